/*
 * rdzv.c - chorusrun on several nodes: the rendezvous, heartbeats, lost
 * nodes, failure records and re-forming the group.
 *
 * Every node runs one agent.  The agents meet on a key-value service (kv_t:
 * chorus's store hosted by the agent at the endpoint for c10d, by node 0
 * for static), under keys "rdzv/<run id>/":
 *
 *   state     the rendezvous state: one text value, changed only by
 *             compare-and-set, so every change is atomic and all agents see
 *             the same sequence of states.  Lines (fields split by spaces):
 *               chorus-rdzv 1
 *               round R          0, 1, ...: one per group formed
 *               phase P          join, frozen or closed
 *               nnodes MIN MAX   as the first agent was started
 *               max_restarts K   likewise
 *               restarts N       rounds opened because something failed
 *               exit CODE        closed: what every agent exits with
 *               reason TEXT      why the round opened or the job closed
 *               prev ID GRANK    the last frozen round's nodes
 *               expect ID        nodes this round waits for: the last
 *                                round's survivors and the nodes that were
 *                                waiting; once all of them (and MIN) are
 *                                in, the round freezes without a last call
 *               member ID NPROC WANT   joined (frozen: in group-rank order);
 *                                WANT is the static --node-rank, else -1
 *               wait ID NPROC WANT     arrived after the freeze
 *   hb/ID     a node's heartbeat, "<counter> run" while it takes part, then
 *             "<counter> done <exit code>" once it has left
 *   fail/R    the first failure of round R anywhere in the job, written
 *             once (compare-and-set on an absent key): the root cause
 *
 * A round: agents add themselves to `member` until MAX are in (freeze at
 * once), or all expected nodes are (freeze at once), or MIN are and the
 * last call (last_call_timeout, timed by each agent from when it first saw
 * MIN) runs out; the agent that freezes assigns group ranks in the same
 * compare-and-set.  Ranks are stable: a node that was in the last round
 * keeps its group rank if it is still below the new node count; the others
 * fill the free ranks, last round's nodes first (in their old order), then
 * new ones in the order they joined.  A node that arrives after the freeze
 * goes to `wait`; group rank 0's agent then opens the next round if the
 * group has room (scale-up, not counted as a restart).
 *
 * While a group runs, every agent writes its heartbeat every `heartbeat`
 * seconds and reads the others'; a node whose counter has not moved for 4
 * heartbeats (and that has not left) is lost.  A failed worker or a lost
 * node makes the agent that sees it write fail/R, then open round R+1 with
 * restarts+1, or close the job when no restarts are left (or a node of the
 * round already finished: its workers cannot rejoin).  Every agent polls
 * the state every monitor interval; a new round stops its workers and it
 * joins again; a closed one stops them and it exits with the job's code
 * after printing the root cause.  A service that has not answered for 4
 * heartbeats is lost too: the agent stops its workers and exits.
 *
 * Received values are untrusted: the state is parsed line by line with
 * bounded fields and counts, node ids are checked character by character,
 * and a value that does not parse is reported, never used.
 */
#include "launcher/launcher.h"
#include "launcher/rdzv_state.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/log.h"
#include "util/net.h"
#include "util/util.h"

#define LOST_BEATS 4
#define JOIN_POLL_MS 10
#define STATE_MAX (4u << 20)

typedef struct {
  char id[ID_MAX];
  long counter;  /* the highest heartbeat counter read */
  long replayed; /* a lower counter read after that one (someone replays old values), or 0 */
  int64_t seen;  /* when the counter last grew */
  int done;      /* it has left */
  int exit_code; /* ... with this code */
  int gone;      /* --elastic inplace: reported lost, the group goes on */
} peer_t;

struct rdzv {
  kv_t *kv;
  chorus_store_server_t *srv; /* the rendezvous store, when this agent hosts it */
  chorus_store_server_t *round_srv; /* etcd: the workers' store of our round (group rank 0) */
  const chorus__key_t *key;   /* the job key (main's, outlives us) */
  char pfx[200];              /* "rdzv/<run id>/" */
  char id[ID_MAX];            /* this node: "<address>/<pid>" */
  char *raw;                  /* the state's text as last read */
  char store_host[128];       /* etcd: the workers' store of this round */
  rstate_t st, nx;            /* last read; the next one being built */
  long beats;
  int left;                   /* our heartbeat says done */
  int dead;                   /* the service was lost: no more calls */
  int64_t next_hb, next_mon, last_ok;
  int64_t lost_ns;     /* a node silent this long is lost */
  int64_t svc_lost_ns; /* the service unanswered this long is lost */
  peer_t peers[3 * MAX_NODES];
  int npeers;
  rnode_t group[MAX_NODES];   /* the frozen round this node runs in */
  int ngroup;
};

/* ------------------------------------------------------------- helpers */

