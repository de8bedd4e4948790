/*
 * test_hostmap.c - the host map from the launcher's placement
 * (src/core/hostmap.c): chorusrun's CHORUS_NODE_SIZES, torchrun's uniform
 * variables and srun's SLURM_STEP_TASKS_PER_NODE give every rank's node; a
 * rank whose own place disagrees, a malformed or short list, or
 * CHORUS_HOST_ID gives no map (the world then reads every record).  A PMI
 * launcher's PMI_process_mapping converts to the same list.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/bootstrap.h"
#include "core/kvs.h"
#include "harness.h"

static const char *const g_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "CHORUS_NODE_SIZES", "CHORUS_HOST_ID", "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};

static void clear_env(void) {
  for (size_t i = 0; i < sizeof g_vars / sizeof g_vars[0]; i++) unsetenv(g_vars[i]);
}

/* torchrun's variables for rank r of a world of n; NULL leaves one unset. */
static void torchrun(const char *r, const char *n, const char *lr, const char *ls, const char *g,
                     const char *gs) {
  clear_env();
  const char *v[] = {r, n, lr, ls, g, gs};
  for (int i = 0; i < 6; i++)
    if (v[i]) setenv(g_vars[i], v[i], 1);
}

static uint64_t g_host[64];

static int map(int rank, int size, int *local) {
  memset(g_host, 0, sizeof g_host);
  *local = -1;
  return chorus__hostmap_from_launcher(rank, size, NULL, g_host, local);
}

TEST(chorusrun_node_sizes) {
  int local;
  /* Nodes of 4, 4 and 3: rank 9 is the second of the third. */
  torchrun("9", "11", "1", "3", "2", "3");
  setenv("CHORUS_NODE_SIZES", "4x2,3", 1);
  ASSERT_EQ(map(9, 11, &local), 1);
  ASSERT_EQ(local, 3);
  for (int r = 0; r < 11; r++) ASSERT_EQ(g_host[r], (uint64_t)(r < 4 ? 1 : r < 8 ? 2 : 3));
  /* Every rank of a world gets the same map. */
  torchrun("0", "11", "0", "4", "0", "3");
  setenv("CHORUS_NODE_SIZES", "4x2,3", 1);
  ASSERT_EQ(map(0, 11, &local), 1);
  ASSERT_EQ(local, 4);
  ASSERT_EQ(g_host[10], 3);
  /* One node of 5 (chorusrun --standalone). */
  torchrun("2", "5", "2", "5", "0", "1");
  setenv("CHORUS_NODE_SIZES", "5", 1);
  ASSERT_EQ(map(2, 5, &local), 1);
  ASSERT_EQ(local, 5);
}

TEST(a_place_that_disagrees_gives_no_map) {
  int local;
  /* Rank 9 says it is on node 1, which holds ranks 4-7. */
  torchrun("9", "11", "1", "3", "1", "3");
  setenv("CHORUS_NODE_SIZES", "4x2,3", 1);
  ASSERT_EQ(map(9, 11, &local), 0);
  /* Its node's size is not the list's. */
  torchrun("9", "11", "1", "4", "2", "3");
  setenv("CHORUS_NODE_SIZES", "4x2,3", 1);
  ASSERT_EQ(map(9, 11, &local), 0);
  /* The launcher's RANK or WORLD_SIZE is not this world's (a subgroup, a
   * grown world). */
  torchrun("9", "11", "1", "3", "2", "3");
  setenv("CHORUS_NODE_SIZES", "4x2,3", 1);
  ASSERT_EQ(map(8, 11, &local), 0);
  ASSERT_EQ(map(9, 12, &local), 0);
  /* CHORUS_HOST_ID says otherwise: no map. */
  setenv("CHORUS_HOST_ID", "a", 1);
  ASSERT_EQ(map(9, 11, &local), 0);
}

TEST(malformed_lists_give_no_map) {
  const char *bad[] = {"4x", "x3", "0x3,3", "4x2,", "4x2,3,1", "4x2", "4(x2),3x", "4x2;3",
                       "-4x2,11", "4x99999999999,3", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int local;
    torchrun("9", "11", "1", "3", "2", "3");
    setenv("CHORUS_NODE_SIZES", bad[i], 1);
    int got = map(9, 11, &local);
    /* "" is unset: torchrun's variables then (not uniform here: no map). */
    if (got != 0) printf("  '%s' gave a map\n", bad[i]);
    ASSERT_EQ(got, 0);
  }
}

TEST(torchrun_uniform) {
  int local;
  torchrun("5", "12", "1", "4", "1", "3");
  ASSERT_EQ(map(5, 12, &local), 1);
  ASSERT_EQ(local, 4);
  ASSERT_EQ(g_host[3], 1);
  ASSERT_EQ(g_host[4], 2);
  ASSERT_EQ(g_host[11], 3);
  /* Not every node runs as many (WORLD_SIZE is not LOCAL_WORLD_SIZE x
   * GROUP_WORLD_SIZE), or a variable is missing: no map. */
  torchrun("5", "11", "1", "4", "1", "3");
  ASSERT_EQ(map(5, 11, &local), 0);
  torchrun("5", "12", "1", "4", NULL, "3");
  ASSERT_EQ(map(5, 12, &local), 0);
  torchrun("5", "12", "1", "4", "1", NULL);
  ASSERT_EQ(map(5, 12, &local), 0);
}

