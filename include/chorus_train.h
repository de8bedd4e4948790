/*
 * chorus_train.h - the training runtime: a small GPT in plain C (forward and
 * backward written by hand, matrix products through CBLAS), its optimizers,
 * token datasets on disk (llm.c's shards) with a prefetching loader, and
 * GPT-2's tokenizer.  Data-parallel training (DDP) on top of
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

/* Generates n tokens after prompt (len >= 1 tokens) into out, each drawn
 * from the model's distribution by a generator seeded with seed
 * (splitmix64): the same weights, prompt and seed give the same tokens.
 * The context is the last ctx tokens (a window that slides). */
CHORUS_API chorus_result_t chorus_gpt_sample(chorus_gpt_t *m, const int *prompt, int len, int n,
                                             uint64_t seed, int *out);

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

/* ----------------------------------------------------------------- units
 *
 * For sharded training (below) the model is cut into units, each a run of
 * consecutive tensors and so one float range of the layout: unit 0 the
 * embeddings (wte, wpe), unit 1 + l block l, the last unit (layers + 1) the
 * final layernorm.  The head, logits = lnf(x) wte^T, runs in the last unit
 * and reads wte, whose gradient its backward adds to: the last unit's
 * compute needs unit 0's parameters (and gradients) as well as its own.
 *
 * A unit's parameters and gradients can live anywhere (bind_unit): a
 * sharded runtime gathers a unit's parameters just before it runs and
 * lets them go after.  A unit hook hears when each unit is about to run
 * and when it is done, forward and backward, in compute order: forward 0,
 * 1, ..., L + 1; backward L + 1, L, ..., 0 -- skipped blocks included, so
 * every rank sees the same sequence. */
typedef struct chorus_gpt_unit {
  size_t offset, size; /* float range of the layout */
  int first_tensor, ntensors;
} chorus_gpt_unit_t;

CHORUS_API int chorus_gpt_num_units(const chorus_gpt_t *m);
/* Bytes of the activations and backward scratch (for max_batch). */
CHORUS_API size_t chorus_gpt_activation_bytes(const chorus_gpt_t *m);
CHORUS_API const chorus_gpt_unit_t *chorus_gpt_unit(const chorus_gpt_t *m, int u);

/* Made with this flag, the model allocates neither parameters nor
 * gradients (chorus_gpt_params and _grads return NULL): every unit must be
 * bound before a pass uses it. */
#define CHORUS_GPT_EXTERNAL 1u
CHORUS_API chorus_result_t chorus_gpt_create_ex(const chorus_gpt_config_t *cfg, int max_batch,
                                                uint64_t seed, unsigned flags,
                                                chorus_gpt_t **out);
/* The initial values chorus_gpt_create gives floats [offset, offset + n)
 * of the layout for seed, into dst -- bit for bit, at a cost of n: a rank
 * can initialise its shard without the rest. */
CHORUS_API void chorus_gpt_init_range(const chorus_gpt_t *m, uint64_t seed, size_t offset,
                                      size_t n, float *dst);
/* Unit u's parameters and gradients are at params and grads (unit size
 * floats each) from now on; NULL: the model's own buffers (or none). */
CHORUS_API chorus_result_t chorus_gpt_bind_unit(chorus_gpt_t *m, int u, float *params,
                                                float *grads);

typedef enum {
  CHORUS_GPT_FORWARD_BEGIN = 0,
  CHORUS_GPT_FORWARD_END = 1,
  CHORUS_GPT_BACKWARD_BEGIN = 2,
  CHORUS_GPT_BACKWARD_END = 3,
} chorus_gpt_event_t;
/* train: the forward has targets (a backward may follow).  A result other
 * than CHORUS_OK stops the pass, which returns it. */
typedef chorus_result_t (*chorus_gpt_unit_fn)(void *arg, chorus_gpt_event_t ev, int unit,
                                              int train);
CHORUS_API void chorus_gpt_set_unit_hook(chorus_gpt_t *m, chorus_gpt_unit_fn fn, void *arg);

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
/* The same in pieces, for state that covers a rank's shard made of
 * several ranges: begin_step once, then update each range -- the floats
 * [state_off, state_off + n) of the state, for params and grads of n
 * floats.  A range outside the state is ignored. */
CHORUS_API void chorus_optim_begin_step(chorus_optim_t *o);
CHORUS_API void chorus_optim_update(chorus_optim_t *o, size_t state_off, float *params,
                                    const float *grads, size_t n, float lr);
/* The state (AdamW: step count, m, v; SGD: momentum) as one byte blob, for
 * checkpoints: size, and copy out / in. */
CHORUS_API size_t chorus_optim_state_size(const chorus_optim_t *o);
CHORUS_API void chorus_optim_state_save(const chorus_optim_t *o, void *dst);
CHORUS_API chorus_result_t chorus_optim_state_load(chorus_optim_t *o, const void *src, size_t len);

/* Euclidean norm of g (n floats), accumulated in double; and its square
 * (the sum of squares), for norms over shards: add the ranks' squares. */
CHORUS_API double chorus_grad_norm(const float *g, size_t n);
CHORUS_API double chorus_grad_sumsq(const float *g, size_t n);
/* Scales g so that its norm (given) is at most max_norm (torch's
 * clip_grad_norm_ rule: factor max_norm / (norm + 1e-6), capped at 1). */
CHORUS_API void chorus_grad_clip(float *g, size_t n, double norm, double max_norm);

/* Learning rate at step (0-based): linear warm-up over warmup steps to
 * max_lr, then cosine decay to min_lr at total steps. */
CHORUS_API float chorus_lr_at(long step, long warmup, long total, float max_lr, float min_lr);

/* ---------------------------------------------------------- token data
 *
 * A dataset is a stream of tokens kept on disk and memory-mapped (pages
 * are given back after each read, so resident memory does not grow with
 * the dataset):
 *   - llm.c's token shards: a header of 256 little-endian int32 -- [0]
 *     CHORUS_SHARD_MAGIC, [1] version (1: uint16 tokens, 2: uint32), [2]
 *     the number of tokens -- then the tokens.  A dataset is a directory
 *     (its NAME_train_*.bin, or NAME_val_*.bin for the validation split), a
 *     glob (validation: the same pattern with its last "train" made "val"),
 *     or one file; shards in name order.
 *   - nanoGPT's train.bin / val.bin: uint16 tokens, no header
 *     (CHORUS_TOKENS_RAW16; a directory holding them, or the file).
 *   - a plain text file: its bytes are the tokens (vocabulary 256); the
 *     last tenth is the validation split.
 * Sequence i (of seq tokens) is tokens i*seq .. i*seq+seq of the stream
 * (inputs, and shifted by one the targets), across shard boundaries.
 * Every token read is checked against the vocabulary; a bad file is
 * reported with its name and the byte offset. */
#define CHORUS_SHARD_MAGIC 20240520
typedef struct chorus_tokens chorus_tokens_t;
enum { CHORUS_SPLIT_TRAIN = 0, CHORUS_SPLIT_VAL = 1 };
enum {
  CHORUS_TOKENS_AUTO = 0, /* shards, or text if a file neither named .bin nor a shard */
  CHORUS_TOKENS_LLMC = 1,
  CHORUS_TOKENS_RAW16 = 2,
  CHORUS_TOKENS_TEXT = 3
};

/* Which split a shard's file name is in by llm.c's naming, NAME_S_<n>.bin
 * or NAME_S.bin (its one-shard datasets: tiny_shakespeare_train.bin), S
 * being train or val and NAME not empty: CHORUS_SPLIT_TRAIN or _VAL, or -1
 * when it is neither.  *name_len gets NAME's length, *numbered the form. */
