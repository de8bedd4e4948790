/*
 * test_kv_etcd.c - the launcher's etcd key-value client (src/launcher/
 * kv_etcd.c, compiled into this test by tests/launcher/CMakeLists.txt; the
 * launcher's main.c is not linked).
 *
 *   test_kv_etcd                       against fake servers on threads of
 *                                      this process (no etcd needed): replies
 *                                      as etcd 3.4 writes them (chunked,
 *                                      escaped, fields left out), then
 *                                      garbage, huge or endless replies,
 *                                      malformed JSON and HTTP, silence,
 *                                      error statuses, stale connections,
 *                                      failover past dead endpoints
 *   test_kv_etcd single ENDPOINTS      against a real etcd: get/set/cas
 *                                      semantics, 1 MiB values, too large
 *                                      ones, prefixes, two clients racing
 *                                      cas, round-trip latency
 *   test_kv_etcd secure ENDPOINTS      the same but the sizes, over TLS or
 *                                      with authentication (CHORUS_TEST_ETCD_*
 *                                      variables), and a token that expires
 *   test_kv_etcd cluster ENDPOINTS CMD against a 3-member etcd: get/set/cas
 *                                      without pause while a thread runs
 *                                      CMD (kills a member); no call may
 *                                      fail or give a wrong answer
 *
 * tests/launcher/test_etcd_kv.sh runs the last two with tests/fixtures/
 * etcd.sh.  Every call in the offline part is bounded by a short call
 * timeout and timed: none may take much longer than it.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "launcher/launcher.h"
#include "util/clock.h"
#include "util/net.h"
#include "util/util.h"

static double now_ms(void) {
  return chorus__now_ns() / 1e6;
}

static void sleep_ms(int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ fake server
 * Answers each complete request (headers and Content-Length body) with the
 * next step of its script; the last step repeats.  One connection at a
 * time: a new one replaces the old. */

enum {
  ACT_REPLY,       /* send text, keep the connection */
  ACT_REPLY_CLOSE, /* send text, then close (no Connection: close said) */
  ACT_SILENT,      /* read the request, never answer */
  ACT_CLOSE,       /* close the connection without a word */
  ACT_FLOOD,       /* text, then 64 KiB chunks forever */
  ACT_DIE,         /* read the request, close it and stop listening */
};

typedef struct {
  int act;
  const char *text;
} step_t;

typedef struct {
  int lfd, port, cfd;
  pthread_t th;
  pthread_mutex_t mu;
  atomic_int stop; /* set by the test thread, read by the server thread */
  step_t script[8];
  int nsteps, next;
  int requests, conns;
  char last[8192]; /* the last request, cut */
} fake_t;

static void fake_send(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    p += w;
    n -= (size_t)w;
  }
}

static void fake_flood(fake_t *f, int fd) {
  static char chunk[7 + 65536 + 2];
  memcpy(chunk, "10000\r\n", 7);
  memset(chunk + 7, ' ', 65536);
  memcpy(chunk + 7 + 65536, "\r\n", 2);
  chorus__net_set_nonblock(fd, 1);
  size_t off = 0, n = 7 + 65536 + 2;
  while (!f->stop) {
    ssize_t w = send(fd, chunk + off, n - off, MSG_NOSIGNAL);
    if (w > 0) {
      off = (off + (size_t)w) % n;
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EINTR) return;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    poll(&p, 1, 20);
    if (p.revents & (POLLERR | POLLHUP)) return;
  }
}

