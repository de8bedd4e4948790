/*
 * agent.c - the agent: one generation of workers watched to its end and
 * the restart loop around generations.
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* How a generation ended: all succeeded, one of ours failed, we were
 * interrupted, we could not run it, or (several nodes) the rendezvous
 * stopped it. */
typedef enum { GEN_OK, GEN_FAILED, GEN_SIGNALED, GEN_ERROR, GEN_REMOTE } gen_outcome_t;

/* --------------------------------------------------------- process control */

static int failed_status(int st) { return !(WIFEXITED(st) && WEXITSTATUS(st) == 0); }

static int status_exit_code(int st) {
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return EXIT_LAUNCHER;
}

/* Sends sig to the process group of every worker still running, followed
 * by SIGCONT so that a stopped (SIGSTOP, Ctrl-Z) worker can act on it. */
static void signal_groups(job_t *job, int sig) {
  for (int r = 0; r < job->nproc; r++)
    if (job->w[r].running) {
      kill(-job->w[r].pid, sig);
      if (sig != SIGKILL) kill(-job->w[r].pid, SIGCONT);
    }
}

/* Reaps every exited child without blocking.  Returns the number of workers
 * reaped; *first_failed receives the index (local rank) of the failing
 * worker to blame if blame is still open (not stopping, none blamed yet).
 * Of the workers that failed in one pass, one killed by a signal is the
 * cause: the others exited because of it (a survivor that saw its peer's
 * connection close comes out of waitpid first when it is the older child,
 * and blaming it named a survivor over TCP). */
static int reap(job_t *job, int *first_failed, int blame_open) {
  int reaped = 0, cand = -1;
  for (;;) {
    int st;
    pid_t pid = waitpid(-1, &st, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) break; /* none ready, or ECHILD */
    worker_t *w = NULL;
    for (int r = 0; r < job->nproc && !w; r++)
      if (job->w[r].running && job->w[r].pid == pid) w = &job->w[r];
    if (!w) { /* the guard, or a descendant reparented to us (subreaper) */
      guard_reaped(pid);
      continue;
    }
    w->running = 0;
    w->status = st;
    reaped++;
    /* Whatever is left in its group dies with it.  The pid cannot have been
     * reused while that group still has members. */
    kill(-pid, SIGKILL);
    guard_send('-', pid);
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "rank %d (pid %d) exited with status 0x%x", w->rank,
                (int)pid, st);
    if (failed_status(st) && blame_open && *first_failed < 0 &&
        (cand < 0 || (WIFSIGNALED(st) && !WIFSIGNALED(job->w[cand].status))))
      cand = (int)(w - job->w);
  }
  if (cand >= 0) *first_failed = cand;
  return reaped;
}

/* A worker still running but stopped by job control (SIGSTOP, ^Z: state
 * T): when the others fail, they failed waiting for it (their timeout
 * names it).  Not state t, a tracing stop: LeakSanitizer stops a process
 * so while it exits, and a debugger's stop is left to named_worker.  Its
 * local index, or -1. */
static int stopped_worker(const job_t *job) {
  for (int r = 0; r < job->nproc; r++) {
    if (!job->w[r].running) continue;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)job->w[r].pid);
    FILE *f = fopen(path, "re");
    if (!f) continue;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')'); /* the name may hold spaces and ')' */
    if (paren && paren[1] == ' ' && paren[2] == 'T') return r;
  }
  return -1;
}

/* The rank the failed workers' own timeouts name ("... timed out after T
 * ms receiving from rank K", "... waiting for rank K in shared memory"): when
 * every failed worker that printed one names the same K, and K is a worker
 * of this node that failed only because chorusrun stopped the group, K is
 * the cause -- alive, but not taking part (busy in user code, or blocked
 * elsewhere).  Its local index, or -1. */
