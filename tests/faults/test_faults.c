/*
 * test_faults.c - failure behaviour: dead peers, stopped peers, mismatched
 * calls, aborts, early exits and strangers.  "Nothing may hang, and every
 * surviving rank gets an error that names the culprit."
 *
 * The driver starts a store (in a child process), forks the ranks of each scenario (they
 * join with chorus_comm_init and a per-scenario key prefix), injects the
 * fault from outside (SIGKILL, SIGSTOP, a raw socket) or lets a rank
 * misbehave, and reads one report line per rank through a pipe:
 *     <status> <ms> <message>
 * where ms is the time the rank's failing call took.  It checks the status,
 * the message and how long detection took, and kills and reaps every child
 * whatever happens (also on the way out, via atexit), so no process is left
 * behind.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "child_store.h"
#include "harness.h"

#define MAXR 8

static pid_t g_store_pid;
static int g_port;
static pid_t g_pids[MAXR];
static int g_fds[MAXR];
static int g_n;
static int g_scenario;
static char g_bufs[MAXR][4096];
static size_t g_lens[MAXR];

static double now_ms(void) { return child_now_ms(); }

static void kill_all(void) {
  children_kill(g_pids, g_fds, g_n);
  memset(g_lens, 0, sizeof g_lens);
}

/* ------------------------------------------------------------ the child */

static int g_wfd; /* child's report pipe */

static void report(chorus_result_t st, double ms, const char *msg) {
  char line[1400];
  int n = snprintf(line, sizeof line, "%d %.0f %s\n", (int)st, ms, msg);
  for (char *p = line; p < line + n - 1; p++)
    if (*p == '\n') *p = ' ';
  (void)!write(g_wfd, line, (size_t)n < sizeof line ? (size_t)n : sizeof line);
}

static chorus_comm_t join(int rank, int n, int timeout_ms) {
  char prefix[32];
  snprintf(prefix, sizeof prefix, "s%d/", g_scenario);
  /* Every rank a host of its own: what goes between hosts (TCP, or UCX
   * with CHORUS_TRANSPORT=ucx) carries every pair. */
  if (getenv("CHORUS_FAULTS_HOST_PER_RANK")) {
    char id[16];
    snprintf(id, sizeof id, "h%d", rank);
    setenv("CHORUS_HOST_ID", id, 1);
  }
  chorus_config_t cfg = child_config(rank, n, g_port, prefix, "fault-test-secret", timeout_ms);
  chorus_comm_t comm = NULL;
  chorus_result_t st = chorus_comm_init(&cfg, &comm);
  if (st != CHORUS_OK) {
    report(st, 0, chorus_last_init_error());
    _exit(1);
  }
  return comm;
}

typedef void (*scenario_fn)(int rank, int n);

static void spawn(int n, scenario_fn fn) {
  g_n = n;
  g_scenario++;
  for (int r = 0; r < n; r++) {
    if ((g_wfd = child_fork_reporting(&g_pids[r], &g_fds[r])) >= 0) {
      fn(r, n);
      _exit(0);
    }
  }
}

/* Reads one report line from each rank in `which` (bitmask) until deadline.
 * Returns the number of reports; status/ms/msg/arrival filled per rank. */
typedef struct {
  int got;
  int status;
  double ms;
  double arrival;
  char msg[1300];
} rep_t;

/* Takes one complete line of rank r out of its buffer, if there is one. */
static int take_line(int r, rep_t *rep) {
  char *nl = memchr(g_bufs[r], '\n', g_lens[r]);
  if (!nl) return 0;
  *nl = '\0';
  rep->got = 1;
  rep->arrival = now_ms();
  sscanf(g_bufs[r], "%d %lf", &rep->status, &rep->ms);
  char *m = strchr(g_bufs[r], ' ');
  m = m ? strchr(m + 1, ' ') : NULL;
  snprintf(rep->msg, sizeof rep->msg, "%s", m ? m + 1 : "");
  size_t used = (size_t)(nl - g_bufs[r]) + 1;
  memmove(g_bufs[r], nl + 1, g_lens[r] - used);
  g_lens[r] -= used;
  return 1;
}

static int collect(unsigned which, rep_t *reps, double timeout_ms) {
  double deadline = now_ms() + timeout_ms;
  int count = 0;
  for (int r = 0; r < g_n; r++)
    if ((which >> r & 1) && take_line(r, &reps[r])) count++;
  for (;;) {
    struct pollfd pf[MAXR];
    int np = 0, idx[MAXR];
    for (int r = 0; r < g_n; r++)
      if ((which >> r & 1) && !reps[r].got && g_fds[r] > 0) {
        pf[np].fd = g_fds[r];
        pf[np].events = POLLIN;
        idx[np++] = r;
      }
    if (!np) break;
    double left = deadline - now_ms();
    if (left <= 0) break;
    if (poll(pf, (nfds_t)np, (int)left + 1) <= 0) continue;
    for (int i = 0; i < np; i++) {
      if (!(pf[i].revents & (POLLIN | POLLHUP))) continue;
      int r = idx[i];
      ssize_t k = read(g_fds[r], g_bufs[r] + g_lens[r], sizeof g_bufs[r] - 1 - g_lens[r]);
      if (k <= 0) {
        close(g_fds[r]);
        g_fds[r] = -1;
        continue;
      }
      g_lens[r] += (size_t)k;
      if (take_line(r, &reps[r])) count++;
    }
  }
  return count;
}

