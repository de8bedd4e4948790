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
#include "algo/pattern.h"
#include "reduce/reduce.h"
#include "util/util.h"

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

/* One ring pass (as chorus__ring_pass, one message per step) run a step at
 * a time, so that passes over different chunks and peers can be in flight
 * together. */
typedef struct {
  chorus__ring_t ring;
  char *buf;         /* count elements in ring.n blocks */
  const char *src;   /* reduce-scatter input (may be buf); buf when gathering */
  size_t count;
  int reducing;
  uint32_t step0;
  char *tmp;         /* reducing: where a block lands before it is combined */
  int rb;            /* the block received at the current step */
  chorus__req_t sreq, rreq;
} pass_t;

static size_t blk_bytes(const chorus__coll_t *c, size_t count, int n, int b, size_t *off) {
  *off = chorus__blk_offset(count, n, b) * c->esize;
  return chorus__blk_count(count, n, b) * c->esize;
}

/* Posts step s (0 .. ring.n - 2) of p: receive block rb from the left,
 * send to the right the block the previous step completed (step 0: the
 * pass's first block, from src). */
static chorus_result_t pass_post(chorus__coll_t *c, pass_t *p, int s, chorus__req_t **reqs,
                                 int *nreq) {
  int n = p->ring.n, me = p->ring.me;
  int sb = p->reducing ? chorus__ring_rs_send_block(me, s, n) : chorus__ring_ag_send_block(me, s, n);
  p->rb = p->reducing ? chorus__ring_rs_recv_block(me, s, n) : chorus__ring_ag_recv_block(me, s, n);
  size_t soff, roff;
  size_t slen = blk_bytes(c, p->count, n, sb, &soff), rlen = blk_bytes(c, p->count, n, p->rb, &roff);
  const char *sbase = s == 0 ? p->src : p->buf;
  int left = p->ring.ranks[chorus__ring_left(me, n)], right = p->ring.ranks[chorus__ring_right(me, n)];
  chorus__coll_req(&p->rreq, CHORUS__REQ_RECV, left, p->reducing ? p->tmp : p->buf + roff, rlen,
                   p->step0 + (uint32_t)s);
  chorus_result_t st = chorus__ep_post(c->ep, &p->rreq);
  if (st != CHORUS_OK) return st;
  reqs[(*nreq)++] = &p->rreq;
  chorus__coll_req(&p->sreq, CHORUS__REQ_SEND, right, (char *)sbase + soff, slen,
                   p->step0 + (uint32_t)s);
  st = chorus__ep_post(c->ep, &p->sreq);
  if (st != CHORUS_OK) return st;
  reqs[(*nreq)++] = &p->sreq;
  return CHORUS_OK;
}

/* After step s's messages completed: a reduce-scatter combines its block. */
static void pass_done(chorus__coll_t *c, pass_t *p) {
  if (!p->reducing) return;
  size_t off, len = blk_bytes(c, p->count, p->ring.n, p->rb, &off);
  chorus__combine(c, p->buf + off, p->src + off, p->tmp, len / c->esize);
}

/* Chunks the hierarchical all_reduce pipelines: a chunk's host phase runs
 * while the previous chunk crosses the hosts and the one before that is
 * gathered, so the hosts' links never wait for the local phases, which on
 * their own cost 10-20 % at 1 Gbit/s.  At least HIER_CHUNK_MIN bytes a
 * chunk, at most HIER_CHUNKS chunks. */
#define HIER_CHUNKS 8
#define HIER_CHUNK_MIN ((size_t)1 << 20)

enum { PH_LOCAL_RS, PH_CROSS_RS, PH_CROSS_AG, PH_LOCAL_AG, PH_DONE };

typedef struct {
  int phase, step; /* current phase and its next step */
  pass_t pass;
  size_t off, count; /* the chunk: elements [off, off + count) */
} chunk_t;