static int named_worker(const job_t *job) {
  int named = -1;
  for (int r = 0; r < job->nproc; r++) {
    const worker_t *w = &job->w[r];
    if (w->pid <= 0 || w->running || !WIFEXITED(w->status) || !failed_status(w->status))
      continue;
    int k = -1;
    for (int i = w->tail_count - 1; i >= 0 && k < 0; i--) {
      const char *line = tail_line(w, i);
      const char *t = line ? strstr(line, " timed out after ") : NULL;
      const char *q = t ? strstr(t, " ms ") : NULL;
      const char *n = q ? strstr(q, " rank ") : NULL;
      if (!n || sscanf(n, " rank %d", &k) != 1 || k < 0) k = -1;
    }
    if (k < 0) continue;
    if (named >= 0 && k != named) return -1; /* they disagree: no single cause */
    named = k;
  }
  for (int r = 0; named >= 0 && r < job->nproc; r++) {
    const worker_t *w = &job->w[r];
    if (w->rank == named)
      return WIFSIGNALED(w->status) && !w->running ? r : -1; /* we ended it */
  }
  return -1;
}

/* -------------------------------------------------------- one generation */

/* Starts stopping the group: SIGTERM now, SIGKILL after the grace period. */
static void stop_group(job_t *job, int *stopping, int64_t *kill_deadline) {
  if (*stopping) return;
  *stopping = 1;
  signal_groups(job, SIGTERM);
  *kill_deadline = chorus__now_ns() + job->grace_ns;
}

/* One generation's progress, shared by the steps of run_generation. */
typedef struct {
  int first_failed;    /* the local index blamed, or -1 */
  rdzv_event_t remote; /* what the rendezvous said */
  int stopping, killed, spawn_error;
  int64_t kill_deadline, abandon_deadline, drain_deadline;
  int running; /* workers still running, as last counted */
  struct pollfd *pfd;
  stream_t **owner_s;
  worker_t **owner_w;
} gen_t;

/* Clears the workers' last generation and starts each; a worker that
 * cannot start stops the others. */
static void start_workers(job_t *job, gen_t *g) {
  for (int r = 0; r < job->nproc; r++) {
    worker_t *w = &job->w[r];
    tail_clear(w);
    w->pid = 0;
    w->running = 0;
    w->reported = 0;
    w->blame_kind = w->blame_code = 0;
    w->st[0].fd = w->st[1].fd = -1;
  }
  for (int r = 0; r < job->nproc; r++) {
    int rc = spawn_worker(job, &job->w[r]);
    if (rc < 0) {
      fprintf(stderr, "chorusrun: cannot start rank %d: %s; stopping the others\n",
              job->w[r].rank, strerror(-rc));
      g->spawn_error = 1;
      stop_group(job, &g->stopping, &g->kill_deadline);
      if (job->rz) {
        char why[200];
        snprintf(why, sizeof why, "cannot start rank %d: %s", job->w[r].rank, strerror(-rc));
        rdzv_failed(job, NULL, why);
      }
      break;
    }
  }
}

/* Reaps the workers that exited; the first failure stops the group (in
 * place: each failure is reported and the others go on). */
static void watch_workers(job_t *job, gen_t *g) {
  int fresh_fail = g->first_failed < 0;
  reap(job, &g->first_failed, !g->stopping);
  if (job->inplace) {
    /* --elastic inplace: a failed worker is reported as it happens and
     * the others go on (they shrink their communicators). */
    for (int r = 0; r < job->nproc; r++) {
      worker_t *w = &job->w[r];
      if (w->pid > 0 && !w->running && !w->reported && failed_status(w->status)) {
        w->reported = 1;
        report_failure(job, w);
        fprintf(stderr, "chorusrun: the other workers go on (--elastic inplace)\n");
      }
    }
  } else if (fresh_fail && g->first_failed >= 0 && !g->stopping) {
    int st = job->w[g->first_failed].status, s = WIFEXITED(st) ? stopped_worker(job) : -1;
    if (s >= 0) {
      job->w[s].blame_kind = BLAME_STOPPED;
      job->w[s].blame_code = status_exit_code(st);
      g->first_failed = s;
    }
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "rank %d failed; stopping the group",
                job->w[g->first_failed].rank);
    stop_group(job, &g->stopping, &g->kill_deadline);
    if (job->rz) {
      /* Its last lines go into the job's failure record: read what its
       * pipes hold first. */
      stream_drain(job, &job->w[g->first_failed]);
      rdzv_failed(job, &job->w[g->first_failed], NULL);
    }
  }
}

