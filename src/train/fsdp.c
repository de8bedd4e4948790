/*
 * fsdp.c - sharded data parallel (ZeRO stages 1-3, FSDP's full shard) for
 * the GPT of chorus_train.h, over the public API of chorus.h.
 *
 * Every unit of the model (chorus_gpt_unit) of c floats is padded to N * s
 * floats, s = ceil(c / N), and rank r owns floats [r s, (r + 1) s) of it:
 * its slice.  A rank's shard is its slices of every unit, one after the
 * other (shard offset soff per unit); the optimizer's state covers the
 * shard.  Padding floats start at zero and stay zero (their gradients are
 * zero, and so is every update of AdamW or SGD on them).
 *
 *   stage 1  full parameters and gradients on every rank, in padded "flat"
 *            buffers the model's units are bound to; each unit's gradient is
 *            all_reduced (AVG) once its backward is done; a rank updates its
 *            slices and the updated parameters are all-gathered per unit.
 *   stage 2  the same parameters; gradients only per unit while its
 *            backward runs, then reduce-scattered into the shard.
 *   stage 3  the parameters too live in the shard: a unit's parameters are
 *            all-gathered before each use and let go after it.
 *
 * Stage 3's uses follow a fixed schedule, the order the model computes its
 * units in: forward 0, 1, ..., L + 1, backward L + 1, ..., 0, where the last
 * unit also needs unit 0 (the head is tied to wte).  At the start of use i
 * the gathers of uses i..i+K (K = prefetch) that are not held yet are
 * issued, then use i's are waited for; at its end a unit whose next use is
 * more than K + 1 uses away is let go (it would be gathered again before
 * then anyway).  Every rank walks the same schedule, so the collectives go
 * out in one order everywhere, skipped blocks included.
 *
 * A unit's gradient (stages 2 and 3) is held from the start of its first
 * backward use (unit 0: the head's, at the last unit) to the end of its
 * last, then reduce-scattered; at most MAX_REDUCING reductions are in
 * flight (the oldest is waited for first), which bounds the memory they
 * hold.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "runtime.h"

/* Rounds src (n floats) to bfloat16 and back into dst (may be src). */
void chorus__round_bf16(float *dst, const float *src, size_t n) {
  uint16_t h[1024];
  for (size_t i = 0; i < n; i += 1024) {
    size_t k = n - i < 1024 ? n - i : 1024;
    chorus_convert(h, CHORUS_BFLOAT16, src + i, CHORUS_FLOAT32, k);
    chorus_convert(dst + i, CHORUS_FLOAT32, h, CHORUS_BFLOAT16, k);
  }
}

enum { MAX_REDUCING = 1, MAX_EVENTS = 4096 };
enum { P_FREE, P_GATHERING, P_READY };
enum { G_NONE, G_HELD, G_REDUCING };

typedef struct {
  size_t count; /* c: floats of the unit */
  size_t off;   /* in the model's layout */
  size_t s;     /* slice: ceil(c / N) */
  size_t soff;  /* the slice's place in the shard */
  size_t foff;  /* stages 1 and 2: the unit's place in the flat buffers */
  /* Gathered parameters: stage 3, and stages 1-2 with bf16 parameters
   * (there only while the gather after the update runs). */
  int pstate;
  float *pbuf;        /* N * s floats (stage 3) */
  uint16_t *phalf;    /* bf16: N * s, what the all_gather fills */
  uint16_t *psend;    /* bf16: s, this rank's slice rounded */
  chorus_work_t pwork;
  /* Gradient (stages 2 and 3: a working copy; stage 1: the flat buffer). */
  int gstate;
  float *gbuf;        /* N * s floats */
  uint16_t *ghalf;    /* bf16 reduction: N * s (stage 1: c) */
  void *rsout;        /* s elements of the reduce dtype */
  chorus_work_t gwork;
  long gseq;          /* order its reduction started in */
  int reduced;        /* stage 1: its all_reduce of this step started */
  int bwd_last;       /* schedule position of its last backward use */
} unit_t;

typedef struct {
  int needs[2], nneeds; /* the unit, and unit 0 for the last unit (the head) */
} use_t;

