/*
 * tcp.c - the TCP channel (chan.h): a full mesh of authenticated
 * connections, one per pair of ranks, optionally encrypted.
 *
 * Wire format of every message: a 56-byte header followed by `len` payload
 * bytes.  The header's layout, its encoding and the checks that need nothing
 * but the header are in wire.h / wire.c.
 *
 * Sends are written zero-copy from the caller's buffer: the calling thread
 * writes what the socket accepts right away, the progress thread writes the
 * rest when the socket becomes writable.  Received bytes land directly where
 * the endpoint layer routes them (the posted receive, or a buffer for a
 * message that came early).
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/chan.h"
#include "transport/transport.h"
#include "transport/wire.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/crypto.h"
#include "util/util.h"

#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
typedef chorus__tx_t txitem_t;

#define HS_ACCEPT 0x41524843u   /* "CHRA" */
#define HS_CONNECT 0x43524843u  /* "CHRC" */
#define HS_OK 0x4b524843u       /* "CHRK" */
#define HS_DENY 0x44524843u     /* "CHRD" */
#define HS_VERSION 2u
/* Set in the version field of hello and connect when the sender encrypts
 * (CHORUS_ENCRYPT=1): both ends must agree. */
#define HS_FLAG_ENCRYPT 0x10000u
#define HS_VERSION_MASK 0xffffu
/* Handshake messages (docs/design.md, "Authentication"):
 *   hello    acceptor -> connector  "CHRA" u32 version, nonce Na
 *   connect  connector -> acceptor  "CHRC" u32 version, u32 rank c, nonce Nc,
 *                                   HMAC(key, "chorus data connect" W c a Na Nc)
 *   ok       acceptor -> connector  "CHRK" u32 rank a,
 *                                   HMAC(key, "chorus data accept" W c a Na Nc)
 *   deny     acceptor -> connector  "CHRD" u32 reason (HS_DENY_*)
 * W is the world id, never sent: a peer of another world fails the MAC like
 * one without the key, and a stranger learns nothing about the world. */
#define HS_HELLO_LEN (8 + CHORUS__NONCE_LEN)
#define HS_CONNECT_LEN (12 + CHORUS__NONCE_LEN + CHORUS__MAC_LEN)
#define HS_OK_LEN (8 + CHORUS__MAC_LEN)
#define HS_DENY_LEN 8
enum { HS_DENY_AUTH = 1, HS_DENY_RANK = 2, HS_DENY_VERSION = 3, HS_DENY_ENCRYPT = 4 };

/* CHORUS_ENCRYPT=1: after the handshake every byte of a connection travels
 * in AES-256-GCM records, u32 plaintext length (authenticated too) | that
 * many ciphertext bytes | 16-byte tag, each direction with its own key from
 * the handshake (HKDF of the job key over both nonces, the world and both
 * ranks) and a counter nonce, so a record that is altered, dropped,
 * replayed or reordered fails the connection.  Records pack the message
 * stream (headers and payloads) in pieces of at most REC_MAX bytes. */
#define REC_MAX ((size_t)128 << 10)
#define REC_OVERHEAD (4 + CHORUS__AEAD_TAG_LEN)
#define DISCARD_BUF 65536


typedef struct tcp_chan tcp_chan_t;

typedef struct conn {
  int fd;
  tcp_chan_t *ch;
  chorus__peer_t *peer;
  chorus__rx_t rx;
  chorus__watch_t watch;
  int epoll_out;
  /* Encryption (NULL when off): the directions' ciphers, the record being
   * written (tx_rec[tx_off..tx_len)) and the record being read
   * (rx_got bytes so far; once opened, plaintext at rx_rec + 4 + rx_poff,
   * rx_pleft bytes of it not yet parsed). */
  chorus__aead_t *tx_aead, *rx_aead;
  uint8_t *tx_rec, *rx_rec;
  size_t tx_len, tx_off, rx_got, rx_poff, rx_pleft;
  uint8_t keys[64]; /* from the handshake: connector->acceptor, acceptor->connector */
  /* Send queue. */
  chorus__txq_t txq;
} conn_t;

struct tcp_chan {
  chorus__chan_t base;
  conn_t *conns; /* indexed by world rank; conns[rank] unused */
  chorus__ratelimit_t reject_log; /* strangers turned away (accept_all) */
  char discard[DISCARD_BUF];
};

static void on_conn_event(void *arg, uint32_t events);
static void conn_failed(conn_t *c, const char *why, chorus_result_t code);
static chorus__tp_t *conn_tp(const conn_t *c) { return c->ch->base.tp; }

/* ------------------------------------------------------------ sending */

/* The events c waits for: input unless paused, output while its queue is
 * blocked. */
static int update_events(conn_t *c, int paused, int out) {
  uint32_t ev = (paused ? 0u : (uint32_t)EPOLLIN) | (out ? (uint32_t)EPOLLOUT : 0u);
  return chorus__tp_watch_mod(conn_tp(c), c->fd, ev, &c->watch);
}

static void set_epoll_out(conn_t *c, int on) {
  if (c->epoll_out == on || c->peer->dead) return;
  if (update_events(c, c->rx.paused, on) == 0) c->epoll_out = on;
}

/* Takes an item off the head of c's queue once all its bytes are out (or
 * sealed in a record): its request is complete, the caller may reuse the
 * buffer. */
