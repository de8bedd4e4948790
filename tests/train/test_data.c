/*
 * test_data.c - token datasets and the loader: llm.c shards written and
 * read back (both versions), sequences across shard boundaries, every kind
 * of bad file refused with its name and offset, nanoGPT's raw files, text
 * as bytes, and the loader: the sampler's order whatever the workers and
 * prefetch, errors passed on, seek and reshard to the consumed position.
 *   test_data   (works in a temporary directory of its own)
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chorus_train.h"
#include "harness.h"

static char g_dir[256];

static const char *path_of(const char *name) {
  static char buf[8][512];
  static int k;
  char *b = buf[k++ & 7];
  snprintf(b, 512, "%s/%s", g_dir, name);
  return b;
}

/* Token t of the test stream. */
static uint32_t tok_at(size_t t, uint32_t vocab) { return (uint32_t)((t * 7919 + 13) % vocab); }

/* Writes shard `name` with tokens first .. first + n of the test stream. */
static void write_shard(const char *name, int version, size_t first, size_t n, uint32_t vocab) {
  chorus_shard_writer_t *w;
  ASSERT_EQ(chorus_shard_writer_open(path_of(name), version, &w), CHORUS_OK);
  uint32_t buf[100];
  for (size_t i = 0; i < n;) {
    size_t c = n - i < 100 ? n - i : 100;
    for (size_t j = 0; j < c; j++) buf[j] = tok_at(first + i + j, vocab);
    ASSERT_EQ(chorus_shard_writer_add(w, buf, c), CHORUS_OK);
    i += c;
  }
  ASSERT_EQ(chorus_shard_writer_count(w), n);
  ASSERT_EQ(chorus_shard_writer_close(w, 1), CHORUS_OK);
}

static void write_bytes(const char *name, const void *p, size_t n) {
  FILE *f = fopen(path_of(name), "wb");
  ASSERT_TRUE(f != NULL);
  ASSERT_EQ(fwrite(p, 1, n, f), n);
  fclose(f);
}

/* Every sequence of d equals the test stream from its start. */
static void check_sequences(const chorus_tokens_t *d, int T, uint32_t vocab) {
  size_t n = chorus_tokens_samples(d, T);
  ASSERT_EQ(n, (chorus_tokens_count(d) - 1) / (size_t)T);
  int *tok = malloc(sizeof(int) * (size_t)T), *tgt = malloc(sizeof(int) * (size_t)T);
  for (size_t i = 0; i < n; i++) {
    ASSERT_EQ(chorus_tokens_read(d, T, &i, 1, tok, tgt), CHORUS_OK);
    for (int j = 0; j < T; j++) {
      if ((uint32_t)tok[j] != tok_at(i * T + j, vocab) ||
          (uint32_t)tgt[j] != tok_at(i * T + j + 1, vocab)) {
        HARNESS_FAIL("sequence %zu position %d: %d/%d, want %u/%u", i, j, tok[j], tgt[j],
                     tok_at(i * T + j, vocab), tok_at(i * T + j + 1, vocab));
        free(tok), free(tgt);
        return;
      }
    }
  }
  free(tok), free(tgt);
}

