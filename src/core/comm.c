/*
 * comm.c - communicator lifecycle: creation from the environment or a
 * config (store, rendezvous, transport), subgroups (new_group, split),
 * algorithm overrides, abort and destroy.
 *
 * World creation, step by step:
 *   1. rank 0 starts the store server unless it already runs (chorusrun);
 *   2. every rank connects to the store and agrees on a random world id
 *      (rank 0 publishes it) so connections of another job or of an earlier
 *      generation of this one are refused;
 *   3. every rank listens on a fresh port on the interface it uses to reach
 *      the store and publishes "address port";
 *   4. the transport connects the full mesh and starts its progress thread.
 * Every step is bounded by the timeout, and each error names the address,
 * rank or variable involved.
 */
#include <errno.h>
#include <sched.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "core/comm.h"
#include "store/rendezvous.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/crypto.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

static __thread char g_init_error[1024];

const char *chorus_last_init_error(void) { return g_init_error; }

static chorus_result_t init_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static chorus_result_t init_fail(chorus_result_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_init_error, sizeof g_init_error, fmt, ap);
  va_end(ap);
  CHORUS_WARN(CHORUS__SUB_INIT, "%s", g_init_error);
  return st;
}

void chorus__comm_set_error(chorus_comm_t comm, const char *fmt, ...) {
  char buf[sizeof comm->last_error];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&comm->lock);
  memcpy(comm->last_error, buf, sizeof buf);
  pthread_mutex_unlock(&comm->lock);
}

/* ------------------------------------------------------ algorithm choice */

static const char *coll_env_value(const chorus__env_t *env, chorus_coll_t coll) {
  switch (coll) {
    case CHORUS_COLL_BROADCAST: return env->BROADCAST_ALGO;
    case CHORUS_COLL_REDUCE: return env->REDUCE_ALGO;
    case CHORUS_COLL_ALL_REDUCE: return env->ALL_REDUCE_ALGO;
    case CHORUS_COLL_SCATTER: return env->SCATTER_ALGO;
    case CHORUS_COLL_GATHER: return env->GATHER_ALGO;
    case CHORUS_COLL_ALL_GATHER: return env->ALL_GATHER_ALGO;
    case CHORUS_COLL_REDUCE_SCATTER: return env->REDUCE_SCATTER_ALGO;
    case CHORUS_COLL_ALL_TO_ALL: return env->ALL_TO_ALL_ALGO;
    case CHORUS_COLL_BARRIER: return env->BARRIER_ALGO;
    default: return "auto";
  }
}

/* Applies CHORUS_ALGO and CHORUS_<COLL>_ALGO; unknown names are errors. */
static chorus_result_t apply_env_algos(chorus_comm_t comm) {
  const chorus__env_t *env = chorus__env();
  for (int k = 0; k < CHORUS_COLL_COUNT; k++) {
    const char *v = coll_env_value(env, (chorus_coll_t)k);
    if (!v || !*v || !strcasecmp(v, "auto")) continue;
    int idx = chorus__algo_find((chorus_coll_t)k, v);
    if (idx < 0)
    {
      char upper[64];
      size_t i = 0;
      for (const char *p = chorus_coll_name((chorus_coll_t)k); *p && i + 1 < sizeof upper; p++)
        upper[i++] = (char)(*p >= 'a' && *p <= 'z' ? *p - 'a' + 'A' : *p);
      upper[i] = '\0';
      return init_fail(CHORUS_ERR_INVALID_ARG, "chorus: CHORUS_%s_ALGO='%s' is not an algorithm "
                       "of %s (see docs/algorithms.md)", upper, v,
                       chorus_coll_name((chorus_coll_t)k));
    }
    comm->forced_algo[k] = idx;
  }
  if (env->ALGO && *env->ALGO) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", env->ALGO);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
      char *colon = strchr(tok, ':');
      int found = 0;
      if (colon) {
        *colon = '\0';
        for (int k = 0; k < CHORUS_COLL_COUNT && !found; k++) {
          if (strcmp(tok, chorus_coll_name((chorus_coll_t)k))) continue;
          /* "auto" restores the automatic choice, as in CHORUS_<COLL>_ALGO
           * and chorus_comm_set_algo (a later entry may undo an earlier). */
          int idx = strcasecmp(colon + 1, "auto") ? chorus__algo_find((chorus_coll_t)k, colon + 1)
                                                  : -1;
          if (idx >= 0 || !strcasecmp(colon + 1, "auto")) {
            comm->forced_algo[k] = idx;
            found = 1;
          }
        }
      }
      if (!found)
        return init_fail(CHORUS_ERR_INVALID_ARG, "chorus: CHORUS_ALGO entry '%s%s%s' is not "
                         "'collective:algorithm' with known names", tok, colon ? ":" : "",
                         colon ? colon + 1 : "");
    }
  }
  return CHORUS_OK;
}

chorus_result_t chorus_comm_set_algo(chorus_comm_t comm, chorus_coll_t coll, const char *name) {
  if (!comm || coll < 0 || coll >= CHORUS_COLL_COUNT) return CHORUS_ERR_INVALID_ARG;
  int idx = -1;
  if (name && strcasecmp(name, "auto")) {
    idx = chorus__algo_find(coll, name);
    if (idx < 0) {
      chorus__comm_set_error(comm, "chorus_comm_set_algo: %s has no algorithm named '%s'",
                             chorus_coll_name(coll), name);
      return CHORUS_ERR_INVALID_ARG;
    }
  }
  __atomic_store_n(&comm->forced_algo[coll], idx, __ATOMIC_RELAXED); /* read without the lock */
  return CHORUS_OK;
}

