/*
 * fuzz_store - the key-value store's server (store_server.c): its
 * handshake, its frame reader and every request, as a stranger or an
 * authenticated client can drive them over a real socket.
 *
 * One real server runs in this process (started in LLVMFuzzerInitialize on
 * 127.0.0.1, port 0, with the job key of FUZZ_SECRET), on its own thread.
 * Small limits (CHORUS_STORE_KEYS_MAX, _DATA_MAX, _BUFFER_MAX, set before
 * the library reads its environment) let 64 KiB inputs reach the "store
 * full" and "frame larger than the buffer" answers.
 *
 * Input: byte 0 picks the mode (value % 3; bit 7: end the connection with
 * a reset instead, see below), the rest is sent as raw bytes.
 *   0  before authentication: a fresh connection; the bytes go right after
 *      the server's hello, then the harness half-closes and reads until
 *      the server closes.  The server must never say "authenticated".
 *   1  handshake fields: a fresh connection; the first 40 bytes are the
 *      client's magic, version and nonce, the harness adds the right HMAC
 *      for the server's nonce (so the fuzzer reaches past the proof); the
 *      verdict must be "ok" exactly when magic and version are right; the
 *      rest goes as in mode 2 on that connection, which is then closed.
 *   2  after authentication: the bytes go on a connection kept
 *      authenticated from one input to the next.
 * After authentication, when the bytes are whole frames (u32 length +
 * body, store.h / store_proto.h) the harness appends a NUM_KEYS request
 * and reads one response per frame plus its own (so the server has handled
 * everything before the next input); otherwise it half-closes and reads
 * until the server closes.  GET and WAIT on missing keys park on the
 * server: once the bytes are sent (and again when responses stall), a
 * second authenticated connection sets the keys those requests name, which
 * wakes them (or, when it wins the race, lets them find their keys).  A
 * connection the server closed is replaced on the next input; the server is
 * restarted when it holds many keys, so little state carries over from one
 * input to the next.  With bit 7 of byte 0 set, the connection is reset
 * (SO_LINGER 0) after the exchange (mode 0: right after the bytes are
 * sent), and the server sees ECONNRESET.  Responses are checked: non-empty frames, status 0 or
 * 2 (never 1), and the harness's own request answered last, with a count.
 */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "fuzz_common.h"
#include "store/store.h"
#include "store/store_proto.h"

#define HOST "127.0.0.1"
#define KEYS_MAX 64
#define RESTART_KEYS 32 /* restart the server once it holds this many */
#define MAX_PARKED_KEYS 64
#define DEADLINE_MS 3000 /* for one input's exchange; beyond: give up on it */
/* For what must work (connecting, the handshake with the right key): beyond
 * it the server is stuck, a finding.  Generous, for loaded machines. */
#define MUST_MS 20000
#define STALL_MS 5 /* no progress this long: set the keys waited for again */
#define UNPARK_ROUNDS 8
#define FATAL(...)                                      \
  do {                                                  \
    fprintf(stderr, "fuzz_store: FATAL: " __VA_ARGS__); \
    fprintf(stderr, "\n");                              \
    abort();                                            \
  } while (0)

static chorus__key_t g_key;
static chorus_store_server_t *g_srv;
static int g_port;
static int g_fz = -1;  /* authenticated connection the inputs are sent on */
static int g_ctl = -1; /* authenticated connection of the harness itself */
static int g_restart;  /* restart the server before the next input */
static unsigned long g_gave_up;
static int g_verbose; /* CHORUS_FUZZ_VERBOSE=1: say what each input did */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int ms_left(int64_t deadline) {
  int64_t l = deadline - now_ms();
  return l < 0 ? 0 : l > 60000 ? 60000 : (int)l;
}

/* Blocking-style I/O with a deadline over a non-blocking socket.  0, or -1
 * at EOF, error or deadline. */
static int io_full(int fd, void *buf, size_t n, int writing, int64_t deadline) {
  uint8_t *p = buf;
  while (n) {
    ssize_t k =
        writing ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
      continue;
    }
    if (k == 0 && !writing) return -1;
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    int left = ms_left(deadline);
    if (left == 0 || poll(&pfd, 1, left) <= 0) return -1;
  }
  return 0;
}

/* One frame into buf (cap bytes); its body length in *len.  0 or -1. */
static int read_frame(int fd, uint8_t *buf, size_t cap, size_t *len, int64_t deadline) {
  uint8_t h[4];
  if (io_full(fd, h, 4, 0, deadline) < 0) return -1;
  uint32_t n = chorus__le32_get(h);
  if (n > cap) FATAL("server sent a %u-byte frame where at most %zu fit", n, cap);
  if (io_full(fd, buf, n, 0, deadline) < 0) return -1;
  *len = n;
  return 0;
}

