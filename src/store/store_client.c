/*
 * store_client.c - the key-value store's client: chorus_store_connect(), the
 * chorus_store_* calls and the internal helpers declared in store.h.
 *
 * Design.  A client owns one blocking TCP connection.  Every call sends one
 * request frame and reads one response frame (store_proto.h), both bounded by
 * the call's deadline: chorus__net_write_full/read_full poll with the time
 * left, so no call can block past its timeout.  A mutex serialises calls, so
 * a client may be shared between threads although it is meant for one.
 *
 * Timeouts and lost connections.  GET and WAIT park on the server until their
 * keys exist, so when a call gives up the server may still answer it later.
 * The connection is therefore closed on every failed exchange (which also
 * tells the server to drop the parked request) and the next call reconnects
 * and authenticates again, transparently; a late reply can never be taken for
 * the answer to another request.  The reconnection retries a refused server
 * for at most RECONNECT_WINDOW_MS: the store was up before, so a refusal now
 * most likely means it is gone, and the caller should hear so quickly.  The
 * store closes connections left idle (CHORUS_STORE_IDLE_TIMEOUT_MS) but
 * never one with a request in flight, so a request that finds its kept
 * connection closed before any answer arrives is sent once more on a fresh
 * one (call()); the caller does not notice.
 *
 * Squatters.  Something that accepts connections on the store's port but is
 * not a store (issue 30) must not hold a caller for its whole timeout: a
 * connection silent for HELLO_WAIT_MS is dropped and another tried, and
 * WRONG_WINDOW_MS of nothing but silent or closed connections ends the
 * attempt.  chorus__store_connect_answer() tells the caller how the
 * endpoint answered, so it can tell a squatter from a store not up yet.
 *
 * Errors.  Every message starts with "store host:port: " and names the call
 * and its keys, e.g. "store 127.0.0.1:29500: get('rank/3') timed out after
 * 3000 ms".  Codes: CHORUS_ERR_TIMEOUT when the deadline passed,
 * CHORUS_ERR_STORE when the store refused or closed the connection,
 * CHORUS_ERR_PROTOCOL for a failed handshake (wrong secret, not a chorus
 * store) or a malformed response, CHORUS_ERR_INVALID_ARG for bad arguments
 * and for requests the store declined (ADD on a non-integer value).
 *
 * Returned values are malloc'd with a NUL byte after the last one (not
 * counted in the length), so text values can be printed as they are; callers
 * free them with chorus_free().
 */
#include "store.h"
#include "store_proto.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util/env.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

#define RECONNECT_WINDOW_MS 1000
#define ERR_CAP 768
#define WHAT_CAP 320
/* Longest part of a key quoted in a message. */
#define KEY_SHOWN 64

struct chorus_store {
  pthread_mutex_t mu;
  char host[256];
  int port;
  char addr[300]; /* "host:port" ("[v6]:port"), in every message */
  chorus__key_t key;
  int fd;         /* -1: disconnected; the next call reconnects */
  char source[64]; /* the address connections leave from ("": the kernel's) */
  int timeout_ms; /* bound of every call without an explicit one */
  int retry_ms;   /* pause between connection attempts */
  char err[ERR_CAP];
};

static _Thread_local char g_connect_err[ERR_CAP];
static _Thread_local int g_connect_denied;
static _Thread_local int g_connect_answer; /* CHORUS__STORE_ANS_NO_ANSWER... */

/* Writes "store <addr>: " and the formatted message into err (ERR_CAP). */
static void set_err(char *err, const char *addr, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_err(char *err, const char *addr, const char *fmt, ...) {
  int n = snprintf(err, ERR_CAP, "store %s: ", addr);
  if (n < 0 || n >= ERR_CAP) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err + n, ERR_CAP - (size_t)n, fmt, ap);
  va_end(ap);
}

/* Appends a printf-formatted piece to out (cap bytes, NUL-terminated),
 * silently truncating. */
static void append(char *out, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void append(char *out, size_t cap, const char *fmt, ...) {
  size_t used = strlen(out);
  if (used + 1 >= cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out + used, cap - used, fmt, ap);
  va_end(ap);
}

/* Appends 'key', shortened to KEY_SHOWN bytes, with unprintable bytes shown
 * as '?'. */
static void append_key(char *out, size_t cap, const char *key) {
  if (!key) {
    append(out, cap, "(null)");
    return;
  }
  char shown[KEY_SHOWN + 4];
  size_t n = 0;
  for (; key[n] && n < KEY_SHOWN; n++) shown[n] = (key[n] >= 0x20 && key[n] < 0x7f) ? key[n] : '?';
  shown[n] = '\0';
  append(out, cap, "'%s%s'", shown, key[n] ? "..." : "");
}

/* "get('rank/3')", "wait('a', 'b', 'c', 'd' and 6 more)", "num_keys()". */
static void describe(char *out, const char *op, const char *const *keys, int nkeys) {
  out[0] = '\0';
  append(out, WHAT_CAP, "%s(", op);
  for (int i = 0; keys && i < nkeys && i < 4; i++) {
    if (i) append(out, WHAT_CAP, ", ");
    append_key(out, WHAT_CAP, keys[i]);
  }
  if (nkeys > 4) append(out, WHAT_CAP, " and %d more", nkeys - 4);
  append(out, WHAT_CAP, ")");
}

static void disconnect(chorus_store_t *c) {
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
  }
}

