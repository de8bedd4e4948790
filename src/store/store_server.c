/*
 * store_server.c - the key-value store's server (chorus_store_server_*).
 *
 * Design.  One thread runs an epoll loop over the listening socket, an
 * eventfd that stop() writes to, and every client connection.  Connections
 * are non-blocking and each has an input buffer (bytes received, consumed a
 * whole frame at a time) and an output buffer (responses not yet sent), so
 * partial reads and writes of any size are fine.  Everything the loop touches
 * belongs to the server thread alone; the only state shared with other threads
 * is the eventfd and the handshake timeout (an atomic).
 *
 * Keys live in a chained hash table keyed by SipHash under a random per-server
 * key, so no client can choose keys that collide.  GET and WAIT on keys that
 * do not exist yet are not errors: the request stays at the head of the
 * connection's input buffer and the connection is linked into the waiter list
 * of the missing key (an entry that is "absent" exists for this purpose).
 * Setting the key moves its waiters to the server's ready list, and after the
 * current batch of events the loop runs each ready connection's head request
 * again.  A connection waits on at most one key at a time (WAIT walks its keys
 * in order and remembers how far it got), and while it waits it reads nothing
 * more, so a blocked client costs one list link.  The server never times a
 * request out: the client applies its own deadline and, when it gives up,
 * closes its connection, which drops the waiter.
 *
 * Fairness.  Epoll is level-triggered and a connection's turn is bounded (a
 * few reads, a few dozen requests); one with complete requests left goes on
 * the "again" list and the next epoll_wait does not sleep.  Every way a turn
 * can end leaves something that brings the connection back (a key being set,
 * EPOLLIN, EPOLLOUT or the again list), so no buffered request is stranded.
 * Closed connections are unlinked at once but freed only at the end of the
 * loop iteration, so an event of the same batch never touches freed memory.
 *
 * Untrusted input.  A new connection first receives a random nonce and must
 * answer with its own nonce and HMAC-SHA256(job key, both nonces) within the
 * handshake timeout (5 s by default; the server then proves the key back,
 * store.h); until then its frames may not exceed the answer's 72 bytes, so a
 * stranger can make the server hold at most a few dozen bytes.  Every length
 * in a request is checked against the frame and the limits in store.h and
 * store_proto.h, and the body must be consumed exactly.  Anything malformed
 * closes that one connection with a WARN naming the peer's address:port.  At
 * most CHORUS__STORE_MAX_CONNS connections are kept; further ones are accepted
 * and closed at once so the listening socket never stalls the loop.  A client
 * that stops reading its responses is not read from either once its output
 * buffer passes OUT_HIGH_WATER.  Allocation failures close the connection
 * concerned, never the server.
 */
#include "store.h"
#include "store_proto.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

#define CHORUS__STORE_MAX_CONNS 4096
#define HANDSHAKE_MS_DEFAULT 5000
/* Stop processing a client's requests while more than this is unsent. */
#define OUT_HIGH_WATER ((size_t)256 << 10)
/* Buffers larger than this are released once empty. */
#define BUF_KEEP ((size_t)64 << 10)
/* Initial input buffer of an authenticated connection. */
#define IN_CHUNK ((size_t)4096)
/* recv() calls and requests per connection per turn before others get one. */
#define READS_PER_TURN 16
#define FRAMES_PER_TURN 64
#define INITIAL_BUCKETS 64
#define LISTEN_BACKLOG 1024
#define ACCEPT_PAUSE_MS 100

/* ------------------------------------------------------- intrusive lists */

typedef struct link {
  struct link *prev, *next;
} link_t;

#define CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static void list_init(link_t *l) {
  l->prev = l->next = l;
}
static int list_empty(const link_t *head) {
  return head->next == head;
}

static void list_insert_after(link_t *pos, link_t *n) {
  n->prev = pos;
  n->next = pos->next;
  pos->next->prev = n;
  pos->next = n;
}

static void list_push_back(link_t *head, link_t *n) {
  list_insert_after(head->prev, n);
}

/* Moves every element of src to the end of dst. */
static void list_splice(link_t *dst, link_t *src) {
  if (list_empty(src)) return;
  src->next->prev = dst->prev;
  dst->prev->next = src->next;
  src->prev->next = dst;
  dst->prev = src->prev;
  list_init(src);
}

/* Unlinks n (a no-op when it is not in a list) and leaves it self-linked. */
static void list_remove(link_t *n) {
  n->prev->next = n->next;
  n->next->prev = n->prev;
  list_init(n);
}

/* ----------------------------------------------------------------- types */

typedef struct entry {
  struct entry *next; /* hash chain */
  uint64_t hash;
  uint8_t *val; /* owned; NULL while absent */
  size_t vlen;
  int present;    /* 0: a placeholder that only holds waiters */
  link_t waiters; /* conn_t.wait_link of connections blocked on this key */
  size_t klen;
  uint8_t key[];
} entry_t;

enum {
  CONN_HELLO,   /* nonce sent, waiting for the client's answer */
  CONN_READY,   /* authenticated, serving requests */
  CONN_CLOSING, /* handshake failed: flushing the verdict, then closing */
  CONN_DEAD,    /* closed; freed at the end of the loop iteration */
};

typedef struct conn {
  int fd;
  int state;
  uint32_t events;     /* epoll mask currently registered */
  int64_t deadline;    /* end of the handshake (HELLO and CLOSING) */
  link_t all_link;     /* server's conns list, or its dead list once closed */
  link_t timer_link;   /* server's handshaking list while HELLO or CLOSING */
  link_t wait_link;    /* an entry's waiters, or the ready or again list */
  entry_t *waiting_on; /* entry whose waiters hold wait_link, or NULL */
  int ready;           /* wait_link is on the ready or again list */
  int eof;             /* the peer closed its side */
  uint32_t resume_idx; /* WAIT: keys [0, resume_idx) were seen present */
  size_t resume_off;   /* WAIT: body offset of key resume_idx; 0: fresh */
  uint8_t nonce[CHORUS__STORE_NONCE_LEN];
  uint8_t *in; /* received bytes; frames start at in_off */
  size_t in_off, in_len, in_cap;
  chorus__sbuf_t out; /* responses; bytes before out_off are sent */
  size_t out_off;
  char peer[80]; /* "address:port" for logs */
} conn_t;

