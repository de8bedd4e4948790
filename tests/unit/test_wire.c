/*
 * test_wire.c - the TCP message header of src/transport/wire.{h,c}: encoding
 * and decoding, the byte layout (little-endian fields at fixed offsets, as
 * documented in wire.h), and chorus__wire_check, the stateless validation
 * tcp_io.c applies to every received header before acting on it.
 *
 * Round trips use pseudo-random headers (every field drawn from all of its
 * bits); the layout test checks single bytes of a header whose every field
 * has a distinct byte pattern, so a swapped, shifted or big-endian field is
 * caught.  The validation test covers each rejection and its message, and
 * the boundary values that must still pass.
 */
#include <stdint.h>

#include "harness.h"
#include "transport/wire.h"

typedef chorus__wire_hdr_t hdr_t;

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static hdr_t random_hdr(uint64_t *s) {
  hdr_t h;
  memset(&h, 0, sizeof h);
  h.magic = (uint32_t)rng_next(s);
  h.type = (uint16_t)rng_next(s);
  h.kind = (uint16_t)rng_next(s);
  h.ep_id = rng_next(s);
  h.seq = rng_next(s);
  h.step = (uint32_t)rng_next(s);
  h.tag = (int32_t)(uint32_t)rng_next(s);
  h.fp.coll = (uint8_t)rng_next(s);
  h.fp.dtype = (uint8_t)rng_next(s);
  h.fp.op = (uint8_t)rng_next(s);
  h.fp.algo = (uint8_t)rng_next(s);
  h.fp.root = (int32_t)(uint32_t)rng_next(s);
  h.fp.count = rng_next(s);
  h.len = rng_next(s);
  return h;
}

static int hdr_equal(const hdr_t *a, const hdr_t *b) {
  return a->magic == b->magic && a->type == b->type && a->kind == b->kind &&
         a->ep_id == b->ep_id && a->seq == b->seq && a->step == b->step && a->tag == b->tag &&
         chorus__fp_equal(&a->fp, &b->fp) && a->len == b->len;
}

/* A header every check accepts: a collective's data message. */
static hdr_t good_data(void) {
  hdr_t h;
  memset(&h, 0, sizeof h);
  h.magic = CHORUS__WIRE_MAGIC;
  h.type = CHORUS__WIRE_DATA;
  h.kind = CHORUS__KIND_COLL;
  h.ep_id = 7;
  h.seq = 3;
  h.tag = -1;
  h.fp.coll = CHORUS_COLL_ALL_REDUCE;
  h.fp.dtype = CHORUS_FLOAT32;
  h.fp.op = CHORUS_SUM;
  h.fp.root = -1;
  h.fp.count = 10;
  h.len = 40;
  return h;
}

static hdr_t control(int type, uint64_t len) {
  hdr_t h;
  memset(&h, 0, sizeof h);
  h.magic = CHORUS__WIRE_MAGIC;
  h.type = (uint16_t)type;
  h.tag = -1;
  h.fp.root = -1;
  h.len = len;
  return h;
}

/* ------------------------------------------------------------- encoding */

TEST(round_trip_random) {
  uint64_t seed = 12345;
  for (int i = 0; i < 100000; i++) {
    hdr_t h = random_hdr(&seed), back;
    uint8_t buf[CHORUS__WIRE_HDR_SIZE + 2];
    buf[CHORUS__WIRE_HDR_SIZE] = 0xa5; /* canaries: nothing written past */
    buf[CHORUS__WIRE_HDR_SIZE + 1] = 0x5a;
    chorus__wire_encode(&h, buf);
    ASSERT_EQ(buf[CHORUS__WIRE_HDR_SIZE], 0xa5);
    ASSERT_EQ(buf[CHORUS__WIRE_HDR_SIZE + 1], 0x5a);
    memset(&back, 0xee, sizeof back);
    chorus__wire_decode(buf, &back);
    ASSERT_TRUE(hdr_equal(&h, &back));
    /* And bytes -> header -> bytes is the identity too. */
    uint8_t again[CHORUS__WIRE_HDR_SIZE];
    chorus__wire_encode(&back, again);
    ASSERT_TRUE(memcmp(buf, again, CHORUS__WIRE_HDR_SIZE) == 0);
  }
}

