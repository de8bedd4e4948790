/*
 * child_store.h - for drivers that fork ranks: children that die with the
 * driver, and a store served by a child of its own, so the driver stays
 * single-threaded while it forks (safe, and allowed under ThreadSanitizer).
 */
#ifndef CHORUS_TEST_CHILD_STORE_H
#define CHORUS_TEST_CHILD_STORE_H

#include <signal.h>
#include <sys/prctl.h>
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

/* Kills and reaps the store child, if any. */
static inline void child_store_stop(pid_t *pid) {
  if (*pid > 0) {
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
  }
}

#endif
