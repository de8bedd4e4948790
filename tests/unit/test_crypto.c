/*
 * test_crypto.c - the job key, HMAC, HKDF and the AEAD records
 * (src/util/crypto.c), and the secret files (src/util/secret.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "util/crypto.h"
#include "util/secret.h"

static int key_eq(const chorus__key_t *a, const chorus__key_t *b) {
  return memcmp(a->b, b->b, sizeof a->b) == 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

TEST(key_form_and_salt) {
  ASSERT_TRUE(chorus__secret_is_key("0123456789abcdef0123456789ABCDEF"));
  ASSERT_TRUE(!chorus__secret_is_key("0123456789abcdef0123456789abcde")); /* 31 digits */
  ASSERT_TRUE(!chorus__secret_is_key("0123456789abcdef0123456789abcdeg"));
  ASSERT_TRUE(!chorus__secret_is_key("correct horse battery staple"));
  const char *hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
  chorus__key_t a, b, c, d, e;
  ASSERT_EQ(chorus__job_key(hex, "job1", &a), 0);
  ASSERT_EQ(chorus__job_key(hex, "job1", &b), 0);
  ASSERT_EQ(chorus__job_key(hex, "job2", &c), 0);
  ASSERT_TRUE(a.set && key_eq(&a, &b));
  ASSERT_TRUE(!key_eq(&a, &c)); /* salted by the job id */
  /* The key is not the secret's bytes. */
  ASSERT_TRUE(memcmp(a.b, hex, sizeof a.b) != 0);
  /* Chosen secrets: stretched (scrypt), salted, deterministic. */
  ASSERT_EQ(chorus__job_key("hunter2", "job1", &d), 0);
  ASSERT_EQ(chorus__job_key("hunter2", "job2", &e), 0);
  ASSERT_TRUE(!key_eq(&d, &e));
  ASSERT_EQ(chorus__job_key("hunter2", "job1", &e), 0);
  ASSERT_TRUE(key_eq(&d, &e));
  /* The insecure key is fixed, marked unset, and no secret gives it. */
  chorus__key_t i1, i2;
  ASSERT_EQ(chorus__job_key(NULL, "", &i1), 0);
  ASSERT_EQ(chorus__job_key("", "x", &i2), 0);
  ASSERT_TRUE(!i1.set && key_eq(&i1, &i2));
  ASSERT_TRUE(!key_eq(&i1, &a) && !key_eq(&i1, &d));
}

/* Stretching must cost an attacker real time per guess: one derivation of a
 * chosen secret takes milliseconds, not nanoseconds (a fresh salt each time
 * defeats the per-process cache). */
TEST(chosen_secrets_are_stretched) {
  char salt[32];
  double t0 = now_s();
  for (int i = 0; i < 3; i++) {
    chorus__key_t k;
    snprintf(salt, sizeof salt, "stretch-%d", i);
    ASSERT_EQ(chorus__job_key("password", salt, &k), 0);
  }
  double per = (now_s() - t0) / 3;
  printf("  scrypt derivation: %.1f ms\n", per * 1e3);
  ASSERT_TRUE(per > 0.005);
}

TEST(hmac_and_hkdf) {
  chorus__key_t k = {.set = 1};
  memset(k.b, 0x42, sizeof k.b);
  uint8_t m1[CHORUS__MAC_LEN], m2[CHORUS__MAC_LEN], m3[CHORUS__MAC_LEN];
  const void *p1[2] = {"ab", "cd"};
  size_t l1[2] = {2, 2};
  const void *p2[1] = {"abcd"};
  size_t l2[1] = {4};
  chorus__hmac(&k, p1, l1, 2, m1);
  chorus__hmac(&k, p2, l2, 1, m2);
  ASSERT_TRUE(memcmp(m1, m2, sizeof m1) == 0); /* parts are concatenated */
  k.b[0] ^= 1;
  chorus__hmac(&k, p2, l2, 1, m3);
  ASSERT_TRUE(memcmp(m1, m3, sizeof m1) != 0);
  ASSERT_TRUE(chorus__ct_equal(m1, m2, sizeof m1));
  ASSERT_TRUE(!chorus__ct_equal(m1, m3, sizeof m1));
  uint8_t o1[64], o2[64];
  ASSERT_EQ(chorus__hkdf(&k, "salt", 4, "info", 4, o1, sizeof o1), 0);
  ASSERT_EQ(chorus__hkdf(&k, "salt", 4, "infp", 4, o2, sizeof o2), 0);
  ASSERT_TRUE(memcmp(o1, o2, sizeof o1) != 0);
}

