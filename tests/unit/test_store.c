/*
 * test_store.c - the key-value store (server and client) in one process.
 *
 * Every command against a real server on 127.0.0.1 with port 0; blocking GET
 * and WAIT, their timeouts and the reconnection that follows; 8 clients adding
 * concurrently; the job secret; raw "strangers" that send garbage, oversize
 * or truncated frames or nothing at all while a regular client keeps working;
 * and stop() while a client is blocked.  Raw sockets speak the protocol by
 * hand through store_proto.h.  The whole file runs in a few seconds.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "harness.h"
#include "store_raw.h"
#include "store/store.h"
#include "store/store_proto.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

static int64_t now_ms(void) {
  return chorus__now_ns() / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* Every store needs a job secret; NULL in these tests means this one. */
#define TEST_SECRET "store-test-secret"

static chorus_store_server_t *start_server(const char *secret, int *port) {
  chorus_store_server_t *s = NULL;
  if (!secret) secret = TEST_SECRET;
  if (chorus_store_server_start("127.0.0.1", 0, secret, &s) != CHORUS_OK) return NULL;
  *port = chorus_store_server_port(s);
  return s;
}

static chorus_store_t *connect_to(int port, const char *secret, int timeout_ms) {
  chorus_store_t *c = NULL;
  if (!secret) secret = TEST_SECRET;
  if (chorus_store_connect("127.0.0.1", port, secret, timeout_ms, &c) != CHORUS_OK) return NULL;
  return c;
}

/* "127.0.0.1:<port>", which every error message must contain. */
static const char *addr_of(int port) {
  static char buf[64];
  snprintf(buf, sizeof buf, "127.0.0.1:%d", port);
  return buf;
}

/* Gets key and compares it with the NUL-terminated text want; 0 on match. */
static int get_is(chorus_store_t *c, const char *key, const char *want) {
  void *v = NULL;
  size_t n = 0;
  if (chorus_store_get(c, key, &v, &n) != CHORUS_OK) return -1;
  int ok = n == strlen(want) && !memcmp(v, want, n) && ((char *)v)[n] == '\0';
  chorus_free(v);
  return ok ? 0 : -1;
}

/* ------------------------------------------------------- raw connections */

static int raw_connect(int port) {
  return chorus__net_connect("127.0.0.1", port, chorus__deadline_ms(2000), 20);
}

/* The client half of the handshake with secret (NULL: TEST_SECRET): the
 * verdict byte (0 ok) or -1. */
static int raw_auth(int fd, const char *secret) {
  chorus__key_t key;
  /* Salted with the job id as the library salts it (CHORUS_JOB_ID). */
  if (chorus__job_key(secret ? secret : TEST_SECRET, chorus__env()->JOB_ID, &key) < 0) return -1;
  return store_raw_auth(fd, &key);
}

/* Sends raw bytes. */
static int raw_send(int fd, const void *p, size_t n) {
  return chorus__net_write_full(fd, p, n, chorus__deadline_ms(2000));
}

/* Reads one response frame into buf (cap bytes); returns its length or -1. */
static int raw_response(int fd, uint8_t *buf, size_t cap) {
  uint8_t hdr[4];
  int64_t dl = chorus__deadline_ms(2000);
  if (chorus__net_read_full(fd, hdr, 4, dl) < 0) return -1;
  uint32_t len = chorus__le32_get(hdr);
  if (len > cap || chorus__net_read_full(fd, buf, len, dl) < 0) return -1;
  return (int)len;
}

/* ------------------------------------------------------------------ tests */

