/*
 * kv_etcd.c - the rendezvous's key-value service on etcd (the etcd
 * backend): get, put, compare-and-set and delete-by-prefix on an etcd v3
 * cluster through its JSON gateway (POST /v3/kv/range, /v3/kv/put,
 * /v3/kv/txn, /v3/kv/deleterange), over HTTP or HTTPS with libcurl, replies
 * read with jansson (base64 and the replies' JSON: kv_etcd_codec.c).
 *
 * Why these libraries: libcurl brings TLS with certificate checks and
 * client certificates, keep-alive, proxies and timeouts, all of it used by
 * far more programs than ours.  jansson (over json-c and cJSON) because its
 * parser is strict by default where a peer's bytes need it -- it refuses
 * invalid UTF-8, NUL bytes inside strings, trailing garbage and nesting
 * deeper than a compiled-in bound, and it parses from a (pointer, length)
 * pair -- and it keeps members in insertion order, so the requests we build
 * are the text we expect.  json-c accepts some non-JSON by default, cJSON
 * wants NUL-terminated input and follows nesting to 1000.
 *
 * Design
 *  - Connections: a libcurl connection cache (a share object) keeps one
 *    connection per member alive; each request runs on a fresh easy handle
 *    over it (see post() for why).  libcurl closes a connection whose
 *    exchange failed, so a late reply is never taken for the answer to the
 *    next request, and it resends a request once, unasked, when a kept
 *    connection turns out to be closed before the reply began -- except a
 *    transaction, whose body we give it in a way it cannot rewind.
 *  - Failover: when a member does not answer (refused, reset, timed out,
 *    HTTP 5xx such as "no leader" during an election) the call goes on
 *    with the next endpoint, round robin, pausing PAUSE_MS after each full
 *    pass, until the deadline; later calls start from the member that
 *    answered last.  An attempt that is not the last untried one of its
 *    pass gets half the time left (between ATTEMPT_MIN_MS and
 *    ATTEMPT_MAX_MS), so one silent member cannot use up the whole call.
 *    When every member refuses connections for REFUSED_WINDOW_MS the call
 *    gives up early: nothing listens, waiting longer helps nobody.  A
 *    member that answers wrongly (not HTTP, malformed JSON, too large, no
 *    /v3 gateway, a certificate that does not check out) is skipped for the
 *    rest of the call; when every member did so, the call ends at once.
 *    etcd refusing the request itself (HTTP 4xx: too large, invalid, bad
 *    credentials, no permission) ends the call at once: every member would
 *    say the same.
 *  - Authentication (etcd's "auth enable"): with a user name, the client
 *    gets a token from /v3/auth/authenticate before its first request and
 *    sends it in the Authorization header; when etcd says the token is no
 *    longer valid (they expire: --auth-token-ttl), it gets a new one and
 *    sends the request again, once per call.
 *  - A request whose reply was lost may still have been applied.  put and
 *    deleterange are idempotent.  For cas, once an attempt may have been
 *    applied, the retries' transactions also read the key when the
 *    comparison fails; finding our desired value there means the lost
 *    attempt swapped it (kv_store.c decides every cas that way: the value
 *    after the call is ours).  A transaction is evaluated when etcd applies
 *    it, so at most one of the attempts can swap.  The first attempt does
 *    not read: two agents may want the same new value, and only the one
 *    whose comparison held swapped.
 *  - Every reply is untrusted.  Bodies are bounded (REPLY_MAX, checked as
 *    bytes arrive, a larger Content-Length refused at once); libcurl bounds
 *    the headers.  The whole body must parse as JSON (jansson, strict) and be
 *    an object before anything is looked up in it; values are strict base64
 *    and must not hold a NUL byte.
 *  - One thread: a kv_t is used by the agent's loop only (no lock).
 *
 * What etcd 3.4.23 (Debian 12) does, measured: the gateway is at /v3/...
 * (/v3alpha/... is 404); keys and values are base64; int64 fields are JSON
 * strings; fields equal to 0, false or empty are left out of replies
 * ("succeeded" absent when false, "kvs" absent when no key, "value" absent
 * for an empty value); a txn's compare on an absent key with target VALUE
 * fails, and {"target":"CREATE","result":"EQUAL","create_revision":"0"}
 * holds exactly when the key does not exist; requests above
 * --max-request-bytes (1.5 MiB by default) are refused with HTTP 400
 * "etcdserver: request is too large"; errors are
 * {"error":"...","message":"...","code":N} with an HTTP status from the gRPC
 * code (Unavailable: 503, Unauthenticated: 401, PermissionDenied: 403,
 * InvalidArgument and FailedPrecondition: 400); a wrong password is
 * "etcdserver: authentication failed, invalid user ID or password", an
 * expired token "etcdserver: invalid auth token".
 */
