/*
 * kv_etcd.c - the rendezvous's key-value service on etcd (the etcd
 * backend): get, put and compare-and-set on an etcd v3 cluster through its
 * JSON gateway (POST /v3/kv/range, /v3/kv/put, /v3/kv/txn) over plain
 * HTTP/1.1, with our own sockets, base64 and JSON scanner, so the launcher
 * needs no HTTP or JSON library.
 *
 * Design
 *  - One keep-alive connection to one member at a time, "the current
 *    endpoint".  A call sends one request and reads one reply, both bounded
 *    by the call's deadline (call_timeout_ms).  The connection is closed
 *    after every failed exchange, so a late reply can never be taken for
 *    the answer to the next request.  A request that finds its kept
 *    connection closed before any byte of the reply arrived (the member
 *    closed it while idle) is sent once more on a fresh one (once per
 *    call, as a retry: see cas below).
 *  - Failover: when a member does not answer (refused, reset, timed out,
 *    HTTP 5xx such as "no leader" during an election) the call goes on
 *    with the next endpoint, round robin, pausing PAUSE_MS after each full
 *    pass, until the deadline; later calls start from the member that
 *    answered last.  An attempt that is not the last untried one of its
 *    pass gets half the time left (between ATTEMPT_MIN_MS and
 *    ATTEMPT_MAX_MS), so one silent member cannot use up the whole call.
 *    When every member refuses connections for REFUSED_WINDOW_MS the call
 *    gives up early: nothing listens, waiting longer helps nobody.  A member that answers wrongly
 *    (not HTTP, malformed JSON, too large, no /v3 gateway) is skipped for
 *    the rest of the call; when every member did so, the call ends at once.
 *    etcd refusing the request itself (HTTP 4xx: too large, invalid, needs
 *    authentication) ends the call at once: every member would say the same.
 *  - A request whose reply was lost may still have been applied.  put is
 *    idempotent.  For cas, once an attempt may have been applied, the
 *    retries' transactions also read the key when the comparison fails;
 *    finding our desired value there means the lost attempt swapped it
 *    (kv_store.c decides every cas that way: the value after the call is
 *    ours).  A transaction is evaluated when etcd applies it, so at most one
 *    of the attempts can swap.
 *  - Every reply is untrusted.  Headers are bounded (HEAD_MAX), bodies too
 *    (REPLY_MAX, after de-chunking, before anything is read past it: a
 *    Content-Length above it is refused right away).  Content-Length and
 *    chunked transfer coding are read; both at once, other codings, folded
 *    or NUL-carrying headers are refused.  The JSON scanner validates the
 *    whole body (grammar, string escapes, nesting at most JSON_DEPTH) before
 *    anything is looked up in it; values are strict base64 and must not
 *    hold a NUL byte.
 *  - One thread: a kv_t is used by the agent's loop only (no lock).
 *
 * What etcd 3.4.23 (Debian 12) does, measured: the gateway is at /v3/...
 * (/v3alpha/... is 404); keys and values are base64; int64 fields are JSON
 * strings; fields equal to 0, false or empty are left out of replies
 * ("succeeded" absent when false, "kvs" absent when no key, "value" absent
 * for an empty value); a txn's compare on an absent key with target VALUE
 * fails, and {"target":"CREATE","result":"EQUAL","create_revision":"0"}
 * holds exactly when the key does not exist; replies longer than about 2 KiB
 * come chunked, with a trailer; requests above --max-request-bytes (1.5 MiB
 * by default) are refused with HTTP 400 "etcdserver: request is too large",
 * above 2 MiB with HTTP 429 from the gateway; errors are
 * {"error":"...","message":"...","code":N} with an HTTP status from the gRPC
 * code (Unavailable: 503).
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/net.h"
#include "util/util.h"

#define EP_MAX 16 /* endpoints in the list */
#define HOST_MAX 256
#define HEAD_MAX (64 << 10)         /* status line and headers of one reply */
#define REPLY_MAX ((size_t)8 << 20) /* one reply's body, de-chunked */
#define CHUNK_LINE_MAX 1024         /* a chunk-size line, a trailer line */
/* The reply buffer: headers, the body, one chunk line and some slack. */
#define RAW_MAX (HEAD_MAX + REPLY_MAX + CHUNK_LINE_MAX + (16 << 10))
#define REQ_HEAD 512 /* room for the request line and headers */
/* A request: a cas carries two values of at most REPLY_MAX in base64. */
#define REQUEST_MAX (3 * REPLY_MAX)
#define JSON_DEPTH 64
#define PAUSE_MS 50 /* after a pass over every endpoint */
#define ATTEMPT_MIN_MS 100
#define ATTEMPT_MAX_MS 2000 /* unless the last untried of a pass */
#define REFUSED_WINDOW_MS 1000
#define DEFAULT_CALL_MS 5000
#define WHY_CAP 220 /* one endpoint's last failure */
#define SHOWN 100   /* bytes of a bad reply quoted */

typedef struct {
  char host[HOST_MAX];
  int port;
  char name[HOST_MAX + 16]; /* "host:port" ("[v6]:port"): Host header, messages */
  char why[WHY_CAP];        /* its last failure in the current call */
  int bad;                  /* answered wrongly in the current call: skipped */
  int refused;              /* its last attempt found nothing listening */
} endpoint_t;

typedef struct {
  kv_t base;
  endpoint_t ep[EP_MAX];
  int nep;
  int cur; /* the endpoint fd is connected to, else the one tried next */
  int fd;  /* keep-alive connection to ep[cur], -1 when none */
  int call_ms;
  char *prefix; /* put before every key */
} kv_etcd_t;

/* What one attempt on one member came to. */
enum {
  A_OK = 0,
  A_RETRY = -1, /* no (usable) answer: another member, or later, may answer */
  A_STALE = -2, /* a kept connection was closed before any reply byte */
  A_BAD = -3,   /* this member answered wrongly: skip it for this call */
  A_FINAL = -4, /* etcd refused the request (k->base.err): same everywhere */
};

