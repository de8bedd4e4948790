/*
 * chorusrun.c - the launcher: starts N workers on this machine with
 * torchrun's environment contract, hosts their rendezvous store, prefixes
 * their output, and stops (or restarts) the whole group when one fails.
 *
 * Design
 *  - One process, one thread of our own (plus the store server's thread,
 *    which blocks every signal).  Everything happens in one poll() loop
 *    over the workers' output pipes and a self-pipe.  Signal handlers only
 *    write the signal number into the self-pipe; the loop does the real work
 *    (reaping, forwarding, stopping), so nothing unsafe runs in a handler.
 *    All signals are blocked around fork() so a child never runs our
 *    handler before it resets them.
 *  - chorusrun hosts the store (chorus_store_server_start) for the whole
 *    job and tells workers CHORUS_STORE_EXTERNAL=1, so rank 0 does not serve
 *    one.  The store outlives restarts: it is never reset.  Each generation
 *    of workers gets CHORUS_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT)
 *    0, 1, ... and the library prefixes its rendezvous keys with it, so keys
 *    of a failed generation never collide with the next one.  A fresh job id
 *    and job secret (random hex) are made per run; the secret authenticates
 *    store and data connections.
 *  - Workers are started with fork + execve (the program is looked up in
 *    PATH before anything starts, so the child only calls async-signal-safe
 *    functions).  Each worker leads its own process group, so signals sent
 *    to the group reach its children too, and sets PR_SET_PDEATHSIG(SIGKILL)
 *    (checking getppid() afterwards to close the race with our death), so no
 *    worker outlives a chorusrun that was killed with SIGKILL.  chorusrun is
 *    also a child subreaper: descendants orphaned by a worker are reparented
 *    to it, so at the end of every generation it can kill and reap whatever
 *    the workers left behind, even outside their process groups.  Finally a
 *    small guard process (see "the guard" below) SIGKILLs the workers'
 *    process groups if chorusrun itself is SIGKILLed, so the workers'
 *    children do not survive that either.
 *  - Output: each worker's stdout and stderr are pipes read with poll(); a
 *    stream's partial line stays in its buffer until the newline arrives, so
 *    only whole lines are written, each with one writev() to our stdout or
 *    stderr behind a "[rankN]:" prefix.  A line longer than 64 KiB is split.
 *    A final unterminated line is flushed at EOF.  The last TAIL_LINES lines
 *    of each rank are kept for the failure report.
 *  - Stopping a generation (a worker failed, or we got SIGINT, SIGTERM,
 *    SIGHUP or SIGQUIT): send SIGTERM (or the signal received, forwarded)
 *    to every live worker's group, wait up to the grace period (a second
 *    signal cuts it short), then SIGKILL the groups.  When a worker is
 *    reaped its group is SIGKILLed too (its leftovers die with it).  Once all
 *    workers are reaped, the pipes are drained until EOF (at most DRAIN_MS,
 *    in case an escaped descendant still holds one).  Every wait is bounded:
 *    the loop polls at least once per second and gives up on processes that
 *    survive SIGKILL for ABANDON_MS.
 *  - The first worker that exits non-zero or by a signal while the group is
 *    running is the one blamed; workers that die because we stopped them are
 *    not.  Exit status: 0 if all succeeded, else the blamed worker's exit
 *    code (128+signal if killed by a signal), 128+signal when chorusrun was
 *    itself interrupted (no restart then), 2 for usage errors, 1 for other
 *    launcher errors, 127 when the program cannot be found.
 *  - --max-restarts K: after a failure the group is stopped as above, the
 *    report printed, and all N workers start again with the next
 *    CHORUS_RESTART_COUNT (same store, same job id and secret, same port).
 *
 * Single machine only for now: --nnodes other than 1 and --node-rank other
 * than 0 are refused.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/env.h"
#include "store/store.h"
#include "util/crypto.h"
#include "util/log.h"
#include "util/secret.h"
#include "util/util.h"

extern char **environ;

#define EXIT_USAGE 2
#define EXIT_LAUNCHER 1
#define EXIT_NOT_FOUND 127

#define LINE_CAP 65536        /* longest line before it is split */
#define TAIL_LINES 20         /* lines kept per rank for the failure report */
#define TAIL_LINE_MAX 1024    /* bytes kept of each of those lines */
#define DRAIN_MS 2000         /* wait for pipe EOF after all workers exited */
#define ABANDON_MS 10000      /* wait for processes to die after SIGKILL */
#define TICK_MS 1000          /* the loop wakes up at least this often */
#define MAX_NPROC 4096

/* ------------------------------------------------------------ data types */

typedef struct {
  int fd;      /* read end of the pipe, -1 once closed */
  int out_fd;  /* where its lines go: 1 or 2 */
  size_t len;  /* bytes of the pending partial line in buf */
  char *buf;   /* LINE_CAP bytes */
} stream_t;

typedef struct {
  int rank;
  pid_t pid;       /* also its process group id; 0 when not started */
  int running;     /* started and not reaped yet */
  int status;      /* wait status once reaped */
  stream_t st[2];  /* stdout, stderr */
  char *tail[TAIL_LINES];
  int tail_next, tail_count;
} worker_t;

typedef struct {
  /* options */
  int nproc;
  const char *master_addr;
  int master_port;
  int max_restarts;
  int prefix;
  int bind;     /* 1: each worker on its own share of our CPUs (--cpu-bind) */
  int64_t grace_ns;
  char **argv;  /* program and its arguments (NULL-terminated) */
  char *prog;   /* resolved path of argv[0] */
  /* runtime */
  int port;     /* the store's actual port */
  char job_id[17];
  char secret[CHORUS__SECRET_MAX];
  char secret_file[4096]; /* what workers get as CHORUS_JOB_SECRET_FILE */
  worker_t *w;
  int out_broken[3];  /* our stdout/stderr gave EPIPE: drop their output */
  int got_sig;        /* first SIGINT/SIGTERM/SIGHUP/SIGQUIT, else 0 */
} job_t;

typedef enum { GEN_OK, GEN_FAILED, GEN_SIGNALED, GEN_ERROR } gen_outcome_t;

