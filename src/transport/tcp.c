/*
 * tcp.c - the TCP channel (chan.h): authenticated connections between the
 * pairs of ranks that exchange messages, made when the first message
 * between them is sent, optionally encrypted; one per pair, or several
 * (CHORUS_SOCKET_NSTREAMS) that share the pair's large messages.
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
 * Pieces.  A message over 1 MiB travels in pieces (wire.h) on
 * connections of their own: the sender dials K piece connections to the
 * peer (CHORUS_SOCKET_NSTREAMS, or fewer if the peer asks for fewer) the
 * first time it has such a message for it, and once they are up sends the
 * message's header alone (a HEAD) on the pair's main connection and piece i
 * on piece connection i mod K, written side by side.  A piece connection
 * carries one direction: the rank that dialled it writes, the other reads.
 * The main connection carries headers and every smaller message, in order,
 * so a large transfer delays another communicator's message by nothing
 * but its header, and a main connection paused for the receiver's budget
 * (chan.h) never holds back the pieces of a message admitted before.  The
 * receiver routes a cut message when its HEAD arrives and places each piece
 * at its offset as the piece connections deliver them (a piece whose HEAD
 * has not come yet waits, its connection unread).  One TCP flow is limited
 * by its congestion window and by one core's copying; K flows take K
 * shares of a link other traffic also uses, and K cores' worth of kernel
 * work.
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
#define MAX_STREAMS CHORUS__WIRE_MAX_STREAMS
typedef chorus__tx_t txitem_t;

#define HS_ACCEPT 0x41524843u   /* "CHRA" */
#define HS_CONNECT 0x43524843u  /* "CHRC" */
#define HS_OK 0x4b524843u       /* "CHRK" */
#define HS_DENY 0x44524843u     /* "CHRD" */
#define HS_VERSION 3u
/* The version word of connect and ok: the version in its low 16 bits, and
 * HS_FLAG_ENCRYPT when the sender encrypts (CHORUS_ENCRYPT=1: both ends must
 * agree); then which connection of the pair this is (bits 19-23: 0 the
 * main one, i + 1 the connector's piece connection i) and, for a piece
 * connection, how many the connector wants (its first: 1 .. MAX_STREAMS)
 * or has (the others) in bits 24-28 -- in ok, how many it may have. */
#define HS_FLAG_ENCRYPT 0x10000u
#define HS_VERSION_MASK 0xffffu
#define HS_STREAM(v) (((v) >> 19) & 0x1fu)
#define HS_NSTREAMS(v) (((v) >> 24) & 0x1fu)
#define HS_STREAMS(s, k) (((uint32_t)(s) << 19) | ((uint32_t)(k) << 24))
/* Handshake messages (docs/design.md, "Authentication"):
 *   hello    acceptor -> connector  "CHRA" u32 version, nonce Na
 *   connect  connector -> acceptor  "CHRC" u32 version word v, u32 rank c, nonce Nc,
 *                                   HMAC(key, "chorus data connect" W c a v Na Nc)
 *   ok       acceptor -> connector  "CHRK" u32 rank a, u32 version word v',
 *                                   HMAC(key, "chorus data accept" W c a v' Na Nc)
 *   deny     acceptor -> connector  "CHRD" u32 reason (HS_DENY_*)
 * W is the world id, never sent: a peer of another world fails the MAC like
 * one without the key, and a stranger learns nothing about the world. */
