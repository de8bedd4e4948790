/*
 * ddp.c - the DDP reducer: buckets of gradient tensors reduced
 * asynchronously while backward runs (see chorus_train.h).
 *
 * Buckets are built once, walking the tensors from the last to the first
 * (backward's order) and closing a bucket when adding the next tensor would
 * pass the cap (the first bucket has a smaller cap).  Because the layout is
 * contiguous, bucket b covers tensors [lo_b, hi_b] and the float range
 * [offset(lo_b), offset(hi_b) + size(hi_b)).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/runtime.h"

typedef struct {
  int lo, hi;           /* tensor indices, lo <= hi */
  size_t off, count;    /* float range in the gradient buffer */
  int pending;          /* tensors not ready yet this step */
  int launched;
  chorus_work_t work;
  uint16_t *half;       /* compressed copy for the bf16/fp16 hooks */
  int64_t t0, t1;       /* when its last all_reduce ran */
} bucket_t;

/* A registered buffer: state every rank keeps but rank 0 owns. */
typedef struct {
  void *data;
  size_t bytes;
} buffer_t;

struct chorus_ddp {
  chorus_comm_t comm;
  chorus_gpt_t *model;
  chorus_ddp_config_t cfg;
  int nb;
  bucket_t *b;
  int *bucket_of; /* tensor -> bucket */
  int sync;
  int next; /* buckets are launched in index order: the next one to go */
  chorus_result_t error;
  double comm_s, exposed_s;
  buffer_t *bufs;
  int nbufs;
  unsigned char *stage; /* the buffers packed for one broadcast */
  size_t stage_bytes;
};

/* gpt.c's error recorder (one per thread). */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void launch(chorus_ddp_t *d, bucket_t *bk) {
  if (bk->launched || d->error != CHORUS_OK) return;
  if (chorus_comm_size(d->comm) == 1) { /* nothing to average */
    bk->launched = 1;
    return;
  }
  float *g = chorus_gpt_grads(d->model) + bk->off;
  chorus_result_t st;
  if (d->cfg.hook == CHORUS_DDP_HOOK_NONE) {
    st = chorus_all_reduce(d->comm, g, g, bk->count, CHORUS_FLOAT32, CHORUS_AVG, &bk->work);
  } else {
    chorus_dtype_t half = d->cfg.hook == CHORUS_DDP_HOOK_BF16 ? CHORUS_BFLOAT16 : CHORUS_FLOAT16;
    chorus_convert(bk->half, half, g, CHORUS_FLOAT32, bk->count);
    st = chorus_all_reduce(d->comm, bk->half, bk->half, bk->count, half, CHORUS_AVG, &bk->work);
  }
  bk->launched = 1;
  if (st != CHORUS_OK) d->error = st;
}

chorus_result_t chorus_ddp_create(chorus_comm_t comm, chorus_gpt_t *model,
                                  const chorus_ddp_config_t *cfg, chorus_ddp_t **out) {
  static const chorus_ddp_config_t defaults = CHORUS_DDP_CONFIG_DEFAULT;
  *out = NULL;
  if (!comm || !model) return CHORUS_ERR_INVALID_ARG;
  chorus_ddp_t *d = calloc(1, sizeof *d);
  if (!d) return CHORUS_ERR_NO_MEMORY;
  d->comm = comm;
  d->model = model;
  d->cfg = cfg ? *cfg : defaults;
  d->sync = 1;
  int nt = chorus_gpt_num_tensors(model);
  d->b = calloc((size_t)nt, sizeof *d->b);
  d->bucket_of = calloc((size_t)nt, sizeof(int));
  if (!d->b || !d->bucket_of) {
    chorus_ddp_destroy(d);
    return CHORUS_ERR_NO_MEMORY;
  }
  /* Buckets from the last tensor to the first. */
  size_t cap = (size_t)(d->cfg.first_bucket_mb * 1048576.0 / sizeof(float));
  for (int k = nt - 1; k >= 0;) {
    bucket_t *bk = &d->b[d->nb];
    bk->hi = k;
    size_t count = 0;
    while (k >= 0) {
      size_t sz = chorus_gpt_tensor(model, k)->size;
      if (count && count + sz > cap) break;
      count += sz;
      d->bucket_of[k] = d->nb;
      k--;
    }
    bk->lo = k + 1;
    bk->off = chorus_gpt_tensor(model, bk->lo)->offset;
    bk->count = count;
    if (d->cfg.hook != CHORUS_DDP_HOOK_NONE) {
      bk->half = malloc(sizeof(uint16_t) * (count ? count : 1));
      if (!bk->half) {
        chorus_ddp_destroy(d);
        return CHORUS_ERR_NO_MEMORY;
      }
    }
    d->nb++;
    cap = (size_t)(d->cfg.bucket_mb * 1048576.0 / sizeof(float));
    if (cap < 1) cap = 1;
  }
  for (int i = 0; i < d->nb; i++) d->b[i].pending = d->b[i].hi - d->b[i].lo + 1;
  /* Everyone starts from rank 0's weights. */
  chorus_result_t st = chorus_broadcast(comm, chorus_gpt_params(model),
                                        chorus_gpt_num_params(model), CHORUS_FLOAT32, 0, NULL);
  if (st != CHORUS_OK) {
    chorus_ddp_destroy(d);
    return st;
  }
  *out = d;
  return CHORUS_OK;
}

void chorus_ddp_destroy(chorus_ddp_t *d) {
  if (!d) return;
  if (d->b) {
    for (int i = 0; i < d->nb; i++) {
      if (d->b[i].work) {
        chorus_work_wait(d->b[i].work, -1);
        chorus_work_free(d->b[i].work);
      }
      free(d->b[i].half);
    }
  }
  free(d->b);
  free(d->bucket_of);
  free(d->bufs);
  free(d->stage);
  free(d);
}

