/*
 * layers.c - forward and backward of the transformer's layers (layers.h).
 * The linear layers' products go through CBLAS; attention has its own
 * causal kernels; the rest are loops the compiler vectorises.  What a
 * backward adds into and what it overwrites: layers.h.
 */
#include "train/layers.h"

#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The loops written to vectorise (GELU, softmax, layernorm, the attention
 * kernels) are compiled twice: for x86-64-v3 (AVX2 + FMA + F16C...) and the
 * baseline, picked at load time by the CPU (GCC function multiversioning),
 * never -march=native.  One clone string per target: "avx2,fma" would be
 * two clones, AVX2 without FMA and FMA without AVX2, and the loader picks
 * the first. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* exp(x) for float, branch-free so loops over it vectorise: x = n ln2 + r
 * with |r| <= ln2 / 2 (n rounded to nearest), a degree-7 polynomial for
 * exp(r) (Cephes' expf coefficients), and 2^n built in the exponent bits.  Relative error about
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

/* Vectors of 8 floats (GCC/Clang vector extension; the baseline clone gets
 * pairs of SSE registers).  No function takes or returns one by value: the
 * baseline and AVX clones would pass them differently. */
typedef float v8 __attribute__((vector_size(32)));
#define SPLAT8(x) ((v8){(x), (x), (x), (x), (x), (x), (x), (x)})

static inline void load8(v8 *v, const float *p) { memcpy(v, p, sizeof *v); }

/* The 8 lanes added in a fixed order. */
static inline float lanes_sum(const v8 *acc) {
  float t[8], s = 0;
  memcpy(t, acc, sizeof t);
  for (int j = 0; j < 8; j++) s += t[j];
  return s;
}

/* Reductions over a row keep 8 partial results (one vector) combined in a
 * fixed order at the end, then the tail: the same sums in the same order
 * on every rank, and vector code without -ffast-math. */
static inline float row_sum(const float *x, int n) {
  v8 acc = SPLAT8(0.0f), v;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    load8(&v, x + i);
    acc += v;
  }
  float s = lanes_sum(&acc);
  for (; i < n; i++) s += x[i];
  return s;
}

typedef int i8 __attribute__((vector_size(32)));

static inline float row_max(const float *x, int n) {
  v8 acc = SPLAT8(x[0]), v;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    load8(&v, x + i);
    const i8 gt = v > acc; /* lanes where v wins: all ones */
    acc = (v8)(((i8)v & gt) | ((i8)acc & ~gt));
  }
  float t[8], m;
  memcpy(t, &acc, sizeof t);
  m = t[0];
  for (int j = 1; j < 8; j++) m = t[j] > m ? t[j] : m;
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* sum((x - c)^2) */
static inline float row_sqdev(const float *x, float c, int n) {
  const v8 cv = SPLAT8(c);
  v8 acc = SPLAT8(0.0f), v;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    load8(&v, x + i);
    v -= cv;
    acc += v * v;
  }
  float s = lanes_sum(&acc);
  for (; i < n; i++) s += (x[i] - c) * (x[i] - c);
  return s;
}

/* y[i] = exp(x[i] - c) for i < n (y may be x); returns their sum. */
static inline float row_exp_sum(float *y, const float *x, float c, int n) {
  for (int i = 0; i < n; i++) y[i] = fast_expf(x[i] - c);
  return row_sum(y, n);
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
    const v8 mv = SPLAT8(m), sv = SPLAT8(s);
    v8 ga = SPLAT8(0.0f), gxa = SPLAT8(0.0f), xv, dv, wv;
    int i = 0;
    for (; i + 8 <= C; i += 8) {
      load8(&xv, xi + i);
      load8(&dv, d + i);
      load8(&wv, w + i);
      const v8 xhat = (xv - mv) * sv, g = dv * wv;
      ga += g;
      gxa += g * xhat;
    }
    float gsum = lanes_sum(&ga), gxsum = lanes_sum(&gxa);
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
  float inv = 1.0f / row_exp_sum(row, row, row_max(row, k), k);
  for (int u = 0; u < k; u++) row[u] *= inv;
  for (int u = k; u < n; u++) row[u] = 0.0f;
}