/* Sets ch's pass up for its current phase (nothing for PH_DONE). */
static void chunk_phase(chorus__coll_t *c, chunk_t *ch, int k, char *tmp_local, char *tmp_cross) {
  const chorus__topo_t *t = c->topo;
  pass_t *p = &ch->pass;
  size_t es = c->esize;
  char *buf = (char *)c->recvbuf + ch->off * es;
  size_t mcnt = chorus__blk_count(ch->count, t->nlocal, t->lidx);
  char *mine = buf + chorus__blk_offset(ch->count, t->nlocal, t->lidx) * es;
  /* Step numbers: 4 phases per chunk, at most size - 1 steps each. */
  p->step0 = (uint32_t)(k * 4 + ch->phase) * (uint32_t)c->size;
  p->tmp = NULL;
  switch (ch->phase) {
    case PH_LOCAL_RS:
    case PH_LOCAL_AG:
      p->ring = (chorus__ring_t){t->local, t->nlocal, t->lidx};
      p->buf = buf;
      p->count = ch->count;
      p->reducing = ch->phase == PH_LOCAL_RS;
      p->src = p->reducing ? (const char *)c->sendbuf + ch->off * es : buf;
      p->tmp = tmp_local;
      break;
    case PH_CROSS_RS:
    case PH_CROSS_AG:
      p->ring = (chorus__ring_t){t->cross, t->nhosts, t->host};
      p->buf = mine;
      p->src = mine;
      p->count = mcnt;
      p->reducing = ch->phase == PH_CROSS_RS;
      p->tmp = tmp_cross;
      break;
    default:
      break;
  }
}

