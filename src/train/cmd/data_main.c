/*
 * chorus-data - turns text into llm.c token shards, and checks shards.
 *
 *   chorus-data prepare INPUT... -o DIR [--tokenizer DIR | --vocab-size N]
 *   chorus-data check DIR|GLOB|FILE [--tokenizer DIR | --vocab N]
 *
 * prepare: INPUTs are text files (each one document), directories (every
 * regular file under them, in path order) and JSON lines files (*.jsonl:
 * one document per line, its "text" field, as llm.c's FineWeb scripts
 * read them).  Each document is "<|endoftext|>" followed by its tokens.
 * The first --val-fraction of the input bytes goes to DIR/NAME_val_000000.bin,
 * the rest to NAME_train_000001.bin, ... of --shard-tokens each.  The input
 * is cut into units of about 256 KiB at places where GPT-2's pre-split has
 * a boundary whatever comes before or after (chorus_bpe_cut), so the
 * tokens do not depend on the cut, and the units are encoded by --threads
 * threads; shards are written in input order, so the result does not
 * depend on the thread count either.  Everything is written into a staging
 * folder and moved into DIR at the end (see "staging").  The tokenizer is
 * DIR's encoder.json + vocab.bpe, given or trained here (--vocab-size, on a
 * sample of the input spread evenly over it) and saved beside the shards.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chorus_train.h"
#include "opt.h"
#include "../runtime.h" /* chorus__remove_entry, chorus__dir_check, chorus__open_regular */

#define UNIT_BYTES (256u << 10)
#define PATH_CAP 4608 /* a folder of up to 4096 - 320 bytes, a name of up to 255 */

typedef struct {
  char *path;
  unsigned char *map;
  size_t len;
  int jsonl;
} file_t;

typedef struct {
  int file;
  size_t off, len;
  long line;      /* jsonl: the first line's number (1-based) */
  int doc_start;  /* text: the unit starts a document (gets an eot) */
  int val;
} unit_t;

typedef struct {
  uint32_t *toks;
  size_t n, cap;
  int done;
  chorus_result_t st;
  char err[512];
} result_t;

typedef struct {
  const char *out, *name, *tokenizer, *field;
  int vocab_size, threads, skip_invalid;
  double val_fraction, vocab_sample_mb;
  size_t shard_tokens;
} opts_t;

static file_t *g_files;
static int g_nfiles;
static unit_t *g_units;
static size_t g_nunits;
static size_t g_skipped;
/* prepare writes into DIR/.prepare-NAME-HOST-PID and moves the files into
 * DIR once all are complete (see "staging"). */
static char g_stage[4096];
static struct stat g_out; /* the output folder, when it exists already: never an input */
static int g_out_known;

/* sb is the output folder's. */
static int is_output(const struct stat *sb) {
  return g_out_known && S_ISDIR(sb->st_mode) && sb->st_dev == g_out.st_dev &&
         sb->st_ino == g_out.st_ino;
}
static void remove_stage(void);

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("chorus-data: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  remove_stage();
  exit(1);
}

/* ---------------------------------------------------------------- inputs */

static int ends_with(const char *s, const char *tail) {
  size_t a = strlen(s), b = strlen(tail);
  return a >= b && !strcmp(s + a - b, tail);
}

static void add_file(const char *path, int jsonl) {
  static int cap;
  if (g_nfiles == cap) {
    cap = cap ? 2 * cap : 256;
    g_files = realloc(g_files, sizeof(file_t) * (size_t)cap);
    if (!g_files) die("out of memory");
  }
  file_t *f = &g_files[g_nfiles++];
  f->path = strdup(path);
  f->jsonl = jsonl || ends_with(path, ".jsonl");
  f->map = NULL;
  f->len = 0;
  if (!f->path) die("out of memory");
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static void walk(const char *dir, int jsonl) {
  DIR *d = opendir(dir);
  if (!d) die("%s: cannot list: %s", dir, strerror(errno));
  char **names = NULL;
  size_t n = 0, cap = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      if (!(names = realloc(names, sizeof(char *) * cap))) die("out of memory");
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    if (!(names[n] = malloc(len))) die("out of memory");
    snprintf(names[n++], len, "%s/%s", dir, e->d_name);
  }
  closedir(d);
  if (n) qsort(names, n, sizeof(char *), cmp_str);
  for (size_t i = 0; i < n; i++) {
    struct stat sb, to;
    if (lstat(names[i], &sb) == 0) {
      if (is_output(&sb))
        fprintf(stderr, "chorus-data: leaving out %s: it is the output folder\n", names[i]);
      else if (S_ISDIR(sb.st_mode)) walk(names[i], jsonl);
      else if (S_ISREG(sb.st_mode)) add_file(names[i], jsonl);
      /* A link to a file is read; one to a folder is not walked (a loop is
       * one link away), and everything is named when left out. */
      else {
        int link = S_ISLNK(sb.st_mode), target = link && stat(names[i], &to) == 0;
        if (target && S_ISREG(to.st_mode))
          add_file(names[i], jsonl);
        else
          fprintf(stderr, "chorus-data: leaving out %s: %s\n", names[i],
                  !link ? "not a regular file (a FIFO, a device or a socket)"
                  : !target ? "a symbolic link to nothing"
                  : S_ISDIR(to.st_mode) ? "a symbolic link to a folder (name the folder itself "
                                          "to read it)"
                                        : "a symbolic link to something not a regular file");
      }
    }
    free(names[i]);
  }
  free(names);
}

