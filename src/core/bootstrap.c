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

#include "algo/algo.h"
#include "core/comm.h"
#include "core/kvs.h"
#include "store/rendezvous.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/host.h"
#include "util/hostlist.h"
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
  char from[300];  /* where the secret came from, for the log (never the secret) */
  chorus__key_t key;
} world_secret_t;

/* <runtime dir>/<name> into buf: 0, or -1 with why. */
static int runtime_file(const char *name, char *buf, size_t cap, char *why, size_t why_cap) {
  char dir[4096];
  if (chorus__runtime_dir(dir, sizeof dir, why, why_cap) < 0) return -1;
  if ((size_t)snprintf(buf, cap, "%s/%s", dir, name) >= cap) {
    snprintf(why, why_cap, "the runtime directory's path is too long");
    return -1;
  }
  return 0;
}

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
    snprintf(ws->from, sizeof ws->from, "the caller (job_secret)");
    have = 1;
  } else {
    have = chorus__secret_configured(ws->secret, sizeof ws->secret, why, sizeof why);
    if (have < 0) return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: %s", rank, why);
    ws->from_file = have && !(env->JOB_SECRET && *env->JOB_SECRET);
    if (ws->from_file) snprintf(ws->file, sizeof ws->file, "%s", env->JOB_SECRET_FILE);
    if (have) chorus__secret_source(ws->from, sizeof ws->from);
  }
  if (!have && chorus__net_is_local(cfg->store_host)) {
    char name[32];
    snprintf(name, sizeof name, "store-%d.key", port);
    if (runtime_file(name, ws->file, sizeof ws->file, why, sizeof why) < 0)
      return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: no job secret, and no private "
                       "directory to agree on one: %s", rank, why);
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
    snprintf(ws->from, sizeof ws->from, "a fresh one %s %.200s (no secret given: the store is "
             "on this host)", host ? "this rank made in" : "read from", ws->file);
  }
  if (!have && !env->INSECURE)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG,
                     "chorus rank %d: no job secret, and the store at %s:%d is not on this host, "
                     "so the ranks cannot agree on one by themselves: give every rank the same "
                     "CHORUS_JOB_SECRET or CHORUS_JOB_SECRET_FILE (chorusrun does this), or set "
                     "CHORUS_INSECURE=1 to let anyone who reaches the ports join "
                     "(docs/security.md)", rank, cfg->store_host, port);
  if (!have) {
    CHORUS_WARN(CHORUS__SUB_INIT, "chorus rank %d: CHORUS_INSECURE=1 and no job secret: anyone "
                "who can reach this job's ports can join it, read and change its data",
                rank);
    snprintf(ws->from, sizeof ws->from, "nowhere: CHORUS_INSECURE=1, the public key");
  }
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

int chorus__env_timeout_ms(void) {
  long s = chorus__env()->TIMEOUT;
  return (int)((s > 0 && s < 2000000 ? s : 300) * 1000);
}

int chorus__init_timeout_ms(const chorus_config_t *cfg, int timeout_ms) {
  /* A caller built against an older header has a shorter struct. */
  size_t end = offsetof(chorus_config_t, init_timeout_ms) + sizeof cfg->init_timeout_ms;
  if (cfg && cfg->size >= end && cfg->init_timeout_ms > 0) return cfg->init_timeout_ms;
  long s = chorus__env()->INIT_TIMEOUT;
  return s > 0 && s < 2000000 ? (int)(s * 1000) : timeout_ms;
}

static void copy_str(char *out, size_t cap, const char *s) {
  size_t n = strlen(s);
  if (n >= cap) n = cap - 1;
  memcpy(out, s, n);
  out[n] = '\0';
}

/* The address this rank listens on for its peers: CHORUS_SOCKET_IFADDR,
 * else the first address of an interface CHORUS_SOCKET_IFNAME names (none
 * is an error), else the address the store connection leaves from -- but
 * never a loopback address when the job may span hosts: a peer on another
 * host would connect to its own loopback.  It may not when MASTER_ADDR is
 * loopback too: the data port then stays on loopback. */
static chorus_result_t listen_addr(const chorus_config_t *cfg, int rank, int size, int store_fd,
                                   char *out, size_t cap) {
  const chorus__env_t *env = chorus__env();
  if (env->SOCKET_IFADDR && *env->SOCKET_IFADDR) {
    snprintf(out, cap, "%s", env->SOCKET_IFADDR);
    return CHORUS_OK;
  }
  if (env->SOCKET_IFNAME && *env->SOCKET_IFNAME) {
    char found[512];
    int rc = chorus__net_ifname_addr(env->SOCKET_IFNAME, found, sizeof found);
    if (rc > 0) {
      copy_str(out, cap, found);
      return CHORUS_OK;
    }
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG,
                             "chorus rank %d: CHORUS_SOCKET_IFNAME=%s matches no interface that is "
                             "up with an address%s%s; set it to one of them (a name prefix, =name, "
                             "or ^names to avoid)", rank, env->SOCKET_IFNAME,
                             rc == 0 && found[0] ? "; this host has: " : "",
                             rc == 0 ? found : "");
  }
  if (chorus__net_local_addr(store_fd, out, cap, NULL) < 0) snprintf(out, cap, "127.0.0.1");
  /* One host also when MASTER_ADDR names loopback and rank 0 serves the
   * store there only: no rank elsewhere can reach it (a port tunnelled from
   * another host is the exception: CHORUS_SOCKET_IFNAME/IFADDR then).  With
   * CHORUS_STORE_BIND_ALL=1, or a store served by someone else, ranks on
   * other hosts may reach it by another address. */
  int one_host = (cfg->local_world_size > 0 && cfg->local_world_size == size) ||
                 (chorus__net_names_loopback(cfg->store_host) && !env->STORE_BIND_ALL &&
                  !env->STORE_EXTERNAL);
  if (!one_host && chorus__net_is_loopback(out)) {
    char addrs[400];
    if (chorus__net_host_addrs(addrs, sizeof addrs) > 0) {
      addrs[strcspn(addrs, ",")] = '\0';
      CHORUS_INFO(CHORUS__SUB_INIT, "chorus rank %d: the store is reached over loopback (%s) but "
                  "the job may span hosts: listening for peers on %s (set CHORUS_SOCKET_IFNAME or "
                  "CHORUS_SOCKET_IFADDR to choose)", rank, out, addrs);
      copy_str(out, cap, addrs);
    }
  }
  return CHORUS_OK;
}

/* How long a store may refuse a rank's key, or fail to prove it holds it,
 * before the rank gives up on it (chorusrun's agents: WRONG_ANSWER_MS). */
#define REFUSED_MS 5000

/* ----------------------------------------------------------- the world
 *
 * world_make runs the steps below in order, each filling its part of a
 * world_build_t; the first that fails stops it, and build_abandon frees
 * what the earlier ones made:
 *   1. build_begin      the configuration checked, the tuning file, the
 *                       timeouts, the job secret, the context;
 *   2. build_store      the store served (rank 0, or the one a launcher's
 *                       key-value service published) and joined, patient
 *                       with a store that refuses while the secret's file
 *                       is replaced;
 *   3. build_world_id   a fresh id for this world, from rank 0;
 *   4. build_publish    this rank's record -- where it listens, a nonce,
 *                       its UCX address, its host -- all-gathered;
 *   5. build_records    the records checked; the host map; UCX or not;
 *   6. build_transport  the transport over them;
 *   7. build_comm       the world communicator, its shared memory and
 *                       algorithms, its own timeout. */
