/*
 * scale_hb.c - chorus-scale-hb: plays H launcher agents' heartbeats against
 * a real store (a chorus store server in this process, or an etcd) with
 * chorusrun's own functions (rdzv__hb_plan, rdzv__beat, rdzv__hb_watch,
 * rdzv__record_failure, rdzv__gen_changed: src/launcher/rdzv_hb.c and
 * rdzv_keys.c), and measures what they cost the service and how soon a
 * killed agent is named lost.
 *
 *   chorus-scale-hb [-n H] [-t THREADS] [--measure S] [--heartbeat S]
 *                   [--etcd HOST:PORT] [--max-writes N] [--max-named S]
 *
 * Each thread plays a block of agents over one connection of its own (the
 * service sees the same keys, values and calls as from H agents; item 2 of
 * issue 45 is the store's connections).  After a warm-up of two beat
 * periods it counts calls for --measure seconds, then stops one agent's
 * beats and waits for another to name it lost, record fail/0 and change
 * the state, and for every other agent to learn it from the state's
 * fingerprint.  Prints one line of results; with --max-writes/--max-named
 * exits 1 when the writes per second or the time to name the lost agent
 * exceed them, or when a live agent was called lost; 77 when this process
 * could not keep its agents on time (their beats later than the plan's
 * slack): that measures the machine, not the heartbeats.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "launcher/rdzv.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/util.h"

/* ---------------------------------------------------- a counting service */

typedef struct {
  atomic_long gets, found, sets, cas, bytes;
} counts_t;

typedef struct {
  kv_t base;
  kv_t *in;
  counts_t *c;
} kv_count_t;

static void add(atomic_long *a, long v) { atomic_fetch_add_explicit(a, v, memory_order_relaxed); }

static int cnt_get(kv_t *kv, const char *key, char **val) {
  kv_count_t *k = (kv_count_t *)kv;
  int rc = k->in->ops->get(k->in, key, val);
  add(&k->c->gets, 1);
  add(&k->c->bytes, (long)strlen(key) + (rc == 1 ? (long)strlen(*val) : 0));
  if (rc == 1) add(&k->c->found, 1);
  if (rc < 0) snprintf(kv->err, sizeof kv->err, "%s", k->in->err);
  return rc;
}

static int cnt_set(kv_t *kv, const char *key, const char *val) {
  kv_count_t *k = (kv_count_t *)kv;
  add(&k->c->sets, 1);
  add(&k->c->bytes, (long)(strlen(key) + strlen(val)));
  int rc = k->in->ops->set(k->in, key, val);
  if (rc < 0) snprintf(kv->err, sizeof kv->err, "%s", k->in->err);
  return rc;
}

static int cnt_cas(kv_t *kv, const char *key, const char *expected, const char *desired) {
  kv_count_t *k = (kv_count_t *)kv;
  add(&k->c->cas, 1);
  add(&k->c->bytes, (long)(strlen(key) + (expected ? strlen(expected) : 0) + strlen(desired)));
  return k->in->ops->cas(k->in, key, expected, desired);
}

static int cnt_addr(kv_t *kv, char *host, size_t cap) {
  kv_count_t *k = (kv_count_t *)kv;
  return k->in->ops->local_addr(k->in, host, cap);
}

static void cnt_close(kv_t *kv) {
  kv_count_t *k = (kv_count_t *)kv;
  k->in->ops->close(k->in);
  free(k);
}

static const kv_ops_t g_cnt_ops = {cnt_get, cnt_set, cnt_cas, cnt_addr, cnt_close, NULL};

/* ------------------------------------------------------------- the run */

#define PEERS_PER_AGENT (2 * RDZV_HB_WATCH + 2)

typedef struct {
  rdzv_io_t io;
  peer_t peers[PEERS_PER_AGENT];
  int rank;
  int ver; /* the state it last read: 0 before the loss, 1 after */
  int64_t next_beat, next_read, next_mon;
} agent_t;

typedef struct {
  int h, threads;
  double measure_s, heartbeat_s;
  const char *etcd;
  long max_writes;
  double max_named;
  int port;
  chorus__key_t key;
  rdzv_hb_plan_t plan;
  rnode_t *group;
  agent_t *agents;
  char pfx[200];
  char *before;            /* the state as stored before the loss */
  _Atomic(char *) after;   /* ... and after it (NULL until then) */
  counts_t counts;
  atomic_int stop, dead; /* dead: the victim no longer beats */
  int victim;
  int64_t t_kill;
  atomic_llong t_named, t_all;
  atomic_int named_by, learned, false_losses;
  atomic_llong max_late;
} run_t;

static run_t g;

static int64_t now_ns(void) { return chorus__now_ns(); }

