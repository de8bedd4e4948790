/*
 * rdzv_keys.c - the rendezvous's values on the key-value service: every
 * value sealed with the job key, the state read and compare-and-set, the
 * heartbeats written and read (peers), and the rounds' failure records;
 * the wait between two calls.  The keys are described at the top of
 * rdzv.c.
 */
#include "launcher/rdzv.h"

#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

#define STATE_MAX (4u << 20)

/* ------------------------------------------------------------- helpers */

void rdzv__key_of(const rdzv_io_t *io, char *buf, size_t cap, const char *fmt, ...) {
  int n = snprintf(buf, cap, "%s", io->pfx);
  va_list ap;
  va_start(ap, fmt);
  if (n >= 0 && (size_t)n < cap) vsnprintf(buf + n, cap - (size_t)n, fmt, ap);
  va_end(ap);
}

static int ok(rdzv_io_t *io, int rc) {
  if (rc >= 0) io->last_ok = chorus__now_ns();
  return rc;
}

int rdzv__lost_store(const rdzv_t *rz) {
  return chorus__now_ns() - rz->io.last_ok > rz->svc_lost_ns;
}

void rdzv__sleep_or_signal(job_t *job, int ms) {
  struct pollfd p = {.fd = g_selfpipe[0], .events = POLLIN};
  if (ms < 0) ms = 0;
  if (poll(&p, 1, ms) > 0) {
    int sig = drain_selfpipe();
    if (sig && !job->got_sig) job->got_sig = sig;
  }
}

/* ------------------------------------------------------ sealed values */

/* Every value we write ends with a line "mac <hex>": HMAC-SHA256 under the
 * job key of the key's name, a NUL and the text before that line.  etcd has
 * no notion of our job, so anyone who reaches it could write there; with
 * the seal a value that no agent of this job wrote is refused, never used
 * (our own store authenticates its clients as well, and the seal costs
 * nothing there). */
#define SEAL_HEX (2 * CHORUS__MAC_LEN)

static void seal_mac(const rdzv_io_t *io, const char *key, const char *text, size_t len,
                     char hex[SEAL_HEX + 1]) {
  const void *parts[] = {key, "", text};
  size_t lens[] = {strlen(key), 1, len};
  uint8_t mac[CHORUS__MAC_LEN];
  chorus__hmac(io->key, parts, lens, 3, mac);
  chorus__hex(hex, mac, CHORUS__MAC_LEN);
}

/* text + (a newline if it lacks one) + the seal line, malloc'd. */
static char *seal(const rdzv_io_t *io, const char *key, const char *text) {
  char hex[SEAL_HEX + 1];
  size_t len = strlen(text);
  char *out = xmalloc(len + SEAL_HEX + 7);
  memcpy(out, text, len);
  if (!len || out[len - 1] != '\n') out[len++] = '\n';
  seal_mac(io, key, out, len, hex);
  snprintf(out + len, SEAL_HEX + 6, "mac %s\n", hex);
  return out;
}

/* Checks val's seal and cuts it off (in place).  0, or -1. */
static int unseal(const rdzv_io_t *io, const char *key, char *val) {
  size_t len = strlen(val);
  if (len < SEAL_HEX + 5 || val[len - 1] != '\n') return -1;
  char *line = val + len - (SEAL_HEX + 5);
  if (strncmp(line, "mac ", 4) || (line != val && line[-1] != '\n')) return -1;
  char hex[SEAL_HEX + 1];
  seal_mac(io, key, val, (size_t)(line - val), hex);
  if (!chorus__ct_equal(hex, line + 4, SEAL_HEX)) return -1;
  *line = '\0';
  return 0;
}

/* get: 1 with *val (the text, malloc'd) and, if raw is not NULL, *raw (the
 * value as stored, malloc'd); 0 absent; -1 no answer; -2 not sealed by this
 * job (message in kv->err). */
