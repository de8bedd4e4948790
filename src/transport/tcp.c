/*
 * tcp.c - the TCP channel (chan.h): one authenticated connection per pair
 * of ranks that exchange messages, made when the first message between
 * them is sent, optionally encrypted.
 *
 * Connections when needed.  Nothing is connected when the world forms;
 * every rank keeps its listener open and accepts (handshakes run in the
 * progress thread, many at once, each with a short deadline).  A send to a
 * peer without a connection queues the message and dials; the connection
 * carries both directions once made.  When both ranks of a pair dial each
 * other at once, the lower rank's connection wins: the lower rank refuses
 * the higher one's with HS_DENY_CROSS, the higher one accepts the lower
 * one's and drops its own attempt, and whichever comes first, both end up
 * on the lower rank's connection (decisions are made under the context's
 * lock, one pair state per peer).  A world of P ranks whose algorithms
 * talk to k peers opens k sockets per rank, not P-1.
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
enum {
  HS_DENY_AUTH = 1,
  HS_DENY_RANK = 2,
  HS_DENY_VERSION = 3,
  HS_DENY_ENCRYPT = 4,
  HS_DENY_CROSS = 5 /* both dialled: the lower rank's connection is the one */
};

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

/* The state of a pair, on this side. */
enum {
  C_IDLE,       /* no connection, none being made */
  C_CONNECTING, /* dialled: connect() in progress (fd >= 0), or waiting to retry (fd < 0) */
  C_HELLO,      /* connected, waiting for the acceptor's hello */
  C_REPLY,      /* our proof sent, waiting for ok or deny */
  C_AWAIT,      /* refused as the crossing connection: the peer's comes */
  C_READY,      /* carries messages both ways */
  C_CLOSED      /* the peer failed */
};

typedef struct conn {
  int fd;
  int state;
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
  /* Dialling (C_CONNECTING .. C_AWAIT): when it began, when it gives up,
   * when to try again (fd < 0), the handshake bytes read so far and both
   * nonces; next on the channel's list of pairs being dialled. */
  int64_t since, deadline, retry_at;
  struct conn *next_dial;
  uint8_t hs[64]; /* a hello or an ok (HS_HELLO_LEN, HS_OK_LEN) */
  size_t hs_got;
  uint8_t na[CHORUS__NONCE_LEN], nc[CHORUS__NONCE_LEN];
  /* Send queue: messages wait here while the connection is made. */
  chorus__txq_t txq;
} conn_t;

/* A connection to our listener whose handshake has not completed: a peer
 * dialling, or a stranger.  Each costs one of max_pending slots until its
 * deadline (CHORUS_HANDSHAKE_TIMEOUT_MS). */
typedef struct pending {
  int fd;
  int slot;
  tcp_chan_t *ch;
  chorus__watch_t watch;
  int64_t deadline;
  size_t got;
  uint8_t na[CHORUS__NONCE_LEN];
  uint8_t in[HS_CONNECT_LEN];
  char addr[80];
} pending_t;

