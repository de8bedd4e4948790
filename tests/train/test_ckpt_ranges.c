/*
 * test_ckpt_ranges.c - sharded checkpoints of ranges (src/train/dist_ckpt*.c,
 * as parameter servers write them), in one process: three ranges of the
 * layout, each with its own AdamW stepped a different number of times, saved
 * as the three files of one checkpoint and read back exactly, range by range
 * and across files; a save missing a file, or with bad ranges, fails and
 * writes nothing; the one-range wrapper writes what the multi-range save
 * writes for the same range.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "harness.h"
#include "train/ckpt.h"
#include "ck_range.h"

/* Odd sizes: ranges that start and end inside units. */
static const chorus_gpt_config_t k_cfg = {37, 9, 3, 3, 15};
enum { SEED = 77, NR = 3 };

static char g_dir[4096];
static chorus_gpt_t *g_m;
static size_t g_np;

static unsigned long long g_rng = 12345; /* the gradients of range_make */

/* The optimizer's state as chorus_optim_state_save gives it. */
static unsigned char *blob_of(const chorus_optim_t *o) {
  unsigned char *b = malloc(chorus_optim_state_size(o));
  if (b) chorus_optim_state_save(o, b);
  return b;
}

static int exists(const char *fmt, const char *a, long step, const char *name) {
  char p[8192];
  snprintf(p, sizeof p, fmt, a, step, name);
  return access(p, F_OK) == 0;
}

static int read_all(const char *path, unsigned char **out, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return -1;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  *out = malloc((size_t)n + 1);
  *len = (size_t)n;
  int rc = *out && fread(*out, 1, (size_t)n, f) == (size_t)n ? 0 : -1;
  fclose(f);
  return rc;
}

/* The layout in three uneven ranges, stepped 2, 5 and 3 times. */
static range_t g_r[NR];
static const int k_steps[NR] = {2, 5, 3};

static int make_ranges(void) {
  const size_t cut1 = g_np / 3 + 7, cut2 = 2 * g_np / 3 - 5;
  const size_t lo[NR] = {0, cut1, cut2}, hi[NR] = {cut1, cut2, g_np};
  for (int k = 0; k < NR; k++)
    if (range_make(&g_r[k], g_m, SEED, lo[k], hi[k] - lo[k], k_steps[k], &g_rng) != 0) return -1;
  return 0;
}

/* Loads [lo, lo + n) from dir into fresh buffers; compares with want (the
 * floats) and, when wblob, with that optimizer state.  1: equal. */
static int load_and_compare(const char *dir, size_t lo, size_t n, long want_step, const float *want,
                            const unsigned char *wblob, int64_t want_t) {
  range_t got = {0};
  if (range_make(&got, g_m, SEED, lo, n, 0, &g_rng) != 0) return 0;
  for (size_t i = 0; i < n; i++) got.par[i] = -1.0f;
  long step = -2;
  char x[64] = "";
  size_t xlen = 0;
  chorus_ckpt_info_t info = {0};
  chorus_result_t st = chorus__ckpt_load_range(NULL, g_m, got.opt, got.par, lo, n, dir, &step, x,
                                               sizeof x, &xlen, &info);
  int ok = st == CHORUS_OK && step == want_step && xlen == 6 && !memcmp(x, "extra", 6) &&
           info.sharded == 1 && (n == 0 || !memcmp(got.par, want, n * sizeof(float))) &&
           steps_of(got.opt) == want_t;
  if (ok && wblob) {
    unsigned char *b = blob_of(got.opt);
    ok = b && !memcmp(b, wblob, chorus_optim_state_size(got.opt));
    free(b);
  }
  if (!ok)
    fprintf(stderr, "load of [%zu, %zu): %s, step %ld, t %lld (want %lld): %s\n", lo, lo + n,
            chorus_result_name(st), step, (long long)steps_of(got.opt), (long long)want_t,
            st == CHORUS_OK ? "contents differ" : chorus_train_last_error());
  range_free(&got);
  return ok;
}

