/*
 * bpe.c - GPT-2's byte-level BPE tokenizer, the object: its ids, the bytes
 * of its tokens and the ranks of its merges, GPT-2's byte alphabet, and
 * the pieces its other files share (errors, a set of token bytes).  The
 * pre-split is bpe_scan.c, GPT-2's files bpe_files.c, encoding
 * bpe_encode.c, counting and training bpe_train.c.
 *
 * Ids.  Ids 0..255 are the single bytes, ids 256 + r the result of merge r
 * (the line r + 2 of vocab.bpe), and "<|endoftext|>", if present, the id
 * after the last merge: GPT-2's own layout (50000 merges, eot 50256), which
 * loading requires and training produces (the bytes in GPT-2's order:
 * '!'..'~', '¡'..'¬', '®'..'ÿ', then the others ascending).
 *
 * Thread-safety: a tokenizer is read-only after load/train and can be
 * shared; encoders and counters are one per thread.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/bpe_internal.h"
#include "train/runtime.h"

/* ------------------------------------------------------------ errors */

chorus_result_t chorus__bpe_fail(char *err, size_t errlen, chorus_result_t st, const char *fmt,
                                 ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (err && errlen) snprintf(err, errlen, "%s", msg);
  return chorus__train_fail(st, "%s", msg);
}

/* --------------------------------------------------- GPT-2's alphabet
 *
 * GPT-2 writes token bytes as characters: the printable bytes '!'..'~',
 * 0xA1..0xAC and 0xAE..0xFF as the code point of the same number, every
 * other byte b as U+0100 + (its position among the others). */

static int printable_byte(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* byte -> code point, and GPT-2's order of the bytes (ids 0..255). */
void chorus__bpe_alphabet(uint16_t b2u[256], uint8_t order[256]) {
  int k = 0, other = 0;
  for (int b = 0; b < 256; b++)
    if (printable_byte(b)) b2u[b] = (uint16_t)b, order[k++] = (uint8_t)b;
  for (int b = 0; b < 256; b++)
    if (!printable_byte(b)) b2u[b] = (uint16_t)(256 + other++), order[k++] = (uint8_t)b;
}

/* ------------------------------------------------------ the tokenizer */

void chorus_bpe_free(chorus_bpe_t *t) {
  if (!t) return;
  free(t->blob);
  free(t->off);
  free(t->ma);
  free(t->mb);
  free(t->mtab);
  free(t);
}

int chorus_bpe_vocab(const chorus_bpe_t *t) { return t ? t->nids : 0; }
int chorus_bpe_eot(const chorus_bpe_t *t) { return t ? t->eot : -1; }

const unsigned char *chorus_bpe_token(const chorus_bpe_t *t, int id, size_t *len) {
  if (!t || id < 0 || id >= t->nids) {
    if (len) *len = 0;
    return NULL;
  }
  if (len) *len = t->off[id + 1] - t->off[id];
  return t->blob + t->off[id];
}

/* Fills the merge table of t (t->nmerges, ma, mb set).  Duplicate pairs
 * were rejected by the caller. */
chorus_result_t chorus__bpe_build_merge_table(chorus_bpe_t *t) {
  size_t size = 16;
  int bits = 4;
  while (size < 2 * (size_t)t->nmerges + 2) size *= 2, bits++;
  t->mtab = malloc(size * sizeof *t->mtab);
  if (!t->mtab) return CHORUS_ERR_NO_MEMORY;
  for (size_t i = 0; i < size; i++) t->mtab[i].key = UINT64_MAX, t->mtab[i].rank = NO_RANK;
  t->mmask = size - 1;
  t->mshift = 64 - bits;
  for (int r = 0; r < t->nmerges; r++) {
    uint64_t k = (uint64_t)t->ma[r] << 32 | t->mb[r];
    size_t i = (size_t)((k * 0x9e3779b97f4a7c15ull) >> t->mshift);
    while (t->mtab[i].key != UINT64_MAX && t->mtab[i].key != k) i = (i + 1) & t->mmask;
    if (t->mtab[i].key == k) return CHORUS_ERR_INTERNAL;
    t->mtab[i].key = k;
    t->mtab[i].rank = (uint32_t)r;
  }
  return CHORUS_OK;
}

/* ---------------------------------------------- a set of token bytes */

int chorus__bpe_tokset_init(tokset_t *s, size_t expect) {
  size_t size = 64;
  while (size < 2 * expect) size *= 2;
  s->slot = calloc(size, sizeof *s->slot);
  s->mask = size - 1;
  s->used = 0;
  return s->slot ? 0 : -1;
}

/* The id whose bytes are p[0..n), or -1. */
long chorus__bpe_tokset_find(const tokset_t *s, const uint8_t *blob, const size_t *off,
                             const uint8_t *p, size_t n) {
  for (size_t i = chorus__bpe_hash_bytes(p, n) & s->mask;; i = (i + 1) & s->mask) {
    uint32_t v = s->slot[i];
    if (!v) return -1;
    uint32_t id = v - 1;
    if (off[id + 1] - off[id] == n && !memcmp(blob + off[id], p, n)) return id;
  }
}

/* Adds id (whose bytes are not yet in the set). */
int chorus__bpe_tokset_add(tokset_t *s, const uint8_t *blob, const size_t *off, uint32_t id) {
  if (2 * (s->used + 1) > s->mask + 1) {
    size_t size = 2 * (s->mask + 1);
    uint32_t *ns = calloc(size, sizeof *ns);
    if (!ns) return -1;
    for (size_t i = 0; i <= s->mask; i++) {
      uint32_t v = s->slot[i];
      if (!v) continue;
      size_t j = chorus__bpe_hash_bytes(blob + off[v - 1], off[v] - off[v - 1]) & (size - 1);
      while (ns[j]) j = (j + 1) & (size - 1);
      ns[j] = v;
    }
    free(s->slot);
    s->slot = ns;
    s->mask = size - 1;
  }
  size_t i = chorus__bpe_hash_bytes(blob + off[id], off[id + 1] - off[id]) & s->mask;
  while (s->slot[i]) i = (i + 1) & s->mask;
  s->slot[i] = id + 1;
  s->used++;
  return 0;
}
