/*
 * tcp.c - the TCP transport: a full mesh of authenticated connections, one
 * epoll progress thread, matching of messages to receives, and the failure
 * machinery described in transport.h.
 *
 * Wire format of every message: a 56-byte header followed by `len` payload
 * bytes.  The header's layout, its encoding and the checks that need nothing
 * but the header are in wire.h / wire.c.
 *
 * Sends are written zero-copy from the caller's buffer: the calling thread
 * writes what the socket accepts right away, the progress thread writes the
 * rest when the socket becomes writable.  Receives land directly in the
 * posted buffer when the receive was posted first, otherwise in a malloc'd
 * "unexpected" buffer that the receive copies from later.
 *
 * Every received header is validated before anything is done with it: the
 * magic, the type, the length (bounded), the kind and fingerprint ranges
 * (chorus__wire_check), then the endpoint membership of the sender, the
 * sequence number (not from the past) and the fingerprint.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/transport.h"
#include "transport/wire.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/crypto.h"
#include "util/util.h"

/* Short names for wire.h's header constants. */
#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
#define MSG_MAGIC CHORUS__WIRE_MAGIC
#define MAX_ABORT_TEXT CHORUS__WIRE_MAX_ABORT_TEXT
enum {
  T_DATA = CHORUS__WIRE_DATA,
  T_ABORT = CHORUS__WIRE_ABORT,
  T_BYE = CHORUS__WIRE_BYE,
  T_PING = CHORUS__WIRE_PING
};
typedef chorus__wire_hdr_t hdr_t;

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

/* Every live connection carries a heartbeat at least this often, so a
 * timeout can tell a silent (stopped, hung) rank from one that is merely
 * waiting for someone else. */
#define HEARTBEAT_MS 250

/* A message waiting to be written (or being written) on a connection. */
typedef struct txitem {
  struct txitem *next;
  uint8_t hdr[HDR_SIZE];
  const char *payload;
  size_t len; /* payload bytes */
  size_t off; /* bytes of hdr+payload written */
  chorus__req_t *req; /* completed when written; NULL for control */
  chorus__ep_t *ep;   /* owner, for detaching on failure; NULL for control */
  char *owned;        /* payload copy owned by the item */
} txitem_t;

/* A message that arrived before its receive was posted. */
typedef struct unexp {
  struct unexp *next;
  hdr_t h;
  int src; /* world rank */
  char *buf;
  size_t got;
  size_t cost; /* charged to the sender's budget (payload + this record) */
  int complete;
  chorus__req_t *req; /* receive waiting for the rest, if any */
} unexp_t;

typedef struct conn {
  int fd;
  int rank; /* world rank of the peer */
  char addr[80];
  int dead;
  chorus_result_t dead_code; /* why it died, for endpoints made afterwards */
  char dead_why[160];
  int bye_received;
  int64_t last_heard; /* monotonic ns of the last byte received */
  int epoll_out;
  /* Receive state. */
  uint8_t hbuf[HDR_SIZE];
  size_t hgot;
  int in_payload;
  hdr_t h;
  char *dst;       /* NULL: discard */
  size_t left;
  chorus__req_t *rx_req;
  unexp_t *rx_unexp;
  char *rx_abort;  /* ABORT text being received */
  size_t rx_abort_len;
  /* Back-pressure: bytes of this peer's messages buffered before their
   * receive was posted.  A message that would take it past tp->budget
   * stays in the socket (paused: its header is read, nothing more) until
   * a receive for it is posted or buffered messages are taken; the
   * kernel's flow control then slows the sender. */
  size_t unexp_bytes;
  int paused;
  int64_t paused_since;
  /* Encryption (NULL when off): the directions' ciphers, the record being
   * written (tx_rec[tx_off..tx_len)) and the record being read
   * (rx_got bytes so far; once opened, plaintext at rx_rec + 4 + rx_poff,
   * rx_pleft bytes of it not yet parsed). */
  chorus__aead_t *tx_aead, *rx_aead;
  uint8_t *tx_rec, *rx_rec;
  size_t tx_len, tx_off, rx_got, rx_poff, rx_pleft;
  uint8_t keys[64]; /* from the handshake: connector->acceptor, acceptor->connector */
  /* Send queue. */
  txitem_t *tx_head, *tx_tail;
} conn_t;

struct chorus__ep {
  chorus__tp_t *tp;
  struct chorus__ep *next;
  uint64_t id;
  int n, me;
  int *members;  /* group rank -> world rank */
  int *w2g;      /* world rank -> group rank, -1 if not a member */
  uint64_t cur_seq, done_seq;
  int in_coll;
  chorus__fp_t cur_fp;
  chorus_result_t status;
  char msg[1024];
  char name[256]; /* ep_doing's text for the current call, formatted on first use */
  chorus__req_t *recvs; /* posted, unmatched receives (FIFO) */
  int failed;           /* atomic copy of status != OK, read without the lock */
  void (*fail_hook)(void *);
  void *fail_arg;
};

struct chorus__tp {
  int rank, size;
  chorus__key_t key;
  uint64_t world_id;
  conn_t *conns; /* indexed by world rank; conns[rank] unused */
  int epfd, evfd;
  pthread_t thread;
  int thread_started;
  int stopping; /* atomic */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  chorus__ep_t *eps;
  unexp_t *unexp_head, *unexp_tail;
  chorus__fp_format_fn fp_format;
  int64_t last_ping;
  int bye_sent;
  size_t budget; /* CHORUS_RECV_BUFFER_MAX */
  int encrypt;   /* CHORUS_ENCRYPT */
  int64_t peer_timeout_ns; /* CHORUS_PEER_TIMEOUT_MS; 0: silence is never death */
  chorus__ratelimit_t reject_log; /* strangers turned away (accept_all) */
  char discard[DISCARD_BUF];
};

/* ------------------------------------------------------------ encoding */

/* The message header is encoded by wire.c; the handshake below writes its
 * fields with util/le.h. */

int chorus__fp_equal(const chorus__fp_t *a, const chorus__fp_t *b) {
  return a->coll == b->coll && a->dtype == b->dtype && a->op == b->op &&
         a->algo == b->algo && a->root == b->root && a->count == b->count;
}

/* ----------------------------------------------------------- failures */

static void wake_all(chorus__tp_t *tp) { pthread_cond_broadcast(&tp->cond); }

static void queue_tx(chorus__tp_t *tp, conn_t *c, txitem_t *it);
static void resume_all(chorus__tp_t *tp);
static void conn_dead_locked(chorus__tp_t *tp, conn_t *c, const char *why);
static void conn_fail_locked(chorus__tp_t *tp, conn_t *c, const char *why, chorus_result_t code);

/* tag: for T_ABORT the code the sender failed with (abort_code), else -1. */
static void send_control(chorus__tp_t *tp, conn_t *c, int type, uint64_t ep_id,
                         const char *text, int32_t tag) {
  if (c->dead || c->fd < 0) return;
  txitem_t *it = calloc(1, sizeof *it);
  if (!it) return;
  size_t len = text ? strlen(text) : 0;
  if (len > MAX_ABORT_TEXT) len = MAX_ABORT_TEXT;
  if (len) {
    it->owned = malloc(len);
    if (!it->owned) {
      free(it);
      return;
    }
    memcpy(it->owned, text, len);
  }
  hdr_t h = {.magic = MSG_MAGIC, .type = (uint16_t)type, .ep_id = ep_id, .tag = tag, .len = len};
  h.fp.root = -1;
  chorus__wire_encode(&h, it->hdr);
  it->payload = it->owned;
  it->len = len;
  queue_tx(tp, c, it);
}

/* Removes every trace of ep's requests from the connections' queues so the
 * callers may free them: unstarted sends are dropped, half-written ones get a
 * private copy of their remaining bytes (the stream must stay well-formed),
 * receives in flight are switched to discard. */