struct tcp_chan {
  chorus__chan_t base;
  /* Pair state, made on a pair's first message either way: conns[rank]
   * (NULL until then; 8 bytes per world rank, not a conn_t), and every
   * one made, in live[0 .. nlive). */
  conn_t **conns;
  conn_t **live;
  int nlive, cap_live;
  int listen_fd;
  chorus__watch_t listen_watch;
  pending_t **pend; /* max_pending slots, npend used */
  int npend, max_pending;
  int hs_ms;
  int64_t connect_ns; /* how long dialling a peer may take */
  int retry_ms;
  conn_t *dialing;    /* pairs in C_CONNECTING .. C_AWAIT */
  unsigned long rejected;
  chorus__ratelimit_t reject_log; /* strangers turned away */
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

static void dial_event(conn_t *c, uint32_t events);

static void on_conn_event(void *arg, uint32_t events) {
  conn_t *c = arg;
  if (c->peer->dead) return;
  if (c->state != C_READY) {
    dial_event(c, events);
    return;
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_conn(c);
  if (!c->peer->dead && (events & EPOLLOUT)) flush_tx(c);
}

/* p's pair state; NULL while nothing was sent either way. */
static conn_t *conn_of(chorus__chan_t *ch, const chorus__peer_t *p) {
  return ((tcp_chan_t *)ch)->conns[p->rank];
}

/* p's pair state, made now if need be; NULL when out of memory. */
static conn_t *conn_make(tcp_chan_t *t, chorus__peer_t *p) {
  conn_t *c = t->conns[p->rank];
  if (c) return c;
  if (t->nlive == t->cap_live) {
    int cap = t->cap_live ? 2 * t->cap_live : 16;
    conn_t **live = realloc(t->live, sizeof *live * (size_t)cap);
    if (!live) return NULL;
    t->live = live;
    t->cap_live = cap;
  }
  c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->fd = -1;
  c->ch = t;
  c->peer = p;
  c->watch = (chorus__watch_t){on_conn_event, c};
  chorus__tp_rx_attach(t->base.tp, p, &c->rx, &t->base, c);
  p->link = c;
  t->conns[p->rank] = c;
  t->live[t->nlive++] = c;
  return c;
}

static void dial_start(conn_t *c);

static void tcp_send(chorus__chan_t *ch, chorus__peer_t *p, txitem_t *it) {
  conn_t *c = conn_make((tcp_chan_t *)ch, p);
  if (!c) {
    chorus__tp_tx_lost(ch->tp, p, it);
    chorus__tp_peer_failed(ch->tp, p, "out of memory for its connection's state",
                           CHORUS_ERR_NO_MEMORY);
    return;
  }
  if (c->state == C_CLOSED) {
    chorus__tp_tx_lost(ch->tp, p, it);
    return;
  }
  chorus__txq_push(&c->txq, it);
  if (c->state == C_READY) {
    if (c->txq.head == it) flush_tx(c);
  } else if (c->state == C_IDLE) {
    c->since = chorus__now_ns();
    c->deadline = c->since + c->ch->connect_ns;
    dial_start(c);
  }
}

static void tcp_rx_pause(chorus__chan_t *ch, chorus__rx_t *rx, int on) {
  conn_t *c = rx->link;
  if (c->state != C_READY || c->peer->dead) return;
  update_events(c, on, c->epoll_out);
  /* Plaintext already opened: no socket event will say so. */
  if (!on && c->rx_pleft) chorus__tp_kick(ch->tp);
}

static int tcp_cancel(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  return c ? chorus__txq_cancel(&c->txq, ep) : 0;
}

static int tcp_pending(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  return c && (chorus__txq_has(&c->txq, ep) || (!ep && c->tx_off < c->tx_len));
}

static void dial_unlist(conn_t *c) {
  for (conn_t **pp = &c->ch->dialing; *pp; pp = &(*pp)->next_dial)
    if (*pp == c) {
      *pp = c->next_dial;
      break;
    }
  c->next_dial = NULL;
}

static void tcp_close(chorus__chan_t *ch, chorus__peer_t *p) {
  conn_t *c = conn_of(ch, p);
  if (!c) return; /* never talked: nothing queued, nothing to close */
  if (c->state >= C_CONNECTING && c->state <= C_AWAIT) dial_unlist(c);
  if (c->fd >= 0) {
    chorus__tp_unwatch(ch->tp, c->fd);
    /* The peer must see EOF now, not at its timeout; the fd number itself
     * stays reserved until the channel goes so it cannot be reused. */
    shutdown(c->fd, SHUT_RDWR);
  }
  c->state = C_CLOSED;
  chorus__txq_lose(ch->tp, p, &c->txq);
  c->tx_off = c->tx_len;
}

static void tcp_link_desc(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap) {
  conn_t *c = conn_of(ch, p);
  char local[80] = "?", remote[80] = "?", ifname[64] = "?";
  int lport = 0, rport = 0;
  if (!c || c->state != C_READY) {
    snprintf(buf, cap, "tcp (%s %s)",
             !c || c->state == C_IDLE ? "not connected; listens at" : "connecting to", p->addr);
    return;
  }
  chorus__net_local_addr(c->fd, local, sizeof local, &lport);
  chorus__net_peer_addr(c->fd, remote, sizeof remote, &rport);
  chorus__net_addr_ifname(local, ifname, sizeof ifname);
  snprintf(buf, cap, "tcp %s:%d -> %s:%d (%s)", local, lport, remote, rport, ifname);
}

static int tcp_link_state(chorus__chan_t *ch, chorus__peer_t *p, int64_t *since) {
  conn_t *c = conn_of(ch, p);
  *since = c ? c->since : 0;
  if (!c) return CHORUS__LINK_NONE;
  return c->state == C_READY ? CHORUS__LINK_READY
         : c->state == C_IDLE || c->state == C_CLOSED ? CHORUS__LINK_NONE
                                                      : CHORUS__LINK_DIALING;
}

static void pending_drop(pending_t *p);
static void dial_tick(tcp_chan_t *t, int64_t now);

/* Each progress round: handshakes and dials past their deadlines; opened
 * records whose rest was not parsed (the stream was paused and resumed,
 * no socket event will say so). */
static void tcp_poll(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  int64_t now = chorus__now_ns();
  for (int i = t->npend - 1; i >= 0; i--) {
    if (i >= t->npend || t->pend[i]->deadline > now) continue;
    chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                        "chorus rank %d: dropped a connection from %s: no handshake within %d ms",
                        ch->tp->rank, t->pend[i]->addr, t->hs_ms);
    t->rejected++;
    pending_drop(t->pend[i]);
  }
  if (t->dialing) dial_tick(t, now);
  if (!ch->tp->encrypt) return;
  for (int i = 0; i < t->nlive; i++) {
    conn_t *c = t->live[i];
    if (c->state == C_READY && c->rx_pleft && !c->rx.paused && !c->peer->dead) read_conn(c);
  }
}

static void tcp_destroy(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  while (t->npend) pending_drop(t->pend[t->npend - 1]);
  free(t->pend);
  if (t->listen_fd >= 0) close(t->listen_fd);
  /* The total, once: the rate limiter may have hidden most of them. */
  if (t->rejected > CHORUS__LOG_BURST)
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: %lu connections rejected in all at this "
                "rank's data port", ch->tp->rank, t->rejected);
  else if (t->rejected)
    CHORUS_INFO(CHORUS__SUB_TCP, "chorus rank %d: %lu connection(s) rejected at this rank's data "
                "port", ch->tp->rank, t->rejected);
  for (int i = 0; i < t->nlive; i++) {
    conn_t *c = t->live[i];
    if (c->fd >= 0) close(c->fd);
    chorus__txq_free(&c->txq);
    chorus__aead_free(c->tx_aead);
    chorus__aead_free(c->rx_aead);
    free(c->tx_rec);
    free(c->rx_rec);
    chorus__wipe(c->keys, sizeof c->keys);
    free(c);
  }
  free(t->live);
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
    .link_state = tcp_link_state,
    .poll = tcp_poll,
    .destroy = tcp_destroy,
};