chorus_result_t chorus__allreduce_hier(chorus__coll_t *c) {
  if (!hier_applies(c)) return chorus__allreduce_ring(c);
  const chorus__topo_t *t = c->topo;
  size_t es = c->esize, bytes = c->count * es;
  int nch = (int)(bytes / HIER_CHUNK_MIN);
  nch = nch < 1 ? 1 : nch > HIER_CHUNKS ? HIER_CHUNKS : nch;
  /* The largest block a reducing pass receives: chunk 0's (the largest). */
  size_t c0 = chorus__blk_count(c->count, nch, 0);
  size_t lblk = chorus__blk_count(c0, t->nlocal, 0);
  size_t xblk = chorus__blk_count(lblk, t->nhosts, 0);
  char *tmp = chorus__scratch(c, (lblk + xblk) * es);
  if (!tmp) return CHORUS_ERR_NO_MEMORY;
  chunk_t ch[HIER_CHUNKS];
  for (int k = 0; k < nch; k++) {
    ch[k].phase = PH_LOCAL_RS; /* once started */
    ch[k].step = 0;
    ch[k].off = chorus__blk_offset(c->count, nch, k);
    ch[k].count = chorus__blk_count(c->count, nch, k);
  }
  /* Steps of each phase: the rings have nlocal and nhosts positions. */
  int nsteps[4] = {t->nlocal - 1, t->nhosts - 1, t->nhosts - 1, t->nlocal - 1};
  /* Each phase holds at most one chunk (its scratch is one block), so a
   * chunk whose phase is over moves on only when the next phase is free;
   * oldest first, so the oldest always can and the pipeline drains. */
  int busy[PH_DONE] = {0, 0, 0, 0};
  chorus_result_t st = CHORUS_OK;
  int started = 0, finished = 0;
  while (finished < nch && st == CHORUS_OK) {
    for (int k = finished; k < started; k++) {
      chunk_t *x = &ch[k];
      if (x->step < nsteps[x->phase] || (x->phase + 1 < PH_DONE && busy[x->phase + 1])) continue;
      busy[x->phase] = 0;
      x->phase++;
      x->step = 0;
      if (x->phase < PH_DONE) {
        busy[x->phase] = 1;
        chunk_phase(c, x, k, tmp, tmp + lblk * es);
      }
    }
    while (finished < nch && finished < started && ch[finished].phase == PH_DONE) finished++;
    if (started < nch && !busy[PH_LOCAL_RS]) {
      ch[started].phase = PH_LOCAL_RS;
      busy[PH_LOCAL_RS] = 1;
      chunk_phase(c, &ch[started], started, tmp, tmp + lblk * es);
      started++;
    }
    chorus__req_t *reqs[2 * HIER_CHUNKS];
    int nreq = 0;
    for (int k = finished; k < started && st == CHORUS_OK; k++)
      if (ch[k].phase < PH_DONE && ch[k].step < nsteps[ch[k].phase])
        st = pass_post(c, &ch[k].pass, ch[k].step, reqs, &nreq);
    if (st == CHORUS_OK && nreq) st = chorus__ep_wait(c->ep, reqs, nreq, c->timeout_ms);
    for (int k = finished; k < started && st == CHORUS_OK; k++) {
      chunk_t *x = &ch[k];
      if (x->phase >= PH_DONE || x->step >= nsteps[x->phase]) continue;
      pass_done(c, &x->pass);
      /* The cross reduce-scatter leaves this rank's sub-block summed over
       * every rank: AVG divides it there. */
      if (++x->step == nsteps[x->phase] && x->phase == PH_CROSS_RS && c->op == CHORUS_AVG) {
        size_t off, len = blk_bytes(c, x->pass.count, t->nhosts, t->host, &off);
        chorus__reduce_finalize_avg(x->pass.buf + off, len / es, c->dtype, c->size);
      }
    }
  }
  chorus__scratch_free(c, tmp);
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
/* What the unchunked hierarchical algorithms below share: the host map,
 * hosts and ranks per host, the spacing of their phases' steps, the two
 * rings (between hosts among this local index, inside this host), and for
 * a rooted collective the root's host and local index. */
typedef struct {
  const chorus__topo_t *t;
  int H, L;
  uint32_t S;
  chorus__ring_t cross, local;
  int rh, rl;
} plan_t;

static void root_place(const chorus__topo_t *t, int root, int *rh, int *rl);

static void plan_begin(const chorus__coll_t *c, int rooted, plan_t *p) {
  const chorus__topo_t *t = c->topo;
  p->t = t;
  p->rh = p->rl = 0;
  if (rooted) root_place(t, c->root, &p->rh, &p->rl);
  p->H = t->nhosts;
  p->L = t->ppn;
  p->S = CHORUS__RING_STEPS(c->size);
  p->cross = (chorus__ring_t){t->cross, t->nhosts, t->host};
  p->local = (chorus__ring_t){t->local, t->nlocal, t->lidx};
}

chorus_result_t chorus__reduce_scatter_hier(chorus__coll_t *c) {
  if (!hier_applies(c)) return chorus__reduce_scatter_ring(c);
  plan_t g;
  plan_begin(c, 0, &g);
  const chorus__topo_t *t = g.t;
  int H = g.H, L = g.L;
  size_t blk = c->count * c->esize;
  char *in = chorus__scratch(c, blk * (size_t)c->size);
  if (!in) return CHORUS_ERR_NO_MEMORY;
  if (blk)
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++)
        memcpy(in + ((size_t)l * (size_t)H + (size_t)h) * blk,
               (const char *)c->sendbuf + (size_t)t->map[h * L + l] * blk, blk);
  size_t group = c->count * (size_t)H;
  chorus_result_t st = chorus__ring_pass(c, &g.local, in, in, group * (size_t)L, 1, 0);
  char *mine = in + (size_t)t->lidx * (size_t)H * blk;
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &g.cross, mine, mine, group, 1, g.S);
  if (st == CHORUS_OK) {
    if (blk) memcpy(c->recvbuf, mine + (size_t)t->host * blk, blk);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(c->recvbuf, c->count, c->dtype, c->size);
  }
  chorus__scratch_free(c, in);
  return st;
}

/* All-gather: rank r's block (count elements) reaches every rank.  Every
 * host needs each other host's blocks once, so the ranks of local index l
 * first gather the blocks of local index l across the hosts (a ring
 * between hosts, every local rank at once: a host's link carries each
 * remote block once), then each host gathers its L groups of H blocks over
 * its own ring, in scratch ordered by local index then host; the blocks
 * are then copied to their ranks' places (one copy of the output). */
