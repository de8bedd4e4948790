/*
 * test_random.c - randomized differential test of the public API, run as N
 * processes by chorusrun.
 *
 * Every rank draws the same pseudo-random sequence of operations from one
 * seed: the collective, dtype, op, count, root, blocking or async, a forced
 * algorithm now and then, subgroups split off and destroyed in between.
 * Choices that a user makes per rank are drawn per rank from the same
 * stream: in place or not, and the kind of each buffer (malloc, malloc one
 * element off alignment, chorus_mem_alloc at offset 0 or at an odd element
 * offset).  Async handles are kept in a small window, polled with
 * chorus_work_test / chorus_work_wait(w, 0) and waited for in random order.
 * Each rank computes what its outputs must hold from the same draws, with
 * no communication, and checks every output element and that out-of-place
 * inputs are untouched.  Values are small integers, so every sum, product,
 * minimum and maximum is exact in every dtype; AVG of floats is compared
 * with a tolerance.
 *
 * Tuning variables (CHORUS_TRANSPORT, CHORUS_SHM_CMA_MIN, CHORUS_SHM_CHUNK,
 * CHORUS_RING_SEGMENT, CHORUS_RING_PIECE) are read once per process: the
 * CTest registrations vary them.  A failure prints the seed, the operation's index and every
 * drawn parameter; `--seed S --ops N` replays it.
 *
 * Usage: test_random [--seed S] [--seeds K] [--ops N] [--max-bytes B]
 *   (CHORUS_RANDOM_SEED also sets the seed; default: from the clock, printed).
 * Rank 0 prints "N passed, M failed" (operations checked on every rank).
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "dtype_values.h"

#define WINDOW 3   /* async operations in flight at most */
#define MAXR 64

static int g_wrank, g_wsize, g_tcp;
static long g_pass, g_fail;
static size_t g_max_bytes = 320 << 10; /* largest buffer of one operation */

/* ---------------------------------------------------------------- draws */

typedef struct {
  uint64_t s;
} rng_t;