TEST(set_get_basics) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  ASSERT_TRUE(port > 0);
  chorus_store_t *c = connect_to(port, NULL, 3000);
  ASSERT_TRUE(c != NULL);
  ASSERT_STREQ(chorus__store_address(c), addr_of(port));
  ASSERT_TRUE(chorus__store_fd(c) >= 0);
  ASSERT_STREQ(chorus_store_last_error(c), "");

  ASSERT_EQ(chorus_store_set(c, "hello", "world", 5), CHORUS_OK);
  ASSERT_EQ(get_is(c, "hello", "world"), 0);
  ASSERT_EQ(chorus_store_set(c, "hello", "again!", 6), CHORUS_OK);
  ASSERT_EQ(get_is(c, "hello", "again!"), 0);

  /* Binary values keep their zero bytes; empty values and keys work. */
  const uint8_t bin[5] = {0, 1, 0, 255, 0};
  ASSERT_EQ(chorus_store_set(c, "bin", bin, sizeof bin), CHORUS_OK);
  void *v = NULL;
  size_t n = 0;
  ASSERT_EQ(chorus_store_get(c, "bin", &v, &n), CHORUS_OK);
  ASSERT_EQ(n, 5);
  ASSERT_EQ(memcmp(v, bin, 5), 0);
  chorus_free(v);
  ASSERT_EQ(chorus_store_set(c, "empty", NULL, 0), CHORUS_OK);
  ASSERT_EQ(chorus_store_get(c, "empty", &v, &n), CHORUS_OK);
  ASSERT_TRUE(v != NULL);
  ASSERT_EQ(n, 0);
  chorus_free(v);
  ASSERT_EQ(chorus_store_set(c, "", "k", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "", "k"), 0);

  /* Argument errors name the store and leave the client usable. */
  char *big = malloc(CHORUS__STORE_MAX_KEY + 2);
  memset(big, 'k', CHORUS__STORE_MAX_KEY + 1);
  big[CHORUS__STORE_MAX_KEY + 1] = '\0';
  ASSERT_EQ(chorus_store_set(c, big, "x", 1), CHORUS_ERR_INVALID_ARG);
  free(big);
  ASSERT_CONTAINS(chorus_store_last_error(c), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(c), "exceeds the limit");
  ASSERT_EQ(chorus_store_set(c, NULL, "x", 1), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_store_set(c, "k", NULL, 3), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(get_is(c, "hello", "again!"), 0);

  /* A 4 MiB value crosses many partial reads and writes. */
  size_t blen = (size_t)4 << 20;
  uint8_t *large = malloc(blen);
  for (size_t i = 0; i < blen; i++) large[i] = (uint8_t)(i * 7 + (i >> 13));
  ASSERT_EQ(chorus_store_set(c, "large", large, blen), CHORUS_OK);
  ASSERT_EQ(chorus_store_get(c, "large", &v, &n), CHORUS_OK);
  ASSERT_EQ(n, blen);
  ASSERT_EQ(memcmp(v, large, blen), 0);
  chorus_free(v);
  free(large);

  /* try_get: one request that never waits; absent, present, empty. */
  int present = -1;
  ASSERT_EQ(chorus__store_try_get(c, "nobody", &present, &v, &n), CHORUS_OK);
  ASSERT_EQ(present, 0);
  ASSERT_TRUE(v == NULL);
  ASSERT_EQ(chorus__store_try_get(c, "hello", &present, &v, &n), CHORUS_OK);
  ASSERT_EQ(present, 1);
  ASSERT_EQ(n, 6);
  ASSERT_STREQ((char *)v, "again!");
  chorus_free(v);
  ASSERT_EQ(chorus__store_try_get(c, "empty", &present, &v, &n), CHORUS_OK);
  ASSERT_EQ(present, 1);
  ASSERT_EQ(n, 0);
  chorus_free(v);
  ASSERT_EQ(chorus__store_try_get(c, NULL, &present, &v, &n), CHORUS_ERR_INVALID_ARG);

  chorus_store_close(c);
  chorus_store_server_stop(s);
  chorus_store_close(NULL);
  chorus_store_server_stop(NULL);
}

