/*
 * comm.h - the communicator and its work handles (private to core/).
 *
 * A world communicator owns a context (chorus__ctx_t): the transport with its
 * connections and progress thread, the store client, and the store server if
 * this rank hosts it.  Subgroups share their world's context (reference
 * counted), so a subgroup may outlive a destroyed world handle.
 *
 * Execution: every call becomes an operation (struct chorus_work) with a
 * sequence number taken, under the communicator's lock, in the order calls
 * enter the library.  A blocking call on an idle communicator runs its
 * operation on the calling thread; otherwise operations are queued and the
 * communicator's worker thread (started on first need) runs them in order.
 * Only one collective of a communicator executes at a time.
 *
 * Point-to-point calls bypass the queue: they are posted to the transport
 * when called (so the order of sends and receives between two ranks is the
 * order of the calls) and complete independently of collectives, which is
 * what torch's isend/irecv/send/recv patterns need (irecv; send; wait must
 * not deadlock).
 */
#ifndef CHORUS_CORE_COMM_H
#define CHORUS_CORE_COMM_H

#include <pthread.h>
#include <stdint.h>

#include "algo/algo.h"
#include "chorus.h"
#include "transport/shm.h"
#include "transport/transport.h"

typedef struct chorus__ctx {
  chorus__tp_t *tp;
  chorus_store_t *store;
  chorus_store_server_t *server;
  int refs; /* communicators using it */
  pthread_mutex_t lock;
  int rank, size;
  uint64_t world_id;
  uint64_t *host; /* per world rank: hash of its host name and boot id */
  int local_count; /* world ranks on this host */
  char *rec_prefix; /* where the ranks' records are (chorus__rdzv_record);
                       NULL: the transport was given every address */
  chorus_store_t *lookup_store; /* reads them while another thread uses store */
  chorus__memreg_t *memreg; /* chorus_mem_alloc memory, mine and mapped */
  /* What a larger world grown from this one needs (grow.c): the job key,
   * the store's address and where joiners and members meet in it. */
  chorus__key_t key;
  char store_host[256];
  int store_port;
  char join_base[200];
} chorus__ctx_t;

enum { CHORUS__WORK_QUEUED, CHORUS__WORK_RUNNING, CHORUS__WORK_DONE };

struct chorus_work {
  struct chorus_work *next;
  chorus_comm_t comm;
  chorus__coll_t c;
  chorus__fp_t fp;
  uint64_t seq; /* 0 for point-to-point */
  int p2p;      /* posted straight to the transport, never queued */
  chorus__req_t req;
  int state;
  int refs; /* the caller's handle + the queue */
  int on_stack; /* a blocking call's record on its caller's stack: never freed */
  int64_t t_start, t_end; /* CLOCK_MONOTONIC ns: execution began / ended */
  int64_t lazy_until;     /* the worker leaves it to its caller until then */
  chorus_result_t result;
  char err[1024];
};

struct chorus_comm {
  chorus__ctx_t *ctx;
  chorus__ep_t *ep;
  uint64_t id;
  int rank, size;
  int *world_ranks; /* group rank -> world rank */
  int local_rank, local_size;
  int timeout_ms;
  int debug_checks;
  int lazy_start; /* CHORUS_LAZY_START */
  int forced_algo[CHORUS_COLL_COUNT]; /* -1: automatic */
  uint64_t next_seq;
  uint64_t children; /* subgroups created so far (for their ids) */
  uint64_t shrinks;  /* chorus_comm_shrink calls so far (their epochs) */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct chorus_work *q_head, *q_tail;
  int executing; /* atomic: an operation runs (inline or on the worker) */
  int nqueued;   /* atomic: operations in the queue */
  int stopping;
  pthread_t worker;
  int worker_started;
  /* The worker sleeps on wcond, woken only when it has work (a queued
   * operation it may start) or must stop; callers waiting for an
   * operation's end sleep on cond.  Lazy start (coll.c): */
  pthread_cond_t wcond;
  int worker_ticking;   /* the worker wakes every LAZY_TICK_NS, not only on a signal */
  int64_t last_lazy_ns; /* when an operation was last left to its caller */
  int eager_left;       /* async calls that go to the worker at once, after one
                         * that its caller did not wait for */
  char last_error[1024];
  chorus__pool_t pool; /* scratch kept between collectives */
  chorus__shm_t *shm;  /* every member on this host: the group's segment */
  chorus__topo_t topo; /* the members' hosts (hierarchical algorithms, the selector) */
  unsigned algo_logged[CHORUS_COLL_COUNT]; /* algorithms already logged (executor only) */
  int failure_logged; /* the first failure was logged (atomic) */
};

/* Records msg as the communicator's last error (thread-safe). */
void chorus__comm_set_error(chorus_comm_t comm, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Creates a communicator over ctx for the given world ranks (ctx gains a
 * reference).  Called for the world and for subgroups. */
chorus_result_t chorus__comm_create(chorus__ctx_t *ctx, uint64_t id, const int *world_ranks,
                                    int n, int my_rank, int timeout_ms, chorus_comm_t *out);

/* A communicator derived from parent (subgroup, shrunk group) over world
 * ranks world[0..n), this rank at index me: it inherits the parent's
 * timeout, forced algorithms and debug checks, and gets its shared-memory
 * segment when every member is on this host (collective over the members).
 * On failure the reason is on parent and *out is NULL. */
chorus_result_t chorus__comm_derive(chorus_comm_t parent, uint64_t id, const int *world, int n,
                                    int me, chorus_comm_t *out);

/* Makes a world as chorus_comm_init does.  key, when not NULL, is the job
 * key (a world grown from another: the members hold it already); join_base,
 * when not NULL, is where the world's joiners meet (default: the world's
 * own store prefix followed by "join/"). */
chorus_result_t chorus__world_make(const chorus_config_t *cfg, const chorus__key_t *key,
                                   const char *join_base, chorus_comm_t *out);

/* CHORUS_TIMEOUT in ms (300 s when unset or out of range). */
int chorus__env_timeout_ms(void);
/* chorus_comm_init's own bound: cfg's init_timeout_ms, else
 * CHORUS_INIT_TIMEOUT, else timeout_ms. */
int chorus__init_timeout_ms(const chorus_config_t *cfg, int timeout_ms);

/* The job key a rank that does not serve cfg's store finds (cfg's secret,
 * the configured one, or the agreement file on one host). */
chorus_result_t chorus__world_key(const chorus_config_t *cfg, int timeout_ms,
                                  chorus__key_t *key);

/* Records the reason a world could not be made (chorus_last_init_error),
 * logs it, returns st. */
chorus_result_t chorus__init_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Applies CHORUS_ALGO and CHORUS_<COLL>_ALGO to a new world; unknown names
 * are errors. */
chorus_result_t chorus__apply_env_algos(chorus_comm_t comm);

/* Gives comm its shared-memory segment when every member is on this host
 * (collective over comm). */
chorus_result_t chorus__shm_setup(chorus_comm_t comm);

#endif