static int open_kv(kv_t **out, char *err, size_t cap) {
  kv_t *in = NULL;
  int rc;
  if (g.etcd) {
    static const kv_etcd_opts_t none;
    rc = kv_etcd_open(g.etcd, "/chorus-scale-hb/", 5000, 5000, &none, &in, err, cap);
  } else {
    rc = kv_store_open("127.0.0.1", g.port, &g.key, 5000, 5000, &in, err, cap);
  }
  if (rc != 0) return -1;
  kv_count_t *k = calloc(1, sizeof *k);
  if (!k) return -1;
  k->base.ops = &g_cnt_ops;
  snprintf(k->base.where, sizeof k->base.where, "%s", in->where);
  k->in = in;
  k->c = &g.counts;
  *out = &k->base;
  return 0;
}

/* The agent that saw the victim lost does what lost_node() does: the
 * failure record, then the state changed and announced. */
static void name_lost(agent_t *a, const peer_t *p, int64_t now) {
  if (strcmp(p->id, g.group[g.victim].id) || !atomic_load(&g.dead)) {
    atomic_fetch_add(&g.false_losses, 1);
    fprintf(stderr, "chorus-scale-hb: agent %d called %s lost, a live agent\n", a->rank, p->id);
    return;
  }
  long long zero = 0;
  if (!atomic_compare_exchange_strong(&g.t_named, &zero, (long long)now)) return;
  atomic_store(&g.named_by, a->rank);
  fail_t f = {0}, rec;
  snprintf(f.kind, sizeof f.kind, "lost");
  f.code = 1;
  f.grank = g.victim;
  f.rank = -1;
  snprintf(f.node, sizeof f.node, "%s", p->id);
  snprintf(f.what, sizeof f.what, "node %d (%s) was lost: no heartbeat for %.1f s", g.victim,
           p->id, (now - p->seen) / 1e9);
  rdzv__record_failure(&a->io, 0, &f, &rec);
  char key[300];
  rdzv__key_of(&a->io, key, sizeof key, "state");
  char *v = NULL, *raw = NULL;
  if (rdzv__kset(&a->io, key, "chorus-rdzv 1\nround 1\nphase join\n") == 0 &&
      rdzv__kget(&a->io, key, &v, &raw) == 1) {
    atomic_store(&g.after, raw);
    rdzv__gen_publish(&a->io, raw);
  }
  free(v);
  a->ver = 1;
  atomic_fetch_add(&g.learned, 1);
}

/* The monitor step: the fingerprint, and the state when it changed. */
static void poll_state(agent_t *a, int64_t now) {
  char *after = atomic_load(&g.after);
  if (a->ver || !after) {
    rdzv__gen_changed(&a->io, a->ver ? after : g.before);
    return;
  }
  if (rdzv__gen_changed(&a->io, g.before) != 1) return;
  char key[300], *v = NULL, *raw = NULL;
  rdzv__key_of(&a->io, key, sizeof key, "state");
  if (rdzv__kget(&a->io, key, &v, &raw) == 1 && !strcmp(raw, after)) {
    a->ver = 1;
    if (atomic_fetch_add(&g.learned, 1) + 2 == g.h) atomic_store(&g.t_all, (long long)now);
  }
  free(v);
  free(raw);
}

static void step(agent_t *a, int64_t now) {
  if (a->rank == g.victim && atomic_load(&g.dead)) return;
  if (now >= a->next_beat) {
    int64_t late = now - a->next_beat;
    if (late > atomic_load(&g.max_late)) atomic_store(&g.max_late, (long long)late);
    a->next_beat = now + g.plan.beat_ns;
    rdzv__beat(&a->io, 0, 0);
  }
  if (now >= a->next_read) {
    a->next_read = now + g.plan.read_ns;
    peer_t *p = NULL;
    if (rdzv__hb_watch(&a->io, &g.plan, g.group, g.h, a->rank, 0, now, &p) == 1)
      name_lost(a, p, now);
  }
  if (now >= a->next_mon) {
    a->next_mon = now + g.plan.mon_ns;
    poll_state(a, now);
  }
}

static void *player(void *arg) {
  int t = (int)(intptr_t)arg;
  int lo = (int)((long)g.h * t / g.threads), hi = (int)((long)g.h * (t + 1) / g.threads);
  kv_t *kv = NULL;
  char err[600];
  if (open_kv(&kv, err, sizeof err) != 0) {
    fprintf(stderr, "chorus-scale-hb: thread %d: %s\n", t, err);
    atomic_store(&g.stop, 1);
    return NULL;
  }
  for (int i = lo; i < hi; i++) g.agents[i].io.kv = kv;
  while (!atomic_load(&g.stop)) {
    int64_t next = now_ns() + 5000000;
    for (int i = lo; i < hi; i++) {
      agent_t *a = &g.agents[i];
      step(a, now_ns());
      int64_t n = CHORUS__MIN(CHORUS__MIN(a->next_beat, a->next_read), a->next_mon);
      if (n < next) next = n;
    }
    int64_t wait = next - now_ns();
    if (wait > 0) {
      struct timespec ts = {(time_t)(wait / 1000000000LL), (long)(wait % 1000000000LL)};
      nanosleep(&ts, NULL);
    }
  }
  kv->ops->close(kv);
  return NULL;
}