/* ------------------------------------------------------------ scenarios */

/* Ranks all_reduce 4 MiB in a loop and report the first error. */
static void loop_allreduce(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 3000);
  size_t count = 1 << 20;
  float *buf = calloc(count, sizeof(float));
  report(CHORUS_OK, 0, "ready");
  for (;;) {
    double t0 = now_ms();
    chorus_result_t st = chorus_all_reduce(comm, buf, buf, count, CHORUS_FLOAT32, CHORUS_SUM, NULL);
    if (st != CHORUS_OK) {
      report(st, now_ms() - t0, chorus_comm_last_error(comm));
      /* Sticky: the next call fails at once with the same kind of error. */
      double t1 = now_ms();
      chorus_result_t again = chorus_barrier(comm, NULL);
      char line[200];
      snprintf(line, sizeof line, "after: %d in %.0f ms", (int)again, now_ms() - t1);
      report(again, now_ms() - t1, line);
      chorus_comm_destroy(comm);
      _exit(0);
    }
  }
}

TEST(sigkill_during_allreduce) {
  spawn(4, loop_allreduce);
  rep_t ready[MAXR] = {0};
  ASSERT_EQ(collect(0xf, ready, 60000 * child_slack()), 4);
  usleep(300 * 1000);
  double t_kill = now_ms();
  kill(g_pids[2], SIGKILL);
  rep_t reps[MAXR] = {0}, after[MAXR] = {0};
  ASSERT_EQ(collect(0xb, reps, 10000), 3);
  collect(0xb, after, 5000);
  for (int r = 0; r < 4; r++) {
    if (r == 2) continue;
    double latency = reps[r].arrival - t_kill;
    printf("  rank %d: detected in %.0f ms: %s\n", r, latency, reps[r].msg);
    ASSERT_TRUE(reps[r].status == CHORUS_ERR_REMOTE);
    ASSERT_CONTAINS(reps[r].msg, "rank 2");
    ASSERT_TRUE(latency < 2000 * child_slack());
    ASSERT_TRUE(after[r].got && after[r].status != CHORUS_OK && after[r].ms < 100);
  }
}

/* Issue 42, item 7: a rank killed while its 3 peers on shared memory wait
 * for it, with 6 busy loops on the host's cores.  Over shared memory the
 * survivors yielded 1000 times before they looked at the endpoint's
 * failure: 1.8-10.7 s with the cores busy (TCP: milliseconds).  Now every
 * survivor names the dead rank within milliseconds. */
static pid_t g_busy[6];

static void busy_stop(void) {
  for (int i = 0; i < 6; i++)
    if (g_busy[i] > 0) {
      kill(g_busy[i], SIGKILL);
      waitpid(g_busy[i], NULL, 0);
      g_busy[i] = 0;
    }
}

static void small_allreduce(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 30000);
  float buf[1024] = {0};
  report(CHORUS_OK, 0, "ready");
  for (;;) {
    chorus_result_t st = chorus_all_reduce(comm, buf, buf, 1024, CHORUS_FLOAT32, CHORUS_SUM, NULL);
    if (st != CHORUS_OK) {
      report(st, 0, chorus_comm_last_error(comm));
      chorus_comm_destroy(comm);
      report(CHORUS_OK, 0, "destroyed");
      _exit(0);
    }
  }
}

TEST(sigkill_busy_host) {
  spawn(4, small_allreduce);
  rep_t ready[MAXR] = {0};
  ASSERT_EQ(collect(0xf, ready, 60000 * child_slack()), 4);
  pid_t self = getpid();
  for (int i = 0; i < 6; i++) {
    g_busy[i] = fork();
    if (g_busy[i] == 0) {
      child_die_with_parent(self);
      for (volatile unsigned long k = 0;; k++) {
      }
    }
  }
  usleep(500 * 1000);
  double t_kill = now_ms();
  kill(g_pids[2], SIGKILL);
  rep_t reps[MAXR] = {0}, gone[MAXR] = {0};
  int got = collect(0xb, reps, 15000);
  collect(0xb, gone, 15000);
  double worst = 0, worst_gone = 0;
  for (int r = 0; r < 4; r++) {
    if (r == 2 || !reps[r].got) continue;
    worst = reps[r].arrival - t_kill > worst ? reps[r].arrival - t_kill : worst;
    if (gone[r].got && gone[r].arrival - t_kill > worst_gone) worst_gone = gone[r].arrival - t_kill;
  }
  busy_stop();
  printf("  6 busy loops: the survivors named rank 2 within %.0f ms, destroyed within %.0f ms\n",
         worst, worst_gone);
  ASSERT_EQ(got, 3);
  for (int r = 0; r < 4; r++) {
    if (r == 2) continue;
    ASSERT_TRUE(reps[r].status == CHORUS_ERR_REMOTE);
    ASSERT_CONTAINS(reps[r].msg, "rank 2");
    ASSERT_TRUE(gone[r].got);
  }
  /* Target 100 ms; the bound leaves room for a loaded CI machine. */
  ASSERT_TRUE(worst < 500 * child_slack());
  ASSERT_TRUE(worst_gone < 1500 * child_slack());
}