static void *fake_main(void *arg) {
  fake_t *f = arg;
  size_t cap = 1 << 20, len = 0;
  char *buf = malloc(cap);
  while (!f->stop) {
    struct pollfd p[2] = {{.fd = f->lfd, .events = POLLIN}, {.fd = f->cfd, .events = POLLIN}};
    if (poll(p, f->cfd >= 0 ? 2 : 1, 20) <= 0) continue;
    if (p[0].revents & POLLIN) {
      int c = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
      if (c >= 0) {
        if (f->cfd >= 0) close(f->cfd);
        f->cfd = c;
        len = 0;
        pthread_mutex_lock(&f->mu);
        f->conns++;
        pthread_mutex_unlock(&f->mu);
      }
      continue;
    }
    if (f->cfd < 0 || !(p[1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    ssize_t n = recv(f->cfd, buf + len, cap - len, 0);
    if (n <= 0) {
      close(f->cfd);
      f->cfd = -1;
      continue;
    }
    len += (size_t)n;
    for (;;) {
      char *e = memmem(buf, len, "\r\n\r\n", 4);
      if (!e) break;
      size_t hl = (size_t)(e - buf) + 4, bl = 0;
      char *cl = strcasestr(buf, "content-length:");
      if (cl && cl < e) bl = strtoul(cl + 15, NULL, 10);
      if (len < hl + bl) break;
      pthread_mutex_lock(&f->mu);
      size_t keep = CHORUS__MIN(hl + bl, sizeof f->last - 1);
      memcpy(f->last, buf, keep);
      f->last[keep] = '\0';
      f->requests++;
      step_t st = f->script[f->next];
      if (f->next + 1 < f->nsteps) f->next++;
      pthread_mutex_unlock(&f->mu);
      memmove(buf, buf + hl + bl, len - hl - bl);
      len -= hl + bl;
      if (st.act == ACT_DIE) {
        close(f->lfd); /* later connects are refused */
        f->lfd = -1;
      }
      if (st.text && st.act != ACT_SILENT && st.act != ACT_CLOSE && st.act != ACT_DIE)
        fake_send(f->cfd, st.text, strlen(st.text));
      if (st.act == ACT_FLOOD) fake_flood(f, f->cfd);
      if (st.act == ACT_REPLY_CLOSE || st.act == ACT_CLOSE || st.act == ACT_FLOOD ||
          st.act == ACT_DIE) {
        close(f->cfd);
        f->cfd = -1;
        len = 0;
        break;
      }
    }
  }
  if (f->cfd >= 0) close(f->cfd);
  free(buf);
  return NULL;
}

static fake_t *fake_start(void) {
  fake_t *f = calloc(1, sizeof *f);
  f->cfd = -1;
  f->lfd = chorus__net_listen("127.0.0.1", 0, 16, &f->port);
  if (f->lfd < 0) {
    free(f);
    return NULL;
  }
  pthread_mutex_init(&f->mu, NULL);
  pthread_create(&f->th, NULL, fake_main, f);
  return f;
}

/* Replaces the script (steps ACT, TEXT, ACT, TEXT, ..., -1). */
static void fake_script(fake_t *f, ...) {
  va_list ap;
  va_start(ap, f);
  pthread_mutex_lock(&f->mu);
  f->nsteps = 0;
  f->next = 0;
  for (int act; f->nsteps < 8 && (act = va_arg(ap, int)) >= 0;) {
    f->script[f->nsteps].act = act;
    f->script[f->nsteps].text = va_arg(ap, const char *);
    f->nsteps++;
  }
  pthread_mutex_unlock(&f->mu);
  va_end(ap);
}

static void fake_stop(fake_t *f) {
  if (!f) return;
  f->stop = 1;
  pthread_join(f->th, NULL);
  if (f->lfd >= 0) close(f->lfd);
  pthread_mutex_destroy(&f->mu);
  free(f);
}

#define HDR200 "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
#define HEADER \
  "{\"header\":{\"cluster_id\":\"1\",\"member_id\":\"2\",\"revision\":\"7\",\"raft_term\":\"2\"}"
/* What etcd answers to a range of an absent key, a put, a failed txn. */
#define OK_EMPTY HDR200 "Content-Length: 76\r\n\r\n" HEADER "}"

static char g_ep[256];

/* Opens a client on the fake (script: the open's check answered, then
 * the steps given) with call timeout ms. */
static kv_t *open_fake(fake_t *f, int ms) {
  snprintf(g_ep, sizeof g_ep, "127.0.0.1:%d", f->port);
  kv_t *kv = NULL;
  char err[700];
  if (kv_etcd_open(g_ep, "/t/", ms, ms, NULL, &kv, err, sizeof err) != 0) {
    fprintf(stderr, "open %s: %s\n", g_ep, err);
    return NULL;
  }
  return kv;
}

static fake_t *g_fake;

/* Replies built at run time, freed at the end. */
static char *g_strs[64];
static int g_nstrs;

static const char *keep(char *s) {
  if (g_nstrs < (int)CHORUS__ARRAY_LEN(g_strs)) g_strs[g_nstrs++] = s;
  return s;
}

static void free_strs(void) {
  while (g_nstrs > 0) free(g_strs[--g_nstrs]);
}

/* "HTTP/1.1 <status>" with Content-Length and body. */
static const char *reply(const char *status, const char *body) {
  size_t n = strlen(body) + 200;
  char *s = malloc(n);
  snprintf(s, n, "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
           status, strlen(body), body);
  return keep(s);
}

/* A 200 reply with body in chunks of piece bytes (an extension on the
 * first, a trailer like etcd's after the last). */
static const char *reply_chunked(const char *body, size_t piece) {
  size_t n = strlen(body), cap = n * 8 + 400, o = 0;
  char *s = malloc(cap);
  o += (size_t)snprintf(s, cap,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        "Transfer-Encoding: chunked\r\nTrailer: Grpc-Trailer-Content-Type\r\n\r\n");
  for (size_t i = 0; i < n; i += piece) {
    size_t m = CHORUS__MIN(piece, n - i);
    o += (size_t)snprintf(s + o, cap - o, "%zx%s\r\n%.*s\r\n", m, i ? "" : ";ext=1", (int)m,
                          body + i);
  }
  snprintf(s + o, cap - o, "0\r\nGrpc-Trailer-Content-Type: application/grpc\r\n\r\n");
  return keep(s);
}

/* A range reply whose kvs[0] carries value (JSON text, quoted). */
static const char *range_reply(const char *value_json) {
  char body[1024];
  snprintf(body, sizeof body,
           HEADER
           ",\"kvs\":[{\"key\":\"L3Qvaw==\",\"create_revision\":\"3\",\"mod_revision\":\"3\","
           "\"version\":\"1\",\"value\":%s}],\"count\":\"1\"}",
           value_json);
  return reply("200 OK", body);
}

/* Runs get on a fresh client whose calls the fake answers with text (act),
 * after a good answer to the open's check: the result, err in errbuf, the
 * call's duration in *ms. */
static int get_with(int act, const char *text, int call_ms, char *errbuf, size_t cap, double *ms,
                    char **val) {
  fake_script(g_fake, ACT_REPLY, OK_EMPTY, act, text, -1);
  kv_t *kv = open_fake(g_fake, call_ms);
  if (!kv) return -9;
  char *v = NULL;
  double t = now_ms();
  int rc = kv->ops->get(kv, "k", &v);
  *ms = now_ms() - t;
  snprintf(errbuf, cap, "%s", kv->err);
  if (val)
    *val = v;
  else
    free(v);
  kv->ops->close(kv);
  return rc;
}

/* get must fail at once (a wrong answer is not waited out) naming the
 * endpoint and saying want. */
#define EXPECT_BAD(act, text, want)                                     \
  do {                                                                  \
    char err_[700];                                                     \
    double ms_;                                                         \
    int rc_ = get_with(act, text, 2000, err_, sizeof err_, &ms_, NULL); \
    ASSERT_EQ(rc_, -1);                                                 \
    ASSERT_CONTAINS(err_, want);                                        \
    ASSERT_CONTAINS(err_, g_ep);                                        \
    if (ms_ > 1000) HARNESS_FAIL("took %.0f ms: %s", ms_, err_);        \
  } while (0)

/* ----------------------------------------------------- offline: the good */

TEST(get_plain_and_keepalive) {
  fake_t *f = g_fake;
  fake_script(f, ACT_REPLY, OK_EMPTY, ACT_REPLY, range_reply("\"aGVsbG8=\""), -1);
  int conns0 = f->conns;
  kv_t *kv = open_fake(f, 500);
  ASSERT_TRUE(kv != NULL);
  char *v = NULL;
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(kv->ops->get(kv, "k", &v), 1);
    ASSERT_STREQ(v, "hello");
    free(v);
  }
  /* The key goes out under the prefix, in base64: "/t/k". */
  ASSERT_CONTAINS(f->last, "POST /v3/kv/range HTTP/1.1\r\n");
  ASSERT_CONTAINS(f->last, "{\"key\":\"L3Qvaw==\"}");
  /* One kept connection for the open and three gets. */
  ASSERT_EQ(f->conns - conns0, 1);
  char host[64];
  ASSERT_EQ(kv->ops->local_addr(kv, host, sizeof host), 0);
  ASSERT_STREQ(host, "127.0.0.1");
  ASSERT_STREQ(kv->where, g_ep);
  kv->ops->close(kv);
}

TEST(get_chunked_escaped_spaced) {
  char err[700], *v = NULL;
  double ms;
  /* Chunked (7-byte chunks, an extension, a trailer); "\/" is "/":
   * "Pz8/" is "???". */
  const char *body =
      HEADER ",\"kvs\":[{\"key\":\"L3Qvaw==\",\"value\":\"Pz8\\/\"}],\"count\":\"1\"}";
  ASSERT_EQ(get_with(ACT_REPLY, reply_chunked(body, 7), 500, err, sizeof err, &ms, &v), 1);
  ASSERT_STREQ(v, "???");
  free(v);
  /* One chunk per byte. */
  ASSERT_EQ(get_with(ACT_REPLY, reply_chunked(body, 1), 500, err, sizeof err, &ms, &v), 1);
  ASSERT_STREQ(v, "???");
  free(v);
  /* \u escapes, whitespace everywhere, a nested "kvs" that is not ours,
   * members in another order. */
  ASSERT_EQ(get_with(ACT_REPLY,
                     reply("200 OK",
                           " {\n \"header\" : {\"kvs\":\"no\"} ,\r\n \"count\":\"1\", \"kvs\" : [ "
                           "{ \"value\" : \"\\u0061Gk=\" , \"key\":\"x\"} ] } \n"),
                     500, err, sizeof err, &ms, &v),
            1);
  ASSERT_STREQ(v, "hi");
  free(v);
}

TEST(get_absent_and_empty) {
  char err[700], *v = NULL;
  double ms;
  /* No key: "kvs" left out. */
  ASSERT_EQ(get_with(ACT_REPLY, OK_EMPTY, 500, err, sizeof err, &ms, &v), 0);
  ASSERT_TRUE(v == NULL);
  ASSERT_EQ(
      get_with(ACT_REPLY, reply("200 OK", HEADER ",\"kvs\":[]}"), 500, err, sizeof err, &ms, &v),
      0);
  /* An empty value: "value" left out. */
  ASSERT_EQ(get_with(ACT_REPLY,
                     reply("200 OK",
                           HEADER ",\"kvs\":[{\"key\":\"L3Qvaw==\",\"create_revision\":\"2\"}]}"),
                     500, err, sizeof err, &ms, &v),
            1);
  ASSERT_STREQ(v, "");
  free(v);
}

TEST(set_and_cas_requests) {
  fake_t *f = g_fake;
  fake_script(f, ACT_REPLY, OK_EMPTY, -1);
  kv_t *kv = open_fake(f, 500);
  ASSERT_TRUE(kv != NULL);
  ASSERT_EQ(kv->ops->set(kv, "k", "v"), 0);
  ASSERT_CONTAINS(f->last, "POST /v3/kv/put HTTP/1.1\r\n");
  ASSERT_CONTAINS(f->last, "{\"key\":\"L3Qvaw==\",\"value\":\"dg==\"}");
  /* Not swapped: "succeeded" left out. */
  ASSERT_EQ(kv->ops->cas(kv, "k", NULL, "v"), 0);
  ASSERT_CONTAINS(f->last, "POST /v3/kv/txn HTTP/1.1\r\n");
  ASSERT_CONTAINS(f->last, "\"result\":\"EQUAL\",\"target\":\"CREATE\",\"create_revision\":\"0\"");
  ASSERT_CONTAINS(f->last,
                  "\"success\":[{\"request_put\":{\"key\":\"L3Qvaw==\",\"value\":\"dg==\"}}]");
  ASSERT_TRUE(strstr(f->last, "failure") == NULL);
  ASSERT_EQ(kv->ops->cas(kv, "k", "old", "v"), 0);
  ASSERT_CONTAINS(f->last, "\"result\":\"EQUAL\",\"target\":\"VALUE\",\"value\":\"b2xk\"");
  fake_script(f, ACT_REPLY, reply("200 OK", HEADER ",\"succeeded\":true,\"responses\":[]}"), -1);
  ASSERT_EQ(kv->ops->cas(kv, "k", "old", "v"), 1);
  fake_script(f, ACT_REPLY, reply("200 OK", HEADER ",\"succeeded\":\"yes\"}"), -1);
  ASSERT_EQ(kv->ops->cas(kv, "k", "old", "v"), -1);
  ASSERT_CONTAINS(kv->err, "not a boolean");
  kv->ops->close(kv);
}

TEST(cas_after_lost_reply) {
  /* The first txn is read and the connection closed without a reply: it
   * may have been applied.  The retry also reads the key when its
   * comparison fails; our value there means the first one swapped. */
  fake_t *f = g_fake;
  const char *mine = reply("200 OK", HEADER
                           ",\"responses\":[{\"response_range\":{\"header\":{},\"kvs\":"
                           "[{\"key\":\"L3Qvaw==\",\"value\":\"bmV3\"}],\"count\":\"1\"}}]}");
  const char *theirs = reply("200 OK", HEADER
                             ",\"responses\":[{\"response_range\":{\"header\":{},\"kvs\":"
                             "[{\"key\":\"L3Qvaw==\",\"value\":\"b3RoZXI=\"}],\"count\":\"1\"}}]}");
  for (int i = 0; i < 2; i++) {
    fake_script(f, ACT_REPLY, OK_EMPTY, ACT_CLOSE, NULL, ACT_REPLY, i ? theirs : mine, -1);
    kv_t *kv = open_fake(f, 1000);
    ASSERT_TRUE(kv != NULL);
    int before = f->requests;
    ASSERT_EQ(kv->ops->cas(kv, "k", "old", "new"), i ? 0 : 1);
    ASSERT_EQ(f->requests - before, 2);
    ASSERT_CONTAINS(f->last, "\"failure\":[{\"request_range\":{\"key\":\"L3Qvaw==\"}}]");
    kv->ops->close(kv);
  }
}

TEST(cas_member_killed_after_taking_it) {
  /* The member takes the txn on a kept connection and dies: libcurl sends
   * it again on a new connection, whose connect is refused.  That refusal
   * does not make the txn unsent (it may have been applied): the next
   * member gets the retry that reads the key, and finds our value. */
  const char *mine = reply("200 OK", HEADER
                           ",\"responses\":[{\"response_range\":{\"header\":{},\"kvs\":"
                           "[{\"key\":\"L3Qvaw==\",\"value\":\"bmV3\"}],\"count\":\"1\"}}]}");
  fake_t *dying = fake_start();
  ASSERT_TRUE(dying != NULL);
  fake_script(dying, ACT_REPLY, OK_EMPTY, ACT_DIE, NULL, -1);
  fake_script(g_fake, ACT_REPLY, mine, -1);
  char eps[128], err[700];
  snprintf(eps, sizeof eps, "127.0.0.1:%d,127.0.0.1:%d", dying->port, g_fake->port);
  kv_t *kv = NULL;
  ASSERT_EQ(kv_etcd_open(eps, "/t/", 2000, 2000, NULL, &kv, err, sizeof err), 0);
  int before = g_fake->requests;
  ASSERT_EQ(kv->ops->cas(kv, "k", "old", "new"), 1);
  ASSERT_EQ(dying->requests, 2);
  ASSERT_EQ(g_fake->requests - before, 1);
  ASSERT_CONTAINS(g_fake->last, "\"failure\":[{\"request_range\":{\"key\":\"L3Qvaw==\"}}]");
  kv->ops->close(kv);
  fake_stop(dying);
}

TEST(stale_and_closed_connections) {
  fake_t *f = g_fake;
  /* The fake closes after each reply without saying so: every call finds
   * its kept connection dead and goes on, unnoticed, on a fresh one. */
  fake_script(f, ACT_REPLY_CLOSE, OK_EMPTY, -1);
  kv_t *kv = open_fake(f, 500);
  ASSERT_TRUE(kv != NULL);
  int conns0 = f->conns;
  for (int i = 0; i < 3; i++) {
    char *v = NULL;
    sleep_ms(30); /* let the close arrive first */
    ASSERT_EQ(kv->ops->get(kv, "k", &v), 0);
  }
  ASSERT_EQ(f->conns - conns0, 3);
  /* "Connection: close" is obeyed. */
  fake_script(f, ACT_REPLY,
              "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 76\r\n\r\n" HEADER "}", -1);
  conns0 = f->conns;
  for (int i = 0; i < 3; i++) ASSERT_EQ(kv->ops->set(kv, "k", "v"), 0);
  ASSERT_EQ(f->conns - conns0, 3);
  /* HTTP/1.0 without a length: the body ends with the connection. */
  fake_script(f, ACT_REPLY_CLOSE, "HTTP/1.0 200 OK\r\n\r\n" HEADER "}", -1);
  ASSERT_EQ(kv->ops->set(kv, "k", "v"), 0);
  kv->ops->close(kv);
}

TEST(failover_past_dead_and_wrong) {
  /* A port nobody listens on, then a server answering garbage, then the
   * good one: the open and the calls get through; later calls go straight
   * to the member that answered. */
  /* Bound but not listening, and held: refused (RST), and no other
   * process on the machine can take the port meanwhile. */
  int dead_port = 0, dfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  socklen_t sl = sizeof sa;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_TRUE(dfd >= 0 && bind(dfd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
              getsockname(dfd, (struct sockaddr *)&sa, &sl) == 0);
  dead_port = ntohs(sa.sin_port);
  fake_t *junk = fake_start();
  ASSERT_TRUE(junk != NULL);
  fake_script(junk, ACT_REPLY, "<html>hello</html>\r\n", -1);
  fake_script(g_fake, ACT_REPLY, range_reply("\"aGk=\""), -1);
  char eps[256], err[700];
  snprintf(eps, sizeof eps, " http://127.0.0.1:%d/, 127.0.0.1:%d,127.0.0.1:%d", dead_port,
           junk->port, g_fake->port);
  kv_t *kv = NULL;
  ASSERT_EQ(kv_etcd_open(eps, "/t/", 2000, 2000, NULL, &kv, err, sizeof err), 0);
  int junk_requests = junk->requests;
  for (int i = 0; i < 3; i++) {
    char *v = NULL;
    ASSERT_EQ(kv->ops->get(kv, "k", &v), 1);
    ASSERT_STREQ(v, "hi");
    free(v);
  }
  ASSERT_EQ(junk->requests, junk_requests);
  char want[64];
  snprintf(want, sizeof want, "127.0.0.1:%d,127.0.0.1:%d,", dead_port, junk->port);
  ASSERT_CONTAINS(kv->where, want);
  kv->ops->close(kv);
  fake_stop(junk);
  close(dfd);
}

/* ------------------------------------------------------ offline: the bad */

/* get must fail naming the endpoint within the call's bound (400 ms):
 * libcurl reads these as unfinished replies and waits for the rest until
 * the deadline. */
#define EXPECT_BOUNDED(act, text)                                      \
  do {                                                                 \
    char err_[700];                                                    \
    double ms_;                                                        \
    int rc_ = get_with(act, text, 400, err_, sizeof err_, &ms_, NULL); \
    ASSERT_EQ(rc_, -1);                                                \
    ASSERT_CONTAINS(err_, g_ep);                                       \
    if (ms_ > 1000) HARNESS_FAIL("took %.0f ms: %s", ms_, err_);       \
  } while (0)

TEST(garbage_replies) {
  EXPECT_BAD(ACT_REPLY, "hello, I am not a web server\r\n", "not an HTTP reply");
  EXPECT_BAD(ACT_REPLY, "HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP reply");
  EXPECT_BAD(ACT_REPLY, "\x16\x03\x01\x02\x00", "not an HTTP reply"); /* a TLS hello */
  EXPECT_BAD(ACT_REPLY, "HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", "announces");
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n");
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}");
  EXPECT_BOUNDED(ACT_REPLY,
                 "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}");
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n{}");
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\n folded: header\r\n\r\n{}");
  EXPECT_BAD(ACT_REPLY, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk");
  EXPECT_BAD(ACT_REPLY,
             "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n123456789abcdef01\r\n", "chunk");
  /* A chunk announced larger than any reply: it would be refused as it
   * arrives; it never does. */
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7fffffff\r\n");
  EXPECT_BOUNDED(ACT_REPLY, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}xx");
  /* Headers that never end: libcurl stops at its own bound. */
  char *longh = malloc(400 << 10);
  memset(longh, 'a', 400 << 10);
  memcpy(longh, "HTTP/1.1 200 OK\r\nX: ", 20);
  longh[(400 << 10) - 1] = '\0';
  EXPECT_BOUNDED(ACT_REPLY, keep(longh));
  /* An endless chunked body: refused at 8 MiB. */
  EXPECT_BAD(ACT_FLOOD, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
             "larger than 8 MiB");
}

TEST(malformed_json) {
  static const char *const bodies[] = {
      "{\"kvs\":[{]}",
      "{\"a\":01}",
      "{\"a\":\"\x01\"}",
      "{\"a\":1}x",
      "{\"a\":\"\\q\"}",
      "{\"a\":\"\\u12\"}",
      "{\"a\":tru}",
      "{\"a\":1,}",
      "{\"a\" 1}",
      "[]",
      "",
      "{\"a\":\"x}",
      "{\"a\":-}",
      "{\"a\":1.}",
      "{\"a\":1e}",
  };
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(bodies); i++)
    EXPECT_BAD(ACT_REPLY, reply("200 OK", bodies[i]), "malformed JSON");
  /* Nesting far deeper than the scanner follows: refused, no crash. */
  size_t n = 200000;
  char *deep = malloc(n + 1);
  memset(deep, '[', n);
  deep[n] = '\0';
  EXPECT_BAD(ACT_REPLY, reply("200 OK", deep), "malformed JSON");
  free(deep);
  deep = malloc(n + 1);
  for (size_t i = 0; i < n; i += 5) memcpy(deep + i, "{\"a\":", 5);
  deep[n] = '\0';
  EXPECT_BAD(ACT_REPLY, reply("200 OK", deep), "malformed JSON");
  free(deep);
}

TEST(bad_values) {
  char err[700];
  double ms;
  static const struct {
    const char *json, *want;
  } cases[] = {
      {"\"aGVsbG8\"", "base64"},
      {"\"aGVsbG8*\"", "base64"},
      {"\"aGVsbG9=\"", "base64"},
      {"\"a=Vs\"", "base64"},
      {"\"AA==\"", "NUL"},
      {"5", "not a string"},
      {"\"\\u0000AAA\"", "malformed JSON"},
  };
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(cases); i++) {
    ASSERT_EQ(get_with(ACT_REPLY, range_reply(cases[i].json), 500, err, sizeof err, &ms, NULL), -1);
    ASSERT_CONTAINS(err, cases[i].want);
  }
  ASSERT_EQ(
      get_with(ACT_REPLY, reply("200 OK", HEADER ",\"kvs\":{}}"), 500, err, sizeof err, &ms, NULL),
      -1);
  ASSERT_CONTAINS(err, "not a list");
  ASSERT_EQ(
      get_with(ACT_REPLY, reply("200 OK", HEADER ",\"kvs\":[5]}"), 500, err, sizeof err, &ms, NULL),
      -1);
  ASSERT_CONTAINS(err, "not a list");
}

TEST(http_errors) {
  char err[700];
  double ms;
  /* etcd refusing the request: at once, with its message. */
  ASSERT_EQ(get_with(ACT_REPLY,
                     reply("400 Bad Request",
                           "{\"error\":\"etcdserver: request is too large\","
                           "\"message\":\"etcdserver: request is too large\",\"code\":3}"),
                     2000, err, sizeof err, &ms, NULL),
            -1);
  ASSERT_CONTAINS(err, "HTTP 400");
  ASSERT_CONTAINS(err, "etcdserver: request is too large");
  ASSERT_TRUE(ms < 500);
  ASSERT_EQ(get_with(ACT_REPLY,
                     reply("401 Unauthorized", "{\"message\":\"etcdserver: user name is empty\"}"),
                     2000, err, sizeof err, &ms, NULL),
            -1);
  ASSERT_CONTAINS(err, "authentication enabled");
  ASSERT_CONTAINS(err, "user=NAME");
  ASSERT_TRUE(ms < 500);
  /* Not etcd's gateway. */
  EXPECT_BAD(ACT_REPLY, reply("404 Not Found", "404 page not found\n"), "no etcd v3 JSON gateway");
  /* Unavailable (no leader): retried until the call's deadline. */
  ASSERT_EQ(get_with(ACT_REPLY,
                     reply("503 Service Unavailable",
                           "{\"error\":\"etcdserver: no leader\","
                           "\"message\":\"etcdserver: no leader\",\"code\":14}"),
                     400, err, sizeof err, &ms, NULL),
            -1);
  ASSERT_CONTAINS(err, "HTTP 503: etcdserver: no leader");
  ASSERT_CONTAINS(err, "no member answered within");
  if (ms < 350 || ms > 1000) HARNESS_FAIL("503s for %.0f ms, call timeout 400", ms);
}

TEST(silence_is_bounded) {
  char err[700];
  double ms;
  ASSERT_EQ(get_with(ACT_SILENT, NULL, 400, err, sizeof err, &ms, NULL), -1);
  ASSERT_CONTAINS(err, "no reply after");
  if (ms < 350 || ms > 1000) HARNESS_FAIL("silent server: %.0f ms, call timeout 400", ms);
  ASSERT_EQ(get_with(ACT_REPLY, HDR200 "Content-Length: 100\r\n\r\n{\"hea", 400, err, sizeof err,
                     &ms, NULL),
            -1);
  ASSERT_CONTAINS(err, "incomplete");
  if (ms < 350 || ms > 1000) HARNESS_FAIL("truncated reply: %.0f ms, call timeout 400", ms);
  /* Closing every connection at once: retried, bounded all the same. */
  ASSERT_EQ(get_with(ACT_CLOSE, NULL, 400, err, sizeof err, &ms, NULL), -1);
  ASSERT_CONTAINS(err, "closed the connection");
  if (ms > 1000) HARNESS_FAIL("closing server: %.0f ms, call timeout 400", ms);
}

TEST(nothing_listens) {
  /* Every member refuses: the call gives up after about a second, not at
   * its (long) deadline. */
  int p1 = 0, p2 = 0, f1 = chorus__net_listen("127.0.0.1", 0, 1, &p1),
      f2 = chorus__net_listen("127.0.0.1", 0, 1, &p2);
  ASSERT_TRUE(f1 >= 0 && f2 >= 0);
  close(f1);
  close(f2);
  char eps[128], err[700];
  snprintf(eps, sizeof eps, "127.0.0.1:%d,127.0.0.1:%d", p1, p2);
  kv_t *kv = NULL;
  double t = now_ms();
  ASSERT_EQ(kv_etcd_open(eps, "/t/", 10000, 10000, NULL, &kv, err, sizeof err), -1);
  double ms = now_ms() - t;
  ASSERT_TRUE(kv == NULL);
  ASSERT_CONTAINS(err, "Connection refused");
  ASSERT_CONTAINS(err, "endpoint health");
  if (ms < 900 || ms > 2500) HARNESS_FAIL("refused everywhere: %.0f ms", ms);
}

TEST(endpoint_lists) {
  static const struct {
    const char *list, *want;
  } cases[] = {
      {"", "empty entry"},
      {"127.0.0.1:1,,127.0.0.1:2", "empty entry"},
      {"ftp://127.0.0.1:2379", "not host:port"},
      {"127.0.0.1:99999", "not host:port"},
      {"127.0.0.1:", "not host:port"},
      {"::1:2379", "not host:port"},
      {"[::1", "not host:port"},
      {"user@host:1", "not host:port"},
      {"a:1,a:2,a:3,a:4,a:5,a:6,a:7,a:8,a:9,a:10,a:11,a:12,a:13,a:14,a:15,a:16,a:17",
       "more than 16"},
  };
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(cases); i++) {
    char err[700] = "";
    kv_t *kv = NULL;
    ASSERT_EQ(kv_etcd_open(cases[i].list, "/t/", 100, 100, NULL, &kv, err, sizeof err), -1);
    ASSERT_CONTAINS(err, cases[i].want);
  }
}

