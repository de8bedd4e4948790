/*
 * dist_ckpt_load.c - reading a checkpoint (chorus_trainer_load, and a
 * parameter server's range): sharded or single-file, written at any stage
 * and by any world, into this rank's state.
 *
 * A checkpoint is complete when its index is.  Loading reads, from every
 * file, the bytes of the ranges this rank needs (its slices, or everything
 * under DDP) into staging buffers while checksumming the whole file; only
 * when every rank has all it needs does any rank change its state.  Rank 0
 * picks the candidate and every rank follows it, newest first, so all load
 * the same one.  The single-file format of chorus_ckpt_save is read the
 * same way (one range covering everything).  The formats: dist_ckpt.h and
 * ckpt.h.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "train/ckpt.h"
#include "train/dist_ckpt.h"
#include "runtime.h"

/* ---------------------------------------------------------------- load */

/* What one rank collects while reading a checkpoint. */
typedef struct {
  const ctx_t *c;
  span_t *sp;
  int nsp;
  float *par;           /* staged parameters, the spans' floats in order */
  size_t *par_at;       /* span i's first float in par */
  unsigned char *blob;  /* staged optimizer state (chorus_optim_state_load's layout) */
  uint64_t covered;     /* bytes of parameters staged */
  int64_t opt_steps;    /* -1: not seen yet */
  unsigned char *extra; /* the caller's bytes */
  uint64_t extra_len;
  int files, stage;     /* how many files it has; the writers' stage */
  int of;               /* its optimizer floats per parameter */
  uint64_t *seen;       /* every range of every file: offset, count */
  size_t nseen, capseen;
  char why[512];
} stage_t;

static int bad(stage_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Notes a range a file holds; the ranges of one checkpoint must not
 * overlap (checked once all are read), so that the bytes staged, counted,
 * are the bytes needed, each once. */
static int note_range(stage_t *s, uint64_t off, uint64_t cnt) {
  if (s->nseen == s->capseen) {
    size_t cap = s->capseen ? 2 * s->capseen : 64;
    uint64_t *n = realloc(s->seen, 2 * cap * sizeof *n);
    if (!n) return -1;
    s->seen = n, s->capseen = cap;
  }
  s->seen[2 * s->nseen] = off, s->seen[2 * s->nseen + 1] = cnt;
  s->nseen++;
  return 0;
}
static int cmp_range(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}
static int ranges_disjoint(stage_t *s) {
  qsort(s->seen, s->nseen, 2 * sizeof *s->seen, cmp_range);
  for (size_t i = 1; i < s->nseen; i++)
    if (s->seen[2 * (i - 1)] + s->seen[2 * (i - 1) + 1] > s->seen[2 * i])
      return bad(s, "the checkpoint's files hold overlapping ranges (at float %llu): not one "
                 "this runtime wrote", (unsigned long long)s->seen[2 * i]);
  return 0;
}

static int bad(stage_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(stage_t *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->why, sizeof s->why, fmt, ap);
  va_end(ap);
  return -1;
}

/* Copies the bytes of [fpos, fpos + len) of a file that belong to one of
 * the piece's arrays (which = 0 parameters, 1 m, 2 v) into the stage. */
static void take(stage_t *s, const piece_t *p, int which, uint64_t fpos, const unsigned char *b,
                 size_t len) {
  const uint64_t base = which == 0 ? p->fpar : which == 1 ? p->fm : p->fv;
  const uint64_t lo = fpos > base ? fpos : base;
  const uint64_t hi = fpos + len < base + 4 * p->count ? fpos + len : base + 4 * p->count;
  if (lo >= hi) return;
  /* [lo, hi) in global bytes of the layout: */
  const uint64_t g0 = 4 * p->off + (lo - base), g1 = g0 + (hi - lo);
  for (int i = 0; i < s->nsp; i++) {
    const span_t *sp = &s->sp[i];
    uint64_t a = g0 > 4 * sp->off ? g0 : 4 * sp->off;
    uint64_t z = g1 < 4 * (sp->off + sp->count) ? g1 : 4 * (sp->off + sp->count);
    if (a >= z) continue;
    const unsigned char *src = b + (lo - fpos) + (a - g0);
    if (which == 0) {
      memcpy((unsigned char *)(s->par + s->par_at[i]) + (a - 4 * sp->off), src, z - a);
      s->covered += z - a;
    } else {
      unsigned char *mom = s->blob + sizeof(int64_t) +
                           sizeof(float) * ((size_t)(which - 1) * s->c->nstate + sp->soff);
      memcpy(mom + (a - 4 * sp->off), src, z - a);
    }
  }
}

/* Streams a whole file: checks its checksum (the last 8 bytes) and hands
 * the pieces' bytes to take().  *sum gets the stored checksum. */
static int read_pieces(stage_t *s, const char *path, int fd, uint64_t size, const piece_t *pc,
                       int npc, uint64_t *sum) {
  enum { CHUNK = 1 << 20 };
  unsigned char *buf = malloc(CHUNK);
  if (!buf) return bad(s, "out of memory");
  if (lseek(fd, 0, SEEK_SET) != 0) {
    free(buf);
    return bad(s, "%s: %s", path, strerror(errno));
  }
  uint64_t h = FNV0, pos = 0, body = size - 8;
  int rc = 0;
  while (pos < body && rc == 0) {
    size_t want = body - pos < CHUNK ? (size_t)(body - pos) : CHUNK;
    ssize_t got = read(fd, buf, want);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      rc = bad(s, "%s: short read at byte %llu", path, (unsigned long long)pos);
      break;
    }
    h = chorus__fnv(h, buf, (size_t)got);
    for (int i = 0; i < npc; i++)
      for (int w = 0; w < 1 + s->c->of; w++) take(s, &pc[i], w, pos, buf, (size_t)got);
    pos += (uint64_t)got;
  }
  uint64_t stored = 0;
  if (rc == 0 && pread(fd, &stored, sizeof stored, (off_t)body) != (ssize_t)sizeof stored)
    rc = bad(s, "%s: cannot read its checksum", path);
  if (rc == 0 && stored != h) rc = bad(s, "%s: checksum mismatch (torn or corrupt)", path);
  free(buf);
  *sum = stored;
  return rc;
}

