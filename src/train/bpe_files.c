/*
 * bpe_files.c - GPT-2's files of a tokenizer: encoder.json (token -> id)
 * and vocab.bpe (the merges, in rank order) read and checked
 * (chorus_bpe_load) and written (chorus_bpe_save).
 *
 * Loading runs its readers one after the other on one load_t: the two
 * files read whole, encoder.json's tokens (each id once, each token in
 * GPT-2's alphabet), their bytes laid out in id order, ids 0..255 checked
 * to be the 256 bytes, vocab.bpe's merges (each the token with id 256 +
 * its rank), the counts of both files compared, and the tokenizer made.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "train/bpe_internal.h"
#include "train/runtime.h"

#define BPE_MAX_FILE (256u << 20)     /* bytes of encoder.json or vocab.bpe */

/* ---------------------------------------- GPT-2's alphabet, read back */

#define ALPHABET_END 0x144 /* 256 + 68 other bytes */

/* code point -> byte, -1 outside the alphabet. */
static void alphabet_inverse(int16_t u2b[ALPHABET_END]) {
  uint16_t b2u[256];
  uint8_t order[256];
  chorus__bpe_alphabet(b2u, order);
  for (int c = 0; c < ALPHABET_END; c++) u2b[c] = -1;
  for (int b = 0; b < 256; b++) u2b[b2u[b]] = (int16_t)b;
}

/* ------------------------------------------------------ loading files */

/* Reads all of path (at most BPE_MAX_FILE bytes) into a malloc'd buffer
 * with a NUL after it. */
static chorus_result_t read_file(const char *path, char **out, size_t *len, char *err,
                                 size_t errlen) {
  struct stat st;
  int fd = chorus__open_regular(path, &st);
  if (fd == -1)
    return chorus__bpe_fail(
        err, errlen, CHORUS_ERR_SYSTEM,
        "chorus_bpe_load: cannot open %s: %s (a tokenizer directory holds GPT-2's "
        "encoder.json and vocab.bpe)",
        path, strerror(errno));
  if (fd < 0 || (uint64_t)st.st_size > BPE_MAX_FILE) {
    if (fd >= 0) close(fd);
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s is not a regular file of at most %u MiB", path,
                            BPE_MAX_FILE >> 20);
  }
  size_t cap = (size_t)st.st_size, n = 0;
  char *buf = malloc(cap + 1);
  if (!buf) {
    close(fd);
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_NO_MEMORY, "chorus_bpe_load: %s: out of memory",
                            path);
  }
  while (n < cap) {
    ssize_t r = read(fd, buf + n, cap - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      free(buf);
      close(fd);
      return chorus__bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_load: reading %s: %s",
                              path, strerror(e));
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

/* What a load holds: what it frees, and what one reader passes on to the
 * next. */
typedef struct {
  char *ejson, *vbpe; /* file contents */
  json_t *root;
  uint8_t *blob;
  size_t *off;
  uint32_t *ma, *mb;
  const char **keys; /* per id, into root */
  tokset_t set;
  const char *dir, *epath, *vpath;
  char *err;
  size_t errlen;
  size_t elen, vlen; /* bytes of ejson and vbpe */
  size_t nids;       /* tokens of encoder.json */
  size_t blen;       /* bytes of them all */
  int eot;           /* the id of <|endoftext|>, or -1 */
  int nm;            /* merges of vocab.bpe */
  uint32_t byte_id[256];
  int16_t u2b[ALPHABET_END];
  uint8_t tmp[BPE_MAX_TOKEN];
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

static chorus_result_t load_nomem(const load_t *L) {
  return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_NO_MEMORY,
                          "chorus_bpe_load: %s: out of memory", L->dir);
}

/* encoder.json: {"token": id, ...}: parsed, and room for its tokens. */
static chorus_result_t parse_encoder_json(load_t *L) {
  json_error_t jerr;
  L->root = json_loadb(L->ejson, L->elen, JSON_REJECT_DUPLICATES, &jerr);
  if (!L->root)
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s line %d column %d (byte %d): %s (expected GPT-2's "
                            "encoder.json: one JSON object of token -> id)",
                            L->epath, jerr.line, jerr.column, jerr.position, jerr.text);
  if (!json_is_object(L->root))
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s is not a JSON object (expected token -> id)",
                            L->epath);
  size_t nids = json_object_size(L->root);
  if (nids < 256 || nids > BPE_MAX_VOCAB)
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s has %zu tokens; a vocabulary has 256..%d (the 256 "
                            "bytes, the merges, <|endoftext|>)",
                            L->epath, nids, BPE_MAX_VOCAB);
  L->nids = nids;
  L->keys = calloc(nids, sizeof *L->keys);
  L->off = calloc(nids + 1, sizeof *L->off);
  if (!L->keys || !L->off) return load_nomem(L);
  return CHORUS_OK;
}

