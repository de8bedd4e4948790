/*
 * dist_ckpt.c - writing checkpoints of a data-parallel run, every rank its
 * file (chorus_trainer_save, and a parameter server's ranges), and the
 * single-file export (chorus_trainer_export, gathering one unit at a time
 * on rank 0); see chorus_train.h.  The format: dist_ckpt.h; reading it:
 * dist_ckpt_load.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "train/ckpt.h"
#include "train/dist_ckpt.h"
#include "runtime.h"

/* ------------------------------------------------------------- context */

/* A rank of comm with no state of its own yet: the model and the rank. */
static void ctx_init_comm(ctx_t *c, chorus_comm_t comm, chorus_gpt_t *m) {
  memset(c, 0, sizeof *c);
  c->m = m;
  c->comm = comm;
  c->rank = comm ? chorus_comm_rank(comm) : 0;
  c->size = comm ? chorus_comm_size(comm) : 1;
  c->file = c->rank;
  c->np = chorus_gpt_num_params(m);
  chorus__ckpt_shape(m, c->shape);
  c->nunits = (uint32_t)chorus_gpt_num_units(m);
}

/* A rank that holds the floats [lo, lo + n) of the layout (a parameter
 * server's range, chorus_ps_*): par, and opt over n floats.  An empty
 * range cannot show its optimizer's kind: of is 0. */
void chorus__ckpt_ctx_init_range(ctx_t *c, chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                 float *par, size_t lo, size_t n) {
  ctx_init_comm(c, comm, m);
  c->opt = opt;
  c->rpar = par;
  c->rlo = lo;
  c->nstate = n;
  size_t blob = chorus_optim_state_size(opt);
  c->of = (int)((blob - sizeof(int64_t)) / (sizeof(float) * (n ? n : 1)));
}

/* A trainer's rank: its optimizer state covers its shard (sharded) or the
 * whole layout (DDP); where its ranges are, my_spans says. */
void chorus__ckpt_ctx_init(ctx_t *c, chorus_trainer_t *t) {
  chorus_fsdp_t *f = chorus_trainer_fsdp(t);
  chorus_gpt_t *m = chorus_trainer_model(t);
  chorus__ckpt_ctx_init_range(c, chorus_trainer_comm(t), m, chorus_trainer_optim(t), NULL, 0,
                              f ? chorus_fsdp_shard_size(f) : chorus_gpt_num_params(m));
  c->t = t;
  c->stage = chorus_trainer_shard(t);
}

/* This rank's spans: its slices (sharded), or for DDP everything when
 * loading and a 1/N share of every unit when saving.  *n of them. */
