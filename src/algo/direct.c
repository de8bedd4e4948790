/*
 * direct.c - collectives over the communicator's shared-memory segment
 * (transport/shm.h): every rank copies its input into its own buffer of the
 * segment once and reads the others' buffers directly, so a collective is a
 * few flag waits instead of a chain of messages.
 *
 * Large collectives are cut into chunks that fit the segment's buffers
 * (three per rank, used in turn, so a rank copies chunk k+1 in while
 * slower peers still read chunk k); a chunk stays in the caches between the
 * copy in and the reads, so memory traffic is close to reading each input
 * and writing each output once.  Payloads of up to CHORUS__SHM_INLINE bytes
 * travel inside the control line itself: one cache line per rank per call.
 *
 * all_reduce: each rank reduces its 1/n slice of the chunk from all n
 * buffers (in rank order, so every element is combined in the same order on
 * every rank), publishes it, and copies the others' slices out after the
 * next chunk is in (one wait per chunk, not two).  Small ones
 * (<= SMALL_BYTES) skip the slicing: every rank combines everything.
 *
 * Mismatch detection: every published line carries the call's fingerprint
 * and every reader compares it.  Each algorithm makes every rank read a
 * line of some rank that reads everyone (the root, or all ranks), so two
 * ranks that disagree always meet; the core therefore skips its neighbour
 * exchange for these algorithms.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "algo/algo.h"
#include "reduce/reduce.h"
#include "transport/shm.h"
#include "util/util.h"

/* all_reduce / reduce up to this many bytes: no slicing, one flag wait. */
#define SMALL_BYTES 4096

/* Bytes combined from every source before moving on (fits L1 twice). */
#define COMBINE_BLOCK 8192

/* Outputs of at least this many bytes per rank are written with streaming
 * (non-temporal) stores: they would not stay in the caches anyway, and
 * streaming skips reading every destination line before overwriting it. */
#define STREAM_MIN_BYTES ((size_t)4 << 20)

/* memcpy, with streaming stores when stream is set (x86-64; SSE2 is part
 * of the base ISA).  Callers fence (stream_fence) before publishing. */
static void copy_out(void *dst, const void *src, size_t n, int stream) {
#if defined(__x86_64__)
  if (stream && n >= 256) {
    unsigned char *d = dst;
    const unsigned char *sp = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, sp, head);
    d += head, sp += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, sp += 64) {
      __m128i a = _mm_loadu_si128((const __m128i *)sp);
      __m128i b = _mm_loadu_si128((const __m128i *)(sp + 16));
      __m128i e = _mm_loadu_si128((const __m128i *)(sp + 32));
      __m128i f = _mm_loadu_si128((const __m128i *)(sp + 48));
      _mm_stream_si128((__m128i *)d, a);
      _mm_stream_si128((__m128i *)(d + 16), b);
      _mm_stream_si128((__m128i *)(d + 32), e);
      _mm_stream_si128((__m128i *)(d + 48), f);
    }
    memcpy(d, sp, n);
    return;
  }
#endif
  (void)stream;
  memcpy(dst, src, n);
}

static void stream_fence(int stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence();
#endif
  (void)stream;
}

/* Whether a call writes its out_bytes of output with streaming stores:
 * large, and not over its own input (in place, the output lines were just
 * read and sit in the cache: plain stores are cheaper there). */
static int stream_out(const chorus__coll_t *c, size_t out_bytes, size_t in_bytes) {
  uintptr_t o = (uintptr_t)c->recvbuf, i = (uintptr_t)c->sendbuf;
  return out_bytes >= STREAM_MIN_BYTES && (o + out_bytes <= i || i + in_bytes <= o);
}

static chorus_result_t mismatch(chorus__coll_t *c, int r, const chorus__fp_t *theirs) {
  char mine[200], other[200], doing[300], rd[64];
  chorus__fp_format(&c->fp, mine, sizeof mine);
  chorus__fp_format(theirs, other, sizeof other);
  chorus__ep_doing(c->ep, doing, sizeof doing);
  chorus__ep_rank_desc(c->ep, r, rd, sizeof rd);
  chorus__ep_fail(c->ep, CHORUS_ERR_MISMATCH, 1,
                  "chorus rank %d/%d: collective mismatch in %s: this rank called %s, %s "
                  "called %s (every rank must call the same collectives in the same order with "
                  "the same counts, dtype, op and root)",
                  c->rank, c->size, doing, mine, rd, other);
  snprintf(c->err, sizeof c->err, "collective mismatch with %s", rd);
  return CHORUS_ERR_MISMATCH;
}