/* dS = P (dP - sum(P dP)) over the first k entries of a row, 0 after. */
VECTOR_CLONES
static void softmax_row_bwd(float *d, const float *p, int k, int n) {
  v8 acc = SPLAT8(0.0f), pv, dv;
  int u = 0;
  for (; u + 8 <= k; u += 8) {
    load8(&pv, p + u);
    load8(&dv, d + u);
    acc += pv * dv;
  }
  float dot = lanes_sum(&acc);
  for (; u < k; u++) dot += p[u] * d[u];
  for (u = 0; u < k; u++) d[u] = p[u] * (d[u] - dot);
  for (u = k; u < n; u++) d[u] = 0.0f;
}

/* The attention products are small (T x T x hs per head: 128 x 128 x 32 by
 * default) and causal, which a general sgemm serves badly: thousands of
 * calls per step, each packing its operands, and the upper triangle either
 * computed and thrown away or cut into ever smaller calls (the BLAS
 * version ran at 30-50 GFLOP/s, the linear layers' products at ~90).  So
 * they are three register-blocked kernels of their own, each computing
 * KR rows x KW columns of its output in KR x KW accumulators (6 x 16
 * floats: twelve AVX2 registers, which keep both FMA units busy through the
 * 4-cycle latency; with 4 rows the backward ran 15 % slower) and skipping
 * the masked part by blocks:
 *
 *   causal_abt  out[t][u] = alpha sum_d A[t][d] Bt[d][u]   u below t's block end
 *   causal_pb   out[t][:] = alpha sum_u P[t][u] B[u][:]     u below t's block end
 *   causal_atb  out[u][:] = alpha sum_t A[t][u] B[t][:]     t from u's block start
 *
 * P and A are zero above the diagonal (the softmax and its backward write
 * those zeros up to the end of each row's block), so the few products
 * past the diagonal inside a block add nothing.  Operands read as vectors
 * (Bt, B) have their rows padded to a multiple of KW with zeros: pack_rows
 * and pack_cols make those copies, or pass rows through when hs is already
 * a multiple of KW.  Rows past T in a block repeat the last row and are
 * not stored. */
#define KR 6
#define KW 16

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

/* A KR x KW block of accumulators, 2 vectors (v8, above) per row, not a
 * float array: GCC keeps an acc[KR][KW] array on the stack and pays a load
 * and a store per multiply-add. */
typedef struct {
  v8 c[KR][2];
} block_t;

static inline void block_fma(block_t *k, const float x[KR], const float *b) {
  v8 b0, b1;
  load8(&b0, b);
  load8(&b1, b + 8);
  for (int r = 0; r < KR; r++) {
    k->c[r][0] += x[r] * b0;
    k->c[r][1] += x[r] * b1;
  }
}

static inline void block_store(const block_t *k, float *out, int ldo, int rows, int w,
                               float alpha) {
  for (int r = 0; r < rows; r++) {
    v8 lo = alpha * k->c[r][0], hi = alpha * k->c[r][1];
    float *o = out + (size_t)r * ldo;
    if (w == KW) {
      memcpy(o, &lo, sizeof lo);
      memcpy(o + 8, &hi, sizeof hi);
    } else {
      float tmp[KW];
      memcpy(tmp, &lo, sizeof lo);
      memcpy(tmp + 8, &hi, sizeof hi);
      for (int j = 0; j < w; j++) o[j] = tmp[j];
    }
  }
}

