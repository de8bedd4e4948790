/*
 * comm.c - communicator lifecycle: construction over a world context, shared
 * memory for groups on one host, subgroups (new_group, split),
 * algorithm overrides, abort and destroy.
 *
 * The world itself is made in bootstrap.c; this file makes every
 * communicator over it (the world handle and subgroups).
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
#include "util/exit.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

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
chorus_result_t chorus__apply_env_algos(chorus_comm_t comm) {
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
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus: CHORUS_%s_ALGO='%s' is not an algorithm "
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
        return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus: CHORUS_ALGO entry '%s%s%s' is not "
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
  chorus_store_close(ctx->lookup_store);
  chorus_store_close(ctx->store);
  chorus_store_server_stop(ctx->server);
  pthread_mutex_destroy(&ctx->lock);
  chorus__memreg_free(ctx->memreg);
  free(ctx->host);
  free(ctx->rec_prefix);
  chorus__wipe(&ctx->key, sizeof ctx->key);
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
  uint64_t *hosts = malloc(sizeof(uint64_t) * (size_t)n);
  int topo_bad = !hosts;
  if (hosts) {
    for (int i = 0; i < n; i++) hosts[i] = ctx->host[world_ranks[i]];
    topo_bad = chorus__topo_build(&comm->topo, hosts, n, my_rank) != 0;
    free(hosts);
  }
  if (topo_bad) {
    free(comm->world_ranks);
    free(comm);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus_result_t st = chorus__ep_create(ctx->tp, id, world_ranks, n, my_rank, &comm->ep);
  if (st != CHORUS_OK) {
    chorus__topo_free(&comm->topo);
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
  comm->lazy_start = chorus__env()->LAZY_START;
  for (int k = 0; k < CHORUS_COLL_COUNT; k++) comm->forced_algo[k] = -1;
  pthread_mutex_init(&comm->lock, NULL);
  chorus__cond_init_monotonic(&comm->cond);
  chorus__cond_init_monotonic(&comm->wcond);
  pthread_mutex_lock(&ctx->lock);
  ctx->refs++;
  pthread_mutex_unlock(&ctx->lock);
  *out = comm;
  return CHORUS_OK;
}

/* ------------------------------------------------------- shared memory */

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
chorus_result_t chorus__shm_setup(chorus_comm_t comm) {
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
  while ((size_t)chunk * CHORUS__SHM_SLOTS * (size_t)comm->size > ((size_t)256 << 20) &&
         chunk > 16384)
    chunk /= 2;
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

chorus_result_t chorus__comm_derive(chorus_comm_t parent, uint64_t id, const int *world, int n,
                                    int me, chorus_comm_t *out) {
  chorus_result_t st = chorus__comm_create(parent->ctx, id, world, n, me, parent->timeout_ms, out);
  if (st != CHORUS_OK) return st;
  memcpy((*out)->forced_algo, parent->forced_algo, sizeof parent->forced_algo);
  (*out)->debug_checks = parent->debug_checks;
  st = chorus__shm_setup(*out);
  if (st != CHORUS_OK) {
    chorus__comm_set_error(parent, "%s", (*out)->last_error);
    chorus_comm_destroy(*out);
    *out = NULL;
  }
  return st;
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
  chorus_result_t st = chorus__comm_derive(parent, id, world, n, me, out);
  free(world);
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
chorus_result_t chorus_comm_link(chorus_comm_t comm, int peer, char *buf, size_t cap) {
  if (!comm || !buf || cap == 0 || peer < 0 || peer >= comm->size) return CHORUS_ERR_INVALID_ARG;
  chorus__tp_link_desc(comm->ctx->tp, comm->world_ranks[peer], buf, cap);
  return CHORUS_OK;
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
  pthread_cond_signal(&comm->wcond);
  pthread_mutex_unlock(&comm->lock);
  if (chorus__exiting()) {
    /* A destroy from an atexit handler that runs after ours: the world
     * failed and its threads stopped (util/exit.h); the worker finishes
     * its queue (every call fails at once), and what OpenSSL or UCX may
     * have torn down already is not touched: the process frees it. */
    if (comm->worker_started) chorus__join_within(comm->worker, 2000);
    return CHORUS_OK;
  }
  if (comm->worker_started) pthread_join(comm->worker, NULL);
  chorus__shm_detach(comm->shm);
  chorus__ep_destroy(comm->ep);
  chorus__pool_release(&comm->pool);
  chorus__topo_free(&comm->topo);
  ctx_unref(comm->ctx);
  pthread_mutex_destroy(&comm->lock);
  pthread_cond_destroy(&comm->cond);
  pthread_cond_destroy(&comm->wcond);
  free(comm->world_ranks);
  free(comm);
  return CHORUS_OK;
}
