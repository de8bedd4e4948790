/*
 * dist_ckpt.c - checkpoints of a data-parallel run, written by every rank
 * and readable by any number of ranks at any stage (see chorus_train.h).
 *
 * dir/ckpt-<step, 9 digits>/ holds shard-<r>-of-<N>.bin, one per rank, and
 * index.bin, written last by rank 0.  A shard file holds ranges of the
 * parameter layout: the rank's slices when sharded, a 1/N share of
 * everything under DDP (every rank writes at once).  For each range: the
 * master weights, then the optimizer's m (and v) for them.
 *
 *   shard file: sh_header_t, nranges x {u64 offset, u64 count} (floats of
 *               the layout), the ranges' data in table order, u64 FNV-1a of
 *               all before it.
 *   index:      ix_header_t, world x {u64 bytes, u64 FNV} (each shard file's
 *               size and stored checksum), the caller's extra bytes, u64
 *               FNV-1a of all before it.
 *
 * A checkpoint is complete when its index is.  Loading reads, from every
 * file, the bytes of the ranges this rank needs (its slices, or everything
 * under DDP) into staging buffers while checksumming the whole file; only
 * when every rank has all it needs does any rank change its state.  Rank 0
 * picks the candidate and every rank follows it, newest first, so all load
 * the same one.  The single-file format of chorus_ckpt_save is read the
 * same way (one range covering everything), and chorus_trainer_export
 * writes it, gathering one unit at a time on rank 0.
 */
#include <dirent.h>
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
#include "runtime.h"

chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
#define fail chorus__train_fail

#define SH_MAGIC 0x6873737572686f63ull /* "chorussh" */
#define IX_MAGIC 0x7869737572686f63ull /* "chorusix" */
#define DC_VERSION 1u
#define MAX_WORLD (1u << 20)
#define MAX_EXTRA (1u << 30)

typedef struct {
  uint64_t magic;
  uint32_t version, header;
  int64_t step;
  int32_t shape[5], of; /* of: optimizer floats per parameter (AdamW 2, SGD 1) */
  int64_t opt_steps;
  uint32_t rank, world;
  uint64_t nranges, nparams;
} sh_header_t;

typedef struct {
  uint64_t magic;
  uint32_t version, header;
  int64_t step;
  int32_t shape[5], of;
  uint64_t nparams;
  uint32_t world, stage;
  uint64_t extrabytes;
} ix_header_t;

/* A range of the layout this rank saves or needs: where its parameters
 * are, where its optimizer state starts. */
typedef struct {
  uint64_t off, count;
  float *par;
  size_t soff;
} span_t;

/* A range as a file holds it: byte positions of its three arrays. */
typedef struct {
  uint64_t off, count;
  uint64_t fpar, fm, fv; /* fv: 0 when of == 1 */
} piece_t;

typedef struct {
  chorus_trainer_t *t; /* NULL: one range, below */
  chorus_gpt_t *m;     /* the model (shape and units) */
  chorus_optim_t *opt;
  float *rpar;         /* without a trainer: the floats [rlo, rlo + nstate) */
  size_t rlo;
  chorus_comm_t comm;
  int rank, size, stage, of;
  uint32_t nunits;
  size_t np, nstate; /* floats of the layout; of the optimizer state */
  int32_t shape[5];
} ctx_t;

/* A rank that holds the floats [lo, lo + n) of the layout (a parameter
 * server's range, chorus_ps_*): par, and opt over n floats. */
static void ctx_init_range(ctx_t *c, chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                           float *par, size_t lo, size_t n) {
  memset(c, 0, sizeof *c);
  c->m = m;
  c->opt = opt;
  c->rpar = par;
  c->rlo = lo;
  c->comm = comm;
  c->rank = comm ? chorus_comm_rank(comm) : 0;
  c->size = comm ? chorus_comm_size(comm) : 1;
  c->np = chorus_gpt_num_params(m);
  c->nstate = n;
  size_t blob = chorus_optim_state_size(opt);
  c->of = (int)((blob - sizeof(int64_t)) / (sizeof(float) * (n ? n : 1)));
  chorus__ckpt_shape(m, c->shape);
  c->nunits = (uint32_t)chorus_gpt_num_units(m);
}