/* A channel that carries every peer no other channel does; no pair state
 * yet (conn_make makes it on the pair's first message). */
static tcp_chan_t *tcp_new(chorus__tp_t *tp) {
  tcp_chan_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->base.ops = &tcp_ops;
  t->base.tp = tp;
  t->listen_fd = -1;
  t->conns = calloc((size_t)tp->size, sizeof *t->conns);
  if (!t->conns) {
    free(t);
    return NULL;
  }
  for (int r = 0; r < tp->size; r++)
    if (r != tp->rank && !tp->peers[r].chan) tp->peers[r].chan = &t->base;
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

/* c's handshake succeeded on fd (this rank dialled: connector): c carries
 * the pair from now on, its queued messages go.  0, or -1 after failing
 * the peer. */
static int conn_ready(conn_t *c, int fd, int connector) {
  chorus__tp_t *tp = conn_tp(c);
  if (c->state >= C_CONNECTING && c->state <= C_AWAIT) dial_unlist(c);
  if (c->fd >= 0 && c->fd != fd) { /* our own attempt, which lost the crossing */
    chorus__tp_unwatch(tp, c->fd);
    close(c->fd);
  }
  c->fd = fd;
  c->state = C_READY;
  if (tp->encrypt) {
    c->tx_aead = chorus__aead_new(c->keys + (connector ? 0 : 32), connector ? 1 : 2, 1);
    c->rx_aead = chorus__aead_new(c->keys + (connector ? 32 : 0), connector ? 2 : 1, 0);
    c->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
    c->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
    chorus__wipe(c->keys, sizeof c->keys);
    if (!c->tx_aead || !c->rx_aead || !c->tx_rec || !c->rx_rec) {
      conn_failed(c, "out of memory for the connection's encryption state", CHORUS_ERR_NO_MEMORY);
      return -1;
    }
  }
  chorus__net_set_nonblock(fd, 1);
  chorus__net_set_nodelay(fd);
  int sz = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  /* An accepted fd is new to epoll; a dialled one is watched already. */
  if (chorus__tp_watch(tp, fd, EPOLLIN, &c->watch) < 0 &&
      (errno != EEXIST || chorus__tp_watch_mod(tp, fd, EPOLLIN, &c->watch) < 0)) {
    char why[96];
    snprintf(why, sizeof why, "epoll_ctl failed (%s)", strerror(errno));
    conn_failed(c, why, CHORUS_ERR_SYSTEM);
    return -1;
  }
  c->epoll_out = 0;
  /* Silence counts from now: nothing could be heard before. */
  c->peer->last_heard = chorus__now_ns();
  CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: connected with world rank %d (%s, %s)", tp->rank,
               c->peer->rank, c->peer->addr, connector ? "dialled" : "accepted");
  if (c->txq.head) flush_tx(c);
  return 0;
}

