/*
 * tune.c - the automatic choice as a table of rules.
 *
 * A rule says: for this collective ("*": any that has the algorithm), in
 * groups of this kind, with this many ranks and calls of this many bytes,
 * run that algorithm.  The first rule that matches wins; a call no rule
 * matches runs the collective's first algorithm.  The table is
 *
 *   the rules of CHORUS_TUNING_FILE, when set (a file chorus-bench --tune
 *   writes for a cluster, or one written by hand), then
 *   the built-in rules (k_builtin below), which every run has.
 *
 * One rule per line, '#' starts a comment:
 *
 *   COLL  WHERE  RANKS  BYTES  ALGO
 *
 *   COLL    a collective's name (all_reduce, ...) or '*'
 *   WHERE   any | one-host (the group shares a memory segment) | hosts
 *           (several hosts, as many ranks on each, more than one) | flat
 *           (anything else: one rank per host, uneven hosts, or one host
 *           without shared memory)
 *   RANKS   any | N | N-M | N-     the group's size
 *   BYTES   any | N | N-M | N-     with K, M, G suffixes (x1024); the
 *           call's bytes: count x dtype size, and for all_gather and
 *           reduce_scatter the whole vector (count x dtype size x ranks)
 *   ALGO    an algorithm of COLL (chorus-bench lists them)
 *
 * The choice depends only on values every rank of a correct program
 * shares, and the file must be the same on every rank: the chosen
 * algorithm is in every message's fingerprint, so ranks with different
 * tables fail with a mismatch instead of exchanging garbage.
 *
 * The file is input like any other: lines are bounded, every field is
 * checked, and a bad line fails the world's creation with its number.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "algo/algo.h"
#include "util/env.h"
#include "util/log.h"
#include "util/util.h"

#define MAX_RULES 4096
#define MAX_LINE 512

enum { W_ANY, W_ONE_HOST, W_HOSTS, W_FLAT };
static const char *const k_where[] = {"any", "one-host", "hosts", "flat"};

typedef struct rule {
  int coll; /* chorus_coll_t, or -1 for '*' */
  int where;
  long min_ranks, max_ranks;      /* inclusive */
  uint64_t min_bytes, max_bytes;  /* inclusive */
  char algo[32];
  int line;
  int from_file;
  signed char idx[CHORUS_COLL_COUNT]; /* the algorithm's index per collective, -1: none */
} rule_t;

/* The default choice.  RING_THRESHOLD stands for CHORUS_RING_THRESHOLD
 * (65536 unless set); the rest is fixed. */
static const char k_builtin[] =
    "# one host: the shared-memory algorithms win at every size\n"
    "*               one-host  any  any                   direct\n"
    "all_reduce      any       any  0-RING_THRESHOLD_1    recursive_doubling\n"
    "all_reduce      hosts     any  RING_THRESHOLD-       hierarchical\n"
    "all_reduce      any       any  RING_THRESHOLD-       ring\n"
    "reduce_scatter  hosts     any  RING_THRESHOLD-       hierarchical\n"
    "reduce_scatter  any       any  any                   ring\n"
    "all_gather      any       any  0-65535               bruck\n"
    "all_gather      hosts     any  1M-                   hierarchical\n"
    "all_gather      any       any  any                   ring\n"
    "broadcast       hosts     any  1M-                   hierarchical\n"
    "reduce          hosts     any  1M-                   hierarchical\n";

static rule_t *g_rules;
static int g_nrules;
static char g_file[256]; /* CHORUS_TUNING_FILE as loaded, "" when none */
static char g_error[512];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int parse_u64(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  if (!*s || *s == '-' || *s == '+') return -1;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s) return -1;
  uint64_t mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1ull << 10, end++;
  else if (*end == 'M' || *end == 'm') mul = 1ull << 20, end++;
  else if (*end == 'G' || *end == 'g') mul = 1ull << 30, end++;
  if (*end || (mul > 1 && v > UINT64_MAX / mul)) return -1;
  *out = (uint64_t)v * mul;
  return 0;
}

/* "any", "N", "N-M" or "N-" into [lo, hi]. */
static int parse_range(char *s, uint64_t *lo, uint64_t *hi) {
  if (!strcasecmp(s, "any")) {
    *lo = 0;
    *hi = UINT64_MAX;
    return 0;
  }
  char *dash = strchr(s, '-');
  if (!dash) {
    if (parse_u64(s, lo) < 0) return -1;
    *hi = *lo;
    return 0;
  }
  *dash = '\0';
  if (parse_u64(s, lo) < 0) return -1;
  if (!dash[1]) {
    *hi = UINT64_MAX;
    return 0;
  }
  if (parse_u64(dash + 1, hi) < 0 || *hi < *lo) return -1;
  return 0;
}

