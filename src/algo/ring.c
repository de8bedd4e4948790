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
#include "util/env.h"
#include "util/util.h"

/* Ring steps can move a block as up to RING_SEGS segments of at least
 * CHORUS_RING_SEGMENT bytes: a segment is combined (reduce-scatter) or
 * forwarded (all-gather) as soon as it arrives, so the next step's first
 * segment is on the wire while this step's later ones still arrive.  Off by
 * default: over loopback on 2 cores every extra message costs a hand-off
 * with the progress thread, and segmenting was slower at 4 ranks (64 MiB:
 * 198 ms against 150) -- see bench/README.md.  The count depends only on the
 * block size and the variable, which every rank shares. */
#define RING_SEGS CHORUS__RING_SEGS

/* With CHORUS_RING_PIECE, a reduce-scatter step combines what it receives
 * that many bytes at a time as they land (chorus__ep_wait_prefix), so the
 * reduction reads them from cache and ends with the transfer instead of
 * after it.  Off by default: on 2 shared cores there is no idle core for
 * the overlap to use, and the wake-up per piece cost more (bench/README.md).
 * Elements per piece for a segment of len elements (len: whole). */
static size_t ring_piece(size_t len, size_t es) {
  long p = chorus__env()->RING_PIECE;
  if (p <= 0 || (size_t)p < es || len * es < 2 * (size_t)p) return len;
  return (size_t)p / es;
}

static int ring_segs(size_t block_bytes) {
  long seg = chorus__env()->RING_SEGMENT;
  if (seg <= 0) return 1;
  size_t k = block_bytes / (size_t)seg;
  return k < 1 ? 1 : k > RING_SEGS ? RING_SEGS : (int)k;
}

/* Segment j of nseg of a block of cnt elements: [*off, *off + *len). */
static void seg_range(size_t cnt, int nseg, int j, size_t *off, size_t *len) {
  *off = chorus__blk_offset(cnt, nseg, j);
  *len = chorus__blk_count(cnt, nseg, j);
}

enum { RING_RS = 1, RING_AG = 2 };

/* Step t of a run: its pass, that pass's step number and the block this
 * rank receives (and, after combining, sends at step t + 1). */
typedef struct {
  int rs;        /* reduce-scatter step (else all-gather) */
  int s;         /* step within its pass */
  int rb;        /* block received */
  uint32_t tag0; /* step number of its first segment */
} ring_step_t;

static ring_step_t ring_step(int mode, int t, int n, int r, int nseg, uint32_t step0) {
  ring_step_t x;
  x.rs = (mode & RING_RS) && t < n - 1;
  x.s = x.rs || !(mode & RING_RS) ? t : t - (n - 1);
  x.rb = x.rs ? chorus__ring_rs_recv_block(r, x.s, n) : chorus__ring_ag_recv_block(r, x.s, n);
  uint32_t base = step0 + (!x.rs && (mode & RING_RS) ? CHORUS__RING_STEPS(n) : 0);
  x.tag0 = base + (uint32_t)(x.s * nseg);
  return x;
}

/* The ring over buf (count elements in ring->n blocks, chorus__blk_*);
 * position i of the ring is group rank ring->ranks[i] (rank i when ranks is
 * NULL), this rank is position ring->me.  mode RING_RS, the reduce-scatter
 * (steps 0..n-2): afterwards block me of buf is reduced over the ring.  Its
 * input is src's blocks (src may be buf); every block of src is read once,
 * as it is first sent or combined, so an out-of-place caller needs no copy
 * of its input first -- buf's blocks other than me are undefined afterwards.
 * RING_AG, the all-gather (src unused): position i starts with block i and
 * ends with all of them.  Both: the all-gather follows the reduce-scatter
 * without a pause (and with avg, block me is divided by n in between).
 * step0 offsets the step numbers; each ring step uses nseg of them, a pass
 * at most CHORUS__RING_STEPS(n), the all-gather of a run of both passes the
 * second CHORUS__RING_STEPS(n).
 *
 * Every receive is posted before the data it waits for can be sent: step
 * t + 1's while step t's arrives (its landing space is free by then: the
 * reduce-scatter alternates two blocks of scratch, the all-gather lands in
 * blocks no send in flight reads).  A message that finds no receive is
 * buffered and copied (transport), which at large sizes costs as much as
 * the reduction. */
