/*
 * trainer.c - one data-parallel training step, whatever the sharding: DDP
 * (stage 0) or chorus_fsdp (stages 1-3), with what both need and a C user
 * would otherwise write again -- the uneven-input join, dynamic loss
 * scaling, gradient clipping over the whole model, the optimizer, and
 * bfloat16 parameters on fp32 master weights.  See chorus_train.h.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "runtime.h"

struct chorus_trainer {
  chorus_comm_t comm;
  chorus_trainer_config_t cfg;
  chorus_gpt_t *m;
  chorus_ddp_t *ddp;
  chorus_fsdp_t *fsdp;
  chorus_optim_t *opt;
  float *master; /* stage 0 with bf16 parameters: the fp32 weights */
  size_t np;
  chorus_loss_scale_t ls;
  chorus_train_memory_t mem;
  uint64_t seed;
  chorus__step_hook_fn hook; /* elastic.c's */
  void *hook_arg;
  int64_t pass_ns[3]; /* the last micro-step: forward start, backward start, end */
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void chorus_trainer_pass_times(const chorus_trainer_t *t, int64_t ns[3]) {
  memcpy(ns, t->pass_ns, sizeof t->pass_ns);
}

/* fsdp.c's: rounds src (n floats) to bfloat16 and back into dst. */
void chorus__round_bf16(float *dst, const float *src, size_t n);

static size_t optim_floats(const chorus_optim_config_t *o) {
  return o->kind == CHORUS_OPTIM_ADAMW ? 2 : 1;
}

static chorus_result_t refuse_cap(const chorus_trainer_t *t, int rank) {
  const chorus_train_memory_t *m = &t->mem;
  return chorus__train_fail(
      CHORUS_ERR_NO_MEMORY,
      "chorus_trainer: rank %d: stage %d needs %.1f MiB per rank (parameters %.1f, "
      "gradients %.1f, optimizer %.1f, gathered units at most %.1f, activations %.1f), "
      "over the cap of %.1f MiB: shard further (a higher stage or more ranks), or use "
      "smaller batches",
      rank, t->cfg.shard, m->planned / 1048576.0, m->params / 1048576.0, m->grads / 1048576.0,
      m->optim / 1048576.0, m->work_bound / 1048576.0, m->activations / 1048576.0,
      t->cfg.mem_cap / 1048576.0);
}

/* The sharded runtime and the optimizer of its shard over comm. */
static chorus_result_t make_shards(chorus_trainer_t *t, chorus_comm_t comm) {
  chorus_fsdp_config_t fc = t->cfg.fsdp;
  fc.stage = t->cfg.shard;
  fc.param_dtype = t->cfg.param_dtype;
  chorus_result_t st = chorus_fsdp_create(comm, t->m, t->seed, &fc, &t->fsdp);
  if (st != CHORUS_OK) return st;
  chorus_fsdp_stats_t fs;
  chorus_fsdp_get_stats(t->fsdp, &fs);
  t->mem.params = fs.param_bytes;
  t->mem.grads = fs.grad_bytes;
  t->mem.optim = fs.shard_floats * 4 * optim_floats(&t->cfg.optim);
  t->mem.work_bound = fs.work_bound;
  t->mem.planned = t->mem.params + t->mem.grads + t->mem.optim + t->mem.work_bound +
                   t->mem.activations;
  if (t->cfg.mem_cap && t->mem.planned > t->cfg.mem_cap)
    return refuse_cap(t, chorus_comm_rank(comm));
  if ((st = chorus_optim_create(&t->cfg.optim, fs.shard_floats, &t->opt)) != CHORUS_OK)
    return chorus__train_fail(st, "chorus_trainer: cannot make the optimizer (out of memory?)");
  t->comm = comm;
  return CHORUS_OK;
}

chorus_result_t chorus__trainer_reshard(chorus_trainer_t *t, chorus_comm_t comm) {
  if (!t->cfg.shard || !comm)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_trainer: only a sharded trainer re-shards");
  chorus_fsdp_destroy(t->fsdp);
  chorus_optim_destroy(t->opt);
  t->fsdp = NULL;
  t->opt = NULL;
  t->comm = NULL;
  return make_shards(t, comm);
}

