/*
 * output.c - the workers' output: whole lines behind a "[rankN]:" prefix,
 * the last lines of each rank kept for the failure report, and the per-rank
 * log files of --log-dir.
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* ---------------------------------------------------------------- output */

/* Writes the iovecs fully to fd (EINTR, partial writes and a non-blocking fd
 * are handled).  0 or -errno. */
static int write_all_iov(int fd, struct iovec *iov, int cnt) {
  while (cnt > 0) {
    ssize_t n = writev(fd, iov, cnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        (void)poll(&p, 1, 100);
        continue;
      }
      return -errno;
    }
    while (cnt > 0 && (size_t)n >= iov->iov_len) {
      n -= (ssize_t)iov->iov_len;
      iov++;
      cnt--;
    }
    if (cnt > 0) {
      iov->iov_base = (char *)iov->iov_base + n;
      iov->iov_len -= (size_t)n;
    }
  }
  return 0;
}

/* To our stdout or stderr (fd 1 or 2).  On EPIPE and other errors the
 * destination is marked broken and its output dropped from then on. */
static void write_iov(job_t *job, int fd, struct iovec *iov, int cnt) {
  if (job->out_broken[fd]) return;
  if (write_all_iov(fd, iov, cnt) != 0) job->out_broken[fd] = 1;
}

/* ------------------------------------------------------------- log files */

/* DIR/<run id>: the run's log directory.  A run id may hold '/' and start
 * with '.' (rdzv_run_id_ok), which would nest directories or, as "..",
 * climb out of DIR: here those become '_'.  0, or -ENAMETOOLONG. */
static int log_run_dir(const job_t *job, char *out, size_t cap) {
  char id[sizeof job->run_id];
  snprintf(id, sizeof id, "%s", job->run_id);
  for (char *c = id; *c; c++)
    if (*c == '/' || (c == id && *c == '.')) *c = '_';
  int n = snprintf(out, cap, "%s/%s", job->log_dir, id);
  return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : 0;
}

/* Worker w's log file for stream k (0 stdout, 1 stderr) in the current
 * round: DIR/<run id>/attempt_<round>/<local rank>/{stdout,stderr}.log, or
 * with k -1 the directory holding them.  0, or -ENAMETOOLONG. */
static int log_path(const job_t *job, const worker_t *w, int k, char *out, size_t cap) {
  char run[4096];
  if (log_run_dir(job, run, sizeof run) != 0) return -ENAMETOOLONG;
  int n = snprintf(out, cap, "%s/attempt_%ld/%d%s", run, job->round, w->local_rank,
                   k < 0 ? "" : k == 0 ? "/stdout.log" : "/stderr.log");
  return n < 0 || (size_t)n >= cap ? -ENAMETOOLONG : 0;
}

/* mkdir -p: creates every missing directory of path with mode 0700 (logs
 * may hold anything the workers print).  0, or -errno after a message
 * naming the directory that could not be made. */
static int make_dirs(char *path) {
  for (char *p = path + 1;; p++) {
    if (*p != '/' && *p != '\0') continue;
    char c = *p;
    *p = '\0';
    int rc = mkdir(path, 0700) == 0 || errno == EEXIST ? 0 : -errno;
    if (rc < 0)
      fprintf(stderr, "chorusrun: cannot create the log directory %s: %s (check --log-dir)\n",
              path, strerror(-rc));
    *p = c;
    if (rc < 0 || c == '\0') return rc;
  }
}

int log_open(job_t *job, const worker_t *w, int fds[2]) {
  fds[0] = fds[1] = -1;
  int which = job->log_dir ? job->redirects[w->local_rank] | job->tee[w->local_rank] : 0;
  if (!which) return 0;
  char dir[4096], path[4096 + 16];
  if (log_path(job, w, -1, dir, sizeof dir) != 0) {
    fprintf(stderr, "chorusrun: the log directory under '%s' would be too long (%zu bytes at "
            "most); choose a shorter --log-dir\n", job->log_dir, sizeof dir - 1);
    return -ENAMETOOLONG;
  }
  int rc = make_dirs(dir);
  if (rc < 0) return rc;
  for (int k = 0; k < 2; k++) {
    if (!(which & (k == 0 ? STD_OUT : STD_ERR))) continue;
    snprintf(path, sizeof path, "%s/%s", dir, k == 0 ? "stdout.log" : "stderr.log");
    /* Truncated: a run id given again (--rdzv-id) starts its logs afresh. */
    fds[k] = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOCTTY, 0600);
    if (fds[k] < 0) {
      int e = errno;
      fprintf(stderr, "chorusrun: cannot open the log file %s: %s (check --log-dir)\n", path,
              strerror(e));
      if (k == 1 && fds[0] >= 0) close(fds[0]);
      fds[0] = fds[1] = -1;
      return -e;
    }
  }
  if (!job->logs_shown) {
    char run[4096];
    if (log_run_dir(job, run, sizeof run) == 0)
      fprintf(stderr, "chorusrun: logs in %s (attempt_<restart>/<local rank>/stdout.log, "
              "stderr.log)\n", run);
    job->logs_shown = 1;
  }
  return 0;
}

/* Writing stream s's log file failed (disk full...): says so once, closes
 * it and sends the stream's lines to the terminal instead, so that nothing
 * more is lost. */