static void tx_item_done(conn_t *c) { chorus__txq_pop_done(conn_tp(c), &c->txq); }

/* Seals the next record from the head of the queue into c->tx_rec: as many
 * bytes of as many queued messages as fit in REC_MAX.  0, or -1 after
 * failing the connection. */
static int seal_record(conn_t *c) {
  size_t plen = 0;
  for (txitem_t *it = c->txq.head; it && plen < REC_MAX; it = it->next)
    plen += CHORUS__MIN(REC_MAX - plen, HDR_SIZE + it->len - it->off);
  uint8_t *rec = c->tx_rec, *out = rec + 4;
  chorus__le32_put(rec, (uint32_t)plen);
  int rc = chorus__aead_begin(c->tx_aead, rec, 4);
  size_t left = plen;
  while (rc == 0 && left > 0) {
    txitem_t *it = c->txq.head;
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
    rc = chorus__aead_update(c->tx_aead, in, out, k);
    out += k;
    left -= k;
    it->off += k;
    if (it->off == HDR_SIZE + it->len) tx_item_done(c);
  }
  if (rc == 0) rc = chorus__aead_seal_end(c->tx_aead, rec + 4 + plen);
  if (rc < 0) {
    conn_failed(c, "encryption failed (libcrypto)", CHORUS_ERR_SYSTEM);
    return -1;
  }
  c->tx_len = plen + REC_OVERHEAD;
  c->tx_off = 0;
  return 0;
}

/* The next bytes of c's queue to write into iov: the rest of the sealed
 * record (sealing the next one when the last is out) when the connection is
 * encrypted, else the head message's header and payload.  Returns the iovec
 * count, 0 when nothing is left, -1 after failing the connection. */
static int next_tx(conn_t *c, struct iovec iov[2]) {
  if (c->tx_aead) {
    if (c->tx_off == c->tx_len) {
      if (!c->txq.head) return 0;
      if (seal_record(c) < 0) return -1;
    }
    iov[0].iov_base = c->tx_rec + c->tx_off;
    iov[0].iov_len = c->tx_len - c->tx_off;
    return 1;
  }
  txitem_t *it = c->txq.head;
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

/* Writes as much of the queue as the socket takes. */
static void flush_tx(conn_t *c) {
  while (!c->peer->dead) {
    struct iovec iov[2];
    int niov = next_tx(c, iov);
    if (niov < 0) return;
    if (niov == 0) {
      set_epoll_out(c, 0);
      chorus__tp_wake(conn_tp(c)); /* tp_destroy waits for drained queues */
      return;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        set_epoll_out(c, 1);
        return;
      }
      char why[128];
      snprintf(why, sizeof why, "write failed (%s)", strerror(errno));
      conn_failed(c, why, CHORUS_ERR_REMOTE);
      return;
    }
    if (c->tx_aead) {
      c->tx_off += (size_t)n;
      continue;
    }
    txitem_t *it = c->txq.head;
    it->off += (size_t)n;
    if (it->off == HDR_SIZE + it->len) tx_item_done(c);
  }
}

static void queue_tx(conn_t *c, txitem_t *it) {
  chorus__txq_push(&c->txq, it);
  if (c->txq.head == it) flush_tx(c);
}

/* ---------------------------------------------------------- receiving */

/* Reads and opens the next record of an encrypted connection.  1 when its
 * plaintext is ready, 0 at end of stream, -1 with errno set (EAGAIN: the
 * rest has not arrived; EBADMSG: the connection failed, it was altered). */
static int open_record(conn_t *c) {
  uint8_t *rec = c->rx_rec;
  for (;;) {
    size_t need = c->rx_got < 4 ? 4 : REC_OVERHEAD + chorus__le32_get(rec);
    if (c->rx_got == 4 && chorus__le32_get(rec) > REC_MAX) {
      chorus__tp_protocol_error(conn_tp(c), c->peer,
                                "encrypted record longer than the protocol allows");
      errno = EBADMSG;
      return -1;
    }
    if (c->rx_got == need && need > 4) break;
    ssize_t n = recv(c->fd, rec + c->rx_got, need - c->rx_got, MSG_DONTWAIT);
    if (n <= 0) return n == 0 ? 0 : -1;
    c->rx_got += (size_t)n;
  }
  size_t plen = chorus__le32_get(rec);
  int rc = chorus__aead_begin(c->rx_aead, rec, 4);
  if (rc == 0) rc = chorus__aead_update(c->rx_aead, rec + 4, rec + 4, plen);
  if (rc == 0) rc = chorus__aead_open_end(c->rx_aead, rec + 4 + plen);
  c->rx_got = 0;
  if (rc < 0) {
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: a record from world rank %d (%s) failed "
                "authentication; closing the connection", c->peer->rank, c->peer->addr);
    conn_failed(c, "an encrypted record failed authentication: its bytes were changed on the "
                "way, or do not come from that rank", CHORUS_ERR_PROTOCOL);
    errno = EBADMSG;
    return -1;
  }
  c->rx_poff = 0;
  c->rx_pleft = plen;
  return 1;
}

/* recv() for the parser: from the socket, or from opened records when the
 * connection is encrypted. */
