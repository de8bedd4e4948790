/*
 * test_reduce.c - the reduction kernels, AVG finalisation and 16-bit float
 * conversions of src/reduce against independent scalar references.
 *
 * The references here share no code with reduce.c:
 *  - 16-bit floats (IEEE half, bfloat16) are decoded from their fields with
 *    ldexp() and rounded by scaling to an integer number of quanta in double
 *    precision and calling nearbyint() (ties to even in the default mode).
 *  - float32 results are computed in double and rounded once to float, which
 *    is the correctly rounded float result for + * / (53 >= 2 * 24 + 2).
 *  - Integer results are computed exactly in int64_t and reduced modulo 2^N
 *    by masking the two's-complement bit pattern.
 * Results are compared bit for bit, except where several answers are right:
 * any NaN where a NaN is expected (a quiet one for 16-bit types) and either
 * zero for MIN/MAX of +0 and -0.
 *
 * Kernels run on pseudo-random data with special values mixed in, for
 * n = 0, 1, 7, 63, 64, 65, 1000 and out of place, dst == a, dst == b and
 * dst == a == b.  dst carries canary elements past n.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "harness.h"
#include "reduce/reduce.h"

static unsigned long long checks; /* element comparisons made */

/* ------------------------------------------------------------- utilities */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint32_t bits_of_float(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static float float_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint64_t bits_of_double(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}

static double double_of_bits(uint64_t u) {
  double d;
  memcpy(&d, &u, 8);
  return d;
}

/* ------------------------------------------- reference 16-bit float formats */

typedef struct {
  const char *name;
  int mant_bits; /* stored mantissa bits; the exponent has 15 - mant_bits */
  int emax;      /* largest exponent, also the bias; emin = 1 - emax */
} fmt16_t;

static const fmt16_t fmt_half = {"float16", 10, 15};
static const fmt16_t fmt_bf16 = {"bfloat16", 7, 127};

static int fmt_emin(fmt16_t f) { return 1 - f.emax; }
static unsigned fmt_exp_all_ones(fmt16_t f) { return (1u << (15 - f.mant_bits)) - 1u; }
static uint16_t fmt_inf(fmt16_t f) { return (uint16_t)(fmt_exp_all_ones(f) << f.mant_bits); }

static int ref_is_nan16(fmt16_t f, uint16_t bits) {
  unsigned e = (bits >> f.mant_bits) & fmt_exp_all_ones(f);
  unsigned m = bits & ((1u << f.mant_bits) - 1u);
  return e == fmt_exp_all_ones(f) && m != 0;
}

static int ref_is_quiet_nan16(fmt16_t f, uint16_t bits) {
  return ref_is_nan16(f, bits) && (bits >> (f.mant_bits - 1) & 1u);
}

/* The value of a 16-bit pattern, from its sign, exponent and mantissa. */
static double ref_decode16(fmt16_t f, uint16_t bits) {
  unsigned e = (bits >> f.mant_bits) & fmt_exp_all_ones(f);
  unsigned m = bits & ((1u << f.mant_bits) - 1u);
  double v;
  if (e == fmt_exp_all_ones(f))
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexp((double)m, fmt_emin(f) - f.mant_bits);
  else
    v = ldexp((double)(m + (1u << f.mant_bits)), (int)e - f.emax - f.mant_bits);
  return (bits & 0x8000u) ? -v : v;
}

/* The 16-bit pattern nearest to v (not NaN), ties to even. */
static uint16_t ref_round16(fmt16_t f, double v) {
  uint16_t sign = signbit(v) ? 0x8000u : 0u;
  double a = fabs(v);
  if (isinf(a)) return sign | fmt_inf(f);
  int e; /* exponent of the quantum's binade: a in [2^e, 2^(e+1)) or subnormal */
  if (a >= ldexp(1.0, fmt_emin(f))) {
    frexp(a, &e);
    e -= 1;
  } else {
    e = fmt_emin(f);
  }
  double q = nearbyint(ldexp(a, f.mant_bits - e)); /* quanta; exact scaling */
  if (q == ldexp(1.0, f.mant_bits + 1)) {         /* rounded up into the next binade */
    q /= 2;
    e += 1;
  }
  if (e > f.emax) return sign | fmt_inf(f);
  if (q < ldexp(1.0, f.mant_bits)) return sign | (uint16_t)q; /* subnormal or zero */
  unsigned biased = (unsigned)(e + f.emax);
  return sign | (uint16_t)(biased << f.mant_bits | ((unsigned)q - (1u << f.mant_bits)));
}

static float conv_to_float(fmt16_t f, uint16_t h) {
  return f.mant_bits == 10 ? chorus__half_to_float(h) : chorus__bf16_to_float(h);
}

static uint16_t conv_from_float(fmt16_t f, float x) {
  return f.mant_bits == 10 ? chorus__float_to_half(x) : chorus__float_to_bf16(x);
}

/* Checks one float -> 16-bit conversion against the reference; 0 if right. */
static int check_round(fmt16_t f, float x) {
  uint16_t got = conv_from_float(f, x);
  checks++;
  if (isnan(x)) {
    if (ref_is_quiet_nan16(f, got) && (got >> 15) == (bits_of_float(x) >> 31)) return 0;
    HARNESS_FAIL("%s(NaN 0x%08x) = 0x%04x, want a quiet NaN of the same sign", f.name,
                 bits_of_float(x), got);
    return -1;
  }
  uint16_t want = ref_round16(f, (double)x);
  if (got == want) return 0;
  HARNESS_FAIL("%s(%a = 0x%08x) = 0x%04x, want 0x%04x", f.name, (double)x, bits_of_float(x), got,
               want);
  return -1;
}

/* ---------------------------------------------------------- conversions */

/* Every 16-bit pattern decodes to its value and converts back to itself. */
static void check_all_patterns(fmt16_t f) {
  for (uint32_t h = 0; h <= 0xffff; h++) {
    float x = conv_to_float(f, (uint16_t)h);
    double want = ref_decode16(f, (uint16_t)h);
    uint16_t back = conv_from_float(f, x);
    checks += 2;
    if (isnan(want)) {
      if (!isnan(x) || !!signbit(x) != !!(h & 0x8000u)) {
        HARNESS_FAIL("%s pattern 0x%04x -> %a, want NaN of the same sign", f.name, h, (double)x);
        return;
      }
      if (!ref_is_quiet_nan16(f, back) || (back & 0x8000u) != (h & 0x8000u)) {
        HARNESS_FAIL("%s NaN 0x%04x -> float -> 0x%04x, want a quiet NaN of the same sign", f.name,
                     h, back);
        return;
      }
      continue;
    }
    if ((double)x != want || !!signbit(x) != !!signbit(want)) {
      HARNESS_FAIL("%s pattern 0x%04x -> %a, want %a", f.name, h, (double)x, want);
      return;
    }
    if (back != h) {
      HARNESS_FAIL("%s pattern 0x%04x -> %a -> 0x%04x: no round trip", f.name, h, (double)x, back);
      return;
    }
  }
}

/* Floats at, just below and just above every halfway point between adjacent
 * finite 16-bit values (including the one above the largest, which
 * overflows), of both signs: ties to even, and the ulp either side. */
static void check_halfway_points(fmt16_t f) {
  for (uint32_t h = 0; h < fmt_inf(f); h++) {
    double lo = ref_decode16(f, (uint16_t)h);
    double hi = h + 1 == fmt_inf(f) ? ldexp(1.0, f.emax + 1) : ref_decode16(f, (uint16_t)(h + 1));
    double mid = (lo + hi) / 2; /* one more significant bit: exact as a float */
    uint32_t mb = bits_of_float((float)mid);
    if ((double)float_of_bits(mb) != mid) {
      HARNESS_FAIL("%s: halfway point %a not a float", f.name, mid);
      return;
    }
    for (int64_t delta = -2; delta <= 2; delta++) {
      for (uint32_t sign = 0; sign <= 1; sign++) {
        uint32_t xb = (uint32_t)((int64_t)mb + delta) | sign << 31;
        if (check_round(f, float_of_bits(xb))) return;
      }
    }
  }
}

/* A sweep over all float bit patterns with an odd stride, plus random ones. */
static void check_float_sweep(fmt16_t f) {
  for (uint64_t u = 0; u <= 0xffffffffu; u += 1031) {
    if (check_round(f, float_of_bits((uint32_t)u))) return;
  }
  uint64_t seed = 42;
  for (int i = 0; i < 200000; i++) {
    if (check_round(f, float_of_bits((uint32_t)rng_next(&seed)))) return;
  }
}

TEST(half_all_patterns) { check_all_patterns(fmt_half); }
TEST(bf16_all_patterns) { check_all_patterns(fmt_bf16); }
TEST(half_halfway_points) { check_halfway_points(fmt_half); }
TEST(bf16_halfway_points) { check_halfway_points(fmt_bf16); }
TEST(half_float_sweep) { check_float_sweep(fmt_half); }
TEST(bf16_float_sweep) { check_float_sweep(fmt_bf16); }

/* Hand-checked cases, written out so the reference above is checked too. */
TEST(half_known_values) {
  static const struct {
    float x;
    uint16_t want;
  } cases[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {-2.0f, 0xc000},
      {65504.0f, 0x7bff},            /* largest finite */
      {65519.99609375f, 0x7bff},     /* just below the overflow threshold */
      {65520.0f, 0x7c00},            /* halfway to 2^16: ties to even = inf */
      {-65520.0f, 0xfc00},
      {1e10f, 0x7c00},
      {INFINITY, 0x7c00},
      {-INFINITY, 0xfc00},
      {FLT_MAX, 0x7c00},
      {0x1p-14f, 0x0400},            /* smallest normal */
      {0x1p-24f, 0x0001},            /* smallest subnormal */
      {0x1p-25f, 0x0000},            /* halfway to 0x0001: ties to even = 0 */
      {0x1.000002p-25f, 0x0001},     /* just above halfway */
      {0x3p-25f, 0x0002},            /* halfway 1..2: even = 2 */
      {0x5p-25f, 0x0002},            /* halfway 2..3: even = 2 */
      {0x1.ff8p-15f, 0x03ff},        /* largest subnormal */
      {0x1.ffcp-15f, 0x0400},        /* ... + half a quantum: ties to even = smallest normal */
      {0x1.002p0f, 0x3c00},          /* 1 + 2^-11: halfway, even = 1 */
      {0x1.006p0f, 0x3c02},          /* 1 + 3 * 2^-11: halfway, even = 1 + 2^-9 */
      {0x1.ffep0f, 0x4000},          /* halfway below 2: even = 2 */
      {FLT_MIN, 0x0000},
      {-0x1p-149f, 0x8000},          /* smallest float subnormal: signed zero */
      {0.1f, 0x2e66},
      {3.14159265f, 0x4248},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    checks++;
    uint16_t got = chorus__float_to_half(cases[i].x);
    if (got != cases[i].want) {
      HARNESS_FAIL("float_to_half(%a) = 0x%04x, want 0x%04x", (double)cases[i].x, got,
                   cases[i].want);
      return;
    }
    ASSERT_EQ(ref_round16(fmt_half, (double)cases[i].x), cases[i].want);
  }
  ASSERT_TRUE(chorus__half_to_float(0x0001) == 0x1p-24f);
  ASSERT_TRUE(chorus__half_to_float(0x03ff) == 0x1.ff8p-15f);
  ASSERT_TRUE(chorus__half_to_float(0x7bff) == 65504.0f);
  ASSERT_TRUE(chorus__half_to_float(0xfc00) == -INFINITY);
  ASSERT_TRUE(isnan(chorus__half_to_float(0x7e00)));
  /* A signalling NaN widens to a quiet one, as vcvtph2ps does. */
  ASSERT_EQ(bits_of_float(chorus__half_to_float(0x7c01)), 0x7fc02000u);
  ASSERT_EQ(bits_of_float(chorus__half_to_float(0xfe00)), 0xffc00000u);
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_half, chorus__float_to_half(NAN)));
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_half, chorus__float_to_half(float_of_bits(0x7f800001u))));
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_half, chorus__float_to_half(float_of_bits(0xffc00000u))));
}