struct chorus_fsdp {
  chorus_comm_t comm;
  chorus_gpt_t *model;
  chorus_fsdp_config_t cfg;
  int rank, size, nu;
  unit_t *u;
  size_t shard;              /* S: floats of the shard */
  size_t flat;               /* padded floats of every unit */
  float *pflat, *gflat;      /* stages 1-2: full parameters; stage 1: full gradients */
  float *pshard;             /* master slices: stage 3, or bf16 parameters */
  float *gshard;             /* stages 2-3: the shard's gradients */
  use_t *sched;              /* forward then backward uses */
  int nsched, train;
  int sync;
  long gseq_next;
  int reducing;              /* reductions in flight */
  chorus_result_t error;
  char why[256];
  /* memory */
  size_t work_bytes, work_peak, work_bound;
  /* timing */
  double comm_s, exposed_s;
  chorus_fsdp_event_t *ev;
  int nev;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void note_event(chorus_fsdp_t *f, int kind, int unit, int64_t t0, int64_t t1,
                       size_t bytes) {
  if (f->nev >= MAX_EVENTS || t1 < t0) return;
  f->ev[f->nev++] = (chorus_fsdp_event_t){kind, unit, t0, t1, bytes};
}

/* Working buffers: counted, so the peak is known. */
static void *work_alloc(chorus_fsdp_t *f, size_t bytes, int zero) {
  void *p = zero ? calloc(1, bytes ? bytes : 1) : malloc(bytes ? bytes : 1);
  if (!p) return NULL;
  f->work_bytes += bytes;
  if (f->work_bytes > f->work_peak) f->work_peak = f->work_bytes;
  return p;
}
static void work_free(chorus_fsdp_t *f, void *p, size_t bytes) {
  if (!p) return;
  free(p);
  f->work_bytes -= bytes;
}

/* Records the first failure.  One of this rank's own (out of memory)
 * aborts the communicator: the other ranks are about to wait in a
 * collective this rank will not join, and must fail at once, not time out. */
static chorus_result_t set_error(chorus_fsdp_t *f, chorus_result_t st, const char *what,
                                 int unit) {
  if (f->error == CHORUS_OK) {
    f->error = st;
    const int local = chorus_comm_status(f->comm) == CHORUS_OK;
    snprintf(f->why, sizeof f->why, "rank %d: %s of unit %d: %s: %s", f->rank, what, unit,
             chorus_result_name(st),
             local ? "this rank's own failure; the communicator is aborted"
                   : chorus_comm_last_error(f->comm));
    if (local) chorus_comm_abort(f->comm);
  }
  return chorus__train_fail(f->error, "chorus_fsdp: %s", f->why);
}

/* Binds unit v where its parameters and gradients live now: gathered
 * (stage 3) or the flat buffers (stages 1-2); a held working gradient or
 * the flat one (stage 1). */
static void rebind(chorus_fsdp_t *f, int v) {
  const unit_t *u = &f->u[v];
  chorus_gpt_bind_unit(f->model, v,
                       u->pstate == P_READY ? u->pbuf : f->pflat ? f->pflat + u->foff : NULL,
                       u->gbuf ? u->gbuf : f->gflat ? f->gflat + u->foff : NULL);
}

/* Waits for *w, adds its run time to the step's and its event to the
 * trace, frees it.  Its result. */
static chorus_result_t finish_work(chorus_fsdp_t *f, chorus_work_t *w, int kind, int unit,
                                   size_t bytes) {
  chorus_result_t st = chorus_work_wait(*w, -1);
  int64_t t0, t1;
  chorus_work_timestamps(*w, &t0, &t1);
  f->comm_s += chorus_work_duration(*w);
  note_event(f, kind, unit, t0, t1, bytes);
  chorus_work_free(*w);
  *w = NULL;
  return st;
}

static chorus_dtype_t reduce_half(const chorus_fsdp_t *f) {
  return f->cfg.reduce_dtype == CHORUS_BFLOAT16 ? CHORUS_BFLOAT16 : CHORUS_FLOAT32;
}

/* ------------------------------------------------------------- gathers */

static chorus_result_t gather_start(chorus_fsdp_t *f, int v) {
  unit_t *u = &f->u[v];
  const size_t full = (size_t)f->size * u->s;
  u->pbuf = work_alloc(f, full * sizeof(float), 0);
  if (!u->pbuf) return set_error(f, CHORUS_ERR_NO_MEMORY, "gathering the parameters", v);
  chorus_result_t st;
  if (f->cfg.param_dtype == CHORUS_BFLOAT16) {
    u->phalf = work_alloc(f, full * 2, 0);
    u->psend = work_alloc(f, u->s * 2, 0);
    if (!u->phalf || !u->psend)
      return set_error(f, CHORUS_ERR_NO_MEMORY, "gathering the parameters", v);
    chorus_convert(u->psend, CHORUS_BFLOAT16, f->pshard + u->soff, CHORUS_FLOAT32, u->s);
    st = chorus_all_gather(f->comm, u->psend, u->phalf, u->s, CHORUS_BFLOAT16, &u->pwork);
  } else {
    st = chorus_all_gather(f->comm, f->pshard + u->soff, u->pbuf, u->s, CHORUS_FLOAT32,
                           &u->pwork);
  }
  if (st != CHORUS_OK) return set_error(f, st, "all_gather of the parameters", v);
  u->pstate = P_GATHERING;
  return CHORUS_OK;
}

static chorus_result_t gather_wait(chorus_fsdp_t *f, int v) {
  unit_t *u = &f->u[v];
  if (u->pstate == P_FREE) {
    chorus_result_t st = gather_start(f, v);
    if (st != CHORUS_OK) return st;
  }
  if (u->pstate == P_GATHERING) {
    int64_t w0 = now_ns();
    chorus_result_t st = finish_work(f, &u->pwork, CHORUS_FSDP_GATHER, v, u->s * f->size * 4);
    f->exposed_s += (double)(now_ns() - w0) / 1e9;
    if (st != CHORUS_OK) return set_error(f, st, "all_gather of the parameters", v);
    if (u->phalf) {
      const size_t full = (size_t)f->size * u->s;
      chorus_convert(u->pbuf, CHORUS_FLOAT32, u->phalf, CHORUS_BFLOAT16, full);
      work_free(f, u->phalf, full * 2);
      work_free(f, u->psend, u->s * 2);
      u->phalf = u->psend = NULL;
    }
    u->pstate = P_READY;
  }
  rebind(f, v);
  return CHORUS_OK;
}

static void gather_drop(chorus_fsdp_t *f, int v) {
  unit_t *u = &f->u[v];
  if (u->pstate == P_GATHERING) {
    chorus_work_wait(u->pwork, -1); /* the buffers must outlive it */
    chorus_work_free(u->pwork);
    u->pwork = NULL;
  }
  const size_t full = (size_t)f->size * u->s;
  work_free(f, u->pbuf, full * sizeof(float));
  work_free(f, u->phalf, full * 2);
  work_free(f, u->psend, u->s * 2);
  u->pbuf = NULL;
  u->phalf = u->psend = NULL;
  u->pstate = P_FREE;
  rebind(f, v);
}

/* ---------------------------------------------------------- reductions */

static chorus_result_t reduce_finish(chorus_fsdp_t *f, int v) {
  unit_t *u = &f->u[v];
  const int half = reduce_half(f) == CHORUS_BFLOAT16;
  const size_t full = (size_t)f->size * u->s;
  chorus_result_t st =
      f->cfg.stage == 1
          ? finish_work(f, &u->gwork, CHORUS_FSDP_ALL_REDUCE, v, u->count * (half ? 2 : 4))
          : finish_work(f, &u->gwork, CHORUS_FSDP_REDUCE_SCATTER, v, full * (half ? 2 : 4));
  f->reducing--;
  if (f->cfg.stage == 1) {
    if (st == CHORUS_OK && half)
      chorus_convert(f->gflat + u->foff, CHORUS_FLOAT32, u->ghalf, CHORUS_BFLOAT16, u->count);
    u->gstate = G_NONE;
    return st == CHORUS_OK ? CHORUS_OK : set_error(f, st, "gradient all_reduce", v);
  }
  if (st == CHORUS_OK) {
    float *g = f->gshard + u->soff;
    if (half) {
      const uint16_t *h = u->rsout;
      float x[1024];
      for (size_t i = 0; i < u->s; i += 1024) {
        size_t n = u->s - i < 1024 ? u->s - i : 1024;
        chorus_convert(x, CHORUS_FLOAT32, h + i, CHORUS_BFLOAT16, n);
        for (size_t j = 0; j < n; j++) g[i + j] += x[j];
      }
    } else {
      const float *r = u->rsout;
      for (size_t i = 0; i < u->s; i++) g[i] += r[i];
    }
  }
  work_free(f, u->gbuf, full * sizeof(float));
  work_free(f, u->ghalf, half ? full * 2 : 0);
  work_free(f, u->rsout, u->s * (half ? 2 : 4));
  u->gbuf = NULL;
  u->ghalf = NULL;
  u->rsout = NULL;
  u->gstate = G_NONE;
  rebind(f, v);
  return st == CHORUS_OK ? CHORUS_OK : set_error(f, st, "gradient reduce_scatter", v);
}

/* Waits for the oldest reduction in flight. */
static chorus_result_t reduce_oldest(chorus_fsdp_t *f) {
  int best = -1;
  for (int v = 0; v < f->nu; v++)
    if (f->u[v].gstate == G_REDUCING && (best < 0 || f->u[v].gseq < f->u[best].gseq)) best = v;
  return best < 0 ? CHORUS_OK : reduce_finish(f, best);
}

static chorus_result_t reduce_start(chorus_fsdp_t *f, int v) {
  unit_t *u = &f->u[v];
  while (f->cfg.stage >= 2 && f->reducing >= MAX_REDUCING) {
    int64_t w0 = now_ns();
    chorus_result_t st = reduce_oldest(f);
    f->exposed_s += (double)(now_ns() - w0) / 1e9;
    if (st != CHORUS_OK) return st;
  }
  const int half = reduce_half(f) == CHORUS_BFLOAT16;
  chorus_result_t st;
  if (f->cfg.stage == 1) {
    float *g = f->gflat + u->foff;
    u->reduced = 1;
    if (half) {
      chorus_convert(u->ghalf, CHORUS_BFLOAT16, g, CHORUS_FLOAT32, u->count);
      st = chorus_all_reduce(f->comm, u->ghalf, u->ghalf, u->count, CHORUS_BFLOAT16, CHORUS_AVG,
                             &u->gwork);
    } else {
      st = chorus_all_reduce(f->comm, g, g, u->count, CHORUS_FLOAT32, CHORUS_AVG, &u->gwork);
    }
  } else {
    const size_t full = (size_t)f->size * u->s;
    u->rsout = work_alloc(f, u->s * (half ? 2 : 4), 0);
    if (!u->rsout) return set_error(f, CHORUS_ERR_NO_MEMORY, "reducing the gradients", v);
    if (half) {
      u->ghalf = work_alloc(f, full * 2, 0);
      if (!u->ghalf) return set_error(f, CHORUS_ERR_NO_MEMORY, "reducing the gradients", v);
      chorus_convert(u->ghalf, CHORUS_BFLOAT16, u->gbuf, CHORUS_FLOAT32, full);
      st = chorus_reduce_scatter(f->comm, u->ghalf, u->rsout, u->s, CHORUS_BFLOAT16, CHORUS_AVG,
                                 &u->gwork);
    } else {
      st = chorus_reduce_scatter(f->comm, u->gbuf, u->rsout, u->s, CHORUS_FLOAT32, CHORUS_AVG,
                                 &u->gwork);
    }
  }
  if (st != CHORUS_OK)
    return set_error(f, st, f->cfg.stage == 1 ? "gradient all_reduce" : "gradient reduce_scatter",
                     v);
  u->gstate = G_REDUCING;
  u->gseq = f->gseq_next++;
  f->reducing++;
  return CHORUS_OK;
}

/* Finishes the reductions that are done, without waiting. */
static chorus_result_t reduce_poll(chorus_fsdp_t *f) {
  for (int v = 0; v < f->nu; v++)
    if (f->u[v].gstate == G_REDUCING && chorus_work_test(f->u[v].gwork) != CHORUS_INPROGRESS) {
      chorus_result_t st = reduce_finish(f, v);
      if (st != CHORUS_OK) return st;
    }
  return CHORUS_OK;
}

/* ------------------------------------------------------------ schedule */

/* Position of the next use of unit v after position i in this pass; -1
 * when none. */
static int next_use(const chorus_fsdp_t *f, int v, int i) {
  int end = f->train ? f->nsched : f->nu;
  for (int j = i + 1; j < end; j++)
    for (int k = 0; k < f->sched[j].nneeds; k++)
      if (f->sched[j].needs[k] == v) return j;
  return -1;
}

/* Issues the gathers of uses from..from+K that are not held yet, in
 * schedule order. */
static chorus_result_t prefetch(chorus_fsdp_t *f, int from) {
  const int end = f->train ? f->nsched : f->nu;
  chorus_result_t st = CHORUS_OK;
  for (int j = from; j <= from + f->cfg.prefetch && j < end && st == CHORUS_OK; j++)
    for (int k = 0; k < f->sched[j].nneeds && st == CHORUS_OK; k++)
      if (f->u[f->sched[j].needs[k]].pstate == P_FREE) st = gather_start(f, f->sched[j].needs[k]);
  return st;
}

static chorus_result_t on_event(void *arg, chorus_gpt_event_t ev, int unit, int train) {
  chorus_fsdp_t *f = arg;
  if (f->error != CHORUS_OK)
    return chorus__train_fail(f->error, "chorus_fsdp: failed before: %s", f->why);
  const int bwd = ev == CHORUS_GPT_BACKWARD_BEGIN || ev == CHORUS_GPT_BACKWARD_END;
  const int begin = ev == CHORUS_GPT_FORWARD_BEGIN || ev == CHORUS_GPT_BACKWARD_BEGIN;
  const int i = bwd ? f->nu + (f->nu - 1 - unit) : unit;
  const use_t *use = &f->sched[i];
  chorus_result_t st = CHORUS_OK;
  int64_t t = now_ns();
  if (ev == CHORUS_GPT_FORWARD_BEGIN && unit == 0) {
    /* A new pass.  A forward with targets whose backward never came
     * (validation) leaves the backward's first units held: let go of
     * what this pass's window does not need, so the bound holds. */
    f->train = train;
    for (int v = 0; v < f->nu && f->cfg.stage == 3; v++) {
      int want = 0;
      for (int j = 0; j <= f->cfg.prefetch && j < f->nu; j++)
        for (int k = 0; k < f->sched[j].nneeds; k++) want |= f->sched[j].needs[k] == v;
      if (!want && f->u[v].pstate != P_FREE) gather_drop(f, v);
    }
  }
  if (begin) {
    if (f->cfg.stage == 3) {
      st = prefetch(f, i);
      for (int k = 0; k < use->nneeds && st == CHORUS_OK; k++) st = gather_wait(f, use->needs[k]);
    }
    /* A unit still being reduced from an earlier backward (two backward
     * passes without a wait between them) is finished first. */
    for (int k = 0; bwd && k < use->nneeds && st == CHORUS_OK; k++)
      if (f->u[use->needs[k]].gstate == G_REDUCING) st = reduce_finish(f, use->needs[k]);
    if (bwd && f->cfg.stage >= 2)
      for (int k = 0; k < use->nneeds && st == CHORUS_OK; k++) {
        unit_t *u = &f->u[use->needs[k]];
        if (u->gstate != G_NONE) continue;
        u->gbuf = work_alloc(f, (size_t)f->size * u->s * sizeof(float), 1);
        if (!u->gbuf) {
          st = set_error(f, CHORUS_ERR_NO_MEMORY, "holding the gradients", use->needs[k]);
          break;
        }
        u->gstate = G_HELD;
        rebind(f, use->needs[k]);
      }
    if (st == CHORUS_OK && f->cfg.stage >= 2) st = reduce_poll(f);
    if (st == CHORUS_OK) note_event(f, bwd ? CHORUS_FSDP_BACKWARD : CHORUS_FSDP_FORWARD, unit,
                                    t, t, 0);
    return st;
  }
  /* The end of use i: close its compute event. */
  for (int e = f->nev - 1; e >= 0; e--)
    if (f->ev[e].unit == unit && f->ev[e].kind == (bwd ? CHORUS_FSDP_BACKWARD : CHORUS_FSDP_FORWARD)) {
      f->ev[e].end_ns = t;
      break;
    }
  if (bwd) {
    /* The next uses' gathers go out before this unit's reduction, so they
     * are not queued behind it (FSDP's backward prefetch). */
    if (f->cfg.stage == 3) st = prefetch(f, i + 1);
    for (int k = 0; k < use->nneeds && st == CHORUS_OK; k++) {
      int v = use->needs[k];
      if (f->u[v].bwd_last != i) continue; /* more of its gradient comes later */
      if (f->cfg.stage == 1 && (!f->sync || !f->cfg.overlap)) continue;
      if (f->cfg.stage >= 2 && !f->cfg.overlap) continue;
      st = reduce_start(f, v);
    }
  }
  if (f->cfg.stage == 3)
    for (int k = 0; k < use->nneeds; k++) {
      int v = use->needs[k], n = next_use(f, v, i);
      if (n < 0 || n > i + 1 + f->cfg.prefetch) gather_drop(f, v);
    }
  return st;
}

/* -------------------------------------------------------------- create */

/* Every rank must start from the same weights (the same seed) and walk
 * the same schedule (the same configuration and model): otherwise their
 * collectives would differ.  CHORUS_OK, or the error (recorded). */
static chorus_result_t agree(chorus_comm_t comm, chorus_gpt_t *model, uint64_t seed,
                             const chorus_fsdp_config_t c) {
  /* Max and -min of each value in one call. */
  const int64_t vals[8] = {(int64_t)(seed >> 32), (int64_t)(seed & 0xffffffffu), c.stage,
                           c.prefetch, (int64_t)c.param_dtype * 64 + (int64_t)c.reduce_dtype,
                           c.overlap, (int64_t)chorus_gpt_num_params(model),
                           chorus_gpt_num_units(model)};
  int64_t mine[16], agreed[16];
  for (int i = 0; i < 8; i++) mine[2 * i] = vals[i], mine[2 * i + 1] = -vals[i];
  chorus_result_t st =
      chorus_all_reduce(comm, mine, agreed, 16, CHORUS_INT64, CHORUS_MAX, NULL);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_fsdp_create: rank %d: agreeing on the seed: %s",
                              chorus_comm_rank(comm), chorus_comm_last_error(comm));
  if (memcmp(agreed, mine, sizeof mine))
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG,
        "chorus_fsdp_create: rank %d: the ranks differ in %s "
        "(this one: seed %llu, stage %d, prefetch %d, overlap %d, %zu parameters): "
        "every rank must make the same model and sharding",
        chorus_comm_rank(comm),
        memcmp(agreed, mine, 4 * sizeof *mine) ? "the seed" : "the configuration",
        (unsigned long long)seed, c.stage, c.prefetch, c.overlap, chorus_gpt_num_params(model));
  return CHORUS_OK;
}

