/*
 * bpe.c - GPT-2's byte-level BPE tokenizer: the pre-split scanner, encoding
 * with a per-encoder cache, GPT-2's files (encoder.json, vocab.bpe) read
 * and written, and training a vocabulary from counted text.
 *
 * Pre-split.  GPT-2 cuts text with the regular expression
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * evaluated by Python's `regex` module.  piece_len() is that expression
 * written out as a scanner: the alternatives are tried in order at the
 * current position, each greedy; the only backtracking is \s+(?!\S), which
 * gives a run of white space minus its last character when a non-space
 * follows and the run has two or more characters (so that the last one can
 * lead the next word as " ?\p{L}+" does), otherwise the whole run.  Only
 * U+0020 is the optional leading space.  The classes of characters come
 * from bpe_unicode.h, generated from the regex module itself.  A byte that
 * does not start a well-formed UTF-8 sequence (overlong forms, surrogates,
 * beyond U+10FFFF, truncated sequences, stray continuation bytes) is one
 * character of class "other", one byte long: what Python's decoder with
 * errors='surrogateescape' makes of it (a lone surrogate, which the pattern
 * classes as neither letter, number nor space).  One departure, for
 * memory: a run that would make a piece of more than BPE_MAX_PIECE bytes
 * (64 KiB of letters, digits, other characters or white space with no
 * change of class: no text a person wrote) is cut into pieces of that many
 * bytes, at a character's start (exact BPE of a piece needs 44 bytes of
 * state per byte: 2 GB for 48 MiB without white space).
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
 *
 * Ids.  Ids 0..255 are the single bytes, ids 256 + r the result of merge r
 * (the line r + 2 of vocab.bpe), and "<|endoftext|>", if present, the id
 * after the last merge: GPT-2's own layout (50000 merges, eot 50256), which
 * loading requires and training produces (the bytes in GPT-2's order:
 * '!'..'~', '¡'..'¬', '®'..'ÿ', then the others ascending).
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
 *
 * Thread-safety: a tokenizer is read-only after load/train and can be
 * shared; encoders and counters are one per thread.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "chorus_train.h"
#include "train/bpe.h"
#include "train/runtime.h"
#include "train/bpe_unicode.h"

/* gpt.c's error recorder (one per thread). */

/* Limits on what is loaded, trained and cached. */
#define BPE_MAX_VOCAB (1 << 22)       /* ids of a vocabulary */
#define BPE_MAX_TOKEN 1024            /* bytes of one token */
#define BPE_MAX_FILE (256u << 20)     /* bytes of encoder.json or vocab.bpe */
#define BPE_SHORT 128                 /* longer pieces use the heap */
#define BPE_MAX_PIECE (64u << 10)     /* longest piece, bytes (the file's comment) */
#define BPE_CACHE_SLOTS (1u << 16)    /* cache entries (at most half used) */
#define BPE_CACHE_PIECE 64            /* longest piece cached, bytes */
#define BPE_CACHE_ARENA (2u << 20)    /* cached pieces and tokens, bytes */
#define BPE_HOT_SLOTS 8192            /* first-level cache entries */
#define BPE_EOT "<|endoftext|>"
#define NO_RANK UINT32_MAX

enum { C_OTHER = 0, C_LETTER = 1, C_NUMBER = 2, C_SPACE = 3 };

/* ------------------------------------------------------------ errors */

static chorus_result_t bpe_fail(char *err, size_t errlen, chorus_result_t st, const char *fmt,
                                ...) __attribute__((format(printf, 4, 5)));
static chorus_result_t bpe_fail(char *err, size_t errlen, chorus_result_t st, const char *fmt,
                                ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (err && errlen) snprintf(err, errlen, "%s", msg);
  return chorus__train_fail(st, "%s", msg);
}

/* ------------------------------------------------------------ hashing */

static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return x;
}

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
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
  return mix64(h ^ v);
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
static void alphabet(uint16_t b2u[256], uint8_t order[256]) {
  int k = 0, other = 0;
  for (int b = 0; b < 256; b++)
    if (printable_byte(b)) b2u[b] = (uint16_t)b, order[k++] = (uint8_t)b;
  for (int b = 0; b < 256; b++)
    if (!printable_byte(b)) b2u[b] = (uint16_t)(256 + other++), order[k++] = (uint8_t)b;
}

#define ALPHABET_END 0x144 /* 256 + 68 other bytes */

/* code point -> byte, -1 outside the alphabet. */
static void alphabet_inverse(int16_t u2b[ALPHABET_END]) {
  uint16_t b2u[256];
  uint8_t order[256];
  alphabet(b2u, order);
  for (int c = 0; c < ALPHABET_END; c++) u2b[c] = -1;
  for (int b = 0; b < 256; b++) u2b[b2u[b]] = (int16_t)b;
}

/* ------------------------------------------------------ the scanner */

static const uint8_t k_ascii_class[128] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0, 0,  /* \t \n \v \f \r */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  /* not \x1c..\x1f */
    3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  /* ' ' */
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0,  /* 0-9 */
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  /* A-O */
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,  /* P-Z */
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  /* a-o */
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0}; /* p-z */

