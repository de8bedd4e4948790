/*
 * reduce_sum.c - the PyTorch tutorial's reduce example.
 *
 *   tensor = torch.ones(1)
 *   dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
 *   if rank == 0:
 *       print(f"Rank 0 has data {tensor[0]}")
 *
 * Every rank contributes one 1.0; only rank 0 receives the sum, the world
 * size.  The other ranks print nothing.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/reduce_sum
 * Expected output with 4 ranks:
 *   [rank0]:Rank 0 has data 4.0
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

  /* In-place on the root (sendbuf == recvbuf), like torch's reduce. */
  float tensor[1] = {1.0f};
  if (chorus_reduce(comm, tensor, tensor, 1, CHORUS_FLOAT32, CHORUS_SUM, 0, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: reduce failed: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_destroy(comm);
    return 1;
  }
  if (rank == 0) printf("Rank 0 has data %.1f\n", tensor[0]);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