/* A trainer's rank: its optimizer state covers its shard (sharded) or the
 * whole layout (DDP); where its ranges are, my_spans says. */
static void ctx_init(ctx_t *c, chorus_trainer_t *t) {
  chorus_fsdp_t *f = chorus_trainer_fsdp(t);
  chorus_gpt_t *m = chorus_trainer_model(t);
  ctx_init_range(c, chorus_trainer_comm(t), m, chorus_trainer_optim(t), NULL, 0,
                 f ? chorus_fsdp_shard_size(f) : chorus_gpt_num_params(m));
  c->t = t;
  c->stage = chorus_trainer_shard(t);
}

/* This rank's spans: its slices (sharded), or for DDP everything when
 * loading and a 1/N share of every unit when saving.  *n of them. */
static span_t *my_spans(const ctx_t *c, int saving, int *n) {
  chorus_gpt_t *m = c->m;
  const int nu = chorus_gpt_num_units(m);
  span_t *s = calloc((size_t)nu + 1, sizeof *s);
  *n = 0;
  if (!s) return NULL;
  if (!c->t) {
    if (c->nstate) s[(*n)++] = (span_t){c->rlo, c->nstate, c->rpar, 0};
    return s;
  }
  chorus_fsdp_t *f = chorus_trainer_fsdp(c->t);
  float *master = chorus_trainer_master(c->t);
  if (!f && !saving) {
    s[(*n)++] = (span_t){0, c->np, master, 0};
    return s;
  }
  for (int i = 0; i < nu; i++) {
    const chorus_gpt_unit_t *u = chorus_gpt_unit(m, i);
    float *p = NULL, *g;
    size_t lo, hi, so = 0, slice;
    chorus__slice(u->size, c->size, c->rank, &lo, &hi);
    if (lo >= hi) continue;
    if (f) chorus_fsdp_slice(f, i, &p, &g, &slice, &so);
    if (f) s[(*n)++] = (span_t){u->offset + lo, hi - lo, p, so};
    else s[(*n)++] = (span_t){u->offset + lo, hi - lo, master + u->offset + lo, u->offset + lo};
  }
  return s;
}

static int mkdirs(const char *dir) {
  char path[4096];
  snprintf(path, sizeof path, "%s", dir);
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0') continue;
    char ch = *p;
    *p = '\0';
    if (mkdir(path, 0755) < 0 && errno != EEXIST) return -1;
    *p = ch;
    if (!ch) break;
  }
  return 0;
}

static void fsync_dir(const char *dir) {
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
}

/* Writes header-and-body pieces to tmp, fsyncs, renames to final.  The
 * checksum of everything goes last; *bytes and *sum get the file's size
 * and that checksum.  0, or -1 with errno. */
typedef struct {
  const void *p;
  size_t n;
} chunk_t;
static int write_file(const char *tmp, const char *final, const chunk_t *ch, int nch,
                      uint64_t *bytes, uint64_t *sum) {
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  uint64_t h = FNV0, total = 0, dummy = FNV0;
  int bad = 0;
  for (int i = 0; i < nch && !bad; i++) {
    bad = ch[i].n && chorus__ckpt_write_all(fd, ch[i].p, ch[i].n, &h);
    total += ch[i].n;
  }
  bad = bad || chorus__ckpt_write_all(fd, &h, sizeof h, &dummy) || fsync(fd) != 0;
  int err = errno;
  if (close(fd) != 0 && !bad) bad = 1, err = errno;
  if (!bad && rename(tmp, final) != 0) bad = 1, err = errno;
  if (bad) {
    unlink(tmp);
    errno = err;
    return -1;
  }
  *bytes = total + sizeof h;
  *sum = h;
  return 0;
}

