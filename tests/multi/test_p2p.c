/*
 * test_p2p.c - point-to-point between the ranks of one host: which channel
 * carries it, that every peer is reached that way, and that a sender far
 * ahead of a slow receiver cannot make the receiver hold more than its
 * budget, and receives from any source.  Run by chorusrun with N >= 2 ranks
 * on one host.
 *
 *   test_p2p --expect-link PREFIX   every peer's link (chorus_comm_link)
 *                                   must start with PREFIX ("shm", "tcp",
 *                                   "ucx")
 *   test_p2p --lazy                 (CHORUS_TRANSPORT=tcp) connections are
 *                                   made on first use: after a ring
 *                                   all_reduce a rank is connected with its
 *                                   two neighbours only, after every pair
 *                                   exchanged (both ends dialling at once)
 *                                   with every peer, one main socket per
 *                                   pair, and each rank's piece connections
 *                                   (CHORUS_SOCKET_NSTREAMS) to each peer it
 *                                   sent a message over 1 MiB
 *   test_p2p --quick                the connection tests only, not the
 *                                   bulk ones (sanitizer builds: those are
 *                                   p2p_tcp's and p2p_streams')
 *
 * CHORUS_RECV_BUFFER_MAX should be set small (the CTest entries use 4 MiB):
 * rank 1 sends rank 0 BURST messages of MSG bytes (BURST * MSG = 32 times
 * the budget) while rank 0 sleeps; rank 0's peak resident memory may grow
 * by the budget, the ring and slack, not by what was sent.  Then rank 0
 * receives them all, in order, and checks every byte.  Then messages just
 * under the budget, each received a little late (receive_posted_mid_message).
 */
#include <dirent.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "harness.h"

static chorus_comm_t g_comm;
static int g_rank, g_size;
static const char *g_expect;
static int g_lazy, g_quick;

enum { MSG = 2 << 20, BURST = 64 }; /* over 1 MiB: in pieces between hosts */

static long peak_rss_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long v = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmHWM: %ld kB", &v) == 1) break;
  fclose(f);
  return v;
}

static void fill(unsigned char *p, size_t n, int k) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 31 + (size_t)k * 7 + 1);
}

/* This process's established TCP connections other than the one to the
 * store (MASTER_PORT): its data connections, finished or handshaking. */
static int data_sockets(void) {
  static unsigned long inodes[4096];
  int ni = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  struct dirent *e;
  char path[300], link[64];
  while ((e = readdir(d)) && ni < 4096) {
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(path, link, sizeof link - 1);
    if (k <= 0) continue;
    link[k] = '\0';
    if (sscanf(link, "socket:[%lu]", &inodes[ni]) == 1) ni++;
  }
  closedir(d);
  const char *mp = getenv("MASTER_PORT");
  unsigned store_port = mp ? (unsigned)atoi(mp) : 0;
  int n = 0;
  const char *tables[2] = {"/proc/self/net/tcp", "/proc/self/net/tcp6"};
  for (int t = 0; t < 2; t++) {
    FILE *f = fopen(tables[t], "r");
    if (!f) continue;
    char line[512];
    while (fgets(line, sizeof line, f)) {
      char local[64], remote[64];
      unsigned st;
      unsigned long inode;
      if (sscanf(line, " %*d: %63s %63s %x %*s %*s %*s %*s %*s %lu", local, remote, &st,
                 &inode) != 4 || st != 1 /* ESTABLISHED */)
        continue;
      const char *rp = strrchr(remote, ':');
      if (rp && strtoul(rp + 1, NULL, 16) == store_port) continue;
      for (int i = 0; i < ni; i++)
        if (inodes[i] == inode) {
          n++;
          break;
        }
    }
    fclose(f);
  }
  return n;
}

/* The peers this rank has a TCP connection with (bit per rank), and how
 * many. */
