/*
 * store_server_cmd.c - the store server's commands: SET, GET, TRY_GET, ADD,
 * COMPARE_SET, CHECK, DELETE, WAIT and NUM_KEYS, each a handler that reads
 * its request's fields (store_proto.h), checks them, acts on the table and
 * replies; GET and WAIT on a missing key park the request instead.
 */
#include "store_server.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* Strict decimal int64 ("-12"; no spaces, no trailing bytes).  Returns 0 or
 * -1. */
static int parse_i64(const uint8_t *p, size_t n, int64_t *out) {
  size_t i = 0;
  int neg = 0;
  if (n > 0 && (p[0] == '-' || p[0] == '+')) {
    neg = p[0] == '-';
    i = 1;
  }
  if (i == n) return -1;
  int64_t v = 0;
  for (; i < n; i++) {
    if (p[i] < '0' || p[i] > '9') return -1;
    int d = p[i] - '0';
    if (__builtin_mul_overflow(v, 10, &v)) return -1;
    if (neg ? __builtin_sub_overflow(v, d, &v) : __builtin_add_overflow(v, d, &v)) return -1;
  }
  *out = v;
  return 0;
}

/* Checks that storing vlen bytes under a key of klen bytes whose entry is e
 * (NULL: a new key) keeps the store within CHORUS_STORE_KEYS_MAX and
 * CHORUS_STORE_DATA_MAX.  Returns -1 when it does; otherwise answers the
 * request with the limit and returns RQ_DONE or RQ_CLOSED. */
static int refuse_if_full(chorus_store_server_t *srv, conn_t *c, const entry_t *e, size_t klen,
                          size_t vlen) {
  if (!e && srv->nentries >= srv->lim.keys_max)
    return chorus__store_reply_limit(srv, c, "store full: CHORUS_STORE_KEYS_MAX=%zu keys",
                                     srv->lim.keys_max);
  size_t old = e && e->present ? klen + e->vlen : 0, add = klen + vlen;
  if (add > old && add - old > srv->lim.data_max - CHORUS__MIN(srv->data_bytes, srv->lim.data_max))
    return chorus__store_reply_limit(srv, c,
                       "store full: CHORUS_STORE_DATA_MAX=%zu bytes (%zu stored; this needs %zu "
                       "more)",
                       srv->lim.data_max, srv->data_bytes, add - old);
  return -1;
}

static int malformed(chorus_store_server_t *srv, conn_t *c, int cmd) {
  if (!strcmp(chorus__store_cmd_name(cmd), "unknown"))
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "unknown command %d", cmd);
  else
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "malformed %s request",
                            chorus__store_cmd_name(cmd));
  return RQ_CLOSED;
}

/* Parks the connection's head request until key exists.  The placeholder
 * entry that holds the waiters counts toward CHORUS_STORE_KEYS_MAX. */
static int wait_on(chorus_store_server_t *srv, conn_t *c, const uint8_t *key, size_t klen) {
  entry_t *e = chorus__store_table_find(srv, key, klen);
  if (!e && srv->nentries >= srv->lim.keys_max) {
    c->resume_idx = 0; /* the WAIT is answered: the next frame starts fresh */
    c->resume_off = 0;
    return chorus__store_reply_limit(srv, c, "store full: CHORUS_STORE_KEYS_MAX=%zu keys",
                                     srv->lim.keys_max);
  }
  if (!e) e = chorus__store_table_find_or_add(srv, key, klen);
  if (!e) return chorus__store_out_of_memory(srv, c);
  c->waiting_on = e;
  list_push_back(&e->waiters, &c->wait_link);
  return RQ_WAIT;
}

/* WAIT: validates the key list once, then checks the keys from where the
 * last run stopped; parks on the first missing one. */
