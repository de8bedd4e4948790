/*
 * coll.c - the entry point of every collective: argument validation, the
 * operation record and its fingerprint, the sequence number, execution
 * (inline or on the worker thread, see comm.h) and the work handles.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/comm.h"
#include "reduce/reduce.h"
#include "util/clock.h"
#include "util/util.h"

#define DEBUG_CHECK_STEP 0x40000000u

/* ----------------------------------------------------------- execution */

/* Every collective also sends its fingerprint to the right neighbour and
 * receives the left one's.  The transport compares each arriving header with
 * this rank's own call, so if any two ranks disagree some neighbour pair
 * does, and fails (telling everyone) at once -- also for calls in which every
 * rank would otherwise start by waiting (reduce with different roots, gather
 * against scatter).  By default the exchange overlaps the algorithm (posted
 * before it, waited for after it); CHORUS_DEBUG_CHECKS=1 completes it before
 * the algorithm moves any data. */
#define NEIGHBOUR_STEP DEBUG_CHECK_STEP

static chorus_result_t post_neighbour_check(chorus__coll_t *c, const chorus__fp_t *fp,
                                            chorus__fp_t *theirs, chorus__req_t *reqs) {
  chorus__coll_req(&reqs[0], CHORUS__REQ_RECV, (c->rank + c->size - 1) % c->size, theirs,
                   sizeof *theirs, NEIGHBOUR_STEP);
  chorus__coll_req(&reqs[1], CHORUS__REQ_SEND, (c->rank + 1) % c->size, (void *)fp, sizeof *fp,
                   NEIGHBOUR_STEP);
  chorus_result_t st = chorus__ep_post(c->ep, &reqs[0]);
  if (st == CHORUS_OK) st = chorus__ep_post(c->ep, &reqs[1]);
  return st;
}
static chorus_result_t finish_neighbour_check(chorus__coll_t *c, const chorus__fp_t *fp,
                                              const chorus__fp_t *theirs, chorus__req_t *reqs) {
  chorus__req_t *ptrs[2] = {&reqs[0], &reqs[1]};
  chorus_result_t st = chorus__ep_wait(c->ep, ptrs, 2, c->timeout_ms);
  if (st == CHORUS_OK && !chorus__fp_equal(fp, theirs)) {
    snprintf(c->err, sizeof c->err, "collective mismatch: the left neighbour's call differs");
    return CHORUS_ERR_MISMATCH;
  }
  return st;
}

static void run_op_timed(struct chorus_work *w);

static void run_op(struct chorus_work *w) {
  /* Only a handle can be asked for its times: a blocking call (its record
   * on the caller's stack) skips the two clock reads, a fifth of a small
   * collective's own cost. */
  if (w->on_stack) {
    run_op_timed(w);
    return;
  }
  w->t_start = chorus__now_ns();
  run_op_timed(w);
  w->t_end = chorus__now_ns();
}

static void run_op_timed(struct chorus_work *w) {
  chorus_comm_t comm = w->comm;
  chorus__coll_t *c = &w->c;
  chorus_result_t st;
  if (chorus__ep_failed(comm->ep)) {
    char prev[sizeof w->err];
    st = chorus__ep_status(comm->ep, prev, sizeof prev);
    snprintf(w->err, sizeof w->err, "the communicator failed earlier: %.900s", prev);
    w->result = st;
    return;
  }
  c->fp = w->fp;
  int n;
  const chorus__algo_t *algo = &chorus__algos(c->coll, &n)[c->algo];
  /* INFO: the first call of each collective with each algorithm (which
   * algorithm runs is the question users ask); DEBUG: every call. */
  unsigned bit = 1u << (c->algo & 31);
  int first = !(comm->algo_logged[c->coll] & bit);
  if (CHORUS__LOG_ON(first ? CHORUS__LOG_INFO : CHORUS__LOG_DEBUG, CHORUS__SUB_ALGO)) {
    char fpbuf[200];
    chorus__fp_format(&w->fp, fpbuf, sizeof fpbuf);
    CHORUS__LOG(first ? CHORUS__LOG_INFO : CHORUS__LOG_DEBUG, CHORUS__SUB_ALGO,
                "%s (call #%" PRIu64 ") runs algorithm %s over %s", fpbuf, w->seq, algo->name,
                algo->shm ? "shared memory" : "tcp");
  }
  comm->algo_logged[c->coll] |= bit;
  st = chorus__ep_begin(comm->ep, w->seq, &w->fp);
  chorus__req_t check[2];
  chorus__fp_t theirs;
  /* Shared-memory algorithms compare fingerprints in their own flags. */
  int checking = st == CHORUS_OK && c->size > 1 && !algo->shm;
  if (checking) st = post_neighbour_check(c, &w->fp, &theirs, check);
  if (st == CHORUS_OK && checking && comm->debug_checks) {
    st = finish_neighbour_check(c, &w->fp, &theirs, check);
    checking = 0;
  }
  if (st == CHORUS_OK) st = algo->run(c);
  if (st == CHORUS_OK && checking) st = finish_neighbour_check(c, &w->fp, &theirs, check);
  if (st != CHORUS_OK) {
    /* A local failure (no memory, bad argument found late) leaves the other
     * ranks waiting for us: fail the communicator everywhere. */
    if (!chorus__ep_failed(comm->ep)) {
      char name[300];
      chorus__ep_doing(comm->ep, name, sizeof name);
      chorus__ep_fail(comm->ep, st, 1, "chorus rank %d/%d: %s failed: %s", comm->rank, comm->size,
                      name, c->err[0] ? c->err : chorus_strerror(st));
    }
    chorus__ep_status(comm->ep, w->err, sizeof w->err);
    if (!w->err[0]) snprintf(w->err, sizeof w->err, "%s", chorus_strerror(st));
    if (!__atomic_exchange_n(&comm->failure_logged, 1, __ATOMIC_ACQ_REL))
      CHORUS_WARN(CHORUS__SUB_COLL, "%s", w->err);
  }
  chorus__ep_end(comm->ep, w->seq);
  w->result = st;
}