static ssize_t conn_recv(conn_t *c, void *dst, size_t want) {
  if (!c->rx_aead) return recv(c->fd, dst, want, MSG_DONTWAIT);
  while (c->rx_pleft == 0) {
    int rc = open_record(c);
    if (rc <= 0) return rc;
  }
  size_t k = CHORUS__MIN(want, c->rx_pleft);
  memcpy(dst, c->rx_rec + 4 + c->rx_poff, k);
  c->rx_poff += k;
  c->rx_pleft -= k;
  return (ssize_t)k;
}

static void read_conn(conn_t *c) {
  chorus__tp_t *tp = conn_tp(c);
  chorus__peer_t *p = c->peer;
  chorus__rx_t *rx = &c->rx;
  while (!p->dead) {
    ssize_t n;
    if (!rx->in_payload) {
      n = conn_recv(c, rx->hbuf + rx->hgot, HDR_SIZE - rx->hgot);
      if (n > 0) {
        p->last_heard = chorus__now_ns();
        rx->hgot += (size_t)n;
        if (rx->hgot == HDR_SIZE) {
          chorus__tp_rx_header(tp, rx);
          if (rx->paused) return; /* the endpoint layer resumes it */
        }
        continue;
      }
    } else {
      char *dst = rx->dst ? rx->dst + (rx->h.len - rx->left) : c->ch->discard;
      size_t want = rx->dst ? rx->left : CHORUS__MIN(rx->left, (size_t)DISCARD_BUF);
      n = conn_recv(c, dst, want);
      if (n > 0) {
        p->last_heard = chorus__now_ns();
        chorus__tp_rx_bytes(tp, rx, (size_t)n);
        continue;
      }
    }
    if (p->dead) return; /* a record failed authentication */
    if (n == 0) {
      conn_failed(c, rx->in_payload || rx->hgot ? "closed its connection in the middle of a "
                                                  "message"
                                                : "closed its connection", CHORUS_ERR_REMOTE);
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    char why[128];
    snprintf(why, sizeof why, "connection failed (%s)", strerror(errno));
    conn_failed(c, why, CHORUS_ERR_REMOTE);
    return;
  }
}

/* ------------------------------------------------- the channel's ops */

static void conn_failed(conn_t *c, const char *why, chorus_result_t code) {
  chorus__tp_peer_failed(conn_tp(c), c->peer, why, code);
}

static void on_conn_event(void *arg, uint32_t events) {
  conn_t *c = arg;
  if (c->peer->dead) return;
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_conn(c);
  if (!c->peer->dead && (events & EPOLLOUT)) flush_tx(c);
}

static conn_t *conn_of(chorus__chan_t *ch, const chorus__peer_t *p) {
  return &((tcp_chan_t *)ch)->conns[p->rank];
}

static void tcp_send(chorus__chan_t *ch, chorus__peer_t *p, txitem_t *it) {
  queue_tx(conn_of(ch, p), it);
}

static void tcp_rx_pause(chorus__chan_t *ch, chorus__rx_t *rx, int on) {
  conn_t *c = rx->link;
  if (c->fd < 0 || c->peer->dead) return;
  update_events(c, on, c->epoll_out);
  /* Plaintext already opened: no socket event will announce it. */
  if (!on && c->rx_pleft) chorus__tp_kick(ch->tp);
}

static int tcp_cancel(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep) {
  return chorus__txq_cancel(&conn_of(ch, p)->txq, ep);
}

static int tcp_pending(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  return chorus__txq_has(&c->txq, ep) || (!ep && c->tx_off < c->tx_len);
}

static void tcp_close(chorus__chan_t *ch, chorus__peer_t *p) {
  conn_t *c = conn_of(ch, p);
  if (c->fd >= 0) {
    chorus__tp_unwatch(ch->tp, c->fd);
    /* The peer must see EOF now, not at its timeout; the fd number itself
     * stays reserved until the channel goes so it cannot be reused. */
    shutdown(c->fd, SHUT_RDWR);
  }
  chorus__txq_lose(ch->tp, p, &c->txq);
  c->tx_off = c->tx_len;
}

static void tcp_link_desc(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap) {
  conn_t *c = conn_of(ch, p);
  char local[80] = "?", remote[80] = "?", ifname[64] = "?";
  int lport = 0, rport = 0;
  if (c->fd < 0) {
    snprintf(buf, cap, "tcp (not connected)");
    return;
  }
  chorus__net_local_addr(c->fd, local, sizeof local, &lport);
  chorus__net_peer_addr(c->fd, remote, sizeof remote, &rport);
  chorus__net_addr_ifname(local, ifname, sizeof ifname);
  snprintf(buf, cap, "tcp %s:%d -> %s:%d (%s)", local, lport, remote, rport, ifname);
}

/* Opened records whose rest was not parsed (the stream was paused and
 * resumed): no socket event will say so. */
static void tcp_poll(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  if (!ch->tp->encrypt) return;
  for (int r = 0; r < ch->tp->size; r++) {
    conn_t *c = &t->conns[r];
    if (r != ch->tp->rank && c->rx_pleft && !c->rx.paused && !c->peer->dead) read_conn(c);
  }
}

static void tcp_destroy(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  if (t->conns) {
    for (int r = 0; r < ch->tp->size; r++) {
      conn_t *c = &t->conns[r];
      if (c->fd >= 0) close(c->fd);
      chorus__txq_free(&c->txq);
      chorus__aead_free(c->tx_aead);
      chorus__aead_free(c->rx_aead);
      free(c->tx_rec);
      free(c->rx_rec);
      chorus__wipe(c->keys, sizeof c->keys);
    }
  }
  free(t->conns);
  free(t);
}

static const chorus__chan_ops_t tcp_ops = {
    .name = "tcp",
    .send = tcp_send,
    .rx_pause = tcp_rx_pause,
    .cancel = tcp_cancel,
    .pending = tcp_pending,
    .close = tcp_close,
    .link_desc = tcp_link_desc,
    .poll = tcp_poll,
    .destroy = tcp_destroy,
};

/* A channel with a conn for every peer, none connected yet; each peer's
 * stream attached and the peer carried by it. */
static tcp_chan_t *tcp_new(chorus__tp_t *tp) {
  tcp_chan_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->base.ops = &tcp_ops;
  t->base.tp = tp;
  t->conns = calloc((size_t)tp->size, sizeof(conn_t));
  if (!t->conns) {
    free(t);
    return NULL;
  }
  for (int r = 0; r < tp->size; r++) {
    conn_t *c = &t->conns[r];
    c->fd = -1;
    c->ch = t;
    c->peer = &tp->peers[r];
    c->watch = (chorus__watch_t){on_conn_event, c};
    if (r == tp->rank || c->peer->chan) continue; /* self, or another channel's */
    chorus__tp_rx_attach(tp, c->peer, &c->rx, &t->base, c);
    c->peer->chan = &t->base;
    c->peer->link = c;
  }
  return t;
}

/* ---------------------------------------------------------- handshake */

static void hs_mac(const chorus__tp_t *tp, int accept_side, uint32_t connector, uint32_t acceptor,
                   const uint8_t *na, const uint8_t *nc, uint8_t mac[CHORUS__MAC_LEN]) {
  static const char lc[] = "chorus data connect", la[] = "chorus data accept";
  uint8_t ids[16];
  chorus__le64_put(ids, tp->world_id);
  chorus__le32_put(ids + 8, connector);
  chorus__le32_put(ids + 12, acceptor);
  const void *parts[4] = {accept_side ? (const void *)la : (const void *)lc, ids, na, nc};
  size_t lens[4] = {accept_side ? sizeof la : sizeof lc, sizeof ids, CHORUS__NONCE_LEN,
                    CHORUS__NONCE_LEN};
  chorus__hmac(&tp->key, parts, lens, 4, mac);
}

/* The connection's two record keys (CHORUS_ENCRYPT): HKDF of the job key
 * over both nonces, the world and both ranks; connector->acceptor first. */
static int hs_keys(const chorus__tp_t *tp, uint32_t connector, uint32_t acceptor,
                   const uint8_t *na, const uint8_t *nc, uint8_t out[64]) {
  uint8_t salt[2 * CHORUS__NONCE_LEN], info[16 + 16];
  memcpy(salt, na, CHORUS__NONCE_LEN);
  memcpy(salt + CHORUS__NONCE_LEN, nc, CHORUS__NONCE_LEN);
  memcpy(info, "chorus data keys", 16);
  chorus__le64_put(info + 16, tp->world_id);
  chorus__le32_put(info + 24, connector);
  chorus__le32_put(info + 28, acceptor);
  int rc = chorus__hkdf(&tp->key, salt, sizeof salt, info, sizeof info, out, 64);
  chorus__wipe(salt, sizeof salt);
  return rc;
}

/* Connector side, on a fresh blocking connection to rank peer.  Returns 0;
 * -EACCES when the acceptor refused us (wrong key or world, or it has that
 * rank already), -EPERM when the acceptor did not prove the key, -EPROTO
 * for a peer that does not speak the protocol, or a negative errno of the
 * socket (the acceptor may have dropped us: worth another try). */
static int hs_connect(tcp_chan_t *t, int fd, int peer, int64_t deadline, char *why,
                      size_t cap) {
  chorus__tp_t *tp = t->base.tp;
  uint8_t in[HS_HELLO_LEN], out[HS_CONNECT_LEN], ok[HS_OK_LEN];
  int rc = chorus__net_read_full(fd, in, sizeof in, deadline);
  if (rc < 0) {
    snprintf(why, cap, "handshake I/O failed: %s", strerror(-rc));
    return rc;
  }
  uint32_t version = chorus__le32_get(in + 4);
  if (chorus__le32_get(in) != HS_ACCEPT || (version & HS_VERSION_MASK) != HS_VERSION) {
    snprintf(why, cap, "not a chorus peer of this version (magic %08x, version %u)",
             chorus__le32_get(in), version & HS_VERSION_MASK);
    return -EPROTO;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    snprintf(why, cap, "the ranks disagree on CHORUS_ENCRYPT (this rank %d, rank %d %d): set it "
             "the same on every rank", tp->encrypt, peer, !tp->encrypt);
    return -EPROTO;
  }
  const uint8_t *na = in + 8;
  uint8_t *nc = out + 12;
  chorus__le32_put(out, HS_CONNECT);
  chorus__le32_put(out + 4, HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0));
  chorus__le32_put(out + 8, (uint32_t)tp->rank);
  if ((rc = chorus__random_bytes(nc, CHORUS__NONCE_LEN)) < 0) {
    snprintf(why, cap, "no randomness: %s", strerror(-rc));
    return rc;
  }
  hs_mac(tp, 0, (uint32_t)tp->rank, (uint32_t)peer, na, nc, out + 12 + CHORUS__NONCE_LEN);
  rc = chorus__net_write_full(fd, out, sizeof out, deadline);
  if (rc == 0) rc = chorus__net_read_full(fd, ok, HS_DENY_LEN, deadline);
  if (rc < 0) {
    snprintf(why, cap, "handshake I/O failed: %s", strerror(-rc));
    return rc;
  }
  if (chorus__le32_get(ok) == HS_DENY) {
    uint32_t reason = chorus__le32_get(ok + 4);
    snprintf(why, cap, "%s", reason == HS_DENY_AUTH ? "it refused our proof: the ranks have "
             "different job secrets, or the address belongs to another world or generation"
             : reason == HS_DENY_RANK    ? "it already has a connection from this rank"
             : reason == HS_DENY_ENCRYPT ? "the ranks disagree on CHORUS_ENCRYPT: set it the "
                                           "same on every rank"
                                         : "it speaks another handshake version");
    return -EACCES;
  }
  if (chorus__le32_get(ok) != HS_OK || chorus__le32_get(ok + 4) != (uint32_t)peer) {
    snprintf(why, cap, "unexpected answer (not rank %d of this world?)", peer);
    return -EPROTO;
  }
  if ((rc = chorus__net_read_full(fd, ok + HS_DENY_LEN, HS_OK_LEN - HS_DENY_LEN, deadline)) < 0) {
    snprintf(why, cap, "handshake I/O failed: %s", strerror(-rc));
    return rc;
  }
  uint8_t want[CHORUS__MAC_LEN];
  hs_mac(tp, 1, (uint32_t)tp->rank, (uint32_t)peer, na, nc, want);
  if (!chorus__ct_equal(want, ok + 8, sizeof want)) {
    snprintf(why, cap, "it did not prove the job key (a stranger on that port?)");
    return -EPERM;
  }
  if (tp->encrypt && hs_keys(tp, (uint32_t)tp->rank, (uint32_t)peer, na, nc,
                             t->conns[peer].keys) < 0) {
    snprintf(why, cap, "cannot derive the connection's keys (libcrypto)");
    return -EIO;
  }
  return 0;
}