struct chorus_store_server {
  pthread_t thread;
  int listen_fd, epoll_fd, stop_fd;
  int port;
  char name[96]; /* "store server *:29500", prefix of every log line */
  chorus__key_t auth_key;
  uint8_t hash_key[16];
  entry_t **buckets;
  size_t nbuckets, nentries;
  int64_t npresent;
  link_t conns, handshaking, dead;
  link_t ready; /* connections to run after the current batch of events */
  link_t again; /* connections that used up their turn with work left */
  size_t nconns;
  atomic_int handshake_ms;
  int listen_paused;
  int64_t listen_resume_at;
  int64_t last_refusal_warn;
  chorus__ratelimit_t reject_log; /* rejected handshakes */
  int stopping;
};

/* Results of one request or handshake frame. */
enum { RQ_DONE, RQ_WAIT, RQ_CLOSED };
/* Results of processing a connection's buffered frames. */
enum { PF_NEED_MORE, PF_STALLED, PF_BUDGET, PF_CLOSED };

/* The epoll data pointers of the two non-connection descriptors. */
static char g_listen_tag, g_stop_tag;

/* ------------------------------------------------------------ hash table */

static entry_t **bucket_of(chorus_store_server_t *srv, uint64_t hash) {
  return &srv->buckets[hash & (srv->nbuckets - 1)];
}

static entry_t *table_find(chorus_store_server_t *srv, const uint8_t *key, size_t klen) {
  uint64_t h = chorus__siphash(srv->hash_key, key, klen);
  for (entry_t *e = *bucket_of(srv, h); e; e = e->next)
    if (e->hash == h && e->klen == klen && !memcmp(e->key, key, klen)) return e;
  return NULL;
}

/* Doubles the bucket array; on allocation failure keeps the old one (longer
 * chains are slower, not wrong). */
static void table_grow(chorus_store_server_t *srv) {
  size_t n = srv->nbuckets * 2;
  entry_t **b = calloc(n, sizeof *b);
  if (!b) return;
  for (size_t i = 0; i < srv->nbuckets; i++) {
    entry_t *e = srv->buckets[i];
    while (e) {
      entry_t *next = e->next;
      entry_t **slot = &b[e->hash & (n - 1)];
      e->next = *slot;
      *slot = e;
      e = next;
    }
  }
  free(srv->buckets);
  srv->buckets = b;
  srv->nbuckets = n;
}

/* Returns the entry for key, adding an absent one if needed; NULL when memory
 * is short. */
static entry_t *table_find_or_add(chorus_store_server_t *srv, const uint8_t *key, size_t klen) {
  entry_t *e = table_find(srv, key, klen);
  if (e) return e;
  e = calloc(1, sizeof *e + klen);
  if (!e) return NULL;
  e->hash = chorus__siphash(srv->hash_key, key, klen);
  e->klen = klen;
  if (klen) memcpy(e->key, key, klen);
  list_init(&e->waiters);
  if (srv->nentries >= srv->nbuckets) table_grow(srv);
  entry_t **slot = bucket_of(srv, e->hash);
  e->next = *slot;
  *slot = e;
  srv->nentries++;
  return e;
}

static void table_remove(chorus_store_server_t *srv, entry_t *e) {
  for (entry_t **p = bucket_of(srv, e->hash); *p; p = &(*p)->next) {
    if (*p == e) {
      *p = e->next;
      break;
    }
  }
  if (e->present) srv->npresent--;
  srv->nentries--;
  free(e->val);
  free(e);
}

/* Removes an entry that is neither present nor waited for. */
static void entry_maybe_drop(chorus_store_server_t *srv, entry_t *e) {
  if (!e->present && list_empty(&e->waiters)) table_remove(srv, e);
}

/* Stores a copy of val at e and wakes every connection waiting for it.
 * Returns 0, or -1 when memory is short (e is then unchanged). */
static int entry_store(chorus_store_server_t *srv, entry_t *e, const void *val, size_t vlen) {
  uint8_t *copy = malloc(vlen ? vlen : 1);
  if (!copy) return -1;
  if (vlen) memcpy(copy, val, vlen);
  free(e->val);
  e->val = copy;
  e->vlen = vlen;
  if (!e->present) {
    e->present = 1;
    srv->npresent++;
  }
  while (!list_empty(&e->waiters)) {
    conn_t *c = CONTAINER_OF(e->waiters.next, conn_t, wait_link);
    list_remove(&c->wait_link);
    c->waiting_on = NULL;
    c->ready = 1;
    list_push_back(&srv->ready, &c->wait_link);
  }
  return 0;
}

static void table_free(chorus_store_server_t *srv) {
  for (size_t i = 0; srv->buckets && i < srv->nbuckets; i++) {
    entry_t *e = srv->buckets[i];
    while (e) {
      entry_t *next = e->next;
      free(e->val);
      free(e);
      e = next;
    }
  }
  free(srv->buckets);
  srv->buckets = NULL;
}

/* Strict decimal int64 ("-12"; no spaces, no trailing bytes).  Returns 0 or
 * -1. */
static int parse_i64(const uint8_t *p, size_t n, int64_t *out) {
  size_t i = 0;
  int neg = 0;
  if (n > 0 && (p[0] == '-' || p[0] == '+')) {
    neg = p[0] == '-';
    i = 1;
  }
  if (i == n) return -1;
  int64_t v = 0;
  for (; i < n; i++) {
    if (p[i] < '0' || p[i] > '9') return -1;
    int d = p[i] - '0';
    if (__builtin_mul_overflow(v, 10, &v)) return -1;
    if (neg ? __builtin_sub_overflow(v, d, &v) : __builtin_add_overflow(v, d, &v)) return -1;
  }
  *out = v;
  return 0;
}