/* Heartbeats go on while we stop (the others must not think us lost);
 * the rendezvous's news only matters while the group runs. */
static void watch_rdzv(job_t *job, gen_t *g) {
  rdzv_event_t e = rdzv_poll(job);
  if (e != RDZV_EV_NONE && !g->stopping) {
    g->remote = e;
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "the rendezvous stops the group (event %d)", (int)e);
    stop_group(job, &g->stopping, &g->kill_deadline);
  }
}

/* The end of the generation: once no worker runs, the pipes drain (bounded
 * by DRAIN_MS); a group that was stopped gets SIGKILL after the grace
 * period, and survivors of SIGKILL are given up after ABANDON_MS.  1 when
 * the generation is over. */
static int wind_down(job_t *job, gen_t *g) {
  int open = 0;
  g->running = 0;
  for (int r = 0; r < job->nproc; r++) {
    g->running += job->w[r].running;
    open += (job->w[r].st[0].fd >= 0) + (job->w[r].st[1].fd >= 0);
  }
  int64_t now = chorus__now_ns();
  if (g->running == 0) {
    if (g->drain_deadline == CHORUS__NO_DEADLINE) {
      /* Every worker is gone: kill what they left behind so the pipes
       * reach EOF, then give the pipes a bounded time to drain. */
      sweep_children();
      g->drain_deadline = chorus__now_ns() + (int64_t)DRAIN_MS * 1000000;
    }
    if (open == 0) return 1;
    if (now >= g->drain_deadline) {
      for (int r = 0; r < job->nproc; r++)
        for (int k = 0; k < 2; k++) stream_close(job, &job->w[r], &job->w[r].st[k]);
      return 1;
    }
  }
  if (g->stopping && !g->killed && now >= g->kill_deadline) {
    if (g->running) CHORUS_INFO(CHORUS__SUB_LAUNCH, "grace period over; sending SIGKILL");
    signal_groups(job, SIGKILL);
    g->killed = 1;
    g->abandon_deadline = now + (int64_t)ABANDON_MS * 1000000;
  }
  if (g->killed && g->running && now >= g->abandon_deadline) {
    for (int r = 0; r < job->nproc; r++)
      if (job->w[r].running)
        fprintf(stderr, "chorusrun: rank %d (pid %d) survived SIGKILL; giving up on it\n", r,
                (int)job->w[r].pid);
    for (int r = 0; r < job->nproc; r++)
      for (int k = 0; k < 2; k++) stream_close(job, &job->w[r], &job->w[r].st[k]);
    g->spawn_error = 1;
    return 1;
  }
  return 0;
}

/* The poll's timeout: the next deadline, at most TICK_MS. */
static int poll_timeout(const job_t *job, const gen_t *g) {
  int timeout = TICK_MS;
  if (g->stopping && !g->killed) timeout = CHORUS__MIN(timeout, chorus__ms_left(g->kill_deadline));
  if (g->killed && g->running) timeout = CHORUS__MIN(timeout, chorus__ms_left(g->abandon_deadline));
  if (g->running == 0) timeout = CHORUS__MIN(timeout, chorus__ms_left(g->drain_deadline));
  if (job->rz) timeout = CHORUS__MIN(timeout, rdzv_poll_ms(job));
  return timeout;
}

/* A signal to us: the first stops the workers (it is forwarded, and ends
 * the job on every node), a second one cuts the grace period short. */