TEST(three_ranges_round_trip) {
  ASSERT_EQ(make_ranges(), 0);
  /* Out of file order, as a server that took over a range lists them. */
  const chorus__ck_range_t cr[NR] = {
      {g_r[2].opt, g_r[2].par, g_r[2].lo, g_r[2].n, 2},
      {g_r[0].opt, g_r[0].par, g_r[0].lo, g_r[0].n, 0},
      {g_r[1].opt, g_r[1].par, g_r[1].lo, g_r[1].n, 1},
  };
  ASSERT_EQ(chorus__ckpt_save_ranges(NULL, g_m, NR, cr, NR, g_dir, 10, "extra", 6, 2), CHORUS_OK);
  const char *f = "%s/ckpt-%09ld/%s";
  ASSERT_TRUE(exists(f, g_dir, 10, "index.bin"));
  ASSERT_TRUE(exists(f, g_dir, 10, "shard-00000-of-00003.bin"));
  ASSERT_TRUE(exists(f, g_dir, 10, "shard-00001-of-00003.bin"));
  ASSERT_TRUE(exists(f, g_dir, 10, "shard-00002-of-00003.bin"));
  /* Each range back, bit for bit, with its own step count. */
  for (int k = 0; k < NR; k++) {
    unsigned char *b = blob_of(g_r[k].opt);
    ASSERT_TRUE(b != NULL);
    ASSERT_EQ(steps_of(g_r[k].opt), k_steps[k]);
    int ok = load_and_compare(g_dir, g_r[k].lo, g_r[k].n, 10, g_r[k].par, b, k_steps[k]);
    free(b);
    ASSERT_TRUE(ok);
  }
  /* A range across files 0 and 1 takes both files' floats and the larger
   * step count (as servers of another split resume). */
  const size_t lo = g_r[1].lo - 11, n = 40;
  float want[40];
  memcpy(want, g_r[0].par + (lo - g_r[0].lo), 11 * sizeof(float));
  memcpy(want + 11, g_r[1].par, 29 * sizeof(float));
  ASSERT_TRUE(load_and_compare(g_dir, lo, n, 10, want, NULL, k_steps[1]));
  /* A rank holding nothing (a standby) takes part and loads the step. */
  ASSERT_TRUE(load_and_compare(g_dir, 0, 0, 10, NULL, NULL, 0));
  /* The whole layout at once. */
  float *whole = malloc(g_np * sizeof(float));
  ASSERT_TRUE(whole != NULL);
  for (int k = 0; k < NR; k++) memcpy(whole + g_r[k].lo, g_r[k].par, g_r[k].n * sizeof(float));
  int ok = load_and_compare(g_dir, 0, g_np, 10, whole, NULL, k_steps[1]);
  free(whole);
  ASSERT_TRUE(ok);
}

/* Each of these fails, names why, and leaves no checkpoint behind. */
static void expect_refused(int nr, const chorus__ck_range_t *cr, int files, long step,
                           const char *why) {
  chorus_result_t st =
      chorus__ckpt_save_ranges(NULL, g_m, nr, cr, files, g_dir, step, "extra", 6, 2);
  if (st == CHORUS_OK) {
    HARNESS_FAIL("save at step %ld succeeded (wanted: %s)", step, why);
    return;
  }
  if (!strstr(chorus_train_last_error(), why))
    HARNESS_FAIL("save at step %ld: \"%s\" does not say \"%s\"", step, chorus_train_last_error(),
                 why);
  char p[8192];
  snprintf(p, sizeof p, "%s/ckpt-%09ld", g_dir, step);
  if (access(p, F_OK) == 0) HARNESS_FAIL("save at step %ld left %s", step, p);
}

TEST(bad_saves_fail) {
  const chorus__ck_range_t r0 = {g_r[0].opt, g_r[0].par, g_r[0].lo, g_r[0].n, 0};
  const chorus__ck_range_t r1 = {g_r[1].opt, g_r[1].par, g_r[1].lo, g_r[1].n, 1};
  const chorus__ck_range_t r2 = {g_r[2].opt, g_r[2].par, g_r[2].lo, g_r[2].n, 2};
  /* File 1 of 3 missing. */
  chorus__ck_range_t two[2] = {r0, r2};
  expect_refused(2, two, 3, 20, "1 file(s) held by no rank: 1 (of 3)");
  /* A file outside the checkpoint, or given twice. */
  chorus__ck_range_t three[3] = {r0, r1, r2};
  three[2].file = 3;
  expect_refused(3, three, 3, 21, "file 3 is not one of the checkpoint's 3");
  three[2].file = 1;
  expect_refused(3, three, 3, 22, "are both file 1");
  /* Overlapping ranges, a range past the layout, an optimizer over other
   * floats. */
  three[2] = r2;
  three[2].lo -= 1;
  expect_refused(3, three, 3, 23, "overlap");
  three[2] = r2;
  three[2].lo += 1;
  expect_refused(3, three, 3, 24, "outside the model's");
  three[2] = r2;
  three[2].n -= 1;
  expect_refused(3, three, 3, 25, "not over the range's floats");
  /* No files at all. */
  expect_refused(0, NULL, 0, 26, "0 files");
  /* Nothing of the above was written: the step-10 checkpoint still loads. */
  unsigned char *b = blob_of(g_r[2].opt);
  ASSERT_TRUE(b != NULL);
  int ok = load_and_compare(g_dir, g_r[2].lo, g_r[2].n, 10, g_r[2].par, b, k_steps[2]);
  free(b);
  ASSERT_TRUE(ok);
}

