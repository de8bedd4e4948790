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
