/*
 * exit.h - the library when its process exits with it still in use.
 *
 * A program may leave without chorus_comm_destroy: main returns, another
 * thread calls exit(), or a Python program ends with an exception.  exit()
 * then runs the atexit handlers, OpenSSL's cleanup among them (and, later,
 * UCX's destructors), while the library's threads -- the progress thread
 * of each world, the store server -- may be in the middle of a handshake
 * HMAC, an AES-GCM record or a UCX call.  They would touch freed state.
 *
 * So the parts that own threads register an exit hook.  One atexit
 * handler of ours, registered after OpenSSL initialised (atexit runs in
 * reverse order of registration, so ours runs before OpenSSL's cleanup),
 * runs every hook once: each tells its peers where it can, stops its
 * threads within a bound, and leaves its memory to the process's end.
 * Afterwards chorus__exiting() is 1, and teardown calls (a destroy in a
 * later atexit handler) only stop what still runs and free nothing that
 * OpenSSL or UCX might have freed already.
 *
 * A hook runs only in the process that registered it: a child forked
 * from a rank inherits the list but not the threads, and its exit() must
 * leave its parent's state alone.
 */
#ifndef CHORUS_UTIL_EXIT_H
#define CHORUS_UTIL_EXIT_H

#include <pthread.h>
#include <sys/types.h>

typedef struct chorus__exit_hook {
  void (*fn)(void *arg);
  void *arg;
  pid_t pid; /* the process that registered it */
  struct chorus__exit_hook *prev, *next;
  int linked;
} chorus__exit_hook_t;

/* Registers h (owned by the caller, alive until removed) so that fn(arg)
 * runs when the process exits before chorus__exit_hook_remove(h).  Returns
 * 0, or -1 when the process is already exiting (the caller must not start
 * what the hook would stop). */
int chorus__exit_hook_add(chorus__exit_hook_t *h, void (*fn)(void *), void *arg);

/* Unregisters h; waits while the exit handler runs hooks, so that h's
 * owner is never freed under its hook.  Returns 1 when the process is
 * exiting (the caller must then only stop, not free), else 0. */
int chorus__exit_hook_remove(chorus__exit_hook_t *h);

/* 1 once the exit handler started, in the process that registered hooks. */
int chorus__exiting(void);

/* pthread_join bounded by ms milliseconds: 0 when joined. */
int chorus__join_within(pthread_t t, int ms);

/* pthread_mutex_lock bounded by ms milliseconds: 0 when locked. */
int chorus__lock_within(pthread_mutex_t *m, int ms);

#endif
