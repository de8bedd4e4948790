/*
 * chorus-train's data-parallel loop and its report: trains the GPT of
 * chorus_train.h data-parallel over every process chorusrun started (one
 * process without it).  Each step: every rank takes its next batch from
 * the loader (PyTorch's DistributedSampler, index for index), forward,
 * backward with DDP reducing gradient buckets while backward runs (or
 * ZeRO's gathers and reductions), gradient clipping, AdamW with warm-up +
 * cosine learning rate.  Prints per-step loss and timings, validation loss
 * every --val-every steps, and a sample of generated text at the end.  Its
 * options are train_opts.c's; --mode async is train_async.c.
 *
 *   chorusrun -n 2 build/chorus-train --steps 300
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../runtime.h" /* chorus__trace_skew: --clock-skew-ms, a test knob */
#include "train.h"

/* OpenBLAS's thread count (absent in other BLAS builds: then a no-op). */
void openblas_set_num_threads(int) __attribute__((weak));

int g_rank, g_size;

void say(const char *fmt, ...) {
  if (g_rank) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void sleep_s(double s) {
  if (!(s > 0)) return;
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ----------------------------------------------------------- checkpoints */

/* Every rank writes its file (its slices, or a share under DDP), rank 0
 * the index last, with the data's position; the call returns on every
 * rank once the checkpoint is complete, so a crash right after still
 * finds it. */
static chorus_result_t checkpoint(const opts_t *o, chorus_trainer_t *t,
                                  const chorus_loader_t *ld, long steps_done) {
  chorus_result_t st = chorus_trainer_save_run(t, ld, o->ckpt_dir, steps_done, o->keep);
  if (st != CHORUS_OK)
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
  else
    say("checkpoint: %s/ckpt-%09ld (%d file(s) and an index)\n", o->ckpt_dir, steps_done,
        g_size);
  return st;
}

/* Every rank loads the newest usable checkpoint, whatever stage and number
 * of ranks wrote it; the loader goes on from the same global position
 * (without one: from the start, over this world).  The step to start
 * from, or -1 when a collective failed (reported). */
static long resume(const opts_t *o, chorus_trainer_t *t, chorus_loader_t *ld) {
  chorus_resume_t rs;
  if (chorus_trainer_resume(t, ld, o->ckpt_dir, &rs) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return -1;
  }
  if (rs.note[0]) say("%s\n", rs.note);
  if (rs.world)
    say("resumed from %s (saved by %d rank(s)%s%s, epoch %ld)\n", rs.path, rs.world,
        rs.info.sharded ? " at stage " : "",
        rs.info.sharded ? (const char *[]){"0", "1", "2", "3"}[rs.info.stage & 3] : "",
        rs.epoch);
  return rs.step;
}

/* ----------------------------------------------------------------- main */

static int die(chorus_comm_t comm, const char *what, chorus_result_t st) {
  /* The runtime's message when the communicator has none (the loader's,
   * the data's: they fail before any collective). */
  const char *why = comm ? chorus_comm_last_error(comm) : "";
  if (!why || !*why) why = chorus_train_last_error();
  fprintf(stderr, "chorus-train: rank %d: %s: %s: %s\n", g_rank, what, chorus_result_name(st),
          why);
  if (comm) chorus_comm_abort(comm);
  return 1;
}

/* join: chorusrun started this worker into a running job (CHORUS_JOIN=1,
 * a node admitted in place). */
static chorus_result_t init_comm(int join, chorus_comm_t *comm) {
  if (join) return chorus_comm_join(NULL, comm);
  if (getenv("RANK") && getenv("WORLD_SIZE")) return chorus_comm_init_env(comm);
  /* Alone: a world of one, its own store on a free port. */
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = 0;
  cfg.world_size = 1;
  cfg.store_host = "127.0.0.1";
  cfg.store_port = 0;
  cfg.host_store = 1;
  return chorus_comm_init(&cfg, comm);
}

/* Rank `rank` of a world of `world`'s mean validation loss over
 * val_batches batches (every rank evaluates different samples); NaN
 * without validation data or memory. */
float val_loss_as(chorus_gpt_t *m, const chorus_tokens_t *val, const opts_t *o, int world,
                  int rank, int *tok, int *tgt) {
  size_t n = chorus_tokens_samples(val, o->model.ctx);
  size_t *idx = malloc(sizeof(size_t) * (size_t)o->batch);
  if (n == 0 || !idx) {
    free(idx);
    return NAN;
  }
  double sum = 0;
  for (int v = 0; v < o->val_batches; v++) {
    for (int b = 0; b < o->batch; b++)
      idx[b] = ((size_t)(v * o->batch + b) * (size_t)world + (size_t)rank) % n;
    if (chorus_tokens_read(val, o->model.ctx, idx, o->batch, tok, tgt) != CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: validation data: %s\n", g_rank,
              chorus_train_last_error());
      free(idx);
      return NAN;
    }
    float loss = 0;
    chorus_gpt_forward(m, tok, tgt, o->batch, o->model.ctx, &loss);
    sum += loss;
  }
  free(idx);
  return (float)(sum / o->val_batches);
}

/* The ranks' mean validation loss, averaged over ranks, into *avg. */
static chorus_result_t validate(chorus_comm_t comm, chorus_gpt_t *m, const chorus_tokens_t *val,
                                const opts_t *o, int *tok, int *tgt, float *avg) {
  *avg = NAN;
  if (chorus_tokens_samples(val, o->model.ctx) == 0) return CHORUS_OK;
  /* Every rank joins the average, also with a NaN (no memory, or a model
   * that diverged). */
  float mine = val_loss_as(m, val, o, g_size, g_rank, tok, tgt);
  return chorus_all_reduce(comm, &mine, avg, 1, CHORUS_FLOAT32, CHORUS_AVG, NULL);
}

/* Rank 0 generates n tokens, sampling from the model's distribution with a
 * seeded generator, after GPT-2's start token "<|endoftext|>" (a newline
 * for byte-level text), and prints them through the tokenizer (bytes as
 * they are without one; token ids when the vocabulary has no text). */
void sample_text(chorus_gpt_t *m, const opts_t *o, const chorus_bpe_t *bpe, int n) {
  const int V = o->model.vocab;
  const int start = bpe && chorus_bpe_eot(bpe) >= 0 ? chorus_bpe_eot(bpe) : V <= 256 ? '\n' : 0;
  int *out = malloc(sizeof(int) * (size_t)n);
  if (!out) return;
  say("---- sample (%d tokens%s) ----\n", n, bpe ? ", GPT-2 BPE" : V <= 256 ? ", bytes" : ", ids");
  if (chorus_gpt_sample(m, &start, 1, n, o->seed ^ 0x5eedull, out) != CHORUS_OK)
    fprintf(stderr, "chorus-train: rank %d: sampling: %s\n", g_rank, chorus_train_last_error());
  else
    for (int i = 0; i < n && g_rank == 0; i++) {
      size_t tl = 0;
      const unsigned char *tb = bpe ? chorus_bpe_token(bpe, out[i], &tl) : NULL;
      if (tb) fwrite(tb, 1, tl, stdout);
      else if (V <= 256) putchar(out[i]);
      else printf("%d ", out[i]);
    }
  say("\n---- end of sample ----\n");
  free(out);
}

/* ------------------------------------------------------------------ a run */

/* Everything a training run changes as it goes. */
typedef struct {
  const opts_t *o;
  chorus_comm_t comm;
  chorus_trainer_t *trainer; /* DDP or sharded, optimizer, loss scaling, join */
  chorus_elastic_t *elastic; /* --elastic inplace: recovery and growth in place */
  chorus_gpt_t *m;           /* the trainer's model */
  chorus_optim_t *opt;       /* the trainer's optimizer */
  chorus_dataset_t data; /* the splits and the tokenizer */
  chorus_loader_t *ld;
  chorus_trace_t *tr;    /* --trace */
  int *tok, *tgt;
  size_t *idx, np;
  int first_generation; /* CHORUS_RESTART_COUNT is 0 */
  /* For the summary. */
  double sum_tps, sum_fwd, sum_bwd, sum_exp, sum_opt, sum_comm, sum_step, sum_data, sum_rep;
  int skipped_steps;
  int timed;
  float first_val, last_val;
  /* The collective that failed a step. */
  const char *fail_what;
  chorus_result_t fail_st;
  int64_t failed_ns; /* when a failure was seen; 0 once a step completed after it */
  long steps_done;
} run_t;

enum { STEP_NEXT, STEP_STOP, STEP_FATAL, STEP_COMM };

/* Opens the training and validation data, the tokenizer when there is
 * one, and sets the model's vocabulary.  0, or -1 (reported). */
static int open_data(opts_t *o, run_t *r) {
  if (chorus_dataset_open(o->data, o->val_data, o->data_format, o->vocab, o->tokenizer,
                          &r->data) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return -1;
  }
  o->model.vocab = r->data.vocab;
  return 0;
}

static int comm_failed(run_t *r, const char *what, chorus_result_t st) {
  r->fail_what = what;
  r->fail_st = st;
  return STEP_COMM;
}

int64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The trace of a step's collectives (and, sharded, each unit's compute),
 * and the optimizer step from t_wait on. */
