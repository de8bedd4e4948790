/*
 * reduce_bench.c - bandwidth of every reduction kernel (dtype x op x ISA)
 * against memcpy.
 *
 *   reduce-bench [dtype [op]]      e.g. reduce-bench float32 sum
 *
 * For each buffer size (64 KiB, 1 MiB, 16 MiB, 64 MiB per operand) the kernel
 * runs out of place, dst = a OP b, and is credited 3 x n x elemsize bytes
 * (two reads and one write); memcpy of the same n x elemsize bytes is
 * credited 2 x n x elemsize (one read, one write), so both columns are memory
 * traffic per second and "x memcpy" is their ratio.  Each figure is the median
 * of 7 samples; small sizes repeat the call within a sample.  Before timing,
 * every ISA's kernel is checked bit for bit against the scalar one.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "reduce/reduce.h"

enum { SAMPLES = 7 };

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

static uint64_t rng(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Finite values near 1 for floating point (PROD stays finite), anything for
 * integers. */
static void fill(void *buf, size_t n, chorus_dtype_t dt, uint64_t seed) {
  for (size_t i = 0; i < n; i++) {
    uint64_t r = rng(&seed);
    float f = 0.5f + (float)(r % 1024) / 1024.0f;
    switch (dt) {
    case CHORUS_FLOAT16: ((uint16_t *)buf)[i] = chorus__float_to_half(f); break;
    case CHORUS_BFLOAT16: ((uint16_t *)buf)[i] = chorus__float_to_bf16(f); break;
    case CHORUS_FLOAT32: ((float *)buf)[i] = f; break;
    case CHORUS_FLOAT64: ((double *)buf)[i] = f; break;
    default: memcpy((char *)buf + i * chorus_dtype_size(dt), &r, chorus_dtype_size(dt)); break;
    }
  }
}

/* Median GB/s of fn over n elements of size es (3 streams); fn == NULL times
 * memcpy (2 streams). */
static double measure(chorus__reduce_fn_t fn, void *dst, const void *a, const void *b, size_t n,
                      size_t es) {
  size_t bytes = n * es;
  size_t traffic = (fn ? 3 : 2) * bytes;
  size_t reps = (size_t)(64u << 20) / traffic;
  if (reps < 1) reps = 1;
  double gbs[SAMPLES];
  for (int s = -1; s < SAMPLES; s++) { /* s = -1 warms up */
    double t0 = now_s();
    for (size_t r = 0; r < reps; r++) {
      if (fn)
        fn(dst, a, b, n);
      else
        memcpy(dst, a, bytes);
      __asm__ volatile("" ::"r"(dst) : "memory");
    }
    double t = now_s() - t0;
    if (s >= 0) gbs[s] = (double)traffic * (double)reps / t / 1e9;
  }
  qsort(gbs, SAMPLES, sizeof gbs[0], cmp_double);
  return gbs[SAMPLES / 2];
}

int main(int argc, char **argv) {
  static const size_t sizes[] = {64u << 10, 1u << 20, 16u << 20, 64u << 20};
  enum { NSIZES = sizeof sizes / sizeof sizes[0] };
  const char *want_dt = argc > 1 ? argv[1] : NULL, *want_op = argc > 2 ? argv[2] : NULL;
  size_t max = sizes[NSIZES - 1];
  unsigned char *a = malloc(max), *b = malloc(max), *dst = malloc(max), *ref = malloc(max);
  if (!a || !b || !dst || !ref) {
    fprintf(stderr, "reduce-bench: out of memory\n");
    return 1;
  }
  memset(dst, 0, max);
  memset(ref, 0, max);

  printf("reduce ISA in use: %s; available:", chorus__reduce_isa_name(chorus__reduce_isa()));
  for (int i = 0; i < CHORUS__ISA_COUNT; i++)
    if (chorus__reduce_isa_available((chorus__isa_t)i))
      printf(" %s", chorus__reduce_isa_name((chorus__isa_t)i));
  printf("\nGB/s: kernel counts 3 x bytes (2 reads + 1 write), memcpy 2 x bytes; median of %d\n\n",
         SAMPLES);

  double memcpy_gbs[NSIZES];
  for (int s = 0; s < NSIZES; s++) memcpy_gbs[s] = measure(NULL, dst, a, b, sizes[s], 1);

  printf("%-9s %-5s %7s %8s", "dtype", "op", "size", "memcpy");
  for (int i = 0; i < CHORUS__ISA_COUNT; i++)
    if (chorus__reduce_isa_available((chorus__isa_t)i))
      printf(" %9s %7s", chorus__reduce_isa_name((chorus__isa_t)i), "x mcpy");
  printf("\n");

  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++) {
    chorus_dtype_t dt = (chorus_dtype_t)d;
    if (want_dt && strcmp(want_dt, chorus_dtype_name(dt)) != 0) continue;
    size_t es = chorus_dtype_size(dt);
    fill(a, max / es, dt, 1 + (uint64_t)d);
    fill(b, max / es, dt, 1000 + (uint64_t)d);
    for (int o = 0; o < CHORUS_OP_COUNT; o++) {
      chorus_op_t op = (chorus_op_t)o;
      if (!chorus__reduce_supported(dt, op)) continue;
      if (want_op && strcmp(want_op, chorus_op_name(op)) != 0) continue;
      /* Check every ISA against scalar on the largest size. */
      size_t n = max / es;
      chorus__reduce_fn_isa(dt, op, CHORUS__ISA_SCALAR)(ref, a, b, n);
      for (int i = 1; i < CHORUS__ISA_COUNT; i++) {
        chorus__reduce_fn_t fn = chorus__reduce_fn_isa(dt, op, (chorus__isa_t)i);
        if (!fn) continue;
        fn(dst, a, b, n);
        if (memcmp(dst, ref, n * es) != 0) {
          fprintf(stderr, "reduce-bench: %s %s %s differs from scalar\n",
                  chorus__reduce_isa_name((chorus__isa_t)i), chorus_dtype_name(dt),
                  chorus_op_name(op));
          return 1;
        }
      }
      for (int s = 0; s < NSIZES; s++) {
        n = sizes[s] / es;
        printf("%-9s %-5s %5zu%s %8.1f", chorus_dtype_name(dt), chorus_op_name(op),
               sizes[s] >= (1u << 20) ? sizes[s] >> 20 : sizes[s] >> 10,
               sizes[s] >= (1u << 20) ? "Mi" : "Ki", memcpy_gbs[s]);
        for (int i = 0; i < CHORUS__ISA_COUNT; i++) {
          chorus__reduce_fn_t fn = chorus__reduce_fn_isa(dt, op, (chorus__isa_t)i);
          if (!fn) continue;
          double g = measure(fn, dst, a, b, n, es);
          printf(" %9.1f %7.2f", g, g / memcpy_gbs[s]);
        }
        printf("\n");
        fflush(stdout);
      }
    }
  }
  free(a);
  free(b);
  free(dst);
  free(ref);
  return 0;
}