TEST(bf16_known_values) {
  static const struct {
    uint32_t x;
    uint16_t want;
  } cases[] = {
      {0x00000000u, 0x0000}, {0x80000000u, 0x8000}, {0x3f800000u, 0x3f80}, /* 1.0 */
      {0x3f808000u, 0x3f80}, /* 1 + 2^-8: halfway, even = 1 */
      {0x3f818000u, 0x3f82}, /* 1 + 3 * 2^-8: halfway, even up */
      {0x3f808001u, 0x3f81}, /* just above halfway */
      {0x3f817fffu, 0x3f81}, /* just below halfway */
      {0x7f7f7fffu, 0x7f7f}, /* below the overflow threshold */
      {0x7f7f8000u, 0x7f80}, /* halfway past the largest: inf */
      {0x7f7fffffu, 0x7f80}, /* FLT_MAX */
      {0xff7fffffu, 0xff80}, {0x7f800000u, 0x7f80}, {0xff800000u, 0xff80},
      {0x00008000u, 0x0000}, /* subnormal halfway, even = 0 */
      {0x00018000u, 0x0002}, /* subnormal halfway, even up */
      {0x00008001u, 0x0001}, {0x007fffffu, 0x0080}, /* largest subnormal rounds to FLT_MIN */
      {0x3dcccccdu, 0x3dcd}, /* 0.1 */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    checks++;
    uint16_t got = chorus__float_to_bf16(float_of_bits(cases[i].x));
    if (got != cases[i].want) {
      HARNESS_FAIL("float_to_bf16(0x%08x) = 0x%04x, want 0x%04x", cases[i].x, got, cases[i].want);
      return;
    }
    ASSERT_EQ(ref_round16(fmt_bf16, (double)float_of_bits(cases[i].x)), cases[i].want);
  }
  ASSERT_TRUE(chorus__bf16_to_float(0x3f80) == 1.0f);
  ASSERT_TRUE(chorus__bf16_to_float(0x0001) == 0x1p-133f);
  ASSERT_TRUE(chorus__bf16_to_float(0xff80) == -INFINITY);
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_bf16, chorus__float_to_bf16(NAN)));
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_bf16, chorus__float_to_bf16(float_of_bits(0x7f800001u))));
  uint16_t neg_nan = chorus__float_to_bf16(float_of_bits(0xffc00000u));
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_bf16, neg_nan) && (neg_nan & 0x8000u));
}

