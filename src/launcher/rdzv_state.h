/*
 * rdzv_state.h - the rendezvous's values as text, and the decisions that
 * read nothing else: the state of the rounds (parsed from and formatted to
 * the text every agent reads and compare-and-sets, rdzv.c) and a round's
 * failure record.  Pure functions of their arguments, unit-tested on their
 * own (tests/unit/test_rdzv_state.c).  Received values are untrusted: the
 * parsers bound every field and count and refuse a line they do not know.
 */
#ifndef CHORUS_LAUNCHER_RDZV_STATE_H
#define CHORUS_LAUNCHER_RDZV_STATE_H

#include <stddef.h>

#include "launcher/launcher.h"

#define MAX_NODES 1024
#define ID_MAX 96
#define REASON_MAX 256

enum { PH_JOIN, PH_FROZEN, PH_CLOSED };
extern const char *const rdzv_phase_name[3]; /* "join", "frozen", "closed" */

typedef struct {
  char id[ID_MAX];
  int nproc;
  int want; /* member/wait: static node rank or -1; prev: group rank */
} rnode_t;

typedef struct {
  long round, restarts;
  int phase, min, max, max_restarts, exit_code;
  char reason[REASON_MAX];
  int nprev, nexp, nmem, nwait;
  rnode_t prev[MAX_NODES], exp[MAX_NODES], mem[MAX_NODES], wait[MAX_NODES];
} rstate_t;

/* A round's failure record ("fail/R"): the first failure anywhere. */
typedef struct {
  char kind[8]; /* exit, signal, lost, error */
  int code;     /* the exit code it gives the job */
  int grank, rank;
  char node[ID_MAX];
  char what[300];
  int ntail;
  char tail[TAIL_LINES][TAIL_LINE_MAX];
} fail_t;

/* Node ids and run ids: 1 to max-1 of letters, digits and . _ : / - */
int rdzv_id_ok(const char *s, size_t max);
/* src made one line (no newline), bounded by cap. */
void rdzv_one_line(char *dst, size_t cap, const char *src);
/* s->reason from the format, made one line. */
void rdzv_set_reason(rstate_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The index of the node id in v[0..n), or -1. */
int rdzv_find(const rnode_t *v, int n, const char *id);
/* Parses a state value into s: 0, or -1 with the reason in err. */
int rdzv_state_parse(const char *text, rstate_t *s, char *err, size_t cap);
/* The text of s (malloc'd; xmalloc: exits on no memory). */
char *rdzv_state_format(const rstate_t *s);
/* A failure record's text (malloc'd) and its parser (0, or -1). */
char *rdzv_fail_format(const fail_t *f);
int rdzv_fail_parse(const char *text, fail_t *f);
/* 1 when the round waits for named nodes and all of them are members. */
int rdzv_all_expected_in(const rstate_t *s);
/* The freeze's group ranks: n->mem (n not s) gets s's members in group-rank
 * order.  by_want (static): each member's rank is its --node-rank; -1 when
 * two want the same one or one is out of range.  Else last round's nodes
 * keep their rank while it is below the new count, and the rest fill the
 * holes, last round's nodes first (in their old order), then new ones in
 * join order.  0, or -1. */
int rdzv_rank_order(const rstate_t *s, int by_want, rstate_t *n);

#endif
