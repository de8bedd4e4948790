/*
 * shrink.c - chorus_comm_shrink: the survivors of a failed communicator
 * agree on who is still alive and get a new communicator of just those.
 *
 * Two things are needed: a failure detector and a point of agreement.
 *   - The detector is the transport (chorus__tp_peer_state): a member whose
 *     connection is gone (it died: the kernel closed its sockets) or that
 *     has sent nothing, not even a heartbeat, for four heartbeat periods
 *     (stopped, hung, or its host unreachable) counts as dead.
 *   - The agreement is the store, a single linearizable server that
 *     outlives workers when chorusrun serves it: every survivor registers
 *     ("alive/<rank>"), waits until each member is registered or dead in
 *     its own view, and proposes the registered, not-dead members with a
 *     compare-and-set on one key.  The first proposal wins; everyone adopts
 *     it.  A survivor that registered too late to be in it learns that it
 *     was left out (an error, never a hang).
 * Keys live under chorus/shrink/<world id>/<communicator id>/<epoch>/; the
 * epoch counts shrinks of this communicator, equal on every survivor
 * because each calls shrink on it the same number of times.
 *
 * Bounds: every wait ends at the deadline.  A member that dies during the
 * agreement is either left out (it died before the proposal) or makes the
 * new communicator fail on its first use (after): the caller shrinks again.
 * The new communicator's id is derived from the old one, the epoch and the
 * member list, so ranks that somehow adopted different lists could never
 * exchange data.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/comm.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/util.h"

#define POLL_MS 10

/* Appends rank list "0,2,3" for members marked in keep. */
static void format_members(const chorus_comm_t comm, const uint8_t *keep, char *buf, size_t cap) {
  size_t len = 0;
  buf[0] = '\0';
  for (int g = 0; g < comm->size; g++) {
    if (!keep[g]) continue;
    int n = snprintf(buf + len, cap - len, "%s%d", len ? "," : "", g);
    if (n < 0 || (size_t)n >= cap - len) return;
    len += (size_t)n;
  }
}

/* Parses the adopted list (it came from the store: untrusted) into keep. */
static int parse_members(const char *s, size_t len, int size, uint8_t *keep) {
  memset(keep, 0, (size_t)size);
  int count = 0, prev = -1;
  size_t i = 0;
  while (i < len) {
    long v = 0;
    size_t d = 0;
    while (i < len && s[i] >= '0' && s[i] <= '9' && d < 10) v = v * 10 + (s[i++] - '0'), d++;
    if (d == 0 || v <= prev || v >= size) return -1;
    keep[v] = 1;
    prev = (int)v;
    count++;
    if (i < len && s[i++] != ',') return -1;
  }
  return count;
}

/* One round of the agreement (epoch = the next shrink of comm).  *retry is
 * set when the agreed communicator could not be set up because a member of
 * it died meanwhile: every member fails that setup alike, so all of them
 * run another round. */
