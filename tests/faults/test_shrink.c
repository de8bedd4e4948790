/*
 * test_shrink.c - chorus_comm_shrink: survivors of a failure agree on who
 * is alive and carry on in a smaller communicator, in bounded time.
 *
 * The driver serves the store in a child (it must outlive the ranks, as
 * chorusrun's does), forks the ranks, injects the fault from outside, and
 * reads one line per rank through a pipe:
 *     ready                        the rank is in its collective loop
 *     ok <size> <rank> <t> <sum>   shrunk: new size and rank, the
 *                                  CLOCK_MONOTONIC ms when the first
 *                                  collective on the new communicator
 *                                  completed, and its result (the sum of the
 *                                  survivors' old ranks)
 *     err <code> <message>         what the rank's shrink returned
 * Scenarios:
 *   kill       4 ranks in a loop of 256 KiB all_reduces, rank 2 SIGKILLed:
 *              the 3 survivors shrink to {0,1,3} and their next all_reduce
 *              is right; time from the SIGKILL to it is printed and must be
 *              under 1 s (scaled by CHORUS_TEST_SLACK)
 *   kill0      the same with rank 0 killed (the rank that serves nothing
 *              here, but is first in every list)
 *   twice      5 ranks, rank 1 killed, then rank 3 killed as soon as the
 *              survivors report they are shrinking: whichever way the race
 *              goes, the survivors end in {0,2,4} (shrinking again when the
 *              first new communicator fails), nobody hangs
 *   stopped    3 ranks, rank 1 SIGSTOPped: the others shrink to {0,2}
 *              (silence counts as death after ~1 s); resumed, rank 1 learns
 *              it was left out (CHORUS_ERR_REMOTE), in bounded time
 *   grow       3 ranks, rank 1 SIGKILLed, the survivors shrink to 2; then a
 *              new process asks to join (chorus_comm_join), the survivors see
 *              it (chorus_comm_joiners) and grow (chorus_comm_grow) to a world
 *              of 3 in which they keep ranks 0 and 1 and the joiner is 2;
 *              an all_reduce there is right on all three ("grown <size>
 *              <rank> <sum>"); a second joiner that nobody admits gives up
 *              with CHORUS_ERR_TIMEOUT and is never counted
 *   nostore    4 ranks, rank 3 and the store killed: shrink fails with
 *              CHORUS_ERR_STORE, naming the store, in bounded time
 * Every child is killed and reaped however the test ends.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "child_store.h"
#include "harness.h"

#define MAXR 8
#define SECRET "shrink-test-secret"

static pid_t g_store_pid;
static int g_port, g_n, g_scenario, g_wfd;
static pid_t g_pids[MAXR];
static int g_fds[MAXR];
static char g_buf[MAXR][8192];
static size_t g_len[MAXR];
static double g_slack = 1;

static double now_ms(void) { return child_now_ms(); }

static void kill_all(void) {
  children_kill(g_pids, g_fds, g_n);
  memset(g_len, 0, sizeof g_len);
}

static void cleanup(void) {
  kill_all();
  child_store_stop(&g_store_pid);
}

/* ------------------------------------------------------------ the ranks */

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  char line[1200];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
  for (int i = 0; i < n; i++)
    if (line[i] == '\n') line[i] = ' ';
  line[n++] = '\n';
  (void)!write(g_wfd, line, (size_t)n);
}

static chorus_comm_t join(int rank, int n) {
  char prefix[32];
  snprintf(prefix, sizeof prefix, "s%d/", g_scenario);
  chorus_config_t cfg = child_config(rank, n, g_port, prefix, SECRET, (int)(10000 * g_slack));
  chorus_comm_t comm = NULL;
  if (chorus_comm_init(&cfg, &comm) != CHORUS_OK) {
    say("err init %s", chorus_last_init_error());
    _exit(1);
  }
  return comm;
}

static int g_grow;       /* the grow scenario */
static int g_slack_join; /* the joiner gives up after 1.5 s */

/* Members: wait for a joiner, grow, all_reduce `mine` in the grown world
 * and report.  Joiners (comm NULL): join first. */
