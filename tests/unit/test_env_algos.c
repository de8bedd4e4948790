/*
 * test_env_algos.c - every CHORUS_<COLL>_ALGO variable's description in
 * util/env.def (what --print-env and docs/env.md show) lists exactly the
 * algorithms the registry has for that collective, in its order, then
 * "auto": a registered algorithm the description leaves out, or a name it
 * keeps after the algorithm went, fails here.
 */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "chorus.h"
#include "harness.h"

static const struct {
  const char *name, *doc;
} k_env[] = {
#define X(name, type, def, doc) {#name, doc},
#include "util/env.def"
#undef X
};

TEST(algo_variables_list_the_registry) {
  int checked = 0;
  for (int c = 0; c < CHORUS_COLL_COUNT; c++) {
    const char *coll = chorus_coll_name((chorus_coll_t)c);
    char var[64];
    size_t n = 0;
    for (const char *p = coll; *p && n + 1 < sizeof var; p++) var[n++] = (char)toupper(*p);
    snprintf(var + n, sizeof var - n, "_ALGO");
    const char *doc = NULL;
    for (size_t i = 0; i < sizeof k_env / sizeof *k_env; i++)
      if (!strcmp(k_env[i].name, var)) doc = k_env[i].doc;
    if (!doc) continue; /* a collective with one way (send, recv, ...) has no variable */
    char want[512];
    int w = snprintf(want, sizeof want, "Algorithm for %s (", coll);
    for (int i = 0; chorus_algo_name((chorus_coll_t)c, i); i++)
      w += snprintf(want + w, sizeof want - (size_t)w, "%s, ", chorus_algo_name((chorus_coll_t)c, i));
    snprintf(want + w, sizeof want - (size_t)w, "auto).");
    ASSERT_STREQ(doc, want);
    checked++;
  }
  ASSERT_EQ(checked, 9); /* broadcast ... barrier: the nine with a choice */
}

int main(void) {
  RUN(algo_variables_list_the_registry);
  return HARNESS_DONE();
}