TEST(check_delete_num_keys) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 3000);
  ASSERT_TRUE(c != NULL);
  int64_t num = -1;
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 0);
  ASSERT_EQ(chorus_store_set(c, "a", "1", 1), CHORUS_OK);
  ASSERT_EQ(chorus_store_set(c, "b", "2", 1), CHORUS_OK);
  ASSERT_EQ(chorus_store_set(c, "a", "3", 1), CHORUS_OK);
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 2);

  const char *ab[] = {"a", "b"}, *abc[] = {"a", "b", "c"};
  int exists = -1;
  ASSERT_EQ(chorus_store_check(c, ab, 2, &exists), CHORUS_OK);
  ASSERT_EQ(exists, 1);
  ASSERT_EQ(chorus_store_check(c, abc, 3, &exists), CHORUS_OK);
  ASSERT_EQ(exists, 0);
  ASSERT_EQ(chorus_store_check(c, NULL, 0, &exists), CHORUS_OK);
  ASSERT_EQ(exists, 1);

  int deleted = -1;
  ASSERT_EQ(chorus_store_delete(c, "a", &deleted), CHORUS_OK);
  ASSERT_EQ(deleted, 1);
  ASSERT_EQ(chorus_store_delete(c, "a", &deleted), CHORUS_OK);
  ASSERT_EQ(deleted, 0);
  ASSERT_EQ(chorus_store_check(c, ab, 2, &exists), CHORUS_OK);
  ASSERT_EQ(exists, 0);
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 1);

  /* Thousands of keys (the table grows several times). */
  char key[32], val[32];
  for (int i = 0; i < 3000; i++) {
    snprintf(key, sizeof key, "many/%d", i);
    snprintf(val, sizeof val, "v%d", i * 3);
    ASSERT_EQ(chorus_store_set(c, key, val, strlen(val)), CHORUS_OK);
  }
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 3001);
  ASSERT_EQ(get_is(c, "many/0", "v0"), 0);
  ASSERT_EQ(get_is(c, "many/1234", "v3702"), 0);
  ASSERT_EQ(get_is(c, "many/2999", "v8997"), 0);
  for (int i = 0; i < 3000; i += 2) {
    snprintf(key, sizeof key, "many/%d", i);
    ASSERT_EQ(chorus_store_delete(c, key, &deleted), CHORUS_OK);
    ASSERT_EQ(deleted, 1);
  }
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 1501);
  ASSERT_EQ(get_is(c, "many/2999", "v8997"), 0);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

TEST(compare_set_semantics) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 3000);
  ASSERT_TRUE(c != NULL);
  void *cur = NULL;
  size_t n = 0;
  int exists = -1;
  const char *keys[] = {"cas"};

  /* Absent key, expected not empty: nothing is stored, expected comes back
   * (torch's behaviour). */
  ASSERT_EQ(chorus_store_compare_set(c, "cas", "old", 3, "new", 3, &cur, &n), CHORUS_OK);
  ASSERT_EQ(n, 3);
  ASSERT_EQ(memcmp(cur, "old", 3), 0);
  chorus_free(cur);
  ASSERT_EQ(chorus_store_check(c, keys, 1, &exists), CHORUS_OK);
  ASSERT_EQ(exists, 0);

  /* Absent key, expected empty: desired is stored. */
  ASSERT_EQ(chorus_store_compare_set(c, "cas", NULL, 0, "first", 5, &cur, &n), CHORUS_OK);
  ASSERT_EQ(n, 5);
  ASSERT_STREQ((char *)cur, "first");
  chorus_free(cur);
  ASSERT_EQ(get_is(c, "cas", "first"), 0);

  /* Mismatch: unchanged, the current value comes back. */
  ASSERT_EQ(chorus_store_compare_set(c, "cas", "wrong", 5, "second", 6, &cur, &n), CHORUS_OK);
  ASSERT_STREQ((char *)cur, "first");
  chorus_free(cur);
  ASSERT_EQ(chorus_store_compare_set(c, "cas", NULL, 0, "second", 6, &cur, &n), CHORUS_OK);
  ASSERT_STREQ((char *)cur, "first");
  chorus_free(cur);

  /* Match: swapped. */
  ASSERT_EQ(chorus_store_compare_set(c, "cas", "first", 5, "second", 6, &cur, &n), CHORUS_OK);
  ASSERT_EQ(n, 6);
  ASSERT_STREQ((char *)cur, "second");
  chorus_free(cur);
  ASSERT_EQ(get_is(c, "cas", "second"), 0);

  /* The result pointer is optional. */
  ASSERT_EQ(chorus_store_compare_set(c, "cas", "second", 6, "third", 5, NULL, NULL), CHORUS_OK);
  ASSERT_EQ(get_is(c, "cas", "third"), 0);

  /* compare_set wakes a GET waiting for the key (tested through WAIT). */
  ASSERT_EQ(chorus_store_compare_set(c, "cas2", NULL, 0, "", 0, &cur, &n), CHORUS_OK);
  ASSERT_EQ(n, 0);
  chorus_free(cur);
  const char *k2[] = {"cas2"};
  ASSERT_EQ(chorus_store_wait(c, k2, 1, 200), CHORUS_OK);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

typedef struct {
  int port;
  int delay_ms;
  const char *keys[4];
  int nkeys;
  chorus_result_t rc;
} setter_arg_t;