chorus_result_t chorus_ddp_add_buffer(chorus_ddp_t *d, void *data, size_t count,
                                      chorus_dtype_t dtype) {
  size_t esz = chorus_dtype_size(dtype);
  if (!d || (!data && count) || !esz || count > SIZE_MAX / esz)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ddp_add_buffer: bad arguments (data %p, count %zu, dtype %d)",
                              data, count, (int)dtype);
  buffer_t *nb = realloc(d->bufs, sizeof *nb * (size_t)(d->nbufs + 1));
  if (!nb) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ddp_add_buffer: out of memory");
  d->bufs = nb;
  d->bufs[d->nbufs++] = (buffer_t){data, count * esz};
  return CHORUS_OK;
}

/* One broadcast for all the buffers (PyTorch coalesces them the same way):
 * in place when there is one, else packed into a staging area.  Ranks
 * that registered different buffers send different byte counts: the
 * collective reports a mismatch, and every rank fails by its next call. */
chorus_result_t chorus_ddp_broadcast_buffers(chorus_ddp_t *d) {
  if (d->nbufs == 0 || chorus_comm_size(d->comm) == 1) return CHORUS_OK;
  if (d->nbufs == 1)
    return chorus_broadcast(d->comm, d->bufs[0].data, d->bufs[0].bytes, CHORUS_UINT8, 0, NULL);
  size_t total = 0;
  for (int i = 0; i < d->nbufs; i++) total += d->bufs[i].bytes;
  if (total > d->stage_bytes) {
    unsigned char *st = realloc(d->stage, total);
    if (!st)
      return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                "chorus_ddp_broadcast_buffers: out of memory (%zu bytes)", total);
    d->stage = st;
    d->stage_bytes = total;
  }
  const int root = chorus_comm_rank(d->comm) == 0;
  size_t off = 0;
  for (int i = 0; i < d->nbufs && root; off += d->bufs[i].bytes, i++)
    if (d->bufs[i].bytes) memcpy(d->stage + off, d->bufs[i].data, d->bufs[i].bytes);
  chorus_result_t st = chorus_broadcast(d->comm, d->stage, total, CHORUS_UINT8, 0, NULL);
  if (st != CHORUS_OK || root) return st;
  off = 0;
  for (int i = 0; i < d->nbufs; off += d->bufs[i].bytes, i++)
    if (d->bufs[i].bytes) memcpy(d->bufs[i].data, d->stage + off, d->bufs[i].bytes);
  return CHORUS_OK;
}

/* Buckets go out strictly in index order (backward's order), like
 * PyTorch's reducer: collectives of one communicator must be issued in the
 * same order on every rank, and ranks whose tensors become ready in a
 * different order (a skipped block, say) must not swap two all_reduces. */
void chorus_ddp_ready(void *arg, int tensor) {
  chorus_ddp_t *d = arg;
  bucket_t *bk = &d->b[d->bucket_of[tensor]];
  --bk->pending;
  if (!d->sync || !d->cfg.overlap) return;
  while (d->next < d->nb && d->b[d->next].pending == 0) launch(d, &d->b[d->next++]);
}

chorus_result_t chorus_ddp_wait(chorus_ddp_t *d) {
  chorus_result_t st = d->error;
  double t0 = now_s();
  d->comm_s = 0;
  for (int i = 0; i < d->nb; i++) {
    bucket_t *bk = &d->b[i];
    bk->pending = bk->hi - bk->lo + 1; /* ready for the next step */
    bk->t0 = bk->t1 = 0;
    if (!d->sync) continue;
    launch(d, bk); /* in order; a no-op when already launched */
  }
  d->next = 0;
  for (int i = 0; i < d->nb && d->sync; i++) {
    bucket_t *bk = &d->b[i];
    if (bk->work) {
      chorus_result_t w = chorus_work_wait(bk->work, -1);
      if (st == CHORUS_OK) st = w;
      d->comm_s += chorus_work_duration(bk->work);
      chorus_work_timestamps(bk->work, &bk->t0, &bk->t1);
      chorus_work_free(bk->work);
      bk->work = NULL;
      if (w == CHORUS_OK && bk->half)
        chorus_convert(chorus_gpt_grads(d->model) + bk->off, CHORUS_FLOAT32, bk->half,
                       d->cfg.hook == CHORUS_DDP_HOOK_BF16 ? CHORUS_BFLOAT16 : CHORUS_FLOAT16,
                       bk->count);
    }
    bk->launched = 0;
  }
  d->exposed_s = now_s() - t0;
  if (st != CHORUS_OK) d->error = st;
  return st;
}

void chorus_ddp_set_sync(chorus_ddp_t *d, int sync) { d->sync = sync != 0; }

void chorus_ddp_get_stats(const chorus_ddp_t *d, chorus_ddp_stats_t *s) {
  s->buckets = d->nb;
  s->comm_s = d->comm_s;
  s->exposed_s = d->exposed_s;
}

void chorus_ddp_bucket_times(const chorus_ddp_t *d, int i, int64_t *start_ns, int64_t *end_ns,
                             size_t *bytes) {
  const bucket_t *bk = i >= 0 && i < d->nb ? &d->b[i] : NULL;
  if (start_ns) *start_ns = bk ? bk->t0 : 0;
  if (end_ns) *end_ns = bk ? bk->t1 : 0;
  if (bytes) *bytes = bk ? bk->count * sizeof(float) : 0;
}
