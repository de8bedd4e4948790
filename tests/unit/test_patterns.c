/*
 * test_patterns.c - the peer math of src/algo/pattern.h, simulated for every
 * group size n from 1 to 64 (and, for trees, every root).
 *
 * Each schedule is played out on plain arrays the way the algorithm in
 * tree.c / ring.c / exchange.c plays it out on the wire, and the test checks
 * what the algorithm relies on:
 *  - binomial tree: one parent per non-root, parent and child agree,
 *    children's subtrees are disjoint contiguous ranges that with the node
 *    make up its subtree, depth <= ceil(log2 n);
 *  - ring: the reduce-scatter leaves block r on rank r with every rank's
 *    contribution exactly once, the all-gather then gives everyone every
 *    block, and what r sends at step s is what r+1 receives;
 *  - recursive doubling: fold, doubling rounds and hand-back leave every
 *    rank with every contribution exactly once; partners are symmetric;
 *  - Rabenseifner: halving leaves block q on rank q with every contribution
 *    exactly once, doubling then gives every rank every block;
 *  - Bruck: every rank ends with every block, sends and receives match;
 *  - pairwise: every ordered pair meets exactly once;
 *  - dissemination: after ceil(log2 n) rounds everyone has heard from all;
 *  - chorus__blk_count/offset partition [0, count);
 *  - the host map (chorus__topo_build, hier.c) for blocked, interleaved and
 *    uneven placements: hosts, local indices, the local and cross rings.
 * Contributions are tracked as bitsets (n <= 64 fits a uint64_t); "exactly
 * once" means two sets being combined never overlap.
 */
#include <stdint.h>

#include "algo/algo.h"
#include "algo/pattern.h"
#include "harness.h"

#define MAXN 64

static long long checks; /* schedule facts verified */

static uint64_t bit(int r) { return (uint64_t)1 << r; }
static uint64_t all_bits(int n) { return n == 64 ? ~(uint64_t)0 : bit(n) - 1; }

/* Reference ceil(log2 n), independent of pattern.h. */
static int ref_ceil_log2(int n) {
  int k = 0;
  for (long p = 1; p < n; p *= 2) k++;
  return k;
}

/* --------------------------------------------------------------- helpers */

TEST(helpers) {
  for (int n = 1; n <= MAXN; n++) {
    ASSERT_EQ(chorus__ceil_log2(n), ref_ceil_log2(n));
    for (int a = -3 * n; a <= 3 * n; a++) {
      int m = chorus__mod(a, n);
      ASSERT_TRUE(m >= 0 && m < n);
      ASSERT_EQ((a - m) % n, 0);
    }
  }
}

/* ---------------------------------------------------------- binomial tree */

TEST(tree_rank_mapping) {
  for (int n = 1; n <= MAXN; n++)
    for (int root = 0; root < n; root++) {
      ASSERT_EQ(chorus__tree_rel(root, root, n), 0);
      for (int rank = 0; rank < n; rank++) {
        int v = chorus__tree_rel(rank, root, n);
        ASSERT_TRUE(v >= 0 && v < n);
        ASSERT_EQ(chorus__tree_real(v, root, n), rank);
        ASSERT_EQ(chorus__tree_rel(chorus__tree_real(rank, root, n), root, n), rank);
      }
    }
}

/* The shape of the tree depends on n only (roots just relabel it), so the
 * structure is checked on relative ranks, and for every root on real ranks:
 * the real parent/children of each real rank must be consistent too. */
