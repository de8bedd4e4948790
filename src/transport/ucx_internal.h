/*
 * ucx_internal.h - what the files of the UCX channel share, and no one
 * else: libucp's function table (ucx_load.c), the channel's wire constants
 * and structures, and the functions its messages (ucx.c), its progress and
 * other calls (ucx_progress.c) and its set-up (ucx_setup.c) call across.
 * Only in a library built with UCX.
 */
#ifndef CHORUS_TRANSPORT_UCX_INTERNAL_H
#define CHORUS_TRANSPORT_UCX_INTERNAL_H

#include <ucp/api/ucp.h>

#include "transport/chan.h"

/* Every UCX function used, as pointers filled from libucp (and, through
 * its dependencies, libucs); the names below stand for them. */
#define UCX_FUNCS(X)                                                    \
  X(ucp_config_read) X(ucp_config_release) X(ucp_init_version) X(ucp_cleanup) \
  X(ucp_worker_create) X(ucp_worker_destroy) X(ucp_worker_get_address)       \
  X(ucp_worker_release_address) X(ucp_worker_get_efd) X(ucp_worker_arm)      \
  X(ucp_worker_progress) X(ucp_worker_set_am_recv_handler) X(ucp_ep_create)  \
  X(ucp_ep_close_nbx) X(ucp_ep_print_info) X(ucp_am_send_nbx)                \
  X(ucp_am_recv_data_nbx) X(ucp_am_data_release) X(ucp_request_free)         \
  X(ucp_request_check_status) X(ucp_request_cancel) X(ucs_status_string)     \
  X(ucp_context_print_info)

typedef struct chorus__ucx_fns {
#define X(f) __typeof__(&f) f;
  UCX_FUNCS(X)
#undef X
} chorus__ucx_fns_t;
extern chorus__ucx_fns_t chorus__ucx_fn;

/* Loads libucp once (the first call); NULL, or why it cannot be used. */
const char *chorus__ucx_load(void);

/* The names below stand for the table's pointers (ucx_load.c, which fills
 * it, does without them). */
#ifndef CHORUS__UCX_LOADER
#define ucp_config_read chorus__ucx_fn.ucp_config_read
#define ucp_config_release chorus__ucx_fn.ucp_config_release
#define ucp_cleanup chorus__ucx_fn.ucp_cleanup
#define ucp_worker_create chorus__ucx_fn.ucp_worker_create
#define ucp_worker_destroy chorus__ucx_fn.ucp_worker_destroy
#define ucp_worker_get_address chorus__ucx_fn.ucp_worker_get_address
#define ucp_worker_release_address chorus__ucx_fn.ucp_worker_release_address
#define ucp_worker_get_efd chorus__ucx_fn.ucp_worker_get_efd
#define ucp_worker_arm chorus__ucx_fn.ucp_worker_arm
#define ucp_worker_progress chorus__ucx_fn.ucp_worker_progress
#define ucp_worker_set_am_recv_handler chorus__ucx_fn.ucp_worker_set_am_recv_handler
#define ucp_ep_create chorus__ucx_fn.ucp_ep_create
#define ucp_ep_close_nbx chorus__ucx_fn.ucp_ep_close_nbx
#define ucp_ep_print_info chorus__ucx_fn.ucp_ep_print_info
#define ucp_am_send_nbx chorus__ucx_fn.ucp_am_send_nbx
#define ucp_am_recv_data_nbx chorus__ucx_fn.ucp_am_recv_data_nbx
#define ucp_am_data_release chorus__ucx_fn.ucp_am_data_release
#define ucp_request_free chorus__ucx_fn.ucp_request_free
#define ucp_request_check_status chorus__ucx_fn.ucp_request_check_status
#define ucp_request_cancel chorus__ucx_fn.ucp_request_cancel
#define ucs_status_string chorus__ucx_fn.ucs_status_string
#define ucp_context_print_info chorus__ucx_fn.ucp_context_print_info
#endif

#define AM_ID 0u
#define AM_HDR (CHORUS__WIRE_HDR_SIZE + 40)
#define OFF_SRC (CHORUS__WIRE_HDR_SIZE)
#define OFF_FLAGS (CHORUS__WIRE_HDR_SIZE + 4)
#define OFF_SEQ (CHORUS__WIRE_HDR_SIZE + 8)
#define OFF_ACK (CHORUS__WIRE_HDR_SIZE + 16)
#define OFF_TOKEN (CHORUS__WIRE_HDR_SIZE + 24)
#define TOKEN_LEN 16
#define F_CREDIT 1u

#define WINDOW 256
#define CREDIT_EVERY 64
#define EAGER_MAX 8192
#define CANCEL_WAIT_MS 200

typedef struct ucx_chan ucx_chan_t;
typedef struct ucx_link ucx_link_t;

/* A message received and not routed yet. */
typedef struct held {
  struct held *next;
  uint64_t seq;
  uint8_t wire[CHORUS__WIRE_HDR_SIZE];
  void *data;   /* UCX's (eager: ucp_am_data_release; rendezvous: its descriptor) */
  size_t len;
  int rndv;
  int own;      /* data is a malloc'ed copy (a callback without persistent data) */
} held_t;

