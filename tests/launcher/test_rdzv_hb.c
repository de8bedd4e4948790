/*
 * test_rdzv_hb.c - the launcher's scaling heartbeats (src/launcher/
 * rdzv_hb.c, compiled in with rdzv_keys.c by tests/launcher/
 * CMakeLists.txt): the plan's periods and bound for H nodes, the ring of
 * watched nodes, and the watching step against a real store: a stopped
 * node named within the bound, a node that left not, replayed old beats
 * not keeping a stopped node alive, a node watched anew given a fresh
 * lost time.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus.h"
#include "harness.h"
#include "launcher/rdzv.h"
#include "store/store.h"
#include "util/clock.h"

#define MS 1000000LL

TEST(plan_small_groups_keep_todays_times) {
  rdzv_hb_plan_t p;
  static const int sizes[] = {1, 4, 400, 600};
  for (int i = 0; i < 4; i++) {
    int n = sizes[i];
    rdzv__hb_plan(150 * MS, 100 * MS, n, &p);
    ASSERT_EQ(p.beat_ns, 150 * MS);
    ASSERT_EQ(p.read_ns, 150 * MS);
    ASSERT_EQ(p.lost_ns, 600 * MS); /* 4 heartbeats */
    ASSERT_EQ(p.bound_ns, 900 * MS);
    ASSERT_EQ(p.mon_ns, n <= 400 ? 100 * MS : n * (MS / 4)); /* the state's poll */
  }
}

TEST(plan_large_groups_stay_under_the_budget) {
  rdzv_hb_plan_t p;
  rdzv__hb_plan(150 * MS, 100 * MS, 10000, &p);
  ASSERT_EQ(p.beat_ns, 2500 * MS);
  ASSERT_TRUE(p.bound_ns <= 5000 * MS);
  for (int n = 1; n <= 100000; n = n * 3 + 1) {
    rdzv__hb_plan(150 * MS, 100 * MS, n, &p);
    double writes = n / (p.beat_ns / 1e9), polls = n / (p.mon_ns / 1e9);
    ASSERT_TRUE(writes <= 4000.5 || n * 1e9 / 4000 < 150 * MS); /* the floor: hb */
    ASSERT_TRUE(polls <= 10000.5);
    ASSERT_TRUE(p.read_ns <= p.beat_ns && p.lost_ns > p.beat_ns);
    ASSERT_TRUE(p.bound_ns == p.lost_ns + 2 * p.read_ns);
  }
}

static rdzv_io_t make_io(peer_t *peers, int cap, const char *id) {
  rdzv_io_t io;
  memset(&io, 0, sizeof io);
  snprintf(io.id, sizeof io.id, "%s", id);
  snprintf(io.pfx, sizeof io.pfx, "rdzv/test-hb/");
  io.peers = peers;
  io.peer_cap = cap;
  return io;
}

TEST(the_ring_skips_nodes_that_left) {
  rnode_t g[5];
  for (int i = 0; i < 5; i++) snprintf(g[i].id, sizeof g[i].id, "n/%d", i);
  peer_t peers[8];
  rdzv_io_t io = make_io(peers, 8, "n/4");
  int t[RDZV_HB_WATCH];
  ASSERT_EQ(rdzv__hb_targets(&io, g, 5, 4, t), 2);
  ASSERT_EQ(t[0], 0);
  ASSERT_EQ(t[1], 1);
  rdzv__peer(&io, "n/0")->done = 1;
  rdzv__peer(&io, "n/1")->gone = 1;
  ASSERT_EQ(rdzv__hb_targets(&io, g, 5, 4, t), 2);
  ASSERT_EQ(t[0], 2);
  ASSERT_EQ(t[1], 3);
  ASSERT_EQ(rdzv__hb_targets(&io, g, 2, 1, t), 0); /* n/0 left: nobody to watch */
  ASSERT_EQ(rdzv__hb_targets(&io, g, 5, -1, t), 0);
}

static void nap(int64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
  nanosleep(&ts, NULL);
}

/* Watches with b until it names a node or `for_ns` passes: the ns it took,
 * or -1. */