TEST(values_too_large) {
  /* A value this client could not read back is refused before sending. */
  fake_script(g_fake, ACT_REPLY, OK_EMPTY, -1);
  kv_t *kv = open_fake(g_fake, 500);
  ASSERT_TRUE(kv != NULL);
  size_t n = 7 << 20;
  char *big = malloc(n + 1);
  memset(big, 'x', n);
  big[n] = '\0';
  int before = g_fake->requests;
  ASSERT_EQ(kv->ops->set(kv, "k", big), -1);
  ASSERT_CONTAINS(kv->err, "more than this client reads back");
  ASSERT_EQ(kv->ops->cas(kv, "k", NULL, big), -1);
  ASSERT_EQ(g_fake->requests, before);
  free(big);
  ASSERT_EQ(kv->ops->set(kv, "k", "small"), 0);
  kv->ops->close(kv);
}

static int offline(void) {
  g_fake = fake_start();
  if (!g_fake) {
    fprintf(stderr, "cannot listen on 127.0.0.1\n");
    return 1;
  }
  RUN(get_plain_and_keepalive);
  RUN(get_chunked_escaped_spaced);
  RUN(get_absent_and_empty);
  RUN(set_and_cas_requests);
  RUN(cas_after_lost_reply);
  RUN(cas_member_killed_after_taking_it);
  RUN(stale_and_closed_connections);
  RUN(failover_past_dead_and_wrong);
  RUN(garbage_replies);
  RUN(malformed_json);
  RUN(bad_values);
  RUN(http_errors);
  RUN(silence_is_bounded);
  RUN(nothing_listens);
  RUN(endpoint_lists);
  RUN(values_too_large);
  fake_stop(g_fake);
  free_strs();
  return HARNESS_DONE();
}

