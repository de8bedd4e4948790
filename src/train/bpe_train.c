/*
 * bpe_train.c - training a vocabulary: pieces of text counted, then the
 * merges picked by count.
 *
 * Training.  Pieces are counted in a hash table (piece bytes -> count).
 * chorus_bpe_train() turns the distinct pieces of two or more bytes into
 * words of byte ids, counts every adjacent pair (weighted by the piece's
 * count) and remembers, per pair, the words it occurs in.  A max-heap of
 * (count, pair) with lazy deletion picks the next merge; merging it
 * rewrites only the words in its list and adjusts the counts of the pairs
 * next to each occurrence, and the pairs with the new token (the only ones
 * whose counts grow) are pushed.  Ties of count go to the pair with the
 * smaller left id, then the smaller right id.  A pair whose concatenation
 * is already a token (two ways to spell the same bytes), or would exceed
 * BPE_MAX_TOKEN bytes, is never merged.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "train/bpe_internal.h"
#include "train/runtime.h"

/* ------------------------------------------------------------ counting */

typedef struct {
  uint64_t h;
  uint64_t off;   /* into the arena */
  uint64_t count; /* 0: empty */
  uint32_t len;
} count_slot_t;

struct chorus_bpe_counter {
  count_slot_t *slot;
  size_t mask, used;
  uint8_t *arena;
  size_t alen, acap;
};

chorus_result_t chorus_bpe_counter_create(chorus_bpe_counter_t **out) {
  if (out) *out = NULL;
  if (!out)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_bpe_counter_create: bad arguments");
  chorus_bpe_counter_t *c = calloc(1, sizeof *c);
  if (c) {
    c->mask = 4095;
    c->slot = calloc(c->mask + 1, sizeof *c->slot);
    c->acap = 1 << 16;
    c->arena = malloc(c->acap);
  }
  if (!c || !c->slot || !c->arena) {
    chorus_bpe_counter_free(c);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_bpe_counter_create: out of memory");
  }
  *out = c;
  return CHORUS_OK;
}

void chorus_bpe_counter_free(chorus_bpe_counter_t *c) {
  if (!c) return;
  free(c->slot);
  free(c->arena);
  free(c);
}

/* Adds count to the piece p[0..n) (hash h); -1 when out of memory. */
static int count_add(chorus_bpe_counter_t *c, const uint8_t *p, size_t n, uint64_t h,
                     uint64_t count) {
  size_t i = (size_t)h & c->mask;
  for (; c->slot[i].count; i = (i + 1) & c->mask) {
    count_slot_t *s = &c->slot[i];
    if (s->h == h && s->len == n && !memcmp(c->arena + s->off, p, n)) {
      s->count += count;
      return 0;
    }
  }
  if (c->alen + n > c->acap) {
    size_t nc = c->acap;
    while (nc < c->alen + n) nc *= 2;
    uint8_t *na = realloc(c->arena, nc);
    if (!na) return -1;
    c->arena = na;
    c->acap = nc;
  }
  if (2 * (c->used + 1) > c->mask + 1) {
    size_t size = 2 * (c->mask + 1);
    count_slot_t *ns = calloc(size, sizeof *ns);
    if (!ns) return -1;
    for (size_t k = 0; k <= c->mask; k++) {
      if (!c->slot[k].count) continue;
      size_t j = (size_t)c->slot[k].h & (size - 1);
      while (ns[j].count) j = (j + 1) & (size - 1);
      ns[j] = c->slot[k];
    }
    free(c->slot);
    c->slot = ns;
    c->mask = size - 1;
    i = (size_t)h & c->mask;
    while (c->slot[i].count) i = (i + 1) & c->mask;
  }
  memcpy(c->arena + c->alen, p, n);
  c->slot[i] = (count_slot_t){h, c->alen, count, (uint32_t)n};
  c->alen += n;
  c->used++;
  return 0;
}

chorus_result_t chorus_bpe_count(chorus_bpe_counter_t *c, const void *text, size_t len) {
  if (!c || (len && !text))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_bpe_count: bad arguments");
  const uint8_t *p = text, *end = p + len;
  while (p < end) {
    size_t pl = chorus__bpe_piece_len(p, end);
    if (pl > UINT32_MAX)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "chorus_bpe_count: a piece of %zu bytes (at most 4 GiB; cut the "
                                "text)", pl);
    if (count_add(c, p, pl, chorus__bpe_hash_bytes(p, pl), 1))
      return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                "chorus_bpe_count: out of memory (%zu distinct pieces counted)",
                                c->used);
    p += pl;
  }
  return CHORUS_OK;
}

