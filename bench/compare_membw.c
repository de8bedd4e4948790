/* compare_membw.c - memory bandwidth for bench/compare's bound.
 *
 * Streams two kernels over buffers far larger than the caches, with 1 and 2
 * threads (each thread its own buffers):
 *   copy: memcpy(dst, src, B)        bytes moved = 2B (B read + B written)
 *   add : c[i] = a[i] + b[i] (float) bytes moved = 3B (2B read + B written)
 * and prints the aggregate bytes moved per second (best of REPS passes):
 *   MEMBW <kernel> <threads> <GB/s>
 * With 2 threads or more it also bounces one cache line between two threads
 * (neither pinned, like the ranks) and prints the round trip (best of 3):
 *   MEMBW pingpong 2 <ns>
 * On a VM that value tells where the two vCPUs sit: sharing a last-level
 * cache (short) or not (several times longer, while the 2-thread bandwidth
 * above rises: each then has memory of its own).
 * usage: compare_membw [MiB per buffer, default 128] [max threads, default 2]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REPS 5

static size_t nbytes;
static pthread_barrier_t bar;
static double t_start[2][64], t_end[2][64];

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

struct arg {
  int id;
  float *a, *b, *c;
};

static void *worker(void *p) {
  struct arg *g = p;
  size_t n = nbytes / sizeof(float);
  for (int r = 0; r < REPS; r++) {
    for (int k = 0; k < 2; k++) {
      pthread_barrier_wait(&bar);
      double t0 = now();
      if (k == 0)
        memcpy(g->c, g->a, nbytes);
      else
        for (size_t i = 0; i < n; i++) g->c[i] = g->a[i] + g->b[i];
      double t1 = now();
      pthread_barrier_wait(&bar);
      if (r == 0 || t1 - t0 < t_end[k][g->id] - t_start[k][g->id]) {
        t_start[k][g->id] = t0;
        t_end[k][g->id] = t1;
      }
    }
  }
  return NULL;
}

/* Cache-line ping-pong: thread 0 waits for even values and writes odd ones,
 * thread 1 the reverse, for PP_TRIPS round trips or PP_SECONDS (thread 0
 * looks at the clock every 1024 trips; a thread that is not running stalls
 * the other, which the time then shows). */
#define PP_TRIPS 200000L
#define PP_SECONDS 0.5
static _Alignas(128) long pp_word;
static _Alignas(128) volatile int pp_stop;
static double pp_t0, pp_t1;
static long pp_trips;

static void *pingpong(void *p) {
  long me = (long)(size_t)p;
  if (me == 0) pp_t0 = now();
  for (long v = me;; v += 2) {
    while (__atomic_load_n(&pp_word, __ATOMIC_ACQUIRE) != v)
      if (pp_stop) return NULL;
    if (me == 0 && (v / 2) % 1024 == 1023) {
      double t = now();
      if (v / 2 + 1 >= PP_TRIPS || t - pp_t0 > PP_SECONDS) {
        pp_t1 = t;
        pp_trips = v / 2 + 1;
        pp_stop = 1;
        return NULL;
      }
    }
    __atomic_store_n(&pp_word, v + 1, __ATOMIC_RELEASE);
  }
}

static double pingpong_ns(void) {
  pthread_t th[2];
  pp_word = 0;
  pp_stop = 0;
  for (long i = 0; i < 2; i++) pthread_create(&th[i], NULL, pingpong, (void *)(size_t)i);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  return (pp_t1 - pp_t0) / (double)pp_trips * 1e9;
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 128;
  int maxt = argc > 2 ? atoi(argv[2]) : 2;
  if (maxt < 1 || maxt > 64) maxt = 2;
  nbytes = mib << 20;
  for (int nt = 1; nt <= maxt; nt++) {
    pthread_t th[64];
    struct arg g[64];
    pthread_barrier_init(&bar, NULL, (unsigned)nt);
    for (int i = 0; i < nt; i++) {
      g[i].id = i;
      g[i].a = malloc(nbytes);
      g[i].b = malloc(nbytes);
      g[i].c = malloc(nbytes);
      if (!g[i].a || !g[i].b || !g[i].c) return 1;
      for (size_t j = 0; j < nbytes / sizeof(float); j++) {
        g[i].a[j] = (float)(j & 7);
        g[i].b[j] = 1.0f;
        g[i].c[j] = 0.0f;
      }
    }
    for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, worker, &g[i]);
    for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
    /* aggregate = all threads' bytes / the slowest thread's best time */
    for (int k = 0; k < 2; k++) {
      double worst = 0;
      for (int i = 0; i < nt; i++)
        if (t_end[k][i] - t_start[k][i] > worst) worst = t_end[k][i] - t_start[k][i];
      double moved = (double)nbytes * (k == 0 ? 2 : 3) * nt;
      printf("MEMBW %s %d %.3f\n", k == 0 ? "copy" : "add", nt, moved / worst / 1e9);
    }
    volatile float sink = 0;
    for (int i = 0; i < nt; i++) {
      sink += g[i].c[7];
      free(g[i].a);
      free(g[i].b);
      free(g[i].c);
    }
    pthread_barrier_destroy(&bar);
  }
  if (maxt >= 2) { /* the best of 3 */
    double best = pingpong_ns();
    for (int i = 0; i < 2; i++) {
      double x = pingpong_ns();
      if (x < best) best = x;
    }
    printf("MEMBW pingpong 2 %.1f\n", best);
  }
  return 0;
}
