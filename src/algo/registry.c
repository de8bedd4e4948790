/*
 * registry.c - the table of algorithms per collective, the automatic choice,
 * and the helpers algorithms are written with (exchange, scratch, combine).
 *
 * The automatic choice depends only on values every rank of a correct
 * program shares (count, dtype, group size), so all ranks pick the same
 * algorithm; the choice is part of the call's fingerprint, so ranks that were
 * told to use different ones (different CHORUS_*_ALGO) fail with a mismatch
 * instead of exchanging garbage.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "reduce/reduce.h"
#include "util/log.h"

#define A(name, fn, desc) {name, fn, desc, 0}
#define D(fn, desc) {"direct", fn, "shared memory: " desc, 1}

static const chorus__algo_t g_bcast[] = {
    A("binomial", chorus__bcast_binomial, "binomial tree, log2(n) rounds"),
    A("linear", chorus__bcast_linear, "root sends to every rank"),
    A("hierarchical", chorus__bcast_hier,
      "root scatters to its host's ranks, each passes its block from host to host in a "
      "pipelined chain, ring all-gather in each host (binomial below 3 hosts or unless every "
      "host has as many ranks)"),
    D(chorus__bcast_direct, "root copies in once, every rank copies out"),
};
static const chorus__algo_t g_reduce[] = {
    A("binomial", chorus__reduce_binomial, "binomial tree, log2(n) rounds"),
    A("linear", chorus__reduce_linear, "root receives from every rank"),
    A("hierarchical", chorus__reduce_hier,
      "ring reduce-scatter in each host, each block reduced down a pipelined chain of hosts to "
      "the root's, blocks gathered to the root (binomial below 3 hosts or unless every host "
      "has as many ranks)"),
    D(chorus__reduce_direct, "each rank reduces a slice from every buffer"),
};
static const chorus__algo_t g_allreduce[] = {
    A("ring", chorus__allreduce_ring, "ring reduce-scatter + ring all-gather, 2(n-1) steps"),
    A("recursive_doubling", chorus__allreduce_rd,
      "recursive doubling, log2(n) rounds (+2 for non-powers of two)"),
    A("reduce_broadcast", chorus__allreduce_reduce_bcast, "binomial reduce + binomial broadcast"),
    A("rabenseifner", chorus__allreduce_rabenseifner,
      "recursive-halving reduce-scatter + recursive-doubling all-gather, 2 log2(n) rounds"),
    A("hierarchical", chorus__allreduce_hier,
      "ring reduce-scatter in each host, ring all_reduce of each local rank's block between "
      "hosts, ring all-gather in each host (flat ring unless every host has as many ranks)"),
    D(chorus__allreduce_direct, "each rank reduces a slice from every buffer, then copies the others' slices"),
};
static const chorus__algo_t g_scatter[] = {
    A("binomial", chorus__scatter_binomial, "binomial tree"),
    A("linear", chorus__scatter_linear, "root sends each block directly"),
    D(chorus__scatter_direct, "root copies in once, every rank copies its block out"),
};
static const chorus__algo_t g_gather[] = {
    A("binomial", chorus__gather_binomial, "binomial tree"),
    A("linear", chorus__gather_linear, "root receives each block directly"),
    D(chorus__gather_direct, "every rank copies in once, root copies out"),
};
static const chorus__algo_t g_allgather[] = {
    A("ring", chorus__allgather_ring, "ring, n-1 steps"),
    A("bruck", chorus__allgather_bruck, "Bruck, ceil(log2(n)) rounds"),
    A("hierarchical", chorus__allgather_hier,
      "ring between hosts among the ranks of each local index, then ring in each host "
      "(flat ring unless every host has as many ranks)"),
    D(chorus__allgather_direct, "every rank copies in once and copies every block out"),
};
static const chorus__algo_t g_reduce_scatter[] = {
    A("ring", chorus__reduce_scatter_ring, "ring, n-1 steps"),
    A("pairwise", chorus__reduce_scatter_pairwise, "every rank sends block j to rank j"),
    A("hierarchical", chorus__reduce_scatter_hier,
      "ring reduce-scatter in each host, then between hosts among the ranks of each local index "
      "(flat ring unless every host has as many ranks)"),
    D(chorus__reduce_scatter_direct, "each rank reduces its block from every buffer"),
};
static const chorus__algo_t g_alltoall[] = {
    A("pairwise", chorus__alltoall_pairwise, "n-1 pairwise exchanges"),
    D(chorus__alltoall_direct, "every rank copies in once and copies its blocks out"),
};
static const chorus__algo_t g_alltoallv[] = {
    A("pairwise", chorus__alltoallv_pairwise, "n-1 pairwise exchanges"),
};
static const chorus__algo_t g_barrier[] = {
    A("dissemination", chorus__barrier_dissemination, "ceil(log2(n)) rounds"),
    D(chorus__barrier_direct, "one flag per rank"),
};
static const chorus__algo_t g_gatherv[] = {
    A("linear", chorus__gatherv_linear, "sizes then data, root receives directly"),
};
static const chorus__algo_t g_allgatherv[] = {
    A("ring", chorus__allgatherv_ring, "ring all-gather of sizes, then of data"),
};
static const chorus__algo_t g_p2p[] = {
    A("direct", NULL, "one message"),
};

const chorus__algo_t *chorus__algos(chorus_coll_t coll, int *n) {
#define CASE(c, t)                                                              \
  case c:                                                                      \
    *n = (int)(sizeof t / sizeof t[0]);                                        \
    return t;
  switch (coll) {
    CASE(CHORUS_COLL_BROADCAST, g_bcast)
    CASE(CHORUS_COLL_REDUCE, g_reduce)
    CASE(CHORUS_COLL_ALL_REDUCE, g_allreduce)
    CASE(CHORUS_COLL_SCATTER, g_scatter)
    CASE(CHORUS_COLL_GATHER, g_gather)
    CASE(CHORUS_COLL_ALL_GATHER, g_allgather)
    CASE(CHORUS_COLL_REDUCE_SCATTER, g_reduce_scatter)
    CASE(CHORUS_COLL_ALL_TO_ALL, g_alltoall)
    CASE(CHORUS_COLL_ALL_TO_ALLV, g_alltoallv)
    CASE(CHORUS_COLL_BARRIER, g_barrier)
    CASE(CHORUS_COLL_GATHERV, g_gatherv)
    CASE(CHORUS_COLL_ALL_GATHERV, g_allgatherv)
    CASE(CHORUS_COLL_SEND, g_p2p)
    CASE(CHORUS_COLL_RECV, g_p2p)
    default:
      *n = 0;
      return NULL;
  }
#undef CASE
}

const char *chorus_algo_name(chorus_coll_t coll, int idx) {
  int n;
  const chorus__algo_t *t = chorus__algos(coll, &n);
  return t && idx >= 0 && idx < n ? t[idx].name : NULL;
}

int chorus__algo_find(chorus_coll_t coll, const char *name) {
  int n;
  const chorus__algo_t *t = chorus__algos(coll, &n);
  for (int i = 0; t && i < n; i++)
    if (!strcmp(t[i].name, name)) return i;
  return -1;
}

/* The automatic choice: the tuning table (tune.c).  An all_reduce with
 * fewer elements than ranks leaves ring blocks empty, so it runs recursive
 * doubling whatever the table says about its size. */
