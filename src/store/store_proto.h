/*
 * store_proto.h - private wire-format helpers shared by the store's server
 * (store_server.c) and client (store_client.c).
 *
 * store.h describes the protocol in prose; this header pins down the details:
 * command and status codes, the handshake message sizes, and the fields each
 * command carries.  Two tiny helpers do all encoding and decoding:
 *  - chorus__sbuf_t, a growable byte buffer that remembers an allocation
 *    failure instead of reporting it at every append (check .oom once at the
 *    end), and
 *  - chorus__srd_t, a bounds-checked reader over a received frame that
 *    remembers a short or malformed field (check .bad once at the end).
 * Every integer on the wire is little-endian and is encoded byte by byte, so
 * the code does not depend on the host's byte order.
 *
 * Request bodies (after the u32 frame length; "str" is u32 length + bytes):
 *   SET          u8 cmd, str key, str value        -> status
 *   GET          u8 cmd, str key                   -> status, str value
 *   ADD          u8 cmd, str key, i64 delta        -> status, i64 new value
 *   COMPARE_SET  u8 cmd, str key, str expected, str desired
 *                                                  -> status, str value
 *   CHECK        u8 cmd, u32 n, n x str key        -> status, u8 all exist
 *   DELETE       u8 cmd, str key                   -> status, u8 existed
 *   WAIT         u8 cmd, u32 n, n x str key        -> status
 *   NUM_KEYS     u8 cmd                            -> status, i64 count
 *   TRY_GET      u8 cmd, str key                   -> status, u8 present, str value
 *                                                     (the value only when present)
 * A response whose status is BAD_REQUEST carries one str with the reason
 * (e.g. ADD on a value that is not an integer) instead of the result fields.
 */
#ifndef CHORUS_STORE_STORE_PROTO_H
#define CHORUS_STORE_STORE_PROTO_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "store.h"
#include "util/crypto.h"
#include "util/le.h"

#define CHORUS__STORE_MAGIC "CHST"
#define CHORUS__STORE_VERSION 2u
#define CHORUS__STORE_NONCE_LEN 32u
#define CHORUS__STORE_MAC_LEN 32u
/* Server hello body: magic, u32 version, server nonce. */
#define CHORUS__STORE_HELLO_LEN (4u + 4u + CHORUS__STORE_NONCE_LEN)
/* Client answer body: magic, u32 version, client nonce, client MAC. */
#define CHORUS__STORE_AUTH_LEN (4u + 4u + CHORUS__STORE_NONCE_LEN + CHORUS__STORE_MAC_LEN)
/* Server verdict body: u8 verdict, then the server MAC when it is OK. */
#define CHORUS__STORE_VERDICT_OK_LEN (1u + CHORUS__STORE_MAC_LEN)
/* Most keys one CHECK or WAIT may name. */
#define CHORUS__STORE_MAX_KEYS 65536u
/* Longest reason a BAD_REQUEST response carries. */
#define CHORUS__STORE_MAX_REASON 512u

/* Request commands (the first byte of a request body). */
enum {
  CHORUS__STORE_CMD_SET = 1,
  CHORUS__STORE_CMD_GET = 2,
  CHORUS__STORE_CMD_ADD = 3,
  CHORUS__STORE_CMD_COMPARE_SET = 4,
  CHORUS__STORE_CMD_CHECK = 5,
  CHORUS__STORE_CMD_DELETE = 6,
  CHORUS__STORE_CMD_WAIT = 7,
  CHORUS__STORE_CMD_NUM_KEYS = 8,
  CHORUS__STORE_CMD_TRY_GET = 9,
};

/* Response status (the first byte of a response body).  TIMEOUT is reserved:
 * this server never times a request out itself, clients apply their own
 * deadline. */
enum {
  CHORUS__STORE_ST_OK = 0,
  CHORUS__STORE_ST_TIMEOUT = 1,
  CHORUS__STORE_ST_BAD_REQUEST = 2,
};

/* Handshake verdict (the one-byte body of the server's last handshake frame). */
enum {
  CHORUS__STORE_HS_OK = 0,
  CHORUS__STORE_HS_DENIED = 1,  /* wrong secret */
  CHORUS__STORE_HS_VERSION = 2, /* bad magic or protocol version */
};

/* ------------------------------------------------------------ write buffer */

typedef struct chorus__sbuf {
  uint8_t *data; /* owned; NULL until the first append */
  size_t len;
  size_t cap;
  int oom; /* an append failed; the contents are incomplete */
} chorus__sbuf_t;

/* Makes room for `extra` more bytes and returns where they go, or NULL (and
 * sets oom) when memory is short. */
static inline uint8_t *chorus__sbuf_reserve(chorus__sbuf_t *b, size_t extra) {
  if (b->oom) return NULL;
  if (extra > SIZE_MAX / 2 - b->len) {
    b->oom = 1;
    return NULL;
  }
  if (b->len + extra > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    uint8_t *p = realloc(b->data, cap);
    if (!p) {
      b->oom = 1;
      return NULL;
    }
    b->data = p;
    b->cap = cap;
  }
  uint8_t *at = b->data + b->len;
  b->len += extra;
  return at;
}

static inline void chorus__sbuf_u8(chorus__sbuf_t *b, uint8_t v) {
  uint8_t *p = chorus__sbuf_reserve(b, 1);
  if (p) *p = v;
}

