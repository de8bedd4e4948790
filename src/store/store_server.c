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
 * EPOLLIN, EPOLLOUT, the again list, or input budget coming free), so no
 * buffered request is stranded.
 * Closed connections are unlinked at once but freed only at the end of the
 * loop iteration, so an event of the same batch never touches freed memory.
 *
 * Untrusted input.  A new connection first receives a random nonce and must
 * answer with its own nonce and HMAC-SHA256(job key, both nonces) within the
 * handshake timeout (5 s by default; the server then proves the key back,
 * store.h); until then its frames may not exceed the answer's 72 bytes, so a
 * stranger can make the server hold at most a few dozen bytes.  At most
 * HANDSHAKING_MAX connections handshake at once: a new one pushes out the
 * oldest, like a short queue, so a flood of silent strangers delays a real
 * client by one queue's worth at most.  Every length in a request is checked
 * against the frame and the limits in store.h and store_proto.h, and the body
 * must be consumed exactly.  Anything malformed closes that one connection
 * with a WARN naming the peer's address:port.  Allocation failures close the
 * connection concerned, never the server.
 *
 * Limits.  Every resource a connection can hold is bounded, by the CHORUS_
 * variables of util/env.def (read once, when the server starts); each limit,
 * when hit, is logged with its variable's name, rate-limited where a client
 * can hit it again and again.
 *   Descriptors: at most CHORUS__STORE_MAX_CONNS connections, at most
 *   CHORUS_STORE_CONNS_PER_ADDR of them from one IP address, and none that
 *   would bring the process within CHORUS_STORE_FD_RESERVE descriptors of
 *   RLIMIT_NOFILE, so that its own sockets still open.  Refused connections
 *   are accepted and closed at once so the listening socket never stalls the
 *   loop; when accept() itself fails (EMFILE) listening pauses briefly
 *   instead of spinning.
 *   Time: an authenticated connection with nothing in flight (no parked
 *   request, no unsent response, no partial frame) that has been silent for
 *   CHORUS_STORE_IDLE_TIMEOUT_MS is closed (INFO: clients reconnect and resend
 *   transparently, store_client.c).  One that sent part of a frame, or leaves
 *   its responses unread, and nothing more for CHORUS_STORE_FRAME_TIMEOUT_MS
 *   is closed (WARN).  Parked requests are not timed: the client's deadline
 *   is.  One sweep over the connections runs at the earliest deadline.
 *   Input memory: a frame larger than IN_CHUNK first reserves its announced
 *   length from CHORUS_STORE_BUFFER_MAX (shared by all connections); its
 *   buffer then grows only as bytes arrive and never past the frame's end, so
 *   a connection buffers one frame at most.  When the reservation does not
 *   fit, the connection is paused (not read: TCP's flow control holds the
 *   sender back) rather than failed, and paused connections are resumed in
 *   FIFO order whenever reservations are released (see buffer_resume).  A
 *   frame larger than the whole budget could never fit: its body is read and
 *   discarded and the request answered with an error naming the variable.
 *   Stored data: CHORUS_STORE_DATA_MAX bytes of keys and values and
 *   CHORUS_STORE_KEYS_MAX entries (placeholders of awaited keys included);
 *   a request that would pass one is answered with an error naming it, and
 *   the connection stays.
 *   Output: a client that stops reading its responses is not read from
 *   either once its output buffer passes OUT_HIGH_WATER (and is closed after
 *   CHORUS_STORE_FRAME_TIMEOUT_MS without progress).
 */
#include "store.h"
#include "store_proto.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/env.h"
#include "util/exit.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

#define CHORUS__STORE_MAX_CONNS 4096
#define HANDSHAKE_MS_DEFAULT 5000
/* Stop processing a client's requests while more than this is unsent. */
#define OUT_HIGH_WATER ((size_t)256 << 10)
/* Output buffers larger than this are released once empty (input buffers
 * larger than IN_CHUNK always are: they hold a share of the input budget). */
#define BUF_KEEP ((size_t)64 << 10)
/* Initial input buffer of an authenticated connection; frames up to this
 * size need no share of CHORUS_STORE_BUFFER_MAX. */