static void set_err(kv_etcd_t *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(kv_etcd_t *k, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(k->base.err, sizeof k->base.err, fmt, ap);
  va_end(ap);
}

static int set_why(endpoint_t *ep, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int set_why(endpoint_t *ep, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ep->why, sizeof ep->why, fmt, ap);
  va_end(ap);
  return rc;
}

/* Copies up to SHOWN bytes of untrusted text for a message: anything not
 * printable ASCII (or a double quote) becomes '?', "..." marks a cut. */
static const char *shown(char *out, size_t cap, const char *s, size_t n) {
  size_t o = 0, lim = CHORUS__MIN(n, (size_t)SHOWN);
  for (size_t i = 0; i < lim && o + 4 < cap; i++) {
    unsigned char c = (unsigned char)s[i];
    out[o++] = c >= 0x20 && c < 0x7f && c != '"' ? (char)c : '?';
  }
  if (n > lim && o + 4 < cap) {
    memcpy(out + o, "...", 3);
    o += 3;
  }
  out[o] = '\0';
  return out;
}

/* ---------------------------------------------------------------- base64 */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static int b64_val(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* Encodes n bytes into out, which has room for b64_len(n) bytes. */
static size_t b64_len(size_t n) {
  return (n + 2) / 3 * 4;
}

static void b64_encode(const unsigned char *s, size_t n, char *out) {
  size_t o = 0, i = 0;
  for (; i + 3 <= n; i += 3) {
    uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
    out[o++] = B64[v >> 18];
    out[o++] = B64[(v >> 12) & 63];
    out[o++] = B64[(v >> 6) & 63];
    out[o++] = B64[v & 63];
  }
  if (i < n) {
    uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0);
    out[o++] = B64[v >> 18];
    out[o++] = B64[(v >> 12) & 63];
    out[o++] = i + 1 < n ? B64[(v >> 6) & 63] : '=';
    out[o++] = '=';
  }
}

/* Decodes standard padded base64 (what Go's encoding/json writes for
 * bytes) into out (room for n / 4 * 3 bytes): the length, or -1 when s is
 * not canonical base64 (length, alphabet, padding, unused bits). */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
  if (n % 4) return -1;
  size_t o = 0;
  for (size_t i = 0; i < n; i += 4) {
    int pad = 0, v[4];
    for (int j = 0; j < 4; j++) {
      unsigned char c = (unsigned char)s[i + j];
      if (c == '=' && i + 4 == n && j >= 2) {
        if (j == 2 && s[i + 3] != '=') return -1;
        v[j] = 0;
        pad++;
        continue;
      }
      if (pad || (v[j] = b64_val(c)) < 0) return -1;
    }
    uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
    if ((pad == 1 && (x & 0xff)) || (pad == 2 && (x & 0xffff))) return -1;
    out[o++] = (unsigned char)(x >> 16);
    if (pad < 2) out[o++] = (unsigned char)(x >> 8);
    if (pad < 1) out[o++] = (unsigned char)x;
  }
  return (long)o;
}

/* ------------------------------------------------------------ JSON scanner
 * Two steps: js_check validates a whole reply once (RFC 8259 grammar, at
 * most JSON_DEPTH levels, no control characters in strings); the lookups
 * (js_member, js_index, js_string) then walk the validated text and need no
 * error paths of their own beyond type checks.  Member names are compared
 * as written: etcd's names carry no escapes. */

typedef struct {
  const char *p, *end; /* one JSON value's text */
} span_t;

static const char *js_ws(const char *p, const char *end) {
  while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
  return p;
}

static int js_hex(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* p at '"': just past the closing quote, NULL when malformed. */
static const char *js_string_end(const char *p, const char *end) {
  for (p++; p < end; p++) {
    unsigned char c = (unsigned char)*p;
    if (c == '"') return p + 1;
    if (c < 0x20) return NULL;
    if (c != '\\') continue;
    if (++p >= end) return NULL;
    if (*p == 'u') {
      if (end - p < 5) return NULL;
      for (int i = 1; i <= 4; i++)
        if (js_hex(p[i]) < 0) return NULL;
      p += 4;
    } else if (!strchr("\"\\/bfnrt", *p) || *p == '\0') {
      return NULL;
    }
  }
  return NULL;
}

static const char *js_digits(const char *p, const char *end) {
  const char *q = p;
  while (q < end && *q >= '0' && *q <= '9') q++;
  return q > p ? q : NULL;
}

static const char *js_number_end(const char *p, const char *end) {
  if (p < end && *p == '-') p++;
  if (p < end && *p == '0')
    p++;
  else if (!(p = js_digits(p, end)))
    return NULL;
  if (p < end && *p == '.' && !(p = js_digits(p + 1, end))) return NULL;
  if (p < end && (*p == 'e' || *p == 'E')) {
    p++;
    if (p < end && (*p == '+' || *p == '-')) p++;
    if (!(p = js_digits(p, end))) return NULL;
  }
  return p;
}

/* The end of the value at p (whitespace before it skipped), NULL when
 * there is no valid one or it nests deeper than JSON_DEPTH. */
static const char *js_skip(const char *p, const char *end, int depth) {
  p = js_ws(p, end);
  if (p >= end) return NULL;
  switch (*p) {
    case '"':
      return js_string_end(p, end);
    case '{':
    case '[': {
      char close = *p == '{' ? '}' : ']';
      if (depth >= JSON_DEPTH) return NULL;
      p = js_ws(p + 1, end);
      if (p < end && *p == close) return p + 1;
      for (;;) {
        if (close == '}') {
          if (p >= end || *p != '"' || !(p = js_string_end(p, end))) return NULL;
          p = js_ws(p, end);
          if (p >= end || *p != ':') return NULL;
          p++;
        }
        if (!(p = js_skip(p, end, depth + 1))) return NULL;
        p = js_ws(p, end);
        if (p < end && *p == ',') {
          p = js_ws(p + 1, end);
          continue;
        }
        return p < end && *p == close ? p + 1 : NULL;
      }
    }
    case 't':
      return end - p >= 4 && !memcmp(p, "true", 4) ? p + 4 : NULL;
    case 'f':
      return end - p >= 5 && !memcmp(p, "false", 5) ? p + 5 : NULL;
    case 'n':
      return end - p >= 4 && !memcmp(p, "null", 4) ? p + 4 : NULL;
    default:
      return js_number_end(p, end);
  }
}

/* 0 when s[0..n) is exactly one JSON value (with whitespace around). */
static int js_check(const char *s, size_t n, span_t *root) {
  const char *end = s + n, *p = js_ws(s, end);
  const char *e = js_skip(p, end, 0);
  if (!e || js_ws(e, end) != end) return -1;
  root->p = p;
  root->end = e;
  return 0;
}

/* The member name of object v: 1 (*out), 0 absent, -1 v is no object. */
static int js_member(span_t v, const char *name, span_t *out) {
  const char *p = v.p, *end = v.end;
  size_t nl = strlen(name);
  if (p >= end || *p != '{') return -1;
  p = js_ws(p + 1, end);
  while (p < end && *p == '"') {
    const char *ke = js_string_end(p, end);
    if (!ke) return -1;
    int match = (size_t)(ke - p) == nl + 2 && !memcmp(p + 1, name, nl);
    p = js_ws(ke, end) + 1; /* the ':' */
    p = js_ws(p, end);
    const char *ve = js_skip(p, end, 0);
    if (!ve) return -1;
    if (match) {
      out->p = p;
      out->end = ve;
      return 1;
    }
    p = js_ws(ve, end);
    if (p < end && *p == ',') p = js_ws(p + 1, end);
  }
  return 0;
}

/* Element idx of array v: 1 (*out), 0 absent, -1 v is no array. */
static int js_index(span_t v, size_t idx, span_t *out) {
  const char *p = v.p, *end = v.end;
  if (p >= end || *p != '[') return -1;
  p = js_ws(p + 1, end);
  for (size_t i = 0; p < end && *p != ']'; i++) {
    const char *ve = js_skip(p, end, 0);
    if (!ve) return -1;
    if (i == idx) {
      out->p = p;
      out->end = ve;
      return 1;
    }
    p = js_ws(ve, end);
    if (p < end && *p == ',') p = js_ws(p + 1, end);
  }
  return 0;
}

static size_t utf8_put(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xc0 | cp >> 6);
    o[1] = (char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | cp >> 12);
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f));
    return 3;
  }
  o[0] = (char)(0xf0 | cp >> 18);
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
  o[3] = (char)(0x80 | (cp & 0x3f));
  return 4;
}

