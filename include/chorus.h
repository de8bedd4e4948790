/*
 * chorus.h - the one public header of libchorus, a collective-communication
 * library for CPU processes (what torch.distributed's Gloo backend offers, in
 * C).
 *
 * A communicator ("process group") is created by rendezvous through a
 * key-value store (env:// style: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
 * or split from a parent.  Every collective exists in one function that is
 * blocking when its last argument `work` is NULL and asynchronous when it is
 * not (torch's async_op=True): the call then returns at once and *work
 * receives a handle to wait on, test and free.
 *
 * Conventions that hold for every function in this header:
 *  - Every function that can fail returns chorus_result_t.  0 is success,
 *    CHORUS_INPROGRESS (positive) means "not done yet", negative values are
 *    errors.  The human-readable reason is kept on the communicator
 *    (chorus_comm_last_error) and on the work handle (chorus_work_error).
 *  - Counts are in elements of the given dtype, not bytes.  Zero counts are
 *    legal everywhere.  Out-of-place buffers must not overlap; passing the same
 *    pointer for send and receive buffers selects the in-place form.
 *  - Collectives on one communicator complete in the order they were issued,
 *    on every rank.  Several threads may issue calls on one communicator; the
 *    order is the order in which calls enter the library, and the program
 *    must make that order the same on every rank.
 *  - Nothing blocks forever: every wait is bounded by the communicator's
 *    timeout (CHORUS_TIMEOUT, default 300 s).  A dead peer, a timed-out peer or
 *    a mismatched collective fails the communicator on every surviving rank
 *    (a mismatch or a timeout with the same code everywhere, other failures
 *    of a peer as CHORUS_ERR_REMOTE); after that every call returns the
 *    error until chorus_comm_destroy().
 *  - The library never calls exit() or abort() and never installs signal
 *    handlers.  It ignores SIGPIPE only for its own writes (MSG_NOSIGNAL).
 */
#ifndef CHORUS_H
#define CHORUS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(CHORUS_BUILDING_LIBRARY) && defined(__GNUC__)
#define CHORUS_API __attribute__((visibility("default")))
#else
#define CHORUS_API
#endif

#define CHORUS_VERSION_MAJOR 0
#define CHORUS_VERSION_MINOR 1
#define CHORUS_VERSION_PATCH 0
#define CHORUS_VERSION                                                          \
  (CHORUS_VERSION_MAJOR * 10000 + CHORUS_VERSION_MINOR * 100 +                 \
   CHORUS_VERSION_PATCH)

/* Returns CHORUS_VERSION of the library actually linked. */
CHORUS_API int chorus_version(void);

/* ---------------------------------------------------------------- status */

/* X(name, value, description).  The description says where to look next. */
#define CHORUS_RESULT_MAP(X)                                                    \
  X(OK, 0, "success")                                                          \
  X(INPROGRESS, 1, "operation still in progress")                              \
  X(ERR_INVALID_ARG, -1, "invalid argument (see the communicator's last error)") \
  X(ERR_NO_MEMORY, -2, "out of memory")                                        \
  X(ERR_SYSTEM, -3, "system call failed (errno is in the message)")            \
  X(ERR_TIMEOUT, -4, "timed out waiting for a peer or the store; "             \
                     "raise CHORUS_TIMEOUT or check the named rank")           \
  X(ERR_REMOTE, -5, "a peer died, closed its connection or reported an error") \
  X(ERR_MISMATCH, -6, "ranks called different collectives or passed "          \
                      "different arguments; compare the calls named")          \
  X(ERR_NOT_SUPPORTED, -7, "operation not supported for these arguments")      \
  X(ERR_INTERNAL, -8, "internal error in chorus; please report it with "       \
                      "CHORUS_LOG_LEVEL=DEBUG output")                         \
  X(ERR_ABORTED, -9, "communicator was aborted")                               \
  X(ERR_PROTOCOL, -10, "malformed or unauthenticated message received")        \
  X(ERR_STORE, -11, "key-value store error (see message for address)")

typedef enum {
#define CHORUS__RESULT_ENUM(name, value, desc) CHORUS_##name = value,
  CHORUS_RESULT_MAP(CHORUS__RESULT_ENUM)
#undef CHORUS__RESULT_ENUM
} chorus_result_t;