TEST(tree_structure) {
  for (int n = 1; n <= MAXN; n++) {
    int nparents[MAXN] = {0};
    int maxdepth = ref_ceil_log2(n);
    ASSERT_EQ(chorus__tree_parent(0), -1);
    ASSERT_EQ(chorus__tree_subtree(0, n), n);
    ASSERT_TRUE(chorus__tree_bit(0, n) >= n);
    for (int v = 0; v < n; v++) {
      int sub = chorus__tree_subtree(v, n);
      ASSERT_TRUE(sub >= 1 && v + sub <= n);
      /* The subtree is v followed by its children's subtrees, contiguous,
       * in ascending order, each child's starting at slot 2^i. */
      int next = v + 1, nch = chorus__tree_nchildren(v, n);
      for (int i = 0; i < nch; i++) {
        int ch = chorus__tree_child(v, i);
        ASSERT_TRUE(ch > v && ch < n);
        ASSERT_EQ(ch, next);
        ASSERT_EQ(ch - v, 1 << i);
        ASSERT_EQ(chorus__tree_parent(ch), v);
        ASSERT_EQ(chorus__tree_bit(ch, n), 1 << i);
        nparents[ch]++;
        next = ch + chorus__tree_subtree(ch, n);
        checks++;
      }
      ASSERT_EQ(next, v + sub);
      /* A leaf's subtree is itself. */
      if (nch == 0) ASSERT_EQ(sub, 1);
      /* The parent lists v among its children. */
      if (v) {
        int p = chorus__tree_parent(v), found = 0;
        ASSERT_TRUE(p >= 0 && p < v);
        for (int i = 0; i < chorus__tree_nchildren(p, n); i++)
          found += chorus__tree_child(p, i) == v;
        ASSERT_EQ(found, 1);
        /* v's subtree lies inside its parent's. */
        ASSERT_TRUE(v + sub <= p + chorus__tree_subtree(p, n));
      }
      /* Depth: walk up to the root. */
      int depth = 0;
      for (int w = v; w; w = chorus__tree_parent(w)) {
        depth++;
        ASSERT_TRUE(depth <= n);
      }
      ASSERT_TRUE(depth <= maxdepth);
    }
    for (int v = 1; v < n; v++) ASSERT_EQ(nparents[v], 1);
    ASSERT_EQ(nparents[0], 0);

    /* Real ranks, every root: every non-root real rank has exactly one real
     * parent, which lists it as a real child. */
    for (int root = 0; root < n; root++) {
      int seen[MAXN] = {0};
      for (int rank = 0; rank < n; rank++) {
        int v = chorus__tree_rel(rank, root, n);
        for (int i = 0; i < chorus__tree_nchildren(v, n); i++) {
          int child = chorus__tree_real(chorus__tree_child(v, i), root, n);
          ASSERT_TRUE(child != root);
          ASSERT_EQ(chorus__tree_real(chorus__tree_parent(chorus__tree_rel(child, root, n)),
                                      root, n),
                    rank);
          seen[child]++;
        }
      }
      for (int rank = 0; rank < n; rank++) ASSERT_EQ(seen[rank], rank == root ? 0 : 1);
      checks++;
    }
  }
}

/* Broadcast reaches everyone; reduce (leaves up, children combined before a
 * node passes its partial result to its parent) counts every rank once. */
TEST(tree_bcast_reduce_simulation) {
  for (int n = 1; n <= MAXN; n++) {
    uint64_t acc[MAXN];
    int sent[MAXN] = {0};
    int got[MAXN] = {0};
    for (int v = 0; v < n; v++) acc[v] = bit(v);
    /* Reduce: process nodes from the highest relative rank down; a node's
     * children are all higher, so they have finished by then. */
    for (int v = n - 1; v >= 0; v--) {
      for (int i = 0; i < chorus__tree_nchildren(v, n); i++) {
        int ch = chorus__tree_child(v, i);
        ASSERT_TRUE(sent[ch]);
        ASSERT_EQ(acc[v] & acc[ch], 0);
        acc[v] |= acc[ch];
      }
      if (v) sent[v] = 1;
    }
    ASSERT_EQ(acc[0], all_bits(n));
    /* Broadcast: process nodes in ascending order; a parent is lower. */
    got[0] = 1;
    for (int v = 0; v < n; v++) {
      ASSERT_TRUE(got[v]);
      for (int i = chorus__tree_nchildren(v, n) - 1; i >= 0; i--) {
        int ch = chorus__tree_child(v, i);
        ASSERT_EQ(got[ch], 0);
        got[ch] = 1;
      }
    }
    checks += n;
  }
}

/* ------------------------------------------------------------------- ring */

TEST(ring_neighbours) {
  for (int n = 1; n <= MAXN; n++)
    for (int r = 0; r < n; r++) {
      ASSERT_EQ(chorus__ring_left(chorus__ring_right(r, n), n), r);
      ASSERT_EQ(chorus__ring_right(chorus__ring_left(r, n), n), r);
      ASSERT_EQ(chorus__ring_right(r, n), (r + 1) % n);
    }
}

