/*
 * grow.c - elastic growth, the other half of shrink.c: processes that were
 * not part of a running job ask to join it (chorus_comm_join), and the
 * members of a communicator admit them (chorus_comm_joiners,
 * chorus_comm_grow) into a new, larger world.
 *
 * The meeting point is the job's store, under the join base of the job's
 * first world (its store prefix, "chorus/r<CHORUS_RESTART_COUNT>/" by
 * default, then "join/"; inherited by every world grown from it), which a
 * joiner finds from the same configuration or environment:
 *   joiner   i = add(next, 1) - 1, then waits for grant/i.  At its deadline
 *            it withdraws with a compare-and-set of slot/i from absent to
 *            "withdrawn"; if that fails, rank 0 claimed it just before, and
 *            the joiner waits 5 s more for its grant, then withdraws from
 *            that claim (compare-and-set from it) too.
 *   members  (collective) rank 0 reads next and admitted, claims every
 *            slot/i in [admitted, next) with a compare-and-set from absent
 *            to "claimed <nonce>" (withdrawn slots, and slots an earlier
 *            attempt claimed and never granted, are skipped), takes a generation
 *            g = add(gen, 1), writes grant/i = "g rank size" for each
 *            claimed joiner in the order they asked, sets admitted = next
 *            and broadcasts (g, size) over the old communicator.
 *   then     members and admitted joiners make a world under
 *            "<join base>w<g>/": members keep their ranks 0..n-1, joiners
 *            follow.  It has its own world id and connections; the old
 *            communicator is untouched.
 * Every wait is bounded.  A joiner that dies after it was admitted makes the
 * new world fail on every member within the grow timeout (the old
 * communicator still works: the caller may try again).  Grants come from
 * the store: they are parsed as untrusted input.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/comm.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/util.h"

#define POLL_MS 10

/* A counter of the store (0 when absent), without creating it. */
static chorus_result_t read_counter(chorus_store_t *s, const char *key, int64_t *v) {
  return chorus_store_add(s, key, 0, v);
}

chorus_result_t chorus_comm_joiners(chorus_comm_t comm, int *count) {
  if (!comm || !count) return CHORUS_ERR_INVALID_ARG;
  chorus__ctx_t *ctx = comm->ctx;
  int64_t n[2] = {0, 0};
  chorus_result_t st = CHORUS_OK;
  if (comm->rank == 0) {
    char key[256];
    snprintf(key, sizeof key, "%snext", ctx->join_base);
    st = read_counter(ctx->store, key, &n[0]);
    snprintf(key, sizeof key, "%sadmitted", ctx->join_base);
    if (st == CHORUS_OK) st = read_counter(ctx->store, key, &n[1]);
    if (st != CHORUS_OK) {
      chorus__comm_set_error(comm, "chorus_comm_joiners: rank 0/%d cannot read the store: %s",
                             comm->size, chorus_store_last_error(ctx->store));
      n[0] = n[1] = -1; /* the others fail alike */
    }
  }
  chorus_result_t bs = chorus_broadcast(comm, n, 2, CHORUS_INT64, 0, NULL);
  if (bs != CHORUS_OK) return bs;
  if (n[0] < 0) {
    if (comm->rank) chorus__comm_set_error(comm, "chorus_comm_joiners: rank 0 cannot read the store");
    return CHORUS_ERR_STORE;
  }
  /* Counters from the store: only 0 <= admitted <= next makes sense. */
  int64_t waiting = n[1] >= 0 && n[1] <= n[0] ? n[0] - n[1] : 0;
  *count = waiting > INT32_MAX ? INT32_MAX : (int)waiting;
  return st;
}

/* Bounds the next store call by the deadline. */
static void store_deadline(chorus_store_t *s, int64_t deadline) {
  chorus__store_set_timeout(s, chorus__ms_left_bound(deadline));
}

/* Rank 0 of the members: claims the waiting joiners and grants them ranks,
 * every store call within the deadline.  out[0] = generation (0: nobody
 * to admit), out[1] = new size. */
