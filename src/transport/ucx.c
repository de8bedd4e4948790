/*
 * ucx.c - the UCX channel: every message to a peer is one active message
 * of UCX's UCP layer, which picks the way (InfiniBand or RoCE verbs, shared
 * memory, TCP) and moves large payloads by rendezvous straight into the
 * receive buffer (RDMA where the hardware has it).
 *
 * What goes over UCP.  Each message is an active message whose user header
 * is the 56-byte wire header (wire.h) followed by ours:
 *
 *   56  u32 sender's world rank
 *   60  u32 flags (F_CREDIT: no message, only the acknowledgement)
 *   64  u64 sequence number of the message on this pair and direction
 *   72  u64 acknowledgement: the receiver of this header may send the
 *           sender messages up to (this + WINDOW - 1)
 *   80  16 bytes: the pair's token
 *
 * and whose data is the payload.  Payloads up to EAGER_MAX travel eagerly
 * (UCX copies them); larger ones by rendezvous (the receiver fetches them
 * once it knows where they go).
 *
 * Who may talk to us.  A UCX worker accepts whoever has its address, so
 * every header carries a token only the job's ranks can compute: HMAC of
 * the job key over the world id and both ranks, one per direction of each
 * pair.  A header with a wrong token is dropped unread; one with a good
 * token but a sequence number other than the ones the pair expects next is
 * a protocol violation (a replayed or forged message), and the peer fails.
 * CHORUS_ENCRYPT=1 is not offered on this channel (docs/security.md).
 *
 * Order and memory.  The endpoint layer needs a peer's messages in order,
 * and must be able to stop reading a peer whose messages can go nowhere yet
 * (its budget of early messages is spent).  Messages are routed in sequence
 * order; those that arrive early or while the peer is paused wait here,
 * their data held by UCX (eager) or still at the sender (rendezvous).  The
 * sender may be at most WINDOW messages ahead of what the receiver routed:
 * every header acknowledges what its sender routed, and a receiver that
 * routed CREDIT_EVERY messages without sending anything back sends a bare
 * acknowledgement.  So a peer can make this rank hold at most WINDOW
 * messages of at most EAGER_MAX bytes each, whatever it sends.
 *
 * Every function here runs with the context's lock held (chan.h).
 */
#include "transport/chan.h"

#ifdef CHORUS_HAVE_UCX

#include "transport/ucx_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "util/clock.h"
#include "util/le.h"
#include "util/net.h"
#include "util/util.h"

/* ------------------------------------------------------------ the wire */

static void mark_ready(ucx_link_t *l) {
  if (l->ready) return;
  l->ready = 1;
  l->next_ready = l->ch->ready;
  l->ch->ready = l;
}

/* A failure seen inside a callback: the peer fails in drive(). */
void chorus__ucx_defer_fail(ucx_link_t *l, int protocol, const char *fmt, const char *arg) {
  if (l->fail_what) return;
  snprintf(l->fail_buf, sizeof l->fail_buf, fmt, arg);
  l->fail_what = l->fail_buf;
  l->fail_protocol = protocol;
  mark_ready(l);
}

void chorus__ucx_token(const chorus__key_t *key, uint64_t world, int src, int dst,
                       uint8_t out[TOKEN_LEN]) {
  uint8_t w[8], s[4], d[4], mac[CHORUS__MAC_LEN];
  chorus__le64_put(w, world);
  chorus__le32_put(s, (uint32_t)src);
  chorus__le32_put(d, (uint32_t)dst);
  static const char label[] = "chorus-ucx-token";
  const void *parts[] = {label, w, s, d};
  const size_t lens[] = {sizeof label - 1, 8, 4, 4};
  chorus__hmac(key, parts, lens, 4, mac);
  memcpy(out, mac, TOKEN_LEN);
}

/* ------------------------------------------------------------- sending */

static void send_cb(void *request, ucs_status_t status, void *user_data) {
  sent_t *s = user_data;
  (void)request;
  s->status = status;
  ucx_chan_t *ch = s->l->ch;
  LIST_DEL(ch->inflight, s);
  LIST_PUSH(ch->completed, s);
}


/* Hands it (NULL: a bare acknowledgement) to UCX.  0, or -1 after failing
 * the peer. */