static int dial(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) FATAL("socket: %s", strerror(errno));
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)g_port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0 && errno != EINPROGRESS)
    FATAL("connect to the store on port %d: %s", g_port, strerror(errno));
  struct pollfd pfd = {.fd = fd, .events = POLLOUT};
  int err = 0;
  socklen_t el = sizeof err;
  if (poll(&pfd, 1, MUST_MS) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) < 0 || err)
    FATAL("connect to the store on port %d: %s", g_port, err ? strerror(err) : "timed out");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

/* A connection that got the server's hello (its nonce into ns).  The
 * server closes a connection at once, without a hello, while this address
 * holds CHORUS_STORE_CONNS_PER_ADDR of them: with thousands of connections
 * a second, closed ones can outnumber what its thread has reaped yet.
 * Such a refusal is retried until MUST_MS; anything else is fatal. */
static int dial_hello(uint8_t ns[CHORUS__STORE_NONCE_LEN]) {
  double until = now_ms() + MUST_MS;
  for (;;) {
    int fd = dial();
    uint8_t b[CHORUS__STORE_HELLO_LEN];
    size_t n = 0;
    int rc = read_frame(fd, b, sizeof b, &n, now_ms() + MUST_MS);
    if (rc == 0 && n == CHORUS__STORE_HELLO_LEN && memcmp(b, CHORUS__STORE_MAGIC, 4) == 0 &&
        chorus__le32_get(b + 4) == CHORUS__STORE_VERSION) {
      memcpy(ns, b + 8, CHORUS__STORE_NONCE_LEN);
      return fd;
    }
    close(fd);
    if (rc == 0 || now_ms() >= until) FATAL("no valid hello from the store");
    struct timespec ts = {0, 5 * 1000000};
    nanosleep(&ts, NULL);
  }
}

/* Sends the client's answer: magic, version, nonce as given, and the HMAC
 * the server expects for them. */
static void send_answer(int fd, const uint8_t ns[CHORUS__STORE_NONCE_LEN],
                        const uint8_t head[8 + CHORUS__STORE_NONCE_LEN]) {
  uint8_t out[4 + CHORUS__STORE_AUTH_LEN];
  chorus__le32_put(out, CHORUS__STORE_AUTH_LEN);
  memcpy(out + 4, head, 8 + CHORUS__STORE_NONCE_LEN);
  chorus__store_mac(&g_key, 0, ns, head + 8, out + 4 + 8 + CHORUS__STORE_NONCE_LEN);
  if (io_full(fd, out, sizeof out, 1, now_ms() + MUST_MS) < 0)
    FATAL("cannot send the handshake answer");
}

/* The verdict: its status, or -1 when the server closed instead.  An OK
 * verdict must carry the server's proof. */
static int read_verdict(int fd, const uint8_t ns[CHORUS__STORE_NONCE_LEN],
                        const uint8_t nc[CHORUS__STORE_NONCE_LEN]) {
  uint8_t b[CHORUS__STORE_VERDICT_OK_LEN];
  size_t n;
  if (read_frame(fd, b, sizeof b, &n, now_ms() + MUST_MS) < 0) return -1;
  FUZZ_REQUIRE(n >= 1);
  if (b[0] != CHORUS__STORE_HS_OK) {
    FUZZ_REQUIRE(n == 1);
    return b[0];
  }
  uint8_t want[CHORUS__STORE_MAC_LEN];
  chorus__store_mac(&g_key, 1, ns, nc, want);
  FUZZ_REQUIRE(n == CHORUS__STORE_VERDICT_OK_LEN && memcmp(want, b + 1, sizeof want) == 0);
  return 0;
}

static int auth_connect(void) {
  uint8_t ns[CHORUS__STORE_NONCE_LEN], head[8 + CHORUS__STORE_NONCE_LEN];
  int fd = dial_hello(ns);
  memcpy(head, CHORUS__STORE_MAGIC, 4);
  chorus__le32_put(head + 4, CHORUS__STORE_VERSION);
  for (size_t i = 0; i < CHORUS__STORE_NONCE_LEN; i++) head[8 + i] = (uint8_t)(i * 37 + 11);
  send_answer(fd, ns, head);
  if (read_verdict(fd, ns, head + 8) != 0) FATAL("the store refused the right key");
  return fd;
}

/* Not an error (a parked request whose key could not be set, a slow
 * machine), but worth knowing when it happens often. */