/* ------------------------------------------------------------- signals */

static int g_selfpipe[2] = {-1, -1};
/* Handled signals.  The first four stop the job and are forwarded to the
 * workers; SIGCHLD only wakes the loop up. */
static const int g_sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD};
static struct sigaction g_old_act[CHORUS__ARRAY_LEN(g_sigs)];
static struct sigaction g_old_pipe;
static struct rlimit g_old_nofile; /* restored in the workers */
static int g_nofile_raised;

/* Async-signal-safe: only write(2), errno preserved. */
static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  (void)!write(g_selfpipe[1], &b, 1);
  errno = saved;
}

static int install_signals(void) {
  if (pipe2(g_selfpipe, O_CLOEXEC | O_NONBLOCK) != 0) return -1;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigfillset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_sigs); i++) {
    sigaction(g_sigs[i], NULL, &g_old_act[i]);
    /* Like nohup expects: a SIGHUP ignored at start stays ignored, for us
     * and the workers.  SIGINT/SIGQUIT are handled even when a
     * non-interactive shell started us in the background with them
     * ignored: `chorusrun ... & kill -INT $!` must stop the job. */
    if (g_sigs[i] == SIGHUP && g_old_act[i].sa_handler == SIG_IGN) continue;
    if (sigaction(g_sigs[i], &sa, NULL) != 0) return -1;
  }
  /* A closed stdout must not kill us (and with us the workers). */
  struct sigaction ign;
  memset(&ign, 0, sizeof ign);
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &g_old_pipe);
  return 0;
}

/* In a freshly forked worker (async-signal-safe): the signals we forward get
 * their default action, so a forwarded SIGINT/SIGTERM works even where we
 * were started with them ignored; the others get back what we inherited. */
static void child_reset_signals(void) {
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_sigs); i++) {
    int sig = g_sigs[i];
    if (sig == SIGINT || sig == SIGTERM || sig == SIGQUIT) sigaction(sig, &dfl, NULL);
    else sigaction(sig, &g_old_act[i], NULL);
  }
  sigaction(SIGPIPE, &g_old_pipe, NULL);
  if (g_nofile_raised) setrlimit(RLIMIT_NOFILE, &g_old_nofile);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
}

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
static pid_t g_guard_pid = -1;
static char g_job_id[17]; /* for removing the job's shared-memory names */
static char g_secret_file[4096]; /* the secret file we made, removed at exit */

/* Workers unlink their shared-memory segments as soon as every rank mapped
 * them; a crash inside that window leaves a name in /dev/shm.  Names of
 * this job start with "chorus-<job id>-" (see src/transport/shm.c). */
static void remove_job_segments(void) {
  char prefix[40];
  if (!g_job_id[0]) return;
  snprintf(prefix, sizeof prefix, "chorus-%s-", g_job_id);
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
static void guard_start(void) {
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
static void guard_reaped(pid_t pid) {
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
static void guard_stop(void) {
  if (g_guard_pid <= 0) return;
  kill(g_guard_pid, SIGKILL);
  while (waitpid(g_guard_pid, NULL, 0) < 0 && errno == EINTR) {}
  guard_reaped(g_guard_pid);
}

static void guard_send(char op, pid_t pid) {
  if (g_guard_fd < 0) return;
  guard_msg_t m = {.op = op, .pid = (int32_t)pid};
  ssize_t w;
  do w = write(g_guard_fd, &m, sizeof m);
  while (w < 0 && errno == EINTR);
}

static const char *signal_name(int sig) {
  switch (sig) {
#define S(name) case name: return #name;
    S(SIGHUP) S(SIGINT) S(SIGQUIT) S(SIGILL) S(SIGTRAP) S(SIGABRT) S(SIGBUS)
    S(SIGFPE) S(SIGKILL) S(SIGUSR1) S(SIGSEGV) S(SIGUSR2) S(SIGPIPE) S(SIGALRM)
    S(SIGTERM) S(SIGCHLD) S(SIGCONT) S(SIGSTOP) S(SIGTSTP) S(SIGTTIN) S(SIGTTOU)
    S(SIGURG) S(SIGXCPU) S(SIGXFSZ) S(SIGVTALRM) S(SIGPROF) S(SIGWINCH) S(SIGIO)
    S(SIGSYS)
#undef S
  }
  return "unknown signal";
}

/* ------------------------------------------------------------- helpers */

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die_usage(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("chorusrun: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\nTry 'chorusrun --help' for more information.\n", stderr);
  va_end(ap);
  exit(EXIT_USAGE);
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "chorusrun: out of memory\n");
    exit(EXIT_LAUNCHER);
  }
  return p;
}

static char *xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  return memcpy(xmalloc(n), s, n);
}

static char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xasprintf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  int n = vasprintf(&s, fmt, ap);
  va_end(ap);
  if (n < 0) {
    fprintf(stderr, "chorusrun: out of memory\n");
    exit(EXIT_LAUNCHER);
  }
  return s;
}

/* Lowercase hex of n random bytes into out (2n+1 bytes). */
static int random_hex(char *out, size_t n) {
  unsigned char raw[32];
  if (n > sizeof raw || chorus__random_bytes(raw, n) != 0) return -1;
  for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", raw[i]);
  return 0;
}

/* The job's secret: CHORUS_JOB_SECRET_FILE as given (workers read the same
 * file), else CHORUS_JOB_SECRET's value or a fresh random one, written to a
 * file of our own in the per-user runtime directory.  0, or -1 after a
 * message. */
