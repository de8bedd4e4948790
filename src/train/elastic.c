/*
 * elastic.c - in-place recovery for a trainer's loop (chorus_elastic_*, see
 * chorus_train.h): what to keep so that the survivors of a death go on from
 * memory, the recovery itself, and taking newcomers in.
 *
 * DDP (shard 0): every rank holds the whole state; each keeps a copy of it
 * as of the start of the last two steps.  A recovery agrees on the first
 * step not every survivor finished (they are at most one apart), goes back
 * to it and moves DDP to the survivors' communicator.
 *
 * Sharded (stages 1-3): rank r's shard (master slices and optimizer state,
 * A arrays of `shard` floats: masters, m, and v for AdamW) exists only on
 * r, so a buddy keeps a replica.  Ranks are put in host order and rank r's
 * holder is the one `shift` places further (shift: the largest number of
 * ranks on one host), so the replica is on another host whenever there is
 * one.  Every K steps, at the start of the step (a "replica point" s):
 *   - r sends its live shard to its holder (one message per slice, then
 *     the optimizer arrays, tag REPLICA_TAG) and receives its buddy's into
 *     `incoming`: the transfers run under the forward and backward;
 *   - when the gradients are in (trainer hook REDUCED), it waits for them:
 *     the live shard must not change while it is being sent;
 *   - after the step's last collective (hook UPDATE; the update follows)
 *     it commits: `own` = its live shard (still as at s), `incoming`
 *     becomes `replica`, committed = s.
 * A rank that commits s has finished a collective every rank entered after
 * waiting for its transfers, so once anyone committed s every replica of s
 * is complete.  A rank that has not committed s has not updated either:
 * its live shard is still s's.  So after a death the survivors can go back
 * to s when each can produce its own shard at s (committed s, or live at s)
 * and each dead rank's holder survived and holds its shard at s (committed,
 * or received complete); else to the previous replica point, where every
 * survivor's `own` and every holder's `replica` still are (nobody
 * committed s).  If neither works (a rank and its holder both died), the
 * model is no longer in memory: reload from disk (cfg.reload).
 *
 * Re-sharding for a new world of M ranks (after a death or a growth): the
 * old shard of each old rank o is supplied by o when it lives, else by its
 * holder; every new rank j needs, of each unit, the floats of its new slice.
 * Both ends compute the same list of pieces (array, unit, old rank, range)
 * in the same order, so one all_to_allv carries them without headers.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "runtime.h"

enum { REPLICA_TAG = 0x52455000 };

/* Where the world stood at the start of a step (the same on every rank). */
typedef struct {
  int64_t step; /* -1: none */
  int64_t epoch, taken;
  int64_t opt_t; /* the optimizer's step count */
  float scale;
  int32_t good, skipped;
  int32_t world; /* the world the shards were laid out for */
} meta_t;

/* Shard geometry of a world of n ranks: unit i's slice is s[i] floats at
 * soff[i] of the shard. */
typedef struct {
  int n, nu;
  size_t shard;
  size_t *count, *s, *soff;
} layout_t;

