/*
 * ps_mirror.c - a range's copy on a second server process: the primary's
 * side shipping the state and every update (tx), the copy's side taking
 * them in (rx), and the take-over when a server process dies (failover).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "train/ps_internal.h"
#include "train/runtime.h"

/* ------------------------------------------------------------ mirrors */

/* Peer rank of server process p on its pair communicator with this one. */
static int speer(const chorus_ps_t *ps, int p) { return p < ps->me ? 0 : 1; }

/* The primary's side of range r's copy: the whole state once, then every
 * update; each waits for its ACK.  On a failure the range goes on without
 * a copy. */
void *chorus__ps_tx_main(void *arg) {
  range_t *r = arg;
  chorus_ps_t *ps = r->ps;
  const int q = r->mproc, peer = speer(ps, q);
  chorus_comm_t c = ps->spair[q];
  char why[600] = "";
  unsigned char *full = malloc(chorus__ps_full_bytes(ps, r));
  pthread_mutex_lock(&ps->mu);
  if (full) chorus__ps_pack(r, full, X_FULL, r->par, 0, 0.0f);
  else snprintf(why, sizeof why, "out of memory for the range's state");
  for (; !why[0];) {
    const mhdr_t mh = r->mh;
    pthread_mutex_unlock(&ps->mu);
    chorus_result_t st = chorus_send(c, &mh, sizeof mh, CHORUS_UINT8, peer, TAG_MHDR(r->id), NULL);
    if (st == CHORUS_OK && mh.kind != X_END)
      st = chorus_send(c, mh.kind == X_FULL ? full : r->mbuf, mh.bytes, CHORUS_UINT8, peer,
                       TAG_MDATA(r->id), NULL);
    mhdr_t ack;
    memset(&ack, 0, sizeof ack);
    if (st == CHORUS_OK && mh.kind != X_END)
      st = chorus_recv(c, &ack, sizeof ack, CHORUS_UINT8, peer, TAG_MACK(r->id), NULL);
    if (st != CHORUS_OK) chorus__ps_pair_error(c, why, sizeof why);
    else if (mh.kind != X_END && (ack.magic != MIR_MAGIC || ack.kind != X_ACK ||
                                  ack.range != r->id || ack.version != mh.version))
      snprintf(why, sizeof why, "a malformed acknowledgement (kind %u, range %d, version %lld "
               "for %lld)", ack.kind, ack.range, (long long)ack.version, (long long)mh.version);
    pthread_mutex_lock(&ps->mu);
    if (why[0] || mh.kind == X_END) break;
    free(full); /* the FULL is through */
    full = NULL;
    r->acked = mh.version;
    memcpy(r->hand, r->par, r->n * sizeof(float)); /* no update since: inflight held it */
    if (mh.kind == X_UPDATE) r->mwait += (double)(chorus__ps_now_ns() - r->t_sent) / 1e9;
    r->inflight = 0;
    chorus__ps_maybe_apply(r);
    pthread_cond_broadcast(&ps->cv);
    while (!r->inflight && !ps->quit && !ps->served && !r->tx_stop)
      pthread_cond_wait(&ps->cv, &ps->mu);
    if (r->tx_stop) break;
    if (!r->inflight) r->mh = (mhdr_t){MIR_MAGIC, X_END, r->id, 0, r->version, r->applied, 0, 0, 0};
  }
  /* Lock held. */
  free(full);
  const int lost = why[0] && !ps->quit && !r->tx_stop;
  r->mproc = -1;
  r->inflight = 0;
  chorus__ps_maybe_apply(r);
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  if (lost) {
    chorus_comm_abort(c); /* the copy must know it is one no more */
    chorus__ps_say(
        ps,
        "async: server %d: range %d's copy on server process %d is gone: %s; the range goes "
        "on without a copy",
        ps->me, r->id, q, why);
  }
  return NULL;
}

/* The copy's side: takes in the state, then every update (the same
 * optimizer step as the primary's), acknowledging each as it arrives.
 * Ends at END or when the primary is gone; what it acknowledged is
 * applied by then. */