/* Static string describing a result code; never NULL. */
CHORUS_API const char *chorus_strerror(chorus_result_t result);
/* Static string with the code's symbolic name ("CHORUS_ERR_TIMEOUT"). */
CHORUS_API const char *chorus_result_name(chorus_result_t result);

/* ------------------------------------------------------- dtypes and ops */

#define CHORUS_DTYPE_MAP(X)                                                     \
  X(INT8, int8, 1)                                                             \
  X(UINT8, uint8, 1)                                                           \
  X(INT32, int32, 4)                                                           \
  X(INT64, int64, 8)                                                           \
  X(FLOAT16, float16, 2)                                                       \
  X(BFLOAT16, bfloat16, 2)                                                     \
  X(FLOAT32, float32, 4)                                                       \
  X(FLOAT64, float64, 8)

typedef enum {
#define CHORUS__DTYPE_ENUM(NAME, name, size) CHORUS_##NAME,
  CHORUS_DTYPE_MAP(CHORUS__DTYPE_ENUM)
#undef CHORUS__DTYPE_ENUM
  CHORUS_DTYPE_COUNT
} chorus_dtype_t;

/* AVG divides the sum by the group size (integer division for integers).
 * BAND/BOR/BXOR are defined for integer dtypes only. */
#define CHORUS_OP_MAP(X)                                                        \
  X(SUM, sum)                                                                  \
  X(PROD, prod)                                                                \
  X(MIN, min)                                                                  \
  X(MAX, max)                                                                  \
  X(AVG, avg)                                                                  \
  X(BAND, band)                                                                \
  X(BOR, bor)                                                                  \
  X(BXOR, bxor)

typedef enum {
#define CHORUS__OP_ENUM(NAME, name) CHORUS_##NAME,
  CHORUS_OP_MAP(CHORUS__OP_ENUM)
#undef CHORUS__OP_ENUM
  CHORUS_OP_COUNT
} chorus_op_t;

/* Size in bytes of one element; 0 for an invalid dtype. */
CHORUS_API size_t chorus_dtype_size(chorus_dtype_t dtype);
/* "float32", "sum", ...; "invalid" for out-of-range values. */
CHORUS_API const char *chorus_dtype_name(chorus_dtype_t dtype);
CHORUS_API const char *chorus_op_name(chorus_op_t op);

/* The collectives, used to name algorithms and in error messages. */
#define CHORUS_COLL_MAP(X)                                                      \
  X(BROADCAST, broadcast)                                                      \
  X(REDUCE, reduce)                                                            \
  X(ALL_REDUCE, all_reduce)                                                    \
  X(SCATTER, scatter)                                                          \
  X(GATHER, gather)                                                            \
  X(ALL_GATHER, all_gather)                                                    \
  X(REDUCE_SCATTER, reduce_scatter)                                            \
  X(ALL_TO_ALL, all_to_all)                                                    \
  X(ALL_TO_ALLV, all_to_allv)                                                  \
  X(BARRIER, barrier)                                                          \
  X(GATHERV, gatherv)                                                          \
  X(ALL_GATHERV, all_gatherv)                                                  \
  X(SEND, send)                                                                \
  X(RECV, recv)

typedef enum {
#define CHORUS__COLL_ENUM(NAME, name) CHORUS_COLL_##NAME,
  CHORUS_COLL_MAP(CHORUS__COLL_ENUM)
#undef CHORUS__COLL_ENUM
  CHORUS_COLL_COUNT
} chorus_coll_t;

CHORUS_API const char *chorus_coll_name(chorus_coll_t coll);

/* ---------------------------------------------------------- communicator */

typedef struct chorus_comm *chorus_comm_t;
typedef struct chorus_work *chorus_work_t;

#define CHORUS_CONFIG_MAGIC 0x43484f52u /* "CHOR" */
#define CHORUS_CONFIG_VERSION 1u

/*
 * Explicit configuration for chorus_comm_init().  Always start from
 * CHORUS_CONFIG_INITIALIZER so fields added later keep their defaults.
 * Strings are copied; the struct may be freed after the call.
 */