int rdzv__kget(rdzv_io_t *io, const char *key, char **val, char **raw) {
  char *v = NULL;
  *val = NULL;
  int rc = ok(io, io->kv->ops->get(io->kv, key, &v));
  if (rc <= 0) return rc;
  char *copy = raw ? xstrdup(v) : NULL;
  if (unseal(io, key, v) != 0) {
    snprintf(io->kv->err, sizeof io->kv->err,
             "%s at %s does not carry this job's seal: written by another job (same run id, "
             "another secret) or corrupted", key, io->kv->where);
    free(v);
    free(copy);
    return -2;
  }
  *val = v;
  if (raw) *raw = copy;
  return 1;
}

int rdzv__kset(rdzv_io_t *io, const char *key, const char *text) {
  char *v = seal(io, key, text);
  int rc = ok(io, io->kv->ops->set(io->kv, key, v));
  free(v);
  return rc;
}

/* cas with expected as stored (sealed) or NULL, desired as text. */
static int kcas(rdzv_io_t *io, const char *key, const char *expected_raw, const char *text) {
  char *v = seal(io, key, text);
  int rc = ok(io, io->kv->ops->cas(io->kv, key, expected_raw, v));
  free(v);
  return rc;
}

/* --------------------------------------------------------------- state */

/* Reads the state: 1 (rz->raw, rz->st), 0 when there is none yet, -1 when
 * the service did not answer, -2 when the value does not parse (message in
 * kv->err). */