static void trace_step(run_t *r, long step, int64_t t_wait) {
  chorus_trace_add(r->tr, "optimizer step", 0, (int)step, -1, t_wait, chorus_trace_now(), 0);
  chorus_trace_step(r->tr, r->trainer, step);
}

/* --dump: the master weights as raw float32, by rank 0 (every rank with
 * --dump-all, to FILE.rank<R>).  Sharded runs gather them unit by unit.
 * 0, or -1 (reported). */
static int dump_weights(run_t *r, const char *file, int all) {
  float *w = malloc(r->np * sizeof(float));
  if (!w) return -1;
  int rc = 0;
  for (int root = 0; root < (all ? g_size : 1) && rc == 0; root++) {
    chorus_result_t st = chorus_trainer_full_params(r->trainer, w, root);
    if (st != CHORUS_OK) {
      die(r->comm, "gathering the weights for --dump", st);
      rc = -1;
      break;
    }
    if (g_rank != root) continue;
    char path[4096];
    if (all) snprintf(path, sizeof path, "%s.rank%d", file, g_rank);
    else snprintf(path, sizeof path, "%s", file);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(w, sizeof(float), r->np, f) != r->np || fclose(f) != 0) {
      fprintf(stderr, "chorus-train: cannot write %s: %s\n", path, strerror(errno));
      rc = -1;
    }
  }
  free(w);
  return rc;
}