/* --------------------------------------------------------- construction */

static void ctx_unref(chorus__ctx_t *ctx) {
  pthread_mutex_lock(&ctx->lock);
  int left = --ctx->refs;
  pthread_mutex_unlock(&ctx->lock);
  if (left > 0) return;
  long bye_ms = chorus__env()->BYE_TIMEOUT_MS;
  chorus__tp_destroy(ctx->tp, chorus__deadline_ms(bye_ms < 0 ? 0 : bye_ms));
  chorus_store_close(ctx->store);
  chorus_store_server_stop(ctx->server);
  pthread_mutex_destroy(&ctx->lock);
  chorus__memreg_free(ctx->memreg);
  free(ctx->host);
  free(ctx);
}

chorus_result_t chorus__comm_create(chorus__ctx_t *ctx, uint64_t id, const int *world_ranks, int n,
                                    int my_rank, int timeout_ms, chorus_comm_t *out) {
  chorus_comm_t comm = calloc(1, sizeof *comm);
  if (!comm) return CHORUS_ERR_NO_MEMORY;
  comm->world_ranks = malloc(sizeof(int) * (size_t)n);
  if (!comm->world_ranks) {
    free(comm);
    return CHORUS_ERR_NO_MEMORY;
  }
  memcpy(comm->world_ranks, world_ranks, sizeof(int) * (size_t)n);
  chorus_result_t st = chorus__ep_create(ctx->tp, id, world_ranks, n, my_rank, &comm->ep);
  if (st != CHORUS_OK) {
    free(comm->world_ranks);
    free(comm);
    return st;
  }
  comm->ctx = ctx;
  comm->id = id;
  comm->rank = my_rank;
  comm->size = n;
  comm->local_rank = comm->local_size = -1;
  comm->timeout_ms = timeout_ms;
  comm->debug_checks = chorus__env()->DEBUG_CHECKS;
  for (int k = 0; k < CHORUS_COLL_COUNT; k++) comm->forced_algo[k] = -1;
  pthread_mutex_init(&comm->lock, NULL);
  chorus__cond_init_monotonic(&comm->cond);
  pthread_mutex_lock(&ctx->lock);
  ctx->refs++;
  pthread_mutex_unlock(&ctx->lock);
  *out = comm;
  return CHORUS_OK;
}

/* ------------------------------------------------------- shared memory */

/* "hostname boot-id": equal exactly for processes that can share memory
 * (a container with its own /dev/shm is caught when mapping fails). */
static void host_identity(char *buf, size_t cap) {
  char host[256] = "?", boot[64] = "";
  gethostname(host, sizeof host - 1);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
    fclose(f);
  }
  boot[strcspn(boot, "\n")] = '\0';
  snprintf(buf, cap, "%s %s", host, boot);
}

static int online_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* Writes this rank's CPU mask into its area of the segment (all ones when
 * it cannot be read or names CPUs past 255). */
static void publish_cpus(chorus__shm_t *shm) {
  uint64_t *m = shm->area[shm->me].cpus;
  cpu_set_t set;
  memset(m, 0, sizeof shm->area[0].cpus);
  int known = sched_getaffinity(0, sizeof set, &set) == 0;
  for (int i = 0; known && i < CPU_SETSIZE; i++) {
    if (!CPU_ISSET(i, &set)) continue;
    if (i >= 256) known = 0;
    else m[i / 64] |= (uint64_t)1 << (i % 64);
  }
  if (!known) memset(m, 0xff, sizeof shm->area[0].cpus);
}

/* Whether this rank may share a core with a rank it waits for, from the
 * masks every member published: when they are all equal (nobody bound the
 * ranks), if the host has more ranks (local_count) than CPUs; when ranks
 * are bound (chorusrun's --cpu-bind), if another member's CPUs overlap
 * this rank's. */
static int cpus_shared(chorus__shm_t *shm, int local_count) {
  const uint64_t *mine = shm->area[shm->me].cpus;
  int same = 1, overlap = 0;
  for (int r = 0; r < shm->n; r++) {
    if (r == shm->me) continue;
    const uint64_t *theirs = shm->area[r].cpus;
    for (int w = 0; w < 4; w++) {
      same &= theirs[w] == mine[w];
      overlap |= (theirs[w] & mine[w]) != 0;
    }
  }
  return same ? local_count > online_cpus() : overlap;
}

/* One all_reduce(MIN) of an int over comm on the network path (the
 * communicator is not handed out yet, so nothing else runs on it). */
static chorus_result_t agree_min(chorus_comm_t comm, int32_t *v) {
  int saved = comm->forced_algo[CHORUS_COLL_ALL_REDUCE];
  comm->forced_algo[CHORUS_COLL_ALL_REDUCE] = -1;
  int32_t in = *v;
  chorus_result_t st = chorus_all_reduce(comm, &in, v, 1, CHORUS_INT32, CHORUS_MIN, NULL);
  comm->forced_algo[CHORUS_COLL_ALL_REDUCE] = saved;
  return st;
}

