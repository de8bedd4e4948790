/*
 * demo.c - every collective of chorus once, on small arrays, checked.
 *
 * The "main job" until the training runtime exists: run it under chorusrun
 * with any number of ranks (1 or more) to see each collective's inputs and
 * results, one line per collective and rank.  Every rank checks its results
 * against values computed locally; a wrong result is marked WRONG, and at the
 * end the ranks agree (one more all_reduce) on whether everything was right.
 * Exit status: 0 if all results were correct on every rank, 1 otherwise or
 * when a call fails (the reason from chorus_comm_last_error is printed).
 *
 * Collectives, in order: broadcast, reduce, all_reduce (sum, max, avg),
 * scatter, gather, all_gather, all_gather_list, reduce_scatter, all_to_all,
 * all_to_allv, barrier, a send/recv ring (skipped on 1 rank: there is no
 * other rank to talk to), gather_bytes, all_gather_bytes, an async
 * all_reduce completed with chorus_work_wait, and chorus_comm_split into
 * even and odd ranks with an all_reduce on each half.  Arrays longer than
 * 12 elements are printed abridged ("...").
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/demo
 * Expected output with 4 ranks (lines of different ranks interleave in any
 * order; each rank's own lines come in this order):
 *   [rank0]:broadcast(root 0): [10, 11, 12] -> [10, 11, 12]
 *   [rank0]:reduce(sum, root 3): [0, 1] -> (result on rank 3)
 *   [rank0]:all_reduce(sum): [1] -> [10]
 *   [rank0]:all_reduce(max): [0, 0] -> [3, 0]
 *   [rank0]:all_reduce(avg): [0, 1] -> [3, 1]
 *   [rank0]:scatter(root 0): [1, 2, 3, 4, 5, 6, 7, 8] -> [1, 2]
 *   [rank0]:gather(root 0): [0] -> [0, 1, 4, 9]
 *   [rank0]:all_gather: [100] -> [100, 101, 102, 103]
 *   [rank0]:all_gather_list: [0, 0] -> [[0, 0], [1, -1], [2, -2], [3, -3]]
 *   [rank0]:reduce_scatter(sum): [0, 1, 2, 3] -> [6]
 *   [rank0]:all_to_all: [0, 1, 2, 3] -> [0, 100, 200, 300]
 *   [rank0]:all_to_allv: sendcounts [0, 1, 2, 0] [1, 2, 2] -> recvcounts [0, 1, 2, 0] [10, 20, 20]
 *   [rank0]:barrier: ok
 *   [rank0]:send/recv ring: sent [0] to rank 1, received [33] from rank 3
 *   [rank0]:gather_bytes(root 0): "a" -> ["a", "bb", "ccc", "dddd"]
 *   [rank0]:all_gather_bytes: [] -> [[], [1], [2, 2], [3, 3, 3]]
 *   [rank0]:all_reduce(sum, async): [0, 1] -> [6, 4]
 *   [rank0]:split(even/odd) rank 0/2 of color 0, all_reduce(sum): [0] -> [2]
 *   [rank0]:demo: all 18 collectives correct on 4 ranks
 *   [rank1]:broadcast(root 0): [-1, -1, -1] -> [10, 11, 12]
 *   [rank1]:reduce(sum, root 3): [1, 2] -> (result on rank 3)
 *   [rank1]:all_reduce(sum): [2] -> [10]
 *   [rank1]:all_reduce(max): [1, -1] -> [3, 0]
 *   [rank1]:all_reduce(avg): [2, 1] -> [3, 1]
 *   [rank1]:scatter(root 0): - -> [3, 4]
 *   [rank1]:gather(root 0): [1] -> (result on rank 0)
 *   [rank1]:all_gather: [101] -> [100, 101, 102, 103]
 *   [rank1]:all_gather_list: [1, -1] -> [[0, 0], [1, -1], [2, -2], [3, -3]]
 *   [rank1]:reduce_scatter(sum): [1, 2, 3, 4] -> [10]
 *   [rank1]:all_to_all: [100, 101, 102, 103] -> [1, 101, 201, 301]
 *   [rank1]:all_to_allv: sendcounts [1, 2, 0, 1] [10, 11, 11, 13] -> recvcounts [1, 2, 0, 1] [1, 11, 11, 31]
 *   [rank1]:barrier: ok
 *   [rank1]:send/recv ring: sent [11] to rank 2, received [0] from rank 0
 *   [rank1]:gather_bytes(root 0): "bb" -> (result on rank 0)
 *   [rank1]:all_gather_bytes: [1] -> [[], [1], [2, 2], [3, 3, 3]]
 *   [rank1]:all_reduce(sum, async): [1, 1] -> [6, 4]
 *   [rank1]:split(even/odd) rank 0/2 of color 1, all_reduce(sum): [1] -> [4]
 *   [rank2]:broadcast(root 0): [-1, -1, -1] -> [10, 11, 12]
 *   [rank2]:reduce(sum, root 3): [2, 3] -> (result on rank 3)
 *   [rank2]:all_reduce(sum): [3] -> [10]
 *   [rank2]:all_reduce(max): [2, -2] -> [3, 0]
 *   [rank2]:all_reduce(avg): [4, 1] -> [3, 1]
 *   [rank2]:scatter(root 0): - -> [5, 6]
 *   [rank2]:gather(root 0): [4] -> (result on rank 0)
 *   [rank2]:all_gather: [102] -> [100, 101, 102, 103]
 *   [rank2]:all_gather_list: [2, -2] -> [[0, 0], [1, -1], [2, -2], [3, -3]]
 *   [rank2]:reduce_scatter(sum): [2, 3, 4, 5] -> [14]
 *   [rank2]:all_to_all: [200, 201, 202, 203] -> [2, 102, 202, 302]
 *   [rank2]:all_to_allv: sendcounts [2, 0, 1, 2] [20, 20, 22, 23, 23] -> recvcounts [2, 0, 1, 2] [2, 2, 22, 32, 32]
 *   [rank2]:barrier: ok
 *   [rank2]:send/recv ring: sent [22] to rank 3, received [11] from rank 1
 *   [rank2]:gather_bytes(root 0): "ccc" -> (result on rank 0)
 *   [rank2]:all_gather_bytes: [2, 2] -> [[], [1], [2, 2], [3, 3, 3]]
 *   [rank2]:all_reduce(sum, async): [2, 1] -> [6, 4]
 *   [rank2]:split(even/odd) rank 1/2 of color 0, all_reduce(sum): [2] -> [2]
 *   [rank3]:broadcast(root 0): [-1, -1, -1] -> [10, 11, 12]
 *   [rank3]:reduce(sum, root 3): [3, 4] -> [6, 10]
 *   [rank3]:all_reduce(sum): [4] -> [10]
 *   [rank3]:all_reduce(max): [3, -3] -> [3, 0]
 *   [rank3]:all_reduce(avg): [6, 1] -> [3, 1]
 *   [rank3]:scatter(root 0): - -> [7, 8]
 *   [rank3]:gather(root 0): [9] -> (result on rank 0)
 *   [rank3]:all_gather: [103] -> [100, 101, 102, 103]
 *   [rank3]:all_gather_list: [3, -3] -> [[0, 0], [1, -1], [2, -2], [3, -3]]
 *   [rank3]:reduce_scatter(sum): [3, 4, 5, 6] -> [18]
 *   [rank3]:all_to_all: [300, 301, 302, 303] -> [3, 103, 203, 303]
 *   [rank3]:all_to_allv: sendcounts [0, 1, 2, 0] [31, 32, 32] -> recvcounts [0, 1, 2, 0] [13, 23, 23]
 *   [rank3]:barrier: ok
 *   [rank3]:send/recv ring: sent [33] to rank 0, received [22] from rank 2
 *   [rank3]:gather_bytes(root 0): "dddd" -> (result on rank 0)
 *   [rank3]:all_gather_bytes: [3, 3, 3] -> [[], [1], [2, 2], [3, 3, 3]]
 *   [rank3]:all_reduce(sum, async): [3, 1] -> [6, 4]
 *   [rank3]:split(even/odd) rank 1/2 of color 1, all_reduce(sum): [3] -> [4]
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"

#define MAX_SHOWN 12 /* array elements printed before "..." */