/* The layout: each unit's slice of the shard and place in the flat
 * buffers, and the schedule of their uses. */
static void lay_out(chorus_fsdp_t *f, chorus_gpt_t *model) {
  const size_t N = (size_t)f->size;
  for (int v = 0; v < f->nu; v++) {
    const chorus_gpt_unit_t *gu = chorus_gpt_unit(model, v);
    unit_t *u = &f->u[v];
    u->count = gu->size;
    u->off = gu->offset;
    u->s = chorus__slice(gu->size, f->size, 0, NULL, NULL);
    u->soff = f->shard;
    u->foff = f->flat;
    f->shard += u->s;
    f->flat += N * u->s;
  }
  /* The schedule: forward 0..U-1, backward U-1..0; the last unit needs 0. */
  for (int i = 0; i < f->nsched; i++) {
    use_t *use = &f->sched[i];
    const int unit = i >= f->nu ? 2 * f->nu - 1 - i : i;
    use->needs[use->nneeds++] = unit;
    if (unit == f->nu - 1) use->needs[use->nneeds++] = 0;
  }
  for (int i = f->nu; i < f->nsched; i++)
    for (int k = 0; k < f->sched[i].nneeds; k++) f->u[f->sched[i].needs[k]].bwd_last = i;
}

/* Storage, and the initial values of what this rank keeps.  0, or -1 (out
 * of memory). */
