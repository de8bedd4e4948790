/*
 * ps_worker.c - a parameter-server worker: its side of the pairs with the
 * server processes (the hello and pull, the push of each range's slice and
 * the answers, a dead server's ranges followed to their copies), and its
 * loop (chorus_ps_train, see chorus_train.h): compute a gradient, hand
 * each server its slice as the backward finishes it, push, go on from the
 * parameters that come back.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/ps_internal.h"
#include "train/runtime.h"

/* -------------------------------------------------------------- worker */

/* A worker that fails tells every server at once (they drop it). */
static void abort_pairs(chorus_ps_t *ps) {
  for (int p = 0; p < ps->nproc; p++) chorus_comm_abort(ps->pair[p]);
}

/* A pair with a server process failed: it died, hung, or aborted. */
static chorus_result_t server_gone(chorus_ps_t *ps, int p, chorus_result_t st, const char *more) {
  char why[600];
  chorus__ps_pair_error(ps->pair[p], why, sizeof why);
  return chorus__train_fail(
      st, "async: worker %d (rank %d): server %d (rank %d) is gone or failed: %s; %s", ps->me,
      ps->rank, p, p, why, more);
}

/* Sends range r's slice (src: count floats) to its server, asynchronously. */
static chorus_result_t send_slice(chorus_ps_t *ps, int r, const float *src, uint64_t count,
                                  int64_t version, float loss, uint32_t tokens) {
  msg_t *h = &ps->hd[r];
  const int p = ps->owner[r];
  memset(h, 0, sizeof *h);
  h->magic = PS_MAGIC;
  h->kind = M_PUSH;
  h->range = r;
  h->version = version;
  h->count = count;
  h->loss = loss;
  h->tokens = tokens;
  h->step = ps->wstep;
  ps->sent[r] = 1;
  chorus_result_t st =
      chorus_send(ps->pair[p], h, sizeof *h, CHORUS_UINT8, 0, TAG_HDR, &ps->wk[2 * r]);
  if (st == CHORUS_OK)
    st = chorus_send(ps->pair[p], src, count, CHORUS_FLOAT32, 0, TAG_DATA, &ps->wk[2 * r + 1]);
  return st;
}

/* Server process p is gone: each range it served goes to the process
 * keeping its copy, and a gradient it did not answer is sent there.
 * CHORUS_OK, or the error when a range has no copy left. */
static chorus_result_t lost_server(chorus_ps_t *ps, int p, chorus_result_t why_st,
                                   const float *grads, float loss, uint32_t tokens) {
  char why[600];
  chorus__ps_pair_error(ps->pair[p], why, sizeof why);
  ps->pdead[p] = 1;
  if (!ps->lost_at) ps->lost_at = chorus__ps_now_ns();
  chorus_comm_abort(ps->pair[p]);
  for (int r = 0; r < ps->nrange; r++) {
    if (ps->owner[r] != p) continue;
    const int q = ps->mholder[r];
    if (q < 0 || ps->pdead[q])
      return chorus__train_fail(
          why_st,
          "async: worker %d (rank %d): server %d (rank %d) is gone or failed: "
          "%s; range %d's parameters are lost with it (%s), so the job fails (a "
          "restart resumes from the servers' last checkpoint)",
          ps->me, ps->rank, p, p, why, r,
          q < 0 ? "it had no copy" : "its copy's process is gone too");
    ps->owner[r] = q;
    ps->mholder[r] = -1;
    chorus__ps_say(
        ps,
        "async: worker %d: server %d is gone (%s); range %d goes to server %d, which kept "
        "its copy",
        ps->me, p, why, r, q);
    if (!ps->pending[r]) continue;
    /* The gradient goes again to the new server (it knows whether it is
     * in already). */
    for (int i = 2 * r; i < 2 * r + 2; i++) {
      if (ps->wk[i]) chorus_work_wait(ps->wk[i], -1);
      chorus_work_free(ps->wk[i]);
      ps->wk[i] = NULL;
    }
    chorus_result_t st = send_slice(ps, r, grads + ps->lo[r], ps->cnt[r], ps->ver[r], loss, tokens);
    if (st != CHORUS_OK) return lost_server(ps, q, st, grads, loss, tokens);
  }
  return CHORUS_OK;
}

/* Receives one answer from server process p: a range's parameters into
 * params, per its header.  CHORUS_INPROGRESS when p is gone (the caller
 * moves its ranges), else the result. */
