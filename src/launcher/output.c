/*
 * output.c - the workers' output: whole lines behind a "[rankN]:" prefix,
 * the last lines of each rank kept for the failure report.
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* ---------------------------------------------------------------- output */

/* Writes the iovecs fully to fd (EINTR, partial writes and a non-blocking fd
 * are handled).  On EPIPE and other errors the destination is marked broken
 * and its output dropped from then on. */
static void write_iov(job_t *job, int fd, struct iovec *iov, int cnt) {
  if (job->out_broken[fd]) return;
  while (cnt > 0) {
    ssize_t n = writev(fd, iov, cnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        (void)poll(&p, 1, 100);
        continue;
      }
      job->out_broken[fd] = 1;
      return;
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

/* One line (without its newline) of worker w to stream s's destination. */
static void emit_line(job_t *job, worker_t *w, stream_t *s, const char *line, size_t len) {
  char prefix[32];
  int plen = job->prefix ? snprintf(prefix, sizeof prefix, "[rank%d]:", w->rank) : 0;
  struct iovec iov[3] = {{prefix, (size_t)plen}, {(void *)line, len}, {"\n", 1}};
  write_iov(job, s->out_fd, iov, 3);
  tail_add(w, line, len);
}

void stream_close(job_t *job, worker_t *w, stream_t *s) {
  if (s->fd < 0) return;
  if (s->len > 0) emit_line(job, w, s, s->buf, s->len); /* unterminated last line */
  s->len = 0;
  close(s->fd);
  s->fd = -1;
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
  (void)job;
  int r = w->rank;
  int st = w->status;
  if (WIFEXITED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: exit code %d\n", r, (int)w->pid,
            WEXITSTATUS(st));
  } else if (WIFSIGNALED(st)) {
    fprintf(stderr, "chorusrun: rank %d (pid %d) failed: killed by signal %d (%s)%s\n", r,
            (int)w->pid, WTERMSIG(st), signal_name(WTERMSIG(st)),
            WCOREDUMP(st) ? ", core dumped" : "");
  }
  if (w->tail_count == 0) {
    fprintf(stderr, "chorusrun: rank %d printed nothing\n", r);
    return;
  }
  fprintf(stderr, "chorusrun: last %d output lines of rank %d:\n", w->tail_count, r);
  int first = (w->tail_next - w->tail_count + TAIL_LINES) % TAIL_LINES;
  for (int i = 0; i < w->tail_count; i++)
    fprintf(stderr, "  | %s\n", w->tail[(first + i) % TAIL_LINES]);
}
