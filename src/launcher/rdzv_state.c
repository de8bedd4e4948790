/*
 * rdzv_state.c - the rendezvous's values as text (rdzv_state.h); the
 * format of the state is described at the top of rdzv.c.
 */
#include "launcher/rdzv_state.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/env.h"
#include "util/util.h"

const char *const rdzv_phase_name[3] = {"join", "frozen", "closed"};

int rdzv_id_ok(const char *s, size_t max) {
  size_t n = 0;
  for (; s[n]; n++) {
    char c = s[n];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
          c == '.' || c == '_' || c == ':' || c == '/' || c == '-'))
      return 0;
  }
  return n > 0 && n < max;
}


/* Makes a line of text safe for the state: no newline, bounded. */
void rdzv_one_line(char *dst, size_t cap, const char *src) {
  size_t k = 0;
  for (const char *p = src; *p && k + 1 < cap; p++) dst[k++] = (*p == '\n' || *p == '\r') ? ' ' : *p;
  dst[k] = '\0';
}

void rdzv_set_reason(rstate_t *s, const char *fmt, ...) {
  char buf[REASON_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  rdzv_one_line(s->reason, sizeof s->reason, buf);
}

int rdzv_find(const rnode_t *v, int n, const char *id) {
  for (int i = 0; i < n; i++)
    if (!strcmp(v[i].id, id)) return i;
  return -1;
}

static int parse_long_field(const char *s, long lo, long hi, long *out) {
  return chorus__parse_long(s, out) == 0 && *out >= lo && *out <= hi ? 0 : -1;
}

/* A node line's fields: prev ID GRANK, expect ID, member|wait ID NPROC WANT.
 * 0, or -1 when a field is out of range. */
static int parse_node(char *const *f, int nf, rnode_t *r) {
  long a = 0, b = -1;
  if (!rdzv_id_ok(f[1], ID_MAX)) return -1;
  if (nf == 3 && parse_long_field(f[2], 0, MAX_NODES - 1, &b) != 0) return -1;
  if (nf == 4 && (parse_long_field(f[2], 1, MAX_NPROC, &a) != 0 ||
                  parse_long_field(f[3], -1, MAX_NODES - 1, &b) != 0))
    return -1;
  snprintf(r->id, sizeof r->id, "%s", f[1]);
  r->nproc = (int)a;
  r->want = (int)b;
  return 0;
}

/* One line of a state (after the first): 0, or -1 when it is malformed. */
static int parse_line(char *line, rstate_t *s) {
  if (!strncmp(line, "reason ", 7)) {
    rdzv_one_line(s->reason, sizeof s->reason, line + 7);
    return 0;
  }
  char *f[5] = {0}, *save = NULL;
  int nf = 0;
  for (char *t = strtok_r(line, " ", &save); t && nf < 5; t = strtok_r(NULL, " ", &save))
    f[nf++] = t;
  if (nf == 0) return 0;
  long a = 0, b = 0;
  if (!strcmp(f[0], "round") && nf == 2 && parse_long_field(f[1], 0, 1L << 40, &a) == 0) {
    s->round = a;
  } else if (!strcmp(f[0], "restarts") && nf == 2 &&
             parse_long_field(f[1], 0, 1L << 40, &a) == 0) {
    s->restarts = a;
  } else if (!strcmp(f[0], "max_restarts") && nf == 2 &&
             parse_long_field(f[1], 0, 1000000, &a) == 0) {
    s->max_restarts = (int)a;
  } else if (!strcmp(f[0], "exit") && nf == 2 && parse_long_field(f[1], 0, 255, &a) == 0) {
    s->exit_code = (int)a;
  } else if (!strcmp(f[0], "phase") && nf == 2) {
    for (int i = 0; i < 3; i++)
      if (!strcmp(f[1], rdzv_phase_name[i])) s->phase = i;
    if (s->phase < 0) return -1;
  } else if (!strcmp(f[0], "nnodes") && nf == 3 &&
             parse_long_field(f[1], 1, MAX_NODES, &a) == 0 &&
             parse_long_field(f[2], a, MAX_NODES, &b) == 0) {
    s->min = (int)a;
    s->max = (int)b;
  } else if ((!strcmp(f[0], "prev") && nf == 3) || (!strcmp(f[0], "expect") && nf == 2) ||
             ((!strcmp(f[0], "member") || !strcmp(f[0], "wait")) && nf == 4)) {
    rnode_t *v;
    int *n;
    switch (f[0][0]) {
      case 'p': v = s->prev, n = &s->nprev; break;
      case 'e': v = s->exp, n = &s->nexp; break;
      case 'm': v = s->mem, n = &s->nmem; break;
      default: v = s->wait, n = &s->nwait; break;
    }
    if (*n >= MAX_NODES || parse_node(f, nf, &v[*n]) != 0) return -1;
    (*n)++;
  } else {
    return -1;
  }
  return 0;
}

/* Parses a state value into s.  0, or -1 with the reason in err. */
int rdzv_state_parse(const char *text, rstate_t *s, char *err, size_t cap) {
  memset(s, 0, offsetof(rstate_t, prev));
  s->nprev = s->nexp = s->nmem = s->nwait = 0;
  s->phase = -1;
  int lineno = 0;
  for (const char *p = text; *p;) {
    const char *nl = strchr(p, '\n');
    size_t len = nl ? (size_t)(nl - p) : strlen(p);
    lineno++;
    char line[512];
    if (len >= sizeof line) {
      snprintf(err, cap, "line %d is too long", lineno);
      return -1;
    }
    memcpy(line, p, len);
    line[len] = '\0';
    p += len + (nl ? 1 : 0);
    if (lineno == 1 ? strcmp(line, "chorus-rdzv 1") != 0 : parse_line(line, s) != 0) {
      if (lineno == 1) snprintf(err, cap, "not a chorus rendezvous state (version 1)");
      else snprintf(err, cap, "line %d is malformed", lineno);
      return -1;
    }
  }
  if (lineno == 0 || s->phase < 0 || s->min < 1) {
    snprintf(err, cap, "round, phase or nnodes missing");
    return -1;
  }
  if (s->nmem > s->max) {
    snprintf(err, cap, "%d members, more than the %d allowed", s->nmem, s->max);
    return -1;
  }
  return 0;
}

/* The text of s, malloc'd. */
char *rdzv_state_format(const rstate_t *s) {
  size_t cap = 512 + (size_t)(s->nprev + s->nexp + s->nmem + s->nwait) * (ID_MAX + 40);
  char *out = xmalloc(cap);
  size_t n = 0;
#define PUT(...) n += (size_t)snprintf(out + n, cap - n, __VA_ARGS__)
  PUT("chorus-rdzv 1\nround %ld\nphase %s\nnnodes %d %d\nmax_restarts %d\nrestarts %ld\n",
      s->round, rdzv_phase_name[s->phase], s->min, s->max, s->max_restarts, s->restarts);
  if (s->phase == PH_CLOSED) PUT("exit %d\n", s->exit_code);
  if (s->reason[0]) PUT("reason %s\n", s->reason);
  for (int i = 0; i < s->nprev; i++) PUT("prev %s %d\n", s->prev[i].id, s->prev[i].want);
  for (int i = 0; i < s->nexp; i++) PUT("expect %s\n", s->exp[i].id);
  for (int i = 0; i < s->nmem; i++)
    PUT("member %s %d %d\n", s->mem[i].id, s->mem[i].nproc, s->mem[i].want);
  for (int i = 0; i < s->nwait; i++)
    PUT("wait %s %d %d\n", s->wait[i].id, s->wait[i].nproc, s->wait[i].want);
#undef PUT
  return out;
}

char *rdzv_fail_format(const fail_t *f) {
  size_t cap = 1024 + (size_t)f->ntail * (TAIL_LINE_MAX + 8);
  char *out = xmalloc(cap);
  size_t n = (size_t)snprintf(out, cap, "chorus-fail 1\n%s %d %d %d %s\n%s\n", f->kind, f->code,
                              f->grank, f->rank, f->node, f->what);
  for (int i = 0; i < f->ntail && n < cap; i++)
    n += (size_t)snprintf(out + n, cap - n, "%s\n", f->tail[i]);
  return out;
}

/* Parses a failure record (untrusted): 0 or -1. */
int rdzv_fail_parse(const char *text, fail_t *f) {
  memset(f, 0, sizeof *f);
  const char *p = text;
  char line[TAIL_LINE_MAX + 8];
  for (int lineno = 0; *p; lineno++) {
    const char *nl = strchr(p, '\n');
    size_t len = nl ? (size_t)(nl - p) : strlen(p);
    size_t keep = CHORUS__MIN(len, sizeof line - 1);
    memcpy(line, p, keep);
    line[keep] = '\0';
    p += len + (nl ? 1 : 0);
    if (lineno == 0) {
      if (strcmp(line, "chorus-fail 1")) return -1;
    } else if (lineno == 1) {
      char kind[8], node[ID_MAX];
      if (sscanf(line, "%7s %d %d %d %95s", kind, &f->code, &f->grank, &f->rank, node) != 5 ||
          !rdzv_id_ok(node, ID_MAX) || f->code < 0 || f->code > 255)
        return -1;
      snprintf(f->kind, sizeof f->kind, "%s", kind);
      snprintf(f->node, sizeof f->node, "%s", node);
    } else if (lineno == 2) {
      rdzv_one_line(f->what, sizeof f->what, line);
    } else if (f->ntail < TAIL_LINES) {
      rdzv_one_line(f->tail[f->ntail++], TAIL_LINE_MAX, line);
    }
  }
  return f->kind[0] ? 0 : -1;
}

int rdzv_all_expected_in(const rstate_t *s) {
  if (s->nexp == 0) return 0;
  for (int i = 0; i < s->nexp; i++)
    if (rdzv_find(s->mem, s->nmem, s->exp[i].id) < 0) return 0;
  return 1;
}

int rdzv_rank_order(const rstate_t *s, int by_want, rstate_t *n) {
  int count = s->nmem;
  int slot[MAX_NODES], used[MAX_NODES];
  for (int i = 0; i < count; i++) slot[i] = -1, used[i] = 0;
  if (by_want) {
    for (int i = 0; i < count; i++) {
      int w = s->mem[i].want;
      if (w < 0 || w >= count || slot[w] >= 0) return -1; /* checked at join */
      slot[w] = i;
    }
  } else {
    /* Last round's nodes keep their group rank when it still exists. */
    for (int i = 0; i < count; i++) {
      int p = rdzv_find(s->prev, s->nprev, s->mem[i].id);
      if (p >= 0 && s->prev[p].want < count && slot[s->prev[p].want] < 0) {
        slot[s->prev[p].want] = i;
        used[i] = 1;
      }
    }
    /* The rest fill the holes: last round's nodes in their old order, then
     * new ones in join order. */
    int next = 0;
    for (int pass = 0; pass < 2; pass++)
      for (int k = 0; k < (pass ? count : s->nprev); k++) {
        int i = pass ? k : rdzv_find(s->mem, count, s->prev[k].id);
        if (i < 0 || used[i]) continue;
        while (slot[next] >= 0) next++;
        slot[next] = i;
        used[i] = 1;
      }
  }
  for (int r = 0; r < count; r++) n->mem[r] = s->mem[slot[r]];
  return 0;
}

int rdzv_run_id_ok(const char *s) { return rdzv_id_ok(s, 128); }
