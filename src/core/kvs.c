/*
 * kvs.c - see kvs.h.
 *
 * PMI-1 wire protocol (MPICH's "simple PMI"), one line per message, fields
 * "name=value" separated by spaces:
 *   -> cmd=init pmi_version=1 pmi_subversion=1
 *   <- cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0
 *   -> cmd=get_my_kvsname            <- cmd=my_kvsname kvsname=K rc=0
 *   -> cmd=put kvsname=K key=k value=v
 *   <- cmd=put_result rc=0 msg=success
 *   -> cmd=barrier_in                <- cmd=barrier_out
 *   -> cmd=get kvsname=K key=k       <- cmd=get_result rc=0 value=v
 *   -> cmd=finalize                  <- cmd=finalize_ack
 * PMI-1 keys are global to the job: rank r's key k is stored as "k-r".
 */
#include "core/kvs.h"

#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"
#include "util/util.h"

#ifdef CHORUS_HAVE_PMIX
#include <pmix.h>
#endif

#define LINE_MAX_BYTES 2048 /* longest PMI-1 reply we accept */

typedef enum { KVS_PMI1, KVS_PMIX, KVS_USER } kvs_kind_t;

#ifdef CHORUS_HAVE_PMIX
typedef struct {
  void *lib;
  pmix_status_t (*init)(pmix_proc_t *, pmix_info_t[], size_t);
  pmix_status_t (*finalize)(const pmix_info_t[], size_t);
  pmix_status_t (*put)(pmix_scope_t, const char[], pmix_value_t *);
  pmix_status_t (*commit)(void);
  pmix_status_t (*fence)(const pmix_proc_t[], size_t, const pmix_info_t[], size_t);
  pmix_status_t (*get)(const pmix_proc_t *, const char[], const pmix_info_t[], size_t,
                       pmix_value_t **);
  void (*value_destruct)(pmix_value_t *);
  pmix_proc_t me;
} pmix_api_t;
#endif

struct chorus__kvs {
  kvs_kind_t kind;
  chorus_kv_t user;   /* KVS_USER: the caller's callbacks */
  int fd;             /* PMI-1: the launcher's socket */
  int rank;           /* ours, as the launcher numbers us */
  char kvsname[256];  /* PMI-1 */
  char line[LINE_MAX_BYTES + 1];
  size_t have;        /* PMI-1: bytes buffered in line */
#ifdef CHORUS_HAVE_PMIX
  pmix_api_t px;
#endif
};

/* ------------------------------------------------------------ discovery */

static int pmi_fd_from_env(void) {
  const char *v = getenv("PMI_FD");
  long fd;
  if (!v || chorus__parse_long(v, &fd) < 0 || fd < 0 || fd > 1 << 20) return -1;
  return (int)fd;
}

const char *chorus__kvs_available(char *why, size_t cap) {
  if (why && cap) why[0] = '\0';
  if (pmi_fd_from_env() >= 0) return "PMI-1 (PMI_FD)";
  if (getenv("PMIX_NAMESPACE") && getenv("PMIX_RANK")) {
#ifdef CHORUS_HAVE_PMIX
    void *lib = dlopen("libpmix.so.2", RTLD_LAZY | RTLD_LOCAL);
    if (lib) {
      dlclose(lib);
      return "PMIx";
    }
    if (why) snprintf(why, cap, "the launcher offers PMIx but libpmix.so.2 cannot be loaded (%s)",
                      dlerror());
#else
    if (why) snprintf(why, cap, "the launcher offers PMIx but this libchorus was built without "
                      "PMIx support (libpmix-dev was missing)");
#endif
  }
  return NULL;
}

/* ------------------------------------------------------------ PMI-1 wire */