/* ------------------------------------------------------------- listing */

static void remove_ckpt(const char *dir, const chorus__ckpt_cand_t *c) {
  char path[4096];
  if (!c->dir) {
    snprintf(path, sizeof path, "%s/ckpt-%09ld.bin", dir, c->step);
    unlink(path);
    return;
  }
  snprintf(path, sizeof path, "%s/ckpt-%09ld", dir, c->step);
  DIR *d = opendir(path);
  if (!d) return;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.' && (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2])))
      continue;
    char f[4352];
    snprintf(f, sizeof f, "%s/%s", path, e->d_name);
    unlink(f);
  }
  closedir(d);
  rmdir(path);
}

static int index_exists(const char *dir, long step) {
  char path[4096];
  snprintf(path, sizeof path, "%s/ckpt-%09ld/index.bin", dir, step);
  return access(path, F_OK) == 0;
}

/* ---------------------------------------------------------------- save */

static chorus_result_t coll_fail(const ctx_t *c, chorus_result_t st, const char *what) {
  return fail(st, "chorus_trainer: rank %d: %s: %s", c->rank, what,
              c->comm ? chorus_comm_last_error(c->comm) : "");
}

/* Every rank agrees on ok (0/1): the minimum. */
static chorus_result_t agree(const ctx_t *c, int *ok) {
  if (!c->comm || c->size == 1) return CHORUS_OK;
  int32_t mine = *ok, all = 0;
  chorus_result_t st = chorus_all_reduce(c->comm, &mine, &all, 1, CHORUS_INT32, CHORUS_MIN, NULL);
  if (st != CHORUS_OK) return coll_fail(c, st, "agreeing on the checkpoint");
  *ok = all;
  return CHORUS_OK;
}

/* Writes c's ranges as file `file` of `files` into sdir: its size and
 * checksum into *fbytes, *fsum.  0, or -1 with why. */
static int write_shard(const ctx_t *c, const char *sdir, long step, int file, int files,
                       uint64_t *fbytes, uint64_t *fsum, char *why, size_t cap) {
  char tmp[4200], final[4200];
  int n = 0, ok = 1;
  span_t *sp = my_spans(c, 1, &n);
  const size_t blob_bytes = chorus_optim_state_size(c->opt);
  unsigned char *blob = malloc(blob_bytes);
  uint64_t *table = calloc(2 * (size_t)n + 1, sizeof *table);
  chunk_t *ch = calloc(2 + 3 * (size_t)n, sizeof *ch);
  if (!sp || !blob || !table || !ch) {
    ok = 0;
    snprintf(why, cap, "out of memory");
  }
  if (ok) {
    chorus_optim_state_save(c->opt, blob);
    int64_t opt_steps;
    memcpy(&opt_steps, blob, sizeof opt_steps);
    sh_header_t h = {SH_MAGIC, DC_VERSION, sizeof h, step, {0}, c->of, opt_steps,
                     (uint32_t)file, (uint32_t)files, (uint64_t)n, c->np};
    memcpy(h.shape, c->shape, sizeof h.shape);
    int k = 0;
    ch[k++] = (chunk_t){&h, sizeof h};
    for (int i = 0; i < n; i++) table[2 * i] = sp[i].off, table[2 * i + 1] = sp[i].count;
    ch[k++] = (chunk_t){table, sizeof *table * 2 * (size_t)n};
    const float *mom = (const float *)(blob + sizeof(int64_t));
    for (int i = 0; i < n; i++) {
      ch[k++] = (chunk_t){sp[i].par, sp[i].count * sizeof(float)};
      for (int j = 0; j < c->of; j++)
        ch[k++] = (chunk_t){mom + (size_t)j * c->nstate + sp[i].soff, sp[i].count * sizeof(float)};
    }
    snprintf(tmp, sizeof tmp, "%s/.shard-%05d-of-%05d.tmp.%d", sdir, file, files, (int)getpid());
    snprintf(final, sizeof final, "%s/shard-%05d-of-%05d.bin", sdir, file, files);
    if (write_file(tmp, final, ch, k, fbytes, fsum) != 0) {
      ok = 0;
      snprintf(why, cap, "writing %s: %s", final, strerror(errno));
    }
  }
  free(sp), free(blob), free(table), free(ch);
  return ok ? 0 : -1;
}

