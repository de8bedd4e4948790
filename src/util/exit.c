/*
 * exit.c - see exit.h.
 */
#include <pthread.h>

#include "exit.h"

#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static chorus__exit_hook_t *g_hooks;
static int g_registered;
static pid_t g_exiting_pid; /* atomic: the process whose handler ran */

/* CLOCK_REALTIME ms from now: what pthread's timed lock and join take. */
static struct timespec realtime_in(int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

static void on_exit_handler(void) {
  pid_t me = getpid();
  __atomic_store_n(&g_exiting_pid, me, __ATOMIC_SEQ_CST);
  /* Bounded: a child forked while another thread of its parent held the
   * lock inherits it held, and must still be able to exit. */
  if (chorus__lock_within(&g_lock, 1000) != 0) return;
  for (chorus__exit_hook_t *h = g_hooks; h; h = h->next)
    if (h->pid == me) h->fn(h->arg);
  pthread_mutex_unlock(&g_lock);
}

int chorus__exiting(void) {
  pid_t p = __atomic_load_n(&g_exiting_pid, __ATOMIC_SEQ_CST);
  return p != 0 && p == getpid();
}

int chorus__exit_hook_add(chorus__exit_hook_t *h, void (*fn)(void *), void *arg) {
  pthread_mutex_lock(&g_lock);
  if (chorus__exiting()) {
    pthread_mutex_unlock(&g_lock);
    return -1;
  }
  if (!g_registered) {
    /* OpenSSL registers its cleanup when it first initialises: make sure
     * it has, so that our handler, registered after it, runs before. */
    OPENSSL_init_crypto(0, NULL);
    g_registered = atexit(on_exit_handler) == 0;
  }
  h->fn = fn;
  h->arg = arg;
  h->pid = getpid();
  h->prev = NULL;
  h->next = g_hooks;
  if (g_hooks) g_hooks->prev = h;
  g_hooks = h;
  h->linked = 1;
  pthread_mutex_unlock(&g_lock);
  return 0;
}

int chorus__exit_hook_remove(chorus__exit_hook_t *h) {
  pthread_mutex_lock(&g_lock);
  if (h->linked) {
    if (h->prev) h->prev->next = h->next;
    else g_hooks = h->next;
    if (h->next) h->next->prev = h->prev;
    h->linked = 0;
  }
  int exiting = chorus__exiting();
  pthread_mutex_unlock(&g_lock);
  return exiting;
}

int chorus__join_within(pthread_t t, int ms) {
  struct timespec ts = realtime_in(ms);
  return pthread_timedjoin_np(t, NULL, &ts);
}

int chorus__lock_within(pthread_mutex_t *m, int ms) {
  struct timespec ts = realtime_in(ms);
  return pthread_mutex_timedlock(m, &ts);
}