#define HS_HELLO_LEN (8 + CHORUS__NONCE_LEN)
#define HS_CONNECT_LEN (12 + CHORUS__NONCE_LEN + CHORUS__MAC_LEN)
#define HS_OK_LEN (12 + CHORUS__MAC_LEN)
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
 * the handshake (HKDF of the job key over both nonces, the world, both
 * ranks and the connection's index) and a counter nonce, so a record that is altered,
 * dropped, replayed or reordered fails the connection.  Records pack the
 * message stream (headers and payloads) in pieces of at most REC_MAX
 * bytes. */
#define REC_MAX ((size_t)128 << 10)
#define REC_OVERHEAD (4 + CHORUS__AEAD_TAG_LEN)
#define DISCARD_BUF 65536
/* Payload bytes read_stream takes from one stream before it returns.  The
 * progress thread holds the context's lock while it reads; a peer that
 * sends as fast as this rank copies would otherwise keep it reading a whole
 * large message, and a thread that wants to post a receive for that very
 * message would wait until it was buffered whole (tens of ms at 32 MiB). */
#define READ_SLICE ((size_t)512 << 10)
/* Messages in pieces a pair may have in reassembly at once, per
 * direction: far more than any algorithm keeps in flight to one peer. */
#define MAX_ASSEMBLIES 4096

typedef struct tcp_chan tcp_chan_t;
typedef struct conn conn_t;

/* The state of a pair (conn_t.state, which its main connection drives) or
 * of a connection being dialled (stream_t.state), on this side. */
enum {
  C_IDLE,       /* no connection, none being made */
  C_CONNECTING, /* dialled: connect() in progress (fd >= 0), or waiting to retry (fd < 0) */
  C_HELLO,      /* connected, waiting for the acceptor's hello */
  C_REPLY,      /* our proof sent, waiting for ok or deny */
  C_AWAIT,      /* refused as the crossing connection: the peer's comes */
  C_READY,      /* carries messages both ways */
  C_CLOSED      /* the peer failed */
};

/* A message being received in pieces: the endpoint layer's stream for it
 * (where its bytes go, how many are still to come), its number among the
 * pair's cut messages, its cut. */
typedef struct assembly {
  chorus__rx_t rx;
  uint64_t msg;
  uint64_t psize;
  int nparts;
  int next[MAX_STREAMS]; /* the piece each piece connection delivers next */
  struct assembly *next_asm;
} assembly_t;

/* What a connection of a pair carries. */
enum {
  S_MAIN, /* every message but pieces, both ways */
  S_OUT,  /* this rank's pieces (dialled by this rank; nothing comes back) */
  S_IN    /* the peer's pieces (accepted here; nothing goes back) */
};

/* One connection of a pair. */
typedef struct stream {
  conn_t *c;
  int kind; /* S_* */
  int idx;  /* of a piece connection: which (piece i travels on i mod K) */
  int fd;
  int state;
  chorus__watch_t watch;
  int epoll_out;
  int waiting; /* S_IN: a piece header whose message's HEAD has not come: not read */
  /* Encryption (NULL when off): the directions' ciphers, the record being
   * written (tx_rec[tx_off..tx_len)) and the record being read
   * (rx_got bytes so far; once opened, plaintext at rx_rec + 4 + rx_poff,
   * rx_pleft bytes of it not yet parsed). */
  chorus__aead_t *tx_aead, *rx_aead;
  uint8_t *tx_rec, *rx_rec;
  size_t tx_len, tx_off, rx_got, rx_poff, rx_pleft;
  uint8_t keys[64]; /* from the handshake: connector->acceptor, acceptor->connector */
  /* Dialling (C_CONNECTING .. C_AWAIT): when it gives up, when to try
   * again (fd < 0), the handshake bytes read so far and both nonces; next
   * on the channel's list of streams being dialled. */
  int64_t deadline, retry_at;
  struct stream *next_dial;
  uint8_t hs[64]; /* a hello or an ok (HS_HELLO_LEN, HS_OK_LEN) */
  size_t hs_got;
  uint8_t na[CHORUS__NONCE_LEN], nc[CHORUS__NONCE_LEN];
  /* Send queue (S_MAIN, S_OUT): messages or pieces wait here while the
   * connection is made and while the socket is full. */
  chorus__txq_t txq;
  /* S_IN: the header of the next piece, and the piece being read into
   * part. */
  assembly_t *part;
  uint64_t part_off, part_left;
  uint8_t hbuf[HDR_SIZE];
  size_t hgot;
} stream_t;

struct conn {
  int state;
  tcp_chan_t *ch;
  chorus__peer_t *peer;
  chorus__rx_t rx;  /* the main connection's message parser */
  int64_t since;    /* when dialling began */
  stream_t s0;      /* the main connection */
  /* Piece connections: this rank's (nout agreed with the peer once the
   * first is up, 0 before; nout_ready up; out_dialled: dialling began) and
   * the peer's (nin, from the handshake of its first). */
  stream_t *out[MAX_STREAMS], *in[MAX_STREAMS];
  int nout, nout_ready, out_dialled, nin;
  int parts_queued; /* pieces on our piece connections' queues */
  /* Messages in pieces: numbered as sent and as their HEADs arrive; those
   * being reassembled, oldest first. */
  uint64_t tx_msgs, rx_msgs;
  assembly_t *asm_head, *asm_tail;
  int nasm;
};

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
  int nstreams; /* CHORUS_SOCKET_NSTREAMS: what this rank asks for */
  int listen_fd;
  chorus__watch_t listen_watch;
  pending_t **pend; /* max_pending slots, npend used */
  int npend, max_pending;
  int hs_ms;
  int64_t connect_ns; /* how long dialling a peer may take */
  int retry_ms;
  stream_t *dialing;  /* streams in C_CONNECTING .. C_AWAIT */
  unsigned long rejected;
  chorus__ratelimit_t reject_log; /* strangers turned away */
  char discard[DISCARD_BUF];
};

static void on_stream_event(void *arg, uint32_t events);
static void conn_failed(conn_t *c, const char *why, chorus_result_t code);
static chorus__tp_t *conn_tp(const conn_t *c) { return c->ch->base.tp; }
static chorus__tp_t *stream_tp(const stream_t *s) { return s->c->ch->base.tp; }

/* ------------------------------------------------------------ sending */

/* Whether the main connection routed a HEAD that head_begin has not taken
 * yet (it was paused for the budget, and resumed). */
static int head_waiting(const conn_t *c) {
  return c->rx.in_payload && chorus__le16_get(c->rx.hbuf + 4) == CHORUS__WIRE_HEAD;
}

/* Whether s's input is switched off: the main connection paused by the
 * endpoint layer, a piece waiting for its HEAD. */
static int stream_blocked(const stream_t *s) {
  return s->kind == S_MAIN ? s->c->rx.paused : s->kind == S_IN && s->waiting;
}

/* The events s waits for: input unless blocked, output while its queue is
 * blocked. */
static int update_events(stream_t *s, int blocked, int out) {
  uint32_t ev = (blocked ? 0u : (uint32_t)EPOLLIN) | (out ? (uint32_t)EPOLLOUT : 0u);
  return chorus__tp_watch_mod(stream_tp(s), s->fd, ev, &s->watch);
}