static void work_release_locked(struct chorus_work *w) {
  if (--w->refs > 0) return;
  free(w->c.recvbufs);
  free(w->c.scounts);
  if (!w->on_stack) free(w);
}

static int executing(chorus_comm_t comm);

/* Wakes the worker when the queue's head is its to start. */
static void wake_worker_locked(chorus_comm_t comm) {
  if (comm->q_head && !comm->q_head->lazy_until && !executing(comm))
    pthread_cond_signal(&comm->wcond);
}

static void finish_locked(chorus_comm_t comm, struct chorus_work *w) {
  w->state = CHORUS__WORK_DONE;
  if (w->result != CHORUS_OK) memcpy(comm->last_error, w->err, sizeof comm->last_error);
  pthread_cond_broadcast(&comm->cond);
  wake_worker_locked(comm);
}

/* comm->executing is written under the lock except at the end of an
 * inline call (submit), which clears it without the lock and takes the
 * lock only when something is queued (comm->nqueued): the worker, or a
 * blocking caller, may be waiting for it.  Both are sequentially consistent
 * atomics, so either that call sees the count or the waiter, which raised
 * it under the lock before sleeping, sees executing cleared. */
static int executing(chorus_comm_t comm) {
  return __atomic_load_n(&comm->executing, __ATOMIC_SEQ_CST);
}

/* Takes the queue's head and runs it on this thread, with the lock held on
 * entry and exit: the worker's loop and a waiting caller do exactly this. */
static void run_head_locked(chorus_comm_t comm) {
  struct chorus_work *w = comm->q_head;
  w->lazy_until = 0;
  comm->q_head = w->next;
  if (!comm->q_head) comm->q_tail = NULL;
  __atomic_store_n(&comm->executing, 1, __ATOMIC_SEQ_CST);
  __atomic_fetch_sub(&comm->nqueued, 1, __ATOMIC_SEQ_CST);
  w->state = CHORUS__WORK_RUNNING;
  pthread_mutex_unlock(&comm->lock);
  run_op(w);
  pthread_mutex_lock(&comm->lock);
  __atomic_store_n(&comm->executing, 0, __ATOMIC_SEQ_CST);
  finish_locked(comm, w);
  work_release_locked(w); /* the queue's reference */
}

/* Lazy start.  An asynchronous call on an idle communicator is left to
 * its caller for a moment instead of waking the worker: a caller that
 * waits for it at once (torch's dist.all_reduce issues the call, then
 * waits) runs it on its own thread (chorus_work_wait), and no other thread
 * wakes -- on a host with as many ranks as cores each wake-up preempts a
 * rank, and two per call were most of a small call's cost through torch.
 * The worker starts such a call itself once LAZY_NS passed: it wakes every
 * LAZY_TICK_NS while calls are being left to their callers (until
 * LAZY_IDLE_NS after the last), so a call nobody waits for starts within
 * about a tick.  A call whose caller did not wait (the worker had to start
 * it, or it was tested, waited with a bound or freed first) makes the next
 * LAZY_EAGER asynchronous calls go to the worker at once, as a program
 * that overlaps its calls with work wants.  Blocking calls never wait in
 * the queue (run inline). */
#define LAZY_NS 50000
#define LAZY_TICK_NS 1000000
#define LAZY_IDLE_NS 20000000
#define LAZY_EAGER 64

/* The caller will not run w itself: the worker starts it, and the
 * operations queued before it, now. */
static void start_now_locked(chorus_comm_t comm, struct chorus_work *w) {
  if (w->state != CHORUS__WORK_QUEUED) return;
  for (struct chorus_work *q = comm->q_head; q; q = q->next) {
    if (q->lazy_until) {
      q->lazy_until = 0;
      comm->eager_left = LAZY_EAGER;
    }
    if (q == w) break;
  }
  wake_worker_locked(comm);
}

