/*
 * runtime.h - what the parts of libchorus-train tell each other and a user
 * never calls (private to src/train): the trainer's step hooks and
 * re-sharding, used by the in-place recovery of elastic.c, and the
 * optimizer's raw state.
 */
#ifndef CHORUS_TRAIN_RUNTIME_H
#define CHORUS_TRAIN_RUNTIME_H

#include <sys/types.h>

#include "chorus_train.h"

/* Records why a call failed, for chorus_train_last_error (error.c; the
 * text of this thread's last failure), and returns st: every file of the
 * runtime reports a failure so, `return chorus__train_fail(CODE, "...")`. */
chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Points of a step a hook hears:
 *   FORWARD  the forward pass of the step's last micro-step is done (its
 *            backward follows);
 *   REDUCED  the gradients are final (the reductions waited for), before
 *            the step's last collectives (the loss-scale vote, the norm);
 *   UPDATE   those collectives are done: the update (or the skip) follows
 *            and cannot fail.
 * A hook's error fails the step (UPDATE's is ignored). */
enum { CHORUS__HOOK_REDUCED = 0, CHORUS__HOOK_UPDATE = 1, CHORUS__HOOK_FORWARD = 2 };
typedef chorus_result_t (*chorus__step_hook_fn)(void *arg, int when);
void chorus__trainer_set_hook(chorus_trainer_t *t, chorus__step_hook_fn fn, void *arg);

/* A sharded trainer moves to comm (another world): its shard layout,
 * optimizer and runtime are made again for comm's size -- a collective
 * on comm -- and hold the seed's initial values until loaded.  The old
 * communicator is no longer used. */
chorus_result_t chorus__trainer_reshard(chorus_trainer_t *t, chorus_comm_t comm);

/* The sharding rule (fsdp.c; the checkpoints and the recovery cut the
 * same way): a unit of count floats is cut into n slices of ceil(count / n)
 * floats, rank r holding floats [lo, hi) of it -- the last slices short or
 * empty, the rest padding.  Returns the slice length; lo and hi may be
 * NULL. */
static inline size_t chorus__slice(size_t count, int n, int r, size_t *lo, size_t *hi) {
  const size_t s = (count + (size_t)n - 1) / (size_t)n, a = (size_t)r * s;
  if (lo) *lo = a < count ? a : count;
  if (hi) *hi = a + s < count ? a + s : count;
  return s;
}

/* Testing (chorus-train --bad-push): a worker's next push claims a version
 * staler than allowed (1), sends one float too many (2), or a NaN in server
 * 0's slice (3).  Not part of the library's API. */
void chorus_ps_inject(chorus_ps_t *ps, int fault);

/* The data order's seed of a loader (loader.c): a run's checkpoint keeps
 * it with the position (resume.c). */
uint64_t chorus__loader_seed(const chorus_loader_t *l);

/* Testing (chorus-train --clock-skew-ms): every time this rank records
 * runs ns ahead (trace.c). */
void chorus__trace_skew(chorus_trace_t *tr, int64_t ns);

/* The optimizer's state in place: the step count and the arrays (m; v
 * for AdamW, else NULL) of n floats. */
void chorus__optim_raw(chorus_optim_t *o, long **t, float **m, float **v, size_t *n);

/* Folders a user names, which another local user may be able to write
 * (files.c).  chorus__dir_trust: -1 when dir cannot be used safely (it is
 * writable by everyone and has no sticky bit: anyone may swap its files),
 * 1 when other users can put entries there (another's folder, or one
 * writable by everyone with the sticky bit: warn), 0 when it is this
 * user's alone; why says so.  chorus__remove_entry removes dir/name, a
 * file or link of this user (never followed), or a folder of this user
 * after its files (not its subfolders): 0, or -1 with errno.
 * chorus__own_dir: 0 when path is a folder of this user, not a link (-1
 * with why).  chorus__create_new: a new file at path (never through a
 * link; a file or link of this user already there is replaced), the
 * descriptor or -1 with errno. */
int chorus__dir_trust(const char *dir, char *why, size_t cap);
/* chorus__dir_trust for a folder about to be written: -1 when it is
 * refused (why says so); 0 otherwise, after a warning on stderr, prefixed
 * by who (NULL: none), the first time in this process that another user
 * can put entries there. */
int chorus__dir_check(const char *dir, const char *who, char *why, size_t cap);
/* Opens path for reading without blocking (a FIFO put in a file's place
 * must not hang the open) and only if it is a regular file: the
 * descriptor, with *sb filled; -1 when it cannot be opened (errno), -2
 * when it is not a regular file. */
struct stat;
int chorus__open_regular(const char *path, struct stat *sb);
int chorus__remove_entry(const char *dir, const char *name);
int chorus__own_dir(const char *path, char *why, size_t cap);
int chorus__create_new(const char *path, mode_t mode);

#endif
