/*
 * rdzv.c - the rendezvous's connection: opening it (hosting or reaching the
 * key-value service, this node's id) and leaving it (the last heartbeat,
 * the store's host staying until the others are gone, the job's keys
 * removed).  The protocol below is carried out by rdzv_round.c (joining a
 * round, freezing it, opening the next), rdzv_watch.c (a formed group:
 * heartbeats, lost nodes, failures and their root cause) and rdzv_keys.c
 * (the sealed values on the service); rdzv.h holds what they share.
 *
 * Every node runs one agent.  The agents meet on a key-value service (kv_t:
 * chorus's store hosted by the agent at the endpoint for c10d, by node 0
 * for static), under keys "rdzv/<run id>/":
 *
 *   state     the rendezvous state: one text value, changed only by
 *             compare-and-set, so every change is atomic and all agents see
 *             the same sequence of states.  Lines (fields split by spaces):
 *               chorus-rdzv 1
 *               round R          0, 1, ...: one per group formed
 *               phase P          join, frozen or closed
 *               nnodes MIN MAX   as the first agent was started
 *               max_restarts K   likewise
 *               restarts N       rounds opened because something failed
 *               exit CODE        closed: what every agent exits with
 *               reason TEXT      why the round opened or the job closed
 *               prev ID GRANK    the last frozen round's nodes
 *               expect ID        nodes this round waits for: the last
 *                                round's survivors and the nodes that were
 *                                waiting; once all of them (and MIN) are
 *                                in, the round freezes without a last call
 *               member ID NPROC WANT   joined (frozen: in group-rank order);
 *                                WANT is the static --node-rank, else -1
 *               wait ID NPROC WANT     arrived after the freeze
 *   hb/ID     a node's heartbeat, "<counter> run" while it takes part, then
 *             "<counter> done <exit code>" once it has left
 *   gen       the state's fingerprint (its seal), set by whoever changed
 *             the state, after the compare-and-set: polled instead of the
 *             state, whose text grows with the nodes
 *   fail/R    the first failure of round R anywhere in the job, written
 *             once (compare-and-set on an absent key): the root cause
 *
 * A round: agents add themselves to `member` until MAX are in (freeze at
 * once), or all expected nodes are (freeze at once), or MIN are and the
 * last call (last_call_timeout, timed by each agent from when it first saw
 * MIN) runs out; the agent that freezes assigns group ranks in the same
 * compare-and-set.  Ranks are stable: a node that was in the last round
 * keeps its group rank if it is still below the new node count; the others
 * fill the free ranks, last round's nodes first (in their old order), then
 * new ones in the order they joined.  A node that arrives after the freeze
 * goes to `wait`; group rank 0's agent then opens the next round if the
 * group has room (scale-up, not counted as a restart).
 *
 * While a group of H nodes runs (rdzv_hb.c), each agent writes its own
 * heartbeat and reads only the heartbeats of the RDZV_HB_WATCH (2) nodes
 * after it in group-rank order, as a ring, skipping nodes that left (or,
 * --elastic inplace, were reported gone); so every node is watched by 2
 * agents, and a node whose watchers died with it is covered by theirs
 * being named.  With hb = the `heartbeat` setting (0.15 s):
 *
 *   beat  = max(hb, H / 4000 s)         our heartbeat's period: at most
 *                                       4,000 heartbeat writes/s per job
 *   read  = max(hb, beat / 3)           each watched node's reads
 *   lost  = beat + max(3 hb, beat / 4)  a watched node whose counter has not
 *                                       grown for this long is lost
 *   bound = lost + 2 read               from a node's death to its naming
 *
 * A live node's next beat comes within beat (plus its lateness) of the
 * last one, which came before the read that first showed it; so a counter
 * unchanged for `lost` since that read is a dead node (or one later than
 * the slack).  The last beat of a dead node is seen within one read, and
 * the first read `lost` after that names it: bound.  Up to 600 nodes
 * the times are as they were (beat = read = 0.15 s, lost 0.6 s, bound
 * 0.9 s; the state's poll below stretches from 400); 1,000
 * nodes: beat 0.25 s, bound 1.0 s; 10,000: beat 2.5 s, lost 3.1 s, bound
 * 4.8 s.  The service's load is H / beat heartbeat writes/s and
 * 2 H / read + H / poll reads/s: 4,000 and 28,000 at 10,000 nodes (was
 * 67,000 and 670 million; the state holds MAX_NODES = 1,024 nodes today,
 * bench/scale_hb.c plays more).  A failed worker or a lost node makes the
 * agent that sees it write fail/R, then open round R+1 with restarts+1, or
 * close the job when no restarts are left (or a node of the round already
 * finished: its workers cannot rejoin); the others learn it from the
 * state.  A node we start to watch (the ring moved, or
 * our own loop or the service kept us from reading for a while) gets a
 * fresh `lost` from then: that silence was ours.
 *
 * Every agent polls the state every poll = max(monitor interval,
 * H / 4000 s) by reading `gen` (80 bytes), and reads the whole state only
 * when `gen` no longer names the one it holds (or every max(10 polls,
 * H x 20 ms) regardless, in case a writer died between its compare-and-set
 * and `gen`): a new round stops its workers and it joins again; a closed
 * one stops them and it exits with the job's code after printing the root
 * cause.  A service that has not answered for `lost` (etcd: at least 10 s)
 * is lost too: the agent stops its workers and exits.
 *
 * Received values are untrusted: the state is parsed line by line with
 * bounded fields and counts, node ids are checked character by character,
 * and a value that does not parse is reported, never used.
 */
