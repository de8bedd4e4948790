/*
 * transport.h - moving tagged messages between the ranks of one job.
 *
 * A transport context (chorus__tp_t) holds the way to every other rank of
 * the world (a channel per peer, chan.h: TCP today), one progress thread,
 * and the matching tables (endpoint_match.c).  Every
 * communicator (world or subgroup) registers an endpoint (chorus__ep_t): its
 * id, its members (world ranks) and its failure state.  Messages carry the
 * endpoint id, so all communicators share the connections.
 *
 * A message is matched to a receive by (endpoint id, source, kind, sequence
 * number and step) for collectives, or by (endpoint id, source, tag) in FIFO
 * order for point-to-point.  A message that arrives before its receive is
 * posted is buffered ("unexpected"), also for endpoints that do not exist yet
 * on this rank (a subgroup created later).
 *
 * Every message header carries the fingerprint of the call that sent it
 * (collective, dtype, op, root, count, algorithm).  The transport compares it
 * with the call this rank is executing at that sequence number (set by
 * chorus__ep_begin) and fails the endpoint on any difference, so mismatched
 * collectives are caught when their first message arrives (the core makes
 * sure every collective sends at least one, see coll.c).
 *
 * Failure model: an endpoint fails on the first error (peer died, timeout,
 * mismatch, protocol violation, abort).  Failing completes all its pending
 * requests with the error, wakes every waiter, and tells the other members
 * (an ABORT message carrying the reason), so every surviving rank learns of
 * it promptly.  A failed endpoint stays failed.
 *
 * Locking: one mutex per context protects every table; waiters sleep on one
 * condition variable that is broadcast on every completion.
 */
#ifndef CHORUS_TRANSPORT_TRANSPORT_H
#define CHORUS_TRANSPORT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"
#include "util/crypto.h"

typedef struct chorus__tp chorus__tp_t;
typedef struct chorus__ep chorus__ep_t;

/* What a call looks like on the wire; equal on every rank for a correct
 * program.  count is 0 for calls whose counts legitimately differ per rank. */
typedef struct chorus__fp {
  uint8_t coll;  /* chorus_coll_t */
  uint8_t dtype; /* chorus_dtype_t */
  uint8_t op;    /* chorus_op_t, 0xff when none */
  uint8_t algo;  /* index in the algorithm registry */
  int32_t root;  /* -1 when none */
  uint64_t count;
} chorus__fp_t;

/* Formats "all_reduce(count=10, float32, sum, algo ring)" into buf.  Lives
 * above the transport (it knows algorithm names); passed in the config. */
typedef void (*chorus__fp_format_fn)(const chorus__fp_t *fp, char *buf, size_t cap);
int chorus__fp_equal(const chorus__fp_t *a, const chorus__fp_t *b);

enum { CHORUS__REQ_SEND = 1, CHORUS__REQ_RECV = 2 };
/* The peer of a point-to-point receive that takes its message from any
 * member: the first message with its tag that arrives (or already did),
 * from whichever member; receives match in the order they were posted,
 * whatever their peer.  Once matched, the request's peer is the sender. */
#define CHORUS__ANY_PEER (-1)
enum { CHORUS__KIND_COLL = 1, CHORUS__KIND_P2P = 2 };

/* One posted send or receive.  Owned by the caller (usually on its stack);
 * must stay alive until chorus__tp_wait() returned for it.  After a wait that
 * failed, requests are inert and may be discarded. */
typedef struct chorus__req {
  int type;         /* CHORUS__REQ_SEND / RECV */
  int peer;         /* rank in the endpoint's group, or CHORUS__ANY_PEER */
  int kind;         /* CHORUS__KIND_COLL / P2P */
  uint32_t step;    /* collective step number, or 0 */
  int32_t tag;      /* p2p tag, or -1 */
  void *buf;        /* data to send / where to receive */
  size_t len;       /* bytes; a receive requires exactly this many */
  chorus__fp_t fp;  /* p2p only: the call's description (sent / expected) */
  /* Internal state. */
  int done;
  int posted;
  chorus__ep_t *ep;
  uint64_t seq;
  size_t sent;      /* bytes of header+payload written (sends) */
  /* Receives: got bytes from the start of buf have landed (a prefix; it
   * may lag behind when pieces arrive out of order, never lead).  A wait
   * counts the receive as done once got >= until (chorus__ep_wait_prefix). */
  size_t got, until;
  struct chorus__req *next;
} chorus__req_t;