/* The process's peak resident memory (VmHWM), bytes; 0 when unknown. */
static size_t peak_rss(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
  fclose(f);
  return (size_t)kb * 1024;
}

/* Every rank's memory: what the runtime holds against the formula of its
 * stage (fp32 parameters and gradients, AdamW's two moments: 16 bytes a
 * parameter unsharded), the peak of gathered units, and the process's
 * peak resident memory. */
static void report_memory(run_t *r) {
  chorus_train_memory_t m;
  chorus_trainer_memory(r->trainer, &m);
  const double P = (double)r->np, N = g_size, ob = r->o->optim == CHORUS_OPTIM_ADAMW ? 8 : 4;
  const int s = r->o->shard;
  double formula = s == 0 ? (8 + ob) * P : s == 1 ? 8 * P + ob * P / N
                 : s == 2 ? 4 * P + (4 + ob) * P / N : (8 + ob) * P / N;
  const double state = (double)(m.params + m.grads + m.optim);
  printf("memory rank %d: stage %d: parameters %.2f MiB, gradients %.2f MiB, optimizer %.2f MiB "
         "= state %.2f MiB (formula %.2f MiB, %.3fx); gathered units peak %.2f MiB (bound "
         "%.2f); activations %.2f MiB; peak resident %.1f MiB\n",
         g_rank, s, m.params / 1048576.0, m.grads / 1048576.0, m.optim / 1048576.0,
         state / 1048576.0, formula / 1048576.0, state / formula, m.work_peak / 1048576.0,
         m.work_bound / 1048576.0, m.activations / 1048576.0, peak_rss() / 1048576.0);
  if (r->elastic) {
    chorus_elastic_stats_t es;
    chorus_elastic_get_stats(r->elastic, &es);
    if (s)
      printf("memory rank %d: replica of rank %d's shard (%s) %.2f MiB = %.3fx the shard's "
             "masters and optimizer state (%.2f MiB); incoming copy %.2f MiB; own copy %.2f "
             "MiB\n", g_rank, es.buddy, es.buddy_same_host ? "on this host: no other" :
             "on another host", es.replica_bytes / 1048576.0,
             (double)es.replica_bytes / (double)(m.optim + m.optim / (ob / 4)),
             (m.optim + m.optim / (ob / 4)) / 1048576.0, es.staging_bytes / 1048576.0,
             es.snapshot_bytes / 1048576.0);
    else
      printf("memory rank %d: snapshots for --elastic inplace %.2f MiB (the last two steps)\n",
             g_rank, es.snapshot_bytes / 1048576.0);
  }
  fflush(stdout);
}

/* --log-data: the sequence numbers of a batch, to FILE.rank<R> (opened per
 * line: the rank can change with an elastic world). */