static int job_secret(job_t *job) {
  char why[600];
  int have = chorus__secret_configured(job->secret, sizeof job->secret, why, sizeof why);
  if (have < 0) {
    fprintf(stderr, "chorusrun: %s\n", why);
    return -1;
  }
  const chorus__env_t *env = chorus__env();
  if (have && env->JOB_SECRET_FILE && *env->JOB_SECRET_FILE &&
      !(env->JOB_SECRET && *env->JOB_SECRET)) {
    snprintf(job->secret_file, sizeof job->secret_file, "%s", env->JOB_SECRET_FILE);
    return 0;
  }
  if (!have && chorus__secret_generate(job->secret, sizeof job->secret) != 0) {
    fprintf(stderr, "chorusrun: cannot get random bytes for the job secret\n");
    return -1;
  }
  char dir[3900];
  if (chorus__runtime_dir(dir, sizeof dir, why, sizeof why) < 0) {
    fprintf(stderr, "chorusrun: no private directory for the job secret: %s\n", why);
    return -1;
  }
  snprintf(job->secret_file, sizeof job->secret_file, "%s/job-%s.key", dir, job->job_id);
  int rc = chorus__secret_write_file(job->secret_file, job->secret);
  if (rc < 0) {
    fprintf(stderr, "chorusrun: cannot write %s: %s\n", job->secret_file, strerror(-rc));
    return -1;
  }
  snprintf(g_secret_file, sizeof g_secret_file, "%s", job->secret_file);
  return 0;
}

/* Two pipes per worker need descriptors: raise the soft limit towards the
 * hard one if the default (often 1024) is too small for nproc workers. */
static void raise_nofile(int nproc) {
  if (getrlimit(RLIMIT_NOFILE, &g_old_nofile) != 0) return;
  rlim_t want = (rlim_t)nproc * 4 + 64;
  if (g_old_nofile.rlim_cur == RLIM_INFINITY || g_old_nofile.rlim_cur >= want) return;
  struct rlimit r = g_old_nofile;
  r.rlim_cur = g_old_nofile.rlim_max == RLIM_INFINITY ? want : CHORUS__MIN(want, g_old_nofile.rlim_max);
  if (setrlimit(RLIMIT_NOFILE, &r) == 0) g_nofile_raised = 1;
}

/* Makes sure fds 0-2 exist, so pipes never land on them. */
static void ensure_std_fds(void) {
  for (int fd = 0; fd < 3; fd++) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    int n = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (n >= 0 && n != fd) {
      dup2(n, fd);
      close(n);
    }
  }
}

/* Looks the program up like execvp() would, so that the child can use
 * execve().  Returns a malloc'd path or NULL. */
static char *resolve_program(const char *name) {
  struct stat sb;
  if (strchr(name, '/')) {
    if (stat(name, &sb) == 0 && S_ISREG(sb.st_mode) && access(name, X_OK) == 0)
      return xstrdup(name);
    return NULL;
  }
  const char *path = getenv("PATH");
  if (!path) path = "/usr/local/bin:/bin:/usr/bin";
  for (const char *p = path;;) {
    const char *colon = strchr(p, ':');
    size_t dlen = colon ? (size_t)(colon - p) : strlen(p);
    char *cand = dlen ? xasprintf("%.*s/%s", (int)dlen, p, name) : xasprintf("./%s", name);
    if (stat(cand, &sb) == 0 && S_ISREG(sb.st_mode) && access(cand, X_OK) == 0)
      return cand;
    free(cand);
    if (!colon) break;
    p = colon + 1;
  }
  return NULL;
}

/* --------------------------------------------------------------- options */

static void usage(FILE *f) {
  fputs(
      "usage: chorusrun [options] [--] program [args...]\n"
      "\n"
      "Starts program N times on this machine with torchrun's environment\n"
      "contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,\n"
      "MASTER_ADDR, MASTER_PORT), hosts the rendezvous store the workers use,\n"
      "prefixes each line of their output with [rankN]:, and stops every worker\n"
      "when one fails.\n"
      "\n"
      "options:\n"
      "  -n, --nproc-per-node N  workers to start (default 1; auto: one per CPU)\n"
      "  --standalone            store on 127.0.0.1 with a free port chosen\n"
      "                          automatically (overrides --master-addr/-port)\n"
      "  --master-addr A         address of the store (default 127.0.0.1)\n"
      "  --master-port P         port of the store (default 29500; 0: any)\n"
      "  --rdzv-endpoint A[:P]   same as --master-addr A --master-port P\n"
      "  --nnodes 1              accepted; multi-node is not supported yet\n"
      "  --node-rank 0           accepted; multi-node is not supported yet\n"
      "  --max-restarts K        after a failure, restart the whole group up\n"
      "                          to K times (default 0)\n"
      "  --grace-period S        seconds between SIGTERM and SIGKILL when\n"
      "                          stopping workers (default 5)\n"
      "  --no-prefix             do not prefix output lines\n"
      "  --cpu-bind auto|none    auto (default; CHORUS_CPU_BIND): worker i runs\n"
      "                          on its own share of chorusrun's CPUs (CPU i mod\n"
      "                          C when there are more workers than CPUs), so\n"
      "                          the scheduler cannot stack ranks that wait on\n"
      "                          each other on one core; none: no binding\n"
      "  --print-env             list chorus's environment variables, exit\n"
      "  --env-markdown          the same list as a markdown table\n"
      "  -h, --help              this text\n"
      "Underscores may replace dashes (--nproc_per_node); --opt=value works.\n"
      "\n"
      "Workers also get CHORUS_JOB_ID, CHORUS_JOB_SECRET_FILE (a file only this\n"
      "user can read, holding a fresh random secret, or CHORUS_JOB_SECRET's value),\n"
      "CHORUS_STORE_EXTERNAL=1 and CHORUS_RESTART_COUNT (0, 1, ... per restart;\n"
      "the store keeps running across restarts and keys are separated by it).\n"
      "\n"
      "Exit status: 0 if every worker succeeded; else the first failing\n"
      "worker's exit code (128+N if it was killed by signal N); 128+N when\n"
      "chorusrun itself got signal N (SIGINT, SIGTERM, SIGHUP or SIGQUIT, forwarded to\n"
      "the workers); 2 for usage errors; 127 if the program is not found;\n"
      "1 for other errors.\n",
      f);
}

static long parse_int_opt(const char *opt, const char *v, long lo, long hi) {
  long x;
  if (chorus__parse_long(v, &x) != 0 || x < lo || x > hi)
    die_usage("invalid value '%s' for %s (expected an integer in %ld..%ld)", v, opt, lo, hi);
  return x;
}