/* A checkpoint of `files` files: this rank writes nf of them (cs[i] as
 * file fid[i]), base names its communicator; together the ranks write
 * each file once.  Rank 0 then writes the index. */
static chorus_result_t save_files(const ctx_t *base, int nf, const ctx_t *cs, const int *fid,
                                  int files, const char *dir, long step, const void *extra,
                                  size_t extra_len, int keep) {
  const ctx_t c = *base;
  char sdir[4096], tmp[4200], final[4200], why[4400] = "";
  snprintf(sdir, sizeof sdir, "%s/ckpt-%09ld", dir, step);
  int ok = 1;
  /* per file: bytes, checksum, writers; summed over the ranks */
  int64_t *tab = calloc(3 * (size_t)files + 1, sizeof *tab);
  int32_t of = c.of;
  if (!tab) {
    ok = 0;
    snprintf(why, sizeof why, "out of memory");
  }
  if (ok && mkdirs(sdir) != 0) {
    ok = 0;
    snprintf(why, sizeof why, "mkdir %s: %s", sdir, strerror(errno));
  }
  for (int i = 0; i < nf && ok; i++) {
    uint64_t b = 0, h = 0;
    if (fid[i] < 0 || fid[i] >= files || tab[3 * fid[i] + 2]) {
      ok = 0;
      snprintf(why, sizeof why, "file %d of %d named twice or out of range", fid[i], files);
    } else if (write_shard(&cs[i], sdir, step, fid[i], files, &b, &h, why, sizeof why) != 0) {
      ok = 0;
    } else {
      tab[3 * fid[i]] = (int64_t)b, tab[3 * fid[i] + 1] = (int64_t)h, tab[3 * fid[i] + 2] = 1;
      if (cs[i].of > of) of = cs[i].of;
    }
  }
  if (!ok) fprintf(stderr, "chorus_trainer_save: rank %d: %s\n", c.rank, why);
  chorus_result_t st = agree(&c, &ok);
  if (st != CHORUS_OK || !ok) free(tab);
  if (st != CHORUS_OK) return st;
  if (!ok)
    return fail(CHORUS_ERR_SYSTEM, "chorus_trainer_save: rank %d: checkpoint %s not written: %s",
                c.rank, sdir, why[0] ? why : "another rank could not write its shard (see its "
                "output)");
  /* Every rank learns every file's size, checksum and writers (one
   * writer each: adding the others' zeros changes nothing). */
  if (c.comm && c.size > 1) {
    st = chorus_all_reduce(c.comm, tab, tab, 3 * (size_t)files, CHORUS_INT64, CHORUS_SUM, NULL);
    if (st == CHORUS_OK)
      st = chorus_all_reduce(c.comm, &of, &of, 1, CHORUS_INT32, CHORUS_MAX, NULL);
    if (st != CHORUS_OK) {
      free(tab);
      return coll_fail(&c, st, "learning the shard files' checksums");
    }
  }
  int missing = -1;
  for (int f = 0; f < files && missing < 0; f++)
    if (tab[3 * f + 2] != 1) missing = f;
  if (missing >= 0) {
    const int64_t writers = tab[3 * missing + 2];
    free(tab);
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_save: rank %d: checkpoint %s not "
                "written: file %d of %d was written by %lld ranks, not one", c.rank, sdir,
                missing, files, (long long)writers);
  }
  if (c.rank == 0) {
    uint64_t *all = calloc(2 * (size_t)files, sizeof *all);
    for (int f = 0; all && f < files; f++)
      all[2 * f] = (uint64_t)tab[3 * f], all[2 * f + 1] = (uint64_t)tab[3 * f + 1];
    ix_header_t h = {IX_MAGIC, DC_VERSION, sizeof h, step, {0}, of, c.np, (uint32_t)files,
                     (uint32_t)c.stage, extra_len};
    memcpy(h.shape, c.shape, sizeof h.shape);
    chunk_t ich[3] = {{&h, sizeof h}, {all, 2 * sizeof *all * (size_t)files}, {extra, extra_len}};
    snprintf(tmp, sizeof tmp, "%s/.index.tmp.%d", sdir, (int)getpid());
    snprintf(final, sizeof final, "%s/index.bin", sdir);
    uint64_t b, s;
    if (!all || write_file(tmp, final, ich, 3, &b, &s) != 0) {
      ok = 0;
      snprintf(why, sizeof why, "writing %s: %s", final, all ? strerror(errno) : "out of memory");
      fprintf(stderr, "chorus_trainer_save: rank 0: %s\n", why);
    } else {
      fsync_dir(sdir);
      fsync_dir(dir);
      /* Keep the newest `keep` complete checkpoints; anything older goes,
       * incomplete ones (a crash while writing) included. */
      int nc;
      chorus__ckpt_cand_t *cands = chorus__ckpt_list(dir, &nc);
      int complete = 0;
      for (int i = 0; i < nc; i++) {
        int whole = !cands[i].dir || index_exists(dir, cands[i].step);
        if (cands[i].step > step) continue; /* newer ones are someone else's business */
        if (whole && complete < keep) {
          complete++;
          continue;
        }
        if (cands[i].step == step) continue;
        remove_ckpt(dir, &cands[i]);
      }
      free(cands);
    }
    free(all);
  }
  free(tab);
  if ((st = agree(&c, &ok)) != CHORUS_OK) return st;
  return ok ? CHORUS_OK
            : fail(CHORUS_ERR_SYSTEM, "chorus_trainer_save: rank %d: the index of %s was not "
                   "written (see rank 0's output)", c.rank, sdir);
}

