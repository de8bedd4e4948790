/*
 * reduce.h - element-wise reduction kernels, one per dtype x op.
 *
 * Every kernel has one signature: dst[i] = a[i] OP b[i] for i < n, where dst
 * may alias a or b exactly (in-place accumulate) but must not partially
 * overlap them.  AVG is computed as SUM by the kernels; the collective then
 * calls chorus__reduce_finalize_avg() once on the final result.  float16 and
 * bfloat16 are widened to float32, combined, and rounded back to nearest-even
 * at every call (as PyTorch does on CPU).
 */
#ifndef CHORUS_REDUCE_REDUCE_H
#define CHORUS_REDUCE_REDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

typedef void (*chorus__reduce_fn_t)(void *dst, const void *a, const void *b, size_t n);

/* The kernel for dtype x op, or NULL when the pair is not supported
 * (bitwise ops on floating-point types, out-of-range values). */
chorus__reduce_fn_t chorus__reduce_fn(chorus_dtype_t dtype, chorus_op_t op);

/* Instruction sets the kernels exist for.  chorus__reduce_fn() uses the best
 * one the running CPU supports (resolved once, thread-safe), unless
 * CHORUS_REDUCE_ISA forces one.  Every ISA gives bit-identical results (in
 * the default floating-point environment: no FTZ/DAZ). */
typedef enum {
  CHORUS__ISA_SCALAR = 0, /* portable C, every architecture */
  CHORUS__ISA_AVX2 = 1,   /* x86-64 with AVX2 and F16C */
  CHORUS__ISA_COUNT
} chorus__isa_t;

/* The kernel for dtype x op on isa: the ISA's own kernel where it has one,
 * else the portable one.  NULL when the pair is not supported, isa is out of
 * range or the running CPU cannot execute it.  For tests and benchmarks. */
chorus__reduce_fn_t chorus__reduce_fn_isa(chorus_dtype_t dtype, chorus_op_t op, chorus__isa_t isa);

/* 1 if the running CPU (and this build) can run isa's kernels. */
int chorus__reduce_isa_available(chorus__isa_t isa);

/* The ISA chorus__reduce_fn() uses; its name ("scalar", "avx2"), or NULL
 * when isa is out of range. */
chorus__isa_t chorus__reduce_isa(void);
const char *chorus__reduce_isa_name(chorus__isa_t isa);

/* Implementation interface between reduce.c and reduce_simd.c: the portable
 * kernel (NULL if unsupported), and the AVX2 kernel (NULL where there is none
 * or not built for this architecture) with the CPU check for it. */
chorus__reduce_fn_t chorus__reduce_scalar_fn(chorus_dtype_t dtype, chorus_op_t op);
chorus__reduce_fn_t chorus__reduce_avx2_fn(chorus_dtype_t dtype, chorus_op_t op);
int chorus__reduce_avx2_usable(void);

/* 1 if dtype x op is supported. */
int chorus__reduce_supported(chorus_dtype_t dtype, chorus_op_t op);

/* buf[i] /= nranks (integer division truncates toward zero). */
void chorus__reduce_finalize_avg(void *buf, size_t n, chorus_dtype_t dtype, int nranks);

/* IEEE half <-> float, bfloat16 <-> float; float -> 16 bit rounds to nearest
 * even and keeps NaN a (quiet) NaN. */
float chorus__half_to_float(uint16_t h);
uint16_t chorus__float_to_half(float f);
float chorus__bf16_to_float(uint16_t b);
uint16_t chorus__float_to_bf16(float f);

#endif