static void detach_requests(chorus__tp_t *tp, chorus__ep_t *ep) {
  for (int r = 0; r < tp->size; r++) {
    conn_t *c = &tp->conns[r];
    if (r == tp->rank) continue;
    int lost = 0;
    txitem_t **pp = &c->tx_head, *prev = NULL;
    while (*pp) {
      txitem_t *it = *pp;
      if (it->ep == ep && it->req) {
        if (it->off == 0 && it != c->tx_head) {
          *pp = it->next;
          if (c->tx_tail == it) c->tx_tail = prev;
          free(it->owned);
          free(it);
          continue;
        }
        /* Started (or first in line, which the writer may be using): keep it,
         * but own the payload. */
        if (!it->owned && it->len) {
          it->owned = malloc(it->len);
          if (it->owned) {
            memcpy(it->owned, it->payload, it->len);
            it->payload = it->owned;
          } else {
            lost = 1; /* cannot keep the stream consistent */
          }
        }
        it->req = NULL;
        it->ep = NULL;
      }
      prev = it;
      pp = &it->next;
    }
    if (c->rx_req && c->rx_req->ep == ep) {
      c->rx_req = NULL;
      c->dst = NULL; /* discard the rest of this payload */
    }
    if (lost) conn_dead_locked(tp, c, "could not be kept consistent (out of memory)");
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
static chorus_result_t abort_code(int32_t tag) {
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
  detach_requests(ep->tp, ep);
  resume_all(ep->tp); /* held-back messages for it are discarded now */
  if (notify) {
    for (int g = 0; g < ep->n; g++) {
      if (g == ep->me) continue;
      send_control(ep->tp, &ep->tp->conns[ep->members[g]], T_ABORT, ep->id, ep->msg,
                   (int32_t)ep->status);
    }
  }
  wake_all(ep->tp);
}

static void ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
                           ...) __attribute__((format(printf, 4, 5)));
static void ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
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
static void peer_desc(chorus__ep_t *ep, int world, char *buf, size_t cap) {
  int g = ep->w2g[world];
  if (g == world && ep->n == ep->tp->size)
    snprintf(buf, cap, "rank %d (%s)", g, ep->tp->conns[world].addr);
  else
    snprintf(buf, cap, "rank %d (world rank %d, %s)", g, world, ep->tp->conns[world].addr);
}

/* What ep is doing, for failure messages (lock held).  The current
 * collective is formatted here, when a message needs it, not when it
 * starts: formatting every call would cost more than a small collective. */
static const char *ep_doing(chorus__ep_t *ep) {
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
  snprintf(buf, cap, "%s", ep_doing(ep));
  pthread_mutex_unlock(&ep->tp->lock);
}

int chorus__ep_failed(chorus__ep_t *ep) { return __atomic_load_n(&ep->failed, __ATOMIC_SEQ_CST); }

void chorus__ep_set_fail_hook(chorus__ep_t *ep, void (*fn)(void *), void *arg) {
  pthread_mutex_lock(&ep->tp->lock);
  ep->fail_hook = fn;
  ep->fail_arg = arg;
  pthread_mutex_unlock(&ep->tp->lock);
}

/* Fails ep because peer c left (said goodbye, or its connection is gone)
 * while ep still needs it; need says how ("waits for its data"). */
static void fail_peer_left(chorus__ep_t *ep, conn_t *c, const char *need) {
  char pd[160];
  peer_desc(ep, c->rank, pd, sizeof pd);
  ep_fail_locked(ep, CHORUS_ERR_REMOTE, 1, "chorus rank %d/%d: %s %s, but %s %s", ep->me, ep->n,
                 pd, c->bye_received ? "destroyed its communicator" : "is gone (its connection closed)",
                 ep_doing(ep), need);
}

/* Fails ep with a timeout: who says what this rank waited for; the members
 * that stopped talking altogether (no heartbeat) are named as culprits,
 * since the ranks we wait for may just be waiting for them. */
static void ep_fail_timeout_locked(chorus__ep_t *ep, int timeout_ms, const char *who) {
  chorus__tp_t *tp = ep->tp;
  char silent[512];
  size_t so = 0;
  silent[0] = '\0';
  int64_t now = chorus__now_ns();
  for (int g = 0; g < ep->n && so < sizeof silent; g++) {
    conn_t *pc = &tp->conns[ep->members[g]];
    if (g == ep->me || pc->dead) continue;
    int64_t quiet_ms = (now - pc->last_heard) / 1000000;
    if (pc->paused) {
      char rd[64];
      chorus__ep_rank_desc(ep, g, rd, sizeof rd);
      so += (size_t)snprintf(silent + so, sizeof silent - so,
                             "%sthis rank stopped reading from %s %lld ms ago: %zu bytes of its "
                             "messages wait for receives, which is CHORUS_RECV_BUFFER_MAX (%zu); "
                             "the ranks receive in an order that needs more buffering",
                             so ? ", " : "", rd,
                             (long long)((now - pc->paused_since) / 1000000), pc->unexp_bytes,
                             tp->budget);
    } else if (quiet_ms > 4 * HEARTBEAT_MS) {
      char rd[64];
      chorus__ep_rank_desc(ep, g, rd, sizeof rd);
      so += (size_t)snprintf(silent + so, sizeof silent - so, "%s%s (silent for %lld ms)",
                             so ? ", " : "", rd, (long long)quiet_ms);
    }
  }
  ep_fail_locked(ep, CHORUS_ERR_TIMEOUT, 1, "chorus rank %d/%d: %s timed out after %d ms %s; %s%s%s",
                 ep->me, ep->n, ep_doing(ep), timeout_ms, who,
                 so ? "not responding at all: " : "",
                 so ? silent : "no rank is silent, so a rank is slow or stuck in user code",
                 so ? " (stopped, hung or overloaded; raise CHORUS_TIMEOUT if merely slow)"
                    : " (raise CHORUS_TIMEOUT if it is just slow)");
}

void chorus__ep_fail_timeout(chorus__ep_t *ep, int timeout_ms, const char *who) {
  pthread_mutex_lock(&ep->tp->lock);
  ep_fail_timeout_locked(ep, timeout_ms, who);
  pthread_mutex_unlock(&ep->tp->lock);
}

int chorus__ep_peer_gone(chorus__ep_t *ep, int peer) {
  chorus__tp_t *tp = ep->tp;
  if (peer < 0 || peer >= ep->n || peer == ep->me) return 0;
  pthread_mutex_lock(&tp->lock);
  conn_t *c = &tp->conns[ep->members[peer]];
  int gone = c->dead || c->bye_received;
  pthread_mutex_unlock(&tp->lock);
  return gone;
}

int chorus__tp_peer_state(chorus__tp_t *tp, int w) {
  if (w < 0 || w >= tp->size || w == tp->rank) return CHORUS__PEER_ALIVE;
  pthread_mutex_lock(&tp->lock);
  conn_t *c = &tp->conns[w];
  int state = c->dead || c->bye_received ? CHORUS__PEER_GONE
              : chorus__now_ns() - c->last_heard > (int64_t)4 * HEARTBEAT_MS * 1000000
                  ? CHORUS__PEER_SILENT
                  : CHORUS__PEER_ALIVE;
  pthread_mutex_unlock(&tp->lock);
  return state;
}

void chorus__tp_link_desc(chorus__tp_t *tp, int w, char *buf, size_t cap) {
  if (w == tp->rank) {
    snprintf(buf, cap, "self");
    return;
  }
  pthread_mutex_lock(&tp->lock);
  int fd = w >= 0 && w < tp->size && !tp->conns[w].dead ? tp->conns[w].fd : -1;
  char local[80] = "?", remote[80] = "?", ifname[64] = "?";
  int lport = 0, rport = 0;
  if (fd >= 0) {
    chorus__net_local_addr(fd, local, sizeof local, &lport);
    chorus__net_peer_addr(fd, remote, sizeof remote, &rport);
  }
  pthread_mutex_unlock(&tp->lock);
  if (fd < 0) {
    snprintf(buf, cap, "tcp (connection gone)");
    return;
  }
  chorus__net_addr_ifname(local, ifname, sizeof ifname);
  snprintf(buf, cap, "tcp %s:%d -> %s:%d (%s)", local, lport, remote, rport, ifname);
}

chorus_result_t chorus__ep_check_peer(chorus__ep_t *ep, int peer, const char *need) {
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  if (ep->status == CHORUS_OK && peer >= 0 && peer < ep->n && peer != ep->me) {
    conn_t *c = &tp->conns[ep->members[peer]];
    if (c->dead || c->bye_received) fail_peer_left(ep, c, need);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* Wakes the shared-memory waiters of every endpoint containing world rank
 * w (it left: they must re-check whether what they wait for can come). */
static void wake_hooks_of(chorus__tp_t *tp, int w) {
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    if (ep->w2g[w] >= 0 && ep->fail_hook) ep->fail_hook(ep->fail_arg);
}

/* A peer's connection ended.  Members of every endpoint containing it fail,
 * unless it said goodbye first and nothing is pending with it. */
static void conn_dead_locked(chorus__tp_t *tp, conn_t *c, const char *why) {
  conn_fail_locked(tp, c, why, CHORUS_ERR_REMOTE);
}

/* The same with the code the endpoints fail with: CHORUS_ERR_PROTOCOL when
 * the peer (or something on the wire) broke the protocol. */
static void conn_fail_locked(chorus__tp_t *tp, conn_t *c, const char *why, chorus_result_t code) {
  if (c->dead) return;
  c->dead = 1;
  c->dead_code = code;
  snprintf(c->dead_why, sizeof c->dead_why, "%s", why);
  if (c->fd >= 0) {
    epoll_ctl(tp->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    /* The peer must see EOF now, not at its timeout; the fd number itself
     * stays reserved until tp_free so it cannot be reused meanwhile. */
    shutdown(c->fd, SHUT_RDWR);
  }
  int clean = c->bye_received && !c->in_payload && c->hgot == 0;
  wake_hooks_of(tp, c->rank);
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next) {
    int g = ep->w2g[c->rank];
    if (g < 0 || ep->status != CHORUS_OK) continue;
    int pending = 0;
    for (chorus__req_t *r = ep->recvs; r; r = r->next)
      if (r->peer == g) pending = 1;
    for (txitem_t *it = c->tx_head; it; it = it->next)
      if (it->ep == ep) pending = 1;
    if (clean && !pending) continue;
    if (clean) {
      fail_peer_left(ep, c, "still exchanges data with it");
      continue;
    }
    char pd[160];
    peer_desc(ep, c->rank, pd, sizeof pd);
    if (code == CHORUS_ERR_PROTOCOL)
      ep_fail_locked(ep, code, 1, "chorus rank %d/%d: the connection with %s failed during %s: "
                     "%s; every other rank fails too", ep->me, ep->n, pd, ep_doing(ep), why);
    else
      ep_fail_locked(ep, code, 1,
                     "chorus rank %d/%d: %s %s during %s; the process probably died "
                     "(check its output); every other rank fails too",
                     ep->me, ep->n, pd, why, ep_doing(ep));
  }
  /* Sends queued to a dead peer can never complete. */
  while (c->tx_head) {
    txitem_t *it = c->tx_head;
    c->tx_head = it->next;
    if (it->req && it->ep && it->ep->status == CHORUS_OK)
      ep_fail_locked(it->ep, CHORUS_ERR_REMOTE, 0, "chorus: send to world rank %d failed: %s",
                     c->rank, why);
    free(it->owned);
    free(it);
  }
  c->tx_tail = NULL;
  wake_all(tp);
}

/* ------------------------------------------------------------ sending */

/* The events c waits for: input unless paused, output while its queue is
 * blocked. */
static int update_events(chorus__tp_t *tp, conn_t *c, int paused, int out) {
  struct epoll_event ev = {.events = (paused ? 0u : (uint32_t)EPOLLIN) | (out ? (uint32_t)EPOLLOUT : 0u),
                           .data.u32 = (uint32_t)c->rank};
  return epoll_ctl(tp->epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

static void set_epoll_out(chorus__tp_t *tp, conn_t *c, int on) {
  if (c->epoll_out == on || c->dead) return;
  if (update_events(tp, c, c->paused, on) == 0) c->epoll_out = on;
}

/* Takes an item off the head of c's queue once all its bytes are out (or
 * sealed in a record): its request is complete, the caller may reuse the
 * buffer. */
static void tx_item_done(chorus__tp_t *tp, conn_t *c, txitem_t *it) {
  c->tx_head = it->next;
  if (!c->tx_head) c->tx_tail = NULL;
  if (it->req) {
    it->req->done = 1;
    wake_all(tp);
  }
  free(it->owned);
  free(it);
}

/* Seals the next record from the head of the queue into c->tx_rec: as many
 * bytes of as many queued messages as fit in REC_MAX.  0, or -1 after
 * failing the connection. */
static int seal_record(chorus__tp_t *tp, conn_t *c) {
  size_t plen = 0;
  for (txitem_t *it = c->tx_head; it && plen < REC_MAX; it = it->next)
    plen += CHORUS__MIN(REC_MAX - plen, HDR_SIZE + it->len - it->off);
  uint8_t *rec = c->tx_rec, *out = rec + 4;
  chorus__le32_put(rec, (uint32_t)plen);
  int rc = chorus__aead_begin(c->tx_aead, rec, 4);
  size_t left = plen;
  while (rc == 0 && left > 0) {
    txitem_t *it = c->tx_head;
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
    if (it->off == HDR_SIZE + it->len) tx_item_done(tp, c, it);
  }
  if (rc == 0) rc = chorus__aead_seal_end(c->tx_aead, rec + 4 + plen);
  if (rc < 0) {
    conn_fail_locked(tp, c, "encryption failed (libcrypto)", CHORUS_ERR_SYSTEM);
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
static int next_tx(chorus__tp_t *tp, conn_t *c, struct iovec iov[2]) {
  if (c->tx_aead) {
    if (c->tx_off == c->tx_len) {
      if (!c->tx_head) return 0;
      if (seal_record(tp, c) < 0) return -1;
    }
    iov[0].iov_base = c->tx_rec + c->tx_off;
    iov[0].iov_len = c->tx_len - c->tx_off;
    return 1;
  }
  txitem_t *it = c->tx_head;
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
static void flush_tx(chorus__tp_t *tp, conn_t *c) {
  while (!c->dead) {
    struct iovec iov[2];
    int niov = next_tx(tp, c, iov);
    if (niov < 0) return;
    if (niov == 0) {
      set_epoll_out(tp, c, 0);
      wake_all(tp); /* tp_destroy waits for drained queues */
      return;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    ssize_t n = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        set_epoll_out(tp, c, 1);
        return;
      }
      char why[128];
      snprintf(why, sizeof why, "write failed (%s)", strerror(errno));
      conn_dead_locked(tp, c, why);
      return;
    }
    if (c->tx_aead) {
      c->tx_off += (size_t)n;
      continue;
    }
    txitem_t *it = c->tx_head;
    it->off += (size_t)n;
    if (it->off == HDR_SIZE + it->len) tx_item_done(tp, c, it);
  }
}

static void queue_tx(chorus__tp_t *tp, conn_t *c, txitem_t *it) {
  it->next = NULL;
  if (c->tx_tail) c->tx_tail->next = it;
  else c->tx_head = it;
  c->tx_tail = it;
  if (c->tx_head == it) flush_tx(tp, c);
}

/* ---------------------------------------------------------- receiving */

static int req_matches(const chorus__req_t *r, const hdr_t *h, int src_group) {
  if (r->peer != src_group || r->kind != h->kind) return 0;
  if (h->kind == CHORUS__KIND_COLL) return r->seq == h->seq && r->step == h->step;
  return r->tag == h->tag;
}

/* Checks a data header against what ep executes; fails ep and returns -1 if
 * the sender is in a different call. */
static int check_data_header(chorus__ep_t *ep, const hdr_t *h, int src_world) {
  char pd[160], theirs[200], mine[200];
  if (h->kind != CHORUS__KIND_COLL) return 0;
  peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  if (h->seq <= ep->done_seq) {
    ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                   "chorus rank %d/%d: collective mismatch: %s sent data for its collective "
                   "#%" PRIu64 " %s, which this rank already completed without it; the ranks "
                   "called different collectives or with different arguments",
                   ep->me, ep->n, pd, h->seq, theirs);
    return -1;
  }
  if (__atomic_load_n(&ep->in_coll, __ATOMIC_ACQUIRE) && h->seq == ep->cur_seq &&
      !chorus__fp_equal(&h->fp, &ep->cur_fp)) {
    ep->tp->fp_format(&ep->cur_fp, mine, sizeof mine);
    ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                   "chorus rank %d/%d: collective mismatch at call #%" PRIu64 ": %s called %s "
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
  peer_desc(ep, src_world, pd, sizeof pd);
  ep->tp->fp_format(&h->fp, theirs, sizeof theirs);
  ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                 "chorus rank %d/%d: %s sent %" PRIu64 " bytes for %s step %u but this rank "
                 "expected %zu bytes in %s; the ranks passed different counts",
                 ep->me, ep->n, pd, h->len, theirs, h->step, r->len, ep_doing(ep));
  return -1;
}

static chorus__ep_t *find_ep(chorus__tp_t *tp, uint64_t id) {
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    if (ep->id == id) return ep;
  return NULL;
}

static void protocol_error(chorus__tp_t *tp, conn_t *c, const char *what) {
  CHORUS_WARN(CHORUS__SUB_TCP, "chorus: protocol violation from world rank %d (%s): %s; "
              "closing the connection", c->rank, c->addr, what);
  char why[200];
  snprintf(why, sizeof why, "it sent a malformed message (%s)", what);
  conn_fail_locked(tp, c, why, CHORUS_ERR_PROTOCOL);
}

static unexp_t *new_unexp(chorus__tp_t *tp, const hdr_t *h, int src) {
  unexp_t *u = calloc(1, sizeof *u);
  if (!u) return NULL;
  u->h = *h;
  u->src = src;
  u->cost = (size_t)h->len + sizeof *u;
  tp->conns[src].unexp_bytes += u->cost;
  if (h->len) {
    u->buf = malloc(h->len);
    if (!u->buf) {
      tp->conns[src].unexp_bytes -= u->cost;
      free(u);
      return NULL;
    }
  }
  if (tp->unexp_tail) tp->unexp_tail->next = u;
  else tp->unexp_head = u;
  tp->unexp_tail = u;
  return u;
}

static void try_resume(chorus__tp_t *tp, conn_t *c);
static void on_payload_done(chorus__tp_t *tp, conn_t *c);

/* Frees a buffered message (already unlinked) and gives its bytes back to
 * its sender's budget. */
static void free_unexp(chorus__tp_t *tp, unexp_t *u) {
  conn_t *c = &tp->conns[u->src];
  c->unexp_bytes -= u->cost;
  free(u->buf);
  free(u);
  if (c->paused) try_resume(tp, c);
}

/* Whether a message of len bytes from c may be buffered now. */
static int budget_allows(const chorus__tp_t *tp, const conn_t *c, uint64_t len) {
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

/* Where the payload of the data message whose header c holds goes: a posted
 * receive, a new buffer (within the sender's budget), or nowhere (discard).
 * Returns 0 when it can go nowhere yet -- no receive and no budget -- after
 * pausing c; try_resume runs this again.  Every check here may run twice
 * for one message: failing an endpoint that failed already does nothing. */
static int route_data(chorus__tp_t *tp, conn_t *c) {
  hdr_t *h = &c->h;
  c->dst = NULL;
  c->rx_req = NULL;
  c->rx_unexp = NULL;
  if (tp->bye_sent) return 1; /* leaving: nothing will receive it */
  chorus__ep_t *ep = find_ep(tp, h->ep_id);
  if (ep) {
    int g = ep->w2g[c->rank];
    if (g < 0) {
      /* Ranks disagree on who is in this group (new_group with different
       * lists): fail the group, keep the connection. */
      if (ep->status == CHORUS_OK)
        ep_fail_locked(ep, CHORUS_ERR_MISMATCH, 1,
                       "chorus rank %d/%d: world rank %d (%s) sent data for this group but "
                       "is not a member here: the ranks created the group with different "
                       "member lists", ep->me, ep->n, c->rank, c->addr);
      return 1; /* discard */
    }
    if (ep->status != CHORUS_OK) return 1; /* discard */
    if (check_data_header(ep, h, c->rank) < 0) return 1;
    for (chorus__req_t **pp = &ep->recvs; *pp; pp = &(*pp)->next) {
      chorus__req_t *r = *pp;
      if (!req_matches(r, h, g)) continue;
      *pp = r->next;
      if (check_length(ep, r, h, c->rank) < 0) return 1;
      c->rx_req = r;
      c->dst = r->buf;
      return 1;
    }
  }
  if (!budget_allows(tp, c, h->len)) {
    if (!c->paused) {
      c->paused = 1;
      c->paused_since = chorus__now_ns();
      update_events(tp, c, 1, c->epoll_out);
      CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus: pausing world rank %d (%s): %zu bytes of its "
                   "messages wait for receives, the next is %" PRIu64 " bytes (budget %zu)",
                   c->rank, c->addr, c->unexp_bytes, h->len, tp->budget);
    }
    return 0;
  }
  c->rx_unexp = new_unexp(tp, h, c->rank);
  if (!c->rx_unexp) {
    if (ep)
      ep_fail_locked(ep, CHORUS_ERR_NO_MEMORY, 1,
                     "chorus: out of memory buffering a %" PRIu64 "-byte message from "
                     "world rank %d", h->len, c->rank);
    return 1;
  }
  c->dst = c->rx_unexp->buf;
  return 1;
}

/* Runs a paused connection's message through route_data again (a receive
 * was posted, buffered bytes were taken, an endpoint failed or went away,
 * or this rank is leaving); reading resumes if it can go somewhere now. */
static void try_resume(chorus__tp_t *tp, conn_t *c) {
  if (!c->paused || c->dead) return;
  /* Cleared first: route_data may fail an endpoint, which resumes every
   * paused connection -- not this one a second time. */
  c->paused = 0;
  if (!route_data(tp, c)) return; /* paused again */
  c->last_heard = chorus__now_ns(); /* it was not silent, we were not listening */
  update_events(tp, c, 0, c->epoll_out);
  c->in_payload = 1;
  c->left = c->h.len;
  if (c->left == 0) on_payload_done(tp, c);
  /* The progress thread reads the rest: its level-triggered epoll sees the
   * waiting bytes now that EPOLLIN is back; plaintext already opened needs
   * a wake-up. */
  uint64_t one = 1;
  if (c->rx_pleft && tp->evfd >= 0) (void)!write(tp->evfd, &one, sizeof one);
}

static void resume_all(chorus__tp_t *tp) {
  for (int r = 0; r < tp->size; r++)
    if (r != tp->rank && tp->conns[r].paused) try_resume(tp, &tp->conns[r]);
}

/* A complete header arrived on c: decide where its payload goes. */
static void on_header(chorus__tp_t *tp, conn_t *c) {
  hdr_t *h = &c->h;
  chorus__wire_decode(c->hbuf, h);
  c->dst = NULL;
  c->rx_req = NULL;
  c->rx_unexp = NULL;
  c->rx_abort = NULL;
  /* Magic, type, length bounds, kind and fingerprint ranges. */
  const char *bad = chorus__wire_check(h);
  if (bad) return protocol_error(tp, c, bad);
  switch (h->type) {
    case T_PING:
      break;
    case T_BYE:
      c->bye_received = 1;
      /* Nothing more will come from it: receives still waiting for it fail. */
      for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next) {
        int g = ep->w2g[c->rank];
        if (g < 0 || ep->status != CHORUS_OK) continue;
        for (chorus__req_t *r = ep->recvs; r; r = r->next) {
          if (r->peer != g) continue;
          fail_peer_left(ep, c, "waits for its data");
          break;
        }
      }
      wake_hooks_of(tp, c->rank);
      wake_all(tp);
      break;
    case T_ABORT:
      /* At most MAX_ABORT_TEXT bytes (chorus__wire_check); kept for a
       * later endpoint only within the sender's budget (on_payload_done). */
      c->rx_abort = calloc(1, h->len + 1);
      c->rx_abort_len = h->len;
      c->dst = c->rx_abort; /* NULL (out of memory): the text is discarded */
      break;
    case T_DATA:
      if (!route_data(tp, c)) return; /* paused: the payload stays in the socket */
      break;
    default: /* rejected by chorus__wire_check */
      return protocol_error(tp, c, "unknown message type");
  }
  c->in_payload = 1;
  c->left = h->len;
}

static void on_payload_done(chorus__tp_t *tp, conn_t *c) {
  c->in_payload = 0;
  c->hgot = 0;
  if (c->rx_req) {
    c->rx_req->done = 1;
    c->rx_req = NULL;
    wake_all(tp);
  } else if (c->rx_unexp) {
    unexp_t *u = c->rx_unexp;
    c->rx_unexp = NULL;
    u->complete = 1;
    if (u->req) {
      if (u->h.len) memcpy(u->req->buf, u->buf, u->h.len);
      u->req->done = 1;
      unlink_unexp(tp, u);
      free_unexp(tp, u);
      wake_all(tp);
    }
  } else if (c->rx_abort) {
    chorus__ep_t *ep = find_ep(tp, c->h.ep_id);
    if (ep) {
      if (ep->w2g[c->rank] >= 0) {
        /* Forward it: whatever this rank sends later (a goodbye, say) must
         * not reach a peer before the cause does. */
        char rd[64], text[MAX_ABORT_TEXT + 1];
        chorus__ep_rank_desc(ep, ep->w2g[c->rank], rd, sizeof rd);
        /* The peer's text is untrusted: escaped before any log or message. */
        chorus__escape(c->rx_abort, c->rx_abort_len, text, sizeof text);
        ep_fail_locked(ep, abort_code(c->h.tag), 1, "chorus rank %d/%d: %s reported an error: %s",
                       ep->me, ep->n, rd, text);
      }
      free(c->rx_abort);
    } else if (!budget_allows(tp, c, c->h.len)) {
      free(c->rx_abort); /* a flood of records for unknown endpoints */
    } else {
      /* For an endpoint not created yet: keep it; ep_create will see it. */
      unexp_t *u = new_unexp(tp, &c->h, c->rank);
      if (u) {
        free(u->buf);
        u->buf = c->rx_abort;
        u->complete = 1;
      } else {
        free(c->rx_abort);
      }
    }
    c->rx_abort = NULL;
  }
}

/* Reads and opens the next record of an encrypted connection.  1 when its
 * plaintext is ready, 0 at end of stream, -1 with errno set (EAGAIN: the
 * rest has not arrived; EBADMSG: the connection failed, it was altered). */
static int open_record(chorus__tp_t *tp, conn_t *c) {
  uint8_t *rec = c->rx_rec;
  for (;;) {
    size_t need = c->rx_got < 4 ? 4 : REC_OVERHEAD + chorus__le32_get(rec);
    if (c->rx_got == 4 && chorus__le32_get(rec) > REC_MAX) {
      protocol_error(tp, c, "encrypted record longer than the protocol allows");
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
                "authentication; closing the connection", c->rank, c->addr);
    conn_fail_locked(tp, c, "an encrypted record failed authentication: its bytes were changed "
                     "on the way, or do not come from that rank", CHORUS_ERR_PROTOCOL);
    errno = EBADMSG;
    return -1;
  }
  c->rx_poff = 0;
  c->rx_pleft = plen;
  return 1;
}

/* recv() for the parser: from the socket, or from opened records when the
 * connection is encrypted. */
static ssize_t conn_recv(chorus__tp_t *tp, conn_t *c, void *dst, size_t want) {
  if (!c->rx_aead) return recv(c->fd, dst, want, MSG_DONTWAIT);
  while (c->rx_pleft == 0) {
    int rc = open_record(tp, c);
    if (rc <= 0) return rc;
  }
  size_t k = CHORUS__MIN(want, c->rx_pleft);
  memcpy(dst, c->rx_rec + 4 + c->rx_poff, k);
  c->rx_poff += k;
  c->rx_pleft -= k;
  return (ssize_t)k;
}

static void read_conn(chorus__tp_t *tp, conn_t *c) {
  while (!c->dead) {
    ssize_t n;
    if (!c->in_payload) {
      n = conn_recv(tp, c, c->hbuf + c->hgot, HDR_SIZE - c->hgot);
      if (n > 0) c->last_heard = chorus__now_ns();
      if (n > 0) {
        c->hgot += (size_t)n;
        if (c->hgot == HDR_SIZE) {
          on_header(tp, c);
          if (c->paused) return; /* try_resume takes it from here */
          if (c->in_payload && c->left == 0) on_payload_done(tp, c);
        }
        continue;
      }
    } else {
      char *dst = c->dst ? c->dst + (c->h.len - c->left) : tp->discard;
      size_t want = c->dst ? c->left : CHORUS__MIN(c->left, (size_t)DISCARD_BUF);
      n = conn_recv(tp, c, dst, want);
      if (n > 0) {
        c->last_heard = chorus__now_ns();
        c->left -= (size_t)n;
        if (c->rx_unexp) c->rx_unexp->got += (size_t)n;
        if (c->left == 0) on_payload_done(tp, c);
        continue;
      }
    }
    if (c->dead) return; /* a record failed authentication */
    if (n == 0) {
      conn_dead_locked(tp, c, c->in_payload || c->hgot ? "closed its connection in the middle "
                                                        "of a message"
                                                      : "closed its connection");
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    char why[128];
    snprintf(why, sizeof why, "connection failed (%s)", strerror(errno));
    conn_dead_locked(tp, c, why);
    return;
  }
}

/* The failure detector for what closes no connection (a host unplugged or
 * powered off, a process stopped): a peer that sent nothing, not even a
 * heartbeat, for the peer timeout is dead.  A connection we stopped
 * reading (back-pressure) is not silent, we are deaf; nor is one we have
 * not heard since we last listened (try_resume). */
static void check_silence(chorus__tp_t *tp, int64_t now) {
  if (!tp->peer_timeout_ns) return;
  for (int r = 0; r < tp->size; r++) {
    conn_t *c = &tp->conns[r];
    /* A peer that said goodbye stops its heartbeats. */
    if (r == tp->rank || c->dead || c->paused || c->fd < 0 || c->bye_received) continue;
    int64_t quiet = now - c->last_heard;
    if (quiet <= tp->peer_timeout_ns) continue;
    char why[200];
    snprintf(why, sizeof why, "went silent (nothing, not even a heartbeat, for %lld ms, "
             "CHORUS_PEER_TIMEOUT_MS: its host unreachable or the process stopped)",
             (long long)(quiet / 1000000));
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: world rank %d (%s) %s", r, c->addr, why);
    conn_dead_locked(tp, c, why);
  }
}

static void *progress_main(void *arg) {
  chorus__tp_t *tp = arg;
  struct epoll_event evs[64];
  while (!__atomic_load_n(&tp->stopping, __ATOMIC_ACQUIRE)) {
    int n = epoll_wait(tp->epfd, evs, 64, HEARTBEAT_MS / 2);
    if (n < 0) {
      if (errno == EINTR) continue;
      CHORUS_WARN(CHORUS__SUB_TCP, "chorus: epoll_wait failed: %s", strerror(errno));
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
      continue;
    }
    pthread_mutex_lock(&tp->lock);
    for (int i = 0; i < n; i++) {
      uint32_t id = evs[i].data.u32;
      if (id == UINT32_MAX) {
        uint64_t v;
        (void)!read(tp->evfd, &v, sizeof v);
        continue;
      }
      if (id >= (uint32_t)tp->size) continue;
      conn_t *c = &tp->conns[id];
      if (c->dead) continue;
      if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) read_conn(tp, c);
      if (!c->dead && (evs[i].events & EPOLLOUT)) flush_tx(tp, c);
    }
    /* Opened records whose rest was not parsed (the connection was paused;
     * try_resume woke us): no socket event will say so. */
    for (int r = 0; tp->encrypt && r < tp->size; r++) {
      conn_t *c = &tp->conns[r];
      if (r != tp->rank && c->rx_pleft && !c->paused && !c->dead) read_conn(tp, c);
    }
    int64_t now = chorus__now_ns();
    if (now - tp->last_ping >= (int64_t)HEARTBEAT_MS * 1000000) {
      tp->last_ping = now;
      for (int r = 0; r < tp->size; r++) {
        conn_t *c = &tp->conns[r];
        if (r != tp->rank && !c->dead && !c->tx_head && !tp->bye_sent)
          send_control(tp, c, T_PING, 0, NULL, -1);
      }
      check_silence(tp, now);
    }
    pthread_mutex_unlock(&tp->lock);
  }
  return NULL;
}

/* ---------------------------------------------------------- endpoints */

chorus_result_t chorus__ep_create(chorus__tp_t *tp, uint64_t id, const int *members, int n,
                                  int me, chorus__ep_t **out) {
  chorus__ep_t *ep = calloc(1, sizeof *ep);
  if (!ep) return CHORUS_ERR_NO_MEMORY;
  ep->members = malloc(sizeof(int) * (size_t)n);
  ep->w2g = malloc(sizeof(int) * (size_t)tp->size);
  if (!ep->members || !ep->w2g) {
    free(ep->members);
    free(ep->w2g);
    free(ep);
    return CHORUS_ERR_NO_MEMORY;
  }
  for (int w = 0; w < tp->size; w++) ep->w2g[w] = -1;
  for (int g = 0; g < n; g++) {
    ep->members[g] = members[g];
    ep->w2g[members[g]] = g;
  }
  ep->tp = tp;
  ep->id = id;
  ep->n = n;
  ep->me = me;
  ep->status = CHORUS_OK;
  pthread_mutex_lock(&tp->lock);
  if (find_ep(tp, id)) {
    pthread_mutex_unlock(&tp->lock);
    free(ep->members);
    free(ep->w2g);
    free(ep);
    return CHORUS_ERR_INTERNAL;
  }
  ep->next = tp->eps;
  tp->eps = ep;
  /* A member may have died, or reported an error, before we got here. */
  for (int g = 0; g < n; g++) {
    conn_t *c = &tp->conns[members[g]];
    if (g != me && c->dead && !c->bye_received && c->dead_code == CHORUS_ERR_PROTOCOL)
      ep_fail_locked(ep, CHORUS_ERR_PROTOCOL, 0,
                     "chorus rank %d/%d: the connection with rank %d (world rank %d, %s) failed "
                     "earlier: %s", me, n, g, members[g], c->addr, c->dead_why);
    else if (g != me && c->dead && !c->bye_received)
      ep_fail_locked(ep, c->dead_code ? c->dead_code : CHORUS_ERR_REMOTE, 0,
                     "chorus rank %d/%d: rank %d (world rank %d, %s) is gone (its connection "
                     "closed earlier: %s)", me, n, g, members[g], c->addr, c->dead_why);
  }
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type == T_ABORT && u->h.ep_id == id && ep->w2g[u->src] >= 0) {
      char rd[64], text[MAX_ABORT_TEXT + 1];
      chorus__ep_rank_desc(ep, ep->w2g[u->src], rd, sizeof rd);
      chorus__escape(u->buf ? u->buf : "", u->h.len, text, sizeof text);
      ep_fail_locked(ep, abort_code(u->h.tag), 0, "chorus rank %d/%d: %s reported an error: %s",
                     me, n, rd, text);
      break;
    }
  }
  pthread_mutex_unlock(&tp->lock);
  *out = ep;
  return CHORUS_OK;
}

void chorus__ep_destroy(chorus__ep_t *ep) {
  if (!ep) return;
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  detach_requests(tp, ep);
  for (chorus__ep_t **pp = &tp->eps; *pp; pp = &(*pp)->next) {
    if (*pp == ep) {
      *pp = ep->next;
      break;
    }
  }
  /* Messages for it that can no longer be received. */
  unexp_t **pp = &tp->unexp_head, *prev = NULL;
  while (*pp) {
    unexp_t *u = *pp;
    if (u->h.ep_id == ep->id && u->complete) {
      *pp = u->next;
      if (tp->unexp_tail == u) tp->unexp_tail = prev;
      free_unexp(tp, u);
      continue;
    }
    prev = u;
    pp = &u->next;
  }
  resume_all(tp); /* messages for it that wait in sockets are discarded */
  pthread_mutex_unlock(&tp->lock);
  free(ep->members);
  free(ep->w2g);
  free(ep);
}

chorus_result_t chorus__ep_begin(chorus__ep_t *ep, uint64_t seq, const chorus__fp_t *fp) {
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  /* Collectives of an endpoint run one after the other: every earlier
   * one is over (chorus__ep_end leaves this to us, to stay lock-free). */
  if (seq - 1 > ep->done_seq) ep->done_seq = seq - 1;
  __atomic_store_n(&ep->in_coll, 1, __ATOMIC_RELEASE);
  ep->cur_seq = seq;
  ep->cur_fp = *fp;
  ep->name[0] = '\0';
  for (unexp_t *u = tp->unexp_head; u && ep->status == CHORUS_OK; u = u->next) {
    if (u->h.type == T_DATA && u->h.ep_id == ep->id && u->h.kind == CHORUS__KIND_COLL &&
        u->h.seq <= seq)
      check_data_header(ep, &u->h, u->src);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
}

/* No lock: a small collective costs about as much as two lock round
 * trips.  done_seq catches up at the next begin, so a stray message for
 * this call that arrives in between waits in the unexpected list until
 * then and is reported as a mismatch there. */
void chorus__ep_end(chorus__ep_t *ep, uint64_t seq) {
  (void)seq;
  __atomic_store_n(&ep->in_coll, 0, __ATOMIC_RELEASE);
}

chorus_result_t chorus__ep_post(chorus__ep_t *ep, chorus__req_t *req) {
  chorus__tp_t *tp = ep->tp;
  req->done = 0;
  req->ep = ep;
  req->next = NULL;
  if (req->peer < 0 || req->peer >= ep->n || req->peer == ep->me) return CHORUS_ERR_INTERNAL;
  int world = ep->members[req->peer];
  conn_t *c = &tp->conns[world];
  pthread_mutex_lock(&tp->lock);
  req->seq = req->kind == CHORUS__KIND_COLL ? ep->cur_seq : 0;
  chorus_result_t st = ep->status;
  if (st != CHORUS_OK) goto out;
  if (req->type == CHORUS__REQ_SEND && (c->dead || c->bye_received)) {
    fail_peer_left(ep, c, "needs to send to it");
    st = ep->status;
    goto out;
  }
  if (req->type == CHORUS__REQ_SEND) {
    txitem_t *it = calloc(1, sizeof *it);
    if (!it) {
      st = CHORUS_ERR_NO_MEMORY;
      goto out;
    }
    hdr_t h = {.magic = MSG_MAGIC, .type = T_DATA, .kind = (uint16_t)req->kind, .ep_id = ep->id,
               .seq = req->seq, .step = req->step, .tag = req->tag, .len = req->len};
    h.fp = ep->cur_fp;
    if (req->kind == CHORUS__KIND_P2P) h.fp = req->fp; /* its own description */
    chorus__wire_encode(&h, it->hdr);
    it->payload = req->buf;
    it->len = req->len;
    it->req = req;
    it->ep = ep;
    queue_tx(tp, c, it);
    st = ep->status;
    goto out;
  }
  /* Receive: look for a message that already arrived. */
  for (unexp_t *u = tp->unexp_head; u; u = u->next) {
    if (u->h.type != T_DATA || u->h.ep_id != ep->id || u->src != world || u->req) continue;
    if (!req_matches(req, &u->h, req->peer)) continue;
    if (check_length(ep, req, &u->h, world) < 0) {
      st = ep->status;
      goto out;
    }
    if (req->kind == CHORUS__KIND_COLL && check_data_header(ep, &u->h, world) < 0) {
      st = ep->status;
      goto out;
    }
    if (u->complete) {
      if (u->h.len) memcpy(req->buf, u->buf, u->h.len);
      req->done = 1;
      unlink_unexp(tp, u);
      free_unexp(tp, u);
    } else {
      u->req = req;
    }
    goto out;
  }
  /* Nothing buffered: a peer that is gone will never send it. */
  if (c->dead || c->bye_received) {
    fail_peer_left(ep, c, "waits for its data");
    st = ep->status;
    goto out;
  }
  chorus__req_t **pp = &ep->recvs;
  while (*pp) pp = &(*pp)->next;
  *pp = req;
  if (c->paused) try_resume(tp, c); /* its held-back message may be this one */
out:
  pthread_mutex_unlock(&tp->lock);
  return st;
}

static chorus_result_t ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int64_t deadline,
                               int timeout_ms, int fatal);

chorus_result_t chorus__ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int timeout_ms) {
  return ep_wait(ep, reqs, n, chorus__deadline_ms(timeout_ms), timeout_ms, 1);
}

chorus_result_t chorus__ep_wait_soft(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                     int timeout_ms) {
  return ep_wait(ep, reqs, n, chorus__deadline_ms(timeout_ms), timeout_ms, 0);
}

chorus_result_t chorus__ep_wait_until(chorus__ep_t *ep, chorus__req_t **reqs, int n,
                                      int64_t deadline, int timeout_ms) {
  return ep_wait(ep, reqs, n, deadline, timeout_ms, 1);
}

static chorus_result_t ep_wait(chorus__ep_t *ep, chorus__req_t **reqs, int n, int64_t deadline,
                               int timeout_ms, int fatal) {
  chorus__tp_t *tp = ep->tp;
  pthread_mutex_lock(&tp->lock);
  for (;;) {
    if (ep->status != CHORUS_OK) break;
    int all = 1;
    for (int i = 0; i < n && all; i++)
      if (reqs[i] && !reqs[i]->done) all = 0;
    if (all) break;
    if (chorus__ms_left(deadline) == 0 && !fatal) {
      pthread_mutex_unlock(&tp->lock);
      return CHORUS_INPROGRESS;
    }
    if (chorus__ms_left(deadline) == 0) {
      char who[512];
      size_t off = 0;
      who[0] = '\0';
      for (int i = 0; i < n && off < sizeof who; i++) {
        if (!reqs[i] || reqs[i]->done) continue;
        char rd[64];
        chorus__ep_rank_desc(ep, reqs[i]->peer, rd, sizeof rd);
        off += (size_t)snprintf(who + off, sizeof who - off, "%s%s %s", off ? ", " : "",
                                reqs[i]->type == CHORUS__REQ_SEND ? "sending to" : "receiving from",
                                rd);
      }
      ep_fail_timeout_locked(ep, timeout_ms, who);
      break;
    }
    struct timespec ts = chorus__deadline_timespec(deadline);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &ts);
  }
  chorus_result_t st = ep->status;
  pthread_mutex_unlock(&tp->lock);
  return st;
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
static int hs_connect(chorus__tp_t *tp, int fd, int peer, int64_t deadline, char *why,
                      size_t cap) {
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
                             tp->conns[peer].keys) < 0) {
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
static int hs_verify(chorus__tp_t *tp, const pending_t *p, char *why, size_t cap) {
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
  if (tp->conns[peer].fd >= 0) {
    snprintf(why, cap, "rank %u is already connected", peer);
    return -HS_DENY_RANK;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    snprintf(why, cap, "rank %u and this rank disagree on CHORUS_ENCRYPT", peer);
    return -HS_DENY_ENCRYPT;
  }
  if (tp->encrypt && hs_keys(tp, peer, (uint32_t)tp->rank, p->na, in + 12, tp->conns[peer].keys) < 0) {
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
static chorus_result_t accept_all(chorus__tp_t *tp, int listen_fd, int64_t deadline,
                                  char *errmsg, size_t errcap) {
  const chorus__env_t *env = chorus__env();
  int need = tp->size - 1 - tp->rank;
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
      chorus__log_limited(&tp->reject_log, CHORUS__SUB_TCP,
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
        if (tp->conns[r].fd < 0)
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
        chorus__log_limited(&tp->reject_log, CHORUS__SUB_TCP,
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
      int peer = hs_verify(tp, p, why, sizeof why);
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
        chorus__log_limited(&tp->reject_log, CHORUS__SUB_TCP,
                            "chorus rank %d: rejected a connection from %s: %s", tp->rank,
                            p->addr, peer < 0 ? why : "could not answer it");
        rejected++;
        pending_drop(ps, &n, i);
        continue;
      }
      chorus__net_set_nonblock(p->fd, 0);
      chorus__net_set_nodelay(p->fd);
      tp->conns[peer].fd = p->fd;
      ps[i] = ps[--n];
      need--;
    }
    if (!(pfd[0].revents & POLLIN)) continue;
    for (int k = 0; k < 64 && need > 0; k++) {
      int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          chorus__log_limited(&tp->reject_log, CHORUS__SUB_TCP, "chorus rank %d: accept: %s",
                              tp->rank, strerror(errno));
        break;
      }
      if (n == max_pending) { /* the oldest stranger makes room */
        int oldest = 0;
        for (int i = 1; i < n; i++)
          if (ps[i].deadline < ps[oldest].deadline) oldest = i;
        chorus__log_limited(&tp->reject_log, CHORUS__SUB_TCP,
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

static void tp_free(chorus__tp_t *tp) {
  if (tp->conns) {
    for (int r = 0; r < tp->size; r++) {
      conn_t *c = &tp->conns[r];
      if (c->fd >= 0) close(c->fd);
      while (c->tx_head) {
        txitem_t *it = c->tx_head;
        c->tx_head = it->next;
        free(it->owned);
        free(it);
      }
      free(c->rx_abort);
      chorus__aead_free(c->tx_aead);
      chorus__aead_free(c->rx_aead);
      free(c->tx_rec);
      free(c->rx_rec);
      chorus__wipe(c->keys, sizeof c->keys);
    }
  }
  while (tp->unexp_head) {
    unexp_t *u = tp->unexp_head;
    tp->unexp_head = u->next;
    free(u->buf);
    free(u);
  }
  if (tp->epfd >= 0) close(tp->epfd);
  if (tp->evfd >= 0) close(tp->evfd);
  pthread_mutex_destroy(&tp->lock);
  pthread_cond_destroy(&tp->cond);
  free(tp->conns);
  free(tp);
}

chorus_result_t chorus__tp_create(const chorus__tp_config_t *cfg, chorus__tp_t **out,
                                  char *errmsg, size_t errcap) {
  chorus__tp_t *tp = calloc(1, sizeof *tp);
  if (!tp) {
    close(cfg->listen_fd);
    return CHORUS_ERR_NO_MEMORY;
  }
  tp->rank = cfg->rank;
  tp->size = cfg->size;
  tp->world_id = cfg->world_id;
  tp->fp_format = cfg->fp_format;
  tp->epfd = tp->evfd = -1;
  tp->key = *cfg->key;
  long budget = chorus__env()->RECV_BUFFER_MAX;
  tp->budget = budget > 0 ? (size_t)budget : (size_t)64 << 20;
  tp->encrypt = chorus__env()->ENCRYPT;
  long peer_ms = chorus__env()->PEER_TIMEOUT_MS;
  /* Never below 4 heartbeats: a peer is not silent between two of them. */
  tp->peer_timeout_ns = peer_ms <= 0 ? 0 : (int64_t)CHORUS__MAX(peer_ms, 4 * HEARTBEAT_MS) * 1000000;
  pthread_mutex_init(&tp->lock, NULL);
  chorus__cond_init_monotonic(&tp->cond);
  chorus_result_t st = CHORUS_OK;
  tp->conns = calloc((size_t)cfg->size, sizeof(conn_t));
  if (!tp->conns) {
    close(cfg->listen_fd);
    st = CHORUS_ERR_NO_MEMORY;
    goto fail;
  }
  for (int r = 0; r < cfg->size; r++) {
    tp->conns[r].fd = -1;
    tp->conns[r].rank = r;
    tp->conns[r].last_heard = chorus__now_ns();
    char host[64];
    int port;
    if (parse_addr(cfg->addrs[r], host, sizeof host, &port) == 0)
      snprintf(tp->conns[r].addr, sizeof tp->conns[r].addr, "%s:%d", host, port);
    else
      snprintf(tp->conns[r].addr, sizeof tp->conns[r].addr, "?");
  }
  char why[256];
  /* Connect to every lower rank. */
  for (int r = 0; r < cfg->rank && st == CHORUS_OK; r++) {
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
      int rc = hs_connect(tp, fd, r, cfg->deadline, why, sizeof why);
      if (rc == 0) {
        tp->conns[r].fd = fd;
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
  if (st == CHORUS_OK) st = accept_all(tp, cfg->listen_fd, cfg->deadline, errmsg, errcap);
  close(cfg->listen_fd);
  if (st != CHORUS_OK) goto fail;
  tp->epfd = epoll_create1(EPOLL_CLOEXEC);
  tp->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (tp->epfd < 0 || tp->evfd < 0) {
    snprintf(errmsg, errcap, "epoll/eventfd: %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.u32 = UINT32_MAX};
  epoll_ctl(tp->epfd, EPOLL_CTL_ADD, tp->evfd, &ev);
  for (int r = 0; r < cfg->size; r++) {
    conn_t *c = &tp->conns[r];
    if (r == cfg->rank) continue;
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
        goto fail;
      }
    }
    chorus__net_set_nonblock(c->fd, 1);
    int sz = 4 << 20;
    setsockopt(c->fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    setsockopt(c->fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    ev.events = EPOLLIN;
    ev.data.u32 = (uint32_t)r;
    if (epoll_ctl(tp->epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0) {
      snprintf(errmsg, errcap, "epoll_ctl: %s", strerror(errno));
      st = CHORUS_ERR_SYSTEM;
      goto fail;
    }
  }
  /* Silence is counted from now: connecting may have taken a while. */
  int64_t start = chorus__now_ns();
  for (int r = 0; r < cfg->size; r++) tp->conns[r].last_heard = start;
  tp->last_ping = start;
  if (pthread_create(&tp->thread, NULL, progress_main, tp) != 0) {
    snprintf(errmsg, errcap, "cannot start the progress thread");
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  tp->thread_started = 1;
  *out = tp;
  return CHORUS_OK;
fail:
  tp_free(tp);
  return st;
}

void chorus__tp_destroy(chorus__tp_t *tp, int64_t bye_deadline) {
  if (!tp) return;
  pthread_mutex_lock(&tp->lock);
  tp->bye_sent = 1;
  resume_all(tp); /* leaving: held-back messages are read and dropped */
  for (int r = 0; r < tp->size; r++)
    if (r != tp->rank) send_control(tp, &tp->conns[r], T_BYE, 0, NULL, -1);
  /* A peer that sent nothing, not even a heartbeat, for SILENT_MS is
   * stopped or hung: its goodbye is not worth waiting for (a survivor of a
   * failure would otherwise linger the whole bye timeout). */
  const int64_t silent_ns = (int64_t)4 * HEARTBEAT_MS * 1000000;
  for (;;) {
    int waiting = 0;
    int64_t now = chorus__now_ns();
    for (int r = 0; r < tp->size; r++) {
      conn_t *c = &tp->conns[r];
      if (r == tp->rank || c->dead) continue;
      if (now - c->last_heard > silent_ns) continue;
      if (!c->bye_received || c->tx_head || c->tx_off < c->tx_len) waiting = 1;
    }
    if (!waiting || chorus__ms_left(bye_deadline) == 0) break;
    /* Wake at least once a heartbeat to notice peers falling silent. */
    int64_t until = now + (int64_t)HEARTBEAT_MS * 1000000;
    struct timespec ts = chorus__deadline_timespec(until < bye_deadline ? until : bye_deadline);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &ts);
  }
  __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&tp->lock);
  uint64_t one = 1;
  (void)!write(tp->evfd, &one, sizeof one);
  if (tp->thread_started) pthread_join(tp->thread, NULL);
  tp_free(tp);
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
  chorus__tp_t *tp = calloc(1, sizeof *tp);
  if (!tp) return NULL;
  tp->rank = rank;
  tp->size = size;
  tp->key = *key;
  tp->world_id = world;
  tp->budget = (size_t)1 << 20;
  tp->fp_format = fuzz_fp_format;
  pthread_mutex_init(&tp->lock, NULL);
  chorus__cond_init_monotonic(&tp->cond);
  tp->conns = calloc((size_t)size, sizeof(conn_t));
  tp->epfd = epoll_create1(EPOLL_CLOEXEC);
  tp->evfd = -1;
  if (!tp->conns || tp->epfd < 0) {
    tp_free(tp);
    return NULL;
  }
  for (int r = 0; r < size; r++) {
    tp->conns[r].fd = -1;
    tp->conns[r].rank = r;
    snprintf(tp->conns[r].addr, sizeof tp->conns[r].addr, "fuzz:%d", r);
  }
  return tp;
}

void chorus__tp_set_fp_format(chorus__tp_t *tp, chorus__fp_format_fn fn) { tp->fp_format = fn; }

int chorus__tp_fuzz_feed(chorus__tp_t *tp, int peer, const void *data, size_t n, int *wfd) {
  conn_t *c = &tp->conns[peer];
  if (c->fd < 0) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sp) < 0) return -1;
    c->fd = sp[0];
    *wfd = sp[1];
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)peer};
    epoll_ctl(tp->epfd, EPOLL_CTL_ADD, c->fd, &ev);
  }
  if (n && send(*wfd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return -1;
  pthread_mutex_lock(&tp->lock);
  if (!c->dead && !c->paused) read_conn(tp, c);
  int dead = c->dead;
  pthread_mutex_unlock(&tp->lock);
  return dead ? -1 : 0;
}

chorus__aead_t *chorus__tp_fuzz_encrypt(chorus__tp_t *tp, int peer) {
  conn_t *c = &tp->conns[peer];
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
  return hs_verify(tp, &p, why, sizeof why);
}

void chorus__tp_fuzz_free(chorus__tp_t *tp) {
  if (tp) tp_free(tp);
}
