/*
 * ps.c - asynchronous data parallel: parameter servers with bounded
 * staleness, whose ranges may be mirrored (chorus_train.h, "asynchronous
 * data parallel").
 *
 * World ranks 0 .. P-1 are server processes, the others workers.  The
 * layout is cut in S ranges; process r serves range r at first.  With
 * mirrors, process (r + 1) % P keeps range r's copy, and processes S ..
 * P-1 (standbys) hold only copies until one takes a range over.
 *
 * Worker <-> server: on the communicator of one (process, worker) pair,
 * the server being its rank 0: a header (msg_t, tag TAG_HDR) naming its
 * range, then `count` float32 (TAG_DATA).
 *   worker -> server: HELLO (to the processes serving a range); PUSH
 *                     {range, version computed on, count, loss, tokens,
 *                     step} + the gradient of that range; BYE (the worker
 *                     leaves: the budget is applied).
 *   server -> worker: PARAMS {range, version, where its copy is, start
 *                     step for a HELLO} + the range; REFUSED {why} + the
 *                     range (a stale or non-finite gradient: the worker
 *                     goes on from fresh parameters); STOP (the budget is
 *                     applied); FATAL {why} (a malformed message: the
 *                     server drops the worker).
 * A HELLO is answered with one PARAMS per range the process serves.
 *
 * Primary -> copy: on the communicator of the two server processes, a
 * header (mhdr_t, TAG_MHDR) then its bytes (TAG_MDATA): FULL (the range's
 * whole state: parameters, optimizer state, per-worker records and
 * statistics), then one UPDATE per optimizer step (the averaged, clipped
 * gradient and the learning rate; the copy takes the same step), END when
 * the primary is done.  The copy answers FULL and UPDATE with an ACK.
 * One update at a time is on its way: the next waits for the ACK (the
 * gradients meanwhile add up), and workers are only ever handed
 * parameters the copy has acknowledged (`hand`).
 *
 * On a server process one thread per worker receives that worker's
 * messages and answers them, one per mirrored range ships its updates
 * (tx) or takes them in (rx), one writes checkpoints, and the caller's
 * thread waits for them, watches the other servers and, when one dies,
 * runs the take-over (failover()).  One mutex guards the process's state;
 * gradients are received into per-worker buffers outside it.
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
#include "train/runtime.h"

#define PS_MAGIC 0x32737063u /* "cps2" */
#define MIR_MAGIC 0x3272696du /* "mir2" */
#define CK_EXTRA_MAGIC 0x31736370736f6863ull
enum { TAG_HDR = 1, TAG_DATA = 2, TAG_GATHER = 9 };
/* A pair of server processes may carry two ranges' copies, one each way:
 * each range has its own tags. */
#define TAG_MHDR(r) (16 + 3 * (r))
#define TAG_MDATA(r) (17 + 3 * (r))
#define TAG_MACK(r) (18 + 3 * (r))
enum { M_HELLO = 1, M_PUSH, M_PARAMS, M_REFUSED, M_STOP, M_FATAL, M_BYE };
enum { X_FULL = 1, X_UPDATE, X_ACK, X_END };
enum { W_NEW, W_COMPUTING, W_WAITING, W_GONE };
enum { R_NONE, R_PRIMARY, R_MIRROR };
enum { RX_RUNNING, RX_ENDED, RX_FAILED };

typedef struct {
  uint32_t magic, kind;
  int32_t range;     /* the range it is about */
  int32_t mirror;    /* PARAMS: the process keeping the range's copy (-1: none) */
  int64_t version;   /* PUSH: of the parameters it was computed on; replies: of those sent */
  uint64_t count;    /* floats that follow */
  int64_t step;      /* PUSH: the worker's step; PARAMS for a HELLO: the step to start at;
                      * replies to a PUSH: 1 when the gradient is in */
  int64_t staleness; /* replies to a PUSH: the gradient's */
  float loss;
  uint32_t tokens;
  char text[216];    /* REFUSED, FATAL: why */
} msg_t;

/* Per worker and range, kept on the copy too: its gradients applied, the
 * step of the last one (a gradient sent again after a take-over is
 * recognised by it) and the version that update made. */
typedef struct {
  int64_t pushes, last_step, ver;
} wrec_t;

/* A range's statistics, shipped with every update. */
typedef struct {
  double tokens, loss_sum, tail_sum;
  double seconds; /* from the first worker's arrival to this update, on its server */
  int64_t loss_n, tail_n, refused;
  int64_t hist[CHORUS_PS_HIST];
} rstat_t;

typedef struct {
  uint32_t magic, kind;
  int32_t range, acc_k;
  int64_t version, applied;
  float lr;
  uint32_t pad;
  uint64_t bytes; /* that follow */
} mhdr_t;

/* What a checkpoint of the servers records besides the ranges. */
typedef struct {
  uint64_t magic;
  int64_t applied, version;
  int32_t workers, pad;
} ck_extra_t;
#define MAX_CK_WORKERS 65536

typedef struct range {
  struct chorus_ps *ps;
  int id, role; /* R_* on this process */
  size_t lo, n;
  float *par, *avg;
  double *acc;  /* the gradients' sum, in double */
  float **held; /* --max-staleness 0: each worker's gradient until the update, which adds
                 * them in worker order (the sum does not depend on who came first) */
  chorus_optim_t *opt;
  int acc_k;
  int64_t version, version0; /* version0: when the copy was made */
  long applied;
  wrec_t *wr;                /* per worker */
  int *wst;                  /* per worker: W_* (serving) */
  int64_t *u, *pend;         /* per worker: version handed; step of a gradient in acc (-1) */
  rstat_t st;
  int adopted;               /* taken over from a dead process */
  /* serving, mirrored: the copy's process (-1: none) and what it has */
  int mproc, inflight, tx_stop, tx_started;
  int64_t acked;             /* the copy has every update up to it (-1: not even the start) */
  float *hand;               /* the parameters at acked */
  unsigned char *mbuf;       /* an update on its way (the FULL goes from a buffer of its own) */
  mhdr_t mh;
  int64_t t_sent;
  double mwait;
  pthread_t tx;
  /* keeping the copy */
  int from, valid, rx_end, rx_started;
  int64_t rx_end_ns;
  unsigned char *rbuf;
  pthread_t rx;
  /* checkpoints */
  float *ck_par;
  unsigned char *ck_blob;
  chorus_optim_t *ck_opt;
} range_t;

typedef struct slot {
  struct chorus_ps *ps;
  int w;
  chorus_comm_t comm;
  pthread_t th;
  int started;
  int gone;  /* left (BYE) or dropped */
  float *g, *out;
} slot_t;