static inline int class_of(uint32_t cp) {
  return (bpe_uni_stage2[bpe_uni_stage1[cp >> 8]][(cp & 255) >> 2] >> (2 * (cp & 3))) & 3;
}

/* The well-formed UTF-8 character at p (p < end; Unicode's table 3-7): its
 * length in bytes and code point, or 0 when p does not start one. */
static inline size_t utf8_char(const uint8_t *p, const uint8_t *end, uint32_t *cp) {
  uint8_t c = p[0];
  size_t avail = (size_t)(end - p);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  if (c >= 0xC2 && c <= 0xDF) {
    if (avail < 2 || (p[1] & 0xC0) != 0x80) return 0;
    *cp = (uint32_t)(c & 0x1F) << 6 | (p[1] & 0x3F);
    return 2;
  }
  if (c >= 0xE0 && c <= 0xEF) {
    uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    if (avail < 3 || p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80) return 0;
    *cp = (uint32_t)(c & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F);
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    if (avail < 4 || p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80)
      return 0;
    *cp = (uint32_t)(c & 0x07) << 18 | (uint32_t)(p[1] & 0x3F) << 12 |
          (uint32_t)(p[2] & 0x3F) << 6 | (p[3] & 0x3F);
    return 4;
  }
  return 0;
}

/* The character at p (p < end): its length in bytes, its class in *cls.
 * A byte that does not start a well-formed character is one "other"
 * character. */
static inline size_t char_at(const uint8_t *p, const uint8_t *end, int *cls) {
  if (p[0] < 0x80) {
    *cls = k_ascii_class[p[0]];
    return 1;
  }
  uint32_t cp;
  size_t n = utf8_char(p, end, &cp);
  if (!n) {
    *cls = C_OTHER;
    return 1;
  }
  *cls = class_of(cp);
  return n;
}

size_t chorus_utf8_check(const void *text, size_t len) {
  const uint8_t *s = text, *end = s + len;
  uint32_t cp;
  for (const uint8_t *p = s; p < end;) {
    size_t n = utf8_char(p, end, &cp);
    if (!n) return (size_t)(p - s);
    p += n;
  }
  return len;
}

size_t chorus_bpe_cut(const void *text, size_t len, size_t from) {
  const uint8_t *s = text;
  for (size_t p = from ? from : 1; p < len; p++) {
    if (s[p] >= 0x80 || k_ascii_class[s[p]] != C_SPACE) continue;
    /* The character that ends at p - 1: ASCII, or a well-formed sequence
     * whose lead byte is at most 3 bytes back. */
    if (s[p - 1] < 0x80) {
      if (k_ascii_class[s[p - 1]] != C_SPACE) return p;
      continue;
    }
    size_t q = p - 1;
    while (q > 0 && p - q < 4 && (s[q] & 0xC0) == 0x80) q--;
    uint32_t cp = 0;
    if (utf8_char(s + q, s + p, &cp) == p - q && class_of(cp) != C_SPACE) return p;
  }
  return len;
}

static size_t piece_len(const uint8_t *s, const uint8_t *full_end);

/* Not every boundary is a place to cut: a piece of white space that ends
 * before BPE_MAX_PIECE ended where it did because of what follows it
 * (\s+(?!\S) gives the run less its last character, and a run's last
 * character is a piece of its own), so the text cut after it has one
 * longer run there.  After any other piece -- it ends with a character
 * that is not white space, or at the cap -- the scan of the text cut there
 * stops where the whole text's did. */
size_t chorus_bpe_cut_pieces(const void *text, size_t len, size_t start, size_t from) {
  const uint8_t *s = text, *end = s + len;
  if (start >= from) return start < len ? start : len;
  for (size_t p = start; p < len;) {
    size_t n = piece_len(s + p, end);
    int k, k2 = C_OTHER;
    size_t m = char_at(s + p, end, &k);
    if (k == C_SPACE && m < n) char_at(s + p + m, end, &k2);
    int space = k == C_SPACE && (m == n || k2 == C_SPACE);
    p += n;
    if (p >= from && (!space || n >= BPE_MAX_PIECE)) return p < len ? p : len;
  }
  return len;
}