typedef struct {
  const chorus_config_t *cfg;
  int rank, size, timeout_ms, init_ms, host; /* host: this rank serves the store */
  int64_t deadline;
  char prefix[256];
  world_secret_t *ws;
  chorus__ctx_t *ctx;
  uint64_t world_id;
  int lfd;                  /* the data listener, until the transport takes it */
  char addrs_mine[128];     /* "ADDR PORT" */
  char ident[400];          /* this host's identity */
  char **addrs;             /* every rank's record (then cut to its address) */
  chorus__ucx_worker_t *ucx; /* until the transport takes it */
  char ucx_kind;            /* 'U' forced, 'A' automatic, '-' none */
  char rdma[256];           /* the RDMA device seen here */
  uint64_t *nonce;          /* per rank */
  const char **ucx_addrs;   /* per rank, into addrs */
  int use_ucx;
} world_build_t;

static chorus_result_t check_config(const chorus_config_t *cfg) {
  if (!cfg || cfg->magic != CHORUS_CONFIG_MAGIC || cfg->size < sizeof(size_t))
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: config not initialised "
                             "with CHORUS_CONFIG_INITIALIZER");
  if (cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: rank %d is not in [0, %d)",
                             cfg->rank, cfg->world_size);
  if (!cfg->store_host || !*cfg->store_host)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: no store address "
                             "(MASTER_ADDR)");
  if (cfg->store_port < 0 || cfg->store_port > 65535)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: store port %d out of "
                             "range", cfg->store_port);
  return CHORUS_OK;
}

/* 1. */
static chorus_result_t build_begin(world_build_t *b, const chorus__key_t *job_key,
                                   const char *join_base) {
  const chorus__env_t *env = chorus__env();
  const chorus_config_t *cfg = b->cfg;
  b->rank = cfg->rank, b->size = cfg->world_size;
  char terr[600];
  if (chorus__tune_load(terr, sizeof terr) != CHORUS_OK)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: %s (fix the file, or unset "
                             "CHORUS_TUNING_FILE for the built-in choice)", cfg->rank, terr);
  b->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : chorus__env_timeout_ms();
  b->init_ms = chorus__init_timeout_ms(cfg, b->timeout_ms);
  if (cfg->store_prefix) snprintf(b->prefix, sizeof b->prefix, "%s", cfg->store_prefix);
  else snprintf(b->prefix, sizeof b->prefix, "chorus/r%ld/", env->RESTART_COUNT);
  b->host = cfg->host_store >= 0 ? cfg->host_store : (b->rank == 0 && !env->STORE_EXTERNAL);
  b->deadline = chorus__deadline_ms(b->init_ms);
  b->ws = calloc(1, sizeof *b->ws);
  if (!b->ws) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  if (job_key) b->ws->key = *job_key;
  else {
    chorus_result_t st = world_secret(cfg, b->rank, b->host, cfg->store_port, b->deadline, b->ws);
    if (st != CHORUS_OK) return st;
  }
  chorus__ctx_t *ctx = b->ctx = calloc(1, sizeof *ctx);
  if (!ctx) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  pthread_mutex_init(&ctx->lock, NULL);
  ctx->rank = b->rank;
  ctx->size = b->size;
  snprintf(ctx->store_host, sizeof ctx->store_host, "%s", cfg->store_host);
  if (join_base) snprintf(ctx->join_base, sizeof ctx->join_base, "%s", join_base);
  else snprintf(ctx->join_base, sizeof ctx->join_base, "%.190sjoin/", b->prefix);
  return CHORUS_OK;
}

/* 2.  *server, when not NULL, is the store this rank already serves: the
 * world takes it (*server becomes NULL). */
static chorus_result_t build_store(world_build_t *b, chorus_store_server_t **server) {
  const chorus__env_t *env = chorus__env();
  const chorus_config_t *cfg = b->cfg;
  chorus__ctx_t *ctx = b->ctx;
  const int rank = b->rank, size = b->size;
  world_secret_t *ws = b->ws;
  const int64_t deadline = b->deadline;
  chorus_result_t st = CHORUS_OK;
  int port = cfg->store_port;
  if (*server) {
    ctx->server = *server;
    *server = NULL;
    port = chorus_store_server_port(ctx->server);
  } else if (b->host) {
    /* On MASTER_ADDR's address only: all interfaces when asked. */
    st = chorus__store_server_start_key(env->STORE_BIND_ALL ? NULL : cfg->store_host, port,
                                        &ws->key, &ctx->server);
    if (st != CHORUS_OK) {
      const int why = errno; /* set by the store's start (0: not a system call's failure) */
      char owner[200];
      if (port > 0 && chorus__net_port_owner(port, owner, sizeof owner) > 0)
        return chorus__init_fail(st, "chorus rank %d: cannot serve the store on port %d (%s): the "
                                 "port is held by %s; stop it or choose another MASTER_PORT", rank,
                                 port, why ? strerror(why) : chorus_result_name(st), owner);
      return chorus__init_fail(st, "chorus rank %d: cannot serve the store on port %d (%s); is "
                               "another job using MASTER_PORT=%d?", rank, port,
                               why ? strerror(why) : chorus_result_name(st), port);
    }
    port = chorus_store_server_port(ctx->server);
  }
  if (port <= 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d: store port 0 is only valid "
                             "for the rank that serves the store", rank);
  ctx->store_port = port;
  /* Refused, or answered by a server that cannot prove it holds the key:
   * the agreement file this rank read may have been stale, so it reads it
   * again and retries; but REFUSED_MS of nothing else means the port is
   * someone else's (another job, or a stranger who speaks the store's
   * hello): give up then, as chorusrun does, naming the port's owner. */
  int64_t refused_since = 0;
  int pause_ms = 20;
  for (;;) {
    st = chorus__store_connect_key(cfg->store_host, port, &ws->key,
                                   chorus__ms_left_bound(deadline), &ctx->store);
    if (st == CHORUS_OK || !chorus__store_connect_denied() || chorus__ms_left(deadline) == 0)
      break;
    int64_t now = chorus__now_ns();
    if (!refused_since) refused_since = now;
    if (now - refused_since >= (int64_t)REFUSED_MS * 1000000) break;
    struct timespec ts = {0, (long)CHORUS__MIN(pause_ms, chorus__ms_left(deadline)) * 1000000};
    nanosleep(&ts, NULL);
    pause_ms = CHORUS__MIN(pause_ms * 2, 500);
    if (world_secret_reread(ws)) refused_since = 0, pause_ms = 20;
  }
  if (st != CHORUS_OK) {
    /* Something answered, wrongly: on this host, say whose the port is. */
    char owner[200], why[sizeof owner + 64] = "";
    if (chorus__store_connect_answer() != CHORUS__STORE_ANS_NO_ANSWER &&
        chorus__net_is_local(cfg->store_host) &&
        chorus__net_port_owner(port, owner, sizeof owner) > 0)
      snprintf(why, sizeof why, "; port %d here is held by %s", port, owner);
    if (refused_since)
      return chorus__init_fail(st, "chorus rank %d/%d: the store at %s:%d refused this rank, or "
                               "could not prove it is this job's, for %.1f s: %s%s.  Every rank "
                               "needs the same job secret; otherwise another job or a stranger "
                               "holds that port: choose another MASTER_PORT", rank, size,
                               cfg->store_host, port, (chorus__now_ns() - refused_since) / 1e9,
                               chorus__store_connect_error(), why);
    return chorus__init_fail(st, "chorus rank %d/%d: cannot use the store at %s:%d: %s%s (is "
                             "rank 0 or chorusrun running, are MASTER_ADDR/MASTER_PORT and the "
                             "job secret right?)", rank, size, cfg->store_host, port,
                             chorus__store_connect_error(), why);
  }
  ctx->key = ws->key; /* as the store accepted it (it may have been read again) */
  return CHORUS_OK;
}

