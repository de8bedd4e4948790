/*
 * test_exit.c - a process that leaves without chorus_comm_destroy: it
 * returns from main (what a Python program ended by an exception does) or
 * another of its threads calls exit() while the main thread waits in the
 * library.  exit() runs the atexit handlers (OpenSSL's cleanup among them)
 * while the library's threads are still working.  No process may crash or
 * hang, the peers must fail with an error that names the rank that left,
 * and no shared-memory name of the job may be left behind.
 *
 * The driver starts a store (in a child), then runs trials: each trial
 * starts n ranks as fresh processes (fork and exec of this program, so a
 * rank's exit runs only its own handlers), on one channel (shared memory,
 * TCP, encrypted TCP, UCX with every rank a host of its own), in one of
 * three variants:
 *   timeout   every rank receives from its neighbour, nobody sends; each
 *             times out after 1.5-2.2 s (the library then tells the
 *             others) and returns from main at once.  Every rank must
 *             exit with status 0.
 *   leave     rank n-1 starts a send and a receive that nobody matches,
 *             waits 0-30 ms, and returns from main.  The others, blocked
 *             in a receive from it, must fail naming it within 3 s.
 *   thread    rank n-1's main thread blocks in a receive while another of
 *             its threads calls exit(0) after 0-30 ms; the others as in
 *             leave.
 * Each rank prints one line per result on stdout ("<status> <ms> <text>"),
 * which the driver reads through a pipe.
 *
 * CHORUS_EXIT_TRIALS: trials per channel and variant (default 3; the
 * sanitizer builds run 1).  CHORUS_EXIT_SEED: the first seed.
 * CHORUS_EXIT_CHANNEL ("shared memory", "tcp", "encrypted tcp", "ucx") and
 * CHORUS_EXIT_VARIANT ("timeout", "leave", "thread"): only those trials.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus.h"
#include "child_store.h"

#define MAXR 4
#define SECRET "exit-test-secret"

enum { V_TIMEOUT, V_LEAVE, V_THREAD, NVARIANTS };
static const char *const variant_names[] = {"timeout", "leave", "thread"};

/* ------------------------------------------------------------ a rank */

static void say(chorus_result_t st, double ms, const char *text) {
  char line[1500];
  int n = snprintf(line, sizeof line, "%d %.0f %s", (int)st, ms, text);
  for (int i = 0; i < n && i < (int)sizeof line; i++)
    if (line[i] == '\n') line[i] = ' ';
  printf("%s\n", line);
  fflush(stdout);
}

static int g_exit_delay_ms;
static void *exiter(void *arg) {
  (void)arg;
  usleep((useconds_t)g_exit_delay_ms * 1000);
  exit(0);
}