static void gave_up(const char *what) {
  if (++g_gave_up <= 5 || g_verbose)
    fprintf(stderr, "fuzz_store: gave up waiting for the server on %s after %d ms (%lu times)\n",
            what, DEADLINE_MS, g_gave_up);
}

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

/* Closes with a reset (RST) instead of a FIN. */
static void reset_fd(int *fd) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  if (*fd >= 0) setsockopt(*fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close_fd(fd);
}

static void server_start(void) {
  if (chorus__store_server_start_key(HOST, 0, &g_key, &g_srv) != CHORUS_OK)
    FATAL("cannot start the store server");
  g_port = chorus_store_server_port(g_srv);
}

static void server_restart(void) {
  close_fd(&g_fz);
  close_fd(&g_ctl);
  chorus_store_server_stop(g_srv);
  server_start();
  g_restart = 0;
}

/* ------------------------------------------------ the harness's requests */

/* SET key = "1" for each of the n keys, pipelined on the control
 * connection.  Returns 1 when a SET was refused (the store is full: restart
 * it), 0 when all were done, -1 when the connection failed. */
static int ctl_set(const uint8_t **keys, const size_t *lens, int n) {
  if (n == 0) return 0;
  if (g_ctl < 0) g_ctl = auth_connect();
  chorus__sbuf_t b = {0};
  for (int i = 0; i < n; i++) {
    size_t at = chorus__sbuf_frame_begin(&b);
    chorus__sbuf_u8(&b, CHORUS__STORE_CMD_SET);
    chorus__sbuf_str(&b, keys[i], lens[i]);
    chorus__sbuf_str(&b, "1", 1);
    chorus__sbuf_frame_end(&b, at);
  }
  FUZZ_REQUIRE(!b.oom);
  int64_t deadline = now_ms() + DEADLINE_MS;
  int rc = io_full(g_ctl, b.data, b.len, 1, deadline), full = 0;
  chorus__sbuf_free(&b);
  for (int i = 0; i < n && rc == 0; i++) {
    uint8_t resp[4 + CHORUS__STORE_MAX_REASON + 16];
    size_t len = 0;
    rc = read_frame(g_ctl, resp, sizeof resp, &len, deadline);
    if (rc == 0 && len < 1) rc = -1;
    if (rc == 0 && resp[0] != CHORUS__STORE_ST_OK) full = 1;
  }
  if (rc < 0) {
    close_fd(&g_ctl);
    return -1;
  }
  return full;
}

/* The keys of the GET and WAIT requests among the whole frames of p (they
 * may park); pointers into p. */
typedef struct parked {
  const uint8_t *key[MAX_PARKED_KEYS];
  size_t len[MAX_PARKED_KEYS];
  /* (the keys stay in the input, which outlives the exchange) */
  int n;
} parked_t;

static void note_keys(parked_t *pk, const uint8_t *body, size_t len) {
  chorus__srd_t r = chorus__srd_make(body, len);
  int cmd = chorus__srd_u8(&r);
  uint32_t nkeys = 1;
  if (cmd == CHORUS__STORE_CMD_WAIT)
    nkeys = chorus__srd_u32(&r);
  else if (cmd != CHORUS__STORE_CMD_GET)
    return;
  for (uint32_t i = 0; i < nkeys && !r.bad && pk->n < MAX_PARKED_KEYS; i++) {
    const uint8_t *k;
    size_t kl;
    chorus__srd_str(&r, CHORUS__STORE_MAX_KEY, &k, &kl);
    if (r.bad) break;
    pk->key[pk->n] = k;
    pk->len[pk->n] = kl;
    pk->n++;
  }
}

/* How many whole frames p holds, if it is nothing but whole frames the
 * server will read (-1 otherwise: an incomplete or empty frame, or one over
 * the limit, after which the server reads no further requests). */
static long count_frames(const uint8_t *p, size_t n, parked_t *pk) {
  long k = 0;
  size_t off = 0;
  while (off < n) {
    if (n - off < 4) return -1;
    uint32_t len = chorus__le32_get(p + off);
    if (len == 0 || len > CHORUS__STORE_MAX_FRAME || len > n - off - 4) return -1;
    note_keys(pk, p + off + 4, len);
    off += 4 + (size_t)len;
    k++;
  }
  return k;
}

/* Checks one response of the server to an authenticated request. */
static void check_response(const uint8_t *body, size_t len) {
  FUZZ_REQUIRE(len >= 1);
  FUZZ_REQUIRE(body[0] == CHORUS__STORE_ST_OK || body[0] == CHORUS__STORE_ST_BAD_REQUEST);
  if (body[0] == CHORUS__STORE_ST_BAD_REQUEST) {
    chorus__srd_t r = chorus__srd_make(body + 1, len - 1);
    const uint8_t *why;
    size_t wl;
    chorus__srd_str(&r, CHORUS__STORE_MAX_REASON, &why, &wl);
    FUZZ_REQUIRE(!r.bad && r.left == 0);
  }
}