int rdzv__read_state(rdzv_t *rz) {
  char key[300], *val = NULL, *raw = NULL;
  rdzv__key_of(&rz->io, key, sizeof key, "state");
  int rc = rdzv__kget(&rz->io, key, &val, &raw);
  if (rc <= 0 || rc == -2) return rc;
  char why[200];
  if (strlen(val) > STATE_MAX || rdzv_state_parse(val, &rz->st, why, sizeof why) != 0) {
    snprintf(rz->io.kv->err, sizeof rz->io.kv->err, "the rendezvous state at %s is corrupt: %s",
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

/* After our compare-and-set put `raw` in: `gen` names it.  Two writers in
 * a row may set `gen` in the other order; so we read the state back and
 * name what is there, until `gen` names the state we read after setting
 * it (a writer that dies in between leaves `gen` behind: the readers'
 * full read every full_ns covers that). */
static void announce(rdzv_t *rz, char *raw /* ours to free */) {
  char key[300];
  rdzv__key_of(&rz->io, key, sizeof key, "state");
  for (int tries = 0; tries < 3; tries++) {
    if (rdzv__gen_publish(&rz->io, raw) != 0) break;
    char *val = NULL, *now = NULL;
    if (rdzv__kget(&rz->io, key, &val, &now) != 1) break;
    free(val);
    int same = !strcmp(now, raw);
    free(raw);
    raw = now;
    if (same) break;
  }
  free(raw);
}

/* Replaces the state last read by rz->nx: 1 done, 0 someone changed it
 * first, -1 no answer. */
int rdzv__write_state(rdzv_t *rz) {
  char key[300];
  rdzv__key_of(&rz->io, key, sizeof key, "state");
  char *text = rdzv_state_format(&rz->nx);
  char *v = seal(&rz->io, key, text);
  int rc = ok(&rz->io, rz->io.kv->ops->cas(rz->io.kv, key, rz->raw, v));
  free(text);
  if (rc == 1) announce(rz, v);
  else free(v);
  return rc;
}

void rdzv__say_state_error(const rdzv_t *rz, int rc) {
  if (rc == -2) fprintf(stderr, "chorusrun: %s\n", rz->io.kv->err);
}

/* The seal line's hex of a stored value (its fingerprint), or NULL. */
static const char *seal_of(const char *raw) {
  size_t len = raw ? strlen(raw) : 0;
  if (len < SEAL_HEX + 5) return NULL;
  const char *line = raw + len - (SEAL_HEX + 5);
  return strncmp(line, "mac ", 4) ? NULL : line + 4;
}

int rdzv__gen_publish(rdzv_io_t *io, const char *raw) {
  const char *mac = seal_of(raw);
  if (!mac) return -1;
  char key[300], val[SEAL_HEX + 1];
  memcpy(val, mac, SEAL_HEX);
  val[SEAL_HEX] = '\0';
  rdzv__key_of(io, key, sizeof key, "gen");
  return rdzv__kset(io, key, val);
}

int rdzv__gen_changed(rdzv_io_t *io, const char *raw) {
  char key[300], *val = NULL;
  rdzv__key_of(io, key, sizeof key, "gen");
  int rc = rdzv__kget(io, key, &val, NULL);
  if (rc == -1) return -1;
  const char *mac = seal_of(raw);
  /* Absent, not sealed by this job or not a fingerprint: read the state. */
  int same = rc == 1 && mac && strlen(val) == SEAL_HEX && !memcmp(val, mac, SEAL_HEX);
  free(val);
  return !same;
}

/* ----------------------------------------------------------- heartbeats */

int rdzv__beat(rdzv_io_t *io, int done, int code) {
  char key[300], val[64];
  rdzv__key_of(io, key, sizeof key, "hb/%s", io->id);
  if (done) snprintf(val, sizeof val, "%ld done %d", ++io->beats, code);
  else snprintf(val, sizeof val, "%ld run", ++io->beats);
  if (done) io->left = 1;
  return rdzv__kset(io, key, val);
}

peer_t *rdzv__peer(rdzv_io_t *io, const char *id) {
  for (int i = 0; i < io->npeers; i++)
    if (!strcmp(io->peers[i].id, id)) return &io->peers[i];
  if (io->npeers == io->peer_cap) io->npeers = 0; /* forget old ones */
  peer_t *p = &io->peers[io->npeers++];
  memset(p, 0, sizeof *p);
  snprintf(p->id, sizeof p->id, "%s", id);
  p->seen = chorus__now_ns();
  return p;
}

/* Reads id's heartbeat.  Returns the peer, NULL when the service did not
 * answer. */
peer_t *rdzv__observe(rdzv_io_t *io, const char *id) {
  peer_t *p = rdzv__peer(io, id);
  char key[300], *val = NULL;
  rdzv__key_of(io, key, sizeof key, "hb/%s", id);
  /* When we asked: a counter that did not move was not moving then.  When
   * the answer came: a counter that grew had grown by then. */
  int64_t asked = chorus__now_ns();
  int rc = rdzv__kget(io, key, &val, NULL);
  if (rc == -1) return NULL;
  p->read = asked;
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
                id, p->counter, counter, io->kv->where);
  }
  free(val);
  return p;
}

/* Judged at our last read, not now: a node we have not read lately is not
 * known to be silent (the watch step gives a node it comes back to a fresh
 * lost_ns). */
int rdzv__peer_lost(const rdzv_io_t *io, const peer_t *p) {
  return !p->done && p->read && p->read - p->seen > io->lost_ns;
}

/* ------------------------------------------------------ failure records */

/* Writes the round's failure record unless one exists; *rec gets the
 * record that stands (ours or the earlier one).  0 or -1. */
int rdzv__record_failure(rdzv_io_t *io, long round, const fail_t *mine, fail_t *rec) {
  char key[300];
  rdzv__key_of(io, key, sizeof key, "fail/%ld", round);
  char *text = rdzv_fail_format(mine);
  int rc = kcas(io, key, NULL, text);
  free(text);
  if (rc == 1) {
    *rec = *mine;
    return 0;
  }
  char *val = NULL;
  if (rc < 0 || rdzv__kget(io, key, &val, NULL) != 1) return -1;
  int prc = rdzv_fail_parse(val, rec);
  free(val);
  if (prc != 0) *rec = *mine;
  return 0;
}
