/*
 * test_colls.c - the collective correctness matrix, run as N processes by
 * chorusrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_*).
 *
 * For every collective x every registered algorithm (forced in turn with
 * chorus_comm_set_algo) x dtype x op x in-place/out-of-place x count x root,
 * each rank fills its inputs with values that are a pure function of
 * (rank, index) and compares its outputs with an expectation computed
 * independently here, from the same function, without any communication.
 * Values are small integers so float results are exact except for AVG (and
 * even there they are exact except for rounding of the final division, which
 * is compared with a tolerance).  Integer SUM/PROD wrap like the library's.
 *
 * Usage: test_colls [--quick] [--big] [--only COLL]
 *   --big   adds ~4 MiB float32/int32 cases for every collective and algorithm.
 *   --quick every collective x algorithm x count x in-place as before, but
 *           the dtype x op x root product sampled: float32 with every op,
 *           int8, float16 and float64 (element sizes 1, 2 and 8) with SUM
 *           or no op, the first and last root.  The sanitizer builds run
 *           this: the kernels' dtype x op matrix is unit.test_reduce's, and
 *           an instrumented build spends its time there, not in the
 *           transport and algorithms it is meant to check.
 * Prints failures with every parameter, and rank 0 prints "N passed, M failed".
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"
#include "dtype_values.h"

static int g_rank, g_size;
static long g_pass, g_fail;
static int g_big, g_quick;
static const char *g_only;

/* --------------------------------------------------------------- values */


/* The input of rank r at index i for a reduction with op. */
static int64_t red_input(int r, size_t i, chorus_dtype_t dt, chorus_op_t op) {
  if (op == CHORUS_PROD) return (int64_t)((r + i) % 2) + 1;
  if (op == CHORUS_BAND || op == CHORUS_BOR || op == CHORUS_BXOR)
    return (int64_t)(((size_t)r * 37 + i * 11) & 0x7f);
  int64_t v = (int64_t)(((size_t)r * 7 + i * 3) % 5) - 1;
  return dt == CHORUS_UINT8 ? v + 1 : v;
}

/* The value rank r contributes at index i to a data-moving collective. */
static int64_t move_input(int r, size_t i, chorus_dtype_t dt) {
  int64_t m;
  switch (dt) {
    case CHORUS_INT8: m = 100; break;
    case CHORUS_UINT8: m = 200; break;
    case CHORUS_BFLOAT16: m = 200; break;
    case CHORUS_FLOAT16: m = 1000; break;
    default: m = 1000000; break;
  }
  return (int64_t)(((size_t)r * 131 + i * 7) % (size_t)m);
}

/* Expected reduction over all ranks at index i, as int64 (wrapping like the
 * dtype) — AVG handled by the caller. */
static int64_t expect_red(size_t i, chorus_dtype_t dt, chorus_op_t op, int n) {
  int64_t acc = red_input(0, i, dt, op);
  for (int r = 1; r < n; r++) {
    int64_t v = red_input(r, i, dt, op);
    acc = combine_int(op, acc, v);
  }
  return acc;
}

/* Wraps an int64 to the dtype's range (for integer dtypes). */
static int64_t wrap(int64_t v, chorus_dtype_t dt) {
  switch (dt) {
    case CHORUS_INT8: return (int8_t)(uint8_t)v;
    case CHORUS_UINT8: return (uint8_t)v;
    case CHORUS_INT32: return (int32_t)(uint32_t)v;
    default: return v;
  }
}

/* ------------------------------------------------------------ checking */

static char g_case[256];

static int check_red(const void *buf, size_t count, chorus_dtype_t dt, chorus_op_t op, int n,
                     const char *what) {
  for (size_t i = 0; i < count; i++) {
    int64_t e = expect_red(i, dt, op, n);
    double got = load_double(buf, i, dt), want;
    if (op == CHORUS_AVG) {
      if (is_float(dt)) {
        want = (double)e / n;
        double tol = dt == CHORUS_FLOAT16 || dt == CHORUS_BFLOAT16 ? 1e-2 * (fabs(want) + 1) : 1e-6 * (fabs(want) + 1);
        if (fabs(got - want) <= tol) continue;
      } else {
        want = (double)(wrap(e, dt) / n);
        if (got == want) continue;
      }
    } else {
      want = is_float(dt) ? (double)e : (double)wrap(e, dt);
      if (got == want) continue;
    }
    fprintf(stderr, "rank %d: FAIL %s: %s[%zu] = %g, expected %g\n", g_rank, g_case, what, i, got,
            want);
    return 0;
  }
  return 1;
}

