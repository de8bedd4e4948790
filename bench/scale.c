/*
 * scale.c - chorus-scale: P ranks forming a world against a real store,
 * played by the library's own formation code (store/rendezvous.c) from a
 * few processes, so that thousands of ranks can be measured on one
 * machine.
 *
 *   chorus-scale [-p PROCS] [-t THREADS] [-l RANKS_PER_HOST] [-k PEERS]
 *                [-r REPEATS] [-o OPS_MAX] [-m MAX_SECONDS] [-R] P [P ...]
 *
 * Per P and repetition: a fresh store (chorus's server) in a process of
 * its own; PROCS client processes of THREADS threads, each thread playing
 * a block of ranks.  Every rank has its own authenticated connection,
 * leaving from its host's loopback address (127.2.0.1 and on, L ranks per
 * host, as the ranks of one real host share an address), and goes
 * through the steps a rank of chorus_comm_init goes through:
 *   connect   the connection and the store's handshake;
 *   world id  rank 0 sets it, the others read it (build_world_id);
 *   join      its record published and itself counted in
 *             (chorus__rdzv_join_begin);
 *   formed    the last rank's count read (chorus__rdzv_join_end);
 *   dial      the records of k peers read (chorus__rdzv_record): ring
 *             neighbours, then ranks 2, 4, 8... away, as a tree or
 *             recursive doubling dials them.
 * A thread runs each step for all its ranks before the next (a rank's
 * step that waits for the others -- world id, formed -- returns at once
 * for all but the first), so the store sees every rank's operations in
 * the order a real world makes them, P connections open at once.
 *
 * With -R, rank 0 is a real one: a process that calls
 * chorus_comm_init_env() with chorusrun's variables (its node the first of
 * P / L), forms the world with the others and reports what forming it
 * added to its resident set -- the per-world state of a rank of a world
 * of P, measured.  It touches no peer (a collective would wait for ranks
 * that are only played, and so does a world on one host, which makes its
 * shared-memory segment at init: -R needs P above L).
 *
 * One line per P, medians: seconds from the start to a formed world and
 * to the last record read, store operations and bytes per rank (counted
 * by the store itself), the store's CPU seconds and peak RSS.  The exit
 * status is 1 when a world did not form, when (-o) operations per rank
 * exceed OPS_MAX + k (issue 45's target: 4 + k), or when (-m) the median
 * world took more than MAX_SECONDS to form (the suite's bench.scale).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/rendezvous.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"

/* Where chorus_comm_init_env() puts a first generation's keys. */
#define PREFIX "chorus/r0/"
#define SECRET "chorus-scale"
#define JOB_ID "scale"
#define STEPS 5
static const char *const g_step_name[STEPS] = {"connect", "world id", "join", "formed", "dial"};

typedef struct {
  int procs, threads, per_host, k, repeats;
  long ops_max;
  int timeout_ms;
  double max_s;
  int real; /* -R: rank 0 is a real rank */
} opts_t;

static opts_t g_o = {4, 8, 64, 2, 3, -1, 120000, 0, 0};
static chorus__key_t g_key;

/* ---------------------------------------------------------- the store */

typedef struct {
  pid_t pid;
  int port, cmd_fd, ans_fd;
} store_proc_t;

/* The store's process: serves until told; answers 's' with its counts. */
static void store_main(int cmd_fd, int ans_fd) {
  chorus_store_server_t *srv = NULL;
  int port = -1;
  if (chorus__store_server_start_key("127.0.0.1", 0, &g_key, &srv) == CHORUS_OK)
    port = chorus_store_server_port(srv);
  if (write(ans_fd, &port, sizeof port) != sizeof port || port < 0) _exit(1);
  char c;
  while (read(cmd_fd, &c, 1) == 1 && c == 's') {
    chorus__store_stats_t s;
    chorus__store_server_stats(srv, &s);
    if (write(ans_fd, &s, sizeof s) != sizeof s) break;
  }
  chorus_store_server_stop(srv);
  _exit(0);
}