static void map_input(file_t *f) {
  struct stat sb;
  int fd = chorus__open_regular(f->path, &sb);
  if (fd == -1) die("%s: cannot open: %s", f->path, strerror(errno));
  if (fd < 0) die("%s: not a regular file", f->path);
  f->len = (size_t)sb.st_size;
  if (f->len) {
    void *p = mmap(NULL, f->len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) die("%s: cannot map it: %s", f->path, strerror(errno));
    f->map = p;
    madvise(p, f->len, MADV_SEQUENTIAL);
  }
  close(fd);
}

static int ascii_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

static void add_unit(int file, size_t off, size_t len, long line, int doc_start, int val) {
  static size_t cap;
  if (g_nunits == cap) {
    cap = cap ? 2 * cap : 1024;
    if (!(g_units = realloc(g_units, sizeof(unit_t) * cap))) die("out of memory");
  }
  g_units[g_nunits++] = (unit_t){file, off, len, line, doc_start, val};
}

/* Cuts file i (mapped) into units; the first val_bytes of the whole input
 * (*seen so far) are the validation units. */
static void plan_file(int i, size_t val_bytes, size_t *seen) {
  file_t *f = &g_files[i];
  size_t off = 0;
  long line = 1;
  while (off < f->len) {
    int val = *seen < val_bytes;
    size_t want = off + UNIT_BYTES;
    if (val && *seen + UNIT_BYTES > val_bytes) want = off + (val_bytes - *seen);
    size_t end;
    if (f->jsonl) { /* whole lines */
      end = want >= f->len ? f->len : want;
      const unsigned char *nl = end < f->len ? memchr(f->map + end, '\n', f->len - end) : NULL;
      end = end >= f->len ? f->len : nl ? (size_t)(nl - f->map) + 1 : f->len;
    } else {
      /* Cut where the pre-split has a boundary whatever is around it (a
       * non-space character followed by ASCII whitespace: the end of nearly
       * every word or sentence, in any script). */
      end = want >= f->len ? f->len : chorus_bpe_cut(f->map, f->len, want);
      /* No white space for another unit's length: a boundary of the
       * pieces themselves, found by scanning them from the unit's start
       * (a text without white space would be one unit: its tokens, and
       * the encoder's state, held at once). */
      if (end - want > UNIT_BYTES) end = chorus_bpe_cut_pieces(f->map, f->len, off, want);
    }
    add_unit(i, off, end - off, line, off == 0, val);
    if (f->jsonl)
      for (size_t k = off; k < end; k++) line += f->map[k] == '\n';
    *seen += end - off;
    off = end;
  }
}

/* A unit's bytes, read into *buf (grown as needed).  NULL on error (r). */
static const unsigned char *read_unit(const unit_t *u, unsigned char **buf, size_t *cap,
                                      result_t *r);

/* ------------------------------------------------------------- encoding */

typedef struct {
  const opts_t *o;
  const chorus_bpe_t *bpe;
  chorus_bpe_counter_t **counters; /* counting pass: one per thread */
  const unsigned char *take;       /* counting pass: units in the sample */
  result_t *res;
  size_t next, consumed, window;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  size_t bytes_done;
  int counters_taken;
} work_t;

static int fail_unit(result_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_unit(result_t *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->err, sizeof r->err, fmt, ap);
  va_end(ap);
  r->st = CHORUS_ERR_INVALID_ARG;
  return -1;
}

static int push_tok(result_t *r, uint32_t t) {
  if (r->n == r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 4096;
    uint32_t *nt = realloc(r->toks, sizeof(uint32_t) * cap);
    if (!nt) return fail_unit(r, "out of memory");
    r->toks = nt, r->cap = cap;
  }
  r->toks[r->n++] = t;
  return 0;
}

/* One document's text: counted (counter) or encoded into r after an eot. */
static int one_doc(const unsigned char *text, size_t len, int doc_start, const char *path,
                   size_t at, long line, chorus_bpe_encoder_t *enc, chorus_bpe_counter_t *cnt,
                   int eot, result_t *r) {
  size_t bad = chorus_utf8_check(text, len);
  if (bad < len) {
    if (line > 0) return fail_unit(r, "%s: line %ld: invalid UTF-8 in the text at its byte %zu "
                                   "(0x%02x)", path, line, bad, text[bad]);
    return fail_unit(r, "%s: invalid UTF-8 at byte offset %zu (0x%02x); is it text? (convert "
                     "it, or --skip-invalid to leave such files out)", path, at + bad,
                     text[bad]);
  }
  if (cnt) return chorus_bpe_count(cnt, text, len) == CHORUS_OK ? 0
                                                                : fail_unit(r, "out of memory");
  if (doc_start && eot >= 0 && push_tok(r, (uint32_t)eot)) return -1;
  if (chorus_bpe_encode(enc, text, len, &r->toks, &r->n, &r->cap) != CHORUS_OK)
    return fail_unit(r, "%s: encoding: %s", path, chorus_train_last_error());
  return 0;
}

