/*
 * endpoint_progress.c - the transport context's life and its progress
 * thread: creating the context (its channels, then the thread), the
 * thread's loop (the channels' descriptors, heartbeats, the silence
 * detector), the goodbyes of chorus__tp_destroy, and what happens when the
 * process exits with the context alive.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/endpoint_internal.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/net.h"
#include "util/util.h"

/* ----------------------------------------------------------- progress */

void chorus__tp_kick(chorus__tp_t *tp) {
  uint64_t one = 1;
  if (tp->evfd >= 0) (void)!write(tp->evfd, &one, sizeof one);
}

int chorus__tp_watch(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w) {
  struct epoll_event ev = {.events = events, .data.ptr = w};
  return epoll_ctl(tp->epfd, EPOLL_CTL_ADD, fd, &ev);
}

int chorus__tp_watch_mod(chorus__tp_t *tp, int fd, uint32_t events, chorus__watch_t *w) {
  struct epoll_event ev = {.events = events, .data.ptr = w};
  return epoll_ctl(tp->epfd, EPOLL_CTL_MOD, fd, &ev);
}

void chorus__tp_unwatch(chorus__tp_t *tp, int fd) { epoll_ctl(tp->epfd, EPOLL_CTL_DEL, fd, NULL); }

static void on_kick(void *arg, uint32_t events) {
  chorus__tp_t *tp = arg;
  (void)events;
  uint64_t v;
  (void)!read(tp->evfd, &v, sizeof v);
}

/* Between events: a thread waits for the lock (chorus__tp_lock) or was
 * woken to see a completion, so let it have the lock first -- for at most
 * YIELD_NS, in case it went elsewhere. */
#define YIELD_NS 20000
static void progress_yield(chorus__tp_t *tp) {
  if (!__atomic_load_n(&tp->lock_wanted, __ATOMIC_SEQ_CST) &&
      !__atomic_load_n(&tp->kicked, __ATOMIC_SEQ_CST))
    return;
  pthread_mutex_unlock(&tp->lock);
  int64_t until = chorus__now_ns() + YIELD_NS;
  do
    for (int k = 0; k < 32; k++) chorus__cpu_relax();
  while ((__atomic_load_n(&tp->lock_wanted, __ATOMIC_SEQ_CST) ||
          __atomic_load_n(&tp->kicked, __ATOMIC_SEQ_CST)) &&
         chorus__now_ns() < until);
  pthread_mutex_lock(&tp->lock);
}

static void *progress_main(void *arg) {
  chorus__tp_t *tp = arg;
  struct epoll_event evs[64];
  chorus__chan_t *local = tp->local, *net = tp->net;
  pthread_mutex_lock(&tp->lock);
  while (!__atomic_load_n(&tp->stopping, __ATOMIC_ACQUIRE)) {
    int busy = 0;
    if (local) busy |= local->ops->idle(local, 1);
    if (net && net->ops->idle) busy |= net->ops->idle(net, 1);
    pthread_mutex_unlock(&tp->lock);
    int n = epoll_wait(tp->epfd, evs, 64, busy ? 0 : HEARTBEAT_MS / 2);
    int err = errno;
    pthread_mutex_lock(&tp->lock);
    if (local) local->ops->idle(local, 0);
    if (net && net->ops->idle) net->ops->idle(net, 0);
    if (n < 0) {
      if (err == EINTR) continue;
      CHORUS_WARN(CHORUS__SUB_TCP, "chorus: epoll_wait failed: %s", strerror(err));
      pthread_mutex_unlock(&tp->lock);
      struct timespec ts = {0, 10000000};
      nanosleep(&ts, NULL);
      pthread_mutex_lock(&tp->lock);
      continue;
    }
    for (int i = 0; i < n; i++) {
      chorus__watch_t *w = evs[i].data.ptr;
      w->fn(w->arg, evs[i].events);
      progress_yield(tp);
    }
    if (tp->net && tp->net->ops->poll) tp->net->ops->poll(tp->net);
    int64_t now = chorus__now_ns();
    if (now - tp->last_ping >= (int64_t)HEARTBEAT_MS * 1000000) {
      tp->last_ping = now;
      CHORUS__FOR_PEERS(tp, c) {
        if (c->rank != tp->rank && c->chan && !c->dead && !tp->bye_sent &&
            chorus__peer_linked(c) && !c->chan->ops->pending(c->chan, c, NULL))
          chorus__tp_send_control(tp, c, T_PING, 0, NULL, -1);
      }
      chorus__tp_check_silence(tp, now);
    }
  }
  pthread_mutex_unlock(&tp->lock);
  return NULL;
}

