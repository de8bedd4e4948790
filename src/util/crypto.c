/*
 * crypto.c - see crypto.h.  Thin wrappers over OpenSSL 3's libcrypto.
 */
#include "crypto.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>

/* scrypt's cost for secrets chosen by people: N = 2^15, r = 8 is 32 MiB of
 * memory per derivation (128 * r * N bytes). */
#define SCRYPT_N (1u << 15)
#define SCRYPT_R 8u
#define SCRYPT_P 1u
#define SCRYPT_MAXMEM ((uint64_t)64 << 20)

static const char k_domain[] = "chorus job key v1";

int chorus__secret_is_key(const char *secret) {
  if (!secret) return 0;
  size_t n = 0;
  for (; secret[n]; n++)
    if (!isxdigit((unsigned char)secret[n])) return 0;
  return n >= 32;
}

static int derive(const char *secret, const char *salt, uint8_t out[CHORUS__KEY_LEN]) {
  size_t slen = strlen(secret), saltlen = strlen(salt);
  if (chorus__secret_is_key(secret)) {
    /* chorus__hkdf takes a 32-byte key: the secret, of any length, is
     * first condensed into one with HMAC under the domain label. */
    chorus__key_t ikm = {.set = 1};
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), k_domain, (int)sizeof k_domain - 1, (const unsigned char *)secret,
              slen, ikm.b, &len))
      return -EIO;
    int rc = chorus__hkdf(&ikm, salt, saltlen, "job key", 7, out, CHORUS__KEY_LEN);
    chorus__wipe(&ikm, sizeof ikm);
    return rc;
  }
  size_t total = sizeof k_domain + saltlen;
  unsigned char *s = malloc(total);
  if (!s) return -ENOMEM;
  memcpy(s, k_domain, sizeof k_domain); /* with its NUL: domain | 0 | salt */
  memcpy(s + sizeof k_domain, salt, saltlen);
  int ok = EVP_PBE_scrypt(secret, slen, s, total, SCRYPT_N, SCRYPT_R, SCRYPT_P, SCRYPT_MAXMEM,
                          out, CHORUS__KEY_LEN);
  free(s);
  return ok == 1 ? 0 : -EIO;
}

/* The last derivation, so a process that builds several worlds (or a store
 * client next to a world) stretches its secret once. */
static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t g_cache_in[CHORUS__MAC_LEN]; /* HMAC of secret and salt, not the secret */
static uint8_t g_cache_key[CHORUS__KEY_LEN];
static int g_cache_valid;

int chorus__job_key(const char *secret, const char *salt, chorus__key_t *key) {
  memset(key, 0, sizeof *key);
  if (!salt) salt = "";
  if (!secret || !*secret) {
    /* The insecure key: derived from the domain alone, known to anyone. */
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), k_domain, (int)sizeof k_domain - 1, (const unsigned char *)"insecure",
              8, key->b, &len))
      return -EIO;
    return 0;
  }
  /* The cache is looked up by HMAC(salt, secret): the secret itself is not
   * kept. */
  uint8_t tag[CHORUS__MAC_LEN];
  unsigned int tlen = 0;
  if (!HMAC(EVP_sha256(), salt, (int)strlen(salt), (const unsigned char *)secret, strlen(secret),
            tag, &tlen))
    return -EIO;
  pthread_mutex_lock(&g_cache_lock);
  if (g_cache_valid && CRYPTO_memcmp(tag, g_cache_in, sizeof tag) == 0) {
    memcpy(key->b, g_cache_key, sizeof key->b);
    pthread_mutex_unlock(&g_cache_lock);
    key->set = 1;
    return 0;
  }
  pthread_mutex_unlock(&g_cache_lock);
  int rc = derive(secret, salt, key->b);
  if (rc < 0) return rc;
  key->set = 1;
  pthread_mutex_lock(&g_cache_lock);
  memcpy(g_cache_in, tag, sizeof tag);
  memcpy(g_cache_key, key->b, sizeof g_cache_key);
  g_cache_valid = 1;
  pthread_mutex_unlock(&g_cache_lock);
  return 0;
}

void chorus__hmac(const chorus__key_t *key, const void *const *parts, const size_t *lens, int n,
                  uint8_t mac[CHORUS__MAC_LEN]) {
  /* The one-shot HMAC() takes one buffer; handshake messages are short. */
  uint8_t buf[512];
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    if (lens[i] > sizeof buf - off) { /* never with the callers here */
      memset(mac, 0, CHORUS__MAC_LEN);
      return;
    }
    memcpy(buf + off, parts[i], lens[i]);
    off += lens[i];
  }
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key->b, CHORUS__KEY_LEN, buf, off, mac, &len))
    memset(mac, 0, CHORUS__MAC_LEN); /* matches nothing a peer computes */
  chorus__wipe(buf, off);
}

