/*
 * tcp_connect.c - making TCP connections: dialling a peer's listener (the
 * connector's side of the handshake, its retries and deadline) and
 * accepting at this rank's (handshakes pending in their slots, each with a
 * deadline), up to a connection that carries messages (stream_ready).
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
#include "util/net.h"
#include "util/util.h"

/* ------------------------------------------------- a connection made */

/* The index of s in the handshake: 0 the main connection, i + 1 piece
 * connection i of the rank that dials it. */
static uint32_t wire_index(const stream_t *s) { return s->kind == S_MAIN ? 0 : (uint32_t)s->idx + 1; }

/* s's handshake succeeded on fd (this rank dialled: connector): s carries
 * its share of the pair from now on, its queued messages go; once this
 * rank's first piece connection is up (and the count agreed), it dials the
 * others.  0, or -1 after failing the peer. */
static int stream_ready(stream_t *s, int fd, int connector) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  if (s->state >= C_CONNECTING && s->state <= C_AWAIT) chorus__tcp_dial_unlist(s);
  if (s->fd >= 0 && s->fd != fd) { /* our own attempt, which lost the crossing */
    chorus__tp_unwatch(tp, s->fd);
    close(s->fd);
  }
  s->fd = fd;
  s->state = C_READY;
  if (s->kind == S_MAIN) {
    c->state = C_READY;
    c->rx.pieces_ok = 1;
  }
  if (tp->encrypt) {
    s->tx_aead = chorus__aead_new(s->keys + (connector ? 0 : 32), connector ? 1 : 2, 1);
    s->rx_aead = chorus__aead_new(s->keys + (connector ? 32 : 0), connector ? 2 : 1, 0);
    s->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
    s->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
    chorus__wipe(s->keys, sizeof s->keys);
    if (!s->tx_aead || !s->rx_aead || !s->tx_rec || !s->rx_rec) {
      chorus__tcp_conn_failed(c, "out of memory for the connection's encryption state",
                              CHORUS_ERR_NO_MEMORY);
      return -1;
    }
  }
  chorus__net_set_nonblock(fd, 1);
  chorus__net_set_nodelay(fd);
  int sz = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  /* An accepted fd is new to epoll; a dialled one is watched already.
   * Every kind reads: ours to see the end of a piece connection. */
  if (chorus__tp_watch(tp, fd, EPOLLIN, &s->watch) < 0 &&
      (errno != EEXIST || chorus__tp_watch_mod(tp, fd, EPOLLIN, &s->watch) < 0)) {
    char why[96];
    snprintf(why, sizeof why, "epoll_ctl failed (%s)", strerror(errno));
    chorus__tcp_conn_failed(c, why, CHORUS_ERR_SYSTEM);
    return -1;
  }
  s->epoll_out = 0;
  if (s->kind == S_MAIN) {
    /* Silence counts from now: nothing could be heard before. */
    c->peer->last_heard = chorus__now_ns();
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: connected with world rank %d (%s, %s)",
                 tp->rank, c->peer->rank, c->peer->addr, connector ? "dialled" : "accepted");
  } else {
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: %s piece connection %d of %d with world "
                 "rank %d up", tp->rank, s->kind == S_OUT ? "outgoing" : "incoming", s->idx + 1,
                 s->kind == S_OUT ? c->nout : c->nin, c->peer->rank);
  }
  if (s->kind == S_OUT) c->nout_ready++;
  if (s->txq.head) chorus__tcp_flush_tx(s);
  if (s->kind == S_OUT && s->idx == 0) {
    for (int i = 1; i < c->nout && !c->peer->dead; i++) {
      stream_t *x = calloc(1, sizeof *x);
      if (!x) {
        chorus__tcp_conn_failed(c, "out of memory for its connections' state",
                                CHORUS_ERR_NO_MEMORY);
        return -1;
      }
      chorus__tcp_stream_init(x, c, S_OUT, i);
      x->deadline = chorus__now_ns() + c->ch->connect_ns;
      chorus__tcp_dial_start(x);
    }
  }
  return c->peer->dead ? -1 : 0;
}