static chorus_result_t pmi1_send(chorus__kvs_t *k, const char *msg, int64_t deadline, char *err,
                                 size_t cap) {
  size_t len = strlen(msg), off = 0;
  while (off < len) {
    ssize_t n = write(k->fd, msg + off, len - off);
    if (n > 0) {
      off += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      struct pollfd p = {.fd = k->fd, .events = POLLOUT};
      int ms = chorus__ms_left(deadline);
      if (ms == 0 || poll(&p, 1, ms) == 0) {
        snprintf(err, cap, "PMI: the launcher did not take our request in time");
        return CHORUS_ERR_TIMEOUT;
      }
      continue;
    }
    snprintf(err, cap, "PMI: writing to PMI_FD=%d failed: %s", k->fd,
             n < 0 ? strerror(errno) : "closed");
    return CHORUS_ERR_REMOTE;
  }
  return CHORUS_OK;
}

/* Reads one reply line (without its newline) into reply (cap
 * LINE_MAX_BYTES + 1); bytes after it stay buffered. */
static chorus_result_t pmi1_recv(chorus__kvs_t *k, char *reply, int64_t deadline, char *err,
                                 size_t cap) {
  for (;;) {
    char *nl = memchr(k->line, '\n', k->have);
    if (nl) {
      size_t len = (size_t)(nl - k->line);
      memcpy(reply, k->line, len);
      reply[len] = '\0';
      k->have -= len + 1;
      memmove(k->line, nl + 1, k->have);
      return CHORUS_OK;
    }
    if (k->have == LINE_MAX_BYTES) {
      snprintf(err, cap, "PMI: the launcher sent a line longer than %d bytes", LINE_MAX_BYTES);
      return CHORUS_ERR_PROTOCOL;
    }
    struct pollfd p = {.fd = k->fd, .events = POLLIN};
    int ms = chorus__ms_left(deadline);
    int r = ms ? poll(&p, 1, ms) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      snprintf(err, cap, "PMI: no answer from the launcher in time (are all ranks running?)");
      return CHORUS_ERR_TIMEOUT;
    }
    ssize_t n = read(k->fd, k->line + k->have, LINE_MAX_BYTES - k->have);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      snprintf(err, cap, "PMI: the launcher closed PMI_FD=%d%s%s", k->fd, n < 0 ? ": " : "",
               n < 0 ? strerror(errno) : "");
      return CHORUS_ERR_REMOTE;
    }
    k->have += (size_t)n;
  }
}

/* Value of field `name` in the reply line, copied into out; -1 when
 * absent or too long. */
static int pmi1_field(const char *line, const char *name, char *out, size_t cap) {
  size_t nl = strlen(name);
  for (const char *p = line; *p;) {
    while (*p == ' ') p++;
    const char *end = strchr(p, ' ');
    if (!end) end = p + strlen(p);
    if ((size_t)(end - p) > nl && !strncmp(p, name, nl) && p[nl] == '=') {
      size_t vl = (size_t)(end - p) - nl - 1;
      if (vl >= cap) return -1;
      memcpy(out, p + nl + 1, vl);
      out[vl] = '\0';
      return 0;
    }
    p = end;
  }
  return -1;
}

/* Sends msg and reads the reply into reply, which must be cmd=<want>, and
 * whose rc, when it has one, must be 0. */
static chorus_result_t pmi1_call(chorus__kvs_t *k, const char *msg, const char *want,
                                 char *reply, int64_t deadline, char *err, size_t cap) {
  chorus_result_t st = pmi1_send(k, msg, deadline, err, cap);
  if (st == CHORUS_OK) st = pmi1_recv(k, reply, deadline, err, cap);
  if (st != CHORUS_OK) return st;
  char cmd[64], rc[16];
  if (pmi1_field(reply, "cmd", cmd, sizeof cmd) < 0 || strcmp(cmd, want)) {
    snprintf(err, cap, "PMI: expected cmd=%s from the launcher, got '%.200s'", want, reply);
    return CHORUS_ERR_PROTOCOL;
  }
  if (pmi1_field(reply, "rc", rc, sizeof rc) == 0 && strcmp(rc, "0")) {
    char why[200] = "";
    pmi1_field(reply, "msg", why, sizeof why);
    snprintf(err, cap, "PMI: the launcher answered %s with rc=%s%s%s", want, rc,
             why[0] ? ": " : "", why);
    return CHORUS_ERR_PROTOCOL;
  }
  return CHORUS_OK;
}

