/*
 * chorus_train.h - the training runtime: a small GPT in plain C (forward and
 * backward written by hand, matrix products through CBLAS), its optimizers,
 * and a byte-level text loader.  Data-parallel training (DDP) on top of
 * chorus.h comes with it; this header uses nothing of chorus's internals.
 *
 * Memory layout (as llm.c does it): every parameter of the model lives in
 * one contiguous float buffer, in the order the forward pass uses them --
 * embeddings, then layer 0, 1, ..., then the final layernorm -- and the
 * gradients (and an optimizer's state) use the same layout, so a
 * communication library can reduce any byte range of it.  Named views
 * (chorus_gpt_tensor) describe each piece.
 *
 * Not thread-safe: one model per thread.  Every function that can fail
 * returns a chorus_result_t; chorus_train_last_error() says why.
 */
#ifndef CHORUS_TRAIN_H
#define CHORUS_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Model shape.  vocab 256 is byte-level text. */
typedef struct chorus_gpt_config {
  int vocab;    /* V */
  int ctx;      /* maximum sequence length (positions) */
  int layers;   /* L */
  int heads;    /* NH; channels must be a multiple */
  int channels; /* C */
} chorus_gpt_config_t;

#define CHORUS_GPT_CONFIG_DEFAULT {256, 128, 4, 4, 128}

typedef struct chorus_gpt chorus_gpt_t;

/* One named parameter tensor: a view into the parameter buffer (and, at the
 * same offset, into the gradient buffer). */
typedef struct chorus_gpt_tensor {
  const char *name; /* "wte", "wpe", "h.3.attn.qkv.w", ..., "lnf.b" */
  size_t offset;    /* in floats from the start of the buffer */
  size_t size;      /* floats */
  int layer;        /* transformer block, or -1 */
} chorus_gpt_tensor_t;

/* Builds a model with room for batches of up to max_batch sequences of cfg
 * ctx tokens, initialised from seed: weights N(0, 0.02), the two residual
 * projections of each block N(0, 0.02 / sqrt(2 L)), biases 0, layernorm
 * gains 1.  The same seed gives the same bits on every machine. */
CHORUS_API chorus_result_t chorus_gpt_create(const chorus_gpt_config_t *cfg, int max_batch,
                                             uint64_t seed, chorus_gpt_t **out);
CHORUS_API void chorus_gpt_destroy(chorus_gpt_t *m);

CHORUS_API const chorus_gpt_config_t *chorus_gpt_config(const chorus_gpt_t *m);
CHORUS_API size_t chorus_gpt_num_params(const chorus_gpt_t *m);
CHORUS_API float *chorus_gpt_params(chorus_gpt_t *m);
CHORUS_API float *chorus_gpt_grads(chorus_gpt_t *m);
CHORUS_API int chorus_gpt_num_tensors(const chorus_gpt_t *m);
CHORUS_API const chorus_gpt_tensor_t *chorus_gpt_tensor(const chorus_gpt_t *m, int i);

/* Forward pass over tokens (B x T, values < vocab, T <= ctx, B <=
 * max_batch).  With targets (same shape; a negative target is ignored) the
 * mean cross-entropy goes to *loss (may be NULL); without, only the next-
 * token probabilities are computed (chorus_gpt_probs). */
CHORUS_API chorus_result_t chorus_gpt_forward(chorus_gpt_t *m, const int *tokens,
                                              const int *targets, int B, int T, float *loss);

/* Probabilities of the last forward: (B, T, vocab). */
CHORUS_API const float *chorus_gpt_probs(const chorus_gpt_t *m);

/* Called during backward as soon as tensor i's gradient is complete (in
 * reverse order of the forward, the embeddings last) -- where DDP starts
 * reducing a bucket while the backward pass goes on. */
typedef void (*chorus_gpt_grad_ready_fn)(void *arg, int tensor);

/* Backward pass of the last forward (which needs targets), scaled by
 * loss_scale (1 for plain training, 1/k for k accumulated micro-steps);
 * ADDS into the gradients.  ready may be NULL. */
CHORUS_API chorus_result_t chorus_gpt_backward(chorus_gpt_t *m, float loss_scale,
                                               chorus_gpt_grad_ready_fn ready, void *arg);
CHORUS_API void chorus_gpt_zero_grad(chorus_gpt_t *m);

/* The reason of the last failure of a chorus_gpt_* call on this thread. */
CHORUS_API const char *chorus_train_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
