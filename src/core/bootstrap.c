/*
 * bootstrap.c - making the world communicator: from a chorus_config_t
 * (chorus_comm_init) or from the environment a launcher left
 * (chorus_comm_init_env).
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
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/comm.h"
#include "store/rendezvous.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

static __thread char g_init_error[1024];

const char *chorus_last_init_error(void) { return g_init_error; }

chorus_result_t chorus__init_fail(chorus_result_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_init_error, sizeof g_init_error, fmt, ap);
  va_end(ap);
  CHORUS_WARN(CHORUS__SUB_INIT, "%s", g_init_error);
  return st;
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
    if (have < 0) return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: %s", rank, why);
    ws->from_file = have && !(env->JOB_SECRET && *env->JOB_SECRET);
    if (ws->from_file) snprintf(ws->file, sizeof ws->file, "%s", env->JOB_SECRET_FILE);
  }
  if (!have && chorus__net_is_local(cfg->store_host)) {
    char dir[4000];
    if (chorus__runtime_dir(dir, sizeof dir, why, sizeof why) < 0)
      return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: no job secret, and no private "
                       "directory to agree on one: %s", rank, why);
    snprintf(ws->file, sizeof ws->file, "%s/store-%d.key", dir, port);
    ws->from_file = 1;
    if (host) {
      int rc = chorus__secret_generate(ws->secret, sizeof ws->secret);
      if (rc == 0) rc = chorus__secret_write_file(ws->file, ws->secret);
      if (rc < 0)
        return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot write the job secret to "
                         "%s: %s", rank, ws->file, strerror(-rc));
      ws->wrote_file = 1;
    } else {
      /* Wait for the rank serving the store to write it. */
      for (;;) {
        int rc = chorus__secret_read_file(ws->file, ws->secret, sizeof ws->secret, why, sizeof why);
        if (rc == 0) break;
        if (rc != -ENOENT || chorus__ms_left(deadline) == 0)
          return chorus__init_fail(rc == -ENOENT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_INVALID_ARG,
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
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG,
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
    return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot derive the job key: %s", rank,
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
  if (!out) return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: comm is NULL");
  *out = NULL;
  if (!cfg || cfg->magic != CHORUS_CONFIG_MAGIC || cfg->size < sizeof(size_t))
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: config not initialised with "
                     "CHORUS_CONFIG_INITIALIZER");
  if (cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: rank %d is not in [0, %d)",
                     cfg->rank, cfg->world_size);
  if (!cfg->store_host || !*cfg->store_host)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: no store address (MASTER_ADDR)");
  if (cfg->store_port < 0 || cfg->store_port > 65535)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: store port %d out of range",
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
  if (!ws) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
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
    return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
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
      chorus__init_fail(st, "chorus rank %d: cannot serve the store on port %d (%s); is another job "
                "using MASTER_PORT=%d?", rank, port, chorus_strerror(st), port);
      goto fail;
    }
    port = chorus_store_server_port(ctx->server);
  }
  if (port <= 0) {
    st = chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: store port 0 is only valid for the "
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
    chorus__init_fail(st, "chorus rank %d/%d: cannot use the store at %s:%d: %s (is rank 0 or chorusrun "
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
    chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size,
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
    st = chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot listen on %s: %s", rank, ifaddr,
                   strerror(-lfd));
    goto fail;
  }
  char mine[128];
  snprintf(mine, sizeof mine, "%s %d", ifaddr, data_port);
  char err[512] = "out of memory";
  st = chorus__rdzv_allgather(ctx->store, prefix, "addr", rank, size, mine, &addrs, err, sizeof err);
  if (st != CHORUS_OK) {
    close(lfd);
    chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
    goto fail;
  }
  chorus__tp_config_t tcfg = {.rank = rank, .size = size, .key = &ws->key, .world_id = world_id,
                              .listen_fd = lfd, .addrs = (const char *const *)addrs,
                              .deadline = deadline, .retry_ms = (int)env->CONNECT_RETRY_MS,
                              .fp_format = chorus__fp_format};
  st = chorus__tp_create(&tcfg, &ctx->tp, err, sizeof err);
  if (st != CHORUS_OK) {
    chorus__init_fail(st, "chorus rank %d/%d: connecting to the other ranks failed: %s", rank, size, err);
    goto fail;
  }
  chorus__rdzv_free(addrs, size);
  addrs = NULL;
  world_secret_done(ws); /* every rank holds the key now */
  free(ws);
  ws = NULL;
  /* Which ranks share this host (for shared memory). */
  char ident[400];
  chorus__host_identity(ident, sizeof ident);
  ctx->world_id = world_id;
  ctx->host = calloc((size_t)size, sizeof *ctx->host);
  ctx->memreg = chorus__memreg_new(env->JOB_ID, world_id, rank);
  if (!ctx->host || !ctx->memreg) {
    st = chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
    goto fail;
  }
  st = chorus__rdzv_allgather(ctx->store, prefix, "host", rank, size, ident, &addrs, err,
                              sizeof err);
  if (st != CHORUS_OK) {
    chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
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
    st = chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
    goto fail;
  }
  for (int r = 0; r < size; r++) world[r] = r;
  chorus_comm_t comm;
  st = chorus__comm_create(ctx, 1, world, size, rank, timeout_ms, &comm);
  free(world);
  if (st != CHORUS_OK) {
    chorus__init_fail(st, "chorus_comm_init: cannot create the communicator");
    goto fail;
  }
  comm->local_rank = cfg->local_rank;
  comm->local_size = cfg->local_world_size;
  st = chorus__apply_env_algos(comm);
  if (st == CHORUS_OK) {
    st = chorus__shm_setup(comm);
    if (st != CHORUS_OK) chorus__init_fail(st, "%s", comm->last_error);
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
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s is not set; launch "
                       "with chorusrun (or torchrun) or set RANK, WORLD_SIZE, "
                       "MASTER_ADDR and MASTER_PORT", required[i]);
    if (rc == -2)
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s='%s' is not a "
                       "non-negative integer", required[i], getenv(required[i]));
  }
  if (env_int("LOCAL_RANK", &cfg.local_rank, 0) < 0 ||
      env_int("LOCAL_WORLD_SIZE", &cfg.local_world_size, 0) < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: LOCAL_RANK or "
                     "LOCAL_WORLD_SIZE is not a non-negative integer");
  cfg.store_host = getenv("MASTER_ADDR");
  if (!cfg.store_host || !*cfg.store_host) cfg.store_host = "127.0.0.1";
  return world_init(&cfg, comm);
}