/* ----------------------------------------------------------- connections */

/* Closes a connection and unlinks it from everything but the dead list, where
 * it stays until the end of the loop iteration so that events of the current
 * batch can still look at it (they see CONN_DEAD and skip it). */
static void conn_close(chorus_store_server_t *srv, conn_t *c) {
  if (c->state == CONN_DEAD) return;
  epoll_ctl(srv->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = -1;
  c->state = CONN_DEAD;
  list_remove(&c->timer_link);
  list_remove(&c->wait_link);
  c->ready = 0;
  if (c->waiting_on) {
    entry_t *e = c->waiting_on;
    c->waiting_on = NULL;
    entry_maybe_drop(srv, e);
  }
  list_remove(&c->all_link);
  list_push_back(&srv->dead, &c->all_link);
  srv->nconns--;
}

static void conn_free(conn_t *c) {
  free(c->in);
  chorus__sbuf_free(&c->out);
  free(c);
}

/* Logs why a connection is dropped, at the given level (CHORUS__LOG_WARN for
 * misbehaviour, lower for ordinary goodbyes), and closes it. */
static void conn_drop(chorus_store_server_t *srv, conn_t *c, int level, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void conn_drop(chorus_store_server_t *srv, conn_t *c, int level, const char *fmt, ...) {
  char why[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  if (level == CHORUS__LOG_WARN && c->state != CONN_READY) /* a stranger: rate-limited */
    chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE, "%s: closing connection from %s: %s",
                        srv->name, c->peer, why);
  else if (level == CHORUS__LOG_WARN)
    CHORUS_WARN(CHORUS__SUB_STORE, "%s: closing connection from %s: %s", srv->name, c->peer, why);
  else if (level == CHORUS__LOG_INFO)
    CHORUS_INFO(CHORUS__SUB_STORE, "%s: closing connection from %s: %s", srv->name, c->peer, why);
  else
    CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: closing connection from %s: %s", srv->name, c->peer, why);
  conn_close(srv, c);
}

/* A socket error (reset, ...).  Losing a connection in the middle of the
 * handshake or of a frame is worth a WARN; between requests it is a client
 * that went away. */
static void conn_lost(chorus_store_server_t *srv, conn_t *c, int err) {
  size_t avail = c->in_len - c->in_off;
  int partial = avail > 0 && (avail < 4 || avail - 4 < chorus__le32_get(c->in + c->in_off));
  int midway = c->state == CONN_HELLO || partial;
  conn_drop(srv, c, midway ? CHORUS__LOG_WARN : CHORUS__LOG_DEBUG, "%s: %s",
            c->state == CONN_HELLO ? "connection lost during the handshake"
            : midway               ? "connection lost in the middle of a frame"
                                   : "connection lost",
            strerror(err));
}

static size_t conn_unsent(const conn_t *c) {
  return c->out.len - c->out_off;
}

/* Whether the connection should be read from now. */
static int conn_can_read(const conn_t *c) {
  return (c->state == CONN_HELLO || c->state == CONN_READY) && !c->waiting_on &&
         conn_unsent(c) <= OUT_HIGH_WATER;
}

/* Registers the epoll interest the connection needs now.  Returns 0, or -1
 * when the connection was closed. */
static int conn_update_events(chorus_store_server_t *srv, conn_t *c) {
  if (c->state == CONN_DEAD) return -1;
  /* EPOLLRDHUP also while not reading: it tells a blocked waiter's client
   * went away. */
  uint32_t ev = EPOLLRDHUP;
  if (conn_can_read(c)) ev |= EPOLLIN;
  if (conn_unsent(c)) ev |= EPOLLOUT;
  if (ev == c->events) return 0;
  struct epoll_event e = {.events = ev, .data.ptr = c};
  if (epoll_ctl(srv->epoll_fd, EPOLL_CTL_MOD, c->fd, &e) < 0) {
    conn_drop(srv, c, CHORUS__LOG_WARN, "epoll_ctl failed: %s", strerror(errno));
    return -1;
  }
  c->events = ev;
  return 0;
}

/* Sends as much of the output buffer as the socket takes.  Returns 0, or -1
 * when the connection was closed (send error, or a failed handshake whose
 * verdict is now out). */
static int conn_flush(chorus_store_server_t *srv, conn_t *c) {
  while (conn_unsent(c)) {
    ssize_t n = send(c->fd, c->out.data + c->out_off, conn_unsent(c), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c->out_off += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    conn_drop(srv, c, CHORUS__LOG_DEBUG, "send failed: %s", strerror(n < 0 ? errno : EIO));
    return -1;
  }
  c->out_off = 0;
  c->out.len = 0;
  if (c->out.cap > BUF_KEEP) chorus__sbuf_free(&c->out);
  if (c->state == CONN_CLOSING) {
    conn_close(srv, c);
    return -1;
  }
  return 0;
}

/* Starts a response frame with the given status: returns the offset to pass
 * to reply_end().  Sent bytes are discarded first so the buffer stays small. */
static size_t reply_begin(conn_t *c, uint8_t status) {
  if (c->out_off) {
    memmove(c->out.data, c->out.data + c->out_off, conn_unsent(c));
    c->out.len -= c->out_off;
    c->out_off = 0;
  }
  size_t at = chorus__sbuf_frame_begin(&c->out);
  chorus__sbuf_u8(&c->out, status);
  return at;
}

static int reply_end(chorus_store_server_t *srv, conn_t *c, size_t at) {
  chorus__sbuf_frame_end(&c->out, at);
  if (c->out.oom) {
    conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory building a response");
    return RQ_CLOSED;
  }
  return RQ_DONE;
}

static int reply_status(chorus_store_server_t *srv, conn_t *c) {
  return reply_end(srv, c, reply_begin(c, CHORUS__STORE_ST_OK));
}

/* A well-formed request the store cannot carry out (ADD on a value that is
 * not an integer): answered with the reason, the connection stays. */
static int reply_bad_request(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int reply_bad_request(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...) {
  char why[CHORUS__STORE_MAX_REASON];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof why) n = (int)sizeof why - 1;
  CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: bad request from %s: %s", srv->name, c->peer, why);
  size_t at = reply_begin(c, CHORUS__STORE_ST_BAD_REQUEST);
  chorus__sbuf_str(&c->out, why, (size_t)n);
  return reply_end(srv, c, at);
}

static int reply_value(chorus_store_server_t *srv, conn_t *c, const void *val, size_t len) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_str(&c->out, val, len);
  return reply_end(srv, c, at);
}

static int reply_u8(chorus_store_server_t *srv, conn_t *c, uint8_t v) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_u8(&c->out, v);
  return reply_end(srv, c, at);
}

static int reply_i64(chorus_store_server_t *srv, conn_t *c, int64_t v) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_u64(&c->out, (uint64_t)v);
  return reply_end(srv, c, at);
}

