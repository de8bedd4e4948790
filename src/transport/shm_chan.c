/*
 * shm_chan.c - the shared-memory channel (chan.h): every message between two
 * ranks of one host, point-to-point and collective, through a ring in shared
 * memory instead of loopback TCP.
 *
 * Inboxes.  Every rank that has peers on its host creates one inbox, an
 * anonymous shared-memory file (memfd_create, its size sealed, memory
 * reserved up front):
 *
 *   header   magic (stored last), geometry, the owner's pid, and two words
 *            senders read before ringing: `sleeping` (the owner's progress
 *            thread is in, or about to enter, epoll_wait) and `polling`
 *            (owner threads spin on their rings)
 *   rings    one per local rank (by its index among the host's ranks; the
 *            owner's own is unused): the sender's `head` (bytes written) and
 *            the owner's `tail` (bytes consumed) on cache lines of their own,
 *            and `want_space` (the sender waits for the owner to consume)
 *   data     ring_bytes of ring data per local rank
 *
 * A ring carries exactly the byte stream a TCP connection would (wire.h
 * headers and payloads), so the endpoint layer parses it the same way and
 * a payload is copied twice in all: into the ring by the sender, out of it
 * into the posted receive (or an early-message buffer) by the owner.  Both
 * copies run at once, in pieces of at most PIECE bytes.
 *
 * An inbox has no name: nobody can create it first, open it, or find one
 * left behind by a crash (its memory goes with the last descriptor and
 * mapping).  The owner hands its descriptor to a local peer over the
 * peer's doorbell (SCM_RIGHTS) when the pair is first used ("pairs made on
 * first use" below), with a message that names the world, both
 * ranks and an HMAC under the job key over them;
 * the receiver takes it only with that proof and with the sender's
 * credentials, which the kernel adds (SO_PASSCRED), showing this user and
 * the pid the inbox's header names; it checks the seal and the geometry
 * before using any offset.  Anything else that arrives there -- a
 * stranger's descriptor, a wake-up datagram -- is dropped (the kernel
 * closes descriptors nobody takes).
 *
 * Doorbells.  Each rank binds an abstract datagram socket that the
 * progress thread watches, named "chorus-bell-" and 32 hex digits of an
 * HMAC under the job key of the world id and the rank: only the
 * job's ranks can compute it, and /proc/net/unix, which lists it to every
 * user, shows nothing a stranger can use.  A sender that published bytes
 * rings the owner's bell only when the owner sleeps and no owner thread
 * polls; an owner that consumed bytes rings the sender's when the sender
 * waits for space.  Both sides publish, fence, then read the other's word
 * (and the sleeper re-checks after raising its own), so one of the two
 * always sees the other: no wake-up is lost.  A datagram from a stranger
 * only wakes the thread.
 *
 * Waiting threads poll the rings themselves for a short while before they
 * block (chorus__ep_wait), so a small message costs no system call on
 * either side.
 *
 * Deaths.  There is no connection to close: each local peer's process is
 * watched with a pidfd, readable once it ended.  Its ring is drained first
 * (its goodbye may be there), then the peer is failed like a closed
 * connection.  Without pidfds (Linux < 5.3) a dead peer is found by the
 * silence detector (CHORUS_PEER_TIMEOUT_MS) or the timeout.
 */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "transport/chan.h"
#include "transport/shm.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/util.h"

#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
typedef chorus__tx_t txitem_t;

#ifndef MADV_POPULATE_WRITE /* Linux 5.14; older headers */
#define MADV_POPULATE_WRITE 23
#endif

#define INBOX_MAGIC 0x584f424e49524843ull /* "CHRINBOX" */
#define INBOX_VERSION 1u
/* Bytes copied before the other side is told (head / tail published), so
 * the two copies of a large message overlap. */
#define PIECE ((size_t)64 << 10)
#define RING_MIN ((size_t)64 << 10)
#define RING_MAX ((size_t)64 << 20)

typedef struct inbox_hdr {
  uint64_t magic; /* atomic; stored last by the owner */
  uint32_t version, nslots;
  uint64_t ring_bytes, bytes;
  int64_t pid;
  uint32_t unused;
  unsigned char pad0[84];
  uint32_t sleeping; /* atomic */
  uint32_t polling;  /* atomic */
  unsigned char pad1[120];
} inbox_hdr_t;

typedef struct ring {
  uint64_t head; /* atomic, the sender's */
  unsigned char pad0[120];
  uint64_t tail; /* atomic, the owner's */
  unsigned char pad1[120];
  uint32_t want_space; /* atomic, the sender's */
  unsigned char pad2[124];
} ring_t;

_Static_assert(sizeof(inbox_hdr_t) == 256, "inbox header layout");
_Static_assert(sizeof(ring_t) == 384, "ring layout");

static size_t rings_offset(void) { return sizeof(inbox_hdr_t); }
static size_t data_offset(int nslots) {
  size_t end = rings_offset() + (size_t)nslots * sizeof(ring_t);
  return (end + 4095) & ~(size_t)4095;
}
static size_t inbox_bytes(int nslots, size_t ring_bytes) {
  return data_offset(nslots) + (size_t)nslots * ring_bytes;
}