TEST(decode_random_bytes) {
  uint64_t seed = 777;
  for (int i = 0; i < 20000; i++) {
    uint8_t buf[CHORUS__WIRE_HDR_SIZE], again[CHORUS__WIRE_HDR_SIZE];
    for (int j = 0; j < CHORUS__WIRE_HDR_SIZE; j++) buf[j] = (uint8_t)rng_next(&seed);
    hdr_t h;
    chorus__wire_decode(buf, &h);
    chorus__wire_encode(&h, again);
    ASSERT_TRUE(memcmp(buf, again, CHORUS__WIRE_HDR_SIZE) == 0);
  }
}

/* Little-endian value v of size bytes at p + off. */
static int is_le(const uint8_t *p, int off, int size, uint64_t v) {
  for (int i = 0; i < size; i++)
    if (p[off + i] != (uint8_t)(v >> (8 * i))) return 0;
  return 1;
}

TEST(byte_layout) {
  ASSERT_EQ(CHORUS__WIRE_HDR_SIZE, 56);
  hdr_t h;
  memset(&h, 0, sizeof h);
  h.magic = CHORUS__WIRE_MAGIC;
  h.type = 0x0102;
  h.kind = 0x0304;
  h.ep_id = 0x1112131415161718ull;
  h.seq = 0x2122232425262728ull;
  h.step = 0x31323334u;
  h.tag = -2; /* 0xfffffffe */
  h.fp.coll = 0x41;
  h.fp.dtype = 0x42;
  h.fp.op = 0x43;
  h.fp.algo = 0x44;
  h.fp.root = 0x51525354;
  h.fp.count = 0x6162636465666768ull;
  h.len = 0x7172737475767778ull;
  uint8_t p[CHORUS__WIRE_HDR_SIZE];
  memset(p, 0xcc, sizeof p);
  chorus__wire_encode(&h, p);
  ASSERT_TRUE(memcmp(p, "CHRM", 4) == 0); /* the magic reads "CHRM" */
  ASSERT_TRUE(is_le(p, 0, 4, CHORUS__WIRE_MAGIC));
  ASSERT_TRUE(is_le(p, 4, 2, 0x0102));
  ASSERT_EQ(p[4], 0x02);
  ASSERT_EQ(p[5], 0x01);
  ASSERT_TRUE(is_le(p, 6, 2, 0x0304));
  ASSERT_TRUE(is_le(p, 8, 8, 0x1112131415161718ull));
  ASSERT_EQ(p[8], 0x18);
  ASSERT_EQ(p[15], 0x11);
  ASSERT_TRUE(is_le(p, 16, 8, 0x2122232425262728ull));
  ASSERT_TRUE(is_le(p, 24, 4, 0x31323334u));
  ASSERT_TRUE(is_le(p, 28, 4, 0xfffffffeu));
  ASSERT_EQ(p[32], 0x41);
  ASSERT_EQ(p[33], 0x42);
  ASSERT_EQ(p[34], 0x43);
  ASSERT_EQ(p[35], 0x44);
  ASSERT_TRUE(is_le(p, 36, 4, 0x51525354u));
  ASSERT_TRUE(is_le(p, 40, 8, 0x6162636465666768ull));
  ASSERT_TRUE(is_le(p, 48, 8, 0x7172737475767778ull));
  ASSERT_EQ(p[48], 0x78);
  ASSERT_EQ(p[55], 0x71);

  /* Decoding reads the same offsets: root -1 and tag -1 come back signed. */
  h.tag = -1;
  h.fp.root = -1;
  chorus__wire_encode(&h, p);
  ASSERT_TRUE(is_le(p, 28, 4, 0xffffffffu));
  ASSERT_TRUE(is_le(p, 36, 4, 0xffffffffu));
  hdr_t back;
  chorus__wire_decode(p, &back);
  ASSERT_EQ(back.tag, -1);
  ASSERT_EQ(back.fp.root, -1);
}

TEST(byte_helpers) {
  uint8_t p[8];
  chorus__le16_put(p, 0xbeef);
  ASSERT_EQ(p[0], 0xef);
  ASSERT_EQ(p[1], 0xbe);
  ASSERT_EQ(chorus__le16_get(p), 0xbeef);
  chorus__le32_put(p, 0xdeadbeefu);
  ASSERT_EQ(p[0], 0xef);
  ASSERT_EQ(p[3], 0xde);
  ASSERT_EQ(chorus__le32_get(p), 0xdeadbeefu);
  chorus__le64_put(p, 0x0123456789abcdefull);
  ASSERT_EQ(p[0], 0xef);
  ASSERT_EQ(p[7], 0x01);
  ASSERT_TRUE(chorus__le64_get(p) == 0x0123456789abcdefull);
}