static chorus_result_t admit(chorus_comm_t comm, int64_t deadline, int64_t out[2]) {
  chorus__ctx_t *ctx = comm->ctx;
  chorus_store_t *s = ctx->store;
  char key[256], val[96], mark[40];
  int64_t next = 0, done = 0;
  out[0] = 0;
  out[1] = comm->size;
  snprintf(key, sizeof key, "%snext", ctx->join_base);
  store_deadline(s, deadline);
  chorus_result_t st = read_counter(s, key, &next);
  snprintf(key, sizeof key, "%sadmitted", ctx->join_base);
  store_deadline(s, deadline);
  if (st == CHORUS_OK) st = read_counter(s, key, &done);
  if (st != CHORUS_OK) return st;
  if (done < 0 || next < done) return CHORUS_ERR_PROTOCOL; /* not what we wrote */
  if (next == done) return CHORUS_OK;
  if (next - done > 4096) next = done + 4096; /* the rest at the next grow */
  size_t cap = (size_t)(next - done);
  int64_t *claimed = malloc(sizeof *claimed * cap);
  if (!claimed) return CHORUS_ERR_NO_MEMORY;
  /* This attempt's own mark: a slot another attempt claimed and never
   * granted (it failed half-way) is not ours to grant. */
  uint64_t nonce;
  chorus__random_bytes(&nonce, sizeof nonce);
  int mlen = snprintf(mark, sizeof mark, "claimed %016" PRIx64, nonce);
  size_t k = 0;
  for (int64_t i = done; i < next && st == CHORUS_OK; i++) {
    void *cur = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "%sslot/%" PRId64, ctx->join_base, i);
    store_deadline(s, deadline);
    st = chorus_store_compare_set(s, key, NULL, 0, mark, (size_t)mlen, &cur, &len);
    if (st == CHORUS_OK && len == (size_t)mlen && !memcmp(cur, mark, len)) claimed[k++] = i;
    free(cur);
  }
  int64_t gen = 0;
  snprintf(key, sizeof key, "%sgen", ctx->join_base);
  store_deadline(s, deadline);
  if (st == CHORUS_OK && k) st = chorus_store_add(s, key, 1, &gen);
  if (st == CHORUS_OK && k && gen < 1) st = CHORUS_ERR_PROTOCOL;
  int64_t size = comm->size + (int64_t)k;
  if (size > INT32_MAX / 2) st = CHORUS_ERR_INVALID_ARG;
  for (size_t j = 0; j < k && st == CHORUS_OK; j++) {
    snprintf(key, sizeof key, "%sgrant/%" PRId64, ctx->join_base, claimed[j]);
    int len = snprintf(val, sizeof val, "%" PRId64 " %" PRId64 " %" PRId64, gen,
                       comm->size + (int64_t)j, size);
    store_deadline(s, deadline);
    st = chorus_store_set(s, key, val, (size_t)len);
  }
  snprintf(key, sizeof key, "%sadmitted", ctx->join_base);
  store_deadline(s, deadline);
  if (st == CHORUS_OK) st = chorus_store_add(s, key, next - done, &done);
  free(claimed);
  if (st == CHORUS_OK && k) {
    out[0] = gen;
    out[1] = size;
  }
  return st;
}

/* The new world under the join base: same store, same job key. */
static chorus_result_t make_world(chorus__ctx_t *ctx, const chorus__key_t *key, int64_t gen,
                                  int rank, int size, int timeout_ms, chorus_comm_t *out) {
  char prefix[256];
  snprintf(prefix, sizeof prefix, "%sw%" PRId64 "/", ctx->join_base, gen);
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = rank;
  cfg.world_size = size;
  cfg.store_host = ctx->store_host;
  cfg.store_port = ctx->store_port;
  cfg.host_store = 0;
  cfg.timeout_ms = timeout_ms;
  cfg.store_prefix = prefix;
  return chorus__world_make(&cfg, key, ctx->join_base, out);
}