static int store_start(store_proc_t *sp) {
  int cmd[2], ans[2];
  if (pipe(cmd) < 0 || pipe(ans) < 0) return -1;
  sp->pid = fork();
  if (sp->pid < 0) return -1;
  if (sp->pid == 0) {
    close(cmd[1]);
    close(ans[0]);
    store_main(cmd[0], ans[1]);
  }
  close(cmd[0]);
  close(ans[1]);
  sp->cmd_fd = cmd[1];
  sp->ans_fd = ans[0];
  return read(sp->ans_fd, &sp->port, sizeof sp->port) == sizeof sp->port && sp->port > 0 ? 0 : -1;
}

static int store_stats(store_proc_t *sp, chorus__store_stats_t *s) {
  return write(sp->cmd_fd, "s", 1) == 1 && read(sp->ans_fd, s, sizeof *s) == sizeof *s ? 0 : -1;
}

/* CPU seconds and peak RSS (MiB) of pid, from /proc. */
static void proc_usage(pid_t pid, double *cpu_s, double *rss_mib) {
  char path[64], buf[4096];
  *cpu_s = *rss_mib = 0;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f) {
    if (fgets(buf, sizeof buf, f)) {
      char *p = strrchr(buf, ')');
      unsigned long ut = 0, st = 0;
      if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) == 2)
        *cpu_s = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
    }
    fclose(f);
  }
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  f = fopen(path, "r");
  while (f && fgets(buf, sizeof buf, f)) {
    long kb;
    if (sscanf(buf, "VmHWM: %ld kB", &kb) == 1) *rss_mib = (double)kb / 1024.0;
  }
  if (f) fclose(f);
}

static void store_stop(store_proc_t *sp) {
  if (sp->pid <= 0) return;
  (void)!write(sp->cmd_fd, "q", 1);
  close(sp->cmd_fd);
  close(sp->ans_fd);
  int status;
  waitpid(sp->pid, &status, 0);
  sp->pid = 0;
}

/* --------------------------------------------------------- the ranks */

typedef struct {
  int first, count, size, port;
  uint64_t world;       /* the world id rank 0 set */
  chorus_store_t **c;   /* per rank of the block */
  int64_t *ticket;      /* per rank: the join counter as it left it */
  int64_t end[STEPS];   /* when the thread finished each step (monotonic ns) */
  int failed;
  char err[600];
} block_t;

/* The host (and so the source address) of rank r. */
static void source_of(int r, char *buf, size_t cap) {
  int h = r / g_o.per_host;
  snprintf(buf, cap, "127.%d.%d.%d", 2 + h / (254 * 256), (h / 254) % 256, 1 + h % 254);
}

static int fail(block_t *b, int r, const char *step, const char *why) {
  if (!b->failed) snprintf(b->err, sizeof b->err, "rank %d, %s: %s", r, step, why);
  b->failed = 1;
  return -1;
}

/* The ranks' k peers: r +- 1, then r + 2, 4, 8 ... (mod size). */
static int peer_of(int r, int i, int size) {
  if (i == 0) return (r + 1) % size;
  if (i == 1) return (r + size - 1) % size;
  long d = 1L << (i - 1);
  return (int)((r + d) % size);
}

/* "formed": the block's join ends, the last rank's first (the others'
 * reads wait for what it writes). */
static int join_ends(block_t *b, int64_t deadline) {
  char err[600] = "";
  for (int pass = 0; pass < 2; pass++)
    for (int j = 0; j < b->count; j++) {
      int last = (b->ticket[j] & CHORUS__RDZV_MAX_RANKS) == b->size;
      if (last != (pass == 0)) continue;
      int votes = 0;
      chorus_result_t st = chorus__rdzv_join_end(b->c[j], PREFIX, b->world, b->size,
                                                 b->ticket[j], deadline, &votes, err, sizeof err);
      if (st != CHORUS_OK) return fail(b, b->first + j, g_step_name[3], err);
    }
  return 0;
}

