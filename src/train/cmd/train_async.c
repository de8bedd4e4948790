/*
 * train_async.c - chorus-train --mode async: parameter servers (with
 * their mirrors) and workers on the runtime's chorus_ps, the servers'
 * report of the run, and the workers' test knobs.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../runtime.h" /* chorus_ps_inject: --bad-push, a test knob */
#include "train.h"


/* The validation loss DDP's validate() reports on `world` ranks (the same
 * samples), computed here alone. */
static float validate_alone(chorus_gpt_t *m, const chorus_tokens_t *val, const opts_t *o,
                            int world, int *tok, int *tgt) {
  double sum = 0;
  for (int r = 0; r < world; r++) sum += val_loss_as(m, val, o, world, r, tok, tgt);
  return (float)(sum / world);
}

/* A server: serves until the budget is applied; server 0 then reports,
 * validates, samples and dumps the final weights. */
static int async_server(const opts_t *o, chorus_comm_t comm, chorus_ps_t *ps, const chorus_dataset_t *run) {
  const int W = chorus_ps_workers(ps);
  chorus_result_t st = chorus_ps_serve(ps);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  chorus_ps_stats_t s;
  chorus_ps_get_stats(ps, &s);
  const int lead = chorus_ps_leader(ps);
  if (s.takeovers)
    printf("rank %d took %d range(s) over from a dead server; it serves %d\n", g_rank,
           s.takeovers, s.ranges);
  if (lead) {
    long total = 0, mx = 0;
    double mean = 0;
    for (int i = 0; i < CHORUS_PS_HIST; i++) {
      total += s.hist[i];
      mean += (double)i * s.hist[i];
      if (s.hist[i]) mx = i;
    }
    char hist[512];
    size_t len = 0;
    hist[0] = '\0';
    for (int i = 0; i < CHORUS_PS_HIST && total; i++)
      if (s.hist[i] && len < sizeof hist)
        len += (size_t)snprintf(hist + len, sizeof hist - len, "%s%d%s: %.1f%%", len ? ", " : "",
                                i, i == CHORUS_PS_HIST - 1 ? "+" : "",
                                100.0 * s.hist[i] / total);
    const double tok = s.tokens;
    printf("summary: async, %d server(s), %d worker(s), --max-staleness %d: %.0f tokens in "
           "%.2f s = %.0f tok/s; %ld update(s) of %ld gradient(s) (%ld refused, %d worker(s) "
           "dropped)\n", o->servers, W, o->max_staleness, tok, s.seconds,
           s.seconds > 0 ? tok / s.seconds : 0.0, s.updates, s.applied, s.refused, s.dropped);
    if (o->mirror)
      printf("mirror: every update acknowledged by range 0's copy before its workers heard "
             "of it, %.2f ms on average\n", s.updates ? 1e3 * s.mirror_wait_s / s.updates : 0.0);
    printf("staleness: %s; mean %.2f, max %ld%s\n", total ? hist : "none",
           total ? mean / total : 0.0, mx, mx == CHORUS_PS_HIST - 1 ? " or more" : "");
    printf("training loss: %.4f (mean of all %ld gradients), %.4f (the last tenth)\n",
           s.loss_n ? s.loss_sum / s.loss_n : NAN, s.loss_n, s.tail_loss);
    fflush(stdout);
  }
  /* The leader (server 0, or the one serving its range now) puts the
   * whole model together for the last words. */
  const int want = o->val_every || o->sample > 0 || o->dump;
  chorus_gpt_t *m = NULL;
  if (lead && want &&
      chorus_gpt_create(&o->model, o->batch > 1 ? o->batch : 1, o->seed, &m) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank 0: %s\n", chorus_train_last_error());
    m = NULL;
  }
  int rc = 0;
  if (want) {
    /* The leader without a model passes no buffer: the call then fails on
     * every server at once. */
    st = chorus_ps_full_params(ps, m ? chorus_gpt_params(m) : NULL);
    if (st != CHORUS_OK || (lead && !m)) {
      if (st != CHORUS_OK) fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank,
                                   chorus_train_last_error());
      rc = 1;
    }
  }
  if (lead && m && rc == 0) {
    const size_t np = chorus_gpt_num_params(m);
    int *tok = malloc(sizeof(int) * (size_t)o->batch * o->model.ctx);
    int *tgt = malloc(sizeof(int) * (size_t)o->batch * o->model.ctx);
    if (o->val_every && tok && tgt)
      printf("validation loss %.4f (final weights; the samples DDP on %d ranks validates on)\n",
             validate_alone(m, run->val, o, W, tok, tgt), W);
    free(tok), free(tgt);
    if (o->sample > 0) sample_text(m, o, run->bpe, o->sample);
    if (o->dump) {
      FILE *f = fopen(o->dump, "wb");
      if (!f || fwrite(chorus_gpt_params(m), sizeof(float), np, f) != np || fclose(f) != 0) {
        fprintf(stderr, "chorus-train: cannot write %s: %s\n", o->dump, strerror(errno));
        rc = 1;
      }
    }
  }
  chorus_gpt_destroy(m);
  (void)comm;
  return rc;
}