TEST(sigstop_times_out) {
  spawn(3, loop_allreduce);
  rep_t ready[MAXR] = {0};
  ASSERT_EQ(collect(0x7, ready, 60000 * child_slack()), 3);
  usleep(200 * 1000);
  double t_stop = now_ms();
  kill(g_pids[1], SIGSTOP);
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x5, reps, 15000), 2);
  for (int r = 0; r < 3; r += 2) {
    double latency = reps[r].arrival - t_stop;
    printf("  rank %d: failed after %.0f ms: %s\n", r, latency, reps[r].msg);
    ASSERT_TRUE(reps[r].status == CHORUS_ERR_TIMEOUT || reps[r].status == CHORUS_ERR_REMOTE);
    ASSERT_CONTAINS(reps[r].msg, "timed out");
    ASSERT_CONTAINS(reps[r].msg, "not responding at all: rank 1 (silent");
    ASSERT_TRUE(latency > 2500 && latency < 8000 * child_slack());
  }
}

/* Mismatch scenarios: rank `bad` deviates in one argument. */
static int g_variant;

static void mismatch_rank(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 20000);
  float buf[64] = {0}, out[64 * 8];
  int64_t lbuf[64] = {0};
  chorus_result_t st = chorus_all_reduce(comm, buf, buf, 8, CHORUS_FLOAT32, CHORUS_SUM, NULL);
  if (st != CHORUS_OK) {
    report(st, 0, chorus_comm_last_error(comm));
    _exit(1);
  }
  int bad = rank == 2;
  double t0 = now_ms();
  switch (g_variant) {
    case 0: /* count */
      st = chorus_all_reduce(comm, buf, buf, bad ? 9 : 8, CHORUS_FLOAT32, CHORUS_SUM, NULL);
      break;
    case 1: /* dtype */
      st = bad ? chorus_all_reduce(comm, lbuf, lbuf, 8, CHORUS_INT64, CHORUS_SUM, NULL)
               : chorus_all_reduce(comm, buf, buf, 8, CHORUS_FLOAT32, CHORUS_SUM, NULL);
      break;
    case 2: /* root */
      st = chorus_broadcast(comm, buf, 8, CHORUS_FLOAT32, bad ? 1 : 0, NULL);
      break;
    case 3: /* op */
      st = chorus_all_reduce(comm, buf, buf, 8, CHORUS_FLOAT32, bad ? CHORUS_MAX : CHORUS_SUM, NULL);
      break;
    case 4: /* collective */
      st = bad ? chorus_broadcast(comm, buf, 8, CHORUS_FLOAT32, 0, NULL)
               : chorus_all_reduce(comm, buf, buf, 8, CHORUS_FLOAT32, CHORUS_SUM, NULL);
      break;
    case 5: /* all_gather sizes (the example users see) */
      st = chorus_all_gather(comm, buf, out, bad ? 3 : 2, CHORUS_FLOAT32, NULL);
      break;
    case 6: /* zero-length versus data */
      st = chorus_all_reduce(comm, buf, buf, bad ? 0 : 5, CHORUS_FLOAT32, CHORUS_SUM, NULL);
      break;
    case 7: /* every rank its own root: each starts by waiting */
      st = chorus_reduce(comm, buf, out, 8, CHORUS_FLOAT32, CHORUS_SUM, rank, NULL);
      break;
    case 8: /* gather against scatter */
      st = bad ? chorus_scatter(comm, out, buf, 2, CHORUS_FLOAT32, 0, NULL)
               : chorus_gather(comm, buf, out, 2, CHORUS_FLOAT32, 0, NULL);
      break;
  }
  /* A rank that only sends may finish before the mismatch is seen; it
   * learns of it (at the latest) on its next call. */
  if (st == CHORUS_OK) st = chorus_barrier(comm, NULL);
  report(st, now_ms() - t0, chorus_comm_last_error(comm));
  /* Alive until the parent has every report (it kills the ranks then): a
   * rank that left at once could end before a slower one, still in its
   * first call, reached it (UCX connects late), which then reports the
   * departure, not the mismatch this scenario is about. */
  for (int i = 0; i < 300; i++) usleep(100000);
  chorus_comm_destroy(comm);
}

TEST(mismatches) {
  static const char *names[] = {"count",       "dtype",      "root",
                                "op",          "collective", "all_gather size",
                                "zero-length", "reduce root", "gather/scatter"};
  for (g_variant = 0; g_variant < 9; g_variant++) {
    spawn(4, mismatch_rank);
    rep_t reps[MAXR] = {0};
    int got = collect(0xf, reps, 15000);
    kill_all();
    printf("  %s mismatch:\n", names[g_variant]);
    ASSERT_EQ(got, 4);
    for (int r = 0; r < 4; r++) {
      printf("    rank %d (%.0f ms): %s\n", r, reps[r].ms, reps[r].msg);
      ASSERT_TRUE(reps[r].status == CHORUS_ERR_MISMATCH || reps[r].status == CHORUS_ERR_REMOTE);
      ASSERT_TRUE(reps[r].ms < 2000 * child_slack());
      ASSERT_TRUE(strstr(reps[r].msg, "mismatch") || strstr(reps[r].msg, "different"));
    }
  }
}

