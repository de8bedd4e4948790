/*
 * rdzv_watch.c - a formed group at work: heartbeats written and watched,
 * lost nodes, waiting nodes admitted (scale-up, or --elastic inplace), a
 * failure recorded and the group re-formed or the job closed, and the root
 * cause printed.  The protocol is described at the top of rdzv.c.
 */
#include "launcher/rdzv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "util/clock.h"
#include "util/util.h"

/* ------------------------------------------------------------- running */

int rdzv_poll_ms(const job_t *job) {
  const rdzv_t *rz = job->rz;
  int64_t next = CHORUS__MIN(CHORUS__MIN(rz->next_hb, rz->next_read), rz->next_mon);
  return chorus__ms_left(next);
}

void rdzv__use_plan(job_t *job, int n) {
  rdzv_t *rz = job->rz;
  rdzv__hb_plan(job->heartbeat_ns, job->monitor_ns, n, &rz->plan);
  rz->io.lost_ns = rz->plan.lost_ns;
  /* Our calls come every read_ns at the longest: the service is lost when
   * it has not answered for as long as a node would be. */
  rz->svc_lost_ns = CHORUS__MAX(rz->svc_lost_base, rz->plan.lost_ns);
}

/* The failure record of a lost node. */
static void lost_node(job_t *job, const peer_t *p) {
  rdzv_t *rz = job->rz;
  fail_t f = {0}, rec;
  int g = rdzv_find(rz->group, rz->ngroup, p->id);
  snprintf(f.kind, sizeof f.kind, "lost");
  f.code = EXIT_LAUNCHER;
  f.grank = g;
  f.rank = -1;
  snprintf(f.node, sizeof f.node, "%s", p->id);
  snprintf(f.what, sizeof f.what, "node %d (%s) was lost: no heartbeat for %.1f s%s", g, p->id,
           (chorus__now_ns() - p->seen) / 1e9,
           p->replayed ? " (old heartbeats of it were replayed meanwhile, and ignored)" : "");
  fprintf(stderr, "chorusrun: %s\n", f.what);
  if (rdzv__record_failure(&rz->io, job->round, &f, &rec) != 0) rec = f;
  rdzv__advance(job, 1, p->id, rec.code, rec.what);
}

/* --elastic inplace: nodes that wait are admitted into the running round
 * by group rank 0, or, once it was lost or left, by the agents that know it
 * (those that watched it: two agents that both admit race on the state's
 * compare-and-set, and one wins; a node we do not watch counts as here):
 * they take the next group ranks, their workers join the running job
 * (chorus_comm_join) and the running workers take them in
 * (chorus_comm_grow).  The grown group's heartbeats are watched as the ring
 * now goes. */
static void admit_in_place(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  const peer_t *p0 = NULL;
  for (int k = 0; k < rz->io.npeers && !p0 && rz->ngroup > 0; k++)
    if (!strcmp(rz->io.peers[k].id, rz->group[0].id)) p0 = &rz->io.peers[k];
  int admitter = rz->ngroup > 0 && (!strcmp(rz->group[0].id, rz->io.id) ||
                                    (p0 && (p0->gone || p0->done)));
  if (admitter && s->nwait > 0 && s->nmem < s->max) {
    rz->nx = *s;
    int k = 0;
    while (k < s->nwait && rz->nx.nmem < s->max) rz->nx.mem[rz->nx.nmem++] = s->wait[k++];
    memmove(rz->nx.wait, s->wait + k, sizeof s->wait[0] * (size_t)(s->nwait - k));
    rz->nx.nwait = s->nwait - k;
    rdzv_set_reason(&rz->nx, "%d node(s) admitted into the running round (--elastic inplace)", k);
    if (rdzv__write_state(rz) == 1)
      fprintf(stderr, "chorusrun: %d node(s) admitted into the running job (--elastic "
              "inplace)\n", k);
    return; /* the others see it at their next read */
  }
  if (s->nmem > rz->ngroup) {
    int64_t now = chorus__now_ns();
    for (int i = rz->ngroup; i < s->nmem; i++) rdzv__peer(&rz->io, s->mem[i].id)->seen = now;
    rz->ngroup = s->nmem;
    memcpy(rz->group, s->mem, sizeof s->mem[0] * (size_t)s->nmem);
  }
}

