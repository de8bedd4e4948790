/*
 * rdzv_hb.c - heartbeats that scale with the group: the plan (how often a
 * group of n nodes beats, reads and polls, and when it calls a node lost)
 * and one watching step of an agent (the few nodes after it in group-rank
 * order).  The agent's loop (rdzv_watch.c) and the scale harness
 * (bench/scale_hb.c) both call these.  The reasoning and the bound are at
 * the top of rdzv.c.
 */
#include "launcher/rdzv.h"

#include <string.h>

#include "util/util.h"

/* The heartbeat writes per second a whole group may cost the service:
 * etcd's guidance is a few thousand writes a second, and our store is one
 * thread.  Up to 600 nodes at the default 0.15 s stay under it as they are. */
#define HB_WRITES_PER_S 4000
/* Each watched node is read this many times per heartbeat period. */
#define HB_READS_PER_BEAT 3
/* A node's beats may come this many heartbeats late (a loaded machine, the
 * service's latency) before it counts as lost: 4 heartbeats in all for a
 * small group, as before; in a large group, a quarter of its period (the
 * service is busier). */
#define HB_SLACK_BEATS 3
#define HB_SLACK_PERIOD_DIV 4
/* Without a change announced, the whole state is read at least every
 * max(10 polls, this per node). */
#define FULL_READ_NS_PER_NODE (20 * 1000000LL)

void rdzv__hb_plan(int64_t heartbeat_ns, int64_t monitor_ns, int n, rdzv_hb_plan_t *plan) {
  if (n < 1) n = 1;
  plan->nodes = n;
  plan->beat_ns = CHORUS__MAX(heartbeat_ns, (int64_t)n * (1000000000LL / HB_WRITES_PER_S));
  plan->read_ns = CHORUS__MAX(heartbeat_ns, plan->beat_ns / HB_READS_PER_BEAT);
  plan->lost_ns = plan->beat_ns + CHORUS__MAX(HB_SLACK_BEATS * heartbeat_ns,
                                              plan->beat_ns / HB_SLACK_PERIOD_DIV);
  /* The state's fingerprint is read at the same budget, without the
   * heartbeat's floor: --monitor-interval as before for small groups. */
  plan->mon_ns = CHORUS__MAX(monitor_ns, (int64_t)n * (1000000000LL / HB_WRITES_PER_S));
  plan->full_ns = CHORUS__MAX(10 * plan->mon_ns, (int64_t)n * FULL_READ_NS_PER_NODE);
  /* The last beat comes at the death at the latest; a read sees it within
   * read_ns; lost_ns after that read, the next read names the node. */
  plan->bound_ns = plan->lost_ns + 2 * plan->read_ns;
  plan->slack_ns = 2 * heartbeat_ns;
}

/* The peer of id if we have one (rdzv__peer makes one). */
static peer_t *known(rdzv_io_t *io, const char *id) {
  for (int i = 0; i < io->npeers; i++)
    if (!strcmp(io->peers[i].id, id)) return &io->peers[i];
  return NULL;
}

int rdzv__hb_targets(rdzv_io_t *io, const rnode_t *group, int n, int me,
                     int out[RDZV_HB_WATCH]) {
  int c = 0;
  if (me < 0 || me >= n) return 0;
  for (int d = 1; d < n && c < RDZV_HB_WATCH; d++) {
    int j = (me + d) % n;
    const peer_t *p = known(io, group[j].id);
    if (p && (p->done || p->gone)) continue; /* the next one is watched instead */
    out[c++] = j;
  }
  return c;
}

int rdzv__hb_watch(rdzv_io_t *io, const rdzv_hb_plan_t *plan, const rnode_t *group, int n,
                   int me, int skip_gone, int64_t now, peer_t **lost) {
  int t[RDZV_HB_WATCH];
  int c = rdzv__hb_targets(io, group, n, me, t);
  io->lost_ns = plan->lost_ns;
  for (int i = 0; i < c; i++) {
    peer_t *p = rdzv__peer(io, group[t[i]].id);
    /* Not read lately (it just became ours to watch, or our own loop or
     * the service kept us from reading): that silence was ours. */
    if (!p->read || now - p->read > plan->read_ns + plan->slack_ns) p->seen = now;
    if (!rdzv__observe(io, p->id)) return -1;
    if (rdzv__peer_lost(io, p) && !p->gone) {
      if (skip_gone) p->gone = 1;
      *lost = p;
      return 1;
    }
  }
  return 0;
}
