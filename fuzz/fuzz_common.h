/*
 * fuzz_common.h - what the harnesses share: a requirement that aborts (so
 * libFuzzer reports it as a crash, whatever NDEBUG says), the environment
 * every harness sets before the library reads it, and the job key.
 */
#ifndef CHORUS_FUZZ_COMMON_H
#define CHORUS_FUZZ_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#include "util/crypto.h"

#define FUZZ_REQUIRE(cond)                                                           \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "%s:%d: requirement failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                       \
    }                                                                                \
  } while (0)

/* 64 hex digits: used as a key as it is (HKDF, no scrypt). */
#define FUZZ_SECRET "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
#define FUZZ_WORLD_ID UINT64_C(0x6368727573667a7a)

/* The library reads CHORUS_* once (util/env.c): set before its first use.
 * Warnings about the fuzzer's garbage still get formatted (that code runs)
 * but go to /dev/null; set CHORUS_LOG_FILE yourself to see them. */
static inline void fuzz_env_init(void) {
  setenv("CHORUS_LOG_FILE", "/dev/null", 0);
  setenv("CHORUS_LOG_LEVEL", "DEBUG", 0);
}

static inline void fuzz_job_key(chorus__key_t *key) {
  if (chorus__job_key(FUZZ_SECRET, "", key) != 0 || !key->set) {
    fprintf(stderr, "fuzz: cannot derive the job key (libcrypto)\n");
    abort();
  }
}

#endif
