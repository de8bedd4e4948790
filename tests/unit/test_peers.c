/*
 * test_peers.c - the transport's per-peer state made on first touch
 * (src/transport/chan.h: chorus__tp_peer): a world of 100,000 ranks holds a
 * pointer per rank and a chorus__peer_t per touched peer only; the walks
 * over touched peers go in rank order and stay whole when their bodies
 * touch more; a peer never touched reads as alive, unconnected, named "?";
 * an endpoint maps world ranks to group ranks without a table per world
 * rank.  Prints the bytes per world rank and per touched peer, and the
 * total at P = 100,000 with 10 touched peers.
 */
#include <stdint.h>

#include "harness.h"
#include "transport/endpoint_internal.h"
#include "transport/tcp.h"

#define P 100000

static chorus__tp_t *new_tp(int rank) {
  chorus__key_t key;
  memset(&key, 7, sizeof key);
  chorus__tp_t *tp = chorus__tp_alloc(rank, P, &key, 1);
  if (!tp) return NULL;
  tcp_chan_t *t = chorus__tcp_new(tp);
  if (!t) {
    chorus__tp_free(tp);
    return NULL;
  }
  tp->net = &t->base;
  return tp;
}

TEST(made_on_first_touch) {
  chorus__tp_t *tp = new_tp(3);
  ASSERT_TRUE(tp);
  ASSERT_EQ(tp->ntouched, 0);
  ASSERT_TRUE(chorus__tp_peer_if(tp, 5) == NULL);
  ASSERT_STREQ(chorus__tp_peer_addr(tp, 5), "?");
  ASSERT_TRUE(chorus__tp_chan_of(tp, 5) == tp->net);
  ASSERT_TRUE(chorus__tp_chan_of(tp, 3) == NULL); /* this rank */
  chorus__peer_t *p = chorus__tp_peer(tp, 5);
  ASSERT_TRUE(p);
  ASSERT_TRUE(chorus__tp_peer(tp, 5) == p);
  ASSERT_TRUE(chorus__tp_peer_if(tp, 5) == p);
  ASSERT_EQ(p->rank, 5);
  ASSERT_TRUE(p->chan == tp->net);
  ASSERT_TRUE(!p->dead && !p->dead_why && !p->link && !p->rxs && p->last_heard > 0);
  ASSERT_STREQ(p->addr, "?");
  ASSERT_EQ(tp->ntouched, 1);
  chorus__peer_t *self = chorus__tp_peer(tp, 3);
  ASSERT_TRUE(self && !self->chan);
  char desc[200];
  chorus__tp_link_desc(tp, 77, desc, sizeof desc); /* not made for a description */
  ASSERT_STREQ(desc, "tcp (not connected; listens at ?)");
  ASSERT_TRUE(chorus__tp_peer_if(tp, 77) == NULL);
  chorus__tp_free(tp);
}

TEST(walks_in_rank_order) {
  chorus__tp_t *tp = new_tp(0);
  ASSERT_TRUE(tp);
  static const int ranks[] = {99999, 17, 4, 50000, 1, 18, 16, 77777, 2, 3000};
  const int k = (int)(sizeof ranks / sizeof ranks[0]);
  for (int i = 0; i < k; i++) ASSERT_TRUE(chorus__tp_peer(tp, ranks[i]));
  ASSERT_EQ(tp->ntouched, k);
  int last = -1, seen = 0;
  CHORUS__FOR_PEERS(tp, c) {
    ASSERT_TRUE(c->rank > last);
    last = c->rank;
    seen++;
  }
  ASSERT_EQ(seen, k);
  /* Touching peers below and above the walk's place: every peer there
   * before is seen once, in order. */
  last = -1;
  seen = 0;
  int extra = 0;
  CHORUS__FOR_PEERS(tp, c) {
    ASSERT_TRUE(c->rank > last);
    last = c->rank;
    if (c->rank == 17) {
      for (int r = 5; r < 40; r++) extra += chorus__tp_peer_if(tp, r) == NULL;
      for (int r = 5; r < 40; r++) ASSERT_TRUE(chorus__tp_peer(tp, r));
    }
    seen++;
  }
  ASSERT_EQ(seen, k + 21); /* and 19..39, new above 17; 5..15 came below it */
  ASSERT_EQ(tp->ntouched, k + extra);
  chorus__tp_free(tp);
}

