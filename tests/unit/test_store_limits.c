/*
 * test_store_limits.c - the store server's resource limits (store_server.c,
 * "Limits"), each against a real server on loopback with raw sockets that
 * speak the protocol by hand (store_proto.h) beside regular clients.
 *
 * The CHORUS_STORE_* variables are parsed once per process, so main() sets
 * small limits for the whole file before the first chorus call: idle 1000 ms,
 * frame 250 ms, 4 MiB of partly received requests, 1 MiB of data, 1000 keys,
 * 64 connections per address, 64 descriptors in reserve.  Connections meant
 * to come from other addresses than 127.0.0.1 bind 127.0.0.2..9 (all of
 * 127/8 is loopback on Linux).
 * Every test is bounded to a few seconds and a few hundred connections, and
 * every descriptor, client, server and child it makes is released by
 * cleanup() after it, also when it failed.  Each test says which behaviour it
 * pins; none of them passes against a server without the limits.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "harness.h"
#include "store_raw.h"
#include "store/store.h"
#include "store/store_proto.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

#define SECRET "limits-test-secret"
#define IDLE_MS 1000
#define FRAME_MS 250
#define BUFFER_MAX ((size_t)4 << 20)
#define DATA_MAX ((size_t)1 << 20)
#define KEYS_MAX 1000
#define PER_ADDR 64
#define FD_RESERVE 64

static int64_t now_ms(void) {
  return chorus__now_ns() / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------- what cleanup() releases */

#define MAX_TRACKED 1024
static int g_fds[MAX_TRACKED];
static int g_nfds;
static chorus_store_t *g_clients[16];
static int g_nclients;
static chorus_store_server_t *g_server;
static pid_t g_child;
static void *g_mem[4];

static void *track_mem(void *p) {
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_mem); i++) {
    if (!g_mem[i]) {
      g_mem[i] = p;
      return p;
    }
  }
  free(p);
  return NULL;
}

static int track_fd(int fd) {
  if (fd >= 0 && g_nfds < MAX_TRACKED) g_fds[g_nfds++] = fd;
  return fd;
}

static void close_fd(int fd) {
  for (int i = 0; i < g_nfds; i++)
    if (g_fds[i] == fd) g_fds[i] = -1;
  if (fd >= 0) close(fd);
}

static void cleanup(void) {
  for (int i = 0; i < g_nfds; i++)
    if (g_fds[i] >= 0) close(g_fds[i]);
  g_nfds = 0;
  for (int i = 0; i < g_nclients; i++) chorus_store_close(g_clients[i]);
  g_nclients = 0;
  chorus_store_server_stop(g_server);
  g_server = NULL;
  if (g_child > 0) {
    kill(g_child, SIGKILL);
    waitpid(g_child, NULL, 0);
    g_child = 0;
  }
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_mem); i++) {
    free(g_mem[i]);
    g_mem[i] = NULL;
  }
}

#define RUN_CLEAN(name) \
  do {                  \
    RUN(name);          \
    cleanup();          \
  } while (0)

/* ------------------------------------------------------------ helpers */

static int start_server(int *port) {
  if (chorus_store_server_start("127.0.0.1", 0, SECRET, &g_server) != CHORUS_OK) return -1;
  *port = chorus_store_server_port(g_server);
  return 0;
}

static chorus_store_t *connect_to(int port) {
  chorus_store_t *c = NULL;
  if (g_nclients == (int)CHORUS__ARRAY_LEN(g_clients)) return NULL;
  if (chorus_store_connect("127.0.0.1", port, SECRET, 3000, &c) != CHORUS_OK) return NULL;
  g_clients[g_nclients++] = c;
  return c;
}

/* Gets key and compares it with the text want; 0 on match. */
static int get_is(chorus_store_t *c, const char *key, const char *want) {
  void *v = NULL;
  size_t n = 0;
  if (chorus_store_get(c, key, &v, &n) != CHORUS_OK) return -1;
  int ok = n == strlen(want) && !memcmp(v, want, n);
  chorus_free(v);
  return ok ? 0 : -1;
}