static void key_of(const rdzv_t *rz, char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void key_of(const rdzv_t *rz, char *buf, size_t cap, const char *fmt, ...) {
  int n = snprintf(buf, cap, "%s", rz->pfx);
  va_list ap;
  va_start(ap, fmt);
  if (n >= 0 && (size_t)n < cap) vsnprintf(buf + n, cap - (size_t)n, fmt, ap);
  va_end(ap);
}


static void sleep_or_signal(job_t *job, int ms) {
  struct pollfd p = {.fd = g_selfpipe[0], .events = POLLIN};
  if (ms < 0) ms = 0;
  if (poll(&p, 1, ms) > 0) {
    int sig = drain_selfpipe();
    if (sig && !job->got_sig) job->got_sig = sig;
  }
}

static int ok(rdzv_t *rz, int rc) {
  if (rc >= 0) rz->last_ok = chorus__now_ns();
  return rc;
}

static int lost_store(const rdzv_t *rz) {
  return chorus__now_ns() - rz->last_ok > rz->svc_lost_ns;
}

/* ------------------------------------------------------ sealed values */

/* Every value we write ends with a line "mac <hex>": HMAC-SHA256 under the
 * job key of the key's name, a NUL and the text before that line.  etcd has
 * no notion of our job, so anyone who reaches it could write there; with
 * the seal a value that no agent of this job wrote is refused, never used
 * (our own store authenticates its clients as well, and the seal costs
 * nothing there). */
#define SEAL_HEX (2 * CHORUS__MAC_LEN)

static void seal_mac(const rdzv_t *rz, const char *key, const char *text, size_t len,
                     char hex[SEAL_HEX + 1]) {
  const void *parts[] = {key, "", text};
  size_t lens[] = {strlen(key), 1, len};
  uint8_t mac[CHORUS__MAC_LEN];
  chorus__hmac(rz->key, parts, lens, 3, mac);
  chorus__hex(hex, mac, CHORUS__MAC_LEN);
}

/* text + (a newline if it lacks one) + the seal line, malloc'd. */
static char *seal(const rdzv_t *rz, const char *key, const char *text) {
  char hex[SEAL_HEX + 1];
  size_t len = strlen(text);
  char *out = xmalloc(len + SEAL_HEX + 7);
  memcpy(out, text, len);
  if (!len || out[len - 1] != '\n') out[len++] = '\n';
  seal_mac(rz, key, out, len, hex);
  snprintf(out + len, SEAL_HEX + 6, "mac %s\n", hex);
  return out;
}

/* Checks val's seal and cuts it off (in place).  0, or -1. */
static int unseal(const rdzv_t *rz, const char *key, char *val) {
  size_t len = strlen(val);
  if (len < SEAL_HEX + 5 || val[len - 1] != '\n') return -1;
  char *line = val + len - (SEAL_HEX + 5);
  if (strncmp(line, "mac ", 4) || (line != val && line[-1] != '\n')) return -1;
  char hex[SEAL_HEX + 1];
  seal_mac(rz, key, val, (size_t)(line - val), hex);
  if (!chorus__ct_equal(hex, line + 4, SEAL_HEX)) return -1;
  *line = '\0';
  return 0;
}

/* get: 1 with *val (the text, malloc'd) and, if raw is not NULL, *raw (the
 * value as stored, malloc'd); 0 absent; -1 no answer; -2 not sealed by this
 * job (message in kv->err). */
static int kget(rdzv_t *rz, const char *key, char **val, char **raw) {
  char *v = NULL;
  *val = NULL;
  int rc = ok(rz, rz->kv->ops->get(rz->kv, key, &v));
  if (rc <= 0) return rc;
  char *copy = raw ? xstrdup(v) : NULL;
  if (unseal(rz, key, v) != 0) {
    snprintf(rz->kv->err, sizeof rz->kv->err,
             "%s at %s does not carry this job's seal: written by another job (same run id, "
             "another secret) or corrupted", key, rz->kv->where);
    free(v);
    free(copy);
    return -2;
  }
  *val = v;
  if (raw) *raw = copy;
  return 1;
}

static int kset(rdzv_t *rz, const char *key, const char *text) {
  char *v = seal(rz, key, text);
  int rc = ok(rz, rz->kv->ops->set(rz->kv, key, v));
  free(v);
  return rc;
}

/* cas with expected as stored (sealed) or NULL, desired as text. */
static int kcas(rdzv_t *rz, const char *key, const char *expected_raw, const char *text) {
  char *v = seal(rz, key, text);
  int rc = ok(rz, rz->kv->ops->cas(rz->kv, key, expected_raw, v));
  free(v);
  return rc;
}

/* --------------------------------------------------------------- state */

/* Reads the state: 1 (rz->raw, rz->st), 0 when there is none yet, -1 when
 * the service did not answer, -2 when the value does not parse (message in
 * kv->err). */
static int read_state(rdzv_t *rz) {
  char key[300], *val = NULL, *raw = NULL;
  key_of(rz, key, sizeof key, "state");
  int rc = kget(rz, key, &val, &raw);
  if (rc <= 0 || rc == -2) return rc;
  char why[200];
  if (strlen(val) > STATE_MAX || rdzv_state_parse(val, &rz->st, why, sizeof why) != 0) {
    snprintf(rz->kv->err, sizeof rz->kv->err, "the rendezvous state at %s is corrupt: %s",
             key, strlen(val) > STATE_MAX ? "too long" : why);
    free(val);
    free(raw);
    return -2;
  }
  free(val);
  free(rz->raw);
  rz->raw = raw;
  return 1;
}

/* Replaces the state last read by rz->nx: 1 done, 0 someone changed it
 * first, -1 no answer. */
static int write_state(rdzv_t *rz) {
  char key[300];
  key_of(rz, key, sizeof key, "state");
  char *text = rdzv_state_format(&rz->nx);
  int rc = kcas(rz, key, rz->raw, text);
  free(text);
  return rc;
}

/* ----------------------------------------------------------- heartbeats */

static int beat(rdzv_t *rz, int done, int code) {
  char key[300], val[64];
  key_of(rz, key, sizeof key, "hb/%s", rz->id);
  if (done) snprintf(val, sizeof val, "%ld done %d", ++rz->beats, code);
  else snprintf(val, sizeof val, "%ld run", ++rz->beats);
  if (done) rz->left = 1;
  return kset(rz, key, val);
}

static peer_t *peer(rdzv_t *rz, const char *id) {
  for (int i = 0; i < rz->npeers; i++)
    if (!strcmp(rz->peers[i].id, id)) return &rz->peers[i];
  if (rz->npeers == (int)CHORUS__ARRAY_LEN(rz->peers)) rz->npeers = 0; /* forget old ones */
  peer_t *p = &rz->peers[rz->npeers++];
  memset(p, 0, sizeof *p);
  snprintf(p->id, sizeof p->id, "%s", id);
  p->seen = chorus__now_ns();
  return p;
}

/* Reads id's heartbeat.  Returns the peer, NULL when the service did not
 * answer. */
static peer_t *observe(rdzv_t *rz, const char *id) {
  peer_t *p = peer(rz, id);
  char key[300], *val = NULL;
  key_of(rz, key, sizeof key, "hb/%s", id);
  int rc = kget(rz, key, &val, NULL);
  if (rc == -1) return NULL;
  long counter = 0, code = 0;
  char word[8] = "";
  int n = rc == 1 ? sscanf(val, "%ld %7s %ld", &counter, word, &code) : 0;
  /* A heartbeat counts only when its counter grew.  Values carry the
   * job's seal, so nobody without the job key can write a new one; someone
   * who can write to the service could still put back an old one (its
   * seal is as good as ever), which without this check would look like a
   * beat -- alternating two old values would keep a dead node alive. */
  if (n >= 2 && counter > p->counter) {
    p->counter = counter;
    p->seen = chorus__now_ns();
    p->done = !strcmp(word, "done");
    if (p->done) p->exit_code = code >= 0 && code <= 255 ? (int)code : EXIT_LAUNCHER;
  } else if (n >= 2 && counter < p->counter && !p->replayed) {
    p->replayed = counter;
    CHORUS_WARN(CHORUS__SUB_LAUNCH,
                "the heartbeat of node %s went back from %ld to %ld: someone who can write to "
                "%s replays old values; ignored",
                id, p->counter, counter, rz->kv->where);
  }
  free(val);
  return p;
}

static int peer_lost(const rdzv_t *rz, const peer_t *p) {
  return !p->done && chorus__now_ns() - p->seen > rz->lost_ns;
}

/* ------------------------------------------------------ failure records */

/* Writes the round's failure record unless one exists; *rec gets the
 * record that stands (ours or the earlier one).  0 or -1. */
static int record_failure(rdzv_t *rz, long round, const fail_t *mine, fail_t *rec) {
  char key[300];
  key_of(rz, key, sizeof key, "fail/%ld", round);
  char *text = rdzv_fail_format(mine);
  int rc = kcas(rz, key, NULL, text);
  free(text);
  if (rc == 1) {
    *rec = *mine;
    return 0;
  }
  char *val = NULL;
  if (rc < 0 || kget(rz, key, &val, NULL) != 1) return -1;
  int prc = rdzv_fail_parse(val, rec);
  free(val);
  if (prc != 0) *rec = *mine;
  return 0;
}

/* ------------------------------------------------------------- rounds */

static void set_reason(rstate_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_reason(rstate_t *s, const char *fmt, ...) {
  char buf[REASON_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  rdzv_one_line(s->reason, sizeof s->reason, buf);
}

/* Builds in rz->nx the round after rz->st: the frozen round's nodes become
 * `prev`, its survivors (not lost, not done) and the waiting nodes are
 * expected. */
static void next_round(rdzv_t *rz, int failure, const char *lost) {
  const rstate_t *s = &rz->st;
  rstate_t *n = &rz->nx;
  *n = *s;
  n->round = s->round + 1;
  n->phase = PH_JOIN;
  n->restarts = s->restarts + (failure ? 1 : 0);
  n->nprev = n->nexp = n->nmem = n->nwait = 0;
  for (int i = 0; i < s->nmem; i++) {
    n->prev[n->nprev] = s->mem[i];
    n->prev[n->nprev++].want = i;
    peer_t *p = peer(rz, s->mem[i].id);
    if ((lost && !strcmp(lost, s->mem[i].id)) || p->done || peer_lost(rz, p)) continue;
    n->exp[n->nexp++] = s->mem[i];
  }
  for (int i = 0; i < s->nwait && n->nexp < MAX_NODES; i++) n->exp[n->nexp++] = s->wait[i];
}

/* Opens the round after our frozen one, or closes the job when a failure
 * finds no restarts left or a node of the round already finished.  The
 * reason goes into the state.  Stops when someone else moved the state on
 * first. */
static void advance(job_t *job, int failure, const char *lost, int exit_code, const char *reason) {
  rdzv_t *rz = job->rz;
  for (int tries = 0; tries < 100; tries++) {
    if (read_state(rz) != 1) return;
    if (rz->st.round != job->round || rz->st.phase != PH_FROZEN) return;
    const char *finished = NULL;
    if (failure)
      for (int i = 0; i < rz->st.nmem && !finished; i++) {
        peer_t *p = strcmp(rz->st.mem[i].id, rz->id) ? observe(rz, rz->st.mem[i].id) : NULL;
        if (p && p->done && p->exit_code == 0) finished = p->id;
      }
    if (failure && (rz->st.restarts >= rz->st.max_restarts || finished)) {
      rz->nx = rz->st;
      rz->nx.phase = PH_CLOSED;
      rz->nx.exit_code = exit_code;
      if (finished)
        set_reason(&rz->nx, "%s; node %s had already finished, so the group cannot re-form",
                   reason, finished);
      else
        set_reason(&rz->nx, "%s; no restarts left (--max-restarts %d)", reason,
                   rz->st.max_restarts);
    } else {
      next_round(rz, failure, lost);
      set_reason(&rz->nx, "%s", reason);
    }
    if (write_state(rz) != 0) return;
  }
}

/* Our group's placement from the frozen state. */
static void take_placement(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  int me = rdzv_find(s->mem, s->nmem, rz->id);
  job->round = s->round;
  job->restarts = s->restarts;
  job->nnodes = s->nmem;
  job->node_rank = me;
  job->rank_base = 0;
  job->world_size = 0;
  for (int i = 0; i < s->nmem; i++) {
    if (i < me) job->rank_base += s->mem[i].nproc;
    job->world_size += s->mem[i].nproc;
  }
  rz->ngroup = s->nmem;
  memcpy(rz->group, s->mem, sizeof s->mem[0] * (size_t)s->nmem);
  int64_t now = chorus__now_ns();
  for (int i = 0; i < s->nmem; i++) {
    peer_t *p = peer(rz, s->mem[i].id);
    p->seen = now; /* a long rendezvous is not silence */
  }
  for (int r = 0; r < job->nproc; r++) job->w[r].rank = job->rank_base + r;
}

/* Freezes the round in rz->st: orders the members by group rank. */
static int freeze(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  rstate_t *n = &rz->nx;
  *n = *s;
  n->phase = PH_FROZEN;
  int count = s->nmem;
  int slot[MAX_NODES], used[MAX_NODES];
  for (int i = 0; i < count; i++) slot[i] = -1, used[i] = 0;
  if (job->backend == BACKEND_STATIC) {
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
  return write_state(rz);
}

/* ------------------------------------------------------------- opening */

/* How long the endpoint may answer wrongly before an agent gives up. */
#define WRONG_ANSWER_MS 5000

/* 1 when nothing listens on host:port here (host "" : every interface). */
static int port_free(const char *host, int port) {
  int fd = chorus__net_listen(host[0] ? host : NULL, port, 1, NULL);
  if (fd < 0) return 0;
  close(fd);
  return 1;
}

/* The endpoint kept answering, but not as this job's store: the message,
 * naming the port's owner when it is on this machine.  Returns the exit
 * code. */
static int wrong_endpoint(const char *host, int port, int rc, const char *err) {
  char owner[200] = "";
  int local = chorus__net_is_local(host);
  int held = local ? chorus__net_port_owner(port, owner, sizeof owner) : 0;
  char who[260];
  if (held > 0)
    snprintf(who, sizeof who, "port %d on this machine is held by %s", port, owner);
  else if (local)
    snprintf(who, sizeof who, "no listener on port %d is visible here any more", port);
  else
    snprintf(who, sizeof who, "look on %s for what listens on port %d", host, port);
  if (rc == -2)
    fprintf(stderr,
            "chorusrun: the rendezvous store at %s:%d refused this node for %.0f s: %s.  Every "
            "node of a job needs the same CHORUS_JOB_SECRET (or CHORUS_JOB_SECRET_FILE "
            "contents) and --rdzv-id; another job may be using this endpoint (%s).\n",
            host, port, WRONG_ANSWER_MS / 1e3, err, who);
  else
    fprintf(stderr,
            "chorusrun: the rendezvous endpoint %s:%d accepts connections but is not a chorus "
            "store (%.0f s of wrong answers: %s): %s.  Stop it, or give every node another "
            "--rdzv-endpoint port.\n",
            host, port, WRONG_ANSWER_MS / 1e3, err, who);
  return EXIT_LAUNCHER;
}

int rdzv_open(job_t *job, const chorus__key_t *key) {
  rdzv_t *rz = calloc(1, sizeof *rz);
  if (!rz) {
    fprintf(stderr, "chorusrun: out of memory\n");
    return EXIT_LAUNCHER;
  }
  job->rz = rz;
  job->round = -1;
  snprintf(rz->pfx, sizeof rz->pfx, "rdzv/%s/", job->run_id);
  rz->lost_ns = LOST_BEATS * job->heartbeat_ns;
  /* Our store is one process: no answer for 4 heartbeats means it is gone.
   * etcd elects a new leader when one dies (a second or two without
   * answers), so give it longer before giving up on it. */
  rz->svc_lost_ns = job->backend == BACKEND_ETCD ? CHORUS__MAX(rz->lost_ns, 10000000000LL)
                                                 : rz->lost_ns;
  rz->key = key;
  const char *host = job->rdzv_host;
  int port = job->rdzv_port;
  int call_ms = (int)CHORUS__MAX(rz->lost_ns / 1000000, 200);
  char err[700] = "";
  int etcd = job->backend == BACKEND_ETCD;

  /* Who hosts the store: static node 0; for c10d the agent on the node the
   * endpoint names (if two agents share that machine, the second finds the
   * port taken and joins as a client).  With etcd nobody: etcd keeps the
   * rendezvous, and once a round is frozen group rank 0 serves that round's
   * workers a store (round_store). */
  int want_host = etcd ? 0
                  : job->backend == BACKEND_STATIC ? job->node_rank_opt == 0
                                                   : chorus__net_is_local(host);
  /* The store listens where the other nodes reach it, no wider: on the
   * endpoint's address (loopback when it names loopback; every interface
   * only when it is 0.0.0.0 or a name that resolves elsewhere too). */
  char bind_host[64] = "";
  if (want_host) {
    chorus__net_bind_addr(host, bind_host, sizeof bind_host);
    chorus_result_t src = start_store(bind_host[0] ? bind_host : NULL, port, key, &rz->srv);
    if (src != CHORUS_OK) {
      if (job->backend == BACKEND_STATIC) {
        char owner[200];
        int held = chorus__net_port_owner(port, owner, sizeof owner);
        fprintf(stderr,
                "chorusrun: node 0 cannot start the store on %s:%d: %s; %s%s (another job, or a "
                "leftover chorusrun; try another --master-port)\n",
                bind_host[0] ? bind_host : "*", port, chorus_strerror(src),
                held > 0 ? "the port is held by " : "is the port in use?", held > 0 ? owner : "");
        return EXIT_LAUNCHER;
      }
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "port %d taken on this machine; joining as a client", port);
      rz->srv = NULL;
    } else {
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "hosting the rendezvous store on %s:%d",
                  bind_host[0] ? bind_host : "*", port);
    }
  }

  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  /* Something that accepts connections on the endpoint but does not answer
   * as this job's store (a squatter on the port: garbage, silence, closing
   * at once, or a store that refuses our key) is not worth the join
   * timeout: after WRONG_ANSWER_MS of nothing but such answers, give up
   * and say who holds the port.  The grace lets a previous job's store on
   * the same port finish shutting down; a refused connection (the store
   * is not up yet) starts it over. */
  int64_t wrong_since = 0;
  int wrong_tries = 0;
  for (;;) {
    int attempt = CHORUS__MIN(CHORUS__MAX(chorus__ms_left(deadline), 1), etcd ? 2000 : 1000);
    int rc = etcd ? kv_etcd_open(host, "/chorus/", attempt, call_ms, &job->etcd, &rz->kv, err,
                                 sizeof err)
                  : kv_store_open(host, port, key, attempt, call_ms, &rz->kv, err, sizeof err);
    if (rc == 0) break;
    if (rc == -2 && etcd) {
      fprintf(stderr, "chorusrun: %s\n", err);
      return EXIT_LAUNCHER;
    }
    if (rc == -2 || rc == -3) {
      if (!wrong_since) wrong_since = chorus__now_ns();
      wrong_tries++;
      if (chorus__now_ns() - wrong_since >= (int64_t)WRONG_ANSWER_MS * 1000000 &&
          wrong_tries >= 3)
        return wrong_endpoint(host, port, rc, err);
    } else {
      wrong_since = 0;
      wrong_tries = 0;
    }
    /* We were to host the store and the port was taken: whoever held it
     * may have left (a previous job's store shut down, a squatter gave
     * up); then we host after all, or nobody would. */
    if (want_host && !rz->srv && port_free(bind_host, port) &&
        start_store(bind_host[0] ? bind_host : NULL, port, key, &rz->srv) == CHORUS_OK) {
      CHORUS_INFO(CHORUS__SUB_LAUNCH, "port %d free again: hosting the rendezvous store", port);
      wrong_since = 0;
      wrong_tries = 0;
      continue;
    }
    /* A refused etcd fails at once; our store's client retries within its
     * attempt; a wrong answer may come at once too. */
    sleep_or_signal(job, etcd ? 100 : rc < -1 ? 500 : 0);
    if (job->got_sig) return 128 + job->got_sig;
    if (chorus__ms_left(deadline) == 0) {
      if (etcd)
        fprintf(stderr, "chorusrun: no etcd at %s after %.0f s (join_timeout): %s\n", host,
                job->join_timeout_ns / 1e9, err);
      else
        fprintf(stderr,
                "chorusrun: no rendezvous store at %s:%d after %.0f s (join_timeout): %s.  The "
                "endpoint must name one of the job's nodes (its agent hosts the store%s), "
                "reachable from this one.\n",
                host, port, job->join_timeout_ns / 1e9, err,
                job->backend == BACKEND_STATIC ? ": node 0" : "");
      return EXIT_LAUNCHER;
    }
  }
  rz->last_ok = chorus__now_ns();
  char addr[64] = "node"; /* numeric: an IPv6 address takes 45 at most */
  if (rz->kv->ops->local_addr(rz->kv, addr, sizeof addr) != 0) snprintf(addr, sizeof addr, "node");
  snprintf(rz->id, sizeof rz->id, "%s/%d", addr, (int)getpid());
  if (!rdzv_id_ok(rz->id, ID_MAX)) snprintf(rz->id, sizeof rz->id, "node/%d", (int)getpid());
  job->master_addr = host;
  job->port = port;
  CHORUS_INFO(CHORUS__SUB_LAUNCH, "node %s: rendezvous %s at %s (run %s)", rz->id,
              job->backend == BACKEND_STATIC ? "static"
              : job->backend == BACKEND_ETCD ? "etcd"
                                             : "c10d",
              rz->kv->where, job->run_id);
  return 0;
}

/* ------------------------------------------------------- the round's store */

/* etcd: the workers need a chorus store of their own.  Group rank 0's agent
 * starts one for the round (any free port) and publishes "<address> <port>"
 * under store/<round>; the others read it.  It lives until that agent
 * leaves or joins the next round.  0, or an exit code after a message. */
static int round_store(job_t *job) {
  rdzv_t *rz = job->rz;
  char key[300];
  key_of(rz, key, sizeof key, "store/%ld", job->round);
  if (job->node_rank == 0) {
    char addr[128], val[200];
    if (rz->kv->ops->local_addr(rz->kv, addr, sizeof addr) != 0) {
      fprintf(stderr, "chorusrun: cannot tell this node's address for the workers' store\n");
      return EXIT_LAUNCHER;
    }
    /* On the address published, the one this node reaches etcd from. */
    chorus_result_t src = start_store(addr, 0, rz->key, &rz->round_srv);
    if (src != CHORUS_OK) {
      fprintf(stderr, "chorusrun: cannot start the workers' store: %s\n", chorus_strerror(src));
      return EXIT_LAUNCHER;
    }
    snprintf(val, sizeof val, "%s %d", addr, chorus_store_server_port(rz->round_srv));
    if (kset(rz, key, val) < 0) {
      fprintf(stderr, "chorusrun: cannot publish the workers' store: %s\n", rz->kv->err);
      return EXIT_LAUNCHER;
    }
  }
  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  for (;;) {
    char *val = NULL;
    int rc = kget(rz, key, &val, NULL);
    if (rc == 1) {
      char host[128];
      int port = 0;
      int good = sscanf(val, "%127s %d", host, &port) == 2 && port > 0 && port < 65536 &&
                 rdzv_id_ok(host, sizeof host);
      free(val);
      if (!good) {
        fprintf(stderr, "chorusrun: the workers' store address under %s is malformed\n", key);
        return EXIT_LAUNCHER;
      }
      snprintf(rz->store_host, sizeof rz->store_host, "%s", host);
      job->master_addr = rz->store_host;
      job->port = port;
      return 0;
    }
    if (rc == -2 || (rc < 0 && lost_store(rz)) || chorus__now_ns() >= deadline) {
      fprintf(stderr, "chorusrun: node 0 of round %ld never published the workers' store (%s)\n",
              job->round, rc < 0 ? rz->kv->err : "join_timeout");
      return EXIT_LAUNCHER;
    }
    if (job->got_sig) return 128 + job->got_sig;
    sleep_or_signal(job, JOIN_POLL_MS);
  }
}

static void round_store_stop(rdzv_t *rz) {
  if (rz->round_srv) chorus_store_server_stop(rz->round_srv);
  rz->round_srv = NULL;
}

/* ------------------------------------------------------------- joining */

/* Adds this node to the state's member list (or, after the freeze, its wait
 * list); the caller checked there is room.  A lost race is retried by the
 * caller's loop. */
static void add_self(job_t *job, int waiting) {
  rdzv_t *rz = job->rz;
  rz->nx = rz->st;
  rnode_t *list = waiting ? rz->nx.wait : rz->nx.mem;
  int *n = waiting ? &rz->nx.nwait : &rz->nx.nmem;
  rnode_t *me = &list[(*n)++];
  *me = (rnode_t){.nproc = job->nproc, .want = job->node_rank_opt};
  snprintf(me->id, sizeof me->id, "%s", rz->id);
  write_state(rz);
}

static void say_state_error(const rdzv_t *rz, int rc) {
  if (rc == -2) fprintf(stderr, "chorusrun: %s\n", rz->kv->err);
}

int rdzv_join(job_t *job) {
  rdzv_t *rz = job->rz;
  int64_t deadline = chorus__now_ns() + job->join_timeout_ns;
  int64_t last_call = CHORUS__NO_DEADLINE;
  int said_waiting = 0;
  long waited_in = -1; /* the frozen round this node waits to enter */
  rz->left = 0;
  job->joining = 0;
  round_store_stop(rz); /* the last round's workers are gone */
  for (;;) {
    if (job->got_sig) {
      rdzv_interrupt(job, job->got_sig);
      return 128 + job->got_sig;
    }
    int64_t now = chorus__now_ns();
    if (now >= rz->next_hb) {
      beat(rz, 0, 0);
      rz->next_hb = now + job->heartbeat_ns;
    }
    int rc = read_state(rz);
    if (rc == -2) {
      say_state_error(rz, rc);
      return EXIT_LAUNCHER;
    }
    if (rc < 0) {
      if (lost_store(rz)) {
        fprintf(stderr,
                "chorusrun: the rendezvous store at %s stopped answering during the "
                "rendezvous (%s); the node hosting it may be down\n",
                rz->kv->where, rz->kv->err);
        return EXIT_LAUNCHER;
      }
      sleep_or_signal(job, JOIN_POLL_MS);
      continue;
    }
    rstate_t *s = &rz->st;
    if (rc == 0) {
      /* The first agent creates round 0. */
      rstate_t *n = &rz->nx;
      memset(n, 0, offsetof(rstate_t, prev));
      n->nprev = n->nexp = n->nmem = n->nwait = 0;
      n->phase = PH_JOIN;
      n->min = job->min_nodes;
      n->max = job->max_nodes;
      n->max_restarts = job->max_restarts;
      set_reason(n, "first round");
      free(rz->raw);
      rz->raw = NULL;
      write_state(rz);
      continue;
    }
    if (s->min != job->min_nodes || s->max != job->max_nodes) {
      fprintf(stderr,
              "chorusrun: this node was started with --nnodes %d:%d, but run '%s' was started "
              "with --nnodes %d:%d by the first node that joined; give every node the same "
              "--nnodes (or use another --rdzv-id)\n",
              job->min_nodes, job->max_nodes, job->run_id, s->min, s->max);
      return EXIT_USAGE;
    }
    int me = rdzv_find(s->mem, s->nmem, rz->id);
    if (s->phase == PH_CLOSED) {
      fprintf(stderr, "chorusrun: run '%s' is over (%s); start a new job with another --rdzv-id\n",
              job->run_id, s->reason[0] ? s->reason : "closed");
      return s->exit_code ? s->exit_code : EXIT_LAUNCHER;
    }
    if (s->phase == PH_FROZEN) {
      if (me >= 0 && s->round > job->round) {
        /* In place, group rank 0 admits waiting nodes into the running
         * round: their workers join the running job. */
        job->joining = job->inplace && s->round == waited_in;
        take_placement(job);
        CHORUS_INFO(CHORUS__SUB_LAUNCH, "round %ld frozen: node %d of %d, ranks %d..%d of %d",
                    s->round, job->node_rank, job->nnodes, job->rank_base,
                    job->rank_base + job->nproc - 1, job->world_size);
        return job->backend == BACKEND_ETCD ? round_store(job) : 0;
      }
      if (me >= 0) {
        /* The round we ran is still the current one (our move to the next
         * one did not reach the store): move it now. */
        advance(job, 0, NULL, 0, "a node rejoins");
        continue;
      }
      if (rdzv_find(s->wait, s->nwait, rz->id) < 0 && s->nwait < MAX_NODES) {
        add_self(job, 1);
        waited_in = s->round;
        continue;
      }
      if (!said_waiting) {
        fprintf(stderr,
                "chorusrun: run '%s' is running with %d node(s) (at most %d); waiting to be "
                "admitted %s\n", job->run_id, s->nmem, s->max,
                job->inplace ? "into it (--elastic inplace)" : "when the group re-forms");
        said_waiting = 1;
      }
    } else if (me < 0) {
      if (job->backend == BACKEND_STATIC) {
        for (int i = 0; i < s->nmem; i++)
          if (s->mem[i].want == job->node_rank_opt) {
            fprintf(stderr,
                    "chorusrun: --node-rank %d is taken by node %s in run '%s'; give each node "
                    "its own --node-rank in 0..%d\n",
                    job->node_rank_opt, s->mem[i].id, job->run_id, job->max_nodes - 1);
            return EXIT_USAGE;
          }
      }
      if (s->nmem < s->max) {
        add_self(job, 0);
        continue;
      }
    } else {
      if (s->nmem >= s->max || (s->nmem >= s->min && rdzv_all_expected_in(s))) {
        freeze(job);
        continue;
      }
      if (s->nmem >= s->min && job->backend != BACKEND_STATIC) {
        if (last_call == CHORUS__NO_DEADLINE) last_call = now + job->last_call_ns;
        else if (now >= last_call) {
          freeze(job);
          continue;
        }
      }
    }
    if (now >= deadline) {
      fprintf(stderr,
              "chorusrun: the rendezvous of run '%s' timed out after %.0f s (join_timeout): "
              "%d node(s) joined round %ld, %d needed%s\n",
              job->run_id, job->join_timeout_ns / 1e9, s->nmem, s->round, s->min,
              s->phase == PH_FROZEN ? " (this node was waiting for room in the running group)"
                                    : "");
      beat(rz, 1, EXIT_LAUNCHER);
      return EXIT_LAUNCHER;
    }
    sleep_or_signal(job, JOIN_POLL_MS);
  }
}

/* ------------------------------------------------------------- running */

int rdzv_poll_ms(const job_t *job) {
  const rdzv_t *rz = job->rz;
  int64_t next = CHORUS__MIN(rz->next_hb, rz->next_mon);
  return chorus__ms_left(next);
}

/* The failure record of a lost node. */
static void lost_node(job_t *job, const peer_t *p) {
  rdzv_t *rz = job->rz;
  fail_t f = {0}, rec;
  int g = rdzv_find(rz->group, rz->ngroup, p->id);
  snprintf(f.kind, sizeof f.kind, "lost");
  f.code = EXIT_LAUNCHER;
  f.grank = g;
  f.rank = -1;
  snprintf(f.node, sizeof f.node, "%s", p->id);
  snprintf(f.what, sizeof f.what, "node %d (%s) was lost: no heartbeat for %.1f s%s", g, p->id,
           (chorus__now_ns() - p->seen) / 1e9,
           p->replayed ? " (old heartbeats of it were replayed meanwhile, and ignored)" : "");
  fprintf(stderr, "chorusrun: %s\n", f.what);
  if (record_failure(rz, job->round, &f, &rec) != 0) rec = f;
  advance(job, 1, p->id, rec.code, rec.what);
}

/* --elastic inplace: nodes that wait are admitted into the running round
 * by the first member still there in this agent's view (group rank 0 unless
 * it was lost or left; two agents that both think so race on the state's
 * compare-and-set, and one wins): they take the next group ranks, their
 * workers join the running job (chorus_comm_join) and the running workers
 * take them in (chorus_comm_grow).  Every agent watches the grown group's
 * heartbeats. */
static void admit_in_place(job_t *job) {
  rdzv_t *rz = job->rz;
  const rstate_t *s = &rz->st;
  int first = -1;
  for (int i = 0; i < rz->ngroup && first < 0; i++) {
    if (!strcmp(rz->group[i].id, rz->id)) first = i;
    const peer_t *p = NULL;
    for (int k = 0; k < rz->npeers && !p; k++)
      if (!strcmp(rz->peers[k].id, rz->group[i].id)) p = &rz->peers[k];
    if (first < 0 && p && !p->gone && !p->done) first = i;
  }
  int admitter = first >= 0 && !strcmp(rz->group[first].id, rz->id);
  if (admitter && s->nwait > 0 && s->nmem < s->max) {
    rz->nx = *s;
    int k = 0;
    while (k < s->nwait && rz->nx.nmem < s->max) rz->nx.mem[rz->nx.nmem++] = s->wait[k++];
    memmove(rz->nx.wait, s->wait + k, sizeof s->wait[0] * (size_t)(s->nwait - k));
    rz->nx.nwait = s->nwait - k;
    set_reason(&rz->nx, "%d node(s) admitted into the running round (--elastic inplace)", k);
    if (write_state(rz) == 1)
      fprintf(stderr, "chorusrun: %d node(s) admitted into the running job (--elastic "
              "inplace)\n", k);
    return; /* the others see it at their next read */
  }
  if (s->nmem > rz->ngroup) {
    int64_t now = chorus__now_ns();
    for (int i = rz->ngroup; i < s->nmem; i++) peer(rz, s->mem[i].id)->seen = now;
    rz->ngroup = s->nmem;
    memcpy(rz->group, s->mem, sizeof s->mem[0] * (size_t)s->nmem);
  }
}

rdzv_event_t rdzv_poll(job_t *job) {
  rdzv_t *rz = job->rz;
  if (rz->dead) return RDZV_EV_NONE;
  int64_t now = chorus__now_ns();
  /* One unanswered call ends this poll: each may take a call timeout, and
   * the loop has workers to watch. */
  if (now >= rz->next_hb) {
    rz->next_hb = now + job->heartbeat_ns;
    int64_t blind = now - rz->last_ok; /* since we last heard the service */
    if (!rz->left && beat(rz, 0, 0) < 0) goto check;
    if (blind > 2 * job->heartbeat_ns) {
      /* We could not see the others' heartbeats for a while (etcd electing
       * a leader, say): that silence was ours, not theirs. */
      for (int i = 0; i < rz->ngroup; i++) peer(rz, rz->group[i].id)->seen = now;
    }
    for (int i = 0; i < rz->ngroup; i++) {
      if (!strcmp(rz->group[i].id, rz->id)) continue;
      peer_t *p = observe(rz, rz->group[i].id);
      if (!p) goto check;
      if (peer_lost(rz, p) && job->inplace) {
        /* Its workers' peers shrink their communicators and go on. */
        if (!p->gone)
          fprintf(stderr, "chorusrun: node %d (%s) was lost: no heartbeat for %.1f s; the "
                  "workers of the other nodes go on without it (--elastic inplace)\n",
                  rdzv_find(rz->group, rz->ngroup, p->id), p->id, (now - p->seen) / 1e9);
        p->gone = 1;
      } else if (peer_lost(rz, p)) {
        lost_node(job, p);
        return RDZV_EV_NEW_ROUND;
      }
    }
  }
  if (now >= rz->next_mon) {
    rz->next_mon = now + job->monitor_ns;
    int rc = read_state(rz);
    if (rc == 1) {
      const rstate_t *s = &rz->st;
      if (s->phase == PH_CLOSED) return RDZV_EV_CLOSED;
      if (s->round != job->round) return RDZV_EV_NEW_ROUND;
      if (job->inplace && s->phase == PH_FROZEN) admit_in_place(job);
      if (s->phase == PH_FROZEN && s->nwait > 0 && s->nmem < s->max && job->node_rank == 0 &&
          !job->inplace) {
        char why[REASON_MAX];
        snprintf(why, sizeof why, "%d node(s) waiting to join (scale-up)", s->nwait);
        advance(job, 0, NULL, 0, why);
        return RDZV_EV_NEW_ROUND;
      }
    } else if (rc == -2) {
      say_state_error(rz, rc);
      rz->dead = 1;
      return RDZV_EV_STORE_LOST;
    }
  }
check:
  if (lost_store(rz)) {
    rz->dead = 1;
    return RDZV_EV_STORE_LOST;
  }
  return RDZV_EV_NONE;
}

void rdzv_failed(job_t *job, const worker_t *w, const char *why) {
  rdzv_t *rz = job->rz;
  fail_t f = {0}, rec;
  f.grank = job->node_rank;
  snprintf(f.node, sizeof f.node, "%s", rz->id);
  if (w) {
    int st = w->status;
    f.rank = w->rank;
    if (WIFSIGNALED(st)) {
      snprintf(f.kind, sizeof f.kind, "signal");
      f.code = 128 + WTERMSIG(st);
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) was killed by %s", w->rank,
               job->node_rank, rz->id, (int)w->pid, signal_name(WTERMSIG(st)));
    } else {
      snprintf(f.kind, sizeof f.kind, "exit");
      f.code = WIFEXITED(st) ? WEXITSTATUS(st) : EXIT_LAUNCHER;
      snprintf(f.what, sizeof f.what, "rank %d (node %d, %s, pid %d) exited with code %d",
               w->rank, job->node_rank, rz->id, (int)w->pid, f.code);
    }
    /* Its last lines, oldest first. */
    for (int i = 0; i < w->tail_count; i++)
      if (tail_line(w, i)) rdzv_one_line(f.tail[f.ntail++], TAIL_LINE_MAX, tail_line(w, i));
  } else {
    snprintf(f.kind, sizeof f.kind, "error");
    f.code = EXIT_LAUNCHER;
    f.rank = -1;
    snprintf(f.what, sizeof f.what, "node %d (%s): %s", job->node_rank, rz->id, why);
  }
  if (record_failure(rz, job->round, &f, &rec) != 0) rec = f;
  advance(job, 1, NULL, rec.code, rec.what);
}