TEST(shards_round_trip) {
  /* Three training shards of odd sizes and a validation shard. */
  write_shard("d_train_000001.bin", 1, 0, 1000, 50257);
  write_shard("d_train_000002.bin", 1, 1000, 333, 50257);
  write_shard("d_train_000003.bin", 1, 1333, 2048, 50257);
  write_shard("d_val_000000.bin", 1, 0, 500, 50257);
  /* The header as llm.c reads it. */
  FILE *f = fopen(path_of("d_train_000002.bin"), "rb");
  int32_t h[256];
  ASSERT_EQ(fread(h, sizeof h, 1, f), 1);
  fclose(f);
  ASSERT_EQ(h[0], 20240520);
  ASSERT_EQ(h[1], 1);
  ASSERT_EQ(h[2], 333);
  struct stat sb;
  ASSERT_EQ(stat(path_of("d_train_000002.bin"), &sb), 0);
  ASSERT_EQ((size_t)sb.st_size, 1024 + 2 * 333);
  chorus_tokens_t *d, *v;
  ASSERT_EQ(chorus_tokens_open(g_dir, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_files(d), 3);
  ASSERT_EQ(chorus_tokens_count(d), 3381);
  ASSERT_TRUE(strstr(chorus_tokens_file(d, 1), "d_train_000002.bin") != NULL);
  check_sequences(d, 64, 50257); /* crosses both boundaries */
  check_sequences(d, 1, 50257);
  ASSERT_EQ(chorus_tokens_check(d), CHORUS_OK);
  ASSERT_EQ(chorus_tokens_open(g_dir, CHORUS_SPLIT_VAL, CHORUS_TOKENS_AUTO, 50257, &v),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(v), 500);
  chorus_tokens_close(v);
  /* A glob, and its validation twin. */
  char pat[600];
  snprintf(pat, sizeof pat, "%s/d_train_*.bin", g_dir);
  chorus_tokens_t *g;
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &g),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(g), 3381);
  chorus_tokens_close(g);
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_VAL, CHORUS_TOKENS_AUTO, 50257, &g), CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(g), 500);
  chorus_tokens_close(g);
  chorus_tokens_close(d);
  /* Version 2: uint32 tokens. */
  write_shard("big_train_000001.bin", 2, 0, 777, 100000);
  snprintf(pat, sizeof pat, "%s/big_train_*.bin", g_dir);
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_LLMC, 100000, &g),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(g), 777);
  check_sequences(g, 10, 100000);
  chorus_tokens_close(g);
  /* A token above 65535 does not fit version 1. */
  chorus_shard_writer_t *w;
  ASSERT_EQ(chorus_shard_writer_open(path_of("x_train_000001.bin"), 1, &w), CHORUS_OK);
  uint32_t big = 70000;
  ASSERT_EQ(chorus_shard_writer_add(w, &big, 1), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_shard_writer_close(w, 0), CHORUS_OK);
  ASSERT_TRUE(access(path_of("x_train_000001.bin"), F_OK) != 0);
  unlink(path_of("big_train_000001.bin"));
}

/* Opening (or checking) path must fail with a message holding each of the
 * given strings. */
static void refused(const char *spec, int check, int vocab, const char *a, const char *b) {
  chorus_tokens_t *d = NULL;
  chorus_result_t st = chorus_tokens_open(spec, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, vocab,
                                          &d);
  if (st == CHORUS_OK && check) {
    st = chorus_tokens_check(d);
    chorus_tokens_close(d);
    d = NULL;
  }
  ASSERT_TRUE(st != CHORUS_OK);
  ASSERT_TRUE(d == NULL);
  const char *e = chorus_train_last_error();
  if (!strstr(e, a) || (b && !strstr(e, b)))
    HARNESS_FAIL("%s: message \"%s\" lacks \"%s\" / \"%s\"", spec, e, a, b ? b : "");
  else
    printf("     refused: %s\n", e);
}