static void take_signal(job_t *job, gen_t *g) {
  int sig = drain_selfpipe();
  if (sig) {
    if (!job->got_sig) {
      job->got_sig = sig;
      fprintf(stderr, "chorusrun: got %s; stopping the workers\n", signal_name(sig));
      signal_groups(job, sig);
      if (job->rz) rdzv_interrupt(job, sig); /* the whole job stops */
      if (!g->stopping) {
        g->stopping = 1;
        g->kill_deadline = chorus__now_ns() + job->grace_ns;
      }
    } else if (!g->killed) {
      fprintf(stderr, "chorusrun: got %s again; killing the workers\n", signal_name(sig));
      g->kill_deadline = chorus__now_ns();
    }
  }
}

/* Waits for output, a signal or the next deadline, and handles what came. */
static void poll_once(job_t *job, gen_t *g) {
  int timeout = poll_timeout(job, g);
  nfds_t n = 0;
  g->pfd[n] = (struct pollfd){.fd = g_selfpipe[0], .events = POLLIN};
  g->owner_s[n] = NULL;
  g->owner_w[n++] = NULL;
  for (int r = 0; r < job->nproc; r++)
    for (int k = 0; k < 2; k++)
      if (job->w[r].st[k].fd >= 0) {
        g->pfd[n] = (struct pollfd){.fd = job->w[r].st[k].fd, .events = POLLIN};
        g->owner_s[n] = &job->w[r].st[k];
        g->owner_w[n++] = &job->w[r];
      }
  int ready = poll(g->pfd, n, timeout);
  if (ready < 0) {
    if (errno == EINTR) return;
    /* Should not happen (EINVAL/ENOMEM); stop everything hard rather
     * than spin. */
    fprintf(stderr, "chorusrun: poll failed: %s; killing the workers\n", strerror(errno));
    signal_groups(job, SIGKILL);
    if (!g->killed) {
      g->killed = g->stopping = 1;
      g->abandon_deadline = chorus__now_ns() + (int64_t)ABANDON_MS * 1000000;
    }
    g->spawn_error = 1;
    struct timespec ts = {0, 10 * 1000000};
    nanosleep(&ts, NULL);
    return;
  }
  if (g->pfd[0].revents) take_signal(job, g);
  for (nfds_t i = 1; i < n; i++)
    if (g->pfd[i].revents) stream_read(job, g->owner_w[i], g->owner_s[i]);
}

/* What the generation came to, once every worker has exited: in place,
 * success when some worker finished; else the worker blamed (a timeout's
 * named rank over the one that reported it), our signal, an error of ours
 * or the rendezvous's news. */
static gen_outcome_t outcome(job_t *job, gen_t *g, int *failed_rank, rdzv_event_t *ev) {
  if (job->inplace && g->first_failed >= 0 && !job->got_sig && !g->spawn_error) {
    /* In place, the job succeeded if some worker ran to its end and every
     * worker that did not fail exited 0. */
    int finished = 0, failed = 0;
    for (int r = 0; r < job->nproc; r++) {
      if (failed_status(job->w[r].status)) failed++;
      else finished++;
    }
    if (finished > 0) {
      fprintf(stderr, "chorusrun: %d worker(s) failed, %d finished (--elastic inplace)\n",
              failed, finished);
      return GEN_OK;
    }
  }
  if (g->first_failed >= 0) {
    /* A worker that exited on a timeout: every such worker may name the one
     * they waited for, which is then the cause. */
    const worker_t *f = &job->w[g->first_failed];
    int n = !f->blame_kind && WIFEXITED(f->status) ? named_worker(job) : -1;
    if (n >= 0 && n != g->first_failed) {
      job->w[n].blame_kind = BLAME_NAMED;
      job->w[n].blame_code = status_exit_code(f->status);
      g->first_failed = n;
    }
    *failed_rank = g->first_failed;
    return GEN_FAILED;
  }
  if (job->got_sig) return GEN_SIGNALED;
  if (g->spawn_error) return GEN_ERROR;
  if (g->remote != RDZV_EV_NONE) {
    *ev = g->remote;
    return GEN_REMOTE;
  }
  return GEN_OK;
}

/* Runs one generation of all workers until every one has exited and its
 * output is drained.  *failed_rank receives the blamed local index
 * (GEN_FAILED), *ev what the rendezvous said (GEN_REMOTE). */