typedef enum { ACT_RUN, ACT_PRINT_ENV, ACT_ENV_MARKDOWN, ACT_HELP } action_t;

static action_t parse_args(int argc, char **argv, job_t *job) {
  int standalone = 0, port_set = 0;
  action_t act = ACT_RUN;
  job->nproc = 1;
  job->master_addr = "127.0.0.1";
  job->master_port = 29500;
  job->max_restarts = 0;
  job->prefix = 1;
  /* CHORUS_CPU_BIND sets the default; --cpu-bind overrides it. */
  const char *bind_env = chorus__env()->CPU_BIND;
  job->bind = !bind_env || strcmp(bind_env, "none") != 0;
  job->grace_ns = 5000000000LL;
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--")) {
      i++;
      break;
    }
    if (a[0] != '-' || a[1] == '\0') break; /* the program */
    /* Normalize: name without leading dashes, '_' -> '-', split at '='. */
    char name[64];
    const char *val = NULL;
    if (a[1] == '-') {
      const char *eq = strchr(a + 2, '=');
      size_t n = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
      if (n >= sizeof name) die_usage("unknown option '%s'", a);
      memcpy(name, a + 2, n);
      name[n] = '\0';
      for (char *c = name; *c; c++)
        if (*c == '_') *c = '-';
      if (eq) val = eq + 1;
    } else if (a[1] == 'n') {
      snprintf(name, sizeof name, "nproc-per-node");
      if (a[2]) val = a + 2;
    } else if (a[1] == 'h' && !a[2]) {
      snprintf(name, sizeof name, "help");
    } else {
      die_usage("unknown option '%s'", a);
    }

    int flag = 1;
    if (!strcmp(name, "standalone")) standalone = 1;
    else if (!strcmp(name, "print-env")) act = ACT_PRINT_ENV;
    else if (!strcmp(name, "env-markdown")) act = ACT_ENV_MARKDOWN;
    else if (!strcmp(name, "no-prefix")) job->prefix = 0;
    else if (!strcmp(name, "help")) act = ACT_HELP;
    else flag = 0;
    if (flag) {
      if (val) die_usage("option '--%s' takes no value", name);
      continue;
    }

    static const char *const with_value[] = {
        "nproc-per-node", "master-addr", "master-port", "rdzv-endpoint", "nnodes",
        "node-rank",      "max-restarts", "grace-period", "cpu-bind"};
    int known = 0;
    for (size_t k = 0; k < CHORUS__ARRAY_LEN(with_value); k++)
      if (!strcmp(name, with_value[k])) known = 1;
    if (!known) die_usage("unknown option '%s'", a);
    if (!val) {
      if (i + 1 >= argc) die_usage("option '%s' needs a value", a);
      val = argv[++i];
    }

    if (!strcmp(name, "nproc-per-node")) {
      if (!strcmp(val, "auto") || !strcmp(val, "cpu")) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        job->nproc = n > 0 ? (int)CHORUS__MIN(n, MAX_NPROC) : 1;
      } else {
        job->nproc = (int)parse_int_opt("--nproc-per-node", val, 1, MAX_NPROC);
      }
    } else if (!strcmp(name, "master-addr")) {
      if (!*val) die_usage("--master-addr needs a non-empty address");
      job->master_addr = val;
    } else if (!strcmp(name, "master-port")) {
      job->master_port = (int)parse_int_opt("--master-port", val, 0, 65535);
      port_set = 1;
    } else if (!strcmp(name, "rdzv-endpoint")) {
      /* host[:port]; an IPv6 literal must be written [addr]:port. */
      static char host[256];
      const char *colon = strrchr(val, ':');
      if (val[0] == '[' && strchr(val, ']') && (!colon || colon < strchr(val, ']')))
        colon = NULL;
      size_t hl = colon ? (size_t)(colon - val) : strlen(val);
      if (hl == 0 || hl >= sizeof host) die_usage("invalid --rdzv-endpoint '%s'", val);
      memcpy(host, val, hl);
      host[hl] = '\0';
      if (host[0] == '[' && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
      }
      job->master_addr = host;
      if (colon) {
        job->master_port = (int)parse_int_opt("--rdzv-endpoint port", colon + 1, 0, 65535);
        port_set = 1;
      }
    } else if (!strcmp(name, "nnodes")) {
      /* torchrun takes N or MIN:MAX; only 1 (or 1:1) is supported. */
      if (strcmp(val, "1") != 0 && strcmp(val, "1:1") != 0)
        die_usage("multi-node not supported yet (--nnodes %s; only 1 is)", val);
    } else if (!strcmp(name, "node-rank")) {
      if (strcmp(val, "0") != 0)
        die_usage("multi-node not supported yet (--node-rank %s; only 0 is)", val);
    } else if (!strcmp(name, "cpu-bind")) {
      if (!strcmp(val, "auto") || !strcmp(val, "core")) job->bind = 1;
      else if (!strcmp(val, "none")) job->bind = 0;
      else die_usage("invalid value '%s' for --cpu-bind (auto or none)", val);
    } else if (!strcmp(name, "max-restarts")) {
      job->max_restarts = (int)parse_int_opt("--max-restarts", val, 0, 1000000);
    } else if (!strcmp(name, "grace-period")) {
      char *end = NULL;
      errno = 0;
      double s = strtod(val, &end);
      if (errno || !end || end == val || *end || !(s >= 0 && s <= 86400))
        die_usage("invalid value '%s' for --grace-period (seconds, 0..86400)", val);
      job->grace_ns = (int64_t)(s * 1e9);
    }
  }
  if (act != ACT_RUN) return act;
  if (i >= argc) die_usage("no program given");
  job->argv = argv + i;
  if (standalone) {
    if (port_set) fprintf(stderr, "chorusrun: --standalone ignores --master-port\n");
    job->master_addr = "127.0.0.1";
    job->master_port = 0;
  }
  return ACT_RUN;
}

/* ---------------------------------------------------------------- output */

/* Writes the iovecs fully to fd (EINTR, partial writes and a non-blocking fd
 * are handled).  On EPIPE and other errors the destination is marked broken
 * and its output dropped from then on. */
