/*
 * kv_etcd.h - what the etcd backend's client (kv_etcd.c) and its codec
 * (kv_etcd_codec.c) share: the buffer a reply's body arrives in and the
 * codec's functions.
 */
#ifndef CHORUS_LAUNCHER_KV_ETCD_H
#define CHORUS_LAUNCHER_KV_ETCD_H

#include <jansson.h>
#include <stddef.h>

#include "launcher/launcher.h"

#define SHOWN 100 /* bytes of a bad reply quoted */

typedef struct {
  char *b;
  size_t len, cap;
  int over; /* more than REPLY_MAX arrived: the transfer was stopped */
} rbuf_t;

/* Untrusted text, at most SHOWN bytes of it, made fit to quote in out. */
const char *etcd_shown(char *out, size_t cap, const char *s, size_t n);
/* The JSON string base64(a b), or NULL (out of memory). */
json_t *etcd_b64_json(const char *a, const char *b);
/* The body as JSON, or NULL when it is not an object. */
json_t *etcd_parse_body(const rbuf_t *r, json_error_t *je);
/* The message of an error reply (etcd's "message" or "error"). */
const char *etcd_error_text(const rbuf_t *r, char *out, size_t cap);
/* The value in kvs[0] of the range reply r: 1 (*val), 0 no key, -1 (err). */
int etcd_range_of(const json_t *r, char **val, char *err, size_t cap);

#endif