CHORUS_API int chorus_shard_name(const char *file, size_t *name_len, int *numbered);

/* Opens a split.  The validation split may be empty (0 tokens); the
 * training split may not.  Headers and sizes are checked here. */
CHORUS_API chorus_result_t chorus_tokens_open(const char *spec, int split, int format, int vocab,
                                              chorus_tokens_t **out);
CHORUS_API void chorus_tokens_close(chorus_tokens_t *d);
/* The tokenizer that came with a dataset: the folder of spec (spec itself
 * when it is a folder; a file's or a glob's folder) when it holds
 * encoder.json, as `chorus-data prepare` leaves it there.  Writes the
 * folder into buf (len bytes) and returns buf, or NULL when there is none
 * (or the name does not fit). */
CHORUS_API const char *chorus_tokens_tokenizer_dir(const char *spec, char *buf, size_t len);
CHORUS_API size_t chorus_tokens_count(const chorus_tokens_t *d);
CHORUS_API int chorus_tokens_files(const chorus_tokens_t *d);
CHORUS_API const char *chorus_tokens_file(const chorus_tokens_t *d, int i);
CHORUS_API int chorus_tokens_vocab(const chorus_tokens_t *d);
CHORUS_API int chorus_tokens_is_text(const chorus_tokens_t *d);
/* Sequences of seq tokens: (tokens - 1) / seq. */
CHORUS_API size_t chorus_tokens_samples(const chorus_tokens_t *d, int seq);
/* Fills tokens and targets (B x seq) with sequences idx[0..B).  Safe from
 * several threads at once. */
CHORUS_API chorus_result_t chorus_tokens_read(const chorus_tokens_t *d, int seq,
                                              const size_t *idx, int B, int *tokens,
                                              int *targets);
/* Reads every token, checking it against the vocabulary. */
CHORUS_API chorus_result_t chorus_tokens_check(const chorus_tokens_t *d);

/* Writing one llm.c shard: a temporary file next to path, renamed to it
 * (after fsync) only by a committing close, so a half-written shard never
 * carries a shard's name. */
typedef struct chorus_shard_writer chorus_shard_writer_t;
CHORUS_API chorus_result_t chorus_shard_writer_open(const char *path, int version,
                                                    chorus_shard_writer_t **out);
CHORUS_API chorus_result_t chorus_shard_writer_add(chorus_shard_writer_t *w,
                                                   const uint32_t *toks, size_t n);
CHORUS_API size_t chorus_shard_writer_count(const chorus_shard_writer_t *w);
CHORUS_API chorus_result_t chorus_shard_writer_close(chorus_shard_writer_t *w, int commit);

/* ---------------------------------------------------------------- loader
 *
 * PyTorch's DataLoader(dataset, batch_size, sampler=DistributedSampler,
 * num_workers, prefetch_factor) over a token dataset: this rank's batches
 * in the sampler's order (chorus_sampler below: torch's lists), read ahead
 * by `workers` threads holding up to `prefetch` batches each, so batch
 * i + 1 .. i + workers * prefetch are read while step i computes.  With 0
 * workers next() reads the batch itself.  The position (epoch, and the
 * samples of it the whole world consumed) counts the batches handed out,
 * not those read ahead: checkpoint it and seek back to it, on any world
 * size (see the sampler's Position). */
typedef struct chorus_loader chorus_loader_t;
typedef struct chorus_loader_config {
  int seq, batch;
  int workers, prefetch;
  int shuffle, drop_last;
  uint64_t seed;
  double read_delay_s; /* benchmarks: a batch takes at least this long to read (slow storage) */
  /* next() fails with CHORUS_ERR_TIMEOUT when the batch it waits for is
   * not read within this many seconds (storage stalled: a hung network
   * file system); 0: CHORUS_TIMEOUT's value, or 300.  The worker stuck in
   * the read cannot be stopped; destroy() then waits for it as long again
   * and, failing that, leaves the loader's memory to the process. */
  double read_timeout_s;
} chorus_loader_config_t;

CHORUS_API chorus_result_t chorus_loader_create(const chorus_tokens_t *data,
                                                const chorus_loader_config_t *cfg, int world,
                                                int rank, chorus_loader_t **out);
CHORUS_API void chorus_loader_destroy(chorus_loader_t *l);
/* The next batch (B x seq tokens and targets; idx, if not NULL, gets its B
 * sequence numbers).  *wait_s: how long the call waited for it -- the time
 * loading took from the step.  A read error (a token outside the
 * vocabulary, ...) comes back on every later call too. */
CHORUS_API chorus_result_t chorus_loader_next(chorus_loader_t *l, int *tokens, int *targets,
                                              size_t *idx, double *wait_s);
CHORUS_API long chorus_loader_epoch(const chorus_loader_t *l);
CHORUS_API size_t chorus_loader_taken(const chorus_loader_t *l);
CHORUS_API chorus_result_t chorus_loader_seek(chorus_loader_t *l, long epoch, size_t taken);
CHORUS_API chorus_result_t chorus_loader_reshard(chorus_loader_t *l, int world, int rank);
/* Sequences per epoch of this rank (the rest of the epoch after a seek), and the dataset's. */
CHORUS_API size_t chorus_loader_len(const chorus_loader_t *l);
CHORUS_API size_t chorus_loader_sequences(const chorus_loader_t *l);

/* ------------------------------------------------------------- tokenizer
 *
 * GPT-2's byte-level BPE.  Text is cut into pieces by GPT-2's pattern
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * (Unicode letters, numbers and white space as Python's `regex` module
 * classifies them), each piece's bytes become byte tokens, and adjacent
 * pairs merge by rank (the lowest-ranked pair present, every occurrence of
 * it left to right, until no pair has a rank) -- the same tokens as GPT-2's
 * encoder.py and tiktoken's encode_ordinary.  Bytes that are not UTF-8
 * (overlong forms, surrogates, beyond U+10FFFF, truncated sequences) each
 * count as one character that is neither letter, number nor space (what
 * Python's surrogateescape makes of them), so every byte string has tokens
 * and decoding them (the concatenation of chorus_bpe_token's bytes) gives
 * it back.  The text "<|endoftext|>" is encoded as ordinary text: append
 * chorus_bpe_eot() yourself between documents.
 *
 * The files are GPT-2's: encoder.json (token text -> id, the text in
 * GPT-2's byte-to-unicode alphabet) and vocab.bpe (one merge "a b" per line
 * in rank order, after a "#version" line).  Ids 0..255 are the byte tokens,
 * then one id per merge (merge r is id 256 + r), then "<|endoftext|>"
 * (GPT-2: 50257 ids, eot 50256).
 *
 * Threads: a tokenizer is read-only once made: share it between threads;
 * an encoder (its cache) and a counter are one per thread.  Memory: a
 * tokenizer holds its tokens' bytes and a merge table (GPT-2's: about
 * 3 MiB); an encoder about 4.3 MiB of cache (emptied when full, never
 * grown) plus, while it encodes a piece longer than 128 bytes, about 44
 * bytes per byte of that piece.  Limits: at most 4M ids, tokens of at most
 * 1024 bytes, files of at most 256 MiB.
 *
 * Errors: every function that can fail returns a chorus_result_t and
 * records why for chorus_train_last_error() (this thread); those with err
 * and errlen also copy the message there (err may be NULL).  Messages name
 * the function, the file and line or token, and what to do. */
typedef struct chorus_bpe chorus_bpe_t;
typedef struct chorus_bpe_encoder chorus_bpe_encoder_t;

