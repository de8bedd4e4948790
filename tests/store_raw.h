/*
 * store_raw.h - a store client written by hand, for tests that must behave
 * as the library's client never would (strangers, partial frames, held
 * connections): the client half of the handshake, and waiting for the
 * server to close a connection.  Internal headers (store/store_proto.h):
 * link the test to chorus_internal.
 */
#ifndef CHORUS_TEST_STORE_RAW_H
#define CHORUS_TEST_STORE_RAW_H

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

#include "store/store_proto.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/net.h"

/* Waits up to ms for the server to close fd (reads and discards whatever it
 * sends first).  Returns 1 when closed, 0 if still open. */
static inline int store_raw_wait_closed(int fd, int ms) {
  int64_t deadline = chorus__deadline_ms(ms);
  for (;;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int left = chorus__ms_left(deadline);
    if (left == 0) return 0;
    if (poll(&p, 1, left) <= 0) continue;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return 1;
  }
}

/* Runs the client half of the handshake on a fresh connection with key:
 * reads the hello, answers with a fixed nonce and the proof.  Returns the
 * verdict byte (0: authenticated, and the server's own proof checked), or -1
 * on a socket error or a server proof that does not match. */
static inline int store_raw_auth(int fd, const chorus__key_t *key) {
  int64_t dl = chorus__deadline_ms(2000);
  uint8_t hello[4 + CHORUS__STORE_HELLO_LEN];
  if (chorus__net_read_full(fd, hello, sizeof hello, dl) < 0) return -1;
  uint8_t ans[4 + CHORUS__STORE_AUTH_LEN];
  chorus__le32_put(ans, CHORUS__STORE_AUTH_LEN);
  memcpy(ans + 4, CHORUS__STORE_MAGIC, 4);
  chorus__le32_put(ans + 8, CHORUS__STORE_VERSION);
  memset(ans + 12, 7, CHORUS__STORE_NONCE_LEN);
  chorus__store_mac(key, 0, hello + 12, ans + 12, ans + 12 + CHORUS__STORE_NONCE_LEN);
  if (chorus__net_write_full(fd, ans, sizeof ans, dl) < 0) return -1;
  uint8_t verdict[5];
  if (chorus__net_read_full(fd, verdict, sizeof verdict, dl) < 0) return -1;
  if (verdict[4] == CHORUS__STORE_HS_OK) { /* the server's proof follows */
    uint8_t proof[CHORUS__STORE_MAC_LEN], want[CHORUS__STORE_MAC_LEN];
    if (chorus__net_read_full(fd, proof, sizeof proof, dl) < 0) return -1;
    chorus__store_mac(key, 1, hello + 12, ans + 12, want);
    if (memcmp(proof, want, sizeof want)) return -1;
  }
  return verdict[4];
}

#endif