/* 3.  Fresh per world, so stale peers cannot join. */
static chorus_result_t build_world_id(world_build_t *b) {
  chorus__ctx_t *ctx = b->ctx;
  char key[300], idbuf[40];
  chorus_result_t st;
  snprintf(key, sizeof key, "%sworld_id", b->prefix);
  if (b->rank == 0) {
    chorus__random_bytes(&b->world_id, sizeof b->world_id);
    snprintf(idbuf, sizeof idbuf, "%016" PRIx64, b->world_id);
    st = chorus_store_set(ctx->store, key, idbuf, strlen(idbuf));
  } else {
    void *val = NULL;
    size_t len = 0;
    chorus__store_set_timeout(ctx->store, chorus__ms_left_bound(b->deadline));
    st = chorus_store_get(ctx->store, key, &val, &len);
    if (st == CHORUS_OK) {
      snprintf(idbuf, sizeof idbuf, "%.*s", (int)CHORUS__MIN(len, 32), (char *)val);
      b->world_id = strtoull(idbuf, NULL, 16);
      free(val);
    }
  }
  if (st != CHORUS_OK)
    return chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", b->rank, b->size,
                             chorus_store_last_error(ctx->store));
  return CHORUS_OK;
}

/* 4.  One round publishes what the transport needs of each rank: the
 * address it listens on, a random nonce (names its shared-memory inbox
 * and doorbell, so nobody outside the job can know them), and its host
 * identity (which ranks share memory, the host map of the hierarchical
 * algorithms), and its UCX worker's address when it would use UCX
 * between hosts: "U<hex>" with CHORUS_TRANSPORT=ucx, "A<hex>" when
 * automatic and this host has an active RDMA device, "-" otherwise
 * (chorus__ucx_decide makes every rank's choice from all of them):
 * "ADDR PORT|NONCE|UCX|IDENT". */
static chorus_result_t build_publish(world_build_t *b) {
  const chorus__env_t *env = chorus__env();
  const chorus_config_t *cfg = b->cfg;
  const int rank = b->rank, size = b->size;
  chorus_result_t st;
  /* Listen where peers can reach us. */
  char ifaddr[80];
  st = listen_addr(cfg, rank, size, chorus__store_fd(b->ctx->store), ifaddr, sizeof ifaddr);
  if (st != CHORUS_OK) return st;
  int data_port = 0;
  b->lfd = chorus__net_listen(ifaddr, 0, 4096, &data_port); /* strangers must not fill it */
  if (b->lfd < 0) {
    int e = -b->lfd;
    b->lfd = -1;
    return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot listen on %s: %s", rank,
                             ifaddr, strerror(e));
  }
  char *ucx_hex = NULL;
  const char *tmode = env->TRANSPORT && env->TRANSPORT[0] ? env->TRANSPORT : "auto";
  b->ucx_kind = '-';
  if (!strcasecmp(tmode, "ucx")) {
    b->ucx_kind = 'U';
  } else if ((!strcasecmp(tmode, "auto") || !strcasecmp(tmode, "shm")) && !env->ENCRYPT &&
             size > cfg->local_world_size && chorus__ucx_built() &&
             chorus__rdma_active("/sys/class/infiniband", b->rdma, sizeof b->rdma) > 0) {
    b->ucx_kind = 'A';
  }
  if (b->ucx_kind == 'U' && env->ENCRYPT)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d/%d: CHORUS_ENCRYPT=1 and "
                             "CHORUS_TRANSPORT=ucx: the UCX channel cannot encrypt; unset one of "
                             "them (TCP encrypts)", rank, size);
  if (b->ucx_kind != '-') {
    char uerr[256] = "out of memory";
    st = chorus__ucx_worker_new(&b->ucx, &ucx_hex, b->ucx_kind == 'A', uerr, sizeof uerr);
    if (st != CHORUS_OK && b->ucx_kind == 'U')
      return chorus__init_fail(st, "chorus rank %d/%d: CHORUS_TRANSPORT=ucx: %s", rank, size,
                               uerr);
    if (st != CHORUS_OK) { /* automatic: TCP it is */
      CHORUS_INFO(CHORUS__SUB_INIT, "RDMA device %s here, but UCX cannot start (%s): TCP "
                  "between hosts", b->rdma, uerr);
      b->ucx_kind = '-';
    }
  }
  if (env->HOST_ID && env->HOST_ID[0])
    snprintf(b->ident, sizeof b->ident, "id %s", env->HOST_ID);
  else
    chorus__host_identity(b->ident, sizeof b->ident);
  uint64_t my_nonce = 0;
  chorus__random_bytes(&my_nonce, sizeof my_nonce);
  snprintf(b->addrs_mine, sizeof b->addrs_mine, "%s %d", ifaddr, data_port);
  size_t mine_cap = 700 + (ucx_hex ? strlen(ucx_hex) : 0);
  char *mine = malloc(mine_cap);
  char err[512] = "out of memory";
  st = CHORUS_ERR_NO_MEMORY;
  if (mine) {
    snprintf(mine, mine_cap, "%s|%016" PRIx64 "|%s%s|%s", b->addrs_mine, my_nonce,
             ucx_hex ? (b->ucx_kind == 'U' ? "U" : "A") : "-", ucx_hex ? ucx_hex : "", b->ident);
    st = chorus__rdzv_allgather(b->ctx->store, b->prefix, "addr", rank, size, mine, b->deadline,
                                &b->addrs, err, sizeof err);
  }
  free(mine);
  free(ucx_hex);
  if (st != CHORUS_OK)
    return chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
  return CHORUS_OK;
}

/* 5.  Every record came through the store: checked before it is used.
 * Each is cut in place into its address (what the transport parses) and
 * the rest.  UCX between hosts when every rank has an address; an error on
 * every rank when one forced it and another cannot. */
static chorus_result_t build_records(world_build_t *b) {
  const chorus__env_t *env = chorus__env();
  chorus__ctx_t *ctx = b->ctx;
  const int rank = b->rank, size = b->size;
  ctx->world_id = b->world_id;
  ctx->host = calloc((size_t)size, sizeof *ctx->host);
  b->nonce = calloc((size_t)size, sizeof *b->nonce);
  ctx->memreg = chorus__memreg_new(env->JOB_ID, b->world_id, rank);
  b->ucx_addrs = calloc((size_t)size, sizeof *b->ucx_addrs); /* the UCX fields */
  if (!ctx->host || !b->nonce || !ctx->memreg || !b->ucx_addrs)
    return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  static const uint8_t hkey[16] = "chorus-hostident";
  for (int r = 0; r < size; r++) {
    char *bar = strchr(b->addrs[r], '|');
    char *bar2 = bar ? strchr(bar + 1, '|') : NULL;
    char *bar3 = bar2 ? strchr(bar2 + 1, '|') : NULL;
    char *end = NULL;
    if (bar && bar2 && bar2 - bar == 17) b->nonce[r] = strtoull(bar + 1, &end, 16);
    if (!bar3 || end != bar2)
      return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d: rank %d published a "
                               "malformed address record (another chorus version?)", rank, size,
                               r);
    *bar = '\0';
    *bar3 = '\0';
    b->ucx_addrs[r] = bar2 + 1;
    const char *their = bar3 + 1;
    ctx->host[r] = chorus__siphash(hkey, their, strlen(their));
    if (!strcmp(their, b->ident)) ctx->local_count++;
  }
  int bad = -1, use = chorus__ucx_decide(b->ucx_addrs, size, &bad);
  if (use < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d/%d: CHORUS_TRANSPORT=ucx on "
                             "some ranks but rank %d has no UCX (another CHORUS_TRANSPORT, or "
                             "UCX could not start there: see its log): set the same "
                             "CHORUS_TRANSPORT on every rank", rank, size, bad);
  if (!use) {
    if (b->ucx)
      CHORUS_INFO(CHORUS__SUB_INIT, "RDMA device %s here, but rank %d has none: TCP between "
                  "hosts", b->rdma, bad);
    chorus__ucx_worker_free(b->ucx);
    b->ucx = NULL;
  } else {
    b->use_ucx = 1;
    for (int r = 0; r < size; r++) b->ucx_addrs[r]++; /* past U/A: the address */
    if (b->ucx_kind == 'A')
      CHORUS_INFO(CHORUS__SUB_INIT, "RDMA device %s on every host: UCX between hosts", b->rdma);
  }
  return CHORUS_OK;
}