/* Abort from another thread while the main thread is blocked. */
static chorus_comm_t g_abort_comm;
static void *aborter(void *arg) {
  usleep(300 * 1000);
  chorus_comm_abort(g_abort_comm);
  return arg;
}

static void abort_rank(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 20000);
  float x = 0;
  pthread_t t;
  if (rank == 0) {
    g_abort_comm = comm;
    pthread_create(&t, NULL, aborter, NULL);
  }
  double t0 = now_ms();
  /* Nobody sends: only the abort can end this. */
  chorus_result_t st = chorus_recv(comm, &x, 1, CHORUS_FLOAT32, (rank + 1) % n, 7, NULL);
  report(st, now_ms() - t0, chorus_comm_last_error(comm));
  if (rank == 0) pthread_join(t, NULL);
  chorus_comm_destroy(comm);
}

TEST(abort_from_other_thread) {
  spawn(2, abort_rank);
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x3, reps, 15000), 2);
  for (int r = 0; r < 2; r++) {
    printf("  rank %d (%.0f ms): %s\n", r, reps[r].ms, reps[r].msg);
    ASSERT_TRUE(reps[r].ms < 3000 * child_slack());
    ASSERT_CONTAINS(reps[r].msg, "abort");
  }
  ASSERT_EQ(reps[0].status, CHORUS_ERR_ABORTED);
  ASSERT_EQ(reps[1].status, CHORUS_ERR_REMOTE);
}

/* A rank leaves (destroys and exits) while the others still want it. */
static void early_exit_rank(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 20000);
  float x = 1;
  if (rank == n - 1) {
    chorus_comm_destroy(comm);
    _exit(0);
  }
  usleep(200 * 1000);
  double t0 = now_ms();
  chorus_result_t st = chorus_all_reduce(comm, &x, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL);
  report(st, now_ms() - t0, chorus_comm_last_error(comm));
  chorus_comm_destroy(comm);
}

TEST(peer_left_early) {
  spawn(3, early_exit_rank);
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x3, reps, 15000), 2);
  for (int r = 0; r < 2; r++) {
    printf("  rank %d (%.0f ms): %s\n", r, reps[r].ms, reps[r].msg);
    ASSERT_TRUE(reps[r].status == CHORUS_ERR_REMOTE);
    ASSERT_TRUE(reps[r].ms < 2000 * child_slack());
    ASSERT_CONTAINS(reps[r].msg, "rank 2");
  }
}

/* A rank sends, then leaves cleanly; its data must still be receivable
 * after its connection is gone.  (Runs before any scenario that makes the
 * driver read the environment, so the child's setenv takes effect.) */
static void send_and_leave(int rank, int n) {
  setenv("CHORUS_BYE_TIMEOUT_MS", "300", 1);
  chorus_comm_t comm = join(rank, n, 20000);
  int32_t v = 42;
  chorus_result_t st;
  if (rank == 1) {
    st = chorus_send(comm, &v, 1, CHORUS_INT32, 0, 3, NULL);
    chorus_comm_destroy(comm); /* waits 300 ms for rank 0's goodbye, then closes */
    report(st, 0, "sent");
    _exit(0);
  }
  usleep(1200 * 1000); /* rank 1 is long gone */
  v = 0;
  st = chorus_recv(comm, &v, 1, CHORUS_INT32, 1, 3, NULL);
  char line[600];
  snprintf(line, sizeof line, "got %d: %s", (int)v, chorus_comm_last_error(comm));
  report(st, 0, line);
  chorus_comm_destroy(comm);
}

TEST(data_survives_goodbye) {
  spawn(2, send_and_leave);
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x3, reps, 15000), 2);
  printf("  rank 0: %s\n", reps[0].msg);
  ASSERT_EQ(reps[0].status, CHORUS_OK);
  ASSERT_CONTAINS(reps[0].msg, "got 42");
}

/* ------------------------------------------- stopped peers, polled */

/* The timing bounds below are multiplied by child_slack() in slow builds. */
#define POLL_TIMEOUT_MS 2000

/* Reports the failing call, then times chorus_comm_destroy and reports
 * that too ("destroyed"), then exits: a survivor's whole way out. */
static void fail_and_leave(chorus_comm_t comm, chorus_comm_t sub, chorus_result_t st,
                           double call_ms, const char *msg) {
  report(st, call_ms, msg);
  double t0 = now_ms();
  chorus_comm_destroy(sub);
  chorus_comm_destroy(comm);
  report(CHORUS_OK, now_ms() - t0, "destroyed");
  _exit(0);
}

/* g_variant: 0 = recv polled with chorus_work_test, 1 = with
 * chorus_work_wait(w, 20) in a loop, 2 = blocking all_reduce, 3 = recv
 * polled inside a subgroup.  Rank `victim` (world) is stopped by the
 * driver after "ready"; everyone else waits for it. */
