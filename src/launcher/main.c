/*
 * main.c - chorusrun's main(): options, job id and secret, the store,
 * the agent, teardown.  The design is in launcher.h.
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "chorus.h"
#include "store/store.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/log.h"
#include "util/util.h"


/* Lowercase hex of n random bytes into out (2n+1 bytes). */
static int random_hex(char *out, size_t n) {
  unsigned char raw[32];
  if (n > sizeof raw || chorus__random_bytes(raw, n) != 0) return -1;
  chorus__hex(out, raw, n);
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
  if (!have && job->backend != BACKEND_NONE) {
    fprintf(stderr,
            "chorusrun: a job on several nodes needs a secret that every node shares: set "
            "CHORUS_JOB_SECRET_FILE to a file only you can read (the same contents on every "
            "node; e.g. made once with 'head -c 32 /dev/urandom | od -An -tx1 | tr -d \" \\n\"') "
            "or CHORUS_JOB_SECRET (docs/security.md)\n");
    return -1;
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
  /* Our pid in the name: agents of one job on one machine (emulated hosts)
   * share the job id, and each removes its own file. */
  snprintf(job->secret_file, sizeof job->secret_file, "%s/job-%s-%d.key", dir, job->job_id,
           (int)getpid());
  int rc = chorus__secret_write_file(job->secret_file, job->secret);
  if (rc < 0) {
    fprintf(stderr, "chorusrun: cannot write %s: %s\n", job->secret_file, strerror(-rc));
    return -1;
  }
  snprintf(g_secret_file, sizeof g_secret_file, "%s", job->secret_file);
  return 0;
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
  if (job.backend != BACKEND_NONE) {
    /* Every node derives the same job id from the run id (it salts the job
     * key, so all agents and workers must agree on it). */
    chorus__key_t zero = {.set = 1};
    const void *parts[] = {"chorus run id", job.run_id};
    size_t lens[] = {13, strlen(job.run_id)};
    uint8_t mac[CHORUS__MAC_LEN];
    chorus__hmac(&zero, parts, lens, 2, mac);
    chorus__hex(job.job_id, mac, 8);
  } else if (random_hex(job.job_id, 8) != 0) {
    fprintf(stderr, "chorusrun: cannot get random bytes for the job id\n");
    return EXIT_LAUNCHER;
  }
  memcpy(g_job_id, job.job_id, sizeof g_job_id);
  if (!job.run_id[0]) snprintf(job.run_id, sizeof job.run_id, "%s", job.job_id);
  /* One node: the whole group is ours.  Several: the rendezvous decides. */
  job.nnodes = 1;
  job.node_rank = 0;
  job.rank_base = 0;
  job.world_size = job.nproc;
  if (job_secret(&job) != 0) return EXIT_LAUNCHER;
  guard_start(); /* before any handler or thread exists */
  if (install_signals() != 0) {
    fprintf(stderr, "chorusrun: cannot set up signal handling: %s\n", strerror(errno));
    guard_stop();
    return EXIT_LAUNCHER;
  }
  /* Descendants orphaned by a worker come to us, so we can clean them up. */
  prctl(PR_SET_CHILD_SUBREAPER, 1);

  chorus_store_server_t *srv = NULL;
  chorus__key_t key;
  if (chorus__job_key(job.secret, job.job_id, &key) != 0) {
    fprintf(stderr, "chorusrun: cannot derive the job key (libcrypto failed)\n");
    guard_stop();
    if (g_secret_file[0]) unlink(g_secret_file);
    return EXIT_LAUNCHER;
  }
  chorus__wipe(job.secret, sizeof job.secret);
  if (job.backend == BACKEND_NONE) {
    chorus_result_t src = start_store(job.master_addr, job.master_port, &key, &srv);
    if (src != CHORUS_OK) {
      /* The store has logged the system error (WARN) just before. */
      fprintf(stderr, "chorusrun: cannot start the store on %s:%d: %s%s\n", job.master_addr,
              job.master_port, chorus_strerror(src),
              job.master_port ? "; is the port in use? try --standalone or another --master-port"
                              : "");
      chorus__wipe(&key, sizeof key);
      guard_stop();
      if (g_secret_file[0]) unlink(g_secret_file);
      return EXIT_LAUNCHER;
    }
    job.port = chorus_store_server_port(srv);
    char why[700];
    if (chorus__store_server_expect(srv, job.nproc + 1, why, sizeof why) != CHORUS_OK) {
      fprintf(stderr, "chorusrun: %s\n", why);
      chorus_store_server_stop(srv);
      chorus__wipe(&key, sizeof key);
      guard_stop();
      if (g_secret_file[0]) unlink(g_secret_file);
      return EXIT_LAUNCHER;
    }
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "job %s: store on %s:%d, %d workers, max %d restarts",
                job.job_id, job.master_addr, job.port, job.nproc, job.max_restarts);
  }

  job.w = xmalloc((size_t)job.nproc * sizeof *job.w);
  memset(job.w, 0, (size_t)job.nproc * sizeof *job.w);
  for (int r = 0; r < job.nproc; r++) {
    job.w[r].rank = job.rank_base + r;
    job.w[r].local_rank = r;
    job.w[r].st[0].fd = job.w[r].st[1].fd = -1;
    job.w[r].st[0].buf = xmalloc(LINE_CAP);
    job.w[r].st[1].buf = xmalloc(LINE_CAP);
  }

  int exit_code;
  if (job.backend != BACKEND_NONE && (exit_code = rdzv_open(&job, &key)) != 0) {
    /* nothing ran */
  } else {
    exit_code = agent_run(&job);
  }
  /* The rendezvous seals its last heartbeat and reads the state while the
   * store's host lingers: the key goes after it. */
  rdzv_close(&job, exit_code);
  chorus__wipe(&key, sizeof key);
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