static void write_iov(job_t *job, int fd, struct iovec *iov, int cnt) {
  if (job->out_broken[fd]) return;
  while (cnt > 0) {
    ssize_t n = writev(fd, iov, cnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        (void)poll(&p, 1, 100);
        continue;
      }
      job->out_broken[fd] = 1;
      return;
    }
    while (cnt > 0 && (size_t)n >= iov->iov_len) {
      n -= (ssize_t)iov->iov_len;
      iov++;
      cnt--;
    }
    if (cnt > 0) {
      iov->iov_base = (char *)iov->iov_base + n;
      iov->iov_len -= (size_t)n;
    }
  }
}

static void tail_add(worker_t *w, const char *line, size_t len) {
  size_t keep = CHORUS__MIN(len, (size_t)TAIL_LINE_MAX);
  char *s = xmalloc(keep + 4);
  memcpy(s, line, keep);
  if (keep < len) memcpy(s + keep, "...", 3), keep += 3;
  s[keep] = '\0';
  free(w->tail[w->tail_next]);
  w->tail[w->tail_next] = s;
  w->tail_next = (w->tail_next + 1) % TAIL_LINES;
  if (w->tail_count < TAIL_LINES) w->tail_count++;
}

static void tail_clear(worker_t *w) {
  for (int i = 0; i < TAIL_LINES; i++) {
    free(w->tail[i]);
    w->tail[i] = NULL;
  }
  w->tail_next = w->tail_count = 0;
}

/* One line (without its newline) of worker w to stream s's destination. */
static void emit_line(job_t *job, worker_t *w, stream_t *s, const char *line, size_t len) {
  char prefix[32];
  int plen = job->prefix ? snprintf(prefix, sizeof prefix, "[rank%d]:", w->rank) : 0;
  struct iovec iov[3] = {{prefix, (size_t)plen}, {(void *)line, len}, {"\n", 1}};
  write_iov(job, s->out_fd, iov, 3);
  tail_add(w, line, len);
}

static void stream_close(job_t *job, worker_t *w, stream_t *s) {
  if (s->fd < 0) return;
  if (s->len > 0) emit_line(job, w, s, s->buf, s->len); /* unterminated last line */
  s->len = 0;
  close(s->fd);
  s->fd = -1;
}

/* Reads what is available (one read) and writes out the complete lines. */
static void stream_read(job_t *job, worker_t *w, stream_t *s) {
  ssize_t n = read(s->fd, s->buf + s->len, LINE_CAP - s->len);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) { /* EOF (or an error, treated alike) */
    stream_close(job, w, s);
    return;
  }
  size_t start = 0, scan = s->len, end = s->len + (size_t)n;
  for (;;) {
    char *nl = memchr(s->buf + scan, '\n', end - scan);
    if (!nl) break;
    size_t at = (size_t)(nl - s->buf);
    emit_line(job, w, s, s->buf + start, at - start);
    start = scan = at + 1;
  }
  if (start == 0 && end == LINE_CAP) { /* over-long line: split it here */
    emit_line(job, w, s, s->buf, end);
    start = end;
  }
  memmove(s->buf, s->buf + start, end - start);
  s->len = end - start;
}

/* ------------------------------------------------------------ spawning */

static const char *const g_contract_vars[] = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "CHORUS_JOB_ID", "CHORUS_JOB_SECRET", "CHORUS_JOB_SECRET_FILE", "CHORUS_STORE_EXTERNAL",
    "CHORUS_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"};

/* The worker's environment: ours minus the contract variables, plus their
 * values for this rank.  Every string is malloc'd; free with free_env(). */
static char **build_env(const job_t *job, int rank, int restart) {
  size_t n = 0;
  for (char **e = environ; *e; e++) n++;
  size_t cap = n + CHORUS__ARRAY_LEN(g_contract_vars) + 1, k = 0;
  char **env = xmalloc(cap * sizeof *env);
  for (char **e = environ; *e; e++) {
    int drop = 0;
    for (size_t v = 0; v < CHORUS__ARRAY_LEN(g_contract_vars) && !drop; v++) {
      size_t len = strlen(g_contract_vars[v]);
      drop = !strncmp(*e, g_contract_vars[v], len) && (*e)[len] == '=';
    }
    if (!drop) env[k++] = xstrdup(*e);
  }
  int ws = job->nproc;
  env[k++] = xasprintf("RANK=%d", rank);
  env[k++] = xasprintf("LOCAL_RANK=%d", rank);
  env[k++] = xasprintf("WORLD_SIZE=%d", ws);
  env[k++] = xasprintf("LOCAL_WORLD_SIZE=%d", ws);
  env[k++] = xasprintf("GROUP_RANK=0");
  env[k++] = xasprintf("GROUP_WORLD_SIZE=1");
  env[k++] = xasprintf("ROLE_RANK=%d", rank);
  env[k++] = xasprintf("ROLE_WORLD_SIZE=%d", ws);
  env[k++] = xasprintf("ROLE_NAME=default");
  env[k++] = xasprintf("MASTER_ADDR=%s", job->master_addr);
  env[k++] = xasprintf("MASTER_PORT=%d", job->port);
  env[k++] = xasprintf("CHORUS_JOB_ID=%s", job->job_id);
  /* The secret itself stays out of the environment (children inherit it,
   * crash reports print it): workers read this file, which only our user
   * can read, and chorusrun removes it when the job ends. */
  env[k++] = xasprintf("CHORUS_JOB_SECRET_FILE=%s", job->secret_file);
  env[k++] = xasprintf("CHORUS_STORE_EXTERNAL=1");
  env[k++] = xasprintf("CHORUS_RESTART_COUNT=%d", restart);
  env[k++] = xasprintf("TORCHELASTIC_RESTART_COUNT=%d", restart);
  env[k++] = xasprintf("TORCHELASTIC_MAX_RESTARTS=%d", job->max_restarts);
  env[k++] = xasprintf("TORCHELASTIC_RUN_ID=%s", job->job_id);
  env[k] = NULL;
  return env;
}

