/*
 * bootstrap.c - making the world communicator from a chorus_config_t
 * (chorus_comm_init): the job secret and the world's creation.  The
 * environment a launcher left (chorus_comm_init_env) is read in
 * bootstrap_env.c; a launcher's or the caller's key-value service is used in
 * bootstrap_kvs.c (chorus_comm_init_kv).
 *
 * World creation, step by step:
 *   1. rank 0 starts the store server unless it already runs (chorusrun);
 *   2. every rank connects to the store and agrees on a random world id
 *      (rank 0 publishes it) so connections of another job or of an earlier
 *      generation of this one are refused;
 *   3. every rank listens on a fresh port on the interface it uses to reach
 *      the store, publishes "address port" and counts itself in; the host
 *      map comes from the launcher's placement (hostmap.c), else from every
 *      rank's record;
 *   4. the transport starts its progress thread; it connects a pair when
 *      the pair first exchanges a message, reading the peer's record then.
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
#include "core/bootstrap.h"
#include "core/comm.h"
#include "store/rendezvous.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/host.h"
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
int chorus__runtime_file(const char *name, char *buf, size_t cap, char *why, size_t why_cap) {
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
    if (chorus__runtime_file(name, ws->file, sizeof ws->file, why, sizeof why) < 0)
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
 *   4. build_publish    this rank's record: where it listens, its UCX
 *                       address, its host;
 *   5. build_join       the record published and this rank counted in
 *                       (three store operations, whatever the size);
 *   6. build_records    the host map from the launcher; or, when some rank
 *                       needs them (UCX, no map), every record all-gathered
 *                       and checked, the host map from them, UCX or not;
 *   7. build_transport  the transport, which reads a peer's record when it
 *                       first dials it (world_lookup);
 *   8. build_comm       the world communicator, its shared memory and
 *                       algorithms, its own timeout. */
