/*
 * ucx.c - the UCX channel: every message to a peer is one active message
 * of UCX's UCP layer, which picks the way (InfiniBand or RoCE verbs, shared
 * memory, TCP) and moves large payloads by rendezvous straight into the
 * receive buffer (RDMA where the hardware has it).
 *
 * What goes over UCP.  Each message is an active message whose user header
 * is the 56-byte wire header (wire.h) followed by ours:
 *
 *   56  u32 sender's world rank
 *   60  u32 flags (F_CREDIT: no message, only the acknowledgement)
 *   64  u64 sequence number of the message on this pair and direction
 *   72  u64 acknowledgement: the receiver of this header may send the
 *           sender messages up to (this + WINDOW - 1)
 *   80  16 bytes: the pair's token
 *
 * and whose data is the payload.  Payloads up to EAGER_MAX travel eagerly
 * (UCX copies them); larger ones by rendezvous (the receiver fetches them
 * once it knows where they go).
 *
 * Who may talk to us.  A UCX worker accepts whoever has its address, so
 * every header carries a token only the job's ranks can compute: HMAC of
 * the job key over the world id and both ranks, one per direction of each
 * pair.  A header with a wrong token is dropped unread; one with a good
 * token but a sequence number other than the ones the pair expects next is
 * a protocol violation (a replayed or forged message), and the peer fails.
 * CHORUS_ENCRYPT=1 is not offered on this channel (docs/security.md).
 *
 * Order and memory.  The endpoint layer needs a peer's messages in order,
 * and must be able to stop reading a peer whose messages can go nowhere yet
 * (its budget of early messages is spent).  Messages are routed in sequence
 * order; those that arrive early or while the peer is paused wait here,
 * their data held by UCX (eager) or still at the sender (rendezvous).  The
 * sender may be at most WINDOW messages ahead of what the receiver routed:
 * every header acknowledges what its sender routed, and a receiver that
 * routed CREDIT_EVERY messages without sending anything back sends a bare
 * acknowledgement.  So a peer can make this rank hold at most WINDOW
 * messages of at most EAGER_MAX bytes each, whatever it sends.
 *
 * Progress.  UCX calls back from ucp_worker_progress; the callbacks only
 * note what happened, and drive() acts on it afterwards (routing calls
 * into the endpoint layer, which may send, fail peers or close them --
 * none of which may happen inside a UCX callback).  The progress thread
 * sleeps on the worker's event descriptor, armed before it sleeps.
 *
 * Loading.  libucp is opened with dlopen() by the first rank that asks
 * for UCX (CHORUS_TRANSPORT=ucx), never linked: UCX's memory hooks
 * (libucm intercepts mmap and friends when it loads) stay out of every
 * process that does not use it.
 *
 * Every function here runs with the context's lock held (chan.h).
 */
#include "transport/chan.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>

#ifdef CHORUS_HAVE_UCX

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <ucp/api/ucp.h>

#include "util/env.h"
#include "util/clock.h"
#include "util/le.h"
#include "util/net.h"
#include "util/util.h"

/* ---------------------------------------------------------- loading UCX */

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

static struct {
#define X(f) __typeof__(&f) f;
  UCX_FUNCS(X)
#undef X
} U;
static pthread_once_t g_ucx_once = PTHREAD_ONCE_INIT;
static char g_ucx_error[256];

static void ucx_load(void) {
  void *lib = dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(g_ucx_error, sizeof g_ucx_error, "cannot load UCX (libucp.so.0: %s); install "
             "Debian's libucx0", dlerror());
    return;
  }
  /* dlsym returns void *; POSIX guarantees the conversion works. */