/* The acceptor side runs for every pending connection at once (accept_all
 * below): one stranger that stays silent costs one slot until its short
 * deadline, never the world's time. */
typedef struct pending {
  int fd;
  int64_t deadline;
  size_t got;
  uint8_t na[CHORUS__NONCE_LEN];
  uint8_t in[HS_CONNECT_LEN];
  char addr[80];
} pending_t;

/* Checks a complete connect message; returns the peer's rank, or a negative
 * HS_DENY_* reason with why filled. */
static int hs_verify(tcp_chan_t *t, const pending_t *p, char *why, size_t cap) {
  chorus__tp_t *tp = t->base.tp;
  const uint8_t *in = p->in;
  uint32_t version = chorus__le32_get(in + 4);
  if (chorus__le32_get(in) != HS_CONNECT || (version & HS_VERSION_MASK) != HS_VERSION) {
    snprintf(why, cap, "not a chorus peer of this version");
    return -HS_DENY_VERSION;
  }
  uint32_t peer = chorus__le32_get(in + 8);
  uint8_t want[CHORUS__MAC_LEN];
  /* The MAC is checked before the claimed rank is believed. */
  hs_mac(tp, 0, peer, (uint32_t)tp->rank, p->na, in + 12, want);
  if (!chorus__ct_equal(want, in + 12 + CHORUS__NONCE_LEN, sizeof want)) {
    snprintf(why, cap, "authentication failed (no job key, or another world)");
    return -HS_DENY_AUTH;
  }
  if (peer >= (uint32_t)tp->size || (int)peer <= tp->rank) {
    snprintf(why, cap, "authenticated peer claims impossible rank %u", peer);
    return -HS_DENY_RANK;
  }
  if (t->conns[peer].fd >= 0) {
    snprintf(why, cap, "rank %u is already connected", peer);
    return -HS_DENY_RANK;
  }
  if (tp->peers[peer].chan != &t->base) {
    snprintf(why, cap, "rank %u shares this host: it talks over shared memory, not TCP", peer);
    return -HS_DENY_RANK;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    snprintf(why, cap, "rank %u and this rank disagree on CHORUS_ENCRYPT", peer);
    return -HS_DENY_ENCRYPT;
  }
  if (tp->encrypt && hs_keys(tp, peer, (uint32_t)tp->rank, p->na, in + 12, t->conns[peer].keys) < 0) {
    snprintf(why, cap, "cannot derive the connection's keys (libcrypto)");
    return -HS_DENY_AUTH;
  }
  return (int)peer;
}

