/*
 * child_store.h - for drivers that fork ranks: children that die with the
 * driver, and a store served by a child of its own, so the driver stays
 * single-threaded while it forks (safe, and allowed under ThreadSanitizer).
 */
#ifndef CHORUS_TEST_CHILD_STORE_H
#define CHORUS_TEST_CHILD_STORE_H

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus.h"

/* Called first in a child: it dies with the driver, even if the driver is
 * SIGKILLed (CTest timeout). */
static inline void child_die_with_parent(pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(1);
}

/* Forks a rank that dies with the driver and reports through a pipe.  In
 * the child returns the pipe's write end; in the driver returns -1 with
 * *pid and *rfd (the read end) set.  Exits the driver if pipe() fails. */
static inline int child_fork_reporting(pid_t *pid, int *rfd) {
  int p[2];
  if (pipe(p) < 0) _exit(1);
  pid_t self = getpid();
  *pid = fork();
  if (*pid == 0) {
    child_die_with_parent(self);
    close(p[0]);
    return p[1];
  }
  close(p[1]);
  *rfd = p[0];
  return -1;
}

/* The slack of slow builds (CHORUS_TEST_SLACK, the sanitizer passes'
 * timeout multiplier), at least 1: timing bounds are multiplied by it. */
static inline double child_slack(void) {
  const char *v = getenv("CHORUS_TEST_SLACK");
  double k = v ? atof(v) : 1.0;
  return k >= 1.0 ? k : 1.0;
}

/* The config of a forked rank joining the store the driver serves on
 * 127.0.0.1:port, under its own key prefix (copied by chorus_comm_init). */
static inline chorus_config_t child_config(int rank, int n, int port, const char *prefix,
                                           const char *secret, int timeout_ms) {
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = rank;
  cfg.world_size = n;
  cfg.store_host = "127.0.0.1";
  cfg.store_port = port;
  cfg.host_store = 0;
  cfg.timeout_ms = timeout_ms;
  /* Joining is bounded apart from the waits the test times: starting
   * several ranks on a loaded 2-core machine can take seconds. */
  cfg.init_timeout_ms = (int)(60000 * child_slack());
  cfg.store_prefix = prefix;
  cfg.job_secret = secret;
  return cfg;
}

/* Starts a store on 127.0.0.1 (any free port) with secret in a child;
 * *pid receives the child's pid.  Returns the port, or -1. */
static inline int child_store_start(const char *secret, pid_t *pid) {
  int p[2];
  if (pipe(p) < 0) return -1;
  pid_t self = getpid();
  *pid = fork();
  if (*pid == 0) {
    child_die_with_parent(self);
    close(p[0]);
    chorus_store_server_t *srv;
    int port = -1;
    if (chorus_store_server_start("127.0.0.1", 0, secret, &srv) == CHORUS_OK)
      port = chorus_store_server_port(srv);
    (void)!write(p[1], &port, sizeof port);
    close(p[1]);
    for (;;) pause(); /* until the driver kills us */
  }
  close(p[1]);
  int port = -1;
  if (*pid < 0 || read(p[0], &port, sizeof port) != (ssize_t)sizeof port) port = -1;
  close(p[0]);
  return port;
}

/* CLOCK_MONOTONIC in ms: the same clock in the driver and its children. */
static inline double child_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Kills (stopped ones too) and reaps children pids[0..n), closes their
 * report pipes fds[0..n) and zeroes both. */
static inline void children_kill(pid_t *pids, int *fds, int n) {
  for (int r = 0; r < n; r++) {
    if (pids[r] > 0) {
      kill(pids[r], SIGCONT);
      kill(pids[r], SIGKILL);
      waitpid(pids[r], NULL, 0);
      pids[r] = 0;
    }
    if (fds[r] > 0) close(fds[r]);
    fds[r] = 0;
  }
}

/* Kills and reaps the store child, if any. */
static inline void child_store_stop(pid_t *pid) {
  if (*pid > 0) {
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
  }
}


static inline int child_cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The names in /dev/shm of job (its segments are "chorus-<job>-..."),
 * sorted, space-separated, into buf; with unlink_them, also removes them.
 * Other jobs on the machine are not the test's to judge.  Returns how
 * many there were (at most 64 are listed). */
static inline int child_job_shm(const char *job, char *buf, size_t cap, int unlink_them) {
  char prefix[64], *names[64];
  int n = 0;
  snprintf(prefix, sizeof prefix, "chorus-%s-", job);
  buf[0] = '\0';
  DIR *d = opendir("/dev/shm");
  struct dirent *e;
  while (d && (e = readdir(d)) && n < 64)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) names[n++] = strdup(e->d_name);
  if (d) closedir(d);
  qsort(names, (size_t)n, sizeof *names, child_cmp_str);
  for (int i = 0; i < n; i++) {
    if (!names[i]) continue;
    size_t used = strlen(buf);
    snprintf(buf + used, cap - used, "%s ", names[i]);
    if (unlink_them) {
      char path[320];
      snprintf(path, sizeof path, "/dev/shm/%s", names[i]);
      unlink(path);
    }
    free(names[i]);
  }
  return n;
}

#endif