static int place(chorus_fsdp_t *f, chorus_gpt_t *model, uint64_t seed) {
  const chorus_fsdp_config_t c = f->cfg;
  const int master = c.stage == 3 || c.param_dtype == CHORUS_BFLOAT16;
  if (c.stage <= 2) {
    f->pflat = calloc(f->flat ? f->flat : 1, sizeof(float));
    if (!f->pflat) return -1;
    for (int v = 0; v < f->nu; v++) {
      unit_t *u = &f->u[v];
      chorus_gpt_init_range(model, seed, u->off, u->count, f->pflat + u->foff);
    }
  }
  if (c.stage == 1) {
    f->gflat = calloc(f->flat ? f->flat : 1, sizeof(float));
    if (!f->gflat) return -1;
    if (c.reduce_dtype == CHORUS_BFLOAT16)
      for (int v = 0; v < f->nu; v++)
        if (!(f->u[v].ghalf = malloc(2 * (f->u[v].count ? f->u[v].count : 1)))) return -1;
  } else {
    f->gshard = calloc(f->shard ? f->shard : 1, sizeof(float));
    if (!f->gshard) return -1;
  }
  if (master) {
    f->pshard = calloc(f->shard ? f->shard : 1, sizeof(float));
    if (!f->pshard) return -1;
    for (int v = 0; v < f->nu; v++) {
      unit_t *u = &f->u[v];
      size_t lo = (size_t)f->rank * u->s, hi = lo + u->s < u->count ? lo + u->s : u->count;
      if (lo < hi) chorus_gpt_init_range(model, seed, u->off + lo, hi - lo, f->pshard + u->soff);
    }
  }
  if (c.stage <= 2 && c.param_dtype == CHORUS_BFLOAT16) /* compute on rounded values */
    for (int v = 0; v < f->nu; v++)
      chorus__round_bf16(f->pflat + f->u[v].foff, f->pflat + f->u[v].foff, f->u[v].count);
  for (int v = 0; v < f->nu; v++) rebind(f, v);
  return 0;
}