/* Compares count elements of buf with rank src's move_input. */
static int check_move(const void *buf, size_t count, chorus_dtype_t dt, int src, size_t base,
                      const char *what) {
  size_t es = chorus_dtype_size(dt);
  char *want = malloc(count * es + 1);
  for (size_t i = 0; i < count; i++) store_val(want, i, dt, move_input(src, base + i, dt));
  int ok = count == 0 || memcmp(want, buf, count * es) == 0;
  if (!ok) {
    for (size_t i = 0; i < count; i++)
      if (memcmp(want + i * es, (const char *)buf + i * es, es)) {
        fprintf(stderr, "rank %d: FAIL %s: %s (from rank %d) element %zu = %g, expected %g\n",
                g_rank, g_case, what, src, i, load_double(buf, i, dt), load_double(want, i, dt));
        break;
      }
  }
  free(want);
  return ok;
}

static void fill_move(void *buf, size_t count, chorus_dtype_t dt, int r, size_t base) {
  for (size_t i = 0; i < count; i++) store_val(buf, i, dt, move_input(r, base + i, dt));
}

static void fill_red(void *buf, size_t count, chorus_dtype_t dt, chorus_op_t op, int r) {
  for (size_t i = 0; i < count; i++) store_val(buf, i, dt, red_input(r, i, dt, op));
}

static void result(int ok, chorus_comm_t comm, chorus_result_t st) {
  if (st != CHORUS_OK) {
    fprintf(stderr, "rank %d: FAIL %s: returned %s: %s\n", g_rank, g_case, chorus_result_name(st),
            chorus_comm_last_error(comm));
    ok = 0;
  }
  if (ok) g_pass++;
  else g_fail++;
}

/* ------------------------------------------------------------ the cases */