typedef struct chorus_config {
  size_t size;          /* sizeof(chorus_config_t), set by the initializer */
  unsigned magic;       /* CHORUS_CONFIG_MAGIC */
  unsigned version;     /* CHORUS_CONFIG_VERSION */
  int rank;             /* 0 <= rank < world_size */
  int world_size;       /* >= 1 */
  const char *store_host; /* address of the store (MASTER_ADDR) */
  int store_port;       /* port of the store (MASTER_PORT) */
  int host_store;       /* 1: this rank serves the store at store_port;
                           0: connect to an existing one; -1 (default):
                           rank 0 serves it unless CHORUS_STORE_EXTERNAL=1 */
  int timeout_ms;       /* <= 0: CHORUS_TIMEOUT from the environment */
  int local_rank;       /* -1: unknown */
  int local_world_size; /* -1: unknown */
  const char *job_secret; /* NULL: CHORUS_JOB_SECRET, CHORUS_JOB_SECRET_FILE,
                             or agreed on one host (docs/security.md) */
  const char *store_prefix; /* NULL: derived from CHORUS_RESTART_COUNT */
  int init_timeout_ms;  /* bound on chorus_comm_init itself (rendezvous,
                           connecting, shared-memory set-up), so a job can
                           fail a silent peer in seconds yet start on a
                           loaded machine; <= 0: CHORUS_INIT_TIMEOUT, else
                           the communicator's timeout */
} chorus_config_t;

#define CHORUS_CONFIG_INITIALIZER                                               \
  {sizeof(chorus_config_t), CHORUS_CONFIG_MAGIC, CHORUS_CONFIG_VERSION, -1, -1, \
   NULL, -1, -1, 0, -1, -1, NULL, NULL, 0}

/*
 * Creates the world communicator from the environment (torchrun's contract):
 * RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and LOCAL_RANK and
 * LOCAL_WORLD_SIZE when present.  Blocks until every rank has joined or the
 * timeout expires.  Collective over all WORLD_SIZE processes.
 * On failure *comm is NULL and the reason is logged at WARN level and
 * available from chorus_last_init_error().
 */
CHORUS_API chorus_result_t chorus_comm_init_env(chorus_comm_t *comm);

/* Same as chorus_comm_init_env() with explicit values (see chorus_config_t). */
CHORUS_API chorus_result_t chorus_comm_init(const chorus_config_t *config,
                                            chorus_comm_t *comm);

/*
 * A key-value service the caller already has -- torch's c10d::Store, a
 * scheduler's, a file system's -- to find the world's store through, the
 * way NCCL passes its unique id.  set stores len bytes under key; get waits
 * up to timeout_ms for key to exist and copies its value into val (at most
 * cap bytes; *len receives the value's full length).  Both return 0, or
 * non-zero with a reason written into err (errcap bytes).  They are called
 * from the thread that calls chorus_comm_init_kv, and only during it.
 */
typedef struct chorus_kv {
  void *ctx;
  int (*set)(void *ctx, const char *key, const void *val, size_t len, char *err,
             size_t errcap);
  int (*get)(void *ctx, const char *key, void *val, size_t cap, size_t *len, int timeout_ms,
             char *err, size_t errcap);
} chorus_kv_t;

/*
 * Same as chorus_comm_init() with the store found through kv: rank 0 starts
 * the world's store on a port the kernel picks (config->store_port when >
 * 0), on every interface (on 127.0.0.1 when config->local_world_size equals
 * world_size), and sets the key "chorus-store" to its port and addresses;
 * the other ranks get it and use the first address that answers.  When no
 * job secret is configured (config->job_secret, CHORUS_JOB_SECRET,
 * CHORUS_JOB_SECRET_FILE), rank 0 makes a fresh one and it travels in that
 * value: the service must then be readable only by the job (torch's
 * TCPStore is readable by anyone who can reach its port: configure a
 * secret where that matters).  config->store_host is ignored.
 */
CHORUS_API chorus_result_t chorus_comm_init_kv(const chorus_config_t *config,
                                               const chorus_kv_t *kv, chorus_comm_t *comm);

/* Reason of the last failed chorus_comm_init*() in this thread. */
CHORUS_API const char *chorus_last_init_error(void);

/*
 * Destroys a communicator.  Waits for its queued work to finish (bounded by
 * the timeout), then releases everything.  Work handles of this communicator
 * must be freed first.  Subgroups share their world's connections, which are
 * closed when the last communicator using them (world or subgroup, in any
 * order) is destroyed: chorus then says goodbye to every peer and waits a
 * bounded time (CHORUS_BYE_TIMEOUT_MS) for theirs, so peers still finishing
 * their last collective do not see a failure.  comm may be NULL.
 */