TEST(ring_schedule_simulation) {
  static uint64_t have[MAXN][MAXN]; /* rank -> block -> contributors */
  static uint64_t msg[MAXN];        /* what each rank sends this step */
  static int msgblk[MAXN];
  for (int n = 1; n <= MAXN; n++) {
    for (int r = 0; r < n; r++)
      for (int b = 0; b < n; b++) have[r][b] = bit(r);
    /* Reduce-scatter: all ranks send at once, then all receive. */
    for (int s = 0; s < n - 1; s++) {
      for (int r = 0; r < n; r++) {
        msgblk[r] = chorus__ring_rs_send_block(r, s, n);
        msg[r] = have[r][msgblk[r]];
        /* What r sends is what r+1 receives, from r. */
        int right = chorus__ring_right(r, n);
        ASSERT_EQ(chorus__ring_left(right, n), r);
        ASSERT_EQ(chorus__ring_rs_recv_block(right, s, n), msgblk[r]);
      }
      for (int r = 0; r < n; r++) {
        int left = chorus__ring_left(r, n), b = chorus__ring_rs_recv_block(r, s, n);
        ASSERT_EQ(msgblk[left], b);
        ASSERT_EQ(have[r][b] & msg[left], 0); /* nobody counted twice */
        have[r][b] |= msg[left];
        checks++;
      }
    }
    for (int r = 0; r < n; r++) ASSERT_EQ(have[r][r], all_bits(n));
    /* All-gather: rank r starts with block r final; forwarded copies
     * replace whatever partial sum the receiver had. */
    for (int s = 0; s < n - 1; s++) {
      for (int r = 0; r < n; r++) {
        msgblk[r] = chorus__ring_ag_send_block(r, s, n);
        msg[r] = have[r][msgblk[r]];
        ASSERT_EQ(msg[r], all_bits(n)); /* only final blocks travel */
        int right = chorus__ring_right(r, n);
        ASSERT_EQ(chorus__ring_ag_recv_block(right, s, n), msgblk[r]);
      }
      for (int r = 0; r < n; r++) {
        int left = chorus__ring_left(r, n), b = chorus__ring_ag_recv_block(r, s, n);
        ASSERT_EQ(msgblk[left], b);
        ASSERT_TRUE(have[r][b] != all_bits(n)); /* each block arrives once */
        have[r][b] = msg[left];
        checks++;
      }
    }
    for (int r = 0; r < n; r++)
      for (int b = 0; b < n; b++) ASSERT_EQ(have[r][b], all_bits(n));
  }
}

/* ----------------------------------------------------- recursive doubling */

TEST(rd_ranks) {
  for (int n = 1; n <= MAXN; n++) {
    int p = chorus__rd_pow2(n), rem = chorus__rd_rem(n);
    ASSERT_TRUE(p <= n && 2 * p > n);
    ASSERT_EQ(p & (p - 1), 0);
    ASSERT_EQ(rem, n - p);
    ASSERT_EQ(1 << chorus__rd_rounds(n), p);
    int used[MAXN] = {0}, out = 0;
    for (int r = 0; r < n; r++) {
      int q = chorus__rd_newrank(r, n);
      ASSERT_EQ(q < 0, chorus__rd_folded_out(r, n));
      ASSERT_EQ(chorus__rd_in_fold(r, n), r < 2 * rem);
      if (q < 0) {
        out++;
        ASSERT_EQ(chorus__rd_partner(r, 0, n), -1);
        continue;
      }
      ASSERT_TRUE(q < p);
      ASSERT_EQ(chorus__rd_real(q, n), r);
      used[q]++;
    }
    ASSERT_EQ(out, rem);
    for (int q = 0; q < p; q++) ASSERT_EQ(used[q], 1);
  }
}

TEST(rd_simulation) {
  for (int n = 1; n <= MAXN; n++) {
    uint64_t acc[MAXN], nxt[MAXN];
    for (int r = 0; r < n; r++) acc[r] = bit(r);
    /* Fold: each folded-out rank's peer takes its vector. */
    for (int r = 0; r < n; r++) {
      int peer = chorus__rd_fold_peer(r, n);
      if (peer < 0) continue;
      ASSERT_TRUE(peer >= 0 && peer < n);
      ASSERT_EQ(chorus__rd_fold_peer(peer, n), r);
      ASSERT_TRUE(chorus__rd_folded_out(r, n) != chorus__rd_folded_out(peer, n));
      if (chorus__rd_folded_out(r, n)) {
        ASSERT_EQ(acc[peer] & acc[r], 0);
        acc[peer] |= acc[r];
        acc[r] = 0; /* it waits for the result */
      }
    }
    /* Doubling rounds: full exchanges, both sides combine. */
    for (int k = 0; k < chorus__rd_rounds(n); k++) {
      for (int r = 0; r < n; r++) {
        nxt[r] = acc[r];
        if (chorus__rd_folded_out(r, n)) continue;
        int partner = chorus__rd_partner(r, k, n);
        ASSERT_TRUE(partner >= 0 && partner < n && partner != r);
        ASSERT_TRUE(!chorus__rd_folded_out(partner, n));
        ASSERT_EQ(chorus__rd_partner(partner, k, n), r); /* symmetric */
        ASSERT_EQ(acc[r] & acc[partner], 0);
        nxt[r] = acc[r] | acc[partner];
        checks++;
      }
      for (int r = 0; r < n; r++) acc[r] = nxt[r];
    }
    for (int r = 0; r < n; r++)
      if (!chorus__rd_folded_out(r, n)) ASSERT_EQ(acc[r], all_bits(n));
    /* Hand-back. */
    for (int r = 0; r < n; r++) {
      if (!chorus__rd_folded_out(r, n)) continue;
      ASSERT_EQ(acc[r], 0);
      acc[r] = acc[chorus__rd_fold_peer(r, n)];
    }
    for (int r = 0; r < n; r++) ASSERT_EQ(acc[r], all_bits(n));
  }
}