static void free_env(char **env) {
  for (char **e = env; *e; e++) free(*e);
  free(env);
}

/* Async-signal-safe message for the child after a failed execve(). */
static void child_exec_failed(const char *path, int err) {
  const char *what;
  switch (err) {
    case ENOENT: what = "No such file or directory"; break;
    case EACCES: what = "Permission denied"; break;
    case ENOEXEC: what = "Exec format error (missing #! line?)"; break;
    case E2BIG: what = "Argument list too long"; break;
    case ENOMEM: what = "Out of memory"; break;
    case ETXTBSY: what = "Text file busy"; break;
    default: what = "execve failed"; break;
  }
  char num[16];
  int i = (int)sizeof num;
  num[--i] = '\0';
  unsigned e = (unsigned)err;
  do num[--i] = (char)('0' + e % 10); while ((e /= 10) && i > 0);
  struct iovec iov[] = {{"chorusrun: cannot execute '", 27}, {(void *)path, strlen(path)},
                        {"': ", 3}, {(void *)what, strlen(what)}, {" (errno ", 8},
                        {num + i, strlen(num + i)}, {")\n", 2}};
  (void)!writev(2, iov, (int)CHORUS__ARRAY_LEN(iov));
}

/* The CPUs worker `rank` of n is bound to: of the C CPUs chorusrun may
 * use, a contiguous share of C/n (the first C mod n workers get one more)
 * when n <= C, else CPU rank mod C.  Ranks of a job wait on each other
 * constantly; left to itself the scheduler often starts them stacked on
 * one core and, because each always ran a moment ago ("cache hot"), keeps
 * them there: a 2-rank 8-byte all_reduce then takes 8-15 us instead of
 * under 1 us, depending on luck (bench/README.md, "Stability").  Open MPI
 * binds to cores by default for the same reason.  Returns 0 (leave the
 * worker unbound) when the mask cannot be read. */
static int worker_cpus(int n, int rank, cpu_set_t *out) {
  cpu_set_t mine;
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 0;
  int c = CPU_COUNT(&mine);
  if (c <= 1) return 0;
  int list[CPU_SETSIZE], k = 0;
  for (int i = 0; i < CPU_SETSIZE && k < c; i++)
    if (CPU_ISSET(i, &mine)) list[k++] = i;
  CPU_ZERO(out);
  if (n > c) {
    CPU_SET(list[rank % c], out);
    return 1;
  }
  int share = c / n, extra = c % n;
  int first = rank * share + (rank < extra ? rank : extra);
  int count = share + (rank < extra);
  for (int i = 0; i < count; i++) CPU_SET(list[first + i], out);
  return 1;
}

/* Starts worker w.  Returns 0 or -errno (nothing left behind on failure). */
static int spawn_worker(job_t *job, worker_t *w, int restart) {
  int outp[2] = {-1, -1}, errp[2] = {-1, -1};
  if (pipe2(outp, O_CLOEXEC) != 0 || pipe2(errp, O_CLOEXEC) != 0) {
    int e = errno;
    if (outp[0] >= 0) close(outp[0]), close(outp[1]);
    return -e;
  }
  char **env = build_env(job, w->rank, restart);
  pid_t parent = getpid();
  cpu_set_t cpus;
  int bind = job->bind && worker_cpus(job->nproc, w->rank, &cpus);

  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t pid = fork();
  if (pid == 0) {
    /* Child: only async-signal-safe calls from here to execve(). */
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(128 + SIGKILL); /* chorusrun already gone */
    if (dup2(outp[1], 1) < 0 || dup2(errp[1], 2) < 0) _exit(127);
    child_reset_signals();
    if (bind) sched_setaffinity(0, sizeof cpus, &cpus); /* a raw system call */
    execve(job->prog, job->argv, env);
    int err = errno;
    child_exec_failed(job->prog, err);
    _exit(err == ENOENT ? 127 : 126);
  }
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  free_env(env);
  close(outp[1]);
  close(errp[1]);
  if (pid < 0) {
    close(outp[0]);
    close(errp[0]);
    return -fork_errno;
  }
  /* Also here, so the group exists before we might signal it (EACCES once
   * the child has exec'd is fine: it did it itself). */
  setpgid(pid, pid);
  guard_send('+', pid);
  fcntl(outp[0], F_SETFL, O_NONBLOCK);
  fcntl(errp[0], F_SETFL, O_NONBLOCK);
  w->pid = pid;
  w->running = 1;
  w->status = 0;
  w->st[0] = (stream_t){.fd = outp[0], .out_fd = 1, .len = 0, .buf = w->st[0].buf};
  w->st[1] = (stream_t){.fd = errp[0], .out_fd = 2, .len = 0, .buf = w->st[1].buf};
  CHORUS_INFO(CHORUS__SUB_LAUNCH, "started rank %d as pid %d (restart %d)", w->rank, (int)pid,
              restart);
  return 0;
}

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
 * reaped; *first_failed receives the rank of the first failing worker if
 * blame is still open (not stopping, none blamed yet). */
static int reap(job_t *job, int *first_failed, int blame_open) {
  int reaped = 0;
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
    if (failed_status(st) && blame_open && *first_failed < 0) *first_failed = w->rank;
  }
  return reaped;
}

/* Kills and reaps every remaining child of ours (descendants the workers
 * left behind and that were reparented to us), bounded by ABANDON_MS. */
