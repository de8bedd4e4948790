/*
 * shards.c - token datasets on disk: llm.c's shard files (read and
 * written), nanoGPT's headerless uint16 files, and a plain text file read
 * as bytes.  Files are memory-mapped, never read whole; the pages a read
 * touched are given back right after, so resident memory does not grow
 * with the dataset.
 *
 * llm.c's format (dev/data/data_common.py and the loader of train_gpt2.c):
 *   int32 header[256]: [0] 20240520, [1] version (1: uint16 tokens, GPT-2;
 *   2: uint32, LLaMA 3), [2] number of tokens, the rest 0;
 *   then the tokens, little-endian.  The file is exactly 1024 + n * width
 *   bytes.  Datasets name them NAME_val_000000.bin (shard 0, validation)
 *   and NAME_train_000001.bin, ...
 *
 * Sequence i of a dataset (its shards one after the other, as one stream of
 * N tokens) is tokens i*T .. i*T+T: T inputs and the T next tokens as
 * targets; it may start in one shard and end in the next.  There are
 * (N - 1) / T of them.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "runtime.h"

#define HDR_INTS 256
#define HDR_BYTES (HDR_INTS * 4)
/* Text files keep their last tenth for validation (as before shards). */
#define TEXT_VAL_FRACTION 0.1

typedef struct {
  char *path;
  unsigned char *map; /* the whole file */
  size_t map_len;
  size_t off;   /* byte offset of the span's first token in the file */
  size_t n;     /* tokens in the span */
  size_t first; /* the span's first token in the dataset's stream */
  int width;    /* bytes per token: 1 (text), 2, 4 */
} span_t;

struct chorus_tokens {
  span_t *s;
  int ns;
  size_t n;
  int vocab;
  int release; /* give pages back after reading (madvise) */
};

static size_t g_page;

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8), p[2] = (unsigned char)(v >> 16),
  p[3] = (unsigned char)(v >> 24);
}

/* Maps path read-only.  0, or -1 (reported). */
static int map_file(const char *path, unsigned char **map, size_t *len) {
  struct stat sb;
  int fd = chorus__open_regular(path, &sb);
  if (fd == -1) {
    chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot open: %s", path, strerror(errno));
    return -1;
  }
  if (fd < 0) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG, "%s: not a regular file", path);
    return -1;
  }
  *len = (size_t)sb.st_size;
  *map = NULL;
  if (*len) {
    void *p = mmap(NULL, *len, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot map it: %s", path, strerror(errno));
      close(fd);
      return -1;
    }
    *map = p;
  }
  close(fd);
  return 0;
}

/* Checks an llm.c shard (or a headerless uint16 file when raw) and fills
 * the span.  0, or -1 (reported, naming the file and what is wrong). */
static int open_shard(span_t *sp, const char *path, int format) {
  if (map_file(path, &sp->map, &sp->map_len)) return -1;
  const size_t size = sp->map_len;
  if (format == CHORUS_TOKENS_RAW16) {
    if (size % 2) {
      chorus__train_fail(CHORUS_ERR_INVALID_ARG, "%s: %zu bytes, an odd number: not uint16 tokens",
                         path, size);
      return -1;
    }
    sp->off = 0, sp->n = size / 2, sp->width = 2;
    return 0;
  }
  const char *hint = format == CHORUS_TOKENS_AUTO ? " (nanoGPT's headerless uint16 files: "
                                                    "chorus-train --data-format raw16)" : "";
  if (size < HDR_BYTES) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                       "%s: %zu bytes, shorter than llm.c's 1024-byte header: not a "
                       "token shard, or one cut short%s",
                       path, size, hint);
    return -1;
  }
  uint32_t magic = le32(sp->map), version = le32(sp->map + 4), ntok = le32(sp->map + 8);
  if (magic != CHORUS_SHARD_MAGIC) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                       "%s: magic %u at offset 0, not llm.c's %u: not a token shard%s", path, magic,
                       CHORUS_SHARD_MAGIC, hint);
    return -1;
  }
  if (version != 1 && version != 2) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                       "%s: version %u at offset 4; llm.c's are 1 (uint16 tokens) and "
                       "2 (uint32)",
                       path, version);
    return -1;
  }
  sp->width = version == 1 ? 2 : 4;
  if (ntok > INT32_MAX) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                       "%s: token count %u at offset 8 is negative as llm.c's int32", path, ntok);
    return -1;
  }
  size_t want = HDR_BYTES + (size_t)ntok * (size_t)sp->width;
  if (size != want) {
    chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                       "%s: the header (offset 8) says %u tokens, %zu bytes in all, "
                       "but the file has %zu: %s",
                       path, ntok, want, size,
                       size < want ? "truncated (cut short while written or copied?)"
                                   : "bytes after the last "
                                     "token");
    return -1;
  }
  sp->off = HDR_BYTES, sp->n = ntok;
  return 0;
}