/* ------------------------------------------------------------ real etcd */

static const char *g_endpoints;
static char g_prefix[128];
/* TLS and authentication for the real etcd, from the environment
 * (CHORUS_TEST_ETCD_CACERT, _CERT, _KEY, _USER, _PASSWORD_FILE). */
static kv_etcd_opts_t g_opts;

static void opts_from_env(void) {
  g_opts.cacert = getenv("CHORUS_TEST_ETCD_CACERT");
  g_opts.cert = getenv("CHORUS_TEST_ETCD_CERT");
  g_opts.key = getenv("CHORUS_TEST_ETCD_KEY");
  g_opts.user = getenv("CHORUS_TEST_ETCD_USER");
  g_opts.password_file = getenv("CHORUS_TEST_ETCD_PASSWORD_FILE");
}

static kv_t *open_real(const char *prefix, int call_ms) {
  kv_t *kv = NULL;
  char err[700];
  if (kv_etcd_open(g_endpoints, prefix, 10000, call_ms, &g_opts, &kv, err, sizeof err) != 0) {
    fprintf(stderr, "kv_etcd_open(%s): %s\n", g_endpoints, err);
    return NULL;
  }
  return kv;
}

#define OK(call)                              \
  do {                                        \
    if ((call) < 0) {                         \
      HARNESS_FAIL("%s: %s", #call, kv->err); \
      return;                                 \
    }                                         \
  } while (0)

static char *text_of(size_t n, unsigned seed) {
  char *s = malloc(n + 1);
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245 + 12345;
    s[i] = (char)(' ' + (seed >> 16) % 95);
  }
  s[n] = '\0';
  return s;
}

