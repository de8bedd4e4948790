/*
 * endpoint.c - the part of the transport that does not depend on how bytes
 * travel (chan.h): endpoints, matching of messages to receives, messages
 * that arrive early and their per-peer budget, the failure model of
 * transport.h, heartbeats and the silence detector, goodbyes, and the
 * progress thread that runs the channels' descriptors.
 *
 * Every received header is validated before anything is done with it: the
 * magic, the type, the length (bounded), the kind and fingerprint ranges
 * (chorus__wire_check), then the endpoint membership of the sender, the
 * sequence number (not from the past) and the fingerprint.
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

#include "transport/chan.h"
#include "transport/transport.h"
#include "transport/wire.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

/* Short names for wire.h's header constants. */
#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
#define MSG_MAGIC CHORUS__WIRE_MAGIC
#define MAX_ABORT_TEXT CHORUS__WIRE_MAX_ABORT_TEXT
#define HEARTBEAT_MS CHORUS__HEARTBEAT_MS
enum {
  T_DATA = CHORUS__WIRE_DATA,
  T_ABORT = CHORUS__WIRE_ABORT,
  T_BYE = CHORUS__WIRE_BYE,
  T_PING = CHORUS__WIRE_PING,
  T_HEAD = CHORUS__WIRE_HEAD
};
typedef chorus__wire_hdr_t hdr_t;
typedef chorus__tx_t txitem_t;
typedef chorus__unexp_t unexp_t;
typedef chorus__peer_t peer_t;
typedef chorus__rx_t rx_t;

struct chorus__ep {
  chorus__tp_t *tp;
  struct chorus__ep *next;
  uint64_t id;
  int n, me;
  int *members;  /* group rank -> world rank */
  int *w2g;      /* world rank -> group rank, -1 if not a member */
  uint64_t cur_seq, done_seq;
  int in_coll;
  chorus__fp_t cur_fp;
  chorus_result_t status;
  char msg[1024];
  char name[256]; /* ep_doing's text for the current call, formatted on first use */
  chorus__req_t *recvs; /* posted, unmatched receives (FIFO) */
  int failed;           /* atomic copy of status != OK, read without the lock */
  void (*fail_hook)(void *);
  void *fail_arg;
};

int chorus__fp_equal(const chorus__fp_t *a, const chorus__fp_t *b) {
  return a->coll == b->coll && a->dtype == b->dtype && a->op == b->op &&
         a->algo == b->algo && a->root == b->root && a->count == b->count;
}

/* ----------------------------------------------------------- failures */

void chorus__tp_wake(chorus__tp_t *tp) {
  pthread_cond_broadcast(&tp->cond);
  if (tp->nsleep) __atomic_store_n(&tp->kicked, tp->nsleep, __ATOMIC_SEQ_CST);
}
#define wake_all chorus__tp_wake

void chorus__tp_kick(chorus__tp_t *tp) {
  uint64_t one = 1;
  if (tp->evfd >= 0) (void)!write(tp->evfd, &one, sizeof one);
}

static void resume_all(chorus__tp_t *tp);

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

/* tag: for T_ABORT the code the sender failed with (abort_code), else -1. */
static void send_control(chorus__tp_t *tp, peer_t *c, int type, uint64_t ep_id,
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

/* Removes every trace of ep's requests from the peers' streams so the
 * callers may free them: the channels drop or copy its sends (cancel),
 * payloads being received into its receives are discarded. */
static void detach_requests(chorus__tp_t *tp, chorus__ep_t *ep) {
  if (tp->exiting == 2) return; /* the channels are closed for good (tp_on_exit) */
  for (int r = 0; r < tp->size; r++) {
    peer_t *c = &tp->peers[r];
    if (r == tp->rank || !c->chan) continue;
    for (rx_t *rx = c->rxs; rx; rx = rx->next) {
      if (rx->req && rx->req->ep == ep) {
        rx->req = NULL;
        rx->dst = NULL; /* discard the rest of this payload */
      }
    }
    if (c->chan->ops->cancel(c->chan, c, ep) < 0)
      chorus__tp_peer_failed(tp, c, "could not be given back a message of a failed "
                             "communicator (out of memory, or the peer did not release it in time)",
                             CHORUS_ERR_REMOTE);
  }
  for (unexp_t *u = tp->unexp_head; u; u = u->next)
    if (u->req && u->req->ep == ep) u->req = NULL;
  ep->recvs = NULL;
}

/* The code a peer's ABORT makes this rank fail with: the sender's own for
 * the failures the whole group shares (a mismatch is one for everyone, so
 * is a timeout the group hit), REMOTE for the rest (a peer's abort or
 * broken connection is not this rank's) and for anything else the
 * untrusted tag holds. */
static chorus_result_t abort_code(int32_t tag) {
  if (tag == CHORUS_ERR_MISMATCH || tag == CHORUS_ERR_TIMEOUT)
    return (chorus_result_t)tag;
  return CHORUS_ERR_REMOTE;
}

static void ep_vfail_locked(chorus__ep_t *ep, chorus_result_t code, int notify,
                            const char *fmt, va_list ap) {
  if (ep->status != CHORUS_OK) return;
  ep->status = code;
  vsnprintf(ep->msg, sizeof ep->msg, fmt, ap);
  __atomic_store_n(&ep->failed, 1, __ATOMIC_SEQ_CST);
  if (ep->fail_hook) ep->fail_hook(ep->fail_arg); /* wakes shared-memory waiters */
  /* Not logged here: a write to a full stderr pipe under the transport lock
   * would stall every wait and abort.  The core logs it when it returns. */
  detach_requests(ep->tp, ep);
  resume_all(ep->tp); /* held-back messages for it are discarded now */
  if (notify) {
    for (int g = 0; g < ep->n; g++) {
      if (g == ep->me) continue;
      send_control(ep->tp, &ep->tp->peers[ep->members[g]], T_ABORT, ep->id, ep->msg,
                   (int32_t)ep->status);
    }
  }
  wake_all(ep->tp);
}

static void ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
                           ...) __attribute__((format(printf, 4, 5)));
static void ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
                           ...) {
  va_list ap;
  va_start(ap, fmt);
  ep_vfail_locked(ep, code, notify, fmt, ap);
  va_end(ap);
}

void chorus__ep_fail(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt, ...) {
  pthread_mutex_lock(&ep->tp->lock);
  va_list ap;
  va_start(ap, fmt);
  ep_vfail_locked(ep, code, notify, fmt, ap);
  va_end(ap);
  pthread_mutex_unlock(&ep->tp->lock);
}

chorus_result_t chorus__ep_status(chorus__ep_t *ep, char *msg, size_t cap) {
  pthread_mutex_lock(&ep->tp->lock);
  chorus_result_t st = ep->status;
  if (msg && cap) snprintf(msg, cap, "%s", ep->msg);
  pthread_mutex_unlock(&ep->tp->lock);
  return st;
}

int chorus__ep_rank_desc(const chorus__ep_t *ep, int g, char *buf, size_t cap) {
  if (g < 0 || g >= ep->n || (ep->n == ep->tp->size && ep->members[g] == g))
    return snprintf(buf, cap, "rank %d", g);
  return snprintf(buf, cap, "rank %d (world rank %d)", g, ep->members[g]);
}

