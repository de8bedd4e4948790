/*
 * endpoint_match.c - matching messages to receives: routing each received
 * header to a posted receive, or buffering its message until one is posted
 * (also for endpoints that do not exist yet) within the sender's budget,
 * pausing a stream whose messages can go nowhere and resuming it; and
 * posting a receive, which first looks among the messages that came early.
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

#include "transport/endpoint_internal.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

/* ------------------------------------------------------------ streams */

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

/* Whether every other member left (said goodbye or is gone): nothing can
 * come any more for a receive from any source. */
static int others_gone(const chorus__ep_t *ep) {
  for (int g = 0; g < ep->n; g++) {
    const peer_t *p = chorus__tp_peer_if(ep->tp, ep->members[g]); /* NULL: never touched */
    if (g != ep->me && (!p || (!p->dead && !p->bye_received))) return 0;
  }
  return 1;
}

static int req_matches(const chorus__req_t *r, const hdr_t *h, int src_group) {
  if ((r->peer != src_group && r->peer != CHORUS__ANY_PEER) || r->kind != h->kind) return 0;
  if (h->kind == CHORUS__KIND_COLL) return r->seq == h->seq && r->step == h->step;
  return r->tag == h->tag;
}

/* Checks a data header against what ep executes; fails ep and returns -1 if
 * the sender is in a different call. */
int chorus__ep_check_data_header(chorus__ep_t *ep, const hdr_t *h, int src_world) {
  char pd[160], theirs[200], mine[200];
  if (h->kind != CHORUS__KIND_COLL) return 0;
  chorus__ep_peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  if (h->seq <= ep->done_seq) {
    chorus__ep_fail_locked(
        ep, CHORUS_ERR_MISMATCH, 1,
        "chorus rank %d/%d: collective mismatch: %s sent data for its collective "
        "#%" PRIu64
        " %s, which this rank already completed without it; the ranks "
        "called different collectives or with different arguments",
        ep->me, ep->n, pd, h->seq, theirs);
    return -1;
  }
  if (__atomic_load_n(&ep->in_coll, __ATOMIC_ACQUIRE) && h->seq == ep->cur_seq &&
      !chorus__fp_equal(&h->fp, &ep->cur_fp)) {
    ep->tp->fp_format(&ep->cur_fp, mine, sizeof mine);
    chorus__ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                           "chorus rank %d/%d: collective mismatch at call #%" PRIu64
                           ": %s called %s "
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
  chorus__ep_peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  chorus__ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                         "chorus rank %d/%d: %s sent %" PRIu64
                         " bytes for %s step %u but this rank "
                         "expected %zu bytes in %s; the ranks passed different counts",
                         ep->me, ep->n, pd, h->len, theirs, h->step, r->len,
                         chorus__ep_doing_locked(ep));
  return -1;
}