static void set_epoll_out(stream_t *s, int on) {
  if (s->epoll_out == on || s->c->peer->dead) return;
  if (update_events(s, stream_blocked(s), on) == 0) s->epoll_out = on;
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
    conn_failed(s->c, "encryption failed (libcrypto)", CHORUS_ERR_SYSTEM);
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
static void flush_tx(stream_t *s) {
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
      conn_failed(c, why, CHORUS_ERR_REMOTE);
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
static void stream_push(stream_t *s, txitem_t *it) {
  chorus__txq_push(&s->txq, it);
  if (s->state == C_READY && s->txq.head == it) flush_tx(s);
}

/* Sends it (a DATA message, every piece connection up) in pieces (wire.h):
 * its header alone as the HEAD on the main connection, piece i a PART on
 * piece connection i mod K.  0, or -1 when it goes whole (too short, or no
 * memory for the pieces). */
static int send_in_pieces(conn_t *c, txitem_t *it) {
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
  stream_push(&c->s0, it);
  i = 0;
  for (txitem_t *pt = first, *nx; pt; pt = nx, i++) {
    nx = pt->next;
    pt->next = NULL;
    if (c->state == C_CLOSED) /* a write failed meanwhile: the pair is gone */
      chorus__tp_tx_lost(conn_tp(c), c->peer, pt);
    else {
      c->parts_queued++;
      stream_push(c->out[i % c->nout], pt);
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
    conn_failed(c, "an encrypted record failed authentication: its bytes were changed on the "
                "way, or do not come from that rank", CHORUS_ERR_PROTOCOL);
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

static void assembly_free(conn_t *c, assembly_t *a) {
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
    conn_failed(c, "out of memory reassembling a message in pieces", CHORUS_ERR_NO_MEMORY);
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
    update_events(o, 0, 0);
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
      update_events(s, 1, 0);
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
  if (!a->rx.left) assembly_free(s->c, a);
}

/* Reads what s's socket has: messages (the main connection), pieces (the
 * peer's piece connections), nothing (ours: only its end, or an error). */
static void read_stream(stream_t *s) {
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
      conn_failed(c, mid ? "closed its connection in the middle of a message"
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

static void dial_event(stream_t *s, uint32_t events);

static void on_stream_event(void *arg, uint32_t events) {
  stream_t *s = arg;
  if (s->c->peer->dead) return;
  if (s->kind == S_IN && s->waiting && (events & (EPOLLHUP | EPOLLERR))) {
    /* Not read while it waits for a HEAD, and epoll reports this anyway. */
    conn_failed(s->c, "closed a piece connection in the middle of a message", CHORUS_ERR_REMOTE);
    return;
  }
  if (s->state != C_READY) {
    dial_event(s, events);
    return;
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_stream(s);
  if (!s->c->peer->dead && (events & EPOLLOUT)) flush_tx(s);
}

/* p's pair state; NULL while nothing was sent either way. */
static conn_t *conn_of(chorus__chan_t *ch, const chorus__peer_t *p) {
  return ((tcp_chan_t *)ch)->conns[p->rank];
}

static void stream_init(stream_t *s, conn_t *c, int kind, int idx) {
  s->c = c;
  s->kind = kind;
  s->idx = idx;
  s->fd = -1;
  s->state = C_IDLE;
  s->watch = (chorus__watch_t){on_stream_event, s};
  if (kind == S_OUT) c->out[idx] = s;
  if (kind == S_IN) c->in[idx] = s;
}

/* Every connection of c: the main one, then the piece connections. */
#define FOR_STREAMS(c, s)                                                              \
  for (int k_ = 0; k_ < 1 + 2 * MAX_STREAMS; k_++)                                     \
    for (stream_t *s = k_ == 0 ? &(c)->s0                                              \
                       : k_ <= MAX_STREAMS ? (c)->out[k_ - 1] : (c)->in[k_ - 1 - MAX_STREAMS]; \
         s; s = NULL)

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
  c->ch = t;
  c->peer = p;
  stream_init(&c->s0, c, S_MAIN, 0);
  chorus__tp_rx_attach(t->base.tp, p, &c->rx, &t->base, c);
  p->link = c;
  t->conns[p->rank] = c;
  t->live[t->nlive++] = c;
  return c;
}

static void dial_start(stream_t *s);

/* The first message over 1 MiB to c's peer: dial this rank's first piece
 * connection (its handshake agrees on how many; stream_ready dials the
 * others).  Meanwhile messages go whole. */
static void pieces_dial(conn_t *c) {
  stream_t *x = calloc(1, sizeof *x);
  c->out_dialled = 1;
  if (!x) return; /* whole messages, then */
  stream_init(x, c, S_OUT, 0);
  x->deadline = chorus__now_ns() + c->ch->connect_ns;
  dial_start(x);
}

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
  if (c->state == C_READY && it->len > CHORUS__WIRE_PART_MAX) {
    if (!c->out_dialled) pieces_dial(c);
    if (c->state == C_CLOSED) { /* that dial failed at once, and the peer with it */
      chorus__tp_tx_lost(ch->tp, p, it);
      return;
    }
    /* In pieces once the connections are up, and while the receiver's
     * reassemblies stay well within MAX_ASSEMBLIES. */
    if (c->nout && c->nout_ready == c->nout && c->parts_queued < MAX_ASSEMBLIES / 2 &&
        send_in_pieces(c, it) == 0)
      return;
  }
  stream_push(&c->s0, it);
  if (c->state == C_IDLE) {
    c->since = chorus__now_ns();
    c->s0.deadline = c->since + c->ch->connect_ns;
    dial_start(&c->s0);
  }
}

static void tcp_rx_pause(chorus__chan_t *ch, chorus__rx_t *rx, int on) {
  conn_t *c = rx->link;
  if (c->state != C_READY || c->peer->dead) return;
  update_events(&c->s0, on, c->s0.epoll_out);
  /* Plaintext already opened, or a HEAD routed now whose bytes come on
   * other connections: no socket event will say so. */
  if (!on && (c->s0.rx_pleft || head_waiting(c))) chorus__tp_kick(ch->tp);
}

static int tcp_cancel(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  int rc = 0;
  if (!c) return 0;
  FOR_STREAMS(c, s) if (chorus__txq_cancel(&s->txq, ep) < 0) rc = -1;
  return rc;
}

static int tcp_pending(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  if (!c) return 0;
  FOR_STREAMS(c, s) if (chorus__txq_has(&s->txq, ep) || (!ep && s->tx_off < s->tx_len)) return 1;
  return 0;
}

static void dial_unlist(stream_t *s) {
  for (stream_t **pp = &s->c->ch->dialing; *pp; pp = &(*pp)->next_dial)
    if (*pp == s) {
      *pp = s->next_dial;
      break;
    }
  s->next_dial = NULL;
}

static void tcp_close(chorus__chan_t *ch, chorus__peer_t *p) {
  conn_t *c = conn_of(ch, p);
  if (!c) return; /* never talked: nothing queued, nothing to close */
  FOR_STREAMS(c, s) {
    if (s->state >= C_CONNECTING && s->state <= C_AWAIT) dial_unlist(s);
    if (s->fd >= 0) {
      chorus__tp_unwatch(ch->tp, s->fd);
      /* The peer must see EOF now, not at its timeout; the fd number
       * itself stays reserved until the channel goes so it cannot be
       * reused. */
      shutdown(s->fd, SHUT_RDWR);
    }
    s->state = C_CLOSED;
    s->part = NULL;
    chorus__txq_lose(ch->tp, p, &s->txq);
    s->tx_off = s->tx_len;
  }
  c->state = C_CLOSED;
  while (c->asm_head) assembly_free(c, c->asm_head);
}

static void tcp_link_desc(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap) {
  conn_t *c = conn_of(ch, p);
  char local[80] = "?", remote[80] = "?", ifname[64] = "?", more[48] = "";
  int lport = 0, rport = 0;
  if (!c || c->state != C_READY) {
    snprintf(buf, cap, "tcp (%s %s)",
             !c || c->state == C_IDLE ? "not connected; listens at" : "connecting to", p->addr);
    return;
  }
  chorus__net_local_addr(c->s0.fd, local, sizeof local, &lport);
  chorus__net_peer_addr(c->s0.fd, remote, sizeof remote, &rport);
  chorus__net_addr_ifname(local, ifname, sizeof ifname);
  if (c->nout || c->nin)
    snprintf(more, sizeof more, ", piece connections %d of %d out, %d in", c->nout_ready, c->nout,
             c->nin);
  snprintf(buf, cap, "tcp %s:%d -> %s:%d (%s%s)", local, lport, remote, rport, ifname, more);
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

/* Whether s has input no socket event will announce: opened plaintext not
 * parsed yet, or a piece header parsed while its HEAD was awaited. */
static int stream_has_input(const stream_t *s) {
  if (s->state != C_READY || stream_blocked(s)) return 0;
  return s->rx_pleft || (s->kind == S_IN && s->hgot == HDR_SIZE && !s->part) ||
         (s->kind == S_MAIN && head_waiting(s->c));
}

/* Each progress round: handshakes and dials past their deadlines; input
 * that is there but that no event will announce (stream_has_input). */
static void tcp_poll(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  int64_t now = chorus__now_ns();
  for (int i = t->npend - 1; i >= 0; i--) {
    if (t->pend[i]->deadline > now) continue;
    chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                        "chorus rank %d: dropped a connection from %s: no handshake within %d ms",
                        ch->tp->rank, t->pend[i]->addr, t->hs_ms);
    t->rejected++;
    pending_drop(t->pend[i]);
  }
  if (t->dialing) dial_tick(t, now);
  for (int i = 0; i < t->nlive; i++) {
    conn_t *c = t->live[i];
    FOR_STREAMS(c, s) if (!c->peer->dead && stream_has_input(s)) read_stream(s);
  }
}

static void stream_free(stream_t *s) {
  if (s->fd >= 0) close(s->fd);
  chorus__txq_free(&s->txq);
  chorus__aead_free(s->tx_aead);
  chorus__aead_free(s->rx_aead);
  free(s->tx_rec);
  free(s->rx_rec);
  chorus__wipe(s->keys, sizeof s->keys);
  if (s->kind != S_MAIN) free(s);
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
    FOR_STREAMS(c, s) stream_free(s);
    while (c->asm_head) assembly_free(c, c->asm_head);
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
  t->nstreams = 1;
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

/* v: the version word of the message the MAC is for (connect or ok). */
static void hs_mac(const chorus__tp_t *tp, int accept_side, uint32_t connector, uint32_t acceptor,
                   uint32_t v, const uint8_t *na, const uint8_t *nc,
                   uint8_t mac[CHORUS__MAC_LEN]) {
  static const char lc[] = "chorus data connect", la[] = "chorus data accept";
  uint8_t ids[20];
  chorus__le64_put(ids, tp->world_id);
  chorus__le32_put(ids + 8, connector);
  chorus__le32_put(ids + 12, acceptor);
  chorus__le32_put(ids + 16, v);
  const void *parts[4] = {accept_side ? (const void *)la : (const void *)lc, ids, na, nc};
  size_t lens[4] = {accept_side ? sizeof la : sizeof lc, sizeof ids, CHORUS__NONCE_LEN,
                    CHORUS__NONCE_LEN};
  chorus__hmac(&tp->key, parts, lens, 4, mac);
}

/* A connection's two record keys (CHORUS_ENCRYPT): HKDF of the job key
 * over both nonces, the world, both ranks and the stream; connector->acceptor
 * first. */
static int hs_keys(const chorus__tp_t *tp, uint32_t connector, uint32_t acceptor, uint32_t stream,
                   const uint8_t *na, const uint8_t *nc, uint8_t out[64]) {
  uint8_t salt[2 * CHORUS__NONCE_LEN], info[16 + 20];
  memcpy(salt, na, CHORUS__NONCE_LEN);
  memcpy(salt + CHORUS__NONCE_LEN, nc, CHORUS__NONCE_LEN);
  memcpy(info, "chorus data keys", 16);
  chorus__le64_put(info + 16, tp->world_id);
  chorus__le32_put(info + 24, connector);
  chorus__le32_put(info + 28, acceptor);
  chorus__le32_put(info + 32, stream);
  int rc = chorus__hkdf(&tp->key, salt, sizeof salt, info, sizeof info, out, 64);
  chorus__wipe(salt, sizeof salt);
  return rc;
}

static void dial_start(stream_t *s);

/* The index of s in the handshake: 0 the main connection, i + 1 piece
 * connection i of the rank that dials it. */
static uint32_t wire_index(const stream_t *s) { return s->kind == S_MAIN ? 0 : (uint32_t)s->idx + 1; }

/* s's handshake succeeded on fd (this rank dialled: connector): s carries
 * its share of the pair from now on, its queued messages go; once this
 * rank's first piece connection is up (and the count agreed), it dials the
 * others.  0, or -1 after failing the peer. */
static int stream_ready(stream_t *s, int fd, int connector) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  if (s->state >= C_CONNECTING && s->state <= C_AWAIT) dial_unlist(s);
  if (s->fd >= 0 && s->fd != fd) { /* our own attempt, which lost the crossing */
    chorus__tp_unwatch(tp, s->fd);
    close(s->fd);
  }
  s->fd = fd;
  s->state = C_READY;
  if (s->kind == S_MAIN) {
    c->state = C_READY;
    c->rx.pieces_ok = 1;
  }
  if (tp->encrypt) {
    s->tx_aead = chorus__aead_new(s->keys + (connector ? 0 : 32), connector ? 1 : 2, 1);
    s->rx_aead = chorus__aead_new(s->keys + (connector ? 32 : 0), connector ? 2 : 1, 0);
    s->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
    s->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
    chorus__wipe(s->keys, sizeof s->keys);
    if (!s->tx_aead || !s->rx_aead || !s->tx_rec || !s->rx_rec) {
      conn_failed(c, "out of memory for the connection's encryption state", CHORUS_ERR_NO_MEMORY);
      return -1;
    }
  }
  chorus__net_set_nonblock(fd, 1);
  chorus__net_set_nodelay(fd);
  int sz = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  /* An accepted fd is new to epoll; a dialled one is watched already.
   * Every kind reads: ours to see the end of a piece connection. */
  if (chorus__tp_watch(tp, fd, EPOLLIN, &s->watch) < 0 &&
      (errno != EEXIST || chorus__tp_watch_mod(tp, fd, EPOLLIN, &s->watch) < 0)) {
    char why[96];
    snprintf(why, sizeof why, "epoll_ctl failed (%s)", strerror(errno));
    conn_failed(c, why, CHORUS_ERR_SYSTEM);
    return -1;
  }
  s->epoll_out = 0;
  if (s->kind == S_MAIN) {
    /* Silence counts from now: nothing could be heard before. */
    c->peer->last_heard = chorus__now_ns();
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: connected with world rank %d (%s, %s)",
                 tp->rank, c->peer->rank, c->peer->addr, connector ? "dialled" : "accepted");
  } else {
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: %s piece connection %d of %d with world "
                 "rank %d up", tp->rank, s->kind == S_OUT ? "outgoing" : "incoming", s->idx + 1,
                 s->kind == S_OUT ? c->nout : c->nin, c->peer->rank);
  }
  if (s->kind == S_OUT) c->nout_ready++;
  if (s->txq.head) flush_tx(s);
  if (s->kind == S_OUT && s->idx == 0) {
    for (int i = 1; i < c->nout && !c->peer->dead; i++) {
      stream_t *x = calloc(1, sizeof *x);
      if (!x) {
        conn_failed(c, "out of memory for its connections' state", CHORUS_ERR_NO_MEMORY);
        return -1;
      }
      stream_init(x, c, S_OUT, i);
      x->deadline = chorus__now_ns() + c->ch->connect_ns;
      dial_start(x);
    }
  }
  return c->peer->dead ? -1 : 0;
}

/* ------------------------------------------------- dialling (connector) */

static void dial_fail(stream_t *s, const char *what, int err) {
  conn_t *c = s->c;
  char why[400], which[48] = "";
  if (s->kind == S_OUT) snprintf(which, sizeof which, " (piece connection %d)", s->idx + 1);
  snprintf(why, sizeof why, "cannot connect to its listener at %s%s: %s", c->peer->addr, which,
           what);
  if (err) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, " (%s)", strerror(err));
  }
  /* Refused: nothing listens there any more.  Right after start-up that is
   * often a rank whose own init failed -- another rank died while the world
   * formed -- and its log names the cause (issue 42). */
  if (err == ECONNREFUSED) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, "; its process has ended, or left init with an error "
             "(its own output says why: another rank's death while the world formed, say)");
  }
  CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: world rank %d: %s", conn_tp(c)->rank,
              c->peer->rank, why);
  conn_failed(c, why, err == ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_REMOTE);
}