/* A text file: its bytes are the tokens; the last tenth is validation. */
static int open_text(span_t *sp, const char *path, int split) {
  if (map_file(path, &sp->map, &sp->map_len)) return -1;
  size_t len = sp->map_len, val_start = len - (size_t)((double)len * TEXT_VAL_FRACTION);
  sp->width = 1;
  sp->off = split == CHORUS_SPLIT_VAL ? val_start : 0;
  sp->n = split == CHORUS_SPLIT_VAL ? len - val_start : val_start;
  return 0;
}

static int has_glob(const char *s) { return strpbrk(s, "*?[") != NULL; }

static int ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && !strcmp(s + a - b, tail);
}

/* path with its last "train" replaced by "val" (llm.c's naming), or NULL. */
static char *train_to_val(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  const char *at = NULL;
  for (const char *p = strstr(base, "train"); p; p = strstr(p + 1, "train")) at = p;
  if (!at) return NULL;
  size_t pre = (size_t)(at - path);
  char *out = malloc(strlen(path) + 1);
  if (!out) return NULL;
  memcpy(out, path, pre);
  strcpy(out + pre, "val");
  strcat(out, at + 5);
  return out;
}

int chorus_shard_name(const char *file, size_t *name_len, int *numbered) {
  size_t n = strlen(file);
  if (n < 5 || strcmp(file + n - 4, ".bin")) return -1;
  n -= 4;
  size_t d = n;
  while (d > 0 && file[d - 1] >= '0' && file[d - 1] <= '9') d--;
  *numbered = d < n && d > 0 && file[d - 1] == '_';
  if (*numbered) n = d - 1;
  static const char *const suffix[2] = {"_train", "_val"}; /* CHORUS_SPLIT_TRAIN, _VAL */
  for (int split = 0; split < 2; split++) {
    size_t k = strlen(suffix[split]);
    if (n > k && !strncmp(file + n - k, suffix[split], k)) {
      *name_len = n - k;
      return split;
    }
  }
  return -1;
}

/* The files of a split: a directory's shards of one dataset (chorus_shard_name), or
 * else nanoGPT's train.bin / val.bin; a glob; or one file.  *files is a
 * sorted malloc'd list (possibly empty).  0, or -1 (reported). */