/* Rank 0's value of *v on every rank, on the network path (like agree_min). */
static chorus_result_t agree_bcast(chorus_comm_t comm, uint64_t *v) {
  int saved = comm->forced_algo[CHORUS_COLL_BROADCAST];
  comm->forced_algo[CHORUS_COLL_BROADCAST] = -1;
  chorus_result_t st = chorus_broadcast(comm, v, 1, CHORUS_INT64, 0, NULL);
  comm->forced_algo[CHORUS_COLL_BROADCAST] = saved;
  return st;
}

/* Gives comm its shared-memory segment when every member is on this host:
 * rank 0 creates it, everyone agrees it exists, the others map it,
 * everyone agrees they did, rank 0 unlinks the name.  Any failure to create
 * or map falls back to TCP on every rank (logged); only a failure of the
 * agreement itself (a dead peer) is an error. */
static chorus_result_t shm_setup(chorus_comm_t comm) {
  const chorus__env_t *env = chorus__env();
  chorus__ctx_t *ctx = comm->ctx;
  const char *mode = env->TRANSPORT && *env->TRANSPORT ? env->TRANSPORT : "auto";
  if (!strcasecmp(mode, "tcp") || comm->size < 2) return CHORUS_OK;
  int strict = !strcasecmp(mode, "shm");
  int local = comm->size <= CHORUS__SHM_MAX_RANKS;
  for (int i = 0; i < comm->size && local; i++) local = chorus_comm_same_host(comm, i) == 1;
  if (!local) {
    if (strict) {
      chorus__comm_set_error(comm, "chorus rank %d/%d: CHORUS_TRANSPORT=shm but the group spans "
                             "several hosts", comm->rank, comm->size);
      return CHORUS_ERR_NOT_SUPPORTED;
    }
    return CHORUS_OK; /* every member computes the same answer */
  }
  char name[128], err[512] = "";
  long chunk = env->SHM_CHUNK;
  if (chunk < 16384) chunk = 16384;
  if (chunk > (64L << 20)) chunk = 64L << 20;
  chunk = (chunk + 4095) / 4096 * 4096;
  /* Keep big groups within 256 MiB of buffers. */
  while ((size_t)chunk * 2 * (size_t)comm->size > ((size_t)256 << 20) && chunk > 16384) chunk /= 2;
  chorus__shm_t *shm = NULL;
  int32_t ok = 1;
  chorus_result_t st = CHORUS_OK;
  /* Rank 0 picks a random name (another one if a stranger holds it) and
   * tells the others over the authenticated connections; 0: it failed. */
  uint64_t nonce = 0;
  for (int attempt = 0; comm->rank == 0 && attempt < 8; attempt++) {
    int exists = 0;
    if (chorus__random_bytes(&nonce, sizeof nonce) < 0 || nonce == 0) nonce = 1 + (uint64_t)attempt;
    chorus__shm_name(name, sizeof name, env->JOB_ID, comm->id, nonce);
    if (chorus__shm_create(name, comm->size, (size_t)chunk, &shm, err, sizeof err, &exists) ==
        CHORUS_OK)
      break;
    nonce = 0;
    if (!exists) break;
    CHORUS_WARN(CHORUS__SUB_INIT, "/dev/shm%s exists already (made by someone else); trying "
                "another name", name);
  }
  if (shm) chorus__shm_publish_self(shm);
  st = agree_bcast(comm, &nonce);
  ok = nonce != 0;
  if (comm->rank != 0) chorus__shm_name(name, sizeof name, env->JOB_ID, comm->id, nonce);
  if (st == CHORUS_OK && ok && comm->rank != 0) {
    ok = chorus__shm_attach(name, comm->size, comm->rank, &shm, err, sizeof err) == CHORUS_OK;
    if (!ok) CHORUS_WARN(CHORUS__SUB_INIT, "rank %d/%d: %s", comm->rank, comm->size, err);
    else chorus__shm_publish_self(shm);
  } else if (st == CHORUS_OK && comm->rank != 0) {
    snprintf(err, sizeof err, "rank 0 could not create the segment");
  }
  if (st == CHORUS_OK) st = agree_min(comm, &ok);
  if (comm->rank == 0 && shm) chorus__shm_unlink(name); /* mapped everywhere, or abandoned */
  if (st != CHORUS_OK || !ok) {
    chorus__shm_detach(shm);
    if (st != CHORUS_OK) return st;
    if (strict) {
      chorus__comm_set_error(comm, "chorus rank %d/%d: CHORUS_TRANSPORT=shm but the shared-memory "
                             "segment failed: %s", comm->rank, comm->size, err);
      return CHORUS_ERR_SYSTEM;
    }
    CHORUS_WARN(CHORUS__SUB_INIT, "group of %d ranks on one host: shared memory unavailable (%s); "
                "using TCP", comm->size, err[0] ? err : "another rank could not map it");
    return CHORUS_OK;
  }
  /* Single copy (process_vm_readv): every rank reads its right neighbour's
   * process; containers without CAP_SYS_PTRACE or with Yama's ptrace_scope
   * >= 1 refuse it everywhere, and then everyone keeps the staged copies. */
  int32_t cma = env->SHM_CMA_MIN >= 0;
  int cma_err = 0;
  if (cma) {
    cma_err = chorus__shm_probe(shm, (comm->rank + 1) % comm->size);
    cma = cma_err == 0;
  }
  st = agree_min(comm, &cma);
  if (st != CHORUS_OK) {
    chorus__shm_detach(shm);
    return st;
  }
  if (!cma && env->SHM_CMA_MIN >= 0)
    CHORUS_INFO(CHORUS__SUB_INIT, "process_vm_readv between ranks is not allowed (%s); large "
                "collectives copy through shared memory", cma_err ? strerror(-cma_err) :
                "refused on another rank");
  shm->cma = cma;
  shm->cma_min = (size_t)(env->SHM_CMA_MIN >= 0 ? env->SHM_CMA_MIN : 0);
  /* Measured on 2 cores (bench/README.md): a short spin catches a peer
   * running on another core; after it, sched_yield (nearly free when
   * nobody else wants the core) lets a peer that shares our core run --
   * with a long spin instead, two ranks on one core took 100 us per flag.
   * With more ranks than cores any spinning steals the time slice of the
   * rank being waited for.  After the yields, sleep on the futex.  The
   * spin is settled below, once every member's CPU mask is known. */
  int yields = env->SHM_YIELD >= 0 ? (int)env->SHM_YIELD : 1000;
  chorus__shm_bind(shm, comm->ep, comm->timeout_ms, 0, yields);
  shm->reg = ctx->memreg;
  shm->world = comm->world_ranks;
  comm->shm = shm;
  publish_cpus(shm);
  /* End with a barrier in shared memory: a rank returns from it once it
   * sees every other rank's flag, so a fast rank's failure in a later call
   * (say a mismatch it detects alone) cannot fail this rank's setup.  It
   * also publishes the CPU masks written above. */
  int saved = comm->forced_algo[CHORUS_COLL_BARRIER];
  comm->forced_algo[CHORUS_COLL_BARRIER] = -1;
  st = chorus_barrier(comm, NULL);
  comm->forced_algo[CHORUS_COLL_BARRIER] = saved;
  if (st != CHORUS_OK) return st;
  int oversubscribed = cpus_shared(shm, ctx->local_count);
  int spin = env->SHM_SPIN >= 0 ? (int)env->SHM_SPIN : oversubscribed ? 0 : 50;
  shm->spin = spin;
  CHORUS_INFO(CHORUS__SUB_INIT, "group of %d ranks on one host: shared memory %s (%zu KiB "
              "buffers, spin %d, yield %d, single copy %s)", comm->size, name, shm->chunk >> 10,
              spin, yields, cma ? "on" : "off");
  return CHORUS_OK;
}

