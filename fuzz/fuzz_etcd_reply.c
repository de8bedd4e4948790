/*
 * fuzz_etcd_reply - what chorusrun's etcd client makes of a reply body
 * (src/launcher/kv_etcd_codec.c): jansson's strict parse of the whole body,
 * then the value of a /v3/kv/range reply (kvs[0].value, canonical base64, no
 * NUL byte).  The HTTP around the body is libcurl's.
 *
 * The input is the body.  Requirements: 1 comes with a NUL-terminated value
 * that is valid base64 of itself (it is re-encoded and must decode the same
 * way: no NUL inside), 0 and -1 with no value, -1 with a reason.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "launcher/launcher.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *val = NULL, err[256] = "";
  int rc = kv_etcd__range_reply((const char *)data, size, &val, err, sizeof err);
  FUZZ_REQUIRE(rc >= -1 && rc <= 1);
  if (rc == 1) {
    FUZZ_REQUIRE(val != NULL);
    size_t n = strlen(val);
    /* The decoded value sits somewhere in the input as base64 of n bytes:
     * at least (n + 2) / 3 * 4 input bytes. */
    FUZZ_REQUIRE((n + 2) / 3 * 4 <= size);
  } else {
    FUZZ_REQUIRE(val == NULL);
    if (rc < 0) FUZZ_REQUIRE(err[0] != '\0');
  }
  free(val);
  return 0;
}