static int connected_peers(unsigned long long *mask) {
  int n = 0;
  *mask = 0;
  for (int p = 0; p < g_size; p++) {
    char link[256];
    if (p == g_rank || chorus_comm_link(g_comm, p, link, sizeof link) != CHORUS_OK) continue;
    if (!strncmp(link, "tcp ", 4) && link[4] != '(') {
      *mask |= 1ull << p;
      n++;
    }
  }
  return n;
}

/* Piece connections per rank and peer (CHORUS_SOCKET_NSTREAMS, as tcp_connect.c
 * clamps it). */
static int streams_per_pair(void) {
  const char *v = getenv("CHORUS_SOCKET_NSTREAMS");
  int k = v ? atoi(v) : 1;
  return k < 1 ? 1 : k > 16 ? 16 : k;
}

/* The data sockets once there are want: piece connections are dialled
 * after the first large message, and a peer's given-up crossing attempt
 * closes when its reset or end is read; give both a moment on a loaded
 * machine. */
static int data_sockets_settled(int want) {
  int sockets = data_sockets();
  for (int i = 0; i < 100 && sockets != want; i++) {
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
    sockets = data_sockets();
  }
  return sockets;
}

TEST(ring_connects_neighbours_only) {
  if (!g_lazy) return;
  ASSERT_TRUE(g_size >= 3 && g_size <= 64);
  ASSERT_EQ(chorus_comm_set_algo(g_comm, CHORUS_COLL_ALL_REDUCE, "ring"), CHORUS_OK);
  float v[64];
  for (int i = 0; i < 64; i++) v[i] = 1.0f;
  ASSERT_EQ(chorus_all_reduce(g_comm, v, v, 64, CHORUS_FLOAT32, CHORUS_SUM, NULL), CHORUS_OK);
  ASSERT_TRUE(v[0] == (float)g_size && v[63] == (float)g_size);
  unsigned long long mask;
  int n = connected_peers(&mask);
  int right = (g_rank + 1) % g_size, left = (g_rank + g_size - 1) % g_size;
  int sockets = data_sockets_settled(2);
  printf("rank %d: after a ring all_reduce of %d ranks: connected with %d peer(s), %d data "
         "socket(s)\n", g_rank, g_size, n, sockets);
  /* Nobody goes on (and connects to more peers) before every rank counted:
   * a second ring all_reduce ends nowhere before every rank entered it. */
  ASSERT_EQ(chorus_all_reduce(g_comm, v, v, 64, CHORUS_FLOAT32, CHORUS_SUM, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_comm_set_algo(g_comm, CHORUS_COLL_ALL_REDUCE, "auto"), CHORUS_OK);
  ASSERT_EQ(mask, (1ull << left) | (1ull << right));
  ASSERT_EQ(sockets, 2); /* small messages: no piece connections */
}

TEST(links_use_the_expected_channel) {
  if (!g_expect) return;
  for (int p = 0; p < g_size; p++) {
    if (p == g_rank) continue;
    char link[256];
    ASSERT_EQ(chorus_comm_link(g_comm, p, link, sizeof link), CHORUS_OK);
    if (strncmp(link, g_expect, strlen(g_expect))) {
      HARNESS_FAIL("rank %d reaches rank %d by '%s', expected '%s...'", g_rank, p, link, g_expect);
      return;
    }
  }
}

/* Every pair both ways, small and large, in a ring and back. */
TEST(every_pair_exchanges) {
  size_t sizes[] = {0, 8, 4096, 3 << 20};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    size_t n = sizes[s];
    unsigned char *out = malloc(n + 1), *in = malloc(n + 1);
    for (int d = 1; d < g_size; d++) {
      int to = (g_rank + d) % g_size, from = (g_rank - d + g_size) % g_size;
      fill(out, n, g_rank * 100 + d);
      chorus_work_t w;
      ASSERT_EQ(chorus_recv(g_comm, in, n, CHORUS_UINT8, from, d, &w), CHORUS_OK);
      ASSERT_EQ(chorus_send(g_comm, out, n, CHORUS_UINT8, to, d, NULL), CHORUS_OK);
      ASSERT_EQ(chorus_work_wait(w, -1), CHORUS_OK);
      chorus_work_free(w);
      fill(out, n, from * 100 + d);
      ASSERT_TRUE(memcmp(in, out, n) == 0);
    }
    free(out);
    free(in);
  }
  if (!g_lazy) return;
  /* Every pair dialled from both ends at once: still one connection each. */
  unsigned long long mask;
  int n = connected_peers(&mask);
  /* One main connection per pair, and each rank's piece connections to
   * each peer (its 3 MiB messages asked for them). */
  int k = streams_per_pair(), sockets = data_sockets_settled((g_size - 1) * (1 + 2 * k));
  printf("rank %d: after every pair exchanged: connected with %d peer(s), %d data socket(s)\n",
         g_rank, n, sockets);
  ASSERT_EQ(n, g_size - 1);
  ASSERT_EQ(sockets, (g_size - 1) * (1 + 2 * k));
}

