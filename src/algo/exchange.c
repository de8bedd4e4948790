/*
 * exchange.c - all-to-all (equal and variable counts), the barrier, and the
 * variable-size byte gathers behind gather_object / all_gather_object.
 *
 * Pairwise exchange: at step s (1..n-1) rank r sends to r+s and receives
 * from r-s, so every pair meets exactly once and no rank receives from two
 * senders at once.  Dissemination barrier (Hensgen, Finkel and Manber): in
 * round k rank r signals r+2^k and waits for r-2^k; after ceil(log2 n)
 * rounds every rank has transitively heard from every other.  The peer math
 * of both, and of the ring all-gather behind all_gather_bytes, lives in
 * pattern.h (chorus__pairwise_*, chorus__dissem_*, chorus__ring_*).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "algo/pattern.h"

chorus_result_t chorus__alltoall_pairwise(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t blk = c->count * c->esize;
  const char *send = c->sendbuf;
  char *recv = c->recvbuf, *copy = NULL;
  if (send == recv && n > 1) {
    copy = chorus__scratch(c, blk * (size_t)n);
    if (!copy) return CHORUS_ERR_NO_MEMORY;
    if (blk) memcpy(copy, send, blk * (size_t)n);
    send = copy;
  }
  if (recv + blk * (size_t)r != send + blk * (size_t)r && blk)
    memmove(recv + blk * (size_t)r, send + blk * (size_t)r, blk);
  chorus_result_t st = CHORUS_OK;
  for (int s = 1; s < n && st == CHORUS_OK; s++) {
    int to = chorus__pairwise_to(r, s, n), from = chorus__pairwise_from(r, s, n);
    st = chorus__xchg(c, to, send + blk * (size_t)to, blk, from, recv + blk * (size_t)from, blk,
                      (uint32_t)s);
  }
  chorus__scratch_free(c, copy);
  return st;
}

chorus_result_t chorus__alltoallv_pairwise(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t es = c->esize;
  const char *send = c->sendbuf;
  char *recv = c->recvbuf;
  if (c->rcounts[r] != c->scounts[r]) {
    snprintf(c->err, sizeof c->err,
             "all_to_allv: sendcounts[%d]=%zu but recvcounts[%d]=%zu on the same rank", r,
             c->scounts[r], r, c->rcounts[r]);
    return CHORUS_ERR_INVALID_ARG;
  }
  if (c->scounts[r]) memmove(recv + c->rdispls[r] * es, send + c->sdispls[r] * es, c->scounts[r] * es);
  for (int s = 1; s < n; s++) {
    int to = chorus__pairwise_to(r, s, n), from = chorus__pairwise_from(r, s, n);
    chorus_result_t st =
        chorus__xchg(c, to, send + c->sdispls[to] * es, c->scounts[to] * es, from,
                     recv + c->rdispls[from] * es, c->rcounts[from] * es, (uint32_t)s);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__barrier_dissemination(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  int rounds = chorus__dissem_rounds(n);
  for (int k = 0; k < rounds; k++) {
    chorus_result_t st = chorus__xchg(c, chorus__dissem_to(r, k, n), NULL, 0,
                                      chorus__dissem_from(r, k, n), NULL, 0, (uint32_t)k);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

/* gather_bytes: sizes first (step 0), then the data (step 1), linear. */
chorus_result_t chorus__gatherv_linear(chorus__coll_t *c) {
  int n = c->size, r = c->rank, root = c->root;
  uint64_t mylen = c->count;
  if (r != root) {
    chorus_result_t st = chorus__send(c, root, &mylen, sizeof mylen, 0);
    if (st == CHORUS_OK) st = chorus__send(c, root, c->sendbuf, c->count, 1);
    return st;
  }
  uint64_t *lens = chorus__scratch(c, sizeof(uint64_t) * (size_t)n);
  if (!lens) return CHORUS_ERR_NO_MEMORY;
  chorus_result_t st = CHORUS_OK;
  size_t total = 0;
  for (int q = 0; q < n && st == CHORUS_OK; q++) {
    if (q == root) lens[q] = mylen;
    else st = chorus__recv(c, q, &lens[q], sizeof lens[q], 0);
    if (st == CHORUS_OK && __builtin_add_overflow(total, lens[q], &total)) {
      snprintf(c->err, sizeof c->err, "gather_bytes: rank %d announced an impossible length", q);
      st = CHORUS_ERR_PROTOCOL;
    }
  }
  char *out = st == CHORUS_OK ? malloc(total ? total : 1) : NULL; /* handed to the user */
  if (st == CHORUS_OK && !out) {
    snprintf(c->err, sizeof c->err, "out of memory allocating %zu bytes for the result", total);
    st = CHORUS_ERR_NO_MEMORY;
  }
  size_t off = 0;
  for (int q = 0; q < n && st == CHORUS_OK; q++) {
    if (q == root) {
      if (lens[q]) memcpy(out + off, c->sendbuf, lens[q]);
    } else {
      st = chorus__recv(c, q, out + off, lens[q], 1);
    }
    c->lens[q] = lens[q];
    off += lens[q];
  }
  if (st == CHORUS_OK) *c->out = out;
  else free(out);
  chorus__scratch_free(c, lens);
  return st;
}

