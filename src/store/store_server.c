/*
 * store_server.c - the key-value store's server (chorus_store_server_*): its
 * life, from start to stop, and the epoll loop its thread runs (the
 * listening socket, the stop eventfd, the sweeps for timed-out
 * connections).  The rest of the server is in store_server_table.c (the
 * keys), store_server_conn.c (a connection) and store_server_cmd.c (the
 * commands); store_server.h lists what they share.
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
#include "store_server.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
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

/* A bound far above any descriptor limit seen in practice: the real one is
 * RLIMIT_NOFILE less CHORUS_STORE_FD_RESERVE (fd_ceiling). */
#define CHORUS__STORE_MAX_CONNS (1 << 22)
#define HANDSHAKE_MS_DEFAULT 5000
#define INITIAL_BUCKETS 64
/* The kernel cuts it to net.core.somaxconn (4096 on Linux >= 5.4): a
 * world's ranks connect at once. */
#define LISTEN_BACKLOG 65535
#define ACCEPT_PAUSE_MS 100
/* Sweeps for timed-out connections run at most this often. */
#define SWEEP_MIN_NS ((int64_t)10 * 1000000)
/* The defaults of util/env.def, for values <= 0 where 0 cannot mean "off". */
#define FRAME_TIMEOUT_MS_DEFAULT 30000
#define BUFFER_MAX_DEFAULT ((size_t)256 << 20)
#define DATA_MAX_DEFAULT ((size_t)1 << 30)
#define KEYS_MAX_DEFAULT ((size_t)1000000)
#define CONNS_PER_ADDR_DEFAULT 1024

/* The epoll data pointers of the two non-connection descriptors. */
static char g_listen_tag, g_stop_tag;

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

long chorus__store_server_capacity(const chorus_store_server_t *srv) {
  long ceiling = fd_ceiling(srv);
  return ceiling == INT_MAX ? CHORUS__STORE_MAX_CONNS : CHORUS__MAX(0, ceiling - 8);
}

chorus_result_t chorus__store_server_expect(chorus_store_server_t *srv, long clients, char *why,
                                            size_t cap) {
  long can = chorus__store_server_capacity(srv);
  if (clients <= can) return CHORUS_OK;
  /* Each client holds a descriptor as long as it lives: the soft limit
   * goes up as far as they need, within the hard one. */
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  rlim_t want = (rlim_t)(clients + srv->lim.fd_reserve + 64);
  if (rl.rlim_cur < want) {
    rlim_t old = rl.rlim_cur;
    rl.rlim_cur = want < rl.rlim_max ? want : rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
      CHORUS_INFO(CHORUS__SUB_STORE, "%s: RLIMIT_NOFILE raised from %ld to %ld for %ld clients",
                  srv->name, (long)old, (long)rl.rlim_cur, clients);
    else
      rl.rlim_cur = old;
    can = chorus__store_server_capacity(srv);
    if (clients <= can) return CHORUS_OK;
  }
  snprintf(why, cap, "%s: %ld clients will connect, but this process may open %ld descriptors "
           "(RLIMIT_NOFILE, hard limit %ld) less CHORUS_STORE_FD_RESERVE=%ld: about %ld "
           "clients. Raise the hard limit to at least %ld (ulimit -Hn as root, LimitNOFILE= in a "
           "systemd unit, nofile in /etc/security/limits.conf; the kernel's fs.nr_open bounds "
           "it), or serve the store elsewhere", srv->name, clients, (long)rl.rlim_cur,
           (long)rl.rlim_max, srv->lim.fd_reserve, can, clients + srv->lim.fd_reserve + 64);
  return CHORUS_ERR_SYSTEM;
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
    chorus__store_conn_accept(srv, fd);
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
      chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "no handshake within %d ms",
                atomic_load(&srv->handshake_ms));
    else
      chorus__store_conn_drop(srv, c, CHORUS__LOG_DEBUG, "verdict not collected in time");
  }
  return CHORUS__NO_DEADLINE;
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
    int timer = chorus__store_conn_timer(srv, c, &deadline);
    if (timer == TIMER_NONE) continue;
    if (deadline <= now)
      chorus__store_conn_expire(srv, c, timer);
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
    chorus__store_conn_free(c);
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
        chorus__store_conn_event(srv, p, evs[i].events);
    }
    /* Connections with work left from the last iteration, then requests
     * woken by keys set in this batch (and by those they set). */
    list_splice(&srv->ready, &srv->again);
    while (!list_empty(&srv->ready)) {
      conn_t *c = CONTAINER_OF(srv->ready.next, conn_t, wait_link);
      chorus__store_conn_service(srv, c);
    }
    listen_resume(srv);
  }
  while (!list_empty(&srv->conns))
    chorus__store_conn_close(srv, CONTAINER_OF(srv->conns.next, conn_t, all_link));
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
  chorus__store_table_free(srv);
  chorus__store_addrs_free(srv);
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

void chorus__store_server_stats(const chorus_store_server_t *srv, chorus__store_stats_t *out) {
  out->requests = __atomic_load_n(&srv->stats.requests, __ATOMIC_RELAXED);
  out->bytes_in = __atomic_load_n(&srv->stats.bytes_in, __ATOMIC_RELAXED);
  out->bytes_out = __atomic_load_n(&srv->stats.bytes_out, __ATOMIC_RELAXED);
  out->accepted = __atomic_load_n(&srv->stats.accepted, __ATOMIC_RELAXED);
}
