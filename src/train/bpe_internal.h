/*
 * bpe_internal.h - what the files of the tokenizer share and nothing else
 * includes (private to src/train/bpe*.c): the tokenizer's layout, the
 * limits more than one of them checks, a set of token bytes, hashing, and
 * the steps one file runs for another.
 *
 * The files: bpe.c (the tokenizer object and GPT-2's byte alphabet),
 * bpe_scan.c (the pre-split), bpe_files.c (encoder.json and vocab.bpe),
 * bpe_encode.c (encoding, with its caches), bpe_train.c (counting and
 * training).  bpe.h holds what the tests use as well.
 */
#ifndef CHORUS_TRAIN_BPE_INTERNAL_H
#define CHORUS_TRAIN_BPE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "chorus_train.h"
#include "train/bpe.h"

/* Limits on what is loaded and trained (each file has its own as well). */
#define BPE_MAX_VOCAB (1 << 22)       /* ids of a vocabulary */
#define BPE_MAX_TOKEN 1024            /* bytes of one token */
#define BPE_EOT "<|endoftext|>"
#define NO_RANK UINT32_MAX

/* ---- the tokenizer (bpe.c) */

typedef struct {
  uint64_t key; /* left id << 32 | right id; UINT64_MAX: empty */
  uint32_t rank;
} merge_slot_t;

struct chorus_bpe {
  int nids, nmerges, eot;
  uint32_t byte_id[256];  /* byte -> id (0..255) */
  uint8_t *blob;          /* the bytes of every token, id order */
  size_t *off;            /* token id: blob[off[id] .. off[id + 1]) */
  uint32_t *ma, *mb;      /* merge r joins ma[r] and mb[r] into id 256 + r */
  merge_slot_t *mtab;     /* (left, right) -> rank */
  size_t mmask;
  int mshift;
};

/* Fills the merge table of t (t->nmerges, ma, mb set).  Duplicate pairs
 * were rejected by the caller. */
chorus_result_t chorus__bpe_build_merge_table(chorus_bpe_t *t);

/* Records the failure (chorus__train_fail) and copies its message to err
 * (errlen bytes; may be NULL); returns st. */
chorus_result_t chorus__bpe_fail(char *err, size_t errlen, chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* GPT-2's alphabet: byte -> code point, and GPT-2's order of the bytes
 * (ids 0..255). */
void chorus__bpe_alphabet(uint16_t b2u[256], uint8_t order[256]);

/* ---- a set of token bytes (bpe.c) */

/* Open addressing over ids, keyed by the bytes blob[off[id]..off[id+1]);
 * used to find a token by its bytes while loading and training. */
typedef struct {
  uint32_t *slot; /* id + 1; 0 empty */
  size_t mask, used;
} tokset_t;

int chorus__bpe_tokset_init(tokset_t *s, size_t expect);
/* The id whose bytes are p[0..n), or -1. */
long chorus__bpe_tokset_find(const tokset_t *s, const uint8_t *blob, const size_t *off,
                             const uint8_t *p, size_t n);
/* Adds id (whose bytes are not yet in the set). */
int chorus__bpe_tokset_add(tokset_t *s, const uint8_t *blob, const size_t *off, uint32_t id);

/* ---- the scanner (bpe_scan.c) */

/* The character at p (p < end): its length in bytes, its class in *cls.
 * A byte that does not start a well-formed character is one "other"
 * character. */
size_t chorus__bpe_char_at(const uint8_t *p, const uint8_t *end, int *cls);

/* ---- hashing */

static inline uint64_t chorus__bpe_mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return x;
}

static inline uint64_t chorus__bpe_hash_bytes(const uint8_t *p, size_t n) {
  uint64_t h = 0x243f6a8885a308d3ull ^ ((uint64_t)n * 0x9e3779b97f4a7c15ull);
  while (n >= 8) {
    uint64_t v;
    memcpy(&v, p, 8);
    h = (h ^ v) * 0x9fb21c651e98df25ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
  return chorus__bpe_mix64(h ^ v);
}

#endif
