/*
 * test_ucx_strangers.c - strangers on the UCX channel (CHORUS_TRANSPORT=ucx).
 *
 * A UCX worker takes active messages from whoever has its address.  Four
 * ranks form a world over UCX, two per host (CHORUS_HOST_ID), so each has
 * a peer on shared memory and two over UCX.  Meanwhile this driver plays a
 * stranger who learned two ranks' worker addresses (through the store here,
 * standing for any leak): with a UCX worker of its own it sends them active
 * messages with chorus's id whose headers have every wrong shape -- too
 * short, too long, a sender rank out of range, this rank's own, a rank
 * shared memory carries (the channel has no UCX link for it), and right-
 * looking ones with random tokens, with and without payloads, small and
 * large (rendezvous).  Every rank must
 * stay up and finish its collectives with the right results: a stranger's
 * message is dropped unread.
 *
 *   test_ucx_strangers        exit 0 when every rank reported success
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include "child_store.h"
#include "harness.h"

#define N 4
#define SECRET "ucx-stranger-test-secret"
#define AM_ID 0u /* the channel's (src/transport/ucx_internal.h) */
#define AM_HDR 96

static pid_t g_store, g_pids[N];
static int g_fds[N];

static void cleanup(void) {
  children_kill(g_pids, g_fds, N);
  child_store_stop(&g_store);
}

static void rank_main(int rank, int port, int wfd) {
  char id[16];
  snprintf(id, sizeof id, "h%d", rank / 2);
  setenv("CHORUS_HOST_ID", id, 1);
  setenv("CHORUS_TRANSPORT", "ucx", 1);
  chorus_config_t cfg = child_config(rank, N, port, "u/", SECRET, 30000);
  chorus_comm_t comm = NULL;
  char line[1400];
  chorus_result_t st = chorus_comm_init(&cfg, &comm);
  if (st == CHORUS_OK) st = chorus_barrier(comm, NULL);
  /* The stranger sends while the ranks wait here and after. */
  struct timespec ts = {1, 500000000};
  nanosleep(&ts, NULL);
  enum { BIG = 100000 };
  float *a = malloc(BIG * sizeof(float));
  for (int round = 0; round < 3 && st == CHORUS_OK && a; round++) {
    for (size_t count = 1000; count <= BIG && st == CHORUS_OK; count *= 100) {
      for (size_t i = 0; i < count; i++) a[i] = (float)(rank + 1);
      st = chorus_all_reduce(comm, a, a, count, CHORUS_FLOAT32, CHORUS_SUM, NULL);
      for (size_t i = 0; i < count && st == CHORUS_OK; i++)
        if (a[i] != (float)(N * (N + 1) / 2)) st = CHORUS_ERR_INTERNAL;
    }
  }
  free(a);
  snprintf(line, sizeof line, "%d %s\n", (int)st,
           st == CHORUS_OK ? "ok" : comm ? chorus_comm_last_error(comm) : chorus_last_init_error());
  if (comm) chorus_comm_destroy(comm);
  (void)!write(wfd, line, strlen(line));
  _exit(st == CHORUS_OK ? 0 : 1);
}

/* The UCX address rank r published: the second field of its record
 * ("ADDR PORT|U<hex>|IDENT"). */
static int address_of(chorus_store_t *store, int r, uint8_t **out, size_t *len) {
  char key[64];
  snprintf(key, sizeof key, "u/addr/%d", r);
  void *val = NULL;
  size_t vlen = 0;
  for (int i = 0; i < 300 && chorus_store_get(store, key, &val, &vlen) != CHORUS_OK; i++) {
    struct timespec ts = {0, 100000000};
    nanosleep(&ts, NULL);
  }
  if (!val) return -1;
  char *rec = val, *f = strchr(rec, '|');
  char *end = f ? strchr(f + 1, '|') : NULL;
  if (!f || !end || f[1] != 'U') {
    chorus_free(val);
    return -1;
  }
  f += 2;
  size_t n = (size_t)(end - f) / 2;
  uint8_t *b = malloc(n);
  for (size_t i = 0; b && i < n; i++) {
    unsigned v;
    sscanf(f + 2 * i, "%2x", &v);
    b[i] = (uint8_t)v;
  }
  chorus_free(val);
  *out = b;
  *len = n;
  return b ? 0 : -1;
}

static uint64_t g_rng = 0x1234567887654321ull;
static uint8_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint8_t)g_rng;
}

/* Sends one active message and waits (bounded) until UCX is done with it. */
static void am(ucp_worker_h w, ucp_ep_h ep, unsigned id, const void *hdr, size_t hlen,
               const void *data, size_t len, unsigned flags) {
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = flags};
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, hdr, hlen, data, len, &prm);
  if (!UCS_PTR_IS_PTR(r)) return;
  /* A rendezvous the rank never fetches stays pending: that is its right. */
  for (int i = 0; i < 20000 && ucp_request_check_status(r) == UCS_INPROGRESS; i++)
    ucp_worker_progress(w);
  if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(w, r);
  ucp_request_free(r);
}

