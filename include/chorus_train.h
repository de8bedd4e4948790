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

/* Makes block layer an identity (skip != 0) or a normal block again, from
 * the next forward on: its parameters then get no gradient, and backward
 * announces them ready at once -- what DDP needs for unused parameters
 * (torch's find_unused_parameters).  Ranks may skip different blocks. */
CHORUS_API chorus_result_t chorus_gpt_skip_layer(chorus_gpt_t *m, int layer, int skip);

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

/* ------------------------------------------------------------ optimizers
 *
 * State lives in buffers of the parameters' layout.  Weight decay is
 * decoupled (AdamW) and applied to every parameter, as torch.optim.AdamW
 * does by default; SGD's is L2 added to the gradient, as torch.optim.SGD. */
typedef enum { CHORUS_OPTIM_ADAMW = 0, CHORUS_OPTIM_SGD = 1 } chorus_optim_kind_t;

typedef struct chorus_optim_config {
  chorus_optim_kind_t kind;
  float beta1, beta2, eps; /* AdamW */
  float momentum;          /* SGD */
  float weight_decay;
} chorus_optim_config_t;

#define CHORUS_OPTIM_ADAMW_DEFAULT {CHORUS_OPTIM_ADAMW, 0.9f, 0.95f, 1e-8f, 0.0f, 0.1f}

typedef struct chorus_optim chorus_optim_t;

CHORUS_API chorus_result_t chorus_optim_create(const chorus_optim_config_t *cfg, size_t n,
                                               chorus_optim_t **out);
CHORUS_API void chorus_optim_destroy(chorus_optim_t *o);
/* One update of params (n floats) from grads with learning rate lr. */
CHORUS_API void chorus_optim_step(chorus_optim_t *o, float *params, const float *grads, float lr);
/* The state (AdamW: step count, m, v; SGD: momentum) as one byte blob, for
 * checkpoints: size, and copy out / in. */
CHORUS_API size_t chorus_optim_state_size(const chorus_optim_t *o);
CHORUS_API void chorus_optim_state_save(const chorus_optim_t *o, void *dst);
CHORUS_API chorus_result_t chorus_optim_state_load(chorus_optim_t *o, const void *src, size_t len);

/* Euclidean norm of g (n floats), accumulated in double. */
CHORUS_API double chorus_grad_norm(const float *g, size_t n);
/* Scales g so that its norm (given) is at most max_norm (torch's
 * clip_grad_norm_ rule: factor max_norm / (norm + 1e-6), capped at 1). */
CHORUS_API void chorus_grad_clip(float *g, size_t n, double norm, double max_norm);

/* Learning rate at step (0-based): linear warm-up over warmup steps to
 * max_lr, then cosine decay to min_lr at total steps. */
CHORUS_API float chorus_lr_at(long step, long warmup, long total, float max_lr, float min_lr);

/* ------------------------------------------------------------- text data
 *
 * A byte-level corpus: every byte is a token (vocab 256).  The last
 * val_fraction of the file is the validation split.  Sample i of a split
 * is the window of seq + 1 bytes starting at i * seq: seq inputs and the
 * seq next bytes as targets. */
typedef struct chorus_text chorus_text_t;
enum { CHORUS_SPLIT_TRAIN = 0, CHORUS_SPLIT_VAL = 1 };

CHORUS_API chorus_result_t chorus_text_load(const char *path, double val_fraction,
                                            chorus_text_t **out);
CHORUS_API void chorus_text_free(chorus_text_t *t);
/* Number of samples of seq tokens in a split. */
CHORUS_API size_t chorus_text_samples(const chorus_text_t *t, int split, int seq);
/* Fills tokens and targets (B x seq) with samples idx[0..B). */
CHORUS_API void chorus_text_batch(const chorus_text_t *t, int split, int seq, const size_t *idx,
                                  int B, int *tokens, int *targets);

/* ------------------------------------------------------------------- DDP
 *
 * Data-parallel training over a communicator, like torch's
 * DistributedDataParallel: chorus_ddp_create broadcasts rank 0's parameters
 * (a collective: every rank calls it); gradients are grouped in buckets of
 * consecutive tensors in reverse layout order (the order backward produces
 * them), the first one small so communication starts early; when backward
 * has finished every tensor of a bucket, that bucket's all_reduce (AVG)
 * starts asynchronously and backward goes on.  chorus_ddp_wait waits for
 * the ones still running (and starts any not started) before the optimizer
 * step.  Every bucket is one contiguous range of the gradient buffer. */
typedef struct chorus_ddp chorus_ddp_t;

typedef enum {
  CHORUS_DDP_HOOK_NONE = 0, /* all_reduce float32 */
  CHORUS_DDP_HOOK_BF16 = 1, /* compress to bfloat16, all_reduce, decompress */
  CHORUS_DDP_HOOK_FP16 = 2, /* the same with float16 */
} chorus_ddp_hook_t;

typedef struct chorus_ddp_config {
  double bucket_mb;       /* bucket cap in MiB (default 25, as PyTorch) */
  double first_bucket_mb; /* the first bucket's cap (default 1) */
  int overlap;            /* 1: reduce during backward; 0: all after it */
  chorus_ddp_hook_t hook;
} chorus_ddp_config_t;

#define CHORUS_DDP_CONFIG_DEFAULT {25.0, 1.0, 1, CHORUS_DDP_HOOK_NONE}

typedef struct chorus_ddp_stats {
  int buckets;
  double comm_s;    /* all_reduce time of the last step, summed over buckets */
  double exposed_s; /* time chorus_ddp_wait blocked in the last step */
} chorus_ddp_stats_t;