/* ------------------------------------------------------------- main */

static void say_usage(void) {
  fprintf(stderr,
          "usage: chorus-scale-hb [-n AGENTS] [-t THREADS] [--measure S] [--heartbeat S]\n"
          "                       [--etcd HOST:PORT] [--max-writes N] [--max-named S]\n");
}

static int parse(int argc, char **argv) {
  g.h = 1000;
  g.threads = 4;
  g.measure_s = 5;
  g.heartbeat_s = 0.15;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) return -1;
    if (!strcmp(a, "-n")) g.h = atoi(v);
    else if (!strcmp(a, "-t")) g.threads = atoi(v);
    else if (!strcmp(a, "--measure")) g.measure_s = atof(v);
    else if (!strcmp(a, "--heartbeat")) g.heartbeat_s = atof(v);
    else if (!strcmp(a, "--etcd")) g.etcd = v;
    else if (!strcmp(a, "--max-writes")) g.max_writes = atol(v);
    else if (!strcmp(a, "--max-named")) g.max_named = atof(v);
    else return -1;
    i++;
  }
  if (g.h < 3 || g.h > 1000000 || g.threads < 1 || g.threads > 256 || g.measure_s <= 0 ||
      g.heartbeat_s < 0.01 || g.heartbeat_s > 60)
    return -1;
  if (g.threads > g.h) g.threads = g.h;
  return 0;
}

static void sleep_s(double s) {
  int64_t until = now_ns() + (int64_t)(s * 1e9);
  while (!atomic_load(&g.stop) && now_ns() < until) {
    struct timespec ts = {0, 10000000};
    nanosleep(&ts, NULL);
  }
}

/* The agents, their ids, their heartbeats' first phases spread over a
 * period, and the state they all read at the start.  0 or -1. */
static int set_up(void) {
  snprintf(g.pfx, sizeof g.pfx, "rdzv/scale-hb-%d-%ld/", (int)getpid(), (long)time(NULL));
  g.group = calloc((size_t)g.h, sizeof *g.group);
  g.agents = calloc((size_t)g.h, sizeof *g.agents);
  if (!g.group || !g.agents) return -1;
  rdzv__hb_plan((int64_t)(g.heartbeat_s * 1e9), 100000000LL, g.h, &g.plan);
  int64_t t0 = now_ns();
  for (int i = 0; i < g.h; i++) {
    snprintf(g.group[i].id, sizeof g.group[i].id, "10.%d.%d.%d/%d", (i >> 16) & 255,
             (i >> 8) & 255, i & 255, 4000 + i);
    g.group[i].nproc = 1;
    agent_t *a = &g.agents[i];
    a->rank = i;
    a->io.key = &g.key;
    snprintf(a->io.pfx, sizeof a->io.pfx, "%s", g.pfx);
    snprintf(a->io.id, sizeof a->io.id, "%s", g.group[i].id);
    a->io.peers = a->peers;
    a->io.peer_cap = PEERS_PER_AGENT;
    a->io.last_ok = t0;
    int64_t phase = (int64_t)((double)i / g.h * (double)g.plan.beat_ns);
    a->next_beat = t0 + phase;
    a->next_read = t0 + phase % g.plan.read_ns;
    a->next_mon = t0 + phase % g.plan.mon_ns;
  }
  g.victim = g.h / 2;
  kv_t *kv = NULL;
  char err[600], key[300];
  if (open_kv(&kv, err, sizeof err) != 0) {
    fprintf(stderr, "chorus-scale-hb: %s\n", err);
    return -1;
  }
  rdzv_io_t io = g.agents[0].io;
  io.kv = kv;
  rdzv__key_of(&io, key, sizeof key, "state");
  char *v = NULL;
  int rc = rdzv__kset(&io, key, "chorus-rdzv 1\nround 0\nphase frozen\n") == 0 &&
                   rdzv__kget(&io, key, &v, &g.before) == 1 && rdzv__gen_publish(&io, g.before) == 0
               ? 0
               : -1;
  free(v);
  kv->ops->close(kv);
  if (rc != 0) fprintf(stderr, "chorus-scale-hb: cannot write the state\n");
  return rc;
}