/* Runs the client side of the handshake on a fresh connection.  Returns 0;
 * -EACCES when the store rejected our key; -EPERM when the server did not
 * prove that it holds the key (not our store); -EPROTONOSUPPORT on a
 * protocol version mismatch (*server_version receives the store's version,
 * or 0 if it did not say); -EPROTO when the peer does not speak the store
 * protocol; or a negative errno from the socket (-ETIMEDOUT when the
 * deadline passed). */
static int handshake(const chorus__key_t *key, int fd, int64_t deadline, uint32_t *server_version) {
  uint8_t hello[4 + CHORUS__STORE_HELLO_LEN];
  int rc = chorus__net_read_full(fd, hello, 4, deadline);
  if (rc < 0) return rc;
  if (chorus__le32_get(hello) != CHORUS__STORE_HELLO_LEN) {
    /* A store of another protocol version sends a hello of another size;
     * its version field is where ours is. */
    uint8_t head[8];
    if (chorus__le32_get(hello) >= 8 && chorus__net_read_full(fd, head, 8, deadline) == 0 &&
        memcmp(head, CHORUS__STORE_MAGIC, 4) == 0) {
      *server_version = chorus__le32_get(head + 4);
      return -EPROTONOSUPPORT;
    }
    return -EPROTO;
  }
  if ((rc = chorus__net_read_full(fd, hello + 4, CHORUS__STORE_HELLO_LEN, deadline)) < 0) return rc;
  if (memcmp(hello + 4, CHORUS__STORE_MAGIC, 4) != 0) return -EPROTO;
  uint32_t version = chorus__le32_get(hello + 8);
  if (version != CHORUS__STORE_VERSION) {
    *server_version = version;
    return -EPROTONOSUPPORT;
  }
  const uint8_t *server_nonce = hello + 12;
  uint8_t answer[4 + CHORUS__STORE_AUTH_LEN];
  uint8_t *client_nonce = answer + 12;
  chorus__le32_put(answer, CHORUS__STORE_AUTH_LEN);
  memcpy(answer + 4, CHORUS__STORE_MAGIC, 4);
  chorus__le32_put(answer + 8, CHORUS__STORE_VERSION);
  if ((rc = chorus__random_bytes(client_nonce, CHORUS__STORE_NONCE_LEN)) < 0) return rc;
  chorus__store_mac(key, 0, server_nonce, client_nonce, answer + 12 + CHORUS__STORE_NONCE_LEN);
  if ((rc = chorus__net_write_full(fd, answer, sizeof answer, deadline)) < 0) return rc;
  uint8_t verdict[4 + CHORUS__STORE_VERDICT_OK_LEN];
  if ((rc = chorus__net_read_full(fd, verdict, 5, deadline)) < 0) return rc;
  uint32_t len = chorus__le32_get(verdict);
  if (verdict[4] == CHORUS__STORE_HS_OK) {
    if (len != CHORUS__STORE_VERDICT_OK_LEN) return -EPROTO;
    if ((rc = chorus__net_read_full(fd, verdict + 5, CHORUS__STORE_MAC_LEN, deadline)) < 0)
      return rc;
    uint8_t want[CHORUS__STORE_MAC_LEN];
    chorus__store_mac(key, 1, server_nonce, client_nonce, want);
    return chorus__ct_equal(want, verdict + 5, sizeof want) ? 0 : -EPERM;
  }
  if (len != 1) return -EPROTO;
  switch (verdict[4]) {
    case CHORUS__STORE_HS_DENIED:
      return -EACCES;
    case CHORUS__STORE_HS_VERSION:
      *server_version = 0;
      return -EPROTONOSUPPORT;
    default:
      return -EPROTO;
  }
}

/* A chorus store says hello as soon as it accepts: a connection silent this
 * long is dropped and another one tried.  Silence or closed connections and
 * nothing else for WRONG_WINDOW_MS: not a store (a squatter on the port),
 * whatever time the caller would still give. */
#define HELLO_WAIT_MS 3000
#define WRONG_WINDOW_MS 10000

/* Connects and authenticates, leaving the connection in c->fd.  Refused
 * connections are retried every retry_ms until connect_deadline; a store that
 * closes the connection during the handshake (it may be at its connection
 * limit) or says nothing is retried until deadline, or for WRONG_WINDOW_MS.
 * On failure writes the reason, prefixed by `what`, into err and returns the
 * error code; no descriptor stays open. */