TEST(real_semantics) {
  kv_t *kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  char *v = NULL;
  ASSERT_EQ(kv->ops->get(kv, "a", &v), 0);
  ASSERT_TRUE(v == NULL);
  OK(kv->ops->set(kv, "a", "one"));
  ASSERT_EQ(kv->ops->get(kv, "a", &v), 1);
  ASSERT_STREQ(v, "one");
  free(v);
  /* cas: absent -> created; exists -> not; wrong expected -> not; right
   * expected -> swapped; expected on an absent key -> not, still absent. */
  ASSERT_EQ(kv->ops->cas(kv, "c", NULL, "first"), 1);
  ASSERT_EQ(kv->ops->cas(kv, "c", NULL, "again"), 0);
  ASSERT_EQ(kv->ops->cas(kv, "c", "wrong", "x"), 0);
  ASSERT_EQ(kv->ops->get(kv, "c", &v), 1);
  ASSERT_STREQ(v, "first");
  free(v);
  ASSERT_EQ(kv->ops->cas(kv, "c", "first", "second"), 1);
  ASSERT_EQ(kv->ops->get(kv, "c", &v), 1);
  ASSERT_STREQ(v, "second");
  free(v);
  ASSERT_EQ(kv->ops->cas(kv, "nothing", "x", "y"), 0);
  ASSERT_EQ(kv->ops->get(kv, "nothing", &v), 0);
  /* Empty values (etcd leaves "value" out), a cas from and to one. */
  OK(kv->ops->set(kv, "e", ""));
  ASSERT_EQ(kv->ops->get(kv, "e", &v), 1);
  ASSERT_STREQ(v, "");
  free(v);
  ASSERT_EQ(kv->ops->cas(kv, "e", "", "full"), 1);
  ASSERT_EQ(kv->ops->cas(kv, "e", "full", ""), 1);
  /* Keys and values with characters JSON and base64 care about. */
  const char *odd = "sp ace/\"quote\"\\back\tslash/é/+/=";
  OK(kv->ops->set(kv, odd, odd));
  ASSERT_EQ(kv->ops->get(kv, odd, &v), 1);
  ASSERT_STREQ(v, odd);
  free(v);
  /* Another prefix does not see these keys. */
  char other[160];
  snprintf(other, sizeof other, "%sother/", g_prefix);
  kv_t *kv2 = open_real(other, 5000);
  ASSERT_TRUE(kv2 != NULL);
  ASSERT_EQ(kv2->ops->get(kv2, "a", &v), 0);
  kv2->ops->close(kv2);
  char host[64];
  ASSERT_EQ(kv->ops->local_addr(kv, host, sizeof host), 0);
  ASSERT_STREQ(host, "127.0.0.1");
  kv->ops->close(kv);
}

