/*
 * bootstrap_env.c - the world from the environment a launcher left
 * (chorus_comm_init_env): who this process is (torchrun's variables, Open
 * MPI's, a PMI launcher's, Slurm's) and where the store is.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "core/comm.h"
#include "core/kvs.h"
#include "store/store.h"
#include "util/clock.h"
#include "util/crypto.h"
#include "util/env.h"
#include "util/hostlist.h"
#include "util/net.h"
#include "util/secret.h"
#include "util/util.h"

/* ----------------------------------------------- the launcher's environment
 *
 * chorus_comm_init_env() finds who this process is from the first of:
 *   1. RANK and WORLD_SIZE (torchrun's contract: chorusrun, torchrun, by
 *      hand) -- explicit values always win;
 *   2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE;
 *   3. a PMI-1 launcher: PMI_RANK and PMI_SIZE with PMI_FD (MPICH's hydra,
 *      `srun --mpi=pmi2`), MPI_LOCALRANKID/MPI_LOCALNRANKS or Slurm's
 *      variables for the node-local part;
 *   4. Slurm's srun: SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
 *      SLURM_NODEID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE -- only
 *      in a task that srun started (SLURM_STEP_ID set and SLURM_TASK_PID our
 *      pid or our parent's, for a wrapper script): a process that merely
 *      inherited them (a program run directly in an sbatch script, a child
 *      of a task) must not believe it is task SLURM_PROCID.
 * and where the store is from the first of:
 *   a. MASTER_ADDR and MASTER_PORT;
 *   b. the launcher's key-value service (kvs.h): rank 0 starts the store on
 *      a port the kernel picks, on every interface, and publishes the port,
 *      its host and its addresses (plus a fresh job secret when none was
 *      configured); the others read them after a fence -- no port race, no
 *      address guess;
 *   c. every rank on one host: 127.0.0.1 and a port derived from the
 *      launcher's job id (MASTER_PORT wins);
 *   d. Slurm without a key-value service: the first host of the step's node
 *      list and the derived port (a job secret must be configured then);
 * else the world cannot form, and that is an error at once -- never a world
 * of one per node.
 */

typedef struct {
  const char *source; /* who launched us, for messages */
  int explicit_ranks; /* from RANK/WORLD_SIZE (not a launcher's own variables) */
  int rank, size;
  int local_rank, local_size; /* -1: unknown */
  int nnodes;                 /* -1: unknown */
  char tag[160];              /* the launcher's job id, for a derived port */
  const char *nodelist;       /* Slurm's step node list, or NULL */
} launch_t;

/* Reads a non-negative integer variable: 1 set, 0 unset, -1 malformed. */
static int env_int(const char *name, int *out) {
  const char *v = getenv(name);
  long x;
  if (!v || !*v) return 0;
  if (chorus__parse_long(v, &x) < 0 || x < 0 || x > 1 << 30) return -1;
  *out = (int)x;
  return 1;
}

/* Both set and well formed: 1; both unset: 0; else an error message. */
static int env_pair(const char *a, int *va, const char *b, int *vb, char *err, size_t cap) {
  int ra = env_int(a, va), rb = env_int(b, vb);
  if (ra < 0 || rb < 0) {
    snprintf(err, cap, "%s='%s' is not a non-negative integer", ra < 0 ? a : b,
             getenv(ra < 0 ? a : b));
    return -1;
  }
  if (ra != rb) {
    snprintf(err, cap, "%s is set but %s is not", ra ? a : b, ra ? b : a);
    return -1;
  }
  if (ra && *va >= *vb) {
    snprintf(err, cap, "%s=%d is not below %s=%d", a, *va, b, *vb);
    return -1;
  }
  return ra;
}

/* Tasks on node `node` from SLURM_STEP_TASKS_PER_NODE ("2(x3),1"), or -1. */
static int slurm_tasks_on_node(const char *spec, int node) {
  int seen = 0;
  for (const char *p = spec; p && *p;) {
    char *end;
    long n = strtol(p, &end, 10), reps = 1;
    if (end == p || n < 0) return -1;
    p = end;
    if (*p == '(') {
      if (p[1] != 'x') return -1;
      reps = strtol(p + 2, &end, 10);
      if (end == p + 2 || *end != ')' || reps < 1) return -1;
      p = end + 1;
    }
    if (node < seen + reps) return (int)n;
    seen += (int)reps;
    if (*p == ',') p++;
    else if (*p) return -1;
  }
  return -1;
}

/* 1 when this process is a task srun started (see above). */
static int slurm_task(void) {
  int task_pid;
  if (!getenv("SLURM_STEP_ID") && !getenv("SLURM_STEPID")) return 0;
  if (env_int("SLURM_TASK_PID", &task_pid) != 1) return 0;
  return task_pid == (int)getpid() || task_pid == (int)getppid();
}

/* Fills L from the environment.  0, or -1 with err set (nothing usable, or
 * malformed values). */