#include "launcher/rdzv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/net.h"
#include "util/util.h"

#define LOST_BEATS 4

/* ------------------------------------------------------------- opening */

/* How long the endpoint may answer wrongly before an agent gives up. */
#define WRONG_ANSWER_MS 5000

/* 1 when nothing listens on host:port here (host "" : every interface). */
static int port_free(const char *host, int port) {
  int fd = chorus__net_listen(host[0] ? host : NULL, port, 1, NULL);
  if (fd < 0) return 0;
  close(fd);
  return 1;
}

/* The endpoint kept answering, but not as this job's store: the message,
 * naming the port's owner when it is on this machine.  Returns the exit
 * code. */
static int wrong_endpoint(const char *host, int port, int rc, const char *err) {
  char owner[200] = "";
  int local = chorus__net_is_local(host);
  int held = local ? chorus__net_port_owner(port, owner, sizeof owner) : 0;
  char who[260];
  if (held > 0)
    snprintf(who, sizeof who, "port %d on this machine is held by %s", port, owner);
  else if (local)
    snprintf(who, sizeof who, "no listener on port %d is visible here any more", port);
  else
    snprintf(who, sizeof who, "look on %s for what listens on port %d", host, port);
  if (rc == -2)
    fprintf(stderr,
            "chorusrun: the rendezvous store at %s:%d refused this node for %.0f s: %s.  Every "
            "node of a job needs the same CHORUS_JOB_SECRET (or CHORUS_JOB_SECRET_FILE "
            "contents) and --rdzv-id; another job may be using this endpoint (%s).\n",
            host, port, WRONG_ANSWER_MS / 1e3, err, who);
  else
    fprintf(stderr,
            "chorusrun: the rendezvous endpoint %s:%d accepts connections but is not a chorus "
            "store (%.0f s of wrong answers: %s): %s.  Stop it, or give every node another "
            "--rdzv-endpoint port.\n",
            host, port, WRONG_ANSWER_MS / 1e3, err, who);
  return EXIT_LAUNCHER;
}