static chorus_result_t open_conn(chorus_store_t *c, char *err, int64_t connect_deadline,
                                 int64_t deadline, int timeout_ms, const char *what) {
  int wrong = CHORUS__STORE_ANS_NO_ANSWER; /* the last connection: accepted, then closed or silent */
  int64_t wrong_since = 0;
  for (;;) {
    int fd = chorus__net_connect_from(c->host, c->port, c->source[0] ? c->source : NULL,
                                      connect_deadline, c->retry_ms);
    g_connect_answer = CHORUS__STORE_ANS_NO_ANSWER;
    if (fd < 0) {
      /* Out of time while connecting again after the endpoint had closed
       * on us or said nothing: it still answers, wrongly. */
      if (fd == -ETIMEDOUT && wrong != CHORUS__STORE_ANS_NO_ANSWER) {
        set_err(err, c->addr,
                "%s: the server there %s every connection during the handshake for %d ms; "
                "is a chorus store listening there?", what,
                wrong == CHORUS__STORE_ANS_SILENT ? "said nothing on" : "closed", timeout_ms);
        g_connect_answer = wrong;
        return wrong == CHORUS__STORE_ANS_SILENT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_STORE;
      }
      if (fd == -ETIMEDOUT) {
        set_err(err, c->addr, "%s: connecting timed out after %d ms", what, timeout_ms);
        return CHORUS_ERR_TIMEOUT;
      }
      set_err(err, c->addr, "%s: cannot connect: %s", what, strerror(-fd));
      return CHORUS_ERR_STORE;
    }
    uint32_t server_version = 0;
    int64_t hello_deadline = chorus__deadline_ms(HELLO_WAIT_MS);
    if (hello_deadline > deadline) hello_deadline = deadline;
    int rc = handshake(&c->key, fd, hello_deadline, &server_version);
    if (rc == 0) {
      c->fd = fd;
      return CHORUS_OK;
    }
    close(fd);
    /* Silent for HELLO_WAIT_MS with time left: like a closed connection. */
    if (rc == -ETIMEDOUT && chorus__ms_left(deadline) > 0) rc = -EAGAIN;
    switch (rc) {
      case -EACCES:
        set_err(err, c->addr,
                "%s: authentication failed: the store rejected this job's key (the processes "
                "were given different secrets, or a different CHORUS_JOB_ID; see "
                "docs/security.md)",
                what);
        g_connect_denied = 1;
        g_connect_answer = CHORUS__STORE_ANS_DENIED;
        return CHORUS_ERR_PROTOCOL;
      case -EPERM:
        set_err(err, c->addr,
                "%s: the server there did not prove that it holds the job key: it is not "
                "this job's store (another job or a stranger is on that port)",
                what);
        g_connect_denied = 1;
        g_connect_answer = CHORUS__STORE_ANS_NO_PROOF;
        return CHORUS_ERR_PROTOCOL;
      case -EPROTONOSUPPORT:
        set_err(err, c->addr, "%s: store protocol version mismatch (store %" PRIu32 ", client %u)",
                what, server_version, CHORUS__STORE_VERSION);
        g_connect_answer = CHORUS__STORE_ANS_VERSION;
        return CHORUS_ERR_PROTOCOL;
      case -EPROTO:
        set_err(err, c->addr, "%s: unexpected handshake; is a chorus store listening there?", what);
        g_connect_answer = CHORUS__STORE_ANS_GARBAGE;
        return CHORUS_ERR_PROTOCOL;
      case -ETIMEDOUT:
        set_err(err, c->addr,
                "%s: no handshake from the store within %d ms; is a chorus store listening there?",
                what, timeout_ms);
        g_connect_answer = CHORUS__STORE_ANS_SILENT;
        return CHORUS_ERR_TIMEOUT;
      default:
        wrong = rc == -EAGAIN ? CHORUS__STORE_ANS_SILENT : CHORUS__STORE_ANS_CLOSED;
        if (!wrong_since) wrong_since = chorus__now_ns();
        break;
    }
    int left = chorus__ms_left(deadline);
    if (left == 0 || chorus__now_ns() - wrong_since >= (int64_t)WRONG_WINDOW_MS * 1000000) {
      if (wrong == CHORUS__STORE_ANS_SILENT)
        set_err(err, c->addr,
                "%s: the server there accepted connections but said nothing (%d ms each) for "
                "%d ms; is a chorus store listening there?", what, HELLO_WAIT_MS,
                (int)((chorus__now_ns() - wrong_since) / 1000000));
      else
        set_err(err, c->addr, "%s: the store closed the connection during the handshake: %s",
                what, strerror(-rc));
      g_connect_answer = wrong;
      return wrong == CHORUS__STORE_ANS_SILENT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_STORE;
    }
    sleep_ms(CHORUS__MIN(left, c->retry_ms));
  }
}

