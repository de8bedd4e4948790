/*
 * sampler.c - DistributedSampler with PyTorch's exact index lists.
 *
 * torch.randperm(n, generator) on the CPU (torch 1.x, n < 2^32 / 20): the
 * generator is MT19937 seeded with the low 32 bits of the seed (the
 * reference init_genrand), and for i = 0 .. n-2 the i-th element is swapped
 * with element i + (next 32-bit output mod (n - i)).
 */
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"

/* ------------------------------------------------------------- MT19937 */

typedef struct {
  uint32_t mt[624];
  int idx;
} mt19937_t;

static void mt_seed(mt19937_t *g, uint32_t seed) {
  g->mt[0] = seed;
  for (int i = 1; i < 624; i++)
    g->mt[i] = 1812433253u * (g->mt[i - 1] ^ (g->mt[i - 1] >> 30)) + (uint32_t)i;
  g->idx = 624;
}

static uint32_t mt_next(mt19937_t *g) {
  if (g->idx >= 624) {
    for (int i = 0; i < 624; i++) {
      uint32_t y = (g->mt[i] & 0x80000000u) | (g->mt[(i + 1) % 624] & 0x7fffffffu);
      g->mt[i] = g->mt[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
    }
    g->idx = 0;
  }
  uint32_t y = g->mt[g->idx++];
  y ^= y >> 11;
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= y >> 18;
  return y;
}

/* ------------------------------------------------------------- sampler */

struct chorus_sampler {
  size_t n, num_samples, total;
  int world, rank, shuffle, drop_last;
  uint64_t seed;
  long epoch;
  size_t *perm; /* n */
  size_t *mine; /* num_samples */
  size_t pos;
};

chorus_result_t chorus_sampler_create(size_t n, int world, int rank, int shuffle, uint64_t seed,
                                      int drop_last, chorus_sampler_t **out) {
  *out = NULL;
  if (n == 0 || world < 1 || rank < 0 || rank >= world || (drop_last && n < (size_t)world))
    return CHORUS_ERR_INVALID_ARG;
  chorus_sampler_t *s = calloc(1, sizeof *s);
  if (!s) return CHORUS_ERR_NO_MEMORY;
  s->n = n;
  s->world = world;
  s->rank = rank;
  s->shuffle = shuffle;
  s->drop_last = drop_last;
  s->seed = seed;
  size_t w = (size_t)world;
  /* torch: with drop_last and n not divisible, ceil((n - world) / world). */
  s->num_samples = drop_last && n % w ? (n - w + w - 1) / w : (n + w - 1) / w;
  s->total = s->num_samples * w;
  s->perm = malloc(sizeof(size_t) * n);
  s->mine = malloc(sizeof(size_t) * (s->num_samples ? s->num_samples : 1));
  if (!s->perm || !s->mine) {
    chorus_sampler_destroy(s);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus_sampler_set_epoch(s, 0);
  *out = s;
  return CHORUS_OK;
}

void chorus_sampler_destroy(chorus_sampler_t *s) {
  if (!s) return;
  free(s->perm);
  free(s->mine);
  free(s);
}

void chorus_sampler_set_epoch(chorus_sampler_t *s, long epoch) {
  s->epoch = epoch;
  for (size_t i = 0; i < s->n; i++) s->perm[i] = i;
  if (s->shuffle) {
    mt19937_t g;
    mt_seed(&g, (uint32_t)(s->seed + (uint64_t)epoch));
    for (size_t i = 0; i + 1 < s->n; i++) {
      size_t z = mt_next(&g) % (s->n - i);
      size_t t = s->perm[i];
      s->perm[i] = s->perm[i + z];
      s->perm[i + z] = t;
    }
  }
  /* Padded (repeating from the start, as often as needed) or cut to
   * total, then every world-th from rank. */
  for (size_t k = 0; k < s->num_samples; k++) {
    size_t p = k * (size_t)s->world + (size_t)s->rank;
    s->mine[k] = s->perm[p % s->n];
  }
  s->pos = 0;
}

long chorus_sampler_epoch(const chorus_sampler_t *s) { return s->epoch; }
size_t chorus_sampler_len(const chorus_sampler_t *s) { return s->num_samples; }
const size_t *chorus_sampler_indices(const chorus_sampler_t *s) { return s->mine; }
size_t chorus_sampler_pos(const chorus_sampler_t *s) { return s->pos; }
void chorus_sampler_set_pos(chorus_sampler_t *s, size_t pos) {
  s->pos = pos < s->num_samples ? pos : s->num_samples;
}

chorus_result_t chorus_sampler_reshard(chorus_sampler_t *s, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world || (s->drop_last && s->n < (size_t)world))
    return CHORUS_ERR_INVALID_ARG;
  size_t w = (size_t)world;
  size_t num = s->drop_last && s->n % w ? (s->n - w + w - 1) / w : (s->n + w - 1) / w;
  size_t *mine = malloc(sizeof(size_t) * (num ? num : 1));
  if (!mine) return CHORUS_ERR_NO_MEMORY;
  /* Samples the whole world has taken of this epoch so far. */
  size_t taken = s->pos * (size_t)s->world;
  free(s->mine);
  s->mine = mine;
  s->world = world;
  s->rank = rank;
  s->num_samples = num;
  s->total = num * w;
  chorus_sampler_set_epoch(s, s->epoch);
  chorus_sampler_set_pos(s, taken / w);
  return CHORUS_OK;
}

size_t chorus_sampler_next(chorus_sampler_t *s) {
  if (s->pos >= s->num_samples) chorus_sampler_set_epoch(s, s->epoch + 1);
  return s->mine[s->pos++];
}