void *chorus__ps_rx_main(void *arg) {
  range_t *r = arg;
  chorus_ps_t *ps = r->ps;
  const int p = r->from, peer = speer(ps, p);
  chorus_comm_t c = ps->spair[p];
  const size_t fb = chorus__ps_full_bytes(ps, r), ub = chorus__ps_update_bytes(ps, r),
               W = (size_t)ps->nwork;
  int end = RX_FAILED;
  char why[600] = "";
  for (;;) {
    mhdr_t h;
    if (chorus_recv(c, &h, sizeof h, CHORUS_UINT8, peer, TAG_MHDR(r->id), NULL) != CHORUS_OK)
      break;
    if (h.magic == MIR_MAGIC && h.kind == X_END && h.range == r->id) {
      end = RX_ENDED;
      break;
    }
    const int full = h.kind == X_FULL;
    if (h.magic != MIR_MAGIC || (!full && h.kind != X_UPDATE) || h.range != r->id ||
        h.bytes != (full ? fb : ub) || (full ? h.version < 0 : (!r->valid ||
        h.version != r->version + 1)) || h.applied < 0 || !isfinite(h.lr)) {
      snprintf(why, sizeof why, "a malformed message (kind %u, range %d, %llu bytes, version "
               "%lld after %lld)", h.kind, h.range, (unsigned long long)h.bytes,
               (long long)h.version, (long long)r->version);
      chorus_comm_abort(c);
      break;
    }
    unsigned char *in = full ? malloc(h.bytes) : r->rbuf; /* the FULL comes once */
    if (!in) {
      snprintf(why, sizeof why, "a state too big for this process's memory (%llu bytes)",
               (unsigned long long)h.bytes);
      chorus_comm_abort(c);
      break;
    }
    if (chorus_recv(c, in, h.bytes, CHORUS_UINT8, peer, TAG_MDATA(r->id), NULL) != CHORUS_OK) {
      if (full) free(in);
      break;
    }
    const mhdr_t ack = {MIR_MAGIC, X_ACK, r->id, 0, h.version, h.applied, 0, 0, 0};
    const int acked = chorus_send(c, &ack, sizeof ack, CHORUS_UINT8, peer, TAG_MACK(r->id),
                                  NULL) == CHORUS_OK;
    /* Applied whether or not the ACK went: the update is whole. */
    const unsigned char *b = in;
    const float *g = (const float *)b;
    b += r->n * sizeof(float);
    if (full) {
      memcpy(r->par, g, r->n * sizeof(float));
      const size_t blob = chorus_optim_state_size(r->opt);
      if (chorus_optim_state_load(r->opt, b, blob) != CHORUS_OK) {
        snprintf(why, sizeof why, "an optimizer state that does not load");
        chorus_comm_abort(c);
        free(in);
        break;
      }
      b += blob;
    } else {
      chorus_optim_begin_step(r->opt);
      chorus_optim_update(r->opt, 0, r->par, g, r->n, h.lr);
    }
    memcpy(r->wr, b, sizeof(wrec_t) * W);
    memcpy(&r->st, b + sizeof(wrec_t) * W, sizeof r->st);
    if (full) free(in);
    r->version = h.version;
    r->applied = (long)h.applied;
    /* A standby serves nothing, but takes part in every checkpoint: the
     * updates of the range it keeps tell it when. */
    if (!full) {
      pthread_mutex_lock(&ps->mu);
      chorus__ps_ck_pass(ps, r->applied / ps->nwork);
      pthread_mutex_unlock(&ps->mu);
    }
    if (full) {
      r->version0 = h.version;
      pthread_mutex_lock(&ps->mu);
      r->valid = 1;
      pthread_mutex_unlock(&ps->mu);
    }
    if (!acked) break;
  }
  pthread_mutex_lock(&ps->mu);
  if (why[0]) r->valid = 0; /* a copy that took something malformed is none */
  r->rx_end = end;
  r->rx_end_ns = chorus__ps_now_ns();
  ps->rx_running--;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  if (why[0])
    chorus__ps_say(ps,
                   "async: server %d: range %d's primary (server process %d) sent %s: this process "
                   "keeps no copy of it from now on",
                   ps->me, r->id, p, why);
  return NULL;
}

/* This process serves range r from now on, from its copy.  Lock held;
 * its rx thread has ended. */