/* The length in bytes of the piece that starts at s (s < end). */
static size_t piece_len(const uint8_t *s, const uint8_t *full_end) {
  /* Runs stop at BPE_MAX_PIECE bytes (with the character that crosses
   * it): the scan of a piece never reads much further, whatever the run's
   * length.  Characters are decoded up to the text's end. */
  const uint8_t *end = full_end - s > (ptrdiff_t)BPE_MAX_PIECE ? s + BPE_MAX_PIECE : full_end;
  const uint8_t *p = s;
  int k;
  /* 's 't 're 've 'm 'll 'd */
  if (*p == '\'' && end - p >= 2) {
    uint8_t c1 = p[1];
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
    if (end - p >= 3) {
      uint8_t c2 = p[2];
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        return 3;
    }
  }
  size_t n = char_at(p, full_end, &k);
  /* " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+" with the space */
  if (*p == ' ' && end - p >= 2) {
    int k1;
    size_t n1 = char_at(p + 1, full_end, &k1);
    if (k1 != C_SPACE) {
      k = k1;
      p += 1 + n1;
      goto run;
    }
  }
  if (k != C_SPACE) {
    p += n;
    goto run;
  }
  /* "\s+(?!\S)", else "\s+" */
  {
    const uint8_t *last = p;
    p += n;
    while (p < end) {
      int kk;
      size_t m = char_at(p, full_end, &kk);
      if (kk != C_SPACE) break;
      last = p;
      p += m;
    }
    /* At the text's end, or at the cap (a piece of its own): the run. */
    if (p >= end || last == s) return (size_t)(p - s);
    return (size_t)(last - s);
  }
run:
  while (p < end) {
    uint8_t c = *p;
    if (c < 0x80) {
      if (k_ascii_class[c] != k) break;
      p++;
      continue;
    }
    int kk;
    size_t m = char_at(p, full_end, &kk);
    if (kk != k) break;
    p += m;
  }
  return (size_t)(p - s);
}

size_t chorus__bpe_piece_len(const uint8_t *s, const uint8_t *end) { return piece_len(s, end); }

/* ------------------------------------------------------ the tokenizer */

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

static inline uint32_t rank_of(const chorus_bpe_t *t, uint32_t a, uint32_t b) {
  uint64_t k = (uint64_t)a << 32 | b;
  size_t i = (size_t)((k * 0x9e3779b97f4a7c15ull) >> t->mshift);
  for (;; i = (i + 1) & t->mmask) {
    if (t->mtab[i].key == k) return t->mtab[i].rank;
    if (t->mtab[i].key == UINT64_MAX) return NO_RANK;
  }
}

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
static chorus_result_t build_merge_table(chorus_bpe_t *t) {
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

/* Open addressing over ids, keyed by the bytes blob[off[id]..off[id+1]);
 * used to find a token by its bytes while loading and training. */
typedef struct {
  uint32_t *slot; /* id + 1; 0 empty */
  size_t mask, used;
} tokset_t;

static int tokset_init(tokset_t *s, size_t expect) {
  size_t size = 64;
  while (size < 2 * expect) size *= 2;
  s->slot = calloc(size, sizeof *s->slot);
  s->mask = size - 1;
  s->used = 0;
  return s->slot ? 0 : -1;
}

/* The id whose bytes are p[0..n), or -1. */
static long tokset_find(const tokset_t *s, const uint8_t *blob, const size_t *off,
                        const uint8_t *p, size_t n) {
  for (size_t i = hash_bytes(p, n) & s->mask;; i = (i + 1) & s->mask) {
    uint32_t v = s->slot[i];
    if (!v) return -1;
    uint32_t id = v - 1;
    if (off[id + 1] - off[id] == n && !memcmp(blob + off[id], p, n)) return id;
  }
}

/* Adds id (whose bytes are not yet in the set). */
static int tokset_add(tokset_t *s, const uint8_t *blob, const size_t *off, uint32_t id) {
  if (2 * (s->used + 1) > s->mask + 1) {
    size_t size = 2 * (s->mask + 1);
    uint32_t *ns = calloc(size, sizeof *ns);
    if (!ns) return -1;
    for (size_t i = 0; i <= s->mask; i++) {
      uint32_t v = s->slot[i];
      if (!v) continue;
      size_t j = hash_bytes(blob + off[v - 1], off[v] - off[v - 1]) & (size - 1);
      while (ns[j]) j = (j + 1) & (size - 1);
      ns[j] = v;
    }
    free(s->slot);
    s->slot = ns;
    s->mask = size - 1;
  }
  size_t i = hash_bytes(blob + off[id], off[id + 1] - off[id]) & s->mask;
  while (s->slot[i]) i = (i + 1) & s->mask;
  s->slot[i] = id + 1;
  s->used++;
  return 0;
}

/* ------------------------------------------------------ loading files */

/* Reads all of path (at most BPE_MAX_FILE bytes) into a malloc'd buffer
 * with a NUL after it. */
static chorus_result_t read_file(const char *path, char **out, size_t *len, char *err,
                                 size_t errlen) {
  struct stat st;
  int fd = chorus__open_regular(path, &st);
  if (fd == -1)
    return bpe_fail(err, errlen, CHORUS_ERR_SYSTEM,
                    "chorus_bpe_load: cannot open %s: %s (a tokenizer directory holds GPT-2's "
                    "encoder.json and vocab.bpe)",
                    path, strerror(errno));
  if (fd < 0 || (uint64_t)st.st_size > BPE_MAX_FILE) {
    if (fd >= 0) close(fd);
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                    "chorus_bpe_load: %s is not a regular file of at most %u MiB", path,
                    BPE_MAX_FILE >> 20);
  }
  size_t cap = (size_t)st.st_size, n = 0;
  char *buf = malloc(cap + 1);
  if (!buf) {
    close(fd);
    return bpe_fail(err, errlen, CHORUS_ERR_NO_MEMORY, "chorus_bpe_load: %s: out of memory",
                    path);
  }
  while (n < cap) {
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      free(buf);
      close(fd);
      return bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_load: reading %s: %s", path,
                      strerror(e));
    }
    if (r == 0) break; /* shrank while we read: take what is there */
    n += (size_t)r;
  }
  close(fd);
  buf[n] = '\0';
  *out = buf;
  *len = n;
  return CHORUS_OK;
}