/* "rank 2 of comm 0x... (world rank 5, 127.0.0.1:4000)" style peer name. */
static void peer_desc(chorus__ep_t *ep, int world, char *buf, size_t cap) {
  int g = ep->w2g[world];
  if (g == world && ep->n == ep->tp->size)
    snprintf(buf, cap, "rank %d (%s)", g, ep->tp->peers[world].addr);
  else
    snprintf(buf, cap, "rank %d (world rank %d, %s)", g, world, ep->tp->peers[world].addr);
}

/* What ep is doing, for failure messages (lock held).  The current
 * collective is formatted here, when a message needs it, not when it
 * starts: formatting every call would cost more than a small collective. */
static const char *ep_doing(chorus__ep_t *ep) {
  if (__atomic_load_n(&ep->in_coll, __ATOMIC_ACQUIRE)) {
    if (ep->name[0]) return ep->name;
    char fp[200];
    ep->tp->fp_format(&ep->cur_fp, fp, sizeof fp);
    snprintf(ep->name, sizeof ep->name, "%s (call #%" PRIu64 ")", fp, ep->cur_seq);
    return ep->name;
  }
  return "communication outside any collective (send/recv)";
}

void chorus__ep_doing(chorus__ep_t *ep, char *buf, size_t cap) {
  pthread_mutex_lock(&ep->tp->lock);
  snprintf(buf, cap, "%s", ep_doing(ep));
  pthread_mutex_unlock(&ep->tp->lock);
}

int chorus__ep_failed(chorus__ep_t *ep) { return __atomic_load_n(&ep->failed, __ATOMIC_SEQ_CST); }

void chorus__ep_set_fail_hook(chorus__ep_t *ep, void (*fn)(void *), void *arg) {
  pthread_mutex_lock(&ep->tp->lock);
  ep->fail_hook = fn;
  ep->fail_arg = arg;
  pthread_mutex_unlock(&ep->tp->lock);
}

/* Whether c's channel connects it (CHORUS__LINK_*), *since when it is
 * being connected. */
static int link_state(peer_t *c, int64_t *since) {
  *since = 0;
  if (!c->chan) return CHORUS__LINK_NONE;
  if (!c->chan->ops->link_state) return CHORUS__LINK_READY;
  return c->chan->ops->link_state(c->chan, c, since);
}

static int linked(peer_t *c) {
  int64_t since;
  return link_state(c, &since) == CHORUS__LINK_READY;
}

/* Whether every other member left (said goodbye or is gone): nothing can
 * come any more for a receive from any source. */
static int others_gone(const chorus__ep_t *ep) {
  for (int g = 0; g < ep->n; g++) {
    const peer_t *p = &ep->tp->peers[ep->members[g]];
    if (g != ep->me && !p->dead && !p->bye_received) return 0;
  }
  return 1;
}

/* Whether a pending request moves on the shared-memory channel (for a
 * receive from any source: every other member is on it). */
static int req_on_local(const chorus__ep_t *ep, const chorus__req_t *r) {
  const chorus__tp_t *tp = ep->tp;
  if (r->peer != CHORUS__ANY_PEER) return tp->peers[ep->members[r->peer]].chan == tp->local;
  for (int g = 0; g < ep->n; g++)
    if (g != ep->me && tp->peers[ep->members[g]].chan != tp->local) return 0;
  return 1;
}

/* Fails ep because peer c left (said goodbye, or its connection is gone)
 * while ep still needs it; need says how ("waits for its data"). */
static void fail_peer_left(chorus__ep_t *ep, peer_t *c, const char *need) {
  char pd[160];
  peer_desc(ep, c->rank, pd, sizeof pd);
  ep_fail_locked(ep, CHORUS_ERR_REMOTE, 1, "chorus rank %d/%d: %s %s, but %s %s", ep->me, ep->n,
                 pd, c->bye_received ? "destroyed its communicator" : "is gone (its connection closed)",
                 ep_doing(ep), need);
}

/* Fails ep with a timeout: who says what this rank waited for; the members
 * that stopped talking altogether (no heartbeat) are named as culprits,
 * since the ranks we wait for may just be waiting for them. */
static void ep_fail_timeout_locked(chorus__ep_t *ep, int timeout_ms, const char *who) {
  chorus__tp_t *tp = ep->tp;
  char silent[512];
  size_t so = 0;
  silent[0] = '\0';
  int64_t now = chorus__now_ns();
  for (int g = 0; g < ep->n && so < sizeof silent; g++) {
    peer_t *pc = &tp->peers[ep->members[g]];
    if (g == ep->me || pc->dead) continue;
    int64_t dialed;
    int ls = link_state(pc, &dialed);
    if (ls == CHORUS__LINK_DIALING && now - dialed > (int64_t)4 * HEARTBEAT_MS * 1000000) {
      char rd[64];
      chorus__ep_rank_desc(ep, g, rd, sizeof rd);
      so += (size_t)snprintf(silent + so, sizeof silent - so,
                             "%s%s (this rank has been connecting to it for %lld ms)",
                             so ? ", " : "", rd, (long long)((now - dialed) / 1000000));
      continue;
    }
    if (ls != CHORUS__LINK_READY) continue; /* never connected: its silence means nothing */
    int64_t quiet_ms = (now - pc->last_heard) / 1000000;
    if (pc->npaused) {
      int64_t since = now;
      for (rx_t *rx = pc->rxs; rx; rx = rx->next)
        if (rx->paused && rx->paused_since < since) since = rx->paused_since;
      char rd[64];
      chorus__ep_rank_desc(ep, g, rd, sizeof rd);
      so += (size_t)snprintf(silent + so, sizeof silent - so,
                             "%sthis rank stopped reading from %s %lld ms ago: %zu bytes of its "
                             "messages wait for receives, which is CHORUS_RECV_BUFFER_MAX (%zu); "
                             "the ranks receive in an order that needs more buffering",
                             so ? ", " : "", rd,
                             (long long)((now - since) / 1000000), pc->unexp_bytes,
                             tp->budget);
    } else if (quiet_ms > 4 * HEARTBEAT_MS) {
      char rd[64];
      chorus__ep_rank_desc(ep, g, rd, sizeof rd);
      so += (size_t)snprintf(silent + so, sizeof silent - so, "%s%s (silent for %lld ms)",
                             so ? ", " : "", rd, (long long)quiet_ms);
    }
  }
  ep_fail_locked(ep, CHORUS_ERR_TIMEOUT, 1, "chorus rank %d/%d: %s timed out after %d ms %s; %s%s%s",
                 ep->me, ep->n, ep_doing(ep), timeout_ms, who,
                 so ? "not responding at all: " : "",
                 so ? silent : "no rank is silent, so a rank is slow or stuck in user code",
                 so ? " (stopped, hung or overloaded; raise CHORUS_TIMEOUT if merely slow)"
                    : " (raise CHORUS_TIMEOUT if it is just slow)");
}

