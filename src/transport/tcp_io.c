/*
 * tcp_io.c - framing and encryption of a TCP connection: writing a
 * connection's send queue (zero-copy from the caller's buffers, or sealed in
 * AES-GCM records), sending a large message in pieces, reading messages
 * (the main connection) and pieces (the peer's piece connections) from it,
 * opening records, and reassembling a message from its pieces.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "transport/tcp.h"
#include "util/clock.h"
#include "util/util.h"

/* Payload bytes chorus__tcp_read_stream takes from one stream before it
 * returns.  The progress thread holds the context's lock while it reads; a peer that
 * sends as fast as this rank copies would otherwise keep it reading a whole
 * large message, and a thread that wants to post a receive for that very
 * message would wait until it was buffered whole (tens of ms at 32 MiB). */
#define READ_SLICE ((size_t)512 << 10)

/* ------------------------------------------------------------ sending */

/* Whether the main connection routed a HEAD that head_begin has not taken
 * yet (it was paused for the budget, and resumed). */
int chorus__tcp_head_waiting(const conn_t *c) {
  return c->rx.in_payload && chorus__le16_get(c->rx.hbuf + 4) == CHORUS__WIRE_HEAD;
}

/* Whether s's input is switched off: the main connection paused by the
 * endpoint layer, a piece waiting for its HEAD. */
int chorus__tcp_stream_blocked(const stream_t *s) {
  return s->kind == S_MAIN ? s->c->rx.paused : s->kind == S_IN && s->waiting;
}

/* The events s waits for: input unless blocked, output while its queue is
 * blocked. */
int chorus__tcp_update_events(stream_t *s, int blocked, int out) {
  uint32_t ev = (blocked ? 0u : (uint32_t)EPOLLIN) | (out ? (uint32_t)EPOLLOUT : 0u);
  return chorus__tp_watch_mod(stream_tp(s), s->fd, ev, &s->watch);
}

static void set_epoll_out(stream_t *s, int on) {
  if (s->epoll_out == on || s->c->peer->dead) return;
  if (chorus__tcp_update_events(s, chorus__tcp_stream_blocked(s), on) == 0) s->epoll_out = on;
}

/* Takes an item off the head of s's queue once all its bytes are out (or
 * sealed in a record): its request is complete (or, for a piece, one step
 * nearer), the caller may reuse the buffer. */
static void tx_item_done(stream_t *s) {
  if (s->kind == S_OUT) s->c->parts_queued--;
  chorus__txq_pop_done(stream_tp(s), &s->txq);
}

/* Seals the next record from the head of the queue into s->tx_rec: as many
 * bytes of as many queued messages as fit in REC_MAX.  0, or -1 after
 * failing the connection. */
static int seal_record(stream_t *s) {
  size_t plen = 0;
  for (txitem_t *it = s->txq.head; it && plen < REC_MAX; it = it->next)
    plen += CHORUS__MIN(REC_MAX - plen, HDR_SIZE + it->len - it->off);
  uint8_t *rec = s->tx_rec, *out = rec + 4;
  chorus__le32_put(rec, (uint32_t)plen);
  int rc = chorus__aead_begin(s->tx_aead, rec, 4);
  size_t left = plen;
  while (rc == 0 && left > 0) {
    txitem_t *it = s->txq.head;
    const uint8_t *in;
    size_t k;
    if (it->off < HDR_SIZE) {
      in = it->hdr + it->off;
      k = HDR_SIZE - it->off;
    } else {
      in = (const uint8_t *)it->payload + (it->off - HDR_SIZE);
      k = HDR_SIZE + it->len - it->off;
    }
    if (k > left) k = left;
    rc = chorus__aead_update(s->tx_aead, in, out, k);
    out += k;
    left -= k;
    it->off += k;
    if (it->off == HDR_SIZE + it->len) tx_item_done(s);
  }
  if (rc == 0) rc = chorus__aead_seal_end(s->tx_aead, rec + 4 + plen);
  if (rc < 0) {
    chorus__tcp_conn_failed(s->c, "encryption failed (libcrypto)", CHORUS_ERR_SYSTEM);
    return -1;
  }
  s->tx_len = plen + REC_OVERHEAD;
  s->tx_off = 0;
  return 0;
}

