/*
 * bpe_encode.c - encoding text into token ids, with a cache of pieces per
 * encoder.
 *
 * Encoding.  Each piece's bytes become byte tokens, then pairs merge by
 * rank as GPT-2's encoder.py does: the lowest-ranked adjacent pair present
 * is found, every occurrence of it merges, left to right and without
 * overlap, and this repeats until no adjacent pair has a rank.  Pieces of
 * up to BPE_SHORT bytes do it on an array (a pass per merge); longer ones
 * on a linked list with a heap of (rank, position), one rank's occurrences
 * taken together in position order and the pairs they create held back
 * until that rank is done, which is the same sequence of merges in
 * O(n log n).  An encoder remembers the tokens of pieces of up to
 * BPE_CACHE_PIECE bytes in a fixed-size table that is emptied when full,
 * and those of up to 16 bytes and 2 tokens also in a small direct-mapped
 * table in front of it (the big table's slots miss the CPU's caches).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "train/bpe_internal.h"
#include "train/runtime.h"

/* Limits on what is encoded on an array and cached. */
#define BPE_SHORT 128                 /* longer pieces use the heap */
#define BPE_CACHE_SLOTS (1u << 16)    /* cache entries (at most half used) */
#define BPE_CACHE_PIECE 64            /* longest piece cached, bytes */
#define BPE_CACHE_ARENA (2u << 20)    /* cached pieces and tokens, bytes */
#define BPE_HOT_SLOTS 8192            /* first-level cache entries */

/* ------------------------------------------------------------ encoding */

/* The rank of the merge of (a, b), NO_RANK when there is none (the merge
 * table of chorus__bpe_build_merge_table). */
static inline uint32_t rank_of(const chorus_bpe_t *t, uint32_t a, uint32_t b) {
  uint64_t k = (uint64_t)a << 32 | b;
  size_t i = (size_t)((k * 0x9e3779b97f4a7c15ull) >> t->mshift);
  for (;; i = (i + 1) & t->mmask) {
    if (t->mtab[i].key == k) return t->mtab[i].rank;
    if (t->mtab[i].key == UINT64_MAX) return NO_RANK;
  }
}

/* A cached piece: its first 8 bytes in head (zero-padded), the rest in the
 * arena at off; its tokens in tok if there are at most two, else in the
 * arena after the bytes (4-aligned).  A short piece is found without
 * touching the arena, a one- or two-token piece copied from the slot. */
typedef struct {
  uint64_t head;
  uint64_t h;    /* hash of all the bytes */
  uint32_t off;
  uint16_t len;  /* 0: empty */
  uint16_t ntok;
  uint32_t tok[2];
} cache_slot_t;

/* The first level: direct-mapped, small enough for the L2 cache, for
 * pieces of up to 16 bytes and 2 tokens (most of them in prose and code);
 * the big table's slots are a cache miss each. */
typedef struct {
  uint64_t head, head2; /* bytes 0..7 and 8..15, zero-padded */
  uint16_t len;         /* 0: empty */
  uint16_t ntok;
  uint32_t tok[2];
} hot_slot_t;

struct chorus_bpe_encoder {
  const chorus_bpe_t *t;
  hot_slot_t *hot;
  cache_slot_t *slot;
  size_t used;
  uint8_t *arena;
  size_t arena_used;
  /* Scratch of long pieces (grown as needed). */
  uint32_t *tok, *nxt, *prv;
  uint64_t *heap, *pend;
  size_t scratch;
  chorus_result_t st; /* why bpe_long() failed */
};