#define IN_CHUNK ((size_t)4096)
/* recv() calls and requests per connection per turn before others get one. */
#define READS_PER_TURN 16
#define FRAMES_PER_TURN 64
#define INITIAL_BUCKETS 64
#define LISTEN_BACKLOG 1024
#define ACCEPT_PAUSE_MS 100
/* Connections that may be handshaking at once; a new one drops the oldest. */
#define HANDSHAKING_MAX 256
/* Buckets of the per-address connection counts (at most MAX_CONNS entries). */
#define ADDR_BUCKETS 1024
/* Sweeps for timed-out connections run at most this often. */
#define SWEEP_MIN_NS ((int64_t)10 * 1000000)
/* The defaults of util/env.def, for values <= 0 where 0 cannot mean "off". */
#define FRAME_TIMEOUT_MS_DEFAULT 30000
#define BUFFER_MAX_DEFAULT ((size_t)256 << 20)
#define DATA_MAX_DEFAULT ((size_t)1 << 30)
#define KEYS_MAX_DEFAULT ((size_t)1000000)
#define CONNS_PER_ADDR_DEFAULT 1024

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

/* Connections from one IP address (CHORUS_STORE_CONNS_PER_ADDR). */
typedef struct addr_count {
  struct addr_count *next; /* hash chain */
  uint64_t hash;
  long n;
  char host[64];
} addr_count_t;

typedef struct conn {
  int fd;
  int state;
  uint32_t events;     /* epoll mask currently registered */
  int64_t deadline;    /* end of the handshake (HELLO and CLOSING) */
  link_t all_link;     /* server's conns list, or its dead list once closed */
  link_t timer_link;   /* server's handshaking list while HELLO or CLOSING */
  link_t wait_link;    /* an entry's waiters, or the ready or again list */
  link_t pause_link;   /* server's paused list while waiting for input budget */
  entry_t *waiting_on; /* entry whose waiters hold wait_link, or NULL */
  int ready;           /* wait_link is on the ready or again list */
  int eof;             /* the peer closed its side */
  uint32_t resume_idx; /* WAIT: keys [0, resume_idx) were seen present */
  size_t resume_off;   /* WAIT: body offset of key resume_idx; 0: fresh */
  uint8_t nonce[CHORUS__STORE_NONCE_LEN];
  uint8_t *in; /* received bytes; frames start at in_off */
  size_t in_off, in_len, in_cap;
  size_t reserved;    /* bytes of CHORUS_STORE_BUFFER_MAX held for the frame */
  size_t want;        /* while paused: the frame's size, to reserve on resuming */
  size_t skip;        /* body bytes of an over-budget frame still to discard */
  int64_t active_ns;  /* last byte received or sent (or resumption) */
  addr_count_t *addr; /* this connection's count of its address */
  chorus__sbuf_t out; /* responses; bytes before out_off are sent */
  size_t out_off;
  char peer[80]; /* "address:port" for logs */
} conn_t;

/* The CHORUS_STORE_* limits (util/env.def). */
typedef struct limits {
  int64_t idle_ns;  /* 0: never */
  int64_t frame_ns; /* > 0 */
  size_t buffer_max, data_max, keys_max;
  long conns_per_addr; /* > 0 */
  long fd_reserve;     /* >= 0 */
} limits_t;

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
  size_t data_bytes; /* keys and values of present entries */
  link_t conns, handshaking, dead;
  link_t ready;  /* connections to run after the current batch of events */
  link_t again;  /* connections that used up their turn with work left */
  link_t paused; /* connections waiting for input budget, oldest first */
  size_t nconns, nhandshaking;
  size_t buffered; /* reserved input bytes, at most lim.buffer_max */
  limits_t lim;
  int64_t next_sweep; /* earliest idle/frame deadline, or CHORUS__NO_DEADLINE */
  addr_count_t *addrs[ADDR_BUCKETS];
  atomic_int handshake_ms;
  int listen_paused;
  int64_t listen_resume_at;
  chorus__ratelimit_t reject_log; /* strangers: handshakes, refused connections */
  chorus__ratelimit_t limit_log;  /* limits hit by authenticated clients */
  int stopping;
  chorus__exit_hook_t exit_hook; /* stops the thread if the process exits first */
  int thread_joined;
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
  if (e->present) {
    srv->npresent--;
    srv->data_bytes -= e->klen + e->vlen;
  }
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
  if (e->present) srv->data_bytes -= e->klen + e->vlen;
  srv->data_bytes += e->klen + vlen;
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

/* ----------------------------------------------------- per-address counts */

/* The count of host, added at 0 if needed; NULL when memory is short. */
static addr_count_t *addr_get(chorus_store_server_t *srv, const char *host) {
  size_t len = strlen(host);
  uint64_t h = chorus__siphash(srv->hash_key, host, len);
  addr_count_t **slot = &srv->addrs[h % ADDR_BUCKETS];
  for (addr_count_t *a = *slot; a; a = a->next)
    if (a->hash == h && !strcmp(a->host, host)) return a;
  addr_count_t *a = calloc(1, sizeof *a);
  if (!a) return NULL;
  a->hash = h;
  snprintf(a->host, sizeof a->host, "%s", host);
  a->next = *slot;
  *slot = a;
  return a;
}

