/*
 * ps.c - a parameter server's set-up (chorus_ps_create): the layout cut in
 * ranges, the communicators of the servers and of each (server, worker)
 * pair, each role's state; its teardown and statistics, and the helpers
 * every role uses.  The protocol and the threads: ps_internal.h.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/ps_internal.h"
#include "train/runtime.h"

void chorus__ps_say(chorus_ps_t *ps, const char *fmt, ...) {
  char line[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (ps->cfg.log) ps->cfg.log(ps->cfg.log_arg, line);
  else fprintf(stderr, "%s\n", line);
}

/* The transport speaks of a group that fails as one; a pair does not:
 * its words to that effect go from a message. */
void chorus__ps_pair_words(char *why) {
  static const char group[] = "; every other rank fails too";
  char *cut = strstr(why, group);
  if (cut) memmove(cut, cut + sizeof group - 1, strlen(cut + sizeof group - 1) + 1);
}

/* A pair communicator's last error, in a pair's words. */
void chorus__ps_pair_error(chorus_comm_t c, char *why, size_t cap) {
  snprintf(why, cap, "%s", chorus_comm_last_error(c));
  chorus__ps_pair_words(why);
}

/* ------------------------------------------------------------ creation */

int chorus_ps_worker(const chorus_ps_t *ps) { return ps && !ps->server ? ps->me : -1; }
int chorus_ps_workers(const chorus_ps_t *ps) { return ps ? ps->nwork : 0; }
int chorus_ps_leader(const chorus_ps_t *ps) {
  return ps && ps->server && ps->owner[0] == ps->me;
}

static void range_free(range_t *r) {
  free(r->par), free(r->acc), free(r->avg), free(r->hand), free(r->wr), free(r->wst), free(r->u);
  free(r->pend), free(r->mbuf), free(r->rbuf), free(r->ck_par), free(r->ck_blob);
  for (int w = 0; r->held && w < r->ps->nwork; w++) free(r->held[w]);
  free(r->held);
  r->held = NULL;
  chorus_optim_destroy(r->opt);
  chorus_optim_destroy(r->ck_opt);
  r->par = r->avg = r->hand = r->ck_par = NULL;
  r->acc = NULL;
  r->wr = NULL, r->wst = NULL, r->u = r->pend = NULL;
  r->mbuf = r->rbuf = r->ck_blob = NULL;
  r->opt = r->ck_opt = NULL;
}

/* The buffers of a range this process serves or keeps: 0, or -1. */
static int range_alloc(chorus_ps_t *ps, range_t *r, int role) {
  const size_t n = r->n, W = (size_t)ps->nwork;
  r->role = role;
  r->par = malloc(n * sizeof(float) + 1);
  if (role == R_PRIMARY) { /* a copy gets them if it takes its range over */
    r->acc = calloc(n + 1, sizeof(double));
    r->avg = malloc(n * sizeof(float) + 1);
  }
  r->wr = calloc(W, sizeof *r->wr);
  r->wst = calloc(W, sizeof *r->wst);
  r->u = calloc(W, sizeof *r->u);
  r->pend = calloc(W, sizeof *r->pend);
  if (chorus_optim_create(&ps->cfg.optim, n, &r->opt) != CHORUS_OK) r->opt = NULL;
  if (!r->par || (role == R_PRIMARY && (!r->acc || !r->avg)) || !r->wr || !r->wst || !r->u ||
      !r->pend || !r->opt)
    return -1;
  for (size_t w = 0; w < W; w++) r->wr[w] = (wrec_t){0, -1, -1}, r->pend[w] = -1;
  r->mproc = -1;
  r->acked = -1;
  r->from = -1;
  if (ps->cfg.mirror) {
    /* the primary ships updates from mbuf and keeps hand; the copy
     * receives them in rbuf (the FULL, three times as big, only once) */
    const size_t bytes = chorus__ps_update_bytes(ps, r);
    if (role == R_PRIMARY) {
      r->mbuf = malloc(bytes);
      r->hand = malloc(n * sizeof(float) + 1);
      if (!r->mbuf || !r->hand) return -1;
    } else {
      r->rbuf = malloc(bytes);
      if (!r->rbuf) return -1;
    }
  }
  return 0;
}