static void *worker_main(void *arg) {
  chorus_comm_t comm = arg;
  pthread_mutex_lock(&comm->lock);
  for (;;) {
    struct chorus_work *h = comm->q_head;
    if (!h && comm->stopping) break; /* drained */
    int64_t now = chorus__now_ns();
    if (h && !executing(comm) && (!h->lazy_until || comm->stopping || h->lazy_until <= now)) {
      if (h->lazy_until) comm->eager_left = LAZY_EAGER; /* its caller did not wait */
      run_head_locked(comm); /* clears lazy_until */
      continue;
    }
    comm->worker_ticking = !comm->stopping && now - comm->last_lazy_ns < LAZY_IDLE_NS;
    if (comm->worker_ticking) {
      struct timespec ts = chorus__deadline_timespec(now + LAZY_TICK_NS);
      pthread_cond_timedwait(&comm->wcond, &comm->lock, &ts);
    } else {
      pthread_cond_wait(&comm->wcond, &comm->lock);
    }
  }
  pthread_mutex_unlock(&comm->lock);
  return NULL;
}

/* Waits until w is done; whenever nothing executes, this thread runs the
 * queue's head (ours or one before ours), as the worker would (same order,
 * same bookkeeping), instead of waking the worker and then being woken by
 * it (see lazy start).  Only for an unbounded wait. */
static void run_until_done_locked(chorus_comm_t comm, struct chorus_work *w) {
  while (w->state != CHORUS__WORK_DONE) {
    if (comm->q_head && !executing(comm)) run_head_locked(comm);
    else pthread_cond_wait(&comm->cond, &comm->lock);
  }
}

/* Takes ownership of w.  Blocking (out == NULL): runs or waits for it and
 * returns its result.  Async: queues it and hands a reference to *out. */
static chorus_result_t submit(chorus_comm_t comm, struct chorus_work *w, chorus_work_t *out) {
  pthread_mutex_lock(&comm->lock);
  if (comm->stopping) {
    pthread_mutex_unlock(&comm->lock);
    work_release_locked(w);
    return CHORUS_ERR_INVALID_ARG;
  }
  if (w->c.coll != CHORUS_COLL_SEND && w->c.coll != CHORUS_COLL_RECV) w->seq = ++comm->next_seq;
  if (!out && !executing(comm) && !comm->q_head) {
    /* Idle communicator: run on this thread, no hand-off. */
    __atomic_store_n(&comm->executing, 1, __ATOMIC_SEQ_CST);
    w->state = CHORUS__WORK_RUNNING;
    pthread_mutex_unlock(&comm->lock);
    run_op(w);
    chorus_result_t st = w->result;
    if (st == CHORUS_OK) {
      /* Nobody else knows w (its record is on our stack): without a
       * failure to record and with nothing queued, no lock is needed. */
      __atomic_store_n(&comm->executing, 0, __ATOMIC_SEQ_CST);
      if (!__atomic_load_n(&comm->nqueued, __ATOMIC_SEQ_CST)) {
        work_release_locked(w);
        return st;
      }
      pthread_mutex_lock(&comm->lock);
    } else {
      pthread_mutex_lock(&comm->lock);
      __atomic_store_n(&comm->executing, 0, __ATOMIC_SEQ_CST);
    }
    finish_locked(comm, w);
    work_release_locked(w);
    pthread_mutex_unlock(&comm->lock);
    return st;
  }
  if (!comm->worker_started) {
    if (pthread_create(&comm->worker, NULL, worker_main, comm) != 0) {
      pthread_mutex_unlock(&comm->lock);
      work_release_locked(w);
      /* The call already took a sequence number: this rank cannot stay in
       * step with the others, so the communicator fails everywhere. */
      chorus__ep_fail(comm->ep, CHORUS_ERR_SYSTEM, 1, "chorus rank %d/%d: cannot start the "
                      "communicator's worker thread", comm->rank, comm->size);
      chorus__comm_set_error(comm, "chorus: cannot start the communicator's worker thread");
      return CHORUS_ERR_SYSTEM;
    }
    comm->worker_started = 1;
  }
  w->refs = 2;
  w->state = CHORUS__WORK_QUEUED;
  w->lazy_until = 0;
  if (out && !executing(comm) && !comm->q_head && comm->lazy_start) {
    if (comm->eager_left > 0) {
      comm->eager_left--;
    } else {
      int64_t now = chorus__now_ns();
      w->lazy_until = now + LAZY_NS;
      comm->last_lazy_ns = now;
      if (!comm->worker_ticking) pthread_cond_signal(&comm->wcond); /* start ticking */
    }
  }
  /* A second async call before the first was waited for: the caller
   * overlaps its calls with work; start the first now. */
  if (out && comm->q_head && comm->q_head->lazy_until) start_now_locked(comm, comm->q_head);
  __atomic_fetch_add(&comm->nqueued, 1, __ATOMIC_SEQ_CST);
  if (comm->q_tail) comm->q_tail->next = w;
  else comm->q_head = w;
  comm->q_tail = w;
  wake_worker_locked(comm);
  if (out) {
    *out = w;
    pthread_mutex_unlock(&comm->lock);
    return CHORUS_OK;
  }
  run_until_done_locked(comm, w); /* behind queued operations */
  chorus_result_t st = w->result;
  work_release_locked(w);
  pthread_mutex_unlock(&comm->lock);
  return st;
}

/* ---------------------------------------------------------- work handles */

