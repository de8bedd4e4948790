/*
 * tcp_fuzz.c - the fuzzers' entry points into the TCP channel (fuzz/;
 * declared in transport.h), compiled into the fuzz harnesses only, never
 * into libchorus.
 *
 * The fuzzers drive the receive path and the acceptor's handshake check
 * with their bytes.  A fuzzing transport has no connections and no
 * progress thread; each peer's bytes arrive through a socket pair whose
 * other end the fuzzer writes, and are parsed by chorus__tcp_read_stream
 * (tcp_io.c) exactly as socket data is.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "transport/tcp.h"
#include "util/util.h"

static void fuzz_fp_format(const chorus__fp_t *fp, char *buf, size_t cap) {
  snprintf(buf, cap, "coll %u dtype %u count %" PRIu64, fp->coll, fp->dtype, fp->count);
}

chorus__tp_t *chorus__tp_fuzz_new(int rank, int size, const chorus__key_t *key, uint64_t world) {
  chorus__tp_t *tp = chorus__tp_alloc(rank, size, key, world);
  if (!tp) return NULL;
  tp->budget = (size_t)1 << 20;
  tp->fp_format = fuzz_fp_format;
  tcp_chan_t *t = chorus__tcp_new(tp);
  if (!t) {
    chorus__tp_free(tp);
    return NULL;
  }
  tp->net = &t->base;
  for (int r = 0; r < size; r++) {
    if (r == rank) continue;
    chorus__peer_t *p = chorus__tp_peer(tp, r);
    if (!p) {
      chorus__tp_free(tp);
      return NULL;
    }
    snprintf(p->addr, sizeof p->addr, "fuzz:%d", r);
  }
  return tp;
}

/* peer's pair state, made now if need be; NULL when out of memory. */
static conn_t *fuzz_conn(chorus__tp_t *tp, int peer) {
  chorus__peer_t *p = chorus__tp_peer(tp, peer);
  return p ? chorus__tcp_conn_make((tcp_chan_t *)tp->net, p) : NULL;
}

void chorus__tp_set_fp_format(chorus__tp_t *tp, chorus__fp_format_fn fn) { tp->fp_format = fn; }

int chorus__tp_fuzz_pieces(chorus__tp_t *tp, int peer, int k) {
  conn_t *c = fuzz_conn(tp, peer);
  if (!c || k < 1 || k > MAX_STREAMS || c->nin) return -1;
  c->nin = k;
  return 0;
}

int chorus__tp_fuzz_feed(chorus__tp_t *tp, int peer, int stream, const void *data, size_t n,
                         int *wfd) {
  conn_t *c = fuzz_conn(tp, peer);
  if (!c || stream < 0 || stream > c->nin) return -1;
  stream_t *s = stream ? c->in[stream - 1] : &c->s0;
  if (!s) {
    if (!(s = calloc(1, sizeof *s))) return -1;
    chorus__tcp_stream_init(s, c, S_IN, stream - 1);
  }
  if (s->fd < 0) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sp) < 0) return -1;
    s->fd = sp[0];
    s->state = C_READY;
    if (stream == 0) c->state = C_READY;
    c->rx.pieces_ok = 1;
    *wfd = sp[1];
    chorus__tp_watch(tp, s->fd, EPOLLIN, &s->watch);
  }
  if (n && send(*wfd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) return -1;
  pthread_mutex_lock(&tp->lock);
  if (!c->peer->dead && !chorus__tcp_stream_blocked(s)) chorus__tcp_read_stream(s);
  if (!c->peer->dead) tp->net->ops->poll(tp->net);
  int dead = c->peer->dead;
  pthread_mutex_unlock(&tp->lock);
  return dead ? -1 : 0;
}

chorus__aead_t *chorus__tp_fuzz_encrypt(chorus__tp_t *tp, int peer) {
  conn_t *c = fuzz_conn(tp, peer);
  static const uint8_t zero[CHORUS__NONCE_LEN];
  uint8_t keys[64];
  if (!c || c->s0.rx_aead || peer <= tp->rank ||
      chorus__tcp_hs_keys(tp, (uint32_t)peer, (uint32_t)tp->rank, 0, zero, zero, keys) < 0)
    return NULL;
  stream_t *s = &c->s0;
  /* This rank accepted peer: it receives on keys[0..32), label 1. */
  s->rx_aead = chorus__aead_new(keys, 1, 0);
  s->tx_aead = chorus__aead_new(keys + 32, 2, 1);
  s->rx_rec = malloc(REC_MAX + REC_OVERHEAD);
  s->tx_rec = malloc(REC_MAX + REC_OVERHEAD);
  chorus__aead_t *sealer = chorus__aead_new(keys, 1, 1);
  chorus__wipe(keys, sizeof keys);
  tp->encrypt = 1;
  return s->rx_aead && s->tx_aead && s->rx_rec && s->tx_rec ? sealer : NULL;
}

size_t chorus__tp_fuzz_seal(chorus__aead_t *sealer, const void *in, size_t n, uint8_t *out) {
  if (n > REC_MAX) n = REC_MAX;
  chorus__le32_put(out, (uint32_t)n);
  if (chorus__aead_seal(sealer, out, 4, in, out + 4, n, out + 4 + n) < 0) return 0;
  return n + REC_OVERHEAD;
}

int chorus__tp_fuzz_handshake(chorus__tp_t *tp, const void *msg, size_t n) {
  pending_t p;
  memset(&p, 0, sizeof p);
  memcpy(p.in, msg, n < sizeof p.in ? n : sizeof p.in);
  char why[160];
  tcp_chan_t *t = (tcp_chan_t *)tp->net;
  int peer = chorus__tcp_hs_verify(t, &p, why, sizeof why);
  if (peer < 0) return peer;
  uint32_t v = chorus__le32_get(p.in + 4);
  int deny = chorus__tcp_hs_decide(t, peer, HS_STREAM(v), HS_NSTREAMS(v));
  return deny ? -deny : peer;
}

void chorus__tp_fuzz_free(chorus__tp_t *tp) {
  if (tp) chorus__tp_free(tp);
}
