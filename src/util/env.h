/*
 * env.h - the process-wide snapshot of chorus's environment variables.
 *
 * The table lives in env.def.  chorus__env() parses it once (thread-safe) and
 * returns a read-only snapshot; values that fail to parse keep their default
 * and are reported through chorus__env_errors().  Nothing else in the library
 * calls getenv() for CHORUS_* variables.
 */
#ifndef CHORUS_UTIL_ENV_H
#define CHORUS_UTIL_ENV_H

#include <stdio.h>

typedef enum { CHORUS__ENV_INT, CHORUS__ENV_STR, CHORUS__ENV_BOOL } chorus__env_type_t;

typedef struct chorus__env {
#define X(name, type, def, doc) CHORUS__ENV_FIELD_##type(name)
#define CHORUS__ENV_FIELD_INT(name) long name;
#define CHORUS__ENV_FIELD_BOOL(name) int name;
#define CHORUS__ENV_FIELD_STR(name) const char *name;
#include "env.def"
#undef X
} chorus__env_t;

/* Parsed once on first use; never NULL; never changes afterwards. */
const chorus__env_t *chorus__env(void);

/* Newline-separated parse errors ("CHORUS_TIMEOUT='x' is not an integer; using
 * 300"), or "" when every value parsed. */
const char *chorus__env_errors(void);

/* Writes "NAME=value (default: ..., doc)" lines for every variable, current
 * values from the real environment, to f.  markdown != 0 writes a table. */
void chorus__env_dump(FILE *f, int markdown);

/* Parses a strict decimal integer; returns 0 on success, -1 otherwise. */
int chorus__parse_long(const char *s, long *out);

#endif