#include "launcher/kv_etcd.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "util/clock.h"
#include "util/crypto.h"
#include "util/util.h"

#define EP_MAX 16 /* endpoints in the list */
#define HOST_MAX 256
#define REPLY_MAX ((size_t)8 << 20) /* one reply's body */
#define PAUSE_MS 50                 /* after a pass over every endpoint */
#define ATTEMPT_MIN_MS 100
#define ATTEMPT_MAX_MS 2000 /* unless the last untried of a pass */
#define REFUSED_WINDOW_MS 1000
#define DEFAULT_CALL_MS 5000
#define WHY_CAP 300 /* one endpoint's last failure */
#define TOKEN_MAX 4096

typedef struct {
  char url[HOST_MAX + 32];  /* "http://host:port" */
  char name[HOST_MAX + 16]; /* "host:port" ("[v6]:port"): messages */
  char why[WHY_CAP];        /* its last failure in the current call */
  int bad;                  /* answered wrongly in the current call: skipped */
  int refused;              /* its last attempt found nothing listening */
} endpoint_t;

typedef struct {
  kv_t base;
  endpoint_t ep[EP_MAX];
  int nep;
  int cur; /* the endpoint tried next */
  int call_ms;
  char *prefix;  /* put before every key */
  CURL *tmpl;    /* our options; each request runs on a copy (post) */
  CURLSH *share; /* the connections kept alive, shared by the copies */
  char curl_err[CURL_ERROR_SIZE];
  rbuf_t r;
  char *user, *password; /* etcd's authentication, when given */
  char *token;           /* from /v3/auth/authenticate */
  char local[64];        /* our address on the last exchange */
  int final;             /* the last call failed for good (A_FINAL, no etcd anywhere) */
} kv_etcd_t;