static int adopt(chorus_ps_t *ps, range_t *r) {
  if (!r->acc) r->acc = calloc(r->n + 1, sizeof(double));
  if (!r->avg) r->avg = malloc(r->n * sizeof(float) + 1);
  if (!r->acc || !r->avg) return -1;
  r->role = R_PRIMARY;
  r->adopted = 1;
  r->mproc = -1;
  r->inflight = 0;
  r->acc_k = 0;
  memset(r->acc, 0, r->n * sizeof(double));
  for (int w = 0; w < ps->nwork; w++) {
    r->pend[w] = -1;
    r->wst[w] = ps->slots[w].gone ? W_GONE : W_COMPUTING;
    /* What its server handed out last is not known: the version its last
     * gradient made (the staleness bound then holds the next update back
     * until it is heard from, never lets one pass too early). */
    r->u[w] = r->wr[w].ver >= 0 ? r->wr[w].ver : r->version0;
  }
  ps->takeovers++;
  /* A standby's clock starts where the dead server's stood. */
  const int64_t now = chorus__ps_now_ns();
  if (ps->t_first == 0) ps->t_first = ps->t_log = now - (int64_t)(r->st.seconds * 1e9);
  if (ps->t_last < now) ps->t_last = now;
  if (ps->cfg.ckpt_dir && chorus__ps_range_ck_alloc(ps, r) != 0)
    chorus__ps_say(
        ps,
        "async: server %d: no memory for range %d's checkpoints: the checkpoints from now "
        "on fail",
        ps->me, r->id);
  if (!ps->quit) chorus__ps_start_slots(ps);
  pthread_cond_broadcast(&ps->cv);
  return 0;
}

/* ------------------------------------------------------------ take-over */

/* What a take-over works with: the survivors' communicator (nc, n ranks,
 * who: the process at each rank; alive per process), what each holds
 * (rec: this one's record, all: everyone's, L int64 apiece), and the
 * decision per range (taken from a dead server; its new server and
 * copy). */
typedef struct {
  chorus_comm_t nc;
  int n;
  size_t L;
  int64_t *who, *rec, *all;
  int *alive, *taken, *nowner, *nmirror;
  long ck_max;
  int64_t t0;
} takeover_t;

/* The survivors agree on who is left: a shrink of the servers'
 * communicator, then every survivor's process.  0, or -1 with why. */
static int survivors(chorus_ps_t *ps, takeover_t *t, char *why, size_t cap) {
  const int P = ps->nproc;
  const size_t L = t->L;
  int *alive = t->alive;
  chorus_result_t st = chorus_comm_shrink(ps->servers, 0, &t->nc);
  if (st != CHORUS_OK) {
    snprintf(why, cap, "the surviving servers could not agree on who is left: %s",
             chorus_comm_last_error(ps->servers));
    return -1;
  }
  const int n = t->n = chorus_comm_size(t->nc);
  int64_t *who = t->who = calloc((size_t)n, sizeof *who);
  t->all = calloc((size_t)n * L, sizeof *t->all);
  int64_t mine = ps->me;
  if (!who || !t->all) {
    snprintf(why, cap, "out of memory");
    return -1;
  }
  if ((st = chorus_all_gather(t->nc, &mine, who, 1, CHORUS_INT64, NULL)) != CHORUS_OK) {
    snprintf(why, cap, "learning who is left: %s", chorus_comm_last_error(t->nc));
    return -1;
  }
  for (int i = 0; i < n; i++) {
    if (who[i] < 0 || who[i] >= P || alive[who[i]]) {
      snprintf(why, cap, "the survivors' list is malformed (process %lld)", (long long)who[i]);
      return -1;
    }
    alive[who[i]] = 1;
  }
  return 0;
}

/* Stop talking to the dead: the copies' links with them end, and what
 * a copy acknowledged is applied once its thread is joined. */