static int malformed(chorus_store_server_t *srv, conn_t *c, int cmd) {
  if (!strcmp(chorus__store_cmd_name(cmd), "unknown"))
    conn_drop(srv, c, CHORUS__LOG_WARN, "unknown command %d", cmd);
  else
    conn_drop(srv, c, CHORUS__LOG_WARN, "malformed %s request", chorus__store_cmd_name(cmd));
  return RQ_CLOSED;
}

static int out_of_memory(chorus_store_server_t *srv, conn_t *c) {
  conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory");
  return RQ_CLOSED;
}

/* Parks the connection's head request until key exists. */
static int wait_on(chorus_store_server_t *srv, conn_t *c, const uint8_t *key, size_t klen) {
  entry_t *e = table_find_or_add(srv, key, klen);
  if (!e) return out_of_memory(srv, c);
  c->waiting_on = e;
  list_push_back(&e->waiters, &c->wait_link);
  return RQ_WAIT;
}

/* Handles the frame of a connection in CONN_HELLO: the client's answer to
 * the nonce.  Any outcome consumes the frame; a failure sends the verdict
 * and moves the connection to CONN_CLOSING. */
static int conn_handshake(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body, len);
  const uint8_t *magic = chorus__srd_raw(&r, 4);
  uint32_t version = chorus__srd_u32(&r);
  const uint8_t *client_nonce = chorus__srd_raw(&r, CHORUS__STORE_NONCE_LEN);
  const uint8_t *mac = chorus__srd_raw(&r, CHORUS__STORE_MAC_LEN);
  uint8_t verdict = CHORUS__STORE_HS_OK;
  if (r.bad || r.left || memcmp(magic, CHORUS__STORE_MAGIC, 4) != 0) {
    chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE, "%s: malformed handshake from %s",
                        srv->name, c->peer);
    verdict = CHORUS__STORE_HS_VERSION;
  } else if (version != CHORUS__STORE_VERSION) {
    chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE,
                        "%s: %s speaks store protocol version %u, this server %u", srv->name,
                        c->peer, version, CHORUS__STORE_VERSION);
    verdict = CHORUS__STORE_HS_VERSION;
  } else {
    uint8_t want[CHORUS__STORE_MAC_LEN];
    chorus__store_mac(&srv->auth_key, 0, c->nonce, client_nonce, want);
    if (!chorus__ct_equal(want, mac, sizeof want)) {
      chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE,
                          "%s: authentication failed for %s (wrong job secret?); closing",
                          srv->name, c->peer);
      verdict = CHORUS__STORE_HS_DENIED;
    }
  }
  size_t at = chorus__sbuf_frame_begin(&c->out);
  chorus__sbuf_u8(&c->out, verdict);
  if (verdict == CHORUS__STORE_HS_OK) {
    uint8_t proof[CHORUS__STORE_MAC_LEN];
    chorus__store_mac(&srv->auth_key, 1, c->nonce, client_nonce, proof);
    chorus__sbuf_raw(&c->out, proof, sizeof proof);
  }
  chorus__sbuf_frame_end(&c->out, at);
  if (c->out.oom) return out_of_memory(srv, c);
  if (verdict == CHORUS__STORE_HS_OK) {
    c->state = CONN_READY;
    list_remove(&c->timer_link);
    CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: %s authenticated", srv->name, c->peer);
  } else {
    c->state = CONN_CLOSING; /* keeps its handshake deadline */
  }
  return RQ_DONE;
}

/* WAIT: validates the key list once, then checks the keys from where the
 * last run stopped; parks on the first missing one. */
static int do_wait(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body + 1, len - 1);
  uint32_t n = chorus__srd_u32(&r);
  if (r.bad || n > CHORUS__STORE_MAX_KEYS) return malformed(srv, c, CHORUS__STORE_CMD_WAIT);
  if (c->resume_off == 0) {
    chorus__srd_t v = r;
    for (uint32_t i = 0; i < n && !v.bad; i++) {
      const uint8_t *k;
      size_t kl;
      chorus__srd_str(&v, CHORUS__STORE_MAX_KEY, &k, &kl);
    }
    if (v.bad || v.left) return malformed(srv, c, CHORUS__STORE_CMD_WAIT);
    c->resume_idx = 0;
    c->resume_off = (size_t)(r.p - body);
  }
  r = chorus__srd_make(body + c->resume_off, len - c->resume_off);
  for (uint32_t i = c->resume_idx; i < n; i++) {
    size_t off = (size_t)(r.p - body);
    const uint8_t *k;
    size_t kl;
    chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &k, &kl);
    entry_t *e = table_find(srv, k, kl);
    if (!e || !e->present) {
      c->resume_idx = i;
      c->resume_off = off;
      return wait_on(srv, c, k, kl);
    }
  }
  c->resume_idx = 0;
  c->resume_off = 0;
  return reply_status(srv, c);
}

