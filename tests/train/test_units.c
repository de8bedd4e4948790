/*
 * test_units.c - the pieces sharded training stands on, without ranks:
 * units cover the layout; chorus_gpt_init_range gives every range the bits
 * chorus_gpt_create gives it; a model whose units are bound to buffers of
 * the caller (CHORUS_GPT_EXTERNAL) computes exactly what the ordinary model
 * computes, and the unit hook hears every unit in compute order; the
 * optimizer updated range by range equals one whole step.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "harness.h"

/* Odd sizes everywhere: ranges that start and end inside Box-Muller pairs. */
static const chorus_gpt_config_t k_cfg = {37, 9, 3, 3, 15};

TEST(units_cover_the_layout) {
  chorus_gpt_t *m;
  ASSERT_EQ(chorus_gpt_create(&k_cfg, 2, 5, &m), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_num_units(m), k_cfg.layers + 2);
  size_t next = 0;
  int tensor = 0;
  for (int u = 0; u < chorus_gpt_num_units(m); u++) {
    const chorus_gpt_unit_t *un = chorus_gpt_unit(m, u);
    ASSERT_EQ(un->offset, next);
    ASSERT_EQ(un->first_tensor, tensor);
    next += un->size;
    tensor += un->ntensors;
  }
  ASSERT_EQ(next, chorus_gpt_num_params(m));
  ASSERT_EQ(tensor, chorus_gpt_num_tensors(m));
  ASSERT_TRUE(chorus_gpt_unit(m, -1) == NULL && chorus_gpt_unit(m, k_cfg.layers + 2) == NULL);
  chorus_gpt_destroy(m);
}

TEST(init_range_equals_create) {
  chorus_gpt_t *m;
  ASSERT_EQ(chorus_gpt_create(&k_cfg, 2, 1234567, &m), CHORUS_OK);
  const size_t n = chorus_gpt_num_params(m);
  const float *full = chorus_gpt_params(m);
  float *got = malloc(n * sizeof(float));
  ASSERT_TRUE(got != NULL);
  unsigned long long s = 99;
  for (int trial = 0; trial < 300; trial++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    size_t off = (size_t)(s >> 33) % n;
    size_t len = 1 + (size_t)(s >> 13) % (n - off);
    if (trial == 0) off = 0, len = n;
    memset(got, 0xff, n * sizeof(float));
    chorus_gpt_init_range(m, 1234567, off, len, got);
    if (memcmp(got, full + off, len * sizeof(float))) {
      HARNESS_FAIL("range [%zu, %zu) differs from chorus_gpt_create's", off, off + len);
      break;
    }
  }
  free(got);
  chorus_gpt_destroy(m);
}

typedef struct {
  int n;
  int ev[64], unit[64];
} seen_t;

static chorus_result_t note(void *arg, chorus_gpt_event_t ev, int unit, int train) {
  seen_t *s = arg;
  (void)train;
  if (s->n < 64) s->ev[s->n] = (int)ev, s->unit[s->n++] = unit;
  return CHORUS_OK;
}