static void pending_drop(pending_t *ps, int *n, int i) {
  close(ps[i].fd);
  ps[i] = ps[--*n];
}

/* Accepts every higher rank on listen_fd until all are connected or
 * deadline passes.  Returns CHORUS_OK or an error with errmsg filled. */
static chorus_result_t accept_all(tcp_chan_t *t, int listen_fd, int64_t deadline,
                                  char *errmsg, size_t errcap) {
  chorus__tp_t *tp = t->base.tp;
  const chorus__env_t *env = chorus__env();
  int need = 0;
  for (int r = tp->rank + 1; r < tp->size; r++) need += tp->peers[r].chan == &t->base;
  int max_pending = env->HANDSHAKE_MAX_PENDING > 0 && env->HANDSHAKE_MAX_PENDING <= 65536
                        ? (int)env->HANDSHAKE_MAX_PENDING : 256;
  int hs_ms = env->HANDSHAKE_TIMEOUT_MS > 0 ? (int)env->HANDSHAKE_TIMEOUT_MS : 1000;
  if (need <= 0) return CHORUS_OK;
  pending_t *ps = calloc((size_t)max_pending, sizeof *ps);
  struct pollfd *pfd = calloc((size_t)max_pending + 1, sizeof *pfd);
  if (!ps || !pfd) {
    free(ps);
    free(pfd);
    snprintf(errmsg, errcap, "out of memory");
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus__net_set_nonblock(listen_fd, 1);
  int n = 0;
  unsigned long rejected = 0;
  chorus_result_t st = CHORUS_OK;
  while (need > 0) {
    int64_t now = chorus__now_ns();
    /* Strangers past their deadline go; the world's deadline is separate. */
    for (int i = 0; i < n;) {
      if (ps[i].deadline > now) {
        i++;
        continue;
      }
      chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                          "chorus rank %d: dropped a connection from %s: no handshake within "
                          "%d ms", tp->rank, ps[i].addr, hs_ms);
      rejected++;
      pending_drop(ps, &n, i);
    }
    int64_t wake = deadline;
    for (int i = 0; i < n; i++)
      if (ps[i].deadline < wake) wake = ps[i].deadline;
    int left = chorus__ms_left(wake);
    if (chorus__ms_left(deadline) == 0) {
      char missing[256];
      size_t off = 0;
      missing[0] = '\0';
      for (int r = tp->rank + 1; r < tp->size && off < sizeof missing; r++)
        if (t->conns[r].fd < 0 && tp->peers[r].chan == &t->base)
          off += (size_t)snprintf(missing + off, sizeof missing - off, "%s%d", off ? ", " : "", r);
      snprintf(errmsg, errcap, "timed out waiting for rank(s) %s to connect%s", missing,
               rejected ? " (connections from strangers were rejected meanwhile)" : "");
      st = CHORUS_ERR_TIMEOUT;
      break;
    }
    pfd[0].fd = listen_fd;
    pfd[0].events = POLLIN;
    for (int i = 0; i < n; i++) {
      pfd[i + 1].fd = ps[i].fd;
      pfd[i + 1].events = POLLIN;
      pfd[i + 1].revents = 0;
    }
    int rc = poll(pfd, (nfds_t)n + 1, left < 0 ? 0 : left);
    if (rc < 0 && errno != EINTR) {
      snprintf(errmsg, errcap, "poll: %s", strerror(errno));
      st = CHORUS_ERR_SYSTEM;
      break;
    }
    if (rc <= 0) continue;
    /* Pending connections first (indices shift as entries go). */
    for (int i = n - 1; i >= 0; i--) {
      if (!pfd[i + 1].revents) continue;
      pending_t *p = &ps[i];
      ssize_t got = recv(p->fd, p->in + p->got, sizeof p->in - p->got, MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got <= 0) {
        chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                            "chorus rank %d: dropped a connection from %s: %s before the "
                            "handshake completed", tp->rank, p->addr,
                            got == 0 ? "closed" : strerror(errno));
        rejected++;
        pending_drop(ps, &n, i);
        continue;
      }
      p->got += (size_t)got;
      if (p->got < sizeof p->in) continue;
      char why[160];
      int peer = hs_verify(t, p, why, sizeof why);
      uint8_t reply[HS_OK_LEN];
      size_t rlen;
      if (peer < 0) {
        chorus__le32_put(reply, HS_DENY);
        chorus__le32_put(reply + 4, (uint32_t)-peer);
        rlen = HS_DENY_LEN;
      } else {
        chorus__le32_put(reply, HS_OK);
        chorus__le32_put(reply + 4, (uint32_t)tp->rank);
        hs_mac(tp, 1, (uint32_t)peer, (uint32_t)tp->rank, p->na, p->in + 12, reply + 8);
        rlen = HS_OK_LEN;
      }
      /* A fresh socket's buffer takes these few bytes at once. */
      ssize_t w = send(p->fd, reply, rlen, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (peer < 0 || w != (ssize_t)rlen) {
        chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                            "chorus rank %d: rejected a connection from %s: %s", tp->rank,
                            p->addr, peer < 0 ? why : "could not answer it");
        rejected++;
        pending_drop(ps, &n, i);
        continue;
      }
      chorus__net_set_nonblock(p->fd, 0);
      chorus__net_set_nodelay(p->fd);
      t->conns[peer].fd = p->fd;
      ps[i] = ps[--n];
      need--;
    }
    if (!(pfd[0].revents & POLLIN)) continue;
    for (int k = 0; k < 64 && need > 0; k++) {
      int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP, "chorus rank %d: accept: %s",
                              tp->rank, strerror(errno));
        break;
      }
      if (n == max_pending) { /* the oldest stranger makes room */
        int oldest = 0;
        for (int i = 1; i < n; i++)
          if (ps[i].deadline < ps[oldest].deadline) oldest = i;
        chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                            "chorus rank %d: %d connections are handshaking "
                            "(CHORUS_HANDSHAKE_MAX_PENDING); dropped the oldest, from %s",
                            tp->rank, max_pending, ps[oldest].addr);
        rejected++;
        pending_drop(ps, &n, oldest);
      }
      pending_t *p = &ps[n];
      memset(p, 0, sizeof *p);
      p->fd = fd;
      p->deadline = chorus__now_ns() + (int64_t)hs_ms * 1000000;
      char host[64] = "?";
      int port = 0;
      chorus__net_peer_addr(fd, host, sizeof host, &port);
      snprintf(p->addr, sizeof p->addr, "%s:%d", host, port);
      uint8_t hello[HS_HELLO_LEN];
      chorus__le32_put(hello, HS_ACCEPT);
      chorus__le32_put(hello + 4, HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0));
      if (chorus__random_bytes(p->na, sizeof p->na) < 0) {
        close(fd);
        continue;
      }
      memcpy(hello + 8, p->na, sizeof p->na);
      if (send(fd, hello, sizeof hello, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof hello) {
        close(fd);
        continue;
      }
      n++;
    }
  }
  for (int i = 0; i < n; i++) close(ps[i].fd);
  free(ps);
  free(pfd);
  /* The total, once: the rate limiter may have hidden most of them. */
  if (rejected > CHORUS__LOG_BURST)
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: %lu connections rejected in all while the "
                "world formed", tp->rank, rejected);
  else if (rejected)
    CHORUS_INFO(CHORUS__SUB_TCP, "chorus rank %d: %lu connection(s) rejected while the world "
                "formed", tp->rank, rejected);
  return st;
}

