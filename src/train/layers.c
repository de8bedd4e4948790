/*
 * layers.c - forward and backward of the transformer's layers (layers.h).
 * Matrix products go through CBLAS; the rest are plain loops the compiler
 * vectorises.  Every backward accumulates (+=) into its gradients.
 */
#include "train/layers.h"

#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The elementwise loops (GELU, softmax) are compiled twice: AVX2 + FMA and
 * the baseline, picked at load time by the CPU (GCC function multiversioning),
 * never -march=native.  Their exponential is fast_expf below. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define VECTOR_CLONES __attribute__((target_clones("avx2,fma", "default")))
#else
#define VECTOR_CLONES
#endif

/* exp(x) for float, branch-free so loops over it vectorise: x = n ln2 + r
 * with |r| <= ln2 / 2 (n rounded to nearest), a degree-7 polynomial for exp(r) (Cephes' expf
 * coefficients), and 2^n built in the exponent bits.  Relative error about
 * 2e-7 on [-87, 88]; below -87 the result is 0. */
static inline float fast_expf(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  /* Round to nearest by adding and removing 1.5 * 2^23 (no call, no
   * branch); the compiler may not fold it without -ffast-math. */
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  union {
    uint32_t u;
    float f;
  } scale = {(uint32_t)((int32_t)n + 127) << 23};
  return p * scale.f;
}

/* tanh(u) as an odd rational function, degree 13 over degree 6 in u, on u
 * clamped to +-7.9 (beyond which float tanh is +-1): the coefficients of
 * the minimax fit that Eigen uses for float.  Absolute error below 4e-7
 * (checked against double tanh on [-12, 12] in steps of 1e-4); one
 * division and eleven multiply-adds, no exponential. */
static inline float fast_tanhf(float u) {
  const float lim = 7.90531110763549805f;
  u = u > lim ? lim : u;
  u = u < -lim ? -lim : u;
  const float u2 = u * u;
  float p = -2.76076847742355e-16f;
  p = p * u2 + 2.00018790482477e-13f;
  p = p * u2 - 8.60467152213735e-11f;
  p = p * u2 + 5.12229709037114e-08f;
  p = p * u2 + 1.48572235717979e-05f;
  p = p * u2 + 6.37261928875436e-04f;
  p = p * u2 + 4.89352455891786e-03f;
  float q = 1.19825839466702e-06f;
  q = q * u2 + 1.18534705686654e-04f;
  q = q * u2 + 2.26843463243900e-03f;
  q = q * u2 + 4.89352518554385e-03f;
  return u * p / q;
}

/* Reductions over a row in LANES independent partial results, combined in
 * a fixed order at the end: GCC vectorises the lane loop without
 * -ffast-math, and the result does not depend on the machine (the same
 * partial sums in the same order on every rank). */
#define LANES 8

static inline float row_sum(const float *x, int n) {
  float acc[LANES] = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += x[i + j];
  float s = 0;
  for (int j = 0; j < LANES; j++) s += acc[j];
  for (; i < n; i++) s += x[i];
  return s;
}

static inline float row_max(const float *x, int n) {
  float acc[LANES];
  for (int j = 0; j < LANES; j++) acc[j] = x[0];
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
  float m = acc[0];
  for (int j = 1; j < LANES; j++) m = acc[j] > m ? acc[j] : m;
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* sum((x - c)^2) */
static inline float row_sqdev(const float *x, float c, int n) {
  float acc[LANES] = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += (x[i + j] - c) * (x[i + j] - c);
  float s = 0;
  for (int j = 0; j < LANES; j++) s += acc[j];
  for (; i < n; i++) s += (x[i] - c) * (x[i] - c);
  return s;
}

/* x[i] = exp(x[i] - c) for i < n; returns their sum. */
static inline float row_exp_sum(float *x, float c, int n) {
  float acc[LANES] = {0};
  int i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; j++) {
      x[i + j] = fast_expf(x[i + j] - c);
      acc[j] += x[i + j];
    }
  float s = 0;
  for (int j = 0; j < LANES; j++) s += acc[j];
  for (; i < n; i++) {
    x[i] = fast_expf(x[i] - c);
    s += x[i];
  }
  return s;
}

