/*
 * all_reduce_max.c - all_reduce with ReduceOp.MAX, as in the PyTorch
 * tutorial's list of reduction operators.
 *
 *   tensor = torch.tensor([rank + 1.0])
 *   dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
 *   print(f"Rank {rank} has data {tensor[0]}")
 *
 * Rank r contributes r + 1; every rank ends up with the largest, the world
 * size.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/all_reduce_max
 * Expected output with 4 ranks (the order of lines may vary):
 *   [rank0]:Rank 0 has data 4.0
 *   [rank1]:Rank 1 has data 4.0
 *   [rank2]:Rank 2 has data 4.0
 *   [rank3]:Rank 3 has data 4.0
 */
#include <stdio.h>

#include "chorus.h"

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm);

  float tensor[1] = {(float)(rank + 1)};
  if (chorus_all_reduce(comm, tensor, tensor, 1, CHORUS_FLOAT32, CHORUS_MAX, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: all_reduce failed: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("Rank %d has data %.1f\n", rank, tensor[0]);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