chorus_result_t chorus_bpe_counter_merge(chorus_bpe_counter_t *into,
                                         const chorus_bpe_counter_t *counted) {
  if (!into || !counted || into == counted)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_bpe_counter_merge: bad arguments");
  for (size_t k = 0; k <= counted->mask; k++) {
    const count_slot_t *s = &counted->slot[k];
    if (s->count && count_add(into, counted->arena + s->off, s->len, s->h, s->count))
      return chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                "chorus_bpe_counter_merge: out of memory (%zu distinct pieces)",
                                into->used);
  }
  return CHORUS_OK;
}

/* ------------------------------------------------------------ training */

typedef struct {
  uint32_t a, b;
  int64_t cnt;
  uint32_t *words; /* words it occurs in (may hold stale ones) */
  uint32_t nw, cw;
  uint32_t stamp;  /* the step that last put it on the touched list */
  int dead;        /* merged, or never to be merged */
} pair_t;

typedef struct {
  int64_t cnt;
  uint32_t a, b, p;
} hent_t;

typedef struct {
  pair_t *pairs;
  size_t npairs, cpairs;
  uint32_t *ptab; /* (a, b) -> pair index + 1 */
  size_t pmask;
  hent_t *heap;
  size_t nheap, cheap;
  uint32_t *touched;
  size_t ntouched, ctouched;
  uint32_t step;        /* 1 while counting, then 2 + the merge's rank */
  uint32_t cur_a, cur_b; /* the pair being merged */
  /* Words: the distinct pieces of two or more bytes as ids. */
  uint32_t *wtok, *wlen, *wstamp;
  size_t *woff;
  int64_t *wcnt;
  size_t nwords;
  /* Tokens so far: bytes and the set of them. */
  uint8_t *blob;
  size_t blen, bcap;
  size_t *off;
  tokset_t set;
  int oom;
} trainer_t;

static inline size_t pair_hash(uint32_t a, uint32_t b, size_t mask) {
  return (size_t)(chorus__bpe_mix64((uint64_t)a << 32 | b)) & mask;
}

/* The index of pair (a, b), made if new; SIZE_MAX when out of memory. */
static size_t pair_get(trainer_t *T, uint32_t a, uint32_t b) {
  size_t i = pair_hash(a, b, T->pmask);
  for (; T->ptab[i]; i = (i + 1) & T->pmask) {
    pair_t *q = &T->pairs[T->ptab[i] - 1];
    if (q->a == a && q->b == b) return T->ptab[i] - 1;
  }
  if (T->npairs == T->cpairs) {
    size_t nc = T->cpairs ? 2 * T->cpairs : 1024;
    pair_t *np = nc < UINT32_MAX ? realloc(T->pairs, nc * sizeof *np) : NULL;
    if (!np) return SIZE_MAX;
    T->pairs = np;
    T->cpairs = nc;
  }
  if (2 * (T->npairs + 1) > T->pmask + 1) {
    size_t size = 2 * (T->pmask + 1);
    uint32_t *nt = calloc(size, sizeof *nt);
    if (!nt) return SIZE_MAX;
    for (size_t k = 0; k < T->npairs; k++) {
      size_t j = pair_hash(T->pairs[k].a, T->pairs[k].b, size - 1);
      while (nt[j]) j = (j + 1) & (size - 1);
      nt[j] = (uint32_t)k + 1;
    }
    free(T->ptab);
    T->ptab = nt;
    T->pmask = size - 1;
    i = pair_hash(a, b, T->pmask);
    while (T->ptab[i]) i = (i + 1) & T->pmask;
  }
  T->pairs[T->npairs] = (pair_t){a, b, 0, NULL, 0, 0, 0, 0};
  T->ptab[i] = (uint32_t)T->npairs + 1;
  return T->npairs++;
}

/* Adds delta (the count of word w) to pair (a, b); a pair that gains is
 * remembered with w and put on the touched list. */