VECTOR_CLONES
static void causal_abt(float *restrict out, int ldo, const float *A, int lda,
                       const float *restrict Bt, int ldb, int T, int K, float alpha) {
  for (int t0 = 0; t0 < T; t0 += KR) {
    const int rows = imin(KR, T - t0), ucount = t0 + rows;
    const float *a[KR];
    for (int r = 0; r < KR; r++) a[r] = A + (size_t)(t0 + imin(r, rows - 1)) * lda;
    for (int u0 = 0; u0 < ucount; u0 += KW) {
      block_t k = {0};
      for (int d = 0; d < K; d++) {
        float x[KR];
        for (int r = 0; r < KR; r++) x[r] = a[r][d];
        block_fma(&k, x, Bt + (size_t)d * ldb + u0);
      }
      /* A whole strip is stored when the rows have room for it: what lands
       * past the block's diagonal is overwritten by the softmax (forward)
       * or never read (backward, see chorus__attention_bwd). */
      block_store(&k, out + (size_t)t0 * ldo + u0, ldo, rows,
                  u0 + KW <= T ? KW : imin(KW, ucount - u0), alpha);
    }
  }
}

VECTOR_CLONES
static void causal_pb(float *restrict out, int ldo, const float *P, int ldp,
                      const float *restrict B, int ldb, int T, int K, float alpha) {
  for (int t0 = 0; t0 < T; t0 += KR) {
    const int rows = imin(KR, T - t0), ucount = t0 + rows;
    const float *p[KR];
    for (int r = 0; r < KR; r++) p[r] = P + (size_t)(t0 + imin(r, rows - 1)) * ldp;
    for (int d0 = 0; d0 < K; d0 += KW) {
      block_t k = {0};
      for (int u = 0; u < ucount; u++) {
        float x[KR];
        for (int r = 0; r < KR; r++) x[r] = p[r][u];
        block_fma(&k, x, B + (size_t)u * ldb + d0);
      }
      block_store(&k, out + (size_t)t0 * ldo + d0, ldo, rows, imin(KW, K - d0), alpha);
    }
  }
}

VECTOR_CLONES
static void causal_atb(float *restrict out, int ldo, const float *A, int lda,
                       const float *restrict B, int ldb, int T, int K, float alpha) {
  for (int u0 = 0; u0 < T; u0 += KR) {
    const int rows = imin(KR, T - u0);
    int col[KR];
    for (int r = 0; r < KR; r++) col[r] = u0 + imin(r, rows - 1);
    for (int d0 = 0; d0 < K; d0 += KW) {
      block_t k = {0};
      for (int t = u0; t < T; t++) {
        const float *arow = A + (size_t)t * lda;
        float x[KR];
        for (int r = 0; r < KR; r++) x[r] = arow[col[r]];
        block_fma(&k, x, B + (size_t)t * ldb + d0);
      }
      block_store(&k, out + (size_t)u0 * ldo + d0, ldo, rows, imin(KW, K - d0), alpha);
    }
  }
}

/* T rows of hs floats (row stride ld) as rows of hsp = hs rounded up to KW
 * (zero-padded) in dst; the rows themselves when hs already is. */
static const float *pack_rows(float *dst, const float *src, int ld, int T, int hs, int *ldout) {
  const int hsp = round_up(hs, KW);
  if (hsp == hs) {
    *ldout = ld;
    return src;
  }
  for (int t = 0; t < T; t++) {
    memcpy(dst + (size_t)t * hsp, src + (size_t)t * ld, sizeof(float) * (size_t)hs);
    memset(dst + (size_t)t * hsp + hs, 0, sizeof(float) * (size_t)(hsp - hs));
  }
  *ldout = hsp;
  return dst;
}

/* The transpose: dst[d][t] = src[t][d], rows of T rounded up to KW. */
static void pack_cols(float *dst, const float *src, int ld, int T, int hs) {
  const int tp = round_up(T, KW);
  for (int d = 0; d < hs; d++) {
    float *row = dst + (size_t)d * tp;
    for (int t = 0; t < T; t++) row[t] = src[(size_t)t * ld + d];
    for (int t = T; t < tp; t++) row[t] = 0.0f;
  }
}

/* The backward's layout, which covers the forward's (Kt, then V padded). */
size_t chorus__attention_scratch(int T, int C, int NH) {
  const int hs = C / NH;
  const size_t tp = (size_t)round_up(T, KW), hsp = (size_t)round_up(hs, KW);
  return (size_t)T * T + (size_t)hs * tp + 3 * (size_t)T * hsp; /* dP, Vt, Q, K, dY */
}