/* A worker's test knobs around chorus_ps_train's loop. */
typedef struct {
  const opts_t *o;
  int first_generation;
  double slow; /* --slowdown's factor on this rank */
} knobs_t;

static void worker_step(void *arg, chorus_ps_t *ps, long step) {
  const knobs_t *k = arg;
  if (step == k->o->kill_at && g_rank == k->o->kill_rank && k->first_generation) {
    fprintf(stderr, "chorus-train: rank %d kills itself at step %ld (--kill-at) at wall clock "
            "%lld ms\n", g_rank, step, (long long)wall_ms());
    raise(SIGKILL);
  }
  if (step == k->o->bad_step && g_rank == k->o->bad_rank) chorus_ps_inject(ps, k->o->bad_kind);
}

static void worker_computed(void *arg, double compute_s) {
  const knobs_t *k = arg;
  sleep_s((k->slow - 1.0) * compute_s); /* --slowdown: a slower machine */
}

static void worker_log(void *arg, const char *line) {
  (void)arg;
  fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, line);
}

/* A worker: the runtime's loop, then its line. */
static int async_worker(const opts_t *o, chorus_ps_t *ps, const chorus_dataset_t *run) {
  const char *rcount = getenv("CHORUS_RESTART_COUNT");
  knobs_t k = {o, !rcount || !strcmp(rcount, "0"), g_rank == o->slow_rank ? o->slow_factor : 1.0};
  chorus_ps_train_config_t wc = {o->model.ctx, o->batch, o->accum, o->workers, o->data_prefetch,
                                 o->seed, o->data_delay_ms / 1e3, worker_step, worker_computed,
                                 worker_log, &k};
  chorus_ps_train_stats_t s;
  if (chorus_ps_train(ps, &o->model, run->train, &wc, &s) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  const long n = s.steps + s.refused;
  printf("worker %d (rank %d): %ld step(s) applied, %.0f tok/s, compute %.1f ms/step%s, push and "
         "pull %.1f ms/step, staleness mean %.2f max %ld, %ld refused, mean loss %.4f\n",
         chorus_ps_worker(ps), g_rank, s.steps, s.seconds > 0 ? s.tokens / s.seconds : 0.0,
         n ? 1e3 * s.compute_s / (double)n : 0.0, k.slow > 1 ? " (slowed down)" : "",
         n ? 1e3 * s.wait_s / (double)n : 0.0, s.staleness_mean, s.staleness_max, s.refused,
         s.mean_loss);
  fflush(stdout);
  return 0;
}

/* --mode async: servers and workers instead of one data-parallel group. */
int run_async(const opts_t *o, chorus_comm_t comm, const chorus_dataset_t *run) {
  chorus_ps_config_t pc = {.servers = o->servers,
                           .mirror = o->mirror,
                           .standby = o->standby,
                           .max_staleness = o->max_staleness,
                           .staleness_weight = o->staleness_weight,
                           .optim = CHORUS_OPTIM_ADAMW_DEFAULT,
                           .clip = o->clip,
                           .lr = o->lr,
                           .min_lr = o->lr * o->min_lr_frac,
                           .warmup = o->warmup,
                           .steps = o->steps,
                           .ckpt_dir = o->ckpt_dir,
                           .ckpt_every = o->ckpt_every,
                           .keep = o->keep,
                           .log_every = o->log_every,
                           .log = log_line};
  pc.optim.kind = o->optim;
  pc.optim.momentum = o->momentum;
  pc.optim.weight_decay = o->weight_decay;
  if (o->servers + o->standby >= g_size) {
    fprintf(stderr, "chorus-train: --mode async needs more ranks than server processes (%d): "
            "at least one worker\n", o->servers + o->standby);
    return 2;
  }
  chorus_ps_t *ps = NULL;
  chorus_result_t st = chorus_ps_create(comm, &o->model, o->seed, &pc, &ps);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  const int W = chorus_ps_workers(ps);
  say("chorus-train: asynchronous data parallel: %d server(s)%s, %d worker(s), --max-staleness "
      "%d%s; model %d layers, %d heads, %d channels, context %d; batch %d x %d per worker, "
      "%d micro-step(s); a budget of %d steps x %d workers = %ld gradients%s\n",
      o->servers, !o->mirror ? "" : o->standby ? " mirrored (the last range on a standby)"
      : " mirrored (each range's copy on the next server)", W, o->max_staleness,
      o->staleness_weight ? ", stale gradients weighted "
      "1 / (1 + staleness)" : "", o->model.layers, o->model.heads, o->model.channels,
      o->model.ctx, o->batch, o->model.ctx, o->accum, o->steps, W, (long)o->steps * W,
      o->slow_rank >= 0 ? "; --slowdown" : "");
  int rc = chorus_ps_worker(ps) < 0 ? async_server(o, comm, ps, run) : async_worker(o, ps, run);
  chorus_ps_destroy(ps);
  return rc;
}