TEST(aead_records) {
  uint8_t key[32];
  for (int i = 0; i < 32; i++) key[i] = (uint8_t)i;
  chorus__aead_t *tx = chorus__aead_new(key, 7, 1), *rx = chorus__aead_new(key, 7, 0);
  ASSERT_TRUE(tx && rx);
  char msg[3000], enc[3000], dec[3000];
  uint8_t tag[CHORUS__AEAD_TAG_LEN], aad[4] = {1, 2, 3, 4};
  for (size_t i = 0; i < sizeof msg; i++) msg[i] = (char)(i * 7);
  /* Three records in order open; the ciphertext is not the plaintext. */
  for (int r = 0; r < 3; r++) {
    ASSERT_EQ(chorus__aead_seal(tx, aad, sizeof aad, msg, enc, sizeof msg, tag), 0);
    ASSERT_TRUE(memcmp(enc, msg, sizeof msg) != 0);
    ASSERT_EQ(chorus__aead_open(rx, aad, sizeof aad, enc, dec, sizeof msg, tag), 0);
    ASSERT_TRUE(memcmp(dec, msg, sizeof msg) == 0);
  }
  /* A flipped bit, a changed length field (aad) or a replayed record fail. */
  ASSERT_EQ(chorus__aead_seal(tx, aad, sizeof aad, msg, enc, sizeof msg, tag), 0);
  enc[100] ^= 4;
  ASSERT_EQ(chorus__aead_open(rx, aad, sizeof aad, enc, dec, sizeof msg, tag), -EBADMSG);
  chorus__aead_free(rx);
  chorus__aead_free(tx);
  /* Replay: the same record twice. */
  tx = chorus__aead_new(key, 1, 1);
  rx = chorus__aead_new(key, 1, 0);
  ASSERT_EQ(chorus__aead_seal(tx, aad, sizeof aad, msg, enc, 64, tag), 0);
  ASSERT_EQ(chorus__aead_open(rx, aad, sizeof aad, enc, dec, 64, tag), 0);
  ASSERT_EQ(chorus__aead_open(rx, aad, sizeof aad, enc, dec, 64, tag), -EBADMSG);
  /* Changed associated data. */
  ASSERT_EQ(chorus__aead_seal(tx, aad, sizeof aad, msg, enc, 64, tag), 0);
  aad[0] ^= 1;
  ASSERT_EQ(chorus__aead_open(rx, aad, sizeof aad, enc, dec, 64, tag), -EBADMSG);
  /* The other direction's label does not open it. */
  chorus__aead_t *other = chorus__aead_new(key, 2, 0);
  aad[0] ^= 1;
  ASSERT_EQ(chorus__aead_seal(tx, aad, sizeof aad, msg, enc, 64, tag), 0);
  ASSERT_EQ(chorus__aead_open(other, aad, sizeof aad, enc, dec, 64, tag), -EBADMSG);
  chorus__aead_free(other);
  chorus__aead_free(rx);
  chorus__aead_free(tx);
}

TEST(secret_files) {
  char dir[4096], why[600], buf[256], path[4200];
  ASSERT_EQ(chorus__runtime_dir(dir, sizeof dir, why, sizeof why), 0);
  struct stat sb;
  ASSERT_EQ(stat(dir, &sb), 0);
  ASSERT_EQ(sb.st_mode & 0777, 0700);
  snprintf(path, sizeof path, "%s/test-crypto-%d.key", dir, (int)getpid());
  char secret[65];
  ASSERT_EQ(chorus__secret_generate(secret, sizeof secret), 0);
  ASSERT_EQ(strlen(secret), 64);
  ASSERT_TRUE(chorus__secret_is_key(secret));
  ASSERT_EQ(chorus__secret_write_file(path, secret), 0);
  ASSERT_EQ(stat(path, &sb), 0);
  ASSERT_EQ(sb.st_mode & 0777, 0600);
  ASSERT_EQ(chorus__secret_read_file(path, buf, sizeof buf, why, sizeof why), 0);
  ASSERT_STREQ(buf, secret);
  /* Readable by others: refused, with the reason. */
  ASSERT_EQ(chmod(path, 0644), 0);
  ASSERT_EQ(chorus__secret_read_file(path, buf, sizeof buf, why, sizeof why), -EPERM);
  ASSERT_CONTAINS(why, "chmod 600");
  unlink(path);
  ASSERT_EQ(chorus__secret_read_file(path, buf, sizeof buf, why, sizeof why), -ENOENT);
  /* An empty file is not a secret. */
  int fd = open(path, O_CREAT | O_WRONLY, 0600);
  ASSERT_TRUE(fd >= 0);
  close(fd);
  ASSERT_EQ(chorus__secret_read_file(path, buf, sizeof buf, why, sizeof why), -EINVAL);
  unlink(path);
}

/* The environment variable is taken once and erased from the process. */
TEST(env_secret_is_erased) {
  char buf[256], why[256];
  ASSERT_EQ(chorus__secret_configured(buf, sizeof buf, why, sizeof why), 1);
  ASSERT_STREQ(buf, "env-secret-for-the-test");
  ASSERT_TRUE(getenv("CHORUS_JOB_SECRET") == NULL);
  /* /proc/self/environ is the original block: overwritten in place. */
  FILE *f = fopen("/proc/self/environ", "r");
  ASSERT_TRUE(f != NULL);
  char all[65536];
  size_t n = fread(all, 1, sizeof all - 1, f);
  fclose(f);
  all[n] = '\0';
  int found = 0;
  for (size_t i = 0; i + 23 <= n; i++)
    if (!memcmp(all + i, "env-secret-for-the-test", 23)) found = 1;
  ASSERT_TRUE(!found);
}

int main(int argc, char **argv) {
  /* Re-run ourselves with the secret in the environment block given at
   * exec, the way a launcher passes it. */
  if (argc < 2 || strcmp(argv[1], "--child")) {
    setenv("CHORUS_JOB_SECRET", "env-secret-for-the-test", 1);
    execl("/proc/self/exe", argv[0], "--child", (char *)NULL);
    perror("exec");
    return 1;
  }
  RUN(key_form_and_salt);
  RUN(chosen_secrets_are_stretched);
  RUN(hmac_and_hkdf);
  RUN(aead_records);
  RUN(secret_files);
  RUN(env_secret_is_erased);
  return HARNESS_DONE();
}
