/*
 * tcp.h - the TCP channel (chan.h), private to its files: authenticated connections between the
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
 *
 * Files: tcp.c the channel's operations (what the endpoint layer calls) and
 * its lifecycle; tcp_io.c framing and encryption of a connection (writing
 * the send queues, reading messages and pieces); tcp_handshake.c the
 * handshake's proofs and the acceptor's check; tcp_connect.c dialling and
 * accepting, up to a connection ready to carry messages; tcp_fuzz.c the
 * fuzzers' entry points (fuzz/ only).  This header: the protocol's
 * constants, the state of a pair and of its connections, and what those
 * files share.  Included by tcp*.c only.
 */
#ifndef CHORUS_TRANSPORT_TCP_H
#define CHORUS_TRANSPORT_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "transport/chan.h"
#include "transport/transport.h"
#include "transport/wire.h"
#include "util/crypto.h"
#include "util/log.h"

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
  /* Pair state, made on a pair's first message either way: the peer's
   * link (NULL until then), and every one made, in live[0 .. nlive). */
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

static inline chorus__tp_t *conn_tp(const conn_t *c) { return c->ch->base.tp; }
static inline chorus__tp_t *stream_tp(const stream_t *s) { return s->c->ch->base.tp; }

/* tcp.c: the channel's operations. */
tcp_chan_t *chorus__tcp_new(chorus__tp_t *tp);
conn_t *chorus__tcp_conn_make(tcp_chan_t *t, chorus__peer_t *p);
void chorus__tcp_stream_init(stream_t *s, conn_t *c, int kind, int idx);
void chorus__tcp_conn_failed(conn_t *c, const char *why, chorus_result_t code);

/* tcp_io.c: framing and encryption of a connection. */
int chorus__tcp_head_waiting(const conn_t *c);
int chorus__tcp_stream_blocked(const stream_t *s);
int chorus__tcp_update_events(stream_t *s, int blocked, int out);
void chorus__tcp_flush_tx(stream_t *s);
void chorus__tcp_stream_push(stream_t *s, txitem_t *it);
int chorus__tcp_send_in_pieces(conn_t *c, txitem_t *it);
void chorus__tcp_assembly_free(conn_t *c, assembly_t *a);
void chorus__tcp_read_stream(stream_t *s);

/* tcp_handshake.c: the handshake's proofs and the acceptor's check. */
void chorus__tcp_hs_mac(const chorus__tp_t *tp, int accept_side, uint32_t connector,
                        uint32_t acceptor, uint32_t v, const uint8_t *na, const uint8_t *nc,
                        uint8_t mac[CHORUS__MAC_LEN]);
int chorus__tcp_hs_keys(const chorus__tp_t *tp, uint32_t connector, uint32_t acceptor,
                        uint32_t stream, const uint8_t *na, const uint8_t *nc, uint8_t out[64]);
int chorus__tcp_hs_verify(tcp_chan_t *t, const pending_t *p, char *why, size_t cap);
int chorus__tcp_hs_decide(tcp_chan_t *t, int peer, uint32_t sidx, uint32_t k);

/* tcp_connect.c: dialling and accepting. */
void chorus__tcp_dial_start(stream_t *s);
void chorus__tcp_dial_event(stream_t *s, uint32_t events);
void chorus__tcp_dial_tick(tcp_chan_t *t, int64_t now);
void chorus__tcp_dial_unlist(stream_t *s);
void chorus__tcp_pending_drop(pending_t *p);
void chorus__tcp_on_listen_event(void *arg, uint32_t events);

#endif
