/*
 * tcp_bound.c - what one TCP connection between two hosts can carry, as a
 * ceiling for a 2-host ring all_reduce: one way, both ways at once, and
 * both ways at once with the received bytes added into a destination
 * (what a ring rank does with every piece it receives).
 *
 *   tcp_bound server PORT                        (on host B)
 *   tcp_bound client HOST PORT [SIZE] [PIECE]    (on host A)
 *
 * SIZE: bytes per measured transfer (default 64M); PIECE: the unit received
 * and reduced at once (default 256K, cache-sized).  The client prints one
 * line per mode, the median of 5 transfers each way:
 *
 *   mode=oneway   MB/s (A -> B)
 *   mode=bidir    MB/s each way, both directions at once
 *   mode=bidir_reduce  MB/s each way, both directions at once, every piece
 *                 received into a PIECE-sized buffer and added (float32)
 *                 into a SIZE-sized destination before the next is read
 *
 * Each side sends on one thread and receives on another (as a rank's
 * progress would), over one connection with chorus's socket buffer sizes
 * (4 MiB).  No chorus code: the bound is the kernel's and the CPU's.
 * Plain C, pthreads: cc -O2 -pthread bench/tcp_bound.c -o tcp_bound
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { REPS = 5, M_ONEWAY = 0, M_BIDIR = 1, M_REDUCE = 2 };

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(1);
}

static void send_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n) {
    ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k <= 0) die("send");
    c += k;
    n -= (size_t)k;
  }
}

static void recv_all(int fd, void *p, size_t n) {
  char *c = p;
  while (n) {
    ssize_t k = recv(fd, c, n, 0);
    if (k <= 0) die("recv");
    c += k;
    n -= (size_t)k;
  }
}

struct side {
  int fd;
  size_t size, piece;
  int mode;
  float *src, *dst, *buf;
};

static void *sender(void *arg) {
  struct side *s = arg;
  send_all(s->fd, s->src, s->size);
  return NULL;
}

/* Receives size bytes; in reduce mode piece by piece into buf, each added
 * into dst before the next is read. */
static void receive(struct side *s) {
  if (s->mode != M_REDUCE) {
    recv_all(s->fd, s->dst, s->size);
    return;
  }
  for (size_t off = 0; off < s->size; off += s->piece) {
    size_t n = s->size - off < s->piece ? s->size - off : s->piece;
    recv_all(s->fd, s->buf, n);
    float *d = s->dst + off / sizeof(float);
    for (size_t i = 0; i < n / sizeof(float); i++) d[i] += s->buf[i];
  }
}

/* One transfer in the given mode; returns seconds.  sends: whether this
 * side sends (oneway: only the client). */
static double transfer(struct side *s, int sends, int receives) {
  char go = 1;
  /* Start together: the client says go, the server echoes. */
  double t0 = now_s();
  pthread_t th;
  if (sends && pthread_create(&th, NULL, sender, s) != 0) die("pthread_create");
  if (receives) receive(s);
  if (sends) pthread_join(th, NULL);
  /* A one-byte acknowledgement: the transfer ended at the far side too. */
  send_all(s->fd, &go, 1);
  recv_all(s->fd, &go, 1);
  return now_s() - t0;
}

/* The socket buffers chorus's TCP channel asks for (src/transport/tcp.c),
 * set before connecting so the window scale allows them. */
static void set_bufs(int fd) {
  int sz = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: tcp_bound server PORT | client HOST PORT [SIZE] [PIECE]\n");
    return 2;
  }
  int is_server = !strcmp(argv[1], "server");
  int fd;
  size_t hdr[2] = {64u << 20, 256u << 10};
  if (is_server) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    set_bufs(l);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 1) < 0) die("listen");
    fd = accept(l, NULL, NULL);
    if (fd < 0) die("accept");
    close(l);
    recv_all(fd, hdr, sizeof hdr);
  } else {
    if (argc < 4) return 2;
    if (argc > 4) hdr[0] = parse_size(argv[4]);
    if (argc > 5) hdr[1] = parse_size(argv[5]);
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
    if (getaddrinfo(argv[2], argv[3], &hints, &res) != 0) die("getaddrinfo");
    fd = -1;
    for (int tries = 0; tries < 100 && fd < 0; tries++) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      set_bufs(fd);
      if (connect(fd, res->ai_addr, res->ai_addrlen) < 0) {
        close(fd);
        fd = -1;
        usleep(100000);
      }
    }
    if (fd < 0) die("connect");
    freeaddrinfo(res);
    send_all(fd, hdr, sizeof hdr);
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  struct side s = {.fd = fd, .size = hdr[0] & ~(size_t)3, .piece = hdr[1] & ~(size_t)3};
  if (s.size == 0 || s.piece == 0 || s.size > ((size_t)1 << 32)) {
    fprintf(stderr, "tcp_bound: bad size %zu or piece %zu\n", s.size, s.piece);
    return 2;
  }
  s.src = malloc(s.size);
  s.dst = malloc(s.size);
  s.buf = malloc(s.piece);
  if (!s.src || !s.dst || !s.buf) die("malloc");
  for (size_t i = 0; i < s.size / sizeof(float); i++) s.src[i] = s.dst[i] = 1.0f;
  static const char *names[] = {"oneway", "bidir", "bidir_reduce"};
  for (int mode = M_ONEWAY; mode <= M_REDUCE; mode++) {
    s.mode = mode;
    double t[REPS + 1];
    for (int r = 0; r <= REPS; r++) /* the first one warms up */
      t[r] = transfer(&s, mode != M_ONEWAY || !is_server, mode != M_ONEWAY || is_server);
    qsort(t + 1, REPS, sizeof *t, cmp);
    if (!is_server)
      printf("mode=%s size=%zu piece=%zu MBps=%.0f\n", names[mode], s.size, s.piece,
             s.size / t[1 + REPS / 2] / 1e6);
  }
  close(fd);
  return 0;
}