/* ------------------------------------------------------------ job secret */

/* How this world found its secret (docs/security.md). */
typedef struct world_secret {
  char secret[CHORUS__SECRET_MAX];
  char file[4096]; /* the per-user agreement file, when that is the source */
  int from_file;   /* read from file: it may be replaced, read again on refusal */
  int wrote_file;  /* this rank made file (it serves the store) */
  chorus__key_t key;
} world_secret_t;

/* Finds the world's secret and derives its key: the API's, CHORUS_JOB_SECRET,
 * CHORUS_JOB_SECRET_FILE; else, when the store is on this host, a fresh one
 * that the rank serving the store writes to a file only this user can read
 * and the others read; else CHORUS_INSECURE=1 or an error. */
static chorus_result_t world_secret(const chorus_config_t *cfg, int rank, int host, int port,
                                    int64_t deadline, world_secret_t *ws) {
  const chorus__env_t *env = chorus__env();
  char why[600];
  int have = 0;
  if (cfg->job_secret && *cfg->job_secret) {
    snprintf(ws->secret, sizeof ws->secret, "%s", cfg->job_secret);
    have = 1;
  } else {
    have = chorus__secret_configured(ws->secret, sizeof ws->secret, why, sizeof why);
    if (have < 0) return init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: %s", rank, why);
    ws->from_file = have && !(env->JOB_SECRET && *env->JOB_SECRET);
    if (ws->from_file) snprintf(ws->file, sizeof ws->file, "%s", env->JOB_SECRET_FILE);
  }
  if (!have && chorus__net_is_local(cfg->store_host)) {
    char dir[4000];
    if (chorus__runtime_dir(dir, sizeof dir, why, sizeof why) < 0)
      return init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: no job secret, and no private "
                       "directory to agree on one: %s", rank, why);
    snprintf(ws->file, sizeof ws->file, "%s/store-%d.key", dir, port);
    ws->from_file = 1;
    if (host) {
      int rc = chorus__secret_generate(ws->secret, sizeof ws->secret);
      if (rc == 0) rc = chorus__secret_write_file(ws->file, ws->secret);
      if (rc < 0)
        return init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot write the job secret to "
                         "%s: %s", rank, ws->file, strerror(-rc));
      ws->wrote_file = 1;
    } else {
      /* Wait for the rank serving the store to write it. */
      for (;;) {
        int rc = chorus__secret_read_file(ws->file, ws->secret, sizeof ws->secret, why, sizeof why);
        if (rc == 0) break;
        if (rc != -ENOENT || chorus__ms_left(deadline) == 0)
          return init_fail(rc == -ENOENT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_INVALID_ARG,
                           "chorus rank %d: no job secret: %s%s", rank, why, rc == -ENOENT ?
                           " (rank 0 writes it when it starts the store; is it running on this "
                           "host?)" : "");
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
      }
    }
    have = 1;
    CHORUS_INFO(CHORUS__SUB_INIT, "no job secret given: the ranks on this host use a fresh one "
                "from %s", ws->file);
  }
  if (!have && !env->INSECURE)
    return init_fail(CHORUS_ERR_INVALID_ARG,
                     "chorus rank %d: no job secret, and the store at %s:%d is not on this host, "
                     "so the ranks cannot agree on one by themselves: give every rank the same "
                     "CHORUS_JOB_SECRET or CHORUS_JOB_SECRET_FILE (chorusrun does this), or set "
                     "CHORUS_INSECURE=1 to let anyone who reaches the ports join "
                     "(docs/security.md)", rank, cfg->store_host, port);
  if (!have)
    CHORUS_WARN(CHORUS__SUB_INIT, "chorus rank %d: CHORUS_INSECURE=1 and no job secret: anyone "
                "who can reach this job's ports can join it, read and change its data",
                rank);
  int rc = chorus__job_key(have ? ws->secret : NULL, env->JOB_ID, &ws->key);
  if (rc < 0)
    return init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot derive the job key: %s", rank,
                     strerror(-rc));
  return CHORUS_OK;
}