static void grow_and_report(chorus_comm_t comm, int64_t mine) {
  chorus_comm_t grown = NULL;
  chorus_result_t st;
  if (!comm) {
    char prefix[32];
    snprintf(prefix, sizeof prefix, "s%d/", g_scenario);
    chorus_config_t cfg = child_config(0, 1, g_port, prefix, SECRET,
                                       g_slack_join ? 1500 : (int)(10000 * g_slack));
    st = chorus_comm_join(&cfg, &grown);
    if (st != CHORUS_OK) {
      say("err %s %s", chorus_result_name(st), chorus_last_init_error());
      _exit(0);
    }
  } else {
    double until = now_ms() + 20000 * g_slack;
    int waiting = 0;
    while ((st = chorus_comm_joiners(comm, &waiting)) == CHORUS_OK && !waiting && now_ms() < until) {
      struct timespec ts = {0, 5 * 1000000};
      nanosleep(&ts, NULL);
    }
    if (st == CHORUS_OK && waiting) st = chorus_comm_grow(comm, (int)(10000 * g_slack), &grown);
    if (st != CHORUS_OK || !grown) {
      say("err %s %s", chorus_result_name(st), st ? chorus_comm_last_error(comm) : "nobody joined");
      _exit(0);
    }
  }
  int64_t sum = 0;
  st = chorus_all_reduce(grown, &mine, &sum, 1, CHORUS_INT64, CHORUS_SUM, NULL);
  if (st != CHORUS_OK) say("err %s %s", chorus_result_name(st), chorus_comm_last_error(grown));
  else say("grown %d %d %lld", chorus_comm_size(grown), chorus_comm_rank(grown), (long long)sum);
  chorus_comm_destroy(grown);
}

/* All_reduces until one fails; then shrinks (again while the new
 * communicator fails at once) and reports. */
static void rank_main(int rank, int n) {
  chorus_comm_t comm = join(rank, n);
  size_t count = 65536;
  float *buf = malloc(count * sizeof *buf);
  for (size_t i = 0; i < count; i++) buf[i] = 1.0f;
  say("ready");
  while (chorus_all_reduce(comm, buf, buf, count, CHORUS_FLOAT32, CHORUS_MAX, NULL) == CHORUS_OK) {
  }
  int old_rank = rank;
  for (int attempt = 0; attempt < 4; attempt++) {
    say("shrinking");
    chorus_comm_t next = NULL;
    chorus_result_t st = chorus_comm_shrink(comm, (int)(5000 * g_slack), &next);
    if (st != CHORUS_OK) {
      say("err %s %s", chorus_result_name(st), chorus_comm_last_error(comm));
      chorus_comm_destroy(comm);
      _exit(0);
    }
    chorus_comm_destroy(comm);
    comm = next;
    int64_t sum = old_rank, in = old_rank;
    st = chorus_all_reduce(comm, &in, &sum, 1, CHORUS_INT64, CHORUS_SUM, NULL);
    if (st == CHORUS_OK) {
      say("ok %d %d %.1f %lld", chorus_comm_size(comm), chorus_comm_rank(comm), now_ms(),
          (long long)sum);
      if (g_grow) grow_and_report(comm, 1);
      chorus_comm_destroy(comm);
      free(buf);
      _exit(0);
    }
    /* A member died after the agreement: shrink this one too. */
  }
  say("err gave up after 4 shrinks");
  _exit(1);
}

/* ------------------------------------------------------------ the driver */

static void spawn(int n) {
  g_n = n;
  g_scenario++;
  for (int r = 0; r < n; r++) {
    if ((g_wfd = child_fork_reporting(&g_pids[r], &g_fds[r])) >= 0) {
      rank_main(r, n);
      _exit(0);
    }
  }
}

/* Waits until rank r printed a line starting with `what` (or its pipe
 * closed, or the deadline); copies the line into out.  1 when found. */