/* s's state, and the pair's when s is its main connection. */
static void dial_state(stream_t *s, int state) {
  s->state = state;
  if (s->kind == S_MAIN) s->c->state = state;
}

/* This attempt is over but the stream may still connect: try again after
 * CHORUS_CONNECT_RETRY_MS, within the deadline (dial_tick). */
static void dial_retry(stream_t *s) {
  if (s->fd >= 0) {
    chorus__tp_unwatch(stream_tp(s), s->fd);
    close(s->fd);
    s->fd = -1;
  }
  dial_state(s, C_CONNECTING);
  s->retry_at = chorus__now_ns() + (int64_t)s->c->ch->retry_ms * 1000000;
}

/* Starts an attempt (C_IDLE, or C_CONNECTING waiting to retry). */
static void dial_start(stream_t *s) {
  tcp_chan_t *t = s->c->ch;
  if (s->state == C_IDLE) {
    s->next_dial = t->dialing;
    t->dialing = s;
  }
  dial_state(s, C_CONNECTING);
  s->hs_got = 0;
  char host[64];
  int port;
  if (chorus__net_split_addr(s->c->peer->addr, ':', host, sizeof host, &port) < 0) {
    dial_fail(s, "the address it published cannot be parsed", 0);
    return;
  }
  int fd = chorus__net_connect_start(host, port);
  if (fd < 0) {
    if (fd == -ENETUNREACH || fd == -EHOSTUNREACH || fd == -EAGAIN || fd == -ENOBUFS) {
      dial_retry(s);
      return;
    }
    dial_fail(s, "connect failed", -fd);
    return;
  }
  s->fd = fd;
  if (chorus__tp_watch(stream_tp(s), fd, EPOLLOUT, &s->watch) < 0) {
    close(fd);
    s->fd = -1;
    dial_fail(s, "epoll_ctl failed", errno);
  }
}