/* Reads the secret file again after the store refused our key (it was
 * replaced: an earlier world on the same port, or a restart).  1 when it
 * changed. */
static int world_secret_reread(world_secret_t *ws) {
  char fresh[CHORUS__SECRET_MAX], why[600];
  if (!ws->from_file || ws->wrote_file) return 0;
  if (chorus__secret_read_file(ws->file, fresh, sizeof fresh, why, sizeof why) < 0) return 0;
  int changed = strcmp(fresh, ws->secret) != 0;
  if (changed) {
    snprintf(ws->secret, sizeof ws->secret, "%s", fresh);
    if (chorus__job_key(ws->secret, chorus__env()->JOB_ID, &ws->key) < 0) changed = 0;
  }
  chorus__wipe(fresh, sizeof fresh);
  return changed;
}

/* The agreement file is needed until every rank holds the key: once the
 * world formed, the rank that wrote it removes it. */
static void world_secret_done(world_secret_t *ws) {
  if (ws->wrote_file) {
    char cur[CHORUS__SECRET_MAX], why[600];
    if (chorus__secret_read_file(ws->file, cur, sizeof cur, why, sizeof why) == 0 &&
        !strcmp(cur, ws->secret))
      unlink(ws->file);
    chorus__wipe(cur, sizeof cur);
    ws->wrote_file = 0;
  }
  chorus__wipe(ws, sizeof *ws);
}