static int wait_line(int r, const char *what, double deadline, char *out, size_t cap) {
  for (;;) {
    for (char *p = g_buf[r], *nl; (nl = memchr(p, '\n', g_len[r] - (size_t)(p - g_buf[r])));
         p = nl + 1) {
      if (!strncmp(p, what, strlen(what))) {
        snprintf(out, cap, "%.*s", (int)(nl - p), p);
        size_t rest = g_len[r] - (size_t)(nl + 1 - g_buf[r]);
        memmove(g_buf[r], nl + 1, rest);
        g_len[r] = rest;
        return 1;
      }
    }
    double left = deadline - now_ms();
    if (left <= 0 || g_fds[r] <= 0 || g_len[r] == sizeof g_buf[r]) return 0;
    struct pollfd pfd = {.fd = g_fds[r], .events = POLLIN};
    if (poll(&pfd, 1, (int)left + 1) <= 0) return 0;
    ssize_t got = read(g_fds[r], g_buf[r] + g_len[r], sizeof g_buf[r] - g_len[r]);
    if (got <= 0) {
      close(g_fds[r]);
      g_fds[r] = 0;
    } else {
      g_len[r] += (size_t)got;
    }
  }
}

static void all_ready(void) {
  char line[256];
  for (int r = 0; r < g_n; r++)
    if (!wait_line(r, "ready", now_ms() + 20000 * g_slack, line, sizeof line))
      HARNESS_FAIL("rank %d never got ready", r);
}

/* Survivors (bitmask) must report ok with the expected size, their rank in
 * old order and the sum of survivors' old ranks.  Returns the latest
 * completion time. */
static double expect_ok(unsigned survivors, double deadline) {
  int size = __builtin_popcount(survivors), next = 0;
  long long sum = 0;
  double latest = 0;
  for (int r = 0; r < g_n; r++)
    if (survivors & (1u << r)) sum += r;
  for (int r = 0; r < g_n; r++) {
    if (!(survivors & (1u << r))) continue;
    char line[1200];
    if (!wait_line(r, "ok", deadline, line, sizeof line)) {
      char err[1200] = "(no report)";
      wait_line(r, "err", now_ms(), err, sizeof err);
      HARNESS_FAIL("rank %d did not shrink: %s", r, err);
      next++;
      continue;
    }
    int nsize, nrank;
    double t;
    long long got;
    if (sscanf(line, "ok %d %d %lf %lld", &nsize, &nrank, &t, &got) != 4 || nsize != size ||
        nrank != next || got != sum)
      HARNESS_FAIL("rank %d: '%s', expected size %d rank %d sum %lld", r, line, size, next, sum);
    if (t > latest) latest = t;
    next++;
  }
  return latest;
}

/* 4 ranks, `victim` SIGKILLed: the 3 survivors' next all_reduce within 1 s. */
static void kill_one_of_four(int victim) {
  spawn(4);
  all_ready();
  double t0 = now_ms();
  kill(g_pids[victim], SIGKILL);
  double ms = expect_ok(0xfu & ~(1u << victim), t0 + 15000 * g_slack) - t0;
  printf("     SIGKILL of rank %d of 4 -> survivors' next all_reduce done: %.0f ms\n", victim, ms);
  if (ms > 1000 * g_slack) HARNESS_FAIL("recovery took %.0f ms (target 1000)", ms);
  kill_all();
}

TEST(kill) { kill_one_of_four(2); }

TEST(kill0) { kill_one_of_four(0); }

TEST(twice) {
  spawn(5);
  all_ready();
  double t0 = now_ms();
  kill(g_pids[1], SIGKILL);
  char line[256];
  if (!wait_line(0, "shrinking", t0 + 15000 * g_slack, line, sizeof line))
    HARNESS_FAIL("rank 0 never started shrinking");
  kill(g_pids[3], SIGKILL);
  double ms = expect_ok(0x15, t0 + 30000 * g_slack) - t0;
  printf("     two deaths, the second during the agreement: survivors done in %.0f ms\n", ms);
  kill_all();
}