/* ----------------------------------------------------------- validation */

/* Encodes h, decodes it (as on_header does) and checks the result. */
static const char *check_wire(const hdr_t *h) {
  uint8_t p[CHORUS__WIRE_HDR_SIZE];
  hdr_t back;
  chorus__wire_encode(h, p);
  chorus__wire_decode(p, &back);
  return chorus__wire_check(&back);
}

#define ASSERT_OK(h)                                                            \
  do {                                                                         \
    const char *why_ = check_wire(&(h));                                       \
    if (why_) {                                                                \
      HARNESS_FAIL("%s rejected: %s", #h, why_);                               \
      return;                                                                  \
    }                                                                          \
  } while (0)
#define ASSERT_REJECTED(h, reason) ASSERT_STREQ(check_wire(&(h)), reason)

TEST(check_accepts_valid) {
  hdr_t h = good_data();
  ASSERT_OK(h);
  h.kind = CHORUS__KIND_P2P; /* a p2p message */
  h.seq = 0;
  h.tag = 12;
  h.fp.coll = CHORUS_COLL_COUNT - 1;
  h.fp.dtype = CHORUS_DTYPE_COUNT - 1;
  h.fp.op = 0xff; /* none */
  h.fp.algo = 0xff;
  h.fp.root = 0x7fffffff;
  ASSERT_OK(h);
  h = good_data();
  h.len = 0;
  ASSERT_OK(h);
  h.len = CHORUS__WIRE_MAX_PAYLOAD; /* the bound is inclusive */
  ASSERT_OK(h);
  hdr_t ping = control(CHORUS__WIRE_PING, 0), bye = control(CHORUS__WIRE_BYE, 0);
  hdr_t abort0 = control(CHORUS__WIRE_ABORT, 0);
  hdr_t abort_max = control(CHORUS__WIRE_ABORT, CHORUS__WIRE_MAX_ABORT_TEXT);
  ASSERT_OK(ping);
  ASSERT_OK(bye);
  ASSERT_OK(abort0);
  ASSERT_OK(abort_max);
  /* Control messages do not look at kind or the fingerprint. */
  ping.kind = 99;
  ping.fp.coll = 0xff;
  ping.fp.dtype = 0xff;
  ASSERT_OK(ping);
}

TEST(check_bad_magic) {
  hdr_t h = good_data();
  h.magic = 0;
  ASSERT_REJECTED(h, "bad magic");
  h.magic = 0x4348524du; /* "MRHC": the magic byte-swapped */
  ASSERT_REJECTED(h, "bad magic");
  for (int bitno = 0; bitno < 32; bitno++) {
    h.magic = CHORUS__WIRE_MAGIC ^ (1u << bitno);
    ASSERT_REJECTED(h, "bad magic");
  }
  /* The magic is checked first, whatever else is wrong. */
  h = control(77, (uint64_t)1 << 50);
  h.magic = 1;
  ASSERT_REJECTED(h, "bad magic");
  hdr_t hs = good_data();
  hs.magic = 0x43524843u; /* a handshake magic ("CHRC") is not a message */
  ASSERT_REJECTED(hs, "bad magic");
}

TEST(check_unknown_type) {
  static const int bad_types[] = {0, 7, 100, 0x100, 0xffff};
  for (size_t i = 0; i < sizeof bad_types / sizeof bad_types[0]; i++) {
    hdr_t h = good_data();
    h.type = (uint16_t)bad_types[i];
    ASSERT_REJECTED(h, "unknown message type");
    h.len = 0;
    ASSERT_REJECTED(h, "unknown message type");
  }
}

TEST(check_unknown_kind) {
  static const int bad_kinds[] = {0, 3, 4, 0x100, 0xffff};
  for (size_t i = 0; i < sizeof bad_kinds / sizeof bad_kinds[0]; i++) {
    hdr_t h = good_data();
    h.kind = (uint16_t)bad_kinds[i];
    ASSERT_REJECTED(h, "unknown message kind");
  }
}

TEST(check_oversize_length) {
  static const int types[] = {CHORUS__WIRE_DATA, CHORUS__WIRE_ABORT, CHORUS__WIRE_BYE,
                              CHORUS__WIRE_PING, 9};
  static const uint64_t lens[] = {CHORUS__WIRE_MAX_PAYLOAD + 1, (uint64_t)1 << 41,
                                  UINT64_MAX};
  for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
    for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++) {
      hdr_t h = types[t] == CHORUS__WIRE_DATA ? good_data() : control(types[t], 0);
      h.len = lens[l];
      /* Checked before the type: even an unknown type reports the length. */
      ASSERT_REJECTED(h, "payload length out of range");
    }
}