/* A key or value we send: printable, no space, no '='. */
static int pmi1_token_ok(const char *s, size_t max) {
  size_t n = 0;
  for (; s[n]; n++)
    if (s[n] <= ' ' || s[n] > '~' || s[n] == '=') return 0;
  return n > 0 && n <= max;
}

static chorus_result_t pmi1_open(chorus__kvs_t *k, int64_t deadline, char *err, size_t cap) {
  char reply[LINE_MAX_BYTES + 1];
  k->fd = pmi_fd_from_env();
  chorus_result_t st = pmi1_call(k, "cmd=init pmi_version=1 pmi_subversion=1\n",
                                 "response_to_init", reply, deadline, err, cap);
  if (st == CHORUS_OK)
    st = pmi1_call(k, "cmd=get_my_kvsname\n", "my_kvsname", reply, deadline, err, cap);
  if (st != CHORUS_OK) return st;
  if (pmi1_field(reply, "kvsname", k->kvsname, sizeof k->kvsname) < 0 ||
      !pmi1_token_ok(k->kvsname, sizeof k->kvsname - 1)) {
    snprintf(err, cap, "PMI: no usable kvsname in '%.200s'", reply);
    return CHORUS_ERR_PROTOCOL;
  }
  return CHORUS_OK;
}

/* ----------------------------------------------------------------- PMIx */