static uint32_t js_u4(const char *p) {
  return (uint32_t)(js_hex(p[0]) << 12 | js_hex(p[1]) << 8 | js_hex(p[2]) << 4 | js_hex(p[3]));
}

/* The string value v unescaped, malloc'd and NUL-terminated (*len without
 * the NUL; "\u0000" may put a NUL inside: callers check).  NULL when v is
 * no string (*len = 0) or out of memory (*len = 1). */
static char *js_string(span_t v, size_t *len) {
  *len = 0;
  if (v.p >= v.end || *v.p != '"') return NULL;
  /* Unescaping never makes text longer: \uXXXX (6 bytes) is at most 3
   * bytes of UTF-8, a surrogate pair (12) is 4. */
  char *out = malloc((size_t)(v.end - v.p));
  if (!out) {
    *len = 1;
    return NULL;
  }
  size_t o = 0;
  for (const char *p = v.p + 1; p < v.end - 1; p++) {
    if (*p != '\\') {
      out[o++] = *p;
      continue;
    }
    p++;
    switch (*p) {
      case 'b':
        out[o++] = '\b';
        break;
      case 'f':
        out[o++] = '\f';
        break;
      case 'n':
        out[o++] = '\n';
        break;
      case 'r':
        out[o++] = '\r';
        break;
      case 't':
        out[o++] = '\t';
        break;
      case 'u': {
        uint32_t cp = js_u4(p + 1);
        p += 4;
        if (cp >= 0xd800 && cp < 0xdc00 && v.end - 1 - p > 6 && p[1] == '\\' && p[2] == 'u') {
          uint32_t lo = js_u4(p + 3);
          if (lo >= 0xdc00 && lo < 0xe000) {
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            p += 6;
          }
        }
        if (cp >= 0xd800 && cp < 0xe000) cp = 0xfffd; /* a lone surrogate */
        o += utf8_put(out + o, cp);
        break;
      }
      default:
        out[o++] = *p;
        break; /* " \ / */
    }
  }
  out[o] = '\0';
  *len = o;
  return out;
}

/* --------------------------------------------------------------- endpoints */

/* Parses "host:port,[v6]:port,http://host:port/,...": 0 or -1 with err. */
static int parse_endpoints(kv_etcd_t *k, const char *list, char *err, size_t cap) {
  const char *p = list ? list : "";
  k->nep = 0;
  for (;;) {
    const char *comma = strchr(p, ',');
    size_t n = comma ? (size_t)(comma - p) : strlen(p);
    while (n && (*p == ' ' || *p == '\t')) p++, n--;
    while (n && (p[n - 1] == ' ' || p[n - 1] == '\t' || p[n - 1] == '/')) n--;
    if (n >= 8 && !strncasecmp(p, "https://", 8)) {
      snprintf(err, cap,
               "etcd endpoint '%.*s': TLS is not supported; give a plain http client URL "
               "(host:port)",
               (int)CHORUS__MIN(n, 200), p);
      return -1;
    }
    if (n >= 7 && !strncasecmp(p, "http://", 7)) p += 7, n -= 7;
    if (n == 0) {
      snprintf(err, cap, "etcd endpoints '%s': an empty entry; give host:port,host:port,...",
               list ? list : "");
      return -1;
    }
    if (k->nep == EP_MAX) {
      snprintf(err, cap, "etcd endpoints: more than %d", EP_MAX);
      return -1;
    }
    endpoint_t *ep = &k->ep[k->nep];
    const char *host = p, *port = NULL;
    size_t hl;
    if (*p == '[') {
      const char *rb = memchr(p, ']', n);
      if (!rb) goto bad;
      host = p + 1;
      hl = (size_t)(rb - host);
      if (rb + 1 < p + n) {
        if (rb[1] != ':') goto bad;
        port = rb + 2;
      }
    } else {
      const char *colon = memchr(p, ':', n);
      if (colon && memchr(colon + 1, ':', (size_t)(p + n - colon - 1))) goto bad; /* bare v6 */
      hl = colon ? (size_t)(colon - p) : n;
      port = colon ? colon + 1 : NULL;
    }
    if (hl == 0 || hl >= HOST_MAX) goto bad;
    for (size_t i = 0; i < hl; i++)
      if (host[i] == ' ' || host[i] == '/' || host[i] == '@' || (unsigned char)host[i] < 0x21)
        goto bad;
    memcpy(ep->host, host, hl);
    ep->host[hl] = '\0';
    ep->port = 2379; /* etcd's client port */
    if (port) {
      size_t pl = (size_t)(p + n - port);
      long v = 0;
      if (pl == 0 || pl > 5) goto bad;
      for (size_t i = 0; i < pl; i++) {
        if (port[i] < '0' || port[i] > '9') goto bad;
        v = v * 10 + (port[i] - '0');
      }
      if (v < 1 || v > 65535) goto bad;
      ep->port = (int)v;
    }
    /* Through a local buffer: GCC cannot tell that ep->host and ep->name
     * never overlap (-Wrestrict). */
    char name[sizeof ep->name];
    snprintf(name, sizeof name, strchr(ep->host, ':') ? "[%s]:%d" : "%s:%d", ep->host, ep->port);
    memcpy(ep->name, name, sizeof name);
    k->nep++;
    if (!comma) return 0;
    p = comma + 1;
    continue;
  bad:
    snprintf(err, cap, "etcd endpoint '%.*s' is not host:port (IPv6: [addr]:port)",
             (int)CHORUS__MIN(n, 200), p);
    return -1;
  }
}

