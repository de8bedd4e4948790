/*
 * bpe_scan.c - GPT-2's pre-split: the scanner that cuts text into the
 * pieces BPE encodes and counts, and the places where a text may be cut
 * into parts that are scanned alone.
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
 */
#include <stddef.h>
#include <stdint.h>

#include "train/bpe_internal.h"
#include "train/bpe_unicode.h"

#define BPE_MAX_PIECE (64u << 10)     /* longest piece, bytes (the file's comment) */

enum { C_OTHER = 0, C_LETTER = 1, C_NUMBER = 2, C_SPACE = 3 };

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

size_t chorus__bpe_char_at(const uint8_t *p, const uint8_t *end, int *cls) {
  return char_at(p, end, cls);
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

size_t chorus__bpe_piece_len(const uint8_t *s, const uint8_t *end) {
  return piece_len(s, end);
}