#define X(f)                                                                      \
  if (!(*(void **)&U.f = dlsym(lib, #f))) {                                       \
    snprintf(g_ucx_error, sizeof g_ucx_error, "libucp.so.0 lacks %s (UCX older "  \
             "than 1.13?)", #f);                                                  \
    return;                                                                       \
  }
  UCX_FUNCS(X)
#undef X
  /* Kept loaded: UCX's hooks and threads outlive any one context. */
}

#define ucp_config_read U.ucp_config_read
#define ucp_config_release U.ucp_config_release
#define ucp_cleanup U.ucp_cleanup
#define ucp_worker_create U.ucp_worker_create
#define ucp_worker_destroy U.ucp_worker_destroy
#define ucp_worker_get_address U.ucp_worker_get_address
#define ucp_worker_release_address U.ucp_worker_release_address
#define ucp_worker_get_efd U.ucp_worker_get_efd
#define ucp_worker_arm U.ucp_worker_arm
#define ucp_worker_progress U.ucp_worker_progress
#define ucp_worker_set_am_recv_handler U.ucp_worker_set_am_recv_handler
#define ucp_ep_create U.ucp_ep_create
#define ucp_ep_close_nbx U.ucp_ep_close_nbx
#define ucp_ep_print_info U.ucp_ep_print_info
#define ucp_am_send_nbx U.ucp_am_send_nbx
#define ucp_am_recv_data_nbx U.ucp_am_recv_data_nbx
#define ucp_am_data_release U.ucp_am_data_release
#define ucp_request_free U.ucp_request_free
#define ucp_request_check_status U.ucp_request_check_status
#define ucp_request_cancel U.ucp_request_cancel
#define ucs_status_string U.ucs_status_string
#define ucp_context_print_info U.ucp_context_print_info

/* ------------------------------------------------------------ the wire */

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

static void mark_ready(ucx_link_t *l) {
  if (l->ready) return;
  l->ready = 1;
  l->next_ready = l->ch->ready;
  l->ch->ready = l;
}

/* A failure seen inside a callback: the peer fails in drive(). */
static void defer_fail(ucx_link_t *l, int protocol, const char *fmt, const char *arg) {
  if (l->fail_what) return;
  snprintf(l->fail_buf, sizeof l->fail_buf, fmt, arg);
  l->fail_what = l->fail_buf;
  l->fail_protocol = protocol;
  mark_ready(l);
}

static void token(const chorus__key_t *key, uint64_t world, int src, int dst, uint8_t out[TOKEN_LEN]) {
  uint8_t w[8], s[4], d[4], mac[CHORUS__MAC_LEN];
  chorus__le64_put(w, world);
  chorus__le32_put(s, (uint32_t)src);
  chorus__le32_put(d, (uint32_t)dst);
  static const char label[] = "chorus-ucx-token";
  const void *parts[] = {label, w, s, d};
  const size_t lens[] = {sizeof label - 1, 8, 4, 4};
  chorus__hmac(key, parts, lens, 4, mac);
  memcpy(out, mac, TOKEN_LEN);
}

/* ------------------------------------------------------------- sending */

static void send_cb(void *request, ucs_status_t status, void *user_data) {
  sent_t *s = user_data;
  (void)request;
  s->status = status;
  ucx_chan_t *ch = s->l->ch;
  LIST_DEL(ch->inflight, s);
  LIST_PUSH(ch->completed, s);
}

static int ensure_ep(ucx_link_t *l);
static void ep_drop(ucx_chan_t *ch, ucx_link_t *l, int force);

/* Hands it (NULL: a bare acknowledgement) to UCX.  0, or -1 after failing
 * the peer. */
static int post(ucx_link_t *l, chorus__tx_t *it) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  sent_t *s = calloc(1, sizeof *s);
  if (!s) {
    chorus__tp_peer_failed(tp, l->peer, "could not be sent to (out of memory)", CHORUS_ERR_REMOTE);
    if (it) chorus__tp_tx_lost(tp, l->peer, it);
    return -1;
  }
  s->l = l;
  s->it = it;
  if (it) memcpy(s->hdr, it->hdr, CHORUS__WIRE_HDR_SIZE);
  chorus__le32_put(s->hdr + OFF_SRC, (uint32_t)tp->rank);
  chorus__le32_put(s->hdr + OFF_FLAGS, it ? 0 : F_CREDIT);
  chorus__le64_put(s->hdr + OFF_SEQ, it ? l->tx_seq++ : 0);
  chorus__le64_put(s->hdr + OFF_ACK, l->rx_next);
  memcpy(s->hdr + OFF_TOKEN, l->tok_out, TOKEN_LEN);
  l->ack_sent = l->rx_next;
  l->last_sent = chorus__now_ns();
  size_t len = it ? it->len : 0;
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_FLAGS,
      .flags = len > EAGER_MAX ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER,
      .cb.send = send_cb,
      .user_data = s};
  LIST_PUSH(ch->inflight, s);
  ucs_status_ptr_t r = ucp_am_send_nbx(l->ep, AM_ID, s->hdr, AM_HDR, it ? it->payload : NULL, len, &prm);
  if (r == NULL) { /* done at once */
    LIST_DEL(ch->inflight, s);
    if (it) chorus__tp_tx_done(tp, it);
    free(s);
    return 0;
  }
  if (UCS_PTR_IS_ERR(r)) {
    LIST_DEL(ch->inflight, s);
    char why[160];
    snprintf(why, sizeof why, "could not be sent to (UCX: %s)", ucs_status_string(UCS_PTR_STATUS(r)));
    free(s);
    chorus__tp_peer_failed(tp, l->peer, why, CHORUS_ERR_REMOTE);
    if (it) chorus__tp_tx_lost(tp, l->peer, it);
    return -1;
  }
  s->req = r; /* freed once its callback ran (drive) */
  return 0;
}

/* Hands the queued messages the window allows to UCX. */
static void flush(ucx_link_t *l) {
  while (l->q.head && !l->closed && l->tx_seq < l->acked + WINDOW) {
    chorus__tx_t *it = l->q.head;
    l->q.head = it->next;
    if (!l->q.head) l->q.tail = NULL;
    it->next = NULL;
    if (post(l, it) < 0) return;
  }
}

static void ucx_send(chorus__chan_t *base, chorus__peer_t *p, chorus__tx_t *it) {
  ucx_link_t *l = p->link;
  if (l->closed || ensure_ep(l) < 0) {
    chorus__tp_tx_lost(base->tp, p, it);
    return;
  }
  chorus__txq_push(&l->q, it);
  flush(l);
  /* Whatever is not done yet moves on the progress thread. */
  if (l->ch->inflight || l->q.head) chorus__tp_kick(base->tp);
}

/* ----------------------------------------------------------- receiving */