/* What one attempt on one member came to. */
enum {
  A_OK = 0,
  A_RETRY = -1, /* no (usable) answer: another member, or later, may answer */
  A_AUTH = -2,  /* the token expired: authenticate again, same member */
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

/* ------------------------------------------------------------- endpoints */

/* Parses "host:port,[v6]:port,https://host:port/,...": 0 or -1 with err.
 * An entry without a scheme gets https when tls is set. */
static int parse_endpoints(kv_etcd_t *k, const char *list, int tls, char *err, size_t cap) {
  const char *p = list ? list : "";
  k->nep = 0;
  for (;;) {
    const char *comma = strchr(p, ',');
    size_t n = comma ? (size_t)(comma - p) : strlen(p);
    int https = tls;
    while (n && (*p == ' ' || *p == '\t')) p++, n--;
    while (n && (p[n - 1] == ' ' || p[n - 1] == '\t' || p[n - 1] == '/')) n--;
    if (n >= 8 && !strncasecmp(p, "https://", 8)) {
      p += 8, n -= 8;
      https = 1;
    } else if (n >= 7 && !strncasecmp(p, "http://", 7)) {
      p += 7, n -= 7;
      https = 0;
    }
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
      if (host[i] == ' ' || host[i] == '/' || host[i] == '@' || host[i] == '[' || host[i] == ']' ||
          (unsigned char)host[i] < 0x21 || (unsigned char)host[i] > 0x7e)
        goto bad;
    long v = 2379; /* etcd's client port */
    if (port) {
      size_t pl = (size_t)(p + n - port);
      v = 0;
      if (pl == 0 || pl > 5) goto bad;
      for (size_t i = 0; i < pl; i++) {
        if (port[i] < '0' || port[i] > '9') goto bad;
        v = v * 10 + (port[i] - '0');
      }
      if (v < 1 || v > 65535) goto bad;
    }
    /* Through a local buffer: GCC cannot tell that the list and k never
     * overlap (-Wrestrict). */
    char name[sizeof ep->name];
    snprintf(name, sizeof name, memchr(host, ':', hl) ? "[%.*s]:%ld" : "%.*s:%ld", (int)hl, host,
             v);
    memcpy(ep->name, name, sizeof name);
    snprintf(ep->url, sizeof ep->url, "%s://%s", https ? "https" : "http", name);
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

/* -------------------------------------------------------------- replies */

/* libcurl's write callback: appends to the reply buffer, stopping the
 * transfer (a short count) once it would hold more than REPLY_MAX. */
static size_t on_body(char *p, size_t size, size_t nmemb, void *arg) {
  rbuf_t *r = arg;
  size_t n = size * nmemb;
  if (n > REPLY_MAX - r->len) {
    r->over = 1;
    return 0;
  }
  if (r->len + n + 1 > r->cap) {
    size_t cap = r->cap ? r->cap : 16384;
    while (cap < r->len + n + 1) cap *= 2;
    char *b = realloc(r->b, cap);
    if (!b) return 0;
    r->b = b;
    r->cap = cap;
  }
  memcpy(r->b + r->len, p, n);
  r->len += n;
  r->b[r->len] = '\0';
  return n;
}

/* ------------------------------------------------------------- requests */

/* The headers of every request: the body's type and, once authenticated,
 * the token.  NULL when out of memory. */
static struct curl_slist *headers(const kv_etcd_t *k) {
  /* "Expect:" drops libcurl's pause for a 100 Continue before bodies over
   * 1 MiB: etcd's gateway never sends one. */
  struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
  struct curl_slist *e = h ? curl_slist_append(h, "Expect:") : NULL;
  if (!e) curl_slist_free_all(h);
  h = e;
  if (h && k->token) {
    char line[TOKEN_MAX + 32];
    snprintf(line, sizeof line, "Authorization: %s", k->token);
    struct curl_slist *t = curl_slist_append(h, line);
    if (!t) curl_slist_free_all(h);
    h = t;
  }
  return h;
}

/* What a failed transfer says about the member. */
static int transfer_failed(kv_etcd_t *k, CURL *h, endpoint_t *ep, CURLcode c, int ms, int *sent) {
  long os = 0, status = 0;
  curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os);
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  const char *what = k->curl_err[0] ? k->curl_err : curl_easy_strerror(c);
  switch (c) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
      *sent = 0;
      ep->refused = c == CURLE_COULDNT_CONNECT && os == ECONNREFUSED;
      return set_why(ep, A_RETRY, "connect: %s", os ? strerror((int)os) : what);
    case CURLE_OPERATION_TIMEDOUT:
      return set_why(ep, A_RETRY, "%s after %d ms (%s)",
                     status ? "the reply was incomplete" : "no reply", ms, what);
    case CURLE_WRITE_ERROR:
      if (k->r.over) return set_why(ep, A_BAD, "the reply is larger than %zu MiB", REPLY_MAX >> 20);
      return set_why(ep, A_FINAL, "out of memory for the reply");
    case CURLE_FILESIZE_EXCEEDED:
      return set_why(ep, A_BAD, "the reply announces more than %zu MiB", REPLY_MAX >> 20);
    case CURLE_PEER_FAILED_VERIFICATION:
      return set_why(ep, A_BAD,
                     "its TLS certificate does not check out (%s); give the CA that signed it "
                     "with --rdzv-conf cacert=FILE",
                     what);
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CACERT_BADFILE:
      return set_why(ep, A_FINAL, "our TLS files: %s (check --rdzv-conf cacert, cert and key)",
                     what);
    case CURLE_SSL_CONNECT_ERROR:
      return set_why(ep, A_BAD,
                     "the TLS handshake failed (%s); does it serve https, and does it accept "
                     "our client certificate (--rdzv-conf cert, key)?",
                     what);
    case CURLE_GOT_NOTHING:
      /* Not what a live etcd does (one going away refuses or resets), but
       * what its TLS port does with plain HTTP. */
      return set_why(ep, A_BAD, "closed the connection without replying%s",
                     strncmp(ep->url, "http:", 5) ? ""
                                                  : " (does it serve https? then give "
                                                    "--rdzv-conf protocol=https,cacert=...)");
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_BAD_CONTENT_ENCODING:
      return set_why(ep, A_BAD, "not an HTTP reply as etcd's gateway sends (%s)", what);
    case CURLE_RECV_ERROR:
      /* With TLS 1.3 a server that refuses our certificate says so in an
       * alert after the handshake, which libcurl reports when reading. */
      if (strstr(what, " alert "))
        return set_why(ep, A_BAD,
                       "it refused us over TLS (%s); is our client certificate (--rdzv-conf "
                       "cert, key) signed by a CA it trusts?",
                       what);
      /* fall through */
    default:
      /* A failure inside a reply (a malformed chunk) is a wrong answer;
       * before one, the member may just be going away. */
      return set_why(ep, status ? A_BAD : A_RETRY, "%s", what);
  }
}

/* A request body as libcurl reads it. */
typedef struct {
  const char *p;
  size_t n, off;
  int rewind; /* may be sent again */
  int taken;  /* libcurl has read some of it: it may have reached etcd */
} body_t;

static size_t on_read(char *out, size_t size, size_t nmemb, void *arg) {
  body_t *b = arg;
  size_t n = CHORUS__MIN(size * nmemb, b->n - b->off);
  memcpy(out, b->p + b->off, n);
  b->off += n;
  if (n) b->taken = 1;
  return n;
}

static int on_seek(void *arg, curl_off_t offset, int origin) {
  body_t *b = arg;
  if (!b->rewind || origin != SEEK_SET || offset != 0) return CURL_SEEKFUNC_CANTSEEK;
  b->off = 0;
  return CURL_SEEKFUNC_OK;
}

/* The outcome of a completed exchange, as post's (below). */
static int reply(kv_etcd_t *k, CURL *c, endpoint_t *ep, const char *path, json_t **root) {
  char q[4 * SHOWN];
  char *ip = NULL;
  if (curl_easy_getinfo(c, CURLINFO_LOCAL_IP, &ip) == CURLE_OK && ip)
    snprintf(k->local, sizeof k->local, "%s", ip);
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  if (status == 200) {
    json_error_t je;
    if ((*root = etcd_parse_body(&k->r, &je))) return A_OK;
    return set_why(ep, A_BAD, "malformed JSON in the reply to %s (%s): \"%s\"", path, je.text,
                   etcd_shown(q, sizeof q, k->r.len ? k->r.b : "", k->r.len));
  }
  etcd_error_text(&k->r, q, sizeof q);
  if (status >= 500) return set_why(ep, A_RETRY, "HTTP %ld: %s", status, q);
  if (status == 404 || status == 405)
    return set_why(ep, A_BAD,
                   "HTTP %ld for POST %s: no etcd v3 JSON gateway here; give the client URL of "
                   "etcd >= 3.4 (e.g. host:2379)",
                   status, path);
  if (status == 401 && k->token && strstr(q, "invalid auth token")) return A_AUTH;
  if (status == 401 ||
      (status == 400 && (strstr(q, "authentication failed") || strstr(q, "user name is empty")))) {
    if (k->user)
      set_err(k,
              "etcd %s refused user '%s' (HTTP %ld: %s); check --rdzv-conf user= and "
              "password_file=",
              ep->name, k->user, status, q);
    else
      set_err(k,
              "etcd %s: HTTP %ld: %s; this etcd has authentication enabled: give "
              "--rdzv-conf user=NAME,password_file=FILE",
              ep->name, status, q);
    return A_FINAL;
  }
  if (status == 403) {
    set_err(k,
            "etcd %s: HTTP 403: %s; the user%s%s needs a role with readwrite permission on "
            "the prefix %s",
            ep->name, q, k->user ? " " : "", k->user ? k->user : "", k->prefix);
    return A_FINAL;
  }
  set_err(k, "etcd %s refused the request (HTTP %ld): %s", ep->name, status, q);
  return A_FINAL;
}

/* POSTs body to path on ep[k->cur] within ms: A_OK with *root (a JSON
 * object, the 200 reply's body), else an outcome with k->ep[k->cur].why
 * (k->base.err for A_FINAL).  once: the request must not be sent twice
 * (see below).  *sent: etcd may have applied the request. */
static int post(kv_etcd_t *k, const char *path, const char *body, int once, int ms,
                json_t **root, int *sent) {
  endpoint_t *ep = &k->ep[k->cur];
  char url[sizeof ep->url + 64];
  snprintf(url, sizeof url, "%s%s", ep->url, path);
  /* A fresh handle per request, the connections kept in k->share:
   * libcurl 7.88 (Debian 12) keeps a pointer to the previous reply's last
   * header in the handle, and a reply whose first header line is folded
   * then makes it use freed memory (curl issue 11101, fixed in 8.1). */
  struct curl_slist *hdr = headers(k);
  CURL *c = hdr ? curl_easy_duphandle(k->tmpl) : NULL;
  if (!c) {
    curl_slist_free_all(hdr);
    return set_why(ep, A_FINAL, "out of memory");
  }
  k->r.len = 0;
  k->r.over = 0;
  k->curl_err[0] = '\0';
  ep->refused = 0;
  *sent = 1;
  curl_easy_setopt(c, CURLOPT_SHARE, k->share); /* not copied by duphandle */
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)ms);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)ms);
  /* libcurl sends a request once more, unasked, when a kept connection
   * dies before the reply begins.  A transaction must not be resent as it
   * was (see cas): its body comes from a callback that cannot rewind, so
   * libcurl fails the transfer instead and the caller decides. */
  body_t src = {body, strlen(body), 0, !once, 0};
  curl_easy_setopt(c, CURLOPT_POST, 1L);
  curl_easy_setopt(c, CURLOPT_READFUNCTION, on_read);
  curl_easy_setopt(c, CURLOPT_READDATA, &src);
  curl_easy_setopt(c, CURLOPT_SEEKFUNCTION, on_seek);
  curl_easy_setopt(c, CURLOPT_SEEKDATA, &src);
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)src.n);
  CURLcode cc = curl_easy_perform(c);
  int rc = cc == CURLE_OK ? reply(k, c, ep, path, root) : transfer_failed(k, c, ep, cc, ms, sent);
  /* A failed connect is not proof that nothing was sent: when a kept
   * connection dies before the reply, libcurl opens a new one to send the
   * request again, and that connect can be what fails (the member was
   * killed after it took the request). */
  if (src.taken) *sent = 1;
  curl_easy_cleanup(c);
  curl_slist_free_all(hdr);
  return rc;
}

