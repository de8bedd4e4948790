/* hello.c - the README example: the ranks add up their rank numbers. Run:
 *   build/chorusrun --standalone -n 4 -- build/examples/hello   # prints, in any order:
 *   [rank0]:rank 0 of 4: sum of ranks = 6
 *   [rank1]:rank 1 of 4: sum of ranks = 6
 *   [rank2]:rank 2 of 4: sum of ranks = 6
 *   [rank3]:rank 3 of 4: sum of ranks = 6 */
#include <stdio.h>
#include "chorus.h"

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm), size = chorus_comm_size(comm);
  float x = (float)rank;
  if (chorus_all_reduce(comm, &x, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: all_reduce failed: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("rank %d of %d: sum of ranks = %g\n", rank, size, x);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