static int step(block_t *b, int s, int64_t deadline) {
  char err[600] = "", src[32], key[64];
  if (s == 3) return join_ends(b, deadline);
  for (int i = 0; i < b->count; i++) {
    const int r = b->first + i;
    chorus_store_t *c = b->c[i];
    chorus_result_t st = CHORUS_OK;
    if (s == 0) {
      source_of(r, src, sizeof src);
      st = chorus__store_connect_from("127.0.0.1", b->port, src, &g_key,
                                      chorus__ms_left_bound(deadline), &b->c[i]);
      if (st != CHORUS_OK) return fail(b, r, g_step_name[s], chorus__store_connect_error());
    } else if (s == 1) {
      snprintf(key, sizeof key, PREFIX "world_id");
      chorus__store_set_timeout(c, chorus__ms_left_bound(deadline));
      if (r == 0) {
        st = chorus_store_set(c, key, "5ca1e5ca1e5ca1e5", 16);
        b->world = 0x5ca1e5ca1e5ca1e5ull;
      } else {
        void *v = NULL;
        size_t len = 0;
        char id[20] = "";
        st = chorus_store_get(c, key, &v, &len);
        if (st == CHORUS_OK) memcpy(id, v, len < 16 ? len : 16);
        b->world = strtoull(id, NULL, 16);
        free(v);
      }
      if (st != CHORUS_OK) return fail(b, r, g_step_name[s], chorus_store_last_error(c));
    } else if (s == 2) {
      char rec[160];
      source_of(r, src, sizeof src);
      snprintf(rec, sizeof rec, "%s %d|-|id scale-host-%d", src, 20000 + r % 40000,
               r / g_o.per_host);
      st = chorus__rdzv_join_begin(c, PREFIX, b->world, r, b->size, rec, 0, deadline, &b->ticket[i],
                                   err, sizeof err);
      if (st != CHORUS_OK) return fail(b, r, g_step_name[s], err);
    } else {
      for (int p = 0; p < g_o.k && p < b->size - 1; p++) {
        char *rec = NULL;
        st = chorus__rdzv_record(c, PREFIX, peer_of(r, p, b->size),
                                 chorus__ms_left_bound(deadline), NULL, &rec, err, sizeof err);
        free(rec);
        if (st != CHORUS_OK) return fail(b, r, g_step_name[s], err);
      }
    }
  }
  return 0;
}

static void *block_main(void *arg) {
  block_t *b = arg;
  int64_t deadline = chorus__deadline_ms(g_o.timeout_ms);
  for (int s = 0; s < STEPS && !b->failed; s++) {
    step(b, s, deadline);
    b->end[s] = chorus__now_ns();
  }
  return NULL;
}

/* What a client process reports: one write, under PIPE_BUF, so that the
 * reports of several processes on one pipe never interleave. */
typedef struct {
  int64_t end[STEPS];
  char err[600];
} report_t;

/* A client process: its ranks [first, first + count) in THREADS blocks;
 * waits for the start, then reports each step's latest end and a failure
 * on out. */
static void client_main(int first, int count, int size, int port, int go_fd, int out_fd) {
  int nt = g_o.threads < count ? g_o.threads : count;
  block_t *b = calloc((size_t)nt, sizeof *b);
  pthread_t *th = calloc((size_t)nt, sizeof *th);
  for (int t = 0; t < nt; t++) {
    b[t].first = first + (int)((long)count * t / nt);
    b[t].count = first + (int)((long)count * (t + 1) / nt) - b[t].first;
    b[t].size = size;
    b[t].port = port;
    b[t].c = calloc((size_t)b[t].count, sizeof *b[t].c);
    b[t].ticket = calloc((size_t)b[t].count, sizeof *b[t].ticket);
  }
  char go;
  if (read(go_fd, &go, 1) != 1) _exit(2);
  for (int t = 0; t < nt; t++) pthread_create(&th[t], NULL, block_main, &b[t]);
  report_t rep;
  memset(&rep, 0, sizeof rep);
  for (int t = 0; t < nt; t++) {
    pthread_join(th[t], NULL);
    for (int s = 0; s < STEPS; s++) rep.end[s] = b[t].end[s] > rep.end[s] ? b[t].end[s] : rep.end[s];
    if (b[t].failed && !rep.err[0]) snprintf(rep.err, sizeof rep.err, "%s", b[t].err);
  }
  if (write(out_fd, &rep, sizeof rep) != sizeof rep) _exit(3);
  for (int t = 0; t < nt; t++)
    for (int i = 0; i < b[t].count; i++) chorus_store_close(b[t].c[i]);
  _exit(rep.err[0] ? 1 : 0);
}