static void log_failed(job_t *job, worker_t *w, stream_t *s, int err) {
  char path[4096 + 16];
  int k = s == &w->st[0] ? 0 : 1;
  if (log_path(job, w, k, path, sizeof path) != 0) snprintf(path, sizeof path, "(?)");
  fprintf(stderr, "chorusrun: cannot write rank %d's log %s: %s; its %s goes to the terminal "
          "from now on\n", w->rank, path, strerror(err), k == 0 ? "stdout" : "stderr");
  close(s->log_fd);
  s->log_fd = -1;
  s->term = 1;
}

static void tail_add(worker_t *w, const char *line, size_t len) {
  size_t keep = CHORUS__MIN(len, (size_t)TAIL_LINE_MAX);
  char *s = xmalloc(keep + 4);
  memcpy(s, line, keep);
  if (keep < len) memcpy(s + keep, "...", 3), keep += 3;
  s[keep] = '\0';
  free(w->tail[w->tail_next]);
  w->tail[w->tail_next] = s;
  w->tail_next = (w->tail_next + 1) % TAIL_LINES;
  if (w->tail_count < TAIL_LINES) w->tail_count++;
}

void tail_clear(worker_t *w) {
  for (int i = 0; i < TAIL_LINES; i++) {
    free(w->tail[i]);
    w->tail[i] = NULL;
  }
  w->tail_next = w->tail_count = 0;
}

/* One line (without its newline) of worker w to stream s's destinations:
 * its log file as it is, the terminal behind the prefix. */
static void emit_line(job_t *job, worker_t *w, stream_t *s, const char *line, size_t len) {
  if (s->log_fd >= 0) {
    struct iovec iov[2] = {{(void *)line, len}, {"\n", 1}};
    int rc = write_all_iov(s->log_fd, iov, 2);
    if (rc < 0) log_failed(job, w, s, -rc);
  }
  if (s->term) {
    char prefix[32];
    int plen = job->prefix ? snprintf(prefix, sizeof prefix, "[rank%d]:", w->rank) : 0;
    struct iovec iov[3] = {{prefix, (size_t)plen}, {(void *)line, len}, {"\n", 1}};
    write_iov(job, s->out_fd, iov, 3);
  }
  tail_add(w, line, len);
}

void stream_close(job_t *job, worker_t *w, stream_t *s) {
  if (s->fd < 0) return;
  if (s->len > 0) emit_line(job, w, s, s->buf, s->len); /* unterminated last line */
  s->len = 0;
  close(s->fd);
  s->fd = -1;
  if (s->log_fd >= 0) close(s->log_fd);
  s->log_fd = -1;
}

/* Reads what is available (one read) and writes out the complete lines. */
void stream_read(job_t *job, worker_t *w, stream_t *s) {
  ssize_t n = read(s->fd, s->buf + s->len, LINE_CAP - s->len);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (n <= 0) { /* EOF (or an error, treated alike) */
    stream_close(job, w, s);
    return;
  }
  size_t start = 0, scan = s->len, end = s->len + (size_t)n;
  for (;;) {
    char *nl = memchr(s->buf + scan, '\n', end - scan);
    if (!nl) break;
    size_t at = (size_t)(nl - s->buf);
    emit_line(job, w, s, s->buf + start, at - start);
    start = scan = at + 1;
  }
  if (start == 0 && end == LINE_CAP) { /* over-long line: split it here */
    emit_line(job, w, s, s->buf, end);
    start = end;
  }
  memmove(s->buf, s->buf + start, end - start);
  s->len = end - start;
}

void stream_drain(job_t *job, worker_t *w) {
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < 1024 && w->st[k].fd >= 0; i++) {
      struct pollfd p = {.fd = w->st[k].fd, .events = POLLIN};
      if (poll(&p, 1, 0) <= 0) break;
      stream_read(job, w, &w->st[k]);
    }
}

/* Prints the failure report of worker w. */
void report_failure(job_t *job, worker_t *w) {
  int r = w->rank;
  int st = w->status;
  if (w->blame_kind == BLAME_STOPPED) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: it was stopped (SIGSTOP or ^Z) "
            "while the others waited for it, and they failed at their timeout\n", r,
            (int)w->pid);
  } else if (w->blame_kind == BLAME_NAMED) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: the others timed out waiting for it, "
            "and every one of their messages names it; it was alive but did not take part "
            "(busy in its own code, or blocked elsewhere), until chorusrun stopped the group\n",
            r, (int)w->pid);
  } else if (WIFEXITED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: exit code %d\n", r, (int)w->pid,
            WEXITSTATUS(st));
  } else if (WIFSIGNALED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: killed by signal %d (%s)%s\n", r,
            (int)w->pid, WTERMSIG(st), signal_name(WTERMSIG(st)),
            WCOREDUMP(st) ? ", core dumped" : "");
  }
  char dir[4096];
  if (job->log_dir && (job->redirects[w->local_rank] | job->tee[w->local_rank]) &&
      log_path(job, w, -1, dir, sizeof dir) == 0)
    fprintf(stderr, "chorusrun: rank %d's log files: %s\n", r, dir);
  if (w->tail_count == 0) {
    fprintf(stderr, "chorusrun: rank %d printed nothing\n", r);
    return;
  }
  fprintf(stderr, "chorusrun: last %d output lines of rank %d:\n", w->tail_count, r);
  for (int i = 0; i < w->tail_count; i++) fprintf(stderr, "  | %s\n", tail_line(w, i));
}

const char *tail_line(const worker_t *w, int i) {
  return w->tail[(w->tail_next - w->tail_count + i + TAIL_LINES) % TAIL_LINES];
}
