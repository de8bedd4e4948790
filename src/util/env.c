/*
 * env.c - parsing and dumping of the CHORUS_* environment table.
 *
 * Parsing happens once per process under pthread_once; the resulting struct
 * is the only place configuration is read from.  A value that does not parse
 * keeps the default and leaves a message in chorus__env_errors(), which the
 * logger prints at WARN on first use so a typo is never silently ignored.
 */
#include "env.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static chorus__env_t g_env;
static char g_errors[2048];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

int chorus__parse_long(const char *s, long *out) {
  if (!s || !*s) return -1;
  errno = 0;
  char *end = NULL;
  long v = strtol(s, &end, 10);
  if (errno || !end || *end != '\0') return -1;
  *out = v;
  return 0;
}

static int parse_bool(const char *s, int *out) {
  if (!strcmp(s, "1") || !strcasecmp(s, "true") || !strcasecmp(s, "yes") ||
      !strcasecmp(s, "on")) {
    *out = 1;
    return 0;
  }
  if (!strcmp(s, "0") || !strcasecmp(s, "false") || !strcasecmp(s, "no") ||
      !strcasecmp(s, "off") || !*s) {
    *out = 0;
    return 0;
  }
  return -1;
}

static void add_error(const char *name, const char *val, const char *what,
                      const char *def) {
  size_t used = strlen(g_errors);
  snprintf(g_errors + used, sizeof g_errors - used,
           "%sCHORUS_%s='%s' is not %s; using the default %s", used ? "\n" : "",
           name, val, what, def);
}

/* The job secret is copied out of the environment and erased there: the
 * copy in environ's memory is overwritten (it is what /proc/PID/environ
 * shows) and the variable removed, so neither children nor an environment
 * dump in a crash report carry it. */
static char g_secret[1024];

static void take_secret(void) {
  char *v = getenv("CHORUS_JOB_SECRET");
  if (!v) return;
  size_t n = strlen(v);
  if (n >= sizeof g_secret) {
    add_error("JOB_SECRET", "...", "at most 1023 bytes", "(none)");
    n = 0;
  }
  memcpy(g_secret, v, n);
  g_secret[n] = '\0';
  g_env.JOB_SECRET = g_secret;
  memset(v, 0, strlen(v));
  unsetenv("CHORUS_JOB_SECRET");
}

static void env_parse(void) {
  char full[128];
  const char *v;
#define X(name, type, def, doc)                                                 \
  snprintf(full, sizeof full, "CHORUS_%s", #name);                              \
  v = getenv(full);                                                             \
  CHORUS__ENV_PARSE_##type(name, def)
#define CHORUS__ENV_PARSE_INT(name, def)                                        \
  chorus__parse_long(def, &g_env.name);                                         \
  if (v && *v && chorus__parse_long(v, &g_env.name) != 0) {                     \
    chorus__parse_long(def, &g_env.name);                                       \
    add_error(#name, v, "an integer", def);                                     \
  }
#define CHORUS__ENV_PARSE_BOOL(name, def)                                       \
  parse_bool(def, &g_env.name);                                                 \
  if (v && parse_bool(v, &g_env.name) != 0) {                                   \
    parse_bool(def, &g_env.name);                                               \
    add_error(#name, v, "a boolean (0/1)", def);                                \
  }
#define CHORUS__ENV_PARSE_STR(name, def) g_env.name = (v ? v : def);
#include "env.def"
#undef X
  take_secret();
}

const chorus__env_t *chorus__env(void) {
  pthread_once(&g_once, env_parse);
  return &g_env;
}

const char *chorus__env_errors(void) {
  chorus__env();
  return g_errors;
}

void chorus__env_dump(FILE *f, int markdown) {
  char full[128];
  if (markdown) {
    fprintf(f, "| Variable | Default | Meaning |\n|---|---|---|\n");
#define X(name, type, def, doc)                                                 \
  fprintf(f, "| `CHORUS_%s` | `%s` | %s |\n", #name, def, doc);
#include "env.def"
#undef X
    fprintf(f, "\nLauncher contract (what chorusrun sets in every worker's environment; "
               "torchrun's names):\n\n"
               "| Variable | Meaning |\n|---|---|\n");
#define X(name, doc) fprintf(f, "| `%s` | %s |\n", #name, doc);
#define C(name) fprintf(f, "| `CHORUS_%s` | (above) |\n", #name);
#include "env_contract.def"
#undef X
#undef C
    return;
  }
#define X(name, type, def, doc)                                                 \
  snprintf(full, sizeof full, "CHORUS_%s", #name);                              \
  fprintf(f, "%-28s = %-12s (default %s) %s\n", full,                           \
          !strcmp(#name, "JOB_SECRET") ? (chorus__env()->JOB_SECRET[0] ? "<hidden>" : "<unset>") \
          : getenv(full) ? getenv(full) : "<unset>", def, doc);
#include "env.def"
#undef X
#define X(name, doc)                                                            \
  fprintf(f, "%-28s = %-12s %s\n", #name, getenv(#name) ? getenv(#name) : "<unset>", doc);
#define C(name)
#include "env_contract.def"
#undef X
#undef C
}