/* ------------------------------------------------- dialling (connector) */

/* Splits "host<sep>port" at the last sep: "host port" as published,
 * "host:port" as kept in peer->addr (the host may be an IPv6 address). */
static int split_addr(const char *s, char sep, char *host, size_t cap, int *port) {
  const char *at = strrchr(s, sep);
  if (!at || (size_t)(at - s) >= cap) return -1;
  memcpy(host, s, (size_t)(at - s));
  host[at - s] = '\0';
  long p;
  if (chorus__parse_long(at + 1, &p) < 0 || p <= 0 || p > 65535) return -1;
  *port = (int)p;
  return 0;
}

static void dial_fail(conn_t *c, const char *what, int err) {
  char why[160];
  snprintf(why, sizeof why, "cannot connect to its listener at %s: %s", c->peer->addr, what);
  if (err) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, " (%s)", strerror(err));
  }
  CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: world rank %d: %s", conn_tp(c)->rank,
              c->peer->rank, why);
  conn_failed(c, why, err == ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_REMOTE);
}

/* This attempt is over but the pair may still connect: try again after
 * CHORUS_CONNECT_RETRY_MS, within the deadline (dial_tick). */
static void dial_retry(conn_t *c) {
  if (c->fd >= 0) {
    chorus__tp_unwatch(conn_tp(c), c->fd);
    close(c->fd);
    c->fd = -1;
  }
  c->state = C_CONNECTING;
  c->retry_at = chorus__now_ns() + (int64_t)c->ch->retry_ms * 1000000;
}

/* Starts an attempt (C_IDLE, or C_CONNECTING waiting to retry). */
static void dial_start(conn_t *c) {
  tcp_chan_t *t = c->ch;
  if (c->state == C_IDLE) {
    c->next_dial = t->dialing;
    t->dialing = c;
  }
  c->state = C_CONNECTING;
  c->hs_got = 0;
  char host[64];
  int port;
  if (split_addr(c->peer->addr, ':', host, sizeof host, &port) < 0) {
    dial_fail(c, "the address it published cannot be parsed", 0);
    return;
  }
  int fd = chorus__net_connect_start(host, port);
  if (fd < 0) {
    if (fd == -ENETUNREACH || fd == -EHOSTUNREACH || fd == -EAGAIN || fd == -ENOBUFS) {
      dial_retry(c);
      return;
    }
    dial_fail(c, "connect failed", -fd);
    return;
  }
  c->fd = fd;
  if (chorus__tp_watch(conn_tp(c), fd, EPOLLOUT, &c->watch) < 0) {
    close(fd);
    c->fd = -1;
    dial_fail(c, "epoll_ctl failed", errno);
  }
}