/* Handles one request frame of an authenticated connection.  Returns RQ_DONE
 * (answered), RQ_WAIT (parked on a key; the frame stays buffered and runs
 * again when the key is set) or RQ_CLOSED. */
static int conn_request(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body, len);
  int cmd = chorus__srd_u8(&r);
  const uint8_t *key = NULL, *val = NULL, *val2 = NULL;
  size_t klen = 0, vlen = 0, vlen2 = 0;
  switch (cmd) {
    case CHORUS__STORE_CMD_SET: {
      chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
      chorus__srd_str(&r, CHORUS__STORE_MAX_FRAME, &val, &vlen);
      if (r.bad || r.left) return malformed(srv, c, cmd);
      entry_t *e = table_find_or_add(srv, key, klen);
      if (!e) return out_of_memory(srv, c);
      if (entry_store(srv, e, val, vlen) < 0) {
        entry_maybe_drop(srv, e);
        return out_of_memory(srv, c);
      }
      return reply_status(srv, c);
    }
    case CHORUS__STORE_CMD_GET: {
      chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
      if (r.bad || r.left) return malformed(srv, c, cmd);
      entry_t *e = table_find(srv, key, klen);
      if (e && e->present) return reply_value(srv, c, e->val, e->vlen);
      return wait_on(srv, c, key, klen);
    }
    case CHORUS__STORE_CMD_ADD: {
      chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
      int64_t delta = (int64_t)chorus__srd_u64(&r);
      if (r.bad || r.left) return malformed(srv, c, cmd);
      entry_t *e = table_find(srv, key, klen);
      int64_t cur = 0, sum;
      if (e && e->present && parse_i64(e->val, e->vlen, &cur) < 0)
        return reply_bad_request(srv, c, "the value of '%.*s' is not a decimal integer",
                                 (int)CHORUS__MIN(klen, 200), (const char *)key);
      if (__builtin_add_overflow(cur, delta, &sum))
        return reply_bad_request(srv, c, "adding %" PRId64 " to %" PRId64 " overflows int64", delta,
                                 cur);
      char text[32];
      int tlen = snprintf(text, sizeof text, "%" PRId64, sum);
      if (!e) e = table_find_or_add(srv, key, klen);
      if (!e) return out_of_memory(srv, c);
      if (entry_store(srv, e, text, (size_t)tlen) < 0) {
        entry_maybe_drop(srv, e);
        return out_of_memory(srv, c);
      }
      return reply_i64(srv, c, sum);
    }
    case CHORUS__STORE_CMD_COMPARE_SET: {
      chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
      chorus__srd_str(&r, CHORUS__STORE_MAX_FRAME, &val, &vlen);   /* expected */
      chorus__srd_str(&r, CHORUS__STORE_MAX_FRAME, &val2, &vlen2); /* desired */
      if (r.bad || r.left) return malformed(srv, c, cmd);
      entry_t *e = table_find(srv, key, klen);
      if (!e || !e->present) {
        /* torch semantics: an absent key is set only when expected is empty;
         * otherwise the key stays absent and the reply echoes expected. */
        if (vlen != 0) return reply_value(srv, c, val, vlen);
      } else if (e->vlen != vlen || (vlen && memcmp(e->val, val, vlen) != 0)) {
        return reply_value(srv, c, e->val, e->vlen);
      }
      if (!e) e = table_find_or_add(srv, key, klen);
      if (!e) return out_of_memory(srv, c);
      if (entry_store(srv, e, val2, vlen2) < 0) {
        entry_maybe_drop(srv, e);
        return out_of_memory(srv, c);
      }
      return reply_value(srv, c, e->val, e->vlen);
    }
    case CHORUS__STORE_CMD_CHECK: {
      uint32_t n = chorus__srd_u32(&r);
      if (r.bad || n > CHORUS__STORE_MAX_KEYS) return malformed(srv, c, cmd);
      int all = 1;
      for (uint32_t i = 0; i < n && !r.bad; i++) {
        chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
        if (r.bad) break;
        entry_t *e = table_find(srv, key, klen);
        if (!e || !e->present) all = 0;
      }
      if (r.bad || r.left) return malformed(srv, c, cmd);
      return reply_u8(srv, c, (uint8_t)all);
    }
    case CHORUS__STORE_CMD_DELETE: {
      chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &key, &klen);
      if (r.bad || r.left) return malformed(srv, c, cmd);
      entry_t *e = table_find(srv, key, klen);
      int existed = e && e->present;
      if (existed) {
        free(e->val);
        e->val = NULL;
        e->vlen = 0;
        e->present = 0;
        srv->npresent--;
        entry_maybe_drop(srv, e);
      }
      return reply_u8(srv, c, (uint8_t)existed);
    }
    case CHORUS__STORE_CMD_WAIT:
      return do_wait(srv, c, body, len);
    case CHORUS__STORE_CMD_NUM_KEYS:
      if (r.left) return malformed(srv, c, cmd);
      return reply_i64(srv, c, srv->npresent);
    default:
      return malformed(srv, c, cmd);
  }
}

/* Handles the complete frames at the head of the input buffer, in order, at
 * most *budget of them.  Returns PF_NEED_MORE (the next frame is incomplete),
 * PF_STALLED (parked on a key, too much unsent output, or closing),
 * PF_BUDGET (complete frames are left but the budget is spent) or
 * PF_CLOSED. */
