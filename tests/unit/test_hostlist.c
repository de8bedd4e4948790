/*
 * test_hostlist.c - Slurm host lists (util/hostlist.c): the forms Slurm
 * writes, padding, products of groups, and malformed or hostile lists that
 * must be refused without expanding them.
 */
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "util/hostlist.h"

/* The whole list, joined by spaces (for short lists). */
static const char *expand(const char *list) {
  static char out[4096];
  char host[300];
  long n = chorus__hostlist_count(list);
  if (n < 0) return "ERROR";
  out[0] = '\0';
  for (long i = 0; i < n; i++) {
    if (chorus__hostlist_nth(list, i, host, sizeof host) != 0) return "ERROR-NTH";
    if (i) strcat(out, " ");
    strcat(out, host);
  }
  return out;
}

TEST(plain) {
  ASSERT_STREQ(expand("vm"), "vm");
  ASSERT_STREQ(expand("a,b,c"), "a b c");
  ASSERT_STREQ(expand("node-1.example.org"), "node-1.example.org");
}

TEST(ranges) {
  ASSERT_STREQ(expand("n[0-3]"), "n0 n1 n2 n3");
  ASSERT_STREQ(expand("node[01-04,07]"), "node01 node02 node03 node04 node07");
  ASSERT_STREQ(expand("n[8-11]"), "n8 n9 n10 n11");
  ASSERT_STREQ(expand("n[098-101]"), "n098 n099 n100 n101");
  ASSERT_STREQ(expand("n[5]"), "n5");
  ASSERT_STREQ(expand("n[1-2],login,m[3,5]"), "n1 n2 login m3 m5");
  ASSERT_STREQ(expand("n[1-2]-ib"), "n1-ib n2-ib");
}

TEST(products) {
  ASSERT_STREQ(expand("r[1-2]n[0-1]"), "r1n0 r1n1 r2n0 r2n1");
  ASSERT_STREQ(expand("r[1-2]n[0-1],x"), "r1n0 r1n1 r2n0 r2n1 x");
}

TEST(nth_and_count) {
  char h[64];
  ASSERT_EQ(chorus__hostlist_count("n[0-999999]"), 1000000);
  ASSERT_EQ(chorus__hostlist_nth("n[0-999999]", 123456, h, sizeof h), 0);
  ASSERT_STREQ(h, "n123456");
  ASSERT_EQ(chorus__hostlist_nth("n[0-3]", 4, h, sizeof h), -1);
  ASSERT_EQ(chorus__hostlist_nth("n[0-3]", -1, h, sizeof h), -1);
  ASSERT_EQ(chorus__hostlist_nth("node[01-04]", 0, h, 6), -1); /* "node01" needs 7 */
  ASSERT_EQ(chorus__hostlist_nth("node[01-04]", 0, h, 7), 0);
}

TEST(malformed) {
  static const char *bad[] = {
      "", ",", "a,", ",a", "a,,b", "n[", "n]", "n[]", "n[1-]", "n[-1]", "n[3-1]", "n[1,]",
      "n[a]", "n[1-2", "n[1[2]]", "n[1 2]", "n[1234567890]", "n[0-2000000]",
      "a[0-999]b[0-999]c[0-9]",                      /* 10^7 hosts: over the cap */
      "a[1]b[1]c[1]d[1]e[1]f[1]g[1]h[1]i[1]",         /* more groups than allowed */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    if (chorus__hostlist_count(bad[i]) != -1) HARNESS_FAIL("accepted '%s'", bad[i]);
    char h[64];
    if (chorus__hostlist_nth(bad[i], 0, h, sizeof h) != -1)
      HARNESS_FAIL("nth accepted '%s'", bad[i]);
  }
  ASSERT_EQ(chorus__hostlist_count(NULL), -1);
  /* A name over the host-name limit is refused when asked for. */
  char longname[400], h[400];
  memset(longname, 'x', 300);
  strcpy(longname + 300, "[1-2]");
  ASSERT_EQ(chorus__hostlist_count(longname), 2);
  ASSERT_EQ(chorus__hostlist_nth(longname, 0, h, sizeof h), -1);
}

int main(void) {
  RUN(plain);
  RUN(ranges);
  RUN(products);
  RUN(nth_and_count);
  RUN(malformed);
  return HARNESS_DONE();
}