/* Sends p on an authenticated connection fd and reads the server's
 * responses until it answered every frame (and the harness's NUM_KEYS
 * request appended to whole frames), or closed the connection.  Returns 0
 * when fd may be used again, -1 when it must be closed. */
static int exchange(int fd, const uint8_t *p, size_t n) {
  parked_t pk = {.n = 0};
  long frames = count_frames(p, n, &pk);
  uint8_t sync[5];
  chorus__le32_put(sync, 1);
  sync[4] = CHORUS__STORE_CMD_NUM_KEYS;
  /* What to send: the input, then (whole frames only) the sync request. */
  const uint8_t *part[2] = {p, sync};
  size_t plen[2] = {n, frames >= 0 ? sizeof sync : 0}, sent[2] = {0, 0};
  int cur = 0, half_closed = 0;
  long want = frames >= 0 ? frames + 1 : -1, got = 0;
  /* Response bytes not parsed yet. */
  static uint8_t in[(size_t)1 << 20];
  size_t have = 0;
  int64_t deadline = now_ms() + DEADLINE_MS;
  int rounds = 0;
  int64_t num_keys = -1;

  for (;;) {
    while (cur < 2 && sent[cur] == plen[cur]) cur++;
    if (cur == 2 && frames < 0 && !half_closed) {
      shutdown(fd, SHUT_WR);
      half_closed = 1;
    }
    if (want >= 0 && got == want) break;
    struct pollfd pfd = {.fd = fd, .events = POLLIN | (cur < 2 ? POLLOUT : 0)};
    int left = ms_left(deadline);
    if (left == 0) {
      gave_up("an authenticated exchange");
      return -1;
    }
    /* Once everything is sent, the keys the GETs and WAITs name are set
     * (from the other connection): a request that parked on one wakes up,
     * one not handled yet finds it.  Again when responses stall (the
     * input deleted a key and waits for it again). */
    int stall = pk.n && rounds < UNPARK_ROUNDS;
    if (cur == 2 && rounds == 0 && pk.n) {
      rounds = 1;
      if (ctl_set(pk.key, pk.len, pk.n) > 0) g_restart = 1;
      continue;
    }
    int r = poll(&pfd, 1, stall ? STALL_MS : left);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      if (stall) {
        rounds++;
        if (ctl_set(pk.key, pk.len, pk.n) > 0) g_restart = 1;
      }
      continue;
    }
    if (cur < 2 && (pfd.revents & POLLOUT)) {
      ssize_t k =
          send(fd, part[cur] + sent[cur], plen[cur] - sent[cur], MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0)
        sent[cur] += (size_t)k;
      else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        return -1;
    }
    if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
      if (have == sizeof in) FATAL("responses larger than the harness's buffer");
      ssize_t k = recv(fd, in + have, sizeof in - have, MSG_DONTWAIT);
      if (k == 0) { /* the server closed the connection */
        if (g_verbose)
          fprintf(stderr, "fuzz_store: closed by the server after %ld responses\n", got);
        return -1;
      }
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        return -1;
      }
      have += (size_t)k;
      size_t off = 0;
      while (have - off >= 4) {
        uint32_t len = chorus__le32_get(in + off);
        FUZZ_REQUIRE(len >= 1 && len <= CHORUS__STORE_MAX_FRAME);
        if (have - off - 4 < len) break;
        check_response(in + off + 4, len);
        got++;
        if (want >= 0 && got > want) FATAL("more responses than requests");
        if (got == want) {
          /* The last one answers the harness's NUM_KEYS. */
          FUZZ_REQUIRE(len == 9 && in[off + 4] == CHORUS__STORE_ST_OK);
          num_keys = (int64_t)chorus__le64_get(in + off + 5);
          FUZZ_REQUIRE(num_keys >= 0 && num_keys <= KEYS_MAX);
        }
        off += 4 + (size_t)len;
      }
      memmove(in, in + off, have - off);
      have -= off;
    }
  }
  FUZZ_REQUIRE(have == 0);
  if (num_keys >= RESTART_KEYS) g_restart = 1;
  if (g_verbose)
    fprintf(stderr, "fuzz_store: %ld responses, %d GET/WAIT keys, %" PRId64 " keys stored\n", got,
            pk.n, num_keys);
  return 0;
}

/* ------------------------------------------------------------------ modes */