struct chorus_elastic {
  chorus_trainer_t *t;
  chorus_loader_t *ld;
  chorus_comm_t comm;
  chorus_elastic_config_t cfg;
  int sharded, A;
  size_t np, optim_bytes;
  long cur;    /* the step begun last */
  int applied; /* its update was applied here */
  /* DDP: the state at the start of the last two steps. */
  struct {
    long step;
    float *params;
    unsigned char *optim;
    meta_t meta;
  } snap[2];
  /* Sharded: copies in the layout of lay (the world they were made in). */
  layout_t lay;
  int rank;          /* in that world */
  int *holder_of;    /* lay.n entries: who keeps rank o's replica */
  int buddy, holder; /* whose replica this rank keeps; who keeps its */
  float *own, *replica, *incoming; /* A * lay.shard floats each */
  meta_t committed;                /* own and replica: the start of this step */
  meta_t pending;                  /* a replica point begun, not committed */
  int incoming_ok;                 /* its transfers into `incoming` completed */
  chorus_work_t *works;
  int nworks, nsends;
  long next_point;
  chorus_elastic_stats_t st; /* buddy, holder: see chorus_elastic_get_stats */
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int my_rank(const chorus_elastic_t *e) { return chorus_comm_rank(e->comm); }

/* ------------------------------------------------------------- layouts */

static void layout_free(layout_t *L) {
  free(L->count), free(L->s), free(L->soff);
  memset(L, 0, sizeof *L);
}

static int layout_make(layout_t *L, const chorus_gpt_t *m, int n) {
  memset(L, 0, sizeof *L);
  L->n = n;
  L->nu = chorus_gpt_num_units(m);
  L->count = calloc((size_t)L->nu, sizeof *L->count);
  L->s = calloc((size_t)L->nu, sizeof *L->s);
  L->soff = calloc((size_t)L->nu, sizeof *L->soff);
  if (!L->count || !L->s || !L->soff) {
    layout_free(L);
    return -1;
  }
  for (int i = 0; i < L->nu; i++) {
    L->count[i] = chorus_gpt_unit(m, i)->size;
    L->s[i] = chorus__slice(L->count[i], n, 0, NULL, NULL);
    L->soff[i] = L->shard;
    L->shard += L->s[i];
  }
  return 0;
}

/* ---------------------------------------------------- the live shard */

static void live_meta(chorus_elastic_t *e, long step, meta_t *m) {
  chorus_loss_scale_t ls;
  chorus_trainer_get_loss_scale(e->t, &ls);
  long *t;
  float *mm, *vv;
  size_t n;
  chorus__optim_raw(chorus_trainer_optim(e->t), &t, &mm, &vv, &n);
  *m = (meta_t){step, chorus_loader_epoch(e->ld), (int64_t)chorus_loader_taken(e->ld), *t,
                ls.scale, ls.good_steps, ls.skipped_steps, chorus_comm_size(e->comm)};
}

/* The live shard's array a, unit i (a = 0: the master slice). */
static float *live_at(chorus_elastic_t *e, int a, int i, size_t *n) {
  chorus_fsdp_t *f = chorus_trainer_fsdp(e->t);
  float *p, *g, *m, *v;
  size_t so, k;
  long *t;
  chorus_fsdp_slice(f, i, &p, &g, n, &so);
  if (a == 0) return p;
  chorus__optim_raw(chorus_trainer_optim(e->t), &t, &m, &v, &k);
  return (a == 1 ? m : v) + so;
}

static void live_copy(chorus_elastic_t *e, float *dst) {
  const layout_t *L = &e->lay;
  for (int a = 0; a < e->A; a++)
    for (int i = 0; i < L->nu; i++) {
      size_t n;
      const float *src = live_at(e, a, i, &n);
      memcpy(dst + (size_t)a * L->shard + L->soff[i], src, n * sizeof(float));
    }
}

/* ------------------------------------------------------------ replicas */

/* Waits for the replica transfers in flight (all of them, even after one
 * failed: their buffers must not be reused before); incoming_ok says
 * whether the receives all completed. */
static chorus_result_t drain(chorus_elastic_t *e) {
  chorus_result_t first = CHORUS_OK;
  int recv_ok = e->nworks > 0;
  for (int i = 0; i < e->nworks; i++) {
    chorus_result_t st = chorus_work_wait(e->works[i], -1);
    if (st != CHORUS_OK) {
      if (first == CHORUS_OK) {
        first = st;
        chorus__train_fail(st, "chorus_elastic: rank %d: the replica %s rank %d: %s", my_rank(e),
                           i < e->nsends ? "sent to" : "received from",
                           i < e->nsends ? e->holder : e->buddy, chorus_work_error(e->works[i]));
      }
      if (i >= e->nsends) recv_ok = 0;
    }
    chorus_work_free(e->works[i]);
  }
  if (e->nworks) e->incoming_ok = recv_ok;
  e->nworks = e->nsends = 0;
  return first;
}

/* Starts the transfers of a replica point: the live shard to the holder,
 * the buddy's into `incoming`. */
static chorus_result_t upkeep_start(chorus_elastic_t *e) {
  const layout_t *L = &e->lay;
  chorus_result_t st = CHORUS_OK;
  e->incoming_ok = 0;
  for (int a = 0; a < e->A && st == CHORUS_OK; a++)
    for (int i = 0; i < L->nu && st == CHORUS_OK; i++) {
      size_t n;
      const float *src = live_at(e, a, i, &n);
      st = chorus_send(e->comm, src, n, CHORUS_FLOAT32, e->holder, REPLICA_TAG,
                       &e->works[e->nworks]);
      if (st == CHORUS_OK) e->nworks++, e->nsends++, e->st.upkeep_bytes += n * sizeof(float);
    }
  for (int a = 0; a < e->A && st == CHORUS_OK; a++)
    for (int i = 0; i < L->nu && st == CHORUS_OK; i++) {
      float *dst = e->incoming + (size_t)a * L->shard + L->soff[i];
      st = chorus_recv(e->comm, dst, L->s[i], CHORUS_FLOAT32, e->buddy, REPLICA_TAG,
                       &e->works[e->nworks]);
      if (st == CHORUS_OK) e->nworks++;
    }
  if (st != CHORUS_OK)
    chorus__train_fail(st, "chorus_elastic: rank %d: starting the replica transfers: %s",
                       my_rank(e), chorus_comm_last_error(e->comm));
  return st;
}

/* The pending replica point becomes the committed one: own = the live
 * shard (still as at that point: the update has not run), and the buddy's
 * incoming copy, when whole, the replica. */
static void commit(chorus_elastic_t *e) {
  live_copy(e, e->own);
  if (e->incoming_ok) {
    float *x = e->replica;
    e->replica = e->incoming;
    e->incoming = x;
  }
  e->committed = e->pending;
  e->pending.step = -1;
  e->incoming_ok = 0;
  e->st.replica_step = e->committed.step;
}

static chorus_result_t on_step(void *arg, int when) {
  chorus_elastic_t *e = arg;
  if (when == CHORUS__HOOK_FORWARD) {
    /* The replica point's transfers start under the backward: at the
     * step's start they would hold up the forward's first gathers on the
     * same links. */
    if (!e->sharded || e->pending.step != e->cur || e->nworks || e->incoming_ok)
      return CHORUS_OK;
    return upkeep_start(e);
  }
  if (when == CHORUS__HOOK_UPDATE) {
    e->applied = 1;
    if (!e->sharded || e->pending.step != e->cur || !e->incoming_ok) return CHORUS_OK;
    int64_t t0 = now_ns();
    commit(e);
    e->st.upkeep_copy_s += (double)(now_ns() - t0) / 1e9;
    return CHORUS_OK;
  }
  if (!e->sharded || e->pending.step != e->cur || e->incoming_ok) return CHORUS_OK;
  int64_t t0 = now_ns();
  /* (A step without a forward of its own has not started them.) */
  chorus_result_t st = e->nworks ? CHORUS_OK : upkeep_start(e);
  if (st == CHORUS_OK) st = drain(e);
  e->st.upkeep_wait_s += (double)(now_ns() - t0) / 1e9;
  return st;
}

/* Buffers for the copies of layout L (A arrays each); 0 or -1. */
static int alloc_copies(chorus_elastic_t *e) {
  const size_t n = (size_t)e->A * e->lay.shard * sizeof(float) + 1;
  free(e->own), free(e->replica), free(e->incoming), free(e->holder_of), free(e->works);
  e->own = calloc(1, n);
  e->replica = calloc(1, n);
  e->incoming = calloc(1, n);
  e->holder_of = calloc((size_t)e->lay.n, sizeof *e->holder_of);
  e->works = calloc((size_t)(2 * e->A * e->lay.nu + 1), sizeof *e->works);
  if (!e->own || !e->replica || !e->incoming || !e->holder_of || !e->works) return -1;
  e->st.replica_bytes = e->st.staging_bytes = e->st.snapshot_bytes = n - 1;
  return 0;
}

/* Pairs the ranks of the current world (host order, see the top) and makes
 * the first replicas of step: own = the live shard, the buddy's sent now
 * and waited for.  A collective. */
static chorus_result_t replicas_make(chorus_elastic_t *e, long step) {
  chorus_comm_t c = e->comm;
  const int n = chorus_comm_size(c), me = chorus_comm_rank(c);
  layout_free(&e->lay);
  if (layout_make(&e->lay, chorus_trainer_model(e->t), n) != 0 || alloc_copies(e) != 0)
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                              "chorus_elastic: rank %d: out of memory for the "
                              "replicas (%zu bytes each)",
                              me, (size_t)e->A * e->lay.shard * 4);
  e->rank = me;
  /* The host of each rank: the lowest rank on it. */
  int32_t lead = me, *leads = calloc((size_t)n, sizeof *leads);
  int *order = calloc((size_t)n, sizeof *order);
  if (!leads || !order) {
    free(leads), free(order);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
  }
  for (int p = 0; p < me; p++)
    if (chorus_comm_same_host(c, p) == 1) {
      lead = p;
      break;
    }
  chorus_result_t st = chorus_all_gather(c, &lead, leads, 1, CHORUS_INT32, NULL);
  if (st != CHORUS_OK) {
    free(leads), free(order);
    return chorus__train_fail(st, "chorus_elastic: rank %d: the host map: %s", me,
                              chorus_comm_last_error(c));
  }
  /* Ranks in host order (hosts by their lowest rank), and the largest
   * number on one host. */
  int k = 0, shift = 1;
  for (int h = 0; h < n; h++) {
    int on = 0;
    for (int r = 0; r < n; r++)
      if (leads[r] == h) order[k++] = r, on++;
    shift = on > shift ? on : shift;
  }
  if (shift >= n) shift = 1;
  for (int p = 0; p < n; p++) {
    int o = order[p], h = order[(p + shift) % n];
    e->holder_of[o] = h;
    if (o == me) e->holder = h;
    if (h == me) e->buddy = o;
  }
  e->st.buddy_same_host = n > 1 && leads[e->holder] == leads[me];
  free(leads), free(order);
  /* The first copies, at once. */
  e->cur = step;
  live_meta(e, step, &e->pending);
  if ((st = upkeep_start(e)) == CHORUS_OK) st = drain(e);
  if (st != CHORUS_OK) return st;
  commit(e);
  e->next_point = step + e->cfg.replica_every;
  return CHORUS_OK;
}

