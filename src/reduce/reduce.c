/*
 * reduce.c - the element-wise reduction kernels (one per dtype x op), the
 * AVG finalisation and the float16/bfloat16 <-> float32 conversions.
 *
 * Kernels.  Every kernel computes dst[i] = a[i] OP b[i] for i < n.  The 52
 * kernels (8 dtypes x 8 ops, less the bitwise ops on the 4 floating-point
 * dtypes) are not written by hand: CHORUS_DTYPE_MAP x CHORUS_OP_MAP is
 * expanded twice over a small table of per-dtype traits below, once to define
 * the kernels and once to fill the const dispatch table, so adding a dtype
 * means adding one traits line.  The kernels have no mutable state; every function
 * here is thread-safe and cannot fail.  These portable kernels are the
 * reference; reduce_simd.c has AVX2/F16C versions of the hot ones, and
 * chorus__reduce_fn() picks a kernel per CPU once (pthread_once) from the
 * tables of both, see "dispatch" below.
 *
 * Arithmetic.  Integer SUM and PROD wrap modulo 2^N as in PyTorch; they are
 * computed on the unsigned type of the same width, so there is no signed
 * overflow (converting back to the signed type is modular on every compiler
 * we support).  Floating-point MIN and MAX propagate NaN like
 * torch.minimum/maximum; between +0 and -0 they return either one (b when
 * the two compare equal).  AVG kernels compute SUM; the collective divides
 * once at the end with chorus__reduce_finalize_avg().  float16 and bfloat16
 * elements are widened to float32, combined, and rounded back to 16 bits at
 * every call, which is what PyTorch does on CPU.  Do not build this file with
 * -ffast-math: it would drop the NaN handling.
 *
 * Vectorisation.  dst may alias a or b exactly, so the pointers cannot be
 * restrict, and GCC would need a run-time overlap check, which its -O2 cost
 * model ("very cheap") refuses, as it refuses loops that need a scalar
 * epilogue.  Each kernel therefore walks the buffer in blocks of 64 bytes
 * with an inner loop of constant trip count marked "ivdep" (no loop-carried
 * dependence, which holds for exact aliasing: element i is read before it is
 * written and by no other iteration), then finishes the tail element by
 * element.  At -O2 on baseline x86-64 (SSE2) GCC 12 vectorises every integer,
 * float32, float64 and bfloat16 kernel that way except int64 PROD/MIN/MAX,
 * which need AVX2/AVX-512 instructions.  The float16 kernels here stay
 * scalar (about 4 ns per element); reduce_simd.c has the F16C path.  Partial overlap of
 * dst with a or b is not allowed (see reduce.h) and would give wrong results.
 *
 * Conversions.  Written in portable C on the bit patterns (no F16C), exact
 * and independent of the floating-point environment (rounding mode, FTZ/DAZ).
 * float -> 16 bit rounds to nearest, ties to even; values at or beyond the
 * halfway point above the largest finite value become infinity; subnormal
 * results are rounded correctly.  NaN stays NaN with its sign and the top
 * bits of its payload, quiet bit set, as the F16C and AVX512-BF16
 * instructions do.  half -> float is exact and quiets a signalling NaN (as
 * vcvtph2ps does); bfloat16 -> float is the exact 16-bit shift.
 */
#include "reduce.h"

#include <pthread.h>
#include <string.h>

#include "util/env.h"

/* ------------------------------------------------------------ conversions */

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. */
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t mag = h & 0x7fffu; /* exponent and mantissa */
  uint32_t bits;
  if (mag >= 0x7c00u) {
    /* Infinity or NaN: all-ones exponent, payload kept, NaN made quiet. */
    bits = 0x7f800000u | (mag & 0x3ffu) << 13 | (mag > 0x7c00u ? 0x00400000u : 0u);
  } else if (mag >= 0x0400u) {
    /* Normal: move the exponent from bias 15 to bias 127. */
    bits = (mag << 13) + ((127u - 15u) << 23);
  } else {
    /* Zero or subnormal: the value is mag * 2^-24, a normal float. */
    bits = f32_bits((float)mag * 0x1p-24f);
  }
  return f32_from_bits(sign | bits);
}

