/*
 * store_server_conn.c - one connection of the store's server, from accept to
 * close: the handshake, the input buffer (read a frame at a time, within the
 * shared input budget CHORUS_STORE_BUFFER_MAX) and the output buffer, the
 * framing and the replies, a connection's turn of the loop, its timers,
 * and closing it.  The requests themselves are store_server_cmd.c's.
 */
#include "store_server.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/net.h"
#include "util/util.h"

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
/* Connections that may be handshaking at once; a new one drops the oldest. */
#define HANDSHAKING_MAX 256

/* Results of processing a connection's buffered frames. */
enum { PF_NEED_MORE, PF_STALLED, PF_BUDGET, PF_CLOSED };

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
void chorus__store_conn_close(chorus_store_server_t *srv, conn_t *c) {
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
    chorus__store_addr_maybe_drop(srv, c->addr);
    c->addr = NULL;
  }
  c->ready = 0;
  if (c->waiting_on) {
    entry_t *e = c->waiting_on;
    c->waiting_on = NULL;
    chorus__store_entry_maybe_drop(srv, e);
  }
  list_remove(&c->all_link);
  list_push_back(&srv->dead, &c->all_link);
  srv->nconns--;
  buffer_release(srv, c); /* last: it may resume paused connections */
}

void chorus__store_conn_free(conn_t *c) {
  free(c->in);
  chorus__sbuf_free(&c->out);
  free(c);
}

/* Logs why a connection is dropped, at the given level (CHORUS__LOG_WARN for
 * misbehaviour, lower for ordinary goodbyes), and closes it. */
void chorus__store_conn_drop(chorus_store_server_t *srv, conn_t *c, int level, const char *fmt,
                             ...) {
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
  chorus__store_conn_close(srv, c);
}

/* A socket error (reset, ...).  Losing a connection in the middle of the
 * handshake or of a frame is worth a WARN; between requests it is a client
 * that went away. */
static void conn_lost(chorus_store_server_t *srv, conn_t *c, int err) {
  size_t avail = c->in_len - c->in_off;
  int partial =
      c->skip || (avail > 0 && (avail < 4 || avail - 4 < chorus__le32_get(c->in + c->in_off)));
  int midway = c->state == CONN_HELLO || partial;
  chorus__store_conn_drop(srv, c, midway ? CHORUS__LOG_WARN : CHORUS__LOG_DEBUG, "%s: %s",
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

/* Returns the connection's timer and sets *deadline to when it fires.
 * Parked and paused connections are not timed: they wait on others. */
int chorus__store_conn_timer(const chorus_store_server_t *srv, const conn_t *c, int64_t *deadline) {
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
  if (chorus__store_conn_timer(srv, c, &deadline) != TIMER_NONE && deadline < srv->next_sweep)
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
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "epoll_ctl failed: %s", strerror(errno));
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
      __atomic_add_fetch(&srv->stats.bytes_out, (uint64_t)n, __ATOMIC_RELAXED);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    chorus__store_conn_drop(srv, c, CHORUS__LOG_DEBUG, "send failed: %s",
                            strerror(n < 0 ? errno : EIO));
    return -1;
  }
  c->out_off = 0;
  c->out.len = 0;
  if (c->out.cap > BUF_KEEP) chorus__sbuf_free(&c->out);
  if (c->state == CONN_CLOSING) {
    chorus__store_conn_close(srv, c);
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
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory building a response");
    return RQ_CLOSED;
  }
  return RQ_DONE;
}

int chorus__store_reply_status(chorus_store_server_t *srv, conn_t *c) {
  return reply_end(srv, c, reply_begin(c, CHORUS__STORE_ST_OK));
}

/* A well-formed request the store cannot carry out (ADD on a value that is
 * not an integer): answered with the reason, the connection stays. */
int chorus__store_reply_bad_request(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...) {
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
int chorus__store_reply_limit(chorus_store_server_t *srv, conn_t *c, const char *fmt, ...) {
  char why[CHORUS__STORE_MAX_REASON];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  chorus__log_limited(&srv->limit_log, CHORUS__SUB_STORE, "%s: refusing a request from %s: %s",
                      srv->name, c->peer, why);
  return chorus__store_reply_bad_request(srv, c, "%s", why);
}

int chorus__store_reply_value(chorus_store_server_t *srv, conn_t *c, const void *val, size_t len) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_str(&c->out, val, len);
  return reply_end(srv, c, at);
}

int chorus__store_reply_present(chorus_store_server_t *srv, conn_t *c, const void *val,
                                size_t len) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_u8(&c->out, 1);
  chorus__sbuf_str(&c->out, val, len);
  return reply_end(srv, c, at);
}

int chorus__store_reply_u8(chorus_store_server_t *srv, conn_t *c, uint8_t v) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_u8(&c->out, v);
  return reply_end(srv, c, at);
}