static int launch_detect(launch_t *L, char *err, size_t cap) {
  memset(L, 0, sizeof *L);
  L->local_rank = L->local_size = L->nnodes = -1;
  int r = env_pair("RANK", &L->rank, "WORLD_SIZE", &L->size, err, cap);
  if (r < 0) return -1;
  if (r) {
    L->source = "RANK/WORLD_SIZE";
    L->explicit_ranks = 1;
    int lr, ls, gs;
    if (env_int("LOCAL_RANK", &lr) == 1 && env_int("LOCAL_WORLD_SIZE", &ls) == 1 && lr < ls) {
      L->local_rank = lr;
      L->local_size = ls;
    }
    if (env_int("GROUP_WORLD_SIZE", &gs) == 1 && gs > 0) L->nnodes = gs;
    return 0;
  }
  r = env_pair("OMPI_COMM_WORLD_RANK", &L->rank, "OMPI_COMM_WORLD_SIZE", &L->size, err, cap);
  if (r < 0) return -1;
  if (r) {
    L->source = "Open MPI's mpirun";
    if (env_pair("OMPI_COMM_WORLD_LOCAL_RANK", &L->local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE",
                 &L->local_size, err, cap) <= 0)
      L->local_rank = L->local_size = -1;
    const char *id = getenv("OMPI_MCA_ess_base_jobid");
    if (!id) id = getenv("PMIX_NAMESPACE");
    snprintf(L->tag, sizeof L->tag, "ompi:%s", id ? id : "");
    return 0;
  }
  int slurm = slurm_task();
  if (getenv("PMI_FD")) {
    r = env_pair("PMI_RANK", &L->rank, "PMI_SIZE", &L->size, err, cap);
    if (r < 0) return -1;
    if (r) {
      L->source = slurm ? "srun (PMI)" : "a PMI launcher (mpiexec)";
      if (env_pair("MPI_LOCALRANKID", &L->local_rank, "MPI_LOCALNRANKS", &L->local_size, err,
                   cap) <= 0)
        L->local_rank = L->local_size = -1;
      if (!slurm) return 0;
      /* srun --mpi=pmi2: Slurm's variables describe the same task. */
      int sr = -1;
      if (env_int("SLURM_PROCID", &sr) != 1 || sr != L->rank) return 0;
    }
  }
  if (!slurm) {
    if (getenv("SLURM_PROCID") && getenv("SLURM_JOB_ID"))
      snprintf(err, cap, "SLURM_PROCID is set but this process was not started by srun as a "
               "task (no SLURM_STEP_ID, or SLURM_TASK_PID is not this process or its parent), "
               "so it is not believed; run the program with srun, chorusrun or torchrun, or "
               "set RANK and WORLD_SIZE");
    else
      snprintf(err, cap, "RANK and WORLD_SIZE are not set; launch with chorusrun (or torchrun), "
               "srun, mpirun or mpiexec, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT");
    return -1;
  }
  int node = -1, tasks = -1;
  if (!L->source) {
    if (env_int("SLURM_PROCID", &L->rank) != 1 ||
        (env_int("SLURM_STEP_NUM_TASKS", &tasks) != 1 && env_int("SLURM_NTASKS", &tasks) != 1) ||
        tasks <= 0 || L->rank >= tasks) {
      snprintf(err, cap, "srun's SLURM_PROCID='%s' / SLURM_STEP_NUM_TASKS='%s' are missing or "
               "inconsistent", getenv("SLURM_PROCID") ? getenv("SLURM_PROCID") : "",
               getenv("SLURM_STEP_NUM_TASKS") ? getenv("SLURM_STEP_NUM_TASKS") : "");
      return -1;
    }
    L->size = tasks;
    L->source = "srun";
  }
  int lr;
  const char *tpn = getenv("SLURM_STEP_TASKS_PER_NODE");
  if (!tpn) tpn = getenv("SLURM_TASKS_PER_NODE");
  if (env_int("SLURM_NODEID", &node) == 1 && env_int("SLURM_LOCALID", &lr) == 1 && tpn) {
    int ls = slurm_tasks_on_node(tpn, node);
    if (ls > lr) {
      L->local_rank = lr;
      L->local_size = ls;
    }
  }
  int nn;
  if (env_int("SLURM_STEP_NUM_NODES", &nn) == 1 && nn > 0) L->nnodes = nn;
  L->nodelist = getenv("SLURM_STEP_NODELIST");
  const char *job = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
  if (!step) step = getenv("SLURM_STEPID");
  snprintf(L->tag, sizeof L->tag, "slurm:%s.%s", job ? job : "", step ? step : "");
  return 0;
}

/* Every rank on this host? 1 yes, 0 no, -1 unknown. */
static int launch_one_host(const launch_t *L) {
  if (L->size == 1 || L->nnodes == 1) return 1;
  if (L->nnodes > 1) return 0;
  if (L->local_size > 0) return L->local_size == L->size;
  return -1;
}