/* ----------------------------------------------------------- re-sharding */

/* The pieces between one supplier and one receiver, in the order both
 * walk: for each array, unit and old rank o the supplier supplies, the
 * floats of o's old slice in the receiver's new slice.  fn(arg, a, i, o,
 * lo, hi) for each non-empty one. */
typedef void (*piece_fn)(void *arg, int a, int i, int o, size_t lo, size_t hi);

static void walk(const layout_t *old, const layout_t *nw, int A, const int *supplier,
                 int from, int to, piece_fn fn, void *arg) {
  for (int a = 0; a < A; a++)
    for (int i = 0; i < nw->nu; i++) {
      size_t nlo, nhi;
      chorus__slice(nw->count[i], nw->n, to, &nlo, &nhi);
      for (int o = 0; o < old->n; o++) {
        if (supplier[o] != from) continue;
        size_t olo, ohi;
        chorus__slice(old->count[i], old->n, o, &olo, &ohi);
        size_t lo = olo > nlo ? olo : nlo, hi = ohi < nhi ? ohi : nhi;
        if (lo < hi) fn(arg, a, i, o, lo, hi);
      }
    }
}

typedef struct {
  const layout_t *old, *nw;
  size_t n;      /* floats so far */
  float *buf;    /* NULL: count only */
  const float *const *src; /* old rank -> its old shard here (NULL: not here) */
  float *const *dst;       /* array -> this rank's new shard array (masters: NULL, see live) */
  chorus_elastic_t *e;
  int me;        /* new rank (receiving) */
} pack_t;