static int note_opt_steps(stage_t *s, int64_t n, const char *path) {
  if (n < 0) return bad(s, "%s: negative optimizer step count", path);
  if (s->opt_steps >= 0 && s->opt_steps != n)
    return bad(s, "%s: optimizer step count %lld, another file says %lld", path, (long long)n,
               (long long)s->opt_steps);
  s->opt_steps = n;
  return 0;
}

/* File `file` of a sharded checkpoint's `files`; bytes and sum from the
 * index. */
static int read_shard(stage_t *s, const char *path, long step, uint32_t file, uint32_t files,
                      uint64_t bytes, uint64_t sum) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO: no hang */
  if (fd < 0) return bad(s, "%s: %s", path, strerror(errno));
  struct stat stt = {0};
  sh_header_t h = {0};
  int rc = 0;
  piece_t *pc = NULL;
  uint64_t *table = NULL;
  if (fstat(fd, &stt) != 0 || (uint64_t)stt.st_size != bytes) {
    rc = bad(s, "%s: %lld bytes, the index says %llu", path, (long long)stt.st_size,
             (unsigned long long)bytes);
  } else if (pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h || h.magic != SH_MAGIC ||
             h.version != DC_VERSION || h.header != sizeof h || h.step != step ||
             memcmp(h.shape, s->c->shape, sizeof h.shape) || h.nparams != s->c->np ||
             h.nranges > s->c->nunits || h.files != files || h.file != file ||
             sizeof h + 16 * h.nranges + 8 > bytes) {
    rc = bad(s, "%s: not a shard of this checkpoint and model", path);
  } else if (h.of != s->of) {
    rc = bad(s, "%s: written with an optimizer of %d state floats per parameter, the index "
             "says %d", path, h.of, s->of);
  }
  if (rc == 0) {
    table = calloc(2 * h.nranges + 1, sizeof *table);
    pc = calloc(h.nranges + 1, sizeof *pc);
    if (!table || !pc) rc = bad(s, "out of memory");
    else if (pread(fd, table, sizeof *table * 2 * h.nranges, sizeof h) !=
             (ssize_t)(sizeof *table * 2 * h.nranges))
      rc = bad(s, "%s: short range table", path);
  }
  uint64_t pos = sizeof h + sizeof *table * 2 * h.nranges;
  for (uint64_t i = 0; rc == 0 && i < h.nranges; i++) {
    uint64_t off = table[2 * i], cnt = table[2 * i + 1];
    if (cnt == 0 || off > s->c->np || cnt > s->c->np - off || note_range(s, off, cnt) != 0) {
      rc = bad(s, "%s: range %llu (+%llu floats) is outside the model's %zu", path,
               (unsigned long long)off, (unsigned long long)cnt, s->c->np);
      break;
    }
    pc[i] = (piece_t){off, cnt, pos, pos + 4 * cnt, h.of > 1 ? pos + 8 * cnt : 0};
    pos += 4 * cnt * (1 + (uint64_t)h.of);
  }
  if (rc == 0 && pos + 8 != bytes) rc = bad(s, "%s: its ranges do not add up to its size", path);
  /* A trainer's ranks step their optimizers together: every file must say
   * the same.  Parameter servers step theirs apart (chorus_ps_*): a range
   * takes the count of the files it comes from (the largest of them). */
  if (rc == 0 && s->c->t) rc = note_opt_steps(s, h.opt_steps, path);
  if (rc == 0 && h.opt_steps < 0) rc = bad(s, "%s: negative optimizer step count", path);
  const uint64_t before = s->covered;
  uint64_t stored;
  if (rc == 0) rc = read_pieces(s, path, fd, bytes, pc, (int)h.nranges, &stored);
  if (rc == 0 && !s->c->t && s->covered > before && h.opt_steps > s->opt_steps)
    s->opt_steps = h.opt_steps;
  if (rc == 0 && stored != sum) rc = bad(s, "%s: not the file the index names", path);
  free(table);
  free(pc);
  close(fd);
  return rc;
}

