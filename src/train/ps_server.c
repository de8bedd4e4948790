/*
 * ps_server.c - a parameter server serving its workers: their hellos and
 * pushes, one thread each; the updates applied to the ranges it serves,
 * under the staleness bound; its checkpoints, the resume, and the
 * caller's loop (chorus_ps_serve) that watches the other servers.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/ckpt.h"
#include "train/ps_internal.h"
#include "train/runtime.h"

/* -------------------------------------------------------------- server */

/* Waits on the server's condition for at most until (CLOCK_MONOTONIC ns).
 * 0, or ETIMEDOUT. */
static int wait_until(chorus_ps_t *ps, int64_t until) {
  struct timespec ts = {(time_t)(until / 1000000000), (long)(until % 1000000000)};
  return pthread_cond_timedwait(&ps->cv, &ps->mu, &ts);
}

/* Now plus a communicator's timeout. */
static int64_t deadline_of(chorus_comm_t c) {
  int ms = c ? chorus_comm_timeout_ms(c) : 0;
  return chorus__ps_now_ns() + (int64_t)(ms > 0 ? ms : 300000) * 1000000;
}

/* The parameters a worker may be handed: those the copy has (all, with
 * no copy), and their version. */
static const float *hand_par(const range_t *r) { return r->mproc >= 0 ? r->hand : r->par; }
static int64_t hand_ver(const range_t *r) { return r->mproc >= 0 ? r->acked : r->version; }

/* The lowest range this process serves (the one its counters come from),
 * or NULL. */
static range_t *first_served(chorus_ps_t *ps) {
  for (int k = 0; k < ps->nrange; k++)
    if (ps->rg[k].role == R_PRIMARY) return &ps->rg[k];
  return NULL;
}

/* The snapshot a checkpoint writes, taken under the lock: every range
 * served here; the progress of the first. */
static void ck_snapshot(chorus_ps_t *ps) {
  const range_t *f = first_served(ps);
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || !r->ck_par) continue;
    memcpy(r->ck_par, r->par, r->n * sizeof(float));
    chorus_optim_state_save(r->opt, r->ck_blob);
  }
  ps->ck_x = (ck_extra_t){CK_EXTRA_MAGIC, f ? f->applied : 0, f ? f->version : 0, ps->nwork, 0};
  for (int w = 0; w < ps->nwork; w++) ps->ck_pushes[w] = f ? f->wr[w].pushes : 0;
}

/* Writes one checkpoint from the snapshot (no lock held); collective over
 * the servers, which write the same steps in the same order: a file per
 * range, from the process serving it. */
static chorus_result_t ck_write(chorus_ps_t *ps, long step) {
  const size_t xlen = sizeof(ck_extra_t) + sizeof(int64_t) * (size_t)ps->nwork;
  unsigned char *x = malloc(xlen);
  chorus__ck_range_t *cr = calloc((size_t)ps->nrange, sizeof *cr);
  chorus_result_t st = x && cr ? CHORUS_OK : CHORUS_ERR_NO_MEMORY;
  int nr = 0;
  for (int k = 0; k < ps->nrange && st == CHORUS_OK; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || !r->ck_par) continue;
    st = chorus_optim_state_load(r->ck_opt, r->ck_blob, chorus_optim_state_size(r->ck_opt));
    cr[nr++] = (chorus__ck_range_t){r->ck_opt, r->ck_par, r->lo, r->n, r->id};
  }
  ps->ck_count++;
  if (st == CHORUS_OK) {
    memcpy(x, &ps->ck_x, sizeof ps->ck_x);
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p = ps->ck_pushes[w];
      memcpy(x + sizeof ps->ck_x + sizeof p * (size_t)w, &p, sizeof p);
    }
  }
  /* Everyone enters the save (a local failure is part of its agreement). */
  chorus_result_t sv = chorus__ckpt_save_ranges(ps->servers, ps->shape, st == CHORUS_OK ? nr : 0,
                                                cr, ps->nrange, ps->cfg.ckpt_dir, step,
                                                x ? x : (void *)&ps->ck_x,
                                                x ? xlen : sizeof ps->ck_x, ps->cfg.keep);
  if (st == CHORUS_OK) st = sv;
  free(x), free(cr);
  if (st != CHORUS_OK)
    chorus__ps_say(ps, "async: server %d: checkpoint of step %ld not written: %s", ps->me, step,
                   chorus_train_last_error());
  else if (chorus_comm_rank(ps->servers) == 0)
    chorus__ps_say(ps, "checkpoint: %s/ckpt-%09ld (%d server file(s) and an index)",
                   ps->cfg.ckpt_dir, step, ps->nrange);
  return st;
}

/* Writes every checkpoint step the updates pass, in order and none
 * skipped, so that every server makes the same collective calls; a
 * snapshot is taken when its turn comes (the state then, at or after the
 * step).  A take-over holds it (ck_hold) and waits until none is being
 * written (ck_busy). */
