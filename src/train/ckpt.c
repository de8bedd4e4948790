/*
 * ckpt.c - atomic single-file checkpoints of model, optimizer and caller
 * state, for a program of one process (the file layout is in ckpt.h; the
 * checkpoints of a data-parallel run, written by every rank, are in
 * dist_ckpt.c; dist_ckpt_load.c reads these files too).
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "train/ckpt.h"
#include "runtime.h"

/* gpt.c's error recorder (one per thread). */

int chorus__ckpt_write_all(int fd, const void *p, size_t n, uint64_t *h) {
  const char *c = p;
  *h = chorus__fnv(*h, p, n);
  while (n) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

void chorus__ckpt_shape(const chorus_gpt_t *m, int32_t s[5]) {
  const chorus_gpt_config_t *c = chorus_gpt_config(m);
  s[0] = c->vocab, s[1] = c->ctx, s[2] = c->layers, s[3] = c->heads, s[4] = c->channels;
}

/* Checkpoints in dir, newest first; a step with both forms lists the
 * sharded one first. */
chorus__ckpt_cand_t *chorus__ckpt_list(const char *dir, int *n) {
  *n = 0;
  DIR *d = opendir(dir);
  if (!d) return NULL;
  chorus__ckpt_cand_t *v = NULL;
  int cap = 0;
  for (struct dirent *e; (e = readdir(d));) {
    long step;
    int used = 0;
    /* Sharded checkpoints are folders of nine-digit steps (this runtime's);
     * a single file may carry its step in fewer digits (an export a user
     * named ckpt-6.bin, as the docs write DIR/ckpt-<step>.bin). */
    if (strncmp(e->d_name, "ckpt-", 5) || !isdigit((unsigned char)e->d_name[5]) ||
        sscanf(e->d_name, "ckpt-%ld%n", &step, &used) != 1 || step < 0)
      continue;
    const char *tail = e->d_name + used;
    int isdir = !*tail;
    if (isdir ? used < 14 : strcmp(tail, ".bin") != 0) continue;
    if (*n == cap) {
      cap = cap ? 2 * cap : 16;
      chorus__ckpt_cand_t *nv = realloc(v, sizeof *v * (size_t)cap);
      if (!nv) break;
      v = nv;
    }
    v[(*n)++] = (chorus__ckpt_cand_t){step, isdir};
  }
  closedir(d);
  for (int i = 1; i < *n; i++)
    for (int j = i; j > 0 && (v[j].step > v[j - 1].step ||
                              (v[j].step == v[j - 1].step && v[j].dir > v[j - 1].dir));
         j--) {
      chorus__ckpt_cand_t t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return v;
}

int chorus__ckpt_file(char *buf, size_t len, const char *dir, long step) {
  int n = snprintf(buf, len, "%s/ckpt-%09ld.bin", dir, step);
  if (n < 0 || (size_t)n >= len) return -1;
  struct stat sb;
  if (lstat(buf, &sb) == 0 || errno != ENOENT) return 0;
  char alt[4200];
  n = snprintf(alt, sizeof alt, "%s/ckpt-%ld.bin", dir, step);
  if (n < 0 || (size_t)n >= len || (size_t)n >= sizeof alt || lstat(alt, &sb) != 0) return 0;
  memcpy(buf, alt, (size_t)n + 1);
  return 0;
}

/* Steps of the single-file checkpoints in dir, newest first (*n of them). */
static long *list_steps(const char *dir, int *n) {
  int nc;
  chorus__ckpt_cand_t *c = chorus__ckpt_list(dir, &nc);
  long *v = malloc(sizeof(long) * (size_t)(nc + 1));
  *n = 0;
  for (int i = 0; v && i < nc; i++)
    if (!c[i].dir) v[(*n)++] = c[i].step;
  free(c);
  return v;
}

chorus_result_t chorus_ckpt_save(const char *dir, long step, chorus_gpt_t *m,
                                 const chorus_optim_t *o, const void *extra, size_t extra_len,
                                 int keep) {
  if (!dir || !m || !o || step < 0 || keep < 1 || (extra_len && !extra))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ckpt_save: bad arguments");
  /* mkdir -p */
  char path[4096];
  snprintf(path, sizeof path, "%s", dir);
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0') continue;
    char c = *p;
    *p = '\0';
    if (mkdir(path, 0755) < 0 && errno != EEXIST)
      return chorus__train_fail(CHORUS_ERR_SYSTEM, "chorus_ckpt_save: mkdir %s: %s", path,
                                strerror(errno));
    *p = c;
    if (!c) break;
  }
  char tmp[4096], final[4096];
  snprintf(tmp, sizeof tmp, "%s/.ckpt-%09ld.tmp.%d", dir, step, (int)getpid());
  snprintf(final, sizeof final, "%s/ckpt-%09ld.bin", dir, step);
  size_t optbytes = chorus_optim_state_size(o);
  void *opt = malloc(optbytes ? optbytes : 1);
  if (!opt) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_ckpt_save: out of memory");
  chorus_optim_state_save(o, opt);
  ck_header_t h = {CK_MAGIC, CK_VERSION, sizeof h, step, {0}, 0, chorus_gpt_num_params(m),
                   optbytes, extra_len};
  chorus__ckpt_shape(m, h.shape);
  char why[4400];
  if (chorus__dir_check(dir, "chorus_ckpt_save", why, sizeof why) < 0) {
    free(opt);
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_ckpt_save: %s", why);
  }
  int fd = chorus__create_new(tmp, 0644);
  uint64_t sum = FNV0;
  int bad = fd < 0 || chorus__ckpt_write_all(fd, &h, sizeof h, &sum) ||
            chorus__ckpt_write_all(fd, chorus_gpt_params(m), sizeof(float) * h.nparams, &sum) ||
            chorus__ckpt_write_all(fd, opt, optbytes, &sum) || (extra_len && chorus__ckpt_write_all(fd, extra, extra_len, &sum));
  uint64_t dummy = FNV0, final_sum = sum;
  bad = bad || chorus__ckpt_write_all(fd, &final_sum, sizeof final_sum, &dummy) || fsync(fd) != 0;
  int err = errno;
  free(opt);
  if (fd >= 0 && close(fd) != 0 && !bad) bad = 1, err = errno;
  if (!bad && rename(tmp, final) != 0) bad = 1, err = errno;
  if (bad) {
    unlink(tmp);
    return chorus__train_fail(CHORUS_ERR_SYSTEM, "chorus_ckpt_save: writing %s: %s", final,
                              strerror(err));
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd); /* the rename itself is durable */
    close(dfd);
  }
  int n;
  long *steps = list_steps(dir, &n);
  for (int i = keep; i < n; i++) {
    char old[64];
    snprintf(old, sizeof old, "ckpt-%09ld.bin", steps[i]);
    chorus__remove_entry(dir, old);
  }
  free(steps);
  return CHORUS_OK;
}