static chorus_result_t ring_run(chorus__coll_t *c, const chorus__ring_t *ring, char *buf,
                                const char *src, size_t count, int mode, int avg, uint32_t step0) {
  int n = ring->n, r = ring->me;
  if (n == 1) {
    if ((mode & RING_RS) && src != buf && count) memcpy(buf, src, count * c->esize);
    if ((mode & RING_RS) && avg) chorus__reduce_finalize_avg(buf, count, c->dtype, 1);
    return CHORUS_OK;
  }
  size_t es = c->esize, blk0 = chorus__blk_count(count, n, 0) * es;
  int nseg = ring_segs(blk0);
  char *tmp[2] = {NULL, NULL};
  if (mode & RING_RS) {
    int two = n > 2; /* n - 1 reduce-scatter steps: two alternate from n = 3 */
    tmp[0] = chorus__scratch(c, blk0 * (size_t)(1 + two));
    if (!tmp[0]) return CHORUS_ERR_NO_MEMORY;
    tmp[1] = tmp[0] + (two ? blk0 : 0);
  } else {
    src = buf;
  }
  int T = ((mode & RING_RS) ? n - 1 : 0) + ((mode & RING_AG) ? n - 1 : 0);
  chorus__req_t sreq[2][RING_SEGS], rreq[2][RING_SEGS];
  const char *ssrc[2] = {NULL, NULL}; /* where each slot's sends read ... */
  size_t slen[2] = {0, 0};            /* ... and how much */
  int spending[2] = {0, 0};           /* sends posted in each slot, not yet waited */
  chorus__req_t *ptrs[RING_SEGS];
  chorus_result_t st = CHORUS_OK;
  int right = chorus__ring_right(r, n), left = chorus__ring_left(r, n);
  if (ring->ranks) {
    right = ring->ranks[right];
    left = ring->ranks[left];
  }
#define WAIT_SENDS(k)                                                   \
  do {                                                                  \
    if (spending[k] && st == CHORUS_OK) {                               \
      for (int j_ = 0; j_ < spending[k]; j_++) ptrs[j_] = &sreq[k][j_]; \
      st = chorus__ep_wait(c->ep, ptrs, spending[k], c->timeout_ms);    \
    }                                                                   \
    spending[k] = 0;                                                    \
  } while (0)
  /* Where step x's data lands: scratch (reduce-scatter) or its block. */
#define LAND(x) ((x).rs ? tmp[(x).s & 1] : buf + chorus__blk_offset(count, n, (x).rb) * es)
  /* Posts step t's receives (all its segments). */
#define POST_RECVS(t)                                                                      \
  do {                                                                                     \
    ring_step_t x_ = ring_step(mode, (t), n, r, nseg, step0);                              \
    size_t rc_ = chorus__blk_count(count, n, x_.rb);                                       \
    char *land_ = LAND(x_);                                                                \
    for (int j_ = 0; j_ < nseg && st == CHORUS_OK; j_++) {                                 \
      size_t o_, l_;                                                                       \
      seg_range(rc_, nseg, j_, &o_, &l_);                                                  \
      chorus__coll_req(&rreq[(t)&1][j_], CHORUS__REQ_RECV, left, land_ + o_ * es, l_ * es, \
                       x_.tag0 + (uint32_t)j_);                                            \
      st = chorus__ep_post(c->ep, &rreq[(t)&1][j_]);                                       \
    }                                                                                      \
  } while (0)
  /* Step 0: receives first, then the whole first block, all segments. */
  POST_RECVS(0);
  {
    int sb0 = (mode & RING_RS) ? chorus__ring_rs_send_block(r, 0, n)
                               : chorus__ring_ag_send_block(r, 0, n);
    ring_step_t x0 = ring_step(mode, 0, n, r, nseg, step0);
    size_t sc0 = chorus__blk_count(count, n, sb0);
    const char *sbase = src + chorus__blk_offset(count, n, sb0) * es;
    for (int j = 0; j < nseg && st == CHORUS_OK; j++) {
      size_t off, len;
      seg_range(sc0, nseg, j, &off, &len);
      chorus__coll_req(&sreq[0][j], CHORUS__REQ_SEND, right, (char *)sbase + off * es, len * es,
                       x0.tag0 + (uint32_t)j);
      st = chorus__ep_post(c->ep, &sreq[0][j]);
      spending[0] = j + 1;
    }
    ssrc[0] = sbase;
    slen[0] = sc0 * es;
  }
  for (int t = 0; t < T && st == CHORUS_OK; t++) {
    ring_step_t x = ring_step(mode, t, n, r, nseg, step0);
    size_t rc = chorus__blk_count(count, n, x.rb);
    size_t roff = chorus__blk_offset(count, n, x.rb) * es;
    char *rbase = buf + roff;
    char *land = LAND(x);
    /* Step t + 1's receives now, unless they land where step t's sends
     * still read (2 positions, in place: the all-gather's first block is
     * the one the reduce-scatter sent); then once those are done. */
    int next = t + 1 < T, early = 0;
    ring_step_t y = ring_step(mode, t + 1, n, r, nseg, step0); /* meaningful if next */
    if (next) {
      const char *yland = LAND(y);
      size_t ylen = chorus__blk_count(count, n, y.rb) * es;
      early = 1;
      for (int k = 0; k < 2; k++)
        if (spending[k] && yland < ssrc[k] + slen[k] && ssrc[k] < yland + ylen) early = 0;
      if (early) POST_RECVS(t + 1);
    }
    for (int j = 0; j < nseg && st == CHORUS_OK; j++) {
      size_t off, len;
      seg_range(rc, nseg, j, &off, &len);
      chorus__req_t *rq = &rreq[t & 1][j];
      /* A reduce-scatter segment is combined a piece at a time as it lands
       * (the piece still in cache), the last piece once it is all in. */
      size_t piece = x.rs ? ring_piece(len, es) : len;
      for (size_t o = 0;;) {
        size_t l = CHORUS__MIN(piece, len - o);
        int whole = o + l >= len;
        if (whole) {
          chorus__req_t *one[1] = {rq};
          st = chorus__ep_wait(c->ep, one, 1, c->timeout_ms);
        } else {
          st = chorus__ep_wait_prefix(c->ep, rq, (o + l) * es, c->timeout_ms);
        }
        if (st != CHORUS_OK) break;
        if (whole && next && !early && j == nseg - 1) {
          WAIT_SENDS(0);
          WAIT_SENDS(1);
          POST_RECVS(t + 1);
          if (st != CHORUS_OK) break;
        }
        if (x.rs && l) {
          size_t at = (off + o) * es;
          chorus__combine(c, rbase + at, src + roff + at, land + off * es + o * es, l);
          if (avg && x.s == n - 2) /* block me, complete: the average before it travels */
            chorus__reduce_finalize_avg(rbase + at, l, c->dtype, n);
        }
        o += l;
        if (whole) break;
      }
      if (st != CHORUS_OK) break;
      if (next) {
        /* The block received now is the one sent at the next step; its
         * slot's sends (step t - 1) must be done before it is reused. */
        int k = (t + 1) & 1;
        if (j == 0) WAIT_SENDS(k);
        if (st != CHORUS_OK) break;
        chorus__coll_req(&sreq[k][j], CHORUS__REQ_SEND, right, rbase + off * es, len * es,
                         y.tag0 + (uint32_t)j);
        st = chorus__ep_post(c->ep, &sreq[k][j]);
        ssrc[k] = rbase;
        slen[k] = rc * es;
        spending[k] = j + 1;
      }
    }
  }
  WAIT_SENDS(0);
  WAIT_SENDS(1);
#undef WAIT_SENDS
#undef POST_RECVS
#undef LAND
  chorus__scratch_free(c, tmp[0]);
  return st;
}

