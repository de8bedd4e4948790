/*
 * launcher.h - chorusrun, the launcher: one agent per node that starts the
 * node's workers with torchrun's environment contract, hosts or joins the
 * job's rendezvous, prefixes their output, and stops (or restarts) the whole
 * group when one fails.  The files, one duty each:
 *
 *   main.c     main(): options, job id and secret, the store, the agent run,
 *              teardown
 *   args.c     command-line options and --help
 *   agent.c    the agent: one generation of workers watched to its end (the
 *              poll loop over their output, reaping, stopping), and the
 *              restart loop around generations
 *   spawn.c    starting one worker: the environment written from the
 *              contract table (util/env_contract.def), CPU binding,
 *              fork + execve
 *   output.c   worker output: whole lines behind a "[rankN]:" prefix, the
 *              last lines of each rank for the failure report; the per-rank
 *              log files of --log-dir (--redirects: file only, --tee: both)
 *   guard.c    the cleanup guard process, sweeping leftover descendants,
 *              removing a crashed job's /dev/shm names
 *   signals.c  the self-pipe signal handling and signal names
 *   rdzv.c     several nodes: the rendezvous's connection, opened (hosting
 *              or reaching the service) and left; its protocol is described
 *              at the top of that file and in docs/launcher.md
 *   rdzv_round.c  a rendezvous round: join, last call, freeze, placement,
 *              the next round opened (or the job closed)
 *   rdzv_watch.c  a formed group: heartbeats and lost nodes, admitting
 *              waiting nodes, failure records and the root-cause summary
 *   rdzv_keys.c  the rendezvous's sealed values on the service: the state,
 *              heartbeats, failure records (rdzv.h: what the rdzv files share)
 *   rdzv_hb.c  heartbeats that scale: the plan for a group of H nodes, the
 *              few nodes each agent watches, one watching step
 *   rdzv_state.c  the rendezvous's values as text and the round decisions
 *              that read nothing else, the freeze's rank assignment among
 *              them (rdzv_state.h; unit-tested on their own)
 *   kv_store.c the rendezvous's key-value service on chorus's store (the
 *              c10d and static backends), and starting the launcher's store
 *              servers
 *   kv_etcd.c  the same service on etcd
 *   kv_etcd_codec.c  base64 and the JSON of etcd's replies (kv_etcd.h)
 *   xalloc.c   allocations that cannot fail (out of memory: exit)
 *
 * Design
 *  - One process, one thread of our own (plus the store server's thread,
 *    which blocks every signal).  Everything happens in one poll() loop
 *    over the workers' output pipes and a self-pipe.  Signal handlers only
 *    write the signal number into the self-pipe; the loop does the real work
 *    (reaping, forwarding, stopping), so nothing unsafe runs in a handler.
 *    All signals are blocked around fork() so a child never runs our
 *    handler before it resets them.
 *  - chorusrun hosts the store (chorus_store_server_start) for the whole
 *    job and tells workers CHORUS_STORE_EXTERNAL=1, so rank 0 does not serve
 *    one.  The store outlives restarts: it is never reset.  Each generation
 *    of workers gets CHORUS_RESTART_COUNT (and TORCHELASTIC_RESTART_COUNT)
 *    0, 1, ... and the library prefixes its rendezvous keys with it, so keys
 *    of a failed generation never collide with the next one.  A fresh job id
 *    and job secret (random hex) are made per run; the secret authenticates
 *    store and data connections.
 *  - Workers are started with fork + execve (the program is looked up in
 *    PATH before anything starts, so the child only calls async-signal-safe
 *    functions).  Each worker leads its own process group, so signals sent
 *    to the group reach its children too, and sets PR_SET_PDEATHSIG(SIGKILL)
 *    (checking getppid() afterwards to close the race with our death), so no
 *    worker outlives a chorusrun that was killed with SIGKILL.  chorusrun is
 *    also a child subreaper: descendants orphaned by a worker are reparented
 *    to it, so at the end of every generation it can kill and reap whatever
 *    the workers left behind, even outside their process groups.  Finally a
 *    small guard process (guard.c) SIGKILLs the workers' process groups if
 *    chorusrun itself is SIGKILLed, so the workers' children do not survive
 *    that either.
 *  - Output: each worker's stdout and stderr are pipes read with poll(); a
 *    stream's partial line stays in its buffer until the newline arrives, so
 *    only whole lines are written, each with one writev() to our stdout or
 *    stderr behind a "[rankN]:" prefix.  A line longer than 64 KiB is split.
 *    A final unterminated line is flushed at EOF.  The last TAIL_LINES lines
 *    of each rank are kept for the failure report.  With --log-dir, the
 *    streams chosen by --redirects/--tee also go, raw (no prefix), to
 *    DIR/<run id>/attempt_<round>/<local rank>/{stdout,stderr}.log, written
 *    by us from the same lines (a redirected stream no longer reaches the
 *    terminal; the report's tail is kept all the same).
 *  - Stopping a generation (a worker failed, or we got SIGINT, SIGTERM,
 *    SIGHUP or SIGQUIT): send SIGTERM (or the signal received, forwarded)
 *    to every live worker's group, wait up to the grace period (a second
 *    signal cuts it short), then SIGKILL the groups.  When a worker is
 *    reaped its group is SIGKILLed too (its leftovers die with it).  Once all
 *    workers are reaped, the pipes are drained until EOF (at most DRAIN_MS,
 *    in case an escaped descendant still holds one).  Every wait is bounded:
 *    the loop polls at least once per second and gives up on processes that
 *    survive SIGKILL for ABANDON_MS.
 *  - The first worker that exits non-zero or by a signal while the group is
 *    running is the one blamed; workers that die because we stopped them are
 *    not.  Exit status: 0 if all succeeded, else the blamed worker's exit
 *    code (128+signal if killed by a signal), 128+signal when chorusrun was
 *    itself interrupted (no restart then), 2 for usage errors, 1 for other
 *    launcher errors, 127 when the program cannot be found.
 *  - --max-restarts K: after a failure the group is stopped as above, the
 *    report printed, and all N workers start again with the next
 *    CHORUS_RESTART_COUNT (same store, same job id and secret, same port).
 *  - --elastic inplace: a failed worker is reported and the others go on
 *    (they shrink their communicators, chorus_comm_shrink, through the
 *    job's store); the run succeeds when every worker that did not fail
 *    exits 0.  On several nodes a lost node is reported and the others go
 *    on too; a node whose workers all failed leaves with their exit code
 *    (the store's host stays until the others are done).
 */