/* Our heartbeat, and the nodes we watch: RDZV_EV_NEW_ROUND when one was
 * lost (recorded, the next round opened), -1 when the service did not
 * answer, else RDZV_EV_NONE. */
static int beat_and_watch(job_t *job, int64_t now) {
  rdzv_t *rz = job->rz;
  if (now >= rz->next_hb) {
    rz->next_hb = now + rz->plan.beat_ns;
    if (!rz->io.left && rdzv__beat(&rz->io, 0, 0) < 0) return -1;
  }
  if (now < rz->next_read) return RDZV_EV_NONE;
  rz->next_read = now + rz->plan.read_ns;
  int me = rdzv_find(rz->group, rz->ngroup, rz->io.id);
  peer_t *p = NULL;
  int rc = rdzv__hb_watch(&rz->io, &rz->plan, rz->group, rz->ngroup, me, job->inplace, now, &p);
  if (rc < 0) return -1;
  if (rc == 0) return RDZV_EV_NONE;
  if (job->inplace) {
    /* Its workers' peers shrink their communicators and go on; the next
     * node after it is watched instead. */
    fprintf(stderr, "chorusrun: node %d (%s) was lost: no heartbeat for %.1f s; the "
            "workers of the other nodes go on without it (--elastic inplace)\n",
            rdzv_find(rz->group, rz->ngroup, p->id), p->id, (now - p->seen) / 1e9);
    return RDZV_EV_NONE;
  }
  lost_node(job, p);
  return RDZV_EV_NEW_ROUND;
}

/* The state, when its fingerprint says it changed (or a full read is due):
 * the event it means, RDZV_EV_NONE, or -1 when the service did not answer. */
static int watch_state(job_t *job, int64_t now) {
  rdzv_t *rz = job->rz;
  rz->next_mon = now + rz->plan.mon_ns;
  int changed = 1;
  if (rz->raw && now < rz->next_full) changed = rdzv__gen_changed(&rz->io, rz->raw);
  if (changed < 0) return -1;
  if (!changed) return RDZV_EV_NONE;
  rz->next_full = now + rz->plan.full_ns;
  int rc = rdzv__read_state(rz);
  if (rc == -2) {
    rdzv__say_state_error(rz, rc);
    rz->dead = 1;
    return RDZV_EV_STORE_LOST;
  }
  if (rc != 1) return rc < 0 ? -1 : RDZV_EV_NONE;
  const rstate_t *s = &rz->st;
  if (s->phase == PH_CLOSED) return RDZV_EV_CLOSED;
  if (s->round != job->round) return RDZV_EV_NEW_ROUND;
  if (job->inplace && s->phase == PH_FROZEN) {
    admit_in_place(job);
    rdzv__use_plan(job, rz->ngroup);
  }
  if (s->phase == PH_FROZEN && s->nwait > 0 && s->nmem < s->max && job->node_rank == 0 &&
      !job->inplace) {
    char why[REASON_MAX];
    snprintf(why, sizeof why, "%d node(s) waiting to join (scale-up)", s->nwait);
    rdzv__advance(job, 0, NULL, 0, why);
    return RDZV_EV_NEW_ROUND;
  }
  return RDZV_EV_NONE;
}

rdzv_event_t rdzv_poll(job_t *job) {
  rdzv_t *rz = job->rz;
  if (rz->dead) return RDZV_EV_NONE;
  int64_t now = chorus__now_ns();
  /* One unanswered call ends this poll: each may take a call timeout, and
   * the loop has workers to watch. */
  int ev = beat_and_watch(job, now);
  if (ev > 0) return (rdzv_event_t)ev;
  if (ev == 0 && now >= rz->next_mon) {
    ev = watch_state(job, now);
    if (ev > 0) return (rdzv_event_t)ev;
  }
  if (rdzv__lost_store(rz)) {
    rz->dead = 1;
    return RDZV_EV_STORE_LOST;
  }
  return RDZV_EV_NONE;
}