static chorus_result_t world_init(const chorus_config_t *cfg, chorus_comm_t *out) {
  const chorus__env_t *env = chorus__env();
  chorus__log_init();
  if (!out) return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: comm is NULL");
  *out = NULL;
  if (!cfg || cfg->magic != CHORUS_CONFIG_MAGIC || cfg->size < sizeof(size_t))
    return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: config not initialised with "
                     "CHORUS_CONFIG_INITIALIZER");
  if (cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
    return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: rank %d is not in [0, %d)",
                     cfg->rank, cfg->world_size);
  if (!cfg->store_host || !*cfg->store_host)
    return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: no store address (MASTER_ADDR)");
  if (cfg->store_port < 0 || cfg->store_port > 65535)
    return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: store port %d out of range",
                     cfg->store_port);
  int rank = cfg->rank, size = cfg->world_size;
  long env_timeout_s = env->TIMEOUT > 0 && env->TIMEOUT < 2000000 ? env->TIMEOUT : 300;
  int timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : (int)(env_timeout_s * 1000);
  char prefix[256];
  if (cfg->store_prefix) snprintf(prefix, sizeof prefix, "%s", cfg->store_prefix);
  else snprintf(prefix, sizeof prefix, "chorus/r%ld/", env->RESTART_COUNT);
  int host = cfg->host_store >= 0 ? cfg->host_store : (rank == 0 && !env->STORE_EXTERNAL);
  int64_t deadline = chorus__deadline_ms(timeout_ms);
  chorus_result_t st;

  world_secret_t *ws = calloc(1, sizeof *ws);
  if (!ws) return init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  st = world_secret(cfg, rank, host, cfg->store_port, deadline, ws);
  if (st != CHORUS_OK) {
    world_secret_done(ws);
    free(ws);
    return st;
  }
  chorus__ctx_t *ctx = calloc(1, sizeof *ctx);
  if (!ctx) {
    world_secret_done(ws);
    free(ws);
    return init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  }
  pthread_mutex_init(&ctx->lock, NULL);
  ctx->rank = rank;
  ctx->size = size;
  int port = cfg->store_port;
  char **addrs = NULL;
  if (host) {
    /* On MASTER_ADDR's address only: all interfaces when asked. */
    st = chorus__store_server_start_key(env->STORE_BIND_ALL ? NULL : cfg->store_host, port,
                                        &ws->key, &ctx->server);
    if (st != CHORUS_OK) {
      init_fail(st, "chorus rank %d: cannot serve the store on port %d (%s); is another job "
                "using MASTER_PORT=%d?", rank, port, chorus_strerror(st), port);
      goto fail;
    }
    port = chorus_store_server_port(ctx->server);
  }
  if (port <= 0) {
    st = init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: store port 0 is only valid for the "
                   "rank that serves the store", rank);
    goto fail;
  }
  for (;;) {
    st = chorus__store_connect_key(cfg->store_host, port, &ws->key, chorus__ms_left(deadline),
                                   &ctx->store);
    if (st == CHORUS_OK || !chorus__store_connect_denied() || chorus__ms_left(deadline) == 0)
      break;
    /* Refused: the agreement file we read may have been stale. */
    struct timespec ts = {0, 20 * 1000000};
    nanosleep(&ts, NULL);
    world_secret_reread(ws);
  }
  if (st != CHORUS_OK) {
    init_fail(st, "chorus rank %d/%d: cannot use the store at %s:%d: %s (is rank 0 or chorusrun "
              "running, are MASTER_ADDR/MASTER_PORT and the job secret right?)", rank, size,
              cfg->store_host, port, chorus__store_connect_error());
    goto fail;
  }
  /* The world id: fresh per world, so stale peers cannot join. */
  char key[300], idbuf[40];
  uint64_t world_id = 0;
  snprintf(key, sizeof key, "%sworld_id", prefix);
  if (rank == 0) {
    chorus__random_bytes(&world_id, sizeof world_id);
    snprintf(idbuf, sizeof idbuf, "%016" PRIx64, world_id);
    st = chorus_store_set(ctx->store, key, idbuf, strlen(idbuf));
  } else {
    void *val = NULL;
    size_t len = 0;
    st = chorus_store_get(ctx->store, key, &val, &len);
    if (st == CHORUS_OK) {
      snprintf(idbuf, sizeof idbuf, "%.*s", (int)CHORUS__MIN(len, 32), (char *)val);
      world_id = strtoull(idbuf, NULL, 16);
      free(val);
    }
  }
  if (st != CHORUS_OK) {
    init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size,
              chorus_store_last_error(ctx->store));
    goto fail;
  }
  /* Listen where peers can reach us: the interface toward the store. */
  char ifaddr[80];
  int ignored;
  if (env->SOCKET_IFADDR && *env->SOCKET_IFADDR)
    snprintf(ifaddr, sizeof ifaddr, "%s", env->SOCKET_IFADDR);
  else if (chorus__net_local_addr(chorus__store_fd(ctx->store), ifaddr, sizeof ifaddr, &ignored) < 0)
    snprintf(ifaddr, sizeof ifaddr, "127.0.0.1");
  int data_port = 0;
  int lfd = chorus__net_listen(ifaddr, 0, 4096, &data_port); /* strangers must not fill it */
  if (lfd < 0) {
    st = init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot listen on %s: %s", rank, ifaddr,
                   strerror(-lfd));
    goto fail;
  }
  char mine[128];
  snprintf(mine, sizeof mine, "%s %d", ifaddr, data_port);
  char err[512] = "out of memory";
  st = chorus__rdzv_allgather(ctx->store, prefix, "addr", rank, size, mine, &addrs, err, sizeof err);
  if (st != CHORUS_OK) {
    close(lfd);
    init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
    goto fail;
  }
  chorus__tp_config_t tcfg = {.rank = rank, .size = size, .key = &ws->key, .world_id = world_id,
                              .listen_fd = lfd, .addrs = (const char *const *)addrs,
                              .deadline = deadline, .retry_ms = (int)env->CONNECT_RETRY_MS,
                              .fp_format = chorus__fp_format};
  st = chorus__tp_create(&tcfg, &ctx->tp, err, sizeof err);
  if (st != CHORUS_OK) {
    init_fail(st, "chorus rank %d/%d: connecting to the other ranks failed: %s", rank, size, err);
    goto fail;
  }
  chorus__rdzv_free(addrs, size);
  addrs = NULL;
  world_secret_done(ws); /* every rank holds the key now */
  free(ws);
  ws = NULL;
  /* Which ranks share this host (for shared memory). */
  char ident[400];
  host_identity(ident, sizeof ident);
  ctx->world_id = world_id;
  ctx->host = calloc((size_t)size, sizeof *ctx->host);
  ctx->memreg = chorus__memreg_new(env->JOB_ID, world_id, rank);
  if (!ctx->host || !ctx->memreg) {
    st = init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
    goto fail;
  }
  st = chorus__rdzv_allgather(ctx->store, prefix, "host", rank, size, ident, &addrs, err,
                              sizeof err);
  if (st != CHORUS_OK) {
    init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
    goto fail;
  }
  static const uint8_t hkey[16] = "chorus-hostident";
  for (int r = 0; r < size; r++) {
    ctx->host[r] = chorus__siphash(hkey, addrs[r], strlen(addrs[r]));
    if (!strcmp(addrs[r], ident)) ctx->local_count++;
  }
  chorus__rdzv_free(addrs, size);
  addrs = NULL;
  int *world = malloc(sizeof(int) * (size_t)size);
  if (!world) {
    st = init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
    goto fail;
  }
  for (int r = 0; r < size; r++) world[r] = r;
  chorus_comm_t comm;
  st = chorus__comm_create(ctx, 1, world, size, rank, timeout_ms, &comm);
  free(world);
  if (st != CHORUS_OK) {
    init_fail(st, "chorus_comm_init: cannot create the communicator");
    goto fail;
  }
  comm->local_rank = cfg->local_rank;
  comm->local_size = cfg->local_world_size;
  st = apply_env_algos(comm);
  if (st == CHORUS_OK) {
    st = shm_setup(comm);
    if (st != CHORUS_OK) init_fail(st, "%s", comm->last_error);
  }
  if (st != CHORUS_OK) {
    chorus_comm_destroy(comm);
    return st;
  }
  chorus__log_set_identity(rank, size);
  CHORUS_INFO(CHORUS__SUB_INIT, "communicator ready: rank %d/%d, store %s, listening on %s",
              rank, size, chorus__store_address(ctx->store), mine);
  g_init_error[0] = '\0';
  *out = comm;
  return CHORUS_OK;
