/*
 * signals.c - chorusrun's signal handling: handlers only write the signal
 * number into a self-pipe that the agent's poll() loop reads; workers get
 * the default actions back before execve().
 */
#include "launcher/launcher.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/util.h"

/* ------------------------------------------------------------- signals */

int g_selfpipe[2] = {-1, -1};
/* Handled signals.  The first four stop the job and are forwarded to the
 * workers; SIGCHLD only wakes the loop up. */
static const int g_sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD};
static struct sigaction g_old_act[CHORUS__ARRAY_LEN(g_sigs)];
static struct sigaction g_old_pipe;
struct rlimit g_old_nofile; /* restored in the workers */
int g_nofile_raised;

/* Async-signal-safe: only write(2), errno preserved. */
static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  (void)!write(g_selfpipe[1], &b, 1);
  errno = saved;
}

int install_signals(void) {
  if (pipe2(g_selfpipe, O_CLOEXEC | O_NONBLOCK) != 0) return -1;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigfillset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_sigs); i++) {
    sigaction(g_sigs[i], NULL, &g_old_act[i]);
    /* Like nohup expects: a SIGHUP ignored at start stays ignored, for us
     * and the workers.  SIGINT/SIGQUIT are handled even when a
     * non-interactive shell started us in the background with them
     * ignored: `chorusrun ... & kill -INT $!` must stop the job. */
    if (g_sigs[i] == SIGHUP && g_old_act[i].sa_handler == SIG_IGN) continue;
    if (sigaction(g_sigs[i], &sa, NULL) != 0) return -1;
  }
  /* A closed stdout must not kill us (and with us the workers). */
  struct sigaction ign;
  memset(&ign, 0, sizeof ign);
  ign.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ign, &g_old_pipe);
  return 0;
}

/* In a freshly forked worker (async-signal-safe): the signals we forward get
 * their default action, so a forwarded SIGINT/SIGTERM works even where we
 * were started with them ignored; the others get back what we inherited. */
void child_reset_signals(void) {
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (size_t i = 0; i < CHORUS__ARRAY_LEN(g_sigs); i++) {
    int sig = g_sigs[i];
    if (sig == SIGINT || sig == SIGTERM || sig == SIGQUIT) sigaction(sig, &dfl, NULL);
    else sigaction(sig, &g_old_act[i], NULL);
  }
  sigaction(SIGPIPE, &g_old_pipe, NULL);
  if (g_nofile_raised) setrlimit(RLIMIT_NOFILE, &g_old_nofile);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
}

const char *signal_name(int sig) {
  switch (sig) {
#define S(name) case name: return #name;
    S(SIGHUP) S(SIGINT) S(SIGQUIT) S(SIGILL) S(SIGTRAP) S(SIGABRT) S(SIGBUS)
    S(SIGFPE) S(SIGKILL) S(SIGUSR1) S(SIGSEGV) S(SIGUSR2) S(SIGPIPE) S(SIGALRM)
    S(SIGTERM) S(SIGCHLD) S(SIGCONT) S(SIGSTOP) S(SIGTSTP) S(SIGTTIN) S(SIGTTOU)
    S(SIGURG) S(SIGXCPU) S(SIGXFSZ) S(SIGVTALRM) S(SIGPROF) S(SIGWINCH) S(SIGIO)
    S(SIGSYS)
#undef S
  }
  return "unknown signal";
}


/* Drains the self-pipe; returns the first terminating signal (SIGINT,
 * SIGTERM, SIGHUP, SIGQUIT) it held, or 0.  SIGCHLD bytes only wake the loop up. */
int drain_selfpipe(void) {
  unsigned char buf[64];
  int term = 0;
  for (;;) {
    ssize_t n = read(g_selfpipe[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; i++)
      if (buf[i] != SIGCHLD && !term) term = buf[i];
  }
  return term;
}
