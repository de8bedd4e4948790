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
  int64_t next = CHORUS__MIN(rz->next_hb, rz->next_mon);
  return chorus__ms_left(next);
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
  if (rdzv__record_failure(rz, job->round, &f, &rec) != 0) rec = f;
  rdzv__advance(job, 1, p->id, rec.code, rec.what);
}

/* --elastic inplace: nodes that wait are admitted into the running round
 * by the first member still there in this agent's view (group rank 0 unless
 * it was lost or left; two agents that both think so race on the state's
 * compare-and-set, and one wins): they take the next group ranks, their
 * workers join the running job (chorus_comm_join) and the running workers
 * take them in (chorus_comm_grow).  Every agent watches the grown group's
 * heartbeats. */
static void admit_in_place(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  int first = -1;
  for (int i = 0; i < rz->ngroup && first < 0; i++) {
    if (!strcmp(rz->group[i].id, rz->id)) first = i;
    const peer_t *p = NULL;
    for (int k = 0; k < rz->npeers && !p; k++)
      if (!strcmp(rz->peers[k].id, rz->group[i].id)) p = &rz->peers[k];
    if (first < 0 && p && !p->gone && !p->done) first = i;
  }
  int admitter = first >= 0 && !strcmp(rz->group[first].id, rz->id);
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
    for (int i = rz->ngroup; i < s->nmem; i++) rdzv__peer(rz, s->mem[i].id)->seen = now;
    rz->ngroup = s->nmem;
    memcpy(rz->group, s->mem, sizeof s->mem[0] * (size_t)s->nmem);
  }
}

rdzv_event_t rdzv_poll(job_t *job) {
  rdzv_t *rz = job->rz;
  if (rz->dead) return RDZV_EV_NONE;
  int64_t now = chorus__now_ns();
  /* One unanswered call ends this poll: each may take a call timeout, and
   * the loop has workers to watch. */
  if (now >= rz->next_hb) {
    rz->next_hb = now + job->heartbeat_ns;
    int64_t blind = now - rz->last_ok; /* since we last heard the service */
    if (!rz->left && rdzv__beat(rz, 0, 0) < 0) goto check;
    if (blind > 2 * job->heartbeat_ns) {
      /* We could not see the others' heartbeats for a while (etcd electing
       * a leader, say): that silence was ours, not theirs. */
      for (int i = 0; i < rz->ngroup; i++) rdzv__peer(rz, rz->group[i].id)->seen = now;
    }
    for (int i = 0; i < rz->ngroup; i++) {
      if (!strcmp(rz->group[i].id, rz->id)) continue;
      peer_t *p = rdzv__observe(rz, rz->group[i].id);
      if (!p) goto check;
      if (rdzv__peer_lost(rz, p) && job->inplace) {
        /* Its workers' peers shrink their communicators and go on. */
        if (!p->gone)
          fprintf(stderr, "chorusrun: node %d (%s) was lost: no heartbeat for %.1f s; the "
                  "workers of the other nodes go on without it (--elastic inplace)\n",
                  rdzv_find(rz->group, rz->ngroup, p->id), p->id, (now - p->seen) / 1e9);
        p->gone = 1;
      } else if (rdzv__peer_lost(rz, p)) {
        lost_node(job, p);
        return RDZV_EV_NEW_ROUND;
      }
    }
  }
  if (now >= rz->next_mon) {
    rz->next_mon = now + job->monitor_ns;
    int rc = rdzv__read_state(rz);
    if (rc == 1) {
      const rstate_t *s = &rz->st;
      if (s->phase == PH_CLOSED) return RDZV_EV_CLOSED;
      if (s->round != job->round) return RDZV_EV_NEW_ROUND;
      if (job->inplace && s->phase == PH_FROZEN) admit_in_place(job);
      if (s->phase == PH_FROZEN && s->nwait > 0 && s->nmem < s->max && job->node_rank == 0 &&
          !job->inplace) {
        char why[REASON_MAX];
        snprintf(why, sizeof why, "%d node(s) waiting to join (scale-up)", s->nwait);
        rdzv__advance(job, 0, NULL, 0, why);
        return RDZV_EV_NEW_ROUND;
      }
    } else if (rc == -2) {
      rdzv__say_state_error(rz, rc);
      rz->dead = 1;
      return RDZV_EV_STORE_LOST;
    }
  }
check:
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
  snprintf(f.node, sizeof f.node, "%s", rz->id);
  if (w) {
    int st = w->status;
    f.rank = w->rank;
    if (WIFSIGNALED(st)) {
      snprintf(f.kind, sizeof f.kind, "signal");
      f.code = 128 + WTERMSIG(st);
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) was killed by %s", w->rank,
               job->node_rank, rz->id, (int)w->pid, signal_name(WTERMSIG(st)));
    } else {
      snprintf(f.kind, sizeof f.kind, "exit");
      f.code = WIFEXITED(st) ? WEXITSTATUS(st) : EXIT_LAUNCHER;
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) exited with code %d",
               w->rank, job->node_rank, rz->id, (int)w->pid, f.code);
    }
    /* Its last lines, oldest first. */
    for (int i = 0; i < w->tail_count; i++)
      if (tail_line(w, i)) rdzv_one_line(f.tail[f.ntail++], TAIL_LINE_MAX, tail_line(w, i));
  } else {
    snprintf(f.kind, sizeof f.kind, "error");
    f.code = EXIT_LAUNCHER;
    f.rank = -1;
    snprintf(f.what, sizeof f.what, "node %d (%s): %s", job->node_rank, rz->id, why);
  }
  if (rdzv__record_failure(rz, job->round, &f, &rec) != 0) rec = f;
  rdzv__advance(job, 1, NULL, rec.code, rec.what);
}

int rdzv_after_failure(job_t *job, rdzv_event_t ev) {
  rdzv_t *rz = job->rz;
  if (ev == RDZV_EV_STORE_LOST) {
    fprintf(stderr,
            "chorusrun: lost the rendezvous store at %s (no answer for %.1f s: %s); the node "
            "hosting it (the --rdzv-endpoint node) died or is unreachable, and the job cannot "
            "go on without it\n",
            rz->kv->where, (chorus__now_ns() - rz->last_ok) / 1e9, rz->kv->err);
    return EXIT_LAUNCHER;
  }
  /* The state as it is now (the move to the next round may still be on its
   * way from the node that saw the failure). */
  int64_t until = chorus__now_ns() + rz->lost_ns;
  int rc;
  while ((rc = rdzv__read_state(rz)) == 1 && rz->st.round == job->round &&
         rz->st.phase == PH_FROZEN && chorus__now_ns() < until)
    rdzv__sleep_or_signal(job, JOIN_POLL_MS);
  if (rc != 1) {
    fprintf(stderr, "chorusrun: lost the rendezvous store at %s: %s\n", rz->kv->where,
            rc == -2 ? rz->kv->err : "no answer");
    return EXIT_LAUNCHER;
  }
  char key[300], *val = NULL;
  rdzv__key_of(rz, key, sizeof key, "fail/%ld", job->round);
  fail_t f;
  if (rdzv__kget(rz, key, &val, NULL) == 1 && rdzv_fail_parse(val, &f) == 0) {
    fprintf(stderr, "chorusrun: root cause of round %ld: %s\n", job->round, f.what);
    if (strcmp(f.node, rz->id) != 0 && f.ntail) {
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
