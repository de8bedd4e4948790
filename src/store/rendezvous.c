/*
 * rendezvous.c - forming a world through the store.
 *
 * The join (chorus__rdzv_join): each rank sets its record, adds itself to
 * a counter of the world and waits for the last to arrive, who writes
 * what the counter reached under a key the others wait on: three store
 * operations per rank whatever the world's size, and no rank reads
 * another's record until it dials it (chorus__rdzv_record).  The counter
 * also sums a vote: ranks that need every record (UCX between hosts, a
 * host map nobody told them) say so, and then all of them all-gather.
 *
 * The all-gather (chorus__rdzv_allgather): one value per rank in O(1)
 * operations per rank: each rank sets its value, rank 0 reads them
 * all and sets one table, every other rank reads the table.  The store
 * serves 2 operations per rank and P + 2 for rank 0, but P values to every
 * rank: P^2 bytes, which is why the join does without it.
 *
 * The table is "<prefix><name>/all/<i>", cut into pieces of at most
 * PIECE_MAX bytes; piece 0 is set last, so a rank that has it finds the
 * others.  Piece 0 begins with a byte: 'T' then the table's length and its
 * number of pieces (u32 each), or 'E' and the reason rank 0 could not
 * make it (a rank that never published), which every rank then reports.
 * The table is u32 count, then per rank u32 length and the value.  Every
 * field is checked: the table is what came through the store.
 */
#include "store/rendezvous.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/le.h"
#include "util/util.h"

/* Each piece of the table: far below the store's frame limit. */
#define PIECE_MAX ((size_t)1 << 20)
/* A value's bytes (an address record: well under this). */
#define VALUE_MAX ((size_t)1 << 16)

void chorus__rdzv_free(char **values, int size) {
  if (!values) return;
  for (int r = 0; r < size; r++) free(values[r]);
  free(values);
}

static chorus_result_t get_key(chorus_store_t *store, const char *key, int64_t deadline,
                               void **val, size_t *len) {
  chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
  return chorus_store_get(store, key, val, len);
}

static chorus_result_t set_key(chorus_store_t *store, const char *key, const void *val,
                               size_t len, int64_t deadline) {
  chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
  return chorus_store_set(store, key, val, len);
}

/* Rank 0: every rank's value as the table, in rank order; *why on failure
 * (also for the others).  Its own is read back last, as the store holds it
 * when the others have published (what each rank used to read). */
