/*
 * hostlist.c - see hostlist.h.  Nothing is expanded into memory: counting
 * and indexing walk the list, so a hostile "n[0-999999999]" costs a parse,
 * not an allocation.
 */
#include "util/hostlist.h"

#include <stdio.h>
#include <string.h>

/* One bracket group "[...]" of a name, parsed: up to GROUP_ITEMS ranges. */
#define GROUP_ITEMS 256
#define MAX_GROUPS 8
#define NUM_DIGITS 9 /* numbers below 10^9 */

typedef struct {
  long lo[GROUP_ITEMS], hi[GROUP_ITEMS];
  int width[GROUP_ITEMS]; /* zero-padded width, 0: none */
  int n;
  long count;            /* numbers in the group */
  const char *prefix;    /* text before the group (after the previous one) */
  size_t prefix_len;
} group_t;

typedef struct {
  group_t g[MAX_GROUPS];
  int ngroups;
  const char *suffix; /* text after the last group */
  size_t suffix_len;
  long count;
} name_t;

static int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Parses a number of at most NUM_DIGITS digits at *p. */
static int parse_num(const char **p, const char *end, long *v, int *ndigits) {
  const char *s = *p;
  long x = 0;
  int d = 0;
  while (s < end && is_digit(*s)) {
    if (++d > NUM_DIGITS) return -1;
    x = x * 10 + (*s++ - '0');
  }
  if (d == 0) return -1;
  *p = s;
  *v = x;
  *ndigits = d;
  return 0;
}

/* Parses the inside of a bracket group [s, end). */
static int parse_group(const char *s, const char *end, group_t *g) {
  g->n = 0;
  g->count = 0;
  while (s < end) {
    if (g->n == GROUP_ITEMS) return -1;
    long lo, hi;
    int dl, dh;
    const char *lo_text = s;
    if (parse_num(&s, end, &lo, &dl) < 0) return -1;
    hi = lo;
    if (s < end && *s == '-') {
      s++;
      if (parse_num(&s, end, &hi, &dh) < 0 || hi < lo) return -1;
    }
    g->lo[g->n] = lo;
    g->hi[g->n] = hi;
    /* A lower bound written with a leading zero pads to its length. */
    g->width[g->n] = *lo_text == '0' && dl > 1 ? dl : 0;
    g->n++;
    g->count += hi - lo + 1;
    if (g->count > CHORUS__HOSTLIST_MAX) return -1;
    if (s < end) {
      if (*s != ',') return -1;
      s++;
      if (s == end) return -1; /* "[1,]" */
    }
  }
  return g->n ? 0 : -1;
}

/* Parses one name [s, end) (no top-level commas). */
static int parse_name(const char *s, const char *end, name_t *nm) {
  nm->ngroups = 0;
  nm->count = 1;
  const char *text = s;
  while (s < end) {
    if (*s == ']') return -1;
    if (*s != '[') {
      s++;
      continue;
    }
    const char *close = memchr(s, ']', (size_t)(end - s));
    if (!close || nm->ngroups == MAX_GROUPS) return -1;
    group_t *g = &nm->g[nm->ngroups++];
    g->prefix = text;
    g->prefix_len = (size_t)(s - text);
    if (parse_group(s + 1, close, g) < 0) return -1;
    nm->count *= g->count;
    if (nm->count > CHORUS__HOSTLIST_MAX) return -1;
    s = text = close + 1;
  }
  nm->suffix = text;
  nm->suffix_len = (size_t)(end - text);
  if (nm->ngroups == 0 && nm->suffix_len == 0) return -1; /* empty name */
  return 0;
}

/* The end of the name starting at s: the next comma outside brackets. */
static const char *name_end(const char *s) {
  int depth = 0;
  for (; *s; s++) {
    if (*s == '[') depth++;
    else if (*s == ']') depth--;
    else if (*s == ',' && depth == 0) break;
  }
  return s;
}

/* Writes the k-th host of nm into out. */
static int name_nth(const name_t *nm, long k, char *out, size_t cap) {
  long idx[MAX_GROUPS];
  for (int i = nm->ngroups - 1; i >= 0; i--) {
    idx[i] = k % nm->g[i].count;
    k /= nm->g[i].count;
  }
  size_t len = 0;
  for (int i = 0; i < nm->ngroups; i++) {
    const group_t *g = &nm->g[i];
    long j = idx[i], v = 0;
    int w = 0;
    for (int r = 0; r < g->n; r++) {
      long span = g->hi[r] - g->lo[r] + 1;
      if (j < span) {
        v = g->lo[r] + j;
        w = g->width[r];
        break;
      }
      j -= span;
    }
    int n = snprintf(out + len, cap > len ? cap - len : 0, "%.*s%0*ld", (int)g->prefix_len,
                     g->prefix, w, v);
    if (n < 0 || (size_t)n >= (cap > len ? cap - len : 0)) return -1;
    len += (size_t)n;
  }
  int n = snprintf(out + len, cap > len ? cap - len : 0, "%.*s", (int)nm->suffix_len, nm->suffix);
  if (n < 0 || (size_t)n >= (cap > len ? cap - len : 0)) return -1;
  return len + (size_t)n > CHORUS__HOSTNAME_MAX ? -1 : 0;
}

/* Walks the list: counts hosts, or finds host `want` (>= 0) into out. */
static long walk(const char *list, long want, char *out, size_t cap) {
  if (!list || !*list) return -1;
  long total = 0;
  name_t nm;
  for (const char *s = list;;) {
    const char *end = name_end(s);
    if (end == s || parse_name(s, end, &nm) < 0) return -1;
    if (want >= 0 && want < total + nm.count) return name_nth(&nm, want - total, out, cap);
    total += nm.count;
    if (total > CHORUS__HOSTLIST_MAX) return -1;
    if (!*end) break;
    s = end + 1;
    if (!*s) return -1; /* trailing comma */
  }
  if (want >= 0) return -1;
  return total;
}

long chorus__hostlist_count(const char *list) { return walk(list, -1, NULL, 0); }

int chorus__hostlist_nth(const char *list, long n, char *out, size_t cap) {
  if (n < 0 || !out || cap == 0) return -1;
  /* The whole list must be well formed, not only up to host n. */
  if (walk(list, -1, NULL, 0) <= n) return -1;
  return walk(list, n, out, cap) == 0 ? 0 : -1;
}