/* The next bytes of s's queue to write into iov: the rest of the sealed
 * record (sealing the next one when the last is out) when the connection is
 * encrypted, else the head message's header and payload.  Returns the iovec
 * count, 0 when nothing is left, -1 after failing the connection. */
static int next_tx(stream_t *s, struct iovec iov[2]) {
  if (s->tx_aead) {
    if (s->tx_off == s->tx_len) {
      if (!s->txq.head) return 0;
      if (seal_record(s) < 0) return -1;
    }
    iov[0].iov_base = s->tx_rec + s->tx_off;
    iov[0].iov_len = s->tx_len - s->tx_off;
    return 1;
  }
  txitem_t *it = s->txq.head;
  if (!it) return 0;
  if (it->off >= HDR_SIZE) {
    size_t poff = it->off - HDR_SIZE;
    iov[0].iov_base = (void *)(it->payload + poff);
    iov[0].iov_len = it->len - poff;
    return 1;
  }
  iov[0].iov_base = it->hdr + it->off;
  iov[0].iov_len = HDR_SIZE - it->off;
  if (!it->len) return 1;
  iov[1].iov_base = (void *)it->payload;
  iov[1].iov_len = it->len;
  return 2;
}

/* Writes as much of s's queue as the socket takes. */
void chorus__tcp_flush_tx(stream_t *s) {
  conn_t *c = s->c;
  while (!c->peer->dead) {
    struct iovec iov[2];
    int niov = next_tx(s, iov);
    if (niov < 0) return;
    if (niov == 0) {
      set_epoll_out(s, 0);
      chorus__tp_wake(conn_tp(c)); /* tp_destroy waits for drained queues */
      return;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    ssize_t n = sendmsg(s->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        set_epoll_out(s, 1);
        return;
      }
      char why[128];
      snprintf(why, sizeof why, "write failed (%s)", strerror(errno));
      chorus__tcp_conn_failed(c, why, CHORUS_ERR_REMOTE);
      return;
    }
    if (s->tx_aead) {
      s->tx_off += (size_t)n;
      continue;
    }
    txitem_t *it = s->txq.head;
    it->off += (size_t)n;
    if (it->off == HDR_SIZE + it->len) tx_item_done(s);
  }
}

/* Queues it on s and writes what can go now, when s is up. */
void chorus__tcp_stream_push(stream_t *s, txitem_t *it) {
  chorus__txq_push(&s->txq, it);
  if (s->state == C_READY && s->txq.head == it) chorus__tcp_flush_tx(s);
}

/* Sends it (a DATA message, every piece connection up) in pieces (wire.h):
 * its header alone as the HEAD on the main connection, piece i a PART on
 * piece connection i mod K.  0, or -1 when it goes whole (too short, or no
 * memory for the pieces). */