static void count_piece(void *arg, int a, int i, int o, size_t lo, size_t hi) {
  (void)a, (void)i, (void)o;
  ((pack_t *)arg)->n += hi - lo;
}

static void pack_piece(void *arg, int a, int i, int o, size_t lo, size_t hi) {
  pack_t *p = arg;
  const float *src = p->src[o] + (size_t)a * p->old->shard + p->old->soff[i] +
                     (lo - (size_t)o * p->old->s[i]);
  memcpy(p->buf + p->n, src, (hi - lo) * sizeof(float));
  p->n += hi - lo;
}

static void unpack_piece(void *arg, int a, int i, int o, size_t lo, size_t hi) {
  (void)o;
  pack_t *p = arg;
  size_t n;
  float *dst = live_at(p->e, a, i, &n) + (lo - (size_t)p->me * p->nw->s[i]);
  memcpy(dst, p->buf + p->n, (hi - lo) * sizeof(float));
  p->n += hi - lo;
}

/* The trainer (already re-sharded over the current world) gets its new
 * shard: the old world's shards (layout old) come from supplier[o] (a rank
 * of the current world), which has them at src[o].  Then the meta: data
 * position, loss scale, optimizer count.  A collective. */
static chorus_result_t reshard(chorus_elastic_t *e, const layout_t *old, const int *supplier,
                               const float *const *src, const meta_t *m) {
  chorus_comm_t c = e->comm;
  const int n = chorus_comm_size(c), me = chorus_comm_rank(c);
  layout_t nw;
  if (layout_make(&nw, chorus_trainer_model(e->t), n) != 0)
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
  size_t *sc = calloc((size_t)n, sizeof *sc), *sd = calloc((size_t)n, sizeof *sd);
  size_t *rc = calloc((size_t)n, sizeof *rc), *rd = calloc((size_t)n, sizeof *rd);
  chorus_result_t st = CHORUS_ERR_NO_MEMORY;
  float *sbuf = NULL, *rbuf = NULL;
  if (!sc || !sd || !rc || !rd) goto out;
  size_t stot = 0, rtot = 0;
  for (int j = 0; j < n; j++) {
    pack_t p = {old, &nw, 0, NULL, src, NULL, e, j};
    walk(old, &nw, e->A, supplier, me, j, count_piece, &p);
    sd[j] = stot, sc[j] = p.n, stot += p.n;
    p.n = 0;
    walk(old, &nw, e->A, supplier, j, me, count_piece, &p);
    rd[j] = rtot, rc[j] = p.n, rtot += p.n;
  }
  sbuf = malloc(stot * sizeof(float) + 1);
  rbuf = malloc(rtot * sizeof(float) + 1);
  if (!sbuf || !rbuf) goto out;
  for (int j = 0; j < n; j++) {
    pack_t p = {old, &nw, sd[j], sbuf, src, NULL, e, j};
    walk(old, &nw, e->A, supplier, me, j, pack_piece, &p);
  }
  st = chorus_all_to_allv(c, sbuf, sc, sd, rbuf, rc, rd, CHORUS_FLOAT32, NULL);
  if (st != CHORUS_OK) {
    chorus__train_fail(st, "chorus_elastic: rank %d: moving the shards: %s", me,
                       chorus_comm_last_error(c));
    goto out;
  }
  for (int j = 0; j < n; j++) {
    pack_t p = {old, &nw, rd[j], rbuf, src, NULL, e, me};
    walk(old, &nw, e->A, supplier, j, me, unpack_piece, &p);
  }
  long *t;
  float *mm, *vv;
  size_t k;
  chorus__optim_raw(chorus_trainer_optim(e->t), &t, &mm, &vv, &k);
  *t = (long)m->opt_t;
  chorus_loss_scale_t ls = {m->scale, m->good, m->skipped};
  chorus_trainer_set_loss_scale(e->t, &ls);
  if ((st = chorus_trainer_weights_changed(e->t)) != CHORUS_OK) goto out;
  if (chorus_loader_reshard(e->ld, n, me) != CHORUS_OK ||
      chorus_loader_seek(e->ld, (long)m->epoch, (size_t)m->taken) != CHORUS_OK)
    st = CHORUS_ERR_INVALID_ARG; /* the loader said why */
out:
  if (st == CHORUS_ERR_NO_MEMORY)
    chorus__train_fail(st, "chorus_elastic: rank %d: out of memory moving the shards", me);
  free(sbuf), free(rbuf), free(sc), free(sd), free(rc), free(rd);
  layout_free(&nw);
  return st;
}

/* ------------------------------------------------------------------ DDP */

static void snap_take(chorus_elastic_t *e, long step) {
  __typeof__(e->snap[0]) *s = &e->snap[step & 1];
  memcpy(s->params, chorus_trainer_master(e->t), e->np * sizeof(float));
  chorus_optim_state_save(chorus_trainer_optim(e->t), s->optim);
  live_meta(e, step, &s->meta);
  s->step = step;
}

static chorus_result_t place_data(chorus_elastic_t *e, const meta_t *m) {
  if (chorus_loader_reshard(e->ld, chorus_comm_size(e->comm), my_rank(e)) != CHORUS_OK ||
      chorus_loader_seek(e->ld, (long)m->epoch, (size_t)m->taken) != CHORUS_OK)
    return CHORUS_ERR_INVALID_ARG; /* the loader said why */
  chorus_loss_scale_t ls = {m->scale, m->good, m->skipped};
  chorus_trainer_set_loss_scale(e->t, &ls);
  return CHORUS_OK;
}