/* ----------------------------------------------------------- Rabenseifner */

/* Recursive halving then doubling among p = 1..64 (powers of two): per
 * block, each rank's copy holds a set of contributions; halving must leave
 * block q on rank q with all p contributions, each combined exactly once,
 * and doubling must then give every rank every block. */
TEST(rabenseifner_simulation) {
  static uint64_t have[MAXN][MAXN], nxt[MAXN][MAXN]; /* rank -> block -> set */
  for (int p = 1; p <= MAXN; p *= 2) {
    int L = ref_ceil_log2(p);
    for (int q = 0; q < p; q++)
      for (int b = 0; b < p; b++) have[q][b] = bit(q);
    int lo[MAXN], w[MAXN]; /* each rank's window */
    for (int q = 0; q < p; q++) lo[q] = 0, w[q] = p;
    for (int k = 0; k < L; k++) {
      int d = chorus__rab_dist(k, p);
      ASSERT_EQ(d, p >> (k + 1));
      for (int q = 0; q < p; q++)
        for (int b = 0; b < p; b++) nxt[q][b] = have[q][b];
      for (int q = 0; q < p; q++) {
        int peer = q ^ d;
        ASSERT_EQ(chorus__rab_window_lo(q, 2 * d), lo[q]);
        ASSERT_EQ(lo[peer], lo[q]); /* partners share the window */
        int keep = q & d ? lo[q] + d : lo[q];
        for (int b = keep; b < keep + d; b++) {
          ASSERT_EQ(have[q][b] & have[peer][b], 0);
          nxt[q][b] = have[q][b] | have[peer][b];
          checks++;
        }
      }
      for (int q = 0; q < p; q++) {
        lo[q] = q & d ? lo[q] + d : lo[q];
        w[q] = d;
        for (int b = 0; b < p; b++) have[q][b] = nxt[q][b];
      }
    }
    for (int q = 0; q < p; q++) {
      ASSERT_EQ(lo[q], q);
      ASSERT_EQ(w[q], 1);
      ASSERT_EQ(have[q][q], all_bits(p));
    }
    /* Doubling, rounds in reverse: windows of size d are exchanged. */
    for (int k = L - 1; k >= 0; k--) {
      int d = chorus__rab_dist(k, p);
      for (int q = 0; q < p; q++)
        for (int b = 0; b < p; b++) nxt[q][b] = have[q][b];
      for (int q = 0; q < p; q++) {
        int mylo = chorus__rab_window_lo(q, d), theirlo = chorus__rab_window_lo(q ^ d, d);
        for (int b = mylo; b < mylo + d; b++) ASSERT_EQ(have[q][b], all_bits(p));
        for (int b = theirlo; b < theirlo + d; b++) nxt[q][b] = have[q ^ d][b];
      }
      for (int q = 0; q < p; q++)
        for (int b = 0; b < p; b++) have[q][b] = nxt[q][b];
    }
    for (int q = 0; q < p; q++)
      for (int b = 0; b < p; b++) ASSERT_EQ(have[q][b], all_bits(p));
  }
}

/* ------------------------------------------------------------------ Bruck */