static void log_batch(const opts_t *o, long step, const size_t *idx, int B) {
  char path[4096];
  snprintf(path, sizeof path, "%s.rank%d", o->log_data, g_rank);
  FILE *f = fopen(path, "a");
  if (!f) return;
  fprintf(f, "%ld:", step);
  for (int b = 0; b < B; b++) fprintf(f, " %zu", idx[b]);
  fputc('\n', f);
  fclose(f);
}

/* One optimizer step: STEP_NEXT, STEP_STOP (out of data, --stop-after),
 * STEP_FATAL (reported) or STEP_COMM (a collective failed: r->fail_*). */
static int train_step(run_t *r, long step) {
  const opts_t *o = r->o;
  const int T = o->model.ctx, B = o->batch;
  chorus_result_t st;
  if (step == o->kill_at && g_rank == o->kill_rank && r->first_generation) {
    fprintf(stderr, "chorus-train: rank %d kills itself at step %ld (--kill-at) at wall clock "
            "%lld ms\n", g_rank, step, (long long)wall_ms());
    raise(SIGKILL);
  }
  double t0 = now_s(), tf = 0, tb = 0, td = 0;
  chorus_trainer_begin_step(r->trainer);
  float loss_sum = 0;
  /* Uneven inputs: a rank out of data joins -- it contributes zero
   * gradients to the others' reductions (averaged over all ranks, as
   * PyTorch's Join does by default) and applies the same update, so every
   * rank keeps the same weights; training ends when no rank has data. */
  int have = !(g_rank == o->uneven_rank && step >= o->uneven_steps), active = have;
  if (o->uneven_rank >= 0 &&
      (st = chorus_trainer_join(r->trainer, have, &active)) != CHORUS_OK)
    return comm_failed(r, "join", st);
  if (active == 0) {
    say("step %ld: every rank is out of data\n", step);
    return STEP_STOP;
  }
  for (int a = 0; a < o->accum; a++) {
    const int last = a == o->accum - 1;
    if (!have) {
      if ((st = chorus_trainer_micro_step(r->trainer, NULL, NULL, 0, 0, 0, last, NULL)) !=
          CHORUS_OK)
        return comm_failed(r, "a joined rank's share of the step", st);
      continue;
    }
    double waited = 0;
    if ((st = chorus_loader_next(r->ld, r->tok, r->tgt, r->idx, &waited)) != CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: the training data: %s\n", g_rank,
              chorus_train_last_error());
      die(r->comm, "reading a batch", st);
      return STEP_FATAL;
    }
    td += waited;
    if (o->log_data) log_batch(o, step, r->idx, B);
    float loss = 0;
    /* --inject-inf: a backward weighted by infinity fills rank 1's
     * gradients with inf and NaN. */
    const float w = step == o->inject_inf && g_rank == 1 ? INFINITY : 1.0f / (float)o->accum;
    st = chorus_trainer_micro_step(r->trainer, r->tok, r->tgt, B, T, w, last, &loss);
    if (st != CHORUS_OK) {
      /* A collective under the pass failed (sharded runs gather and reduce
       * inside it), or the pass itself refused its input. */
      if (chorus_comm_status(r->comm) != CHORUS_OK) return comm_failed(r, "forward/backward", st);
      die(NULL, "forward/backward", st);
      return STEP_FATAL;
    }
    int64_t ns[3];
    chorus_trainer_pass_times(r->trainer, ns);
    chorus_trace_add(r->tr, "forward", 0, (int)step, -1, ns[0], ns[1], 0);
    chorus_trace_add(r->tr, "backward", 0, (int)step, -1, ns[1], ns[2], 0);
    tf += (double)(ns[1] - ns[0]) / 1e9;
    tb += (double)(ns[2] - ns[1]) / 1e9;
    loss_sum += loss;
  }
  if (g_rank == o->slow_rank) { /* --slowdown: a slower machine */
    sleep_s((o->slow_factor - 1.0) * (tf + tb));
  }
  double w0 = now_s();
  int64_t nw0 = chorus_trace_now();
  float lr = chorus_lr_at(step, o->warmup, o->steps, o->lr, o->lr * o->min_lr_frac);
  chorus_step_info_t info;
  if ((st = chorus_trainer_finish_step(r->trainer, lr, &info)) != CHORUS_OK)
    return comm_failed(r, "the optimizer step (gradient reductions)", st);
  double w1 = now_s();
  trace_step(r, step, nw0);
  if (info.skipped) {
    r->skipped_steps++;
    say("step %ld: inf/NaN in the gradients: step skipped on every rank, loss scale now %g\n",
        step, info.loss_scale);
  }
  const double norm = info.grad_norm;
  r->steps_done = step + 1;
  double t1 = now_s();
  double dt = t1 - t0, tps = (double)g_size * B * T * o->accum / dt;
  /* Sharded runs wait for gathers inside the passes: that time is in
   * fwd/bwd and in exposed comm both. */
  const double opt_s = (w1 - w0) - info.wait_s;
  /* --elastic inplace, sharded: what the replicas' upkeep cost the step
   * (waiting for the transfers, copying at the commit). */
  double rep_s = 0;
  if (r->elastic && o->shard) {
    chorus_elastic_stats_t es;
    chorus_elastic_get_stats(r->elastic, &es);
    rep_s = es.upkeep_wait_s + es.upkeep_copy_s;
  }
  if (step >= 3) { /* after warm-up */
    r->sum_rep += rep_s;
    r->sum_tps += tps, r->sum_fwd += tf, r->sum_bwd += tb, r->sum_exp += info.exposed_s;
    r->sum_opt += opt_s, r->sum_comm += info.comm_s, r->sum_step += dt, r->sum_data += td;
    r->timed++;
  }
  /* The loss every rank saw, averaged (what PyTorch users log). */
  float mine = loss_sum / (float)o->accum, avg = mine;
  if (step % o->log_every == 0 || step == o->steps - 1) {
    if ((st = chorus_all_reduce(r->comm, &mine, &avg, 1, CHORUS_FLOAT32, CHORUS_AVG, NULL)) !=
        CHORUS_OK)
      return comm_failed(r, "loss all_reduce", st);
    char rep[48] = "";
    if (r->elastic && o->shard) snprintf(rep, sizeof rep, "  replica %.1f ms", 1e3 * rep_s);
    say("step %4ld/%d  loss %.4f  lr %.2e  norm %.3f  %.0f tok/s  data %.1f ms  fwd %.1f ms  "
        "bwd %.1f ms  exposed comm %.1f ms  optim %.1f ms%s\n",
        step, o->steps, avg, lr, norm, tps, 1e3 * td, 1e3 * tf, 1e3 * tb, 1e3 * info.exposed_s,
        1e3 * opt_s, rep);
  }
  if (o->val_every && ((step + 1) % o->val_every == 0 || step == o->steps - 1)) {
    float v;
    if ((st = validate(r->comm, r->m, r->data.val, o, r->tok, r->tgt, &v)) != CHORUS_OK)
      return comm_failed(r, "validation", st);
    if (isnan(r->first_val)) r->first_val = v;
    r->last_val = v;
    say("step %4ld  validation loss %.4f\n", step, v);
  }
  int stopping = o->stop_after >= 0 && step + 1 >= o->stop_after;
  if (o->ckpt_dir && ((o->ckpt_every && (step + 1) % o->ckpt_every == 0) ||
                      step == o->steps - 1 || stopping)) {
    st = checkpoint(o, r->trainer, r->ld, step + 1);
    if (st == CHORUS_ERR_SYSTEM || st == CHORUS_ERR_NO_MEMORY) {
      fprintf(stderr, "chorus-train: rank %d: stopping: the checkpoint could not be written\n",
              g_rank);
      return STEP_FATAL;
    }
    if (st != CHORUS_OK) return comm_failed(r, "checkpoint", st);
  }
  if (stopping) {
    say("stopping after %ld steps (--stop-after)\n", step + 1);
    return STEP_STOP;
  }
  return STEP_NEXT;
}

