/*
 * chorus_bench.c - chorus-bench, a collective benchmark with the interface
 * and the output of nccl-tests, written against the public chorus.h only.
 *
 * Run it under chorusrun, one process per rank:
 *
 *   chorusrun --standalone -n 4 -- chorus-bench -b 8 -e 64M -f 2
 *   chorusrun --standalone -n 3 -- chorus-bench --all -e 1M -c 1
 *
 * For every message size from -b to -e (times -f, or plus -i) each rank
 * runs -w untimed warm-up calls, then -n timed calls of the collective, first
 * out-of-place, then in-place where the collective has an in-place form.
 * Rank 0 prints one row per size; see bench/README.md for the columns and
 * their formulas.  In short, following nccl-tests:
 *  - time   = (max over ranks of the rank's total time of the -n calls) / -n,
 *  - median = median over the -n calls of (max over ranks of that call),
 *  - algbw  = size / time,  busbw = algbw * factor(collective, n).
 *
 * Sizes follow nccl-tests: "size" is the largest buffer of the call, that is
 * the whole vector for all_reduce, reduce and broadcast, and the whole
 * n-block buffer for all_gather, reduce_scatter, all_to_all, scatter and
 * gather (each rank contributes or receives size/n).  Sizes are rounded
 * down to whole elements (and whole blocks of n elements); rows whose count
 * rounds to 0 still run (zero counts are legal) and report 0 GB/s.
 *
 * Checking (-c 1, the default): the inputs are small non-negative integers,
 * so every sum, product, minimum and maximum is exact in every dtype
 * (float16 and bfloat16 included), and the result of the last timed call of
 * each size is compared element by element with values computed locally
 * (avg with a relative tolerance).  The output buffer is filled with 0xff
 * bytes (NaN, or -1/255) before that call, so a call that writes nothing is
 * caught too.  Wrong elements are summed over ranks into the #wrong column,
 * and the exit status is 1 if any element was wrong.
 *
 * In-place calls of all_reduce, reduce, reduce_scatter and all_to_all
 * modify their input, so their in-place buffer is restored from a pristine
 * copy (untimed) before every call; that keeps the values bounded and every
 * call identical.  Broadcast, all_gather, scatter and gather read only what
 * they never overwrite: their buffer is restored once, and before the
 * checked call (measure()).
 *
 * Every chorus call is checked; on failure the reason
 * (chorus_comm_last_error or chorus_work_error) is printed, the communicator
 * is aborted and the process exits 1.  Usage errors exit 2.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* getopt_long, gethostname, clock_gettime */
#endif
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"

/* ------------------------------------------------------------- options */

/* The collectives chorus-bench knows, in the order --all runs them. */
static const chorus_coll_t k_colls[] = {
    CHORUS_COLL_ALL_REDUCE, CHORUS_COLL_BROADCAST,      CHORUS_COLL_REDUCE,
    CHORUS_COLL_ALL_GATHER, CHORUS_COLL_REDUCE_SCATTER, CHORUS_COLL_ALL_TO_ALL,
    CHORUS_COLL_SCATTER,    CHORUS_COLL_GATHER,         CHORUS_COLL_BARRIER,
};
#define NCOLLS ((int)(sizeof k_colls / sizeof k_colls[0]))

/* The reduction ops offered by -o (the bitwise ones are integer-only). */
static const chorus_op_t k_ops[] = {CHORUS_SUM, CHORUS_PROD, CHORUS_MIN, CHORUS_MAX, CHORUS_AVG};
#define NOPS ((int)(sizeof k_ops / sizeof k_ops[0]))

typedef struct {
  size_t min_bytes, max_bytes;
  size_t factor;    /* multiplicative step; 0 when stepping by increment */
  size_t increment; /* additive step (-i) */
  chorus_op_t op;
  chorus_dtype_t dtype;
  int root, iters, warmup, check, async, all, memalloc;
  int links;        /* --links: the pairwise matrix instead of a collective */
  int cpu;          /* --cpu: also the CPU time the timed calls took */
  const char *tune; /* --tune FILE: time every algorithm, write a tuning table */
  const char *algo; /* -a; NULL: the library's automatic choice */
  chorus_coll_t coll;
} opts_t;

static void usage(FILE *f) {
  fprintf(f,
          "usage: chorusrun [chorusrun options] -- chorus-bench [options]\n"
          "\n"
          "Benchmarks one chorus collective (or all of them) over a range of sizes,\n"
          "like nccl-tests.  Rank 0 prints the results.\n"
          "\n"
          "  -b, --minbytes SIZE      smallest size (default 8); K, M, G suffixes (x1024)\n"
          "  -e, --maxbytes SIZE      largest size (default 64M)\n"
          "  -f, --stepfactor N       multiply the size by N (>= 2) each step (default 2)\n"
          "  -i, --stepbytes SIZE     add SIZE each step instead of multiplying\n"
          "  -o, --op OP              sum, prod, min, max, avg (default sum)\n"
          "  -d, --datatype DTYPE     int8, uint8, int32, int64, float16, bfloat16,\n"
          "                           float32, float64 (default float32)\n"
          "  -r, --root ROOT          root of broadcast, reduce, scatter, gather (default 0)\n"
          "  -n, --iters N            timed iterations per size (default 20)\n"
          "  -w, --warmup_iters N     untimed iterations before them (default 5)\n"
          "  -c, --check 0|1          check the results (default 1)\n"
          "  -a, --algo NAME          force the algorithm (chorus_comm_set_algo); default: the\n"
          "                           library's choice, which CHORUS_ALGO and CHORUS_<COLL>_ALGO\n"
          "                           steer; the algo column names what ran\n"
          "  -C, --coll COLL          all_reduce (default), broadcast, reduce, all_gather,\n"
          "                           reduce_scatter, all_to_all, scatter, gather, barrier\n"
          "      --all                run every collective in turn\n"
          "  -z, --async 0|1          0: blocking calls (default); 1: async handles + wait\n"
          "  -m, --memalloc 0|1       1: buffers from chorus_mem_alloc (shared memory;\n"
          "                           all_reduce then skips every staging copy)\n"
          "      --cpu                after each row, the CPU time (every thread, user and\n"
          "                           system) the timed calls took, in seconds per GB of\n"
          "                           the size column, averaged over the ranks\n"
          "      --links              measure every pair of ranks instead: 8-byte one-way\n"
          "                           latency and bandwidth both ways (-e bytes, default\n"
          "                           4M, 5 times), print the matrices, name the slow\n"
          "                           links and the interface each pair uses\n"
          "      --tune FILE          time every algorithm of each collective (-C, or\n"
          "                           all_reduce, reduce_scatter, all_gather, broadcast,\n"
          "                           reduce) at every size and write the fastest as a\n"
          "                           tuning table for this kind of group and size to\n"
          "                           FILE (rank 0), for CHORUS_TUNING_FILE\n"
          "  -h, --help               this help\n"
          "\n"
          "Algorithms (-a) per collective:\n");
  for (int c = 0; c < NCOLLS; c++) {
    fprintf(f, "  %-15s", chorus_coll_name(k_colls[c]));
    for (int i = 0; chorus_algo_name(k_colls[c], i); i++)
      fprintf(f, " %s", chorus_algo_name(k_colls[c], i));
    fputc('\n', f);
  }
  fprintf(f,
          "With --all, -a applies to the collectives that have an algorithm of that\n"
          "name; the others use the automatic choice.\n"
          "\n"
          "Exit status: 0 if every call succeeded and every checked element was right,\n"
          "1 if a call failed or an element was wrong, 2 for a usage error.\n");
}

static void die_usage(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("chorus-bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs(" (-h for help)\n", stderr);
  va_end(ap);
  exit(2);
}

/* "64M", "1k", "4096", "2GiB": bytes, suffixes are powers of 1024. */
static int parse_size(const char *s, size_t *out) {
  if (!isdigit((unsigned char)*s)) return -1;
  errno = 0;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno) return -1;
  unsigned shift = 0;
  switch (toupper((unsigned char)*end)) {
    case 'K':
      shift = 10;
      break;
    case 'M':
      shift = 20;
      break;
    case 'G':
      shift = 30;
      break;
    case 'T':
      shift = 40;
      break;
    default:
      break;
  }
  if (shift) {
    end++;
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
  } else if (*end == 'b' || *end == 'B') {
    end++;
  }
  if (*end) return -1;
  if (shift && v > (SIZE_MAX >> shift)) return -1;
  if (v > SIZE_MAX) return -1;
  *out = (size_t)(v << shift);
  return 0;
}

static int parse_int(const char *s, int lo, int hi, int *out) {
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno || end == s || *end || v < lo || v > hi) return -1;
  *out = (int)v;
  return 0;
}