TEST(bruck_simulation) {
  static int slot[MAXN][MAXN], nxt[MAXN][MAXN]; /* rank -> slot -> block, -1 */
  for (int n = 1; n <= MAXN; n++) {
    ASSERT_EQ(chorus__bruck_rounds(n), ref_ceil_log2(n));
    for (int r = 0; r < n; r++)
      for (int i = 0; i < n; i++) slot[r][i] = i ? -1 : r;
    int filled = 1; /* slots every rank holds before this round */
    for (int k = 0; k < chorus__bruck_rounds(n); k++) {
      int d = chorus__bruck_dist(k), cnt = chorus__bruck_nblocks(k, n);
      ASSERT_EQ(d, filled);
      ASSERT_TRUE(cnt >= 1 && cnt <= d && d + cnt <= n);
      for (int r = 0; r < n; r++)
        for (int i = 0; i < n; i++) nxt[r][i] = slot[r][i];
      for (int r = 0; r < n; r++) {
        int to = chorus__bruck_send_to(r, k, n), from = chorus__bruck_recv_from(r, k, n);
        /* Sends and receives match. */
        ASSERT_EQ(chorus__bruck_recv_from(to, k, n), r);
        ASSERT_EQ(chorus__bruck_send_to(from, k, n), r);
        for (int j = 0; j < cnt; j++) {
          ASSERT_TRUE(slot[from][j] >= 0); /* the sender has what it sends */
          ASSERT_EQ(slot[r][d + j], -1);  /* and it is new to the receiver */
          nxt[r][d + j] = slot[from][j];
          checks++;
        }
      }
      for (int r = 0; r < n; r++)
        for (int i = 0; i < n; i++) slot[r][i] = nxt[r][i];
      filled += cnt;
    }
    ASSERT_EQ(filled, n);
    /* Slot i holds block r+i: after the rotation every block, once. */
    for (int r = 0; r < n; r++) {
      uint64_t blocks = 0;
      for (int i = 0; i < n; i++) {
        ASSERT_EQ(slot[r][i], (r + i) % n);
        blocks |= bit(slot[r][i]);
      }
      ASSERT_EQ(blocks, all_bits(n));
    }
  }
}

/* --------------------------------------------------------------- pairwise */

TEST(pairwise_schedule) {
  for (int n = 1; n <= MAXN; n++) {
    static int met[MAXN][MAXN];
    for (int a = 0; a < n; a++)
      for (int b = 0; b < n; b++) met[a][b] = 0;
    for (int s = 1; s < n; s++) {
      int recv_from[MAXN];
      for (int r = 0; r < n; r++) recv_from[r] = -1;
      for (int r = 0; r < n; r++) {
        int to = chorus__pairwise_to(r, s, n);
        ASSERT_TRUE(to != r);
        ASSERT_EQ(chorus__pairwise_from(to, s, n), r);
        ASSERT_EQ(recv_from[to], -1); /* one sender per receiver per step */
        recv_from[to] = r;
        met[r][to]++;
      }
    }
    for (int a = 0; a < n; a++)
      for (int b = 0; b < n; b++) {
        ASSERT_EQ(met[a][b], a == b ? 0 : 1);
        checks++;
      }
  }
}

/* ---------------------------------------------------------- dissemination */

TEST(dissemination_schedule) {
  for (int n = 1; n <= MAXN; n++) {
    uint64_t heard[MAXN], nxt[MAXN];
    int rounds = chorus__dissem_rounds(n);
    ASSERT_EQ(rounds, ref_ceil_log2(n));
    for (int r = 0; r < n; r++) heard[r] = bit(r);
    for (int k = 0; k < rounds; k++) {
      for (int r = 0; r < n; r++) nxt[r] = heard[r];
      for (int r = 0; r < n; r++) {
        int to = chorus__dissem_to(r, k, n);
        ASSERT_EQ(chorus__dissem_from(to, k, n), r);
        ASSERT_TRUE(to != r);
        nxt[to] |= heard[r];
      }
      for (int r = 0; r < n; r++) heard[r] = nxt[r];
      /* Before the last round somebody is still missing someone: the
       * number of rounds is not more than needed. */
      if (k == rounds - 2) {
        int all = 1;
        for (int r = 0; r < n; r++) all &= heard[r] == all_bits(n);
        ASSERT_TRUE(!all);
      }
    }
    for (int r = 0; r < n; r++) {
      ASSERT_EQ(heard[r], all_bits(n));
      checks++;
    }
  }
}

/* ----------------------------------------------------------------- blocks */