#ifndef CHORUS_LAUNCHER_LAUNCHER_H
#define CHORUS_LAUNCHER_LAUNCHER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "chorus.h"
#include "util/crypto.h"
#include "util/secret.h"

#define EXIT_USAGE 2
#define EXIT_LAUNCHER 1
#define EXIT_NOT_FOUND 127

#define LINE_CAP 65536        /* longest line before it is split */
enum { BLAME_NONE, BLAME_STOPPED, BLAME_NAMED };
#define TAIL_LINES 20         /* lines kept per rank for the failure report */
#define TAIL_LINE_MAX 1024    /* bytes kept of each of those lines */
#define DRAIN_MS 2000         /* wait for pipe EOF after all workers exited */
#define ABANDON_MS 10000      /* wait for processes to die after SIGKILL */
#define TICK_MS 1000          /* the loop wakes up at least this often */
#define MAX_NPROC 4096

/* ------------------------------------------------------------ data types */

/* The key-value service a multi-node rendezvous runs on (kv_store.c; the
 * etcd backend is another implementation).  Values are NUL-free strings.
 * Every call is bounded by a short timeout; -1 means the service did not
 * answer correctly, with the reason in err. */
typedef struct kv kv_t;
typedef struct {
  /* 1 and *val (malloc'd) when key exists, 0 when it does not, -1. */
  int (*get)(kv_t *kv, const char *key, char **val);
  int (*set)(kv_t *kv, const char *key, const char *val);
  /* Sets key to desired if its value is expected (expected NULL: if it
   * does not exist).  1 swapped, 0 not, -1. */
  int (*cas)(kv_t *kv, const char *key, const char *expected, const char *desired);
  /* Our address on the connection to the service (numeric), 0 or -1. */
  int (*local_addr)(kv_t *kv, char *host, size_t cap);
  void (*close)(kv_t *kv);
  /* Deletes every key that begins with key: 0 or -1.  NULL for a service
   * that ends with the job (our own store). */
  int (*del_prefix)(kv_t *kv, const char *key);
} kv_ops_t;
struct kv {
  const kv_ops_t *ops;
  char where[300]; /* "host:port" of the service, for messages */
  char err[600];
};