static void polled_rank(int rank, int n) {
  chorus_comm_t comm = join(rank, n, POLL_TIMEOUT_MS), sub = NULL, c = comm;
  /* The subgroup lists world ranks backwards: the stopped world rank n-1
   * is subgroup rank 0, a name that belongs to a healthy world rank. */
  int ranks[MAXR];
  for (int i = 0; i < n; i++) ranks[i] = n - 1 - i;
  if (g_variant == 3) {
    chorus_result_t st = chorus_comm_new_group(comm, ranks, n, &sub);
    if (st != CHORUS_OK) fail_and_leave(comm, NULL, st, 0, chorus_comm_last_error(comm));
    c = sub;
  }
  /* Everyone is connected and alive before the stop. */
  chorus_result_t st = chorus_barrier(c, NULL);
  if (st != CHORUS_OK) fail_and_leave(comm, sub, st, 0, chorus_comm_last_error(c));
  report(CHORUS_OK, 0, "ready");
  if (rank == n - 1) {
    for (;;) pause(); /* stopped, later killed by the driver */
  }
  double t0 = now_ms();
  float x = 0;
  int from = g_variant == 3 ? 0 : n - 1; /* the stopped rank, in c's numbering */
  if (g_variant == 2) {
    st = chorus_all_reduce(c, &x, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL);
    fail_and_leave(comm, sub, st, now_ms() - t0, chorus_comm_last_error(c));
  }
  chorus_work_t w = NULL;
  st = chorus_recv(c, &x, 1, CHORUS_FLOAT32, from, 5, &w);
  if (st != CHORUS_OK) fail_and_leave(comm, sub, st, 0, chorus_comm_last_error(c));
  /* Poll for up to 6 timeouts: the library must end it long before. */
  while (now_ms() - t0 < 6.0 * POLL_TIMEOUT_MS) {
    st = g_variant == 1 ? chorus_work_wait(w, 20) : chorus_work_test(w);
    if (st != CHORUS_INPROGRESS) break;
    if (g_variant != 1) usleep(1000);
  }
  char msg[1300];
  snprintf(msg, sizeof msg, "%s", st == CHORUS_INPROGRESS ? "still in progress"
                                                           : chorus_work_error(w));
  double ms = now_ms() - t0;
  chorus_work_free(w); /* failed already: returns at once */
  fail_and_leave(comm, sub, st, ms, msg);
}

TEST(sigstop_polled) {
  static const char *names[] = {"recv polled with test", "recv polled with wait(20 ms)",
                                "blocking all_reduce", "recv polled in a subgroup"};
  const double t = POLL_TIMEOUT_MS, k = child_slack();
  for (g_variant = 0; g_variant < 4; g_variant++) {
    int n = 3;
    spawn(n, polled_rank);
    rep_t ready[MAXR] = {0};
    int got = collect(0x7, ready, 60000 * child_slack());
    for (int r = 0; r < n; r++)
      if (ready[r].got && ready[r].status != CHORUS_OK) printf("  rank %d failed to join: %s\n", r, ready[r].msg);
    if (got != n) kill_all();
    ASSERT_EQ(got, n);
    for (int r = 0; r < n; r++) ASSERT_EQ(ready[r].status, CHORUS_OK);
    usleep(100 * 1000);
    double t_stop = now_ms();
    kill(g_pids[n - 1], SIGSTOP);
    rep_t reps[MAXR] = {0}, gone[MAXR] = {0};
    got = collect(0x3, reps, 6 * t + 5000);
    collect(0x3, gone, 5000);
    kill_all();
    printf("  %s:\n", names[g_variant]);
    ASSERT_EQ(got, 2);
    for (int r = 0; r < 2; r++) {
      double fail_at = reps[r].arrival - t_stop, exit_at = gone[r].arrival - t_stop;
      printf("    rank %d failed %.0f ms after the stop, out of destroy %.0f ms after: %s\n", r,
             fail_at, gone[r].got ? exit_at : -1.0, reps[r].msg);
      ASSERT_TRUE(reps[r].status == CHORUS_ERR_TIMEOUT || reps[r].status == CHORUS_ERR_REMOTE);
      ASSERT_CONTAINS(reps[r].msg, "timed out");
      /* The culprit by the name it has in the world. */
      ASSERT_CONTAINS(reps[r].msg, g_variant == 3 ? "rank 0 (world rank 2)" : "rank 2");
      ASSERT_TRUE(fail_at < (t + 500) * k);
      ASSERT_TRUE(gone[r].got);
      ASSERT_TRUE(exit_at < (t + 1000) * k);
    }
  }
}

/* ------------------------------------------------ random fault trials */

/* Each trial: n ranks (2..5) on shared memory or TCP run the same random
 * sequence of collectives, async handles polled with test and wait(t),
 * and a send/recv ring; at a random moment the driver SIGKILLs or
 * SIGSTOPs a random rank.  Every survivor must fail (timeout or remote
 * error) naming the victim, within 2 s of a SIGKILL or T + 0.5 s of a
 * SIGSTOP (T = POLL_TIMEOUT_MS), be out of chorus_comm_destroy within
 * T + 1 s, and exit by itself; no /dev/shm name may be left.
 * CHORUS_FAULT_TRIALS sets the number of trials (6 by default, 2 in the
 * sanitizer passes; the release check in README.md runs 200),
 * CHORUS_FAULT_SEED the first seed. */
static uint64_t g_trial_seed;
static int g_trial_tcp;