static int rank_main(int rank, int n, int port, const char *prefix, int variant,
                     uint64_t seed) {
  /* Every rank of the trial has started (the driver says so on stdin):
   * the short timeouts below then bound joining, not starting processes. */
  char go;
  if (read(0, &go, 1) != 1) return 5;
  /* Timeouts: the timeout variant's differ between ranks (0.6-1.3 s,
   * times the slack of slow builds), so that one rank times out, tells
   * the others and leaves while they still wait.  Joining has its own,
   * longer bound (child_config). */
  int timeout_ms = variant == V_TIMEOUT
                       ? (int)((600 + (int)((seed >> (8 * rank)) % 700)) * child_slack())
                       : 20000;
  chorus_config_t cfg = child_config(rank, n, port, prefix, SECRET, timeout_ms);
  chorus_comm_t comm = NULL;
  chorus_result_t st = chorus_comm_init(&cfg, &comm);
  if (st != CHORUS_OK) {
    say(st, 0, chorus_last_init_error());
    return 2;
  }
  /* Half the trials connect every pair first; in the others a pair's first
   * message may be the failure itself. */
  if (seed & 1) {
    st = chorus_barrier(comm, NULL);
    if (st != CHORUS_OK) {
      say(st, 0, chorus_comm_last_error(comm));
      /* The barrier ends at different moments on different ranks: the
       * leaver may be out of it and gone while a survivor still waits in
       * it, which then fails as it should (the driver checks why). */
      if (variant == V_TIMEOUT || rank == n - 1) return 3;
      chorus_comm_destroy(comm);
      say(CHORUS_OK, 0, "destroyed");
      return 0;
    }
  }
  say(CHORUS_OK, 0, "ready");
  static float big[1 << 16], small[4];
  double t0 = child_now_ms();
  int leaver = rank == n - 1;
  int delay_ms = (int)((seed >> 16) % 31);
  if (variant == V_TIMEOUT) {
    /* Polled (test) or waited, by the draw. */
    chorus_work_t w = NULL;
    st = chorus_recv(comm, small, 1, CHORUS_FLOAT32, (rank + 1) % n, 9, &w);
    if (st == CHORUS_OK) {
      if (seed & 2)
        while ((st = chorus_work_test(w)) == CHORUS_INPROGRESS) usleep(500);
      else
        st = chorus_work_wait(w, -1);
    }
    say(st, child_now_ms() - t0, w ? chorus_work_error(w) : chorus_comm_last_error(comm));
    return 0; /* the work and the communicator are left alive */
  }
  if (leaver && variant == V_LEAVE) {
    chorus_work_t ws = NULL, wr = NULL;
    chorus_send(comm, big, sizeof big / sizeof *big, CHORUS_FLOAT32, 0, 5, &ws);
    chorus_recv(comm, small, 1, CHORUS_FLOAT32, n > 2 ? 1 : 0, 6, &wr);
    usleep((useconds_t)delay_ms * 1000);
    say(CHORUS_OK, 0, "leaving");
    return 0;
  }
  if (leaver && variant == V_THREAD) {
    g_exit_delay_ms = delay_ms;
    pthread_t t;
    if (pthread_create(&t, NULL, exiter, NULL) != 0) return 4;
    say(CHORUS_OK, 0, "leaving");
    st = chorus_recv(comm, small, 1, CHORUS_FLOAT32, 0, 6, NULL);
    /* The exit may wake this receive before the process ends. */
    for (;;) pause();
  }
  /* A survivor: blocked on the leaver until the library says it left. */
  st = chorus_recv(comm, small, 1, CHORUS_FLOAT32, n - 1, 7, NULL);
  say(st, child_now_ms() - t0, chorus_comm_last_error(comm));
  t0 = child_now_ms();
  chorus_comm_destroy(comm);
  say(CHORUS_OK, child_now_ms() - t0, "destroyed");
  return 0;
}

/* ---------------------------------------------------------- the driver */

static pid_t g_store_pid;
static pid_t g_pids[MAXR];
static int g_fds[MAXR], g_go[MAXR];
static char g_job[32];

static void cleanup(void) {
  children_kill(g_pids, g_fds, MAXR);
  child_store_stop(&g_store_pid);
}

typedef struct {
  const char *name;
  const char *transport; /* CHORUS_TRANSPORT, or NULL */
  int encrypt;
  int host_per_rank;
} channel_t;

static const channel_t channels[] = {
    {"shared memory", NULL, 0, 0},
    {"tcp", "tcp", 0, 0},
    {"encrypted tcp", "tcp", 1, 0},
#ifdef CHORUS_TEST_UCX
    {"ucx", "ucx", 0, 1},
#endif
};

/* Starts rank r of n as a fresh process of this program. */
static void start_rank(const char *self, int r, int n, int port, const char *prefix,
                       const channel_t *ch, int variant, uint64_t seed) {
  int p[2], in[2];
  if (pipe(p) < 0 || pipe(in) < 0) _exit(1);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    child_die_with_parent(parent);
    close(p[0]);
    close(in[1]);
    dup2(p[1], 1);
    dup2(in[0], 0);
    close(p[1]);
    close(in[0]);
    for (int k = 0; k < MAXR; k++)
      if (g_go[k] > 0) close(g_go[k]);
    /* What a process that never destroys leaves allocated is the point of
     * the test, not a leak to report (ASan builds). */
    const char *asan = getenv("ASAN_OPTIONS");
    char opts[512];
    snprintf(opts, sizeof opts, "%s%sdetect_leaks=0", asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    if (ch->transport) setenv("CHORUS_TRANSPORT", ch->transport, 1);
    if (ch->encrypt) setenv("CHORUS_ENCRYPT", "1", 1);
    if (ch->host_per_rank) {
      char id[16];
      snprintf(id, sizeof id, "h%d", r);
      setenv("CHORUS_HOST_ID", id, 1);
    }
    char a[6][32];
    snprintf(a[0], 32, "%d", r);
    snprintf(a[1], 32, "%d", n);
    snprintf(a[2], 32, "%d", port);
    snprintf(a[3], 32, "%s", prefix);
    snprintf(a[4], 32, "%d", variant);
    snprintf(a[5], 32, "%llu", (unsigned long long)seed);
    execl(self, self, "--rank", a[0], a[1], a[2], a[3], a[4], a[5], (char *)NULL);
    _exit(127);
  }
  close(p[1]);
  close(in[0]);
  g_pids[r] = pid;
  g_fds[r] = p[0];
  g_go[r] = in[1];
}