static void *ck_main(void *arg) {
  chorus_ps_t *ps = arg;
  pthread_mutex_lock(&ps->mu);
  for (;;) {
    while ((ps->ck_done >= ps->ck_crossed || ps->ck_hold) && !ps->ck_quit)
      pthread_cond_wait(&ps->cv, &ps->mu);
    if (ps->ck_done >= ps->ck_crossed || ps->ck_hold) break;
    const long step = (ps->ck_done + 1) * ps->cfg.ckpt_every;
    ps->ck_busy = 1;
    ck_snapshot(ps);
    pthread_mutex_unlock(&ps->mu);
    chorus_result_t st = ck_write(ps, step);
    pthread_mutex_lock(&ps->mu);
    ps->ck_busy = 0;
    ps->ck_done++;
    if (st == CHORUS_OK) ps->ck_last = step;
    pthread_cond_broadcast(&ps->cv);
  }
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* Packs range r's state (FULL) or its last update (UPDATE) into mbuf:
 * the floats first (parameters, or the averaged gradient), then for a
 * FULL the optimizer state, then the per-worker records and statistics.
 * Lock held. */
void chorus__ps_pack(range_t *r, unsigned char *dst, int kind, const float *g, int acc_k,
                     float lr) {
  chorus_ps_t *ps = r->ps;
  unsigned char *p = dst;
  memcpy(p, g, r->n * sizeof(float));
  p += r->n * sizeof(float);
  if (kind == X_FULL) {
    chorus_optim_state_save(r->opt, p);
    p += chorus_optim_state_size(r->opt);
  }
  memcpy(p, r->wr, sizeof(wrec_t) * (size_t)ps->nwork);
  p += sizeof(wrec_t) * (size_t)ps->nwork;
  memcpy(p, &r->st, sizeof r->st);
  p += sizeof r->st;
  r->mh = (mhdr_t){MIR_MAGIC, (uint32_t)kind, r->id, acc_k, r->version, r->applied, lr, 0,
                   (uint64_t)(p - dst)};
  r->inflight = 1;
  r->t_sent = chorus__ps_now_ns();
}

/* The updates seen here have passed `step` of the budget: the checkpoint
 * steps up to it are due (ck_main writes them).  Lock held. */
void chorus__ps_ck_pass(chorus_ps_t *ps, long step) {
  const long every = ps->cfg.ckpt_every;
  if (!ps->cfg.ckpt_dir || every <= 0 || step >= ps->cfg.steps || step / every <= ps->ck_crossed)
    return;
  ps->ck_crossed = step / every;
  pthread_cond_broadcast(&ps->cv);
}

/* One update from the gradients summed so far.  Lock held. */
static void apply(range_t *r) {
  chorus_ps_t *ps = r->ps;
  const size_t n = r->n;
  const chorus_ps_config_t *c = &ps->cfg;
  if (r->held)
    for (int w = 0; w < ps->nwork; w++)
      if (r->pend[w] >= 0)
        for (size_t i = 0; i < n; i++) r->acc[i] += r->held[w][i];
  const double inv = 1.0 / (double)r->acc_k;
  for (size_t i = 0; i < n; i++) r->avg[i] = (float)(r->acc[i] * inv);
  if (c->clip > 0) chorus_grad_clip(r->avg, n, chorus_grad_norm(r->avg, n), c->clip);
  /* The schedule's rate at this point of the budget, scaled by the share
   * of a synchronous step's batch the update averages (the linear scaling
   * rule): k gradients of W move the weights k / W as far, so a token
   * counts the same whatever the staleness bound, and S = 0 is DDP. */
  const int k = r->acc_k;
  const float lr = chorus_lr_at(r->applied / ps->nwork, c->warmup, c->steps, c->lr, c->min_lr) *
                   (float)k / (float)ps->nwork;
  chorus_optim_begin_step(r->opt);
  chorus_optim_update(r->opt, 0, r->par, r->avg, n, lr);
  r->applied += k;
  r->acc_k = 0;
  r->version++;
  for (int w = 0; w < ps->nwork; w++)
    if (r->pend[w] >= 0) {
      r->wr[w].pushes++;
      r->wr[w].last_step = r->pend[w];
      r->wr[w].ver = r->version;
      r->pend[w] = -1;
    }
  memset(r->acc, 0, n * sizeof(double));
  ps->t_last = chorus__ps_now_ns();
  r->st.seconds = (double)(ps->t_last - ps->t_first) / 1e9;
  /* The copy takes the same step. */
  if (r->mproc >= 0) chorus__ps_pack(r, r->mbuf, X_UPDATE, r->avg, k, lr);
  const long step = r->applied / ps->nwork;
  if (r->id == 0 && c->log_every > 0 && step >= ps->log_next && ps->log_n) {
    const double dt = (double)(ps->t_last - ps->t_log) / 1e9;
    chorus__ps_say(
        ps,
        "async step %5ld/%ld  loss %.4f  lr %.2e  %.0f tok/s  staleness mean %.2f max %ld  "
        "version %lld  (%ld gradient(s))",
        step, c->steps, ps->log_loss / (double)ps->log_n, lr, dt > 0 ? ps->log_tok / dt : 0.0,
        ps->log_stale / (double)ps->log_n, ps->log_smax, (long long)r->version, ps->log_n);
    ps->log_loss = ps->log_tok = ps->log_stale = 0;
    ps->log_n = ps->log_smax = 0;
    ps->t_log = ps->t_last;
    while (ps->log_next <= step) ps->log_next += c->log_every;
  }
  /* A checkpoint step is passed once every range served here passed it
   * (the snapshot must be at or after it for each). */
  long least = step;
  for (int q = 0; q < ps->nrange; q++)
    if (ps->rg[q].role == R_PRIMARY && ps->rg[q].applied / ps->nwork < least)
      least = ps->rg[q].applied / ps->nwork;
  chorus__ps_ck_pass(ps, least);
  pthread_cond_broadcast(&ps->cv);
}

/* Applies the summed gradients if no worker still computing would then be
 * more than max_staleness versions behind, and the copy has the last
 * update.  Lock held. */
void chorus__ps_maybe_apply(range_t *r) {
  if (r->role != R_PRIMARY || r->acc_k == 0 || r->inflight) return;
  for (int w = 0; w < r->ps->nwork; w++) {
    /* A worker whose gradient is applied but who was not answered yet
     * (its thread has not woken) computes next on what it will be
     * handed: at least hand_ver. */
    const int64_t u = r->wst[w] == W_COMPUTING                     ? r->u[w]
                      : r->wst[w] == W_WAITING && r->pend[w] < 0 ? hand_ver(r)
                                                                 : INT64_MAX;
    if (u != INT64_MAX && r->version + 1 - u > r->ps->cfg.max_staleness) return;
  }
  apply(r);
}

/* The worker is gone (it left, or was dropped).  Lock held. */
static void gone(slot_t *sl) {
  chorus_ps_t *ps = sl->ps;
  sl->gone = 1;
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY || r->wst[sl->w] == W_GONE) continue;
    r->wst[sl->w] = W_GONE; /* a gradient of it in acc stays in */
    chorus__ps_maybe_apply(r);
  }
  pthread_cond_broadcast(&ps->cv);
}

