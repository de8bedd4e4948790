/*
 * all_gather.c - the PyTorch tutorial's all_gather example.
 *
 *   tensor = torch.tensor([rank])
 *   tensor_list = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]
 *   dist.all_gather(tensor_list, tensor)
 *   print(f"Rank {rank} has data {[t.item() for t in tensor_list]}")
 *
 * Every rank sends its rank number and receives everyone's, in rank order.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/all_gather
 * Expected output with 4 ranks (the order of lines may vary):
 *   [rank0]:Rank 0 has data [0, 1, 2, 3]
 *   [rank1]:Rank 1 has data [0, 1, 2, 3]
 *   [rank2]:Rank 2 has data [0, 1, 2, 3]
 *   [rank3]:Rank 3 has data [0, 1, 2, 3]
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
  int32_t *tensor_list = calloc((size_t)size, sizeof *tensor_list);
  if (!tensor_list) {
    fprintf(stderr, "rank %d: out of memory\n", rank);
    chorus_comm_abort(comm);
    chorus_comm_destroy(comm);
    return 1;
  }
  if (chorus_all_gather(comm, tensor, tensor_list, 1, CHORUS_INT32, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: all_gather failed: %s\n", rank, chorus_comm_last_error(comm));
    free(tensor_list);
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("Rank %d has data [", rank);
  for (int i = 0; i < size; i++) printf("%s%d", i ? ", " : "", (int)tensor_list[i]);
  printf("]\n");
  free(tensor_list);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