static gen_outcome_t run_generation(job_t *job, int *failed_rank, rdzv_event_t *ev) {
  gen_t g = {.first_failed = -1, .remote = RDZV_EV_NONE};
  g.kill_deadline = g.abandon_deadline = g.drain_deadline = CHORUS__NO_DEADLINE;
  nfds_t cap = 1 + 2 * (nfds_t)job->nproc;
  g.pfd = xmalloc(cap * sizeof *g.pfd);
  g.owner_s = xmalloc(cap * sizeof *g.owner_s);
  g.owner_w = xmalloc(cap * sizeof *g.owner_w);

  /* A signal that arrived between generations cancels the next one. */
  int sig = drain_selfpipe();
  if (sig && !job->got_sig) job->got_sig = sig;
  if (job->got_sig) goto done;

  start_workers(job, &g);
  for (;;) {
    watch_workers(job, &g);
    if (job->rz) watch_rdzv(job, &g);
    if (wind_down(job, &g)) break;
    poll_once(job, &g);
  }

done:
  free(g.pfd);
  free(g.owner_s);
  free(g.owner_w);
  return outcome(job, &g, failed_rank, ev);
}

/* ------------------------------------------------------ restart loop */

/* Several nodes: join a round, run it, and after a failure anywhere either
 * join the next round or end with the job's exit code. */
static int agent_run_nodes(job_t *job) {
  for (;;) {
    int rc = rdzv_join(job);
    if (rc != 0) return rc;
    int failed = -1;
    rdzv_event_t ev = RDZV_EV_NONE;
    gen_outcome_t out = run_generation(job, &failed, &ev);
    remove_job_segments();
    switch (out) {
      case GEN_OK: return rdzv_finish(job, 0);
      case GEN_SIGNALED: return 128 + job->got_sig;
      case GEN_FAILED:
        if (!job->w[failed].reported) report_failure(job, &job->w[failed]);
        /* In place, this node's workers all died; the other nodes' go on. */
        if (job->inplace && !job->got_sig)
          return rdzv_finish(job, status_exit_code(job->w[failed].status));
        if (job->got_sig) {
          rdzv_interrupt(job, job->got_sig);
          return 128 + job->got_sig;
        }
        rc = rdzv_after_failure(job, RDZV_EV_NONE);
        break;
      case GEN_ERROR: rc = rdzv_after_failure(job, RDZV_EV_NONE); break;
      case GEN_REMOTE: rc = rdzv_after_failure(job, ev); break;
    }
    if (rc >= 0) return rc;
    if (job->got_sig) {
      rdzv_interrupt(job, job->got_sig);
      return 128 + job->got_sig;
    }
  }
}

int agent_run(job_t *job) {
  if (job->rz) return agent_run_nodes(job);
  int exit_code = 0;
  for (int restart = 0;; restart++) {
    int failed = -1;
    rdzv_event_t ev = RDZV_EV_NONE;
    job->round = job->restarts = restart;
    gen_outcome_t out = run_generation(job, &failed, &ev);
    remove_job_segments(); /* every worker of the generation has exited */
    if (out == GEN_OK || out == GEN_REMOTE) {
      exit_code = 0;
      break;
    }
    if (out == GEN_SIGNALED) {
      exit_code = 128 + job->got_sig;
      break;
    }
    if (out == GEN_ERROR) {
      exit_code = EXIT_LAUNCHER;
      break;
    }
    if (!job->w[failed].reported) report_failure(job, &job->w[failed]);
    exit_code = job->w[failed].blame_kind ? job->w[failed].blame_code
                                          : status_exit_code(job->w[failed].status);
    if (job->got_sig) break; /* interrupted while stopping: no restart */
    if (restart >= job->max_restarts) {
      if (job->max_restarts > 0)
        fprintf(stderr, "chorusrun: no restarts left (--max-restarts %d)\n", job->max_restarts);
      break;
    }
    fprintf(stderr, "chorusrun: restarting the group (restart %d/%d)\n", restart + 1,
            job->max_restarts);
  }

  return exit_code;
}