TEST(bad_files) {
  int32_t h[256] = {20240520, 1, 100};
  unsigned char buf[1024 + 400];
  memset(buf, 0, sizeof buf);
  memcpy(buf, h, sizeof h);
  /* Truncated: the header says 100 tokens, 60 are there. */
  write_bytes("t_train_000001.bin", buf, 1024 + 120);
  refused(path_of("t_train_000001.bin"), 0, 50257, "t_train_000001.bin", "truncated");
  /* Too long. */
  write_bytes("t_train_000001.bin", buf, 1024 + 202);
  refused(path_of("t_train_000001.bin"), 0, 50257, "says 100 tokens", "after the last");
  /* Wrong magic. */
  h[0] = 12345;
  memcpy(buf, h, sizeof h);
  write_bytes("t_train_000001.bin", buf, 1024 + 200);
  refused(path_of("t_train_000001.bin"), 0, 50257, "magic 12345", "raw16");
  /* Unknown version. */
  h[0] = 20240520, h[1] = 7;
  memcpy(buf, h, sizeof h);
  write_bytes("t_train_000001.bin", buf, 1024 + 200);
  refused(path_of("t_train_000001.bin"), 0, 50257, "version 7", NULL);
  /* Shorter than a header. */
  write_bytes("t_train_000001.bin", buf, 100);
  refused(path_of("t_train_000001.bin"), 0, 50257, "shorter than", NULL);
  /* A token outside the vocabulary, found at its byte offset. */
  h[1] = 1;
  memcpy(buf, h, sizeof h);
  uint16_t bad = 60000;
  memcpy(buf + 1024 + 2 * 37, &bad, 2);
  write_bytes("t_train_000001.bin", buf, 1024 + 200);
  refused(path_of("t_train_000001.bin"), 1, 50257, "token 60000 at byte offset 1098", NULL);
  /* The loader passes such an error on. */
  chorus_tokens_t *d;
  ASSERT_EQ(chorus_tokens_open(path_of("t_train_000001.bin"), CHORUS_SPLIT_TRAIN,
                               CHORUS_TOKENS_AUTO, 50257, &d), CHORUS_OK);
  for (int workers = 0; workers < 3; workers += 2) {
    chorus_loader_config_t lc = {10, 9, workers, 2, 0, 0, 1, 0, 0};
    chorus_loader_t *l;
    ASSERT_EQ(chorus_loader_create(d, &lc, 1, 0, &l), CHORUS_OK);
    int tok[90], tgt[90];
    double w;
    /* Sequences 0..8 hold tokens 0..90; 37 is in sequence 3. */
    ASSERT_EQ(chorus_loader_next(l, tok, tgt, NULL, &w), CHORUS_ERR_INVALID_ARG);
    ASSERT_TRUE(strstr(chorus_train_last_error(), "byte offset 1098") != NULL);
    ASSERT_EQ(chorus_loader_next(l, tok, tgt, NULL, &w), CHORUS_ERR_INVALID_ARG);
    chorus_loader_destroy(l);
  }
  chorus_tokens_close(d);
  unlink(path_of("t_train_000001.bin"));
  /* A directory with no shards, and a missing path. */
  ASSERT_EQ(mkdir(path_of("empty"), 0700), 0);
  refused(path_of("empty"), 0, 50257, "no token shards", "chorus-data prepare");
  refused(path_of("nothing-here"), 0, 50257, "nothing-here", NULL);
  rmdir(path_of("empty"));
  /* A half-written shard (a writer not committed, or its temporary file
   * left by a crash) is not part of the dataset. */
  write_shard("h_train_000001.bin", 1, 0, 50, 50257);
  write_bytes("h_train_000002.bin.tmp.999", buf, 1024 + 10);
  chorus_shard_writer_t *w;
  ASSERT_EQ(chorus_shard_writer_open(path_of("h_train_000003.bin"), 1, &w), CHORUS_OK);
  uint32_t t = 5;
  ASSERT_EQ(chorus_shard_writer_add(w, &t, 1), CHORUS_OK);
  char pat[600];
  snprintf(pat, sizeof pat, "%s/h_train_*", g_dir);
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_ERR_INVALID_ARG); /* the glob takes the temporaries: refused as such */
  snprintf(pat, sizeof pat, "%s/h_train_*.bin", g_dir);
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 50);
  chorus_tokens_close(d);
  ASSERT_EQ(chorus_shard_writer_close(w, 0), CHORUS_OK);
  unlink(path_of("h_train_000001.bin"));
  unlink(path_of("h_train_000002.bin.tmp.999"));
}