/* ------------------------------------------------------------ connection */

static void drop(kv_etcd_t *k) {
  if (k->fd >= 0) close(k->fd);
  k->fd = -1;
}

static int wait_fd(int fd, short events, int64_t deadline) {
  for (;;) {
    int ms = chorus__ms_left(deadline);
    if (ms == 0) return -ETIMEDOUT;
    struct pollfd p = {.fd = fd, .events = events};
    int rc = poll(&p, 1, ms);
    if (rc > 0) return 0;
    if (rc < 0 && errno != EINTR) return -errno;
  }
}

/* One connection attempt to ep, bounded by deadline: fd or -errno.  Unlike
 * chorus__net_connect, a refusal is not retried: the caller moves on to the
 * next member.  (Name resolution is not bounded; numeric addresses need
 * none.) */
static int dial(const endpoint_t *ep, int64_t deadline) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  char svc[16];
  snprintf(svc, sizeof svc, "%d", ep->port);
  int rc = getaddrinfo(ep->host, svc, &hints, &res);
  if (rc != 0) return rc == EAI_SYSTEM ? -errno : -EHOSTUNREACH;
  rc = -ECONNREFUSED;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      rc = -errno;
      continue;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      rc = 0;
    } else if (errno != EINPROGRESS) {
      rc = -errno;
    } else if ((rc = wait_fd(fd, POLLOUT, deadline)) == 0) {
      int e = 0;
      socklen_t len = sizeof e;
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) < 0) e = errno;
      rc = -e;
    }
    if (rc == 0) {
      chorus__net_set_nodelay(fd);
      freeaddrinfo(res);
      return fd;
    }
    close(fd);
    if (rc == -ETIMEDOUT) break;
  }
  freeaddrinfo(res);
  return rc;
}

/* ---------------------------------------------------------------- replies */

typedef struct {
  char *b;
  size_t len, cap; /* cap - 1 usable: one byte stays for the body's NUL */
} rbuf_t;

typedef struct {
  int status;
  char *body; /* inside the rbuf, NUL-terminated */
  size_t n;
  int keep; /* the connection may carry the next request */
} reply_t;

/* Makes room in r for at least one more byte (and the NUL): 0, -ENOMEM,
 * -E2BIG when r holds RAW_MAX bytes already. */
static int rbuf_grow(rbuf_t *r) {
  if (r->len + 1 < r->cap) return 0;
  if (r->cap >= RAW_MAX + 1) return -E2BIG;
  size_t cap = r->cap ? r->cap * 2 : 16384;
  if (cap > RAW_MAX + 1) cap = RAW_MAX + 1;
  char *b = realloc(r->b, cap);
  if (!b) return -ENOMEM;
  r->b = b;
  r->cap = cap;
  return 0;
}

/* One recv into r, waiting until deadline: bytes read, 0 at EOF, -errno
 * (-ETIMEDOUT), -E2BIG when r holds RAW_MAX bytes already. */
