/*
 * all_gather_object.c - all_gather of variable-size data, what
 * torch.distributed.all_gather_object does for picklable objects.
 *
 *   obj = [rank] * (rank + 1)
 *   output = [None] * world_size
 *   dist.all_gather_object(output, obj)
 *   print(f"Rank {rank} has data {output}")
 *
 * Rank r contributes r + 1 int32 values, all equal to r.  The contributions
 * have different lengths, so they go through chorus_all_gather_bytes, which
 * exchanges the lengths itself and returns one buffer plus each rank's length.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/all_gather_object
 * Expected output with 4 ranks (the order of lines may vary):
 *   [rank0]:Rank 0 has data [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
 *   [rank1]:Rank 1 has data [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
 *   [rank2]:Rank 2 has data [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
 *   [rank3]:Rank 3 has data [[0], [1, 1], [2, 2, 2], [3, 3, 3, 3]]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus.h"

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  int rank = chorus_comm_rank(comm), size = chorus_comm_size(comm);

  int32_t *obj = malloc((size_t)(rank + 1) * sizeof *obj);
  size_t *lens = calloc((size_t)size, sizeof *lens); /* bytes per rank */
  if (!obj || !lens) {
    fprintf(stderr, "rank %d: out of memory\n", rank);
    free(obj);
    free(lens);
    chorus_comm_abort(comm);
    chorus_comm_destroy(comm);
    return 1;
  }
  for (int i = 0; i <= rank; i++) obj[i] = rank;

  void *out = NULL;
  chorus_result_t rc =
      chorus_all_gather_bytes(comm, obj, (size_t)(rank + 1) * sizeof *obj, &out, lens);
  free(obj);
  if (rc != CHORUS_OK) {
    fprintf(stderr, "rank %d: all_gather_bytes failed: %s\n", rank, chorus_comm_last_error(comm));
    free(lens);
    chorus_comm_destroy(comm);
    return 1;
  }

  /* out holds every rank's bytes back to back, in rank order. */
  const unsigned char *p = out;
  printf("Rank %d has data [", rank);
  for (int r = 0; r < size; r++) {
    printf("%s[", r ? ", " : "");
    for (size_t i = 0; i < lens[r] / sizeof(int32_t); i++) {
      int32_t v;
      memcpy(&v, p + i * sizeof v, sizeof v); /* out is not promised to be aligned */
      printf("%s%d", i ? ", " : "", (int)v);
    }
    printf("]");
    p += lens[r];
  }
  printf("]\n");
  chorus_free(out);
  free(lens);
  return chorus_comm_destroy(comm) == CHORUS_OK ? 0 : 1;
}