int rdzv_open(job_t *job, const chorus__key_t *key) {
  rdzv_t *rz = calloc(1, sizeof *rz);
  if (!rz) {
    fprintf(stderr, "chorusrun: out of memory\n");
    return EXIT_LAUNCHER;
  }
  job->rz = rz;
  job->round = -1;
  snprintf(rz->io.pfx, sizeof rz->io.pfx, "rdzv/%s/", job->run_id);
  rz->io.peers = rz->peers;
  rz->io.peer_cap = (int)CHORUS__ARRAY_LEN(rz->peers);
  int64_t lost_ns = LOST_BEATS * job->heartbeat_ns;
  /* Our store is one process: no answer for 4 heartbeats means it is gone.
   * etcd elects a new leader when one dies (a second or two without
   * answers), so give it longer before giving up on it.  A large group's
   * slower plan stretches both (rdzv__use_plan). */
  rz->svc_lost_base = job->backend == BACKEND_ETCD ? CHORUS__MAX(lost_ns, 10000000000LL) : 0;
  rdzv__use_plan(job, 1);
  rz->io.key = key;
  const char *host = job->rdzv_host;
  int port = job->rdzv_port;
  int call_ms = (int)CHORUS__MAX(lost_ns / 1000000, 200);
  char err[700] = "";
  int etcd = job->backend == BACKEND_ETCD;

  /* Who hosts the store: static node 0; for c10d the agent on the node the
   * endpoint names (if two agents share that machine, the second finds the
   * port taken and joins as a client).  With etcd nobody: etcd keeps the
   * rendezvous, and once a round is frozen group rank 0 serves that round's
   * workers a store (round_store). */
  int want_host = etcd ? 0
                  : job->backend == BACKEND_STATIC ? job->node_rank_opt == 0
                                                   : chorus__net_is_local(host);
  /* The store listens where the other nodes reach it, no wider: on the
   * endpoint's address (loopback when it names loopback; every interface
   * only when it is 0.0.0.0 or a name that resolves elsewhere too). */
  char bind_host[64] = "";
  if (want_host) {
    chorus__net_bind_addr(host, bind_host, sizeof bind_host);
    chorus_result_t src = start_store(bind_host[0] ? bind_host : NULL, port, key, &rz->srv);
    if (src != CHORUS_OK) {
      if (job->backend == BACKEND_STATIC) {
        char owner[200];
        int held = chorus__net_port_owner(port, owner, sizeof owner);
        fprintf(stderr,
                "chorusrun: node 0 cannot start the store on %s:%d: %s; %s%s (another job, or a "
                "leftover chorusrun; try another --master-port)\n",
                bind_host[0] ? bind_host : "*", port, chorus_strerror(src),
                held > 0 ? "the port is held by " : "is the port in use?", held > 0 ? owner : "");
        return EXIT_LAUNCHER;
      }
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "port %d taken on this machine; joining as a client", port);
      rz->srv = NULL;
    } else {
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "hosting the rendezvous store on %s:%d",
                  bind_host[0] ? bind_host : "*", port);
    }
  }

  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  /* Something that accepts connections on the endpoint but does not answer
   * as this job's store (a squatter on the port: garbage, silence, closing
   * at once, or a store that refuses our key) is not worth the join
   * timeout: after WRONG_ANSWER_MS of nothing but such answers, give up
   * and say who holds the port.  The grace lets a previous job's store on
   * the same port finish shutting down; a refused connection (the store
   * is not up yet) starts it over. */
  int64_t wrong_since = 0;
  int wrong_tries = 0;
  for (;;) {
    int attempt = CHORUS__MIN(CHORUS__MAX(chorus__ms_left(deadline), 1), etcd ? 2000 : 1000);
    int rc = etcd ? kv_etcd_open(host, "/chorus/", attempt, call_ms, &job->etcd, &rz->io.kv, err,
                                 sizeof err)
                  : kv_store_open(host, port, key, attempt, call_ms, &rz->io.kv, err, sizeof err);
    if (rc == 0) break;
    if (rc == -2 && etcd) {
      fprintf(stderr, "chorusrun: %s\n", err);
      return EXIT_LAUNCHER;
    }
    if (rc == -2 || rc == -3) {
      if (!wrong_since) wrong_since = chorus__now_ns();
      wrong_tries++;
      if (chorus__now_ns() - wrong_since >= (int64_t)WRONG_ANSWER_MS * 1000000 &&
          wrong_tries >= 3)
        return wrong_endpoint(host, port, rc, err);
    } else {
      wrong_since = 0;
      wrong_tries = 0;
    }
    /* We were to host the store and the port was taken: whoever held it
     * may have left (a previous job's store shut down, a squatter gave
     * up); then we host after all, or nobody would. */
    if (want_host && !rz->srv && port_free(bind_host, port) &&
        start_store(bind_host[0] ? bind_host : NULL, port, key, &rz->srv) == CHORUS_OK) {
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "port %d free again: hosting the rendezvous store", port);
      wrong_since = 0;
      wrong_tries = 0;
      continue;
    }
    /* A refused etcd fails at once; our store's client retries within its
     * attempt; a wrong answer may come at once too. */
    rdzv__sleep_or_signal(job, etcd ? 100 : rc < -1 ? 500 : 0);
    if (job->got_sig) return 128 + job->got_sig;
    if (chorus__ms_left(deadline) == 0) {
      if (etcd)
        fprintf(stderr, "chorusrun: no etcd at %s after %.0f s (join_timeout): %s\n", host,
                job->join_timeout_ns / 1e9, err);
      else
        fprintf(stderr,
                "chorusrun: no rendezvous store at %s:%d after %.0f s (join_timeout): %s.  The "
                "endpoint must name one of the job's nodes (its agent hosts the store%s), "
                "reachable from this one.\n",
                host, port, job->join_timeout_ns / 1e9, err,
                job->backend == BACKEND_STATIC ? ": node 0" : "");
      return EXIT_LAUNCHER;
    }
  }
  rz->io.last_ok = chorus__now_ns();
  char addr[64] = "node"; /* numeric: an IPv6 address takes 45 at most */
  if (rz->io.kv->ops->local_addr(rz->io.kv, addr, sizeof addr) != 0) snprintf(addr, sizeof addr, "node");
  snprintf(rz->io.id, sizeof rz->io.id, "%s/%d", addr, (int)getpid());
  if (!rdzv_id_ok(rz->io.id, ID_MAX)) snprintf(rz->io.id, sizeof rz->io.id, "node/%d", (int)getpid());
  job->master_addr = host;
  job->port = port;
  CHORUS_INFO(CHORUS__SUB_LAUNCH, "node %s: rendezvous %s at %s (run %s)", rz->io.id,
              job->backend == BACKEND_STATIC ? "static"
              : job->backend == BACKEND_ETCD ? "etcd"
                                             : "c10d",
              rz->io.kv->where, job->run_id);
  return 0;
}

