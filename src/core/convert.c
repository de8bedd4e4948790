/*
 * convert.c - chorus_convert: float32 <-> float16 / bfloat16 arrays with the
 * reduction kernels' conversions (src/reduce/, tested against every 16-bit
 * pattern).
 */
#include <string.h>

#include "chorus.h"
#include "reduce/reduce.h"

chorus_result_t chorus_convert(void *dst, chorus_dtype_t to, const void *src, chorus_dtype_t from,
                               size_t n) {
  if (n && (!dst || !src)) return CHORUS_ERR_INVALID_ARG;
  if (to == from && to >= 0 && to < CHORUS_DTYPE_COUNT) {
    if (n && dst != src) memmove(dst, src, n * chorus_dtype_size(to));
    return CHORUS_OK;
  }
  if (from == CHORUS_FLOAT32 && (to == CHORUS_FLOAT16 || to == CHORUS_BFLOAT16)) {
    const float *s = src;
    uint16_t *d = dst;
    if (to == CHORUS_FLOAT16)
      for (size_t i = 0; i < n; i++) d[i] = chorus__float_to_half(s[i]);
    else
      for (size_t i = 0; i < n; i++) d[i] = chorus__float_to_bf16(s[i]);
    return CHORUS_OK;
  }
  if (to == CHORUS_FLOAT32 && (from == CHORUS_FLOAT16 || from == CHORUS_BFLOAT16)) {
    const uint16_t *s = src;
    float *d = dst;
    if (from == CHORUS_FLOAT16)
      for (size_t i = 0; i < n; i++) d[i] = chorus__half_to_float(s[i]);
    else
      for (size_t i = 0; i < n; i++) d[i] = chorus__bf16_to_float(s[i]);
    return CHORUS_OK;
  }
  return CHORUS_ERR_INVALID_ARG;
}
