/*
 * names.c - the string tables of the public enums (status codes, dtypes,
 * ops, collectives) and chorus_free().  Each table is generated from the
 * X-macro in chorus.h, so the enum and its strings cannot drift apart.
 */
#include <stdlib.h>

#include "chorus.h"

int chorus_version(void) { return CHORUS_VERSION; }

const char *chorus_strerror(chorus_result_t result) {
  switch (result) {
#define X(name, value, desc)                                                    \
  case CHORUS_##name:                                                          \
    return desc;
    CHORUS_RESULT_MAP(X)
#undef X
  }
  return "unknown result code";
}

const char *chorus_result_name(chorus_result_t result) {
  switch (result) {
#define X(name, value, desc)                                                    \
  case CHORUS_##name:                                                          \
    return "CHORUS_" #name;
    CHORUS_RESULT_MAP(X)
#undef X
  }
  return "CHORUS_UNKNOWN";
}

size_t chorus_dtype_size(chorus_dtype_t dtype) {
  switch (dtype) {
#define X(NAME, name, size)                                                     \
  case CHORUS_##NAME:                                                          \
    return size;
    CHORUS_DTYPE_MAP(X)
#undef X
  default:
    return 0;
  }
}

const char *chorus_dtype_name(chorus_dtype_t dtype) {
  switch (dtype) {
#define X(NAME, name, size)                                                     \
  case CHORUS_##NAME:                                                          \
    return #name;
    CHORUS_DTYPE_MAP(X)
#undef X
  default:
    return "invalid";
  }
}

const char *chorus_op_name(chorus_op_t op) {
  switch (op) {
#define X(NAME, name)                                                           \
  case CHORUS_##NAME:                                                          \
    return #name;
    CHORUS_OP_MAP(X)
#undef X
  default:
    return "invalid";
  }
}

const char *chorus_coll_name(chorus_coll_t coll) {
  switch (coll) {
#define X(NAME, name)                                                           \
  case CHORUS_COLL_##NAME:                                                     \
    return #name;
    CHORUS_COLL_MAP(X)
#undef X
  default:
    return "invalid";
  }
}

void chorus_free(void *ptr) { free(ptr); }
