/*
 * chan.h - between the endpoint layer (endpoint*.c) and the channels that
 * move its bytes (tcp.c, shm_chan.c, ucx.c).  Internal to src/transport/.
 *
 * The endpoint layer owns everything that does not depend on how bytes
 * travel: endpoints, matching of messages to receives, the buffer for
 * messages that arrive early and its per-peer budget, the failure model
 * (sticky failures, ABORT to the other members, timeouts naming the silent
 * ranks), heartbeats and the silence detector, goodbyes, and the progress
 * thread.  A channel owns the way to a peer: its connections (or rings),
 * the handshake, framing on its medium, and its send queues.  Whatever the
 * channel, every message is the same 56-byte header (wire.h) and payload,
 * with the same fingerprints and sequence numbers.
 *
 * Sending.  The endpoint layer fills a chorus__tx_t (encoded header, the
 * caller's payload, the request it completes) and hands it to the peer's
 * channel (ops->send), which writes it in order with the peer's other
 * messages and calls chorus__tp_tx_done() once every byte is out (or
 * copied): the caller may then reuse its buffer.
 *
 * Receiving.  A channel parses each incoming byte stream with a
 * chorus__rx_t: once its 56 header bytes are in rx->hbuf it calls
 * chorus__tp_rx_header(), which decides where the payload goes (a posted
 * receive, a new early-message buffer, or nowhere) and sets rx->dst and
 * rx->left -- or pauses the stream (ops->rx_pause(rx, 1)) when the message
 * can go nowhere yet because the sender's budget is spent; the channel
 * then stops reading that stream until the endpoint layer resumes it
 * (ops->rx_pause(rx, 0)) and the kernel's (or the ring's) flow control
 * slows the sender.  The channel moves payload bytes to rx->dst (discarding
 * them when it is NULL) and reports them with chorus__tp_rx_bytes().  It
 * reads rx->dst again before each chunk: a receive posted while its
 * message is being buffered takes over the rest of the payload (the bytes
 * buffered so far are copied, rx->dst moves to the receive's buffer).  A
 * channel that hands dst to a transfer in flight sets rx->dst_fixed.
 *
 * Messages in pieces (wire.h).  A channel that cuts messages sets
 * rx->pieces_ok on the stream that may carry HEADs; the endpoint layer
 * routes a HEAD as the DATA message it is (rx->h says DATA, its whole
 * length; rx->hbuf still says HEAD), and the channel then moves that
 * message's state into a stream of its own (chorus__tp_rx_move) which its
 * pieces fill at their offsets as they come, reporting each with
 * chorus__tp_rx_bytes_to; the HEAD's stream goes on with the next header.
 *
 * Failures.  A channel that loses a peer (EOF, error, a protocol violation)
 * calls chorus__tp_peer_failed(); the endpoint layer fails the endpoints
 * that need the peer and asks the channel to close it (ops->close), which
 * hands every queued message back through chorus__tp_tx_lost().
 *
 * Every call in either direction runs with the context's lock held, from
 * the progress thread or from a thread posting or waiting.
 */
#ifndef CHORUS_TRANSPORT_CHAN_H
#define CHORUS_TRANSPORT_CHAN_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"
#include "transport/wire.h"
#include "util/crypto.h"
#include "util/exit.h"
#include "util/log.h"

/* Every live peer hears from us at least this often (a PING when nothing
 * else is sent), so a timeout can tell a silent rank (stopped, hung, its
 * link down) from one that merely waits for someone else. */
#define CHORUS__HEARTBEAT_MS 250

typedef struct chorus__chan chorus__chan_t;

/* A message waiting to be written (or being written) to a peer. */
typedef struct chorus__tx {
  struct chorus__tx *next;
  uint8_t hdr[CHORUS__WIRE_HDR_SIZE];
  const char *payload;
  size_t len;          /* payload bytes */
  size_t off;          /* bytes of hdr+payload written */
  chorus__req_t *req;  /* completed when written; NULL for control */
  chorus__ep_t *ep;    /* owner, for detaching on failure; NULL for control */
  char *owned;         /* payload copy owned by the item */
  /* A message a channel cut into pieces (tcp_io.c) is several
   * items: the whole (its request, its first piece) with pieces = how many
   * of its items are not yet written or lost, itself included, and one item
   * per other piece with whole pointing to it.  The request completes when
   * the last is written; the whole is freed with its last item. */
  struct chorus__tx *whole;
  int pieces;
} chorus__tx_t;