/* Decodes one UTF-8 character of well-formed text (jansson checked it);
 * returns its length. */
static size_t utf8_decode(const uint8_t *p, uint32_t *cp) {
  if (p[0] < 0x80) return *cp = p[0], 1;
  if (p[0] < 0xE0) return *cp = (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F), 2;
  if (p[0] < 0xF0)
    return *cp = (uint32_t)(p[0] & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F), 3;
  return *cp = (uint32_t)(p[0] & 0x07) << 18 | (uint32_t)(p[1] & 0x3F) << 12 |
               (uint32_t)(p[2] & 0x3F) << 6 | (p[3] & 0x3F),
         4;
}

/* Turns GPT-2's spelling (n bytes of UTF-8 at s) of a token into its
 * bytes (out, at most BPE_MAX_TOKEN).  Returns the number of bytes, or -1
 * with the offending code point in *bad (UINT32_MAX: too long). */
static long unspell(const int16_t *u2b, const uint8_t *s, size_t n, uint8_t *out, uint32_t *bad) {
  size_t o = 0;
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    size_t m = utf8_decode(s + i, &cp);
    if (i + m > n || cp >= ALPHABET_END || u2b[cp] < 0) {
      *bad = i + m > n ? 0xFFFD : cp;
      return -1;
    }
    if (o == BPE_MAX_TOKEN) {
      *bad = UINT32_MAX;
      return -1;
    }
    out[o++] = (uint8_t)u2b[cp];
    i += m;
  }
  return (long)o;
}

/* A key of encoder.json for a message: as written, cut to about 40 bytes
 * at a character boundary. */
static const char *show_key(const char *k, char *buf, size_t cap) {
  size_t n = strlen(k), i = 0;
  while (i < n && i < 40 && i + 5 < cap) {
    size_t m = 1;
    while (i + m < n && ((uint8_t)k[i + m] & 0xC0) == 0x80) m++;
    if (i + m + 1 >= cap) break;
    memcpy(buf + i, k + i, m);
    i += m;
  }
  buf[i] = '\0';
  if (i < n) strcat(buf, "...");
  return buf;
}

typedef struct {
  char *ejson, *vbpe;  /* file contents */
  json_t *root;
  uint8_t *blob;
  size_t *off;
  uint32_t *ma, *mb;
  const char **keys;   /* per id, into root */
  tokset_t set;
} load_t;

static void load_clean(load_t *L) {
  free(L->ejson);
  free(L->vbpe);
  if (L->root) json_decref(L->root);
  free(L->blob);
  free(L->off);
  free(L->ma);
  free(L->mb);
  free(L->keys);
  free(L->set.slot);
}