/* How to reach etcd beyond its addresses (torchrun's --rdzv-conf keys
 * protocol, cacert, cert, key; user and password_file are ours).  Any
 * field may be NULL/0. */
typedef struct {
  int https;                 /* endpoints without a scheme use https */
  const char *cacert;        /* CA bundle that signed the members' certificates */
  const char *cert, *key;    /* our client certificate and its key (PEM) */
  const char *user;          /* etcd user (auth enable) ... */
  const char *password_file; /* ... and a file whose first line is the password */
  const char *password;      /* or the password itself (tests) */
} kv_etcd_opts_t;

typedef enum { BACKEND_NONE, BACKEND_STATIC, BACKEND_C10D, BACKEND_ETCD } backend_t;

/* What the rendezvous tells the agent loop (rdzv_poll). */
typedef enum {
  RDZV_EV_NONE,
  RDZV_EV_NEW_ROUND,  /* the group re-forms: stop the workers and join again */
  RDZV_EV_CLOSED,     /* the job ends (no restarts left, a node interrupted) */
  RDZV_EV_STORE_LOST, /* the rendezvous's key-value service stopped answering */
} rdzv_event_t;

typedef struct rdzv rdzv_t;

/* --redirects / --tee values (torchrun's Std): which streams go to the log
 * files. */
#define STD_OUT 1
#define STD_ERR 2

typedef struct {
  int fd;      /* read end of the pipe, -1 once closed */
  int out_fd;  /* where its lines go: 1 or 2 */
  int term;    /* 1: its lines go to out_fd (not redirected, or teed) */
  int log_fd;  /* its log file (--log-dir), -1 when none */
  size_t len;  /* bytes of the pending partial line in buf */
  char *buf;   /* LINE_CAP bytes */
} stream_t;

typedef struct {
  int rank;        /* global rank in the current generation */
  int local_rank;  /* index on this node */
  pid_t pid;       /* also its process group id; 0 when not started */
  int running;     /* started and not reaped yet */
  int status;      /* wait status once reaped */
  int reported;    /* its failure report was printed */
  /* Blamed for others' failure (not its own exit): BLAME_STOPPED, it was
   * stopped while the others failed; BLAME_NAMED, every failed rank's timeout
   * names it.  blame_code: then the job's exit code (the first failure's). */
  int blame_kind, blame_code;
  stream_t st[2];  /* stdout, stderr */
  char *tail[TAIL_LINES];
  int tail_next, tail_count;
} worker_t;

typedef struct {
  /* options */
  int nproc;    /* workers on this node */
  int min_nodes, max_nodes; /* --nnodes MIN:MAX (N: N:N) */
  int node_rank_opt;        /* --node-rank, -1 when not given */
  backend_t backend;        /* BACKEND_NONE: one node, no rendezvous */
  const char *rdzv_host;    /* --rdzv-endpoint host (or --master-addr) */
  int rdzv_port;
  int64_t join_timeout_ns, last_call_ns, close_timeout_ns, heartbeat_ns, monitor_ns;
  kv_etcd_opts_t etcd; /* --rdzv-conf protocol, cacert, cert, key, user, password_file */
  const char *master_addr;
  int master_port;
  int max_restarts;
  int inplace;  /* --elastic inplace: a failed worker does not stop the others */
  int joining;  /* in place: this node was admitted into a running round, its
                   workers join the running job (CHORUS_JOIN=1) */
  int prefix;
  int bind;     /* 1: each worker on its own share of our CPUs (--cpu-bind) */
  const char *log_dir;  /* --log-dir, NULL when not given */
  /* --redirects and --tee by local rank: STD_OUT | STD_ERR bits */
  unsigned char redirects[MAX_NPROC], tee[MAX_NPROC];
  int64_t grace_ns;
  char **argv;  /* program and its arguments (NULL-terminated) */
  char *prog;   /* resolved path of argv[0] */
  /* placement of this node in the current generation */
  int nnodes;      /* nodes in the group */
  int node_rank;   /* this node's rank among them (GROUP_RANK) */
  int rank_base;   /* global rank of this node's local rank 0 */
  int world_size;  /* workers in the whole group */
  char *node_sizes; /* every node's workers, GROUP_RANK order ("8x3,6"; NULL: one
                       node, this one: CHORUS_NODE_SIZES) */
  long round;      /* rendezvous round (CHORUS_RESTART_COUNT: separates the
                      store keys of each generation) */
  long restarts;   /* restarts after failures so far (TORCHELASTIC_RESTART_COUNT) */
  rdzv_t *rz;      /* the rendezvous, several nodes only */
  /* runtime */
  int port;     /* the store's actual port */
  char job_id[17];
  char run_id[128];  /* TORCHELASTIC_RUN_ID: --rdzv-id, else job_id */
  char secret[CHORUS__SECRET_MAX];
  char secret_file[4096]; /* what workers get as CHORUS_JOB_SECRET_FILE */
  worker_t *w;
  int out_broken[3];  /* our stdout/stderr gave EPIPE: drop their output */
  int logs_shown;     /* "logs in ..." was printed */
  int got_sig;        /* first SIGINT/SIGTERM/SIGHUP/SIGQUIT, else 0 */
} job_t;