static int list_files(const char *spec, int split, char ***files, int *nfiles) {
  *files = NULL, *nfiles = 0;
  char **list = NULL;
  int n = 0, cap = 0;
  struct stat sb;
  char first[256] = ""; /* the dataset of the first shard taken: NAME_S and its form */
  int first_numbered = 0;
  if (!has_glob(spec) && stat(spec, &sb) == 0 && S_ISDIR(sb.st_mode)) {
    DIR *d = opendir(spec);
    if (!d) {
      chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot list: %s", spec, strerror(errno));
      return -1;
    }
    for (int pass = 0; pass < 2 && n == 0; pass++) {
      rewinddir(d);
      for (struct dirent *e; (e = readdir(d));) {
        const char *nm = e->d_name;
        size_t key = 0; /* the length of NAME_S: with the form, which dataset */
        int numbered = 0;
        int take = pass == 0 ? chorus_shard_name(nm, &key, &numbered) == split
                             : !strcmp(nm, split == CHORUS_SPLIT_VAL ? "val.bin" : "train.bin");
        if (!take) continue;
        key += split == CHORUS_SPLIT_VAL ? 4 : 6;
        if (pass == 0 && !first[0]) {
          snprintf(first, sizeof first, "%.*s", (int)key, nm);
          first_numbered = numbered;
        } else if (pass == 0 && (strlen(first) != key || strncmp(first, nm, key) ||
                                 first_numbered != numbered)) {
          chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                             "%s holds the shards of more than one dataset (%s%s and "
                             "%s): give a glob, such as '%s/%s%s'",
                             spec, first, first_numbered ? "_*.bin" : ".bin", nm, spec, first,
                             first_numbered ? "_*.bin" : ".bin");
          closedir(d);
          for (int i = 0; i < n; i++) free(list[i]);
          free(list);
          return -1;
        }
        if (n == cap) {
          cap = cap ? 2 * cap : 16;
          char **nl = realloc(list, sizeof(char *) * (size_t)cap);
          if (!nl) goto nomem;
          list = nl;
        }
        size_t len = strlen(spec) + strlen(nm) + 2;
        if (!(list[n] = malloc(len))) goto nomem;
        snprintf(list[n++], len, "%s/%s", spec, nm);
      }
    }
    closedir(d);
    if (n) qsort(list, (size_t)n, sizeof(char *), cmp_str);
    *files = list, *nfiles = n;
    return 0;
  nomem:
    closedir(d);
    for (int i = 0; i < n; i++) free(list[i]);
    free(list);
    chorus__train_fail(CHORUS_ERR_NO_MEMORY, "listing %s: out of memory", spec);
    return -1;
  }
  /* A glob or a file; validation goes by llm.c's naming (train -> val). */
  char *pat = split == CHORUS_SPLIT_VAL ? train_to_val(spec) : strdup(spec);
  if (!pat) return 0; /* no name for a validation part: none */
  glob_t g;
  int rc = glob(pat, GLOB_NOSORT, NULL, &g);
  free(pat);
  if (rc == GLOB_NOMATCH) return 0;
  if (rc != 0) {
    chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot expand the pattern", spec);
    return -1;
  }
  list = calloc(g.gl_pathc ? g.gl_pathc : 1, sizeof(char *));
  for (size_t i = 0; list && i < g.gl_pathc; i++)
    if (!(list[n++] = strdup(g.gl_pathv[i]))) break;
  globfree(&g);
  if (!list || (size_t)n != g.gl_pathc || (n && !list[n - 1])) {
    for (int i = 0; list && i < n; i++) free(list[i]);
    free(list);
    chorus__train_fail(CHORUS_ERR_NO_MEMORY, "listing %s: out of memory", spec);
    return -1;
  }
  if (n) qsort(list, (size_t)n, sizeof(char *), cmp_str);
  *files = list, *nfiles = n;
  return 0;
}

/* Text, unless it is named like a shard or starts with llm.c's magic;
 * *nul_at gets the offset of the first NUL byte in its first 64 KiB, or
 * -1 (text has none; token files without a header are full of them). */