/* Publishes this rank's line for ticket t (payload first, then seq). */
static void put_line(chorus__coll_t *c, uint64_t t, const void *data, size_t len) {
  chorus__shm_t *s = c->shm;
  chorus__shm_line_t *l = chorus__shm_line(s, s->me, t);
  l->fp = c->fp;
  if (len) memcpy(l->data, data, len);
  chorus__shm_post(s, &l->seq, t); /* the step's finish() or next wait rings */
}

/* Waits for rank r's line of ticket t and checks its fingerprint. */
static chorus_result_t get_line(chorus__coll_t *c, int r, uint64_t t, chorus__shm_line_t **out) {
  chorus__shm_t *s = c->shm;
  chorus__shm_line_t *l = chorus__shm_line(s, r, t);
  chorus_result_t st = chorus__shm_wait(s, &l->seq, t, r, "its data");
  if (st != CHORUS_OK) return st;
  if (!chorus__fp_equal(&l->fp, &c->fp)) return mismatch(c, r, &l->fp);
  if (out) *out = l;
  return CHORUS_OK;
}

/* Waits for every other rank's line of ticket t.  Each of them published
 * done(t - 2) before it (shm.h), which is what the claim of t + 1 needs. */
static chorus_result_t get_all(chorus__coll_t *c, uint64_t t) {
  chorus__shm_t *s = c->shm;
  for (int r = 0; r < s->n; r++) {
    if (r == s->me) continue;
    chorus_result_t st = get_line(c, r, t, NULL);
    if (st != CHORUS_OK) return st;
  }
  if (t > 2 && s->all_done < t - 2) s->all_done = t - 2;
  return CHORUS_OK;
}

/* This rank finished reading ticket t. */
static void finish(chorus__coll_t *c, uint64_t t) {
  chorus__shm_t *s = c->shm;
  chorus__shm_set(s, &s->area[s->me].done, t);
}

/* Where rank r's data of ticket t is: inline for small payloads. */
static const unsigned char *src_of(chorus__coll_t *c, int r, uint64_t t, int inl) {
  return inl ? chorus__shm_line(c->shm, r, t)->data : chorus__shm_buf(c->shm, r, t);
}

/* dst = src[0] op src[1] op ... op src[n-1] over cnt elements, in rank
 * order, divided by n for AVG.  dst may be one of the sources (an in-place
 * reduce_scatter combines into its own input block): then each block is
 * built in a scratch block first, so no source is overwritten before it is
 * read.  With stream, blocks are built there too and streamed out (caller
 * fences). */
static void combine_all(chorus__coll_t *c, unsigned char *dst, const unsigned char *const *src,
                        int n, size_t cnt, int stream) {
  const size_t es = c->esize;
  if (n == 1) {
    if (dst != src[0]) memcpy(dst, src[0], cnt * es);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(dst, cnt, c->dtype, n);
    return;
  }
  int staged = stream;
  for (int r = 1; r < n; r++) staged |= src[r] == dst;
  /* Block by block, so the partial result stays in L1 between sources:
   * n reads and one write per element instead of 2(n-1) and n-1. */
  _Alignas(64) unsigned char acc[COMBINE_BLOCK];
  const size_t blk = COMBINE_BLOCK / es;
  for (size_t off = 0; off < cnt; off += blk) {
    size_t k = CHORUS__MIN(blk, cnt - off), b = off * es;
    unsigned char *to = staged ? acc : dst + b;
    chorus__combine(c, to, src[0] + b, src[1] + b, k);
    for (int r = 2; r < n; r++) chorus__combine(c, to, to, src[r] + b, k);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(to, k, c->dtype, n);
    if (staged) copy_out(dst + b, acc, k * es, stream);
  }
}

/* Each rank publishes `blocks` sub-blocks of up to the returned number of
 * elements per chunk; *inl says the whole call fits in a control line (one
 * chunk).  Every rank computes the same plan. */
static size_t chunk_plan(const chorus__coll_t *c, int blocks, int *inl) {
  *inl = c->count * c->esize * (size_t)blocks <= CHORUS__SHM_INLINE;
  if (*inl) return CHORUS__MAX(c->count, (size_t)1);
  return c->shm->chunk / (c->esize * (size_t)blocks);
}

/* ------------------------------------------- zero copy (chorus_mem_alloc) */

/* What a rank says about its buffers in its first line of a large
 * all_reduce: the chorus_mem_alloc allocations (ids, 0 = ordinary memory)
 * and offsets of its input and output.  Exactly one control line. */
typedef struct {
  uint64_t sid, soff, rid, roff;
} zc_desc_t;
_Static_assert(sizeof(zc_desc_t) <= CHORUS__SHM_INLINE, "descriptor fits a control line");

/* Describes this rank's src (and, when dst is not NULL, dst) of len bytes:
 * ids 0 unless every one of them is chorus_mem_alloc memory. */
