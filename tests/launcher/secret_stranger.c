/*
 * secret_stranger.c - a stranger to a running job: connects to the job's
 * store at HOST:PORT and runs the store handshake, first with the public
 * key that CHORUS_INSECURE=1 uses (the key a world without a secret would
 * run on), then with a key of its own.  Prints one line:
 *
 *   stranger: refused at HOST:PORT (public key, own key)   exit 0
 *   stranger: ADMITTED at HOST:PORT with the <which> key    exit 1
 *   stranger: cannot test HOST:PORT: <why>                  exit 2
 *
 * Used by tests/launcher/test_bootstrap.sh and tests/python/torch/secret.py
 * while the job holds its world open (bootstrap_check's CHORUS_TEST_HOLD).
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "store_raw.h"
#include "util/crypto.h"
#include "util/clock.h"
#include "util/net.h"
#include "util/util.h"

/* The verdict of one handshake with key, or -1 when nothing answered. */
static int verdict(const char *host, int port, const chorus__key_t *key) {
  int fd = chorus__net_connect(host, port, chorus__deadline_ms(2000), 50);
  if (fd < 0) return -2;
  int v = store_raw_auth(fd, key);
  close(fd);
  return v;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: secret_stranger HOST PORT\n");
    return 2;
  }
  const char *host = argv[1];
  int port = atoi(argv[2]);
  chorus__key_t pub, own;
  uint8_t rnd[32];
  char hex[65];
  if (chorus__job_key(NULL, "", &pub) < 0 || chorus__random_bytes(rnd, sizeof rnd) < 0) {
    printf("stranger: cannot test %s:%d: no key\n", host, port);
    return 2;
  }
  chorus__hex(hex, rnd, sizeof rnd);
  if (chorus__job_key(hex, "", &own) < 0) return 2;
  const struct {
    const char *name;
    const chorus__key_t *key;
  } tries[] = {{"public", &pub}, {"own", &own}};
  for (size_t i = 0; i < sizeof tries / sizeof tries[0]; i++) {
    int v = verdict(host, port, tries[i].key);
    if (v == -2) {
      printf("stranger: cannot test %s:%d: nothing listens there\n", host, port);
      return 2;
    }
    if (v == CHORUS__STORE_HS_OK) {
      printf("stranger: ADMITTED at %s:%d with the %s key\n", host, port, tries[i].name);
      return 1;
    }
    if (v != CHORUS__STORE_HS_DENIED) {
      printf("stranger: cannot test %s:%d: the %s key's handshake ended with %d, not a "
             "verdict\n", host, port, tries[i].name, v);
      return 2;
    }
  }
  printf("stranger: refused at %s:%d (public key, own key)\n", host, port);
  return 0;
}