/* Turns a failed send/receive into an error, closing the connection. */
static chorus_result_t io_failed(chorus_store_t *c, const char *what, int rc, int64_t deadline,
                                 int timeout_ms) {
  disconnect(c);
  if (rc == -ETIMEDOUT && deadline != CHORUS__NO_DEADLINE && chorus__ms_left(deadline) == 0) {
    set_err(c->err, c->addr, "%s timed out after %d ms", what, timeout_ms);
    return CHORUS_ERR_TIMEOUT;
  }
  if (rc == -ECONNRESET || rc == -EPIPE)
    set_err(c->err, c->addr, "%s: connection to the store lost: %s", what, strerror(-rc));
  else
    set_err(c->err, c->addr, "%s: %s", what, strerror(-rc));
  return CHORUS_ERR_STORE;
}

static chorus_result_t bad_response(chorus_store_t *c, const char *what) {
  disconnect(c);
  set_err(c->err, c->addr, "%s: malformed response from the store", what);
  return CHORUS_ERR_PROTOCOL;
}

static void req_begin(chorus__sbuf_t *req, int cmd) {
  chorus__sbuf_frame_begin(req);
  chorus__sbuf_u8(req, (uint8_t)cmd);
}

/* Sends req (one frame built with req_begin) and reads the response within
 * timeout_ms (< 0: none).  The caller holds c->mu.  On CHORUS_OK *body is the
 * malloc'd response body (*blen bytes plus a NUL; the caller frees it), whose
 * first byte is the OK status.  A request the store declined returns
 * CHORUS_ERR_INVALID_ARG with the store's reason.  Any failure to complete
 * the exchange closes the connection; the next call reconnects. */
static chorus_result_t call(chorus_store_t *c, const char *what, chorus__sbuf_t *req,
                            int timeout_ms, uint8_t **body, size_t *blen) {
  *body = NULL;
  *blen = 0;
  if (req->oom) {
    set_err(c->err, c->addr, "%s: out of memory", what);
    return CHORUS_ERR_NO_MEMORY;
  }
  chorus__sbuf_frame_end(req, 0);
  if (req->len - 4 > CHORUS__STORE_MAX_FRAME) {
    set_err(c->err, c->addr, "%s: request of %zu bytes exceeds the store's limit of %u bytes", what,
            req->len - 4, CHORUS__STORE_MAX_FRAME);
    return CHORUS_ERR_INVALID_ARG;
  }
  int64_t deadline = chorus__deadline_ms(timeout_ms);
  uint8_t hdr[4];
  int rc;
  for (int reused = c->fd >= 0;; reused = 0) {
    if (c->fd < 0) {
      int64_t connect_deadline = chorus__deadline_ms(RECONNECT_WINDOW_MS);
      if (connect_deadline > deadline) connect_deadline = deadline;
      chorus_result_t res = open_conn(c, c->err, connect_deadline, deadline, timeout_ms, what);
      if (res != CHORUS_OK) return res;
    }
    rc = chorus__net_write_full(c->fd, req->data, req->len, deadline);
    if (rc == 0) rc = chorus__net_read_full(c->fd, hdr, sizeof hdr, deadline);
    /* The store closes a connection that sat idle (CHORUS_STORE_IDLE_TIMEOUT_MS),
     * and only one with no request in flight: a request that found a kept
     * connection closed before any answer was never run, so it goes once
     * more on a fresh connection. */
    if (reused && (rc == -ECONNRESET || rc == -EPIPE)) {
      CHORUS_DEBUG(CHORUS__SUB_STORE, "store %s: %s: the store closed the connection; resending",
                   c->addr, what);
      disconnect(c);
      continue;
    }
    break;
  }
  if (rc < 0) return io_failed(c, what, rc, deadline, timeout_ms);
  uint32_t len = chorus__le32_get(hdr);
  if (len == 0 || len > CHORUS__STORE_MAX_FRAME) return bad_response(c, what);
  uint8_t *b = malloc((size_t)len + 1);
  if (!b) {
    disconnect(c);
    set_err(c->err, c->addr, "%s: out of memory for a %" PRIu32 "-byte response", what, len);
    return CHORUS_ERR_NO_MEMORY;
  }
  if ((rc = chorus__net_read_full(c->fd, b, len, deadline)) < 0) {
    free(b);
    return io_failed(c, what, rc, deadline, timeout_ms);
  }
  b[len] = '\0';
  chorus_result_t res;
  switch (b[0]) {
    case CHORUS__STORE_ST_OK:
      *body = b;
      *blen = len;
      return CHORUS_OK;
    case CHORUS__STORE_ST_BAD_REQUEST: {
      chorus__srd_t r = chorus__srd_make(b + 1, len - 1);
      const uint8_t *why;
      size_t wlen;
      chorus__srd_str(&r, CHORUS__STORE_MAX_REASON, &why, &wlen);
      if (r.bad || r.left) {
        res = bad_response(c, what);
      } else {
        set_err(c->err, c->addr, "%s: the store declined: %.*s", what, (int)wlen,
                (const char *)why);
        res = CHORUS_ERR_INVALID_ARG;
      }
      break;
    }
    case CHORUS__STORE_ST_TIMEOUT:
      set_err(c->err, c->addr, "%s timed out on the store", what);
      res = CHORUS_ERR_TIMEOUT;
      break;
    default:
      res = bad_response(c, what);
      break;
  }
  free(b);
  return res;
}

