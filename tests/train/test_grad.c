/*
 * test_grad.c - every layer's backward against central finite differences,
 * then the whole model's.
 *
 * For a layer y = f(x, w) and a fixed random upstream gradient g, the
 * scalar s = sum(g * y) has ds/dx = the layer's dx given dout = g; each
 * checked entry is perturbed by +-eps and (s+ - s-) / 2eps compared with
 * the analytic value, with s accumulated in double.  Tolerance: |a - n| <=
 * 1e-3 + 2e-2 |n| (float forward passes).  The model check perturbs entries
 * of every parameter tensor and compares with chorus_gpt_backward.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "harness.h"
#include "train/layers.h"

static uint64_t g_seed = 12345;
static float frand(void) { /* uniform in [-1, 1) */
  g_seed = g_seed * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((g_seed >> 40) / 8388608.0 - 1.0);
}
static float *rvec(size_t n, float scale) {
  float *p = malloc(sizeof(float) * n);
  for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
  return p;
}
static float *zvec(size_t n) { return calloc(n, sizeof(float)); }
static double dot(const float *a, const float *b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
  return s;
}

static int g_checked;
static int close_enough(double analytic, double numeric) {
  return fabs(analytic - numeric) <= 1e-3 + 2e-2 * fabs(numeric);
}

/* Compares analytic[i] with the numeric derivative of eval() w.r.t. x[i]
 * for every i (or a stride of them). */
#define CHECK_GRAD(what, x, n, analytic, eval_expr)                              \
  do {                                                                           \
    const float eps_ = 1e-2f;                                                    \
    size_t step_ = (n) > 64 ? (n) / 64 : 1;                                      \
    for (size_t i_ = 0; i_ < (n); i_ += step_) {                                 \
      float keep_ = (x)[i_];                                                     \
      (x)[i_] = keep_ + eps_;                                                    \
      double up_ = (eval_expr);                                                  \
      (x)[i_] = keep_ - eps_;                                                    \
      double down_ = (eval_expr);                                                \
      (x)[i_] = keep_;                                                           \
      double num_ = (up_ - down_) / (2.0 * eps_);                                \
      g_checked++;                                                               \
      if (!close_enough((analytic)[i_], num_)) {                                 \
        HARNESS_FAIL("%s[%zu]: analytic %.6g, numeric %.6g", what, i_,           \
                     (double)(analytic)[i_], num_);                              \
        break;                                                                   \
      }                                                                          \
    }                                                                            \
  } while (0)

/* ------------------------------------------------------------ the layers */

enum { B = 2, T = 5, C = 8, NH = 2, V = 11 };

static float *g_out;
static const float *g_g;

static double eval_ln(float *x, float *w, float *b) {
  float mean[B * T], rstd[B * T];
  chorus__layernorm_fwd(g_out, mean, rstd, x, w, b, B * T, C);
  return dot(g_out, g_g, B * T * C);
}

TEST(layernorm) {
  size_t n = B * T * C;
  float *x = rvec(n, 2), *w = rvec(C, 1), *b = rvec(C, 1), *g = rvec(n, 1);
  float *dx = zvec(n), *dw = zvec(C), *db = zvec(C), mean[B * T], rstd[B * T];
  g_out = zvec(n);
  g_g = g;
  chorus__layernorm_fwd(g_out, mean, rstd, x, w, b, B * T, C);
  chorus__layernorm_bwd(dx, dw, db, g, x, w, mean, rstd, B * T, C);
  CHECK_GRAD("ln.dx", x, n, dx, eval_ln(x, w, b));
  CHECK_GRAD("ln.dw", w, (size_t)C, dw, eval_ln(x, w, b));
  CHECK_GRAD("ln.db", b, (size_t)C, db, eval_ln(x, w, b));
  free(x), free(w), free(b), free(g), free(dx), free(dw), free(db), free(g_out);
}

static double eval_linear(float *x, float *W, float *bias, float *res, int N, int IC, int OC) {
  chorus__linear_fwd(g_out, x, W, bias, res, N, IC, OC);
  return dot(g_out, g_g, (size_t)N * OC);
}

