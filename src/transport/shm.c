/*
 * shm.c - the shared-memory segment of a single-host communicator: creation,
 * mapping, the bell, and bounded waits on flags (see shm.h for the
 * protocol).
 */
#include "transport/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <pthread.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/host.h"
#include "util/log.h"
#include "util/util.h"

#define SHM_MAGIC 0x63686f7275736d31ull /* "chorusm1" */
#define SHM_VERSION 2u
#define SHM_PAGE 4096u

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static size_t areas_offset(void) { return SHM_PAGE; }
static size_t data_offset(int n) {
  return round_up(areas_offset() + sizeof(chorus__shm_area_t) * (size_t)n, SHM_PAGE);
}

size_t chorus__shm_bytes(int n, size_t chunk) {
  return data_offset(n) + (size_t)n * CHORUS__SHM_SLOTS * chunk;
}

void chorus__shm_name(char *buf, size_t cap, const char *job, uint64_t group_id,
                      uint64_t nonce) {
  char clean[24];
  size_t k = 0;
  for (const char *p = job ? job : ""; *p && k + 1 < sizeof clean; p++)
    if ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z'))
      clean[k++] = *p;
  clean[k] = '\0';
  char tag[9];
  chorus__host_tag(tag);
  snprintf(buf, cap, "/chorus-%s-%s-%016" PRIx64 "-%016" PRIx64, k ? clean : "nojob", tag,
           group_id, nonce);
}

static chorus__shm_t *wrap(void *base, size_t bytes, int n, int me, size_t chunk) {
  chorus__shm_t *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->base = base;
  s->bytes = bytes;
  s->n = n;
  s->me = me;
  s->chunk = chunk;
  s->hdr = base;
  s->area = (chorus__shm_area_t *)((char *)base + areas_offset());
  s->data = (unsigned char *)base + data_offset(n);
  s->timeout_ms = 300000;
  return s;
}

int chorus__shm_open_own(const char *name, struct stat *sb, char *errmsg, size_t cap) {
  int fd = shm_open(name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) {
    int e = errno;
    snprintf(errmsg, cap, "shm_open(%s) failed: %s (is /dev/shm shared between the ranks?)", name,
             strerror(e));
    errno = e;
    return -1;
  }
  if (fstat(fd, sb) < 0 || !S_ISREG(sb->st_mode) || sb->st_uid != geteuid() ||
      (sb->st_mode & 077)) {
    snprintf(errmsg, cap, "%s is not a segment of this job (owner uid %u, mode %03o; expected "
             "uid %u, mode 600): refusing it", name, (unsigned)sb->st_uid,
             (unsigned)(sb->st_mode & 0777), (unsigned)geteuid());
    close(fd);
    errno = EPERM;
    return -1;
  }
  return fd;
}

/* Creates shm object name (O_EXCL, 0600) of bytes bytes, reserves its memory
 * (a tmpfs that runs out later would SIGBUS us) and maps it; on failure
 * removes the name, says why in errmsg and returns NULL with *st set. */
static void *create_mapped(const char *name, size_t bytes, char *errmsg, size_t cap,
                           chorus_result_t *st, int *exists) {
  *exists = 0;
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    snprintf(errmsg, cap, "shm_open(%s) failed: %s", name, strerror(errno));
    *exists = errno == EEXIST;
    *st = CHORUS_ERR_SYSTEM;
    return NULL;
  }
  int rc = posix_fallocate(fd, 0, (off_t)bytes);
  if (rc != 0) {
    snprintf(errmsg, cap, "cannot reserve %zu bytes in /dev/shm for %s: %s", bytes, name,
             strerror(rc));
    close(fd);
    shm_unlink(name);
    *st = CHORUS_ERR_NO_MEMORY;
    return NULL;
  }
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    snprintf(errmsg, cap, "mmap of %zu bytes (%s) failed: %s", bytes, name, strerror(errno));
    shm_unlink(name);
    *st = CHORUS_ERR_SYSTEM;
    return NULL;
  }
  *st = CHORUS_OK;
  return base;
}