span_t *chorus__ckpt_my_spans(const ctx_t *c, int saving, int *n) {
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

chorus_result_t chorus__ckpt_coll_fail(const ctx_t *c, chorus_result_t st, const char *what) {
  return chorus__train_fail(st, "chorus_trainer: rank %d: %s: %s", c->rank, what,
                            c->comm ? chorus_comm_last_error(c->comm) : "");
}

/* Every rank agrees on ok (0/1): the minimum. */
chorus_result_t chorus__ckpt_agree(const ctx_t *c, int *ok) {
  if (!c->comm || c->size == 1) return CHORUS_OK;
  int32_t mine = *ok, all = 0;
  chorus_result_t st = chorus_all_reduce(c->comm, &mine, &all, 1, CHORUS_INT32, CHORUS_MIN, NULL);
  if (st != CHORUS_OK) return chorus__ckpt_coll_fail(c, st, "agreeing on the checkpoint");
  *ok = all;
  return CHORUS_OK;
}

/* ------------------------------------------------------------- writing */

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
  int fd = chorus__create_new(tmp, 0644);
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

/* Never through a link: another user who can write dir may have named one
 * like a checkpoint (chorus__remove_entry). */
static void remove_ckpt(const char *dir, const chorus__ckpt_cand_t *c) {
  char name[64];
  snprintf(name, sizeof name, c->dir ? "ckpt-%09ld" : "ckpt-%09ld.bin", c->step);
  chorus__remove_entry(dir, name);
}

static int index_exists(const char *dir, long step) {
  char path[4096];
  snprintf(path, sizeof path, "%s/ckpt-%09ld/index.bin", dir, step);
  return access(path, F_OK) == 0;
}

/* ---------------------------------------------------------------- save */

/* n int64s of every rank combined by op into out (a copy when alone).
 * SUM wraps (src/reduce), so a slot only one rank fills arrives exact,
 * whatever its bits: the checksums travel this way. */
static chorus_result_t reduce64(const ctx_t *c, const void *in, void *out, size_t n,
                                chorus_op_t op, const char *what) {
  if (!c->comm || c->size == 1) {
    if (n) memcpy(out, in, n * sizeof(int64_t));
    return CHORUS_OK;
  }
  chorus_result_t st = chorus_all_reduce(c->comm, in, out, n, CHORUS_INT64, op, NULL);
  return st == CHORUS_OK ? CHORUS_OK : chorus__ckpt_coll_fail(c, st, what);
}

/* Writes fc's ranges (my_spans) as file fc->file of `files` into sdir, with
 * `of` optimizer floats per parameter; *bytes and *sum get its size and
 * checksum.  0, or -1 with why. */
static int write_shard(const ctx_t *fc, const char *sdir, long step, int files, int of,
                       uint64_t *bytes, uint64_t *sum, char *why, size_t cap) {
  char tmp[4200], final[4200];
  int n = 0, ok = 1;
  span_t *sp = chorus__ckpt_my_spans(fc, 1, &n);
  unsigned char *blob = malloc(chorus_optim_state_size(fc->opt));
  uint64_t *table = calloc(2 * (size_t)n + 1, sizeof *table);
  chunk_t *ch = calloc(2 + 3 * (size_t)n, sizeof *ch);
  if (!sp || !blob || !table || !ch) {
    ok = 0;
    snprintf(why, cap, "out of memory");
  }
  if (ok) {
    chorus_optim_state_save(fc->opt, blob);
    int64_t opt_steps;
    memcpy(&opt_steps, blob, sizeof opt_steps);
    sh_header_t h = {SH_MAGIC, DC_VERSION, sizeof h, step, {0}, of, opt_steps,
                     (uint32_t)fc->file, (uint32_t)files, (uint64_t)n, fc->np};
    memcpy(h.shape, fc->shape, sizeof h.shape);
    int k = 0;
    ch[k++] = (chunk_t){&h, sizeof h};
    for (int i = 0; i < n; i++) table[2 * i] = sp[i].off, table[2 * i + 1] = sp[i].count;
    ch[k++] = (chunk_t){table, sizeof *table * 2 * (size_t)n};
    const float *mom = (const float *)(blob + sizeof(int64_t));
    for (int i = 0; i < n; i++) {
      ch[k++] = (chunk_t){sp[i].par, sp[i].count * sizeof(float)};
      for (int j = 0; j < of; j++)
        ch[k++] = (chunk_t){mom + (size_t)j * fc->nstate + sp[i].soff, sp[i].count * sizeof(float)};
    }
    snprintf(tmp, sizeof tmp, "%s/.shard-%05d-of-%05d.tmp.%d", sdir, fc->file, files,
             (int)getpid());
    snprintf(final, sizeof final, "%s/shard-%05d-of-%05d.bin", sdir, fc->file, files);
    if (write_file(tmp, final, ch, k, bytes, sum) != 0) {
      ok = 0;
      snprintf(why, cap, "writing %s: %s", final, strerror(errno));
    }
  }
  free(sp), free(blob), free(table), free(ch);
  return ok ? 0 : -1;
}

/* Names, into why, the files not held exactly once (n[f] ranks hold file f):
 * a few of each kind, and how many there are. */
static void name_files(const int64_t *n, int files, char *why, size_t cap) {
  size_t at = 0;
  for (int dup = 0; dup < 2; dup++) {
    int count = 0;
    for (int f = 0; f < files; f++) count += dup ? n[f] > 1 : n[f] < 1;
    if (!count) continue;
    at += (size_t)snprintf(why + at, at < cap ? cap - at : 0, "%s%d file(s) %s:", at ? "; " : "",
                           count, dup ? "held by more than one rank" : "held by no rank");
    int shown = 0;
    for (int f = 0; f < files && shown < 8; f++)
      if (dup ? n[f] > 1 : n[f] < 1)
        at += (size_t)snprintf(why + at, at < cap ? cap - at : 0, " %d", f), shown++;
    if (count > shown) at += (size_t)snprintf(why + at, at < cap ? cap - at : 0, " ...");
  }
  if (at < cap) snprintf(why + at, cap - at, " (of %d)", files);
}

/* The checkpoint of step.  This rank writes nf files, fc[i]'s ranges as
 * file fc[i].file of `files` (none: it only takes part in the agreements);
 * rank 0 writes the index, c (the communicator, model and stage) the same
 * on every rank.  bad: why this rank's arguments are wrong (NULL: they are
 * not); every rank then fails before any file is written. */
static chorus_result_t save(const ctx_t *c, const ctx_t *fc, int nf, int files, const char *bad,
                            const char *dir, long step, const void *extra, size_t extra_len,
                            int keep) {
  char sdir[4096], tmp[4200], final[4200], why[4400] = "";
  snprintf(sdir, sizeof sdir, "%s/ckpt-%09ld", dir, step);
  if (bad) snprintf(why, sizeof why, "%s", bad);
  else if (files < 1 || (unsigned)files > MAX_WORLD)
    snprintf(why, sizeof why, "%d files: not in 1..%u", files, MAX_WORLD);
  /* The agreements' buffers, made before the first so that its verdict
   * covers their failure: no rank may skip one alone.  Per rank: how many
   * times it holds each file, then each file's {bytes, checksum}, then
   * whether its writing failed; and as much for the sums. */
  const size_t nslot = 3 * (size_t)files + 1;
  uint64_t *mine = why[0] ? NULL : calloc(2 * nslot, sizeof *mine);
  if (!why[0] && !mine) snprintf(why, sizeof why, "out of memory");
  /* 1. Every rank's arguments are good, and all say the same number of
   * files and the same optimizer kind (which an empty range cannot show).
   * The maximum of: -files, files, bad, AdamW held, SGD held. */
  int64_t a[5] = {-(int64_t)files, files, why[0] != 0, 0, 0}, b[5];
  for (int i = 0; i < nf && !why[0]; i++)
    if (fc[i].nstate) a[fc[i].of == 2 ? 3 : 4] = 1;
  if (why[0]) fprintf(stderr, "chorus_trainer_save: rank %d: %s\n", c->rank, why);
  chorus_result_t st = reduce64(c, a, b, 5, CHORUS_MAX, "agreeing on the checkpoint's files");
  if (st == CHORUS_OK && !why[0]) {
    if (b[2]) snprintf(why, sizeof why, "another rank's arguments are bad (see its output)");
    else if (-b[0] != b[1])
      snprintf(why, sizeof why, "the ranks disagree on the number of files (%lld to %lld)",
               (long long)-b[0], (long long)b[1]);
    else if (b[3] && b[4])
      snprintf(why, sizeof why, "the ranges' optimizers are of different kinds (AdamW and SGD)");
    else if (!b[3] && !b[4]) snprintf(why, sizeof why, "no range holds any parameter");
  }
  /* 2. Each file is held by exactly one rank (each rank's own were checked
   * apart); one missing would leave a checkpoint no load can use. */
  if (st == CHORUS_OK && !why[0]) {
    uint64_t *cnt = mine;
    int64_t *held = (int64_t *)(mine + nslot);
    for (int i = 0; i < nf; i++) cnt[fc[i].file]++;
    st = reduce64(c, cnt, held, (size_t)files, CHORUS_SUM, "counting the checkpoint's files");
    int whole = 1;
    for (int f = 0; st == CHORUS_OK && f < files; f++) whole = whole && held[f] == 1;
    if (st == CHORUS_OK && !whole) name_files(held, files, why, sizeof why);
  }
  if (st != CHORUS_OK || why[0]) {
    free(mine);
    return st != CHORUS_OK ? st
                           : chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                                "chorus_trainer_save: rank %d: "
                                                "checkpoint %s not written: %s",
                                                c->rank, sdir, why);
  }
  /* 3. This rank's files, then every file's size and checksum everywhere
   * (each slot filled by its one writer), with the count of failures. */
  const int of = b[3] ? 2 : 1;
  uint64_t *tab = mine + files, *sum = mine + nslot;
  int ok = 1;
  if (mkdirs(sdir) != 0) {
    ok = 0;
    snprintf(why, sizeof why, "mkdir %s: %s", sdir, strerror(errno));
  } else {
    /* The folder this rank writes into must be what it made (or its own
     * earlier run made), not a link another user put there. */
    const char *who = c->rank == 0 ? "chorus_trainer_save" : NULL; /* rank 0 warns */
    if (chorus__dir_check(dir, who, why, sizeof why) < 0 ||
        chorus__own_dir(sdir, why, sizeof why) < 0)
      ok = 0;
    else why[0] = '\0';
  }
  for (int i = 0; ok && i < nf; i++) {
    const int f = fc[i].file;
    ok = write_shard(&fc[i], sdir, step, files, of, &tab[2 * f], &tab[2 * f + 1], why,
                     sizeof why) == 0;
  }
  tab[2 * (size_t)files] = !ok;
  if (!ok) fprintf(stderr, "chorus_trainer_save: rank %d: %s\n", c->rank, why);
  st = reduce64(c, tab, sum + files, 2 * (size_t)files + 1, CHORUS_SUM,
                "gathering the files' sizes and checksums");
  if (st != CHORUS_OK) {
    free(mine);
    return st;
  }
  const uint64_t *all = sum + files;
  if (all[2 * (size_t)files]) {
    free(mine);
    return chorus__train_fail(CHORUS_ERR_SYSTEM,
                              "chorus_trainer_save: rank %d: checkpoint %s not written: %s",
                              c->rank, sdir,
                              why[0] ? why
                                     : "another rank could not write its file(s) (see its "
                                       "output)");
  }
  /* 4. Rank 0 writes the index. */
  if (c->rank == 0) {
    ix_header_t h = {IX_MAGIC, DC_VERSION, sizeof h, step, {0}, of, c->np, (uint32_t)files,
                     (uint32_t)c->stage, extra_len};
    memcpy(h.shape, c->shape, sizeof h.shape);
    chunk_t ich[3] = {{&h, sizeof h}, {all, 2 * sizeof *all * (size_t)files}, {extra, extra_len}};
    snprintf(tmp, sizeof tmp, "%s/.index.tmp.%d", sdir, (int)getpid());
    snprintf(final, sizeof final, "%s/index.bin", sdir);
    uint64_t ib, is;
    if (write_file(tmp, final, ich, 3, &ib, &is) != 0) {
      ok = 0;
      snprintf(why, sizeof why, "writing %s: %s", final, strerror(errno));
      fprintf(stderr, "chorus_trainer_save: rank 0: %s\n", why);
    } else {
      fsync_dir(sdir);
      fsync_dir(dir);
      /* Keep the newest `keep` complete checkpoints; anything older goes,
       * incomplete ones (a crash while writing) included. */
      int nc;
      chorus__ckpt_cand_t *cs = chorus__ckpt_list(dir, &nc);
      int complete = 0;
      for (int i = 0; i < nc; i++) {
        int whole = !cs[i].dir || index_exists(dir, cs[i].step);
        if (cs[i].step > step) continue; /* newer ones are someone else's business */
        if (whole && complete < keep) {
          complete++;
          continue;
        }
        if (cs[i].step == step) continue;
        remove_ckpt(dir, &cs[i]);
      }
      free(cs);
    }
  }
  free(mine);
  if ((st = chorus__ckpt_agree(c, &ok)) != CHORUS_OK) return st;
  return ok ? CHORUS_OK
            : chorus__train_fail(CHORUS_ERR_SYSTEM,
                                 "chorus_trainer_save: rank %d: the index of %s was not "
                                 "written (see rank 0's output)",
                                 c->rank, sdir);
}