/* 6.  The transport takes the listener and the UCX worker, whatever comes
 * of it. */
static chorus_result_t build_transport(world_build_t *b) {
  const chorus__env_t *env = chorus__env();
  chorus__ctx_t *ctx = b->ctx;
  char err[512] = "";
  chorus__tp_config_t tcfg = {.rank = b->rank, .size = b->size, .key = &b->ws->key,
                              .world_id = b->world_id, .listen_fd = b->lfd,
                              .addrs = (const char *const *)b->addrs, .deadline = b->deadline,
                              .retry_ms = (int)env->CONNECT_RETRY_MS,
                              .fp_format = chorus__fp_format, .host = ctx->host,
                              .nonce = b->nonce, .ucx = b->ucx,
                              .ucx_addrs = b->use_ucx ? b->ucx_addrs : NULL};
  chorus_result_t st = chorus__tp_create(&tcfg, &ctx->tp, err, sizeof err);
  b->lfd = -1;
  b->ucx = NULL;
  if (st != CHORUS_OK)
    return chorus__init_fail(st, "chorus rank %d/%d: connecting to the other ranks failed: %s",
                             b->rank, b->size, err);
  return CHORUS_OK;
}

/* What the steps made, when one failed. */
static void build_abandon(world_build_t *b) {
  if (b->ws) {
    world_secret_done(b->ws);
    free(b->ws);
  }
  free(b->nonce);
  free(b->ucx_addrs);
  chorus__ucx_worker_free(b->ucx);
  if (b->lfd >= 0) close(b->lfd);
  chorus__rdzv_free(b->addrs, b->size);
  chorus__ctx_t *ctx = b->ctx;
  if (ctx) {
    if (ctx->tp) chorus__tp_destroy(ctx->tp, chorus__deadline_ms(0));
    chorus__memreg_free(ctx->memreg);
    free(ctx->host);
    chorus_store_close(ctx->store);
    chorus_store_server_stop(ctx->server);
    pthread_mutex_destroy(&ctx->lock);
    chorus__wipe(&ctx->key, sizeof ctx->key);
    free(ctx);
  }
  free(b);
}

/* 7.  The communicator takes the context; b is freed either way. */
static chorus_result_t build_comm(world_build_t *b, chorus_comm_t *out) {
  const chorus_config_t *cfg = b->cfg;
  chorus__ctx_t *ctx = b->ctx;
  const int rank = b->rank, size = b->size, timeout_ms = b->timeout_ms;
  /* What only init needed: every rank holds the key now. */
  free(b->nonce);
  free(b->ucx_addrs);
  b->nonce = NULL, b->ucx_addrs = NULL;
  chorus__rdzv_free(b->addrs, size);
  b->addrs = NULL;
  world_secret_done(b->ws);
  free(b->ws);
  b->ws = NULL;
  int *world = malloc(sizeof(int) * (size_t)size);
  if (!world) {
    build_abandon(b);
    return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  }
  for (int r = 0; r < size; r++) world[r] = r;
  chorus_comm_t comm;
  /* The set-up below still belongs to init: it runs under init's bound,
   * and the communicator gets its own timeout once it is ready. */
  chorus_result_t st = chorus__comm_create(ctx, 1, world, size, rank, b->init_ms, &comm);
  free(world);
  if (st != CHORUS_OK) {
    build_abandon(b);
    return chorus__init_fail(st, "chorus_comm_init: cannot create the communicator");
  }
  char addrs_mine[sizeof b->addrs_mine];
  snprintf(addrs_mine, sizeof addrs_mine, "%s", b->addrs_mine);
  free(b); /* the context is the communicator's now */
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
  comm->timeout_ms = timeout_ms;
  if (comm->shm) comm->shm->timeout_ms = timeout_ms;
  chorus__store_set_timeout(ctx->store, timeout_ms);
  chorus__log_set_identity(rank, size);
  CHORUS_INFO(CHORUS__SUB_INIT, "communicator ready: rank %d/%d, store %s, listening on %s",
              rank, size, chorus__store_address(ctx->store), addrs_mine);
  g_init_error[0] = '\0';
  *out = comm;
  return CHORUS_OK;
}

/* Makes the world (the steps above).  *server, when not NULL, is the store
 * this rank already serves (the launcher's key-value service published its
 * port): the world takes it (*server becomes NULL) once it is past the
 * argument checks.  secret_from, when not NULL, says where cfg->job_secret
 * came from (a key-value exchange), for the log line that names the
 * secret's source. */
static chorus_result_t world_make(const chorus_config_t *cfg, const chorus__key_t *job_key,
                                  const char *join_base, chorus_store_server_t **server,
                                  const char *secret_from, chorus_comm_t *out) {
  chorus__log_init();
  if (!out) return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: comm is NULL");
  *out = NULL;
  chorus_result_t st = check_config(cfg);
  if (st != CHORUS_OK) return st;
  world_build_t *b = calloc(1, sizeof *b);
  if (!b) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  b->cfg = cfg;
  b->lfd = -1;
  st = build_begin(b, job_key, join_base);
  if (st == CHORUS_OK) st = build_store(b, server);
  if (st == CHORUS_OK && (secret_from || b->ws->from[0]))
    /* Which secret this world runs on, never the secret: what a user (and
     * tests/launcher, tests/python/torch) checks to see the job is not open. */
    CHORUS_INFO(CHORUS__SUB_INIT, "chorus rank %d/%d: job secret from %s", b->rank, b->size,
                secret_from ? secret_from : b->ws->from);
  if (st == CHORUS_OK) st = build_world_id(b);
  if (st == CHORUS_OK) st = build_publish(b);
  if (st == CHORUS_OK) st = build_records(b);
  if (st == CHORUS_OK) st = build_transport(b);
  if (st == CHORUS_OK) return build_comm(b, out);
  build_abandon(b);
  return st;
}

chorus_result_t chorus__world_key(const chorus_config_t *cfg, int timeout_ms,
                                  chorus__key_t *key) {
  world_secret_t *ws = calloc(1, sizeof *ws);
  if (!ws) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  chorus_result_t st = world_secret(cfg, 1, 0, cfg->store_port, chorus__deadline_ms(timeout_ms),
                                    ws);
  if (st == CHORUS_OK) *key = ws->key;
  world_secret_done(ws);
  free(ws);
  return st;
}

chorus_result_t chorus__world_make(const chorus_config_t *cfg, const chorus__key_t *key,
                                   const char *join_base, chorus_comm_t *out) {
  chorus_store_server_t *server = NULL;
  return world_make(cfg, key, join_base, &server, NULL, out);
}

static chorus_result_t world_init(const chorus_config_t *cfg, chorus_store_server_t *server,
                                  const char *secret_from, chorus_comm_t *out) {
  chorus_result_t st = world_make(cfg, NULL, NULL, &server, secret_from, out);
  chorus_store_server_stop(server); /* NULL once the world took it */
  return st;
}

