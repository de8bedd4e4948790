/*
 * broadcast.c - the PyTorch tutorial's broadcast example.
 *
 *   tensor = torch.tensor([42]) if rank == 0 else torch.zeros(1, dtype=torch.int32)
 *   dist.broadcast(tensor, src=0)
 *   print(f"Rank {rank} has data {tensor[0]}")
 *
 * Rank 0 holds 42, the others 0; after the broadcast everyone holds 42.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/broadcast
 * Expected output with 4 ranks (the order of lines may vary):
 *   [rank0]:Rank 0 has data 42
 *   [rank1]:Rank 1 has data 42
 *   [rank2]:Rank 2 has data 42
 *   [rank3]:Rank 3 has data 42
 */
#include <stdint.h>
#include <stdio.h>

#include "chorus.h"

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm);

  int32_t tensor[1] = {rank == 0 ? 42 : 0};
  if (chorus_broadcast(comm, tensor, 1, CHORUS_INT32, 0, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: broadcast failed: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("Rank %d has data %d\n", rank, (int)tensor[0]);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