struct chorus_ps {
  chorus_ps_config_t cfg;
  chorus_comm_t world, servers, *pair, *spair; /* pair[w] on a server, pair[p] on a worker;
                                                * spair[p]: this server and server p */
  int rank, nrange, nproc, nwork, me;          /* me: server process or worker index */
  int server;
  size_t np, *lo, *cnt, maxcnt; /* every range */
  chorus_gpt_t *shape;          /* no storage: the layout, for init and checkpoints */
  int *owner, *mholder;         /* per range: the process serving it, the one keeping its copy */
  /* worker */
  int64_t *ver;
  long wstep; /* the worker's step: start + pushes */
  int fault;
  chorus_work_t *wk; /* the push under way: its messages, per range */
  msg_t *hd;
  int *sent, *pending, *pdead;
  int64_t lost_at; /* when a server was found gone in this push (0: none) */
  /* server */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int sync_ok;
  range_t *rg;
  slot_t *slots;
  int *crank;                /* per process: its rank in servers (-1: gone) */
  chorus_optim_t *opt0;      /* a standby's empty state, for the collective load */
  int hellos, running, rx_running, failed, byes, quit, dropped, takeovers;
  int served; /* every worker here is gone: the ranges served here are final */
  long budget, log_next, resumed_step;
  double log_loss, log_tok, log_stale;
  long log_n, log_smax;
  int64_t t_first, t_last, t_log;
  long *start_step; /* per worker, from a checkpoint */
  /* checkpoint thread */
  pthread_t ck_th;
  int ck_started, ck_quit, ck_busy, ck_hold;
  long ck_crossed, ck_done; /* checkpoint steps passed by the updates; written (or tried) */
  long ck_last;             /* the last step written */
  int ck_count;             /* checkpoints tried: every server tries the same ones */
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
int chorus_ps_leader(const chorus_ps_t *ps) {
  return ps && ps->server && ps->owner[0] == ps->me;
}

/* Bytes of a FULL and of an UPDATE of range r. */
static size_t full_bytes(const chorus_ps_t *ps, const range_t *r) {
  return r->n * sizeof(float) + chorus_optim_state_size(r->opt) +
         sizeof(wrec_t) * (size_t)ps->nwork + sizeof(rstat_t);
}
static size_t update_bytes(const chorus_ps_t *ps, const range_t *r) {
  return r->n * sizeof(float) + sizeof(wrec_t) * (size_t)ps->nwork + sizeof(rstat_t);
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
    const size_t bytes = update_bytes(ps, r);
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
static int range_ck_alloc(chorus_ps_t *ps, range_t *r) {
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
  /* Every rank makes every group in the same order; members get one. */
  int *ranks = malloc(sizeof(int) * (size_t)P);
  for (int p = 0; ranks && p < P; p++) ranks[p] = p;
  st = ranks ? chorus_comm_new_group(world, ranks, P, &ps->servers) : CHORUS_ERR_NO_MEMORY;
  free(ranks);
  for (int a = 0; cfg->mirror && a < P && st == CHORUS_OK; a++)
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
  if (st != CHORUS_OK) {
    chorus__train_fail(
        st, "chorus_ps_create: rank %d: making the servers' and pairs' communicators: %s", ps->rank,
        chorus_comm_last_error(world));
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
      if (ok && cfg->ckpt_dir) ok = range_ck_alloc(ps, g) == 0;
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
  if (!ok || pthread_mutex_init(&ps->mu, NULL) != 0) {
    chorus_ps_destroy(ps);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                              "chorus_ps_create: server %d: out of memory for a range of "
                              "%zu floats",
                              ps->me, ps->maxcnt);
  }
  pthread_condattr_t ca;
  int bad = pthread_condattr_init(&ca) != 0;
  bad = bad || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&ps->cv, &ca) != 0;
  if (!bad) pthread_condattr_destroy(&ca);
  if (bad) {
    pthread_mutex_destroy(&ps->mu);
    chorus_ps_destroy(ps);
    return chorus__train_fail(CHORUS_ERR_SYSTEM,
                              "chorus_ps_create: cannot make a condition variable");
  }
  ps->sync_ok = 1;
  ps->budget = cfg->steps * ps->nwork;
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

/* -------------------------------------------------------------- server */

/* Waits on the server's condition for at most until (CLOCK_MONOTONIC ns).
 * 0, or ETIMEDOUT. */
static int wait_until(chorus_ps_t *ps, int64_t until) {
  struct timespec ts = {(time_t)(until / 1000000000), (long)(until % 1000000000)};
  return pthread_cond_timedwait(&ps->cv, &ps->mu, &ts);
}

/* Now plus a communicator's timeout. */
static int64_t deadline_of(chorus_comm_t c) {
  int ms = c ? chorus_comm_timeout_ms(c) : 0;
  return now_ns() + (int64_t)(ms > 0 ? ms : 300000) * 1000000;
}

/* The parameters a worker may be handed: those the copy has (all, with
 * no copy), and their version. */
static const float *hand_par(const range_t *r) { return r->mproc >= 0 ? r->hand : r->par; }
static int64_t hand_ver(const range_t *r) { return r->mproc >= 0 ? r->acked : r->version; }

/* The lowest range this process serves (the one its counters come from),
 * or NULL. */
static range_t *first_served(chorus_ps_t *ps) {
  for (int k = 0; k < ps->nrange; k++)
    if (ps->rg[k].role == R_PRIMARY) return &ps->rg[k];
  return NULL;
}

/* The snapshot a checkpoint writes, taken under the lock: every range
 * served here; the progress of the first. */
static void ck_snapshot(chorus_ps_t *ps) {
  const range_t *f = first_served(ps);
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || !r->ck_par) continue;
    memcpy(r->ck_par, r->par, r->n * sizeof(float));
    chorus_optim_state_save(r->opt, r->ck_blob);
  }
  ps->ck_x = (ck_extra_t){CK_EXTRA_MAGIC, f ? f->applied : 0, f ? f->version : 0, ps->nwork, 0};
  for (int w = 0; w < ps->nwork; w++) ps->ck_pushes[w] = f ? f->wr[w].pushes : 0;
}

/* Writes one checkpoint from the snapshot (no lock held); collective over
 * the servers, which write the same steps in the same order: a file per
 * range, from the process serving it. */
static chorus_result_t ck_write(chorus_ps_t *ps, long step) {
  const size_t xlen = sizeof(ck_extra_t) + sizeof(int64_t) * (size_t)ps->nwork;
  unsigned char *x = malloc(xlen);
  chorus__ck_range_t *cr = calloc((size_t)ps->nrange, sizeof *cr);
  chorus_result_t st = x && cr ? CHORUS_OK : CHORUS_ERR_NO_MEMORY;
  int nr = 0;
  for (int k = 0; k < ps->nrange && st == CHORUS_OK; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || !r->ck_par) continue;
    st = chorus_optim_state_load(r->ck_opt, r->ck_blob, chorus_optim_state_size(r->ck_opt));
    cr[nr++] = (chorus__ck_range_t){r->ck_opt, r->ck_par, r->lo, r->n, r->id};
  }
  ps->ck_count++;
  if (st == CHORUS_OK) {
    memcpy(x, &ps->ck_x, sizeof ps->ck_x);
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p = ps->ck_pushes[w];
      memcpy(x + sizeof ps->ck_x + sizeof p * (size_t)w, &p, sizeof p);
    }
  }
  /* Everyone enters the save (a local failure is part of its agreement). */
  chorus_result_t sv = chorus__ckpt_save_ranges(ps->servers, ps->shape, st == CHORUS_OK ? nr : 0,
                                                cr, ps->nrange, ps->cfg.ckpt_dir, step,
                                                x ? x : (void *)&ps->ck_x,
                                                x ? xlen : sizeof ps->ck_x, ps->cfg.keep);
  if (st == CHORUS_OK) st = sv;
  free(x), free(cr);
  if (st != CHORUS_OK)
    say(ps, "async: server %d: checkpoint of step %ld not written: %s", ps->me, step,
        chorus_train_last_error());
  else if (chorus_comm_rank(ps->servers) == 0)
    say(ps, "checkpoint: %s/ckpt-%09ld (%d server file(s) and an index)", ps->cfg.ckpt_dir, step,
        ps->nrange);
  return st;
}

/* Writes every checkpoint step the updates pass, in order and none
 * skipped, so that every server makes the same collective calls; a
 * snapshot is taken when its turn comes (the state then, at or after the
 * step).  A take-over holds it (ck_hold) and waits until none is being
 * written (ck_busy). */
static void *ck_main(void *arg) {
  chorus_ps_t *ps = arg;
  pthread_mutex_lock(&ps->mu);
  for (;;) {
    while ((ps->ck_done >= ps->ck_crossed || ps->ck_hold) && !ps->ck_quit)
      pthread_cond_wait(&ps->cv, &ps->mu);
    if (ps->ck_done >= ps->ck_crossed || ps->ck_hold) break;
    const long step = (ps->ck_done + 1) * ps->cfg.ckpt_every;
    ps->ck_busy = 1;
    ck_snapshot(ps);
    pthread_mutex_unlock(&ps->mu);
    chorus_result_t st = ck_write(ps, step);
    pthread_mutex_lock(&ps->mu);
    ps->ck_busy = 0;
    ps->ck_done++;
    if (st == CHORUS_OK) ps->ck_last = step;
    pthread_cond_broadcast(&ps->cv);
  }
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* Packs range r's state (FULL) or its last update (UPDATE) into mbuf:
 * the floats first (parameters, or the averaged gradient), then for a
 * FULL the optimizer state, then the per-worker records and statistics.
 * Lock held. */
static void pack(range_t *r, unsigned char *dst, int kind, const float *g, int acc_k, float lr) {
  chorus_ps_t *ps = r->ps;
  unsigned char *p = dst;
  memcpy(p, g, r->n * sizeof(float));
  p += r->n * sizeof(float);
  if (kind == X_FULL) {
    chorus_optim_state_save(r->opt, p);
    p += chorus_optim_state_size(r->opt);
  }
  memcpy(p, r->wr, sizeof(wrec_t) * (size_t)ps->nwork);
  p += sizeof(wrec_t) * (size_t)ps->nwork;
  memcpy(p, &r->st, sizeof r->st);
  p += sizeof r->st;
  r->mh = (mhdr_t){MIR_MAGIC, (uint32_t)kind, r->id, acc_k, r->version, r->applied, lr, 0,
                   (uint64_t)(p - dst)};
  r->inflight = 1;
  r->t_sent = now_ns();
}

/* The updates seen here have passed `step` of the budget: the checkpoint
 * steps up to it are due (ck_main writes them).  Lock held. */
static void ck_pass(chorus_ps_t *ps, long step) {
  const long every = ps->cfg.ckpt_every;
  if (!ps->cfg.ckpt_dir || every <= 0 || step >= ps->cfg.steps || step / every <= ps->ck_crossed)
    return;
  ps->ck_crossed = step / every;
  pthread_cond_broadcast(&ps->cv);
}

/* One update from the gradients summed so far.  Lock held. */
static void apply(range_t *r) {
  chorus_ps_t *ps = r->ps;
  const size_t n = r->n;
  const chorus_ps_config_t *c = &ps->cfg;
  if (r->held)
    for (int w = 0; w < ps->nwork; w++)
      if (r->pend[w] >= 0)
        for (size_t i = 0; i < n; i++) r->acc[i] += r->held[w][i];
  const double inv = 1.0 / (double)r->acc_k;
  for (size_t i = 0; i < n; i++) r->avg[i] = (float)(r->acc[i] * inv);
  if (c->clip > 0) chorus_grad_clip(r->avg, n, chorus_grad_norm(r->avg, n), c->clip);
  /* The schedule's rate at this point of the budget, scaled by the share
   * of a synchronous step's batch the update averages (the linear scaling
   * rule): k gradients of W move the weights k / W as far, so a token
   * counts the same whatever the staleness bound, and S = 0 is DDP. */
  const int k = r->acc_k;
  const float lr = chorus_lr_at(r->applied / ps->nwork, c->warmup, c->steps, c->lr, c->min_lr) *
                   (float)k / (float)ps->nwork;
  chorus_optim_begin_step(r->opt);
  chorus_optim_update(r->opt, 0, r->par, r->avg, n, lr);
  r->applied += k;
  r->acc_k = 0;
  r->version++;
  for (int w = 0; w < ps->nwork; w++)
    if (r->pend[w] >= 0) {
      r->wr[w].pushes++;
      r->wr[w].last_step = r->pend[w];
      r->wr[w].ver = r->version;
      r->pend[w] = -1;
    }
  memset(r->acc, 0, n * sizeof(double));
  ps->t_last = now_ns();
  r->st.seconds = (double)(ps->t_last - ps->t_first) / 1e9;
  /* The copy takes the same step. */
  if (r->mproc >= 0) pack(r, r->mbuf, X_UPDATE, r->avg, k, lr);
  const long step = r->applied / ps->nwork;
  if (r->id == 0 && c->log_every > 0 && step >= ps->log_next && ps->log_n) {
    const double dt = (double)(ps->t_last - ps->t_log) / 1e9;
    say(ps, "async step %5ld/%ld  loss %.4f  lr %.2e  %.0f tok/s  staleness mean %.2f max %ld  "
        "version %lld  (%ld gradient(s))", step, c->steps, ps->log_loss / (double)ps->log_n, lr,
        dt > 0 ? ps->log_tok / dt : 0.0, ps->log_stale / (double)ps->log_n, ps->log_smax,
        (long long)r->version, ps->log_n);
    ps->log_loss = ps->log_tok = ps->log_stale = 0;
    ps->log_n = ps->log_smax = 0;
    ps->t_log = ps->t_last;
    while (ps->log_next <= step) ps->log_next += c->log_every;
  }
  /* A checkpoint step is passed once every range served here passed it
   * (the snapshot must be at or after it for each). */
  long least = step;
  for (int q = 0; q < ps->nrange; q++)
    if (ps->rg[q].role == R_PRIMARY && ps->rg[q].applied / ps->nwork < least)
      least = ps->rg[q].applied / ps->nwork;
  ck_pass(ps, least);
  pthread_cond_broadcast(&ps->cv);
}

/* Applies the summed gradients if no worker still computing would then be
 * more than max_staleness versions behind, and the copy has the last
 * update.  Lock held. */
static void maybe_apply(range_t *r) {
  if (r->role != R_PRIMARY || r->acc_k == 0 || r->inflight) return;
  for (int w = 0; w < r->ps->nwork; w++) {
    /* A worker whose gradient is applied but who was not answered yet
     * (its thread has not woken) computes next on what it will be
     * handed: at least hand_ver. */
    const int64_t u = r->wst[w] == W_COMPUTING                     ? r->u[w]
                      : r->wst[w] == W_WAITING && r->pend[w] < 0 ? hand_ver(r)
                                                                 : INT64_MAX;
    if (u != INT64_MAX && r->version + 1 - u > r->ps->cfg.max_staleness) return;
  }
  apply(r);
}

/* The worker is gone (it left, or was dropped).  Lock held. */
static void gone(slot_t *sl) {
  chorus_ps_t *ps = sl->ps;
  sl->gone = 1;
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || r->wst[sl->w] == W_GONE) continue;
    r->wst[sl->w] = W_GONE; /* a gradient of it in acc stays in */
    maybe_apply(r);
  }
  pthread_cond_broadcast(&ps->cv);
}