static chorus_result_t save(const ctx_t *c, const char *dir, long step, const void *extra,
                            size_t extra_len, int keep) {
  return save_files(c, 1, c, &c->rank, c->size, dir, step, extra, extra_len, keep);
}

chorus_result_t chorus_trainer_save(chorus_trainer_t *t, const char *dir, long step,
                                    const void *extra, size_t extra_len, int keep) {
  if (!t || !dir || step < 0 || keep < 1 || (extra_len && !extra) || extra_len > MAX_EXTRA)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_save: bad arguments");
  ctx_t c;
  ctx_init(&c, t);
  return save(&c, dir, step, extra, extra_len, keep);
}

chorus_result_t chorus__ckpt_save_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long step, const void *extra, size_t extra_len, int keep) {
  if (!m || !opt || !dir || step < 0 || keep < 1 || (extra_len && !extra) ||
      extra_len > MAX_EXTRA || lo > chorus_gpt_num_params(m) ||
      n > chorus_gpt_num_params(m) - lo)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_save: bad arguments");
  ctx_t c;
  ctx_init_range(&c, comm, m, opt, par, lo, n);
  return save(&c, dir, step, extra, extra_len, keep);
}

chorus_result_t chorus__ckpt_save_ranges(chorus_comm_t comm, chorus_gpt_t *m, int nr,
                                         const chorus__ck_range_t *r, int files, const char *dir,
                                         long step, const void *extra, size_t extra_len,
                                         int keep) {
  const size_t np = m ? chorus_gpt_num_params(m) : 0;
  int bad = !m || !dir || step < 0 || keep < 1 || nr < 0 || files < 1 || (nr && !r) ||
            (extra_len && !extra) || extra_len > MAX_EXTRA || (size_t)files > MAX_WORLD;
  for (int i = 0; !bad && i < nr; i++)
    bad = !r[i].opt || (r[i].n && !r[i].par) || r[i].lo > np || r[i].n > np - r[i].lo;
  ctx_t base, *cs = calloc((size_t)nr + 1, sizeof *cs);
  int *fid = calloc((size_t)nr + 1, sizeof *fid);
  if (bad || !cs || !fid) {
    free(cs), free(fid);
    /* the others must not wait for this rank's part of the agreement */
    if (comm) chorus_comm_abort(comm);
    return fail(bad ? CHORUS_ERR_INVALID_ARG : CHORUS_ERR_NO_MEMORY,
                "chorus_trainer_save: %s", bad ? "bad arguments" : "out of memory");
  }
  for (int i = 0; i < nr; i++) {
    ctx_init_range(&cs[i], comm, m, r[i].opt, r[i].par, r[i].lo, r[i].n);
    fid[i] = r[i].file;
  }
  /* A rank holding nothing still names the communicator and the layout. */
  if (nr) {
    base = cs[0];
  } else {
    memset(&base, 0, sizeof base);
    base.m = m;
    base.comm = comm;
    base.rank = comm ? chorus_comm_rank(comm) : 0;
    base.size = comm ? chorus_comm_size(comm) : 1;
    base.np = np;
    chorus__ckpt_shape(m, base.shape);
    base.nunits = (uint32_t)chorus_gpt_num_units(m);
  }
  chorus_result_t st = save_files(&base, nr, cs, fid, files, dir, step, extra, extra_len, keep);
  free(cs), free(fid);
  return st;
}

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
  int world, stage;     /* who wrote it */
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