static void held_release(ucx_chan_t *ch, held_t *m) {
  if (m->own) free(m->data);
  else if (m->data) ucp_am_data_release(ch->worker, m->data);
  free(m);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param) {
  ucx_chan_t *ch = arg;
  chorus__tp_t *tp = ch->base.tp;
  const uint8_t *h = header;
  if (header_length != AM_HDR) goto stranger;
  uint32_t src = chorus__le32_get(h + OFF_SRC);
  if (src >= (uint32_t)tp->size || (int)src == tp->rank) goto stranger;
  ucx_link_t *l = &ch->links[src];
  /* A rank shared memory carries has no link here (peer NULL). */
  if (!l->peer || l->peer->chan != &ch->base ||
      !chorus__ct_equal(h + OFF_TOKEN, l->tok_in, TOKEN_LEN))
    goto stranger;
  if (l->closed || l->fail_what) return UCS_OK; /* dropped with the peer */
  l->peer->last_heard = chorus__now_ns();
  uint64_t ack = chorus__le64_get(h + OFF_ACK);
  if (ack > l->tx_seq) {
    defer_fail(l, 1, "%s", "acknowledged messages never sent");
    return UCS_OK;
  }
  if (ack > l->acked) {
    l->acked = ack;
    if (l->q.head) mark_ready(l);
  }
  if (!l->ep) mark_ready(l); /* heartbeats go back from now on */
  uint32_t flags = chorus__le32_get(h + OFF_FLAGS);
  if (flags & F_CREDIT) return UCS_OK;
  uint64_t seq = chorus__le64_get(h + OFF_SEQ);
  if (seq < l->rx_next || seq - l->rx_next >= WINDOW) {
    defer_fail(l, 1, "%s", "message outside the window (replayed, or sent past its credit)");
    return UCS_OK;
  }
  int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  int keep = rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA);
  /* What may be held is bounded here, before anything is kept: eager
   * payloads of at most EAGER_MAX (larger ones go by rendezvous, and a
   * small one by rendezvous would only make us fetch), each the length its
   * header says. */
  if (rndv != (length > EAGER_MAX)) {
    defer_fail(l, 1, "%s", rndv ? "small message by rendezvous" : "eager message too large");
    return UCS_OK;
  }
  chorus__wire_hdr_t wh;
  chorus__wire_decode(h, &wh);
  if (wh.len != length) {
    defer_fail(l, 1, "%s", "payload length differs from its header");
    return UCS_OK;
  }
  held_t *m = calloc(1, sizeof *m);
  if (!m) {
    defer_fail(l, 0, "%s", "sent a message this rank had no memory to hold");
    return UCS_OK;
  }
  m->seq = seq;
  memcpy(m->wire, h, CHORUS__WIRE_HDR_SIZE);
  m->len = length;
  m->rndv = rndv;
  if (keep) {
    m->data = data;
  } else if (length) {
    m->data = malloc(length); /* at most EAGER_MAX (checked above) */
    m->own = 1;
    if (!m->data) {
      free(m);
      defer_fail(l, 0, "%s", "sent a message this rank had no memory to hold");
      return UCS_OK;
    }
    memcpy(m->data, data, length);
  }
  held_t **pp = &l->held;
  while (*pp && (*pp)->seq < seq) pp = &(*pp)->next;
  if (*pp && (*pp)->seq == seq) {
    if (m->own) free(m->data); /* UCX frees its own when we return UCS_OK */
    free(m);
    defer_fail(l, 1, "%s", "two messages with one sequence number");
    return UCS_OK;
  }
  m->next = *pp;
  *pp = m;
  if (seq == l->rx_next) mark_ready(l);
  return keep ? UCS_INPROGRESS : UCS_OK;
stranger:
  /* Not from a rank of this job (or from another world): never read. */
  if (!ch->warned_stranger) {
    ch->warned_stranger = 1;
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus: dropped a UCX message that is not from a rank of this "
                "job (wrong header or token); further ones are dropped silently");
  }
  return UCS_OK;
}

static void pull_cb(void *request, ucs_status_t status, size_t length, void *user_data) {
  pull_t *pl = user_data;
  (void)request;
  (void)length;
  pl->status = status;
  ucx_chan_t *ch = pl->l->ch;
  LIST_DEL(ch->pulls, pl);
  LIST_PUSH(ch->pulled, pl);
}

/* A fetch that failed fails its peer in drive(), after the messages the
 * peer sent before; its stream stays attached until then (the peer's
 * failure sees a message in progress). */
static void pull_finish(ucx_chan_t *ch, pull_t *pl) {
  chorus__tp_t *tp = ch->base.tp;
  ucx_link_t *l = pl->l;
  if (pl->req) ucp_request_free(pl->req);
  pl->req = NULL;
  if (pl->status != UCS_OK && !l->closed) {
    defer_fail(l, 0, "failed while this rank fetched a message from it (UCX: %s)",
               ucs_status_string(pl->status));
    pl->next = ch->failed_pulls;
    ch->failed_pulls = pl;
    return;
  }
  if (pl->status == UCS_OK && !l->closed) {
    l->peer->last_heard = chorus__now_ns();
    chorus__tp_rx_bytes(tp, &pl->rx, pl->len);
  }
  chorus__tp_rx_detach(l->peer, &pl->rx);
  free(pl);
}

/* l->rx routed message m (its payload, if any, next): moves the payload. */
static void deliver(ucx_link_t *l, held_t *m) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  if (!l->rx.in_payload) { /* nothing to move (or a zero-length payload, done) */
    held_release(ch, m);
    return;
  }
  if (!m->rndv) {
    if (l->rx.dst && m->len) memcpy(l->rx.dst, m->data, m->len);
    held_release(ch, m);
    chorus__tp_rx_bytes(tp, &l->rx, l->rx.left);
    return;
  }
  if (!l->rx.dst) {
    /* Nowhere to go: UCX tells the sender its message was taken. */
    void *desc = m->data;
    m->data = NULL;
    ucp_am_data_release(ch->worker, desc);
    held_release(ch, m);
    chorus__tp_rx_bytes(tp, &l->rx, l->rx.left);
    return;
  }
  pull_t *pl = calloc(1, sizeof *pl);
  if (!pl) {
    held_release(ch, m);
    chorus__tp_peer_failed(tp, l->peer, "sent a message this rank had no memory to fetch",
                           CHORUS_ERR_REMOTE);
    return;
  }
  pl->l = l;
  pl->len = m->len;
  pl->owner = l->rx.req ? l->rx.req->ep : NULL;
  chorus__tp_rx_attach(tp, l->peer, &pl->rx, &ch->base, l);
  chorus__tp_rx_move(&l->rx, &pl->rx);
  pl->rx.src = l->peer->rank;
  pl->rx.dst_fixed = 1; /* UCX fetches into it from now on */
  LIST_PUSH(ch->pulls, pl);
  ucp_request_param_t prm = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
      .cb.recv_am = pull_cb,
      .user_data = pl};
  void *desc = m->data;
  m->data = NULL;
  free(m);
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(ch->worker, desc, pl->rx.dst, pl->len, &prm);
  if (r == NULL || UCS_PTR_IS_ERR(r)) {
    LIST_DEL(ch->pulls, pl);
    pl->status = r ? UCS_PTR_STATUS(r) : UCS_OK;
    pull_finish(ch, pl);
    return;
  }
  pl->req = r;
}