/* The transport speaks of a group that fails as one; a pair does not:
 * its words to that effect go from a message. */
static void pair_words(char *why) {
  static const char group[] = "; every other rank fails too";
  char *cut = strstr(why, group);
  if (cut) memmove(cut, cut + sizeof group - 1, strlen(cut + sizeof group - 1) + 1);
}

/* A pair communicator's last error, in a pair's words. */
static void pair_error(chorus_comm_t c, char *why, size_t cap) {
  snprintf(why, cap, "%s", chorus_comm_last_error(c));
  pair_words(why);
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
  /* A worker told to stop everywhere has nothing left here to lose. */
  int was = 0;
  for (int k = 0; !sl->gone && k < ps->nrange; k++)
    was |= ps->rg[k].role == R_PRIMARY && ps->rg[k].wst[sl->w] != W_GONE;
  if (was) ps->dropped++;
  gone(sl);
  int alive = 0;
  for (int w = 0; w < ps->nwork; w++) alive += !ps->slots[w].gone;
  const int failed = ps->failed;
  pthread_mutex_unlock(&ps->mu);
  if (was && !failed)
    say(ps, "async: server %d dropped worker %d (rank %d): %s; %d worker(s) go on; the rest of "
        "its data is not trained on (lost), the budget is filled by the others", ps->me, sl->w,
        ps->nproc + sl->w, why, alive);
}

/* Sends the worker an answer (m, then m->count floats of data): 0, or -1
 * when it could not go (the worker is dropped). */
static int reply(slot_t *sl, msg_t *m, const float *data) {
  chorus_result_t st = chorus_send(sl->comm, m, sizeof *m, CHORUS_UINT8, 1, TAG_HDR, NULL);
  if (st == CHORUS_OK && m->count)
    st = chorus_send(sl->comm, data, m->count, CHORUS_FLOAT32, 1, TAG_DATA, NULL);
  if (st == CHORUS_OK) return 0;
  drop(sl, "%s", chorus_comm_last_error(sl->comm));
  return -1;
}

/* Tells the worker it is refused for good, and drops it. */
static void fatal(slot_t *sl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fatal(slot_t *sl, const char *fmt, ...) {
  msg_t m;
  memset(&m, 0, sizeof m);
  m.magic = PS_MAGIC;
  m.kind = M_FATAL;
  m.range = -1;
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

/* Range r's parameters for a worker, and its state: computing on them.
 * Lock held. */
static void hand_out(slot_t *sl, range_t *r, msg_t *m, int kind) {
  memcpy(sl->out, hand_par(r), r->n * sizeof(float));
  memset(m, 0, sizeof *m);
  m->magic = PS_MAGIC;
  m->kind = (uint32_t)kind;
  m->range = r->id;
  m->mirror = r->mproc;
  m->version = hand_ver(r);
  m->count = r->n;
  r->u[sl->w] = hand_ver(r);
  r->wst[sl->w] = W_COMPUTING;
}

/* A HELLO: once every worker is here (so that a synchronous run has them
 * all in its first update) and the copies have the start, the parameters
 * of every range served here.  0, or -1 (the worker was dropped). */
static int hello(slot_t *sl) {
  chorus_ps_t *ps = sl->ps;
  pthread_mutex_lock(&ps->mu);
  if (ps->t_first == 0) ps->t_first = ps->t_log = now_ns();
  ps->hellos++;
  pthread_cond_broadcast(&ps->cv);
  const int64_t until = deadline_of(sl->comm);
  int to = 0;
  for (;;) {
    int left = 0, unsynced = 0;
    for (int w = 0; w < ps->nwork; w++) left += ps->slots[w].gone;
    for (int k = 0; k < ps->nrange; k++)
      unsynced += ps->rg[k].role == R_PRIMARY && hand_ver(&ps->rg[k]) < 0;
    if ((ps->hellos + left >= ps->nwork && !unsynced) || ps->failed || to) break;
    to = wait_until(ps, until) == ETIMEDOUT;
  }
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY) continue;
    if (hand_ver(r) < 0) {
      pthread_mutex_unlock(&ps->mu);
      drop(sl, "range %d's copy never acknowledged its start", r->id);
      return -1;
    }
    msg_t m;
    hand_out(sl, r, &m, M_PARAMS);
    m.step = ps->start_step[sl->w];
    pthread_mutex_unlock(&ps->mu);
    if (reply(sl, &m, sl->out) != 0) return -1;
    pthread_mutex_lock(&ps->mu);
  }
  pthread_mutex_unlock(&ps->mu);
  return 0;
}

/* A PUSH whose header is h: receives the gradient, adds it, answers once
 * the update it went into is on the copy.  0, or -1 (the worker was
 * dropped). */