void chorus__ep_fail_timeout(chorus__ep_t *ep, int timeout_ms, const char *who) {
  pthread_mutex_lock(&ep->tp->lock);
  ep_fail_timeout_locked(ep, timeout_ms, who);
  pthread_mutex_unlock(&ep->tp->lock);
}

int chorus__ep_peer_gone(chorus__ep_t *ep, int peer) {
  chorus__tp_t *tp = ep->tp;
  if (peer < 0 || peer >= ep->n || peer == ep->me) return 0;
  pthread_mutex_lock(&tp->lock);
  peer_t *c = &tp->peers[ep->members[peer]];
  int gone = c->dead || c->bye_received;
  pthread_mutex_unlock(&tp->lock);
  return gone;
}

int chorus__tp_peer_state(chorus__tp_t *tp, int w) {
  if (w < 0 || w >= tp->size || w == tp->rank) return CHORUS__PEER_ALIVE;
  pthread_mutex_lock(&tp->lock);
  peer_t *c = &tp->peers[w];
  const int64_t quiet_ns = (int64_t)4 * HEARTBEAT_MS * 1000000, now = chorus__now_ns();
  int64_t since;
  int ls = link_state(c, &since);
  int state = c->dead || c->bye_received ? CHORUS__PEER_GONE
              : ls == CHORUS__LINK_READY ? (now - c->last_heard > quiet_ns ? CHORUS__PEER_SILENT
                                                                          : CHORUS__PEER_ALIVE)
              : ls == CHORUS__LINK_DIALING && now - since > quiet_ns ? CHORUS__PEER_SILENT
                                                                     : CHORUS__PEER_ALIVE;
  /* Never connected: nothing tells whether it lives.  Connecting (a
   * heartbeat) does: a dead rank refuses, a live one answers, and one that
   * does neither turns silent above. */
  if (ls == CHORUS__LINK_NONE && state == CHORUS__PEER_ALIVE && c->chan)
    send_control(tp, c, T_PING, 0, NULL, -1);
  pthread_mutex_unlock(&tp->lock);
  return state;
}

void chorus__tp_link_desc(chorus__tp_t *tp, int w, char *buf, size_t cap) {
  if (w == tp->rank || w < 0 || w >= tp->size) {
    snprintf(buf, cap, w == tp->rank ? "self" : "none");
    return;
  }
  pthread_mutex_lock(&tp->lock);
  peer_t *p = &tp->peers[w];
  if (!p->chan)
    snprintf(buf, cap, "none");
  else if (p->dead)
    snprintf(buf, cap, "%s (connection gone)", p->chan->ops->name);
  else
    p->chan->ops->link_desc(p->chan, p, buf, cap);
  pthread_mutex_unlock(&tp->lock);
}

chorus_result_t chorus__ep_check_peer(chorus__ep_t *ep, int peer, const char *need) {
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  if (ep->status == CHORUS_OK && peer >= 0 && peer < ep->n && peer != ep->me) {
    peer_t *c = &tp->peers[ep->members[peer]];
    if (c->dead || c->bye_received) fail_peer_left(ep, c, need);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* Wakes the shared-memory waiters of every endpoint containing world rank
 * w (it left: they must re-check whether what they wait for can come). */
static void wake_hooks_of(chorus__tp_t *tp, int w) {
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    if (ep->w2g[w] >= 0 && ep->fail_hook) ep->fail_hook(ep->fail_arg);
}

/* The way to peer c ended.  Members of every endpoint containing it fail,
 * unless it said goodbye first, between two messages, and nothing is
 * pending with it.  code: CHORUS_ERR_PROTOCOL when the peer (or something
 * on the wire) broke the protocol, else CHORUS_ERR_REMOTE. */
void chorus__tp_peer_failed(chorus__tp_t *tp, peer_t *c, const char *why, chorus_result_t code) {
  if (c->dead) return;
  c->dead = 1;
  c->dead_code = code;
  snprintf(c->dead_why, sizeof c->dead_why, "%s", why);
  int clean = c->bye_received;
  for (rx_t *rx = c->rxs; rx; rx = rx->next)
    if (rx->in_payload || rx->hgot) clean = 0;
  wake_hooks_of(tp, c->rank);
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next) {
    int g = ep->w2g[c->rank];
    if (g < 0 || ep->status != CHORUS_OK) continue;
    int pending = c->chan && c->chan->ops->pending(c->chan, c, ep);
    for (chorus__req_t *r = ep->recvs; r; r = r->next)
      if (r->peer == g || r->peer == CHORUS__ANY_PEER) pending = 1;
    if (clean && !pending) continue;
    if (clean) {
      fail_peer_left(ep, c, "still exchanges data with it");
      continue;
    }
    char pd[160];
    peer_desc(ep, c->rank, pd, sizeof pd);
    if (code == CHORUS_ERR_PROTOCOL)
      ep_fail_locked(ep, code, 1, "chorus rank %d/%d: the connection with %s failed during %s: "
                     "%s; every other rank fails too", ep->me, ep->n, pd, ep_doing(ep), why);
    else
      ep_fail_locked(ep, code, 1,
                     "chorus rank %d/%d: %s %s during %s; the process probably died "
                     "(check its output); every other rank fails too",
                     ep->me, ep->n, pd, why, ep_doing(ep));
  }
  /* Stop reading it; sends queued to it can never complete. */
  for (rx_t *rx = c->rxs; rx; rx = rx->next) {
    if (rx->paused) c->npaused--;
    rx->paused = 0;
  }
  if (c->chan) c->chan->ops->close(c->chan, c);
  wake_all(tp);
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
    ep_fail_locked(w->ep, CHORUS_ERR_REMOTE, 0, "chorus: send to world rank %d failed: %s",
                   p->rank, p->dead_why);
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

void chorus__tp_rx_attach(chorus__tp_t *tp, peer_t *p, rx_t *rx, chorus__chan_t *ch, void *link) {
  (void)tp;
  memset(rx, 0, sizeof *rx);
  rx->src = p->rank;
  rx->chan = ch;
  rx->link = link;
  rx->next = p->rxs;
  p->rxs = rx;
}

void chorus__tp_rx_move(rx_t *from, rx_t *to) {
  to->h = from->h;
  to->dst = from->dst;
  to->left = from->left;
  to->req = from->req;
  to->unexp = from->unexp;
  to->in_payload = 1;
  from->dst = NULL;
  from->req = NULL;
  from->unexp = NULL;
  from->left = 0;
  from->in_payload = 0;
  from->hgot = 0;
}

void chorus__tp_rx_detach(peer_t *p, rx_t *rx) {
  for (rx_t **pp = &p->rxs; *pp; pp = &(*pp)->next)
    if (*pp == rx) {
      *pp = rx->next;
      return;
    }
}

/* ---------------------------------------------------------- receiving */

static int req_matches(const chorus__req_t *r, const hdr_t *h, int src_group) {
  if ((r->peer != src_group && r->peer != CHORUS__ANY_PEER) || r->kind != h->kind) return 0;
  if (h->kind == CHORUS__KIND_COLL) return r->seq == h->seq && r->step == h->step;
  return r->tag == h->tag;
}

/* Checks a data header against what ep executes; fails ep and returns -1 if
 * the sender is in a different call. */
static int check_data_header(chorus__ep_t *ep, const hdr_t *h, int src_world) {
  char pd[160], theirs[200], mine[200];
  if (h->kind != CHORUS__KIND_COLL) return 0;
  peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  if (h->seq <= ep->done_seq) {
    ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                   "chorus rank %d/%d: collective mismatch: %s sent data for its collective "
                   "#%" PRIu64 " %s, which this rank already completed without it; the ranks "
                   "called different collectives or with different arguments",
                   ep->me, ep->n, pd, h->seq, theirs);
    return -1;
  }
  if (__atomic_load_n(&ep->in_coll, __ATOMIC_ACQUIRE) && h->seq == ep->cur_seq &&
      !chorus__fp_equal(&h->fp, &ep->cur_fp)) {
    ep->tp->fp_format(&ep->cur_fp, mine, sizeof mine);
    ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                   "chorus rank %d/%d: collective mismatch at call #%" PRIu64 ": %s called %s "
                   "but rank %d called %s",
                   ep->me, ep->n, h->seq, pd, theirs, ep->me, mine);
    return -1;
  }
  return 0;
}

