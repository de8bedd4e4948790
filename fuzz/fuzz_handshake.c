/*
 * fuzz_handshake - the data port's acceptor check of a connect message
 * (tcp_handshake.c: chorus__tcp_hs_verify through chorus__tp_fuzz_handshake).  The store's
 * server-side handshake is fuzzed by fuzz_store (modes 0 and 1).
 *
 * Connect message (76 bytes, docs/design.md "Authentication"):
 *   "CHRC" u32 version word v, u32 rank c, nonce Nc (32),
 *   HMAC-SHA256(key, "chorus data connect" W c a v Na Nc)
 * where the fuzzing transport's own nonce Na is 32 zero bytes; v holds the
 * version (bits 0-15), the encryption flag (16), which connection (19-23:
 * 0 the pair's main one, i + 1 the connector's piece connection i) and a
 * count of piece connections (24-28).
 *
 * Input: byte 0 flags, the rest the connect message as it arrives (shorter:
 * zero-padded by the hook; longer: the rest is ignored).
 *   bits 0-1  this rank (mod the size)
 *   bits 2-3  world size - 2 (2..5)
 *   bit 4     replace the message's MAC with the right one for its fields,
 *             so the checks after the proof are reached
 *   bit 5     world rank (this rank + 1) is already connected
 *   bit 6     transport made with another job key (bit 4's MAC is then
 *             made with the fuzzer's key: must be refused)
 * Oracle: a message is accepted (a rank returned) exactly when its magic,
 * version, MAC (checked here independently with libcrypto's HMAC), rank
 * (not this rank, below the size), encryption flag and connection are
 * right: a count of 1 to 16 and a connection index at most the count;
 * the main connection only from a rank not connected yet, a piece
 * connection only from a connected rank and only its first (no count
 * agreed yet); every refusal is one of the four reasons.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "fuzz_common.h"
#include "transport/transport.h"
#include "transport/wire.h"

#define CONNECT_LEN (12 + CHORUS__NONCE_LEN + CHORUS__MAC_LEN)
#define HS_CONNECT 0x43524843u /* "CHRC" */
#define HS_VERSION 3u
#define HS_FLAG_ENCRYPT 0x10000u

static chorus__key_t g_key, g_other_key;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  fuzz_env_init();
  fuzz_job_key(&g_key);
  if (chorus__job_key("ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100", "",
                      &g_other_key) != 0)
    abort();
  return 0;
}

/* What tcp_handshake.c's chorus__tcp_hs_mac computes, written from the protocol's description. */
static void connect_mac(const chorus__key_t *key, uint32_t connector, uint32_t acceptor,
                        uint32_t v, const uint8_t *nc, uint8_t mac[CHORUS__MAC_LEN]) {
  static const char label[] = "chorus data connect"; /* with its NUL */
  static const uint8_t na[CHORUS__NONCE_LEN];
  uint8_t ids[20];
  chorus__le64_put(ids, FUZZ_WORLD_ID);
  chorus__le32_put(ids + 8, connector);
  chorus__le32_put(ids + 12, acceptor);
  chorus__le32_put(ids + 16, v);
  const void *parts[4] = {label, ids, na, nc};
  size_t lens[4] = {sizeof label, sizeof ids, sizeof na, CHORUS__NONCE_LEN};
  chorus__hmac(key, parts, lens, 4, mac);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t flags = data[0];
  int nproc = 2 + ((flags >> 2) & 3);
  int rank = (flags & 3) % nproc;
  const chorus__key_t *tp_key = (flags & 64) ? &g_other_key : &g_key;

  uint8_t msg[CONNECT_LEN + 64];
  size_t n = size - 1 < sizeof msg ? size - 1 : sizeof msg;
  memset(msg, 0, sizeof msg);
  memcpy(msg, data + 1, n);
  uint32_t version = chorus__le32_get(msg + 4), peer = chorus__le32_get(msg + 8);
  if (flags & 16) {
    connect_mac(&g_key, peer, (uint32_t)rank, version, msg + 12, msg + 12 + CHORUS__NONCE_LEN);
    if (n < CONNECT_LEN) n = CONNECT_LEN;
  }

  chorus__tp_t *tp = chorus__tp_fuzz_new(rank, nproc, tp_key, FUZZ_WORLD_ID);
  FUZZ_REQUIRE(tp != NULL);
  int wfd = -1, connected = -1;
  if ((flags & 32) && rank + 1 < nproc) {
    connected = rank + 1;
    FUZZ_REQUIRE(chorus__tp_fuzz_feed(tp, connected, 0, NULL, 0, &wfd) == 0);
  }

  int got = chorus__tp_fuzz_handshake(tp, msg, n);

  uint8_t want[CHORUS__MAC_LEN];
  connect_mac(tp_key, peer, (uint32_t)rank, version, msg + 12, want);
  int mac_ok = memcmp(want, msg + 12 + CHORUS__NONCE_LEN, sizeof want) == 0;
  uint32_t sidx = (version >> 19) & 0x1fu, count = (version >> 24) & 0x1fu;
  int conn_ok = count >= 1 && count <= 16 && sidx <= count &&
                (sidx == 0 ? (int)peer != connected : (int)peer == connected && sidx == 1);
  int ok = chorus__le32_get(msg) == HS_CONNECT && (version & 0xffffu) == HS_VERSION && mac_ok &&
           peer < (uint32_t)nproc && (int)peer != rank && !(version & HS_FLAG_ENCRYPT) && conn_ok;
  if (ok) {
    FUZZ_REQUIRE(got == (int)peer);
  } else {
    FUZZ_REQUIRE(got >= -4 && got <= -1);
  }
  /* A wrong proof is refused as such, before anything else is believed. */
  if (chorus__le32_get(msg) == HS_CONNECT && (version & 0xffffu) == HS_VERSION && !mac_ok)
    FUZZ_REQUIRE(got == -1);

  chorus__tp_fuzz_free(tp);
  if (wfd >= 0) close(wfd);
  return 0;
}