int chorus__store_reply_i64(chorus_store_server_t *srv, conn_t *c, int64_t v) {
  size_t at = reply_begin(c, CHORUS__STORE_ST_OK);
  chorus__sbuf_u64(&c->out, (uint64_t)v);
  return reply_end(srv, c, at);
}

int chorus__store_out_of_memory(chorus_store_server_t *srv, conn_t *c) {
  chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory");
  return RQ_CLOSED;
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
  if (c->out.oom) return chorus__store_out_of_memory(srv, c);
  if (verdict == CHORUS__STORE_HS_OK) {
    c->state = CONN_READY;
    handshaking_remove(srv, c);
    CHORUS_DEBUG(CHORUS__SUB_STORE, "%s: %s authenticated", srv->name, c->peer);
  } else {
    c->state = CONN_CLOSING; /* keeps its handshake deadline */
  }
  return RQ_DONE;
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
  return chorus__store_reply_limit(srv, c,
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
      chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN,
                "frame of %" PRIu32 " bytes exceeds the limit of %" PRIu32 "%s", len, limit,
                c->state == CONN_HELLO
                    ? " before authentication: not a chorus client (a torch TCPStore, from a "
                      "script under chorusrun that does not import chorus.torch before "
                      "init_process_group?)"
                    : "");
      return PF_CLOSED;
    }
    if (len == 0) {
      chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "empty frame");
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
                                    : chorus__store_request(srv, c, body, len);
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
      __atomic_add_fetch(&srv->stats.bytes_in, (uint64_t)n, __ATOMIC_RELAXED);
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
      chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN, "out of memory");
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
void chorus__store_conn_service(chorus_store_server_t *srv, conn_t *c) {
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
        chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN,
                  "peer closed in the middle of a refused frame (%zu bytes short)", c->skip);
      else if (partial && rc == PF_NEED_MORE)
        chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN,
                                "peer closed in the middle of a frame (%zu bytes)", partial);
      else if (c->state == CONN_HELLO)
        chorus__store_conn_drop(srv, c, CHORUS__LOG_INFO, "peer closed before the handshake");
      else
        chorus__store_conn_drop(srv, c, CHORUS__LOG_DEBUG, "peer closed the connection");
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

void chorus__store_conn_event(chorus_store_server_t *srv, conn_t *c, uint32_t ev) {
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
    chorus__store_conn_drop(srv, c, CHORUS__LOG_DEBUG, "peer closed the connection while %s",
              c->waiting_on ? "waiting for a key" : "not being read");
    return;
  }
  chorus__store_conn_service(srv, c);
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
  chorus__store_addr_maybe_drop(srv, c->addr);
  chorus__store_conn_free(c);
}

void chorus__store_conn_accept(chorus_store_server_t *srv, int fd) {
  __atomic_add_fetch(&srv->stats.accepted, 1, __ATOMIC_RELAXED);
  char host[64], peer[80];
  int port = 0;
  if (chorus__net_peer_addr(fd, host, sizeof host, &port) == 0) {
    snprintf(peer, sizeof peer, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  } else {
    snprintf(host, sizeof host, "?"); /* all unknown peers share one count */
    snprintf(peer, sizeof peer, "unknown peer (fd %d)", fd);
  }
  addr_count_t *a = chorus__store_addr_get(srv, host);
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
    chorus__store_addr_maybe_drop(srv, a);
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
    chorus__store_conn_drop(srv, CONTAINER_OF(srv->handshaking.next, conn_t, timer_link),
                            CHORUS__LOG_WARN, "%d connections are handshaking; dropping the oldest",
                            HANDSHAKING_MAX);
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

/* Closes an authenticated connection whose timer fired. */
void chorus__store_conn_expire(chorus_store_server_t *srv, conn_t *c, int timer) {
  long long idle_ms = (long long)(srv->lim.idle_ns / 1000000);
  long long frame_ms = (long long)(srv->lim.frame_ns / 1000000);
  if (timer == TIMER_IDLE)
    chorus__store_conn_drop(srv, c, CHORUS__LOG_INFO,
              "idle for %lld ms (CHORUS_STORE_IDLE_TIMEOUT_MS); its client reconnects on its "
              "next call",
              idle_ms);
  else if (timer == TIMER_PARTIAL)
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN,
              "sent part of a request (%zu bytes) and nothing more for %lld ms "
              "(CHORUS_STORE_FRAME_TIMEOUT_MS)",
              c->skip ? c->skip : c->in_len - c->in_off, frame_ms);
  else
    chorus__store_conn_drop(srv, c, CHORUS__LOG_WARN,
              "left %zu bytes of responses unread for %lld ms (CHORUS_STORE_FRAME_TIMEOUT_MS)",
              conn_unsent(c), frame_ms);
}