static void sweep_children(void) {
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

/* Drains the self-pipe; returns the first terminating signal (SIGINT,
 * SIGTERM, SIGHUP, SIGQUIT) it held, or 0.  SIGCHLD bytes only wake the loop up. */
static int drain_selfpipe(void) {
  unsigned char buf[64];
  int term = 0;
  for (;;) {
    ssize_t n = read(g_selfpipe[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; i++)
      if (buf[i] != SIGCHLD && !term) term = buf[i];
  }
  return term;
}

/* Prints the failure report of rank r. */
static void report_failure(job_t *job, int r) {
  worker_t *w = &job->w[r];
  int st = w->status;
  if (WIFEXITED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: exit code %d\n", r, (int)w->pid,
            WEXITSTATUS(st));
  } else if (WIFSIGNALED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: killed by signal %d (%s)%s\n", r,
            (int)w->pid, WTERMSIG(st), signal_name(WTERMSIG(st)),
            WCOREDUMP(st) ? ", core dumped" : "");
  }
  if (w->tail_count == 0) {
    fprintf(stderr, "chorusrun: rank %d printed nothing\n", r);
    return;
  }
  fprintf(stderr, "chorusrun: last %d output lines of rank %d:\n", w->tail_count, r);
  int first = (w->tail_next - w->tail_count + TAIL_LINES) % TAIL_LINES;
  for (int i = 0; i < w->tail_count; i++)
    fprintf(stderr, "  | %s\n", w->tail[(first + i) % TAIL_LINES]);
}

/* -------------------------------------------------------- one generation */

/* Runs one generation of all workers until every one has exited and its
 * output is drained.  *failed_rank receives the blamed rank (GEN_FAILED). */