/* ------------------------------------------------------------- leaving */

/* The other nodes of the state that have neither left nor been lost, or
 * -1 when the state could not be read. */
static int others_here(rdzv_t *rz) {
  if (rdzv__read_state(rz) != 1) return -1;
  int here = 0;
  const rstate_t *s = &rz->st;
  const rnode_t *lists[] = {s->mem, s->wait, s->exp};
  const int counts[] = {s->nmem, s->nwait, s->nexp};
  for (int l = 0; l < 3; l++)
    for (int i = 0; i < counts[l]; i++) {
      if (!strcmp(lists[l][i].id, rz->io.id)) continue;
      peer_t *p = rdzv__observe(&rz->io, lists[l][i].id);
      if (p && !p->done && !rdzv__peer_lost(&rz->io, p)) here++;
    }
  return here;
}

/* The store's host stays until every other node of the job has left (or is
 * lost), so nobody loses the store while it still needs it; bounded by
 * `deadline` and by heartbeats.  Returns others_here() at the end (-1
 * without asking when we host no store and nothing is to be cleaned up). */
static int linger(job_t *job, int64_t deadline) {
  rdzv_t *rz = job->rz;
  if (!rz->srv && !rz->round_srv) return rz->io.kv->ops->del_prefix ? others_here(rz) : -1;
  for (;;) {
    int waiting = others_here(rz);
    if (waiting < 0) return waiting;
    const rstate_t *s = &rz->st;
    if (!waiting || chorus__now_ns() >= deadline || job->got_sig) {
      if (s->phase != PH_CLOSED && !waiting) {
        rz->nx = *s;
        rz->nx.phase = PH_CLOSED;
        rz->nx.exit_code = 0;
        rdzv_set_reason(&rz->nx, "the job finished");
        rdzv__write_state(rz);
      }
      return waiting;
    }
    rdzv__sleep_or_signal(job, (int)(job->monitor_ns / 1000000));
  }
}

/* The last node to leave removes what the job wrote to a service that
 * outlives it (etcd): its state, heartbeats, failure records, store
 * addresses.  Several may think they are last; deleting twice is
 * harmless.  A node killed outright leaves its keys until the others are
 * gone too, and a job whose every agent was killed leaves all of them
 * (etcdctl del --prefix /chorus/rdzv/<run id>/ removes them). */
static void clean_up(rdzv_t *rz, int others) {
  if (others != 0 || !rz->io.kv->ops->del_prefix) return;
  if (rz->io.kv->ops->del_prefix(rz->io.kv, rz->io.pfx) == 0)
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "the last node to leave: removed %s at %s", rz->io.pfx,
                rz->io.kv->where);
  else
    CHORUS_WARN(CHORUS__SUB_LAUNCH, "could not remove the job's keys %s: %s", rz->io.pfx, rz->io.kv->err);
}

int rdzv_finish(job_t *job, int exit_code) {
  rdzv_t *rz = job->rz;
  rdzv__beat(&rz->io, 1, exit_code);
  if (rz->srv || rz->round_srv)
    CHORUS_INFO(CHORUS__SUB_LAUNCH,
                "our workers finished; serving the store until the other nodes leave");
  clean_up(rz, linger(job, CHORUS__NO_DEADLINE));
  return exit_code;
}

void rdzv_close(job_t *job, int exit_code) {
  rdzv_t *rz = job->rz;
  if (!rz) return;
  if (rz->io.kv && !rz->dead) {
    int was_left = rz->io.left;
    if (!was_left) rdzv__beat(&rz->io, 1, exit_code);
    int others = linger(job, chorus__now_ns() + job->close_timeout_ns);
    if (!was_left) clean_up(rz, others); /* rdzv_finish did, when it was called */
    rz->io.kv->ops->close(rz->io.kv);
  }
  rdzv__round_store_stop(rz);
  if (rz->srv) chorus_store_server_stop(rz->srv);
  free(rz->raw);
  free(rz);
  job->rz = NULL;
}