/* A peer's (or a stream's) messages waiting to be written, in order. */
typedef struct chorus__txq {
  chorus__tx_t *head, *tail;
} chorus__txq_t;

/* A message that arrived before its receive was posted. */
typedef struct chorus__unexp {
  struct chorus__unexp *next;
  chorus__wire_hdr_t h;
  int src; /* world rank */
  char *buf;
  size_t got;
  size_t hi;   /* every byte written so far lies below this offset */
  size_t cost; /* charged to the sender's budget (payload + this record) */
  int complete;
  chorus__req_t *req; /* receive waiting for the rest, if any */
} chorus__unexp_t;

/* The parser of one byte stream from a peer. */
typedef struct chorus__rx {
  int src;               /* world rank of the sender */
  chorus__chan_t *chan;  /* the channel reading it (for rx_pause) */
  void *link;            /* the channel's state for this stream */
  uint8_t hbuf[CHORUS__WIRE_HDR_SIZE];
  size_t hgot;           /* header bytes in hbuf */
  int in_payload;
  chorus__wire_hdr_t h;  /* the decoded header of the current message */
  char *dst;             /* where payload bytes go; NULL: discard */
  size_t left;           /* payload bytes still to come */
  chorus__req_t *req;    /* the posted receive they land in, if any */
  chorus__unexp_t *unexp; /* the early-message buffer they land in, if any */
  char *abort;           /* ABORT text being received */
  size_t abort_len;
  int paused;            /* not read: its payload can go nowhere yet */
  int64_t paused_since;
  int pieces_ok;         /* the channel may deliver HEADs here (wire.h: pieces) */
  int dst_fixed;         /* the channel reads dst once per payload (not per
                            chunk): it cannot be moved mid-payload */
  struct chorus__rx *next; /* the peer's other streams */
} chorus__rx_t;

/* What the endpoint layer knows of one world rank, whatever carries its
 * bytes: made when the rank is first touched (chorus__tp_peer), so a rank
 * holds one for the peers it talks with, not for every world rank. */
typedef struct chorus__peer {
  int rank;
  char addr[80]; /* "host:port" of its listener, for messages ("?": not known yet) */
  int dead;
  chorus_result_t dead_code; /* why it died, for endpoints made afterwards */
  char *dead_why;            /* its text (malloc'd: only failed peers hold one) */
  int bye_received;
  int64_t last_heard; /* monotonic ns of the last byte received */
  size_t unexp_bytes; /* its messages buffered before their receive */
  int npaused;        /* its streams paused for back-pressure */
  chorus__rx_t *rxs;  /* its streams (chorus__tp_rx_attach) */
  chorus__chan_t *chan; /* the channel that carries it (NULL: self) */
  void *link;           /* that channel's state for it */
} chorus__peer_t;

/* Why p died, for messages ("" text when it could not be kept). */
static inline const char *chorus__peer_why(const chorus__peer_t *p) {
  return p->dead_why ? p->dead_why : "(its reason was lost: out of memory)";
}

enum { CHORUS__LINK_NONE, CHORUS__LINK_DIALING, CHORUS__LINK_READY };