CHORUS_API chorus_result_t chorus_comm_destroy(chorus_comm_t comm);

/*
 * Aborts a communicator: pending and future calls fail with
 * CHORUS_ERR_ABORTED, peers are told, blocked threads return.  Callable from
 * any thread, including while another thread is blocked in a collective;
 * returns in bounded time.  chorus_comm_destroy() must still be called.
 */
CHORUS_API chorus_result_t chorus_comm_abort(chorus_comm_t comm);

CHORUS_API int chorus_comm_rank(chorus_comm_t comm);
CHORUS_API int chorus_comm_size(chorus_comm_t comm);
/* LOCAL_RANK / LOCAL_WORLD_SIZE when known, else -1. */
CHORUS_API int chorus_comm_local_rank(chorus_comm_t comm);
CHORUS_API int chorus_comm_local_size(chorus_comm_t comm);
/* 1 when rank peer of comm runs on this rank's host (same host name and
 * boot id, exchanged at rendezvous: they share CLOCK_MONOTONIC and can
 * share memory), 0 when not, -1 for a peer that is not a rank of comm. */
CHORUS_API int chorus_comm_same_host(chorus_comm_t comm, int peer);

/* How this rank's messages to rank peer of comm travel (send/recv, and the
 * collectives that do not use shared memory), for diagnostics:
 * "shm ..." through the shared-memory channel (a peer on this host),
 * "tcp LOCAL -> REMOTE (IFACE)" with the connection's addresses and the
 * local interface, "tcp (not connected; listens at ADDR)" before the
 * pair's first message (connections are made on first use), "tcp
 * (connecting to ADDR)" meanwhile, "tcp (connection gone)" once it
 * closed, or "self".
 * Written into buf (truncated to cap, always NUL-terminated).  Returns
 * CHORUS_OK, or CHORUS_ERR_INVALID_ARG (bad comm, peer or buffer). */
CHORUS_API chorus_result_t chorus_comm_link(chorus_comm_t comm, int peer, char *buf, size_t cap);

/* Human-readable reason for the communicator's last error ("" if none).
 * Valid until the next failing call on this communicator. */
CHORUS_API const char *chorus_comm_last_error(chorus_comm_t comm);

/* Sticky state: CHORUS_OK, or the error that failed the communicator. */
CHORUS_API chorus_result_t chorus_comm_status(chorus_comm_t comm);

/* Timeout of waits on this communicator, in milliseconds. */
CHORUS_API int chorus_comm_timeout_ms(chorus_comm_t comm);

/*
 * torch.distributed.new_group(ranks): every rank of `parent` calls it with
 * the same list of distinct parent ranks (in that order they become ranks
 * 0..n-1 of the new group).  Members get a new communicator; non-members get
 * *out = NULL and CHORUS_OK.  Does not block on other ranks.  The new group is
 * independent of its parent: both may be used concurrently from different
 * threads.
 */
CHORUS_API chorus_result_t chorus_comm_new_group(chorus_comm_t parent,
                                                 const int *ranks, int nranks,
                                                 chorus_comm_t *out);

/*
 * MPI_Comm_split / ncclCommSplit: collective over `parent`.  Ranks with the
 * same color form a group, ordered by key then parent rank.  A negative
 * color yields *out = NULL (not a member of any group).
 */
CHORUS_API chorus_result_t chorus_comm_split(chorus_comm_t parent, int color,
                                             int key, chorus_comm_t *out);

/*
 * After members of comm died (ULFM's MPI_Comm_shrink, NCCL's
 * ncclCommShrink): the survivors agree on who is still alive and get a new
 * communicator of exactly those, numbered in their old order.  Every
 * survivor calls it (comm may have failed already; it stays failed: destroy
 * it).  A member counts as dead when its connection is gone or it has sent
 * nothing for about a second; one that has not joined the agreement when
 * timeout_ms runs out (<= 0: comm's timeout) is left out.  The call never
 * hangs: a member that dies during it is either left out or makes the new
 * communicator fail on its first use (shrink again).  A survivor left out
 * gets CHORUS_ERR_REMOTE.  The survivors agree through the job's store,
 * which must outlive the failure: chorusrun serves it; in a world whose
 * rank 0 serves it, rank 0's death makes this fail with CHORUS_ERR_STORE.
 */