static void zc_describe(const chorus__coll_t *c, const void *src, const void *dst, size_t len,
                        zc_desc_t *d) {
  memset(d, 0, sizeof *d);
  if (!c->shm->reg) return;
  if (!chorus__memreg_find(c->shm->reg, src, len, &d->sid, &d->soff) ||
      (dst && !chorus__memreg_find(c->shm->reg, dst, len, &d->rid, &d->roff)))
    d->sid = d->rid = 0;
}

/* Every rank's line of ticket t (already read) describes shared sources,
 * and shared destinations too when dest. */
static int zc_all(chorus__coll_t *c, uint64_t t, int dest) {
  for (int r = 0; r < c->shm->n; r++) {
    const zc_desc_t *d = (const zc_desc_t *)chorus__shm_line(c->shm, r, t)->data;
    if (!d->sid || (dest && !d->rid)) return 0;
  }
  return 1;
}

/* Rank r's buffer described by (id, off), mapped here. */
static unsigned char *zc_map(chorus__coll_t *c, int r, uint64_t id, uint64_t off, size_t bytes) {
  chorus__shm_t *s = c->shm;
  size_t size = 0;
  unsigned char *base = chorus__memreg_peer(s->reg, s->world[r], id, &size);
  if (base && off <= size && bytes <= size - off) return base + off;
  char doing[300];
  chorus__ep_doing(c->ep, doing, sizeof doing);
  chorus__ep_fail(c->ep, CHORUS_ERR_SYSTEM, 1,
                  "chorus rank %d/%d: %s: cannot map rank %d's chorus_mem_alloc buffer "
                  "(allocation %" PRIu64 ", offset %" PRIu64 ", %zu bytes): %s",
                  c->rank, c->size, doing, r, id, off, bytes,
                  base ? "the call runs past the end of the allocation" : "it is gone");
  return NULL;
}

/* all_reduce with every input and output in chorus_mem_alloc memory: each
 * rank combines its slice straight from the n inputs and writes the result
 * straight into the n outputs (in place too: only this rank touches its
 * slice of anyone's buffer).  Ticket t is the one whose lines carried the
 * descriptors. */
static chorus_result_t zc_allreduce(chorus__coll_t *c, uint64_t t) {
  chorus__shm_t *s = c->shm;
  const int n = s->n;
  const size_t es = c->esize, bytes = c->count * es;
  const unsigned char *src[CHORUS__SHM_MAX_RANKS];
  unsigned char *dst[CHORUS__SHM_MAX_RANKS];
  for (int r = 0; r < n; r++) {
    const zc_desc_t *d = (const zc_desc_t *)chorus__shm_line(s, r, t)->data;
    if (r == s->me) {
      src[r] = c->sendbuf;
      dst[r] = c->recvbuf;
      continue;
    }
    src[r] = zc_map(c, r, d->sid, d->soff, bytes);
    dst[r] = zc_map(c, r, d->rid, d->roff, bytes);
    if (!src[r] || !dst[r]) return CHORUS_ERR_SYSTEM;
  }
  _Alignas(64) unsigned char acc[COMBINE_BLOCK];
  const size_t blk = COMBINE_BLOCK / es;
  const int stream = stream_out(c, bytes, bytes); /* as in the staged path */
  size_t a = chorus__blk_offset(c->count, n, s->me), k = chorus__blk_count(c->count, n, s->me);
  for (size_t i = 0; i < k; i += blk) {
    size_t kk = CHORUS__MIN(blk, k - i), b = (a + i) * es;
    chorus__combine(c, acc, src[0] + b, src[1] + b, kk);
    for (int r = 2; r < n; r++) chorus__combine(c, acc, acc, src[r] + b, kk);
    if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(acc, kk, c->dtype, n);
    for (int j = 0; j < n; j++) {
      int r = (s->me + j) % n;
      copy_out(dst[r] + b, acc, kk * es, stream);
    }
  }
  stream_fence(stream);
  /* Done writing everyone's outputs and reading their inputs. */
  chorus__shm_set(s, &chorus__shm_line(s, s->me, t)->red, t);
  for (int r = 0; r < n; r++) {
    if (r == s->me) continue;
    chorus_result_t st = chorus__shm_wait(s, &chorus__shm_line(s, r, t)->red, t, r,
                                          "its slice of the result");
    if (st != CHORUS_OK) return st;
  }
  finish(c, t);
  return CHORUS_OK;
}

/* ---------------------------------------------------------- all_reduce */

