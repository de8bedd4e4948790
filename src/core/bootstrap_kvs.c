/*
 * bootstrap_kvs.c - the key-value exchange that tells every rank where the
 * store is: through the launcher's service (srun, mpirun, hydra:
 * chorus_comm_init_env) or the caller's (chorus_comm_init_kv).  Rank 0
 * starts the store on a port the kernel picks and publishes the port, its
 * addresses and, when no job secret is configured, a fresh one (or, on one
 * host, the name of the file that holds it); the others read them after a
 * fence and take the first address that answers.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "core/comm.h"
#include "core/kvs.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

/* Rank 0, one host: the fresh secret into a new file; its name ("@" and 32
 * hex digits, what the others look for) into ref.  0, or -1 with why. */
static int kv_secret_to_file(const chorus__kv_exchange_t *L, const char *secret, char *ref,
                             size_t ref_cap, char *why, size_t why_cap) {
  char rnd[65];
  if (chorus__secret_generate(rnd, sizeof rnd) != 0) {
    snprintf(why, why_cap, "cannot get random bytes");
    return -1;
  }
  rnd[32] = '\0';
  char name[40];
  snprintf(name, sizeof name, "kv-%.32s.key", rnd);
  if (chorus__runtime_file(name, L->secret_file, L->secret_file_cap, why, why_cap) < 0) {
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

/* Rank 0, first step: the job secret -- the caller's, one configured, or a
 * fresh one (on one host with L->secret_file, written to a file whose name
 * goes in ref) -- and where it came from.  *have_out: 1 configured (only
 * "-" is published), 0 fresh.  kvs is closed on failure. */
static chorus_result_t kv_rank0_secret(const chorus__kv_exchange_t *L, chorus__kvs_t *kvs,
                                       char *secret, size_t secret_cap, int64_t deadline,
                                       char *from, size_t from_cap, int *have_out, char *ref,
                                       size_t ref_cap) {
  char why[600];
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
  if (!have && L->secret_file && L->one_host) {
    /* The others refuse a secret in the value on one host: no fallback. */
    if (kv_secret_to_file(L, secret, ref, ref_cap, why, sizeof why) < 0) {
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
  *have_out = have;
  return CHORUS_OK;
}

/* Rank 0, second step: starts the store with the secret's key (on
 * 127.0.0.1 on one host, else on every interface) and lists the
 * addresses to publish in addrs.  kvs is closed on failure. */
static chorus_result_t kv_rank0_serve(const chorus__kv_exchange_t *L, chorus__kvs_t *kvs,
                                      chorus_config_t *cfg, const char *secret,
                                      chorus_store_server_t **server, int64_t deadline,
                                      char *addrs, size_t addrs_cap) {
  const chorus__env_t *env = chorus__env();
  chorus__key_t key;
  int port = cfg->store_port > 0 ? cfg->store_port : 0;
  chorus_result_t st =
      chorus__job_key(secret, env->JOB_ID, &key) == 0
          ? chorus__store_server_start_key(L->one_host ? "127.0.0.1" : NULL, port, &key, server)
          : CHORUS_ERR_SYSTEM;
  chorus__wipe(&key, sizeof key);
  if (st != CHORUS_OK) {
    const int why_errno = errno; /* set by the store's start */
    chorus__kvs_close(kvs, deadline);
    return chorus__init_fail(st, "chorus rank 0 (%s): cannot serve the store on port %d: %s",
                             L->source, port,
                             why_errno ? strerror(why_errno) : chorus_result_name(st));
  }
  if (L->one_host || chorus__net_host_addrs(addrs, addrs_cap) <= 0)
    snprintf(addrs, addrs_cap, "127.0.0.1");
  return CHORUS_OK;
}

/* The other ranks: the job secret from rank 0's value (sec: "-", "@" and a
 * file name, or the secret), unless this rank has its own (own > 0). */
static chorus_result_t kv_take_secret(const chorus__kv_exchange_t *L, chorus_config_t *cfg,
                                      const char *sec, int own, char *secret, size_t secret_cap,
                                      char *from, size_t from_cap) {
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
    if (chorus__runtime_file(name, path, sizeof path, fwhy, sizeof fwhy) < 0 ||
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
  return CHORUS_OK;
}

/* The other ranks: the store's host, from rank 0's addresses (list, joined
 * by "+"; port): the only one, or the first that answers. */
static chorus_result_t kv_reach_store(const chorus__kv_exchange_t *L, chorus_config_t *cfg,
                                      char *list, long port, const char *secret, char *host,
                                      size_t host_cap, int64_t deadline) {
  const chorus__env_t *env = chorus__env();
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

chorus_result_t chorus__bootstrap_kv_exchange(const chorus__kv_exchange_t *L, chorus__kvs_t *kvs,
                                              chorus_config_t *cfg, char *host, size_t host_cap,
                                              char *secret, size_t secret_cap,
                                              chorus_store_server_t **server, int64_t deadline,
                                              char *from, size_t from_cap) {
  char err[600], val[CHORUS__KVS_VALUE_MAX + 1], why[600];
  chorus_result_t st = CHORUS_OK;
  char addrs[400]; /* rank 0's, published */
  from[0] = '\0';
  if (secret[0]) snprintf(from, from_cap, "the caller (job_secret)");
  if (L->rank == 0) {
    /* Bind first, publish second: the port is ours before anyone reads it. */
    int have = 0;
    char ref[40] = "";
    st = kv_rank0_secret(L, kvs, secret, secret_cap, deadline, from, from_cap, &have, ref,
                         sizeof ref);
    if (st != CHORUS_OK) return st;
    st = kv_rank0_serve(L, kvs, cfg, secret, server, deadline, addrs, sizeof addrs);
    if (st != CHORUS_OK) return st;
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
  st = kv_take_secret(L, cfg, sec, own, secret, secret_cap, from, from_cap);
  if (st != CHORUS_OK) return st;
  cfg->store_port = (int)port;
  return kv_reach_store(L, cfg, list, port, secret, host, host_cap, deadline);
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
    chorus__kv_exchange_t X = {cfg.rank,
                    cfg.world_size,
                    "the caller's key-value service",
                    cfg.local_world_size == cfg.world_size,
                    "the caller's key-value service",
                    secret_file,
                    sizeof secret_file};
    if ((st = chorus__kvs_wrap(&kvs, kv, cfg.rank)) != CHORUS_OK)
      return chorus__init_fail(st, "chorus_comm_init_kv: out of memory");
    if (cfg.rank != 0) cfg.store_port = 0;
    st = chorus__bootstrap_kv_exchange(&X, kvs, &cfg, host, sizeof host, secret, sizeof secret,
                                       &server, deadline, from, sizeof from);
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
  st = chorus__world_init(&cfg, server, from[0] ? from : NULL, NULL, comm);
  /* Every rank has proven the key to the store once the world formed; on
   * failure nobody needs the file either. */
  if (secret_file[0]) unlink(secret_file);
  chorus__wipe(secret, sizeof secret);
  return st;
}