static int check_length(chorus__ep_t *ep, const chorus__req_t *r, const hdr_t *h, int src_world) {
  if (h->len == r->len &&
      (r->kind != CHORUS__KIND_P2P || (h->fp.dtype == r->fp.dtype && h->fp.count == r->fp.count)))
    return 0;
  char pd[160], theirs[200];
  peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                 "chorus rank %d/%d: %s sent %" PRIu64 " bytes for %s step %u but this rank "
                 "expected %zu bytes in %s; the ranks passed different counts",
                 ep->me, ep->n, pd, h->len, theirs, h->step, r->len, ep_doing(ep));
  return -1;
}

static chorus__ep_t *find_ep(chorus__tp_t *tp, uint64_t id) {
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    if (ep->id == id) return ep;
  return NULL;
}

void chorus__tp_protocol_error(chorus__tp_t *tp, peer_t *c, const char *what) {
  CHORUS_WARN(CHORUS__SUB_TCP, "chorus: protocol violation from world rank %d (%s): %s; "
              "closing the connection", c->rank, c->addr, what);
  char why[200];
  snprintf(why, sizeof why, "it sent a malformed message (%s)", what);
  chorus__tp_peer_failed(tp, c, why, CHORUS_ERR_PROTOCOL);
}

static unexp_t *new_unexp(chorus__tp_t *tp, const hdr_t *h, int src) {
  unexp_t *u = calloc(1, sizeof *u);
  if (!u) return NULL;
  u->h = *h;
  u->src = src;
  u->cost = (size_t)h->len + sizeof *u;
  tp->peers[src].unexp_bytes += u->cost;
  if (h->len) {
    u->buf = malloc(h->len);
    if (!u->buf) {
      tp->peers[src].unexp_bytes -= u->cost;
      free(u);
      return NULL;
    }
  }
  if (tp->unexp_tail) tp->unexp_tail->next = u;
  else tp->unexp_head = u;
  tp->unexp_tail = u;
  return u;
}

static void resume_peer(chorus__tp_t *tp, peer_t *c);
static void on_payload_done(chorus__tp_t *tp, rx_t *rx);

/* Frees a buffered message (already unlinked) and gives its bytes back to
 * its sender's budget. */
static void free_unexp(chorus__tp_t *tp, unexp_t *u) {
  peer_t *c = &tp->peers[u->src];
  c->unexp_bytes -= u->cost;
  free(u->buf);
  free(u);
  resume_peer(tp, c);
}

/* Whether a message of len bytes from c may be buffered now. */
static int budget_allows(const chorus__tp_t *tp, const peer_t *c, uint64_t len) {
  uint64_t cost = len + sizeof(unexp_t);
  return cost <= tp->budget && c->unexp_bytes <= tp->budget - cost;
}

static void unlink_unexp(chorus__tp_t *tp, unexp_t *u) {
  unexp_t **pp = &tp->unexp_head, *prev = NULL;
  while (*pp && *pp != u) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  if (!*pp) return;
  *pp = u->next;
  if (tp->unexp_tail == u) tp->unexp_tail = prev;
}

static void rx_pause(chorus__tp_t *tp, rx_t *rx) {
  peer_t *c = &tp->peers[rx->src];
  rx->paused = 1;
  rx->paused_since = chorus__now_ns();
  c->npaused++;
  rx->chan->ops->rx_pause(rx->chan, rx, 1);
  CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus: pausing world rank %d (%s): %zu bytes of its "
               "messages wait for receives, the next is %" PRIu64 " bytes (budget %zu)",
               c->rank, c->addr, c->unexp_bytes, rx->h.len, tp->budget);
}

/* Where the payload of the data message whose header rx holds goes: a
 * posted receive, a new buffer (within the sender's budget), or nowhere
 * (discard).  Returns 0 when it can go nowhere yet -- no receive and no
 * budget -- after pausing rx; try_resume runs this again.  Every check here
 * may run twice for one message: failing an endpoint that failed already
 * does nothing. */
static int route_data(chorus__tp_t *tp, rx_t *rx) {
  hdr_t *h = &rx->h;
  peer_t *c = &tp->peers[rx->src];
  rx->dst = NULL;
  rx->req = NULL;
  rx->unexp = NULL;
  if (tp->bye_sent) return 1; /* leaving: nothing will receive it */
  chorus__ep_t *ep = find_ep(tp, h->ep_id);
  if (ep) {
    int g = ep->w2g[c->rank];
    if (g < 0) {
      /* Ranks disagree on who is in this group (new_group with different
       * lists): fail the group, keep the connection. */
      if (ep->status == CHORUS_OK)
        ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                       "chorus rank %d/%d: world rank %d (%s) sent data for this group but "
                       "is not a member here: the ranks created the group with different "
                       "member lists", ep->me, ep->n, c->rank, c->addr);
      return 1; /* discard */
    }
    if (ep->status != CHORUS_OK) return 1; /* discard */
    if (check_data_header(ep, h, c->rank) < 0) return 1;
    for (chorus__req_t **pp = &ep->recvs; *pp; pp = &(*pp)->next) {
      chorus__req_t *r = *pp;
      if (!req_matches(r, h, g)) continue;
      *pp = r->next;
      if (check_length(ep, r, h, c->rank) < 0) return 1;
      r->peer = g; /* an any-source receive learns its sender */
      rx->req = r;
      rx->dst = r->buf;
      return 1;
    }
  }
  if (!budget_allows(tp, c, h->len)) {
    if (!rx->paused) rx_pause(tp, rx);
    return 0;
  }
  rx->unexp = new_unexp(tp, h, c->rank);
  if (!rx->unexp) {
    if (ep)
      ep_fail_locked(ep, CHORUS_ERR_NO_MEMORY, 1,
                     "chorus: out of memory buffering a %" PRIu64 "-byte message from "
                     "world rank %d", h->len, c->rank);
    return 1;
  }
  rx->dst = rx->unexp->buf;
  return 1;
}

/* Runs a paused stream's message through route_data again (a receive was
 * posted, buffered bytes were taken, an endpoint failed or went away, or
 * this rank is leaving); reading resumes if it can go somewhere now. */