static chorus_result_t snap_restore(chorus_elastic_t *e, long step) {
  const __typeof__(e->snap[0]) *s = &e->snap[step & 1];
  if (s->step != step)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_elastic: rank %d: cannot go back to the start "
                              "of step %ld (kept: steps %ld and %ld)",
                              my_rank(e), step, e->snap[0].step, e->snap[1].step);
  if (chorus_trainer_load_weights(e->t, s->params) != CHORUS_OK ||
      chorus_optim_state_load(chorus_trainer_optim(e->t), s->optim, e->optim_bytes) != CHORUS_OK)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_elastic: rank %d: the snapshot does not load", my_rank(e));
  return place_data(e, &s->meta);
}

static void say(chorus_elastic_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ----------------------------------------------------------------- API */

chorus_result_t chorus_elastic_create(chorus_trainer_t *t, chorus_loader_t *ld,
                                      const chorus_elastic_config_t *cfg,
                                      chorus_elastic_t **out) {
  static const chorus_elastic_config_t defaults = CHORUS_ELASTIC_CONFIG_DEFAULT;
  if (!out || !t || !ld)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_elastic_create: NULL argument");
  *out = NULL;
  chorus_comm_t comm = chorus_trainer_comm(t);
  if (!comm)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_elastic_create: the trainer has no "
                              "communicator");
  chorus_elastic_t *e = calloc(1, sizeof *e);
  if (!e) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic_create: out of memory");
  e->t = t;
  e->ld = ld;
  e->comm = comm;
  e->cfg = cfg ? *cfg : defaults;
  if (e->cfg.replica_every < 1) e->cfg.replica_every = 1;
  if (e->cfg.attempts < 1) e->cfg.attempts = 1;
  if (e->cfg.grow_timeout_ms <= 0) e->cfg.grow_timeout_ms = 10000;
  e->sharded = chorus_trainer_shard(t) > 0;
  e->np = chorus_gpt_num_params(chorus_trainer_model(t));
  e->optim_bytes = chorus_optim_state_size(chorus_trainer_optim(t));
  {
    long *tt;
    float *m, *v;
    size_t n;
    chorus__optim_raw(chorus_trainer_optim(t), &tt, &m, &v, &n);
    e->A = v ? 3 : 2;
  }
  e->cur = -1;
  e->committed.step = e->pending.step = -1;
  e->st.replica_step = -1;
  chorus_result_t st = CHORUS_OK;
  if (!e->sharded) {
    for (int k = 0; k < 2; k++) {
      e->snap[k].step = -1;
      e->snap[k].params = malloc(e->np * sizeof(float));
      e->snap[k].optim = malloc(e->optim_bytes ? e->optim_bytes : 1);
      if (!e->snap[k].params || !e->snap[k].optim) st = CHORUS_ERR_NO_MEMORY;
    }
    e->st.snapshot_bytes = 2 * (e->np * sizeof(float) + e->optim_bytes);
    if (st != CHORUS_OK)
      chorus__train_fail(st, "chorus_elastic_create: out of memory for the snapshots");
  }
  if (st != CHORUS_OK) {
    chorus_elastic_destroy(e);
    return st;
  }
  chorus__trainer_set_hook(t, on_step, e);
  *out = e;
  return CHORUS_OK;
}

void chorus_elastic_destroy(chorus_elastic_t *e) {
  if (!e) return;
  drain(e);
  chorus__trainer_set_hook(e->t, NULL, NULL);
  for (int k = 0; k < 2; k++) free(e->snap[k].params), free(e->snap[k].optim);
  free(e->own), free(e->replica), free(e->incoming), free(e->holder_of), free(e->works);
  layout_free(&e->lay);
  free(e);
}

chorus_comm_t chorus_elastic_comm(const chorus_elastic_t *e) { return e->comm; }

void chorus_elastic_get_stats(const chorus_elastic_t *e, chorus_elastic_stats_t *s) {
  *s = e->st;
  s->buddy = e->own ? e->buddy : -1;
  s->holder = e->own ? e->holder : -1;
  if (!e->sharded) s->replica_bytes = s->staging_bytes = 0;
}

/* Growth: after the members moved the trainer to the grown communicator,
 * every rank (members and newcomers) takes the state rank 0 sends: the
 * meta (a member's `mine`, taken before the trainer moved; NULL on a
 * newcomer), then the optimizer state (DDP; making DDP broadcast the
 * weights) or the shards (re-sharded from the members' own copies). */