void chorus__trainer_set_hook(chorus_trainer_t *t, chorus__step_hook_fn fn, void *arg) {
  t->hook = fn;
  t->hook_arg = arg;
}

chorus_result_t chorus_trainer_create(chorus_comm_t comm, const chorus_gpt_config_t *model,
                                      int max_batch, uint64_t seed,
                                      const chorus_trainer_config_t *cfg,
                                      chorus_trainer_t **out) {
  if (!out || !cfg || !model)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_create: NULL argument");
  *out = NULL;
  if (cfg->shard < 0 || cfg->shard > 3 || (cfg->shard && !comm) ||
      (cfg->param_dtype != CHORUS_FLOAT32 && cfg->param_dtype != CHORUS_BFLOAT16))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_trainer_create: shard %d must be 0-3 (1-3 need "
                              "a communicator), parameters float32 or bfloat16",
                              cfg->shard);
  chorus_trainer_t *t = calloc(1, sizeof *t);
  if (!t) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_trainer_create: out of memory");
  t->cfg = *cfg;
  t->seed = seed;
  t->ls = (chorus_loss_scale_t){cfg->loss_scale ? 65536.0f : 1.0f, 0, 0};
  const int rank = comm ? chorus_comm_rank(comm) : 0;
  /* The model without storage first: its shape gives the plan. */
  chorus_result_t st = chorus_gpt_create_ex(model, max_batch, seed, CHORUS_GPT_EXTERNAL, &t->m);
  if (st != CHORUS_OK) goto out;
  t->np = chorus_gpt_num_params(t->m);
  t->mem.activations = chorus_gpt_activation_bytes(t->m);
  const size_t of = optim_floats(&cfg->optim);
  if (cfg->shard == 0) {
    const int half = cfg->ddp.hook != CHORUS_DDP_HOOK_NONE;
    t->mem.params = t->np * 4 * (cfg->param_dtype == CHORUS_BFLOAT16 ? 2 : 1);
    t->mem.grads = t->np * (4 + 2 * half);
    t->mem.optim = t->np * 4 * of;
    t->mem.planned = t->mem.params + t->mem.grads + t->mem.optim + t->mem.activations;
    if (cfg->mem_cap && t->mem.planned > cfg->mem_cap) {
      st = refuse_cap(t, rank);
      goto out;
    }
    chorus_gpt_destroy(t->m);
    t->m = NULL;
    if ((st = chorus_gpt_create(model, max_batch, seed, &t->m)) != CHORUS_OK) goto out;
    if (cfg->param_dtype == CHORUS_BFLOAT16) {
      t->master = malloc(t->np * sizeof(float));
      if (!t->master) {
        st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_trainer_create: out of memory");
        goto out;
      }
      memcpy(t->master, chorus_gpt_params(t->m), t->np * sizeof(float));
      chorus__round_bf16(chorus_gpt_params(t->m), t->master, t->np);
    }
    if ((st = chorus_optim_create(&cfg->optim, t->np, &t->opt)) != CHORUS_OK) {
      chorus__train_fail(st, "chorus_trainer_create: cannot make the optimizer (out of memory?)");
      goto out;
    }
    if (comm && (st = chorus_trainer_set_comm(t, comm)) != CHORUS_OK) goto out;
  } else if ((st = make_shards(t, comm)) != CHORUS_OK) {
    goto out;
  }
  *out = t;
  return CHORUS_OK;
out:
  chorus_trainer_destroy(t);
  return st;
}

void chorus_trainer_destroy(chorus_trainer_t *t) {
  if (!t) return;
  chorus_ddp_destroy(t->ddp);
  chorus_fsdp_destroy(t->fsdp);
  chorus_optim_destroy(t->opt);
  chorus_gpt_destroy(t->m);
  free(t->master);
  free(t);
}

