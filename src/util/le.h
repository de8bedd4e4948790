/*
 * le.h - little-endian stores and loads of unaligned integers, for every
 * byte format chorus reads or writes (the data wire, the store protocol,
 * handshakes).  Byte by byte, so any alignment and any host byte order work;
 * compilers turn each into one load or store on little-endian machines.
 */
#ifndef CHORUS_UTIL_LE_H
#define CHORUS_UTIL_LE_H

#include <stdint.h>

static inline void chorus__le16_put(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void chorus__le32_put(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void chorus__le64_put(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t chorus__le16_get(const uint8_t *p) {
  return (uint16_t)(p[0] | (unsigned)p[1] << 8);
}
static inline uint32_t chorus__le32_get(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t chorus__le64_get(const uint8_t *p) {
  return (uint64_t)chorus__le32_get(p) | (uint64_t)chorus__le32_get(p + 4) << 32;
}

#endif