chorus_result_t chorus_trainer_save(chorus_trainer_t *t, const char *dir, long step,
                                    const void *extra, size_t extra_len, int keep) {
  if (!t || !dir || step < 0 || keep < 1 || (extra_len && !extra) || extra_len > MAX_EXTRA)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_save: bad arguments");
  ctx_t c;
  chorus__ckpt_ctx_init(&c, t);
  return save(&c, &c, 1, c.size, NULL, dir, step, extra, extra_len, keep);
}

/* For ordering a rank's ranges by file and by offset. */
typedef struct {
  size_t key;
  int i;
} order_t;
static int cmp_order(const void *a, const void *b) {
  const order_t *x = a, *y = b;
  return x->key < y->key ? -1 : x->key > y->key ? 1 : (x->i > y->i) - (x->i < y->i);
}

/* Checks a rank's ranges and makes their contexts (fc, nr of them).  0, or
 * -1 with why. */
static int ranges_ctx(const ctx_t *c, const chorus__ck_range_t *r, int nr, int files, ctx_t *fc,
                      char *why, size_t cap) {
  const size_t np = c->np;
  for (int i = 0; i < nr; i++) {
    const chorus__ck_range_t *g = &r[i];
    if (g->file < 0 || g->file >= files) {
      snprintf(why, cap, "range %d: file %d is not one of the checkpoint's %d", i, g->file, files);
      return -1;
    }
    if (g->lo > np || g->n > np - g->lo) {
      snprintf(why, cap, "range %d (file %d): %zu floats from %zu are outside the model's %zu",
               i, g->file, g->n, g->lo, np);
      return -1;
    }
    /* The optimizer must be over exactly these n floats (AdamW: 2 state
     * floats per parameter, SGD 1): its state is written as theirs. */
    const size_t sb = g->opt ? chorus_optim_state_size(g->opt) : 0;
    const size_t per = g->n ? (sb - sizeof(int64_t)) / (sizeof(float) * g->n) : 0;
    if (!g->opt || (g->n && !g->par) || sb < sizeof(int64_t) ||
        sb != sizeof(int64_t) + sizeof(float) * g->n * per || per > 2 || (g->n && per < 1)) {
      snprintf(why, cap, "range %d (file %d): %s", i, g->file,
               !g->opt ? "no optimizer" : g->n && !g->par ? "no parameters"
                       : "its optimizer's state is not over the range's floats");
      return -1;
    }
    chorus__ckpt_ctx_init_range(&fc[i], c->comm, c->m, g->opt, g->par, g->lo, g->n);
    fc[i].file = g->file;
  }
  order_t *o = calloc((size_t)nr + 1, sizeof *o);
  if (!o) {
    snprintf(why, cap, "out of memory");
    return -1;
  }
  int rc = 0;
  for (int i = 0; i < nr; i++) o[i] = (order_t){(size_t)r[i].file, i};
  qsort(o, (size_t)nr, sizeof *o, cmp_order);
  for (int i = 1; i < nr && rc == 0; i++)
    if (o[i].key == o[i - 1].key) {
      snprintf(why, cap, "ranges %d and %d are both file %d", o[i - 1].i, o[i].i, r[o[i].i].file);
      rc = -1;
    }
  /* Empty ranges hold nothing to overlap. */
  int k = 0;
  for (int i = 0; i < nr; i++)
    if (r[i].n) o[k++] = (order_t){r[i].lo, i};
  qsort(o, (size_t)k, sizeof *o, cmp_order);
  for (int i = 1; i < k && rc == 0; i++) {
    const chorus__ck_range_t *p = &r[o[i - 1].i], *q = &r[o[i].i];
    if (p->lo + p->n > q->lo) {
      snprintf(why, cap, "ranges %d and %d overlap (at float %zu)", o[i - 1].i, o[i].i, q->lo);
      rc = -1;
    }
  }
  free(o);
  return rc;
}