/* Turns an OK response holding one value into the value itself: moves the
 * bytes to the front of the block, NUL-terminates them and hands the block
 * to the caller (*val, *len).  Frees body on failure. */
static chorus_result_t take_value(chorus_store_t *c, const char *what, uint8_t *body, size_t blen,
                                  void **val, size_t *len) {
  chorus__srd_t r = chorus__srd_make(body + 1, blen - 1);
  uint32_t vlen = chorus__srd_u32(&r);
  if (r.bad || r.left != vlen) {
    free(body);
    return bad_response(c, what);
  }
  memmove(body, body + 5, vlen);
  body[vlen] = '\0';
  *val = body;
  *len = vlen;
  return CHORUS_OK;
}

/* Reads the one fixed-size field of an OK response (u8 or i64). */
static chorus_result_t take_u8(chorus_store_t *c, const char *what, uint8_t *body, size_t blen,
                               int *out) {
  chorus_result_t res = CHORUS_OK;
  if (blen != 2 || body[1] > 1)
    res = bad_response(c, what);
  else if (out)
    *out = body[1];
  free(body);
  return res;
}

static chorus_result_t take_i64(chorus_store_t *c, const char *what, uint8_t *body, size_t blen,
                                int64_t *out) {
  chorus_result_t res = CHORUS_OK;
  if (blen != 9)
    res = bad_response(c, what);
  else if (out)
    *out = (int64_t)chorus__le64_get(body + 1);
  free(body);
  return res;
}

static chorus_result_t check_key(chorus_store_t *c, const char *what, const char *key) {
  if (!key) {
    set_err(c->err, c->addr, "%s: key is NULL", what);
    return CHORUS_ERR_INVALID_ARG;
  }
  size_t n = strlen(key);
  if (n > CHORUS__STORE_MAX_KEY) {
    set_err(c->err, c->addr, "%s: key of %zu bytes exceeds the limit of %u", what, n,
            CHORUS__STORE_MAX_KEY);
    return CHORUS_ERR_INVALID_ARG;
  }
  return CHORUS_OK;
}

static chorus_result_t check_keys(chorus_store_t *c, const char *what, const char *const *keys,
                                  int nkeys) {
  if (nkeys < 0 || (uint32_t)nkeys > CHORUS__STORE_MAX_KEYS || (nkeys > 0 && !keys)) {
    set_err(c->err, c->addr, "%s: invalid key list (%d keys%s; at most %u)", what, nkeys,
            keys ? "" : ", NULL array", CHORUS__STORE_MAX_KEYS);
    return CHORUS_ERR_INVALID_ARG;
  }
  for (int i = 0; i < nkeys; i++) {
    chorus_result_t res = check_key(c, what, keys[i]);
    if (res != CHORUS_OK) return res;
  }
  return CHORUS_OK;
}

static chorus_result_t check_buf(chorus_store_t *c, const char *what, const char *name,
                                 const void *p, size_t len) {
  if (!p && len) {
    set_err(c->err, c->addr, "%s: %s is NULL but its length is %zu", what, name, len);
    return CHORUS_ERR_INVALID_ARG;
  }
  if (len > CHORUS__STORE_MAX_FRAME) {
    set_err(c->err, c->addr, "%s: %s of %zu bytes exceeds the store's limit of %u bytes", what,
            name, len, CHORUS__STORE_MAX_FRAME);
    return CHORUS_ERR_INVALID_ARG;
  }
  return CHORUS_OK;
}

static int default_timeout_ms(void) {
  long s = chorus__env()->TIMEOUT;
  if (s <= 0) s = 300;
  return s > INT_MAX / 1000 ? INT_MAX : (int)(s * 1000);
}

/* ---------------------------------------------------------- connection */