static chorus_comm_t g_comm;
static int g_rank, g_size;
static int g_ncoll;  /* collectives run */
static int g_nwrong; /* of which gave a wrong result on this rank */

/* ------------------------------------------------------------- helpers */

/* Allocates zeroed memory or gives up: the peers are told (abort) so that
 * they fail at once instead of waiting for this rank until the timeout. */
static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p) {
    fprintf(stderr, "rank %d: out of memory\n", g_rank);
    chorus_comm_abort(g_comm);
    chorus_comm_destroy(g_comm);
    exit(1);
  }
  return p;
}

/* One output line, built piece by piece and printed at once. */
typedef struct {
  char s[4096];
  size_t n;
} line_t;

static void addf(line_t *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void addf(line_t *l, const char *fmt, ...) {
  if (l->n >= sizeof l->s - 1) return;
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(l->s + l->n, sizeof l->s - l->n, fmt, ap);
  va_end(ap);
  if (k > 0) l->n += (size_t)k < sizeof l->s - l->n ? (size_t)k : sizeof l->s - 1 - l->n;
}

static void add_i32s(line_t *l, const int32_t *a, size_t n) {
  addf(l, "[");
  for (size_t i = 0; i < n && i < MAX_SHOWN; i++) addf(l, "%s%d", i ? ", " : "", (int)a[i]);
  addf(l, "%s]", n > MAX_SHOWN ? ", ..." : "");
}

static void add_f32s(line_t *l, const float *a, size_t n) {
  addf(l, "[");
  for (size_t i = 0; i < n && i < MAX_SHOWN; i++) addf(l, "%s%g", i ? ", " : "", (double)a[i]);
  addf(l, "%s]", n > MAX_SHOWN ? ", ..." : "");
}

static void add_sizes(line_t *l, const size_t *a, size_t n) {
  addf(l, "[");
  for (size_t i = 0; i < n && i < MAX_SHOWN; i++) addf(l, "%s%zu", i ? ", " : "", a[i]);
  addf(l, "%s]", n > MAX_SHOWN ? ", ..." : "");
}

static int same_i32(const int32_t *got, const int32_t *want, size_t n) {
  return n == 0 || memcmp(got, want, n * sizeof *got) == 0;
}

/* Prints the collective's line and counts it; ok == 0 marks it WRONG. */
static int report(const line_t *l, int ok) {
  g_ncoll++;
  if (!ok) g_nwrong++;
  printf("%s%s\n", l->s, ok ? "" : "  <-- WRONG");
  if (!ok) fprintf(stderr, "rank %d: WRONG result: %s\n", g_rank, l->s);
  return 0;
}

/* Reports a failed call; the caller then stops the demo. */
static int failed(const char *what, chorus_result_t rc, const char *why) {
  fprintf(stderr, "rank %d: %s failed: %s: %s\n", g_rank, what, chorus_result_name(rc), why);
  return -1;
}

#define CALL(what, expr)                                                       \
  do {                                                                         \
    chorus_result_t rc_ = (expr);                                              \
    if (rc_ != CHORUS_OK) return failed(what, rc_, chorus_comm_last_error(g_comm)); \
  } while (0)

/* -------------------------------------------------------- the collectives
 * Each returns 0 when the call succeeded (whether or not the result was
 * right, which report() records) and -1 when it failed. */

static int demo_broadcast(void) {
  int32_t buf[3], want[3] = {10, 11, 12};
  for (int i = 0; i < 3; i++) buf[i] = g_rank == 0 ? want[i] : -1;
  line_t l = {.n = 0};
  addf(&l, "broadcast(root 0): ");
  add_i32s(&l, buf, 3);
  CALL("broadcast", chorus_broadcast(g_comm, buf, 3, CHORUS_INT32, 0, NULL));
  addf(&l, " -> ");
  add_i32s(&l, buf, 3);
  return report(&l, same_i32(buf, want, 3));
}

static int demo_reduce(void) {
  int root = g_size - 1;
  int32_t in[2] = {g_rank, g_rank + 1}, out[2] = {-1, -1};
  int32_t want[2] = {g_size * (g_size - 1) / 2, g_size * (g_size + 1) / 2};
  line_t l = {.n = 0};
  addf(&l, "reduce(sum, root %d): ", root);
  add_i32s(&l, in, 2);
  CALL("reduce", chorus_reduce(g_comm, in, g_rank == root ? out : NULL, 2, CHORUS_INT32,
                               CHORUS_SUM, root, NULL));
  if (g_rank != root) {
    addf(&l, " -> (result on rank %d)", root);
    return report(&l, 1);
  }
  addf(&l, " -> ");
  add_i32s(&l, out, 2);
  return report(&l, same_i32(out, want, 2));
}

static int demo_all_reduce_sum(void) {
  int32_t buf[1] = {g_rank + 1}, want[1] = {g_size * (g_size + 1) / 2};
  line_t l = {.n = 0};
  addf(&l, "all_reduce(sum): ");
  add_i32s(&l, buf, 1);
  CALL("all_reduce(sum)", chorus_all_reduce(g_comm, buf, buf, 1, CHORUS_INT32, CHORUS_SUM, NULL));
  addf(&l, " -> ");
  add_i32s(&l, buf, 1);
  return report(&l, same_i32(buf, want, 1));
}

static int demo_all_reduce_max(void) {
  int32_t in[2] = {g_rank, -g_rank}, out[2], want[2] = {g_size - 1, 0};
  line_t l = {.n = 0};
  addf(&l, "all_reduce(max): ");
  add_i32s(&l, in, 2);
  CALL("all_reduce(max)", chorus_all_reduce(g_comm, in, out, 2, CHORUS_INT32, CHORUS_MAX, NULL));
  addf(&l, " -> ");
  add_i32s(&l, out, 2);
  return report(&l, same_i32(out, want, 2));
}

static int demo_all_reduce_avg(void) {
  /* The mean of 0, 2, ..., 2(size-1) is size-1: exact in float32. */
  float in[2] = {2.0f * (float)g_rank, 1.0f}, out[2];
  line_t l = {.n = 0};
  addf(&l, "all_reduce(avg): ");
  add_f32s(&l, in, 2);
  CALL("all_reduce(avg)",
       chorus_all_reduce(g_comm, in, out, 2, CHORUS_FLOAT32, CHORUS_AVG, NULL));
  addf(&l, " -> ");
  add_f32s(&l, out, 2);
  return report(&l, out[0] == (float)(g_size - 1) && out[1] == 1.0f);
}

static int demo_scatter(void) {
  size_t n = 2 * (size_t)g_size;
  int32_t *in = xcalloc(n, sizeof *in), out[2] = {-1, -1};
  int32_t want[2] = {2 * g_rank + 1, 2 * g_rank + 2};
  for (size_t i = 0; i < n; i++) in[i] = (int32_t)i + 1;
  line_t l = {.n = 0};
  addf(&l, "scatter(root 0): ");
  if (g_rank == 0) add_i32s(&l, in, n);
  else addf(&l, "-");
  chorus_result_t rc = chorus_scatter(g_comm, g_rank == 0 ? in : NULL, out, 2, CHORUS_INT32, 0,
                                      NULL);
  free(in);
  if (rc != CHORUS_OK) return failed("scatter", rc, chorus_comm_last_error(g_comm));
  addf(&l, " -> ");
  add_i32s(&l, out, 2);
  return report(&l, same_i32(out, want, 2));
}

static int demo_gather(void) {
  int32_t in[1] = {g_rank * g_rank};
  int32_t *out = g_rank == 0 ? xcalloc((size_t)g_size, sizeof *out) : NULL;
  line_t l = {.n = 0};
  addf(&l, "gather(root 0): ");
  add_i32s(&l, in, 1);
  chorus_result_t rc = chorus_gather(g_comm, in, out, 1, CHORUS_INT32, 0, NULL);
  if (rc != CHORUS_OK) {
    free(out);
    return failed("gather", rc, chorus_comm_last_error(g_comm));
  }
  int ok = 1;
  if (g_rank == 0) {
    for (int r = 0; r < g_size; r++) ok &= out[r] == r * r;
    addf(&l, " -> ");
    add_i32s(&l, out, (size_t)g_size);
  } else {
    addf(&l, " -> (result on rank 0)");
  }
  free(out);
  return report(&l, ok);
}

static int demo_all_gather(void) {
  int32_t in[1] = {100 + g_rank};
  int32_t *out = xcalloc((size_t)g_size, sizeof *out);
  line_t l = {.n = 0};
  addf(&l, "all_gather: ");
  add_i32s(&l, in, 1);
  chorus_result_t rc = chorus_all_gather(g_comm, in, out, 1, CHORUS_INT32, NULL);
  if (rc != CHORUS_OK) {
    free(out);
    return failed("all_gather", rc, chorus_comm_last_error(g_comm));
  }
  int ok = 1;
  for (int r = 0; r < g_size; r++) ok &= out[r] == 100 + r;
  addf(&l, " -> ");
  add_i32s(&l, out, (size_t)g_size);
  free(out);
  return report(&l, ok);
}

static int demo_all_gather_list(void) {
  int32_t in[2] = {g_rank, -g_rank};
  /* Separate buffers, one per rank, like torch's tensor_list. */
  int32_t **bufs = xcalloc((size_t)g_size, sizeof *bufs);
  for (int r = 0; r < g_size; r++) bufs[r] = xcalloc(2, sizeof **bufs);
  line_t l = {.n = 0};
  addf(&l, "all_gather_list: ");
  add_i32s(&l, in, 2);
  chorus_result_t rc =
      chorus_all_gather_list(g_comm, in, (void *const *)bufs, 2, CHORUS_INT32, NULL);
  int ok = 1;
  if (rc == CHORUS_OK) {
    addf(&l, " -> [");
    for (int r = 0; r < g_size; r++) {
      int32_t want[2] = {r, -r};
      ok &= same_i32(bufs[r], want, 2);
      if (r < MAX_SHOWN) {
        addf(&l, "%s", r ? ", " : "");
        add_i32s(&l, bufs[r], 2);
      }
    }
    addf(&l, "%s]", g_size > MAX_SHOWN ? ", ..." : "");
  }
  for (int r = 0; r < g_size; r++) free(bufs[r]);
  free(bufs);
  if (rc != CHORUS_OK) return failed("all_gather_list", rc, chorus_comm_last_error(g_comm));
  return report(&l, ok);
}

static int demo_reduce_scatter(void) {
  /* Block j of rank r holds r + j; rank j receives sum_r (r + j). */
  int32_t *in = xcalloc((size_t)g_size, sizeof *in), out[1] = {-1};
  for (int j = 0; j < g_size; j++) in[j] = g_rank + j;
  int32_t want[1] = {g_size * (g_size - 1) / 2 + g_size * g_rank};
  line_t l = {.n = 0};
  addf(&l, "reduce_scatter(sum): ");
  add_i32s(&l, in, (size_t)g_size);
  chorus_result_t rc = chorus_reduce_scatter(g_comm, in, out, 1, CHORUS_INT32, CHORUS_SUM, NULL);
  free(in);
  if (rc != CHORUS_OK) return failed("reduce_scatter", rc, chorus_comm_last_error(g_comm));
  addf(&l, " -> ");
  add_i32s(&l, out, 1);
  return report(&l, same_i32(out, want, 1));
}

static int demo_all_to_all(void) {
  /* Rank i sends 100*i + j to rank j, which finds it in its block i. */
  int32_t *in = xcalloc((size_t)g_size, sizeof *in), *out = xcalloc((size_t)g_size, sizeof *out);
  for (int j = 0; j < g_size; j++) in[j] = 100 * g_rank + j;
  line_t l = {.n = 0};
  addf(&l, "all_to_all: ");
  add_i32s(&l, in, (size_t)g_size);
  chorus_result_t rc = chorus_all_to_all(g_comm, in, out, 1, CHORUS_INT32, NULL);
  int ok = 1;
  if (rc == CHORUS_OK) {
    for (int i = 0; i < g_size; i++) ok &= out[i] == 100 * i + g_rank;
    addf(&l, " -> ");
    add_i32s(&l, out, (size_t)g_size);
  }
  free(in);
  free(out);
  if (rc != CHORUS_OK) return failed("all_to_all", rc, chorus_comm_last_error(g_comm));
  return report(&l, ok);
}

/* all_to_allv: rank i sends (i + j) % 3 elements (zero included), each
 * 10*i + j, to rank j. */
static size_t v_count(int i, int j) { return (size_t)((i + j) % 3); }

static int demo_all_to_allv(void) {
  size_t n = (size_t)g_size;
  size_t *sc = xcalloc(n, sizeof *sc), *sd = xcalloc(n, sizeof *sd);
  size_t *rc_ = xcalloc(n, sizeof *rc_), *rd = xcalloc(n, sizeof *rd);
  size_t stotal = 0, rtotal = 0;
  for (int j = 0; j < g_size; j++) {
    sc[j] = v_count(g_rank, j);
    sd[j] = stotal;
    stotal += sc[j];
    rc_[j] = v_count(j, g_rank);
    rd[j] = rtotal;
    rtotal += rc_[j];
  }
  int32_t *in = xcalloc(stotal, sizeof *in), *out = xcalloc(rtotal, sizeof *out);
  int32_t *want = xcalloc(rtotal, sizeof *want);
  for (int j = 0; j < g_size; j++) {
    for (size_t k = 0; k < sc[j]; k++) in[sd[j] + k] = 10 * g_rank + j;
    for (size_t k = 0; k < rc_[j]; k++) want[rd[j] + k] = 10 * j + g_rank;
  }
  line_t l = {.n = 0};
  addf(&l, "all_to_allv: sendcounts ");
  add_sizes(&l, sc, n);
  addf(&l, " ");
  add_i32s(&l, in, stotal);
  chorus_result_t rc =
      chorus_all_to_allv(g_comm, in, sc, sd, out, rc_, rd, CHORUS_INT32, NULL);
  int ok = 0;
  if (rc == CHORUS_OK) {
    ok = same_i32(out, want, rtotal);
    addf(&l, " -> recvcounts ");
    add_sizes(&l, rc_, n);
    addf(&l, " ");
    add_i32s(&l, out, rtotal);
  }
  free(sc);
  free(sd);
  free(rc_);
  free(rd);
  free(in);
  free(out);
  free(want);
  if (rc != CHORUS_OK) return failed("all_to_allv", rc, chorus_comm_last_error(g_comm));
  return report(&l, ok);
}

static int demo_barrier(void) {
  CALL("barrier", chorus_barrier(g_comm, NULL));
  line_t l = {.n = 0};
  addf(&l, "barrier: ok");
  return report(&l, 1);
}

static int demo_send_recv(void) {
  if (g_size < 2) {
    printf("send/recv ring: skipped (needs 2 ranks)\n");
    return 0;
  }
  /* Even ranks send first, odd ranks receive first, so every send has a
   * receiver (for any world size >= 2) without relying on buffering.
   * (Posting an async recv and then a blocking send does NOT work: calls on
   * one communicator run one at a time, in order, p2p included, so the send
   * would wait behind the recv.) */
  int next = (g_rank + 1) % g_size, prev = (g_rank + g_size - 1) % g_size;
  int32_t out[1] = {11 * g_rank}, in[1] = {-1}, want[1] = {11 * prev};
  if (g_rank % 2 == 0) {
    CALL("send", chorus_send(g_comm, out, 1, CHORUS_INT32, next, 7, NULL));
    CALL("recv", chorus_recv(g_comm, in, 1, CHORUS_INT32, prev, 7, NULL));
  } else {
    CALL("recv", chorus_recv(g_comm, in, 1, CHORUS_INT32, prev, 7, NULL));
    CALL("send", chorus_send(g_comm, out, 1, CHORUS_INT32, next, 7, NULL));
  }
  line_t l = {.n = 0};
  addf(&l, "send/recv ring: sent ");
  add_i32s(&l, out, 1);
  addf(&l, " to rank %d, received ", next);
  add_i32s(&l, in, 1);
  addf(&l, " from rank %d", prev);
  return report(&l, same_i32(in, want, 1));
}

static int demo_gather_bytes(void) {
  /* Rank r contributes r + 1 letters: "a", "bb", "ccc", ... */
  size_t len = (size_t)g_rank + 1;
  char *mine = xcalloc(len + 1, 1);
  memset(mine, 'a' + g_rank % 26, len);
  size_t *lens = xcalloc((size_t)g_size, sizeof *lens);
  void *all = NULL;
  line_t l = {.n = 0};
  addf(&l, "gather_bytes(root 0): \"%.*s%s\"", MAX_SHOWN, mine, len > MAX_SHOWN ? "..." : "");
  chorus_result_t rc = chorus_gather_bytes(g_comm, mine, len, 0, &all, lens);
  int ok = 1;
  if (rc == CHORUS_OK && g_rank != 0) {
    ok = all == NULL; /* only the root receives */
    addf(&l, " -> (result on rank 0)");
  } else if (rc == CHORUS_OK) {
    const char *p = all;
    addf(&l, " -> [");
    for (int r = 0; r < g_size; r++) {
      int good = lens[r] == (size_t)r + 1;
      for (size_t i = 0; good && i < lens[r]; i++) good = p[i] == 'a' + r % 26;
      ok &= good;
      if (r < MAX_SHOWN) {
        int shown = lens[r] > MAX_SHOWN ? MAX_SHOWN : (int)lens[r];
        addf(&l, "%s\"%.*s%s\"", r ? ", " : "", shown, p, lens[r] > MAX_SHOWN ? "..." : "");
      }
      p += lens[r];
    }
    addf(&l, "%s]", g_size > MAX_SHOWN ? ", ..." : "");
  }
  chorus_free(all);
  free(mine);
  free(lens);
  if (rc != CHORUS_OK) return failed("gather_bytes", rc, chorus_comm_last_error(g_comm));
  return report(&l, ok);
}

static int demo_all_gather_bytes(void) {
  /* Rank r contributes r int32 values equal to r: rank 0 sends nothing. */
  size_t n = (size_t)g_rank;
  int32_t *mine = xcalloc(n, sizeof *mine);
  for (size_t i = 0; i < n; i++) mine[i] = g_rank;
  size_t *lens = xcalloc((size_t)g_size, sizeof *lens);
  void *all = NULL;
  line_t l = {.n = 0};
  addf(&l, "all_gather_bytes: ");
  add_i32s(&l, mine, n);
  chorus_result_t rc = chorus_all_gather_bytes(g_comm, mine, n * sizeof *mine, &all, lens);
  int ok = 1;
  if (rc == CHORUS_OK) {
    const unsigned char *p = all;
    addf(&l, " -> [");
    for (int r = 0; r < g_size; r++) {
      size_t k = lens[r] / sizeof(int32_t);
      int32_t vals[MAX_SHOWN];
      int good = lens[r] == (size_t)r * sizeof(int32_t);
      for (size_t i = 0; good && i < k; i++) {
        int32_t v;
        memcpy(&v, p + i * sizeof v, sizeof v); /* no alignment promised */
        good = v == r;
        if (i < MAX_SHOWN) vals[i] = v;
      }
      ok &= good;
      if (r < MAX_SHOWN) {
        addf(&l, "%s", r ? ", " : "");
        if (good) add_i32s(&l, vals, k); /* else: k values may not be read */
        else addf(&l, "(%zu bytes, wrong)", lens[r]);
      }
      p += lens[r];
    }
    addf(&l, "%s]", g_size > MAX_SHOWN ? ", ..." : "");
  }
  chorus_free(all);
  free(mine);
  free(lens);
  if (rc != CHORUS_OK) return failed("all_gather_bytes", rc, chorus_comm_last_error(g_comm));
  return report(&l, ok);
}

static int demo_async_all_reduce(void) {
  int32_t buf[2] = {g_rank, 1}, want[2] = {g_size * (g_size - 1) / 2, g_size};
  line_t l = {.n = 0};
  addf(&l, "all_reduce(sum, async): ");
  add_i32s(&l, buf, 2);
  chorus_work_t work = NULL;
  CALL("all_reduce(async)",
       chorus_all_reduce(g_comm, buf, buf, 2, CHORUS_INT32, CHORUS_SUM, &work));
  /* ... this rank could compute here while the all_reduce runs ... */
  chorus_result_t rc = chorus_work_wait(work, -1);
  if (rc != CHORUS_OK) {
    failed("all_reduce(async) wait", rc, chorus_work_error(work));
    chorus_work_free(work);
    return -1;
  }
  chorus_work_free(work);
  addf(&l, " -> ");
  add_i32s(&l, buf, 2);
  return report(&l, same_i32(buf, want, 2));
}

static int demo_split(void) {
  int color = g_rank % 2;
  chorus_comm_t half = NULL;
  CALL("split", chorus_comm_split(g_comm, color, g_rank, &half));
  if (!half) return failed("split", CHORUS_ERR_INTERNAL, "no communicator for a member");
  /* Ranks of one parity, in parent order: sub rank g_rank/2. */
  int hrank = chorus_comm_rank(half), hsize = chorus_comm_size(half);
  int want_size = (g_size - color + 1) / 2;
  int32_t buf[1] = {g_rank}, want[1] = {0};
  for (int r = color; r < g_size; r += 2) want[0] += r;
  line_t l = {.n = 0};
  addf(&l, "split(even/odd) rank %d/%d of color %d, all_reduce(sum): ", hrank, hsize, color);
  add_i32s(&l, buf, 1);
  chorus_result_t rc = chorus_all_reduce(half, buf, buf, 1, CHORUS_INT32, CHORUS_SUM, NULL);
  if (rc != CHORUS_OK) {
    failed("all_reduce on the split group", rc, chorus_comm_last_error(half));
    chorus_comm_destroy(half);
    return -1;
  }
  addf(&l, " -> ");
  add_i32s(&l, buf, 1);
  /* A subgroup is destroyed before its parent. */
  rc = chorus_comm_destroy(half);
  if (rc != CHORUS_OK) return failed("destroying the split group", rc, chorus_strerror(rc));
  return report(&l, hrank == g_rank / 2 && hsize == want_size && same_i32(buf, want, 1));
}

/* ------------------------------------------------------------------ main */

int main(void) {
  if (chorus_comm_init_env(&g_comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(g_comm);
  g_size = chorus_comm_size(g_comm);

  static int (*const steps[])(void) = {
      demo_broadcast,       demo_reduce,           demo_all_reduce_sum,
      demo_all_reduce_max,  demo_all_reduce_avg,   demo_scatter,
      demo_gather,          demo_all_gather,       demo_all_gather_list,
      demo_reduce_scatter,  demo_all_to_all,       demo_all_to_allv,
      demo_barrier,         demo_send_recv,        demo_gather_bytes,
      demo_all_gather_bytes, demo_async_all_reduce, demo_split,
  };
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    if (steps[i]() != 0) {
      chorus_comm_destroy(g_comm);
      return 1;
    }
  }

  /* Agree on the outcome: the largest number of wrong results of any rank
   * (this summary all_reduce is not counted among the demo's). */
  int32_t wrong = g_nwrong;
  chorus_result_t rc = chorus_all_reduce(g_comm, &wrong, &wrong, 1, CHORUS_INT32, CHORUS_MAX, NULL);
  if (rc != CHORUS_OK) {
    failed("the final all_reduce", rc, chorus_comm_last_error(g_comm));
    chorus_comm_destroy(g_comm);
    return 1;
  }
  if (g_rank == 0) {
    if (wrong == 0)
      printf("demo: all %d collectives correct on %d rank%s\n", g_ncoll, g_size,
             g_size == 1 ? "" : "s");
    else
      printf("demo: FAILED: up to %d wrong result%s on a rank (see WRONG above)\n", (int)wrong,
             wrong == 1 ? "" : "s");
  }
  fflush(stdout);
  rc = chorus_comm_destroy(g_comm);
  if (rc != CHORUS_OK) {
    fprintf(stderr, "rank %d: destroy failed: %s\n", g_rank, chorus_strerror(rc));
    return 1;
  }
  return wrong == 0 ? 0 : 1;
}