/* A range's checkpoint buffers: 0, or -1. */
int chorus__ps_range_ck_alloc(chorus_ps_t *ps, range_t *r) {
  if (r->ck_par) return 0;
  r->ck_par = malloc(r->n * sizeof(float) + 1);
  r->ck_blob = malloc(chorus_optim_state_size(r->opt));
  if (chorus_optim_create(&ps->cfg.optim, r->n, &r->ck_opt) != CHORUS_OK) r->ck_opt = NULL;
  return r->ck_par && r->ck_blob && r->ck_opt ? 0 : -1;
}

void chorus_ps_destroy(chorus_ps_t *ps) {
  if (!ps) return;
  int n = ps->server ? ps->nwork : ps->nproc;
  for (int i = 0; ps->pair && i < n; i++) chorus_comm_destroy(ps->pair[i]);
  for (int p = 0; ps->spair && p < ps->nproc; p++) chorus_comm_destroy(ps->spair[p]);
  chorus_comm_destroy(ps->servers);
  for (int w = 0; ps->slots && w < ps->nwork; w++) free(ps->slots[w].g), free(ps->slots[w].out);
  for (int r = 0; ps->rg && r < ps->nrange; r++) range_free(&ps->rg[r]);
  free(ps->rg);
  free(ps->slots);
  free(ps->pair), free(ps->spair);
  free(ps->lo), free(ps->cnt), free(ps->owner), free(ps->mholder), free(ps->ver);
  free(ps->wk), free(ps->hd), free(ps->sent), free(ps->pending), free(ps->pdead);
  free(ps->crank), free(ps->start_step), free(ps->ck_pushes);
  chorus_optim_destroy(ps->opt0);
  chorus_gpt_destroy(ps->shape);
  if (ps->sync_ok) {
    pthread_mutex_destroy(&ps->mu);
    pthread_cond_destroy(&ps->cv);
  }
  free(ps);
}

/* The servers' communicator and, with mirrors, one per pair of server
 * processes; one per (server process, worker) pair.  Every rank makes
 * every group in the same order; members get one.  CHORUS_OK, or the
 * error (recorded). */
static chorus_result_t make_groups(chorus_ps_t *ps) {
  const int P = ps->nproc, W = ps->nwork;
  chorus_comm_t world = ps->world;
  int *ranks = malloc(sizeof(int) * (size_t)P);
  for (int p = 0; ranks && p < P; p++) ranks[p] = p;
  chorus_result_t st =
      ranks ? chorus_comm_new_group(world, ranks, P, &ps->servers) : CHORUS_ERR_NO_MEMORY;
  free(ranks);
  for (int a = 0; ps->cfg.mirror && a < P && st == CHORUS_OK; a++)
    for (int b = a + 1; b < P && st == CHORUS_OK; b++) {
      chorus_comm_t c = NULL;
      const int two[2] = {a, b};
      st = chorus_comm_new_group(world, two, 2, &c);
      if (c) ps->spair[ps->rank == a ? b : a] = c;
    }
  for (int p = 0; p < P && st == CHORUS_OK; p++)
    for (int w = 0; w < W && st == CHORUS_OK; w++) {
      chorus_comm_t c = NULL;
      const int two[2] = {p, P + w};
      st = chorus_comm_new_group(world, two, 2, &c);
      if (c) ps->pair[ps->server ? w : p] = c;
    }
  if (st != CHORUS_OK)
    chorus__train_fail(
        st, "chorus_ps_create: rank %d: making the servers' and pairs' communicators: %s", ps->rank,
        chorus_comm_last_error(world));
  return st;
}

/* A server's state: its ranges (the one it serves, from the seed; the copy
 * it keeps), a slot per worker, the lock and its condition.  CHORUS_OK,
 * or the error (recorded). */
