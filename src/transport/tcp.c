/*
 * tcp.c - the TCP channel's operations (chan.h), as the endpoint layer sees
 * them: send (whole, or in pieces once the piece connections are up),
 * pausing a connection's input, cancelling, closing a pair, describing its
 * link, each progress round's poll; a pair's state made on its first
 * message either way; opening and destroying the channel.  The design, the
 * protocol's constants and the state it keeps are in tcp.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transport/tcp.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

/* ------------------------------------------------- the channel's ops */

void chorus__tcp_conn_failed(conn_t *c, const char *why, chorus_result_t code) {
  chorus__tp_peer_failed(conn_tp(c), c->peer, why, code);
}

static void on_stream_event(void *arg, uint32_t events) {
  stream_t *s = arg;
  if (s->c->peer->dead) return;
  if (s->kind == S_IN && s->waiting && (events & (EPOLLHUP | EPOLLERR))) {
    /* Not read while it waits for a HEAD, and epoll reports this anyway. */
    chorus__tcp_conn_failed(s->c, "closed a piece connection in the middle of a message",
                            CHORUS_ERR_REMOTE);
    return;
  }
  if (s->state != C_READY) {
    chorus__tcp_dial_event(s, events);
    return;
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) chorus__tcp_read_stream(s);
  if (!s->c->peer->dead && (events & EPOLLOUT)) chorus__tcp_flush_tx(s);
}

/* p's pair state; NULL while nothing was sent either way. */
static conn_t *conn_of(chorus__chan_t *ch, const chorus__peer_t *p) {
  (void)ch;
  return p->link;
}

void chorus__tcp_stream_init(stream_t *s, conn_t *c, int kind, int idx) {
  s->c = c;
  s->kind = kind;
  s->idx = idx;
  s->fd = -1;
  s->state = C_IDLE;
  s->watch = (chorus__watch_t){on_stream_event, s};
  if (kind == S_OUT) c->out[idx] = s;
  if (kind == S_IN) c->in[idx] = s;
}

/* Every connection of c: the main one, then the piece connections. */
#define FOR_STREAMS(c, s)                                                              \
  for (int k_ = 0; k_ < 1 + 2 * MAX_STREAMS; k_++)                                     \
    for (stream_t *s = k_ == 0 ? &(c)->s0                                              \
                       : k_ <= MAX_STREAMS ? (c)->out[k_ - 1] : (c)->in[k_ - 1 - MAX_STREAMS]; \
         s; s = NULL)

/* p's pair state, made now if need be; NULL when out of memory. */
conn_t *chorus__tcp_conn_make(tcp_chan_t *t, chorus__peer_t *p) {
  conn_t *c = p->link;
  if (c) return c;
  if (t->nlive == t->cap_live) {
    int cap = t->cap_live ? 2 * t->cap_live : 16;
    conn_t **live = realloc(t->live, sizeof *live * (size_t)cap);
    if (!live) return NULL;
    t->live = live;
    t->cap_live = cap;
  }
  c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->ch = t;
  c->peer = p;
  chorus__tcp_stream_init(&c->s0, c, S_MAIN, 0);
  chorus__tp_rx_attach(t->base.tp, p, &c->rx, &t->base, c);
  p->link = c;
  t->live[t->nlive++] = c;
  return c;
}

/* The first message over 1 MiB to c's peer: dial this rank's first piece
 * connection (its handshake agrees on how many; stream_ready dials the
 * others).  Meanwhile messages go whole. */
static void pieces_dial(conn_t *c) {
  stream_t *x = calloc(1, sizeof *x);
  c->out_dialled = 1;
  if (!x) return; /* whole messages, then */
  chorus__tcp_stream_init(x, c, S_OUT, 0);
  x->deadline = chorus__now_ns() + c->ch->connect_ns;
  chorus__tcp_dial_start(x);
}