TEST(raw16_and_text) {
  uint16_t raw[300];
  for (int i = 0; i < 300; i++) raw[i] = (uint16_t)tok_at((size_t)i, 50257);
  ASSERT_EQ(mkdir(path_of("nano"), 0700), 0);
  write_bytes("nano/train.bin", raw, sizeof raw);
  write_bytes("nano/val.bin", raw, 100);
  chorus_tokens_t *d;
  /* Without the format named, a headerless file is refused. */
  refused(path_of("nano"), 0, 50257, "train.bin", "raw16");
  ASSERT_EQ(chorus_tokens_open(path_of("nano"), CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_RAW16, 50257,
                               &d), CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 300);
  check_sequences(d, 16, 50257);
  chorus_tokens_close(d);
  ASSERT_EQ(chorus_tokens_open(path_of("nano"), CHORUS_SPLIT_VAL, CHORUS_TOKENS_RAW16, 50257,
                               &d), CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 50);
  chorus_tokens_close(d);
  unlink(path_of("nano/train.bin"));
  unlink(path_of("nano/val.bin"));
  rmdir(path_of("nano"));
  /* Text: bytes, the last tenth for validation. */
  char text[1000];
  for (int i = 0; i < 1000; i++) text[i] = (char)('a' + i % 26);
  write_bytes("t.txt", text, sizeof text);
  ASSERT_EQ(chorus_tokens_open(path_of("t.txt"), CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 256,
                               &d), CHORUS_OK);
  ASSERT_TRUE(chorus_tokens_is_text(d));
  ASSERT_EQ(chorus_tokens_count(d), 900);
  size_t i = 3;
  int tok[8], tgt[8];
  ASSERT_EQ(chorus_tokens_read(d, 8, &i, 1, tok, tgt), CHORUS_OK);
  ASSERT_EQ(tok[0], 'a' + 24 % 26);
  ASSERT_EQ(tgt[7], 'a' + 32 % 26);
  chorus_tokens_close(d);
  ASSERT_EQ(chorus_tokens_open(path_of("t.txt"), CHORUS_SPLIT_VAL, CHORUS_TOKENS_AUTO, 256, &d),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 100);
  ASSERT_EQ(chorus_tokens_read(d, 8, &i, 1, tok, tgt), CHORUS_OK);
  ASSERT_EQ(tok[0], 'a' + (900 + 24) % 26);
  chorus_tokens_close(d);
  unlink(path_of("t.txt"));
  /* A directory: one dataset's shards, in either of llm.c's forms; two
   * datasets (or both forms of one) are refused, naming both. */
  ASSERT_EQ(mkdir(path_of("two"), 0700), 0);
  write_shard("two/a_train_000001.bin", 1, 0, 100, 50257);
  write_shard("two/a_train_000002.bin", 1, 100, 100, 50257);
  write_shard("two/a_val.bin", 1, 0, 50, 50257);
  write_shard("two/a_train_val_000001.bin", 1, 0, 50, 50257); /* not a_train's */
  ASSERT_EQ(chorus_tokens_open(path_of("two"), CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 200);
  chorus_tokens_close(d);
  unlink(path_of("two/a_train_val_000001.bin"));
  ASSERT_EQ(chorus_tokens_open(path_of("two"), CHORUS_SPLIT_VAL, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 50);
  chorus_tokens_close(d);
  write_shard("two/b_train_000001.bin", 1, 0, 100, 50257);
  refused(path_of("two"), 0, 50257, "more than one dataset", "_train_*.bin");
  unlink(path_of("two/b_train_000001.bin"));
  write_shard("two/a_train.bin", 1, 0, 100, 50257);
  refused(path_of("two"), 0, 50257, "more than one dataset", "a_train.bin");
  unlink(path_of("two/a_train.bin"));
  unlink(path_of("two/a_train_000001.bin"));
  unlink(path_of("two/a_train_000002.bin"));
  unlink(path_of("two/a_val.bin"));
  ASSERT_EQ(rmdir(path_of("two")), 0);
  /* A headerless token file not named .bin is not taken for text (NUL
   * bytes), unless text is asked for. */
  write_bytes("tokens.dat", raw, sizeof raw);
  refused(path_of("tokens.dat"), 0, 256, "a NUL byte at offset", "--data-format raw16");
  ASSERT_EQ(chorus_tokens_open(path_of("tokens.dat"), CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_TEXT,
                               256, &d), CHORUS_OK);
  ASSERT_EQ(chorus_tokens_count(d), 540);
  chorus_tokens_close(d);
  unlink(path_of("tokens.dat"));
}

/* The loader's next `batches` batches (B x T) hold the sampler's next
 * indices. */
static void same_batches(chorus_loader_t *l, chorus_sampler_t *sp, int batches, int B, int T) {
  int tok[1024], tgt[1024];
  size_t idx[8];
  ASSERT_TRUE(B <= 8 && B * T <= 1024);
  for (int b = 0; b < batches; b++) {
    ASSERT_EQ(chorus_loader_next(l, tok, tgt, idx, NULL), CHORUS_OK);
    for (int k = 0; k < B; k++) {
      size_t want;
      ASSERT_EQ(chorus_sampler_next(sp, &want), CHORUS_OK);
      ASSERT_EQ(idx[k], want);
    }
  }
}

/* The loader hands out exactly the sampler's order, whatever its workers
 * and prefetch, across epochs, and seeks back to the consumed position
 * (not the read-ahead one) on any world. */
TEST(loader_order) {
  write_shard("l_train_000001.bin", 1, 0, 3001, 50257);
  write_shard("l_train_000002.bin", 1, 3001, 2000, 50257);
  chorus_tokens_t *d;
  char pat[600];
  snprintf(pat, sizeof pat, "%s/l_train_*.bin", g_dir);
  ASSERT_EQ(chorus_tokens_open(pat, CHORUS_SPLIT_TRAIN, CHORUS_TOKENS_AUTO, 50257, &d),
            CHORUS_OK);
  const int T = 20, B = 3, W = 2;
  const size_t n = chorus_tokens_samples(d, T); /* 250 */
  ASSERT_EQ(n, 250);
  chorus_sampler_t *sp;
  ASSERT_EQ(chorus_sampler_create(n, W, 1, 1, 77, 0, &sp), CHORUS_OK);
  int workers[] = {0, 1, 3}, prefetch[] = {1, 2, 4};
  for (int c = 0; c < 3; c++) {
    chorus_loader_config_t lc = {T, B, workers[c], prefetch[c], 1, 0, 77, 0, 0};
    chorus_loader_t *l;
    ASSERT_EQ(chorus_loader_create(d, &lc, W, 1, &l), CHORUS_OK);
    ASSERT_EQ(chorus_sampler_set_epoch(sp, 0), CHORUS_OK);
    int tok[60], tgt[60];
    size_t idx[3];
    /* 125 per rank per epoch: 100 batches run into epoch 2. */
    for (int b = 0; b < 100; b++) {
      ASSERT_EQ(chorus_loader_next(l, tok, tgt, idx, NULL), CHORUS_OK);
      for (int k = 0; k < B; k++) {
        size_t want;
        ASSERT_EQ(chorus_sampler_next(sp, &want), CHORUS_OK);
        if (idx[k] != want) {
          HARNESS_FAIL("workers %d: batch %d item %d is sequence %zu, the sampler says %zu",
                       workers[c], b, k, idx[k], want);
          b = 100;
          break;
        }
        if ((uint32_t)tok[k * T] != tok_at(idx[k] * T, 50257))
          HARNESS_FAIL("workers %d: batch %d item %d has the wrong tokens", workers[c], b, k);
      }
    }
    ASSERT_EQ(chorus_loader_epoch(l), chorus_sampler_epoch(sp));
    ASSERT_EQ(chorus_loader_taken(l), chorus_sampler_taken(sp));
    ASSERT_EQ(chorus_loader_epoch(l), 2);
    /* Reshard to one rank at the consumed position: it goes on with the
     * rest of epoch 2 in global order. */
    const size_t taken = chorus_loader_taken(l);
    ASSERT_EQ(chorus_loader_reshard(l, 1, 0), CHORUS_OK);
    chorus_sampler_t *one;
    ASSERT_EQ(chorus_sampler_create(n, 1, 0, 1, 77, 0, &one), CHORUS_OK);
    ASSERT_EQ(chorus_sampler_seek(one, 2, taken), CHORUS_OK);
    same_batches(l, one, 5, B, T);
    /* Seek back: the same batches again. */
    ASSERT_EQ(chorus_loader_seek(l, 2, taken), CHORUS_OK);
    ASSERT_EQ(chorus_sampler_seek(one, 2, taken), CHORUS_OK);
    same_batches(l, one, 5, B, T);
    chorus_sampler_destroy(one);
    chorus_loader_destroy(l);
  }
  chorus_sampler_destroy(sp);
  /* Fewer sequences than ranks. */
  chorus_loader_config_t lc = {T, B, 0, 1, 1, 0, 77, 0, 0};
  chorus_loader_t *l;
  ASSERT_EQ(chorus_loader_create(d, &lc, 300, 0, &l), CHORUS_ERR_INVALID_ARG);
  chorus_tokens_close(d);
  unlink(path_of("l_train_000001.bin"));
  unlink(path_of("l_train_000002.bin"));
}

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A read slower than the loader's deadline fails next() in time, naming
 * the batch, and a seek that would wait longer than the deadline for that
 * read fails too.  The read takes 2.5 deadlines (3 s against 1.2 s): the
 * seek gives up at 2 deadlines and destroy() waits until 3, 0.6 s of slack
 * either way.  With a deadline that holds, a seek waits only for
 * the read under way, not for every batch queued behind it, and the first
 * batch comes again after it. */
TEST(loader_deadline_and_seek) {
  write_shard("s_train_000001.bin", 1, 0, 3001, 50257);
  chorus_tokens_t *d;
  ASSERT_EQ(chorus_tokens_open(path_of("s_train_000001.bin"), CHORUS_SPLIT_TRAIN,
                               CHORUS_TOKENS_AUTO, 50257, &d), CHORUS_OK);
  chorus_loader_config_t lc = {20, 1, 1, 1, 1, 0, 5, 3.0, 1.2};
  chorus_loader_t *l;
  ASSERT_EQ(chorus_loader_create(d, &lc, 1, 0, &l), CHORUS_OK);
  int tok[20], tgt[20];
  size_t idx, first;
  double t0 = mono_s();
  ASSERT_EQ(chorus_loader_next(l, tok, tgt, &idx, NULL), CHORUS_ERR_TIMEOUT);
  double waited = mono_s() - t0;
  if (waited < 1.19 || waited > 2.5) HARNESS_FAIL("next() gave up after %.2f s", waited);
  ASSERT_TRUE(strstr(chorus_train_last_error(), "was not read within") != NULL);
  ASSERT_EQ(chorus_loader_seek(l, 0, 0), CHORUS_ERR_TIMEOUT);
  ASSERT_TRUE(strstr(chorus_train_last_error(), "did not end within") != NULL);
  chorus_loader_destroy(l); /* waits for that read to end */

  chorus_loader_config_t lc2 = {20, 1, 1, 6, 1, 0, 5, 0.5, 30};
  ASSERT_EQ(chorus_loader_create(d, &lc2, 1, 0, &l), CHORUS_OK);
  ASSERT_EQ(chorus_loader_next(l, tok, tgt, &first, NULL), CHORUS_OK);
  ASSERT_EQ(chorus_loader_next(l, tok, tgt, &idx, NULL), CHORUS_OK);
  /* Six batches queued, one being read: the seek takes one read, not six. */
  t0 = mono_s();
  ASSERT_EQ(chorus_loader_seek(l, 0, 0), CHORUS_OK);
  double seek_s = mono_s() - t0;
  if (seek_s > 1.5)
    HARNESS_FAIL("the seek took %.2f s: it waited for the queued batches (0.5 s each)", seek_s);
  ASSERT_EQ(chorus_loader_next(l, tok, tgt, &idx, NULL), CHORUS_OK);
  ASSERT_EQ(idx, first);
  chorus_loader_destroy(l);
  chorus_tokens_close(d);
  unlink(path_of("s_train_000001.bin"));
}

int main(void) {
  const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
  snprintf(g_dir, sizeof g_dir, "%s/chorus-test-data-XXXXXX", tmp);
  if (!mkdtemp(g_dir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(shards_round_trip);
  RUN(bad_files);
  RUN(raw16_and_text);
  RUN(loader_order);
  RUN(loader_deadline_and_seek);
  unlink(path_of("d_train_000001.bin"));
  unlink(path_of("d_train_000002.bin"));
  unlink(path_of("d_train_000003.bin"));
  unlink(path_of("d_val_000000.bin"));
  if (rmdir(g_dir) != 0) HARNESS_FAIL("%s left with files in it: %s", g_dir, strerror(errno));
  return HARNESS_DONE();
}