typedef struct {
  const chorus_config_t *cfg;
  const char *node_sizes; /* the launcher's placement, when its key-value service said it */
  int rank, size, timeout_ms, init_ms, host; /* host: this rank serves the store */
  int64_t deadline;
  char prefix[256];
  world_secret_t *ws;
  chorus__ctx_t *ctx;
  uint64_t world_id;
  int lfd;                  /* the data listener, until the transport takes it */
  int bell_fd;              /* the shared-memory doorbell, likewise */
  char addrs_mine[128];     /* "ADDR PORT" */
  char ident[400];          /* this host's identity */
  char *record;             /* this rank's: "ADDR PORT|UCX|IDENT" */
  int full;                 /* every rank reads every record (build_join) */
  char **addrs;             /* full: every rank's record (then cut to its address) */
  chorus__ucx_worker_t *ucx; /* until the transport takes it */
  char ucx_kind;            /* 'U' forced, 'A' automatic, '-' none */
  char rdma[256];           /* the RDMA device seen here */
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
  if (ctx->server) { /* every rank will hold a connection to it */
    char why[700];
    if (chorus__store_server_expect(ctx->server, size, why, sizeof why) != CHORUS_OK)
      return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d/%d: %s", rank, size, why);
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

/* 4.  The record holds what the transport needs of a rank: the address it
 * listens on, its host identity (which ranks share memory, the host map of
 * the hierarchical algorithms, when the launcher does not say it), and its
 * UCX worker's address when it would use UCX between hosts: "U<hex>" with
 * CHORUS_TRANSPORT=ucx, "A<hex>" when automatic and this host has an
 * active RDMA device, "-" otherwise (chorus__ucx_decide makes every
 * rank's choice from all of them): "ADDR PORT|UCX|IDENT". */
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
  /* The doorbell local peers hand their inboxes to, bound before the
   * record goes out: one missing later is a rank that ended. */
  if (strcasecmp(tmode, "tcp") != 0) {
    b->bell_fd = chorus__shm_bell_bind(&b->ws->key, b->world_id, rank);
    if (b->bell_fd < 0) {
      int e = -b->bell_fd;
      b->bell_fd = -1;
      free(ucx_hex);
      return chorus__init_fail(CHORUS_ERR_SYSTEM, "chorus rank %d: cannot make the "
                               "shared-memory doorbell: %s", rank, strerror(e));
    }
  }
  snprintf(b->addrs_mine, sizeof b->addrs_mine, "%s %d", ifaddr, data_port);
  size_t mine_cap = 700 + (ucx_hex ? strlen(ucx_hex) : 0);
  b->record = malloc(mine_cap);
  if (b->record)
    snprintf(b->record, mine_cap, "%s|%s%s|%s", b->addrs_mine,
             ucx_hex ? (b->ucx_kind == 'U' ? "U" : "A") : "-", ucx_hex ? ucx_hex : "", b->ident);
  free(ucx_hex);
  if (!b->record) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  return CHORUS_OK;
}

/* 5.  The record out and this rank counted in.  A rank votes for every
 * record when it would use UCX (which needs every rank's worker address)
 * or finds no host map in what the launcher says (hostmap.c); one vote
 * and every rank all-gathers them. */
static chorus_result_t build_join(world_build_t *b) {
  chorus__ctx_t *ctx = b->ctx;
  const int rank = b->rank, size = b->size;
  ctx->host = calloc((size_t)size, sizeof *ctx->host);
  if (!ctx->host) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  int mapped = chorus__hostmap_from_launcher(rank, size, b->node_sizes, ctx->host,
                                             &ctx->local_count);
  int votes = 0;
  char err[1024] = "";
  chorus_result_t st = chorus__rdzv_join(ctx->store, b->prefix, b->world_id, rank, size, b->record,
                                         b->ucx_kind != '-' || !mapped, b->deadline, &votes, err,
                                         sizeof err);
  if (st == CHORUS_OK && votes > 0) {
    b->full = 1;
    ctx->local_count = 0;
    st = chorus__rdzv_allgather(ctx->store, b->prefix, "addr", rank, size, b->record, 1,
                                b->deadline, &b->addrs, err, sizeof err);
  }
  if (st != CHORUS_OK)
    return chorus__init_fail(st, "chorus rank %d/%d: rendezvous failed: %s", rank, size, err);
  CHORUS_INFO(CHORUS__SUB_INIT, "chorus rank %d/%d: joined; %s", rank, size,
              b->full ? "every rank reads every record (UCX, or a rank without the launcher's "
                        "host map)" : "host map from the launcher, records read when dialled");
  return CHORUS_OK;
}

/* 6.  Without every record: the launcher's host map (build_join).  With
 * them: every record came through the store, checked before it is used.
 * Each is cut in place into its address (what the transport parses) and
 * the rest.  UCX between hosts when every rank has an address; an error on
 * every rank when one forced it and another cannot. */
static chorus_result_t build_records(world_build_t *b) {
  const chorus__env_t *env = chorus__env();
  chorus__ctx_t *ctx = b->ctx;
  const int rank = b->rank, size = b->size;
  ctx->world_id = b->world_id;
  ctx->memreg = chorus__memreg_new(env->JOB_ID, b->world_id, rank);
  if (!ctx->memreg) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  if (!b->full) return CHORUS_OK;
  b->ucx_addrs = calloc((size_t)size, sizeof *b->ucx_addrs); /* the UCX fields */
  if (!b->ucx_addrs) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  static const uint8_t hkey[16] = "chorus-hostident";
  for (int r = 0; r < size; r++) {
    char *bar = strchr(b->addrs[r], '|');
    char *bar2 = bar ? strchr(bar + 1, '|') : NULL;
    if (!bar2)
      return chorus__init_fail(CHORUS_ERR_PROTOCOL, "chorus rank %d/%d: rank %d published a "
                               "malformed address record (another chorus version?)", rank, size,
                               r);
    *bar = '\0';
    *bar2 = '\0';
    b->ucx_addrs[r] = bar + 1;
    const char *their = bar2 + 1;
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

/* A peer's listener, from the record it published in the join, when this
 * rank first dials it (the transport's lookup, under its lock): "host:port".
 * Through the world's store client -- unless another thread is in a call
 * on it, which may wait for something this dial must carry first (a key a
 * peer sets once it heard from this rank): then through a client of its
 * own, made on that first need. */
static int world_lookup(void *arg, int rank, char *addr, size_t cap, char *why, size_t whycap) {
  chorus__ctx_t *ctx = arg;
  char *rec = NULL, host[64];
  int port, busy = 0;
  const int ms = 30000;
  chorus_result_t st = chorus__rdzv_record(ctx->store, ctx->rec_prefix, rank, ms, &busy, &rec,
                                           why, whycap);
  if (st == CHORUS_OK && busy) {
    if (!ctx->lookup_store &&
        chorus__store_connect_key(ctx->store_host, ctx->store_port, &ctx->key, ms,
                                  &ctx->lookup_store) != CHORUS_OK) {
      snprintf(why, whycap, "cannot reach the store to read its record: %s",
               chorus__store_connect_error());
      return -1;
    }
    st = chorus__rdzv_record(ctx->lookup_store, ctx->rec_prefix, rank, ms, NULL, &rec, why,
                             whycap);
  }
  if (st != CHORUS_OK) return -1;
  rec[strcspn(rec, "|")] = '\0';
  int rc = chorus__net_split_addr(rec, ' ', host, sizeof host, &port);
  if (rc < 0) snprintf(why, whycap, "it published an unparsable address '%.100s'", rec);
  else snprintf(addr, cap, "%s:%d", host, port);
  free(rec);
  return rc < 0 ? -1 : 0;
}

/* 7.  The transport takes the listener and the UCX worker, whatever comes
 * of it. */
static chorus_result_t build_transport(world_build_t *b) {
  const chorus__env_t *env = chorus__env();
  chorus__ctx_t *ctx = b->ctx;
  char err[512] = "";
  if (!b->full && !(ctx->rec_prefix = strdup(b->prefix)))
    return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  chorus__tp_config_t tcfg = {.rank = b->rank, .size = b->size, .key = &b->ws->key,
                              .world_id = b->world_id, .listen_fd = b->lfd,
                              .addrs = (const char *const *)b->addrs,
                              .lookup = b->full ? NULL : world_lookup, .lookup_arg = ctx,
                              .deadline = b->deadline,
                              .retry_ms = (int)env->CONNECT_RETRY_MS,
                              .fp_format = chorus__fp_format, .host = ctx->host,
                              .bell_fd = b->bell_fd, .ucx = b->ucx,
                              .ucx_addrs = b->use_ucx ? b->ucx_addrs : NULL};
  chorus_result_t st = chorus__tp_create(&tcfg, &ctx->tp, err, sizeof err);
  b->lfd = -1;
  b->bell_fd = -1;
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
  free(b->record);
  free(b->ucx_addrs);
  chorus__ucx_worker_free(b->ucx);
  if (b->lfd >= 0) close(b->lfd);
  if (b->bell_fd >= 0) close(b->bell_fd);
  chorus__rdzv_free(b->addrs, b->size);
  chorus__ctx_t *ctx = b->ctx;
  if (ctx) {
    if (ctx->tp) chorus__tp_destroy(ctx->tp, chorus__deadline_ms(0));
    chorus__memreg_free(ctx->memreg);
    free(ctx->host);
    free(ctx->rec_prefix);
    chorus_store_close(ctx->lookup_store);
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
  free(b->record);
  free(b->ucx_addrs);
  b->record = NULL, b->ucx_addrs = NULL;
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
                                  const char *secret_from, const char *node_sizes,
                                  chorus_comm_t *out) {
  chorus__log_init();
  if (!out) return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init: comm is NULL");
  *out = NULL;
  chorus_result_t st = check_config(cfg);
  if (st != CHORUS_OK) return st;
  world_build_t *b = calloc(1, sizeof *b);
  if (!b) return chorus__init_fail(CHORUS_ERR_NO_MEMORY, "chorus_comm_init: out of memory");
  b->cfg = cfg;
  b->node_sizes = node_sizes;
  b->lfd = -1;
  b->bell_fd = -1;
  st = build_begin(b, job_key, join_base);
  if (st == CHORUS_OK) st = build_store(b, server);
  if (st == CHORUS_OK && (secret_from || b->ws->from[0]))
    /* Which secret this world runs on, never the secret: what a user (and
     * tests/launcher, tests/python/torch) checks to see the job is not open. */
    CHORUS_INFO(CHORUS__SUB_INIT, "chorus rank %d/%d: job secret from %s", b->rank, b->size,
                secret_from ? secret_from : b->ws->from);
  if (st == CHORUS_OK) st = build_world_id(b);
  if (st == CHORUS_OK) st = build_publish(b);
  if (st == CHORUS_OK) st = build_join(b);
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
  return world_make(cfg, key, join_base, &server, NULL, NULL, out);
}

chorus_result_t chorus__world_init(const chorus_config_t *cfg, chorus_store_server_t *server,
                                   const char *secret_from, const char *node_sizes,
                                   chorus_comm_t *out) {
  chorus_result_t st = world_make(cfg, NULL, NULL, &server, secret_from, node_sizes, out);
  chorus_store_server_stop(server); /* NULL once the world took it */
  return st;
}

chorus_result_t chorus_comm_init(const chorus_config_t *config, chorus_comm_t *comm) {
  return chorus__world_init(config, NULL, NULL, NULL, comm);
}
