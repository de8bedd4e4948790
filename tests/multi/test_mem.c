/*
 * test_mem.c - chorus_mem_alloc buffers in collectives (run by chorusrun at
 * several world sizes): all_reduce with every rank's input and output in
 * shared memory (the zero-copy path), in place and out of place, at odd
 * offsets and counts; the same with one rank on ordinary memory (the
 * staged path must take over on every rank); use from a subgroup; and the
 * API's edge cases.  Every rank checks every element.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"

static int g_rank, g_size, g_fail, g_pass;

#define CHECK(cond, ...)                                                        \
  do {                                                                         \
    if (cond) {                                                                \
      g_pass++;                                                                \
    } else {                                                                   \
      g_fail++;                                                                \
      fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__);    \
      fprintf(stderr, __VA_ARGS__);                                            \
      fputc('\n', stderr);                                                     \
    }                                                                          \
  } while (0)

/* Input element i of rank r; small integers, so float sums are exact. */
static float value(int r, size_t i) { return (float)((r + 1) * 3 + (int)(i % 97)); }

static float expected(size_t i, int n, chorus_op_t op) {
  float sum = 0, mx = value(0, i);
  for (int r = 0; r < n; r++) {
    sum += value(r, i);
    if (value(r, i) > mx) mx = value(r, i);
  }
  return op == CHORUS_MAX ? mx : op == CHORUS_AVG ? sum / (float)n : sum;
}

/* all_reduce of count floats from in to out (in == out: in place) on comm
 * of n ranks whose rank is me; checks every element. */
static void run(chorus_comm_t comm, float *in, float *out, size_t count, chorus_op_t op,
                const char *what) {
  int me = chorus_comm_rank(comm), n = chorus_comm_size(comm);
  for (size_t i = 0; i < count; i++) in[i] = value(me, i);
  if (out != in)
    for (size_t i = 0; i < count; i++) out[i] = -1;
  chorus_result_t st = chorus_all_reduce(comm, in, out, count, CHORUS_FLOAT32, op, NULL);
  CHECK(st == CHORUS_OK, "%s: all_reduce returned %s: %s", what, chorus_result_name(st),
        chorus_comm_last_error(comm));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < count; i++) {
    float e = expected(i, n, op);
    float diff = out[i] - e;
    if (diff > 1e-4f * e || diff < -1e-4f * e) {
      if (!bad) first = i;
      bad++;
    }
  }
  CHECK(bad == 0, "%s: %zu of %zu elements wrong (first: [%zu] = %g, want %g)", what, bad, count,
        first, bad ? out[first] : 0.0, bad ? expected(first, n, op) : 0.0);
}

/* Other collectives on shared buffers: the sources (root's for broadcast and
 * scatter, everyone's for the rest) are read in place by the others.
 * shared: this rank's buffers from chorus_mem_alloc (else malloc). */