TEST(check_abort_text_too_long) {
  static const uint64_t lens[] = {CHORUS__WIRE_MAX_ABORT_TEXT + 1, 65536, 1u << 30,
                                  CHORUS__WIRE_MAX_PAYLOAD};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    hdr_t h = control(CHORUS__WIRE_ABORT, lens[i]);
    ASSERT_REJECTED(h, "abort text too long");
  }
}

TEST(check_control_with_payload) {
  static const uint64_t lens[] = {1, 2, 4096, CHORUS__WIRE_MAX_PAYLOAD};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    hdr_t ping = control(CHORUS__WIRE_PING, lens[i]), bye = control(CHORUS__WIRE_BYE, lens[i]);
    ASSERT_REJECTED(ping, "heartbeat with payload");
    ASSERT_REJECTED(bye, "goodbye with payload");
  }
}

TEST(check_fingerprint_range) {
  hdr_t h = good_data();
  h.fp.coll = CHORUS_COLL_COUNT;
  ASSERT_REJECTED(h, "fingerprint out of range");
  h.fp.coll = 0xff;
  ASSERT_REJECTED(h, "fingerprint out of range");
  h = good_data();
  h.fp.dtype = CHORUS_DTYPE_COUNT;
  ASSERT_REJECTED(h, "fingerprint out of range");
  h.fp.dtype = 0xff;
  ASSERT_REJECTED(h, "fingerprint out of range");
  h = good_data();
  h.kind = CHORUS__KIND_P2P; /* p2p headers are checked the same way */
  h.fp.dtype = CHORUS_DTYPE_COUNT;
  ASSERT_REJECTED(h, "fingerprint out of range");
  /* The kind is checked before the fingerprint. */
  h.kind = 0;
  ASSERT_REJECTED(h, "unknown message kind");
  /* Every in-range pair passes. */
  for (int coll = 0; coll < CHORUS_COLL_COUNT; coll++)
    for (int dt = 0; dt < CHORUS_DTYPE_COUNT; dt++) {
      h = good_data();
      h.fp.coll = (uint8_t)coll;
      h.fp.dtype = (uint8_t)dt;
      ASSERT_OK(h);
    }
}

/* Random headers: the verdict agrees with an independent statement of the
 * rules, field by field. */
static const char *ref_check(const hdr_t *h) {
  if (h->magic != 0x4d524843u) return "bad magic";
  if (h->len > ((uint64_t)1 << 40)) return "payload length out of range";
  if (h->type == 4) return h->len ? "heartbeat with payload" : NULL;
  if (h->type == 3) return h->len ? "goodbye with payload" : NULL;
  if (h->type == 2) return h->len > 4096 ? "abort text too long" : NULL;
  if (h->type == 6)
    return h->kind || h->step || h->tag || h->fp.coll || h->fp.dtype || h->fp.op ||
                   h->fp.algo || h->fp.root || h->fp.count || !h->len || !h->ep_id
               ? "malformed piece header" : NULL;
  if (h->type == 5 && h->len <= (1u << 20)) return "message in pieces too short to cut";
  if (h->type != 1 && h->type != 5) return "unknown message type";
  if (h->kind != 1 && h->kind != 2) return "unknown message kind";
  if (h->fp.coll >= CHORUS_COLL_COUNT || h->fp.dtype >= CHORUS_DTYPE_COUNT)
    return "fingerprint out of range";
  return NULL;
}

TEST(check_random_against_reference) {
  uint64_t seed = 99;
  int accepted = 0;
  for (int i = 0; i < 200000; i++) {
    hdr_t h = random_hdr(&seed);
    /* Bias toward the interesting region so every branch is reached. */
    uint64_t knobs = rng_next(&seed);
    if (knobs & 1) h.magic = CHORUS__WIRE_MAGIC;
    if (knobs & 2) h.type = (uint16_t)(1 + (knobs >> 8) % 7);
    if (knobs & 4) h.kind = (uint16_t)((knobs >> 16) % 4);
    if (knobs & 8) h.len = (knobs >> 24) % 8192;
    if (knobs & 16) h.len = 0;
    if (knobs & 32) h.fp.coll = (uint8_t)((knobs >> 32) % (CHORUS_COLL_COUNT + 2));
    if (knobs & 64) h.fp.dtype = (uint8_t)((knobs >> 40) % (CHORUS_DTYPE_COUNT + 2));
    const char *want = ref_check(&h), *got = check_wire(&h);
    if (!want) {
      ASSERT_TRUE(got == NULL);
      accepted++;
    } else {
      ASSERT_STREQ(got, want);
    }
  }
  ASSERT_TRUE(accepted > 1000);
}