/* ------------------------------------------------------------ embeddings */

void chorus__encoder_fwd(float *x, const int *tok, const float *wte, const float *wpe, int B,
                         int T, int C) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      float *o = x + ((size_t)b * T + t) * C;
      const float *e = wte + (size_t)tok[b * T + t] * C, *p = wpe + (size_t)t * C;
      for (int i = 0; i < C; i++) o[i] = e[i] + p[i];
    }
}

void chorus__encoder_bwd(float *dwte, float *dwpe, const float *dx, const int *tok, int B, int T,
                         int C) {
  for (int b = 0; b < B; b++)
    for (int t = 0; t < T; t++) {
      const float *d = dx + ((size_t)b * T + t) * C;
      float *de = dwte + (size_t)tok[b * T + t] * C, *dp = dwpe + (size_t)t * C;
      for (int i = 0; i < C; i++) {
        de[i] += d[i];
        dp[i] += d[i];
      }
    }
}

/* ------------------------------------------------------------- layernorm */

VECTOR_CLONES
void chorus__layernorm_fwd(float *out, float *mean, float *rstd, const float *x, const float *w,
                           const float *b, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *xi = x + (size_t)n * C;
    float *o = out + (size_t)n * C;
    float m = row_sum(xi, C) / (float)C;
    float s = 1.0f / sqrtf(row_sqdev(xi, m, C) / (float)C + 1e-5f);
    for (int i = 0; i < C; i++) o[i] = ((xi[i] - m) * s) * w[i] + b[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

VECTOR_CLONES
void chorus__layernorm_bwd(float *restrict dx, float *restrict dw, float *restrict db,
                           const float *dout, const float *x, const float *w, const float *mean,
                           const float *rstd, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *xi = x + (size_t)n * C, *d = dout + (size_t)n * C;
    float *restrict dxi = dx + (size_t)n * C;
    const float m = mean[n], s = rstd[n];
    /* With xhat = (x - m) s and g = dout * w:
     * dx = s (g - mean(g) - xhat mean(g xhat)). */
    float ga[LANES] = {0}, gxa[LANES] = {0};
    int i = 0;
    for (; i + LANES <= C; i += LANES)
      for (int j = 0; j < LANES; j++) {
        float xhat = (xi[i + j] - m) * s, g = d[i + j] * w[i + j];
        ga[j] += g;
        gxa[j] += g * xhat;
      }
    float gsum = 0, gxsum = 0;
    for (int j = 0; j < LANES; j++) gsum += ga[j], gxsum += gxa[j];
    for (; i < C; i++) {
      float xhat = (xi[i] - m) * s, g = d[i] * w[i];
      gsum += g;
      gxsum += g * xhat;
    }
    const float gmean = gsum / (float)C, gxmean = gxsum / (float)C;
    for (i = 0; i < C; i++) {
      float xhat = (xi[i] - m) * s, g = d[i] * w[i];
      dw[i] += d[i] * xhat;
      db[i] += d[i];
      dxi[i] += s * (g - gmean - xhat * gxmean);
    }
  }
}

/* ---------------------------------------------------------------- linear */

void chorus__linear_fwd(float *out, const float *x, const float *W, const float *bias,
                        const float *res, int N, int IC, int OC) {
  /* out starts as bias + res and the product is added (beta 1): one pass
   * over out instead of a separate residual add. */
  const size_t row = sizeof(float) * (size_t)OC;
  if (bias && res)
    for (int n = 0; n < N; n++) {
      float *o = out + (size_t)n * OC;
      const float *r = res + (size_t)n * OC;
      for (int i = 0; i < OC; i++) o[i] = r[i] + bias[i];
    }
  else if (bias)
    for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, bias, row);
  else if (res && res != out)
    memcpy(out, res, row * (size_t)N);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, x, IC, W, IC,
              bias || res ? 1.0f : 0.0f, out, OC);
}