/* A blocking TCP connection to 127.0.0.1:port from address src (NULL: the
 * kernel's choice, 127.0.0.1); tracked.  -1 on failure. */
static int raw_connect_from(const char *src, int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET};
  if (src && (inet_pton(AF_INET, src, &a.sin_addr) != 1 ||
              bind(fd, (struct sockaddr *)&a, sizeof a) < 0)) {
    close(fd);
    return -1;
  }
  struct sockaddr_in d = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &d.sin_addr);
  if (connect(fd, (struct sockaddr *)&d, sizeof d) < 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return track_fd(fd);
}

/* Whether the peer has closed fd, without waiting or consuming anything. */
static int peer_closed(int fd) {
  char b;
  ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* Reads the server's hello; 0 when it came within ms. */
static int read_hello(int fd, uint8_t hello[4 + CHORUS__STORE_HELLO_LEN], int ms) {
  return chorus__net_read_full(fd, hello, 4 + CHORUS__STORE_HELLO_LEN, chorus__deadline_ms(ms));
}

/* The client half of the handshake with the test's secret: the verdict
 * byte (0 ok) or -1. */
static int raw_auth(int fd) {
  chorus__key_t key;
  /* Salted with the job id as the library salts it (CHORUS_JOB_ID). */
  if (chorus__job_key(SECRET, chorus__env()->JOB_ID, &key) < 0) return -1;
  return store_raw_auth(fd, &key);
}

/* An authenticated raw connection from src (NULL: 127.0.0.1), or -1. */
static int raw_authed_from(const char *src, int port) {
  int fd = raw_connect_from(src, port);
  if (fd < 0) return -1;
  if (raw_auth(fd) != 0) {
    close_fd(fd);
    return -1;
  }
  return fd;
}

static int raw_send(int fd, const void *p, size_t n) {
  return chorus__net_write_full(fd, p, n, chorus__deadline_ms(2000));
}

/* Reads one response frame into buf (cap bytes); returns its length or -1. */
static int raw_response(int fd, uint8_t *buf, size_t cap, int ms) {
  uint8_t hdr[4];
  int64_t dl = chorus__deadline_ms(ms);
  if (chorus__net_read_full(fd, hdr, 4, dl) < 0) return -1;
  uint32_t len = chorus__le32_get(hdr);
  if (len > cap || chorus__net_read_full(fd, buf, len, dl) < 0) return -1;
  return (int)len;
}

/* The reason of a BAD_REQUEST response body (NUL-terminated in place), or
 * NULL when the body is something else. */
static const char *bad_request_reason(uint8_t *body, int len) {
  if (len < 5 || body[0] != CHORUS__STORE_ST_BAD_REQUEST) return NULL;
  uint32_t n = chorus__le32_get(body + 1);
  if (5 + n != (uint32_t)len) return NULL;
  memmove(body, body + 5, n);
  body[n] = '\0';
  return (const char *)body;
}

/* A GET request frame for key into out; returns its length. */
static size_t get_frame(uint8_t *out, const char *key) {
  uint32_t kl = (uint32_t)strlen(key);
  chorus__le32_put(out, 1 + 4 + kl);
  out[4] = CHORUS__STORE_CMD_GET;
  chorus__le32_put(out + 5, kl);
  memcpy(out + 9, key, kl);
  return 9 + kl;
}

/* Resident memory of this process (the server thread's included), bytes. */
static size_t rss_bytes(void) {
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long size = 0, resident = 0;
  if (!f) return 0;
  if (fscanf(f, "%lu %lu", &size, &resident) != 2) resident = 0;
  fclose(f);
  return resident * (size_t)sysconf(_SC_PAGESIZE);
}

/* The most resident memory seen over ms (sampled every 10 ms): the server
 * reads what was pushed in its own time. */
static size_t rss_peak(int ms) {
  size_t peak = rss_bytes();
  for (int64_t end = now_ms() + ms; now_ms() < end; sleep_ms(10)) {
    size_t r = rss_bytes();
    if (r > peak) peak = r;
  }
  return peak;
}

/* Frames being pushed through non-blocking sends. */
typedef struct {
  int fd;
  const uint8_t *data;
  size_t len; /* bytes to push */
  size_t sent;
  int err; /* the send error that ended this push, or 0 */
} push_t;

/* Sends what the sockets take of every push, round-robin, until all are sent
 * (or failed: .err), nothing moved for quiet_ms, or ms passed.  Returns the
 * number of pushes that failed. */
static int push_all(push_t *p, int n, int quiet_ms, int ms) {
  int64_t deadline = chorus__deadline_ms(ms), last_progress = now_ms();
  for (;;) {
    int pending = 0, moved = 0, failed = 0;
    for (int i = 0; i < n; i++) {
      while (!p[i].err && p[i].sent < p[i].len) {
        ssize_t k = send(p[i].fd, p[i].data + p[i].sent, p[i].len - p[i].sent,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k > 0) {
          p[i].sent += (size_t)k;
          moved = 1;
          continue;
        }
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
        p[i].err = k < 0 ? errno : EIO;
      }
      if (p[i].err) failed++;
      else if (p[i].sent < p[i].len) pending = 1;
    }
    if (!pending) return failed;
    if (moved) last_progress = now_ms();
    if (now_ms() - last_progress >= quiet_ms || chorus__ms_left(deadline) == 0) return failed;
    sleep_ms(5);
  }
}

/* ------------------------------------------------------------------ tests */

/* Pins CHORUS_STORE_IDLE_TIMEOUT_MS and the client's transparent resend:
 * without the limit the idle raw connection would stay open; without the
 * resend the real client's first call after the close would fail.  Also pins
 * that a parked request is not "idle". */
TEST(idle_connections_close_and_clients_resend) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  ASSERT_EQ(chorus_store_set(c, "before", "1", 1), CHORUS_OK);
  int idle = raw_authed_from(NULL, port);
  int parked = raw_authed_from(NULL, port);
  ASSERT_TRUE(idle >= 0 && parked >= 0);
  uint8_t req[64];
  ASSERT_EQ(raw_send(parked, req, get_frame(req, "later")), 0);
  int64_t t0 = now_ms();

  ASSERT_EQ(store_raw_wait_closed(idle, IDLE_MS + 2000), 1);
  int64_t took = now_ms() - t0;
  ASSERT_TRUE(took >= IDLE_MS - 100);
  /* The parked GET has been silent just as long but waits for a key. */
  sleep_ms(300);
  ASSERT_TRUE(!peer_closed(parked));

  /* The real client's connection went idle too, and the server closed it;
   * its next calls resend on a fresh connection without the caller noticing. */
  ASSERT_TRUE(peer_closed(chorus__store_fd(c)));
  ASSERT_EQ(chorus_store_set(c, "later", "v", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "before", "1"), 0);
  ASSERT_STREQ(chorus_store_last_error(c), "");

  /* The parked GET is answered, and from then on its connection is idle. */
  uint8_t body[64];
  int n = raw_response(parked, body, sizeof body, 2000);
  ASSERT_EQ(n, 1 + 4 + 1);
  ASSERT_EQ(body[0], CHORUS__STORE_ST_OK);
  t0 = now_ms();
  ASSERT_EQ(store_raw_wait_closed(parked, IDLE_MS + 2000), 1);
  ASSERT_TRUE(now_ms() - t0 >= IDLE_MS - 100);
}

