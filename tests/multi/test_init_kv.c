/*
 * test_init_kv.c - chorus_comm_init_kv: a world found through the caller's
 * own key-value service (here: files in a directory, the way a shared file
 * system would carry it), run by chorusrun on N ranks.
 *
 *  - without a configured job secret (rank 0 makes one and it travels in
 *    the service), two worlds side by side under different key prefixes,
 *    collectives on both;
 *  - a world of one never touches the service;
 *  - untrusted values: a malformed, an oversized and a missing value fail
 *    at once with PROTOCOL / STORE errors that say why, never a hang.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "harness.h"

typedef struct {
  char dir[200];
  const char *prefix;
  const char *fake; /* non-NULL: get returns this, whatever the key */
  int fail_get;
  int calls;
} dirkv_t;

static void path_of(const dirkv_t *kv, const char *key, char *out, size_t cap) {
  snprintf(out, cap, "%s/%s%s", kv->dir, kv->prefix, key);
}

static int kv_set(void *ctx, const char *key, const void *val, size_t len, char *err,
                  size_t cap) {
  dirkv_t *kv = ctx;
  kv->calls++;
  char path[400], tmp[420];
  path_of(kv, key, path, sizeof path);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0 || write(fd, val, len) != (ssize_t)len || close(fd) < 0 || rename(tmp, path) < 0) {
    snprintf(err, cap, "%s: %s", path, strerror(errno));
    return -1;
  }
  return 0;
}

static int kv_get(void *ctx, const char *key, void *val, size_t cap, size_t *len, int timeout_ms,
                  char *err, size_t errcap) {
  dirkv_t *kv = ctx;
  kv->calls++;
  if (kv->fail_get) {
    snprintf(err, errcap, "the test's service is down");
    return -1;
  }
  if (kv->fake) {
    *len = strlen(kv->fake);
    memcpy(val, kv->fake, *len < cap ? *len : cap);
    return 0;
  }
  char path[400];
  path_of(kv, key, path, sizeof path);
  for (int waited = 0;; waited += 10) {
    int fd = open(path, O_RDONLY);
    if (fd >= 0) {
      struct stat sb;
      ssize_t n = fstat(fd, &sb) == 0 ? read(fd, val, cap) : -1;
      close(fd);
      if (n < 0) break;
      *len = (size_t)sb.st_size;
      return 0;
    }
    if (waited >= timeout_ms) break;
    struct timespec ts = {0, 10 * 1000000};
    nanosleep(&ts, NULL);
  }
  snprintf(err, errcap, "%s did not appear within %d ms", path, timeout_ms);
  return -1;
}

static int g_rank, g_size;
static char g_dir[200];

static chorus_result_t make(dirkv_t *kv, int rank, int size, chorus_comm_t *out) {
  chorus_kv_t ops = {kv, kv_set, kv_get};
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = rank;
  cfg.world_size = size;
  cfg.timeout_ms = 20000;
  return chorus_comm_init_kv(&cfg, &ops, out);
}

static void check_sum(chorus_comm_t comm, int scale) {
  int n = chorus_comm_size(comm), r = chorus_comm_rank(comm);
  int64_t v[3] = {r * scale, 1, -r}, want0 = 0;
  for (int i = 0; i < n; i++) want0 += i * scale;
  chorus_result_t st = chorus_all_reduce(comm, v, v, 3, CHORUS_INT64, CHORUS_SUM, NULL);
  if (st != CHORUS_OK) HARNESS_FAIL("all_reduce: %s", chorus_comm_last_error(comm));
  if (v[0] != want0 || v[1] != n || v[2] != -want0 / (scale ? scale : 1))
    HARNESS_FAIL("all_reduce gave %lld %lld %lld", (long long)v[0], (long long)v[1],
                 (long long)v[2]);
}

TEST(two_worlds_fresh_secret) {
  dirkv_t a = {.prefix = "a-"}, b = {.prefix = "b-"};
  snprintf(a.dir, sizeof a.dir, "%s", g_dir);
  snprintf(b.dir, sizeof b.dir, "%s", g_dir);
  chorus_comm_t wa = NULL, wb = NULL;
  chorus_result_t st = make(&a, g_rank, g_size, &wa);
  if (st != CHORUS_OK) HARNESS_FAIL("world a: %s", chorus_last_init_error());
  ASSERT_EQ(st, CHORUS_OK);
  /* The second in reverse rank order: rank 0 is someone else. */
  st = make(&b, g_size - 1 - g_rank, g_size, &wb);
  if (st != CHORUS_OK) HARNESS_FAIL("world b: %s", chorus_last_init_error());
  ASSERT_EQ(st, CHORUS_OK);
  ASSERT_EQ(chorus_comm_size(wa), g_size);
  ASSERT_EQ(chorus_comm_rank(wb), g_size - 1 - g_rank);
  check_sum(wa, 1);
  check_sum(wb, 3);
  check_sum(wa, 5);
  if (g_size > 1) ASSERT_TRUE(a.calls >= 1);
  ASSERT_EQ(chorus_comm_destroy(wb), CHORUS_OK);
  ASSERT_EQ(chorus_comm_destroy(wa), CHORUS_OK);
}