/* ------------------------------------------------------- --elastic inplace */

/* After a recovery or a growth: the runtime's communicator. */
static void world_changed(run_t *r) {
  if (!r->elastic) return;
  r->comm = chorus_elastic_comm(r->elastic);
  g_rank = chorus_comm_rank(r->comm);
  g_size = chorus_comm_size(r->comm);
}

/* The runtime's lines (elastic events, the servers' reports), as they come. */
void log_line(void *arg, const char *line) {
  (void)arg;
  printf("%s\n", line);
  fflush(stdout);
}

/* The runtime lost a shard with its replica: the last checkpoint (or the
 * start, without one) over the survivors. */
static chorus_result_t reload_checkpoint(void *arg, long *step) {
  run_t *r = arg;
  world_changed(r);
  if (!r->o->ckpt_dir) {
    fprintf(stderr, "chorus-train: rank %d: no --checkpoint-dir to go back to\n", g_rank);
    return CHORUS_ERR_INVALID_ARG;
  }
  long s = resume(r->o, r->trainer, r->ld);
  if (s < 0) return CHORUS_ERR_REMOTE;
  *step = s;
  return CHORUS_OK;
}

/* The trainer, the loader over this world, in-place recovery when asked,
 * the step's buffers.  0, or the exit status (reported). */