chorus_result_t chorus_store_connect(const char *host, int port, const char *secret, int timeout_ms,
                                     chorus_store_t **client) {
  chorus__key_t key;
  g_connect_err[0] = '\0';
  g_connect_denied = 0;
  if (client) *client = NULL;
  if (chorus__key_for_api(secret, &key, g_connect_err, sizeof g_connect_err) < 0) {
    CHORUS_WARN(CHORUS__SUB_STORE, "store %.64s:%d: %s", host ? host : "", port, g_connect_err);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus_result_t res = chorus__store_connect_key(host, port, &key, timeout_ms, client);
  chorus__wipe(&key, sizeof key);
  return res;
}

int chorus__store_connect_denied(void) { return g_connect_denied; }

int chorus__store_connect_answer(void) { return g_connect_answer; }

chorus_result_t chorus__store_connect_key(const char *host, int port, const chorus__key_t *key,
                                          int timeout_ms, chorus_store_t **client) {
  return chorus__store_connect_from(host, port, NULL, key, timeout_ms, client);
}

chorus_result_t chorus__store_connect_from(const char *host, int port, const char *source,
                                           const chorus__key_t *key, int timeout_ms,
                                           chorus_store_t **client) {
  g_connect_err[0] = '\0';
  g_connect_denied = 0;
  g_connect_answer = CHORUS__STORE_ANS_NO_ANSWER;
  if (!client) return CHORUS_ERR_INVALID_ARG;
  *client = NULL;
  if (!host || !*host) host = "127.0.0.1";
  if (strlen(host) >= sizeof((chorus_store_t *)0)->host || port <= 0 || port > 65535) {
    snprintf(g_connect_err, sizeof g_connect_err, "store %.64s:%d: invalid address", host, port);
    CHORUS_WARN(CHORUS__SUB_STORE, "%s", g_connect_err);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus_store_t *c = calloc(1, sizeof *c);
  if (!c) {
    snprintf(g_connect_err, sizeof g_connect_err, "store %s:%d: out of memory", host, port);
    return CHORUS_ERR_NO_MEMORY;
  }
  pthread_mutex_init(&c->mu, NULL);
  snprintf(c->host, sizeof c->host, "%s", host);
  c->port = port;
  if (source) snprintf(c->source, sizeof c->source, "%s", source);
  snprintf(c->addr, sizeof c->addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
  c->key = *key;
  c->fd = -1;
  c->timeout_ms = timeout_ms > 0 ? timeout_ms : default_timeout_ms();
  long retry = chorus__env()->CONNECT_RETRY_MS;
  c->retry_ms = retry > 0 && retry < 60000 ? (int)retry : 50;
  int64_t deadline = chorus__deadline_ms(c->timeout_ms);
  chorus_result_t res = open_conn(c, g_connect_err, deadline, deadline, c->timeout_ms, "connect");
  if (res != CHORUS_OK) {
    CHORUS_WARN(CHORUS__SUB_STORE, "%s", g_connect_err);
    chorus_store_close(c);
    return res;
  }
  CHORUS_DEBUG(CHORUS__SUB_STORE, "store %s: connected", c->addr);
  *client = c;
  return CHORUS_OK;
}

void chorus_store_close(chorus_store_t *client) {
  if (!client) return;
  disconnect(client);
  chorus__wipe(&client->key, sizeof client->key);
  pthread_mutex_destroy(&client->mu);
  free(client);
}

const char *chorus_store_last_error(const chorus_store_t *client) {
  return client ? client->err : "";
}

const char *chorus__store_connect_error(void) {
  return g_connect_err;
}

void chorus__store_set_timeout(chorus_store_t *client, int timeout_ms) {
  if (!client) return;
  pthread_mutex_lock(&client->mu);
  client->timeout_ms = timeout_ms > 0 ? timeout_ms : default_timeout_ms();
  pthread_mutex_unlock(&client->mu);
}

const char *chorus__store_address(const chorus_store_t *client) {
  return client ? client->addr : "";
}

int chorus__store_fd(const chorus_store_t *client) {
  if (!client) return -1;
  /* The mutex is not part of the client's logical state. */
  chorus_store_t *c = (chorus_store_t *)client;
  pthread_mutex_lock(&c->mu);
  int fd = c->fd;
  pthread_mutex_unlock(&c->mu);
  return fd;
}

/* ---------------------------------------------------------------- calls
 *
 * Each public call validates its arguments, then runs its *_locked body under
 * the client's mutex. */

static chorus_result_t set_locked(chorus_store_t *c, const char *key, const void *val, size_t len) {
  char what[WHAT_CAP];
  describe(what, "set", &key, 1);
  chorus_result_t res = check_key(c, what, key);
  if (res == CHORUS_OK) res = check_buf(c, what, "value", val, len);
  if (res != CHORUS_OK) return res;
  chorus__sbuf_t req = {0};
  req_begin(&req, CHORUS__STORE_CMD_SET);
  chorus__sbuf_str(&req, key, strlen(key));
  chorus__sbuf_str(&req, val, len);
  uint8_t *body;
  size_t blen;
  res = call(c, what, &req, c->timeout_ms, &body, &blen);
  chorus__sbuf_free(&req);
  if (res != CHORUS_OK) return res;
  if (blen != 1) res = bad_response(c, what);
  free(body);
  return res;
}

chorus_result_t chorus_store_set(chorus_store_t *c, const char *key, const void *val, size_t len) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = set_locked(c, key, val, len);
  pthread_mutex_unlock(&c->mu);
  return res;
}

/* A request whose only field is key (GET, TRY_GET, DELETE): its response
 * body in *body. */
static chorus_result_t key_call(chorus_store_t *c, const char *what, uint8_t cmd, const char *key,
                                int timeout_ms, uint8_t **body, size_t *blen) {
  chorus_result_t res = check_key(c, what, key);
  if (res != CHORUS_OK) return res;
  chorus__sbuf_t req = {0};
  req_begin(&req, cmd);
  chorus__sbuf_str(&req, key, strlen(key));
  res = call(c, what, &req, timeout_ms, body, blen);
  chorus__sbuf_free(&req);
  return res;
}

static chorus_result_t get_locked(chorus_store_t *c, const char *key, int timeout_ms, void **val,
                                  size_t *len) {
  char what[WHAT_CAP];
  describe(what, "get", &key, 1);
  if (!val || !len) {
    set_err(c->err, c->addr, "%s: NULL output pointer", what);
    return CHORUS_ERR_INVALID_ARG;
  }
  *val = NULL;
  *len = 0;
  uint8_t *body;
  size_t blen;
  chorus_result_t res = key_call(c, what, CHORUS__STORE_CMD_GET, key,
                                 timeout_ms < 0 ? c->timeout_ms : timeout_ms, &body, &blen);
  if (res != CHORUS_OK) return res;
  return take_value(c, what, body, blen, val, len);
}

static chorus_result_t try_get_locked(chorus_store_t *c, const char *key, int *present,
                                      void **val, size_t *len) {
  char what[WHAT_CAP];
  describe(what, "try_get", &key, 1);
  *present = 0;
  *val = NULL;
  *len = 0;
  uint8_t *body;
  size_t blen;
  chorus_result_t res = key_call(c, what, CHORUS__STORE_CMD_TRY_GET, key, c->timeout_ms, &body,
                                 &blen);
  if (res != CHORUS_OK) return res;
  /* OK, then 0 alone, or 1 and the value. */
  if (blen == 2 && body[1] == 0) {
    free(body);
    return CHORUS_OK;
  }
  if (blen < 2 || body[1] != 1) {
    free(body);
    return bad_response(c, what);
  }
  memmove(body + 1, body + 2, blen - 2); /* the value's str where take_value wants it */
  *present = 1;
  return take_value(c, what, body, blen - 1, val, len);
}

chorus_result_t chorus__store_try_get(chorus_store_t *c, const char *key, int *present,
                                      void **val, size_t *len) {
  if (!c || !key || !present || !val || !len) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = try_get_locked(c, key, present, val, len);
  pthread_mutex_unlock(&c->mu);
  return res;
}

chorus_result_t chorus__store_get_timeout(chorus_store_t *c, const char *key, int timeout_ms,
                                          void **val, size_t *len) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = get_locked(c, key, timeout_ms, val, len);
  pthread_mutex_unlock(&c->mu);
  return res;
}

int chorus__store_get_if_free(chorus_store_t *c, const char *key, int timeout_ms, void **val,
                              size_t *len, chorus_result_t *st) {
  if (!c) {
    *st = CHORUS_ERR_INVALID_ARG;
    return 1;
  }
  if (pthread_mutex_trylock(&c->mu) != 0) return 0;
  *st = get_locked(c, key, timeout_ms, val, len);
  pthread_mutex_unlock(&c->mu);
  return 1;
}

chorus_result_t chorus_store_get(chorus_store_t *c, const char *key, void **val, size_t *len) {
  return chorus__store_get_timeout(c, key, -1, val, len);
}

static chorus_result_t add_locked(chorus_store_t *c, const char *key, int64_t delta,
                                  int64_t *result) {
  char what[WHAT_CAP];
  describe(what, "add", &key, 1);
  chorus_result_t res = check_key(c, what, key);
  if (res != CHORUS_OK) return res;
  chorus__sbuf_t req = {0};
  req_begin(&req, CHORUS__STORE_CMD_ADD);
  chorus__sbuf_str(&req, key, strlen(key));
  chorus__sbuf_u64(&req, (uint64_t)delta);
  uint8_t *body;
  size_t blen;
  res = call(c, what, &req, c->timeout_ms, &body, &blen);
  chorus__sbuf_free(&req);
  if (res != CHORUS_OK) return res;
  return take_i64(c, what, body, blen, result);
}

chorus_result_t chorus_store_add(chorus_store_t *c, const char *key, int64_t delta,
                                 int64_t *result) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = add_locked(c, key, delta, result);
  pthread_mutex_unlock(&c->mu);
  return res;
}