/* Routes l's messages in sequence order until one must wait. */
static void route(ucx_link_t *l) {
  ucx_chan_t *ch = l->ch;
  chorus__tp_t *tp = ch->base.tp;
  while (!l->paused && !l->closed && !l->peer->dead && l->held && l->held->seq == l->rx_next) {
    held_t *m = l->held;
    if (!l->head_routed) {
      chorus__wire_hdr_t h;
      chorus__wire_decode(m->wire, &h);
      if (h.len != m->len) {
        chorus__tp_protocol_error(tp, l->peer, "payload length differs from its header");
        return;
      }
      memcpy(l->rx.hbuf, m->wire, CHORUS__WIRE_HDR_SIZE);
      l->rx.hgot = CHORUS__WIRE_HDR_SIZE;
      chorus__tp_rx_header(tp, &l->rx);
      if (l->closed || l->peer->dead || l->paused) return; /* waits at the head */
    }
    l->head_routed = 0;
    l->held = m->next;
    l->rx_next++;
    deliver(l, m);
  }
  if (!l->closed && !l->peer->dead && l->rx_next - l->ack_sent >= CREDIT_EVERY && l->ep)
    post(l, NULL);
}

static void ucx_rx_pause(chorus__chan_t *base, chorus__rx_t *rx, int on) {
  ucx_link_t *l = rx->link;
  if (rx != &l->rx) return; /* a pull never pauses */
  if (on) {
    l->paused = 1;
    return;
  }
  /* The endpoint routed the head again (try_resume): its payload next. */
  l->paused = 0;
  l->head_routed = 1;
  mark_ready(l);
  chorus__tp_kick(base->tp);
}

/* -------------------------------------------------------------- progress */

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
  ucx_link_t *l = arg;
  (void)ep;
  defer_fail(l, 0, "became unreachable (its UCX endpoint failed: %s)", ucs_status_string(status));
}

static int ensure_ep(ucx_link_t *l) {
  if (l->ep) return 0;
  ucx_chan_t *ch = l->ch;
  int r = l->peer->rank;
  ucp_ep_params_t prm = {
      .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER,
      .address = (const ucp_address_t *)ch->addrs[r],
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = ep_err_cb, .arg = l}};
  ucs_status_t st = ucp_ep_create(ch->worker, &prm, &l->ep);
  if (st != UCS_OK) {
    l->ep = NULL;
    char why[160];
    snprintf(why, sizeof why, "cannot be reached (UCX endpoint: %s)", ucs_status_string(st));
    chorus__tp_peer_failed(ch->base.tp, l->peer, why, CHORUS_ERR_REMOTE);
    return -1;
  }
  return 0;
}

/* The endpoint layer sends a peer heartbeats only while nothing is queued
 * to it (over TCP the queued bytes themselves say the sender is alive).
 * Here a large message waits at the sender until the receiver fetches it,
 * which may take longer than the peer timeout on a slow link: so a link
 * with a message in flight and nothing else sent for a heartbeat period
 * gets a bare acknowledgement, which the peer counts as hearing from us. */
static void heartbeats(ucx_chan_t *ch) {
  int64_t now = chorus__now_ns(), period = (int64_t)CHORUS__HEARTBEAT_MS * 1000000;
  ucx_link_t *due = NULL;
  for (sent_t *s = ch->inflight; s; s = s->next) {
    ucx_link_t *l = s->l;
    if (l->hb_due || l->closed || l->fail_what || !l->ep || now - l->last_sent < period) continue;
    l->hb_due = 1;
    l->next_hb = due;
    due = l;
  }
  while (due) {
    ucx_link_t *l = due;
    due = l->next_hb;
    l->hb_due = 0;
    if (!l->closed) post(l, NULL);
  }
}

/* Acts on what the callbacks noted, until UCX has nothing more. */
static void drive(ucx_chan_t *ch) {
  chorus__tp_t *tp = ch->base.tp;
  if (ch->driving) return;
  ch->driving = 1;
  for (int rounds = 0; rounds < 64; rounds++) {
    unsigned n = 0;
    for (int k = 0; k < 256 && ucp_worker_progress(ch->worker); k++) n++;
    int did = 0;
    while (ch->completed) {
      sent_t *s = ch->completed;
      LIST_DEL(ch->completed, s);
      did = 1;
      ucx_link_t *l = s->l;
      if (s->req) ucp_request_free(s->req);
      s->req = NULL;
      chorus__tx_t *it = s->it;
      /* A receiver that had nowhere to put a rendezvous payload
       * declines it: delivered as far as this rank is concerned. */
      ucs_status_t status = s->status;
      int ok = status == UCS_OK || (status == UCS_ERR_CANCELED && !l->closed);
      if (!it || ok) {
        free(s);
        if (it) chorus__tp_tx_done(tp, it);
        continue;
      }
      /* The peer fails first, after what it sent before (its endpoints
       * fail and tell the others why), then this message is lost with it. */
      if (!l->closed)
        defer_fail(l, 0, "could not be sent to (UCX: %s)", ucs_status_string(status));
      s->next = ch->failed_sends;
      ch->failed_sends = s;
    }
    while (ch->pulled) {
      pull_t *pl = ch->pulled;
      LIST_DEL(ch->pulled, pl);
      did = 1;
      pull_finish(ch, pl);
    }
    /* Messages first, failures after: what a peer sent before its
     * endpoint failed (a goodbye, an ABORT naming the real cause) is
     * routed before the failure is acted on. */
    ucx_link_t *batch = NULL;
    while (ch->ready) {
      ucx_link_t *l = ch->ready;
      ch->ready = l->next_ready;
      l->ready = 0;
      l->next_batch = batch;
      batch = l;
      did = 1;
    }
    for (ucx_link_t *l = batch; l; l = l->next_batch) {
      if (l->closed || l->fail_protocol) continue;
      if (!l->ep && !l->fail_what && ensure_ep(l) < 0) continue;
      route(l);
      if (!l->fail_what) flush(l);
    }
    for (ucx_link_t *l = batch; l; l = l->next_batch) {
      if (l->closed || !l->fail_what) continue;
      if (l->fail_protocol) chorus__tp_protocol_error(tp, l->peer, l->fail_what);
      else chorus__tp_peer_failed(tp, l->peer, l->fail_what, CHORUS_ERR_REMOTE);
    }
    while (ch->failed_sends) { /* their peers failed just now */
      sent_t *s = ch->failed_sends;
      ch->failed_sends = s->next;
      chorus__tp_tx_lost(tp, s->l->peer, s->it);
      free(s);
      did = 1;
    }
    while (ch->failed_pulls) {
      pull_t *pl = ch->failed_pulls;
      ch->failed_pulls = pl->next;
      chorus__tp_rx_detach(pl->l->peer, &pl->rx);
      free(pl);
      did = 1;
    }
    if (!n && !did) break;
  }
  heartbeats(ch);
  ch->driving = 0;
}