static int parse_addr(const char *s, char *host, size_t cap, int *port) {
  const char *sp = strrchr(s, ' ');
  if (!sp || (size_t)(sp - s) >= cap) return -1;
  memcpy(host, s, (size_t)(sp - s));
  host[sp - s] = '\0';
  long p;
  if (chorus__parse_long(sp + 1, &p) < 0 || p <= 0 || p > 65535) return -1;
  *port = (int)p;
  return 0;
}

/* ---------------------------------------------------------- lifecycle */

/* Undoes tcp_new when the channel never carried anything. */
static void tcp_abandon(tcp_chan_t *t) {
  chorus__tp_t *tp = t->base.tp;
  for (int r = 0; r < tp->size; r++) {
    if (tp->peers[r].chan != &t->base) continue;
    tp->peers[r].chan = NULL;
    tp->peers[r].link = NULL;
    tp->peers[r].rxs = NULL;
  }
  tcp_destroy(&t->base);
}

chorus_result_t chorus__tcp_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  tcp_chan_t *t = tcp_new(tp);
  if (!t) {
    close(cfg->listen_fd);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus_result_t st = CHORUS_OK;
  for (int r = 0; r < cfg->size; r++) {
    char host[64];
    int port;
    if (parse_addr(cfg->addrs[r], host, sizeof host, &port) == 0)
      snprintf(tp->peers[r].addr, sizeof tp->peers[r].addr, "%s:%d", host, port);
  }
  char why[256];
  /* Connect to every lower rank. */
  for (int r = 0; r < cfg->rank && st == CHORUS_OK; r++) {
    if (tp->peers[r].chan != &t->base) continue;
    char host[64];
    int port;
    if (parse_addr(cfg->addrs[r], host, sizeof host, &port) < 0) {
      snprintf(errmsg, errcap, "rank %d published an unparsable address '%s'", r, cfg->addrs[r]);
      st = CHORUS_ERR_PROTOCOL;
      break;
    }
    /* The acceptor may drop us (its handshake slots were full of strangers,
     * or it was too slow to answer in time): connect again until the
     * deadline.  A refusal is final. */
    for (;;) {
      int fd = chorus__net_connect(host, port, cfg->deadline, cfg->retry_ms);
      if (fd < 0) {
        snprintf(errmsg, errcap, "cannot connect to rank %d at %s:%d: %s", r, host, port,
                 strerror(-fd));
        st = fd == -ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_SYSTEM;
        break;
      }
      int rc = hs_connect(t, fd, r, cfg->deadline, why, sizeof why);
      if (rc == 0) {
        t->conns[r].fd = fd;
        break;
      }
      close(fd);
      if ((rc == -ECONNRESET || rc == -EPIPE || rc == -ECONNABORTED) &&
          chorus__ms_left(cfg->deadline) > 0) {
        struct timespec ts = {0, (long)(cfg->retry_ms > 0 ? cfg->retry_ms : 50) * 1000000};
        nanosleep(&ts, NULL);
        continue;
      }
      snprintf(errmsg, errcap, "handshake with rank %d at %s:%d failed: %s", r, host, port, why);
      st = rc == -ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_PROTOCOL;
      break;
    }
  }
  /* Accept every higher rank; strangers are rejected (rate-limited log). */
  if (st == CHORUS_OK) st = accept_all(t, cfg->listen_fd, cfg->deadline, errmsg, errcap);
  close(cfg->listen_fd);
  for (int r = 0; r < cfg->size && st == CHORUS_OK; r++) {
    conn_t *c = &t->conns[r];
    if (r == cfg->rank || tp->peers[r].chan != &t->base) continue;
    if (tp->encrypt) {
      /* Lower ranks are the ones we connected to: we sent on keys[0..32). */
      int connector = cfg->rank > r;
      c->tx_aead = chorus__aead_new(c->keys + (connector ? 0 : 32), connector ? 1 : 2, 1);
      c->rx_aead = chorus__aead_new(c->keys + (connector ? 32 : 0), connector ? 2 : 1, 0);
      c->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
      c->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
      chorus__wipe(c->keys, sizeof c->keys);
      if (!c->tx_aead || !c->rx_aead || !c->tx_rec || !c->rx_rec) {
        snprintf(errmsg, errcap, "out of memory for the encryption state");
        st = CHORUS_ERR_NO_MEMORY;
        break;
      }
    }
    chorus__net_set_nonblock(c->fd, 1);
    int sz = 4 << 20;
    setsockopt(c->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    if (chorus__tp_watch(tp, c->fd, EPOLLIN, &c->watch) < 0) {
      snprintf(errmsg, errcap, "epoll_ctl: %s", strerror(errno));
      st = CHORUS_ERR_SYSTEM;
    }
  }
  if (st != CHORUS_OK) {
    tcp_abandon(t);
    return st;
  }
  *out = &t->base;
  return CHORUS_OK;
}

/* ------------------------------------------------------------- fuzzing
 *
 * The fuzzers (fuzz/) drive the receive path and the acceptor's handshake
 * check with their bytes.  A fuzzing transport has no connections and no
 * progress thread; each peer's bytes arrive through a socket pair whose
 * other end the fuzzer writes, and are parsed by read_conn exactly as
 * socket data is. */

static void fuzz_fp_format(const chorus__fp_t *fp, char *buf, size_t cap) {
  snprintf(buf, cap, "coll %u dtype %u count %" PRIu64, fp->coll, fp->dtype, fp->count);
}

chorus__tp_t *chorus__tp_fuzz_new(int rank, int size, const chorus__key_t *key, uint64_t world) {
  chorus__tp_t *tp = chorus__tp_alloc(rank, size, key, world);
  if (!tp) return NULL;
  tp->budget = (size_t)1 << 20;
  tp->fp_format = fuzz_fp_format;
  tcp_chan_t *t = tcp_new(tp);
  if (!t) {
    chorus__tp_free(tp);
    return NULL;
  }
  tp->net = &t->base;
  for (int r = 0; r < size; r++)
    snprintf(tp->peers[r].addr, sizeof tp->peers[r].addr, "fuzz:%d", r);
  return tp;
}

void chorus__tp_set_fp_format(chorus__tp_t *tp, chorus__fp_format_fn fn) { tp->fp_format = fn; }

int chorus__tp_fuzz_feed(chorus__tp_t *tp, int peer, const void *data, size_t n, int *wfd) {
  conn_t *c = &((tcp_chan_t *)tp->net)->conns[peer];
  if (c->fd < 0) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sp) < 0) return -1;
    c->fd = sp[0];
    *wfd = sp[1];
    chorus__tp_watch(tp, c->fd, EPOLLIN, &c->watch);
  }
  if (n && send(*wfd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return -1;
  pthread_mutex_lock(&tp->lock);
  if (!c->peer->dead && !c->rx.paused) read_conn(c);
  int dead = c->peer->dead;
  pthread_mutex_unlock(&tp->lock);
  return dead ? -1 : 0;
}

chorus__aead_t *chorus__tp_fuzz_encrypt(chorus__tp_t *tp, int peer) {
  conn_t *c = &((tcp_chan_t *)tp->net)->conns[peer];
  static const uint8_t zero[CHORUS__NONCE_LEN];
  uint8_t keys[64];
  if (c->rx_aead || peer <= tp->rank ||
      hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, zero, zero, keys) < 0)
    return NULL;
  /* This rank accepted peer: it receives on keys[0..32), label 1. */
  c->rx_aead = chorus__aead_new(keys, 1, 0);
  c->tx_aead = chorus__aead_new(keys + 32, 2, 1);
  c->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
  c->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
  chorus__aead_t *sealer = chorus__aead_new(keys, 1, 1);
  chorus__wipe(keys, sizeof keys);
  tp->encrypt = 1;
  return c->rx_aead && c->tx_aead && c->rx_rec && c->tx_rec ? sealer : NULL;
}

size_t chorus__tp_fuzz_seal(chorus__aead_t *sealer, const void *in, size_t n, uint8_t *out) {
  if (n > REC_MAX) n = REC_MAX;
  chorus__le32_put(out, (uint32_t)n);
  if (chorus__aead_seal(sealer, out, 4, in, out + 4, n, out + 4 + n) < 0) return 0;
  return n + REC_OVERHEAD;
}

int chorus__tp_fuzz_handshake(chorus__tp_t *tp, const void *msg, size_t n) {
  pending_t p;
  memset(&p, 0, sizeof p);
  memcpy(p.in, msg, n < sizeof p.in ? n : sizeof p.in);
  char why[160];
  return hs_verify((tcp_chan_t *)tp->net, &p, why, sizeof why);
}

void chorus__tp_fuzz_free(chorus__tp_t *tp) {
  if (tp) chorus__tp_free(tp);
}