static void drop(slot_t *sl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void drop(slot_t *sl, const char *fmt, ...) {
  chorus_ps_t *ps = sl->ps;
  char why[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  chorus__ps_pair_words(why);
  pthread_mutex_lock(&ps->mu);
  /* A worker told to stop everywhere has nothing left here to lose. */
  int was = 0;
  for (int k = 0; !sl->gone && k < ps->nrange; k++)
    was |= ps->rg[k].role == R_PRIMARY && ps->rg[k].wst[sl->w] != W_GONE;
  if (was) ps->dropped++;
  gone(sl);
  int alive = 0;
  for (int w = 0; w < ps->nwork; w++) alive += !ps->slots[w].gone;
  const int failed = ps->failed;
  pthread_mutex_unlock(&ps->mu);
  if (was && !failed)
    chorus__ps_say(
        ps,
        "async: server %d dropped worker %d (rank %d): %s; %d worker(s) go on; the rest of "
        "its data is not trained on (lost), the budget is filled by the others",
        ps->me, sl->w, ps->nproc + sl->w, why, alive);
}

/* Sends the worker an answer (m, then m->count floats of data): 0, or -1
 * when it could not go (the worker is dropped). */
static int reply(slot_t *sl, msg_t *m, const float *data) {
  chorus_result_t st = chorus_send(sl->comm, m, sizeof *m, CHORUS_UINT8, 1, TAG_HDR, NULL);
  if (st == CHORUS_OK && m->count)
    st = chorus_send(sl->comm, data, m->count, CHORUS_FLOAT32, 1, TAG_DATA, NULL);
  if (st == CHORUS_OK) return 0;
  drop(sl, "%s", chorus_comm_last_error(sl->comm));
  return -1;
}

/* Tells the worker it is refused for good, and drops it. */
static void fatal(slot_t *sl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fatal(slot_t *sl, const char *fmt, ...) {
  msg_t m;
  memset(&m, 0, sizeof m);
  m.magic = PS_MAGIC;
  m.kind = M_FATAL;
  m.range = -1;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m.text, sizeof m.text, fmt, ap);
  va_end(ap);
  /* It may not read it (it may be what is broken): abort right after. */
  chorus_work_t wk = NULL;
  if (chorus_send(sl->comm, &m, sizeof m, CHORUS_UINT8, 1, TAG_HDR, &wk) == CHORUS_OK) {
    chorus_work_wait(wk, 1000);
    if (chorus_work_test(wk) == CHORUS_INPROGRESS) chorus_comm_abort(sl->comm);
    chorus_work_free(wk);
  }
  drop(sl, "refused: %s", m.text);
}

/* Range r's parameters for a worker, and its state: computing on them.
 * Lock held. */
static void hand_out(slot_t *sl, range_t *r, msg_t *m, int kind) {
  memcpy(sl->out, hand_par(r), r->n * sizeof(float));
  memset(m, 0, sizeof *m);
  m->magic = PS_MAGIC;
  m->kind = (uint32_t)kind;
  m->range = r->id;
  m->mirror = r->mproc;
  m->version = hand_ver(r);
  m->count = r->n;
  r->u[sl->w] = hand_ver(r);
  r->wst[sl->w] = W_COMPUTING;
}

/* A HELLO: once every worker is here (so that a synchronous run has them
 * all in its first update) and the copies have the start, the parameters
 * of every range served here.  0, or -1 (the worker was dropped). */
static int hello(slot_t *sl) {
  chorus_ps_t *ps = sl->ps;
  pthread_mutex_lock(&ps->mu);
  if (ps->t_first == 0) ps->t_first = ps->t_log = chorus__ps_now_ns();
  ps->hellos++;
  pthread_cond_broadcast(&ps->cv);
  const int64_t until = deadline_of(sl->comm);
  int to = 0;
  for (;;) {
    int left = 0, unsynced = 0;
    for (int w = 0; w < ps->nwork; w++) left += ps->slots[w].gone;
    for (int k = 0; k < ps->nrange; k++)
      unsynced += ps->rg[k].role == R_PRIMARY && hand_ver(&ps->rg[k]) < 0;
    if ((ps->hellos + left >= ps->nwork && !unsynced) || ps->failed || to) break;
    to = wait_until(ps, until) == ETIMEDOUT;
  }
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role != R_PRIMARY) continue;
    if (hand_ver(r) < 0) {
      pthread_mutex_unlock(&ps->mu);
      drop(sl, "range %d's copy never acknowledged its start", r->id);
      return -1;
    }
    msg_t m;
    hand_out(sl, r, &m, M_PARAMS);
    m.step = ps->start_step[sl->w];
    pthread_mutex_unlock(&ps->mu);
    if (reply(sl, &m, sl->out) != 0) return -1;
    pthread_mutex_lock(&ps->mu);
  }
  pthread_mutex_unlock(&ps->mu);
  return 0;
}