/* ------------------------------------------------- dialling (connector) */

/* s leaves the channel's list of streams being dialled. */
void chorus__tcp_dial_unlist(stream_t *s) {
  for (stream_t **pp = &s->c->ch->dialing; *pp; pp = &(*pp)->next_dial)
    if (*pp == s) {
      *pp = s->next_dial;
      break;
    }
  s->next_dial = NULL;
}

static void dial_fail(stream_t *s, const char *what, int err) {
  conn_t *c = s->c;
  char why[400], which[48] = "";
  if (s->kind == S_OUT) snprintf(which, sizeof which, " (piece connection %d)", s->idx + 1);
  snprintf(why, sizeof why, "cannot connect to its listener at %s%s: %s", c->peer->addr, which,
           what);
  if (err) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, " (%s)", strerror(err));
  }
  /* Refused: nothing listens there any more.  Right after start-up that is
   * often a rank whose own init failed -- another rank died while the world
   * formed -- and its log names the cause (issue 42). */
  if (err == ECONNREFUSED) {
    size_t n = strlen(why);
    snprintf(why + n, sizeof why - n, "; its process has ended, or left init with an error "
             "(its own output says why: another rank's death while the world formed, say)");
  }
  CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: world rank %d: %s", conn_tp(c)->rank,
              c->peer->rank, why);
  chorus__tcp_conn_failed(c, why, err == ETIMEDOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_REMOTE);
}

/* s's state, and the pair's when s is its main connection. */
static void dial_state(stream_t *s, int state) {
  s->state = state;
  if (s->kind == S_MAIN) s->c->state = state;
}

/* This attempt is over but the stream may still connect: try again after
 * CHORUS_CONNECT_RETRY_MS, within the deadline (chorus__tcp_dial_tick). */
static void dial_retry(stream_t *s) {
  if (s->fd >= 0) {
    chorus__tp_unwatch(stream_tp(s), s->fd);
    close(s->fd);
    s->fd = -1;
  }
  dial_state(s, C_CONNECTING);
  s->retry_at = chorus__now_ns() + (int64_t)s->c->ch->retry_ms * 1000000;
}

/* The peer's listener, read from its record when a world formed without
 * every record (chorus__tp_config_t's lookup): 0, or -1 after failing the
 * stream.  Once per peer; a blocking read of the store, bounded by the
 * dial's own deadline. */
static int dial_lookup(stream_t *s) {
  chorus__tp_t *tp = stream_tp(s);
  chorus__peer_t *p = s->c->peer;
  if (!tp->lookup || strcmp(p->addr, "?") != 0) return 0;
  char addr[sizeof p->addr], why[400];
  int64_t left_ms = (s->deadline - chorus__now_ns()) / 1000000;
  if (tp->lookup(tp->lookup_arg, p->rank, addr, sizeof addr, why, sizeof why) < 0 ||
      left_ms <= 0) {
    dial_fail(s, left_ms <= 0 ? "no time left to find its listener" : why, 0);
    return -1;
  }
  memcpy(p->addr, addr, sizeof addr);
  return 0;
}

/* Starts an attempt (C_IDLE, or C_CONNECTING waiting to retry). */
void chorus__tcp_dial_start(stream_t *s) {
  tcp_chan_t *t = s->c->ch;
  if (s->state == C_IDLE) {
    s->next_dial = t->dialing;
    t->dialing = s;
  }
  dial_state(s, C_CONNECTING);
  s->hs_got = 0;
  char host[64];
  int port;
  if (dial_lookup(s) < 0) return;
  if (chorus__net_split_addr(s->c->peer->addr, ':', host, sizeof host, &port) < 0) {
    dial_fail(s, "the address it published cannot be parsed", 0);
    return;
  }
  int fd = chorus__net_connect_start(host, port);
  if (fd < 0) {
    if (fd == -ENETUNREACH || fd == -EHOSTUNREACH || fd == -EAGAIN || fd == -ENOBUFS) {
      dial_retry(s);
      return;
    }
    dial_fail(s, "connect failed", -fd);
    return;
  }
  s->fd = fd;
  if (chorus__tp_watch(stream_tp(s), fd, EPOLLOUT, &s->watch) < 0) {
    close(fd);
    s->fd = -1;
    dial_fail(s, "epoll_ctl failed", errno);
  }
}