/* Compares names ignoring case, '_' and '-' ("allreduce" == "all_reduce"). */
static int name_eq(const char *a, const char *b) {
  for (;;) {
    while (*a == '_' || *a == '-') a++;
    while (*b == '_' || *b == '-') b++;
    if (tolower((unsigned char)*a) != tolower((unsigned char)*b)) return 0;
    if (!*a) return 1;
    a++, b++;
  }
}

static int algo_registered(chorus_coll_t coll, const char *name) {
  for (int i = 0; chorus_algo_name(coll, i); i++)
    if (strcmp(chorus_algo_name(coll, i), name) == 0) return 1;
  return 0;
}

static void parse_args(int argc, char **argv, opts_t *o) {
  *o = (opts_t){.min_bytes = 8,
                .max_bytes = (size_t)64 << 20,
                .factor = 2,
                .op = CHORUS_SUM,
                .dtype = CHORUS_FLOAT32,
                .root = 0,
                .iters = 20,
                .warmup = 5,
                .check = 1,
                .coll = CHORUS_COLL_ALL_REDUCE};
  enum { OPT_ALL = 1000, OPT_LINKS, OPT_TUNE, OPT_CPU };
  static const struct option longopts[] = {{"minbytes", required_argument, NULL, 'b'},
                                           {"maxbytes", required_argument, NULL, 'e'},
                                           {"stepfactor", required_argument, NULL, 'f'},
                                           {"stepbytes", required_argument, NULL, 'i'},
                                           {"op", required_argument, NULL, 'o'},
                                           {"datatype", required_argument, NULL, 'd'},
                                           {"root", required_argument, NULL, 'r'},
                                           {"iters", required_argument, NULL, 'n'},
                                           {"warmup_iters", required_argument, NULL, 'w'},
                                           {"check", required_argument, NULL, 'c'},
                                           {"algo", required_argument, NULL, 'a'},
                                           {"coll", required_argument, NULL, 'C'},
                                           {"async", required_argument, NULL, 'z'},
                                           {"memalloc", required_argument, NULL, 'm'},
                                           {"all", no_argument, NULL, OPT_ALL},
                                           {"links", no_argument, NULL, OPT_LINKS},
                                           {"cpu", no_argument, NULL, OPT_CPU},
                                           {"tune", required_argument, NULL, OPT_TUNE},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  int have_f = 0, have_i = 0, have_c = 0, have_e = 0, opt;
  while ((opt = getopt_long(argc, argv, "b:e:f:i:o:d:r:n:w:c:a:C:z:m:h", longopts, NULL)) != -1) {
    switch (opt) {
      case 'b':
        if (parse_size(optarg, &o->min_bytes)) die_usage("bad -b size '%s'", optarg);
        break;
      case 'e':
        if (parse_size(optarg, &o->max_bytes)) die_usage("bad -e size '%s'", optarg);
        have_e = 1;
        break;
      case 'f': {
        int f;
        if (parse_int(optarg, 2, 1 << 20, &f))
          die_usage("-f wants an integer >= 2, not '%s'", optarg);
        o->factor = (size_t)f;
        have_f = 1;
        break;
      }
      case 'i':
        if (parse_size(optarg, &o->increment) || o->increment == 0)
          die_usage("-i wants a size > 0, not '%s'", optarg);
        have_i = 1;
        break;
      case 'o': {
        int found = 0;
        for (int i = 0; i < NOPS; i++)
          if (name_eq(optarg, chorus_op_name(k_ops[i]))) o->op = k_ops[i], found = 1;
        if (!found) die_usage("unknown op '%s' (sum, prod, min, max, avg)", optarg);
        break;
      }
      case 'd': {
        static const struct {
          const char *alias;
          chorus_dtype_t dt;
        } aliases[] = {{"float", CHORUS_FLOAT32},  {"half", CHORUS_FLOAT16},
                       {"double", CHORUS_FLOAT64}, {"bf16", CHORUS_BFLOAT16},
                       {"fp16", CHORUS_FLOAT16},   {"fp32", CHORUS_FLOAT32},
                       {"fp64", CHORUS_FLOAT64}};
        int found = 0;
        for (int d = 0; d < CHORUS_DTYPE_COUNT; d++)
          if (name_eq(optarg, chorus_dtype_name((chorus_dtype_t)d)))
            o->dtype = (chorus_dtype_t)d, found = 1;
        for (size_t i = 0; !found && i < sizeof aliases / sizeof aliases[0]; i++)
          if (name_eq(optarg, aliases[i].alias)) o->dtype = aliases[i].dt, found = 1;
        if (!found) die_usage("unknown dtype '%s'", optarg);
        break;
      }
      case 'r':
        if (parse_int(optarg, 0, 1 << 30, &o->root)) die_usage("bad root '%s'", optarg);
        break;
      case 'n':
        if (parse_int(optarg, 1, 1 << 30, &o->iters))
          die_usage("-n wants an integer >= 1, not '%s'", optarg);
        break;
      case 'w':
        if (parse_int(optarg, 0, 1 << 30, &o->warmup))
          die_usage("-w wants an integer >= 0, not '%s'", optarg);
        break;
      case 'c':
        if (parse_int(optarg, 0, 1, &o->check)) die_usage("-c wants 0 or 1, not '%s'", optarg);
        break;
      case 'z':
        if (parse_int(optarg, 0, 1, &o->async)) die_usage("-z wants 0 or 1, not '%s'", optarg);
        break;
      case 'm':
        if (parse_int(optarg, 0, 1, &o->memalloc)) die_usage("-m wants 0 or 1, not '%s'", optarg);
        break;
      case 'a':
        o->algo = (strcmp(optarg, "auto") == 0) ? NULL : optarg;
        break;
      case 'C': {
        int found = 0;
        for (int c = 0; c < NCOLLS; c++)
          if (name_eq(optarg, chorus_coll_name(k_colls[c]))) o->coll = k_colls[c], found = 1;
        if (!found) die_usage("unknown collective '%s'", optarg);
        have_c = 1;
        break;
      }
      case OPT_ALL:
        o->all = 1;
        break;
      case OPT_LINKS:
        o->links = 1;
        break;
      case OPT_CPU:
        o->cpu = 1;
        break;
      case OPT_TUNE:
        o->tune = optarg;
        break;
      case 'h': {
        /* Under chorusrun every rank gets -h; let rank 0 alone print it. */
        const char *rank = getenv("RANK");
        if (!rank || strcmp(rank, "0") == 0) usage(stdout);
        exit(0);
      }
      default:
        die_usage("bad option");
    }
  }
  if (optind < argc) die_usage("unexpected argument '%s'", argv[optind]);
  if (have_f && have_i) die_usage("-f and -i are alternatives; give one");
  if (have_i) o->factor = 0;
  if (have_c && o->all) die_usage("-C and --all are alternatives; give one");
  if (o->links && (o->all || have_c || o->memalloc))
    die_usage("--links measures point-to-point links: no -C, --all or -m with it");
  if (o->links && !have_e) o->max_bytes = (size_t)4 << 20;
  if (o->tune && (o->links || o->all || o->algo))
    die_usage("--tune times every algorithm itself: no --links, --all or -a with it");
  if (o->tune && !have_c) o->coll = (chorus_coll_t)-1; /* the tunable set */
  if (o->min_bytes > o->max_bytes)
    die_usage("-b %zu is larger than -e %zu", o->min_bytes, o->max_bytes);
  if (o->algo && !o->all && !algo_registered(o->coll, o->algo)) {
    fprintf(stderr, "chorus-bench: %s has no algorithm '%s'; it has:", chorus_coll_name(o->coll),
            o->algo);
    for (int i = 0; chorus_algo_name(o->coll, i); i++)
      fprintf(stderr, " %s", chorus_algo_name(o->coll, i));
    fputc('\n', stderr);
    exit(2);
  }
}

/* --------------------------------------------------------- the bench state */

typedef struct {
  opts_t o;
  chorus_comm_t comm;
  int rank, n;
  size_t es;        /* element size of o.dtype */
  size_t cap;       /* bytes in each of a and b */
  unsigned char *a; /* out-of-place: send buffer; in-place: pristine copy */
  unsigned char *b; /* out-of-place: receive buffer; in-place: the buffer */
  double *times;    /* 2 + 2 * iters: totals, then per-call times */
} bench_t;

/* Buffers and counts of one collective at one size.  count is the count
 * argument of the call; bytes and elems are the size and count columns. */
typedef struct {
  chorus_coll_t coll;
  size_t count;
  size_t bytes, elems;
  size_t oop_send, oop_recv; /* elements this rank's out-of-place buffers use */
  size_t ip_elems;           /* elements of the in-place buffer */
} geom_t;

static int coll_has_op(chorus_coll_t c) {
  return c == CHORUS_COLL_ALL_REDUCE || c == CHORUS_COLL_REDUCE || c == CHORUS_COLL_REDUCE_SCATTER;
}
static int coll_has_root(chorus_coll_t c) {
  return c == CHORUS_COLL_BROADCAST || c == CHORUS_COLL_REDUCE || c == CHORUS_COLL_SCATTER ||
         c == CHORUS_COLL_GATHER;
}
/* Broadcast has one buffer (root's is the source): that is the in-place
 * form, and there is no out-of-place one.  Barrier has neither. */
static int coll_has_oop(chorus_coll_t c) {
  return c != CHORUS_COLL_BROADCAST;
}
static int coll_has_ip(chorus_coll_t c) {
  return c != CHORUS_COLL_BARRIER;
}

/* busbw = algbw * factor: nccl-tests' doc/PERFORMANCE.md. */
static double bus_factor(chorus_coll_t c, int n) {
  switch (c) {
    case CHORUS_COLL_ALL_REDUCE:
      return 2.0 * (n - 1) / n;
    case CHORUS_COLL_ALL_GATHER:
    case CHORUS_COLL_REDUCE_SCATTER:
    case CHORUS_COLL_ALL_TO_ALL:
    case CHORUS_COLL_SCATTER:
    case CHORUS_COLL_GATHER:
      return (double)(n - 1) / n;
    case CHORUS_COLL_BROADCAST:
    case CHORUS_COLL_REDUCE:
      return 1.0;
    default:
      return 0.0;
  }
}

static geom_t geometry(const bench_t *b, chorus_coll_t coll, size_t size) {
  geom_t g = {.coll = coll};
  size_t n = (size_t)b->n, total = size / b->es;
  int root = b->rank == b->o.root;
  switch (coll) {
    case CHORUS_COLL_ALL_REDUCE:
    case CHORUS_COLL_REDUCE:
    case CHORUS_COLL_BROADCAST:
      g.count = total;
      g.elems = total;
      g.oop_send = g.oop_recv = g.ip_elems = total;
      break;
    case CHORUS_COLL_ALL_GATHER:
    case CHORUS_COLL_REDUCE_SCATTER:
    case CHORUS_COLL_ALL_TO_ALL:
    case CHORUS_COLL_SCATTER:
    case CHORUS_COLL_GATHER:
      g.count = total / n; /* per rank (per block) */
      g.elems = g.count * n;
      g.ip_elems = g.elems;
      g.oop_send = g.oop_recv = g.elems;
      if (coll == CHORUS_COLL_ALL_GATHER || coll == CHORUS_COLL_GATHER) g.oop_send = g.count;
      if (coll == CHORUS_COLL_REDUCE_SCATTER || coll == CHORUS_COLL_SCATTER) g.oop_recv = g.count;
      if (coll == CHORUS_COLL_SCATTER && !root) g.oop_send = 0;
      if (coll == CHORUS_COLL_GATHER && !root) g.oop_recv = 0;
      break;
    default:
      break; /* barrier: no data */
  }
  g.bytes = g.elems * b->es;
  return g;
}

/* ------------------------------------------------------------- failures */

static void fail_call(bench_t *b, const char *what, chorus_result_t rc, const char *reason) {
  fprintf(stderr, "chorus-bench: rank %d: %s failed: %s: %s\n", b->rank, what,
          chorus_result_name(rc), reason && *reason ? reason : chorus_strerror(rc));
  fflush(stderr);
  chorus_comm_abort(b->comm); /* tells the peers now, instead of at their timeout */
  chorus_comm_destroy(b->comm);
  exit(1);
}

static void check_rc(bench_t *b, chorus_result_t rc, const char *what) {
  if (rc != CHORUS_OK) fail_call(b, what, rc, chorus_comm_last_error(b->comm));
}

/* Rank 0 prints; flushed per line, so rows show up as they are measured. */
static void say(const bench_t *b, const char *fmt, ...) {
  if (b->rank != 0) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

/* ------------------------------------------------------ element values */

static uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
  if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0)); /* inf, NaN */
  int e = (int)exp - 127 + 15;
  if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow: inf */
  if (e <= 0) {                                   /* subnormal or zero */
    if (e < -10) return (uint16_t)sign;
    man |= 0x800000u;
    unsigned shift = (unsigned)(14 - e);
    uint32_t h = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++; /* may carry into inf: right */
  return (uint16_t)(sign | h);
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
  if (exp == 0x1f) {
    x = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (!man) {
      x = sign;
    } else { /* normalise the subnormal */
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while (!(man & 0x400u));
      x = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    x = sign | ((exp - 15 + 127) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN */
  x += 0x7fffu + ((x >> 16) & 1u);                                           /* round to even */
  return (uint16_t)(x >> 16);
}

static float bf16_to_float(uint16_t h) {
  uint32_t x = (uint32_t)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static void put(void *buf, size_t i, chorus_dtype_t dt, double v) {
  switch (dt) {
    case CHORUS_INT8:
      ((int8_t *)buf)[i] = (int8_t)v;
      break;
    case CHORUS_UINT8:
      ((uint8_t *)buf)[i] = (uint8_t)v;
      break;
    case CHORUS_INT32:
      ((int32_t *)buf)[i] = (int32_t)v;
      break;
    case CHORUS_INT64:
      ((int64_t *)buf)[i] = (int64_t)v;
      break;
    case CHORUS_FLOAT16:
      ((uint16_t *)buf)[i] = float_to_half((float)v);
      break;
    case CHORUS_BFLOAT16:
      ((uint16_t *)buf)[i] = float_to_bf16((float)v);
      break;
    case CHORUS_FLOAT32:
      ((float *)buf)[i] = (float)v;
      break;
    case CHORUS_FLOAT64:
      ((double *)buf)[i] = v;
      break;
    default:
      break;
  }
}

static double get(const void *buf, size_t i, chorus_dtype_t dt) {
  switch (dt) {
    case CHORUS_INT8:
      return ((const int8_t *)buf)[i];
    case CHORUS_UINT8:
      return ((const uint8_t *)buf)[i];
    case CHORUS_INT32:
      return ((const int32_t *)buf)[i];
    case CHORUS_INT64:
      return (double)((const int64_t *)buf)[i];
    case CHORUS_FLOAT16:
      return half_to_float(((const uint16_t *)buf)[i]);
    case CHORUS_BFLOAT16:
      return bf16_to_float(((const uint16_t *)buf)[i]);
    case CHORUS_FLOAT32:
      return ((const float *)buf)[i];
    case CHORUS_FLOAT64:
      return ((const double *)buf)[i];
    default:
      return NAN;
  }
}

static int is_float(chorus_dtype_t dt) {
  return dt == CHORUS_FLOAT16 || dt == CHORUS_BFLOAT16 || dt == CHORUS_FLOAT32 ||
         dt == CHORUS_FLOAT64;
}

/* Input of the reductions at element i of rank r's vector: 0..3, different
 * between neighbouring ranks, so min, max and sum all depend on the
 * position.  For prod, 1 or 2 with at most one 2 per element (rank i mod n),
 * so the product is 1 or 2 whatever the group size. */
static double red_val(chorus_op_t op, int n, int r, size_t i) {
  if (op == CHORUS_PROD) return ((i % (size_t)n) == (size_t)r && (i / (size_t)n) % 3 != 0) ? 2 : 1;
  return (double)((i % 7) % 3 + ((i + (size_t)r) & 1));
}

/* op over every rank of red_val(., i). */
static double red_expected(chorus_op_t op, chorus_dtype_t dt, int n, size_t i) {
  double acc = red_val(op, n, 0, i);
  for (int r = 1; r < n; r++) {
    double v = red_val(op, n, r, i);
    switch (op) {
      case CHORUS_PROD:
        acc *= v;
        break;
      case CHORUS_MIN:
        acc = v < acc ? v : acc;
        break;
      case CHORUS_MAX:
        acc = v > acc ? v : acc;
        break;
      default:
        acc += v;
        break; /* sum, avg */
    }
  }
  if (op == CHORUS_AVG) acc = is_float(dt) ? acc / n : floor(acc / n); /* sums are >= 0 */
  return acc;
}

/* Payload of the data-moving collectives: 0..100, exact in every dtype. */
static double mov_val(int r, size_t i) {
  return (double)(((size_t)r * 37 + i * 11 + 5) % 101);
}

/* Fills this rank's input: buf gets the input of the call (at the offset the
 * in-place form wants when inplace) and 0xff bytes everywhere else. */
static void fill_input(const bench_t *b, const geom_t *g, unsigned char *buf, int inplace) {
  chorus_dtype_t dt = b->o.dtype;
  size_t c = g->count, n = (size_t)b->n, r = (size_t)b->rank;
  size_t elems = inplace ? g->ip_elems : g->oop_send;
  memset(buf, 0xff, elems * b->es);
  switch (g->coll) {
    case CHORUS_COLL_ALL_REDUCE:
    case CHORUS_COLL_REDUCE:
      for (size_t i = 0; i < c; i++) put(buf, i, dt, red_val(b->o.op, b->n, b->rank, i));
      break;
    case CHORUS_COLL_REDUCE_SCATTER:
      for (size_t i = 0; i < n * c; i++) put(buf, i, dt, red_val(b->o.op, b->n, b->rank, i));
      break;
    case CHORUS_COLL_BROADCAST:
      if (b->rank == b->o.root)
        for (size_t i = 0; i < c; i++) put(buf, i, dt, mov_val(b->rank, i));
      break;
    case CHORUS_COLL_ALL_GATHER:
    case CHORUS_COLL_GATHER: {
      void *at = buf + (inplace ? r * c * b->es : 0);
      for (size_t i = 0; i < c; i++) put(at, i, dt, mov_val(b->rank, i));
      break;
    }
    case CHORUS_COLL_ALL_TO_ALL:
      for (size_t i = 0; i < n * c; i++) put(buf, i, dt, mov_val(b->rank, i));
      break;
    case CHORUS_COLL_SCATTER:
      if (b->rank == b->o.root)
        for (size_t i = 0; i < n * c; i++) put(buf, i, dt, mov_val(b->rank, i));
      break;
    default:
      break;
  }
}

/* Elements of this rank's result that differ from the expected values. */
static int64_t count_wrong(const bench_t *b, const geom_t *g, int inplace) {
  chorus_dtype_t dt = b->o.dtype;
  chorus_op_t op = b->o.op;
  size_t c = g->count, n = (size_t)b->n, r = (size_t)b->rank;
  int is_root = b->rank == b->o.root;
  const unsigned char *res = b->b; /* both forms leave their result in b */
  double tol = 0;
  if (op == CHORUS_AVG && coll_has_op(g->coll))
    tol = dt == CHORUS_FLOAT16    ? 1e-3
          : dt == CHORUS_BFLOAT16 ? 1e-2
          : dt == CHORUS_FLOAT32  ? 1e-6
                                  : 1e-12;
  size_t len = 0, first = 0; /* check res[0..len), shifted by first for reduce_scatter/scatter */
  switch (g->coll) {
    case CHORUS_COLL_ALL_REDUCE:
    case CHORUS_COLL_BROADCAST:
      len = c;
      break;
    case CHORUS_COLL_REDUCE:
      len = is_root ? c : 0;
      break;
    case CHORUS_COLL_ALL_GATHER:
    case CHORUS_COLL_ALL_TO_ALL:
      len = n * c;
      break;
    case CHORUS_COLL_GATHER:
      len = is_root ? n * c : 0;
      break;
    case CHORUS_COLL_REDUCE_SCATTER:
    case CHORUS_COLL_SCATTER:
      len = c;
      if (inplace) res += r * c * b->es; /* in-place result: block r of the buffer */
      first = r * c;
      break;
    default:
      break;
  }
  int64_t wrong = 0;
  for (size_t k = 0; k < len; k++) {
    double want;
    switch (g->coll) {
      case CHORUS_COLL_ALL_REDUCE:
      case CHORUS_COLL_REDUCE:
        want = red_expected(op, dt, b->n, k);
        break;
      case CHORUS_COLL_REDUCE_SCATTER:
        want = red_expected(op, dt, b->n, first + k);
        break;
      case CHORUS_COLL_BROADCAST:
        want = mov_val(b->o.root, k);
        break;
      case CHORUS_COLL_ALL_GATHER:
      case CHORUS_COLL_GATHER:
        want = mov_val((int)(k / c), k % c);
        break;
      case CHORUS_COLL_ALL_TO_ALL:
        want = mov_val((int)(k / c), r * c + k % c);
        break;
      case CHORUS_COLL_SCATTER:
        want = mov_val(b->o.root, first + k);
        break;
      default:
        want = 0;
        break;
    }
    double got = get(res, k, dt);
    if (tol > 0 ? !(fabs(got - want) <= tol * fmax(1.0, fabs(want))) : !(got == want)) wrong++;
  }
  return wrong;
}

/* --------------------------------------------------------------- calls */

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* CPU seconds this process has used, all its threads (the progress
 * thread's socket work included), user and system. */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Issues the collective once (out-of-place from a to b, or in-place in b)
 * and, with -z 1, waits for its handle. */
static void run_once(bench_t *b, const geom_t *g, int inplace) {
  chorus_comm_t comm = b->comm;
  chorus_work_t work = NULL, *wp = b->o.async ? &work : NULL;
  chorus_dtype_t dt = b->o.dtype;
  chorus_op_t op = b->o.op;
  int root = b->o.root;
  size_t c = g->count, off = (size_t)b->rank * c * b->es; /* this rank's block */
  unsigned char *A = b->a, *B = b->b;
  chorus_result_t rc = CHORUS_ERR_INTERNAL;
  switch (g->coll) {
    case CHORUS_COLL_ALL_REDUCE:
      rc = chorus_all_reduce(comm, inplace ? B : A, B, c, dt, op, wp);
      break;
    case CHORUS_COLL_BROADCAST:
      rc = chorus_broadcast(comm, B, c, dt, root, wp);
      break;
    case CHORUS_COLL_REDUCE:
      rc = chorus_reduce(comm, inplace ? B : A, B, c, dt, op, root, wp);
      break;
    case CHORUS_COLL_ALL_GATHER:
      rc = chorus_all_gather(comm, inplace ? B + off : A, B, c, dt, wp);
      break;
    case CHORUS_COLL_REDUCE_SCATTER:
      rc = inplace ? chorus_reduce_scatter(comm, B, B + off, c, dt, op, wp)
                   : chorus_reduce_scatter(comm, A, B, c, dt, op, wp);
      break;
    case CHORUS_COLL_ALL_TO_ALL:
      rc = chorus_all_to_all(comm, inplace ? B : A, B, c, dt, wp);
      break;
    case CHORUS_COLL_SCATTER:
      /* In-place as nccl-tests does it: every rank's result is block rank of
       * an n-block buffer, which on the root is also the send buffer. */
      rc = inplace ? chorus_scatter(comm, B, B + off, c, dt, root, wp)
                   : chorus_scatter(comm, A, B, c, dt, root, wp);
      break;
    case CHORUS_COLL_GATHER:
      rc = inplace ? chorus_gather(comm, B + off, B, c, dt, root, wp)
                   : chorus_gather(comm, A, B, c, dt, root, wp);
      break;
    case CHORUS_COLL_BARRIER:
      rc = chorus_barrier(comm, wp);
      break;
    default:
      break;
  }
  check_rc(b, rc, chorus_coll_name(g->coll));
  if (wp) {
    rc = chorus_work_wait(work, -1);
    if (rc != CHORUS_OK) {
      char reason[1100];
      snprintf(reason, sizeof reason, "%s",
               rc == CHORUS_INPROGRESS ? "chorus_work_wait timed out" : chorus_work_error(work));
      chorus_work_free(work);
      fail_call(b, chorus_coll_name(g->coll), rc, reason);
    }
    chorus_work_free(work);
  }
}

/* An in-place call of these leaves its buffer as the next call needs it:
 * the data it reads (the root's buffer, each rank's own block) is what it
 * read the time before, and everything it writes is overwritten again. */
static int inplace_repeats(chorus_coll_t coll) {
  return coll == CHORUS_COLL_BROADCAST || coll == CHORUS_COLL_ALL_GATHER ||
         coll == CHORUS_COLL_SCATTER || coll == CHORUS_COLL_GATHER;
}

/* Warm-up, then -n timed calls of one form.  Per-call times go to times[],
 * their sum to *total, the CPU seconds they took to *cpu.  Returns this
 * rank's wrong elements of the last call (0 without -c). */
static int64_t measure(bench_t *b, const geom_t *g, int inplace, double *times, double *total,
                       double *cpu) {
  int check = b->o.check && g->coll != CHORUS_COLL_BARRIER;
  size_t ipbytes = g->ip_elems * b->es;
  /* Restore the in-place buffer before a call that would otherwise see
   * what the previous call wrote over its input.  Collectives that read
   * only what they never overwrite are restored once, and again before the
   * checked call (which must start from the 0xff-filled outputs); restoring
   * them every time would put the restore's dirty cache lines into the
   * timed call, which a program calling them back to back does not pay. */
  int restore_each = inplace && !inplace_repeats(g->coll);
  if (inplace) {
    fill_input(b, g, b->a, 1); /* a keeps the pristine in-place buffer */
    if (!restore_each) memcpy(b->b, b->a, ipbytes); /* the one restore */
  } else if (g->coll != CHORUS_COLL_BARRIER) {
    fill_input(b, g, b->a, 0);
    memset(b->b, 0xff, g->oop_recv * b->es);
  }
  for (int it = 0; it < b->o.warmup; it++) {
    if (restore_each) memcpy(b->b, b->a, ipbytes);
    run_once(b, g, inplace);
  }
  *total = 0;
  *cpu = 0;
  for (int it = 0; it < b->o.iters; it++) {
    int prepared = 0;
    if (inplace && (restore_each || (check && it == b->o.iters - 1))) {
      memcpy(b->b, b->a, ipbytes);
      prepared = 1;
    } else if (check && it == b->o.iters - 1) {
      memset(b->b, 0xff, g->oop_recv * b->es); /* the checked call must write everything */
      prepared = 1;
    }
    /* Restoring a large buffer takes long and ends at different times on
     * each rank (more so with more ranks than cores): line the ranks up
     * again, untimed, or the timed call absorbs the others' restore.
     * Decided by the size column, the same on every rank: a rooted
     * collective's buffers differ between root and the rest, and a barrier
     * on one rank only would meet the next call on the others. */
    if (prepared && g->bytes >= ((size_t)1 << 15))
      check_rc(b, chorus_barrier(b->comm, NULL), "barrier (after restoring the buffer)");
    double c0 = cpu_s(), t0 = now_us();
    run_once(b, g, inplace);
    times[it] = now_us() - t0;
    *cpu += cpu_s() - c0;
    *total += times[it];
  }
  return check ? count_wrong(b, g, inplace) : 0;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, c = *(const double *)y;
  return (a > c) - (a < c);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* nccl-tests' time format: fewer decimals as the value grows. */
static void fmt_time(char *s, size_t len, double us) {
  snprintf(s, len, us >= 10000.0 ? "%8.0f" : us >= 100.0 ? "%8.1f" : "%8.2f", us);
}

/* ------------------------------------------------------------ the tables */

typedef struct {
  double busbw_sum;
  int busbw_n;
  int64_t wrong;
} summary_t;

#define ROW_FMT_HEAD "%12s  %12s  %8s  %6s  %6s  %18s"
#define PLACE_FMT_HEAD "  %8s  %8s  %7s  %7s  %6s"

/* Prints one line of the table header, without trailing blanks. */
static void say_line(const bench_t *b, char *line) {
  size_t len = strlen(line);
  while (len && line[len - 1] == ' ') line[--len] = '\0';
  say(b, "%s\n", line);
}

static void print_table_header(const bench_t *b, chorus_coll_t coll) {
  char line[512];
  int ip = coll_has_ip(coll);
  say(b, "#\n# Collective: %s\n#\n", chorus_coll_name(coll));
  /* Each label centred over its block of columns (72 + 46k); a barrier has
   * no buffers, so neither label applies. */
  snprintf(line, sizeof line, "#%*s%s%*s%s", 72 + (46 - 12) / 2, "",
           coll_has_oop(coll) && ip ? "out-of-place" : "", ip ? (46 - 12) / 2 + (46 - 8) / 2 : 0,
           "", ip ? "in-place" : "");
  say_line(b, line);
  int len = snprintf(line, sizeof line, "#" ROW_FMT_HEAD PLACE_FMT_HEAD, "size", "count", "type",
                     "redop", "root", "algo", "time", "median", "algbw", "busbw", "#wrong");
  if (ip)
    snprintf(line + len, sizeof line - (size_t)len, PLACE_FMT_HEAD, "time", "median", "algbw",
             "busbw", "#wrong");
  say_line(b, line);
  len = snprintf(line, sizeof line, "#" ROW_FMT_HEAD PLACE_FMT_HEAD, "(B)", "(elements)", "", "",
                 "", "", "(us)", "(us)", "(GB/s)", "(GB/s)", "");
  if (ip)
    snprintf(line + len, sizeof line - (size_t)len, PLACE_FMT_HEAD, "(us)", "(us)", "(GB/s)",
             "(GB/s)", "");
  say_line(b, line);
}

/* One row: measures both forms at one size and prints them. */
static void bench_size(bench_t *b, chorus_coll_t coll, size_t size, summary_t *sum) {
  geom_t g = geometry(b, coll, size);
  /* The algorithm the calls below run (forced or the library's choice). */
  const char *algo = chorus_comm_algo(b->comm, coll, g.count, b->o.dtype);
  if (!algo) algo = "?";
  int iters = b->o.iters, has[2] = {coll_has_oop(coll), coll_has_ip(coll)};
  double *tot = b->times, *per[2] = {b->times + 2, b->times + 2 + iters};
  int64_t wrong[2] = {0, 0};
  double cpu[2] = {0, 0};

  check_rc(b, chorus_barrier(b->comm, NULL), "barrier (between sizes)");
  memset(b->times, 0, sizeof(double) * (size_t)(2 + 2 * iters));
  for (int p = 0; p < 2; p++)
    if (has[p]) wrong[p] = measure(b, &g, p, per[p], &tot[p], &cpu[p]);

  /* Max over ranks of the totals and of every call; sum of wrong elements. */
  check_rc(b,
           chorus_all_reduce(b->comm, b->times, b->times, (size_t)(2 + 2 * iters), CHORUS_FLOAT64,
                             CHORUS_MAX, NULL),
           "all_reduce (times)");
  check_rc(b, chorus_all_reduce(b->comm, wrong, wrong, 2, CHORUS_INT64, CHORUS_SUM, NULL),
           "all_reduce (wrong counts)");
  if (b->o.cpu)
    check_rc(b, chorus_all_reduce(b->comm, cpu, cpu, 2, CHORUS_FLOAT64, CHORUS_SUM, NULL),
             "all_reduce (CPU times)");

  /* Every rank computes the row (so every rank has the same summary and
   * exit status); rank 0 prints it. */
  double factor = bus_factor(coll, b->n);
  char cells[2][128];
  for (int p = 0; p < 2; p++) {
    if (!has[p]) {
      snprintf(cells[p], sizeof cells[p], PLACE_FMT_HEAD, "n/a", "n/a", "n/a", "n/a", "n/a");
      continue;
    }
    double avg = tot[p] / iters, med = median(per[p], iters);
    double algbw = avg > 0 ? (double)g.bytes / 1e3 / avg : 0; /* bytes/us/1e3 = GB/s */
    double busbw = algbw * factor;
    char ts[32], ms[32], ws[32];
    fmt_time(ts, sizeof ts, avg);
    fmt_time(ms, sizeof ms, med);
    if (b->o.check && coll != CHORUS_COLL_BARRIER)
      snprintf(ws, sizeof ws, "%" PRId64, wrong[p]);
    else
      snprintf(ws, sizeof ws, "N/A");
    snprintf(cells[p], sizeof cells[p], "  %8s  %8s  %7.2f  %7.2f  %6s", ts, ms, algbw, busbw, ws);
    if (coll != CHORUS_COLL_BARRIER) {
      sum->busbw_sum += busbw;
      sum->busbw_n++;
    }
    sum->wrong += wrong[p];
  }
  char root[16];
  snprintf(root, sizeof root, "%d", coll_has_root(coll) ? b->o.root : -1);
  say(b, " %12zu  %12zu  %8s  %6s  %6s  %18s%s%s\n", g.bytes, g.elems,
      coll == CHORUS_COLL_BARRIER ? "none" : chorus_dtype_name(b->o.dtype),
      coll_has_op(coll) ? chorus_op_name(b->o.op) : "none", root, algo, cells[0],
      coll_has_ip(coll) ? cells[1] : "");
  if (b->o.cpu && g.bytes) {
    /* Per rank and GB of the size column: CPU s / (iters * bytes / 1e9). */
    double gb = (double)iters * (double)g.bytes / 1e9 * b->n;
    say(b, "# cpu %zu bytes: out-of-place %s s/GB, in-place %s s/GB\n", g.bytes,
        has[0] ? (snprintf(cells[0], sizeof cells[0], "%.3f", cpu[0] / gb), cells[0]) : "n/a",
        has[1] ? (snprintf(cells[1], sizeof cells[1], "%.3f", cpu[1] / gb), cells[1]) : "n/a");
  }
}

/* Runs every size of one collective; returns its summary. */
static summary_t bench_coll(bench_t *b, chorus_coll_t coll) {
  summary_t sum = {0, 0, 0};
  /* Without -a (or with --all, for a collective -a's name does not exist
   * for), the library chooses, as CHORUS_ALGO / CHORUS_<COLL>_ALGO say. */
  if (b->o.algo && algo_registered(coll, b->o.algo))
    check_rc(b, chorus_comm_set_algo(b->comm, coll, b->o.algo), "chorus_comm_set_algo");

  print_table_header(b, coll);
  if (coll == CHORUS_COLL_BARRIER) {
    bench_size(b, coll, 0, &sum); /* no sizes: one row */
  } else {
    size_t s = b->o.min_bytes;
    for (;;) {
      bench_size(b, coll, s, &sum);
      size_t next = b->o.factor ? (s ? s * b->o.factor : 1) : s + b->o.increment;
      if (next <= s || next > b->o.max_bytes) break; /* past -e, or overflow */
      if (b->o.factor && s && next / b->o.factor != s) break;
      s = next;
    }
  }
  if (b->o.check && coll != CHORUS_COLL_BARRIER)
    say(b, "# Wrong elements       : %" PRId64 " %s\n", sum.wrong, sum.wrong ? "FAILED" : "OK");
  if (sum.busbw_n)
    say(b, "# Avg bus bandwidth    : %g\n", sum.busbw_sum / sum.busbw_n);
  else
    say(b, "# Avg bus bandwidth    : n/a (%s moves no data; see its time)\n",
        chorus_coll_name(coll));
  return sum;
}

/* ------------------------------------------------------------- the header */

typedef struct {
  int64_t pid;
  int32_t local_rank, local_size;
  char host[64];
} rank_info_t;

static void print_header(bench_t *b) {
  const opts_t *o = &b->o;
  rank_info_t me = {.pid = (int64_t)getpid(),
                    .local_rank = chorus_comm_local_rank(b->comm),
                    .local_size = chorus_comm_local_size(b->comm)};
  if (gethostname(me.host, sizeof me.host) != 0) snprintf(me.host, sizeof me.host, "?");
  me.host[sizeof me.host - 1] = '\0';
  rank_info_t *all = calloc((size_t)b->n, sizeof *all);
  if (!all) {
    fprintf(stderr, "chorus-bench: out of memory\n");
    exit(1);
  }
  check_rc(b, chorus_all_gather(b->comm, &me, all, sizeof me, CHORUS_UINT8, NULL),
           "all_gather (rank info)");

  char step[64];
  if (o->factor)
    snprintf(step, sizeof step, "%zu(factor)", o->factor);
  else
    snprintf(step, sizeof step, "%zu(bytes)", o->increment);
  int v = chorus_version();
  say(b, "# chorus-bench, chorus %d.%d.%d\n", v / 10000, v / 100 % 100, v % 100);
  say(b, "# collective: %s  dtype: %s  op: %s  root: %d  algo: %s\n",
      o->all ? "all" : chorus_coll_name(o->coll), chorus_dtype_name(o->dtype),
      chorus_op_name(o->op), o->root,
      o->algo ? o->algo : "the library's choice (see the algo column)");
  say(b,
      "# minBytes %zu maxBytes %zu step: %s warmup iters: %d iters: %d validation: %d "
      "blocking: %d memalloc: %d\n",
      o->min_bytes, o->max_bytes, step, o->warmup, o->iters, o->check, !o->async, o->memalloc);
  say(b, "# world size %d  hostname %s\n", b->n, me.host);
  /* The variables that change what is measured, if set. */
  extern char **environ;
  for (char **e = environ; *e; e++) {
    const char *eq = strchr(*e, '=');
    if (strncmp(*e, "CHORUS_", 7) != 0 || !eq) continue;
    size_t len = (size_t)(eq - *e);
    int show =
        (len >= 5 && strncmp(eq - 5, "_ALGO", 5) == 0) || strncmp(*e, "CHORUS_ALGO=", 12) == 0 ||
        strncmp(*e, "CHORUS_RING_THRESHOLD=", 22) == 0 || strncmp(*e, "CHORUS_TIMEOUT=", 15) == 0 ||
        strncmp(*e, "CHORUS_DEBUG_CHECKS=", 20) == 0;
    if (show) say(b, "# env %s\n", *e);
  }
  say(b, "#\n# Using ranks\n");
  for (int r = 0; r < b->n; r++) {
    all[r].host[sizeof all[r].host - 1] = '\0';
    say(b, "#  Rank %2d Pid %7" PRId64 " on %10s local rank %d/%d\n", r, all[r].pid, all[r].host,
        (int)all[r].local_rank, (int)all[r].local_size);
  }
  free(all);
}

/* ------------------------------------------------------------------ main */

/* ---------------------------------------------------------------- links */
#define CHORUS_BENCH_MAX(a, b) ((a) > (b) ? (a) : (b))

enum { LINK_DESC = 96, LAT_ITERS = 200, LAT_WARMUP = 20, BW_REPS = 5 };

/* One pair: 8-byte ping-pong (lower rank times the round trips), then
 * `bytes` one way BW_REPS times and a 1-byte ack back, in each direction.
 * *lat: median one-way latency (us, lower rank only); *bw_out: bytes/us
 * from this rank to peer (measured on the sender). */
static void link_pair(bench_t *b, int peer, size_t bytes, double *lat, double *bw_out) {
  int lower = b->rank < peer;
  char ping[8] = {0}, ack = 0;
  double rtt[LAT_ITERS];
  for (int i = 0; i < LAT_WARMUP + LAT_ITERS; i++) {
    double t0 = now_us();
    if (lower) {
      check_rc(b, chorus_send(b->comm, ping, 8, CHORUS_UINT8, peer, 1, NULL), "send (links)");
      check_rc(b, chorus_recv(b->comm, ping, 8, CHORUS_UINT8, peer, 1, NULL), "recv (links)");
      if (i >= LAT_WARMUP) rtt[i - LAT_WARMUP] = now_us() - t0;
    } else {
      check_rc(b, chorus_recv(b->comm, ping, 8, CHORUS_UINT8, peer, 1, NULL), "recv (links)");
      check_rc(b, chorus_send(b->comm, ping, 8, CHORUS_UINT8, peer, 1, NULL), "send (links)");
    }
  }
  *lat = lower ? median(rtt, LAT_ITERS) / 2 : 0;
  /* Lower rank sends first, then the other way. */
  for (int dir = 0; dir < 2; dir++) {
    int sending = (dir == 0) == lower;
    /* One untimed transfer first: connections and buffers warm up. */
    for (int rep = -1; rep < BW_REPS; rep++) {
      double t0 = now_us();
      if (sending) {
        check_rc(b, chorus_send(b->comm, b->a, bytes, CHORUS_UINT8, peer, 2, NULL), "send (links)");
        check_rc(b, chorus_recv(b->comm, &ack, 1, CHORUS_UINT8, peer, 3, NULL), "recv (links)");
        if (rep >= 0) b->times[rep] = now_us() - t0;
      } else {
        check_rc(b, chorus_recv(b->comm, b->b, bytes, CHORUS_UINT8, peer, 2, NULL), "recv (links)");
        check_rc(b, chorus_send(b->comm, &ack, 1, CHORUS_UINT8, peer, 3, NULL), "send (links)");
      }
    }
    if (sending) *bw_out = (double)bytes / median(b->times, BW_REPS);
  }
}

/* --links: every pair of ranks, a round at a time (the circle method: in
 * each round every rank is in at most one pair, so pairs do not share a
 * rank's time; pairs of one round may still share a host's link).  Rank 0
 * prints the latency and bandwidth matrices, the slow links and the link
 * each pair uses (chorus_comm_link). */
static int run_links(bench_t *b, size_t bytes) {
  int n = b->n, m = n + (n & 1); /* a bye when odd */
  double *lat = calloc((size_t)n, sizeof *lat), *bw = calloc((size_t)n, sizeof *bw);
  double *all_lat = NULL, *all_bw = NULL;
  char *desc = calloc((size_t)n, LINK_DESC), *all_desc = NULL;
  char host[64] = "?", *hosts = NULL;
  if (b->rank == 0) {
    all_lat = calloc((size_t)n * n, sizeof *all_lat);
    all_bw = calloc((size_t)n * n, sizeof *all_bw);
    all_desc = calloc((size_t)n * n, LINK_DESC);
    hosts = calloc((size_t)n, sizeof host);
  }
  if (!lat || !bw || !desc || (b->rank == 0 && (!all_lat || !all_bw || !all_desc || !hosts))) {
    fprintf(stderr, "chorus-bench: rank %d: out of memory for --links\n", b->rank);
    chorus_comm_abort(b->comm);
    return 1;
  }
  gethostname(host, sizeof host - 1);
  say(b, "# links: %d ranks, 8-byte ping-pong x %d, then %zu bytes x %d each way per pair\n",
      n, LAT_ITERS, bytes, BW_REPS);
  for (int r = 0; r < m - 1; r++) {
    /* Circle method: position 0 stays, the others rotate. */
    int partner = -1;
    for (int k = 0; k < m / 2; k++) {
      int x = k == 0 ? 0 : 1 + (r + k) % (m - 1);
      int y = k == 0 ? 1 + r % (m - 1) : 1 + (r - k + (m - 1)) % (m - 1);
      if (x == b->rank && y < n) partner = y;
      if (y == b->rank && x < n) partner = x;
    }
    if (partner >= 0) link_pair(b, partner, bytes, &lat[partner], &bw[partner]);
    check_rc(b, chorus_barrier(b->comm, NULL), "barrier (links)");
  }
  for (int p = 0; p < n; p++) chorus_comm_link(b->comm, p, desc + (size_t)p * LINK_DESC, LINK_DESC);
  check_rc(b, chorus_gather(b->comm, lat, all_lat, (size_t)n, CHORUS_FLOAT64, 0, NULL), "gather (links)");
  check_rc(b, chorus_gather(b->comm, bw, all_bw, (size_t)n, CHORUS_FLOAT64, 0, NULL), "gather (links)");
  check_rc(b, chorus_gather(b->comm, desc, all_desc, (size_t)n * LINK_DESC, CHORUS_UINT8, 0, NULL),
           "gather (links)");
  check_rc(b, chorus_gather(b->comm, host, hosts, sizeof host, CHORUS_UINT8, 0, NULL), "gather (links)");
  if (b->rank == 0) {
    /* Latency is measured once per pair (on its lower rank): mirror it. */
    for (int i = 0; i < n; i++)
      for (int j = 0; j < i; j++) all_lat[(size_t)i * n + j] = all_lat[(size_t)j * n + i];
    double *v = calloc((size_t)n * n + 1, sizeof *v);
    int nv = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < n; j++)
        if (i != j && v) v[nv++] = all_bw[(size_t)i * n + j];
    double bw_med = v ? median(v, nv) : 0;
    nv = 0;
    for (int i = 0; i < n; i++)
      for (int j = i + 1; j < n; j++)
        if (v) v[nv++] = all_lat[(size_t)i * n + j];
    double lat_med = v ? median(v, nv) : 0;
    free(v);
    for (int pass = 0; pass < 2; pass++) {
      say(b, "#\n# %s, row = from, column = to\n# %8s", pass ? "bandwidth (MB/s)" : "one-way latency (us)",
          "");
      for (int j = 0; j < n; j++) say(b, " %8d", j);
      say(b, "\n");
      for (int i = 0; i < n; i++) {
        say(b, "  %8d", i);
        for (int j = 0; j < n; j++) {
          double x = pass ? all_bw[(size_t)i * n + j] : all_lat[(size_t)i * n + j];
          if (i == j) say(b, " %8s", "-");
          else say(b, pass ? " %8.0f" : " %8.1f", x);
        }
        say(b, "\n");
      }
    }
    say(b, "#\n# medians: latency %.1f us, bandwidth %.0f MB/s\n", lat_med, bw_med);
    int slow = 0;
    for (int i = 0; i < n; i++)
      for (int j = 0; j < n; j++) {
        if (i == j) continue;
        double l = all_lat[(size_t)i * n + j], w = all_bw[(size_t)i * n + j];
        int bad_bw = w < 0.5 * bw_med, bad_lat = i < j && l > 2 * lat_med && l > lat_med + 20;
        if (!bad_bw && !bad_lat) continue;
        if (!slow++) say(b, "# slow links (bandwidth under half the median, or latency over twice it):\n");
        say(b, "#   %d -> %d: %.0f MB/s, %.1f us; %s\n", i, j, w, l,
            all_desc + ((size_t)i * n + j) * LINK_DESC);
      }
    if (!slow) say(b, "# no slow link\n");
    say(b, "#\n# links (rank host: how it reaches each peer)\n");
    for (int i = 0; i < n; i++)
      for (int j = 0; j < n; j++)
        if (i != j)
          say(b, "#   %d %s -> %d %s: %s\n", i, hosts + (size_t)i * sizeof host, j,
              hosts + (size_t)j * sizeof host, all_desc + ((size_t)i * n + j) * LINK_DESC);
  }
  free(lat);
  free(bw);
  free(desc);
  free(all_lat);
  free(all_bw);
  free(all_desc);
  free(hosts);
  return 0;
}

/* ----------------------------------------------------------------- tune */

/* The collectives --tune times when -C is not given: those whose automatic
 * choice depends on size. */
static const chorus_coll_t k_tuned[] = {CHORUS_COLL_ALL_REDUCE, CHORUS_COLL_REDUCE_SCATTER,
                                        CHORUS_COLL_ALL_GATHER, CHORUS_COLL_BROADCAST,
                                        CHORUS_COLL_REDUCE};

/* The tuning table's name for this group's kind (src/algo/tune.c): one
 * host with shared memory, several hosts with as many ranks each (more
 * than one), or anything else. */
static const char *group_kind(bench_t *b) {
  const char *a = chorus_comm_algo(b->comm, CHORUS_COLL_ALL_REDUCE, (size_t)1 << 20, CHORUS_FLOAT32);
  int32_t local[2] = {0, 0};
  for (int p = 0; p < b->n; p++) local[0] += chorus_comm_same_host(b->comm, p) == 1;
  local[1] = -local[0];
  check_rc(b, chorus_all_reduce(b->comm, local, local, 2, CHORUS_INT32, CHORUS_MAX, NULL),
           "all_reduce (host sizes)");
  int most = local[0], least = -local[1];
  if (a && !strcmp(a, "direct")) return "one-host";
  if (most == least && most > 1 && most < b->n) return "hosts";
  return "flat";
}

/* Median time (max over ranks per call) of one algorithm at one size, or
 * -1 when the group cannot run it. */
static double tune_time(bench_t *b, chorus_coll_t coll, const char *algo, size_t size,
                        const char *kind) {
  /* The shared-memory algorithms need a group on one host. */
  if (!strcmp(algo, "direct") && strcmp(kind, "one-host")) return -1;
  /* Elsewhere than on several hosts it is the flat ring under another name. */
  if (!strcmp(algo, "hierarchical") && strcmp(kind, "hosts")) return -1;
  if (chorus_comm_set_algo(b->comm, coll, algo) != CHORUS_OK) return -1;
  geom_t g = geometry(b, coll, size);
  int iters = b->o.iters, form = coll_has_oop(coll) ? 0 : 1;
  double *per = b->times + 2, total = 0, cpu = 0;
  check_rc(b, chorus_barrier(b->comm, NULL), "barrier (between algorithms)");
  memset(b->times, 0, sizeof(double) * (size_t)(2 + iters));
  int64_t wrong = measure(b, &g, form, per, &total, &cpu);
  check_rc(b, chorus_all_reduce(b->comm, per, per, (size_t)iters, CHORUS_FLOAT64, CHORUS_MAX, NULL),
           "all_reduce (times)");
  check_rc(b, chorus_all_reduce(b->comm, &wrong, &wrong, 1, CHORUS_INT64, CHORUS_SUM, NULL),
           "all_reduce (wrong counts)");
  if (wrong) fail_call(b, "tune", CHORUS_ERR_INTERNAL, "wrong results while tuning");
  return median(per, iters);
}

/* --tune: every algorithm of each collective at every size; the fastest
 * per size, merged into byte ranges, becomes the table's rules for this
 * kind of group and this many ranks.  Every rank measures (the calls are
 * collective); rank 0 writes the file. */
static int run_tune(bench_t *b) {
  const char *kind = group_kind(b);
  FILE *f = NULL;
  if (b->rank == 0) {
    f = fopen(b->o.tune, "w");
    if (!f) fprintf(stderr, "chorus-bench: cannot write %s: %s\n", b->o.tune, strerror(errno));
  }
  int ok = f != NULL || b->rank != 0;
  check_rc(b, chorus_all_reduce(b->comm, &ok, &ok, 1, CHORUS_INT32, CHORUS_MIN, NULL),
           "all_reduce (file opened)");
  if (!ok) return 1;
  if (f)
    fprintf(f, "# chorus tuning table: chorus-bench --tune on %d ranks (%s), %s, -n %d\n"
               "# COLL  WHERE  RANKS  BYTES  ALGO   (see docs/algorithms.md)\n",
            b->n, kind, chorus_dtype_name(b->o.dtype), b->o.iters);
  int ncoll = b->o.coll == (chorus_coll_t)-1 ? (int)(sizeof k_tuned / sizeof *k_tuned) : 1;
  for (int ci = 0; ci < ncoll; ci++) {
    chorus_coll_t coll = b->o.coll == (chorus_coll_t)-1 ? k_tuned[ci] : b->o.coll;
    say(b, "# tune %s (%s, %d ranks)\n", chorus_coll_name(coll), kind, b->n);
    const char *prev = NULL;
    uint64_t from = 0;
    for (size_t s = b->o.min_bytes;;) {
      geom_t g = geometry(b, coll, s);
      /* The table's bytes: count x size, the whole vector for these two. */
      uint64_t tb = (uint64_t)g.count * b->es;
      if (coll == CHORUS_COLL_ALL_GATHER || coll == CHORUS_COLL_REDUCE_SCATTER) tb *= (uint64_t)b->n;
      const char *best = NULL;
      double best_t = 0;
      char line[512];
      int off = snprintf(line, sizeof line, "# %12zu B:", s);
      for (int i = 0; chorus_algo_name(coll, i); i++) {
        const char *name = chorus_algo_name(coll, i);
        double t = tune_time(b, coll, name, s, kind);
        if (t < 0) continue;
        if (off > 0 && (size_t)off < sizeof line)
          off += snprintf(line + off, sizeof line - (size_t)off, " %s %.1f us", name, t);
        if (!best || t < best_t) best = name, best_t = t;
      }
      say(b, "%s -> %s\n", line, best ? best : "(none)");
      if (best && prev && strcmp(best, prev)) {
        if (f)
          fprintf(f, "%-15s %-8s %-5d %" PRIu64 "-%" PRIu64 " %s\n", chorus_coll_name(coll), kind,
                  b->n, from, tb - 1, prev);
        from = tb;
      }
      if (best) prev = best;
      size_t next = b->o.factor ? (s ? s * b->o.factor : 1) : s + b->o.increment;
      if (next <= s || next > b->o.max_bytes) break;
      if (b->o.factor && s && next / b->o.factor != s) break;
      s = next;
    }
    if (f && prev)
      fprintf(f, "%-15s %-8s %-5d %" PRIu64 "- %s\n", chorus_coll_name(coll), kind, b->n, from, prev);
    check_rc(b, chorus_comm_set_algo(b->comm, coll, "auto"), "chorus_comm_set_algo (auto)");
  }
  if (f) {
    int bad = fclose(f) != 0;
    if (bad) fprintf(stderr, "chorus-bench: writing %s failed\n", b->o.tune);
    else say(b, "# wrote %s: use it with CHORUS_TUNING_FILE=%s on every rank\n", b->o.tune, b->o.tune);
    return bad;
  }
  return 0;
}

int main(int argc, char **argv) {
  bench_t b = {0};
  parse_args(argc, argv, &b.o);

  if (!getenv("RANK") || !getenv("WORLD_SIZE")) {
    fprintf(stderr,
            "chorus-bench: RANK and WORLD_SIZE are not set; run it through chorusrun:\n"
            "  chorusrun --standalone -n 2 -- chorus-bench\n");
    return 2;
  }
  chorus_result_t rc = chorus_comm_init_env(&b.comm);
  if (rc != CHORUS_OK) {
    fprintf(stderr, "chorus-bench: chorus_comm_init_env failed: %s: %s\n", chorus_result_name(rc),
            chorus_last_init_error());
    return 1;
  }
  b.rank = chorus_comm_rank(b.comm);
  b.n = chorus_comm_size(b.comm);
  b.es = chorus_dtype_size(b.o.dtype);
  if (b.o.root >= b.n) {
    if (b.rank == 0) fprintf(stderr, "chorus-bench: root %d is not a rank of %d\n", b.o.root, b.n);
    chorus_comm_destroy(b.comm);
    return 2;
  }

  /* Two buffers of -e bytes serve every collective and size: no call needs
   * more than size bytes in either. */
  b.cap = (b.o.max_bytes + 63) / 64 * 64;
  if (b.cap < 64) b.cap = 64;
  if (b.o.memalloc) {
    void *pa = NULL, *pb = NULL;
    if (chorus_mem_alloc(b.comm, b.cap, &pa) != CHORUS_OK ||
        chorus_mem_alloc(b.comm, b.cap, &pb) != CHORUS_OK)
      fprintf(stderr, "chorus-bench: %s\n", chorus_comm_last_error(b.comm));
    b.a = pa;
    b.b = pb;
  } else {
    b.a = aligned_alloc(64, b.cap);
    b.b = aligned_alloc(64, b.cap);
  }
  b.times = calloc((size_t)CHORUS_BENCH_MAX(2 + 2 * b.o.iters, BW_REPS), sizeof(double));
  if (!b.a || !b.b || !b.times) {
    fprintf(stderr, "chorus-bench: rank %d: cannot allocate 2 x %zu bytes\n", b.rank, b.cap);
    chorus_comm_abort(b.comm);
    chorus_comm_destroy(b.comm);
    return 1;
  }
  memset(b.a, 0, b.cap); /* fault the pages in before anything is timed */
  memset(b.b, 0, b.cap);

  if (b.o.links) {
    int lrc = run_links(&b, b.o.max_bytes); /* 4 MiB unless -e was given */
    rc = chorus_comm_destroy(b.comm);
    free(b.a);
    free(b.b);
    free(b.times);
    return lrc || rc != CHORUS_OK;
  }
  if (b.o.tune) {
    int trc = run_tune(&b);
    rc = chorus_comm_destroy(b.comm);
    free(b.a);
    free(b.b);
    free(b.times);
    return trc || rc != CHORUS_OK;
  }
  print_header(&b);
  if (b.o.check) {
    /* Largest value a result reaches: 3n for sum (inputs 0..3). */
    double limit = b.o.dtype == CHORUS_INT8       ? 127
                   : b.o.dtype == CHORUS_UINT8    ? 255
                   : b.o.dtype == CHORUS_BFLOAT16 ? 256
                   : b.o.dtype == CHORUS_FLOAT16  ? 2048
                                                  : 1e15;
    if (3.0 * b.n > limit)
      say(&b, "# warning: sums of %d ranks may not fit %s exactly; -c may report false errors\n",
          b.n, chorus_dtype_name(b.o.dtype));
  }

  summary_t sums[NCOLLS];
  int ncolls = 0;
  chorus_coll_t run[NCOLLS];
  if (b.o.all)
    for (int c = 0; c < NCOLLS; c++) run[ncolls++] = k_colls[c];
  else
    run[ncolls++] = b.o.coll;
  int64_t wrong = 0;
  for (int c = 0; c < ncolls; c++) {
    sums[c] = bench_coll(&b, run[c]);
    wrong += sums[c].wrong;
  }
  /* Every rank has the same sums (they come from all_reduces), so every rank
   * agrees on the exit status. */
  check_rc(&b, chorus_all_reduce(b.comm, &wrong, &wrong, 1, CHORUS_INT64, CHORUS_MAX, NULL),
           "all_reduce (exit status)");

  if (b.o.all) {
    say(&b, "#\n# Summary\n#  %-15s %16s  %s\n", "collective", "avg busbw (GB/s)", "#wrong");
    for (int c = 0; c < ncolls; c++) {
      char bw[32], w[32];
      snprintf(bw, sizeof bw, sums[c].busbw_n ? "%.3f" : "n/a",
               sums[c].busbw_n ? sums[c].busbw_sum / sums[c].busbw_n : 0.0);
      snprintf(w, sizeof w, b.o.check && run[c] != CHORUS_COLL_BARRIER ? "%" PRId64 : "N/A",
               sums[c].wrong);
      say(&b, "#  %-15s %16s  %s\n", chorus_coll_name(run[c]), bw, w);
    }
  }
  say(&b, "#\n");

  if (b.o.memalloc) {
    /* Before the communicator goes (it owns them): once nobody reads them. */
    chorus_barrier(b.comm, NULL);
    chorus_mem_free(b.comm, b.a);
    chorus_mem_free(b.comm, b.b);
  } else {
    free(b.a);
    free(b.b);
  }
  rc = chorus_comm_destroy(b.comm);
  free(b.times);
  if (rc != CHORUS_OK) {
    fprintf(stderr, "chorus-bench: rank %d: chorus_comm_destroy failed: %s\n", b.rank,
            chorus_result_name(rc));
    return 1;
  }
  if (wrong) {
    if (b.rank == 0) fprintf(stderr, "chorus-bench: %" PRId64 " wrong elements\n", wrong);
    return 1;
  }
  return 0;
}