typedef struct shm_chan shm_chan_t;

/* One local peer. */
typedef struct link {
  shm_chan_t *ch;
  chorus__peer_t *peer;
  int lidx;
  /* Inbound: the peer's ring in this rank's inbox. */
  ring_t *in;
  unsigned char *in_data;
  chorus__rx_t rx;
  /* Outbound: this rank's ring in the peer's inbox. */
  void *peer_base;
  size_t peer_bytes;
  inbox_hdr_t *peer_hdr;
  ring_t *out;
  unsigned char *out_data;
  int out_ready; /* out_data's pages are reserved (reserve_ring) */
  chorus__txq_t txq;
  struct sockaddr_un bell;
  socklen_t bell_len; /* 0 until the name is computed (bell_of) */
  /* The pair is made on first use (offer): this rank's inbox handed over
   * (offered), since when, and when to try again (0: not waiting). */
  int offered, active;
  int64_t offer_since, retry_at;
  int pidfd;
  chorus__watch_t pid_watch;
} link_t;

struct shm_chan {
  chorus__chan_t base;
  void *mine; /* this rank's inbox */
  size_t mine_bytes;
  inbox_hdr_t *hdr;
  size_t ring_bytes;
  int nlocal, me;   /* local ranks, this rank's index among them */
  link_t *links;    /* by local index; links[me] unused */
  int lazy;         /* rings' pages reserved on first use (MADV_POPULATE_WRITE) */
  int memfd;        /* this rank's inbox, for handing over */
  uint64_t world;   /* the world's id */
  int rank, size;        /* world rank and size */
  int *act, nact;        /* the links in use (offered or attached), in order */
  int64_t window_ns;     /* how long a pair may take to be made */
  int64_t retry_ns;      /* between attempts while a doorbell is busy */
  int bell_fd;      /* this rank's doorbell (bound) */
  int send_fd;      /* for ringing the others */
  chorus__watch_t bell_watch;
};

static chorus__tp_t *link_tp(const link_t *l) { return l->ch->base.tp; }

static void ring_bell(shm_chan_t *ch, link_t *l) {
  /* EAGAIN: the peer has a datagram waiting already, which wakes it. */
  (void)!sendto(ch->send_fd, "", 1, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&l->bell,
                l->bell_len);
}

/* The abstract name of rank's doorbell (the file's comment). */
static void bell_addr(struct sockaddr_un *a, socklen_t *len, const chorus__key_t *key,
                      uint64_t world, int rank) {
  static const char label[] = "chorus shm bell";
  uint32_t r = (uint32_t)rank;
  const void *parts[] = {label, &world, &r};
  const size_t lens[] = {sizeof label, sizeof world, sizeof r};
  uint8_t mac[CHORUS__MAC_LEN];
  chorus__hmac(key, parts, lens, 3, mac);
  char hex[33];
  chorus__hex(hex, mac, 16);
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  /* Abstract (leading NUL): no file, gone with the socket. */
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "chorus-bell-%s", hex);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* ------------------------------------------------------------ sending */

/* Copies n bytes from src into the ring at stream position pos. */
static void ring_put(unsigned char *data, size_t size, uint64_t pos, const void *src, size_t n) {
  size_t at = (size_t)(pos & (size - 1)), first = CHORUS__MIN(n, size - at);
  memcpy(data + at, src, first);
  if (n > first) memcpy(data, (const char *)src + first, n - first);
}

static void ring_get(const unsigned char *data, size_t size, uint64_t pos, void *dst, size_t n) {
  size_t at = (size_t)(pos & (size - 1)), first = CHORUS__MIN(n, size - at);
  memcpy(dst, data + at, first);
  if (n > first) memcpy((char *)dst + first, data, n - first);
}

/* An inbox's rings take memory only once used: the sender reserves its
 * ring's pages in the peer's inbox before its first bytes, so a host of L
 * ranks holds what its ranks' pairs actually carry, not L x (L - 1) rings.
 * MADV_POPULATE_WRITE allocates them now or fails with ENOMEM, where a
 * plain write would take the process down with SIGBUS when memory runs
 * out.  Without it (Linux < 5.14) every inbox was reserved whole at
 * creation.  0, or -1 with the peer failed. */
static int reserve_ring(link_t *l) {
  shm_chan_t *ch = l->ch;
  if (!ch->lazy ||
      madvise(l->out_data, ch->ring_bytes, MADV_POPULATE_WRITE) == 0) {
    /* Linked from now on: its silence counts from here (shm_link_state). */
    if (!__atomic_load_n(&l->in->head, __ATOMIC_ACQUIRE)) l->peer->last_heard = chorus__now_ns();
    l->out_ready = 1;
    return 0;
  }
  char why[200];
  snprintf(why, sizeof why, "cannot reserve the %zu KiB shared-memory ring to it (%s); the host is "
           "out of memory: run fewer ranks per host or lower CHORUS_SHM_P2P_RING",
           ch->ring_bytes >> 10, strerror(errno));
  chorus__tp_peer_failed(link_tp(l), l->peer, why, CHORUS_ERR_NO_MEMORY);
  return -1;
}