/* Pairs waiting to retry, or past their deadline.  Failing a pair fails
 * endpoints, whose ABORTs may start or fail other dials: the scan starts
 * over after each. */
static void dial_tick(tcp_chan_t *t, int64_t now) {
  for (conn_t *c = t->dialing; c;) {
    if (now >= c->deadline) {
      char what[96];
      snprintf(what, sizeof what, "no connection within %lld ms (%s)",
               (long long)(t->connect_ns / 1000000),
               c->state == C_AWAIT ? "it was to dial this rank" : "the attempts kept failing");
      dial_fail(c, what, ETIMEDOUT);
      c = t->dialing;
    } else if (c->state == C_CONNECTING && c->fd < 0 && now >= c->retry_at) {
      dial_start(c);
      c = t->dialing;
    } else {
      c = c->next_dial;
    }
  }
}

/* Reads handshake bytes up to want; 1 when there, 0 when more must come,
 * -1 when the connection ended (errno; 0 at EOF). */
static int dial_read(conn_t *c, size_t want) {
  while (c->hs_got < want) {
    ssize_t n = recv(c->fd, c->hs + c->hs_got, want - c->hs_got, MSG_DONTWAIT);
    if (n > 0) {
      c->hs_got += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n == 0) errno = 0;
    return -1;
  }
  return 1;
}

/* The acceptor's hello is in: answer with our proof. */
static void dial_hello(conn_t *c) {
  chorus__tp_t *tp = conn_tp(c);
  uint32_t version = chorus__le32_get(c->hs + 4);
  if (chorus__le32_get(c->hs) != HS_ACCEPT || (version & HS_VERSION_MASK) != HS_VERSION) {
    char what[96];
    snprintf(what, sizeof what, "not a chorus peer of this version (magic %08x, version %u)",
             chorus__le32_get(c->hs), version & HS_VERSION_MASK);
    dial_fail(c, what, 0);
    return;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    char what[128];
    snprintf(what, sizeof what, "the ranks disagree on CHORUS_ENCRYPT (this rank %d, that one "
             "%d): set it the same on every rank", tp->encrypt, !tp->encrypt);
    dial_fail(c, what, 0);
    return;
  }
  uint8_t out[HS_CONNECT_LEN];
  memcpy(c->na, c->hs + 8, CHORUS__NONCE_LEN);
  chorus__le32_put(out, HS_CONNECT);
  chorus__le32_put(out + 4, HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0));
  chorus__le32_put(out + 8, (uint32_t)tp->rank);
  if (chorus__random_bytes(c->nc, CHORUS__NONCE_LEN) < 0) {
    dial_fail(c, "no randomness", errno);
    return;
  }
  memcpy(out + 12, c->nc, CHORUS__NONCE_LEN);
  hs_mac(tp, 0, (uint32_t)tp->rank, (uint32_t)c->peer->rank, c->na, c->nc,
         out + 12 + CHORUS__NONCE_LEN);
  /* A fresh socket's buffer takes these few bytes at once. */
  if (send(c->fd, out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof out) {
    dial_retry(c);
    return;
  }
  c->state = C_REPLY;
  c->hs_got = 0;
}