/* Forgets a count that has dropped to zero. */
static void addr_maybe_drop(chorus_store_server_t *srv, addr_count_t *a) {
  if (a->n > 0) return;
  for (addr_count_t **p = &srv->addrs[a->hash % ADDR_BUCKETS]; *p; p = &(*p)->next) {
    if (*p == a) {
      *p = a->next;
      break;
    }
  }
  free(a);
}

static void addrs_free(chorus_store_server_t *srv) {
  for (size_t i = 0; i < ADDR_BUCKETS; i++) {
    while (srv->addrs[i]) {
      addr_count_t *a = srv->addrs[i];
      srv->addrs[i] = a->next;
      free(a);
    }
  }
}

/* ------------------------------------------------------------ input budget
 *
 * A frame larger than IN_CHUNK reserves its whole announced size before its
 * body is read past the first chunk, and keeps the reservation until it has
 * been handled (or the connection closes).  A connection whose reservation
 * does not fit holds none and is paused.  So paused connections never hold
 * budget that others wait for, and every reservation comes back: its frame
 * either arrives and is handled, or the connection goes silent and the frame
 * timeout closes it; a parked request keeps its frame until its key is set or
 * its client gives up.  Smaller frames need no reservation: the IN_CHUNK
 * every authenticated connection may keep is bounded by the connection
 * limits instead. */

static int conn_paused(const conn_t *c) {
  return c->pause_link.next != &c->pause_link;
}

/* Resumes paused connections in FIFO order while the oldest one's frame
 * fits, reserving for it at once so that newcomers cannot take the freed
 * budget first.  FIFO rather than smallest-first: a large frame is never
 * passed over forever by a stream of smaller ones. */
static void buffer_resume(chorus_store_server_t *srv) {
  while (!list_empty(&srv->paused)) {
    conn_t *c = CONTAINER_OF(srv->paused.next, conn_t, pause_link);
    if (c->want - c->reserved > srv->lim.buffer_max - srv->buffered) return;
    list_remove(&c->pause_link);
    srv->buffered += c->want - c->reserved;
    c->reserved = c->want;
    c->active_ns = chorus__now_ns(); /* its silence was ours: restart its clock */
    CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: resuming %s (a %zu-byte request)", srv->name, c->peer,
                 c->want);
    if (!c->ready) {
      c->ready = 1;
      list_push_back(&srv->ready, &c->wait_link);
    }
  }
}

/* Returns the connection's reservation (its frame is done or it closed). */
static void buffer_release(chorus_store_server_t *srv, conn_t *c) {
  if (!c->reserved) return;
  srv->buffered -= c->reserved;
  c->reserved = 0;
  buffer_resume(srv);
}

/* Reserves frame bytes for the frame being received.  Returns 1 when they
 * are reserved, 0 when the connection was paused instead. */
static int buffer_admit(chorus_store_server_t *srv, conn_t *c, size_t frame) {
  if (c->reserved >= frame) return 1;
  if (list_empty(&srv->paused) && frame - c->reserved <= srv->lim.buffer_max - srv->buffered) {
    srv->buffered += frame - c->reserved;
    c->reserved = frame;
    return 1;
  }
  c->want = frame;
  list_push_back(&srv->paused, &c->pause_link);
  chorus__log_limited(&srv->limit_log, CHORUS__SUB_STORE,
                      "%s: CHORUS_STORE_BUFFER_MAX=%zu bytes reached (%zu reserved for partly "
                      "received requests); not reading %s's %zu-byte request until some are done",
                      srv->name, srv->lim.buffer_max, srv->buffered, c->peer, frame);
  return 0;
}

/* ----------------------------------------------------------- connections */

static void handshaking_remove(chorus_store_server_t *srv, conn_t *c) {
  if (c->timer_link.next == &c->timer_link) return;
  list_remove(&c->timer_link);
  srv->nhandshaking--;
}

/* Closes a connection and unlinks it from everything but the dead list, where
 * it stays until the end of the loop iteration so that events of the current
 * batch can still look at it (they see CONN_DEAD and skip it). */
