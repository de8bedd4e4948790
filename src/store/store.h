/*
 * store.h - internal view of the key-value store (the API itself is public,
 * in chorus.h: chorus_store_*).
 *
 * Wire protocol (all integers little-endian):
 *   every frame:   u32 length of what follows, then that many bytes
 *   handshake:     server -> client  "CHST" u32 version, 16-byte nonce
 *                  client -> server  "CHST" u32 version, u64 siphash(key, nonce)
 *                  server -> client  u8 status (0 ok; else the connection closes)
 *   request body:  u8 command, then command fields; strings and values are
 *                  u32 length + bytes.  Responses: u8 status (0 ok, 1 timeout,
 *                  2 bad request) then result fields.
 * Frames longer than CHORUS__STORE_MAX_FRAME, keys longer than
 * CHORUS__STORE_MAX_KEY and malformed bodies close the connection (the
 * server logs the peer's address:port) without disturbing other clients.
 */
#ifndef CHORUS_STORE_STORE_H
#define CHORUS_STORE_STORE_H

#include <stdint.h>

#include "chorus.h"

#define CHORUS__STORE_MAX_FRAME (64u << 20)
#define CHORUS__STORE_MAX_KEY 4096u

/* Changes the default timeout of a client's blocking calls. */
void chorus__store_set_timeout(chorus_store_t *client, int timeout_ms);

/* get with an explicit timeout (ms, < 0: the client's). */
chorus_result_t chorus__store_get_timeout(chorus_store_t *c, const char *key,
                                          int timeout_ms, void **val, size_t *len);

/* "host:port" the client is connected to. */
const char *chorus__store_address(const chorus_store_t *client);

/* The file descriptor of the client's connection (for getsockname). */
int chorus__store_fd(const chorus_store_t *client);

#endif