static uint64_t mix64(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Polls w with test or wait(10) (by the draw) until it is done. */
static chorus_result_t poll_work(chorus_work_t w, int by_wait) {
  for (;;) {
    chorus_result_t st = by_wait ? chorus_work_wait(w, 10) : chorus_work_test(w);
    if (st != CHORUS_INPROGRESS) return st;
    if (!by_wait) usleep(200);
  }
}

static void trial_rank(int rank, int n) {
  if (g_trial_tcp) setenv("CHORUS_TRANSPORT", "tcp", 1);
  chorus_comm_t comm = join(rank, n, POLL_TIMEOUT_MS);
  size_t big = (1u << 20) / sizeof(float);
  float *a = calloc(big * (size_t)n, sizeof(float)), *b = calloc(big * (size_t)n, sizeof(float));
  chorus_result_t st = chorus_barrier(comm, NULL);
  if (st != CHORUS_OK || !a || !b) fail_and_leave(comm, NULL, st, 0, chorus_comm_last_error(comm));
  report(CHORUS_OK, 0, "ready");
  uint64_t seq = g_trial_seed; /* the same draws on every rank */
  for (;;) {
    uint64_t r = mix64(&seq);
    int kind = (int)(r % 7), flag = (int)(r >> 8) & 1;
    size_t count = (size_t)1 << (r >> 16) % 19; /* 1 .. 256 Ki floats */
    chorus_work_t w = NULL, w2 = NULL;
    double t0 = now_ms();
    switch (kind) {
      case 0: st = chorus_all_reduce(comm, a, flag ? a : b, count, CHORUS_FLOAT32, CHORUS_SUM, NULL); break;
      case 1: st = chorus_broadcast(comm, a, count, CHORUS_FLOAT32, (int)(r >> 40) % n, NULL); break;
      case 2: st = chorus_all_gather(comm, a, b, count / 4 + 1, CHORUS_FLOAT32, NULL); break;
      case 3: st = chorus_barrier(comm, NULL); break;
      case 4: /* async all_reduce, polled */
        st = chorus_all_reduce(comm, a, b, count, CHORUS_FLOAT32, CHORUS_MAX, &w);
        if (st == CHORUS_OK) st = poll_work(w, flag);
        break;
      case 5: /* ring: recv from the left polled, send to the right */
        if (n < 2) break;
        st = chorus_recv(comm, b, count, CHORUS_FLOAT32, (rank + n - 1) % n, 1, &w);
        if (st == CHORUS_OK) st = chorus_send(comm, a, count, CHORUS_FLOAT32, (rank + 1) % n, 1, &w2);
        if (st == CHORUS_OK) st = poll_work(w, flag);
        if (st == CHORUS_OK) st = poll_work(w2, !flag);
        break;
      case 6: st = chorus_reduce_scatter(comm, a, b, count / 8 + 1, CHORUS_FLOAT32, CHORUS_SUM, NULL); break;
    }
    if (st != CHORUS_OK) {
      char msg[1300];
      const char *e = w && chorus_work_error(w)[0] ? chorus_work_error(w)
                      : w2 && chorus_work_error(w2)[0] ? chorus_work_error(w2)
                                                       : chorus_comm_last_error(comm);
      snprintf(msg, sizeof msg, "%s", e);
      chorus_work_free(w);
      chorus_work_free(w2);
      free(a);
      free(b);
      fail_and_leave(comm, NULL, st, now_ms() - t0, msg);
    }
    chorus_work_free(w);
    chorus_work_free(w2);
  }
}

/* This run's job id: names its shared memory, which random_faults checks. */
static char g_job[32];
static void shm_names(char *buf, size_t cap) { child_job_shm(g_job, buf, cap, 0); }

TEST(random_faults) {
  const char *v = getenv("CHORUS_FAULT_TRIALS");
  int trials = v ? atoi(v) : 6;
  v = getenv("CHORUS_FAULT_SEED");
  uint64_t seed = v ? strtoull(v, NULL, 10) : 1;
  const double t = POLL_TIMEOUT_MS, k = child_slack();
  int failed = 0;
  for (int i = 0; i < trials && !failed; i++) {
    uint64_t s = seed + (uint64_t)i, draw = s * 0x2545f4914f6cdd1dull;
    int n = 2 + (int)(mix64(&draw) % 4), victim = (int)(mix64(&draw) % (uint64_t)n);
    int sig = mix64(&draw) % 2 ? SIGKILL : SIGSTOP;
    int delay_ms = 20 + (int)(mix64(&draw) % 400);
    g_trial_tcp = (int)(mix64(&draw) % 2);
    g_trial_seed = mix64(&draw);
    char before[2048], after[2048];
    shm_names(before, sizeof before);
    spawn(n, trial_rank);
    unsigned all = (1u << n) - 1, survivors = all & ~(1u << victim);
    rep_t ready[MAXR] = {0};
    int got = collect(all, ready, 60000 * child_slack());
    for (int r = 0; r < n; r++)
      if (ready[r].got && (ready[r].status != CHORUS_OK || strcmp(ready[r].msg, "ready"))) {
        printf("  trial seed %llu: rank %d failed to join: %s\n", (unsigned long long)s, r,
               ready[r].msg);
        got = -1;
      }
    if (got != n) {
      if (got >= 0)
        printf("  trial seed %llu: only %d of %d ranks got ready\n", (unsigned long long)s, got, n);
      kill_all();
      failed = 1;
      break;
    }
    usleep((useconds_t)delay_ms * 1000);
    double t_fault = now_ms();
    kill(g_pids[victim], sig);
    rep_t reps[MAXR] = {0}, gone[MAXR] = {0};
    int nrep = collect(survivors, reps, 3 * t + 5000);
    collect(survivors, gone, 5000);
    /* Survivors exit by themselves after "destroyed". */
    int exited = 1;
    for (int r = 0; r < n; r++) {
      if (r == victim) continue;
      double until = now_ms() + 2000;
      int done = 0;
      while (!done && now_ms() < until) {
        done = waitpid(g_pids[r], NULL, WNOHANG) == g_pids[r];
        if (!done) usleep(10000);
      }
      if (done) g_pids[r] = 0;
      else exited = 0;
    }
    kill_all();
    shm_names(after, sizeof after);
    double bound = sig == SIGKILL ? 2000 : t + 500;
    char name[16];
    snprintf(name, sizeof name, "rank %d", victim);
    int ok = nrep == n - 1 && exited && !strcmp(before, after);
    for (int r = 0; r < n && ok; r++) {
      if (r == victim) continue;
      double fail_at = reps[r].arrival - t_fault, gone_at = gone[r].arrival - t_fault;
      ok = (reps[r].status == CHORUS_ERR_TIMEOUT || reps[r].status == CHORUS_ERR_REMOTE) &&
           strstr(reps[r].msg, name) && fail_at < bound * k && gone[r].got &&
           gone_at < (sig == SIGKILL ? 3000 : t + 1000) * k;
    }
    printf("  trial seed %llu: %d ranks over %s, %s rank %d after %d ms: %s\n",
           (unsigned long long)s, n, g_trial_tcp ? "tcp" : "shared memory",
           sig == SIGKILL ? "SIGKILL" : "SIGSTOP", victim, delay_ms, ok ? "ok" : "FAILED");
    if (!ok) {
      failed = 1;
      printf("    reports %d of %d, survivors exited by themselves: %s, /dev/shm before [%s] "
             "after [%s]\n", nrep, n - 1, exited ? "yes" : "no", before, after);
      for (int r = 0; r < n; r++)
        if (r != victim)
          printf("    rank %d: status %d, failed %.0f ms after the fault, out of destroy %.0f ms "
                 "after: %s\n", r, reps[r].status, reps[r].arrival - t_fault,
                 gone[r].got ? gone[r].arrival - t_fault : -1.0, reps[r].msg);
    }
  }
  ASSERT_TRUE(!failed);
}

/* chorus_config_t.init_timeout_ms bounds joining apart from the
 * communicator's timeout: rank 1 comes 1.2 s late to a job whose timeout
 * is 0.5 s, and both still join (init has child_config's 60 s); a
 * receive nobody answers then fails after 0.5 s, not 60.  In the second
 * round rank 1 never comes and rank 0's init_timeout_ms of 0.4 s ends its
 * join; in the third the bound is 1 ms, spent before the store is reached
 * (a request given 0 ms left once waited the store client's default of
 * 300 s).  g_variant selects the round. */
static void late_start_rank(int rank, int n) {
  if (g_variant >= 1 && rank == 1) _exit(0); /* never joins */
  if (rank == 1) usleep(1200 * 1000);
  char prefix[32];
  snprintf(prefix, sizeof prefix, "s%d/", g_scenario);
  chorus_config_t cfg = child_config(rank, n, g_port, prefix, "fault-test-secret", 500);
  if (g_variant >= 1) cfg.init_timeout_ms = g_variant == 1 ? 400 : 1;
  double t0 = now_ms();
  chorus_comm_t comm = NULL;
  chorus_result_t st = chorus_comm_init(&cfg, &comm);
  if (st != CHORUS_OK) {
    report(st, now_ms() - t0, chorus_last_init_error());
    _exit(0);
  }
  float x = 0;
  t0 = now_ms();
  st = chorus_recv(comm, &x, 1, CHORUS_FLOAT32, 1 - rank, 3, NULL);
  report(st, now_ms() - t0, st == CHORUS_OK ? "received" : chorus_comm_last_error(comm));
  chorus_comm_destroy(comm);
}

TEST(init_timeout_apart) {
  const double k = child_slack();
  static const char *names[] = {"late rank, short timeout", "missing rank, init bound 0.4 s",
                                "missing rank, init bound 1 ms"};
  static const double least[] = {450, 350, 0}, most[] = {500, 400, 1};
  for (g_variant = 0; g_variant < 3; g_variant++) {
    spawn(2, late_start_rank);
    unsigned who = g_variant == 0 ? 0x3 : 0x1;
    rep_t reps[MAXR] = {0};
    int got = collect(who, reps, 30000 * k);
    kill_all();
    ASSERT_EQ(got, g_variant == 0 ? 2 : 1);
    for (int r = 0; r < got; r++) {
      printf("  %s: rank %d failed after %.0f ms: %s\n", names[g_variant], r, reps[r].ms,
             reps[r].msg);
      ASSERT_TRUE(reps[r].status == CHORUS_ERR_TIMEOUT || reps[r].status == CHORUS_ERR_REMOTE);
      ASSERT_TRUE(reps[r].ms >= least[g_variant]);
      ASSERT_TRUE(reps[r].ms < most[g_variant] + 1500 * k);
    }
    if (g_variant == 0) ASSERT_CONTAINS(reps[0].msg, "timed out");
  }
}

/* A stranger talks garbage to the store while a job uses it. */
static void busy_rank(int rank, int n) {
  chorus_comm_t comm = join(rank, n, 20000);
  double t0 = now_ms();
  chorus_result_t st = CHORUS_OK;
  for (int i = 0; i < 200 && st == CHORUS_OK; i++) {
    int64_t v = rank;
    st = chorus_all_reduce(comm, &v, &v, 1, CHORUS_INT64, CHORUS_SUM, NULL);
    if (st == CHORUS_OK && v != (int64_t)n * (n - 1) / 2) st = CHORUS_ERR_INTERNAL;
    usleep(1000);
  }
  report(st, now_ms() - t0, st == CHORUS_OK ? "fine" : chorus_comm_last_error(comm));
  chorus_comm_destroy(comm);
}

TEST(stranger_on_store) {
  spawn(3, busy_rank);
  for (int k = 0; k < 20; k++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)g_port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
      char junk[256];
      for (size_t i = 0; i < sizeof junk; i++) junk[i] = (char)(i * 37 + k);
      (void)!send(fd, junk, (size_t)(k * 13) % sizeof junk, MSG_NOSIGNAL);
    }
    close(fd);
    usleep(5000);
  }
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x7, reps, 20000), 3);
  for (int r = 0; r < 3; r++) {
    if (reps[r].status != CHORUS_OK) printf("  rank %d: %s\n", r, reps[r].msg);
    ASSERT_EQ(reps[r].status, CHORUS_OK);
  }
}