static int conn_process(chorus_store_server_t *srv, conn_t *c, int *budget) {
  for (;;) {
    if (!conn_can_read(c)) return PF_STALLED;
    size_t avail = c->in_len - c->in_off;
    if (avail < 4) return PF_NEED_MORE;
    uint32_t len = chorus__le32_get(c->in + c->in_off);
    uint32_t limit = c->state == CONN_HELLO ? CHORUS__STORE_AUTH_LEN : CHORUS__STORE_MAX_FRAME;
    if (len > limit) {
      conn_drop(srv, c, CHORUS__LOG_WARN,
                "frame of %" PRIu32 " bytes exceeds the limit of %" PRIu32 "%s", len, limit,
                c->state == CONN_HELLO ? " before authentication" : "");
      return PF_CLOSED;
    }
    if (len == 0) {
      conn_drop(srv, c, CHORUS__LOG_WARN, "empty frame");
      return PF_CLOSED;
    }
    if (avail - 4 < len) return PF_NEED_MORE;
    if (*budget == 0) return PF_BUDGET;
    --*budget;
    const uint8_t *body = c->in + c->in_off + 4;
    int rc = c->state == CONN_HELLO ? conn_handshake(srv, c, body, len)
                                    : conn_request(srv, c, body, len);
    if (rc == RQ_CLOSED) return PF_CLOSED;
    if (rc == RQ_WAIT) return PF_STALLED;
    c->in_off += 4 + (size_t)len;
    if (c->in_off == c->in_len) {
      c->in_off = c->in_len = 0;
      if (c->in_cap > BUF_KEEP) {
        free(c->in);
        c->in = NULL;
        c->in_cap = 0;
      }
    }
  }
}

/* One recv() into the input buffer, which grows toward the size of the frame
 * being received.  Returns the bytes read, 0 when none are available (or the
 * peer closed: c->eof), or -1 when the connection was closed. */
static ssize_t conn_read(chorus_store_server_t *srv, conn_t *c) {
  if (c->in_off) {
    memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
    c->in_len -= c->in_off;
    c->in_off = 0;
  }
  size_t target;
  if (c->state == CONN_HELLO) {
    target = 4 + CHORUS__STORE_AUTH_LEN; /* nothing larger is accepted yet */
  } else {
    /* conn_process has checked the length of a complete header. */
    size_t frame = c->in_len >= 4 ? 4 + (size_t)chorus__le32_get(c->in) : 0;
    target = CHORUS__MAX(IN_CHUNK, CHORUS__MIN(frame, c->in_cap * 2));
  }
  if (c->in_cap < target) {
    uint8_t *p = realloc(c->in, target);
    if (!p) {
      conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory");
      return -1;
    }
    c->in = p;
    c->in_cap = target;
  }
  for (;;) {
    ssize_t n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
    if (n > 0) {
      c->in_len += (size_t)n;
      return n;
    }
    if (n == 0) {
      c->eof = 1;
      return 0;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    conn_lost(srv, c, errno);
    return -1;
  }
}

/* Gives a connection a turn: handles buffered frames, reads more while that
 * makes progress, flushes responses and updates its epoll interest.  A turn
 * is bounded (READS_PER_TURN, FRAMES_PER_TURN); a connection with complete
 * frames left goes on the again list for the next loop iteration.  Whenever
 * a turn ends, whatever is left is sure to bring the connection back: a key
 * being set, EPOLLOUT, EPOLLIN (data still unread), or the again list. */
static void conn_service(chorus_store_server_t *srv, conn_t *c) {
  if (c->ready) {
    list_remove(&c->wait_link);
    c->ready = 0;
  }
  int budget = FRAMES_PER_TURN;
  for (int reads = 0;;) {
    int rc = conn_process(srv, c, &budget);
    if (rc == PF_CLOSED) return;
    if (rc == PF_BUDGET) {
      c->ready = 1;
      list_push_back(&srv->again, &c->wait_link);
      break;
    }
    if (c->eof) {
      /* Frames that arrived before the goodbye have been handled. */
      size_t partial = c->in_len - c->in_off;
      if (partial && rc == PF_NEED_MORE)
        conn_drop(srv, c, CHORUS__LOG_WARN, "peer closed in the middle of a frame (%zu bytes)",
                  partial);
      else if (c->state == CONN_HELLO)
        conn_drop(srv, c, CHORUS__LOG_INFO, "peer closed before the handshake");
      else
        conn_drop(srv, c, CHORUS__LOG_DEBUG, "peer closed the connection");
      return;
    }
    if (rc == PF_STALLED) {
      if (c->waiting_on || c->state != CONN_READY) break;
      /* Too much unsent output: send what the socket takes now and go on
       * if that was enough; otherwise EPOLLOUT resumes the connection. */
      if (conn_flush(srv, c) < 0) return;
      if (conn_unsent(c) > OUT_HIGH_WATER) break;
      continue;
    }
    /* PF_NEED_MORE: no complete frame is buffered. */
    if (reads++ >= READS_PER_TURN) break;
    ssize_t n = conn_read(srv, c);
    if (n < 0) return;
    if (n == 0 && !c->eof) break;
  }
  if (conn_flush(srv, c) < 0) return;
  conn_update_events(srv, c);
}

static void conn_event(chorus_store_server_t *srv, conn_t *c, uint32_t ev) {
  if (c->state == CONN_DEAD) return;
  if (ev & EPOLLERR) {
    int err = 0;
    socklen_t sl = sizeof err;
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl);
    conn_lost(srv, c, err ? err : EIO);
    return;
  }
  if ((ev & EPOLLOUT) && conn_flush(srv, c) < 0) return;
  if ((ev & (EPOLLRDHUP | EPOLLHUP)) && !conn_can_read(c)) {
    /* Not reading (parked, stalled or closing), so the goodbye would never be
     * seen by recv(): the client gave up. */
    conn_drop(srv, c, CHORUS__LOG_DEBUG, "peer closed the connection while %s",
              c->waiting_on ? "waiting for a key" : "not being read");
    return;
  }
  conn_service(srv, c);
}

/* Keeps the handshaking list sorted by deadline (it nearly always goes at the
 * end). */