/* One shard file of a sharded checkpoint; bytes and sum from the index. */
static int read_shard(stage_t *s, const char *path, long step, uint32_t rank, uint32_t world,
                      uint64_t bytes, uint64_t sum) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
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
             h.nranges > s->c->nunits || h.world != world || h.rank != rank ||
             sizeof h + 16 * h.nranges + 8 > bytes) {
    rc = bad(s, "%s: not a shard of this checkpoint and model", path);
  } else if (h.of != s->c->of) {
    rc = bad(s, "%s: written with an optimizer of %d state floats per parameter, this run's "
             "has %d (AdamW 2, SGD 1)", path, h.of, s->c->of);
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
  int fd = open(path, O_RDONLY | O_CLOEXEC);
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
             h.step != step || h.world < 1 || h.world > MAX_WORLD || h.extrabytes > MAX_EXTRA ||
             (uint64_t)stt.st_size != sizeof h + 16 * (uint64_t)h.world + h.extrabytes + 8)
      rc = bad(s, "%s: not an index of this form", path);
    else if (memcmp(h.shape, s->c->shape, sizeof h.shape) || h.nparams != s->c->np)
      rc = bad(s, "%s: written for another model shape", path);
    else if (h.of != s->c->of)
      rc = bad(s, "%s: written with an optimizer of %d state floats per parameter, this run's "
               "has %d (AdamW 2, SGD 1)", path, h.of, s->c->of);
  }
  if (rc == 0) {
    s->world = (int)h.world;
    s->stage = (int)h.stage;
    s->extra_len = h.extrabytes;
    s->extra = malloc(h.extrabytes + 1);
    if (!s->extra) rc = bad(s, "out of memory");
    else memcpy(s->extra, buf + sizeof h + 16 * (size_t)h.world, h.extrabytes);
  }
  for (uint32_t r = 0; rc == 0 && r < h.world; r++) {
    uint64_t fb, fs;
    memcpy(&fb, buf + sizeof h + 16 * (size_t)r, 8);
    memcpy(&fs, buf + sizeof h + 16 * (size_t)r + 8, 8);
    snprintf(path, sizeof path, "%s/ckpt-%09ld/shard-%05u-of-%05u.bin", dir, step, r, h.world);
    rc = read_shard(s, path, step, r, h.world, fb, fs);
  }
  if (rc == 0) rc = ranges_disjoint(s);
  free(buf);
  return rc;
}