static chorus_result_t answer(chorus_ps_t *ps, int p, float *params, chorus_ps_reply_t *rep,
                              long *start, int *range) {
  chorus_comm_t c = ps->pair[p];
  msg_t h;
  *range = -1;
  chorus_result_t st = chorus_recv(c, &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
  if (st != CHORUS_OK) return CHORUS_INPROGRESS;
  h.text[sizeof h.text - 1] = '\0';
  if (h.magic == PS_MAGIC && h.kind == M_FATAL) {
    chorus_comm_abort(c);
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "async: worker %d (rank %d): server %d refused it: %s", ps->me,
                              ps->rank, p, h.text);
  }
  const int known = h.kind == M_PARAMS || h.kind == M_REFUSED || h.kind == M_STOP;
  const int data = h.kind == M_PARAMS || h.kind == M_REFUSED;
  const int r = h.range;
  if (h.magic != PS_MAGIC || !known || r < 0 || r >= ps->nrange || ps->owner[r] != p ||
      !ps->pending[r] || h.version < ps->ver[r] || h.staleness < 0 ||
      h.mirror < -1 || h.mirror >= ps->nproc || h.mirror == p ||
      h.count != (data ? ps->cnt[r] : 0) || (!start && h.step != 0 && h.step != 1) ||
      (start && (h.step < 0 || h.step > ps->cfg.steps * (long)ps->nwork))) {
    /* (a fast worker may have done more than steps of the budget's
     * steps * workers gradients) */
    chorus_comm_abort(c);
    return chorus__train_fail(CHORUS_ERR_PROTOCOL,
                              "async: worker %d: server %d sent a malformed answer (kind "
                              "%u, range %d, version %lld after %lld, %llu floats, step %lld)",
                              ps->me, p, h.kind, r, (long long)h.version,
                              (long long)(r >= 0 && r < ps->nrange ? ps->ver[r] : 0),
                              (unsigned long long)h.count, (long long)h.step);
  }
  *range = r;
  if (h.kind == M_STOP) {
    ps->pending[r] = 0;
    if (rep) {
      rep->stop = 1;
      if (h.step == 1 && h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
      if (h.step != 1) rep->unused = 1;
    }
    return CHORUS_OK;
  }
  if ((st = chorus_recv(c, params + ps->lo[r], ps->cnt[r], CHORUS_FLOAT32, 0, TAG_DATA, NULL)) !=
      CHORUS_OK)
    return CHORUS_INPROGRESS;
  ps->pending[r] = 0;
  ps->ver[r] = h.version;
  ps->mholder[r] = h.mirror;
  if (start && r == 0) *start = (long)h.step;
  if (rep) {
    if (h.staleness > rep->staleness) rep->staleness = (long)h.staleness;
    if (r == 0) rep->version = (long)h.version;
    if (h.kind == M_REFUSED) {
      rep->refused = 1;
      snprintf(rep->why, sizeof rep->why, "%s", h.text);
    }
  }
  return CHORUS_OK;
}

chorus_result_t chorus_ps_pull(chorus_ps_t *ps, float *params, long *start_step) {
  if (!ps || ps->server || !params)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_pull: not a worker, or no buffer");
  long start = 0;
  chorus_result_t st = CHORUS_OK;
  /* A hello to every process serving a range; one answer per range. */
  for (int p = 0; p < ps->nproc && st == CHORUS_OK; p++) {
    int serves = 0;
    for (int r = 0; r < ps->nrange; r++) serves |= ps->owner[r] == p;
    if (!serves) continue;
    msg_t h;
    memset(&h, 0, sizeof h);
    h.magic = PS_MAGIC;
    h.kind = M_HELLO;
    st = chorus_send(ps->pair[p], &h, sizeof h, CHORUS_UINT8, 0, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      server_gone(ps, p, st, "the job fails before it started");
      abort_pairs(ps);
      return st;
    }
  }
  for (int r = 0; r < ps->nrange; r++) ps->pending[r] = 1;
  for (int r = 0; r < ps->nrange && st == CHORUS_OK; r++) {
    if (!ps->pending[r]) continue;
    const int p = ps->owner[r];
    chorus_ps_reply_t rep;
    memset(&rep, 0, sizeof rep);
    int got;
    st = answer(ps, p, params, &rep, &start, &got);
    if (st == CHORUS_INPROGRESS)
      st = server_gone(ps, p, CHORUS_ERR_REMOTE, "the job fails before it started");
    else if (st == CHORUS_OK && rep.stop)
      st = chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "async: worker %d: the budget is already applied", ps->me);
    if (st == CHORUS_OK && got != r) r--; /* another range of p answered first */
  }
  if (st != CHORUS_OK) abort_pairs(ps);
  if (start_step) *start_step = start;
  ps->wstep = start;
  return st;
}

