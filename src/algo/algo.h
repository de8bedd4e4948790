/*
 * algo.h - the algorithm layer: one description of a collective call
 * (chorus__coll_t), a registry of named algorithms per collective, and the
 * message helpers every algorithm is written with.
 *
 * An algorithm is straight-line code run by one thread (the caller's, or the
 * communicator's worker for asynchronous calls).  It posts sends and receives
 * through the transport endpoint and waits for them; every wait is bounded by
 * the communicator's timeout, and any failure of the endpoint (peer died,
 * mismatch, abort) makes the wait return the error at once.  Algorithms send
 * the same messages whatever the count (zero-length ones included); the core
 * adds a fingerprint exchange with the ring neighbours to every collective,
 * so a mismatched call is always seen by some receiver.
 *
 * Steps: every message of one collective has a step number, unique per
 * (sender, receiver) pair within that collective; (sequence number, step)
 * is the match key.
 */
#ifndef CHORUS_ALGO_ALGO_H
#define CHORUS_ALGO_ALGO_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "chorus.h"
#include "transport/transport.h"

/* Scratch buffers kept by a communicator between calls, so large
 * collectives do not pay for fresh pages (page faults) on every call.  Only
 * one collective of a communicator runs at a time, so the pool needs no
 * lock.  Buffers above CHORUS__POOL_MAX_BYTES are not kept. */
#define CHORUS__POOL_SLOTS 4
#define CHORUS__POOL_MAX_BYTES ((size_t)128 << 20)
typedef struct chorus__pool {
  void *buf[CHORUS__POOL_SLOTS];
  size_t cap[CHORUS__POOL_SLOTS];
  int used[CHORUS__POOL_SLOTS];
} chorus__pool_t;

/* Frees every buffer of the pool (none may be in use). */
void chorus__pool_release(chorus__pool_t *pool);

struct chorus__shm;

/* Where the group's ranks live, from the host map learned at rendezvous;
 * the same on every rank, so a selector that reads it stays consistent.
 * Hosts are numbered by first appearance in group order; a rank's local
 * index is its position among its host's ranks in group order. */
typedef struct chorus__topo {
  int nhosts;
  int ppn;       /* ranks on every host when all hosts have as many, else 0 */
  int blocked;   /* every host's ranks are consecutive group ranks */
  int host, lidx;   /* this rank's host and local index */
  int nlocal;       /* ranks on this rank's host */
  int *local;       /* [nlocal]: those ranks, in group order */
  int *cross;       /* [nhosts]: the rank of local index lidx on each host that has one */
  int *map;         /* [nhosts * ppn] when ppn: map[h * ppn + l] = rank of local index l on h */
} chorus__topo_t;

/* Builds t for a group of n ranks whose hosts are host[0..n) (any values,
 * equal for ranks of one host), this rank being me.  Returns -1 when out of
 * memory; free with chorus__topo_free. */
int chorus__topo_build(chorus__topo_t *t, const uint64_t *host, int n, int me);
void chorus__topo_free(chorus__topo_t *t);

typedef struct chorus__coll {
  chorus_coll_t coll;
  const void *sendbuf;
  void *recvbuf;
  size_t count;
  chorus_dtype_t dtype;
  chorus_op_t op; /* CHORUS_OP_COUNT when none */
  int root;       /* -1 when none */
  void **recvbufs;                   /* all_gather_list (copied array) */
  size_t *scounts, *sdispls;         /* all_to_allv (copied arrays) */
  size_t *rcounts, *rdispls;
  int peer, tag;                     /* send / recv */
  void **out;                        /* gatherv / all_gatherv results */
  size_t *lens;
  /* Execution context, filled by the core. */
  chorus__ep_t *ep;
  int rank, size;
  int timeout_ms;
  size_t esize;
  int algo;
  chorus__pool_t *pool; /* the communicator's scratch pool, or NULL */
  struct chorus__shm *shm; /* the group's shared-memory segment, or NULL */
  const chorus__topo_t *topo; /* the group's host map */
  chorus__fp_t fp;         /* this call's fingerprint */
  char err[256]; /* local failure reason (e.g. out of memory) */
} chorus__coll_t;