chorus_result_t chorus_bpe_encoder_create(const chorus_bpe_t *t, chorus_bpe_encoder_t **out) {
  if (out) *out = NULL;
  if (!t || !out)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_bpe_encoder_create: bad arguments");
  chorus_bpe_encoder_t *e = calloc(1, sizeof *e);
  if (e) {
    e->t = t;
    e->hot = calloc(BPE_HOT_SLOTS, sizeof *e->hot);
    e->slot = calloc(BPE_CACHE_SLOTS, sizeof *e->slot);
    e->arena = malloc(BPE_CACHE_ARENA);
  }
  if (!e || !e->hot || !e->slot || !e->arena) {
    chorus_bpe_encoder_free(e);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_bpe_encoder_create: out of memory");
  }
  *out = e;
  return CHORUS_OK;
}

static void free_scratch(chorus_bpe_encoder_t *e) {
  free(e->tok);
  free(e->nxt);
  free(e->prv);
  free(e->heap);
  free(e->pend);
  e->tok = e->nxt = e->prv = NULL;
  e->heap = e->pend = NULL;
  e->scratch = 0;
}

void chorus_bpe_encoder_free(chorus_bpe_encoder_t *e) {
  if (!e) return;
  free(e->hot);
  free(e->slot);
  free(e->arena);
  free_scratch(e);
  free(e);
}

/* BPE of a piece of n <= BPE_SHORT bytes on an array: one pass per merge
 * rank, rk[i] the rank of the pair (tok[i], tok[i + 1]). */
static size_t bpe_short(const chorus_bpe_t *t, const uint8_t *s, size_t n, uint32_t *out) {
  uint32_t tok[BPE_SHORT], rk[BPE_SHORT];
  uint8_t merged[BPE_SHORT];
  for (size_t i = 0; i < n; i++) tok[i] = t->byte_id[s[i]];
  for (size_t i = 0; i + 1 < n; i++) rk[i] = rank_of(t, tok[i], tok[i + 1]);
  size_t m = n;
  while (m > 1) {
    uint32_t best = NO_RANK;
    for (size_t i = 0; i + 1 < m; i++)
      if (rk[i] < best) best = rk[i];
    if (best == NO_RANK) break;
    uint32_t id = 256 + best;
    size_t j = 0;
    for (size_t i = 0; i < m; j++) {
      if (i + 1 < m && rk[i] == best) {
        tok[j] = id, merged[j] = 1, i += 2;
      } else {
        /* rk[i] stays right if the next one is copied too. */
        tok[j] = tok[i], rk[j] = rk[i], merged[j] = 0, i++;
      }
    }
    m = j;
    for (size_t i = 0; i + 1 < m; i++)
      if (merged[i] || merged[i + 1]) rk[i] = rank_of(t, tok[i], tok[i + 1]);
  }
  memcpy(out, tok, m * sizeof *out);
  return m;
}

/* Min-heap of uint64 (rank << 32 | position). */
static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
  size_t i = (*n)++;
  while (i) {
    size_t p = (i - 1) / 2;
    if (h[p] <= v) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
  uint64_t top = h[0], v = h[--*n];
  size_t i = 0, len = *n;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= len) break;
    if (c + 1 < len && h[c + 1] < h[c]) c++;
    if (v <= h[c]) break;
    h[i] = h[c];
    i = c;
  }
  if (len) h[i] = v;
  return top;
}

/* BPE of a long piece on a linked list (see the file's comment).  Returns
 * the number of tokens, or SIZE_MAX (out of memory, error recorded). */