/* Streams waiting to retry, or past their deadline.  Failing a pair fails
 * endpoints, whose ABORTs may start or fail other dials: the scan starts
 * over after each. */
static void dial_tick(tcp_chan_t *t, int64_t now) {
  for (stream_t *s = t->dialing; s;) {
    if (now >= s->deadline) {
      char what[96];
      snprintf(what, sizeof what, "no connection within %lld ms (%s)",
               (long long)(t->connect_ns / 1000000),
               s->state == C_AWAIT ? "it was to dial this rank" : "the attempts kept failing");
      dial_fail(s, what, ETIMEDOUT);
      s = t->dialing;
    } else if (s->state == C_CONNECTING && s->fd < 0 && now >= s->retry_at) {
      dial_start(s);
      s = t->dialing;
    } else {
      s = s->next_dial;
    }
  }
}

/* Reads handshake bytes up to want; 1 when there, 0 when more must come,
 * -1 when the connection ended (errno; 0 at EOF). */
static int dial_read(stream_t *s, size_t want) {
  while (s->hs_got < want) {
    ssize_t n = recv(s->fd, s->hs + s->hs_got, want - s->hs_got, MSG_DONTWAIT);
    if (n > 0) {
      s->hs_got += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n == 0) errno = 0;
    return -1;
  }
  return 1;
}

