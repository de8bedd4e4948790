/*
 * pattern.h - the peer math of every algorithm: who talks to whom at which
 * step, and which block moves.  Pure functions of (rank, step, size) with no
 * I/O and no state, so that tests/unit/test_patterns.c can simulate each
 * schedule for every group size from 1 to 64 and check that it delivers
 * what the algorithm relies on.  The algorithms (tree.c, ring.c,
 * exchange.c) only add buffers and messages on top.
 *
 * Conventions: n >= 1 is the group size and ranks are 0..n-1.  Functions
 * that name a round or step document its range; outside it the result is
 * meaningless (the callers never go there).  Nothing here can fail.
 *
 * Families:
 *  - binomial tree (chorus__tree_*): broadcast, reduce, scatter, gather;
 *  - ring (chorus__ring_*): ring reduce-scatter / all-gather block schedule;
 *  - recursive doubling with non-power-of-two folding (chorus__rd_*);
 *  - Bruck all-gather (chorus__bruck_*);
 *  - pairwise exchange (chorus__pairwise_*): all-to-all, reduce-scatter;
 *  - dissemination barrier (chorus__dissem_*).
 */
#ifndef CHORUS_ALGO_PATTERN_H
#define CHORUS_ALGO_PATTERN_H

/* a mod n in [0, n) for any sign of a (n >= 1). */
static inline int chorus__mod(int a, int n) { return ((a % n) + n) % n; }

/* Smallest k with 2^k >= n (0 for n = 1). */
static inline int chorus__ceil_log2(int n) {
  int k = 0;
  while ((1 << k) < n) k++;
  return k;
}

/* ----------------------------------------------------------- binomial tree
 *
 * Trees work on ranks relative to the root, v = (rank - root) mod n, so the
 * root is v = 0.  Node v's parent is v minus its lowest set bit; its
 * children are v + m for every power of two m below that bit (below the
 * smallest power of two >= n for the root) with v + m < n.  Because m grows
 * and v + m < n stops holding once it fails, the children are exactly
 * v + 2^i for i = 0 .. nchildren-1.  Node v's subtree is the contiguous
 * range of relative ranks [v, v + subtree(v)), subtree(v) =
 * min(bit(v), n - v), and child v + 2^i has bit 2^i, so a node's subtree is
 * itself followed by its children's subtrees in ascending order.  The depth
 * of v is popcount(v) <= ceil(log2 n).
 */

/* Relative rank of rank in the tree rooted at root. */
static inline int chorus__tree_rel(int rank, int root, int n) { return (rank - root + n) % n; }

/* Real rank of relative rank v in the tree rooted at root. */
static inline int chorus__tree_real(int v, int root, int n) { return (v + root) % n; }

/* Lowest set bit of v, or the smallest power of two >= n for the root. */
static inline int chorus__tree_bit(int v, int n) {
  if (v) return v & -v;
  return 1 << chorus__ceil_log2(n);
}

/* Number of relative ranks in v's subtree (v itself included). */
static inline int chorus__tree_subtree(int v, int n) {
  if (!v) return n;
  int bit = v & -v;
  return bit < n - v ? bit : n - v;
}

/* Relative rank of v's parent, or -1 for the root. */
static inline int chorus__tree_parent(int v) { return v ? v - (v & -v) : -1; }

/* Number of children of v. */
static inline int chorus__tree_nchildren(int v, int n) {
  int bit = chorus__tree_bit(v, n), k = 0;
  while ((1 << k) < bit && v + (1 << k) < n) k++;
  return k;
}

/* Relative rank of v's child i (0 <= i < nchildren): v + 2^i.  Its subtree
 * starts 2^i slots after v's. */
static inline int chorus__tree_child(int v, int i) { return v + (1 << i); }

/* ------------------------------------------------------------------- ring
 *
 * The vector is cut into n blocks.  Reduce-scatter, steps s = 0..n-2: rank
 * r sends block (r-s-1) mod n to its right neighbour and receives block
 * (r-s-2) mod n from its left one, combining it into its copy; after n-1
 * steps rank r holds block r reduced over all ranks.  All-gather, steps
 * s = 0..n-2: rank r forwards block (r-s) mod n and receives block
 * (r-s-1) mod n, so starting from "rank r owns block r" everyone ends with
 * every block.  In both, what r sends at step s is what r+1 receives.
 */

static inline int chorus__ring_right(int r, int n) { return chorus__mod(r + 1, n); }
static inline int chorus__ring_left(int r, int n) { return chorus__mod(r - 1, n); }

/* Reduce-scatter step s: the block r sends / receives and combines. */
static inline int chorus__ring_rs_send_block(int r, int s, int n) { return chorus__mod(r - s - 1, n); }
static inline int chorus__ring_rs_recv_block(int r, int s, int n) { return chorus__mod(r - s - 2, n); }

/* All-gather step s: the block r forwards / receives. */
static inline int chorus__ring_ag_send_block(int r, int s, int n) { return chorus__mod(r - s, n); }
static inline int chorus__ring_ag_recv_block(int r, int s, int n) { return chorus__mod(r - s - 1, n); }

