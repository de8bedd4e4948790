/*
 * ckpt_ranges.c - chorus__ckpt_save_ranges across ranks (run by chorusrun
 * with N >= 2): the layout in four ranges, each with its own AdamW and
 * step count, held unevenly (rank 0 none, the others two each at N = 3, out
 * of file order); every rank then loads a range of its own -- the whole
 * layout, one across two files, an empty one -- collectively and exactly.
 * A file no rank holds or two ranks hold, ranks that disagree on the
 * number of files, or bad ranges on one rank fail the save on every rank,
 * naming why, with nothing written; the communicator goes on working.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "chorus_train.h"
#include "harness.h"
#include "train/ckpt.h"
#include "ck_range.h"

static const chorus_gpt_config_t k_cfg = {37, 9, 3, 3, 15};
enum { SEED = 91, NF = 4 };

static chorus_comm_t g_comm;
static int g_rank, g_size;
static chorus_gpt_t *g_m;
static size_t g_np;
static char g_dir[512];

/* File f's range and its state: the same on every rank (seeded by f), so
 * each can check what another wrote. */
static range_t g_r[NF];

static void file_bounds(int f, size_t *lo, size_t *n) {
  const size_t cut[NF + 1] = {0, g_np / 5, g_np / 2 + 3, g_np - 101, g_np};
  *lo = cut[f], *n = cut[f + 1] - cut[f];
}

/* Rank 0 holds nothing; file f goes to rank 1 + f % (N - 1). */
static int holder(int f) {
  return 1 + f % (g_size - 1);
}

/* This rank's ranges, last file first. */
static int my_ranges(chorus__ck_range_t *cr) {
  int k = 0;
  for (int f = NF - 1; f >= 0; f--)
    if (holder(f) == g_rank)
      cr[k++] = (chorus__ck_range_t){g_r[f].opt, g_r[f].par, g_r[f].lo, g_r[f].n, f};
  return k;
}

TEST(ranges_over_ranks_round_trip) {
  chorus__ck_range_t cr[NF];
  const int nr = my_ranges(cr);
  ASSERT_EQ(chorus__ckpt_save_ranges(g_comm, g_m, nr, cr, NF, g_dir, 4, "xtra", 5, 2), CHORUS_OK);
  /* Rank 0: everything; the last rank: nothing (a standby); the others a
   * range across two files. */
  size_t lo = 0, n = g_np;
  if (g_rank == g_size - 1)
    n = 0;
  else if (g_rank > 0)
    lo = g_r[1 + (g_rank - 1) % (NF - 1)].lo - 17, n = 40;
  range_t got = {0};
  unsigned long long none = 0;
  ASSERT_EQ(range_make(&got, g_m, SEED, lo, n, 0, &none), 0);
  long step = -1;
  char x[16] = "";
  size_t xlen = 0;
  chorus_ckpt_info_t info = {0};
  chorus_result_t st = chorus__ckpt_load_range(g_comm, g_m, got.opt, got.par, lo, n, g_dir, &step,
                                               x, sizeof x, &xlen, &info);
  int same = st == CHORUS_OK && step == 4 && xlen == 5 && !strcmp(x, "xtra") && info.world == NF;
  int64_t want_t = 0;
  for (int f = 0; same && f < NF; f++) {
    const size_t a = lo > g_r[f].lo ? lo : g_r[f].lo;
    const size_t z = lo + n < g_r[f].lo + g_r[f].n ? lo + n : g_r[f].lo + g_r[f].n;
    if (a >= z) continue;
    same = !memcmp(got.par + (a - lo), g_r[f].par + (a - g_r[f].lo), (z - a) * sizeof(float));
    if (steps_of(g_r[f].opt) > want_t) want_t = steps_of(g_r[f].opt);
  }
  same = same && steps_of(got.opt) == want_t;
  if (!same)
    HARNESS_FAIL("rank %d: load of [%zu, %zu): %s, step %ld, t %lld (want %lld): %s", g_rank, lo,
                 lo + n, chorus_result_name(st), step, (long long)steps_of(got.opt),
                 (long long)want_t,
                 st == CHORUS_OK ? "contents differ" : chorus_train_last_error());
  range_free(&got);
}