TEST(real_large_values) {
  kv_t *kv = open_real(g_prefix, 10000);
  ASSERT_TRUE(kv != NULL);
  char *a = text_of(1 << 20, 1), *b = text_of(1 << 20, 2), *v = NULL;
  OK(kv->ops->set(kv, "big", a));
  ASSERT_EQ(kv->ops->get(kv, "big", &v), 1);
  ASSERT_TRUE(v && strlen(v) == strlen(a) && !strcmp(v, a));
  free(v);
  /* cas with 1 MiB on either side (both at once would pass etcd's 1.5 MiB
   * request limit). */
  ASSERT_EQ(kv->ops->cas(kv, "big", b, "small"), 0);
  ASSERT_EQ(kv->ops->cas(kv, "big", a, "small"), 1);
  ASSERT_EQ(kv->ops->cas(kv, "big", "small", b), 1);
  ASSERT_EQ(kv->ops->get(kv, "big", &v), 1);
  ASSERT_TRUE(v && !strcmp(v, b));
  free(v);
  free(a);
  free(b);
  a = text_of(1 << 20, 5);
  b = text_of(2 << 20, 6);
  b[(1 << 20) - 1] = '\0';                      /* 1 MiB - 1 byte of another text */
  ASSERT_EQ(kv->ops->cas(kv, "big", a, b), -1); /* 2 MiB of request */
  printf("  cas 1 MiB -> 1 MiB: %s\n", kv->err);
  free(a);
  free(b);
  /* Above etcd's --max-request-bytes (1.5 MiB) and above its gateway's 2
   * MiB: refused with etcd's words, and the client goes on. */
  a = text_of(1600 << 10, 3);
  ASSERT_EQ(kv->ops->set(kv, "huge", a), -1);
  printf("  1.6 MiB: %s\n", kv->err);
  ASSERT_CONTAINS(kv->err, "too large");
  free(a);
  a = text_of(2200 << 10, 4);
  ASSERT_EQ(kv->ops->set(kv, "huge", a), -1);
  printf("  2.2 MiB: %s\n", kv->err);
  ASSERT_CONTAINS(kv->err, "larger than max");
  free(a);
  ASSERT_EQ(kv->ops->get(kv, "huge", &v), 0);
  kv->ops->close(kv);
}