TEST(linear) {
  const int N = B * T, IC = 6, OC = 7;
  float *x = rvec((size_t)N * IC, 1), *W = rvec((size_t)OC * IC, 1), *bias = rvec(OC, 1);
  float *g = rvec((size_t)N * OC, 1);
  float *res = rvec((size_t)N * OC, 1);
  float *dx = rvec((size_t)N * IC, 1), *dW = zvec((size_t)OC * IC), *db = zvec(OC);
  g_out = zvec((size_t)N * OC);
  g_g = g;
  chorus__linear_bwd(dx, dW, db, g, x, W, N, IC, OC); /* dx is overwritten */
  CHECK_GRAD("linear.dx", x, (size_t)N * IC, dx, eval_linear(x, W, bias, NULL, N, IC, OC));
  CHECK_GRAD("linear.dW", W, (size_t)OC * IC, dW, eval_linear(x, W, bias, NULL, N, IC, OC));
  CHECK_GRAD("linear.db", bias, (size_t)OC, db, eval_linear(x, W, bias, NULL, N, IC, OC));
  /* With a residual: d/dres is the identity, and the rest is unchanged. */
  CHECK_GRAD("linear.dres", res, (size_t)N * OC, g, eval_linear(x, W, bias, res, N, IC, OC));
  CHECK_GRAD("linear.dW+res", W, (size_t)OC * IC, dW, eval_linear(x, W, NULL, res, N, IC, OC));
  free(x), free(W), free(bias), free(res), free(g), free(dx), free(dW), free(db), free(g_out);
}

static float *g_att, *g_scratch;
static int g_at, g_ab, g_ac, g_anh;
static double eval_attn(float *qkv) {
  chorus__attention_fwd(g_out, g_att, qkv, g_scratch, g_ab, g_at, g_ac, g_anh);
  return dot(g_out, g_g, (size_t)g_ab * g_at * g_ac);
}

/* Shapes that exercise the kernels' edges: T not a multiple of the 4-row
 * blocks or the 16-column strips, head sizes that need padded copies (4)
 * and that are read in place (16, 32), one row, and the default T = 128.
 * Every output and scratch buffer starts with garbage. */
static void check_attention(int b, int t, int c, int nh) {
  g_ab = b, g_at = t, g_ac = c, g_anh = nh;
  size_t n = (size_t)b * t * 3 * c;
  float *qkv = rvec(n, 1), *g = rvec((size_t)b * t * c, 1), *dqkv = rvec(n, 5);
  float *scratch = rvec(chorus__attention_scratch(t, c, nh), 5);
  g_scratch = scratch;
  g_att = rvec((size_t)b * nh * t * t, 5);
  g_out = rvec((size_t)b * t * c, 5);
  g_g = g;
  chorus__attention_fwd(g_out, g_att, qkv, scratch, b, t, c, nh);
  /* Causality: row i of every probability matrix is zero above i and sums
   * to 1. */
  for (int bh = 0; bh < b * nh; bh++)
    for (int i = 0; i < t; i++) {
      double sum = 0;
      for (int u = 0; u < t; u++) {
        float p = g_att[((size_t)bh * t + i) * t + u];
        if (u > i) ASSERT_TRUE(p == 0.0f);
        sum += p;
      }
      ASSERT_TRUE(fabs(sum - 1.0) < 1e-5);
    }
  chorus__attention_bwd(dqkv, g, qkv, g_att, scratch, b, t, c, nh);
  CHECK_GRAD("attention.dqkv", qkv, n, dqkv, eval_attn(qkv));
  free(qkv), free(g), free(dqkv), free(scratch), free(g_att), free(g_out);
}

TEST(attention) {
  check_attention(B, T, C, NH); /* hs 4 */
  check_attention(1, 70, C, NH);
  check_attention(1, 1, C, NH);
  check_attention(2, 37, 64, 2); /* hs 32, in place */
  check_attention(1, 19, 16, 1); /* hs 16 */
  check_attention(1, 23, 40, 2); /* hs 20: one full strip and a padded one */
  check_attention(1, 128, 64, 2);
}

static double eval_gelu(float *x, size_t n) {
  chorus__gelu_fwd(g_out, x, n);
  return dot(g_out, g_g, n);
}

TEST(gelu) {
  size_t n = 200;
  float *x = rvec(n, 4), *g = rvec(n, 1), *dx = rvec(n, 3);
  g_out = zvec(n);
  g_g = g;
  chorus__gelu_bwd(dx, x, g, n); /* dx is overwritten */
  CHECK_GRAD("gelu.dx", x, n, dx, eval_gelu(x, n));
  free(x), free(g), free(dx), free(g_out);
}

static double eval_xent(float *logits, const int *targets, int N) {
  float probs[B * T * V], losses[B * T];
  return chorus__xent_fwd(probs, losses, logits, targets, N, V);
}

TEST(cross_entropy) {
  const int N = B * T;
  float *logits = rvec((size_t)N * V, 3), probs[B * T * V], losses[B * T];
  float *dl = zvec((size_t)N * V);
  int targets[B * T];
  for (int i = 0; i < N; i++) targets[i] = i == 3 ? -1 : (i * 7) % V; /* one ignored */
  float loss = chorus__xent_fwd(probs, losses, logits, targets, N, V);
  ASSERT_TRUE(loss > 0 && losses[3] == 0.0f);
  chorus__xent_bwd(dl, probs, targets, 1.0f, N, V);
  for (int v = 0; v < V; v++) ASSERT_TRUE(dl[3 * V + v] == 0.0f);
  CHECK_GRAD("xent.dlogits", logits, (size_t)N * V, dl, eval_xent(logits, targets, N));
  free(logits), free(dl);
}