/* The version word of this rank's connect for s: for a piece connection
 * also how many this rank wants (its first) or agreed (the others). */
static uint32_t connect_word(const stream_t *s) {
  const conn_t *c = s->c;
  int k = s->kind == S_MAIN ? 1 : s->idx ? c->nout : c->ch->nstreams;
  return HS_VERSION | (conn_tp(c)->encrypt ? HS_FLAG_ENCRYPT : 0) | HS_STREAMS(wire_index(s), k);
}

/* The acceptor's hello is in: answer with our proof. */
static void dial_hello(stream_t *s) {
  chorus__tp_t *tp = stream_tp(s);
  uint32_t version = chorus__le32_get(s->hs + 4);
  if (chorus__le32_get(s->hs) != HS_ACCEPT || (version & HS_VERSION_MASK) != HS_VERSION) {
    char what[96];
    snprintf(what, sizeof what, "not a chorus peer of this version (magic %08x, version %u)",
             chorus__le32_get(s->hs), version & HS_VERSION_MASK);
    dial_fail(s, what, 0);
    return;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    char what[128];
    snprintf(what, sizeof what, "the ranks disagree on CHORUS_ENCRYPT (this rank %d, that one "
             "%d): set it the same on every rank", tp->encrypt, !tp->encrypt);
    dial_fail(s, what, 0);
    return;
  }
  uint8_t out[HS_CONNECT_LEN];
  uint32_t v = connect_word(s);
  memcpy(s->na, s->hs + 8, CHORUS__NONCE_LEN);
  chorus__le32_put(out, HS_CONNECT);
  chorus__le32_put(out + 4, v);
  chorus__le32_put(out + 8, (uint32_t)tp->rank);
  if (chorus__random_bytes(s->nc, CHORUS__NONCE_LEN) < 0) {
    dial_fail(s, "no randomness", errno);
    return;
  }
  memcpy(out + 12, s->nc, CHORUS__NONCE_LEN);
  hs_mac(tp, 0, (uint32_t)tp->rank, (uint32_t)s->c->peer->rank, v, s->na, s->nc,
         out + 12 + CHORUS__NONCE_LEN);
  /* A fresh socket's buffer takes these few bytes at once. */
  if (send(s->fd, out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof out) {
    dial_retry(s);
    return;
  }
  dial_state(s, C_REPLY);
  s->hs_got = 0;
}

/* The acceptor's answer is in (at least its first 8 bytes). */
static void dial_reply(stream_t *s) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  int peer = c->peer->rank;
  if (chorus__le32_get(s->hs) == HS_DENY) {
    uint32_t reason = chorus__le32_get(s->hs + 4);
    if (reason == HS_DENY_CROSS && s->kind == S_MAIN) {
      /* It dials us too and its connection is the one: wait for it. */
      chorus__tp_unwatch(tp, s->fd);
      close(s->fd);
      s->fd = -1;
      dial_state(s, C_AWAIT);
      return;
    }
    dial_fail(s, reason == HS_DENY_AUTH ? "it refused our proof: the ranks have different job "
              "secrets, or the address belongs to another world or generation"
              : reason == HS_DENY_RANK    ? "it already has a connection from this rank"
              : reason == HS_DENY_ENCRYPT ? "the ranks disagree on CHORUS_ENCRYPT: set it the "
                                            "same on every rank"
                                          : "it speaks another handshake version", 0);
    return;
  }
  uint32_t v = chorus__le32_get(s->hs + 8);
  uint32_t k = HS_NSTREAMS(v);
  if (chorus__le32_get(s->hs) != HS_OK || chorus__le32_get(s->hs + 4) != (uint32_t)peer) {
    dial_fail(s, "unexpected answer to the handshake (not that rank of this world?)", 0);
    return;
  }
  uint8_t want[CHORUS__MAC_LEN];
  hs_mac(tp, 1, (uint32_t)tp->rank, (uint32_t)peer, v, s->na, s->nc, want);
  if (!chorus__ct_equal(want, s->hs + 12, sizeof want)) {
    dial_fail(s, "it did not prove the job key (a stranger on that port?)", 0);
    return;
  }
  /* The count of piece connections: at most what we asked for; the others
   * must repeat it. */
  if (k < 1 || k > (uint32_t)HS_NSTREAMS(connect_word(s)) ||
      (s->kind == S_OUT && s->idx && k != (uint32_t)c->nout)) {
    dial_fail(s, "it answered with an impossible number of piece connections", 0);
    return;
  }
  if (tp->encrypt && hs_keys(tp, (uint32_t)tp->rank, (uint32_t)peer, wire_index(s), s->na, s->nc,
                             s->keys) < 0) {
    dial_fail(s, "cannot derive the connection's keys (libcrypto)", 0);
    return;
  }
  if (s->kind == S_OUT && s->idx == 0) c->nout = (int)k;
  stream_ready(s, s->fd, 1);
}