int chorus__ucx_post(ucx_link_t *l, chorus__tx_t *it) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  sent_t *s = calloc(1, sizeof *s);
  if (!s) {
    chorus__tp_peer_failed(tp, l->peer, "could not be sent to (out of memory)", CHORUS_ERR_REMOTE);
    if (it) chorus__tp_tx_lost(tp, l->peer, it);
    return -1;
  }
  s->l = l;
  s->it = it;
  if (it) memcpy(s->hdr, it->hdr, CHORUS__WIRE_HDR_SIZE);
  chorus__le32_put(s->hdr + OFF_SRC, (uint32_t)tp->rank);
  chorus__le32_put(s->hdr + OFF_FLAGS, it ? 0 : F_CREDIT);
  chorus__le64_put(s->hdr + OFF_SEQ, it ? l->tx_seq++ : 0);
  chorus__le64_put(s->hdr + OFF_ACK, l->rx_next);
  memcpy(s->hdr + OFF_TOKEN, l->tok_out, TOKEN_LEN);
  l->ack_sent = l->rx_next;
  l->last_sent = chorus__now_ns();
  size_t len = it ? it->len : 0;
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_FLAGS,
      .flags = len > EAGER_MAX ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER,
      .cb.send = send_cb,
      .user_data = s};
  LIST_PUSH(ch->inflight, s);
  ucs_status_ptr_t r = ucp_am_send_nbx(l->ep, AM_ID, s->hdr, AM_HDR, it ? it->payload : NULL, len, &prm);
  if (r == NULL) { /* done at once */
    LIST_DEL(ch->inflight, s);
    if (it) chorus__tp_tx_done(tp, it);
    free(s);
    return 0;
  }
  if (UCS_PTR_IS_ERR(r)) {
    LIST_DEL(ch->inflight, s);
    char why[160];
    snprintf(why, sizeof why, "could not be sent to (UCX: %s)", ucs_status_string(UCS_PTR_STATUS(r)));
    free(s);
    chorus__tp_peer_failed(tp, l->peer, why, CHORUS_ERR_REMOTE);
    if (it) chorus__tp_tx_lost(tp, l->peer, it);
    return -1;
  }
  s->req = r; /* freed once its callback ran (drive) */
  return 0;
}

/* Hands the queued messages the window allows to UCX. */
void chorus__ucx_flush(ucx_link_t *l) {
  while (l->q.head && !l->closed && l->tx_seq < l->acked + WINDOW) {
    chorus__tx_t *it = l->q.head;
    l->q.head = it->next;
    if (!l->q.head) l->q.tail = NULL;
    it->next = NULL;
    if (chorus__ucx_post(l, it) < 0) return;
  }
}

void chorus__ucx_send(chorus__chan_t *base, chorus__peer_t *p, chorus__tx_t *it) {
  ucx_link_t *l = p->link;
  if (l->closed || chorus__ucx_ensure_ep(l) < 0) {
    chorus__tp_tx_lost(base->tp, p, it);
    return;
  }
  chorus__txq_push(&l->q, it);
  chorus__ucx_flush(l);
  /* Whatever is not done yet moves on the progress thread. */
  if (l->ch->inflight || l->q.head) chorus__tp_kick(base->tp);
}

/* ----------------------------------------------------------- receiving */

void chorus__ucx_held_release(ucx_chan_t *ch, held_t *m) {
  if (m->own) free(m->data);
  else if (m->data) ucp_am_data_release(ch->worker, m->data);
  free(m);
}