static int stranger(int port) {
  chorus_store_t *store = NULL;
  if (chorus_store_connect("127.0.0.1", port, SECRET, 10000, &store) != CHORUS_OK) return -1;
  ucp_config_t *conf;
  ucp_context_h ctx;
  ucp_worker_h w;
  ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  if (ucp_config_read(NULL, NULL, &conf) != UCS_OK) return -1;
  ucs_status_t st = ucp_init(&p, conf, &ctx);
  ucp_config_release(conf);
  if (st != UCS_OK || ucp_worker_create(ctx, &wp, &w) != UCS_OK) return -1;
  static uint8_t big[200000], hdr[4096];
  int sent = 0;
  for (int target = 0; target < N; target += 2) { /* rank 0 (host 0), rank 2 (host 1) */
    uint8_t *addr;
    size_t alen;
    if (address_of(store, target, &addr, &alen) < 0) return -1;
    ucp_ep_params_t ep_p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
                            .address = (const ucp_address_t *)addr};
    ucp_ep_h ep;
    if (ucp_ep_create(w, &ep_p, &ep) != UCS_OK) return -1;
    /* The sender ranks a header may claim: this rank, its shared-memory
     * peer, the two over UCX, and ranks that do not exist. */
    const uint32_t srcs[] = {(uint32_t)target, (uint32_t)(target ^ 1), (uint32_t)((target + 2) % N),
                             (uint32_t)((target + 3) % N), N, 0xffffffffu};
    for (size_t k = 0; k < sizeof srcs / sizeof srcs[0]; k++) {
      for (int shape = 0; shape < 6; shape++) {
        for (size_t i = 0; i < sizeof hdr; i++) hdr[i] = rnd();
        for (size_t i = 0; i < 64; i++) big[i] = rnd();
        for (int b = 0; b < 4; b++) hdr[56 + b] = (uint8_t)(srcs[k] >> (8 * b));
        hdr[60] = (uint8_t)(shape & 1); /* flags: a bare acknowledgement, or not */
        memset(hdr + 64, 0, 16);        /* sequence 0, acknowledging nothing */
        size_t len = shape < 2 ? 0 : shape < 4 ? 100 : sizeof big;
        am(w, ep, AM_ID, hdr, AM_HDR, big, len, len > 8192 ? UCP_AM_SEND_FLAG_RNDV : 0);
        sent++;
      }
    }
    /* Wrong header sizes.  (Not other ids: UCX 1.13 itself crashes on an
     * active message whose id has no handler -- its protocol trusts its
     * peers; docs/security.md.) */
    const size_t hlens[] = {0, 1, 56, AM_HDR - 1, AM_HDR + 1, 1024};
    for (size_t k = 0; k < sizeof hlens / sizeof hlens[0]; k++) {
      am(w, ep, AM_ID, hdr, hlens[k], big, 100, 0);
      am(w, ep, AM_ID, hdr, hlens[k], NULL, 0, 0);
      sent += 2;
    }
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &cp);
    if (UCS_PTR_IS_PTR(r)) {
      for (int i = 0; i < 10000 && ucp_request_check_status(r) == UCS_INPROGRESS; i++)
        ucp_worker_progress(w);
      ucp_request_free(r);
    }
    free(addr);
  }
  ucp_worker_destroy(w);
  ucp_cleanup(ctx);
  chorus_store_close(store);
  printf("stranger: sent %d active messages to ranks 0 and 2\n", sent);
  return 0;
}

TEST(strangers_are_dropped) {
  int port = child_store_start(SECRET, &g_store);
  ASSERT_TRUE(port > 0);
  for (int r = 0; r < N; r++) {
    int wfd = child_fork_reporting(&g_pids[r], &g_fds[r]);
    if (wfd >= 0) rank_main(r, port, wfd);
  }
  ASSERT_EQ(stranger(port), 0);
  for (int r = 0; r < N; r++) {
    char buf[1400] = "";
    size_t got = 0;
    struct pollfd pf = {.fd = g_fds[r], .events = POLLIN};
    double deadline = child_now_ms() + 60000;
    while (!memchr(buf, '\n', got) && child_now_ms() < deadline && got < sizeof buf - 1) {
      if (poll(&pf, 1, 1000) <= 0) continue;
      ssize_t k = read(g_fds[r], buf + got, sizeof buf - 1 - got);
      if (k <= 0) break;
      got += (size_t)k;
    }
    buf[got] = '\0';
    printf("  rank %d: %s", r, got ? buf : "(no report: died or hung)\n");
    ASSERT_TRUE(!strncmp(buf, "0 ok", 4));
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  atexit(cleanup);
  RUN(strangers_are_dropped);
  return HARNESS_DONE();
}
