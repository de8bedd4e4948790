/*
 * rendezvous.h - forming a world through the store: every rank's record
 * published and a join counted (O(1) operations per rank), a record read
 * when a peer is first dialled, and the all-gather of every record for the
 * worlds that need all of them.
 */
#ifndef CHORUS_STORE_RENDEZVOUS_H
#define CHORUS_STORE_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

/* Publishes value under "<prefix><name>/<rank>" (unless published: the
 * join did) and waits until every rank of size published its own;
 * values[r] receives rank r's value
 * (NUL-terminated, malloc'd; free with chorus__rdzv_free).  The whole call
 * ends by deadline (chorus__deadline_ms; the client's timeout is set to what
 * is left before each request); errmsg names the first rank missing. */
chorus_result_t chorus__rdzv_allgather(chorus_store_t *store, const char *prefix,
                                       const char *name, int rank, int size, const char *value,
                                       int published, int64_t deadline, char ***values,
                                       char *errmsg, size_t cap);
void chorus__rdzv_free(char **values, int size);

/* The join: publishes record under "<prefix>addr/<rank>", then counts this
 * rank in "<prefix>joined/<world>" with its vote (non-zero: this rank needs
 * every record, chorus__rdzv_allgather) and waits until all size ranks
 * joined.  Four store operations with the world id's (three here), whatever
 * size is.  *votes: how many ranks voted for every record.  By deadline;
 * errmsg names ranks missing. */
#define CHORUS__RDZV_MAX_RANKS ((1 << 21) - 1)
chorus_result_t chorus__rdzv_join(chorus_store_t *store, const char *prefix, uint64_t world,
                                  int rank, int size, const char *record, int vote,
                                  int64_t deadline, int *votes, char *errmsg, size_t cap);

/* The join's two halves, for a caller that plays many ranks from one
 * thread (bench/scale): begin publishes and counts (its ticket: the
 * counter as this rank left it), end waits for the last rank. */
chorus_result_t chorus__rdzv_join_begin(chorus_store_t *store, const char *prefix,
                                        uint64_t world, int rank, int size, const char *record,
                                        int vote, int64_t deadline, int64_t *ticket, char *errmsg,
                                        size_t cap);
chorus_result_t chorus__rdzv_join_end(chorus_store_t *store, const char *prefix, uint64_t world,
                                      int size, int64_t ticket, int64_t deadline, int *votes,
                                      char *errmsg, size_t cap);

/* Rank r's record as it published it in the join (the world formed: it is
 * there), NUL-terminated and malloc'd; by timeout_ms.  With busy: read
 * only if no other thread is in a call on store, else *busy = 1 and
 * nothing read (*record NULL). */
chorus_result_t chorus__rdzv_record(chorus_store_t *store, const char *prefix, int r,
                                    int timeout_ms, int *busy, char **record, char *errmsg,
                                    size_t cap);

#endif