/* Streams waiting to retry, or past their deadline.  Failing a pair fails
 * endpoints, whose ABORTs may start or fail other dials: the scan starts
 * over after each. */
void chorus__tcp_dial_tick(tcp_chan_t *t, int64_t now) {
  for (stream_t *s = t->dialing; s;) {
    if (now >= s->deadline) {
      char what[96];
      snprintf(what, sizeof what, "no connection within %lld ms (%s)",
               (long long)(t->connect_ns / 1000000),
               s->state == C_AWAIT ? "it was to dial this rank" : "the attempts kept failing");
      dial_fail(s, what, ETIMEDOUT);
      s = t->dialing;
    } else if (s->state == C_CONNECTING && s->fd < 0 && now >= s->retry_at) {
      chorus__tcp_dial_start(s);
      s = t->dialing;
    } else {
      s = s->next_dial;
    }
  }
}

/* Reads handshake bytes up to want; 1 when there, 0 when more must come,
 * -1 when the connection ended (errno; 0 at EOF). */
static int dial_read(stream_t *s, size_t want) {
  while (s->hs_got < want) {
    ssize_t n = recv(s->fd, s->hs + s->hs_got, want - s->hs_got, MSG_DONTWAIT);
    if (n > 0) {
      s->hs_got += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n == 0) errno = 0;
    return -1;
  }
  return 1;
}

/* The version word of this rank's connect for s: for a piece connection
 * also how many this rank wants (its first) or agreed (the others). */
static uint32_t connect_word(const stream_t *s) {
  const conn_t *c = s->c;
  int k = s->kind == S_MAIN ? 1 : s->idx ? c->nout : c->ch->nstreams;
  return HS_VERSION | (conn_tp(c)->encrypt ? HS_FLAG_ENCRYPT : 0) | HS_STREAMS(wire_index(s), k);
}