fail:
  if (ws) {
    world_secret_done(ws);
    free(ws);
  }
  chorus__rdzv_free(addrs, size);
  if (ctx->tp) chorus__tp_destroy(ctx->tp, chorus__deadline_ms(0));
  chorus__memreg_free(ctx->memreg);
  free(ctx->host);
  chorus_store_close(ctx->store);
  chorus_store_server_stop(ctx->server);
  pthread_mutex_destroy(&ctx->lock);
  free(ctx);
  return st;
}

chorus_result_t chorus_comm_init(const chorus_config_t *config, chorus_comm_t *comm) {
  return world_init(config, comm);
}

static int env_int(const char *name, int *out, int required) {
  const char *v = getenv(name);
  long x;
  if (!v || !*v) return required ? -1 : 0;
  if (chorus__parse_long(v, &x) < 0 || x < 0 || x > 1 << 30) return -2;
  *out = (int)x;
  return 0;
}

chorus_result_t chorus_comm_init_env(chorus_comm_t *comm) {
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  static const char *required[] = {"RANK", "WORLD_SIZE", "MASTER_PORT"};
  int *fields[] = {&cfg.rank, &cfg.world_size, &cfg.store_port};
  if (comm) *comm = NULL;
  for (int i = 0; i < 3; i++) {
    int rc = env_int(required[i], fields[i], 1);
    if (rc == -1)
      return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s is not set; launch "
                       "with chorusrun (or torchrun) or set RANK, WORLD_SIZE, "
                       "MASTER_ADDR and MASTER_PORT", required[i]);
    if (rc == -2)
      return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s='%s' is not a "
                       "non-negative integer", required[i], getenv(required[i]));
  }
  if (env_int("LOCAL_RANK", &cfg.local_rank, 0) < 0 ||
      env_int("LOCAL_WORLD_SIZE", &cfg.local_world_size, 0) < 0)
    return init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: LOCAL_RANK or "
                     "LOCAL_WORLD_SIZE is not a non-negative integer");
  cfg.store_host = getenv("MASTER_ADDR");
  if (!cfg.store_host || !*cfg.store_host) cfg.store_host = "127.0.0.1";
  return world_init(&cfg, comm);
}

/* ----------------------------------------------------------- subgroups */

/* A group's id: the parent, how many groups the parent made before, and the
 * member list (world ranks in order), so ranks that disagree on the members
 * get different ids (and then a mismatch or timeout, never mixed data). */
static uint64_t child_id(chorus_comm_t parent, uint64_t counter, const int *ranks, int n) {
  static const uint8_t key[16] = "chorus-groupids";
  uint64_t members = chorus__siphash(key, ranks, sizeof(int) * (size_t)n);
  uint64_t m[3] = {parent->id, counter, members};
  uint64_t id = chorus__siphash(key, m, sizeof m);
  return id < 2 ? id + 2 : id; /* 1 is the world */
}

static chorus_result_t make_group(chorus_comm_t parent, const int *ranks, int n, uint64_t id,
                                  chorus_comm_t *out) {
  int me = -1;
  for (int i = 0; i < n; i++)
    if (ranks[i] == parent->rank) me = i;
  if (me < 0) return CHORUS_OK;
  int *world = malloc(sizeof(int) * (size_t)n);
  if (!world) return CHORUS_ERR_NO_MEMORY;
  for (int i = 0; i < n; i++) world[i] = parent->world_ranks[ranks[i]];
  chorus_result_t st = chorus__comm_create(parent->ctx, id, world, n, me, parent->timeout_ms, out);
  free(world);
  if (st == CHORUS_OK) {
    memcpy((*out)->forced_algo, parent->forced_algo, sizeof parent->forced_algo);
    (*out)->debug_checks = parent->debug_checks;
    st = shm_setup(*out);
    if (st != CHORUS_OK) {
      chorus__comm_set_error(parent, "%s", (*out)->last_error);
      chorus_comm_destroy(*out);
      *out = NULL;
    }
  }
  return st;
}