static chorus_result_t server_state(chorus_ps_t *ps, const chorus_ps_config_t *cfg,
                                    uint64_t seed) {
  const int S = ps->nrange, W = ps->nwork, P = ps->nproc;
  ps->rg = calloc((size_t)S, sizeof *ps->rg);
  ps->slots = calloc((size_t)W, sizeof *ps->slots);
  ps->crank = calloc((size_t)P, sizeof *ps->crank);
  ps->start_step = calloc((size_t)W, sizeof *ps->start_step);
  ps->ck_pushes = calloc((size_t)W, sizeof *ps->ck_pushes);
  int ok = ps->rg && ps->slots && ps->crank && ps->start_step && ps->ck_pushes;
  for (int p = 0; ok && p < P; p++) ps->crank[p] = p;
  for (int r = 0; ok && r < S; r++) {
    range_t *g = &ps->rg[r];
    g->ps = ps;
    g->id = r;
    g->lo = ps->lo[r];
    g->n = ps->cnt[r];
    g->mproc = g->from = -1;
    g->acked = -1;
    if (r == ps->me) {
      ok = range_alloc(ps, g, R_PRIMARY) == 0;
      if (ok && cfg->ckpt_dir) ok = chorus__ps_range_ck_alloc(ps, g) == 0;
      if (ok) chorus_gpt_init_range(ps->shape, seed, g->lo, g->n, g->par);
      g->mproc = ps->mholder[r];
    } else if (ps->mholder[r] == ps->me) {
      ok = range_alloc(ps, g, R_MIRROR) == 0;
      g->from = r;
    }
  }
  if (ok && ps->me >= S && chorus_optim_create(&cfg->optim, 0, &ps->opt0) != CHORUS_OK) ok = 0;
  for (int w = 0; ok && w < W; w++) {
    slot_t *sl = &ps->slots[w];
    sl->ps = ps;
    sl->w = w;
    sl->comm = ps->pair[w];
    sl->g = malloc(ps->maxcnt * sizeof(float) + 1);
    sl->out = malloc(ps->maxcnt * sizeof(float) + 1);
    ok = sl->g && sl->out;
  }
  if (!ok || pthread_mutex_init(&ps->mu, NULL) != 0)
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                              "chorus_ps_create: server %d: out of memory for a range of "
                              "%zu floats",
                              ps->me, ps->maxcnt);
  pthread_condattr_t ca;
  int bad = pthread_condattr_init(&ca) != 0;
  bad = bad || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&ps->cv, &ca) != 0;
  if (!bad) pthread_condattr_destroy(&ca);
  if (bad) {
    pthread_mutex_destroy(&ps->mu);
    return chorus__train_fail(CHORUS_ERR_SYSTEM,
                              "chorus_ps_create: cannot make a condition variable");
  }
  ps->sync_ok = 1;
  ps->budget = cfg->steps * ps->nwork;
  return CHORUS_OK;
}

