/*
 * test_bpe.c - the tokenizer (src/train/bpe.c) without the Python
 * reference: the pre-split scanner on cases checked by hand (and against
 * the regex module once), encoding with a hand-made vocabulary, load
 * errors (each must name the file and what is wrong), save/load and
 * decode(encode(x)) round trips, counters merged, the training's limits.
 * GPT-2's own files are used where CHORUS_GPT2_DIR names their folder.
 *   test_bpe [ignored]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus_train.h"
#include "harness.h"
#include "train/bpe.h"

static char g_dir[256]; /* this run's scratch folder */

/* ------------------------------------------------------------ helpers */

static void write_file(const char *dir, const char *name, const char *text, size_t len) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
}

static char *read_whole(const char *dir, const char *name, size_t *len) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) exit(1);
  fclose(f);
  buf[n] = '\0';
  *len = (size_t)n;
  return buf;
}

/* GPT-2's spelling of byte b (UTF-8, NUL-terminated). */
static const char *spell_byte(int b, char out[4]) {
  int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; x++)
      if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE))) n++;
    cp = 256 + n;
  }
  if (cp < 0x80) {
    out[0] = (char)cp, out[1] = 0;
  } else {
    out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
  }
  return out;
}

/* The id of byte b in GPT-2's layout (printable bytes first). */
static int byte_id(int b) {
  int id = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int x = 0; x < 256; x++) {
      int printable = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE);
      if (printable != !pass) continue;
      if (x == b) return id;
      id++;
    }
  return -1;
}

/* Writes dir/encoder.json and dir/vocab.bpe: the 256 bytes, the merges
 * ("a b" each, ASCII letters only so that spelling is the text itself)
 * with results named by results[], then <|endoftext|> if eot. */
static void make_vocab(const char *dir, const char *const *merges, const char *const *results,
                       int n, int eot) {
  mkdir(dir, 0755);
  static char json[1 << 16];
  size_t o = 0;
  o += (size_t)snprintf(json + o, sizeof json - o, "{");
  for (int id = 0; id < 256; id++) {
    int b = -1;
    for (int x = 0; x < 256; x++)
      if (byte_id(x) == id) b = x;
    char sp[4];
    spell_byte(b, sp);
    const char *esc = (!strcmp(sp, "\"") || !strcmp(sp, "\\")) ? "\\" : "";
    o += (size_t)snprintf(json + o, sizeof json - o, "%s\"%s%s\": %d", id ? ", " : "", esc, sp,
                          id);
  }
  for (int r = 0; r < n; r++)
    o += (size_t)snprintf(json + o, sizeof json - o, ", \"%s\": %d", results[r], 256 + r);
  if (eot) o += (size_t)snprintf(json + o, sizeof json - o, ", \"<|endoftext|>\": %d", 256 + n);
  o += (size_t)snprintf(json + o, sizeof json - o, "}");
  write_file(dir, "encoder.json", json, o);
  static char bpe[1 << 14];
  size_t b = (size_t)snprintf(bpe, sizeof bpe, "#version: 0.2\n");
  for (int r = 0; r < n; r++) b += (size_t)snprintf(bpe + b, sizeof bpe - b, "%s\n", merges[r]);
  write_file(dir, "vocab.bpe", bpe, b);
}

/* Encodes text (len bytes) with t and a fresh encoder. */
static size_t encode(const chorus_bpe_t *t, const void *text, size_t len, uint32_t **toks) {
  chorus_bpe_encoder_t *e;
  size_t n = 0, cap = 0;
  *toks = NULL;
  if (chorus_bpe_encoder_create(t, &e) != CHORUS_OK) return (size_t)-1;
  chorus_result_t st = chorus_bpe_encode(e, text, len, toks, &n, &cap);
  chorus_bpe_encoder_free(e);
  return st == CHORUS_OK ? n : (size_t)-1;
}

/* decode(toks) == text? */
static int decodes_to(const chorus_bpe_t *t, const uint32_t *toks, size_t n, const void *text,
                      size_t len) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    size_t l;
    const unsigned char *p = chorus_bpe_token(t, (int)toks[i], &l);
    if (!p || o + l > len || memcmp((const char *)text + o, p, l)) return 0;
    o += l;
  }
  return o == len;
}

/* ------------------------------------------------------------- scanner */

typedef struct {
  const char *text;
  const char *pieces[6];
} split_case_t;

/* Checked by hand, and once against regex.findall with GPT-2's pattern
 * (the text decoded with surrogateescape). */
