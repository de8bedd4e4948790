/*
 * util.c - randomness and a keyed hash for tables.
 *
 * SipHash-2-4 (Aumasson and Bernstein, 2012) is a PRF on short inputs: keyed
 * with random bytes it spreads peer-chosen keys over a hash table without
 * letting the peer choose collisions.  Written from the paper's description.
 */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

void chorus__hex(char *out, const void *bytes, size_t n) {
  static const char digits[] = "0123456789abcdef";
  const uint8_t *b = bytes;
  for (size_t i = 0; i < n; i++) {
    out[2 * i] = digits[b[i] >> 4];
    out[2 * i + 1] = digits[b[i] & 15];
  }
  out[2 * n] = '\0';
}

int chorus__random_bytes(void *buf, size_t n) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
      if (fd < 0) return -errno;
      got = read(fd, p, n);
      int e = errno;
      close(fd);
      if (got <= 0) return got < 0 ? -e : -EIO;
    }
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

static inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

static inline uint64_t load64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v; /* little-endian hosts only (x86-64, aarch64) */
}

#define SIPROUND                                                                \
  do {                                                                         \
    v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);                  \
    v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                                     \
    v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                                     \
    v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);                  \
  } while (0)

uint64_t chorus__siphash(const uint8_t key[16], const void *data, size_t len) {
  const uint8_t *in = data;
  uint64_t k0 = load64(key), k1 = load64(key + 8);
  uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
  uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
  size_t full = len & ~(size_t)7;
  for (size_t i = 0; i < full; i += 8) {
    uint64_t m = load64(in + i);
    v3 ^= m;
    SIPROUND;
    SIPROUND;
    v0 ^= m;
  }
  uint64_t b = (uint64_t)len << 56;
  for (size_t i = 0; i < (len & 7); i++) b |= (uint64_t)in[full + i] << (8 * i);
  v3 ^= b;
  SIPROUND;
  SIPROUND;
  v0 ^= b;
  v2 ^= 0xff;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  SIPROUND;
  return v0 ^ v1 ^ v2 ^ v3;
}
