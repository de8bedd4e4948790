/* opt.c - strict option values for chorus-train and chorus-data (opt.h). */
#include "opt.h"

#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int refuse(const char *prog, const char *opt, const char *val, const char *why,
                  const char *takes) {
  fprintf(stderr, "%s: %s '%s': %s; it takes %s\n", prog, opt, val, why, takes);
  return -1;
}

/* "a whole number from 1 to 65536", "a whole number of 0 or more" */
static void whole_range(char *buf, size_t n, long long lo, long long hi) {
  if (hi == LLONG_MAX || hi == LONG_MAX || hi == INT_MAX)
    snprintf(buf, n, "a whole number of %lld or more", lo);
  else snprintf(buf, n, "a whole number from %lld to %lld", lo, hi);
}

int opt_long(const char *prog, const char *opt, const char *val, long long lo, long long hi,
             long long *out) {
  char takes[96];
  whole_range(takes, sizeof takes, lo, hi);
  char *end = NULL;
  errno = 0;
  long long x = (*val && !isspace((unsigned char)*val)) ? strtoll(val, &end, 10) : 0;
  if (!end || end == val || *end) return refuse(prog, opt, val, "not a whole number", takes);
  if (errno == ERANGE || x < lo || x > hi) return refuse(prog, opt, val, "out of range", takes);
  *out = x;
  return 0;
}

int opt_int(const char *prog, const char *opt, const char *val, long lo, long hi, int *out) {
  long long x;
  if (lo < INT_MIN) lo = INT_MIN;
  if (hi > INT_MAX) hi = INT_MAX;
  if (opt_long(prog, opt, val, lo, hi, &x) != 0) return -1;
  *out = (int)x;
  return 0;
}

int opt_u64(const char *prog, const char *opt, const char *val, uint64_t *out) {
  const char *takes = "a whole number from 0 to 18446744073709551615";
  char *end = NULL;
  errno = 0;
  unsigned long long x = isdigit((unsigned char)*val) ? strtoull(val, &end, 10) : 0;
  if (!end || end == val || *end) return refuse(prog, opt, val, "not a whole number", takes);
  if (errno == ERANGE) return refuse(prog, opt, val, "out of range", takes);
  *out = x;
  return 0;
}

int opt_double(const char *prog, const char *opt, const char *val, double lo, int lo_open,
               double hi, double *out) {
  char takes[96];
  if (isinf(hi)) snprintf(takes, sizeof takes, "a number %s %g", lo_open ? "above" : "of at least", lo);
  else snprintf(takes, sizeof takes, "a number from %g%s to %g", lo, lo_open ? " (not included)" : "", hi);
  char *end = NULL;
  errno = 0;
  double x = (*val && !isspace((unsigned char)*val)) ? strtod(val, &end) : 0;
  if (!end || end == val || *end || isnan(x)) return refuse(prog, opt, val, "not a number", takes);
  if (errno == ERANGE || !(x >= lo) || (lo_open && x == lo) || !(x <= hi))
    return refuse(prog, opt, val, "out of range", takes);
  *out = x;
  return 0;
}

int opt_float(const char *prog, const char *opt, const char *val, double lo, int lo_open,
              double hi, float *out) {
  double x;
  if (opt_double(prog, opt, val, lo, lo_open, hi, &x) != 0) return -1;
  *out = (float)x;
  return 0;
}

int opt_choice(const char *prog, const char *opt, const char *val, const char *words, int *out) {
  size_t n = strlen(val);
  int i = 0;
  for (const char *w = words; *w; i++) {
    const char *bar = strchr(w, '|');
    size_t len = bar ? (size_t)(bar - w) : strlen(w);
    if (n && len == n && !memcmp(w, val, n)) {
      *out = i;
      return 0;
    }
    if (!bar) break;
    w = bar + 1;
  }
  char takes[160];
  snprintf(takes, sizeof takes, "one of %s", words);
  return refuse(prog, opt, val, "not a choice", takes);
}

int opt_bytes(const char *prog, const char *opt, const char *val, uint64_t *out) {
  const char *takes = "a byte count above 0, with K, M or G for KiB, MiB, GiB (e.g. 8G)";
  char *end = NULL;
  errno = 0;
  double v = (*val && !isspace((unsigned char)*val)) ? strtod(val, &end) : 0;
  if (!end || end == val || isnan(v)) return refuse(prog, opt, val, "not a byte count", takes);
  double k = !*end ? 1 : !strcmp(end, "K") || !strcmp(end, "KiB") ? 1024.0
           : !strcmp(end, "M") || !strcmp(end, "MiB") ? 1048576.0
           : !strcmp(end, "G") || !strcmp(end, "GiB") ? 1073741824.0 : -1;
  if (k < 0) return refuse(prog, opt, val, "not a byte count", takes);
  if (!(v > 0) || !(v * k < 1.8e19)) return refuse(prog, opt, val, "out of range", takes);
  *out = (uint64_t)(v * k);
  return 0;
}

int opt_pair(const char *prog, const char *opt, const char *val, const char *form, long alo,
             long ahi, long blo, long bhi, int *a, int *b) {
  char takes[160], first[64];
  snprintf(takes, sizeof takes, "%s (%ld-%ld:%ld-%ld)", form, alo, ahi, blo, bhi);
  const char *colon = strchr(val, ':');
  size_t n = colon ? (size_t)(colon - val) : 0;
  if (!colon || n >= sizeof first) return refuse(prog, opt, val, "not of that form", takes);
  memcpy(first, val, n);
  first[n] = '\0';
  char *e1 = NULL, *e2 = NULL;
  errno = 0;
  long x = (n && !isspace((unsigned char)first[0])) ? strtol(first, &e1, 10) : 0;
  long y = (colon[1] && !isspace((unsigned char)colon[1])) ? strtol(colon + 1, &e2, 10) : 0;
  if (!e1 || *e1 || e1 == first || !e2 || *e2 || e2 == colon + 1)
    return refuse(prog, opt, val, "not of that form", takes);
  if (errno == ERANGE || x < alo || x > ahi || y < blo || y > bhi)
    return refuse(prog, opt, val, "out of range", takes);
  *a = (int)x;
  *b = (int)y;
  return 0;
}

void opt_getopt_error(const char *prog, int c, char *const *argv) {
  const char *a = optind > 0 ? argv[optind - 1] : "?";
  if (c == ':') fprintf(stderr, "%s: %s needs a value\n", prog, a);
  else if (optopt && strncmp(a, "--", 2)) fprintf(stderr, "%s: '-%c': not an option\n", prog, optopt);
  else fprintf(stderr, "%s: '%s': not an option\n", prog, a);
  opt_see_help(prog);
}

void opt_see_help(const char *prog) {
  fprintf(stderr, "%s --help lists the options\n", prog);
}