/* The acceptor's answer is in (at least its first 8 bytes). */
static void dial_reply(conn_t *c) {
  chorus__tp_t *tp = conn_tp(c);
  int peer = c->peer->rank;
  if (chorus__le32_get(c->hs) == HS_DENY) {
    uint32_t reason = chorus__le32_get(c->hs + 4);
    if (reason == HS_DENY_CROSS) {
      /* It dials us too and its connection is the one: wait for it. */
      chorus__tp_unwatch(tp, c->fd);
      close(c->fd);
      c->fd = -1;
      c->state = C_AWAIT;
      return;
    }
    dial_fail(c, reason == HS_DENY_AUTH ? "it refused our proof: the ranks have different job "
              "secrets, or the address belongs to another world or generation"
              : reason == HS_DENY_RANK    ? "it already has a connection from this rank"
              : reason == HS_DENY_ENCRYPT ? "the ranks disagree on CHORUS_ENCRYPT: set it the "
                                            "same on every rank"
                                          : "it speaks another handshake version", 0);
    return;
  }
  if (chorus__le32_get(c->hs) != HS_OK || chorus__le32_get(c->hs + 4) != (uint32_t)peer) {
    dial_fail(c, "unexpected answer to the handshake (not that rank of this world?)", 0);
    return;
  }
  uint8_t want[CHORUS__MAC_LEN];
  hs_mac(tp, 1, (uint32_t)tp->rank, (uint32_t)peer, c->na, c->nc, want);
  if (!chorus__ct_equal(want, c->hs + 8, sizeof want)) {
    dial_fail(c, "it did not prove the job key (a stranger on that port?)", 0);
    return;
  }
  if (tp->encrypt && hs_keys(tp, (uint32_t)tp->rank, (uint32_t)peer, c->na, c->nc, c->keys) < 0) {
    dial_fail(c, "cannot derive the connection's keys (libcrypto)", 0);
    return;
  }
  conn_ready(c, c->fd, 1);
}

static void dial_event(conn_t *c, uint32_t events) {
  if (c->fd < 0) return;
  if (c->state == C_CONNECTING) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == 0 && !(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
    if (err == ECONNREFUSED) {
      /* The listener was there when its address was published: the rank
       * is gone, or listens on an address this host cannot reach. */
      dial_fail(c, "connection refused: the rank has exited, or its address is not reachable "
                "from this host (check CHORUS_SOCKET_IFNAME)", 0);
      return;
    }
    if (err) {
      dial_retry(c);
      return;
    }
    c->state = C_HELLO;
    c->hs_got = 0;
    chorus__tp_watch_mod(conn_tp(c), c->fd, EPOLLIN, &c->watch);
    return;
  }
  if (c->state != C_HELLO && c->state != C_REPLY) return;
  size_t want = c->state == C_HELLO ? HS_HELLO_LEN : HS_DENY_LEN;
  int rc = dial_read(c, want);
  if (rc == 1 && c->state == C_REPLY && chorus__le32_get(c->hs) == HS_OK)
    rc = dial_read(c, HS_OK_LEN);
  if (rc < 0) {
    /* The acceptor dropped us (its handshake slots were full, or it was
     * too slow to answer): try again within the deadline. */
    dial_retry(c);
    return;
  }
  if (rc == 0) return;
  if (c->state == C_HELLO)
    dial_hello(c);
  else
    dial_reply(c);
}

/* ------------------------------------------------ accepting (acceptor) */

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
  if (peer >= (uint32_t)tp->size || (int)peer == tp->rank) {
    snprintf(why, cap, "authenticated peer claims impossible rank %u", peer);
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
  return (int)peer;
}

/* What to do with an authenticated peer's connection, given the pair's
 * state here: 0 accept it, or a HS_DENY_* reason. */
static int hs_decide(tcp_chan_t *t, int peer) {
  if (!t->conns[peer]) return 0;
  switch (t->conns[peer]->state) {
  case C_IDLE:
  case C_AWAIT:
    return 0;
  case C_CONNECTING:
  case C_HELLO:
  case C_REPLY:
    /* Both dialled: the lower rank's connection wins. */
    return t->base.tp->rank < peer ? HS_DENY_CROSS : 0;
  default:
    /* Connected (or failed) already: the peer's crossing attempt, which it
     * gave up when it accepted ours, arriving late. */
    return HS_DENY_RANK;
  }
}

static void pending_drop(pending_t *p) {
  tcp_chan_t *t = p->ch;
  chorus__tp_unwatch(t->base.tp, p->fd);
  close(p->fd);
  int i = p->slot;
  t->pend[i] = t->pend[--t->npend];
  t->pend[i]->slot = i;
  free(p);
}

static void pending_reject(pending_t *p, const char *why) {
  tcp_chan_t *t = p->ch;
  chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                      "chorus rank %d: rejected a connection from %s: %s", t->base.tp->rank,
                      p->addr, why);
  t->rejected++;
  pending_drop(p);
}