static inline uint16_t float_to_half(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = x >> 16 & 0x8000u;
  uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u) /* NaN */
    return (uint16_t)(sign | 0x7e00u | (mag >> 13 & 0x3ffu));
  if (mag >= 0x477ff000u) /* >= 65520, halfway from 65504 to 2^16: overflow */
    return (uint16_t)(sign | 0x7c00u);
  if (mag >= 0x38800000u) {
    /* >= 2^-14, a normal half: rebias the exponent, then round away the 13
     * low mantissa bits to nearest even.  A carry out of the mantissa bumps
     * the exponent, which is the right result; the test above keeps it from
     * reaching the infinity encoding. */
    mag -= (127u - 15u) << 23;
    mag += 0xfffu + (mag >> 13 & 1u);
    return (uint16_t)(sign | mag >> 13);
  }
  if (mag < 0x33000000u) /* < 2^-25, less than half the smallest subnormal */
    return (uint16_t)sign;
  /* A subnormal half (or 2^-14 after rounding up).  The float is m * 2^(e-150)
   * with the implicit bit in m; in units of 2^-24 that is m >> (126 - e),
   * with a shift of 14 to 24 here. */
  uint32_t e = mag >> 23;
  uint32_t m = (mag & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;
  uint32_t q = m >> shift;
  uint32_t rest = m & ((1u << shift) - 1u);
  uint32_t halfway = 1u << (shift - 1u);
  q += rest > halfway || (rest == halfway && (q & 1u));
  return (uint16_t)(sign | q);
}