/* Every rank combines the whole (small) vector itself: one wait. */
static chorus_result_t reduce_small(chorus__coll_t *c, int everyone) {
  chorus__shm_t *s = c->shm;
  size_t bytes = c->count * c->esize;
  int inl = bytes <= CHORUS__SHM_INLINE;
  uint64_t t;
  chorus_result_t st = chorus__shm_claim(s, &t);
  if (st != CHORUS_OK) return st;
  if (!inl && bytes) memcpy(chorus__shm_buf(s, s->me, t), c->sendbuf, bytes);
  put_line(c, t, c->sendbuf, inl ? bytes : 0);
  int mine = everyone || c->rank == c->root;
  if (mine) {
    st = get_all(c, t);
    if (st != CHORUS_OK) return st;
    const unsigned char *src[CHORUS__SHM_MAX_RANKS];
    for (int r = 0; r < s->n; r++) src[r] = src_of(c, r, t, inl);
    if (bytes) {
      combine_all(c, c->recvbuf, src, s->n, c->count, 0);
    }
  } else {
    st = get_line(c, c->root, t, NULL); /* the root's call must be ours */
    if (st != CHORUS_OK) return st;
  }
  finish(c, t);
  return CHORUS_OK;
}

/* Copies the other ranks' reduced slices of chunk [off, off+m), ticket t,
 * to the output (if this rank has one), then finishes t. */
static chorus_result_t gather_slices(chorus__coll_t *c, uint64_t t, size_t off, size_t m,
                                     int outputs, int stream) {
  chorus__shm_t *s = c->shm;
  const size_t es = c->esize;
  unsigned char *out = c->recvbuf;
  for (int i = 1; outputs && i < s->n; i++) {
    int r = (s->me + i) % s->n; /* start with different peers */
    chorus_result_t st =
        chorus__shm_wait(s, &chorus__shm_line(s, r, t)->red, t, r, "its reduced slice");
    if (st != CHORUS_OK) return st;
    size_t ra = chorus__blk_offset(m, s->n, r), rk = chorus__blk_count(m, s->n, r);
    copy_out(out + (off + ra) * es, chorus__shm_buf(s, r, t) + ra * es, rk * es, stream);
  }
  stream_fence(stream);
  finish(c, t);
  return CHORUS_OK;
}

/* Chunked, one wait per chunk: copy chunk k in and publish it; once every
 * rank's chunk k is in, copy out the others' reduced slices of chunk k - 1
 * (each rank published them before its chunk k), then reduce my slice of
 * chunk k and publish it.  Chunk k - 1 is still in its slot because a slot
 * is reused only three tickets later (shm.h).  Only the root copies out
 * for reduce. */
static chorus_result_t reduce_sliced(chorus__coll_t *c, int everyone) {
  chorus__shm_t *s = c->shm;
  const size_t es = c->esize, per = s->chunk / es;
  const unsigned char *in = c->sendbuf;
  unsigned char *out = c->recvbuf;
  const int outputs = everyone || c->rank == c->root;
  const int stream = outputs && stream_out(c, c->count * es, c->count * es);
  /* Partial results are built in a small block that stays in L1, then
   * copied to my buffer (for the others) and to the output. */
  _Alignas(64) unsigned char acc[COMBINE_BLOCK];
  const size_t blk = COMBINE_BLOCK / es;
  uint64_t t = 0, pt = 0; /* this chunk's ticket, the previous chunk's */
  size_t poff = 0, pm = 0;
  chorus_result_t st;
  for (size_t off = 0; off < c->count; off += per) {
    size_t m = CHORUS__MIN(per, c->count - off);
    st = chorus__shm_claim(s, &t);
    if (st != CHORUS_OK) return st;
    unsigned char *mybuf = chorus__shm_buf(s, s->me, t);
    /* My slice of my input is read by nobody else: it stays where it is,
     * and my buffer's slice receives the result instead. */
    size_t a = chorus__blk_offset(m, s->n, s->me), k = chorus__blk_count(m, s->n, s->me);
    memcpy(mybuf, in + off * es, a * es);
    memcpy(mybuf + (a + k) * es, in + (off + a + k) * es, (m - a - k) * es);
    /* The first line of an all_reduce says whether this rank's buffers are
     * chorus_mem_alloc memory; if everyone's are, no staging at all. */
    zc_desc_t desc;
    int zc = off == 0 && everyone && c->count > per;
    if (zc) zc_describe(c, c->sendbuf, c->recvbuf, c->count * es, &desc);
    put_line(c, t, zc ? &desc : NULL, zc ? sizeof desc : 0);
    st = get_all(c, t);
    if (st != CHORUS_OK) return st;
    if (zc && zc_all(c, t, 1)) return zc_allreduce(c, t);
    if (pt && (st = gather_slices(c, pt, poff, pm, outputs, stream)) != CHORUS_OK) return st;
    const unsigned char *src[CHORUS__SHM_MAX_RANKS];
    for (int r = 0; r < s->n; r++) src[r] = r == s->me ? in + off * es : chorus__shm_buf(s, r, t);
    for (size_t i = 0; i < k; i += blk) {
      size_t kk = CHORUS__MIN(blk, k - i), b = (a + i) * es;
      chorus__combine(c, acc, src[0] + b, src[1] + b, kk);
      for (int r = 2; r < s->n; r++) chorus__combine(c, acc, acc, src[r] + b, kk);
      if (c->op == CHORUS_AVG) chorus__reduce_finalize_avg(acc, kk, c->dtype, s->n);
      memcpy(mybuf + b, acc, kk * es);
      if (outputs) copy_out(out + off * es + b, acc, kk * es, stream);
    }
    chorus__shm_set(s, &chorus__shm_line(s, s->me, t)->red, t);
    pt = t, poff = off, pm = m;
  }
  return gather_slices(c, pt, poff, pm, outputs, stream);
}