static void leave_the_dead(chorus_ps_t *ps, const int *alive) {
  const int P = ps->nproc, S = ps->nrange;
  for (int p = 0; p < P; p++)
    if (!alive[p] && ps->spair[p]) chorus_comm_abort(ps->spair[p]);
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < S; k++) {
    range_t *r = &ps->rg[k];
    if (r->role == R_PRIMARY && r->tx_started && r->mproc >= 0 && !alive[r->mproc]) {
      r->tx_stop = 1;
      pthread_cond_broadcast(&ps->cv);
      pthread_mutex_unlock(&ps->mu);
      pthread_join(r->tx, NULL);
      pthread_mutex_lock(&ps->mu);
      r->tx_started = 0;
    }
    if (r->role == R_MIRROR && r->rx_started && !alive[r->from]) {
      pthread_mutex_unlock(&ps->mu);
      pthread_join(r->rx, NULL);
      pthread_mutex_lock(&ps->mu);
      r->rx_started = 0;
    }
  }
  /* Returns holding ps->mu: holdings() records what is left under the
   * same lock, as nothing may change in between. */
}

/* What each survivor holds: the ranges it serves, and whole copies
 * still good (being kept up to date, or complete: their server ended,
 * or died).  Called with ps->mu held (leave_the_dead), which it lets
 * go.  0, or -1 with why. */
static int holdings(chorus_ps_t *ps, takeover_t *t, char *why, size_t cap) {
  const int S = ps->nrange;
  const int *alive = t->alive;
  int64_t *rec = t->rec;
  /* ps->mu is held (leave_the_dead). */
  rec[0] = ps->me;
  rec[1] = ps->ck_done;
  for (int k = 0; k < S; k++) {
    const range_t *r = &ps->rg[k];
    rec[2 + k] = r->role == R_PRIMARY;
    rec[2 + S + k] = r->role == R_MIRROR && r->valid &&
                     (r->rx_end != RX_FAILED || !alive[r->from]);
  }
  pthread_mutex_unlock(&ps->mu);
  if (chorus_all_gather(t->nc, rec, t->all, t->L, CHORUS_INT64, NULL) != CHORUS_OK) {
    snprintf(why, cap, "learning who holds what: %s", chorus_comm_last_error(t->nc));
    return -1;
  }
  return 0;
}

/* The same decision on every survivor: who serves each range and who
 * keeps its copy; the checkpoints tried.  0, or -1 with why (a range
 * lost, or two servers of one). */
static int decide(chorus_ps_t *ps, takeover_t *t, char *why, size_t cap) {
  const int S = ps->nrange, n = t->n;
  const size_t L = t->L;
  const int64_t *all = t->all;
  long ck_max = 0;
  for (int i = 0; i < n; i++) ck_max = all[i * L + 1] > ck_max ? (long)all[i * L + 1] : ck_max;
  t->ck_max = ck_max;
  for (int k = 0; k < S; k++) {
    int prim = -1, copy = -1;
    for (int i = 0; i < n; i++) {
      if (all[i * L + 2 + k]) {
        if (prim >= 0) {
          snprintf(why, cap, "range %d has two servers (processes %d and %lld)", k, prim,
                   (long long)all[i * L]);
          return -1;
        }
        prim = (int)all[i * L];
      }
      if (all[i * L + 2 + S + k] && copy < 0) copy = (int)all[i * L];
    }
    if (prim < 0 && copy < 0) {
      char also[96] = "it had no copy";
      if (ps->mholder[k] >= 0)
        snprintf(also, sizeof also, "so did its copy's, process %d", ps->mholder[k]);
      snprintf(why, cap, "range %d (floats [%zu, %zu)) is gone: its server, process %d, died, "
               "and %s", k, ps->lo[k], ps->lo[k] + ps->cnt[k], ps->owner[k], also);
      return -1;
    }
    t->taken[k] = prim < 0;
    t->nowner[k] = prim >= 0 ? prim : copy;
    t->nmirror[k] = prim >= 0 && copy >= 0 && copy == ps->mholder[k] ? copy : -1;
  }
  return 0;
}

/* Acts on the decision: this process takes over the ranges given to it,
 * every range's server and copy are the new ones, and the servers'
 * communicator is the survivors'.  0, or -1 with why (no memory to take
 * a range over: the survivors hear it from the aborted communicator). */