/* A push's first step: its header checked, its gradient received into
 * sl->g.  The range it is for, or NULL (the worker was refused or
 * dropped). */
static range_t *push_receive(slot_t *sl, const msg_t *h) {
  chorus_ps_t *ps = sl->ps;
  if (h->range < 0 || h->range >= ps->nrange) {
    fatal(sl, "a push for range %d, but there are %d", h->range, ps->nrange);
    return NULL;
  }
  range_t *r = &ps->rg[h->range];
  const size_t n = r->n;
  if (h->count != n) {
    fatal(sl, "a gradient of %llu floats, but server %d holds %zu for range %d (floats [%zu, "
          "%zu) of %zu): the worker's model is not the servers'", (unsigned long long)h->count,
          ps->me, n, r->id, r->lo, r->lo + n, ps->np);
    return NULL;
  }
  if (chorus_recv(sl->comm, sl->g, n, CHORUS_FLOAT32, 1, TAG_DATA, NULL) != CHORUS_OK) {
    drop(sl, "%s", chorus_comm_last_error(sl->comm));
    return NULL;
  }
  return r;
}

/* Refuses the gradient, tau versions old (why in m->text): the worker
 * goes on from the newest parameters.  Lock held; released.  0, or -1
 * (the worker was dropped). */
static int push_refuse(slot_t *sl, range_t *r, msg_t *m, int64_t tau) {
  chorus_ps_t *ps = sl->ps;
  char text[sizeof m->text];
  memcpy(text, m->text, sizeof text);
  r->st.refused++;
  hand_out(sl, r, m, M_REFUSED);
  memcpy(m->text, text, sizeof text);
  m->staleness = tau;
  chorus__ps_maybe_apply(r); /* it computes on the newest version now */
  pthread_mutex_unlock(&ps->mu);
  chorus__ps_say(ps, "async: %s (worker %d)", m->text, sl->w);
  return reply(sl, m, sl->out);
}

/* Adds the gradient in sl->g (of push h, tau versions old) to the range's
 * sum and statistics; the worker then waits for the update.  Lock held.
 * 0, or -1: no memory to hold it (--max-staleness 0), nothing added. */
