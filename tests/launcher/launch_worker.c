/*
 * launch_worker.c - a worker program for test_launcher.sh: chorusrun starts
 * it N times and the script checks what comes out.  The mode is argv[1]:
 *
 *   env                     print the launcher contract variables, NAME=value
 *   lines N                 print N long pattern lines to stdout and to stderr,
 *                           each written in several pieces (tests that lines
 *                           are never mixed)
 *   mixed                   a stdout line, a stderr line, a 100000-byte line,
 *                           then a last line without newline
 *   exit R CODE [sleep|sleep-ignore-term]
 *                           rank R prints a line and exits with CODE; the
 *                           others exit 0 (or sleep forever, possibly
 *                           ignoring SIGTERM)
 *   signal R SIG            rank R kills itself with signal SIG; the others
 *                           sleep forever
 *   sleep                   sleep forever
 *   sleep-ignore-term       ignore SIGTERM and sleep forever
 *   fork-sleep              fork a child that sleeps forever, then sleep too
 *   trap                    print "rankN got SIGxxx" on SIGINT/SIGTERM/SIGHUP
 *                           and exit 0
 *   restart-fail R CODE     rank R exits CODE while CHORUS_RESTART_COUNT is 0;
 *                           every rank succeeds on later restarts
 *   culprit R kill|stop|busy  the world all_reduces in a loop, a step every
 *                           millisecond; after 20 steps rank R SIGKILLs or
 *                           SIGSTOPs itself, or sleeps in a loop (alive but
 *                           stuck in user code) (R -1: nobody); the others
 *                           print the error of the all_reduce that failed
 *                           ("rankN failed: ...") and exit 2
 *   inplace R STEP          the world all_reduces 200 steps; rank R SIGKILLs
 *                           itself at STEP; the others shrink
 *                           (chorus_comm_shrink) and finish the 200 steps in
 *                           the smaller world, then print "rankN inplace done
 *                           size S sum X" (X: the sum of the survivors'
 *                           ranks, from an all_reduce in that world)
 *   round-wait K            print "rankN start round R world W node G/GW pid P
 *                           at T" (R: CHORUS_RESTART_COUNT, T: wall-clock
 *                           ms); below round K sleep forever, from round K
 *                           on print "rankN done round R world W" and exit 0
 *   reduce-loop K           form the world (chorus_comm_init_env) and
 *                           all_reduce 4 KiB every 10 ms; below round K
 *                           forever (printing "rankN reducing round R at T
 *                           sockets S", S: the process's open sockets once
 *                           the world formed, and after the first all_reduce
 *                           "rankN first all_reduce done at T sockets S")
 *                           and the error of a failed all_reduce, then exit
 *                           1), from round K on 20 steps, then print "rankN
 *                           done round R world W" and exit 0
 *   leak-shm                make an empty /dev/shm name the way a worker's
 *                           segment is named (job id, host tag), print
 *                           "made <path>" and SIGKILL itself
 *   store                   connect to the store (MASTER_ADDR, MASTER_PORT,
 *                           the secret from CHORUS_JOB_SECRET_FILE), set a key,
 *                           read every rank's
 *                           key (the only mode that uses libchorus)
 *
 * Sleeping workers print "rankN ready" first so the script can wait for
 * them.  Output is written with write(2), never buffered.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "util/host.h"

static int g_rank;

static void put(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(int fd, const char *fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof buf - 1) n = (int)sizeof buf - 1;
  if (n > 0) (void)!write(fd, buf, (size_t)n);
}

static void write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) return;
    p += w;
    n -= (size_t)w;
  }
}

static void sleep_forever(void) {
  put(1, "rank%d ready\n", g_rank);
  for (;;) pause();
}

static void on_trap(int sig) {
  const char *name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP";
  char buf[64];
  int n = snprintf(buf, sizeof buf, "rank%d got %s\n", g_rank, name);
  (void)!write(1, buf, (size_t)n);
  _exit(0);
}

/* One pattern line: "LINE-<rank>-<i>-" + 20 x "abcdefghij" + "-END\n",
 * written in three pieces with a yield between them. */