/* Completes a point-to-point handle: waits up to timeout_ms (< 0: until
 * the outcome) and records the result.  Returns CHORUS_INPROGRESS if still
 * pending.  Whoever waits, and however (wait(-1), wait(t), test in a
 * loop), a send or recv pending for the communicator's timeout since it
 * was posted fails the communicator: polling must not hang either. */
static chorus_result_t p2p_progress(struct chorus_work *w, int timeout_ms) {
  chorus_comm_t comm = w->comm;
  pthread_mutex_lock(&comm->lock);
  int done = w->state == CHORUS__WORK_DONE;
  pthread_mutex_unlock(&comm->lock);
  if (done) return w->result;
  chorus__req_t *reqs[1] = {&w->req};
  int64_t op_deadline = w->t_start + (int64_t)comm->timeout_ms * 1000000;
  chorus_result_t st;
  if (timeout_ms >= 0 && chorus__deadline_ms(timeout_ms) < op_deadline)
    st = chorus__ep_wait_soft(comm->ep, reqs, 1, timeout_ms);
  else
    st = chorus__ep_wait_until(comm->ep, reqs, 1, op_deadline, comm->timeout_ms);
  if (st == CHORUS_INPROGRESS) return st;
  pthread_mutex_lock(&comm->lock);
  if (w->state != CHORUS__WORK_DONE) {
    w->result = st;
    w->t_end = chorus__now_ns();
    if (st != CHORUS_OK) chorus__ep_status(comm->ep, w->err, sizeof w->err);
    finish_locked(comm, w);
  }
  st = w->result;
  pthread_mutex_unlock(&comm->lock);
  return st;
}

chorus_result_t chorus_work_wait(chorus_work_t w, int timeout_ms) {
  if (!w) return CHORUS_ERR_INVALID_ARG;
  if (w->p2p) return p2p_progress(w, timeout_ms);
  chorus_comm_t comm = w->comm;
  int64_t deadline = chorus__deadline_ms(timeout_ms < 0 ? -1 : timeout_ms);
  pthread_mutex_lock(&comm->lock);
  if (timeout_ms < 0) run_until_done_locked(comm, w);
  while (w->state != CHORUS__WORK_DONE && chorus__ms_left(deadline) > 0) {
    /* A bounded wait must be able to return before the operation ends:
     * the worker runs it. */
    start_now_locked(comm, w);
    struct timespec ts = chorus__deadline_timespec(deadline);
    pthread_cond_timedwait(&comm->cond, &comm->lock, &ts);
  }
  chorus_result_t st = w->state == CHORUS__WORK_DONE ? w->result : CHORUS_INPROGRESS;
  pthread_mutex_unlock(&comm->lock);
  return st;
}

chorus_result_t chorus_work_test(chorus_work_t w) {
  if (!w) return CHORUS_ERR_INVALID_ARG;
  if (w->p2p) return p2p_progress(w, 0);
  pthread_mutex_lock(&w->comm->lock);
  start_now_locked(w->comm, w);
  chorus_result_t st = w->state == CHORUS__WORK_DONE ? w->result : CHORUS_INPROGRESS;
  pthread_mutex_unlock(&w->comm->lock);
  return st;
}

int chorus_work_source(chorus_work_t w) {
  if (!w || !w->p2p || w->req.type != CHORUS__REQ_RECV) return -1;
  pthread_mutex_lock(&w->comm->lock);
  int src = w->state == CHORUS__WORK_DONE && w->result == CHORUS_OK ? w->req.peer : -1;
  pthread_mutex_unlock(&w->comm->lock);
  return src;
}

double chorus_work_duration(chorus_work_t w) {
  if (!w) return 0;
  pthread_mutex_lock(&w->comm->lock);
  double d = w->state == CHORUS__WORK_DONE && w->t_end >= w->t_start
                 ? (double)(w->t_end - w->t_start) * 1e-9
                 : 0.0;
  pthread_mutex_unlock(&w->comm->lock);
  return d;
}

void chorus_work_timestamps(chorus_work_t w, int64_t *start_ns, int64_t *end_ns) {
  int64_t a = 0, b = 0;
  if (w) {
    pthread_mutex_lock(&w->comm->lock);
    if (w->state == CHORUS__WORK_DONE) a = w->t_start, b = w->t_end;
    pthread_mutex_unlock(&w->comm->lock);
  }
  if (start_ns) *start_ns = a;
  if (end_ns) *end_ns = b;
}

const char *chorus_work_error(chorus_work_t w) {
  if (!w) return "";
  pthread_mutex_lock(&w->comm->lock);
  const char *e = w->state == CHORUS__WORK_DONE ? w->err : "";
  pthread_mutex_unlock(&w->comm->lock);
  return e;
}

void chorus_work_free(chorus_work_t w) {
  if (!w) return;
  chorus_comm_t comm = w->comm;
  /* The transport still points at a pending request: finish it first
   * (bounded by the timeout; a failure detaches it). */
  if (w->p2p) p2p_progress(w, -1);
  pthread_mutex_lock(&comm->lock);
  start_now_locked(comm, w);
  work_release_locked(w);
  pthread_mutex_unlock(&comm->lock);
}

/* ------------------------------------------------------------ validation */