static const unsigned char *read_unit(const unit_t *u, unsigned char **buf, size_t *cap,
                                      result_t *r) {
  const char *path = g_files[u->file].path;
  if (u->len > *cap) {
    unsigned char *nb = realloc(*buf, u->len);
    if (!nb) {
      fail_unit(r, "out of memory");
      return NULL;
    }
    *buf = nb, *cap = u->len;
  }
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  size_t got = 0;
  while (fd >= 0 && got < u->len) {
    ssize_t k = pread(fd, *buf + got, u->len - got, (off_t)(u->off + got));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got += (size_t)k;
  }
  int e = errno;
  if (fd >= 0) close(fd);
  if (got < u->len) {
    fail_unit(r, "%s: cannot read bytes %zu..%zu (changed while being prepared?): %s", path,
              u->off, u->off + u->len, got ? "short read" : strerror(e));
    return NULL;
  }
  return *buf;
}

static int do_unit(work_t *w, const unit_t *u, chorus_bpe_encoder_t *enc,
                   chorus_bpe_counter_t *cnt, result_t *r, unsigned char **buf, size_t *cap) {
  const file_t *f = &g_files[u->file];
  const unsigned char *p = read_unit(u, buf, cap, r);
  if (!p) return -1;
  const int eot = w->bpe ? chorus_bpe_eot(w->bpe) : -1;
  if (!f->jsonl)
    return one_doc(p, u->len, u->doc_start, f->path, u->off, 0, enc, cnt, eot, r);
  long line = u->line;
  for (size_t i = 0; i < u->len; line++) {
    const unsigned char *nl = memchr(p + i, '\n', u->len - i);
    size_t end = nl ? (size_t)(nl - p) : u->len;
    size_t first = i; /* a blank line (CRLF's "\r" too) is no document */
    while (first < end && ascii_space(p[first])) first++;
    if (first < end) {
      json_error_t je;
      json_t *doc = json_loadb((const char *)p + i, end - i, 0, &je);
      json_t *t = doc ? json_object_get(doc, w->o->field) : NULL;
      int rc;
      if (!doc)
        rc = fail_unit(r, "%s: line %ld: not JSON: %s (column %d)", f->path, line, je.text,
                       je.column);
      else if (!json_is_string(t))
        rc = fail_unit(r, "%s: line %ld: no string field \"%s\"", f->path, line, w->o->field);
      else
        rc = one_doc((const unsigned char *)json_string_value(t), json_string_length(t), 1,
                     f->path, 0, line, enc, cnt, eot, r);
      json_decref(doc);
      if (rc && !w->o->skip_invalid) return -1;
      if (rc) { /* --skip-invalid: that document is left out */
        fprintf(stderr, "chorus-data: skipped: %s\n", r->err);
        r->st = CHORUS_OK;
        __atomic_fetch_add(&g_skipped, 1, __ATOMIC_RELAXED);
      }
    }
    i = end + 1;
  }
  return 0;
}

static void *worker(void *arg) {
  work_t *w = arg;
  chorus_bpe_encoder_t *enc = NULL;
  unsigned char *buf = NULL;
  size_t cap = 0;
  /* Without an encoder this thread still takes units, failing each: the
   * caller waits for every unit in turn and must hear of it. */
  const int no_enc = w->bpe && chorus_bpe_encoder_create(w->bpe, &enc) != CHORUS_OK;
  pthread_mutex_lock(&w->mu);
  int me = -1;
  if (w->counters) me = w->counters_taken++; /* counting: a counter of its own */
  for (;;) {
    while (w->next < g_nunits && w->next >= w->consumed + w->window)
      pthread_cond_wait(&w->cv, &w->mu);
    if (w->next >= g_nunits) break;
    size_t u = w->next++;
    pthread_mutex_unlock(&w->mu);
    result_t *r = &w->res[u % w->window];
    if (no_enc)
      fail_unit(r, "cannot make an encoder: %s", chorus_train_last_error());
    else if (!w->take || w->take[u])
      do_unit(w, &g_units[u], enc, me >= 0 ? w->counters[me] : NULL, r, &buf, &cap);
    pthread_mutex_lock(&w->mu);
    r->done = 1;
    w->bytes_done += g_units[u].len;
    pthread_cond_broadcast(&w->cv);
  }
  pthread_mutex_unlock(&w->mu);
  chorus_bpe_encoder_free(enc);
  free(buf);
  return NULL;
}

/* ------------------------------------------------------------- progress */