static void try_resume(chorus__tp_t *tp, rx_t *rx) {
  peer_t *c = &tp->peers[rx->src];
  if (!rx->paused || c->dead) return;
  /* Cleared first: route_data may fail an endpoint, which resumes every
   * paused stream -- not this one a second time. */
  rx->paused = 0;
  c->npaused--;
  if (!route_data(tp, rx)) return; /* paused again */
  c->last_heard = chorus__now_ns(); /* it was not silent, we were not listening */
  rx->in_payload = 1;
  rx->left = rx->h.len;
  if (rx->left == 0) on_payload_done(tp, rx);
  rx->chan->ops->rx_pause(rx->chan, rx, 0);
}

static void resume_peer(chorus__tp_t *tp, peer_t *c) {
  for (rx_t *rx = c->rxs; rx && c->npaused; rx = rx->next)
    if (rx->paused) try_resume(tp, rx);
}

static void resume_all(chorus__tp_t *tp) {
  for (int r = 0; r < tp->size; r++)
    if (r != tp->rank && tp->peers[r].npaused) resume_peer(tp, &tp->peers[r]);
}

void chorus__tp_rx_header(chorus__tp_t *tp, rx_t *rx) {
  hdr_t *h = &rx->h;
  peer_t *c = &tp->peers[rx->src];
  chorus__wire_decode(rx->hbuf, h);
  rx->dst = NULL;
  rx->req = NULL;
  rx->unexp = NULL;
  rx->abort = NULL;
  /* Magic, type, length bounds, kind and fingerprint ranges. */
  const char *bad = chorus__wire_check(h);
  if (bad) return chorus__tp_protocol_error(tp, c, bad);
  switch (h->type) {
    case T_PING:
      break;
    case T_BYE:
      c->bye_received = 1;
      /* Nothing more will come from it: receives still waiting for it fail. */
      for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next) {
        int g = ep->w2g[c->rank];
        if (g < 0 || ep->status != CHORUS_OK) continue;
        for (chorus__req_t *r = ep->recvs; r; r = r->next) {
          if (r->peer == CHORUS__ANY_PEER ? !others_gone(ep) : r->peer != g) continue;
          fail_peer_left(ep, c, "waits for its data");
          break;
        }
      }
      wake_hooks_of(tp, c->rank);
      wake_all(tp);
      break;
    case T_ABORT:
      /* At most MAX_ABORT_TEXT bytes (chorus__wire_check); kept for a
       * later endpoint only within the sender's budget (on_payload_done). */
      rx->abort = calloc(1, h->len + 1);
      rx->abort_len = h->len;
      rx->dst = rx->abort; /* NULL (out of memory): the text is discarded */
      break;
    case T_HEAD:
      if (!rx->pieces_ok)
        return chorus__tp_protocol_error(tp, c, "message in pieces on a connection that "
                                                "carries none");
      h->type = T_DATA; /* the DATA message it is, for matching and buffering */
      __attribute__((fallthrough));
    case T_DATA:
      if (!route_data(tp, rx)) return; /* paused: the payload stays where it is */
      break;
    default: /* a PART (only the channel that cut it parses those), or rejected by wire_check */
      return chorus__tp_protocol_error(tp, c, "piece of a message outside its "
                                              "connection");
  }
  rx->in_payload = 1;
  rx->left = h->len;
  if (rx->left == 0) on_payload_done(tp, rx);
}

void chorus__tp_rx_bytes_to(chorus__tp_t *tp, rx_t *rx, size_t n, size_t end) {
  rx->left -= n;
  chorus__req_t *r = rx->req;
  if (r && end - n <= r->got && end > r->got) {
    r->got = end;
    if (r->until && end >= r->until) {
      r->until = 0;
      wake_all(tp);
    }
  }
  if (rx->unexp) {
    rx->unexp->got += n;
    if (end > rx->unexp->hi) rx->unexp->hi = end;
  }
  if (rx->left == 0) on_payload_done(tp, rx);
}

void chorus__tp_rx_bytes(chorus__tp_t *tp, rx_t *rx, size_t n) {
  chorus__tp_rx_bytes_to(tp, rx, n, (size_t)rx->h.len - (rx->left - n));
}

/* The stream filling early-message buffer u, if its channel lets the rest
 * of the payload go elsewhere. */
static rx_t *unexp_stream(chorus__tp_t *tp, const unexp_t *u) {
  for (rx_t *rx = tp->peers[u->src].rxs; rx; rx = rx->next)
    if (rx->unexp == u) return rx->dst_fixed ? NULL : rx;
  return NULL;
}

static void on_payload_done(chorus__tp_t *tp, rx_t *rx) {
  peer_t *c = &tp->peers[rx->src];
  rx->in_payload = 0;
  rx->hgot = 0;
  if (rx->req) {
    rx->req->done = 1;
    rx->req = NULL;
    wake_all(tp);
  } else if (rx->unexp) {
    unexp_t *u = rx->unexp;
    rx->unexp = NULL;
    u->complete = 1;
    if (u->req) {
      if (u->h.len) memcpy(u->req->buf, u->buf, u->h.len);
      u->req->done = 1;
      unlink_unexp(tp, u);
      free_unexp(tp, u);
      wake_all(tp);
    }
  } else if (rx->abort) {
    chorus__ep_t *ep = find_ep(tp, rx->h.ep_id);
    if (ep) {
      if (ep->w2g[c->rank] >= 0) {
        /* Forward it: whatever this rank sends later (a goodbye, say) must
         * not reach a peer before the cause does. */
        char rd[64], text[MAX_ABORT_TEXT + 1];
        chorus__ep_rank_desc(ep, ep->w2g[c->rank], rd, sizeof rd);
        /* The peer's text is untrusted: escaped before any log or message. */
        chorus__escape(rx->abort, rx->abort_len, text, sizeof text);
        ep_fail_locked(ep, abort_code(rx->h.tag), 1, "chorus rank %d/%d: %s reported an error: %s",
                       ep->me, ep->n, rd, text);
      }
      free(rx->abort);
    } else if (!budget_allows(tp, c, rx->h.len)) {
      free(rx->abort); /* a flood of records for unknown endpoints */
    } else {
      /* For an endpoint not created yet: keep it; ep_create will see it. */
      unexp_t *u = new_unexp(tp, &rx->h, c->rank);
      if (u) {
        free(u->buf);
        u->buf = rx->abort;
        u->complete = 1;
      } else {
        free(rx->abort);
      }
    }
    rx->abort = NULL;
  }
}

/* ---------------------------------------------------------- endpoints */

