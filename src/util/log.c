/*
 * log.c - see log.h.  The configuration is a process-wide snapshot taken
 * once from the environment table; the identity (rank/size) is set once the
 * first communicator knows it.
 */
#include "log.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "env.h"

int chorus__log_level = CHORUS__LOG_WARN;
unsigned chorus__log_mask = CHORUS__SUB_ALL;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_fd = 2; /* accessed atomically */
static char g_host[64] = "?";
static int g_rank = -1, g_size = -1; /* accessed atomically */

static const struct {
  const char *name;
  unsigned bit;
} g_subs[] = {{"INIT", CHORUS__SUB_INIT},   {"STORE", CHORUS__SUB_STORE},
              {"TCP", CHORUS__SUB_TCP},     {"COLL", CHORUS__SUB_COLL},
              {"ALGO", CHORUS__SUB_ALGO},   {"LAUNCH", CHORUS__SUB_LAUNCH},
              {"ALL", CHORUS__SUB_ALL}};

static const char *sub_name(unsigned sub) {
  for (size_t i = 0; i < sizeof g_subs / sizeof g_subs[0]; i++)
    if (g_subs[i].bit == sub) return g_subs[i].name;
  return "?";
}

static unsigned parse_mask(const char *s) {
  unsigned mask = 0, excl = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    int neg = tok[0] == '^';
    for (size_t i = 0; i < sizeof g_subs / sizeof g_subs[0]; i++)
      if (!strcasecmp(tok + neg, g_subs[i].name)) *(neg ? &excl : &mask) |= g_subs[i].bit;
  }
  if (!mask) mask = CHORUS__SUB_ALL;
  return mask & ~excl;
}

static void expand_path(const char *pat, char *out, size_t cap) {
  size_t o = 0;
  for (const char *p = pat; *p && o + 1 < cap; p++) {
    if (p[0] == '%' && p[1]) {
      char tmp[80];
      p++;
      if (*p == 'h') snprintf(tmp, sizeof tmp, "%s", g_host);
      else if (*p == 'p') snprintf(tmp, sizeof tmp, "%d", (int)getpid());
      else if (*p == 'r') snprintf(tmp, sizeof tmp, "%d", __atomic_load_n(&g_rank, __ATOMIC_ACQUIRE));
      else snprintf(tmp, sizeof tmp, "%%%c", *p);
      o += (size_t)snprintf(out + o, cap - o, "%s", tmp);
      if (o >= cap) o = cap - 1;
    } else {
      out[o++] = *p;
    }
  }
  out[o] = '\0';
}

static void open_log_file(void) {
  char path[512];
  expand_path(chorus__env()->LOG_FILE, path, sizeof path);
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd >= 0) __atomic_store_n(&g_fd, fd, __ATOMIC_RELEASE);
}