static void tcp_send(chorus__chan_t *ch, chorus__peer_t *p, txitem_t *it) {
  conn_t *c = chorus__tcp_conn_make((tcp_chan_t *)ch, p);
  if (!c) {
    chorus__tp_tx_lost(ch->tp, p, it);
    chorus__tp_peer_failed(ch->tp, p, "out of memory for its connection's state",
                           CHORUS_ERR_NO_MEMORY);
    return;
  }
  if (c->state == C_CLOSED) {
    chorus__tp_tx_lost(ch->tp, p, it);
    return;
  }
  if (c->state == C_READY && it->len > CHORUS__WIRE_PART_MAX) {
    if (!c->out_dialled) pieces_dial(c);
    if (c->state == C_CLOSED) { /* that dial failed at once, and the peer with it */
      chorus__tp_tx_lost(ch->tp, p, it);
      return;
    }
    /* In pieces once the connections are up, and while the receiver's
     * reassemblies stay well within MAX_ASSEMBLIES. */
    if (c->nout && c->nout_ready == c->nout && c->parts_queued < MAX_ASSEMBLIES / 2 &&
        chorus__tcp_send_in_pieces(c, it) == 0)
      return;
  }
  chorus__tcp_stream_push(&c->s0, it);
  if (c->state == C_IDLE) {
    c->since = chorus__now_ns();
    c->s0.deadline = c->since + c->ch->connect_ns;
    chorus__tcp_dial_start(&c->s0);
  }
}

static void tcp_rx_pause(chorus__chan_t *ch, chorus__rx_t *rx, int on) {
  conn_t *c = rx->link;
  if (c->state != C_READY || c->peer->dead) return;
  chorus__tcp_update_events(&c->s0, on, c->s0.epoll_out);
  /* Plaintext already opened, or a HEAD routed now whose bytes come on
   * other connections: no socket event will say so. */
  if (!on && (c->s0.rx_pleft || chorus__tcp_head_waiting(c))) chorus__tp_kick(ch->tp);
}

static int tcp_cancel(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  int rc = 0;
  if (!c) return 0;
  FOR_STREAMS(c, s) if (chorus__txq_cancel(&s->txq, ep) < 0) rc = -1;
  return rc;
}

static int tcp_pending(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep) {
  conn_t *c = conn_of(ch, p);
  if (!c) return 0;
  FOR_STREAMS(c, s) if (chorus__txq_has(&s->txq, ep) || (!ep && s->tx_off < s->tx_len)) return 1;
  return 0;
}

static void tcp_close(chorus__chan_t *ch, chorus__peer_t *p) {
  conn_t *c = conn_of(ch, p);
  if (!c) return; /* never talked: nothing queued, nothing to close */
  FOR_STREAMS(c, s) {
    if (s->state >= C_CONNECTING && s->state <= C_AWAIT) chorus__tcp_dial_unlist(s);
    if (s->fd >= 0) {
      chorus__tp_unwatch(ch->tp, s->fd);
      /* The peer must see EOF now, not at its timeout; the fd number
       * itself stays reserved until the channel goes so it cannot be
       * reused. */
      shutdown(s->fd, SHUT_RDWR);
    }
    s->state = C_CLOSED;
    s->part = NULL;
    chorus__txq_lose(ch->tp, p, &s->txq);
    s->tx_off = s->tx_len;
  }
  c->state = C_CLOSED;
  while (c->asm_head) chorus__tcp_assembly_free(c, c->asm_head);
}

static void tcp_link_desc(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap) {
  conn_t *c = conn_of(ch, p);
  char local[80] = "?", remote[80] = "?", ifname[64] = "?", more[48] = "";
  int lport = 0, rport = 0;
  if (!c || c->state != C_READY) {
    snprintf(buf, cap, "tcp (%s %s)",
             !c || c->state == C_IDLE ? "not connected; listens at" : "connecting to", p->addr);
    return;
  }
  chorus__net_local_addr(c->s0.fd, local, sizeof local, &lport);
  chorus__net_peer_addr(c->s0.fd, remote, sizeof remote, &rport);
  chorus__net_addr_ifname(local, ifname, sizeof ifname);
  if (c->nout || c->nin)
    snprintf(more, sizeof more, ", piece connections %d of %d out, %d in", c->nout_ready, c->nout,
             c->nin);
  snprintf(buf, cap, "tcp %s:%d -> %s:%d (%s%s)", local, lport, remote, rport, ifname, more);
}

