/*
 * dist_ckpt.h - what the sharded checkpoint's files share (private to
 * dist_ckpt.c, which writes it, and dist_ckpt_load.c, which reads it): the
 * on-disk headers, a rank's view of what it saves or loads (ctx_t), and
 * the collective steps both take.
 *
 * dir/ckpt-<step, 9 digits>/ holds shard-<f>-of-<N>.bin, files 0 .. N - 1,
 * and index.bin, written last by rank 0.  A trainer's rank r writes file r
 * of its world's; parameter servers write one file per range, each from the
 * server holding it (chorus__ckpt_save_ranges).  A shard file holds ranges
 * of the parameter layout: the rank's slices when sharded, a 1/N share of
 * everything under DDP (every rank writes at once), a server's one range.
 * For each range: the master weights, then the optimizer's m (and v) for
 * them.
 *
 *   shard file: sh_header_t, nranges x {u64 offset, u64 count} (floats of
 *               the layout), the ranges' data in table order, u64 FNV-1a of
 *               all before it.
 *   index:      ix_header_t, files x {u64 bytes, u64 FNV} (each shard file's
 *               size and stored checksum), the caller's extra bytes, u64
 *               FNV-1a of all before it.
 */
#ifndef CHORUS_TRAIN_DIST_CKPT_H
#define CHORUS_TRAIN_DIST_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "chorus_train.h"

#define SH_MAGIC 0x6873737572686f63ull /* "chorussh" */
#define IX_MAGIC 0x7869737572686f63ull /* "chorusix" */
#define DC_VERSION 1u
#define MAX_WORLD (1u << 20)
#define MAX_EXTRA (1u << 30)

typedef struct {
  uint64_t magic;
  uint32_t version, header;
  int64_t step;
  int32_t shape[5], of; /* of: optimizer floats per parameter (AdamW 2, SGD 1) */
  int64_t opt_steps;
  uint32_t file, files; /* this is file `file` of the checkpoint's `files` */
  uint64_t nranges, nparams;
} sh_header_t;

typedef struct {
  uint64_t magic;
  uint32_t version, header;
  int64_t step;
  int32_t shape[5], of;
  uint64_t nparams;
  uint32_t files, stage;
  uint64_t extrabytes;
} ix_header_t;

/* A range of the layout this rank saves or needs: where its parameters
 * are, where its optimizer state starts. */
typedef struct {
  uint64_t off, count;
  float *par;
  size_t soff;
} span_t;

/* A range as a file holds it: byte positions of its three arrays. */
typedef struct {
  uint64_t off, count;
  uint64_t fpar, fm, fv; /* fv: 0 when of == 1 */
} piece_t;

typedef struct {
  chorus_trainer_t *t; /* NULL: one range, below */
  chorus_gpt_t *m;     /* the model (shape and units) */
  chorus_optim_t *opt;
  float *rpar;         /* without a trainer: the floats [rlo, rlo + nstate) */
  size_t rlo;
  chorus_comm_t comm;
  int rank, size, stage, of;
  int file;          /* saving: which of the checkpoint's files its ranges go to */
  uint32_t nunits;
  size_t np, nstate; /* floats of the layout; of the optimizer state */
  int32_t shape[5];
} ctx_t;

/* A rank's context: of a trainer (its optimizer state covers its shard,
 * or the whole layout under DDP), or of a rank holding the floats [lo, lo
 * + n) of the layout in par, with opt over them (a parameter server's
 * range). */
void chorus__ckpt_ctx_init(ctx_t *c, chorus_trainer_t *t);
void chorus__ckpt_ctx_init_range(ctx_t *c, chorus_comm_t comm, chorus_gpt_t *m,
                                 chorus_optim_t *opt, float *par, size_t lo, size_t n);
/* This rank's spans: its slices (sharded), or for DDP everything when
 * loading and a 1/N share of every unit when saving.  *n of them. */
span_t *chorus__ckpt_my_spans(const ctx_t *c, int saving, int *n);
/* A collective's failure, recorded with the communicator's error: st. */
chorus_result_t chorus__ckpt_coll_fail(const ctx_t *c, chorus_result_t st, const char *what);
/* Every rank agrees on ok (0/1): the minimum. */
chorus_result_t chorus__ckpt_agree(const ctx_t *c, int *ok);

#endif