/* bfloat16 is the high half of a float32: 8 exponent bits, 7 mantissa bits. */
static inline float bf16_to_float(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

static inline uint16_t float_to_bf16(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, quiet */
    return (uint16_t)(x >> 16 | 0x0040u);
  /* Round to nearest even on the 16 dropped bits.  Overflow carries into the
   * exponent and yields infinity; subnormals need no special case. */
  x += 0x7fffu + (x >> 16 & 1u);
  return (uint16_t)(x >> 16);
}

float chorus__half_to_float(uint16_t h) { return half_to_float(h); }
uint16_t chorus__float_to_half(float f) { return float_to_half(f); }
float chorus__bf16_to_float(uint16_t b) { return bf16_to_float(b); }
uint16_t chorus__float_to_bf16(float f) { return float_to_bf16(f); }

/* ----------------------------------------------------- element operations */

/*
 * CHORUS__ELEM_<ARITH>_<OP>(T, U, p, q) combines two elements p and q that
 * were loaded into the compute type.  ARITH is INT (T is the element type, U
 * the unsigned type of its width) or FP (combined in float or double; T and
 * U unused).  Bitwise ops exist for INT only.
 */
#define CHORUS__ELEM_INT_SUM(T, U, p, q) ((T)((U)(p) + (U)(q)))
#define CHORUS__ELEM_INT_PROD(T, U, p, q) ((T)((U)(p) * (U)(q)))
#define CHORUS__ELEM_INT_MIN(T, U, p, q) ((p) < (q) ? (p) : (q))
#define CHORUS__ELEM_INT_MAX(T, U, p, q) ((p) > (q) ? (p) : (q))
#define CHORUS__ELEM_INT_AVG CHORUS__ELEM_INT_SUM
#define CHORUS__ELEM_INT_BAND(T, U, p, q) ((T)((U)(p) & (U)(q)))
#define CHORUS__ELEM_INT_BOR(T, U, p, q) ((T)((U)(p) | (U)(q)))
#define CHORUS__ELEM_INT_BXOR(T, U, p, q) ((T)((U)(p) ^ (U)(q)))

#define CHORUS__ELEM_FP_SUM(T, U, p, q) ((p) + (q))
#define CHORUS__ELEM_FP_PROD(T, U, p, q) ((p) * (q))
/* p != p is the NaN test: a NaN p is returned as is, a NaN q fails p < q. */
#define CHORUS__ELEM_FP_MIN(T, U, p, q) ((p) < (q) || (p) != (p) ? (p) : (q))
#define CHORUS__ELEM_FP_MAX(T, U, p, q) ((p) > (q) || (p) != (p) ? (p) : (q))
#define CHORUS__ELEM_FP_AVG CHORUS__ELEM_FP_SUM

/*
 * Which ops apply to which arithmetic: CHORUS__GATE(OP, ARITH)(M) is the
 * macro name M when OP is defined for ARITH, and a macro that swallows its
 * arguments when it is not.
 */
#define CHORUS__OPCLASS_SUM ANY
#define CHORUS__OPCLASS_PROD ANY
#define CHORUS__OPCLASS_MIN ANY
#define CHORUS__OPCLASS_MAX ANY
#define CHORUS__OPCLASS_AVG ANY
#define CHORUS__OPCLASS_BAND BITS
#define CHORUS__OPCLASS_BOR BITS
#define CHORUS__OPCLASS_BXOR BITS

#define CHORUS__SWALLOW(...)
#define CHORUS__GATE_ANY_INT(M) M
#define CHORUS__GATE_ANY_FP(M) M
#define CHORUS__GATE_BITS_INT(M) M
#define CHORUS__GATE_BITS_FP(M) CHORUS__SWALLOW
#define CHORUS__GATE_(CLASS, ARITH) CHORUS__GATE_##CLASS##_##ARITH
#define CHORUS__GATE2(CLASS, ARITH) CHORUS__GATE_(CLASS, ARITH)
#define CHORUS__GATE(OP, ARITH) CHORUS__GATE2(CHORUS__OPCLASS_##OP, ARITH)

/* ------------------------------------------------------------ dtype traits */

/*
 * One line per entry of CHORUS_DTYPE_MAP.  CHORUS__DTYPE_<NAME> is the
 * X-macro handed to CHORUS_OP_MAP: for each op it calls CHORUS__ACTION (defined
 * around each expansion below) with the op and the dtype's traits:
 *   NAME, name   as in CHORUS_DTYPE_MAP
 *   ARITH        INT or FP, selects CHORUS__ELEM_<ARITH>_<OP>
 *   T            the element's storage type
 *   U            the unsigned type of the same width (integer wrap-around;
 *                unused by FP)
 *   C            the type two elements are combined in
 *   LOAD, STORE  conversions T -> C and C -> T
 */
#define CHORUS__AS_IS(v) (v)
#define CHORUS__DTYPE_INT8(OP, op)                                              \
  CHORUS__ACTION(INT8, int8, OP, op, INT, int8_t, uint8_t, int8_t, CHORUS__AS_IS, CHORUS__AS_IS)
#define CHORUS__DTYPE_UINT8(OP, op)                                             \
  CHORUS__ACTION(UINT8, uint8, OP, op, INT, uint8_t, uint8_t, uint8_t, CHORUS__AS_IS,           \
                 CHORUS__AS_IS)
#define CHORUS__DTYPE_INT32(OP, op)                                             \
  CHORUS__ACTION(INT32, int32, OP, op, INT, int32_t, uint32_t, int32_t, CHORUS__AS_IS,          \
                 CHORUS__AS_IS)
#define CHORUS__DTYPE_INT64(OP, op)                                             \
  CHORUS__ACTION(INT64, int64, OP, op, INT, int64_t, uint64_t, int64_t, CHORUS__AS_IS,          \
                 CHORUS__AS_IS)
#define CHORUS__DTYPE_FLOAT16(OP, op)                                           \
  CHORUS__ACTION(FLOAT16, float16, OP, op, FP, uint16_t, uint16_t, float, half_to_float,       \
                 float_to_half)
#define CHORUS__DTYPE_BFLOAT16(OP, op)                                          \
  CHORUS__ACTION(BFLOAT16, bfloat16, OP, op, FP, uint16_t, uint16_t, float, bf16_to_float,     \
                 float_to_bf16)
#define CHORUS__DTYPE_FLOAT32(OP, op)                                           \
  CHORUS__ACTION(FLOAT32, float32, OP, op, FP, float, uint32_t, float, CHORUS__AS_IS,          \
                 CHORUS__AS_IS)
#define CHORUS__DTYPE_FLOAT64(OP, op)                                           \
  CHORUS__ACTION(FLOAT64, float64, OP, op, FP, double, uint64_t, double, CHORUS__AS_IS,        \
                 CHORUS__AS_IS)

/* Expands CHORUS__ACTION for every dtype x op. */
#define CHORUS__EACH_OP(NAME, name, size) CHORUS_OP_MAP(CHORUS__DTYPE_##NAME)
#define CHORUS__FOR_EACH_KERNEL CHORUS_DTYPE_MAP(CHORUS__EACH_OP)

/* Element sizes from chorus.h, to check the traits against. */
enum {
#define CHORUS__SIZE_ENUM(NAME, name, size) CHORUS__SIZE_##NAME = size,
  CHORUS_DTYPE_MAP(CHORUS__SIZE_ENUM)
#undef CHORUS__SIZE_ENUM
};

/* ----------------------------------------------------------------- kernels */

/* Promise GCC that the loop has no loop-carried dependence.  Clang needs no
 * help: its -O2 vectoriser adds the run-time overlap check itself (and its
 * "vectorize(assume_safety)" would warn wherever it cannot vectorise). */
#if defined(__GNUC__) && !defined(__clang__)
#define CHORUS__IVDEP _Pragma("GCC ivdep")
#else
#define CHORUS__IVDEP
#endif

/* d[k] = a[k] OP b[k] for one element, through the compute type C. */
#define CHORUS__REDUCE_STEP(k, OP, ARITH, T, U, C, LOAD, STORE)                 \
  do {                                                                         \
    C p_ = LOAD(x[k]), q_ = LOAD(y[k]);                                        \
    d[k] = STORE(CHORUS__ELEM_##ARITH##_##OP(T, U, p_, q_));                   \
  } while (0)

#define CHORUS__KERNEL(NAME, name, OP, op, ARITH, T, U, C, LOAD, STORE)      \
  _Static_assert(sizeof(T) == CHORUS__SIZE_##NAME, #name " traits disagree with chorus.h");   \
  static void reduce_##name##_##op(void *dst, const void *a, const void *b, size_t n) {         \
    enum { BLOCK = 64 / sizeof(T) }; /* elements in 64 bytes */                \
    T *d = dst;                                                                \
    const T *x = a, *y = b;                                                    \
    size_t i = 0;                                                              \
    for (; n - i >= BLOCK; i += BLOCK) {                                       \
      CHORUS__IVDEP                                                            \
      for (size_t j = 0; j < BLOCK; j++)                                       \
        CHORUS__REDUCE_STEP(i + j, OP, ARITH, T, U, C, LOAD, STORE);           \
    }                                                                          \
    for (; i < n; i++) CHORUS__REDUCE_STEP(i, OP, ARITH, T, U, C, LOAD, STORE); \
  }
#define CHORUS__DEFINE_KERNEL(NAME, name, OP, op, ARITH, ...)                   \
  CHORUS__GATE(OP, ARITH)(CHORUS__KERNEL)(NAME, name, OP, op, ARITH, __VA_ARGS__)

#define CHORUS__ACTION CHORUS__DEFINE_KERNEL
CHORUS__FOR_EACH_KERNEL
#undef CHORUS__ACTION

/* [dtype][op] -> kernel; NULL where the pair is not supported. */
#define CHORUS__ENTRY(NAME, name, OP, op, ...) [CHORUS_##NAME][CHORUS_##OP] = reduce_##name##_##op,
#define CHORUS__TABLE_ENTRY(NAME, name, OP, op, ARITH, ...)                     \
  CHORUS__GATE(OP, ARITH)(CHORUS__ENTRY)(NAME, name, OP, op)

static const chorus__reduce_fn_t kernels[CHORUS_DTYPE_COUNT][CHORUS_OP_COUNT] = {
#define CHORUS__ACTION CHORUS__TABLE_ENTRY
    CHORUS__FOR_EACH_KERNEL
#undef CHORUS__ACTION
};

chorus__reduce_fn_t chorus__reduce_scalar_fn(chorus_dtype_t dtype, chorus_op_t op) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || (unsigned)op >= CHORUS_OP_COUNT) return NULL;
  return kernels[dtype][op];
}