static void run_case(chorus_comm_t comm, chorus_coll_t coll, chorus_dtype_t dt, chorus_op_t op,
                     size_t count, int root, int inplace) {
  int n = g_size, r = g_rank;
  size_t es = chorus_dtype_size(dt), blk = count * es;
  char *a = calloc((size_t)n * blk + 16, 1), *b = calloc((size_t)n * blk + 16, 1);
  chorus_result_t st = CHORUS_OK;
  int ok = 1;
  switch (coll) {
    case CHORUS_COLL_ALL_REDUCE:
      fill_red(a, count, dt, op, r);
      st = chorus_all_reduce(comm, a, inplace ? a : b, count, dt, op, NULL);
      ok = check_red(inplace ? a : b, count, dt, op, n, "result");
      break;
    case CHORUS_COLL_REDUCE:
      fill_red(a, count, dt, op, r);
      st = chorus_reduce(comm, a, inplace && r == root ? a : b, count, dt, op, root, NULL);
      if (r == root) ok = check_red(inplace ? a : b, count, dt, op, n, "result");
      break;
    case CHORUS_COLL_REDUCE_SCATTER:
      for (int q = 0; q < n; q++) {
        /* Block q of rank r holds rank r's input at indices q*count.. */
        char *blkp = a + (size_t)q * blk;
        for (size_t i = 0; i < count; i++)
          store_val(blkp, i, dt, red_input(r, (size_t)q * count + i, dt, op));
      }
      {
        void *out = inplace ? a + (size_t)r * blk : b;
        st = chorus_reduce_scatter(comm, a, out, count, dt, op, NULL);
        /* Expected: the reduction at global indices r*count + i. */
        for (size_t i = 0; i < count && ok; i++) {
          int64_t e = expect_red((size_t)r * count + i, dt, op, n);
          double got = load_double(out, i, dt), want;
          if (op == CHORUS_AVG && is_float(dt)) {
            want = (double)e / n;
            ok = fabs(got - want) <= 1e-2 * (fabs(want) + 1);
          } else {
            want = op == CHORUS_AVG ? (double)(wrap(e, dt) / n)
                                    : (is_float(dt) ? (double)e : (double)wrap(e, dt));
            ok = got == want;
          }
          if (!ok)
            fprintf(stderr, "rank %d: FAIL %s: result[%zu] = %g, expected %g\n", g_rank, g_case,
                    i, got, want);
        }
      }
      break;
    case CHORUS_COLL_BROADCAST:
      if (r == root) fill_move(a, count, dt, root, 0);
      st = chorus_broadcast(comm, a, count, dt, root, NULL);
      ok = check_move(a, count, dt, root, 0, "buf");
      break;
    case CHORUS_COLL_SCATTER:
      if (r == root)
        for (int q = 0; q < n; q++) fill_move(a + (size_t)q * blk, count, dt, q, 0);
      {
        void *out = inplace && r == root ? a + (size_t)r * blk : b;
        st = chorus_scatter(comm, a, out, count, dt, root, NULL);
        ok = check_move(out, count, dt, r, 0, "recv");
      }
      break;
    case CHORUS_COLL_GATHER: {
      void *in = inplace && r == root ? b + (size_t)r * blk : a;
      fill_move(in, count, dt, r, 0);
      st = chorus_gather(comm, in, b, count, dt, root, NULL);
      if (r == root)
        for (int q = 0; q < n && ok; q++) ok = check_move(b + (size_t)q * blk, count, dt, q, 0, "block");
      break;
    }
    case CHORUS_COLL_ALL_GATHER: {
      void *in = inplace == 1 ? b + (size_t)r * blk : a;
      fill_move(in, count, dt, r, 0);
      if (inplace == 2) {
        /* The list form. */
        void **list = malloc(sizeof(void *) * (size_t)n);
        for (int q = 0; q < n; q++) list[q] = b + (size_t)(n - 1 - q) * blk;
        st = chorus_all_gather_list(comm, a, list, count, dt, NULL);
        for (int q = 0; q < n && ok; q++) ok = check_move(list[q], count, dt, q, 0, "list entry");
        free(list);
      } else {
        st = chorus_all_gather(comm, in, b, count, dt, NULL);
        for (int q = 0; q < n && ok; q++) ok = check_move(b + (size_t)q * blk, count, dt, q, 0, "block");
      }
      break;
    }
    case CHORUS_COLL_ALL_TO_ALL:
      /* Block q of rank r: move_input(r, q*count + i). */
      for (int q = 0; q < n; q++) fill_move(a + (size_t)q * blk, count, dt, r, (size_t)q * count);
      st = chorus_all_to_all(comm, a, inplace ? a : b, count, dt, NULL);
      for (int q = 0; q < n && ok; q++)
        ok = check_move((inplace ? a : b) + (size_t)q * blk, count, dt, q, (size_t)r * count, "block");
      break;
    case CHORUS_COLL_ALL_TO_ALLV: {
      /* Rank i sends (i + j) % 3 * count / 2 + (j==0) elements to rank j. */
      size_t *sc = calloc((size_t)n, sizeof(size_t)), *sd = calloc((size_t)n, sizeof(size_t));
      size_t *rc = calloc((size_t)n, sizeof(size_t)), *rd = calloc((size_t)n, sizeof(size_t));
      size_t so = 0, ro = 0;
      for (int q = 0; q < n; q++) {
        sc[q] = (size_t)((r + q) % 3) * count / 2 + (q == 0);
        rc[q] = (size_t)((q + r) % 3) * count / 2 + (r == 0);
        sd[q] = so;
        rd[q] = ro + 1; /* a hole, to test displacements */
        so += sc[q];
        ro += rc[q] + 1;
      }
      char *sb = calloc(so * es + 1, 1), *rb = calloc(ro * es + 1, 1);
      for (int q = 0; q < n; q++) fill_move(sb + sd[q] * es, sc[q], dt, r, (size_t)q * 1000);
      st = chorus_all_to_allv(comm, sb, sc, sd, rb, rc, rd, dt, NULL);
      for (int q = 0; q < n && ok; q++)
        ok = check_move(rb + rd[q] * es, rc[q], dt, q, (size_t)r * 1000, "block");
      free(sc), free(sd), free(rc), free(rd), free(sb), free(rb);
      break;
    }
    case CHORUS_COLL_BARRIER:
      st = chorus_barrier(comm, NULL);
      break;
    case CHORUS_COLL_GATHERV:
    case CHORUS_COLL_ALL_GATHERV: {
      /* Rank q contributes (q + 1) * count / 4 + q bytes of move_input. */
      size_t len = (size_t)(r + 1) * count / 4 + (size_t)r;
      fill_move(a, len, CHORUS_UINT8, r, 0);
      void *out = NULL;
      size_t *lens = calloc((size_t)n, sizeof(size_t));
      if (coll == CHORUS_COLL_GATHERV) st = chorus_gather_bytes(comm, a, len, root, &out, lens);
      else st = chorus_all_gather_bytes(comm, a, len, &out, lens);
      if (st == CHORUS_OK && (coll == CHORUS_COLL_ALL_GATHERV || r == root)) {
        size_t off = 0;
        for (int q = 0; q < n && ok; q++) {
          size_t want = (size_t)(q + 1) * count / 4 + (size_t)q;
          if (lens[q] != want) {
            fprintf(stderr, "rank %d: FAIL %s: lens[%d] = %zu, expected %zu\n", r, g_case, q,
                    lens[q], want);
            ok = 0;
            break;
          }
          ok = check_move((char *)out + off, lens[q], CHORUS_UINT8, q, 0, "object");
          off += lens[q];
        }
      } else if (st == CHORUS_OK && out) {
        fprintf(stderr, "rank %d: FAIL %s: non-root got output\n", r, g_case);
        ok = 0;
      }
      chorus_free(out);
      free(lens);
      break;
    }
    default:
      break;
  }
  result(ok, comm, st);
  free(a);
  free(b);
}