static int push(slot_t *sl, const msg_t *h) {
  chorus_ps_t *ps = sl->ps;
  const int S = ps->cfg.max_staleness, w = sl->w;
  if (h->range < 0 || h->range >= ps->nrange) {
    fatal(sl, "a push for range %d, but there are %d", h->range, ps->nrange);
    return -1;
  }
  range_t *r = &ps->rg[h->range];
  const size_t n = r->n;
  if (h->count != n) {
    fatal(sl, "a gradient of %llu floats, but server %d holds %zu for range %d (floats [%zu, "
          "%zu) of %zu): the worker's model is not the servers'", (unsigned long long)h->count,
          ps->me, n, r->id, r->lo, r->lo + n, ps->np);
    return -1;
  }
  if (chorus_recv(sl->comm, sl->g, n, CHORUS_FLOAT32, 1, TAG_DATA, NULL) != CHORUS_OK) {
    drop(sl, "%s", chorus_comm_last_error(sl->comm));
    return -1;
  }
  const double sq = chorus_grad_sumsq(sl->g, n);
  msg_t m;
  memset(&m, 0, sizeof m);
  pthread_mutex_lock(&ps->mu);
  /* The range may be on its way here: its server died and this process,
   * keeping its copy, takes it over once the servers agree on that. */
  const int64_t until = deadline_of(sl->comm);
  int to = 0;
  while (r->role == R_MIRROR && !ps->failed && !to) to = wait_until(ps, until) == ETIMEDOUT;
  if (r->role != R_PRIMARY) {
    const int role = r->role;
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a push for range %d, which server process %d does not serve%s", r->id, ps->me,
          role == R_MIRROR ? " (it keeps the range's copy, and its server is alive)" : "");
    return -1;
  }
  if (r->wst[w] == W_NEW) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a push before its hello");
    return -1;
  }
  if (r->wst[w] == W_GONE) {
    /* Told to stop already: it is again. */
    pthread_mutex_unlock(&ps->mu);
    m = (msg_t){.magic = PS_MAGIC, .kind = M_STOP, .range = r->id, .mirror = -1};
    return reply(sl, &m, NULL);
  }
  if (h->step <= r->wr[w].last_step) {
    /* Sent again after a take-over, but already applied (the copy has
     * it): its answer only. */
    const int stop = r->applied >= ps->budget;
    hand_out(sl, r, &m, stop ? M_STOP : M_PARAMS);
    m.step = 1;
    if (stop) m.count = 0, r->wst[w] = W_GONE, maybe_apply(r);
    pthread_mutex_unlock(&ps->mu);
    return reply(sl, &m, sl->out);
  }
  const int64_t v = r->version;
  /* A range taken over does not know what its dead server handed out
   * last: anything up to its version is allowed. */
  const int64_t newest = r->adopted && r->version > r->u[w] ? r->version : r->u[w];
  if (h->version < 0 || h->version > newest) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a gradient claiming version %lld, but range %d handed it version %lld",
          (long long)h->version, r->id, (long long)newest);
    return -1;
  }
  const int64_t tau = v - h->version;
  int refuse = 0;
  if (tau > S) {
    snprintf(m.text, sizeof m.text, "server %d refused the gradient of step %lld: it was "
             "computed on version %lld, %lld versions old, and --max-staleness is %d", ps->me,
             (long long)h->step, (long long)h->version, (long long)tau, S);
    refuse = 1;
  } else if (!isfinite(sq) || !isfinite(h->loss)) {
    snprintf(m.text, sizeof m.text, "server %d refused the gradient of step %lld: it holds inf "
             "or NaN", ps->me, (long long)h->step);
    refuse = 1;
  }
  if (refuse) {
    char text[sizeof m.text];
    memcpy(text, m.text, sizeof text);
    r->st.refused++;
    hand_out(sl, r, &m, M_REFUSED);
    memcpy(m.text, text, sizeof text);
    m.staleness = tau;
    maybe_apply(r); /* it computes on the newest version now */
    pthread_mutex_unlock(&ps->mu);
    say(ps, "async: %s (worker %d)", m.text, w);
    return reply(sl, &m, sl->out);
  }
  if (r->applied + r->acc_k >= ps->budget) {
    /* The budget is full: this one is not needed. */
    r->wst[w] = W_GONE;
    maybe_apply(r);
    pthread_cond_broadcast(&ps->cv);
    pthread_mutex_unlock(&ps->mu);
    m = (msg_t){.magic = PS_MAGIC, .kind = M_STOP, .range = r->id, .mirror = -1, .version = v};
    return reply(sl, &m, NULL);
  }
  const float wgt = ps->cfg.staleness_weight ? 1.0f / (1.0f + (float)tau) : 1.0f;
  if (S == 0 && !r->held) r->held = calloc((size_t)ps->nwork, sizeof *r->held);
  if (S == 0 && r->held && !r->held[w]) r->held[w] = malloc(n * sizeof(float) + 1);
  if (S == 0 && r->held && r->held[w])
    memcpy(r->held[w], sl->g, n * sizeof(float)); /* added at the update, in worker order */
  else if (S == 0) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "server %d is out of memory for a gradient of range %d", ps->me, r->id);
    return -1;
  } else if (wgt == 1.0f)
    for (size_t i = 0; i < n; i++) r->acc[i] += sl->g[i];
  else
    for (size_t i = 0; i < n; i++) r->acc[i] += (double)(wgt * sl->g[i]);
  r->acc_k++;
  r->pend[w] = h->step;
  r->st.hist[tau < CHORUS_PS_HIST - 1 ? tau : CHORUS_PS_HIST - 1]++;
  r->st.tokens += h->tokens;
  r->st.loss_sum += h->loss;
  r->st.loss_n++;
  if (r->id == 0) {
    ps->log_loss += h->loss, ps->log_tok += h->tokens, ps->log_stale += (double)tau;
    ps->log_n++;
    if (tau > ps->log_smax) ps->log_smax = (long)tau;
  }
  if ((r->applied + r->acc_k) * 10 > ps->budget * 9) r->st.tail_sum += h->loss, r->st.tail_n++;
  r->wst[w] = W_WAITING;
  maybe_apply(r);
  int64_t wait_end = deadline_of(sl->comm);
  while (hand_ver(r) <= v && !ps->failed && r->role == R_PRIMARY) {
    if (wait_until(ps, wait_end) != ETIMEDOUT) continue;
    /* A whole timeout without the update: the workers still computing
     * that hold it back have not pushed for that long.  They go. */
    slot_t *late[64];
    int nl = 0;
    for (int o = 0; o < ps->nwork && nl < 64; o++)
      if (r->wst[o] == W_COMPUTING && r->version + 1 - r->u[o] > S) late[nl++] = &ps->slots[o];
    pthread_mutex_unlock(&ps->mu);
    for (int i = 0; i < nl; i++) {
      drop(late[i], "it held the others' update back for a whole timeout (CHORUS_TIMEOUT) "
           "without pushing");
      chorus_comm_abort(late[i]->comm);
    }
    pthread_mutex_lock(&ps->mu);
    wait_end = deadline_of(sl->comm);
  }
  if (hand_ver(r) <= v) {
    pthread_mutex_unlock(&ps->mu);
    drop(sl, "the servers failed");
    return -1;
  }
  const int stop = r->applied >= ps->budget;
  hand_out(sl, r, &m, stop ? M_STOP : M_PARAMS);
  m.staleness = tau;
  m.step = 1; /* its gradient is in */
  if (stop) {
    m.count = 0;
    r->wst[w] = W_GONE;
    maybe_apply(r);
  }
  pthread_mutex_unlock(&ps->mu);
  return reply(sl, &m, sl->out);
}