ucs_status_t chorus__ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param) {
  ucx_chan_t *ch = arg;
  chorus__tp_t *tp = ch->base.tp;
  const uint8_t *h = header;
  if (header_length != AM_HDR) goto stranger;
  uint32_t src = chorus__le32_get(h + OFF_SRC);
  if (src >= (uint32_t)tp->size || (int)src == tp->rank) goto stranger;
  ucx_link_t *l = &ch->links[src];
  /* A rank shared memory carries has no link here (peer NULL). */
  if (!l->peer || l->peer->chan != &ch->base ||
      !chorus__ct_equal(h + OFF_TOKEN, l->tok_in, TOKEN_LEN))
    goto stranger;
  if (l->closed || l->fail_what) return UCS_OK; /* dropped with the peer */
  l->peer->last_heard = chorus__now_ns();
  uint64_t ack = chorus__le64_get(h + OFF_ACK);
  if (ack > l->tx_seq) {
    chorus__ucx_defer_fail(l, 1, "%s", "acknowledged messages never sent");
    return UCS_OK;
  }
  if (ack > l->acked) {
    l->acked = ack;
    if (l->q.head) mark_ready(l);
  }
  if (!l->ep) mark_ready(l); /* heartbeats go back from now on */
  uint32_t flags = chorus__le32_get(h + OFF_FLAGS);
  if (flags & F_CREDIT) return UCS_OK;
  uint64_t seq = chorus__le64_get(h + OFF_SEQ);
  if (seq < l->rx_next || seq - l->rx_next >= WINDOW) {
    chorus__ucx_defer_fail(l, 1, "%s",
                           "message outside the window (replayed, or sent past its credit)");
    return UCS_OK;
  }
  int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  int keep = rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA);
  /* What may be held is bounded here, before anything is kept: eager
   * payloads of at most EAGER_MAX (larger ones go by rendezvous, and a
   * small one by rendezvous would only make us fetch), each the length its
   * header says. */
  if (rndv != (length > EAGER_MAX)) {
    chorus__ucx_defer_fail(l, 1, "%s",
                           rndv ? "small message by rendezvous" : "eager message too large");
    return UCS_OK;
  }
  chorus__wire_hdr_t wh;
  chorus__wire_decode(h, &wh);
  if (wh.len != length) {
    chorus__ucx_defer_fail(l, 1, "%s", "payload length differs from its header");
    return UCS_OK;
  }
  held_t *m = calloc(1, sizeof *m);
  if (!m) {
    chorus__ucx_defer_fail(l, 0, "%s", "sent a message this rank had no memory to hold");
    return UCS_OK;
  }
  m->seq = seq;
  memcpy(m->wire, h, CHORUS__WIRE_HDR_SIZE);
  m->len = length;
  m->rndv = rndv;
  if (keep) {
    m->data = data;
  } else if (length) {
    m->data = malloc(length); /* at most EAGER_MAX (checked above) */
    m->own = 1;
    if (!m->data) {
      free(m);
      chorus__ucx_defer_fail(l, 0, "%s", "sent a message this rank had no memory to hold");
      return UCS_OK;
    }
    memcpy(m->data, data, length);
  }
  held_t **pp = &l->held;
  while (*pp && (*pp)->seq < seq) pp = &(*pp)->next;
  if (*pp && (*pp)->seq == seq) {
    if (m->own) free(m->data); /* UCX frees its own when we return UCS_OK */
    free(m);
    chorus__ucx_defer_fail(l, 1, "%s", "two messages with one sequence number");
    return UCS_OK;
  }
  m->next = *pp;
  *pp = m;
  if (seq == l->rx_next) mark_ready(l);
  return keep ? UCS_INPROGRESS : UCS_OK;
stranger:
  /* Not from a rank of this job (or from another world): never read. */
  if (!ch->warned_stranger) {
    ch->warned_stranger = 1;
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: dropped a UCX message that is not from a rank of this "
                "job (wrong header or token); further ones are dropped silently");
  }
  return UCS_OK;
}

static void pull_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
  pull_t *pl = user_data;
  (void)request;
  (void)length;
  pl->status = status;
  ucx_chan_t *ch = pl->l->ch;
  LIST_DEL(ch->pulls, pl);
  LIST_PUSH(ch->pulled, pl);
}

/* A fetch that failed fails its peer in drive(), after the messages the
 * peer sent before; its stream stays attached until then (the peer's
 * failure sees a message in progress). */
void chorus__ucx_pull_finish(ucx_chan_t *ch, pull_t *pl) {
  chorus__tp_t *tp = ch->base.tp;
  ucx_link_t *l = pl->l;
  if (pl->req) ucp_request_free(pl->req);
  pl->req = NULL;
  if (pl->status != UCS_OK && !l->closed) {
    chorus__ucx_defer_fail(l, 0, "failed while this rank fetched a message from it (UCX: %s)",
                           ucs_status_string(pl->status));
    pl->next = ch->failed_pulls;
    ch->failed_pulls = pl;
    return;
  }
  if (pl->status == UCS_OK && !l->closed) {
    l->peer->last_heard = chorus__now_ns();
    chorus__tp_rx_bytes(tp, &pl->rx, pl->len);
  }
  chorus__tp_rx_detach(l->peer, &pl->rx);
  free(pl);
}