static int push_add(slot_t *sl, range_t *r, const msg_t *h, int64_t tau) {
  chorus_ps_t *ps = sl->ps;
  const int S = ps->cfg.max_staleness, w = sl->w;
  const size_t n = r->n;
  const float wgt = ps->cfg.staleness_weight ? 1.0f / (1.0f + (float)tau) : 1.0f;
  if (S == 0 && !r->held) r->held = calloc((size_t)ps->nwork, sizeof *r->held);
  if (S == 0 && r->held && !r->held[w]) r->held[w] = malloc(n * sizeof(float) + 1);
  if (S == 0 && r->held && r->held[w])
    memcpy(r->held[w], sl->g, n * sizeof(float)); /* added at the update, in worker order */
  else if (S == 0)
    return -1;
  else if (wgt == 1.0f)
    for (size_t i = 0; i < n; i++) r->acc[i] += sl->g[i];
  else
    for (size_t i = 0; i < n; i++) r->acc[i] += (double)(wgt * sl->g[i]);
  r->acc_k++;
  r->pend[w] = h->step;
  r->st.hist[tau < CHORUS_PS_HIST - 1 ? tau : CHORUS_PS_HIST - 1]++;
  r->st.tokens += h->tokens;
  r->st.loss_sum += h->loss;
  r->st.loss_n++;
  if (r->id == 0) {
    ps->log_loss += h->loss, ps->log_tok += h->tokens, ps->log_stale += (double)tau;
    ps->log_n++;
    if (tau > ps->log_smax) ps->log_smax = (long)tau;
  }
  if ((r->applied + r->acc_k) * 10 > ps->budget * 9) r->st.tail_sum += h->loss, r->st.tail_n++;
  r->wst[w] = W_WAITING;
  return 0;
}

/* Waits until the update past version v, which holds the gradient, is on
 * the copy (or the servers failed, or the range moved).  Lock held. */
static void push_await(slot_t *sl, range_t *r, int64_t v) {
  chorus_ps_t *ps = sl->ps;
  const int S = ps->cfg.max_staleness;
  int64_t wait_end = deadline_of(sl->comm);
  while (hand_ver(r) <= v && !ps->failed && r->role == R_PRIMARY) {
    if (wait_until(ps, wait_end) != ETIMEDOUT) continue;
    /* A whole timeout without the update: the workers still computing
     * that hold it back have not pushed for that long.  They go. */
    slot_t *late[64];
    int nl = 0;
    for (int o = 0; o < ps->nwork && nl < 64; o++)
      if (r->wst[o] == W_COMPUTING && r->version + 1 - r->u[o] > S) late[nl++] = &ps->slots[o];
    pthread_mutex_unlock(&ps->mu);
    for (int i = 0; i < nl; i++) {
      drop(late[i], "it held the others' update back for a whole timeout (CHORUS_TIMEOUT) "
           "without pushing");
      chorus_comm_abort(late[i]->comm);
    }
    pthread_mutex_lock(&ps->mu);
    wait_end = deadline_of(sl->comm);
  }
}

/* A PUSH whose header is h: receives the gradient, adds it, answers once
 * the update it went into is on the copy.  0, or -1 (the worker was
 * dropped). */
static int push(slot_t *sl, const msg_t *h) {
  chorus_ps_t *ps = sl->ps;
  const int S = ps->cfg.max_staleness, w = sl->w;
  range_t *r = push_receive(sl, h);
  if (!r) return -1;
  const double sq = chorus_grad_sumsq(sl->g, r->n);
  msg_t m;
  memset(&m, 0, sizeof m);
  pthread_mutex_lock(&ps->mu);
  /* The range may be on its way here: its server died and this process,
   * keeping its copy, takes it over once the servers agree on that. */
  const int64_t until = deadline_of(sl->comm);
  int to = 0;
  while (r->role == R_MIRROR && !ps->failed && !to) to = wait_until(ps, until) == ETIMEDOUT;
  if (r->role != R_PRIMARY) {
    const int role = r->role;
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a push for range %d, which server process %d does not serve%s", r->id, ps->me,
          role == R_MIRROR ? " (it keeps the range's copy, and its server is alive)" : "");
    return -1;
  }
  if (r->wst[w] == W_NEW) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a push before its hello");
    return -1;
  }
  if (r->wst[w] == W_GONE) {
    /* Told to stop already: it is again. */
    pthread_mutex_unlock(&ps->mu);
    m = (msg_t){.magic = PS_MAGIC, .kind = M_STOP, .range = r->id, .mirror = -1};
    return reply(sl, &m, NULL);
  }
  if (h->step <= r->wr[w].last_step) {
    /* Sent again after a take-over, but already applied (the copy has
     * it): its answer only. */
    const int stop = r->applied >= ps->budget;
    hand_out(sl, r, &m, stop ? M_STOP : M_PARAMS);
    m.step = 1;
    if (stop) m.count = 0, r->wst[w] = W_GONE, chorus__ps_maybe_apply(r);
    pthread_mutex_unlock(&ps->mu);
    return reply(sl, &m, sl->out);
  }
  const int64_t v = r->version;
  /* A range taken over does not know what its dead server handed out
   * last: anything up to its version is allowed. */
  const int64_t newest = r->adopted && r->version > r->u[w] ? r->version : r->u[w];
  if (h->version < 0 || h->version > newest) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "a gradient claiming version %lld, but range %d handed it version %lld",
          (long long)h->version, r->id, (long long)newest);
    return -1;
  }
  const int64_t tau = v - h->version;
  int refuse = 0;
  if (tau > S) {
    snprintf(m.text, sizeof m.text, "server %d refused the gradient of step %lld: it was "
             "computed on version %lld, %lld versions old, and --max-staleness is %d", ps->me,
             (long long)h->step, (long long)h->version, (long long)tau, S);
    refuse = 1;
  } else if (!isfinite(sq) || !isfinite(h->loss)) {
    snprintf(m.text, sizeof m.text, "server %d refused the gradient of step %lld: it holds inf "
             "or NaN", ps->me, (long long)h->step);
    refuse = 1;
  }
  if (refuse) return push_refuse(sl, r, &m, tau);
  if (r->applied + r->acc_k >= ps->budget) {
    /* The budget is full: this one is not needed. */
    r->wst[w] = W_GONE;
    chorus__ps_maybe_apply(r);
    pthread_cond_broadcast(&ps->cv);
    pthread_mutex_unlock(&ps->mu);
    m = (msg_t){.magic = PS_MAGIC, .kind = M_STOP, .range = r->id, .mirror = -1, .version = v};
    return reply(sl, &m, NULL);
  }
  if (push_add(sl, r, h, tau) != 0) {
    pthread_mutex_unlock(&ps->mu);
    fatal(sl, "server %d is out of memory for a gradient of range %d", ps->me, r->id);
    return -1;
  }
  chorus__ps_maybe_apply(r);
  push_await(sl, r, v);
  if (hand_ver(r) <= v) {
    pthread_mutex_unlock(&ps->mu);
    drop(sl, "the servers failed");
    return -1;
  }
  const int stop = r->applied >= ps->budget;
  hand_out(sl, r, &m, stop ? M_STOP : M_PARAMS);
  m.staleness = tau;
  m.step = 1; /* its gradient is in */
  if (stop) {
    m.count = 0;
    r->wst[w] = W_GONE;
    chorus__ps_maybe_apply(r);
  }
  pthread_mutex_unlock(&ps->mu);
  return reply(sl, &m, sl->out);
}