chorus_result_t chorus_ps_create(chorus_comm_t world, const chorus_gpt_config_t *model,
                                 uint64_t seed, const chorus_ps_config_t *cfg,
                                 chorus_ps_t **out) {
  if (!out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  const int size = world ? chorus_comm_size(world) : 0;
  const int P = cfg ? cfg->servers + (cfg->mirror ? cfg->standby : 0) : 0;
  if (!world || !model || !cfg || cfg->servers < 1 || cfg->standby < 0 || P >= size ||
      cfg->max_staleness < 0 || cfg->steps < 0 || cfg->warmup < 0 || cfg->ckpt_every < 0 ||
      (cfg->ckpt_dir && cfg->keep < 1) || size - P > MAX_CK_WORKERS)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ps_create: bad arguments (%d server(s) and %d "
                              "standby of a world of %d: at least one server and one worker)",
                              cfg ? cfg->servers : 0, cfg ? cfg->standby : 0, size);
  if ((cfg->mirror && P < 2) || (!cfg->mirror && cfg->standby > 0) || cfg->standby > 1)
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG, "chorus_ps_create: %s",
        cfg->standby > 1 ? "one standby at most (it keeps the last range's copy)"
        : cfg->mirror    ? "mirrors need a second server process to keep each range's "
                           "copy: two servers, or a standby"
                         : "a standby only keeps copies: it needs mirrors");
  chorus_ps_t *ps = calloc(1, sizeof *ps);
  if (!ps) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
  ps->cfg = *cfg;
  ps->world = world;
  ps->rank = chorus_comm_rank(world);
  ps->nrange = cfg->servers;
  ps->nproc = P;
  ps->nwork = size - P;
  ps->server = ps->rank < P;
  ps->me = ps->server ? ps->rank : ps->rank - P;
  chorus_result_t st = chorus_gpt_create_ex(model, 1, seed, CHORUS_GPT_EXTERNAL, &ps->shape);
  if (st != CHORUS_OK) {
    chorus_ps_destroy(ps);
    return st;
  }
  const int S = ps->nrange, W = ps->nwork;
  ps->np = chorus_gpt_num_params(ps->shape);
  ps->lo = calloc((size_t)S, sizeof *ps->lo);
  ps->cnt = calloc((size_t)S, sizeof *ps->cnt);
  ps->owner = calloc((size_t)S, sizeof *ps->owner);
  ps->mholder = calloc((size_t)S, sizeof *ps->mholder);
  int npair = ps->server ? W : P;
  ps->pair = calloc((size_t)npair, sizeof *ps->pair);
  ps->spair = calloc((size_t)P, sizeof *ps->spair);
  if (!ps->lo || !ps->cnt || !ps->owner || !ps->mholder || !ps->pair || !ps->spair) {
    chorus_ps_destroy(ps);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
  }
  for (int r = 0; r < S; r++) {
    ps->lo[r] = ps->np * (size_t)r / (size_t)S;
    ps->cnt[r] = ps->np * (size_t)(r + 1) / (size_t)S - ps->lo[r];
    if (ps->cnt[r] > ps->maxcnt) ps->maxcnt = ps->cnt[r];
    ps->owner[r] = r;
    ps->mholder[r] = cfg->mirror ? (r + 1) % P : -1;
  }
  if ((st = make_groups(ps)) != CHORUS_OK) {
    chorus_ps_destroy(ps);
    return st;
  }
  if (!ps->server) {
    ps->ver = calloc((size_t)S, sizeof *ps->ver);
    ps->wk = calloc(2 * (size_t)S, sizeof *ps->wk);
    ps->hd = calloc((size_t)S, sizeof *ps->hd);
    ps->sent = calloc((size_t)S, sizeof *ps->sent);
    ps->pending = calloc((size_t)S, sizeof *ps->pending);
    ps->pdead = calloc((size_t)P, sizeof *ps->pdead);
    if (!ps->ver || !ps->wk || !ps->hd || !ps->sent || !ps->pending || !ps->pdead) {
      chorus_ps_destroy(ps);
      return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_create: out of memory");
    }
    *out = ps;
    return CHORUS_OK;
  }
  if ((st = server_state(ps, cfg, seed)) != CHORUS_OK) {
    chorus_ps_destroy(ps);
    return st;
  }
  *out = ps;
  return CHORUS_OK;
}

void chorus_ps_inject(chorus_ps_t *ps, int fault) {
  if (ps) ps->fault = fault;
}

void chorus_ps_get_stats(const chorus_ps_t *ps, chorus_ps_stats_t *out) {
  if (!ps || !out) return;
  memset(out, 0, sizeof *out);
  out->tail_loss = NAN;
  if (!ps->server) return;
  const range_t *r = &ps->rg[0];
  if (r->role == R_PRIMARY) {
    out->applied = r->applied;
    out->updates = r->version;
    out->refused = r->st.refused;
    out->tokens = r->st.tokens;
    for (int i = 0; i < CHORUS_PS_HIST; i++) out->hist[i] = r->st.hist[i];
    out->loss_sum = r->st.loss_sum;
    out->loss_n = r->st.loss_n;
    out->tail_loss = r->st.tail_n ? r->st.tail_sum / (double)r->st.tail_n : NAN;
    out->mirror_wait_s = r->mwait;
  }
  out->dropped = ps->dropped;
  out->seconds = ps->t_last > ps->t_first ? (double)(ps->t_last - ps->t_first) / 1e9 : 0.0;
  out->resumed_step = ps->resumed_step;
  out->takeovers = ps->takeovers;
  for (int k = 0; k < ps->nrange; k++) out->ranges += ps->rg[k].role == R_PRIMARY;
}