chorus_result_t chorus_comm_init(const chorus_config_t *config, chorus_comm_t *comm) {
  return world_init(config, NULL, NULL, comm);
}

/* ----------------------------------------------- the launcher's environment
 *
 * chorus_comm_init_env() finds who this process is from the first of:
 *   1. RANK and WORLD_SIZE (torchrun's contract: chorusrun, torchrun, by
 *      hand) -- explicit values always win;
 *   2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE;
 *   3. a PMI-1 launcher: PMI_RANK and PMI_SIZE with PMI_FD (MPICH's hydra,
 *      `srun --mpi=pmi2`), MPI_LOCALRANKID/MPI_LOCALNRANKS or Slurm's
 *      variables for the node-local part;
 *   4. Slurm's srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
 *      SLURM_NODEID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE -- only
 *      in a task that srun started (SLURM_STEP_ID set and SLURM_TASK_PID our
 *      pid or our parent's, for a wrapper script): a process that merely
 *      inherited them (a program run directly in an sbatch script, a child
 *      of a task) must not believe it is task SLURM_PROCID.
 * and where the store is from the first of:
 *   a. MASTER_ADDR and MASTER_PORT;
 *   b. the launcher's key-value service (kvs.h): rank 0 starts the store on
 *      a port the kernel picks, on every interface, and publishes the port,
 *      its host and its addresses (plus a fresh job secret when none was
 *      configured); the others read them after a fence -- no port race, no
 *      address guess;
 *   c. every rank on one host: 127.0.0.1 and a port derived from the
 *      launcher's job id (MASTER_PORT wins);
 *   d. Slurm without a key-value service: the first host of the step's node
 *      list and the derived port (a job secret must be configured then);
 * else the world cannot form, and that is an error at once -- never a world
 * of one per node.
 */

typedef struct {
  const char *source; /* who launched us, for messages */
  int explicit_ranks; /* from RANK/WORLD_SIZE (not a launcher's own variables) */
  int rank, size;
  int local_rank, local_size; /* -1: unknown */
  int nnodes;                 /* -1: unknown */
  char tag[160];              /* the launcher's job id, for a derived port */
  const char *nodelist;       /* Slurm's step node list, or NULL */
} launch_t;

/* Reads a non-negative integer variable: 1 set, 0 unset, -1 malformed. */
static int env_int(const char *name, int *out) {
  const char *v = getenv(name);
  long x;
  if (!v || !*v) return 0;
  if (chorus__parse_long(v, &x) < 0 || x < 0 || x > 1 << 30) return -1;
  *out = (int)x;
  return 1;
}

/* Both set and well formed: 1; both unset: 0; else an error message. */
static int env_pair(const char *a, int *va, const char *b, int *vb, char *err, size_t cap) {
  int ra = env_int(a, va), rb = env_int(b, vb);
  if (ra < 0 || rb < 0) {
    snprintf(err, cap, "%s='%s' is not a non-negative integer", ra < 0 ? a : b,
             getenv(ra < 0 ? a : b));
    return -1;
  }
  if (ra != rb) {
    snprintf(err, cap, "%s is set but %s is not", ra ? a : b, ra ? b : a);
    return -1;
  }
  if (ra && *va >= *vb) {
    snprintf(err, cap, "%s=%d is not below %s=%d", a, *va, b, *vb);
    return -1;
  }
  return ra;
}

/* Tasks on node `node` from SLURM_STEP_TASKS_PER_NODE ("2(x3),1"), or -1. */
static int slurm_tasks_on_node(const char *spec, int node) {
  int seen = 0;
  for (const char *p = spec; p && *p;) {
    char *end;
    long n = strtol(p, &end, 10), reps = 1;
    if (end == p || n < 0) return -1;
    p = end;
    if (*p == '(') {
      if (p[1] != 'x') return -1;
      reps = strtol(p + 2, &end, 10);
      if (end == p + 2 || *end != ')' || reps < 1) return -1;
      p = end + 1;
    }
    if (node < seen + reps) return (int)n;
    seen += (int)reps;
    if (*p == ',') p++;
    else if (*p) return -1;
  }
  return -1;
}

/* 1 when this process is a task srun started (see above). */
static int slurm_task(void) {
  int task_pid;
  if (!getenv("SLURM_STEP_ID") && !getenv("SLURM_STEPID")) return 0;
  if (env_int("SLURM_TASK_PID", &task_pid) != 1) return 0;
  return task_pid == (int)getpid() || task_pid == (int)getppid();
}

/* Fills L from the environment.  0, or -1 with err set (nothing usable, or
 * malformed values). */