/* ------------------------------------------------------ dtypes and ops */

typedef enum { K_SINT, K_UINT, K_HALF, K_BF16, K_F32, K_F64 } kind_t;

/* The test's own view of the dtypes, written independently of reduce.c. */
static const struct dtype_info {
  chorus_dtype_t dtype;
  const char *name;
  size_t size;
  kind_t kind;
} dtypes[] = {
    {CHORUS_INT8, "int8", 1, K_SINT},        {CHORUS_UINT8, "uint8", 1, K_UINT},
    {CHORUS_INT32, "int32", 4, K_SINT},      {CHORUS_INT64, "int64", 8, K_SINT},
    {CHORUS_FLOAT16, "float16", 2, K_HALF},  {CHORUS_BFLOAT16, "bfloat16", 2, K_BF16},
    {CHORUS_FLOAT32, "float32", 4, K_F32},   {CHORUS_FLOAT64, "float64", 8, K_F64},
};
#define N_DTYPES (sizeof dtypes / sizeof dtypes[0])

static const struct dtype_info *info_of(chorus_dtype_t dt) {
  for (size_t i = 0; i < N_DTYPES; i++)
    if (dtypes[i].dtype == dt) return &dtypes[i];
  return NULL;
}

static const chorus_op_t all_ops[] = {CHORUS_SUM, CHORUS_PROD, CHORUS_MIN,  CHORUS_MAX,
                                      CHORUS_AVG, CHORUS_BAND, CHORUS_BOR, CHORUS_BXOR};
#define N_OPS (sizeof all_ops / sizeof all_ops[0])

static int is_int_kind(kind_t k) { return k == K_SINT || k == K_UINT; }
static int is_bitwise(chorus_op_t op) {
  return op == CHORUS_BAND || op == CHORUS_BOR || op == CHORUS_BXOR;
}

TEST(supported_table) {
  ASSERT_EQ(N_DTYPES, CHORUS_DTYPE_COUNT);
  ASSERT_EQ(N_OPS, CHORUS_OP_COUNT);
  for (size_t d = 0; d < N_DTYPES; d++) {
    ASSERT_EQ(chorus_dtype_size(dtypes[d].dtype), dtypes[d].size);
    ASSERT_STREQ(chorus_dtype_name(dtypes[d].dtype), dtypes[d].name);
    for (size_t o = 0; o < N_OPS; o++) {
      int want = is_int_kind(dtypes[d].kind) || !is_bitwise(all_ops[o]);
      int supported = chorus__reduce_supported(dtypes[d].dtype, all_ops[o]);
      int has_fn = chorus__reduce_fn(dtypes[d].dtype, all_ops[o]) != NULL;
      checks++;
      if (supported != want || has_fn != want) {
        HARNESS_FAIL("%s x %s: supported %d, kernel %s, want %d", dtypes[d].name,
                     chorus_op_name(all_ops[o]), supported, has_fn ? "found" : "NULL", want);
        return;
      }
    }
  }
  /* Out-of-range values. */
  const int bad_dtypes[] = {-1, CHORUS_DTYPE_COUNT, CHORUS_DTYPE_COUNT + 1, 1000000};
  const int bad_ops[] = {-1, CHORUS_OP_COUNT, CHORUS_OP_COUNT + 1, 1000000};
  for (size_t i = 0; i < 4; i++) {
    ASSERT_TRUE(chorus__reduce_fn((chorus_dtype_t)bad_dtypes[i], CHORUS_SUM) == NULL);
    ASSERT_EQ(chorus__reduce_supported((chorus_dtype_t)bad_dtypes[i], CHORUS_SUM), 0);
    ASSERT_TRUE(chorus__reduce_fn(CHORUS_INT32, (chorus_op_t)bad_ops[i]) == NULL);
    ASSERT_EQ(chorus__reduce_supported(CHORUS_FLOAT32, (chorus_op_t)bad_ops[i]), 0);
    checks += 4;
  }
}

/* ------------------------------------------------- elements as raw bits */

static uint64_t load_bits(const struct dtype_info *di, const void *base, size_t i) {
  const unsigned char *p = (const unsigned char *)base + i * di->size;
  switch (di->size) {
  case 1: return *p;
  case 2: { uint16_t v; memcpy(&v, p, 2); return v; }
  case 4: { uint32_t v; memcpy(&v, p, 4); return v; }
  default: { uint64_t v; memcpy(&v, p, 8); return v; }
  }
}

static void store_bits(const struct dtype_info *di, void *base, size_t i, uint64_t bits) {
  unsigned char *p = (unsigned char *)base + i * di->size;
  switch (di->size) {
  case 1: *p = (unsigned char)bits; break;
  case 2: { uint16_t v = (uint16_t)bits; memcpy(p, &v, 2); break; }
  case 4: { uint32_t v = (uint32_t)bits; memcpy(p, &v, 4); break; }
  default: memcpy(p, &bits, 8); break;
  }
}

static uint64_t size_mask(size_t size) { return size == 8 ? ~0ull : (1ull << (8 * size)) - 1; }

/* Integer value of an integer element's bits (sign-extended if signed). */
static int64_t int_value(const struct dtype_info *di, uint64_t bits) {
  if (di->kind == K_UINT || di->size == 8) {
    int64_t v;
    memcpy(&v, &bits, 8);
    return v;
  }
  uint64_t sign = 1ull << (8 * di->size - 1);
  return bits & sign ? (int64_t)(bits & (sign - 1)) - (int64_t)sign : (int64_t)bits;
}

/* Value of a floating-point element's bits, exactly. */
static double fp_value(const struct dtype_info *di, uint64_t bits) {
  switch (di->kind) {
  case K_HALF: return ref_decode16(fmt_half, (uint16_t)bits);
  case K_BF16: return ref_decode16(fmt_bf16, (uint16_t)bits);
  case K_F32: return (double)float_of_bits((uint32_t)bits);
  default: return double_of_bits(bits);
  }
}

/* Bits of a double rounded once to float32, then (16-bit types) to 16 bits. */
static uint64_t fp_round(const struct dtype_info *di, double v) {
  switch (di->kind) {
  case K_HALF: return ref_round16(fmt_half, (double)(float)v);
  case K_BF16: return ref_round16(fmt_bf16, (double)(float)v);
  case K_F32: return bits_of_float((float)v);
  default: return bits_of_double(v);
  }
}

static int fp_is_nan_result(const struct dtype_info *di, uint64_t bits) {
  switch (di->kind) {
  case K_HALF: return ref_is_quiet_nan16(fmt_half, (uint16_t)bits);
  case K_BF16: return ref_is_quiet_nan16(fmt_bf16, (uint16_t)bits);
  default: return isnan(fp_value(di, bits));
  }
}