static chorus_result_t compare_set_locked(chorus_store_t *c, const char *key, const void *expected,
                                          size_t expected_len, const void *desired,
                                          size_t desired_len, void **current, size_t *current_len) {
  char what[WHAT_CAP];
  describe(what, "compare_set", &key, 1);
  chorus_result_t res = check_key(c, what, key);
  if (res == CHORUS_OK) res = check_buf(c, what, "expected", expected, expected_len);
  if (res == CHORUS_OK) res = check_buf(c, what, "desired", desired, desired_len);
  if (res != CHORUS_OK) return res;
  chorus__sbuf_t req = {0};
  req_begin(&req, CHORUS__STORE_CMD_COMPARE_SET);
  chorus__sbuf_str(&req, key, strlen(key));
  chorus__sbuf_str(&req, expected, expected_len);
  chorus__sbuf_str(&req, desired, desired_len);
  uint8_t *body;
  size_t blen;
  res = call(c, what, &req, c->timeout_ms, &body, &blen);
  chorus__sbuf_free(&req);
  if (res != CHORUS_OK) return res;
  void *val = NULL;
  size_t len = 0;
  res = take_value(c, what, body, blen, &val, &len);
  if (res != CHORUS_OK) return res;
  if (current)
    *current = val;
  else
    free(val);
  if (current_len) *current_len = len;
  return CHORUS_OK;
}