/* Receives from any source (CHORUS_ANY_SOURCE): rank 0 takes K messages
 * from every other rank, half of its receives posted before the messages
 * come and half after they arrived (buffered; at 16 B), at 16 B and at
 * 2 MiB (in pieces where the link cuts large messages).  Each message is taken once,
 * chorus_work_source names its sender, and one sender's messages come in
 * the order it sent them.  Then the posting order between a receive from
 * any source and one from rank 1, both ways. */
enum { ANY_K = 4 };
static void any_source_round(size_t n, int tag) {
  int others = g_size - 1, total = others * ANY_K, small = n < 4096;
  if (g_rank != 0) {
    unsigned char *out = malloc(n);
    ASSERT_TRUE(out != NULL);
    ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
    for (int k = 0; k < ANY_K; k++) {
      memset(out, k, n);
      out[0] = (unsigned char)g_rank;
      ASSERT_EQ(chorus_send(g_comm, out, n, CHORUS_UINT8, 0, tag, NULL), CHORUS_OK);
    }
    if (small) ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
    free(out);
    return;
  }
  unsigned char *in = calloc((size_t)total, n);
  chorus_work_t *w = calloc((size_t)total, sizeof *w);
  int *next = calloc((size_t)g_size, sizeof *next);
  ASSERT_TRUE(in && w && next);
  int early = total / 2;
  for (int i = 0; i < early; i++)
    ASSERT_EQ(chorus_recv(g_comm, in + (size_t)i * n, n, CHORUS_UINT8, CHORUS_ANY_SOURCE, tag,
                          &w[i]), CHORUS_OK);
  ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
  /* Small ones: every message sent (buffered here) before the rest are
   * posted.  Large ones would exceed CHORUS_RECV_BUFFER_MAX: posted now. */
  if (small) ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
  for (int i = early; i < total; i++)
    ASSERT_EQ(chorus_recv(g_comm, in + (size_t)i * n, n, CHORUS_UINT8, CHORUS_ANY_SOURCE, tag,
                          &w[i]), CHORUS_OK);
  for (int i = 0; i < total; i++) {
    ASSERT_EQ(chorus_work_wait(w[i], -1), CHORUS_OK);
    unsigned char *m = in + (size_t)i * n;
    int src = chorus_work_source(w[i]);
    ASSERT_TRUE(src >= 1 && src < g_size);
    ASSERT_EQ((int)m[0], src);
    /* One sender's messages in its order: the k-th carries k. */
    ASSERT_EQ((int)m[n - 1], next[src]);
    next[src]++;
    chorus_work_free(w[i]);
  }
  for (int r = 1; r < g_size; r++) ASSERT_EQ(next[r], ANY_K);
  printf("rank 0: %d messages of %zu B from any source, each sender's in order\n", total, n);
  free(in);
  free(w);
  free(next);
}