/* The most the working buffers can hold at once (for --mem-cap): walk
 * the schedule as the hook would.  0, or -1 (out of memory). */
static int bound_work(chorus_fsdp_t *f) {
  const chorus_fsdp_config_t c = f->cfg;
  const size_t N = (size_t)f->size;
  const int K = c.stage == 3 ? f->cfg.prefetch : 0;
  unsigned char *seen = calloc(f->nu > 0 ? (size_t)f->nu : 1, 1);
  if (!seen) return -1;
  size_t biggest = 0;
  for (int v = 0; v < f->nu; v++) biggest = f->u[v].s > biggest ? f->u[v].s : biggest;
  size_t pb = 0;
  if (c.stage == 3) {
    const size_t per = N * (sizeof(float) + (c.param_dtype == CHORUS_BFLOAT16 ? 2 : 0)) + 2;
    for (int i = 0; i < f->nsched; i++) {
      size_t sum = 0;
      memset(seen, 0, (size_t)f->nu);
      for (int j = i; j <= i + K + 1 && j < f->nsched; j++)
        for (int k = 0; k < f->sched[j].nneeds; k++) {
          int v = f->sched[j].needs[k];
          if (seen[v]) continue;
          seen[v] = 1;
          sum += f->u[v].s * per;
        }
      if (sum > pb) pb = sum;
    }
  }
  /* Gradients: unit 0 held through backward, the one computing, and the
   * reductions in flight (each with its output and bf16 copy). */
  size_t gb = 0;
  if (c.stage >= 2) {
    const size_t half = c.reduce_dtype == CHORUS_BFLOAT16;
    const size_t per = N * (sizeof(float) + 2 * half) + (half ? 2 : 4);
    /* Without overlap every unit's gradient waits for chorus_fsdp_wait. */
    gb = c.overlap ? (f->u[0].s + (MAX_REDUCING + 1) * biggest) * per : f->shard * per;
  }
  /* Stages 1-2 with bf16 parameters: sync_params's bf16 copies, all at once. */
  if (c.stage <= 2 && c.param_dtype == CHORUS_BFLOAT16) pb = 2 * (f->flat + f->shard);
  free(seen);
  f->work_bound = pb + gb;
  return 0;
}