static void pair_add(trainer_t *T, uint32_t a, uint32_t b, int64_t delta, uint32_t w) {
  if (T->oom || (a == T->cur_a && b == T->cur_b)) return;
  size_t k = pair_get(T, a, b);
  if (k == SIZE_MAX) {
    T->oom = 1;
    return;
  }
  pair_t *q = &T->pairs[k];
  q->cnt += delta;
  if (delta <= 0) return;
  if (!q->nw || q->words[q->nw - 1] != w) {
    if (q->nw == q->cw) {
      uint32_t nc = q->cw ? 2 * q->cw : 4;
      uint32_t *nw = nc > q->cw ? realloc(q->words, (size_t)nc * sizeof *nw) : NULL;
      if (!nw) {
        T->oom = 1;
        return;
      }
      q->words = nw;
      q->cw = nc;
    }
    q->words[q->nw++] = w;
  }
  if (q->stamp != T->step) {
    if (T->ntouched == T->ctouched) {
      size_t nc = T->ctouched ? 2 * T->ctouched : 1024;
      uint32_t *nt = realloc(T->touched, nc * sizeof *nt);
      if (!nt) {
        T->oom = 1;
        return;
      }
      T->touched = nt;
      T->ctouched = nc;
    }
    q->stamp = T->step;
    T->touched[T->ntouched++] = (uint32_t)k;
  }
}

/* Heap order: more frequent first; ties: smaller left id, smaller right id. */
static inline int hent_before(const hent_t *x, const hent_t *y) {
  if (x->cnt != y->cnt) return x->cnt > y->cnt;
  if (x->a != y->a) return x->a < y->a;
  return x->b < y->b;
}

static int hpush(trainer_t *T, size_t k) {
  if (T->nheap == T->cheap) {
    size_t nc = T->cheap ? 2 * T->cheap : 1024;
    hent_t *nh = realloc(T->heap, nc * sizeof *nh);
    if (!nh) return -1;
    T->heap = nh;
    T->cheap = nc;
  }
  hent_t v = {T->pairs[k].cnt, T->pairs[k].a, T->pairs[k].b, (uint32_t)k};
  size_t i = T->nheap++;
  while (i) {
    size_t p = (i - 1) / 2;
    if (!hent_before(&v, &T->heap[p])) break;
    T->heap[i] = T->heap[p];
    i = p;
  }
  T->heap[i] = v;
  return 0;
}

static hent_t hpop(trainer_t *T) {
  hent_t top = T->heap[0], v = T->heap[--T->nheap];
  size_t i = 0, n = T->nheap;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && hent_before(&T->heap[c + 1], &T->heap[c])) c++;
    if (!hent_before(&T->heap[c], &v)) break;
    T->heap[i] = T->heap[c];
    i = c;
  }
  if (n) T->heap[i] = v;
  return top;
}

/* Pushes the touched pairs that have a count. */
static int push_touched(trainer_t *T) {
  for (size_t i = 0; i < T->ntouched; i++) {
    size_t k = T->touched[i];
    if (T->pairs[k].cnt > 0 && !T->pairs[k].dead && hpush(T, k)) return -1;
  }
  T->ntouched = 0;
  return 0;
}

/* Merges every (a, b) of word w into id, left to right, and moves the
 * counts of the neighbouring pairs: before an occurrence the pair with the
 * token now on the left (already merged, if it was), after it the pair
 * with the next token as it was. */
static void merge_word(trainer_t *T, uint32_t w, uint32_t a, uint32_t b, uint32_t id) {
  uint32_t *t = T->wtok + T->woff[w];
  size_t n = T->wlen[w], j = 0;
  int64_t c = T->wcnt[w];
  for (size_t i = 0; i < n; j++) {
    if (i + 1 < n && t[i] == a && t[i + 1] == b) {
      if (j) {
        pair_add(T, t[j - 1], a, -c, w);
        pair_add(T, t[j - 1], id, c, w);
      }
      if (i + 2 < n) {
        pair_add(T, b, t[i + 2], -c, w);
        pair_add(T, id, t[i + 2], c, w);
      }
      t[j] = id;
      i += 2;
    } else {
      t[j] = t[i++];
    }
  }
  T->wlen[w] = (uint32_t)j;
}

static void trainer_clean(trainer_t *T) {
  for (size_t k = 0; k < T->npairs; k++) free(T->pairs[k].words);
  free(T->pairs);
  free(T->ptab);
  free(T->heap);
  free(T->touched);
  free(T->wtok);
  free(T->wlen);
  free(T->wstamp);
  free(T->woff);
  free(T->wcnt);
  free(T->blob);
  free(T->off);
  free(T->set.slot);
}