static void others(chorus_comm_t comm, float *sh_in, float *sh_out, float *pl_in, float *pl_out,
                   size_t count, const char *tag) {
  int me = chorus_comm_rank(comm), n = chorus_comm_size(comm);
  char what[200];
  chorus_result_t st;
  size_t bad;
  /* all_gather */
  for (size_t i = 0; i < count; i++) sh_in[i] = value(me, i);
  for (size_t i = 0; i < count * (size_t)n; i++) sh_out[i] = -1;
  st = chorus_all_gather(comm, sh_in, sh_out, count, CHORUS_FLOAT32, NULL);
  bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++) bad += sh_out[(size_t)r * count + i] != value(r, i);
  snprintf(what, sizeof what, "%s all_gather count=%zu", tag, count);
  CHECK(st == CHORUS_OK && bad == 0, "%s: %s, %zu wrong", what, chorus_result_name(st), bad);
  /* all_to_all: block b of rank r holds value(r * n + b, i) */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) sh_in[(size_t)b * count + i] = value(me * n + b, i);
  st = chorus_all_to_all(comm, sh_in, sh_out, count, CHORUS_FLOAT32, NULL);
  bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++) bad += sh_out[(size_t)r * count + i] != value(r * n + me, i);
  snprintf(what, sizeof what, "%s all_to_all count=%zu", tag, count);
  CHECK(st == CHORUS_OK && bad == 0, "%s: %s, %zu wrong", what, chorus_result_name(st), bad);
  /* reduce_scatter (sum): block b of every rank r is value(r, i) + b */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) sh_in[(size_t)b * count + i] = value(me, i) + (float)b;
  st = chorus_reduce_scatter(comm, sh_in, sh_out, count, CHORUS_FLOAT32, CHORUS_SUM, NULL);
  bad = 0;
  for (size_t i = 0; i < count; i++)
    bad += sh_out[i] != expected(i, n, CHORUS_SUM) + (float)(me * n);
  snprintf(what, sizeof what, "%s reduce_scatter count=%zu", tag, count);
  CHECK(st == CHORUS_OK && bad == 0, "%s: %s, %zu wrong", what, chorus_result_name(st), bad);
  /* broadcast and scatter from every root; non-roots use ordinary memory
   * for their outputs half of the time. */
  for (int root = 0; root < n; root++) {
    float *buf = me == root || root % 2 ? sh_out : pl_out;
    for (size_t i = 0; i < count; i++) buf[i] = me == root ? value(root, i) : -1;
    st = chorus_broadcast(comm, buf, count, CHORUS_FLOAT32, root, NULL);
    bad = 0;
    for (size_t i = 0; i < count; i++) bad += buf[i] != value(root, i);
    snprintf(what, sizeof what, "%s broadcast root=%d count=%zu", tag, root, count);
    CHECK(st == CHORUS_OK && bad == 0, "%s: %s, %zu wrong", what, chorus_result_name(st), bad);
    if (me == root)
      for (int b = 0; b < n; b++)
        for (size_t i = 0; i < count; i++) sh_in[(size_t)b * count + i] = value(b + 7, i);
    float *dst = root % 2 ? pl_out : sh_out;
    st = chorus_scatter(comm, sh_in, dst, count, CHORUS_FLOAT32, root, NULL);
    bad = 0;
    for (size_t i = 0; i < count; i++) bad += dst[i] != value(me + 7, i);
    snprintf(what, sizeof what, "%s scatter root=%d count=%zu", tag, root, count);
    CHECK(st == CHORUS_OK && bad == 0, "%s: %s, %zu wrong", what, chorus_result_name(st), bad);
  }
  (void)pl_in;
}

/* Per-rank in-place choices on shared and ordinary memory: reduce_scatter
 * and all_to_all where the ranks in `inplace` (a bit per rank) pass one
 * buffer and the others two.  An in-place reduce_scatter on shared memory
 * once combined into its own input block before reading it (wrong data on
 * ranks >= 2), and an all_to_all whose ranks disagreed about in place ran
 * two protocols with CHORUS_SHM_CMA_MIN set (the CTest runs this both
 * ways). */