static int read_sharded(stage_t *s, const char *dir, long step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/ckpt-%09ld/index.bin", dir, step);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO: no hang */
  if (fd < 0) return bad(s, "%s: %s", path, strerror(errno));
  struct stat stt = {0};
  ix_header_t h = {0};
  unsigned char *buf = NULL;
  int rc = 0;
  if (fstat(fd, &stt) != 0 || stt.st_size < (off_t)(sizeof h + 8) ||
      stt.st_size > (off_t)(sizeof h + 16 * (uint64_t)MAX_WORLD + MAX_EXTRA + 8)) {
    rc = bad(s, "%s: implausible size", path);
  } else if (!(buf = malloc((size_t)stt.st_size)) ||
             pread(fd, buf, (size_t)stt.st_size, 0) != (ssize_t)stt.st_size) {
    rc = bad(s, "%s: cannot read it", path);
  }
  close(fd);
  if (rc == 0) {
    memcpy(&h, buf, sizeof h);
    uint64_t stored;
    memcpy(&stored, buf + stt.st_size - 8, 8);
    if (chorus__fnv(FNV0, buf, (size_t)stt.st_size - 8) != stored)
      rc = bad(s, "%s: checksum mismatch", path);
    else if (h.magic != IX_MAGIC || h.version != DC_VERSION || h.header != sizeof h ||
             h.step != step || h.files < 1 || h.files > MAX_WORLD || h.of < 1 || h.of > 2 ||
             h.extrabytes > MAX_EXTRA ||
             (uint64_t)stt.st_size != sizeof h + 16 * (uint64_t)h.files + h.extrabytes + 8)
      rc = bad(s, "%s: not an index of this form", path);
    else if (memcmp(h.shape, s->c->shape, sizeof h.shape) || h.nparams != s->c->np)
      rc = bad(s, "%s: written for another model shape", path);
    else if (s->c->of && h.of != s->c->of) /* of 0: an empty range, nothing to fill */
      rc = bad(s, "%s: written with an optimizer of %d state floats per parameter, this run's "
               "has %d (AdamW 2, SGD 1)", path, h.of, s->c->of);
  }
  if (rc == 0) {
    s->files = (int)h.files;
    s->stage = (int)h.stage;
    s->of = h.of;
    s->extra_len = h.extrabytes;
    s->extra = malloc(h.extrabytes + 1);
    if (!s->extra) rc = bad(s, "out of memory");
    else memcpy(s->extra, buf + sizeof h + 16 * (size_t)h.files, h.extrabytes);
  }
  /* File f of the index's table is shard-f-of-<files>, which says so in
   * its header: a trainer's rank f, or a parameter server's range. */
  for (uint32_t f = 0; rc == 0 && f < h.files; f++) {
    uint64_t fb, fs;
    memcpy(&fb, buf + sizeof h + 16 * (size_t)f, 8);
    memcpy(&fs, buf + sizeof h + 16 * (size_t)f + 8, 8);
    snprintf(path, sizeof path, "%s/ckpt-%09ld/shard-%05u-of-%05u.bin", dir, step, f, h.files);
    rc = read_shard(s, path, step, f, h.files, fb, fs);
  }
  if (rc == 0) rc = ranges_disjoint(s);
  free(buf);
  return rc;
}