static int tcp_link_state(chorus__chan_t *ch, chorus__peer_t *p, int64_t *since) {
  conn_t *c = conn_of(ch, p);
  *since = c ? c->since : 0;
  if (!c) return CHORUS__LINK_NONE;
  return c->state == C_READY ? CHORUS__LINK_READY
         : c->state == C_IDLE || c->state == C_CLOSED ? CHORUS__LINK_NONE
                                                      : CHORUS__LINK_DIALING;
}

/* Whether s has input no socket event will announce: opened plaintext not
 * parsed yet, or a piece header parsed while its HEAD was awaited. */
static int stream_has_input(const stream_t *s) {
  if (s->state != C_READY || chorus__tcp_stream_blocked(s)) return 0;
  return s->rx_pleft || (s->kind == S_IN && s->hgot == HDR_SIZE && !s->part) ||
         (s->kind == S_MAIN && chorus__tcp_head_waiting(s->c));
}

/* Each progress round: handshakes and dials past their deadlines; input
 * that is there but that no event will announce (stream_has_input). */
static void tcp_poll(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  int64_t now = chorus__now_ns();
  for (int i = t->npend - 1; i >= 0; i--) {
    if (t->pend[i]->deadline > now) continue;
    chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                        "chorus rank %d: dropped a connection from %s: no handshake within %d ms",
                        ch->tp->rank, t->pend[i]->addr, t->hs_ms);
    t->rejected++;
    chorus__tcp_pending_drop(t->pend[i]);
  }
  if (t->dialing) chorus__tcp_dial_tick(t, now);
  for (int i = 0; i < t->nlive; i++) {
    conn_t *c = t->live[i];
    FOR_STREAMS(c, s) if (!c->peer->dead && stream_has_input(s)) chorus__tcp_read_stream(s);
  }
}

static void stream_free(stream_t *s) {
  if (s->fd >= 0) close(s->fd);
  chorus__txq_free(&s->txq);
  chorus__aead_free(s->tx_aead);
  chorus__aead_free(s->rx_aead);
  free(s->tx_rec);
  free(s->rx_rec);
  chorus__wipe(s->keys, sizeof s->keys);
  if (s->kind != S_MAIN) free(s);
}

static void tcp_destroy(chorus__chan_t *ch) {
  tcp_chan_t *t = (tcp_chan_t *)ch;
  while (t->npend) chorus__tcp_pending_drop(t->pend[t->npend - 1]);
  free(t->pend);
  if (t->listen_fd >= 0) close(t->listen_fd);
  /* The total, once: the rate limiter may have hidden most of them. */
  if (t->rejected > CHORUS__LOG_BURST)
    CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: %lu connections rejected in all at this "
                "rank's data port", ch->tp->rank, t->rejected);
  else if (t->rejected)
    CHORUS_INFO(CHORUS__SUB_TCP, "chorus rank %d: %lu connection(s) rejected at this rank's data "
                "port", ch->tp->rank, t->rejected);
  for (int i = 0; i < t->nlive; i++) {
    conn_t *c = t->live[i];
    FOR_STREAMS(c, s) stream_free(s);
    while (c->asm_head) chorus__tcp_assembly_free(c, c->asm_head);
    free(c);
  }
  free(t->live);
  free(t);
}

static const chorus__chan_ops_t tcp_ops = {
    .name = "tcp",
    .send = tcp_send,
    .rx_pause = tcp_rx_pause,
    .cancel = tcp_cancel,
    .pending = tcp_pending,
    .close = tcp_close,
    .link_desc = tcp_link_desc,
    .link_state = tcp_link_state,
    .poll = tcp_poll,
    .destroy = tcp_destroy,
};

