/*
 * test_async.c - asynchronous work handles, issue order, waits from other
 * threads, tagged point-to-point, and overlapping subgroups used
 * concurrently with their parent.  Run by chorusrun with any N >= 1 (the
 * subgroup cases need N >= 3 and are skipped below that).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus.h"
#include "child_store.h" /* child_now_ms */
#include "harness.h"

static chorus_comm_t g_comm;
static int g_rank, g_size;

#define CHECK_OK(call)                                                          \
  do {                                                                         \
    chorus_result_t st_ = (call);                                              \
    if (st_ != CHORUS_OK) {                                                    \
      HARNESS_FAIL("%s -> %s: %s", #call, chorus_result_name(st_),             \
                   chorus_comm_last_error(g_comm));                            \
      return;                                                                  \
    }                                                                          \
  } while (0)

TEST(many_outstanding_in_order) {
  enum { K = 64, COUNT = 1000 };
  int32_t *bufs = malloc(sizeof(int32_t) * K * COUNT);
  chorus_work_t works[K];
  for (int k = 0; k < K; k++) {
    for (int i = 0; i < COUNT; i++) bufs[k * COUNT + i] = g_rank + k + i;
    CHECK_OK(chorus_all_reduce(g_comm, bufs + k * COUNT, bufs + k * COUNT, COUNT, CHORUS_INT32,
                               CHORUS_SUM, &works[k]));
  }
  /* Waiting for the last one means every earlier one is complete too. */
  CHECK_OK(chorus_work_wait(works[K - 1], -1));
  for (int k = 0; k < K; k++) ASSERT_EQ(chorus_work_test(works[k]), CHORUS_OK);
  for (int k = K - 1; k >= 0; k--) {
    ASSERT_EQ(chorus_work_wait(works[k], -1), CHORUS_OK);
    chorus_work_free(works[k]);
  }
  int64_t n = g_size;
  for (int k = 0; k < K; k++)
    for (int i = 0; i < COUNT; i++)
      ASSERT_EQ(bufs[k * COUNT + i], n * (n - 1) / 2 + n * (k + i));
  free(bufs);
}

/* An async call its caller does not wait for still starts by itself
 * (lazy start leaves it to the caller only briefly): rank 0 issues one and
 * then sleeps without entering the library; the other ranks' blocking call
 * must complete long before rank 0 wakes. */
TEST(unwaited_async_starts_by_itself) {
  enum { SLEEP_MS = 1500 };
  int64_t n = g_size;
  /* Issue and wait at once (after the earlier tests' unwaited calls, the
   * first ones go to the worker at once; these bring lazy start back). */
  for (int i = 0; i < 2000; i++) {
    int64_t v = 1;
    chorus_work_t w;
    CHECK_OK(chorus_all_reduce(g_comm, &v, &v, 1, CHORUS_INT64, CHORUS_SUM, &w));
    CHECK_OK(chorus_work_wait(w, -1));
    chorus_work_free(w);
    ASSERT_EQ(v, n);
  }
  int64_t a = g_rank;
  if (g_rank == 0) {
    chorus_work_t w;
    CHECK_OK(chorus_all_reduce(g_comm, &a, &a, 1, CHORUS_INT64, CHORUS_SUM, &w));
    struct timespec nap = {SLEEP_MS / 1000, (SLEEP_MS % 1000) * 1000000L};
    nanosleep(&nap, NULL);
    CHECK_OK(chorus_work_wait(w, -1));
    chorus_work_free(w);
  } else {
    double t0 = child_now_ms();
    CHECK_OK(chorus_all_reduce(g_comm, &a, &a, 1, CHORUS_INT64, CHORUS_SUM, NULL));
    double took = child_now_ms() - t0;
    printf("rank %d: rank 0's unwaited call completed after %.1f ms (it waits at %d ms)\n",
           g_rank, took, SLEEP_MS);
    ASSERT_TRUE(took < SLEEP_MS / 2);
  }
  ASSERT_EQ(a, n * (n - 1) / 2);
}

TEST(blocking_after_async_keeps_order) {
  int64_t a = g_rank, b = 1;
  chorus_work_t w;
  CHECK_OK(chorus_all_reduce(g_comm, &a, &a, 1, CHORUS_INT64, CHORUS_SUM, &w));
  /* Blocking call queued behind the async one. */
  CHECK_OK(chorus_all_reduce(g_comm, &b, &b, 1, CHORUS_INT64, CHORUS_SUM, NULL));
  ASSERT_EQ(chorus_work_test(w), CHORUS_OK);
  ASSERT_EQ(a, (int64_t)g_size * (g_size - 1) / 2);
  ASSERT_EQ(b, g_size);
  chorus_work_free(w);
}