typedef struct chorus__tp_config {
  int rank, size;           /* world rank and size */
  const chorus__key_t *key; /* the job key (util/crypto.h) */
  uint64_t world_id;        /* random id every rank of this world agreed on */
  int listen_fd;            /* already listening socket (ownership passes) */
  /* "host port" of every rank's listener; NULL: lookup finds each when
   * this rank first dials it. */
  const char *const *addrs;
  int (*lookup)(void *arg, int rank, char *addr, size_t cap, char *why, size_t whycap);
  void *lookup_arg;
  int64_t deadline;         /* for opening the channels; what is left of it
                             * (at least 10 s) bounds each later dial */
  int retry_ms;
  chorus__fp_format_fn fp_format;
  /* Per world rank: its host (ranks with equal values share memory; NULL:
   * every peer over TCP). */
  const uint64_t *host;
  /* With host: this rank's shared-memory doorbell, bound before its
   * record went out (chorus__shm_bell_bind), so that a doorbell missing
   * later is a rank that ended; ownership passes.  -1: none yet. */
  int bell_fd;
  /* With CHORUS_TRANSPORT=ucx: this rank's UCX worker (chorus__ucx_worker_new;
   * tp_create owns it, also when it fails) and every rank's worker address
   * as it published it (hex).  UCX then carries the peers of other hosts
   * instead of TCP. */
  struct chorus__ucx_worker *ucx;
  const char *const *ucx_addrs;
} chorus__tp_config_t;

/* The abstract datagram socket a local peer hands its shared-memory inbox
 * to, bound for (world, rank) under the job key: a descriptor, or -errno
 * (shm_chan.c). */
int chorus__shm_bell_bind(const chorus__key_t *key, uint64_t world, int rank);

/* UCX (ucx.c): whether this library was built with it; a worker made
 * before the ranks exchange addresses, and its address in hex to publish
 * (free it) -- with need_rdma, only when UCX can use an RDMA transport
 * (CHORUS_ERR_NOT_SUPPORTED otherwise); freeing one that tp_create did not
 * take. */
typedef struct chorus__ucx_worker chorus__ucx_worker_t;
#define CHORUS__UCX_ADDR_MAX 16384
int chorus__ucx_built(void);
chorus_result_t chorus__ucx_worker_new(chorus__ucx_worker_t **out, char **addr_hex, int need_rdma,
                                       char *errmsg, size_t errcap);
void chorus__ucx_worker_free(chorus__ucx_worker_t *w);
/* RDMA devices (InfiniBand, RoCE) with an active port under dir (normally
 * /sys/class/infiniband): how many, their names comma-separated in names. */
int chorus__rdma_active(const char *dir, char *names, size_t cap);
/* Whether a world uses UCX between hosts, from every rank's published UCX
 * field: "U<address>" (CHORUS_TRANSPORT=ucx), "A<address>" (auto, and
 * this rank has an active RDMA device), "-" (neither).  1: every rank has
 * an address; 0: TCP (no rank forced UCX); -1: a rank forced it and rank
 * *bad has none (an error on every rank).  *bad: the first rank without. */
int chorus__ucx_decide(const char *const *fields, int n, int *bad);

/* Opens the channels (shared-memory inboxes with the ranks of this host;
 * TCP for the rest, each pair connected and authenticated with the job key
 * when its first message goes) and starts the progress thread.  On failure
 * errmsg receives a reason. */
chorus_result_t chorus__tp_create(const chorus__tp_config_t *cfg, chorus__tp_t **tp,
                                  char *errmsg, size_t errcap);

/* Says goodbye to every live peer, waits until every peer said goodbye (or
 * died, or bye_deadline passed), then stops the progress thread, closes the
 * connections and frees everything.  Endpoints must be destroyed first. */
void chorus__tp_destroy(chorus__tp_t *tp, int64_t bye_deadline);

/* Registers an endpoint: id must be unique within the world and agreed by
 * every member; members[i] is the world rank of group rank i; my_rank is this
 * process's group rank.  Never blocks on peers. */
chorus_result_t chorus__ep_create(chorus__tp_t *tp, uint64_t id, const int *members,
                                  int nmembers, int my_rank, chorus__ep_t **ep);
void chorus__ep_destroy(chorus__ep_t *ep);

/* Marks the start and end of collective number seq (1, 2, ...) described by
 * fp.  begin checks messages that already arrived for seq. */
chorus_result_t chorus__ep_begin(chorus__ep_t *ep, uint64_t seq, const chorus__fp_t *fp);
void chorus__ep_end(chorus__ep_t *ep, uint64_t seq);

/* Posts a request for the current collective (seq given to begin) or a p2p
 * message.  Returns at once; fails if the endpoint already failed. */
chorus_result_t chorus__ep_post(chorus__ep_t *ep, chorus__req_t *req);

/* Waits until every request completed, the endpoint failed, or timeout_ms
 * passed without all of them completing (which fails the endpoint with a
 * timeout naming the ranks still being waited for). */
chorus_result_t chorus__ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                int timeout_ms);

/* Same, but when timeout_ms passes it returns CHORUS_INPROGRESS and leaves
 * the endpoint alone (for polling a work handle; timeout_ms >= 0). */
chorus_result_t chorus__ep_wait_soft(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                     int timeout_ms);

/* Waits until the first want bytes of receive req have landed (or all of
 * it did), as chorus__ep_wait: a caller consumes a large message in pieces
 * while the rest arrives. */
chorus_result_t chorus__ep_wait_prefix(chorus__ep_t *ep, chorus__req_t *req, size_t want,
                                       int timeout_ms);

/* chorus__ep_wait with an absolute deadline (CLOCK_MONOTONIC ns, possibly
 * past already); timeout_ms is the communicator's timeout the deadline was
 * derived from, for the message. */
