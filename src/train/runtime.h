/*
 * runtime.h - what the parts of libchorus-train tell each other and a user
 * never calls (private to src/train): the trainer's step hooks and
 * re-sharding, used by the in-place recovery of elastic.c, and the
 * optimizer's raw state.
 */
#ifndef CHORUS_TRAIN_RUNTIME_H
#define CHORUS_TRAIN_RUNTIME_H

#include "chorus_train.h"

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

/* The optimizer's state in place: the step count and the arrays (m; v
 * for AdamW, else NULL) of n floats. */
void chorus__optim_raw(chorus_optim_t *o, long **t, float **m, float **v, size_t *n);

#endif
