/*
 * optim.c - AdamW and SGD over flat parameter buffers, gradient norm and
 * clipping, and the warm-up + cosine learning-rate schedule.  Same update
 * rules as torch.optim.AdamW / torch.optim.SGD (defaults: no amsgrad, no
 * nesterov, dampening 0), element by element, so a run can be compared
 * with PyTorch's.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "runtime.h"

struct chorus_optim {
  chorus_optim_config_t cfg;
  size_t n;
  long t;       /* steps taken */
  float *m, *v; /* AdamW moments; SGD: m is the momentum buffer */
};

chorus_result_t chorus_optim_create(const chorus_optim_config_t *cfg, size_t n,
                                    chorus_optim_t **out) {
  *out = NULL;
  if (!cfg || (cfg->kind != CHORUS_OPTIM_ADAMW && cfg->kind != CHORUS_OPTIM_SGD))
    return CHORUS_ERR_INVALID_ARG;
  chorus_optim_t *o = calloc(1, sizeof *o);
  if (!o) return CHORUS_ERR_NO_MEMORY;
  o->cfg = *cfg;
  o->n = n;
  o->m = calloc(n ? n : 1, sizeof(float));
  o->v = cfg->kind == CHORUS_OPTIM_ADAMW ? calloc(n ? n : 1, sizeof(float)) : NULL;
  if (!o->m || (cfg->kind == CHORUS_OPTIM_ADAMW && !o->v)) {
    chorus_optim_destroy(o);
    return CHORUS_ERR_NO_MEMORY;
  }
  *out = o;
  return CHORUS_OK;
}

void chorus_optim_destroy(chorus_optim_t *o) {
  if (!o) return;
  free(o->m);
  free(o->v);
  free(o);
}

void chorus_optim_begin_step(chorus_optim_t *o) { o->t++; }

void chorus_optim_update(chorus_optim_t *o, size_t state_off, float *p, const float *g, size_t n,
                         float lr) {
  const chorus_optim_config_t *c = &o->cfg;
  if (state_off > o->n || n > o->n - state_off) return; /* documented: ranges inside n */
  float *m = o->m + state_off, *v = o->v ? o->v + state_off : NULL;
  if (c->kind == CHORUS_OPTIM_ADAMW) {
    const float b1 = c->beta1, b2 = c->beta2, wd = c->weight_decay;
    const float bc1 = 1.0f - powf(b1, (float)o->t), bc2 = 1.0f - powf(b2, (float)o->t);
    const float step = lr / bc1, bc2_sqrt = sqrtf(bc2);
    for (size_t i = 0; i < n; i++) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] -= step * m[i] / (sqrtf(v[i]) / bc2_sqrt + c->eps);
    }
  } else {
    const float mu = c->momentum, wd = c->weight_decay;
    for (size_t i = 0; i < n; i++) {
      float d = g[i] + wd * p[i];
      if (mu != 0.0f) {
        m[i] = o->t == 1 ? d : mu * m[i] + d;
        d = m[i];
      }
      p[i] -= lr * d;
    }
  }
}

void chorus_optim_step(chorus_optim_t *o, float *p, const float *g, float lr) {
  chorus_optim_begin_step(o);
  chorus_optim_update(o, 0, p, g, o->n, lr);
}

/* Layout of the blob: int64 step count, then m (and v for AdamW). */
size_t chorus_optim_state_size(const chorus_optim_t *o) {
  return sizeof(int64_t) + sizeof(float) * o->n * (o->v ? 2 : 1);
}

void chorus__optim_raw(chorus_optim_t *o, long **t, float **m, float **v, size_t *n) {
  *t = &o->t;
  *m = o->m;
  *v = o->v;
  *n = o->n;
}

void chorus_optim_state_save(const chorus_optim_t *o, void *dst) {
  int64_t t = o->t;
  char *d = dst;
  memcpy(d, &t, sizeof t);
  memcpy(d + sizeof t, o->m, sizeof(float) * o->n);
  if (o->v) memcpy(d + sizeof t + sizeof(float) * o->n, o->v, sizeof(float) * o->n);
}

chorus_result_t chorus_optim_state_load(chorus_optim_t *o, const void *src, size_t len) {
  if (len != chorus_optim_state_size(o)) return CHORUS_ERR_INVALID_ARG;
  int64_t t;
  const char *s = src;
  memcpy(&t, s, sizeof t);
  if (t < 0) return CHORUS_ERR_INVALID_ARG;
  o->t = (long)t;
  memcpy(o->m, s + sizeof t, sizeof(float) * o->n);
  if (o->v) memcpy(o->v, s + sizeof t + sizeof(float) * o->n, sizeof(float) * o->n);
  return CHORUS_OK;
}

/* In double, 8 partial sums (GCC/Clang vectors) added in a fixed order:
 * the serial sum waited on every addition's latency (0.8 ms a step at the
 * default size, 1 % of it). */
typedef float f8 __attribute__((vector_size(32)));
typedef double d8 __attribute__((vector_size(64)));

double chorus_grad_norm(const float *g, size_t n) { return sqrt(chorus_grad_sumsq(g, n)); }

double chorus_grad_sumsq(const float *g, size_t n) {
  d8 acc = {0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f8 v;
    memcpy(&v, g + i, sizeof v);
    const d8 d = __builtin_convertvector(v, d8);
    acc += d * d;
  }
  double lanes[8], s = 0;
  memcpy(lanes, &acc, sizeof lanes);
  for (int j = 0; j < 8; j++) s += lanes[j];
  for (; i < n; i++) s += (double)g[i] * g[i];
  return s;
}

void chorus_grad_clip(float *g, size_t n, double norm, double max_norm) {
  double k = max_norm / (norm + 1e-6);
  if (k >= 1.0) return;
  for (size_t i = 0; i < n; i++) g[i] = (float)(g[i] * k);
}

float chorus_lr_at(long step, long warmup, long total, float max_lr, float min_lr) {
  if (step < warmup) return max_lr * (float)(step + 1) / (float)warmup;
  if (step >= total) return min_lr;
  double ratio = (double)(step - warmup) / (double)(total > warmup ? total - warmup : 1);
  double coeff = 0.5 * (1.0 + cos(3.141592653589793 * ratio));
  return (float)(min_lr + coeff * (max_lr - min_lr));
}