/* Pins CHORUS_STORE_FRAME_TIMEOUT_MS: a connection that stops halfway
 * through a length prefix or a body is closed after the frame timeout, well
 * before the idle timeout; without the limit it would stay open. */
TEST(partial_frames_time_out) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  int prefix = raw_authed_from(NULL, port);
  int body = raw_authed_from(NULL, port);
  ASSERT_TRUE(prefix >= 0 && body >= 0);
  uint8_t half[4 + 100] = {0};
  chorus__le32_put(half, 100);
  half[4] = CHORUS__STORE_CMD_SET;
  ASSERT_EQ(raw_send(prefix, half, 2), 0);
  ASSERT_EQ(raw_send(body, half, 4 + 40), 0);
  int64_t t0 = now_ms();
  ASSERT_EQ(store_raw_wait_closed(prefix, IDLE_MS), 1);
  int64_t took = now_ms() - t0;
  ASSERT_TRUE(took >= FRAME_MS - 50 && took < IDLE_MS - 200);
  ASSERT_EQ(store_raw_wait_closed(body, IDLE_MS), 1);
  ASSERT_TRUE(now_ms() - t0 < IDLE_MS - 200);

  /* A regular client is not disturbed. */
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "k", "v"), 0);
}

#define NPUSH 12

/* Asserts that the process's resident memory grew by less than the input
 * budget and 4 MiB (the client's own buffers, allocator slack).  Sanitizers
 * keep freed blocks in quarantine and count shadow memory, so under them the
 * number is only printed. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define RSS_CHECKED 0
#else
#define RSS_CHECKED 1
#endif
#define ASSERT_RSS_BOUNDED(grew)                                                 \
  do {                                                                         \
    if (RSS_CHECKED) ASSERT_TRUE((grew) < BUFFER_MAX + ((size_t)4 << 20));     \
  } while (0)

/* Pins CHORUS_STORE_BUFFER_MAX.  Part A: 12 authenticated connections each
 * send all but the last byte of a 1.9 MiB request: only what fits in the
 * 4 MiB budget is read, the rest waits in the kernel (a server without the
 * budget holds 23 MiB), and a regular client is served meanwhile.  Part B:
 * 12 connections each announce a 64 MiB frame, more than the whole budget:
 * each is answered at once with an error naming the variable while its body
 * is thrown away, so the 4 MiB each then pushes is never held (without the
 * budget: 48 MiB held, and no answer).  Part C: 12 complete 1.9 MiB requests
 * at once are all answered: paused connections resume as buffers free, none
 * starves, nothing deadlocks. */