int chorus__tcp_send_in_pieces(conn_t *c, txitem_t *it) {
  uint64_t psize;
  if (chorus__le16_get(it->hdr + 4) != CHORUS__WIRE_DATA) return -1;
  int n = chorus__wire_parts(it->len, c->nout, &psize);
  if (n < 2) return -1;
  txitem_t *first = NULL, **tail = &first;
  for (int i = 0; i < n; i++) {
    txitem_t *pt = calloc(1, sizeof *pt);
    if (!pt) {
      while (first) {
        txitem_t *x = first;
        first = x->next;
        free(x);
      }
      return -1;
    }
    *tail = pt;
    tail = &pt->next;
  }
  uint64_t msg = ++c->tx_msgs;
  int i = 0;
  for (txitem_t *pt = first; pt; pt = pt->next, i++) {
    uint64_t off = (uint64_t)i * psize;
    chorus__wire_hdr_t h = {.magic = CHORUS__WIRE_MAGIC, .type = CHORUS__WIRE_PART,
                            .ep_id = msg, .seq = off,
                            .len = CHORUS__MIN(psize, (uint64_t)it->len - off)};
    chorus__wire_encode(&h, pt->hdr);
    pt->payload = it->payload + off;
    pt->len = (size_t)h.len;
    pt->ep = it->ep;
    pt->whole = it;
  }
  chorus__le16_put(it->hdr + 4, CHORUS__WIRE_HEAD); /* its len stays the whole length */
  it->len = 0;                                     /* the header alone */
  it->pieces = n + 1;
  chorus__tcp_stream_push(&c->s0, it);
  i = 0;
  for (txitem_t *pt = first, *nx; pt; pt = nx, i++) {
    nx = pt->next;
    pt->next = NULL;
    if (c->state == C_CLOSED) /* a write failed meanwhile: the pair is gone */
      chorus__tp_tx_lost(conn_tp(c), c->peer, pt);
    else {
      c->parts_queued++;
      chorus__tcp_stream_push(c->out[i % c->nout], pt);
    }
  }
  return 0;
}

/* ---------------------------------------------------------- receiving */

/* Reads and opens the next record of an encrypted connection.  1 when its
 * plaintext is ready, 0 at end of stream, -1 with errno set (EAGAIN: the
 * rest has not arrived; EBADMSG: the connection failed, it was altered). */
static int open_record(stream_t *s) {
  conn_t *c = s->c;
  uint8_t *rec = s->rx_rec;
  for (;;) {
    size_t need = s->rx_got < 4 ? 4 : REC_OVERHEAD + chorus__le32_get(rec);
    if (s->rx_got == 4 && chorus__le32_get(rec) > REC_MAX) {
      chorus__tp_protocol_error(conn_tp(c), c->peer,
                                "encrypted record longer than the protocol allows");
      errno = EBADMSG;
      return -1;
    }
    if (s->rx_got == need && need > 4) break;
    ssize_t n = recv(s->fd, rec + s->rx_got, need - s->rx_got, MSG_DONTWAIT);
    if (n <= 0) return n == 0 ? 0 : -1;
    s->rx_got += (size_t)n;
  }
  size_t plen = chorus__le32_get(rec);
  int rc = chorus__aead_begin(s->rx_aead, rec, 4);
  if (rc == 0) rc = chorus__aead_update(s->rx_aead, rec + 4, rec + 4, plen);
  if (rc == 0) rc = chorus__aead_open_end(s->rx_aead, rec + 4 + plen);
  s->rx_got = 0;
  if (rc < 0) {
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: a record from world rank %d (%s) failed "
                "authentication; closing the connection", c->peer->rank, c->peer->addr);
    chorus__tcp_conn_failed(
        c,
        "an encrypted record failed authentication: its bytes were changed on the "
        "way, or do not come from that rank",
        CHORUS_ERR_PROTOCOL);
    errno = EBADMSG;
    return -1;
  }
  s->rx_poff = 0;
  s->rx_pleft = plen;
  return 1;
}

/* recv() for the parser: from the socket, or from opened records when the
 * connection is encrypted. */
static ssize_t stream_recv(stream_t *s, void *dst, size_t want) {
  if (!s->rx_aead) return recv(s->fd, dst, want, MSG_DONTWAIT);
  while (s->rx_pleft == 0) {
    int rc = open_record(s);
    if (rc <= 0) return rc;
  }
  size_t k = CHORUS__MIN(want, s->rx_pleft);
  memcpy(dst, s->rx_rec + 4 + s->rx_poff, k);
  s->rx_poff += k;
  s->rx_pleft -= k;
  return (ssize_t)k;
}