int rdzv_after_failure(job_t *job, rdzv_event_t ev) {
  rdzv_t *rz = job->rz;
  if (ev == RDZV_EV_STORE_LOST) {
    fprintf(stderr,
            "chorusrun: lost the rendezvous store at %s (no answer for %.1f s: %s); the node "
            "hosting it (the --rdzv-endpoint node) died or is unreachable, and the job cannot "
            "go on without it\n",
            rz->kv->where, (chorus__now_ns() - rz->last_ok) / 1e9, rz->kv->err);
    return EXIT_LAUNCHER;
  }
  /* The state as it is now (the move to the next round may still be on its
   * way from the node that saw the failure). */
  int64_t until = chorus__now_ns() + rz->lost_ns;
  int rc;
  while ((rc = read_state(rz)) == 1 && rz->st.round == job->round &&
         rz->st.phase == PH_FROZEN && chorus__now_ns() < until)
    sleep_or_signal(job, JOIN_POLL_MS);
  if (rc != 1) {
    fprintf(stderr, "chorusrun: lost the rendezvous store at %s: %s\n", rz->kv->where,
            rc == -2 ? rz->kv->err : "no answer");
    return EXIT_LAUNCHER;
  }
  char key[300], *val = NULL;
  key_of(rz, key, sizeof key, "fail/%ld", job->round);
  fail_t f;
  if (kget(rz, key, &val, NULL) == 1 && rdzv_fail_parse(val, &f) == 0) {
    fprintf(stderr, "chorusrun: root cause of round %ld: %s\n", job->round, f.what);
    if (strcmp(f.node, rz->id) != 0 && f.ntail) {
      fprintf(stderr, "chorusrun: its last %d line(s):\n", f.ntail);
      for (int i = 0; i < f.ntail; i++) fprintf(stderr, "  [rank%d]: %s\n", f.rank, f.tail[i]);
    }
  }
  free(val);
  if (rz->st.phase == PH_CLOSED) {
    fprintf(stderr, "chorusrun: the job ends: %s\n", rz->st.reason);
    return rz->st.exit_code ? rz->st.exit_code : EXIT_LAUNCHER;
  }
  if (rz->st.phase == PH_FROZEN && rz->st.round == job->round) {
    /* Nobody moved on (the node that failed could not reach the store):
     * open the next round ourselves. */
    advance(job, 1, NULL, EXIT_LAUNCHER, "the group stopped");
  }
  fprintf(stderr, "chorusrun: the group re-forms (round %ld: %s)\n", job->round + 1,
          rz->st.reason[0] ? rz->st.reason : "restart");
  return -1;
}