static chorus_result_t hand_over(chorus_elastic_t *e, long *step, const meta_t *mine) {
  chorus_comm_t c = e->comm;
  const int me = chorus_comm_rank(c), member = mine != NULL;
  meta_t m = {0};
  if (me == 0 && mine) m = *mine;
  chorus_result_t st = chorus_broadcast(c, &m, sizeof m, CHORUS_UINT8, 0, NULL);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_elastic: rank %d: the hand-over: %s", me,
                              chorus_comm_last_error(c));
  if (m.step < 0 || m.epoch < 0 || m.taken < 0 || m.opt_t < 0 || m.world < 1 ||
      m.world > chorus_comm_size(c))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_elastic: rank %d: a malformed hand-over "
                              "(step %lld, world %d)",
                              me, (long long)m.step, (int)m.world);
  *step = (long)m.step;
  if (!e->sharded) {
    unsigned char *optim = malloc(e->optim_bytes ? e->optim_bytes : 1);
    if (!optim) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
    if (me == 0) chorus_optim_state_save(chorus_trainer_optim(e->t), optim);
    st = chorus_broadcast(c, optim, e->optim_bytes, CHORUS_UINT8, 0, NULL);
    if (st == CHORUS_OK &&
        chorus_optim_state_load(chorus_trainer_optim(e->t), optim, e->optim_bytes) != CHORUS_OK)
      st =
          chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_elastic: a malformed optimizer state");
    free(optim);
    if (st == CHORUS_OK) st = place_data(e, &m);
    return st;
  }
  /* The members' old shards (in own: copied before the trainer moved),
   * each supplied by the member of that rank (members keep their ranks). */
  layout_t old;
  if (layout_make(&old, chorus_trainer_model(e->t), (int)m.world) != 0)
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
  int *supplier = calloc((size_t)m.world, sizeof *supplier);
  const float **src = calloc((size_t)m.world, sizeof *src);
  if (!supplier || !src) {
    free(supplier), free(src), layout_free(&old);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
  }
  for (int o = 0; o < m.world; o++) supplier[o] = o;
  if (member) src[me] = e->own;
  st = reshard(e, &old, supplier, src, &m);
  free(supplier), free(src), layout_free(&old);
  if (st == CHORUS_OK) st = replicas_make(e, *step);
  return st;
}

/* At the start of a step: newcomers waiting are taken in.  1: grown (the
 * step may have changed), 0: nobody waited, or an error. */
static chorus_result_t admit(chorus_elastic_t *e, long *step, int *grown_out) {
  *grown_out = 0;
  int waiting = 0;
  chorus_result_t st = chorus_comm_joiners(e->comm, &waiting);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_elastic: rank %d: looking for new ranks: %s", my_rank(e),
                              chorus_comm_last_error(e->comm));
  if (!waiting) return CHORUS_OK;
  int64_t t0 = now_ns();
  chorus_comm_t grown = NULL;
  st = chorus_comm_grow(e->comm, e->cfg.grow_timeout_ms, &grown);
  if (st != CHORUS_OK)
    fprintf(stderr, "chorus_elastic: rank %d: could not take in %d new rank(s): %s\n",
            my_rank(e), waiting, chorus_comm_last_error(e->comm));
  /* Every member moves to the grown world, or none does (a newcomer that
   * died half-way may leave it formed on some members only). */
  int32_t ok = st == CHORUS_OK && grown, all = 0;
  chorus_result_t vs = chorus_all_reduce(e->comm, &ok, &all, 1, CHORUS_INT32, CHORUS_MIN, NULL);
  if (vs != CHORUS_OK || !all) {
    chorus_comm_destroy(grown);
    if (vs != CHORUS_OK)
      return chorus__train_fail(vs, "chorus_elastic: rank %d: the vote on new ranks: %s",
                                my_rank(e), chorus_comm_last_error(e->comm));
    return CHORUS_OK;
  }
  const int before = chorus_comm_size(e->comm);
  meta_t m;
  live_meta(e, *step, &m); /* before the optimizer is made again */
  if (e->sharded) {
    m.world = e->lay.n;
    /* own takes the shard as at this step, in the old layout; the replica
     * no longer pairs with it.  Until the new world's replicas exist a
     * death can only be recovered from disk: no copy is claimed. */
    e->committed.step = e->pending.step = -1;
    live_copy(e, e->own);
    st = chorus__trainer_reshard(e->t, grown);
  } else {
    st = chorus_trainer_set_comm(e->t, grown);
  }
  chorus_comm_destroy(e->comm);
  e->comm = grown;
  if (st == CHORUS_OK) st = hand_over(e, step, &m);
  if (st != CHORUS_OK) return st;
  e->st.grows++;
  *grown_out = 1;
  say(e, "elastic: %d new rank(s) joined at step %ld: %d rank(s) now, %s (took %.0f ms)",
      chorus_comm_size(grown) - before, *step, chorus_comm_size(grown),
      e->sharded ? "the model re-sharded over them" : "the data re-sharded",
      (now_ns() - t0) / 1e6);
  return CHORUS_OK;
}

chorus_result_t chorus_elastic_join(chorus_elastic_t *e, long *step) {
  *step = 0;
  chorus_result_t st = hand_over(e, step, NULL);
  if (st == CHORUS_OK) e->cur = *step;
  return st;
}

chorus_result_t chorus_elastic_begin_step(chorus_elastic_t *e, long *step) {
  int grown = 0;
  chorus_result_t st;
  /* After a grow, every rank (the newcomers too) looks again.  What a
   * recovery needs is in place before the check, which can fail too: no
   * update applied yet, and under DDP the snapshot of this step. */
  do {
    e->cur = *step;
    e->applied = 0;
    if (!e->sharded) snap_take(e, *step);
    if ((st = admit(e, step, &grown)) != CHORUS_OK) return st;
  } while (grown);
  if (!e->sharded) return CHORUS_OK;
  if (!e->own) return replicas_make(e, *step);
  e->st.upkeep_wait_s = e->st.upkeep_copy_s = 0;
  e->st.upkeep_bytes = 0;
  if (*step >= e->next_point) {
    /* A replica point: the state now is what the copies will hold; the
     * transfers start once the forward is done (hook FORWARD). */
    e->next_point = *step + e->cfg.replica_every;
    live_meta(e, *step, &e->pending);
    e->incoming_ok = 0;
  }
  return CHORUS_OK;
}