static const split_case_t k_splits[] = {
    {"Hello world", {"Hello", " world"}},
    {"I'm here", {"I", "'m", " here"}},
    {"don'T", {"don", "'", "T"}},
    {"''s", {"''", "s"}},
    {"'ll've", {"'ll", "'ve"}},
    {" 'S", {" '", "S"}},
    {"'", {"'"}},
    {"  hello", {" ", " hello"}},
    {"a  \n b", {"a", "  \n", " b"}},
    {"x \n", {"x", " \n"}},
    {"   ", {"   "}},
    {" \n ", {" \n "}},
    {"\t\tword", {"\t", "\t", "word"}},
    {"a\r\n\r\nb", {"a", "\r\n\r", "\n", "b"}},
    {"123abc", {"123", "abc"}},
    {" 123", {" 123"}},
    {"3.14", {"3", ".", "14"}},
    {"!!! ?", {"!!!", " ?"}},
    {"x\x1c", {"x", "\x1c"}},                                  /* not \s */
    {"\xc3\xa9t\xc3\xa9", {"\xc3\xa9t\xc3\xa9"}},              /* été */
    {"hello\xcc\x81", {"hello", "\xcc\x81"}},                  /* combining mark: not L */
    {"\xd9\xa1\xd9\xa2x", {"\xd9\xa1\xd9\xa2", "x"}},          /* Arabic-Indic digits */
    {"a\xc2\xa0" "b", {"a", "\xc2\xa0", "b"}},                 /* U+00A0 */
    {"\xe2\x80\x83x", {"\xe2\x80\x83", "x"}},                  /* U+2003 */
    {" \xe2\x80\x83x", {" ", "\xe2\x80\x83", "x"}},
    {"\xe3\x80\x80\xe3\x80\x80\xe5\xad\x97", {"\xe3\x80\x80", "\xe3\x80\x80", "\xe5\xad\x97"}},
    {"\xe2\x80\x8b", {"\xe2\x80\x8b"}},                        /* ZWSP: other */
    {"\xff\xfe", {"\xff\xfe"}},                                /* not UTF-8: other */
    {"a\xc3", {"a", "\xc3"}},                                  /* truncated */
    {"\xed\xa0\x80" "a", {"\xed\xa0\x80", "a"}},               /* a surrogate */
    {"\xc0\x80", {"\xc0\x80"}},                                /* overlong */
    {"\xf4\x90\x80\x80", {"\xf4\x90\x80\x80"}},                /* > U+10FFFF */
    {" \xff" "a", {" \xff", "a"}},
};

TEST(scanner_cases) {
  for (size_t c = 0; c < sizeof k_splits / sizeof *k_splits; c++) {
    const split_case_t *k = &k_splits[c];
    const uint8_t *p = (const uint8_t *)k->text, *end = p + strlen(k->text);
    int i = 0;
    while (p < end) {
      size_t n = chorus__bpe_piece_len(p, end);
      const char *want = k->pieces[i];
      if (!want || strlen(want) != n || memcmp(want, p, n)) {
        HARNESS_FAIL("case %zu: piece %d is %zu bytes \"%.*s\", expected \"%s\"", c, i, n, (int)n,
                     (const char *)p, want ? want : "(none)");
        return;
      }
      p += n;
      i++;
    }
    ASSERT_TRUE(k->pieces[i] == NULL);
  }
}

/* The piece boundaries of text[0, len) as flags in at[0..len]. */
static void boundaries(const uint8_t *text, size_t len, char *at) {
  memset(at, 0, len + 1);
  for (const uint8_t *p = text; p < text + len;) {
    at[p - text] = 1;
    p += chorus__bpe_piece_len(p, text + len);
  }
  at[len] = 1;
}

/* Up to 40 fragments drawn with *seed (an LCG), end to end in text (at
 * most cap bytes): their length. */
static size_t mixture(const char *const *frag, size_t nfrag, unsigned *seed, uint8_t *text,
                      size_t cap) {
  size_t len = 0;
  for (int k = 0; k < 40; k++) {
    *seed = *seed * 1103515245u + 12345u;
    const char *f = frag[(*seed >> 16) % nfrag];
    size_t n = strlen(f);
    if (len + n > cap) break;
    memcpy(text + len, f, n);
    len += n;
  }
  return len;
}

/* A place chorus_bpe_cut gives is a boundary of the whole text, and the
 * text cut there has the same pieces before it: checked at every place of
 * random mixtures of letters, digits, contractions, ASCII and Unicode
 * spaces, \x1c, marks and bytes that are not UTF-8; and hand cases. */
