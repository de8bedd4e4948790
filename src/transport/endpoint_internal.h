/*
 * endpoint_internal.h - what the files of the endpoint layer share, and no
 * one else: the endpoint itself (endpoint.c), its failure model
 * (endpoint_failure.c), the matching of messages to receives
 * (endpoint_match.c) and the progress thread (endpoint_progress.c).
 * Internal to src/transport/; every function here runs with the context's
 * lock held.
 */
#ifndef CHORUS_TRANSPORT_ENDPOINT_INTERNAL_H
#define CHORUS_TRANSPORT_ENDPOINT_INTERNAL_H

#include <stdint.h>

#include "transport/chan.h"
#include "transport/transport.h"
#include "transport/wire.h"

/* Short names for wire.h's header constants. */
#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
#define MSG_MAGIC CHORUS__WIRE_MAGIC
#define MAX_ABORT_TEXT CHORUS__WIRE_MAX_ABORT_TEXT
#define HEARTBEAT_MS CHORUS__HEARTBEAT_MS
enum {
  T_DATA = CHORUS__WIRE_DATA,
  T_ABORT = CHORUS__WIRE_ABORT,
  T_BYE = CHORUS__WIRE_BYE,
  T_PING = CHORUS__WIRE_PING,
  T_HEAD = CHORUS__WIRE_HEAD
};
typedef chorus__wire_hdr_t hdr_t;
typedef chorus__tx_t txitem_t;
typedef chorus__unexp_t unexp_t;
typedef chorus__peer_t peer_t;
typedef chorus__rx_t rx_t;

struct chorus__ep {
  chorus__tp_t *tp;
  struct chorus__ep *next;
  uint64_t id;
  int n, me;
  int *members;  /* group rank -> world rank */
  /* World rank -> group rank (chorus__ep_group): NULL where they are the
   * same (the world's own endpoint), else the members sorted by world
   * rank, n of them -- per endpoint O(n), not O(world size). */
  struct chorus__member *by_world;
  uint64_t cur_seq, done_seq;
  int in_coll;
  chorus__fp_t cur_fp;
  chorus_result_t status;
  char msg[1024];
  char name[256]; /* chorus__ep_doing_locked's text for the current call, formatted on first use */
  chorus__req_t *recvs; /* posted, unmatched receives (FIFO) */
  int failed;           /* atomic copy of status != OK, read without the lock */
  void (*fail_hook)(void *);
  void *fail_arg;
};

/* A member of an endpoint: its world and group ranks. */
struct chorus__member {
  int world, g;
};

/* ep's group rank of world rank w, -1 when w is not a member. */
static inline int chorus__ep_group(const chorus__ep_t *ep, int w) {
  if (!ep->by_world) return w;
  int lo = 0, hi = ep->n;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (ep->by_world[mid].world < w) lo = mid + 1;
    else hi = mid;
  }
  return lo < ep->n && ep->by_world[lo].world == w ? ep->by_world[lo].g : -1;
}

#define wake_all chorus__tp_wake

/* ---- endpoint.c */

/* Queues a control message (T_PING, T_BYE, T_ABORT with text) to c.  tag:
 * for T_ABORT the code the sender failed with (chorus__abort_code), else
 * -1. */
void chorus__tp_send_control(chorus__tp_t *tp, peer_t *c, int type, uint64_t ep_id,
                             const char *text, int32_t tag);

/* ---- endpoint_failure.c */

/* Fails ep (first failure wins): chorus__ep_fail with the lock held. */
void chorus__ep_fail_locked(chorus__ep_t *ep, chorus_result_t code, int notify, const char *fmt,
                            ...) __attribute__((format(printf, 4, 5)));
/* chorus__ep_fail_timeout with the lock held. */
void chorus__ep_fail_timeout_locked(chorus__ep_t *ep, int timeout_ms, const char *who);
/* Fails ep because peer c left while ep still needs it (need: how). */
void chorus__ep_fail_peer_left(chorus__ep_t *ep, peer_t *c, const char *need);
/* Removes every trace of ep's requests from the peers' streams. */
void chorus__ep_detach_requests(chorus__tp_t *tp, chorus__ep_t *ep);
/* The code a peer's ABORT (its tag) makes this rank fail with. */
chorus_result_t chorus__abort_code(int32_t tag);
/* World rank world as a member of ep, with its address, for messages. */
void chorus__ep_peer_desc(chorus__ep_t *ep, int world, char *buf, size_t cap);
/* What ep is doing, for failure messages. */
const char *chorus__ep_doing_locked(chorus__ep_t *ep);
/* Whether c's channel connects it (heartbeats flow both ways). */
int chorus__peer_linked(peer_t *c);
/* Wakes the shared-memory waiters of every endpoint containing world
 * rank w. */
void chorus__tp_wake_hooks_of(chorus__tp_t *tp, int w);
/* The silence detector: fails every peer that sent nothing for the peer
 * timeout (the progress thread, once a heartbeat). */
void chorus__tp_check_silence(chorus__tp_t *tp, int64_t now);

/* ---- endpoint_match.c */

chorus__ep_t *chorus__tp_find_ep(chorus__tp_t *tp, uint64_t id);
/* Checks a data header against what ep executes; fails ep and returns -1 if
 * the sender is in a different call. */
int chorus__ep_check_data_header(chorus__ep_t *ep, const hdr_t *h, int src_world);
/* Frees a buffered message (already unlinked) and gives its bytes back to
 * its sender's budget. */
void chorus__tp_free_unexp(chorus__tp_t *tp, unexp_t *u);
/* Runs every paused stream's message through the routing again (a receive
 * was posted, an endpoint failed or went away, or this rank is leaving). */
void chorus__tp_resume_all(chorus__tp_t *tp);
/* The receive half of chorus__ep_post (ep not failed): takes a message
 * that already arrived, or queues req behind ep's other receives.
 * CHORUS_OK or ep's failure. */
chorus_result_t chorus__ep_post_recv(chorus__ep_t *ep, chorus__req_t *req);

#endif