chorus_result_t chorus_fsdp_create(chorus_comm_t comm, chorus_gpt_t *model, uint64_t seed,
                                   const chorus_fsdp_config_t *cfg, chorus_fsdp_t **out) {
  static const chorus_fsdp_config_t defaults = CHORUS_FSDP_CONFIG_DEFAULT;
  if (!out) return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_fsdp_create: out is NULL");
  *out = NULL;
  const chorus_fsdp_config_t c = cfg ? *cfg : defaults;
  if (!comm || !model || c.stage < 1 || c.stage > 3 || c.prefetch < 0 ||
      (c.reduce_dtype != CHORUS_FLOAT32 && c.reduce_dtype != CHORUS_BFLOAT16) ||
      (c.param_dtype != CHORUS_FLOAT32 && c.param_dtype != CHORUS_BFLOAT16))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_fsdp_create: bad arguments (stage %d: 1, 2 or "
                              "3; prefetch %d >= 0; dtypes float32 or bfloat16)",
                              c.stage, c.prefetch);
  if (chorus_gpt_params(model))
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG,
        "chorus_fsdp_create: the model holds its own parameters; "
        "make it with chorus_gpt_create_ex(..., CHORUS_GPT_EXTERNAL, ...) so that the "
        "runtime places them");
  chorus_result_t st = agree(comm, model, seed, c);
  if (st != CHORUS_OK) return st;
  chorus_fsdp_t *f = calloc(1, sizeof *f);
  if (!f) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_fsdp_create: out of memory");
  f->comm = comm;
  f->model = model;
  f->cfg = c;
  f->rank = chorus_comm_rank(comm);
  f->size = chorus_comm_size(comm);
  f->nu = chorus_gpt_num_units(model);
  if (f->cfg.prefetch > 2 * f->nu) f->cfg.prefetch = 2 * f->nu; /* the whole schedule */
  f->sync = 1;
  f->u = calloc((size_t)f->nu, sizeof *f->u);
  f->nsched = 2 * f->nu;
  f->sched = calloc((size_t)f->nsched, sizeof *f->sched);
  f->ev = calloc(MAX_EVENTS, sizeof *f->ev);
  if (!f->u || !f->sched || !f->ev) goto oom;
  lay_out(f, model);
  if (place(f, model, seed) != 0) goto oom;
  if (bound_work(f) != 0) goto oom;
  chorus_gpt_set_unit_hook(model, on_event, f);
  *out = f;
  return CHORUS_OK;