chorus_result_t chorus__allgather_hier(chorus__coll_t *c) {
  if (!hier_applies(c)) return chorus__allgather_ring(c);
  plan_t g;
  plan_begin(c, 0, &g);
  const chorus__topo_t *t = g.t;
  int H = g.H, L = g.L;
  size_t blk = c->count * c->esize;
  char *s = chorus__scratch(c, blk * (size_t)c->size);
  if (!s) return CHORUS_ERR_NO_MEMORY;
  char *group = s + (size_t)t->lidx * (size_t)H * blk;
  if (blk) memcpy(group + (size_t)t->host * blk, c->sendbuf, blk);
  size_t gcount = c->count * (size_t)H;
  chorus_result_t st = chorus__ring_pass(c, &g.cross, group, NULL, gcount, 0, 0);
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &g.local, s, NULL, gcount * (size_t)L, 0, g.S);
  if (st == CHORUS_OK && blk) {
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++) {
        int r = t->map[h * L + l];
        char *dst = c->recvbufs ? c->recvbufs[r] : (char *)c->recvbuf + (size_t)r * blk;
        memcpy(dst, s + ((size_t)l * (size_t)H + (size_t)h) * blk, blk);
      }
  }
  chorus__scratch_free(c, s);
  return st;
}

/* ------------------------------------------ broadcast and reduce
 *
 * A rooted collective crosses the hosts' links like this, with L ranks on
 * each of H hosts and the root on host rh:
 *
 *   broadcast: the root hands block l of L to its local rank l (shared
 *   memory); the ranks of local index l, one per host, pass block l from
 *   host to host in a pipelined chain starting at rh; every host then
 *   all-gathers its L blocks.  A host's link carries the vector once,
 *   split over its L ranks, where the binomial tree sends the whole vector
 *   log2(H) times in a row down its deepest path.
 *
 *   reduce: the mirror image -- reduce-scatter in each host, each local
 *   index's block reduced down a pipelined chain of hosts ending at rh,
 *   and the L blocks gathered to the root.
 *
 * Below L x H elements some blocks would be empty, and between two hosts
 * the tree crosses once anyway: the binomial tree runs instead.  Steps:
 * phases spaced by CHORUS__RING_STEPS(size). */

/* The root's host and local index. */
static void root_place(const chorus__topo_t *t, int root, int *rh, int *rl) {
  *rh = *rl = 0;
  for (int h = 0; h < t->nhosts; h++)
    for (int l = 0; l < t->ppn; l++)
      if (t->map[h * t->ppn + l] == root) {
        *rh = h;
        *rl = l;
      }
}

/* One rank gives sub-block b of n (of count elements at buf) to ranks[b]
 * for every b != me (give = 1), or takes sub-block b from ranks[b] (give =
 * 0); everyone else sends or receives its own sub-block with the root of
 * the exchange, position `at`. */
static chorus_result_t blocks_exchange(chorus__coll_t *c, const int *ranks, int n, int me, int at,
                                       char *buf, size_t count, int give, uint32_t step) {
  size_t es = c->esize;
  if (me != at) {
    size_t off = chorus__blk_offset(count, n, me) * es, len = chorus__blk_count(count, n, me) * es;
    return give ? chorus__recv(c, ranks[at], buf + off, len, step)
                : chorus__send(c, ranks[at], buf + off, len, step);
  }
  chorus__req_t *reqs = calloc((size_t)n, sizeof *reqs);
  chorus__req_t **ptrs = calloc((size_t)n, sizeof *ptrs);
  if (!reqs || !ptrs) {
    free(reqs);
    free(ptrs);
    return CHORUS_ERR_NO_MEMORY;
  }
  int k = 0;
  chorus_result_t st = CHORUS_OK;
  for (int b = 0; b < n && st == CHORUS_OK; b++) {
    if (b == me) continue;
    size_t off = chorus__blk_offset(count, n, b) * es, len = chorus__blk_count(count, n, b) * es;
    chorus__coll_req(&reqs[k], give ? CHORUS__REQ_SEND : CHORUS__REQ_RECV, ranks[b], buf + off,
                     len, step);
    st = chorus__ep_post(c->ep, &reqs[k]);
    if (st == CHORUS_OK) {
      ptrs[k] = &reqs[k];
      k++;
    }
  }
  if (k) {
    chorus_result_t wst = chorus__ep_wait(c->ep, ptrs, k, c->timeout_ms);
    if (st == CHORUS_OK) st = wst;
  }
  free(reqs);
  free(ptrs);
  return st;
}

