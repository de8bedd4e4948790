/*
 * clock.h - monotonic clock and deadlines.  A deadline is an absolute
 * CLOCK_MONOTONIC time in nanoseconds; CHORUS__NO_DEADLINE never expires.
 */
#ifndef CHORUS_UTIL_CLOCK_H
#define CHORUS_UTIL_CLOCK_H

#include <stdint.h>
#include <time.h>

#define CHORUS__NO_DEADLINE INT64_MAX

/* One pause of a spin-wait loop (a hint to the CPU, no system call). */
static inline void chorus__cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static inline int64_t chorus__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Deadline timeout_ms from now; timeout_ms < 0 means none. */
static inline int64_t chorus__deadline_ms(int64_t timeout_ms) {
  if (timeout_ms < 0) return CHORUS__NO_DEADLINE;
  return chorus__now_ns() + timeout_ms * 1000000;
}

/* Milliseconds left until deadline (0 when past, INT32_MAX-ish if none),
 * rounded up so a poll() never returns early and spins. */
static inline int chorus__ms_left(int64_t deadline) {
  if (deadline == CHORUS__NO_DEADLINE) return 0x3fffffff;
  int64_t left = deadline - chorus__now_ns();
  if (left <= 0) return 0;
  int64_t ms = (left + 999999) / 1000000;
  return ms > 0x3fffffff ? 0x3fffffff : (int)ms;
}

/* chorus__ms_left, but at least 1: for a timeout handed to a callee that
 * reads 0 as "its default" (the store client: 300 s) -- a spent deadline
 * must end the call, not restart it. */
static inline int chorus__ms_left_bound(int64_t deadline) {
  int ms = chorus__ms_left(deadline);
  return ms > 0 ? ms : 1;
}

/* The deadline as an absolute CLOCK_MONOTONIC timespec, for
 * pthread_cond_timedwait on a condvar created with chorus__cond_init_monotonic
 * (no deadline: an hour from now; callers loop). */
static inline struct timespec chorus__deadline_timespec(int64_t deadline) {
  struct timespec ts;
  if (deadline == CHORUS__NO_DEADLINE) deadline = chorus__now_ns() + (int64_t)3600 * 1000000000;
  ts.tv_sec = (time_t)(deadline / 1000000000);
  ts.tv_nsec = (long)(deadline % 1000000000);
  return ts;
}

#endif
