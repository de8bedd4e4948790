/*
 * wire.h - the message header of the TCP transport: its byte layout, its
 * encoding and decoding, and the checks every received header must pass
 * before the transport acts on it.  Pure code (no I/O, no state), shared by
 * tcp_io.c and tests/unit/test_wire.c.
 *
 * Wire format of every message: a 56-byte header followed by `len` payload
 * bytes.  Every field is little-endian, whatever the host.
 *
 *   off size field
 *     0    4 magic "CHRM" (0x4d524843)
 *     4    2 type    DATA=1, ABORT=2, BYE=3, PING=4
 *     6    2 kind    COLL=1, P2P=2 (CHORUS__KIND_*; DATA only)
 *     8    8 endpoint id
 *    16    8 sequence number of the collective (0 for p2p)
 *    24    4 step within the collective
 *    28    4 p2p tag (-1 for collectives)
 *    32    4 coll, dtype, op, algo (one byte each)   } fingerprint
 *    36    4 root                                    } (chorus__fp_t)
 *    40    8 count                                   }
 *    48    8 payload length
 *
 * Types: DATA carries a collective's or p2p message's bytes; ABORT carries
 * the failure text of an endpoint (at most CHORUS__WIRE_MAX_ABORT_TEXT
 * bytes, not NUL-terminated); BYE (goodbye: the sender destroyed its last
 * endpoint, nothing more will come) and PING (heartbeat) carry nothing.
 *
 * Pieces (TCP, between ranks on different hosts).  A DATA message longer
 * than PART_MAX may be sent as a HEAD instead: the same header, len the
 * whole message's length, on the pair's main connection, with no payload
 * there.  Its bytes travel as PARTs on the sender's K piece connections to
 * that peer (CHORUS_SOCKET_NSTREAMS, agreed with the peer), piece i
 * (chorus__wire_parts) on piece connection i mod K: a header whose endpoint
 * field holds the message's number (1 for the first message in pieces
 * from that sender to that peer, counted in HEAD order on the main
 * connection) and whose sequence field holds the piece's offset in the
 * message, len its length; every other field is zero.  Each piece
 * connection carries its pieces of a message in order, and of messages in
 * order.  The receiver routes the message when its HEAD arrives and places
 * each piece at its offset, whatever order the connections deliver them
 * in.  The main connection, meanwhile, carries the next messages: a large
 * transfer delays another message by its header, not its bytes.
 */
#ifndef CHORUS_TRANSPORT_WIRE_H
#define CHORUS_TRANSPORT_WIRE_H

#include <stdint.h>

#include "transport/transport.h"
#include "util/le.h"

#define CHORUS__WIRE_HDR_SIZE 56
#define CHORUS__WIRE_MAGIC 0x4d524843u /* "CHRM" */
#define CHORUS__WIRE_MAX_PAYLOAD ((uint64_t)1 << 40)
#define CHORUS__WIRE_MAX_ABORT_TEXT 4096u

enum {
  CHORUS__WIRE_DATA = 1,
  CHORUS__WIRE_ABORT = 2,
  CHORUS__WIRE_BYE = 3,
  CHORUS__WIRE_PING = 4,
  CHORUS__WIRE_HEAD = 5, /* DATA whose payload travels in pieces (above) */
  CHORUS__WIRE_PART = 6  /* a piece of it, on a piece connection */
};

/* Pieces are at least PART_MIN and at most PART_MAX bytes long (but the
 * last of a message, which may be shorter), and a rank has at most
 * MAX_STREAMS piece connections to a peer. */
#define CHORUS__WIRE_PART_MIN ((uint64_t)128 << 10)
#define CHORUS__WIRE_PART_MAX ((uint64_t)1 << 20)
#define CHORUS__WIRE_MAX_STREAMS 16

/* A decoded header, one member per field above. */
typedef struct chorus__wire_hdr {
  uint32_t magic;
  uint16_t type, kind;
  uint64_t ep_id, seq;
  uint32_t step;
  int32_t tag;
  chorus__fp_t fp;
  uint64_t len;
} chorus__wire_hdr_t;

/* Writes h into the CHORUS__WIRE_HDR_SIZE bytes at p.  Can't fail. */
void chorus__wire_encode(const chorus__wire_hdr_t *h, uint8_t *p);

/* Reads the CHORUS__WIRE_HDR_SIZE bytes at p into h (every field, whatever
 * the bytes are: nothing is checked here).  Can't fail. */
void chorus__wire_decode(const uint8_t *p, chorus__wire_hdr_t *h);

/* The checks that need nothing but the header itself: NULL if h is
 * acceptable, otherwise a static string saying what is wrong ("bad magic",
 * "payload length out of range", "heartbeat with payload", "goodbye with
 * payload", "abort text too long", "unknown message kind", "fingerprint out
 * of range", "message in pieces too short to cut", "malformed piece
 * header", "unknown message type").  A header that fails them is a
 * protocol violation: the transport closes the connection.  The checks that
 * need state (is the sender a member of the endpoint, is the call the one
 * this rank executes) are the endpoint's and tcp_io.c's. */
const char *chorus__wire_check(const chorus__wire_hdr_t *h);

/* How a message of len bytes is cut for k connections: the number of
 * pieces (1: it is not cut -- it is PART_MAX or shorter), each *psize
 * bytes (a multiple of 4096, the share of each connection, within
 * PART_MIN .. PART_MAX) but the last; piece i starts at i * *psize and
 * travels on connection i mod k.  Sender and receiver compute the same
 * cut. */
int chorus__wire_parts(uint64_t len, int k, uint64_t *psize);

#endif