static void *serve_worker(void *arg) {
  slot_t *sl = arg;
  chorus_ps_t *ps = sl->ps;
  int said_hello = 0;
  for (;;) {
    msg_t h;
    chorus_result_t st = chorus_recv(sl->comm, &h, sizeof h, CHORUS_UINT8, 1, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      drop(sl, "%s", chorus_comm_last_error(sl->comm));
      break;
    }
    if (h.magic == PS_MAGIC && h.kind == M_BYE) {
      /* The budget is applied (here or on another range): it leaves. */
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
    const int left = sl->gone; /* another thread may have dropped it */
    pthread_mutex_unlock(&ps->mu);
    if (left) break;
    if (h.kind == M_HELLO) {
      if (said_hello) {
        fatal(sl, "a second hello");
        break;
      }
      said_hello = 1;
      if (hello(sl) != 0) break;
      continue;
    }
    if (push(sl, &h) != 0) break;
  }
  pthread_mutex_lock(&ps->mu);
  gone(sl);
  ps->running--;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* Starts the thread of every worker not served yet, not gone.  Lock held. */
static void start_slots(chorus_ps_t *ps) {
  for (int w = 0; w < ps->nwork; w++) {
    slot_t *sl = &ps->slots[w];
    if (sl->started || sl->gone) continue;
    if (pthread_create(&sl->th, NULL, serve_worker, sl) != 0) {
      sl->gone = 1;
      continue;
    }
    sl->started = 1;
    ps->running++;
  }
}

/* ------------------------------------------------------------ mirrors */

/* Peer rank of server process p on its pair communicator with this one. */
static int speer(const chorus_ps_t *ps, int p) { return p < ps->me ? 0 : 1; }

/* The primary's side of range r's copy: the whole state once, then every
 * update; each waits for its ACK.  On a failure the range goes on without
 * a copy. */
static void *tx_main(void *arg) {
  range_t *r = arg;
  chorus_ps_t *ps = r->ps;
  const int q = r->mproc, peer = speer(ps, q);
  chorus_comm_t c = ps->spair[q];
  char why[600] = "";
  unsigned char *full = malloc(full_bytes(ps, r));
  pthread_mutex_lock(&ps->mu);
  if (full) pack(r, full, X_FULL, r->par, 0, 0.0f);
  else snprintf(why, sizeof why, "out of memory for the range's state");
  for (; !why[0];) {
    const mhdr_t mh = r->mh;
    pthread_mutex_unlock(&ps->mu);
    chorus_result_t st = chorus_send(c, &mh, sizeof mh, CHORUS_UINT8, peer, TAG_MHDR(r->id), NULL);
    if (st == CHORUS_OK && mh.kind != X_END)
      st = chorus_send(c, mh.kind == X_FULL ? full : r->mbuf, mh.bytes, CHORUS_UINT8, peer,
                       TAG_MDATA(r->id), NULL);
    mhdr_t ack;
    memset(&ack, 0, sizeof ack);
    if (st == CHORUS_OK && mh.kind != X_END)
      st = chorus_recv(c, &ack, sizeof ack, CHORUS_UINT8, peer, TAG_MACK(r->id), NULL);
    if (st != CHORUS_OK) pair_error(c, why, sizeof why);
    else if (mh.kind != X_END && (ack.magic != MIR_MAGIC || ack.kind != X_ACK ||
                                  ack.range != r->id || ack.version != mh.version))
      snprintf(why, sizeof why, "a malformed acknowledgement (kind %u, range %d, version %lld "
               "for %lld)", ack.kind, ack.range, (long long)ack.version, (long long)mh.version);
    pthread_mutex_lock(&ps->mu);
    if (why[0] || mh.kind == X_END) break;
    free(full); /* the FULL is through */
    full = NULL;
    r->acked = mh.version;
    memcpy(r->hand, r->par, r->n * sizeof(float)); /* no update since: inflight held it */
    if (mh.kind == X_UPDATE) r->mwait += (double)(now_ns() - r->t_sent) / 1e9;
    r->inflight = 0;
    maybe_apply(r);
    pthread_cond_broadcast(&ps->cv);
    while (!r->inflight && !ps->quit && !ps->served && !r->tx_stop)
      pthread_cond_wait(&ps->cv, &ps->mu);
    if (r->tx_stop) break;
    if (!r->inflight) r->mh = (mhdr_t){MIR_MAGIC, X_END, r->id, 0, r->version, r->applied, 0, 0, 0};
  }
  /* Lock held. */
  free(full);
  const int lost = why[0] && !ps->quit && !r->tx_stop;
  r->mproc = -1;
  r->inflight = 0;
  maybe_apply(r);
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  if (lost) {
    chorus_comm_abort(c); /* the copy must know it is one no more */
    say(ps, "async: server %d: range %d's copy on server process %d is gone: %s; the range goes "
        "on without a copy", ps->me, r->id, q, why);
  }
  return NULL;
}

/* The copy's side: takes in the state, then every update (the same
 * optimizer step as the primary's), acknowledging each as it arrives.
 * Ends at END or when the primary is gone; what it acknowledged is
 * applied by then. */
static void *rx_main(void *arg) {
  range_t *r = arg;
  chorus_ps_t *ps = r->ps;
  const int p = r->from, peer = speer(ps, p);
  chorus_comm_t c = ps->spair[p];
  const size_t fb = full_bytes(ps, r), ub = update_bytes(ps, r), W = (size_t)ps->nwork;
  int end = RX_FAILED;
  char why[600] = "";
  for (;;) {
    mhdr_t h;
    if (chorus_recv(c, &h, sizeof h, CHORUS_UINT8, peer, TAG_MHDR(r->id), NULL) != CHORUS_OK)
      break;
    if (h.magic == MIR_MAGIC && h.kind == X_END && h.range == r->id) {
      end = RX_ENDED;
      break;
    }
    const int full = h.kind == X_FULL;
    if (h.magic != MIR_MAGIC || (!full && h.kind != X_UPDATE) || h.range != r->id ||
        h.bytes != (full ? fb : ub) || (full ? h.version < 0 : (!r->valid ||
        h.version != r->version + 1)) || h.applied < 0 || !isfinite(h.lr)) {
      snprintf(why, sizeof why, "a malformed message (kind %u, range %d, %llu bytes, version "
               "%lld after %lld)", h.kind, h.range, (unsigned long long)h.bytes,
               (long long)h.version, (long long)r->version);
      chorus_comm_abort(c);
      break;
    }
    unsigned char *in = full ? malloc(h.bytes) : r->rbuf; /* the FULL comes once */
    if (!in) {
      snprintf(why, sizeof why, "a state too big for this process's memory (%llu bytes)",
               (unsigned long long)h.bytes);
      chorus_comm_abort(c);
      break;
    }
    if (chorus_recv(c, in, h.bytes, CHORUS_UINT8, peer, TAG_MDATA(r->id), NULL) != CHORUS_OK) {
      if (full) free(in);
      break;
    }
    const mhdr_t ack = {MIR_MAGIC, X_ACK, r->id, 0, h.version, h.applied, 0, 0, 0};
    const int acked = chorus_send(c, &ack, sizeof ack, CHORUS_UINT8, peer, TAG_MACK(r->id),
                                  NULL) == CHORUS_OK;
    /* Applied whether or not the ACK went: the update is whole. */
    const unsigned char *b = in;
    const float *g = (const float *)b;
    b += r->n * sizeof(float);
    if (full) {
      memcpy(r->par, g, r->n * sizeof(float));
      const size_t blob = chorus_optim_state_size(r->opt);
      if (chorus_optim_state_load(r->opt, b, blob) != CHORUS_OK) {
        snprintf(why, sizeof why, "an optimizer state that does not load");
        chorus_comm_abort(c);
        free(in);
        break;
      }
      b += blob;
    } else {
      chorus_optim_begin_step(r->opt);
      chorus_optim_update(r->opt, 0, r->par, g, r->n, h.lr);
    }
    memcpy(r->wr, b, sizeof(wrec_t) * W);
    memcpy(&r->st, b + sizeof(wrec_t) * W, sizeof r->st);
    if (full) free(in);
    r->version = h.version;
    r->applied = (long)h.applied;
    /* A standby serves nothing, but takes part in every checkpoint: the
     * updates of the range it keeps tell it when. */
    if (!full) {
      pthread_mutex_lock(&ps->mu);
      ck_pass(ps, r->applied / ps->nwork);
      pthread_mutex_unlock(&ps->mu);
    }
    if (full) {
      r->version0 = h.version;
      pthread_mutex_lock(&ps->mu);
      r->valid = 1;
      pthread_mutex_unlock(&ps->mu);
    }
    if (!acked) break;
  }
  pthread_mutex_lock(&ps->mu);
  if (why[0]) r->valid = 0; /* a copy that took something malformed is none */
  r->rx_end = end;
  r->rx_end_ns = now_ns();
  ps->rx_running--;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  if (why[0])
    say(ps, "async: server %d: range %d's primary (server process %d) sent %s: this process "
        "keeps no copy of it from now on", ps->me, r->id, p, why);
  return NULL;
}

/* This process serves range r from now on, from its copy.  Lock held;
 * its rx thread has ended. */
static int adopt(chorus_ps_t *ps, range_t *r) {
  if (!r->acc) r->acc = calloc(r->n + 1, sizeof(double));
  if (!r->avg) r->avg = malloc(r->n * sizeof(float) + 1);
  if (!r->acc || !r->avg) return -1;
  r->role = R_PRIMARY;
  r->adopted = 1;
  r->mproc = -1;
  r->inflight = 0;
  r->acc_k = 0;
  memset(r->acc, 0, r->n * sizeof(double));
  for (int w = 0; w < ps->nwork; w++) {
    r->pend[w] = -1;
    r->wst[w] = ps->slots[w].gone ? W_GONE : W_COMPUTING;
    /* What its server handed out last is not known: the version its last
     * gradient made (the staleness bound then holds the next update back
     * until it is heard from, never lets one pass too early). */
    r->u[w] = r->wr[w].ver >= 0 ? r->wr[w].ver : r->version0;
  }
  ps->takeovers++;
  /* A standby's clock starts where the dead server's stood. */
  const int64_t now = now_ns();
  if (ps->t_first == 0) ps->t_first = ps->t_log = now - (int64_t)(r->st.seconds * 1e9);
  if (ps->t_last < now) ps->t_last = now;
  if (ps->cfg.ckpt_dir && range_ck_alloc(ps, r) != 0)
    say(ps, "async: server %d: no memory for range %d's checkpoints: the checkpoints from now "
        "on fail", ps->me, r->id);
  if (!ps->quit) start_slots(ps);
  pthread_cond_broadcast(&ps->cv);
  return 0;
}

/* After a server process died: the survivors agree on who is left (a
 * shrink of the servers' communicator), then on who serves each range --
 * a range whose server died goes to the process keeping its copy -- and
 * on the checkpoints written.  0, or -1 with why (a range lost, or no
 * agreement). */
static int failover(chorus_ps_t *ps, char *why, size_t cap) {
  const int P = ps->nproc, S = ps->nrange;
  const int64_t t0 = now_ns();
  pthread_mutex_lock(&ps->mu);
  ps->ck_hold = 1;
  pthread_mutex_unlock(&ps->mu);
  chorus_comm_abort(ps->servers); /* a checkpoint being written on it ends */
  pthread_mutex_lock(&ps->mu);
  while (ps->ck_busy) pthread_cond_wait(&ps->cv, &ps->mu);
  pthread_mutex_unlock(&ps->mu);
  chorus_comm_t nc = NULL;
  const size_t L = 2 + 2 * (size_t)S;
  int64_t *who = NULL, *rec = calloc(L, sizeof *rec), *all = NULL;
  int *alive = calloc((size_t)P, sizeof *alive), *taken = calloc((size_t)S, sizeof *taken);
  int *nowner = calloc((size_t)S, sizeof *nowner), *nmirror = calloc((size_t)S, sizeof *nmirror);
  int rc = -1, n = 0;
  if (!rec || !alive || !taken || !nowner || !nmirror) {
    snprintf(why, cap, "out of memory");
    goto out;
  }
  chorus_result_t st = chorus_comm_shrink(ps->servers, 0, &nc);
  if (st != CHORUS_OK) {
    snprintf(why, cap, "the surviving servers could not agree on who is left: %s",
             chorus_comm_last_error(ps->servers));
    goto out;
  }
  n = chorus_comm_size(nc);
  who = calloc((size_t)n, sizeof *who);
  all = calloc((size_t)n * L, sizeof *all);
  int64_t mine = ps->me;
  if (!who || !all) {
    snprintf(why, cap, "out of memory");
    goto out;
  }
  if ((st = chorus_all_gather(nc, &mine, who, 1, CHORUS_INT64, NULL)) != CHORUS_OK) {
    snprintf(why, cap, "learning who is left: %s", chorus_comm_last_error(nc));
    goto out;
  }
  for (int i = 0; i < n; i++) {
    if (who[i] < 0 || who[i] >= P || alive[who[i]]) {
      snprintf(why, cap, "the survivors' list is malformed (process %lld)", (long long)who[i]);
      goto out;
    }
    alive[who[i]] = 1;
  }
  /* Stop talking to the dead: the copies' links with them end, and what
   * a copy acknowledged is applied once its thread is joined. */
  for (int p = 0; p < P; p++)
    if (!alive[p] && ps->spair[p]) chorus_comm_abort(ps->spair[p]);
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < S; k++) {
    range_t *r = &ps->rg[k];
    if (r->role == R_PRIMARY && r->tx_started && r->mproc >= 0 && !alive[r->mproc]) {
      r->tx_stop = 1;
      pthread_cond_broadcast(&ps->cv);
      pthread_mutex_unlock(&ps->mu);
      pthread_join(r->tx, NULL);
      pthread_mutex_lock(&ps->mu);
      r->tx_started = 0;
    }
    if (r->role == R_MIRROR && r->rx_started && !alive[r->from]) {
      pthread_mutex_unlock(&ps->mu);
      pthread_join(r->rx, NULL);
      pthread_mutex_lock(&ps->mu);
      r->rx_started = 0;
    }
  }
  /* What each survivor holds: the ranges it serves, and whole copies
   * still good (being kept up to date, or complete: their server ended,
   * or died). */
  rec[0] = ps->me;
  rec[1] = ps->ck_done;
  for (int k = 0; k < S; k++) {
    const range_t *r = &ps->rg[k];
    rec[2 + k] = r->role == R_PRIMARY;
    rec[2 + S + k] = r->role == R_MIRROR && r->valid &&
                     (r->rx_end != RX_FAILED || !alive[r->from]);
  }
  pthread_mutex_unlock(&ps->mu);
  if ((st = chorus_all_gather(nc, rec, all, L, CHORUS_INT64, NULL)) != CHORUS_OK) {
    snprintf(why, cap, "learning who holds what: %s", chorus_comm_last_error(nc));
    goto out;
  }
  /* The same decision on every survivor. */
  long ck_max = 0;
  for (int i = 0; i < n; i++) ck_max = all[i * L + 1] > ck_max ? (long)all[i * L + 1] : ck_max;
  for (int k = 0; k < S; k++) {
    int prim = -1, copy = -1;
    for (int i = 0; i < n; i++) {
      if (all[i * L + 2 + k]) {
        if (prim >= 0) {
          snprintf(why, cap, "range %d has two servers (processes %d and %lld)", k, prim,
                   (long long)all[i * L]);
          goto out;
        }
        prim = (int)all[i * L];
      }
      if (all[i * L + 2 + S + k] && copy < 0) copy = (int)all[i * L];
    }
    if (prim < 0 && copy < 0) {
      char also[96] = "it had no copy";
      if (ps->mholder[k] >= 0)
        snprintf(also, sizeof also, "so did its copy's, process %d", ps->mholder[k]);
      snprintf(why, cap, "range %d (floats [%zu, %zu)) is gone: its server, process %d, died, "
               "and %s", k, ps->lo[k], ps->lo[k] + ps->cnt[k], ps->owner[k], also);
      goto out;
    }
    taken[k] = prim < 0;
    nowner[k] = prim >= 0 ? prim : copy;
    nmirror[k] = prim >= 0 && copy >= 0 && copy == ps->mholder[k] ? copy : -1;
  }
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < S; k++) {
    range_t *r = &ps->rg[k];
    if (taken[k]) {
      const int dead = ps->owner[k];
      if (nowner[k] == ps->me && adopt(ps, r) != 0) {
        /* every survivor must hear that the range is gone: it fails the
         * servers' communicator, and they stop at their next look */
        snprintf(why, cap, "server %d is out of memory to take range %d over", ps->me, k);
        pthread_mutex_unlock(&ps->mu);
        chorus_comm_abort(nc);
        goto out;
      }
      if (nowner[k] == ps->me) {
        say(ps, "async: server process %d died; server %d took its range %d over from its copy "
            "(version %lld, %ld gradients applied) %.0f ms after the failure was seen; the range "
            "has no copy from now on", dead, ps->me, k, (long long)r->version, r->applied,
            (double)(now_ns() - t0) / 1e6);
      }
    }
    if (r->role == R_PRIMARY && !taken[k] && ps->mholder[k] >= 0 && nmirror[k] < 0)
      say(ps, "async: server %d: range %d's copy (on process %d) is gone; the range goes on "
          "without one", ps->me, k, ps->mholder[k]);
    if (r->role == R_MIRROR && nmirror[k] != ps->me && !r->rx_started && r->rx_end == RX_FAILED)
      r->role = R_NONE; /* a copy nobody counts on */
    ps->owner[k] = nowner[k];
    ps->mholder[k] = nmirror[k];
  }
  for (int p = 0; p < P; p++) ps->crank[p] = -1;
  for (int i = 0; i < n; i++) ps->crank[who[i]] = i;
  if (ck_max > ps->ck_done) ps->ck_done = ck_max; /* checkpoints another tried count as tried */
  if (ps->ck_crossed < ps->ck_done) ps->ck_crossed = ps->ck_done;
  chorus_comm_destroy(ps->servers);
  ps->servers = nc;
  nc = NULL;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  rc = 0;
out:
  if (nc) chorus_comm_destroy(nc);
  pthread_mutex_lock(&ps->mu);
  ps->ck_hold = 0;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  free(who), free(rec), free(all), free(alive), free(taken), free(nowner), free(nmirror);
  return rc;
}