chorus_result_t chorus__ckpt_save_ranges(chorus_comm_t comm, chorus_gpt_t *m, int nr,
                                         const chorus__ck_range_t *r, int files, const char *dir,
                                         long step, const void *extra, size_t extra_len,
                                         int keep) {
  if (!m || !dir || step < 0 || keep < 1 || (extra_len && !extra) || extra_len > MAX_EXTRA)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_save: bad arguments");
  ctx_t c;
  ctx_init_comm(&c, comm, m);
  /* Bad ranges still take part in the agreements: every rank fails. */
  char why[512] = "";
  ctx_t *fc = NULL;
  if (nr < 0 || (nr > 0 && !r))
    snprintf(why, sizeof why, "a list of %d ranges at %p", nr, (const void *)r);
  else if (!(fc = calloc((size_t)nr + 1, sizeof *fc))) snprintf(why, sizeof why, "out of memory");
  else ranges_ctx(&c, r, nr, files, fc, why, sizeof why);
  chorus_result_t st = save(&c, fc, why[0] ? 0 : nr, files, why[0] ? why : NULL, dir, step,
                            extra, extra_len, keep);
  free(fc);
  return st;
}

/* One range, as file <comm rank> of <comm size>. */
chorus_result_t chorus__ckpt_save_range(chorus_comm_t comm, chorus_gpt_t *m, chorus_optim_t *opt,
                                        float *par, size_t lo, size_t n, const char *dir,
                                        long step, const void *extra, size_t extra_len, int keep) {
  const chorus__ck_range_t r = {opt, par, lo, n, comm ? chorus_comm_rank(comm) : 0};
  return chorus__ckpt_save_ranges(comm, m, 1, &r, comm ? chorus_comm_size(comm) : 1, dir, step,
                                  extra, extra_len, keep);
}