/* Sets each key (value "v:<key>") after delay_ms, with its own client. */
static void *setter_main(void *p) {
  setter_arg_t *a = p;
  chorus_store_t *c = connect_to(a->port, NULL, 3000);
  if (!c) {
    a->rc = CHORUS_ERR_STORE;
    return NULL;
  }
  a->rc = CHORUS_OK;
  for (int i = 0; i < a->nkeys && a->rc == CHORUS_OK; i++) {
    sleep_ms(a->delay_ms);
    char val[64];
    snprintf(val, sizeof val, "v:%s", a->keys[i]);
    a->rc = chorus_store_set(c, a->keys[i], val, strlen(val));
  }
  chorus_store_close(c);
  return NULL;
}

TEST(get_and_wait_block_until_set) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 5000);
  ASSERT_TRUE(c != NULL);

  setter_arg_t a = {.port = port, .delay_ms = 150, .keys = {"late"}, .nkeys = 1};
  pthread_t t;
  int64_t t0 = now_ms();
  pthread_create(&t, NULL, setter_main, &a);
  ASSERT_EQ(get_is(c, "late", "v:late"), 0);
  int64_t waited = now_ms() - t0;
  pthread_join(t, NULL);
  ASSERT_EQ(a.rc, CHORUS_OK);
  ASSERT_TRUE(waited >= 100);

  /* WAIT on three keys set one after the other. */
  setter_arg_t b = {.port = port, .delay_ms = 50, .keys = {"w/2", "w/0", "w/1"}, .nkeys = 3};
  const char *keys[] = {"w/0", "w/1", "w/2"};
  t0 = now_ms();
  pthread_create(&t, NULL, setter_main, &b);
  ASSERT_EQ(chorus_store_wait(c, keys, 3, -1), CHORUS_OK);
  waited = now_ms() - t0;
  pthread_join(t, NULL);
  ASSERT_EQ(b.rc, CHORUS_OK);
  ASSERT_TRUE(waited >= 100);
  ASSERT_EQ(get_is(c, "w/1", "v:w/1"), 0);

  /* Two clients blocked on the same key are both woken. */
  chorus_store_t *c2 = connect_to(port, NULL, 5000);
  ASSERT_TRUE(c2 != NULL);
  setter_arg_t d = {.port = port, .delay_ms = 100, .keys = {"shared"}, .nkeys = 1};
  pthread_create(&t, NULL, setter_main, &d);
  const char *shared[] = {"shared"};
  ASSERT_EQ(chorus_store_wait(c2, shared, 1, 3000), CHORUS_OK);
  ASSERT_EQ(get_is(c, "shared", "v:shared"), 0);
  pthread_join(t, NULL);
  chorus_store_close(c2);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

TEST(get_and_wait_timeouts) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 5000);
  chorus_store_t *other = connect_to(port, NULL, 5000);
  ASSERT_TRUE(c != NULL && other != NULL);
  ASSERT_EQ(chorus_store_set(c, "present", "here", 4), CHORUS_OK);

  void *v = NULL;
  size_t n = 0;
  int64_t t0 = now_ms();
  ASSERT_EQ(chorus__store_get_timeout(c, "missing", 200, &v, &n), CHORUS_ERR_TIMEOUT);
  int64_t took = now_ms() - t0;
  ASSERT_TRUE(took >= 150 && took < 2000);
  ASSERT_TRUE(v == NULL);
  ASSERT_CONTAINS(chorus_store_last_error(c), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(c), "get('missing') timed out after 200 ms");
  ASSERT_EQ(chorus__store_fd(c), -1); /* dropped; the next call reconnects */

  /* The key appears after the timeout: a stale connection would now hold
   * its late reply.  The next calls must see only their own answers. */
  ASSERT_EQ(chorus_store_set(other, "missing", "late", 4), CHORUS_OK);
  ASSERT_EQ(get_is(c, "present", "here"), 0);
  ASSERT_EQ(get_is(c, "missing", "late"), 0);
  ASSERT_TRUE(chorus__store_fd(c) >= 0);

  const char *keys[] = {"present", "absent"};
  t0 = now_ms();
  ASSERT_EQ(chorus_store_wait(c, keys, 2, 200), CHORUS_ERR_TIMEOUT);
  took = now_ms() - t0;
  ASSERT_TRUE(took >= 150 && took < 2000);
  ASSERT_CONTAINS(chorus_store_last_error(c), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(c), "wait('present', 'absent') timed out after 200 ms");
  ASSERT_EQ(chorus_store_set(other, "absent", "now", 3), CHORUS_OK);
  ASSERT_EQ(chorus_store_wait(c, keys, 2, 200), CHORUS_OK);
  ASSERT_EQ(chorus_store_wait(c, NULL, 0, 200), CHORUS_OK);
  int64_t num = 0;
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 3);

  /* The client's default timeout applies to plain get(). */
  chorus__store_set_timeout(c, 100);
  t0 = now_ms();
  ASSERT_EQ(chorus_store_get(c, "never", &v, &n), CHORUS_ERR_TIMEOUT);
  ASSERT_TRUE(now_ms() - t0 < 2000);
  ASSERT_CONTAINS(chorus_store_last_error(c), "timed out after 100 ms");
  ASSERT_EQ(get_is(c, "present", "here"), 0);

  chorus_store_close(other);
  chorus_store_close(c);
  chorus_store_server_stop(s);
}