CHORUS_API chorus_result_t chorus_comm_shrink(chorus_comm_t comm, int timeout_ms,
                                              chorus_comm_t *out);

/*
 * Elastic growth, the other half of chorus_comm_shrink.  A process that is
 * not part of a running job asks to join it with chorus_comm_join.  config
 * names the job's store as for chorus_comm_init (store_host, store_port,
 * job_secret, and store_prefix: the job's first world's; rank and
 * world_size are ignored) and timeout_ms bounds the wait to be admitted
 * (<= 0: CHORUS_TIMEOUT); with config NULL they come from MASTER_ADDR,
 * MASTER_PORT, the job secret's variables and CHORUS_RESTART_COUNT
 * (chorusrun sets them all, and CHORUS_JOIN=1, for workers it starts into a
 * running job).  The joiner gets a communicator of the grown world.  The members of a communicator learn how
 * many processes wait with chorus_comm_joiners (collective; one store read
 * by rank 0 and a broadcast: cheap enough to call every training step) and
 * admit them all with chorus_comm_grow (collective), which gives every
 * member a communicator of a new world: the members keep their ranks 0..n-1
 * and the joiners follow in the order they asked (*out = NULL and CHORUS_OK
 * when nobody waited).  The old communicator is untouched: destroy it when
 * done with it.  A joiner that gave up before it was admitted is skipped;
 * one that dies after it was admitted makes chorus_comm_grow fail within
 * timeout_ms on every member (the old communicator still works).  The store
 * must outlive the members that made it (chorusrun serves it).
 */
CHORUS_API chorus_result_t chorus_comm_join(const chorus_config_t *config, chorus_comm_t *out);
CHORUS_API chorus_result_t chorus_comm_joiners(chorus_comm_t comm, int *count);
CHORUS_API chorus_result_t chorus_comm_grow(chorus_comm_t comm, int timeout_ms,
                                            chorus_comm_t *out);

/*
 * Forces the algorithm used for `coll` on this communicator ("ring",
 * "recursive_doubling", "binomial", "linear", ...; NULL or "auto" restores the
 * automatic choice).  Every rank must make the same choice; a difference is
 * reported as a mismatch.  Overrides CHORUS_<COLL>_ALGO.
 */
CHORUS_API chorus_result_t chorus_comm_set_algo(chorus_comm_t comm,
                                                chorus_coll_t coll,
                                                const char *name);

/*
 * The algorithm `coll` on `count` elements of `dtype` (the count as passed
 * to the call) would run on this communicator now: the forced one, or the
 * automatic choice.  NULL for bad arguments or a forced shared-memory
 * algorithm the group cannot run.  Every rank gets the same answer.
 */
CHORUS_API const char *chorus_comm_algo(chorus_comm_t comm, chorus_coll_t coll,
                                        size_t count, chorus_dtype_t dtype);

/* Name of the idx-th algorithm registered for coll, or NULL past the end. */
CHORUS_API const char *chorus_algo_name(chorus_coll_t coll, int idx);

/* ------------------------------------------------------------ work handles */

/*
 * Waits until the operation completes, fails, or timeout_ms elapses.
 * Returns the operation's result, or CHORUS_INPROGRESS if timeout_ms >= 0
 * elapsed first (the operation continues).  timeout_ms < 0 waits for the
 * outcome, which cannot take forever: every wait inside an operation is
 * bounded by the communicator's timeout and fails the communicator when it
 * passes (a queued operation may wait for the ones before it).  Callable
 * from any thread.
 */
CHORUS_API chorus_result_t chorus_work_wait(chorus_work_t work, int timeout_ms);

/* CHORUS_INPROGRESS while running, else the operation's result. Never blocks. */
CHORUS_API chorus_result_t chorus_work_test(chorus_work_t work);

/* Reason for the operation's failure ("" if none). Valid until freed. */
CHORUS_API const char *chorus_work_error(chorus_work_t work);

/* The rank a completed recv got its message from (for CHORUS_ANY_SOURCE,
 * the sender it matched); -1 while it is pending, when it failed, and for
 * every other operation. */
