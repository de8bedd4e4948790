/*
 * guard.c - what cleans up after the workers: the guard process that
 * SIGKILLs their process groups if chorusrun dies abruptly, the sweep of
 * descendants reparented to us, and the removal of /dev/shm names a crashed
 * worker left.
 */
#include "launcher/launcher.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/host.h"
#include "util/log.h"
#include "util/util.h"

/* ----------------------------------------------------------- the guard
 *
 * PR_SET_PDEATHSIG kills a worker when chorusrun dies, but not the worker's
 * own children.  The guard is a small process forked before anything else
 * (in its own session, so terminal signals do not reach it) that learns
 * every worker's process group through a pipe.  When that pipe reaches EOF
 * while the guard still lives, chorusrun died abruptly (SIGKILL, crash, or
 * an exit() on a path that did not stop the workers) and the guard SIGKILLs
 * every group still listed, then exits.  Messages are 8 bytes
 * (atomic on a pipe): op '+' (group started) or '-' (group gone), then the
 * pid.  On a normal exit chorusrun kills and reaps the guard itself.
 */
static int g_guard_fd = -1;
pid_t g_guard_pid = -1;
char g_job_id[17]; /* for removing the job's shared-memory names */
char g_secret_file[4096]; /* the secret file we made, removed at exit */

/* Workers unlink their shared-memory segments as soon as every rank mapped
 * them; a crash inside that window leaves a name in /dev/shm.  Names of
 * this job's workers on this host start with "chorus-<job id>-<host tag>-"
 * (src/transport/shm.c); other hosts of the job may share /dev/shm (emulated
 * hosts, containers), and their names are theirs to remove. */
void remove_job_segments(void) {
  char prefix[48], tag[9];
  if (!g_job_id[0]) return;
  chorus__host_tag(tag);
  snprintf(prefix, sizeof prefix, "chorus-%s-%s-", g_job_id, tag);
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  for (struct dirent *e; (e = readdir(d));) {
    if (strncmp(e->d_name, prefix, strlen(prefix))) continue;
    if (unlinkat(dirfd(d), e->d_name, 0) == 0)
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "removed /dev/shm/%s left by a crashed worker", e->d_name);
  }
  closedir(d);
}

typedef struct {
  char op;
  char pad[3];
  int32_t pid;
} guard_msg_t;

static void guard_main(int rfd) {
  pid_t *pids = NULL;
  size_t n = 0, cap = 0;
  guard_msg_t m;
  for (;;) {
    ssize_t got = read(rfd, &m, sizeof m);
    if (got < 0 && errno == EINTR) continue;
    if (got != (ssize_t)sizeof m) break; /* EOF: chorusrun is gone */
    if (m.op == '+') {
      if (n == cap) {
        cap = cap ? 2 * cap : 64;
        pid_t *np = realloc(pids, cap * sizeof *np);
        if (!np) continue;
        pids = np;
      }
      pids[n++] = m.pid;
    } else if (m.op == '-') {
      for (size_t i = 0; i < n; i++)
        if (pids[i] == m.pid) {
          pids[i] = pids[--n];
          break;
        }
    }
  }
  for (size_t i = 0; i < n; i++) kill(-pids[i], SIGKILL);
  if (n) remove_job_segments();
  if (g_secret_file[0]) unlink(g_secret_file);
  _exit(0);
}

/* Forks the guard; failure only loses this safety net. */
void guard_start(void) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return;
  pid_t pid = fork();
  if (pid == 0) {
    /* Single-threaded here (before the store starts). */
    setsid();
    prctl(PR_SET_NAME, "chorusrun-guard");
    int null = open("/dev/null", O_RDWR);
    if (null >= 0) {
      dup2(null, 0);
      dup2(null, 1);
      dup2(null, 2);
    }
    struct sigaction ign;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigaction(SIGINT, &ign, NULL);
    sigaction(SIGTERM, &ign, NULL);
    sigaction(SIGHUP, &ign, NULL);
    sigaction(SIGQUIT, &ign, NULL);
    sigaction(SIGPIPE, &ign, NULL);
    /* Keep only the read end: close everything else we might hold. */
    for (int fd = 3; fd < 1024; fd++)
      if (fd != p[0]) close(fd);
    guard_main(p[0]);
  }
  close(p[0]);
  if (pid < 0) {
    close(p[1]);
    return;
  }
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  g_guard_fd = p[1];
  g_guard_pid = pid;
}

/* Called for every child we reap: if it was the guard, stop using it. */
void guard_reaped(pid_t pid) {
  if (pid != g_guard_pid || pid <= 0) return;
  g_guard_pid = -1;
  if (g_guard_fd >= 0) close(g_guard_fd);
  g_guard_fd = -1;
}

/* Reaps every exited child that is not a worker (called when no worker is
 * left unreaped). */
static void reap_others(void) {
  pid_t pid;
  while ((pid = waitpid(-1, NULL, WNOHANG)) > 0 || (pid < 0 && errno == EINTR)) guard_reaped(pid);
}

/* Ends the guard on a normal exit (SIGKILL, so the wait is short). */
void guard_stop(void) {
  if (g_guard_pid <= 0) return;
  kill(g_guard_pid, SIGKILL);
  while (waitpid(g_guard_pid, NULL, 0) < 0 && errno == EINTR) {}
  guard_reaped(g_guard_pid);
}

void guard_send(char op, pid_t pid) {
  if (g_guard_fd < 0) return;
  guard_msg_t m = {.op = op, .pid = (int32_t)pid};
  ssize_t w;
  do w = write(g_guard_fd, &m, sizeof m);
  while (w < 0 && errno == EINTR);
}


/* Kills and reaps every remaining child of ours (descendants the workers
 * left behind and that were reparented to us), bounded by ABANDON_MS. */
void sweep_children(void) {
  int64_t deadline = chorus__deadline_ms(ABANDON_MS);
  for (;;) {
    reap_others();
    int found = 0;
    DIR *d = opendir("/proc/self/task");
    if (d) {
      struct dirent *de;
      while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char path[300];
        snprintf(path, sizeof path, "/proc/self/task/%s/children", de->d_name);
        FILE *f = fopen(path, "re");
        if (!f) continue;
        long pid;
        while (fscanf(f, "%ld", &pid) == 1) {
          if ((pid_t)pid == g_guard_pid) continue;
          /* A child's pid stays ours until we reap it: no reuse race. */
          kill((pid_t)pid, SIGKILL);
          found = 1;
        }
        fclose(f);
      }
      closedir(d);
    }
    if (!found) {
      /* No /proc children file (or nothing left): reap what is ready. */
      reap_others();
      return;
    }
    if (chorus__now_ns() >= deadline) {
      fprintf(stderr, "chorusrun: some leftover processes did not die after SIGKILL\n");
      return;
    }
    struct timespec ts = {0, 10 * 1000000};
    nanosleep(&ts, NULL);
  }
}
