/*
 * train.h - what chorus-train's files share: its options (train_opts.c),
 * the rank it runs as and the pieces both modes use (train_main.c: the
 * data-parallel loop and its report), and --mode async (train_async.c).
 */
#ifndef CHORUS_TRAIN_CMD_TRAIN_H
#define CHORUS_TRAIN_CMD_TRAIN_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"
#include "chorus_train.h"

typedef struct {
  const char *data, *val_data, *tokenizer;
  int data_format, vocab;       /* vocab 0: from the tokenizer, the data, or GPT-2's */
  int workers, data_prefetch;   /* the loader's threads and batches read ahead by each */
  double data_delay_ms;         /* benchmarks: each batch takes this long to read */
  const char *log_data;         /* testing: FILE.rank<R> gets each step's sequence numbers */
  chorus_gpt_config_t model;
  int batch, steps, warmup, val_every, val_batches, accum, sample, threads, overlap, log_every;
  float lr, min_lr_frac, weight_decay, clip;
  double bucket_mb;
  chorus_ddp_hook_t hook;
  chorus_optim_kind_t optim;
  float momentum;
  uint64_t seed;
  const char *dump, *ckpt_dir, *trace, *export_path;
  int ckpt_every, keep, stop_after, kill_at, kill_rank;
  int elastic; /* --elastic inplace (-1: CHORUS_ELASTIC decides) */
  int replica_every; /* --elastic inplace, sharded: replicas brought up to date every K steps */
  int skip_rank, skip_layer;     /* --skip-layer R:L */
  int uneven_rank, uneven_steps; /* --uneven R:N */
  int dump_all;
  int loss_scale;  /* dynamic loss scaling */
  int inject_inf;  /* testing: rank 1 puts an inf into its gradient at this step */
  int trace_ping;  /* --trace-clock ping: estimate every rank's clock offset */
  long skew_ms;    /* testing: rank 1's trace clock runs this far ahead */
  int shard;       /* 0: DDP; 1-3: ZeRO stages */
  int prefetch;    /* stage 3: gathers ahead */
  chorus_dtype_t param_dtype;
  size_t mem_cap;  /* bytes per rank; 0: none */
  int async;       /* --mode async: parameter servers and workers */
  int servers, max_staleness, staleness_weight, mirror, standby;
  int slow_rank;   /* testing: --slowdown RANK:FACTOR */
  double slow_factor;
  int bad_rank, bad_kind, bad_step; /* testing: --bad-push RANK:stale|size|nan:STEP */
  int join;        /* CHORUS_JOIN=1: started into a running job */
} opts_t;

/* The options, checked alone and together, with the environment's say
 * (CHORUS_ELASTIC, CHORUS_JOIN): 0, or the exit status (2; reported). */
int train_options(int argc, char **argv, opts_t *o);

/* This process's rank and world (the survivors' after a recovery). */
extern int g_rank, g_size;

/* printf on rank 0 only, flushed. */
void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
double now_s(void);
void sleep_s(double s);
int64_t wall_ms(void);
/* The runtime's lines (elastic events, the servers' reports), as they come. */
void log_line(void *arg, const char *line);
/* Rank `rank` of a world of `world`'s mean validation loss over
 * val_batches batches; NaN without validation data or memory. */
float val_loss_as(chorus_gpt_t *m, const chorus_tokens_t *val, const opts_t *o, int world,
                  int rank, int *tok, int *tgt);
/* Rank 0 prints n tokens the model generates (--sample). */
void sample_text(chorus_gpt_t *m, const opts_t *o, const chorus_bpe_t *bpe, int n);

/* --mode async: servers and workers instead of one data-parallel group.
 * The exit status. */
int run_async(const opts_t *o, chorus_comm_t comm, const chorus_dataset_t *data);

#endif
