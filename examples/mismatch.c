/*
 * mismatch.c - what happens when the ranks disagree on a collective.
 *
 * Every rank calls all_gather, but rank r passes count r + 1: a programming
 * error that in many libraries hangs or corrupts memory.  chorus compares
 * the description each message carries with the call the receiving rank is
 * executing, fails the communicator with CHORUS_ERR_MISMATCH and tells the
 * other ranks, so every rank returns an error at once (no timeout needed)
 * and chorus_comm_last_error says which ranks called what.
 *
 * This program exits 0 when its all_gather failed, as it should, and 1 if
 * the call wrongly succeeded.
 *
 * Run:  build/chorusrun --standalone -n 4 -- build/examples/mismatch
 * Expected output with 4 ranks, one failure line per rank, all within
 * milliseconds.  The order of lines, the addresses, and which mismatch a rank
 * notices first depend on timing; a rank that learns of the failure from a
 * peer reports "rank K reported an error: ...".  A typical run (the library
 * also logs each error at WARN level on stderr); the ranks share one host,
 * so all_gather is the shared-memory "direct" algorithm, which compares the
 * calls in its flags:
 *   [rank1]:rank 1: all_gather failed: chorus rank 1/4: collective mismatch in all_gather(count=2, int32, algo direct) (call #5): this rank called all_gather(count=2, int32, algo direct), rank 0 called all_gather(count=1, int32, algo direct) (every rank must call the same collectives in the same order with the same counts, dtype, op and root)
 *   [rank3]:rank 3: all_gather failed: chorus rank 3/4: rank 1 reported an error: chorus rank 1/4: collective mismatch in all_gather(count=2, int32, algo direct) (call #5): ...
 * Over TCP (CHORUS_TRANSPORT=tcp) the message headers carry the call:
 *   [rank0]:rank 0: all_gather failed: chorus rank 0/4: collective mismatch at call #1: rank 1 (127.0.0.1:41525) called all_gather(count=2, int32, algo bruck) but rank 0 called all_gather(count=1, int32, algo bruck)
 * (docs/errors.md shows both, and the doc test compares them with a run.)
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

  /* Rank r sends r + 1 elements: deliberately wrong. */
  size_t count = (size_t)rank + 1;
  int32_t *send = calloc(count, sizeof *send);
  int32_t *recv = calloc((size_t)size * count, sizeof *recv);
  if (!send || !recv) {
    fprintf(stderr, "rank %d: out of memory\n", rank);
    free(send);
    free(recv);
    chorus_comm_abort(comm);
    chorus_comm_destroy(comm);
    return 1;
  }
  chorus_result_t rc = chorus_all_gather(comm, send, recv, count, CHORUS_INT32, NULL);
  free(send);
  free(recv);
  if (rc == CHORUS_OK) {
    printf("rank %d: all_gather wrongly succeeded with mismatched counts\n", rank);
    chorus_comm_destroy(comm);
    return 1;
  }
  printf("rank %d: all_gather failed: %s\n", rank, chorus_comm_last_error(comm));
  /* The communicator is failed for good; destroy reports that again. */
  chorus_comm_destroy(comm);
  return 0;
}