/* What a OP b must be: exact bits, any (quiet) NaN, or either operand. */
typedef struct {
  uint64_t bits;
  int any_nan;
  int either; /* a or b (MIN/MAX of operands that compare equal) */
} expect_t;

static expect_t ref_combine(const struct dtype_info *di, chorus_op_t op, uint64_t a, uint64_t b) {
  expect_t e = {0, 0, 0};
  if (is_int_kind(di->kind)) {
    int64_t x = int_value(di, a), y = int_value(di, b);
    switch (op) {
    case CHORUS_SUM:
    case CHORUS_AVG:
      /* Exact in int64 below 64 bits; for int64, unsigned arithmetic is the
       * definition of the wrap-around. */
      e.bits = di->size == 8 ? a + b : (uint64_t)(x + y);
      break;
    case CHORUS_PROD:
      e.bits = di->size == 8 ? a * b : (uint64_t)(x * y);
      break;
    case CHORUS_MIN: e.bits = x <= y ? a : b; break;
    case CHORUS_MAX: e.bits = x >= y ? a : b; break;
    case CHORUS_BAND: e.bits = a & b; break;
    case CHORUS_BOR: e.bits = a | b; break;
    default: e.bits = a ^ b; break;
    }
    e.bits &= size_mask(di->size);
    return e;
  }
  double x = fp_value(di, a), y = fp_value(di, b);
  switch (op) {
  case CHORUS_SUM:
  case CHORUS_AVG:
  case CHORUS_PROD: {
    double r = op == CHORUS_PROD ? x * y : x + y;
    if (isnan(r)) e.any_nan = 1;
    else e.bits = fp_round(di, r);
    break;
  }
  default: /* MIN, MAX */
    if (isnan(x) || isnan(y)) e.any_nan = 1;
    else if (x == y) e.either = 1;
    else e.bits = (op == CHORUS_MIN) == (x < y) ? a : b;
    break;
  }
  return e;
}

static int matches(const struct dtype_info *di, expect_t e, uint64_t a, uint64_t b, uint64_t got) {
  if (e.any_nan) return fp_is_nan_result(di, got);
  if (e.either) return got == a || got == b;
  return got == e.bits;
}

/* ----------------------------------------------------------- test data */

static uint64_t random_element(const struct dtype_info *di, uint64_t *seed) {
  uint64_t r = rng_next(seed);
  unsigned pick = (unsigned)(r >> 56) % 8;
  uint64_t low = r & 0xffffffffffffull;
  switch (di->kind) {
  case K_SINT:
  case K_UINT: {
    uint64_t top = 1ull << (8 * di->size - 1); /* the sign bit */
    const uint64_t special[] = {0, 1, ~0ull, top, top - 1, top + 1, top - 2, 2};
    if (pick == 0) return special[low % 8] & size_mask(di->size);
    if (pick <= 2) return (uint64_t)((int64_t)(low % 601) - 300) & size_mask(di->size);
    return r & size_mask(di->size);
  }
  case K_HALF:
  case K_BF16: {
    const uint16_t half_special[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0xfe00, 0x7bff,
                                     0xfbff, 0x0001, 0x8001, 0x03ff, 0x0400, 0x3c00, 0xbc00,
                                     0x7c01, 0x5bff};
    const uint16_t bf16_special[] = {0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0xffc0, 0x7f7f,
                                     0xff7f, 0x0001, 0x8001, 0x007f, 0x0080, 0x3f80, 0xbf80,
                                     0x7f81, 0x4b7f};
    int half = di->kind == K_HALF;
    if (pick == 0) return half ? half_special[low % 16] : bf16_special[low % 16];
    if (pick <= 3) {
      /* Same-binade magnitudes around 1: carries and ties in the sum. */
      unsigned mb = half ? 10 : 7, bias = half ? 15 : 127;
      uint64_t e = bias - 2 + low % 5, m = (low >> 8) & ((1u << mb) - 1);
      return (r >> 55 & 1) << 15 | e << mb | m;
    }
    return r & 0xffff;
  }
  case K_F32: {
    const uint32_t special[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                0x7fc00000u, 0xffc00000u, 0x7f7fffffu, 0xff7fffffu,
                                0x00000001u, 0x80000001u, 0x00800000u, 0x3f800000u,
                                0xbf800000u, 0x7f800001u, 0x4b000000u, 0x33800000u};
    if (pick == 0) return special[low % 16];
    if (pick <= 2) return bits_of_float((float)((int64_t)(low % 20001) - 10000) / 8.0f);
    if (pick <= 4) return (uint32_t)(r >> 40 & 1) << 31 | (uint32_t)(124 + low % 7) << 23 |
                          (uint32_t)(low >> 8 & 0x7fffff);
    return r & 0xffffffffu;
  }
  default: {
    const uint64_t special[] = {0, 1ull << 63, 0x7ff0000000000000ull, 0xfff0000000000000ull,
                                0x7ff8000000000000ull, 0x7fefffffffffffffull, 1,
                                0x0010000000000000ull, 0x3ff0000000000000ull,
                                0xbff0000000000000ull, 0x7ff0000000000001ull,
                                0x4330000000000000ull};
    if (pick == 0) return special[low % 12];
    if (pick <= 2) return bits_of_double((double)((int64_t)(low % 20001) - 10000) / 8.0);
    if (pick <= 4) return (r >> 40 & 1) << 63 | (uint64_t)(1020 + low % 7) << 52 |
                          (rng_next(seed) & 0xfffffffffffffull);
    return r;
  }
  }
}

/* --------------------------------------------------------------- kernels */

/* The ISA the kernel tests are running for; kfn() is its kernel. */
static chorus__isa_t test_isa = CHORUS__ISA_SCALAR;

static chorus__reduce_fn_t kfn(chorus_dtype_t dt, chorus_op_t op) {
  return chorus__reduce_fn_isa(dt, op, test_isa);
}

/* Runs body once per ISA the CPU has, with test_isa set. */
#define FOR_EACH_ISA(body)                                                      \
  do {                                                                         \
    for (int isa_ = 0; isa_ < CHORUS__ISA_COUNT; isa_++) {                     \
      if (!chorus__reduce_isa_available((chorus__isa_t)isa_)) continue;        \
      test_isa = (chorus__isa_t)isa_;                                          \
      body;                                                                    \
    }                                                                          \
    test_isa = CHORUS__ISA_SCALAR;                                             \
  } while (0)

enum { MODE_OUT_OF_PLACE, MODE_DST_A, MODE_DST_B, MODE_ALL_SAME, N_MODES };
static const char *const mode_names[] = {"out-of-place", "dst==a", "dst==b", "dst==a==b"};
enum { CANARY = 8 };

