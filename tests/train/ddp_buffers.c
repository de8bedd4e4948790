/*
 * ddp_buffers.c - chorus_ddp_add_buffer / chorus_ddp_broadcast_buffers
 * across ranks (run by chorusrun with any N >= 1): every rank ends with
 * rank 0's values, in place for one buffer and packed for several, again
 * after rank 0 changes them; ranks that registered different buffers get
 * an error, not a hang and not a silent partial copy.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "chorus.h"
#include "chorus_train.h"
#include "harness.h"

static chorus_comm_t g_comm;
static int g_rank, g_size;
static chorus_gpt_t *g_model;

static float expect_f(int rank, int i) { return (float)(rank * 1000 + i) * 0.5f; }

TEST(one_buffer_in_place) {
  chorus_ddp_t *d;
  ASSERT_EQ(chorus_ddp_create(g_comm, g_model, NULL, &d), CHORUS_OK);
  float stats[333];
  for (int i = 0; i < 333; i++) stats[i] = expect_f(g_rank, i);
  ASSERT_EQ(chorus_ddp_add_buffer(d, stats, 333, CHORUS_FLOAT32), CHORUS_OK);
  ASSERT_EQ(chorus_ddp_broadcast_buffers(d), CHORUS_OK);
  for (int i = 0; i < 333; i++) ASSERT_TRUE(stats[i] == expect_f(0, i));
  chorus_ddp_destroy(d);
}

TEST(several_buffers_packed) {
  chorus_ddp_t *d;
  ASSERT_EQ(chorus_ddp_create(g_comm, g_model, NULL, &d), CHORUS_OK);
  float mean[64];
  int64_t counter = 100 + g_rank;
  uint8_t mask[5];
  uint16_t half[3];
  for (int i = 0; i < 64; i++) mean[i] = expect_f(g_rank, i);
  memset(mask, g_rank + 1, sizeof mask);
  for (int i = 0; i < 3; i++) half[i] = (uint16_t)(g_rank * 10 + i);
  ASSERT_EQ(chorus_ddp_add_buffer(d, mean, 64, CHORUS_FLOAT32), CHORUS_OK);
  ASSERT_EQ(chorus_ddp_add_buffer(d, &counter, 1, CHORUS_INT64), CHORUS_OK);
  ASSERT_EQ(chorus_ddp_add_buffer(d, NULL, 0, CHORUS_FLOAT32), CHORUS_OK); /* empty is fine */
  ASSERT_EQ(chorus_ddp_add_buffer(d, mask, 5, CHORUS_UINT8), CHORUS_OK);
  ASSERT_EQ(chorus_ddp_add_buffer(d, half, 3, CHORUS_BFLOAT16), CHORUS_OK);
  for (int step = 0; step < 3; step++) {
    ASSERT_EQ(chorus_ddp_broadcast_buffers(d), CHORUS_OK);
    for (int i = 0; i < 64; i++) ASSERT_TRUE(mean[i] == expect_f(0, i) + (float)step);
    ASSERT_EQ(counter, 100 + step);
    for (int i = 0; i < 5; i++) ASSERT_EQ(mask[i], 1);
    for (int i = 0; i < 3; i++) ASSERT_EQ(half[i], i);
    /* Every rank updates its copy (as a forward would); rank 0's update
     * is the one that survives the next broadcast. */
    for (int i = 0; i < 64; i++) mean[i] += g_rank == 0 ? 1.0f : 7.0f;
    counter++;
    mask[0] = (uint8_t)(g_rank + 1);
  }
  chorus_ddp_destroy(d);
}

TEST(bad_arguments) {
  chorus_ddp_t *d;
  ASSERT_EQ(chorus_ddp_create(g_comm, g_model, NULL, &d), CHORUS_OK);
  float x;
  ASSERT_EQ(chorus_ddp_add_buffer(d, NULL, 4, CHORUS_FLOAT32), CHORUS_ERR_INVALID_ARG);
  ASSERT_CONTAINS(chorus_train_last_error(), "chorus_ddp_add_buffer");
  ASSERT_EQ(chorus_ddp_add_buffer(d, &x, 1, (chorus_dtype_t)99), CHORUS_ERR_INVALID_ARG);
  ASSERT_EQ(chorus_ddp_broadcast_buffers(d), CHORUS_OK); /* none registered */
  chorus_ddp_destroy(d);
}

/* Last: a mismatch fails the communicator.  The rank that sees it fails at
 * once and tells the others; a rank whose own part of the broadcast was
 * consistent (here rank 1 with 3 ranks: it only compares with the root)
 * may complete the call, but its next collective must fail. */
TEST(different_registrations_fail_everywhere) {
  if (g_size < 2) return;
  chorus_ddp_t *d;
  ASSERT_EQ(chorus_ddp_create(g_comm, g_model, NULL, &d), CHORUS_OK);
  float a[16] = {0}, b[16] = {0};
  ASSERT_EQ(chorus_ddp_add_buffer(d, a, 16, CHORUS_FLOAT32), CHORUS_OK);
  ASSERT_EQ(chorus_ddp_add_buffer(d, b, g_rank == g_size - 1 ? 15 : 16, CHORUS_FLOAT32),
            CHORUS_OK);
  chorus_result_t st = chorus_ddp_broadcast_buffers(d);
  if (st == CHORUS_OK) st = chorus_barrier(g_comm, NULL);
  if (st == CHORUS_OK) HARNESS_FAIL("rank %d: a mismatched broadcast went unnoticed", g_rank);
  else printf("rank %d: %s: %s\n", g_rank, chorus_result_name(st), chorus_comm_last_error(g_comm));
  chorus_ddp_destroy(d);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (chorus_comm_init_env(&g_comm) != CHORUS_OK) {
    fprintf(stderr, "init failed: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(g_comm);
  g_size = chorus_comm_size(g_comm);
  chorus_gpt_config_t cfg = {13, 6, 1, 2, 8};
  if (chorus_gpt_create(&cfg, 2, 7, &g_model) != CHORUS_OK) {
    fprintf(stderr, "model: %s\n", chorus_train_last_error());
    return 1;
  }
  RUN(one_buffer_in_place);
  RUN(several_buffers_packed);
  RUN(bad_arguments);
  RUN(different_registrations_fail_everywhere);
  chorus_gpt_destroy(g_model);
  chorus_comm_destroy(g_comm);
  return HARNESS_DONE();
}
