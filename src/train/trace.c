/*
 * trace.c - a run's timeline as a Chrome trace (Perfetto, chrome://tracing):
 * complete events of each rank (compute on one lane, collectives on
 * another), put on rank 0's clock and written by rank 0 as one file.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "chorus.h"
#include "chorus_train.h"
#include "train/runtime.h"

/* A complete event ("ph":"X") of this rank, in its CLOCK_MONOTONIC ns. */
typedef struct {
  const char *name;
  int lane; /* 0: compute, 1: collectives */
  int step;
  int bucket; /* collectives: the bucket's or unit's index */
  int64_t t0, t1;
  size_t bytes;
} event_t;

struct chorus_trace {
  event_t *ev;
  size_t n, cap;
  int64_t skew; /* testing: added to every time of this rank */
};

enum { TRACE_MAX_EVENTS = 1000000 };

int64_t chorus_trace_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

chorus_result_t chorus_trace_create(chorus_trace_t **out) {
  *out = calloc(1, sizeof **out);
  return *out ? CHORUS_OK
              : chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_trace_create: no memory");
}

void chorus_trace_destroy(chorus_trace_t *tr) {
  if (!tr) return;
  free(tr->ev);
  free(tr);
}

void chorus__trace_skew(chorus_trace_t *tr, int64_t ns) { tr->skew = ns; }

void chorus_trace_add(chorus_trace_t *tr, const char *name, int lane, int step, int bucket,
                      int64_t t0, int64_t t1, size_t bytes) {
  if (!tr || !name || t1 <= t0 || tr->n >= TRACE_MAX_EVENTS) return;
  if (tr->n == tr->cap) {
    size_t cap = tr->cap ? tr->cap * 2 : 1024;
    event_t *ev = realloc(tr->ev, cap * sizeof *ev);
    if (!ev) return;
    tr->ev = ev, tr->cap = cap;
  }
  tr->ev[tr->n++] = (event_t){name, lane != 0, step, bucket, t0 + tr->skew, t1 + tr->skew, bytes};
}

void chorus_trace_step(chorus_trace_t *tr, chorus_trainer_t *t, long step) {
  if (!tr) return;
  chorus_ddp_t *ddp = chorus_trainer_ddp(t);
  chorus_fsdp_t *f = chorus_trainer_fsdp(t);
  if (ddp) {
    chorus_ddp_stats_t bs;
    chorus_ddp_get_stats(ddp, &bs);
    for (int i = 0; i < bs.buckets; i++) {
      int64_t b0, b1;
      size_t bytes;
      chorus_ddp_bucket_times(ddp, i, &b0, &b1, &bytes);
      chorus_trace_add(tr, "all_reduce bucket", 1, (int)step, i, b0, b1, bytes);
    }
  }
  static const char *const names[] = {"forward unit", "backward unit", "all_gather unit",
                                      "reduce_scatter unit", "all_reduce unit"};
  const chorus_fsdp_event_t *e;
  for (int i = 0; f && (e = chorus_fsdp_event(f, i)); i++)
    chorus_trace_add(tr, names[e->kind], e->kind >= CHORUS_FSDP_GATHER, (int)step, e->unit,
                     e->start_ns, e->end_ns, e->bytes);
}

/* The trace's clock is rank 0's CLOCK_MONOTONIC.  Ranks on rank 0's host
 * (chorus_comm_same_host) read the same clock (offset 0, exact).  Any
 * other rank estimates its offset by Cristian's method: it sends its time
 * t1, rank 0 answers with its own t, the answer arrives at t2, so rank 0's
 * clock read t somewhere in [t1, t2] of ours: offset = t - (t1 + t2) / 2,
 * wrong by at most (t2 - t1) / 2.  Of 16 round trips the shortest is kept;
 * *unc gets that bound.  Rank 0 answers the ranks one after the other. */
static chorus_result_t clock_offset(chorus_comm_t comm, const chorus_trace_t *tr, int ping,
                                    int64_t *off, int64_t *unc) {
  enum { ROUNDS = 16, TAG = 7001 };
  const int me = chorus_comm_rank(comm), size = chorus_comm_size(comm);
  *off = *unc = 0;
  chorus_result_t st = CHORUS_OK;
  for (int r = 1; r < size && st == CHORUS_OK; r++) {
    /* Rank 0 and rank r see the same answer (one host table). */
    if (!ping && chorus_comm_same_host(comm, me == 0 ? r : 0) == 1) continue;
    if (me == 0) {
      for (int k = 0; k < ROUNDS && st == CHORUS_OK; k++) {
        int64_t t;
        st = chorus_recv(comm, &t, 1, CHORUS_INT64, r, TAG, NULL);
        t = chorus_trace_now() + tr->skew;
        if (st == CHORUS_OK) st = chorus_send(comm, &t, 1, CHORUS_INT64, r, TAG, NULL);
      }
    } else if (me == r) {
      int64_t best = INT64_MAX;
      for (int k = 0; k < ROUNDS && st == CHORUS_OK; k++) {
        int64_t t1 = chorus_trace_now() + tr->skew, t;
        st = chorus_send(comm, &t1, 1, CHORUS_INT64, 0, TAG, NULL);
        if (st == CHORUS_OK) st = chorus_recv(comm, &t, 1, CHORUS_INT64, 0, TAG, NULL);
        int64_t t2 = chorus_trace_now() + tr->skew;
        if (st == CHORUS_OK && t2 - t1 < best) {
          best = t2 - t1;
          *off = t - t1 - best / 2;
          *unc = (best + 1) / 2;
        }
      }
    }
  }
  return st;
}

