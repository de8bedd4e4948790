/*
 * shm.h - one shared-memory segment per communicator whose ranks all live
 * on one host, and the flag protocol the "direct" algorithms run on.
 *
 * Layout (every rank maps the whole segment):
 *
 *   header page   magic, geometry, the bell (futex word) and sleeper count
 *   rank areas    per rank: CHORUS__SHM_SLOTS control lines and a done line,
 *                 each on its own 128-byte block (no false sharing, also with
 *                 the adjacent-line prefetcher)
 *   data          per rank: CHORUS__SHM_SLOTS buffers of `chunk` bytes
 *
 * Tickets.  Every step of a direct collective that publishes data takes the
 * communicator's next ticket t (1, 2, ...); all ranks take the same tickets
 * in the same order because they run the same collectives in the same order.
 * Ticket t uses control line and data buffer t % 3 (its slot) of each rank:
 *
 *   line.seq = t   "my data for ticket t is in place" (release store, after
 *                  the payload and the call's fingerprint)
 *   line.red = t   "my reduced slice for ticket t is in place" (all_reduce)
 *   done     = t   "I finished reading everything of ticket t"
 *
 * Before a rank writes ticket t into slot t % 3 it must know that every
 * peer finished reading ticket t - 3 (chorus__shm_claim).  A rank publishes
 * done(t) before anything of ticket t + 2, so seeing every peer's seq at
 * t - 1 already proves it; the claim reads the done lines only when that
 * has not been seen.  Most steps publish done(t) even before ticket t + 1;
 * the third slot is for those that do not: all_reduce reads its peers'
 * reduced slices of chunk k after it published chunk k + 1, so every rank
 * waits once per chunk instead of twice.
 *
 * Waiting: spin on the word (pause), then sched_yield, then sleep on the
 * segment's bell with FUTEX_WAIT.  A publisher rings the bell only when the
 * sleeper count is non-zero, so the fast path is one store and one load.
 * Every wait has a deadline (the communicator's timeout) and returns at once
 * when the endpoint fails (the transport rings the bell through a hook).
 *
 * Lifetime: the group's rank 0 creates the segment (O_EXCL, memory reserved
 * with posix_fallocate so a full /dev/shm is an error, never a SIGBUS), the
 * others map it, and rank 0 unlinks the name as soon as everyone mapped it;
 * the memory goes away with the last mapping, also after a crash.  chorusrun
 * removes names of its job left behind by a crash during that window.
 */
#ifndef CHORUS_TRANSPORT_SHM_H
#define CHORUS_TRANSPORT_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#include "chorus.h"
#include "transport/transport.h"

#define CHORUS__SHM_INLINE 32 /* payload bytes carried inside a control line */
#define CHORUS__SHM_MAX_RANKS 256 /* larger groups use the network transport */
#define CHORUS__SHM_SLOTS 3         /* buffers (and control lines) per rank */

typedef struct chorus__shm_line {
  uint64_t seq; /* atomic */
  uint64_t red; /* atomic */
  chorus__fp_t fp;
  unsigned char data[CHORUS__SHM_INLINE];
  unsigned char pad[64];
} chorus__shm_line_t;

typedef struct chorus__shm_area {
  chorus__shm_line_t line[CHORUS__SHM_SLOTS];
  uint64_t done;   /* atomic */
  int64_t pid;     /* the rank's process id (for process_vm_readv) */
  uint64_t probe;  /* an address in that process holding SHM magic */
  uint64_t cpus[4]; /* the CPUs (0..255) the rank may run on; all ones: unknown */
  unsigned char pad[72];
} chorus__shm_area_t;
_Static_assert(sizeof(chorus__shm_line_t) == 128 && sizeof(chorus__shm_area_t) % 128 == 0,
               "every line and area of the segment fills whole 128-byte blocks");

/* Memory handed to the user by chorus_mem_alloc (one shm object each), and
 * the views of other ranks' allocations this process mapped; one per world,
 * shared by its groups (thread-safe). */