/* Gets a token for k->user from ep[k->cur]: A_OK or an outcome as post's. */
static int authenticate(kv_etcd_t *k, int ms) {
  endpoint_t *ep = &k->ep[k->cur];
  free(k->token);
  k->token = NULL;
  json_t *req = json_pack("{s:s,s:s}", "name", k->user, "password", k->password);
  char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
  json_decref(req);
  if (!body) return set_why(ep, A_FINAL, "out of memory");
  json_t *root = NULL;
  int sent, rc = post(k, "/v3/auth/authenticate", body, 0, ms, &root, &sent);
  free(body);
  if (rc == A_FINAL && strstr(k->base.err, "authentication is not enabled"))
    set_err(k,
            "etcd %s has authentication disabled, but --rdzv-conf user=%s was given: enable it "
            "(etcdctl auth enable) or leave user= out",
            ep->name, k->user);
  if (rc != A_OK) return rc;
  json_t *t = json_object_get(root, "token");
  const char *s = json_is_string(t) ? json_string_value(t) : NULL;
  size_t n = s ? json_string_length(t) : 0;
  int ok = s && n > 0 && n < TOKEN_MAX;
  for (size_t i = 0; ok && i < n; i++) ok = s[i] > 0x20 && s[i] < 0x7f;
  if (ok) k->token = strdup(s);
  json_decref(root);
  if (!ok) return set_why(ep, A_BAD, "a malformed reply to authenticate: no usable token");
  return k->token ? A_OK : set_why(ep, A_FINAL, "out of memory");
}