/* l->rx routed message m (its payload, if any, next): moves the payload. */
static void deliver(ucx_link_t *l, held_t *m) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  if (!l->rx.in_payload) { /* nothing to move (or a zero-length payload, done) */
    chorus__ucx_held_release(ch, m);
    return;
  }
  if (!m->rndv) {
    if (l->rx.dst && m->len) memcpy(l->rx.dst, m->data, m->len);
    chorus__ucx_held_release(ch, m);
    chorus__tp_rx_bytes(tp, &l->rx, l->rx.left);
    return;
  }
  if (!l->rx.dst) {
    /* Nowhere to go: UCX tells the sender its message was taken. */
    void *desc = m->data;
    m->data = NULL;
    ucp_am_data_release(ch->worker, desc);
    chorus__ucx_held_release(ch, m);
    chorus__tp_rx_bytes(tp, &l->rx, l->rx.left);
    return;
  }
  pull_t *pl = calloc(1, sizeof *pl);
  if (!pl) {
    chorus__ucx_held_release(ch, m);
    chorus__tp_peer_failed(tp, l->peer, "sent a message this rank had no memory to fetch",
                           CHORUS_ERR_REMOTE);
    return;
  }
  pl->l = l;
  pl->len = m->len;
  pl->owner = l->rx.req ? l->rx.req->ep : NULL;
  chorus__tp_rx_attach(tp, l->peer, &pl->rx, &ch->base, l);
  chorus__tp_rx_move(&l->rx, &pl->rx);
  pl->rx.src = l->peer->rank;
  pl->rx.dst_fixed = 1; /* UCX fetches into it from now on */
  LIST_PUSH(ch->pulls, pl);
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
      .cb.recv_am = pull_cb,
      .user_data = pl};
  void *desc = m->data;
  m->data = NULL;
  free(m);
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(ch->worker, desc, pl->rx.dst, pl->len, &prm);
  if (r == NULL || UCS_PTR_IS_ERR(r)) {
    LIST_DEL(ch->pulls, pl);
    pl->status = r ? UCS_PTR_STATUS(r) : UCS_OK;
    chorus__ucx_pull_finish(ch, pl);
    return;
  }
  pl->req = r;
}

/* Routes l's messages in sequence order until one must wait. */
void chorus__ucx_route(ucx_link_t *l) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  while (!l->paused && !l->closed && !l->peer->dead && l->held && l->held->seq == l->rx_next) {
    held_t *m = l->held;
    if (!l->head_routed) {
      chorus__wire_hdr_t h;
      chorus__wire_decode(m->wire, &h);
      if (h.len != m->len) {
        chorus__tp_protocol_error(tp, l->peer, "payload length differs from its header");
        return;
      }
      memcpy(l->rx.hbuf, m->wire, CHORUS__WIRE_HDR_SIZE);
      l->rx.hgot = CHORUS__WIRE_HDR_SIZE;
      chorus__tp_rx_header(tp, &l->rx);
      if (l->closed || l->peer->dead || l->paused) return; /* waits at the head */
    }
    l->head_routed = 0;
    l->held = m->next;
    l->rx_next++;
    deliver(l, m);
  }
  if (!l->closed && !l->peer->dead && l->rx_next - l->ack_sent >= CREDIT_EVERY && l->ep)
    chorus__ucx_post(l, NULL);
}

void chorus__ucx_rx_pause(chorus__chan_t *base, chorus__rx_t *rx, int on) {
  ucx_link_t *l = rx->link;
  if (rx != &l->rx) return; /* a pull never pauses */
  if (on) {
    l->paused = 1;
    return;
  }
  /* The endpoint routed the head again (try_resume): its payload next. */
  l->paused = 0;
  l->head_routed = 1;
  mark_ready(l);
  chorus__tp_kick(base->tp);
}

#endif
