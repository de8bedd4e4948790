/*
 * error.c - libchorus-train's error recorder: the reason of the last
 * failure on this thread, which chorus_train_last_error() returns.  Every
 * file of the runtime records a failure with chorus__train_fail
 * (runtime.h) and returns its code.
 */
#include <stdarg.h>
#include <stdio.h>

#include "chorus_train.h"
#include "train/runtime.h"

static __thread char g_err[512];

const char *chorus_train_last_error(void) { return g_err; }

chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return st;
}