TEST(cut_places) {
  static const char *const frag[] = {
      "a", "Z", "\xc3\xa9", "\xe6\x97\xa5", "1", "\xd9\xa3", "'", "s", "ll", " ", "  ", "\n",
      "\r\n", "\t", "\xc2\xa0", "\xe3\x80\x80", "\xe3\x80\x82", "\x1c", ".", "!", "\xcc\x81",
      "\xff", "\xc3"};
  const size_t nfrag = sizeof frag / sizeof *frag;
  uint8_t text[256];
  char whole[257], part[257];
  unsigned seed = 12345;
  size_t cuts = 0;
  for (int round = 0; round < 3000; round++) {
    size_t len = mixture(frag, nfrag, &seed, text, sizeof text);
    boundaries(text, len, whole);
    for (size_t p = 0; p < len; p++) {
      size_t c = chorus_bpe_cut(text, len, p);
      ASSERT_TRUE(c >= p && c <= len);
      if (c == len) break;
      cuts++;
      boundaries(text, c, part);
      if (!whole[c] || memcmp(whole, part, c)) {
        HARNESS_FAIL("round %d: a cut at %zu of \"%.*s\" changes the pieces", round, c,
                     (int)len, (const char *)text);
        return;
      }
      p = c; /* the next one after this */
    }
  }
  ASSERT_TRUE(cuts > 10000);
  /* CRLF, Chinese full stop before a newline, the non-breaking and the
   * ideographic space (\s in GPT-2's pattern) and \x1c (not \s). */
  ASSERT_EQ(chorus_bpe_cut("a\r\nb", 4, 0), 1);
  ASSERT_EQ(chorus_bpe_cut("\xe6\x97\xa5\xe3\x80\x82\n\xe6\x97\xa5", 10, 0), 6);
  ASSERT_EQ(chorus_bpe_cut("\xc2\xa0 x", 4, 0), 4);
  ASSERT_EQ(chorus_bpe_cut("\xe3\x80\x80\nx", 5, 0), 5);
  ASSERT_EQ(chorus_bpe_cut("\x1c x", 3, 0), 1);
  ASSERT_EQ(chorus_bpe_cut("word", 4, 0), 4);
  ASSERT_EQ(chorus_bpe_cut("ab cd ef", 8, 3), 5);
}

/* A place chorus_bpe_cut_pieces gives is a boundary of the whole text's
 * pieces, and the text cut there has the same pieces on both sides: at
 * every place of random mixtures (as above), and of texts holding runs
 * longer than a piece may be (64 KiB of letters, of CJK characters, of
 * digits, of spaces, of symbols), which are cut into pieces of at most
 * 64 KiB and a character (issue 42: without white space a text was one
 * piece, 17 bytes of memory per byte). */
static int cuts_agree(const uint8_t *text, size_t len, const char *whole, size_t c) {
  char *part = malloc(len + 1);
  int ok = part != NULL;
  if (ok) {
    boundaries(text, c, part);
    ok = whole[c] && !memcmp(whole, part, c);
  }
  if (ok) {
    boundaries(text + c, len - c, part);
    ok = !memcmp(whole + c, part, len - c + 1);
  }
  free(part);
  return ok;
}