TEST(input_budget_back_pressure) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);

  /* The bytes to push, touched now so that they count before the baseline.
   * CHECK with 480 keys of 4092 bytes: a valid 1.9 MiB request with a
   * one-byte answer that stores nothing. */
  const uint32_t nkeys = 480, klen = 4092;
  size_t check_len = 4 + 1 + 4 + (size_t)nkeys * (4 + klen);
  uint8_t *check = track_mem(malloc(check_len));
  size_t big_push = (size_t)4 << 20;
  uint8_t *big = track_mem(calloc(1, big_push));
  ASSERT_TRUE(big && check);
  chorus__le32_put(check, (uint32_t)(check_len - 4));
  check[4] = CHORUS__STORE_CMD_CHECK;
  chorus__le32_put(check + 5, nkeys);
  for (uint32_t i = 0; i < nkeys; i++) {
    uint8_t *k = check + 9 + (size_t)i * (4 + klen);
    chorus__le32_put(k, klen);
    memset(k + 4, 'a' + (int)(i % 26), klen);
  }
  uint32_t huge = CHORUS__STORE_MAX_FRAME;
  chorus__le32_put(big, huge);
  big[4] = CHORUS__STORE_CMD_SET;
  chorus__le32_put(big + 5, 1);
  big[9] = 'h';
  chorus__le32_put(big + 10, huge - 10);

  /* Part A.  Connections read wholly wait for their last byte and are
   * closed by the frame timeout, which lets paused ones in: all the same,
   * never more than the budget is held. */
  push_t p[NPUSH];
  for (int i = 0; i < NPUSH; i++) {
    int fd = raw_authed_from(NULL, port);
    ASSERT_TRUE(fd >= 0);
    p[i] = (push_t){.fd = fd, .data = check, .len = check_len - 1};
  }
  size_t rss0 = rss_bytes();
  push_all(p, NPUSH, 200, 3000);
  size_t rss1 = rss_peak(300), grew = rss1 > rss0 ? rss1 - rss0 : 0, pushed = 0;
  for (int i = 0; i < NPUSH; i++) pushed += p[i].sent;
  printf("  part A: pushed %zu KiB, RSS grew %zu KiB\n", pushed >> 10, grew >> 10);
  ASSERT_RSS_BOUNDED(grew);
  ASSERT_EQ(chorus_store_set(c, "during", "yes", 3), CHORUS_OK);
  ASSERT_EQ(get_is(c, "during", "yes"), 0);
  for (int i = 0; i < NPUSH; i++) close_fd(p[i].fd);

  /* Part B.  The server may close one that went quiet (frame timeout) while
   * others were pushed: its answer is read all the same. */
  for (int i = 0; i < NPUSH; i++) {
    int fd = raw_authed_from(NULL, port);
    ASSERT_TRUE(fd >= 0);
    p[i] = (push_t){.fd = fd, .data = big, .len = big_push};
  }
  rss0 = rss_bytes();
  push_all(p, NPUSH, 200, 3000);
  rss1 = rss_peak(100);
  grew = rss1 > rss0 ? rss1 - rss0 : 0;
  printf("  part B: pushed %zu MiB, RSS grew %zu KiB\n", (size_t)NPUSH * big_push >> 20,
         grew >> 10);
  ASSERT_RSS_BOUNDED(grew);
  for (int i = 0; i < NPUSH; i++) {
    uint8_t body[CHORUS__STORE_MAX_REASON + 8];
    int n = raw_response(p[i].fd, body, sizeof body, 2000);
    ASSERT_TRUE(n > 0);
    ASSERT_CONTAINS(bad_request_reason(body, n), "exceeds CHORUS_STORE_BUFFER_MAX=4194304");
    close_fd(p[i].fd);
  }
  ASSERT_EQ(get_is(c, "k", "v"), 0);

  /* Part C. */
  for (int i = 0; i < NPUSH; i++) {
    int fd = raw_authed_from(NULL, port);
    ASSERT_TRUE(fd >= 0);
    p[i] = (push_t){.fd = fd, .data = check, .len = check_len};
  }
  int answered[NPUSH] = {0}, nanswered = 0;
  int64_t deadline = chorus__deadline_ms(10000);
  while (nanswered < NPUSH && chorus__ms_left(deadline) > 0) {
    ASSERT_EQ(push_all(p, NPUSH, 20, 50), 0);
    for (int i = 0; i < NPUSH; i++) {
      if (answered[i] || p[i].sent < p[i].len) continue;
      struct pollfd pf = {.fd = p[i].fd, .events = POLLIN};
      if (poll(&pf, 1, 0) <= 0) continue;
      uint8_t body[16];
      ASSERT_EQ(raw_response(p[i].fd, body, sizeof body, 2000), 2);
      ASSERT_EQ(body[0], CHORUS__STORE_ST_OK);
      answered[i] = 1;
      nanswered++;
    }
  }
  ASSERT_EQ(nanswered, NPUSH);
  ASSERT_EQ(get_is(c, "during", "yes"), 0);
}