/* Resumes from the newest checkpoint: the range served here, and the
 * progress (a checkpoint of the servers, or of a synchronous run: then
 * every worker starts at its step).  A standby takes part with nothing. */
static chorus_result_t resume(chorus_ps_t *ps) {
  const size_t cap = sizeof(ck_extra_t) + sizeof(int64_t) * MAX_CK_WORKERS;
  unsigned char *x = malloc(cap);
  if (!x) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_serve: out of memory");
  long step = -1;
  size_t xlen = 0;
  chorus_ckpt_info_t info;
  range_t *r = ps->me < ps->nrange ? &ps->rg[ps->me] : NULL;
  chorus_result_t st = chorus__ckpt_load_range(ps->servers, ps->shape, r ? r->opt : ps->opt0,
                                               r ? r->par : NULL, r ? r->lo : 0, r ? r->n : 0,
                                               ps->cfg.ckpt_dir, &step, x, cap, &xlen, &info);
  if (st != CHORUS_OK || step < 0) {
    free(x);
    return st;
  }
  ck_extra_t e;
  memset(&e, 0, sizeof e);
  if (xlen >= sizeof e) memcpy(&e, x, sizeof e);
  long applied;
  int64_t version;
  if (xlen >= sizeof e && e.magic == CK_EXTRA_MAGIC && e.workers == ps->nwork &&
      xlen == sizeof e + sizeof(int64_t) * (size_t)e.workers && e.applied >= 0 &&
      e.version >= 0) {
    applied = (long)e.applied;
    version = e.version;
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p;
      memcpy(&p, x + sizeof e + sizeof p * (size_t)w, sizeof p);
      ps->start_step[w] = p > 0 ? (long)p : 0;
    }
  } else {
    /* Another world or mode wrote it: everybody goes on from its step. */
    applied = step * ps->nwork;
    version = step;
    for (int w = 0; w < ps->nwork; w++) ps->start_step[w] = step;
  }
  if (applied > ps->budget) applied = ps->budget;
  if (r) {
    r->applied = applied;
    r->version = version;
    for (int w = 0; w < ps->nwork; w++)
      r->wr[w] = (wrec_t){ps->start_step[w], ps->start_step[w] - 1, -1};
  }
  ps->resumed_step = step;
  ps->ck_last = step;
  if (ps->cfg.ckpt_every > 0) ps->ck_done = ps->ck_crossed = step / ps->cfg.ckpt_every;
  ps->log_next = step + 1;
  if (ps->me == 0)
    say(ps, "resumed from %s/ckpt-%09ld%s (written by %d rank(s)%s): %ld of %ld gradients "
        "applied", ps->cfg.ckpt_dir, step, info.sharded ? "" : ".bin", info.world,
        e.magic == CK_EXTRA_MAGIC ? ", asynchronous" : "", applied, ps->budget);
  free(x);
  return CHORUS_OK;
}

/* Waits while this process has work: workers to serve, copies to keep, a
 * copy whose primary failed until the servers agree on it.  Watches the
 * other servers meanwhile and runs the take-over when one dies.  Lock
 * held.  0, or -1 (failed; why set). */
static int watch(chorus_ps_t *ps, char *why, size_t cap) {
  for (;;) {
    int unsettled = 0;
    const int64_t now = now_ns(), grace = (int64_t)chorus_comm_timeout_ms(ps->servers) * 1000000;
    for (int k = 0; k < ps->nrange; k++) {
      range_t *r = &ps->rg[k];
      if (r->role != R_MIRROR || r->rx_started == 0 || r->rx_end != RX_FAILED) continue;
      /* its primary failed: wait for the agreement, but not forever */
      if (now - r->rx_end_ns < grace) unsettled++;
    }
    const int down = ps->nproc > 1 && !ps->failed && chorus_comm_status(ps->servers) != CHORUS_OK;
    if (ps->running == 0 && !ps->served) {
      ps->served = 1; /* the copies of the ranges served here can end */
      pthread_cond_broadcast(&ps->cv);
    }
    if (!down && ps->running == 0 && ps->rx_running == 0 && !unsettled) return 0;
    if (down) {
      if (!ps->cfg.mirror) {
        snprintf(why, cap, "%s", chorus_comm_last_error(ps->servers));
        return -1;
      }
      pthread_mutex_unlock(&ps->mu);
      int rc = failover(ps, why, cap);
      pthread_mutex_lock(&ps->mu);
      if (rc != 0) return -1;
      continue;
    }
    wait_until(ps, now_ns() + 200 * 1000000);
  }
}