static void progress(const char *what, double t0, size_t done, size_t total, size_t toks,
                     int final) {
  static double last;
  double t = now_s();
  int tty = isatty(2);
  if (!final && t - last < (tty ? 0.25 : 5.0)) return;
  last = t;
  double el = t - t0, rate = el > 0 ? (double)done / el : 0;
  double eta = rate > 0 ? (double)(total - done) / rate : 0;
  fprintf(stderr, "%s%s: %.1f/%.1f MB (%3.0f%%)  %.2f M tok/s  %.1f MB/s  %s %d:%02d%s",
          tty ? "\r" : "", what, (double)done / 1e6, (double)total / 1e6,
          total ? 100.0 * (double)done / (double)total : 100.0, el > 0 ? (double)toks / el / 1e6
                                                                      : 0.0,
          rate / 1e6, final ? "took" : "ETA", (int)((final ? el : eta) / 60),
          (int)(final ? el : eta) % 60, tty && !final ? "   " : "\n");
}

/* Runs the workers over every unit; consume(u) is called in unit order on
 * the caller's thread as results come in. */
static void run_units(work_t *w, const char *what, size_t total,
                      void (*consume)(work_t *, size_t, result_t *, void *), void *arg) {
  pthread_t th[256];
  int n = w->o->threads;
  w->window = (size_t)n * 4;
  w->res = calloc(w->window, sizeof(result_t));
  if (!w->res) die("out of memory");
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  for (int i = 0; i < n; i++)
    if (pthread_create(&th[i], NULL, worker, w)) die("cannot start a thread");
  const double t0 = now_s();
  size_t toks = 0;
  for (size_t u = 0; u < g_nunits; u++) {
    result_t *r = &w->res[u % w->window];
    pthread_mutex_lock(&w->mu);
    while (!r->done) pthread_cond_wait(&w->cv, &w->mu);
    size_t bytes = w->bytes_done;
    pthread_mutex_unlock(&w->mu);
    if (r->st != CHORUS_OK) die("%s", r->err);
    toks += r->n;
    consume(w, u, r, arg);
    r->n = 0, r->done = 0, r->st = CHORUS_OK;
    pthread_mutex_lock(&w->mu);
    w->consumed = u + 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    progress(what, t0, bytes, total, toks, 0);
  }
  progress(what, t0, total, total, toks, 1);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  for (size_t i = 0; i < w->window; i++) free(w->res[i].toks);
  free(w->res);
  w->res = NULL;
}

/* ---------------------------------------------------------- the shards */

typedef struct {
  const opts_t *o;
  chorus_shard_writer_t *w;
  int shard, version, val_shards, train_shards, in_val, skipped_file;
  size_t val_toks, train_toks;
} sink_t;

static void close_shard(sink_t *s) {
  if (!s->w) return;
  if (chorus_shard_writer_close(s->w, 1) != CHORUS_OK) die("%s", chorus_train_last_error());
  s->w = NULL;
  s->shard++;
}

static void put(sink_t *s, int val, const uint32_t *t, size_t n) {
  while (n) {
    if (s->w && (s->in_val != val || chorus_shard_writer_count(s->w) >= s->o->shard_tokens))
      close_shard(s);
    if (!s->w) {
      char path[PATH_CAP];
      if (snprintf(path, sizeof path, "%s/%s_%s_%06d.bin", g_stage, s->o->name,
                   val ? "val" : "train", s->shard) >= (int)sizeof path)
        die("%s: the output path is too long", s->o->out);
      if (chorus_shard_writer_open(path, s->version, &s->w) != CHORUS_OK)
        die("%s", chorus_train_last_error());
      s->in_val = val;
      if (val) s->val_shards++;
      else s->train_shards++;
    }
    size_t room = s->o->shard_tokens - chorus_shard_writer_count(s->w);
    size_t c = n < room ? n : room;
    if (chorus_shard_writer_add(s->w, t, c) != CHORUS_OK) die("%s", chorus_train_last_error());
    if (val) s->val_toks += c;
    else s->train_toks += c;
    t += c, n -= c;
  }
}

static void consume_tokens(work_t *w, size_t u, result_t *r, void *arg) {
  (void)w;
  sink_t *s = arg;
  /* Validation first (shard 0, as llm.c numbers them), then training. */
  if (!g_units[u].val && s->in_val && s->w) close_shard(s);
  if (!g_units[u].val && s->shard == 0) s->shard = 1;
  put(s, g_units[u].val, r->toks, r->n);
}

static void consume_nothing(work_t *w, size_t u, result_t *r, void *arg) {
  (void)w, (void)u, (void)r, (void)arg;
}

/* --------------------------------------------------------------- staging */

/* dir/name into buf (cap bytes); 0, or -1 when it does not fit. */
static int join_path(char *buf, size_t cap, const char *dir, const char *name) {
  int n = snprintf(buf, cap, "%s/%s", dir, name);
  return n < 0 || (size_t)n >= cap ? -1 : 0;
}

/* Splits g_stage into its folder and name: the staging folder is removed
 * relative to DIR, never through a link. */
static void remove_stage(void) {
  if (!g_stage[0]) return;
  char *slash = strrchr(g_stage, '/');
  if (slash) {
    *slash = '\0';
    chorus__remove_entry(g_stage, slash + 1);
  }
  g_stage[0] = 0;
}