typedef struct chorus__chan_ops {
  const char *name;
  /* Queues it behind p's other messages and writes what can go now. */
  void (*send)(chorus__chan_t *ch, chorus__peer_t *p, chorus__tx_t *it);
  /* Stops (on) or resumes reading rx's stream. */
  void (*rx_pause)(chorus__chan_t *ch, chorus__rx_t *rx, int on);
  /* Takes ep's sends out of p's queues so their buffers may be freed:
   * unstarted ones are dropped, begun ones keep going from a private copy
   * (the stream must stay well-formed); nothing completes a request of ep
   * any more.  -1 when a stream could not be kept whole (out of memory) or
   * the channel could not take its buffers back in time (UCX: a transfer
   * the peer did not finish); the peer then fails. */
  int (*cancel)(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep);
  /* Whether sends of ep (any owner with NULL, and for NULL also bytes of
   * a sealed record) are still queued to p. */
  int (*pending)(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep);
  /* p failed (chorus__tp_peer_failed): stop watching its streams, make it
   * see the end at once, and hand every queued message back with
   * chorus__tp_tx_lost. */
  void (*close)(chorus__chan_t *ch, chorus__peer_t *p);
  /* Which way the bytes to p go: "tcp LOCAL -> REMOTE (IFACE)". */
  void (*link_desc)(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap);
  /* For channels that connect a pair on its first message (TCP): whether
   * p is connected (CHORUS__LINK_READY: heartbeats flow both ways, silence
   * means something), being connected since *since (DIALING), or neither
   * (NONE: nothing was ever sent either way).  NULL: always READY. */
  int (*link_state)(chorus__chan_t *ch, chorus__peer_t *p, int64_t *since);
  /* Each round of the progress loop, after the events: work no event
   * announces (plaintext opened but not parsed yet).  May be NULL. */
  void (*poll)(chorus__chan_t *ch);
  /* idle: the progress thread is about to sleep (1: the channel must
   * arrange to be woken -- ring a doorbell, arm an event descriptor -- and
   * look once more; non-zero when it could not and the thread must look
   * again at once) or woke (0).  May be NULL.
   * For the local channel, which no descriptor announces (shared memory):
   * progress moves what can move now, returns non-zero if anything did (a
   * waiting thread polls with it before it blocks); polling: a thread
   * starts (1) or stops (0) calling progress, so peers need not wake this
   * rank meanwhile. */
  int (*idle)(chorus__chan_t *ch, int sleeping);
  int (*progress)(chorus__chan_t *ch);
  void (*polling)(chorus__chan_t *ch, int on);
  /* Frees everything, after the progress thread stopped. */
  void (*destroy)(chorus__chan_t *ch);
  /* The process is exiting with the channel open (util/exit.h), the
   * progress thread stopped: stop whatever threads the channel's library
   * runs, freeing nothing the process's end would.  May be NULL. */
  void (*on_exit)(chorus__chan_t *ch);
} chorus__chan_ops_t;

struct chorus__chan {
  const chorus__chan_ops_t *ops;
  chorus__tp_t *tp;
};

/* A file descriptor the progress thread watches: fn(arg, epoll events) runs
 * with the lock held. */
typedef struct chorus__watch {
  void (*fn)(void *arg, uint32_t events);
  void *arg;
} chorus__watch_t;

struct chorus__tp {
  int rank, size;
  chorus__key_t key;
  uint64_t world_id;
  /* Peers, made when first touched (chorus__tp_peer): peers[r] for world
   * rank r, NULL until then (8 bytes per world rank); those made, in rank
   * order, in touched[0 .. ntouched) (what the heartbeats, the silence
   * detector and the goodbyes walk: chorus__tp_peer_next). */
  chorus__peer_t **peers;
  chorus__peer_t **touched;
  int ntouched, cap_touched;
  chorus__chan_t *carrier; /* carries the peers no other channel claimed (TCP): a new peer's */
  /* The listeners of peers not touched yet, from every rank's record
   * (chorus__tp_config_t's addrs), packed: addr_text + addr_off[r]; NULL
   * without them (the host map: each is read when first dialled). */
  char *addr_text;
  uint32_t *addr_off;
  chorus__chan_t *net;   /* the channel between hosts (TCP or UCX) */
  chorus__chan_t *local; /* the channel between ranks of this host (shared memory), or NULL */
  int crowded;           /* fewer CPUs than local ranks: waiting threads poll local
                          * with sched_yield from the start (set by local) */
  int epfd, evfd;
  chorus__watch_t ev_watch;
  pthread_t thread;
  int thread_started;
  int stopping; /* atomic */
  /* The process is exiting with this world alive (util/exit.h): 1 while
   * the exit hook lets the ABORTs it queued go out, 2 once the progress
   * thread stopped (no channel may be called any more: OpenSSL and UCX
   * are being torn down). */
  int exiting;
  chorus__exit_hook_t exit_hook;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  /* The progress thread holds lock while it moves bytes and takes it back
   * right after epoll_wait; a thread that wants it (to post, or woken to
   * see a completion) could lose that race for as long as bytes keep
   * coming.  So such threads say so, and the progress thread steps aside
   * between events while they do (endpoint_progress.c: progress_yield). */
  int lock_wanted; /* atomic: threads in chorus__tp_lock */
  int nsleep;      /* threads asleep on cond in ep_wait (lock held) */
  int kicked;      /* atomic: of those, woken and not yet holding lock */
  chorus__ep_t *eps;
  chorus__unexp_t *unexp_head, *unexp_tail;
  chorus__fp_format_fn fp_format;
  int64_t last_ping;
  int bye_sent;
  size_t budget; /* CHORUS_RECV_BUFFER_MAX */
  int encrypt;   /* CHORUS_ENCRYPT */
  int64_t peer_timeout_ns; /* CHORUS_PEER_TIMEOUT_MS; 0: silence is never death */
  /* A peer's listener when it is first dialled (chorus__tp_config_t). */
  int (*lookup)(void *arg, int rank, char *addr, size_t cap, char *why, size_t whycap);
  void *lookup_arg;
};

