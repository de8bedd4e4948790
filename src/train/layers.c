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

/* tanh(u) = 1 - 2 / (exp(2u) + 1): absolute error about 1e-7. */
static inline float fast_tanhf(float u) { return 1.0f - 2.0f / (fast_expf(2.0f * u) + 1.0f); }

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

void chorus__layernorm_fwd(float *out, float *mean, float *rstd, const float *x, const float *w,
                           const float *b, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *xi = x + (size_t)n * C;
    float *o = out + (size_t)n * C;
    double m = 0, v = 0;
    for (int i = 0; i < C; i++) m += xi[i];
    m /= C;
    for (int i = 0; i < C; i++) v += (xi[i] - m) * (xi[i] - m);
    v /= C;
    float s = (float)(1.0 / sqrt(v + 1e-5));
    for (int i = 0; i < C; i++) o[i] = ((xi[i] - (float)m) * s) * w[i] + b[i];
    mean[n] = (float)m;
    rstd[n] = s;
  }
}

void chorus__layernorm_bwd(float *dx, float *dw, float *db, const float *dout, const float *x,
                           const float *w, const float *mean, const float *rstd, int N, int C) {
  for (int n = 0; n < N; n++) {
    const float *xi = x + (size_t)n * C, *d = dout + (size_t)n * C;
    float *dxi = dx + (size_t)n * C;
    float m = mean[n], s = rstd[n];
    /* With xhat = (x - m) s and g = dout * w:
     * dx = s (g - mean(g) - xhat mean(g xhat)). */
    double gmean = 0, gxmean = 0;
    for (int i = 0; i < C; i++) {
      float xhat = (xi[i] - m) * s, g = d[i] * w[i];
      gmean += g;
      gxmean += g * xhat;
    }
    gmean /= C;
    gxmean /= C;
    for (int i = 0; i < C; i++) {
      float xhat = (xi[i] - m) * s, g = d[i] * w[i];
      dw[i] += d[i] * xhat;
      db[i] += d[i];
      dxi[i] += s * (g - (float)gmean - xhat * (float)gxmean);
    }
  }
}

/* ---------------------------------------------------------------- linear */

void chorus__linear_fwd(float *out, const float *x, const float *W, const float *bias, int N,
                        int IC, int OC) {
  if (bias)
    for (int n = 0; n < N; n++) memcpy(out + (size_t)n * OC, bias, sizeof(float) * (size_t)OC);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, x, IC, W, IC,
              bias ? 1.0f : 0.0f, out, OC);
}

void chorus__linear_bwd(float *dx, float *dW, float *dbias, const float *dout, const float *x,
                        const float *W, int N, int IC, int OC) {
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IC, OC, 1.0f, dout, OC, W, IC, 1.0f,
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
  float mx = row[0], sum = 0;
  for (int u = 1; u < k; u++) mx = row[u] > mx ? row[u] : mx;
  for (int u = 0; u < k; u++) {
    row[u] = fast_expf(row[u] - mx);
    sum += row[u];
  }
  float inv = 1.0f / sum;
  for (int u = 0; u < k; u++) row[u] *= inv;
  for (int u = k; u < n; u++) row[u] = 0.0f;
}

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
      /* S = scale Q K^T, then a causal softmax row by row. */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, Q, ld, K, ld, 0.0f, P,
                  T);
      for (int t = 0; t < T; t++) softmax_row(P + (size_t)t * T, t + 1, T);
      /* Y = P V */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, V, ld, 0.0f,
                  out + (size_t)b * T * C + (size_t)h * hs, C);
    }
}

void chorus__attention_bwd(float *dqkv, const float *dout, const float *qkv, const float *att,
                           float *scratch, int B, int T, int C, int NH) {
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  float *dP = scratch;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *Q = qkv + (size_t)b * T * ld + (size_t)h * hs;
      const float *K = Q + C, *V = Q + 2 * C;
      float *dQ = dqkv + (size_t)b * T * ld + (size_t)h * hs;
      float *dK = dQ + C, *dV = dQ + 2 * C;
      const float *P = att + ((size_t)b * NH + h) * T * T;
      const float *dY = dout + (size_t)b * T * C + (size_t)h * hs;
      /* dP = dY V^T;  dV += P^T dY */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dY, C, V, ld, 0.0f, dP,
                  T);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, P, T, dY, C, 1.0f, dV,
                  ld);
      /* Softmax backward, row by row: dS = P (dP - sum(P dP)); masked
       * entries have P = 0 and get 0. */
      for (int t = 0; t < T; t++) {
        const float *p = P + (size_t)t * T;
        float *d = dP + (size_t)t * T, dot = 0;
        for (int u = 0; u <= t; u++) dot += p[u] * d[u];
        for (int u = 0; u <= t; u++) d[u] = p[u] * (d[u] - dot);
        for (int u = t + 1; u < T; u++) d[u] = 0.0f;
      }
      /* S = scale Q K^T:  dQ += scale dS K;  dK += scale dS^T Q */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, dP, T, K, ld, 1.0f,
                  dQ, ld);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, dP, T, Q, ld, 1.0f, dK,
                  ld);
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

VECTOR_CLONES
void chorus__gelu_bwd(float *dx, const float *x, const float *dout, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = x[i], u = GELU_K * (v + GELU_A * v * v * v), th = fast_tanhf(u);
    float du = GELU_K * (1.0f + 3.0f * GELU_A * v * v);
    float grad = 0.5f * (1.0f + th) + 0.5f * v * (1.0f - th * th) * du;
    dx[i] += grad * dout[i];
  }
}

/* -------------------------------------------------- softmax cross-entropy */

float chorus__xent_fwd(float *probs, float *losses, const float *logits, const int *targets, int N,
                       int V) {
  double total = 0;
  int counted = 0;
  for (int n = 0; n < N; n++) {
    const float *l = logits + (size_t)n * V;
    float *p = probs + (size_t)n * V, mx = l[0];
    for (int v = 1; v < V; v++) mx = l[v] > mx ? l[v] : mx;
    double sum = 0;
    for (int v = 0; v < V; v++) {
      p[v] = fast_expf(l[v] - mx);
      sum += p[v];
    }
    float inv = (float)(1.0 / sum);
    for (int v = 0; v < V; v++) p[v] *= inv;
    if (targets[n] < 0) {
      losses[n] = 0.0f;
      continue;
    }
    /* -log p[target] computed from the logits (no log of a rounded 0). */
    losses[n] = (float)(log(sum) + mx - l[targets[n]]);
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
