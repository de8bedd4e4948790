/* compare_mpi.c - tiny MPI collective benchmark for bench/compare.
 *
 * Measures exactly what bench/compare measures for chorus (chorus-bench's
 * "median" column, out-of-place form): for each size, a barrier, W untimed
 * calls, then N timed calls, each timed alone with CLOCK_MONOTONIC; the
 * per-call times are combined with a MAX over ranks and the median over the
 * N calls is printed.  Sizes follow nccl-tests' convention (see
 * bench/README.md): S = the largest buffer of the call.
 *
 * usage: compare_mpi COLL SIZE:WARMUP:ITERS [SIZE:WARMUP:ITERS ...]
 *   COLL: all_reduce all_gather reduce_scatter broadcast all_to_all
 * output (rank 0): "RESULT <coll> <n> <size> <median_us> <cpu_s_per_gb>" per
 * size: the CPU time of the timed calls (every thread, user and system) per
 * GB of the size, averaged over the ranks.
 * float32 everywhere; all_reduce and reduce_scatter use MPI_SUM.
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* CPU seconds of this process, every thread, user and system. */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: %s COLL SIZE:WARMUP:ITERS...\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const char *coll = argv[1];
  for (int a = 2; a < argc; a++) {
    long long size;
    int warm, iters;
    if (sscanf(argv[a], "%lld:%d:%d", &size, &warm, &iters) != 3 || iters < 1) {
      if (rank == 0) fprintf(stderr, "bad size spec %s\n", argv[a]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t total = (size_t)size / sizeof(float); /* elements of the big buffer */
    size_t per = total / (size_t)n;              /* elements per rank / block */
    size_t sendn = total, recvn = total;
    if (!strcmp(coll, "all_gather")) {
      sendn = per;
      recvn = per * (size_t)n;
    } else if (!strcmp(coll, "reduce_scatter")) {
      sendn = per * (size_t)n;
      recvn = per;
    } else if (!strcmp(coll, "all_to_all")) {
      sendn = recvn = per * (size_t)n;
    }
    float *sb = malloc((sendn ? sendn : 1) * sizeof(float));
    float *rb = malloc((recvn ? recvn : 1) * sizeof(float));
    double *t = malloc((size_t)iters * sizeof(double));
    double *tmax = malloc((size_t)iters * sizeof(double));
    if (!sb || !rb || !t || !tmax) MPI_Abort(MPI_COMM_WORLD, 1);
    for (size_t i = 0; i < sendn; i++) sb[i] = (float)((i + (size_t)rank) % 4);
    memset(rb, 0, (recvn ? recvn : 1) * sizeof(float));
    MPI_Barrier(MPI_COMM_WORLD);
    double cpu = 0, cpu_all = 0;
    for (int it = -warm; it < iters; it++) {
      double c0 = cpu_s(), t0 = now_us();
      int rc;
      if (!strcmp(coll, "all_reduce"))
        rc = MPI_Allreduce(sb, rb, (int)total, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (!strcmp(coll, "all_gather"))
        rc = MPI_Allgather(sb, (int)per, MPI_FLOAT, rb, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      else if (!strcmp(coll, "reduce_scatter"))
        rc = MPI_Reduce_scatter_block(sb, rb, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      else if (!strcmp(coll, "broadcast"))
        rc = MPI_Bcast(rank == 0 ? sb : rb, (int)total, MPI_FLOAT, 0, MPI_COMM_WORLD);
      else if (!strcmp(coll, "all_to_all"))
        rc = MPI_Alltoall(sb, (int)per, MPI_FLOAT, rb, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
      else {
        if (rank == 0) fprintf(stderr, "unknown collective %s\n", coll);
        MPI_Abort(MPI_COMM_WORLD, 2);
        return 2;
      }
      double t1 = now_us();
      if (rc != MPI_SUCCESS) MPI_Abort(MPI_COMM_WORLD, 1);
      if (it >= 0) {
        t[it] = t1 - t0;
        cpu += cpu_s() - c0;
      }
    }
    MPI_Reduce(t, tmax, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&cpu, &cpu_all, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      qsort(tmax, (size_t)iters, sizeof(double), cmp_d);
      double med = iters % 2 ? tmax[iters / 2] : 0.5 * (tmax[iters / 2 - 1] + tmax[iters / 2]);
      /* the size actually moved, rounded down as chorus-bench does */
      long long real = (!strcmp(coll, "all_reduce") || !strcmp(coll, "broadcast"))
                           ? (long long)(total * sizeof(float))
                           : (long long)(per * (size_t)n * sizeof(float));
      /* CPU seconds per GB of the size, averaged over the ranks. */
      double gb = (double)iters * (double)real / 1e9 * n;
      printf("RESULT %s %d %lld %.3f %.4f\n", coll, n, real, med, gb > 0 ? cpu_all / gb : 0.0);
      fflush(stdout);
    }
    free(sb);
    free(rb);
    free(t);
    free(tmax);
  }
  MPI_Finalize();
  return 0;
}