static chorus_result_t reduce_any(chorus__coll_t *c, int everyone) {
  if (c->count * c->esize <= CHORUS__MIN((size_t)SMALL_BYTES, c->shm->chunk))
    return reduce_small(c, everyone);
  return reduce_sliced(c, everyone);
}

chorus_result_t chorus__allreduce_direct(chorus__coll_t *c) { return reduce_any(c, 1); }
chorus_result_t chorus__reduce_direct(chorus__coll_t *c) { return reduce_any(c, 0); }

/* ---------------------------------------------------------- all_gather */

static unsigned char *gather_dst(chorus__coll_t *c, int r, size_t off) {
  if (c->recvbufs) return (unsigned char *)c->recvbufs[r] + off * c->esize;
  return (unsigned char *)c->recvbuf + ((size_t)r * c->count + off) * c->esize;
}

/* ------------------------------------------------ single copy (CMA) */

enum { K_BCAST, K_SCATTER, K_GATHER, K_ALLGATHER, K_ALLTOALL, K_RSCATTER };

/* Bytes of the buffer other ranks read from in a single-copy call. */
static size_t source_bytes(const chorus__coll_t *c, int kind) {
  size_t block = c->count * c->esize;
  return kind == K_SCATTER || kind == K_ALLTOALL || kind == K_RSCATTER ? block * (size_t)c->size
                                                                       : block;
}

/* The buffer this rank's peers read from in a single-copy call. */
static const unsigned char *source_buf(const chorus__coll_t *c, int kind) {
  return kind == K_BCAST ? (const unsigned char *)c->recvbuf : (const unsigned char *)c->sendbuf;
}

/* Single copy, process_vm_readv flavour (CHORUS_SHM_CMA_MIN): for large
 * calls where the kernel allows it between the ranks. */
static int use_cma(const chorus__coll_t *c, int kind) {
  const chorus__shm_t *s = c->shm;
  size_t block = c->count * c->esize;
  /* Only values every rank shares decide (s->cma is agreed when the group
   * forms; a correct program passes the same count everywhere): ranks must
   * not run different protocols.  Per-rank choices such as in place are
   * settled inside the call (cma_run). */
  (void)kind;
  return s->cma && block != 0 && block >= s->cma_min;
}

/* Single copy, chorus_mem_alloc flavour: this rank's source buffer as a
 * descriptor (sid 0: not shareable), put in its first line of a call of at
 * least ZC_MIN_BYTES. */
#define ZC_MIN_BYTES ((size_t)64 << 10)
static void zc_describe_source(const chorus__coll_t *c, int kind, zc_desc_t *d) {
  if (kind == K_ALLTOALL && c->sendbuf == c->recvbuf) /* peers would read what we overwrite */
    memset(d, 0, sizeof *d);
  else
    zc_describe(c, source_buf(c, kind), NULL, source_bytes(c, kind), d);
}
static int zc_source(chorus__coll_t *c, int r, uint64_t t) {
  return ((const zc_desc_t *)chorus__shm_line(c->shm, r, t)->data)->sid != 0;
}

/* Copies len bytes at offset off of rank r's source buffer into dst:
 * through its mapping (zc) or with process_vm_readv at the address in its
 * line. */
static chorus_result_t read_source(chorus__coll_t *c, int kind, int zc, int r, uint64_t t,
                                   size_t off, void *dst, size_t len) {
  const unsigned char *line = chorus__shm_line(c->shm, r, t)->data;
  if (!zc) return chorus__shm_read_peer(c->shm, r, dst, *(const uint64_t *)line + off, len);
  const zc_desc_t *d = (const zc_desc_t *)line;
  const unsigned char *p = zc_map(c, r, d->sid, d->soff, source_bytes(c, kind));
  if (!p) return CHORUS_ERR_SYSTEM;
  memcpy(dst, p + off, len);
  return CHORUS_OK;
}

/* The single-copy data movement of ticket t, whose lines (the sources'
 * addresses or descriptors) are published and read: readers copy straight
 * from the owners' buffers into their outputs, say so with their red flag,
 * and an owner returns only once its readers are done with its buffer. */