/* Writes as much of l's queue as its ring takes.  Returns 1 if it wrote
 * anything. */
static int reserve_ring(link_t *l);
static int offer(link_t *l);

static int flush_link(link_t *l) {
  if (l->peer->dead || !l->txq.head) return 0;
  if (!l->peer_base) { /* the pair is being made: its inbox comes first */
    if (!l->offered && !l->retry_at) offer(l);
    return 0;
  }
  if (!l->out_ready && reserve_ring(l) != 0) return 0;
  shm_chan_t *ch = l->ch;
  size_t size = ch->ring_bytes;
  uint64_t head = l->out->head; /* only this rank writes it */
  int wrote = 0;
  while (l->txq.head) {
    uint64_t tail = __atomic_load_n(&l->out->tail, __ATOMIC_ACQUIRE);
    size_t space = size - (size_t)(head - tail);
    if (space == 0) {
      /* A thread of this rank polls (chorus__ep_wait): it will see the
       * space, and a bell would only wake the progress thread to fight it
       * for the lock.  It calls this again when it stops. */
      if (__atomic_load_n(&ch->hdr->polling, __ATOMIC_SEQ_CST)) break;
      /* Ask to be rung, then look once more: the owner may have consumed
       * in between without seeing the flag. */
      __atomic_store_n(&l->out->want_space, 1, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&l->out->tail, __ATOMIC_SEQ_CST) == tail) break;
      __atomic_store_n(&l->out->want_space, 0, __ATOMIC_RELAXED);
      continue;
    }
    txitem_t *it = l->txq.head;
    const unsigned char *src;
    size_t k;
    if (it->off < HDR_SIZE) {
      src = it->hdr + it->off;
      k = HDR_SIZE - it->off;
    } else {
      src = (const unsigned char *)it->payload + (it->off - HDR_SIZE);
      k = HDR_SIZE + it->len - it->off;
    }
    k = CHORUS__MIN(k, CHORUS__MIN(space, PIECE));
    ring_put(l->out_data, size, head, src, k);
    head += k;
    __atomic_store_n(&l->out->head, head, __ATOMIC_RELEASE);
    wrote = 1;
    it->off += k;
    if (it->off == HDR_SIZE + it->len) chorus__txq_pop_done(link_tp(l), &l->txq);
  }
  if (wrote) {
    /* Sequentially consistent, like the owner raising `sleeping` and its
     * last look at head: one of the two sees the other.  (A store, not a
     * fence: ThreadSanitizer does not model fences.) */
    __atomic_store_n(&l->out->head, head, __ATOMIC_SEQ_CST);
    inbox_hdr_t *h = l->peer_hdr;
    if (__atomic_load_n(&h->sleeping, __ATOMIC_SEQ_CST) &&
        !__atomic_load_n(&h->polling, __ATOMIC_SEQ_CST))
      ring_bell(ch, l);
  }
  return wrote;
}

/* ---------------------------------------------------------- receiving */

/* Parses what l's inbound ring holds.  Returns 1 if it consumed anything. */
static int read_link(link_t *l) {
  chorus__rx_t *rx = &l->rx;
  chorus__peer_t *p = l->peer;
  if (p->dead || rx->paused) return 0;
  chorus__tp_t *tp = link_tp(l);
  shm_chan_t *ch = l->ch;
  size_t size = ch->ring_bytes;
  uint64_t tail = l->in->tail; /* only this rank writes it */
  uint64_t head = __atomic_load_n(&l->in->head, __ATOMIC_SEQ_CST);
  if (head == tail) return 0;
  /* The sender's word is untrusted: it cannot claim more than the ring. */
  if (head - tail > size) {
    chorus__tp_protocol_error(tp, p, "its shared-memory ring claims more bytes than it holds");
    return 0;
  }
  while (head != tail && !p->dead && !rx->paused) {
    size_t avail = (size_t)(head - tail), k;
    if (!rx->in_payload) {
      k = CHORUS__MIN(avail, HDR_SIZE - rx->hgot);
      ring_get(l->in_data, size, tail, rx->hbuf + rx->hgot, k);
      rx->hgot += k;
      tail += k;
      __atomic_store_n(&l->in->tail, tail, __ATOMIC_RELEASE);
      if (rx->hgot == HDR_SIZE) chorus__tp_rx_header(tp, rx);
    } else {
      k = CHORUS__MIN(avail, CHORUS__MIN(rx->left, PIECE));
      if (rx->dst) ring_get(l->in_data, size, tail, rx->dst + (rx->h.len - rx->left), k);
      tail += k;
      __atomic_store_n(&l->in->tail, tail, __ATOMIC_RELEASE);
      chorus__tp_rx_bytes(tp, rx, k);
    }
    if (head == tail) head = __atomic_load_n(&l->in->head, __ATOMIC_ACQUIRE);
    if (head - tail > size) {
      chorus__tp_protocol_error(tp, p, "its shared-memory ring claims more bytes than it holds");
      return 1;
    }
  }
  p->last_heard = chorus__now_ns();
  /* Pairs with the sender raising want_space before its last look at
   * tail (both sequentially consistent). */
  __atomic_store_n(&l->in->tail, tail, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&l->in->want_space, __ATOMIC_SEQ_CST)) {
    __atomic_store_n(&l->in->want_space, 0, __ATOMIC_RELAXED);
    ring_bell(ch, l);
  }
  return 1;
}