static int do_wait(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body + 1, len - 1);
  uint32_t n = chorus__srd_u32(&r);
  if (r.bad || n > CHORUS__STORE_MAX_KEYS) return malformed(srv, c, CHORUS__STORE_CMD_WAIT);
  if (c->resume_off == 0) {
    chorus__srd_t v = r;
    for (uint32_t i = 0; i < n && !v.bad; i++) {
      const uint8_t *k;
      size_t kl;
      chorus__srd_str(&v, CHORUS__STORE_MAX_KEY, &k, &kl);
    }
    if (v.bad || v.left) return malformed(srv, c, CHORUS__STORE_CMD_WAIT);
    c->resume_idx = 0;
    c->resume_off = (size_t)(r.p - body);
  }
  r = chorus__srd_make(body + c->resume_off, len - c->resume_off);
  for (uint32_t i = c->resume_idx; i < n; i++) {
    size_t off = (size_t)(r.p - body);
    const uint8_t *k;
    size_t kl;
    chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &k, &kl);
    entry_t *e = chorus__store_table_find(srv, k, kl);
    if (!e || !e->present) {
      c->resume_idx = i;
      c->resume_off = off;
      return wait_on(srv, c, k, kl);
    }
  }
  c->resume_idx = 0;
  c->resume_off = 0;
  return chorus__store_reply_status(srv, c);
}

/* SET key value. */
static int do_set(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL, *val = NULL;
  size_t klen = 0, vlen = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  chorus__srd_str(r, CHORUS__STORE_MAX_FRAME, &val, &vlen);
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_SET);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  int full = refuse_if_full(srv, c, e, klen, vlen);
  if (full >= 0) return full;
  if (!e) e = chorus__store_table_find_or_add(srv, key, klen);
  if (!e) return chorus__store_out_of_memory(srv, c);
  if (chorus__store_entry_store(srv, e, val, vlen) < 0) {
    chorus__store_entry_maybe_drop(srv, e);
    return chorus__store_out_of_memory(srv, c);
  }
  return chorus__store_reply_status(srv, c);
}

/* GET key: the value, or parked until the key exists. */
static int do_get(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL;
  size_t klen = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_GET);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  if (e && e->present) return chorus__store_reply_value(srv, c, e->val, e->vlen);
  return wait_on(srv, c, key, klen);
}

/* TRY_GET key: whether it is there and, when it is, its value; never
 * waits (what a reader that polls wants in one request, not CHECK + GET). */
static int do_try_get(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL;
  size_t klen = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_TRY_GET);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  if (e && e->present) return chorus__store_reply_present(srv, c, e->val, e->vlen);
  return chorus__store_reply_u8(srv, c, 0);
}

/* ADD key delta: the value, a decimal integer (0 when absent), plus delta. */
static int do_add(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL;
  size_t klen = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  int64_t delta = (int64_t)chorus__srd_u64(r);
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_ADD);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  int64_t cur = 0, sum;
  if (e && e->present && parse_i64(e->val, e->vlen, &cur) < 0)
    return chorus__store_reply_bad_request(srv, c, "the value of '%.*s' is not a decimal integer",
                                           (int)CHORUS__MIN(klen, 200), (const char *)key);
  if (__builtin_add_overflow(cur, delta, &sum))
    return chorus__store_reply_bad_request(
        srv, c, "adding %" PRId64 " to %" PRId64 " overflows int64", delta, cur);
  char text[32];
  int tlen = snprintf(text, sizeof text, "%" PRId64, sum);
  int full = refuse_if_full(srv, c, e, klen, (size_t)tlen);
  if (full >= 0) return full;
  if (!e) e = chorus__store_table_find_or_add(srv, key, klen);
  if (!e) return chorus__store_out_of_memory(srv, c);
  if (chorus__store_entry_store(srv, e, text, (size_t)tlen) < 0) {
    chorus__store_entry_maybe_drop(srv, e);
    return chorus__store_out_of_memory(srv, c);
  }
  return chorus__store_reply_i64(srv, c, sum);
}