static double eval_enc(const int *tok, float *wte, float *wpe) {
  chorus__encoder_fwd(g_out, tok, wte, wpe, B, T, C);
  return dot(g_out, g_g, B * T * C);
}

TEST(encoder) {
  int tok[B * T];
  for (int i = 0; i < B * T; i++) tok[i] = (i * 3) % V;
  tok[4] = tok[1]; /* a repeated token accumulates */
  float *wte = rvec((size_t)V * C, 1), *wpe = rvec((size_t)T * C, 1), *g = rvec(B * T * C, 1);
  float *dwte = zvec((size_t)V * C), *dwpe = zvec((size_t)T * C);
  g_out = zvec(B * T * C);
  g_g = g;
  chorus__encoder_bwd(dwte, dwpe, g, tok, B, T, C);
  CHECK_GRAD("encoder.dwte", wte, (size_t)V * C, dwte, eval_enc(tok, wte, wpe));
  CHECK_GRAD("encoder.dwpe", wpe, (size_t)T * C, dwpe, eval_enc(tok, wte, wpe));
  free(wte), free(wpe), free(g), free(dwte), free(dwpe), free(g_out);
}

/* ------------------------------------------------------------ the model */

static chorus_gpt_t *g_m;
static int g_nready_skip;
static void count_ready(void *arg, int k) {
  (void)arg, (void)k;
  g_nready_skip++;
}
static int g_tok[2 * 6], g_tgt[2 * 6];
static double eval_model(void) {
  float loss = 0;
  chorus_gpt_forward(g_m, g_tok, g_tgt, 2, 6, &loss);
  return loss;
}

/* g_m: a 13-token vocabulary, context 6, 2 heads of 4 channels, the given
 * number of blocks; g_tok / g_tgt: a batch of 2 x 6.  The weights get
 * random offsets bigger than the initialisation so that every path
 * matters. */
static int model_setup(int layers, uint64_t seed) {
  chorus_gpt_config_t cfg = {13, 6, layers, 2, 8};
  if (chorus_gpt_create(&cfg, 2, seed, &g_m) != CHORUS_OK) return -1;
  for (int i = 0; i < 12; i++) {
    g_tok[i] = (i * 5 + 1) % 13;
    g_tgt[i] = (i * 3 + 2) % 13;
  }
  float *p = chorus_gpt_params(g_m);
  for (size_t i = 0; i < chorus_gpt_num_params(g_m); i++) p[i] += 0.3f * frand();
  return 0;
}