/* The connect message is complete: verify, decide, answer. */
static void pending_complete(pending_t *p) {
  tcp_chan_t *t = p->ch;
  chorus__tp_t *tp = t->base.tp;
  char why[160];
  int peer = hs_verify(t, p, why, sizeof why);
  int deny = peer < 0 ? -peer : hs_decide(t, peer);
  uint8_t keys[64];
  if (!deny && tp->encrypt && hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, p->na, p->in + 12,
                                      keys) < 0) {
    snprintf(why, sizeof why, "cannot derive the connection's keys (libcrypto)");
    deny = HS_DENY_AUTH;
  }
  conn_t *c = NULL;
  if (!deny && !(c = conn_make(t, &tp->peers[peer]))) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, "out of memory for the pair's state");
    return;
  }
  uint8_t reply[HS_OK_LEN];
  size_t rlen;
  if (deny) {
    chorus__le32_put(reply, HS_DENY);
    chorus__le32_put(reply + 4, (uint32_t)deny);
    rlen = HS_DENY_LEN;
  } else {
    chorus__le32_put(reply, HS_OK);
    chorus__le32_put(reply + 4, (uint32_t)tp->rank);
    hs_mac(tp, 1, (uint32_t)peer, (uint32_t)tp->rank, p->na, p->in + 12, reply + 8);
    rlen = HS_OK_LEN;
  }
  /* A fresh socket's buffer takes these few bytes at once. */
  ssize_t w = send(p->fd, reply, rlen, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (peer >= 0 && (deny == HS_DENY_CROSS || deny == HS_DENY_RANK)) {
    /* The peer's own attempt, which our connection replaces: no stranger. */
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: world rank %d's crossing connection refused",
                 tp->rank, peer);
    pending_drop(p);
    return;
  }
  if (deny || w != (ssize_t)rlen) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, deny ? why : "could not answer it");
    return;
  }
  int fd = p->fd;
  /* The fd moves from the pending record to the pair. */
  chorus__tp_unwatch(tp, fd);
  p->fd = -1;
  int i = p->slot;
  t->pend[i] = t->pend[--t->npend];
  t->pend[i]->slot = i;
  free(p);
  if (tp->encrypt) memcpy(c->keys, keys, sizeof keys);
  chorus__wipe(keys, sizeof keys);
  conn_ready(c, fd, 0);
}

static void on_pending_event(void *arg, uint32_t events) {
  pending_t *p = arg;
  (void)events;
  tcp_chan_t *t = p->ch;
  ssize_t got = recv(p->fd, p->in + p->got, sizeof p->in - p->got, MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (got <= 0) {
    if (p->got == 0 && (got == 0 || errno == ECONNRESET)) {
      /* Closed without a word: a port probe, or a peer's crossing attempt
       * given up (reset: our hello was still unread).  Nothing to report. */
      CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: %s closed before its handshake",
                   t->base.tp->rank, p->addr);
      pending_drop(p);
      return;
    }
    chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                        "chorus rank %d: dropped a connection from %s: %s before the handshake "
                        "completed", t->base.tp->rank, p->addr,
                        got == 0 ? "closed" : strerror(errno));
    t->rejected++;
    pending_drop(p);
    return;
  }
  p->got += (size_t)got;
  if (p->got == sizeof p->in) pending_complete(p);
}