static chorus_result_t copy_run(chorus__coll_t *c, int kind, uint64_t t, int zc) {
  chorus__shm_t *s = c->shm;
  const int n = s->n, me = s->me, root = c->root;
  const size_t bytes = c->count * c->esize;
  unsigned char *out = c->recvbuf;
  const unsigned char *in = source_buf(c, kind);
  chorus_result_t st = CHORUS_OK;
  int stream = 0; /* only reduce_scatter's combine streams here */
  switch (kind) {
    case K_BCAST:
      if (me != root) st = read_source(c, kind, zc, root, t, 0, out, bytes);
      break;
    case K_SCATTER:
      if (me != root)
        st = read_source(c, kind, zc, root, t, (size_t)me * bytes, out, bytes);
      else if (out != in + (size_t)me * bytes)
        memmove(out, in + (size_t)me * bytes, bytes);
      break;
    case K_GATHER:
      if (me != root) break;
      __attribute__((fallthrough)); /* the root gathers like all_gather */
    case K_ALLGATHER:
      for (int i = 0; i < n && st == CHORUS_OK; i++) {
        int r = (me + i) % n;
        unsigned char *to = gather_dst(c, r, 0);
        if (r != me) st = read_source(c, kind, zc, r, t, 0, to, bytes);
        else if (to != in) memmove(to, in, bytes);
      }
      break;
    case K_ALLTOALL:
      for (int i = 0; i < n && st == CHORUS_OK; i++) {
        int r = (me + i) % n;
        if (r != me)
          st = read_source(c, kind, zc, r, t, (size_t)me * bytes, out + (size_t)r * bytes, bytes);
        else
          memcpy(out + (size_t)me * bytes, in + (size_t)me * bytes, bytes);
      }
      break;
    case K_RSCATTER: { /* zc only: combine block me of every source */
      const unsigned char *src[CHORUS__SHM_MAX_RANKS];
      for (int r = 0; r < n; r++) {
        const zc_desc_t *d = (const zc_desc_t *)chorus__shm_line(s, r, t)->data;
        const unsigned char *p = r == me ? in : zc_map(c, r, d->sid, d->soff, n * bytes);
        if (!p) return CHORUS_ERR_SYSTEM;
        src[r] = p + (size_t)me * bytes;
      }
      stream = stream_out(c, bytes, (size_t)n * bytes);
      combine_all(c, out, src, n, c->count, stream);
      break;
    }
  }
  if (st != CHORUS_OK) return st;
  stream_fence(stream);
  chorus__shm_set(s, &chorus__shm_line(s, me, t)->red, t); /* done reading */
  for (int r = 0; r < n; r++) {
    if (r == me) continue;
    int reads_me = kind == K_ALLGATHER || kind == K_ALLTOALL || kind == K_RSCATTER ||
                   (me == root && (kind == K_BCAST || kind == K_SCATTER)) ||
                   (kind == K_GATHER && r == root);
    if (!reads_me) continue;
    st = chorus__shm_wait(s, &chorus__shm_line(s, r, t)->red, t, r, "done reading");
    if (st != CHORUS_OK) return st;
  }
  finish(c, t);
  return CHORUS_OK;
}

/* process_vm_readv single copy: every rank publishes its buffer's address. */
static chorus_result_t blocks_any(chorus__coll_t *c, int reducing);

static chorus_result_t cma_run(chorus__coll_t *c, int kind) {
  chorus__shm_t *s = c->shm;
  int rooted = kind == K_BCAST || kind == K_SCATTER || kind == K_GATHER;
  uint64_t t;
  chorus_result_t st = chorus__shm_claim(s, &t);
  if (st != CHORUS_OK) return st;
  /* An in-place all_to_all overwrites blocks its peers would read: such a
   * rank publishes address 0, and then every rank (all of them read every
   * line) runs the staged copies instead, which are safe in place. */
  uint64_t mine = (uint64_t)(uintptr_t)source_buf(c, kind);
  if (kind == K_ALLTOALL && c->sendbuf == c->recvbuf) mine = 0;
  put_line(c, t, &mine, sizeof mine);
  /* Fingerprints: the root (or everyone) reads every line, the others the
   * root's -- as in the staged algorithms. */
  if (!rooted || s->me == c->root) st = get_all(c, t);
  else st = get_line(c, c->root, t, NULL);
  if (st != CHORUS_OK) return st;
  if (kind == K_ALLTOALL) {
    for (int r = 0; r < s->n; r++) {
      if (*(const uint64_t *)chorus__shm_line(s, r, t)->data) continue;
      finish(c, t);
      return blocks_any(c, 0);
    }
  }
  return copy_run(c, kind, t, 0);
}