/* Reads and verifies one file fully before touching the model. */
static int load_one(const char *path, chorus_gpt_t *m, chorus_optim_t *o, void *extra,
                    size_t extra_cap, size_t *extra_len, long *step) {
  struct stat sb;
  int fd = chorus__open_regular(path, &sb); /* a FIFO named like one: no hang */
  if (fd < 0) return -1;
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    close(fd);
    return -1;
  }
  ck_header_t h;
  int32_t shape[5];
  chorus__ckpt_shape(m, shape);
  int ok = fread(&h, sizeof h, 1, f) == 1 && h.magic == CK_MAGIC && h.version == CK_VERSION &&
           h.header == sizeof h && !memcmp(h.shape, shape, sizeof shape) &&
           h.nparams == chorus_gpt_num_params(m) && h.optbytes == chorus_optim_state_size(o) &&
           h.extrabytes <= ((uint64_t)1 << 30) && h.step >= 0;
  size_t pbytes = ok ? sizeof(float) * h.nparams : 0;
  char *buf = ok ? malloc(pbytes + h.optbytes + h.extrabytes + 1) : NULL;
  uint64_t stored = 0, sum = FNV0;
  ok = ok && buf && fread(buf, 1, pbytes + h.optbytes + h.extrabytes, f) ==
                        pbytes + h.optbytes + h.extrabytes &&
       fread(&stored, sizeof stored, 1, f) == 1;
  fclose(f);
  if (ok) {
    sum = chorus__fnv(chorus__fnv(sum, &h, sizeof h), buf, pbytes + h.optbytes + h.extrabytes);
    ok = sum == stored;
  }
  if (ok) ok = chorus_optim_state_load(o, buf + pbytes, h.optbytes) == CHORUS_OK;
  if (ok) {
    memcpy(chorus_gpt_params(m), buf, pbytes);
    size_t n = h.extrabytes < extra_cap ? h.extrabytes : extra_cap;
    if (n) memcpy(extra, buf + pbytes + h.optbytes, n);
    if (extra_len) *extra_len = h.extrabytes;
    *step = (long)h.step;
  }
  free(buf);
  return ok ? 0 : -1;
}

chorus_result_t chorus_ckpt_load(const char *dir, long *step, chorus_gpt_t *m, chorus_optim_t *o,
                                 void *extra, size_t extra_cap, size_t *extra_len) {
  *step = -1;
  if (extra_len) *extra_len = 0;
  int n;
  long *steps = list_steps(dir, &n);
  chorus_result_t st = CHORUS_OK;
  for (int i = 0; i < n; i++) {
    char path[4096];
    if (chorus__ckpt_file(path, sizeof path, dir, steps[i]) != 0) continue;
    if (load_one(path, m, o, extra, extra_cap, extra_len, step) == 0) break;
    /* Torn, foreign or of another shape: note it, try the previous one. */
    chorus__train_fail(CHORUS_OK, "checkpoint %s is unusable (incomplete, corrupt or for "
                       "another model); an older one was tried", path);
  }
  free(steps);
  return st;
}