static void on_efd(void *arg, uint32_t events) {
  (void)events;
  drive(arg);
}

static void ucx_poll(chorus__chan_t *base) { drive((ucx_chan_t *)base); }

static int ucx_idle(chorus__chan_t *base, int sleeping) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  if (!sleeping) return 0;
  for (int k = 0; k < 16; k++) {
    drive(ch);
    ucs_status_t st = ucp_worker_arm(ch->worker);
    /* Armed, but work of ours left (a heartbeat failed a peer): again. */
    if (st == UCS_OK) return ch->ready || ch->completed || ch->pulled;
    if (st != UCS_ERR_BUSY) {
      /* Cannot arm: the progress thread's heartbeat tick (and the
       * channel's poll) keep it going, slower; said once. */
      if (!ch->warned_arm) {
        ch->warned_arm = 1;
        CHORUS_WARN(CHORUS__SUB_TCP, "chorus: cannot arm the UCX worker's event descriptor "
                    "(%s): UCX progresses every %d ms only", ucs_status_string(st),
                    CHORUS__HEARTBEAT_MS / 2);
      }
      return 0;
    }
  }
  return 1; /* still busy: look again at once */
}

/* ------------------------------------------------------ the other calls */

/* Progresses UCX (callbacks only note) until ep's operations with l are
 * done or the deadline passed: 0 when they are. */
static int wait_ops(ucx_link_t *l, const chorus__ep_t *ep, int64_t deadline) {
  ucx_chan_t *ch = l->ch;
  for (;;) {
    int busy = 0;
    for (sent_t *s = ch->inflight; s && !busy; s = s->next)
      if (s->l == l && s->it && s->it->ep == ep) busy = 1;
    for (pull_t *pl = ch->pulls; pl && !busy; pl = pl->next)
      if (pl->l == l && pl->owner == ep) busy = 1;
    if (!busy) return 0;
    if (chorus__now_ns() >= deadline) return -1;
    ucp_worker_progress(ch->worker);
  }
}

static int ucx_cancel(chorus__chan_t *base, chorus__peer_t *p, chorus__ep_t *ep) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  ucx_link_t *l = p->link;
  int rc = chorus__txq_cancel(&l->q, ep);
  /* Handed to UCX: its sends read ep's buffers and its fetches write them
   * until they complete; they must before the caller frees them.  With a
   * peer that failed (its endpoints are failing now, before its close),
   * the endpoint is closed at once, which cancels its sends.  A live peer
   * finishes them within a round trip (it declines what its own failed
   * endpoint no longer wants); one that does not within CANCEL_WAIT_MS is
   * stopped, cut off or holding the message back for its receive budget,
   * and fails (-1), which ends them. */
  if (p->dead) ep_drop(ch, l, 1);
  if (wait_ops(l, ep, chorus__now_ns() + (int64_t)(p->dead ? 0 : CANCEL_WAIT_MS) * 1000000) < 0)
    return -1;
  for (sent_t *s = ch->completed; s; s = s->next)
    if (s->l == l && s->it && s->it->ep == ep) {
      s->it->req = NULL;
      s->it->ep = NULL;
    }
  for (pull_t *pl = ch->pulled; pl; pl = pl->next)
    if (pl->l == l && pl->owner == ep) pl->owner = NULL;
  return rc;
}

static int ucx_pending(chorus__chan_t *base, chorus__peer_t *p, const chorus__ep_t *ep) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  ucx_link_t *l = p->link;
  if (chorus__txq_has(&l->q, ep)) return 1;
  for (sent_t *s = ch->inflight; s; s = s->next)
    if (s->l == l && s->it && (!ep || s->it->ep == ep)) return 1;
  for (sent_t *s = ch->completed; s; s = s->next)
    if (s->l == l && s->it && (!ep || s->it->ep == ep)) return 1;
  return 0;
}

/* Closes l's endpoint at once (FORCE: its sends complete as cancelled). */
static void ep_drop(ucx_chan_t *ch, ucx_link_t *l, int force) {
  if (!l->ep) return;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
  ucs_status_ptr_t r = ucp_ep_close_nbx(l->ep, &prm);
  l->ep = NULL;
  if (r && UCS_PTR_IS_PTR(r)) {
    int64_t until = chorus__now_ns() + (int64_t)(force ? 1000 : 2000) * 1000000;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && chorus__now_ns() < until)
      ucp_worker_progress(ch->worker);
    if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(ch->worker, r);
    ucp_request_free(r);
  }
}

static void ucx_close(chorus__chan_t *base, chorus__peer_t *p) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  chorus__tp_t *tp = base->tp;
  ucx_link_t *l = p->link;
  if (l->closed) return;
  l->closed = 1;
  ep_drop(ch, l, 1);
  /* Every message to it comes back lost: the ones UCX finished (or
   * cancelled) now, the ones it still holds when their callbacks run.
   * Losing one fails endpoints, which may run UCX's callbacks (cancel
   * waits) and move entries between the lists: each search starts over. */
  for (;;) {
    sent_t *s = NULL;
    for (sent_t *x = ch->completed; x && !s; x = x->next)
      if (x->l == l && x->it) s = x;
    for (sent_t *x = ch->inflight; x && !s; x = x->next)
      if (x->l == l && x->it) s = x;
    if (!s) break;
    chorus__tx_t *it = s->it;
    s->it = NULL;
    chorus__tp_tx_lost(tp, p, it);
  }
  chorus__txq_lose(tp, p, &l->q);
  while (l->held) {
    held_t *m = l->held;
    l->held = m->next;
    held_release(ch, m);
  }
}

/* "ucx posix/memory cma/memory": the transports of the endpoint's lanes,
 * read from what ucp_ep_print_info prints ("lane[0]:  8:posix/memory.0 ..."). */