TEST(external_units_compute_the_same) {
  const int B = 2, T = 7, N = B * T;
  int tok[14], tgt[14];
  for (int i = 0; i < N; i++) tok[i] = (i * 7) % k_cfg.vocab, tgt[i] = (i * 5 + 3) % k_cfg.vocab;
  chorus_gpt_t *a, *b;
  ASSERT_EQ(chorus_gpt_create(&k_cfg, B, 42, &a), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_create_ex(&k_cfg, B, 42, CHORUS_GPT_EXTERNAL, &b), CHORUS_OK);
  ASSERT_TRUE(chorus_gpt_params(b) == NULL && chorus_gpt_grads(b) == NULL);
  float la = 0, lb = 0;
  /* Unbound: a clear error, not a crash. */
  ASSERT_EQ(chorus_gpt_forward(b, tok, tgt, B, T, &lb), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(strstr(chorus_train_last_error(), "unit 0 has no parameters") != NULL);
  const int U = chorus_gpt_num_units(b);
  float **p = calloc((size_t)U, sizeof *p), **g = calloc((size_t)U, sizeof *g);
  for (int u = 0; u < U; u++) {
    const chorus_gpt_unit_t *un = chorus_gpt_unit(b, u);
    p[u] = malloc(un->size * sizeof(float));
    g[u] = calloc(un->size, sizeof(float));
    chorus_gpt_init_range(b, 42, un->offset, un->size, p[u]);
    ASSERT_EQ(chorus_gpt_bind_unit(b, u, p[u], g[u]), CHORUS_OK);
  }
  seen_t seen = {0};
  chorus_gpt_set_unit_hook(b, note, &seen);
  ASSERT_EQ(chorus_gpt_forward(a, tok, tgt, B, T, &la), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_forward(b, tok, tgt, B, T, &lb), CHORUS_OK);
  ASSERT_TRUE(la == lb);
  ASSERT_EQ(chorus_gpt_backward(a, 1.0f, NULL, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_backward(b, 1.0f, NULL, NULL), CHORUS_OK);
  for (int u = 0; u < U; u++) {
    const chorus_gpt_unit_t *un = chorus_gpt_unit(b, u);
    ASSERT_TRUE(!memcmp(g[u], chorus_gpt_grads(a) + un->offset, un->size * sizeof(float)));
  }
  /* Forward 0..U-1 then backward U-1..0, a begin and an end each. */
  ASSERT_EQ(seen.n, 4 * U);
  for (int i = 0; i < seen.n; i++) {
    int k = i / 2, bwd = k >= U;
    int want_unit = bwd ? 2 * U - 1 - k : k;
    int want_ev = (bwd ? CHORUS_GPT_BACKWARD_BEGIN : CHORUS_GPT_FORWARD_BEGIN) + (i & 1);
    if (seen.unit[i] != want_unit || seen.ev[i] != want_ev) {
      HARNESS_FAIL("event %d: unit %d event %d, expected unit %d event %d", i, seen.unit[i],
                   seen.ev[i], want_unit, want_ev);
      break;
    }
  }
  /* The last unit's backward needs unit 0's gradients (the tied head). */
  ASSERT_EQ(chorus_gpt_bind_unit(b, 0, p[0], NULL), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_forward(b, tok, tgt, B, T, &lb), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_backward(b, 1.0f, NULL, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(strstr(chorus_train_last_error(), "unit 0 has no gradients bound") != NULL);
  for (int u = 0; u < U; u++) free(p[u]), free(g[u]);
  free(p);
  free(g);
  chorus_gpt_destroy(a);
  chorus_gpt_destroy(b);
}

TEST(optimizer_in_ranges_equals_whole) {
  const size_t n = 1001;
  const chorus_optim_kind_t kinds[2] = {CHORUS_OPTIM_ADAMW, CHORUS_OPTIM_SGD};
  for (int k = 0; k < 2; k++) {
    chorus_optim_config_t c = CHORUS_OPTIM_ADAMW_DEFAULT;
    c.kind = kinds[k];
    c.momentum = 0.9f;
    chorus_optim_t *whole, *parts;
    ASSERT_EQ(chorus_optim_create(&c, n, &whole), CHORUS_OK);
    ASSERT_EQ(chorus_optim_create(&c, n, &parts), CHORUS_OK);
    float pw[1001], pp[1001], g[1001];
    for (size_t i = 0; i < n; i++) pw[i] = pp[i] = sinf((float)i);
    for (int step = 0; step < 3; step++) {
      for (size_t i = 0; i < n; i++) g[i] = cosf((float)(i * (size_t)(step + 2)));
      chorus_optim_step(whole, pw, g, 1e-2f);
      chorus_optim_begin_step(parts);
      const size_t cuts[] = {0, 1, 400, 401, 1000, 1001};
      for (int r = 0; r + 1 < 6; r++)
        chorus_optim_update(parts, cuts[r], pp + cuts[r], g + cuts[r], cuts[r + 1] - cuts[r],
                            1e-2f);
      chorus_optim_update(parts, 1000, pp, g, 5, 1e-2f); /* outside the state: ignored */
    }
    ASSERT_TRUE(!memcmp(pw, pp, sizeof pw));
    chorus_optim_destroy(whole);
    chorus_optim_destroy(parts);
  }
  ASSERT_TRUE(fabs(chorus_grad_sumsq((const float[]){3, 4}, 2) - 25.0) < 1e-12);
}

int main(void) {
  RUN(units_cover_the_layout);
  RUN(init_range_equals_create);
  RUN(external_units_compute_the_same);
  RUN(optimizer_in_ranges_equals_whole);
  return HARNESS_DONE();
}