/* all_gather (everyone receives) and gather (the root receives). */
static chorus_result_t gather_any(chorus__coll_t *c, int everyone) {
  chorus__shm_t *s = c->shm;
  const size_t es = c->esize;
  int inl;
  const size_t per = chunk_plan(c, 1, &inl), bytes = c->count * es;
  int receives = everyone || c->rank == c->root;
  const unsigned char *in = c->sendbuf;
  const int stream = receives && stream_out(c, (size_t)s->n * bytes, bytes);
  uint64_t t = 0;
  size_t off = 0;
  do {
    size_t m = CHORUS__MIN(per, c->count - off);
    chorus_result_t st = chorus__shm_claim(s, &t);
    if (st != CHORUS_OK) return st;
    if (!inl && m) memcpy(chorus__shm_buf(s, s->me, t), in + off * es, m * es);
    zc_desc_t desc;
    int zc = off == 0 && everyone && !inl && bytes >= ZC_MIN_BYTES;
    if (zc) zc_describe_source(c, K_ALLGATHER, &desc);
    put_line(c, t, zc ? (const void *)&desc : in, zc ? sizeof desc : inl ? bytes : 0);
    if (receives) {
      st = get_all(c, t);
      if (st != CHORUS_OK) return st;
      if (zc && zc_all(c, t, 0)) return copy_run(c, K_ALLGATHER, t, 1);
      for (int r = 0; r < s->n && m; r++) {
        const unsigned char *from = r == s->me ? in + off * es : src_of(c, r, t, inl);
        unsigned char *to = gather_dst(c, r, off);
        if (r != s->me) copy_out(to, from, m * es, stream); /* from shared memory */
        else if (to != from) memmove(to, from, m * es);
      }
    } else {
      st = get_line(c, c->root, t, NULL);
      if (st != CHORUS_OK) return st;
    }
    finish(c, t);
    off += m;
  } while (off < c->count);
  stream_fence(stream);
  return CHORUS_OK;
}

chorus_result_t chorus__allgather_direct(chorus__coll_t *c) {
  return use_cma(c, K_ALLGATHER) ? cma_run(c, K_ALLGATHER) : gather_any(c, 1);
}
chorus_result_t chorus__gather_direct(chorus__coll_t *c) {
  return use_cma(c, K_GATHER) ? cma_run(c, K_GATHER) : gather_any(c, 0);
}

/* ------------------------------------- reduce_scatter and all_to_all */

/* Every rank publishes sub-chunk [off, off+m) of each of its n blocks; rank
 * r then reads sub-block r of everyone (and reduces them, or places them). */
static chorus_result_t blocks_any(chorus__coll_t *c, int reducing) {
  chorus__shm_t *s = c->shm;
  const int n = s->n;
  const size_t es = c->esize;
  int inl;
  const size_t per = chunk_plan(c, n, &inl);
  const unsigned char *in = c->sendbuf;
  unsigned char *out = c->recvbuf;
  const size_t block = c->count * es;
  const int stream = stream_out(c, reducing ? block : (size_t)n * block, (size_t)n * block);
  uint64_t t = 0;
  size_t off = 0;
  do {
    size_t m = CHORUS__MIN(per, c->count - off);
    chorus_result_t st = chorus__shm_claim(s, &t);
    if (st != CHORUS_OK) return st;
    unsigned char *mine = inl ? chorus__shm_line(s, s->me, t)->data : chorus__shm_buf(s, s->me, t);
    /* My own block is read by nobody else: it is not staged. */
    for (int b = 0; b < n && m; b++)
      if (b != s->me)
        memcpy(mine + (size_t)b * m * es, in + ((size_t)b * c->count + off) * es, m * es);
    int kind = reducing ? K_RSCATTER : K_ALLTOALL;
    zc_desc_t desc;
    int zc = off == 0 && !inl && c->count * es * (size_t)n >= ZC_MIN_BYTES;
    if (zc) zc_describe_source(c, kind, &desc);
    put_line(c, t, zc ? &desc : NULL, zc ? sizeof desc : 0);
    st = get_all(c, t);
    if (st != CHORUS_OK) return st;
    if (zc && zc_all(c, t, 0)) return copy_run(c, kind, t, 1);
    if (m) {
      const unsigned char *src[CHORUS__SHM_MAX_RANKS];
      for (int r = 0; r < n; r++)
        src[r] = r == s->me ? in + ((size_t)r * c->count + off) * es
                            : src_of(c, r, t, inl) + (size_t)s->me * m * es;
      if (reducing) {
        combine_all(c, out + off * es, src, n, m, stream);
      } else {
        for (int r = 0; r < n; r++) {
          unsigned char *to = out + ((size_t)r * c->count + off) * es;
          if (r != s->me) copy_out(to, src[r], m * es, stream);
          else if (to != src[r]) memmove(to, src[r], m * es); /* in place: already there */
        }
      }
    }
    finish(c, t);
    off += m;
  } while (off < c->count);
  stream_fence(stream);
  return CHORUS_OK;
}