typedef struct {
  char buf[8192];
  size_t len;
  int lines;
  int eof;
  int status; /* wait status, valid once reaped */
  int reaped;
  double exited_at;
} out_t;

/* Reads the ranks' output and reaps them until every rank has exited or
 * the deadline passes. */
static void gather(out_t *out, int n, double deadline) {
  for (;;) {
    int open = 0;
    struct pollfd pf[MAXR];
    int who[MAXR], k = 0;
    for (int r = 0; r < n; r++) {
      if (!out[r].reaped && g_pids[r] > 0 && waitpid(g_pids[r], &out[r].status, WNOHANG) ==
                                                 g_pids[r]) {
        out[r].reaped = 1;
        out[r].exited_at = child_now_ms();
        g_pids[r] = 0;
      }
      if (!out[r].eof) {
        pf[k] = (struct pollfd){.fd = g_fds[r], .events = POLLIN};
        who[k++] = r;
      }
      if (!out[r].reaped || !out[r].eof) open = 1;
    }
    if (!open) return;
    double left = deadline - child_now_ms();
    if (left <= 0) return;
    int rc = poll(pf, (nfds_t)k, k ? (left < 20 ? (int)left : 20) : 0);
    if (!k) usleep(10000);
    if (rc <= 0) continue;
    for (int i = 0; i < k; i++) {
      if (!pf[i].revents) continue;
      out_t *o = &out[who[i]];
      ssize_t got = read(pf[i].fd, o->buf + o->len, sizeof o->buf - 1 - o->len);
      if (got <= 0) {
        o->eof = 1;
        continue;
      }
      o->len += (size_t)got;
      o->buf[o->len] = '\0';
    }
  }
}

/* The line'th report ("<status> <ms> <text>") of a rank's output; other
 * lines (UCX logs to stdout) are skipped. */
static int line_of(const out_t *o, int line, int *status, double *ms, const char **text,
                   char *scratch, size_t cap) {
  int seen = 0;
  for (const char *p = o->buf; p && *p;) {
    const char *e = strchr(p, '\n');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len >= cap) len = cap - 1;
    memcpy(scratch, p, len);
    scratch[len] = '\0';
    p = e ? e + 1 : NULL;
    char c;
    if (sscanf(scratch, "%d %lf %c", status, ms, &c) < 2 || scratch[0] == '[') continue;
    if (seen++ < line) continue;
    const char *t = strchr(scratch, ' ');
    t = t ? strchr(t + 1, ' ') : NULL;
    *text = t ? t + 1 : "";
    return 1;
  }
  return 0;
}