/* Loads dir/encoder.json and dir/vocab.bpe.  Every field is checked (ids
 * dense and unique, ids 0..255 the 256 bytes, each merge's parts tokens
 * and its result the token 256 + rank, <|endoftext|> optional and last);
 * err (errlen bytes) says what is wrong and where.  *out is NULL on
 * failure.  CHORUS_ERR_SYSTEM: a file cannot be read; INVALID_ARG: its
 * content; NO_MEMORY. */
CHORUS_API chorus_result_t chorus_bpe_load(const char *dir, chorus_bpe_t **out, char *err,
                                           size_t errlen);
/* Writes dir/encoder.json (one line, ASCII, escaped as GPT-2's file) and
 * dir/vocab.bpe, each through a temporary file and a rename; makes dir
 * (not its parents) if missing. */
CHORUS_API chorus_result_t chorus_bpe_save(const chorus_bpe_t *t, const char *dir, char *err,
                                           size_t errlen);
CHORUS_API void chorus_bpe_free(chorus_bpe_t *t);
/* Number of ids (merges + 256 + special tokens) and the id of
 * "<|endoftext|>" (-1 if the vocabulary has none). */
CHORUS_API int chorus_bpe_vocab(const chorus_bpe_t *t);
CHORUS_API int chorus_bpe_eot(const chorus_bpe_t *t);
/* The bytes of token id (NULL if id is out of range; the eot token gives
 * its text "<|endoftext|>"); valid while t lives.  len may be NULL. */
CHORUS_API const unsigned char *chorus_bpe_token(const chorus_bpe_t *t, int id, size_t *len);

/* An encoder reads t, which must outlive it. */
/* The offset of the first byte of text that does not start well-formed
 * UTF-8 (what Python's decoder accepts: no overlong forms, surrogates or
 * code points past U+10FFFF), or len when all of it is. */
CHORUS_API size_t chorus_utf8_check(const void *text, size_t len);
/* The first place p >= from (and >= 1) in text where GPT-2's pre-split has
 * a boundary that does not depend on anything before or after: a character
 * other than whitespace followed by ASCII whitespace.  No pattern of the
 * pre-split matches such a pair (runs of letters, digits and other
 * characters take a space only in front), so a piece ends at p both in the
 * whole text and in the text cut at p, and matching from p on looks at
 * nothing before it: encoding text[0, p) and text[p, len) apart gives the
 * tokens of the whole.  len when there is none. */
CHORUS_API size_t chorus_bpe_cut(const void *text, size_t len, size_t from);
/* The first place p >= from where the pre-split's pieces, scanned from
 * start, can be cut: the end of a piece that is not white space, or of one
 * that reached the longest a piece may be (64 KiB; the tokenizer cuts
 * longer runs so).  start must be 0 or a place this function or
 * chorus_bpe_cut returned.  The pre-split matches from such a place on
 * without looking back, and a piece ending there ends there also in the
 * text cut there, so encoding text[start, p) and text[p, len) apart gives
 * the tokens of the whole.  Costs a scan of from - start bytes: for text
 * with no white space, where chorus_bpe_cut finds no place.  len when
 * there is none. */
CHORUS_API size_t chorus_bpe_cut_pieces(const void *text, size_t len, size_t start, size_t from);

CHORUS_API chorus_result_t chorus_bpe_encoder_create(const chorus_bpe_t *t,
                                                     chorus_bpe_encoder_t **out);
CHORUS_API void chorus_bpe_encoder_free(chorus_bpe_encoder_t *e);
/* Appends the tokens of len bytes of text to *toks (a malloc'd array of
 * *cap entries holding *n; grown with realloc as needed; *toks = NULL,
 * *n = *cap = 0 to start).  The text is cut as a whole: a piece never
 * spans two calls, so cut long input where the pattern would (e.g. after
 * a newline followed by a non-space) to get the tokens of the whole.  On
 * failure (NO_MEMORY, or INVALID_ARG for a single piece over 4 GiB) the
 * tokens of the pieces before stay appended. */
CHORUS_API chorus_result_t chorus_bpe_encode(chorus_bpe_encoder_t *e, const void *text,
                                             size_t len, uint32_t **toks, size_t *n,
                                             size_t *cap);

/* Training a vocabulary: feed text (any number of calls, pieces cut by the
 * pattern above, a piece never spanning two calls; one counter per thread,
 * merged), then learn merges until the vocabulary has vocab_size ids
 * including "<|endoftext|>" (257 <= vocab_size <= 4M): the most frequent
 * adjacent pair over the counted pieces becomes the next merge, ties going
 * to the smaller left id, then the smaller right id; a pair whose bytes
 * are already a token, or would be longer than 1024 bytes, is never
 * merged.  The same counts give the same vocabulary.  Fails with
 * INVALID_ARG (saying how many ids the text allows) when the text has
 * too few distinct pairs.  A counter holds every distinct piece once, with
 * its count. */
typedef struct chorus_bpe_counter chorus_bpe_counter_t;
CHORUS_API chorus_result_t chorus_bpe_counter_create(chorus_bpe_counter_t **out);
CHORUS_API void chorus_bpe_counter_free(chorus_bpe_counter_t *c);
CHORUS_API chorus_result_t chorus_bpe_count(chorus_bpe_counter_t *c, const void *text, size_t len);
/* Adds everything from counted into into (counted is left as it was). */
CHORUS_API chorus_result_t chorus_bpe_counter_merge(chorus_bpe_counter_t *into,
                                                    const chorus_bpe_counter_t *counted);
CHORUS_API chorus_result_t chorus_bpe_train(const chorus_bpe_counter_t *c, int vocab_size,
                                            chorus_bpe_t **out, char *err, size_t errlen);

/* ---------------------------------------------------------------- dataset
 *
 * A run's data with its vocabulary, as chorus-train opens it: the training
 * split of spec and the validation split of val_spec (spec's when NULL),
 * and the tokenizer -- the folder tokenizer, or, for token shards, the one
 * that came with them (chorus_tokens_tokenizer_dir).  The vocabulary is
 * vocab when not 0, else the tokenizer's, else 256 for text and GPT-2's
 * 50257 for token files; a vocab smaller than the tokenizer's is refused.
 * format: CHORUS_TOKENS_*. */
typedef struct chorus_dataset {
  chorus_tokens_t *train, *val;
  chorus_bpe_t *bpe; /* NULL: no tokenizer */
  int vocab;
  char tokenizer[4096]; /* the tokenizer's folder, "" without */
} chorus_dataset_t;
CHORUS_API chorus_result_t chorus_dataset_open(const char *spec, const char *val_spec, int format,
                                               int vocab, const char *tokenizer,
                                               chorus_dataset_t *out);
CHORUS_API void chorus_dataset_close(chorus_dataset_t *d);

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

/* ------------------------------------------------------------- sharding
 *
 * Sharded data parallel -- ZeRO's stages, stage 3 being FSDP's full shard
 * -- over a communicator of N ranks.  Each unit of the model is padded to
 * a multiple of N floats and cut in N equal slices; rank r keeps slice r of
 * every unit (its shard) and the optimizer state of its shard only.
 *   stage 1  every rank keeps the full parameters and gradients; a unit's
 *            gradient is all_reduced (AVG) as soon as its backward is done
 *            (as DDP); each rank updates its slices, then every unit's
 *            updated slices are all-gathered.
 *   stage 2  the gradients are sharded too: a unit's gradient exists only
 *            from its backward until it is reduce-scattered into the shard.
 *   stage 3  the parameters too: a unit's are all-gathered before each of
 *            its uses, forward and backward, up to `prefetch` units ahead of
 *            the unit computing, and let go after it.
 * The model must be made with CHORUS_GPT_EXTERNAL; chorus_fsdp_create binds
 * its units and installs its unit hook.  Every rank initialises its own
 * slices from seed (chorus_gpt_init_range: the weights chorus_gpt_create
 * gives, which DDP would broadcast); ranks given different seeds fail.
 * Stages 2 and 3 reduce the gradients at every backward, micro-steps of an
 * accumulation included (they keep no full gradient to accumulate into);
 * stage 1 honours set_sync as DDP does. */
