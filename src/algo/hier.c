/*
 * hier.c - the group's host map, and the hierarchical algorithms that use it.
 *
 * A group that spans hosts pays for every byte that crosses a host's link;
 * bytes between ranks of one host are cheap (shared memory, or loopback).
 * The flat ring treats both alike: with L ranks on each of H hosts, a host's
 * link carries 2(n-1)/n of the vector each way for an all_reduce.  The
 * hierarchical all_reduce reduces inside each host first, so only sums
 * cross:
 *
 *   1. reduce-scatter inside each host (ring over its L ranks): local rank
 *      l ends with block l of L, reduced over the host;
 *   2. all_reduce of block l between hosts (ring over the H ranks with
 *      local index l, one per host): every local rank carries its own
 *      block, so all of a host's ranks (and links, and cores) work at once;
 *   3. all-gather inside each host.
 *
 * A host's link then carries 2(H-1)/H of the vector each way: at 2 x 2,
 * 1 instead of 1.5 vectors, which is why its bus bandwidth (counted over n
 * ranks) exceeds one link's.  It needs the same number of ranks on every
 * host (the ranks with one local index form the second phase's ring);
 * otherwise it runs the flat ring.  Any placement of ranks on hosts works
 * (the rings follow the host map, not rank order).
 *
 * The hierarchical reduce-scatter is the first two phases over the blocks
 * regrouped by local index.
 *
 * Steps: a phase over n' positions takes CHORUS__RING_STEPS(n') numbers;
 * phases are spaced by CHORUS__RING_STEPS(size), local and cross pairs
 * never coincide, and every phase has its own range anyway.
 */
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "reduce/reduce.h"

int chorus__topo_build(chorus__topo_t *t, const uint64_t *host, int n, int me) {
  memset(t, 0, sizeof *t);
  int *hidx = malloc(sizeof(int) * (size_t)n), *lidx = malloc(sizeof(int) * (size_t)n);
  int *count = calloc((size_t)n, sizeof(int)), *first = malloc(sizeof(int) * (size_t)n);
  if (!hidx || !lidx || !count || !first) goto oom;
  /* Host numbers by first appearance (n is a group size: quadratic in the
   * number of hosts at worst, once per communicator). */
  for (int r = 0; r < n; r++) {
    int h = 0;
    while (h < t->nhosts && host[first[h]] != host[r]) h++;
    if (h == t->nhosts) first[t->nhosts++] = r;
    hidx[r] = h;
    lidx[r] = count[h]++;
  }
  t->host = hidx[me];
  t->lidx = lidx[me];
  t->nlocal = count[t->host];
  t->ppn = count[0];
  for (int h = 1; h < t->nhosts; h++)
    if (count[h] != t->ppn) t->ppn = 0;
  /* Numbered by first appearance, hosts are blocks of consecutive ranks
   * exactly when the numbers never go down. */
  t->blocked = 1;
  for (int r = 1; r < n; r++)
    if (hidx[r] < hidx[r - 1]) t->blocked = 0;
  t->local = malloc(sizeof(int) * (size_t)t->nlocal);
  t->cross = malloc(sizeof(int) * (size_t)t->nhosts);
  t->map = t->ppn ? malloc(sizeof(int) * (size_t)n) : NULL;
  if (!t->local || !t->cross || (t->ppn && !t->map)) goto oom;
  for (int h = 0; h < t->nhosts; h++) t->cross[h] = -1;
  for (int r = 0; r < n; r++) {
    if (hidx[r] == t->host) t->local[lidx[r]] = r;
    if (lidx[r] == t->lidx) t->cross[hidx[r]] = r;
    if (t->map) t->map[hidx[r] * t->ppn + lidx[r]] = r;
  }
  free(hidx);
  free(lidx);
  free(count);
  free(first);
  return 0;
oom:
  free(hidx);
  free(lidx);
  free(count);
  free(first);
  chorus__topo_free(t);
  return -1;
}

void chorus__topo_free(chorus__topo_t *t) {
  free(t->local);
  free(t->cross);
  free(t->map);
  t->local = t->cross = t->map = NULL;
}

/* Whether the hierarchical schedule applies to c's group. */
static int hier_applies(const chorus__coll_t *c) {
  const chorus__topo_t *t = c->topo;
  return t && t->ppn > 0 && t->nhosts > 1 && t->ppn > 1;
}

chorus_result_t chorus__allreduce_hier(chorus__coll_t *c) {
  if (!hier_applies(c)) return chorus__allreduce_ring(c);
  const chorus__topo_t *t = c->topo;
  chorus__ring_t local = {t->local, t->nlocal, t->lidx};
  chorus__ring_t cross = {t->cross, t->nhosts, t->host};
  uint32_t k = CHORUS__RING_STEPS(c->size);
  size_t es = c->esize;
  char *buf = c->recvbuf;
  chorus_result_t st = chorus__ring_pass(c, &local, buf, c->sendbuf, c->count, 1, 0);
  size_t cnt = chorus__blk_count(c->count, t->nlocal, t->lidx);
  char *mine = buf + chorus__blk_offset(c->count, t->nlocal, t->lidx) * es;
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &cross, mine, mine, cnt, 1, k);
  if (st == CHORUS_OK && c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(mine + chorus__blk_offset(cnt, t->nhosts, t->host) * es,
                                chorus__blk_count(cnt, t->nhosts, t->host), c->dtype, c->size);
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &cross, mine, NULL, cnt, 0, 2 * k);
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &local, buf, NULL, c->count, 0, 3 * k);
  return st;
}

/* Reduce-scatter: rank r's block (count elements) is reduced over every
 * rank.  The input's blocks are regrouped in scratch so that group l holds
 * the blocks of the ranks with local index l, in host order; the host's
 * reduce-scatter leaves group lidx reduced over the host on this rank, and
 * the cross ring's reduce-scatter over that group's H blocks leaves block
 * `host` of it -- this rank's own -- reduced over all hosts.  The regrouping
 * is one copy of the input; a host's link carries (H-1)/H of the input
 * instead of the flat ring's (n-1)/n. */
chorus_result_t chorus__reduce_scatter_hier(chorus__coll_t *c) {
  if (!hier_applies(c)) return chorus__reduce_scatter_ring(c);
  const chorus__topo_t *t = c->topo;
  int H = t->nhosts, L = t->ppn;
  size_t blk = c->count * c->esize;
  char *in = chorus__scratch(c, blk * (size_t)c->size);
  if (!in) return CHORUS_ERR_NO_MEMORY;
  if (blk)
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++)
        memcpy(in + ((size_t)l * (size_t)H + (size_t)h) * blk,
               (const char *)c->sendbuf + (size_t)t->map[h * L + l] * blk, blk);
  chorus__ring_t local = {t->local, t->nlocal, t->lidx};
  chorus__ring_t cross = {t->cross, t->nhosts, t->host};
  size_t group = c->count * (size_t)H;
  chorus_result_t st =
      chorus__ring_pass(c, &local, in, in, group * (size_t)L, 1, 0);
  char *mine = in + (size_t)t->lidx * (size_t)H * blk;
  if (st == CHORUS_OK)
    st = chorus__ring_pass(c, &cross, mine, mine, group, 1, CHORUS__RING_STEPS(c->size));
  if (st == CHORUS_OK) {
    if (blk) memcpy(c->recvbuf, mine + (size_t)t->host * blk, blk);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(c->recvbuf, c->count, c->dtype, c->size);
  }
  chorus__scratch_free(c, in);
  return st;
}
