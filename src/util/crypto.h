/*
 * crypto.h - the job key and what is built on it: key derivation, message
 * authentication and authenticated encryption, all from OpenSSL's libcrypto
 * (Debian's libssl-dev).  Nothing here is hand-rolled.
 *
 * The job key.  Every process of a job derives the same 32-byte key from the
 * job secret (docs/security.md says where the secret comes from):
 *   - a secret of at least 32 hex digits (what chorusrun and the per-user
 *     runtime file make: 128+ random bits) is already a key; HKDF-SHA256
 *     maps it to the job key;
 *   - any other secret was chosen by a person and may be guessable: it is
 *     stretched with scrypt (N = 2^15, r = 8, p = 1: 32 MiB and about 0.1 s
 *     once per process), salted with the job id, so a sniffed handshake
 *     costs an attacker that much per guess and tables cannot be shared
 *     between jobs.
 * Connections then prove knowledge of the key with HMAC-SHA256 over fresh
 * nonces from both sides (store.h, tcp_handshake.c), and CHORUS_ENCRYPT derives per
 * connection AES-256-GCM keys from the key and both nonces with HKDF.
 */
#ifndef CHORUS_UTIL_CRYPTO_H
#define CHORUS_UTIL_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

#define CHORUS__KEY_LEN 32
#define CHORUS__MAC_LEN 32
#define CHORUS__NONCE_LEN 32

typedef struct chorus__key {
  uint8_t b[CHORUS__KEY_LEN];
  int set; /* 0: no key (an insecure job, see chorus__job_key) */
} chorus__key_t;

/* Derives the job key from secret, salted with salt (the job id; "" when
 * there is none).  A NULL or empty secret gives the well-known insecure
 * key, which only CHORUS_INSECURE=1 may use (the caller decides).  The
 * result is remembered per process for the last (secret, salt) pair, so the
 * stretching is paid once.  Returns 0 or -ENOMEM / -EIO (libcrypto). */
int chorus__job_key(const char *secret, const char *salt, chorus__key_t *key);

/* 1 when secret is used as a key as it is (32 or more hex digits). */
int chorus__secret_is_key(const char *secret);

/* HMAC-SHA256 under key of the concatenation of n parts. */
void chorus__hmac(const chorus__key_t *key, const void *const *parts, const size_t *lens, int n,
                  uint8_t mac[CHORUS__MAC_LEN]);

/* HKDF-SHA256: out_len bytes from key, salt and info.  Returns 0 or -EIO. */
int chorus__hkdf(const chorus__key_t *key, const void *salt, size_t salt_len, const void *info,
                 size_t info_len, uint8_t *out, size_t out_len);

/* Constant-time comparison of n bytes: 1 when equal. */
int chorus__ct_equal(const void *a, const void *b, size_t n);

/* Overwrites n bytes in a way the compiler cannot drop. */
void chorus__wipe(void *p, size_t n);

/* ------------------------------------------------- authenticated encryption
 *
 * AES-256-GCM, one direction of one connection.  The 96-bit nonce is a
 * 32-bit direction label and a 64-bit message counter, so no nonce repeats
 * under one key (a connection's keys are fresh per handshake); a record
 * whose tag does not verify, or that arrives out of order, fails. */
#define CHORUS__AEAD_TAG_LEN 16
typedef struct chorus__aead chorus__aead_t;

/* key: 32 bytes; encrypt: 1 to seal, 0 to open.  NULL when out of memory. */
chorus__aead_t *chorus__aead_new(const uint8_t key[32], uint32_t label, int encrypt);
void chorus__aead_free(chorus__aead_t *a);
/* A record in pieces: begin (with the associated data), update as often as
 * needed (in place allowed), then seal_end writes the tag, or open_end
 * checks it (-EBADMSG when the record was altered, reordered or not made
 * with this key; the plaintext already written must then be discarded).
 * Each record uses the next counter value. */
int chorus__aead_begin(chorus__aead_t *a, const void *aad, size_t aad_len);
int chorus__aead_update(chorus__aead_t *a, const void *in, void *out, size_t len);
int chorus__aead_seal_end(chorus__aead_t *a, uint8_t tag[CHORUS__AEAD_TAG_LEN]);
int chorus__aead_open_end(chorus__aead_t *a, const uint8_t tag[CHORUS__AEAD_TAG_LEN]);

/* Seals len bytes of in (in place allowed) with aad into out and tag.
 * Returns 0 or -EIO. */
int chorus__aead_seal(chorus__aead_t *a, const void *aad, size_t aad_len, const void *in,
                      void *out, size_t len, uint8_t tag[CHORUS__AEAD_TAG_LEN]);
/* Opens what seal made with the next counter; -EBADMSG when the record was
 * altered, reordered or not made with this key. */
int chorus__aead_open(chorus__aead_t *a, const void *aad, size_t aad_len, const void *in,
                      void *out, size_t len, const uint8_t tag[CHORUS__AEAD_TAG_LEN]);

#endif