typedef struct chorus_fsdp chorus_fsdp_t;

typedef struct chorus_fsdp_config {
  int stage;                   /* 1, 2 or 3 */
  int prefetch;                /* stage 3: gathers ahead of the computing unit (1; 0: none) */
  chorus_dtype_t param_dtype;  /* what the parameter all-gathers carry, and the precision the
                                  model computes with: FLOAT32, or BFLOAT16 (fp32 master
                                  slices, rounded copies gathered) */
  chorus_dtype_t reduce_dtype; /* what the gradient reductions carry: FLOAT32 or BFLOAT16 */
  int overlap;                 /* 1: reduce a unit's gradient as soon as its backward is done */
} chorus_fsdp_config_t;

#define CHORUS_FSDP_CONFIG_DEFAULT {3, 1, CHORUS_FLOAT32, CHORUS_FLOAT32, 1}

CHORUS_API chorus_result_t chorus_fsdp_create(chorus_comm_t comm, chorus_gpt_t *model,
                                              uint64_t seed, const chorus_fsdp_config_t *cfg,
                                              chorus_fsdp_t **out);
CHORUS_API void chorus_fsdp_destroy(chorus_fsdp_t *f);
/* Zeroes the shard's gradients (and stage 1's full ones): the start of a step. */
CHORUS_API void chorus_fsdp_zero_grad(chorus_fsdp_t *f);
/* Stage 1: 0 makes the next backward passes reduce nothing (no_sync). */
CHORUS_API void chorus_fsdp_set_sync(chorus_fsdp_t *f, int sync);
/* Starts what did not start and waits for every gradient reduction of the
 * backward passes so far: the shard's gradients are then final. */
CHORUS_API chorus_result_t chorus_fsdp_wait(chorus_fsdp_t *f);
/* The shard, slice by slice (one per unit): parameters to update (fp32
 * master values; write them only after chorus_fsdp_wait, which leaves no
 * gather reading them), their averaged gradients, n floats, and where the
 * slice's optimizer state starts (an optimizer made for shard_size floats:
 * chorus_optim_update(o, state_off, params, grads, n, lr)). */
CHORUS_API size_t chorus_fsdp_shard_size(const chorus_fsdp_t *f);
CHORUS_API int chorus_fsdp_num_slices(const chorus_fsdp_t *f);
CHORUS_API void chorus_fsdp_slice(chorus_fsdp_t *f, int i, float **params, float **grads,
                                  size_t *n, size_t *state_off);
/* After the slices were updated (a collective): stages 1-2 all-gather
 * them into every rank's full parameters; stage 3 lets go of gathered
 * copies, which are stale now. */
CHORUS_API chorus_result_t chorus_fsdp_sync_params(chorus_fsdp_t *f);
/* The whole parameters (master values, the layout of chorus_gpt_tensor)
 * into root's dst (nparams floats; ignored elsewhere), gathered unit by
 * unit: root holds one unit more than its shard at a time.  A collective. */
CHORUS_API chorus_result_t chorus_fsdp_full_params(chorus_fsdp_t *f, float *dst, int root);

typedef struct chorus_fsdp_stats {
  int stage;
  size_t shard_floats;
  size_t param_bytes; /* resident: full flat parameters (stages 1-2), master slices */
  size_t grad_bytes;  /* resident: full gradients (stage 1) or the shard's */
  size_t work_bytes, work_peak; /* gathered parameters and gradients being reduced: now, peak */
  size_t work_bound;  /* the most the schedule lets them reach */
  double comm_s;      /* collectives of the last step, summed */
  double exposed_s;   /* time the last step blocked on them */
  int events;
} chorus_fsdp_stats_t;
CHORUS_API void chorus_fsdp_get_stats(const chorus_fsdp_t *f, chorus_fsdp_stats_t *s);

/* What happened in the last step (since zero_grad), for traces: each
 * unit's forward and backward compute, and each collective. */
enum {
  CHORUS_FSDP_FORWARD = 0,
  CHORUS_FSDP_BACKWARD = 1,
  CHORUS_FSDP_GATHER = 2,
  CHORUS_FSDP_REDUCE_SCATTER = 3,
  CHORUS_FSDP_ALL_REDUCE = 4,
};
typedef struct chorus_fsdp_event {
  int kind, unit;
  int64_t start_ns, end_ns; /* CLOCK_MONOTONIC */
  size_t bytes;
} chorus_fsdp_event_t;
CHORUS_API const chorus_fsdp_event_t *chorus_fsdp_event(const chorus_fsdp_t *f, int i);

/* -------------------------------------------------------------- trainer
 *
 * One data-parallel training step of the GPT, whichever way it is spread
 * over the ranks -- DDP (shard 0) or sharded (1-3, chorus_fsdp) -- with
 * what every loop needs around it:
 *   - the uneven-input join (PyTorch's Join): a rank out of data keeps
 *     taking part, contributing zero gradients, until no rank has data;
 *   - dynamic loss scaling (torch.cuda.amp.GradScaler's rule): the loss is
 *     scaled (2^16 at first) so small gradients survive fp16/bf16
 *     reductions; a step whose gradients hold inf/NaN on any rank is
 *     skipped on every rank and the scale halves; 200 good steps double it;
 *   - the gradient norm over the whole model (over every shard), clipping;
 *   - the optimizer, over the whole model or the rank's shard;
 *   - bfloat16 parameters: the model computes with weights rounded to
 *     bf16, fp32 master weights are what the optimizer updates (stage 0
 *     too, so DDP is the counterpart of the sharded runs).
 * A step: begin_step, micro_step once per micro-batch (the last with
 * last = 1), finish_step.  Every rank makes the same calls. */
typedef struct chorus_trainer chorus_trainer_t;

typedef struct chorus_trainer_config {
  int shard;                   /* 0: DDP; 1, 2, 3: ZeRO stages (3 = FSDP full shard) */
  chorus_ddp_config_t ddp;     /* shard 0 */
  chorus_fsdp_config_t fsdp;   /* shards 1-3 (its stage and param_dtype are set from here) */
  chorus_optim_config_t optim;
  float clip;                  /* max norm of the whole gradient; 0: no clipping */
  int loss_scale;              /* 1: dynamic loss scaling */
  chorus_dtype_t param_dtype;  /* FLOAT32, or BFLOAT16 on fp32 masters */
  size_t mem_cap;              /* bytes per rank; 0: no cap (see chorus_train_memory_t) */
} chorus_trainer_config_t;

/* Memory of one rank, in bytes.  planned = params + grads + optim +
 * work_bound + activations is what --mem-cap compares. */
typedef struct chorus_train_memory {
  size_t params;      /* resident parameters (full, shard, masters) */
  size_t grads;       /* resident gradients (full or shard, + DDP's bf16/fp16 copies) */
  size_t optim;       /* optimizer state */
  size_t work_peak;   /* gathered parameters and gradients in flight: the peak so far */
  size_t work_bound;  /* the most the schedule lets those reach */
  size_t activations; /* activations and backward scratch */
  size_t planned;
} chorus_train_memory_t;