static void ucx_link_desc(chorus__chan_t *base, chorus__peer_t *p, char *buf, size_t cap) {
  ucx_link_t *l = p->link;
  (void)base;
  if (l->closed) {
    snprintf(buf, cap, "ucx (connection gone)");
    return;
  }
  if (!l->ep) {
    snprintf(buf, cap, "ucx (not connected yet)");
    return;
  }
  char text[4096] = "";
  FILE *f = fmemopen(text, sizeof text - 1, "w");
  if (f) {
    ucp_ep_print_info(l->ep, f);
    fclose(f);
  }
  size_t off = (size_t)snprintf(buf, cap, "ucx");
  for (char *line = text; line && *line && off < cap; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    char *lane = strstr(line, "lane[");
    char *eol = strchr(line, '\n');
    if (!lane || (eol && lane > eol)) continue;
    char *c = strchr(lane, ':');
    if (!c || (eol && c > eol)) continue;
    c++;
    while (*c == ' ') c++;
    while (*c >= '0' && *c <= '9') c++;
    if (*c == ':') c++;
    size_t n = strcspn(c, " \n");
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)CHORUS__MIN(n, sizeof name - 1), c);
    char *dot = strrchr(name, '.');
    if (dot && dot > strchr(name, '/')) *dot = '\0';
    if (!name[0] || strstr(buf, name)) continue; /* each transport once */
    off += (size_t)snprintf(buf + off, cap - off, " %s", name);
  }
}

static int ucx_link_state(chorus__chan_t *base, chorus__peer_t *p, int64_t *since) {
  ucx_link_t *l = p->link;
  (void)base;
  (void)since;
  return l->ep || l->closed ? CHORUS__LINK_READY : CHORUS__LINK_NONE;
}

static void free_sent(sent_t *s) {
  if (s->it) chorus__tx_free(s->it);
  free(s);
}

static void free_pull(pull_t *pl) {
  chorus__tp_rx_detach(pl->l->peer, &pl->rx);
  free(pl);
}

/* Closes every endpoint side by side -- a peer that said goodbye is
 * flushed (unless all_force), the others closed with FORCE, so that their
 * requests complete as cancelled -- cancels the fetches in flight, and
 * progresses the worker until the closes are done or ms passed.  UCX does
 * not allow destroying a worker whose endpoints still hold requests (it
 * asserts, and a process that exited with a collective in flight died of
 * SIGABRT: issue 42). */
static void close_endpoints(ucx_chan_t *ch, int all_force, int ms) {
  chorus__tp_t *tp = ch->base.tp;
  void **closing = calloc((size_t)tp->size, sizeof *closing);
  int nclosing = 0;
  for (int r = 0; ch->links && r < tp->size; r++) {
    ucx_link_t *l = &ch->links[r];
    if (!l->peer || !l->ep) continue;
    int force = all_force || !closing || l->peer->dead || !l->peer->bye_received;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    ucs_status_ptr_t rq = ucp_ep_close_nbx(l->ep, &prm);
    l->ep = NULL;
    if (rq && UCS_PTR_IS_PTR(rq)) {
      if (closing) closing[nclosing++] = rq;
      else ucp_request_free(rq);
    }
  }
  for (pull_t *pl = ch->pulls; pl; pl = pl->next)
    if (pl->req && ucp_request_check_status(pl->req) == UCS_INPROGRESS)
      ucp_request_cancel(ch->worker, pl->req);
  int64_t until = chorus__now_ns() + (int64_t)ms * 1000000;
  for (;;) {
    int busy = 0;
    for (int i = 0; i < nclosing && !busy; i++)
      if (ucp_request_check_status(closing[i]) == UCS_INPROGRESS) busy = 1;
    if (!busy || chorus__now_ns() >= until) break;
    ucp_worker_progress(ch->worker);
  }
  for (int i = 0; i < nclosing; i++) {
    if (ucp_request_check_status(closing[i]) == UCS_INPROGRESS)
      ucp_request_cancel(ch->worker, closing[i]);
    ucp_request_free(closing[i]);
  }
  /* What the cancellations completed. */
  for (int i = 0; i < 16; i++) ucp_worker_progress(ch->worker);
  free(closing);
}

static void ucx_destroy(chorus__chan_t *base) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  chorus__tp_t *tp = base->tp;
  if (ch->links) {
    for (int r = 0; r < tp->size; r++) {
      ucx_link_t *l = &ch->links[r];
      if (!l->peer) continue;
      l->closed = 1;
      while (l->held) {
        held_t *m = l->held;
        l->held = m->next;
        held_release(ch, m);
      }
      chorus__txq_free(&l->q);
    }
  }
  /* Flushed for a peer that said goodbye; the others are dead, stopped or
   * gone silent (tp_destroy waited for them): nothing to wait for.  Only
   * the flushing closes are waited for. */
  if (ch->worker) close_endpoints(ch, 0, 1000);
  /* Requests UCX finished are released while the worker lives; those it
   * never finished go with it (their callbacks may run as it goes, so the
   * structures outlive it). */
  for (sent_t *s = ch->completed; s; s = s->next) {
    if (s->req) ucp_request_free(s->req);
    s->req = NULL;
  }
  for (pull_t *pl = ch->pulled; pl; pl = pl->next) {
    if (pl->req) ucp_request_free(pl->req);
    pl->req = NULL;
  }
  if (ch->efd >= 0) chorus__tp_unwatch(tp, ch->efd);
  if (ch->worker) ucp_worker_destroy(ch->worker);
  if (ch->ctx) ucp_cleanup(ch->ctx);
  while (ch->completed) {
    sent_t *s = ch->completed;
    LIST_DEL(ch->completed, s);
    free_sent(s);
  }
  while (ch->inflight) {
    sent_t *s = ch->inflight;
    LIST_DEL(ch->inflight, s);
    free_sent(s);
  }
  while (ch->failed_sends) {
    sent_t *s = ch->failed_sends;
    ch->failed_sends = s->next;
    free_sent(s);
  }
  while (ch->pulled) {
    pull_t *pl = ch->pulled;
    LIST_DEL(ch->pulled, pl);
    free_pull(pl);
  }
  while (ch->pulls) {
    pull_t *pl = ch->pulls;
    LIST_DEL(ch->pulls, pl);
    free_pull(pl);
  }
  while (ch->failed_pulls) {
    pull_t *pl = ch->failed_pulls;
    ch->failed_pulls = pl->next;
    free_pull(pl);
  }
  if (ch->addrs)
    for (int r = 0; r < tp->size; r++) free(ch->addrs[r]);
  free(ch->addrs);
  free(ch->links);
  free(ch);
}

