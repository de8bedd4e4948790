/*
 * dtype_values.h - the test programs' own element conversions: small
 * integers to and from every chorus dtype, written independently of the
 * library's (so a test never checks chorus against itself).  Exact for
 * |v| <= 2048 in float16 and |v| <= 256 in bfloat16.
 */
#ifndef CHORUS_TEST_DTYPE_VALUES_H
#define CHORUS_TEST_DTYPE_VALUES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "chorus.h"

static inline int is_float(chorus_dtype_t dt) {
  return dt == CHORUS_FLOAT16 || dt == CHORUS_BFLOAT16 || dt == CHORUS_FLOAT32 ||
         dt == CHORUS_FLOAT64;
}

static inline uint16_t int_to_half(int64_t v) {
  if (v == 0) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  uint64_t a = (uint64_t)(v < 0 ? -v : v);
  int e = 63 - __builtin_clzll(a);
  uint64_t mant = e >= 10 ? a >> (e - 10) : a << (10 - e);
  return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)(mant & 0x3ff));
}

static inline uint16_t int_to_bf16(int64_t v) {
  float f = (float)v;
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16); /* exact for |v| <= 256 */
}

static inline double half_to_double(uint16_t h) {
  int e = (h >> 10) & 0x1f;
  double m = h & 0x3ff;
  double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -v : v;
}

static inline double bf16_to_double(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline void store_val(void *buf, size_t i, chorus_dtype_t dt, int64_t v) {
  switch (dt) {
    case CHORUS_INT8: ((int8_t *)buf)[i] = (int8_t)(uint8_t)v; break;
    case CHORUS_UINT8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case CHORUS_INT32: ((int32_t *)buf)[i] = (int32_t)(uint32_t)v; break;
    case CHORUS_INT64: ((int64_t *)buf)[i] = v; break;
    case CHORUS_FLOAT16: ((uint16_t *)buf)[i] = int_to_half(v); break;
    case CHORUS_BFLOAT16: ((uint16_t *)buf)[i] = int_to_bf16(v); break;
    case CHORUS_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case CHORUS_FLOAT64: ((double *)buf)[i] = (double)v; break;
    default: break;
  }
}

static inline double load_double(const void *buf, size_t i, chorus_dtype_t dt) {
  switch (dt) {
    case CHORUS_INT8: return ((const int8_t *)buf)[i];
    case CHORUS_UINT8: return ((const uint8_t *)buf)[i];
    case CHORUS_INT32: return ((const int32_t *)buf)[i];
    case CHORUS_INT64: return (double)((const int64_t *)buf)[i];
    case CHORUS_FLOAT16: return half_to_double(((const uint16_t *)buf)[i]);
    case CHORUS_BFLOAT16: return bf16_to_double(((const uint16_t *)buf)[i]);
    case CHORUS_FLOAT32: return ((const float *)buf)[i];
    case CHORUS_FLOAT64: return ((const double *)buf)[i];
    default: return 0;
  }
}

/* acc op v on integers, wrapping like two's complement (AVG sums). */
static inline int64_t combine_int(chorus_op_t op, int64_t acc, int64_t v) {
  switch (op) {
    case CHORUS_SUM:
    case CHORUS_AVG: return (int64_t)((uint64_t)acc + (uint64_t)v);
    case CHORUS_PROD: return (int64_t)((uint64_t)acc * (uint64_t)v);
    case CHORUS_MIN: return v < acc ? v : acc;
    case CHORUS_MAX: return v > acc ? v : acc;
    case CHORUS_BAND: return acc & v;
    case CHORUS_BOR: return acc | v;
    case CHORUS_BXOR: return acc ^ v;
    default: return acc;
  }
}

#endif