/* For one (b, h): Q, K, V are T x hs with row stride 3C inside qkv; the
 * output rows have stride C. */
void chorus__attention_fwd(float *out, float *att, const float *qkv, float *scratch, int B, int T,
                           int C, int NH) {
  const int hs = C / NH, ld = 3 * C;
  const float scale = 1.0f / sqrtf((float)hs);
  float *Kt = scratch, *Vbuf = Kt + (size_t)hs * round_up(T, KW);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *Q = qkv + (size_t)b * T * ld + (size_t)h * hs;
      const float *K = Q + C, *V = Q + 2 * C;
      float *P = att + ((size_t)b * NH + h) * T * T;
      int ldv;
      pack_cols(Kt, K, ld, T, hs);
      const float *Vp = pack_rows(Vbuf, V, ld, T, hs, &ldv);
      /* S = scale Q K^T, then a causal softmax row by row (zeros past the
       * diagonal to the end of the row). */
      causal_abt(P, T, Q, ld, Kt, round_up(T, KW), T, hs, scale);
      for (int t = 0; t < T; t++) softmax_row(P + (size_t)t * T, t + 1, T);
      /* Y = P V */
      causal_pb(out + (size_t)b * T * C + (size_t)h * hs, C, P, T, Vp, ldv, T, hs, 1.0f);
    }
}

void chorus__attention_bwd(float *dqkv, const float *dout, const float *qkv, const float *att,
                           float *scratch, int B, int T, int C, int NH) {
  const int hs = C / NH, ld = 3 * C, tp = round_up(T, KW), hsp = round_up(hs, KW);
  const float scale = 1.0f / sqrtf((float)hs);
  float *dP = scratch, *Vt = dP + (size_t)T * T, *buf = Vt + (size_t)hs * tp;
  float *Qbuf = buf, *Kbuf = buf + (size_t)T * hsp, *dYbuf = Kbuf + (size_t)T * hsp;
  for (int b = 0; b < B; b++)
    for (int h = 0; h < NH; h++) {
      const float *Q = qkv + (size_t)b * T * ld + (size_t)h * hs;
      const float *K = Q + C, *V = Q + 2 * C;
      float *dQ = dqkv + (size_t)b * T * ld + (size_t)h * hs;
      float *dK = dQ + C, *dV = dQ + 2 * C;
      const float *P = att + ((size_t)b * NH + h) * T * T;
      const float *dY = dout + (size_t)b * T * C + (size_t)h * hs;
      int ldq, ldk, ldy;
      pack_cols(Vt, V, ld, T, hs);
      const float *Qp = pack_rows(Qbuf, Q, ld, T, hs, &ldq);
      const float *Kp = pack_rows(Kbuf, K, ld, T, hs, &ldk);
      const float *dYp = pack_rows(dYbuf, dY, C, T, hs, &ldy);
      /* dP = dY V^T;  dV = P^T dY */
      causal_abt(dP, T, dY, C, Vt, tp, T, hs, 1.0f);
      causal_atb(dV, ld, P, T, dYp, ldy, T, hs, 1.0f);
      /* Softmax backward; zeros past the diagonal to the end of the row's
       * block of KR rows (what the kernels below read). */
      for (int t = 0; t < T; t++) {
        const int block_end = imin(T, (t / KR + 1) * KR);
        softmax_row_bwd(dP + (size_t)t * T, P + (size_t)t * T, t + 1, block_end);
      }
      /* S = scale Q K^T:  dQ = scale dS K;  dK = scale dS^T Q */
      causal_pb(dQ, ld, dP, T, Kp, ldk, T, hs, scale);
      causal_atb(dK, ld, dP, T, Qp, ldq, T, hs, scale);
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
    float sum = row_exp_sum(p, l, mx, V), inv = 1.0f / sum;
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