chorus_result_t chorus__ep_create(chorus__tp_t *tp, uint64_t id, const int *members, int n,
                                  int me, chorus__ep_t **out) {
  if (__atomic_load_n(&tp->exiting, __ATOMIC_ACQUIRE)) return CHORUS_ERR_ABORTED;
  chorus__ep_t *ep = calloc(1, sizeof *ep);
  if (!ep) return CHORUS_ERR_NO_MEMORY;
  ep->members = malloc(sizeof(int) * (size_t)n);
  ep->w2g = malloc(sizeof(int) * (size_t)tp->size);
  if (!ep->members || !ep->w2g) {
    free(ep->members);
    free(ep->w2g);
    free(ep);
    return CHORUS_ERR_NO_MEMORY;
  }
  for (int w = 0; w < tp->size; w++) ep->w2g[w] = -1;
  for (int g = 0; g < n; g++) {
    ep->members[g] = members[g];
    ep->w2g[members[g]] = g;
  }
  ep->tp = tp;
  ep->id = id;
  ep->n = n;
  ep->me = me;
  ep->status = CHORUS_OK;
  pthread_mutex_lock(&tp->lock);
  if (find_ep(tp, id)) {
    pthread_mutex_unlock(&tp->lock);
    free(ep->members);
    free(ep->w2g);
    free(ep);
    return CHORUS_ERR_INTERNAL;
  }
  ep->next = tp->eps;
  tp->eps = ep;
  /* A member may have died, or reported an error, before we got here. */
  for (int g = 0; g < n; g++) {
    peer_t *c = &tp->peers[members[g]];
    if (g != me && c->dead && !c->bye_received && c->dead_code == CHORUS_ERR_PROTOCOL)
      ep_fail_locked(ep, CHORUS_ERR_PROTOCOL, 0,
                     "chorus rank %d/%d: the connection with rank %d (world rank %d, %s) failed "
                     "earlier: %s", me, n, g, members[g], c->addr, c->dead_why);
    else if (g != me && c->dead && !c->bye_received)
      ep_fail_locked(ep, c->dead_code ? c->dead_code : CHORUS_ERR_REMOTE, 0,
                     "chorus rank %d/%d: rank %d (world rank %d, %s) is gone (its connection "
                     "closed earlier: %s)", me, n, g, members[g], c->addr, c->dead_why);
  }
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type == T_ABORT && u->h.ep_id == id && ep->w2g[u->src] >= 0) {
      char rd[64], text[MAX_ABORT_TEXT + 1];
      chorus__ep_rank_desc(ep, ep->w2g[u->src], rd, sizeof rd);
      chorus__escape(u->buf ? u->buf : "", u->h.len, text, sizeof text);
      ep_fail_locked(ep, abort_code(u->h.tag), 0, "chorus rank %d/%d: %s reported an error: %s",
                     me, n, rd, text);
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
  detach_requests(tp, ep);
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
      free_unexp(tp, u);
      continue;
    }
    prev = u;
    pp = &u->next;
  }
  resume_all(tp); /* messages for it that wait in sockets are discarded */
  pthread_mutex_unlock(&tp->lock);
  free(ep->members);
  free(ep->w2g);
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
      check_data_header(ep, &u->h, u->src);
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
  int world = any ? -1 : ep->members[req->peer];
  peer_t *c = any ? NULL : &tp->peers[world];
  chorus__tp_lock(tp);
  req->seq = req->kind == CHORUS__KIND_COLL ? ep->cur_seq : 0;
  chorus_result_t st = ep->status;
  if (st != CHORUS_OK) goto out;
  if (req->type == CHORUS__REQ_SEND && (c->dead || c->bye_received)) { /* (never any) */
    fail_peer_left(ep, c, "needs to send to it");
    st = ep->status;
    goto out;
  }
  if (req->type == CHORUS__REQ_SEND) {
    txitem_t *it = calloc(1, sizeof *it);
    if (!it) {
      st = CHORUS_ERR_NO_MEMORY;
      goto out;
    }
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
    st = ep->status;
    goto out;
  }
  /* Receive: look for a message that already arrived (from any member:
   * the one that arrived first). */
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type != T_DATA || u->h.ep_id != ep->id || u->req) continue;
    if (any ? ep->w2g[u->src] < 0 : u->src != world) continue;
    if (!req_matches(req, &u->h, ep->w2g[u->src])) continue;
    if (check_length(ep, req, &u->h, u->src) < 0) {
      st = ep->status;
      goto out;
    }
    if (req->kind == CHORUS__KIND_COLL && check_data_header(ep, &u->h, world) < 0) {
      st = ep->status;
      goto out;
    }
    req->peer = ep->w2g[u->src];
    if (u->complete) {
      /* Copied without the lock, so the progress thread goes on reading
       * meanwhile.  Unlinked, u is no one else's; its bytes stay charged
       * to the sender until it is freed. */
      unlink_unexp(tp, u);
      pthread_mutex_unlock(&tp->lock);
      if (u->h.len) memcpy(req->buf, u->buf, u->h.len);
      chorus__tp_lock(tp);
      req->done = 1;
      free_unexp(tp, u);
      goto out;
    }
    rx_t *rx = unexp_stream(tp, u);
    if (!rx) {
      u->req = req; /* on_payload_done copies it */
      goto out;
    }
    /* Still arriving (a large message sent before this receive was posted,
     * the common case for a ring's first step): the part buffered so far
     * is copied and the rest goes straight to the receive's buffer. */
    if (u->hi) memcpy(req->buf, u->buf, u->hi);
    req->got = u->got == u->hi ? u->hi : 0; /* a prefix, or holes (pieces) */
    rx->unexp = NULL;
    rx->req = req;
    rx->dst = req->buf;
    unlink_unexp(tp, u);
    free_unexp(tp, u);
    goto out;
  }
  /* Nothing buffered: a peer that is gone will never send it. */
  if (any && others_gone(ep)) {
    ep_fail_locked(ep, CHORUS_ERR_REMOTE, 1, "chorus rank %d/%d: every other rank left (destroyed "
                   "its communicator or is gone), but this rank waits for a message from any "
                   "of them", ep->me, ep->n);
    st = ep->status;
    goto out;
  }
  if (!any && (c->dead || c->bye_received)) {
    fail_peer_left(ep, c, "waits for its data");
    st = ep->status;
    goto out;
  }
  chorus__req_t **pp = &ep->recvs;
  while (*pp) pp = &(*pp)->next;
  *pp = req;
  if (any) resume_all(tp); /* a held-back message may be this one */
  else resume_peer(tp, c);
out:
  pthread_mutex_unlock(&tp->lock);
  return st;
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
      ep_fail_timeout_locked(ep, timeout_ms, who);
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

/* ----------------------------------------------------------- progress */

int chorus__tp_watch(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w) {
  struct epoll_event ev = {.events = events, .data.ptr = w};
  return epoll_ctl(tp->epfd, EPOLL_CTL_ADD, fd, &ev);
}

int chorus__tp_watch_mod(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w) {
  struct epoll_event ev = {.events = events, .data.ptr = w};
  return epoll_ctl(tp->epfd, EPOLL_CTL_MOD, fd, &ev);
}

void chorus__tp_unwatch(chorus__tp_t *tp, int fd) { epoll_ctl(tp->epfd, EPOLL_CTL_DEL, fd, NULL); }

static void on_kick(void *arg, uint32_t events) {
  chorus__tp_t *tp = arg;
  (void)events;
  uint64_t v;
  (void)!read(tp->evfd, &v, sizeof v);
}

/* The failure detector for what closes no connection (a host unplugged or
 * powered off, a process stopped): a peer that sent nothing, not even a
 * heartbeat, for the peer timeout is dead.  A peer we stopped reading
 * (back-pressure) is not silent, we are deaf; nor is one we have not heard
 * since we last listened (try_resume). */