/* ------------------------------------------------------------- leaving */

/* The other nodes of the state that have neither left nor been lost, or
 * -1 when the state could not be read. */
static int others_here(rdzv_t *rz) {
  if (read_state(rz) != 1) return -1;
  int here = 0;
  const rstate_t *s = &rz->st;
  const rnode_t *lists[] = {s->mem, s->wait, s->exp};
  const int counts[] = {s->nmem, s->nwait, s->nexp};
  for (int l = 0; l < 3; l++)
    for (int i = 0; i < counts[l]; i++) {
      if (!strcmp(lists[l][i].id, rz->id)) continue;
      peer_t *p = observe(rz, lists[l][i].id);
      if (p && !p->done && !peer_lost(rz, p)) here++;
    }
  return here;
}

/* The store's host stays until every other node of the job has left (or is
 * lost), so nobody loses the store while it still needs it; bounded by
 * `deadline` and by heartbeats.  Returns others_here() at the end (-1
 * without asking when we host no store and nothing is to be cleaned up). */
static int linger(job_t *job, int64_t deadline) {
  rdzv_t *rz = job->rz;
  if (!rz->srv && !rz->round_srv) return rz->kv->ops->del_prefix ? others_here(rz) : -1;
  for (;;) {
    int waiting = others_here(rz);
    if (waiting < 0) return waiting;
    const rstate_t *s = &rz->st;
    if (!waiting || chorus__now_ns() >= deadline || job->got_sig) {
      if (s->phase != PH_CLOSED && !waiting) {
        rz->nx = *s;
        rz->nx.phase = PH_CLOSED;
        rz->nx.exit_code = 0;
        set_reason(&rz->nx, "the job finished");
        write_state(rz);
      }
      return waiting;
    }
    sleep_or_signal(job, (int)(job->monitor_ns / 1000000));
  }
}