TEST(stopped) {
  spawn(3);
  all_ready();
  double t0 = now_ms();
  kill(g_pids[1], SIGSTOP);
  double ms = expect_ok(0x5, t0 + 20000 * g_slack) - t0;
  printf("     SIGSTOP of rank 1 of 3 -> survivors done in %.0f ms\n", ms);
  kill(g_pids[1], SIGCONT);
  char line[1200];
  if (!wait_line(1, "err", now_ms() + 30000 * g_slack, line, sizeof line))
    HARNESS_FAIL("the resumed rank reported nothing");
  else if (!strstr(line, "CHORUS_ERR_REMOTE") || !strstr(line, "left out"))
    HARNESS_FAIL("the resumed rank: '%s', expected CHORUS_ERR_REMOTE ... left out", line);
  kill_all();
}

/* Forks one more child into slot r that joins the running job. */
static void spawn_joiner(int r) {
  if ((g_wfd = child_fork_reporting(&g_pids[r], &g_fds[r])) >= 0) {
    grow_and_report(NULL, 100);
    _exit(0);
  }
  if (r >= g_n) g_n = r + 1;
}

TEST(grow) {
  g_grow = 1;
  spawn(3);
  all_ready();
  kill(g_pids[1], SIGKILL);
  expect_ok(0x5, now_ms() + 15000 * g_slack);
  double t0 = now_ms();
  spawn_joiner(3);
  char line[1200];
  const int who[3] = {0, 2, 3}, rank_in_grown[3] = {0, 1, 2};
  for (int i = 0; i < 3; i++) {
    if (!wait_line(who[i], "grown", t0 + 20000 * g_slack, line, sizeof line)) {
      char err[1200] = "(no report)";
      wait_line(who[i], "err", now_ms(), err, sizeof err);
      HARNESS_FAIL("process %d did not grow: %s", who[i], err);
      continue;
    }
    int size, rank;
    long long sum;
    if (sscanf(line, "grown %d %d %lld", &size, &rank, &sum) != 3 || size != 3 ||
        rank != rank_in_grown[i] || sum != 102)
      HARNESS_FAIL("process %d: '%s', expected grown 3 %d 102", who[i], line, rank_in_grown[i]);
  }
  printf("     2 survivors + 1 joiner: grown world ready %.0f ms after the joiner started\n",
         now_ms() - t0);
  /* Nobody admits a second joiner: it gives up, and is not counted. */
  g_slack_join = 1;
  spawn_joiner(4);
  if (!wait_line(4, "err", now_ms() + 15000 * g_slack, line, sizeof line) ||
      !strstr(line, "CHORUS_ERR_TIMEOUT") || !strstr(line, "admitted"))
    HARNESS_FAIL("the joiner nobody admitted: '%s'", line);
  g_slack_join = 0;
  g_grow = 0;
  kill_all();
}

TEST(nostore) {
  spawn(4);
  all_ready();
  double t0 = now_ms();
  child_store_stop(&g_store_pid);
  kill(g_pids[3], SIGKILL);
  for (int r = 0; r < 3; r++) {
    char line[1200];
    if (!wait_line(r, "err", t0 + 20000 * g_slack, line, sizeof line))
      HARNESS_FAIL("rank %d reported no error", r);
    else if (!strstr(line, "CHORUS_ERR_STORE") || !strstr(line, "store"))
      HARNESS_FAIL("rank %d: '%s', expected CHORUS_ERR_STORE naming the store", r, line);
  }
  printf("     store gone: every survivor failed in %.0f ms\n", now_ms() - t0);
  kill_all();
  g_port = child_store_start(SECRET, &g_store_pid);
}

int main(void) {
  const char *slack = getenv("CHORUS_TEST_SLACK");
  if (slack && atof(slack) >= 1) g_slack = atof(slack);
  signal(SIGPIPE, SIG_IGN);
  atexit(cleanup);
  g_port = child_store_start(SECRET, &g_store_pid);
  if (g_port <= 0) {
    fprintf(stderr, "cannot start the store\n");
    return 1;
  }
  RUN(kill);
  RUN(kill0);
  RUN(twice);
  RUN(stopped);
  RUN(grow);
  RUN(nostore);
  return HARNESS_DONE();
}