chorus_result_t chorus_ps_serve(chorus_ps_t *ps) {
  if (!ps || !ps->server)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_serve: not a server");
  chorus_result_t st = CHORUS_OK;
  if (ps->cfg.ckpt_dir && (st = resume(ps)) != CHORUS_OK) return st;
  if (ps->cfg.log_every > 0 && ps->log_next == 0) ps->log_next = ps->cfg.log_every;
  if (ps->cfg.ckpt_dir) {
    if (pthread_create(&ps->ck_th, NULL, ck_main, ps) != 0) {
      chorus_comm_abort(ps->servers); /* the other servers must not wait for this one */
      return chorus__train_fail(CHORUS_ERR_SYSTEM, "chorus_ps_serve: cannot start a thread: %s",
                                strerror(errno));
    }
    ps->ck_started = 1;
  }
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role == R_PRIMARY && r->mproc >= 0) {
      if (pthread_create(&r->tx, NULL, tx_main, r) != 0) r->mproc = -1;
      else r->tx_started = 1;
    } else if (r->role == R_MIRROR) {
      if (pthread_create(&r->rx, NULL, rx_main, r) == 0) r->rx_started = 1, ps->rx_running++;
      else r->role = R_NONE;
    }
  }
  /* A standby serves workers only once it takes a range over. */
  if (ps->me < ps->nrange) start_slots(ps);
  char why[600] = "";
  if (watch(ps, why, sizeof why) != 0 && !ps->failed) {
    ps->failed = 1;
    pthread_cond_broadcast(&ps->cv);
    pthread_mutex_unlock(&ps->mu);
    for (int w = 0; w < ps->nwork; w++) chorus_comm_abort(ps->slots[w].comm);
    for (int p = 0; p < ps->nproc; p++)
      if (ps->spair[p]) chorus_comm_abort(ps->spair[p]);
    pthread_mutex_lock(&ps->mu);
  }
  ps->quit = ps->ck_quit = 1;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  for (int w = 0; w < ps->nwork; w++)
    if (ps->slots[w].started) pthread_join(ps->slots[w].th, NULL), ps->slots[w].started = 0;
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->tx_started) pthread_join(r->tx, NULL), r->tx_started = 0;
    if (r->rx_started) pthread_join(r->rx, NULL), r->rx_started = 0;
  }
  if (ps->ck_started) pthread_join(ps->ck_th, NULL);
  ps->ck_started = 0;
  if (ps->failed)
    return chorus__train_fail(CHORUS_ERR_REMOTE,
                              "async: server %d: another server failed, and its parameters "
                              "with it: %s (resume from the last checkpoint)",
                              ps->me, why);
  const range_t *f = first_served(ps);
  const int short_of_budget = f && f->applied < ps->budget && ps->byes == 0;
  /* The final checkpoint, at a step every server reached, if every server
   * made the same checkpoint calls so far (updates that counted different
   * gradients -- one refused a slice another took -- can part them).  A
   * server dying now still hands its ranges to their copies. */
  int64_t agree[3] = {0, 0, 0};
  for (int attempt = 0;; attempt++) {
    const range_t *g = first_served(ps);
    agree[0] = g ? g->applied / ps->nwork : INT64_MAX;
    agree[1] = ps->ck_count;
    agree[2] = -(int64_t)ps->ck_count;
    if (chorus_comm_size(ps->servers) < 2) break;
    st = chorus_all_reduce(ps->servers, agree, agree, 3, CHORUS_INT64, CHORUS_MIN, NULL);
    if (st == CHORUS_OK) break;
    if (!ps->cfg.mirror || attempt >= 2 || failover(ps, why, sizeof why) != 0)
      return chorus__train_fail(st, "async: server %d: agreeing on the final step: %s%s%s", ps->me,
                                chorus_comm_last_error(ps->servers), why[0] ? ": " : "", why);
  }
  const long step = (long)agree[0];
  const long written = ps->cfg.ckpt_every > 0 ? ps->ck_done * ps->cfg.ckpt_every : 0;
  st = CHORUS_OK;
  if (agree[1] != -agree[2]) {
    say(ps, "async: server %d: the servers made %lld to %lld checkpoints (their updates counted "
        "different gradients); no final checkpoint", ps->me, (long long)agree[1],
        (long long)-agree[2]);
  } else if (ps->cfg.ckpt_dir && step > written && step > ps->resumed_step) {
    ck_snapshot(ps);
    st = ck_write(ps, step);
  }
  if (st == CHORUS_OK && short_of_budget && ps->nproc > 1) chorus_comm_abort(ps->servers);
  if (st == CHORUS_OK && short_of_budget)
    st = chorus__train_fail(
        CHORUS_ERR_REMOTE,
        "async: server %d: every worker is gone with %ld of the budget's "
        "%ld gradients applied%s",
        ps->me, f->applied, ps->budget,
        ps->cfg.ckpt_dir ? " (a restart resumes from the checkpoint just written)" : "");
  return st;
}

chorus_result_t chorus_ps_full_params(chorus_ps_t *ps, float *dst) {
  if (!ps || !ps->server)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_full_params: bad arguments");
  const int lead = ps->owner[0], root = ps->crank[lead];
  if (lead == ps->me && !dst) {
    chorus_comm_abort(ps->servers); /* the others must not wait for it */
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ps_full_params: the leader has no buffer");
  }
  chorus_result_t st = CHORUS_OK;
  for (int k = 0; k < ps->nrange && st == CHORUS_OK; k++) {
    const int o = ps->owner[k];
    const range_t *r = &ps->rg[k];
    if (o == lead && lead == ps->me) memcpy(dst + ps->lo[k], r->par, ps->cnt[k] * sizeof(float));
    else if (lead == ps->me)
      st = chorus_recv(ps->servers, dst + ps->lo[k], ps->cnt[k], CHORUS_FLOAT32, ps->crank[o],
                       TAG_GATHER, NULL);
    else if (o == ps->me)
      st = chorus_send(ps->servers, r->par, ps->cnt[k], CHORUS_FLOAT32, root, TAG_GATHER, NULL);
  }
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "async: server %d: gathering the parameters: %s", ps->me,
                              chorus_comm_last_error(ps->servers));
  return CHORUS_OK;
}

/* -------------------------------------------------------------- worker */

/* A worker that fails tells every server at once (they drop it). */
static void abort_pairs(chorus_ps_t *ps) {
  for (int p = 0; p < ps->nproc; p++) chorus_comm_abort(ps->pair[p]);
}

/* A pair with a server process failed: it died, hung, or aborted. */
static chorus_result_t server_gone(chorus_ps_t *ps, int p, chorus_result_t st, const char *more) {
  char why[600];
  pair_error(ps->pair[p], why, sizeof why);
  return chorus__train_fail(
      st, "async: worker %d (rank %d): server %d (rank %d) is gone or failed: %s; %s", ps->me,
      ps->rank, p, p, why, more);
}

/* Sends range r's slice (src: count floats) to its server, asynchronously. */
static chorus_result_t send_slice(chorus_ps_t *ps, int r, const float *src, uint64_t count,
                                  int64_t version, float loss, uint32_t tokens) {
  msg_t *h = &ps->hd[r];
  const int p = ps->owner[r];
  memset(h, 0, sizeof *h);
  h->magic = PS_MAGIC;
  h->kind = M_PUSH;
  h->range = r;
  h->version = version;
  h->count = count;
  h->loss = loss;
  h->tokens = tokens;
  h->step = ps->wstep;
  ps->sent[r] = 1;
  chorus_result_t st =
      chorus_send(ps->pair[p], h, sizeof *h, CHORUS_UINT8, 0, TAG_HDR, &ps->wk[2 * r]);
  if (st == CHORUS_OK)
    st = chorus_send(ps->pair[p], src, count, CHORUS_FLOAT32, 0, TAG_DATA, &ps->wk[2 * r + 1]);
  return st;
}

/* Server process p is gone: each range it served goes to the process
 * keeping its copy, and a gradient it did not answer is sent there.
 * CHORUS_OK, or the error when a range has no copy left. */
static chorus_result_t lost_server(chorus_ps_t *ps, int p, chorus_result_t why_st,
                                   const float *grads, float loss, uint32_t tokens) {
  char why[600];
  pair_error(ps->pair[p], why, sizeof why);
  ps->pdead[p] = 1;
  if (!ps->lost_at) ps->lost_at = now_ns();
  chorus_comm_abort(ps->pair[p]);
  for (int r = 0; r < ps->nrange; r++) {
    if (ps->owner[r] != p) continue;
    const int q = ps->mholder[r];
    if (q < 0 || ps->pdead[q])
      return chorus__train_fail(
          why_st,
          "async: worker %d (rank %d): server %d (rank %d) is gone or failed: "
          "%s; range %d's parameters are lost with it (%s), so the job fails (a "
          "restart resumes from the servers' last checkpoint)",
          ps->me, ps->rank, p, p, why, r,
          q < 0 ? "it had no copy" : "its copy's process is gone too");
    ps->owner[r] = q;
    ps->mholder[r] = -1;
    say(ps, "async: worker %d: server %d is gone (%s); range %d goes to server %d, which kept "
        "its copy", ps->me, p, why, r, q);
    if (!ps->pending[r]) continue;
    /* The gradient goes again to the new server (it knows whether it is
     * in already). */
    for (int i = 2 * r; i < 2 * r + 2; i++) {
      if (ps->wk[i]) chorus_work_wait(ps->wk[i], -1);
      chorus_work_free(ps->wk[i]);
      ps->wk[i] = NULL;
    }
    chorus_result_t st = send_slice(ps, r, grads + ps->lo[r], ps->cnt[r], ps->ver[r], loss, tokens);
    if (st != CHORUS_OK) return lost_server(ps, q, st, grads, loss, tokens);
  }
  return CHORUS_OK;
}

