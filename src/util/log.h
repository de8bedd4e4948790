/*
 * log.h - leveled, subsystem-masked logging.
 *
 * CHORUS_WARN(sub, ...), CHORUS_INFO(sub, ...), CHORUS_DEBUG(sub, ...),
 * CHORUS_TRACE(sub, ...) test the level and mask before formatting anything,
 * so a disabled line costs one load and one branch.  Lines look like
 *   host:pid 1/4 [TCP] WARN message
 * The rank/size prefix is a process-wide identity set by the first world
 * communicator (chorus__log_set_identity).  Output goes to stderr or to
 * CHORUS_LOG_FILE.  Each line is written with one write() so lines of
 * concurrent threads and processes do not interleave.
 */
#ifndef CHORUS_UTIL_LOG_H
#define CHORUS_UTIL_LOG_H

#include <stddef.h>

enum {
  CHORUS__LOG_NONE = 0,
  CHORUS__LOG_WARN = 1,
  CHORUS__LOG_INFO = 2,
  CHORUS__LOG_DEBUG = 3,
  CHORUS__LOG_TRACE = 4,
};

enum {
  CHORUS__SUB_INIT = 1u << 0,
  CHORUS__SUB_STORE = 1u << 1,
  CHORUS__SUB_TCP = 1u << 2,
  CHORUS__SUB_COLL = 1u << 3,
  CHORUS__SUB_ALGO = 1u << 4,
  CHORUS__SUB_LAUNCH = 1u << 5,
  CHORUS__SUB_ALL = 0xffffu,
};

/* Compile-time ceiling: lines above it compile to nothing. */
#ifndef CHORUS_LOG_MAX_LEVEL
#define CHORUS_LOG_MAX_LEVEL CHORUS__LOG_TRACE
#endif

extern int chorus__log_level;        /* valid after chorus__log_init() */
extern unsigned chorus__log_mask;

/* Reads CHORUS_LOG_* once; cheap to call again. */
void chorus__log_init(void);
void chorus__log_set_identity(int rank, int size);
void chorus__log(int level, unsigned sub, const char *file, int line,
                 const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define CHORUS__LOG(level, sub, ...)                                            \
  do {                                                                         \
    if ((level) <= CHORUS_LOG_MAX_LEVEL) {                                     \
      chorus__log_init();                                                      \
      if ((level) <= chorus__log_level && ((sub)&chorus__log_mask))            \
        chorus__log((level), (sub), __FILE__, __LINE__, __VA_ARGS__);          \
    }                                                                          \
  } while (0)

/* Whether a line at level for sub would be written (to skip preparing it). */
#define CHORUS__LOG_ON(level, sub)                                              \
  ((level) <= CHORUS_LOG_MAX_LEVEL &&                                          \
   (chorus__log_init(), (level) <= chorus__log_level && ((sub)&chorus__log_mask)))

/* Rate limit for warnings a stranger can cause (rejected connections): at
 * most CHORUS__LOG_BURST lines per CHORUS__LOG_WINDOW_MS; the first line
 * after a quiet window says how many were suppressed.  Zero-initialise; the
 * owner serialises its use (one thread, or under its lock). */
#define CHORUS__LOG_BURST 5
#define CHORUS__LOG_WINDOW_MS 10000
typedef struct chorus__ratelimit {
  long long window_start_ns;
  unsigned in_window, suppressed;
} chorus__ratelimit_t;

/* A WARN line through rl. */
void chorus__log_limited(chorus__ratelimit_t *rl, unsigned sub, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies n bytes of untrusted text (a peer's message) into out (cap bytes,
 * NUL-terminated), printable ASCII as it is and everything else -- control
 * characters, escapes, bytes >= 0x7f -- as \xNN, cut to fit.  Returns out. */
char *chorus__escape(const char *in, size_t n, char *out, size_t cap);

#define CHORUS_WARN(sub, ...) CHORUS__LOG(CHORUS__LOG_WARN, sub, __VA_ARGS__)
#define CHORUS_INFO(sub, ...) CHORUS__LOG(CHORUS__LOG_INFO, sub, __VA_ARGS__)
#define CHORUS_DEBUG(sub, ...) CHORUS__LOG(CHORUS__LOG_DEBUG, sub, __VA_ARGS__)
#define CHORUS_TRACE(sub, ...) CHORUS__LOG(CHORUS__LOG_TRACE, sub, __VA_ARGS__)

#endif
