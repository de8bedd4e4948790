/*
 * ps.c - asynchronous data parallel: a parameter server with bounded
 * staleness (chorus_train.h, "asynchronous data parallel").
 *
 * Every message travels on the communicator of one (server, worker) pair,
 * the server being its rank 0: a header (msg_t, bytes, tag TAG_HDR), then
 * `count` float32 on tag TAG_DATA.
 *   worker -> server: HELLO; PUSH {version computed on, count, loss,
 *                     tokens, step} + the gradient of the server's range
 *   server -> worker: PARAMS {version, start step for a HELLO} + the range;
 *                     REFUSED {why} + the range (a stale or non-finite
 *                     gradient: the worker goes on from fresh parameters);
 *                     STOP (the budget is applied); FATAL {why} (a
 *                     malformed message: the server drops the worker).
 *   worker -> server: BYE (another server said STOP: this one's budget
 *                     is as good as full, the worker leaves).
 *
 * On a server one thread per worker receives that worker's messages and
 * answers them, one writes checkpoints, and the caller's thread waits for
 * them and watches the other servers.  One mutex guards the server's
 * state; a worker's gradient is received into its own buffer outside it
 * and only added to the sum under it.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/ckpt.h"

chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define fail chorus__train_fail

#define PS_MAGIC 0x31737063u /* "cps1" */
#define CK_EXTRA_MAGIC 0x31736370736f6863ull
enum { TAG_HDR = 1, TAG_DATA = 2 };
enum { M_HELLO = 1, M_PUSH, M_PARAMS, M_REFUSED, M_STOP, M_FATAL, M_BYE };
enum { W_NEW, W_COMPUTING, W_WAITING, W_GONE };

typedef struct {
  uint32_t magic, kind;
  int64_t version;   /* PUSH: of the parameters it was computed on; replies: of those sent */
  uint64_t count;    /* floats that follow */
  int64_t step;      /* PUSH: the worker's step; PARAMS for a HELLO: the step to start at */
  int64_t staleness; /* replies to a PUSH: the gradient's */
  float loss;
  uint32_t tokens;
  char text[216];    /* REFUSED, FATAL: why */
} msg_t;

/* What a checkpoint of the servers records besides the range. */
typedef struct {
  uint64_t magic;
  int64_t applied, version;
  int32_t workers, pad;
} ck_extra_t;
#define MAX_CK_WORKERS 65536

typedef struct slot {
  struct chorus_ps *ps;
  int w;
  chorus_comm_t comm;
  pthread_t th;
  int started;
  int state;   /* W_* */
  int64_t u;   /* W_COMPUTING: the version it computes on */
  long pushes; /* its gradients applied, for a resume */
  float *g, *out;
} slot_t;