typedef struct {
  int port;
  chorus_store_t *shared; /* NULL: connect a client of its own */
  int iters;
  chorus_result_t rc;
  int64_t last;
} adder_arg_t;

static void *adder_main(void *p) {
  adder_arg_t *a = p;
  chorus_store_t *c = a->shared ? a->shared : connect_to(a->port, NULL, 3000);
  a->rc = c ? CHORUS_OK : CHORUS_ERR_STORE;
  for (int i = 0; i < a->iters && a->rc == CHORUS_OK; i++)
    a->rc = chorus_store_add(c, "counter", 1, &a->last);
  if (!a->shared) chorus_store_close(c);
  return NULL;
}

TEST(add_counters) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 3000);
  ASSERT_TRUE(c != NULL);

  int64_t r = 0;
  ASSERT_EQ(chorus_store_add(c, "n", 5, &r), CHORUS_OK);
  ASSERT_EQ(r, 5);
  ASSERT_EQ(chorus_store_add(c, "n", -7, &r), CHORUS_OK);
  ASSERT_EQ(r, -2);
  ASSERT_EQ(get_is(c, "n", "-2"), 0);
  ASSERT_EQ(chorus_store_add(c, "n", 0, NULL), CHORUS_OK);

  /* 8 clients x 100 increments. */
  enum { NT = 8 };
  pthread_t t[NT];
  adder_arg_t a[NT];
  for (int i = 0; i < NT; i++) {
    a[i] = (adder_arg_t){.port = port, .iters = 100};
    pthread_create(&t[i], NULL, adder_main, &a[i]);
  }
  for (int i = 0; i < NT; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < NT; i++) ASSERT_EQ(a[i].rc, CHORUS_OK);
  ASSERT_EQ(get_is(c, "counter", "800"), 0);

  /* 4 threads sharing one client (serialised by its mutex). */
  for (int i = 0; i < 4; i++) {
    a[i] = (adder_arg_t){.port = port, .shared = c, .iters = 50};
    pthread_create(&t[i], NULL, adder_main, &a[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) ASSERT_EQ(a[i].rc, CHORUS_OK);
  ASSERT_EQ(get_is(c, "counter", "1000"), 0);

  /* ADD on text and an overflowing ADD are declined; the client goes on. */
  ASSERT_EQ(chorus_store_set(c, "text", "abc", 3), CHORUS_OK);
  ASSERT_EQ(chorus_store_add(c, "text", 1, &r), CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_store_last_error(c), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(c), "not a decimal integer");
  ASSERT_EQ(chorus_store_add(c, "big", INT64_MAX, &r), CHORUS_OK);
  ASSERT_EQ(chorus_store_add(c, "big", 1, &r), CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_store_last_error(c), "overflows");
  ASSERT_EQ(get_is(c, "text", "abc"), 0);
  ASSERT_EQ(chorus_store_add(c, "counter", 1, &r), CHORUS_OK);
  ASSERT_EQ(r, 1001);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

TEST(job_secret) {
  int port = 0;
  chorus_store_server_t *s = start_server("s3cret", &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = NULL;
  int64_t t0 = now_ms();
  ASSERT_EQ(chorus_store_connect("127.0.0.1", port, "wrong", 3000, &c), CHORUS_ERR_PROTOCOL);
  ASSERT_TRUE(c == NULL);
  ASSERT_TRUE(now_ms() - t0 < 2000); /* a rejection is final, not retried */
  ASSERT_CONTAINS(chorus__store_connect_error(), addr_of(port));
  ASSERT_CONTAINS(chorus__store_connect_error(), "authentication failed");
  /* No secret at all: refused before connecting (CHORUS_INSECURE is not set). */
  ASSERT_EQ(chorus_store_connect("127.0.0.1", port, NULL, 3000, &c), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(c == NULL);
  ASSERT_CONTAINS(chorus__store_connect_error(), "no job secret");
  chorus_store_server_t *open_srv = NULL;
  ASSERT_EQ(chorus_store_server_start("127.0.0.1", 0, NULL, &open_srv), CHORUS_ERR_INVALID_ARG);

  c = connect_to(port, "s3cret", 3000);
  ASSERT_TRUE(c != NULL);
  ASSERT_STREQ(chorus__store_connect_error(), "");
  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "k", "v"), 0);

  /* A raw connection with the wrong key gets verdict 1 and is closed. */
  int fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  ASSERT_EQ(raw_auth(fd, "nope"), CHORUS__STORE_HS_DENIED);
  ASSERT_EQ(store_raw_wait_closed(fd, 1000), 1);
  close(fd);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

TEST(strangers_do_not_disturb) {
  int port = 0;
  chorus_store_server_t *s = start_server("sec", &port);
  ASSERT_TRUE(s != NULL);
  chorus__store_server_set_handshake_timeout(s, 300);
  chorus_store_t *c = connect_to(port, "sec", 3000);
  ASSERT_TRUE(c != NULL);
  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);

  /* Silent connections, kept open while everything else runs. */
  int silent[20];
  for (int i = 0; i < 20; i++) {
    silent[i] = raw_connect(port);
    ASSERT_TRUE(silent[i] >= 0);
  }

  /* Garbage (an HTTP request) instead of a handshake. */
  int fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  const char *http = "GET / HTTP/1.1\r\nHost: store\r\n\r\n";
  raw_send(fd, http, strlen(http));
  ASSERT_EQ(store_raw_wait_closed(fd, 1000), 1);
  close(fd);
  ASSERT_EQ(get_is(c, "k", "v"), 0);

  /* A 4 GiB length prefix. */
  fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  const uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};
  raw_send(fd, huge, 4);
  ASSERT_EQ(store_raw_wait_closed(fd, 1000), 1);
  close(fd);

  /* Half a handshake frame, then goodbye: once without reading the nonce
   * (the close becomes a reset), once after reading it (a clean close). */
  const uint8_t half[7] = {CHORUS__STORE_AUTH_LEN, 0, 0, 0, 'C', 'H', 'S'};
  for (int i = 0; i < 2; i++) {
    fd = raw_connect(port);
    ASSERT_TRUE(fd >= 0);
    uint8_t hello[4 + CHORUS__STORE_HELLO_LEN];
    if (i == 1)
      ASSERT_EQ(chorus__net_read_full(fd, hello, sizeof hello, chorus__deadline_ms(2000)), 0);
    raw_send(fd, half, sizeof half);
    close(fd);
  }
  /* Half a request after a good handshake, then goodbye. */
  fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  ASSERT_EQ(raw_auth(fd, "sec"), 0);
  const uint8_t half_req[6] = {20, 0, 0, 0, CHORUS__STORE_CMD_SET, 3};
  raw_send(fd, half_req, sizeof half_req);
  close(fd);
  ASSERT_EQ(get_is(c, "k", "v"), 0);

  /* Authenticated but malformed requests: each closes its connection. */
  uint8_t bad[5][16];
  size_t badlen[5];
  /* unknown command */
  chorus__le32_put(bad[0], 1);
  bad[0][4] = 99;
  badlen[0] = 5;
  /* SET whose key length runs past the frame */
  chorus__le32_put(bad[1], 5);
  bad[1][4] = CHORUS__STORE_CMD_SET;
  chorus__le32_put(bad[1] + 5, 0xfffffff0u);
  badlen[1] = 9;
  /* CHECK naming a billion keys */
  chorus__le32_put(bad[2], 5);
  bad[2][4] = CHORUS__STORE_CMD_CHECK;
  chorus__le32_put(bad[2] + 5, 1000000000u);
  badlen[2] = 9;
  /* NUM_KEYS with trailing bytes */
  chorus__le32_put(bad[3], 3);
  bad[3][4] = CHORUS__STORE_CMD_NUM_KEYS;
  bad[3][5] = bad[3][6] = 7;
  badlen[3] = 7;
  /* an empty frame */
  chorus__le32_put(bad[4], 0);
  badlen[4] = 4;
  for (int i = 0; i < 5; i++) {
    fd = raw_connect(port);
    ASSERT_TRUE(fd >= 0);
    ASSERT_EQ(raw_auth(fd, "sec"), 0);
    raw_send(fd, bad[i], badlen[i]);
    if (!store_raw_wait_closed(fd, 1000)) HARNESS_FAIL("malformed request %d did not close", i);
    close(fd);
    ASSERT_EQ(get_is(c, "k", "v"), 0);
  }

  /* Two pipelined requests, sent one byte at a time. */
  fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  ASSERT_EQ(raw_auth(fd, "sec"), 0);
  chorus__sbuf_t req = {0};
  size_t at = chorus__sbuf_frame_begin(&req);
  chorus__sbuf_u8(&req, CHORUS__STORE_CMD_SET);
  chorus__sbuf_str(&req, "raw", 3);
  chorus__sbuf_str(&req, "bytes", 5);
  chorus__sbuf_frame_end(&req, at);
  at = chorus__sbuf_frame_begin(&req);
  chorus__sbuf_u8(&req, CHORUS__STORE_CMD_GET);
  chorus__sbuf_str(&req, "raw", 3);
  chorus__sbuf_frame_end(&req, at);
  for (size_t i = 0; i < req.len; i++) ASSERT_EQ(raw_send(fd, req.data + i, 1), 0);
  chorus__sbuf_free(&req);
  uint8_t resp[64];
  ASSERT_EQ(raw_response(fd, resp, sizeof resp), 1);
  ASSERT_EQ(resp[0], CHORUS__STORE_ST_OK);
  ASSERT_EQ(raw_response(fd, resp, sizeof resp), 10);
  ASSERT_EQ(resp[0], CHORUS__STORE_ST_OK);
  ASSERT_EQ(chorus__le32_get(resp + 1), 5);
  ASSERT_EQ(memcmp(resp + 5, "bytes", 5), 0);
  close(fd);
  ASSERT_EQ(get_is(c, "raw", "bytes"), 0);

  /* The silent ones are dropped after the (shortened) handshake timeout. */
  for (int i = 0; i < 20; i++) {
    if (!store_raw_wait_closed(silent[i], 2000)) HARNESS_FAIL("silent connection %d still open", i);
    close(silent[i]);
  }
  int64_t num = 0;
  ASSERT_EQ(chorus_store_num_keys(c, &num), CHORUS_OK);
  ASSERT_EQ(num, 2);

  chorus_store_close(c);
  chorus_store_server_stop(s);
}

/* A client that pipelines requests for large values and reads the answers
 * only later: the server stops working for it while too much output is
 * unsent and must resume every buffered request once the client reads. */
TEST(pipelined_large_responses) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 3000);
  ASSERT_TRUE(c != NULL);
  size_t vlen = 300 << 10;
  uint8_t *val = malloc(vlen);
  for (size_t i = 0; i < vlen; i++) val[i] = (uint8_t)(i % 251);
  ASSERT_EQ(chorus_store_set(c, "big", val, vlen), CHORUS_OK);

  int fd = raw_connect(port);
  ASSERT_TRUE(fd >= 0);
  ASSERT_EQ(raw_auth(fd, NULL), 0);
  enum { NREQ = 24 };
  chorus__sbuf_t req = {0};
  for (int i = 0; i < NREQ; i++) {
    size_t at = chorus__sbuf_frame_begin(&req);
    chorus__sbuf_u8(&req, CHORUS__STORE_CMD_GET);
    chorus__sbuf_str(&req, "big", 3);
    chorus__sbuf_frame_end(&req, at);
  }
  ASSERT_EQ(raw_send(fd, req.data, req.len), 0);
  chorus__sbuf_free(&req);
  sleep_ms(100);
  ASSERT_EQ(chorus_store_set(c, "other", "x", 1), CHORUS_OK); /* not held up */

  uint8_t *resp = malloc(vlen + 16);
  for (int i = 0; i < NREQ; i++) {
    int n = raw_response(fd, resp, vlen + 16);
    if (n != (int)(vlen + 5)) {
      HARNESS_FAIL("response %d: length %d", i, n);
      break;
    }
    if (resp[0] != CHORUS__STORE_ST_OK || memcmp(resp + 5, val, vlen) != 0) {
      HARNESS_FAIL("response %d differs", i);
      break;
    }
  }
  free(resp);
  free(val);
  close(fd);
  ASSERT_EQ(get_is(c, "other", "x"), 0);
  chorus_store_close(c);
  chorus_store_server_stop(s);
}