/* The one-range wrapper writes file 0 of 1, byte for byte what the
 * multi-range save writes for that range, and it loads back. */
TEST(one_range_wrapper) {
  range_t a;
  ASSERT_EQ(range_make(&a, g_m, SEED, 0, g_np, 4, &g_rng), 0);
  char d1[4200], d2[4200];
  snprintf(d1, sizeof d1, "%s/one", g_dir);
  snprintf(d2, sizeof d2, "%s/many", g_dir);
  ASSERT_EQ(chorus__ckpt_save_range(NULL, g_m, a.opt, a.par, 0, g_np, d1, 3, "extra", 6, 1),
            CHORUS_OK);
  const chorus__ck_range_t cr = {a.opt, a.par, 0, g_np, 0};
  ASSERT_EQ(chorus__ckpt_save_ranges(NULL, g_m, 1, &cr, 1, d2, 3, "extra", 6, 1), CHORUS_OK);
  const char *names[2] = {"shard-00000-of-00001.bin", "index.bin"};
  for (int i = 0; i < 2; i++) {
    char p1[8192], p2[8192];
    snprintf(p1, sizeof p1, "%s/ckpt-%09d/%s", d1, 3, names[i]);
    snprintf(p2, sizeof p2, "%s/ckpt-%09d/%s", d2, 3, names[i]);
    unsigned char *b1 = NULL, *b2 = NULL;
    size_t n1 = 0, n2 = 0;
    int same = read_all(p1, &b1, &n1) == 0 && read_all(p2, &b2, &n2) == 0 && n1 == n2 &&
               !memcmp(b1, b2, n1);
    /* The shard: a header, one range {0, np}, parameters, m, v, checksum. */
    if (same && i == 0) {
      uint64_t magic, range[2];
      memcpy(&magic, b1, sizeof magic);
      memcpy(range, b1 + n1 - 8 - 12 * g_np - 16, sizeof range);
      same = magic == 0x6873737572686f63ull && range[0] == 0 && range[1] == g_np &&
             !memcmp(b1 + n1 - 8 - 12 * g_np, a.par, g_np * sizeof(float));
    }
    free(b1), free(b2);
    if (!same) HARNESS_FAIL("%s: the wrapper's file differs or is not of the format", names[i]);
  }
  unsigned char *b = blob_of(a.opt);
  ASSERT_TRUE(b != NULL);
  int ok = load_and_compare(d1, 0, g_np, 3, a.par, b, 4);
  free(b);
  range_free(&a);
  ASSERT_TRUE(ok);
}

int main(void) {
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/chorus-ckpt-ranges-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(g_dir)) {
    fprintf(stderr, "mkdtemp %s: %s\n", g_dir, strerror(errno));
    return 1;
  }
  if (chorus_gpt_create_ex(&k_cfg, 1, SEED, CHORUS_GPT_EXTERNAL, &g_m) != CHORUS_OK) {
    fprintf(stderr, "model: %s\n", chorus_train_last_error());
    rm_tree(g_dir);
    return 1;
  }
  g_np = chorus_gpt_num_params(g_m);
  RUN(three_ranges_round_trip);
  RUN(bad_saves_fail);
  RUN(one_range_wrapper);
  for (int k = 0; k < NR; k++) range_free(&g_r[k]);
  chorus_gpt_destroy(g_m);
  rm_tree(g_dir);
  return HARNESS_DONE();
}