static void log_init_once(void) {
  const chorus__env_t *env = chorus__env();
  gethostname(g_host, sizeof g_host - 1);
  const char *lv = env->LOG_LEVEL;
  if (!strcasecmp(lv, "NONE")) chorus__log_level = CHORUS__LOG_NONE;
  else if (!strcasecmp(lv, "INFO")) chorus__log_level = CHORUS__LOG_INFO;
  else if (!strcasecmp(lv, "DEBUG")) chorus__log_level = CHORUS__LOG_DEBUG;
  else if (!strcasecmp(lv, "TRACE")) chorus__log_level = CHORUS__LOG_TRACE;
  else chorus__log_level = CHORUS__LOG_WARN;
  chorus__log_mask = parse_mask(env->LOG_SUBSYS);
  /* A file name with %r waits for the rank (chorus__log_set_identity);
   * until then lines go to stderr. */
  if (env->LOG_FILE && *env->LOG_FILE && !strstr(env->LOG_FILE, "%r")) open_log_file();
  const char *errs = chorus__env_errors();
  if (*errs && chorus__log_level >= CHORUS__LOG_WARN) {
    char line[2300];
    int n = snprintf(line, sizeof line, "%s:%d chorus WARN %s\n", g_host,
                     (int)getpid(), errs);
    if (n > 0) (void)!write(__atomic_load_n(&g_fd, __ATOMIC_ACQUIRE), line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
  }
}

void chorus__log_init(void) { pthread_once(&g_once, log_init_once); }

void chorus__log_set_identity(int rank, int size) {
  chorus__log_init();
  __atomic_store_n(&g_size, size, __ATOMIC_RELAXED);
  int old = __atomic_exchange_n(&g_rank, rank, __ATOMIC_ACQ_REL);
  const char *file = chorus__env()->LOG_FILE;
  if (old < 0 && file && strstr(file, "%r")) open_log_file();
}

void chorus__log(int level, unsigned sub, const char *file, int line,
                 const char *fmt, ...) {
  static const char *names[] = {"NONE", "WARN", "INFO", "DEBUG", "TRACE"};
  char buf[2048];
  int n;
  int rank = __atomic_load_n(&g_rank, __ATOMIC_ACQUIRE);
  int size = __atomic_load_n(&g_size, __ATOMIC_RELAXED);
  if (rank >= 0)
    n = snprintf(buf, sizeof buf, "%s:%d %d/%d [%s] %s ", g_host, (int)getpid(),
                 rank, size, sub_name(sub), names[level]);
  else
    n = snprintf(buf, sizeof buf, "%s:%d [%s] %s ", g_host, (int)getpid(),
                 sub_name(sub), names[level]);
  if (n < 0) return;
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  va_end(ap);
  if (m < 0) return;
  size_t len = (size_t)n + (size_t)m;
  if (len > sizeof buf - 2) len = sizeof buf - 2;
  if (chorus__log_level >= CHORUS__LOG_DEBUG) {
    const char *base = strrchr(file, '/');
    len += (size_t)snprintf(buf + len, sizeof buf - len, " (%s:%d)",
                            base ? base + 1 : file, line);
    if (len > sizeof buf - 2) len = sizeof buf - 2;
  }
  buf[len++] = '\n';
  (void)!write(__atomic_load_n(&g_fd, __ATOMIC_ACQUIRE), buf, len);
}

void chorus__log_limited(chorus__ratelimit_t *rl, unsigned sub, const char *fmt, ...) {
  if (!CHORUS__LOG_ON(CHORUS__LOG_WARN, sub)) return;
  long long now = chorus__now_ns();
  if (now - rl->window_start_ns >= (long long)CHORUS__LOG_WINDOW_MS * 1000000 ||
      rl->window_start_ns == 0) {
    rl->window_start_ns = now;
    rl->in_window = 0;
  }
  if (rl->in_window >= CHORUS__LOG_BURST) {
    rl->suppressed++;
    return;
  }
  rl->in_window++;
  char msg[1536];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (rl->suppressed) {
    unsigned s = rl->suppressed;
    rl->suppressed = 0;
    chorus__log(CHORUS__LOG_WARN, sub, __FILE__, __LINE__,
                "%s (and %u similar messages suppressed in the last %d s)", msg, s,
                CHORUS__LOG_WINDOW_MS / 1000);
  } else {
    chorus__log(CHORUS__LOG_WARN, sub, __FILE__, __LINE__, "%s%s", msg,
                rl->in_window == CHORUS__LOG_BURST ? " (more like this are suppressed for a while)"
                                                   : "");
  }
}

char *chorus__escape(const char *in, size_t n, char *out, size_t cap) {
  static const char hex[] = "0123456789abcdef";
  size_t o = 0;
  if (!cap) return out;
  for (size_t i = 0; i < n && in[i]; i++) {
    unsigned char ch = (unsigned char)in[i];
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') {
      if (o + 1 >= cap) break;
      out[o++] = (char)ch;
    } else {
      if (o + 4 >= cap) break;
      out[o++] = '\\';
      out[o++] = 'x';
      out[o++] = hex[ch >> 4];
      out[o++] = hex[ch & 15];
    }
  }
  out[o] = '\0';
  return out;
}