/* A piece header as tcp_io.c writes one: every field zero but the message
 * number, the offset and the length. */
TEST(check_part) {
  hdr_t h;
  memset(&h, 0, sizeof h);
  h.magic = CHORUS__WIRE_MAGIC;
  h.type = CHORUS__WIRE_PART;
  h.ep_id = 3;
  h.seq = 1 << 20;
  h.len = 1 << 17;
  ASSERT_TRUE(check_wire(&h) == NULL);
  hdr_t b = h;
  b.ep_id = 0; /* messages are numbered from 1 */
  ASSERT_REJECTED(b, "malformed piece header");
  b = h;
  b.len = 0;
  ASSERT_REJECTED(b, "malformed piece header");
  b = h;
  b.kind = CHORUS__KIND_COLL;
  ASSERT_REJECTED(b, "malformed piece header");
  b = h;
  b.fp.count = 1;
  ASSERT_REJECTED(b, "malformed piece header");
  /* A HEAD is a DATA header that must be long enough to cut. */
  hdr_t d = good_data();
  d.type = CHORUS__WIRE_HEAD;
  d.len = CHORUS__WIRE_PART_MAX + 1;
  ASSERT_TRUE(check_wire(&d) == NULL);
  d.len--;
  ASSERT_REJECTED(d, "message in pieces too short to cut");
}

/* The cut both ends compute: pieces of PART_MIN .. PART_MAX (4 KiB
 * multiples but the last) that cover the message exactly, as many as the
 * connections share at the least. */
TEST(parts_cut) {
  uint64_t ps;
  ASSERT_EQ(chorus__wire_parts(1 << 20, 1, &ps), 1);
  ASSERT_EQ(chorus__wire_parts(CHORUS__WIRE_PART_MAX, 4, &ps), 1);
  ASSERT_EQ(chorus__wire_parts(CHORUS__WIRE_PART_MAX + 1, 16, &ps), 9);
  ASSERT_EQ(ps, CHORUS__WIRE_PART_MIN);
  ASSERT_EQ(chorus__wire_parts(4 << 20, 4, &ps), 4);
  ASSERT_EQ(ps, 1u << 20);
  ASSERT_EQ(chorus__wire_parts(64 << 20, 1, &ps), 64); /* one connection: 1 MiB pieces */
  ASSERT_EQ(ps, CHORUS__WIRE_PART_MAX);
  ASSERT_EQ(chorus__wire_parts(3 << 20, 2, &ps), 3);
  uint64_t seed = 7;
  for (int i = 0; i < 100000; i++) {
    uint64_t len = rng_next(&seed) % (64u << 20);
    int k = 1 + (int)(rng_next(&seed) % CHORUS__WIRE_MAX_STREAMS);
    int n = chorus__wire_parts(len, k, &ps);
    ASSERT_TRUE(n >= 1);
    ASSERT_TRUE(ps % 4096 == 0 && ps >= CHORUS__WIRE_PART_MIN && ps <= CHORUS__WIRE_PART_MAX);
    if (n == 1) {
      ASSERT_TRUE(len <= CHORUS__WIRE_PART_MAX);
      continue;
    }
    ASSERT_TRUE(n >= k || ps == CHORUS__WIRE_PART_MIN || ps - len / (uint64_t)k < 4096);
    ASSERT_TRUE((uint64_t)(n - 1) * ps < len && (uint64_t)n * ps >= len);
  }
}

int main(void) {
  RUN(round_trip_random);
  RUN(decode_random_bytes);
  RUN(byte_layout);
  RUN(byte_helpers);
  RUN(check_accepts_valid);
  RUN(check_bad_magic);
  RUN(check_unknown_type);
  RUN(check_part);
  RUN(parts_cut);
  RUN(check_unknown_kind);
  RUN(check_oversize_length);
  RUN(check_abort_text_too_long);
  RUN(check_control_with_payload);
  RUN(check_fingerprint_range);
  RUN(check_random_against_reference);
  return HARNESS_DONE();
}