typedef struct {
  chorus_store_t *c;
  chorus_result_t rc;
  int64_t returned_ms;
} blocked_arg_t;

static void *blocked_get_main(void *p) {
  blocked_arg_t *a = p;
  void *v = NULL;
  size_t n = 0;
  a->rc = chorus_store_get(a->c, "never", &v, &n);
  a->returned_ms = now_ms();
  chorus_free(v);
  return NULL;
}

TEST(stop_with_blocked_client) {
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);
  chorus_store_t *c = connect_to(port, NULL, 5000);
  chorus_store_t *idle = connect_to(port, NULL, 5000);
  ASSERT_TRUE(c != NULL && idle != NULL);
  ASSERT_EQ(chorus_store_set(idle, "k", "v", 1), CHORUS_OK);

  blocked_arg_t a = {.c = c};
  pthread_t t;
  pthread_create(&t, NULL, blocked_get_main, &a);
  sleep_ms(200);
  int64_t t0 = now_ms();
  chorus_store_server_stop(s);
  int64_t stop_took = now_ms() - t0;
  pthread_join(t, NULL);
  ASSERT_TRUE(stop_took < 1000);
  ASSERT_EQ(a.rc, CHORUS_ERR_STORE);
  ASSERT_TRUE(a.returned_ms - t0 < 2000);
  ASSERT_CONTAINS(chorus_store_last_error(c), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(c), "get('never')");

  /* The idle client hears about it on its next call, quickly. */
  t0 = now_ms();
  ASSERT_EQ(chorus_store_set(idle, "k", "v", 1), CHORUS_ERR_STORE);
  ASSERT_TRUE(now_ms() - t0 < 2000);
  ASSERT_CONTAINS(chorus_store_last_error(idle), addr_of(port));
  /* And the one after that cannot reconnect: refused, named. */
  ASSERT_EQ(chorus_store_set(idle, "k", "v", 1), CHORUS_ERR_STORE);
  ASSERT_TRUE(now_ms() - t0 < 3000);
  ASSERT_CONTAINS(chorus_store_last_error(idle), addr_of(port));
  ASSERT_CONTAINS(chorus_store_last_error(idle), strerror(ECONNREFUSED));

  chorus_store_close(idle);
  chorus_store_close(c);
}