/* Takes tp->lock from a thread other than the progress thread. */
static inline void chorus__tp_lock(chorus__tp_t *tp) {
  __atomic_add_fetch(&tp->lock_wanted, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&tp->lock);
  __atomic_sub_fetch(&tp->lock_wanted, 1, __ATOMIC_SEQ_CST);
}

/* ---- for channels (lock held) */

/* rx->hbuf holds a whole header: decode and route it.  Afterwards the
 * stream is paused (rx->paused), or in the payload (rx->in_payload, with
 * rx->dst / rx->left), or -- a zero-length payload or a PING -- done with
 * the message (rx->hgot == 0); the peer may also have failed (protocol
 * violation). */
void chorus__tp_rx_header(chorus__tp_t *tp, chorus__rx_t *rx);
/* n payload bytes of rx's message arrived at rx->dst (or were discarded). */
void chorus__tp_rx_bytes(chorus__tp_t *tp, chorus__rx_t *rx, size_t n);
/* The same for bytes that did not extend a prefix (a piece): every byte
 * written so far lies below end. */
void chorus__tp_rx_bytes_to(chorus__tp_t *tp, chorus__rx_t *rx, size_t n, size_t end);
/* it's bytes are all out: its request completes; it is freed. */
void chorus__tp_tx_done(chorus__tp_t *tp, chorus__tx_t *it);
/* it will never be written (its peer p failed): its endpoint fails; freed. */
void chorus__tp_tx_lost(chorus__tp_t *tp, chorus__peer_t *p, chorus__tx_t *it);
/* Frees a message no request owns any more. */
void chorus__tx_free(chorus__tx_t *it);
/* The queue helpers every channel's send side shares: push at the tail;
 * pop the head (all its bytes are out: its request completes);
 * cancel ep's messages (the ops->cancel contract: the head, begun ones and
 * the items of a message in pieces keep going from a private copy, -1 when
 * one could not be copied); whether ep (NULL: anyone) has messages queued;
 * hand every message back because the peer failed (chorus__tp_tx_lost);
 * free everything (teardown; a message in pieces with its last item). */
void chorus__txq_push(chorus__txq_t *q, chorus__tx_t *it);
void chorus__txq_pop_done(chorus__tp_t *tp, chorus__txq_t *q);
int chorus__txq_cancel(chorus__txq_t *q, const chorus__ep_t *ep);
int chorus__txq_has(const chorus__txq_t *q, const chorus__ep_t *ep);
void chorus__txq_lose(chorus__tp_t *tp, chorus__peer_t *p, chorus__txq_t *q);
void chorus__txq_free(chorus__txq_t *q);
/* The way to p is gone (code REMOTE) or broken (PROTOCOL): every endpoint
 * with p fails unless p said goodbye and nothing is pending with it; the
 * channel's close runs. */
void chorus__tp_peer_failed(chorus__tp_t *tp, chorus__peer_t *p, const char *why,
                            chorus_result_t code);
/* p ended without ever exchanging a byte with this rank (a local peer's
 * process ended, seen by its pidfd): it had nothing to say goodbye for, so
 * it is gone like one that did -- only an endpoint that has something
 * pending with it fails now, and any that posts to it later. */
