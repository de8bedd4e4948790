/*
 * ps_train.c - a parameter-server worker's loop (chorus_ps_train, see
 * chorus_train.h): compute a gradient, hand each server its slice as the
 * backward finishes it, push, go on from the parameters that come back.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/runtime.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The last backward: which tensors are final, and from where on the
 * layout is (its tail completes first: backward runs from the head). */
typedef struct {
  chorus_ps_t *ps;
  chorus_gpt_t *m;
  const float *grads;
  float loss;
  uint32_t tokens;
  unsigned char *done;
  int ntensors, front; /* tensors front .. ntensors - 1 are final */
} ready_t;

static void push_ready(void *arg, int i) {
  ready_t *r = arg;
  if (i < 0 || i >= r->ntensors) return;
  r->done[i] = 1;
  int f = r->front;
  while (f > 0 && r->done[f - 1]) f--;
  if (f == r->front) return;
  r->front = f;
  chorus_ps_push_early(r->ps, r->grads, r->loss, r->tokens, chorus_gpt_tensor(r->m, f)->offset);
}

chorus_result_t chorus_ps_train(chorus_ps_t *ps, const chorus_gpt_config_t *model,
                                const chorus_tokens_t *data, const chorus_ps_train_config_t *cfg,
                                chorus_ps_train_stats_t *out) {
  if (!ps || !model || !data || !cfg || !out || cfg->seq < 1 || cfg->batch < 1 ||
      cfg->accum < 1)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_train: bad arguments");
  memset(out, 0, sizeof *out);
  const int W = chorus_ps_workers(ps), me = chorus_ps_worker(ps);
  if (me < 0)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_train: this rank is a server");
  const int T = cfg->seq, B = cfg->batch, A = cfg->accum;
  const uint32_t ntok = (uint32_t)(B * T * A);
  chorus_gpt_t *m = NULL;
  chorus_loader_t *ld = NULL;
  chorus_loader_config_t lc = {T, B, cfg->workers, cfg->prefetch, 1, 0, cfg->seed,
                               cfg->read_delay_s, 0};
  chorus_result_t st = chorus_gpt_create(model, B, cfg->seed, &m);
  if (st == CHORUS_OK) st = chorus_loader_create(data, &lc, W, me, &ld);
  int *tok = malloc(sizeof(int) * (size_t)B * T), *tgt = malloc(sizeof(int) * (size_t)B * T);
  size_t *idx = malloc(sizeof(size_t) * (size_t)B);
  const int nt = m ? chorus_gpt_num_tensors(m) : 0;
  unsigned char *done = calloc((size_t)nt + 1, 1);
  if (st == CHORUS_OK && (!tok || !tgt || !idx || !done))
    st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_train: out of memory");
  float *params = m ? chorus_gpt_params(m) : NULL, *grads = m ? chorus_gpt_grads(m) : NULL;
  long step = 0;
  if (st == CHORUS_OK) st = chorus_ps_pull(ps, params, &step);
  /* A resumed worker goes on in its data where it was: its own count of
   * samples taken, over whole epochs of its list. */
  if (st == CHORUS_OK && step > 0) {
    size_t mine = (size_t)step * (size_t)A * (size_t)B, len = chorus_loader_len(ld);
    st = chorus_loader_seek(ld, (long)(mine / len), mine % len * (size_t)W);
  }
  double ssum = 0, loss_sum = 0;
  const double t_start = now_s();
  for (; st == CHORUS_OK; step++) {
    if (cfg->before_step) cfg->before_step(cfg->arg, ps, step);
    const double t0 = now_s();
    chorus_gpt_zero_grad(m);
    float loss = 0;
    for (int a = 0; a < A && st == CHORUS_OK; a++) {
      float l = 0;
      st = chorus_loader_next(ld, tok, tgt, idx, NULL);
      if (st == CHORUS_OK) st = chorus_gpt_forward(m, tok, tgt, B, T, &l);
      loss += l / (float)A;
      /* The last micro-step's backward hands the servers their slices as
       * they become final. */
      const int last = a == A - 1;
      ready_t rd = {ps, m, grads, loss, ntok, done, nt, nt};
      if (last) memset(done, 0, (size_t)nt);
      if (st == CHORUS_OK)
        st = chorus_gpt_backward(m, 1.0f / (float)A, last ? push_ready : NULL, &rd);
    }
    if (st != CHORUS_OK) break;
    if (cfg->after_compute) cfg->after_compute(cfg->arg, now_s() - t0);
    const double t2 = now_s();
    chorus_ps_reply_t rep;
    if ((st = chorus_ps_push(ps, grads, loss, ntok, params, &rep)) != CHORUS_OK) break;
    out->compute_s += t2 - t0, out->wait_s += now_s() - t2;
    if (rep.refused) {
      out->refused++;
      if (cfg->log) {
        char line[512];
        snprintf(line, sizeof line, "worker %d: %s; going on from the fresh parameters", me,
                 rep.why);
        cfg->log(cfg->arg, line);
      }
    } else if (!rep.unused) {
      out->steps++;
      loss_sum += loss;
      ssum += (double)rep.staleness;
      if (rep.staleness > out->staleness_max) out->staleness_max = rep.staleness;
    }
    if (rep.stop) break;
  }
  out->seconds = now_s() - t_start;
  out->tokens = (double)out->steps * ntok;
  out->staleness_mean = out->steps ? ssum / (double)out->steps : 0.0;
  out->mean_loss = out->steps ? loss_sum / (double)out->steps : NAN;
  free(tok), free(tgt), free(idx), free(done);
  chorus_loader_destroy(ld);
  chorus_gpt_destroy(m);
  return st;
}