static void handshaking_insert(chorus_store_server_t *srv, conn_t *c) {
  link_t *pos = srv->handshaking.prev;
  while (pos != &srv->handshaking && CONTAINER_OF(pos, conn_t, timer_link)->deadline > c->deadline)
    pos = pos->prev;
  list_insert_after(pos, &c->timer_link);
}

static void conn_accept(chorus_store_server_t *srv, int fd) {
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    return;
  }
  c->fd = fd;
  c->state = CONN_HELLO;
  list_init(&c->all_link);
  list_init(&c->timer_link);
  list_init(&c->wait_link);
  char host[64];
  int port = 0;
  if (chorus__net_peer_addr(fd, host, sizeof host, &port) == 0)
    snprintf(c->peer, sizeof c->peer, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  else
    snprintf(c->peer, sizeof c->peer, "unknown peer (fd %d)", fd);
  chorus__net_set_nodelay(fd);
  int rc = chorus__random_bytes(c->nonce, sizeof c->nonce);
  if (rc < 0) {
    CHORUS_WARN(CHORUS__SUB_STORE, "%s: no randomness for %s: %s", srv->name, c->peer,
                strerror(-rc));
    close(fd);
    conn_free(c);
    return;
  }
  size_t at = chorus__sbuf_frame_begin(&c->out);
  chorus__sbuf_raw(&c->out, CHORUS__STORE_MAGIC, 4);
  chorus__sbuf_u32(&c->out, CHORUS__STORE_VERSION);
  chorus__sbuf_raw(&c->out, c->nonce, sizeof c->nonce);
  chorus__sbuf_frame_end(&c->out, at);
  c->events = EPOLLIN | EPOLLRDHUP | EPOLLOUT;
  struct epoll_event e = {.events = c->events, .data.ptr = c};
  if (c->out.oom || epoll_ctl(srv->epoll_fd, EPOLL_CTL_ADD, fd, &e) < 0) {
    CHORUS_WARN(CHORUS__SUB_STORE, "%s: cannot take connection from %s: %s", srv->name, c->peer,
                c->out.oom ? "out of memory" : strerror(errno));
    close(fd);
    conn_free(c);
    return;
  }
  c->deadline = chorus__now_ns() + (int64_t)atomic_load(&srv->handshake_ms) * 1000000;
  list_push_back(&srv->conns, &c->all_link);
  handshaking_insert(srv, c);
  srv->nconns++;
  CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: connection from %s", srv->name, c->peer);
  if (conn_flush(srv, c) < 0) return;
  conn_update_events(srv, c);
}

static void listen_pause(chorus_store_server_t *srv) {
  struct epoll_event e = {.events = 0, .data.ptr = &g_listen_tag};
  epoll_ctl(srv->epoll_fd, EPOLL_CTL_MOD, srv->listen_fd, &e);
  srv->listen_paused = 1;
  srv->listen_resume_at = chorus__now_ns() + (int64_t)ACCEPT_PAUSE_MS * 1000000;
}

static void listen_resume(chorus_store_server_t *srv) {
  if (!srv->listen_paused || chorus__now_ns() < srv->listen_resume_at) return;
  struct epoll_event e = {.events = EPOLLIN, .data.ptr = &g_listen_tag};
  epoll_ctl(srv->epoll_fd, EPOLL_CTL_MOD, srv->listen_fd, &e);
  srv->listen_paused = 0;
}

static void accept_ready(chorus_store_server_t *srv) {
  for (int i = 0; i < 64; i++) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      /* Out of descriptors or memory: level-triggered epoll would report the
       * pending connection again at once, so stop listening for a moment. */
      CHORUS_WARN(CHORUS__SUB_STORE, "%s: accept failed: %s; pausing new connections for %d ms",
                  srv->name, strerror(errno), ACCEPT_PAUSE_MS);
      listen_pause(srv);
      return;
    }
    if (srv->nconns >= CHORUS__STORE_MAX_CONNS) {
      int64_t now = chorus__now_ns();
      if (now - srv->last_refusal_warn > 1000000000) {
        srv->last_refusal_warn = now;
        CHORUS_WARN(CHORUS__SUB_STORE, "%s: %d connections open; refusing new ones", srv->name,
                    CHORUS__STORE_MAX_CONNS);
      }
      close(fd);
      continue;
    }
    conn_accept(srv, fd);
  }
}

/* Closes connections whose handshake deadline passed; returns the next
 * deadline or CHORUS__NO_DEADLINE. */
static int64_t expire_handshakes(chorus_store_server_t *srv) {
  int64_t now = chorus__now_ns();
  while (!list_empty(&srv->handshaking)) {
    conn_t *c = CONTAINER_OF(srv->handshaking.next, conn_t, timer_link);
    if (c->deadline > now) return c->deadline;
    if (c->state == CONN_HELLO)
      conn_drop(srv, c, CHORUS__LOG_WARN, "no handshake within %d ms",
                atomic_load(&srv->handshake_ms));
    else
      conn_drop(srv, c, CHORUS__LOG_DEBUG, "verdict not collected in time");
  }
  return CHORUS__NO_DEADLINE;
}

static void free_dead(chorus_store_server_t *srv) {
  while (!list_empty(&srv->dead)) {
    conn_t *c = CONTAINER_OF(srv->dead.next, conn_t, all_link);
    list_remove(&c->all_link);
    conn_free(c);
  }
}