chorus_result_t chorus_bpe_load(const char *dir, chorus_bpe_t **out, char *err, size_t errlen) {
  if (out) *out = NULL;
  if (!dir || !out)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_load: bad arguments");
  char epath[4096], vpath[4096];
  if ((size_t)snprintf(epath, sizeof epath, "%s/encoder.json", dir) >= sizeof epath ||
      (size_t)snprintf(vpath, sizeof vpath, "%s/vocab.bpe", dir) >= sizeof vpath)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_load: path too long: %s",
                    dir);
  load_t L;
  memset(&L, 0, sizeof L);
  chorus_result_t st;
  size_t elen, vlen;
  char sb[64], sb2[64];
  uint8_t tmp[BPE_MAX_TOKEN];
  int16_t u2b[ALPHABET_END];
  alphabet_inverse(u2b);
  if ((st = read_file(epath, &L.ejson, &elen, err, errlen)) != CHORUS_OK) goto fail;
  if ((st = read_file(vpath, &L.vbpe, &vlen, err, errlen)) != CHORUS_OK) goto fail;

  /* encoder.json: {"token": id, ...} */
  json_error_t jerr;
  L.root = json_loadb(L.ejson, elen, JSON_REJECT_DUPLICATES, &jerr);
  if (!L.root) {
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                  "chorus_bpe_load: %s line %d column %d (byte %d): %s (expected GPT-2's "
                  "encoder.json: one JSON object of token -> id)",
                  epath, jerr.line, jerr.column, jerr.position, jerr.text);
    goto fail;
  }
  if (!json_is_object(L.root)) {
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                  "chorus_bpe_load: %s is not a JSON object (expected token -> id)", epath);
    goto fail;
  }
  size_t nids = json_object_size(L.root);
  if (nids < 256 || nids > BPE_MAX_VOCAB) {
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                  "chorus_bpe_load: %s has %zu tokens; a vocabulary has 256..%d (the 256 bytes, "
                  "the merges, <|endoftext|>)",
                  epath, nids, BPE_MAX_VOCAB);
    goto fail;
  }
  L.keys = calloc(nids, sizeof *L.keys);
  L.off = calloc(nids + 1, sizeof *L.off);
  if (!L.keys || !L.off) goto nomem;
  size_t blen = 0;
  int eot = -1;
  {
    const char *key;
    json_t *val;
    json_object_foreach(L.root, key, val) {
      json_int_t id = json_is_integer(val) ? json_integer_value(val) : -1;
      if (id < 0 || (size_t)id >= nids) {
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s: token \"%s\" has id %s%lld; with %zu tokens the ids "
                      "must be the integers 0..%zu, each once",
                      epath, show_key(key, sb, sizeof sb), json_is_integer(val) ? "" : "(not an integer) ",
                      (long long)(json_is_integer(val) ? id : 0), nids, nids - 1);
        goto fail;
      }
      if (L.keys[id]) {
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s: id %lld is given to both \"%s\" and \"%s\" (each id "
                      "must name one token)",
                      epath, (long long)id, show_key(L.keys[id], sb, sizeof sb),
                      show_key(key, sb2, sizeof sb2));
        goto fail;
      }
      L.keys[id] = key;
      if (!strcmp(key, BPE_EOT)) {
        eot = (int)id;
        blen += strlen(BPE_EOT);
        continue;
      }
      uint32_t bad;
      long n = unspell(u2b, (const uint8_t *)key, strlen(key), tmp, &bad);
      if (n < 0) {
        if (bad == UINT32_MAX)
          st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                        "chorus_bpe_load: %s: token \"%s\" (id %lld) is longer than %d bytes",
                        epath, show_key(key, sb, sizeof sb), (long long)id, BPE_MAX_TOKEN);
        else
          st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                        "chorus_bpe_load: %s: token \"%s\" (id %lld) has the character U+%04X, "
                        "which is not in GPT-2's byte alphabet (tokens are written one "
                        "character per byte)",
                        epath, show_key(key, sb, sizeof sb), (long long)id, bad);
        goto fail;
      }
      if (n == 0) {
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s: the empty token has id %lld (tokens have 1 or more "
                      "bytes)",
                      epath, (long long)id);
        goto fail;
      }
      blen += (size_t)n;
    }
  }
  /* The bytes of every token, in id order. */
  L.blob = malloc(blen + 1);
  if (!L.blob || tokset_init(&L.set, nids)) goto nomem;
  blen = 0;
  for (size_t id = 0; id < nids; id++) {
    L.off[id] = blen;
    uint32_t bad;
    long n;
    if ((int)id == eot) {
      n = (long)strlen(BPE_EOT);
      memcpy(tmp, BPE_EOT, (size_t)n);
    } else {
      n = unspell(u2b, (const uint8_t *)L.keys[id], strlen(L.keys[id]), tmp, &bad);
    }
    memcpy(L.blob + blen, tmp, (size_t)n);
    blen += (size_t)n;
  }
  L.off[nids] = blen;
  for (size_t id = 0; id < nids; id++)
    if ((int)id != eot && tokset_add(&L.set, L.blob, L.off, (uint32_t)id)) goto nomem;

  /* Ids 0..255: the 256 bytes. */
  uint32_t byte_id[256];
  int have[256] = {0};
  for (int id = 0; id < 256; id++) {
    size_t n = L.off[id + 1] - L.off[id];
    if (id == eot || n != 1) {
      st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                    "chorus_bpe_load: %s: id %d is \"%s\", but ids 0..255 must be the 256 single "
                    "bytes (GPT-2's layout)",
                    epath, id, show_key(L.keys[id], sb, sizeof sb));
      goto fail;
    }
    uint8_t b = L.blob[L.off[id]];
    have[b] = 1;
    byte_id[b] = (uint32_t)id;
  }
  for (int b = 0; b < 256; b++)
    if (!have[b]) {
      st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                    "chorus_bpe_load: %s: byte 0x%02x has no token among ids 0..255 (every byte "
                    "needs one)",
                    epath, b);
      goto fail;
    }

  /* vocab.bpe: "#version..." then one merge "a b" per line. */
  size_t maxm = nids - 256;
  L.ma = malloc((maxm + 1) * sizeof *L.ma);
  L.mb = malloc((maxm + 1) * sizeof *L.mb);
  if (!L.ma || !L.mb) goto nomem;
  int nm = 0;
  {
    char *p = L.vbpe, *end = L.vbpe + vlen;
    char *nl = memchr(p, '\n', vlen);
    if (vlen == 0 || *p != '#' || !nl) {
      st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                    "chorus_bpe_load: %s line 1: expected a \"#version: ...\" line (GPT-2's "
                    "vocab.bpe: a version line, then one merge \"a b\" per line)",
                    vpath);
      goto fail;
    }
    p = nl + 1;
    for (long line = 2; p < end; line++) {
      nl = memchr(p, '\n', (size_t)(end - p));
      char *le = nl ? nl : end;
      char *sp = memchr(p, ' ', (size_t)(le - p));
      if (!sp || sp == p || sp + 1 == le || memchr(sp + 1, ' ', (size_t)(le - sp - 1)) ||
          memchr(p, '\0', (size_t)(le - p))) {
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s line %ld: expected two tokens separated by one space",
                      vpath, line);
        goto fail;
      }
      /* The parts are GPT-2 spellings: UTF-8 first, then the alphabet. */
      uint32_t ids[2];
      char *part[2] = {p, sp + 1};
      size_t plen[2] = {(size_t)(sp - p), (size_t)(le - sp - 1)};
      for (int k = 0; k < 2; k++) {
        int ok = 1;
        for (size_t i = 0; ok && i < plen[k];) {
          int cls;
          size_t m = char_at((const uint8_t *)part[k] + i, (const uint8_t *)part[k] + plen[k], &cls);
          if (m == 1 && (uint8_t)part[k][i] >= 0x80) ok = 0;
          i += m;
        }
        uint32_t bad = 0;
        long n = ok ? unspell(u2b, (const uint8_t *)part[k], plen[k], tmp, &bad) : -1;
        long id = n > 0 ? tokset_find(&L.set, L.blob, L.off, tmp, (size_t)n) : -1;
        if (id < 0) {
          char cut[64];
          size_t cl = plen[k] < 40 ? plen[k] : 40;
          memcpy(cut, part[k], cl);
          cut[cl] = '\0';
          st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                        "chorus_bpe_load: %s line %ld: \"%s\" %s", vpath, line,
                        show_key(cut, sb, sizeof sb),
                        !ok ? "is not UTF-8"
                        : n < 0 ? "is not written in GPT-2's byte alphabet"
                                : "is not a token of encoder.json (both parts of a merge must be)");
          goto fail;
        }
        ids[k] = (uint32_t)id;
      }
      if ((size_t)nm == maxm) {
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s line %ld: more merges than %s has tokens for (%zu "
                      "tokens: 256 bytes + at most %zu merges)",
                      vpath, line, epath, nids, maxm);
        goto fail;
      }
      /* The result must be the token with id 256 + rank. */
      uint32_t want = 256 + (uint32_t)nm;
      size_t la = L.off[ids[0] + 1] - L.off[ids[0]], lb = L.off[ids[1] + 1] - L.off[ids[1]];
      int same = (int)want != eot && L.off[want + 1] - L.off[want] == la + lb &&
                 !memcmp(L.blob + L.off[want], L.blob + L.off[ids[0]], la) &&
                 !memcmp(L.blob + L.off[want] + la, L.blob + L.off[ids[1]], lb);
      if (!same) {
        long got = -1;
        if (la + lb <= BPE_MAX_TOKEN) {
          memcpy(tmp, L.blob + L.off[ids[0]], la);
          memcpy(tmp + la, L.blob + L.off[ids[1]], lb);
          got = tokset_find(&L.set, L.blob, L.off, tmp, la + lb);
        }
        char whats[64];
        if (got < 0)
          snprintf(whats, sizeof whats, "is not in %s", "encoder.json");
        else
          snprintf(whats, sizeof whats, "has id %ld there", got);
        st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                      "chorus_bpe_load: %s line %ld: merge %d joins ids %u and %u into a token "
                      "that %s; it must be id %u (merge r makes id 256 + r, as in GPT-2's files)",
                      vpath, line, nm, ids[0], ids[1], whats, want);
        goto fail;
      }
      L.ma[nm] = ids[0];
      L.mb[nm] = ids[1];
      nm++;
      if (!nl) break;
      p = nl + 1;
    }
  }
  size_t want_ids = 256 + (size_t)nm + (eot >= 0);
  if (nids != want_ids || (eot >= 0 && eot != 256 + nm)) {
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                  "chorus_bpe_load: %s has %zu tokens%s but %s has %d merges: expected 256 "
                  "bytes, ids 256..%d for the merges and %s (check that both files belong to "
                  "the same vocabulary)",
                  epath, nids, eot >= 0 ? " (with <|endoftext|>)" : "", vpath, nm, 255 + nm,
                  eot >= 0 ? "then <|endoftext|>" : "nothing else");
    goto fail;
  }

  chorus_bpe_t *t = calloc(1, sizeof *t);
  if (!t) goto nomem;
  t->nids = (int)nids;
  t->nmerges = nm;
  t->eot = eot;
  memcpy(t->byte_id, byte_id, sizeof byte_id);
  t->blob = L.blob, L.blob = NULL;
  t->off = L.off, L.off = NULL;
  t->ma = L.ma, L.ma = NULL;
  t->mb = L.mb, L.mb = NULL;
  if (build_merge_table(t) != CHORUS_OK) {
    chorus_bpe_free(t);
    goto nomem;
  }
  load_clean(&L);
  *out = t;
  return CHORUS_OK;