static size_t bpe_long(chorus_bpe_encoder_t *e, const uint8_t *s, size_t n, uint32_t *out) {
  const chorus_bpe_t *t = e->t;
  if (n >= UINT32_MAX) {
    e->st = chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                               "chorus_bpe_encode: a piece of %zu bytes (at most 4 GiB; cut the "
                               "text)", n);
    return SIZE_MAX;
  }
  if (e->scratch < n) {
    free_scratch(e);
    e->tok = malloc(n * sizeof *e->tok);
    e->nxt = malloc(n * sizeof *e->nxt);
    e->prv = malloc(n * sizeof *e->prv);
    e->heap = malloc(3 * n * sizeof *e->heap);
    e->pend = malloc(n * sizeof *e->pend); /* a pass merges at most n / 2 pairs */
    if (!e->tok || !e->nxt || !e->prv || !e->heap || !e->pend) {
      free_scratch(e);
      e->st = chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                 "chorus_bpe_encode: out of memory for a piece of %zu bytes", n);
      return SIZE_MAX;
    }
    e->scratch = n;
  }
  uint32_t *tok = e->tok, *nxt = e->nxt, *prv = e->prv;
  uint64_t *heap = e->heap, *pend = e->pend;
  const uint32_t END = UINT32_MAX, DEAD = UINT32_MAX;
  size_t nh = 0;
  for (size_t i = 0; i < n; i++) {
    tok[i] = t->byte_id[s[i]];
    nxt[i] = i + 1 < n ? (uint32_t)(i + 1) : END;
    prv[i] = i ? (uint32_t)(i - 1) : END;
  }
  for (size_t i = 0; i + 1 < n; i++) {
    uint32_t r = rank_of(t, tok[i], tok[i + 1]);
    if (r != NO_RANK) heap_push(heap, &nh, (uint64_t)r << 32 | i);
  }
  while (nh) {
    uint32_t r = (uint32_t)(heap[0] >> 32);
    uint32_t a = t->ma[r], b = t->mb[r], id = 256 + r;
    size_t np = 0;
    while (nh && (uint32_t)(heap[0] >> 32) == r) {
      uint32_t pos = (uint32_t)heap_pop(heap, &nh);
      uint32_t nx = nxt[pos];
      if (tok[pos] != a || nx == END || tok[nx] != b) continue; /* stale */
      tok[pos] = id;
      tok[nx] = DEAD;
      nxt[pos] = nxt[nx];
      if (nxt[nx] != END) prv[nxt[nx]] = pos;
      if (prv[pos] != END) {
        uint32_t q = rank_of(t, tok[prv[pos]], id);
        if (q != NO_RANK) pend[np++] = (uint64_t)q << 32 | prv[pos];
      }
      if (nxt[pos] != END) {
        uint32_t q = rank_of(t, id, tok[nxt[pos]]);
        if (q != NO_RANK) pend[np++] = (uint64_t)q << 32 | pos;
      }
    }
    for (size_t i = 0; i < np; i++) heap_push(heap, &nh, pend[i]);
  }
  size_t m = 0;
  for (uint32_t i = 0; i != END; i = nxt[i]) out[m++] = tok[i];
  if (n > (1u << 20)) free_scratch(e); /* do not keep hundreds of MiB */
  return m;
}

/* The first min(n, 8) bytes of s, zero-padded; s + 8 <= end allows one
 * load. */
static inline uint64_t head8(const uint8_t *s, size_t n, const uint8_t *end) {
  uint64_t v = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (end - s >= 8) {
    memcpy(&v, s, 8);
    if (n < 8) v &= ~(uint64_t)0 >> (64 - 8 * n); /* the first n bytes */
    return v;
  }
#else
  (void)end;
#endif
  for (size_t i = 0; i < n && i < 8; i++) v |= (uint64_t)s[i] << (8 * i);
  return v;
}

/* The tokens of one piece of n >= 2 bytes into out (room for n); end is
 * the end of the text (bytes up to it may be read). */