chorus_result_t chorus__reduce_scatter_direct(chorus__coll_t *c) { return blocks_any(c, 1); }
chorus_result_t chorus__alltoall_direct(chorus__coll_t *c) {
  return use_cma(c, K_ALLTOALL) ? cma_run(c, K_ALLTOALL) : blocks_any(c, 0);
}

/* ------------------------------------------------ broadcast and scatter */

/* The root publishes chunk by chunk (n sub-blocks for scatter); the others
 * copy out and acknowledge with their own line, which the root checks at
 * the end (so a rank that disagrees about the root is always caught). */
static chorus_result_t from_root(chorus__coll_t *c, int scatter) {
  chorus__shm_t *s = c->shm;
  const int n = s->n, root = c->root;
  const size_t es = c->esize;
  int inl;
  const size_t per = chunk_plan(c, scatter ? n : 1, &inl);
  const unsigned char *in = c->sendbuf;
  unsigned char *out = c->recvbuf;
  /* What a receiver (or a scatter's rank) writes is its output only. */
  const int stream = c->rank != root && c->count * es >= STREAM_MIN_BYTES;
  uint64_t t = 0;
  size_t off = 0;
  do {
    size_t m = CHORUS__MIN(per, c->count - off);
    chorus_result_t st = chorus__shm_claim(s, &t);
    if (st != CHORUS_OK) return st;
    /* Zero copy when the root's buffer is chorus_mem_alloc memory: its first
     * line says so, the others read straight from it. */
    int kind = scatter ? K_SCATTER : K_BCAST;
    zc_desc_t desc;
    int zc = off == 0 && !inl && source_bytes(c, kind) >= ZC_MIN_BYTES;
    if (zc) {
      if (c->rank == root) {
        zc_describe_source(c, kind, &desc); /* published below even when sid is 0 */
        if (desc.sid) {
          put_line(c, t, &desc, sizeof desc);
          st = get_all(c, t); /* the others' acknowledgements, with their calls */
          return st == CHORUS_OK ? copy_run(c, kind, t, 1) : st;
        }
      } else {
        st = get_line(c, root, t, NULL);
        if (st != CHORUS_OK) return st;
        if (zc_source(c, root, t)) {
          put_line(c, t, NULL, 0);
          return copy_run(c, kind, t, 1);
        }
      }
    }
    if (c->rank == root) {
      unsigned char *mine = inl ? chorus__shm_line(s, s->me, t)->data : chorus__shm_buf(s, s->me, t);
      if (scatter) {
        for (int b = 0; b < n && m; b++)
          if (b != root) memcpy(mine + (size_t)b * m * es, in + ((size_t)b * c->count + off) * es,
                                m * es);
        if (m && out != in + (size_t)root * c->count * es)
          memmove(out + off * es, in + ((size_t)root * c->count + off) * es, m * es);
      } else if (m) {
        memcpy(mine, in + off * es, m * es);
      }
      put_line(c, t, zc ? &desc : NULL, zc ? sizeof desc : 0);
    } else {
      st = get_line(c, root, t, NULL);
      if (st != CHORUS_OK) return st;
      const unsigned char *src = src_of(c, root, t, inl) + (scatter ? (size_t)s->me * m * es : 0);
      if (m) copy_out(out + off * es, src, m * es, stream);
      put_line(c, t, NULL, 0); /* acknowledgement */
    }
    off += m;
    /* The acknowledgements are lines of ticket t too: read them before
     * saying done(t), or a fast peer could reuse the line meanwhile. */
    if (c->rank == root && off >= c->count) {
      st = get_all(c, t);
      if (st != CHORUS_OK) return st;
    }
    finish(c, t);
  } while (off < c->count);
  stream_fence(stream);
  return CHORUS_OK;
}

chorus_result_t chorus__bcast_direct(chorus__coll_t *c) {
  return use_cma(c, K_BCAST) ? cma_run(c, K_BCAST) : from_root(c, 0);
}
chorus_result_t chorus__scatter_direct(chorus__coll_t *c) {
  return use_cma(c, K_SCATTER) ? cma_run(c, K_SCATTER) : from_root(c, 1);
}

/* ------------------------------------------------------------- barrier */

chorus_result_t chorus__barrier_direct(chorus__coll_t *c) {
  uint64_t t;
  chorus_result_t st = chorus__shm_claim(c->shm, &t);
  if (st != CHORUS_OK) return st;
  put_line(c, t, NULL, 0);
  st = get_all(c, t);
  if (st == CHORUS_OK) finish(c, t);
  return st;
}