/* Runs one request on the service until a member answers it (0 and *root),
 * etcd refuses it or every member answered wrongly, or the deadline passes
 * (-1, k->base.err).  retry (NULL: body again, which may then also be
 * resent by libcurl) is sent instead of body once an earlier attempt may
 * have been applied; *retried says which one the reply answers. */
static int request(kv_etcd_t *k, const char *path, const char *body, const char *retry,
                   int64_t deadline, json_t **root, int *retried) {
  int64_t t0 = chorus__now_ns();
  int usable = k->nep, tried = 0, only_refused = 1, ambiguous = 0, reauth = 0;
  for (int i = 0; i < k->nep; i++) {
    k->ep[i].why[0] = '\0';
    k->ep[i].bad = 0;
  }
  *root = NULL;
  *retried = 0;
  k->final = 0;
  k->base.err[0] = '\0';
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
    int ms = (int)CHORUS__MAX((share + 999999) / 1000000, 1);
    int rc = k->user && !k->token ? authenticate(k, ms) : A_OK, sent = 0;
    if (rc == A_OK) {
      const char *b = ambiguous && retry ? retry : body;
      rc = post(k, path, b, retry != NULL, ms, root, &sent);
      if (rc == A_OK) {
        *retried = b == retry;
        return 0;
      }
      if (sent) ambiguous = 1;
    }
    if (rc == A_FINAL) {
      k->final = 1;
      if (!k->base.err[0]) set_err(k, "etcd %s: %s", k->ep[k->cur].name, k->ep[k->cur].why);
      return -1;
    }
    if (rc == A_AUTH) {
      free(k->token);
      k->token = NULL;
      if (!reauth++) continue; /* once per call, the same member */
      set_why(&k->ep[k->cur], A_RETRY, "the token it gave was refused at once");
    }
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
      int pause = CHORUS__MIN(chorus__ms_left(deadline), PAUSE_MS);
      struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)pause * 1000000};
      nanosleep(&ts, NULL);
    }
  }
  /* "etcd: a:1: why; b:2: why (what to do)" */
  size_t n = 0, cap = sizeof k->base.err;
  char *e = k->base.err;
  n += (size_t)snprintf(e, cap, "etcd: ");
  for (int i = 0; i < k->nep && n < cap; i++)
    if (k->ep[i].why[0])
      n += (size_t)snprintf(e + n, cap - n, "%s%s: %.200s", n > 6 ? "; " : "", k->ep[i].name,
                            k->ep[i].why);
  k->final = usable == 0;
  if (n < cap) {
    if (usable == 0)
      snprintf(e + n, cap - n, " (every endpoint failed in a way that waiting will not mend)");
    else
      snprintf(e + n, cap - n,
               " (no member answered within %lld ms; check them with etcdctl "
               "--endpoints=%s endpoint health)",
               (long long)((chorus__now_ns() - t0) / 1000000), k->base.where);
  }
  return -1;
}