TEST(cut_pieces) {
  static const char *const frag[] = {
      "a", "Z", "\xc3\xa9", "\xe6\x97\xa5", "1", "\xd9\xa3", "'", "s", "ll", " ", "  ", "\n",
      "\r\n", "\t", "\xc2\xa0", "\xe3\x80\x80", "\xe3\x80\x82", "\x1c", ".", "!", "\xcc\x81",
      "\xff", "\xc3", "'re"};
  const size_t nfrag = sizeof frag / sizeof *frag;
  uint8_t text[256];
  char whole[257];
  unsigned seed = 777;
  size_t cuts = 0;
  for (int round = 0; round < 2000; round++) {
    size_t len = mixture(frag, nfrag, &seed, text, sizeof text);
    boundaries(text, len, whole);
    size_t start = 0;
    for (size_t p = 0; p < len;) {
      size_t c = chorus_bpe_cut_pieces(text, len, start, p);
      ASSERT_TRUE(c >= p && c <= len);
      if (c == len) break;
      cuts++;
      if (!cuts_agree(text, len, whole, c)) {
        HARNESS_FAIL("round %d: a cut at %zu of \"%.*s\" changes the pieces", round, c,
                     (int)len, (const char *)text);
        return;
      }
      start = c;
      p = c + 1 + (seed >> 20) % 7;
    }
  }
  ASSERT_TRUE(cuts > 5000);
  /* Long runs, each between two words. */
  static const char *const run[] = {"a", "\xe6\x97\xa5", "7", " ", "#", "\n"};
  const size_t big = 200000;
  uint8_t *t = malloc(big + 64);
  char *w = malloc(big + 65);
  ASSERT_TRUE(t && w);
  for (size_t r = 0; r < sizeof run / sizeof *run; r++) {
    size_t len = 0, k = strlen(run[r]);
    memcpy(t, "word ", 5), len = 5;
    while (len + k + 6 < big) memcpy(t + len, run[r], k), len += k;
    memcpy(t + len, " end.", 5), len += 5;
    boundaries(t, len, w);
    size_t longest = 0, last = 0;
    for (size_t i = 1; i <= len; i++)
      if (w[i]) longest = i - last > longest ? i - last : longest, last = i;
    ASSERT_TRUE(longest >= (64u << 10) && longest <= (64u << 10) + 3);
    size_t start = 0, n = 0;
    for (size_t p = 1000; p < len; p += 30011) {
      size_t c = chorus_bpe_cut_pieces(t, len, start, p);
      if (c == len) break;
      ASSERT_TRUE(cuts_agree(t, len, w, c));
      start = c, n++;
    }
    ASSERT_TRUE(n >= 2);
  }
  free(t);
  free(w);
}

/* --------------------------------------------------- hand-made vocabulary */

