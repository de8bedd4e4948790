/*
 * fuzz_tcp_recv - the TCP transport's receive path (tcp_io.c: chorus__tcp_read_stream,
 * on_header, route_data, the unexpected-message list, the receive budget,
 * ABORT/BYE/PING handling, fingerprint and length checks).
 *
 * Each input gets a fresh fuzzing transport (chorus__tp_fuzz_new: world rank
 * 0 of 3, no connections, no progress thread) whose peers' bytes come from
 * the input, through socket pairs, into the real parser.
 *
 * Input layout:
 *   byte 0   flags
 *              bit 0  format fingerprints with the library's formatter
 *                     (algo/registry.c) instead of the transport's default
 *              bit 1  post the receives before the bytes arrive (else after:
 *                     the messages go through the unexpected list)
 *              bit 2  create the subgroup endpoint after the bytes arrived
 *                     (an ABORT for it waits in the unexpected list)
 *              bit 3  afterwards start collective #2 and post its receive
 *                     (chorus__ep_begin checks what arrived for it)
 *              bit 4  destroy the subgroup before the world endpoint
 *              bit 5  end with a wait that times out at once (the timeout
 *                     message: silent and paused peers); else a wait that
 *                     only polls
 *              bit 6  encrypted connections (CHORUS_ENCRYPT=1): each chunk
 *                     of a stream goes out sealed as one record, so the
 *                     parser runs behind open_record
 *              bit 7  with bit 6: flip one bit of rank 1's first record
 *                     (chosen by the chunk size byte), which must fail
 *                     that connection
 *   byte 1   chunk size: the bytes are written and parsed this many at a
 *            time (0: all at once), so headers and payloads arrive split
 *   rest     the byte stream from world rank 1; if it contains the 8-byte
 *            marker "#rank2#\n", what follows is world rank 2's stream.
 *            If rank 1's stream contains "#piece#\n" (and bit 6 is clear),
 *            rank 1 has a piece connection to this rank (tcp_io.c): what
 *            follows the marker is that connection's stream of pieces (PART
 *            headers + bytes); the part before it may carry HEADs.  The streams are fed in alternating chunks.  Each is a
 *            sequence of messages: 56-byte header (transport/wire.h) +
 *            payload.
 *
 * Endpoints and receives (what the seeds in fuzz/corpus/fuzz_tcp_recv aim
 * at):
 *   endpoint 1 (world: 0,1,2), collective #1 = all_reduce(count=4, float32,
 *     sum, algo 0): collective receive from rank 1 step 0 (16 bytes),
 *     collective receive from rank 2 step 1 (0 bytes), p2p receive from
 *     rank 1 tag 5 (8 bytes, uint8 x 8), p2p receive from rank 2 tag 7
 *     (4 bytes, int32 x 1);
 *   endpoint 2 (subgroup: world 0 and 2): p2p receive from group rank 1
 *     (world rank 2) tag 5 (4 bytes, uint8 x 4); world rank 1 is not a
 *     member, so its data for endpoint 2 fails the group.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "algo/algo.h"
#include "chorus.h"
#include "fuzz_common.h"
#include "transport/transport.h"

#define MARKER "#rank2#\n"
#define MARKER_LEN 8
#define PIECE_MARKER "#piece#\n"
#define MAX_FEEDS 4096

static chorus__key_t g_key;
static int g_verbose; /* CHORUS_FUZZ_VERBOSE=1: say what each input did */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_env_init();
  fuzz_job_key(&g_key);
  g_verbose = getenv("CHORUS_FUZZ_VERBOSE") && atoi(getenv("CHORUS_FUZZ_VERBOSE")) > 0;
  return 0;
}

typedef struct peer_stream {
  int world;
  int stream; /* of the pair */
  const uint8_t *p;
  size_t n, off;
  int wfd;
  int dead;
  chorus__aead_t *sealer; /* bit 6: seals each chunk into a record */
  int flip;               /* bit 7: bit to flip in the first record, or -1 */
} peer_stream_t;

static uint8_t g_rec[65536 + 64];

/* Writes the next chunk of s and parses it; a dead connection (protocol
 * violation) is never fed again. */
static void feed(chorus__tp_t *tp, peer_stream_t *s, size_t chunk) {
  size_t k = s->n - s->off;
  if (chunk && k > chunk) k = chunk;
  const uint8_t *out = s->p + s->off;
  size_t outn = k;
  if (s->sealer) {
    outn = chorus__tp_fuzz_seal(s->sealer, s->p + s->off, k, g_rec);
    FUZZ_REQUIRE(outn == k + 4 + CHORUS__AEAD_TAG_LEN);
    if (s->flip >= 0) {
      /* In the ciphertext or tag: the record stays whole, so it must be
       * opened and rejected at once. */
      g_rec[4 + (size_t)s->flip % (outn - 4)] ^= (uint8_t)(1u << (s->flip & 7));
      s->flip = -1;
    }
    out = g_rec;
  }
  if (!s->dead && chorus__tp_fuzz_feed(tp, s->world, s->stream, out, outn, &s->wfd) < 0)
    s->dead = 1;
  s->off = s->dead ? s->n : s->off + k;
}