CHORUS_API chorus_result_t chorus_ddp_create(chorus_comm_t comm, chorus_gpt_t *model,
                                             const chorus_ddp_config_t *cfg, chorus_ddp_t **out);
CHORUS_API void chorus_ddp_destroy(chorus_ddp_t *d);
/* Pass these to chorus_gpt_backward(model, scale, chorus_ddp_ready, d). */
CHORUS_API void chorus_ddp_ready(void *d, int tensor);
/* Starts what was not started, waits for every bucket of this step. */
CHORUS_API chorus_result_t chorus_ddp_wait(chorus_ddp_t *d);
/* 0: the next backward passes communicate nothing (no_sync gradient
 * accumulation); 1 (default): they do. */
CHORUS_API void chorus_ddp_set_sync(chorus_ddp_t *d, int sync);
CHORUS_API void chorus_ddp_get_stats(const chorus_ddp_t *d, chorus_ddp_stats_t *s);
/* Buffers: state a model keeps besides its parameters and does not train
 * with gradients (running statistics, masks, counters).  Register them on
 * every rank, in the same order and with the same sizes; then
 * chorus_ddp_broadcast_buffers (a collective) copies rank 0's values to
 * every rank in one broadcast.  Calling it before each forward gives
 * PyTorch's broadcast_buffers=True (PyTorch skips it on the forward after a
 * no_sync one).  The GPT of this library has no buffers. */
CHORUS_API chorus_result_t chorus_ddp_add_buffer(chorus_ddp_t *d, void *data, size_t count,
                                                 chorus_dtype_t dtype);
CHORUS_API chorus_result_t chorus_ddp_broadcast_buffers(chorus_ddp_t *d);
/* Bucket i's all_reduce of the last step: when it ran (CLOCK_MONOTONIC ns,
 * 0 when it did not) and its bytes; i < stats.buckets. */
CHORUS_API void chorus_ddp_bucket_times(const chorus_ddp_t *d, int i, int64_t *start_ns,
                                        int64_t *end_ns, size_t *bytes);

/* ---------------------------------------------------------------- sampler
 *
 * torch.utils.data.DistributedSampler, index for index: each epoch a
 * permutation of the n samples from a generator seeded with seed + epoch
 * (the same MT19937 stream and shuffle as torch.randperm on the CPU, so the
 * lists equal PyTorch's), padded by repeating its head to a multiple of the
 * world size (or cut, with drop_last), and rank r takes positions r, r +
 * world, ...  The position inside the epoch can be saved and restored. */
typedef struct chorus_sampler chorus_sampler_t;

CHORUS_API chorus_result_t chorus_sampler_create(size_t n, int world, int rank, int shuffle,
                                                 uint64_t seed, int drop_last,
                                                 chorus_sampler_t **out);
CHORUS_API void chorus_sampler_destroy(chorus_sampler_t *s);
/* Starts epoch e (its order; position 0). */
CHORUS_API void chorus_sampler_set_epoch(chorus_sampler_t *s, long epoch);
CHORUS_API long chorus_sampler_epoch(const chorus_sampler_t *s);
/* Samples per rank per epoch (torch's num_samples) and this rank's list. */
CHORUS_API size_t chorus_sampler_len(const chorus_sampler_t *s);
CHORUS_API const size_t *chorus_sampler_indices(const chorus_sampler_t *s);
/* Next index of this rank; at the end of an epoch starts the next one. */
CHORUS_API size_t chorus_sampler_next(chorus_sampler_t *s);
CHORUS_API size_t chorus_sampler_pos(const chorus_sampler_t *s);
CHORUS_API void chorus_sampler_set_pos(chorus_sampler_t *s, size_t pos);
/* The sampler of another world (elastic training: the survivors of a failed
 * rank, or new ranks): the same as creating it with world and rank, keeping
 * the epoch and how far the whole old world got into it -- the new position
 * is pos * old world / world, rounded down.  Torch's elastic examples do the
 * same with a new DistributedSampler and the saved global position. */
CHORUS_API chorus_result_t chorus_sampler_reshard(chorus_sampler_t *s, int world, int rank);

/* ----------------------------------------------------------- checkpoints
 *
 * One file per checkpoint, dir/ckpt-<step, 9 digits>.bin: a header (magic,
 * version, model shape, sizes), the parameters, the optimizer state, the
 * caller's extra bytes (step, sampler position...) and a checksum of all of
 * it.  Written atomically: a temporary file, fsync, rename, fsync of the
 * directory; then all but the newest keep checkpoints are removed.  Loading
 * takes the newest file that is complete and whose shape matches, so a
 * crash while writing leaves the previous checkpoint usable.  The content
 * does not depend on the number of ranks. */
CHORUS_API chorus_result_t chorus_ckpt_save(const char *dir, long step, chorus_gpt_t *m,
                                            const chorus_optim_t *o, const void *extra,
                                            size_t extra_len, int keep);
/* *step = -1 and CHORUS_OK when dir has no usable checkpoint.  extra gets
 * up to extra_cap bytes; *extra_len the stored length. */
CHORUS_API chorus_result_t chorus_ckpt_load(const char *dir, long *step, chorus_gpt_t *m,
                                            chorus_optim_t *o, void *extra, size_t extra_cap,
                                            size_t *extra_len);

/* The reason of the last failure of a chorus_gpt_* / chorus_ckpt_* call on
 * this thread. */
CHORUS_API const char *chorus_train_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
