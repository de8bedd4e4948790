/*
 * ck_range.h - what the checkpoint-of-ranges tests (test_ckpt_ranges.c,
 * ckpt_ranges.c) both need: a range of a model's layout with its own AdamW
 * stepped a given number of times, its optimizer's step count, and the
 * removal of a test's directory.  Static: each test is its own program.
 */
#ifndef CHORUS_TESTS_CK_RANGE_H
#define CHORUS_TESTS_CK_RANGE_H

#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"

typedef struct {
  size_t lo, n;
  float *par;
  chorus_optim_t *opt;
} range_t;

/* The floats [lo, lo + n) of m's initialisation from seed, then `steps`
 * AdamW updates with gradients uniform in [-0.5, 0.5) drawn from *rng (an
 * LCG, advanced).  0, or -1 (out of memory). */
static int range_make(range_t *r, const chorus_gpt_t *m, uint64_t seed, size_t lo, size_t n,
                      int steps, unsigned long long *rng) {
  const chorus_optim_config_t oc = CHORUS_OPTIM_ADAMW_DEFAULT;
  r->lo = lo, r->n = n;
  r->par = malloc(n * sizeof(float) + 1);
  float *g = malloc(n * sizeof(float) + 1);
  if (!r->par || !g || chorus_optim_create(&oc, n, &r->opt) != CHORUS_OK) {
    free(g);
    return -1;
  }
  chorus_gpt_init_range(m, seed, lo, n, r->par);
  for (int s = 0; s < steps; s++) {
    for (size_t i = 0; i < n; i++) {
      *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
      g[i] = (float)((*rng >> 40) & 0xffffff) / (float)0x1000000 - 0.5f;
    }
    chorus_optim_step(r->opt, r->par, g, 1e-2f);
  }
  free(g);
  return 0;
}

static void range_free(range_t *r) {
  free(r->par);
  chorus_optim_destroy(r->opt);
  memset(r, 0, sizeof *r);
}

/* The optimizer's step count (the first field of its saved state); -1 when
 * out of memory. */
static int64_t steps_of(const chorus_optim_t *o) {
  unsigned char *b = malloc(chorus_optim_state_size(o));
  int64_t t = -1;
  if (b) chorus_optim_state_save(o, b), memcpy(&t, b, sizeof t);
  free(b);
  return t;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
  (void)st, (void)flag, (void)f;
  return remove(p);
}
/* Removes the directory p and all below it. */
static void rm_tree(const char *p) {
  nftw(p, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

#endif