/* Runs the parser once more over what waits in the socket (a paused
 * connection resumed by a receive posted since). */
static void poke(chorus__tp_t *tp, peer_stream_t *s) {
  if (!s->dead && chorus__tp_fuzz_feed(tp, s->world, s->stream, NULL, 0, &s->wfd) < 0)
    s->dead = 1;
}

static chorus__req_t recv_req(int peer, int kind, uint32_t step, int32_t tag, void *buf, size_t len,
                              uint8_t dtype, uint64_t count) {
  chorus__req_t r;
  memset(&r, 0, sizeof r);
  r.type = CHORUS__REQ_RECV;
  r.peer = peer;
  r.kind = kind;
  r.step = step;
  r.tag = tag;
  r.buf = buf;
  r.len = len;
  r.fp.coll = CHORUS_COLL_SEND;
  r.fp.dtype = dtype;
  r.fp.op = 0xff;
  r.fp.root = -1;
  r.fp.count = count;
  return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  uint8_t flags = data[0];
  size_t chunk = data[1];
  const uint8_t *rest = data + 2;
  size_t nrest = size - 2;

  peer_stream_t s1 = {.world = 1, .p = rest, .n = nrest, .wfd = -1};
  peer_stream_t s2 = {.world = 2, .p = NULL, .n = 0, .wfd = -1};
  const uint8_t *m = nrest >= MARKER_LEN ? memmem(rest, nrest, MARKER, MARKER_LEN) : NULL;
  if (m) {
    s1.n = (size_t)(m - rest);
    s2.p = m + MARKER_LEN;
    s2.n = nrest - s1.n - MARKER_LEN;
  }
  peer_stream_t s1b = {.world = 1, .stream = 1, .p = NULL, .n = 0, .wfd = -1};
  const uint8_t *pm = !(flags & 64) && s1.n >= MARKER_LEN
                          ? memmem(s1.p, s1.n, PIECE_MARKER, MARKER_LEN) : NULL;
  if (pm) {
    s1b.p = pm + MARKER_LEN;
    s1b.n = s1.n - (size_t)(pm - s1.p) - MARKER_LEN;
    s1.n = (size_t)(pm - s1.p);
  }
  /* Bounded work per input, whatever the chunk size. */
  size_t longest = s1.n > s2.n ? s1.n : s2.n;
  if (s1b.n > longest) longest = s1b.n;
  if (chunk && longest / chunk > MAX_FEEDS) chunk = longest / MAX_FEEDS + 1;

  chorus__tp_t *tp = chorus__tp_fuzz_new(0, 3, &g_key, FUZZ_WORLD_ID);
  FUZZ_REQUIRE(tp != NULL);
  s1.flip = s1b.flip = s2.flip = -1;
  if (pm) FUZZ_REQUIRE(chorus__tp_fuzz_pieces(tp, 1, 1) == 0);
  if (flags & 64) {
    s1.sealer = chorus__tp_fuzz_encrypt(tp, 1);
    s2.sealer = chorus__tp_fuzz_encrypt(tp, 2);
    FUZZ_REQUIRE(s1.sealer && s2.sealer);
    if (flags & 128) s1.flip = (int)data[1] * 8 + (data[1] & 7);
  }
  int flip_wanted = (flags & 64) && (flags & 128) && s1.n > 0;
  if (flags & 1) chorus__tp_set_fp_format(tp, chorus__fp_format);

  static const int world[3] = {0, 1, 2}, sub[2] = {0, 2};
  chorus__ep_t *ep = NULL, *ep2 = NULL;
  FUZZ_REQUIRE(chorus__ep_create(tp, 1, world, 3, 0, &ep) == CHORUS_OK);
  if (!(flags & 4)) FUZZ_REQUIRE(chorus__ep_create(tp, 2, sub, 2, 0, &ep2) == CHORUS_OK);

  chorus__fp_t fp1 = {.coll = CHORUS_COLL_ALL_REDUCE,
                      .dtype = CHORUS_FLOAT32,
                      .op = CHORUS_SUM,
                      .algo = 0,
                      .root = -1,
                      .count = 4};
  (void)chorus__ep_begin(ep, 1, &fp1);

  /* Receives stay alive until their endpoint is destroyed (below). */
  uint8_t b_coll[16], b_coll0[1], b_p2p[8], b_p2p2[4], b_sub[4], b_coll2[16];
  chorus__req_t reqs[5];
  reqs[0] = recv_req(1, CHORUS__KIND_COLL, 0, -1, b_coll, sizeof b_coll, 0, 0);
  reqs[1] = recv_req(2, CHORUS__KIND_COLL, 1, -1, b_coll0, 0, 0, 0);
  reqs[2] = recv_req(1, CHORUS__KIND_P2P, 0, 5, b_p2p, sizeof b_p2p, CHORUS_UINT8, 8);
  reqs[3] = recv_req(2, CHORUS__KIND_P2P, 0, 7, b_p2p2, sizeof b_p2p2, CHORUS_INT32, 1);
  chorus__req_t rsub = recv_req(1, CHORUS__KIND_P2P, 0, 5, b_sub, sizeof b_sub, CHORUS_UINT8, 4);
  chorus__req_t rcoll2 = recv_req(1, CHORUS__KIND_COLL, 0, -1, b_coll2, sizeof b_coll2, 0, 0);
  int posted = 0;

#define POST_ALL()                                                   \
  do {                                                               \
    for (int i = 0; i < 4; i++) (void)chorus__ep_post(ep, &reqs[i]); \
    if (ep2) (void)chorus__ep_post(ep2, &rsub);                      \
    posted = 1;                                                      \
  } while (0)

  if (flags & 2) POST_ALL();
  /* Alternate chunks between the two peers until both streams are out. */
  if (s1.n == 0) poke(tp, &s1); /* an empty stream still opens the socket */
  while (s1.off < s1.n || s1b.off < s1b.n || s2.off < s2.n) {
    if (s1.off < s1.n) feed(tp, &s1, chunk);
    if (s1b.off < s1b.n) {
      s1b.dead |= s1.dead; /* one pair: a violation on either ends both */
      feed(tp, &s1b, chunk);
      s1.dead |= s1b.dead;
    }
    if (s2.off < s2.n) feed(tp, &s2, chunk);
  }
  if (flags & 4) FUZZ_REQUIRE(chorus__ep_create(tp, 2, sub, 2, 0, &ep2) == CHORUS_OK);
  if (!posted) {
    POST_ALL();
    poke(tp, &s1);
    if (s1b.p && !s1.dead) poke(tp, &s1b);
    if (s2.p) poke(tp, &s2);
  }
  if (flags & 8) {
    chorus__ep_end(ep, 1);
    chorus__fp_t fp2 = fp1;
    fp2.coll = CHORUS_COLL_BROADCAST;
    fp2.op = 0xff;
    fp2.root = 1;
    (void)chorus__ep_begin(ep, 2, &fp2);
    (void)chorus__ep_post(ep, &rcoll2);
    poke(tp, &s1);
  }

  chorus__req_t *rp[4] = {&reqs[0], &reqs[1], &reqs[2], &reqs[3]};
  if (flags & 32)
    (void)chorus__ep_wait(ep, rp, 4, 0);
  else
    (void)chorus__ep_wait_soft(ep, rp, 4, 0);
  for (int g = 1; g < 3; g++) (void)chorus__ep_check_peer(ep, g, "waits for its data");

  char msg[512], msg2[512], doing[256];
  chorus_result_t st = chorus__ep_status(ep, msg, sizeof msg);
  chorus_result_t st2 = chorus__ep_status(ep2, msg2, sizeof msg2);
  chorus__ep_doing(ep, doing, sizeof doing);
  if (g_verbose) {
    fprintf(stderr,
            "fuzz_tcp_recv: rank 1 %s, rank 2 %s; receives done: coll %d coll0 %d p2p %d "
            "p2p2 %d sub %d coll2 %d\n  endpoint 1: %s %s\n  endpoint 2: %s %s\n  doing: %s\n",
            s1.dead ? "dead" : "alive", s2.dead ? "dead" : "alive", reqs[0].done, reqs[1].done,
            reqs[2].done, reqs[3].done, rsub.done, rcoll2.done, chorus_result_name(st), msg,
            chorus_result_name(st2), msg2, doing);
  }
  for (int g = 0; g < 3; g++) (void)chorus__ep_peer_gone(ep, g);
  /* A record with a flipped bit never passes: rank 1's connection died. */
  if (flip_wanted) FUZZ_REQUIRE(s1.dead);

  if (flags & 16) {
    chorus__ep_destroy(ep2);
    chorus__ep_destroy(ep);
  } else {
    chorus__ep_destroy(ep);
    chorus__ep_destroy(ep2);
  }
  chorus__tp_fuzz_free(tp);
  chorus__aead_free(s1.sealer);
  chorus__aead_free(s2.sealer);
  if (s1.wfd >= 0) close(s1.wfd);
  if (s1b.wfd >= 0) close(s1b.wfd);
  if (s2.wfd >= 0) close(s2.wfd);
  return 0;
}