/* The tokens of encoder.json: each id given once, each token written in
 * GPT-2's alphabet (or <|endoftext|>); the bytes of them all counted. */
static chorus_result_t read_encoder_tokens(load_t *L) {
  const char *epath = L->epath;
  size_t nids = L->nids;
  char sb[64], sb2[64];
  const char *key;
  json_t *val;
  json_object_foreach(L->root, key, val) {
    json_int_t id = json_is_integer(val) ? json_integer_value(val) : -1;
    if (id < 0 || (size_t)id >= nids)
      return chorus__bpe_fail(
          L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
          "chorus_bpe_load: %s: token \"%s\" has id %s%lld; with %zu tokens the "
          "ids must be the integers 0..%zu, each once",
          epath, show_key(key, sb, sizeof sb), json_is_integer(val) ? "" : "(not an integer) ",
          (long long)(json_is_integer(val) ? id : 0), nids, nids - 1);
    if (L->keys[id])
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s: id %lld is given to both \"%s\" and \"%s\" "
                              "(each id must name one token)",
                              epath, (long long)id, show_key(L->keys[id], sb, sizeof sb),
                              show_key(key, sb2, sizeof sb2));
    L->keys[id] = key;
    if (!strcmp(key, BPE_EOT)) {
      L->eot = (int)id;
      L->blen += strlen(BPE_EOT);
      continue;
    }
    uint32_t bad;
    long n = unspell(L->u2b, (const uint8_t *)key, strlen(key), L->tmp, &bad);
    if (n < 0) {
      if (bad == UINT32_MAX)
        return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                                "chorus_bpe_load: %s: token \"%s\" (id %lld) is longer than %d "
                                "bytes",
                                epath, show_key(key, sb, sizeof sb), (long long)id, BPE_MAX_TOKEN);
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s: token \"%s\" (id %lld) has the character "
                              "U+%04X, which is not in GPT-2's byte alphabet (tokens are written "
                              "one character per byte)",
                              epath, show_key(key, sb, sizeof sb), (long long)id, bad);
    }
    if (n == 0)
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s: the empty token has id %lld (tokens have 1 or "
                              "more bytes)",
                              epath, (long long)id);
    L->blen += (size_t)n;
  }
  return CHORUS_OK;
}

/* The bytes of every token, in id order, and the set of them. */
static chorus_result_t lay_out_tokens(load_t *L) {
  size_t nids = L->nids, blen;
  int eot = L->eot;
  L->blob = malloc(L->blen + 1);
  if (!L->blob || chorus__bpe_tokset_init(&L->set, nids)) return load_nomem(L);
  blen = 0;
  for (size_t id = 0; id < nids; id++) {
    L->off[id] = blen;
    uint32_t bad;
    long n;
    if ((int)id == eot) {
      n = (long)strlen(BPE_EOT);
      memcpy(L->tmp, BPE_EOT, (size_t)n);
    } else {
      n = unspell(L->u2b, (const uint8_t *)L->keys[id], strlen(L->keys[id]), L->tmp, &bad);
    }
    memcpy(L->blob + blen, L->tmp, (size_t)n);
    blen += (size_t)n;
  }
  L->off[nids] = blen;
  L->blen = blen;
  for (size_t id = 0; id < nids; id++)
    if ((int)id != eot && chorus__bpe_tokset_add(&L->set, L->blob, L->off, (uint32_t)id))
      return load_nomem(L);
  return CHORUS_OK;
}

/* Ids 0..255: the 256 bytes. */
static chorus_result_t check_byte_ids(load_t *L) {
  char sb[64];
  int have[256] = {0};
  for (int id = 0; id < 256; id++) {
    size_t n = L->off[id + 1] - L->off[id];
    if (id == L->eot || n != 1)
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s: id %d is \"%s\", but ids 0..255 must be the "
                              "256 single bytes (GPT-2's layout)",
                              L->epath, id, show_key(L->keys[id], sb, sizeof sb));
    uint8_t b = L->blob[L->off[id]];
    have[b] = 1;
    L->byte_id[b] = (uint32_t)id;
  }
  for (int b = 0; b < 256; b++)
    if (!have[b])
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s: byte 0x%02x has no token among ids 0..255 "
                              "(every byte needs one)",
                              L->epath, b);
  return CHORUS_OK;
}

/* One part of a merge of vocab.bpe, line line (a GPT-2 spelling: UTF-8
 * first, then the alphabet): the id of its token in *out. */