void chorus__tcp_assembly_free(conn_t *c, assembly_t *a) {
  assembly_t **pp = &c->asm_head, *prev = NULL;
  while (*pp && *pp != a) {
    prev = *pp;
    pp = &(*pp)->next_asm;
  }
  if (*pp) {
    *pp = a->next_asm;
    if (c->asm_tail == a) c->asm_tail = prev;
    c->nasm--;
  }
  chorus__tp_rx_detach(c->peer, &a->rx);
  free(a);
}

/* The main connection routed a HEAD (c->rx in its payload, none of which
 * comes on this connection): the message moves to an assembly of its own
 * for the piece connections to fill, and the main connection goes on with
 * the next header; piece connections whose piece of it came first may read
 * on.  0, or -1 after failing the peer. */
static int head_begin(conn_t *c) {
  chorus__tp_t *tp = conn_tp(c);
  uint64_t psize;
  int n = c->nin ? chorus__wire_parts(c->rx.h.len, c->nin, &psize) : 0;
  if (n < 2) { /* wire_check rules out the short ones; a peer's bytes all the same */
    chorus__tp_protocol_error(tp, c->peer, c->nin ? "a message in pieces too short to cut"
                                                  : "a message in pieces before any piece "
                                                    "connection");
    return -1;
  }
  if (c->nasm >= MAX_ASSEMBLIES) {
    chorus__tp_protocol_error(tp, c->peer, "too many messages in pieces in reassembly");
    return -1;
  }
  assembly_t *a = calloc(1, sizeof *a);
  if (!a) {
    chorus__tcp_conn_failed(c, "out of memory reassembling a message in pieces",
                            CHORUS_ERR_NO_MEMORY);
    return -1;
  }
  chorus__tp_rx_attach(tp, c->peer, &a->rx, &c->ch->base, c);
  chorus__tp_rx_move(&c->rx, &a->rx);
  a->msg = ++c->rx_msgs;
  a->psize = psize;
  a->nparts = n;
  for (int i = 0; i < c->nin; i++) a->next[i] = i;
  if (c->asm_tail) c->asm_tail->next_asm = a;
  else c->asm_head = a;
  c->asm_tail = a;
  c->nasm++;
  for (int i = 0; i < c->nin; i++) {
    stream_t *o = c->in[i];
    if (!o || !o->waiting) continue;
    o->waiting = 0;
    chorus__tcp_update_events(o, 0, 0);
    chorus__tp_kick(tp); /* its header is parsed already: no event says so */
  }
  return 0;
}

/* The header of a piece is in s->hbuf (s: a piece connection of the
 * peer's): find its message, or wait for its HEAD.  0, or -1 after failing
 * the peer. */
static int part_header(stream_t *s) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  chorus__wire_hdr_t h;
  chorus__wire_decode(s->hbuf, &h);
  const char *bad = chorus__wire_check(&h);
  if (!bad && h.type != CHORUS__WIRE_PART) bad = "a message other than a piece on a piece connection";
  if (bad) {
    chorus__tp_protocol_error(tp, c->peer, bad);
    return -1;
  }
  if (h.ep_id > c->rx_msgs) { /* its HEAD has not come yet on the main connection */
    if (!s->waiting) {
      s->waiting = 1;
      chorus__tcp_update_events(s, 1, 0);
    }
    return 0;
  }
  assembly_t *a = c->asm_head;
  while (a && a->msg != h.ep_id) a = a->next_asm;
  int j = a ? a->next[s->idx] : 0;
  uint64_t off = (uint64_t)j * (a ? a->psize : 0);
  if (!a || j >= a->nparts || h.seq != off || h.len != CHORUS__MIN(a->psize, a->rx.h.len - off)) {
    chorus__tp_protocol_error(tp, c->peer, a ? "a piece that does not fit its message"
                                             : "a piece of a message already complete");
    return -1;
  }
  a->next[s->idx] += c->nin;
  s->hgot = 0;
  s->part = a;
  s->part_off = off;
  s->part_left = h.len;
  return 0;
}