/* A checkpoint of chorus_ckpt_save's single-file format (or an export). */
static int read_single(stage_t *s, const char *dir, long step) {
  char path[4200];
  if (chorus__ckpt_file(path, sizeof path, dir, step) != 0) return bad(s, "%s: too long a name", dir);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO: no hang */
  if (fd < 0) return bad(s, "%s: %s", path, strerror(errno));
  struct stat stt = {0};
  ck_header_t h = {0};
  int rc = 0;
  const int ok = fstat(fd, &stt) == 0 && pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h;
  /* An empty range (of 0) has nothing to fill: the file's own kind. */
  const uint64_t np = s->c->np;
  const int of = s->c->of ? s->c->of : h.optbytes == 8 + 8 * np ? 2 : 1;
  const uint64_t opt = 8 + 4 * (uint64_t)of * np;
  if (!ok || h.magic != CK_MAGIC || h.version != CK_VERSION || h.header != sizeof h ||
      h.step != step)
    rc = bad(s, "%s: not a checkpoint", path);
  else if (memcmp(h.shape, s->c->shape, sizeof h.shape) || h.nparams != np)
    rc = bad(s, "%s: written for another model shape", path);
  else if (h.optbytes != opt)
    rc = bad(s, "%s: its optimizer state is %llu bytes, this run's optimizer needs %llu",
             path, (unsigned long long)h.optbytes, (unsigned long long)opt);
  else if (h.extrabytes > MAX_EXTRA ||
           (uint64_t)stt.st_size != sizeof h + 4 * np + opt + h.extrabytes + 8)
    rc = bad(s, "%s: its size does not match its header (torn?)", path);
  int64_t steps = 0;
  if (rc == 0 && pread(fd, &steps, 8, (off_t)(sizeof h + 4 * np)) != 8)
    rc = bad(s, "%s: short read", path);
  if (rc == 0) rc = note_opt_steps(s, steps, path);
  if (rc == 0) {
    s->files = 0;
    s->stage = 0;
    s->of = of;
    s->extra_len = h.extrabytes;
    s->extra = malloc(h.extrabytes + 1);
    if (!s->extra ||
        pread(fd, s->extra, h.extrabytes, (off_t)(sizeof h + 4 * np + opt)) !=
            (ssize_t)h.extrabytes)
      rc = bad(s, "%s: cannot read its extra bytes", path);
  }
  const uint64_t fpar = sizeof h, fm = fpar + 4 * np + 8;
  piece_t pc = {0, np, fpar, fm, of > 1 ? fm + 4 * np : 0};
  uint64_t stored;
  if (rc == 0) rc = read_pieces(s, path, fd, (uint64_t)stt.st_size, &pc, 1, &stored);
  close(fd);
  return rc;
}

static void stage_free(stage_t *s) {
  free(s->sp);
  free(s->par);
  free(s->par_at);
  free(s->blob);
  free(s->extra);
  free(s->seen);
}

/* Fresh staging buffers for one attempt. */
static int stage_init(stage_t *s, const ctx_t *c) {
  memset(s, 0, sizeof *s);
  s->c = c;
  s->opt_steps = -1;
  s->sp = chorus__ckpt_my_spans(c, 0, &s->nsp);
  s->par_at = calloc((size_t)s->nsp + 1, sizeof *s->par_at);
  size_t total = 0;
  for (int i = 0; s->sp && s->par_at && i < s->nsp; i++) s->par_at[i] = total, total += s->sp[i].count;
  s->par = malloc(total * sizeof(float) + 1);
  s->blob = calloc(1, chorus_optim_state_size(c->opt));
  if (!s->sp || !s->par_at || !s->par || !s->blob) return bad(s, "out of memory");
  return 0;
}

