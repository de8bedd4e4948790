/*
 * kv_store.c - the rendezvous's key-value service on chorus's own store
 * (the c10d and static backends): get, set and compare-and-set over a store
 * client whose every call is bounded by a short timeout, so the agent's
 * loop never waits long on a store that went away.
 */
#include "launcher/launcher.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"
#include "store/store.h"
#include "util/net.h"

typedef struct {
  kv_t base;
  chorus_store_t *c;
} kv_store_t;

static int fail(kv_store_t *k, const char *what) {
  snprintf(k->base.err, sizeof k->base.err, "%s: %s", what, chorus_store_last_error(k->c));
  return -1;
}

/* Takes a store value as a NUL-terminated string; values with a NUL inside
 * are not ours. */
static int take(kv_store_t *k, void *v, size_t len, char **out) {
  if (memchr(v, '\0', len)) {
    chorus_free(v);
    snprintf(k->base.err, sizeof k->base.err, "a value with a NUL byte inside");
    return -1;
  }
  char *s = malloc(len + 1);
  if (!s) {
    chorus_free(v);
    snprintf(k->base.err, sizeof k->base.err, "out of memory");
    return -1;
  }
  memcpy(s, v, len);
  s[len] = '\0';
  chorus_free(v);
  *out = s;
  return 0;
}

static int kvs_get(kv_t *kv, const char *key, char **val) {
  kv_store_t *k = (kv_store_t *)kv;
  int present = 0;
  *val = NULL;
  void *v = NULL;
  size_t len = 0;
  /* One request, which never waits (heartbeats are read this way). */
  if (chorus__store_try_get(k->c, key, &present, &v, &len) != CHORUS_OK) return fail(k, "get");
  if (!present) return 0;
  return take(k, v, len, val) == 0 ? 1 : -1;
}

static int kvs_set(kv_t *kv, const char *key, const char *val) {
  kv_store_t *k = (kv_store_t *)kv;
  if (chorus_store_set(k->c, key, val, strlen(val)) != CHORUS_OK) return fail(k, "set");
  return 0;
}

static int kvs_cas(kv_t *kv, const char *key, const char *expected, const char *desired) {
  kv_store_t *k = (kv_store_t *)kv;
  void *cur = NULL;
  size_t len = 0;
  size_t dlen = strlen(desired);
  if (chorus_store_compare_set(k->c, key, expected, expected ? strlen(expected) : 0, desired,
                               dlen, &cur, &len) != CHORUS_OK)
    return fail(k, "compare_set");
  /* The store answers with the value after the call: ours exactly when the
   * swap happened (an absent key with a non-empty expected echoes
   * expected, which is never our desired value). */
  int swapped = len == dlen && memcmp(cur, desired, dlen) == 0;
  chorus_free(cur);
  return swapped;
}

static int kvs_local_addr(kv_t *kv, char *host, size_t cap) {
  kv_store_t *k = (kv_store_t *)kv;
  int port, fd = chorus__store_fd(k->c);
  return fd >= 0 ? chorus__net_local_addr(fd, host, cap, &port) : -1;
}

static void kvs_close(kv_t *kv) {
  kv_store_t *k = (kv_store_t *)kv;
  chorus_store_close(k->c);
  free(k);
}

static const kv_ops_t g_kv_store_ops = {kvs_get, kvs_set, kvs_cas, kvs_local_addr, kvs_close, NULL};

int kv_store_open(const char *host, int port, const chorus__key_t *key, int timeout_ms,
                  int call_timeout_ms, kv_t **out, char *err, size_t cap) {
  *out = NULL;
  chorus_store_t *c = NULL;
  if (chorus__store_connect_key(host, port, key, timeout_ms, &c) != CHORUS_OK) {
    snprintf(err, cap, "%s", chorus__store_connect_error());
    if (chorus__store_connect_denied()) return -2;
    return chorus__store_connect_answer() != CHORUS__STORE_ANS_NO_ANSWER ? -3 : -1;
  }
  chorus__store_set_timeout(c, call_timeout_ms);
  kv_store_t *k = calloc(1, sizeof *k);
  if (!k) {
    chorus_store_close(c);
    snprintf(err, cap, "out of memory");
    return -1;
  }
  k->base.ops = &g_kv_store_ops;
  snprintf(k->base.where, sizeof k->base.where, "%s", chorus__store_address(c));
  k->c = c;
  *out = &k->base;
  return 0;
}

/* The launcher's store servers (the job's, the rendezvous's, a round's):
 * started with every signal blocked, so that the store's thread never takes
 * the signals that main()'s self-pipe must see. */
chorus_result_t start_store(const char *host, int port, const chorus__key_t *key,
                            chorus_store_server_t **srv) {
  /* The store thread must never take our signals (it blocks them itself
   * too, once running): they go to the main thread, whose poll() the
   * self-pipe wakes.  A thread starts with its creator's mask. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  chorus_result_t rc = chorus__store_server_start_key(host, port, key, srv);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return rc;
}