int chorus__algo_select(const chorus__coll_t *c) {
  int line, from_file;
  int idx = chorus__tune_select(c, &line, &from_file);
  if (c->coll == CHORUS_COLL_ALL_REDUCE && c->count < (size_t)c->size) {
    const char *name = g_allreduce[idx].name;
    if (!strcmp(name, "ring") || !strcmp(name, "hierarchical") || !strcmp(name, "rabenseifner"))
      idx = chorus__algo_find(CHORUS_COLL_ALL_REDUCE, "recursive_doubling");
  }
  CHORUS_DEBUG(CHORUS__SUB_ALGO, "algo: %s of %zu bytes on %d ranks (%s): %s, by %s line %d",
               chorus_coll_name(c->coll), c->count * c->esize, c->size,
               chorus__tune_where_name(c), chorus_algo_name(c->coll, idx),
               from_file ? chorus__tune_file() : line ? "the built-in table" : "default (no rule)",
               line);
  return idx;
}

void chorus__fp_format(const chorus__fp_t *fp, char *buf, size_t cap) {
  const char *algo = chorus_algo_name((chorus_coll_t)fp->coll, fp->algo);
  int n = snprintf(buf, cap, "%s(count=%" PRIu64 ", %s", chorus_coll_name((chorus_coll_t)fp->coll),
                   fp->count, chorus_dtype_name((chorus_dtype_t)fp->dtype));
  if (n < 0 || (size_t)n >= cap) return;
  if (fp->op < CHORUS_OP_COUNT)
    n += snprintf(buf + n, cap - (size_t)n, ", %s", chorus_op_name((chorus_op_t)fp->op));
  if ((size_t)n >= cap) return;
  if (fp->root >= 0) n += snprintf(buf + n, cap - (size_t)n, ", root=%d", (int)fp->root);
  if ((size_t)n >= cap) return;
  snprintf(buf + n, cap - (size_t)n, ", algo %s)", algo ? algo : "?");
}