static int looks_like_text(const char *path, long *nul_at) {
  *nul_at = -1;
  if (ends_with(path, ".bin")) return 0;
  struct stat sb;
  int fd = chorus__open_regular(path, &sb);
  if (fd < 0) return 1; /* opening reports it (map_file) */
  static const size_t N = 1 << 16;
  unsigned char head[4], *b = malloc(N);
  size_t want = b ? N : 4, n = 0; /* out of memory: the magic only */
  while (n < want) {
    ssize_t k = read(fd, (b ? b : head) + n, want - n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    n += (size_t)k;
  }
  close(fd);
  int shard = n >= 4 && le32(b ? b : head) == CHORUS_SHARD_MAGIC;
  if (!b) return !shard;
  const unsigned char *z = n ? memchr(b, 0, n) : NULL;
  if (!shard && z) *nul_at = (long)(z - b);
  free(b);
  return !shard;
}

const char *chorus_tokens_tokenizer_dir(const char *spec, char *buf, size_t len) {
  struct stat sb;
  int n;
  if (!spec || !buf || !len) return NULL;
  if (stat(spec, &sb) == 0 && S_ISDIR(sb.st_mode)) n = snprintf(buf, len, "%s", spec);
  else {
    const char *slash = strrchr(spec, '/');
    n = slash ? snprintf(buf, len, "%.*s", (int)(slash - spec + (slash == spec)), spec)
              : snprintf(buf, len, ".");
  }
  if (n < 0 || (size_t)n >= len) return NULL;
  char path[4200];
  n = snprintf(path, sizeof path, "%s/encoder.json", buf);
  if (n < 0 || (size_t)n >= sizeof path || access(path, R_OK) != 0) return NULL;
  return buf;
}

chorus_result_t chorus_tokens_open(const char *spec, int split, int format, int vocab,
                                   chorus_tokens_t **out) {
  *out = NULL;
  if (!spec || (split != CHORUS_SPLIT_TRAIN && split != CHORUS_SPLIT_VAL) || vocab < 1)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_tokens_open: bad arguments");
  if (!g_page) g_page = (size_t)sysconf(_SC_PAGESIZE);
  struct stat sb;
  int text = format == CHORUS_TOKENS_TEXT;
  long at;
  if (format == CHORUS_TOKENS_AUTO && !has_glob(spec) && stat(spec, &sb) == 0 &&
      S_ISREG(sb.st_mode) && (text = looks_like_text(spec, &at))) {
    /* nanoGPT's headerless train.bin under another name, say */
    if (at >= 0)
      return chorus__train_fail(
          CHORUS_ERR_INVALID_ARG,
          "%s: a NUL byte at offset %ld: not text, and not an "
          "llm.c shard (no magic 20240520); nanoGPT's headerless uint16 tokens: "
          "--data-format raw16; its bytes as text anyway: --data-format text",
          spec, at);
  }
  char **files = NULL;
  int nf = 0;
  if (text) {
    files = malloc(sizeof(char *));
    if (!files || !(files[0] = strdup(spec))) {
      free(files);
      return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
    }
    nf = 1;
  } else if (list_files(spec, split, &files, &nf)) {
    return CHORUS_ERR_INVALID_ARG;
  }
  if (nf == 0 && split == CHORUS_SPLIT_TRAIN) {
    free(files);
    if (stat(spec, &sb) != 0 && !has_glob(spec))
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "%s: %s", spec, strerror(errno));
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG,
        "%s: no token shards there (llm.c's NAME_train_*.bin or "
        "NAME_train.bin, nanoGPT's train.bin; make them with chorus-data prepare)",
        spec);
  }
  chorus_tokens_t *d = calloc(1, sizeof *d);
  span_t *s = calloc((size_t)(nf ? nf : 1), sizeof *s);
  if (!d || !s) {
    for (int i = 0; i < nf; i++) free(files[i]);
    free(files), free(d), free(s);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  }
  d->s = s, d->vocab = vocab, d->release = 1;
  int bad = 0;
  for (int i = 0; i < nf; i++) {
    s[i].path = files[i];
    if (bad) continue;
    d->ns = i + 1;
    bad = text ? open_text(&s[i], files[i], split) : open_shard(&s[i], files[i], format);
    s[i].first = d->n;
    d->n += s[i].n;
  }
  for (int i = d->ns; i < nf; i++) free(files[i]);
  free(files);
  if (bad) {
    chorus_tokens_close(d);
    return CHORUS_ERR_INVALID_ARG;
  }
  if (text && vocab < 256) {
    chorus_tokens_close(d);
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "%s: text is read as bytes, vocabulary 256, not %d", spec, vocab);
  }
  *out = d;
  return CHORUS_OK;
}

void chorus_tokens_close(chorus_tokens_t *d) {
  if (!d) return;
  for (int i = 0; i < d->ns; i++) {
    if (d->s[i].map) munmap(d->s[i].map, d->s[i].map_len);
    free(d->s[i].path);
  }
  free(d->s);
  free(d);
}