/* n bytes of s's piece were read. */
static void part_bytes(stream_t *s, size_t n) {
  assembly_t *a = s->part;
  s->part_off += n;
  s->part_left -= n;
  if (!s->part_left) s->part = NULL;
  chorus__tp_rx_bytes_to(stream_tp(s), &a->rx, n, s->part_off);
  /* Completing it may fail endpoints, whose ABORT may fail the peer: then
   * tcp_close freed every assembly, a too. */
  if (s->c->peer->dead) return;
  if (!a->rx.left) chorus__tcp_assembly_free(s->c, a);
}

/* Reads what s's socket has: messages (the main connection), pieces (the
 * peer's piece connections), nothing (ours: only its end, or an error). */
void chorus__tcp_read_stream(stream_t *s) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  chorus__peer_t *p = c->peer;
  chorus__rx_t *rx = &c->rx;
  size_t slice = 0; /* payload bytes read by this call */
  while (!p->dead) {
    ssize_t n;
    /* Input left in the kernel shows in the next epoll_wait; decrypted
     * bytes of a record only to tcp_poll, in the same round. */
    if (slice >= READ_SLICE && !s->rx_pleft) return;
    if (s->kind == S_OUT) {
      char b;
      n = stream_recv(s, &b, 1);
      if (n > 0) {
        chorus__tp_protocol_error(tp, p, "data on a connection that carries this rank's pieces");
        return;
      }
    } else if (s->kind == S_IN) {
      if (s->part) {
        assembly_t *a = s->part;
        char *dst = a->rx.dst ? a->rx.dst + s->part_off : c->ch->discard;
        size_t want = a->rx.dst ? s->part_left : CHORUS__MIN(s->part_left, (uint64_t)DISCARD_BUF);
        n = stream_recv(s, dst, want);
        if (n > 0) {
          p->last_heard = chorus__now_ns();
          slice += (size_t)n;
          part_bytes(s, (size_t)n);
          continue;
        }
      } else {
        if (s->waiting) return;
        if (s->hgot == HDR_SIZE) {
          if (part_header(s) < 0) return;
          continue;
        }
        n = stream_recv(s, s->hbuf + s->hgot, HDR_SIZE - s->hgot);
        if (n > 0) {
          p->last_heard = chorus__now_ns();
          s->hgot += (size_t)n;
          continue;
        }
      }
    } else if (!rx->in_payload) {
      n = stream_recv(s, rx->hbuf + rx->hgot, HDR_SIZE - rx->hgot);
      if (n > 0) {
        p->last_heard = chorus__now_ns();
        rx->hgot += (size_t)n;
        if (rx->hgot == HDR_SIZE) {
          chorus__tp_rx_header(tp, rx);
          if (rx->paused) return; /* the endpoint layer resumes it */
        }
        continue;
      }
    } else if (chorus__le16_get(rx->hbuf + 4) == CHORUS__WIRE_HEAD) {
      /* Routed (now, or when the endpoint layer resumed the connection). */
      if (head_begin(c) < 0) return;
      continue;
    } else {
      char *dst = rx->dst ? rx->dst + (rx->h.len - rx->left) : c->ch->discard;
      size_t want = rx->dst ? rx->left : CHORUS__MIN(rx->left, (size_t)DISCARD_BUF);
      n = stream_recv(s, dst, want);
      if (n > 0) {
        p->last_heard = chorus__now_ns();
        slice += (size_t)n;
        chorus__tp_rx_bytes(tp, rx, (size_t)n);
        continue;
      }
    }
    if (p->dead) return; /* a record failed authentication */
    if (n == 0) {
      int mid = s->kind == S_IN ? s->part || s->hgot : s->kind == S_MAIN && (rx->in_payload || rx->hgot);
      chorus__tcp_conn_failed(c, mid ? "closed its connection in the middle of a message"
                         : "closed its connection", CHORUS_ERR_REMOTE);
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    char why[128];
    snprintf(why, sizeof why, "connection failed (%s)", strerror(errno));
    chorus__tcp_conn_failed(c, why, CHORUS_ERR_REMOTE);
    return;
  }
}