/* s is one or more decimal digits followed by tail. */
static int digits_then(const char *s, const char *tail) {
  const char *p = s;
  while (*p >= '0' && *p <= '9') p++;
  return p > s && !strcmp(p, tail);
}

/* A shard of the dataset NAME by the loader's reading of names
 * (chorus_shard_name): NAME_train_<n>.bin, NAME_val_<n>.bin,
 * NAME_train.bin, NAME_val.bin (not NAME_val_train_1.bin, another
 * dataset's). */
static int own_shard(const char *nm, const char *name) {
  size_t k;
  int numbered;
  return chorus_shard_name(nm, &k, &numbered) >= 0 && k == strlen(name) && !strncmp(nm, name, k);
}

/* ".prepare-NAME-HOST-": the staging folders of this dataset made on this
 * host (a folder shared between hosts holds others' too). */
static void stage_prefix(const opts_t *o, char *buf, size_t cap) {
  char host[65] = "host";
  if (gethostname(host, sizeof host - 1) == 0) host[sizeof host - 1] = 0;
  for (char *c = host; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.'))
      *c = '_';
  snprintf(buf, cap, ".prepare-%s-%s-", o->name, host);
}

/* Makes the staging folder DIR/.prepare-NAME-HOST-PID, after removing
 * those of killed runs on this host (their process is gone). */
static void make_stage(const opts_t *o) {
  struct stat sb;
  if (strlen(o->out) > sizeof g_stage - 320) die("%s: the output path is too long", o->out);
  if (mkdir(o->out, 0755) != 0 && errno != EEXIST) die("%s: %s", o->out, strerror(errno));
  if (stat(o->out, &sb) != 0 || !S_ISDIR(sb.st_mode))
    die("%s: not a folder (-o names the folder for the shards)", o->out);
  char why[PATH_CAP + 300];
  if (chorus__dir_check(o->out, "chorus-data", why, sizeof why) < 0) die("%s", why);
  char prefix[320];
  stage_prefix(o, prefix, sizeof prefix);
  const size_t k = strlen(prefix);
  DIR *d = opendir(o->out);
  if (!d) die("%s: cannot list: %s", o->out, strerror(errno));
  for (struct dirent *e; (e = readdir(d));) {
    if (strncmp(e->d_name, prefix, k) || !digits_then(e->d_name + k, "")) continue;
    long pid = strtol(e->d_name + k, NULL, 10);
    /* Only a folder of this user, never through a link (anyone who can
     * write DIR could name a link to a folder of this user so). */
    if (pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH)
      chorus__remove_entry(o->out, e->d_name);
  }
  closedir(d);
  snprintf(g_stage, sizeof g_stage, "%s/%s%ld", o->out, prefix, (long)getpid());
  if (mkdir(g_stage, 0755) != 0) {
    int e = errno;
    g_stage[0] = 0;
    die("%s: cannot make a staging folder there: %s", o->out, strerror(e));
  }
}

/* Renames dir_a/a to dir_b/b.  0, or -1 with errno. */
static int move(const char *dir_a, const char *a, const char *dir_b, const char *b) {
  char from[PATH_CAP], to[PATH_CAP];
  if (join_path(from, sizeof from, dir_a, a) || join_path(to, sizeof to, dir_b, b)) {
    errno = ENAMETOOLONG;
    return -1;
  }
  return rename(from, to);
}

/* Puts the earlier run's shards back (the staging folder's old-*) after
 * removing the shards of this run already moved into DIR. */
static void roll_back(const opts_t *o) {
  DIR *d = opendir(o->out);
  char path[PATH_CAP];
  for (struct dirent *e; d && (e = readdir(d));)
    if (own_shard(e->d_name, o->name) && join_path(path, sizeof path, o->out, e->d_name) == 0)
      unlink(path);
  if (d) closedir(d);
  if (!(d = opendir(g_stage))) return;
  for (struct dirent *e; (e = readdir(d));)
    if (!strncmp(e->d_name, "old-", 4)) move(g_stage, e->d_name, o->out, e->d_name + 4);
  closedir(d);
}

/* Moves the finished files into DIR.  The shards an earlier run left under
 * the same name (they would mix with these) first go into the staging
 * folder as old-*, then the new shards and the tokenizer are renamed in,
 * then the staging folder goes.  A failure on the way puts DIR back as it
 * was; only a kill in the middle of these renames (a few system calls) can
 * leave a part of the new shards. */
static void publish(const opts_t *o) {
  DIR *d = opendir(o->out);
  if (!d) die("%s: cannot list: %s", o->out, strerror(errno));
  int replaced = 0;
  char old[PATH_CAP];
  for (struct dirent *e; (e = readdir(d));) {
    if (!own_shard(e->d_name, o->name)) continue;
    snprintf(old, sizeof old, "old-%s", e->d_name);
    if (move(o->out, e->d_name, g_stage, old) != 0) {
      int err = errno;
      closedir(d);
      roll_back(o);
      die("%s/%s: cannot move an earlier run's shard aside: %s", o->out, e->d_name,
          strerror(err));
    }
    replaced++;
  }
  closedir(d);
  /* Shards first, the tokenizer's files last. */
  for (int pass = 0; pass < 2; pass++) {
    if (!(d = opendir(g_stage))) {
      int err = errno;
      roll_back(o);
      die("%s: cannot list: %s", g_stage, strerror(err));
    }
    for (struct dirent *e; (e = readdir(d));) {
      const char *nm = e->d_name;
      if (!strcmp(nm, ".") || !strcmp(nm, "..") || !strncmp(nm, "old-", 4) ||
          (pass == 0) != own_shard(nm, o->name))
        continue;
      if (move(g_stage, nm, o->out, nm) != 0) {
        int err = errno;
        closedir(d);
        roll_back(o);
        die("%s/%s: cannot move it into %s: %s", g_stage, nm, o->out, strerror(err));
      }
    }
    closedir(d);
  }
  remove_stage(); /* and the earlier run's shards with it */
  if (replaced)
    fprintf(stderr, "chorus-data: replaced %d shard(s) named %s_* of an earlier run in %s\n",
            replaced, o->name, o->out);
  int fd = open(o->out, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd); /* the renames survive a crash */
    close(fd);
  }
}