static int launch_detect(launch_t *L, char *err, size_t cap) {
  memset(L, 0, sizeof *L);
  L->local_rank = L->local_size = L->nnodes = -1;
  int r = env_pair("RANK", &L->rank, "WORLD_SIZE", &L->size, err, cap);
  if (r < 0) return -1;
  if (r) {
    L->source = "RANK/WORLD_SIZE";
    L->explicit_ranks = 1;
    int lr, ls, gs;
    if (env_int("LOCAL_RANK", &lr) == 1 && env_int("LOCAL_WORLD_SIZE", &ls) == 1 && lr < ls) {
      L->local_rank = lr;
      L->local_size = ls;
    }
    if (env_int("GROUP_WORLD_SIZE", &gs) == 1 && gs > 0) L->nnodes = gs;
    return 0;
  }
  r = env_pair("OMPI_COMM_WORLD_RANK", &L->rank, "OMPI_COMM_WORLD_SIZE", &L->size, err, cap);
  if (r < 0) return -1;
  if (r) {
    L->source = "Open MPI's mpirun";
    if (env_pair("OMPI_COMM_WORLD_LOCAL_RANK", &L->local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE",
                 &L->local_size, err, cap) <= 0)
      L->local_rank = L->local_size = -1;
    const char *id = getenv("OMPI_MCA_ess_base_jobid");
    if (!id) id = getenv("PMIX_NAMESPACE");
    snprintf(L->tag, sizeof L->tag, "ompi:%s", id ? id : "");
    return 0;
  }
  int slurm = slurm_task();
  if (getenv("PMI_FD")) {
    r = env_pair("PMI_RANK", &L->rank, "PMI_SIZE", &L->size, err, cap);
    if (r < 0) return -1;
    if (r) {
      L->source = slurm ? "srun (PMI)" : "a PMI launcher (mpiexec)";
      if (env_pair("MPI_LOCALRANKID", &L->local_rank, "MPI_LOCALNRANKS", &L->local_size, err,
                   cap) <= 0)
        L->local_rank = L->local_size = -1;
      if (!slurm) return 0;
      /* srun --mpi=pmi2: Slurm's variables describe the same task. */
      int sr = -1;
      if (env_int("SLURM_PROCID", &sr) != 1 || sr != L->rank) return 0;
    }
  }
  if (!slurm) {
    if (getenv("SLURM_PROCID") && getenv("SLURM_JOB_ID"))
      snprintf(err, cap, "SLURM_PROCID is set but this process was not started by srun as a "
               "task (no SLURM_STEP_ID, or SLURM_TASK_PID is not this process or its parent), "
               "so it is not believed; run the program with srun, chorusrun or torchrun, or "
               "set RANK and WORLD_SIZE");
    else
      snprintf(err, cap, "RANK and WORLD_SIZE are not set; launch with chorusrun (or torchrun), "
               "srun, mpirun or mpiexec, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
    return -1;
  }
  int node = -1, tasks = -1;
  if (!L->source) {
    if (env_int("SLURM_PROCID", &L->rank) != 1 ||
        (env_int("SLURM_STEP_NUM_TASKS", &tasks) != 1 && env_int("SLURM_NTASKS", &tasks) != 1) ||
        tasks <= 0 || L->rank >= tasks) {
      snprintf(err, cap, "srun's SLURM_PROCID='%s' / SLURM_STEP_NUM_TASKS='%s' are missing or "
               "inconsistent", getenv("SLURM_PROCID") ? getenv("SLURM_PROCID") : "",
               getenv("SLURM_STEP_NUM_TASKS") ? getenv("SLURM_STEP_NUM_TASKS") : "");
      return -1;
    }
    L->size = tasks;
    L->source = "srun";
  }
  int lr;
  const char *tpn = getenv("SLURM_STEP_TASKS_PER_NODE");
  if (!tpn) tpn = getenv("SLURM_TASKS_PER_NODE");
  if (env_int("SLURM_NODEID", &node) == 1 && env_int("SLURM_LOCALID", &lr) == 1 && tpn) {
    int ls = slurm_tasks_on_node(tpn, node);
    if (ls > lr) {
      L->local_rank = lr;
      L->local_size = ls;
    }
  }
  int nn;
  if (env_int("SLURM_STEP_NUM_NODES", &nn) == 1 && nn > 0) L->nnodes = nn;
  L->nodelist = getenv("SLURM_STEP_NODELIST");
  const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
  if (!step) step = getenv("SLURM_STEPID");
  snprintf(L->tag, sizeof L->tag, "slurm:%s.%s", job ? job : "", step ? step : "");
  return 0;
}

/* Every rank on this host? 1 yes, 0 no, -1 unknown. */
static int launch_one_host(const launch_t *L) {
  if (L->size == 1 || L->nnodes == 1) return 1;
  if (L->nnodes > 1) return 0;
  if (L->local_size > 0) return L->local_size == L->size;
  return -1;
}

/* A store port derived from the launcher's job id, the same on every rank:
 * [20000, 32000), below Linux's ephemeral range. */
static int derived_port(const launch_t *L) {
  static const uint8_t key[16] = "chorus-storeport";
  return 20000 + (int)(chorus__siphash(key, L->tag, strlen(L->tag)) % 12000);
}

/* Who takes part in a key-value exchange. */
typedef struct {
  int rank, size;
  const char *source; /* the launcher, for messages */
  int one_host;       /* 1: every rank on this host (the store on 127.0.0.1) */
  const char *service; /* the key-value service, for the secret's log line */
  /* Not NULL: a fresh secret goes in a file of the runtime directory, whose
   * path this receives (rank 0 removes it once the world formed), and the
   * service carries only its name -- for services strangers may read (a
   * caller's: torch's TCPStore has no authentication). One host only. */
  char *secret_file;
  size_t secret_file_cap;
} exchange_t;

/* Rank 0, one host: the fresh secret into a new file; its name ("@" and 32
 * hex digits, what the others look for) into ref.  0, or -1 with why. */
static int kv_secret_to_file(const exchange_t *L, const char *secret, char *ref, size_t ref_cap,
                             char *why, size_t why_cap) {
  char rnd[65];
  if (chorus__secret_generate(rnd, sizeof rnd) != 0) {
    snprintf(why, why_cap, "cannot get random bytes");
    return -1;
  }
  rnd[32] = '\0';
  char name[40];
  snprintf(name, sizeof name, "kv-%.32s.key", rnd);
  if (runtime_file(name, L->secret_file, L->secret_file_cap, why, why_cap) < 0) {
    L->secret_file[0] = '\0';
    return -1;
  }
  int rc = chorus__secret_write_file(L->secret_file, secret);
  if (rc != 0) {
    snprintf(why, why_cap, "cannot write %.300s: %s", L->secret_file, strerror(-rc));
    L->secret_file[0] = '\0';
    return -1;
  }
  snprintf(ref, ref_cap, "@%.32s", rnd);
  return 0;
}

/* The key-value exchange (b above, and chorus_comm_init_kv); kvs is closed
 * on every path.  On success cfg has the store's host and port (and the job
 * secret, in secret, when rank 0 made one), and rank 0 holds the running
 * store in *server.  from says where the secret came from when cfg has it
 * ("" when the world finds its own: world_secret). */
static chorus_result_t kvs_exchange(const exchange_t *L, chorus__kvs_t *kvs, chorus_config_t *cfg,
                                    char *host, size_t host_cap, char *secret, size_t secret_cap,
                                    chorus_store_server_t **server, int64_t deadline, char *from,
                                    size_t from_cap) {
  const chorus__env_t *env = chorus__env();
  char err[600], val[CHORUS__KVS_VALUE_MAX + 1], why[600];
  chorus_result_t st = CHORUS_OK;
  int one_host = L->one_host;
  char addrs[400]; /* rank 0's, published */
  from[0] = '\0';
  if (secret[0]) snprintf(from, from_cap, "the caller (job_secret)");
  if (L->rank == 0) {
    /* Bind first, publish second: the port is ours before anyone reads it. */
    int have = secret[0] ? 1 : chorus__secret_configured(secret, secret_cap, why, sizeof why);
    if (have > 0 && !from[0]) chorus__secret_source(from, from_cap);
    if (have < 0) {
      chorus__kvs_close(kvs, deadline);
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank 0: %s", why);
    }
    if (!have && chorus__secret_generate(secret, secret_cap) != 0) {
      chorus__kvs_close(kvs, deadline);
      return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank 0: cannot get random bytes for "
                               "the job secret");
    }
    char ref[40] = "";
    if (!have && L->secret_file && L->one_host) {
      /* The others refuse a secret in the value on one host: no fallback. */
      if (kv_secret_to_file(L, secret, ref, sizeof ref, why, sizeof why) < 0) {
        chorus__kvs_close(kvs, deadline);
        return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank 0 (%s): every rank is on this "
                                 "host, where a fresh job secret goes through a file of the "
                                 "runtime directory, never through %s, and that failed: %s.  "
                                 "Set CHORUS_JOB_SECRET_FILE on every rank", L->source,
                                 L->service, why);
      }
      snprintf(from, from_cap, "a fresh one this rank made, in %.200s (only its name went "
               "through %s)", L->secret_file, L->service);
    } else if (!have) {
      snprintf(from, from_cap, "a fresh one this rank made, sent to the others through %s",
               L->service);
      if (L->secret_file)
        CHORUS_WARN(CHORUS__SUB_INIT, "chorus rank 0/%d: no job secret given and the group "
                    "spans hosts, so a fresh one goes through %s, which has no authentication "
                    "(torch's TCPStore): anyone who can reach it can read the secret and join "
                    "this group, or put their own there.  Give every rank the same "
                    "CHORUS_JOB_SECRET_FILE (docs/security.md)", L->size, L->service);
    }
    chorus__key_t key;
    int port = cfg->store_port > 0 ? cfg->store_port : 0;
    st = chorus__job_key(secret, env->JOB_ID, &key) == 0
             ? chorus__store_server_start_key(one_host ? "127.0.0.1" : NULL, port, &key, server)
             : CHORUS_ERR_SYSTEM;
    chorus__wipe(&key, sizeof key);
    if (st != CHORUS_OK) {
      const int why_errno = errno; /* set by the store's start */
      chorus__kvs_close(kvs, deadline);
      return chorus__init_fail(st, "chorus rank 0 (%s): cannot serve the store on port %d: %s",
                               L->source, port,
                               why_errno ? strerror(why_errno) : chorus_result_name(st));
    }
    if (one_host || chorus__net_host_addrs(addrs, sizeof addrs) <= 0)
      snprintf(addrs, sizeof addrs, "127.0.0.1");
    /* "v1,<port>,<addresses joined by +>,<secret or ->" */
    for (char *c = addrs; *c; c++)
      if (*c == ',') *c = '+';
    snprintf(val, sizeof val, "v1,%d,%s,%s", chorus_store_server_port(*server), addrs,
             have ? "-" : ref[0] ? ref : secret);
    st = chorus__kvs_put(kvs, "chorus-store", val, deadline, err, sizeof err);
    chorus__wipe(val, sizeof val);
  }
  if (st == CHORUS_OK) st = chorus__kvs_fence(kvs, deadline, err, sizeof err);
  if (st == CHORUS_OK && L->rank != 0)
    st = chorus__kvs_get(kvs, 0, "chorus-store", val, sizeof val, deadline, err, sizeof err);
  chorus__kvs_close(kvs, deadline);
  if (st != CHORUS_OK)
    return chorus__init_fail(st, "chorus rank %d/%d (%s): the key-value exchange "
                             "failed: %s", L->rank, L->size, L->source, err);
  if (L->rank == 0) {
    /* Our own store through the first address we published (127.0.0.1 on
     * one host): the data port listens on the interface it goes through. */
    cfg->store_port = chorus_store_server_port(*server);
    addrs[strcspn(addrs, "+")] = '\0';
    snprintf(host, host_cap, "%.255s", addrs);
    cfg->store_host = host;
    if (secret[0]) cfg->job_secret = secret;
    return CHORUS_OK;
  }
  /* What this rank was given itself wins over anything the service says:
   * a caller's service (torch's TCPStore) can be written by anyone who
   * reaches it, and the value names a store to join as well as a secret. */
  int own = secret[0] ? 1 : chorus__secret_configured(secret, secret_cap, why, sizeof why);
  if (own < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d/%d (%s): %s", L->rank,
                             L->size, L->source, why);
  if (own > 0 && !from[0]) chorus__secret_source(from, from_cap);
  if (own > 0) cfg->job_secret = secret;
  /* Parse rank 0's value: it is untrusted like any received bytes. */
  char *save = NULL, *ver = strtok_r(val, ",", &save), *port_s = strtok_r(NULL, ",", &save);
  char *list = strtok_r(NULL, ",", &save), *sec = strtok_r(NULL, ",", &save);
  long port = 0;
  if (!ver || strcmp(ver, "v1") || !port_s || chorus__parse_long(port_s, &port) < 0 ||
      port < 1 || port > 65535 || !list || !sec || strtok_r(NULL, ",", &save))
    return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d (%s): rank 0's store "
                             "address in the key-value service is malformed", L->rank, L->size,
                             L->source);
  if (own > 0 && strcmp(sec, "-")) {
    /* Rank 0 made a fresh secret, so it has none configured -- or someone
     * else wrote the key.  Either way this rank keeps its own: with a store
     * that holds another key, the store refuses it, or fails to prove it
     * holds this one, and init fails naming the store. */
    CHORUS_WARN(CHORUS__SUB_INIT, "chorus rank %d/%d (%s): the \"chorus-store\" value in %s "
                "carries a job secret, which this rank ignores: it has its own (%s).  Either "
                "rank 0 was given no secret (give every rank the same one), or someone who can "
                "write to %s put the value there", L->rank, L->size, L->source, L->service,
                from, L->service);
  } else if (sec[0] == '@') {
    /* The secret is in a file of the runtime directory, named by rank 0.
     * The name is untrusted: 32 hex digits, nothing else. */
    char path[4200], fwhy[600];
    size_t n = strspn(sec + 1, "0123456789abcdef");
    if (n != 32 || sec[33] != '\0')
      return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d (%s): rank 0's secret "
                               "file name in the key-value service is malformed", L->rank,
                               L->size, L->source);
    char name[40];
    snprintf(name, sizeof name, "kv-%s.key", sec + 1);
    if (runtime_file(name, path, sizeof path, fwhy, sizeof fwhy) < 0 ||
        chorus__secret_read_file(path, secret, secret_cap, fwhy, sizeof fwhy) < 0)
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d/%d (%s): rank 0 put the "
                               "job secret in its runtime directory, and this rank cannot read "
                               "it: %s.  Ranks that say they share a host (LOCAL_WORLD_SIZE == "
                               "WORLD_SIZE) need the same user and runtime directory "
                               "(XDG_RUNTIME_DIR, TMPDIR); or set CHORUS_JOB_SECRET",
                               L->rank, L->size, L->source, fwhy);
    cfg->job_secret = secret;
    snprintf(from, from_cap, "rank 0's fresh one, from %.200s (only its name went through %s)",
             path, L->service);
  } else if (strcmp(sec, "-")) {
    /* A secret in the value itself.  On one host rank 0 passes it through
     * a file only this user can read, never so: a value that carries one
     * was written by someone else (torch's store has no authentication). */
    if (L->one_host && L->secret_file)
      return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d (%s): the \"chorus-store\" "
                               "value in %s carries a job secret, but every rank says it is on "
                               "this host (LOCAL_WORLD_SIZE == WORLD_SIZE), where rank 0 passes "
                               "it through a file of the runtime directory and never through "
                               "that service: someone else wrote it.  Refusing to join the store "
                               "it names.  Set CHORUS_JOB_SECRET_FILE on every rank to be "
                               "immune to writers of the caller's store (docs/security.md)",
                               L->rank, L->size, L->source, L->service);
    snprintf(secret, secret_cap, "%s", sec);
    cfg->job_secret = secret;
    snprintf(from, from_cap, "rank 0's fresh one, through %s", L->service);
    if (L->secret_file)
      CHORUS_WARN(CHORUS__SUB_INIT, "chorus rank %d/%d: the job secret came through %s, which "
                  "has no authentication (torch's TCPStore): anyone who can write to it could "
                  "have put their own there and be reading this group's data.  Give every rank "
                  "the same CHORUS_JOB_SECRET_FILE (docs/security.md)", L->rank, L->size,
                  L->service);
  }
  cfg->store_port = (int)port;
  /* The first of rank 0's addresses that answers (one address: no choice
   * to make).  The probe is a full store handshake, so the store sees a
   * client that came and went, not a stranger. */
  if (!strchr(list, '+')) {
    snprintf(host, host_cap, "%s", list);
    cfg->store_host = host;
    return CHORUS_OK;
  }
  chorus__key_t key;
  if (!secret[0] || chorus__job_key(secret, env->JOB_ID, &key) < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus rank %d/%d (%s): no job secret to "
                             "reach rank 0's store with", L->rank, L->size, L->source);
  int tried = 0;
  char denied[700] = "";
  for (char *s2 = NULL, *a = strtok_r(list, "+", &s2); a; a = strtok_r(NULL, "+", &s2)) {
    if (tried++ == 16) break;
    chorus_store_t *probe = NULL;
    int ms = CHORUS__MIN(2000, chorus__ms_left_bound(deadline));
    if (chorus__store_connect_key(a, (int)port, &key, ms, &probe) == CHORUS_OK) {
      chorus_store_close(probe);
      chorus__wipe(&key, sizeof key);
      snprintf(host, host_cap, "%s", a);
      cfg->store_host = host;
      return CHORUS_OK;
    }
    if (chorus__store_connect_denied() && !denied[0])
      snprintf(denied, sizeof denied, "%s", chorus__store_connect_error());
  }
  chorus__wipe(&key, sizeof key);
  if (denied[0])
    return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d (%s): the store at "
                             "rank 0's address refused this rank, or could not prove it is "
                             "this job's (%s).  Every rank needs the same job secret; if they "
                             "have it, someone other than rank 0 wrote the \"chorus-store\" "
                             "value in %s", L->rank, L->size, L->source, denied, L->service);
  return chorus__init_fail(CHORUS_ERR_TIMEOUT, "chorus rank %d/%d (%s): none of rank 0's "
                           "addresses answers on port %ld; set MASTER_ADDR and MASTER_PORT "
                           "to an address of rank 0's host that this host can reach",
                           L->rank, L->size, L->source, port);
}