static int make_trainer(run_t *r) {
  const opts_t *o = r->o;
  chorus_trainer_config_t tc = {.shard = o->shard,
                                .ddp = CHORUS_DDP_CONFIG_DEFAULT,
                                .fsdp = CHORUS_FSDP_CONFIG_DEFAULT,
                                .optim = CHORUS_OPTIM_ADAMW_DEFAULT,
                                .clip = o->clip,
                                .loss_scale = o->loss_scale,
                                .param_dtype = o->param_dtype,
                                .mem_cap = o->mem_cap};
  tc.ddp.bucket_mb = o->bucket_mb;
  tc.ddp.overlap = o->overlap;
  tc.ddp.hook = o->hook;
  tc.fsdp.prefetch = o->prefetch;
  tc.fsdp.overlap = o->overlap;
  tc.fsdp.reduce_dtype = o->hook == CHORUS_DDP_HOOK_BF16 ? CHORUS_BFLOAT16 : CHORUS_FLOAT32;
  tc.optim.kind = o->optim;
  tc.optim.momentum = o->momentum;
  tc.optim.weight_decay = o->weight_decay;
  /* A newcomer makes it on the grown world with the members (who move
   * theirs to it), then takes their state (chorus_elastic_join). */
  chorus_result_t st = chorus_trainer_create(r->comm, &o->model, o->batch, o->seed, &tc,
                                             &r->trainer);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    if (st != CHORUS_ERR_NO_MEMORY || !o->mem_cap) chorus_comm_abort(r->comm);
    chorus_comm_destroy(r->comm);
    return 1;
  }
  r->m = chorus_trainer_model(r->trainer);
  r->opt = chorus_trainer_optim(r->trainer);
  r->np = chorus_gpt_num_params(r->m);
  if (o->skip_rank == g_rank && (st = chorus_gpt_skip_layer(r->m, o->skip_layer, 1)) != CHORUS_OK)
    return die(NULL, "--skip-layer", st);

  const int T = o->model.ctx, B = o->batch;
  chorus_loader_config_t lc = {T, B, o->workers, o->data_prefetch, 1, 0, o->seed,
                               o->data_delay_ms / 1e3, 0};
  if ((st = chorus_loader_create(r->data.train, &lc, g_size, g_rank, &r->ld)) != CHORUS_OK)
    return die(r->comm, o->data, st);
  r->tok = malloc(sizeof(int) * (size_t)B * T);
  r->tgt = malloc(sizeof(int) * (size_t)B * T);
  r->idx = malloc(sizeof(size_t) * (size_t)B);
  if (o->elastic) {
    chorus_elastic_config_t ec = CHORUS_ELASTIC_CONFIG_DEFAULT;
    ec.replica_every = o->replica_every;
    ec.reload = reload_checkpoint;
    ec.reload_arg = r;
    ec.log = log_line;
    if ((st = chorus_elastic_create(r->trainer, r->ld, &ec, &r->elastic)) != CHORUS_OK)
      return die(r->comm, "--elastic inplace", st);
  }
  if (!r->tok || !r->tgt || !r->idx) return die(r->comm, "buffers", CHORUS_ERR_NO_MEMORY);
  return 0;
}