static chorus_result_t bad(chorus_comm_t comm, const char *coll, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static chorus_result_t bad(chorus_comm_t comm, const char *coll, const char *fmt, ...) {
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  chorus__comm_set_error(comm, "chorus rank %d/%d: %s: %s", comm->rank, comm->size, coll, msg);
  return CHORUS_ERR_INVALID_ARG;
}

/* memset for the few hundred bytes of an operation record, with plain
 * 16-byte stores: GCC turns a memset of this size into `rep stos`, whose
 * start-up alone is a tenth of a small collective's own cost on the AMD
 * cores we measure on (kept out of line, or the loop becomes memset again). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((noinline, optimize("no-tree-loop-distribute-patterns")))
#endif
static void zero_small(void *p, size_t n) {
#if defined(__SSE2__)
  unsigned char *b = p;
  const __m128i z = _mm_setzero_si128();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm_storeu_si128((__m128i *)(b + i), z);
  for (; i < n; i++) b[i] = 0;
#else
  memset(p, 0, n);
#endif
}

/* Discards an operation that was never submitted. */
static __attribute__((noinline)) void drop_op(struct chorus_work *w) {
  if (!w->on_stack) free(w);
}

/* The algorithm c runs on comm: the forced one, else the automatic choice;
 * -1 when the forced one needs shared memory the group lacks.  A group of
 * one has nothing to share, so a forced shared-memory algorithm gives way
 * to the automatic choice there. */
static int pick_algo(chorus_comm_t comm, const chorus__coll_t *c) {
  int forced = __atomic_load_n(&comm->forced_algo[c->coll], __ATOMIC_RELAXED);
  if (forced < 0) return chorus__algo_select(c);
  int nalgos;
  const chorus__algo_t *algo = &chorus__algos(c->coll, &nalgos)[forced];
  if (algo->shm && !c->shm) return comm->size == 1 ? chorus__algo_select(c) : -1;
  return forced;
}

const char *chorus_comm_algo(chorus_comm_t comm, chorus_coll_t coll, size_t count,
                             chorus_dtype_t dtype) {
  if (!comm || coll < 0 || coll >= CHORUS_COLL_COUNT || chorus_dtype_size(dtype) == 0)
    return NULL;
  chorus__coll_t c;
  memset(&c, 0, sizeof c);
  c.coll = coll;
  c.count = count;
  c.dtype = dtype;
  c.esize = chorus_dtype_size(dtype);
  c.rank = comm->rank;
  c.size = comm->size;
  c.shm = comm->shm;
  c.topo = &comm->topo;
  c.root = c.peer = c.tag = -1;
  int idx = pick_algo(comm, &c);
  return idx < 0 ? NULL : chorus_algo_name(coll, idx);
}

/* Allocates and fills the common part of an operation; NULL on bad args
 * (*st says why). */
static struct chorus_work *new_op(chorus_comm_t comm, chorus_coll_t coll, const void *sendbuf,
                                  void *recvbuf, size_t count, chorus_dtype_t dtype,
                                  chorus_op_t op, int root, chorus_result_t *st,
                                  struct chorus_work *storage) {
  const char *name = chorus_coll_name(coll);
  *st = CHORUS_ERR_INVALID_ARG;
  if (dtype < 0 || dtype >= CHORUS_DTYPE_COUNT) {
    bad(comm, name, "invalid dtype %d", (int)dtype);
    return NULL;
  }
  int reducing = coll == CHORUS_COLL_REDUCE || coll == CHORUS_COLL_ALL_REDUCE ||
                 coll == CHORUS_COLL_REDUCE_SCATTER;
  if (reducing && (op < 0 || op >= CHORUS_OP_COUNT)) {
    bad(comm, name, "invalid reduce op %d", (int)op);
    return NULL;
  }
  if (reducing && !chorus__reduce_supported(dtype, op)) {
    bad(comm, name, "reduce op %s is not defined for %s (bitwise ops need integer dtypes)",
        chorus_op_name(op), chorus_dtype_name(dtype));
    *st = op >= 0 && op < CHORUS_OP_COUNT ? CHORUS_ERR_NOT_SUPPORTED : CHORUS_ERR_INVALID_ARG;
    return NULL;
  }
  if (root != -1 && (root < 0 || root >= comm->size)) {
    bad(comm, name, "root %d is not a rank of this group of %d", root, comm->size);
    return NULL;
  }
  size_t bytes;
  if (chorus__mul_overflow(count, chorus_dtype_size(dtype), &bytes) ||
      chorus__mul_overflow(bytes, (size_t)comm->size, &bytes)) {
    bad(comm, name, "count %zu overflows the address space", count);
    return NULL;
  }
  struct chorus_work *w = storage;
  if (w) {
    /* A blocking call's record lives on its caller's stack (no allocation
     * on the small-message path); the error text is written only on
     * failure, so it is not cleared. */
    const size_t c_err = offsetof(struct chorus_work, c) + offsetof(chorus__coll_t, err);
    const size_t after_c = offsetof(struct chorus_work, c) + sizeof(chorus__coll_t);
    zero_small(w, c_err);
    zero_small((char *)w + after_c, offsetof(struct chorus_work, err) - after_c);
    w->c.err[0] = w->err[0] = '\0';
    w->on_stack = 1;
  } else if (!(w = calloc(1, sizeof *w))) {
    *st = CHORUS_ERR_NO_MEMORY;
    return NULL;
  }
  w->comm = comm;
  w->refs = 1;
  chorus__coll_t *c = &w->c;
  c->coll = coll;
  c->sendbuf = sendbuf;
  c->recvbuf = recvbuf;
  c->count = count;
  c->dtype = dtype;
  c->op = op;
  c->root = root;
  c->ep = comm->ep;
  c->rank = comm->rank;
  c->size = comm->size;
  c->timeout_ms = comm->timeout_ms;
  c->esize = chorus_dtype_size(dtype);
  c->pool = &comm->pool; /* collectives of one communicator never overlap */
  c->shm = comm->shm;
  c->topo = &comm->topo;
  c->peer = c->tag = -1;
  c->algo = pick_algo(comm, c);
  if (c->algo < 0) {
    bad(comm, name, "algorithm '%s' needs every rank of the group on one host with shared "
        "memory, and this group has none (ranks on several hosts, CHORUS_TRANSPORT=tcp, or "
        "the segment could not be created: see the INFO log)",
        chorus_algo_name(coll, comm->forced_algo[coll]));
    if (w != storage) free(w);
    *st = CHORUS_ERR_NOT_SUPPORTED;
    return NULL;
  }
  w->fp.coll = (uint8_t)coll;
  w->fp.dtype = (uint8_t)dtype;
  w->fp.op = op == CHORUS_OP_COUNT ? 0xff : (uint8_t)op;
  w->fp.algo = (uint8_t)c->algo;
  w->fp.root = root;
  w->fp.count = count;
  *st = CHORUS_OK;
  return w;
}

#define NEED_BUF(ptr, what)                                                     \
  do {                                                                         \
    if (!(ptr) && count) return bad(comm, name, "%s is NULL", what);           \
  } while (0)

#define START(coll_id)                                                          \
  const char *name = chorus_coll_name(coll_id);                                \
  if (!comm) return CHORUS_ERR_INVALID_ARG;                                    \
  if (work) *work = NULL;

#define SUBMIT(w)                                                               \
  do {                                                                         \
    chorus_result_t st_;                                                       \
    if (!(w)) return CHORUS_ERR_INVALID_ARG;                                   \
    st_ = submit(comm, (w), work);                                             \
    return st_;                                                                \
  } while (0)

#define MAKE(w, coll_id, sb, rb, op_, root_)                                    \
  chorus_result_t st;                                                          \
  struct chorus_work w##_stack;                                                 \
  struct chorus_work *w = new_op(comm, coll_id, sb, rb, count, dtype, op_, root_, &st, \
                                 work ? NULL : &w##_stack);                  \
  if (!w) return st;

chorus_result_t chorus_broadcast(chorus_comm_t comm, void *buf, size_t count, chorus_dtype_t dtype,
                                 int root, chorus_work_t *work) {
  START(CHORUS_COLL_BROADCAST);
  NEED_BUF(buf, "buf");
  MAKE(w, CHORUS_COLL_BROADCAST, buf, buf, CHORUS_OP_COUNT, root);
  SUBMIT(w);
}

chorus_result_t chorus_reduce(chorus_comm_t comm, const void *sendbuf, void *recvbuf, size_t count,
                              chorus_dtype_t dtype, chorus_op_t op, int root, chorus_work_t *work) {
  START(CHORUS_COLL_REDUCE);
  NEED_BUF(sendbuf, "sendbuf");
  if (comm->rank == root) NEED_BUF(recvbuf, "recvbuf (on root)");
  MAKE(w, CHORUS_COLL_REDUCE, sendbuf, recvbuf, op, root);
  SUBMIT(w);
}

chorus_result_t chorus_all_reduce(chorus_comm_t comm, const void *sendbuf, void *recvbuf,
                                  size_t count, chorus_dtype_t dtype, chorus_op_t op,
                                  chorus_work_t *work) {
  START(CHORUS_COLL_ALL_REDUCE);
  NEED_BUF(sendbuf, "sendbuf");
  NEED_BUF(recvbuf, "recvbuf");
  MAKE(w, CHORUS_COLL_ALL_REDUCE, sendbuf, recvbuf, op, -1);
  SUBMIT(w);
}

chorus_result_t chorus_scatter(chorus_comm_t comm, const void *sendbuf, void *recvbuf, size_t count,
                               chorus_dtype_t dtype, int root, chorus_work_t *work) {
  START(CHORUS_COLL_SCATTER);
  if (comm->rank == root) NEED_BUF(sendbuf, "sendbuf (on root)");
  NEED_BUF(recvbuf, "recvbuf");
  MAKE(w, CHORUS_COLL_SCATTER, sendbuf, recvbuf, CHORUS_OP_COUNT, root);
  SUBMIT(w);
}

chorus_result_t chorus_gather(chorus_comm_t comm, const void *sendbuf, void *recvbuf, size_t count,
                              chorus_dtype_t dtype, int root, chorus_work_t *work) {
  START(CHORUS_COLL_GATHER);
  NEED_BUF(sendbuf, "sendbuf");
  if (comm->rank == root) NEED_BUF(recvbuf, "recvbuf (on root)");
  MAKE(w, CHORUS_COLL_GATHER, sendbuf, recvbuf, CHORUS_OP_COUNT, root);
  SUBMIT(w);
}

chorus_result_t chorus_all_gather(chorus_comm_t comm, const void *sendbuf, void *recvbuf,
                                  size_t count, chorus_dtype_t dtype, chorus_work_t *work) {
  START(CHORUS_COLL_ALL_GATHER);
  NEED_BUF(sendbuf, "sendbuf");
  NEED_BUF(recvbuf, "recvbuf");
  MAKE(w, CHORUS_COLL_ALL_GATHER, sendbuf, recvbuf, CHORUS_OP_COUNT, -1);
  SUBMIT(w);
}

chorus_result_t chorus_all_gather_list(chorus_comm_t comm, const void *sendbuf,
                                       void *const *recvbufs, size_t count, chorus_dtype_t dtype,
                                       chorus_work_t *work) {
  START(CHORUS_COLL_ALL_GATHER);
  NEED_BUF(sendbuf, "sendbuf");
  if (!recvbufs) return bad(comm, name, "recvbufs is NULL");
  for (int r = 0; r < comm->size; r++)
    if (!recvbufs[r] && count) return bad(comm, name, "recvbufs[%d] is NULL", r);
  MAKE(w, CHORUS_COLL_ALL_GATHER, sendbuf, NULL, CHORUS_OP_COUNT, -1);
  w->c.recvbufs = malloc(sizeof(void *) * (size_t)comm->size);
  if (!w->c.recvbufs) {
    drop_op(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  memcpy(w->c.recvbufs, recvbufs, sizeof(void *) * (size_t)comm->size);
  SUBMIT(w);
}

chorus_result_t chorus_reduce_scatter(chorus_comm_t comm, const void *sendbuf, void *recvbuf,
                                      size_t count, chorus_dtype_t dtype, chorus_op_t op,
                                      chorus_work_t *work) {
  START(CHORUS_COLL_REDUCE_SCATTER);
  NEED_BUF(sendbuf, "sendbuf");
  NEED_BUF(recvbuf, "recvbuf");
  MAKE(w, CHORUS_COLL_REDUCE_SCATTER, sendbuf, recvbuf, op, -1);
  SUBMIT(w);
}

chorus_result_t chorus_all_to_all(chorus_comm_t comm, const void *sendbuf, void *recvbuf,
                                  size_t count, chorus_dtype_t dtype, chorus_work_t *work) {
  START(CHORUS_COLL_ALL_TO_ALL);
  NEED_BUF(sendbuf, "sendbuf");
  NEED_BUF(recvbuf, "recvbuf");
  MAKE(w, CHORUS_COLL_ALL_TO_ALL, sendbuf, recvbuf, CHORUS_OP_COUNT, -1);
  SUBMIT(w);
}

chorus_result_t chorus_all_to_allv(chorus_comm_t comm, const void *sendbuf,
                                   const size_t *sendcounts, const size_t *sdispls, void *recvbuf,
                                   const size_t *recvcounts, const size_t *rdispls,
                                   chorus_dtype_t dtype, chorus_work_t *work) {
  START(CHORUS_COLL_ALL_TO_ALLV);
  size_t count = 0;
  if (!sendcounts || !sdispls || !recvcounts || !rdispls)
    return bad(comm, name, "count or displacement array is NULL");
  size_t es = chorus_dtype_size(dtype);
  for (int r = 0; r < comm->size; r++) {
    size_t send_end, recv_end;
    if (__builtin_add_overflow(sdispls[r], sendcounts[r], &send_end) ||
        __builtin_add_overflow(rdispls[r], recvcounts[r], &recv_end) ||
        chorus__mul_overflow(send_end, es ? es : 1, &send_end) ||
        chorus__mul_overflow(recv_end, es ? es : 1, &recv_end))
      return bad(comm, name, "counts/displacements for rank %d overflow", r);
    if ((sendcounts[r] && !sendbuf) || (recvcounts[r] && !recvbuf))
      return bad(comm, name, "buffer is NULL but counts for rank %d are not zero", r);
  }
  if (sendbuf && sendbuf == recvbuf) {
    bad(comm, name, "in-place all_to_allv is not supported");
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  MAKE(w, CHORUS_COLL_ALL_TO_ALLV, sendbuf, recvbuf, CHORUS_OP_COUNT, -1);
  size_t n = (size_t)comm->size;
  w->c.scounts = malloc(sizeof(size_t) * n * 4);
  if (!w->c.scounts) {
    drop_op(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  w->c.sdispls = w->c.scounts + n;
  w->c.rcounts = w->c.scounts + 2 * n;
  w->c.rdispls = w->c.scounts + 3 * n;
  memcpy(w->c.scounts, sendcounts, sizeof(size_t) * n);
  memcpy(w->c.sdispls, sdispls, sizeof(size_t) * n);
  memcpy(w->c.rcounts, recvcounts, sizeof(size_t) * n);
  memcpy(w->c.rdispls, rdispls, sizeof(size_t) * n);
  SUBMIT(w);
}

chorus_result_t chorus_barrier(chorus_comm_t comm, chorus_work_t *work) {
  START(CHORUS_COLL_BARRIER);
  (void)name;
  size_t count = 0;
  chorus_dtype_t dtype = CHORUS_UINT8;
  MAKE(w, CHORUS_COLL_BARRIER, NULL, NULL, CHORUS_OP_COUNT, -1);
  SUBMIT(w);
}

static chorus_result_t p2p(chorus_comm_t comm, chorus_coll_t coll, const void *sbuf, void *rbuf,
                           size_t count, chorus_dtype_t dtype, int peer, int tag,
                           chorus_work_t *work) {
  START(coll);
  int any = coll == CHORUS_COLL_RECV && peer == CHORUS_ANY_SOURCE;
  if (!any && (peer < 0 || peer >= comm->size || peer == comm->rank))
    return bad(comm, name, "peer %d is not another rank of this group of %d%s", peer, comm->size,
               coll == CHORUS_COLL_RECV ? " (CHORUS_ANY_SOURCE: from any rank)" : "");
  if (any && comm->size < 2)
    return bad(comm, name, "receiving from any source in a group of one rank: no rank can send");
  if (tag < 0) return bad(comm, name, "tag %d is negative", tag);
  NEED_BUF(coll == CHORUS_COLL_SEND ? sbuf : rbuf, "buf");
  MAKE(w, coll, sbuf, rbuf, CHORUS_OP_COUNT, -1);
  w->p2p = 1;
  w->req.type = coll == CHORUS_COLL_SEND ? CHORUS__REQ_SEND : CHORUS__REQ_RECV;
  w->req.peer = any ? CHORUS__ANY_PEER : peer;
  w->req.kind = CHORUS__KIND_P2P;
  w->req.tag = tag;
  w->req.buf = coll == CHORUS_COLL_SEND ? (void *)sbuf : rbuf;
  w->req.len = count * chorus_dtype_size(dtype);
  w->req.fp = w->fp;
  w->req.fp.coll = CHORUS_COLL_SEND; /* both ends describe the message alike */
  w->req.fp.algo = 0;
  st = chorus__ep_post(comm->ep, &w->req);
  if (st != CHORUS_OK) {
    chorus__ep_status(comm->ep, w->err, sizeof w->err);
    chorus__comm_set_error(comm, "%s", w->err[0] ? w->err : chorus_strerror(st));
    drop_op(w);
    return st;
  }
  w->state = CHORUS__WORK_RUNNING;
  w->t_start = chorus__now_ns();
  if (work) {
    *work = w;
    return CHORUS_OK;
  }
  st = p2p_progress(w, -1);
  pthread_mutex_lock(&comm->lock);
  work_release_locked(w);
  pthread_mutex_unlock(&comm->lock);
  return st;
}

chorus_result_t chorus_send(chorus_comm_t comm, const void *buf, size_t count, chorus_dtype_t dtype,
                            int peer, int tag, chorus_work_t *work) {
  return p2p(comm, CHORUS_COLL_SEND, buf, NULL, count, dtype, peer, tag, work);
}

chorus_result_t chorus_recv(chorus_comm_t comm, void *buf, size_t count, chorus_dtype_t dtype,
                            int peer, int tag, chorus_work_t *work) {
  return p2p(comm, CHORUS_COLL_RECV, NULL, buf, count, dtype, peer, tag, work);
}

/* Variable-size byte gathers: count is this rank's length; the fingerprint's
 * count is 0 because lengths legitimately differ between ranks. */
static chorus_result_t bytes_gather(chorus_comm_t comm, chorus_coll_t coll, const void *data,
                                    size_t len, int root, void **out, size_t *lens) {
  chorus_work_t *work = NULL;
  START(coll);
  size_t count = len;
  chorus_dtype_t dtype = CHORUS_UINT8;
  NEED_BUF(data, "data");
  int receives = coll == CHORUS_COLL_ALL_GATHERV || comm->rank == root;
  if (receives && (!out || !lens)) return bad(comm, name, "out or lens is NULL");
  if (out) *out = NULL;
  MAKE(w, coll, data, NULL, CHORUS_OP_COUNT, root);
  w->fp.count = 0;
  void *result = NULL;
  w->c.out = &result;
  w->c.lens = lens;
  st = submit(comm, w, NULL);
  if (st == CHORUS_OK && receives) *out = result;
  else free(result);
  return st;
}

chorus_result_t chorus_gather_bytes(chorus_comm_t comm, const void *data, size_t len, int root,
                                    void **out, size_t *lens) {
  if (comm && (root < 0 || root >= comm->size))
    return bad(comm, "gather_bytes", "root %d is not a rank of this group of %d", root, comm->size);
  return bytes_gather(comm, CHORUS_COLL_GATHERV, data, len, root, out, lens);
}

chorus_result_t chorus_all_gather_bytes(chorus_comm_t comm, const void *data, size_t len,
                                        void **out, size_t *lens) {
  return bytes_gather(comm, CHORUS_COLL_ALL_GATHERV, data, len, -1, out, lens);
}