static long recv_some(int fd, rbuf_t *r, int64_t deadline) {
  int rc = rbuf_grow(r);
  if (rc < 0) return rc;
  for (;;) {
    ssize_t n = recv(fd, r->b + r->len, r->cap - 1 - r->len, MSG_DONTWAIT);
    if (n >= 0) {
      r->len += (size_t)n;
      return (long)n;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -errno;
    if ((rc = wait_fd(fd, POLLIN, deadline)) < 0) return rc;
  }
}

/* Maps a failed recv_some to the attempt's outcome. */
static int recv_failed(endpoint_t *ep, long n, const rbuf_t *r, int ms, const char *when) {
  if (n == -E2BIG) return set_why(ep, A_BAD, "the reply is larger than %zu MiB", REPLY_MAX >> 20);
  if (n == -ENOMEM) return set_why(ep, A_FINAL, "out of memory for the reply");
  if (n == -ETIMEDOUT)
    return set_why(ep, A_RETRY, "%s after %d ms %s",
                   r->len ? "the reply was incomplete" : "no reply", ms, when);
  if (r->len == 0 && (n == 0 || n == -ECONNRESET))
    return set_why(ep, A_STALE, "closed the connection without replying");
  return set_why(ep, A_RETRY, "%s %s", n == 0 ? "connection closed" : strerror((int)-n), when);
}

static int hdr_is(const char *name, size_t nl, const char *want) {
  return nl == strlen(want) && !strncasecmp(name, want, nl);
}

/* Reads one HTTP/1.x reply from fd into r (r->len 0 on entry), bounded by
 * deadline.  A_OK with rep filled, else A_RETRY/A_STALE/A_BAD/A_FINAL with
 * ep->why. */
static int read_reply(int fd, endpoint_t *ep, rbuf_t *r, int64_t deadline, int ms, reply_t *rep) {
  static const char proto[] = "HTTP/1.";
  char q[4 * SHOWN];
  size_t hend = 0, scan = 0;
  long n;
  memset(rep, 0, sizeof *rep);
  if (rbuf_grow(r) < 0) return set_why(ep, A_FINAL, "out of memory for the reply");
  for (int informational = 0;;) {
    char *e;
    while (!(e = memmem(r->b + scan, r->len - scan, "\r\n\r\n", 4))) {
      /* Anything not starting like an HTTP reply is refused as soon as it
       * shows, rather than after waiting for an end of headers. */
      size_t m = CHORUS__MIN(r->len, sizeof proto - 1);
      if (m && memcmp(r->b, proto, m))
        return set_why(ep, A_BAD, "not an HTTP reply: \"%s\"", shown(q, sizeof q, r->b, r->len));
      if (r->len >= HEAD_MAX)
        return set_why(ep, A_BAD, "reply headers longer than %d KiB", HEAD_MAX >> 10);
      scan = r->len > 3 ? r->len - 3 : 0;
      if ((n = recv_some(fd, r, deadline)) <= 0)
        return recv_failed(ep, n, r, ms, "reading the headers");
    }
    hend = (size_t)(e - r->b) + 4;
    if (memchr(r->b, '\0', hend)) return set_why(ep, A_BAD, "a NUL byte in the reply headers");
    /* "HTTP/1.1 200 OK\r\n" */
    const char *s = r->b;
    if (hend < 16 || memcmp(s, proto, 7) || (s[7] != '0' && s[7] != '1') || s[8] != ' ' ||
        s[9] < '1' || s[9] > '5' || s[10] < '0' || s[10] > '9' || s[11] < '0' || s[11] > '9' ||
        (s[12] != ' ' && s[12] != '\r'))
      return set_why(ep, A_BAD, "not an HTTP reply: \"%s\"", shown(q, sizeof q, r->b, hend));
    rep->status = (s[9] - '0') * 100 + (s[10] - '0') * 10 + (s[11] - '0');
    rep->keep = s[7] == '1';
    if (rep->status >= 200) break;
    /* 1xx: an interim reply; the real one follows. */
    if (++informational > 4) return set_why(ep, A_BAD, "more than 4 interim (1xx) replies");
    memmove(r->b, r->b + hend, r->len - hend);
    r->len -= hend;
    scan = 0;
  }

  /* Headers. */
  int chunked = 0, has_len = 0;
  size_t clen = 0;
  const char *p = memmem(r->b, hend, "\r\n", 2) + 2, *hd_end = r->b + hend - 2;
  while (p < hd_end) {
    const char *eol = memmem(p, (size_t)(hd_end + 2 - p), "\r\n", 2);
    const char *colon = memchr(p, ':', (size_t)(eol - p));
    if (*p == ' ' || *p == '\t' || !colon || colon == p)
      return set_why(ep, A_BAD, "a malformed reply header: \"%s\"",
                     shown(q, sizeof q, p, (size_t)(eol - p)));
    size_t nl = (size_t)(colon - p);
    const char *v = colon + 1, *ve = eol;
    while (v < ve && (*v == ' ' || *v == '\t')) v++;
    while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t')) ve--;
    size_t vl = (size_t)(ve - v);
    if (hdr_is(p, nl, "content-length")) {
      size_t x = 0;
      if (vl == 0 || vl > 19) goto bad_len;
      for (size_t i = 0; i < vl; i++) {
        if (v[i] < '0' || v[i] > '9') goto bad_len;
        x = x * 10 + (size_t)(v[i] - '0');
      }
      if (has_len && x != clen) goto bad_len;
      has_len = 1;
      clen = x;
    } else if (hdr_is(p, nl, "transfer-encoding")) {
      if (vl != 7 || strncasecmp(v, "chunked", 7))
        return set_why(ep, A_BAD, "an unsupported transfer coding \"%s\"",
                       shown(q, sizeof q, v, vl));
      chunked = 1;
    } else if (hdr_is(p, nl, "connection")) {
      for (size_t i = 0; i + 5 <= vl; i++)
        if (!strncasecmp(v + i, "close", 5)) rep->keep = 0;
    }
    p = eol + 2;
  }
  if (chunked && has_len)
    return set_why(ep, A_BAD, "both Content-Length and chunked transfer coding");
  if (has_len && clen > REPLY_MAX)
    return set_why(ep, A_BAD, "the reply announces %zu bytes, more than the %zu MiB accepted", clen,
                   REPLY_MAX >> 20);

  /* Body. */
  size_t body = hend;
  if (rep->status == 204 || rep->status == 304) {
    rep->n = 0;
    if (r->len > hend) rep->keep = 0;
  } else if (chunked) {
    /* De-chunked in place: [body, out) holds the data so far and the
     * unread rest is moved down behind it after each chunk, so the buffer
     * never holds much more than the body. */
    size_t out = hend, pos = hend;
    for (;;) {
      char *eol;
      while (!(eol = memmem(r->b + pos, r->len - pos, "\r\n", 2))) {
        if (r->len - pos > CHUNK_LINE_MAX) return set_why(ep, A_BAD, "a chunk-size line too long");
        if ((n = recv_some(fd, r, deadline)) <= 0)
          return recv_failed(ep, n, r, ms, "reading the body");
      }
      const char *c = r->b + pos;
      size_t size = 0, digits = 0;
      for (; c < eol && js_hex(*c) >= 0; c++, digits++) size = size * 16 + (size_t)js_hex(*c);
      while (c < eol && (*c == ' ' || *c == '\t')) c++;
      if (digits == 0 || digits > 8 || (c < eol && *c != ';'))
        return set_why(ep, A_BAD, "a malformed chunk-size line \"%s\"",
                       shown(q, sizeof q, r->b + pos, (size_t)(eol - (r->b + pos))));
      if (size > REPLY_MAX - (out - body))
        return set_why(ep, A_BAD, "the chunked reply is larger than %zu MiB", REPLY_MAX >> 20);
      pos = (size_t)(eol - r->b) + 2;
      if (size == 0) break;
      while (r->len - pos < size + 2)
        if ((n = recv_some(fd, r, deadline)) <= 0)
          return recv_failed(ep, n, r, ms, "reading the body");
      if (r->b[pos + size] != '\r' || r->b[pos + size + 1] != '\n')
        return set_why(ep, A_BAD, "a chunk not followed by CRLF");
      memmove(r->b + out, r->b + pos, size);
      out += size;
      pos += size + 2;
      memmove(r->b + out, r->b + pos, r->len - pos);
      r->len -= pos - out;
      pos = out;
    }
    /* Trailers (etcd sends Grpc-Trailer-Content-Type), up to an empty line. */
    for (size_t total = 0;;) {
      char *eol;
      while (!(eol = memmem(r->b + pos, r->len - pos, "\r\n", 2))) {
        if (r->len - pos > CHUNK_LINE_MAX) return set_why(ep, A_BAD, "a trailer line too long");
        if ((n = recv_some(fd, r, deadline)) <= 0)
          return recv_failed(ep, n, r, ms, "reading the trailers");
      }
      size_t ll = (size_t)(eol - (r->b + pos));
      pos += ll + 2;
      if (ll == 0) break;
      if ((total += ll + 2) > HEAD_MAX)
        return set_why(ep, A_BAD, "trailers longer than %d KiB", HEAD_MAX >> 10);
    }
    if (r->len > pos) rep->keep = 0; /* bytes nobody asked for */
    rep->n = out - body;
  } else if (has_len) {
    while (r->len - hend < clen)
      if ((n = recv_some(fd, r, deadline)) <= 0)
        return recv_failed(ep, n, r, ms, "reading the body");
    if (r->len > hend + clen) rep->keep = 0;
    rep->n = clen;
  } else {
    /* Neither: the body ends with the connection. */
    rep->keep = 0;
    while ((n = recv_some(fd, r, deadline)) > 0) {
    }
    if (n < 0) return recv_failed(ep, n, r, ms, "reading the body");
    if (r->len - hend > REPLY_MAX)
      return set_why(ep, A_BAD, "the reply is larger than %zu MiB", REPLY_MAX >> 20);
    rep->n = r->len - hend;
  }
  rep->body = r->b + body;
  rep->body[rep->n] = '\0';
  return A_OK;
bad_len:
  return set_why(ep, A_BAD, "a malformed Content-Length");
}

/* The message of an error reply: etcd's "message" (or "error") when the
 * body is JSON with one, else the body's beginning. */
static const char *error_text(const reply_t *rep, char *out, size_t cap) {
  span_t root, m;
  if (js_check(rep->body, rep->n, &root) == 0 &&
      (js_member(root, "message", &m) == 1 || js_member(root, "error", &m) == 1)) {
    size_t len;
    char *s = js_string(m, &len);
    if (s) {
      shown(out, cap, s, len);
      free(s);
      return out;
    }
  }
  return shown(out, cap, rep->body, rep->n);
}

/* --------------------------------------------------------------- requests */

typedef struct {
  char *b;
  size_t len, cap;
  int oom; /* out of memory or past REQUEST_MAX: the request is not sent */
} sb_t;

/* Room for n more bytes and a NUL: where to write them, NULL (s->oom). */
static char *sb_room(sb_t *s, size_t n) {
  if (s->oom || n > REQUEST_MAX - s->len - 1) {
    s->oom = 1;
    return NULL;
  }
  if (s->len + n + 1 > s->cap) {
    size_t cap = s->cap ? s->cap : 1024;
    while (cap < s->len + n + 1) cap *= 2;
    char *b = realloc(s->b, cap);
    if (!b) {
      s->oom = 1;
      return NULL;
    }
    s->b = b;
    s->cap = cap;
  }
  return s->b + s->len;
}

static void sb_put(sb_t *s, const char *p, size_t n) {
  char *d = sb_room(s, n);
  if (!d) return;
  memcpy(d, p, n);
  s->len += n;
}

static void sb_str(sb_t *s, const char *p) {
  sb_put(s, p, strlen(p));
}

/* Appends the JSON string "base64(a b)" to s. */
static void sb_b64(sb_t *s, const char *a, const char *b) {
  size_t al = strlen(a), bl = strlen(b);
  const char *raw = b;
  char *cat = NULL;
  if (al) { /* a key under the prefix: short */
    if (bl > REQUEST_MAX || !(cat = malloc(al + bl + 1))) {
      s->oom = 1;
      return;
    }
    memcpy(cat, a, al);
    memcpy(cat + al, b, bl);
    raw = cat;
  }
  size_t n = al + bl, el = n <= REQUEST_MAX ? b64_len(n) : REQUEST_MAX;
  char *d = sb_room(s, el + 2);
  if (d) {
    d[0] = '"';
    b64_encode((const unsigned char *)raw, n, d + 1);
    d[el + 1] = '"';
    s->len += el + 2;
  }
  free(cat);
}

/* A request body starts after REQ_HEAD bytes kept for the request line and
 * headers, so each attempt sends both with one write. */
static void sb_begin(sb_t *s) {
  memset(s, 0, sizeof *s);
  if (sb_room(s, REQ_HEAD)) {
    memset(s->b, 0, REQ_HEAD);
    s->len = REQ_HEAD;
  }
}

/* Sends the request in s to ep[k->cur] (connecting first when needed) and
 * reads the reply into r, by deadline.  *sent: the request went out whole
 * (etcd may have applied it, reply or not).  A_OK with a 200 reply whose
 * body is a valid JSON object, else an outcome with k->ep[k->cur].why (or
 * k->base.err for A_FINAL).  The connection is closed unless A_OK. */
static int attempt(kv_etcd_t *k, const char *path, sb_t *s, int64_t deadline, int ms, rbuf_t *r,
                   reply_t *rep, span_t *root, int *sent) {
  endpoint_t *ep = &k->ep[k->cur];
  char head[REQ_HEAD], q[4 * SHOWN];
  ep->refused = 0;
  int hl = snprintf(head, sizeof head,
                    "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                    "Content-Length: %zu\r\n\r\n",
                    path, ep->name, s->len - REQ_HEAD);
  if (hl < 0 || hl >= REQ_HEAD) {
    set_err(k, "etcd %s: request headers too long", ep->name);
    return A_FINAL;
  }
  char *req = s->b + REQ_HEAD - hl;
  memcpy(req, head, (size_t)hl);
  size_t len = s->len - REQ_HEAD + (size_t)hl;

  int reused = k->fd >= 0;
  if (!reused) {
    int fd = dial(ep, deadline);
    if (fd < 0) {
      ep->refused = fd == -ECONNREFUSED;
      return set_why(ep, A_RETRY, "connect: %s", fd == -ETIMEDOUT ? "timed out" : strerror(-fd));
    }
    k->fd = fd;
  }
  int rc = chorus__net_write_full(k->fd, req, len, deadline);
  if (rc < 0) {
    drop(k);
    return set_why(ep, reused && rc != -ETIMEDOUT ? A_STALE : A_RETRY, "sending the request: %s",
                   rc == -ETIMEDOUT ? "timed out" : strerror(-rc));
  }
  *sent = 1;
  r->len = 0;
  rc = read_reply(k->fd, ep, r, deadline, ms, rep);
  if (rc != A_OK || !rep->keep) drop(k);
  if (rc == A_STALE && !reused) rc = A_RETRY;
  if (rc == A_FINAL) set_err(k, "etcd %s: %s", ep->name, ep->why);
  if (rc != A_OK) return rc;
  if (rep->status == 200) {
    if (js_check(rep->body, rep->n, root) == 0 && *root->p == '{') return A_OK;
    drop(k);
    return set_why(ep, A_BAD, "malformed JSON in the reply to %s: \"%s\"", path,
                   shown(q, sizeof q, rep->body, rep->n));
  }
  drop(k);
  error_text(rep, q, sizeof q);
  if (rep->status >= 500) return set_why(ep, A_RETRY, "HTTP %d: %s", rep->status, q);
  if (rep->status == 404 || rep->status == 405)
    return set_why(ep, A_BAD,
                   "HTTP %d for POST %s: no etcd v3 JSON gateway here; give the client URL of "
                   "etcd >= 3.4 (e.g. host:2379)",
                   rep->status, path);
  if (rep->status == 401 || rep->status == 403) {
    set_err(k,
            "etcd %s: HTTP %d: %s; chorusrun's etcd client does not authenticate: use a "
            "cluster (or prefix) open to unauthenticated clients",
            ep->name, rep->status, q);
    return A_FINAL;
  }
  set_err(k, "etcd %s refused the request (HTTP %d): %s", ep->name, rep->status, q);
  return A_FINAL;
}

/* Runs one request on the service until a member answers it (0: rep and
 * root describe the 200 reply, its body in r), etcd refuses it or every
 * member answered wrongly, or the deadline passes (-1, k->base.err).
 * retry (NULL: s again) is sent instead of s once an earlier attempt may
 * have been applied; *retried says which one the reply answers. */
static int request(kv_etcd_t *k, const char *path, sb_t *s, sb_t *retry, int64_t deadline,
                   rbuf_t *r, reply_t *rep, span_t *root, int *retried) {
  if (s->oom || (retry && retry->oom)) {
    set_err(k, "etcd: out of memory for the request");
    return -1;
  }
  int64_t t0 = chorus__now_ns();
  int usable = k->nep, tried = 0, only_refused = 1, ambiguous = 0, stale = 0;
  for (int i = 0; i < k->nep; i++) {
    k->ep[i].why[0] = '\0';
    k->ep[i].bad = 0;
  }
  *retried = 0;
  for (;;) {
    while (k->ep[k->cur].bad) k->cur = (k->cur + 1) % k->nep;
    int64_t now = chorus__now_ns(), left = deadline - now;
    if (left <= 0) break;
    /* The last untried member of a pass gets all the time left, the
     * others half of it, at least ATTEMPT_MIN_MS and at most
     * ATTEMPT_MAX_MS: a follower whose proposal went to a leader that just
     * died holds it until etcd's own request timeout (7 s), while another
     * member answers once a new leader is elected (about a second). */
    int64_t share = left;
    if (tried + 1 < usable)
      share =
          CHORUS__MIN(CHORUS__MAX(left / 2, CHORUS__MIN(left, (int64_t)ATTEMPT_MIN_MS * 1000000)),
                      (int64_t)ATTEMPT_MAX_MS * 1000000);
    share = CHORUS__MIN(share, (int64_t)k->call_ms * 1000000);
    sb_t *body = ambiguous && retry ? retry : s;
    int sent = 0;
    int rc =
        attempt(k, path, body, now + share, (int)((share + 999999) / 1000000), r, rep, root, &sent);
    if (rc == A_OK) {
      *retried = body == retry;
      return 0;
    }
    if (rc == A_FINAL) return -1;
    if (sent) ambiguous = 1;
    /* The member closed our kept connection while it was idle: once per
     * call, the same member again on a fresh connection. */
    if (rc == A_STALE && !stale++) continue;
    endpoint_t *ep = &k->ep[k->cur];
    if (!ep->refused) only_refused = 0;
    if (rc == A_BAD) {
      ep->bad = 1;
      usable--;
    }
    k->cur = (k->cur + 1) % k->nep;
    if (usable == 0) break;
    if (++tried >= usable) {
      /* A full pass without an answer. */
      if (only_refused && chorus__now_ns() - t0 >= (int64_t)REFUSED_WINDOW_MS * 1000000) break;
      tried = 0;
      only_refused = 1;
      int ms = CHORUS__MIN(chorus__ms_left(deadline), PAUSE_MS);
      struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000};
      nanosleep(&ts, NULL);
    }
  }
  /* "etcd: a:1: why; b:2: why (what to do)" */
  size_t n = 0, cap = sizeof k->base.err;
  char *e = k->base.err;
  n += (size_t)snprintf(e, cap, "etcd: ");
  for (int i = 0; i < k->nep && n < cap; i++)
    if (k->ep[i].why[0])
      n += (size_t)snprintf(e + n, cap - n, "%s%s: %.150s", n > 6 ? "; " : "", k->ep[i].name,
                            k->ep[i].why);
  if (n < cap) {
    if (usable == 0)
      snprintf(e + n, cap - n, " (no endpoint answered as etcd's v3 JSON gateway does)");
    else
      snprintf(e + n, cap - n,
               " (no member answered within %lld ms; check them with etcdctl "
               "--endpoints=%s endpoint health)",
               (long long)((chorus__now_ns() - t0) / 1000000), k->base.where);
  }
  return -1;
}