static void check_silence(chorus__tp_t *tp, int64_t now) {
  if (!tp->peer_timeout_ns) return;
  for (int r = 0; r < tp->size; r++) {
    peer_t *c = &tp->peers[r];
    /* A peer that said goodbye stops its heartbeats. */
    if (r == tp->rank || c->dead || c->npaused || !c->chan || c->bye_received || !linked(c))
      continue;
    int64_t quiet = now - c->last_heard;
    if (quiet <= tp->peer_timeout_ns) continue;
    char why[200];
    snprintf(why, sizeof why, "went silent (nothing, not even a heartbeat, for %lld ms, "
             "CHORUS_PEER_TIMEOUT_MS: its host unreachable or the process stopped)",
             (long long)(quiet / 1000000));
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: world rank %d (%s) %s", r, c->addr, why);
    chorus__tp_peer_failed(tp, c, why, CHORUS_ERR_REMOTE);
  }
}

/* Between events: a thread waits for the lock (chorus__tp_lock) or was
 * woken to see a completion, so let it have the lock first -- for at most
 * YIELD_NS, in case it went elsewhere. */
#define YIELD_NS 20000
static void progress_yield(chorus__tp_t *tp) {
  if (!__atomic_load_n(&tp->lock_wanted, __ATOMIC_SEQ_CST) &&
      !__atomic_load_n(&tp->kicked, __ATOMIC_SEQ_CST))
    return;
  pthread_mutex_unlock(&tp->lock);
  int64_t until = chorus__now_ns() + YIELD_NS;
  do
    for (int k = 0; k < 32; k++) chorus__cpu_relax();
  while ((__atomic_load_n(&tp->lock_wanted, __ATOMIC_SEQ_CST) ||
          __atomic_load_n(&tp->kicked, __ATOMIC_SEQ_CST)) &&
         chorus__now_ns() < until);
  pthread_mutex_lock(&tp->lock);
}

static void *progress_main(void *arg) {
  chorus__tp_t *tp = arg;
  struct epoll_event evs[64];
  chorus__chan_t *local = tp->local, *net = tp->net;
  pthread_mutex_lock(&tp->lock);
  while (!__atomic_load_n(&tp->stopping, __ATOMIC_ACQUIRE)) {
    int busy = 0;
    if (local) busy |= local->ops->idle(local, 1);
    if (net && net->ops->idle) busy |= net->ops->idle(net, 1);
    pthread_mutex_unlock(&tp->lock);
    int n = epoll_wait(tp->epfd, evs, 64, busy ? 0 : HEARTBEAT_MS / 2);
    int err = errno;
    pthread_mutex_lock(&tp->lock);
    if (local) local->ops->idle(local, 0);
    if (net && net->ops->idle) net->ops->idle(net, 0);
    if (n < 0) {
      if (err == EINTR) continue;
      CHORUS_WARN(CHORUS__SUB_TCP, "chorus: epoll_wait failed: %s", strerror(err));
      pthread_mutex_unlock(&tp->lock);
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
      pthread_mutex_lock(&tp->lock);
      continue;
    }
    for (int i = 0; i < n; i++) {
      chorus__watch_t *w = evs[i].data.ptr;
      w->fn(w->arg, evs[i].events);
      progress_yield(tp);
    }
    if (tp->net && tp->net->ops->poll) tp->net->ops->poll(tp->net);
    int64_t now = chorus__now_ns();
    if (now - tp->last_ping >= (int64_t)HEARTBEAT_MS * 1000000) {
      tp->last_ping = now;
      for (int r = 0; r < tp->size; r++) {
        peer_t *c = &tp->peers[r];
        if (r != tp->rank && c->chan && !c->dead && !tp->bye_sent && linked(c) &&
            !c->chan->ops->pending(c->chan, c, NULL))
          send_control(tp, c, T_PING, 0, NULL, -1);
      }
      check_silence(tp, now);
    }
  }
  pthread_mutex_unlock(&tp->lock);
  return NULL;
}

/* ---------------------------------------------------------- lifecycle */

/* How long an exiting process gives the ABORTs it queued to leave, and
 * its progress thread to stop. */
#define EXIT_FLUSH_MS 200
#define EXIT_JOIN_MS 1000

/* The process exits with this world alive (util/exit.h): every endpoint
 * fails and tells its peers why, the ABORTs get EXIT_FLUSH_MS to leave
 * (dialling a peer never talked to included), then the progress thread
 * stops and no channel is called again. */
static void tp_on_exit(void *arg) {
  chorus__tp_t *tp = arg;
  /* Only a signal handler that called exit() while this thread held the
   * lock keeps it: then nothing can be stopped safely. */
  if (chorus__lock_within(&tp->lock, 1000) != 0) return;
  __atomic_store_n(&tp->exiting, 1, __ATOMIC_RELEASE);
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    ep_fail_locked(ep, CHORUS_ERR_ABORTED, 1,
                   "chorus rank %d/%d: its process is exiting with the communicator alive "
                   "(main returned, or exit() was called, before chorus_comm_destroy)",
                   ep->me, ep->n);
  int64_t until = chorus__now_ns() + (int64_t)EXIT_FLUSH_MS * 1000000;
  while (tp->thread_started && chorus__now_ns() < until) {
    int waiting = 0;
    for (int r = 0; r < tp->size && !waiting; r++) {
      peer_t *c = &tp->peers[r];
      if (r != tp->rank && c->chan && !c->dead && c->chan->ops->pending(c->chan, c, NULL))
        waiting = 1;
    }
    if (!waiting) break;
    struct timespec step = chorus__deadline_timespec(chorus__now_ns() + 5000000);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &step);
  }
  __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&tp->lock);
  chorus__tp_kick(tp);
  if (tp->thread_started && chorus__join_within(tp->thread, EXIT_JOIN_MS) == 0)
    tp->thread_started = 0;
  pthread_mutex_lock(&tp->lock);
  __atomic_store_n(&tp->exiting, 2, __ATOMIC_RELEASE);
  if (!tp->thread_started) {
    if (tp->net && tp->net->ops->on_exit) tp->net->ops->on_exit(tp->net);
    if (tp->local && tp->local->ops->on_exit) tp->local->ops->on_exit(tp->local);
  }
  pthread_mutex_unlock(&tp->lock);
}

chorus__tp_t *chorus__tp_alloc(int rank, int size, const chorus__key_t *key, uint64_t world) {
  chorus__tp_t *tp = calloc(1, sizeof *tp);
  if (!tp) return NULL;
  tp->rank = rank;
  tp->size = size;
  tp->key = *key;
  tp->world_id = world;
  tp->epfd = tp->evfd = -1;
  pthread_mutex_init(&tp->lock, NULL);
  chorus__cond_init_monotonic(&tp->cond);
  tp->peers = calloc((size_t)size, sizeof(peer_t));
  tp->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (!tp->peers || tp->epfd < 0) {
    chorus__tp_free(tp);
    return NULL;
  }
  int64_t now = chorus__now_ns();
  for (int r = 0; r < size; r++) {
    tp->peers[r].rank = r;
    tp->peers[r].last_heard = now;
    snprintf(tp->peers[r].addr, sizeof tp->peers[r].addr, "?");
  }
  return tp;
}