/* Every ring both ways; 1 if anything moved. */
static int progress_all(shm_chan_t *ch) {
  int any = 0;
  for (int k = 0; k < ch->nact; k++) { /* only pairs in use can move bytes */
    link_t *l = &ch->links[ch->act[k]];
    any |= read_link(l);
    any |= flush_link(l);
  }
  return any;
}

static void take_all(shm_chan_t *ch);

static void on_bell(void *arg, uint32_t events) {
  shm_chan_t *ch = arg;
  (void)events;
  take_all(ch); /* inboxes handed over, and wake-ups */
  progress_all(ch);
}

static int shm_link_state(chorus__chan_t *ch, chorus__peer_t *p, int64_t *since);

static void on_pid(void *arg, uint32_t events) {
  link_t *l = arg;
  (void)events;
  if (l->peer->dead) return;
  read_link(l); /* its goodbye may be in the ring */
  if (l->peer->dead) return;
  /* A peer that never exchanged a byte with this rank sends it no goodbye
   * (shm_link_state): its end matters only to what needs it. */
  if (shm_link_state(&l->ch->base, l->peer, NULL) == CHORUS__LINK_NONE)
    chorus__tp_peer_ended_quietly(link_tp(l), l->peer, "exited (its process ended)");
  else
    chorus__tp_peer_failed(link_tp(l), l->peer, "exited (its process ended)", CHORUS_ERR_REMOTE);
}

/* ------------------------------------------------- the channel's ops */

static link_t *link_of(chorus__chan_t *ch, const chorus__peer_t *p) {
  (void)ch;
  return p->link;
}

static void shm_send(chorus__chan_t *ch, chorus__peer_t *p, txitem_t *it) {
  link_t *l = link_of(ch, p);
  chorus__txq_push(&l->txq, it);
  if (l->txq.head == it) flush_link(l);
}

static void shm_rx_pause(chorus__chan_t *ch, chorus__rx_t *rx, int on) {
  /* read_link skips a paused stream; the ring holds the rest meanwhile and
   * the sender waits for space. */
  (void)rx;
  if (!on) chorus__tp_kick(ch->tp);
}

static int shm_cancel(chorus__chan_t *ch, chorus__peer_t *p, chorus__ep_t *ep) {
  return chorus__txq_cancel(&link_of(ch, p)->txq, ep);
}

static int shm_pending(chorus__chan_t *ch, chorus__peer_t *p, const chorus__ep_t *ep) {
  return chorus__txq_has(&link_of(ch, p)->txq, ep);
}

static void shm_close(chorus__chan_t *ch, chorus__peer_t *p) {
  link_t *l = link_of(ch, p);
  if (l->pidfd >= 0) chorus__tp_unwatch(ch->tp, l->pidfd);
  chorus__txq_lose(ch->tp, p, &l->txq);
}

static void shm_link_desc(chorus__chan_t *ch, chorus__peer_t *p, char *buf, size_t cap) {
  shm_chan_t *s = (shm_chan_t *)ch;
  snprintf(buf, cap, "shm ring %zu KiB each way (same host, local ranks %d and %d)",
           s->ring_bytes >> 10, s->me, link_of(ch, p)->lidx);
}

static int shm_progress(chorus__chan_t *ch) { return progress_all((shm_chan_t *)ch); }

static void tick(shm_chan_t *ch);

static int shm_idle(chorus__chan_t *ch, int sleeping) {
  shm_chan_t *s = (shm_chan_t *)ch;
  if (sleeping) tick(s); /* pairs being made: retries and deadlines */
  __atomic_store_n(&s->hdr->sleeping, (uint32_t)sleeping, __ATOMIC_SEQ_CST);
  /* Going to sleep: look once more after raising the flag (a sender that
   * published before seeing it did not ring). */
  if (sleeping) progress_all(s);
  return 0;
}

static void shm_polling(chorus__chan_t *ch, int on) {
  shm_chan_t *s = (shm_chan_t *)ch;
  if (on) __atomic_add_fetch(&s->hdr->polling, 1, __ATOMIC_SEQ_CST);
  else __atomic_sub_fetch(&s->hdr->polling, 1, __ATOMIC_SEQ_CST);
}