/* ------------------------------------------------------------- operations */

static void key_body(sb_t *s, kv_etcd_t *k, const char *key) {
  sb_str(s, "\"key\":");
  sb_b64(s, k->prefix, key);
}

/* Values must be readable back: base64 makes them 4/3 larger, and a reply
 * may not exceed REPLY_MAX. */
static int value_ok(kv_etcd_t *k, const char *key, const char *val) {
  size_t n = strlen(val);
  if (n <= (REPLY_MAX - 4096) / 4 * 3) return 1;
  set_err(k,
          "etcd: the value for '%.100s' has %zu bytes, more than this client reads back (%zu); "
          "etcd itself takes at most --max-request-bytes (1.5 MiB by default)",
          key, n, (REPLY_MAX - 4096) / 4 * 3);
  return 0;
}

/* The value in kvs[0] of the range reply r: 1 (*val), 0 no key, -1 (err). */
static int range_value(kv_etcd_t *k, span_t r, const char *key, const char *what, char **val) {
  span_t kvs, kv0, v;
  int rc = js_member(r, "kvs", &kvs);
  if (rc == 0) return 0;
  if (rc < 0 || (rc = js_index(kvs, 0, &kv0)) < 0 || (rc == 1 && *kv0.p != '{')) {
    set_err(k, "etcd %s: a malformed reply to %s('%.100s'): kvs is not a list of objects",
            k->ep[k->cur].name, what, key);
    return -1;
  }
  if (rc == 0) return 0;
  if ((rc = js_member(kv0, "value", &v)) == 0) { /* left out: empty */
    *val = calloc(1, 1);
    if (!*val) set_err(k, "out of memory");
    return *val ? 1 : -1;
  }
  size_t len = 0;
  char *text = rc < 0 ? NULL : js_string(v, &len);
  if (!text) {
    if (len)
      set_err(k, "out of memory");
    else
      set_err(k, "etcd %s: a malformed reply to %s('%.100s'): the value is not a string",
              k->ep[k->cur].name, what, key);
    return -1;
  }
  unsigned char *out = malloc(len / 4 * 3 + 1);
  long vl = out ? b64_decode(text, len, out) : -1;
  free(text);
  if (vl < 0 || memchr(out, '\0', (size_t)vl)) {
    if (!out)
      set_err(k, "out of memory");
    else
      set_err(k, "etcd %s: the value of '%.100s' is %s", k->ep[k->cur].name, key,
              vl < 0 ? "not valid base64 (a malformed reply)"
                     : "not text (a NUL byte inside): not chorusrun's");
    free(out);
    return -1;
  }
  out[vl] = '\0';
  *val = (char *)out;
  return 1;
}

