/*
 * test_runtime_dir.c - the private directory for secret files
 * (chorus__runtime_dir, util/secret.c): another local user who makes or
 * links $TMPDIR/chorus-<uid> first must not stop this user's jobs.  Every
 * case runs in directories of its own (TMPDIR and HOME point into a fresh
 * mkdtemp directory, XDG_RUNTIME_DIR is unset), never in the real /tmp.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "util/secret.h"

static char g_root[256], g_tmp[300], g_home[300], g_squat[400];

static void rm_rf(const char *path) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", path);
}

/* Fresh TMPDIR and HOME under a new root for each case. */
static void fresh(void) {
  if (g_root[0]) rm_rf(g_root);
  snprintf(g_root, sizeof g_root, "/tmp/chorus-test-rundir.XXXXXX");
  if (!mkdtemp(g_root)) {
    perror("mkdtemp");
    exit(1);
  }
  snprintf(g_tmp, sizeof g_tmp, "%s/tmp", g_root);
  snprintf(g_home, sizeof g_home, "%s/home", g_root);
  mkdir(g_tmp, 01777);
  chmod(g_tmp, 01777);
  mkdir(g_home, 0700);
  setenv("TMPDIR", g_tmp, 1);
  setenv("HOME", g_home, 1);
  unsetenv("XDG_RUNTIME_DIR");
  snprintf(g_squat, sizeof g_squat, "%s/chorus-%u", g_tmp, (unsigned)geteuid());
}

static int mode_of(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0 && S_ISDIR(st.st_mode) ? (int)(st.st_mode & 0777) : -1;
}

TEST(plain_tmpdir) {
  fresh();
  char dir[4096], why[600];
  ASSERT_EQ(chorus__runtime_dir(dir, sizeof dir, why, sizeof why), 0);
  ASSERT_STREQ(dir, g_squat);
  ASSERT_EQ(mode_of(dir), 0700);
}

/* Someone else's directory (root can hand it to another uid; otherwise the
 * same check sees a group-writable one). */
TEST(squatted_directory) {
  fresh();
  ASSERT_EQ(mkdir(g_squat, 0777), 0);
  ASSERT_EQ(chmod(g_squat, 0777), 0);
  if (geteuid() == 0) ASSERT_EQ(chown(g_squat, 65534, 65534), 0);
  char dir[4096], why[600], want[400];
  ASSERT_EQ(chorus__runtime_dir(dir, sizeof dir, why, sizeof why), 0);
  snprintf(want, sizeof want, "%s/.cache/chorus-run", g_home);
  ASSERT_STREQ(dir, want);
  ASSERT_EQ(mode_of(dir), 0700);
  /* The same answer every time: ranks of one job must agree. */
  char again[4096];
  ASSERT_EQ(chorus__runtime_dir(again, sizeof again, why, sizeof why), 0);
  ASSERT_STREQ(again, dir);
}

TEST(squatted_symlink) {
  fresh();
  char target[400];
  snprintf(target, sizeof target, "%s/elsewhere", g_root);
  ASSERT_EQ(mkdir(target, 0700), 0);
  ASSERT_EQ(symlink(target, g_squat), 0);
  char dir[4096], why[600], want[400];
  ASSERT_EQ(chorus__runtime_dir(dir, sizeof dir, why, sizeof why), 0);
  snprintf(want, sizeof want, "%s/.cache/chorus-run", g_home);
  ASSERT_STREQ(dir, want);
}

/* Both unusable: an error that names both and says what to do. */
TEST(nowhere) {
  fresh();
  ASSERT_EQ(symlink("/", g_squat), 0);
  setenv("HOME", "/nonexistent-home-of-nobody", 1);
  char dir[4096], why[600];
  ASSERT_TRUE(chorus__runtime_dir(dir, sizeof dir, why, sizeof why) < 0);
  ASSERT_TRUE(strstr(why, g_squat) != NULL);
  ASSERT_TRUE(strstr(why, "HOME") != NULL);
  ASSERT_TRUE(strstr(why, "XDG_RUNTIME_DIR") != NULL);
}

/* XDG_RUNTIME_DIR of this user wins over both. */
TEST(xdg_first) {
  fresh();
  char xdg[400], want[420];
  snprintf(xdg, sizeof xdg, "%s/xdg", g_root);
  ASSERT_EQ(mkdir(xdg, 0700), 0);
  setenv("XDG_RUNTIME_DIR", xdg, 1);
  ASSERT_EQ(mkdir(g_squat, 0777), 0);
  char dir[4096], why[600];
  ASSERT_EQ(chorus__runtime_dir(dir, sizeof dir, why, sizeof why), 0);
  snprintf(want, sizeof want, "%s/chorus", xdg);
  ASSERT_STREQ(dir, want);
  unsetenv("XDG_RUNTIME_DIR");
}

int main(void) {
  RUN(plain_tmpdir);
  RUN(squatted_directory);
  RUN(squatted_symlink);
  RUN(nowhere);
  RUN(xdg_first);
  if (g_root[0]) rm_rf(g_root);
  return HARNESS_DONE();
}