static void shm_destroy(chorus__chan_t *base) {
  shm_chan_t *ch = (shm_chan_t *)base;
  if (ch->links) {
    for (int i = 0; i < ch->nlocal; i++) {
      link_t *l = &ch->links[i];
      if (i == ch->me) continue;
      chorus__txq_free(&l->txq);
      if (l->pidfd >= 0) close(l->pidfd);
      if (l->peer_base) munmap(l->peer_base, l->peer_bytes);
    }
  }
  if (ch->mine) munmap(ch->mine, ch->mine_bytes);
  if (ch->memfd >= 0) close(ch->memfd);
  if (ch->bell_fd >= 0) close(ch->bell_fd);
  if (ch->send_fd >= 0) close(ch->send_fd);
  free(ch->links);
  free(ch->act);
  free(ch);
}

/* A pair is linked once bytes went either way: this rank's ring to the
 * peer is in use, or the peer's to this rank holds or held bytes.  Until
 * then no heartbeat flows between them and silence means nothing, as for a
 * TCP pair never connected: a host of L ranks does not exchange L x (L - 1)
 * heartbeats (nor reserve a ring per pair for them) when each rank talks
 * with a few. */
static int shm_link_state(chorus__chan_t *ch, chorus__peer_t *p, int64_t *since) {
  (void)ch;
  const link_t *l = p->link;
  if (l->peer_base && (l->out_ready || __atomic_load_n(&l->in->head, __ATOMIC_ACQUIRE)))
    return CHORUS__LINK_READY;
  if (!l->peer_base && (l->offered || l->retry_at)) {
    if (since) *since = l->offer_since;
    return CHORUS__LINK_DIALING;
  }
  return CHORUS__LINK_NONE;
}

static const chorus__chan_ops_t shm_ops = {
    .name = "shm",
    .send = shm_send,
    .rx_pause = shm_rx_pause,
    .cancel = shm_cancel,
    .pending = shm_pending,
    .close = shm_close,
    .link_desc = shm_link_desc,
    .link_state = shm_link_state,
    .poll = NULL,
    .progress = shm_progress,
    .idle = shm_idle,
    .polling = shm_polling,
    .destroy = shm_destroy,
};

/* ---------------------------------------------------------- set-up */

static int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

/* Maps the inbox a local peer handed over (fd, from the process pid the
 * kernel vouched for), checks it, and sets l's outbound side up; fd is
 * closed. */
static chorus_result_t attach_peer(shm_chan_t *ch, link_t *l, int fd, pid_t pid, char *errmsg,
                                   size_t cap) {
  struct stat sb;
  void *base = MAP_FAILED;
  int seals = fcntl(fd, F_GET_SEALS);
  size_t bytes = inbox_bytes(ch->nlocal, ch->ring_bytes);
  if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_uid == geteuid() &&
      (size_t)sb.st_size == bytes && seals >= 0 && (seals & F_SEAL_SHRINK))
    base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  inbox_hdr_t *h = base;
  if (base == MAP_FAILED ||
      __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != INBOX_MAGIC ||
      h->version != INBOX_VERSION || h->nslots != (uint32_t)ch->nlocal ||
      h->ring_bytes != ch->ring_bytes || h->bytes != bytes || h->pid != (int64_t)pid) {
    snprintf(errmsg, cap, "local rank %d (world rank %d, pid %d) handed over a shared-memory "
             "inbox that is not one for %d local ranks with %zu-byte rings, sealed, of this user",
             l->lidx, l->peer->rank, (int)pid, ch->nlocal, ch->ring_bytes);
    if (base != MAP_FAILED) munmap(base, bytes);
    return CHORUS_ERR_PROTOCOL;
  }
  l->peer_base = base;
  l->peer_bytes = bytes;
  l->peer_hdr = h;
  l->out = (ring_t *)((char *)base + rings_offset()) + ch->me;
  l->out_data = (unsigned char *)base + data_offset(ch->nlocal) + (size_t)ch->me * ch->ring_bytes;
  l->pidfd = open_pidfd(pid);
  if (l->pidfd < 0)
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus: no pidfd for local rank %d (pid %d): %s; its death "
                 "is found by silence instead", l->lidx, (int)pid, strerror(errno));
  return CHORUS_OK;
}

/* What goes with an inbox's descriptor to a local peer's doorbell. */
typedef struct {
  uint64_t magic, world;
  uint32_t from, to; /* world ranks */
  uint8_t mac[CHORUS__MAC_LEN];
} handover_t;

static void handover_mac(const chorus__key_t *key, const handover_t *m,
                         uint8_t mac[CHORUS__MAC_LEN]) {
  static const char label[] = "chorus shm inbox";
  const void *parts[] = {label, &m->world, &m->from, &m->to};
  const size_t lens[] = {sizeof label, sizeof m->world, sizeof m->from, sizeof m->to};
  chorus__hmac(key, parts, lens, 4, mac);
}

/* l's doorbell's name, computed when first needed. */
static const struct sockaddr_un *bell_of(link_t *l) {
  if (!l->bell_len)
    bell_addr(&l->bell, &l->bell_len, &l->ch->base.tp->key, l->ch->world, l->peer->rank);
  return &l->bell;
}

/* Sends this rank's inbox to l's doorbell: 1 sent, 0 not now (its queue is
 * full), -1 error (errno; ECONNREFUSED or ENOENT: the doorbell is gone). */