static int coll_by_name(const char *s) {
  for (int k = 0; k < CHORUS_COLL_COUNT; k++) {
    const char *n = chorus_coll_name((chorus_coll_t)k);
    if (n && !strcmp(n, s)) return k;
  }
  return -2;
}

/* Parses one line into r (0), a blank or comment line (1), or fails (-1,
 * why filled). */
static int parse_rule(char *line, rule_t *r, char *why, size_t cap) {
  char *hash = strchr(line, '#');
  if (hash) *hash = '\0';
  char *f[6];
  int n = 0;
  for (char *save = NULL, *t = strtok_r(line, " \t\r\n", &save); t;
       t = strtok_r(NULL, " \t\r\n", &save)) {
    if (n == 5) {
      snprintf(why, cap, "more than 5 fields");
      return -1;
    }
    f[n++] = t;
  }
  if (n == 0) return 1;
  if (n != 5) {
    snprintf(why, cap, "%d fields, want COLL WHERE RANKS BYTES ALGO", n);
    return -1;
  }
  memset(r, 0, sizeof *r);
  r->coll = strcmp(f[0], "*") ? coll_by_name(f[0]) : -1;
  if (r->coll == -2) {
    snprintf(why, cap, "unknown collective '%.40s'", f[0]);
    return -1;
  }
  r->where = -1;
  for (int w = 0; w < 4; w++)
    if (!strcasecmp(f[1], k_where[w])) r->where = w;
  if (r->where < 0) {
    snprintf(why, cap, "WHERE '%.40s' is not any, one-host, hosts or flat", f[1]);
    return -1;
  }
  uint64_t lo, hi;
  if (parse_range(f[2], &lo, &hi) < 0 || lo > (uint64_t)INT32_MAX) {
    snprintf(why, cap, "RANKS must be any, N, N-M or N-");
    return -1;
  }
  r->min_ranks = (long)lo;
  r->max_ranks = hi > (uint64_t)INT32_MAX ? INT32_MAX : (long)hi;
  if (parse_range(f[3], &r->min_bytes, &r->max_bytes) < 0) {
    snprintf(why, cap, "BYTES must be any, N, N-M or N- (K, M, G suffixes)");
    return -1;
  }
  if (strlen(f[4]) >= sizeof r->algo) {
    snprintf(why, cap, "algorithm name too long");
    return -1;
  }
  snprintf(r->algo, sizeof r->algo, "%s", f[4]);
  if (r->coll >= 0 ? chorus__algo_find((chorus_coll_t)r->coll, r->algo) < 0 : 0) {
    snprintf(why, cap, "%s has no algorithm '%s'", f[0], r->algo);
    return -1;
  }
  if (r->coll < 0) {
    int any = 0;
    for (int k = 0; k < CHORUS_COLL_COUNT && !any; k++)
      any = chorus__algo_find((chorus_coll_t)k, r->algo) >= 0;
    if (!any) {
      snprintf(why, cap, "no collective has an algorithm '%s'", r->algo);
      return -1;
    }
  }
  return 0;
}

static int add_rule(rule_t *r) {
  if (g_nrules == MAX_RULES) return -1;
  for (int k = 0; k < CHORUS_COLL_COUNT; k++)
    r->idx[k] = (signed char)(r->coll < 0 || r->coll == k
                                  ? chorus__algo_find((chorus_coll_t)k, r->algo) : -1);
  if (!(g_nrules & (g_nrules - 1))) {
    int cap = g_nrules ? 2 * g_nrules : 16;
    rule_t *p = realloc(g_rules, sizeof *p * (size_t)cap);
    if (!p) return -1;
    g_rules = p;
  }
  g_rules[g_nrules++] = *r;
  return 0;
}