nomem:
  st = bpe_fail(err, errlen, CHORUS_ERR_NO_MEMORY, "chorus_bpe_load: %s: out of memory", dir);
fail:
  load_clean(&L);
  return st;
}

/* ------------------------------------------------------ saving files */

/* Writes a token as GPT-2 spells it; json: as a JSON string body with
 * everything outside ' '..'~' escaped the way Python's json.dump does. */
static void put_spelling(FILE *f, const uint8_t *p, size_t n, const uint16_t *b2u, int json) {
  for (size_t i = 0; i < n; i++) {
    uint16_t c = b2u[p[i]];
    if (json) {
      if (c == '"' || c == '\\')
        fprintf(f, "\\%c", (char)c);
      else if (c >= 0x20 && c < 0x7f)
        fputc(c, f);
      else
        fprintf(f, "\\u%04x", c);
    } else if (c < 0x80) {
      fputc(c, f);
    } else if (c < 0x800) {
      fputc(0xC0 | (c >> 6), f);
      fputc(0x80 | (c & 0x3F), f);
    } else {
      fputc(0xE0 | (c >> 12), f);
      fputc(0x80 | ((c >> 6) & 0x3F), f);
      fputc(0x80 | (c & 0x3F), f);
    }
  }
}

/* Writes path through a temporary file in the same directory. */
static chorus_result_t save_one(const chorus_bpe_t *t, const char *path, int json, char *err,
                                size_t errlen) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "wbx");
  if (!f && errno == EEXIST) {
    unlink(tmp);
    f = fopen(tmp, "wbx");
  }
  if (!f)
    return bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: cannot create %s: %s", tmp,
                    strerror(errno));
  uint16_t b2u[256];
  uint8_t order[256];
  alphabet(b2u, order);
  if (json) {
    fputc('{', f);
    for (int id = 0; id < t->nids; id++) {
      if (id) fputs(", ", f);
      fputc('"', f);
      if (id == t->eot)
        fputs(BPE_EOT, f);
      else
        put_spelling(f, t->blob + t->off[id], t->off[id + 1] - t->off[id], b2u, 1);
      fprintf(f, "\": %d", id);
    }
    fputc('}', f);
  } else {
    fputs("#version: 0.2\n", f);
    for (int r = 0; r < t->nmerges; r++) {
      uint32_t a = t->ma[r], b = t->mb[r];
      put_spelling(f, t->blob + t->off[a], t->off[a + 1] - t->off[a], b2u, 0);
      fputc(' ', f);
      put_spelling(f, t->blob + t->off[b], t->off[b + 1] - t->off[b], b2u, 0);
      fputc('\n', f);
    }
  }
  int bad = ferror(f) || fflush(f) != 0 || fsync(fileno(f)) != 0;
  int e = errno;
  if (fclose(f) != 0 && !bad) bad = 1, e = errno;
  if (!bad && rename(tmp, path) != 0) bad = 1, e = errno;
  if (bad) {
    unlink(tmp);
    return bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: writing %s: %s", path,
                    strerror(e));
  }
  return CHORUS_OK;
}