/* request() with a JSON body (a reference the call takes): builds it,
 * sends it, frees it. */
static int request_json(kv_etcd_t *k, const char *path, json_t *body, json_t *retry,
                        int64_t deadline, json_t **root, int *retried) {
  char *b = body ? json_dumps(body, JSON_COMPACT) : NULL;
  char *r = retry ? json_dumps(retry, JSON_COMPACT) : NULL;
  int rc = -1;
  *root = NULL;
  if (!b || (retry && !r))
    set_err(k, "etcd: out of memory for the request");
  else
    rc = request(k, path, b, r, deadline, root, retried);
  free(b);
  free(r);
  json_decref(body);
  json_decref(retry);
  return rc;
}

/* ----------------------------------------------------------- operations */

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
static int range_value(kv_etcd_t *k, const json_t *r, const char *key, const char *what,
                       char **val) {
  char why[128];
  int rc = etcd_range_of(r, val, why, sizeof why);
  if (rc < 0)
    set_err(k, "etcd %s: a malformed reply to %s('%.100s'): %s", k->ep[k->cur].name, what, key,
            why);
  return rc;
}

static json_t *key_json(kv_etcd_t *k, const char *key) {
  return etcd_b64_json(k->prefix, key);
}

static int kve_get(kv_t *kv, const char *key, char **val) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  *val = NULL;
  json_t *root;
  int retried, rc = request_json(k, "/v3/kv/range", json_pack("{s:o}", "key", key_json(k, key)),
                                 NULL, chorus__deadline_ms(k->call_ms), &root, &retried);
  if (rc == 0) rc = range_value(k, root, key, "get", val);
  json_decref(root);
  return rc;
}