/* ------------------------------------------------------ the real rank */

typedef struct {
  int64_t formed;          /* monotonic ns */
  long rss_before, rss_after, hwm; /* kB */
  char err[600];
} real_t;

static long status_kb(const char *field) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kb = -1;
  size_t n = strlen(field);
  while (f && fgets(line, sizeof line, f))
    if (!strncmp(line, field, n) && line[n] == ':') kb = strtol(line + n + 1, NULL, 10);
  if (f) fclose(f);
  return kb;
}

static void setenv_int(const char *name, long v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%ld", v);
  setenv(name, buf, 1);
}

/* Rank 0 of the world, for real: chorusrun's variables (its node holds
 * the first L ranks), chorus_comm_init_env(), what it added to the
 * resident set, destroy. */
static void real_main(int size, int port, int go_fd, int out_fd) {
  const int L = g_o.per_host < size ? g_o.per_host : size;
  char spec[64];
  if (size % L) snprintf(spec, sizeof spec, "%dx%d,%d", L, size / L, size % L);
  else snprintf(spec, sizeof spec, "%dx%d", L, size / L);
  setenv_int("RANK", 0);
  setenv_int("WORLD_SIZE", size);
  setenv_int("LOCAL_RANK", 0);
  setenv_int("LOCAL_WORLD_SIZE", L);
  setenv_int("GROUP_RANK", 0);
  setenv_int("GROUP_WORLD_SIZE", (size + L - 1) / L);
  setenv("CHORUS_NODE_SIZES", spec, 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv_int("MASTER_PORT", port);
  setenv("CHORUS_STORE_EXTERNAL", "1", 1);
  setenv("CHORUS_JOB_SECRET", SECRET, 1);
  setenv("CHORUS_JOB_ID", JOB_ID, 1);
  setenv_int("CHORUS_TIMEOUT", g_o.timeout_ms / 1000);
  real_t rep;
  memset(&rep, 0, sizeof rep);
  char go;
  if (read(go_fd, &go, 1) != 1) _exit(2);
  rep.rss_before = status_kb("VmRSS");
  chorus_comm_t comm = NULL;
  chorus_result_t st = chorus_comm_init_env(&comm);
  rep.formed = chorus__now_ns();
  rep.rss_after = status_kb("VmRSS");
  rep.hwm = status_kb("VmHWM");
  if (st != CHORUS_OK) snprintf(rep.err, sizeof rep.err, "real rank 0: %s", chorus_last_init_error());
  else chorus_comm_destroy(comm);
  (void)!write(out_fd, &rep, sizeof rep);
  _exit(st == CHORUS_OK ? 0 : 1);
}

typedef struct {
  double formed_s, dial_s, ops, bytes, cpu_s, rss_mib, step_s[STEPS];
  double real_s, real_rss_mib, real_grew_mib; /* -R */
  int ok;
  char err[700];
} result_t;

static int run_once(int size, result_t *res) {
  memset(res, 0, sizeof *res);
  store_proc_t sp = {0};
  if (store_start(&sp) < 0) {
    snprintf(res->err, sizeof res->err, "the store did not start");
    store_stop(&sp);
    return -1;
  }
  const int played = size - g_o.real, base = g_o.real; /* ranks the clients play */
  int procs = g_o.procs < played ? g_o.procs : played;
  int go[2], out[2], rout[2] = {-1, -1};
  if (pipe(go) < 0 || pipe(out) < 0 || (g_o.real && pipe(rout) < 0)) return -1;
  pid_t *pids = calloc((size_t)procs + 1, sizeof *pids);
  if (g_o.real) {
    pids[procs] = fork();
    if (pids[procs] == 0) {
      close(go[1]);
      close(rout[0]);
      real_main(size, sp.port, go[0], rout[1]);
    }
    close(rout[1]);
  }
  for (int p = 0; p < procs; p++) {
    int first = base + (int)((long)played * p / procs);
    int last = base + (int)((long)played * (p + 1) / procs);
    pids[p] = fork();
    if (pids[p] == 0) {
      close(go[1]);
      close(out[0]);
      client_main(first, last - first, size, sp.port, go[0], out[1]);
    }
  }
  close(go[0]);
  close(out[1]);
  usleep(200000); /* the clients' threads are made: time the ranks only */
  chorus__store_stats_t s0, s1;
  store_stats(&sp, &s0);
  int64_t t0 = chorus__now_ns();
  for (int p = 0; p < procs + g_o.real; p++) (void)!write(go[1], "g", 1);
  int64_t end[STEPS] = {0};
  res->ok = 1;
  for (int p = 0; p < procs; p++) {
    report_t rep;
    if (read(out[0], &rep, sizeof rep) != sizeof rep) {
      res->ok = 0;
      if (!res->err[0]) snprintf(res->err, sizeof res->err, "a client process died");
      continue;
    }
    for (int s = 0; s < STEPS; s++) end[s] = rep.end[s] > end[s] ? rep.end[s] : end[s];
    if (rep.err[0]) {
      res->ok = 0;
      if (!res->err[0]) snprintf(res->err, sizeof res->err, "%s", rep.err);
    }
  }
  if (g_o.real) {
    real_t rr;
    if (read(rout[0], &rr, sizeof rr) != sizeof rr) {
      res->ok = 0;
      snprintf(res->err, sizeof res->err, "the real rank died");
    } else if (rr.err[0]) {
      res->ok = 0;
      snprintf(res->err, sizeof res->err, "%s", rr.err);
    } else {
      res->real_s = (double)(rr.formed - t0) / 1e9;
      res->real_rss_mib = (double)rr.rss_after / 1024;
      res->real_grew_mib = (double)(rr.rss_after - rr.rss_before) / 1024;
    }
    close(rout[0]);
  }
  store_stats(&sp, &s1);
  proc_usage(sp.pid, &res->cpu_s, &res->rss_mib);
  for (int p = 0; p < procs + g_o.real; p++) waitpid(pids[p], NULL, 0);
  free(pids);
  close(go[1]);
  close(out[0]);
  store_stop(&sp);
  for (int s = 0; s < STEPS; s++) res->step_s[s] = (double)(end[s] - t0) / 1e9;
  res->formed_s = res->step_s[3] > res->real_s ? res->step_s[3] : res->real_s;
  res->dial_s = res->step_s[4];
  res->ops = (double)(s1.requests - s0.requests) / size;
  res->bytes = (double)(s1.bytes_in + s1.bytes_out - s0.bytes_in - s0.bytes_out) / size;
  return res->ok ? 0 : -1;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void usage(void) {
  fprintf(stderr, "usage: chorus-scale [-p PROCS] [-t THREADS] [-l RANKS_PER_HOST] [-k PEERS] "
                  "[-r REPEATS] [-o OPS_MAX] [-m MAX_SECONDS] [-R] P [P ...]\n");
  exit(2);
}

int main(int argc, char **argv) {
  int opt;
  while ((opt = getopt(argc, argv, "p:t:l:k:r:o:m:T:R")) != -1) {
    long v = optarg ? strtol(optarg, NULL, 10) : 0;
    if (v < 0 || v > 1 << 24) usage();
    switch (opt) {
      case 'p': g_o.procs = (int)(v ? v : 1); break;
      case 't': g_o.threads = (int)(v ? v : 1); break;
      case 'l': g_o.per_host = (int)(v ? v : 1); break;
      case 'k': g_o.k = (int)v; break;
      case 'r': g_o.repeats = (int)(v ? v : 1); break;
      case 'o': g_o.ops_max = v; break;
      case 'T': g_o.timeout_ms = (int)(v * 1000); break;
      case 'm': g_o.max_s = (double)v; break;
      case 'R': g_o.real = 1; break;
      default: usage();
    }
  }
  if (optind >= argc) usage();
  signal(SIGPIPE, SIG_IGN);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  chorus__job_key(SECRET, JOB_ID, &g_key);
  printf("# chorus-scale -p %d -t %d -l %d -k %d: medians of %d\n", g_o.procs, g_o.threads,
         g_o.per_host, g_o.k, g_o.repeats);
  printf("| P | formed (s) | +%d records (s) | store ops/rank | store bytes/rank | store CPU (s) | "
         "store peak RSS (MiB) |%s\n|---|---|---|---|---|---|---|%s\n", g_o.k,
         g_o.real ? " real rank 0: RSS (MiB) | added by forming (MiB) |" : "",
         g_o.real ? "---|---|" : "");
  int bad = 0;
  for (int a = optind; a < argc; a++) {
    int size = (int)strtol(argv[a], NULL, 10);
    if (size < 1 || size > CHORUS__RDZV_MAX_RANKS) usage();
    if (g_o.real && size <= g_o.per_host) {
      fprintf(stderr, "chorus-scale: -R needs more ranks than one host's %d (P=%d): a world on "
              "one host makes its shared-memory segment with a collective at init, which the "
              "played ranks cannot answer\n", g_o.per_host, size);
      bad = 1;
      continue;
    }
    double f[64], d[64], ops[64], by[64], cpu[64], rss[64], rr[64], rg[64];
    int n = 0, reps = g_o.repeats < 64 ? g_o.repeats : 64;
    for (int r = 0; r < reps; r++) {
      result_t res;
      if (run_once(size, &res) < 0) {
        fprintf(stderr, "chorus-scale: P=%d: %s\n", size, res.err);
        bad = 1;
        continue;
      }
      f[n] = res.formed_s, d[n] = res.dial_s, ops[n] = res.ops, by[n] = res.bytes;
      cpu[n] = res.cpu_s, rss[n] = res.rss_mib, rr[n] = res.real_rss_mib, rg[n] = res.real_grew_mib;
      n++;
      fprintf(stderr, "  P=%d run %d: steps (s from start):", size, r + 1);
      for (int s = 0; s < STEPS; s++) fprintf(stderr, " %s %.3f", g_step_name[s], res.step_s[s]);
      fprintf(stderr, "\n");
    }
    if (!n) {
      printf("| %d | failed | | | | | |\n", size);
      continue;
    }
    double mops = median(ops, n), mformed = median(f, n);
    printf("| %d | %.3f | %.3f | %.2f | %.0f | %.2f | %.1f |", size, mformed, median(d, n),
           mops, median(by, n), median(cpu, n), median(rss, n));
    if (g_o.real) printf(" %.1f | %.2f |", median(rr, n), median(rg, n));
    printf("\n");
    fflush(stdout);
    if (g_o.ops_max >= 0 && mops > (double)(g_o.ops_max + g_o.k)) {
      fprintf(stderr, "chorus-scale: P=%d: %.2f store operations per rank, more than %ld + %d\n",
              size, mops, g_o.ops_max, g_o.k);
      bad = 1;
    }
    if (g_o.max_s > 0 && mformed > g_o.max_s) {
      fprintf(stderr, "chorus-scale: P=%d: formed in %.2f s, more than %.0f s\n", size, mformed,
              g_o.max_s);
      bad = 1;
    }
  }
  return bad;
}
