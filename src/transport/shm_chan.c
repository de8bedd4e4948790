/*
 * shm_chan.c - the shared-memory channel (chan.h): every message between two
 * ranks of one host, point-to-point and collective, through a ring in shared
 * memory instead of loopback TCP.
 *
 * Inboxes.  Every rank that has peers on its host creates one inbox, a
 * shared-memory object of its own (O_EXCL, mode 600, memory reserved up
 * front):
 *
 *   header   magic (stored last), geometry, the owner's pid, how many
 *            senders mapped it, and two words senders read before ringing:
 *            `sleeping` (the owner's progress thread is in, or about to enter,
 *            epoll_wait) and `polling` (owner threads spin on their rings)
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
 * The name of an inbox is "/chorus-<job>-<host tag>-<world id>-<nonce>",
 * with the owner's nonce from the rendezvous, so nobody outside the job can
 * know it in advance; a sender checks that the object belongs to this user
 * and nobody else can open it, and checks its geometry before using any
 * offset.  The last of the owner's local peers to map it unlinks the name;
 * the memory goes with the last mapping, also after a crash (chorusrun
 * removes names a crash left behind).
 *
 * Doorbells.  Each rank binds an abstract datagram socket (named after the
 * world id, its rank and its nonce) that the progress thread watches.  A
 * sender that published bytes rings the owner's bell only when the owner
 * sleeps and no owner thread polls; an owner that consumed bytes rings the
 * sender's when the sender waits for space.  Both sides publish, fence, then
 * read the other's word (and the sleeper re-checks after raising its own),
 * so one of the two always sees the other: no wake-up is lost.  A datagram
 * from a stranger only wakes the thread.
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
#include "util/env.h"
#include "util/util.h"

#define HDR_SIZE CHORUS__WIRE_HDR_SIZE
typedef chorus__tx_t txitem_t;

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
  uint32_t mapped; /* atomic: senders that mapped it */
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
  chorus__txq_t txq;
  struct sockaddr_un bell;
  socklen_t bell_len;
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
  int bell_fd;      /* this rank's doorbell (bound) */
  int send_fd;      /* for ringing the others */
  chorus__watch_t bell_watch;
  char name[128]; /* this rank's inbox */
};

static chorus__tp_t *link_tp(const link_t *l) { return l->ch->base.tp; }

static void ring_bell(shm_chan_t *ch, link_t *l) {
  /* EAGAIN: the peer has a datagram waiting already, which wakes it. */
  (void)!sendto(ch->send_fd, "", 1, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&l->bell,
                l->bell_len);
}

static void bell_addr(struct sockaddr_un *a, socklen_t *len, uint64_t world, int rank,
                      uint64_t nonce) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  /* Abstract (leading NUL): no file, gone with the socket. */
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "chorus-bell-%016" PRIx64 "-%d-%016" PRIx64,
                   world, rank, nonce);
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

/* Writes as much of l's queue as its ring takes.  Returns 1 if it wrote
 * anything. */
static int flush_link(link_t *l) {
  if (l->peer->dead || !l->txq.head) return 0;
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
  for (int i = 0; i < ch->nlocal; i++) {
    if (i == ch->me) continue;
    link_t *l = &ch->links[i];
    any |= read_link(l);
    any |= flush_link(l);
  }
  return any;
}

static void on_bell(void *arg, uint32_t events) {
  shm_chan_t *ch = arg;
  (void)events;
  char buf[64];
  while (recv(ch->bell_fd, buf, sizeof buf, MSG_DONTWAIT) >= 0) {
  }
  progress_all(ch);
}