static void snapshot(long v[5]) {
  v[0] = atomic_load(&g.counts.sets);
  v[1] = atomic_load(&g.counts.cas);
  v[2] = atomic_load(&g.counts.gets);
  v[3] = atomic_load(&g.counts.found);
  v[4] = atomic_load(&g.counts.bytes);
}

int main(int argc, char **argv) {
  if (parse(argc, argv) != 0) {
    say_usage();
    return 2;
  }
  chorus__job_key("scale-hb-secret", "scale-hb", &g.key);
  chorus_store_server_t *srv = NULL;
  if (!g.etcd) {
    if (chorus__store_server_start_key("127.0.0.1", 0, &g.key, &srv) != CHORUS_OK) {
      fprintf(stderr, "chorus-scale-hb: cannot start a store\n");
      return 1;
    }
    g.port = chorus_store_server_port(srv);
  }
  if (set_up() != 0) return 1;
  pthread_t *th = calloc((size_t)g.threads, sizeof *th);
  for (int t = 0; t < g.threads; t++) pthread_create(&th[t], NULL, player, (void *)(intptr_t)t);
  /* Warm-up: every agent has beaten and read its nodes twice. */
  sleep_s(2.0 * (double)(g.plan.beat_ns + g.plan.read_ns) / 1e9);
  long a[5], b[5];
  chorus__store_stats_t sa = {0}, sb = {0}; /* the store's own count of requests */
  snapshot(a);
  if (srv) chorus__store_server_stats(srv, &sa);
  int64_t m0 = now_ns();
  sleep_s(g.measure_s);
  snapshot(b);
  if (srv) chorus__store_server_stats(srv, &sb);
  double span = (now_ns() - m0) / 1e9;
  g.t_kill = now_ns();
  atomic_store(&g.dead, 1);
  double wait = 3.0 * (double)(g.plan.bound_ns + g.plan.mon_ns) / 1e9;
  int64_t until = g.t_kill + (int64_t)(wait * 1e9);
  while (!atomic_load(&g.stop) && now_ns() < until && !atomic_load(&g.t_all)) sleep_s(0.01);
  atomic_store(&g.stop, 1);
  for (int t = 0; t < g.threads; t++) pthread_join(th[t], NULL);
  if (srv) chorus_store_server_stop(srv);

  double writes = (double)(b[0] - a[0] + b[1] - a[1]) / span;
  double reads = (double)(b[2] - a[2]) / span;
  /* What the store answered (a read is one TRY_GET). */
  double requests = (double)(sb.requests - sa.requests) / span;
  double bytes = (double)(b[4] - a[4]) / span;
  long long tn = atomic_load(&g.t_named), ta = atomic_load(&g.t_all);
  double named = tn ? (tn - g.t_kill) / 1e9 : -1, all = ta ? (ta - g.t_kill) / 1e9 : -1;
  printf("H=%d backend=%s threads=%d beat=%.3fs read=%.3fs lost_after=%.3fs bound=%.3fs "
         "mon=%.3fs | writes/s=%.0f reads/s=%.0f store_requests/s=%.0f bytes/s=%.0f | "
         "named_lost_s=%.3f (by agent %d, watching %d) all_learned_s=%.3f "
         "false_losses=%d max_beat_late_s=%.3f\n",
         g.h, g.etcd ? "etcd" : "store", g.threads, g.plan.beat_ns / 1e9, g.plan.read_ns / 1e9,
         g.plan.lost_ns / 1e9, g.plan.bound_ns / 1e9, g.plan.mon_ns / 1e9, writes, reads,
         g.etcd ? writes + reads : requests, bytes, named, atomic_load(&g.named_by), g.victim,
         all, atomic_load(&g.false_losses), atomic_load(&g.max_late) / 1e9);
  /* Agents this process could not keep on time (a loaded machine) test
   * nothing: their beats came later than the plan's slack allows. */
  double late = atomic_load(&g.max_late) / 1e9, slack = (g.plan.lost_ns - g.plan.beat_ns) / 1e9;
  if (late > slack && (g.max_writes > 0 || g.max_named > 0)) {
    fprintf(stderr,
            "chorus-scale-hb: this machine could not keep the agents on time (beats up to %.3f s "
            "late, the slack is %.3f s): not a measurement\n", late, slack);
    return 77;
  }
  int bad = atomic_load(&g.false_losses) > 0 || named < 0;
  if (g.max_writes > 0 && writes > (double)g.max_writes) {
    fprintf(stderr, "chorus-scale-hb: %.0f writes/s, above %ld\n", writes, g.max_writes);
    bad = 1;
  }
  if (g.max_named > 0 && (named < 0 || named > g.max_named)) {
    fprintf(stderr, "chorus-scale-hb: the lost agent named after %.3f s, bound %.3f s\n", named,
            g.max_named);
    bad = 1;
  }
  return bad;
}