/* Pins CHORUS_STORE_DATA_MAX and CHORUS_STORE_KEYS_MAX: requests past them
 * fail with the limit's name in the client's error, the connection stays and
 * the store keeps serving (without the limits they would succeed). */
TEST(data_and_key_limits) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  size_t vlen = 600 << 10;
  char *val = malloc(vlen);
  ASSERT_TRUE(val != NULL);
  memset(val, 'x', vlen);
  chorus_result_t rc1 = chorus_store_set(c, "big1", val, vlen);
  chorus_result_t rc2 = chorus_store_set(c, "big2", val, vlen);
  void *cur = NULL;
  size_t curlen = 0;
  chorus_result_t rc3 = chorus_store_compare_set(c, "big3", NULL, 0, val, vlen, &cur, &curlen);
  free(val);
  ASSERT_EQ(rc1, CHORUS_OK);
  ASSERT_EQ(rc2, CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(rc3, CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_store_last_error(c), "store full: CHORUS_STORE_DATA_MAX=1048576 bytes");
  ASSERT_CONTAINS(chorus_store_last_error(c), "compare_set('big3')");
  int fd = chorus__store_fd(c);
  /* Shrinking a value is fine when full; deleting makes room. */
  ASSERT_EQ(chorus_store_set(c, "big1", "small", 5), CHORUS_OK);
  ASSERT_EQ(get_is(c, "big1", "small"), 0);
  ASSERT_EQ(chorus__store_fd(c), fd); /* the same connection */

  /* Keys: 1000 in all, placeholders of awaited keys included. */
  char key[32];
  for (int i = 1; i < KEYS_MAX; i++) {
    snprintf(key, sizeof key, "k%d", i);
    if (chorus_store_set(c, key, "1", 1) != CHORUS_OK) {
      HARNESS_FAIL("set(%s): %s", key, chorus_store_last_error(c));
      return;
    }
  }
  int64_t nkeys = 0;
  ASSERT_EQ(chorus_store_num_keys(c, &nkeys), CHORUS_OK);
  ASSERT_EQ(nkeys, KEYS_MAX);
  ASSERT_EQ(chorus_store_set(c, "one-more", "1", 1), CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_store_last_error(c), "store full: CHORUS_STORE_KEYS_MAX=1000 keys");
  ASSERT_EQ(chorus_store_add(c, "counter", 1, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_store_last_error(c), "CHORUS_STORE_KEYS_MAX");
  /* A GET on a missing key would need a placeholder: refused at once
   * rather than parked. */
  void *v = NULL;
  size_t n = 0;
  int64_t t0 = now_ms();
  ASSERT_EQ(chorus__store_get_timeout(c, "missing", 3000, &v, &n), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(now_ms() - t0 < 1000);
  ASSERT_CONTAINS(chorus_store_last_error(c), "CHORUS_STORE_KEYS_MAX=1000");
  /* Existing keys still change; a delete makes room for a new one. */
  ASSERT_EQ(chorus_store_set(c, "k1", "2", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "k1", "2"), 0);
  int deleted = 0;
  ASSERT_EQ(chorus_store_delete(c, "k2", &deleted), CHORUS_OK);
  ASSERT_EQ(deleted, 1);
  ASSERT_EQ(chorus_store_set(c, "one-more", "1", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "one-more", "1"), 0);
  ASSERT_EQ(chorus__store_fd(c), fd);
}

/* Pins CHORUS_STORE_CONNS_PER_ADDR: the 65th connection from 127.0.0.2 is
 * closed at once, without a hello (a server without the limit would greet
 * it), while clients from 127.0.0.1 keep working and connecting; once some
 * close, 127.0.0.2 can connect again. */
TEST(connections_per_address) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  chorus__store_server_set_handshake_timeout(g_server, 10000);
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  int fds[PER_ADDR];
  uint8_t hello[4 + CHORUS__STORE_HELLO_LEN];
  for (int i = 0; i < PER_ADDR; i++) {
    fds[i] = raw_connect_from("127.0.0.2", port);
    ASSERT_TRUE(fds[i] >= 0);
    ASSERT_EQ(read_hello(fds[i], hello, 2000), 0);
  }
  int extra = raw_connect_from("127.0.0.2", port);
  ASSERT_TRUE(extra >= 0);
  int64_t t0 = now_ms();
  ASSERT_EQ(store_raw_wait_closed(extra, 2000), 1);
  ASSERT_TRUE(now_ms() - t0 < 1000);

  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "k", "v"), 0);
  chorus_store_t *c2 = connect_to(port);
  ASSERT_TRUE(c2 != NULL);
  ASSERT_EQ(get_is(c2, "k", "v"), 0);

  for (int i = 0; i < 8; i++) close_fd(fds[i]);
  /* The server sees those goodbyes in its own time: retry briefly, as the
   * client library does when a store closes it during the handshake. */
  int fd = -1;
  for (int64_t end = now_ms() + 2000; fd < 0 && now_ms() < end; sleep_ms(20))
    fd = raw_authed_from("127.0.0.2", port);
  ASSERT_TRUE(fd >= 0);
  uint8_t req[64], body[64];
  ASSERT_EQ(raw_send(fd, req, get_frame(req, "k")), 0);
  ASSERT_EQ(raw_response(fd, body, sizeof body, 2000), 1 + 4 + 1);
  ASSERT_EQ(body[5], 'v');
}