static void *waiter(void *arg) {
  chorus_work_t w = arg;
  return (void *)(intptr_t)chorus_work_wait(w, -1);
}

TEST(wait_from_another_thread) {
  float x[4096];
  for (int i = 0; i < 4096; i++) x[i] = (float)(g_rank + 1);
  chorus_work_t w;
  CHECK_OK(chorus_all_reduce(g_comm, x, x, 4096, CHORUS_FLOAT32, CHORUS_MAX, &w));
  pthread_t t;
  pthread_create(&t, NULL, waiter, w);
  void *ret;
  pthread_join(t, &ret);
  ASSERT_EQ((intptr_t)ret, CHORUS_OK);
  for (int i = 0; i < 4096; i++) ASSERT_TRUE(x[i] == (float)g_size);
  chorus_work_free(w);
}

TEST(wait_timeout_then_complete) {
  if (g_size < 2) return;
  /* Rank 1 posts a receive nobody has sent yet: a zero timeout reports
   * INPROGRESS; after a barrier rank 0 sends and the wait completes. */
  int32_t v = -1;
  if (g_rank == 1) {
    chorus_work_t w;
    CHECK_OK(chorus_recv(g_comm, &v, 1, CHORUS_INT32, 0, 5, &w));
    ASSERT_EQ(chorus_work_wait(w, 0), CHORUS_INPROGRESS);
    ASSERT_EQ(chorus_work_test(w), CHORUS_INPROGRESS);
    int32_t one = 1;
    CHECK_OK(chorus_send(g_comm, &one, 1, CHORUS_INT32, 0, 6, NULL)); /* "go" */
    ASSERT_EQ(chorus_work_wait(w, -1), CHORUS_OK);
    ASSERT_EQ(v, 1234);
    chorus_work_free(w);
  } else if (g_rank == 0) {
    int32_t go = 0, payload = 1234;
    CHECK_OK(chorus_recv(g_comm, &go, 1, CHORUS_INT32, 1, 6, NULL));
    CHECK_OK(chorus_send(g_comm, &payload, 1, CHORUS_INT32, 1, 5, NULL));
  }
  CHECK_OK(chorus_barrier(g_comm, NULL));
}

TEST(p2p_tags_out_of_order) {
  if (g_size < 2) return;
  int right = (g_rank + 1) % g_size, left = (g_rank + g_size - 1) % g_size;
  /* Send tags 1, 2, 3 (3 twice: FIFO within a tag); receive 3, 2, 1, 3. */
  int64_t s[4] = {100 + g_rank, 200 + g_rank, 300 + g_rank, 400 + g_rank};
  int tags[4] = {1, 2, 3, 3};
  chorus_work_t sw[4];
  for (int i = 0; i < 4; i++) CHECK_OK(chorus_send(g_comm, &s[i], 1, CHORUS_INT64, right, tags[i], &sw[i]));
  int64_t r[4];
  CHECK_OK(chorus_recv(g_comm, &r[2], 1, CHORUS_INT64, left, 3, NULL));
  CHECK_OK(chorus_recv(g_comm, &r[1], 1, CHORUS_INT64, left, 2, NULL));
  CHECK_OK(chorus_recv(g_comm, &r[0], 1, CHORUS_INT64, left, 1, NULL));
  CHECK_OK(chorus_recv(g_comm, &r[3], 1, CHORUS_INT64, left, 3, NULL));
  for (int i = 0; i < 4; i++) {
    ASSERT_EQ(chorus_work_wait(sw[i], -1), CHORUS_OK);
    chorus_work_free(sw[i]);
    ASSERT_EQ(r[i], s[i] - g_rank + left);
  }
}

TEST(irecv_send_wait_ring) {
  /* torch's irecv / send / wait pattern around a ring must not deadlock. */
  if (g_size < 2) return;
  int right = (g_rank + 1) % g_size, left = (g_rank + g_size - 1) % g_size;
  int32_t in = -1, out = 1000 + g_rank;
  chorus_work_t w;
  CHECK_OK(chorus_recv(g_comm, &in, 1, CHORUS_INT32, left, 0, &w));
  CHECK_OK(chorus_send(g_comm, &out, 1, CHORUS_INT32, right, 0, NULL));
  CHECK_OK(chorus_work_wait(w, -1));
  chorus_work_free(w);
  ASSERT_EQ(in, 1000 + left);
}