/* Runs one dtype x op x n x mode case; 0 if right. */
static int run_kernel_case(const struct dtype_info *di, chorus_op_t op, size_t n, int mode,
                           uint64_t *seed) {
  chorus__reduce_fn_t fn = kfn(di->dtype, op);
  size_t bytes = (n + CANARY) * di->size;
  unsigned char *a = malloc(bytes), *b = malloc(bytes), *dst = malloc(bytes);
  unsigned char *a0 = malloc(bytes), *b0 = malloc(bytes);
  int rc = -1;
  if (!a || !b || !dst || !a0 || !b0) {
    HARNESS_FAIL("out of memory");
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    store_bits(di, a, i, random_element(di, seed));
    store_bits(di, b, i, random_element(di, seed));
  }
  memset(a + n * di->size, 0x5a, CANARY * di->size);
  memset(b + n * di->size, 0x5a, CANARY * di->size);
  memset(dst, 0xa5, bytes);
  if (mode == MODE_ALL_SAME) memcpy(b, a, bytes);
  memcpy(a0, a, bytes);
  memcpy(b0, b, bytes);

  switch (mode) {
  case MODE_OUT_OF_PLACE: fn(dst, a, b, n); break;
  case MODE_DST_A: fn(a, a, b, n); break;
  case MODE_DST_B: fn(b, a, b, n); break;
  default: fn(a, a, a, n); break;
  }
  const unsigned char *out = mode == MODE_OUT_OF_PLACE ? dst : mode == MODE_DST_B ? b : a;

  for (size_t i = 0; i < n; i++) {
    uint64_t x = load_bits(di, a0, i), y = load_bits(di, b0, i), got = load_bits(di, out, i);
    expect_t e = ref_combine(di, op, x, y);
    checks++;
    if (!matches(di, e, x, y, got)) {
      HARNESS_FAIL("%s %s %s n=%zu %s [%zu]: a=0x%llx b=0x%llx -> 0x%llx, want %s0x%llx",
                   chorus__reduce_isa_name(test_isa), di->name,
                   chorus_op_name(op), n, mode_names[mode], i, (unsigned long long)x,
                   (unsigned long long)y, (unsigned long long)got,
                   e.any_nan ? "NaN, e.g. " : e.either ? "a or b, e.g. " : "",
                   (unsigned long long)(e.either ? x : e.bits));
      goto out;
    }
  }
  /* Canaries past n, and inputs that are not the destination, untouched. */
  unsigned char dst_canary[CANARY * 8];
  memset(dst_canary, 0xa5, sizeof dst_canary);
  const unsigned char *before = mode == MODE_OUT_OF_PLACE ? dst_canary
                                : mode == MODE_DST_B      ? b0 + n * di->size
                                                          : a0 + n * di->size;
  checks++;
  int canary_ok = memcmp(out + n * di->size, before, CANARY * di->size) == 0;
  int inputs_ok = 1;
  if (mode == MODE_OUT_OF_PLACE)
    inputs_ok = memcmp(a, a0, bytes) == 0 && memcmp(b, b0, bytes) == 0;
  if (mode == MODE_DST_A) inputs_ok = memcmp(b, b0, bytes) == 0;
  if (mode == MODE_DST_B) inputs_ok = memcmp(a, a0, bytes) == 0;
  if (!canary_ok || !inputs_ok) {
    HARNESS_FAIL("%s %s %s n=%zu %s: wrote outside dst[0..n)", chorus__reduce_isa_name(test_isa),
                 di->name, chorus_op_name(op), n, mode_names[mode]);
    goto out;
  }
  rc = 0;
out:
  free(a);
  free(b);
  free(dst);
  free(a0);
  free(b0);
  return rc;
}

static void check_kernels(chorus_dtype_t dt) {
  const struct dtype_info *di = info_of(dt);
  static const size_t sizes[] = {0, 1, 7, 63, 64, 65, 1000};
  ASSERT_TRUE(di != NULL);
  for (size_t o = 0; o < N_OPS; o++) {
    chorus_op_t op = all_ops[o];
    chorus__reduce_fn_t fn = kfn(dt, op);
    if (!fn) continue; /* supported_table checks which ones exist */
    fn(NULL, NULL, NULL, 0); /* n = 0 touches nothing */
    uint64_t seed = (uint64_t)dt * 1000 + (uint64_t)op;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      for (int mode = 0; mode < N_MODES; mode++)
        if (run_kernel_case(di, op, sizes[s], mode, &seed)) return;
  }
}

#define KERNEL_TEST(NAME, name, size) \
  TEST(kernels_##name) { FOR_EACH_ISA(check_kernels(CHORUS_##NAME)); }
CHORUS_DTYPE_MAP(KERNEL_TEST)
#undef KERNEL_TEST

/* Wrap-around and NaN cases written out by hand. */
static void check_known_values(void) {
  int8_t i8a[] = {127, -128, -128, 100, -1}, i8b[] = {1, -1, -1, 100, -1}, i8r[5];
  kfn(CHORUS_INT8, CHORUS_SUM)(i8r, i8a, i8b, 5);
  ASSERT_EQ(i8r[0], -128);
  ASSERT_EQ(i8r[1], 127);
  ASSERT_EQ(i8r[3], -56);
  kfn(CHORUS_INT8, CHORUS_PROD)(i8r, i8a, i8b, 5);
  ASSERT_EQ(i8r[1], -128); /* -128 * -1 wraps */
  ASSERT_EQ(i8r[3], 16);   /* 10000 mod 256 */
  ASSERT_EQ(i8r[4], 1);

  uint8_t u8a[] = {255, 16, 0, 200}, u8b[] = {1, 16, 255, 100}, u8r[4];
  kfn(CHORUS_UINT8, CHORUS_SUM)(u8r, u8a, u8b, 4);
  ASSERT_EQ(u8r[0], 0);
  ASSERT_EQ(u8r[3], 44);
  kfn(CHORUS_UINT8, CHORUS_PROD)(u8r, u8a, u8b, 4);
  ASSERT_EQ(u8r[1], 0);
  ASSERT_EQ(u8r[0], 255);
  kfn(CHORUS_UINT8, CHORUS_MIN)(u8r, u8a, u8b, 4);
  ASSERT_EQ(u8r[2], 0);
  ASSERT_EQ(u8r[3], 100);

  int32_t i32a[] = {INT32_MAX, INT32_MIN, 65536, -5}, i32b[] = {1, -1, 65536, 3}, i32r[4];
  kfn(CHORUS_INT32, CHORUS_SUM)(i32r, i32a, i32b, 4);
  ASSERT_EQ(i32r[0], INT32_MIN);
  ASSERT_EQ(i32r[1], INT32_MAX);
  kfn(CHORUS_INT32, CHORUS_PROD)(i32r, i32a, i32b, 4);
  ASSERT_EQ(i32r[0], INT32_MAX);
  ASSERT_EQ(i32r[1], INT32_MIN);
  ASSERT_EQ(i32r[2], 0);
  ASSERT_EQ(i32r[3], -15);
  kfn(CHORUS_INT32, CHORUS_BXOR)(i32r, i32a, i32b, 4);
  ASSERT_EQ(i32r[3], -5 ^ 3);

  int64_t i64a[] = {INT64_MAX, INT64_MIN, INT64_MAX, 4294967297LL},
          i64b[] = {1, -1, 2, 4294967297LL}, i64r[4];
  kfn(CHORUS_INT64, CHORUS_SUM)(i64r, i64a, i64b, 4);
  ASSERT_TRUE(i64r[0] == INT64_MIN);
  ASSERT_TRUE(i64r[1] == INT64_MAX);
  kfn(CHORUS_INT64, CHORUS_PROD)(i64r, i64a, i64b, 4);
  ASSERT_TRUE(i64r[1] == INT64_MIN);
  ASSERT_TRUE(i64r[2] == -2);
  ASSERT_TRUE(i64r[3] == 8589934593LL); /* (2^32 + 1)^2 mod 2^64 = 2^33 + 1 */
  kfn(CHORUS_INT64, CHORUS_MIN)(i64r, i64a, i64b, 4);
  ASSERT_TRUE(i64r[0] == 1 && i64r[1] == INT64_MIN);

  float fa[] = {NAN, 1.0f, -INFINITY, 2.0f}, fb[] = {1.0f, NAN, 5.0f, -3.0f}, fr[4];
  kfn(CHORUS_FLOAT32, CHORUS_MIN)(fr, fa, fb, 4);
  ASSERT_TRUE(isnan(fr[0]) && isnan(fr[1]) && fr[2] == -INFINITY && fr[3] == -3.0f);
  kfn(CHORUS_FLOAT32, CHORUS_MAX)(fr, fa, fb, 4);
  ASSERT_TRUE(isnan(fr[0]) && isnan(fr[1]) && fr[2] == 5.0f && fr[3] == 2.0f);

  /* float16: 2048 + 1 = 2049 is a tie between 2048 and 2050: even = 2048. */
  uint16_t ha[] = {0x6800, 0x7bff, 0x3c00, 0x7e00}, hb[] = {0x3c00, 0x7bff, 0x0001, 0x3c00}, hr[4];
  kfn(CHORUS_FLOAT16, CHORUS_SUM)(hr, ha, hb, 4);
  ASSERT_EQ(hr[0], 0x6800);
  ASSERT_EQ(hr[1], 0x7c00); /* 65504 + 65504 overflows */
  ASSERT_EQ(hr[2], 0x3c00); /* 1 + 2^-24 rounds back to 1 */
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_half, hr[3]));
  kfn(CHORUS_FLOAT16, CHORUS_MAX)(hr, ha, hb, 4);
  ASSERT_TRUE(ref_is_quiet_nan16(fmt_half, hr[3]));
}

