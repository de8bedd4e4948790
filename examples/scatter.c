/*
 * scatter.c - the PyTorch tutorial's scatter example.
 *
 *   tensor = torch.empty(1)
 *   if rank == 0:
 *       scatter_list = [torch.tensor([i + 1.0]) for i in range(world_size)]
 *       dist.scatter(tensor, scatter_list, src=0)
 *   else:
 *       dist.scatter(tensor, src=0)
 *   print(f"Rank {rank} has data {tensor[0]}")
 *
 * Rank 0 holds [1, 2, ..., world_size] and sends element r to rank r.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/scatter
 * Expected output with 4 ranks (the order of lines may vary):
 *   [rank0]:Rank 0 has data 1.0
 *   [rank1]:Rank 1 has data 2.0
 *   [rank2]:Rank 2 has data 3.0
 *   [rank3]:Rank 3 has data 4.0
 */
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

  float *scatter_list = NULL; /* only the root's is read */
  if (rank == 0) {
    scatter_list = malloc((size_t)size * sizeof *scatter_list);
    if (!scatter_list) {
      fprintf(stderr, "rank 0: out of memory\n");
      chorus_comm_abort(comm);
      chorus_comm_destroy(comm);
      return 1;
    }
    for (int i = 0; i < size; i++) scatter_list[i] = (float)(i + 1);
  }
  float tensor[1] = {0.0f};
  chorus_result_t rc = chorus_scatter(comm, scatter_list, tensor, 1, CHORUS_FLOAT32, 0, NULL);
  free(scatter_list);
  if (rc != CHORUS_OK) {
    fprintf(stderr, "rank %d: scatter failed: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("Rank %d has data %.1f\n", rank, tensor[0]);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
