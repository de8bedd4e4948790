/*
 * test_rdzv_state.c - chorusrun's rendezvous values as text
 * (src/launcher/rdzv_state.c): a state and a failure record survive
 * format -> parse with every field; the parsers refuse every malformed or
 * out-of-range line (the values come from a store or an etcd that others
 * may reach); the round decision that reads only the state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "launcher/rdzv_state.h"

static rstate_t g_a, g_b; /* big (4 x 1024 nodes): not on the stack */

static void node(rnode_t *n, const char *id, int nproc, int want) {
  snprintf(n->id, sizeof n->id, "%s", id);
  n->nproc = nproc;
  n->want = want;
}

/* A state with every field set to something other than its default. */
static void full_state(rstate_t *s) {
  memset(s, 0, sizeof *s);
  s->round = 7, s->restarts = 2, s->phase = PH_FROZEN, s->min = 2, s->max = 4;
  s->max_restarts = 3;
  snprintf(s->reason, sizeof s->reason, "node 10.0.0.3/4242 was lost (no heartbeat for 0.6 s)");
  node(&s->prev[s->nprev++], "10.0.0.1/100", 0, 0);
  node(&s->prev[s->nprev++], "10.0.0.2/200", 0, 1);
  node(&s->exp[s->nexp++], "10.0.0.1/100", 0, -1);
  node(&s->mem[s->nmem++], "10.0.0.1/100", 4, -1);
  node(&s->mem[s->nmem++], "10.0.0.2/200", 2, 1);
  node(&s->wait[s->nwait++], "10.0.0.9/900", 8, -1);
}

static int same_nodes(const rnode_t *a, const rnode_t *b, int n) {
  for (int i = 0; i < n; i++)
    if (strcmp(a[i].id, b[i].id) || a[i].nproc != b[i].nproc || a[i].want != b[i].want) return 0;
  return 1;
}

/* Format, parse, compare every field; the text formats back the same. */
static void round_trip(const rstate_t *a, rstate_t *b) {
  char err[200] = "";
  char *text = rdzv_state_format(a);
  int rc = rdzv_state_parse(text, b, err, sizeof err);
  if (rc != 0) HARNESS_FAIL("parse of its own format failed: %s\n%s", err, text);
  ASSERT_EQ(rc, 0);
  ASSERT_EQ(b->round, a->round);
  ASSERT_EQ(b->restarts, a->restarts);
  ASSERT_EQ(b->phase, a->phase);
  ASSERT_EQ(b->min, a->min);
  ASSERT_EQ(b->max, a->max);
  ASSERT_EQ(b->max_restarts, a->max_restarts);
  ASSERT_EQ(b->exit_code, a->exit_code);
  ASSERT_STREQ(b->reason, a->reason);
  ASSERT_EQ(b->nprev, a->nprev);
  ASSERT_EQ(b->nexp, a->nexp);
  ASSERT_EQ(b->nmem, a->nmem);
  ASSERT_EQ(b->nwait, a->nwait);
  ASSERT_TRUE(same_nodes(b->mem, a->mem, a->nmem));
  ASSERT_TRUE(same_nodes(b->wait, a->wait, a->nwait));
  for (int i = 0; i < a->nprev; i++) {
    ASSERT_STREQ(b->prev[i].id, a->prev[i].id);
    ASSERT_EQ(b->prev[i].want, a->prev[i].want);
  }
  for (int i = 0; i < a->nexp; i++) ASSERT_STREQ(b->exp[i].id, a->exp[i].id);
  char *again = rdzv_state_format(b);
  ASSERT_STREQ(again, text);
  free(again);
  free(text);
}

TEST(state_round_trip) {
  full_state(&g_a);
  round_trip(&g_a, &g_b);
}

TEST(closed_state_keeps_its_exit_code) {
  full_state(&g_a);
  g_a.phase = PH_CLOSED;
  g_a.exit_code = 137;
  round_trip(&g_a, &g_b);
  ASSERT_EQ(g_b.exit_code, 137);
}

TEST(a_join_state_with_nothing_optional) {
  memset(&g_a, 0, sizeof g_a);
  g_a.phase = PH_JOIN, g_a.min = 1, g_a.max = 1;
  round_trip(&g_a, &g_b);
}

TEST(the_largest_state) {
  memset(&g_a, 0, sizeof g_a);
  g_a.phase = PH_FROZEN, g_a.min = 1, g_a.max = MAX_NODES;
  char id[ID_MAX];
  for (int i = 0; i < MAX_NODES; i++) {
    snprintf(id, sizeof id, "node-%04d.cluster.example.org:29400/%d", i, 100000 + i);
    node(&g_a.mem[g_a.nmem++], id, MAX_NPROC, i);
  }
  round_trip(&g_a, &g_b);
}

