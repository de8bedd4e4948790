/*
 * bootstrap.h - what the files that make the world share, and no one else:
 * bootstrap.c (the secret, the world), bootstrap_env.c (the launcher's
 * environment), hostmap.c (its placement of ranks on hosts) and
 * bootstrap_kvs.c (the key-value exchange).  Private to
 * src/core/.
 */
#ifndef CHORUS_CORE_BOOTSTRAP_H
#define CHORUS_CORE_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "chorus.h"
#include "core/kvs.h"
#include "store/store.h"

/* <runtime dir>/<name> into buf: 0, or -1 with why. */
int chorus__runtime_file(const char *name, char *buf, size_t cap, char *why, size_t why_cap);

/* Makes the world from cfg, taking server (the store this rank already
 * serves, or NULL) in every case; secret_from, when not NULL, says where
 * cfg->job_secret came from, for the log; node_sizes, when not NULL, is
 * the launcher's placement its key-value service gave (hostmap.c). */
chorus_result_t chorus__world_init(const chorus_config_t *cfg, chorus_store_server_t *server,
                                   const char *secret_from, const char *node_sizes,
                                   chorus_comm_t *out);

/* host[r] for each of size ranks (equal values: one host) and how many
 * share this rank's, from the blocks the launcher placed ranks in
 * (hostmap.c; pmi_sizes: what its PMI_process_mapping said, or NULL): 1,
 * or 0 when the launcher says nothing that covers this world or this
 * rank's own place disagrees with it. */
int chorus__hostmap_from_launcher(int rank, int size, const char *pmi_sizes, uint64_t *host,
                                  int *local_count);

/* Who takes part in a key-value exchange. */
typedef struct {
  int rank, size;
  const char *source; /* the launcher, for messages */
  int one_host;       /* 1: every rank on this host (the store on 127.0.0.1) */
  const char *service; /* the key-value service, for the secret's log line */
  /* Not NULL: a fresh secret goes in a file of the runtime directory, whose
   * path this receives (rank 0 removes it once the world formed), and the
   * service carries only its name -- for services strangers may read (a
   * caller's: torch's TCPStore has no authentication). One host only. */
  char *secret_file;
  size_t secret_file_cap;
} chorus__kv_exchange_t;

/* The key-value exchange (bootstrap_kvs.c): rank 0 serves the store and
 * publishes where it is (and a fresh job secret when none is configured);
 * the others read it.  kvs is closed on every path.  On success cfg has the
 * store's host (in host) and port, and the job secret (in secret) when
 * there is one; rank 0 holds the running store in *server; from says where
 * the secret came from ("" when the world finds its own). */
chorus_result_t chorus__bootstrap_kv_exchange(const chorus__kv_exchange_t *L, chorus__kvs_t *kvs,
                                              chorus_config_t *cfg, char *host, size_t host_cap,
                                              char *secret, size_t secret_cap,
                                              chorus_store_server_t **server, int64_t deadline,
                                              char *from, size_t from_cap);

#endif