static void pattern_lines(int fd, int count) {
  char line[512];
  for (int i = 0; i < count; i++) {
    int n = snprintf(line, sizeof line, "LINE-%d-%d-", g_rank, i);
    for (int k = 0; k < 20; k++) n += snprintf(line + n, sizeof line - (size_t)n, "abcdefghij");
    n += snprintf(line + n, sizeof line - (size_t)n, "-END\n");
    int a = n / 3, b = 2 * n / 3;
    write_all(fd, line, (size_t)a);
    if (i % 7 == 0) sched_yield();
    write_all(fd, line + a, (size_t)(b - a));
    write_all(fd, line + b, (size_t)(n - b));
  }
}

static int store_mode(void) {
  const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
  const char *secret = NULL, *ws = getenv("WORLD_SIZE"); /* NULL: the library finds it */
  const char *restart = getenv("CHORUS_RESTART_COUNT");
  if (!addr || !port || !ws) {
    put(2, "rank%d: MASTER_ADDR/MASTER_PORT/WORLD_SIZE missing\n", g_rank);
    return 1;
  }
  chorus_store_t *st = NULL;
  chorus_result_t rc = chorus_store_connect(addr, atoi(port), secret, 20000, &st);
  if (rc != CHORUS_OK) {
    put(2, "rank%d: store connect to %s:%s failed: %s\n", g_rank, addr, port,
        chorus_strerror(rc));
    return 1;
  }
  char key[128], val[64];
  snprintf(key, sizeof key, "launch_test/%s/rank%d", restart ? restart : "0", g_rank);
  snprintf(val, sizeof val, "value-of-rank%d", g_rank);
  rc = chorus_store_set(st, key, val, strlen(val));
  if (rc != CHORUS_OK) {
    put(2, "rank%d: store set failed: %s %s\n", g_rank, chorus_strerror(rc),
        chorus_store_last_error(st));
    chorus_store_close(st);
    return 1;
  }
  int n = atoi(ws), seen = 0;
  for (int r = 0; r < n; r++) {
    snprintf(key, sizeof key, "launch_test/%s/rank%d", restart ? restart : "0", r);
    void *got = NULL;
    size_t len = 0;
    rc = chorus_store_get(st, key, &got, &len);
    if (rc != CHORUS_OK) {
      put(2, "rank%d: store get %s failed: %s %s\n", g_rank, key, chorus_strerror(rc),
          chorus_store_last_error(st));
      chorus_store_close(st);
      return 1;
    }
    snprintf(val, sizeof val, "value-of-rank%d", r);
    if (len == strlen(val) && !memcmp(got, val, len)) seen++;
    chorus_free(got);
  }
  chorus_store_close(st);
  put(1, "rank%d store ok: %d of %d keys\n", g_rank, seen, n);
  return seen == n ? 0 : 1;
}

/* Open file descriptors of this process that are sockets. */
static int count_sockets(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    char link[64], path[300];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, link, sizeof link - 1);
    if (k > 0) {
      link[k] = '\0';
      n += !strncmp(link, "socket:", 7);
    }
  }
  closedir(d);
  return n;
}

