/*
 * harness.h - a minimal test harness: TEST(name) bodies registered by hand in
 * main via RUN(name), ASSERT_* macros that print both operands and the
 * location, and a summary line "N passed, M failed".
 */
#ifndef CHORUS_TEST_HARNESS_H
#define CHORUS_TEST_HARNESS_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int harness_failed_asserts;
static int harness_passed, harness_failed;

#define TEST(name) static void test_##name(void)

#define RUN(name)                                                               \
  do {                                                                         \
    int before_ = harness_failed_asserts;                                      \
    test_##name();                                                             \
    if (harness_failed_asserts == before_) {                                   \
      harness_passed++;                                                        \
      printf("ok   %s\n", #name);                                              \
    } else {                                                                   \
      harness_failed++;                                                        \
      printf("FAIL %s\n", #name);                                              \
    }                                                                          \
    fflush(stdout);                                                            \
  } while (0)

#define HARNESS_FAIL(...)                                                       \
  do {                                                                         \
    harness_failed_asserts++;                                                  \
    fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                            \
    fprintf(stderr, __VA_ARGS__);                                              \
    fputc('\n', stderr);                                                       \
  } while (0)

#define ASSERT_TRUE(c)                                                          \
  do {                                                                         \
    if (!(c)) {                                                                \
      HARNESS_FAIL("assertion failed: %s", #c);                                \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define ASSERT_EQ(a, b)                                                         \
  do {                                                                         \
    long long a_ = (long long)(a), b_ = (long long)(b);                        \
    if (a_ != b_) {                                                            \
      HARNESS_FAIL("%s == %s: %lld != %lld", #a, #b, a_, b_);                  \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define ASSERT_STREQ(a, b)                                                      \
  do {                                                                         \
    const char *a_ = (a), *b_ = (b);                                           \
    if (!a_ || !b_ || strcmp(a_, b_)) {                                        \
      HARNESS_FAIL("%s == %s: \"%s\" != \"%s\"", #a, #b, a_ ? a_ : "(null)",   \
                   b_ ? b_ : "(null)");                                        \
      return;                                                                  \
    }                                                                          \
  } while (0)

#define ASSERT_CONTAINS(hay, needle)                                            \
  do {                                                                         \
    const char *h_ = (hay), *n_ = (needle);                                    \
    if (!h_ || !strstr(h_, n_)) {                                              \
      HARNESS_FAIL("\"%s\" does not contain \"%s\"", h_ ? h_ : "(null)", n_);  \
      return;                                                                  \
    }                                                                          \
  } while (0)

/* Prints the summary line CTest logs and returns the exit status. */
#define HARNESS_DONE()                                                          \
  (printf("%d passed, %d failed\n", harness_passed, harness_failed),           \
   harness_failed ? 1 : 0)

#endif
