/*
 * hostlist.h - Slurm's compressed host lists ("node[01-04,07],login1",
 * "rack[1-2]n[0-3]"), as in SLURM_STEP_NODELIST and SLURM_JOB_NODELIST.
 *
 * Grammar: a list is names separated by commas outside brackets; a name is
 * text with zero or more bracket groups, each a comma-separated set of
 * numbers or ranges lo-hi (lo <= hi).  A range keeps the width of its lower
 * bound when that bound has a leading zero ("01-10" gives 01, 02, ... 10).
 * Several groups in one name expand as a product, leftmost slowest.  The
 * input comes from the environment: every length and count is bounded and a
 * malformed list is an error, never a guess.
 */
#ifndef CHORUS_UTIL_HOSTLIST_H
#define CHORUS_UTIL_HOSTLIST_H

#include <stddef.h>

#define CHORUS__HOSTLIST_MAX 1048576 /* hosts a list may name */
#define CHORUS__HOSTNAME_MAX 255     /* bytes of one host name */

/* Number of hosts in list, or -1 when it is malformed or names more than
 * CHORUS__HOSTLIST_MAX hosts. */
long chorus__hostlist_count(const char *list);

/* The n-th host (0-based) into out (NUL-terminated).  0, or -1 when the
 * list is malformed, n is out of range, or the name is longer than
 * CHORUS__HOSTNAME_MAX or does not fit in cap. */
int chorus__hostlist_nth(const char *list, long n, char *out, size_t cap);

#endif