static int hand_over(shm_chan_t *ch, link_t *l) {
  handover_t m = {INBOX_MAGIC, ch->world, (uint32_t)ch->rank, (uint32_t)l->peer->rank, {0}};
  handover_mac(&ch->base.tp->key, &m, m.mac);
  struct iovec iov = {&m, sizeof m};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  memset(&ctl, 0, sizeof ctl);
  struct msghdr mh = {.msg_name = (void *)bell_of(l), .msg_namelen = l->bell_len, .msg_iov = &iov,
                      .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
  struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &ch->memfd, sizeof(int));
  if (sendmsg(ch->send_fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof m) return 1;
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EINTR) return 0;
  return -1;
}

/* Takes one datagram off this rank's doorbell: a local peer's inbox
 * (attached to its link, *lp), or anything else (dropped, its descriptors
 * closed).  1 attached, 0 nothing usable, -1 nothing queued, or -2 with *st
 * set and *lp the peer whose inbox is unusable. */
static int take_handover(shm_chan_t *ch, link_t **lp, chorus_result_t *st, char *errmsg,
                         size_t cap) {
  handover_t m;
  char extra;
  struct iovec iov[2] = {{&m, sizeof m}, {&extra, 1}};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(4 * sizeof(int)) + CMSG_SPACE(sizeof(struct ucred))];
  } ctl;
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2, .msg_control = ctl.buf,
                      .msg_controllen = sizeof ctl.buf};
  ssize_t n = recvmsg(ch->bell_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) return -1;
  int fds[8], nfds = 0, have_cred = 0;
  struct ucred cred = {0, 0, 0};
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET) continue;
    if (c->cmsg_type == SCM_RIGHTS) {
      size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k && nfds < 8; i++)
        memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    } else if (c->cmsg_type == SCM_CREDENTIALS && c->cmsg_len >= CMSG_LEN(sizeof cred)) {
      memcpy(&cred, CMSG_DATA(c), sizeof cred);
      have_cred = 1;
    }
  }
  int ok = 0;
  link_t *l = NULL;
  if (n == (ssize_t)sizeof m && !(mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) && nfds == 1 &&
      have_cred && cred.uid == geteuid() && m.magic == INBOX_MAGIC && m.world == ch->world &&
      m.to == (uint32_t)ch->rank && m.from < (uint32_t)ch->size &&
      chorus__tp_chan_of(ch->base.tp, (int)m.from) == &ch->base) {
    l = ch->base.tp->peers[m.from]->link; /* a local rank: touched when the channel opened */
    uint8_t want[CHORUS__MAC_LEN];
    handover_mac(&ch->base.tp->key, &m, want);
    ok = !l->peer_base && !l->peer->dead && chorus__ct_equal(want, m.mac, sizeof want);
  }
  if (!ok) {
    for (int i = 0; i < nfds; i++) close(fds[i]);
    /* A descriptor or a message of the handover's size from someone who
     * cannot prove the key: say so once (a wake-up is silent). */
    if ((nfds || n == (ssize_t)sizeof m) && !(l && (l->peer_base || l->peer->dead))) {
      static int said;
      if (!said++)
        CHORUS_WARN(CHORUS__SUB_TCP, "chorus rank %d: dropped a datagram on its shared-memory "
                    "doorbell that is not a local rank's inbox (uid %u, pid %d): a stranger, "
                    "or another job", ch->rank, (unsigned)cred.uid, (int)cred.pid);
    }
    return 0;
  }
  *lp = l;
  *st = attach_peer(ch, l, fds[0], cred.pid, errmsg, cap);
  return *st == CHORUS_OK ? 1 : -2;
}

/* -------------------------------------------- pairs made on first use
 *
 * A pair of local ranks exchanges inboxes when the first message between
 * them is sent, as TCP connects a pair: the sender hands its inbox over
 * (offer), the peer maps it and answers with its own, and the messages
 * queued meanwhile go.  Start-up does nothing per pair, so a host of L
 * ranks makes the pairs its ranks use, not L x (L - 1).  Every doorbell was
 * bound before its rank's record went out (chorus__shm_bell_bind), so one
 * that is gone is a rank that ended; one that does not answer within the
 * window fails the pair, as a dial does. */

static void activate(link_t *l) {
  shm_chan_t *ch = l->ch;
  if (l->active) return;
  l->active = 1;
  ch->act[ch->nact++] = l->lidx;
}

/* Hands this rank's inbox to l's peer (the pair's first message, or the
 * answer to the peer's).  0: sent, or to be tried again (retry_at); -1:
 * the peer failed. */
static int offer(link_t *l) {
  shm_chan_t *ch = l->ch;
  int64_t now = chorus__now_ns();
  if (!l->offer_since) l->offer_since = now;
  activate(l);
  int rc = hand_over(ch, l);
  l->retry_at = rc == 0 ? now + ch->retry_ns : 0;
  if (rc == 1) l->offered = 1;
  if (rc >= 0) return 0;
  char why[300];
  if (errno == ECONNREFUSED || errno == ENOENT)
    snprintf(why, sizeof why, "its shared-memory doorbell is gone: its process has ended, or "
             "left init with an error (its own output says why)");
  else
    snprintf(why, sizeof why, "cannot hand it this rank's shared-memory inbox: %s",
             strerror(errno));
  chorus__tp_peer_failed(link_tp(l), l->peer, why, CHORUS_ERR_REMOTE);
  return -1;
}

