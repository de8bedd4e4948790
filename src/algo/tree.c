/*
 * tree.c - rooted collectives: broadcast, reduce, scatter, gather.
 *
 * Binomial trees work on ranks relative to the root, v = (rank - root) mod n
 * (the peer math is in pattern.h, chorus__tree_*).  Node v's parent is v
 * minus its lowest set bit; its children are v + 2^i for every power of two
 * below that bit (below the smallest power of two >= n for the root) with
 * v + 2^i < n.  Node v's subtree is the contiguous range of relative ranks
 * [v, v + min(lowbit(v), n - v)), and child v + 2^i's subtree starts 2^i
 * slots after v's, which is what lets scatter and gather move whole subtrees
 * as one message.  Each (parent, child) pair exchanges exactly one message,
 * so every message uses step 0 (gather and reduce flow up, broadcast and
 * scatter down).  Downward, a node serves its biggest subtree first;
 * upward, it collects its smallest first.
 *
 * The linear variants (root talks to everyone) exist for testing and small
 * groups.
 */
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "algo/pattern.h"
#include "reduce/reduce.h"

static chorus_result_t bcast_binomial(chorus__coll_t *c, void *buf, size_t bytes, int root) {
  int n = c->size, v = chorus__tree_rel(c->rank, root, n);
  chorus_result_t st;
  if (v) {
    st = chorus__recv(c, chorus__tree_real(chorus__tree_parent(v), root, n), buf, bytes, 0);
    if (st != CHORUS_OK) return st;
  }
  /* Biggest subtree first: it has the longest way to go. */
  for (int i = chorus__tree_nchildren(v, n) - 1; i >= 0; i--) {
    st = chorus__send(c, chorus__tree_real(chorus__tree_child(v, i), root, n), buf, bytes, 0);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__bcast_binomial(chorus__coll_t *c) {
  return bcast_binomial(c, c->recvbuf, c->count * c->esize, c->root);
}

chorus_result_t chorus__bcast_linear(chorus__coll_t *c) {
  size_t bytes = c->count * c->esize;
  if (c->rank != c->root) return chorus__recv(c, c->root, c->recvbuf, bytes, 0);
  for (int r = 0; r < c->size; r++) {
    if (r == c->root) continue;
    chorus_result_t st = chorus__send(c, r, c->recvbuf, bytes, 0);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

/* Binomial reduce of count elements of send into recv on root (recv is only
 * written on root; elsewhere scratch is used). */
static chorus_result_t reduce_binomial(chorus__coll_t *c, const void *send, void *recv,
                                       int root) {
  int n = c->size, v = chorus__tree_rel(c->rank, root, n);
  size_t bytes = c->count * c->esize;
  chorus_result_t st = CHORUS_OK;
  char *acc = c->rank == root && recv ? recv : chorus__scratch(c, bytes);
  char *tmp = chorus__scratch(c, bytes);
  if (!acc || !tmp) {
    st = CHORUS_ERR_NO_MEMORY;
    goto out;
  }
  if (acc != send && bytes) memcpy(acc, send, bytes);
  /* Combine the children's partial results (smallest subtree first, it is
   * ready first), then pass ours up. */
  int nch = chorus__tree_nchildren(v, n);
  for (int i = 0; i < nch && st == CHORUS_OK; i++) {
    st = chorus__recv(c, chorus__tree_real(chorus__tree_child(v, i), root, n), tmp, bytes, 0);
    if (st == CHORUS_OK) chorus__combine(c, acc, acc, tmp, c->count);
  }
  if (st == CHORUS_OK && v)
    st = chorus__send(c, chorus__tree_real(chorus__tree_parent(v), root, n), acc, bytes, 0);
  if (st == CHORUS_OK && c->rank == root && c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(acc, c->count, c->dtype, n);
out:
  if (acc != recv) chorus__scratch_free(c, acc);
  chorus__scratch_free(c, tmp);
  return st;
}

chorus_result_t chorus__reduce_binomial(chorus__coll_t *c) {
  return reduce_binomial(c, c->sendbuf, c->recvbuf, c->root);
}

chorus_result_t chorus__reduce_linear(chorus__coll_t *c) {
  size_t bytes = c->count * c->esize;
  if (c->rank != c->root) return chorus__send(c, c->root, c->sendbuf, bytes, 0);
  char *tmp = chorus__scratch(c, bytes);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  if (c->recvbuf != c->sendbuf && bytes) memcpy(c->recvbuf, c->sendbuf, bytes);
  chorus_result_t st = CHORUS_OK;
  for (int r = 0; r < c->size && st == CHORUS_OK; r++) {
    if (r == c->root) continue;
    st = chorus__recv(c, r, tmp, bytes, 0);
    if (st == CHORUS_OK) chorus__combine(c, c->recvbuf, c->recvbuf, tmp, c->count);
  }
  if (st == CHORUS_OK && c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(c->recvbuf, c->count, c->dtype, c->size);
  chorus__scratch_free(c, tmp);
  return st;
}

chorus_result_t chorus__allreduce_reduce_bcast(chorus__coll_t *c) {
  chorus_result_t st = reduce_binomial(c, c->sendbuf, c->recvbuf, 0);
  if (st != CHORUS_OK) return st;
  return bcast_binomial(c, c->recvbuf, c->count * c->esize, 0);
}

/* --------------------------------------------------------------- scatter */

chorus_result_t chorus__scatter_binomial(chorus__coll_t *c) {
  int n = c->size, root = c->root, v = chorus__tree_rel(c->rank, root, n);
  size_t blk = c->count * c->esize;
  int sub = chorus__tree_subtree(v, n);
  chorus_result_t st = CHORUS_OK;
  char *buf = NULL, *own = NULL;
  if (v == 0) {
    if (root == 0) {
      buf = (char *)c->sendbuf; /* relative order is absolute order */
    } else {
      /* Rotate so that relative rank w's block sits at w. */
      own = chorus__scratch(c, blk * (size_t)n);
      if (!own) return CHORUS_ERR_NO_MEMORY;
      for (int w = 0; w < n; w++)
        if (blk)
          memcpy(own + blk * (size_t)w,
                 (const char *)c->sendbuf + blk * (size_t)chorus__tree_real(w, root, n), blk);
      buf = own;
    }
  } else if (sub == 1) {
    buf = c->recvbuf; /* a leaf receives its block directly */
  } else {
    own = chorus__scratch(c, blk * (size_t)sub);
    if (!own) return CHORUS_ERR_NO_MEMORY;
    buf = own;
  }
  /* buf holds the blocks of v's subtree in relative order: v's own block
   * first, then child i's subtree at slot 2^i. */
  if (v) {
    st = chorus__recv(c, chorus__tree_real(chorus__tree_parent(v), root, n), buf,
                      blk * (size_t)sub, 0);
    if (st != CHORUS_OK) goto out;
  }
  for (int i = chorus__tree_nchildren(v, n) - 1; i >= 0; i--) {
    int child = chorus__tree_child(v, i);
    st = chorus__send(c, chorus__tree_real(child, root, n), buf + blk * (size_t)(child - v),
                      blk * (size_t)chorus__tree_subtree(child, n), 0);
    if (st != CHORUS_OK) goto out;
  }
  if (buf != c->recvbuf && blk) memmove(c->recvbuf, buf, blk);
out:
  chorus__scratch_free(c, own);
  return st;
}

chorus_result_t chorus__scatter_linear(chorus__coll_t *c) {
  size_t blk = c->count * c->esize;
  if (c->rank != c->root) return chorus__recv(c, c->root, c->recvbuf, blk, 0);
  for (int r = 0; r < c->size; r++) {
    const char *src = (const char *)c->sendbuf + blk * (size_t)r;
    if (r == c->root) {
      if (c->recvbuf != src && blk) memmove(c->recvbuf, src, blk);
      continue;
    }
    chorus_result_t st = chorus__send(c, r, src, blk, 0);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}

/* ---------------------------------------------------------------- gather */

chorus_result_t chorus__gather_binomial(chorus__coll_t *c) {
  int n = c->size, root = c->root, v = chorus__tree_rel(c->rank, root, n);
  size_t blk = c->count * c->esize;
  int sub = chorus__tree_subtree(v, n);
  chorus_result_t st = CHORUS_OK;
  char *buf, *own = NULL;
  if (v == 0 && root == 0) {
    buf = c->recvbuf;
  } else if (sub == 1) {
    buf = (char *)c->sendbuf; /* a leaf sends its block as it is */
  } else {
    own = chorus__scratch(c, blk * (size_t)sub);
    if (!own) return CHORUS_ERR_NO_MEMORY;
    buf = own;
  }
  if (buf != c->sendbuf && blk) memmove(buf, c->sendbuf, blk);
  /* Assemble v's subtree in relative order (child i's subtree at slot 2^i),
   * then send it up whole. */
  int nch = chorus__tree_nchildren(v, n);
  for (int i = 0; i < nch; i++) {
    int child = chorus__tree_child(v, i);
    st = chorus__recv(c, chorus__tree_real(child, root, n), buf + blk * (size_t)(child - v),
                      blk * (size_t)chorus__tree_subtree(child, n), 0);
    if (st != CHORUS_OK) goto out;
  }
  if (v) {
    st = chorus__send(c, chorus__tree_real(chorus__tree_parent(v), root, n), buf,
                      blk * (size_t)sub, 0);
  } else if (root != 0) {
    for (int w = 0; w < n; w++)
      if (blk)
        memcpy((char *)c->recvbuf + blk * (size_t)chorus__tree_real(w, root, n),
               buf + blk * (size_t)w, blk);
  }
out:
  chorus__scratch_free(c, own);
  return st;
}

chorus_result_t chorus__gather_linear(chorus__coll_t *c) {
  size_t blk = c->count * c->esize;
  if (c->rank != c->root) return chorus__send(c, c->root, c->sendbuf, blk, 0);
  for (int r = 0; r < c->size; r++) {
    char *dst = (char *)c->recvbuf + blk * (size_t)r;
    if (r == c->root) {
      if (dst != c->sendbuf && blk) memmove(dst, c->sendbuf, blk);
      continue;
    }
    chorus_result_t st = chorus__recv(c, r, dst, blk, 0);
    if (st != CHORUS_OK) return st;
  }
  return CHORUS_OK;
}