size_t chorus_tokens_count(const chorus_tokens_t *d) { return d ? d->n : 0; }
int chorus_tokens_files(const chorus_tokens_t *d) { return d ? d->ns : 0; }
const char *chorus_tokens_file(const chorus_tokens_t *d, int i) {
  return d && i >= 0 && i < d->ns ? d->s[i].path : NULL;
}
int chorus_tokens_vocab(const chorus_tokens_t *d) { return d->vocab; }
int chorus_tokens_is_text(const chorus_tokens_t *d) { return d->ns > 0 && d->s[0].width == 1; }

size_t chorus_tokens_samples(const chorus_tokens_t *d, int seq) {
  if (!d || seq < 1 || d->n < (size_t)seq + 1) return 0;
  return (d->n - 1) / (size_t)seq;
}

/* The span holding token t of the stream. */
static int span_of(const chorus_tokens_t *d, size_t t) {
  int lo = 0, hi = d->ns - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (d->s[mid].first <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Copies count tokens from stream position t into out, checking each
 * against the vocabulary.  0, or -1 (reported with file and offset). */
static int copy_tokens(const chorus_tokens_t *d, size_t t, size_t count, int *out) {
  int k = span_of(d, t);
  while (count) {
    while (k < d->ns && t >= d->s[k].first + d->s[k].n) k++;
    if (k >= d->ns) {
      chorus__train_fail(CHORUS_ERR_INVALID_ARG, "token %zu is past the dataset's end (%zu)", t,
                         d->n);
      return -1;
    }
    const span_t *sp = &d->s[k];
    size_t at = t - sp->first, take = sp->n - at < count ? sp->n - at : count;
    const unsigned char *p = sp->map + sp->off + at * (size_t)sp->width;
    for (size_t i = 0; i < take; i++) {
      uint32_t v = sp->width == 1   ? p[i]
                   : sp->width == 2 ? (uint32_t)p[2 * i] | (uint32_t)p[2 * i + 1] << 8
                                    : le32(p + 4 * i);
      if (v >= (uint32_t)d->vocab) {
        chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                           "%s: token %u at byte offset %zu is outside the "
                           "vocabulary of %d tokens (tokenized with another vocabulary?)",
                           sp->path, v, sp->off + (at + i) * (size_t)sp->width, d->vocab);
        return -1;
      }
      out[i] = (int)v;
    }
    if (d->release && sp->width > 1) {
      /* Give the pages back: the page cache keeps them, our RSS does not. */
      uintptr_t a = (uintptr_t)p & ~(uintptr_t)(g_page - 1);
      uintptr_t b = ((uintptr_t)(p + take * (size_t)sp->width) + g_page - 1) &
                    ~(uintptr_t)(g_page - 1);
      uintptr_t end = (uintptr_t)(sp->map + sp->map_len);
      if (b > end) b = end;
      if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
    }
    out += take, t += take, count -= take;
  }
  return 0;
}

chorus_result_t chorus_tokens_read(const chorus_tokens_t *d, int seq, const size_t *idx, int B,
                                   int *tokens, int *targets) {
  size_t n = chorus_tokens_samples(d, seq);
  int *win = malloc(sizeof(int) * ((size_t)seq + 1));
  if (!win) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  for (int b = 0; b < B; b++) {
    if (idx[b] >= n) {
      free(win);
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "sequence %zu: the dataset has %zu", idx[b],
                                n);
    }
    if (copy_tokens(d, idx[b] * (size_t)seq, (size_t)seq + 1, win)) {
      free(win);
      return CHORUS_ERR_INVALID_ARG;
    }
    memcpy(tokens + (size_t)b * seq, win, sizeof(int) * (size_t)seq);
    memcpy(targets + (size_t)b * seq, win + 1, sizeof(int) * (size_t)seq);
  }
  free(win);
  return CHORUS_OK;
}

chorus_result_t chorus_tokens_check(const chorus_tokens_t *d) {
  enum { CHUNK = 1 << 16 };
  int *buf = malloc(sizeof(int) * CHUNK);
  if (!buf) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  for (size_t t = 0; t < d->n; t += CHUNK) {
    size_t c = d->n - t < CHUNK ? d->n - t : CHUNK;
    if (copy_tokens(d, t, c, buf)) {
      free(buf);
      return CHORUS_ERR_INVALID_ARG;
    }
  }
  free(buf);
  return CHORUS_OK;
}