/* The acceptor's hello is in: answer with our proof. */
static void dial_hello(stream_t *s) {
  chorus__tp_t *tp = stream_tp(s);
  uint32_t version = chorus__le32_get(s->hs + 4);
  if (chorus__le32_get(s->hs) != HS_ACCEPT || (version & HS_VERSION_MASK) != HS_VERSION) {
    char what[96];
    snprintf(what, sizeof what, "not a chorus peer of this version (magic %08x, version %u)",
             chorus__le32_get(s->hs), version & HS_VERSION_MASK);
    dial_fail(s, what, 0);
    return;
  }
  if (!!(version & HS_FLAG_ENCRYPT) != tp->encrypt) {
    char what[128];
    snprintf(what, sizeof what, "the ranks disagree on CHORUS_ENCRYPT (this rank %d, that one "
             "%d): set it the same on every rank", tp->encrypt, !tp->encrypt);
    dial_fail(s, what, 0);
    return;
  }
  uint8_t out[HS_CONNECT_LEN];
  uint32_t v = connect_word(s);
  memcpy(s->na, s->hs + 8, CHORUS__NONCE_LEN);
  chorus__le32_put(out, HS_CONNECT);
  chorus__le32_put(out + 4, v);
  chorus__le32_put(out + 8, (uint32_t)tp->rank);
  if (chorus__random_bytes(s->nc, CHORUS__NONCE_LEN) < 0) {
    dial_fail(s, "no randomness", errno);
    return;
  }
  memcpy(out + 12, s->nc, CHORUS__NONCE_LEN);
  chorus__tcp_hs_mac(tp, 0, (uint32_t)tp->rank, (uint32_t)s->c->peer->rank, v, s->na, s->nc,
         out + 12 + CHORUS__NONCE_LEN);
  /* A fresh socket's buffer takes these few bytes at once. */
  if (send(s->fd, out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof out) {
    dial_retry(s);
    return;
  }
  dial_state(s, C_REPLY);
  s->hs_got = 0;
}

/* The acceptor's answer is in (at least its first 8 bytes). */
static void dial_reply(stream_t *s) {
  conn_t *c = s->c;
  chorus__tp_t *tp = conn_tp(c);
  int peer = c->peer->rank;
  if (chorus__le32_get(s->hs) == HS_DENY) {
    uint32_t reason = chorus__le32_get(s->hs + 4);
    if (reason == HS_DENY_CROSS && s->kind == S_MAIN) {
      /* It dials us too and its connection is the one: wait for it. */
      chorus__tp_unwatch(tp, s->fd);
      close(s->fd);
      s->fd = -1;
      dial_state(s, C_AWAIT);
      return;
    }
    dial_fail(s, reason == HS_DENY_AUTH ? "it refused our proof: the ranks have different job "
              "secrets, or the address belongs to another world or generation"
              : reason == HS_DENY_RANK    ? "it already has a connection from this rank"
              : reason == HS_DENY_ENCRYPT ? "the ranks disagree on CHORUS_ENCRYPT: set it the "
                                            "same on every rank"
                                          : "it speaks another handshake version", 0);
    return;
  }
  uint32_t v = chorus__le32_get(s->hs + 8);
  uint32_t k = HS_NSTREAMS(v);
  if (chorus__le32_get(s->hs) != HS_OK || chorus__le32_get(s->hs + 4) != (uint32_t)peer) {
    dial_fail(s, "unexpected answer to the handshake (not that rank of this world?)", 0);
    return;
  }
  uint8_t want[CHORUS__MAC_LEN];
  chorus__tcp_hs_mac(tp, 1, (uint32_t)tp->rank, (uint32_t)peer, v, s->na, s->nc, want);
  if (!chorus__ct_equal(want, s->hs + 12, sizeof want)) {
    dial_fail(s, "it did not prove the job key (a stranger on that port?)", 0);
    return;
  }
  /* The count of piece connections: at most what we asked for; the others
   * must repeat it. */
  if (k < 1 || k > (uint32_t)HS_NSTREAMS(connect_word(s)) ||
      (s->kind == S_OUT && s->idx && k != (uint32_t)c->nout)) {
    dial_fail(s, "it answered with an impossible number of piece connections", 0);
    return;
  }
  if (tp->encrypt && chorus__tcp_hs_keys(tp, (uint32_t)tp->rank, (uint32_t)peer, wire_index(s),
                                         s->na, s->nc, s->keys) < 0) {
    dial_fail(s, "cannot derive the connection's keys (libcrypto)", 0);
    return;
  }
  if (s->kind == S_OUT && s->idx == 0) c->nout = (int)k;
  stream_ready(s, s->fd, 1);
}

void chorus__tcp_dial_event(stream_t *s, uint32_t events) {
  if (s->fd < 0) return;
  if (s->state == C_CONNECTING) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == 0 && !(events & (EPOLLOUT | EPOLLERR | EPOLLHUP))) return;
    if (err == ECONNREFUSED) {
      /* The listener was there when its address was published: the rank
       * is gone, or listens on an address this host cannot reach. */
      dial_fail(s, "connection refused: the rank has exited, or its address is not reachable "
                "from this host (check CHORUS_SOCKET_IFNAME)", 0);
      return;
    }
    if (err) {
      dial_retry(s);
      return;
    }
    dial_state(s, C_HELLO);
    s->hs_got = 0;
    chorus__tp_watch_mod(stream_tp(s), s->fd, EPOLLIN, &s->watch);
    return;
  }
  if (s->state != C_HELLO && s->state != C_REPLY) return;
  size_t want = s->state == C_HELLO ? HS_HELLO_LEN : HS_DENY_LEN;
  int rc = dial_read(s, want);
  if (rc == 1 && s->state == C_REPLY && chorus__le32_get(s->hs) == HS_OK)
    rc = dial_read(s, HS_OK_LEN);
  if (rc < 0) {
    /* The acceptor dropped us (its handshake slots were full, or it was
     * too slow to answer): try again within the deadline. */
    dial_retry(s);
    return;
  }
  if (rc == 0) return;
  if (s->state == C_HELLO)
    dial_hello(s);
  else
    dial_reply(s);
}