/* The last node to leave removes what the job wrote to a service that
 * outlives it (etcd): its state, heartbeats, failure records, store
 * addresses.  Several may think they are last; deleting twice is
 * harmless.  A node killed outright leaves its keys until the others are
 * gone too, and a job whose every agent was killed leaves all of them
 * (etcdctl del --prefix /chorus/rdzv/<run id>/ removes them). */
static void clean_up(rdzv_t *rz, int others) {
  if (others != 0 || !rz->kv->ops->del_prefix) return;
  if (rz->kv->ops->del_prefix(rz->kv, rz->pfx) == 0)
    CHORUS_INFO(CHORUS__SUB_LAUNCH, "the last node to leave: removed %s at %s", rz->pfx,
                rz->kv->where);
  else
    CHORUS_WARN(CHORUS__SUB_LAUNCH, "could not remove the job's keys %s: %s", rz->pfx, rz->kv->err);
}

int rdzv_finish(job_t *job, int exit_code) {
  rdzv_t *rz = job->rz;
  beat(rz, 1, exit_code);
  if (rz->srv || rz->round_srv)
    CHORUS_INFO(CHORUS__SUB_LAUNCH,
                "our workers finished; serving the store until the other nodes leave");
  clean_up(rz, linger(job, CHORUS__NO_DEADLINE));
  return exit_code;
}

void rdzv_interrupt(job_t *job, int sig) {
  rdzv_t *rz = job->rz;
  for (int tries = 0; tries < 100; tries++) {
    if (read_state(rz) != 1 || rz->st.phase == PH_CLOSED) break;
    rz->nx = rz->st;
    rz->nx.phase = PH_CLOSED;
    rz->nx.exit_code = 128 + sig;
    set_reason(&rz->nx, "node %s got %s", rz->id, signal_name(sig));
    if (write_state(rz) != 0) break;
  }
}

void rdzv_close(job_t *job, int exit_code) {
  rdzv_t *rz = job->rz;
  if (!rz) return;
  if (rz->kv && !rz->dead) {
    int was_left = rz->left;
    if (!was_left) beat(rz, 1, exit_code);
    int others = linger(job, chorus__now_ns() + job->close_timeout_ns);
    if (!was_left) clean_up(rz, others); /* rdzv_finish did, when it was called */
    rz->kv->ops->close(rz->kv);
  }
  round_store_stop(rz);
  if (rz->srv) chorus_store_server_stop(rz->srv);
  free(rz->raw);
  free(rz);
  job->rz = NULL;
}