chorus_result_t chorus_trainer_set_comm(chorus_trainer_t *t, chorus_comm_t comm) {
  if (t->fsdp)
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG,
        "chorus_trainer_set_comm: a sharded run cannot move to "
        "another communicator in memory (its shards would need redistributing); "
        "restart it from a checkpoint");
  chorus_ddp_destroy(t->ddp);
  t->ddp = NULL;
  t->comm = comm;
  if (!comm) return CHORUS_OK;
  /* chorus_ddp_create broadcasts rank 0's (compute) weights; with bf16
   * parameters the masters follow rank 0's too. */
  chorus_result_t st = chorus_ddp_create(comm, t->m, &t->cfg.ddp, &t->ddp);
  if (st == CHORUS_OK && t->master)
    st = chorus_broadcast(comm, t->master, t->np, CHORUS_FLOAT32, 0, NULL);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_trainer: rank %d: making DDP: %s", chorus_comm_rank(comm),
                              chorus_comm_last_error(comm));
  return CHORUS_OK;
}

chorus_gpt_t *chorus_trainer_model(chorus_trainer_t *t) { return t->m; }
chorus_comm_t chorus_trainer_comm(chorus_trainer_t *t) { return t->comm; }
int chorus_trainer_shard(const chorus_trainer_t *t) { return t->cfg.shard; }

chorus_result_t chorus_trainer_weights_changed(chorus_trainer_t *t) {
  if (t->fsdp) return chorus_fsdp_sync_params(t->fsdp);
  if (t->master) chorus__round_bf16(chorus_gpt_params(t->m), t->master, t->np);
  return CHORUS_OK;
}
chorus_optim_t *chorus_trainer_optim(chorus_trainer_t *t) { return t->opt; }
chorus_ddp_t *chorus_trainer_ddp(chorus_trainer_t *t) { return t->ddp; }
chorus_fsdp_t *chorus_trainer_fsdp(chorus_trainer_t *t) { return t->fsdp; }
float *chorus_trainer_master(chorus_trainer_t *t) {
  return t->master ? t->master : chorus_gpt_params(t->m);
}
chorus_result_t chorus_trainer_load_weights(chorus_trainer_t *t, const float *src) {
  if (t->fsdp)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_trainer_load_weights: a sharded run holds only "
                              "its shard");
  float *dst = chorus_trainer_master(t);
  if (dst != src) memcpy(dst, src, t->np * sizeof(float));
  if (t->master) chorus__round_bf16(chorus_gpt_params(t->m), t->master, t->np);
  return CHORUS_OK;
}

void chorus_trainer_get_loss_scale(const chorus_trainer_t *t, chorus_loss_scale_t *ls) {
  *ls = t->ls;
}
void chorus_trainer_set_loss_scale(chorus_trainer_t *t, const chorus_loss_scale_t *ls) {
  t->ls = *ls;
}

void chorus_trainer_memory(const chorus_trainer_t *t, chorus_train_memory_t *out) {
  *out = t->mem;
  if (t->fsdp) {
    chorus_fsdp_stats_t fs;
    chorus_fsdp_get_stats(t->fsdp, &fs);
    out->work_peak = fs.work_peak;
  }
}

void chorus_trainer_begin_step(chorus_trainer_t *t) {
  if (t->fsdp) chorus_fsdp_zero_grad(t->fsdp);
  else chorus_gpt_zero_grad(t->m);
}

chorus_result_t chorus_trainer_join(chorus_trainer_t *t, int have_data, int *active) {
  int32_t have = have_data != 0, all = have;
  *active = have;
  if (!t->comm || chorus_comm_size(t->comm) == 1) return CHORUS_OK;
  chorus_result_t st = chorus_all_reduce(t->comm, &have, &all, 1, CHORUS_INT32, CHORUS_SUM, NULL);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_trainer_join: rank %d: the vote on who has data: %s",
                              chorus_comm_rank(t->comm), chorus_comm_last_error(t->comm));
  *active = all;
  return CHORUS_OK;
}

/* A pass failed on this rank alone (bad input, no memory) while the
 * communicator is fine: the other ranks are in, or about to enter, this
 * step's collectives; aborting fails them at once instead of at the
 * timeout.  Returns st. */
static chorus_result_t pass_failed(chorus_trainer_t *t, chorus_result_t st) {
  if (t->comm && chorus_comm_size(t->comm) > 1 && chorus_comm_status(t->comm) == CHORUS_OK)
    chorus_comm_abort(t->comm);
  return st;
}

static chorus_result_t micro_step(chorus_trainer_t *t, const int *tokens, const int *targets,
                                  int B, int T, float weight, int last, float *loss);

