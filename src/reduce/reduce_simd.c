/*
 * reduce_simd.c - AVX2 (+F16C) versions of the hot reduction kernels, x86-64
 * only; chorus__reduce_fn() in reduce.c picks them at run time when the CPU
 * has AVX2 and F16C.  Each function carries its own target attribute, so the
 * library is still built for baseline x86-64 (never -march=native).  Other
 * architectures, and dtype x op pairs not listed here, use the portable
 * kernels of reduce.c.
 *
 * Bit-identical to the portable kernels (tests/unit/test_reduce.c checks it):
 *  - float32/float64 SUM, PROD, AVG: one IEEE operation per element, a OP b
 *    in that operand order (the NaN a x86 operation returns is its first
 *    NaN operand, quieted), as in the portable loop.
 *  - MIN/MAX: the portable rule "p < q or p is NaN ? p : q" (p from a, q
 *    from b) as compare masks and a blend: NaN propagates, +0/-0 gives b.
 *  - float16: vcvtph2ps / vcvtps2ph with round-to-nearest-even in the
 *    immediate (not MXCSR), which is what the portable conversions do,
 *    including NaN quieting and payload truncation.
 *  - bfloat16: widened by a 16-bit shift (or mask), rounded back with the
 *    same integer round-to-nearest-even and NaN rule as float_to_bf16().
 *  - integers: wrap-around add and multiply, exact min/max.
 * The float arithmetic is subject to MXCSR (FTZ/DAZ, rounding mode) exactly
 * as the portable SSE code is.  Loads and stores are unaligned; dst may alias
 * a or b exactly, since each vector is loaded before its own slot is stored.
 * Elements past the last whole vector go to the portable kernel.
 */
#include "reduce.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <cpuid.h>
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2,f16c")))

/* AVX2 via the compiler's CPU model (which also checks that the OS saves the
 * YMM state); F16C from CPUID leaf 1, since clang's __builtin_cpu_supports
 * does not know "f16c". */
int chorus__reduce_avx2_usable(void) {
  unsigned eax, ebx, ecx, edx;
  if (!__builtin_cpu_supports("avx2")) return 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
  return (ecx & bit_F16C) != 0;
}

/* ------------------------------------------------- per-type load / store */

#define LD_F32(p) _mm256_loadu_ps(p)
#define ST_F32(p, v) _mm256_storeu_ps(p, v)
#define LD_F64(p) _mm256_loadu_pd(p)
#define ST_F64(p, v) _mm256_storeu_pd(p, v)
#define LD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define ST_I(p, v) _mm256_storeu_si256((__m256i *)(p), v)

/* float16: 8 halves <-> 8 floats. */
#define LD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define ST_F16(p, v) _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT))

/* bfloat16: a vector of 16 holds the even elements in the high halves of
 * its 32-bit lanes after a 16-bit left shift and the odd ones in place after
 * masking the low halves, so no shuffles are needed either way.  Rounding
 * works on the float's bits as float_to_bf16() does: NaN keeps its top half
 * with the quiet bit set, anything else adds 0x7fff + (bit 16) and keeps the
 * top half (round to nearest even; overflow carries into infinity). */