chorus_result_t chorus__shm_create(const char *name, int n, size_t chunk, chorus__shm_t **out,
                                   char *errmsg, size_t cap, int *exists) {
  *out = NULL;
  size_t bytes = chorus__shm_bytes(n, chunk);
  chorus_result_t st;
  void *base = create_mapped(name, bytes, errmsg, cap, &st, exists);
  if (!base) return st;
  /* fallocate zero-filled everything: every flag starts at ticket 0. */
  chorus__shm_hdr_t *h = base;
  h->version = SHM_VERSION;
  h->n = (uint32_t)n;
  h->chunk = chunk;
  h->bytes = bytes;
  __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
  *out = wrap(base, bytes, n, 0, chunk);
  if (!*out) {
    munmap(base, bytes);
    shm_unlink(name);
    snprintf(errmsg, cap, "out of memory");
    return CHORUS_ERR_NO_MEMORY;
  }
  return CHORUS_OK;
}

chorus_result_t chorus__shm_attach(const char *name, int n, int me, chorus__shm_t **out,
                                   char *errmsg, size_t cap) {
  *out = NULL;
  struct stat sb;
  int fd = chorus__shm_open_own(name, &sb, errmsg, cap);
  if (fd < 0) return CHORUS_ERR_SYSTEM;
  if (sb.st_size < (off_t)sizeof(chorus__shm_hdr_t)) {
    snprintf(errmsg, cap, "%s is too small to be a chorus segment", name);
    close(fd);
    return CHORUS_ERR_SYSTEM;
  }
  size_t bytes = (size_t)sb.st_size;
  void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    snprintf(errmsg, cap, "mmap of %s failed: %s", name, strerror(errno));
    return CHORUS_ERR_SYSTEM;
  }
  chorus__shm_hdr_t *h = base;
  /* The segment is written only by ranks of this job (0600, same user), but
   * check its geometry before trusting any offset derived from it. */
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC || h->version != SHM_VERSION ||
      h->n != (uint32_t)n || h->bytes != bytes || h->chunk == 0 || h->chunk % 64 ||
      chorus__shm_bytes(n, h->chunk) != bytes) {
    snprintf(errmsg, cap, "%s does not hold a chorus segment for %d ranks", name, n);
    munmap(base, bytes);
    return CHORUS_ERR_PROTOCOL;
  }
  *out = wrap(base, bytes, n, me, h->chunk);
  if (!*out) {
    munmap(base, bytes);
    snprintf(errmsg, cap, "out of memory");
    return CHORUS_ERR_NO_MEMORY;
  }
  return CHORUS_OK;
}

void chorus__shm_unlink(const char *name) { shm_unlink(name); }

static void fail_hook(void *arg) { chorus__shm_ring(arg); }

void chorus__shm_bind(chorus__shm_t *s, chorus__ep_t *ep, int timeout_ms, int spin, int yields) {
  s->ep = ep;
  s->timeout_ms = timeout_ms;
  s->spin = spin < 0 ? 0 : spin;
  s->yields = yields < 0 ? 0 : yields;
  chorus__ep_set_fail_hook(ep, fail_hook, s);
}