chorus_result_t chorus__ring_pass(chorus__coll_t *c, const chorus__ring_t *ring, char *buf,
                                  const char *src, size_t count, int reducing, uint32_t step0) {
  return ring_run(c, ring, buf, src, count, reducing ? RING_RS : RING_AG, 0, step0);
}

chorus_result_t chorus__allreduce_ring(chorus__coll_t *c) {
  chorus__ring_t all = {NULL, c->size, c->rank};
  /* Out of place, the reduce-scatter reads the input where it is. */
  return ring_run(c, &all, c->recvbuf, c->sendbuf, c->count, RING_RS | RING_AG, c->op == CHORUS_AVG,
                  0);
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
      if (partner < r)
        chorus__combine(c, buf, tmp, buf, c->count);
      else
        chorus__combine(c, buf, buf, tmp, c->count);
    }
    if (st == CHORUS_OK && c->op == CHORUS_AVG)
      chorus__reduce_finalize_avg(buf, c->count, c->dtype, n);
  }
  /* Hand the result to the ranks folded out at the start (step 64, above
   * any doubling round). */
  step = 64;
  if (st == CHORUS_OK && fold >= 0) {
    if (!chorus__rd_folded_out(r, n))
      st = chorus__send(c, fold, buf, bytes, step);
    else
      st = chorus__recv(c, fold, buf, bytes, step);
  }
  chorus__scratch_free(c, tmp);
  return st;
}

