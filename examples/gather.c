/*
 * gather.c - the PyTorch tutorial's gather example.
 *
 *   tensor = torch.tensor([rank])
 *   if rank == 0:
 *       gather_list = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]
 *       dist.gather(tensor, gather_list, dst=0)
 *       print(f"Rank 0 has data {[t.item() for t in gather_list]}")
 *   else:
 *       dist.gather(tensor, dst=0)
 *
 * Every rank sends its rank number; rank 0 receives them all in rank order.
 * The other ranks print nothing.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/gather
 * Expected output with 4 ranks:
 *   [rank0]:Rank 0 has data [0, 1, 2, 3]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "chorus.h"

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm), size = chorus_comm_size(comm);

  int32_t tensor[1] = {rank};
  int32_t *gather_list = NULL; /* only needed on the root */
  if (rank == 0) {
    gather_list = calloc((size_t)size, sizeof *gather_list);
    if (!gather_list) {
      fprintf(stderr, "rank 0: out of memory\n");
      chorus_comm_abort(comm);
      chorus_comm_destroy(comm);
      return 1;
    }
  }
  if (chorus_gather(comm, tensor, gather_list, 1, CHORUS_INT32, 0, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: gather failed: %s\n", rank, chorus_comm_last_error(comm));
    free(gather_list);
    chorus_comm_destroy(comm);
    return 1;
  }
  if (rank == 0) {
    printf("Rank 0 has data [");
    for (int i = 0; i < size; i++) printf("%s%d", i ? ", " : "", (int)gather_list[i]);
    printf("]\n");
  }
  free(gather_list);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
