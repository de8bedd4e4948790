/*
 * endpoint_failure.c - the failure model of transport.h: failing an
 * endpoint (first failure wins, pending requests fail, the other members
 * get an ABORT), describing what failed and who is to blame (silent ranks
 * in a timeout), and the peers' liveness: goodbyes, lost connections and
 * the silence detector the heartbeats feed.
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

/* Removes every trace of ep's requests from the peers' streams so the
 * callers may free them: the channels drop or copy its sends (cancel),
 * payloads being received into its receives are discarded. */
void chorus__ep_detach_requests(chorus__tp_t *tp, chorus__ep_t *ep) {
  if (tp->exiting == 2) return; /* the channels are closed for good (tp_on_exit) */
  CHORUS__FOR_PEERS(tp, c) {
    if (c->rank == tp->rank || !c->chan) continue;
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
chorus_result_t chorus__abort_code(int32_t tag) {
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
  chorus__ep_detach_requests(ep->tp, ep);
  chorus__tp_resume_all(ep->tp); /* held-back messages for it are discarded now */
  if (notify) {
    for (int g = 0; g < ep->n; g++) {
      if (g == ep->me) continue;
      peer_t *c = chorus__tp_peer(ep->tp, ep->members[g]); /* NULL: out of memory, not told */
      if (c) chorus__tp_send_control(ep->tp, c, T_ABORT, ep->id, ep->msg, (int32_t)ep->status);
    }
  }
  wake_all(ep->tp);
}

void chorus__ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
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
void chorus__ep_peer_desc(chorus__ep_t *ep, int world, char *buf, size_t cap) {
  int g = chorus__ep_group(ep, world);
  if (g == world && ep->n == ep->tp->size)
    snprintf(buf, cap, "rank %d (%s)", g, chorus__tp_peer_addr(ep->tp, world));
  else
    snprintf(buf, cap, "rank %d (world rank %d, %s)", g, world,
             chorus__tp_peer_addr(ep->tp, world));
}

/* What ep is doing, for failure messages (lock held).  The current
 * collective is formatted here, when a message needs it, not when it
 * starts: formatting every call would cost more than a small collective. */
const char *chorus__ep_doing_locked(chorus__ep_t *ep) {
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
  snprintf(buf, cap, "%s", chorus__ep_doing_locked(ep));
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

int chorus__peer_linked(peer_t *c) {
  int64_t since;
  return link_state(c, &since) == CHORUS__LINK_READY;
}

/* Fails ep because peer c left (said goodbye, or its connection is gone)
 * while ep still needs it; need says how ("waits for its data"). */
void chorus__ep_fail_peer_left(chorus__ep_t *ep, peer_t *c, const char *need) {
  char pd[160];
  chorus__ep_peer_desc(ep, c->rank, pd, sizeof pd);
  chorus__ep_fail_locked(
      ep, CHORUS_ERR_REMOTE, 1, "chorus rank %d/%d: %s %s, but %s %s", ep->me, ep->n, pd,
      c->bye_received ? "destroyed its communicator" : "is gone (its connection closed)",
      chorus__ep_doing_locked(ep), need);
}

/* Fails ep with a timeout: who says what this rank waited for; the members
 * that stopped talking altogether (no heartbeat) are named as culprits,
 * since the ranks we wait for may just be waiting for them. */
void chorus__ep_fail_timeout_locked(chorus__ep_t *ep, int timeout_ms, const char *who) {
  chorus__tp_t *tp = ep->tp;
  char silent[512];
  size_t so = 0;
  silent[0] = '\0';
  int64_t now = chorus__now_ns();
  for (int g = 0; g < ep->n && so < sizeof silent; g++) {
    peer_t *pc = chorus__tp_peer_if(tp, ep->members[g]);
    if (g == ep->me || !pc || pc->dead) continue; /* never touched: never connected */
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
  chorus__ep_fail_locked(
      ep, CHORUS_ERR_TIMEOUT, 1, "chorus rank %d/%d: %s timed out after %d ms %s; %s%s%s", ep->me,
      ep->n, chorus__ep_doing_locked(ep), timeout_ms, who, so ? "not responding at all: " : "",
      so ? silent : "no rank is silent, so a rank is slow or stuck in user code",
      so ? " (stopped, hung or overloaded; raise CHORUS_TIMEOUT if merely slow)"
         : " (raise CHORUS_TIMEOUT if it is just slow)");
}

void chorus__ep_fail_timeout(chorus__ep_t *ep, int timeout_ms, const char *who) {
  pthread_mutex_lock(&ep->tp->lock);
  chorus__ep_fail_timeout_locked(ep, timeout_ms, who);
  pthread_mutex_unlock(&ep->tp->lock);
}

int chorus__ep_peer_gone(chorus__ep_t *ep, int peer) {
  chorus__tp_t *tp = ep->tp;
  if (peer < 0 || peer >= ep->n || peer == ep->me) return 0;
  pthread_mutex_lock(&tp->lock);
  peer_t *c = chorus__tp_peer_if(tp, ep->members[peer]);
  int gone = c && (c->dead || c->bye_received);
  pthread_mutex_unlock(&tp->lock);
  return gone;
}

int chorus__tp_peer_state(chorus__tp_t *tp, int w) {
  if (w < 0 || w >= tp->size || w == tp->rank) return CHORUS__PEER_ALIVE;
  pthread_mutex_lock(&tp->lock);
  /* Made here if need be: a peer never connected is pinged below. */
  peer_t *c = chorus__tp_peer(tp, w);
  if (!c) {
    pthread_mutex_unlock(&tp->lock);
    return CHORUS__PEER_ALIVE; /* out of memory: nothing known */
  }
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
    chorus__tp_send_control(tp, c, T_PING, 0, NULL, -1);
  pthread_mutex_unlock(&tp->lock);
  return state;
}

void chorus__tp_link_desc(chorus__tp_t *tp, int w, char *buf, size_t cap) {
  if (w == tp->rank || w < 0 || w >= tp->size) {
    snprintf(buf, cap, w == tp->rank ? "self" : "none");
    return;
  }
  pthread_mutex_lock(&tp->lock);
  peer_t *p = chorus__tp_peer_if(tp, w), untouched;
  if (!p) { /* never touched: as its channel would see it, not made for a description */
    memset(&untouched, 0, sizeof untouched);
    untouched.rank = w;
    untouched.chan = chorus__tp_chan_of(tp, w);
    snprintf(untouched.addr, sizeof untouched.addr, "%s", chorus__tp_peer_addr(tp, w));
    p = &untouched;
  }
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
    peer_t *c = chorus__tp_peer_if(tp, ep->members[peer]);
    if (c && (c->dead || c->bye_received)) chorus__ep_fail_peer_left(ep, c, need);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* Wakes the shared-memory waiters of every endpoint containing world rank
 * w (it left: they must re-check whether what they wait for can come). */
void chorus__tp_wake_hooks_of(chorus__tp_t *tp, int w) {
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    if (chorus__ep_group(ep, w) >= 0 && ep->fail_hook) ep->fail_hook(ep->fail_arg);
}

/* The way to peer c ended.  Members of every endpoint containing it fail,
 * unless it said goodbye first (or, quiet, never exchanged a byte with this
 * rank), between two messages, and nothing is pending with it: those fail
 * only when they need it.  code: CHORUS_ERR_PROTOCOL when the peer (or
 * something on the wire) broke the protocol, else CHORUS_ERR_REMOTE. */
static void peer_failed(chorus__tp_t *tp, peer_t *c, const char *why, chorus_result_t code,
                        int quiet) {
  if (c->dead) return;
  c->dead = 1;
  c->dead_code = code;
  c->dead_why = strdup(why); /* NULL: chorus__peer_why says so */
  int clean = c->bye_received || quiet;
  for (rx_t *rx = c->rxs; rx; rx = rx->next)
    if (rx->in_payload || rx->hgot) clean = 0;
  chorus__tp_wake_hooks_of(tp, c->rank);
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next) {
    int g = chorus__ep_group(ep, c->rank);
    if (g < 0 || ep->status != CHORUS_OK) continue;
    int pending = c->chan && c->chan->ops->pending(c->chan, c, ep);
    for (chorus__req_t *r = ep->recvs; r; r = r->next)
      if (r->peer == g || r->peer == CHORUS__ANY_PEER) pending = 1;
    if (clean && !pending) continue;
    if (clean) {
      chorus__ep_fail_peer_left(ep, c, "still exchanges data with it");
      continue;
    }
    char pd[160];
    chorus__ep_peer_desc(ep, c->rank, pd, sizeof pd);
    if (code == CHORUS_ERR_PROTOCOL)
      chorus__ep_fail_locked(ep, code, 1,
                             "chorus rank %d/%d: the connection with %s failed during %s: "
                             "%s; every other rank fails too",
                             ep->me, ep->n, pd, chorus__ep_doing_locked(ep), why);
    else
      chorus__ep_fail_locked(ep, code, 1,
                             "chorus rank %d/%d: %s %s during %s; the process probably died "
                             "(check its output); every other rank fails too",
                             ep->me, ep->n, pd, why, chorus__ep_doing_locked(ep));
  }
  /* Stop reading it; sends queued to it can never complete. */
  for (rx_t *rx = c->rxs; rx; rx = rx->next) {
    if (rx->paused) c->npaused--;
    rx->paused = 0;
  }
  if (c->chan) c->chan->ops->close(c->chan, c);
  wake_all(tp);
}

void chorus__tp_peer_failed(chorus__tp_t *tp, peer_t *c, const char *why, chorus_result_t code) {
  peer_failed(tp, c, why, code, 0);
}

void chorus__tp_peer_ended_quietly(chorus__tp_t *tp, peer_t *c, const char *why) {
  peer_failed(tp, c, why, CHORUS_ERR_REMOTE, 1);
}

/* The failure detector for what closes no connection (a host unplugged or
 * powered off, a process stopped): a peer that sent nothing, not even a
 * heartbeat, for the peer timeout is dead.  A peer we stopped reading
 * (back-pressure) is not silent, we are deaf; nor is one we have not heard
 * since we last listened (try_resume). */
void chorus__tp_check_silence(chorus__tp_t *tp, int64_t now) {
  if (!tp->peer_timeout_ns) return;
  CHORUS__FOR_PEERS(tp, c) {
    /* A peer that said goodbye stops its heartbeats. */
    if (c->rank == tp->rank || c->dead || c->npaused || !c->chan || c->bye_received ||
        !chorus__peer_linked(c))
      continue;
    int64_t quiet = now - c->last_heard;
    if (quiet <= tp->peer_timeout_ns) continue;
    char why[200];
    snprintf(why, sizeof why, "went silent (nothing, not even a heartbeat, for %lld ms, "
             "CHORUS_PEER_TIMEOUT_MS: its host unreachable or the process stopped)",
             (long long)(quiet / 1000000));
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: world rank %d (%s) %s", c->rank, c->addr, why);
    chorus__tp_peer_failed(tp, c, why, CHORUS_ERR_REMOTE);
  }
}
