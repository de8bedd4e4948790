/*
 * wire.c - encoding, decoding and stateless validation of the TCP message
 * header; the layout is documented in wire.h.
 */
#include <stddef.h>

#include "transport/wire.h"

void chorus__wire_encode(const chorus__wire_hdr_t *h, uint8_t *p) {
  chorus__le32_put(p + 0, h->magic);
  chorus__le16_put(p + 4, h->type);
  chorus__le16_put(p + 6, h->kind);
  chorus__le64_put(p + 8, h->ep_id);
  chorus__le64_put(p + 16, h->seq);
  chorus__le32_put(p + 24, h->step);
  chorus__le32_put(p + 28, (uint32_t)h->tag);
  p[32] = h->fp.coll;
  p[33] = h->fp.dtype;
  p[34] = h->fp.op;
  p[35] = h->fp.algo;
  chorus__le32_put(p + 36, (uint32_t)h->fp.root);
  chorus__le64_put(p + 40, h->fp.count);
  chorus__le64_put(p + 48, h->len);
}

void chorus__wire_decode(const uint8_t *p, chorus__wire_hdr_t *h) {
  h->magic = chorus__le32_get(p + 0);
  h->type = chorus__le16_get(p + 4);
  h->kind = chorus__le16_get(p + 6);
  h->ep_id = chorus__le64_get(p + 8);
  h->seq = chorus__le64_get(p + 16);
  h->step = chorus__le32_get(p + 24);
  h->tag = (int32_t)chorus__le32_get(p + 28);
  h->fp.coll = p[32];
  h->fp.dtype = p[33];
  h->fp.op = p[34];
  h->fp.algo = p[35];
  h->fp.root = (int32_t)chorus__le32_get(p + 36);
  h->fp.count = chorus__le64_get(p + 40);
  h->len = chorus__le64_get(p + 48);
}

const char *chorus__wire_check(const chorus__wire_hdr_t *h) {
  if (h->magic != CHORUS__WIRE_MAGIC) return "bad magic";
  if (h->len > CHORUS__WIRE_MAX_PAYLOAD) return "payload length out of range";
  switch (h->type) {
    case CHORUS__WIRE_PING:
      return h->len ? "heartbeat with payload" : NULL;
    case CHORUS__WIRE_BYE:
      return h->len ? "goodbye with payload" : NULL;
    case CHORUS__WIRE_ABORT:
      return h->len > CHORUS__WIRE_MAX_ABORT_TEXT ? "abort text too long" : NULL;
    case CHORUS__WIRE_HEAD:
      if (h->len <= CHORUS__WIRE_PART_MAX) return "message in pieces too short to cut";
      __attribute__((fallthrough)); /* otherwise a DATA header */
    case CHORUS__WIRE_DATA:
      if (h->kind != CHORUS__KIND_COLL && h->kind != CHORUS__KIND_P2P)
        return "unknown message kind";
      /* Only coll and dtype must be in range (failure messages look their
       * names up); an unknown op or algo is formatted as none / "?", and a
       * fingerprint that differs from this rank's is a mismatch, not a
       * protocol violation. */
      if (h->fp.coll >= CHORUS_COLL_COUNT || h->fp.dtype >= CHORUS_DTYPE_COUNT)
        return "fingerprint out of range";
      return NULL;
    case CHORUS__WIRE_PART:
      if (h->kind || h->step || h->tag || h->fp.coll || h->fp.dtype || h->fp.op || h->fp.algo ||
          h->fp.root || h->fp.count || !h->len || !h->ep_id)
        return "malformed piece header";
      return NULL;
    default:
      return "unknown message type";
  }
}

int chorus__wire_parts(uint64_t len, int k, uint64_t *psize) {
  if (k < 1) k = 1;
  if (k > CHORUS__WIRE_MAX_STREAMS) k = CHORUS__WIRE_MAX_STREAMS;
  uint64_t p = (len + (uint64_t)k - 1) / (uint64_t)k;
  if (p < CHORUS__WIRE_PART_MIN) p = CHORUS__WIRE_PART_MIN;
  if (p > CHORUS__WIRE_PART_MAX) p = CHORUS__WIRE_PART_MAX;
  p = (p + 4095) & ~(uint64_t)4095;
  *psize = p;
  return len <= CHORUS__WIRE_PART_MAX ? 1 : (int)((len + p - 1) / p);
}