/* --------------------------------------------------------------- prepare */

static int prepare(const opts_t *o, int ninputs, char **inputs) {
  const double start = now_s();
  if (!o->out) die("prepare: give the output directory with -o DIR");
  if (!o->tokenizer && !o->vocab_size)
    die("prepare: give --tokenizer DIR (encoder.json and vocab.bpe, e.g. GPT-2's) or "
        "--vocab-size N to train a vocabulary on the input");
  g_out_known = stat(o->out, &g_out) == 0;
  for (int i = 0; i < ninputs; i++) {
    struct stat sb;
    if (stat(inputs[i], &sb) != 0) die("%s: %s", inputs[i], strerror(errno));
    if (is_output(&sb)) die("%s: the input is the output folder", inputs[i]);
    if (S_ISDIR(sb.st_mode)) walk(inputs[i], 0);
    else if (S_ISREG(sb.st_mode)) add_file(inputs[i], 0);
    else die("%s: not a regular file (a FIFO, a device or a socket): name text files or folders",
             inputs[i]);
  }
  if (!g_nfiles) die("prepare: no input files");
  /* The validation part is a fraction of the sizes; each file is then
   * mapped in turn (checked, cut into units) and let go: the workers read
   * their units themselves, so a corpus of many files holds no mappings. */
  size_t total = 0, est = 0, seen = 0;
  for (int i = 0; i < g_nfiles; i++) {
    struct stat sb;
    if (stat(g_files[i].path, &sb) == 0) est += (size_t)sb.st_size;
  }
  double cap = 16.0 * 1048576;
  size_t val_bytes = (size_t)((double)est * o->val_fraction);
  if (o->val_fraction > 0 && (double)val_bytes > cap) val_bytes = (size_t)cap;
  int kept = 0;
  for (int i = 0; i < g_nfiles; i++) {
    file_t *f = &g_files[i];
    map_input(f);
    if (!f->len) {
      if (!o->skip_invalid)
        die("%s: an empty file (no text to tokenize; --skip-invalid leaves such files out)",
            f->path);
      fprintf(stderr, "chorus-data: skipped %s: an empty file\n", f->path);
      g_skipped++;
      continue;
    }
    size_t bad = f->jsonl ? f->len : chorus_utf8_check(f->map, f->len);
    if (bad < f->len) {
      if (!o->skip_invalid)
        die("%s: invalid UTF-8 at byte offset %zu (0x%02x); is it text? (convert it, or "
            "--skip-invalid to leave such files out)", f->path, bad, f->map[bad]);
      fprintf(stderr, "chorus-data: skipped %s: invalid UTF-8 at byte offset %zu\n", f->path,
              bad);
      munmap(f->map, f->len);
      f->map = NULL, f->len = 0;
      g_skipped++;
      continue;
    }
    plan_file(i, val_bytes, &seen);
    munmap(f->map, f->len);
    f->map = NULL;
    total += f->len;
    kept++;
  }
  if (!total) die("prepare: the input holds no text");
  make_stage(o);
  fprintf(stderr, "chorus-data: %d file(s), %.1f MB, %zu unit(s), %d thread(s)\n", kept,
          (double)total / 1e6, g_nunits, o->threads);

  chorus_bpe_t *bpe = NULL;
  char err[512];
  const char *how;
  if (o->tokenizer) {
    if (chorus_bpe_load(o->tokenizer, &bpe, err, sizeof err) != CHORUS_OK) die("%s", err);
    how = o->tokenizer;
    if (strcmp(o->tokenizer, o->out) && chorus_bpe_save(bpe, g_stage, err, sizeof err) != CHORUS_OK)
      die("%s", err);
  } else {
    /* Count a sample spread evenly over the input, then learn merges. */
    work_t w = {.o = o};
    unsigned char *take = calloc(g_nunits, 1);
    if (!take) die("out of memory");
    double want = o->vocab_sample_mb * 1e6;
    size_t every = want >= (double)total ? 1 : (size_t)((double)total / want + 0.999), sampled = 0;
    for (size_t u = 0; u < g_nunits; u += every) take[u] = 1, sampled += g_units[u].len;
    w.take = take;
    w.counters = calloc((size_t)o->threads, sizeof *w.counters);
    for (int i = 0; i < o->threads; i++)
      if (!w.counters || chorus_bpe_counter_create(&w.counters[i]) != CHORUS_OK)
        die("out of memory");
    run_units(&w, "counting", total, consume_nothing, NULL);
    for (int i = 1; i < o->threads; i++)
      if (chorus_bpe_counter_merge(w.counters[0], w.counters[i]) != CHORUS_OK) die("out of memory");
    double t0 = now_s();
    if (chorus_bpe_train(w.counters[0], o->vocab_size, &bpe, err, sizeof err) != CHORUS_OK)
      die("training the vocabulary: %s", err);
    fprintf(stderr, "chorus-data: learned %d tokens from %.1f MB of the input in %.1f s\n",
            chorus_bpe_vocab(bpe), (double)sampled / 1e6, now_s() - t0);
    for (int i = 0; i < o->threads; i++) chorus_bpe_counter_free(w.counters[i]);
    free(w.counters);
    free(take);
    if (chorus_bpe_save(bpe, g_stage, err, sizeof err) != CHORUS_OK) die("%s", err);
    how = "trained here";
  }
  work_t w = {.o = o, .bpe = bpe};
  sink_t s = {.o = o, .version = chorus_bpe_vocab(bpe) <= 65536 ? 1 : 2};
  const double t0 = now_s();
  run_units(&w, "prepare", total, consume_tokens, &s);
  close_shard(&s);
  const double dt = now_s() - t0; /* the encoding pass; the summary's last time is all */
  if (!s.train_toks)
    die("prepare: no tokens for training: all %.1f MB of the input went to validation "
        "(--val-fraction %g); give more text or a smaller --val-fraction",
        (double)total / 1e6, o->val_fraction);
  publish(o);
  const size_t toks = s.val_toks + s.train_toks;
  printf("prepared %s: %.1f MB of text in %d file(s)%s -> %zu tokens (%.2f bytes a token): "
         "train %zu in %d shard(s), validation %zu in %d; vocabulary %d (%s), uint%d tokens; "
         "%.1f s, %.1f MB/s, %.2f M tok/s with %d thread(s); %.1f s in all\n",
         o->out, (double)total / 1e6, kept, g_skipped ? " (some skipped, see above)" : "", toks,
         toks ? (double)total / (double)toks : 0.0, s.train_toks, s.train_shards, s.val_toks,
         s.val_shards, chorus_bpe_vocab(bpe), how, s.version == 1 ? 16 : 32, dt,
         (double)total / 1e6 / dt, (double)toks / 1e6 / dt, o->threads, now_s() - start);
  chorus_bpe_free(bpe);
  for (int i = 0; i < g_nfiles; i++) {
    free(g_files[i].path);
  }
  free(g_files);
  free(g_units);
  return 0;
}