/* What this run is: the world, the model, the sharding, the data. */
static void say_run(const run_t *r, int threads) {
  const opts_t *o = r->o;
  char mode[128];
  if (o->shard == 0) {
    chorus_ddp_stats_t ds = {0};
    if (chorus_trainer_ddp(r->trainer)) chorus_ddp_get_stats(chorus_trainer_ddp(r->trainer), &ds);
    snprintf(mode, sizeof mode, "DDP, %d bucket(s)", ds.buckets);
  } else {
    snprintf(mode, sizeof mode, "sharded, stage %d (%s), %d units%s", o->shard,
             o->shard == 1 ? "optimizer state" : o->shard == 2 ? "+ gradients" : "+ parameters",
             chorus_gpt_num_units(r->m), o->shard == 3 && o->prefetch ? ", prefetch" : "");
    if (o->shard == 3 && o->prefetch) snprintf(mode + strlen(mode), sizeof mode - strlen(mode), " %d",
                                               o->prefetch);
  }
  const int T = o->model.ctx, B = o->batch;
  say("chorus-train: %d rank(s), %d BLAS thread(s) each; model %d layers, %d heads, %d "
      "channels, context %d, vocabulary %d: %zu parameters; %s; batch %d x %d per rank, %d "
      "step(s) of %d micro-step(s); %zu training samples%s%s\n",
      g_size, threads, o->model.layers, o->model.heads, o->model.channels, T, o->model.vocab,
      r->np, mode, B, T, o->steps, o->accum, chorus_loader_sequences(r->ld),
      o->elastic ? "; --elastic inplace" : "",
      o->param_dtype == CHORUS_BFLOAT16 ? "; bf16 parameters on fp32 masters" : "");
  say("data: %s: %zu tokens in %d file(s); validation %zu tokens; loader: %d worker(s) x %d "
      "batch(es) ahead%s\n", o->data, chorus_tokens_count(r->data.train),
      chorus_tokens_files(r->data.train), chorus_tokens_count(r->data.val), o->workers,
      o->workers ? o->data_prefetch : 0, o->data_delay_ms > 0 ? "; --data-delay-ms" : "");
}

/* Where the loop starts: a newcomer's step from the members, a resumed
 * checkpoint's, or 0.  -1 when that failed (reported). */
static long start_step(run_t *r) {
  const opts_t *o = r->o;
  long start = 0;
  chorus_result_t st;
  if (o->join) {
    /* A newcomer: the members hand over their state. */
    if ((st = chorus_elastic_join(r->elastic, &start)) != CHORUS_OK)
      return die(r->comm, "joining the running job", st), -1;
    fprintf(stderr, "chorus-train: joined the running job as rank %d of %d at step %ld\n", g_rank,
            g_size, start);
  } else if (o->ckpt_dir) {
    if ((start = resume(o, r->trainer, r->ld)) < 0)
      return die(r->comm, "resuming", CHORUS_ERR_REMOTE), -1;
    if (start >= o->steps)
      say("nothing to train: the checkpoint in %s has %ld of --steps %d step(s) done; raise "
          "--steps to train further, or delete %s to start over\n", o->ckpt_dir, start, o->steps,
          o->ckpt_dir);
  }
  return start;
}

/* The steps from start to --steps, recovering in place when asked.  0, or
 * the exit status (reported). */
static int train_loop(run_t *r, long start) {
  const opts_t *o = r->o;
  chorus_result_t st;
  for (long step = start; step < o->steps;) {
    int how = STEP_NEXT;
    if (r->elastic && (st = chorus_elastic_begin_step(r->elastic, &step)) != CHORUS_OK)
      how = comm_failed(r, "the start of the step (replicas, new ranks)", st);
    world_changed(r);
    if (how == STEP_NEXT) how = train_step(r, step);
    if (how == STEP_STOP) break;
    if (how == STEP_FATAL) return 1;
    if (how == STEP_COMM) {
      if (!r->elastic) return die(r->comm, r->fail_what, r->fail_st);
      if (!r->failed_ns) r->failed_ns = chorus_trace_now();
      fprintf(stderr, "chorus-train: rank %d: step %ld failed in %s (%s: %s); going on with "
              "the ranks still alive\n", g_rank, step, r->fail_what,
              chorus_result_name(r->fail_st), chorus_comm_last_error(r->comm));
      if (chorus_elastic_recover(r->elastic, &step) != CHORUS_OK) {
        fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
        return 1;
      }
      world_changed(r);
      continue;
    }
    if (r->failed_ns) {
      say("elastic: step %ld done %.0f ms after the failure was seen (wall clock %lld ms)\n",
          step, (chorus_trace_now() - r->failed_ns) / 1e6, (long long)wall_ms());
      r->failed_ns = 0;
    }
    step++;
  }
  return 0;
}