static void conn_close(chorus_store_server_t *srv, conn_t *c) {
  if (c->state == CONN_DEAD) return;
  epoll_ctl(srv->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = -1;
  c->state = CONN_DEAD;
  handshaking_remove(srv, c);
  list_remove(&c->wait_link);
  list_remove(&c->pause_link);
  if (c->addr) {
    c->addr->n--;
    addr_maybe_drop(srv, c->addr);
    c->addr = NULL;
  }
  c->ready = 0;
  if (c->waiting_on) {
    entry_t *e = c->waiting_on;
    c->waiting_on = NULL;
    entry_maybe_drop(srv, e);
  }
  list_remove(&c->all_link);
  list_push_back(&srv->dead, &c->all_link);
  srv->nconns--;
  buffer_release(srv, c); /* last: it may resume paused connections */
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
  int partial =
      c->skip || (avail > 0 && (avail < 4 || avail - 4 < chorus__le32_get(c->in + c->in_off)));
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
         !conn_paused(c) && conn_unsent(c) <= OUT_HIGH_WATER;
}

/* What an authenticated connection is timed for now. */
enum { TIMER_NONE, TIMER_IDLE, TIMER_PARTIAL, TIMER_UNREAD };

/* Returns the connection's timer and sets *deadline to when it fires.
 * Parked and paused connections are not timed: they wait on others. */
static int conn_timer(const chorus_store_server_t *srv, const conn_t *c, int64_t *deadline) {
  if (c->state != CONN_READY || c->waiting_on || conn_paused(c)) return TIMER_NONE;
  int timer = conn_unsent(c)                         ? TIMER_UNREAD
              : c->skip || c->in_len > c->in_off ? TIMER_PARTIAL
              : srv->lim.idle_ns                 ? TIMER_IDLE
                                                 : TIMER_NONE;
  if (timer != TIMER_NONE)
    *deadline = c->active_ns + (timer == TIMER_IDLE ? srv->lim.idle_ns : srv->lim.frame_ns);
  return timer;
}

/* Brings the next sweep forward to the connection's deadline; called at the
 * end of every turn, which is where a connection's timer can change. */
static void conn_arm(chorus_store_server_t *srv, const conn_t *c) {
  int64_t deadline;
  if (conn_timer(srv, c, &deadline) != TIMER_NONE && deadline < srv->next_sweep)
    srv->next_sweep = deadline;
}

/* Registers the epoll interest the connection needs now.  Returns 0, or -1
 * when the connection was closed. */
static int conn_update_events(chorus_store_server_t *srv, conn_t *c) {
  if (c->state == CONN_DEAD) return -1;
  conn_arm(srv, c);
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
      c->active_ns = chorus__now_ns();
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

/* A request that would pass a limit: answered with the reason, which names
 * the limit's variable; logged, rate-limited (a client may keep trying). */
static int reply_limit(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int reply_limit(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...) {
  char why[CHORUS__STORE_MAX_REASON];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  chorus__log_limited(&srv->limit_log, CHORUS__SUB_STORE, "%s: refusing a request from %s: %s",
                      srv->name, c->peer, why);
  return reply_bad_request(srv, c, "%s", why);
}

/* Checks that storing vlen bytes under a key of klen bytes whose entry is e
 * (NULL: a new key) keeps the store within CHORUS_STORE_KEYS_MAX and
 * CHORUS_STORE_DATA_MAX.  Returns -1 when it does; otherwise answers the
 * request with the limit and returns RQ_DONE or RQ_CLOSED. */
static int refuse_if_full(chorus_store_server_t *srv, conn_t *c, const entry_t *e, size_t klen,
                          size_t vlen) {
  if (!e && srv->nentries >= srv->lim.keys_max)
    return reply_limit(srv, c, "store full: CHORUS_STORE_KEYS_MAX=%zu keys", srv->lim.keys_max);
  size_t old = e && e->present ? klen + e->vlen : 0, add = klen + vlen;
  if (add > old && add - old > srv->lim.data_max - CHORUS__MIN(srv->data_bytes, srv->lim.data_max))
    return reply_limit(srv, c,
                       "store full: CHORUS_STORE_DATA_MAX=%zu bytes (%zu stored; this needs %zu "
                       "more)",
                       srv->lim.data_max, srv->data_bytes, add - old);
  return -1;
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

/* Parks the connection's head request until key exists.  The placeholder
 * entry that holds the waiters counts toward CHORUS_STORE_KEYS_MAX. */
static int wait_on(chorus_store_server_t *srv, conn_t *c, const uint8_t *key, size_t klen) {
  entry_t *e = table_find(srv, key, klen);
  if (!e && srv->nentries >= srv->lim.keys_max) {
    c->resume_idx = 0; /* the WAIT is answered: the next frame starts fresh */
    c->resume_off = 0;
    return reply_limit(srv, c, "store full: CHORUS_STORE_KEYS_MAX=%zu keys", srv->lim.keys_max);
  }
  if (!e) e = table_find_or_add(srv, key, klen);
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
    handshaking_remove(srv, c);
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
      entry_t *e = table_find(srv, key, klen);
      int full = refuse_if_full(srv, c, e, klen, vlen);
      if (full >= 0) return full;
      if (!e) e = table_find_or_add(srv, key, klen);
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
      int full = refuse_if_full(srv, c, e, klen, (size_t)tlen);
      if (full >= 0) return full;
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
      int full = refuse_if_full(srv, c, e, klen, vlen2);
      if (full >= 0) return full;
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
        srv->data_bytes -= e->klen + e->vlen;
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

/* Drops the frame just handled (n bytes) from the input buffer.  A buffer
 * larger than IN_CHUNK held that frame alone (conn_read stops at its end): it
 * is freed and its reservation returned, which may resume paused
 * connections. */
static void conn_consume(chorus_store_server_t *srv, conn_t *c, size_t n) {
  c->in_off += n;
  if (c->in_off < c->in_len) return;
  c->in_off = c->in_len = 0;
  if (c->in_cap > IN_CHUNK) {
    free(c->in);
    c->in = NULL;
    c->in_cap = 0;
  }
  buffer_release(srv, c);
}

/* A frame larger than the whole of CHORUS_STORE_BUFFER_MAX could never be
 * admitted: its request is answered with the limit now and its body, of
 * which at most the first chunk is buffered, is read and thrown away. */
static int conn_refuse_frame(chorus_store_server_t *srv, conn_t *c, uint32_t len) {
  size_t avail = c->in_len - c->in_off;
  c->skip = 4 + (size_t)len - avail;
  c->in_off = c->in_len = 0;
  return reply_limit(srv, c,
                     "request of %" PRIu32 " bytes exceeds CHORUS_STORE_BUFFER_MAX=%zu bytes", len,
                     srv->lim.buffer_max);
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
    if (c->skip || avail < 4) return PF_NEED_MORE;
    uint32_t len = chorus__le32_get(c->in + c->in_off);
    uint32_t limit = c->state == CONN_HELLO ? CHORUS__STORE_AUTH_LEN : CHORUS__STORE_MAX_FRAME;
    if (len > limit) {
      conn_drop(srv, c, CHORUS__LOG_WARN,
                "frame of %" PRIu32 " bytes exceeds the limit of %" PRIu32 "%s", len, limit,
                c->state == CONN_HELLO
                    ? " before authentication: not a chorus client (a torch TCPStore, from a "
                      "script under chorusrun that does not import chorus.torch before "
                      "init_process_group?)"
                    : "");
      return PF_CLOSED;
    }
    if (len == 0) {
      conn_drop(srv, c, CHORUS__LOG_WARN, "empty frame");
      return PF_CLOSED;
    }
    if (avail - 4 < len) {
      size_t frame = 4 + (size_t)len;
      if (c->state != CONN_READY || frame <= IN_CHUNK || frame <= srv->lim.buffer_max)
        return PF_NEED_MORE;
      if (*budget == 0) return PF_BUDGET;
      --*budget;
      if (conn_refuse_frame(srv, c, len) == RQ_CLOSED) return PF_CLOSED;
      continue;
    }
    if (*budget == 0) return PF_BUDGET;
    --*budget;
    const uint8_t *body = c->in + c->in_off + 4;
    int rc = c->state == CONN_HELLO ? conn_handshake(srv, c, body, len)
                                    : conn_request(srv, c, body, len);
    if (rc == RQ_CLOSED) return PF_CLOSED;
    if (rc == RQ_WAIT) return PF_STALLED;
    conn_consume(srv, c, 4 + (size_t)len);
  }
}

/* One recv() of at most len bytes into dst: the bytes read, 0 when none
 * are available or the peer closed (c->eof), -1 when the connection was
 * closed on an error. */
static ssize_t conn_recv(chorus_store_server_t *srv, conn_t *c, void *dst, size_t len) {
  for (;;) {
    ssize_t n = recv(c->fd, dst, len, 0);
    if (n > 0) {
      c->active_ns = chorus__now_ns();
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

/* Reads and throws away up to the rest of a refused frame's body.  Returns
 * like conn_read. */
static ssize_t conn_discard(chorus_store_server_t *srv, conn_t *c) {
  uint8_t sink[16384];
  ssize_t n = conn_recv(srv, c, sink, CHORUS__MIN(c->skip, sizeof sink));
  if (n > 0) c->skip -= (size_t)n;
  return n;
}

/* One recv() into the input buffer, which grows toward the size of the frame
 * being received as its bytes arrive.  A frame larger than IN_CHUNK must
 * first reserve its size from the input budget (or the connection pauses),
 * and is read up to its end only, so that its buffer holds it alone.  Returns
 * the bytes read, 0 when none are available (or the peer closed: c->eof, or
 * the connection paused), or -1 when the connection was closed. */
static ssize_t conn_read(chorus_store_server_t *srv, conn_t *c) {
  if (c->skip) return conn_discard(srv, c);
  if (c->in_off) {
    memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
    c->in_len -= c->in_off;
    c->in_off = 0;
  }
  size_t target, end = SIZE_MAX;
  if (c->state == CONN_HELLO) {
    target = 4 + CHORUS__STORE_AUTH_LEN; /* nothing larger is accepted yet */
  } else {
    /* conn_process has checked the length of a complete header. */
    size_t frame = c->in_len >= 4 ? 4 + (size_t)chorus__le32_get(c->in) : 0;
    if (frame > IN_CHUNK) {
      if (!buffer_admit(srv, c, frame)) return 0;
      end = frame;
    }
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
  end = CHORUS__MIN(end, c->in_cap);
  ssize_t n = conn_recv(srv, c, c->in + c->in_len, end - c->in_len);
  if (n > 0) c->in_len += (size_t)n;
  return n;
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
      if (c->skip)
        conn_drop(srv, c, CHORUS__LOG_WARN,
                  "peer closed in the middle of a refused frame (%zu bytes short)", c->skip);
      else if (partial && rc == PF_NEED_MORE)
        conn_drop(srv, c, CHORUS__LOG_WARN, "peer closed in the middle of a frame (%zu bytes)",
                  partial);
      else if (c->state == CONN_HELLO)
        conn_drop(srv, c, CHORUS__LOG_INFO, "peer closed before the handshake");
      else
        conn_drop(srv, c, CHORUS__LOG_DEBUG, "peer closed the connection");
      return;
    }
    if (rc == PF_STALLED) {
      if (c->waiting_on || conn_paused(c) || c->state != CONN_READY) break;
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

/* Frees a connection that never made it into the lists. */
static void conn_discard_new(chorus_store_server_t *srv, conn_t *c) {
  close(c->fd);
  c->addr->n--;
  addr_maybe_drop(srv, c->addr);
  conn_free(c);
}

static void conn_accept(chorus_store_server_t *srv, int fd) {
  char host[64], peer[80];
  int port = 0;
  if (chorus__net_peer_addr(fd, host, sizeof host, &port) == 0) {
    snprintf(peer, sizeof peer, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  } else {
    snprintf(host, sizeof host, "?"); /* all unknown peers share one count */
    snprintf(peer, sizeof peer, "unknown peer (fd %d)", fd);
  }
  addr_count_t *a = addr_get(srv, host);
  if (!a || a->n >= srv->lim.conns_per_addr) {
    if (a)
      chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE,
                          "%s: %ld connections from %s already (CHORUS_STORE_CONNS_PER_ADDR); "
                          "refusing %s",
                          srv->name, a->n, host, peer);
    close(fd);
    return;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    addr_maybe_drop(srv, a);
    close(fd);
    return;
  }
  a->n++;
  c->addr = a;
  c->fd = fd;
  c->state = CONN_HELLO;
  list_init(&c->all_link);
  list_init(&c->timer_link);
  list_init(&c->wait_link);
  list_init(&c->pause_link);
  memcpy(c->peer, peer, sizeof c->peer);
  chorus__net_set_nodelay(fd);
  int rc = chorus__random_bytes(c->nonce, sizeof c->nonce);
  if (rc < 0) {
    CHORUS_WARN(CHORUS__SUB_STORE, "%s: no randomness for %s: %s", srv->name, c->peer,
                strerror(-rc));
    conn_discard_new(srv, c);
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
    conn_discard_new(srv, c);
    return;
  }
  /* A full handshake queue drops its oldest: a stranger that stays silent
   * loses its slot to the next comer rather than keeping everyone out. */
  if (srv->nhandshaking >= HANDSHAKING_MAX)
    conn_drop(srv, CONTAINER_OF(srv->handshaking.next, conn_t, timer_link), CHORUS__LOG_WARN,
              "%d connections are handshaking; dropping the oldest", HANDSHAKING_MAX);
  c->deadline = chorus__now_ns() + (int64_t)atomic_load(&srv->handshake_ms) * 1000000;
  c->active_ns = chorus__now_ns();
  list_push_back(&srv->conns, &c->all_link);
  handshaking_insert(srv, c);
  srv->nhandshaking++;
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

/* The lowest descriptor number at which new connections are refused to keep
 * CHORUS_STORE_FD_RESERVE descriptors free (INT_MAX: no limit).  Descriptors
 * are handed out lowest first, so when accept() returns number fd, at least
 * fd + 1 are open: refusing from RLIMIT_NOFILE - reserve on leaves the
 * reserve to the process's own sockets. */
static long fd_ceiling(const chorus_store_server_t *srv) {
  struct rlimit rl;
  if (srv->lim.fd_reserve <= 0 || getrlimit(RLIMIT_NOFILE, &rl) < 0 ||
      rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur > (rlim_t)INT_MAX)
    return INT_MAX;
  return (long)rl.rlim_cur - srv->lim.fd_reserve;
}

static void accept_ready(chorus_store_server_t *srv) {
  long ceiling = fd_ceiling(srv);
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
    if (fd >= ceiling) {
      chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE,
                          "%s: descriptor %d is within CHORUS_STORE_FD_RESERVE=%ld of the "
                          "process's limit (RLIMIT_NOFILE %ld); refusing new connections",
                          srv->name, fd, srv->lim.fd_reserve, ceiling + srv->lim.fd_reserve);
      close(fd);
      continue;
    }
    if (srv->nconns >= CHORUS__STORE_MAX_CONNS) {
      chorus__log_limited(&srv->reject_log, CHORUS__SUB_STORE,
                          "%s: %d connections open; refusing new ones", srv->name,
                          CHORUS__STORE_MAX_CONNS);
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

/* Closes an authenticated connection whose timer fired. */
static void conn_expire(chorus_store_server_t *srv, conn_t *c, int timer) {
  long long idle_ms = (long long)(srv->lim.idle_ns / 1000000);
  long long frame_ms = (long long)(srv->lim.frame_ns / 1000000);
  if (timer == TIMER_IDLE)
    conn_drop(srv, c, CHORUS__LOG_INFO,
              "idle for %lld ms (CHORUS_STORE_IDLE_TIMEOUT_MS); its client reconnects on its "
              "next call",
              idle_ms);
  else if (timer == TIMER_PARTIAL)
    conn_drop(srv, c, CHORUS__LOG_WARN,
              "sent part of a request (%zu bytes) and nothing more for %lld ms "
              "(CHORUS_STORE_FRAME_TIMEOUT_MS)",
              c->skip ? c->skip : c->in_len - c->in_off, frame_ms);
  else
    conn_drop(srv, c, CHORUS__LOG_WARN,
              "left %zu bytes of responses unread for %lld ms (CHORUS_STORE_FRAME_TIMEOUT_MS)",
              conn_unsent(c), frame_ms);
}

/* Closes authenticated connections whose idle or frame timer fired, at most
 * every SWEEP_MIN_NS; returns when to sweep next (CHORUS__NO_DEADLINE: no
 * timer runs; conn_arm brings it forward when one starts). */
static int64_t expire_connections(chorus_store_server_t *srv) {
  int64_t now = chorus__now_ns();
  if (now < srv->next_sweep) return srv->next_sweep;
  int64_t next = CHORUS__NO_DEADLINE;
  for (link_t *l = srv->conns.next; l != &srv->conns;) {
    conn_t *c = CONTAINER_OF(l, conn_t, all_link);
    l = l->next; /* closing c moves it to the dead list */
    int64_t deadline;
    int timer = conn_timer(srv, c, &deadline);
    if (timer == TIMER_NONE) continue;
    if (deadline <= now)
      conn_expire(srv, c, timer);
    else if (deadline < next)
      next = deadline;
  }
  if (next != CHORUS__NO_DEADLINE && next < now + SWEEP_MIN_NS) next = now + SWEEP_MIN_NS;
  srv->next_sweep = next;
  return next;
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
    next = CHORUS__MIN(next, expire_connections(srv));
    if (srv->listen_paused && srv->listen_resume_at < next) next = srv->listen_resume_at;
    free_dead(srv);
    /* The ready list is not empty when a closed connection's budget resumed
     * paused ones. */
    int timeout = !list_empty(&srv->again) || !list_empty(&srv->ready) ? 0
                  : next == CHORUS__NO_DEADLINE                         ? -1
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

/* The process exits with the server running (util/exit.h): its thread
 * stops (a handshake's HMAC must not race OpenSSL's cleanup); the rest
 * goes with the process.  Clients see their connections close. */
static void ring_stop(chorus_store_server_t *srv) {
  uint64_t one = 1;
  while (write(srv->stop_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

static void server_on_exit(void *arg) {
  chorus_store_server_t *srv = arg;
  ring_stop(srv);
  if (chorus__join_within(srv->thread, 1000) == 0) srv->thread_joined = 1;
}

static void server_free(chorus_store_server_t *srv) {
  table_free(srv);
  addrs_free(srv);
  if (srv->listen_fd >= 0) close(srv->listen_fd);
  if (srv->epoll_fd >= 0) close(srv->epoll_fd);
  if (srv->stop_fd >= 0) close(srv->stop_fd);
  free(srv);
}

static int64_t ms_to_ns(long ms) {
  return (int64_t)CHORUS__MIN(ms, (long)(INT64_MAX / 4000000)) * 1000000;
}

/* The CHORUS_STORE_* limits.  A value <= 0 means "never" for the idle
 * timeout and "no reserve" for the descriptor reserve; elsewhere it cannot
 * mean "off" (the limit is a safeguard), so it means the default. */
static void limits_load(limits_t *l) {
  const chorus__env_t *env = chorus__env();
  l->idle_ns = env->STORE_IDLE_TIMEOUT_MS > 0 ? ms_to_ns(env->STORE_IDLE_TIMEOUT_MS) : 0;
  l->frame_ns = ms_to_ns(env->STORE_FRAME_TIMEOUT_MS > 0 ? env->STORE_FRAME_TIMEOUT_MS
                                                          : FRAME_TIMEOUT_MS_DEFAULT);
  l->buffer_max = env->STORE_BUFFER_MAX > 0 ? (size_t)env->STORE_BUFFER_MAX : BUFFER_MAX_DEFAULT;
  l->data_max = env->STORE_DATA_MAX > 0 ? (size_t)env->STORE_DATA_MAX : DATA_MAX_DEFAULT;
  l->keys_max = env->STORE_KEYS_MAX > 0 ? (size_t)env->STORE_KEYS_MAX : KEYS_MAX_DEFAULT;
  l->conns_per_addr =
      env->STORE_CONNS_PER_ADDR > 0 ? env->STORE_CONNS_PER_ADDR : CONNS_PER_ADDR_DEFAULT;
  l->fd_reserve = env->STORE_FD_RESERVE > 0 ? env->STORE_FD_RESERVE : 0;
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
  list_init(&srv->paused);
  list_init(&srv->dead);
  limits_load(&srv->lim);
  srv->next_sweep = CHORUS__NO_DEADLINE;
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
  if (chorus__exit_hook_add(&srv->exit_hook, server_on_exit, srv) < 0) {
    server_on_exit(srv); /* the process is exiting already */
    if (srv->thread_joined) server_free(srv);
    return CHORUS_ERR_ABORTED;
  }
  CHORUS_INFO(CHORUS__SUB_STORE, "%s: listening", srv->name);
  CHORUS_DEBUG(CHORUS__SUB_STORE,
               "%s: limits: idle %lld ms, frame %lld ms, buffers %zu bytes, data %zu bytes, "
               "%zu keys, %ld connections per address, %ld descriptors kept free",
               srv->name, (long long)(srv->lim.idle_ns / 1000000),
               (long long)(srv->lim.frame_ns / 1000000), srv->lim.buffer_max, srv->lim.data_max,
               srv->lim.keys_max, srv->lim.conns_per_addr, srv->lim.fd_reserve);
  *server = srv;
  return CHORUS_OK;

fail:
  CHORUS_WARN(CHORUS__SUB_STORE, "store server %s:%d: cannot start: %s: %s", shown, port, what,
              strerror(-rc));
  server_free(srv);
  errno = rc < 0 ? -rc : 0; /* the cause, for the caller's message */
  return res;
}

int chorus_store_server_port(const chorus_store_server_t *server) {
  return server ? server->port : -1;
}

void chorus_store_server_stop(chorus_store_server_t *server) {
  if (!server) return;
  /* Past the exit handler, which stopped the thread: nothing else is
   * safe to do (OpenSSL may be gone), the process's end frees it. */
  if (chorus__exit_hook_remove(&server->exit_hook)) return;
  ring_stop(server);
  pthread_join(server->thread, NULL);
  CHORUS_INFO(CHORUS__SUB_STORE, "%s: stopped", server->name);
  server_free(server);
}

void chorus__store_server_set_handshake_timeout(chorus_store_server_t *server, int timeout_ms) {
  if (server && timeout_ms > 0) atomic_store(&server->handshake_ms, timeout_ms);
}