chorus_result_t chorus_comm_init_env(chorus_comm_t *comm) {
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  const chorus__env_t *env = chorus__env();
  chorus__log_init();
  if (comm) *comm = NULL;
  launch_t L;
  char err[700], host[300], secret[CHORUS__SECRET_MAX] = "", from[300] = "";
  const char *service = NULL;
  if (launch_detect(&L, err, sizeof err) < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s", err);
  cfg.rank = L.rank;
  cfg.world_size = L.size;
  if (L.local_rank >= 0) {
    cfg.local_rank = L.local_rank;
    cfg.local_world_size = L.local_size;
  }
  int port_set = env_int("MASTER_PORT", &cfg.store_port);
  if (port_set < 0 || cfg.store_port > 65535)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_PORT='%s' "
                             "is not a port number", getenv("MASTER_PORT"));
  const char *addr = getenv("MASTER_ADDR");
  int one_host = launch_one_host(&L);
  int64_t deadline = chorus__deadline_ms(chorus__init_timeout_ms(NULL, chorus__env_timeout_ms()));
  chorus_store_server_t *server = NULL;
  chorus_result_t st;
  char why[300] = "";
  if (addr && *addr && port_set) {
    cfg.store_host = addr; /* a */
  } else if (!port_set && addr && *addr) {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_ADDR is set "
                             "but MASTER_PORT is not");
  } else if ((service = chorus__kvs_available(why, sizeof why)) && L.size > 1 &&
             !env->STORE_EXTERNAL) {
    chorus__kvs_t *kvs = NULL;
    char kerr[600], svc[120];
    snprintf(svc, sizeof svc, "the launcher's key-value service (%s)", service);
    exchange_t X = {L.rank, L.size, L.source, one_host == 1, svc, NULL, 0};
    st = chorus__kvs_open(&kvs, L.rank, deadline, kerr, sizeof kerr);
    if (st != CHORUS_OK)
      return chorus__init_fail(st, "chorus rank %d/%d (%s): %s", L.rank, L.size, L.source, kerr);
    st = kvs_exchange(&X, kvs, &cfg, host, sizeof host, secret, sizeof secret, &server, deadline,
                      from, sizeof from);
    if (st != CHORUS_OK) {
      chorus__wipe(secret, sizeof secret);
      return st;
    }
  } else if (!port_set && L.explicit_ranks && L.size > 1) {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_PORT is not "
                             "set; launch with chorusrun (or torchrun) or set RANK, WORLD_SIZE, "
                             "MASTER_ADDR and MASTER_PORT");
  } else if (one_host == 1) {
    cfg.store_host = "127.0.0.1"; /* c */
    if (!port_set) cfg.store_port = derived_port(&L);
  } else if (L.nodelist) {
    /* d: rank 0 is task 0, on the step's first node (srun places tasks in
     * node order). */
    if (chorus__hostlist_nth(L.nodelist, 0, host, sizeof host) < 0)
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: cannot read "
                               "SLURM_STEP_NODELIST='%.200s'", L.nodelist);
    cfg.store_host = host;
    if (!port_set) cfg.store_port = derived_port(&L);
  } else if (port_set && one_host < 0) {
    cfg.store_host = "127.0.0.1"; /* MASTER_PORT alone: torchrun's default address */
  } else {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: rank %d of %d "
                             "(%s) spans several hosts%s and has no store address: set "
                             "MASTER_ADDR and MASTER_PORT, or launch with srun --mpi=pmi2 or "
                             "--mpi=pmix, mpirun, mpiexec or chorusrun, whose key-value service "
                             "carries it%s%s", L.rank, L.size, L.source,
                             one_host < 0 ? " (or may)" : "", why[0] ? "; " : "", why);
  }
  CHORUS_INFO(CHORUS__SUB_INIT, "bootstrap: rank %d/%d from %s, local %d/%d, store %s:%d",
              L.rank, L.size, L.source, L.local_rank, L.local_size, cfg.store_host,
              cfg.store_port);
  if (server) cfg.host_store = 1;
  st = world_init(&cfg, server, from[0] ? from : NULL, comm);
  chorus__wipe(secret, sizeof secret);
  return st;
}

