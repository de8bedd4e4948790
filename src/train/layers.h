/*
 * layers.h - the transformer's layers, forward and backward, on plain float
 * arrays (row-major).  Shapes: B batch, T positions, C channels, NH heads,
 * V vocabulary, OC/IC output/input channels of a linear layer.
 *
 * Conventions: a forward writes its output (and whatever its backward needs,
 * passed in explicitly).  A backward ADDS into the parameter gradients (so
 * micro-steps and the tied embedding accumulate) and into the d-input of
 * layernorm and the encoder (the residual stream's gradient, which several
 * branches feed); the d-inputs of linear, attention and GELU, which have a
 * single consumer, are OVERWRITTEN, so the model needs no memset before
 * them.
 */
#ifndef CHORUS_TRAIN_LAYERS_H
#define CHORUS_TRAIN_LAYERS_H

#include <stddef.h>

/* x[b,t,:] = wte[tok[b,t],:] + wpe[t,:]                     x: (B,T,C) */
void chorus__encoder_fwd(float *x, const int *tok, const float *wte, const float *wpe, int B,
                         int T, int C);
void chorus__encoder_bwd(float *dwte, float *dwpe, const float *dx, const int *tok, int B, int T,
                         int C);

/* out = (x - mean) / sqrt(var + 1e-5) * w + b over the last axis of N rows
 * of C; saves mean and rstd (N each). */
void chorus__layernorm_fwd(float *out, float *mean, float *rstd, const float *x, const float *w,
                           const float *b, int N, int C);
void chorus__layernorm_bwd(float *dx, float *dw, float *db, const float *dout, const float *x,
                           const float *w, const float *mean, const float *rstd, int N, int C);

/* out (N,OC) = x (N,IC) · W^T (W: OC,IC) + bias (OC) + res (N,OC): bias
 * and the residual res may be NULL; res may be out itself. */
void chorus__linear_fwd(float *out, const float *x, const float *W, const float *bias,
                        const float *res, int N, int IC, int OC);
/* dx = dout · W; dW += dout^T · x; dbias += column sums of dout (dx, dbias
 * may be NULL when not wanted). */
void chorus__linear_bwd(float *dx, float *dW, float *dbias, const float *dout, const float *x,
                        const float *W, int N, int IC, int OC);

/* Causal multi-head self-attention.  qkv (B,T,3C): per position the C
 * query, C key and C value channels, head h using channels [h*hs, (h+1)*hs)
 * of each (hs = C/NH).  out (B,T,C); att (B,NH,T,T) saves the softmax
 * probabilities (zero above the diagonal). */
void chorus__attention_fwd(float *out, float *att, const float *qkv, float *scratch, int B, int T,
                           int C, int NH);
/* dqkv = ... (overwritten).  Both directions need
 * chorus__attention_scratch(T, C, NH) floats of scratch. */
size_t chorus__attention_scratch(int T, int C, int NH);
void chorus__attention_bwd(float *dqkv, const float *dout, const float *qkv, const float *att,
                           float *scratch, int B, int T, int C, int NH);

/* GELU, tanh approximation, elementwise over n. */
void chorus__gelu_fwd(float *out, const float *x, size_t n);
/* dx = gelu'(x) dout (overwritten). */
void chorus__gelu_bwd(float *dx, const float *x, const float *dout, size_t n);

/* Softmax over V of logits (N rows), cross-entropy against targets:
 * probs (N,V), losses (N); returns the mean loss.  Targets < 0 are
 * ignored (no loss, no gradient) and not counted in the mean. */
float chorus__xent_fwd(float *probs, float *losses, const float *logits, const int *targets, int N,
                       int V);
/* dlogits = dloss * (probs - onehot) / counted rows (overwrites). */
void chorus__xent_bwd(float *dlogits, const float *probs, const int *targets, float dloss, int N,
                      int V);

#endif