typedef enum { ACT_RUN, ACT_PRINT_ENV, ACT_ENV_MARKDOWN, ACT_HELP } action_t;


/* ----------------------------------------------------------- xalloc.c */

void *xmalloc(size_t n);
char *xstrdup(const char *s);
char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---------------------------------------------------------- kv_store.c */

/* chorus__store_server_start_key with every signal blocked while the
 * server's thread is created, so that thread never takes one of ours. */
chorus_result_t start_store(const char *host, int port, const chorus__key_t *key,
                            chorus_store_server_t **srv);

/* ------------------------------------------------------------- args.c */

void usage(FILE *f);
/* Fills job's options from argv; exits with EXIT_USAGE after a message on
 * a usage error. */
action_t parse_args(int argc, char **argv, job_t *job);

/* ------------------------------------------------------------ agent.c */

/* Runs generations of workers (restarting up to --max-restarts) until one
 * succeeds, fails for good or we are interrupted.  Returns our exit code. */
int agent_run(job_t *job);

/* --------------------------------- rdzv.c, rdzv_round.c, rdzv_watch.c */

/* Opens the rendezvous: hosts the store when this node is the endpoint (or
 * static node 0), connects to it otherwise.  0, or an exit code after a
 * message. */
int rdzv_open(job_t *job, const chorus__key_t *key);
/* Joins the next round and waits until it is frozen with this node in it:
 * fills job's placement (round, nnodes, node_rank, rank_base, world_size,
 * restarts).  0, or an exit code after a message. */
int rdzv_join(job_t *job);
/* Heartbeats and watches the round; cheap unless one of them is due. */
rdzv_event_t rdzv_poll(job_t *job);
/* Milliseconds until rdzv_poll has work to do. */
int rdzv_poll_ms(const job_t *job);
/* This node's first failure of the round (w, or w NULL with why: an error
 * of ours): records it as the round's root cause if it is the first in the
 * job, then opens the next round (or closes the job: no restarts left). */
void rdzv_failed(job_t *job, const worker_t *w, const char *why);
/* After a round that ended in a failure anywhere: prints the root cause.
 * Returns -1 to join again, else the exit code the job ends with. */
int rdzv_after_failure(job_t *job, rdzv_event_t ev);
/* Every local worker is done (succeeded, or failed with --elastic
 * inplace, where that does not stop the others): tells the others, then
 * (the store's host) serves the store until every other node has left.
 * Returns exit_code. */
int rdzv_finish(job_t *job, int exit_code);
/* We were interrupted by sig: ends the job on every node. */
void rdzv_interrupt(job_t *job, int sig);
/* Leaves with exit_code: says so in our heartbeat; the store's host waits
 * (at most close_timeout) for the others to leave; closes the connection
 * and the store. */
void rdzv_close(job_t *job, int exit_code);
/* 1 when s is usable as a run id (letters, digits, . _ : / -; < 128). */
int rdzv_run_id_ok(const char *s);

