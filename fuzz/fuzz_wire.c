/*
 * fuzz_wire - the 56-byte message header of the TCP transport (wire.c).
 *
 * The input is cut into 56-byte headers (the last one padded with zeros).
 * For each: decode, encode again (must give the same bytes: every field is
 * kept), chorus__wire_check (must say NULL or one of the reasons wire.h
 * lists, and a header it accepts must satisfy the rules it promises), and
 * the fingerprint formatter failure messages use (algo/registry.c), into
 * buffers of every size the input picks, for the fields the check accepts
 * and for those it does not.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "algo/algo.h"
#include "chorus.h"
#include "fuzz_common.h"
#include "transport/wire.h"

static const char *const reasons[] = {
    "bad magic",
    "payload length out of range",
    "heartbeat with payload",
    "goodbye with payload",
    "abort text too long",
    "unknown message kind",
    "fingerprint out of range",
    "message in pieces too short to cut",
    "malformed piece header",
    "unknown message type",
};

static void one_header(const uint8_t *p) {
  chorus__wire_hdr_t h, h2;
  uint8_t again[CHORUS__WIRE_HDR_SIZE];
  memset(&h, 0xa5, sizeof h);
  chorus__wire_decode(p, &h);
  chorus__wire_encode(&h, again);
  FUZZ_REQUIRE(memcmp(p, again, sizeof again) == 0);
  chorus__wire_decode(again, &h2);
  FUZZ_REQUIRE(h.magic == h2.magic && h.type == h2.type && h.kind == h2.kind &&
               h.ep_id == h2.ep_id && h.seq == h2.seq && h.step == h2.step && h.tag == h2.tag &&
               chorus__fp_equal(&h.fp, &h2.fp) && h.len == h2.len);
  FUZZ_REQUIRE(chorus__le32_get(p) == h.magic && chorus__le64_get(p + 48) == h.len);

  const char *bad = chorus__wire_check(&h);
  if (bad) {
    int known = 0;
    for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
      if (strcmp(bad, reasons[i]) == 0) known = 1;
    FUZZ_REQUIRE(known);
  } else {
    FUZZ_REQUIRE(h.magic == CHORUS__WIRE_MAGIC);
    FUZZ_REQUIRE(h.len <= CHORUS__WIRE_MAX_PAYLOAD);
    switch (h.type) {
      case CHORUS__WIRE_PING:
      case CHORUS__WIRE_BYE:
        FUZZ_REQUIRE(h.len == 0);
        break;
      case CHORUS__WIRE_ABORT:
        FUZZ_REQUIRE(h.len <= CHORUS__WIRE_MAX_ABORT_TEXT);
        break;
      case CHORUS__WIRE_HEAD:
        FUZZ_REQUIRE(h.len > CHORUS__WIRE_PART_MAX);
        __attribute__((fallthrough)); /* and a DATA header's rules */
      case CHORUS__WIRE_DATA:
        FUZZ_REQUIRE(h.kind == CHORUS__KIND_COLL || h.kind == CHORUS__KIND_P2P);
        FUZZ_REQUIRE(h.fp.coll < CHORUS_COLL_COUNT && h.fp.dtype < CHORUS_DTYPE_COUNT);
        break;
      case CHORUS__WIRE_PART:
        FUZZ_REQUIRE(h.len > 0 && h.ep_id > 0 && !h.kind && !h.step && !h.tag && !h.fp.count &&
                     !h.fp.coll && !h.fp.dtype && !h.fp.op && !h.fp.algo && !h.fp.root);
        break;
      default:
        FUZZ_REQUIRE(!"accepted an unknown type");
    }
  }

  /* Failure messages format the fingerprint of any header that reaches the
   * matching code; the formatter must cope with any field values and with
   * any buffer size (snprintf truncation arithmetic). */
  char buf[256];
  size_t cap = (size_t)p[31] % sizeof buf; /* the tag's high byte: any size */
  memset(buf, 0x5a, sizeof buf);
  chorus__fp_format(&h.fp, buf, cap);
  if (cap) FUZZ_REQUIRE(memchr(buf, '\0', cap) != NULL);
  for (size_t i = cap; i < sizeof buf; i++) FUZZ_REQUIRE(buf[i] == 0x5a);
  chorus__fp_format(&h.fp, buf, sizeof buf);
  FUZZ_REQUIRE(memchr(buf, '\0', sizeof buf) != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t hdr[CHORUS__WIRE_HDR_SIZE];
  size_t off = 0;
  do {
    size_t n = size - off < sizeof hdr ? size - off : sizeof hdr;
    memset(hdr, 0, sizeof hdr);
    if (n) memcpy(hdr, data + off, n);
    one_header(hdr);
    off += n;
  } while (off < size);
  return 0;
}