static uint64_t next(rng_t *g) {
  uint64_t z = (g->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint64_t below(rng_t *g, uint64_t n) { return n ? next(g) % n : 0; }
/* A value every rank draws alike, then mixed with a rank: per-rank choices
 * that every rank can also compute for every other rank. */
static uint64_t per_rank(uint64_t draw, int rank) {
  rng_t g = {draw ^ ((uint64_t)(rank + 1) * 0xd1b54a32d192ed03ull)};
  return next(&g);
}

/* ---------------------------------------------------------------- values */

/* Element i of rank r's input of an operation salted with salt.  For
 * reductions, small enough that n <= 64 of them combine exactly in every
 * dtype (int8 sums stay below 128 up to 8 ranks: values 0..15). */
static unsigned input(int r, size_t i, uint64_t salt, chorus_op_t op, int n) {
  uint64_t h = (uint64_t)r * 0x9e3779b1u + i * 0x85ebca6bu + salt;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  if (op == CHORUS_PROD) return (size_t)r == i % (size_t)n ? 2 : 1; /* product 2 */
  if (op == CHORUS_BAND || op == CHORUS_BOR || op == CHORUS_BXOR) return (unsigned)(h & 0x7f);
  if (op == CHORUS_SUM || op == CHORUS_AVG) return (unsigned)(h % (n <= 8 ? 16 : 2));
  return (unsigned)(h % 100); /* MIN, MAX and data movement */
}

static double reduce_expect(size_t i, uint64_t salt, chorus_dtype_t dt, chorus_op_t op, int n) {
  int64_t acc = input(0, i, salt, op, n);
  for (int r = 1; r < n; r++) {
    int64_t v = input(r, i, salt, op, n);
    acc = combine_int(op, acc, v);
  }
  if (op == CHORUS_AVG) return is_float(dt) ? (double)acc / n : (double)(acc / n);
  return (double)acc;
}

/* ---------------------------------------------------------------- buffers */

/* Two arenas per rank (input side and output side), each WINDOW slots, in
 * both kinds of memory; an operation in slot k uses slot k of both. */
typedef struct {
  unsigned char *shm[2], *plain[2];
  size_t slot; /* bytes per slot */
} arena_t;

enum { B_MALLOC, B_MALLOC_ODD, B_SHM, B_SHM_ODD, B_KINDS };
static const char *kind_name[B_KINDS] = {"malloc", "malloc+1", "mem_alloc", "mem_alloc+odd"};

static unsigned char *buffer(arena_t *a, int side, int slot, int kind, size_t esize) {
  unsigned char *base = kind >= B_SHM ? a->shm[side] : a->plain[side];
  base += (size_t)slot * a->slot;
  if (kind == B_MALLOC_ODD) base += esize; /* one element off alignment */
  if (kind == B_SHM_ODD) base += 3 * esize;
  return base;
}

/* ---------------------------------------------------------------- one op */

enum {
  OP_BCAST, OP_REDUCE, OP_ALLREDUCE, OP_SCATTER, OP_GATHER, OP_ALLGATHER, OP_ALLGATHER_LIST,
  OP_RSCATTER, OP_ALLTOALL, OP_ALLTOALLV, OP_BARRIER, OP_SENDRECV, OP_GATHER_BYTES,
  OP_ALLGATHER_BYTES, OP_KINDS
};
static const char *op_name[OP_KINDS] = {
    "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "all_gather_list",
    "reduce_scatter", "all_to_all", "all_to_allv", "barrier", "send/recv ring", "gather_bytes",
    "all_gather_bytes"};
static const chorus_coll_t op_coll[OP_KINDS] = {
    CHORUS_COLL_BROADCAST, CHORUS_COLL_REDUCE, CHORUS_COLL_ALL_REDUCE, CHORUS_COLL_SCATTER,
    CHORUS_COLL_GATHER, CHORUS_COLL_ALL_GATHER, CHORUS_COLL_ALL_GATHER, CHORUS_COLL_REDUCE_SCATTER,
    CHORUS_COLL_ALL_TO_ALL, CHORUS_COLL_ALL_TO_ALLV, CHORUS_COLL_BARRIER, CHORUS_COLL_SEND,
    CHORUS_COLL_GATHERV, CHORUS_COLL_ALL_GATHERV};

typedef struct {
  uint64_t seed;
  long index;      /* in the sequence */
  int kind;        /* OP_* */
  chorus_dtype_t dt;
  chorus_op_t op;
  size_t count;    /* elements per block */
  int root;
  int inplace;     /* this rank */
  int bkind;       /* this rank's buffer kind */
  int async, poll;
  int slot;         /* arena slot of its buffers */
  const char *algo; /* forced, or NULL */
  int group_size, group_rank;
  uint64_t salt;
  /* This rank's buffers and handles. */
  unsigned char *in, *out;
  void *list[MAXR];
  size_t *counts;  /* all_to_allv: 4 arrays of n */
  void *bytes_out;
  size_t *lens;
  unsigned char *sr_in, *sr_out;
  chorus_work_t w, w2;
  unsigned char *snapshot; /* copy of an out-of-place input, to check it is untouched */
  size_t in_bytes;
} op_t;

static void describe(const op_t *o, char *buf, size_t cap) {
  snprintf(buf, cap,
           "seed %" PRIu64 " op #%ld: %s dtype=%s op=%s count=%zu root=%d algo=%s group %d/%d "
           "in_place=%d buffers=%s %s",
           o->seed, o->index, op_name[o->kind], chorus_dtype_name(o->dt),
           o->kind == OP_REDUCE || o->kind == OP_ALLREDUCE || o->kind == OP_RSCATTER
               ? chorus_op_name(o->op) : "-",
           o->count, o->root, o->algo ? o->algo : "auto", o->group_rank, o->group_size,
           o->inplace, kind_name[o->bkind], o->async ? (o->poll ? "async+polled" : "async")
                                                    : "blocking");
}

static void fail(const op_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(const op_t *o, const char *fmt, ...) {
  char d[400], m[1400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  describe(o, d, sizeof d);
  fprintf(stderr, "world rank %d: FAIL %s: %s\n", g_wrank, d, m);
  g_fail++;
}

/* Does operation kind k have an in-place form that this rank may choose? */
static int has_inplace(int k, int me, int root) {
  switch (k) {
    case OP_REDUCE: case OP_SCATTER: case OP_GATHER: return me == root;
    case OP_ALLREDUCE: case OP_ALLGATHER: case OP_RSCATTER: case OP_ALLTOALL: return 1;
    default: return 0;
  }
}

/* Fills this rank's inputs and sets up the call; returns the call's status. */
static chorus_result_t start(chorus_comm_t c, op_t *o, arena_t *a, int slot) {
  const int n = o->group_size, me = o->group_rank;
  const size_t es = chorus_dtype_size(o->dt), cnt = o->count;
  chorus_work_t *wp = o->async ? &o->w : NULL;
  unsigned char *A = buffer(a, 0, slot, o->bkind, es), *B = buffer(a, 1, slot, o->bkind, es);
  chorus_op_t rop = o->op;
  int mv = o->kind != OP_REDUCE && o->kind != OP_ALLREDUCE && o->kind != OP_RSCATTER;
  if (mv) rop = CHORUS_OP_COUNT;
  size_t nin = 0; /* input elements */
  switch (o->kind) {
    case OP_BCAST: nin = cnt; break;
    case OP_REDUCE: case OP_ALLREDUCE: nin = cnt; break;
    case OP_SCATTER: nin = me == o->root ? cnt * (size_t)n : 0; break;
    case OP_GATHER: case OP_ALLGATHER: case OP_ALLGATHER_LIST: nin = cnt; break;
    case OP_RSCATTER: case OP_ALLTOALL: case OP_ALLTOALLV: nin = cnt * (size_t)n; break;
    default: break;
  }
  /* Inputs: element i of block b of rank me is input(me, b*cnt + i). */
  o->in = A;
  o->out = B;
  if (o->inplace) {
    /* The in-place conventions of chorus.h. */
    switch (o->kind) {
      case OP_REDUCE: case OP_ALLREDUCE: case OP_ALLTOALL: case OP_RSCATTER: o->out = A; break;
      case OP_SCATTER: o->out = A + (size_t)o->root * cnt * es; break;
      case OP_GATHER: o->in = B + (size_t)o->root * cnt * es; break;
      case OP_ALLGATHER: o->in = B + (size_t)me * cnt * es; break;
      default: break;
    }
  }
  for (size_t i = 0; i < nin; i++)
    store_val(o->in, i, o->dt, input(me, i, o->salt, rop, n));
  if (o->kind == OP_BCAST) {
    o->out = o->in;
    if (me != o->root) memset(o->in, 0xee, cnt * es);
  }
  /* Outputs start as garbage (except where they are the input). */
  size_t nout = 0;
  switch (o->kind) {
    case OP_REDUCE: nout = me == o->root ? cnt : 0; break;
    case OP_ALLREDUCE: case OP_SCATTER: nout = cnt; break;
    case OP_GATHER: nout = me == o->root ? cnt * (size_t)n : 0; break;
    case OP_ALLGATHER: case OP_ALLTOALL: case OP_ALLTOALLV: nout = cnt * (size_t)n; break;
    case OP_RSCATTER: nout = cnt; break;
    default: break;
  }
  if (!o->inplace && nout) memset(o->out, 0xee, nout * es);
  if (o->inplace && o->kind == OP_ALLGATHER) { /* the other blocks of the output */
    for (int r = 0; r < n; r++)
      if (r != me) memset(B + (size_t)r * cnt * es, 0xee, cnt * es);
  }
  if (o->inplace && o->kind == OP_GATHER) {
    for (int r = 0; r < n; r++)
      if (r != o->root) memset(B + (size_t)r * cnt * es, 0xee, cnt * es);
  }
  /* Keep a copy of an out-of-place input to check it is left alone. */
  o->in_bytes = 0;
  if (!o->inplace && nin && o->kind != OP_BCAST) {
    o->in_bytes = nin * es;
    o->snapshot = malloc(o->in_bytes);
    if (o->snapshot) memcpy(o->snapshot, o->in, o->in_bytes);
  }
  switch (o->kind) {
    case OP_BCAST: return chorus_broadcast(c, o->in, cnt, o->dt, o->root, wp);
    case OP_REDUCE: return chorus_reduce(c, o->in, me == o->root ? o->out : NULL, cnt, o->dt, o->op, o->root, wp);
    case OP_ALLREDUCE: return chorus_all_reduce(c, o->in, o->out, cnt, o->dt, o->op, wp);
    case OP_SCATTER: return chorus_scatter(c, me == o->root ? o->in : NULL, o->out, cnt, o->dt, o->root, wp);
    case OP_GATHER: return chorus_gather(c, o->in, me == o->root ? B : NULL, cnt, o->dt, o->root, wp);
    case OP_ALLGATHER: return chorus_all_gather(c, o->in, B, cnt, o->dt, wp);
    case OP_ALLGATHER_LIST:
      /* Blocks in reverse order, to show the list is honoured. */
      for (int r = 0; r < n; r++) o->list[r] = B + (size_t)(n - 1 - r) * cnt * es;
      memset(B, 0xee, cnt * (size_t)n * es);
      return chorus_all_gather_list(c, o->in, o->list, cnt, o->dt, wp);
    case OP_RSCATTER: return chorus_reduce_scatter(c, o->in, o->inplace ? A + (size_t)me * cnt * es : o->out, cnt, o->dt, o->op, wp);
    case OP_ALLTOALL: return chorus_all_to_all(c, o->in, o->out, cnt, o->dt, wp);
    case OP_ALLTOALLV: {
      /* Rank i sends (i + j) % 3 * cnt / 2 elements to rank j, at
       * displacement j * cnt; receives likewise. */
      o->counts = malloc(4 * (size_t)n * sizeof(size_t));
      if (!o->counts) return CHORUS_ERR_NO_MEMORY;
      size_t *sc = o->counts, *sd = sc + n, *rc = sd + n, *rd = rc + n;
      for (int j = 0; j < n; j++) {
        sc[j] = (size_t)((me + j) % 3) * cnt / 2;
        sd[j] = (size_t)j * cnt;
        rc[j] = (size_t)((j + me) % 3) * cnt / 2;
        rd[j] = (size_t)j * cnt;
      }
      return chorus_all_to_allv(c, o->in, sc, sd, o->out, rc, rd, o->dt, wp);
    }
    case OP_BARRIER: return chorus_barrier(c, wp);
    case OP_SENDRECV: {
      if (n < 2) return CHORUS_OK;
      /* To the right, from the left, cnt elements, tag from the salt. */
      o->sr_in = A;
      o->sr_out = B;
      for (size_t i = 0; i < cnt; i++) store_val(A, i, o->dt, input(me, i, o->salt, CHORUS_OP_COUNT, n));
      memset(B, 0xee, cnt * es);
      int tag = (int)(o->salt & 0xffff);
      chorus_result_t st = chorus_recv(c, B, cnt, o->dt, (me + n - 1) % n, tag, &o->w);
      if (st == CHORUS_OK) st = chorus_send(c, A, cnt, o->dt, (me + 1) % n, tag, &o->w2);
      return st;
    }
    case OP_GATHER_BYTES: case OP_ALLGATHER_BYTES: {
      /* Rank r contributes (r * 37 + cnt) % 200 bytes of value r + i. */
      size_t len = ((size_t)me * 37 + cnt) % 200;
      for (size_t i = 0; i < len; i++) A[i] = (unsigned char)(me + i);
      o->lens = calloc((size_t)n, sizeof(size_t));
      if (!o->lens) return CHORUS_ERR_NO_MEMORY;
      return o->kind == OP_GATHER_BYTES
                 ? chorus_gather_bytes(c, A, len, o->root, &o->bytes_out, o->lens)
                 : chorus_all_gather_bytes(c, A, len, &o->bytes_out, o->lens);
    }
    default: return CHORUS_OK;
  }
}

/* Checks this rank's outputs once the operation completed. */
static void check(op_t *o) {
  const int n = o->group_size, me = o->group_rank;
  const size_t es = chorus_dtype_size(o->dt), cnt = o->count;
  size_t bad = 0, first = 0;
  double got = 0, want = 0;
#define EXPECT(buf, idx, value)                                                 \
  do {                                                                         \
    double g_ = load_double((buf), (idx), o->dt), w_ = (value);                        \
    int ok_ = o->op == CHORUS_AVG && is_float(o->dt) && o->kind != OP_BCAST    \
                  ? fabs(g_ - w_) <= 1e-2 * fabs(w_) + 1e-3                    \
                  : g_ == w_;                                                  \
    if (!ok_ && !bad++) first = (idx), got = g_, want = w_;                    \
  } while (0)
  const chorus_op_t mvop = CHORUS_OP_COUNT;
  switch (o->kind) {
    case OP_BCAST:
      for (size_t i = 0; i < cnt; i++) EXPECT(o->in, i, input(o->root, i, o->salt, mvop, n));
      break;
    case OP_REDUCE:
      if (me != o->root) break;
      /* fallthrough */
    case OP_ALLREDUCE:
      for (size_t i = 0; i < cnt; i++) EXPECT(o->out, i, reduce_expect(i, o->salt, o->dt, o->op, n));
      break;
    case OP_SCATTER:
      for (size_t i = 0; i < cnt; i++) EXPECT(o->out, i, input(o->root, (size_t)me * cnt + i, o->salt, mvop, n));
      break;
    case OP_GATHER:
      if (me != o->root) break;
      /* fallthrough */
    case OP_ALLGATHER: {
      unsigned char *B = o->inplace ? o->in - (size_t)(o->kind == OP_GATHER ? o->root : me) * cnt * es : o->out;
      for (int r = 0; r < n; r++)
        for (size_t i = 0; i < cnt; i++) EXPECT(B, (size_t)r * cnt + i, input(r, i, o->salt, mvop, n));
      break;
    }
    case OP_ALLGATHER_LIST:
      for (int r = 0; r < n; r++)
        for (size_t i = 0; i < cnt; i++) EXPECT(o->list[r], i, input(r, i, o->salt, mvop, n));
      break;
    case OP_RSCATTER: {
      const unsigned char *res = o->inplace ? o->in + (size_t)me * cnt * es : o->out;
      for (size_t i = 0; i < cnt; i++)
        EXPECT(res, i, reduce_expect((size_t)me * cnt + i, o->salt, o->dt, o->op, n));
      break;
    }
    case OP_ALLTOALL:
      for (int r = 0; r < n; r++)
        for (size_t i = 0; i < cnt; i++)
          EXPECT(o->out, (size_t)r * cnt + i, input(r, (size_t)me * cnt + i, o->salt, mvop, n));
      break;
    case OP_ALLTOALLV:
      for (int r = 0; r < n; r++) {
        size_t k = (size_t)((r + me) % 3) * cnt / 2;
        for (size_t i = 0; i < k; i++)
          EXPECT(o->out, (size_t)r * cnt + i, input(r, (size_t)me * cnt + i, o->salt, mvop, n));
      }
      break;
    case OP_SENDRECV:
      if (n < 2) break;
      for (size_t i = 0; i < cnt; i++) EXPECT(o->sr_out, i, input((me + n - 1) % n, i, o->salt, mvop, n));
      break;
    case OP_GATHER_BYTES: case OP_ALLGATHER_BYTES: {
      if (o->kind == OP_GATHER_BYTES && me != o->root) {
        if (o->bytes_out) fail(o, "a non-root rank received a gather_bytes result");
        break;
      }
      const unsigned char *p = o->bytes_out;
      for (int r = 0; r < n; r++) {
        size_t len = ((size_t)r * 37 + cnt) % 200;
        if (o->lens[r] != len) {
          fail(o, "rank %d's length is %zu, want %zu", r, o->lens[r], len);
          return;
        }
        for (size_t i = 0; i < len; i++)
          if (!p || p[i] != (unsigned char)(r + i)) {
            fail(o, "rank %d's byte %zu is wrong", r, i);
            return;
          }
        p += len;
      }
      break;
    }
    default: break;
  }
#undef EXPECT
  if (bad) fail(o, "%zu elements wrong, first at [%zu]: got %g, want %g", bad, first, got, want);
  if (o->snapshot && memcmp(o->snapshot, o->in, o->in_bytes))
    fail(o, "the out-of-place input was modified");
  if (!bad) g_pass++;
}

static void release(op_t *o) {
  chorus_work_free(o->w);
  chorus_work_free(o->w2);
  free(o->snapshot);
  free(o->counts);
  free(o->lens);
  chorus_free(o->bytes_out);
  memset(o, 0, sizeof *o);
}

/* Completes o: polls it first when drawn so, then waits; checks it. */
static void complete(chorus_comm_t c, op_t *o) {
  chorus_result_t st = CHORUS_OK;
  chorus_work_t ws[2] = {o->w, o->w2};
  for (int k = 0; k < 2; k++) {
    if (!ws[k]) continue;
    if (o->poll) {
      for (int i = 0; i < 100000; i++) {
        chorus_result_t p = i % 2 ? chorus_work_test(ws[k]) : chorus_work_wait(ws[k], 0);
        if (p != CHORUS_INPROGRESS) break;
      }
    }
    chorus_result_t s = chorus_work_wait(ws[k], -1);
    if (s != CHORUS_OK && st == CHORUS_OK) {
      st = s;
      fail(o, "wait returned %s: %s", chorus_result_name(s), chorus_work_error(ws[k]));
    }
  }
  if (st == CHORUS_OK) check(o);
  (void)c;
  release(o);
}

/* ------------------------------------------------------------- sequence */

typedef struct {
  chorus_comm_t c;
  op_t pend[WINDOW];
  int npend;
} runner_t;

static void drain(runner_t *run, rng_t *g) {
  /* In random order (the same draw on every rank, though any order is
   * legal: collectives complete in issue order anyway). */
  while (run->npend) {
    int k = (int)below(g, (uint64_t)run->npend);
    complete(run->c, &run->pend[k]);
    run->pend[k] = run->pend[run->npend - 1];
    memset(&run->pend[run->npend - 1], 0, sizeof(op_t));
    run->npend--;
  }
}

static int algo_count(chorus_coll_t coll) {
  int k = 0;
  while (chorus_algo_name(coll, k)) k++;
  return k;
}

/* Whether every member of c shares this rank's host (CHORUS_HOST_ID may
 * split one machine into several): only then may "direct" be forced. */
static int one_host(chorus_comm_t c) {
  for (int p = 0; p < chorus_comm_size(c); p++)
    if (chorus_comm_same_host(c, p) != 1) return 0;
  return 1;
}

static int run_one(runner_t *run, arena_t *a, rng_t *g, uint64_t seed, long index) {
  chorus_comm_t c = run->c;
  const int n = chorus_comm_size(c), me = chorus_comm_rank(c);
  op_t o;
  memset(&o, 0, sizeof o);
  o.seed = seed;
  o.index = index;
  o.group_size = n;
  o.group_rank = me;
  o.kind = (int)below(g, OP_KINDS);
  o.dt = (chorus_dtype_t)below(g, CHORUS_DTYPE_COUNT);
  int reducing = o.kind == OP_REDUCE || o.kind == OP_ALLREDUCE || o.kind == OP_RSCATTER;
  do o.op = (chorus_op_t)below(g, CHORUS_OP_COUNT);
  while (!is_float(o.dt) ? 0 : o.op >= CHORUS_BAND);
  if (!reducing) o.op = CHORUS_SUM;
  if (o.op == CHORUS_SUM && n > 8 && o.dt == CHORUS_INT8) o.op = CHORUS_MAX;
  o.root = (int)below(g, (uint64_t)n);
  o.salt = next(g);
  /* Count per block: zero, tiny, medium or large (the zero-copy paths
   * start at 64 KiB in all, chunking at the segment's buffer size). */
  const size_t es = chorus_dtype_size(o.dt);
  int blocks = o.kind == OP_BCAST || o.kind == OP_REDUCE || o.kind == OP_ALLREDUCE ||
                       o.kind == OP_SENDRECV ? 1 : n;
  size_t maxc = (a->slot - 8 * es) / es / (size_t)blocks;
  uint64_t sz = below(g, 100);
  o.count = sz < 5 ? 0 : sz < 40 ? 1 + below(g, 16) : sz < 70 ? 17 + below(g, 2000)
                                                    : 2017 + below(g, maxc > 2017 ? maxc - 2017 : 1);
  if (o.count > maxc) o.count = maxc;
  if (o.kind == OP_GATHER_BYTES || o.kind == OP_ALLGATHER_BYTES) o.count %= 1000;
  uint64_t ip_draw = next(g), kind_draw = next(g);
  o.inplace = has_inplace(o.kind, me, o.root) && per_rank(ip_draw, me) % 2;
  o.bkind = (int)(per_rank(kind_draw, me) % B_KINDS);
  /* Mostly every rank on the same kind of memory, so the zero-copy paths
   * run; per-rank mixes the rest of the time. */
  if (kind_draw % 3 != 0) o.bkind = (int)(kind_draw / 3 % B_KINDS);
  o.async = o.kind != OP_GATHER_BYTES && o.kind != OP_ALLGATHER_BYTES && (below(g, 100) < 35 || o.kind == OP_SENDRECV);
  o.poll = below(g, 2);
  /* Forced algorithm now and then. */
  chorus_coll_t coll = op_coll[o.kind];
  int forced = 0;
  if (below(g, 100) < 15 && coll <= CHORUS_COLL_BARRIER) {
    int na = algo_count(coll);
    const char *name = na ? chorus_algo_name(coll, (int)below(g, (uint64_t)na)) : NULL;
    if (name && !((g_tcp || !one_host(c)) && !strcmp(name, "direct"))) {
      drain(run, g); /* the choice applies to calls issued from now on */
      chorus_result_t st = chorus_comm_set_algo(c, coll, name);
      if (st != CHORUS_OK) {
        fail(&o, "set_algo(%s) returned %s", name, chorus_result_name(st));
        return -1;
      }
      o.algo = name;
      forced = 1;
    }
  }
  if (!o.async || run->npend == WINDOW) drain(run, g);
  /* A slot of the arenas no pending operation uses. */
  int used[WINDOW] = {0}, slot = 0;
  for (int k = 0; k < run->npend; k++) used[run->pend[k].slot] = 1;
  while (used[slot]) slot++;
  o.slot = slot;
  chorus_result_t st = start(c, &o, a, slot);
  int rc = 0;
  if (st != CHORUS_OK) {
    fail(&o, "the call returned %s: %s", chorus_result_name(st), chorus_comm_last_error(c));
    release(&o);
    rc = -1;
  } else if (o.async) {
    run->pend[run->npend++] = o;
  } else {
    complete(c, &o);
  }
  if (forced) {
    drain(run, g);
    chorus_comm_set_algo(c, coll, "auto");
  }
  return rc;
}

static int run_sequence(chorus_comm_t world, arena_t *a, uint64_t seed, long ops) {
  rng_t g = {seed};
  runner_t run = {.c = world};
  long i = 0;
  while (i < ops && !g_fail) {
    /* A subgroup now and then: split by a drawn colour, a few ops on it. */
    if (below(&g, 100) < 4 && g_wsize > 1) {
      drain(&run, &g);
      int colours = 1 + (int)below(&g, 3);
      uint64_t cd = next(&g);
      int colour = (int)(per_rank(cd, g_wrank) % (uint64_t)colours);
      chorus_comm_t sub = NULL;
      chorus_result_t st = chorus_comm_split(world, colour, (int)(per_rank(cd, g_wrank) >> 8 & 7), &sub);
      if (st != CHORUS_OK || !sub) {
        fprintf(stderr, "world rank %d: FAIL seed %" PRIu64 " op #%ld: split returned %s: %s\n",
                g_wrank, seed, i, chorus_result_name(st), chorus_comm_last_error(world));
        g_fail++;
        return -1;
      }
      /* Every subgroup runs the same number of draws, so the world's
       * stream stays in step: each member draws from a copy. */
      int k = 2 + (int)below(&g, 4);
      rng_t sg = {next(&g)};
      runner_t sr = {.c = sub};
      for (int j = 0; j < k && !g_fail; j++, i++) run_one(&sr, a, &sg, seed, i);
      drain(&sr, &sg);
      chorus_comm_destroy(sub);
      continue;
    }
    run_one(&run, a, &g, seed, i);
    i++;
  }
  drain(&run, &g);
  return g_fail ? -1 : 0;
}

int main(int argc, char **argv) {
  uint64_t seed = 0;
  long ops = 200, seeds = 1;
  const char *env = getenv("CHORUS_RANDOM_SEED");
  if (env) seed = strtoull(env, NULL, 10);
  else seed = (uint64_t)time(NULL);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(argv[i], "--seeds") && i + 1 < argc) seeds = atol(argv[++i]);
    else if (!strcmp(argv[i], "--ops") && i + 1 < argc) ops = atol(argv[++i]);
    else if (!strcmp(argv[i], "--max-bytes") && i + 1 < argc) g_max_bytes = (size_t)atol(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--seed S] [--seeds K] [--ops N] [--max-bytes B]\n", argv[0]);
      return 2;
    }
  }
  const char *tr = getenv("CHORUS_TRANSPORT");
  g_tcp = tr && !strcmp(tr, "tcp");
  chorus_comm_t world;
  if (chorus_comm_init_env(&world) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_wrank = chorus_comm_rank(world);
  g_wsize = chorus_comm_size(world);
  /* Everyone runs rank 0's seed. */
  int64_t s64 = (int64_t)seed;
  if (chorus_broadcast(world, &s64, 1, CHORUS_INT64, 0, NULL) != CHORUS_OK) return 1;
  seed = (uint64_t)s64;
  if (g_wrank == 0)
    printf("test_random: %d ranks, seeds %" PRIu64 "..%" PRIu64 ", %ld operations each%s\n",
           g_wsize, seed, seed + (uint64_t)seeds - 1, ops, g_tcp ? ", TCP" : "");
  arena_t a;
  memset(&a, 0, sizeof a);
  a.slot = g_max_bytes + 64;
  for (int s = 0; s < 2; s++) {
    void *p = NULL;
    if (chorus_mem_alloc(world, a.slot * WINDOW, &p) != CHORUS_OK || !p) {
      fprintf(stderr, "chorus_mem_alloc failed: %s\n", chorus_comm_last_error(world));
      return 1;
    }
    a.shm[s] = p;
    a.plain[s] = malloc(a.slot * WINDOW);
    if (!a.plain[s]) return 1;
  }
  for (long k = 0; k < seeds && !g_fail; k++) run_sequence(world, &a, seed + (uint64_t)k, ops);
  if (g_fail)
    fprintf(stderr, "world rank %d: replay with: test_random --seed <the seed above> --ops %ld\n",
            g_wrank, ops);
  /* Every rank's tally; a rank that failed may have left the world broken,
   * and then its own exit status reports it. */
  long tally[2] = {g_pass, g_fail}, total[2] = {0, 0};
  chorus_result_t st = chorus_all_reduce(world, tally, total, 2, CHORUS_INT64, CHORUS_SUM, NULL);
  if (st != CHORUS_OK) total[0] = g_pass, total[1] = g_fail + 1;
  if (g_wrank == 0) printf("%ld passed, %ld failed\n", total[0], total[1]);
  chorus_barrier(world, NULL); /* nobody uses the allocations any more */
  for (int s = 0; s < 2; s++) {
    chorus_mem_free(world, a.shm[s]);
    free(a.plain[s]);
  }
  chorus_comm_destroy(world);
  return total[1] || g_fail ? 1 : 0;
}