static void dial_event(stream_t *s, uint32_t events) {
  if (s->fd < 0) return;
  if (s->state == C_CONNECTING) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == 0 && !(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
    if (err == ECONNREFUSED) {
      /* The listener was there when its address was published: the rank
       * is gone, or listens on an address this host cannot reach. */
      dial_fail(s, "connection refused: the rank has exited, or its address is not reachable "
                "from this host (check CHORUS_SOCKET_IFNAME)", 0);
      return;
    }
    if (err) {
      dial_retry(s);
      return;
    }
    dial_state(s, C_HELLO);
    s->hs_got = 0;
    chorus__tp_watch_mod(stream_tp(s), s->fd, EPOLLIN, &s->watch);
    return;
  }
  if (s->state != C_HELLO && s->state != C_REPLY) return;
  size_t want = s->state == C_HELLO ? HS_HELLO_LEN : HS_DENY_LEN;
  int rc = dial_read(s, want);
  if (rc == 1 && s->state == C_REPLY && chorus__le32_get(s->hs) == HS_OK)
    rc = dial_read(s, HS_OK_LEN);
  if (rc < 0) {
    /* The acceptor dropped us (its handshake slots were full, or it was
     * too slow to answer): try again within the deadline. */
    dial_retry(s);
    return;
  }
  if (rc == 0) return;
  if (s->state == C_HELLO)
    dial_hello(s);
  else
    dial_reply(s);
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
  hs_mac(tp, 0, peer, (uint32_t)tp->rank, version, p->na, in + 12, want);
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
  uint32_t k = HS_NSTREAMS(version), sidx = HS_STREAM(version);
  if (k < 1 || k > MAX_STREAMS || sidx > k) {
    snprintf(why, cap, "rank %u asks for connection %u of %u", peer, sidx, k);
    return -HS_DENY_VERSION;
  }
  return (int)peer;
}

/* What to do with an authenticated peer's connection (sidx 0: the pair's
 * main one; else its piece connection sidx - 1 of k), given the pair's
 * state here: 0 accept it, or a HS_DENY_* reason. */