/* ------------------------------------------------ accepting (acceptor) */

/* p leaves the pending slots (its fd closed unless taken, p->fd < 0). */
void chorus__tcp_pending_drop(pending_t *p) {
  tcp_chan_t *t = p->ch;
  if (p->fd >= 0) {
    chorus__tp_unwatch(t->base.tp, p->fd);
    close(p->fd);
  }
  int i = p->slot;
  t->pend[i] = t->pend[--t->npend];
  t->pend[i]->slot = i;
  free(p);
}

static void pending_reject(pending_t *p, const char *why) {
  tcp_chan_t *t = p->ch;
  chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                      "chorus rank %d: rejected a connection from %s: %s", t->base.tp->rank,
                      p->addr, why);
  t->rejected++;
  chorus__tcp_pending_drop(p);
}

/* The connect message is complete: verify, decide, answer. */
static void pending_complete(pending_t *p) {
  tcp_chan_t *t = p->ch;
  chorus__tp_t *tp = t->base.tp;
  char why[160];
  int peer = chorus__tcp_hs_verify(t, p, why, sizeof why);
  uint32_t v = chorus__le32_get(p->in + 4);
  uint32_t sidx = HS_STREAM(v), k = HS_NSTREAMS(v);
  int deny = peer < 0 ? -peer : chorus__tcp_hs_decide(t, peer, sidx, k);
  uint8_t keys[64];
  if (!deny && tp->encrypt &&
      chorus__tcp_hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, sidx, p->na, p->in + 12, keys) <
          0) {
    snprintf(why, sizeof why, "cannot derive the connection's keys (libcrypto)");
    deny = HS_DENY_AUTH;
  }
  conn_t *c = NULL;
  stream_t *s = NULL;
  chorus__peer_t *pp = deny ? NULL : chorus__tp_peer(tp, peer);
  if (!deny && !(pp && (c = chorus__tcp_conn_make(t, pp)))) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, "out of memory for the pair's state");
    return;
  }
  if (!deny && sidx > 0 && !(s = calloc(1, sizeof *s))) {
    chorus__wipe(keys, sizeof keys);
    pending_reject(p, "out of memory for the connection's state");
    return;
  }
  /* The count of the peer's piece connections: the smaller wish (its
   * first), then that one. */
  uint32_t agreed = sidx > 1 ? k : CHORUS__MIN(k, (uint32_t)t->nstreams);
  uint32_t ok_word = HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0) | HS_STREAMS(sidx, agreed);
  uint8_t reply[HS_OK_LEN];
  size_t rlen;
  if (deny) {
    chorus__le32_put(reply, HS_DENY);
    chorus__le32_put(reply + 4, (uint32_t)deny);
    rlen = HS_DENY_LEN;
  } else {
    chorus__le32_put(reply, HS_OK);
    chorus__le32_put(reply + 4, (uint32_t)tp->rank);
    chorus__le32_put(reply + 8, ok_word);
    chorus__tcp_hs_mac(tp, 1, (uint32_t)peer, (uint32_t)tp->rank, ok_word, p->na, p->in + 12,
                       reply + 12);
    rlen = HS_OK_LEN;
  }
  /* A fresh socket's buffer takes these few bytes at once. */
  ssize_t w = send(p->fd, reply, rlen, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (peer >= 0 && sidx == 0 && (deny == HS_DENY_CROSS || deny == HS_DENY_RANK)) {
    /* The peer's own attempt, which our connection replaces: no stranger. */
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: world rank %d's crossing connection refused",
                 tp->rank, peer);
    chorus__tcp_pending_drop(p);
    return;
  }
  if (deny || w != (ssize_t)rlen) {
    chorus__wipe(keys, sizeof keys);
    free(s);
    pending_reject(p, deny ? why : "could not answer it");
    return;
  }
  /* The fd moves from the pending record to the stream. */
  int fd = p->fd;
  chorus__tp_unwatch(tp, fd);
  p->fd = -1;
  chorus__tcp_pending_drop(p);
  if (sidx > 0) {
    chorus__tcp_stream_init(s, c, S_IN, (int)sidx - 1);
    if (sidx == 1) c->nin = (int)agreed;
  } else {
    s = &c->s0;
  }
  if (tp->encrypt) memcpy(s->keys, keys, sizeof keys);
  chorus__wipe(keys, sizeof keys);
  stream_ready(s, fd, 0);
}