typedef struct chorus_loss_scale {
  float scale;
  int good_steps, skipped_steps;
} chorus_loss_scale_t;

typedef struct chorus_step_info {
  int skipped;       /* inf/NaN in the gradients: no update on any rank */
  double grad_norm;  /* of the whole gradient, before clipping */
  float loss_scale;  /* after this step */
  double comm_s;     /* the step's reductions (and gathers), summed */
  double exposed_s;  /* time the step blocked on them (sharded: in the passes too) */
  double wait_s;     /* of which in finish_step, waiting for the gradients */
} chorus_step_info_t;

/* Makes the model (seed: chorus_gpt_create's weights; every rank the same),
 * its sharding and its optimizer.  With a mem_cap the plan is checked
 * first: over the cap, CHORUS_ERR_NO_MEMORY and a message that itemises it,
 * before training (under DDP before any state exists; sharded, after the
 * shards -- 4 + 4 floats a parameter over N -- are made, since the plan
 * comes from them).  comm NULL (shard 0 only): no DDP until
 * set_comm.  Shards 1-3 are collectives of comm. */
CHORUS_API chorus_result_t chorus_trainer_create(chorus_comm_t comm,
                                                 const chorus_gpt_config_t *model, int max_batch,
                                                 uint64_t seed,
                                                 const chorus_trainer_config_t *cfg,
                                                 chorus_trainer_t **out);
CHORUS_API void chorus_trainer_destroy(chorus_trainer_t *t);
/* Shard 0: leave the communicator (NULL) or move to another, which
 * broadcasts rank 0's weights (elastic training).  Sharded runs refuse. */
CHORUS_API chorus_result_t chorus_trainer_set_comm(chorus_trainer_t *t, chorus_comm_t comm);

CHORUS_API chorus_gpt_t *chorus_trainer_model(chorus_trainer_t *t);
CHORUS_API chorus_optim_t *chorus_trainer_optim(chorus_trainer_t *t);
CHORUS_API chorus_ddp_t *chorus_trainer_ddp(chorus_trainer_t *t);   /* NULL when sharded */
CHORUS_API chorus_fsdp_t *chorus_trainer_fsdp(chorus_trainer_t *t); /* NULL at shard 0 */
/* Shard 0: the weights the optimizer updates (fp32 masters with bf16
 * parameters, else the model's parameters).  NULL when sharded. */
CHORUS_API float *chorus_trainer_master(chorus_trainer_t *t);
/* Shard 0: sets the weights (nparams floats: masters, and the model's
 * rounded copy with bf16 parameters). */
CHORUS_API chorus_result_t chorus_trainer_load_weights(chorus_trainer_t *t, const float *src);
CHORUS_API void chorus_trainer_get_loss_scale(const chorus_trainer_t *t, chorus_loss_scale_t *ls);
CHORUS_API void chorus_trainer_set_loss_scale(chorus_trainer_t *t, const chorus_loss_scale_t *ls);
CHORUS_API void chorus_trainer_memory(const chorus_trainer_t *t, chorus_train_memory_t *out);

/* Every rank says whether it has data for this step (a collective):
 * *active gets how many do; 0 means training is over. */
CHORUS_API chorus_result_t chorus_trainer_join(chorus_trainer_t *t, int have_data, int *active);
/* Zeroes the gradients. */
CHORUS_API void chorus_trainer_begin_step(chorus_trainer_t *t);
/* Forward and backward of one micro-batch (B x T tokens and targets),
 * its loss weighted by weight (1/K for K micro-batches) and the loss
 * scale; last: the step's last micro-batch (DDP and stage 1 reduce only
 * then).  tokens NULL: this rank is out of data and only takes part.  A
 * failure of this rank's own (bad input, no memory) aborts the
 * communicator, so the other ranks fail at once rather than time out. */
CHORUS_API chorus_result_t chorus_trainer_micro_step(chorus_trainer_t *t, const int *tokens,
                                                     const int *targets, int B, int T,
                                                     float weight, int last, float *loss);
/* The communicator (NULL when detached) and the stage (0 for DDP). */
CHORUS_API chorus_comm_t chorus_trainer_comm(chorus_trainer_t *t);
CHORUS_API int chorus_trainer_shard(const chorus_trainer_t *t);
/* After writing new master weights into chorus_trainer_master (shard 0) or
 * the slices (chorus_fsdp_slice): brings every copy up to date (bf16
 * rounding, stages 1-2's full parameters, stage 3's gathered units).  A
 * collective when sharded. */
CHORUS_API chorus_result_t chorus_trainer_weights_changed(chorus_trainer_t *t);

/* Checkpoints of a run, at any stage, resumable at any stage on any number
 * of ranks (a collective).  dir/ckpt-<step, 9 digits>/ gets one file per
 * rank, shard-<r>-of-<N>.bin -- global ranges of the parameter layout, each
 * with its master weights and optimizer state: a rank's slices when
 * sharded, a 1/N share of everything under DDP, so every rank writes at
 * once -- and index.bin, written last by rank 0 with each file's size and
 * checksum and the caller's extra bytes.  Every file is written to a
 * temporary name, fsynced and renamed; a checkpoint exists once its index
 * does.  Then all but the newest keep complete checkpoints are removed,
 * and incomplete older ones.  A shared filesystem is assumed. */
CHORUS_API chorus_result_t chorus_trainer_save(chorus_trainer_t *t, const char *dir, long step,
                                               const void *extra, size_t extra_len, int keep);
typedef struct chorus_ckpt_info {
  int world;   /* its files: the ranks that wrote it (parameter servers: their
                * ranges); 0 for a single file */
  int stage;   /* their stage */
  int sharded; /* 1: dir/ckpt-N/, 0: dir/ckpt-N.bin (chorus_ckpt_save, an export) */
} chorus_ckpt_info_t;
/* Loads the newest usable checkpoint of dir -- sharded, or the single
 * file of chorus_ckpt_save / chorus_trainer_export -- whatever the world
 * and stage that wrote it: each rank reads the ranges it needs from every
 * file, checksumming each file whole, and nothing changes on any rank
 * until every rank has all it needs; a torn, foreign or mismatched one is
 * reported and the previous one tried (rank 0's list decides, every rank
 * follows).  *step = -1 and CHORUS_OK when none is usable.  The optimizer
 * must be of the same kind as the one that wrote it. */
CHORUS_API chorus_result_t chorus_trainer_load(chorus_trainer_t *t, const char *dir, long *step,
                                               void *extra, size_t extra_cap, size_t *extra_len,
                                               chorus_ckpt_info_t *info);
/* The whole state in chorus_ckpt_save's single-file format at path (a
 * collective): rank 0 writes it, gathering one unit of one array at a time,
 * so it never holds the whole optimizer state.  Loadable by
 * chorus_ckpt_load in a program of one process, and by chorus_trainer_load
 * at any stage (as dir/ckpt-<step>.bin). */
CHORUS_API chorus_result_t chorus_trainer_export(chorus_trainer_t *t, const char *path, long step,
                                                 const void *extra, size_t extra_len);

/* A run's checkpoints: chorus_trainer_save (and _export) with the
 * loader's position as the extra bytes -- the epoch, the samples of it the
 * whole world consumed, the data order's seed and length -- so that
 * chorus_trainer_resume puts the loader on the very next sample, over the
 * trainer's world whatever the world that saved it.  steps_done: the
 * steps completed (the step to go on from). */
