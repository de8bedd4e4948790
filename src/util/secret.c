/*
 * secret.c - see secret.h.
 */
#include "secret.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "env.h"
#include "log.h"
#include "util.h"

int chorus__secret_read_file(const char *path, char *buf, size_t cap, char *why, size_t why_cap) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    int e = errno;
    snprintf(why, why_cap, "cannot open the secret file %s: %s", path, strerror(e));
    return -e;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    snprintf(why, why_cap, "the secret file %s is not a regular file", path);
    return -EINVAL;
  }
  if (st.st_uid != geteuid() || (st.st_mode & 077)) {
    close(fd);
    snprintf(why, why_cap, "the secret file %s must belong to this user (uid %u) and be "
             "readable by nobody else (chmod 600); it is owned by uid %u, mode %03o",
             path, (unsigned)geteuid(), (unsigned)st.st_uid, (unsigned)(st.st_mode & 0777));
    return -EPERM;
  }
  ssize_t n = read(fd, buf, cap - 1);
  int e = errno;
  close(fd);
  if (n < 0) {
    snprintf(why, why_cap, "cannot read the secret file %s: %s", path, strerror(e));
    return -e;
  }
  buf[n] = '\0';
  buf[strcspn(buf, "\r\n")] = '\0';
  if (!buf[0]) {
    snprintf(why, why_cap, "the secret file %s is empty", path);
    return -EINVAL;
  }
  return 0;
}

int chorus__secret_write_file(const char *path, const char *secret) {
  char tmp[4096];
  char rnd[9];
  uint32_t r = 0;
  chorus__random_bytes(&r, sizeof r);
  snprintf(rnd, sizeof rnd, "%08x", r);
  if (snprintf(tmp, sizeof tmp, "%s.%s.tmp", path, rnd) >= (int)sizeof tmp) return -ENAMETOOLONG;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return -errno;
  size_t n = strlen(secret);
  int rc = write(fd, secret, n) == (ssize_t)n && write(fd, "\n", 1) == 1 ? 0 : -EIO;
  if (close(fd) < 0 && rc == 0) rc = -errno;
  if (rc == 0 && rename(tmp, path) < 0) rc = -errno;
  if (rc < 0) unlink(tmp);
  return rc;
}

int chorus__secret_configured(char *buf, size_t cap, char *why, size_t why_cap) {
  const chorus__env_t *env = chorus__env();
  if (env->JOB_SECRET && *env->JOB_SECRET) {
    snprintf(buf, cap, "%s", env->JOB_SECRET);
    return 1;
  }
  if (env->JOB_SECRET_FILE && *env->JOB_SECRET_FILE) {
    if (chorus__secret_read_file(env->JOB_SECRET_FILE, buf, cap, why, why_cap) < 0) return -1;
    return 1;
  }
  return 0;
}

void chorus__secret_source(char *buf, size_t cap) {
  const chorus__env_t *env = chorus__env();
  if (env->JOB_SECRET && *env->JOB_SECRET) snprintf(buf, cap, "CHORUS_JOB_SECRET");
  else if (env->JOB_SECRET_FILE && *env->JOB_SECRET_FILE)
    snprintf(buf, cap, "CHORUS_JOB_SECRET_FILE (%.200s)", env->JOB_SECRET_FILE);
  else snprintf(buf, cap, "nowhere");
}

int chorus__key_for_api(const char *secret, chorus__key_t *key, char *why, size_t why_cap) {
  char buf[CHORUS__SECRET_MAX];
  const chorus__env_t *env = chorus__env();
  int have = 1;
  if (!secret || !*secret) {
    have = chorus__secret_configured(buf, sizeof buf, why, why_cap);
    if (have < 0) return -1;
    secret = have ? buf : NULL;
  }
  if (!have && !env->INSECURE) {
    snprintf(why, why_cap, "no job secret: pass one, set CHORUS_JOB_SECRET or "
             "CHORUS_JOB_SECRET_FILE (the same on every process), or CHORUS_INSECURE=1 to "
             "accept anyone who can reach the port (docs/security.md)");
    return -1;
  }
  if (!have)
    CHORUS_WARN(CHORUS__SUB_STORE, "CHORUS_INSECURE=1 and no job secret: this store accepts "
                "anyone who can reach its port (docs/security.md)");
  int rc = chorus__job_key(secret, env->JOB_ID, key);
  chorus__wipe(buf, sizeof buf);
  if (rc < 0) {
    snprintf(why, why_cap, "cannot derive the job key: %s", strerror(-rc));
    return -1;
  }
  return 0;
}