/* What each survivor says in a sharded recovery. */
enum { I_OLD, I_COMMITTED, I_LIVE, I_INCOMING_OK, I_N };

/* The step to go back to from the survivors' words (info: I_N per
 * survivor), or -1 with why. */
static long choose(const chorus_elastic_t *e, const int64_t *info, int m, char *why, size_t cap) {
  const int n = e->lay.n;
  int *at = malloc((size_t)n * sizeof *at); /* old rank -> survivor index, or -1 */
  if (!at) {
    snprintf(why, cap, "out of memory");
    return -1;
  }
  for (int o = 0; o < n; o++) at[o] = -1;
  for (int x = 0; x < m; x++) {
    int64_t o = info[x * I_N + I_OLD];
    if (o < 0 || o >= n || at[o] >= 0) {
      snprintf(why, cap, "survivor %d says it was rank %lld of %d (malformed or twice)", x,
               (long long)o, n);
      free(at);
      return -1;
    }
    at[o] = x;
  }
  long best = -1;
  snprintf(why, cap, "no copies of the shards exist yet (a growth or a recovery was under way)");
  /* Every step someone can produce, newest first. */
  long cands[64];
  int nc = 0;
  for (int x = 0; x < m; x++)
    for (int k = I_COMMITTED; k <= I_LIVE; k++) {
      long v = (long)info[x * I_N + k];
      int dup = v < 0;
      for (int c = 0; c < nc && !dup; c++) dup = cands[c] == v;
      if (!dup && nc < 64) cands[nc++] = v;
    }
  for (int a = 0; a < nc; a++)
    for (int b = a + 1; b < nc; b++)
      if (cands[b] > cands[a]) {
        long x = cands[a];
        cands[a] = cands[b], cands[b] = x;
      }
  for (int c = 0; c < nc && best < 0; c++) {
    const long R = cands[c];
    int ok = 1;
    for (int x = 0; x < m && ok; x++)
      if (info[x * I_N + I_COMMITTED] != R && info[x * I_N + I_LIVE] != R) {
        ok = 0;
        snprintf(why, cap, "rank %lld no longer holds its shard as of step %ld",
                 (long long)info[x * I_N + I_OLD], R);
      }
    for (int d = 0; d < n && ok; d++) {
      if (at[d] >= 0) continue;
      const int h = e->holder_of[d];
      if (h == d || at[h] < 0) {
        ok = 0;
        snprintf(why, cap, "rank %d and rank %d, which kept rank %d's replica, are both gone",
                 d, h, d);
        break;
      }
      const int64_t *hi = info + (size_t)at[h] * I_N;
      if (hi[I_COMMITTED] != R && !(hi[I_LIVE] == R && hi[I_INCOMING_OK])) {
        ok = 0;
        snprintf(why, cap, "rank %d's replica on rank %d is not of step %ld (the copy was "
                 "being made when it died)", d, h, R);
      }
    }
    if (ok) best = R;
  }
  free(at);
  return best;
}