/* Two clients race to increment one counter with cas. */
typedef struct {
  int wins, losses, errors;
  char err[700];
} racer_t;

#define RACE_WINS 100

static void *racer(void *arg) {
  racer_t *r = arg;
  kv_t *kv = open_real(g_prefix, 5000);
  if (!kv) {
    r->errors++;
    return NULL;
  }
  while (r->wins < RACE_WINS && r->errors == 0) {
    char *v = NULL, next[32];
    if (kv->ops->get(kv, "counter", &v) != 1) {
      r->errors++;
      snprintf(r->err, sizeof r->err, "get: %s", kv->err);
      break;
    }
    snprintf(next, sizeof next, "%ld", atol(v) + 1);
    int rc = kv->ops->cas(kv, "counter", v, next);
    free(v);
    if (rc == 1)
      r->wins++;
    else if (rc == 0)
      r->losses++;
    else {
      r->errors++;
      snprintf(r->err, sizeof r->err, "cas: %s", kv->err);
    }
  }
  kv->ops->close(kv);
  return NULL;
}

TEST(real_cas_race) {
  kv_t *kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  ASSERT_EQ(kv->ops->cas(kv, "counter", NULL, "0"), 1);
  racer_t r[2];
  memset(r, 0, sizeof r);
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, racer, &r[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++)
    if (r[i].errors) HARNESS_FAIL("racer %d: %s", i, r[i].err);
  char *v = NULL;
  ASSERT_EQ(kv->ops->get(kv, "counter", &v), 1);
  ASSERT_EQ(atol(v), 2 * RACE_WINS);
  free(v);
  printf("  race: %d + %d swaps, %d + %d lost\n", r[0].wins, r[1].wins, r[0].losses, r[1].losses);
  kv->ops->close(kv);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void report(const char *what, double *us, int n) {
  double sum = 0;
  for (int i = 0; i < n; i++) sum += us[i];
  qsort(us, (size_t)n, sizeof *us, cmp_double);
  printf("  latency %-4s mean %6.0f us  p50 %6.0f us  p99 %6.0f us  (%d calls)\n", what, sum / n,
         us[n / 2], us[n * 99 / 100], n);
}

TEST(real_latency) {
  enum { N = 300 };
  kv_t *kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  static double get_us[N], cas_us[N], set_us[N];
  OK(kv->ops->set(kv, "lat", "0"));
  for (int i = 0; i < N; i++) {
    char cur[16], next[16], *v = NULL;
    snprintf(cur, sizeof cur, "%d", i);
    snprintf(next, sizeof next, "%d", i + 1);
    double t = now_ms();
    ASSERT_EQ(kv->ops->get(kv, "lat", &v), 1);
    get_us[i] = (now_ms() - t) * 1000;
    ASSERT_STREQ(v, cur);
    free(v);
    t = now_ms();
    ASSERT_EQ(kv->ops->cas(kv, "lat", cur, next), 1);
    cas_us[i] = (now_ms() - t) * 1000;
    t = now_ms();
    OK(kv->ops->set(kv, "lat2", next));
    set_us[i] = (now_ms() - t) * 1000;
  }
  report("get", get_us, N);
  report("cas", cas_us, N);
  report("set", set_us, N);
  kv->ops->close(kv);
}

/* ---------------------------------------------------- a member killed */

/* etcd's tokens expire after --auth-token-ttl without use: a client idle
 * longer than that must get a new one and go on. */
TEST(real_token_renewal) {
  int ttl = atoi(getenv("CHORUS_TEST_ETCD_TOKEN_TTL"));
  kv_t *kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  OK(kv->ops->set(kv, "token", "before"));
  sleep_ms(ttl * 1000 + 1500);
  char *v = NULL;
  OK(kv->ops->get(kv, "token", &v));
  ASSERT_STREQ(v, "before");
  free(v);
  OK(kv->ops->set(kv, "token", "after"));
  printf("  idle for %d s, longer than the token's %d s: renewed\n", ttl + 1, ttl);
  kv->ops->close(kv);
}

static const char *g_kill_cmd;
static volatile int g_killed;
static volatile double g_kill_at; /* when the kill command started */

static void *killer(void *arg) {
  sleep_ms(1000);
  g_kill_at = now_ms();
  int rc = system(g_kill_cmd);
  if (rc != 0) fprintf(stderr, "kill command exited %d: %s\n", rc, g_kill_cmd);
  g_killed = rc == 0 ? 1 : -1;
  return NULL;
}

TEST(real_member_killed) {
  kv_t *kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  ASSERT_EQ(kv->ops->cas(kv, "ctr", NULL, "0"), 1);
  pthread_t th;
  pthread_create(&th, NULL, killer, NULL);
  long i = 0;
  double worst = 0, worst_at = 0, end = 0;
  int failed = 0;
  /* Until 4 s after the kill: every call must succeed with the right
   * answer. */
  while (!failed && (end == 0 || now_ms() < end)) {
    if (g_killed && end == 0) end = now_ms() + 4000;
    char cur[32], next[32], *v = NULL, *none = NULL;
    snprintf(cur, sizeof cur, "%ld", i);
    snprintf(next, sizeof next, "%ld", i + 1);
    double t = now_ms();
    int rc;
    if ((rc = kv->ops->set(kv, "hb", next)) != 0 || (rc = kv->ops->get(kv, "hb", &v)) != 1 ||
        strcmp(v, next) || (rc = kv->ops->cas(kv, "ctr", cur, next)) != 1 ||
        (rc = kv->ops->cas(kv, "ctr", "wrong", "x")) != 0 ||
        (rc = kv->ops->get(kv, "absent", &none)) != 0) {
      HARNESS_FAIL("round %ld (%.0f ms after the kill started): rc %d, value '%s': %s", i,
                   g_kill_at ? now_ms() - g_kill_at : -1.0, rc, v ? v : "", kv->err);
      failed = 1;
    }
    free(v);
    free(none);
    double d = now_ms() - t;
    if (d > worst) {
      worst = d;
      worst_at = t;
    }
    i++;
  }
  pthread_join(th, NULL);
  ASSERT_EQ(g_killed, 1);
  ASSERT_TRUE(!failed);
  printf(
      "  %ld rounds (set, get, cas, cas, get), the slowest %.0f ms, starting %.0f ms after the "
      "kill (negative: before)\n",
      i, worst, worst_at - g_kill_at);
  char *v = NULL;
  ASSERT_EQ(kv->ops->get(kv, "ctr", &v), 1);
  ASSERT_EQ(atol(v), i);
  free(v);
  kv->ops->close(kv);
  /* A new client with the same list (one member dead) opens and works. */
  double t = now_ms();
  kv = open_real(g_prefix, 5000);
  ASSERT_TRUE(kv != NULL);
  ASSERT_EQ(kv->ops->get(kv, "ctr", &v), 1);
  ASSERT_EQ(atol(v), i);
  free(v);
  printf("  a new client: open and get in %.0f ms\n", now_ms() - t);
  kv->ops->close(kv);
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc == 1) return offline();
  if (argc < 3 || (strcmp(argv[1], "single") && strcmp(argv[1], "secure") && strcmp(argv[1], "cluster")) ||
      (!strcmp(argv[1], "cluster") && argc < 4)) {
    fprintf(stderr, "usage: %s [single|secure ENDPOINTS | cluster ENDPOINTS KILL-COMMAND]\n",
            argv[0]);
    return 2;
  }
  g_endpoints = argv[2];
  opts_from_env();
  snprintf(g_prefix, sizeof g_prefix, "/chorus-test/%d/%ld/", (int)getpid(), (long)now_ms());
  printf("etcd %s, keys under %s\n", g_endpoints, g_prefix);
  if (!strcmp(argv[1], "single")) {
    RUN(real_semantics);
    RUN(real_large_values);
    RUN(real_cas_race);
    RUN(real_latency);
  } else if (!strcmp(argv[1], "secure")) {
    /* Over TLS or with authentication (from the environment): what the
     * transport or a token could break, not sizes again. */
    RUN(real_semantics);
    RUN(real_cas_race);
    RUN(real_latency);
    if (g_opts.user && getenv("CHORUS_TEST_ETCD_TOKEN_TTL")) RUN(real_token_renewal);
  } else {
    g_kill_cmd = argv[3];
    RUN(real_member_killed);
  }
  return HARNESS_DONE();
}