/* Every datagram on the doorbell: inboxes handed over (each answered with
 * this rank's, then the pair's queue goes), the rest dropped. */
static void take_all(shm_chan_t *ch) {
  chorus_result_t st;
  char err[400];
  link_t *l;
  int rc;
  while ((rc = take_handover(ch, &l, &st, err, sizeof err)) != -1) {
    if (rc == -2) {
      chorus__tp_peer_failed(link_tp(l), l->peer, err, st);
      continue;
    }
    if (rc != 1) continue;
    activate(l);
    if (l->pidfd >= 0 && chorus__tp_watch(link_tp(l), l->pidfd, EPOLLIN, &l->pid_watch) < 0) {
      close(l->pidfd);
      l->pidfd = -1;
    }
    if (!l->offered && !l->retry_at && offer(l) != 0) continue;
    flush_link(l);
  }
}

/* The pairs being made: doorbells that were busy tried again, and a peer
 * that did not answer within the window failed. */
static void tick(shm_chan_t *ch) {
  int64_t now = chorus__now_ns();
  for (int k = 0; k < ch->nact; k++) {
    link_t *l = &ch->links[ch->act[k]];
    if (l->peer->dead || (l->peer_base && !l->retry_at)) continue;
    if (l->retry_at) {
      if (now >= l->retry_at) {
        l->retry_at = 0;
        if (offer(l) == 0 && l->offered && l->peer_base) flush_link(l);
      }
      continue;
    }
    if (now - l->offer_since > ch->window_ns) {
      char why[200];
      snprintf(why, sizeof why, "did not hand over its shared-memory inbox within %lld ms of this "
               "rank's (its process is stopped or hung)", (long long)(ch->window_ns / 1000000));
      chorus__tp_peer_failed(link_tp(l), l->peer, why, CHORUS_ERR_TIMEOUT);
    }
  }
}

int chorus__shm_bell_bind(const chorus__key_t *key, uint64_t world, int rank) {
  struct sockaddr_un a;
  socklen_t alen;
  bell_addr(&a, &alen, key, world, rank);
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), on = 1;
  if (fd < 0) return -errno;
  if (setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) < 0 ||
      bind(fd, (struct sockaddr *)&a, alen) < 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

/* Every other rank of this host: touched now, carried by this channel
 * from now on; its pair is made when first used (offer).  NO_MEMORY when a
 * peer's state could not be made. */
