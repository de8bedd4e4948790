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
 * and the client's CPU time per transfer (user and system, median) per GB
 * of SIZE: with bidir_reduce, about what a rank of a 2-rank ring all_reduce
 * of SIZE bytes must spend at least (it sends and receives SIZE bytes too,
 * and reduces half of them).
 *
 * Each side moves both directions on one thread (non-blocking sockets and
 * poll, as a rank's progress thread does), each direction on a connection
 * of its own (as chorus's piece connections are), with chorus's socket
 * buffer sizes (4 MiB).  No chorus code: the bound is the
 * kernel's and the CPU's.  Plain C: cc -O2 bench/tcp_bound.c -o tcp_bound
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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

/* CPU seconds of this process (user and system). */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
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
  int fd;     /* this side's sending connection; also the control one */
  int rx;     /* the connection it receives on (fd for one way) */
  size_t size, piece;
  int mode;
  float *src, *dst, *buf;
};

/* Both directions at once on this one thread, as a ring rank's progress
 * moves them: a non-blocking socket, poll, send what the socket takes,
 * receive what came -- in reduce mode piece by piece into buf, each piece
 * added into dst once complete. */
static void exchange(struct side *s) {
  size_t sent = 0, got = 0, in_piece = 0;
  int fl = fcntl(s->fd, F_GETFL), rfl = fcntl(s->rx, F_GETFL);
  fcntl(s->fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(s->rx, F_SETFL, rfl | O_NONBLOCK);
  while (sent < s->size || got < s->size) {
    struct pollfd p[2] = {{.fd = s->fd, .events = sent < s->size ? POLLOUT : 0},
                          {.fd = s->rx, .events = got < s->size ? POLLIN : 0}};
    if (poll(p, 2, -1) < 0) die("poll");
    while ((p[1].revents & POLLIN) && got < s->size) {
      ssize_t k;
      if (s->mode == M_REDUCE) {
        size_t want = s->size - got < s->piece ? s->size - got : s->piece;
        k = recv(s->rx, (char *)s->buf + in_piece, want - in_piece, 0);
        if (k > 0 && (in_piece += (size_t)k) == want) {
          float *d = s->dst + (got + (size_t)k - in_piece) / sizeof(float);
          for (size_t i = 0; i < want / sizeof(float); i++) d[i] += s->buf[i];
          in_piece = 0;
        }
      } else {
        k = recv(s->rx, (char *)s->dst + got, s->size - got, 0);
      }
      if (k == 0) die("recv: closed");
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        die("recv");
      }
      got += (size_t)k;
    }
    while ((p[0].revents & POLLOUT) && sent < s->size) {
      size_t n = s->size - sent < (1u << 20) ? s->size - sent : (1u << 20);
      ssize_t k = send(s->fd, (char *)s->src + sent, n, MSG_NOSIGNAL);
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        die("send");
      }
      sent += (size_t)k;
    }
  }
  fcntl(s->fd, F_SETFL, fl);
  fcntl(s->rx, F_SETFL, rfl);
}

/* One transfer in the given mode; returns seconds.  One way: the client
 * sends, the server receives; otherwise both do both. */
static double transfer(struct side *s, int is_server) {
  char go = 1;
  int ctl = is_server ? s->rx : s->fd; /* the client's sending connection */
  double t0 = now_s();
  if (s->mode != M_ONEWAY) exchange(s);
  else if (is_server) recv_all(ctl, s->dst, s->size);
  else send_all(ctl, s->src, s->size);
  /* A one-byte acknowledgement: the transfer ended at the far side too. */
  send_all(ctl, &go, 1);
  recv_all(ctl, &go, 1);
  return now_s() - t0;
}

/* The socket buffers chorus's TCP channel asks for (src/transport/tcp_connect.c),
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
  int fd, rx;
  size_t hdr[2] = {64u << 20, 256u << 10};
  if (is_server) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    set_bufs(l);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 2) < 0) die("listen");
    rx = accept(l, NULL, NULL);  /* the client's sending connection */
    fd = accept(l, NULL, NULL);  /* ours */
    if (rx < 0 || fd < 0) die("accept");
    close(l);
    recv_all(rx, hdr, sizeof hdr);
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
    rx = socket(AF_INET, SOCK_STREAM, 0);
    set_bufs(rx);
    if (connect(rx, res->ai_addr, res->ai_addrlen) < 0) die("connect");
    freeaddrinfo(res);
    send_all(fd, hdr, sizeof hdr);
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(rx, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  /* One way: the client's connection carries it (and the acknowledgements). */
  struct side s = {.fd = fd, .rx = rx, .size = hdr[0] & ~(size_t)3, .piece = hdr[1] & ~(size_t)3};
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
    double t[REPS + 1], c[REPS + 1];
    for (int r = 0; r <= REPS; r++) { /* the first one warms up */
      double c0 = cpu_s();
      t[r] = transfer(&s, is_server);
      c[r] = cpu_s() - c0;
    }
    qsort(t + 1, REPS, sizeof *t, cmp);
    qsort(c + 1, REPS, sizeof *c, cmp);
    if (!is_server)
      printf("mode=%s size=%zu piece=%zu MBps=%.0f cpu_s_per_GB=%.3f\n", names[mode], s.size,
             s.piece, s.size / t[1 + REPS / 2] / 1e6, c[1 + REPS / 2] / (s.size / 1e9));
  }
  close(fd);
  close(rx);
  return 0;
}