/* Each text must be refused, with a reason. */
static const char *const k_bad[] = {
    "",                                                           /* empty */
    "chorus-rdzv 2\nround 0\nphase join\nnnodes 1 1\n",           /* another version */
    "round 0\nphase join\nnnodes 1 1\n",                          /* no header */
    "chorus-rdzv 1\nround 0\nnnodes 1 1\n",                       /* no phase */
    "chorus-rdzv 1\nround 0\nphase join\n",                       /* no nnodes */
    "chorus-rdzv 1\nphase joined\nnnodes 1 1\n",                  /* unknown phase */
    "chorus-rdzv 1\nphase join\nnnodes 3 2\n",                    /* max below min */
    "chorus-rdzv 1\nphase join\nnnodes 0 2\n",                    /* min 0 */
    "chorus-rdzv 1\nphase join\nnnodes 1 1025\n",                 /* max over MAX_NODES */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nround -1\n",          /* negative round */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nround 1x\n",          /* not a number */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nrestarts\n",          /* a field missing */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nround 1 2\n",          /* a field too many */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nexit 256\n",          /* no such exit code */
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nmax_restarts 2000000\n",
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nspeed 3\n",           /* unknown line */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a$b 1 -1\n",   /* a bad id */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a 0 -1\n",     /* no workers */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a 4097 -1\n",  /* too many workers */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a 1 1024\n",   /* no such node rank */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a 1\n",        /* a field missing */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nmember a 1 -1 x\n",   /* a field too many */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nwait a 1\n",
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nprev a\n",
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nprev a -1\n",         /* no such group rank */
    "chorus-rdzv 1\nphase join\nnnodes 1 2\nexpect a b\n",
    "chorus-rdzv 1\nphase join\nnnodes 1 1\nmember a 1 -1\nmember b 1 -1\n", /* over max */
};

TEST(malformed_states_are_refused) {
  for (size_t i = 0; i < sizeof k_bad / sizeof *k_bad; i++) {
    char err[200] = "";
    if (rdzv_state_parse(k_bad[i], &g_b, err, sizeof err) == 0)
      HARNESS_FAIL("accepted: \"%s\"", k_bad[i]);
    else if (!err[0])
      HARNESS_FAIL("refused without a reason: \"%s\"", k_bad[i]);
  }
}

TEST(a_line_too_long_is_refused) {
  static char text[4096];
  int n = snprintf(text, sizeof text, "chorus-rdzv 1\nphase join\nnnodes 1 1\nreason ");
  memset(text + n, 'x', 1000);
  text[n + 1000] = '\0';
  char err[200] = "";
  ASSERT_EQ(rdzv_state_parse(text, &g_b, err, sizeof err), -1);
  ASSERT_CONTAINS(err, "too long");
}

TEST(a_reason_cannot_add_lines) {
  memset(&g_a, 0, sizeof g_a);
  g_a.phase = PH_JOIN, g_a.min = 1, g_a.max = 1;
  rdzv_one_line(g_a.reason, sizeof g_a.reason, "first\nmember x 1 -1\rlast");
  ASSERT_STREQ(g_a.reason, "first member x 1 -1 last");
  round_trip(&g_a, &g_b);
  ASSERT_EQ(g_b.nmem, 0);
}

TEST(failure_record_round_trip) {
  static fail_t a, b;
  memset(&a, 0, sizeof a);
  snprintf(a.kind, sizeof a.kind, "signal");
  a.code = 137, a.grank = 1, a.rank = 5;
  snprintf(a.node, sizeof a.node, "10.0.0.2/200");
  snprintf(a.what, sizeof a.what, "rank 5 (pid 4242) failed: killed by signal 9 (SIGKILL)");
  a.ntail = 2;
  snprintf(a.tail[0], TAIL_LINE_MAX, "step 10 loss 3.2");
  snprintf(a.tail[1], TAIL_LINE_MAX, "the last line");
  char *text = rdzv_fail_format(&a);
  ASSERT_EQ(rdzv_fail_parse(text, &b), 0);
  ASSERT_STREQ(b.kind, a.kind);
  ASSERT_EQ(b.code, a.code);
  ASSERT_EQ(b.grank, a.grank);
  ASSERT_EQ(b.rank, a.rank);
  ASSERT_STREQ(b.node, a.node);
  ASSERT_STREQ(b.what, a.what);
  ASSERT_EQ(b.ntail, a.ntail);
  ASSERT_STREQ(b.tail[0], a.tail[0]);
  ASSERT_STREQ(b.tail[1], a.tail[1]);
  free(text);
}

TEST(malformed_failure_records_are_refused) {
  static fail_t f;
  static const char *const bad[] = {
      "",
      "chorus-fail 2\nexit 1 0 0 a/1\nwhat\n",
      "chorus-fail 1\n",
      "chorus-fail 1\nexit 1 0 0\nwhat\n",        /* the node missing */
      "chorus-fail 1\nexit 256 0 0 a/1\nwhat\n",  /* no such exit code */
      "chorus-fail 1\nexit -1 0 0 a/1\nwhat\n",
      "chorus-fail 1\nexit 1 0 0 a$1\nwhat\n",    /* a bad node id */
      "chorus-fail 1\nexit x 0 0 a/1\nwhat\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    if (rdzv_fail_parse(bad[i], &f) == 0) HARNESS_FAIL("accepted: \"%s\"", bad[i]);
}