static void *serve_worker(void *arg) {
  slot_t *sl = arg;
  chorus_ps_t *ps = sl->ps;
  int said_hello = 0;
  for (;;) {
    msg_t h;
    chorus_result_t st = chorus_recv(sl->comm, &h, sizeof h, CHORUS_UINT8, 1, TAG_HDR, NULL);
    if (st != CHORUS_OK) {
      drop(sl, "%s", chorus_comm_last_error(sl->comm));
      break;
    }
    if (h.magic == PS_MAGIC && h.kind == M_BYE) {
      /* The budget is applied (here or on another range): it leaves. */
      pthread_mutex_lock(&ps->mu);
      ps->byes++;
      pthread_mutex_unlock(&ps->mu);
      break;
    }
    if (h.magic != PS_MAGIC || (h.kind != M_HELLO && h.kind != M_PUSH)) {
      fatal(sl, "a message that is neither a hello nor a push (magic %#x, kind %u)", h.magic,
            h.kind);
      break;
    }
    pthread_mutex_lock(&ps->mu);
    const int left = sl->gone; /* another thread may have dropped it */
    pthread_mutex_unlock(&ps->mu);
    if (left) break;
    if (h.kind == M_HELLO) {
      if (said_hello) {
        fatal(sl, "a second hello");
        break;
      }
      said_hello = 1;
      if (hello(sl) != 0) break;
      continue;
    }
    if (push(sl, &h) != 0) break;
  }
  pthread_mutex_lock(&ps->mu);
  gone(sl);
  ps->running--;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  return NULL;
}

/* Starts the thread of every worker not served yet, not gone.  Lock held. */
void chorus__ps_start_slots(chorus_ps_t *ps) {
  for (int w = 0; w < ps->nwork; w++) {
    slot_t *sl = &ps->slots[w];
    if (sl->started || sl->gone) continue;
    if (pthread_create(&sl->th, NULL, serve_worker, sl) != 0) {
      sl->gone = 1;
      continue;
    }
    sl->started = 1;
    ps->running++;
  }
}

/* ---------------------------------------------------- the caller's loop */

/* Resumes from the newest checkpoint: the range served here, and the
 * progress (a checkpoint of the servers, or of a synchronous run: then
 * every worker starts at its step).  A standby takes part with nothing. */