/* Rabenseifner: fold to a power of two as recursive doubling does, then
 * reduce-scatter by recursive halving and all-gather by recursive doubling
 * (pattern.h), then hand the result back: 2 log2(p) rounds moving 2(p-1)/p
 * of the vector, instead of the ring's 2(n-1) rounds.  Steps: fold 0,
 * halving 1..L, doubling L+1..2L, hand-back 64. */
chorus_result_t chorus__allreduce_rabenseifner(chorus__coll_t *c) {
  int n = c->size, r = c->rank;
  size_t es = c->esize, bytes = c->count * es;
  char *buf = c->recvbuf;
  if (buf != c->sendbuf && bytes) memcpy(buf, c->sendbuf, bytes);
  char *tmp = chorus__scratch(c, bytes);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  chorus_result_t st = CHORUS_OK;
  int fold = chorus__rd_fold_peer(r, n);
  if (fold >= 0) {
    if (chorus__rd_folded_out(r, n)) {
      st = chorus__send(c, fold, buf, bytes, 0);
    } else {
      st = chorus__recv(c, fold, tmp, bytes, 0);
      if (st == CHORUS_OK) chorus__combine(c, buf, tmp, buf, c->count);
    }
  }
  if (!chorus__rd_folded_out(r, n) && st == CHORUS_OK) {
    int p = chorus__rd_pow2(n), L = chorus__rd_rounds(n), q = chorus__rd_newrank(r, n);
#define OFF(b) (chorus__blk_offset(c->count, p, (b)))
    /* Halving: keep the half of the window on my side of the partner. */
    for (int k = 0; k < L && st == CHORUS_OK; k++) {
      int d = chorus__rab_dist(k, p), w = 2 * d, lo = chorus__rab_window_lo(q, w);
      int peer = chorus__rd_real(q ^ d, n);
      int keep = q & d ? lo + d : lo, give = q & d ? lo : lo + d;
      size_t kcnt = OFF(keep + d) - OFF(keep), gcnt = OFF(give + d) - OFF(give);
      st = chorus__xchg(c, peer, buf + OFF(give) * es, gcnt * es, peer, tmp, kcnt * es,
                        (uint32_t)(1 + k));
      if (st != CHORUS_OK) break;
      char *mine = buf + OFF(keep) * es;
      /* Lower rank's data first, so every rank gets the same bits. */
      if (q & d)
        chorus__combine(c, mine, tmp, mine, kcnt);
      else
        chorus__combine(c, mine, mine, tmp, kcnt);
    }
    if (st == CHORUS_OK && c->op == CHORUS_AVG)
      chorus__reduce_finalize_avg(buf + OFF(q) * es, OFF(q + 1) - OFF(q), c->dtype, n);
    /* Doubling: windows grow back from one block to all p. */
    for (int k = L - 1; k >= 0 && st == CHORUS_OK; k--) {
      int d = chorus__rab_dist(k, p);
      int mylo = chorus__rab_window_lo(q, d), theirlo = chorus__rab_window_lo(q ^ d, d);
      int peer = chorus__rd_real(q ^ d, n);
      st = chorus__xchg(c, peer, buf + OFF(mylo) * es, (OFF(mylo + d) - OFF(mylo)) * es, peer,
                        buf + OFF(theirlo) * es, (OFF(theirlo + d) - OFF(theirlo)) * es,
                        (uint32_t)(1 + L + (L - 1 - k)));
    }
#undef OFF
  }
  if (st == CHORUS_OK && fold >= 0) {
    if (!chorus__rd_folded_out(r, n))
      st = chorus__send(c, fold, buf, bytes, 64);
    else
      st = chorus__recv(c, fold, buf, bytes, 64);
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
                      chorus__bruck_recv_from(r, k, n), tmp + blk * (size_t)chorus__bruck_dist(k),
                      blk * cnt, (uint32_t)k);
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
  /* Equal blocks: chorus__blk_* over count*n elements gives count each. */
  chorus__ring_t all = {NULL, n, c->rank};
  chorus_result_t st = chorus__ring_pass(c, &all, acc, c->sendbuf, total, 1, 0);
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