/* ------------------------------------------------------ recursive doubling
 *
 * p is the largest power of two <= n and rem = n - p.  Fold: of the first
 * 2*rem ranks, each even rank r sends its vector to r+1 and drops out
 * ("folded out"); the odd ones combine and continue.  The p remaining ranks
 * get new ranks 0..p-1 (odd r < 2*rem -> r/2, r >= 2*rem -> r - rem) and
 * run log2(p) rounds: in round k new rank q exchanges with q ^ 2^k.
 * Hand-back: each odd r < 2*rem sends the result to r-1.
 */

/* Largest power of two <= n. */
static inline int chorus__rd_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

/* Ranks beyond the power of two: n - pow2(n). */
static inline int chorus__rd_rem(int n) { return n - chorus__rd_pow2(n); }

/* Number of doubling rounds: log2(pow2(n)). */
static inline int chorus__rd_rounds(int n) { return chorus__ceil_log2(chorus__rd_pow2(n)); }

/* Whether r takes part in the fold and hand-back (r < 2*rem). */
static inline int chorus__rd_in_fold(int r, int n) { return r < 2 * chorus__rd_rem(n); }

/* Whether r gives its vector away in the fold and waits for the result. */
static inline int chorus__rd_folded_out(int r, int n) {
  return chorus__rd_in_fold(r, n) && r % 2 == 0;
}

/* r's peer in the fold and hand-back (r ^ 1), or -1 if r is not in it. */
static inline int chorus__rd_fold_peer(int r, int n) {
  return chorus__rd_in_fold(r, n) ? r ^ 1 : -1;
}

/* r's rank among the p ranks that double, or -1 if r is folded out. */
static inline int chorus__rd_newrank(int r, int n) {
  int rem = chorus__rd_rem(n);
  if (r < 2 * rem) return r % 2 ? r / 2 : -1;
  return r - rem;
}

/* Real rank of new rank q (0 <= q < pow2(n)). */
static inline int chorus__rd_real(int q, int n) {
  int rem = chorus__rd_rem(n);
  return q < rem ? q * 2 + 1 : q + rem;
}

/* Real rank of r's partner in doubling round k (0 <= k < rounds), or -1 if
 * r is folded out. */
static inline int chorus__rd_partner(int r, int k, int n) {
  int q = chorus__rd_newrank(r, n);
  return q < 0 ? -1 : chorus__rd_real(q ^ (1 << k), n);
}

/* ----------------------------------------------------------- Rabenseifner
 *
 * After the recursive-doubling fold, the p = pow2(n) remaining ranks (new
 * ranks q) cut the vector into p blocks.  Reduce-scatter by recursive
 * halving: round k (0..log2 p - 1) pairs q with q ^ (p >> (k+1)); each keeps
 * the half of its current window of blocks on its own side and sends the
 * other half.  Windows: before round k, q's window is the aligned group of
 * p >> k blocks containing block q; after the last round it is block q
 * alone.  All-gather by recursive doubling retraces the rounds backwards,
 * each rank sending its window and receiving its partner's.
 */

/* Distance of halving round k among p ranks. */
static inline int chorus__rab_dist(int k, int p) { return p >> (k + 1); }

/* First block of q's window of size w (a power of two). */
static inline int chorus__rab_window_lo(int q, int w) { return q & ~(w - 1); }

/* ------------------------------------------------------------------ Bruck
 *
 * Rank r keeps a buffer of n slots, slot i holding block (r+i) mod n; it
 * starts with its own block in slot 0.  Round k (k = 0..ceil(log2 n)-1,
 * distance d = 2^k): r sends its first nblocks = min(d, n-d) slots to r-d
 * and receives as many from r+d into slots d.. (r+d's slot j is block
 * r+d+j = r's slot d+j).  After the last round all n slots are filled; a
 * final rotation puts the blocks in rank order.
 */

static inline int chorus__bruck_rounds(int n) { return chorus__ceil_log2(n); }
static inline int chorus__bruck_dist(int k) { return 1 << k; }
static inline int chorus__bruck_send_to(int r, int k, int n) { return chorus__mod(r - (1 << k), n); }
static inline int chorus__bruck_recv_from(int r, int k, int n) { return chorus__mod(r + (1 << k), n); }

/* Number of blocks (slots) sent and received in round k. */
static inline int chorus__bruck_nblocks(int k, int n) {
  int d = 1 << k;
  return d < n - d ? d : n - d;
}

/* --------------------------------------------------------------- pairwise
 *
 * Steps s = 1..n-1: rank r sends to r+s and receives from r-s, so every
 * ordered pair meets exactly once and no rank receives from two senders in
 * one step.
 */

static inline int chorus__pairwise_to(int r, int s, int n) { return chorus__mod(r + s, n); }
static inline int chorus__pairwise_from(int r, int s, int n) { return chorus__mod(r - s, n); }

/* ---------------------------------------------------------- dissemination
 *
 * Hensgen, Finkel and Manber: in round k (k = 0..ceil(log2 n)-1) rank r
 * signals r + 2^k and waits for r - 2^k; after the last round every rank
 * has transitively heard from every other.
 */

static inline int chorus__dissem_rounds(int n) { return chorus__ceil_log2(n); }
static inline int chorus__dissem_to(int r, int k, int n) { return chorus__mod(r + (1 << k), n); }
static inline int chorus__dissem_from(int r, int k, int n) { return chorus__mod(r - (1 << k), n); }

#endif