static chorus_result_t resume(chorus_ps_t *ps) {
  const size_t cap = sizeof(ck_extra_t) + sizeof(int64_t) * MAX_CK_WORKERS;
  unsigned char *x = malloc(cap);
  if (!x) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ps_serve: out of memory");
  long step = -1;
  size_t xlen = 0;
  chorus_ckpt_info_t info;
  range_t *r = ps->me < ps->nrange ? &ps->rg[ps->me] : NULL;
  chorus_result_t st = chorus__ckpt_load_range(ps->servers, ps->shape, r ? r->opt : ps->opt0,
                                               r ? r->par : NULL, r ? r->lo : 0, r ? r->n : 0,
                                               ps->cfg.ckpt_dir, &step, x, cap, &xlen, &info);
  if (st != CHORUS_OK || step < 0) {
    free(x);
    return st;
  }
  ck_extra_t e;
  memset(&e, 0, sizeof e);
  if (xlen >= sizeof e) memcpy(&e, x, sizeof e);
  long applied;
  int64_t version;
  if (xlen >= sizeof e && e.magic == CK_EXTRA_MAGIC && e.workers == ps->nwork &&
      xlen == sizeof e + sizeof(int64_t) * (size_t)e.workers && e.applied >= 0 &&
      e.version >= 0) {
    applied = (long)e.applied;
    version = e.version;
    for (int w = 0; w < ps->nwork; w++) {
      int64_t p;
      memcpy(&p, x + sizeof e + sizeof p * (size_t)w, sizeof p);
      ps->start_step[w] = p > 0 ? (long)p : 0;
    }
  } else {
    /* Another world or mode wrote it: everybody goes on from its step. */
    applied = step * ps->nwork;
    version = step;
    for (int w = 0; w < ps->nwork; w++) ps->start_step[w] = step;
  }
  if (applied > ps->budget) applied = ps->budget;
  if (r) {
    r->applied = applied;
    r->version = version;
    for (int w = 0; w < ps->nwork; w++)
      r->wr[w] = (wrec_t){ps->start_step[w], ps->start_step[w] - 1, -1};
  }
  ps->resumed_step = step;
  ps->ck_last = step;
  if (ps->cfg.ckpt_every > 0) ps->ck_done = ps->ck_crossed = step / ps->cfg.ckpt_every;
  ps->log_next = step + 1;
  if (ps->me == 0)
    chorus__ps_say(ps,
                   "resumed from %s/ckpt-%09ld%s (written by %d rank(s)%s): %ld of %ld gradients "
                   "applied",
                   ps->cfg.ckpt_dir, step, info.sharded ? "" : ".bin", info.world,
                   e.magic == CK_EXTRA_MAGIC ? ", asynchronous" : "", applied, ps->budget);
  free(x);
  return CHORUS_OK;
}

/* Waits while this process has work: workers to serve, copies to keep, a
 * copy whose primary failed until the servers agree on it.  Watches the
 * other servers meanwhile and runs the take-over when one dies.  Lock
 * held.  0, or -1 (failed; why set). */
static int watch(chorus_ps_t *ps, char *why, size_t cap) {
  for (;;) {
    int unsettled = 0;
    const int64_t now = chorus__ps_now_ns(),
                  grace = (int64_t)chorus_comm_timeout_ms(ps->servers) * 1000000;
    for (int k = 0; k < ps->nrange; k++) {
      range_t *r = &ps->rg[k];
      if (r->role != R_MIRROR || r->rx_started == 0 || r->rx_end != RX_FAILED) continue;
      /* its primary failed: wait for the agreement, but not forever */
      if (now - r->rx_end_ns < grace) unsettled++;
    }
    const int down = ps->nproc > 1 && !ps->failed && chorus_comm_status(ps->servers) != CHORUS_OK;
    if (ps->running == 0 && !ps->served) {
      ps->served = 1; /* the copies of the ranges served here can end */
      pthread_cond_broadcast(&ps->cv);
    }
    if (!down && ps->running == 0 && ps->rx_running == 0 && !unsettled) return 0;
    if (down) {
      if (!ps->cfg.mirror) {
        snprintf(why, cap, "%s", chorus_comm_last_error(ps->servers));
        return -1;
      }
      pthread_mutex_unlock(&ps->mu);
      int rc = chorus__ps_failover(ps, why, cap);
      pthread_mutex_lock(&ps->mu);
      if (rc != 0) return -1;
      continue;
    }
    wait_until(ps, chorus__ps_now_ns() + 200 * 1000000);
  }
}

