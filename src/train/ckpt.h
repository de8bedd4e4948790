/*
 * ckpt.h - what the two checkpoint formats share (private to the runtime):
 * the single-file format of ckpt.c (chorus_ckpt_save; also what a full
 * export writes) and the FNV-1a checksum both use.
 *
 * Single file (little-endian, as the machine writes it):
 *   u64 magic "chorusck", u32 version, u32 header bytes,
 *   i64 step, 5 x i32 model shape (vocab ctx layers heads channels), i32 pad,
 *   u64 params (floats), u64 optimizer bytes, u64 extra bytes,
 *   then the parameters, the optimizer state (i64 step count, m, and v for
 *   AdamW), the extra bytes, then u64 FNV-1a of everything before it.
 */
#ifndef CHORUS_TRAIN_CKPT_H
#define CHORUS_TRAIN_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "chorus_train.h"

#define CK_MAGIC 0x6b637375726f6863ull /* "chorusck" */
#define CK_VERSION 1u

typedef struct {
  uint64_t magic;
  uint32_t version, header;
  int64_t step;
  int32_t shape[5], pad;
  uint64_t nparams, optbytes, extrabytes;
} ck_header_t;

#define FNV0 0xcbf29ce484222325ull
static inline uint64_t chorus__fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}
/* Writes all of p (retrying short writes), adding it to the checksum *h.
 * 0, or -1 with errno. */
int chorus__ckpt_write_all(int fd, const void *p, size_t n, uint64_t *h);
void chorus__ckpt_shape(const chorus_gpt_t *m, int32_t s[5]);

/* The checkpoints in a directory: ckpt-<step>/ (sharded, dist_ckpt.c and dist_ckpt_load.c) and
 * ckpt-<step>.bin (one file), newest first, a step's sharded one before
 * its single file.  *n of them; NULL when none (or dir is missing). */
typedef struct {
  long step;
  int dir; /* 1: ckpt-N/, 0: ckpt-N.bin */
} chorus__ckpt_cand_t;
chorus__ckpt_cand_t *chorus__ckpt_list(const char *dir, int *n);
/* The single-file checkpoint of step in dir, into buf: the name this
 * runtime writes (ckpt-000000006.bin), or, when only that is absent, the
 * one a user may give an export (ckpt-6.bin).  0, or -1 if it does not fit. */
int chorus__ckpt_file(char *buf, size_t len, const char *dir, long step);

/* chorus_trainer_save / _load for a rank that holds one range of the
 * layout, the floats [lo, lo + n), in par, with opt's state over those n
 * floats (a parameter server, ps_server.c).  Collective over comm (NULL: alone),
 * whose ranks' ranges must not overlap; a load fills the range from any
 * checkpoint whatever wrote it (n = 0: it only takes part).  The files are
 * those of chorus_trainer_save (the index records stage 0): the save is
 * chorus__ckpt_save_ranges with the range as file <comm rank> of <comm
 * size>. */
chorus_result_t chorus__ckpt_save_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long step, const void *extra, size_t extra_len, int keep);
chorus_result_t chorus__ckpt_load_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long *step, void *extra, size_t extra_cap,
                                        size_t *extra_len, chorus_ckpt_info_t *info);

/* One range a rank holds for chorus__ckpt_save_ranges: the floats [lo, lo + n)
 * in par, opt's state over those n floats, written as file `file` of the
 * checkpoint's `files`. */
typedef struct {
  chorus_optim_t *opt;
  float *par;
  size_t lo, n;
  int file;
} chorus__ck_range_t;
/* Like chorus__ckpt_save_range for a rank holding nr >= 0 ranges (a rank may
 * hold none: it only takes part in the agreement).  Collective over comm (NULL:
 * alone); together the ranks hold files 0 .. files - 1, each exactly once, and
 * their ranges do not overlap.  Comm rank 0 writes the index with its extra.
 * Bad ranges on any rank (a file outside 0 .. files - 1 or given twice, a
 * range outside the layout or overlapping another of the rank's, an optimizer
 * not over its range), the ranks disagreeing on files, or a file no rank or
 * two ranks hold, fail the save on every rank before any file is written. */
chorus_result_t chorus__ckpt_save_ranges(chorus_comm_t comm, chorus_gpt_t *m, int nr,
                                         const chorus__ck_range_t *r, int files, const char *dir,
                                         long step, const void *extra, size_t extra_len, int keep);

#endif