/* ---------------------------------------------------------------- dispatch */

static const char *const isa_names[CHORUS__ISA_COUNT] = {"scalar", "avx2"};

const char *chorus__reduce_isa_name(chorus__isa_t isa) {
  return (unsigned)isa < CHORUS__ISA_COUNT ? isa_names[isa] : NULL;
}

int chorus__reduce_isa_available(chorus__isa_t isa) {
  switch (isa) {
  case CHORUS__ISA_SCALAR: return 1;
  case CHORUS__ISA_AVX2: return chorus__reduce_avx2_usable();
  default: return 0;
  }
}

chorus__reduce_fn_t chorus__reduce_fn_isa(chorus_dtype_t dtype, chorus_op_t op, chorus__isa_t isa) {
  chorus__reduce_fn_t fn = chorus__reduce_scalar_fn(dtype, op);
  if (!fn || !chorus__reduce_isa_available(isa)) return NULL;
  if (isa == CHORUS__ISA_AVX2) {
    chorus__reduce_fn_t v = chorus__reduce_avx2_fn(dtype, op);
    if (v) return v;
  }
  return fn;
}

/* The ISA in use and its kernel table, resolved once from the CPU and
 * CHORUS_REDUCE_ISA ("auto", or an ISA's name; an unknown or unavailable
 * name means auto). */
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
static chorus__isa_t isa_used;
static chorus__reduce_fn_t resolved[CHORUS_DTYPE_COUNT][CHORUS_OP_COUNT];

