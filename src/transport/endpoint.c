/*
 * endpoint.c - the endpoints of the transport (transport.h): creating and
 * destroying one, marking its collectives, posting sends and receives and
 * waiting for them; and the send queues every channel shares (chan.h).
 *
 * The endpoint layer is the part of the transport that does not depend on
 * how bytes travel (chan.h).  Its other files: endpoint_failure.c (the
 * failure model: failing an endpoint, peers that die or fall silent),
 * endpoint_match.c (matching messages to receives, early messages and
 * their budget) and endpoint_progress.c (the context's life and its
 * progress thread); endpoint_internal.h is what they share.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/endpoint_internal.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

int chorus__fp_equal(const chorus__fp_t *a, const chorus__fp_t *b) {
  return a->coll == b->coll && a->dtype == b->dtype && a->op == b->op &&
         a->algo == b->algo && a->root == b->root && a->count == b->count;
}

/* ------------------------------------------------------------ sending */

void chorus__tx_free(chorus__tx_t *it) {
  free(it->owned);
  free(it);
}

static chorus__tx_t *tx_last_piece(chorus__tx_t *it);

void chorus__txq_push(chorus__txq_t *q, chorus__tx_t *it) {
  it->next = NULL;
  if (q->tail) q->tail->next = it;
  else q->head = it;
  q->tail = it;
}

void chorus__txq_pop_done(chorus__tp_t *tp, chorus__txq_t *q) {
  chorus__tx_t *it = q->head;
  q->head = it->next;
  if (!q->head) q->tail = NULL;
  chorus__tp_tx_done(tp, it);
}

int chorus__txq_cancel(chorus__txq_t *q, const chorus__ep_t *ep) {
  int lost = 0;
  chorus__tx_t **pp = &q->head, *prev = NULL;
  while (*pp) {
    chorus__tx_t *it = *pp;
    if (it->ep == ep && (it->req || it->whole)) {
      /* A message in pieces is never dropped half-sent (the receiver waits
       * for every piece of one whose HEAD it saw): each item is kept, and
       * the whole, which may be in no queue any more, forgets ep too. */
      int in_pieces = it->whole || it->pieces;
      if (it->whole) {
        it->whole->req = NULL;
        it->whole->ep = NULL;
      }
      if (it->off == 0 && it != q->head && !in_pieces) {
        *pp = it->next;
        if (q->tail == it) q->tail = prev;
        chorus__tx_free(it);
        continue;
      }
      /* Started (or first in line, which the writer may be using): keep it,
       * but own the payload. */
      if (!it->owned && it->len) {
        it->owned = malloc(it->len);
        if (it->owned) {
          memcpy(it->owned, it->payload, it->len);
          it->payload = it->owned;
        } else {
          lost = 1; /* cannot keep the stream consistent */
        }
      }
      it->req = NULL;
      it->ep = NULL;
    }
    prev = it;
    pp = &it->next;
  }
  return lost ? -1 : 0;
}

int chorus__txq_has(const chorus__txq_t *q, const chorus__ep_t *ep) {
  if (!ep) return q->head != NULL;
  for (const chorus__tx_t *it = q->head; it; it = it->next)
    if (it->ep == ep) return 1;
  return 0;
}

void chorus__txq_lose(chorus__tp_t *tp, chorus__peer_t *p, chorus__txq_t *q) {
  while (q->head) {
    chorus__tx_t *it = q->head;
    q->head = it->next;
    chorus__tp_tx_lost(tp, p, it);
  }
  q->tail = NULL;
}

void chorus__txq_free(chorus__txq_t *q) {
  while (q->head) {
    chorus__tx_t *it = q->head, *w;
    q->head = it->next;
    /* A message in pieces goes with its last item, wherever that is
     * queued (its whole may be in no queue). */
    if ((w = tx_last_piece(it))) chorus__tx_free(w);
  }
  q->tail = NULL;
}