typedef chorus_result_t (*chorus__algo_fn_t)(chorus__coll_t *c);

typedef struct chorus__algo {
  const char *name;
  chorus__algo_fn_t run;
  const char *desc;
  int shm; /* needs the shared-memory segment (every rank on one host) */
} chorus__algo_t;

/* The algorithms registered for coll (*n receives their number). */
const chorus__algo_t *chorus__algos(chorus_coll_t coll, int *n);

/* Index of the algorithm named name for coll, or -1. */
int chorus__algo_find(chorus_coll_t coll, const char *name);

/* The automatic choice for c (depends only on arguments every rank shares). */
int chorus__algo_select(const chorus__coll_t *c);

/* The tuning table (tune.c): loads CHORUS_TUNING_FILE (once per process)
 * and the built-in rules; an error names the file's bad line.  select
 * returns the first matching rule's algorithm for c (0 when none matches)
 * and where it came from; the file's name (NULL when none) and c's kind of
 * group ("one-host", "hosts", "flat") for messages. */
chorus_result_t chorus__tune_load(char *err, size_t cap);
int chorus__tune_select(const chorus__coll_t *c, int *rule_line, int *from_file);
const char *chorus__tune_file(void);
const char *chorus__tune_where_name(const chorus__coll_t *c);

/* Formats a fingerprint with the algorithm's name (for the transport). */
void chorus__fp_format(const chorus__fp_t *fp, char *buf, size_t cap);

/* ------------------------------------------------------------- helpers */

/* A ring over some ranks of the group: position i is group rank ranks[i]
 * (rank i when ranks is NULL); this rank is position me. */
typedef struct chorus__ring {
  const int *ranks;
  int n, me;
} chorus__ring_t;

/* Segments a ring step may use (ring.c), and the step numbers one pass over
 * an n-position ring may take: a second pass starts that many later. */
#define CHORUS__RING_SEGS 8
#define CHORUS__RING_STEPS(n) ((uint32_t)(n) * CHORUS__RING_SEGS)

/* One ring pass over buf, count elements cut into ring->n blocks: a
 * reduce-scatter (reducing = 1; input from src, which may be buf; block
 * ring->me of buf ends reduced over the ring, the other blocks undefined)
 * or an all-gather (reducing = 0; src unused; position i brings block i).
 * Steps step0 .. step0 + CHORUS__RING_STEPS(ring->n) - 1. */
chorus_result_t chorus__ring_pass(chorus__coll_t *c, const chorus__ring_t *ring, char *buf,
                                  const char *src, size_t count, int reducing, uint32_t step0);

/* Fills req as a collective send or receive of the current call. */
static inline void chorus__coll_req(chorus__req_t *req, int type, int peer, void *buf, size_t len,
                                    uint32_t step) {
  memset(req, 0, sizeof *req);
  req->type = type;
  req->peer = peer;
  req->kind = CHORUS__KIND_COLL;
  req->step = step;
  req->tag = -1;
  req->buf = buf;
  req->len = len;
}

/* Posts a receive of rlen bytes from rpeer (if rpeer >= 0) and a send of
 * slen bytes to speer (if speer >= 0), both with the given step, and waits
 * for both. */
chorus_result_t chorus__xchg(chorus__coll_t *c, int speer, const void *sbuf, size_t slen,
                             int rpeer, void *rbuf, size_t rlen, uint32_t step);

static inline chorus_result_t chorus__send(chorus__coll_t *c, int peer, const void *buf,
                                           size_t len, uint32_t step) {
  return chorus__xchg(c, peer, buf, len, -1, NULL, 0, step);
}
static inline chorus_result_t chorus__recv(chorus__coll_t *c, int peer, void *buf, size_t len,
                                           uint32_t step) {
  return chorus__xchg(c, -1, NULL, 0, peer, buf, len, step);
}