static int kve_get(kv_t *kv, const char *key, char **val) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  *val = NULL;
  sb_t s;
  sb_begin(&s);
  sb_str(&s, "{");
  key_body(&s, k, key);
  sb_str(&s, "}");
  rbuf_t r = {0};
  reply_t rep;
  span_t root;
  int retried, rc = request(k, "/v3/kv/range", &s, NULL, chorus__deadline_ms(k->call_ms), &r, &rep,
                            &root, &retried);
  if (rc == 0) rc = range_value(k, root, key, "get", val);
  free(s.b);
  free(r.b);
  return rc;
}

static int kve_set(kv_t *kv, const char *key, const char *val) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (!value_ok(k, key, val)) return -1;
  sb_t s;
  sb_begin(&s);
  sb_str(&s, "{");
  key_body(&s, k, key);
  sb_str(&s, ",\"value\":");
  sb_b64(&s, "", val);
  sb_str(&s, "}");
  rbuf_t r = {0};
  reply_t rep;
  span_t root;
  int retried, rc = request(k, "/v3/kv/put", &s, NULL, chorus__deadline_ms(k->call_ms), &r, &rep,
                            &root, &retried);
  free(s.b);
  free(r.b);
  return rc;
}

/* The txn of a cas; with_read: a failed comparison also reads the key. */
static void cas_body(sb_t *s, kv_etcd_t *k, const char *key, const char *expected,
                     const char *desired, int with_read) {
  sb_begin(s);
  sb_str(s, "{\"compare\":[{");
  key_body(s, k, key);
  if (expected) {
    sb_str(s, ",\"result\":\"EQUAL\",\"target\":\"VALUE\",\"value\":");
    sb_b64(s, "", expected);
  } else {
    /* Created at revision 0: the key does not exist. */
    sb_str(s, ",\"result\":\"EQUAL\",\"target\":\"CREATE\",\"create_revision\":\"0\"");
  }
  sb_str(s, "}],\"success\":[{\"request_put\":{");
  key_body(s, k, key);
  sb_str(s, ",\"value\":");
  sb_b64(s, "", desired);
  sb_str(s, "}}]");
  if (with_read) {
    sb_str(s, ",\"failure\":[{\"request_range\":{");
    key_body(s, k, key);
    sb_str(s, "}}]");
  }
  sb_str(s, "}");
}