CHORUS_API int chorus_work_source(chorus_work_t work);

/* Seconds the operation ran (from the moment it started executing, not
 * when it was queued, to its completion) -- torch's Work.get_duration; 0
 * while it has not finished.  For send/recv: from posting to completion. */
CHORUS_API double chorus_work_duration(chorus_work_t work);

/* The same as two CLOCK_MONOTONIC instants in nanoseconds (both 0 while
 * it has not finished); comparable across the processes of one host. */
CHORUS_API void chorus_work_timestamps(chorus_work_t work, int64_t *start_ns, int64_t *end_ns);

/*
 * Releases the handle.  Freeing a handle does not cancel the operation: the
 * buffers it names must stay valid until it completes (wait first).  For a
 * pending send/recv, free waits for it to complete (bounded by the timeout,
 * which then fails the communicator).  work may be NULL.
 */
CHORUS_API void chorus_work_free(chorus_work_t work);

/* Converts n values from src (of type from) to dst (of type to), for
 * float32 <-> float16 and float32 <-> bfloat16 (also a type to itself):
 * round to nearest even, NaN stays NaN, overflow to float16 gives
 * infinity -- the conversions chorus's own reductions use.  For gradient
 * compression and the like.  dst and src must not overlap unless equal
 * types.  CHORUS_ERR_INVALID_ARG for other pairs. */
CHORUS_API chorus_result_t chorus_convert(void *dst, chorus_dtype_t to, const void *src,
                                          chorus_dtype_t from, size_t n);

/* ------------------------------------------------------ shared-memory buffers
 *
 * Memory for collective buffers, shared with the other processes of the
 * job's host.  When every rank of a one-host group passes buffers from
 * chorus_mem_alloc (any offset inside an allocation), all_reduce reads the
 * others' inputs and writes its results straight into their outputs: no
 * staging copies at all; all_gather, all_to_all and reduce_scatter read the
 * others' inputs in place (when every input is such memory), broadcast and
 * scatter the root's (when the root's is).  Calls where some rank passes
 * ordinary memory work as usual, through the staging buffers.  An allocation can be used with
 * comm and with every group of comm's world; it needs no other call to be
 * shared.  size 0 is allowed (*ptr is then NULL).  Errors: NO_MEMORY when
 * /dev/shm is full, SYSTEM when it cannot be created or mapped.
 */
CHORUS_API chorus_result_t chorus_mem_alloc(chorus_comm_t comm, size_t size, void **ptr);

/* Frees memory from chorus_mem_alloc (NULL is fine).  No collective may be
 * using it on any rank; other ranks keep their view of it until their
 * communicators are destroyed. */
CHORUS_API chorus_result_t chorus_mem_free(chorus_comm_t comm, void *ptr);

/* --------------------------------------------------------------- collectives
 *
 * Every function below: `work` NULL -> blocking; the call returns when this
 * rank's part is complete and the buffers may be reused.  `work` non-NULL ->
 * asynchronous; the call returns CHORUS_OK once the operation is queued and
 * *work must later be waited for and freed.  Buffers must stay untouched
 * until then.  Argument errors are returned at once in both forms.
 */

/* Root's buf is sent to every rank's buf. */
CHORUS_API chorus_result_t chorus_broadcast(chorus_comm_t comm, void *buf,
                                            size_t count, chorus_dtype_t dtype,
                                            int root, chorus_work_t *work);

/* recvbuf on root receives op(sendbuf of all ranks); recvbuf is ignored
 * elsewhere (may be NULL).  sendbuf == recvbuf on root is in-place. */
CHORUS_API chorus_result_t chorus_reduce(chorus_comm_t comm, const void *sendbuf,
                                         void *recvbuf, size_t count,
                                         chorus_dtype_t dtype, chorus_op_t op,
                                         int root, chorus_work_t *work);

/* Every rank's recvbuf receives op(sendbuf of all ranks). */
CHORUS_API chorus_result_t chorus_all_reduce(chorus_comm_t comm,
                                             const void *sendbuf, void *recvbuf,
                                             size_t count, chorus_dtype_t dtype,
                                             chorus_op_t op, chorus_work_t *work);