void chorus__tp_free(chorus__tp_t *tp) {
  /* The streams live in the channels: their ABORT texts go first. */
  if (tp->peers) {
    for (int r = 0; r < tp->size; r++)
      for (rx_t *rx = tp->peers[r].rxs; rx; rx = rx->next) free(rx->abort);
  }
  if (tp->net) tp->net->ops->destroy(tp->net);
  if (tp->local) tp->local->ops->destroy(tp->local);
  while (tp->unexp_head) {
    unexp_t *u = tp->unexp_head;
    tp->unexp_head = u->next;
    free(u->buf);
    free(u);
  }
  if (tp->epfd >= 0) close(tp->epfd);
  if (tp->evfd >= 0) close(tp->evfd);
  pthread_mutex_destroy(&tp->lock);
  pthread_cond_destroy(&tp->cond);
  free(tp->peers);
  free(tp);
}

chorus_result_t chorus__tp_create(const chorus__tp_config_t *cfg, chorus__tp_t **out,
                                  char *errmsg, size_t errcap) {
  chorus__tp_t *tp = chorus__tp_alloc(cfg->rank, cfg->size, cfg->key, cfg->world_id);
  if (!tp) {
    close(cfg->listen_fd);
    chorus__ucx_worker_free(cfg->ucx);
    return CHORUS_ERR_NO_MEMORY;
  }
  tp->fp_format = cfg->fp_format;
  long budget = chorus__env()->RECV_BUFFER_MAX;
  tp->budget = budget > 0 ? (size_t)budget : (size_t)64 << 20;
  tp->encrypt = chorus__env()->ENCRYPT;
  long peer_ms = chorus__env()->PEER_TIMEOUT_MS;
  /* Never below 4 heartbeats: a peer is not silent between two of them. */
  tp->peer_timeout_ns = peer_ms <= 0 ? 0 : (int64_t)CHORUS__MAX(peer_ms, 4 * HEARTBEAT_MS) * 1000000;
  chorus_result_t st;
  tp->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  tp->ev_watch = (chorus__watch_t){on_kick, tp};
  if (tp->evfd < 0 || chorus__tp_watch(tp, tp->evfd, EPOLLIN, &tp->ev_watch) < 0) {
    close(cfg->listen_fd);
    chorus__ucx_worker_free(cfg->ucx);
    snprintf(errmsg, errcap, "eventfd: %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  /* Every peer is named by the address it published ("rank 1
   * (10.0.0.7:4000)"); a channel may name its own peers otherwise. */
  for (int r = 0; r < cfg->size && cfg->addrs; r++) {
    char host[64];
    int port;
    if (chorus__net_split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) == 0)
      snprintf(tp->peers[r].addr, sizeof tp->peers[r].addr, "%s:%d", host, port);
  }
  /* Peers on this host first (shared memory), then TCP or UCX for the
   * rest. */
  const char *mode = chorus__env()->TRANSPORT;
  if (cfg->host && cfg->nonce && !(mode && !strcmp(mode, "tcp"))) {
    st = chorus__shm_chan_open(tp, cfg, &tp->local, errmsg, errcap);
    if (st != CHORUS_OK) {
      close(cfg->listen_fd);
      chorus__ucx_worker_free(cfg->ucx);
      goto fail;
    }
  }
  if (cfg->ucx) {
    close(cfg->listen_fd);
    st = chorus__ucx_open(tp, cfg, &tp->net, errmsg, errcap);
  } else {
    st = chorus__tcp_open(tp, cfg, &tp->net, errmsg, errcap);
  }
  if (st != CHORUS_OK) goto fail;
  /* Silence is counted from now: connecting may have taken a while. */
  int64_t start = chorus__now_ns();
  for (int r = 0; r < cfg->size; r++) tp->peers[r].last_heard = start;
  tp->last_ping = start;
  if (pthread_create(&tp->thread, NULL, progress_main, tp) != 0) {
    snprintf(errmsg, errcap, "cannot start the progress thread");
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  tp->thread_started = 1;
  if (chorus__exit_hook_add(&tp->exit_hook, tp_on_exit, tp) < 0) {
    snprintf(errmsg, errcap, "the process is exiting");
    __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
    chorus__tp_kick(tp);
    pthread_join(tp->thread, NULL);
    st = CHORUS_ERR_ABORTED;
    goto fail;
  }
  *out = tp;
  return CHORUS_OK;
fail:
  chorus__tp_free(tp);
  return st;
}

void chorus__tp_destroy(chorus__tp_t *tp, int64_t bye_deadline) {
  if (!tp) return;
  /* Past the exit handler (a destroy from a later atexit handler): the
   * hook stopped what ran; OpenSSL or UCX may be gone, so nothing is
   * closed or freed -- the process's end does that. */
  if (chorus__exit_hook_remove(&tp->exit_hook)) return;
  pthread_mutex_lock(&tp->lock);
  tp->bye_sent = 1;
  resume_all(tp); /* leaving: held-back messages are read and dropped */
  /* Goodbyes go where there is a connection; a peer this rank never
   * talked with has nothing to wait for. */
  for (int r = 0; r < tp->size; r++)
    if (r != tp->rank && tp->peers[r].chan && linked(&tp->peers[r]))
      send_control(tp, &tp->peers[r], T_BYE, 0, NULL, -1);
  /* A peer that sent nothing, not even a heartbeat, for four heartbeats is
   * stopped or hung: its goodbye is not worth waiting for (a survivor of a
   * failure would otherwise linger the whole bye timeout). */
  const int64_t silent_ns = (int64_t)4 * HEARTBEAT_MS * 1000000, start = chorus__now_ns();
  for (;;) {
    int waiting = 0;
    int64_t now = chorus__now_ns();
    for (int r = 0; r < tp->size; r++) {
      peer_t *c = &tp->peers[r];
      if (r == tp->rank || c->dead || !c->chan) continue;
      if (!linked(c)) {
        /* An ABORT being dialled: a peer this rank never talked with, whose
         * handshake a stopped process never answers (its kernel accepts the
         * connection), gets as long as a silent one (issue 42: survivors
         * waited the whole bye timeout for it). */
        if (c->chan->ops->pending(c->chan, c, NULL) && now - start < silent_ns) waiting = 1;
        continue;
      }
      if (now - c->last_heard > silent_ns) continue;
      if (!c->bye_received || c->chan->ops->pending(c->chan, c, NULL)) waiting = 1;
    }
    if (!waiting || chorus__ms_left(bye_deadline) == 0) break;
    /* Wake at least once a heartbeat to notice peers falling silent. */
    int64_t until = now + (int64_t)HEARTBEAT_MS * 1000000;
    struct timespec ts = chorus__deadline_timespec(until < bye_deadline ? until : bye_deadline);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &ts);
  }
  __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&tp->lock);
  chorus__tp_kick(tp);
  if (tp->thread_started) pthread_join(tp->thread, NULL);
  chorus__tp_free(tp);
}