chorus_result_t chorus_bpe_save(const chorus_bpe_t *t, const char *dir, char *err,
                                size_t errlen) {
  if (!t || !dir)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_save: bad arguments");
  char path[4096];
  if (strlen(dir) > sizeof path - 32)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_save: path too long: %s",
                    dir);
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: mkdir %s: %s", dir,
                    strerror(errno));
  /* vocab.bpe first: a reader that finds the new encoder.json with the old
   * vocab.bpe (a crash in between) is told that they disagree. */
  snprintf(path, sizeof path, "%s/vocab.bpe", dir);
  chorus_result_t st = save_one(t, path, 0, err, errlen);
  if (st != CHORUS_OK) return st;
  snprintf(path, sizeof path, "%s/encoder.json", dir);
  st = save_one(t, path, 1, err, errlen);
  if (st != CHORUS_OK) return st;
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return CHORUS_OK;
}

/* ------------------------------------------------------------ encoding */

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
  uint64_t h = n <= 16 ? mix64((head ^ ((uint64_t)n << 59)) + head2 * 0x9e3779b97f4a7c15ull)
                       : hash_bytes(s, n);
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
    size_t pl = piece_len(p, end);
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
    size_t pl = piece_len(p, end);
    if (pl > UINT32_MAX)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "chorus_bpe_count: a piece of %zu bytes (at most 4 GiB; cut the "
                                "text)", pl);
    if (count_add(c, p, pl, hash_bytes(p, pl), 1))
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
  return (size_t)(mix64((uint64_t)a << 32 | b)) & mask;
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
  return tokset_add(&T->set, T->blob, T->off, (uint32_t)id);
}