TEST(blocks_partition) {
  static const size_t big[] = {1000, 1023, 1024, 1025, 65537, 1u << 20, ((size_t)1 << 32) + 7};
  for (int n = 1; n <= MAXN; n++) {
    for (size_t i = 0; i < 300 + sizeof big / sizeof big[0]; i++) {
      size_t count = i < 300 ? i : big[i - 300];
      size_t off = 0, max = chorus__blk_count(count, n, 0);
      for (int b = 0; b < n; b++) {
        size_t cnt = chorus__blk_count(count, n, b);
        ASSERT_EQ(chorus__blk_offset(count, n, b), off);
        ASSERT_TRUE(cnt <= max && cnt + 1 >= max); /* block 0 is a largest */
        off += cnt;
        checks++;
      }
      ASSERT_EQ(off, count);
      ASSERT_EQ(chorus__blk_offset(count, n, n), count);
    }
  }
}

/* ------------------------------------------------------------- host map */

/* Host of rank r under placement kind: 0 blocked (p ranks per host), 1
 * interleaved (r mod p), 2 uneven (a hash, some hosts empty of some local
 * indices). */
static uint64_t place(int kind, int r, int p) {
  if (kind == 0) return 1000 + (uint64_t)(r / p);
  if (kind == 1) return 77 * (uint64_t)(r % p);
  return ((uint64_t)r * 2654435761u >> 7) % (uint64_t)p;
}

TEST(topo_maps) {
  uint64_t hosts[MAXN];
  for (int n = 1; n <= MAXN; n++)
    for (int kind = 0; kind < 3; kind++)
      for (int p = 1; p <= n; p++) {
        for (int r = 0; r < n; r++) hosts[r] = place(kind, r, p);
        /* Reference: host numbers by first appearance, ranks per host. */
        int hid[MAXN], cnt[MAXN] = {0}, nh = 0, lid[MAXN];
        for (int r = 0; r < n; r++) {
          int h = -1;
          for (int q = 0; q < r && h < 0; q++)
            if (hosts[q] == hosts[r]) h = hid[q];
          if (h < 0) h = nh++;
          hid[r] = h;
          lid[r] = cnt[h]++;
        }
        int ppn = cnt[0];
        for (int h = 1; h < nh; h++)
          if (cnt[h] != ppn) ppn = 0;
        int blocked = 1; /* every host's ranks consecutive */
        for (int a = 0; a < n; a++)
          for (int b = a + 2; b < n; b++)
            for (int q = a + 1; q < b; q++)
              if (hid[a] == hid[b] && hid[q] != hid[a]) blocked = 0;
        for (int me = 0; me < n; me++) {
          chorus__topo_t t;
          ASSERT_EQ(chorus__topo_build(&t, hosts, n, me), 0);
          ASSERT_EQ(t.nhosts, nh);
          ASSERT_EQ(t.ppn, ppn);
          ASSERT_EQ(t.host, hid[me]);
          ASSERT_EQ(t.lidx, lid[me]);
          ASSERT_EQ(t.nlocal, cnt[hid[me]]);
          ASSERT_EQ(t.blocked, blocked);
          if (kind == 0) ASSERT_TRUE(t.blocked);
          for (int l = 0; l < t.nlocal; l++) {
            ASSERT_EQ(hid[t.local[l]], t.host);
            ASSERT_EQ(lid[t.local[l]], l);
          }
          for (int h = 0; h < nh; h++) {
            int r = t.cross[h];
            if (r < 0) {
              ASSERT_TRUE(cnt[h] <= t.lidx); /* host h has no rank of my index */
              continue;
            }
            ASSERT_EQ(hid[r], h);
            ASSERT_EQ(lid[r], t.lidx);
          }
          ASSERT_EQ(t.cross[t.host], me);
          if (ppn)
            for (int r = 0; r < n; r++) ASSERT_EQ(t.map[hid[r] * ppn + lid[r]], r);
          else
            ASSERT_TRUE(t.map == NULL);
          chorus__topo_free(&t);
          checks++;
        }
      }
}

int main(void) {
  RUN(helpers);
  RUN(tree_rank_mapping);
  RUN(tree_structure);
  RUN(tree_bcast_reduce_simulation);
  RUN(ring_neighbours);
  RUN(ring_schedule_simulation);
  RUN(rd_ranks);
  RUN(rd_simulation);
  RUN(rabenseifner_simulation);
  RUN(bruck_simulation);
  RUN(pairwise_schedule);
  RUN(dissemination_schedule);
  RUN(blocks_partition);
  RUN(topo_maps);
  printf("%lld schedule facts checked for n = 1..%d\n", checks, MAXN);
  return HARNESS_DONE();
}