static void stop_store(void) { child_store_stop(&g_store_pid); }

/* The store, in a child of its own (child_store.h). */
static int start_store(void) { return child_store_start("fault-test-secret", &g_store_pid); }

/* A stranger connects to a rank's data port while it waits for its peers
 * to connect, sends garbage (or nothing) and goes away: the rank rejects it
 * and the job forms normally. */
static void late_rank(int rank, int n) {
  /* The data port is TCP's: ranks of one host would use shared memory. */
  setenv("CHORUS_TRANSPORT", "tcp", 1);
  if (rank == 1) usleep(600 * 1000); /* rank 0 is accepting meanwhile */
  busy_rank(rank, n);
}

TEST(stranger_on_data_port) {
  spawn(2, late_rank);
  chorus_store_t *store = NULL;
  ASSERT_EQ(chorus_store_connect("127.0.0.1", g_port, "fault-test-secret", 5000, &store), CHORUS_OK);
  char key[64];
  snprintf(key, sizeof key, "s%d/addr/0", g_scenario);
  void *val = NULL;
  size_t len = 0;
  ASSERT_EQ(chorus_store_get(store, key, &val, &len), CHORUS_OK);
  char host[64] = "";
  int port = 0;
  ASSERT_EQ(sscanf((char *)val, "%63s %d", host, &port), 2);
  chorus_free(val);
  chorus_store_close(store);
  for (int k = 0; k < 3; k++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &sa.sin_addr);
    ASSERT_EQ(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    if (k < 2) {
      char junk[64];
      memset(junk, k ? 0xff : 'A', sizeof junk);
      (void)!send(fd, junk, sizeof junk, MSG_NOSIGNAL);
      usleep(20 * 1000);
    }
    close(fd);
  }
  rep_t reps[MAXR] = {0};
  ASSERT_EQ(collect(0x3, reps, 20000), 2);
  for (int r = 0; r < 2; r++) {
    if (reps[r].status != CHORUS_OK) printf("  rank %d: %s\n", r, reps[r].msg);
    ASSERT_EQ(reps[r].status, CHORUS_OK);
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *only = argc > 1 ? argv[1] : NULL; /* one scenario, by name */
  /* This run's job id, before anything reads the environment (it salts
   * the key, and names the shared memory random_faults checks). */
  snprintf(g_job, sizeof g_job, "faults%d", (int)getpid());
  setenv("CHORUS_JOB_ID", g_job, 1);
  atexit(kill_all);
  atexit(busy_stop);
  atexit(stop_store);
  g_port = start_store();
  if (g_port <= 0) {
    fprintf(stderr, "cannot start the store\n");
    return 1;
  }
#define RUN_SCENARIO(name)                                                      \
  do {                                                                         \
    if (!only || !strcmp(only, #name)) {                                       \
      RUN(name);                                                               \
      kill_all();                                                              \
    }                                                                          \
  } while (0)
  RUN_SCENARIO(sigkill_during_allreduce);
  RUN_SCENARIO(sigkill_busy_host);
  RUN_SCENARIO(sigstop_times_out);
  RUN_SCENARIO(sigstop_polled);
  RUN_SCENARIO(random_faults);
  RUN_SCENARIO(init_timeout_apart);
  RUN_SCENARIO(mismatches);
  RUN_SCENARIO(abort_from_other_thread);
  RUN_SCENARIO(peer_left_early);
  RUN_SCENARIO(data_survives_goodbye);
  RUN_SCENARIO(stranger_on_store);
  RUN_SCENARIO(stranger_on_data_port);
  return HARNESS_DONE();
}