chorus_result_t chorus_trainer_micro_step(chorus_trainer_t *t, const int *tokens,
                                          const int *targets, int B, int T, float weight,
                                          int last, float *loss) {
  chorus_result_t st = micro_step(t, tokens, targets, B, T, weight, last, loss);
  return st == CHORUS_OK ? st : pass_failed(t, st);
}

static chorus_result_t micro_step(chorus_trainer_t *t, const int *tokens, const int *targets,
                                  int B, int T, float weight, int last, float *loss) {
  chorus_result_t st;
  if (loss) *loss = 0;
  if (!tokens) {
    /* Out of data (join): take part in the communication with zero
     * gradients.  DDP needs no pass for that (the step's wait reduces
     * every bucket); the sharded runtime gathers and reduces per unit, so
     * a rank runs a pass of one token with its loss weighted 0. */
    if (t->ddp) {
      chorus_ddp_set_sync(t->ddp, last);
      return last ? CHORUS_OK : chorus_ddp_wait(t->ddp);
    }
    static const int zero = 0;
    if (t->fsdp) chorus_fsdp_set_sync(t->fsdp, last);
    if ((st = chorus_gpt_forward(t->m, &zero, &zero, 1, 1, NULL)) != CHORUS_OK) return st;
    if ((st = chorus_gpt_backward(t->m, 0.0f, NULL, NULL)) != CHORUS_OK) return st;
    return last || !t->fsdp ? CHORUS_OK : chorus_fsdp_wait(t->fsdp);
  }
  t->pass_ns[0] = now_ns();
  if ((st = chorus_gpt_forward(t->m, tokens, targets, B, T, loss)) != CHORUS_OK) return st;
  t->pass_ns[1] = t->pass_ns[2] = now_ns();
  if (last && t->hook && (st = t->hook(t->hook_arg, CHORUS__HOOK_FORWARD)) != CHORUS_OK)
    return st;
  const float scale = t->ls.scale * weight;
  if (t->ddp) {
    chorus_ddp_set_sync(t->ddp, last);
    if ((st = chorus_gpt_backward(t->m, scale, chorus_ddp_ready, t->ddp)) != CHORUS_OK) return st;
    t->pass_ns[2] = now_ns();
    /* Not the last micro-step: resets the buckets, communicates nothing. */
    return last ? CHORUS_OK : chorus_ddp_wait(t->ddp);
  }
  if (t->fsdp) chorus_fsdp_set_sync(t->fsdp, last);
  if ((st = chorus_gpt_backward(t->m, scale, NULL, NULL)) != CHORUS_OK) return st;
  t->pass_ns[2] = now_ns();
  /* Stages 2-3 reduced this micro-step's gradients: wait for them. */
  return last || !t->fsdp ? CHORUS_OK : chorus_fsdp_wait(t->fsdp);
}

/* The gradients this rank updates from: the whole (stage 0) or its slices. */
static int nranges(const chorus_trainer_t *t) {
  return t->fsdp ? chorus_fsdp_num_slices(t->fsdp) : 1;
}
static void range_at(chorus_trainer_t *t, int i, float **p, float **g, size_t *n, size_t *so) {
  if (t->fsdp) {
    chorus_fsdp_slice(t->fsdp, i, p, g, n, so);
    return;
  }
  *p = chorus_trainer_master(t);
  *g = chorus_gpt_grads(t->m);
  *n = t->np;
  *so = 0;
}

static chorus_result_t comm_fail(chorus_trainer_t *t, chorus_result_t st, const char *what) {
  return chorus__train_fail(st, "chorus_trainer: rank %d: %s: %s", chorus_comm_rank(t->comm), what,
                            chorus_comm_last_error(t->comm));
}

