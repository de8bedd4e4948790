/*
 * many_local.c - many ranks on one host (256 on a 2-core machine): the
 * world forms, an all_reduce and a barrier complete, and the shared memory
 * the job holds grows with the ranks, not their square.  Each rank adds up
 * what its own inbox holds (the pages of its memfd, st_blocks), and rank 0
 * the /dev/shm segments it maps (the communicators' segments);
 * rank 0 fails the test above 8 MiB a rank.  Measured inside the job, so
 * other jobs on the machine do not count.  Run under chorusrun.
 */
#include <dirent.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chorus.h"

#define LIMIT_PER_RANK ((uint64_t)8 << 20)

/* Bytes allocated to this rank's inbox: the memfd it keeps open. */
static uint64_t inbox_bytes(void) {
  DIR *d = opendir("/proc/self/fd");
  uint64_t sum = 0;
  struct dirent *e;
  while (d && (e = readdir(d))) {
    char path[300], target[PATH_MAX];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    struct stat sb;
    if (strstr(target, "memfd:chorus-inbox") && stat(path, &sb) == 0)
      sum += (uint64_t)sb.st_blocks * 512;
  }
  if (d) closedir(d);
  return sum;
}

/* Bytes allocated to the /dev/shm segments this rank maps, each once
 * (unlinked once every member mapped it: stat'ed through map_files). */
static uint64_t segment_bytes(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[1024];
  unsigned long seen[256];
  int nseen = 0;
  uint64_t sum = 0;
  while (f && fgets(line, sizeof line, f)) {
    if (!strstr(line, "/dev/shm/")) continue;
    char range[64], path[128];
    if (sscanf(line, "%63s", range) != 1) continue;
    snprintf(path, sizeof path, "/proc/self/map_files/%s", range);
    struct stat sb;
    if (stat(path, &sb) != 0) continue;
    int known = 0;
    for (int i = 0; i < nseen; i++) known |= seen[i] == (unsigned long)sb.st_ino;
    if (known || nseen == 256) continue;
    seen[nseen++] = (unsigned long)sb.st_ino;
    sum += (uint64_t)sb.st_blocks * 512;
  }
  if (f) fclose(f);
  return sum;
}

int main(void) {
  chorus_comm_t comm;
  if (chorus_comm_init_env(&comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  const int rank = chorus_comm_rank(comm), size = chorus_comm_size(comm);
  int64_t mine = rank, sum = 0;
  if (chorus_all_reduce(comm, &mine, &sum, 1, CHORUS_INT64, CHORUS_SUM, NULL) != CHORUS_OK ||
      chorus_barrier(comm, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_abort(comm);
    return 1;
  }
  int rc = sum == (int64_t)size * (size - 1) / 2 ? 0 : 1;
  if (rc) fprintf(stderr, "rank %d: the sum of ranks is %lld\n", rank, (long long)sum);
  /* Every rank's bytes, summed while all of them are still alive. */
  int64_t bytes[2] = {(int64_t)inbox_bytes(), rank == 0 ? (int64_t)segment_bytes() : 0}, tot[2];
  if (chorus_all_reduce(comm, bytes, tot, 2, CHORUS_INT64, CHORUS_SUM, NULL) != CHORUS_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, chorus_comm_last_error(comm));
    chorus_comm_abort(comm);
    return 1;
  }
  if (rank == 0) {
    const double per = (double)(tot[0] + tot[1]) / size;
    printf("%d ranks on one host: the sum of ranks is right; shared memory %.1f MiB "
           "(inboxes %.1f, segments %.1f) = %.0f KiB per rank (at most %llu)\n",
           size, (double)(tot[0] + tot[1]) / 1048576, (double)tot[0] / 1048576,
           (double)tot[1] / 1048576, per / 1024, (unsigned long long)(LIMIT_PER_RANK >> 10));
    if (per > (double)LIMIT_PER_RANK) {
      printf("FAIL: more than %llu KiB of shared memory per rank\n",
             (unsigned long long)(LIMIT_PER_RANK >> 10));
      rc = 1;
    }
    if (tot[0] == 0) {
      printf("FAIL: no inbox found: the measurement is broken\n");
      rc = 1;
    }
  }
  return chorus_comm_destroy(comm) == CHORUS_OK ? rc : 1;
}