/* Scratch memory of n bytes (n may be 0) from the communicator's pool, or
 * malloc'd when the pool has no room; records a failure message on c and
 * returns NULL when out of memory.  Give it back with chorus__scratch_free
 * (NULL is fine).  Contents are undefined. */
void *chorus__scratch(chorus__coll_t *c, size_t n);
void chorus__scratch_free(chorus__coll_t *c, void *p);

/* dst = a op b over n elements of c's dtype (dst may alias a or b). */
void chorus__combine(const chorus__coll_t *c, void *dst, const void *a, const void *b, size_t n);

/* Block b of n equal-as-possible blocks of count elements: the first
 * count % n blocks get one element more. */
static inline size_t chorus__blk_count(size_t count, int n, int b) {
  return count / (size_t)n + ((size_t)b < count % (size_t)n ? 1 : 0);
}
static inline size_t chorus__blk_offset(size_t count, int n, int b) {
  size_t q = count / (size_t)n, r = count % (size_t)n;
  return q * (size_t)b + ((size_t)b < r ? (size_t)b : r);
}

/* Per-family entry points, registered in registry.c. */
#define CHORUS__ALGO_DECL(fn) chorus_result_t fn(chorus__coll_t *c)
CHORUS__ALGO_DECL(chorus__bcast_binomial);
CHORUS__ALGO_DECL(chorus__bcast_linear);
CHORUS__ALGO_DECL(chorus__reduce_binomial);
CHORUS__ALGO_DECL(chorus__reduce_linear);
CHORUS__ALGO_DECL(chorus__allreduce_ring);
CHORUS__ALGO_DECL(chorus__allreduce_rd);
CHORUS__ALGO_DECL(chorus__allreduce_rabenseifner);
CHORUS__ALGO_DECL(chorus__allreduce_reduce_bcast);
CHORUS__ALGO_DECL(chorus__scatter_binomial);
CHORUS__ALGO_DECL(chorus__scatter_linear);
CHORUS__ALGO_DECL(chorus__gather_binomial);
CHORUS__ALGO_DECL(chorus__gather_linear);
CHORUS__ALGO_DECL(chorus__allgather_ring);
CHORUS__ALGO_DECL(chorus__allgather_bruck);
CHORUS__ALGO_DECL(chorus__reduce_scatter_ring);
CHORUS__ALGO_DECL(chorus__reduce_scatter_pairwise);
CHORUS__ALGO_DECL(chorus__alltoall_pairwise);
CHORUS__ALGO_DECL(chorus__alltoallv_pairwise);
CHORUS__ALGO_DECL(chorus__barrier_dissemination);
CHORUS__ALGO_DECL(chorus__gatherv_linear);
CHORUS__ALGO_DECL(chorus__allreduce_direct);
CHORUS__ALGO_DECL(chorus__reduce_direct);
CHORUS__ALGO_DECL(chorus__allgather_direct);
CHORUS__ALGO_DECL(chorus__gather_direct);
CHORUS__ALGO_DECL(chorus__reduce_scatter_direct);
CHORUS__ALGO_DECL(chorus__alltoall_direct);
CHORUS__ALGO_DECL(chorus__bcast_direct);
CHORUS__ALGO_DECL(chorus__scatter_direct);
CHORUS__ALGO_DECL(chorus__barrier_direct);
CHORUS__ALGO_DECL(chorus__allgatherv_ring);
CHORUS__ALGO_DECL(chorus__allreduce_hier);
CHORUS__ALGO_DECL(chorus__reduce_scatter_hier);
CHORUS__ALGO_DECL(chorus__allgather_hier);
CHORUS__ALGO_DECL(chorus__bcast_hier);
CHORUS__ALGO_DECL(chorus__reduce_hier);

#endif