static inline AVX2_FN __m256 bf16_even(__m256i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline AVX2_FN __m256 bf16_odd(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* The rounded bfloat16 in the high half of each lane (low half garbage). */
static inline AVX2_FN __m256i bf16_round(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i abs = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i qnan = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
  return _mm256_blendv_epi8(r, qnan, nan);
}

static inline AVX2_FN __m256i bf16_join(__m256 even, __m256 odd) {
  return _mm256_or_si256(_mm256_srli_epi32(bf16_round(even), 16),
                         _mm256_and_si256(bf16_round(odd), _mm256_set1_epi32((int)0xffff0000u)));
}

/* ------------------------------------------------------ element operations */

/* a OP b with a as the first source operand, whose NaN x86 returns when both
 * are NaN.  The intrinsics would let the compiler commute the operands (it
 * does), so the instruction is written out. */
#define ORDERED_OP(name, V, insn)                                               \
  static inline AVX2_FN V name(V p, V q) {                                     \
    V r;                                                                       \
    __asm__(insn " %2, %1, %0" : "=x"(r) : "x"(p), "xm"(q));                   \
    return r;                                                                  \
  }
ORDERED_OP(ps_add, __m256, "vaddps")
ORDERED_OP(ps_mul, __m256, "vmulps")
ORDERED_OP(pd_add, __m256d, "vaddpd")
ORDERED_OP(pd_mul, __m256d, "vmulpd")

#define PS_SUM(p, q) ps_add(p, q)
#define PS_PROD(p, q) ps_mul(p, q)
/* p < q (or >) or p is NaN ? p : q, lane by lane. */
#define PICK_P(T, p, q, CMP)                                                    \
  _mm256_blendv_##T(q, p,                                                      \
                    _mm256_or_##T(_mm256_cmp_##T(p, q, CMP), _mm256_cmp_##T(p, p, _CMP_UNORD_Q)))
#define PS_MIN(p, q) PICK_P(ps, p, q, _CMP_LT_OQ)
#define PS_MAX(p, q) PICK_P(ps, p, q, _CMP_GT_OQ)

#define PD_SUM(p, q) pd_add(p, q)
#define PD_PROD(p, q) pd_mul(p, q)
#define PD_MIN(p, q) PICK_P(pd, p, q, _CMP_LT_OQ)
#define PD_MAX(p, q) PICK_P(pd, p, q, _CMP_GT_OQ)

#define EPI32_SUM(p, q) _mm256_add_epi32(p, q)
#define EPI32_PROD(p, q) _mm256_mullo_epi32(p, q)
#define EPI32_MIN(p, q) _mm256_min_epi32(p, q)
#define EPI32_MAX(p, q) _mm256_max_epi32(p, q)
#define EPI64_SUM(p, q) _mm256_add_epi64(p, q)
#define EPI64_MIN(p, q) _mm256_blendv_epi8(q, p, _mm256_cmpgt_epi64(q, p))
#define EPI64_MAX(p, q) _mm256_blendv_epi8(q, p, _mm256_cmpgt_epi64(p, q))

/* ------------------------------------------------------------------ kernels */

/*
 * avx2_<name>_<op>: LANES elements per vector of type V, two vectors per
 * iteration, then one, then the portable kernel for the rest.
 */
#define AVX2_KERNEL(NAME, name, OP, op, T, V, LANES, LD, ST, EXPR)            \
  static AVX2_FN void avx2_##name##_##op(void *dst, const void *a, const void *b, size_t n) { \
    T *d = dst;                                                                \
    const T *x = a, *y = b;                                                    \
    size_t i = 0;                                                              \
    for (; n - i >= 2 * (size_t)(LANES); i += 2 * (LANES)) {                   \
      V p0 = LD(x + i), q0 = LD(y + i);                                        \
      V p1 = LD(x + i + (LANES)), q1 = LD(y + i + (LANES));                    \
      ST(d + i, EXPR(p0, q0));                                                 \
      ST(d + i + (LANES), EXPR(p1, q1));                                       \
    }                                                                          \
    if (n - i >= (size_t)(LANES)) {                                            \
      V p0 = LD(x + i), q0 = LD(y + i);                                        \
      ST(d + i, EXPR(p0, q0));                                                 \
      i += (LANES);                                                            \
    }                                                                          \
    if (i < n) chorus__reduce_scalar_fn(CHORUS_##NAME, CHORUS_##OP)(d + i, x + i, y + i, n - i); \
  }

/* avx2_bfloat16_<op>: 16 elements per iteration as even and odd halves. */
#define AVX2_BF16_KERNEL(NAME, name, OP, op, EXPR)                              \
  static AVX2_FN void avx2_##name##_##op(void *dst, const void *a, const void *b, size_t n) { \
    uint16_t *d = dst;                                                         \
    const uint16_t *x = a, *y = b;                                             \
    size_t i = 0;                                                              \
    for (; n - i >= 16; i += 16) {                                             \
      __m256i p = LD_I(x + i), q = LD_I(y + i);                                \
      __m256 pe = bf16_even(p), qe = bf16_even(q), po = bf16_odd(p), qo = bf16_odd(q); \
      ST_I(d + i, bf16_join(EXPR(pe, qe), EXPR(po, qo)));                      \
    }                                                                          \
    if (i < n) chorus__reduce_scalar_fn(CHORUS_##NAME, CHORUS_##OP)(d + i, x + i, y + i, n - i); \
  }

#define AVX2_BF16_KERNELS(X)                                                    \
  X(BFLOAT16, bfloat16, SUM, sum, PS_SUM)                                      \
  X(BFLOAT16, bfloat16, AVG, avg, PS_SUM)                                      \
  X(BFLOAT16, bfloat16, PROD, prod, PS_PROD)                                   \
  X(BFLOAT16, bfloat16, MIN, min, PS_MIN)                                      \
  X(BFLOAT16, bfloat16, MAX, max, PS_MAX)

/* X(NAME, name, OP, op, T, V, LANES, LD, ST, EXPR): every other AVX2 kernel. */
#define AVX2_KERNELS(X)                                                         \
  X(FLOAT32, float32, SUM, sum, float, __m256, 8, LD_F32, ST_F32, PS_SUM)       \
  X(FLOAT32, float32, AVG, avg, float, __m256, 8, LD_F32, ST_F32, PS_SUM)       \
  X(FLOAT32, float32, PROD, prod, float, __m256, 8, LD_F32, ST_F32, PS_PROD)    \
  X(FLOAT32, float32, MIN, min, float, __m256, 8, LD_F32, ST_F32, PS_MIN)       \
  X(FLOAT32, float32, MAX, max, float, __m256, 8, LD_F32, ST_F32, PS_MAX)       \
  X(FLOAT64, float64, SUM, sum, double, __m256d, 4, LD_F64, ST_F64, PD_SUM)     \
  X(FLOAT64, float64, AVG, avg, double, __m256d, 4, LD_F64, ST_F64, PD_SUM)     \
  X(FLOAT64, float64, PROD, prod, double, __m256d, 4, LD_F64, ST_F64, PD_PROD)  \
  X(FLOAT64, float64, MIN, min, double, __m256d, 4, LD_F64, ST_F64, PD_MIN)     \
  X(FLOAT64, float64, MAX, max, double, __m256d, 4, LD_F64, ST_F64, PD_MAX)     \
  X(FLOAT16, float16, SUM, sum, uint16_t, __m256, 8, LD_F16, ST_F16, PS_SUM)    \
  X(FLOAT16, float16, AVG, avg, uint16_t, __m256, 8, LD_F16, ST_F16, PS_SUM)    \
  X(FLOAT16, float16, PROD, prod, uint16_t, __m256, 8, LD_F16, ST_F16, PS_PROD) \
  X(FLOAT16, float16, MIN, min, uint16_t, __m256, 8, LD_F16, ST_F16, PS_MIN)    \
  X(FLOAT16, float16, MAX, max, uint16_t, __m256, 8, LD_F16, ST_F16, PS_MAX)    \
  X(INT32, int32, SUM, sum, int32_t, __m256i, 8, LD_I, ST_I, EPI32_SUM)         \
  X(INT32, int32, AVG, avg, int32_t, __m256i, 8, LD_I, ST_I, EPI32_SUM)         \
  X(INT32, int32, PROD, prod, int32_t, __m256i, 8, LD_I, ST_I, EPI32_PROD)      \
  X(INT32, int32, MIN, min, int32_t, __m256i, 8, LD_I, ST_I, EPI32_MIN)         \
  X(INT32, int32, MAX, max, int32_t, __m256i, 8, LD_I, ST_I, EPI32_MAX)         \
  X(INT64, int64, SUM, sum, int64_t, __m256i, 4, LD_I, ST_I, EPI64_SUM)         \
  X(INT64, int64, AVG, avg, int64_t, __m256i, 4, LD_I, ST_I, EPI64_SUM)         \
  X(INT64, int64, MIN, min, int64_t, __m256i, 4, LD_I, ST_I, EPI64_MIN)         \
  X(INT64, int64, MAX, max, int64_t, __m256i, 4, LD_I, ST_I, EPI64_MAX)

AVX2_KERNELS(AVX2_KERNEL)
AVX2_BF16_KERNELS(AVX2_BF16_KERNEL)

#define AVX2_ENTRY(NAME, name, OP, op, ...) [CHORUS_##NAME][CHORUS_##OP] = avx2_##name##_##op,
static const chorus__reduce_fn_t avx2_kernels[CHORUS_DTYPE_COUNT][CHORUS_OP_COUNT] = {
    AVX2_KERNELS(AVX2_ENTRY) AVX2_BF16_KERNELS(AVX2_ENTRY)};

chorus__reduce_fn_t chorus__reduce_avx2_fn(chorus_dtype_t dtype, chorus_op_t op) {
  if ((unsigned)dtype >= CHORUS_DTYPE_COUNT || (unsigned)op >= CHORUS_OP_COUNT) return NULL;
  return avx2_kernels[dtype][op];
}

#else /* not x86-64: the portable kernels only */

int chorus__reduce_avx2_usable(void) { return 0; }

chorus__reduce_fn_t chorus__reduce_avx2_fn(chorus_dtype_t dtype, chorus_op_t op) {
  (void)dtype;
  (void)op;
  return NULL;
}

#endif