static const char *describe(int status, char *buf, size_t cap) {
  if (WIFEXITED(status)) snprintf(buf, cap, "exit status %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status)) snprintf(buf, cap, "killed by %s", strsignal(WTERMSIG(status)));
  else snprintf(buf, cap, "wait status %#x", status);
  return buf;
}

/* One trial; returns 1 when it passed, printing why not otherwise. */
static int trial(const char *self, int port, int id, const channel_t *ch, int variant,
                 uint64_t seed) {
  int n = 2 + (int)(seed >> 40) % 2; /* 2 or 3 ranks */
  char prefix[32];
  snprintf(prefix, sizeof prefix, "t%d/", id);
  double t0 = child_now_ms();
  for (int r = 0; r < n; r++) start_rank(self, r, n, port, prefix, ch, variant, seed);
  for (int r = 0; r < n; r++) {
    (void)!write(g_go[r], "g", 1);
    close(g_go[r]);
    g_go[r] = 0;
  }
  out_t out[MAXR];
  memset(out, 0, sizeof out);
  const double k = child_slack();
  /* Start-up (scrypt, init) plus the longest timeout, plus the way out. */
  gather(out, n, t0 + (15000 + 3000) * k);
  int hung = 0;
  for (int r = 0; r < n; r++) hung |= !out[r].reaped;
  children_kill(g_pids, g_fds, MAXR);
  char why[2048] = "";
  size_t wl = 0;
#define WHY(...) (wl += (size_t)snprintf(why + wl, wl < sizeof why ? sizeof why - wl : 0, __VA_ARGS__))
  char scratch[1500], desc[64];
  int leaver = n - 1;
  double left_at = 0;
  for (int r = 0; r < n; r++) {
    int st;
    double ms;
    const char *text;
    if (!out[r].reaped) {
      WHY(" rank %d did not exit (hang);", r);
      continue;
    }
    if (!WIFEXITED(out[r].status) || WEXITSTATUS(out[r].status) != 0)
      WHY(" rank %d: %s;", r, describe(out[r].status, desc, sizeof desc));
    int got = line_of(&out[r], 0, &st, &ms, &text, scratch, sizeof scratch);
    /* A survivor may fail in the first barrier already (the leaver left
     * it sooner): that failure is then its first report. */
    int early = got && st != CHORUS_OK && variant != V_TIMEOUT && r != leaver;
    if (!got || (st != CHORUS_OK && !early)) {
      WHY(" rank %d never got ready;", r);
      continue;
    }
    if (variant != V_TIMEOUT && r == leaver) {
      left_at = out[r].exited_at;
      continue;
    }
    if (!early && !line_of(&out[r], 1, &st, &ms, &text, scratch, sizeof scratch)) {
      WHY(" rank %d reported no failure;", r);
      continue;
    }
    if (st != CHORUS_ERR_TIMEOUT && st != CHORUS_ERR_REMOTE)
      WHY(" rank %d: status %d (%s): %s;", r, st, chorus_strerror((chorus_result_t)st), text);
    if (variant != V_TIMEOUT) {
      char name[16];
      snprintf(name, sizeof name, "rank %d", leaver);
      if (!strstr(text, name)) WHY(" rank %d: the error does not name %s: %s;", r, name, text);
    }
    /* Every peer is named with its address (docs/errors.md), over UCX too. */
    if (strstr(text, "(?)") || strstr(text, ", ?)"))
      WHY(" rank %d: a peer without its address: %s;", r, text);
  }
  /* Survivors fail soon after the leaver is gone. */
  if (variant != V_TIMEOUT && left_at > 0)
    for (int r = 0; r < leaver; r++)
      if (out[r].reaped && out[r].exited_at - left_at > 3000 * k)
        WHY(" rank %d went on %.0f ms after rank %d left;", r, out[r].exited_at - left_at, leaver);
  char names[1024];
  if (child_job_shm(g_job, names, sizeof names, 0)) WHY(" /dev/shm names left: %s;", names);
  int ok = why[0] == '\0';
  printf("  %-13s %-7s seed %-20llu %d ranks%s: %s%s\n", ch->name, variant_names[variant],
         (unsigned long long)seed, n, (seed & 1) ? ", connected" : "", ok ? "ok" : "FAILED",
         hung ? " (hang)" : "");
  if (!ok) {
    printf("    %s\n", why);
    for (int r = 0; r < n; r++) printf("    rank %d said: %s\n", r, out[r].buf);
    /* Names this trial left would fail every later trial too. */
    child_job_shm(g_job, names, sizeof names, 1);
  }
  return ok;
}

int main(int argc, char **argv) {
  if (argc == 8 && !strcmp(argv[1], "--rank"))
    return rank_main(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), argv[5], atoi(argv[6]),
                     strtoull(argv[7], NULL, 10));
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* The job id names this run's shared memory: only those names are ours. */
  snprintf(g_job, sizeof g_job, "exit%d", (int)getpid());
  /* Before the store starts: the job id salts the key a secret gives. */
  setenv("CHORUS_JOB_ID", g_job, 1);
  atexit(cleanup);
  int port = child_store_start(SECRET, &g_store_pid);
  if (port <= 0) {
    fprintf(stderr, "test_exit: cannot start the store\n");
    return 1;
  }
  const char *v = getenv("CHORUS_EXIT_TRIALS");
  int trials = v ? atoi(v) : 3;
  v = getenv("CHORUS_EXIT_SEED");
  uint64_t seed = v ? strtoull(v, NULL, 10) : 1;
  /* One channel and/or one variant, by name, for hunting one case. */
  const char *only_ch = getenv("CHORUS_EXIT_CHANNEL"), *only_v = getenv("CHORUS_EXIT_VARIANT");
  int id = 0, failed = 0, total = 0;
  for (size_t c = 0; c < sizeof channels / sizeof *channels; c++)
    for (int variant = 0; variant < NVARIANTS; variant++)
      for (int i = 0; i < trials; i++) {
        if ((only_ch && *only_ch && strcmp(only_ch, channels[c].name)) ||
            (only_v && *only_v && strcmp(only_v, variant_names[variant])))
          continue;
        uint64_t s = (seed + (uint64_t)id) * 0x9e3779b97f4a7c15ull;
        s ^= s >> 29;
        total++;
        failed += !trial("/proc/self/exe", port, id++, &channels[c], variant, s);
      }
  printf("%d of %d trials passed\n", total - failed, total);
  return failed ? 1 : 0;
}