/* A checkpoint of chorus_ckpt_save's single-file format (or an export). */
static int read_single(stage_t *s, const char *dir, long step) {
  char path[4200];
  snprintf(path, sizeof path, "%s/ckpt-%09ld.bin", dir, step);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return bad(s, "%s: %s", path, strerror(errno));
  struct stat stt = {0};
  ck_header_t h = {0};
  int rc = 0;
  const uint64_t np = s->c->np, opt = 8 + 4 * (uint64_t)s->c->of * np;
  if (fstat(fd, &stt) != 0 || pread(fd, &h, sizeof h, 0) != (ssize_t)sizeof h ||
      h.magic != CK_MAGIC || h.version != CK_VERSION || h.header != sizeof h || h.step != step)
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
    s->world = 0;
    s->stage = 0;
    s->extra_len = h.extrabytes;
    s->extra = malloc(h.extrabytes + 1);
    if (!s->extra ||
        pread(fd, s->extra, h.extrabytes, (off_t)(sizeof h + 4 * np + opt)) !=
            (ssize_t)h.extrabytes)
      rc = bad(s, "%s: cannot read its extra bytes", path);
  }
  const uint64_t fpar = sizeof h, fm = fpar + 4 * np + 8;
  piece_t pc = {0, np, fpar, fm, s->c->of > 1 ? fm + 4 * np : 0};
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
  s->sp = my_spans(c, 0, &s->nsp);
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
      st = coll_fail(&c, st, "choosing the checkpoint");
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
    if ((st = agree(&c, &ok)) != CHORUS_OK) {
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
    memcpy(s.blob, &s.opt_steps, sizeof s.opt_steps);
    st = chorus_optim_state_load(c.opt, s.blob, chorus_optim_state_size(c.opt));
    if (st == CHORUS_OK && t) st = chorus_trainer_weights_changed(t);
    if (st == CHORUS_OK) {
      *step = cstep;
      size_t nx = s.extra_len < extra_cap ? (size_t)s.extra_len : extra_cap;
      if (nx) memcpy(extra, s.extra, nx);
      if (extra_len) *extra_len = (size_t)s.extra_len;
      if (info) *info = (chorus_ckpt_info_t){s.world, s.stage, (pick & 1) != 0};
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
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_load: bad arguments");
  ctx_t c;
  ctx_init(&c, t);
  return load(&c, dir, step, extra, extra_cap, extra_len, info);
}

chorus_result_t chorus__ckpt_load_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long *step, void *extra, size_t extra_cap,
                                        size_t *extra_len, chorus_ckpt_info_t *info) {
  if (!m || !opt || !dir || !step || lo > chorus_gpt_num_params(m) ||
      n > chorus_gpt_num_params(m) - lo)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_load: bad arguments");
  ctx_t c;
  ctx_init_range(&c, comm, m, opt, par, lo, n);
  return load(&c, dir, step, extra, extra_cap, extra_len, info);
}

/* -------------------------------------------------------------- export */