TEST(hand_vocab) {
  char dir[300];
  snprintf(dir, sizeof dir, "%s/hand", g_dir);
  /* Ranks: 0 "h e", 1 "l l", 2 "he ll", 3 "b c", 4 "a b", 5 "a a",
   * 6 "Ġ w" (space + w). */
  const char *merges[] = {"h e", "l l", "he ll", "b c", "a b", "a a", "\xc4\xa0 w"};
  const char *results[] = {"he", "ll", "hell", "bc", "ab", "aa", "\xc4\xa0w"};
  make_vocab(dir, merges, results, 7, 1);
  char err[512];
  chorus_bpe_t *t;
  ASSERT_EQ(chorus_bpe_load(dir, &t, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_vocab(t), 256 + 7 + 1);
  ASSERT_EQ(chorus_bpe_eot(t), 263);
  size_t len;
  const unsigned char *eot = chorus_bpe_token(t, 263, &len);
  ASSERT_TRUE(eot && len == 13 && !memcmp(eot, "<|endoftext|>", 13));
  ASSERT_TRUE(chorus_bpe_token(t, 264, &len) == NULL);
  ASSERT_TRUE(chorus_bpe_token(t, -1, &len) == NULL);
  const unsigned char *w = chorus_bpe_token(t, 262, &len);
  ASSERT_TRUE(w && len == 2 && !memcmp(w, " w", 2));
  struct {
    const char *text;
    int n;
    int ids[6];
  } cases[] = {
      {"hello", 2, {258, 'o' - '!'}},                  /* he, ll, hell; o */
      {"abc", 2, {'a' - '!', 259}},                    /* "b c" outranks "a b" */
      {"aaa", 2, {261, 'a' - '!'}},                    /* left to right, no overlap */
      {"aaaa", 2, {261, 261}},
      {" w", 1, {262}},
      {"x w", 2, {'x' - '!', 262}},
      {"\n", 1, {byte_id('\n')}},
      {"<|endoftext|>", 6, {byte_id('<'), byte_id('|'), 'e' - '!', 'n' - '!', 'd' - '!', 'o' - '!'}},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    uint32_t *toks;
    size_t n = encode(t, cases[c].text, strlen(cases[c].text), &toks);
    if (c == 7) n = n > 6 ? 6 : n; /* ordinary text: only its start is checked */
    ASSERT_EQ(n, cases[c].n);
    for (int i = 0; i < cases[c].n; i++)
      if ((int)toks[i] != cases[c].ids[i]) {
        HARNESS_FAIL("\"%s\": token %d is %u, expected %d", cases[c].text, i, toks[i],
                     cases[c].ids[i]);
        free(toks);
        chorus_bpe_free(t);
        return;
      }
    free(toks);
  }
  chorus_bpe_free(t);
}

/* encoder.py's rule is "every occurrence of the lowest-ranked pair, then
 * look again", not "the leftmost lowest pair, then look again": with
 * "ab a" ranked before "a b" (a file may say so), "abab" is ab ab, not
 * aba b.  Short pieces (an array) and long ones (the heap) alike. */
TEST(rank_order_rule) {
  char dir[300];
  snprintf(dir, sizeof dir, "%s/order", g_dir);
  const char *merges[] = {"ab a", "a b"};
  const char *results[] = {"aba", "ab"};
  make_vocab(dir, merges, results, 2, 0);
  char err[512];
  chorus_bpe_t *t;
  ASSERT_EQ(chorus_bpe_load(dir, &t, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_eot(t), -1);
  for (size_t reps = 2; reps <= 400; reps += 398) { /* 4 bytes, then 800 (the heap) */
    char *s = malloc(2 * reps);
    for (size_t i = 0; i < reps; i++) s[2 * i] = 'a', s[2 * i + 1] = 'b';
    uint32_t *toks;
    size_t n = encode(t, s, 2 * reps, &toks);
    ASSERT_EQ(n, reps);
    for (size_t i = 0; i < n; i++) ASSERT_EQ(toks[i], 257);
    free(toks);
    free(s);
  }
  chorus_bpe_free(t);
}

/* ---------------------------------------------------------- load errors */

typedef struct {
  const char *what;
  const char *from, *to; /* replace the first from with to in file */
  const char *file;
  chorus_result_t st;
  const char *says; /* a part of the message */
} bad_case_t;

TEST(load_errors) {
  char dir[300], err[512];
  snprintf(dir, sizeof dir, "%s/bad", g_dir);
  const char *merges[] = {"h e", "l l", "he ll"};
  const char *results[] = {"he", "ll", "hell"};
  chorus_bpe_t *t = (chorus_bpe_t *)1;

  /* No folder, no files. */
  ASSERT_EQ(chorus_bpe_load("/nonexistent/bpe", &t, err, sizeof err), CHORUS_ERR_SYSTEM);
  ASSERT_TRUE(t == NULL);
  ASSERT_TRUE(strstr(err, "/nonexistent/bpe/encoder.json") && strstr(err, "cannot open"));
  ASSERT_TRUE(strstr(chorus_train_last_error(), "cannot open") != NULL);
  ASSERT_EQ(chorus_bpe_load(NULL, &t, err, sizeof err), CHORUS_ERR_INVALID_ARG);

  const bad_case_t cases[] = {
      {"bad JSON", "\"he\": 256", "\"he\" 256", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "encoder.json line 1 column"},
      {"not an object", "{", "[", "encoder.json", CHORUS_ERR_INVALID_ARG, "encoder.json line"},
      {"duplicate key", "\"ll\": 257", "\"he\": 257", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "duplicate"},
      {"duplicate id", "\"ll\": 257", "\"ll\": 256", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "is given to both"},
      {"id out of range", "\"hell\": 258", "\"hell\": 9999", "encoder.json",
       CHORUS_ERR_INVALID_ARG, "has id 9999"},
      {"id not an integer", "\"hell\": 258", "\"hell\": \"258\"", "encoder.json",
       CHORUS_ERR_INVALID_ARG, "not an integer"},
      {"negative id", "\"hell\": 258", "\"hell\": -1", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "has id -1"},
      {"outside the alphabet", "\"hell\": 258", "\"h\\u0400ll\": 258", "encoder.json",
       CHORUS_ERR_INVALID_ARG, "U+0400, which is not in GPT-2's byte alphabet"},
      {"empty token", "\"hell\": 258", "\"\": 258", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "empty token"},
      {"a byte id not a byte", "\"!\": 0", "\"!!\": 0", "encoder.json", CHORUS_ERR_INVALID_ARG,
       "ids 0..255 must be the 256 single bytes"},
      {"no version line", "#version: 0.2\n", "", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "vocab.bpe line 1"},
      {"one part", "l l\n", "ll\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "vocab.bpe line 3: expected two tokens"},
      {"three parts", "l l\n", "l l l\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "vocab.bpe line 3: expected two tokens"},
      {"missing part", "he ll\n", "he lo\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "vocab.bpe line 4: \"lo\" is not a token of encoder.json"},
      {"part outside the alphabet", "he ll\n", "he l\xd0\x80\n", "vocab.bpe",
       CHORUS_ERR_INVALID_ARG, "line 4: \"l\xd0\x80\" is not written in GPT-2's byte alphabet"},
      {"part not UTF-8", "he ll\n", "he l\xff\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "line 4: \"l\xff\" is not UTF-8"},
      {"merge result elsewhere", "h e\nl l\n", "l l\nh e\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "vocab.bpe line 2: merge 0 joins ids"},
      {"merge result missing", "he ll\n", "he he\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "is not in encoder.json; it must be id 258"},
      {"a merge too few", "he ll\n", "", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "has 2 merges: expected 256 bytes"},
      {"a merge onto <|endoftext|>'s id", "he ll\n", "he ll\nhe l\n", "vocab.bpe",
       CHORUS_ERR_INVALID_ARG, "line 5: merge 3 joins ids 256 and 75 into a token that is not in "
       "encoder.json; it must be id 259"},
      {"empty line", "he ll\n", "\nhe ll\n", "vocab.bpe", CHORUS_ERR_INVALID_ARG,
       "line 4: expected two tokens"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    make_vocab(dir, merges, results, 3, 1);
    size_t len;
    char *text = read_whole(dir, cases[c].file, &len);
    ASSERT_TRUE(text != NULL);
    char *at = strstr(text, cases[c].from);
    if (!at) {
      HARNESS_FAIL("case \"%s\": \"%s\" not in %s", cases[c].what, cases[c].from, cases[c].file);
      free(text);
      return;
    }
    size_t fl = strlen(cases[c].from), tl = strlen(cases[c].to);
    char *mod = malloc(len - fl + tl + 1);
    size_t head = (size_t)(at - text);
    memcpy(mod, text, head);
    memcpy(mod + head, cases[c].to, tl);
    memcpy(mod + head + tl, at + fl, len - head - fl);
    write_file(dir, cases[c].file, mod, len - fl + tl);
    free(mod);
    free(text);
    err[0] = '\0';
    chorus_result_t st = chorus_bpe_load(dir, &t, err, sizeof err);
    if (st != cases[c].st || !strstr(err, cases[c].says) || !strstr(err, cases[c].file) ||
        strcmp(err, chorus_train_last_error())) {
      HARNESS_FAIL("case \"%s\": %s, \"%s\"; expected %s and \"%s\"", cases[c].what,
                   chorus_result_name(st), err, chorus_result_name(cases[c].st), cases[c].says);
      if (st == CHORUS_OK) chorus_bpe_free(t);
      return;
    }
    ASSERT_TRUE(t == NULL);
  }
  /* A vocabulary without <|endoftext|> and with no merges is fine; a
   * small err buffer or none is too. */
  make_vocab(dir, merges, results, 0, 0);
  ASSERT_EQ(chorus_bpe_load(dir, &t, NULL, 0), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_vocab(t), 256);
  ASSERT_EQ(chorus_bpe_eot(t), -1);
  chorus_bpe_free(t);
  make_vocab(dir, merges, results, 3, 0);
  const char *extra = "#version: 0.2\nh e\nl l\nhe ll\nhe l\n";
  write_file(dir, "vocab.bpe", extra, strlen(extra));
  ASSERT_EQ(chorus_bpe_load(dir, &t, err, sizeof err), CHORUS_ERR_INVALID_ARG);
  if (!strstr(err, "line 5: more merges than")) HARNESS_FAIL("got \"%s\"", err);
  write_file(dir, "vocab.bpe", "#version: 0.2\nh e\n", 18);
  char small[8];
  ASSERT_EQ(chorus_bpe_load(dir, &t, small, sizeof small), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(strlen(small), 7);
}

/* ------------------------------------------- training, saving, round trips */

static const char k_text[] =
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see, won't we? "
    "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c \xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5"
    "\xd1\x82 \xf0\x9f\x98\x80\xf0\x9f\x98\x80  \t\n  for (i = 0; i < n; i++) x += y;\n"
    "\xff\xfe\xc3 caf\xc3\xa9 the the the quick quick brown    \n\n";

static chorus_bpe_t *train_on(const void *text, size_t len, int reps, int vocab) {
  chorus_bpe_counter_t *c;
  if (chorus_bpe_counter_create(&c) != CHORUS_OK) return NULL;
  for (int i = 0; i < reps; i++)
    if (chorus_bpe_count(c, text, len) != CHORUS_OK) return NULL;
  char err[512];
  chorus_bpe_t *t = NULL;
  if (chorus_bpe_train(c, vocab, &t, err, sizeof err) != CHORUS_OK) fprintf(stderr, "%s\n", err);
  chorus_bpe_counter_free(c);
  return t;
}

TEST(train_save_load_roundtrip) {
  chorus_bpe_t *t = train_on(k_text, sizeof k_text - 1, 3, 300);
  ASSERT_TRUE(t != NULL);
  ASSERT_EQ(chorus_bpe_vocab(t), 300);
  ASSERT_EQ(chorus_bpe_eot(t), 299);
  size_t len;
  const unsigned char *eot = chorus_bpe_token(t, 299, &len);
  ASSERT_TRUE(len == 13 && !memcmp(eot, "<|endoftext|>", 13));
  /* Ids 0..255 in GPT-2's byte order. */
  for (int b = 0; b < 256; b++) {
    const unsigned char *p = chorus_bpe_token(t, byte_id(b), &len);
    ASSERT_TRUE(p && len == 1 && *p == b);
  }
  char dir[300], err[512];
  snprintf(dir, sizeof dir, "%s/trained", g_dir);
  ASSERT_EQ(chorus_bpe_save(t, dir, err, sizeof err), CHORUS_OK);
  chorus_bpe_t *u;
  ASSERT_EQ(chorus_bpe_load(dir, &u, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_vocab(u), 300);
  for (int id = 0; id < 300; id++) {
    size_t l1, l2;
    const unsigned char *p = chorus_bpe_token(t, id, &l1), *q = chorus_bpe_token(u, id, &l2);
    ASSERT_TRUE(l1 == l2 && !memcmp(p, q, l1));
  }
  /* Saving what was loaded writes the same files. */
  char dir2[300];
  snprintf(dir2, sizeof dir2, "%s/trained2", g_dir);
  ASSERT_EQ(chorus_bpe_save(u, dir2, err, sizeof err), CHORUS_OK);
  for (int f = 0; f < 2; f++) {
    const char *name = f ? "vocab.bpe" : "encoder.json";
    size_t la, lb;
    char *a = read_whole(dir, name, &la), *b = read_whole(dir2, name, &lb);
    ASSERT_TRUE(a && b && la == lb && !memcmp(a, b, la));
    free(a);
    free(b);
  }
  /* decode(encode(x)) == x: the training text, random bytes, edge sizes,
   * and text the vocabulary never saw; one encoder for all (its cache). */
  chorus_bpe_encoder_t *e;
  ASSERT_EQ(chorus_bpe_encoder_create(u, &e), CHORUS_OK);
  unsigned char *buf = malloc(1 << 16);
  uint64_t x = 88172645463325252ull;
  uint32_t *toks = NULL;
  size_t cap = 0;
  for (int round = 0; round < 200; round++) {
    size_t n = round < 3 ? (size_t)round : (size_t)(x % 3000);
    for (size_t i = 0; i < n; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      buf[i] = round % 3 == 0 ? (unsigned char)x
               : round % 3 == 1 ? (unsigned char)k_text[x % (sizeof k_text - 1)]
                                : (unsigned char)" \t\nab'"[x % 6];
    }
    size_t nt = 0;
    ASSERT_EQ(chorus_bpe_encode(e, buf, n, &toks, &nt, &cap), CHORUS_OK);
    ASSERT_TRUE(decodes_to(u, toks, nt, buf, n));
    /* Encoding appends. */
    size_t before = nt;
    ASSERT_EQ(chorus_bpe_encode(e, buf, n, &toks, &nt, &cap), CHORUS_OK);
    ASSERT_EQ(nt, 2 * before);
    ASSERT_TRUE(!before || !memcmp(toks, toks + before, before * sizeof *toks));
  }
  size_t nt = 0;
  ASSERT_EQ(chorus_bpe_encode(e, NULL, 0, &toks, &nt, &cap), CHORUS_OK);
  ASSERT_EQ(nt, 0);
  ASSERT_EQ(chorus_bpe_encode(e, buf, 1, NULL, &nt, &cap), CHORUS_ERR_INVALID_ARG);
  free(toks);
  free(buf);
  chorus_bpe_encoder_free(e);
  chorus_bpe_free(u);
  chorus_bpe_free(t);
}

TEST(long_pieces) {
  chorus_bpe_t *t = train_on(k_text, sizeof k_text - 1, 2, 280);
  ASSERT_TRUE(t != NULL);
  /* 1 MB of spaces and 1 MB of symbols: pieces of 64 KiB. */
  size_t n = 1 << 20;
  unsigned char *s = malloc(n);
  for (int kind = 0; kind < 2; kind++) {
    uint64_t x = 12345;
    for (size_t i = 0; i < n; i++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      s[i] = kind ? (unsigned char)"!#$%&*+-/<=>?@^~"[x % 16] : ' ';
    }
    /* At most 64 KiB a piece (the tokenizer's one departure from GPT-2's
     * pattern, for memory). */
    ASSERT_EQ(chorus__bpe_piece_len(s, s + n), (size_t)64 << 10);
    uint32_t *toks;
    size_t nt = encode(t, s, n, &toks);
    ASSERT_TRUE(nt != (size_t)-1 && nt > 0);
    ASSERT_TRUE(decodes_to(t, toks, nt, s, n));
    free(toks);
  }
  free(s);
  chorus_bpe_free(t);
}

TEST(counters_merge) {
  /* Two counters merged train the same vocabulary as one that saw both. */
  const char *a = "alpha beta gamma alpha beta alpha ", *b = "beta delta delta epsilon beta ";
  chorus_bpe_counter_t *c1, *c2, *c3;
  ASSERT_EQ(chorus_bpe_counter_create(&c1), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_counter_create(&c2), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_counter_create(&c3), CHORUS_OK);
  for (int i = 0; i < 50; i++) {
    ASSERT_EQ(chorus_bpe_count(c1, a, strlen(a)), CHORUS_OK);
    ASSERT_EQ(chorus_bpe_count(c2, b, strlen(b)), CHORUS_OK);
    ASSERT_EQ(chorus_bpe_count(c3, a, strlen(a)), CHORUS_OK);
    ASSERT_EQ(chorus_bpe_count(c3, b, strlen(b)), CHORUS_OK);
  }
  ASSERT_EQ(chorus_bpe_counter_merge(c1, c2), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_counter_merge(c1, c1), CHORUS_ERR_INVALID_ARG);
  char err[512];
  chorus_bpe_t *t1, *t3;
  ASSERT_EQ(chorus_bpe_train(c1, 280, &t1, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_train(c3, 280, &t3, err, sizeof err), CHORUS_OK);
  for (int id = 0; id < 280; id++) {
    size_t l1, l3;
    const unsigned char *p = chorus_bpe_token(t1, id, &l1), *q = chorus_bpe_token(t3, id, &l3);
    ASSERT_TRUE(l1 == l3 && !memcmp(p, q, l1));
  }
  /* Too few distinct pairs for the size asked: an error that says how
   * many ids the text allows. */
  chorus_bpe_t *t;
  ASSERT_EQ(chorus_bpe_train(c2, 5000, &t, err, sizeof err), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(t == NULL && strstr(err, "gives only") && strstr(err, "at most"));
  ASSERT_EQ(chorus_bpe_train(c2, 256, &t, err, sizeof err), CHORUS_ERR_INVALID_ARG);
  ASSERT_TRUE(strstr(err, "257..") != NULL);
  /* An empty counter trains the 257 ids of bytes and <|endoftext|>. */
  chorus_bpe_counter_t *c0;
  ASSERT_EQ(chorus_bpe_counter_create(&c0), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_train(c0, 257, &t, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_vocab(t), 257);
  chorus_bpe_free(t);
  chorus_bpe_counter_free(c0);
  chorus_bpe_free(t1);
  chorus_bpe_free(t3);
  chorus_bpe_counter_free(c1);
  chorus_bpe_counter_free(c2);
  chorus_bpe_counter_free(c3);
}

/* GPT-2's own files, where CHORUS_GPT2_DIR names their folder. */
TEST(gpt2_files) {
  const char *dir = getenv("CHORUS_GPT2_DIR");
  if (!dir || !*dir) {
    printf("skip gpt2_files: set CHORUS_GPT2_DIR to a folder with GPT-2's encoder.json and "
           "vocab.bpe\n");
    return;
  }
  char err[512];
  chorus_bpe_t *t;
  ASSERT_EQ(chorus_bpe_load(dir, &t, err, sizeof err), CHORUS_OK);
  ASSERT_EQ(chorus_bpe_vocab(t), 50257);
  ASSERT_EQ(chorus_bpe_eot(t), 50256);
  uint32_t *toks;
  size_t n = encode(t, "Hello world", 11, &toks);
  ASSERT_EQ(n, 2);
  ASSERT_EQ(toks[0], 15496);
  ASSERT_EQ(toks[1], 995);
  free(toks);
  chorus_bpe_free(t);
}

int main(void) {
  snprintf(g_dir, sizeof g_dir, "%s/test_bpe.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(g_dir)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(scanner_cases);
  RUN(cut_places);
  RUN(cut_pieces);
  RUN(hand_vocab);
  RUN(rank_order_rule);
  RUN(load_errors);
  RUN(train_save_load_roundtrip);
  RUN(long_pieces);
  RUN(counters_merge);
  RUN(gpt2_files);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
  return HARNESS_DONE();
}