TEST(any_source) {
  any_source_round(16, 20);
  any_source_round(2 << 20, 21);
  if (g_rank > 1) return;
  /* Posting order decides, whatever the receive's peer. */
  for (int any_first = 1; any_first >= 0; any_first--) {
    int tag = 22 + any_first;
    int64_t a = 0, b = 0;
    if (g_rank == 1) {
      int64_t va = 111, vb = 222;
      ASSERT_EQ(chorus_recv(g_comm, &a, 1, CHORUS_INT64, 0, tag, NULL), CHORUS_OK); /* go */
      ASSERT_EQ(chorus_send(g_comm, &va, 1, CHORUS_INT64, 0, tag, NULL), CHORUS_OK);
      ASSERT_EQ(chorus_send(g_comm, &vb, 1, CHORUS_INT64, 0, tag, NULL), CHORUS_OK);
      continue;
    }
    chorus_work_t wa, wb;
    ASSERT_EQ(chorus_recv(g_comm, &a, 1, CHORUS_INT64, any_first ? CHORUS_ANY_SOURCE : 1, tag,
                          &wa), CHORUS_OK);
    ASSERT_EQ(chorus_recv(g_comm, &b, 1, CHORUS_INT64, any_first ? 1 : CHORUS_ANY_SOURCE, tag,
                          &wb), CHORUS_OK);
    ASSERT_EQ(chorus_send(g_comm, &a, 1, CHORUS_INT64, 1, tag, NULL), CHORUS_OK);
    ASSERT_EQ(chorus_work_wait(wa, -1), CHORUS_OK);
    ASSERT_EQ(chorus_work_wait(wb, -1), CHORUS_OK);
    ASSERT_EQ(a, 111);
    ASSERT_EQ(b, 222);
    ASSERT_EQ(chorus_work_source(wa), 1);
    ASSERT_EQ(chorus_work_source(wb), 1);
    chorus_work_free(wa);
    chorus_work_free(wb);
  }
  /* A blocking one, and the wrong uses. */
  int64_t v = 7;
  if (g_rank == 1) ASSERT_EQ(chorus_send(g_comm, &v, 1, CHORUS_INT64, 0, 30, NULL), CHORUS_OK);
  else {
    v = 0;
    ASSERT_EQ(chorus_recv(g_comm, &v, 1, CHORUS_INT64, CHORUS_ANY_SOURCE, 30, NULL), CHORUS_OK);
    ASSERT_EQ(v, 7);
    ASSERT_EQ(chorus_send(g_comm, &v, 1, CHORUS_INT64, CHORUS_ANY_SOURCE, 30, NULL),
              CHORUS_ERR_INVALID_ARG);
    ASSERT_EQ(chorus_work_source(NULL), -1);
  }
}

/* Rank 1 sends burst messages of msg bytes at once while rank 0 sleeps;
 * rank 0's peak resident memory (its high-water mark reset first, where
 * the kernel allows) may grow by the budget, what a channel holds per peer
 * (the UCX channel: 256 eager messages of at most 8 KiB) and slack. */