/* Two hosts: the binomial tree crosses between them once, as this would;
 * the local phases only add work (measured 0.85-1.02x at 2 x 2). */
static int rooted_hier_applies(const chorus__coll_t *c) {
  return hier_applies(c) && c->topo->nhosts >= 3 && c->count >= (size_t)c->size;
}

/* Broadcast of bytes at buf over the ring's positions from position at, as
 * a pipelined chain: cut into segments, each passed from position to
 * position, a position forwarding segment k while it receives k + 1.  Every
 * link carries the data once; the last position has it after
 * bytes/bw + (n - 2) segments' time.  Segments of at least CHAIN_SEG
 * bytes, at most CHORUS__RING_STEPS(size) of them (steps step0 ..). */
#define CHAIN_SEG ((size_t)256 << 10)

static chorus_result_t chain_bcast(chorus__coll_t *c, const chorus__ring_t *ring, int at,
                                   char *buf, size_t bytes, uint32_t step0) {
  int n = ring->n, pos = (ring->me - at + n) % n;
  int prev = ring->ranks[(ring->me + n - 1) % n], next = ring->ranks[(ring->me + 1) % n];
  size_t maxseg = CHORUS__RING_STEPS(c->size);
  size_t seg = CHORUS__MAX(CHAIN_SEG, (bytes + maxseg - 1) / maxseg);
  size_t nseg = bytes ? (bytes + seg - 1) / seg : 1;
  int forward = pos < n - 1;
  chorus__req_t *sreq = forward ? calloc(nseg, sizeof *sreq) : NULL;
  chorus__req_t **ptrs = forward ? calloc(nseg, sizeof *ptrs) : NULL;
  if (forward && (!sreq || !ptrs)) {
    free(sreq);
    free(ptrs);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus_result_t st = CHORUS_OK;
  size_t posted = 0;
  for (size_t k = 0; k < nseg && st == CHORUS_OK; k++) {
    size_t off = k * seg, len = CHORUS__MIN(seg, bytes - off);
    if (pos > 0) st = chorus__recv(c, prev, buf + off, len, step0 + (uint32_t)k);
    if (st != CHORUS_OK || !forward) continue;
    chorus__coll_req(&sreq[k], CHORUS__REQ_SEND, next, buf + off, len, step0 + (uint32_t)k);
    st = chorus__ep_post(c->ep, &sreq[k]);
    if (st == CHORUS_OK) ptrs[posted++] = &sreq[k];
  }
  if (posted) {
    chorus_result_t wst = chorus__ep_wait(c->ep, ptrs, (int)posted, c->timeout_ms);
    if (st == CHORUS_OK) st = wst;
  }
  free(sreq);
  free(ptrs);
  return st;
}

/* The chain run the other way: count elements at buf reduced over the
 * ring's positions into position at's buf.  The last position sends
 * segment k toward `at`; each position on the way receives it, combines it
 * with its own and passes it on, while the next segment comes in.  The
 * buffers of positions other than `at` end undefined. */
static chorus_result_t chain_reduce(chorus__coll_t *c, const chorus__ring_t *ring, int at,
                                    char *buf, size_t count, uint32_t step0) {
  int n = ring->n, pos = (ring->me - at + n) % n;
  int up = ring->ranks[(ring->me + n - 1) % n], down = ring->ranks[(ring->me + 1) % n];
  size_t es = c->esize, maxseg = CHORUS__RING_STEPS(c->size);
  size_t seg = CHORUS__MAX(CHAIN_SEG / es, (count + maxseg - 1) / maxseg);
  size_t nseg = count ? (count + seg - 1) / seg : 1;
  int receive = pos < n - 1, send = pos > 0;
  char *tmp = receive ? chorus__scratch(c, seg * es) : NULL;
  chorus__req_t *sreq = send ? calloc(nseg, sizeof *sreq) : NULL;
  chorus__req_t **ptrs = send ? calloc(nseg, sizeof *ptrs) : NULL;
  chorus_result_t st = CHORUS_OK;
  if ((receive && !tmp) || (send && (!sreq || !ptrs))) st = CHORUS_ERR_NO_MEMORY;
  size_t posted = 0;
  for (size_t k = 0; k < nseg && st == CHORUS_OK; k++) {
    size_t off = k * seg, len = CHORUS__MIN(seg, count - off);
    char *at_k = buf + off * es;
    if (receive) {
      st = chorus__recv(c, down, tmp, len * es, step0 + (uint32_t)k);
      if (st != CHORUS_OK) break;
      chorus__combine(c, at_k, at_k, tmp, len);
    }
    if (!send) continue;
    chorus__coll_req(&sreq[k], CHORUS__REQ_SEND, up, at_k, len * es, step0 + (uint32_t)k);
    st = chorus__ep_post(c->ep, &sreq[k]);
    if (st == CHORUS_OK) ptrs[posted++] = &sreq[k];
  }
  if (posted) {
    chorus_result_t wst = chorus__ep_wait(c->ep, ptrs, (int)posted, c->timeout_ms);
    if (st == CHORUS_OK) st = wst;
  }
  chorus__scratch_free(c, tmp);
  free(sreq);
  free(ptrs);
  return st;
}

chorus_result_t chorus__bcast_hier(chorus__coll_t *c) {
  if (!rooted_hier_applies(c)) return chorus__bcast_binomial(c);
  plan_t r;
  plan_begin(c, 1, &r);
  const chorus__topo_t *t = r.t;
  char *buf = c->recvbuf;
  chorus_result_t st = CHORUS_OK;
  /* 1. The root's host: block l to local rank l. */
  if (t->host == r.rh)
    st = blocks_exchange(c, t->local, t->nlocal, t->lidx, r.rl, buf, c->count, 1, 0);
  /* 2. Block lidx between hosts: a chain from host rh. */
  size_t mcnt = chorus__blk_count(c->count, t->nlocal, t->lidx);
  char *mine = buf + chorus__blk_offset(c->count, t->nlocal, t->lidx) * c->esize;
  if (st == CHORUS_OK) st = chain_bcast(c, &r.cross, r.rh, mine, mcnt * c->esize, r.S);
  /* 3. Every host gathers its L blocks. */
  if (st == CHORUS_OK) st = chorus__ring_pass(c, &r.local, buf, NULL, c->count, 0, 2 * r.S);
  return st;
}

chorus_result_t chorus__reduce_hier(chorus__coll_t *c) {
  if (!rooted_hier_applies(c)) return chorus__reduce_binomial(c);
  plan_t r;
  plan_begin(c, 1, &r);
  const chorus__topo_t *t = r.t;
  int into_recv = c->rank == c->root && c->recvbuf;
  char *buf = into_recv ? c->recvbuf : chorus__scratch(c, c->count * c->esize);
  if (!buf) return CHORUS_ERR_NO_MEMORY;
  /* 1. Block lidx reduced over the host; 2. over every host, down a chain
   * to host rh's rank of this local index; 3. the blocks to the root. */
  chorus_result_t st = chorus__ring_pass(c, &r.local, buf, c->sendbuf, c->count, 1, 0);
  size_t mcnt = chorus__blk_count(c->count, t->nlocal, t->lidx);
  char *mine = buf + chorus__blk_offset(c->count, t->nlocal, t->lidx) * c->esize;
  if (st == CHORUS_OK) st = chain_reduce(c, &r.cross, r.rh, mine, mcnt, r.S);
  if (st == CHORUS_OK && t->host == r.rh)
    st = blocks_exchange(c, t->local, t->nlocal, t->lidx, r.rl, buf, c->count, 0, 2 * r.S + 1);
  if (st == CHORUS_OK && into_recv && c->op == CHORUS_AVG)
    chorus__reduce_finalize_avg(buf, c->count, c->dtype, c->size);
  if (!into_recv) chorus__scratch_free(c, buf);
  return st;
}