chorus_result_t chorus_ps_serve(chorus_ps_t *ps) {
  if (!ps || !ps->server)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_serve: not a server");
  chorus_result_t st = CHORUS_OK;
  if (ps->cfg.ckpt_dir && (st = resume(ps)) != CHORUS_OK) return st;
  if (ps->cfg.log_every > 0 && ps->log_next == 0) ps->log_next = ps->cfg.log_every;
  if (ps->cfg.ckpt_dir) {
    if (pthread_create(&ps->ck_th, NULL, ck_main, ps) != 0) {
      chorus_comm_abort(ps->servers); /* the other servers must not wait for this one */
      return chorus__train_fail(CHORUS_ERR_SYSTEM, "chorus_ps_serve: cannot start a thread: %s",
                                strerror(errno));
    }
    ps->ck_started = 1;
  }
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->role == R_PRIMARY && r->mproc >= 0) {
      if (pthread_create(&r->tx, NULL, chorus__ps_tx_main, r) != 0) r->mproc = -1;
      else r->tx_started = 1;
    } else if (r->role == R_MIRROR) {
      if (pthread_create(&r->rx, NULL, chorus__ps_rx_main, r) == 0)
        r->rx_started = 1, ps->rx_running++;
      else r->role = R_NONE;
    }
  }
  /* A standby serves workers only once it takes a range over. */
  if (ps->me < ps->nrange) chorus__ps_start_slots(ps);
  char why[600] = "";
  if (watch(ps, why, sizeof why) != 0 && !ps->failed) {
    ps->failed = 1;
    pthread_cond_broadcast(&ps->cv);
    pthread_mutex_unlock(&ps->mu);
    for (int w = 0; w < ps->nwork; w++) chorus_comm_abort(ps->slots[w].comm);
    for (int p = 0; p < ps->nproc; p++)
      if (ps->spair[p]) chorus_comm_abort(ps->spair[p]);
    pthread_mutex_lock(&ps->mu);
  }
  ps->quit = ps->ck_quit = 1;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  for (int w = 0; w < ps->nwork; w++)
    if (ps->slots[w].started) pthread_join(ps->slots[w].th, NULL), ps->slots[w].started = 0;
  for (int k = 0; k < ps->nrange; k++) {
    range_t *r = &ps->rg[k];
    if (r->tx_started) pthread_join(r->tx, NULL), r->tx_started = 0;
    if (r->rx_started) pthread_join(r->rx, NULL), r->rx_started = 0;
  }
  if (ps->ck_started) pthread_join(ps->ck_th, NULL);
  ps->ck_started = 0;
  if (ps->failed)
    return chorus__train_fail(CHORUS_ERR_REMOTE,
                              "async: server %d: another server failed, and its parameters "
                              "with it: %s (resume from the last checkpoint)",
                              ps->me, why);
  const range_t *f = first_served(ps);
  const int short_of_budget = f && f->applied < ps->budget && ps->byes == 0;
  /* The final checkpoint, at a step every server reached, if every server
   * made the same checkpoint calls so far (updates that counted different
   * gradients -- one refused a slice another took -- can part them).  A
   * server dying now still hands its ranges to their copies. */
  int64_t agree[3] = {0, 0, 0};
  for (int attempt = 0;; attempt++) {
    const range_t *g = first_served(ps);
    agree[0] = g ? g->applied / ps->nwork : INT64_MAX;
    agree[1] = ps->ck_count;
    agree[2] = -(int64_t)ps->ck_count;
    if (chorus_comm_size(ps->servers) < 2) break;
    st = chorus_all_reduce(ps->servers, agree, agree, 3, CHORUS_INT64, CHORUS_MIN, NULL);
    if (st == CHORUS_OK) break;
    if (!ps->cfg.mirror || attempt >= 2 || chorus__ps_failover(ps, why, sizeof why) != 0)
      return chorus__train_fail(st, "async: server %d: agreeing on the final step: %s%s%s", ps->me,
                                chorus_comm_last_error(ps->servers), why[0] ? ": " : "", why);
  }
  const long step = (long)agree[0];
  const long written = ps->cfg.ckpt_every > 0 ? ps->ck_done * ps->cfg.ckpt_every : 0;
  st = CHORUS_OK;
  if (agree[1] != -agree[2]) {
    chorus__ps_say(
        ps,
        "async: server %d: the servers made %lld to %lld checkpoints (their updates counted "
        "different gradients); no final checkpoint",
        ps->me, (long long)agree[1], (long long)-agree[2]);
  } else if (ps->cfg.ckpt_dir && step > written && step > ps->resumed_step) {
    ck_snapshot(ps);
    st = ck_write(ps, step);
  }
  if (st == CHORUS_OK && short_of_budget && ps->nproc > 1) chorus_comm_abort(ps->servers);
  if (st == CHORUS_OK && short_of_budget)
    st = chorus__train_fail(
        CHORUS_ERR_REMOTE,
        "async: server %d: every worker is gone with %ld of the budget's "
        "%ld gradients applied%s",
        ps->me, f->applied, ps->budget,
        ps->cfg.ckpt_dir ? " (a restart resumes from the checkpoint just written)" : "");
  return st;
}

chorus_result_t chorus_ps_full_params(chorus_ps_t *ps, float *dst) {
  if (!ps || !ps->server)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ps_full_params: bad arguments");
  const int lead = ps->owner[0], root = ps->crank[lead];
  if (lead == ps->me && !dst) {
    chorus_comm_abort(ps->servers); /* the others must not wait for it */
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_ps_full_params: the leader has no buffer");
  }
  chorus_result_t st = CHORUS_OK;
  for (int k = 0; k < ps->nrange && st == CHORUS_OK; k++) {
    const int o = ps->owner[k];
    const range_t *r = &ps->rg[k];
    if (o == lead && lead == ps->me) memcpy(dst + ps->lo[k], r->par, ps->cnt[k] * sizeof(float));
    else if (lead == ps->me)
      st = chorus_recv(ps->servers, dst + ps->lo[k], ps->cnt[k], CHORUS_FLOAT32, ps->crank[o],
                       TAG_GATHER, NULL);
    else if (o == ps->me)
      st = chorus_send(ps->servers, r->par, ps->cnt[k], CHORUS_FLOAT32, root, TAG_GATHER, NULL);
  }
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "async: server %d: gathering the parameters: %s", ps->me,
                              chorus_comm_last_error(ps->servers));
  return CHORUS_OK;
}

