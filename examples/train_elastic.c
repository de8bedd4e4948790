/* train_elastic.c - a training loop of your own that survives losing ranks:
 * a small GPT trained sharded (ZeRO stage 3 unless STAGE says otherwise),
 * with libchorus-train's in-place recovery doing the rest.  When a rank
 * dies, chorus_elastic_recover rebuilds its shard from the replica another
 * rank keeps, re-shards the model and the data over the survivors and
 * says which step to redo; the loop just goes on.  Run:
 *   build/chorusrun --standalone -n 4 --elastic inplace -- \
 *       build/examples/train_elastic data/tinyshakespeare.txt 2 6
 * (the last two arguments make rank 2 SIGKILL itself at step 6, to see
 * it; leave them out for a quiet run).  Rank 0 prints the losses, the
 * recovery, and the final loss of the 3 survivors.
 *
 * With CKPT_DIR set, the loop also keeps a checkpoint there every 4 steps
 * (the model, the optimizer and the data's position) and a new run goes
 * on from the newest, on the very next sample, at any stage and on any
 * number of ranks; STOP_AT=N ends the run after step N, as a job out of
 * time would.
 *
 * The peak learning rate is 1e-3.  At 3e-3 this small model's loss jumped
 * once, from 3.7 to 7.7 at step 6 on 4 ranks, and fell back to 3.5 at
 * step 7 -- on one rank with the same global batch too, so not the
 * distribution: one AdamW step of the first block's attention weights
 * overshoots, the model then bets on byte values the text never holds,
 * and the next step undoes it (an independent NumPy forward of those
 * weights gives the same 7.7). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

#include "chorus.h"
#include "chorus_train.h"

enum { STEPS = 16, BATCH = 8 };

static void say(void *arg, const char *line) {
  (void)arg;
  printf("%s\n", line);
  fflush(stdout);
}

int main(int argc, char **argv) {
  const char *data = argc > 1 ? argv[1] : "data/tinyshakespeare.txt";
  const int kill_rank = argc > 3 ? atoi(argv[2]) : -1;
  const long kill_step = argc > 3 ? atol(argv[3]) : -1;
  const char *stage = getenv("STAGE");

  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  /* The model, the data and the optimizer, as for any sharded run. */
  chorus_gpt_config_t model = {256, 64, 2, 4, 128}; /* vocab ctx layers heads channels */
  chorus_trainer_config_t tc = {.shard = stage ? atoi(stage) : 3,
                                .ddp = CHORUS_DDP_CONFIG_DEFAULT,
                                .fsdp = CHORUS_FSDP_CONFIG_DEFAULT,
                                .optim = CHORUS_OPTIM_ADAMW_DEFAULT,
                                .clip = 1.0f,
                                .param_dtype = CHORUS_FLOAT32};
  chorus_trainer_t *t = NULL;
  chorus_tokens_t *train = NULL;
  chorus_loader_t *ld = NULL;
  chorus_elastic_t *e = NULL;
  chorus_loader_config_t lc = {model.ctx, BATCH, 1, 2, 1, 0, 1337, 0, 0};
  if (chorus_trainer_create(comm, &model, BATCH, 1337, &tc, &t) != CHORUS_OK ||
      chorus_tokens_open(data, 0, CHORUS_TOKENS_TEXT, 256, &train) != CHORUS_OK ||
      chorus_loader_create(train, &lc, chorus_comm_size(comm), chorus_comm_rank(comm), &ld) !=
          CHORUS_OK) {
    fprintf(stderr, "rank %d: %s\n", chorus_comm_rank(comm), chorus_train_last_error());
    chorus_comm_abort(comm);
    return 1;
  }
  /* In-place recovery: a replica of every shard on another rank, brought
   * up to date every step; it takes the communicator over. */
  chorus_elastic_config_t ec = CHORUS_ELASTIC_CONFIG_DEFAULT;
  ec.log = say;
  if (chorus_elastic_create(t, ld, &ec, &e) != CHORUS_OK) {
    fprintf(stderr, "%s\n", chorus_train_last_error());
    return 1;
  }
  /* A run that goes on from where another stopped (CKPT_DIR). */
  const char *ckpt = getenv("CKPT_DIR");
  const long stop_at = getenv("STOP_AT") ? atol(getenv("STOP_AT")) : -1;
  long start = 0;
  if (ckpt) {
    chorus_resume_t rs;
    if (chorus_trainer_resume(t, ld, ckpt, &rs) != CHORUS_OK) {
      fprintf(stderr, "rank %d: resuming: %s\n", chorus_comm_rank(comm), chorus_train_last_error());
      chorus_comm_abort(comm);
      return 1;
    }
    if (chorus_comm_rank(comm) == 0 && rs.ckpt_step >= 0)
      printf("resumed from %s at step %ld%s%s\n", rs.path, rs.step, rs.note[0] ? ": " : "",
             rs.note);
    start = rs.step;
  }
  const int world0 = chorus_comm_size(comm);
  int *tok = malloc(sizeof(int) * BATCH * model.ctx);
  int *tgt = malloc(sizeof(int) * BATCH * model.ctx);
  size_t idx[BATCH];
  float loss = 0;
  for (long step = start; step < STEPS && (stop_at < 0 || step <= stop_at);) {
    comm = chorus_elastic_comm(e); /* the survivors' after a recovery */
    const int rank = chorus_comm_rank(comm);
    if (step == kill_step && rank == kill_rank && chorus_comm_size(comm) == world0)
      raise(SIGKILL); /* a rank dies (once) */
    chorus_result_t st = chorus_elastic_begin_step(e, &step);
    if (st == CHORUS_OK) {
      chorus_trainer_begin_step(t);
      double waited;
      if ((st = chorus_loader_next(ld, tok, tgt, idx, &waited)) != CHORUS_OK) {
        fprintf(stderr, "rank %d: the data: %s\n", rank, chorus_train_last_error());
        return 1;
      }
      st = chorus_trainer_micro_step(t, tok, tgt, BATCH, model.ctx, 1.0f, 1, &loss);
    }
    if (st == CHORUS_OK) {
      chorus_step_info_t info;
      float lr = chorus_lr_at(step, 2, STEPS, 1e-3f, 1e-4f);
      st = chorus_trainer_finish_step(t, lr, &info);
    }
    if (st == CHORUS_OK) /* the loss every rank saw, averaged */
      st = chorus_all_reduce(comm, &loss, &loss, 1, CHORUS_FLOAT32, CHORUS_AVG, NULL);
    if (st == CHORUS_OK && ckpt && (step + 1) % 4 == 0) /* steps 0..step are done */
      st = chorus_trainer_save_run(t, ld, ckpt, step + 1, 2);
    if (st != CHORUS_OK) {
      /* A rank died (or its host went away): go on from memory. */
      if (chorus_elastic_recover(e, &step) != CHORUS_OK) {
        fprintf(stderr, "rank %d: cannot go on: %s\n", rank, chorus_train_last_error());
        return 1;
      }
      continue; /* step is now the one to redo */
    }
    if (rank == 0)
      printf("step %2ld: loss %.4f on %d rank(s)\n", step, loss, chorus_comm_size(comm));
    step++;
  }
  comm = chorus_elastic_comm(e);
  if (chorus_comm_rank(comm) == 0)
    printf("done: %d rank(s), final loss %.4f\n", chorus_comm_size(comm), loss);
  free(tok), free(tgt);
  chorus_elastic_destroy(e);
  chorus_loader_destroy(ld);
  chorus_tokens_close(train);
  chorus_trainer_destroy(t);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