oom:
  /* The others went on after the agreement: fail them at once. */
  chorus_fsdp_destroy(f);
  chorus_comm_abort(comm);
  return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                            "chorus_fsdp_create: rank %d: out of memory (the "
                            "communicator is aborted)",
                            chorus_comm_rank(comm));
}

void chorus_fsdp_destroy(chorus_fsdp_t *f) {
  if (!f) return;
  if (f->model) chorus_gpt_set_unit_hook(f->model, NULL, NULL);
  for (int v = 0; f->u && v < f->nu; v++) {
    unit_t *u = &f->u[v];
    if (u->pwork) chorus_work_wait(u->pwork, -1), chorus_work_free(u->pwork);
    if (u->gwork) chorus_work_wait(u->gwork, -1), chorus_work_free(u->gwork);
    free(u->pbuf), free(u->phalf), free(u->psend), free(u->gbuf), free(u->ghalf), free(u->rsout);
    if (f->model) chorus_gpt_bind_unit(f->model, v, NULL, NULL);
  }
  free(f->u);
  free(f->sched);
  free(f->ev);
  free(f->pflat), free(f->gflat), free(f->pshard), free(f->gshard);
  free(f);
}

/* ---------------------------------------------------------------- step */

size_t chorus_fsdp_shard_size(const chorus_fsdp_t *f) { return f->shard; }
int chorus_fsdp_num_slices(const chorus_fsdp_t *f) { return f->nu; }

void chorus_fsdp_slice(chorus_fsdp_t *f, int i, float **params, float **grads, size_t *n,
                       size_t *state_off) {
  const unit_t *u = &f->u[i];
  const size_t mine = (size_t)f->rank * u->s;
  *params = f->pshard ? f->pshard + u->soff : f->pflat + u->foff + mine;
  *grads = f->gshard ? f->gshard + u->soff : f->gflat + u->foff + mine;
  *n = u->s;
  *state_off = u->soff;
}

void chorus_fsdp_set_sync(chorus_fsdp_t *f, int sync) { f->sync = sync != 0; }

void chorus_fsdp_zero_grad(chorus_fsdp_t *f) {
  if (f->gflat) memset(f->gflat, 0, f->flat * sizeof(float));
  if (f->gshard) memset(f->gshard, 0, f->shard * sizeof(float));
  f->nev = 0;
  f->comm_s = f->exposed_s = 0;
}

chorus_result_t chorus_fsdp_wait(chorus_fsdp_t *f) {
  if (f->error != CHORUS_OK) return chorus__train_fail(f->error, "chorus_fsdp: %s", f->why);
  int64_t w0 = now_ns();
  chorus_result_t st = CHORUS_OK;
  /* What did not start during backward starts now, in backward's order. */
  for (int i = f->nu; i < f->nsched && st == CHORUS_OK; i++)
    for (int k = 0; k < f->sched[i].nneeds && st == CHORUS_OK; k++) {
      int v = f->sched[i].needs[k];
      unit_t *u = &f->u[v];
      if (u->bwd_last != i) continue;
      if (f->cfg.stage == 1 ? f->sync && !u->reduced : u->gstate == G_HELD)
        st = reduce_start(f, v);
    }
  while (st == CHORUS_OK && f->reducing > 0) st = reduce_oldest(f);
  /* No gather may still read the shard when the optimizer writes it. */
  for (int v = 0; v < f->nu && st == CHORUS_OK; v++)
    if (f->u[v].pstate == P_GATHERING) st = gather_wait(f, v);
  for (int v = 0; v < f->nu; v++) f->u[v].reduced = 0;
  f->exposed_s += (double)(now_ns() - w0) / 1e9;
  return st;
}

