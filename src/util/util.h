/*
 * util.h - small helpers shared by every layer: error-propagation macros,
 * checked arithmetic and a monotonic condition variable.
 */
#ifndef CHORUS_UTIL_UTIL_H
#define CHORUS_UTIL_UTIL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "log.h"
#include "clock.h"

#define CHORUS__MIN(a, b) ((a) < (b) ? (a) : (b))
#define CHORUS__MAX(a, b) ((a) > (b) ? (a) : (b))
#define CHORUS__ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* a * b into *out; returns 0, or -1 on overflow. */
static inline int chorus__mul_overflow(size_t a, size_t b, size_t *out) {
  return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}

/* pthread_cond_t whose timedwait takes CLOCK_MONOTONIC deadlines. */
static inline int chorus__cond_init_monotonic(pthread_cond_t *cond) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  int rc = pthread_cond_init(cond, &attr);
  pthread_condattr_destroy(&attr);
  return rc;
}

/* Fills buf with n bytes from getrandom(2) (falls back to /dev/urandom);
 * returns 0 or -errno. */
int chorus__random_bytes(void *buf, size_t n);

/* Lowercase hex of n bytes into out (2n + 1 bytes, NUL-terminated). */
void chorus__hex(char *out, const void *bytes, size_t n);

/* SipHash-2-4 of data under a 16-byte key: a keyed hash for hash tables
 * and ids that peers must not be able to steer (not for authentication:
 * that is HMAC-SHA256 in crypto.h). */
uint64_t chorus__siphash(const uint8_t key[16], const void *data, size_t len);

#endif
