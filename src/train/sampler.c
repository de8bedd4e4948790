/*
 * sampler.c - DistributedSampler with PyTorch's exact index lists.
 *
 * torch.randperm(n, generator) on the CPU as Debian 12's torch 1.13 draws
 * it for every n below 2^32 (compared with the real torch.randperm on both
 * sides of 2^32 / 20 = 214,748,364): the generator is MT19937 seeded with
 * the low 32 bits of the seed (the reference init_genrand), and for
 * i = 0 .. n-2 the i-th element is swapped with element i + (next 32-bit
 * output mod (n - i)).  Later torch releases draw 64-bit numbers from
 * n >= 2^32 / 20 on, so their lists differ from there; datasets that long
 * (214 M sequences: 27 G tokens at context 128) are not shuffled their way.
 */
#include <stdint.h>
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
  size_t n, num_samples;
  int world, rank, shuffle, drop_last;
  uint64_t seed;
  long epoch;
  size_t start;   /* this world's part of the epoch starts at this global position */
  uint32_t *mine; /* num_samples */
  size_t pos;
};

/* torch: with drop_last and a remainder, ceil((n - world) / world), which
 * is n / world; else ceil(n / world). */
static size_t per_rank(size_t n, int world, int drop_last) {
  size_t w = (size_t)world;
  return drop_last ? n / w : (n + w - 1) / w;
}

/* This rank's list of the epoch from global position start on: the
 * permutation (built for the call and freed again, so only the rank's list
 * stays resident), padded by repeating its head, every world-th. */
static chorus_result_t build(chorus_sampler_t *s) {
  size_t num = per_rank(s->n - s->start, s->world, s->drop_last);
  uint32_t *perm = malloc(sizeof(uint32_t) * s->n);
  uint32_t *mine = realloc(s->mine, sizeof(uint32_t) * (num ? num : 1));
  if (mine) s->mine = mine;
  if (!perm || !mine) {
    free(perm);
    s->num_samples = s->pos = 0; /* next() tries again */
    return CHORUS_ERR_NO_MEMORY;
  }
  for (size_t i = 0; i < s->n; i++) perm[i] = (uint32_t)i;
  if (s->shuffle) {
    mt19937_t g;
    mt_seed(&g, (uint32_t)(s->seed + (uint64_t)s->epoch));
    for (size_t i = 0; i + 1 < s->n; i++) {
      size_t z = mt_next(&g) % (s->n - i);
      uint32_t t = perm[i];
      perm[i] = perm[i + z];
      perm[i + z] = t;
    }
  }
  for (size_t k = 0; k < num; k++)
    s->mine[k] = perm[(s->start + k * (size_t)s->world + (size_t)s->rank) % s->n];
  free(perm);
  s->num_samples = num;
  s->pos = 0;
  return CHORUS_OK;
}

chorus_result_t chorus_sampler_create(size_t n, int world, int rank, int shuffle, uint64_t seed,
                                      int drop_last, chorus_sampler_t **out) {
  *out = NULL;
  if (n == 0 || n > UINT32_MAX || world < 1 || rank < 0 || rank >= world ||
      (drop_last && n < (size_t)world))
    return CHORUS_ERR_INVALID_ARG;
  chorus_sampler_t *s = calloc(1, sizeof *s);
  if (!s) return CHORUS_ERR_NO_MEMORY;
  s->n = n;
  s->world = world;
  s->rank = rank;
  s->shuffle = shuffle;
  s->drop_last = drop_last;
  s->seed = seed;
  if (build(s) != CHORUS_OK) {
    chorus_sampler_destroy(s);
    return CHORUS_ERR_NO_MEMORY;
  }
  *out = s;
  return CHORUS_OK;
}

void chorus_sampler_destroy(chorus_sampler_t *s) {
  if (!s) return;
  free(s->mine);
  free(s);
}

chorus_result_t chorus_sampler_seek(chorus_sampler_t *s, long epoch, size_t taken) {
  if (epoch < 0) return CHORUS_ERR_INVALID_ARG;
  s->epoch = epoch;
  s->start = taken < s->n ? taken : s->n;
  return build(s);
}

chorus_result_t chorus_sampler_set_epoch(chorus_sampler_t *s, long epoch) {
  return chorus_sampler_seek(s, epoch, 0);
}

long chorus_sampler_epoch(const chorus_sampler_t *s) { return s->epoch; }
size_t chorus_sampler_len(const chorus_sampler_t *s) { return s->num_samples; }
size_t chorus_sampler_at(const chorus_sampler_t *s, size_t k) {
  return k < s->num_samples ? s->mine[k] : SIZE_MAX;
}
size_t chorus_sampler_pos(const chorus_sampler_t *s) { return s->pos; }
void chorus_sampler_set_pos(chorus_sampler_t *s, size_t pos) {
  s->pos = pos < s->num_samples ? pos : s->num_samples;
}
size_t chorus_sampler_taken(const chorus_sampler_t *s) {
  return s->start + s->pos * (size_t)s->world;
}

chorus_result_t chorus_sampler_reshard(chorus_sampler_t *s, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world || (s->drop_last && s->n < (size_t)world))
    return CHORUS_ERR_INVALID_ARG;
  size_t taken = chorus_sampler_taken(s);
  s->world = world;
  s->rank = rank;
  return chorus_sampler_seek(s, s->epoch, taken);
}

chorus_result_t chorus_sampler_next(chorus_sampler_t *s, size_t *index) {
  /* An epoch ends when this rank's list does (a resumed part of an epoch
   * can be empty: then the next one starts). */
  for (int tries = 0; s->pos >= s->num_samples; tries++) {
    chorus_result_t st = chorus_sampler_set_epoch(s, s->epoch + 1);
    if (st != CHORUS_OK) return st;
    if (tries > 0 && s->num_samples == 0) return CHORUS_ERR_INVALID_ARG;
  }
  *index = s->mine[s->pos++];
  return CHORUS_OK;
}