static void far_ahead(size_t msg, int burst) {
  unsigned char *buf = malloc(msg);
  ASSERT_TRUE(buf != NULL);
  memset(buf, 0, msg); /* resident before the baseline */
  FILE *cr = fopen("/proc/self/clear_refs", "w");
  if (cr) {
    fputs("5", cr); /* resets VmHWM */
    fclose(cr);
  }
  ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
  long before = peak_rss_kib();
  if (g_rank == 1) {
    /* Everything at once, asynchronously: far more than rank 0 may hold. */
    unsigned char *src = malloc(msg * (size_t)burst);
    chorus_work_t *w = calloc((size_t)burst, sizeof *w);
    ASSERT_TRUE(src && w);
    for (int k = 0; k < burst; k++) {
      fill(src + (size_t)k * msg, msg, k);
      ASSERT_EQ(chorus_send(g_comm, src + (size_t)k * msg, msg, CHORUS_UINT8, 0, 7, &w[k]),
                CHORUS_OK);
    }
    for (int k = 0; k < burst; k++) {
      ASSERT_EQ(chorus_work_wait(w[k], -1), CHORUS_OK);
      chorus_work_free(w[k]);
    }
    free(w);
    free(src);
  } else {
    struct timespec ts = {1, 500000000}; /* let rank 1 run far ahead */
    nanosleep(&ts, NULL);
    long mid = peak_rss_kib();
    const char *b = getenv("CHORUS_RECV_BUFFER_MAX");
    long budget_kib = (b ? atol(b) : 64 << 20) / 1024;
    long grew = mid - before;
    printf("rank 0: peak RSS grew by %ld KiB while rank 1 sent %d messages of %zu KiB (%zu MiB) "
           "ahead (budget %ld KiB)\n", grew, burst, msg >> 10, (msg * (size_t)burst) >> 20,
           budget_kib);
    /* The budget, one message in flight past it, the rings and slack;
     * under TSan four times that (its shadow memory is resident too), or
     * CHORUS_TEST_SLACK times. */
    const char *sl = getenv("CHORUS_TEST_SLACK");
    long slack = sl && atol(sl) > 1 ? atol(sl) : 1;
#if defined(__SANITIZE_THREAD__)
    if (slack < 4) slack = 4;
#endif
    ASSERT_TRUE(grew < slack * (budget_kib + 2 * (long)(msg / 1024) + 16 * 1024));
    unsigned char *want = malloc(msg);
    for (int k = 0; k < burst; k++) {
      ASSERT_EQ(chorus_recv(g_comm, buf, msg, CHORUS_UINT8, 1, 7, NULL), CHORUS_OK);
      fill(want, msg, k);
      if (memcmp(buf, want, msg)) {
        HARNESS_FAIL("message %d of %zu bytes arrived wrong", k, msg);
        break;
      }
    }
    free(want);
  }
  free(buf);
  ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
}

TEST(sender_far_ahead_stays_bounded) {
  if (g_size < 2 || g_rank > 1) {
    for (int k = 0; k < 4; k++) ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
    return;
  }
  far_ahead(MSG, BURST);
  far_ahead(4096, 16384); /* small ones: eager over UCX, 16 times the budget */
}

/* fill() for large buffers: the pattern repeats every 256 bytes, so one
 * 64 KiB block copied over (cheap under the sanitizers, unlike a byte
 * loop); big_ok checks a buffer against it block by block. */
enum { BLOCK = 64 << 10 };
static void fill_big(unsigned char *p, size_t n, int k) {
  size_t first = n < BLOCK ? n : BLOCK;
  fill(p, first, k);
  for (size_t off = first; off < n; off += BLOCK)
    memcpy(p + off, p, n - off < BLOCK ? n - off : BLOCK);
}
static int big_ok(const unsigned char *p, size_t n, int k) {
  static unsigned char ref[BLOCK];
  fill(ref, BLOCK, k);
  for (size_t off = 0; off < n; off += BLOCK)
    if (memcmp(p + off, ref, n - off < BLOCK ? n - off : BLOCK)) return 0;
  return 1;
}

/* A receive posted while its message is arriving: the bytes buffered so far
 * are copied and the rest of the payload lands in the receive's buffer
 * (endpoint_match.c).  Rank 1 sends messages just under the budget (so they are
 * buffered, not held back) in pieces (over 1 MiB); rank 0 posts each
 * receive after a delay from 0 to 4 ms, so some arrive whole first, some
 * are caught part way (at a ragged edge with several piece connections)
 * and some after the receive; every byte is checked. */
