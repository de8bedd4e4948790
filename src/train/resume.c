/*
 * resume.c - a run's checkpoints with the data's position: what
 * chorus_trainer_save keeps of the model and optimizer, plus where the
 * loader stood, so that a loop (chorus-train's or a user's) resumes on
 * the very next sample, at any stage and on any number of ranks.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "chorus.h"
#include "chorus_train.h"
#include "train/ckpt.h"
#include "train/runtime.h"

/* The extra bytes of a run's checkpoint (little-endian hosts only, as the
 * checkpoints themselves).  The data position: with `taken` set, pos is
 * the samples of the epoch the whole world consumed; checkpoints from
 * before it (taken 0) hold rank 0's position in its list, which times
 * world is the same count.  nseq (absent from checkpoints written before
 * it, which end at seed) is what the position counts in: the dataset's
 * sequences. */
typedef struct {
  int64_t steps_done, epoch, pos;
  int32_t world, taken;
  uint64_t seed;
  int64_t nseq;
} run_state_t;
#define RUN_STATE_OLD_LEN offsetof(run_state_t, nseq)

static run_state_t run_state(chorus_trainer_t *t, const chorus_loader_t *ld, long steps_done) {
  return (run_state_t){.steps_done = steps_done,
                       .epoch = chorus_loader_epoch(ld),
                       .pos = (int64_t)chorus_loader_taken(ld),
                       .world = chorus_comm_size(chorus_trainer_comm(t)),
                       .taken = 1,
                       .seed = chorus__loader_seed(ld),
                       .nseq = (int64_t)chorus_loader_sequences(ld)};
}

chorus_result_t chorus_trainer_save_run(chorus_trainer_t *t, const chorus_loader_t *ld,
                                        const char *dir, long steps_done, int keep) {
  run_state_t rs = run_state(t, ld, steps_done);
  return chorus_trainer_save(t, dir, steps_done, &rs, sizeof rs, keep);
}

chorus_result_t chorus_trainer_export_run(chorus_trainer_t *t, const chorus_loader_t *ld,
                                          const char *path, long steps_done) {
  run_state_t rs = run_state(t, ld, steps_done);
  return chorus_trainer_export(t, path, steps_done, &rs, sizeof rs);
}

/* Puts the loader at (epoch, taken: samples of it the world consumed)
 * over the trainer's world; what it had read ahead is dropped. */
static chorus_result_t place(chorus_trainer_t *t, chorus_loader_t *ld, long epoch,
                             size_t taken) {
  chorus_comm_t comm = chorus_trainer_comm(t);
  chorus_result_t st = chorus_loader_reshard(ld, chorus_comm_size(comm), chorus_comm_rank(comm));
  return st == CHORUS_OK ? chorus_loader_seek(ld, epoch, taken) : st;
}

chorus_result_t chorus_trainer_resume(chorus_trainer_t *t, chorus_loader_t *ld, const char *dir,
                                      chorus_resume_t *out) {
  memset(out, 0, sizeof *out);
  out->ckpt_step = -1;
  run_state_t rs;
  size_t len = 0;
  long step = -1;
  chorus_result_t st = chorus_trainer_load(t, dir, &step, &rs, sizeof rs, &len, &out->info);
  if (st != CHORUS_OK) return st;
  if (step < 0) /* none: the data from its start, over this world */
    return place(t, ld, 0, 0);
  out->ckpt_step = out->step = step;
  /* The file's own name, as the runtime found it: an export may be named
   * ckpt-6.bin by hand. */
  if (out->info.sharded) snprintf(out->path, sizeof out->path, "%s/ckpt-%09ld", dir, step);
  else chorus__ckpt_file(out->path, sizeof out->path, dir, step);
  if ((len != sizeof rs && len != RUN_STATE_OLD_LEN) || rs.world < 1 || rs.epoch < 0 ||
      rs.pos < 0) {
    snprintf(out->note, sizeof out->note,
             "checkpoint of step %ld: its training state is unreadable; the data order starts "
             "over", step);
    return CHORUS_OK;
  }
  /* A position in another order (other data or seed) would skip and
   * repeat sequences without a word: that epoch starts over instead. */
  const run_state_t now = run_state(t, ld, 0);
  size_t pos = (size_t)rs.pos * (rs.taken ? 1 : (size_t)rs.world);
  if (rs.seed != now.seed || (len == sizeof rs && rs.nseq != now.nseq)) {
    snprintf(out->note, sizeof out->note,
             "checkpoint of step %ld: its data position is in another order (%lld sequences, "
             "seed %llu; this run: %lld, seed %llu): epoch %lld starts over", step,
             len == sizeof rs ? (long long)rs.nseq : -1LL, (unsigned long long)rs.seed,
             (long long)now.nseq, (unsigned long long)now.seed, (long long)rs.epoch);
    pos = 0;
  }
  if (place(t, ld, (long)rs.epoch, pos) != CHORUS_OK) {
    snprintf(out->note, sizeof out->note,
             "checkpoint of step %ld: the data position could not be restored (%s); the data "
             "order starts over", step, chorus_train_last_error());
    return CHORUS_OK;
  }
  out->world = rs.world;
  out->epoch = (long)rs.epoch;
  out->step = (long)rs.steps_done;
  out->exact = !out->note[0];
  return CHORUS_OK;
}