/* all_gather_bytes: ring all-gather of the sizes (steps 0..n-2), then a ring
 * all-gather of variable blocks (steps n..2n-2). */
chorus_result_t chorus__allgatherv_ring(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  uint64_t *lens = chorus__scratch(c, sizeof(uint64_t) * (size_t)n);
  size_t *offs = chorus__scratch(c, sizeof(size_t) * (size_t)(n + 1));
  char *out = NULL;
  chorus_result_t st = CHORUS_OK;
  if (!lens || !offs) {
    st = CHORUS_ERR_NO_MEMORY;
    goto done;
  }
  lens[r] = c->count;
  for (int s = 0; s < n - 1 && st == CHORUS_OK; s++)
    st = chorus__xchg(c, chorus__ring_right(r, n), &lens[chorus__ring_ag_send_block(r, s, n)],
                      sizeof(uint64_t), chorus__ring_left(r, n),
                      &lens[chorus__ring_ag_recv_block(r, s, n)], sizeof(uint64_t), (uint32_t)s);
  if (st != CHORUS_OK) goto done;
  offs[0] = 0;
  for (int q = 0; q < n; q++) {
    if (__builtin_add_overflow(offs[q], lens[q], &offs[q + 1])) {
      snprintf(c->err, sizeof c->err, "all_gather_bytes: rank %d announced an impossible length", q);
      st = CHORUS_ERR_PROTOCOL;
      goto done;
    }
  }
  out = malloc(offs[n] ? offs[n] : 1); /* handed to the user */
  if (!out) {
    snprintf(c->err, sizeof c->err, "out of memory allocating %zu bytes for the result", offs[n]);
    st = CHORUS_ERR_NO_MEMORY;
    goto done;
  }
  if (c->count) memcpy(out + offs[r], c->sendbuf, c->count);
  for (int s = 0; s < n - 1 && st == CHORUS_OK; s++) {
    int sb = chorus__ring_ag_send_block(r, s, n), rb = chorus__ring_ag_recv_block(r, s, n);
    st = chorus__xchg(c, chorus__ring_right(r, n), out + offs[sb], lens[sb],
                      chorus__ring_left(r, n), out + offs[rb], lens[rb], (uint32_t)(n + s));
  }
  if (st == CHORUS_OK) {
    for (int q = 0; q < n; q++) c->lens[q] = lens[q];
    *c->out = out;
    out = NULL;
  }
done:
  free(out);
  chorus__scratch_free(c, lens);
  chorus__scratch_free(c, offs);
  return st;
}