static void on_pending_event(void *arg, uint32_t events) {
  pending_t *p = arg;
  (void)events;
  tcp_chan_t *t = p->ch;
  ssize_t got = recv(p->fd, p->in + p->got, sizeof p->in - p->got, MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (got <= 0) {
    if (p->got == 0 && (got == 0 || errno == ECONNRESET)) {
      /* Closed without a word: a port probe, or a peer's crossing attempt
       * given up (reset: our hello was still unread).  Nothing to report. */
      CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus rank %d: %s closed before its handshake",
                   t->base.tp->rank, p->addr);
      chorus__tcp_pending_drop(p);
      return;
    }
    chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                        "chorus rank %d: dropped a connection from %s: %s before the handshake "
                        "completed", t->base.tp->rank, p->addr,
                        got == 0 ? "closed" : strerror(errno));
    t->rejected++;
    chorus__tcp_pending_drop(p);
    return;
  }
  p->got += (size_t)got;
  if (p->got == sizeof p->in) pending_complete(p);
}

void chorus__tcp_on_listen_event(void *arg, uint32_t events) {
  tcp_chan_t *t = arg;
  chorus__tp_t *tp = t->base.tp;
  (void)events;
  for (int k = 0; k < 64; k++) {
    int fd = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP, "chorus rank %d: accept: %s",
                            tp->rank, strerror(errno));
      return;
    }
    if (t->npend == t->max_pending) { /* the oldest makes room */
      int oldest = 0;
      for (int i = 1; i < t->npend; i++)
        if (t->pend[i]->deadline < t->pend[oldest]->deadline) oldest = i;
      chorus__log_limited(&t->reject_log, CHORUS__SUB_TCP,
                          "chorus rank %d: %d connections are handshaking "
                          "(CHORUS_HANDSHAKE_MAX_PENDING); dropped the oldest, from %s",
                          tp->rank, t->max_pending, t->pend[oldest]->addr);
      t->rejected++;
      chorus__tcp_pending_drop(t->pend[oldest]);
    }
    pending_t *p = calloc(1, sizeof *p);
    uint8_t hello[HS_HELLO_LEN];
    if (!p || chorus__random_bytes(p->na, sizeof p->na) < 0) {
      free(p);
      close(fd);
      continue;
    }
    p->fd = fd;
    p->ch = t;
    p->watch = (chorus__watch_t){on_pending_event, p};
    p->deadline = chorus__now_ns() + (int64_t)t->hs_ms * 1000000;
    char host[64] = "?";
    int port = 0;
    chorus__net_peer_addr(fd, host, sizeof host, &port);
    snprintf(p->addr, sizeof p->addr, "%s:%d", host, port);
    chorus__le32_put(hello, HS_ACCEPT);
    chorus__le32_put(hello + 4, HS_VERSION | (tp->encrypt ? HS_FLAG_ENCRYPT : 0));
    memcpy(hello + 8, p->na, sizeof p->na);
    if (send(fd, hello, sizeof hello, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof hello ||
        chorus__tp_watch(tp, fd, EPOLLIN, &p->watch) < 0) {
      free(p);
      close(fd);
      continue;
    }
    p->slot = t->npend;
    t->pend[t->npend++] = p;
  }
}