int chorus__hkdf(const chorus__key_t *key, const void *salt, size_t salt_len, const void *info,
                 size_t info_len, uint8_t *out, size_t out_len) {
  EVP_PKEY_CTX *pc = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
  int ok = pc && EVP_PKEY_derive_init(pc) > 0 && EVP_PKEY_CTX_set_hkdf_md(pc, EVP_sha256()) > 0 &&
           EVP_PKEY_CTX_set1_hkdf_salt(pc, salt_len ? salt : (const void *)"", (int)salt_len) > 0 &&
           EVP_PKEY_CTX_set1_hkdf_key(pc, key->b, CHORUS__KEY_LEN) > 0 &&
           EVP_PKEY_CTX_add1_hkdf_info(pc, info, (int)info_len) > 0;
  size_t len = out_len;
  if (ok) ok = EVP_PKEY_derive(pc, out, &len) > 0 && len == out_len;
  EVP_PKEY_CTX_free(pc);
  return ok ? 0 : -EIO;
}

int chorus__ct_equal(const void *a, const void *b, size_t n) { return CRYPTO_memcmp(a, b, n) == 0; }

void chorus__wipe(void *p, size_t n) { OPENSSL_cleanse(p, n); }

/* ------------------------------------------------- authenticated encryption */

struct chorus__aead {
  EVP_CIPHER_CTX *ctx;
  uint32_t label;
  uint64_t counter;
  int encrypt;
};

chorus__aead_t *chorus__aead_new(const uint8_t key[32], uint32_t label, int encrypt) {
  chorus__aead_t *a = calloc(1, sizeof *a);
  if (!a) return NULL;
  a->ctx = EVP_CIPHER_CTX_new();
  a->label = label;
  a->encrypt = encrypt;
  if (!a->ctx ||
      EVP_CipherInit_ex(a->ctx, EVP_aes_256_gcm(), NULL, key, NULL, encrypt) != 1) {
    chorus__aead_free(a);
    return NULL;
  }
  return a;
}

void chorus__aead_free(chorus__aead_t *a) {
  if (!a) return;
  EVP_CIPHER_CTX_free(a->ctx);
  free(a);
}

static void make_iv(const chorus__aead_t *a, uint8_t iv[12]) {
  for (int i = 0; i < 4; i++) iv[i] = (uint8_t)(a->label >> (8 * i));
  for (int i = 0; i < 8; i++) iv[4 + i] = (uint8_t)(a->counter >> (8 * i));
}

/* Feeds len bytes through the cipher in pieces EVP's int lengths accept. */
static int update(EVP_CIPHER_CTX *ctx, uint8_t *out, const uint8_t *in, size_t len) {
  while (len > 0) {
    int piece = len > (1u << 30) ? 1 << 30 : (int)len, got = 0;
    if (EVP_CipherUpdate(ctx, out, &got, in, piece) != 1 || got != piece) return -1;
    in += piece;
    out += piece;
    len -= (size_t)piece;
  }
  return 0;
}

int chorus__aead_begin(chorus__aead_t *a, const void *aad, size_t aad_len) {
  uint8_t iv[12];
  int got = 0;
  make_iv(a, iv);
  if (EVP_CipherInit_ex(a->ctx, NULL, NULL, NULL, iv, a->encrypt) != 1) return -EIO;
  if (aad_len && EVP_CipherUpdate(a->ctx, NULL, &got, aad, (int)aad_len) != 1) return -EIO;
  return 0;
}

int chorus__aead_update(chorus__aead_t *a, const void *in, void *out, size_t len) {
  return update(a->ctx, out, in, len) < 0 ? -EIO : 0;
}

int chorus__aead_seal_end(chorus__aead_t *a, uint8_t tag[CHORUS__AEAD_TAG_LEN]) {
  uint8_t scratch[16];
  int got = 0;
  a->counter++;
  if (!a->encrypt || EVP_CipherFinal_ex(a->ctx, scratch, &got) != 1) return -EIO;
  return EVP_CIPHER_CTX_ctrl(a->ctx, EVP_CTRL_GCM_GET_TAG, CHORUS__AEAD_TAG_LEN, tag) == 1 ? 0
                                                                                          : -EIO;
}

int chorus__aead_open_end(chorus__aead_t *a, const uint8_t tag[CHORUS__AEAD_TAG_LEN]) {
  uint8_t scratch[16];
  int got = 0;
  if (a->encrypt ||
      EVP_CIPHER_CTX_ctrl(a->ctx, EVP_CTRL_GCM_SET_TAG, CHORUS__AEAD_TAG_LEN, (void *)tag) != 1)
    return -EIO;
  if (EVP_CipherFinal_ex(a->ctx, scratch, &got) != 1) return -EBADMSG;
  a->counter++;
  return 0;
}

int chorus__aead_seal(chorus__aead_t *a, const void *aad, size_t aad_len, const void *in,
                      void *out, size_t len, uint8_t tag[CHORUS__AEAD_TAG_LEN]) {
  if (!a->encrypt) return -EIO;
  int rc = chorus__aead_begin(a, aad, aad_len);
  if (rc == 0) rc = chorus__aead_update(a, in, out, len);
  if (rc == 0) rc = chorus__aead_seal_end(a, tag);
  return rc;
}

int chorus__aead_open(chorus__aead_t *a, const void *aad, size_t aad_len, const void *in,
                      void *out, size_t len, const uint8_t tag[CHORUS__AEAD_TAG_LEN]) {
  if (a->encrypt) return -EIO;
  int rc = chorus__aead_begin(a, aad, aad_len);
  if (rc == 0) rc = chorus__aead_update(a, in, out, len);
  if (rc == 0) rc = chorus__aead_open_end(a, tag);
  return rc;
}