/* Appends a token of n bytes (p, then q of m bytes) as id T->... */
static int add_token(trainer_t *T, size_t id, const uint8_t *p, size_t n, const uint8_t *q,
                     size_t m) {
  if (T->blen + n + m > T->bcap) {
    size_t nc = T->bcap ? T->bcap : 4096;
    while (nc < T->blen + n + m) nc *= 2;
    uint8_t *nb = realloc(T->blob, nc);
    if (!nb) return -1;
    T->blob = nb;
    T->bcap = nc;
  }
  memcpy(T->blob + T->blen, p, n);
  if (m) memcpy(T->blob + T->blen + n, q, m);
  T->off[id] = T->blen;
  T->blen += n + m;
  T->off[id + 1] = T->blen;
  return chorus__bpe_tokset_add(&T->set, T->blob, T->off, (uint32_t)id);
}

/* The words: the distinct pieces of two or more bytes (total bytes) as
 * byte ids, their pairs counted and pushed; -1 when out of memory. */
static int make_words(trainer_t *T, const chorus_bpe_counter_t *c, const uint32_t byte_id[256],
                      size_t total) {
  T->wtok = malloc((total ? total : 1) * sizeof *T->wtok);
  T->wlen = malloc((T->nwords + 1) * sizeof *T->wlen);
  T->wstamp = calloc(T->nwords + 1, sizeof *T->wstamp);
  T->woff = malloc((T->nwords + 1) * sizeof *T->woff);
  T->wcnt = malloc((T->nwords + 1) * sizeof *T->wcnt);
  T->pmask = 1023;
  T->ptab = calloc(T->pmask + 1, sizeof *T->ptab);
  if (!T->wtok || !T->wlen || !T->wstamp || !T->woff || !T->wcnt || !T->ptab) return -1;
  {
    size_t w = 0, o = 0;
    for (size_t k = 0; k <= c->mask; k++) {
      const count_slot_t *s = &c->slot[k];
      if (!s->count || s->len < 2) continue;
      T->woff[w] = o;
      T->wlen[w] = s->len;
      T->wcnt[w] = s->count > INT64_MAX / 2 ? INT64_MAX / 2 : (int64_t)s->count;
      for (size_t i = 0; i < s->len; i++) T->wtok[o + i] = byte_id[c->arena[s->off + i]];
      for (size_t i = 0; i + 1 < s->len; i++)
        pair_add(T, T->wtok[o + i], T->wtok[o + i + 1], T->wcnt[w], (uint32_t)w);
      o += s->len;
      w++;
    }
  }
  if (T->oom || push_touched(T)) return -1;
  return 0;
}

/* Makes up to want merges into ma and mb, the most frequent pair first;
 * *made: how many.  -1 when out of memory. */
static int make_merges(trainer_t *T, size_t want, uint32_t *ma, uint32_t *mb, size_t *made_out) {
  size_t made = 0;
  uint8_t cat[BPE_MAX_TOKEN];
  while (made < want && T->nheap) {
    hent_t top = hpop(T);
    pair_t *q = &T->pairs[top.p];
    if (q->dead) continue;
    if (top.cnt != q->cnt) { /* stale: counts only fall */
      if (q->cnt > 0 && hpush(T, top.p)) return -1;
      continue;
    }
    uint32_t a = q->a, b = q->b;
    size_t la = T->off[a + 1] - T->off[a], lb = T->off[b + 1] - T->off[b];
    q->dead = 1;
    if (la + lb > BPE_MAX_TOKEN) continue;
    memcpy(cat, T->blob + T->off[a], la);
    memcpy(cat + la, T->blob + T->off[b], lb);
    if (chorus__bpe_tokset_find(&T->set, T->blob, T->off, cat, la + lb) >= 0)
      continue; /* spelt already */
    uint32_t id = 256 + (uint32_t)made;
    if (add_token(T, id, cat, la + lb, NULL, 0)) return -1;
    ma[made] = a;
    mb[made] = b;
    made++;
    T->step = (uint32_t)made + 1; /* merge made - 1 */
    T->cur_a = a;
    T->cur_b = b;
    /* q's word list is not appended to while it is merged ((a, b) gains
     * nothing), but T->pairs may move: hold the list itself. */
    uint32_t *words = q->words, nw = q->nw;
    for (uint32_t k = 0; k < nw; k++) {
      uint32_t w = words[k];
      if (T->wstamp[w] == T->step) continue;
      T->wstamp[w] = T->step;
      merge_word(T, w, a, b, id);
    }
    q = &T->pairs[top.p];
    q->cnt = 0;
    free(q->words);
    q->words = NULL;
    q->nw = q->cw = 0;
    if (T->oom || push_touched(T)) return -1;
  }
  *made_out = made;
  return 0;
}