/* A save that must fail on every rank, saying why (this rank's own reason
 * where it has one), leaving no checkpoint. */
static void expect_refused(int nr, const chorus__ck_range_t *cr, int files, long step,
                           const char *why) {
  chorus_result_t st =
      chorus__ckpt_save_ranges(g_comm, g_m, nr, cr, files, g_dir, step, "xtra", 5, 2);
  if (st == CHORUS_OK)
    HARNESS_FAIL("rank %d: save at step %ld succeeded (wanted: %s)", g_rank, step, why);
  else if (!strstr(chorus_train_last_error(), why))
    HARNESS_FAIL("rank %d: save at step %ld: \"%s\" does not say \"%s\"", g_rank, step,
                 chorus_train_last_error(), why);
  /* Rank 0 looks once every rank is done with it. */
  if (chorus_barrier(g_comm, NULL) != CHORUS_OK)
    HARNESS_FAIL("rank %d: barrier: %s", g_rank, chorus_comm_last_error(g_comm));
  char p[1024];
  snprintf(p, sizeof p, "%s/ckpt-%09ld", g_dir, step);
  if (g_rank == 0 && access(p, F_OK) == 0) HARNESS_FAIL("save at step %ld left %s", step, p);
}

TEST(bad_saves_fail_everywhere) {
  chorus__ck_range_t cr[NF + 1];
  int nr = my_ranges(cr);
  /* File 3's holder leaves it out. */
  expect_refused(holder(3) == g_rank ? nr - 1 : nr, holder(3) == g_rank ? cr + 1 : cr, NF, 11,
                 "1 file(s) held by no rank: 3 (of 4)");
  /* Rank 0 holds file 0 as well. */
  cr[nr] = (chorus__ck_range_t){g_r[0].opt, g_r[0].par, g_r[0].lo, g_r[0].n, 0};
  expect_refused(g_rank == 0 ? 1 : nr, g_rank == 0 ? cr + nr : cr, NF, 12,
                 "1 file(s) held by more than one rank: 0 (of 4)");
  /* Rank 0 counts five files. */
  expect_refused(nr, cr, g_rank == 0 ? NF + 1 : NF, 13,
                 "the ranks disagree on the number of files (4 to 5)");
  /* The last rank names a file the checkpoint has not. */
  if (g_rank == g_size - 1) cr[0].file = NF + 2;
  expect_refused(nr, cr, NF, 14,
                 g_rank == g_size - 1 ? "is not one of the checkpoint's 4"
                                      : "another rank's arguments are bad (see its output)");
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (chorus_comm_init_env(&g_comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(g_comm);
  g_size = chorus_comm_size(g_comm);
  if (g_size < 2) {
    fprintf(stderr, "ckpt_ranges: needs 2 ranks or more\n");
    return 1;
  }
  /* Rank 0's temporary directory, for every rank. */
  if (g_rank == 0) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/chorus-ckpt-ranges-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) g_dir[0] = '\0';
  }
  if (chorus_broadcast(g_comm, g_dir, sizeof g_dir, CHORUS_UINT8, 0, NULL) != CHORUS_OK ||
      !g_dir[0]) {
    fprintf(stderr, "rank %d: no temporary directory\n", g_rank);
    return 1;
  }
  int made = chorus_gpt_create_ex(&k_cfg, 1, SEED, CHORUS_GPT_EXTERNAL, &g_m) == CHORUS_OK;
  if (made) g_np = chorus_gpt_num_params(g_m);
  for (int f = 0; made && f < NF; f++) {
    size_t lo, n;
    file_bounds(f, &lo, &n);
    unsigned long long rng = 1000 + (unsigned long long)f;
    made = range_make(&g_r[f], g_m, SEED, lo, n, 2 + 3 * f, &rng) == 0;
  }
  if (!made) {
    fprintf(stderr, "rank %d: model or ranges: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  RUN(ranges_over_ranks_round_trip);
  RUN(bad_saves_fail_everywhere);
  for (int f = 0; f < NF; f++) range_free(&g_r[f]);
  chorus_gpt_destroy(g_m);
  chorus_barrier(g_comm, NULL);
  if (g_rank == 0) rm_tree(g_dir);
  chorus_comm_destroy(g_comm);
  return HARNESS_DONE();
}