/* COMPARE_SET key expected desired: the value after the call. */
static int do_compare_set(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL, *val = NULL, *val2 = NULL;
  size_t klen = 0, vlen = 0, vlen2 = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  chorus__srd_str(r, CHORUS__STORE_MAX_FRAME, &val, &vlen);   /* expected */
  chorus__srd_str(r, CHORUS__STORE_MAX_FRAME, &val2, &vlen2); /* desired */
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_COMPARE_SET);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  if (!e || !e->present) {
    /* torch semantics: an absent key is set only when expected is empty;
     * otherwise the key stays absent and the reply echoes expected. */
    if (vlen != 0) return chorus__store_reply_value(srv, c, val, vlen);
  } else if (e->vlen != vlen || (vlen && memcmp(e->val, val, vlen) != 0)) {
    return chorus__store_reply_value(srv, c, e->val, e->vlen);
  }
  int full = refuse_if_full(srv, c, e, klen, vlen2);
  if (full >= 0) return full;
  if (!e) e = chorus__store_table_find_or_add(srv, key, klen);
  if (!e) return chorus__store_out_of_memory(srv, c);
  if (chorus__store_entry_store(srv, e, val2, vlen2) < 0) {
    chorus__store_entry_maybe_drop(srv, e);
    return chorus__store_out_of_memory(srv, c);
  }
  return chorus__store_reply_value(srv, c, e->val, e->vlen);
}

/* CHECK keys: whether they all exist. */
static int do_check(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL;
  size_t klen = 0;
  uint32_t n = chorus__srd_u32(r);
  if (r->bad || n > CHORUS__STORE_MAX_KEYS) return malformed(srv, c, CHORUS__STORE_CMD_CHECK);
  int all = 1;
  for (uint32_t i = 0; i < n && !r->bad; i++) {
    chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
    if (r->bad) break;
    entry_t *e = chorus__store_table_find(srv, key, klen);
    if (!e || !e->present) all = 0;
  }
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_CHECK);
  return chorus__store_reply_u8(srv, c, (uint8_t)all);
}

/* DELETE key: whether it existed. */
static int do_delete(chorus_store_server_t *srv, conn_t *c, chorus__srd_t *r) {
  const uint8_t *key = NULL;
  size_t klen = 0;
  chorus__srd_str(r, CHORUS__STORE_MAX_KEY, &key, &klen);
  if (r->bad || r->left) return malformed(srv, c, CHORUS__STORE_CMD_DELETE);
  entry_t *e = chorus__store_table_find(srv, key, klen);
  int existed = e && e->present;
  if (existed) {
    srv->data_bytes -= e->klen + e->vlen;
    free(e->val);
    e->val = NULL;
    e->vlen = 0;
    e->present = 0;
    srv->npresent--;
    chorus__store_entry_maybe_drop(srv, e);
  }
  return chorus__store_reply_u8(srv, c, (uint8_t)existed);
}

/* Handles one request frame of an authenticated connection.  Returns RQ_DONE
 * (answered), RQ_WAIT (parked on a key; the frame stays buffered and runs
 * again when the key is set) or RQ_CLOSED. */
static int request(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body, len);
  int cmd = chorus__srd_u8(&r);
  switch (cmd) {
    case CHORUS__STORE_CMD_SET:
      return do_set(srv, c, &r);
    case CHORUS__STORE_CMD_GET:
      return do_get(srv, c, &r);
    case CHORUS__STORE_CMD_TRY_GET:
      return do_try_get(srv, c, &r);
    case CHORUS__STORE_CMD_ADD:
      return do_add(srv, c, &r);
    case CHORUS__STORE_CMD_COMPARE_SET:
      return do_compare_set(srv, c, &r);
    case CHORUS__STORE_CMD_CHECK:
      return do_check(srv, c, &r);
    case CHORUS__STORE_CMD_DELETE:
      return do_delete(srv, c, &r);
    case CHORUS__STORE_CMD_WAIT:
      return do_wait(srv, c, body, len);
    case CHORUS__STORE_CMD_NUM_KEYS:
      if (r.left) return malformed(srv, c, cmd);
      return chorus__store_reply_i64(srv, c, srv->npresent);
    default:
      return malformed(srv, c, cmd);
  }
}

int chorus__store_request(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  int rc = request(srv, c, body, len);
  /* A parked request counts once, when it is answered. */
  if (rc != RQ_WAIT) __atomic_add_fetch(&srv->stats.requests, 1, __ATOMIC_RELAXED);
  return rc;
}