TEST(receive_posted_mid_message) {
  const char *b = getenv("CHORUS_RECV_BUFFER_MAX");
  size_t budget = b ? (size_t)atol(b) : (size_t)64 << 20;
  size_t msg = budget - budget / 8;
  if (msg > (24u << 20)) msg = 24u << 20;
  unsigned char *buf = malloc(msg);
  ASSERT_TRUE(buf != NULL);
  static const long delay_us[] = {0, 200, 500, 1000, 2000, 4000};
  int rounds = (int)(sizeof delay_us / sizeof delay_us[0]) * 3;
  for (int k = 0; k < rounds; k++) {
    ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
    if (g_size < 2 || g_rank > 1) continue;
    if (g_rank == 1) {
      fill_big(buf, msg, k);
      ASSERT_EQ(chorus_send(g_comm, buf, msg, CHORUS_UINT8, 0, 20 + k, NULL), CHORUS_OK);
    } else {
      long us = delay_us[k % (int)(sizeof delay_us / sizeof delay_us[0])];
      struct timespec ts = {0, us * 1000};
      nanosleep(&ts, NULL);
      memset(buf, 0xee, msg);
      ASSERT_EQ(chorus_recv(g_comm, buf, msg, CHORUS_UINT8, 1, 20 + k, NULL), CHORUS_OK);
      if (!big_ok(buf, msg, k)) {
        HARNESS_FAIL("message %d of %zu bytes, received %ld us late, arrived wrong", k, msg, us);
      }
    }
  }
  free(buf);
  ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
}

/* Whether process pid is stopped (state T in /proc). */
static int is_stopped(pid_t pid) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  int stopped = 0;
  if (fgets(line, sizeof line, f)) {
    const char *rp = strrchr(line, ')'); /* the name may hold spaces */
    stopped = rp && rp[1] == ' ' && (rp[2] == 'T' || rp[2] == 't');
  }
  fclose(f);
  return stopped;
}

/* Over TCP a large message on one communicator does not hold up a small
 * one on another.  Rank 1 posts both receives and stops itself (SIGSTOP);
 * rank 0 sends 256 MiB on the world, then 8 bytes on a second
 * communicator, and waits up to 2 s for the small send to complete, then
 * resumes rank 1.  The large message travels on rank 0's piece connections
 * and cannot complete while rank 1 reads nothing (far more than the
 * sockets buffer); the small one's bytes go on the main connection behind
 * the large one's header only, so its send completes at once.  Whole
 * messages in order would keep it behind 256 MiB nobody reads. */
