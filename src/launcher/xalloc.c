/*
 * xalloc.c - chorusrun's allocations that cannot fail: out of memory, the
 * launcher says so and exits (EXIT_LAUNCHER).  Used by every file of the
 * launcher; they live apart from main() so that nothing depends on it.
 */
#include "launcher/launcher.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "chorusrun: out of memory\n");
    exit(EXIT_LAUNCHER);
  }
  return p;
}

char *xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  return memcpy(xmalloc(n), s, n);
}

char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
char *xasprintf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  int n = vasprintf(&s, fmt, ap);
  va_end(ap);
  if (n < 0) {
    fprintf(stderr, "chorusrun: out of memory\n");
    exit(EXIT_LAUNCHER);
  }
  return s;
}