/* ---------------------------------------------------------- lifecycle */

/* How long an exiting process gives the ABORTs it queued to leave, and
 * its progress thread to stop. */
#define EXIT_FLUSH_MS 200
#define EXIT_JOIN_MS 1000

/* The process exits with this world alive (util/exit.h): every endpoint
 * fails and tells its peers why, the ABORTs get EXIT_FLUSH_MS to leave
 * (dialling a peer never talked to included), then the progress thread
 * stops and no channel is called again. */
static void tp_on_exit(void *arg) {
  chorus__tp_t *tp = arg;
  /* Only a signal handler that called exit() while this thread held the
   * lock keeps it: then nothing can be stopped safely. */
  if (chorus__lock_within(&tp->lock, 1000) != 0) return;
  __atomic_store_n(&tp->exiting, 1, __ATOMIC_RELEASE);
  for (chorus__ep_t *ep = tp->eps; ep; ep = ep->next)
    chorus__ep_fail_locked(ep, CHORUS_ERR_ABORTED, 1,
                           "chorus rank %d/%d: its process is exiting with the communicator alive "
                           "(main returned, or exit() was called, before chorus_comm_destroy)",
                           ep->me, ep->n);
  int64_t until = chorus__now_ns() + (int64_t)EXIT_FLUSH_MS * 1000000;
  while (tp->thread_started && chorus__now_ns() < until) {
    int waiting = 0;
    CHORUS__FOR_PEERS(tp, c) {
      if (c->rank != tp->rank && c->chan && !c->dead && c->chan->ops->pending(c->chan, c, NULL)) {
        waiting = 1;
        break;
      }
    }
    if (!waiting) break;
    struct timespec step = chorus__deadline_timespec(chorus__now_ns() + 5000000);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &step);
  }
  __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&tp->lock);
  chorus__tp_kick(tp);
  if (tp->thread_started && chorus__join_within(tp->thread, EXIT_JOIN_MS) == 0)
    tp->thread_started = 0;
  pthread_mutex_lock(&tp->lock);
  __atomic_store_n(&tp->exiting, 2, __ATOMIC_RELEASE);
  if (!tp->thread_started) {
    if (tp->net && tp->net->ops->on_exit) tp->net->ops->on_exit(tp->net);
    if (tp->local && tp->local->ops->on_exit) tp->local->ops->on_exit(tp->local);
  }
  pthread_mutex_unlock(&tp->lock);
}

chorus__tp_t *chorus__tp_alloc(int rank, int size, const chorus__key_t *key, uint64_t world) {
  chorus__tp_t *tp = calloc(1, sizeof *tp);
  if (!tp) return NULL;
  tp->rank = rank;
  tp->size = size;
  tp->key = *key;
  tp->world_id = world;
  tp->epfd = tp->evfd = -1;
  pthread_mutex_init(&tp->lock, NULL);
  chorus__cond_init_monotonic(&tp->cond);
  tp->peers = calloc((size_t)size, sizeof *tp->peers);
  tp->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (!tp->peers || tp->epfd < 0) {
    chorus__tp_free(tp);
    return NULL;
  }
  return tp;
}