/* Root's sendbuf holds size*count elements; rank r receives elements
 * [r*count, (r+1)*count) in recvbuf.  sendbuf is ignored on other ranks.
 * In-place on root: recvbuf == sendbuf + root*count*elemsize. */
CHORUS_API chorus_result_t chorus_scatter(chorus_comm_t comm, const void *sendbuf,
                                          void *recvbuf, size_t count,
                                          chorus_dtype_t dtype, int root,
                                          chorus_work_t *work);

/* Root's recvbuf (size*count elements) receives every rank's sendbuf in rank
 * order.  In-place on root: sendbuf == recvbuf + root*count*elemsize. */
CHORUS_API chorus_result_t chorus_gather(chorus_comm_t comm, const void *sendbuf,
                                         void *recvbuf, size_t count,
                                         chorus_dtype_t dtype, int root,
                                         chorus_work_t *work);

/* all_gather_into_tensor: recvbuf (size*count) receives every rank's sendbuf
 * in rank order.  In-place: sendbuf == recvbuf + rank*count*elemsize. */
CHORUS_API chorus_result_t chorus_all_gather(chorus_comm_t comm,
                                             const void *sendbuf, void *recvbuf,
                                             size_t count, chorus_dtype_t dtype,
                                             chorus_work_t *work);

/* all_gather into a list: recvbufs[r] (count elements each, size entries)
 * receives rank r's sendbuf.  The array itself is copied by the call. */
CHORUS_API chorus_result_t chorus_all_gather_list(chorus_comm_t comm,
                                                  const void *sendbuf,
                                                  void *const *recvbufs,
                                                  size_t count,
                                                  chorus_dtype_t dtype,
                                                  chorus_work_t *work);

/* sendbuf holds size*count elements; rank r's recvbuf (count elements)
 * receives op over all ranks of block r.  In-place: recvbuf ==
 * sendbuf + rank*count*elemsize. */
CHORUS_API chorus_result_t chorus_reduce_scatter(chorus_comm_t comm,
                                                 const void *sendbuf,
                                                 void *recvbuf, size_t count,
                                                 chorus_dtype_t dtype,
                                                 chorus_op_t op,
                                                 chorus_work_t *work);

/* Block j (count elements) of rank i's sendbuf lands in block i of rank j's
 * recvbuf.  sendbuf == recvbuf is in-place. */
CHORUS_API chorus_result_t chorus_all_to_all(chorus_comm_t comm,
                                             const void *sendbuf, void *recvbuf,
                                             size_t count, chorus_dtype_t dtype,
                                             chorus_work_t *work);

/* Variable all_to_all: rank i sends sendcounts[j] elements starting at
 * sdispls[j] to rank j, which receives them at rdispls[i] (recvcounts[i]
 * elements; it must equal the sender's sendcounts[j]).  Displacements are in
 * elements.  The count arrays are copied.  Not in-place. */
CHORUS_API chorus_result_t chorus_all_to_allv(
    chorus_comm_t comm, const void *sendbuf, const size_t *sendcounts,
    const size_t *sdispls, void *recvbuf, const size_t *recvcounts,
    const size_t *rdispls, chorus_dtype_t dtype, chorus_work_t *work);

/* Returns when every rank has entered the barrier. */
CHORUS_API chorus_result_t chorus_barrier(chorus_comm_t comm, chorus_work_t *work);

/* Tagged point-to-point.  A send matches the first recv posted by `peer`
 * with the same tag (tag >= 0), in order.  count must be equal on both ends.
 * A recv whose peer is CHORUS_ANY_SOURCE takes the first message with its
 * tag from any rank (the one that arrived first); receives match in the
 * order they were posted, whatever their peer.  chorus_work_source tells
 * which rank sent it (so such a recv is usually posted with a work handle). */
#define CHORUS_ANY_SOURCE (-1)
CHORUS_API chorus_result_t chorus_send(chorus_comm_t comm, const void *buf,
                                       size_t count, chorus_dtype_t dtype,
                                       int peer, int tag, chorus_work_t *work);
CHORUS_API chorus_result_t chorus_recv(chorus_comm_t comm, void *buf,
                                       size_t count, chorus_dtype_t dtype,
                                       int peer, int tag, chorus_work_t *work);