static chorus_result_t merge_part_id(load_t *L, const char *part, size_t plen, long line,
                                     uint32_t *out) {
  char sb[64];
  int ok = 1;
  for (size_t i = 0; ok && i < plen;) {
    int cls;
    size_t m = chorus__bpe_char_at((const uint8_t *)part + i, (const uint8_t *)part + plen, &cls);
    if (m == 1 && (uint8_t)part[i] >= 0x80) ok = 0;
    i += m;
  }
  uint32_t bad = 0;
  long n = ok ? unspell(L->u2b, (const uint8_t *)part, plen, L->tmp, &bad) : -1;
  long id = n > 0 ? chorus__bpe_tokset_find(&L->set, L->blob, L->off, L->tmp, (size_t)n) : -1;
  if (id < 0) {
    char cut[64];
    size_t cl = plen < 40 ? plen : 40;
    memcpy(cut, part, cl);
    cut[cl] = '\0';
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s line %ld: \"%s\" %s", L->vpath, line,
                            show_key(cut, sb, sizeof sb),
                            !ok     ? "is not UTF-8"
                            : n < 0 ? "is not written in GPT-2's byte alphabet"
                                    : "is not a token of encoder.json (both parts of a merge "
                                      "must be)");
  }
  *out = (uint32_t)id;
  return CHORUS_OK;
}

/* The result of merge L->nm (of ids[0] and ids[1], line line of vocab.bpe)
 * must be the token with id 256 + rank. */
static chorus_result_t check_merge_result(load_t *L, const uint32_t ids[2], long line) {
  const size_t *off = L->off;
  uint32_t want = 256 + (uint32_t)L->nm;
  size_t la = off[ids[0] + 1] - off[ids[0]], lb = off[ids[1] + 1] - off[ids[1]];
  int same = (int)want != L->eot && off[want + 1] - off[want] == la + lb &&
             !memcmp(L->blob + off[want], L->blob + off[ids[0]], la) &&
             !memcmp(L->blob + off[want] + la, L->blob + off[ids[1]], lb);
  if (same) return CHORUS_OK;
  long got = -1;
  if (la + lb <= BPE_MAX_TOKEN) {
    memcpy(L->tmp, L->blob + off[ids[0]], la);
    memcpy(L->tmp + la, L->blob + off[ids[1]], lb);
    got = chorus__bpe_tokset_find(&L->set, L->blob, off, L->tmp, la + lb);
  }
  char whats[64];
  if (got < 0)
    snprintf(whats, sizeof whats, "is not in %s", "encoder.json");
  else
    snprintf(whats, sizeof whats, "has id %ld there", got);
  return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                          "chorus_bpe_load: %s line %ld: merge %d joins ids %u and %u into a "
                          "token that %s; it must be id %u (merge r makes id 256 + r, as in "
                          "GPT-2's files)",
                          L->vpath, line, L->nm, ids[0], ids[1], whats, want);
}

/* vocab.bpe: "#version..." then one merge "a b" per line. */
static chorus_result_t read_vocab_bpe(load_t *L) {
  const char *vpath = L->vpath;
  size_t maxm = L->nids - 256, vlen = L->vlen;
  chorus_result_t st;
  L->ma = malloc((maxm + 1) * sizeof *L->ma);
  L->mb = malloc((maxm + 1) * sizeof *L->mb);
  if (!L->ma || !L->mb) return load_nomem(L);
  char *p = L->vbpe, *end = L->vbpe + vlen;
  char *nl = memchr(p, '\n', vlen);
  if (vlen == 0 || *p != '#' || !nl)
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s line 1: expected a \"#version: ...\" line "
                            "(GPT-2's vocab.bpe: a version line, then one merge \"a b\" per line)",
                            vpath);
  p = nl + 1;
  for (long line = 2; p < end; line++) {
    nl = memchr(p, '\n', (size_t)(end - p));
    char *le = nl ? nl : end;
    char *sp = memchr(p, ' ', (size_t)(le - p));
    if (!sp || sp == p || sp + 1 == le || memchr(sp + 1, ' ', (size_t)(le - sp - 1)) ||
        memchr(p, '\0', (size_t)(le - p)))
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s line %ld: expected two tokens separated by "
                              "one space",
                              vpath, line);
    /* The parts are GPT-2 spellings: UTF-8 first, then the alphabet. */
    uint32_t ids[2];
    char *part[2] = {p, sp + 1};
    size_t plen[2] = {(size_t)(sp - p), (size_t)(le - sp - 1)};
    for (int k = 0; k < 2; k++)
      if ((st = merge_part_id(L, part[k], plen[k], line, &ids[k])) != CHORUS_OK) return st;
    if ((size_t)L->nm == maxm)
      return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                              "chorus_bpe_load: %s line %ld: more merges than %s has tokens for "
                              "(%zu tokens: 256 bytes + at most %zu merges)",
                              vpath, line, L->epath, L->nids, maxm);
    if ((st = check_merge_result(L, ids, line)) != CHORUS_OK) return st;
    L->ma[L->nm] = ids[0];
    L->mb[L->nm] = ids[1];
    L->nm++;
    if (!nl) break;
    p = nl + 1;
  }
  return CHORUS_OK;
}