void chorus__shm_detach(chorus__shm_t *s) {
  if (!s) return;
  if (s->ep) chorus__ep_set_fail_hook(s->ep, NULL, NULL);
  munmap(s->base, s->bytes);
  free(s);
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

void chorus__shm_ring(chorus__shm_t *s) {
  __atomic_fetch_add(&s->hdr->bell, 1, __ATOMIC_SEQ_CST);
  futex(&s->hdr->bell, FUTEX_WAKE, INT_MAX, NULL);
}

/* Fails the endpoint with a timeout naming the peer and where it is. */
static chorus_result_t wait_timeout(chorus__shm_t *s, const uint64_t *word, uint64_t target,
                                    int peer, const char *what) {
  char who[256], rd[64];
  uint64_t at = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  chorus__ep_rank_desc(s->ep, peer, rd, sizeof rd);
  snprintf(who, sizeof who, "waiting for %s in shared memory (%s: step %" PRIu64
           " needed, it is at step %" PRIu64 ")", rd, what, target, at);
  chorus__ep_fail_timeout(s->ep, s->timeout_ms, who);
  return CHORUS_ERR_TIMEOUT;
}

/* The longest a wait yields before it sleeps on the bell. */
#define YIELD_MAX_NS (20 * 1000000LL)

chorus_result_t chorus__shm_wait_slow(chorus__shm_t *s, const uint64_t *word, uint64_t target,
                                      int peer, const char *what) {
#define REACHED() (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target)
  /* The peer may be asleep waiting for what this rank posted last. */
  chorus__shm_flush(s);
  for (int i = 0; i < s->spin; i++) {
    chorus__cpu_relax();
    if (REACHED()) return CHORUS_OK;
  }
  /* Yielding, keep noticing failures: on a busy host one sched_yield can
   * cost a whole time slice, and 1000 of them seconds (issue 42: a dead
   * peer noticed 1.8-10.7 s late with 6 busy loops on 2 cores).  The
   * endpoint's flag is one load; whether the awaited peer left, and the
   * clock, are looked at every 16 yields, and YIELD_MAX_NS of yielding
   * ends the phase: the futex sleep below costs nothing then. */
  int64_t yield_end = 0;
  for (int i = 0; i < s->yields; i++) {
    sched_yield();
    if (REACHED()) return CHORUS_OK;
    if (chorus__ep_failed(s->ep)) break;
    if ((i & 15) == 15) {
      if (chorus__ep_peer_gone(s->ep, peer)) break;
      int64_t now = chorus__now_ns();
      if (!yield_end) yield_end = now + YIELD_MAX_NS;
      else if (now >= yield_end) break;
    }
  }
  int64_t deadline = chorus__deadline_ms(s->timeout_ms);
  for (;;) {
    if (REACHED()) return CHORUS_OK;
    if (chorus__ep_failed(s->ep)) return chorus__ep_status(s->ep, NULL, 0);
    /* A peer that left will not write again (what it wrote before stays). */
    if (chorus__ep_peer_gone(s->ep, peer)) {
      if (REACHED()) return CHORUS_OK; /* its last write came before its goodbye */
      return chorus__ep_check_peer(s->ep, peer, "waits for its data in shared memory");
    }
    int64_t left = chorus__ms_left(deadline);
    if (left <= 0) return wait_timeout(s, word, target, peer, what);
    uint32_t bell = __atomic_load_n(&s->hdr->bell, __ATOMIC_SEQ_CST);
    /* An RMW: it orders against chorus__shm_flush's fence (or its RMW of
     * the same word under ThreadSanitizer). */
    __atomic_fetch_add(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
    if (!REACHED() && !chorus__ep_failed(s->ep)) {
      int64_t ms = left < 1000 ? left : 1000;
      struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
      futex(&s->hdr->bell, FUTEX_WAIT, bell, &ts);
    }
    __atomic_fetch_sub(&s->hdr->sleepers, 1, __ATOMIC_SEQ_CST);
  }
#undef REACHED
}

chorus_result_t chorus__shm_claim(chorus__shm_t *s, uint64_t *ticket) {
  uint64_t t = ++s->ticket;
  *ticket = t;
  if (t <= CHORUS__SHM_SLOTS) return CHORUS_OK; /* a slot not used before */
  const uint64_t need = t - CHORUS__SHM_SLOTS;  /* the ticket whose slot t reuses */
  if (s->all_done >= need) return CHORUS_OK;
  for (int r = 0; r < s->n; r++) {
    if (r == s->me) continue;
    chorus_result_t st = chorus__shm_wait(s, &s->area[r].done, need, r, "finished reading");
    if (st != CHORUS_OK) return st;
  }
  s->all_done = need;
  return CHORUS_OK;
}

void chorus__shm_publish_self(chorus__shm_t *s) {
  s->area[s->me].pid = (int64_t)getpid();
  s->area[s->me].probe = (uint64_t)(uintptr_t)&s->hdr->magic;
}

int chorus__shm_probe(chorus__shm_t *s, int peer) {
  uint64_t v = 0;
  struct iovec local = {&v, sizeof v};
  struct iovec remote = {(void *)(uintptr_t)s->area[peer].probe, sizeof v};
  ssize_t got = process_vm_readv((pid_t)s->area[peer].pid, &local, 1, &remote, 1, 0);
  if (got < 0) return -errno;
  return got == (ssize_t)sizeof v && v == SHM_MAGIC ? 0 : -EIO;
}

chorus_result_t chorus__shm_read_peer(chorus__shm_t *s, int peer, void *dst, uint64_t addr,
                                      size_t len) {
  unsigned char *d = dst;
  while (len) {
    /* The kernel copies at most MAX_RW_COUNT (~2 GiB) per call and may stop
     * early; continue where it stopped. */
    size_t want = len < ((size_t)1 << 30) ? len : (size_t)1 << 30;
    struct iovec local = {d, want};
    struct iovec remote = {(void *)(uintptr_t)addr, want};
    ssize_t got = process_vm_readv((pid_t)s->area[peer].pid, &local, 1, &remote, 1, 0);
    if (got <= 0) {
      int e = got < 0 ? errno : EIO;
      if (e == EINTR) continue;
      char doing[300];
      chorus__ep_doing(s->ep, doing, sizeof doing);
      chorus__ep_fail(s->ep, e == ESRCH ? CHORUS_ERR_REMOTE : CHORUS_ERR_SYSTEM, 1,
                      "chorus rank %d/%d: %s: reading %zu bytes from rank %d (pid %lld) with "
                      "process_vm_readv failed: %s%s",
                      s->me, s->n, doing, len, peer, (long long)s->area[peer].pid, strerror(e),
                      e == EFAULT ? " (its buffer is smaller than the call says: check the count "
                                    "it passed)"
                                  : e == ESRCH ? " (the process is gone)" : "");
      return e == ESRCH ? CHORUS_ERR_REMOTE : CHORUS_ERR_SYSTEM;
    }
    d += got;
    addr += (uint64_t)got;
    len -= (size_t)got;
  }
  return CHORUS_OK;
}

/* ------------------------------------------------ chorus_mem_alloc memory */

typedef struct region {
  struct region *next;
  int owner;        /* world rank */
  uint64_t id;      /* per owner, never reused */
  unsigned char *base;
  size_t size, mapped;
} region_t;

struct chorus__memreg {
  pthread_mutex_t lock;
  char job[24];
  uint64_t world_id;
  int me;
  region_t *mine, *peers;
};

static void region_name(const chorus__memreg_t *reg, int owner, uint64_t id, char *buf,
                        size_t cap) {
  char tag[9];
  chorus__host_tag(tag);
  snprintf(buf, cap, "/chorus-%s-%s-%016" PRIx64 "-m%d-%016" PRIx64, reg->job, tag,
           reg->world_id, owner, id);
}

chorus__memreg_t *chorus__memreg_new(const char *job, uint64_t world_id, int world_rank) {
  chorus__memreg_t *reg = calloc(1, sizeof *reg);
  if (!reg) return NULL;
  pthread_mutex_init(&reg->lock, NULL);
  size_t k = 0;
  for (const char *p = job ? job : ""; *p && k + 1 < sizeof reg->job; p++)
    if ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z'))
      reg->job[k++] = *p;
  if (!k) snprintf(reg->job, sizeof reg->job, "nojob");
  reg->world_id = world_id;
  reg->me = world_rank;
  return reg;
}

static void drop_list(chorus__memreg_t *reg, region_t *r, int unlink_names) {
  while (r) {
    region_t *next = r->next;
    if (unlink_names) {
      char name[128];
      region_name(reg, r->owner, r->id, name, sizeof name);
      shm_unlink(name);
    }
    munmap(r->base, r->mapped);
    free(r);
    r = next;
  }
}

void chorus__memreg_free(chorus__memreg_t *reg) {
  if (!reg) return;
  drop_list(reg, reg->mine, 1);
  drop_list(reg, reg->peers, 0);
  pthread_mutex_destroy(&reg->lock);
  free(reg);
}

chorus_result_t chorus__memreg_alloc(chorus__memreg_t *reg, size_t size, void **ptr, char *err,
                                     size_t cap) {
  *ptr = NULL;
  if (size == 0) return CHORUS_OK;
  size_t mapped = (size + SHM_PAGE - 1) / SHM_PAGE * SHM_PAGE;
  region_t *r = calloc(1, sizeof *r);
  if (!r) return CHORUS_ERR_NO_MEMORY;
  r->owner = reg->me;
  /* Ids are random (peers learn them from the collective that uses the
   * memory), so nobody can create the next name first; a name that exists
   * anyway is skipped. */
  char name[128];
  chorus_result_t st = CHORUS_ERR_SYSTEM;
  void *base = NULL;
  for (int attempt = 0; attempt < 8 && !base; attempt++) {
    if (chorus__random_bytes(&r->id, sizeof r->id) < 0) break;
    region_name(reg, r->owner, r->id, name, sizeof name);
    int exists;
    base = create_mapped(name, mapped, err, cap, &st, &exists);
    if (!base && !exists) break;
    if (!base)
      CHORUS_WARN(CHORUS__SUB_INIT, "/dev/shm%s exists already (made by someone else); trying "
                  "another name", name);
  }
  if (!base) {
    free(r);
    return st;
  }
  r->base = base;
  r->size = size;
  r->mapped = mapped;
  pthread_mutex_lock(&reg->lock);
  r->next = reg->mine;
  reg->mine = r;
  pthread_mutex_unlock(&reg->lock);
  *ptr = base;
  return CHORUS_OK;
}

chorus_result_t chorus__memreg_release(chorus__memreg_t *reg, void *ptr) {
  if (!ptr) return CHORUS_OK;
  pthread_mutex_lock(&reg->lock);
  region_t **pp = &reg->mine;
  while (*pp && (*pp)->base != ptr) pp = &(*pp)->next;
  region_t *r = *pp;
  if (r) *pp = r->next;
  pthread_mutex_unlock(&reg->lock);
  if (!r) return CHORUS_ERR_INVALID_ARG;
  r->next = NULL;
  drop_list(reg, r, 1);
  return CHORUS_OK;
}

int chorus__memreg_find(chorus__memreg_t *reg, const void *ptr, size_t len, uint64_t *id,
                        uint64_t *off) {
  if (!reg || !ptr) return 0;
  const unsigned char *p = ptr;
  int found = 0;
  pthread_mutex_lock(&reg->lock);
  for (region_t *r = reg->mine; r; r = r->next) {
    if (p >= r->base && p < r->base + r->size && len <= r->size - (size_t)(p - r->base)) {
      *id = r->id;
      *off = (uint64_t)(p - r->base);
      found = 1;
      break;
    }
  }
  pthread_mutex_unlock(&reg->lock);
  return found;
}

unsigned char *chorus__memreg_peer(chorus__memreg_t *reg, int w, uint64_t id, size_t *size) {
  pthread_mutex_lock(&reg->lock);
  for (region_t *r = reg->peers; r; r = r->next) {
    if (r->owner == w && r->id == id) {
      *size = r->size;
      pthread_mutex_unlock(&reg->lock);
      return r->base;
    }
  }
  pthread_mutex_unlock(&reg->lock);
  char name[128], why[256];
  region_name(reg, w, id, name, sizeof name);
  struct stat sb;
  int fd = chorus__shm_open_own(name, &sb, why, sizeof why);
  if (fd < 0) {
    CHORUS_WARN(CHORUS__SUB_INIT, "chorus_mem_alloc memory of world rank %d: %s", w, why);
    return NULL;
  }
  if (sb.st_size <= 0) {
    close(fd);
    return NULL;
  }
  void *base = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return NULL;
  region_t *r = calloc(1, sizeof *r);
  if (!r) {
    munmap(base, (size_t)sb.st_size);
    return NULL;
  }
  r->owner = w;
  r->id = id;
  r->base = base;
  r->size = r->mapped = (size_t)sb.st_size;
  pthread_mutex_lock(&reg->lock);
  r->next = reg->peers;
  reg->peers = r;
  pthread_mutex_unlock(&reg->lock);
  *size = r->size;
  return r->base;
}