/*
 * Variable-size byte gathers (gather_object / all_gather_object): each rank
 * contributes `len` bytes, lengths may differ.  The library exchanges the
 * lengths itself and allocates the result: *out receives one buffer holding
 * all contributions in rank order, and lens (an array of size() entries owned
 * by the caller) receives each rank's length.  Free *out with chorus_free().
 * For gather_bytes, *out and lens are only written on root (NULL elsewhere).
 * Blocking only.
 */
CHORUS_API chorus_result_t chorus_gather_bytes(chorus_comm_t comm,
                                               const void *data, size_t len,
                                               int root, void **out,
                                               size_t *lens);
CHORUS_API chorus_result_t chorus_all_gather_bytes(chorus_comm_t comm,
                                                   const void *data, size_t len,
                                                   void **out, size_t *lens);

/* Frees memory returned by the library (NULL is fine). */
CHORUS_API void chorus_free(void *ptr);

/* ---------------------------------------------------------------- the store
 *
 * The TCP key-value store used for rendezvous, also usable directly (like
 * torch.distributed.TCPStore).  Values are byte strings.  Every blocking call
 * is bounded by the store's timeout.
 */
typedef struct chorus_store chorus_store_t;               /* a client */
typedef struct chorus_store_server chorus_store_server_t; /* a server */

/* Starts a store server listening on host:port (port 0 picks a free port;
 * host NULL: all interfaces).  The server runs on its own thread.
 * secret (here and in chorus_store_connect) authenticates every connection
 * both ways; NULL or "": CHORUS_JOB_SECRET or CHORUS_JOB_SECRET_FILE, else
 * CHORUS_ERR_INVALID_ARG unless CHORUS_INSECURE=1 (docs/security.md). */
CHORUS_API chorus_result_t chorus_store_server_start(const char *host, int port,
                                                     const char *secret,
                                                     chorus_store_server_t **server);
/* Port the server listens on. */
CHORUS_API int chorus_store_server_port(const chorus_store_server_t *server);
/* Stops the server thread, closes every connection and frees it. */
CHORUS_API void chorus_store_server_stop(chorus_store_server_t *server);

/* Connects a client, retrying until timeout_ms if the server is not up yet. */
CHORUS_API chorus_result_t chorus_store_connect(const char *host, int port,
                                                const char *secret,
                                                int timeout_ms,
                                                chorus_store_t **client);
CHORUS_API void chorus_store_close(chorus_store_t *client);
/* Last error message of this client ("" if none). */
CHORUS_API const char *chorus_store_last_error(const chorus_store_t *client);

CHORUS_API chorus_result_t chorus_store_set(chorus_store_t *c, const char *key,
                                            const void *val, size_t len);
/* Blocks until key exists (or timeout); *val is malloc'd, free with
 * chorus_free(). */
CHORUS_API chorus_result_t chorus_store_get(chorus_store_t *c, const char *key,
                                            void **val, size_t *len);
/* Atomically adds delta to the integer stored at key (0 if absent); returns
 * the new value in *result. */
CHORUS_API chorus_result_t chorus_store_add(chorus_store_t *c, const char *key,
                                            int64_t delta, int64_t *result);
/* If key's value equals expected (or key is absent and expected_len == 0
 * with expected == NULL), sets it to desired.  *current receives the value
 * after the call (malloc'd). */
CHORUS_API chorus_result_t chorus_store_compare_set(
    chorus_store_t *c, const char *key, const void *expected, size_t expected_len,
    const void *desired, size_t desired_len, void **current, size_t *current_len);
/* *exists = 1 if every key exists now.  Never blocks on keys. */
CHORUS_API chorus_result_t chorus_store_check(chorus_store_t *c,
                                              const char *const *keys, int nkeys,
                                              int *exists);
/* *deleted = 1 if the key existed. */
CHORUS_API chorus_result_t chorus_store_delete(chorus_store_t *c, const char *key,
                                               int *deleted);
/* Blocks until every key exists; timeout_ms < 0: the client's timeout. */
CHORUS_API chorus_result_t chorus_store_wait(chorus_store_t *c,
                                             const char *const *keys, int nkeys,
                                             int timeout_ms);
CHORUS_API chorus_result_t chorus_store_num_keys(chorus_store_t *c,
                                                 int64_t *num);

#ifdef __cplusplus
}
#endif
#endif /* CHORUS_H */