/* A stranger: whatever it sends, it must not be authenticated. */
static void before_auth(const uint8_t *p, size_t n, int rst) {
  uint8_t ns[CHORUS__STORE_NONCE_LEN];
  int fd = dial_hello(ns);
  int64_t deadline = now_ms() + DEADLINE_MS;
  size_t sent = 0;
  uint8_t in[4096];
  size_t have = 0;
  int half_closed = 0;
  for (;;) {
    if (sent == n && rst) break;
    if (sent == n && !half_closed) {
      shutdown(fd, SHUT_WR);
      half_closed = 1;
    }
    struct pollfd pfd = {.fd = fd, .events = POLLIN | (sent < n ? POLLOUT : 0)};
    int left = ms_left(deadline);
    if (left == 0) {
      gave_up("a connection before authentication");
      break;
    }
    int r = poll(&pfd, 1, left);
    if (r <= 0) continue;
    if (sent < n && (pfd.revents & POLLOUT)) {
      ssize_t k = send(fd, p + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0)
        sent += (size_t)k;
      else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        sent = n;
    }
    if (pfd.revents & (POLLIN | POLLHUP | POLLERR)) {
      ssize_t k = recv(fd, in + have, sizeof in - have, MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
      if (k < 0) continue;
      have += (size_t)k;
      /* At most one verdict, and never "ok". */
      FUZZ_REQUIRE(have <= 5);
      if (have >= 4) FUZZ_REQUIRE(chorus__le32_get(in) == 1);
      if (have == 5)
        FUZZ_REQUIRE(in[4] == CHORUS__STORE_HS_DENIED || in[4] == CHORUS__STORE_HS_VERSION);
    }
  }
  if (rst)
    reset_fd(&fd);
  else
    close_fd(&fd);
}

/* The handshake with the fuzzer's magic, version and nonce and a correct
 * HMAC over them: accepted exactly when magic and version are right. */
static void handshake_fields(const uint8_t *p, size_t n, int rst) {
  uint8_t head[8 + CHORUS__STORE_NONCE_LEN];
  memset(head, 0, sizeof head);
  memcpy(head, p, n < sizeof head ? n : sizeof head);
  uint8_t ns[CHORUS__STORE_NONCE_LEN];
  int fd = dial_hello(ns);
  send_answer(fd, ns, head);
  int v = read_verdict(fd, ns, head + 8);
  int right = memcmp(head, CHORUS__STORE_MAGIC, 4) == 0 &&
              chorus__le32_get(head + 4) == CHORUS__STORE_VERSION;
  if (v < 0) {
    /* Closed before any verdict: the store drops connections it cannot
     * keep (over CHORUS_STORE_CONNS_PER_ADDR while it reaps closed ones,
     * past its handshake timeout on a loaded machine).  Not a wrong
     * verdict; auth_connect still requires the right key to get in. */
    gave_up("the store closed a connection before its verdict");
    close_fd(&fd);
    return;
  }
  if (v != (right ? CHORUS__STORE_HS_OK : CHORUS__STORE_HS_VERSION))
    fprintf(stderr, "fuzz_store: verdict %d for %s magic and version\n", v,
            right ? "the right" : "a wrong");
  FUZZ_REQUIRE(v == (right ? CHORUS__STORE_HS_OK : CHORUS__STORE_HS_VERSION));
  if (v == CHORUS__STORE_HS_OK && n > sizeof head)
    (void)exchange(fd, p + sizeof head, n - sizeof head);
  if (rst)
    reset_fd(&fd);
  else
    close_fd(&fd);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_env_init();
  /* Small limits, so that 64 KiB inputs reach them. */
  setenv("CHORUS_STORE_KEYS_MAX", "64", 1);
  setenv("CHORUS_STORE_DATA_MAX", "32768", 1);
  setenv("CHORUS_STORE_BUFFER_MAX", "8192", 1);
  fuzz_job_key(&g_key);
  g_verbose = getenv("CHORUS_FUZZ_VERBOSE") && atoi(getenv("CHORUS_FUZZ_VERBOSE")) > 0;
  server_start();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  if (g_restart) server_restart();
  const uint8_t *p = data + 1;
  size_t n = size - 1;
  int rst = (data[0] & 0x80) != 0;
  switch ((data[0] & 0x7f) % 3) {
    case 0:
      before_auth(p, n, rst);
      break;
    case 1:
      handshake_fields(p, n, rst);
      break;
    default:
      if (g_fz < 0) g_fz = auth_connect();
      if (exchange(g_fz, p, n) < 0) close_fd(&g_fz);
      if (rst) reset_fd(&g_fz);
      break;
  }
  return 0;
}