struct chorus_ps {
  chorus_ps_config_t cfg;
  chorus_comm_t world, servers, *pair; /* pair[w] on a server, pair[s] on a worker */
  int rank, nserv, nwork, me;          /* me: server or worker index */
  int server;
  size_t np, *lo, *cnt; /* every server's range */
  chorus_gpt_t *shape;  /* no storage: the layout, for init and checkpoints */
  /* worker */
  int64_t *ver;
  long wstep; /* the worker's step: start + pushes */
  int fault;
  /* the push under way: its messages, which servers have theirs */
  chorus_work_t *wk;
  msg_t *hd;
  int *sent;
  chorus_result_t early_st; /* a send of chorus_ps_push_early that failed */
  /* server */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int sync_ok;
  float *par, *acc;
  chorus_optim_t *opt;
  int acc_k, hellos, running, failed, byes;
  int64_t version;
  long applied, budget, log_next;
  double log_loss, log_tok, log_stale;
  long log_n, log_smax;
  int64_t t_first, t_last, t_log;
  slot_t *slots;
  long *start_step; /* per worker, from a checkpoint */
  chorus_ps_stats_t st;
  double tail_sum;
  long tail_n;
  /* checkpoint thread */
  pthread_t ck_th;
  int ck_started, ck_quit;
  long ck_crossed, ck_done; /* checkpoint steps passed by the updates; written (or tried) */
  long ck_last;             /* the last step written */
  int ck_count;             /* checkpoints tried: every server tries the same ones */
  float *ck_par;
  unsigned char *ck_blob;
  size_t ck_blob_len;
  chorus_optim_t *ck_opt;
  ck_extra_t ck_x;
  long *ck_pushes;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void say(chorus_ps_t *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(chorus_ps_t *ps, const char *fmt, ...) {
  char line[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (ps->cfg.log) ps->cfg.log(ps->cfg.log_arg, line);
  else fprintf(stderr, "%s\n", line);
}

/* ------------------------------------------------------------ creation */

int chorus_ps_worker(const chorus_ps_t *ps) { return ps && !ps->server ? ps->me : -1; }
int chorus_ps_workers(const chorus_ps_t *ps) { return ps ? ps->nwork : 0; }

void chorus_ps_destroy(chorus_ps_t *ps) {
  if (!ps) return;
  int n = ps->server ? ps->nwork : ps->nserv;
  for (int i = 0; ps->pair && i < n; i++) chorus_comm_destroy(ps->pair[i]);
  chorus_comm_destroy(ps->servers);
  for (int w = 0; ps->slots && w < ps->nwork; w++) free(ps->slots[w].g), free(ps->slots[w].out);
  free(ps->slots);
  free(ps->pair);
  free(ps->lo), free(ps->cnt), free(ps->ver);
  free(ps->wk), free(ps->hd), free(ps->sent);
  free(ps->par), free(ps->acc), free(ps->start_step);
  free(ps->ck_par), free(ps->ck_blob), free(ps->ck_pushes);
  chorus_optim_destroy(ps->opt);
  chorus_optim_destroy(ps->ck_opt);
  chorus_gpt_destroy(ps->shape);
  if (ps->sync_ok) {
    pthread_mutex_destroy(&ps->mu);
    pthread_cond_destroy(&ps->cv);
  }
  free(ps);
}

chorus_result_t chorus_ps_create(chorus_comm_t world, const chorus_gpt_config_t *model,
                                 uint64_t seed, const chorus_ps_config_t *cfg,
                                 chorus_ps_t **out) {
  if (!out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  const int size = world ? chorus_comm_size(world) : 0;
  if (!world || !model || !cfg || cfg->servers < 1 || cfg->servers >= size ||
      cfg->max_staleness < 0 || cfg->steps < 0 || cfg->warmup < 0 || cfg->ckpt_every < 0 ||
      (cfg->ckpt_dir && cfg->keep < 1) || size - cfg->servers > MAX_CK_WORKERS)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_create: bad arguments (%d server(s) of a "
                "world of %d: at least one server and one worker)", cfg ? cfg->servers : 0, size);
  chorus_ps_t *ps = calloc(1, sizeof *ps);
  if (!ps) return fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
  ps->cfg = *cfg;
  ps->world = world;
  ps->rank = chorus_comm_rank(world);
  ps->nserv = cfg->servers;
  ps->nwork = size - cfg->servers;
  ps->server = ps->rank < ps->nserv;
  ps->me = ps->server ? ps->rank : ps->rank - ps->nserv;
  chorus_result_t st = chorus_gpt_create_ex(model, 1, seed, CHORUS_GPT_EXTERNAL, &ps->shape);
  if (st != CHORUS_OK) {
    chorus_ps_destroy(ps);
    return st;
  }
  ps->np = chorus_gpt_num_params(ps->shape);
  ps->lo = calloc((size_t)ps->nserv, sizeof *ps->lo);
  ps->cnt = calloc((size_t)ps->nserv, sizeof *ps->cnt);
  int npair = ps->server ? ps->nwork : ps->nserv;
  ps->pair = calloc((size_t)npair, sizeof *ps->pair);
  if (!ps->lo || !ps->cnt || !ps->pair) {
    chorus_ps_destroy(ps);
    return fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
  }
  for (int s = 0; s < ps->nserv; s++) {
    ps->lo[s] = ps->np * (size_t)s / (size_t)ps->nserv;
    ps->cnt[s] = ps->np * (size_t)(s + 1) / (size_t)ps->nserv - ps->lo[s];
  }
  /* Every rank makes every group in the same order; members get one. */
  int *ranks = malloc(sizeof(int) * (size_t)ps->nserv);
  for (int s = 0; ranks && s < ps->nserv; s++) ranks[s] = s;
  st = ranks ? chorus_comm_new_group(world, ranks, ps->nserv, &ps->servers) : CHORUS_ERR_NO_MEMORY;
  free(ranks);
  for (int s = 0; s < ps->nserv && st == CHORUS_OK; s++)
    for (int w = 0; w < ps->nwork && st == CHORUS_OK; w++) {
      chorus_comm_t c = NULL;
      const int two[2] = {s, ps->nserv + w};
      st = chorus_comm_new_group(world, two, 2, &c);
      if (c) ps->pair[ps->server ? w : s] = c;
    }
  if (st != CHORUS_OK) {
    fail(st, "chorus_ps_create: rank %d: making the servers' and pairs' communicators: %s",
         ps->rank, chorus_comm_last_error(world));
    chorus_ps_destroy(ps);
    return st;
  }
  if (!ps->server) {
    ps->ver = calloc((size_t)ps->nserv, sizeof *ps->ver);
    ps->wk = calloc(2 * (size_t)ps->nserv, sizeof *ps->wk);
    ps->hd = calloc((size_t)ps->nserv, sizeof *ps->hd);
    ps->sent = calloc((size_t)ps->nserv, sizeof *ps->sent);
    if (!ps->ver || !ps->wk || !ps->hd || !ps->sent) {
      chorus_ps_destroy(ps);
      return fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
    }
    *out = ps;
    return CHORUS_OK;
  }
  const size_t n = ps->cnt[ps->me];
  ps->par = malloc(n * sizeof(float) + 1);
  ps->acc = calloc(n + 1, sizeof(float));
  ps->slots = calloc((size_t)ps->nwork, sizeof *ps->slots);
  ps->start_step = calloc((size_t)ps->nwork, sizeof *ps->start_step);
  ps->ck_pushes = calloc((size_t)ps->nwork, sizeof *ps->ck_pushes);
  st = chorus_optim_create(&cfg->optim, n, &ps->opt);
  if (st == CHORUS_OK && cfg->ckpt_dir) {
    st = chorus_optim_create(&cfg->optim, n, &ps->ck_opt);
    ps->ck_blob_len = chorus_optim_state_size(ps->opt);
    ps->ck_par = malloc(n * sizeof(float) + 1);
    ps->ck_blob = malloc(ps->ck_blob_len);
    if (!ps->ck_par || !ps->ck_blob) st = CHORUS_ERR_NO_MEMORY;
  }
  int ok = st == CHORUS_OK && ps->par && ps->acc && ps->slots && ps->start_step && ps->ck_pushes;
  for (int w = 0; ok && w < ps->nwork; w++) {
    slot_t *sl = &ps->slots[w];
    sl->ps = ps;
    sl->w = w;
    sl->comm = ps->pair[w];
    sl->g = malloc(n * sizeof(float) + 1);
    sl->out = malloc(n * sizeof(float) + 1);
    ok = sl->g && sl->out;
  }
  if (!ok || pthread_mutex_init(&ps->mu, NULL) != 0) {
    chorus_ps_destroy(ps);
    return fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: server %d: out of memory for a range of "
                "%zu floats", ps->me, n);
  }
  pthread_condattr_t ca;
  int bad = pthread_condattr_init(&ca) != 0;
  bad = bad || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&ps->cv, &ca) != 0;
  if (!bad) pthread_condattr_destroy(&ca);
  if (bad) {
    pthread_mutex_destroy(&ps->mu);
    chorus_ps_destroy(ps);
    return fail(CHORUS_ERR_SYSTEM, "chorus_ps_create: cannot make a condition variable");
  }
  ps->sync_ok = 1;
  chorus_gpt_init_range(ps->shape, seed, ps->lo[ps->me], n, ps->par);
  ps->budget = cfg->steps * ps->nwork;
  *out = ps;
  return CHORUS_OK;
}

void chorus_ps_inject(chorus_ps_t *ps, int fault) {
  if (ps) ps->fault = fault;
}

void chorus_ps_get_stats(const chorus_ps_t *ps, chorus_ps_stats_t *out) {
  if (!ps || !out) return;
  *out = ps->st;
  out->applied = ps->applied;
  out->updates = ps->version;
  out->seconds = ps->t_last > ps->t_first ? (double)(ps->t_last - ps->t_first) / 1e9 : 0.0;
  out->tail_loss = ps->tail_n ? ps->tail_sum / (double)ps->tail_n : NAN;
}

/* -------------------------------------------------------------- server */

/* Waits on the server's condition for at most until (CLOCK_MONOTONIC ns).
 * 0, or ETIMEDOUT. */
static int wait_until(chorus_ps_t *ps, int64_t until) {
  struct timespec ts = {(time_t)(until / 1000000000), (long)(until % 1000000000)};
  return pthread_cond_timedwait(&ps->cv, &ps->mu, &ts);
}

/* Now plus the pair's timeout. */
static int64_t deadline(const slot_t *sl) {
  int ms = chorus_comm_timeout_ms(sl->comm);
  return now_ns() + (int64_t)(ms > 0 ? ms : 300000) * 1000000;
}

/* The snapshot a checkpoint writes, taken under the lock. */
static void ck_snapshot(chorus_ps_t *ps) {
  memcpy(ps->ck_par, ps->par, ps->cnt[ps->me] * sizeof(float));
  chorus_optim_state_save(ps->opt, ps->ck_blob);
  ps->ck_x = (ck_extra_t){CK_EXTRA_MAGIC, ps->applied, ps->version, ps->nwork, 0};
  for (int w = 0; w < ps->nwork; w++) ps->ck_pushes[w] = ps->slots[w].pushes;
}

/* Writes one checkpoint from the snapshot (no lock held); collective over
 * the servers, which write the same steps in the same order. */
static chorus_result_t ck_write(chorus_ps_t *ps, long step) {
  const size_t xlen = sizeof(ck_extra_t) + sizeof(int64_t) * (size_t)ps->nwork;
  unsigned char *x = malloc(xlen);
  chorus_result_t st = x ? chorus_optim_state_load(ps->ck_opt, ps->ck_blob, ps->ck_blob_len)
                         : CHORUS_ERR_NO_MEMORY;
  ps->ck_count++;
  if (st == CHORUS_OK) {
    memcpy(x, &ps->ck_x, sizeof ps->ck_x);
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p = ps->ck_pushes[w];
      memcpy(x + sizeof ps->ck_x + sizeof p * (size_t)w, &p, sizeof p);
    }
  }
  /* Everyone enters the save (a local failure is part of its agreement). */
  chorus_result_t sv = chorus__ckpt_save_range(ps->servers, ps->shape, ps->ck_opt, ps->ck_par,
                                               ps->lo[ps->me], ps->cnt[ps->me], ps->cfg.ckpt_dir,
                                               step, x ? x : (void *)&ps->ck_x,
                                               x ? xlen : sizeof ps->ck_x, ps->cfg.keep);
  if (st == CHORUS_OK) st = sv;
  free(x);
  if (st != CHORUS_OK)
    say(ps, "async: server %d: checkpoint of step %ld not written: %s", ps->me, step,
        chorus_train_last_error());
  else if (ps->me == 0)
    say(ps, "checkpoint: %s/ckpt-%09ld (%d server file(s) and an index)", ps->cfg.ckpt_dir, step,
        ps->nserv);
  return st;
}

/* Writes every checkpoint step the updates pass, in order and none
 * skipped, so that every server makes the same collective calls; a
 * snapshot is taken when its turn comes (the state then, at or after the
 * step). */
static void *ck_main(void *arg) {
  chorus_ps_t *ps = arg;
  pthread_mutex_lock(&ps->mu);
  for (;;) {
    while (ps->ck_done >= ps->ck_crossed && !ps->ck_quit) pthread_cond_wait(&ps->cv, &ps->mu);
    if (ps->ck_done >= ps->ck_crossed) break;
    const long step = (ps->ck_done + 1) * ps->cfg.ckpt_every;
    ck_snapshot(ps);
    pthread_mutex_unlock(&ps->mu);
    chorus_result_t st = ck_write(ps, step);
    pthread_mutex_lock(&ps->mu);
    ps->ck_done++;
    if (st == CHORUS_OK) ps->ck_last = step;
  }
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* One update from the gradients summed so far.  Lock held. */
static void apply(chorus_ps_t *ps) {
  const size_t n = ps->cnt[ps->me];
  const chorus_ps_config_t *c = &ps->cfg;
  const float inv = 1.0f / (float)ps->acc_k;
  for (size_t i = 0; i < n; i++) ps->acc[i] *= inv;
  if (c->clip > 0) chorus_grad_clip(ps->acc, n, chorus_grad_norm(ps->acc, n), c->clip);
  /* The schedule's rate at this point of the budget, scaled by the share
   * of a synchronous step's batch the update averages (the linear scaling
   * rule): k gradients of W move the weights k / W as far, so a token
   * counts the same whatever the staleness bound, and S = 0 is DDP. */
  const float lr = chorus_lr_at(ps->applied / ps->nwork, c->warmup, c->steps, c->lr, c->min_lr) *
                   (float)ps->acc_k / (float)ps->nwork;
  chorus_optim_begin_step(ps->opt);
  chorus_optim_update(ps->opt, 0, ps->par, ps->acc, n, lr);
  memset(ps->acc, 0, n * sizeof(float));
  const long before = ps->applied / ps->nwork;
  ps->applied += ps->acc_k;
  ps->acc_k = 0;
  ps->version++;
  ps->t_last = now_ns();
  const long step = ps->applied / ps->nwork;
  if (ps->me == 0 && c->log_every > 0 && step >= ps->log_next && ps->log_n) {
    const double dt = (double)(ps->t_last - ps->t_log) / 1e9;
    say(ps, "async step %5ld/%ld  loss %.4f  lr %.2e  %.0f tok/s  staleness mean %.2f max %ld  "
        "version %lld  (%ld gradient(s))", step, c->steps, ps->log_loss / (double)ps->log_n, lr,
        dt > 0 ? ps->log_tok / dt : 0.0, ps->log_stale / (double)ps->log_n, ps->log_smax,
        (long long)ps->version, ps->log_n);
    ps->log_loss = ps->log_tok = ps->log_stale = 0;
    ps->log_n = ps->log_smax = 0;
    ps->t_log = ps->t_last;
    while (ps->log_next <= step) ps->log_next += c->log_every;
  }
  if (c->ckpt_dir && c->ckpt_every > 0 && step / c->ckpt_every > before / c->ckpt_every &&
      step < c->steps)
    ps->ck_crossed = step / c->ckpt_every; /* ck_main writes it */
  pthread_cond_broadcast(&ps->cv);
}

/* Applies the summed gradients if no worker still computing would then be
 * more than max_staleness versions behind.  Lock held. */
static void maybe_apply(chorus_ps_t *ps) {
  if (ps->acc_k == 0) return;
  for (int w = 0; w < ps->nwork; w++) {
    const slot_t *sl = &ps->slots[w];
    if (sl->state == W_COMPUTING && ps->version + 1 - sl->u > ps->cfg.max_staleness) return;
  }
  apply(ps);
}

/* The worker is gone (or dropped).  Lock held. */
static void gone(slot_t *sl) {
  chorus_ps_t *ps = sl->ps;
  if (sl->state == W_GONE) return;
  sl->state = W_GONE;
  maybe_apply(ps);
  pthread_cond_broadcast(&ps->cv);
}

/* The transport speaks of a group that fails as one; a pair does not:
 * its words to that effect go from a message. */
static void pair_words(char *why) {
  static const char group[] = "; every other rank fails too";
  char *cut = strstr(why, group);
  if (cut) memmove(cut, cut + sizeof group - 1, strlen(cut + sizeof group - 1) + 1);
}

static void drop(slot_t *sl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void drop(slot_t *sl, const char *fmt, ...) {
  chorus_ps_t *ps = sl->ps;
  char why[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  pair_words(why);
  pthread_mutex_lock(&ps->mu);
  const int was = sl->state;
  if (was != W_GONE) ps->st.dropped++;
  gone(sl);
  int alive = 0;
  for (int w = 0; w < ps->nwork; w++) alive += ps->slots[w].state != W_GONE;
  const int failed = ps->failed;
  pthread_mutex_unlock(&ps->mu);
  if (was != W_GONE && !failed)
    say(ps, "async: server %d dropped worker %d (rank %d): %s; %d worker(s) go on; the rest of "
        "its data is not trained on (lost), the budget is filled by the others", ps->me, sl->w,
        ps->nserv + sl->w, why, alive);
}

static chorus_result_t send_msg(slot_t *sl, msg_t *m, const float *data) {
  chorus_result_t st = chorus_send(sl->comm, m, sizeof *m, CHORUS_UINT8, 1, TAG_HDR, NULL);
  if (st == CHORUS_OK && m->count)
    st = chorus_send(sl->comm, data, m->count, CHORUS_FLOAT32, 1, TAG_DATA, NULL);
  return st;
}

/* Tells the worker it is refused for good, and drops it. */
static void fatal(slot_t *sl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fatal(slot_t *sl, const char *fmt, ...) {
  msg_t m;
  memset(&m, 0, sizeof m);
  m.magic = PS_MAGIC;
  m.kind = M_FATAL;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m.text, sizeof m.text, fmt, ap);
  va_end(ap);
  /* It may not read it (it may be what is broken): abort right after. */
  chorus_work_t wk = NULL;
  if (chorus_send(sl->comm, &m, sizeof m, CHORUS_UINT8, 1, TAG_HDR, &wk) == CHORUS_OK) {
    chorus_work_wait(wk, 1000);
    if (chorus_work_test(wk) == CHORUS_INPROGRESS) chorus_comm_abort(sl->comm);
    chorus_work_free(wk);
  }
  drop(sl, "refused: %s", m.text);
}

/* The parameters for a worker, and its state: computing on them.  Lock held. */
static void hand_out(slot_t *sl, msg_t *m, int kind) {
  chorus_ps_t *ps = sl->ps;
  memcpy(sl->out, ps->par, ps->cnt[ps->me] * sizeof(float));
  m->magic = PS_MAGIC;
  m->kind = (uint32_t)kind;
  m->version = ps->version;
  m->count = ps->cnt[ps->me];
  sl->u = ps->version;
  sl->state = W_COMPUTING;
}

static void *serve_worker(void *arg) {
  slot_t *sl = arg;
  chorus_ps_t *ps = sl->ps;
  const size_t n = ps->cnt[ps->me];
  const int S = ps->cfg.max_staleness;
  for (;;) {
    msg_t h, r;
    memset(&r, 0, sizeof r);
    chorus_result_t st = chorus_recv(sl->comm, &h, sizeof h, CHORUS_UINT8, 1, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      drop(sl, "%s", chorus_comm_last_error(sl->comm));
      break;
    }
    if (h.magic == PS_MAGIC && h.kind == M_BYE) {
      /* Another server's budget is full: so is this one's, near enough. */
      pthread_mutex_lock(&ps->mu);
      ps->byes++;
      pthread_mutex_unlock(&ps->mu);
      break;
    }
    if (h.magic != PS_MAGIC || (h.kind != M_HELLO && h.kind != M_PUSH)) {
      fatal(sl, "a message that is neither a hello nor a push (magic %#x, kind %u)", h.magic,
            h.kind);
      break;
    }
    pthread_mutex_lock(&ps->mu);
    const int state = sl->state; /* another thread may have dropped it */
    pthread_mutex_unlock(&ps->mu);
    if (state == W_GONE) break;
    if (h.kind == M_HELLO && state != W_NEW) {
      fatal(sl, "a second hello");
      break;
    }
    if (h.kind == M_PUSH && state != W_COMPUTING) {
      fatal(sl, "a push before its hello");
      break;
    }
    if (h.kind == M_HELLO) {
      /* Nobody starts before everybody is here, so that a synchronous run
       * has every worker in its first update. */
      pthread_mutex_lock(&ps->mu);
      if (ps->t_first == 0) ps->t_first = ps->t_log = now_ns();
      ps->hellos++;
      pthread_cond_broadcast(&ps->cv);
      const int64_t until = deadline(sl);
      int to = 0;
      for (;;) {
        int left = 0;
        for (int w = 0; w < ps->nwork; w++) left += ps->slots[w].state == W_GONE;
        if (ps->hellos + left >= ps->nwork || ps->failed || to) break;
        to = wait_until(ps, until) == ETIMEDOUT;
      }
      hand_out(sl, &r, M_PARAMS);
      r.step = ps->start_step[sl->w];
      pthread_mutex_unlock(&ps->mu);
      if ((st = send_msg(sl, &r, sl->out)) != CHORUS_OK) {
        drop(sl, "%s", chorus_comm_last_error(sl->comm));
        break;
      }
      continue;
    }
    if (h.count != n) {
      fatal(sl, "a gradient of %llu floats, but server %d holds %zu (floats [%zu, %zu) of %zu): "
            "the worker's model is not the servers'", (unsigned long long)h.count, ps->me, n,
            ps->lo[ps->me], ps->lo[ps->me] + n, ps->np);
      break;
    }
    if ((st = chorus_recv(sl->comm, sl->g, n, CHORUS_FLOAT32, 1, TAG_DATA, NULL)) != CHORUS_OK) {
      drop(sl, "%s", chorus_comm_last_error(sl->comm));
      break;
    }
    const double sq = chorus_grad_sumsq(sl->g, n);
    pthread_mutex_lock(&ps->mu);
    const int64_t v = ps->version, u = sl->u;
    if (h.version < 0 || h.version > u) {
      pthread_mutex_unlock(&ps->mu);
      fatal(sl, "a gradient claiming version %lld, but server %d handed it version %lld",
            (long long)h.version, ps->me, (long long)u);
      break;
    }
    const int64_t tau = v - h.version;
    int refuse = 0;
    if (tau > S) {
      snprintf(r.text, sizeof r.text, "server %d refused the gradient of step %lld: it was "
               "computed on version %lld, %lld versions old, and --max-staleness is %d", ps->me,
               (long long)h.step, (long long)h.version, (long long)tau, S);
      refuse = 1;
    } else if (!isfinite(sq) || !isfinite(h.loss)) {
      snprintf(r.text, sizeof r.text, "server %d refused the gradient of step %lld: it holds inf "
               "or NaN", ps->me, (long long)h.step);
      refuse = 1;
    }
    if (refuse) {
      ps->st.refused++;
      hand_out(sl, &r, M_REFUSED);
      r.staleness = tau;
      maybe_apply(ps); /* it computes on the newest version now */
      pthread_mutex_unlock(&ps->mu);
      say(ps, "async: %s (worker %d)", r.text, sl->w);
      if ((st = send_msg(sl, &r, sl->out)) != CHORUS_OK) {
        drop(sl, "%s", chorus_comm_last_error(sl->comm));
        break;
      }
      continue;
    }
    if (ps->applied + ps->acc_k >= ps->budget) {
      /* The budget is full: this one is not needed. */
      sl->state = W_GONE;
      maybe_apply(ps);
      pthread_cond_broadcast(&ps->cv);
      pthread_mutex_unlock(&ps->mu);
      r.magic = PS_MAGIC;
      r.kind = M_STOP;
      r.version = v;
      send_msg(sl, &r, NULL);
      break;
    }
    const float wgt = ps->cfg.staleness_weight ? 1.0f / (1.0f + (float)tau) : 1.0f;
    if (wgt == 1.0f)
      for (size_t i = 0; i < n; i++) ps->acc[i] += sl->g[i];
    else
      for (size_t i = 0; i < n; i++) ps->acc[i] += wgt * sl->g[i];
    ps->acc_k++;
    sl->pushes++;
    ps->st.hist[tau < CHORUS_PS_HIST - 1 ? tau : CHORUS_PS_HIST - 1]++;
    ps->st.tokens += h.tokens;
    ps->st.loss_sum += h.loss;
    ps->st.loss_n++;
    ps->log_loss += h.loss, ps->log_tok += h.tokens, ps->log_stale += (double)tau, ps->log_n++;
    if (tau > ps->log_smax) ps->log_smax = (long)tau;
    if ((ps->applied + ps->acc_k) * 10 > ps->budget * 9) ps->tail_sum += h.loss, ps->tail_n++;
    sl->state = W_WAITING;
    maybe_apply(ps);
    int64_t until = deadline(sl);
    while (ps->version == v && !ps->failed) {
      if (wait_until(ps, until) != ETIMEDOUT) continue;
      /* A whole timeout without the update: the workers still computing
       * that hold it back have not pushed for that long.  They go. */
      slot_t *late[64];
      int nl = 0;
      for (int w = 0; w < ps->nwork && nl < 64; w++) {
        slot_t *o = &ps->slots[w];
        if (o->state == W_COMPUTING && ps->version + 1 - o->u > S) late[nl++] = o;
      }
      pthread_mutex_unlock(&ps->mu);
      for (int i = 0; i < nl; i++) {
        drop(late[i], "it held the others' update back for a whole timeout (CHORUS_TIMEOUT) "
             "without pushing");
        chorus_comm_abort(late[i]->comm);
      }
      pthread_mutex_lock(&ps->mu);
      until = deadline(sl);
    }
    if (ps->version == v) {
      pthread_mutex_unlock(&ps->mu);
      drop(sl, "the servers failed");
      break;
    }
    const int stop = ps->applied >= ps->budget;
    hand_out(sl, &r, stop ? M_STOP : M_PARAMS);
    r.staleness = tau;
    r.step = 1; /* its gradient is in */
    if (stop) {
      r.count = 0;
      sl->state = W_GONE;
      maybe_apply(ps);
    }
    pthread_mutex_unlock(&ps->mu);
    if ((st = send_msg(sl, &r, sl->out)) != CHORUS_OK) {
      drop(sl, "%s", chorus_comm_last_error(sl->comm));
      break;
    }
    if (stop) break;
  }
  pthread_mutex_lock(&ps->mu);
  gone(sl);
  ps->running--;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* Resumes from the newest checkpoint: this server's range, and the
 * progress (a checkpoint of the servers, or of a synchronous run: then
 * every worker starts at its step). */
static chorus_result_t resume(chorus_ps_t *ps) {
  const size_t cap = sizeof(ck_extra_t) + sizeof(int64_t) * MAX_CK_WORKERS;
  unsigned char *x = malloc(cap);
  if (!x) return fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_serve: out of memory");
  long step = -1;
  size_t xlen = 0;
  chorus_ckpt_info_t info;
  chorus_result_t st = chorus__ckpt_load_range(ps->servers, ps->shape, ps->opt, ps->par,
                                               ps->lo[ps->me], ps->cnt[ps->me], ps->cfg.ckpt_dir,
                                               &step, x, cap, &xlen, &info);
  if (st != CHORUS_OK || step < 0) {
    free(x);
    return st;
  }
  ck_extra_t e;
  memset(&e, 0, sizeof e);
  if (xlen >= sizeof e) memcpy(&e, x, sizeof e);
  if (xlen >= sizeof e && e.magic == CK_EXTRA_MAGIC && e.workers == ps->nwork &&
      xlen == sizeof e + sizeof(int64_t) * (size_t)e.workers && e.applied >= 0 &&
      e.version >= 0) {
    ps->applied = (long)e.applied;
    ps->version = e.version;
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p;
      memcpy(&p, x + sizeof e + sizeof p * (size_t)w, sizeof p);
      ps->start_step[w] = p > 0 ? (long)p : 0;
      ps->slots[w].pushes = ps->start_step[w];
    }
  } else {
    /* Another world or mode wrote it: everybody goes on from its step. */
    ps->applied = step * ps->nwork;
    ps->version = step;
    for (int w = 0; w < ps->nwork; w++) ps->start_step[w] = ps->slots[w].pushes = step;
  }
  if (ps->applied > ps->budget) ps->applied = ps->budget;
  ps->st.resumed_step = step;
  ps->ck_last = step;
  if (ps->cfg.ckpt_every > 0) ps->ck_done = ps->ck_crossed = step / ps->cfg.ckpt_every;
  ps->log_next = step + 1;
  if (ps->me == 0)
    say(ps, "resumed from %s/ckpt-%09ld%s (written by %d rank(s)%s): %ld of %ld gradients "
        "applied", ps->cfg.ckpt_dir, step, info.sharded ? "" : ".bin", info.world,
        e.magic == CK_EXTRA_MAGIC ? ", asynchronous" : "", ps->applied,
        ps->budget);
  free(x);
  return CHORUS_OK;
}

chorus_result_t chorus_ps_serve(chorus_ps_t *ps) {
  if (!ps || !ps->server) return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_serve: not a server");
  chorus_result_t st = CHORUS_OK;
  if (ps->cfg.ckpt_dir && (st = resume(ps)) != CHORUS_OK) return st;
  if (ps->cfg.log_every > 0 && ps->log_next == 0) ps->log_next = ps->cfg.log_every;
  if (ps->cfg.ckpt_dir) {
    if (pthread_create(&ps->ck_th, NULL, ck_main, ps) != 0) {
      chorus_comm_abort(ps->servers); /* the other servers must not wait for this one */
      return fail(CHORUS_ERR_SYSTEM, "chorus_ps_serve: cannot start a thread: %s", strerror(errno));
    }
    ps->ck_started = 1;
  }
  pthread_mutex_lock(&ps->mu);
  for (int w = 0; w < ps->nwork; w++) {
    if (pthread_create(&ps->slots[w].th, NULL, serve_worker, &ps->slots[w]) != 0) {
      ps->slots[w].state = W_GONE;
      continue;
    }
    ps->slots[w].started = 1;
    ps->running++;
  }
  /* Wait for the workers' threads; watch the other servers meanwhile. */
  char why[512] = "";
  while (ps->running > 0) {
    wait_until(ps, now_ns() + 200 * 1000000);
    if (ps->nserv > 1 && !ps->failed && chorus_comm_status(ps->servers) != CHORUS_OK) {
      ps->failed = 1;
      snprintf(why, sizeof why, "%s", chorus_comm_last_error(ps->servers));
      pthread_cond_broadcast(&ps->cv);
      pthread_mutex_unlock(&ps->mu);
      for (int w = 0; w < ps->nwork; w++) chorus_comm_abort(ps->slots[w].comm);
      pthread_mutex_lock(&ps->mu);
    }
  }
  ps->ck_quit = 1;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  for (int w = 0; w < ps->nwork; w++)
    if (ps->slots[w].started) pthread_join(ps->slots[w].th, NULL);
  if (ps->ck_started) pthread_join(ps->ck_th, NULL);
  ps->ck_started = 0;
  if (ps->failed)
    return fail(CHORUS_ERR_REMOTE, "async: server %d: another server failed, and its parameters "
                "with it: %s (resume from the last checkpoint)", ps->me, why);
  const int short_of_budget = ps->applied < ps->budget && ps->byes == 0;
  /* The final checkpoint, at a step every server reached, if every server
   * made the same checkpoint calls so far (updates that counted different
   * gradients -- one refused a slice another took -- can part them). */
  int64_t agree[3] = {ps->applied / ps->nwork, ps->ck_count, -(int64_t)ps->ck_count};
  if (ps->nserv > 1 &&
      (st = chorus_all_reduce(ps->servers, agree, agree, 3, CHORUS_INT64, CHORUS_MIN, NULL)) !=
          CHORUS_OK)
    return fail(st, "async: server %d: agreeing on the final step: %s", ps->me,
                chorus_comm_last_error(ps->servers));
  const long step = (long)agree[0];
  const long written = ps->cfg.ckpt_every > 0 ? ps->ck_done * ps->cfg.ckpt_every : 0;
  if (agree[1] != -agree[2]) {
    say(ps, "async: server %d: the servers made %lld to %lld checkpoints (their updates counted "
        "different gradients); no final checkpoint", ps->me, (long long)agree[1],
        (long long)-agree[2]);
  } else if (ps->cfg.ckpt_dir && step > written && step > ps->st.resumed_step) {
    ck_snapshot(ps);
    st = ck_write(ps, step);
  }
  if (st == CHORUS_OK && short_of_budget && ps->nserv > 1) chorus_comm_abort(ps->servers);
  if (st == CHORUS_OK && short_of_budget)
    st = fail(CHORUS_ERR_REMOTE, "async: server %d: every worker is gone with %ld of the budget's "
              "%ld gradients applied%s", ps->me, ps->applied, ps->budget,
              ps->cfg.ckpt_dir ? " (a restart resumes from the checkpoint just written)" : "");
  return st;
}

chorus_result_t chorus_ps_full_params(chorus_ps_t *ps, float *dst) {
  if (!ps || !ps->server) return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_full_params: bad arguments");
  if (ps->me == 0 && !dst) {
    chorus_comm_abort(ps->servers); /* the others must not wait for it */
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_full_params: server 0 has no buffer");
  }
  if (ps->me == 0) memcpy(dst + ps->lo[0], ps->par, ps->cnt[0] * sizeof(float));
  chorus_result_t st = CHORUS_OK;
  for (int s = 1; s < ps->nserv && st == CHORUS_OK; s++) {
    if (ps->me == 0)
      st = chorus_recv(ps->servers, dst + ps->lo[s], ps->cnt[s], CHORUS_FLOAT32, s, 9, NULL);
    else if (ps->me == s)
      st = chorus_send(ps->servers, ps->par, ps->cnt[s], CHORUS_FLOAT32, 0, 9, NULL);
  }
  if (st != CHORUS_OK)
    return fail(st, "async: server %d: gathering the parameters: %s", ps->me,
                chorus_comm_last_error(ps->servers));
  return CHORUS_OK;
}

/* -------------------------------------------------------------- worker */

/* A worker that fails tells every server at once (they drop it). */
static void abort_pairs(chorus_ps_t *ps) {
  for (int s = 0; s < ps->nserv; s++) chorus_comm_abort(ps->pair[s]);
}

/* A pair with a server failed: the server died, hung, or aborted. */
static chorus_result_t server_gone(chorus_ps_t *ps, int s, chorus_result_t st) {
  char why[600];
  snprintf(why, sizeof why, "%s", chorus_comm_last_error(ps->pair[s]));
  pair_words(why);
  return fail(st, "async: worker %d (rank %d): server %d (rank %d) is gone or failed: %s; the "
              "parameters it held are lost, so the job fails (a restart resumes from the "
              "servers' last checkpoint)", ps->me, ps->rank, s, s, why);
}

/* Receives server s's answer: its parameters into params (its range). */
static chorus_result_t answer(chorus_ps_t *ps, int s, float *params, chorus_ps_reply_t *rep,
                              long *start) {
  chorus_comm_t c = ps->pair[s];
  msg_t h;
  chorus_result_t st = chorus_recv(c, &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
  if (st != CHORUS_OK) return server_gone(ps, s, st);
  h.text[sizeof h.text - 1] = '\0';
  const int known = h.kind == M_PARAMS || h.kind == M_REFUSED || h.kind == M_STOP;
  if (h.magic == PS_MAGIC && h.kind == M_FATAL) {
    chorus_comm_abort(c);
    return fail(CHORUS_ERR_INVALID_ARG, "async: worker %d (rank %d): server %d refused it: %s",
                ps->me, ps->rank, s, h.text);
  }
  const int data = h.kind == M_PARAMS || h.kind == M_REFUSED;
  if (h.magic != PS_MAGIC || !known || h.version < ps->ver[s] || h.staleness < 0 ||
      h.count != (data ? ps->cnt[s] : 0) || (!start && h.step != 0 && h.step != 1) ||
      (start && (h.step < 0 || h.step > ps->cfg.steps))) {
    chorus_comm_abort(c);
    return fail(CHORUS_ERR_PROTOCOL, "async: worker %d: server %d sent a malformed answer (kind "
                "%u, version %lld after %lld, %llu floats where %zu were expected, step %lld)",
                ps->me, s, h.kind, (long long)h.version, (long long)ps->ver[s],
                (unsigned long long)h.count, data ? ps->cnt[s] : (size_t)0, (long long)h.step);
  }
  if (h.kind == M_STOP) {
    if (rep) {
      rep->stop = 1;
      if (h.step == 1 && h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
      if (h.step != 1) rep->unused = 1;
    }
    return CHORUS_OK;
  }
  if ((st = chorus_recv(c, params + ps->lo[s], ps->cnt[s], CHORUS_FLOAT32, 0, TAG_DATA, NULL)) !=
      CHORUS_OK)
    return fail(st, "async: worker %d: receiving server %d's parameters: %s", ps->me, s,
                chorus_comm_last_error(c));
  ps->ver[s] = h.version;
  if (start && s == 0) *start = (long)h.step;
  if (rep) {
    if (h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
    if (s == 0) rep->version = (long)h.version;
    if (h.kind == M_REFUSED) {
      rep->refused = 1;
      snprintf(rep->why, sizeof rep->why, "%s", h.text);
    }
  }
  return CHORUS_OK;
}

chorus_result_t chorus_ps_pull(chorus_ps_t *ps, float *params, long *start_step) {
  if (!ps || ps->server || !params)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_pull: not a worker, or no buffer");
  long start = 0;
  chorus_result_t st = CHORUS_OK;
  for (int s = 0; s < ps->nserv && st == CHORUS_OK; s++) {
    msg_t h;
    memset(&h, 0, sizeof h);
    h.magic = PS_MAGIC;
    h.kind = M_HELLO;
    st = chorus_send(ps->pair[s], &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      server_gone(ps, s, st);
      abort_pairs(ps);
      return st;
    }
  }
  for (int s = 0; s < ps->nserv && st == CHORUS_OK; s++) {
    chorus_ps_reply_t rep;
    memset(&rep, 0, sizeof rep);
    st = answer(ps, s, params, &rep, &start);
    if (st == CHORUS_OK && rep.stop)
      st = fail(CHORUS_ERR_INVALID_ARG, "async: worker %d: the budget is already applied", ps->me);
  }
  if (st != CHORUS_OK) abort_pairs(ps);
  if (start_step) *start_step = start;
  ps->wstep = start;
  return st;
}

/* Sends server s its slice (src: count floats) asynchronously. */
static chorus_result_t send_slice(chorus_ps_t *ps, int s, const float *src, uint64_t count,
                                  int64_t version, float loss, uint32_t tokens) {
  msg_t *h = &ps->hd[s];
  memset(h, 0, sizeof *h);
  h->magic = PS_MAGIC;
  h->kind = M_PUSH;
  h->version = version;
  h->count = count;
  h->loss = loss;
  h->tokens = tokens;
  h->step = ps->wstep;
  ps->sent[s] = 1;
  chorus_result_t st =
      chorus_send(ps->pair[s], h, sizeof *h, CHORUS_UINT8, 0, TAG_HDR, &ps->wk[2 * s]);
  if (st == CHORUS_OK)
    st = chorus_send(ps->pair[s], src, count, CHORUS_FLOAT32, 0, TAG_DATA, &ps->wk[2 * s + 1]);
  if (st != CHORUS_OK) server_gone(ps, s, st);
  return st;
}

chorus_result_t chorus_ps_push_early(chorus_ps_t *ps, const float *grads, float loss,
                                     uint32_t tokens, size_t final_from) {
  if (!ps || ps->server || !grads)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_push_early: not a worker, or no buffer");
  if (ps->fault || ps->early_st != CHORUS_OK) return ps->early_st; /* testing faults: all at once */
  for (int s = 0; s < ps->nserv && ps->early_st == CHORUS_OK; s++)
    if (!ps->sent[s] && ps->lo[s] >= final_from)
      ps->early_st = send_slice(ps, s, grads + ps->lo[s], ps->cnt[s], ps->ver[s], loss, tokens);
  return ps->early_st;
}

chorus_result_t chorus_ps_push(chorus_ps_t *ps, const float *grads, float loss, uint32_t tokens,
                               float *params, chorus_ps_reply_t *rep) {
  if (!ps || ps->server || !grads || !params || !rep)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_push: not a worker, or no buffer");
  memset(rep, 0, sizeof *rep);
  float *extra = NULL;
  const int fault = ps->fault;
  ps->fault = 0;
  if (fault == 2 || fault == 3) extra = calloc(ps->cnt[0] + 1, sizeof(float));
  int *stopped = calloc((size_t)ps->nserv, sizeof *stopped);
  chorus_result_t st = ps->early_st;
  if (st == CHORUS_OK && (!stopped || ((fault == 2 || fault == 3) && !extra)))
    st = fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_push: out of memory");
  /* The slices not sent early (chorus_ps_push_early) go now. */
  for (int s = 0; s < ps->nserv && st == CHORUS_OK; s++) {
    if (ps->sent[s]) continue;
    const float *src = grads + ps->lo[s];
    uint64_t count = ps->cnt[s];
    int64_t version = ps->ver[s];
    if (fault == 1) version = ps->ver[s] - ps->cfg.max_staleness - 1;
    if ((fault == 2 || fault == 3) && s == 0) {
      memcpy(extra, src, ps->cnt[0] * sizeof(float));
      if (fault == 2) count = ps->cnt[0] + 1;
      else extra[0] = NAN;
      src = extra;
    }
    st = send_slice(ps, s, src, count, version, loss, tokens);
  }
  for (int s = 0; s < ps->nserv && st == CHORUS_OK; s++) {
    const int before = rep->stop;
    rep->stop = 0;
    st = answer(ps, s, params, rep, NULL);
    stopped[s] = rep->stop;
    rep->stop |= before;
  }
  /* Servers whose budget was not full yet learn that this worker leaves. */
  for (int s = 0; s < ps->nserv && st == CHORUS_OK && rep->stop; s++) {
    if (stopped[s]) continue;
    msg_t bye;
    memset(&bye, 0, sizeof bye);
    bye.magic = PS_MAGIC;
    bye.kind = M_BYE;
    chorus_send(ps->pair[s], &bye, sizeof bye, CHORUS_UINT8, 0, TAG_HDR, NULL);
  }
  free(stopped);
  for (int i = 0; i < 2 * ps->nserv; i++) {
    /* A server that stopped or refused this worker may never take the data. */
    if (ps->wk[i] && (st != CHORUS_OK || rep->stop) &&
        chorus_work_wait(ps->wk[i], 2000) == CHORUS_INPROGRESS)
      chorus_comm_abort(ps->pair[i / 2]);
    chorus_work_free(ps->wk[i]);
    ps->wk[i] = NULL;
  }
  for (int s = 0; s < ps->nserv; s++) ps->sent[s] = 0;
  ps->early_st = CHORUS_OK;
  free(extra);
  /* The other servers learn at once that this worker is out. */
  if (st != CHORUS_OK) abort_pairs(ps);
  ps->wstep++;
  return st;
}