static inline void chorus__sbuf_u32(chorus__sbuf_t *b, uint32_t v) {
  uint8_t *p = chorus__sbuf_reserve(b, 4);
  if (p) chorus__le32_put(p, v);
}

static inline void chorus__sbuf_u64(chorus__sbuf_t *b, uint64_t v) {
  uint8_t *p = chorus__sbuf_reserve(b, 8);
  if (p) chorus__le64_put(p, v);
}

static inline void chorus__sbuf_raw(chorus__sbuf_t *b, const void *data, size_t len) {
  uint8_t *p = chorus__sbuf_reserve(b, len);
  if (p && len) memcpy(p, data, len);
}

/* A length-prefixed string.  len must fit in u32 (callers check limits). */
static inline void chorus__sbuf_str(chorus__sbuf_t *b, const void *data, size_t len) {
  chorus__sbuf_u32(b, (uint32_t)len);
  chorus__sbuf_raw(b, data, len);
}

/* Starts a frame: reserves its u32 length and returns the offset to hand to
 * chorus__sbuf_frame_end() once the body is appended. */
static inline size_t chorus__sbuf_frame_begin(chorus__sbuf_t *b) {
  size_t at = b->len;
  chorus__sbuf_reserve(b, 4);
  return at;
}

static inline void chorus__sbuf_frame_end(chorus__sbuf_t *b, size_t at) {
  if (!b->oom) chorus__le32_put(b->data + at, (uint32_t)(b->len - at - 4));
}

static inline void chorus__sbuf_free(chorus__sbuf_t *b) {
  free(b->data);
  memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------ frame reader */

typedef struct chorus__srd {
  const uint8_t *p; /* next unread byte */
  size_t left;      /* bytes left in the frame */
  int bad;          /* a read ran past the end or exceeded its limit */
} chorus__srd_t;

static inline chorus__srd_t chorus__srd_make(const void *data, size_t len) {
  chorus__srd_t r = {(const uint8_t *)data, len, 0};
  return r;
}

static inline uint8_t chorus__srd_u8(chorus__srd_t *r) {
  if (r->bad || r->left < 1) {
    r->bad = 1;
    return 0;
  }
  r->left--;
  return *r->p++;
}

static inline uint32_t chorus__srd_u32(chorus__srd_t *r) {
  if (r->bad || r->left < 4) {
    r->bad = 1;
    return 0;
  }
  uint32_t v = chorus__le32_get(r->p);
  r->p += 4;
  r->left -= 4;
  return v;
}

static inline uint64_t chorus__srd_u64(chorus__srd_t *r) {
  if (r->bad || r->left < 8) {
    r->bad = 1;
    return 0;
  }
  uint64_t v = chorus__le64_get(r->p);
  r->p += 8;
  r->left -= 8;
  return v;
}

/* A length-prefixed string of at most max bytes; *data points into the frame
 * (not NUL-terminated).  On error *data is NULL and *len 0. */
static inline void chorus__srd_str(chorus__srd_t *r, size_t max, const uint8_t **data,
                                   size_t *len) {
  uint32_t n = chorus__srd_u32(r);
  if (r->bad || n > max || n > r->left) {
    r->bad = 1;
    *data = NULL;
    *len = 0;
    return;
  }
  *data = r->p;
  *len = n;
  r->p += n;
  r->left -= n;
}

/* Raw bytes of a fixed size (the handshake's magic and nonce). */
static inline const uint8_t *chorus__srd_raw(chorus__srd_t *r, size_t n) {
  if (r->bad || r->left < n) {
    r->bad = 1;
    return NULL;
  }
  const uint8_t *at = r->p;
  r->p += n;
  r->left -= n;
  return at;
}

/* The handshake's proofs: HMAC-SHA256 under the job key of a label (which
 * side proves), the server's nonce and the client's.  Each side checks the
 * other's, so neither a stranger client nor a stranger server listening on
 * the store's port gets anywhere without the key. */
static inline void chorus__store_mac(const chorus__key_t *key, int server_side,
                                     const uint8_t *server_nonce, const uint8_t *client_nonce,
                                     uint8_t mac[CHORUS__STORE_MAC_LEN]) {
  static const char lc[] = "chorus store client", ls[] = "chorus store server";
  const void *parts[3] = {server_side ? ls : lc, server_nonce, client_nonce};
  size_t lens[3] = {sizeof lc, CHORUS__STORE_NONCE_LEN, CHORUS__STORE_NONCE_LEN};
  chorus__hmac(key, parts, lens, 3, mac);
}

/* Name of a command for logs and error messages. */
static inline const char *chorus__store_cmd_name(int cmd) {
  switch (cmd) {
    case CHORUS__STORE_CMD_SET:
      return "set";
    case CHORUS__STORE_CMD_GET:
      return "get";
    case CHORUS__STORE_CMD_ADD:
      return "add";
    case CHORUS__STORE_CMD_COMPARE_SET:
      return "compare_set";
    case CHORUS__STORE_CMD_CHECK:
      return "check";
    case CHORUS__STORE_CMD_DELETE:
      return "delete";
    case CHORUS__STORE_CMD_WAIT:
      return "wait";
    case CHORUS__STORE_CMD_NUM_KEYS:
      return "num_keys";
    default:
      return "unknown";
  }
}

#endif