chorus_result_t chorus_trainer_finish_step(chorus_trainer_t *t, float lr,
                                           chorus_step_info_t *info) {
  chorus_step_info_t inf = {0};
  chorus_result_t st = CHORUS_OK;
  if (t->ddp) {
    st = chorus_ddp_wait(t->ddp);
    chorus_ddp_stats_t ds;
    chorus_ddp_get_stats(t->ddp, &ds);
    inf.comm_s = ds.comm_s;
    inf.exposed_s = ds.exposed_s;
    inf.wait_s = ds.exposed_s;
  } else if (t->fsdp) {
    int64_t w0 = now_ns();
    st = chorus_fsdp_wait(t->fsdp);
    inf.wait_s = (double)(now_ns() - w0) / 1e9;
  }
  if (st == CHORUS_OK && t->hook) st = t->hook(t->hook_arg, CHORUS__HOOK_REDUCED);
  if (st != CHORUS_OK) {
    if (info) *info = inf;
    return st; /* the reducer (or the hook) recorded why */
  }
  const int n = nranges(t);
  const int many = t->comm && chorus_comm_size(t->comm) > 1;
  /* Dynamic loss scaling: unscale; a non-finite value on any rank skips
   * the step on every rank (all vote: with sharded gradients no rank sees
   * them all) and halves the scale; growth_interval good steps double it. */
  if (t->cfg.loss_scale) {
    int32_t bad = 0, any = 0;
    for (int i = 0; i < n; i++) {
      float *p, *g;
      size_t k, so;
      range_at(t, i, &p, &g, &k, &so);
      const float inv = t->ls.scale;
      for (size_t j = 0; j < k; j++) {
        g[j] /= inv;
        bad |= !isfinite(g[j]);
      }
    }
    any = bad;
    if (many && (st = chorus_all_reduce(t->comm, &bad, &any, 1, CHORUS_INT32, CHORUS_MAX,
                                        NULL)) != CHORUS_OK)
      return comm_fail(t, st, "the loss-scale vote");
    if (any) {
      inf.skipped = 1;
      t->ls.skipped_steps++;
      t->ls.good_steps = 0;
      t->ls.scale = t->ls.scale / 2.0f < 1.0f ? 1.0f : t->ls.scale / 2.0f;
    } else if (++t->ls.good_steps == 200) {
      t->ls.good_steps = 0;
      t->ls.scale = t->ls.scale * 2.0f > 16777216.0f ? 16777216.0f : t->ls.scale * 2.0f;
    }
  }
  inf.loss_scale = t->ls.scale;
  if (!inf.skipped) {
    /* The norm of the whole gradient: stage 0 holds it all; shards add
     * their squares over the ranks. */
    double sq = 0;
    for (int i = 0; i < n; i++) {
      float *p, *g;
      size_t k, so;
      range_at(t, i, &p, &g, &k, &so);
      sq += chorus_grad_sumsq(g, k);
    }
    if (t->fsdp && many &&
        (st = chorus_all_reduce(t->comm, &sq, &sq, 1, CHORUS_FLOAT64, CHORUS_SUM, NULL)) !=
            CHORUS_OK)
      return comm_fail(t, st, "the gradient norm");
    inf.grad_norm = sqrt(sq);
  }
  if (t->hook) t->hook(t->hook_arg, CHORUS__HOOK_UPDATE);
  if (!inf.skipped) {
    chorus_optim_begin_step(t->opt);
    for (int i = 0; i < n; i++) {
      float *p, *g;
      size_t k, so;
      range_at(t, i, &p, &g, &k, &so);
      if (t->cfg.clip > 0) chorus_grad_clip(g, k, inf.grad_norm, t->cfg.clip);
      chorus_optim_update(t->opt, so, p, g, k, lr);
    }
    if (t->master) chorus__round_bf16(chorus_gpt_params(t->m), t->master, t->np);
    if (t->fsdp && (st = chorus_fsdp_sync_params(t->fsdp)) != CHORUS_OK) return st;
  }
  if (t->fsdp) {
    chorus_fsdp_stats_t fs;
    chorus_fsdp_get_stats(t->fsdp, &fs);
    inf.comm_s = fs.comm_s;
    inf.exposed_s = fs.exposed_s;
  }
  if (info) *info = inf;
  return CHORUS_OK;
}

chorus_result_t chorus_trainer_full_params(chorus_trainer_t *t, float *dst, int root) {
  if (t->fsdp) return chorus_fsdp_full_params(t->fsdp, dst, root);
  if (!t->comm || chorus_comm_rank(t->comm) == root)
    memcpy(dst, chorus_trainer_master(t), t->np * sizeof(float));
  return CHORUS_OK;
}