TEST(ids) {
  ASSERT_TRUE(rdzv_id_ok("10.0.0.1:29400/4242", ID_MAX));
  ASSERT_TRUE(rdzv_id_ok("run-7_a.b", ID_MAX));
  ASSERT_TRUE(!rdzv_id_ok("", ID_MAX));
  ASSERT_TRUE(!rdzv_id_ok("a b", ID_MAX));
  ASSERT_TRUE(!rdzv_id_ok("a\nb", ID_MAX));
  ASSERT_TRUE(!rdzv_id_ok("../x;y", ID_MAX));
  char longid[ID_MAX + 1];
  memset(longid, 'a', ID_MAX);
  longid[ID_MAX] = '\0';
  ASSERT_TRUE(!rdzv_id_ok(longid, ID_MAX));
  ASSERT_TRUE(rdzv_run_id_ok("run7"));
}

TEST(all_expected_in) {
  memset(&g_a, 0, sizeof g_a);
  ASSERT_EQ(rdzv_all_expected_in(&g_a), 0); /* nothing expected: the last call decides */
  node(&g_a.exp[g_a.nexp++], "a/1", 0, -1);
  node(&g_a.exp[g_a.nexp++], "b/2", 0, -1);
  node(&g_a.mem[g_a.nmem++], "a/1", 1, -1);
  ASSERT_EQ(rdzv_all_expected_in(&g_a), 0);
  node(&g_a.mem[g_a.nmem++], "b/2", 1, -1);
  ASSERT_EQ(rdzv_all_expected_in(&g_a), 1);
  ASSERT_EQ(rdzv_find(g_a.mem, g_a.nmem, "b/2"), 1);
  ASSERT_EQ(rdzv_find(g_a.mem, g_a.nmem, "c/3"), -1);
}

/* The freeze's group ranks: a node of the last round keeps its rank while
 * it exists, the rest fill the holes (last round's nodes first), and static
 * ranks are taken as asked or refused. */
TEST(rank_order) {
  static rstate_t n;
  memset(&g_a, 0, sizeof g_a);
  node(&g_a.prev[g_a.nprev++], "a/1", 0, 0);
  node(&g_a.prev[g_a.nprev++], "b/2", 0, 1);
  node(&g_a.prev[g_a.nprev++], "c/3", 0, 2);
  node(&g_a.mem[g_a.nmem++], "new/9", 1, -1);
  node(&g_a.mem[g_a.nmem++], "c/3", 1, -1);
  node(&g_a.mem[g_a.nmem++], "b/2", 1, -1);
  ASSERT_EQ(rdzv_rank_order(&g_a, 0, &n), 0);
  /* b keeps 1, c keeps 2, the newcomer fills 0. */
  ASSERT_EQ(strcmp(n.mem[0].id, "new/9"), 0);
  ASSERT_EQ(strcmp(n.mem[1].id, "b/2"), 0);
  ASSERT_EQ(strcmp(n.mem[2].id, "c/3"), 0);
  /* Two nodes: c's rank 2 is gone, so c fills a hole before the newcomer. */
  g_a.nmem = 0;
  node(&g_a.mem[g_a.nmem++], "new/9", 1, -1);
  node(&g_a.mem[g_a.nmem++], "c/3", 1, -1);
  ASSERT_EQ(rdzv_rank_order(&g_a, 0, &n), 0);
  ASSERT_EQ(strcmp(n.mem[0].id, "c/3"), 0);
  ASSERT_EQ(strcmp(n.mem[1].id, "new/9"), 0);
  /* Static ranks: as asked; a duplicate or one out of range is refused. */
  g_a.nmem = 0;
  node(&g_a.mem[g_a.nmem++], "x/1", 1, 1);
  node(&g_a.mem[g_a.nmem++], "y/2", 1, 0);
  ASSERT_EQ(rdzv_rank_order(&g_a, 1, &n), 0);
  ASSERT_EQ(strcmp(n.mem[0].id, "y/2"), 0);
  ASSERT_EQ(strcmp(n.mem[1].id, "x/1"), 0);
  g_a.mem[0].want = 0;
  ASSERT_EQ(rdzv_rank_order(&g_a, 1, &n), -1);
  g_a.mem[0].want = 2;
  ASSERT_EQ(rdzv_rank_order(&g_a, 1, &n), -1);
}

int main(void) {
  RUN(state_round_trip);
  RUN(closed_state_keeps_its_exit_code);
  RUN(a_join_state_with_nothing_optional);
  RUN(the_largest_state);
  RUN(malformed_states_are_refused);
  RUN(a_line_too_long_is_refused);
  RUN(a_reason_cannot_add_lines);
  RUN(failure_record_round_trip);
  RUN(malformed_failure_records_are_refused);
  RUN(ids);
  RUN(all_expected_in);
  RUN(rank_order);
  return HARNESS_DONE();
}