chorus_result_t chorus_ps_push_early(chorus_ps_t *ps, const float *grads, float loss,
                                     uint32_t tokens, size_t final_from) {
  if (!ps || ps->server || !grads)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ps_push_early: not a worker, or no buffer");
  if (ps->fault) return CHORUS_OK; /* testing faults: all at once */
  /* A failed send is taken up by chorus_ps_push (the server may be gone). */
  for (int r = 0; r < ps->nrange; r++)
    if (!ps->sent[r] && ps->lo[r] >= final_from)
      send_slice(ps, r, grads + ps->lo[r], ps->cnt[r], ps->ver[r], loss, tokens);
  return CHORUS_OK;
}

chorus_result_t chorus_ps_push(chorus_ps_t *ps, const float *grads, float loss, uint32_t tokens,
                               float *params, chorus_ps_reply_t *rep) {
  if (!ps || ps->server || !grads || !params || !rep)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_push: not a worker, or no buffer");
  memset(rep, 0, sizeof *rep);
  const int S = ps->nrange;
  float *extra = NULL;
  const int fault = ps->fault;
  ps->fault = 0;
  if (fault == 2 || fault == 3) extra = calloc(ps->cnt[0] + 1, sizeof(float));
  chorus_result_t st = CHORUS_OK;
  if ((fault == 2 || fault == 3) && !extra)
    st = chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_push: out of memory");
  for (int r = 0; r < S; r++) ps->pending[r] = 1;
  /* The slices not sent early (chorus_ps_push_early) go now. */
  for (int r = 0; r < S && st == CHORUS_OK; r++) {
    if (ps->sent[r]) continue;
    const float *src = grads + ps->lo[r];
    uint64_t count = ps->cnt[r];
    int64_t version = ps->ver[r];
    if (fault == 1) version = ps->ver[r] - ps->cfg.max_staleness - 1;
    if ((fault == 2 || fault == 3) && r == 0) {
      memcpy(extra, src, ps->cnt[0] * sizeof(float));
      if (fault == 2) count = ps->cnt[0] + 1;
      else extra[0] = NAN;
      src = extra;
    }
    send_slice(ps, r, src, count, version, loss, tokens); /* a failure shows in its answer */
  }
  /* The answers, from whichever process serves each range; a process
   * gone hands its ranges to their copies. */
  for (;;) {
    int r = 0;
    while (r < S && !ps->pending[r]) r++;
    if (r == S || st != CHORUS_OK) break;
    const int p = ps->owner[r];
    const int before = rep->stop;
    int got;
    rep->stop = 0;
    st = answer(ps, p, params, rep, NULL, &got);
    rep->stop |= before;
    if (st == CHORUS_INPROGRESS) {
      st = ps->cfg.mirror ? lost_server(ps, p, CHORUS_ERR_REMOTE, grads, loss, tokens)
                          : server_gone(ps, p, CHORUS_ERR_REMOTE, "the parameters it held are "
                                        "lost, so the job fails (a restart resumes from the "
                                        "servers' last checkpoint)");
    }
  }
  if (ps->lost_at && st == CHORUS_OK)
    chorus__ps_say(ps,
                   "async: worker %d: every range answered %.0f ms after a server was found gone",
                   ps->me, (double)(chorus__ps_now_ns() - ps->lost_at) / 1e6);
  ps->lost_at = 0;
  /* Every server process learns that this worker leaves (a standby too:
   * it may have taken a range over). */
  for (int p = 0; p < ps->nproc && st == CHORUS_OK && rep->stop; p++) {
    if (ps->pdead[p]) continue;
    msg_t bye;
    memset(&bye, 0, sizeof bye);
    bye.magic = PS_MAGIC;
    bye.kind = M_BYE;
    bye.range = -1;
    chorus_send(ps->pair[p], &bye, sizeof bye, CHORUS_UINT8, 0, TAG_HDR, NULL);
  }
  for (int i = 0; i < 2 * S; i++) {
    /* A server that stopped or refused this worker may never take the data. */
    if (ps->wk[i] && (st != CHORUS_OK || rep->stop) &&
        chorus_work_wait(ps->wk[i], 2000) == CHORUS_INPROGRESS)
      chorus_comm_abort(ps->pair[ps->owner[i / 2]]);
    chorus_work_free(ps->wk[i]);
    ps->wk[i] = NULL;
  }
  for (int r = 0; r < S; r++) ps->sent[r] = 0;
  free(extra);
  /* The other servers learn at once that this worker is out. */
  if (st != CHORUS_OK) abort_pairs(ps);
  ps->wstep++;
  return st;
}

/* ------------------------------------------------------------ the loop */

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