static void *server_main(void *arg) {
  chorus_store_server_t *srv = arg;
  struct epoll_event evs[64];
  while (!srv->stopping) {
    int64_t next = expire_handshakes(srv);
    if (srv->listen_paused && srv->listen_resume_at < next) next = srv->listen_resume_at;
    free_dead(srv);
    int timeout = !list_empty(&srv->again)      ? 0
                  : next == CHORUS__NO_DEADLINE ? -1
                                                : chorus__ms_left(next);
    int n = epoll_wait(srv->epoll_fd, evs, (int)CHORUS__ARRAY_LEN(evs), timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      CHORUS_WARN(CHORUS__SUB_STORE, "%s: epoll_wait failed: %s; the store stops serving",
                  srv->name, strerror(errno));
      break;
    }
    for (int i = 0; i < n; i++) {
      void *p = evs[i].data.ptr;
      if (p == &g_stop_tag)
        srv->stopping = 1;
      else if (p == &g_listen_tag)
        accept_ready(srv);
      else
        conn_event(srv, p, evs[i].events);
    }
    /* Connections with work left from the last iteration, then requests
     * woken by keys set in this batch (and by those they set). */
    list_splice(&srv->ready, &srv->again);
    while (!list_empty(&srv->ready)) {
      conn_t *c = CONTAINER_OF(srv->ready.next, conn_t, wait_link);
      conn_service(srv, c);
    }
    listen_resume(srv);
  }
  while (!list_empty(&srv->conns)) conn_close(srv, CONTAINER_OF(srv->conns.next, conn_t, all_link));
  free_dead(srv);
  return NULL;
}

/* --------------------------------------------------------------- public */

static void server_free(chorus_store_server_t *srv) {
  table_free(srv);
  if (srv->listen_fd >= 0) close(srv->listen_fd);
  if (srv->epoll_fd >= 0) close(srv->epoll_fd);
  if (srv->stop_fd >= 0) close(srv->stop_fd);
  free(srv);
}

chorus_result_t chorus_store_server_start(const char *host, int port, const char *secret,
                                          chorus_store_server_t **server) {
  if (!server) return CHORUS_ERR_INVALID_ARG;
  *server = NULL;
  chorus__key_t key;
  char why[400];
  if (chorus__key_for_api(secret, &key, why, sizeof why) < 0) {
    CHORUS_WARN(CHORUS__SUB_STORE, "store server %s:%d: %s", host && *host ? host : "*", port,
                why);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus_result_t res = chorus__store_server_start_key(host, port, &key, server);
  chorus__wipe(&key, sizeof key);
  return res;
}

chorus_result_t chorus__store_server_start_key(const char *host, int port,
                                               const chorus__key_t *key,
                                               chorus_store_server_t **server) {
  if (!server || !key) return CHORUS_ERR_INVALID_ARG;
  *server = NULL;
  const char *shown = host && *host ? host : "*";
  if (port < 0 || port > 65535) {
    CHORUS_WARN(CHORUS__SUB_STORE, "store server %s:%d: invalid port", shown, port);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus_store_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) return CHORUS_ERR_NO_MEMORY;
  srv->listen_fd = srv->epoll_fd = srv->stop_fd = -1;
  list_init(&srv->conns);
  list_init(&srv->handshaking);
  list_init(&srv->ready);
  list_init(&srv->again);
  list_init(&srv->dead);
  atomic_init(&srv->handshake_ms, HANDSHAKE_MS_DEFAULT);
  srv->auth_key = *key;
  chorus_result_t res = CHORUS_ERR_SYSTEM;
  const char *what = NULL;
  int rc = chorus__random_bytes(srv->hash_key, sizeof srv->hash_key);
  if (rc < 0) {
    what = "getrandom";
    goto fail;
  }
  srv->nbuckets = INITIAL_BUCKETS;
  srv->buckets = calloc(srv->nbuckets, sizeof *srv->buckets);
  if (!srv->buckets) {
    res = CHORUS_ERR_NO_MEMORY;
    rc = -ENOMEM;
    what = "allocation";
    goto fail;
  }
  srv->listen_fd = rc = chorus__net_listen(host, port, LISTEN_BACKLOG, &srv->port);
  if (rc < 0) {
    res = CHORUS_ERR_STORE;
    what = "listen";
    goto fail;
  }
  snprintf(srv->name, sizeof srv->name,
           strchr(shown, ':') ? "store server [%s]:%d" : "store server %s:%d", shown, srv->port);
  if ((rc = chorus__net_set_nonblock(srv->listen_fd, 1)) < 0) {
    what = "fcntl";
    goto fail;
  }
  srv->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  srv->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (srv->epoll_fd < 0 || srv->stop_fd < 0) {
    rc = -errno;
    what = srv->epoll_fd < 0 ? "epoll_create1" : "eventfd";
    goto fail;
  }
  struct epoll_event le = {.events = EPOLLIN, .data.ptr = &g_listen_tag};
  struct epoll_event se = {.events = EPOLLIN, .data.ptr = &g_stop_tag};
  if (epoll_ctl(srv->epoll_fd, EPOLL_CTL_ADD, srv->listen_fd, &le) < 0 ||
      epoll_ctl(srv->epoll_fd, EPOLL_CTL_ADD, srv->stop_fd, &se) < 0) {
    rc = -errno;
    what = "epoll_ctl";
    goto fail;
  }
  /* The server thread takes no signals: they belong to the application's
   * threads. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = -pthread_create(&srv->thread, NULL, server_main, srv);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc < 0) {
    what = "pthread_create";
    goto fail;
  }
  CHORUS_INFO(CHORUS__SUB_STORE, "%s: listening", srv->name);
  *server = srv;
  return CHORUS_OK;

fail:
  CHORUS_WARN(CHORUS__SUB_STORE, "store server %s:%d: cannot start: %s: %s", shown, port, what,
              strerror(-rc));
  server_free(srv);
  return res;
}

int chorus_store_server_port(const chorus_store_server_t *server) {
  return server ? server->port : -1;
}

void chorus_store_server_stop(chorus_store_server_t *server) {
  if (!server) return;
  uint64_t one = 1;
  while (write(server->stop_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
  pthread_join(server->thread, NULL);
  CHORUS_INFO(CHORUS__SUB_STORE, "%s: stopped", server->name);
  server_free(server);
}

void chorus__store_server_set_handshake_timeout(chorus_store_server_t *server, int timeout_ms) {
  if (server && timeout_ms > 0) atomic_store(&server->handshake_ms, timeout_ms);
}
