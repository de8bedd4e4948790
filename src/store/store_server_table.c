/*
 * store_server_table.c - the store server's hash tables: the keys (a chained
 * table keyed by SipHash under the server's random key, which keeps the
 * count of entries and of stored bytes that CHORUS_STORE_KEYS_MAX and
 * CHORUS_STORE_DATA_MAX bound, and wakes a key's waiters when it is set),
 * and the open connections counted per address
 * (CHORUS_STORE_CONNS_PER_ADDR).
 */
#include "store_server.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* ------------------------------------------------------------ hash table */

static entry_t **bucket_of(chorus_store_server_t *srv, uint64_t hash) {
  return &srv->buckets[hash & (srv->nbuckets - 1)];
}

entry_t *chorus__store_table_find(chorus_store_server_t *srv, const uint8_t *key, size_t klen) {
  uint64_t h = chorus__siphash(srv->hash_key, key, klen);
  for (entry_t *e = *bucket_of(srv, h); e; e = e->next)
    if (e->hash == h && e->klen == klen && !memcmp(e->key, key, klen)) return e;
  return NULL;
}

/* Doubles the bucket array; on allocation failure keeps the old one (longer
 * chains are slower, not wrong). */
static void table_grow(chorus_store_server_t *srv) {
  size_t n = srv->nbuckets * 2;
  entry_t **b = calloc(n, sizeof *b);
  if (!b) return;
  for (size_t i = 0; i < srv->nbuckets; i++) {
    entry_t *e = srv->buckets[i];
    while (e) {
      entry_t *next = e->next;
      entry_t **slot = &b[e->hash & (n - 1)];
      e->next = *slot;
      *slot = e;
      e = next;
    }
  }
  free(srv->buckets);
  srv->buckets = b;
  srv->nbuckets = n;
}

/* Returns the entry for key, adding an absent one if needed; NULL when memory
 * is short. */
entry_t *chorus__store_table_find_or_add(chorus_store_server_t *srv, const uint8_t *key,
                                         size_t klen) {
  entry_t *e = chorus__store_table_find(srv, key, klen);
  if (e) return e;
  e = calloc(1, sizeof *e + klen);
  if (!e) return NULL;
  e->hash = chorus__siphash(srv->hash_key, key, klen);
  e->klen = klen;
  if (klen) memcpy(e->key, key, klen);
  list_init(&e->waiters);
  if (srv->nentries >= srv->nbuckets) table_grow(srv);
  entry_t **slot = bucket_of(srv, e->hash);
  e->next = *slot;
  *slot = e;
  srv->nentries++;
  return e;
}

static void table_remove(chorus_store_server_t *srv, entry_t *e) {
  for (entry_t **p = bucket_of(srv, e->hash); *p; p = &(*p)->next) {
    if (*p == e) {
      *p = e->next;
      break;
    }
  }
  if (e->present) {
    srv->npresent--;
    srv->data_bytes -= e->klen + e->vlen;
  }
  srv->nentries--;
  free(e->val);
  free(e);
}

/* Removes an entry that is neither present nor waited for. */
void chorus__store_entry_maybe_drop(chorus_store_server_t *srv, entry_t *e) {
  if (!e->present && list_empty(&e->waiters)) table_remove(srv, e);
}

/* Stores a copy of val at e and wakes every connection waiting for it.
 * Returns 0, or -1 when memory is short (e is then unchanged). */
int chorus__store_entry_store(chorus_store_server_t *srv, entry_t *e, const void *val,
                              size_t vlen) {
  uint8_t *copy = malloc(vlen ? vlen : 1);
  if (!copy) return -1;
  if (vlen) memcpy(copy, val, vlen);
  if (e->present) srv->data_bytes -= e->klen + e->vlen;
  srv->data_bytes += e->klen + vlen;
  free(e->val);
  e->val = copy;
  e->vlen = vlen;
  if (!e->present) {
    e->present = 1;
    srv->npresent++;
  }
  while (!list_empty(&e->waiters)) {
    conn_t *c = CONTAINER_OF(e->waiters.next, conn_t, wait_link);
    list_remove(&c->wait_link);
    c->waiting_on = NULL;
    c->ready = 1;
    list_push_back(&srv->ready, &c->wait_link);
  }
  return 0;
}

void chorus__store_table_free(chorus_store_server_t *srv) {
  for (size_t i = 0; srv->buckets && i < srv->nbuckets; i++) {
    entry_t *e = srv->buckets[i];
    while (e) {
      entry_t *next = e->next;
      free(e->val);
      free(e);
      e = next;
    }
  }
  free(srv->buckets);
  srv->buckets = NULL;
}

/* ----------------------------------------------------- per-address counts */

/* The count of host, added at 0 if needed; NULL when memory is short. */
addr_count_t *chorus__store_addr_get(chorus_store_server_t *srv, const char *host) {
  size_t len = strlen(host);
  uint64_t h = chorus__siphash(srv->hash_key, host, len);
  addr_count_t **slot = &srv->addrs[h % ADDR_BUCKETS];
  for (addr_count_t *a = *slot; a; a = a->next)
    if (a->hash == h && !strcmp(a->host, host)) return a;
  addr_count_t *a = calloc(1, sizeof *a);
  if (!a) return NULL;
  a->hash = h;
  snprintf(a->host, sizeof a->host, "%s", host);
  a->next = *slot;
  *slot = a;
  return a;
}

/* Forgets a count that has dropped to zero. */
void chorus__store_addr_maybe_drop(chorus_store_server_t *srv, addr_count_t *a) {
  if (a->n > 0) return;
  for (addr_count_t **p = &srv->addrs[a->hash % ADDR_BUCKETS]; *p; p = &(*p)->next) {
    if (*p == a) {
      *p = a->next;
      break;
    }
  }
  free(a);
}

void chorus__store_addrs_free(chorus_store_server_t *srv) {
  for (size_t i = 0; i < ADDR_BUCKETS; i++) {
    while (srv->addrs[i]) {
      addr_count_t *a = srv->addrs[i];
      srv->addrs[i] = a->next;
      free(a);
    }
  }
}
