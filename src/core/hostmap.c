/*
 * hostmap.c - which world ranks share a host, from what the launcher says,
 * so that a world forms without every rank reading every rank's record.
 *
 * chorusrun and torchrun place ranks in blocks: node g (GROUP_RANK) holds
 * the LOCAL_WORLD_SIZE ranks that follow the earlier nodes' ranks.  The
 * block sizes come from CHORUS_NODE_SIZES (chorusrun: "8x3,6" is three
 * nodes of 8 then one of 6, in GROUP_RANK order), else from torchrun's
 * variables when every node has the same count (WORLD_SIZE =
 * LOCAL_WORLD_SIZE x GROUP_WORLD_SIZE), else from a PMI launcher's
 * PMI_process_mapping (hydra's mpiexec, srun --mpi=pmi2: the caller reads
 * it from the key-value service, kvs.c), else from Slurm's
 * SLURM_STEP_TASKS_PER_NODE ("2(x3),1") when srun placed tasks in blocks,
 * else from mpirun's or a PMI launcher's local size when it is the world's
 * (one node).
 * This rank checks that its own place agrees (its RANK is its block's
 * first plus LOCAL_RANK); the join counts ranks that found no map or
 * disagree, and any one of them sends the whole world back to reading
 * every record (rendezvous.c), so a map is used only when every rank
 * holds the same one.
 *
 * A map treats each node as its own host: two launcher nodes on one
 * machine talk over TCP, as two machines would.  CHORUS_HOST_ID, which
 * says otherwise, makes the map unknown.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/bootstrap.h"
#include "util/env.h"

/* A non-negative integer variable: 1 set, 0 unset or malformed. */
static int var_int(const char *name, long *out) {
  const char *v = getenv(name);
  return v && *v && chorus__parse_long(v, out) == 0 && *out >= 0 && *out <= (1L << 30);
}

/* Calls each(arg, count) for every node of a run-length list, in order:
 * "8x3,6" (chorusrun's) or "8(x3),6" (Slurm's).  Nodes, or -1 when the
 * list is malformed or lists more than limit ranks. */
static long each_node(const char *spec, long limit, void (*each)(void *, long), void *arg) {
  long nodes = 0, ranks = 0;
  for (const char *p = spec; *p;) {
    char *end;
    long n = strtol(p, &end, 10), reps = 1;
    if (end == p || n < 1) return -1;
    p = end;
    int paren = p[0] == '(';
    if (paren || p[0] == 'x') {
      const char *r = p + (paren ? 2 : 1);
      if (paren && p[1] != 'x') return -1;
      reps = strtol(r, &end, 10);
      if (end == r || reps < 1 || (paren && *end != ')')) return -1;
      p = end + paren;
    }
    if (reps > limit || n > limit / reps || ranks > limit - n * reps) return -1;
    for (long i = 0; i < reps && each; i++) each(arg, n);
    ranks += n * reps;
    nodes += reps;
    if (*p == ',') p++;
    else if (*p) return -1;
  }
  return ranks == limit ? nodes : -1;
}

typedef struct {
  uint64_t *host; /* out: per rank, its node + 1 */
  long at, node;
  long first_of_mine, mine; /* this rank's node: its first rank and count */
  int want_node;            /* that node; -1: the one that holds want_rank */
  int want_rank;
} fill_t;

static void fill_node(void *arg, long count) {
  fill_t *f = arg;
  if (f->node == f->want_node ||
      (f->want_node < 0 && f->want_rank >= f->at && f->want_rank < f->at + count))
    f->first_of_mine = f->at, f->mine = count;
  for (long i = 0; i < count; i++) f->host[f->at + i] = (uint64_t)f->node + 1;
  f->at += count;
  f->node++;
}

/* The blocks of spec with this rank's place checked (node -1: the block
 * that holds rank; local_rank -1: not said): 1, or 0. */
static int from_blocks(const char *spec, int rank, int size, long node, long local_rank,
                       long local_size, uint64_t *host, int *local_count) {
  if (each_node(spec, size, NULL, NULL) < 0) return 0;
  fill_t f = {host, 0, 0, -1, 0, (int)node, rank};
  each_node(spec, size, fill_node, &f);
  if (f.first_of_mine < 0 || (local_rank >= 0 && f.first_of_mine + local_rank != rank) ||
      (local_rank < 0 && (rank < f.first_of_mine || rank >= f.first_of_mine + f.mine)) ||
      (local_size >= 0 && f.mine != local_size))
    return 0;
  *local_count = (int)f.mine;
  return 1;
}

int chorus__hostmap_from_launcher(int rank, int size, const char *pmi_sizes, uint64_t *host,
                                  int *local_count) {
  const char *hid = getenv("CHORUS_HOST_ID");
  if (hid && *hid) return 0;
  long r, ws, lr, ls, g, gs;
  if (var_int("RANK", &r) && var_int("WORLD_SIZE", &ws)) {
    if (r != rank || ws != size || !var_int("LOCAL_RANK", &lr) ||
        !var_int("LOCAL_WORLD_SIZE", &ls) || !var_int("GROUP_RANK", &g))
      return 0;
    const char *sizes = getenv("CHORUS_NODE_SIZES");
    if (sizes && *sizes) return from_blocks(sizes, rank, size, g, lr, ls, host, local_count);
    char uniform[64];
    if (!var_int("GROUP_WORLD_SIZE", &gs) || ls < 1 || ls * gs != size) return 0;
    snprintf(uniform, sizeof uniform, "%ldx%ld", ls, gs);
    return from_blocks(uniform, rank, size, g, lr, ls, host, local_count);
  }
  /* A PMI launcher's mapping: this rank's node is the block that holds it,
   * checked against MPI_LOCALRANKID/MPI_LOCALNRANKS where hydra sets them. */
  if (pmi_sizes && *pmi_sizes) {
    if (!var_int("MPI_LOCALRANKID", &lr)) lr = -1;
    if (!var_int("MPI_LOCALNRANKS", &ls)) ls = -1;
    return from_blocks(pmi_sizes, rank, size, -1, lr, ls, host, local_count);
  }
  /* srun's tasks: only in a task srun started (SLURM_STEP_ID). */
  const char *tpn = getenv("SLURM_STEP_TASKS_PER_NODE");
  if (getenv("SLURM_STEP_ID") && tpn && var_int("SLURM_PROCID", &r) && r == rank &&
      var_int("SLURM_NODEID", &g) && var_int("SLURM_LOCALID", &lr))
    return from_blocks(tpn, rank, size, g, lr, -1, host, local_count);
  /* mpirun's or a PMI launcher's ranks, all on one node. */
  static const char *const one[][4] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"}};
  for (int i = 0; i < 2; i++) {
    char spec[32];
    if (!var_int(one[i][0], &r) || !var_int(one[i][1], &ws) || !var_int(one[i][2], &lr) ||
        !var_int(one[i][3], &ls))
      continue;
    if (r != rank || ws != size || ls != size) return 0;
    snprintf(spec, sizeof spec, "%d", size);
    return from_blocks(spec, rank, size, 0, lr, ls, host, local_count);
  }
  return 0;
}