/* The process exits with the channel open (endpoint.c's tp_on_exit, after
 * the progress thread stopped): the endpoints are closed with FORCE and the
 * worker and the context go now, which
 * stops UCX's own async thread.  Left running, that thread races UCX's
 * library destructors at exit (a lock destroyed while it holds it).  The
 * channel's structures stay for the process's end; nothing calls the
 * channel again. */
static void ucx_on_exit(chorus__chan_t *base) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  if (ch->efd >= 0) chorus__tp_unwatch(base->tp, ch->efd);
  ch->efd = -1;
  /* The endpoints first, and their requests with them (see
   * close_endpoints): a process leaving with a collective in flight. */
  if (ch->worker) close_endpoints(ch, 1, 500);
  if (ch->worker) ucp_worker_destroy(ch->worker);
  if (ch->ctx) ucp_cleanup(ch->ctx);
  ch->worker = NULL;
  ch->ctx = NULL;
  for (int r = 0; ch->links && r < base->tp->size; r++) {
    ch->links[r].ep = NULL;
    ch->links[r].closed = 1;
  }
}

static const chorus__chan_ops_t ucx_ops = {
    .name = "ucx",
    .send = ucx_send,
    .rx_pause = ucx_rx_pause,
    .cancel = ucx_cancel,
    .pending = ucx_pending,
    .close = ucx_close,
    .link_desc = ucx_link_desc,
    .link_state = ucx_link_state,
    .poll = ucx_poll,
    .idle = ucx_idle,
    .destroy = ucx_destroy,
    .on_exit = ucx_on_exit,
};

/* ---------------------------------------------------------------- set-up */

int chorus__ucx_built(void) { return 1; }

/* The RDMA transports UCX found ("rc_mlx5/mlx5_0:1 ud_verbs/..."), read from
 * what ucp_context_print_info lists ("resource 2 : md 1 dev 2 flags --
 * rc_verbs/mlx5_0:1"): how many. */
static int rdma_resources(ucp_context_h ctx, char *names, size_t cap) {
  char text[8192] = "";
  FILE *f = fmemopen(text, sizeof text - 1, "w");
  if (!f) return 0;
  ucp_context_print_info(ctx, f);
  fclose(f);
  int n = 0;
  size_t off = 0;
  if (cap) names[0] = '\0';
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    if (!strstr(line, "resource") || !strstr(line, "flags")) continue;
    char *tl = strrchr(line, ' ');
    if (!tl) continue;
    tl++;
    if (strncmp(tl, "rc_", 3) && strncmp(tl, "dc_", 3) && strncmp(tl, "ud_", 3)) continue;
    n++;
    if (off < cap) off += (size_t)snprintf(names + off, cap - off, "%s%s", off ? " " : "", tl);
  }
  return n;
}

chorus_result_t chorus__ucx_worker_new(chorus__ucx_worker_t **out, char **addr_hex, int need_rdma,
                                       char *errmsg, size_t errcap) {
  *out = NULL;
  *addr_hex = NULL;
  pthread_once(&g_ucx_once, ucx_load);
  if (g_ucx_error[0]) {
    snprintf(errmsg, errcap, "%s", g_ucx_error);
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  chorus__ucx_worker_t *w = calloc(1, sizeof *w);
  if (!w) return CHORUS_ERR_NO_MEMORY;
  ucp_config_t *conf = NULL;
  ucs_status_t st = ucp_config_read(NULL, NULL, &conf);
  if (st == UCS_OK) {
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    st = U.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &prm, conf, &w->ctx);
    ucp_config_release(conf);
  }
  if (st == UCS_OK) {
    /* Chosen for an RDMA device, UCX must be able to use it (its verbs
     * library, a provider for the card), or TCP is the better channel;
     * forced, it is told what UCX will use. */
    char names[256];
    int nr = rdma_resources(w->ctx, names, sizeof names);
    if (need_rdma && nr == 0) {
      snprintf(errmsg, errcap, "UCX found no RDMA transport (rc, dc or ud) for the device");
      chorus__ucx_worker_free(w);
      return CHORUS_ERR_NOT_SUPPORTED;
    }
    CHORUS_INFO(CHORUS__SUB_INIT, "UCX %s RDMA transports: %s", need_rdma ? "chosen," : "forced;",
                nr ? names : "none (UCX will use TCP or shared memory)");
  }
  if (st == UCS_OK) {
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    st = ucp_worker_create(w->ctx, &wp, &w->worker);
  }
  ucp_address_t *a = NULL;
  size_t alen = 0;
  if (st == UCS_OK) st = ucp_worker_get_address(w->worker, &a, &alen);
  if (st != UCS_OK) {
    snprintf(errmsg, errcap, "cannot start UCX (%s); check UCX_TLS and UCX_NET_DEVICES",
             ucs_status_string(st));
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_SYSTEM;
  }
  char *hex = malloc(2 * alen + 1);
  if (hex) chorus__hex(hex, a, alen);
  ucp_worker_release_address(w->worker, a);
  if (!hex) {
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  *out = w;
  *addr_hex = hex;
  return CHORUS_OK;
}

void chorus__ucx_worker_free(chorus__ucx_worker_t *w) {
  if (!w) return;
  if (w->worker) ucp_worker_destroy(w->worker);
  if (w->ctx) ucp_cleanup(w->ctx);
  free(w);
}

static int unhex(const char *s, uint8_t **out) {
  size_t n = strlen(s);
  if (n == 0 || n % 2 || n > 2 * CHORUS__UCX_ADDR_MAX) return -1;
  uint8_t *b = malloc(n / 2);
  if (!b) return -1;
  for (size_t i = 0; i < n / 2; i++) {
    int v = 0;
    for (int k = 0; k < 2; k++) {
      char c = s[2 * i + (size_t)k];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) {
        free(b);
        return -1;
      }
      v = v * 16 + d;
    }
    b[i] = (uint8_t)v;
  }
  *out = b;
  return 0;
}