void rdzv_failed(job_t *job, const worker_t *w, const char *why) {
  rdzv_t *rz = job->rz;
  fail_t f = {0}, rec;
  f.grank = job->node_rank;
  snprintf(f.node, sizeof f.node, "%s", rz->io.id);
  if (w) {
    int st = w->status;
    f.rank = w->rank;
    if (WIFSIGNALED(st)) {
      snprintf(f.kind, sizeof f.kind, "signal");
      f.code = 128 + WTERMSIG(st);
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) was killed by %s", w->rank,
               job->node_rank, rz->io.id, (int)w->pid, signal_name(WTERMSIG(st)));
    } else {
      snprintf(f.kind, sizeof f.kind, "exit");
      f.code = WIFEXITED(st) ? WEXITSTATUS(st) : EXIT_LAUNCHER;
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) exited with code %d",
               w->rank, job->node_rank, rz->io.id, (int)w->pid, f.code);
    }
    /* Its last lines, oldest first. */
    for (int i = 0; i < w->tail_count; i++)
      if (tail_line(w, i)) rdzv_one_line(f.tail[f.ntail++], TAIL_LINE_MAX, tail_line(w, i));
  } else {
    snprintf(f.kind, sizeof f.kind, "error");
    f.code = EXIT_LAUNCHER;
    f.rank = -1;
    snprintf(f.what, sizeof f.what, "node %d (%s): %s", job->node_rank, rz->io.id, why);
  }
  if (rdzv__record_failure(&rz->io, job->round, &f, &rec) != 0) rec = f;
  rdzv__advance(job, 1, NULL, rec.code, rec.what);
}

int rdzv_after_failure(job_t *job, rdzv_event_t ev) {
  rdzv_t *rz = job->rz;
  if (ev == RDZV_EV_STORE_LOST) {
    fprintf(stderr,
            "chorusrun: lost the rendezvous store at %s (no answer for %.1f s: %s); the node "
            "hosting it (the --rdzv-endpoint node) died or is unreachable, and the job cannot "
            "go on without it\n",
            rz->io.kv->where, (chorus__now_ns() - rz->io.last_ok) / 1e9, rz->io.kv->err);
    return EXIT_LAUNCHER;
  }
  /* The state as it is now (the move to the next round may still be on its
   * way from the node that saw the failure). */
  int64_t until = chorus__now_ns() + rz->io.lost_ns;
  int rc;
  while ((rc = rdzv__read_state(rz)) == 1 && rz->st.round == job->round &&
         rz->st.phase == PH_FROZEN && chorus__now_ns() < until)
    rdzv__sleep_or_signal(job, JOIN_POLL_MS);
  if (rc != 1) {
    fprintf(stderr, "chorusrun: lost the rendezvous store at %s: %s\n", rz->io.kv->where,
            rc == -2 ? rz->io.kv->err : "no answer");
    return EXIT_LAUNCHER;
  }
  char key[300], *val = NULL;
  rdzv__key_of(&rz->io, key, sizeof key, "fail/%ld", job->round);
  fail_t f;
  if (rdzv__kget(&rz->io, key, &val, NULL) == 1 && rdzv_fail_parse(val, &f) == 0) {
    fprintf(stderr, "chorusrun: root cause of round %ld: %s\n", job->round, f.what);
    if (strcmp(f.node, rz->io.id) != 0 && f.ntail) {
      fprintf(stderr, "chorusrun: its last %d line(s):\n", f.ntail);
      for (int i = 0; i < f.ntail; i++) fprintf(stderr, "  [rank%d]: %s\n", f.rank, f.tail[i]);
    }
  }
  free(val);
  if (rz->st.phase == PH_CLOSED) {
    fprintf(stderr, "chorusrun: the job ends: %s\n", rz->st.reason);
    return rz->st.exit_code ? rz->st.exit_code : EXIT_LAUNCHER;
  }
  if (rz->st.phase == PH_FROZEN && rz->st.round == job->round) {
    /* Nobody moved on (the node that failed could not reach the store):
     * open the next round ourselves. */
    rdzv__advance(job, 1, NULL, EXIT_LAUNCHER, "the group stopped");
  }
  fprintf(stderr, "chorusrun: the group re-forms (round %ld: %s)\n", job->round + 1,
          rz->st.reason[0] ? rz->st.reason : "restart");
  return -1;
}
