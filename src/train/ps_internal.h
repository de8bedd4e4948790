/*
 * ps_internal.h - what the parameter-server files share (private to
 * ps.c, ps_server.c, ps_mirror.c and ps_worker.c): the messages, a range's,
 * a worker slot's and the process's state, and the steps one role calls
 * in another's file.
 *
 * Asynchronous data parallel: parameter servers with bounded staleness,
 * whose ranges may be mirrored (chorus_train.h, "asynchronous data
 * parallel").
 *
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
 * runs the take-over (chorus__ps_failover, ps_mirror.c).  One mutex
 * guards the process's state; gradients are received into per-worker
 * buffers outside it.
 */
#ifndef CHORUS_TRAIN_PS_INTERNAL_H
#define CHORUS_TRAIN_PS_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "chorus_train.h"

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

/* CLOCK_MONOTONIC, in nanoseconds. */
static inline int64_t chorus__ps_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Bytes of a FULL and of an UPDATE of range r. */
static inline size_t chorus__ps_full_bytes(const chorus_ps_t *ps, const range_t *r) {
  return r->n * sizeof(float) + chorus_optim_state_size(r->opt) +
         sizeof(wrec_t) * (size_t)ps->nwork + sizeof(rstat_t);
}
static inline size_t chorus__ps_update_bytes(const chorus_ps_t *ps, const range_t *r) {
  return r->n * sizeof(float) + sizeof(wrec_t) * (size_t)ps->nwork + sizeof(rstat_t);
}

/* ps.c: what every role uses. */
/* A line of the log (cfg.log, or stderr). */
void chorus__ps_say(chorus_ps_t *ps, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The transport speaks of a group that fails as one; a pair does not:
 * its words to that effect go from a message. */
void chorus__ps_pair_words(char *why);
/* A pair communicator's last error, in a pair's words. */
void chorus__ps_pair_error(chorus_comm_t c, char *why, size_t cap);
/* A range's checkpoint buffers: 0, or -1. */
int chorus__ps_range_ck_alloc(chorus_ps_t *ps, range_t *r);

/* ps_server.c: what the mirrors and the take-over call. */
/* Packs range r's state (FULL) or its last update (UPDATE) into dst.
 * Lock held. */
void chorus__ps_pack(range_t *r, unsigned char *dst, int kind, const float *g, int acc_k,
                     float lr);
/* The updates seen here have passed `step` of the budget: the checkpoint
 * steps up to it are due.  Lock held. */
void chorus__ps_ck_pass(chorus_ps_t *ps, long step);
/* Applies the summed gradients if the staleness bound and the copy allow.
 * Lock held. */
void chorus__ps_maybe_apply(range_t *r);
/* Starts the thread of every worker not served yet, not gone.  Lock held. */
void chorus__ps_start_slots(chorus_ps_t *ps);

/* ps_mirror.c: a range's copy, and the take-over. */
/* Threads: the primary's side of range r's copy (tx), and the copy's (rx);
 * arg is the range_t. */
void *chorus__ps_tx_main(void *arg);
void *chorus__ps_rx_main(void *arg);
/* After a server process died: the survivors agree on who serves each
 * range.  0, or -1 with why. */
int chorus__ps_failover(chorus_ps_t *ps, char *why, size_t cap);

#endif