static void in_place_mix(chorus_comm_t comm, float *in, float *out, size_t count, unsigned inplace,
                         const char *tag) {
  int me = chorus_comm_rank(comm), n = chorus_comm_size(comm);
  int ip = (inplace >> me) & 1;
  char what[200];
  size_t bad = 0, total = count * (size_t)n;
  /* reduce_scatter (sum): block b of rank r is value(r, i) + b */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) in[(size_t)b * count + i] = value(me, i) + (float)b;
  float *rs_out = ip ? in + (size_t)me * count : out;
  chorus_result_t st =
      chorus_reduce_scatter(comm, in, rs_out, count, CHORUS_FLOAT32, CHORUS_SUM, NULL);
  for (size_t i = 0; i < count; i++) bad += rs_out[i] != expected(i, n, CHORUS_SUM) + (float)(me * n);
  snprintf(what, sizeof what, "%s reduce_scatter count=%zu in-place mask=%#x", tag, count, inplace);
  CHECK(st == CHORUS_OK && bad == 0, "%s: %s (%s), %zu of %zu wrong", what, chorus_result_name(st),
        chorus_comm_last_error(comm), bad, count);
  /* all_to_all: block b of rank r holds value(r * n + b, i) */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) in[(size_t)b * count + i] = value(me * n + b, i);
  float *a_out = ip ? in : out;
  st = chorus_all_to_all(comm, in, a_out, count, CHORUS_FLOAT32, NULL);
  bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++) bad += a_out[(size_t)r * count + i] != value(r * n + me, i);
  snprintf(what, sizeof what, "%s all_to_all count=%zu in-place mask=%#x", tag, count, inplace);
  CHECK(st == CHORUS_OK && bad == 0, "%s: %s (%s), %zu of %zu wrong", what, chorus_result_name(st),
        chorus_comm_last_error(comm), bad, total);
}

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(comm);
  g_size = chorus_comm_size(comm);
  static const size_t counts[] = {1, 1000, (1u << 20) / 4 + 7, (3u << 20) / 4 + 13};
  static const chorus_op_t ops[] = {CHORUS_SUM, CHORUS_MAX, CHORUS_AVG};
  size_t maxc = (3u << 20) / 4 + 13;
  char what[200];

  /* 1. Everyone's buffers from chorus_mem_alloc, at odd offsets. */
  void *a = NULL, *b = NULL;
  CHECK(chorus_mem_alloc(comm, (maxc + 16) * sizeof(float), &a) == CHORUS_OK && a, "alloc a");
  CHECK(chorus_mem_alloc(comm, (maxc + 16) * sizeof(float), &b) == CHORUS_OK && b, "alloc b");
  if (!a || !b) return 1;
  float *in = (float *)a + 3, *out = (float *)b + 5;
  for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
    for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++) {
      snprintf(what, sizeof what, "shared out-of-place count=%zu op=%s", counts[k],
               chorus_op_name(ops[o]));
      run(comm, in, out, counts[k], ops[o], what);
      snprintf(what, sizeof what, "shared in-place count=%zu op=%s", counts[k],
               chorus_op_name(ops[o]));
      run(comm, out, out, counts[k], ops[o], what);
    }

  /* 2. Rank 0 on ordinary memory: everyone must take the staged path. */
  float *plain = malloc((maxc + 16) * sizeof(float));
  float *pin = g_rank == 0 ? plain : in;
  snprintf(what, sizeof what, "mixed (rank 0 malloc) count=%zu", maxc);
  run(comm, pin, out, maxc, CHORUS_SUM, what);
  run(comm, out, out, maxc, CHORUS_SUM, "mixed in-place (rank 0's output is malloc)");

  /* 2b. The other collectives, all shared, then with rank 0's inputs in
   * ordinary memory (staged everywhere, or zero copy from the others). */
  {
    size_t oc = (1u << 20) / 4 / (size_t)g_size + 5; /* total fits the allocations */
    others(comm, in, out, plain, plain + maxc / 2, oc, "shared");
    others(comm, g_rank == 0 ? plain : in, out, plain, plain + maxc / 2, oc, "rank 0 malloc");
    others(comm, in, out, plain, plain + maxc / 2, 100, "shared small");
    /* Every rank in place, none, only rank 1, all but rank 1; big enough
     * (>= 64 KiB in all) for the zero-copy and single-copy paths. */
    static const unsigned masks[] = {~0u, 0u, 2u, ~2u};
    size_t ic = (1u << 20) / 4 / (size_t)g_size + 5;
    for (size_t m = 0; m < sizeof masks / sizeof masks[0]; m++) {
      in_place_mix(comm, in, out, ic, masks[m], "shared");
      in_place_mix(comm, plain, plain + maxc / 2, ic, masks[m], "malloc");
      in_place_mix(comm, in, out, 1000, masks[m], "shared 1000");
    }
  }

  /* 3. The world's allocations from a subgroup (odd ranks, even ranks). */
  chorus_comm_t sub = NULL;
  CHECK(chorus_comm_split(comm, g_rank % 2, g_rank, &sub) == CHORUS_OK && sub, "split");
  if (sub) {
    run(sub, in, out, counts[3], CHORUS_SUM, "subgroup shared out-of-place");
    chorus_comm_destroy(sub);
  }

  /* 4. The API's edges. */
  void *z = (void *)1;
  CHECK(chorus_mem_alloc(comm, 0, &z) == CHORUS_OK && z == NULL, "size 0 gives NULL");
  CHECK(chorus_mem_free(comm, NULL) == CHORUS_OK, "free(NULL)");
  CHECK(chorus_mem_free(comm, plain) == CHORUS_ERR_INVALID_ARG, "free of malloc memory refused");
  CHECK(chorus_mem_alloc(NULL, 8, &z) == CHORUS_ERR_INVALID_ARG, "NULL comm refused");
  free(plain);
  /* Everyone is done with the buffers before anyone frees them. */
  chorus_barrier(comm, NULL);
  CHECK(chorus_mem_free(comm, a) == CHORUS_OK, "free a");
  CHECK(chorus_mem_free(comm, b) == CHORUS_OK, "free b");

  long counts2[2] = {g_pass, g_fail}, total[2] = {0, 0};
  if (chorus_all_reduce(comm, counts2, total, 2, CHORUS_INT64, CHORUS_SUM, NULL) != CHORUS_OK)
    total[1]++;
  if (g_rank == 0) printf("%ld passed, %ld failed\n", total[0], total[1]);
  chorus_comm_destroy(comm);
  return total[1] ? 1 : 0;
}