chorus_result_t chorus_store_compare_set(chorus_store_t *c, const char *key, const void *expected,
                                         size_t expected_len, const void *desired,
                                         size_t desired_len, void **current, size_t *current_len) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  if (current) *current = NULL;
  if (current_len) *current_len = 0;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = compare_set_locked(c, key, expected, expected_len, desired, desired_len,
                                           current, current_len);
  pthread_mutex_unlock(&c->mu);
  return res;
}

/* CHECK and WAIT share their request layout. */
static chorus_result_t keys_locked(chorus_store_t *c, int cmd, const char *const *keys, int nkeys,
                                   int timeout_ms, int *exists) {
  char what[WHAT_CAP];
  describe(what, chorus__store_cmd_name(cmd), keys, nkeys);
  chorus_result_t res = check_keys(c, what, keys, nkeys);
  if (res != CHORUS_OK) return res;
  chorus__sbuf_t req = {0};
  req_begin(&req, cmd);
  chorus__sbuf_u32(&req, (uint32_t)nkeys);
  for (int i = 0; i < nkeys; i++) chorus__sbuf_str(&req, keys[i], strlen(keys[i]));
  uint8_t *body;
  size_t blen;
  res = call(c, what, &req, timeout_ms, &body, &blen);
  chorus__sbuf_free(&req);
  if (res != CHORUS_OK) return res;
  if (cmd == CHORUS__STORE_CMD_CHECK) return take_u8(c, what, body, blen, exists);
  if (blen != 1) res = bad_response(c, what);
  free(body);
  return res;
}

chorus_result_t chorus_store_check(chorus_store_t *c, const char *const *keys, int nkeys,
                                   int *exists) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res;
  if (!exists) {
    set_err(c->err, c->addr, "check: NULL output pointer");
    res = CHORUS_ERR_INVALID_ARG;
  } else {
    *exists = 0;
    res = keys_locked(c, CHORUS__STORE_CMD_CHECK, keys, nkeys, c->timeout_ms, exists);
  }
  pthread_mutex_unlock(&c->mu);
  return res;
}

chorus_result_t chorus_store_wait(chorus_store_t *c, const char *const *keys, int nkeys,
                                  int timeout_ms) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = keys_locked(c, CHORUS__STORE_CMD_WAIT, keys, nkeys,
                                    timeout_ms < 0 ? c->timeout_ms : timeout_ms, NULL);
  pthread_mutex_unlock(&c->mu);
  return res;
}

static chorus_result_t delete_locked(chorus_store_t *c, const char *key, int *deleted) {
  char what[WHAT_CAP];
  describe(what, "delete", &key, 1);
  uint8_t *body;
  size_t blen;
  chorus_result_t res = key_call(c, what, CHORUS__STORE_CMD_DELETE, key, c->timeout_ms, &body,
                                 &blen);
  if (res != CHORUS_OK) return res;
  return take_u8(c, what, body, blen, deleted);
}

chorus_result_t chorus_store_delete(chorus_store_t *c, const char *key, int *deleted) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  if (deleted) *deleted = 0;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = delete_locked(c, key, deleted);
  pthread_mutex_unlock(&c->mu);
  return res;
}

chorus_result_t chorus_store_num_keys(chorus_store_t *c, int64_t *num) {
  if (!c) return CHORUS_ERR_INVALID_ARG;
  pthread_mutex_lock(&c->mu);
  chorus_result_t res = CHORUS_OK;
  if (!num) {
    set_err(c->err, c->addr, "num_keys(): NULL output pointer");
    res = CHORUS_ERR_INVALID_ARG;
  } else {
    *num = 0;
    chorus__sbuf_t req = {0};
    req_begin(&req, CHORUS__STORE_CMD_NUM_KEYS);
    uint8_t *body;
    size_t blen;
    res = call(c, "num_keys()", &req, c->timeout_ms, &body, &blen);
    chorus__sbuf_free(&req);
    if (res == CHORUS_OK) res = take_i64(c, "num_keys()", body, blen, num);
  }
  pthread_mutex_unlock(&c->mu);
  return res;
}