TEST(p2p_large) {
  if (g_size < 2) return;
  size_t count = (8u << 20) / 4 + 5;
  float *a = malloc(count * 4), *b = malloc(count * 4);
  for (size_t i = 0; i < count; i++) a[i] = (float)((i + (size_t)g_rank) % 1000);
  int right = (g_rank + 1) % g_size, left = (g_rank + g_size - 1) % g_size;
  chorus_work_t w;
  CHECK_OK(chorus_send(g_comm, a, count, CHORUS_FLOAT32, right, 9, &w));
  CHECK_OK(chorus_recv(g_comm, b, count, CHORUS_FLOAT32, left, 9, NULL));
  CHECK_OK(chorus_work_wait(w, -1));
  chorus_work_free(w);
  for (size_t i = 0; i < count; i++) ASSERT_TRUE(b[i] == (float)((i + (size_t)left) % 1000));
  free(a);
  free(b);
}

/* ---------------------------------------------------------- subgroups */

typedef struct {
  chorus_comm_t comm;
  int iters;
  int64_t expect;
  int failed;
  char err[512];
} loop_arg_t;

static void *loop_allreduce(void *p) {
  loop_arg_t *a = p;
  for (int i = 0; i < a->iters && !a->failed; i++) {
    int64_t v = chorus_comm_rank(a->comm) + i;
    chorus_result_t st = chorus_all_reduce(a->comm, &v, &v, 1, CHORUS_INT64, CHORUS_SUM, NULL);
    int64_t n = chorus_comm_size(a->comm);
    if (st != CHORUS_OK || v != a->expect + n * i) {
      a->failed = 1;
      snprintf(a->err, sizeof a->err, "iter %d: st=%d v=%lld: %s", i, (int)st, (long long)v,
               chorus_comm_last_error(a->comm));
    }
  }
  return NULL;
}

TEST(overlapping_subgroups_concurrently) {
  if (g_size < 3) return;
  int n = g_size;
  int *ra = malloc(sizeof(int) * (size_t)n), *rb = malloc(sizeof(int) * (size_t)n);
  for (int i = 0; i < n - 1; i++) ra[i] = i;          /* A = 0..n-2 */
  for (int i = 0; i < n - 1; i++) rb[i] = n - 1 - i;  /* B = n-1..1 (reversed order) */
  chorus_comm_t A = NULL, B = NULL, P = NULL;
  CHECK_OK(chorus_comm_new_group(g_comm, ra, n - 1, &A));
  CHECK_OK(chorus_comm_new_group(g_comm, rb, n - 1, &B));
  CHECK_OK(chorus_comm_split(g_comm, g_rank % 2, -g_rank, &P)); /* parity, reversed */
  ASSERT_TRUE((A != NULL) == (g_rank <= n - 2));
  ASSERT_TRUE((B != NULL) == (g_rank >= 1));
  ASSERT_TRUE(P != NULL);
  if (B) ASSERT_EQ(chorus_comm_rank(B), n - 1 - g_rank);
  int psize = (n + (g_rank % 2 ? 0 : 1)) / 2;
  ASSERT_EQ(chorus_comm_size(P), psize);
  /* Key -rank: the highest parent rank of the colour is rank 0. */
  int pr = 0;
  for (int q = g_rank + 2; q < n; q += 2) pr++;
  ASSERT_EQ(chorus_comm_rank(P), pr);

  enum { ITERS = 100 };
  loop_arg_t args[4];
  memset(args, 0, sizeof args);
  chorus_comm_t comms[4] = {g_comm, A, B, P};
  pthread_t th[4];
  for (int k = 0; k < 4; k++) {
    args[k].comm = comms[k];
    args[k].iters = ITERS;
    if (comms[k]) {
      int64_t m = chorus_comm_size(comms[k]);
      args[k].expect = m * (m - 1) / 2;
      pthread_create(&th[k], NULL, loop_allreduce, &args[k]);
    }
  }
  for (int k = 0; k < 4; k++)
    if (comms[k]) pthread_join(th[k], NULL);
  for (int k = 0; k < 4; k++) {
    if (args[k].failed) printf("group %d: %s\n", k, args[k].err);
    ASSERT_TRUE(!args[k].failed);
  }
  /* A subgroup of a subgroup. */
  if (B) {
    chorus_comm_t BB = NULL;
    CHECK_OK(chorus_comm_split(B, chorus_comm_rank(B) < 2 ? 0 : -1, 0, &BB));
    if (chorus_comm_rank(B) < 2) {
      ASSERT_TRUE(BB != NULL);
      int64_t v = 1;
      CHECK_OK(chorus_all_reduce(BB, &v, &v, 1, CHORUS_INT64, CHORUS_SUM, NULL));
      ASSERT_EQ(v, chorus_comm_size(BB));
      chorus_comm_destroy(BB);
    } else {
      ASSERT_TRUE(BB == NULL);
    }
  }
  chorus_comm_destroy(A);
  chorus_comm_destroy(B);
  chorus_comm_destroy(P);
  free(ra);
  free(rb);
  CHECK_OK(chorus_barrier(g_comm, NULL));
}