chorus_result_t chorus_fsdp_sync_params(chorus_fsdp_t *f) {
  if (f->error != CHORUS_OK) return chorus__train_fail(f->error, "chorus_fsdp: %s", f->why);
  if (f->cfg.stage == 3) { /* every gathered copy is stale now */
    for (int v = 0; v < f->nu; v++)
      if (f->u[v].pstate != P_FREE) gather_drop(f, v);
    return CHORUS_OK;
  }
  /* Stages 1-2: every unit's slices go to every rank, all in flight at
   * once (fp32: in place in the flat buffer). */
  const int half = f->cfg.param_dtype == CHORUS_BFLOAT16;
  chorus_result_t st = CHORUS_OK;
  for (int v = 0; v < f->nu && st == CHORUS_OK; v++) {
    unit_t *u = &f->u[v];
    float *full = f->pflat + u->foff;
    if (!half) {
      st = chorus_all_gather(f->comm, full + (size_t)f->rank * u->s, full, u->s, CHORUS_FLOAT32,
                             &u->pwork);
    } else {
      u->phalf = work_alloc(f, (size_t)f->size * u->s * 2, 0);
      u->psend = work_alloc(f, u->s * 2, 0);
      if (!u->phalf || !u->psend) {
        st = CHORUS_ERR_NO_MEMORY;
        break;
      }
      chorus_convert(u->psend, CHORUS_BFLOAT16, f->pshard + u->soff, CHORUS_FLOAT32, u->s);
      st = chorus_all_gather(f->comm, u->psend, u->phalf, u->s, CHORUS_BFLOAT16, &u->pwork);
    }
    if (st != CHORUS_OK) break;
  }
  chorus_result_t first = st;
  int bad = -1;
  for (int v = 0; v < f->nu; v++) {
    unit_t *u = &f->u[v];
    if (u->pwork) {
      chorus_result_t w = finish_work(f, &u->pwork, CHORUS_FSDP_GATHER, v,
                                      (size_t)f->size * u->s * (half ? 2 : 4));
      if (w != CHORUS_OK && first == CHORUS_OK) first = w, bad = v;
      if (w == CHORUS_OK && half)
        chorus_convert(f->pflat + u->foff, CHORUS_FLOAT32, u->phalf, CHORUS_BFLOAT16, u->count);
    }
    work_free(f, u->phalf, (size_t)f->size * u->s * 2);
    work_free(f, u->psend, u->s * 2);
    u->phalf = u->psend = NULL;
  }
  return first == CHORUS_OK ? CHORUS_OK
                            : set_error(f, first, "all_gather of the updated parameters",
                                        bad < 0 ? 0 : bad);
}

chorus_result_t chorus_fsdp_full_params(chorus_fsdp_t *f, float *dst, int root) {
  if (f->error != CHORUS_OK) return chorus__train_fail(f->error, "chorus_fsdp: %s", f->why);
  const int me = f->rank == root;
  size_t biggest = 0;
  for (int v = 0; v < f->nu; v++) biggest = f->u[v].s > biggest ? f->u[v].s : biggest;
  float *tmp = me ? malloc((size_t)f->size * biggest * sizeof(float) + 1) : NULL;
  if (me && !tmp) return set_error(f, CHORUS_ERR_NO_MEMORY, "gathering the full parameters", 0);
  chorus_result_t st = CHORUS_OK;
  for (int v = 0; v < f->nu && st == CHORUS_OK; v++) {
    const unit_t *u = &f->u[v];
    const float *slice = f->pshard ? f->pshard + u->soff
                                   : f->pflat + u->foff + (size_t)f->rank * u->s;
    st = chorus_gather(f->comm, slice, tmp, u->s, CHORUS_FLOAT32, root, NULL);
    if (st == CHORUS_OK && me) memcpy(dst + u->off, tmp, u->count * sizeof(float));
  }
  free(tmp);
  return st == CHORUS_OK ? CHORUS_OK : set_error(f, st, "gathering the full parameters", 0);
}

void chorus_fsdp_get_stats(const chorus_fsdp_t *f, chorus_fsdp_stats_t *s) {
  memset(s, 0, sizeof *s);
  s->stage = f->cfg.stage;
  s->shard_floats = f->shard;
  s->comm_s = f->comm_s;
  s->exposed_s = f->exposed_s;
  s->param_bytes = (f->pflat ? f->flat * sizeof(float) : 0) +
                   (f->pshard ? f->shard * sizeof(float) : 0);
  s->grad_bytes = f->gflat ? f->flat * sizeof(float) : f->shard * sizeof(float);
  if (f->cfg.stage == 1 && f->cfg.reduce_dtype == CHORUS_BFLOAT16)
    for (int v = 0; v < f->nu; v++) s->grad_bytes += f->u[v].count * 2;
  s->work_bytes = f->work_bytes;
  s->work_peak = f->work_peak;
  s->work_bound = f->work_bound;
  s->events = f->nev;
}

const chorus_fsdp_event_t *chorus_fsdp_event(const chorus_fsdp_t *f, int i) {
  return i >= 0 && i < f->nev ? &f->ev[i] : NULL;
}