static size_t bpe_piece(chorus_bpe_encoder_t *e, const uint8_t *s, size_t n, const uint8_t *end,
                        uint32_t *out) {
  if (n > BPE_CACHE_PIECE)
    return n <= BPE_SHORT ? bpe_short(e->t, s, n, out) : bpe_long(e, s, n, out);
  uint64_t head = head8(s, n, end), head2 = n > 8 ? head8(s + 8, n - 8, end) : 0;
  uint64_t h = n <= 16
                   ? chorus__bpe_mix64((head ^ ((uint64_t)n << 59)) + head2 * 0x9e3779b97f4a7c15ull)
                   : chorus__bpe_hash_bytes(s, n);
  hot_slot_t *hs = n <= 16 ? &e->hot[(h >> 32) & (BPE_HOT_SLOTS - 1)] : NULL;
  if (hs && hs->len == n && hs->head == head && hs->head2 == head2) {
    out[0] = hs->tok[0];
    out[1] = hs->tok[1];
    return hs->ntok;
  }
  size_t m;
  size_t mask = BPE_CACHE_SLOTS - 1, i = (size_t)h & mask;
  for (; e->slot[i].len; i = (i + 1) & mask) {
    cache_slot_t *c = &e->slot[i];
    if (c->h != h || c->head != head || c->len != n ||
        (n > 8 && memcmp(e->arena + c->off, s + 8, n - 8)))
      continue;
    m = c->ntok;
    if (m <= 2) {
      out[0] = c->tok[0];
      out[1] = c->tok[1];
      if (hs) *hs = (hot_slot_t){head, head2, (uint16_t)n, (uint16_t)m, {out[0], out[1]}};
    } else {
      size_t rest = n > 8 ? (n - 8 + 3) & ~(size_t)3 : 0;
      memcpy(out, e->arena + c->off + rest, 4 * m);
    }
    return m;
  }
  m = bpe_short(e->t, s, n, out);
  if (hs && m <= 2)
    *hs = (hot_slot_t){head, head2, (uint16_t)n, (uint16_t)m, {out[0], m > 1 ? out[1] : 0}};
  size_t rest = n > 8 ? (n - 8 + 3) & ~(size_t)3 : 0, need = rest + (m > 2 ? 4 * m : 0);
  if (2 * (e->used + 1) > BPE_CACHE_SLOTS || e->arena_used + need > BPE_CACHE_ARENA) {
    memset(e->slot, 0, BPE_CACHE_SLOTS * sizeof *e->slot);
    e->used = 0;
    e->arena_used = 0;
    i = (size_t)h & mask; /* the table is empty now */
  }
  cache_slot_t *c = &e->slot[i];
  c->head = head;
  c->h = h;
  c->off = (uint32_t)e->arena_used;
  c->len = (uint16_t)n;
  c->ntok = (uint16_t)m;
  c->tok[0] = out[0];
  c->tok[1] = m > 1 ? out[1] : 0;
  if (n > 8) memcpy(e->arena + e->arena_used, s + 8, n - 8);
  if (m > 2) memcpy(e->arena + e->arena_used + rest, out, 4 * m);
  e->arena_used += need;
  e->used++;
  return m;
}

chorus_result_t chorus_bpe_encode(chorus_bpe_encoder_t *e, const void *text, size_t len,
                                  uint32_t **toks, size_t *n, size_t *cap) {
  if (!e || !toks || !n || !cap || (len && !text) || *n > *cap || (*cap && !*toks))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_bpe_encode: bad arguments");
  const uint8_t *p = text, *end = p + len;
  const chorus_bpe_t *t = e->t;
  while (p < end) {
    size_t pl = chorus__bpe_piece_len(p, end);
    if (*cap - *n < pl) {
      size_t want = *n + pl, nc = *cap ? *cap : 1024;
      while (nc < want && nc <= SIZE_MAX / 8) nc *= 2;
      if (nc < want || nc > SIZE_MAX / sizeof(uint32_t))
        return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_bpe_encode: %zu tokens", want);
      uint32_t *nt = realloc(*toks, nc * sizeof *nt);
      if (!nt)
        return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                  "chorus_bpe_encode: out of memory for %zu tokens", nc);
      *toks = nt;
      *cap = nc;
    }
    if (pl == 1) {
      (*toks)[(*n)++] = t->byte_id[*p];
    } else {
      size_t m = bpe_piece(e, p, pl, end, *toks + *n);
      if (m == SIZE_MAX) return e->st;
      *n += m;
    }
    p += pl;
  }
  return CHORUS_OK;
}