static int64_t watch_until_lost(rdzv_io_t *b, const rdzv_hb_plan_t *p, const rnode_t *g, int n,
                                int64_t for_ns, rdzv_io_t *beating, const char **who) {
  int64_t t0 = chorus__now_ns();
  while (chorus__now_ns() - t0 < for_ns) {
    if (beating) rdzv__beat(beating, 0, 0);
    peer_t *lost = NULL;
    if (rdzv__hb_watch(b, p, g, n, 1, 0, chorus__now_ns(), &lost) == 1) {
      *who = lost->id;
      return chorus__now_ns() - t0;
    }
    nap(p->read_ns);
  }
  return -1;
}

TEST(a_stopped_node_is_named_within_the_bound) {
  chorus__key_t key;
  chorus__job_key("test-hb-secret", "test-hb", &key);
  chorus_store_server_t *srv = NULL;
  ASSERT_EQ(chorus__store_server_start_key("127.0.0.1", 0, &key, &srv), CHORUS_OK);
  int port = chorus_store_server_port(srv);
  kv_t *kv = NULL;
  char err[600];
  ASSERT_EQ(kv_store_open("127.0.0.1", port, &key, 2000, 2000, &kv, err, sizeof err), 0);
  rnode_t g[3];
  for (int i = 0; i < 3; i++) snprintf(g[i].id, sizeof g[i].id, "n/%d", i);
  peer_t pa[8], pb[8];
  rdzv_io_t a = make_io(pa, 8, "n/2"), b = make_io(pb, 8, "n/1");
  a.kv = b.kv = kv;
  a.key = b.key = &key;
  rdzv_hb_plan_t p;
  rdzv__hb_plan(20 * MS, 20 * MS, 3, &p);
  const char *who = NULL;
  /* n/1 watches n/2 and n/0; n/0 never beat, n/2 beats: n/0 is named. */
  int64_t t = watch_until_lost(&b, &p, g, 3, 20 * p.bound_ns, &a, &who);
  ASSERT_TRUE(t > 0 && !strcmp(who, "n/0"));
  /* n/0 says it left: no longer watched, never lost.  n/2 stops. */
  peer_t pz[8];
  rdzv_io_t z = make_io(pz, 8, "n/0");
  z.kv = kv;
  z.key = &key;
  z.beats = 100;
  ASSERT_EQ(rdzv__beat(&z, 1, 0), 0);
  char old[300], *v1 = NULL, *raw1 = NULL;
  rdzv__key_of(&a, old, sizeof old, "hb/%s", a.id);
  ASSERT_EQ(rdzv__kget(&a, old, &v1, &raw1), 1); /* an old beat of n/2, sealed */
  rdzv__beat(&a, 0, 0);
  rdzv__beat(&a, 0, 0);
  int64_t stop = chorus__now_ns();
  peer_t *none = NULL;
  ASSERT_EQ(rdzv__hb_watch(&b, &p, g, 3, 1, 0, chorus__now_ns(), &none), 0); /* sees the last */
  who = NULL;
  /* Someone puts n/2's old value back every read: a replay, not a beat. */
  int64_t named = -1;
  for (int i = 0; i < 1000 && named < 0; i++) {
    ASSERT_EQ(kv->ops->set(kv, old, raw1), 0);
    peer_t *lost = NULL;
    if (rdzv__hb_watch(&b, &p, g, 3, 1, 0, chorus__now_ns(), &lost) == 1) {
      who = lost->id;
      named = chorus__now_ns() - stop;
    }
    nap(p.read_ns);
  }
  ASSERT_TRUE(who && !strcmp(who, "n/2"));
  ASSERT_TRUE(named <= p.bound_ns + 5 * p.read_ns); /* a loaded machine's slack */
  ASSERT_TRUE(rdzv__peer(&b, "n/2")->replayed > 0);
  free(v1);
  free(raw1);
  /* A node not read for a while is given a fresh lost time: n/2, still
   * silent, is not named at the first read after a pause. */
  nap(3 * p.lost_ns);
  peer_t *lost = NULL;
  ASSERT_EQ(rdzv__hb_watch(&b, &p, g, 3, 1, 0, chorus__now_ns(), &lost), 0);
  kv->ops->close(kv);
  chorus_store_server_stop(srv);
}

int main(void) {
  RUN(plan_small_groups_keep_todays_times);
  RUN(plan_large_groups_stay_under_the_budget);
  RUN(the_ring_skips_nodes_that_left);
  RUN(a_stopped_node_is_named_within_the_bound);
  return HARNESS_DONE();
}