chorus_result_t chorus_comm_new_group(chorus_comm_t parent, const int *ranks, int n,
                                      chorus_comm_t *out) {
  if (!parent || !out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  if (n < 1 || n > parent->size || !ranks) {
    chorus__comm_set_error(parent, "chorus_comm_new_group: %d ranks requested from a group of %d",
                           n, parent->size);
    return CHORUS_ERR_INVALID_ARG;
  }
  for (int i = 0; i < n; i++) {
    if (ranks[i] < 0 || ranks[i] >= parent->size) {
      chorus__comm_set_error(parent, "chorus_comm_new_group: rank %d is not in [0, %d)", ranks[i],
                             parent->size);
      return CHORUS_ERR_INVALID_ARG;
    }
    for (int j = 0; j < i; j++)
      if (ranks[j] == ranks[i]) {
        chorus__comm_set_error(parent, "chorus_comm_new_group: rank %d is listed twice", ranks[i]);
        return CHORUS_ERR_INVALID_ARG;
      }
  }
  pthread_mutex_lock(&parent->lock);
  uint64_t counter = ++parent->children;
  pthread_mutex_unlock(&parent->lock);
  return make_group(parent, ranks, n, child_id(parent, counter, ranks, n), out);
}

chorus_result_t chorus_comm_split(chorus_comm_t parent, int color, int key, chorus_comm_t *out) {
  if (!parent || !out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  int n = parent->size;
  int32_t mine[2] = {color, key};
  int32_t *all = malloc(sizeof(int32_t) * 2 * (size_t)n);
  int *ranks = malloc(sizeof(int) * (size_t)n);
  if (!all || !ranks) {
    free(all);
    free(ranks);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus_result_t st = chorus_all_gather(parent, mine, all, 2, CHORUS_INT32, NULL);
  pthread_mutex_lock(&parent->lock);
  uint64_t counter = ++parent->children;
  pthread_mutex_unlock(&parent->lock);
  if (st == CHORUS_OK && color >= 0) {
    /* Members in (key, parent rank) order: insertion sort, n is small. */
    int m = 0;
    for (int r = 0; r < n; r++) {
      if (all[2 * r] != color) continue;
      int i = m++;
      while (i > 0 && all[2 * ranks[i - 1] + 1] > all[2 * r + 1]) {
        ranks[i] = ranks[i - 1];
        i--;
      }
      ranks[i] = r;
    }
    st = make_group(parent, ranks, m, child_id(parent, counter, ranks, m), out);
  }
  free(all);
  free(ranks);
  return st;
}

/* ------------------------------------------------- shared-memory buffers */

chorus_result_t chorus_mem_alloc(chorus_comm_t comm, size_t size, void **ptr) {
  if (!comm || !ptr) return CHORUS_ERR_INVALID_ARG;
  char err[300] = "";
  chorus_result_t st = chorus__memreg_alloc(comm->ctx->memreg, size, ptr, err, sizeof err);
  if (st != CHORUS_OK)
    chorus__comm_set_error(comm, "chorus rank %d/%d: chorus_mem_alloc(%zu bytes) failed: %s",
                           comm->rank, comm->size, size, err[0] ? err : chorus_strerror(st));
  return st;
}

chorus_result_t chorus_mem_free(chorus_comm_t comm, void *ptr) {
  if (!comm) return CHORUS_ERR_INVALID_ARG;
  chorus_result_t st = chorus__memreg_release(comm->ctx->memreg, ptr);
  if (st != CHORUS_OK)
    chorus__comm_set_error(comm, "chorus rank %d/%d: chorus_mem_free(%p): not memory from "
                           "chorus_mem_alloc of this communicator's world", comm->rank,
                           comm->size, ptr);
  return st;
}

/* ----------------------------------------------------------- accessors */

int chorus_comm_rank(chorus_comm_t comm) { return comm ? comm->rank : -1; }
int chorus_comm_size(chorus_comm_t comm) { return comm ? comm->size : -1; }
int chorus_comm_local_rank(chorus_comm_t comm) { return comm ? comm->local_rank : -1; }
int chorus_comm_local_size(chorus_comm_t comm) { return comm ? comm->local_size : -1; }
int chorus_comm_same_host(chorus_comm_t comm, int peer) {
  if (!comm || peer < 0 || peer >= comm->size) return -1;
  const chorus__ctx_t *ctx = comm->ctx;
  return ctx->host[comm->world_ranks[peer]] == ctx->host[ctx->rank];
}
int chorus_comm_timeout_ms(chorus_comm_t comm) { return comm ? comm->timeout_ms : -1; }

const char *chorus_comm_last_error(chorus_comm_t comm) { return comm ? comm->last_error : ""; }

chorus_result_t chorus_comm_status(chorus_comm_t comm) {
  if (!comm) return CHORUS_ERR_INVALID_ARG;
  return chorus__ep_status(comm->ep, NULL, 0);
}

chorus_result_t chorus_comm_abort(chorus_comm_t comm) {
  if (!comm) return CHORUS_ERR_INVALID_ARG;
  chorus__ep_fail(comm->ep, CHORUS_ERR_ABORTED, 1,
                  "chorus rank %d/%d: the communicator was aborted by the application "
                  "(chorus_comm_abort)", comm->rank, comm->size);
  pthread_mutex_lock(&comm->lock);
  pthread_cond_broadcast(&comm->cond);
  pthread_mutex_unlock(&comm->lock);
  return CHORUS_OK;
}

chorus_result_t chorus_comm_destroy(chorus_comm_t comm) {
  if (!comm) return CHORUS_OK;
  pthread_mutex_lock(&comm->lock);
  comm->stopping = 1;
  pthread_cond_broadcast(&comm->cond);
  pthread_mutex_unlock(&comm->lock);
  if (comm->worker_started) pthread_join(comm->worker, NULL);
  chorus__shm_detach(comm->shm);
  chorus__ep_destroy(comm->ep);
  chorus__pool_release(&comm->pool);
  ctx_unref(comm->ctx);
  pthread_mutex_destroy(&comm->lock);
  pthread_cond_destroy(&comm->cond);
  free(comm->world_ranks);
  free(comm);
  return CHORUS_OK;
}