#ifdef CHORUS_HAVE_PMIX
static chorus_result_t pmix_open(chorus__kvs_t *k, char *err, size_t cap) {
  pmix_api_t *px = &k->px;
  px->lib = dlopen("libpmix.so.2", RTLD_LAZY | RTLD_LOCAL);
  if (!px->lib) {
    snprintf(err, cap, "PMIx: cannot load libpmix.so.2: %s", dlerror());
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  /* dlsym returns void *; POSIX guarantees the conversion works. */
#define SYM(field, name) *(void **)&px->field = dlsym(px->lib, name)
  SYM(init, "PMIx_Init");
  SYM(finalize, "PMIx_Finalize");
  SYM(put, "PMIx_Put");
  SYM(commit, "PMIx_Commit");
  SYM(fence, "PMIx_Fence");
  SYM(get, "PMIx_Get");
  SYM(value_destruct, "PMIx_Value_destruct");
#undef SYM
  if (!px->init || !px->finalize || !px->put || !px->commit || !px->fence || !px->get ||
      !px->value_destruct) {
    snprintf(err, cap, "PMIx: libpmix.so.2 lacks a function we need (PMIx 4 expected)");
    dlclose(px->lib);
    px->lib = NULL;
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  pmix_status_t rc = px->init(&px->me, NULL, 0);
  if (rc != PMIX_SUCCESS) {
    snprintf(err, cap, "PMIx: PMIx_Init failed (status %d): is the launcher's PMIx server "
             "reachable?", (int)rc);
    dlclose(px->lib);
    px->lib = NULL;
    return CHORUS_ERR_REMOTE;
  }
  return CHORUS_OK;
}
#endif

/* ------------------------------------------------------------------ API */

chorus_result_t chorus__kvs_open(chorus__kvs_t **out, int rank, int64_t deadline, char *err,
                                 size_t cap) {
  *out = NULL;
  char why[300];
  const char *which = chorus__kvs_available(why, sizeof why);
  if (!which) {
    snprintf(err, cap, "%s", why[0] ? why : "no launcher key-value service (PMI_FD, PMIx)");
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  chorus__kvs_t *k = calloc(1, sizeof *k);
  if (!k) return CHORUS_ERR_NO_MEMORY;
  k->fd = -1;
  k->rank = rank;
  chorus_result_t st;
  if (!strcmp(which, "PMIx")) {
    k->kind = KVS_PMIX;
#ifdef CHORUS_HAVE_PMIX
    st = pmix_open(k, err, cap);
#else
    st = CHORUS_ERR_NOT_SUPPORTED;
#endif
  } else {
    k->kind = KVS_PMI1;
    st = pmi1_open(k, deadline, err, cap);
  }
  if (st != CHORUS_OK) {
    free(k);
    return st;
  }
  CHORUS_INFO(CHORUS__SUB_INIT, "bootstrap: using the launcher's %s", which);
  *out = k;
  return CHORUS_OK;
}

chorus_result_t chorus__kvs_wrap(chorus__kvs_t **out, const chorus_kv_t *kv, int rank) {
  *out = NULL;
  if (!kv || !kv->set || !kv->get) return CHORUS_ERR_INVALID_ARG;
  chorus__kvs_t *k = calloc(1, sizeof *k);
  if (!k) return CHORUS_ERR_NO_MEMORY;
  k->kind = KVS_USER;
  k->user = *kv;
  k->fd = -1;
  k->rank = rank;
  *out = k;
  return CHORUS_OK;
}

chorus_result_t chorus__kvs_put(chorus__kvs_t *k, const char *key, const char *value,
                                int64_t deadline, char *err, size_t cap) {
  if (!pmi1_token_ok(key, 64) || !pmi1_token_ok(value, CHORUS__KVS_VALUE_MAX)) {
    snprintf(err, cap, "PMI: key or value not printable or too long");
    return CHORUS_ERR_INVALID_ARG;
  }
  if (k->kind == KVS_USER) {
    char why[300] = "";
    if (k->user.set(k->user.ctx, key, value, strlen(value), why, sizeof why) != 0) {
      why[sizeof why - 1] = '\0';
      snprintf(err, cap, "setting '%s' in the caller's key-value service failed: %s", key,
               why[0] ? why : "(no reason given)");
      return CHORUS_ERR_STORE;
    }
    return CHORUS_OK;
  }
#ifdef CHORUS_HAVE_PMIX
  if (k->kind == KVS_PMIX) {
    pmix_value_t v;
    memset(&v, 0, sizeof v);
    v.type = PMIX_STRING;
    v.data.string = (char *)value;
    pmix_status_t rc = k->px.put(PMIX_GLOBAL, key, &v);
    if (rc != PMIX_SUCCESS) {
      snprintf(err, cap, "PMIx: PMIx_Put(%s) failed (status %d)", key, (int)rc);
      return CHORUS_ERR_PROTOCOL;
    }
    return CHORUS_OK;
  }
#endif
  char msg[LINE_MAX_BYTES], reply[LINE_MAX_BYTES + 1];
  snprintf(msg, sizeof msg, "cmd=put kvsname=%s key=%s-%d value=%s\n", k->kvsname, key, k->rank,
           value);
  return pmi1_call(k, msg, "put_result", reply, deadline, err, cap);
}

chorus_result_t chorus__kvs_fence(chorus__kvs_t *k, int64_t deadline, char *err, size_t cap) {
  if (k->kind == KVS_USER) return CHORUS_OK; /* its get waits for the key */
#ifdef CHORUS_HAVE_PMIX
  if (k->kind == KVS_PMIX) {
    pmix_status_t rc = k->px.commit();
    if (rc != PMIX_SUCCESS) {
      snprintf(err, cap, "PMIx: PMIx_Commit failed (status %d)", (int)rc);
      return CHORUS_ERR_PROTOCOL;
    }
    pmix_info_t info[2];
    memset(info, 0, sizeof info);
    snprintf(info[0].key, sizeof info[0].key, "%s", PMIX_COLLECT_DATA);
    info[0].value.type = PMIX_BOOL;
    info[0].value.data.flag = true;
    int ms = chorus__ms_left(deadline);
    snprintf(info[1].key, sizeof info[1].key, "%s", PMIX_TIMEOUT);
    info[1].value.type = PMIX_INT;
    info[1].value.data.integer = ms / 1000 > 0 ? ms / 1000 : 1;
    pmix_proc_t all;
    memcpy(&all, &k->px.me, sizeof all);
    all.rank = PMIX_RANK_WILDCARD;
    rc = k->px.fence(&all, 1, info, 2);
    if (rc != PMIX_SUCCESS) {
      snprintf(err, cap, "PMIx: PMIx_Fence failed (status %d): did a rank die, or not all "
               "reach the bootstrap in time?", (int)rc);
      return rc == PMIX_ERR_TIMEOUT ? CHORUS_ERR_TIMEOUT : CHORUS_ERR_PROTOCOL;
    }
    return CHORUS_OK;
  }
#endif
  char reply[LINE_MAX_BYTES + 1];
  return pmi1_call(k, "cmd=barrier_in\n", "barrier_out", reply, deadline, err, cap);
}

chorus_result_t chorus__kvs_get(chorus__kvs_t *k, int from, const char *key, char *value,
                                size_t value_cap, int64_t deadline, char *err, size_t cap) {
  if (k->kind == KVS_USER) {
    /* One writer (rank 0), so the key needs no rank suffix.  The value is
     * the caller's service's bytes: bounded, NUL-free, printable. */
    char v[CHORUS__KVS_VALUE_MAX + 1], why[300] = "";
    size_t len = 0;
    int ms = chorus__ms_left(deadline);
    if (k->user.get(k->user.ctx, key, v, sizeof v - 1, &len, ms > 0 ? ms : 1, why, sizeof why)) {
      why[sizeof why - 1] = '\0';
      snprintf(err, cap, "waiting %d ms for rank %d's '%s' in the caller's key-value service "
               "failed: %s", ms, from, key, why[0] ? why : "(no reason given)");
      return CHORUS_ERR_STORE;
    }
    if (len > sizeof v - 1 || len >= value_cap) {
      snprintf(err, cap, "rank %d's '%s' is %zu bytes, more than the %d allowed", from, key, len,
               CHORUS__KVS_VALUE_MAX);
      return CHORUS_ERR_PROTOCOL;
    }
    v[len] = '\0';
    if (strlen(v) != len || !pmi1_token_ok(v, CHORUS__KVS_VALUE_MAX)) {
      snprintf(err, cap, "rank %d's '%s' is not printable text", from, key);
      return CHORUS_ERR_PROTOCOL;
    }
    memcpy(value, v, len + 1);
    return CHORUS_OK;
  }
#ifdef CHORUS_HAVE_PMIX
  if (k->kind == KVS_PMIX) {
    pmix_proc_t src;
    memcpy(&src, &k->px.me, sizeof src);
    src.rank = (pmix_rank_t)from;
    pmix_value_t *v = NULL;
    pmix_status_t rc = k->px.get(&src, key, NULL, 0, &v);
    if (rc != PMIX_SUCCESS || !v) {
      snprintf(err, cap, "PMIx: rank %d's '%s' not found (status %d)", from, key, (int)rc);
      return CHORUS_ERR_PROTOCOL;
    }
    chorus_result_t st = CHORUS_OK;
    if (v->type != PMIX_STRING || !v->data.string ||
        strlen(v->data.string) >= value_cap || strlen(v->data.string) > CHORUS__KVS_VALUE_MAX) {
      snprintf(err, cap, "PMIx: rank %d's '%s' is not a string of at most %d bytes", from, key,
               CHORUS__KVS_VALUE_MAX);
      st = CHORUS_ERR_PROTOCOL;
    } else {
      snprintf(value, value_cap, "%s", v->data.string);
    }
    k->px.value_destruct(v);
    free(v);
    return st;
  }
#endif
  char msg[LINE_MAX_BYTES], reply[LINE_MAX_BYTES + 1];
  snprintf(msg, sizeof msg, "cmd=get kvsname=%s key=%s-%d\n", k->kvsname, key, from);
  chorus_result_t st = pmi1_call(k, msg, "get_result", reply, deadline, err, cap);
  if (st != CHORUS_OK) return st;
  char v[CHORUS__KVS_VALUE_MAX + 1];
  if (pmi1_field(reply, "value", v, sizeof v) < 0 || strlen(v) >= value_cap) {
    snprintf(err, cap, "PMI: rank %d's '%s' is missing or longer than %d bytes", from, key,
             CHORUS__KVS_VALUE_MAX);
    return CHORUS_ERR_PROTOCOL;
  }
  snprintf(value, value_cap, "%s", v);
  return CHORUS_OK;
}

/* Appends a run of `len` ranks on one node to spec ("LxN" for N equal
 * runs in a row): 0, or -1 when spec is full. */
static int spec_run(char *spec, size_t cap, size_t *at, long *last, long *reps, long len) {
  if (len == *last) {
    (*reps)++;
    return 0;
  }
  if (*last > 0) {
    int n = *reps > 1 ? snprintf(spec + *at, cap - *at, "%s%ldx%ld", *at ? "," : "", *last, *reps)
                      : snprintf(spec + *at, cap - *at, "%s%ld", *at ? "," : "", *last);
    if (n < 0 || (size_t)n >= cap - *at) return -1;
    *at += (size_t)n;
  }
  *last = len, *reps = 1;
  return 0;
}

int chorus__pmi_mapping_sizes(const char *m, int size, char *spec, size_t cap) {
  enum { TRIPLES = 64 };
  long t[TRIPLES][3];
  int nt = 0;
  const char *p = m;
  if (size < 1 || cap < 2 || strncmp(p, "(vector,", 8) != 0) return -1;
  for (p += 8;;) { /* the triples: (first node, nodes, ranks per node) */
    char *end;
    if (*p != '(' || nt == TRIPLES) return -1;
    p++;
    for (int i = 0; i < 3; i++) {
      t[nt][i] = strtol(p, &end, 10);
      if (end == p || t[nt][i] < 0 || t[nt][i] > (1L << 24) || *end != (i < 2 ? ',' : ')'))
        return -1;
      p = end + 1;
    }
    if (t[nt][1] < 1 || t[nt][2] < 1) return -1;
    nt++;
    if (*p == ',') p++;
    else if (*p == ')' && p[1] == '\0') break;
    else return -1;
  }
  /* The pattern repeats until every rank has a node (hydra writes one
   * node of one rank as (0,1,1) for any count on it).  Runs of ranks on
   * one node, in rank order; a node met again after another is not a
   * block placement. */
  long node = -1, run = 0, last = 0, reps = 0, placed = 0, top = -1;
  size_t at = 0;
  spec[0] = '\0';
  while (placed < size) {
    for (int i = 0; i < nt && placed < size; i++)
      for (long n = t[i][0]; n < t[i][0] + t[i][1] && placed < size; n++) {
        long k = t[i][2] < size - placed ? t[i][2] : size - placed;
        if (n != node) {
          if (n <= top) return -1; /* met again, or out of order */
          if (run && spec_run(spec, cap, &at, &last, &reps, run) < 0) return -1;
          node = top = n, run = 0;
        }
        run += k;
        placed += k;
      }
  }
  if (spec_run(spec, cap, &at, &last, &reps, run) < 0 || spec_run(spec, cap, &at, &last, &reps, -1) < 0)
    return -1;
  return 0;
}

chorus_result_t chorus__kvs_node_sizes(chorus__kvs_t *k, int size, char *spec, size_t cap,
                                       int64_t deadline) {
  spec[0] = '\0';
  if (!k || k->kind != KVS_PMI1) return CHORUS_ERR_NOT_SUPPORTED;
  char msg[LINE_MAX_BYTES], reply[LINE_MAX_BYTES + 1], err[300];
  snprintf(msg, sizeof msg, "cmd=get kvsname=%s key=PMI_process_mapping\n", k->kvsname);
  chorus_result_t st = pmi1_call(k, msg, "get_result", reply, deadline, err, sizeof err);
  if (st != CHORUS_OK) return st;
  char v[CHORUS__KVS_VALUE_MAX + 1];
  if (pmi1_field(reply, "value", v, sizeof v) < 0 || chorus__pmi_mapping_sizes(v, size, spec, cap) < 0) {
    spec[0] = '\0';
    return CHORUS_ERR_PROTOCOL;
  }
  return CHORUS_OK;
}

void chorus__kvs_close(chorus__kvs_t *k, int64_t deadline) {
  if (!k) return;
  char err[256], reply[LINE_MAX_BYTES + 1];
#ifdef CHORUS_HAVE_PMIX
  if (k->kind == KVS_PMIX && k->px.lib) {
    k->px.finalize(NULL, 0);
    /* libpmix keeps threads and handlers; it stays loaded. */
  }
#endif
  if (k->kind == KVS_PMI1 && k->fd >= 0)
    (void)pmi1_call(k, "cmd=finalize\n", "finalize_ack", reply, deadline, err, sizeof err);
  free(k);
}
