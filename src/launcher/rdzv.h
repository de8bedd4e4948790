/*
 * rdzv.h - what the rendezvous's files share (rdzv.c, rdzv_keys.c,
 * rdzv_round.c, rdzv_watch.c): this agent's rendezvous (struct rdzv), the
 * calls on the service's keys and the moves between rounds.  Private to
 * those files; the agent and main() call the rendezvous through
 * launcher.h.  The protocol is described at the top of rdzv.c.
 */
#ifndef CHORUS_LAUNCHER_RDZV_H
#define CHORUS_LAUNCHER_RDZV_H

#include <stddef.h>
#include <stdint.h>

#include "launcher/launcher.h"
#include "launcher/rdzv_state.h"
#include "store/store.h"

#define JOIN_POLL_MS 10

typedef struct {
  char id[ID_MAX];
  long counter;  /* the highest heartbeat counter read */
  long replayed; /* a lower counter read after that one (someone replays old values), or 0 */
  int64_t seen;  /* when a read first showed that counter (or we began to look) */
  int64_t read;  /* when the service last answered a read of it (0: never) */
  int done;      /* it has left */
  int exit_code; /* ... with this code */
  int gone;      /* --elastic inplace: reported lost, the group goes on */
} peer_t;

/* An agent's calls on the service and its heartbeat: the connection, the
 * job key that seals every value, this node's id and counter, the peers
 * whose heartbeats it read.  Small on purpose: bench/scale_hb.c plays
 * thousands of agents in one process with the functions below. */
typedef struct {
  kv_t *kv;
  const chorus__key_t *key;   /* the job key (main's, outlives us) */
  char pfx[200];              /* "rdzv/<run id>/" */
  char id[ID_MAX];            /* this node: "<address>/<pid>" */
  long beats;
  int left;                   /* our heartbeat says done */
  int64_t last_ok;            /* when the service last answered */
  int64_t lost_ns;            /* a node silent this long is lost (rdzv_hb_plan_t) */
  peer_t *peers;              /* peer_cap of them; the oldest forgotten when full */
  int npeers, peer_cap;
} rdzv_io_t;

/* How often an agent of a group of n nodes beats, reads the nodes it
 * watches and polls the state, and when it calls a node lost (rdzv_hb.c;
 * the formulas are at the top of rdzv.c). */
typedef struct {
  int nodes;
  int64_t beat_ns;  /* our heartbeat's period */
  int64_t read_ns;  /* the period of reading each watched node's heartbeat */
  int64_t lost_ns;  /* a watched node whose counter has not moved this long is lost */
  int64_t mon_ns;   /* the period of polling the state's fingerprint */
  int64_t full_ns;  /* the period of reading the whole state regardless */
  int64_t bound_ns; /* the longest from a node's death to its naming */
  int64_t slack_ns; /* a read this much later than planned: our silence, not theirs */
} rdzv_hb_plan_t;

/* Each agent watches this many nodes: those after it in group-rank order
 * (a ring), skipping nodes that left or were reported gone. */
#define RDZV_HB_WATCH 2

struct rdzv {
  rdzv_io_t io;               /* the service, our heartbeat, the peers read */
  chorus_store_server_t *srv; /* the rendezvous store, when this agent hosts it */
  chorus_store_server_t *round_srv; /* etcd: the workers' store of our round (group rank 0) */
  char *raw;                  /* the state's text as last read */
  char store_host[128];       /* etcd: the workers' store of this round */
  rstate_t st, nx;            /* last read; the next one being built */
  int dead;                   /* the service was lost: no more calls */
  int64_t next_hb, next_read, next_mon, next_full;
  int64_t svc_lost_base;      /* the service unanswered this long is lost (small groups) */
  int64_t svc_lost_ns;        /* ... and as the group's plan stretches it */
  rdzv_hb_plan_t plan;        /* the heartbeat plan of the group we run in */
  peer_t peers[3 * MAX_NODES];/* io.peers */
  rnode_t group[MAX_NODES];   /* the frozen round this node runs in */
  int ngroup;
};

/* -------------------------------------------------------- rdzv_keys.c */