static int reduce_loop_mode(int until_round) {
  const char *rc = getenv("CHORUS_RESTART_COUNT");
  int round = rc ? atoi(rc) : -1;
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    put(2, "rank%d: init failed: %s\n", g_rank, chorus_last_init_error());
    return 1;
  }
  float buf[1024];
  for (int i = 0; i < 1024; i++) buf[i] = 1;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  put(1, "rank%d reducing round %d at %lld sockets %d\n", g_rank, round,
      (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000, count_sockets());
  for (int step = 0; round < until_round || step < 20; step++) {
    if (chorus_all_reduce(comm, buf, buf, 1024, CHORUS_FLOAT32, CHORUS_AVG, NULL) != CHORUS_OK) {
      put(2, "rank%d: all_reduce failed: %s\n", g_rank, chorus_comm_last_error(comm));
      return 1;
    }
    if (step == 0) {
      clock_gettime(CLOCK_REALTIME, &now);
      put(1, "rank%d first all_reduce done at %lld sockets %d\n", g_rank,
          (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000, count_sockets());
    }
    struct timespec ts = {0, 10 * 1000000};
    nanosleep(&ts, NULL);
  }
  put(1, "rank%d done round %d world %d\n", g_rank, round, chorus_comm_size(comm));
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}

static int inplace_mode(int victim, int kill_step) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    put(2, "rank%d: init failed: %s\n", g_rank, chorus_last_init_error());
    return 1;
  }
  for (int step = 0; step < 200;) {
    if (step == kill_step && g_rank == victim) raise(SIGKILL);
    float x = 1;
    if (chorus_all_reduce(comm, &x, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL) == CHORUS_OK) {
      step++;
      continue;
    }
    chorus_comm_t next;
    chorus_result_t st = chorus_comm_shrink(comm, 0, &next);
    if (st != CHORUS_OK) {
      put(2, "rank%d: shrink failed: %s\n", g_rank, chorus_comm_last_error(comm));
      return 1;
    }
    chorus_comm_destroy(comm);
    comm = next; /* the step that failed runs again in the smaller world */
  }
  int64_t mine = g_rank, sum = 0;
  if (chorus_all_reduce(comm, &mine, &sum, 1, CHORUS_INT64, CHORUS_SUM, NULL) != CHORUS_OK) {
    put(2, "rank%d: final all_reduce failed: %s\n", g_rank, chorus_comm_last_error(comm));
    return 1;
  }
  put(1, "rank%d inplace done size %d sum %lld\n", g_rank, chorus_comm_size(comm),
      (long long)sum);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}

static int culprit_mode(int victim, const char *how) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    put(2, "rank%d: init failed: %s\n", g_rank, chorus_last_init_error());
    return 1;
  }
  for (int step = 0;; step++) {
    if (step == 20 && g_rank == victim) {
      if (!strcmp(how, "busy")) /* alive (its heartbeats go on), in user code */
        for (;;) usleep(100000);
      raise(!strcmp(how, "stop") ? SIGSTOP : SIGKILL);
    }
    float x = 1;
    if (chorus_all_reduce(comm, &x, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL) != CHORUS_OK) {
      put(2, "rank%d failed: %s\n", g_rank, chorus_comm_last_error(comm));
      chorus_comm_abort(comm);
      return 2;
    }
    if (step == 20 && g_rank == 0) put(1, "rank0 at step 20\n");
    usleep(1000);
  }
}