void chorus__linear_bwd(float *dx, float *dW, float *dbias, const float *dout, const float *x,
                        const float *W, int N, int IC, int OC) {
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IC, OC, 1.0f, dout, OC, W, IC, 0.0f,
                dx, IC);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, IC, N, 1.0f, dout, OC, x, IC, 1.0f, dW,
              IC);
  if (dbias)
    for (int n = 0; n < N; n++) {
      const float *d = dout + (size_t)n * OC;
      for (int o = 0; o < OC; o++) dbias[o] += d[o];
    }
}

/* ------------------------------------------------------------- attention */

/* In place: the first k entries of row become their softmax, the other
 * n - k zero (the causal mask). */
VECTOR_CLONES
static void softmax_row(float *row, int k, int n) {
  float inv = 1.0f / row_exp_sum(row, row_max(row, k), k);
  for (int u = 0; u < k; u++) row[u] *= inv;
  for (int u = k; u < n; u++) row[u] = 0.0f;
}

/* dS = P (dP - sum(P dP)) over the first k entries of a row, 0 after. */
VECTOR_CLONES
static void softmax_row_bwd(float *d, const float *p, int k, int n) {
  float acc[LANES] = {0};
  int u = 0;
  for (; u + LANES <= k; u += LANES)
    for (int j = 0; j < LANES; j++) acc[j] += p[u + j] * d[u + j];
  float dot = 0;
  for (int j = 0; j < LANES; j++) dot += acc[j];
  for (; u < k; u++) dot += p[u] * d[u];
  for (u = 0; u < k; u++) d[u] = p[u] * (d[u] - dot);
  for (u = k; u < n; u++) d[u] = 0.0f;
}

/* The causal mask makes the upper right of every T x T score matrix zero,
 * so the products run over blocks of ATT_ROWS query rows: rows [r0, r1)
 * only see keys [0, r1).  With T = 128 that is 5/8 of the full products'
 * work; smaller blocks save more but run OpenBLAS on ever smaller
 * matrices (measured: 32 rows was the best here). */
#define ATT_ROWS 32

/* For one (b, h): Q, K, V are T x hs with row stride 3C inside qkv; the
 * output rows have stride C. */
void chorus__attention_fwd(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *Q = qkv + (size_t)b * T * ld + (size_t)h * hs;
      const float *K = Q + C, *V = Q + 2 * C;
      float *P = att + ((size_t)b * NH + h) * T * T;
      float *Y = out + (size_t)b * T * C + (size_t)h * hs;
      for (int r0 = 0; r0 < T; r0 += ATT_ROWS) {
        const int r1 = r0 + ATT_ROWS < T ? r0 + ATT_ROWS : T, M = r1 - r0;
        float *Pr = P + (size_t)r0 * T;
        /* S = scale Q K^T, then a causal softmax row by row. */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, r1, hs, scale,
                    Q + (size_t)r0 * ld, ld, K, ld, 0.0f, Pr, T);
        for (int t = r0; t < r1; t++) softmax_row(P + (size_t)t * T, t + 1, T);
        /* Y = P V */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, hs, r1, 1.0f, Pr, T, V, ld, 0.0f,
                    Y + (size_t)r0 * C, C);
      }
    }
}