/* ----------------------------------------------------------------- check */

/* The vocabulary: --vocab, else --tokenizer's, else the one prepare left
 * beside the shards, else GPT-2's (said, since nothing says it is right). */
static int check(const opts_t *o, const char *spec, int vocab) {
  chorus_bpe_t *bpe = NULL;
  char err[512], dbuf[4096];
  const char *tokdir = o->tokenizer;
  if (!vocab && !tokdir) tokdir = chorus_tokens_tokenizer_dir(spec, dbuf, sizeof dbuf);
  if (!vocab && tokdir) {
    if (chorus_bpe_load(tokdir, &bpe, err, sizeof err) != CHORUS_OK) die("%s", err);
    vocab = chorus_bpe_vocab(bpe);
    chorus_bpe_free(bpe);
    printf("%s: the tokenizer in %s: %d tokens\n", spec, tokdir, vocab);
  }
  if (!vocab) {
    vocab = 50257;
    printf("%s: no tokenizer beside the shards and no --tokenizer or --vocab: checking "
           "against GPT-2's 50257 tokens\n", spec);
  }
  int bad = 0;
  for (int split = 0; split < 2; split++) {
    chorus_tokens_t *d;
    if (chorus_tokens_open(spec, split, CHORUS_TOKENS_LLMC, vocab, &d) != CHORUS_OK ||
        chorus_tokens_check(d) != CHORUS_OK) {
      fprintf(stderr, "chorus-data: %s\n", chorus_train_last_error());
      bad = 1;
      continue;
    }
    printf("%s: %s: %d shard(s), %zu tokens, every one below %d\n", spec,
           split ? "validation" : "train", chorus_tokens_files(d), chorus_tokens_count(d), vocab);
    chorus_tokens_close(d);
  }
  return bad;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: chorus-data prepare INPUT... -o DIR (--tokenizer GPT2DIR | --vocab-size N) "
          "[options]\n"
          "       chorus-data check DIR|GLOB|FILE [--tokenizer DIR | --vocab N]\n\n"
          "prepare: text files, directories (every file under them) and JSON lines\n"
          "(*.jsonl, or --jsonl) into llm.c token shards in DIR:\n"
          "  -o DIR               output (shards, and the tokenizer's encoder.json, vocab.bpe)\n"
          "  --tokenizer DIR      GPT-2's files (encoder.json, vocab.bpe) to encode with\n"
          "  --vocab-size N       or learn a byte-level BPE vocabulary of N tokens here\n"
          "  --vocab-sample MB    learn it from this much of the input, spread over it (200)\n"
          "  --shard-tokens N     tokens per shard (100000000, llm.c's)\n"
          "  --val-fraction F     the input's first F (0-0.9) for validation, at most\n"
          "                       16 MiB (0.1)\n"
          "  --name NAME          shard names NAME_val_000000.bin, NAME_train_000001.bin (data)\n"
          "  --threads N          encoding threads (all cores)\n"
          "  --field NAME         JSON lines: the text field (text)\n"
          "  --skip-invalid       leave out empty files and files that are not UTF-8 (named)\n\n"
          "check: reads every token of a dataset (a folder, a glob or a shard) against\n"
          "the vocabulary: --vocab N, or --tokenizer DIR's, or the tokenizer prepare left\n"
          "beside the shards, or else GPT-2's 50257 (said so)\n\n"
          "examples:\n"
          "  chorus-data prepare data/tinyshakespeare.txt -o runs/data/shakespeare \\\n"
          "      --vocab-size 1024          # learn a 1024-token BPE vocabulary, write shards\n"
          "  chorus-data prepare corpus/ docs.jsonl -o runs/data/web --tokenizer gpt2/\n"
          "  chorus-data check runs/data/shakespeare\n"
          "  chorusrun --standalone -n 2 -- chorus-train --data runs/data/shakespeare\n");
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const char *cmd = argv[1];
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  opts_t o = {.name = "data", .field = "text", .threads = cores > 0 ? (int)cores : 1,
              .val_fraction = 0.1, .vocab_sample_mb = 200, .shard_tokens = 100000000};
  int vocab = 0;
  static const struct option lo[] = {
      {"tokenizer", 1, 0, 't'}, {"vocab-size", 1, 0, 'v'}, {"vocab-sample", 1, 0, 'S'},
      {"shard-tokens", 1, 0, 's'}, {"val-fraction", 1, 0, 'f'}, {"name", 1, 0, 'n'},
      {"threads", 1, 0, 'j'}, {"field", 1, 0, 'F'}, {"skip-invalid", 0, 0, 'k'},
      {"vocab", 1, 0, 'V'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
  optind = 2;
  int c, idx;
  char name[32];
  long long st;
#define P "chorus-data"
  opterr = 0;
  while ((idx = -1, c = getopt_long(argc, argv, ":o:h", lo, &idx)) != -1) {
    snprintf(name, sizeof name, "-%s%s", idx >= 0 ? "-" : "", idx >= 0 ? lo[idx].name : "o");
    int bad = 0;
    switch (c) {
      case 'o': o.out = optarg; break;
      case 't': o.tokenizer = optarg; break;
      case 'v': bad = opt_int(P, name, optarg, 257, 1 << 20, &o.vocab_size); break;
      case 'S': bad = opt_double(P, name, optarg, 0, 1, 1 << 20, &o.vocab_sample_mb); break;
      case 's':
        bad = opt_long(P, name, optarg, 1, INT32_MAX, &st);
        o.shard_tokens = bad ? 0 : (size_t)st;
        break;
      case 'f': bad = opt_double(P, name, optarg, 0, 0, 0.9, &o.val_fraction); break;
      case 'n':
        if (!*optarg || strchr(optarg, '/') || strlen(optarg) > 200) {
          fprintf(stderr, P ": --name '%s': not a name; it takes 1-200 bytes without '/'\n",
                  optarg);
          bad = -1;
        }
        o.name = optarg;
        break;
      case 'j': bad = opt_int(P, name, optarg, 1, 256, &o.threads); break;
      case 'F': o.field = optarg; break;
      case 'k': o.skip_invalid = 1; break;
      case 'V': bad = opt_int(P, name, optarg, 2, 1 << 24, &vocab); break;
      case 'h': usage(stdout); return 0;
      default: opt_getopt_error(P, c, argv); return 2;
    }
    if (bad) return 2;
  }
#undef P
  if (!strcmp(cmd, "prepare")) {
    if (optind >= argc) die("prepare: no INPUT given");
    return prepare(&o, argc - optind, argv + optind);
  }
  if (!strcmp(cmd, "check")) {
    if (optind != argc - 1) die("check: give one DIR, GLOB or FILE");
    return check(&o, argv[optind], vocab);
  }
  fprintf(stderr, "chorus-data: '%s': not a command (prepare or check)\n", cmd);
  opt_see_help("chorus-data");
  return 2;
}