TEST(model) {
  ASSERT_EQ(model_setup(2, 7), 0);
  float *p = chorus_gpt_params(g_m);
  size_t np = chorus_gpt_num_params(g_m);
  float loss;
  ASSERT_EQ(chorus_gpt_forward(g_m, g_tok, g_tgt, 2, 6, &loss), CHORUS_OK);
  chorus_gpt_zero_grad(g_m);
  ASSERT_EQ(chorus_gpt_backward(g_m, 1.0f, NULL, NULL), CHORUS_OK);
  float *grad = malloc(sizeof(float) * np);
  memcpy(grad, chorus_gpt_grads(g_m), sizeof(float) * np);
  for (int k = 0; k < chorus_gpt_num_tensors(g_m); k++) {
    const chorus_gpt_tensor_t *t = chorus_gpt_tensor(g_m, k);
    CHECK_GRAD(t->name, p + t->offset, t->size, grad + t->offset, eval_model());
  }
  /* The backward's scratch is not cleared between steps (the layers
   * overwrite it): after a step on other data, the same batch must give
   * the same gradients bit for bit. */
  int tok2[12], tgt2[12];
  for (int i = 0; i < 12; i++) tok2[i] = (i * 7 + 3) % 13, tgt2[i] = (i * 11) % 13;
  ASSERT_EQ(chorus_gpt_forward(g_m, tok2, tgt2, 2, 6, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_backward(g_m, 3.0f, NULL, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_forward(g_m, g_tok, g_tgt, 2, 6, NULL), CHORUS_OK);
  chorus_gpt_zero_grad(g_m);
  ASSERT_EQ(chorus_gpt_backward(g_m, 1.0f, NULL, NULL), CHORUS_OK);
  ASSERT_TRUE(memcmp(grad, chorus_gpt_grads(g_m), sizeof(float) * np) == 0);
  free(grad);
  chorus_gpt_destroy(g_m);
}

/* A skipped block is the identity: the rest of the model still gets exact
 * gradients, the block's own stay zero, and it is still announced ready. */
TEST(model_skipped_block) {
  ASSERT_EQ(model_setup(3, 9), 0);
  ASSERT_EQ(chorus_gpt_skip_layer(g_m, 1, 1), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_skip_layer(g_m, 3, 1), CHORUS_ERR_INVALID_ARG);
  float *p = chorus_gpt_params(g_m);
  size_t np = chorus_gpt_num_params(g_m);
  ASSERT_EQ(chorus_gpt_forward(g_m, g_tok, g_tgt, 2, 6, NULL), CHORUS_OK);
  chorus_gpt_zero_grad(g_m);
  g_nready_skip = 0;
  ASSERT_EQ(chorus_gpt_backward(g_m, 1.0f, count_ready, NULL), CHORUS_OK);
  ASSERT_EQ(g_nready_skip, chorus_gpt_num_tensors(g_m));
  float *grad = malloc(sizeof(float) * np);
  memcpy(grad, chorus_gpt_grads(g_m), sizeof(float) * np);
  for (int k = 0; k < chorus_gpt_num_tensors(g_m); k++) {
    const chorus_gpt_tensor_t *t = chorus_gpt_tensor(g_m, k);
    if (t->layer == 1) {
      for (size_t i = 0; i < t->size; i++) ASSERT_TRUE(grad[t->offset + i] == 0.0f);
      continue;
    }
    CHECK_GRAD(t->name, p + t->offset, t->size, grad + t->offset, eval_model());
  }
  free(grad);
  chorus_gpt_destroy(g_m);
}

/* Every tensor is announced ready exactly once, and only after the last
 * contribution to its gradient (the embeddings at the very end). */
static int g_ready[256], g_nready;
static void on_ready(void *arg, int k) {
  (void)arg;
  g_ready[g_nready++] = k;
}

TEST(ready_order) {
  chorus_gpt_config_t cfg = {13, 6, 3, 2, 8};
  chorus_gpt_t *m;
  ASSERT_EQ(chorus_gpt_create(&cfg, 2, 7, &m), CHORUS_OK);
  int tok[12], tgt[12];
  for (int i = 0; i < 12; i++) tok[i] = tgt[i] = i % 13;
  ASSERT_EQ(chorus_gpt_forward(m, tok, tgt, 2, 6, NULL), CHORUS_OK);
  g_nready = 0;
  ASSERT_EQ(chorus_gpt_backward(m, 1.0f, on_ready, NULL), CHORUS_OK);
  int n = chorus_gpt_num_tensors(m), seen[256] = {0};
  ASSERT_EQ(g_nready, n);
  for (int i = 0; i < g_nready; i++) seen[g_ready[i]]++;
  for (int k = 0; k < n; k++) ASSERT_EQ(seen[k], 1);
  ASSERT_EQ(g_ready[n - 1], 0); /* wte: the output projection and the input */
  /* Blocks are announced from the last to the first. */
  int last_layer = 99;
  for (int i = 0; i < g_nready; i++) {
    int ly = chorus_gpt_tensor(m, g_ready[i])->layer;
    if (ly < 0) continue;
    ASSERT_TRUE(ly <= last_layer);
    last_layer = ly;
  }
  chorus_gpt_destroy(m);
}

TEST(bad_arguments) {
  chorus_gpt_config_t cfg = {13, 6, 2, 3, 8}; /* 8 channels, 3 heads */
  chorus_gpt_t *m = NULL;
  ASSERT_EQ(chorus_gpt_create(&cfg, 2, 7, &m), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(strstr(chorus_train_last_error(), "multiple of heads") != NULL);
  cfg.heads = 2;
  ASSERT_EQ(chorus_gpt_create(&cfg, 2, 7, &m), CHORUS_OK);
  int tok[12] = {0}, bad[12] = {0};
  bad[5] = 13;
  ASSERT_EQ(chorus_gpt_forward(m, bad, NULL, 2, 6, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_gpt_forward(m, tok, NULL, 3, 6, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_gpt_forward(m, tok, NULL, 2, 7, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_gpt_forward(m, tok, NULL, 2, 6, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_gpt_backward(m, 1.0f, NULL, NULL), CHORUS_ERR_INVALID_ARG);
  chorus_gpt_destroy(m);
}

int main(void) {
  RUN(layernorm);
  RUN(linear);
  RUN(attention);
  RUN(gelu);
  RUN(cross_entropy);
  RUN(encoder);
  RUN(model);
  RUN(model_skipped_block);
  RUN(ready_order);
  RUN(bad_arguments);
  printf("%d derivatives checked\n", g_checked);
  return HARNESS_DONE();
}