/* ---------------------------------------------------------- kv_store.c */

/* Connects to chorus's store at host:port with the job key, retrying for
 * timeout_ms; each later call is bounded by call_timeout_ms.  0, -2 when the
 * store refused our key (another job, or a different secret) or did not
 * prove it holds it, -3 when something accepted the connection but did not
 * answer as a chorus store (garbage, silence, closed at once, another
 * protocol version), -1 when nothing answered (not up yet, unreachable). */
int kv_store_open(const char *host, int port, const chorus__key_t *key, int timeout_ms,
                  int call_timeout_ms, kv_t **out, char *err, size_t cap);

/* ----------------------------------------------------------- kv_etcd.c */


/* Connects to etcd (endpoints "host:port,https://host:port,..."; tries each
 * in turn and fails over to the next when one does not answer), keys under
 * `prefix` (e.g. "/chorus/"); every call bounded by call_timeout_ms.  0, -2
 * when etcd refused us in a way waiting cannot mend (credentials, TLS,
 * permissions, not an etcd anywhere), -1 with err. */
int kv_etcd_open(const char *endpoints, const char *prefix, int timeout_ms, int call_timeout_ms,
                 const kv_etcd_opts_t *opts, kv_t **out, char *err, size_t cap);
/* The value in a /v3/kv/range reply body (kv_etcd_codec.c, for the
 * fuzzer): 1 and *val, 0 no key, -1 with err. */
int kv_etcd__range_reply(const char *body, size_t n, char **val, char *err, size_t cap);

/* ------------------------------------------------------------ spawn.c */

/* Raises RLIMIT_NOFILE for nproc workers' pipes (restored in the workers). */
void raise_nofile(int nproc);
/* Looks the program up like execvp() would, so that the child can use
 * execve().  Returns a malloc'd path or NULL. */
char *resolve_program(const char *name);
/* Starts worker w for the current round (job->round, job->restarts).
 * Returns 0 or -errno (nothing left behind on failure). */
int spawn_worker(job_t *job, worker_t *w);

/* ----------------------------------------------------------- output.c */

/* Opens worker w's log files for the current round (--log-dir), creating
 * the directories (0700): fds[0] stdout's, fds[1] stderr's, -1 for a stream
 * that is not logged.  0, or -errno after a message naming the path. */
int log_open(job_t *job, const worker_t *w, int fds[2]);
/* Reads what is available on s (one read) and writes out complete lines. */
void stream_read(job_t *job, worker_t *w, stream_t *s);
/* Reads everything w's pipes hold now (w has exited), without waiting. */
void stream_drain(job_t *job, worker_t *w);
/* Flushes an unterminated last line and closes the stream (and its log
 * file). */
void stream_close(job_t *job, worker_t *w, stream_t *s);
void tail_clear(worker_t *w);
/* The i-th of a worker's kept last lines, oldest first (i < tail_count);
 * may be NULL. */
const char *tail_line(const worker_t *w, int i);
/* Prints the failure report of worker w (exit status, last lines). */
void report_failure(job_t *job, worker_t *w);

/* ------------------------------------------------------------ guard.c */

extern pid_t g_guard_pid;
extern char g_job_id[17];        /* names the job's /dev/shm segments */
extern char g_secret_file[4096]; /* the secret file we made, removed at exit */

void guard_start(void);
void guard_stop(void);
void guard_send(char op, pid_t pid);
/* Called for every child reaped: if it was the guard, stop using it. */
void guard_reaped(pid_t pid);
/* Kills and reaps every remaining child of ours, bounded by ABANDON_MS. */
void sweep_children(void);
/* Removes /dev/shm names of this job that a crashed worker left. */
void remove_job_segments(void);

/* ---------------------------------------------------------- signals.c */

extern int g_selfpipe[2];
extern struct rlimit g_old_nofile; /* restored in the workers */
extern int g_nofile_raised;

int install_signals(void);
/* In a freshly forked worker (async-signal-safe). */
void child_reset_signals(void);
/* Drains the self-pipe; returns the first terminating signal it held or 0. */
int drain_selfpipe(void);
const char *signal_name(int sig);

#endif
