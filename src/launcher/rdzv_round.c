/*
 * rdzv_round.c - the rendezvous's rounds: joining one and waiting until it
 * is frozen (the last call, the freeze, this node's placement), the
 * workers' store of an etcd round, and opening the next round or closing
 * the job (no restarts left, or a node interrupted).  The protocol is
 * described at the top of rdzv.c.
 */
#include "launcher/rdzv.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* ------------------------------------------------------------- rounds */

/* Builds in rz->nx the round after rz->st: the frozen round's nodes become
 * `prev`, its survivors (not lost, not done) and the waiting nodes are
 * expected. */
static void next_round(rdzv_t *rz, int failure, const char *lost) {
  const rstate_t *s = &rz->st;
  rstate_t *n = &rz->nx;
  *n = *s;
  n->round = s->round + 1;
  n->phase = PH_JOIN;
  n->restarts = s->restarts + (failure ? 1 : 0);
  n->nprev = n->nexp = n->nmem = n->nwait = 0;
  for (int i = 0; i < s->nmem; i++) {
    n->prev[n->nprev] = s->mem[i];
    n->prev[n->nprev++].want = i;
    peer_t *p = rdzv__peer(&rz->io, s->mem[i].id);
    if ((lost && !strcmp(lost, s->mem[i].id)) || p->done || rdzv__peer_lost(&rz->io, p)) continue;
    n->exp[n->nexp++] = s->mem[i];
  }
  for (int i = 0; i < s->nwait && n->nexp < MAX_NODES; i++) n->exp[n->nexp++] = s->wait[i];
}

/* Opens the round after our frozen one, or closes the job when a failure
 * finds no restarts left or a node of the round already finished.  The
 * reason goes into the state.  Stops when someone else moved the state on
 * first. */
void rdzv__advance(job_t *job, int failure, const char *lost, int exit_code, const char *reason) {
  rdzv_t *rz = job->rz;
  for (int tries = 0; tries < 100; tries++) {
    if (rdzv__read_state(rz) != 1) return;
    if (rz->st.round != job->round || rz->st.phase != PH_FROZEN) return;
    const char *finished = NULL;
    if (failure)
      for (int i = 0; i < rz->st.nmem && !finished; i++) {
        peer_t *p = strcmp(rz->st.mem[i].id, rz->io.id) ? rdzv__observe(&rz->io, rz->st.mem[i].id) : NULL;
        if (p && p->done && p->exit_code == 0) finished = p->id;
      }
    if (failure && (rz->st.restarts >= rz->st.max_restarts || finished)) {
      rz->nx = rz->st;
      rz->nx.phase = PH_CLOSED;
      rz->nx.exit_code = exit_code;
      if (finished)
        rdzv_set_reason(&rz->nx, "%s; node %s had already finished, so the group cannot re-form",
                   reason, finished);
      else
        rdzv_set_reason(&rz->nx, "%s; no restarts left (--max-restarts %d)", reason,
                   rz->st.max_restarts);
    } else {
      next_round(rz, failure, lost);
      rdzv_set_reason(&rz->nx, "%s", reason);
    }
    if (rdzv__write_state(rz) != 0) return;
  }
}

void rdzv_interrupt(job_t *job, int sig) {
  rdzv_t *rz = job->rz;
  for (int tries = 0; tries < 100; tries++) {
    if (rdzv__read_state(rz) != 1 || rz->st.phase == PH_CLOSED) break;
    rz->nx = rz->st;
    rz->nx.phase = PH_CLOSED;
    rz->nx.exit_code = 128 + sig;
    rdzv_set_reason(&rz->nx, "node %s got %s", rz->io.id, signal_name(sig));
    if (rdzv__write_state(rz) != 0) break;
  }
}