TEST(kernel_known_values) { FOR_EACH_ISA(check_known_values()); }

/* ----------------------------------------------------------- finalize_avg */

/* Reference for v / nranks, as bits. */
static expect_t ref_avg(const struct dtype_info *di, uint64_t v, int nranks) {
  expect_t e = {0, 0, 0};
  if (is_int_kind(di->kind)) {
    /* Truncation toward zero: divide the magnitude, then restore the sign. */
    int64_t x = int_value(di, v);
    uint64_t mag = x < 0 ? 0 - (uint64_t)x : (uint64_t)x;
    uint64_t q = mag / (uint64_t)nranks;
    e.bits = (x < 0 ? 0 - q : q) & size_mask(di->size);
    return e;
  }
  double x = fp_value(di, v);
  if (isnan(x)) {
    e.any_nan = 1;
    return e;
  }
  if (di->kind == K_F64) e.bits = bits_of_double(x / (double)nranks);
  else e.bits = fp_round(di, x / (double)nranks); /* float32 division, correctly rounded */
  return e;
}

static void check_avg(chorus_dtype_t dt) {
  const struct dtype_info *di = info_of(dt);
  static const size_t sizes[] = {0, 1, 7, 1000};
  static const int ranks[] = {2, 3, 4, 7, 8, 255, 256, 1000, 1 << 20};
  ASSERT_TRUE(di != NULL);
  chorus__reduce_finalize_avg(NULL, 0, dt, 3);
  uint64_t seed = 7 + (uint64_t)dt;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    for (size_t r = 0; r < sizeof ranks / sizeof ranks[0]; r++) {
      size_t n = sizes[s];
      unsigned char *buf = malloc((n + CANARY) * di->size), *orig = malloc((n + CANARY) * di->size);
      ASSERT_TRUE(buf && orig);
      for (size_t i = 0; i < n + CANARY; i++) store_bits(di, buf, i, random_element(di, &seed));
      memcpy(orig, buf, (n + CANARY) * di->size);
      chorus__reduce_finalize_avg(buf, n, dt, ranks[r]);
      int bad = -1;
      for (size_t i = 0; i < n && bad < 0; i++) {
        uint64_t v = load_bits(di, orig, i), got = load_bits(di, buf, i);
        expect_t e = ref_avg(di, v, ranks[r]);
        checks++;
        if (!matches(di, e, v, v, got)) {
          HARNESS_FAIL("%s avg n=%zu nranks=%d [%zu]: 0x%llx -> 0x%llx, want %s0x%llx", di->name, n,
                       ranks[r], i, (unsigned long long)v, (unsigned long long)got,
                       e.any_nan ? "NaN, e.g. " : "", (unsigned long long)e.bits);
          bad = (int)i;
        }
      }
      checks++;
      int canary_ok = memcmp(buf + n * di->size, orig + n * di->size, CANARY * di->size) == 0;
      /* nranks = 1 (and nonsense values) leave the buffer as it is. */
      memcpy(buf, orig, (n + CANARY) * di->size);
      chorus__reduce_finalize_avg(buf, n, dt, 1);
      chorus__reduce_finalize_avg(buf, n, dt, 0);
      chorus__reduce_finalize_avg(buf, n, dt, -4);
      int unchanged = memcmp(buf, orig, (n + CANARY) * di->size) == 0;
      free(buf);
      free(orig);
      ASSERT_TRUE(bad < 0);
      ASSERT_TRUE(canary_ok);
      ASSERT_TRUE(unchanged);
    }
  }
}