TEST(endpoint_groups) {
  chorus__tp_t *tp = new_tp(3);
  ASSERT_TRUE(tp);
  static const int members[] = {7, 3, 99999, 0};
  chorus__ep_t *ep = NULL;
  ASSERT_EQ(chorus__ep_create(tp, 42, members, 4, 1, &ep), CHORUS_OK);
  ASSERT_TRUE(ep->by_world);
  ASSERT_EQ(chorus__ep_group(ep, 7), 0);
  ASSERT_EQ(chorus__ep_group(ep, 3), 1);
  ASSERT_EQ(chorus__ep_group(ep, 99999), 2);
  ASSERT_EQ(chorus__ep_group(ep, 0), 3);
  ASSERT_EQ(chorus__ep_group(ep, 5), -1);
  ASSERT_EQ(chorus__ep_group(ep, 99998), -1);
  char pd[160];
  chorus__ep_peer_desc(ep, 99999, pd, sizeof pd);
  ASSERT_STREQ(pd, "rank 2 (world rank 99999, ?)");
  ASSERT_EQ(tp->ntouched, 0); /* creating it touched no one */
  ASSERT_EQ(chorus__ep_peer_gone(ep, 2), 0);
  ASSERT_EQ(chorus__ep_check_peer(ep, 2, "test"), CHORUS_OK);
  ASSERT_EQ(tp->ntouched, 0);
  chorus__ep_destroy(ep);
  int *world = malloc(sizeof(int) * P);
  ASSERT_TRUE(world);
  for (int r = 0; r < P; r++) world[r] = r;
  ASSERT_EQ(chorus__ep_create(tp, 43, world, P, 3, &ep), CHORUS_OK);
  free(world);
  ASSERT_TRUE(!ep->by_world); /* the world's own: no table */
  ASSERT_EQ(chorus__ep_group(ep, 12345), 12345);
  chorus__ep_peer_desc(ep, 12345, pd, sizeof pd);
  ASSERT_STREQ(pd, "rank 12345 (?)");
  chorus__ep_destroy(ep);
  chorus__tp_free(tp);
}

/* The bytes of per-world state, from the structures. */
TEST(bytes_per_rank) {
  const size_t k = 10;
  const size_t per_rank = sizeof(chorus__peer_t *);  /* tp->peers */
  const size_t world_ep = sizeof(int);               /* the world endpoint's members */
  const size_t per_peer = sizeof(chorus__peer_t) + sizeof(chorus__peer_t *); /* + touched[] */
  const size_t per_conn = sizeof(conn_t) + sizeof(conn_t *);                 /* + live[] */
  const size_t total = P * (per_rank + world_ep) + 16 * sizeof(chorus__peer_t *) +
                       k * sizeof(chorus__peer_t) + k * per_conn;
  printf("per world rank: %zu (peer table) + %zu (world endpoint's members) bytes\n", per_rank,
         world_ep);
  printf("per touched peer: %zu = %zu (chorus__peer_t) + %zu (touched slot) bytes\n", per_peer,
         sizeof(chorus__peer_t), sizeof(chorus__peer_t *));
  printf("per TCP-connected peer: %zu (conn_t) + %zu (live slot) bytes\n", sizeof(conn_t),
         sizeof(conn_t *));
  printf("P = %d, k = %zu touched (all over TCP): %zu bytes\n", P, k, total);
  ASSERT_TRUE(per_rank + world_ep <= 16);
  ASSERT_TRUE(total <= (size_t)5 << 20);
}

int main(void) {
  RUN(made_on_first_touch);
  RUN(walks_in_rank_order);
  RUN(endpoint_groups);
  RUN(bytes_per_rank);
  return HARNESS_DONE();
}