typedef struct chorus__memreg chorus__memreg_t;

chorus__memreg_t *chorus__memreg_new(const char *job, uint64_t world_id, int world_rank);
void chorus__memreg_free(chorus__memreg_t *reg); /* unmaps everything */
chorus_result_t chorus__memreg_alloc(chorus__memreg_t *reg, size_t size, void **ptr, char *err,
                                     size_t cap);
chorus_result_t chorus__memreg_release(chorus__memreg_t *reg, void *ptr);
/* If [ptr, ptr+len) lies in one of this process's allocations: 1, with its
 * id and the offset of ptr; else 0. */
int chorus__memreg_find(chorus__memreg_t *reg, const void *ptr, size_t len, uint64_t *id,
                        uint64_t *off);
/* Base and size of world rank w's allocation id in this process (mapped on
 * first use); NULL if it cannot be opened. */
unsigned char *chorus__memreg_peer(chorus__memreg_t *reg, int w, uint64_t id, size_t *size);

typedef struct chorus__shm_hdr {
  uint64_t magic;
  uint32_t version, n;
  uint64_t chunk, bytes;
  unsigned char pad0[96];
  uint32_t bell;     /* futex word, bumped by every wake-up */
  uint32_t sleepers; /* ranks in (or about to enter) FUTEX_WAIT */
  unsigned char pad1[120];
} chorus__shm_hdr_t;

typedef struct chorus__shm {
  void *base;
  size_t bytes;
  int n, me;
  size_t chunk; /* bytes per data buffer */
  chorus__shm_hdr_t *hdr;
  chorus__shm_area_t *area; /* n areas */
  unsigned char *data;      /* n * CHORUS__SHM_SLOTS * chunk bytes */
  uint64_t ticket;          /* last ticket taken */
  uint64_t all_done;        /* every peer finished reading tickets <= this */
  int spin, yields;         /* wait policy */
  int unrung;               /* posted a flag without checking for sleepers */
  int cma;                  /* every rank can process_vm_readv every other */
  size_t cma_min;           /* bytes per rank from which collectives use it */
  chorus__ep_t *ep;
  int timeout_ms;
  chorus__memreg_t *reg; /* the world's chorus_mem_alloc registry */
  const int *world;      /* group rank -> world rank */
} chorus__shm_t;

/* "/chorus-<job>-<group id>-<nonce>" into buf.  The nonce is random (the
 * creator picks it and tells the others over authenticated connections),
 * so no other user can create the name first. */
void chorus__shm_name(char *buf, size_t cap, const char *job, uint64_t group_id, uint64_t nonce);

/* Bytes a segment for n ranks with the given chunk needs. */
size_t chorus__shm_bytes(int n, size_t chunk);

/* Rank 0: creates (O_EXCL, mode 600), sizes and initialises the segment;
 * *exists tells that the name was taken.  Others: map it, after checking
 * that it belongs to this user and nobody else can open it.  On failure
 * errmsg says why (ENOSPC, permissions, a stranger's file, ...). */
chorus_result_t chorus__shm_create(const char *name, int n, size_t chunk, chorus__shm_t **out,
                                   char *errmsg, size_t cap, int *exists);
chorus_result_t chorus__shm_attach(const char *name, int n, int me, chorus__shm_t **out,
                                   char *errmsg, size_t cap);
void chorus__shm_unlink(const char *name);

/* Opens an existing shared-memory object for mapping; it must be a file of
 * this user that nobody else may open (what this user's chorus processes
 * make), or someone else put it there.  Returns the fd (*sb filled), or -1
 * with errmsg filled and errno ENOENT (no such name), EPERM (not this job's
 * file) or shm_open's. */
int chorus__shm_open_own(const char *name, struct stat *sb, char *errmsg, size_t cap);

/* Binds the segment to the endpoint whose failures end its waits, and the
 * wait policy: spin iterations, then sched_yield calls, then sleep. */