#define AVG_TEST(NAME, name, size) \
  TEST(avg_##name) { check_avg(CHORUS_##NAME); }
CHORUS_DTYPE_MAP(AVG_TEST)
#undef AVG_TEST

/* A three-rank AVG as a collective does it: SUM kernels, then one division. */
TEST(avg_end_to_end) {
  int32_t r0[] = {-7, 7, 1, INT32_MAX}, r1[] = {0, 0, 1, 0}, r2[] = {0, 1, 0, 0};
  chorus__reduce_fn_t fn = chorus__reduce_fn(CHORUS_INT32, CHORUS_AVG);
  fn(r0, r0, r1, 4);
  fn(r0, r0, r2, 4);
  chorus__reduce_finalize_avg(r0, 4, CHORUS_INT32, 3);
  ASSERT_EQ(r0[0], -2); /* -7 / 3 truncates toward zero, not -3 */
  ASSERT_EQ(r0[1], 2);
  ASSERT_EQ(r0[2], 0);
  ASSERT_EQ(r0[3], INT32_MAX / 3);

  float f0[] = {1.0f, -1.0f}, f1[] = {2.0f, 0.5f}, f2[] = {4.0f, 0.25f};
  fn = chorus__reduce_fn(CHORUS_FLOAT32, CHORUS_AVG);
  fn(f0, f0, f1, 2);
  fn(f0, f1, f0, 2); /* dst == b */
  ASSERT_TRUE(f0[0] == 5.0f);
  fn(f2, f0, f2, 2);
  chorus__reduce_finalize_avg(f2, 2, CHORUS_FLOAT32, 3);
  ASSERT_TRUE(f2[0] == 3.0f);
  ASSERT_TRUE(f2[1] == 0.25f / 3.0f);

  uint16_t h0[] = {0x3c00}, h1[] = {0x4000}; /* 1 and 2 in float16 */
  fn = chorus__reduce_fn(CHORUS_FLOAT16, CHORUS_AVG);
  fn(h0, h0, h1, 1);
  chorus__reduce_finalize_avg(h0, 1, CHORUS_FLOAT16, 2);
  ASSERT_EQ(h0[0], 0x3e00); /* 1.5 */

  uint8_t u0[] = {200}, u1[] = {100};
  chorus__reduce_fn(CHORUS_UINT8, CHORUS_AVG)(u0, u0, u1, 1);
  chorus__reduce_finalize_avg(u0, 1, CHORUS_UINT8, 2);
  ASSERT_EQ(u0[0], 22); /* (300 mod 256) / 2: the sum wraps first */

  chorus__reduce_finalize_avg(u0, 1, (chorus_dtype_t)CHORUS_DTYPE_COUNT, 2);
  ASSERT_EQ(u0[0], 22); /* invalid dtype: untouched */
}

/* ------------------------------------------------- ISA dispatch, SIMD */

TEST(isa_dispatch) {
  ASSERT_TRUE(chorus__reduce_isa_available(CHORUS__ISA_SCALAR));
  ASSERT_TRUE(!chorus__reduce_isa_available(CHORUS__ISA_COUNT));
  ASSERT_TRUE(chorus__reduce_isa_name(CHORUS__ISA_COUNT) == NULL);
  chorus__isa_t used = chorus__reduce_isa();
  ASSERT_TRUE(chorus__reduce_isa_available(used));
  ASSERT_STREQ(chorus__reduce_isa_name(CHORUS__ISA_SCALAR), "scalar");
  ASSERT_STREQ(chorus__reduce_isa_name(CHORUS__ISA_AVX2), "avx2");
  const char *forced = getenv("CHORUS_REDUCE_ISA");
  if (forced && strcmp(forced, "scalar") == 0) ASSERT_EQ(used, CHORUS__ISA_SCALAR);
  if (!forced || !*forced || strcmp(forced, "auto") == 0)
    for (int i = used + 1; i < CHORUS__ISA_COUNT; i++)
      ASSERT_TRUE(!chorus__reduce_isa_available((chorus__isa_t)i));
  printf("     reduce ISA in use: %s; available:", chorus__reduce_isa_name(used));
  for (int i = 0; i < CHORUS__ISA_COUNT; i++)
    if (chorus__reduce_isa_available((chorus__isa_t)i))
      printf(" %s", chorus__reduce_isa_name((chorus__isa_t)i));
  printf("\n");
  for (size_t d = 0; d < N_DTYPES; d++)
    for (size_t o = 0; o < N_OPS; o++) {
      chorus_dtype_t dt = dtypes[d].dtype;
      chorus_op_t op = all_ops[o];
      checks++;
      ASSERT_TRUE(chorus__reduce_fn(dt, op) == chorus__reduce_fn_isa(dt, op, used));
      for (int i = 0; i < CHORUS__ISA_COUNT; i++) {
        chorus__reduce_fn_t f = chorus__reduce_fn_isa(dt, op, (chorus__isa_t)i);
        if (chorus__reduce_isa_available((chorus__isa_t)i))
          ASSERT_EQ(f != NULL, chorus__reduce_supported(dt, op));
        else
          ASSERT_TRUE(f == NULL);
      }
      ASSERT_TRUE(chorus__reduce_fn_isa(dt, op, CHORUS__ISA_COUNT) == NULL);
    }
}

/* The quiet NaN x of an element's format becomes (x itself if not NaN). */
static uint64_t quieted(const struct dtype_info *di, uint64_t x) {
  switch (di->kind) {
  case K_HALF: return ref_is_nan16(fmt_half, (uint16_t)x) ? x | 0x0200u : x;
  case K_BF16: return ref_is_nan16(fmt_bf16, (uint16_t)x) ? x | 0x0040u : x;
  case K_F32: return isnan(float_of_bits((uint32_t)x)) ? x | 0x00400000u : x;
  case K_F64: return isnan(double_of_bits(x)) ? x | 1ull << 51 : x;
  default: return x;
  }
}

/* got (SIMD) is the scalar kernel's result want.  One exception: SUM/PROD of
 * two NaNs is the first NaN operand of the x86 instruction, quieted, and
 * which operand comes first in the portable kernels is the compiler's choice
 * (GCC commutes them differently per dtype and per loop), so there either
 * NaN of the two, quieted, is the portable result. */
static int same_result(const struct dtype_info *di, chorus_op_t op, uint64_t a, uint64_t b,
                       uint64_t got, uint64_t want) {
  if (got == want) return 1;
  if (di->kind == K_SINT || di->kind == K_UINT) return 0;
  if (op != CHORUS_SUM && op != CHORUS_PROD && op != CHORUS_AVG) return 0;
  if (!isnan(fp_value(di, a)) || !isnan(fp_value(di, b))) return 0;
  return (got == quieted(di, a) || got == quieted(di, b)) &&
         (want == quieted(di, a) || want == quieted(di, b));
}

/* Compares fn against the scalar kernel on the same inputs in every aliasing
 * mode; 0 if the bits agree. */
static int compare_with_scalar(const struct dtype_info *di, chorus_op_t op, chorus__isa_t isa,
                               const unsigned char *a0, const unsigned char *b0, size_t n) {
  chorus__reduce_fn_t ref = chorus__reduce_fn_isa(di->dtype, op, CHORUS__ISA_SCALAR);
  chorus__reduce_fn_t fn = chorus__reduce_fn_isa(di->dtype, op, isa);
  size_t bytes = (n + CANARY) * di->size;
  unsigned char *a = malloc(bytes), *b = malloc(bytes), *dst = malloc(bytes), *want = malloc(bytes);
  int rc = -1;
  if (!a || !b || !dst || !want) {
    HARNESS_FAIL("out of memory");
    goto out;
  }
  for (int mode = 0; mode < N_MODES; mode++) {
    /* Expected: the scalar kernel, out of place on the inputs of this mode. */
    memset(want, 0xa5, bytes);
    ref(want, a0, mode == MODE_ALL_SAME ? a0 : b0, n);
    memcpy(a, a0, bytes);
    memcpy(b, mode == MODE_ALL_SAME ? a0 : b0, bytes);
    memset(dst, 0xa5, bytes);
    unsigned char *out;
    switch (mode) {
    case MODE_OUT_OF_PLACE: fn(dst, a, b, n); out = dst; break;
    case MODE_DST_A: fn(a, a, b, n); out = a; break;
    case MODE_DST_B: fn(b, a, b, n); out = b; break;
    default: fn(a, a, a, n); out = a; break;
    }
    checks += n + 1;
    size_t i = 0;
    const unsigned char *bb = mode == MODE_ALL_SAME ? a0 : b0;
    while (i < n && same_result(di, op, load_bits(di, a0, i), load_bits(di, bb, i),
                                load_bits(di, out, i), load_bits(di, want, i)))
      i++;
    if (i < n) {
      HARNESS_FAIL("%s %s %s n=%zu %s [%zu]: a=0x%llx b=0x%llx -> 0x%llx, scalar 0x%llx",
                   chorus__reduce_isa_name(isa), di->name, chorus_op_name(op), n, mode_names[mode],
                   i, (unsigned long long)load_bits(di, a0, i),
                   (unsigned long long)load_bits(di, mode == MODE_ALL_SAME ? a0 : b0, i),
                   (unsigned long long)load_bits(di, out, i),
                   (unsigned long long)load_bits(di, want, i));
      goto out;
    }
    const unsigned char *tail_before = mode == MODE_OUT_OF_PLACE ? want
                                       : mode == MODE_DST_B      ? b0
                                                                 : a0;
    if (memcmp(out + n * di->size, tail_before + n * di->size, CANARY * di->size) != 0) {
      HARNESS_FAIL("%s %s %s n=%zu %s: wrote past n", chorus__reduce_isa_name(isa), di->name,
                   chorus_op_name(op), n, mode_names[mode]);
      goto out;
    }
  }
  rc = 0;
out:
  free(a);
  free(b);
  free(dst);
  free(want);
  return rc;
}

/* Every non-scalar kernel gives the scalar kernel's bits: random data with
 * NaN (quiet, signalling, both signs), +-0, +-inf, subnormals, n = 0..100
 * and 1000; for the 16-bit types also every bit pattern against a few
 * operands (this covers the conversions exhaustively). */
TEST(simd_bit_identical) {
  for (int isa = 1; isa < CHORUS__ISA_COUNT; isa++) {
    if (!chorus__reduce_isa_available((chorus__isa_t)isa)) continue;
    for (size_t d = 0; d < N_DTYPES; d++) {
      const struct dtype_info *di = &dtypes[d];
      for (size_t o = 0; o < N_OPS; o++) {
        chorus_op_t op = all_ops[o];
        if (!chorus__reduce_supported(di->dtype, op)) continue;
        uint64_t seed = 0x5eed + d * 100 + o;
        unsigned char *a0 = malloc((65536 + CANARY) * 8), *b0 = malloc((65536 + CANARY) * 8);
        ASSERT_TRUE(a0 && b0);
        int bad = 0;
        for (size_t n = 0; n <= 1000 && !bad; n = n < 100 ? n + 1 : 1000) {
          for (size_t i = 0; i < n + CANARY; i++) {
            store_bits(di, a0, i, random_element(di, &seed));
            store_bits(di, b0, i, random_element(di, &seed));
          }
          bad = compare_with_scalar(di, op, (chorus__isa_t)isa, a0, b0, n);
          if (n == 1000) break;
        }
        if (!bad && di->size == 2) {
          /* All 65536 patterns against +-0, +-1, a NaN, inf, a subnormal. */
          const uint16_t half_ops[] = {0x0000, 0x8000, 0x3c00, 0xbc00,
                                       0x7e01, 0x7c00, 0x0001, 0x7c01};
          const uint16_t bf16_ops[] = {0x0000, 0x8000, 0x3f80, 0xbf80,
                                       0x7fc1, 0x7f80, 0x0001, 0x7f81};
          for (size_t k = 0; k < 8 && !bad; k++) {
            for (size_t i = 0; i < 65536 + CANARY; i++) {
              store_bits(di, a0, i, i & 0xffff);
              store_bits(di, b0, i, di->kind == K_HALF ? half_ops[k] : bf16_ops[k]);
            }
            bad = compare_with_scalar(di, op, (chorus__isa_t)isa, a0, b0, 65536) ||
                  compare_with_scalar(di, op, (chorus__isa_t)isa, b0, a0, 65536);
          }
        }
        free(a0);
        free(b0);
        if (bad) return;
      }
    }
  }
}

/* The public chorus_convert: every 16-bit pattern survives float32 and back
 * (NaNs stay NaN), float -> 16 bit matches the internal conversion, and
 * other pairs are refused. */
TEST(public_convert) {
  static uint16_t in[65536], back[65536], direct[65536];
  static float f[65536];
  for (int k = 0; k < 2; k++) {
    chorus_dtype_t h = k ? CHORUS_BFLOAT16 : CHORUS_FLOAT16;
    for (int i = 0; i < 65536; i++) in[i] = (uint16_t)i;
    ASSERT_EQ(chorus_convert(f, CHORUS_FLOAT32, in, h, 65536), CHORUS_OK);
    ASSERT_EQ(chorus_convert(back, h, f, CHORUS_FLOAT32, 65536), CHORUS_OK);
    for (int i = 0; i < 65536; i++) {
      if (f[i] != f[i]) { /* NaN */
        ASSERT_TRUE(isnan(k ? chorus__bf16_to_float(back[i]) : chorus__half_to_float(back[i])));
        continue;
      }
      ASSERT_EQ(back[i], in[i]);
      direct[i] = k ? chorus__float_to_bf16(f[i] * 1.001f) : chorus__float_to_half(f[i] * 1.001f);
      f[i] *= 1.001f;
    }
    ASSERT_EQ(chorus_convert(back, h, f, CHORUS_FLOAT32, 65536), CHORUS_OK);
    for (int i = 0; i < 65536; i++)
      if (f[i] == f[i]) ASSERT_EQ(back[i], direct[i]);
  }
  ASSERT_EQ(chorus_convert(back, CHORUS_INT32, f, CHORUS_FLOAT32, 4), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_convert(back, CHORUS_FLOAT16, f, CHORUS_BFLOAT16, 4), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_convert(NULL, CHORUS_FLOAT16, f, CHORUS_FLOAT32, 4), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_convert(NULL, CHORUS_FLOAT16, NULL, CHORUS_FLOAT32, 0), CHORUS_OK);
}

int main(void) {
  RUN(public_convert);
  RUN(supported_table);
  RUN(half_known_values);
  RUN(bf16_known_values);
  RUN(half_all_patterns);
  RUN(bf16_all_patterns);
  RUN(half_halfway_points);
  RUN(bf16_halfway_points);
  RUN(half_float_sweep);
  RUN(bf16_float_sweep);
#define RUN_DTYPE_TESTS(NAME, name, size) RUN(kernels_##name);
  CHORUS_DTYPE_MAP(RUN_DTYPE_TESTS)
#undef RUN_DTYPE_TESTS
  RUN(kernel_known_values);
#define RUN_DTYPE_TESTS(NAME, name, size) RUN(avg_##name);
  CHORUS_DTYPE_MAP(RUN_DTYPE_TESTS)
#undef RUN_DTYPE_TESTS
  RUN(avg_end_to_end);
  RUN(isa_dispatch);
  RUN(simd_bit_identical);
  printf("%llu element checks\n", checks);
  return HARNESS_DONE();
}