chorus_result_t chorus_bpe_train(const chorus_bpe_counter_t *c, int vocab_size,
                                 chorus_bpe_t **out, char *err, size_t errlen) {
  if (out) *out = NULL;
  if (!c || !out)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_train: bad arguments");
  if (vocab_size < 257 || vocab_size > BPE_MAX_VOCAB)
    return bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
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
  alphabet(b2u, order);
  for (int i = 0; i < 256; i++) byte_id[order[i]] = (uint32_t)i;
  T.cur_a = T.cur_b = UINT32_MAX;
  T.step = 1; /* the first count; merge k (from 0) is step k + 2 */

  /* Tokens: the bytes, room for the merges and <|endoftext|>. */
  T.off = malloc(((size_t)vocab_size + 1) * sizeof *T.off);
  if (!T.off || tokset_init(&T.set, (size_t)vocab_size)) goto nomem;
  for (size_t i = 0; i < 256; i++)
    if (add_token(&T, i, &order[i], 1, NULL, 0)) goto nomem;

  /* Words. */
  size_t total = 0;
  for (size_t k = 0; k <= c->mask; k++)
    if (c->slot[k].count && c->slot[k].len >= 2) T.nwords++, total += c->slot[k].len;
  if (T.nwords >= UINT32_MAX) {
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                  "chorus_bpe_train: %zu distinct pieces (at most 4G)", T.nwords);
    goto fail;
  }
  T.wtok = malloc((total ? total : 1) * sizeof *T.wtok);
  T.wlen = malloc((T.nwords + 1) * sizeof *T.wlen);
  T.wstamp = calloc(T.nwords + 1, sizeof *T.wstamp);
  T.woff = malloc((T.nwords + 1) * sizeof *T.woff);
  T.wcnt = malloc((T.nwords + 1) * sizeof *T.wcnt);
  T.pmask = 1023;
  T.ptab = calloc(T.pmask + 1, sizeof *T.ptab);
  if (!T.wtok || !T.wlen || !T.wstamp || !T.woff || !T.wcnt || !T.ptab) goto nomem;
  {
    size_t w = 0, o = 0;
    for (size_t k = 0; k <= c->mask; k++) {
      const count_slot_t *s = &c->slot[k];
      if (!s->count || s->len < 2) continue;
      T.woff[w] = o;
      T.wlen[w] = s->len;
      T.wcnt[w] = s->count > INT64_MAX / 2 ? INT64_MAX / 2 : (int64_t)s->count;
      for (size_t i = 0; i < s->len; i++) T.wtok[o + i] = byte_id[c->arena[s->off + i]];
      for (size_t i = 0; i + 1 < s->len; i++)
        pair_add(&T, T.wtok[o + i], T.wtok[o + i + 1], T.wcnt[w], (uint32_t)w);
      o += s->len;
      w++;
    }
  }
  if (T.oom || push_touched(&T)) goto nomem;

  /* Merges. */
  size_t made = 0;
  uint8_t cat[BPE_MAX_TOKEN];
  uint32_t *ma = malloc((want + 1) * sizeof *ma), *mb = malloc((want + 1) * sizeof *mb);
  if (!ma || !mb) {
    free(ma);
    free(mb);
    goto nomem;
  }
  while (made < want && T.nheap) {
    hent_t top = hpop(&T);
    pair_t *q = &T.pairs[top.p];
    if (q->dead) continue;
    if (top.cnt != q->cnt) { /* stale: counts only fall */
      if (q->cnt > 0 && hpush(&T, top.p)) goto nomem_m;
      continue;
    }
    uint32_t a = q->a, b = q->b;
    size_t la = T.off[a + 1] - T.off[a], lb = T.off[b + 1] - T.off[b];
    q->dead = 1;
    if (la + lb > BPE_MAX_TOKEN) continue;
    memcpy(cat, T.blob + T.off[a], la);
    memcpy(cat + la, T.blob + T.off[b], lb);
    if (tokset_find(&T.set, T.blob, T.off, cat, la + lb) >= 0) continue; /* spelt already */
    uint32_t id = 256 + (uint32_t)made;
    if (add_token(&T, id, cat, la + lb, NULL, 0)) goto nomem_m;
    ma[made] = a;
    mb[made] = b;
    made++;
    T.step = (uint32_t)made + 1; /* merge made - 1 */
    T.cur_a = a;
    T.cur_b = b;
    /* q's word list is not appended to while it is merged ((a, b) gains
     * nothing), but T.pairs may move: hold the list itself. */
    uint32_t *words = q->words, nw = q->nw;
    for (uint32_t k = 0; k < nw; k++) {
      uint32_t w = words[k];
      if (T.wstamp[w] == T.step) continue;
      T.wstamp[w] = T.step;
      merge_word(&T, w, a, b, id);
    }
    q = &T.pairs[top.p];
    q->cnt = 0;
    free(q->words);
    q->words = NULL;
    q->nw = q->cw = 0;
    if (T.oom || push_touched(&T)) goto nomem_m;
  }
  if (made < want) {
    free(ma);
    free(mb);
    st = bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
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
  if (build_merge_table(t) != CHORUS_OK) {
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
  st = bpe_fail(err, errlen, CHORUS_ERR_NO_MEMORY,
                "chorus_bpe_train: out of memory (%zu distinct pieces, %zu pairs)", T.nwords,
                T.npairs);
fail:
  trainer_clean(&T);
  return st;
}