static void on_pid(void *arg, uint32_t events) {
  link_t *l = arg;
  (void)events;
  if (l->peer->dead) return;
  read_link(l); /* its goodbye may be in the ring */
  if (!l->peer->dead)
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

static int shm_idle(chorus__chan_t *ch, int sleeping) {
  shm_chan_t *s = (shm_chan_t *)ch;
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
  /* Normally the last peer to map it removed the name; not if one never
   * did (it failed first). */
  if (ch->mine) {
    shm_unlink(ch->name);
    munmap(ch->mine, ch->mine_bytes);
  }
  if (ch->bell_fd >= 0) close(ch->bell_fd);
  if (ch->send_fd >= 0) close(ch->send_fd);
  free(ch->links);
  free(ch);
}

static const chorus__chan_ops_t shm_ops = {
    .name = "shm",
    .send = shm_send,
    .rx_pause = shm_rx_pause,
    .cancel = shm_cancel,
    .pending = shm_pending,
    .close = shm_close,
    .link_desc = shm_link_desc,
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

/* Maps rank w's inbox (it may not exist yet: the owner creates it after
 * the same rendezvous), checks it, and sets l's outbound side up. */
static chorus_result_t attach_peer(shm_chan_t *ch, link_t *l, const char *name, int64_t deadline,
                                   char *errmsg, size_t cap) {
  int fd = -1;
  struct stat sb;
  void *base = MAP_FAILED;
  for (;;) {
    fd = chorus__shm_open_own(name, &sb, errmsg, cap);
    if (fd >= 0) {
      if ((size_t)sb.st_size >= sizeof(inbox_hdr_t)) {
        base = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base != MAP_FAILED &&
            __atomic_load_n(&((inbox_hdr_t *)base)->magic, __ATOMIC_ACQUIRE) == INBOX_MAGIC)
          break;
        if (base != MAP_FAILED) munmap(base, (size_t)sb.st_size);
        base = MAP_FAILED;
      }
      close(fd);
      fd = -1;
    } else if (errno != ENOENT) {
      return errno == EPERM ? CHORUS_ERR_PROTOCOL : CHORUS_ERR_SYSTEM;
    }
    if (chorus__ms_left(deadline) == 0) {
      snprintf(errmsg, cap, "local rank %d (world rank %d) did not create its shared-memory "
               "inbox %s in time (is /dev/shm shared between the ranks of this host? "
               "CHORUS_TRANSPORT=tcp avoids shared memory)", l->lidx, l->peer->rank, name);
      return CHORUS_ERR_TIMEOUT;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  close(fd);
  inbox_hdr_t *h = base;
  size_t bytes = (size_t)sb.st_size;
  size_t rb = h->ring_bytes;
  if (h->version != INBOX_VERSION || h->nslots != (uint32_t)ch->nlocal || rb != ch->ring_bytes ||
      h->bytes != bytes || inbox_bytes(ch->nlocal, rb) != bytes || h->pid <= 0) {
    snprintf(errmsg, cap, "%s does not hold an inbox for %d local ranks with %zu-byte rings",
             name, ch->nlocal, ch->ring_bytes);
    munmap(base, bytes);
    return CHORUS_ERR_PROTOCOL;
  }
  l->peer_base = base;
  l->peer_bytes = bytes;
  l->peer_hdr = h;
  l->out = (ring_t *)((char *)base + rings_offset()) + ch->me;
  l->out_data = (unsigned char *)base + data_offset(ch->nlocal) + (size_t)ch->me * rb;
  l->pidfd = open_pidfd((pid_t)h->pid);
  if (l->pidfd < 0)
    CHORUS_DEBUG(CHORUS__SUB_TCP, "chorus: no pidfd for local rank %d (pid %" PRId64 "): %s; "
                 "its death is found by silence instead", l->lidx, h->pid, strerror(errno));
  /* The last sender to map it removes the name. */
  if (__atomic_add_fetch(&h->mapped, 1, __ATOMIC_ACQ_REL) == (uint32_t)ch->nlocal - 1)
    shm_unlink(name);
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
  if (nlocal < 2) return CHORUS_OK; /* nobody to share memory with */
  shm_chan_t *ch = calloc(1, sizeof *ch);
  if (!ch) return CHORUS_ERR_NO_MEMORY;
  ch->base.ops = &shm_ops;
  ch->base.tp = tp;
  ch->nlocal = nlocal;
  ch->me = me;
  ch->bell_fd = ch->send_fd = -1;
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
  chorus_result_t st = CHORUS_OK;
  if (!ch->links) {
    st = CHORUS_ERR_NO_MEMORY;
    goto fail;
  }
  /* This rank's doorbell, then its inbox (the bell is bound before anyone
   * can find the inbox and ring). */
  struct sockaddr_un a;
  socklen_t alen;
  bell_addr(&a, &alen, cfg->world_id, cfg->rank, cfg->nonce[cfg->rank]);
  ch->bell_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  ch->send_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (ch->bell_fd < 0 || ch->send_fd < 0 || bind(ch->bell_fd, (struct sockaddr *)&a, alen) < 0 ||
      chorus__tp_watch(tp, ch->bell_fd, EPOLLIN, &ch->bell_watch) < 0) {
    snprintf(errmsg, errcap, "cannot make the shared-memory doorbell: %s", strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  char *name = ch->name;
  chorus__shm_name(name, sizeof ch->name, chorus__env()->JOB_ID, cfg->world_id,
                   cfg->nonce[cfg->rank]);
  size_t bytes = inbox_bytes(nlocal, ch->ring_bytes);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    snprintf(errmsg, errcap, "shm_open(%s): %s", name, strerror(errno));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  int rc = posix_fallocate(fd, 0, (off_t)bytes);
  if (rc == 0) {
    ch->mine = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ch->mine == MAP_FAILED) {
      rc = errno;
      ch->mine = NULL;
    }
  }
  close(fd);
  if (rc != 0) {
    shm_unlink(name);
    snprintf(errmsg, errcap, "cannot reserve %zu bytes in /dev/shm for the shared-memory inbox "
             "(%d local ranks x %zu KiB rings): %s; CHORUS_SHM_P2P_RING sets the ring size",
             bytes, nlocal, ch->ring_bytes >> 10, strerror(rc));
    st = rc == ENOSPC ? CHORUS_ERR_NO_MEMORY : CHORUS_ERR_SYSTEM;
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
  /* The peers: each carried by this channel from now on. */
  int li = 0;
  for (int r = 0; r < cfg->size; r++) {
    if (cfg->host[r] != cfg->host[cfg->rank]) continue;
    link_t *l = &ch->links[li];
    l->ch = ch;
    l->lidx = li;
    l->pidfd = -1;
    li++;
    if (r == cfg->rank) continue;
    l->peer = &tp->peers[r];
    l->in = (ring_t *)((char *)ch->mine + rings_offset()) + l->lidx;
    l->in_data = (unsigned char *)ch->mine + data_offset(nlocal) + (size_t)l->lidx * ch->ring_bytes;
    l->pid_watch = (chorus__watch_t){on_pid, l};
    bell_addr(&l->bell, &l->bell_len, cfg->world_id, r, cfg->nonce[r]);
    chorus__tp_rx_attach(tp, l->peer, &l->rx, &ch->base, l);
    l->peer->chan = &ch->base;
    l->peer->link = l;
  }
  /* Map every local peer's inbox. */
  for (int i = 0; i < nlocal && st == CHORUS_OK; i++) {
    link_t *l = &ch->links[i];
    if (i == me) continue;
    char pname[128];
    chorus__shm_name(pname, sizeof pname, chorus__env()->JOB_ID, cfg->world_id,
                     cfg->nonce[l->peer->rank]);
    st = attach_peer(ch, l, pname, cfg->deadline, errmsg, errcap);
    if (st == CHORUS_OK && l->pidfd >= 0 && chorus__tp_watch(tp, l->pidfd, EPOLLIN, &l->pid_watch) < 0) {
      close(l->pidfd);
      l->pidfd = -1;
    }
  }
  if (st != CHORUS_OK) goto fail;
  /* With fewer CPUs than local ranks a polling thread may hold the CPU
   * its peer needs to answer: endpoint.c then yields from the start. */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  tp->crowded = ncpu > 0 && ncpu < nlocal;
  *out = &ch->base;
  return CHORUS_OK;
fail:
  for (int r = 0; r < tp->size; r++) {
    if (tp->peers[r].chan != &ch->base) continue;
    tp->peers[r].chan = NULL;
    tp->peers[r].link = NULL;
    tp->peers[r].rxs = NULL;
  }
  if (ch->bell_fd >= 0) chorus__tp_unwatch(tp, ch->bell_fd);
  shm_destroy(&ch->base);
  return st;
}