/* Pins the handshake queue (HANDSHAKING_MAX, 256): 300 silent strangers
 * (from five addresses, under the per-address limit) do not keep a real
 * client out, and the oldest of them are dropped long before the handshake
 * timeout (a server without the queue keeps all 300 for 10 s). */
TEST(handshake_queue_drops_oldest) {
  int port = 0;
  ASSERT_EQ(start_server(&port), 0);
  chorus__store_server_set_handshake_timeout(g_server, 10000);
  enum { NSTRANGERS = 300 };
  static int s[NSTRANGERS];
  static const char *const from[] = {"127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6",
                                     "127.0.0.7"};
  for (int i = 0; i < NSTRANGERS; i++) {
    s[i] = raw_connect_from(from[i % 5], port);
    ASSERT_TRUE(s[i] >= 0);
  }
  int64_t t0 = now_ms();
  chorus_store_t *c = connect_to(port);
  ASSERT_TRUE(c != NULL);
  ASSERT_TRUE(now_ms() - t0 < 2000);
  ASSERT_EQ(chorus_store_set(c, "k", "v", 1), CHORUS_OK);
  ASSERT_EQ(get_is(c, "k", "v"), 0);
  ASSERT_EQ(store_raw_wait_closed(s[0], 2000), 1);
  ASSERT_EQ(store_raw_wait_closed(s[40], 2000), 1); /* 300 + 1 - 256 = 45 dropped */
  ASSERT_EQ(store_raw_wait_closed(s[NSTRANGERS - 1], 100), 0);
}