/* The loop's throughput, the mean step's parts, the validation loss. */
static void say_summary(const run_t *r, long start, double secs) {
  const opts_t *o = r->o;
  const int T = o->model.ctx, B = o->batch;
  if (r->steps_done > start) {
    const double toks = (double)(r->steps_done - start) * g_size * B * T * o->accum;
    say("trained %.0f tokens in %.2f s = %.0f tok/s (the whole loop, first steps included)\n",
        toks, secs, secs > 0 ? toks / secs : 0.0);
  }
  if (!r->timed) return;
  double step_s = r->sum_step / r->timed;
  say("summary: %.0f tok/s (mean after 3 steps), step %.1f ms: data %.1f, fwd %.1f, bwd %.1f, "
      "exposed comm %.1f (%.0f %%), optim %.1f; %s %.1f ms per step, %.0f %% hidden behind "
      "%s\n",
      r->sum_tps / r->timed, 1e3 * step_s, 1e3 * r->sum_data / r->timed,
      1e3 * r->sum_fwd / r->timed, 1e3 * r->sum_bwd / r->timed,
      1e3 * r->sum_exp / r->timed, 100.0 * r->sum_exp / r->timed / step_s,
      1e3 * r->sum_opt / r->timed, o->shard ? "collectives" : "all_reduce",
      1e3 * r->sum_comm / r->timed,
      r->sum_comm > 0 && r->sum_exp < r->sum_comm ? 100.0 * (1.0 - r->sum_exp / r->sum_comm)
                                                  : 0.0,
      o->shard ? "compute" : "backward");
  if (r->elastic && o->shard)
    say("replicas: %.2f ms per step waiting for and committing the copies (every %d "
        "step(s))\n", 1e3 * r->sum_rep / r->timed, o->replica_every);
  if (!isnan(r->first_val)) say("validation loss %.4f -> %.4f\n", r->first_val, r->last_val);
}

/* After the loop: the trace, the sample, --dump, --export, the memory
 * report.  0, or the exit status (reported). */
static int finish(run_t *r) {
  const opts_t *o = r->o;
  if (r->tr) {
    if (chorus_trace_write(r->tr, r->comm, o->trace_ping, o->trace) != CHORUS_OK)
      fprintf(stderr, "chorus-train: rank %d: cannot write the trace %s: %s\n", g_rank, o->trace,
              chorus_train_last_error());
    else
      say("trace: %s (%d ranks; open in https://ui.perfetto.dev or chrome://tracing)\n", o->trace,
          g_size);
  }
  if (o->sample > 0) sample_text(r->m, o, r->data.bpe, o->sample);
  if (o->dump && dump_weights(r, o->dump, o->dump_all) != 0) return 1;
  if (o->export_path) {
    if (chorus_trainer_export_run(r->trainer, r->ld, o->export_path, r->steps_done) !=
        CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
      return 1;
    }
    say("exported: %s (step %ld)\n", o->export_path, r->steps_done);
  }
  report_memory(r);
  return 0;
}

int main(int argc, char **argv) {
  opts_t o;
  int rc = train_options(argc, argv, &o);
  if (rc) return rc;
  run_t r = {.o = &o, .first_val = NAN, .last_val = NAN};
  if (init_comm(o.join, &r.comm) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: cannot join the group: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(r.comm);
  g_size = chorus_comm_size(r.comm);
  /* BLAS threads: share the cores among the ranks of this host. */
  int local = chorus_comm_local_size(r.comm) > 0 ? chorus_comm_local_size(r.comm) : g_size;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = o.threads > 0 ? o.threads : (int)(cores / local > 0 ? cores / local : 1);
  if (openblas_set_num_threads) openblas_set_num_threads(threads);

  if (open_data(&o, &r) != 0) {
    chorus_comm_abort(r.comm);
    chorus_comm_destroy(r.comm);
    return 1;
  }
  if (o.async) {
    rc = run_async(&o, r.comm, &r.data);
    chorus_dataset_close(&r.data);
    chorus_comm_destroy(r.comm);
    return rc;
  }
  if ((rc = make_trainer(&r)) != 0) return rc;
  say_run(&r, threads);
  const long start = start_step(&r);
  if (start < 0) return 1;
  if (o.trace) {
    if (chorus_trace_create(&r.tr) != CHORUS_OK) return die(r.comm, "--trace", CHORUS_ERR_NO_MEMORY);
    if (g_rank == 1) chorus__trace_skew(r.tr, (int64_t)o.skew_ms * 1000000);
  }
  r.steps_done = start;
  const char *restarts = getenv("CHORUS_RESTART_COUNT");
  r.first_generation = !restarts || !strcmp(restarts, "0");
  const double loop_t0 = now_s();
  if ((rc = train_loop(&r, start)) != 0) return rc;
  say_summary(&r, start, now_s() - loop_t0);
  rc = finish(&r);
  chorus_trace_destroy(r.tr);
  if (rc) return rc;
  chorus_elastic_destroy(r.elastic);
  free(r.tok), free(r.tgt), free(r.idx);
  chorus_loader_destroy(r.ld);
  chorus_trainer_destroy(r.trainer);
  chorus_dataset_close(&r.data);
  chorus_comm_destroy(r.comm);
  return 0;
}