void chorus__attention_bwd(float *dqkv, const float *dout, const float *qkv, const float *att,
                           float *scratch, int B, int T, int C, int NH) {
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  float *dP = scratch;
  const int last = (T - 1) / ATT_ROWS * ATT_ROWS;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *Q = qkv + (size_t)b * T * ld + (size_t)h * hs;
      const float *K = Q + C, *V = Q + 2 * C;
      float *dQ = dqkv + (size_t)b * T * ld + (size_t)h * hs;
      float *dK = dQ + C, *dV = dQ + 2 * C;
      const float *P = att + ((size_t)b * NH + h) * T * T;
      const float *dY = dout + (size_t)b * T * C + (size_t)h * hs;
      /* The last block (keys [0, T)) goes first and writes dK and dV; the
       * others add to their first r1 rows. */
      for (int r0 = last; r0 >= 0; r0 -= ATT_ROWS) {
        const int r1 = r0 + ATT_ROWS < T ? r0 + ATT_ROWS : T, M = r1 - r0;
        const float beta = r0 == last ? 0.0f : 1.0f;
        const float *Pr = P + (size_t)r0 * T;
        float *dPr = dP + (size_t)r0 * T;
        /* dP = dY V^T;  dV += P^T dY */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, r1, hs, 1.0f,
                    dY + (size_t)r0 * C, C, V, ld, 0.0f, dPr, T);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1, hs, M, 1.0f, Pr, T,
                    dY + (size_t)r0 * C, C, beta, dV, ld);
        /* Softmax backward: masked entries have P = 0 and get 0. */
        for (int t = r0; t < r1; t++) softmax_row_bwd(dP + (size_t)t * T, P + (size_t)t * T, t + 1, r1);
        /* S = scale Q K^T:  dQ = scale dS K;  dK += scale dS^T Q */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, hs, r1, scale, dPr, T, K, ld,
                    0.0f, dQ + (size_t)r0 * ld, ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1, hs, M, scale, dPr, T,
                    Q + (size_t)r0 * ld, ld, beta, dK, ld);
      }
    }
}

/* ------------------------------------------------------------------ GELU */

#define GELU_K 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_A 0.044715f

VECTOR_CLONES
void chorus__gelu_fwd(float *out, const float *x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i];
    out[i] = 0.5f * v * (1.0f + fast_tanhf(GELU_K * (v + GELU_A * v * v * v)));
  }
}

/* The derivative recomputes tanh rather than keeping it from the forward:
 * measured, storing gelu'(x) in the forward made the forward as much
 * slower as it made this faster. */
VECTOR_CLONES
void chorus__gelu_bwd(float *restrict dx, const float *x, const float *dout, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i], u = GELU_K * (v + GELU_A * v * v * v), th = fast_tanhf(u);
    float du = GELU_K * (1.0f + 3.0f * GELU_A * v * v);
    float grad = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] = grad * dout[i];
  }
}

/* -------------------------------------------------- softmax cross-entropy */

VECTOR_CLONES
float chorus__xent_fwd(float *probs, float *losses, const float *logits, const int *targets, int N,
                       int V) {
  double total = 0;
  int counted = 0;
  for (int n = 0; n < N; n++) {
    const float *l = logits + (size_t)n * V;
    float *p = probs + (size_t)n * V, mx = row_max(l, V);
    memcpy(p, l, sizeof(float) * (size_t)V);
    float sum = row_exp_sum(p, mx, V), inv = 1.0f / sum;
    for (int v = 0; v < V; v++) p[v] *= inv;
    if (targets[n] < 0) {
      losses[n] = 0.0f;
      continue;
    }
    /* -log p[target] computed from the logits (no log of a rounded 0). */
    losses[n] = logf(sum) + mx - l[targets[n]];
    total += losses[n];
    counted++;
  }
  return counted ? (float)(total / counted) : 0.0f;
}

void chorus__xent_bwd(float *dlogits, const float *probs, const int *targets, float dloss, int N,
                      int V) {
  int counted = 0;
  for (int n = 0; n < N; n++) counted += targets[n] >= 0;
  float k = counted ? dloss / (float)counted : 0.0f;
  for (int n = 0; n < N; n++) {
    float *d = dlogits + (size_t)n * V;
    const float *p = probs + (size_t)n * V;
    if (targets[n] < 0) {
      memset(d, 0, sizeof(float) * (size_t)V);
      continue;
    }
    for (int v = 0; v < V; v++) d[v] = k * p[v];
    d[targets[n]] -= k;
  }
}