/* A channel that carries every peer no other channel does; no pair state
 * yet (chorus__tcp_conn_make makes it on the pair's first message). */
tcp_chan_t *chorus__tcp_new(chorus__tp_t *tp) {
  tcp_chan_t *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->base.ops = &tcp_ops;
  t->base.tp = tp;
  t->listen_fd = -1;
  t->nstreams = 1;
  CHORUS__FOR_PEERS(tp, p) {
    if (p->rank != tp->rank && !p->chan) p->chan = &t->base;
  }
  tp->carrier = &t->base; /* and every peer touched from now on */
  return t;
}

/* ---------------------------------------------------------- lifecycle */

/* Undoes chorus__tcp_new when the channel never carried anything. */
static void tcp_abandon(tcp_chan_t *t) {
  chorus__tp_t *tp = t->base.tp;
  CHORUS__FOR_PEERS(tp, p) {
    if (p->chan != &t->base) continue;
    p->chan = NULL;
    p->link = NULL;
    p->rxs = NULL;
  }
  if (tp->carrier == &t->base) tp->carrier = NULL;
  tcp_destroy(&t->base);
}

chorus_result_t chorus__tcp_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  tcp_chan_t *t = chorus__tcp_new(tp);
  if (!t) {
    close(cfg->listen_fd);
    return CHORUS_ERR_NO_MEMORY;
  }
  const chorus__env_t *env = chorus__env();
  t->listen_fd = cfg->listen_fd;
  t->max_pending = env->HANDSHAKE_MAX_PENDING > 0 && env->HANDSHAKE_MAX_PENDING <= 65536
                       ? (int)env->HANDSHAKE_MAX_PENDING : 256;
  t->hs_ms = env->HANDSHAKE_TIMEOUT_MS > 0 ? (int)env->HANDSHAKE_TIMEOUT_MS : 1000;
  t->retry_ms = cfg->retry_ms > 0 ? cfg->retry_ms : 50;
  t->nstreams = (int)CHORUS__MAX(1, CHORUS__MIN(env->SOCKET_NSTREAMS, (int64_t)MAX_STREAMS));
  /* Dialling a peer may take as long as forming the world could. */
  int window = chorus__ms_left(cfg->deadline);
  t->connect_ns = (int64_t)CHORUS__MAX(window, 10000) * 1000000;
  t->pend = calloc((size_t)t->max_pending, sizeof *t->pend);
  t->listen_watch = (chorus__watch_t){chorus__tcp_on_listen_event, t};
  int ntcp = 0;
  for (int r = 0; r < cfg->size; r++) {
    char host[64];
    int port;
    int mine = chorus__tp_chan_of(tp, r) == &t->base;
    ntcp += mine;
    /* Named already (chorus__tp_create); ours must be reachable. */
    if (mine && cfg->addrs &&
        chorus__net_split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) < 0) {
      snprintf(errmsg, errcap, "rank %d published an unparsable address '%s'", r, cfg->addrs[r]);
      tcp_abandon(t);
      return CHORUS_ERR_PROTOCOL;
    }
  }
  if (!t->pend) {
    tcp_abandon(t);
    return CHORUS_ERR_NO_MEMORY;
  }
  if (!ntcp) { /* every peer shares this host: nobody will connect */
    close(t->listen_fd);
    t->listen_fd = -1;
  } else if (chorus__net_set_nonblock(t->listen_fd, 1) < 0 ||
             chorus__tp_watch(tp, t->listen_fd, EPOLLIN, &t->listen_watch) < 0) {
    snprintf(errmsg, errcap, "cannot watch the data listener: %s", strerror(errno));
    tcp_abandon(t);
    return CHORUS_ERR_SYSTEM;
  }
  *out = &t->base;
  return CHORUS_OK;
}