TEST(srun_blocks) {
  int local;
  clear_env();
  setenv("SLURM_STEP_ID", "0", 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1", 1);
  /* Block placement: task 5 is the second of node 2 (tasks 4 and 5). */
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NODEID", "2", 1);
  setenv("SLURM_LOCALID", "1", 1);
  ASSERT_EQ(map(5, 7, &local), 1);
  ASSERT_EQ(local, 2);
  ASSERT_EQ(g_host[6], 4);
  /* Cyclic placement: task 2 on node 2 as its first: no map. */
  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_LOCALID", "0", 1);
  ASSERT_EQ(map(2, 7, &local), 0);
  /* Not a task srun started: no map. */
  unsetenv("SLURM_STEP_ID");
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_LOCALID", "1", 1);
  ASSERT_EQ(map(5, 7, &local), 0);
}

TEST(pmi_process_mapping) {
  char spec[64];
  ASSERT_EQ(chorus__pmi_mapping_sizes("(vector,(0,2,4))", 8, spec, sizeof spec), 0);
  ASSERT_STREQ(spec, "4x2");
  ASSERT_EQ(chorus__pmi_mapping_sizes("(vector,(0,1,3),(1,2,2))", 7, spec, sizeof spec), 0);
  ASSERT_STREQ(spec, "3,2x2");
  /* hydra's one node, whatever the count; a pattern that repeats on the
   * same node; the last node short. */
  ASSERT_EQ(chorus__pmi_mapping_sizes("(vector,(0,1,1))", 5, spec, sizeof spec), 0);
  ASSERT_STREQ(spec, "5");
  ASSERT_EQ(chorus__pmi_mapping_sizes("(vector,(0,2,4))", 6, spec, sizeof spec), 0);
  ASSERT_STREQ(spec, "4,2");
  /* Round robin (a node met again), nodes out of order, not a mapping. */
  const char *bad[] = {"(vector,(0,2,1))", "(vector,(1,1,4),(0,1,4))",
                       "(vector,(0,2,4)", "(vector,(0,2))", "(vector,(0,0,4))",
                       "(vector,(0,2,4)),", "(list,(0,2,4))", "(vector,(0,2,-4))", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int got = chorus__pmi_mapping_sizes(bad[i], 8, spec, sizeof spec);
    if (got != -1) printf("  '%s' gave '%s'\n", bad[i], spec);
    ASSERT_EQ(got, -1);
  }
  /* Too long for the caller's buffer. */
  ASSERT_EQ(chorus__pmi_mapping_sizes("(vector,(0,2,4))", 8, spec, 3), -1);
  /* The map from it: the block that holds the rank, checked against
   * hydra's local rank where it is set. */
  int local;
  clear_env();
  memset(g_host, 0, sizeof g_host);
  ASSERT_EQ(chorus__hostmap_from_launcher(4, 7, "3x1,2x2", g_host, &local), 1);
  ASSERT_EQ(local, 2);
  ASSERT_EQ(g_host[2], 1);
  ASSERT_EQ(g_host[4], 2);
  ASSERT_EQ(g_host[6], 3);
  setenv("MPI_LOCALRANKID", "1", 1);
  setenv("MPI_LOCALNRANKS", "2", 1);
  ASSERT_EQ(chorus__hostmap_from_launcher(4, 7, "3x1,2x2", g_host, &local), 1);
  setenv("MPI_LOCALRANKID", "0", 1);
  ASSERT_EQ(chorus__hostmap_from_launcher(4, 7, "3x1,2x2", g_host, &local), 0);
  /* A cyclic mapping covers fewer ranks than the world: no map. */
  clear_env();
  ASSERT_EQ(chorus__hostmap_from_launcher(4, 8, "2x2", g_host, &local), 0);
}

TEST(one_node_launchers) {
  int local;
  /* mpirun with every rank on this node. */
  clear_env();
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  ASSERT_EQ(map(2, 4, &local), 1);
  ASSERT_EQ(local, 4);
  ASSERT_EQ(g_host[0], g_host[3]);
  /* Several nodes: mpirun says only this one's size, no map. */
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  ASSERT_EQ(map(2, 4, &local), 0);
  /* hydra on one node. */
  clear_env();
  setenv("PMI_RANK", "1", 1);
  setenv("PMI_SIZE", "3", 1);
  setenv("MPI_LOCALRANKID", "1", 1);
  setenv("MPI_LOCALNRANKS", "3", 1);
  ASSERT_EQ(map(1, 3, &local), 1);
  ASSERT_EQ(map(1, 4, &local), 0); /* another world */
}

int main(void) {
  RUN(chorusrun_node_sizes);
  RUN(a_place_that_disagrees_gives_no_map);
  RUN(malformed_lists_give_no_map);
  RUN(torchrun_uniform);
  RUN(srun_blocks);
  RUN(pmi_process_mapping);
  RUN(one_node_launchers);
  clear_env();
  return HARNESS_DONE();
}