chorus_result_t chorus__ep_wait_until(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                      int64_t deadline, int timeout_ms);

/* Fails the endpoint (first failure wins): records code and message, fails
 * pending requests, wakes waiters and, if notify_peers, sends ABORT with the
 * message to every member.  Safe from any thread. */
void chorus__ep_fail(chorus__ep_t *ep, chorus_result_t code, int notify_peers,
                     const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* CHORUS_OK or the endpoint's failure; msg (may be NULL) receives the text. */
chorus_result_t chorus__ep_status(chorus__ep_t *ep, char *msg, size_t cap);

/* What this rank is doing, for failure messages: the current collective,
 * e.g. "all_reduce(count=10, float32, sum, algo ring) (call #3)" (formatted
 * only when a message needs it), or point-to-point communication. */
void chorus__ep_doing(chorus__ep_t *ep, char *buf, size_t cap);

/* Group rank g of ep for messages: "rank g" in a world endpoint, "rank g
 * (world rank w)" in a subgroup, so a message never seems to name a
 * healthy world rank.  Returns what snprintf returns. */
int chorus__ep_rank_desc(const chorus__ep_t *ep, int g, char *buf, size_t cap);

/* Non-zero once the endpoint failed; no lock, for polling loops. */
int chorus__ep_failed(chorus__ep_t *ep);

/* Fails ep with CHORUS_ERR_TIMEOUT after timeout_ms; who says what this
 * rank waited for ("waiting for rank 2 ..."); members whose heartbeats
 * stopped are named in the message. */
void chorus__ep_fail_timeout(chorus__ep_t *ep, int timeout_ms, const char *who);

/* Non-zero if group rank peer left (goodbye or connection gone). */
int chorus__ep_peer_gone(chorus__ep_t *ep, int peer);

/* What the transport knows of world rank w: its connection is gone (dead
 * or said goodbye), it has sent nothing -- not even a heartbeat -- for four
 * heartbeat periods (stopped, hung, or its link is down), or it is alive. */
enum { CHORUS__PEER_ALIVE = 0, CHORUS__PEER_GONE = 1, CHORUS__PEER_SILENT = 2 };
int chorus__tp_peer_state(chorus__tp_t *tp, int w);

/* "tcp LOCAL -> REMOTE (IFACE)" for world rank w's connection (see
 * chorus_comm_link), "tcp (connection gone)", or "self". */
void chorus__tp_link_desc(chorus__tp_t *tp, int w, char *buf, size_t cap);

/* If group rank peer left (goodbye or connection gone), fails ep saying that
 * this rank still needs it (need: "waits for its data"); returns the
 * endpoint's status. */
chorus_result_t chorus__ep_check_peer(chorus__ep_t *ep, int peer, const char *need);

/* fn(arg) runs (with the transport lock held: it must not block or call
 * back into the transport) right after the endpoint fails and whenever a
 * member leaves, from whichever thread noticed.  Used to wake shared-memory
 * waiters.  NULL removes it. */
void chorus__ep_set_fail_hook(chorus__ep_t *ep, void (*fn)(void *), void *arg);

/* For the fuzzers (fuzz/) only: a transport without connections or progress
 * thread whose receive path is fed by chorus__tp_fuzz_feed: the bytes are
 * written to a socket pair (its other end returned in *wfd, created on the
 * first call for that peer and stream; the caller closes it) and parsed as
 * bytes from world rank peer on that connection of the pair (0: the main
 * one, i: the peer's piece connection i - 1), then the progress round's
 * poll runs.  Returns -1 once that connection is dead (a protocol
 * violation).  chorus__tp_fuzz_pieces gives the peer k piece connections
 * to this rank (as their handshakes would; before they are first fed).  chorus__tp_fuzz_handshake runs
 * the acceptor's check of a connect message and its decision given the
 * pairs' states (returns the peer's rank or a negative HS_DENY reason). */
chorus__tp_t *chorus__tp_fuzz_new(int rank, int size, const chorus__key_t *key, uint64_t world);
void chorus__tp_set_fp_format(chorus__tp_t *tp, chorus__fp_format_fn fn);
int chorus__tp_fuzz_feed(chorus__tp_t *tp, int peer, int stream, const void *data, size_t n,
                         int *wfd);
int chorus__tp_fuzz_pieces(chorus__tp_t *tp, int peer, int k);
int chorus__tp_fuzz_handshake(chorus__tp_t *tp, const void *msg, size_t n);
/* Makes the connection from world rank peer (> this rank, before it is first
 * fed) encrypted as with CHORUS_ENCRYPT=1, with keys from all-zero nonces;
 * returns the peer's sealing state (free with chorus__aead_free), which
 * chorus__tp_fuzz_seal uses to turn up to 128 KiB of stream into one record
 * in out (room for n + 20 bytes); returns the record's size. */
chorus__aead_t *chorus__tp_fuzz_encrypt(chorus__tp_t *tp, int peer);
size_t chorus__tp_fuzz_seal(chorus__aead_t *sealer, const void *in, size_t n, uint8_t *out);
void chorus__tp_fuzz_free(chorus__tp_t *tp);

#endif