/* ------------------------------------------------------------- helpers */

chorus_result_t chorus__xchg(chorus__coll_t *c, int speer, const void *sbuf, size_t slen,
                             int rpeer, void *rbuf, size_t rlen, uint32_t step) {
  chorus__req_t rr, sr;
  chorus__req_t *reqs[2] = {NULL, NULL};
  chorus_result_t st;
  if (rpeer >= 0) {
    chorus__coll_req(&rr, CHORUS__REQ_RECV, rpeer, rbuf, rlen, step);
    st = chorus__ep_post(c->ep, &rr);
    if (st != CHORUS_OK) return st;
    reqs[0] = &rr;
  }
  if (speer >= 0) {
    chorus__coll_req(&sr, CHORUS__REQ_SEND, speer, (void *)sbuf, slen, step);
    st = chorus__ep_post(c->ep, &sr);
    if (st != CHORUS_OK) {
      /* The receive may be posted: failing the endpoint detaches it. */
      if (chorus__ep_status(c->ep, NULL, 0) == CHORUS_OK)
        chorus__ep_fail(c->ep, st, 1, "chorus rank %d/%d: cannot post a send: %s", c->rank,
                        c->size, chorus_strerror(st));
      return st;
    }
    reqs[1] = &sr;
  }
  return chorus__ep_wait(c->ep, reqs, 2, c->timeout_ms);
}

void *chorus__scratch(chorus__coll_t *c, size_t n) {
  chorus__pool_t *pool = c->pool;
  if (n == 0) n = 1;
  if (pool && n <= CHORUS__POOL_MAX_BYTES) {
    /* The smallest free slot that fits; else grow the largest free one. */
    int best = -1, grow = -1;
    for (int i = 0; i < CHORUS__POOL_SLOTS; i++) {
      if (pool->used[i]) continue;
      if (pool->buf[i] && pool->cap[i] >= n && (best < 0 || pool->cap[i] < pool->cap[best]))
        best = i;
      if (grow < 0 || pool->cap[i] > pool->cap[grow]) grow = i;
    }
    if (best < 0 && grow >= 0) {
      void *q = malloc(n);
      if (q) {
        free(pool->buf[grow]);
        pool->buf[grow] = q;
        pool->cap[grow] = n;
        best = grow;
      }
    }
    if (best >= 0) {
      pool->used[best] = 1;
      return pool->buf[best];
    }
  }
  void *p = malloc(n);
  if (!p)
    snprintf(c->err, sizeof c->err, "out of memory allocating %zu bytes of scratch space", n);
  return p;
}

void chorus__scratch_free(chorus__coll_t *c, void *p) {
  if (!p) return;
  if (c->pool)
    for (int i = 0; i < CHORUS__POOL_SLOTS; i++)
      if (c->pool->buf[i] == p && c->pool->used[i]) {
        c->pool->used[i] = 0;
        return;
      }
  free(p);
}

void chorus__pool_release(chorus__pool_t *pool) {
  for (int i = 0; i < CHORUS__POOL_SLOTS; i++) {
    free(pool->buf[i]);
    pool->buf[i] = NULL;
    pool->cap[i] = 0;
    pool->used[i] = 0;
  }
}

void chorus__combine(const chorus__coll_t *c, void *dst, const void *a, const void *b, size_t n) {
  chorus__reduce_fn_t fn = chorus__reduce_fn(c->dtype, c->op);
  if (fn && n) fn(dst, a, b, n);
}