chorus_result_t chorus_bpe_train(const chorus_bpe_counter_t *c, int vocab_size,
                                 chorus_bpe_t **out, char *err, size_t errlen) {
  if (out) *out = NULL;
  if (!c || !out)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_train: bad arguments");
  if (vocab_size < 257 || vocab_size > BPE_MAX_VOCAB)
    return chorus__bpe_fail(
        err, errlen, CHORUS_ERR_INVALID_ARG,
        "chorus_bpe_train: vocab_size %d: must be 257..%d (256 bytes, the merges, "
        "<|endoftext|>)",
        vocab_size, BPE_MAX_VOCAB);
  size_t want = (size_t)vocab_size - 257;
  trainer_t T;
  memset(&T, 0, sizeof T);
  chorus_result_t st;
  uint16_t b2u[256];
  uint8_t order[256];
  uint32_t byte_id[256];
  chorus__bpe_alphabet(b2u, order);
  for (int i = 0; i < 256; i++) byte_id[order[i]] = (uint32_t)i;
  T.cur_a = T.cur_b = UINT32_MAX;
  T.step = 1; /* the first count; merge k (from 0) is step k + 2 */

  /* Tokens: the bytes, room for the merges and <|endoftext|>. */
  T.off = malloc(((size_t)vocab_size + 1) * sizeof *T.off);
  if (!T.off || chorus__bpe_tokset_init(&T.set, (size_t)vocab_size)) goto nomem;
  for (size_t i = 0; i < 256; i++)
    if (add_token(&T, i, &order[i], 1, NULL, 0)) goto nomem;

  /* Words. */
  size_t total = 0;
  for (size_t k = 0; k <= c->mask; k++)
    if (c->slot[k].count && c->slot[k].len >= 2) T.nwords++, total += c->slot[k].len;
  if (T.nwords >= UINT32_MAX) {
    st = chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                          "chorus_bpe_train: %zu distinct pieces (at most 4G)", T.nwords);
    goto fail;
  }
  if (make_words(&T, c, byte_id, total)) goto nomem;

  /* Merges. */
  size_t made = 0;
  uint32_t *ma = malloc((want + 1) * sizeof *ma), *mb = malloc((want + 1) * sizeof *mb);
  if (!ma || !mb) {
    free(ma);
    free(mb);
    goto nomem;
  }
  if (make_merges(&T, want, ma, mb, &made)) goto nomem_m;
  if (made < want) {
    free(ma);
    free(mb);
    st = chorus__bpe_fail(
        err, errlen, CHORUS_ERR_INVALID_ARG,
        "chorus_bpe_train: the counted text gives only %zu merges, vocab_size %d needs "
        "%zu (count more, or more varied, text; or ask for at most %zu ids)",
        made, vocab_size, want, made + 257);
    goto fail;
  }

  /* The tokenizer: the bytes, the merges, <|endoftext|>. */
  if (add_token(&T, 256 + made, (const uint8_t *)BPE_EOT, strlen(BPE_EOT), NULL, 0)) goto nomem_m;
  chorus_bpe_t *t = calloc(1, sizeof *t);
  if (!t) goto nomem_m;
  t->nids = vocab_size;
  t->nmerges = (int)made;
  t->eot = vocab_size - 1;
  memcpy(t->byte_id, byte_id, sizeof byte_id);
  t->blob = T.blob, T.blob = NULL;
  t->off = T.off, T.off = NULL;
  t->ma = ma;
  t->mb = mb;
  if (chorus__bpe_build_merge_table(t) != CHORUS_OK) {
    chorus_bpe_free(t);
    goto nomem;
  }
  trainer_clean(&T);
  *out = t;
  return CHORUS_OK;
nomem_m:
  free(ma);
  free(mb);
nomem:
  st = chorus__bpe_fail(err, errlen, CHORUS_ERR_NO_MEMORY,
                        "chorus_bpe_train: out of memory (%zu distinct pieces, %zu pairs)",
                        T.nwords, T.npairs);
fail:
  trainer_clean(&T);
  return st;
}
