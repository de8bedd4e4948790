/*
 * store_server.h - what the files of the store's server share: the
 * intrusive lists, the types of a key's entry, a connection and the server,
 * and the functions one file calls in another.  The opening comment of
 * store_server.c describes the design.  The files, one job each:
 *
 *   store_server.c        the server's life: start and stop, the epoll loop,
 *                         the listening socket, the timers' sweeps
 *   store_server_table.c  the keys' hash table, with its count of stored
 *                         bytes and entries, and the connections counted
 *                         per address
 *   store_server_conn.c   a connection from accept to close: the handshake,
 *                         its input and output buffers and their budget,
 *                         frames, replies and timers
 *   store_server_cmd.c    the commands (SET, GET, ADD, COMPARE_SET, CHECK,
 *                         DELETE, WAIT, NUM_KEYS)
 *
 * All of it runs on the server's thread, but for the eventfd that stop()
 * writes and the handshake timeout (an atomic).
 */
#ifndef CHORUS_STORE_STORE_SERVER_H
#define CHORUS_STORE_STORE_SERVER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "store.h"
#include "store_proto.h"
#include "util/exit.h"
#include "util/util.h"

/* Buckets of the per-address connection counts (at most MAX_CONNS entries). */
#define ADDR_BUCKETS 1024

/* ------------------------------------------------------- intrusive lists */

typedef struct link {
  struct link *prev, *next;
} link_t;

#define CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static inline void list_init(link_t *l) {
  l->prev = l->next = l;
}
static inline int list_empty(const link_t *head) {
  return head->next == head;
}

static inline void list_insert_after(link_t *pos, link_t *n) {
  n->prev = pos;
  n->next = pos->next;
  pos->next->prev = n;
  pos->next = n;
}

static inline void list_push_back(link_t *head, link_t *n) {
  list_insert_after(head->prev, n);
}

/* Moves every element of src to the end of dst. */
static inline void list_splice(link_t *dst, link_t *src) {
  if (list_empty(src)) return;
  src->next->prev = dst->prev;
  dst->prev->next = src->next;
  src->prev->next = dst;
  dst->prev = src->prev;
  list_init(src);
}

/* Unlinks n (a no-op when it is not in a list) and leaves it self-linked. */
static inline void list_remove(link_t *n) {
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
  chorus__store_stats_t stats; /* atomic: read by chorus__store_server_stats */
  int stopping;
  chorus__exit_hook_t exit_hook; /* stops the thread if the process exits first */
  int thread_joined;
};

/* Results of one request or handshake frame. */
enum { RQ_DONE, RQ_WAIT, RQ_CLOSED };
/* What an authenticated connection is timed for now. */
enum { TIMER_NONE, TIMER_IDLE, TIMER_PARTIAL, TIMER_UNREAD };

/* -------------------------------------------------- store_server_table.c */

/* The entry of key, or NULL. */
entry_t *chorus__store_table_find(chorus_store_server_t *srv, const uint8_t *key, size_t klen);
entry_t *chorus__store_table_find_or_add(chorus_store_server_t *srv, const uint8_t *key,
                                         size_t klen);
int chorus__store_entry_store(chorus_store_server_t *srv, entry_t *e, const void *val, size_t vlen);
void chorus__store_entry_maybe_drop(chorus_store_server_t *srv, entry_t *e);
void chorus__store_table_free(chorus_store_server_t *srv);
addr_count_t *chorus__store_addr_get(chorus_store_server_t *srv, const char *host);
void chorus__store_addr_maybe_drop(chorus_store_server_t *srv, addr_count_t *a);
void chorus__store_addrs_free(chorus_store_server_t *srv);

/* --------------------------------------------------- store_server_conn.c */

void chorus__store_conn_accept(chorus_store_server_t *srv, int fd);
void chorus__store_conn_event(chorus_store_server_t *srv, conn_t *c, uint32_t ev);
void chorus__store_conn_service(chorus_store_server_t *srv, conn_t *c);
int chorus__store_conn_timer(const chorus_store_server_t *srv, const conn_t *c, int64_t *deadline);
void chorus__store_conn_expire(chorus_store_server_t *srv, conn_t *c, int timer);
void chorus__store_conn_drop(chorus_store_server_t *srv, conn_t *c, int level, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void chorus__store_conn_close(chorus_store_server_t *srv, conn_t *c);
void chorus__store_conn_free(conn_t *c);
/* The replies to a request: each returns RQ_DONE, or RQ_CLOSED when the
 * connection was closed (out of memory). */
int chorus__store_reply_status(chorus_store_server_t *srv, conn_t *c);
int chorus__store_reply_value(chorus_store_server_t *srv, conn_t *c, const void *val, size_t len);
int chorus__store_reply_u8(chorus_store_server_t *srv, conn_t *c, uint8_t v);
/* TRY_GET's answer for a key that is there: 1, then the value. */
int chorus__store_reply_present(chorus_store_server_t *srv, conn_t *c, const void *val,
                                size_t len);
int chorus__store_reply_i64(chorus_store_server_t *srv, conn_t *c, int64_t v);
int chorus__store_reply_bad_request(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int chorus__store_reply_limit(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Closes the connection for want of memory: RQ_CLOSED. */
int chorus__store_out_of_memory(chorus_store_server_t *srv, conn_t *c);

/* ---------------------------------------------------- store_server_cmd.c */

/* Handles one request frame: RQ_DONE, RQ_WAIT or RQ_CLOSED. */
int chorus__store_request(chorus_store_server_t *srv, conn_t *c, const uint8_t *body, size_t len);

#endif