static gen_outcome_t run_generation(job_t *job, int restart, int *failed_rank) {
  int first_failed = -1;
  int stopping = 0, killed = 0, spawn_error = 0;
  int64_t kill_deadline = CHORUS__NO_DEADLINE, abandon_deadline = CHORUS__NO_DEADLINE;
  int64_t drain_deadline = CHORUS__NO_DEADLINE;
  nfds_t cap = 1 + 2 * (nfds_t)job->nproc;
  struct pollfd *pfd = xmalloc(cap * sizeof *pfd);
  stream_t **owner_s = xmalloc(cap * sizeof *owner_s);
  worker_t **owner_w = xmalloc(cap * sizeof *owner_w);

  /* A signal that arrived between generations cancels the next one. */
  int sig = drain_selfpipe();
  if (sig && !job->got_sig) job->got_sig = sig;
  if (job->got_sig) goto done;

  for (int r = 0; r < job->nproc; r++) {
    worker_t *w = &job->w[r];
    tail_clear(w);
    w->pid = 0;
    w->running = 0;
    w->st[0].fd = w->st[1].fd = -1;
  }
  for (int r = 0; r < job->nproc; r++) {
    int rc = spawn_worker(job, &job->w[r], restart);
    if (rc < 0) {
      fprintf(stderr, "chorusrun: cannot start rank %d: %s; stopping the others\n", r,
              strerror(-rc));
      spawn_error = 1;
      stopping = 1;
      signal_groups(job, SIGTERM);
      kill_deadline = chorus__now_ns() + job->grace_ns;
      break;
    }
  }

  for (;;) {
    int fresh_fail = first_failed < 0;
    reap(job, &first_failed, !stopping);
    if (fresh_fail && first_failed >= 0 && !stopping) {
      stopping = 1;
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "rank %d failed; stopping the group", first_failed);
      signal_groups(job, SIGTERM);
      kill_deadline = chorus__now_ns() + job->grace_ns;
    }

    int running = 0, open = 0;
    for (int r = 0; r < job->nproc; r++) {
      running += job->w[r].running;
      open += (job->w[r].st[0].fd >= 0) + (job->w[r].st[1].fd >= 0);
    }
    int64_t now = chorus__now_ns();
    if (running == 0) {
      if (drain_deadline == CHORUS__NO_DEADLINE) {
        /* Every worker is gone: kill what they left behind so the pipes
         * reach EOF, then give the pipes a bounded time to drain. */
        sweep_children();
        drain_deadline = chorus__now_ns() + (int64_t)DRAIN_MS * 1000000;
      }
      if (open == 0) break;
      if (now >= drain_deadline) {
        for (int r = 0; r < job->nproc; r++)
          for (int k = 0; k < 2; k++) stream_close(job, &job->w[r], &job->w[r].st[k]);
        break;
      }
    }
    if (stopping && !killed && now >= kill_deadline) {
      if (running) CHORUS_INFO(CHORUS__SUB_LAUNCH, "grace period over; sending SIGKILL");
      signal_groups(job, SIGKILL);
      killed = 1;
      abandon_deadline = now + (int64_t)ABANDON_MS * 1000000;
    }
    if (killed && running && now >= abandon_deadline) {
      for (int r = 0; r < job->nproc; r++)
        if (job->w[r].running)
          fprintf(stderr, "chorusrun: rank %d (pid %d) survived SIGKILL; giving up on it\n", r,
                  (int)job->w[r].pid);
      for (int r = 0; r < job->nproc; r++)
        for (int k = 0; k < 2; k++) stream_close(job, &job->w[r], &job->w[r].st[k]);
      spawn_error = 1;
      break;
    }

    int timeout = TICK_MS;
    if (stopping && !killed) timeout = CHORUS__MIN(timeout, chorus__ms_left(kill_deadline));
    if (killed && running) timeout = CHORUS__MIN(timeout, chorus__ms_left(abandon_deadline));
    if (running == 0) timeout = CHORUS__MIN(timeout, chorus__ms_left(drain_deadline));

    nfds_t n = 0;
    pfd[n] = (struct pollfd){.fd = g_selfpipe[0], .events = POLLIN};
    owner_s[n] = NULL;
    owner_w[n++] = NULL;
    for (int r = 0; r < job->nproc; r++)
      for (int k = 0; k < 2; k++)
        if (job->w[r].st[k].fd >= 0) {
          pfd[n] = (struct pollfd){.fd = job->w[r].st[k].fd, .events = POLLIN};
          owner_s[n] = &job->w[r].st[k];
          owner_w[n++] = &job->w[r];
        }
    int ready = poll(pfd, n, timeout);
    if (ready < 0) {
      if (errno == EINTR) continue;
      /* Should not happen (EINVAL/ENOMEM); stop everything hard rather
       * than spin. */
      fprintf(stderr, "chorusrun: poll failed: %s; killing the workers\n", strerror(errno));
      signal_groups(job, SIGKILL);
      if (!killed) {
        killed = stopping = 1;
        abandon_deadline = chorus__now_ns() + (int64_t)ABANDON_MS * 1000000;
      }
      spawn_error = 1;
      struct timespec ts = {0, 10 * 1000000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (pfd[0].revents) {
      sig = drain_selfpipe();
      if (sig) {
        if (!job->got_sig) {
          job->got_sig = sig;
          fprintf(stderr, "chorusrun: got %s; stopping the workers\n", signal_name(sig));
          signal_groups(job, sig);
          if (!stopping) {
            stopping = 1;
            kill_deadline = chorus__now_ns() + job->grace_ns;
          }
        } else if (!killed) {
          fprintf(stderr, "chorusrun: got %s again; killing the workers\n", signal_name(sig));
          kill_deadline = chorus__now_ns();
        }
      }
    }
    for (nfds_t i = 1; i < n; i++)
      if (pfd[i].revents) stream_read(job, owner_w[i], owner_s[i]);
  }

done:
  free(pfd);
  free(owner_s);
  free(owner_w);
  if (first_failed >= 0) {
    *failed_rank = first_failed;
    return GEN_FAILED;
  }
  if (job->got_sig) return GEN_SIGNALED;
  return spawn_error ? GEN_ERROR : GEN_OK;
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv) {
  job_t job;
  memset(&job, 0, sizeof job);
  action_t act = parse_args(argc, argv, &job);
  switch (act) {
    case ACT_HELP:
      usage(stdout);
      return 0;
    case ACT_PRINT_ENV:
      chorus__env_dump(stdout, 0);
      return fflush(stdout) == 0 ? 0 : EXIT_LAUNCHER;
    case ACT_ENV_MARKDOWN:
      chorus__env_dump(stdout, 1);
      return fflush(stdout) == 0 ? 0 : EXIT_LAUNCHER;
    case ACT_RUN:
      break;
  }
  ensure_std_fds();
  raise_nofile(job.nproc);

  job.prog = resolve_program(job.argv[0]);
  if (!job.prog) {
    fprintf(stderr, "chorusrun: program '%s' not found or not executable%s\n", job.argv[0],
            strchr(job.argv[0], '/') ? "" : " (searched PATH)");
    return EXIT_NOT_FOUND;
  }
  if (random_hex(job.job_id, 8) != 0) {
    fprintf(stderr, "chorusrun: cannot get random bytes for the job id\n");
    return EXIT_LAUNCHER;
  }
  memcpy(g_job_id, job.job_id, sizeof g_job_id);
  if (job_secret(&job) != 0) return EXIT_LAUNCHER;
  guard_start(); /* before any handler or thread exists */
  if (install_signals() != 0) {
    fprintf(stderr, "chorusrun: cannot set up signal handling: %s\n", strerror(errno));
    guard_stop();
    return EXIT_LAUNCHER;
  }
  /* Descendants orphaned by a worker come to us, so we can clean them up. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);

  /* The store thread must never take our signals (it blocks them itself
   * too): they go to the main thread, whose poll() the self-pipe wakes. */
  sigset_t sigs, old;
  sigemptyset(&sigs);
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_sigs); i++) sigaddset(&sigs, g_sigs[i]);
  pthread_sigmask(SIG_BLOCK, &sigs, &old);
  chorus_store_server_t *srv = NULL;
  chorus__key_t key;
  chorus_result_t src = CHORUS_ERR_SYSTEM;
  if (chorus__job_key(job.secret, job.job_id, &key) == 0)
    src = chorus__store_server_start_key(job.master_addr, job.master_port, &key, &srv);
  chorus__wipe(&key, sizeof key);
  chorus__wipe(job.secret, sizeof job.secret);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (src != CHORUS_OK) {
    /* The store has logged the system error (WARN) just before. */
    fprintf(stderr, "chorusrun: cannot start the store on %s:%d: %s%s\n", job.master_addr,
            job.master_port, chorus_strerror(src),
            job.master_port ? "; is the port in use? try --standalone or another --master-port"
                            : "");
    guard_stop();
    if (g_secret_file[0]) unlink(g_secret_file);
    return EXIT_LAUNCHER;
  }
  job.port = chorus_store_server_port(srv);
  CHORUS_INFO(CHORUS__SUB_LAUNCH, "job %s: store on %s:%d, %d workers, max %d restarts",
              job.job_id, job.master_addr, job.port, job.nproc, job.max_restarts);

  job.w = xmalloc((size_t)job.nproc * sizeof *job.w);
  memset(job.w, 0, (size_t)job.nproc * sizeof *job.w);
  for (int r = 0; r < job.nproc; r++) {
    job.w[r].rank = r;
    job.w[r].st[0].fd = job.w[r].st[1].fd = -1;
    job.w[r].st[0].buf = xmalloc(LINE_CAP);
    job.w[r].st[1].buf = xmalloc(LINE_CAP);
  }

  int exit_code = 0;
  for (int restart = 0;; restart++) {
    int failed = -1;
    gen_outcome_t out = run_generation(&job, restart, &failed);
    remove_job_segments(); /* every worker of the generation has exited */
    if (out == GEN_OK) {
      exit_code = 0;
      break;
    }
    if (out == GEN_SIGNALED) {
      exit_code = 128 + job.got_sig;
      break;
    }
    if (out == GEN_ERROR) {
      exit_code = EXIT_LAUNCHER;
      break;
    }
    report_failure(&job, failed);
    exit_code = status_exit_code(job.w[failed].status);
    if (job.got_sig) break; /* interrupted while stopping: no restart */
    if (restart >= job.max_restarts) {
      if (job.max_restarts > 0)
        fprintf(stderr, "chorusrun: no restarts left (--max-restarts %d)\n", job.max_restarts);
      break;
    }
    fprintf(stderr, "chorusrun: restarting the group (restart %d/%d)\n", restart + 1,
            job.max_restarts);
  }

  chorus_store_server_stop(srv);
  guard_stop();
  if (g_secret_file[0]) unlink(g_secret_file);
  for (int r = 0; r < job.nproc; r++) {
    tail_clear(&job.w[r]);
    free(job.w[r].st[0].buf);
    free(job.w[r].st[1].buf);
  }
  free(job.w);
  free(job.prog);
  return exit_code;
}