chorus_result_t chorus_trainer_export(chorus_trainer_t *t, const char *path, long step,
                                      const void *extra, size_t extra_len) {
  if (!t || !path || step < 0 || (extra_len && !extra))
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_export: bad arguments");
  ctx_t c;
  ctx_init(&c, t);
  chorus_gpt_t *m = chorus_trainer_model(t);
  chorus_fsdp_t *f = chorus_trainer_fsdp(t);
  const size_t blob_bytes = chorus_optim_state_size(chorus_trainer_optim(t));
  unsigned char *blob = malloc(blob_bytes);
  const int nu = chorus_gpt_num_units(m);
  size_t biggest = 0;
  for (int i = 0; i < nu; i++) {
    size_t sl = chorus__slice(chorus_gpt_unit(m, i)->size, c.size, 0, NULL, NULL);
    biggest = sl > biggest ? sl : biggest;
  }
  float *unit = c.rank == 0 && f ? malloc((size_t)c.size * biggest * sizeof(float) + 1) : NULL;
  int ok = blob && (c.rank != 0 || !f || unit);
  char tmp[4200], why[4400] = "out of memory";
  int fd = -1;
  uint64_t h = FNV0;
  /* Nobody may enter the gathers without its buffers. */
  int ready = ok;
  chorus_result_t st = agree(&c, &ready);
  if (st != CHORUS_OK || !ready) {
    free(blob), free(unit);
    return st != CHORUS_OK ? st
                           : fail(CHORUS_ERR_NO_MEMORY, "chorus_trainer_export: rank %d: out of "
                                  "memory (here or on another rank)", c.rank);
  }
  if (ok) chorus_optim_state_save(chorus_trainer_optim(t), blob);
  if (ok && c.rank == 0) {
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ck_header_t hd = {CK_MAGIC, CK_VERSION, sizeof hd, step, {0}, 0, c.np,
                      8 + 4 * (uint64_t)c.of * c.np, extra_len};
    memcpy(hd.shape, c.shape, sizeof hd.shape);
    if (fd < 0 || chorus__ckpt_write_all(fd, &hd, sizeof hd, &h) != 0) {
      ok = 0;
      snprintf(why, sizeof why, "writing %s: %s", tmp, strerror(errno));
    }
  }
  /* Parameters, the step count, m, v: each array unit by unit. */
  const float *mom = (const float *)(blob + sizeof(int64_t));
  for (int a = 0; a < 1 + c.of && st == CHORUS_OK; a++) {
    if (a == 1 && c.rank == 0 && ok && chorus__ckpt_write_all(fd, blob, 8, &h) != 0) {
      ok = 0;
      snprintf(why, sizeof why, "writing %s: %s", tmp, strerror(errno));
    }
    for (int i = 0; i < nu && st == CHORUS_OK; i++) {
      const chorus_gpt_unit_t *u = chorus_gpt_unit(m, i);
      const float *src;
      if (f) {
        float *p, *g;
        size_t n, so;
        chorus_fsdp_slice(f, i, &p, &g, &n, &so);
        src = a == 0 ? p : mom + (size_t)(a - 1) * c.nstate + so;
        /* Everyone sends, whatever happened on rank 0: the gathers must match. */
        st = chorus_gather(c.comm, src, unit, n, CHORUS_FLOAT32, 0, NULL);
        src = unit;
      } else {
        src = a == 0 ? chorus_trainer_master(t) + u->offset
                     : mom + (size_t)(a - 1) * c.nstate + u->offset;
      }
      if (st == CHORUS_OK && c.rank == 0 && ok &&
          chorus__ckpt_write_all(fd, src, u->size * sizeof(float), &h) != 0) {
        ok = 0;
        snprintf(why, sizeof why, "writing %s: %s", tmp, strerror(errno));
      }
    }
  }
  if (st != CHORUS_OK) {
    if (fd >= 0) close(fd), unlink(tmp);
    free(blob), free(unit);
    return coll_fail(&c, st, "gathering the state for the export");
  }
  if (c.rank == 0 && ok) {
    uint64_t dummy = FNV0, sum;
    if ((extra_len && chorus__ckpt_write_all(fd, extra, extra_len, &h) != 0) ||
        (sum = h, chorus__ckpt_write_all(fd, &sum, sizeof sum, &dummy) != 0) || fsync(fd) != 0 ||
        close(fd) != 0 || (fd = -1, rename(tmp, path) != 0)) {
      ok = 0;
      snprintf(why, sizeof why, "writing %s: %s", path, strerror(errno));
    }
    fd = -1;
  }
  if (fd >= 0) close(fd);
  if (!ok && c.rank == 0) unlink(tmp);
  free(blob), free(unit);
  if ((st = agree(&c, &ok)) != CHORUS_OK) return st;
  return ok ? CHORUS_OK
            : fail(CHORUS_ERR_SYSTEM, "chorus_trainer_export: rank %d: %s", c.rank,
                   c.rank == 0 ? why : "rank 0 could not write the file (see its output)");
}