static int check_dir(const char *path, char *why, size_t why_cap) {
  struct stat st;
  if (lstat(path, &st) < 0) {
    int e = errno;
    snprintf(why, why_cap, "%s: %s", path, strerror(e));
    return -e;
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077)) {
    snprintf(why, why_cap, "%s must be a directory of this user (uid %u) with mode 700; it is "
             "%s, owned by uid %u, mode %03o", path, (unsigned)geteuid(),
             S_ISDIR(st.st_mode) ? "a directory" : "not a directory", (unsigned)st.st_uid,
             (unsigned)(st.st_mode & 0777));
    return -EPERM;
  }
  return 0;
}

/* mkdir 0700 if missing. */
static int make_dir(const char *path, char *why, size_t why_cap) {
  if (mkdir(path, 0700) < 0 && errno != EEXIST) {
    int e = errno;
    snprintf(why, why_cap, "cannot create %s: %s", path, strerror(e));
    return -e;
  }
  return 0;
}

/* make_dir, then check_dir. */
static int make_private(const char *path, char *why, size_t why_cap) {
  int rc = make_dir(path, why, why_cap);
  return rc < 0 ? rc : check_dir(path, why, why_cap);
}

/* buf = dir/name. */
static int join(char *buf, size_t cap, const char *dir, const char *name, char *why,
                size_t why_cap) {
  int n = snprintf(buf, cap, "%s/%s", dir, name);
  if (n < 0 || (size_t)n >= cap) {
    snprintf(why, why_cap, "runtime directory name too long (%s/%s)", dir, name);
    return -ENAMETOOLONG;
  }
  return 0;
}

/* The fallback under the user's home, which no other user can create:
 * $HOME/.cache/chorus-run (.cache made 0700 if missing). */
static int home_dir(char *buf, size_t cap, char *why, size_t why_cap) {
  const char *home = getenv("HOME");
  struct stat st;
  if (!home || *home != '/' || stat(home, &st) < 0 || !S_ISDIR(st.st_mode) ||
      st.st_uid != geteuid()) {
    snprintf(why, why_cap, "HOME (%s) is not a directory of this user", home ? home : "unset");
    return -EPERM;
  }
  char cache[4096];
  int rc = join(cache, sizeof cache, home, ".cache", why, why_cap);
  if (rc == 0) rc = make_dir(cache, why, why_cap);
  if (rc == 0) rc = join(buf, cap, cache, "chorus-run", why, why_cap);
  return rc < 0 ? rc : make_private(buf, why, why_cap);
}

int chorus__runtime_dir(char *buf, size_t cap, char *why, size_t why_cap) {
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  struct stat st;
  if (xdg && *xdg == '/' && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) &&
      st.st_uid == geteuid()) {
    int rc = join(buf, cap, xdg, "chorus", why, why_cap);
    return rc < 0 ? rc : make_private(buf, why, why_cap);
  }
  /* A shared temporary directory: another local user may have made (or
   * linked) chorus-<uid> first.  Then the home fallback -- the same choice
   * on every rank of this user that sees the same files. */
  const char *tmp = getenv("TMPDIR");
  if (!tmp || *tmp != '/') tmp = "/tmp";
  char name[32], first[4096], why1[4400];
  snprintf(name, sizeof name, "chorus-%u", (unsigned)geteuid());
  int rc = join(buf, cap, tmp, name, why, why_cap);
  if (rc < 0) return rc;
  if (make_private(buf, why1, sizeof why1) == 0) return 0;
  snprintf(first, sizeof first, "%s", buf);
  char why2[4400];
  rc = home_dir(buf, cap, why2, sizeof why2);
  if (rc == 0) {
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
      CHORUS_WARN(CHORUS__SUB_INIT, "chorus: cannot use %s (%s); using %s instead. Set "
                  "XDG_RUNTIME_DIR to a private directory, or have the owner of %s remove it",
                  first, why1, buf, first);
    return 0;
  }
  snprintf(why, why_cap, "no private runtime directory: %s; and %s. Set XDG_RUNTIME_DIR to a "
           "directory of this user with mode 700, or CHORUS_JOB_SECRET / "
           "CHORUS_JOB_SECRET_FILE", why1, why2);
  return rc;
}

int chorus__secret_generate(char *buf, size_t cap) {
  uint8_t r[32];
  if (cap < 2 * sizeof r + 1) return -EINVAL;
  int rc = chorus__random_bytes(r, sizeof r);
  if (rc < 0) return rc;
  chorus__hex(buf, r, sizeof r);
  chorus__wipe(r, sizeof r);
  return 0;
}