static chorus_result_t gather_table(chorus_store_t *store, const char *prefix, const char *name,
                                    int size, int64_t deadline, uint8_t **table, size_t *tlen,
                                    char *why, size_t cap) {
  size_t len = 4, have = 0, *at = calloc((size_t)size, sizeof *at);
  uint8_t *t = NULL;
  char key[512];
  chorus_result_t st = at ? CHORUS_OK : CHORUS_ERR_NO_MEMORY;
  if (!at) snprintf(why, cap, "out of memory for the table of %d values", size);
  for (int i = 1; i <= size && st == CHORUS_OK; i++) {
    const int r = i % size;
    void *val = NULL;
    size_t vlen = 0;
    snprintf(key, sizeof key, "%s%s/%d", prefix, name, r);
    st = get_key(store, key, deadline, &val, &vlen);
    if (st != CHORUS_OK) {
      snprintf(why, cap, "rank %d never published '%s' (%s)", r, key,
               chorus_store_last_error(store));
      break;
    }
    if (vlen > VALUE_MAX) {
      snprintf(why, cap, "rank %d published %zu bytes under '%s', more than %zu", r, vlen, key,
               VALUE_MAX);
      st = CHORUS_ERR_PROTOCOL;
    } else if (len + 4 + vlen > have) {
      size_t grow = have ? have * 2 : 4096;
      while (grow < len + 4 + vlen) grow *= 2;
      uint8_t *nt = realloc(t, grow);
      if (!nt) {
        snprintf(why, cap, "out of memory for the table of %d values", size);
        st = CHORUS_ERR_NO_MEMORY;
      } else {
        t = nt, have = grow;
      }
    }
    if (st == CHORUS_OK) {
      at[r] = len;
      chorus__le32_put(t + len, (uint32_t)vlen);
      if (vlen) memcpy(t + len + 4, val, vlen);
      len += 4 + vlen;
    }
    free(val);
  }
  if (st != CHORUS_OK) {
    free(at);
    free(t);
    return st;
  }
  /* Rank order: rank 0's entry was read last, so it moves to the front. */
  size_t first = len - at[0];
  uint8_t *o = malloc(len);
  if (!o) {
    free(at);
    free(t);
    snprintf(why, cap, "out of memory for the table of %d values", size);
    return CHORUS_ERR_NO_MEMORY;
  }
  memcpy(o + 4, t + at[0], first);
  memcpy(o + 4 + first, t + 4, at[0] - 4);
  free(at);
  free(t);
  t = o;
  if (len > UINT32_MAX) {
    snprintf(why, cap, "the table of %d values would be %zu bytes, more than 4 GiB", size, len);
    free(t);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus__le32_put(t, (uint32_t)size);
  *table = t;
  *tlen = len;
  return CHORUS_OK;
}

/* Rank 0: the table's pieces, piece 0 (with the header) last; or the
 * reason in piece 0. */
static chorus_result_t publish_table(chorus_store_t *store, const char *prefix, const char *name,
                                     const uint8_t *t, size_t tlen, const char *why,
                                     int64_t deadline) {
  char key[512];
  if (!t) {
    size_t wl = strlen(why);
    uint8_t *e = malloc(1 + wl);
    if (!e) return CHORUS_ERR_NO_MEMORY;
    e[0] = 'E';
    memcpy(e + 1, why, wl);
    snprintf(key, sizeof key, "%s%s/all/0", prefix, name);
    chorus_result_t st = set_key(store, key, e, 1 + wl, deadline);
    free(e);
    return st;
  }
  const size_t first = PIECE_MAX - 9, npieces = tlen <= first ? 1 : 2 + (tlen - first - 1) / PIECE_MAX;
  chorus_result_t st = CHORUS_OK;
  for (size_t i = 1; i < npieces && st == CHORUS_OK; i++) {
    size_t off = first + (i - 1) * PIECE_MAX, n = tlen - off < PIECE_MAX ? tlen - off : PIECE_MAX;
    snprintf(key, sizeof key, "%s%s/all/%zu", prefix, name, i);
    st = set_key(store, key, t + off, n, deadline);
  }
  if (st != CHORUS_OK) return st;
  size_t n0 = tlen < first ? tlen : first;
  uint8_t *p0 = malloc(9 + n0);
  if (!p0) return CHORUS_ERR_NO_MEMORY;
  p0[0] = 'T';
  chorus__le32_put(p0 + 1, (uint32_t)tlen);
  chorus__le32_put(p0 + 5, (uint32_t)npieces);
  memcpy(p0 + 9, t, n0);
  snprintf(key, sizeof key, "%s%s/all/0", prefix, name);
  st = set_key(store, key, p0, 9 + n0, deadline);
  free(p0);
  return st;
}

/* Any rank but 0: the table rank 0 published, put together again. */
static chorus_result_t fetch_table(chorus_store_t *store, const char *prefix, const char *name,
                                   int size, int64_t deadline, uint8_t **table, size_t *tlen,
                                   char *errmsg, size_t cap) {
  char key[512];
  snprintf(key, sizeof key, "%s%s/all/0", prefix, name);
  void *v0 = NULL;
  size_t l0 = 0;
  chorus_result_t st = get_key(store, key, deadline, &v0, &l0);
  if (st != CHORUS_OK) {
    snprintf(errmsg, cap, "rank 0 never published the table '%s' (%s)", key,
             chorus_store_last_error(store));
    return st;
  }
  const uint8_t *p = v0;
  if (l0 >= 1 && p[0] == 'E') {
    snprintf(errmsg, cap, "rank 0: %.*s", (int)(l0 - 1), (const char *)p + 1);
    free(v0);
    return CHORUS_ERR_REMOTE;
  }
  uint32_t total = l0 >= 9 && p[0] == 'T' ? chorus__le32_get(p + 1) : 0;
  uint32_t npieces = l0 >= 9 ? chorus__le32_get(p + 5) : 0;
  /* At most a 64 KiB value per rank, and the pieces that makes. */
  const uint64_t most = 4 + (uint64_t)size * (4 + VALUE_MAX);
  if (!total || total > most || !npieces || npieces > 2 + most / PIECE_MAX ||
      (npieces == 1 && l0 - 9 != total) || (npieces > 1 && l0 != PIECE_MAX)) {
    snprintf(errmsg, cap, "the table '%s' from rank 0 is malformed (%zu bytes)", key, l0);
    free(v0);
    return CHORUS_ERR_PROTOCOL;
  }
  uint8_t *t = malloc(total);
  if (!t) {
    free(v0);
    snprintf(errmsg, cap, "out of memory for a table of %u bytes", total);
    return CHORUS_ERR_NO_MEMORY;
  }
  size_t have = l0 - 9;
  memcpy(t, p + 9, have);
  free(v0);
  for (uint32_t i = 1; i < npieces && st == CHORUS_OK; i++) {
    void *v = NULL;
    size_t l = 0;
    snprintf(key, sizeof key, "%s%s/all/%u", prefix, name, i);
    st = get_key(store, key, deadline, &v, &l);
    if (st != CHORUS_OK) {
      snprintf(errmsg, cap, "the table's piece '%s' is missing (%s)", key,
               chorus_store_last_error(store));
    } else if (l > total - have || (i + 1 < npieces && l != PIECE_MAX) ||
               (i + 1 == npieces && have + l != total)) {
      snprintf(errmsg, cap, "the table's piece '%s' from rank 0 is malformed (%zu bytes)", key, l);
      st = CHORUS_ERR_PROTOCOL;
    } else {
      memcpy(t + have, v, l);
      have += l;
    }
    free(v);
  }
  if (st != CHORUS_OK) {
    free(t);
    return st;
  }
  *table = t;
  *tlen = total;
  return CHORUS_OK;
}

/* The table cut into size NUL-terminated values. */
static chorus_result_t split_table(const uint8_t *t, size_t tlen, int size, char ***out,
                                   char *errmsg, size_t cap) {
  if (tlen < 4 || chorus__le32_get(t) != (uint32_t)size) {
    snprintf(errmsg, cap, "the table from rank 0 is not one of %d values", size);
    return CHORUS_ERR_PROTOCOL;
  }
  char **values = calloc((size_t)size, sizeof(char *));
  if (!values) return CHORUS_ERR_NO_MEMORY;
  size_t at = 4;
  for (int r = 0; r < size; r++) {
    uint32_t vlen = tlen - at >= 4 ? chorus__le32_get(t + at) : UINT32_MAX;
    if (vlen > VALUE_MAX || vlen > tlen - at - 4) {
      snprintf(errmsg, cap, "the table from rank 0 is malformed at rank %d", r);
      chorus__rdzv_free(values, size);
      return CHORUS_ERR_PROTOCOL;
    }
    values[r] = malloc((size_t)vlen + 1);
    if (!values[r]) {
      chorus__rdzv_free(values, size);
      return CHORUS_ERR_NO_MEMORY;
    }
    memcpy(values[r], t + at + 4, vlen);
    values[r][vlen] = '\0';
    at += 4 + vlen;
  }
  if (at != tlen) {
    snprintf(errmsg, cap, "the table from rank 0 has %zu bytes past its %d values", tlen - at,
             size);
    chorus__rdzv_free(values, size);
    return CHORUS_ERR_PROTOCOL;
  }
  *out = values;
  return CHORUS_OK;
}

chorus_result_t chorus__rdzv_allgather(chorus_store_t *store, const char *prefix,
                                       const char *name, int rank, int size, const char *value,
                                       int published, int64_t deadline, char ***out, char *errmsg,
                                       size_t cap) {
  char key[512];
  snprintf(key, sizeof key, "%s%s/%d", prefix, name, rank);
  if (strlen(value) > VALUE_MAX) {
    snprintf(errmsg, cap, "a value of %zu bytes for '%s': at most %zu", strlen(value), key,
             VALUE_MAX);
    return CHORUS_ERR_INVALID_ARG;
  }
  chorus_result_t st = published ? CHORUS_OK : set_key(store, key, value, strlen(value), deadline);
  if (st != CHORUS_OK) {
    snprintf(errmsg, cap, "%s", chorus_store_last_error(store));
    return st;
  }
  uint8_t *t = NULL;
  size_t tlen = 0;
  if (rank == 0) {
    st = gather_table(store, prefix, name, size, deadline, &t, &tlen, errmsg, cap);
    chorus_result_t pst = publish_table(store, prefix, name, t, tlen, errmsg, deadline);
    if (st == CHORUS_OK && pst != CHORUS_OK) {
      snprintf(errmsg, cap, "publishing the table: %s", chorus_store_last_error(store));
      st = pst;
    }
  } else {
    st = fetch_table(store, prefix, name, size, deadline, &t, &tlen, errmsg, cap);
  }
  if (st == CHORUS_OK) st = split_table(t, tlen, size, out, errmsg, cap);
  free(t);
  /* This rank's own value came back as it went: else the table is not
   * this rendezvous's.  (Rank 0 made it from what the store held.) */
  if (st == CHORUS_OK && rank != 0 && strcmp((*out)[rank], value) != 0) {
    snprintf(errmsg, cap, "the table from rank 0 holds another value for this rank");
    chorus__rdzv_free(*out, size);
    *out = NULL;
    st = CHORUS_ERR_PROTOCOL;
  }
  return st;
}

/* ---------------------------------------------------------------- join */

/* The counter's fields: arrivals in the low bits, votes above them. */
#define JOIN_BITS 21
#define JOIN_MASK ((int64_t)CHORUS__RDZV_MAX_RANKS)

/* After a join that timed out: which ranks never published, by CHECKs of
 * 64 keys at a time (then one at a time within a batch that lacks one),
 * naming at most 8 and counting the rest; a few seconds at most. */
static void name_missing(chorus_store_t *store, const char *prefix, int size, char *errmsg,
                         size_t cap) {
  int64_t until = chorus__deadline_ms(3000);
  char keys[64][160];
  const char *kp[64];
  int named = 0, missing = 0, checked = 0;
  size_t at = strlen(errmsg);
  for (int base = 0; base < size && chorus__ms_left(until) > 0; base += 64) {
    int n = CHORUS__MIN(64, size - base), all = 1;
    for (int i = 0; i < n; i++) {
      snprintf(keys[i], sizeof keys[i], "%saddr/%d", prefix, base + i);
      kp[i] = keys[i];
    }
    chorus__store_set_timeout(store, chorus__ms_left_bound(until));
    if (chorus_store_check(store, kp, n, &all) != CHORUS_OK) break;
    checked = base + n;
    for (int i = 0; i < n && !all; i++) {
      int one = 1;
      if (chorus_store_check(store, kp + i, 1, &one) != CHORUS_OK) break;
      if (one) continue;
      missing++;
      if (named++ < 8 && at < cap)
        at += (size_t)snprintf(errmsg + at, cap - at, "%s%d", named == 1 ? "; missing: rank " : ", ",
                               base + i);
    }
  }
  if (at < cap && missing > 8)
    at += (size_t)snprintf(errmsg + at, cap - at, " and %d more", missing - 8);
  if (at < cap && checked < size)
    snprintf(errmsg + at, cap - at, " (ranks from %d on not checked)", checked);
  else if (at < cap && !missing)
    snprintf(errmsg + at, cap - at, "; every rank published its record: one of them did not "
             "count itself in (it failed between the two)");
}

chorus_result_t chorus__rdzv_join_begin(chorus_store_t *store, const char *prefix,
                                        uint64_t world, int rank, int size, const char *record,
                                        int vote, int64_t deadline, int64_t *ticket, char *errmsg,
                                        size_t cap) {
  char key[512];
  if (size < 1 || size > CHORUS__RDZV_MAX_RANKS || rank < 0 || rank >= size) {
    snprintf(errmsg, cap, "rank %d of %d: a world joins with 1 to %d ranks", rank, size,
             CHORUS__RDZV_MAX_RANKS);
    return CHORUS_ERR_INVALID_ARG;
  }
  if (strlen(record) > VALUE_MAX) {
    snprintf(errmsg, cap, "a record of %zu bytes: at most %zu", strlen(record), VALUE_MAX);
    return CHORUS_ERR_INVALID_ARG;
  }
  snprintf(key, sizeof key, "%saddr/%d", prefix, rank);
  chorus_result_t st = set_key(store, key, record, strlen(record), deadline);
  snprintf(key, sizeof key, "%sjoined/%016llx", prefix, (unsigned long long)world);
  if (st == CHORUS_OK) {
    chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
    st = chorus_store_add(store, key, 1 + ((int64_t)(vote != 0) << JOIN_BITS), ticket);
  }
  if (st != CHORUS_OK) snprintf(errmsg, cap, "%s", chorus_store_last_error(store));
  return st;
}

chorus_result_t chorus__rdzv_join_end(chorus_store_t *store, const char *prefix, uint64_t world,
                                      int size, int64_t total, int64_t deadline, int *votes,
                                      char *errmsg, size_t cap) {
  char done[512];
  chorus_result_t st;
  snprintf(done, sizeof done, "%sjoined/%016llx/all", prefix, (unsigned long long)world);
  void *val = NULL;
  size_t len = 0;
  if ((total & JOIN_MASK) == size) {
    /* The last to arrive says so; the first writer of the key wins, so
     * every rank reads one answer even if someone else wrote it. */
    char txt[32];
    snprintf(txt, sizeof txt, "%lld", (long long)total);
    chorus__store_set_timeout(store, chorus__ms_left_bound(deadline));
    st = chorus_store_compare_set(store, done, NULL, 0, txt, strlen(txt), &val, &len);
  } else {
    st = get_key(store, done, deadline, &val, &len);
  }
  if (st != CHORUS_OK) {
    snprintf(errmsg, cap, "%d of %d ranks joined within the timeout (%s)",
             (int)(total & JOIN_MASK), size, chorus_store_last_error(store));
    if (st == CHORUS_ERR_TIMEOUT) name_missing(store, prefix, size, errmsg, cap);
    free(val);
    return st;
  }
  char txt[32];
  long got = -1;
  snprintf(txt, sizeof txt, "%.*s", (int)CHORUS__MIN(len, sizeof txt - 1), (const char *)val);
  free(val);
  if (chorus__parse_long(txt, &got) < 0 || got < 0 || (got & JOIN_MASK) != size ||
      (got >> JOIN_BITS) > size) {
    snprintf(errmsg, cap, "'%s' holds '%s', not the count of a world of %d ranks (another "
             "world under the same prefix?)", done, txt, size);
    return CHORUS_ERR_PROTOCOL;
  }
  *votes = (int)(got >> JOIN_BITS);
  return CHORUS_OK;
}

chorus_result_t chorus__rdzv_join(chorus_store_t *store, const char *prefix, uint64_t world,
                                  int rank, int size, const char *record, int vote,
                                  int64_t deadline, int *votes, char *errmsg, size_t cap) {
  int64_t ticket = 0;
  chorus_result_t st = chorus__rdzv_join_begin(store, prefix, world, rank, size, record, vote,
                                               deadline, &ticket, errmsg, cap);
  if (st != CHORUS_OK) return st;
  return chorus__rdzv_join_end(store, prefix, world, size, ticket, deadline, votes, errmsg, cap);
}

chorus_result_t chorus__rdzv_record(chorus_store_t *store, const char *prefix, int r,
                                    int timeout_ms, int *busy, char **record, char *errmsg,
                                    size_t cap) {
  char key[512];
  snprintf(key, sizeof key, "%saddr/%d", prefix, r);
  void *val = NULL;
  size_t len = 0;
  chorus_result_t st;
  *record = NULL;
  if (busy) {
    *busy = !chorus__store_get_if_free(store, key, timeout_ms, &val, &len, &st);
    if (*busy) return CHORUS_OK;
  } else {
    st = chorus__store_get_timeout(store, key, timeout_ms, &val, &len);
  }
  if (st != CHORUS_OK) {
    snprintf(errmsg, cap, "cannot read its record '%s' from the store: %s", key,
             chorus_store_last_error(store));
    return st;
  }
  if (len > VALUE_MAX || memchr(val, '\0', len)) {
    snprintf(errmsg, cap, "its record '%s' is malformed (%zu bytes)", key, len);
    free(val);
    return CHORUS_ERR_PROTOCOL;
  }
  char *out = malloc(len + 1);
  if (!out) {
    free(val);
    snprintf(errmsg, cap, "out of memory");
    return CHORUS_ERR_NO_MEMORY;
  }
  memcpy(out, val, len);
  out[len] = '\0';
  free(val);
  *record = out;
  return CHORUS_OK;
}
