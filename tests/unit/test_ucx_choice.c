/*
 * test_ucx_choice.c - how a world decides between TCP and UCX between hosts
 * (src/transport/ucx_load.c, built with or without UCX):
 *   - chorus__rdma_active finds the RDMA devices with an active port in a
 *     sysfs-like tree (made here in a temporary directory: a device with an
 *     active port counts, one whose ports are all down or that has no ports
 *     does not);
 *   - chorus__ucx_decide turns every rank's published UCX field into one
 *     answer: UCX only when every rank has an address, an error when a rank
 *     forced UCX and another has none, TCP otherwise.
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "transport/transport.h"

static char g_dir[64];

static void put(const char *dev, const char *port, const char *state) {
  char p[256];
  snprintf(p, sizeof p, "%s/%s", g_dir, dev);
  mkdir(p, 0700);
  snprintf(p, sizeof p, "%s/%s/ports", g_dir, dev);
  mkdir(p, 0700);
  if (!port) return;
  snprintf(p, sizeof p, "%s/%s/ports/%s", g_dir, dev, port);
  mkdir(p, 0700);
  snprintf(p, sizeof p, "%s/%s/ports/%s/state", g_dir, dev, port);
  FILE *f = fopen(p, "w");
  if (f) {
    fputs(state, f);
    fclose(f);
  }
}

TEST(rdma_devices_need_an_active_port) {
  snprintf(g_dir, sizeof g_dir, "/tmp/chorus-ib.XXXXXX");
  ASSERT_TRUE(mkdtemp(g_dir) != NULL);
  char names[128];
  ASSERT_EQ(chorus__rdma_active("/nonexistent/chorus/infiniband", names, sizeof names), 0);
  ASSERT_EQ(chorus__rdma_active(g_dir, names, sizeof names), 0);
  ASSERT_STREQ(names, "");
  put("mlx5_0", "1", "1: DOWN\n");
  put("mlx5_1", NULL, NULL); /* no ports at all */
  ASSERT_EQ(chorus__rdma_active(g_dir, names, sizeof names), 0);
  put("mlx5_0", "2", "4: ACTIVE\n"); /* a second port, up */
  ASSERT_EQ(chorus__rdma_active(g_dir, names, sizeof names), 1);
  ASSERT_STREQ(names, "mlx5_0");
  put("rxe0", "1", "4: ACTIVE\n");
  ASSERT_EQ(chorus__rdma_active(g_dir, names, sizeof names), 2);
  ASSERT_TRUE(strstr(names, "mlx5_0") && strstr(names, "rxe0") && strchr(names, ','));
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
  ASSERT_EQ(system(cmd), 0);
}

TEST(every_rank_agrees) {
  int bad = 7;
  const char *all_auto[] = {"A0a", "A0b", "A0c"};
  ASSERT_EQ(chorus__ucx_decide(all_auto, 3, &bad), 1);
  ASSERT_EQ(bad, -1);
  const char *mixed_forced[] = {"U0a", "A0b", "U0c"};
  ASSERT_EQ(chorus__ucx_decide(mixed_forced, 3, &bad), 1);
  /* One host without RDMA: TCP everywhere, and which rank says so. */
  const char *one_without[] = {"A0a", "-", "A0c", "-"};
  ASSERT_EQ(chorus__ucx_decide(one_without, 4, &bad), 0);
  ASSERT_EQ(bad, 1);
  const char *none[] = {"-", "-"};
  ASSERT_EQ(chorus__ucx_decide(none, 2, &bad), 0);
  ASSERT_EQ(bad, 0);
  /* A rank forced UCX and another cannot: an error, naming it. */
  const char *forced_vs_tcp[] = {"U0a", "U0b", "-"};
  ASSERT_EQ(chorus__ucx_decide(forced_vs_tcp, 3, &bad), -1);
  ASSERT_EQ(bad, 2);
  /* Untrusted fields: anything but U or A is "no address". */
  const char *junk[] = {"A0a", "X0b"};
  ASSERT_EQ(chorus__ucx_decide(junk, 2, &bad), 0);
  ASSERT_EQ(bad, 1);
  const char *empty[] = {"U", ""};
  ASSERT_EQ(chorus__ucx_decide(empty, 2, &bad), -1);
  ASSERT_EQ(bad, 1);
}

int main(void) {
  RUN(rdma_devices_need_an_active_port);
  RUN(every_rank_agrees);
  return HARNESS_DONE();
}