TEST(world_of_one_needs_no_service) {
  dirkv_t kv = {.prefix = "solo-", .fail_get = 1};
  snprintf(kv.dir, sizeof kv.dir, "%s", g_dir);
  chorus_comm_t w = NULL;
  ASSERT_EQ(make(&kv, 0, 1, &w), CHORUS_OK);
  check_sum(w, 1);
  ASSERT_EQ(kv.calls, 0);
  chorus_comm_destroy(w);
}

/* Rank 1 of a world whose "rank 0" published v: must fail with want. */
static void bad_value(const char *v, int fail_get, chorus_result_t want, const char *needle) {
  dirkv_t kv = {.prefix = "bad-", .fake = v, .fail_get = fail_get};
  snprintf(kv.dir, sizeof kv.dir, "%s", g_dir);
  chorus_comm_t w = NULL;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  chorus_result_t st = make(&kv, 1, 2, &w);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  if (st != want || w || !strstr(chorus_last_init_error(), needle) || s > 5)
    HARNESS_FAIL("value '%.40s': got %s in %.1f s (%s), wanted %s mentioning '%s'", v ? v : "",
                 chorus_result_name(st), s, chorus_last_init_error(), chorus_result_name(want),
                 needle);
  chorus_comm_destroy(w);
}

TEST(untrusted_values) {
  bad_value("v1,99999,127.0.0.1,-", 0, CHORUS_ERR_PROTOCOL, "malformed");
  bad_value("v2,1234,127.0.0.1,-", 0, CHORUS_ERR_PROTOCOL, "malformed");
  bad_value("v1,1234,127.0.0.1", 0, CHORUS_ERR_PROTOCOL, "malformed");
  bad_value("v1,12 34,127.0.0.1,-", 0, CHORUS_ERR_PROTOCOL, "printable");
  static char big[2000];
  memset(big, 'x', sizeof big - 1);
  bad_value(big, 0, CHORUS_ERR_PROTOCOL, "bytes");
  bad_value(NULL, 1, CHORUS_ERR_STORE, "service is down");
}

TEST(bad_arguments) {
  chorus_comm_t w = NULL;
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = 0;
  cfg.world_size = 2;
  chorus_kv_t none = {NULL, NULL, NULL};
  ASSERT_EQ(chorus_comm_init_kv(&cfg, &none, &w), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(w == NULL);
  dirkv_t kv = {.prefix = "x-"};
  chorus_kv_t ops = {&kv, kv_set, kv_get};
  cfg.rank = 2;
  ASSERT_EQ(chorus_comm_init_kv(&cfg, &ops, &w), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(kv.calls, 0);
}

int main(void) {
  const char *r = getenv("RANK"), *n = getenv("WORLD_SIZE"), *port = getenv("MASTER_PORT");
  if (!r || !n || !port) {
    fprintf(stderr, "run me under chorusrun\n");
    return 2;
  }
  g_rank = atoi(r);
  g_size = atoi(n);
  /* No configured secret: rank 0 makes one, the service carries it. */
  unsetenv("CHORUS_JOB_SECRET");
  unsetenv("CHORUS_JOB_SECRET_FILE");
  /* Named by chorusrun's job id (random per run): a directory a killed run
   * left behind is never this run's. */
  const char *job = getenv("CHORUS_JOB_ID");
  snprintf(g_dir, sizeof g_dir, "/tmp/chorus-test-kv-%s", job && *job ? job : port);
  mkdir(g_dir, 0700);
  RUN(two_worlds_fresh_secret);
  RUN(world_of_one_needs_no_service);
  RUN(untrusted_values);
  RUN(bad_arguments);
  /* Leave the directory for the last one out: everyone is past its gets
   * once a barrier on a last world completes; simpler: each rank removes
   * what it can, rank 0 the directory after a grace period. */
  if (g_rank == 0) {
    sleep(1);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
  }
  printf("%d passed, %d failed\n", harness_passed, harness_failed);
  return harness_failed ? 1 : 0;
}
