/*
 * ring.c - all-reduce, all-gather and reduce-scatter.
 *
 * Ring (Patarasuk and Yuan's bandwidth-optimal schedule): the vector is cut
 * into n blocks (chorus__blk_*).  Reduce-scatter: at step s (0..n-2) rank r
 * sends block (r-s-1) mod n to its right neighbour and receives block
 * (r-s-2) mod n from its left one, combining it into its copy; after n-1
 * steps rank r holds block r reduced over all ranks.  All-gather: at step s
 * rank r forwards block (r-s) mod n and receives block (r-s-1) mod n.  Each
 * rank sends 2(n-1)/n of the vector in total.
 *
 * Recursive doubling: log2(p) rounds of full-vector exchanges with partner
 * rank ^ 2^k, where p is the largest power of two <= n.  The first 2*(n-p)
 * ranks first fold pairwise (even into odd) and the folded-out ranks get the
 * result at the end.  Partners always combine as (lower rank) op (higher
 * rank), so every rank ends with bit-identical results.
 *
 * Bruck all-gather: rounds k = 1, 2, 4, ... send the first min(k, n-k) blocks
 * gathered so far to rank r-k and receive as many from rank r+k; a final
 * rotation puts blocks in rank order.  ceil(log2 n) rounds for any n.
 *
 * The peer and block math of all three lives in pattern.h (chorus__ring_*,
 * chorus__rd_*, chorus__bruck_*), where it is unit-tested.
 */
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "algo/pattern.h"
#include "reduce/reduce.h"

/* Ring reduce-scatter over buf (count elements, blocks as chorus__blk_*),
 * in place; steps 0..n-2.  On return block rank of buf is fully reduced. */
static chorus_result_t ring_reduce_scatter(chorus__coll_t *c, char *buf, size_t count) {
  int n = c->size, r = c->rank;
  size_t es = c->esize, maxblk = chorus__blk_count(count, n, 0) * es;
  char *tmp = chorus__scratch(c, maxblk);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  chorus_result_t st = CHORUS_OK;
  for (int s = 0; s < n - 1 && st == CHORUS_OK; s++) {
    int sb = chorus__ring_rs_send_block(r, s, n), rb = chorus__ring_rs_recv_block(r, s, n);
    size_t rcnt = chorus__blk_count(count, n, rb);
    st = chorus__xchg(c, chorus__ring_right(r, n), buf + chorus__blk_offset(count, n, sb) * es,
                      chorus__blk_count(count, n, sb) * es, chorus__ring_left(r, n), tmp,
                      rcnt * es, (uint32_t)s);
    if (st == CHORUS_OK) {
      char *dst = buf + chorus__blk_offset(count, n, rb) * es;
      chorus__combine(c, dst, dst, tmp, rcnt);
    }
  }
  chorus__scratch_free(c, tmp);
  return st;
}

/* Ring all-gather of the blocks of buf where rank r owns block r; steps
 * step0 .. step0+n-2. */
