/*
 * rendezvous.h - all-gathering one value per rank through the store.
 */
#ifndef CHORUS_STORE_RENDEZVOUS_H
#define CHORUS_STORE_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

/* Publishes value under "<prefix><name>/<rank>" and waits until every rank
 * of size published its own; values[r] receives rank r's value
 * (NUL-terminated, malloc'd; free with chorus__rdzv_free).  The whole call
 * ends by deadline (chorus__deadline_ms; the client's timeout is set to what
 * is left before each request); errmsg names the first rank missing. */
chorus_result_t chorus__rdzv_allgather(chorus_store_t *store, const char *prefix,
                                       const char *name, int rank, int size, const char *value,
                                       int64_t deadline, char ***values, char *errmsg,
                                       size_t cap);
void chorus__rdzv_free(char **values, int size);

#endif