/* Reads n bytes from a pipe within ms; 0 or -1. */
static int read_pipe(int fd, void *buf, size_t n, int ms) {
  int64_t deadline = chorus__deadline_ms(ms);
  for (size_t got = 0; got < n;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = chorus__ms_left(deadline);
    if (left == 0 || poll(&p, 1, left) < 0) return -1;
    if (!(p.revents & (POLLIN | POLLHUP))) continue;
    ssize_t k = read(fd, (char *)buf + got, n - got);
    if (k <= 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

/* The child of fd_reserve: serves a store with RLIMIT_NOFILE just above what
 * it holds (reserve + 40), then on request reports how many sockets it can
 * still open itself. */
static void fd_child(int in, int out) {
  alarm(30);
  int lowest = dup(in);
  close(lowest);
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = (rlim_t)lowest + 3 + FD_RESERVE + 40; /* 3: listen, epoll, eventfd */
  int port = -1;
  chorus_store_server_t *srv = NULL;
  if (setrlimit(RLIMIT_NOFILE, &rl) == 0 &&
      chorus_store_server_start("127.0.0.1", 0, SECRET, &srv) == CHORUS_OK)
    port = chorus_store_server_port(srv);
  if (write(out, &port, sizeof port) != sizeof port) _exit(1);
  char b;
  if (read(in, &b, 1) != 1) _exit(1);
  int opened = 0;
  while (opened < FD_RESERVE - 4 && socket(AF_INET, SOCK_STREAM, 0) >= 0) opened++;
  if (write(out, &opened, sizeof opened) != sizeof opened) _exit(1);
  while (read(in, &b, 1) > 0) {
  }
  _exit(0);
}

/* Pins CHORUS_STORE_FD_RESERVE: a store in a child process whose descriptor
 * limit is 40 above what it needs takes about 40 connections and refuses
 * the rest at once, and the child can still open its own sockets (a server
 * without the reserve takes connections until accept() fails with EMFILE,
 * and the child then cannot open any). */
TEST(fd_reserve_keeps_descriptors_free) {
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  track_fd(to_child[0]);
  track_fd(to_child[1]);
  ASSERT_EQ(pipe(from_child), 0);
  track_fd(from_child[0]);
  track_fd(from_child[1]);
  fflush(stdout);
  fflush(stderr);
  g_child = fork();
  ASSERT_TRUE(g_child >= 0);
  if (g_child == 0) {
    close(to_child[1]);
    close(from_child[0]);
    fd_child(to_child[0], from_child[1]);
  }
  close_fd(to_child[0]);
  close_fd(from_child[1]);
  int port = -1;
  ASSERT_EQ(read_pipe(from_child[0], &port, sizeof port, 5000), 0);
  ASSERT_TRUE(port > 0);
  int accepted = 0, refused = 0;
  for (int i = 0; i < 100; i++) {
    int fd = raw_connect_from(i % 2 ? "127.0.0.8" : "127.0.0.9", port);
    ASSERT_TRUE(fd >= 0);
    uint8_t hello[4 + CHORUS__STORE_HELLO_LEN];
    if (read_hello(fd, hello, 1000) == 0)
      accepted++;
    else
      refused++;
  }
  printf("  %d connections accepted, %d refused\n", accepted, refused);
  ASSERT_TRUE(accepted >= 30);
  ASSERT_TRUE(refused >= 40);
  char go = 1;
  ASSERT_EQ(write(to_child[1], &go, 1), 1);
  int opened = -1;
  ASSERT_EQ(read_pipe(from_child[0], &opened, sizeof opened, 5000), 0);
  ASSERT_EQ(opened, FD_RESERVE - 4);
}

int main(void) {
  /* Parsed once per process: before the first chorus call. */
  setenv("CHORUS_STORE_IDLE_TIMEOUT_MS", "1000", 1);
  setenv("CHORUS_STORE_FRAME_TIMEOUT_MS", "250", 1);
  setenv("CHORUS_STORE_BUFFER_MAX", "4194304", 1);
  setenv("CHORUS_STORE_DATA_MAX", "1048576", 1);
  setenv("CHORUS_STORE_KEYS_MAX", "1000", 1);
  setenv("CHORUS_STORE_CONNS_PER_ADDR", "64", 1);
  setenv("CHORUS_STORE_FD_RESERVE", "64", 1);
  /* 300 strangers hold 600 descriptors here: make sure the soft limit has
   * room for them above the reserve. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 4096) {
    rl.rlim_cur = rl.rlim_max < 4096 ? rl.rlim_max : 4096;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  signal(SIGPIPE, SIG_IGN);
  RUN_CLEAN(idle_connections_close_and_clients_resend);
  RUN_CLEAN(partial_frames_time_out);
  RUN_CLEAN(input_budget_back_pressure);
  RUN_CLEAN(data_and_key_limits);
  RUN_CLEAN(connections_per_address);
  RUN_CLEAN(handshake_queue_drops_oldest);
  RUN_CLEAN(fd_reserve_keeps_descriptors_free);
  return HARNESS_DONE();
}
