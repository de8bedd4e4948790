/*
 * bootstrap_check.c - forms the world with chorus_comm_init_env() and no
 * flags, whoever launched it (chorusrun, srun, mpirun, mpiexec), and checks
 * that the world is whole: every rank distinct, the local ranks of each
 * host distinct and dense, a sum over every rank right.  Prints one line
 * per rank for the test script to count:
 *
 *   bootstrap ok rank R size S local L/LS host H
 *
 * and exits 0; on failure prints "bootstrap FAILED: <reason>" (with the
 * library's message) and exits 1.  With CHORUS_TEST_HOLD set, rank 0 also
 * prints "bootstrap holding" once the world works, and the world waits
 * for that file before the ranks report.  Used by test_bootstrap.sh and
 * test_ifname.sh.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"

#define HOST_MAX 64

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    printf("bootstrap FAILED: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm), size = chorus_comm_size(comm);
  /* CHORUS_TEST_DELAY_MS: this rank's first message comes that much later
   * (the others' first messages then decide which way pairs connect). */
  const char *delay = getenv("CHORUS_TEST_DELAY_MS");
  if (delay) usleep((useconds_t)atoi(delay) * 1000);
  int lr = chorus_comm_local_rank(comm), ls = chorus_comm_local_size(comm);
  /* Every rank's (rank, local rank, host) on every rank. */
  struct {
    int rank, local;
    char host[HOST_MAX];
  } mine, *all = calloc((size_t)size, sizeof *all);
  memset(&mine, 0, sizeof mine);
  mine.rank = rank;
  mine.local = lr;
  gethostname(mine.host, HOST_MAX - 1);
  const char *node = getenv("SLURMD_NODENAME"); /* several slurmd on one host */
  if (node) snprintf(mine.host, HOST_MAX, "%s", node);
  const char *fake = getenv("MPIR_CVAR_CH3_INTERFACE_HOSTNAME"); /* hydra -hosts */
  if (!fake) fake = getenv("CHORUS_TEST_HOST"); /* the test's rsh agent for mpirun */
  if (fake && !node) snprintf(mine.host, HOST_MAX, "%s", fake);
  if (!all || chorus_all_gather(comm, &mine, all, sizeof mine, CHORUS_UINT8, NULL) != CHORUS_OK) {
    printf("bootstrap FAILED: rank %d: all_gather: %s\n", rank, chorus_comm_last_error(comm));
    return 1;
  }
  const char *why = NULL;
  for (int r = 0; r < size && !why; r++) {
    if (all[r].rank != r) why = "ranks are not 0..size-1 in order";
    for (int q = 0; q < r && !why; q++)
      if (!strcmp(all[q].host, all[r].host) && all[q].local == all[r].local)
        why = "two ranks on one host have the same local rank";
  }
  int on_host = 0;
  for (int r = 0; r < size; r++) on_host += !strcmp(all[r].host, mine.host);
  if (!why && lr >= 0 && (ls != on_host || lr >= ls)) why = "local size is not the ranks on this host";
  double x = rank + 1, sum = 0;
  if (!why && chorus_all_reduce(comm, &x, &sum, 1, CHORUS_FLOAT64, CHORUS_SUM, NULL) != CHORUS_OK)
    why = chorus_comm_last_error(comm);
  if (!why && sum != (double)size * (size + 1) / 2) why = "all_reduce gave a wrong sum";
  /* CHORUS_TEST_HOLD=PATH: the world stays up until PATH exists (rank 0
   * waits at most 60 s, then a barrier), so that a test can attack the
   * running job (test_bootstrap.sh, tests/python/torch/secret.py). */
  const char *hold = getenv("CHORUS_TEST_HOLD");
  if (!why && hold && *hold) {
    if (rank == 0) {
      printf("bootstrap holding\n");
      fflush(stdout);
      for (int i = 0; i < 600 && access(hold, F_OK) != 0; i++) usleep(100 * 1000);
    }
    if (chorus_barrier(comm, NULL) != CHORUS_OK) why = chorus_comm_last_error(comm);
  }
  if (why) {
    printf("bootstrap FAILED: rank %d: %s\n", rank, why);
    return 1;
  }
  printf("bootstrap ok rank %d size %d local %d/%d host %s\n", rank, size, lr, ls, mine.host);
  fflush(stdout);
  free(all);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