chorus_result_t chorus_comm_grow(chorus_comm_t comm, int timeout_ms, chorus_comm_t *out) {
  if (!comm || !out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  chorus__ctx_t *ctx = comm->ctx;
  if (timeout_ms <= 0) timeout_ms = comm->timeout_ms;
  int64_t plan[2] = {-1, -1};
  if (comm->rank == 0) {
    /* Half the time for admitting: the others wait for it in the broadcast
     * below, and the world still has to form. */
    chorus_result_t st = admit(comm, chorus__deadline_ms(CHORUS__MAX(1, timeout_ms / 2)), plan);
    chorus__store_set_timeout(ctx->store, comm->timeout_ms);
    if (st != CHORUS_OK) {
      chorus__comm_set_error(comm, "chorus_comm_grow: rank 0/%d cannot admit the joiners: %s: %s",
                             comm->size, chorus_result_name(st),
                             chorus_store_last_error(ctx->store));
      plan[0] = -1;
    }
  }
  chorus_result_t st = chorus_broadcast(comm, plan, 2, CHORUS_INT64, 0, NULL);
  if (st != CHORUS_OK) return st;
  if (plan[0] < 0) {
    if (comm->rank) chorus__comm_set_error(comm, "chorus_comm_grow: rank 0 could not admit the "
                                           "joiners (see its error)");
    return CHORUS_ERR_STORE;
  }
  if (plan[0] == 0) return CHORUS_OK; /* nobody was waiting */
  if (plan[1] <= comm->size || plan[1] > INT32_MAX / 2) {
    chorus__comm_set_error(comm, "chorus_comm_grow: rank %d/%d: a world of %" PRId64 " is not "
                           "larger", comm->rank, comm->size, plan[1]);
    return CHORUS_ERR_PROTOCOL;
  }
  chorus_comm_t grown = NULL;
  st = make_world(ctx, &ctx->key, plan[0], comm->rank, (int)plan[1], timeout_ms, &grown);
  if (st != CHORUS_OK) {
    chorus__comm_set_error(comm, "chorus_comm_grow: rank %d/%d: the world of %" PRId64 " ranks "
                           "did not form: %s", comm->rank, comm->size, plan[1],
                           chorus_last_init_error());
    return st;
  }
  grown->timeout_ms = comm->timeout_ms;
  /* When this rank serves the job's store, the grown world takes it over:
   * the old one is about to be destroyed, and the store must go on. */
  pthread_mutex_lock(&ctx->lock);
  grown->ctx->server = ctx->server;
  ctx->server = NULL;
  pthread_mutex_unlock(&ctx->lock);
  CHORUS_INFO(CHORUS__SUB_INIT, "grow: rank %d/%d is rank %d/%d of the grown world (generation %" PRId64 ")",
              comm->rank, comm->size, grown->rank, grown->size, plan[0]);
  *out = grown;
  return CHORUS_OK;
}

/* Parses "gen rank size" (untrusted): three decimal numbers, one space
 * apart, nothing else. */
static int parse_grant(const char *v, size_t len, int64_t *gen, int *rank, int *size) {
  char buf[96];
  if (len == 0 || len >= sizeof buf) return -1;
  memcpy(buf, v, len);
  buf[len] = '\0';
  long long f[3];
  const char *p = buf;
  for (int i = 0; i < 3; i++) {
    if (*p < '0' || *p > '9') return -1;
    char *end;
    errno = 0;
    f[i] = strtoll(p, &end, 10);
    if (errno || end - p > 18) return -1;
    p = end;
    if (i < 2 && *p++ != ' ') return -1;
  }
  if (*p) return -1;
  long long g = f[0], r = f[1], n = f[2];
  if (g < 1 || n < 2 || n > INT32_MAX / 2 || r < 1 || r >= n) return -1;
  *gen = g;
  *rank = (int)r;
  *size = (int)n;
  return 0;
}

chorus_result_t chorus_comm_join(const chorus_config_t *config, chorus_comm_t *out) {
  if (!out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  const chorus__env_t *env = chorus__env();
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  if (config) {
    if (config->magic != CHORUS_CONFIG_MAGIC || config->size < sizeof(size_t))
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_join: config not "
                               "initialised with CHORUS_CONFIG_INITIALIZER");
    cfg.store_host = config->store_host;
    cfg.store_port = config->store_port;
    cfg.job_secret = config->job_secret;
    cfg.store_prefix = config->store_prefix;
    cfg.timeout_ms = config->timeout_ms;
  } else {
    /* As chorus_comm_init_env reads them (the range is checked below). */
    long port = -1;
    const char *port_s = getenv("MASTER_PORT");
    if (!port_s || chorus__parse_long(port_s, &port) < 0) port = -1;
    cfg.store_host = getenv("MASTER_ADDR");
    cfg.store_port = port > 0 && port < 65536 ? (int)port : -1;
  }
  if (!cfg.store_host || !*cfg.store_host || cfg.store_port < 1 || cfg.store_port > 65535)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_join: the running job's store "
                             "is not known: %s", config ? "config's store_host and store_port "
                             "must name it" : "set MASTER_ADDR and MASTER_PORT (chorusrun does)");
  int timeout_ms = cfg.timeout_ms > 0 ? cfg.timeout_ms : chorus__env_timeout_ms();
  int64_t deadline = chorus__deadline_ms(timeout_ms);
  /* What make_world needs of a context: the store, the job key (found as
   * chorus_comm_init finds it) and the job's join base. */
  chorus__ctx_t probe = {0};
  snprintf(probe.store_host, sizeof probe.store_host, "%s", cfg.store_host);
  probe.store_port = cfg.store_port;
  if (cfg.store_prefix)
    snprintf(probe.join_base, sizeof probe.join_base, "%.190sjoin/", cfg.store_prefix);
  else
    snprintf(probe.join_base, sizeof probe.join_base, "chorus/r%ld/join/", env->RESTART_COUNT);
  chorus_store_t *s = NULL;
  chorus_result_t st = chorus__world_key(&cfg, timeout_ms, &probe.key);
  if (st != CHORUS_OK) return st; /* chorus_last_init_error says why */
  st = chorus__store_connect_key(probe.store_host, probe.store_port, &probe.key,
                                 chorus__ms_left_bound(deadline), &s);
  if (st != CHORUS_OK) {
    chorus__wipe(&probe.key, sizeof probe.key);
    return chorus__init_fail(st, "chorus_comm_join: cannot use the job's store at %s:%d: %s",
                             probe.store_host, probe.store_port, chorus__store_connect_error());
  }
  char key[256];
  int64_t idx = 0;
  snprintf(key, sizeof key, "%snext", probe.join_base);
  st = chorus_store_add(s, key, 1, &idx);
  if (st == CHORUS_OK && --idx < 0) st = CHORUS_ERR_PROTOCOL;
  int64_t gen = 0;
  int rank = -1, size = 0, extended = 0;
  char claim[64];
  size_t claim_len = 0;
  while (st == CHORUS_OK) {
    snprintf(key, sizeof key, "%sgrant/%" PRId64, probe.join_base, idx);
    const char *keys[1] = {key};
    int left = chorus__ms_left(deadline);
    st = left > 0 ? chorus_store_wait(s, keys, 1, CHORUS__MIN(left, 1000)) : CHORUS_ERR_TIMEOUT;
    if (st == CHORUS_OK) {
      void *v = NULL;
      size_t len = 0;
      st = chorus_store_get(s, key, &v, &len);
      if (st == CHORUS_OK && parse_grant(v, len, &gen, &rank, &size) != 0)
        st = CHORUS_ERR_PROTOCOL;
      free(v);
      break;
    }
    if (st != CHORUS_ERR_TIMEOUT) break;
    if (chorus__ms_left(deadline) > 0) {
      st = CHORUS_OK;
      continue;
    }
    /* Out of time: withdraw, unless rank 0 claimed us first (then its
     * grant follows at once; a claim without a grant for 5 more seconds
     * is an admission that failed half-way: withdraw from it too). */
    void *cur = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "%sslot/%" PRId64, probe.join_base, idx);
    st = chorus_store_compare_set(s, key, extended ? claim : NULL, extended ? claim_len : 0,
                                  "withdrawn", 9, &cur, &len);
    int claimed = st == CHORUS_OK && !extended && len > 8 && len < sizeof claim &&
                  !memcmp(cur, "claimed ", 8);
    if (claimed) {
      memcpy(claim, cur, len);
      claim_len = len;
    }
    free(cur);
    if (!claimed) {
      if (st == CHORUS_OK) st = CHORUS_ERR_TIMEOUT;
      break;
    }
    extended = 1;
    deadline = chorus__deadline_ms(CHORUS__MIN(timeout_ms, 5000));
  }
  char store_err[300];
  snprintf(store_err, sizeof store_err, "%s", chorus_store_last_error(s));
  chorus_store_close(s);
  if (st == CHORUS_OK) st = make_world(&probe, &probe.key, gen, rank, size, timeout_ms, out);
  else if (st == CHORUS_ERR_TIMEOUT)
    chorus__init_fail(st, "chorus_comm_join: no member of the job at %s:%d admitted this process "
                      "within %d ms (the job's ranks must call chorus_comm_joiners and "
                      "chorus_comm_grow)", probe.store_host, probe.store_port, timeout_ms);
  else if (st == CHORUS_ERR_PROTOCOL)
    chorus__init_fail(st, "chorus_comm_join: the grant in the store at %s:%d is malformed",
                      probe.store_host, probe.store_port);
  else
    chorus__init_fail(st, "chorus_comm_join: the job's store at %s:%d failed: %s: %s",
                      probe.store_host, probe.store_port, chorus_result_name(st), store_err);
  chorus__wipe(&probe.key, sizeof probe.key);
  return st;
}