void chorus__tp_peer_ended_quietly(chorus__tp_t *tp, chorus__peer_t *p, const char *why);
/* p broke the protocol (what: the broken rule): logged, then peer_failed. */
void chorus__tp_protocol_error(chorus__tp_t *tp, chorus__peer_t *p, const char *what);
/* rx is a stream from p, read by ch (link: the channel's state for it);
 * the endpoint layer looks at a peer's streams when it fails, resumes or
 * goes away.  Before anything is parsed. */
void chorus__tp_rx_attach(chorus__tp_t *tp, chorus__peer_t *p, chorus__rx_t *rx,
                          chorus__chan_t *ch, void *link);
/* The message whose payload from starts (routed, nothing of it read) is
 * received through to from now on -- to attached to the same peer, by the
 * channel that reassembles it -- and from waits for its next header.
 * detach: rx (a stream the channel attached) is no longer the peer's. */
void chorus__tp_rx_move(chorus__rx_t *from, chorus__rx_t *to);
void chorus__tp_rx_detach(chorus__peer_t *p, chorus__rx_t *rx);
/* Wakes the threads waiting for requests (after a completion). */
void chorus__tp_wake(chorus__tp_t *tp);
/* Wakes the progress thread (work no descriptor announces). */
void chorus__tp_kick(chorus__tp_t *tp);

/* fd joins the progress thread's set with events (EPOLLIN, EPOLLOUT); mod
 * changes them; unwatch removes it.  0 or -1 with errno. */
int chorus__tp_watch(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w);
int chorus__tp_watch_mod(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w);
void chorus__tp_unwatch(chorus__tp_t *tp, int fd);

/* World rank r's state, made (and its channel the carrier's, unless r is
 * this rank) when it is first touched: a send or an ABORT to it, a
 * connection from it, a channel that claims it.  NULL: out of memory. */
chorus__peer_t *chorus__tp_peer(chorus__tp_t *tp, int r);
/* r's state if it was ever touched.  NULL: it was not -- not dead, not
 * gone, nothing heard from it, nothing queued to it, never connected. */
static inline chorus__peer_t *chorus__tp_peer_if(const chorus__tp_t *tp, int r) {
  return tp->peers[r];
}
/* The touched peer of lowest rank above r (-1: the first), NULL past the
 * last: a walk stays whole when its body touches peers. */
chorus__peer_t *chorus__tp_peer_next(const chorus__tp_t *tp, int r);
#define CHORUS__FOR_PEERS(tp, c) \
  for (chorus__peer_t *c = chorus__tp_peer_next(tp, -1); c; c = chorus__tp_peer_next(tp, c->rank))
/* r's listener "host:port" for messages ("?": not known yet). */
const char *chorus__tp_peer_addr(const chorus__tp_t *tp, int r);
/* The channel that carries r (NULL: r is this rank, or no channel does). */
static inline chorus__chan_t *chorus__tp_chan_of(const chorus__tp_t *tp, int r) {
  const chorus__peer_t *p = tp->peers[r];
  return p ? p->chan : r == tp->rank ? NULL : tp->carrier;
}

/* A context with its peer table and lock but no channel, progress thread or
 * descriptors to watch yet (chorus__tp_create and the fuzzers). */
chorus__tp_t *chorus__tp_alloc(int rank, int size, const chorus__key_t *key, uint64_t world);
void chorus__tp_free(chorus__tp_t *tp);

/* ---- the channels */

/* Shared memory (shm_chan.c): carries every peer whose cfg->host equals
 * this rank's; *out stays NULL when there is none.  Opened first. */
chorus_result_t chorus__shm_chan_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                      chorus__chan_t **out, char *errmsg, size_t errcap);
/* TCP (tcp.c and its tcp_*.c): carries the peers no other channel carries, one connection
 * per pair made when the first message between them is sent, and
 * CHORUS_SOCKET_NSTREAMS more per rank and peer for the pieces of large
 * messages (the listener cfg->listen_fd accepts for as long as the channel
 * lives). */
chorus_result_t chorus__tcp_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap);
/* UCX (ucx*.c): carries the peers no other channel carries, over the
 * worker cfg->ucx (ownership passes, also on failure) to the addresses
 * cfg->ucx_addrs.  Only in a library built with UCX. */
chorus_result_t chorus__ucx_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap);

#endif
