/*
 * kvs.h - the launcher's key-value service, where one exists: how a world
 * started by srun or mpirun passes rank 0's store address (and, when no
 * secret was configured, a fresh job secret) to every rank without a
 * MASTER_ADDR and without guessing a free port.
 *
 * Two services, chosen by what the launcher left in the environment:
 *   - PMI-1's wire protocol over the socket in PMI_FD: MPICH's hydra
 *     (mpiexec), and Slurm's `srun --mpi=pmi2` (whose PMI-2 server also
 *     speaks PMI-1).  Implemented here over the descriptor, no library.
 *   - PMIx (PMIX_NAMESPACE and PMIX_RANK set): Open MPI's mpirun and
 *     `srun --mpi=pmix`.  libpmix is loaded with dlopen() on first use, so
 *     libchorus does not depend on it; built only where its headers were
 *     found (CHORUS_HAVE_PMIX).
 * Both are private to the job: only the launcher's processes hold the
 * descriptor or the PMIx server's credentials, which is why a secret may
 * travel through them.
 *
 * The use is one exchange: rank 0 puts, everyone fences, the others get.
 * Every call is bounded by the deadline (PMI-1: poll on the socket; PMIx:
 * its timeout attribute).  Replies are untrusted: lines are bounded and
 * parsed field by field, values are length-checked.
 */
#ifndef CHORUS_CORE_KVS_H
#define CHORUS_CORE_KVS_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"

#define CHORUS__KVS_VALUE_MAX 512 /* bytes of one value we put or accept */

typedef struct chorus__kvs chorus__kvs_t;

/* Which service this process's environment offers: "PMI-1 (PMI_FD)",
 * "PMIx", or NULL when none (a PMIx environment without libpmix counts as
 * none; *why then says so). */
const char *chorus__kvs_available(char *why, size_t cap);

/* Connects to the service as the launcher's rank `rank`.  CHORUS_OK, or
 * an error with err filled. */
chorus_result_t chorus__kvs_open(chorus__kvs_t **out, int rank, int64_t deadline, char *err,
                                 size_t cap);

/* The caller's own service (chorus_comm_init_kv): put is its set, get its
 * waiting get, the fence a no-op.  kv is copied. */
chorus_result_t chorus__kvs_wrap(chorus__kvs_t **out, const chorus_kv_t *kv, int rank);

/* Publishes key=value (value: printable ASCII without spaces or '=',
 * at most CHORUS__KVS_VALUE_MAX bytes). */
chorus_result_t chorus__kvs_put(chorus__kvs_t *kvs, const char *key, const char *value,
                                int64_t deadline, char *err, size_t cap);

/* Commits what this process put and waits until every process of the job
 * did the same (a collective: every rank must call it). */
chorus_result_t chorus__kvs_fence(chorus__kvs_t *kvs, int64_t deadline, char *err, size_t cap);

/* The value rank `from` put under key (after the fence), into value. */
chorus_result_t chorus__kvs_get(chorus__kvs_t *kvs, int from, const char *key, char *value,
                                size_t value_cap, int64_t deadline, char *err, size_t cap);

/* PMI-1 only: the launcher's placement of ranks on nodes, from its
 * PMI_process_mapping ("(vector,(0,2,4))": from node 0, 2 nodes of 4 ranks)
 * as CHORUS_NODE_SIZES writes it ("4x2"), when each node's ranks follow
 * each other.  CHORUS_OK with spec set, else an error (no such key, a
 * mapping of another shape: the caller goes without). */
chorus_result_t chorus__kvs_node_sizes(chorus__kvs_t *kvs, int size, char *spec, size_t cap,
                                       int64_t deadline);
/* The conversion for a world of size ranks: the mapping's pattern repeats
 * until every rank has a node; 0 when each node's ranks follow each other,
 * with spec its runs ("(vector,(0,2,2))": "2x2"; (0,1,1): every rank on
 * one node), else -1. */
int chorus__pmi_mapping_sizes(const char *mapping, int size, char *spec, size_t cap);

/* Says goodbye to the service (the launcher then knows we are done with
 * it) and frees kvs.  NULL is fine. */
void chorus__kvs_close(chorus__kvs_t *kvs, int64_t deadline);

#endif