chorus_result_t chorus_comm_init_kv(const chorus_config_t *config, const chorus_kv_t *kv,
                                    chorus_comm_t *comm) {
  chorus__log_init();
  if (comm) *comm = NULL;
  if (!comm || !config || !kv || !kv->set || !kv->get)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_kv: comm, config, kv, "
                             "kv->set and kv->get are required");
  if (config->magic != CHORUS_CONFIG_MAGIC || config->size < sizeof(chorus_config_t))
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_kv: config not "
                             "initialised with CHORUS_CONFIG_INITIALIZER");
  if (config->world_size < 1 || config->rank < 0 || config->rank >= config->world_size)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_kv: rank %d is not in "
                             "[0, %d)", config->rank, config->world_size);
  chorus_config_t cfg = *config;
  int timeout_ms = cfg.timeout_ms > 0 ? cfg.timeout_ms : chorus__env_timeout_ms();
  int64_t deadline = chorus__deadline_ms(chorus__init_timeout_ms(&cfg, timeout_ms));
  char host[300] = "127.0.0.1", secret[CHORUS__SECRET_MAX] = "", from[300] = "";
  char secret_file[4200] = "";
  if (cfg.job_secret && *cfg.job_secret) snprintf(secret, sizeof secret, "%s", cfg.job_secret);
  chorus_store_server_t *server = NULL;
  chorus_result_t st = CHORUS_OK;
  if (cfg.world_size > 1) {
    chorus__kvs_t *kvs = NULL;
    exchange_t X = {cfg.rank,
                    cfg.world_size,
                    "the caller's key-value service",
                    cfg.local_world_size == cfg.world_size,
                    "the caller's key-value service",
                    secret_file,
                    sizeof secret_file};
    if ((st = chorus__kvs_wrap(&kvs, kv, cfg.rank)) != CHORUS_OK)
      return chorus__init_fail(st, "chorus_comm_init_kv: out of memory");
    if (cfg.rank != 0) cfg.store_port = 0;
    st = kvs_exchange(&X, kvs, &cfg, host, sizeof host, secret, sizeof secret, &server, deadline,
                      from, sizeof from);
    if (st != CHORUS_OK) {
      chorus__wipe(secret, sizeof secret);
      return st;
    }
  } else {
    cfg.store_host = host; /* a world of one serves itself */
    cfg.store_port = 0;
    cfg.host_store = 1;
  }
  if (server) cfg.host_store = 1;
  else if (cfg.world_size > 1) cfg.host_store = 0;
  cfg.timeout_ms = timeout_ms;
  CHORUS_INFO(CHORUS__SUB_INIT, "bootstrap: rank %d/%d through the caller's key-value service, "
              "store %s:%d", cfg.rank, cfg.world_size, cfg.store_host, cfg.store_port);
  st = world_init(&cfg, server, from[0] ? from : NULL, comm);
  /* Every rank has proven the key to the store once the world formed; on
   * failure nobody needs the file either. */
  if (secret_file[0]) unlink(secret_file);
  chorus__wipe(secret, sizeof secret);
  return st;
}