TEST(small_overtakes_large) {
  enum { BIG = 256 << 20 };
  chorus_comm_t other;
  ASSERT_EQ(chorus_comm_split(g_comm, 0, g_rank, &other), CHORUS_OK);
  char link[256] = "";
  int tcp = 0, ucx = 0;
  if (g_rank <= 1 && g_size >= 2) {
    ASSERT_EQ(chorus_comm_link(g_comm, 1 - g_rank, link, sizeof link), CHORUS_OK);
    tcp = strstr(link, "tcp") == link;
    ucx = strstr(link, "ucx") == link;
  }
  /* Over UCX the large message waits at the sender (rendezvous) and the
   * small one goes by itself: the same must hold. */
  if (g_rank <= 1 && g_size >= 2 && (tcp || ucx)) {
    unsigned char *big = malloc(BIG), small[8];
    ASSERT_TRUE(big != NULL);
    chorus_work_t wb, ws;
    int pid = (int)getpid();
    if (g_rank == 0) {
      ASSERT_EQ(chorus_recv(g_comm, &pid, 1, CHORUS_INT32, 1, 9, NULL), CHORUS_OK);
      fill_big(big, BIG, 3);
      fill(small, sizeof small, 4);
      /* A first message over 1 MiB has this rank dial its piece connections
       * (it goes whole itself): wait until the link says they are up. */
      ASSERT_EQ(chorus_send(g_comm, big, 2 << 20, CHORUS_UINT8, 1, 10, NULL), CHORUS_OK);
      for (int i = 0; i < 1000 && tcp; i++) {
        int up = -1, of = -2;
        ASSERT_EQ(chorus_comm_link(g_comm, 1, link, sizeof link), CHORUS_OK);
        const char *at = strstr(link, "piece connections ");
        if (at && sscanf(at, "piece connections %d of %d", &up, &of) == 2 && up == of && up > 0)
          break;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
      }
      int token;
      ASSERT_EQ(chorus_recv(g_comm, &token, 1, CHORUS_INT32, 1, 8, NULL), CHORUS_OK);
      /* rank 1 posted its receives and stops now */
      for (int i = 0; i < 500 && !is_stopped((pid_t)pid); i++) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
      }
      ASSERT_TRUE(is_stopped((pid_t)pid));
      ASSERT_EQ(chorus_send(g_comm, big, BIG, CHORUS_UINT8, 1, 11, &wb), CHORUS_OK);
      struct timespec ts = {0, 100000000}; /* the queued send is on its way */
      nanosleep(&ts, NULL);
      ASSERT_EQ(chorus_send(other, small, sizeof small, CHORUS_UINT8, 1, 12, &ws), CHORUS_OK);
      chorus_result_t st = CHORUS_INPROGRESS;
      for (int i = 0; i < 200 && st == CHORUS_INPROGRESS; i++) {
        struct timespec t10 = {0, 10000000};
        nanosleep(&t10, NULL);
        st = chorus_work_test(ws);
      }
      chorus_result_t stb = chorus_work_test(wb);
      kill((pid_t)pid, SIGCONT);
      ASSERT_EQ(chorus_work_wait(ws, -1), CHORUS_OK);
      ASSERT_EQ(chorus_work_wait(wb, -1), CHORUS_OK);
      chorus_work_free(ws);
      chorus_work_free(wb);
      printf("rank 0: with rank 1 stopped, 8 bytes on another communicator %s behind a 256 MiB "
             "message (%s)\n", st == CHORUS_OK ? "were sent" : "were stuck",
             stb == CHORUS_INPROGRESS ? "still in flight" : "complete");
      ASSERT_EQ(st, CHORUS_OK);
      ASSERT_EQ(stb, CHORUS_INPROGRESS);
    } else {
      ASSERT_EQ(chorus_send(g_comm, &pid, 1, CHORUS_INT32, 0, 9, NULL), CHORUS_OK);
      ASSERT_EQ(chorus_recv(g_comm, big, 2 << 20, CHORUS_UINT8, 0, 10, NULL), CHORUS_OK);
      ASSERT_EQ(chorus_recv(g_comm, big, BIG, CHORUS_UINT8, 0, 11, &wb), CHORUS_OK);
      ASSERT_EQ(chorus_recv(other, small, sizeof small, CHORUS_UINT8, 0, 12, &ws), CHORUS_OK);
      ASSERT_EQ(chorus_send(g_comm, &pid, 1, CHORUS_INT32, 0, 8, NULL), CHORUS_OK);
      raise(SIGSTOP); /* rank 0 resumes it */
      ASSERT_EQ(chorus_work_wait(ws, -1), CHORUS_OK);
      ASSERT_EQ(chorus_work_wait(wb, -1), CHORUS_OK);
      chorus_work_free(ws);
      chorus_work_free(wb);
      unsigned char want[8];
      fill(want, sizeof want, 4);
      ASSERT_TRUE(memcmp(small, want, sizeof want) == 0);
      /* The large one whole, every piece in its place. */
      ASSERT_TRUE(big_ok(big, BIG, 3));
    }
    free(big);
  }
  ASSERT_EQ(chorus_barrier(g_comm, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_comm_destroy(other), CHORUS_OK);
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--expect-link") && i + 1 < argc) g_expect = argv[++i];
    else if (!strcmp(argv[i], "--lazy")) g_lazy = 1;
    else if (!strcmp(argv[i], "--quick")) g_quick = 1;
    else {
      fprintf(stderr, "usage: test_p2p [--expect-link PREFIX] [--lazy] [--quick]\n");
      return 2;
    }
  }
  chorus_result_t st = chorus_comm_init_env(&g_comm);
  if (st != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(g_comm);
  g_size = chorus_comm_size(g_comm);
  RUN(ring_connects_neighbours_only);
  RUN(links_use_the_expected_channel);
  RUN(every_pair_exchanges);
  RUN(any_source);
  if (!g_quick) {
    RUN(sender_far_ahead_stays_bounded);
    RUN(small_overtakes_large);
    RUN(receive_posted_mid_message);
  }
  chorus_comm_destroy(g_comm);
  return HARNESS_DONE();
}
