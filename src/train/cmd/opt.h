/* opt.h - strict option values for chorus-train and chorus-data.
 *
 * Every function takes the program's name, the option as the user wrote it
 * ("--batch") and its value; it stores the parsed value and returns 0, or
 * prints one line that names the program, the option, the value and what
 * the option takes ("chorus-train: --batch 0: out of range; it takes a
 * whole number from 1 to 65536") and returns -1.  A value is taken whole:
 * "12abc", "", " 3", "1e3" for a whole number and "nan" are refused. */
#ifndef CHORUS_CMD_OPT_H
#define CHORUS_CMD_OPT_H

#include <stdint.h>

/* A whole number in [lo, hi]. */
int opt_int(const char *prog, const char *opt, const char *val, long lo, long hi, int *out);
int opt_long(const char *prog, const char *opt, const char *val, long long lo, long long hi,
             long long *out);
/* An unsigned 64-bit whole number (any). */
int opt_u64(const char *prog, const char *opt, const char *val, uint64_t *out);
/* A finite number in [lo, hi]; with lo_open, lo itself is refused. */
int opt_double(const char *prog, const char *opt, const char *val, double lo, int lo_open,
               double hi, double *out);
int opt_float(const char *prog, const char *opt, const char *val, double lo, int lo_open,
              double hi, float *out);
/* One of the words in `words` ("none|bf16|fp16"): *out is its index. */
int opt_choice(const char *prog, const char *opt, const char *val, const char *words, int *out);
/* A byte count: a number with an optional K, M, G (or KiB, MiB, GiB), above 0. */
int opt_bytes(const char *prog, const char *opt, const char *val, uint64_t *out);
/* "A:B": two whole numbers, A in [alo, ahi] and B in [blo, bhi]. */
int opt_pair(const char *prog, const char *opt, const char *val, const char *form, long alo,
             long ahi, long blo, long bhi, int *a, int *b);
/* For getopt_long called with an option string that starts with ':' and
 * opterr 0: c is what it returned, ':' (the option before optind lacks its
 * value) or '?' (not an option); says so in one line, and where the
 * options are listed. */
void opt_getopt_error(const char *prog, int c, char *const *argv);
/* "PROG --help lists the options" */
void opt_see_help(const char *prog);

#endif
