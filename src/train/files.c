/*
 * files.c - the training runtime's and its tools' changes to folders a user
 * names (checkpoints, datasets), made so that another local user who can
 * create entries there cannot turn them against this user: nothing is
 * removed or written through a symbolic link, a folder is emptied only if
 * it is this user's own, and a folder anyone may change without the
 * sticky bit is refused (see runtime.h).
 */
#include "runtime.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int chorus__open_regular(const char *path, struct stat *sb) {
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return -1;
  if (fstat(fd, sb) != 0 || !S_ISREG(sb->st_mode)) {
    close(fd);
    return -2;
  }
  return fd;
}

int chorus__dir_check(const char *dir, const char *who, char *why, size_t cap) {
  static int warned; /* once per process */
  int trust = chorus__dir_trust(dir, why, cap);
  if (trust > 0 && who && !__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
    fprintf(stderr, "%s: warning: %s\n", who, why);
  return trust < 0 ? -1 : 0;
}

int chorus__dir_trust(const char *dir, char *why, size_t cap) {
  struct stat sb;
  if (stat(dir, &sb) != 0) {
    snprintf(why, cap, "%s: %s", dir, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(sb.st_mode)) {
    snprintf(why, cap, "%s: not a folder", dir);
    return -1;
  }
  if ((sb.st_mode & S_IWOTH) && !(sb.st_mode & S_ISVTX)) {
    snprintf(why, cap, "%s is writable by every user and has no sticky bit (mode %04o): "
             "anyone could replace or remove its files while they are used.  Use a folder of "
             "your own, or chmod o-w (or +t) it", dir, (unsigned)(sb.st_mode & 07777));
    return -1;
  }
  if (sb.st_uid != geteuid() || (sb.st_mode & S_IWOTH)) {
    snprintf(why, cap, "%s %s: other users can put files there; only entries of this user "
             "(uid %u) are removed or replaced", dir, sb.st_uid != geteuid() ?
             "belongs to another user" : "is writable by every user", (unsigned)geteuid());
    return 1;
  }
  why[0] = '\0';
  return 0;
}

/* Empties the folder open at fd of its files and links (subfolders stay,
 * so the folder's removal then fails): never follows a link. */
static void empty_dir(int fd) {
  int lfd = dup(fd);
  DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
  if (!d) {
    if (lfd >= 0) close(lfd);
    return;
  }
  for (struct dirent *e; (e = readdir(d));) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    struct stat es;
    if (fstatat(fd, e->d_name, &es, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISDIR(es.st_mode))
      unlinkat(fd, e->d_name, 0);
  }
  closedir(d);
}

int chorus__remove_entry(const char *dir, const char *name) {
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return -1;
  struct stat sb;
  int rc = fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW);
  if (rc == 0 && !S_ISDIR(sb.st_mode)) {
    rc = sb.st_uid == geteuid() ? unlinkat(dfd, name, 0) : (errno = EPERM, -1);
  } else if (rc == 0) {
    /* O_NOFOLLOW: a link put in its place since the look above fails. */
    int sfd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat own;
    if (sfd < 0 || fstat(sfd, &own) != 0 || own.st_uid != geteuid() || own.st_ino != sb.st_ino) {
      if (sfd >= 0) errno = EPERM;
      rc = -1;
    } else {
      empty_dir(sfd);
      rc = unlinkat(dfd, name, AT_REMOVEDIR);
    }
    int e = errno;
    if (sfd >= 0) close(sfd);
    errno = e;
  }
  int e = errno;
  close(dfd);
  errno = e;
  return rc;
}

int chorus__own_dir(const char *path, char *why, size_t cap) {
  struct stat sb;
  if (lstat(path, &sb) != 0) {
    snprintf(why, cap, "%s: %s", path, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(sb.st_mode) || sb.st_uid != geteuid()) {
    snprintf(why, cap, "%s is not a folder of this user (%s, uid %u): another user may have put "
             "it there; remove it", path, S_ISLNK(sb.st_mode) ? "a symbolic link" :
             S_ISDIR(sb.st_mode) ? "a folder" : "not a folder", (unsigned)sb.st_uid);
    errno = EPERM;
    return -1;
  }
  return 0;
}

int chorus__create_new(const char *path, mode_t mode) {
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0 && errno == EEXIST) {
    /* A temporary file of an earlier process with this pid, or anyone's
     * link: the name goes (unlink never follows), then a new file. */
    if (unlink(path) == 0)
      fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
  }
  return fd;
}