/* This rank's events as JSON objects (no brackets) on rank 0's clock,
 * times relative to base; a malloc'ed string of *len bytes, or NULL. */
static char *events_json(const chorus_trace_t *tr, int me, int64_t off, int64_t unc,
                         int64_t base, size_t *len_out) {
  size_t cap = 512 + tr->n * 200, len = 0;
  char *buf = malloc(cap);
  if (!buf) return NULL;
  len += (size_t)snprintf(buf + len, cap - len,
                          "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":"
                          "\"rank %d\",\"clock_offset_us\":%.3f,\"clock_uncertainty_us\":%.3f}},"
                          "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
                          "\"args\":{\"name\":\"compute\"}},{\"name\":\"thread_name\",\"ph\":\"M\","
                          "\"pid\":%d,\"tid\":1,\"args\":{\"name\":\"collectives\"}}",
                          me, me, (double)off / 1e3, (double)unc / 1e3, me, me);
  for (size_t i = 0; i < tr->n && len < cap; i++) {
    const event_t *e = &tr->ev[i];
    len += (size_t)snprintf(buf + len, cap - len,
                            ",{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%d,\"bucket\":%d,"
                            "\"bytes\":%zu}}",
                            e->name, e->lane ? "comm" : "compute", me, e->lane,
                            (double)(e->t0 + off - base) / 1e3, (double)(e->t1 - e->t0) / 1e3,
                            e->step, e->bucket, e->bytes);
  }
  *len_out = len >= cap ? cap - 1 : len;
  return buf;
}

/* Rank 0's file: every rank's objects in one traceEvents array. */
static chorus_result_t write_file(const char *path, const char *all, const size_t *lens,
                                  int size) {
  FILE *f = fopen(path, "w");
  if (!f) return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trace_write: cannot create %s",
                                    path);
  fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", f);
  for (int r = 0; r < size; r++) {
    if (r) fputc(',', f);
    fwrite(all, 1, lens[r], f);
    all += lens[r];
  }
  fputs("]}\n", f);
  if (fclose(f) != 0)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_trace_write: cannot write %s",
                              path);
  return CHORUS_OK;
}

chorus_result_t chorus_trace_write(chorus_trace_t *tr, chorus_comm_t comm, int ping,
                                   const char *path) {
  const int me = chorus_comm_rank(comm), size = chorus_comm_size(comm);
  int64_t off, unc;
  chorus_result_t st = clock_offset(comm, tr, ping, &off, &unc);
  if (st != CHORUS_OK)
    return chorus__train_fail(st, "chorus_trace_write: rank %d: the clocks' offsets: %s", me,
                              chorus_comm_last_error(comm));
  int64_t mine = INT64_MAX, base;
  for (size_t i = 0; i < tr->n; i++) mine = tr->ev[i].t0 + off < mine ? tr->ev[i].t0 + off : mine;
  if ((st = chorus_all_reduce(comm, &mine, &base, 1, CHORUS_INT64, CHORUS_MIN, NULL)) !=
      CHORUS_OK)
    return chorus__train_fail(st, "chorus_trace_write: rank %d: the earliest event: %s", me,
                              chorus_comm_last_error(comm));
  size_t len = 0, *lens = calloc((size_t)size, sizeof *lens);
  if (!lens) /* the others' gather then fails by its deadline */
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_trace_write: rank %d: no memory",
                              me);
  /* Every rank joins the gather, also without memory (an empty part). */
  char *buf = events_json(tr, me, off, unc, base, &len);
  void *all = NULL;
  st = chorus_gather_bytes(comm, buf ? buf : "", buf ? len : 0, 0, &all, lens);
  free(buf);
  if (st != CHORUS_OK)
    st = chorus__train_fail(st, "chorus_trace_write: rank %d: gathering the events: %s", me,
                            chorus_comm_last_error(comm));
  else if (me == 0)
    st = write_file(path, all, lens, size);
  chorus_free(all);
  free(lens);
  return st;
}