TEST(invalid_arguments_are_rejected) {
  float x = 0;
  ASSERT_EQ(chorus_all_reduce(g_comm, &x, &x, 1, CHORUS_FLOAT32, CHORUS_BAND, NULL),
            CHORUS_ERR_NOT_SUPPORTED);
  ASSERT_CONTAINS(chorus_comm_last_error(g_comm), "bitwise");
  ASSERT_EQ(chorus_broadcast(g_comm, &x, 1, CHORUS_FLOAT32, g_size, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_all_reduce(g_comm, NULL, &x, 1, CHORUS_FLOAT32, CHORUS_SUM, NULL),
            CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_send(g_comm, &x, 1, CHORUS_FLOAT32, g_rank, 0, NULL), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_comm_set_algo(g_comm, CHORUS_COLL_ALL_REDUCE, "nonsense"), CHORUS_ERR_INVALID_ARG);
  /* Zero counts are legal everywhere, NULL buffers included. */
  CHECK_OK(chorus_reduce(g_comm, NULL, NULL, 0, CHORUS_FLOAT32, CHORUS_SUM, 0, NULL));
  chorus_comm_set_algo(g_comm, CHORUS_COLL_ALL_REDUCE, "reduce_broadcast");
  CHECK_OK(chorus_all_reduce(g_comm, NULL, NULL, 0, CHORUS_FLOAT32, CHORUS_SUM, NULL));
  chorus_comm_set_algo(g_comm, CHORUS_COLL_ALL_REDUCE, NULL);
  CHECK_OK(chorus_all_gather(g_comm, NULL, NULL, 0, CHORUS_INT8, NULL));
  /* Still healthy: argument errors do not fail the communicator. */
  ASSERT_EQ(chorus_comm_status(g_comm), CHORUS_OK);
  CHECK_OK(chorus_barrier(g_comm, NULL));
}

/* chorusrun starts every rank on this host; CHORUS_HOST_ID=h<rank> (the
 * UCX runs) makes each a host of its own. */
TEST(same_host) {
  const char *id = getenv("CHORUS_HOST_ID");
  int own = id && id[0] == 'h' && atoi(id + 1) == g_rank;
  for (int r = 0; r < g_size; r++)
    ASSERT_EQ(chorus_comm_same_host(g_comm, r), own ? r == g_rank : 1);
  ASSERT_EQ(chorus_comm_same_host(g_comm, -1), -1);
  ASSERT_EQ(chorus_comm_same_host(g_comm, g_size), -1);
  ASSERT_EQ(chorus_comm_same_host(NULL, 0), -1);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  chorus_result_t st = chorus_comm_init_env(&g_comm);
  if (st != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(g_comm);
  g_size = chorus_comm_size(g_comm);
  RUN(many_outstanding_in_order);
  RUN(blocking_after_async_keeps_order);
  RUN(unwaited_async_starts_by_itself);
  RUN(wait_from_another_thread);
  RUN(wait_timeout_then_complete);
  RUN(p2p_tags_out_of_order);
  RUN(irecv_send_wait_ring);
  RUN(p2p_large);
  RUN(overlapping_subgroups_concurrently);
  RUN(invalid_arguments_are_rejected);
  RUN(same_host);
  chorus_comm_destroy(g_comm);
  return HARNESS_DONE();
}