static int take_over(chorus_ps_t *ps, takeover_t *t, char *why, size_t cap) {
  const int P = ps->nproc, S = ps->nrange;
  const int *taken = t->taken, *nowner = t->nowner, *nmirror = t->nmirror;
  pthread_mutex_lock(&ps->mu);
  for (int k = 0; k < S; k++) {
    range_t *r = &ps->rg[k];
    if (taken[k]) {
      const int dead = ps->owner[k];
      if (nowner[k] == ps->me && adopt(ps, r) != 0) {
        /* every survivor must hear that the range is gone: it fails the
         * servers' communicator, and they stop at their next look */
        snprintf(why, cap, "server %d is out of memory to take range %d over", ps->me, k);
        pthread_mutex_unlock(&ps->mu);
        chorus_comm_abort(t->nc);
        return -1;
      }
      if (nowner[k] == ps->me) {
        chorus__ps_say(
            ps,
            "async: server process %d died; server %d took its range %d over from its copy "
            "(version %lld, %ld gradients applied) %.0f ms after the failure was seen; the range "
            "has no copy from now on",
            dead, ps->me, k, (long long)r->version, r->applied,
            (double)(chorus__ps_now_ns() - t->t0) / 1e6);
      }
    }
    if (r->role == R_PRIMARY && !taken[k] && ps->mholder[k] >= 0 && nmirror[k] < 0)
      chorus__ps_say(ps,
                     "async: server %d: range %d's copy (on process %d) is gone; the range goes on "
                     "without one",
                     ps->me, k, ps->mholder[k]);
    if (r->role == R_MIRROR && nmirror[k] != ps->me && !r->rx_started && r->rx_end == RX_FAILED)
      r->role = R_NONE; /* a copy nobody counts on */
    ps->owner[k] = nowner[k];
    ps->mholder[k] = nmirror[k];
  }
  for (int p = 0; p < P; p++) ps->crank[p] = -1;
  for (int i = 0; i < t->n; i++) ps->crank[t->who[i]] = i;
  const long ck_max = t->ck_max;
  if (ck_max > ps->ck_done) ps->ck_done = ck_max; /* checkpoints another tried count as tried */
  if (ps->ck_crossed < ps->ck_done) ps->ck_crossed = ps->ck_done;
  chorus_comm_destroy(ps->servers);
  ps->servers = t->nc;
  t->nc = NULL;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  return 0;
}

/* After a server process died: the survivors agree on who is left (a
 * shrink of the servers' communicator), then on who serves each range --
 * a range whose server died goes to the process keeping its copy -- and
 * on the checkpoints written.  0, or -1 with why (a range lost, or no
 * agreement). */
int chorus__ps_failover(chorus_ps_t *ps, char *why, size_t cap) {
  const int P = ps->nproc, S = ps->nrange;
  takeover_t t;
  memset(&t, 0, sizeof t);
  t.t0 = chorus__ps_now_ns();
  pthread_mutex_lock(&ps->mu);
  ps->ck_hold = 1;
  pthread_mutex_unlock(&ps->mu);
  chorus_comm_abort(ps->servers); /* a checkpoint being written on it ends */
  pthread_mutex_lock(&ps->mu);
  while (ps->ck_busy) pthread_cond_wait(&ps->cv, &ps->mu);
  pthread_mutex_unlock(&ps->mu);
  t.L = 2 + 2 * (size_t)S;
  t.rec = calloc(t.L, sizeof *t.rec);
  t.alive = calloc((size_t)P, sizeof *t.alive), t.taken = calloc((size_t)S, sizeof *t.taken);
  t.nowner = calloc((size_t)S, sizeof *t.nowner), t.nmirror = calloc((size_t)S, sizeof *t.nmirror);
  int rc = -1;
  if (!t.rec || !t.alive || !t.taken || !t.nowner || !t.nmirror) {
    snprintf(why, cap, "out of memory");
    goto out;
  }
  if (survivors(ps, &t, why, cap) != 0) goto out;
  leave_the_dead(ps, t.alive);
  if (holdings(ps, &t, why, cap) != 0 || decide(ps, &t, why, cap) != 0 ||
      take_over(ps, &t, why, cap) != 0)
    goto out;
  rc = 0;
out:
  if (t.nc) chorus_comm_destroy(t.nc);
  pthread_mutex_lock(&ps->mu);
  ps->ck_hold = 0;
  pthread_cond_broadcast(&ps->cv);
  pthread_mutex_unlock(&ps->mu);
  free(t.who), free(t.rec), free(t.all), free(t.alive), free(t.taken), free(t.nowner);
  free(t.nmirror);
  return rc;
}
