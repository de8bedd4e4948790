/*
 * kv_etcd_codec.c - the etcd backend's codec: base64 as etcd's JSON gateway
 * writes keys and values, and the JSON of its replies (a strict parse of the
 * whole body, an error reply's message, the value of a /v3/kv/range reply),
 * apart from the client that sends the requests (kv_etcd.c).  Every reply is
 * untrusted: the body must be one JSON object, values strict base64 without
 * a NUL byte.  fuzz/fuzz_etcd_reply.c fuzzes it through kv_etcd__range_reply.
 */
#include "launcher/kv_etcd.h"

#include <openssl/evp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/util.h"

/* Copies up to SHOWN bytes of untrusted text for a message: anything not
 * printable ASCII (or a double quote) becomes '?', "..." marks a cut. */
const char *etcd_shown(char *out, size_t cap, const char *s, size_t n) {
  size_t o = 0, lim = CHORUS__MIN(n, (size_t)SHOWN);
  for (size_t i = 0; i < lim && o + 4 < cap; i++) {
    unsigned char c = (unsigned char)s[i];
    out[o++] = c >= 0x20 && c < 0x7f && c != '"' ? (char)c : '?';
  }
  if (n > lim && o + 4 < cap) {
    memcpy(out + o, "...", 3);
    o += 3;
  }
  out[o] = '\0';
  return out;
}

/* ---------------------------------------------------------------- base64
 * Encoding by libcrypto; decoding here, because EVP_DecodeBlock skips
 * whitespace and does not check padding or unused bits, and a value that
 * is not exactly what etcd writes is a malformed reply. */

static int b64_val(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* Decodes canonical padded base64 into out (room for n / 4 * 3 bytes): the
 * length, or -1 (length, alphabet, padding, unused bits). */
static long b64_decode(const char *s, size_t n, unsigned char *out) {
  if (n % 4) return -1;
  size_t o = 0;
  for (size_t i = 0; i < n; i += 4) {
    int pad = 0, v[4];
    for (int j = 0; j < 4; j++) {
      unsigned char c = (unsigned char)s[i + j];
      if (c == '=' && i + 4 == n && j >= 2) {
        if (j == 2 && s[i + 3] != '=') return -1;
        v[j] = 0;
        pad++;
        continue;
      }
      if (pad || (v[j] = b64_val(c)) < 0) return -1;
    }
    uint32_t x = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
    if ((pad == 1 && (x & 0xff)) || (pad == 2 && (x & 0xffff))) return -1;
    out[o++] = (unsigned char)(x >> 16);
    if (pad < 2) out[o++] = (unsigned char)(x >> 8);
    if (pad < 1) out[o++] = (unsigned char)x;
  }
  return (long)o;
}

/* The JSON string base64(a b), or NULL (out of memory). */
json_t *etcd_b64_json(const char *a, const char *b) {
  size_t al = strlen(a), bl = strlen(b), n = al + bl;
  unsigned char *raw = malloc(n + 1);
  char *enc = malloc((n + 2) / 3 * 4 + 1);
  json_t *j = NULL;
  if (raw && enc) {
    memcpy(raw, a, al);
    memcpy(raw + al, b, bl);
    int el = EVP_EncodeBlock((unsigned char *)enc, raw, (int)n);
    j = json_stringn(enc, (size_t)el);
  }
  free(raw);
  free(enc);
  return j;
}

/* -------------------------------------------------------------- replies */

/* The body as JSON, or NULL when it is not an object. */
json_t *etcd_parse_body(const rbuf_t *r, json_error_t *je) {
  json_t *root = json_loadb(r->len ? r->b : "", r->len, JSON_REJECT_DUPLICATES, je);
  if (root && !json_is_object(root)) {
    snprintf(je->text, sizeof je->text, "not an object");
    json_decref(root);
    root = NULL;
  }
  return root;
}

/* The message of an error reply: etcd's "message" (or "error") when the
 * body is JSON with one, else the body's beginning. */
const char *etcd_error_text(const rbuf_t *r, char *out, size_t cap) {
  json_error_t je;
  json_t *root = etcd_parse_body(r, &je);
  json_t *m = root ? json_object_get(root, "message") : NULL;
  if (!json_is_string(m) && root) m = json_object_get(root, "error");
  if (json_is_string(m))
    etcd_shown(out, cap, json_string_value(m), json_string_length(m));
  else
    etcd_shown(out, cap, r->len ? r->b : "", r->len);
  json_decref(root);
  return out;
}

/* The value in kvs[0] of the range reply r: 1 (*val), 0 no key, -1 with err. */
int etcd_range_of(const json_t *r, char **val, char *err, size_t cap) {
  *val = NULL;
  json_t *kvs = json_object_get(r, "kvs"), *kv0 = json_array_get(kvs, 0);
  if (!kvs) return 0;
  if (!json_is_array(kvs) || (json_array_size(kvs) && !json_is_object(kv0))) {
    snprintf(err, cap, "kvs is not a list of objects");
    return -1;
  }
  if (json_array_size(kvs) == 0) return 0;
  json_t *v = json_object_get(kv0, "value");
  if (!v) { /* left out: empty */
    *val = calloc(1, 1);
    if (!*val) snprintf(err, cap, "out of memory");
    return *val ? 1 : -1;
  }
  if (!json_is_string(v)) {
    snprintf(err, cap, "the value is not a string");
    return -1;
  }
  size_t len = json_string_length(v);
  unsigned char *out = malloc(len / 4 * 3 + 1);
  long vl = out ? b64_decode(json_string_value(v), len, out) : -1;
  if (vl < 0 || memchr(out, '\0', (size_t)vl)) {
    snprintf(err, cap, "%s",
             !out     ? "out of memory"
             : vl < 0 ? "the value is not valid base64"
                      : "the value is not text (a NUL byte inside): not chorusrun's");
    free(out);
    return -1;
  }
  out[vl] = '\0';
  *val = (char *)out;
  return 1;
}

int kv_etcd__range_reply(const char *body, size_t n, char **val, char *err, size_t cap) {
  rbuf_t r = {.b = (char *)body, .len = n};
  json_error_t je;
  json_t *root = etcd_parse_body(&r, &je);
  *val = NULL;
  if (!root) {
    snprintf(err, cap, "malformed JSON (%s)", je.text);
    return -1;
  }
  int rc = etcd_range_of(root, val, err, cap);
  json_decref(root);
  return rc;
}