/* The built-in text with the ring threshold put in. */
static int load_builtin(void) {
  long thr = chorus__env()->RING_THRESHOLD;
  if (thr < 1) thr = 1;
  char text[sizeof k_builtin + 64], num[32], num1[32];
  snprintf(num, sizeof num, "%ld", thr);
  snprintf(num1, sizeof num1, "%ld", thr - 1);
  size_t o = 0;
  for (const char *p = k_builtin; *p && o + 32 < sizeof text;) {
    if (!strncmp(p, "RING_THRESHOLD_1", 16)) {
      o += (size_t)snprintf(text + o, sizeof text - o, "%s", num1);
      p += 16;
    } else if (!strncmp(p, "RING_THRESHOLD", 14)) {
      o += (size_t)snprintf(text + o, sizeof text - o, "%s", num);
      p += 14;
    } else {
      text[o++] = *p++;
    }
  }
  text[o] = '\0';
  int line = 0;
  for (char *save = NULL, *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
    rule_t r;
    char why[160];
    line++;
    int rc = parse_rule(l, &r, why, sizeof why);
    if (rc < 0) {
      snprintf(g_error, sizeof g_error, "built-in tuning table line %d: %s", line, why);
      return -1;
    }
    if (rc > 0) continue;
    r.line = line;
    if (add_rule(&r) < 0) return -1;
  }
  return 0;
}

static int load_file(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    snprintf(g_error, sizeof g_error, "CHORUS_TUNING_FILE %s: %s", path, strerror(errno));
    return -1;
  }
  char buf[MAX_LINE + 2];
  int line = 0, rc = 0;
  while (fgets(buf, sizeof buf, f)) {
    line++;
    size_t len = strlen(buf);
    if (len == sizeof buf - 1 && buf[len - 1] != '\n') {
      snprintf(g_error, sizeof g_error, "CHORUS_TUNING_FILE %s line %d: longer than %d bytes",
               path, line, MAX_LINE);
      rc = -1;
      break;
    }
    rule_t r;
    char why[160];
    int p = parse_rule(buf, &r, why, sizeof why);
    if (p < 0) {
      snprintf(g_error, sizeof g_error, "CHORUS_TUNING_FILE %s line %d: %s", path, line, why);
      rc = -1;
      break;
    }
    if (p > 0) continue;
    r.line = line;
    r.from_file = 1;
    if (add_rule(&r) < 0) {
      snprintf(g_error, sizeof g_error, "CHORUS_TUNING_FILE %s: more than %d rules (or out of "
               "memory)", path, MAX_RULES);
      rc = -1;
      break;
    }
  }
  if (rc == 0 && ferror(f)) {
    snprintf(g_error, sizeof g_error, "CHORUS_TUNING_FILE %s: read error", path);
    rc = -1;
  }
  fclose(f);
  return rc;
}

static void load_once(void) {
  const char *path = chorus__env()->TUNING_FILE;
  if (path && *path) {
    snprintf(g_file, sizeof g_file, "%s", path);
    if (load_file(path) < 0) return;
  }
  if (load_builtin() < 0 && !g_error[0]) snprintf(g_error, sizeof g_error, "out of memory");
}

chorus_result_t chorus__tune_load(char *err, size_t cap) {
  pthread_once(&g_once, load_once);
  if (!g_error[0]) return CHORUS_OK;
  snprintf(err, cap, "%s", g_error);
  return CHORUS_ERR_INVALID_ARG;
}

static int where_of(const chorus__coll_t *c) {
  if (c->shm) return W_ONE_HOST;
  const chorus__topo_t *t = c->topo;
  if (t && t->nhosts > 1 && t->ppn > 1) return W_HOSTS;
  return W_FLAT;
}

int chorus__tune_select(const chorus__coll_t *c, int *rule_line, int *from_file) {
  pthread_once(&g_once, load_once);
  uint64_t bytes = (uint64_t)c->count * c->esize;
  if (c->coll == CHORUS_COLL_ALL_GATHER || c->coll == CHORUS_COLL_REDUCE_SCATTER)
    bytes *= (uint64_t)c->size;
  int where = where_of(c);
  for (int i = 0; i < g_nrules; i++) {
    const rule_t *r = &g_rules[i];
    if (r->coll >= 0 && r->coll != (int)c->coll) continue;
    if (r->where != W_ANY && r->where != where) continue;
    if (c->size < r->min_ranks || c->size > r->max_ranks) continue;
    if (bytes < r->min_bytes || bytes > r->max_bytes) continue;
    int idx = r->idx[c->coll];
    if (idx < 0) continue; /* a '*' rule for an algorithm this collective lacks */
    int nalgos;
    const chorus__algo_t *a = &chorus__algos(c->coll, &nalgos)[idx];
    if (a->shm && !c->shm) continue;
    *rule_line = r->line;
    *from_file = r->from_file;
    return idx;
  }
  *rule_line = 0;
  *from_file = 0;
  return 0;
}

const char *chorus__tune_file(void) { return g_file[0] ? g_file : NULL; }

const char *chorus__tune_where_name(const chorus__coll_t *c) { return k_where[where_of(c)]; }