/* --------------------------------------------------------------- writing */

struct chorus_shard_writer {
  char *path, *tmp;
  int fd, width;
  size_t n;
  unsigned char buf[1 << 16];
  size_t used;
};

chorus_result_t chorus_shard_writer_open(const char *path, int version,
                                         chorus_shard_writer_t **out) {
  *out = NULL;
  if (version != 1 && version != 2)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "%s: version %d: llm.c's are 1 and 2", path,
                              version);
  chorus_shard_writer_t *w = calloc(1, sizeof *w);
  size_t len = strlen(path) + 32;
  if (!w || !(w->path = strdup(path)) || !(w->tmp = malloc(len))) {
    if (w) free(w->path);
    free(w);
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  }
  /* A half-written shard never has the final name. */
  snprintf(w->tmp, len, "%s.tmp.%ld", path, (long)getpid());
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd < 0) {
    chorus_result_t st =
        chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot create: %s", w->tmp, strerror(errno));
    free(w->tmp), free(w->path), free(w);
    return st;
  }
  w->width = version == 1 ? 2 : 4;
  memset(w->buf, 0, HDR_BYTES); /* the header, filled in at the end */
  w->used = HDR_BYTES;
  *out = w;
  return CHORUS_OK;
}

static int write_all(int fd, const unsigned char *p, size_t n) {
  while (n) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k, n -= (size_t)k;
  }
  return 0;
}

static chorus_result_t flush_buf(chorus_shard_writer_t *w) {
  if (w->used && write_all(w->fd, w->buf, w->used))
    return chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: write: %s", w->tmp, strerror(errno));
  w->used = 0;
  return CHORUS_OK;
}

chorus_result_t chorus_shard_writer_add(chorus_shard_writer_t *w, const uint32_t *toks,
                                        size_t n) {
  const uint32_t lim = w->width == 2 ? 0xffffu : 0xffffffffu;
  if (w->n + n > INT32_MAX)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "%s: more than 2^31 - 1 tokens in one shard (llm.c's "
                              "header holds an int32)",
                              w->path);
  for (size_t i = 0; i < n; i++) {
    if (toks[i] > lim)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "%s: token %u does not fit version 1's uint16", w->path, toks[i]);
    if (w->used + 4 > sizeof w->buf) {
      chorus_result_t st = flush_buf(w);
      if (st != CHORUS_OK) return st;
    }
    if (w->width == 2) {
      w->buf[w->used++] = (unsigned char)toks[i];
      w->buf[w->used++] = (unsigned char)(toks[i] >> 8);
    } else {
      put32(w->buf + w->used, toks[i]);
      w->used += 4;
    }
  }
  w->n += n;
  return CHORUS_OK;
}

size_t chorus_shard_writer_count(const chorus_shard_writer_t *w) { return w->n; }

chorus_result_t chorus_shard_writer_close(chorus_shard_writer_t *w, int commit) {
  if (!w) return CHORUS_OK;
  chorus_result_t st = commit ? flush_buf(w) : CHORUS_OK;
  if (commit && st == CHORUS_OK) {
    unsigned char h[12];
    put32(h, CHORUS_SHARD_MAGIC);
    put32(h + 4, w->width == 2 ? 1u : 2u);
    put32(h + 8, (uint32_t)w->n);
    if (pwrite(w->fd, h, sizeof h, 0) != (ssize_t)sizeof h || fsync(w->fd) != 0)
      st = chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: write: %s", w->tmp, strerror(errno));
  }
  if (close(w->fd) != 0 && st == CHORUS_OK && commit)
    st = chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: close: %s", w->tmp, strerror(errno));
  if (commit && st == CHORUS_OK && rename(w->tmp, w->path) != 0)
    st = chorus__train_fail(CHORUS_ERR_SYSTEM, "%s: cannot rename to %s: %s", w->tmp, w->path,
                            strerror(errno));
  if (!commit || st != CHORUS_OK) unlink(w->tmp);
  free(w->tmp), free(w->path), free(w);
  return st;
}