/* Our group's placement from the frozen state. */
static void take_placement(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  int me = rdzv_find(s->mem, s->nmem, rz->io.id);
  job->round = s->round;
  job->restarts = s->restarts;
  job->nnodes = s->nmem;
  job->node_rank = me;
  job->rank_base = 0;
  job->world_size = 0;
  for (int i = 0; i < s->nmem; i++) {
    if (i < me) job->rank_base += s->mem[i].nproc;
    job->world_size += s->mem[i].nproc;
  }
  rz->ngroup = s->nmem;
  memcpy(rz->group, s->mem, sizeof s->mem[0] * (size_t)s->nmem);
  rdzv__use_plan(job, s->nmem);
  int64_t now = chorus__now_ns();
  for (int i = 0; i < s->nmem; i++) {
    peer_t *p = rdzv__peer(&rz->io, s->mem[i].id);
    p->seen = now; /* a long rendezvous is not silence */
  }
  for (int r = 0; r < job->nproc; r++) job->w[r].rank = job->rank_base + r;
  /* The rendezvous store this agent serves (c10d) holds every agent and
   * every worker (etcd's workers' store: round_store). */
  char why[700];
  if (rz->srv &&
      chorus__store_server_expect(rz->srv, job->world_size + s->nmem, why, sizeof why) != CHORUS_OK)
    CHORUS_WARN(CHORUS__SUB_LAUNCH, "chorusrun: %s; the group will fail to form", why);
  /* CHORUS_NODE_SIZES: runs of equal counts, "8x3,6". */
  free(job->node_sizes);
  size_t cap = 24 * (size_t)s->nmem + 1, at = 0;
  job->node_sizes = xmalloc(cap);
  job->node_sizes[0] = '\0';
  for (int i = 0; i < s->nmem;) {
    int j = i;
    while (j < s->nmem && s->mem[j].nproc == s->mem[i].nproc) j++;
    at += (size_t)snprintf(job->node_sizes + at, cap - at, j - i > 1 ? "%s%dx%d" : "%s%d",
                           i ? "," : "", s->mem[i].nproc, j - i);
    i = j;
  }
}

/* Freezes the round in rz->st: orders the members by group rank. */
static int freeze(job_t *job) {
  rdzv_t *rz = job->rz;
  rz->nx = rz->st;
  rz->nx.phase = PH_FROZEN;
  if (rdzv_rank_order(&rz->st, job->backend == BACKEND_STATIC, &rz->nx) != 0) return -1;
  return rdzv__write_state(rz);
}

/* ------------------------------------------------------- the round's store */

/* etcd: the workers need a chorus store of their own.  Group rank 0's agent
 * starts one for the round (any free port) and publishes "<address> <port>"
 * under store/<round>; the others read it.  It lives until that agent
 * leaves or joins the next round.  0, or an exit code after a message. */
static int round_store(job_t *job) {
  rdzv_t *rz = job->rz;
  char key[300];
  rdzv__key_of(&rz->io, key, sizeof key, "store/%ld", job->round);
  if (job->node_rank == 0) {
    char addr[128], val[200];
    if (rz->io.kv->ops->local_addr(rz->io.kv, addr, sizeof addr) != 0) {
      fprintf(stderr, "chorusrun: cannot tell this node's address for the workers' store\n");
      return EXIT_LAUNCHER;
    }
    /* On the address published, the one this node reaches etcd from. */
    chorus_result_t src = start_store(addr, 0, rz->io.key, &rz->round_srv);
    if (src != CHORUS_OK) {
      fprintf(stderr, "chorusrun: cannot start the workers' store: %s\n", chorus_strerror(src));
      return EXIT_LAUNCHER;
    }
    char why[700];
    if (chorus__store_server_expect(rz->round_srv, job->world_size, why, sizeof why) != CHORUS_OK) {
      fprintf(stderr, "chorusrun: %s\n", why);
      return EXIT_LAUNCHER;
    }
    snprintf(val, sizeof val, "%s %d", addr, chorus_store_server_port(rz->round_srv));
    if (rdzv__kset(&rz->io, key, val) < 0) {
      fprintf(stderr, "chorusrun: cannot publish the workers' store: %s\n", rz->io.kv->err);
      return EXIT_LAUNCHER;
    }
  }
  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  for (;;) {
    char *val = NULL;
    int rc = rdzv__kget(&rz->io, key, &val, NULL);
    if (rc == 1) {
      char host[128];
      int port = 0;
      int good = sscanf(val, "%127s %d", host, &port) == 2 && port > 0 && port < 65536 &&
                 rdzv_id_ok(host, sizeof host);
      free(val);
      if (!good) {
        fprintf(stderr, "chorusrun: the workers' store address under %s is malformed\n", key);
        return EXIT_LAUNCHER;
      }
      snprintf(rz->store_host, sizeof rz->store_host, "%s", host);
      job->master_addr = rz->store_host;
      job->port = port;
      return 0;
    }
    if (rc == -2 || (rc < 0 && rdzv__lost_store(rz)) || chorus__now_ns() >= deadline) {
      fprintf(stderr, "chorusrun: node 0 of round %ld never published the workers' store (%s)\n",
              job->round, rc < 0 ? rz->io.kv->err : "join_timeout");
      return EXIT_LAUNCHER;
    }
    if (job->got_sig) return 128 + job->got_sig;
    rdzv__sleep_or_signal(job, JOIN_POLL_MS);
  }
}