/* -------------------------------------------------------------- export */

chorus_result_t chorus_trainer_export(chorus_trainer_t *t, const char *path, long step,
                                      const void *extra, size_t extra_len) {
  if (!t || !path || step < 0 || (extra_len && !extra))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trainer_export: bad arguments");
  ctx_t c;
  chorus__ckpt_ctx_init(&c, t);
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
  chorus_result_t st = chorus__ckpt_agree(&c, &ready);
  if (st != CHORUS_OK || !ready) {
    free(blob), free(unit);
    return st != CHORUS_OK ? st
                           : chorus__train_fail(CHORUS_ERR_NO_MEMORY,
                                                "chorus_trainer_export: rank %d: out of "
                                                "memory (here or on another rank)",
                                                c.rank);
  }
  if (ok) chorus_optim_state_save(chorus_trainer_optim(t), blob);
  if (ok && c.rank == 0) {
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    fd = chorus__create_new(tmp, 0644);
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
    return chorus__ckpt_coll_fail(&c, st, "gathering the state for the export");
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
  if ((st = chorus__ckpt_agree(&c, &ok)) != CHORUS_OK) return st;
  return ok ? CHORUS_OK
            : chorus__train_fail(
                  CHORUS_ERR_SYSTEM, "chorus_trainer_export: rank %d: %s", c.rank,
                  c.rank == 0 ? why : "rank 0 could not write the file (see its output)");
}