void chorus__shm_bind(chorus__shm_t *s, chorus__ep_t *ep, int timeout_ms, int spin, int yields);
void chorus__shm_detach(chorus__shm_t *s);

/* Single copy between processes (cross-memory attach).  publish_self
 * writes this rank's pid and probe address; probe tries to read rank
 * peer's magic with process_vm_readv (0 on success, else -errno). */
void chorus__shm_publish_self(chorus__shm_t *s);
int chorus__shm_probe(chorus__shm_t *s, int peer);

/* Reads len bytes at addr in rank peer's process into dst; on failure
 * fails the endpoint with a message naming the peer and returns the code. */
chorus_result_t chorus__shm_read_peer(chorus__shm_t *s, int peer, void *dst, uint64_t addr,
                                      size_t len);

/* Rings the bell: wakes every sleeper of the segment (they re-check). */
void chorus__shm_ring(chorus__shm_t *s);

static inline chorus__shm_area_t *chorus__shm_peer(chorus__shm_t *s, int r) { return &s->area[r]; }
static inline unsigned char *chorus__shm_buf(chorus__shm_t *s, int r, uint64_t t) {
  return s->data + ((size_t)r * CHORUS__SHM_SLOTS + (size_t)(t % CHORUS__SHM_SLOTS)) * s->chunk;
}
static inline chorus__shm_line_t *chorus__shm_line(chorus__shm_t *s, int r, uint64_t t) {
  return &s->area[r].line[t % CHORUS__SHM_SLOTS];
}

/* Rings the bell if anyone sleeps and this rank published something since
 * it last looked.  The fence pairs with the sleeper count a waiter raises
 * before its last look at the flag (shm.c): either the waiter sees the
 * flag or this sees the sleeper. */
static inline void chorus__shm_flush(chorus__shm_t *s) {
  if (!s->unrung) return;
  s->unrung = 0;
#if defined(__SANITIZE_THREAD__)
  /* ThreadSanitizer does not model fences: an RMW of the sleeper count
   * itself orders the same way (both sides then RMW one word), at the
   * price of a shared cache line per step. */
  if (__atomic_fetch_add(&s->hdr->sleepers, 0, __ATOMIC_SEQ_CST)) chorus__shm_ring(s);
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (__atomic_load_n(&s->hdr->sleepers, __ATOMIC_SEQ_CST)) chorus__shm_ring(s);
#endif
}

/* Stores v into a flag word of this rank's area, without the fence: the
 * store drains from the store buffer while this rank goes on (to read its
 * peers' lines), instead of stalling it for a full cache-line round trip.
 * Sleepers are woken by the next chorus__shm_flush: chorus__shm_set, or
 * any wait of this rank that does not succeed at once (a rank never blocks
 * with a publication it has not rung for). */
static inline void chorus__shm_post(chorus__shm_t *s, uint64_t *word, uint64_t v) {
  __atomic_store_n(word, v, __ATOMIC_RELEASE);
  s->unrung = 1;
}

/* chorus__shm_post, then chorus__shm_flush: what ends every step a peer
 * may be asleep for. */
static inline void chorus__shm_set(chorus__shm_t *s, uint64_t *word, uint64_t v) {
  chorus__shm_post(s, word, v);
  chorus__shm_flush(s);
}

/* Waits until *word >= target (word belongs to rank peer; what names the
 * flag for error messages).  Fails the endpoint on timeout. */
chorus_result_t chorus__shm_wait_slow(chorus__shm_t *s, const uint64_t *word, uint64_t target,
                                      int peer, const char *what);
static inline chorus_result_t chorus__shm_wait(chorus__shm_t *s, const uint64_t *word,
                                               uint64_t target, int peer, const char *what) {
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= target) return CHORUS_OK;
  return chorus__shm_wait_slow(s, word, target, peer, what);
}

/* Takes the next ticket and makes sure every peer finished reading the
 * ticket three before it (whose buffers it reuses). */
chorus_result_t chorus__shm_claim(chorus__shm_t *s, uint64_t *ticket);

#endif
