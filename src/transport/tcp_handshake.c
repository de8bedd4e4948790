/*
 * tcp_handshake.c - the TCP handshake's proofs and the acceptor's check:
 * the MACs of connect and ok, a connection's record keys (CHORUS_ENCRYPT),
 * and what the acceptor makes of a connect message (verify it, then decide
 * against the pair's state here).  The messages are in tcp.h; the states
 * that send and read them are in tcp_connect.c.
 */
#include <stdio.h>
#include <string.h>

#include "transport/tcp.h"
#include "util/util.h"

/* ------------------------------------------------------- proofs and keys */

/* v: the version word of the message the MAC is for (connect or ok). */
void chorus__tcp_hs_mac(const chorus__tp_t *tp, int accept_side, uint32_t connector,
                        uint32_t acceptor, uint32_t v, const uint8_t *na, const uint8_t *nc,
                        uint8_t mac[CHORUS__MAC_LEN]) {
  static const char lc[] = "chorus data connect", la[] = "chorus data accept";
  uint8_t ids[20];
  chorus__le64_put(ids, tp->world_id);
  chorus__le32_put(ids + 8, connector);
  chorus__le32_put(ids + 12, acceptor);
  chorus__le32_put(ids + 16, v);
  const void *parts[4] = {accept_side ? (const void *)la : (const void *)lc, ids, na, nc};
  size_t lens[4] = {accept_side ? sizeof la : sizeof lc, sizeof ids, CHORUS__NONCE_LEN,
                    CHORUS__NONCE_LEN};
  chorus__hmac(&tp->key, parts, lens, 4, mac);
}

/* A connection's two record keys (CHORUS_ENCRYPT): HKDF of the job key
 * over both nonces, the world, both ranks and the stream; connector->acceptor
 * first. */
int chorus__tcp_hs_keys(const chorus__tp_t *tp, uint32_t connector, uint32_t acceptor,
                        uint32_t stream, const uint8_t *na, const uint8_t *nc, uint8_t out[64]) {
  uint8_t salt[2 * CHORUS__NONCE_LEN], info[16 + 20];
  memcpy(salt, na, CHORUS__NONCE_LEN);
  memcpy(salt + CHORUS__NONCE_LEN, nc, CHORUS__NONCE_LEN);
  memcpy(info, "chorus data keys", 16);
  chorus__le64_put(info + 16, tp->world_id);
  chorus__le32_put(info + 24, connector);
  chorus__le32_put(info + 28, acceptor);
  chorus__le32_put(info + 32, stream);
  int rc = chorus__hkdf(&tp->key, salt, sizeof salt, info, sizeof info, out, 64);
  chorus__wipe(salt, sizeof salt);
  return rc;
}

/* --------------------------------------------------- the acceptor's check */

/* Checks a complete connect message; returns the peer's rank, or a negative
 * HS_DENY_* reason with why filled. */
int chorus__tcp_hs_verify(tcp_chan_t *t, const pending_t *p, char *why, size_t cap) {
  chorus__tp_t *tp = t->base.tp;
  const uint8_t *in = p->in;
  uint32_t version = chorus__le32_get(in + 4);
  if (chorus__le32_get(in) != HS_CONNECT || (version & HS_VERSION_MASK) != HS_VERSION) {
    snprintf(why, cap, "not a chorus peer of this version");
    return -HS_DENY_VERSION;
  }
  uint32_t peer = chorus__le32_get(in + 8);
  uint8_t want[CHORUS__MAC_LEN];
  /* The MAC is checked before the claimed rank is believed. */
  chorus__tcp_hs_mac(tp, 0, peer, (uint32_t)tp->rank, version, p->na, in + 12, want);
  if (!chorus__ct_equal(want, in + 12 + CHORUS__NONCE_LEN, sizeof want)) {
    snprintf(why, cap, "authentication failed (no job key, or another world)");
    return -HS_DENY_AUTH;
  }
  if (peer >= (uint32_t)tp->size || (int)peer == tp->rank) {
    snprintf(why, cap, "authenticated peer claims impossible rank %u", peer);
    return -HS_DENY_RANK;
  }
  if (chorus__tp_chan_of(tp, (int)peer) != &t->base) {
    snprintf(why, cap, "rank %u shares this host: it talks over shared memory, not TCP", peer);
    return -HS_DENY_RANK;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    snprintf(why, cap, "rank %u and this rank disagree on CHORUS_ENCRYPT", peer);
    return -HS_DENY_ENCRYPT;
  }
  uint32_t k = HS_NSTREAMS(version), sidx = HS_STREAM(version);
  if (k < 1 || k > MAX_STREAMS || sidx > k) {
    snprintf(why, cap, "rank %u asks for connection %u of %u", peer, sidx, k);
    return -HS_DENY_VERSION;
  }
  return (int)peer;
}

/* What to do with an authenticated peer's connection (sidx 0: the pair's
 * main one; else its piece connection sidx - 1 of k), given the pair's
 * state here: 0 accept it, or a HS_DENY_* reason. */
int chorus__tcp_hs_decide(tcp_chan_t *t, int peer, uint32_t sidx, uint32_t k) {
  const chorus__peer_t *p = chorus__tp_peer_if(t->base.tp, peer); /* NULL: never touched */
  conn_t *c = p ? p->link : NULL;
  if (sidx > 0) /* it dials its piece connections once the pair is connected */
    return c && c->state != C_CLOSED && c->state != C_IDLE && !c->in[sidx - 1] &&
                   (sidx == 1 ? !c->nin : c->nin && k == (uint32_t)c->nin && sidx <= k)
               ? 0 : HS_DENY_RANK;
  if (!c) return 0;
  switch (c->state) {
  case C_IDLE:
  case C_AWAIT:
    return 0;
  case C_CONNECTING:
  case C_HELLO:
  case C_REPLY:
    /* Both dialled: the lower rank's connection wins. */
    return t->base.tp->rank < peer ? HS_DENY_CROSS : 0;
  default:
    /* Connected (or failed) already: the peer's crossing attempt, which it
     * gave up when it accepted ours, arriving late. */
    return HS_DENY_RANK;
  }
}