TEST(connect_errors) {
  /* A port nobody listens on any more: refused until the timeout. */
  int port = 0;
  chorus_store_server_t *s = start_server(NULL, &port);
  ASSERT_TRUE(s != NULL);

  /* A second server cannot take the same port. */
  chorus_store_server_t *s2 = NULL;
  ASSERT_EQ(chorus_store_server_start("127.0.0.1", port, TEST_SECRET, &s2), CHORUS_ERR_STORE);
  ASSERT_TRUE(s2 == NULL);
  chorus_store_server_stop(s);

  chorus_store_t *c = NULL;
  int64_t t0 = now_ms();
  chorus_result_t rc = chorus_store_connect("127.0.0.1", port, TEST_SECRET, 300, &c);
  int64_t took = now_ms() - t0;
  ASSERT_EQ(rc, CHORUS_ERR_STORE);
  ASSERT_TRUE(c == NULL);
  ASSERT_TRUE(took >= 250 && took < 2000);
  ASSERT_CONTAINS(chorus__store_connect_error(), addr_of(port));
  ASSERT_CONTAINS(chorus__store_connect_error(), strerror(ECONNREFUSED));

  ASSERT_EQ(chorus_store_connect("127.0.0.1", 0, TEST_SECRET, 300, &c), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_store_server_start(NULL, 70000, TEST_SECRET, &s2), CHORUS_ERR_INVALID_ARG);
}

int main(void) {
  RUN(set_get_basics);
  RUN(check_delete_num_keys);
  RUN(compare_set_semantics);
  RUN(get_and_wait_block_until_set);
  RUN(get_and_wait_timeouts);
  RUN(add_counters);
  RUN(job_secret);
  RUN(strangers_do_not_disturb);
  RUN(pipelined_large_responses);
  RUN(stop_with_blocked_client);
  RUN(connect_errors);
  return HARNESS_DONE();
}
