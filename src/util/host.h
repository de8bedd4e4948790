/*
 * host.h - which processes share a machine.
 *
 * Two processes may share memory (and so use the shared-memory channel)
 * when their identity strings are equal: host name, kernel boot id and
 * network namespace.  The namespace is part of it because a separate
 * network namespace is what a container or an emulated host
 * (tests/fixtures/netns.sh) is made of: processes there are on "another
 * host" as far as the job's topology goes, even when /dev/shm happens to be
 * shared.
 */
#ifndef CHORUS_UTIL_HOST_H
#define CHORUS_UTIL_HOST_H

#include <stddef.h>

/* "hostname boot-id net:[inode]" into buf (truncated to cap). */
void chorus__host_identity(char *buf, size_t cap);

/* 8 lowercase hex digits (a hash of the identity) into tag[9]: shared-memory
 * names carry it, so a launcher removes only its own host's leftovers. */
void chorus__host_tag(char tag[9]);

#endif