/* Receives one answer from server process p: a range's parameters into
 * params, per its header.  CHORUS_INPROGRESS when p is gone (the caller
 * moves its ranges), else the result. */
static chorus_result_t answer(chorus_ps_t *ps, int p, float *params, chorus_ps_reply_t *rep,
                              long *start, int *range) {
  chorus_comm_t c = ps->pair[p];
  msg_t h;
  *range = -1;
  chorus_result_t st = chorus_recv(c, &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
  if (st != CHORUS_OK) return CHORUS_INPROGRESS;
  h.text[sizeof h.text - 1] = '\0';
  if (h.magic == PS_MAGIC && h.kind == M_FATAL) {
    chorus_comm_abort(c);
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "async: worker %d (rank %d): server %d refused it: %s", ps->me,
                              ps->rank, p, h.text);
  }
  const int known = h.kind == M_PARAMS || h.kind == M_REFUSED || h.kind == M_STOP;
  const int data = h.kind == M_PARAMS || h.kind == M_REFUSED;
  const int r = h.range;
  if (h.magic != PS_MAGIC || !known || r < 0 || r >= ps->nrange || ps->owner[r] != p ||
      !ps->pending[r] || h.version < ps->ver[r] || h.staleness < 0 ||
      h.mirror < -1 || h.mirror >= ps->nproc || h.mirror == p ||
      h.count != (data ? ps->cnt[r] : 0) || (!start && h.step != 0 && h.step != 1) ||
      (start && (h.step < 0 || h.step > ps->cfg.steps * (long)ps->nwork))) {
    /* (a fast worker may have done more than steps of the budget's
     * steps * workers gradients) */
    chorus_comm_abort(c);
    return chorus__train_fail(CHORUS_ERR_PROTOCOL,
                              "async: worker %d: server %d sent a malformed answer (kind "
                              "%u, range %d, version %lld after %lld, %llu floats, step %lld)",
                              ps->me, p, h.kind, r, (long long)h.version,
                              (long long)(r >= 0 && r < ps->nrange ? ps->ver[r] : 0),
                              (unsigned long long)h.count, (long long)h.step);
  }
  *range = r;
  if (h.kind == M_STOP) {
    ps->pending[r] = 0;
    if (rep) {
      rep->stop = 1;
      if (h.step == 1 && h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
      if (h.step != 1) rep->unused = 1;
    }
    return CHORUS_OK;
  }
  if ((st = chorus_recv(c, params + ps->lo[r], ps->cnt[r], CHORUS_FLOAT32, 0, TAG_DATA, NULL)) !=
      CHORUS_OK)
    return CHORUS_INPROGRESS;
  ps->pending[r] = 0;
  ps->ver[r] = h.version;
  ps->mholder[r] = h.mirror;
  if (start && r == 0) *start = (long)h.step;
  if (rep) {
    if (h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
    if (r == 0) rep->version = (long)h.version;
    if (h.kind == M_REFUSED) {
      rep->refused = 1;
      snprintf(rep->why, sizeof rep->why, "%s", h.text);
    }
  }
  return CHORUS_OK;
}

chorus_result_t chorus_ps_pull(chorus_ps_t *ps, float *params, long *start_step) {
  if (!ps || ps->server || !params)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_pull: not a worker, or no buffer");
  long start = 0;
  chorus_result_t st = CHORUS_OK;
  /* A hello to every process serving a range; one answer per range. */
  for (int p = 0; p < ps->nproc && st == CHORUS_OK; p++) {
    int serves = 0;
    for (int r = 0; r < ps->nrange; r++) serves |= ps->owner[r] == p;
    if (!serves) continue;
    msg_t h;
    memset(&h, 0, sizeof h);
    h.magic = PS_MAGIC;
    h.kind = M_HELLO;
    st = chorus_send(ps->pair[p], &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      server_gone(ps, p, st, "the job fails before it started");
      abort_pairs(ps);
      return st;
    }
  }
  for (int r = 0; r < ps->nrange; r++) ps->pending[r] = 1;
  for (int r = 0; r < ps->nrange && st == CHORUS_OK; r++) {
    if (!ps->pending[r]) continue;
    const int p = ps->owner[r];
    chorus_ps_reply_t rep;
    memset(&rep, 0, sizeof rep);
    int got;
    st = answer(ps, p, params, &rep, &start, &got);
    if (st == CHORUS_INPROGRESS)
      st = server_gone(ps, p, CHORUS_ERR_REMOTE, "the job fails before it started");
    else if (st == CHORUS_OK && rep.stop)
      st = chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "async: worker %d: the budget is already applied", ps->me);
    if (st == CHORUS_OK && got != r) r--; /* another range of p answered first */
  }
  if (st != CHORUS_OK) abort_pairs(ps);
  if (start_step) *start_step = start;
  ps->wstep = start;
  return st;
}

chorus_result_t chorus_ps_push_early(chorus_ps_t *ps, const float *grads, float loss,
                                     uint32_t tokens, size_t final_from) {
  if (!ps || ps->server || !grads)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ps_push_early: not a worker, or no buffer");
  if (ps->fault) return CHORUS_OK; /* testing faults: all at once */
  /* A failed send is taken up by chorus_ps_push (the server may be gone). */
  for (int r = 0; r < ps->nrange; r++)
    if (!ps->sent[r] && ps->lo[r] >= final_from)
      send_slice(ps, r, grads + ps->lo[r], ps->cnt[r], ps->ver[r], loss, tokens);
  return CHORUS_OK;
}

chorus_result_t chorus_ps_push(chorus_ps_t *ps, const float *grads, float loss, uint32_t tokens,
                               float *params, chorus_ps_reply_t *rep) {
  if (!ps || ps->server || !grads || !params || !rep)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_push: not a worker, or no buffer");
  memset(rep, 0, sizeof *rep);
  const int S = ps->nrange;
  float *extra = NULL;
  const int fault = ps->fault;
  ps->fault = 0;
  if (fault == 2 || fault == 3) extra = calloc(ps->cnt[0] + 1, sizeof(float));
  chorus_result_t st = CHORUS_OK;
  if ((fault == 2 || fault == 3) && !extra)
    st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_push: out of memory");
  for (int r = 0; r < S; r++) ps->pending[r] = 1;
  /* The slices not sent early (chorus_ps_push_early) go now. */
  for (int r = 0; r < S && st == CHORUS_OK; r++) {
    if (ps->sent[r]) continue;
    const float *src = grads + ps->lo[r];
    uint64_t count = ps->cnt[r];
    int64_t version = ps->ver[r];
    if (fault == 1) version = ps->ver[r] - ps->cfg.max_staleness - 1;
    if ((fault == 2 || fault == 3) && r == 0) {
      memcpy(extra, src, ps->cnt[0] * sizeof(float));
      if (fault == 2) count = ps->cnt[0] + 1;
      else extra[0] = NAN;
      src = extra;
    }
    send_slice(ps, r, src, count, version, loss, tokens); /* a failure shows in its answer */
  }
  /* The answers, from whichever process serves each range; a process
   * gone hands its ranges to their copies. */
  for (;;) {
    int r = 0;
    while (r < S && !ps->pending[r]) r++;
    if (r == S || st != CHORUS_OK) break;
    const int p = ps->owner[r];
    const int before = rep->stop;
    int got;
    rep->stop = 0;
    st = answer(ps, p, params, rep, NULL, &got);
    rep->stop |= before;
    if (st == CHORUS_INPROGRESS) {
      st = ps->cfg.mirror ? lost_server(ps, p, CHORUS_ERR_REMOTE, grads, loss, tokens)
                          : server_gone(ps, p, CHORUS_ERR_REMOTE, "the parameters it held are "
                                        "lost, so the job fails (a restart resumes from the "
                                        "servers' last checkpoint)");
    }
  }
  if (ps->lost_at && st == CHORUS_OK)
    say(ps, "async: worker %d: every range answered %.0f ms after a server was found gone",
        ps->me, (double)(now_ns() - ps->lost_at) / 1e6);
  ps->lost_at = 0;
  /* Every server process learns that this worker leaves (a standby too:
   * it may have taken a range over). */
  for (int p = 0; p < ps->nproc && st == CHORUS_OK && rep->stop; p++) {
    if (ps->pdead[p]) continue;
    msg_t bye;
    memset(&bye, 0, sizeof bye);
    bye.magic = PS_MAGIC;
    bye.kind = M_BYE;
    bye.range = -1;
    chorus_send(ps->pair[p], &bye, sizeof bye, CHORUS_UINT8, 0, TAG_HDR, NULL);
  }
  for (int i = 0; i < 2 * S; i++) {
    /* A server that stopped or refused this worker may never take the data. */
    if (ps->wk[i] && (st != CHORUS_OK || rep->stop) &&
        chorus_work_wait(ps->wk[i], 2000) == CHORUS_INPROGRESS)
      chorus_comm_abort(ps->pair[ps->owner[i / 2]]);
    chorus_work_free(ps->wk[i]);
    ps->wk[i] = NULL;
  }
  for (int r = 0; r < S; r++) ps->sent[r] = 0;
  free(extra);
  /* The other servers learn at once that this worker is out. */
  if (st != CHORUS_OK) abort_pairs(ps);
  ps->wstep++;
  return st;
}