static void isa_resolve(void) {
  chorus__isa_t best = CHORUS__ISA_SCALAR;
  for (int i = CHORUS__ISA_COUNT - 1; i > 0; i--)
    if (chorus__reduce_isa_available((chorus__isa_t)i)) {
      best = (chorus__isa_t)i;
      break;
    }
  const char *want = chorus__env()->REDUCE_ISA;
  for (int i = 0; i < CHORUS__ISA_COUNT; i++)
    if (want && strcmp(want, isa_names[i]) == 0 && chorus__reduce_isa_available((chorus__isa_t)i))
      best = (chorus__isa_t)i;
  isa_used = best;
  for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
    for (int o = 0; o < CHORUS_OP_COUNT; o++)
      resolved[d][o] = chorus__reduce_fn_isa((chorus_dtype_t)d, (chorus_op_t)o, best);
}

chorus__isa_t chorus__reduce_isa(void) {
  pthread_once(&isa_once, isa_resolve);
  return isa_used;
}

chorus__reduce_fn_t chorus__reduce_fn(chorus_dtype_t dtype, chorus_op_t op) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || (unsigned)op >= CHORUS_OP_COUNT) return NULL;
  pthread_once(&isa_once, isa_resolve);
  return resolved[dtype][op];
}

int chorus__reduce_supported(chorus_dtype_t dtype, chorus_op_t op) {
  return chorus__reduce_fn(dtype, op) != NULL;
}

/* ------------------------------------------------------------------- AVG */

/* Integer division in C truncates toward zero, as required; the integer
 * types are promoted to int or stay int64_t, so nranks is not narrowed. */
#define CHORUS__DIV_INT(C, p, nranks) ((p) / (nranks))
#define CHORUS__DIV_FP(C, p, nranks) ((p) / (C)(nranks))

#define CHORUS__AVG_CASE(NAME, name, OP, op, ARITH, T, U, C, LOAD, STORE)       \
  case CHORUS_##NAME: {                                                        \
    T *v = buf;                                                                \
    for (size_t i = 0; i < n; i++) v[i] = STORE(CHORUS__DIV_##ARITH(C, LOAD(v[i]), nranks));   \
    break;                                                                     \
  }
#define CHORUS__AVG_DTYPE(NAME, name, size) CHORUS__DTYPE_##NAME(AVG, avg)

/* nranks < 2 leaves buf unchanged (nothing to divide by, or a caller bug that
 * must not become a division by zero); so does an invalid dtype. */
void chorus__reduce_finalize_avg(void *buf, size_t n, chorus_dtype_t dtype, int nranks) {
  if (nranks < 2) return;
  switch (dtype) {
#define CHORUS__ACTION CHORUS__AVG_CASE
    CHORUS_DTYPE_MAP(CHORUS__AVG_DTYPE)
#undef CHORUS__ACTION
  default:
    break;
  }
}