static void say(chorus_elastic_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(chorus_elastic_t *e, const char *fmt, ...) {
  if (!e->cfg.log || my_rank(e) != 0) return;
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  e->cfg.log(e->cfg.log_arg, line);
}

/* The model is no longer in memory: the trainer moves to the survivors and
 * the program's reload puts the last checkpoint in it. */
static chorus_result_t reload(chorus_elastic_t *e, const char *why, long *step) {
  if (!e->cfg.reload)
    return chorus__train_fail(CHORUS_ERR_REMOTE,
                              "chorus_elastic: rank %d: cannot go on from memory: %s; "
                              "restart from the last checkpoint",
                              my_rank(e), why);
  say(e, "elastic: the model is no longer in memory (%s): going on from the last checkpoint",
      why);
  chorus_result_t st = e->sharded ? chorus__trainer_reshard(e->t, e->comm)
                                  : chorus_trainer_set_comm(e->t, e->comm);
  if (st == CHORUS_OK) st = e->cfg.reload(e->cfg.reload_arg, step);
  if (st != CHORUS_OK) return st;
  e->st.reloads++;
  e->pending.step = -1;
  if (e->sharded) st = replicas_make(e, *step);
  return st;
}

chorus_result_t chorus_elastic_recover(chorus_elastic_t *e, long *step) {
  int64_t t0 = now_ns();
  const long s = *step;
  const int before = chorus_comm_size(e->comm);
  /* No transfer may still write the copies (and the receives' outcome says
   * whether the incoming copies are whole). */
  if (e->sharded) drain(e);
  /* The communicator the trainer still uses: destroyed once it moved. */
  chorus_comm_t used = e->comm;
  if (!e->sharded) {
    chorus_trainer_set_comm(e->t, NULL);
    /* A rank that applied this step's update has the next one's start. */
    if (e->applied) snap_take(e, s + 1);
  }
  const int64_t done = s + e->applied;
  chorus_result_t st = CHORUS_ERR_REMOTE;
  long to = -1;
  int reloaded = 0, *supplier = NULL, attempt;
  const float **src = NULL;
  for (attempt = 0; attempt < e->cfg.attempts; attempt++) {
    chorus_comm_t next = NULL;
    st = chorus_comm_shrink(e->comm, 0, &next);
    if (st != CHORUS_OK) {
      chorus__train_fail(st, "chorus_elastic: rank %d: cannot go on: chorus_comm_shrink: %s",
                         my_rank(e), chorus_comm_last_error(e->comm));
      break;
    }
    if (e->comm != used || !e->sharded) {
      chorus_comm_destroy(e->comm);
      if (e->comm == used) used = NULL;
    }
    e->comm = next;
    const int me = chorus_comm_rank(next), m = chorus_comm_size(next);
    if (!e->sharded) {
      /* The earliest and the latest step done, in one all_reduce. */
      int64_t mine[2] = {done, -done}, agreed[2];
      st = chorus_all_reduce(next, mine, agreed, 2, CHORUS_INT64, CHORUS_MIN, NULL);
      if (st != CHORUS_OK) continue; /* someone else died: shrink again */
      to = (long)agreed[0];
      if (-agreed[1] - agreed[0] > 1) {
        st = chorus__train_fail(CHORUS_ERR_REMOTE,
                                "chorus_elastic: rank %d: cannot go on: the survivors are "
                                "at steps %lld to %lld, more than one apart",
                                me, (long long)agreed[0], (long long)-agreed[1]);
        break;
      }
      if ((st = snap_restore(e, to)) != CHORUS_OK) break;
      /* DDP's creation broadcasts rank 0's weights: every survivor went
       * back to the same step, so they are the ones it holds already. */
      if ((st = chorus_trainer_set_comm(e->t, next)) != CHORUS_OK) continue;
      break;
    }
    /* Sharded: what each survivor can produce, then the step. */
    int64_t mine[I_N] = {e->rank, e->committed.step, e->pending.step, e->incoming_ok};
    int64_t *info = malloc((size_t)m * I_N * sizeof *info);
    if (!info) {
      st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
      break;
    }
    st = chorus_all_gather(next, mine, info, I_N, CHORUS_INT64, NULL);
    if (st != CHORUS_OK) {
      free(info);
      continue;
    }
    char why[256];
    to = choose(e, info, m, why, sizeof why);
    if (to < 0) {
      free(info);
      st = reload(e, why, &to);
      reloaded = 1;
      if (st == CHORUS_OK && used) chorus_comm_destroy(used);
      used = NULL;
      break;
    }
    /* This rank's shard as of `to`, and its buddy's, into own and replica. */
    if (e->committed.step != to) commit(e);
    e->pending.step = -1;
    const int n = e->lay.n;
    free(supplier), free(src);
    supplier = calloc((size_t)n, sizeof *supplier);
    src = calloc((size_t)n, sizeof *src);
    if (!supplier || !src) {
      free(info);
      st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_elastic: out of memory");
      break;
    }
    for (int o = 0; o < n; o++) supplier[o] = -1;
    for (int x = 0; x < m; x++) /* choose() checked them: 0 <= old < n, once each */
      supplier[info[x * I_N + I_OLD]] = x;
    for (int o = 0; o < n; o++)
      if (supplier[o] < 0) {
        const int h = e->holder_of[o];
        for (int x = 0; x < m; x++)
          if (info[x * I_N + I_OLD] == h) supplier[o] = x;
      }
    free(info);
    src[e->rank] = e->own;
    if (supplier[e->buddy] == me && e->buddy != e->rank) src[e->buddy] = e->replica;
    if ((st = chorus__trainer_reshard(e->t, next)) != CHORUS_OK) continue;
    if (used) chorus_comm_destroy(used);
    used = NULL;
    if ((st = reshard(e, &e->lay, supplier, src, &e->committed)) != CHORUS_OK) continue;
    /* New pairs and replicas for the new world (a death now loses a shard
     * that has no replica yet: the next recovery reloads). */
    st = replicas_make(e, to);
    break;
  }
  free(supplier), free(src);
  if (used && used != e->comm) chorus_comm_destroy(used);
  if (st != CHORUS_OK && attempt == e->cfg.attempts)
    chorus__train_fail(
        st,
        "chorus_elastic: rank %d: cannot go on: ranks kept dying during the recovery "
        "(%d attempts; the last: %s)",
        my_rank(e), attempt, chorus_comm_last_error(e->comm));
  if (st != CHORUS_OK) return st;
  *step = to;
  e->cur = to;
  e->st.recoveries++;
  e->st.last_recovery_s = (double)(now_ns() - t0) / 1e9;
  if (reloaded)
    say(e, "elastic: %d of %d rank(s) go on from step %ld, loaded from the last checkpoint "
        "(recovery took %.0f ms)", chorus_comm_size(e->comm), before, to,
        (now_ns() - t0) / 1e6);
  else
    say(e, "elastic: %d of %d rank(s) go on from step %ld with the %s in memory, %s "
        "(recovery took %.0f ms)", chorus_comm_size(e->comm), before, to,
        e->sharded ? "shards" : "weights",
        e->sharded ? "the model re-sharded from the replicas and the data over the survivors"
                   : "the data re-sharded",
        (now_ns() - t0) / 1e6);
  return CHORUS_OK;
}
