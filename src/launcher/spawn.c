/*
 * spawn.c - starting one worker: its environment (from the contract
 * table, util/env_contract.def), its CPUs, fork + execve.
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* Each worker needs descriptors of ours: the read ends of its two pipes
 * (both ends while it starts), its two log files with --log-dir and its
 * connection to the store we serve.  Raise the soft limit towards the hard
 * one if the default (often 1024) is too small for nproc workers. */
void raise_nofile(int nproc) {
  if (getrlimit(RLIMIT_NOFILE, &g_old_nofile) != 0) return;
  rlim_t want = (rlim_t)nproc * 6 + 64;
  if (g_old_nofile.rlim_cur == RLIM_INFINITY || g_old_nofile.rlim_cur >= want) return;
  struct rlimit r = g_old_nofile;
  r.rlim_cur = g_old_nofile.rlim_max == RLIM_INFINITY ? want : CHORUS__MIN(want, g_old_nofile.rlim_max);
  if (setrlimit(RLIMIT_NOFILE, &r) == 0) g_nofile_raised = 1;
}

/* Looks the program up like execvp() would, so that the child can use
 * execve().  Returns a malloc'd path or NULL. */
char *resolve_program(const char *name) {
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

/* ------------------------------------------------------------ spawning */

/* The contract (util/env_contract.def), one enumerator per variable. */
typedef enum {
#define X(name, doc) CV_##name,
#define C(name) CV_CHORUS_##name,
#include "util/env_contract.def"
#undef X
#undef C
  CV_COUNT
} contract_var_t;

static const char *const g_contract_names[CV_COUNT] = {
#define X(name, doc) #name,
#define C(name) "CHORUS_" #name,
#include "util/env_contract.def"
#undef X
#undef C
};

/* Variable v's value for worker w of generation `restart`, malloc'd, or
 * NULL when the worker must not have the variable at all. */
static char *contract_value(const job_t *job, const worker_t *w, contract_var_t v) {
  switch (v) {
    case CV_RANK:
    case CV_ROLE_RANK: return xasprintf("%d", w->rank);
    case CV_LOCAL_RANK: return xasprintf("%d", w->local_rank);
    case CV_GROUP_RANK: return xasprintf("%d", job->node_rank);
    case CV_WORLD_SIZE:
    case CV_ROLE_WORLD_SIZE: return xasprintf("%d", job->world_size);
    case CV_LOCAL_WORLD_SIZE: return xasprintf("%d", job->nproc);
    case CV_GROUP_WORLD_SIZE: return xasprintf("%d", job->nnodes);
    case CV_ROLE_NAME: return xstrdup("default");
    case CV_MASTER_ADDR: return xstrdup(job->master_addr);
    case CV_MASTER_PORT: return xasprintf("%d", job->port);
    case CV_TORCHELASTIC_RESTART_COUNT: return xasprintf("%ld", job->restarts);
    /* The round, not the restarts: rounds opened by a scale-up form new
     * groups too, and each needs its own store keys. */
    case CV_CHORUS_RESTART_COUNT: return xasprintf("%ld", job->round);
    case CV_CHORUS_ELASTIC: return xstrdup(job->inplace ? "inplace" : "restart");
    case CV_CHORUS_JOIN: return job->joining ? xstrdup("1") : NULL;
    case CV_CHORUS_NODE_SIZES:
      return job->node_sizes ? xstrdup(job->node_sizes) : xasprintf("%d", job->nproc);
    case CV_TORCHELASTIC_MAX_RESTARTS: return xasprintf("%d", job->max_restarts);
    case CV_TORCHELASTIC_RUN_ID: return xstrdup(job->run_id);
    case CV_CHORUS_JOB_ID: return xstrdup(job->job_id);
    /* The secret itself stays out of the environment (children inherit it,
     * crash reports print it): workers read this file, which only our user
     * can read, and chorusrun removes it when the job ends. */
    case CV_CHORUS_JOB_SECRET: return NULL;
    case CV_CHORUS_JOB_SECRET_FILE: return xstrdup(job->secret_file);
    case CV_CHORUS_STORE_EXTERNAL: return xstrdup("1");
    case CV_COUNT: break;
  }
  return NULL;
}

/* The worker's environment: ours minus every contract variable, plus their
 * values for this worker.  Every string is malloc'd; free with free_env(). */
static char **build_env(const job_t *job, const worker_t *w) {
  size_t n = 0;
  for (char **e = environ; *e; e++) n++;
  size_t k = 0;
  char **env = xmalloc((n + CV_COUNT + 1) * sizeof *env);
  for (char **e = environ; *e; e++) {
    int drop = 0;
    for (int v = 0; v < CV_COUNT && !drop; v++) {
      size_t len = strlen(g_contract_names[v]);
      drop = !strncmp(*e, g_contract_names[v], len) && (*e)[len] == '=';
    }
    if (!drop) env[k++] = xstrdup(*e);
  }
  for (int v = 0; v < CV_COUNT; v++) {
    char *val = contract_value(job, w, (contract_var_t)v);
    if (!val) continue;
    env[k++] = xasprintf("%s=%s", g_contract_names[v], val);
    free(val);
  }
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

static void close_logs(const int logs[2]) {
  for (int k = 0; k < 2; k++)
    if (logs[k] >= 0) close(logs[k]);
}

/* Starts worker w.  Returns 0 or -errno (nothing left behind on failure). */
int spawn_worker(job_t *job, worker_t *w) {
  /* Its log files first: a generation whose logs cannot be written does
   * not start (the caller stops it as for any other spawn error). */
  int logs[2];
  int rc = log_open(job, w, logs);
  if (rc < 0) return rc;
  int outp[2] = {-1, -1}, errp[2] = {-1, -1};
  if (pipe2(outp, O_CLOEXEC) != 0 || pipe2(errp, O_CLOEXEC) != 0) {
    int e = errno;
    if (outp[0] >= 0) close(outp[0]), close(outp[1]);
    close_logs(logs);
    return -e;
  }
  char **env = build_env(job, w);
  pid_t parent = getpid();
  cpu_set_t cpus;
  int bind = job->bind && worker_cpus(job->nproc, w->local_rank, &cpus);

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
    close_logs(logs);
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
  /* --redirects: the log file only; --tee: the terminal as well. */
  int tee = job->tee[w->local_rank];
  w->st[0] = (stream_t){.fd = outp[0], .out_fd = 1, .term = logs[0] < 0 || (tee & STD_OUT),
                        .log_fd = logs[0], .len = 0, .buf = w->st[0].buf};
  w->st[1] = (stream_t){.fd = errp[0], .out_fd = 2, .term = logs[1] < 0 || (tee & STD_ERR),
                        .log_fd = logs[1], .len = 0, .buf = w->st[1].buf};
  CHORUS_INFO(CHORUS__SUB_LAUNCH, "started rank %d as pid %d (round %ld)", w->rank, (int)pid,
              job->round);
  return 0;
}