/* A message handed to UCX, until its send completes. */
typedef struct sent {
  struct sent *next, *prev;
  ucx_link_t *l;
  chorus__tx_t *it; /* NULL: a bare acknowledgement, or its message already lost */
  void *req;
  ucs_status_t status;
  uint8_t hdr[AM_HDR];
} sent_t;

/* The payload of a routed rendezvous message, being fetched. */
typedef struct pull {
  struct pull *next, *prev;
  chorus__rx_t rx;   /* attached to the peer; holds where the bytes go */
  ucx_link_t *l;
  const chorus__ep_t *owner; /* endpoint of the receive it writes, NULL: ours */
  void *req;
  ucs_status_t status;
  size_t len;
} pull_t;

struct ucx_link {
  chorus__peer_t *peer;
  ucx_chan_t *ch;
  ucp_ep_h ep;
  int closed;
  const char *fail_what; /* a failure a callback saw, acted on in drive() */
  int fail_protocol;
  char fail_buf[96];
  uint64_t tx_seq;   /* next sequence number to send */
  uint64_t acked;    /* the peer routed every message below this */
  uint64_t rx_next;  /* next sequence number to route */
  uint64_t ack_sent; /* rx_next as last told to the peer */
  chorus__txq_t q;   /* beyond the window: not handed to UCX yet */
  held_t *held;      /* by sequence number */
  int head_routed;   /* the endpoint routed held's head when it resumed */
  int paused;
  int ready;         /* in ch->ready */
  ucx_link_t *next_ready, *next_batch, *next_hb;
  int hb_due;
  int64_t last_sent; /* when a message last went to it */
  chorus__rx_t rx;
  uint8_t tok_in[TOKEN_LEN], tok_out[TOKEN_LEN];
};

struct chorus__ucx_worker {
  ucp_context_h ctx;
  ucp_worker_h worker;
};

struct ucx_chan {
  chorus__chan_t base;
  ucp_context_h ctx;
  ucp_worker_h worker;
  int efd;
  chorus__watch_t watch;
  ucx_link_t *links; /* by world rank */
  uint8_t **addrs;   /* every rank's worker address */
  sent_t *inflight, *completed;
  pull_t *pulls, *pulled;
  sent_t *failed_sends; /* lost once their peers failed (drive) */
  pull_t *failed_pulls;
  ucx_link_t *ready;
  int driving;
  int warned_stranger, warned_arm;
};

/* The two lists of operations UCX holds, doubly linked: sends and
 * fetches move from "in flight" to "completed" in their callbacks. */
#define LIST_PUSH(head, n)        \
  do {                            \
    (n)->prev = NULL;             \
    (n)->next = (head);           \
    if (head) (head)->prev = (n); \
    (head) = (n);                 \
  } while (0)
#define LIST_DEL(head, n)                             \
  do {                                                \
    if ((n)->prev) (n)->prev->next = (n)->next;       \
    else (head) = (n)->next;                          \
    if ((n)->next) (n)->next->prev = (n)->prev;       \
    (n)->next = (n)->prev = NULL;                     \
  } while (0)

/* ---- ucx.c: the wire, sending, receiving */

/* A failure seen inside a callback: the peer fails in drive(). */
void chorus__ucx_defer_fail(ucx_link_t *l, int protocol, const char *fmt, const char *arg);
/* The token of the direction src -> dst of a pair. */
void chorus__ucx_token(const chorus__key_t *key, uint64_t world, int src, int dst,
                       uint8_t out[TOKEN_LEN]);
/* Hands it (NULL: a bare acknowledgement) to UCX.  0, or -1 after failing
 * the peer. */
int chorus__ucx_post(ucx_link_t *l, chorus__tx_t *it);
/* Hands the queued messages the window allows to UCX. */
void chorus__ucx_flush(ucx_link_t *l);
void chorus__ucx_send(chorus__chan_t *base, chorus__peer_t *p, chorus__tx_t *it);
void chorus__ucx_held_release(ucx_chan_t *ch, held_t *m);
/* The active-message handler every peer's messages arrive through. */
ucs_status_t chorus__ucx_am_cb(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param);
/* A fetch completed (or failed): its bytes go to the endpoint layer. */
void chorus__ucx_pull_finish(ucx_chan_t *ch, pull_t *pl);
/* Routes l's messages in sequence order until one must wait. */
void chorus__ucx_route(ucx_link_t *l);
void chorus__ucx_rx_pause(chorus__chan_t *base, chorus__rx_t *rx, int on);

/* ---- ucx_progress.c: progress and the other calls */

/* Creates l's UCX endpoint if it has none: 0, or -1 after failing the peer. */
int chorus__ucx_ensure_ep(ucx_link_t *l);
/* The worker's event descriptor is readable (the progress thread). */
void chorus__ucx_on_efd(void *arg, uint32_t events);
void chorus__ucx_destroy(chorus__chan_t *base);
extern const chorus__chan_ops_t chorus__ucx_ops;

#endif