static chorus_result_t claim_peers(shm_chan_t *ch, const chorus__tp_config_t *cfg) {
  chorus__tp_t *tp = ch->base.tp;
  int li = 0;
  for (int r = 0; r < cfg->size; r++) {
    if (cfg->host[r] != cfg->host[cfg->rank]) continue;
    link_t *l = &ch->links[li];
    l->ch = ch;
    l->lidx = li;
    l->pidfd = -1;
    li++;
    if (r == cfg->rank) continue;
    if (!(l->peer = chorus__tp_peer(tp, r))) return CHORUS_ERR_NO_MEMORY;
    l->in = (ring_t *)((char *)ch->mine + rings_offset()) + l->lidx;
    l->in_data = (unsigned char *)ch->mine + data_offset(ch->nlocal) +
                 (size_t)l->lidx * ch->ring_bytes;
    l->pid_watch = (chorus__watch_t){on_pid, l};
    if (!strcmp(l->peer->addr, "?")) /* no record read: named by where it is */
      snprintf(l->peer->addr, sizeof l->peer->addr, "this host");
    chorus__tp_rx_attach(tp, l->peer, &l->rx, &ch->base, l);
    l->peer->chan = &ch->base;
    l->peer->link = l;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__shm_chan_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                      chorus__chan_t **out, char *errmsg, size_t errcap) {
  *out = NULL;
  int me = -1, nlocal = 0;
  for (int r = 0; r < cfg->size; r++) {
    if (cfg->host[r] != cfg->host[cfg->rank]) continue;
    if (r == cfg->rank) me = nlocal;
    nlocal++;
  }
  if (nlocal < 2) { /* nobody to share memory with */
    if (cfg->bell_fd >= 0) close(cfg->bell_fd);
    return CHORUS_OK;
  }
  shm_chan_t *ch = calloc(1, sizeof *ch);
  if (!ch) {
    if (cfg->bell_fd >= 0) close(cfg->bell_fd);
    return CHORUS_ERR_NO_MEMORY;
  }
  ch->base.ops = &shm_ops;
  ch->base.tp = tp;
  ch->nlocal = nlocal;
  ch->me = me;
  ch->bell_fd = cfg->bell_fd;
  ch->send_fd = ch->memfd = -1;
  ch->world = cfg->world_id;
  ch->rank = cfg->rank;
  ch->size = cfg->size;
  /* A pair may take as long to be made as forming the world could (at
   * least 10 s), as a TCP dial. */
  ch->window_ns = (int64_t)CHORUS__MAX(chorus__ms_left(cfg->deadline), 10000) * 1000000;
  ch->retry_ns = (int64_t)(cfg->retry_ms > 0 ? cfg->retry_ms : 50) * 1000000;
  ch->bell_watch = (chorus__watch_t){on_bell, ch};
  /* Ring size: CHORUS_SHM_P2P_RING, at most 64 MiB of inbox per rank. */
  long want = chorus__env()->SHM_P2P_RING;
  size_t rb = want > 0 ? (size_t)want : (size_t)512 << 10;
  if (rb > ((size_t)64 << 20) / (size_t)(nlocal - 1)) rb = ((size_t)64 << 20) / (size_t)(nlocal - 1);
  rb = CHORUS__MAX(rb, RING_MIN);
  rb = CHORUS__MIN(rb, RING_MAX);
  size_t p2 = RING_MIN;
  while (p2 * 2 <= rb) p2 *= 2;
  ch->ring_bytes = p2;
  ch->links = calloc((size_t)nlocal, sizeof(link_t));
  ch->act = calloc((size_t)nlocal, sizeof(int));
  chorus_result_t st = CHORUS_OK;
  if (!ch->links || !ch->act) {
    st = CHORUS_ERR_NO_MEMORY;
    goto fail;
  }
  /* This rank's doorbell (the kernel adds each sender's credentials): bound
   * before its record went out (bootstrap), else here; then its inbox. */
  if (ch->bell_fd < 0) {
    int fd = chorus__shm_bell_bind(&tp->key, cfg->world_id, cfg->rank);
    if (fd < 0) {
      snprintf(errmsg, errcap, "cannot make the shared-memory doorbell: %s", strerror(-fd));
      st = CHORUS_ERR_SYSTEM;
      goto fail;
    }
    ch->bell_fd = fd;
  }
  ch->send_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (ch->send_fd < 0) {
    snprintf(errmsg, errcap, "cannot make a socket for the shared-memory doorbells: %s",
             strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  size_t bytes = inbox_bytes(nlocal, ch->ring_bytes);
  int fd = memfd_create("chorus-inbox", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    snprintf(errmsg, errcap, "memfd_create (the shared-memory inbox): %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  /* The header and the rings' words now; the data on first use (reserve_ring)
   * where the kernel can reserve pages on demand, else all of it now. */
  const size_t meta = data_offset(nlocal);
  int rc = ftruncate(fd, (off_t)bytes) == 0 ? posix_fallocate(fd, 0, (off_t)meta) : errno;
  if (rc == 0) {
    ch->mine = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ch->mine == MAP_FAILED) {
      rc = errno;
      ch->mine = NULL;
    }
  }
  if (rc == 0) {
    ch->lazy = madvise(ch->mine, meta, MADV_POPULATE_WRITE) == 0;
    if (!ch->lazy) rc = posix_fallocate(fd, (off_t)meta, (off_t)(bytes - meta));
  }
  if (rc == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    rc = errno;
  if (rc != 0) {
    close(fd);
    snprintf(errmsg, errcap, "cannot reserve %zu bytes of shared memory for the inbox (%d local "
             "ranks x %zu KiB rings): %s; CHORUS_SHM_P2P_RING sets the ring size",
             bytes, nlocal, ch->ring_bytes >> 10, strerror(rc));
    st = rc == ENOSPC || rc == ENOMEM ? CHORUS_ERR_NO_MEMORY : CHORUS_ERR_SYSTEM;
    goto fail;
  }
  ch->mine_bytes = bytes;
  ch->hdr = ch->mine;
  ch->hdr->version = INBOX_VERSION;
  ch->hdr->nslots = (uint32_t)nlocal;
  ch->hdr->ring_bytes = ch->ring_bytes;
  ch->hdr->bytes = bytes;
  ch->hdr->pid = (int64_t)getpid();
  __atomic_store_n(&ch->hdr->magic, INBOX_MAGIC, __ATOMIC_RELEASE);
  ch->memfd = fd;
  st = claim_peers(ch, cfg);
  if (st == CHORUS_OK && chorus__tp_watch(tp, ch->bell_fd, EPOLLIN, &ch->bell_watch) < 0) {
    snprintf(errmsg, errcap, "cannot watch the shared-memory doorbell: %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
  }
  if (st != CHORUS_OK) goto fail;
  /* With fewer CPUs than local ranks a polling thread may hold the CPU
   * its peer needs to answer: endpoint.c then yields from the start. */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  tp->crowded = ncpu > 0 && ncpu < nlocal;
  *out = &ch->base;
  return CHORUS_OK;
fail:
  CHORUS__FOR_PEERS(tp, p) {
    if (p->chan != &ch->base) continue;
    p->chan = NULL;
    p->link = NULL;
    p->rxs = NULL;
  }
  if (ch->bell_fd >= 0) chorus__tp_unwatch(tp, ch->bell_fd);
  shm_destroy(&ch->base);
  return st;
}