static chorus_result_t ring_all_gather_blocks(chorus__coll_t *c, char *buf, size_t count,
                                              uint32_t step0) {
  int n = c->size, r = c->rank;
  size_t es = c->esize;
  for (int s = 0; s < n - 1; s++) {
    int sb = chorus__ring_ag_send_block(r, s, n), rb = chorus__ring_ag_recv_block(r, s, n);
    chorus_result_t st = chorus__xchg(
        c, chorus__ring_right(r, n), buf + chorus__blk_offset(count, n, sb) * es,
        chorus__blk_count(count, n, sb) * es, chorus__ring_left(r, n),
        buf + chorus__blk_offset(count, n, rb) * es, chorus__blk_count(count, n, rb) * es,
        step0 + (uint32_t)s);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__allreduce_ring(chorus__coll_t *c) {
  size_t bytes = c->count * c->esize;
  char *buf = c->recvbuf;
  if (buf != c->sendbuf && bytes) memcpy(buf, c->sendbuf, bytes);
  chorus_result_t st = ring_reduce_scatter(c, buf, c->count);
  if (st != CHORUS_OK) return st;
  if (c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(buf + chorus__blk_offset(c->count, c->size, c->rank) * c->esize,
                                chorus__blk_count(c->count, c->size, c->rank), c->dtype, c->size);
  return ring_all_gather_blocks(c, buf, c->count, (uint32_t)c->size);
}

chorus_result_t chorus__allreduce_rd(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t bytes = c->count * c->esize;
  char *buf = c->recvbuf;
  if (buf != c->sendbuf && bytes) memcpy(buf, c->sendbuf, bytes);
  char *tmp = chorus__scratch(c, bytes);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  chorus_result_t st = CHORUS_OK;
  uint32_t step = 0;
  /* Fold (step 0): the even rank of each of the first rem pairs hands its
   * vector to the odd one, which combines (lower rank first). */
  int fold = chorus__rd_fold_peer(r, n);
  if (fold >= 0) {
    if (chorus__rd_folded_out(r, n)) {
      st = chorus__send(c, fold, buf, bytes, step);
    } else {
      st = chorus__recv(c, fold, tmp, bytes, step);
      if (st == CHORUS_OK) chorus__combine(c, buf, tmp, buf, c->count);
    }
  }
  step++;
  /* Doubling (steps 1..rounds) among the pow2(n) ranks still in. */
  if (!chorus__rd_folded_out(r, n)) {
    int rounds = chorus__rd_rounds(n);
    for (int k = 0; k < rounds && st == CHORUS_OK; k++, step++) {
      int partner = chorus__rd_partner(r, k, n);
      st = chorus__xchg(c, partner, buf, bytes, partner, tmp, bytes, step);
      if (st != CHORUS_OK) break;
      if (partner < r) chorus__combine(c, buf, tmp, buf, c->count);
      else chorus__combine(c, buf, buf, tmp, c->count);
    }
    if (st == CHORUS_OK && c->op == CHORUS_AVG)
      chorus__reduce_finalize_avg(buf, c->count, c->dtype, n);
  }
  /* Hand the result to the ranks folded out at the start (step 64, above
   * any doubling round). */
  step = 64;
  if (st == CHORUS_OK && fold >= 0) {
    if (!chorus__rd_folded_out(r, n)) st = chorus__send(c, fold, buf, bytes, step);
    else st = chorus__recv(c, fold, buf, bytes, step);
  }
  chorus__scratch_free(c, tmp);
  return st;
}

/* ------------------------------------------------------------ all-gather */

static char *gather_block(chorus__coll_t *c, int r) {
  if (c->recvbufs) return c->recvbufs[r];
  return (char *)c->recvbuf + (size_t)r * c->count * c->esize;
}

chorus_result_t chorus__allgather_ring(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t blk = c->count * c->esize;
  char *mine = gather_block(c, r);
  if (mine != c->sendbuf && blk) memmove(mine, c->sendbuf, blk);
  for (int s = 0; s < n - 1; s++) {
    chorus_result_t st = chorus__xchg(
        c, chorus__ring_right(r, n), gather_block(c, chorus__ring_ag_send_block(r, s, n)), blk,
        chorus__ring_left(r, n), gather_block(c, chorus__ring_ag_recv_block(r, s, n)), blk,
        (uint32_t)s);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__allgather_bruck(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t blk = c->count * c->esize;
  char *tmp = chorus__scratch(c, blk * (size_t)n);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  if (blk) memcpy(tmp, c->sendbuf, blk);
  /* tmp slot i holds block (r + i) mod n; round k appends nblocks slots at
   * slot 2^k. */
  chorus_result_t st = CHORUS_OK;
  int rounds = chorus__bruck_rounds(n);
  for (int k = 0; k < rounds && st == CHORUS_OK; k++) {
    size_t cnt = (size_t)chorus__bruck_nblocks(k, n);
    st = chorus__xchg(c, chorus__bruck_send_to(r, k, n), tmp, blk * cnt,
                      chorus__bruck_recv_from(r, k, n),
                      tmp + blk * (size_t)chorus__bruck_dist(k), blk * cnt, (uint32_t)k);
  }
  if (st == CHORUS_OK)
    for (int i = 0; i < n; i++)
      if (blk) memcpy(gather_block(c, chorus__mod(r + i, n)), tmp + blk * (size_t)i, blk);
  chorus__scratch_free(c, tmp);
  return st;
}

/* -------------------------------------------------------- reduce-scatter */

chorus_result_t chorus__reduce_scatter_ring(chorus__coll_t *c) {
  int n = c->size;
  size_t blk = c->count * c->esize, total = c->count * (size_t)n;
  char *acc = chorus__scratch(c, blk * (size_t)n);
  if (!acc) return CHORUS_ERR_NO_MEMORY;
  if (blk) memcpy(acc, c->sendbuf, blk * (size_t)n);
  /* Equal blocks: chorus__blk_* over count*n elements gives count each. */
  chorus_result_t st = ring_reduce_scatter(c, acc, total);
  if (st == CHORUS_OK) {
    if (blk) memmove(c->recvbuf, acc + blk * (size_t)c->rank, blk);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(c->recvbuf, c->count, c->dtype, n);
  }
  chorus__scratch_free(c, acc);
  return st;
}

chorus_result_t chorus__reduce_scatter_pairwise(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t blk = c->count * c->esize;
  const char *send = c->sendbuf;
  char *tmp = chorus__scratch(c, blk);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  char *acc = c->recvbuf;
  if (acc != send + blk * (size_t)r && blk) memcpy(acc, send + blk * (size_t)r, blk);
  chorus_result_t st = CHORUS_OK;
  for (int s = 1; s < n && st == CHORUS_OK; s++) {
    int to = chorus__pairwise_to(r, s, n), from = chorus__pairwise_from(r, s, n);
    st = chorus__xchg(c, to, send + blk * (size_t)to, blk, from, tmp, blk, (uint32_t)s);
    if (st == CHORUS_OK) chorus__combine(c, acc, acc, tmp, c->count);
  }
  if (st == CHORUS_OK && c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(acc, c->count, c->dtype, n);
  chorus__scratch_free(c, tmp);
  return st;
}