/* tag: for T_ABORT the code the sender failed with (chorus__abort_code), else -1. */
void chorus__tp_send_control(chorus__tp_t *tp, peer_t *c, int type, uint64_t ep_id,
                             const char *text, int32_t tag) {
  if (c->dead || !c->chan || tp->exiting == 2) return;
  txitem_t *it = calloc(1, sizeof *it);
  if (!it) return;
  size_t len = text ? strlen(text) : 0;
  if (len > MAX_ABORT_TEXT) len = MAX_ABORT_TEXT;
  if (len) {
    it->owned = malloc(len);
    if (!it->owned) {
      free(it);
      return;
    }
    memcpy(it->owned, text, len);
  }
  hdr_t h = {.magic = MSG_MAGIC, .type = (uint16_t)type, .ep_id = ep_id, .tag = tag, .len = len};
  h.fp.root = -1;
  chorus__wire_encode(&h, it->hdr);
  it->payload = it->owned;
  it->len = len;
  c->chan->ops->send(c->chan, c, it);
}

/* The message it belongs to once it is written or lost, when that was its
 * last item still out (chorus__tx_t: pieces); NULL while others are. */
static chorus__tx_t *tx_last_piece(chorus__tx_t *it) {
  chorus__tx_t *w = it->whole ? it->whole : it;
  if (it != w) chorus__tx_free(it);
  return w->pieces && --w->pieces ? NULL : w;
}

void chorus__tp_tx_lost(chorus__tp_t *tp, peer_t *p, chorus__tx_t *it) {
  (void)tp;
  chorus__tx_t *w = it->whole ? it->whole : it;
  if (w->req && w->ep && w->ep->status == CHORUS_OK)
    chorus__ep_fail_locked(w->ep, CHORUS_ERR_REMOTE, 0, "chorus: send to world rank %d failed: %s",
                           p->rank, chorus__peer_why(p));
  w->req = NULL; /* lost once: it never completes */
  if ((w = tx_last_piece(it))) chorus__tx_free(w);
}

void chorus__tp_tx_done(chorus__tp_t *tp, chorus__tx_t *it) {
  chorus__tx_t *w = tx_last_piece(it);
  if (!w) return;
  if (w->req) {
    w->req->done = 1;
    wake_all(tp);
  }
  chorus__tx_free(w);
}

/* ---------------------------------------------------------- endpoints */

/* Orders members by world rank (chorus__ep_group). */
static int member_cmp(const void *a, const void *b) {
  int x = ((const struct chorus__member *)a)->world, y = ((const struct chorus__member *)b)->world;
  return (x > y) - (x < y);
}

chorus_result_t chorus__ep_create(chorus__tp_t *tp, uint64_t id, const int *members, int n,
                                  int me, chorus__ep_t **out) {
  if (__atomic_load_n(&tp->exiting, __ATOMIC_ACQUIRE)) return CHORUS_ERR_ABORTED;
  chorus__ep_t *ep = calloc(1, sizeof *ep);
  if (!ep) return CHORUS_ERR_NO_MEMORY;
  ep->members = malloc(sizeof(int) * (size_t)n);
  int same = n == tp->size; /* group rank g is world rank g */
  for (int g = 0; g < n && same; g++) same = members[g] == g;
  if (!same) ep->by_world = malloc(sizeof *ep->by_world * (size_t)n);
  if (!ep->members || (!same && !ep->by_world)) {
    free(ep->members);
    free(ep->by_world);
    free(ep);
    return CHORUS_ERR_NO_MEMORY;
  }
  for (int g = 0; g < n; g++) {
    ep->members[g] = members[g];
    if (!same) ep->by_world[g] = (struct chorus__member){members[g], g};
  }
  if (!same) qsort(ep->by_world, (size_t)n, sizeof *ep->by_world, member_cmp);
  ep->tp = tp;
  ep->id = id;
  ep->n = n;
  ep->me = me;
  ep->status = CHORUS_OK;
  pthread_mutex_lock(&tp->lock);
  if (chorus__tp_find_ep(tp, id)) {
    pthread_mutex_unlock(&tp->lock);
    free(ep->members);
    free(ep->by_world);
    free(ep);
    return CHORUS_ERR_INTERNAL;
  }
  ep->next = tp->eps;
  tp->eps = ep;
  /* A member may have died, or reported an error, before we got here. */
  for (int g = 0; g < n; g++) {
    peer_t *c = chorus__tp_peer_if(tp, members[g]); /* NULL: never touched, not dead */
    if (!c) continue;
    if (g != me && c->dead && !c->bye_received && c->dead_code == CHORUS_ERR_PROTOCOL)
      chorus__ep_fail_locked(
          ep, CHORUS_ERR_PROTOCOL, 0,
          "chorus rank %d/%d: the connection with rank %d (world rank %d, %s) failed "
          "earlier: %s",
          me, n, g, members[g], c->addr, chorus__peer_why(c));
    else if (g != me && c->dead && !c->bye_received)
      chorus__ep_fail_locked(
          ep, c->dead_code ? c->dead_code : CHORUS_ERR_REMOTE, 0,
          "chorus rank %d/%d: rank %d (world rank %d, %s) is gone (its connection "
          "closed earlier: %s)",
          me, n, g, members[g], c->addr, chorus__peer_why(c));
  }
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type == T_ABORT && u->h.ep_id == id && chorus__ep_group(ep, u->src) >= 0) {
      char rd[64], text[MAX_ABORT_TEXT + 1];
      chorus__ep_rank_desc(ep, chorus__ep_group(ep, u->src), rd, sizeof rd);
      chorus__escape(u->buf ? u->buf : "", u->h.len, text, sizeof text);
      chorus__ep_fail_locked(ep, chorus__abort_code(u->h.tag), 0,
                             "chorus rank %d/%d: %s reported an error: %s", me, n, rd, text);
      break;
    }
  }
  pthread_mutex_unlock(&tp->lock);
  *out = ep;
  return CHORUS_OK;
}