CHORUS_API chorus_result_t chorus_trainer_save_run(chorus_trainer_t *t, const chorus_loader_t *ld,
                                                   const char *dir, long steps_done, int keep);
CHORUS_API chorus_result_t chorus_trainer_export_run(chorus_trainer_t *t,
                                                     const chorus_loader_t *ld, const char *path,
                                                     long steps_done);
typedef struct chorus_resume {
  long step;      /* the step to go on from: 0 without a checkpoint */
  long ckpt_step; /* the checkpoint loaded, -1 when none was usable */
  chorus_ckpt_info_t info;
  int world;      /* the ranks that saved it; 0: its data position was not
                   * taken (note says why) */
  long epoch;     /* the data's epoch it resumed in */
  int exact;      /* 1: the loader is on the next sample of the saved run */
  char path[4200];  /* the checkpoint's folder or file */
  char note[512];   /* why not exact (another data order, an unreadable
                     * position: the order starts over), "" otherwise */
} chorus_resume_t;
/* Loads the newest usable checkpoint of dir into t (chorus_trainer_load)
 * and places ld where the run that saved it stood: the same epoch and
 * global position, re-sharded over this world.  A position in another
 * data order (another dataset or seed) is not taken: that epoch starts
 * over, and out->note says so.  Without a usable checkpoint the loader
 * starts the data over, placed over the trainer's world (what a reload
 * after a lost shard needs).  A collective; an error is a failed load. */
CHORUS_API chorus_result_t chorus_trainer_resume(chorus_trainer_t *t, chorus_loader_t *ld,
                                                 const char *dir, chorus_resume_t *out);

/* When the last micro_step's forward started, its backward started and
 * ended (CLOCK_MONOTONIC ns). */
CHORUS_API void chorus_trainer_pass_times(const chorus_trainer_t *t, int64_t ns[3]);
/* Waits for the gradients, unscales and votes, clips, updates (with lr),
 * and brings the parameters up to date on every rank. */
CHORUS_API chorus_result_t chorus_trainer_finish_step(chorus_trainer_t *t, float lr,
                                                      chorus_step_info_t *info);
/* The whole master weights into root's dst (nparams floats).  A
 * collective when sharded. */
CHORUS_API chorus_result_t chorus_trainer_full_params(chorus_trainer_t *t, float *dst, int root);

/* ----------------------------------------------------------- resilience
 *
 * In-place recovery for a trainer's loop (chorus-train --elastic inplace;
 * see examples/train_elastic.c): when a rank dies or its host goes away,
 * the survivors go on from the weights in memory -- no checkpoint read --
 * and a process that arrives is taken in.  The loop calls
 *
 *   for (long step = start; step < steps;) {
 *     if (chorus_elastic_begin_step(e, &step) != CHORUS_OK) -> recover
 *     ... chorus_trainer_micro_step / _finish_step ... failed -> recover
 *     step++;
 *     continue;
 *   recover:
 *     if (chorus_elastic_recover(e, &step) != CHORUS_OK) give up;
 *   }
 *
 * and gets back the step to redo.  The runtime owns the communicator from
 * chorus_elastic_create on: a recovery shrinks it to the survivors and a
 * growth widens it, destroying the old one; ask chorus_elastic_comm (or
 * chorus_trainer_comm) for the current one after either.
 *
 * What survives a death:
 *   DDP (shard 0)  every rank holds everything: each keeps the state at
 *                  the start of the last two steps (a survivor may have
 *                  finished the step the others failed in);
 *   stages 1-3     a rank's shard exists only on it, so each rank keeps a
 *                  replica of one other rank's shard -- its buddy's, on
 *                  another host when there is one (from the host map) --
 *                  masters and optimizer state, brought up to date every
 *                  replica_every steps: the buddy sends it at the start of
 *                  the step, over point-to-point messages that run under
 *                  the step's compute, and the copy is committed when the
 *                  step's gradients are in (a death in between leaves the
 *                  previous copy).  Each rank also keeps its own shard as of
 *                  that step.
 * A recovery: the survivors shrink the communicator, agree on the newest
 * step every lost shard has a copy of (the step in progress when the
 * replicas are current, else up to replica_every - 1 steps back), cut the
 * model into shards for the new world and send every piece from whoever
 * holds it (the owner, or its buddy for a dead owner), place the data over
 * the new world at that step, and make new replicas.  When a shard and its
 * replica are both lost (a rank and its buddy together), the model is
 * gone from memory: with cfg.reload the runtime re-shards over the
 * survivors and calls it to load the last checkpoint (and says why), else
 * recover fails.  A rank dying during the recovery starts it over without
 * that rank, at most cfg.attempts times.
 * A growth (chorus_comm_joiners at the start of a step): the members
 * widen the communicator, hand the newcomers the step, the data position,
 * the loss scale and the weights (DDP) or re-shard over the larger world,
 * and make new replicas.  The newcomer makes its trainer on the
 * communicator chorus_comm_join gave and calls chorus_elastic_join. */
typedef struct chorus_elastic chorus_elastic_t;

typedef struct chorus_elastic_config {
  int replica_every;   /* stages 1-3: replicas brought up to date every K steps (1) */
  int attempts;        /* shrinks tried while ranks keep dying (8) */
  int grow_timeout_ms; /* bound on taking newcomers in (10000) */
  /* Both shards of a pair lost: load the last checkpoint into the trainer
   * (already over the survivors) and the loader, *step the step to go on
   * from; NULL: recover fails instead. */
  chorus_result_t (*reload)(void *arg, long *step);
  void *reload_arg;
  /* What happened to the world (a recovery, a growth, a reload), one line
   * without newline, on rank 0 of the new world; NULL: nothing said. */
  void (*log)(void *arg, const char *line);
  void *log_arg;
} chorus_elastic_config_t;

#define CHORUS_ELASTIC_CONFIG_DEFAULT {1, 8, 10000, NULL, NULL, NULL, NULL}

/* t's communicator and ld (placed over it) are taken over; cfg may be NULL
 * (the defaults).  Not a collective: the first begin_step pairs the ranks
 * and makes the first replicas. */
CHORUS_API chorus_result_t chorus_elastic_create(chorus_trainer_t *t, chorus_loader_t *ld,
                                                 const chorus_elastic_config_t *cfg,
                                                 chorus_elastic_t **out);
CHORUS_API void chorus_elastic_destroy(chorus_elastic_t *e);
/* At the start of *step, before its first micro-step: takes newcomers in
 * (*step is then theirs and the members'), keeps the state a recovery
 * goes back to, and starts the replicas' upkeep when due.  An error is a
 * failed collective: recover. */
CHORUS_API chorus_result_t chorus_elastic_begin_step(chorus_elastic_t *e, long *step);
/* After a failed collective of *step (or of its begin_step): *step becomes
 * the step to redo.  CHORUS_OK, or an error saying why the job cannot go
 * on (chorus_train_last_error). */
CHORUS_API chorus_result_t chorus_elastic_recover(chorus_elastic_t *e, long *step);
/* A newcomer (made on chorus_comm_join's communicator): receives the
 * members' state; *step the step to start from. */
CHORUS_API chorus_result_t chorus_elastic_join(chorus_elastic_t *e, long *step);
CHORUS_API chorus_comm_t chorus_elastic_comm(const chorus_elastic_t *e);