static chorus_result_t shrink_round(chorus_comm_t comm, int64_t deadline, chorus_comm_t *out,
                                    int *retry) {
  chorus__ctx_t *ctx = comm->ctx;
  *retry = 0;
  pthread_mutex_lock(&comm->lock);
  uint64_t epoch = ++comm->shrinks;
  pthread_mutex_unlock(&comm->lock);
  char prefix[160], key[200];
  snprintf(prefix, sizeof prefix, "chorus/shrink/%016" PRIx64 "/%016" PRIx64 "/%" PRIu64 "/",
           ctx->world_id, comm->id, epoch);
  uint8_t *seen = calloc((size_t)comm->size, 1), *keep = calloc((size_t)comm->size, 1);
  size_t cap = (size_t)comm->size * 12 + 16;
  char *list = malloc(cap);
  chorus_result_t st = CHORUS_OK;
  void *cur = NULL;
  size_t cur_len = 0;
  if (!seen || !keep || !list) {
    st = CHORUS_ERR_NO_MEMORY;
    goto done;
  }
  /* Every store call below ends by the deadline, whatever the store does. */
  chorus__store_set_timeout(ctx->store, chorus__ms_left_bound(deadline));

  /* 1. Register. */
  snprintf(key, sizeof key, "%salive/%d", prefix, comm->rank);
  st = chorus_store_set(ctx->store, key, "1", 1);
  if (st != CHORUS_OK) goto store_failed;
  seen[comm->rank] = 1;

  /* 2. Wait until every member is registered or dead in our view. */
  for (;;) {
    int undecided = 0;
    for (int g = 0; g < comm->size; g++) {
      if (seen[g]) continue;
      int state = chorus__tp_peer_state(ctx->tp, comm->world_ranks[g]);
      snprintf(key, sizeof key, "%salive/%d", prefix, g);
      const char *keys[1] = {key};
      int exists = 0;
      st = chorus_store_check(ctx->store, keys, 1, &exists);
      if (st != CHORUS_OK) goto store_failed;
      if (exists) seen[g] = 1;
      else if (state == CHORUS__PEER_ALIVE) undecided++;
    }
    if (!undecided) break;
    if (chorus__ms_left(deadline) == 0) break; /* the undecided count as dead */
    struct timespec ts = {0, POLL_MS * 1000000};
    nanosleep(&ts, NULL);
  }

  /* 3. Propose the registered members that are not dead now; the first
   *    proposal is the decision. */
  for (int g = 0; g < comm->size; g++)
    keep[g] = seen[g] && (g == comm->rank ||
                          chorus__tp_peer_state(ctx->tp, comm->world_ranks[g]) ==
                              CHORUS__PEER_ALIVE);
  format_members(comm, keep, list, cap);
  snprintf(key, sizeof key, "%smembers", prefix);
  st = chorus_store_compare_set(ctx->store, key, NULL, 0, list, strlen(list), &cur, &cur_len);
  if (st != CHORUS_OK) goto store_failed;
  int n = parse_members(cur, cur_len, comm->size, keep);
  if (n <= 0) {
    chorus__comm_set_error(comm, "chorus_comm_shrink: rank %d/%d: the agreed member list in the "
                           "store is malformed", comm->rank, comm->size);
    st = CHORUS_ERR_PROTOCOL;
    goto done;
  }
  if (!keep[comm->rank]) {
    chorus__comm_set_error(comm, "chorus_comm_shrink: rank %d/%d was left out: the survivors "
                           "agreed on ranks %.*s before this rank registered (it was too slow "
                           "or seemed dead to them)", comm->rank, comm->size,
                           (int)CHORUS__MIN(cur_len, 300), (const char *)cur);
    st = CHORUS_ERR_REMOTE;
    goto done;
  }

  /* 4. The new communicator over the same connections. */
  int *world = malloc(sizeof(int) * (size_t)n);
  if (!world) {
    st = CHORUS_ERR_NO_MEMORY;
    goto done;
  }
  int me = -1, k = 0;
  for (int g = 0; g < comm->size; g++) {
    if (!keep[g]) continue;
    if (g == comm->rank) me = k;
    world[k++] = comm->world_ranks[g];
  }
  static const uint8_t idkey[16] = "chorus-shrinkid";
  uint64_t h[3] = {comm->id, epoch, chorus__siphash(idkey, world, sizeof(int) * (size_t)n)};
  uint64_t id = chorus__siphash(idkey, h, sizeof h);
  if (id < 2) id += 2; /* 1 is the world */
  st = chorus__comm_derive(comm, id, world, n, me, out);
  free(world);
  if (st != CHORUS_OK) {
    /* The agreed group lost a member before it was set up: every member
     * fails that setup alike and agrees again. */
    *retry = st == CHORUS_ERR_REMOTE || st == CHORUS_ERR_TIMEOUT || st == CHORUS_ERR_ABORTED;
  }
  if (st == CHORUS_OK)
    CHORUS_INFO(CHORUS__SUB_INIT, "shrink: rank %d/%d is rank %d/%d of the survivors (%.*s)",
                comm->rank, comm->size, me, n, (int)CHORUS__MIN(cur_len, 300),
                (const char *)cur);
  goto done;

store_failed:
  chorus__comm_set_error(comm, "chorus_comm_shrink: rank %d/%d cannot reach the store (%s); "
                         "the survivors agree through it, so it must outlive the failure: "
                         "launch with chorusrun, whose agent serves it",
                         comm->rank, comm->size, chorus_store_last_error(ctx->store));
done:
  chorus__store_set_timeout(ctx->store, comm->timeout_ms);
  free(cur);
  free(seen);
  free(keep);
  free(list);
  return st;
}

chorus_result_t chorus_comm_shrink(chorus_comm_t comm, int timeout_ms, chorus_comm_t *out) {
  if (!comm || !out) return CHORUS_ERR_INVALID_ARG;
  *out = NULL;
  if (timeout_ms <= 0) timeout_ms = comm->timeout_ms;
  int64_t deadline = chorus__deadline_ms(timeout_ms);
  if (!comm->ctx->store) {
    chorus__comm_set_error(comm, "chorus_comm_shrink: rank %d/%d has no store connection",
                           comm->rank, comm->size);
    return CHORUS_ERR_STORE;
  }
  for (;;) {
    int retry = 0;
    chorus_result_t st = shrink_round(comm, deadline, out, &retry);
    if (!retry || chorus__ms_left(deadline) == 0) return st;
    CHORUS_INFO(CHORUS__SUB_INIT, "shrink: rank %d/%d: a member of the agreed group died before "
                "it was set up; agreeing again", comm->rank, comm->size);
  }
}
