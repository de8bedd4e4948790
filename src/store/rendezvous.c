/*
 * rendezvous.c - see rendezvous.h.  Values are small strings (addresses,
 * ids); each rank's key is fetched in turn with a blocking get, so a rank
 * that never shows up is named in the error.
 */
#include "store/rendezvous.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store.h"
#include "util/clock.h"

void chorus__rdzv_free(char **values, int size) {
  if (!values) return;
  for (int r = 0; r < size; r++) free(values[r]);
  free(values);
}

chorus_result_t chorus__rdzv_allgather(chorus_store_t *store, const char *prefix,
                                       const char *name, int rank, int size, const char *value,
                                       int64_t deadline, char ***out, char *errmsg, size_t cap) {
  char key[512];
  snprintf(key, sizeof key, "%s%s/%d", prefix, name, rank);
  chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
  chorus_result_t st = chorus_store_set(store, key, value, strlen(value));
  if (st != CHORUS_OK) {
    snprintf(errmsg, cap, "%s", chorus_store_last_error(store));
    return st;
  }
  char **values = calloc((size_t)size, sizeof(char *));
  if (!values) return CHORUS_ERR_NO_MEMORY;
  for (int r = 0; r < size; r++) {
    void *val = NULL;
    size_t len = 0;
    snprintf(key, sizeof key, "%s%s/%d", prefix, name, r);
    chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
    st = chorus_store_get(store, key, &val, &len);
    if (st != CHORUS_OK) {
      snprintf(errmsg, cap, "rank %d never published '%s' (%s)", r, key,
               chorus_store_last_error(store));
      chorus__rdzv_free(values, size);
      return st;
    }
    values[r] = malloc(len + 1);
    if (!values[r]) {
      free(val);
      chorus__rdzv_free(values, size);
      return CHORUS_ERR_NO_MEMORY;
    }
    if (len) memcpy(values[r], val, len);
    values[r][len] = '\0';
    free(val);
  }
  *out = values;
  return CHORUS_OK;
}