static int kve_cas(kv_t *kv, const char *key, const char *expected, const char *desired) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (!value_ok(k, key, desired) || (expected && !value_ok(k, key, expected))) return -1;
  sb_t s, retry;
  cas_body(&s, k, key, expected, desired, 0);
  cas_body(&retry, k, key, expected, desired, 1);
  rbuf_t r = {0};
  reply_t rep;
  span_t root, v, resp, rr;
  int retried, rc = request(k, "/v3/kv/txn", &s, &retry, chorus__deadline_ms(k->call_ms), &r, &rep,
                            &root, &retried);
  if (rc == 0) {
    int m = js_member(root, "succeeded", &v); /* left out when false */
    if (m == 1 && v.end - v.p == 4 && !memcmp(v.p, "true", 4)) {
      rc = 1;
    } else if (m == 1 && !(v.end - v.p == 5 && !memcmp(v.p, "false", 5))) {
      set_err(k, "etcd %s: a malformed reply to cas('%.100s'): succeeded is not a boolean",
              k->ep[k->cur].name, key);
      rc = -1;
    } else if (!retried) {
      rc = 0;
    } else {
      /* An earlier attempt may have swapped: then the key holds ours. */
      char *cur = NULL;
      rc = 0;
      if (js_member(root, "responses", &resp) == 1 && js_index(resp, 0, &rr) == 1 &&
          js_member(rr, "response_range", &rr) == 1) {
        rc = range_value(k, rr, key, "cas", &cur);
        if (rc >= 0) rc = rc == 1 && !strcmp(cur, desired);
        free(cur);
      }
    }
  }
  free(s.b);
  free(retry.b);
  free(r.b);
  return rc;
}

static int kve_local_addr(kv_t *kv, char *host, size_t cap) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  int64_t deadline = chorus__deadline_ms(k->call_ms);
  /* Between calls the connection may be gone (closed after a failure):
   * the next member that accepts one is the one the next call uses. */
  for (int i = 0; k->fd < 0 && i < k->nep; i++) {
    int fd = dial(&k->ep[k->cur], deadline);
    if (fd >= 0)
      k->fd = fd;
    else
      k->cur = (k->cur + 1) % k->nep;
  }
  int port;
  if (k->fd < 0 || chorus__net_local_addr(k->fd, host, cap, &port) < 0) {
    set_err(k, "etcd: no connection to any of %s for our local address", k->base.where);
    return -1;
  }
  return 0;
}

static void kve_close(kv_t *kv) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  drop(k);
  free(k->prefix);
  free(k);
}

static const kv_ops_t g_kv_etcd_ops = {kve_get, kve_set, kve_cas, kve_local_addr, kve_close};

int kv_etcd_open(const char *endpoints, const char *prefix, int timeout_ms, int call_timeout_ms,
                 kv_t **out, char *err, size_t cap) {
  *out = NULL;
  kv_etcd_t *k = calloc(1, sizeof *k);
  if (!k || !(k->prefix = strdup(prefix ? prefix : ""))) {
    free(k);
    snprintf(err, cap, "out of memory");
    return -1;
  }
  k->fd = -1;
  k->call_ms = call_timeout_ms > 0 ? call_timeout_ms : DEFAULT_CALL_MS;
  if (parse_endpoints(k, endpoints, err, cap) != 0) {
    kve_close(&k->base);
    return -1;
  }
  k->base.ops = &g_kv_etcd_ops;
  size_t n = 0;
  for (int i = 0; i < k->nep; i++) {
    const char *name = k->ep[i].name;
    if (n + strlen(name) + 5 > sizeof k->base.where) {
      snprintf(k->base.where + n, sizeof k->base.where - n, ",...");
      break;
    }
    n += (size_t)snprintf(k->base.where + n, sizeof k->base.where - n, "%s%s", i ? "," : "", name);
  }
  /* A first request proves that an etcd serves there (not just a port
   * that accepts connections) and that it has a leader: a linearizable
   * count of the prefix's key, retried for timeout_ms (at least one short
   * attempt) while the cluster starts. */
  sb_t s;
  sb_begin(&s);
  sb_str(&s, "{");
  key_body(&s, k, k->prefix[0] ? "" : "chorus");
  sb_str(&s, ",\"count_only\":true}");
  rbuf_t r = {0};
  reply_t rep;
  span_t root;
  int retried, rc = request(k, "/v3/kv/range", &s, NULL,
                            chorus__deadline_ms(CHORUS__MAX(timeout_ms, ATTEMPT_MIN_MS)), &r, &rep,
                            &root, &retried);
  free(s.b);
  free(r.b);
  if (rc != 0) {
    snprintf(err, cap, "%s", k->base.err);
    kve_close(&k->base);
    return -1;
  }
  k->base.err[0] = '\0';
  *out = &k->base;
  return 0;
}