chorus__ep_t *chorus__tp_find_ep(chorus__tp_t *tp, uint64_t id) {
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
  peer_t *c = tp->peers[src]; /* touched: its stream brought h */
  c->unexp_bytes += u->cost;
  if (h->len) {
    u->buf = malloc(h->len);
    if (!u->buf) {
      c->unexp_bytes -= u->cost;
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
void chorus__tp_free_unexp(chorus__tp_t *tp, unexp_t *u) {
  peer_t *c = tp->peers[u->src];
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
  peer_t *c = tp->peers[rx->src];
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
  peer_t *c = tp->peers[rx->src];
  rx->dst = NULL;
  rx->req = NULL;
  rx->unexp = NULL;
  if (tp->bye_sent) return 1; /* leaving: nothing will receive it */
  chorus__ep_t *ep = chorus__tp_find_ep(tp, h->ep_id);
  if (ep) {
    int g = chorus__ep_group(ep, c->rank);
    if (g < 0) {
      /* Ranks disagree on who is in this group (new_group with different
       * lists): fail the group, keep the connection. */
      if (ep->status == CHORUS_OK)
        chorus__ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                               "chorus rank %d/%d: world rank %d (%s) sent data for this group but "
                               "is not a member here: the ranks created the group with different "
                               "member lists",
                               ep->me, ep->n, c->rank, c->addr);
      return 1; /* discard */
    }
    if (ep->status != CHORUS_OK) return 1; /* discard */
    if (chorus__ep_check_data_header(ep, h, c->rank) < 0) return 1;
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
      chorus__ep_fail_locked(ep, CHORUS_ERR_NO_MEMORY, 1,
                             "chorus: out of memory buffering a %" PRIu64
                             "-byte message from "
                             "world rank %d",
                             h->len, c->rank);
    return 1;
  }
  rx->dst = rx->unexp->buf;
  return 1;
}

/* Runs a paused stream's message through route_data again (a receive was
 * posted, buffered bytes were taken, an endpoint failed or went away, or
 * this rank is leaving); reading resumes if it can go somewhere now. */
static void try_resume(chorus__tp_t *tp, rx_t *rx) {
  peer_t *c = tp->peers[rx->src];
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

void chorus__tp_resume_all(chorus__tp_t *tp) {
  CHORUS__FOR_PEERS(tp, c) {
    if (c->rank != tp->rank && c->npaused) resume_peer(tp, c);
  }
}

void chorus__tp_rx_header(chorus__tp_t *tp, rx_t *rx) {
  hdr_t *h = &rx->h;
  peer_t *c = tp->peers[rx->src];
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
        int g = chorus__ep_group(ep, c->rank);
        if (g < 0 || ep->status != CHORUS_OK) continue;
        for (chorus__req_t *r = ep->recvs; r; r = r->next) {
          if (r->peer == CHORUS__ANY_PEER ? !others_gone(ep) : r->peer != g) continue;
          chorus__ep_fail_peer_left(ep, c, "waits for its data");
          break;
        }
      }
      chorus__tp_wake_hooks_of(tp, c->rank);
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
  for (rx_t *rx = tp->peers[u->src]->rxs; rx; rx = rx->next)
    if (rx->unexp == u) return rx->dst_fixed ? NULL : rx;
  return NULL;
}

static void on_payload_done(chorus__tp_t *tp, rx_t *rx) {
  peer_t *c = tp->peers[rx->src];
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
      chorus__tp_free_unexp(tp, u);
      wake_all(tp);
    }
  } else if (rx->abort) {
    chorus__ep_t *ep = chorus__tp_find_ep(tp, rx->h.ep_id);
    if (ep) {
      if (chorus__ep_group(ep, c->rank) >= 0) {
        /* Forward it: whatever this rank sends later (a goodbye, say) must
         * not reach a peer before the cause does. */
        char rd[64], text[MAX_ABORT_TEXT + 1];
        chorus__ep_rank_desc(ep, chorus__ep_group(ep, c->rank), rd, sizeof rd);
        /* The peer's text is untrusted: escaped before any log or message. */
        chorus__escape(rx->abort, rx->abort_len, text, sizeof text);
        chorus__ep_fail_locked(ep, chorus__abort_code(rx->h.tag), 1,
                               "chorus rank %d/%d: %s reported an error: %s", ep->me, ep->n, rd,
                               text);
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

/* ---------------------------------------------------- posting receives */

/* chorus__ep_post's receive half (endpoint_internal.h), lock held. */
chorus_result_t chorus__ep_post_recv(chorus__ep_t *ep, chorus__req_t *req) {
  chorus__tp_t *tp = ep->tp;
  int any = req->peer == CHORUS__ANY_PEER;
  int world = any ? -1 : ep->members[req->peer];
  peer_t *c = any ? NULL : chorus__tp_peer_if(tp, world); /* NULL too: never touched */
  chorus_result_t st = CHORUS_OK;
  /* Receive: look for a message that already arrived (from any member:
   * the one that arrived first). */
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type != T_DATA || u->h.ep_id != ep->id || u->req) continue;
    if (any ? chorus__ep_group(ep, u->src) < 0 : u->src != world) continue;
    if (!req_matches(req, &u->h, chorus__ep_group(ep, u->src))) continue;
    if (check_length(ep, req, &u->h, u->src) < 0) {
      st = ep->status;
      goto out;
    }
    if (req->kind == CHORUS__KIND_COLL && chorus__ep_check_data_header(ep, &u->h, world) < 0) {
      st = ep->status;
      goto out;
    }
    req->peer = chorus__ep_group(ep, u->src);
    if (u->complete) {
      /* Copied without the lock, so the progress thread goes on reading
       * meanwhile.  Unlinked, u is no one else's; its bytes stay charged
       * to the sender until it is freed. */
      unlink_unexp(tp, u);
      pthread_mutex_unlock(&tp->lock);
      if (u->h.len) memcpy(req->buf, u->buf, u->h.len);
      chorus__tp_lock(tp);
      req->done = 1;
      chorus__tp_free_unexp(tp, u);
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
    chorus__tp_free_unexp(tp, u);
    goto out;
  }
  /* Nothing buffered: a peer that is gone will never send it. */
  if (any && others_gone(ep)) {
    chorus__ep_fail_locked(
        ep, CHORUS_ERR_REMOTE, 1,
        "chorus rank %d/%d: every other rank left (destroyed "
        "its communicator or is gone), but this rank waits for a message from any "
        "of them",
        ep->me, ep->n);
    st = ep->status;
    goto out;
  }
  if (c && (c->dead || c->bye_received)) {
    chorus__ep_fail_peer_left(ep, c, "waits for its data");
    st = ep->status;
    goto out;
  }
  chorus__req_t **pp = &ep->recvs;
  while (*pp) pp = &(*pp)->next;
  *pp = req;
  if (any)
    chorus__tp_resume_all(tp); /* a held-back message may be this one */
  else if (c) resume_peer(tp, c);
out:
  return st;
}