static int has_op(chorus_coll_t c) {
  return c == CHORUS_COLL_ALL_REDUCE || c == CHORUS_COLL_REDUCE || c == CHORUS_COLL_REDUCE_SCATTER;
}
static int has_root(chorus_coll_t c) {
  return c == CHORUS_COLL_REDUCE || c == CHORUS_COLL_BROADCAST || c == CHORUS_COLL_SCATTER ||
         c == CHORUS_COLL_GATHER || c == CHORUS_COLL_GATHERV;
}
static int has_inplace(chorus_coll_t c) {
  return c != CHORUS_COLL_BROADCAST && c != CHORUS_COLL_BARRIER && c != CHORUS_COLL_ALL_TO_ALLV &&
         c != CHORUS_COLL_GATHERV && c != CHORUS_COLL_ALL_GATHERV;
}

static void matrix(chorus_comm_t comm, chorus_coll_t coll) {
  static const size_t counts[] = {0, 1, 7, 1000};
  for (int ai = 0; chorus_algo_name(coll, ai); ai++) {
    const char *algo = chorus_algo_name(coll, ai);
    chorus_comm_set_algo(comm, coll, algo);
    const char *tp = getenv("CHORUS_TRANSPORT");
    int spread = 0; /* ranks on several hosts */
    for (int r = 0; r < g_size; r++) spread |= chorus_comm_same_host(comm, r) == 0;
    if (!strcmp(algo, "direct") && g_size > 1 && ((tp && !strcmp(tp, "tcp")) || spread)) {
      /* No shared memory: forcing it must be refused, clearly. */
      char one[64] = {0}, out[64 * 64] = {0};
      chorus_result_t st = CHORUS_OK;
      switch (coll) {
        case CHORUS_COLL_BARRIER: st = chorus_barrier(comm, NULL); break;
        default: st = chorus_all_gather(comm, one, out, 1, CHORUS_INT8, NULL); break;
      }
      if (coll == CHORUS_COLL_BARRIER || coll == CHORUS_COLL_ALL_GATHER) {
        snprintf(g_case, sizeof g_case, "%s algo=direct over tcp n=%d", chorus_coll_name(coll),
                 g_size);
        if (st == CHORUS_ERR_NOT_SUPPORTED && strstr(chorus_comm_last_error(comm), "shared memory"))
          g_pass++;
        else {
          g_fail++;
          fprintf(stderr, "rank %d: FAIL %s: returned %s, want CHORUS_ERR_NOT_SUPPORTED\n", g_rank,
                  g_case, chorus_result_name(st));
        }
      }
      chorus_comm_set_algo(comm, coll, NULL);
      continue;
    }
    int ninplace = has_inplace(coll) ? (coll == CHORUS_COLL_ALL_GATHER ? 3 : 2) : 1;
    int dtype_free = coll == CHORUS_COLL_BARRIER || coll == CHORUS_COLL_GATHERV ||
                     coll == CHORUS_COLL_ALL_GATHERV;
    for (int dt = 0; dt < (dtype_free ? 1 : CHORUS_DTYPE_COUNT); dt++) {
      for (int op = 0; op < (has_op(coll) ? CHORUS_OP_COUNT : 1); op++) {
        chorus_op_t o = has_op(coll) ? (chorus_op_t)op : CHORUS_OP_COUNT;
        if (has_op(coll) && is_float((chorus_dtype_t)dt) && op >= CHORUS_BAND) continue;
        if (g_quick && dt != CHORUS_FLOAT32 && (op != 0 ||
            (dt != CHORUS_INT8 && dt != CHORUS_FLOAT16 && dt != CHORUS_FLOAT64)))
          continue;
        for (size_t ci = 0; ci < (coll == CHORUS_COLL_BARRIER ? 1 : sizeof counts / sizeof counts[0]); ci++) {
          for (int ip = 0; ip < ninplace; ip++) {
            /* Every root for the plain op; first and last root otherwise. */
            for (int root = 0; root < (has_root(coll) ? g_size : 1); root++) {
              if (has_root(coll) && (op != 0 || g_quick) && root != 0 && root != g_size - 1)
                continue;
              snprintf(g_case, sizeof g_case, "%s algo=%s dtype=%s op=%s count=%zu root=%d %s n=%d",
                       chorus_coll_name(coll), algo, chorus_dtype_name((chorus_dtype_t)dt),
                       has_op(coll) ? chorus_op_name(o) : "-", counts[ci],
                       has_root(coll) ? root : -1, ip == 2 ? "list" : ip ? "in-place" : "out-of-place",
                       g_size);
              run_case(comm, coll, (chorus_dtype_t)dt, o, counts[ci], has_root(coll) ? root : -1, ip);
            }
          }
        }
      }
    }
    if (g_big) {
      /* ~4 MiB, not a multiple of the group size (--quick: 1.25 MiB, still
       * above the 1 MiB a message goes in pieces from). */
      size_t big = (g_quick ? (5u << 18) : (4u << 20)) / 4 + 3;
      chorus_dtype_t dts[2] = {CHORUS_FLOAT32, CHORUS_INT32};
      for (int k = 0; k < 2; k++) {
        int root = g_size - 1;
        snprintf(g_case, sizeof g_case, "%s algo=%s dtype=%s count=%zu root=%d n=%d (big)",
                 chorus_coll_name(coll), algo, chorus_dtype_name(dts[k]), big, root, g_size);
        run_case(comm, coll, dts[k], has_op(coll) ? CHORUS_SUM : CHORUS_OP_COUNT,
                 big,
                 has_root(coll) ? root : -1, 0);
      }
    }
    chorus_comm_set_algo(comm, coll, NULL);
  }
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--big")) g_big = 1;
    else if (!strcmp(argv[i], "--quick")) g_quick = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
  }
  chorus_comm_t comm;
  chorus_result_t st = chorus_comm_init_env(&comm);
  if (st != CHORUS_OK) {
    fprintf(stderr, "init failed: %s: %s\n", chorus_result_name(st), chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(comm);
  g_size = chorus_comm_size(comm);
  static const chorus_coll_t colls[] = {
      CHORUS_COLL_ALL_REDUCE, CHORUS_COLL_REDUCE,     CHORUS_COLL_REDUCE_SCATTER,
      CHORUS_COLL_BROADCAST,  CHORUS_COLL_SCATTER,    CHORUS_COLL_GATHER,
      CHORUS_COLL_ALL_GATHER, CHORUS_COLL_ALL_TO_ALL, CHORUS_COLL_ALL_TO_ALLV,
      CHORUS_COLL_BARRIER,    CHORUS_COLL_GATHERV,    CHORUS_COLL_ALL_GATHERV};
  for (size_t k = 0; k < sizeof colls / sizeof colls[0]; k++) {
    if (g_only && strcmp(g_only, chorus_coll_name(colls[k]))) continue;
    matrix(comm, colls[k]);
  }
  /* Every rank must agree that every rank passed. */
  long counts[2] = {g_pass, g_fail}, total[2] = {0, 0};
  st = chorus_all_reduce(comm, counts, total, 2, CHORUS_INT64, CHORUS_SUM, NULL);
  if (st != CHORUS_OK) {
    fprintf(stderr, "rank %d: final all_reduce failed: %s\n", g_rank, chorus_comm_last_error(comm));
    total[1]++;
  }
  if (g_rank == 0) printf("%ld passed, %ld failed\n", total[0], total[1]);
  chorus_comm_destroy(comm);
  return total[1] ? 1 : 0;
}