static void on_listen_event(void *arg, uint32_t events) {
  tcp_chan_t *t = arg;
  chorus__tp_t *tp = t->base.tp;
  (void)events;
  for (int k = 0; k < 64; k++) {
    int fd = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP, "chorus rank %d: accept: %s",
                            tp->rank, strerror(errno));
      return;
    }
    if (t->npend == t->max_pending) { /* the oldest makes room */
      int oldest = 0;
      for (int i = 1; i < t->npend; i++)
        if (t->pend[i]->deadline < t->pend[oldest]->deadline) oldest = i;
      chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                          "chorus rank %d: %d connections are handshaking "
                          "(CHORUS_HANDSHAKE_MAX_PENDING); dropped the oldest, from %s",
                          tp->rank, t->max_pending, t->pend[oldest]->addr);
      t->rejected++;
      pending_drop(t->pend[oldest]);
    }
    pending_t *p = calloc(1, sizeof *p);
    uint8_t hello[HS_HELLO_LEN];
    if (!p || chorus__random_bytes(p->na, sizeof p->na) < 0) {
      free(p);
      close(fd);
      continue;
    }
    p->fd = fd;
    p->ch = t;
    p->watch = (chorus__watch_t){on_pending_event, p};
    p->deadline = chorus__now_ns() + (int64_t)t->hs_ms * 1000000;
    char host[64] = "?";
    int port = 0;
    chorus__net_peer_addr(fd, host, sizeof host, &port);
    snprintf(p->addr, sizeof p->addr, "%s:%d", host, port);
    chorus__le32_put(hello, HS_ACCEPT);
    chorus__le32_put(hello + 4, HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0));
    memcpy(hello + 8, p->na, sizeof p->na);
    if (send(fd, hello, sizeof hello, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof hello ||
        chorus__tp_watch(tp, fd, EPOLLIN, &p->watch) < 0) {
      free(p);
      close(fd);
      continue;
    }
    p->slot = t->npend;
    t->pend[t->npend++] = p;
  }
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
  const chorus__env_t *env = chorus__env();
  t->listen_fd = cfg->listen_fd;
  t->max_pending = env->HANDSHAKE_MAX_PENDING > 0 && env->HANDSHAKE_MAX_PENDING <= 65536
                       ? (int)env->HANDSHAKE_MAX_PENDING : 256;
  t->hs_ms = env->HANDSHAKE_TIMEOUT_MS > 0 ? (int)env->HANDSHAKE_TIMEOUT_MS : 1000;
  t->retry_ms = cfg->retry_ms > 0 ? cfg->retry_ms : 50;
  /* Dialling a peer may take as long as forming the world could. */
  int window = chorus__ms_left(cfg->deadline);
  t->connect_ns = (int64_t)CHORUS__MAX(window, 10000) * 1000000;
  t->pend = calloc((size_t)t->max_pending, sizeof *t->pend);
  t->listen_watch = (chorus__watch_t){on_listen_event, t};
  int ntcp = 0;
  for (int r = 0; r < cfg->size; r++) {
    char host[64];
    int port;
    int mine = tp->peers[r].chan == &t->base;
    ntcp += mine;
    if (split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) == 0)
      snprintf(tp->peers[r].addr, sizeof tp->peers[r].addr, "%s:%d", host, port);
    else if (mine) {
      snprintf(errmsg, errcap, "rank %d published an unparsable address '%s'", r, cfg->addrs[r]);
      tcp_abandon(t);
      return CHORUS_ERR_PROTOCOL;
    }
  }
  if (!t->pend) {
    tcp_abandon(t);
    return CHORUS_ERR_NO_MEMORY;
  }
  if (!ntcp) { /* every peer shares this host: nobody will connect */
    close(t->listen_fd);
    t->listen_fd = -1;
  } else if (chorus__net_set_nonblock(t->listen_fd, 1) < 0 ||
             chorus__tp_watch(tp, t->listen_fd, EPOLLIN, &t->listen_watch) < 0) {
    snprintf(errmsg, errcap, "cannot watch the data listener: %s", strerror(errno));
    tcp_abandon(t);
    return CHORUS_ERR_SYSTEM;
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
  conn_t *c = conn_make((tcp_chan_t *)tp->net, &tp->peers[peer]);
  if (!c) return -1;
  if (c->fd < 0) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sp) < 0) return -1;
    c->fd = sp[0];
    c->state = C_READY;
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
  conn_t *c = conn_make((tcp_chan_t *)tp->net, &tp->peers[peer]);
  static const uint8_t zero[CHORUS__NONCE_LEN];
  uint8_t keys[64];
  if (!c || c->rx_aead || peer <= tp->rank ||
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
  tcp_chan_t *t = (tcp_chan_t *)tp->net;
  int peer = hs_verify(t, &p, why, sizeof why);
  if (peer < 0) return peer;
  int deny = hs_decide(t, peer);
  return deny ? -deny : peer;
}

void chorus__tp_fuzz_free(chorus__tp_t *tp) {
  if (tp) chorus__tp_free(tp);
}