chorus_result_t chorus__ucx_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  *out = NULL;
  chorus__ucx_worker_t *w = cfg->ucx;
  ucx_chan_t *ch = calloc(1, sizeof *ch);
  if (!ch) {
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  ch->base.ops = &ucx_ops;
  ch->base.tp = tp;
  ch->ctx = w->ctx;
  ch->worker = w->worker;
  free(w);
  ch->efd = -1;
  ch->watch = (chorus__watch_t){on_efd, ch};
  ch->links = calloc((size_t)cfg->size, sizeof *ch->links);
  ch->addrs = calloc((size_t)cfg->size, sizeof *ch->addrs);
  chorus_result_t st = CHORUS_ERR_NO_MEMORY;
  if (!ch->links || !ch->addrs) goto fail;
  for (int r = 0; r < cfg->size; r++) {
    chorus__peer_t *p = &tp->peers[r];
    if (r == cfg->rank || p->chan) continue;
    /* Ours are named by their host ("rank 3 (ucx:10.0.0.8)"): their TCP
     * listener is not used. */
    char host[64];
    int port;
    if (cfg->addrs && chorus__net_split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) == 0)
      snprintf(p->addr, sizeof p->addr, "ucx:%s", host);
    if (!cfg->ucx_addrs || !cfg->ucx_addrs[r] ||
        unhex(cfg->ucx_addrs[r], &ch->addrs[r]) < 0) {
      snprintf(errmsg, errcap, "rank %d published no UCX address: every rank must set "
               "CHORUS_TRANSPORT=ucx (or none)", r);
      st = CHORUS_ERR_INVALID_ARG;
      goto fail;
    }
    ucx_link_t *l = &ch->links[r];
    l->peer = p;
    l->ch = ch;
    token(cfg->key, cfg->world_id, r, cfg->rank, l->tok_in);
    token(cfg->key, cfg->world_id, cfg->rank, r, l->tok_out);
    chorus__tp_rx_attach(tp, p, &l->rx, &ch->base, l);
    p->chan = &ch->base;
    p->link = l;
  }
  ucp_am_handler_param_t hp = {
      .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
      .id = AM_ID,
      .flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA,
      .cb = am_cb,
      .arg = ch};
  ucs_status_t us = ucp_worker_set_am_recv_handler(ch->worker, &hp);
  if (us == UCS_OK) us = ucp_worker_get_efd(ch->worker, &ch->efd);
  if (us != UCS_OK) {
    ch->efd = -1;
    snprintf(errmsg, errcap, "UCX worker: %s", ucs_status_string(us));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  if (chorus__tp_watch(tp, ch->efd, EPOLLIN, &ch->watch) < 0) {
    snprintf(errmsg, errcap, "epoll on the UCX worker: %s", strerror(errno));
    ch->efd = -1;
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  *out = &ch->base;
  return CHORUS_OK;
fail:
  for (int r = 0; r < cfg->size; r++)
    if (tp->peers[r].chan == &ch->base) {
      chorus__tp_rx_detach(&tp->peers[r], &ch->links[r].rx);
      tp->peers[r].chan = NULL;
      tp->peers[r].link = NULL;
    }
  ucx_destroy(&ch->base);
  return st;
}

#else /* !CHORUS_HAVE_UCX */

int chorus__ucx_built(void) { return 0; }

chorus_result_t chorus__ucx_worker_new(chorus__ucx_worker_t **out, char **addr_hex, int need_rdma,
                                       char *errmsg, size_t errcap) {
  (void)need_rdma;
  *out = NULL;
  *addr_hex = NULL;
  snprintf(errmsg, errcap, "this libchorus was built without UCX (install libucx-dev and "
           "rebuild), so CHORUS_TRANSPORT=ucx is not available");
  return CHORUS_ERR_INVALID_ARG;
}

void chorus__ucx_worker_free(chorus__ucx_worker_t *w) { (void)w; }

chorus_result_t chorus__ucx_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  (void)tp;
  (void)cfg;
  *out = NULL;
  snprintf(errmsg, errcap, "built without UCX");
  return CHORUS_ERR_INVALID_ARG;
}

#endif

/* ------------------------------------------- choosing UCX (either build) */

int chorus__rdma_active(const char *dir, char *names, size_t cap) {
  if (cap) names[0] = '\0';
  DIR *d = opendir(dir);
  if (!d) return 0;
  int found = 0;
  size_t off = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char ports[512];
    snprintf(ports, sizeof ports, "%s/%s/ports", dir, e->d_name);
    DIR *pd = opendir(ports);
    if (!pd) continue;
    int active = 0;
    struct dirent *p;
    while (!active && (p = readdir(pd))) {
      if (p->d_name[0] == '.') continue;
      char path[800], state[64] = "";
      snprintf(path, sizeof path, "%s/%s/state", ports, p->d_name);
      FILE *f = fopen(path, "r");
      if (!f) continue;
      /* "4: ACTIVE" */
      if (fgets(state, sizeof state, f) && strstr(state, "ACTIVE")) active = 1;
      fclose(f);
    }
    closedir(pd);
    if (!active) continue;
    found++;
    if (off < cap)
      off += (size_t)snprintf(names + off, cap - off, "%s%s", off ? "," : "", e->d_name);
  }
  closedir(d);
  return found;
}

int chorus__ucx_decide(const char *const *fields, int n, int *bad) {
  int forced = 0, all = 1;
  *bad = -1;
  for (int r = 0; r < n; r++) {
    const char *f = fields[r];
    if (f[0] == 'U') forced = 1;
    if (f[0] != 'U' && f[0] != 'A') {
      all = 0;
      if (*bad < 0) *bad = r;
    }
  }
  if (all) return 1;
  return forced ? -1 : 0;
}