/* A store port derived from the launcher's job id, the same on every rank:
 * [20000, 32000), below Linux's ephemeral range. */
static int derived_port(const launch_t *L) {
  static const uint8_t key[16] = "chorus-storeport";
  return 20000 + (int)(chorus__siphash(key, L->tag, strlen(L->tag)) % 12000);
}

chorus_result_t chorus_comm_init_env(chorus_comm_t *comm) {
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  const chorus__env_t *env = chorus__env();
  chorus__log_init();
  if (comm) *comm = NULL;
  launch_t L;
  char err[700], host[300], secret[CHORUS__SECRET_MAX] = "", from[300] = "", node_sizes[256] = "";
  const char *service = NULL;
  if (launch_detect(&L, err, sizeof err) < 0)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: %s", err);
  cfg.rank = L.rank;
  cfg.world_size = L.size;
  if (L.local_rank >= 0) {
    cfg.local_rank = L.local_rank;
    cfg.local_world_size = L.local_size;
  }
  int port_set = env_int("MASTER_PORT", &cfg.store_port);
  if (port_set < 0 || cfg.store_port > 65535)
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_PORT='%s' "
                             "is not a port number", getenv("MASTER_PORT"));
  const char *addr = getenv("MASTER_ADDR");
  int one_host = launch_one_host(&L);
  int64_t deadline = chorus__deadline_ms(chorus__init_timeout_ms(NULL, chorus__env_timeout_ms()));
  chorus_store_server_t *server = NULL;
  chorus_result_t st;
  char why[300] = "";
  if (addr && *addr && port_set) {
    cfg.store_host = addr; /* a */
  } else if (!port_set && addr && *addr) {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_ADDR is set "
                             "but MASTER_PORT is not");
  } else if ((service = chorus__kvs_available(why, sizeof why)) && L.size > 1 &&
             !env->STORE_EXTERNAL) {
    chorus__kvs_t *kvs = NULL;
    char kerr[600], svc[120];
    snprintf(svc, sizeof svc, "the launcher's key-value service (%s)", service);
    chorus__kv_exchange_t X = {L.rank, L.size, L.source, one_host == 1, svc, NULL, 0};
    st = chorus__kvs_open(&kvs, L.rank, deadline, kerr, sizeof kerr);
    if (st != CHORUS_OK)
      return chorus__init_fail(st, "chorus rank %d/%d (%s): %s", L.rank, L.size, L.source, kerr);
    /* Where the launcher placed the ranks (PMI-1's mapping), if it says. */
    chorus__kvs_node_sizes(kvs, L.size, node_sizes, sizeof node_sizes, deadline);
    st = chorus__bootstrap_kv_exchange(&X, kvs, &cfg, host, sizeof host, secret, sizeof secret,
                                       &server, deadline, from, sizeof from);
    if (st != CHORUS_OK) {
      chorus__wipe(secret, sizeof secret);
      return st;
    }
  } else if (!port_set && L.explicit_ranks && L.size > 1) {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: MASTER_PORT is not "
                             "set; launch with chorusrun (or torchrun) or set RANK, WORLD_SIZE, "
                             "MASTER_ADDR and MASTER_PORT");
  } else if (one_host == 1) {
    cfg.store_host = "127.0.0.1"; /* c */
    if (!port_set) cfg.store_port = derived_port(&L);
  } else if (L.nodelist) {
    /* d: rank 0 is task 0, on the step's first node (srun places tasks in
     * node order). */
    if (chorus__hostlist_nth(L.nodelist, 0, host, sizeof host) < 0)
      return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: cannot read "
                               "SLURM_STEP_NODELIST='%.200s'", L.nodelist);
    cfg.store_host = host;
    if (!port_set) cfg.store_port = derived_port(&L);
  } else if (port_set && one_host < 0) {
    cfg.store_host = "127.0.0.1"; /* MASTER_PORT alone: torchrun's default address */
  } else {
    return chorus__init_fail(CHORUS_ERR_INVALID_ARG, "chorus_comm_init_env: rank %d of %d "
                             "(%s) spans several hosts%s and has no store address: set "
                             "MASTER_ADDR and MASTER_PORT, or launch with srun --mpi=pmi2 or "
                             "--mpi=pmix, mpirun, mpiexec or chorusrun, whose key-value service "
                             "carries it%s%s", L.rank, L.size, L.source,
                             one_host < 0 ? " (or may)" : "", why[0] ? "; " : "", why);
  }
  CHORUS_INFO(CHORUS__SUB_INIT, "bootstrap: rank %d/%d from %s, local %d/%d, store %s:%d",
              L.rank, L.size, L.source, L.local_rank, L.local_size, cfg.store_host,
              cfg.store_port);
  if (server) cfg.host_store = 1;
  st = chorus__world_init(&cfg, server, from[0] ? from : NULL, node_sizes[0] ? node_sizes : NULL,
                          comm);
  chorus__wipe(secret, sizeof secret);
  return st;
}
