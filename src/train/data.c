/*
 * data.c - a byte-level text corpus split into train and validation parts.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"

struct chorus_text {
  unsigned char *bytes;
  size_t len, val_start;
};

chorus_result_t chorus_text_load(const char *path, double val_fraction, chorus_text_t **out) {
  *out = NULL;
  if (!path || val_fraction < 0 || val_fraction >= 1) return CHORUS_ERR_INVALID_ARG;
  FILE *f = fopen(path, "rb");
  if (!f) return CHORUS_ERR_SYSTEM;
  chorus_text_t *t = calloc(1, sizeof *t);
  size_t cap = 1 << 20;
  t->bytes = t ? malloc(cap) : NULL;
  if (!t || !t->bytes) {
    fclose(f);
    chorus_text_free(t);
    return CHORUS_ERR_NO_MEMORY;
  }
  for (;;) {
    if (t->len == cap) {
      unsigned char *nb = realloc(t->bytes, cap * 2);
      if (!nb) {
        fclose(f);
        chorus_text_free(t);
        return CHORUS_ERR_NO_MEMORY;
      }
      t->bytes = nb;
      cap *= 2;
    }
    size_t got = fread(t->bytes + t->len, 1, cap - t->len, f);
    t->len += got;
    if (got == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    chorus_text_free(t);
    return CHORUS_ERR_SYSTEM;
  }
  t->val_start = t->len - (size_t)((double)t->len * val_fraction);
  *out = t;
  return CHORUS_OK;
}

void chorus_text_free(chorus_text_t *t) {
  if (!t) return;
  free(t->bytes);
  free(t);
}

static void split_range(const chorus_text_t *t, int split, size_t *lo, size_t *hi) {
  *lo = split == CHORUS_SPLIT_VAL ? t->val_start : 0;
  *hi = split == CHORUS_SPLIT_VAL ? t->len : t->val_start;
}

size_t chorus_text_samples(const chorus_text_t *t, int split, int seq) {
  size_t lo, hi;
  split_range(t, split, &lo, &hi);
  if (seq < 1 || hi - lo < (size_t)seq + 1) return 0;
  return (hi - lo - 1) / (size_t)seq;
}

void chorus_text_batch(const chorus_text_t *t, int split, int seq, const size_t *idx, int B,
                       int *tokens, int *targets) {
  size_t lo, hi;
  split_range(t, split, &lo, &hi);
  for (int b = 0; b < B; b++) {
    const unsigned char *w = t->bytes + lo + idx[b] * (size_t)seq;
    for (int i = 0; i < seq; i++) {
      tokens[b * seq + i] = w[i];
      targets[b * seq + i] = w[i + 1];
    }
  }
}