static int kve_set(kv_t *kv, const char *key, const char *val) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (!value_ok(k, key, val)) return -1;
  json_t *root;
  int retried, rc = request_json(
                   k, "/v3/kv/put",
                   json_pack("{s:o,s:o}", "key", key_json(k, key), "value", etcd_b64_json("", val)),
                   NULL, chorus__deadline_ms(k->call_ms), &root, &retried);
  json_decref(root);
  return rc;
}

/* The txn of a cas; with_read: a failed comparison also reads the key. */
static json_t *cas_body(kv_etcd_t *k, const char *key, const char *expected, const char *desired,
                        int with_read) {
  json_t *cmp = expected
                    ? json_pack("{s:o,s:s,s:s,s:o}", "key", key_json(k, key), "result", "EQUAL",
                                "target", "VALUE", "value", etcd_b64_json("", expected))
                    /* Created at revision 0: the key does not exist. */
                    : json_pack("{s:o,s:s,s:s,s:s}", "key", key_json(k, key), "result", "EQUAL",
                                "target", "CREATE", "create_revision", "0");
  json_t *t = json_pack("{s:[o],s:[{s:{s:o,s:o}}]}", "compare", cmp, "success", "request_put",
                        "key", key_json(k, key), "value", etcd_b64_json("", desired));
  if (t && with_read &&
      json_object_set_new(t, "failure",
                          json_pack("[{s:{s:o}}]", "request_range", "key", key_json(k, key)))) {
    json_decref(t);
    t = NULL;
  }
  return t;
}

static int kve_cas(kv_t *kv, const char *key, const char *expected, const char *desired) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (!value_ok(k, key, desired) || (expected && !value_ok(k, key, expected))) return -1;
  json_t *root;
  int retried, rc = request_json(k, "/v3/kv/txn", cas_body(k, key, expected, desired, 0),
                                 cas_body(k, key, expected, desired, 1),
                                 chorus__deadline_ms(k->call_ms), &root, &retried);
  if (rc == 0) {
    json_t *ok = json_object_get(root, "succeeded"); /* left out when false */
    if (json_is_true(ok)) {
      rc = 1;
    } else if (ok && !json_is_false(ok)) {
      set_err(k, "etcd %s: a malformed reply to cas('%.100s'): succeeded is not a boolean",
              k->ep[k->cur].name, key);
      rc = -1;
    } else if (retried) {
      /* An earlier attempt may have swapped: then the key holds ours. */
      json_t *rr =
          json_object_get(json_array_get(json_object_get(root, "responses"), 0), "response_range");
      char *cur = NULL;
      rc = json_is_object(rr) ? range_value(k, rr, key, "cas", &cur) : 0;
      if (rc >= 0) rc = rc == 1 && !strcmp(cur, desired);
      free(cur);
    }
  }
  json_decref(root);
  return rc;
}

/* Deletes every key that starts with key (under the prefix). */
static int kve_del_prefix(kv_t *kv, const char *key) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  size_t pl = strlen(k->prefix), kl = strlen(key);
  char *end = malloc(pl + kl + 1);
  if (!end) {
    set_err(k, "out of memory");
    return -1;
  }
  /* The range's end: the key with its last byte raised by one (every key
   * of ours is printable text, so the last byte is below 0xff). */
  memcpy(end, k->prefix, pl);
  memcpy(end + pl, key, kl + 1);
  if (pl + kl) end[pl + kl - 1]++;
  json_t *root;
  int retried, rc = request_json(k, "/v3/kv/deleterange",
                                 json_pack("{s:o,s:o}", "key", key_json(k, key), "range_end",
                                           etcd_b64_json("", end)),
                                 NULL, chorus__deadline_ms(k->call_ms), &root, &retried);
  free(end);
  json_decref(root);
  return rc;
}

static int kve_local_addr(kv_t *kv, char *host, size_t cap) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (!k->local[0]) {
    set_err(k, "etcd: no exchange with any of %s yet for our local address", k->base.where);
    return -1;
  }
  snprintf(host, cap, "%s", k->local);
  return 0;
}