int main(int argc, char **argv) {
  const char *r = getenv("RANK");
  g_rank = r ? atoi(r) : -1;
  if (argc < 2) {
    put(2, "usage: launch_worker MODE [args]\n");
    return 2;
  }
  const char *mode = argv[1];

  if (!strcmp(mode, "cpus")) { /* the CPUs this process may run on */
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    put(1, "CPUS=");
    for (int i = 0, first = 1; i < CPU_SETSIZE; i++)
      if (CPU_ISSET(i, &set)) {
        put(1, first ? "%d" : ",%d", i);
        first = 0;
      }
    put(1, "\n");
    return 0;
  }
  if (!strcmp(mode, "env")) {
    static const char *const vars[] = {
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "CHORUS_JOB_ID", "CHORUS_JOB_SECRET", "CHORUS_JOB_SECRET_FILE",
        "CHORUS_STORE_EXTERNAL", "CHORUS_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_MAX_RESTARTS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
      const char *v = getenv(vars[i]);
      put(1, "%s=%s\n", vars[i], v ? v : "<unset>");
    }
    /* The secret file's mode and first line, for the script to check. */
    const char *path = getenv("CHORUS_JOB_SECRET_FILE");
    struct stat sb;
    char secret[256] = "<unreadable>";
    FILE *f = path ? fopen(path, "r") : NULL;
    if (f && fgets(secret, sizeof secret, f)) secret[strcspn(secret, "\n")] = '\0';
    if (f) fclose(f);
    put(1, "SECRET_FILE_MODE=%o\n", path && stat(path, &sb) == 0 ? (unsigned)(sb.st_mode & 0777) : 0u);
    put(1, "SECRET=%s\n", secret);
    return 0;
  }
  if (!strcmp(mode, "lines") && argc >= 3) {
    int n = atoi(argv[2]);
    pattern_lines(1, n);
    pattern_lines(2, n);
    return 0;
  }
  if (!strcmp(mode, "mixed")) {
    put(1, "hello from stdout\n");
    put(2, "hello from stderr\n");
    size_t big = 100000;
    char *line = malloc(big + 1);
    if (!line) return 1;
    memset(line, 'x', big);
    line[big] = '\n';
    write_all(1, line, big + 1);
    free(line);
    put(1, "tail-no-newline");
    return 0;
  }
  if (!strcmp(mode, "exit") && argc >= 4) {
    if (g_rank == atoi(argv[2])) {
      /* Give the other ranks time to set up (ignore SIGTERM) first, so the
       * launcher's grace period is really exercised even on a loaded box. */
      if (argc >= 5) usleep(300 * 1000);
      put(2, "rank%d exiting with code %s\n", g_rank, argv[3]);
      return atoi(argv[3]);
    }
    if (argc >= 5 && !strcmp(argv[4], "sleep-ignore-term")) signal(SIGTERM, SIG_IGN);
    if (argc >= 5) sleep_forever();
    return 0;
  }
  if (!strcmp(mode, "signal") && argc >= 4) {
    if (g_rank == atoi(argv[2])) {
      put(2, "rank%d raising signal %s\n", g_rank, argv[3]);
      signal(atoi(argv[3]), SIG_DFL);
      raise(atoi(argv[3]));
      return 99; /* not reached for deadly signals */
    }
    sleep_forever();
  }
  if (!strcmp(mode, "sleep")) sleep_forever();
  if (!strcmp(mode, "sleep-ignore-term")) {
    signal(SIGTERM, SIG_IGN);
    sleep_forever();
  }
  if (!strcmp(mode, "fork-sleep")) {
    pid_t pid = fork();
    if (pid == 0) {
      for (;;) pause();
    }
    put(1, "rank%d forked child %d\n", g_rank, (int)pid);
    sleep_forever();
  }
  if (!strcmp(mode, "trap")) {
    signal(SIGINT, on_trap);
    signal(SIGTERM, on_trap);
    signal(SIGHUP, on_trap);
    sleep_forever();
  }
  if (!strcmp(mode, "restart-fail") && argc >= 4) {
    const char *rc = getenv("CHORUS_RESTART_COUNT");
    int restart = rc ? atoi(rc) : -1;
    put(1, "rank%d restart %d\n", g_rank, restart);
    if (restart == 0 && g_rank == atoi(argv[2])) {
      put(2, "rank%d failing on restart 0\n", g_rank);
      return atoi(argv[3]);
    }
    return restart >= 0 ? 0 : 1;
  }
  if (!strcmp(mode, "round-wait") && argc >= 3) {
    const char *rc = getenv("CHORUS_RESTART_COUNT"), *ws = getenv("WORLD_SIZE");
    const char *g = getenv("GROUP_RANK"), *gw = getenv("GROUP_WORLD_SIZE");
    int round = rc ? atoi(rc) : -1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    put(1, "rank%d start round %d world %s node %s/%s pid %d at %lld\n", g_rank, round,
        ws ? ws : "?", g ? g : "?", gw ? gw : "?", (int)getpid(),
        (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    if (round < atoi(argv[2])) sleep_forever();
    put(1, "rank%d done round %d world %s\n", g_rank, round, ws ? ws : "?");
    return 0;
  }
  if (!strcmp(mode, "reduce-loop") && argc >= 3) return reduce_loop_mode(atoi(argv[2]));
  if (!strcmp(mode, "leak-shm")) {
    char tag[9], path[256];
    const char *job = getenv("CHORUS_JOB_ID");
    chorus__host_tag(tag);
    snprintf(path, sizeof path, "/dev/shm/chorus-%s-%s-0-0", job ? job : "nojob", tag);
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) return 3;
    close(fd);
    put(1, "made %s\n", path);
    raise(SIGKILL);
  }
  if (!strcmp(mode, "store")) return store_mode();
  if (!strcmp(mode, "inplace") && argc >= 4) return inplace_mode(atoi(argv[2]), atoi(argv[3]));
  if (!strcmp(mode, "culprit") && argc >= 4) return culprit_mode(atoi(argv[2]), argv[3]);

  put(2, "launch_worker: unknown mode or missing arguments: %s\n", mode);
  return 2;
}
