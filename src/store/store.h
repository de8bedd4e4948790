/*
 * store.h - internal view of the key-value store (the API itself is public,
 * in chorus.h: chorus_store_*).
 *
 * Wire protocol (all integers little-endian):
 *   every frame:   u32 length of what follows, then that many bytes; the
 *                  three handshake messages are frames too
 *   handshake:     server -> client  "CHST" u32 version, 32-byte nonce Ns
 *                  client -> server  "CHST" u32 version, 32-byte nonce Nc,
 *                                    HMAC(key, "chorus store client" Ns Nc)
 *                  server -> client  u8 status (0 ok, 1 wrong secret, 2 bad
 *                                    magic/version; anything but 0 closes
 *                                    the connection), and after a 0
 *                                    HMAC(key, "chorus store server" Ns Nc)
 *                  where key is the job key (util/crypto.h) and HMAC is
 *                  HMAC-SHA256; the client checks the server's proof too.
 *   request body:  u8 command, then command fields; strings and values are
 *                  u32 length + bytes.  Responses: u8 status (0 ok, 1 timeout
 *                  (reserved, never sent: clients apply their own deadline),
 *                  2 bad request, followed by a reason string) then result
 *                  fields.  store_proto.h lists each command's fields.
 * One request is answered at a time per connection, in order; GET and WAIT
 * on missing keys park the request on the server until the keys exist.
 * Frames longer than CHORUS__STORE_MAX_FRAME, keys longer than
 * CHORUS__STORE_MAX_KEY and malformed bodies close the connection (the
 * server logs the peer's address:port) without disturbing other clients.
 * Before the handshake completes no frame may exceed the client's 72-byte
 * answer, and a connection that has not answered within 5 s is closed.
 * After it, the server bounds what each client may hold (store_server.c,
 * "Limits"): a connection idle for CHORUS_STORE_IDLE_TIMEOUT_MS is closed
 * (the client resends its next request on a fresh one), as is one that
 * stops halfway through a frame for CHORUS_STORE_FRAME_TIMEOUT_MS; a request
 * that would pass CHORUS_STORE_DATA_MAX or CHORUS_STORE_KEYS_MAX, or is
 * larger than CHORUS_STORE_BUFFER_MAX, is answered with status 2 and a
 * reason naming the variable ("store full: CHORUS_STORE_DATA_MAX=...").
 */
#ifndef CHORUS_STORE_STORE_H
#define CHORUS_STORE_STORE_H

#include <stdint.h>

#include "chorus.h"
#include "util/crypto.h"

#define CHORUS__STORE_MAX_FRAME (64u << 20)
#define CHORUS__STORE_MAX_KEY 4096u

/* The public chorus_store_server_start / chorus_store_connect with the job
 * key already derived (the communicator and chorusrun derive it once).  key
 * must be set (chorus__job_key); an insecure key is the caller's decision. */
chorus_result_t chorus__store_server_start_key(const char *host, int port,
                                               const chorus__key_t *key,
                                               chorus_store_server_t **server);
chorus_result_t chorus__store_connect_key(const char *host, int port, const chorus__key_t *key,
                                          int timeout_ms, chorus_store_t **client);
/* The same, its connections leaving from the numeric address source
 * (bench/scale plays many hosts' ranks from one machine so). */
chorus_result_t chorus__store_connect_from(const char *host, int port, const char *source,
                                           const chorus__key_t *key, int timeout_ms,
                                           chorus_store_t **client);

/* What a store server did since it started (its own thread counts; any
 * thread may read): requests answered, bytes in and out, connections
 * accepted. */
typedef struct {
  uint64_t requests, bytes_in, bytes_out, accepted;
} chorus__store_stats_t;
void chorus__store_server_stats(const chorus_store_server_t *server, chorus__store_stats_t *out);

/* How many clients the server can hold at once (its descriptor limit less
 * the reserve); and CHORUS_OK when clients fit -- raising the soft limit
 * within the hard one if they need it -- else why not and what to change. */
long chorus__store_server_capacity(const chorus_store_server_t *server);
chorus_result_t chorus__store_server_expect(chorus_store_server_t *server, long clients,
                                            char *why, size_t cap);

/* 1 when the last failed connect of this thread failed because the store
 * refused the key (so a caller that reads its secret from a file may read
 * it again: it may have been replaced). */
int chorus__store_connect_denied(void);

/* How the endpoint of this thread's last failed connect answered, when it
 * accepted the TCP connection but did not complete the handshake as this
 * job's store: a squatter on the port (or a store of another job or
 * version) tells apart from a store that is not up yet (NO_ANSWER:
 * refused, unreachable, not resolvable). */
enum {
  CHORUS__STORE_ANS_NO_ANSWER = 0,
  CHORUS__STORE_ANS_DENIED,   /* a chorus store refused our key */
  CHORUS__STORE_ANS_NO_PROOF, /* it did not prove it holds the key */
  CHORUS__STORE_ANS_GARBAGE,  /* bytes that are not the store's handshake */
  CHORUS__STORE_ANS_VERSION,  /* a chorus store of another protocol version */
  CHORUS__STORE_ANS_SILENT,   /* accepted, then said nothing until the deadline */
  CHORUS__STORE_ANS_CLOSED    /* accepted, then closed, until the deadline */
};
int chorus__store_connect_answer(void);

/* Changes the default timeout of a client's blocking calls (<= 0: the
 * CHORUS_TIMEOUT default).  chorus_store_connect()'s timeout_ms is the
 * initial default (<= 0 there too: CHORUS_TIMEOUT). */
void chorus__store_set_timeout(chorus_store_t *client, int timeout_ms);

/* get with an explicit timeout (ms, < 0: the client's). */
chorus_result_t chorus__store_get_timeout(chorus_store_t *c, const char *key,
                                          int timeout_ms, void **val, size_t *len);

/* Whether key is there now and, when it is (*present = 1), its value
 * (malloc'd, NUL-terminated past len); never waits for it. */
chorus_result_t chorus__store_try_get(chorus_store_t *c, const char *key, int *present,
                                      void **val, size_t *len);

/* get, unless another thread is in a call on c (which may be waiting for
 * something the caller must do first): 0 then, nothing done; else 1 with
 * the call's result in *st. */
int chorus__store_get_if_free(chorus_store_t *c, const char *key, int timeout_ms, void **val,
                              size_t *len, chorus_result_t *st);

/* "host:port" the client is connected to. */
const char *chorus__store_address(const chorus_store_t *client);

/* The file descriptor of the client's connection (for getsockname); -1
 * while it is disconnected (after a timeout, until the next call). */
int chorus__store_fd(const chorus_store_t *client);

/* Reason the last failed chorus_store_connect() of this thread failed ("" if
 * none): chorus_store_connect() has no client to keep it on. */
const char *chorus__store_connect_error(void);

/* How long a new connection may take to authenticate (default 5000 ms);
 * applies to connections accepted afterwards.  For tests. */
void chorus__store_server_set_handshake_timeout(chorus_store_server_t *server,
                                                int timeout_ms);

#endif