static int hs_decide(tcp_chan_t *t, int peer, uint32_t sidx, uint32_t k) {
  conn_t *c = t->conns[peer];
  if (sidx > 0) /* it dials its piece connections once the pair is connected */
    return c && c->state != C_CLOSED && c->state != C_IDLE && !c->in[sidx - 1] &&
                   (sidx == 1 ? !c->nin : c->nin && k == (uint32_t)c->nin && sidx <= k)
               ? 0 : HS_DENY_RANK;
  if (!c) return 0;
  switch (c->state) {
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

/* p leaves the pending slots (its fd closed unless taken, p->fd < 0). */
static void pending_drop(pending_t *p) {
  tcp_chan_t *t = p->ch;
  if (p->fd >= 0) {
    chorus__tp_unwatch(t->base.tp, p->fd);
    close(p->fd);
  }
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
  uint32_t v = chorus__le32_get(p->in + 4);
  uint32_t sidx = HS_STREAM(v), k = HS_NSTREAMS(v);
  int deny = peer < 0 ? -peer : hs_decide(t, peer, sidx, k);
  uint8_t keys[64];
  if (!deny && tp->encrypt &&
      hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, sidx, p->na, p->in + 12, keys) < 0) {
    snprintf(why, sizeof why, "cannot derive the connection's keys (libcrypto)");
    deny = HS_DENY_AUTH;
  }
  conn_t *c = NULL;
  stream_t *s = NULL;
  if (!deny && !(c = conn_make(t, &tp->peers[peer]))) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, "out of memory for the pair's state");
    return;
  }
  if (!deny && sidx > 0 && !(s = calloc(1, sizeof *s))) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, "out of memory for the connection's state");
    return;
  }
  /* The count of the peer's piece connections: the smaller wish (its
   * first), then that one. */
  uint32_t agreed = sidx > 1 ? k : CHORUS__MIN(k, (uint32_t)t->nstreams);
  uint32_t ok_word = HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0) | HS_STREAMS(sidx, agreed);
  uint8_t reply[HS_OK_LEN];
  size_t rlen;
  if (deny) {
    chorus__le32_put(reply, HS_DENY);
    chorus__le32_put(reply + 4, (uint32_t)deny);
    rlen = HS_DENY_LEN;
  } else {
    chorus__le32_put(reply, HS_OK);
    chorus__le32_put(reply + 4, (uint32_t)tp->rank);
    chorus__le32_put(reply + 8, ok_word);
    hs_mac(tp, 1, (uint32_t)peer, (uint32_t)tp->rank, ok_word, p->na, p->in + 12, reply + 12);
    rlen = HS_OK_LEN;
  }
  /* A fresh socket's buffer takes these few bytes at once. */
  ssize_t w = send(p->fd, reply, rlen, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (peer >= 0 && sidx == 0 && (deny == HS_DENY_CROSS || deny == HS_DENY_RANK)) {
    /* The peer's own attempt, which our connection replaces: no stranger. */
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: world rank %d's crossing connection refused",
                 tp->rank, peer);
    pending_drop(p);
    return;
  }
  if (deny || w != (ssize_t)rlen) {
    chorus__wipe(keys, sizeof keys);
    free(s);
    pending_reject(p, deny ? why : "could not answer it");
    return;
  }
  /* The fd moves from the pending record to the stream. */
  int fd = p->fd;
  chorus__tp_unwatch(tp, fd);
  p->fd = -1;
  pending_drop(p);
  if (sidx > 0) {
    stream_init(s, c, S_IN, (int)sidx - 1);
    if (sidx == 1) c->nin = (int)agreed;
  } else {
    s = &c->s0;
  }
  if (tp->encrypt) memcpy(s->keys, keys, sizeof keys);
  chorus__wipe(keys, sizeof keys);
  stream_ready(s, fd, 0);
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
  t->nstreams = (int)CHORUS__MAX(1, CHORUS__MIN(env->SOCKET_NSTREAMS, (int64_t)MAX_STREAMS));
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
    /* Named already (chorus__tp_create); ours must be reachable. */
    if (mine && chorus__net_split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) < 0) {
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

int chorus__tp_fuzz_pieces(chorus__tp_t *tp, int peer, int k) {
  conn_t *c = conn_make((tcp_chan_t *)tp->net, &tp->peers[peer]);
  if (!c || k < 1 || k > MAX_STREAMS || c->nin) return -1;
  c->nin = k;
  return 0;
}

int chorus__tp_fuzz_feed(chorus__tp_t *tp, int peer, int stream, const void *data, size_t n,
                         int *wfd) {
  conn_t *c = conn_make((tcp_chan_t *)tp->net, &tp->peers[peer]);
  if (!c || stream < 0 || stream > c->nin) return -1;
  stream_t *s = stream ? c->in[stream - 1] : &c->s0;
  if (!s) {
    if (!(s = calloc(1, sizeof *s))) return -1;
    stream_init(s, c, S_IN, stream - 1);
  }
  if (s->fd < 0) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sp) < 0) return -1;
    s->fd = sp[0];
    s->state = C_READY;
    if (stream == 0) c->state = C_READY;
    c->rx.pieces_ok = 1;
    *wfd = sp[1];
    chorus__tp_watch(tp, s->fd, EPOLLIN, &s->watch);
  }
  if (n && send(*wfd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return -1;
  pthread_mutex_lock(&tp->lock);
  if (!c->peer->dead && !stream_blocked(s)) read_stream(s);
  if (!c->peer->dead) tcp_poll(tp->net);
  int dead = c->peer->dead;
  pthread_mutex_unlock(&tp->lock);
  return dead ? -1 : 0;
}

chorus__aead_t *chorus__tp_fuzz_encrypt(chorus__tp_t *tp, int peer) {
  conn_t *c = conn_make((tcp_chan_t *)tp->net, &tp->peers[peer]);
  static const uint8_t zero[CHORUS__NONCE_LEN];
  uint8_t keys[64];
  if (!c || c->s0.rx_aead || peer <= tp->rank ||
      hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, 0, zero, zero, keys) < 0)
    return NULL;
  stream_t *s = &c->s0;
  /* This rank accepted peer: it receives on keys[0..32), label 1. */
  s->rx_aead = chorus__aead_new(keys, 1, 0);
  s->tx_aead = chorus__aead_new(keys + 32, 2, 1);
  s->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
  s->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
  chorus__aead_t *sealer = chorus__aead_new(keys, 1, 1);
  chorus__wipe(keys, sizeof keys);
  tp->encrypt = 1;
  return s->rx_aead && s->tx_aead && s->rx_rec && s->tx_rec ? sealer : NULL;
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
  uint32_t v = chorus__le32_get(p.in + 4);
  int deny = hs_decide(t, peer, HS_STREAM(v), HS_NSTREAMS(v));
  return deny ? -deny : peer;
}

void chorus__tp_fuzz_free(chorus__tp_t *tp) {
  if (tp) chorus__tp_free(tp);
}