static void kve_close(kv_t *kv) {
  kv_etcd_t *k = (kv_etcd_t *)kv;
  if (k->tmpl) curl_easy_cleanup(k->tmpl);
  if (k->share) curl_share_cleanup(k->share);
  free(k->r.b);
  free(k->prefix);
  free(k->user);
  if (k->password) chorus__wipe(k->password, strlen(k->password));
  free(k->password);
  free(k->token);
  free(k);
}

static const kv_ops_t g_kv_etcd_ops = {kve_get,        kve_set,   kve_cas,
                                       kve_local_addr, kve_close, kve_del_prefix};

/* The password: the first line of the file (a trailing newline cut off). */
static char *read_password(const char *path, char *err, size_t cap) {
  FILE *f = fopen(path, "re");
  char buf[1024];
  if (!f || !fgets(buf, sizeof buf, f)) {
    snprintf(err, cap, "etcd password_file '%s': %s", path, f ? "empty" : strerror(errno));
    if (f) fclose(f);
    return NULL;
  }
  fclose(f);
  buf[strcspn(buf, "\r\n")] = '\0';
  char *p = strdup(buf);
  chorus__wipe(buf, sizeof buf);
  if (!p) snprintf(err, cap, "out of memory");
  return p;
}

static int setup_curl(kv_etcd_t *k, const kv_etcd_opts_t *o, char *err, size_t cap) {
  static int global_done;
  if (!global_done && curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
    snprintf(err, cap, "libcurl: global initialisation failed");
    return -1;
  }
  global_done = 1;
  CURL *c = k->tmpl = curl_easy_init();
  k->share = curl_share_init();
  if (!c || !k->share ||
      curl_share_setopt(k->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT) != CURLSHE_OK) {
    snprintf(err, cap, "libcurl: out of memory");
    return -1;
  }
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, k->curl_err);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &k->r);
  curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)REPLY_MAX);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(c, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
  if (o && o->cacert) curl_easy_setopt(c, CURLOPT_CAINFO, o->cacert);
  if (o && o->cert) curl_easy_setopt(c, CURLOPT_SSLCERT, o->cert);
  if (o && o->key) curl_easy_setopt(c, CURLOPT_SSLKEY, o->key);
  return 0;
}

int kv_etcd_open(const char *endpoints, const char *prefix, int timeout_ms, int call_timeout_ms,
                 const kv_etcd_opts_t *o, kv_t **out, char *err, size_t cap) {
  *out = NULL;
  kv_etcd_t *k = calloc(1, sizeof *k);
  if (!k || !(k->prefix = strdup(prefix ? prefix : ""))) {
    free(k);
    snprintf(err, cap, "out of memory");
    return -1;
  }
  k->base.ops = &g_kv_etcd_ops;
  k->call_ms = call_timeout_ms > 0 ? call_timeout_ms : DEFAULT_CALL_MS;
  int tls = o && (o->https || o->cacert || o->cert);
  if (parse_endpoints(k, endpoints, tls, err, cap) != 0 || setup_curl(k, o, err, cap) != 0)
    goto fail;
  if (o && o->user) {
    if (!(k->user = strdup(o->user))) goto oom;
    if (o->password_file ? !(k->password = read_password(o->password_file, err, cap))
                         : !(k->password = strdup(o->password ? o->password : "")))
      goto fail;
  }
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
   * that accepts connections), that it takes our credentials and that it
   * has a leader: a linearizable count of the prefix's key, retried for
   * timeout_ms (at least one short attempt) while the cluster starts. */
  json_t *root;
  int retried;
  if (request_json(
          k, "/v3/kv/range",
          json_pack("{s:o,s:b}", "key", key_json(k, k->prefix[0] ? "" : "chorus"), "count_only", 1),
          NULL, chorus__deadline_ms(CHORUS__MAX(timeout_ms, ATTEMPT_MIN_MS)), &root,
          &retried) != 0) {
    snprintf(err, cap, "%s", k->base.err);
    int final = k->final;
    kve_close(&k->base);
    return final ? -2 : -1;
  }
  json_decref(root);
  k->base.err[0] = '\0';
  *out = &k->base;
  return 0;
oom:
  snprintf(err, cap, "out of memory");
fail:
  kve_close(&k->base);
  return -1;
}