static chorus_result_t load(const ctx_t *cp, const char *dir, long *step, void *extra,
                            size_t extra_cap, size_t *extra_len, chorus_ckpt_info_t *info) {
  const ctx_t c = *cp;
  chorus_trainer_t *t = c.t;
  *step = -1;
  if (extra_len) *extra_len = 0;
  int nc = 0;
  chorus__ckpt_cand_t *cs = chorus__ckpt_list(dir, &nc); /* rank 0's list is the one followed */
  chorus_result_t st = CHORUS_OK;
  char last_why[512] = "";
  for (int i = 0;; i++) {
    /* Rank 0 names the next candidate: step * 2 + sharded, or -1. */
    int64_t pick = c.rank == 0 ? (i < nc ? 2 * (int64_t)cs[i].step + cs[i].dir : -1) : 0;
    if (c.comm && c.size > 1 &&
        (st = chorus_broadcast(c.comm, &pick, 1, CHORUS_INT64, 0, NULL)) != CHORUS_OK) {
      st = chorus__ckpt_coll_fail(&c, st, "choosing the checkpoint");
      break;
    }
    if (pick < 0) break; /* none usable: start fresh */
    const long cstep = (long)(pick / 2);
    stage_t s;
    int ok = stage_init(&s, &c) == 0 &&
             ((pick & 1) ? read_sharded(&s, dir, cstep) : read_single(&s, dir, cstep)) == 0;
    uint64_t want = 0;
    for (int k = 0; ok && k < s.nsp; k++) want += 4 * s.sp[k].count;
    if (ok && s.covered != want)
      ok = bad(&s, "the files cover %llu of the %llu parameter bytes this rank needs",
               (unsigned long long)s.covered, (unsigned long long)want) == 0;
    if (!ok) {
      snprintf(last_why, sizeof last_why, "%s", s.why);
      fprintf(stderr, "chorus_trainer_load: rank %d: %s/ckpt-%09ld%s is unusable: %s\n", c.rank,
              dir, cstep, (pick & 1) ? "" : ".bin", s.why);
    }
    if ((st = chorus__ckpt_agree(&c, &ok)) != CHORUS_OK) {
      stage_free(&s);
      break;
    }
    if (!ok) {
      stage_free(&s);
      continue; /* the previous one */
    }
    /* Every rank has all it needs: now change the state -- at stage 3
     * after letting go of gathered units (no gather may still read a
     * slice while it is overwritten). */
    if (t && c.stage == 3 && (st = chorus_trainer_weights_changed(t)) != CHORUS_OK) {
      stage_free(&s);
      break;
    }
    for (int k = 0; k < s.nsp; k++)
      memcpy(s.sp[k].par, s.par + s.par_at[k], s.sp[k].count * sizeof(float));
    /* No file covers an empty range: its count stays 0. */
    if (s.opt_steps < 0) s.opt_steps = 0;
    memcpy(s.blob, &s.opt_steps, sizeof s.opt_steps);
    st = chorus_optim_state_load(c.opt, s.blob, chorus_optim_state_size(c.opt));
    if (st == CHORUS_OK && t) st = chorus_trainer_weights_changed(t);
    if (st == CHORUS_OK) {
      *step = cstep;
      size_t nx = s.extra_len < extra_cap ? (size_t)s.extra_len : extra_cap;
      if (nx) memcpy(extra, s.extra, nx);
      if (extra_len) *extra_len = (size_t)s.extra_len;
      if (info) *info = (chorus_ckpt_info_t){s.files, s.stage, (pick & 1) != 0};
    }
    stage_free(&s);
    break;
  }
  free(cs);
  (void)last_why;
  return st;
}

chorus_result_t chorus_trainer_load(chorus_trainer_t *t, const char *dir, long *step,
                                    void *extra, size_t extra_cap, size_t *extra_len,
                                    chorus_ckpt_info_t *info) {
  if (!t || !dir || !step)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_load: bad arguments");
  ctx_t c;
  chorus__ckpt_ctx_init(&c, t);
  return load(&c, dir, step, extra, extra_cap, extra_len, info);
}

chorus_result_t chorus__ckpt_load_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long *step, void *extra, size_t extra_cap,
                                        size_t *extra_len, chorus_ckpt_info_t *info) {
  if (!m || !opt || !dir || !step || lo > chorus_gpt_num_params(m) ||
      n > chorus_gpt_num_params(m) - lo)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_load: bad arguments");
  ctx_t c;
  chorus__ckpt_ctx_init_range(&c, comm, m, opt, par, lo, n);
  return load(&c, dir, step, extra, extra_cap, extra_len, info);
}