void chorus__ep_destroy(chorus__ep_t *ep) {
  if (!ep) return;
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  if (tp->exiting) {
    /* The channels are closed for good (tp_on_exit): the endpoint stays
     * listed and allocated, as its world does, until the process ends. */
    pthread_mutex_unlock(&tp->lock);
    return;
  }
  chorus__ep_detach_requests(tp, ep);
  for (chorus__ep_t **pp = &tp->eps; *pp; pp = &(*pp)->next) {
    if (*pp == ep) {
      *pp = ep->next;
      break;
    }
  }
  /* Messages for it that can no longer be received. */
  unexp_t **pp = &tp->unexp_head, *prev = NULL;
  while (*pp) {
    unexp_t *u = *pp;
    if (u->h.ep_id == ep->id && u->complete) {
      *pp = u->next;
      if (tp->unexp_tail == u) tp->unexp_tail = prev;
      chorus__tp_free_unexp(tp, u);
      continue;
    }
    prev = u;
    pp = &u->next;
  }
  chorus__tp_resume_all(tp); /* messages for it that wait in sockets are discarded */
  pthread_mutex_unlock(&tp->lock);
  free(ep->members);
  free(ep->by_world);
  free(ep);
}

chorus_result_t chorus__ep_begin(chorus__ep_t *ep, uint64_t seq, const chorus__fp_t *fp) {
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  /* Collectives of an endpoint run one after the other: every earlier
   * one is over (chorus__ep_end leaves this to us, to stay lock-free). */
  if (seq - 1 > ep->done_seq) ep->done_seq = seq - 1;
  __atomic_store_n(&ep->in_coll, 1, __ATOMIC_RELEASE);
  ep->cur_seq = seq;
  ep->cur_fp = *fp;
  ep->name[0] = '\0';
  for (unexp_t *u = tp->unexp_head; u && ep->status == CHORUS_OK; u = u->next) {
    if (u->h.type == T_DATA && u->h.ep_id == ep->id && u->h.kind == CHORUS__KIND_COLL &&
        u->h.seq <= seq)
      chorus__ep_check_data_header(ep, &u->h, u->src);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* No lock: a small collective costs about as much as two lock round
 * trips.  done_seq catches up at the next begin, so a stray message for
 * this call that arrives in between waits in the unexpected list until
 * then and is reported as a mismatch there. */
void chorus__ep_end(chorus__ep_t *ep, uint64_t seq) {
  (void)seq;
  __atomic_store_n(&ep->in_coll, 0, __ATOMIC_RELEASE);
}

/* The send half of chorus__ep_post (ep not failed, lock held): queues req
 * to world rank world, whose state is made now if need be.  CHORUS_OK, or
 * ep's failure, or NO_MEMORY. */
static chorus_result_t post_send(chorus__ep_t *ep, chorus__req_t *req, int world) {
  peer_t *c = chorus__tp_peer(ep->tp, world);
  if (!c) return CHORUS_ERR_NO_MEMORY;
  if (c->dead || c->bye_received) {
    chorus__ep_fail_peer_left(ep, c, "needs to send to it");
    return ep->status;
  }
  txitem_t *it = calloc(1, sizeof *it);
  if (!it) return CHORUS_ERR_NO_MEMORY;
  hdr_t h = {.magic = MSG_MAGIC, .type = T_DATA, .kind = (uint16_t)req->kind, .ep_id = ep->id,
             .seq = req->seq, .step = req->step, .tag = req->tag, .len = req->len};
  h.fp = ep->cur_fp;
  if (req->kind == CHORUS__KIND_P2P) h.fp = req->fp; /* its own description */
  chorus__wire_encode(&h, it->hdr);
  it->payload = req->buf;
  it->len = req->len;
  it->req = req;
  it->ep = ep;
  c->chan->ops->send(c->chan, c, it);
  return ep->status;
}

chorus_result_t chorus__ep_post(chorus__ep_t *ep, chorus__req_t *req) {
  chorus__tp_t *tp = ep->tp;
  req->done = 0;
  req->got = req->until = 0;
  req->ep = ep;
  req->next = NULL;
  int any = req->peer == CHORUS__ANY_PEER;
  if (any ? req->type != CHORUS__REQ_RECV || req->kind != CHORUS__KIND_P2P
          : req->peer < 0 || req->peer >= ep->n || req->peer == ep->me)
    return CHORUS_ERR_INTERNAL;
  chorus__tp_lock(tp);
  req->seq = req->kind == CHORUS__KIND_COLL ? ep->cur_seq : 0;
  chorus_result_t st = ep->status;
  if (st == CHORUS_OK)
    st = req->type == CHORUS__REQ_SEND ? post_send(ep, req, ep->members[req->peer]) /* never any */
                                       : chorus__ep_post_recv(ep, req);
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* ------------------------------------------------------------ waiting */

void chorus__tp_wake(chorus__tp_t *tp) {
  pthread_cond_broadcast(&tp->cond);
  if (tp->nsleep) __atomic_store_n(&tp->kicked, tp->nsleep, __ATOMIC_SEQ_CST);
}

/* Whether a pending request moves on the shared-memory channel (for a
 * receive from any source: every other member is on it). */
static int req_on_local(const chorus__ep_t *ep, const chorus__req_t *r) {
  const chorus__tp_t *tp = ep->tp;
  if (r->peer != CHORUS__ANY_PEER) return chorus__tp_chan_of(tp, ep->members[r->peer]) == tp->local;
  for (int g = 0; g < ep->n; g++)
    if (g != ep->me && chorus__tp_chan_of(tp, ep->members[g]) != tp->local) return 0;
  return 1;
}

static chorus_result_t ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int64_t deadline,
                               int timeout_ms, int fatal);

/* Whether a wait may stop waiting for r: done, or the prefix it waits for
 * (until) is in. */
static int req_ready(const chorus__req_t *r) { return r->done || (r->until && r->got >= r->until); }

chorus_result_t chorus__ep_wait_prefix(chorus__ep_t *ep, chorus__req_t *req, size_t want,
                                       int timeout_ms) {
  chorus__tp_t *tp = ep->tp;
  chorus__tp_lock(tp);
  int ready = req->done || req->got >= want;
  if (!ready) req->until = want; /* > got >= 0 */
  pthread_mutex_unlock(&tp->lock);
  if (ready) return CHORUS_OK;
  chorus__req_t *one[1] = {req};
  chorus_result_t st = chorus__ep_wait(ep, one, 1, timeout_ms);
  chorus__tp_lock(tp);
  req->until = 0;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

chorus_result_t chorus__ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int timeout_ms) {
  return ep_wait(ep, reqs, n, chorus__deadline_ms(timeout_ms), timeout_ms, 1);
}

chorus_result_t chorus__ep_wait_soft(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                     int timeout_ms) {
  return ep_wait(ep, reqs, n, chorus__deadline_ms(timeout_ms), timeout_ms, 0);
}

chorus_result_t chorus__ep_wait_until(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                      int64_t deadline, int timeout_ms) {
  return ep_wait(ep, reqs, n, deadline, timeout_ms, 1);
}

/* A thread waiting on the shared-memory channel polls it until nothing
 * moved for SPIN_NS, pause-spinning the first SPIN_PAUSE_NS of that and
 * yielding the CPU for the rest (all of it when tp->crowded). */
#define SPIN_NS 50000
#define SPIN_PAUSE_NS 5000

static chorus_result_t ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int64_t deadline,
                               int timeout_ms, int fatal) {
  chorus__tp_t *tp = ep->tp;
  chorus__chan_t *local = tp->local;
  int64_t spin_until = 0;
  int polling = 0;
  chorus__tp_lock(tp);
  for (;;) {
    if (ep->status != CHORUS_OK) break;
    int all = 1;
    for (int i = 0; i < n && all; i++)
      if (reqs[i] && !req_ready(reqs[i])) all = 0;
    if (all) break;
    /* Polling helps when the shared-memory channel carries every request
     * still pending; the others move on the progress thread, which the
     * polling would keep from the CPU. */
    int on_local = local != NULL;
    for (int i = 0; on_local && i < n; i++)
      if (reqs[i] && !req_ready(reqs[i]) && !req_on_local(ep, reqs[i])) on_local = 0;
    if (on_local) {
      /* Shared memory: move bytes on this thread before blocking, until
       * nothing moved for SPIN_NS (or the deadline came), announced so the
       * peers need not ring this rank meanwhile. */
      int moved = local->ops->progress(local);
      int64_t now = chorus__now_ns();
      if (moved && now < deadline) {
        spin_until = 0;
        continue;
      }
      if (!spin_until) spin_until = CHORUS__MIN(now + SPIN_NS, deadline);
      if (now < spin_until) {
        if (!polling) local->ops->polling(local, 1);
        polling = 1;
        pthread_mutex_unlock(&tp->lock);
        /* Pause-spin the first few microseconds (a peer about to answer),
         * then sched_yield: whatever else wants this CPU -- the peer
         * itself, on a crowded host -- runs first. */
        if (tp->crowded || spin_until - now < SPIN_NS - SPIN_PAUSE_NS) sched_yield();
        else for (int k = 0; k < 32; k++) chorus__cpu_relax();
        chorus__tp_lock(tp);
        continue;
      }
      if (polling) {
        /* A sender that saw us polling did not ring: look once more. */
        local->ops->polling(local, 0);
        polling = 0;
        continue;
      }
    }
    if (chorus__ms_left(deadline) == 0 && !fatal) {
      pthread_mutex_unlock(&tp->lock);
      return CHORUS_INPROGRESS;
    }
    if (chorus__ms_left(deadline) == 0) {
      char who[512];
      size_t off = 0;
      who[0] = '\0';
      for (int i = 0; i < n && off < sizeof who; i++) {
        if (!reqs[i] || req_ready(reqs[i])) continue;
        char rd[64];
        if (reqs[i]->peer == CHORUS__ANY_PEER) snprintf(rd, sizeof rd, "any rank");
        else chorus__ep_rank_desc(ep, reqs[i]->peer, rd, sizeof rd);
        off += (size_t)snprintf(who + off, sizeof who - off, "%s%s %s", off ? ", " : "",
                                reqs[i]->type == CHORUS__REQ_SEND ? "sending to" : "receiving from",
                                rd);
      }
      chorus__ep_fail_timeout_locked(ep, timeout_ms, who);
      break;
    }
    struct timespec ts = chorus__deadline_timespec(deadline);
    tp->nsleep++;
    pthread_cond_timedwait(&tp->cond, &tp->lock, &ts);
    tp->nsleep--;
    if (__atomic_load_n(&tp->kicked, __ATOMIC_SEQ_CST) > 0)
      __atomic_sub_fetch(&tp->kicked, 1, __ATOMIC_SEQ_CST);
  }
  if (polling) local->ops->polling(local, 0);
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}