typedef struct chorus_elastic_stats {
  size_t replica_bytes;  /* the buddy's shard kept here (0 under DDP) */
  size_t staging_bytes;  /* the incoming copy while it is not committed */
  size_t snapshot_bytes; /* this rank's own state kept for going back */
  int buddy, holder;     /* whose shard this rank keeps; who keeps this rank's (-1: none) */
  int buddy_same_host;   /* no other host to put it on */
  long replica_step;     /* the step the committed replicas are the start of (-1) */
  double upkeep_wait_s;  /* the last upkeep: what the step waited for its transfers */
  double upkeep_copy_s;  /* ... and for its copies */
  size_t upkeep_bytes;   /* ... and what it sent */
  int recoveries, grows, reloads;
  double last_recovery_s; /* the last recovery, from the failure seen to its end */
} chorus_elastic_stats_t;
CHORUS_API void chorus_elastic_get_stats(const chorus_elastic_t *e, chorus_elastic_stats_t *s);

/* ------------------------------------------------------------------ trace
 *
 * A run's timeline for Perfetto or chrome://tracing: each rank records
 * complete events (lane 0: compute, 1: collectives) in CLOCK_MONOTONIC ns
 * (chorus_trace_now), chorus_trace_step adds a step's collectives as the
 * trainer timed them (DDP's buckets; sharded: each unit's gathers,
 * reductions and compute), and chorus_trace_write (a collective) puts
 * every rank's events on rank 0's clock -- exact on rank 0's host,
 * estimated by the shortest of 16 round trips elsewhere (ping: on every
 * rank), the bound written with each rank -- and rank 0 writes one file.
 * Names are kept as pointers: give strings that outlive the trace.  At
 * most a million events a rank; more are dropped. */
typedef struct chorus_trace chorus_trace_t;
CHORUS_API chorus_result_t chorus_trace_create(chorus_trace_t **out);
CHORUS_API void chorus_trace_destroy(chorus_trace_t *tr);
CHORUS_API int64_t chorus_trace_now(void);
CHORUS_API void chorus_trace_add(chorus_trace_t *tr, const char *name, int lane, int step,
                                 int bucket, int64_t t0_ns, int64_t t1_ns, size_t bytes);
CHORUS_API void chorus_trace_step(chorus_trace_t *tr, chorus_trainer_t *t, long step);
CHORUS_API chorus_result_t chorus_trace_write(chorus_trace_t *tr, chorus_comm_t comm, int ping,
                                              const char *path);

/* ---------------------------------------------- asynchronous data parallel
 *
 * A parameter server (chorus-train --mode async).  World ranks 0 .. S-1
 * serve, the others work.  Server s holds the floats [lo_s, hi_s) of the
 * layout (an even split), their optimizer state and a version: the number
 * of updates applied.  A worker computes a gradient on the parameters it
 * last received, pushes each server its slice, and gets back that server's
 * parameters once its gradient went into an update.  Every (server, worker)
 * pair talks over a communicator of its own, so a worker that dies, hangs
 * past the timeout or sends a malformed message fails only its pairs: the
 * server drops it and goes on with the others.
 *
 * Mirrors.  Without them a server that dies fails every worker (its
 * parameters are gone): the job stops, and a restart resumes from the
 * servers' last checkpoint.  With cfg->mirror, server processes 0 .. P-1
 * (P = servers + standby) hold the S = servers ranges: process r serves
 * range r, and process (r + 1) % P keeps a copy of it (a standby, process
 * S, keeps the last range's copy and serves nothing at first).  The primary sends its copy
 * the range's whole state once, then every update -- the averaged
 * gradient and the learning rate, which the copy applies with the same
 * optimizer step, so it stays bit for bit the primary's -- and answers no
 * worker with parameters the copy has not acknowledged.  So every update
 * a worker heard of is on two processes.  When a server process dies, the
 * survivors agree on it (chorus_comm_shrink over the servers: the job's
 * store must outlive it, as chorusrun's does), the process holding the
 * copy of each of its ranges serves that range from then on, and the
 * workers send that range's gradients there, again where the answer did
 * not come (a gradient already applied is recognised by its step and not
 * applied twice).  A range that lost its copy (or was taken over) has
 * none from then on: a second death that hits it ends the job, saying
 * which range is gone.  Checkpoints go on, a file per range.
 *
 * Staleness.  A gradient computed on version u and applied at version v
 * has staleness v - u.  Gradients are added up as they arrive; an update
 * averages what has arrived (each weighted 1, or 1 / (1 + staleness) with
 * staleness_weight), clips it by its norm over the server's range, and
 * takes one optimizer step.  The server applies it as soon as no worker
 * still computing would be more than max_staleness versions behind after
 * it; a worker that pushed waits for the update its gradient is in, so a
 * fast worker runs at most max_staleness versions ahead of the slowest.
 * max_staleness 0 is synchronous (every update averages one gradient of
 * each live worker: DDP's step); large values are fully asynchronous (an
 * update per gradient).  A gradient claiming a version staler than that,
 * or a newer one than exists, is refused, as is one of the wrong size or
 * with inf/NaN; the server says why in the reply.
 *
 * The run's length is a budget of gradients, steps * workers, DDP's tokens
 * for --steps steps on as many ranks: the learning rate follows
 * chorus_lr_at(applied / workers, ...) and a worker is told to stop once
 * the budget is applied, however many steps it did itself. */
typedef struct chorus_ps chorus_ps_t;

typedef struct chorus_ps_config {
  int servers;           /* ranges (S); ranks 0 .. servers + standby - 1 are servers */
  int mirror;            /* 1: every range has a copy on another server process */
  int standby;           /* with mirror, 0 or 1: a process that keeps a copy only, at first */
  int max_staleness;     /* >= 0 */
  int staleness_weight;  /* 1: gradients weighted 1 / (1 + staleness) */
  chorus_optim_config_t optim;
  float clip;            /* max norm of an update over a server's range; 0: none */
  float lr, min_lr;      /* peak and final learning rate */
  long warmup, steps;    /* in steps of all workers (the budget: steps * workers gradients) */
  const char *ckpt_dir;  /* servers save every ckpt_every steps and at the end; NULL: never */
  int ckpt_every, keep;
  int log_every;         /* range 0's server reports progress every log_every steps (0: never) */
  /* Servers report here (progress, dropped workers, refused gradients,
   * checkpoints), from their threads, one line at a time; NULL: stderr. */
  void (*log)(void *arg, const char *line);
  void *log_arg;
} chorus_ps_config_t;

enum { CHORUS_PS_HIST = 17 }; /* staleness 0 .. 15, and 16 or more */

typedef struct chorus_ps_stats {
  long applied;            /* gradients applied (this server) */
  long updates;            /* optimizer steps: the version */
  long refused;            /* gradients refused (stale, non-finite, past the budget excluded) */
  int dropped;             /* workers dropped (died, hung, malformed) */
  double tokens;           /* tokens of the applied gradients */
  double seconds;          /* from the first worker's arrival to the last update */
  long hist[CHORUS_PS_HIST]; /* staleness of the applied gradients */
  double loss_sum;         /* of the applied gradients' losses; loss_n of them */
  long loss_n;
  double tail_loss;        /* mean loss of the last tenth of the budget's gradients (NaN: none) */
  long resumed_step;       /* the checkpoint's step the run resumed from; 0: fresh */
  int takeovers;           /* ranges this process took over from a dead one */
  int ranges;              /* ranges this process serves at the end */
  double mirror_wait_s;    /* summed over updates: from the update to its copy's ack */
} chorus_ps_stats_t;

/* Every rank of world calls it with the same arguments (it makes the
 * pairs' communicators).  seed gives chorus_gpt_create's weights. */
CHORUS_API chorus_result_t chorus_ps_create(chorus_comm_t world, const chorus_gpt_config_t *model,
                                            uint64_t seed, const chorus_ps_config_t *cfg,
                                            chorus_ps_t **out);