/* Waits ms (or until a signal arrives: job->got_sig). */
void rdzv__sleep_or_signal(job_t *job, int ms);

/* buf = the job's prefix "rdzv/<run id>/" + the formatted rest. */
void rdzv__key_of(const rdzv_io_t *io, char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* 1 when the service has not answered for svc_lost_ns. */
int rdzv__lost_store(const rdzv_t *rz);
/* The sealed value of key: 1, 0 absent, -1 no answer, -2 not this job's. */
int rdzv__kget(rdzv_io_t *io, const char *key, char **val, char **raw);
/* set: key = text sealed.  0, or -1. */
int rdzv__kset(rdzv_io_t *io, const char *key, const char *text);
/* rz->st from the service: 1, 0 none yet, -1 no answer, -2 corrupt. */
int rdzv__read_state(rdzv_t *rz);
/* rz->nx compare-and-set over the state last read: 1, 0 lost, -1.  A
 * change is announced under `gen` (rdzv__gen_publish). */
int rdzv__write_state(rdzv_t *rz);
/* Prints read_state's message for rc -2. */
void rdzv__say_state_error(const rdzv_t *rz, int rc);
/* Writes our heartbeat: running, or done with code (then io->left). */
int rdzv__beat(rdzv_io_t *io, int done, int code);
/* The peer of node id (a new one: seen now). */
peer_t *rdzv__peer(rdzv_io_t *io, const char *id);
/* Reads id's heartbeat into its peer; NULL when the service did not answer. */
peer_t *rdzv__observe(rdzv_io_t *io, const char *id);
/* 1 when p has not left and, at our last read of it, its heartbeat had not
 * moved for lost_ns. */
int rdzv__peer_lost(const rdzv_io_t *io, const peer_t *p);
/* The round's first failure: *rec is the one that stands.  0 or -1. */
int rdzv__record_failure(rdzv_io_t *io, long round, const fail_t *mine, fail_t *rec);

/* ---------------------------------------------------------- rdzv_hb.c */

/* The plan of a group of n nodes for --rdzv-conf heartbeat and
 * --monitor-interval. */
void rdzv__hb_plan(int64_t heartbeat_ns, int64_t monitor_ns, int n, rdzv_hb_plan_t *plan);
/* The group ranks agent `me` of group[0..n) watches: up to RDZV_HB_WATCH,
 * the next ones in ring order whose peers (if io has one) have neither
 * left nor been reported gone.  Returns how many (into out). */
int rdzv__hb_targets(rdzv_io_t *io, const rnode_t *group, int n, int me,
                     int out[RDZV_HB_WATCH]);
/* One watching step at `now`: reads the heartbeat of each node that agent
 * `me` watches (a node not read for a while is given a fresh lost_ns:
 * that silence was ours).  Returns 1 with *lost when one is lost (with
 * skip_gone, a lost node is marked gone and the next one is watched; 1 is
 * returned once per node), 0, or -1 when the service did not answer. */
int rdzv__hb_watch(rdzv_io_t *io, const rdzv_hb_plan_t *plan, const rnode_t *group, int n,
                   int me, int skip_gone, int64_t now, peer_t **lost);
/* Announces the state whose stored (sealed) text is raw under `gen`: its
 * seal, a fingerprint small to read.  0 or -1. */
int rdzv__gen_publish(rdzv_io_t *io, const char *raw);
/* 1 when `gen` differs from the state raw (or is absent), 0 when it is
 * raw's, -1 no answer. */
int rdzv__gen_changed(rdzv_io_t *io, const char *raw);

/* ------------------------------------------------------ rdzv_watch.c */

/* rz->plan (and the times it sets) for a group of n nodes. */
void rdzv__use_plan(job_t *job, int n);

/* ------------------------------------------------------- rdzv_round.c */

/* Opens the round after our frozen one, or closes the job. */
void rdzv__advance(job_t *job, int failure, const char *lost, int exit_code, const char *reason);
/* Stops the workers' store of our etcd round, if we serve one. */
void rdzv__round_store_stop(rdzv_t *rz);

#endif