/* Where rank r is, or would go, in tp->touched. */
static int touched_pos(const chorus__tp_t *tp, int r) {
  int lo = 0, hi = tp->ntouched;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (tp->touched[mid]->rank < r) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

chorus__peer_t *chorus__tp_peer(chorus__tp_t *tp, int r) {
  peer_t *p = tp->peers[r];
  if (p) return p;
  if (tp->ntouched == tp->cap_touched) {
    int cap = tp->cap_touched ? 2 * tp->cap_touched : 16;
    peer_t **t = realloc(tp->touched, sizeof *t * (size_t)cap);
    if (!t) return NULL;
    tp->touched = t;
    tp->cap_touched = cap;
  }
  p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->rank = r;
  p->last_heard = chorus__now_ns();
  snprintf(p->addr, sizeof p->addr, "%s", chorus__tp_peer_addr(tp, r));
  p->chan = r == tp->rank ? NULL : tp->carrier;
  int i = touched_pos(tp, r);
  memmove(tp->touched + i + 1, tp->touched + i, sizeof *tp->touched * (size_t)(tp->ntouched - i));
  tp->touched[i] = p;
  tp->ntouched++;
  tp->peers[r] = p;
  return p;
}

chorus__peer_t *chorus__tp_peer_next(const chorus__tp_t *tp, int r) {
  int i = touched_pos(tp, r + 1);
  return i < tp->ntouched ? tp->touched[i] : NULL;
}

const char *chorus__tp_peer_addr(const chorus__tp_t *tp, int r) {
  if (tp->peers[r]) return tp->peers[r]->addr;
  return tp->addr_off ? tp->addr_text + tp->addr_off[r] : "?";
}

/* Keeps every rank's listener from its record ("host port"), packed, for
 * the peers touched later: "host:port", or "?" where it does not parse.
 * -1: out of memory. */
static int keep_addrs(chorus__tp_t *tp, const char *const *addrs) {
  size_t len = 0;
  for (int pass = 0; pass < 2; pass++) {
    if (pass) { /* len: what the first pass counted */
      if (len > UINT32_MAX) return -1;
      tp->addr_text = malloc(len);
      tp->addr_off = malloc(sizeof *tp->addr_off * (size_t)tp->size);
      if (!tp->addr_text || !tp->addr_off) return -1;
    }
    len = 0;
    for (int r = 0; r < tp->size; r++) {
      char host[64], one[80] = "?";
      int port;
      if (chorus__net_split_addr(addrs[r], ' ', host, sizeof host, &port) == 0)
        snprintf(one, sizeof one, "%s:%d", host, port);
      size_t n = strlen(one) + 1;
      if (pass) {
        memcpy(tp->addr_text + len, one, n);
        tp->addr_off[r] = (uint32_t)len;
      }
      len += n;
    }
  }
  return 0;
}

void chorus__tp_free(chorus__tp_t *tp) {
  /* The streams live in the channels: their ABORT texts go first. */
  for (int i = 0; i < tp->ntouched; i++) {
    for (rx_t *rx = tp->touched[i]->rxs; rx; rx = rx->next) free(rx->abort);
    free(tp->touched[i]->dead_why);
  }
  if (tp->net) tp->net->ops->destroy(tp->net);
  if (tp->local) tp->local->ops->destroy(tp->local);
  while (tp->unexp_head) {
    unexp_t *u = tp->unexp_head;
    tp->unexp_head = u->next;
    free(u->buf);
    free(u);
  }
  if (tp->epfd >= 0) close(tp->epfd);
  if (tp->evfd >= 0) close(tp->evfd);
  pthread_mutex_destroy(&tp->lock);
  pthread_cond_destroy(&tp->cond);
  for (int i = 0; i < tp->ntouched; i++) free(tp->touched[i]);
  free(tp->touched);
  free(tp->peers);
  free(tp->addr_text);
  free(tp->addr_off);
  free(tp);
}

chorus_result_t chorus__tp_create(const chorus__tp_config_t *cfg, chorus__tp_t **out,
                                  char *errmsg, size_t errcap) {
  /* The doorbell the shared-memory channel takes (it is part of cfg only
   * with the host map). */
  const int bell = cfg->host ? cfg->bell_fd : -1;
  chorus__tp_t *tp = chorus__tp_alloc(cfg->rank, cfg->size, cfg->key, cfg->world_id);
  if (!tp) {
    if (bell >= 0) close(bell);
    close(cfg->listen_fd);
    chorus__ucx_worker_free(cfg->ucx);
    return CHORUS_ERR_NO_MEMORY;
  }
  tp->fp_format = cfg->fp_format;
  long budget = chorus__env()->RECV_BUFFER_MAX;
  tp->budget = budget > 0 ? (size_t)budget : (size_t)64 << 20;
  tp->encrypt = chorus__env()->ENCRYPT;
  long peer_ms = chorus__env()->PEER_TIMEOUT_MS;
  /* Never below 4 heartbeats: a peer is not silent between two of them. */
  tp->peer_timeout_ns = peer_ms <= 0 ? 0 : (int64_t)CHORUS__MAX(peer_ms, 4 * HEARTBEAT_MS) * 1000000;
  chorus_result_t st;
  tp->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  tp->ev_watch = (chorus__watch_t){on_kick, tp};
  if (tp->evfd < 0 || chorus__tp_watch(tp, tp->evfd, EPOLLIN, &tp->ev_watch) < 0) {
    if (bell >= 0) close(bell);
    close(cfg->listen_fd);
    chorus__ucx_worker_free(cfg->ucx);
    snprintf(errmsg, errcap, "eventfd: %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  /* Every peer is named by the address it published ("rank 1
   * (10.0.0.7:4000)"); a channel may name its own peers otherwise. */
  if (cfg->addrs && keep_addrs(tp, cfg->addrs) < 0) {
    if (bell >= 0) close(bell);
    close(cfg->listen_fd);
    chorus__ucx_worker_free(cfg->ucx);
    st = CHORUS_ERR_NO_MEMORY;
    goto fail;
  }
  tp->lookup = cfg->lookup;
  tp->lookup_arg = cfg->lookup_arg;
  /* Peers on this host first (shared memory), then TCP or UCX for the
   * rest. */
  const char *mode = chorus__env()->TRANSPORT;
  if (cfg->host && !(mode && !strcmp(mode, "tcp"))) {
    st = chorus__shm_chan_open(tp, cfg, &tp->local, errmsg, errcap); /* takes the bell */
    if (st != CHORUS_OK) {
      close(cfg->listen_fd);
      chorus__ucx_worker_free(cfg->ucx);
      goto fail;
    }
  } else if (bell >= 0) {
    close(bell);
  }
  if (cfg->ucx) {
    close(cfg->listen_fd);
    st = chorus__ucx_open(tp, cfg, &tp->net, errmsg, errcap);
  } else {
    st = chorus__tcp_open(tp, cfg, &tp->net, errmsg, errcap);
  }
  if (st != CHORUS_OK) goto fail;
  /* Silence is counted from now: connecting may have taken a while. */
  int64_t start = chorus__now_ns();
  CHORUS__FOR_PEERS(tp, c) c->last_heard = start;
  tp->last_ping = start;
  if (pthread_create(&tp->thread, NULL, progress_main, tp) != 0) {
    snprintf(errmsg, errcap, "cannot start the progress thread");
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  tp->thread_started = 1;
  if (chorus__exit_hook_add(&tp->exit_hook, tp_on_exit, tp) < 0) {
    snprintf(errmsg, errcap, "the process is exiting");
    __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
    chorus__tp_kick(tp);
    pthread_join(tp->thread, NULL);
    st = CHORUS_ERR_ABORTED;
    goto fail;
  }
  *out = tp;
  return CHORUS_OK;
fail:
  chorus__tp_free(tp);
  return st;
}

void chorus__tp_destroy(chorus__tp_t *tp, int64_t bye_deadline) {
  if (!tp) return;
  /* Past the exit handler (a destroy from a later atexit handler): the
   * hook stopped what ran; OpenSSL or UCX may be gone, so nothing is
   * closed or freed -- the process's end does that. */
  if (chorus__exit_hook_remove(&tp->exit_hook)) return;
  pthread_mutex_lock(&tp->lock);
  tp->bye_sent = 1;
  chorus__tp_resume_all(tp); /* leaving: held-back messages are read and dropped */
  /* Goodbyes go where there is a connection; a peer this rank never
   * talked with has nothing to wait for. */
  CHORUS__FOR_PEERS(tp, c) {
    if (c->rank != tp->rank && c->chan && chorus__peer_linked(c))
      chorus__tp_send_control(tp, c, T_BYE, 0, NULL, -1);
  }
  /* A peer that sent nothing, not even a heartbeat, for four heartbeats is
   * stopped or hung: its goodbye is not worth waiting for (a survivor of a
   * failure would otherwise linger the whole bye timeout). */
  const int64_t silent_ns = (int64_t)4 * HEARTBEAT_MS * 1000000, start = chorus__now_ns();
  for (;;) {
    int waiting = 0;
    int64_t now = chorus__now_ns();
    CHORUS__FOR_PEERS(tp, c) {
      if (c->rank == tp->rank || c->dead || !c->chan) continue;
      if (!chorus__peer_linked(c)) {
        /* An ABORT being dialled: a peer this rank never talked with, whose
         * handshake a stopped process never answers (its kernel accepts the
         * connection), gets as long as a silent one (issue 42: survivors
         * waited the whole bye timeout for it). */
        if (c->chan->ops->pending(c->chan, c, NULL) && now - start < silent_ns) waiting = 1;
        continue;
      }
      if (now - c->last_heard > silent_ns) continue;
      if (!c->bye_received || c->chan->ops->pending(c->chan, c, NULL)) waiting = 1;
    }
    if (!waiting || chorus__ms_left(bye_deadline) == 0) break;
    /* Wake at least once a heartbeat to notice peers falling silent. */
    int64_t until = now + (int64_t)HEARTBEAT_MS * 1000000;
    struct timespec ts = chorus__deadline_timespec(until < bye_deadline ? until : bye_deadline);
    pthread_cond_timedwait(&tp->cond, &tp->lock, &ts);
  }
  __atomic_store_n(&tp->stopping, 1, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&tp->lock);
  chorus__tp_kick(tp);
  if (tp->thread_started) pthread_join(tp->thread, NULL);
  chorus__tp_free(tp);
}