void rdzv__round_store_stop(rdzv_t *rz) {
  if (rz->round_srv) chorus_store_server_stop(rz->round_srv);
  rz->round_srv = NULL;
}

/* ------------------------------------------------------------- joining */

/* Adds this node to the state's member list (or, after the freeze, its wait
 * list); the caller checked there is room.  A lost race is retried by the
 * caller's loop. */
static void add_self(job_t *job, int waiting) {
  rdzv_t *rz = job->rz;
  rz->nx = rz->st;
  rnode_t *list = waiting ? rz->nx.wait : rz->nx.mem;
  int *n = waiting ? &rz->nx.nwait : &rz->nx.nmem;
  rnode_t *me = &list[(*n)++];
  *me = (rnode_t){.nproc = job->nproc, .want = job->node_rank_opt};
  snprintf(me->id, sizeof me->id, "%s", rz->io.id);
  rdzv__write_state(rz);
}

int rdzv_join(job_t *job) {
  rdzv_t *rz = job->rz;
  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  int64_t last_call = CHORUS__NO_DEADLINE;
  int said_waiting = 0;
  long waited_in = -1; /* the frozen round this node waits to enter */
  rz->io.left = 0;
  job->joining = 0;
  rdzv__round_store_stop(rz); /* the last round's workers are gone */
  for (;;) {
    if (job->got_sig) {
      rdzv_interrupt(job, job->got_sig);
      return 128 + job->got_sig;
    }
    int64_t now = chorus__now_ns();
    if (now >= rz->next_hb) {
      rdzv__beat(&rz->io, 0, 0);
      rz->next_hb = now + rz->plan.beat_ns;
    }
    int rc = rdzv__read_state(rz);
    if (rc == -2) {
      rdzv__say_state_error(rz, rc);
      return EXIT_LAUNCHER;
    }
    if (rc < 0) {
      if (rdzv__lost_store(rz)) {
        fprintf(stderr,
                "chorusrun: the rendezvous store at %s stopped answering during the "
                "rendezvous (%s); the node hosting it may be down\n",
                rz->io.kv->where, rz->io.kv->err);
        return EXIT_LAUNCHER;
      }
      rdzv__sleep_or_signal(job, JOIN_POLL_MS);
      continue;
    }
    rstate_t *s = &rz->st;
    /* A large round beats as slowly as the group it will be. */
    if (rc == 1 && s->nmem > rz->plan.nodes) rdzv__use_plan(job, s->nmem);
    if (rc == 0) {
      /* The first agent creates round 0. */
      rstate_t *n = &rz->nx;
      memset(n, 0, offsetof(rstate_t, prev));
      n->nprev = n->nexp = n->nmem = n->nwait = 0;
      n->phase = PH_JOIN;
      n->min = job->min_nodes;
      n->max = job->max_nodes;
      n->max_restarts = job->max_restarts;
      rdzv_set_reason(n, "first round");
      free(rz->raw);
      rz->raw = NULL;
      rdzv__write_state(rz);
      continue;
    }
    if (s->min != job->min_nodes || s->max != job->max_nodes) {
      fprintf(stderr,
              "chorusrun: this node was started with --nnodes %d:%d, but run '%s' was started "
              "with --nnodes %d:%d by the first node that joined; give every node the same "
              "--nnodes (or use another --rdzv-id)\n",
              job->min_nodes, job->max_nodes, job->run_id, s->min, s->max);
      return EXIT_USAGE;
    }
    int me = rdzv_find(s->mem, s->nmem, rz->io.id);
    if (s->phase == PH_CLOSED) {
      fprintf(stderr, "chorusrun: run '%s' is over (%s); start a new job with another --rdzv-id\n",
              job->run_id, s->reason[0] ? s->reason : "closed");
      return s->exit_code ? s->exit_code : EXIT_LAUNCHER;
    }
    if (s->phase == PH_FROZEN) {
      if (me >= 0 && s->round > job->round) {
        /* In place, group rank 0 admits waiting nodes into the running
         * round: their workers join the running job. */
        job->joining = job->inplace && s->round == waited_in;
        take_placement(job);
        CHORUS_INFO(CHORUS__SUB_LAUNCH, "round %ld frozen: node %d of %d, ranks %d..%d of %d",
                    s->round, job->node_rank, job->nnodes, job->rank_base,
                    job->rank_base + job->nproc - 1, job->world_size);
        return job->backend == BACKEND_ETCD ? round_store(job) : 0;
      }
      if (me >= 0) {
        /* The round we ran is still the current one (our move to the next
         * one did not reach the store): move it now. */
        rdzv__advance(job, 0, NULL, 0, "a node rejoins");
        continue;
      }
      if (rdzv_find(s->wait, s->nwait, rz->io.id) < 0 && s->nwait < MAX_NODES) {
        add_self(job, 1);
        waited_in = s->round;
        continue;
      }
      if (!said_waiting) {
        fprintf(stderr,
                "chorusrun: run '%s' is running with %d node(s) (at most %d); waiting to be "
                "admitted %s\n", job->run_id, s->nmem, s->max,
                job->inplace ? "into it (--elastic inplace)" : "when the group re-forms");
        said_waiting = 1;
      }
    } else if (me < 0) {
      if (job->backend == BACKEND_STATIC) {
        for (int i = 0; i < s->nmem; i++)
          if (s->mem[i].want == job->node_rank_opt) {
            fprintf(stderr,
                    "chorusrun: --node-rank %d is taken by node %s in run '%s'; give each node "
                    "its own --node-rank in 0..%d\n",
                    job->node_rank_opt, s->mem[i].id, job->run_id, job->max_nodes - 1);
            return EXIT_USAGE;
          }
      }
      if (s->nmem < s->max) {
        add_self(job, 0);
        continue;
      }
    } else {
      if (s->nmem >= s->max || (s->nmem >= s->min && rdzv_all_expected_in(s))) {
        freeze(job);
        continue;
      }
      if (s->nmem >= s->min && job->backend != BACKEND_STATIC) {
        if (last_call == CHORUS__NO_DEADLINE) last_call = now + job->last_call_ns;
        else if (now >= last_call) {
          freeze(job);
          continue;
        }
      }
    }
    if (now >= deadline) {
      fprintf(stderr,
              "chorusrun: the rendezvous of run '%s' timed out after %.0f s (join_timeout): "
              "%d node(s) joined round %ld, %d needed%s\n",
              job->run_id, job->join_timeout_ns / 1e9, s->nmem, s->round, s->min,
              s->phase == PH_FROZEN ? " (this node was waiting for room in the running group)"
                                    : "");
      rdzv__beat(&rz->io, 1, EXIT_LAUNCHER);
      return EXIT_LAUNCHER;
    }
    rdzv__sleep_or_signal(job, JOIN_POLL_MS);
  }
}