CHORUS_API void chorus_ps_destroy(chorus_ps_t *ps);
/* This rank's worker index (0 .. workers - 1), or -1 on a server. */
CHORUS_API int chorus_ps_worker(const chorus_ps_t *ps);
CHORUS_API int chorus_ps_workers(const chorus_ps_t *ps);

/* A server: resumes from cfg->ckpt_dir's newest checkpoint (any mode and
 * world wrote it), then serves until the budget is applied and every worker
 * was told, or no worker is left; saves the final checkpoint.  Collective
 * over the servers.  Fails when another server died. */
CHORUS_API chorus_result_t chorus_ps_serve(chorus_ps_t *ps);
/* The statistics of the run (applied, updates, tokens, losses, staleness)
 * are those of range 0, on the process that serves it: the leader. */
CHORUS_API void chorus_ps_get_stats(const chorus_ps_t *ps, chorus_ps_stats_t *out);
/* 1 on the server process serving range 0 (server 0, or the one that took
 * its range over), 0 elsewhere: it reports, and receives the parameters. */
CHORUS_API int chorus_ps_leader(const chorus_ps_t *ps);
/* After serve: the leader receives the whole parameters into dst (num
 * params floats; NULL elsewhere); collective over the surviving servers. */
CHORUS_API chorus_result_t chorus_ps_full_params(chorus_ps_t *ps, float *dst);

/* A worker: the current parameters into params (num params floats) and the
 * step this worker starts at (its own steps done before a resume). */
CHORUS_API chorus_result_t chorus_ps_pull(chorus_ps_t *ps, float *params, long *start_step);
typedef struct chorus_ps_reply {
  int stop;          /* the budget is applied: stop */
  int unused;        /* the budget was full before this gradient came: not applied */
  int refused;       /* some server refused this gradient (why says why); params are fresh */
  long staleness;    /* the largest of the servers' */
  long version;      /* server 0's version of the parameters now in params */
  char why[320];
} chorus_ps_reply_t;
/* Pushes grads (num params floats; its loss and tokens for the servers'
 * accounting) and receives the parameters after the update it went into. */
CHORUS_API chorus_result_t chorus_ps_push(chorus_ps_t *ps, const float *grads, float loss,
                                          uint32_t tokens, float *params,
                                          chorus_ps_reply_t *reply);
/* During the backward of a push's last micro-step: the floats [final_from,
 * num params) of grads are final (backward completes the layout from its
 * end), so the servers whose ranges lie there get their slices now, while
 * backward goes on; chorus_ps_push then sends the rest.  grads must stay
 * as they are until chorus_ps_push returns.  Loss and tokens as for that
 * call.  A send that fails is taken up by chorus_ps_push (the server may
 * be gone: with mirrors the slice goes to its copy); CHORUS_OK unless the
 * arguments are bad. */
CHORUS_API chorus_result_t chorus_ps_push_early(chorus_ps_t *ps, const float *grads, float loss,
                                                uint32_t tokens, size_t final_from);

/* A worker's whole loop (chorus-train --mode async): makes the model and
 * a loader over data (this worker's share: DistributedSampler's rule over
 * the workers), pulls, then computes a gradient of accum micro-steps of
 * batch x seq tokens and pushes it -- each server's slice as soon as the
 * last backward has finished it -- until a server says the budget is
 * applied.  A resumed worker goes on in its data where its own steps left
 * it.  before_step (may be NULL) is called at the start of each step, and
 * after_compute with the seconds its compute took (testing: faults, a
 * slower machine); log (may be NULL) hears a refused gradient, one line. */
typedef struct chorus_ps_train_config {
  int seq, batch, accum;
  int workers, prefetch; /* the loader's (chorus_loader_config_t) */
  uint64_t seed;         /* the model's initial weights and the data order */
  double read_delay_s;
  void (*before_step)(void *arg, chorus_ps_t *ps, long step);
  void (*after_compute)(void *arg, double compute_s);
  void (*log)(void *arg, const char *line);
  void *arg;
} chorus_ps_train_config_t;

typedef struct chorus_ps_train_stats {
  long steps;      /* gradients of this worker applied */
  long refused;    /* refused by a server (it went on from fresh parameters) */
  long staleness_max;
  double staleness_mean, mean_loss; /* over the applied ones */
  double seconds, compute_s, wait_s; /* the loop; compute and push-and-pull summed */
  double tokens;   /* of the applied gradients */
} chorus_ps_train_stats_t;

CHORUS_API chorus_result_t chorus_ps_train(chorus_ps_t *ps, const chorus_gpt_config_t *model,
                                           const chorus_tokens_t *data,
                                           const chorus_ps_train_config_t *cfg,
                                           chorus_ps_train_stats_t *out);

/* ---------------------------------------------------------------- sampler
 *
 * torch.utils.data.DistributedSampler, index for index: each epoch a
 * permutation of the n samples from a generator seeded with seed + epoch
 * (the same MT19937 stream and shuffle as torch.randperm on the CPU, so the
 * lists equal PyTorch's), padded by repeating its head to a multiple of the
 * world size (or cut, with drop_last), and rank r takes positions r, r +
 * world, ...  Only the rank's list stays in memory (4 bytes a sample; n <
 * 2^32).
 *
 * Position.  `taken` is how many samples of the epoch's global order the
 * whole world has consumed (rank r's pos p: taken = p * world).  Seeking
 * to (epoch, taken) -- a checkpoint, or a different world after a failure
 * -- splits the rest of the epoch, global positions taken, taken + 1, ...,
 * over the current world the same way (rank r from taken + r, every
 * world-th; padded or cut at the end so each rank has as many): no sample
 * of the epoch is skipped or seen twice across the change of world,
 * beyond the padding torch adds at an epoch's end too. */
typedef struct chorus_sampler chorus_sampler_t;

CHORUS_API chorus_result_t chorus_sampler_create(size_t n, int world, int rank, int shuffle,
                                                 uint64_t seed, int drop_last,
                                                 chorus_sampler_t **out);
CHORUS_API void chorus_sampler_destroy(chorus_sampler_t *s);
/* Starts epoch e (its order; position 0).  Fails only without memory. */
CHORUS_API chorus_result_t chorus_sampler_set_epoch(chorus_sampler_t *s, long epoch);
CHORUS_API long chorus_sampler_epoch(const chorus_sampler_t *s);
/* Samples of this rank in (the rest of) the epoch -- torch's num_samples
 * for a whole epoch -- and the k-th of them (SIZE_MAX past the end). */
CHORUS_API size_t chorus_sampler_len(const chorus_sampler_t *s);
CHORUS_API size_t chorus_sampler_at(const chorus_sampler_t *s, size_t k);
/* This rank's next index; at the end of an epoch the next one starts. */
CHORUS_API chorus_result_t chorus_sampler_next(chorus_sampler_t *s, size_t *index);
/* The position in this rank's list, and setting it. */
CHORUS_API size_t chorus_sampler_pos(const chorus_sampler_t *s);
CHORUS_API void chorus_sampler_set_pos(chorus_sampler_t *s, size_t pos);
/* Samples of the epoch the world has consumed (see Position), and going to
 * (epoch, taken) over the current world. */
CHORUS_API size_t chorus_sampler_taken(const chorus_sampler_t *s);
CHORUS_API chorus_result_t chorus_sampler_seek(chorus_sampler_t *s, long epoch, size_t taken);
/* Over another world (elastic training: the survivors of a failed rank, or
 * new ranks), keeping the epoch and what the old world had taken of it. */
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
