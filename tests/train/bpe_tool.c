/*
 * bpe_tool.c - the tokenizer from the command line, for test_bpe.sh and
 * bench/bpe/compare.sh (tokens are little-endian uint32, the format
 * bpe_ref.py writes too):
 *   bpe_tool encode DIR IN OUT          tokens of file IN with vocabulary DIR
 *   bpe_tool decode DIR IN OUT          the bytes of the tokens in IN
 *   bpe_tool pieces IN OUT              byte lengths of IN's pre-split pieces
 *   bpe_tool train VOCAB DIR FILE...    counts the files, trains VOCAB ids,
 *                                       saves them in DIR (prints the times)
 *   bpe_tool bench DIR IN RUNS          encodes IN RUNS times, each with a
 *                                       new encoder (an empty cache); prints
 *                                       every run's MB/s and the median
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/bpe.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void die(const char *what) {
  fprintf(stderr, "bpe_tool: %s\n", what);
  exit(1);
}

static unsigned char *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    exit(1);
  }
  size_t cap = 1 << 20, n = 0;
  unsigned char *buf = malloc(cap);
  for (;;) {
    if (!buf) die("out of memory");
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    cap *= 2;
    buf = realloc(buf, cap);
  }
  if (ferror(f)) die("read error");
  fclose(f);
  *len = n;
  return buf;
}

static void spit(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
    perror(path);
    exit(1);
  }
}

static chorus_bpe_t *load(const char *dir) {
  char err[512];
  chorus_bpe_t *t;
  if (chorus_bpe_load(dir, &t, err, sizeof err) != CHORUS_OK) die(err);
  return t;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  if (argc >= 5 && !strcmp(argv[1], "encode")) {
    chorus_bpe_t *t = load(argv[2]);
    size_t len;
    unsigned char *text = slurp(argv[3], &len);
    chorus_bpe_encoder_t *e;
    uint32_t *toks = NULL;
    size_t n = 0, cap = 0;
    if (chorus_bpe_encoder_create(t, &e) != CHORUS_OK ||
        chorus_bpe_encode(e, text, len, &toks, &n, &cap) != CHORUS_OK)
      die(chorus_train_last_error());
    spit(argv[4], toks, n * sizeof *toks); /* little-endian hosts only */
    chorus_bpe_encoder_free(e);
    chorus_bpe_free(t);
    free(toks);
    free(text);
    return 0;
  }
  if (argc >= 5 && !strcmp(argv[1], "decode")) {
    chorus_bpe_t *t = load(argv[2]);
    size_t len;
    unsigned char *in = slurp(argv[3], &len);
    FILE *f = fopen(argv[4], "wb");
    if (!f) die("cannot write the output");
    for (size_t i = 0; i + 4 <= len; i += 4) {
      uint32_t id;
      memcpy(&id, in + i, 4);
      size_t n;
      const unsigned char *p = chorus_bpe_token(t, (int)id, &n);
      if (!p) die("token id out of range");
      fwrite(p, 1, n, f);
    }
    if (fclose(f) != 0) die("write error");
    chorus_bpe_free(t);
    free(in);
    return 0;
  }
  if (argc >= 4 && !strcmp(argv[1], "pieces")) {
    size_t len, n = 0;
    unsigned char *text = slurp(argv[2], &len);
    uint32_t *out = malloc((len + 1) * sizeof *out);
    if (!out) die("out of memory");
    for (size_t i = 0; i < len;) {
      size_t m = chorus__bpe_piece_len(text + i, text + len);
      out[n++] = (uint32_t)m;
      i += m;
    }
    spit(argv[3], out, n * sizeof *out);
    free(out);
    free(text);
    return 0;
  }
  if (argc >= 5 && !strcmp(argv[1], "train")) {
    int vocab = atoi(argv[2]);
    chorus_bpe_counter_t *c;
    if (chorus_bpe_counter_create(&c) != CHORUS_OK) die(chorus_train_last_error());
    size_t total = 0;
    double t0 = now();
    for (int i = 4; i < argc; i++) {
      size_t len;
      unsigned char *text = slurp(argv[i], &len);
      if (chorus_bpe_count(c, text, len) != CHORUS_OK) die(chorus_train_last_error());
      total += len;
      free(text);
    }
    double t1 = now();
    char err[512];
    chorus_bpe_t *t;
    if (chorus_bpe_train(c, vocab, &t, err, sizeof err) != CHORUS_OK) die(err);
    double t2 = now();
    if (chorus_bpe_save(t, argv[3], err, sizeof err) != CHORUS_OK) die(err);
    printf("train: %.1f MB counted in %.2f s, %d ids learned in %.2f s\n", (double)total / 1e6,
           t1 - t0, vocab, t2 - t1);
    chorus_bpe_free(t);
    chorus_bpe_counter_free(c);
    return 0;
  }
  if (argc >= 5 && !strcmp(argv[1], "bench")) {
    chorus_bpe_t *t = load(argv[2]);
    size_t len;
    unsigned char *text = slurp(argv[3], &len);
    int runs = atoi(argv[4]);
    if (runs < 1 || runs > 100) die("RUNS must be 1..100");
    double mbs[100];
    uint32_t *toks = NULL;
    size_t cap = 0, n = 0;
    for (int r = 0; r < runs; r++) {
      chorus_bpe_encoder_t *e;
      n = 0;
      if (chorus_bpe_encoder_create(t, &e) != CHORUS_OK) die(chorus_train_last_error());
      double t0 = now();
      if (chorus_bpe_encode(e, text, len, &toks, &n, &cap) != CHORUS_OK)
        die(chorus_train_last_error());
      double dt = now() - t0;
      chorus_bpe_encoder_free(e);
      mbs[r] = (double)len / 1e6 / dt;
      printf("run %d: %.1f MB in %.3f s: %.1f MB/s (%zu tokens)\n", r, (double)len / 1e6, dt,
             mbs[r], n);
    }
    qsort(mbs, (size_t)runs, sizeof *mbs, cmp_double);
    printf("median %.1f MB/s\n", mbs[runs / 2]);
    free(toks);
    free(text);
    chorus_bpe_free(t);
    return 0;
  }
  fprintf(stderr,
          "usage: bpe_tool encode DIR IN OUT | decode DIR IN OUT | pieces IN OUT |\n"
          "       train VOCAB DIR FILE... | bench DIR IN RUNS\n");
  return 2;
}