/* Both files of one vocabulary: 256 bytes, a token per merge, and
 * <|endoftext|> (if any) after them. */
static chorus_result_t check_counts(const load_t *L) {
  int nm = L->nm, eot = L->eot;
  size_t want_ids = 256 + (size_t)nm + (eot >= 0);
  if (L->nids != want_ids || (eot >= 0 && eot != 256 + nm))
    return chorus__bpe_fail(L->err, L->errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: %s has %zu tokens%s but %s has %d merges: expected "
                            "256 bytes, ids 256..%d for the merges and %s (check that both files "
                            "belong to the same vocabulary)",
                            L->epath, L->nids, eot >= 0 ? " (with <|endoftext|>)" : "", L->vpath,
                            nm, 255 + nm, eot >= 0 ? "then <|endoftext|>" : "nothing else");
  return CHORUS_OK;
}

chorus_result_t chorus_bpe_load(const char *dir, chorus_bpe_t **out, char *err, size_t errlen) {
  if (out) *out = NULL;
  if (!dir || !out)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_load: bad arguments");
  char epath[4096], vpath[4096];
  if ((size_t)snprintf(epath, sizeof epath, "%s/encoder.json", dir) >= sizeof epath ||
      (size_t)snprintf(vpath, sizeof vpath, "%s/vocab.bpe", dir) >= sizeof vpath)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_load: path too long: %s", dir);
  load_t L;
  memset(&L, 0, sizeof L);
  L.dir = dir;
  L.epath = epath;
  L.vpath = vpath;
  L.err = err;
  L.errlen = errlen;
  L.eot = -1;
  chorus_result_t st;
  alphabet_inverse(L.u2b);
  if ((st = read_file(epath, &L.ejson, &L.elen, err, errlen)) != CHORUS_OK ||
      (st = read_file(vpath, &L.vbpe, &L.vlen, err, errlen)) != CHORUS_OK ||
      (st = parse_encoder_json(&L)) != CHORUS_OK || (st = read_encoder_tokens(&L)) != CHORUS_OK ||
      (st = lay_out_tokens(&L)) != CHORUS_OK || (st = check_byte_ids(&L)) != CHORUS_OK ||
      (st = read_vocab_bpe(&L)) != CHORUS_OK || (st = check_counts(&L)) != CHORUS_OK)
    goto fail;

  chorus_bpe_t *t = calloc(1, sizeof *t);
  if (!t) goto nomem;
  t->nids = (int)L.nids;
  t->nmerges = L.nm;
  t->eot = L.eot;
  memcpy(t->byte_id, L.byte_id, sizeof L.byte_id);
  t->blob = L.blob, L.blob = NULL;
  t->off = L.off, L.off = NULL;
  t->ma = L.ma, L.ma = NULL;
  t->mb = L.mb, L.mb = NULL;
  if (chorus__bpe_build_merge_table(t) != CHORUS_OK) {
    chorus_bpe_free(t);
    goto nomem;
  }
  load_clean(&L);
  *out = t;
  return CHORUS_OK;
nomem:
  st = load_nomem(&L);
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
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: cannot create %s: %s",
                            tmp, strerror(errno));
  uint16_t b2u[256];
  uint8_t order[256];
  chorus__bpe_alphabet(b2u, order);
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
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: writing %s: %s", path,
                            strerror(e));
  }
  return CHORUS_OK;
}

chorus_result_t chorus_bpe_save(const chorus_bpe_t *t, const char *dir, char *err,
                                size_t errlen) {
  if (!t || !dir)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG, "chorus_bpe_save: bad arguments");
  char path[4096];
  if (strlen(dir) > sizeof path - 32)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_INVALID_ARG,
                            "chorus_bpe_save: path too long: %s", dir);
  if (mkdir(dir, 0755) != 0 && errno != EEXIST)
    return chorus__bpe_fail(err, errlen, CHORUS_ERR_SYSTEM, "chorus_bpe_save: mkdir %s: %s", dir,
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
