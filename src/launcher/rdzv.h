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
  int64_t seen;  /* when the counter last grew */
  int done;      /* it has left */
  int exit_code; /* ... with this code */
  int gone;      /* --elastic inplace: reported lost, the group goes on */
} peer_t;

struct rdzv {
  kv_t *kv;
  chorus_store_server_t *srv; /* the rendezvous store, when this agent hosts it */
  chorus_store_server_t *round_srv; /* etcd: the workers' store of our round (group rank 0) */
  const chorus__key_t *key;   /* the job key (main's, outlives us) */
  char pfx[200];              /* "rdzv/<run id>/" */
  char id[ID_MAX];            /* this node: "<address>/<pid>" */
  char *raw;                  /* the state's text as last read */
  char store_host[128];       /* etcd: the workers' store of this round */
  rstate_t st, nx;            /* last read; the next one being built */
  long beats;
  int left;                   /* our heartbeat says done */
  int dead;                   /* the service was lost: no more calls */
  int64_t next_hb, next_mon, last_ok;
  int64_t lost_ns;     /* a node silent this long is lost */
  int64_t svc_lost_ns; /* the service unanswered this long is lost */
  peer_t peers[3 * MAX_NODES];
  int npeers;
  rnode_t group[MAX_NODES];   /* the frozen round this node runs in */
  int ngroup;
};

/* -------------------------------------------------------- rdzv_keys.c */

/* Waits ms (or until a signal arrives: job->got_sig). */
void rdzv__sleep_or_signal(job_t *job, int ms);

/* buf = the job's prefix "rdzv/<run id>/" + the formatted rest. */
void rdzv__key_of(const rdzv_t *rz, char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* 1 when the service has not answered for svc_lost_ns. */
int rdzv__lost_store(const rdzv_t *rz);
/* The sealed value of key: 1, 0 absent, -1 no answer, -2 not this job's. */
int rdzv__kget(rdzv_t *rz, const char *key, char **val, char **raw);
/* set: key = text sealed.  0, or -1. */
int rdzv__kset(rdzv_t *rz, const char *key, const char *text);
/* rz->st from the service: 1, 0 none yet, -1 no answer, -2 corrupt. */
int rdzv__read_state(rdzv_t *rz);
/* rz->nx compare-and-set over the state last read: 1, 0 lost, -1. */
int rdzv__write_state(rdzv_t *rz);
/* Prints read_state's message for rc -2. */
void rdzv__say_state_error(const rdzv_t *rz, int rc);
/* Writes our heartbeat: running, or done with code (then rz->left). */
int rdzv__beat(rdzv_t *rz, int done, int code);
/* The peer of node id (a new one: seen now). */
peer_t *rdzv__peer(rdzv_t *rz, const char *id);
/* Reads id's heartbeat into its peer; NULL when the service did not answer. */
peer_t *rdzv__observe(rdzv_t *rz, const char *id);
/* 1 when p has not left and its heartbeat has not moved for lost_ns. */
int rdzv__peer_lost(const rdzv_t *rz, const peer_t *p);
/* The round's first failure: *rec is the one that stands.  0 or -1. */
int rdzv__record_failure(rdzv_t *rz, long round, const fail_t *mine, fail_t *rec);

/* ------------------------------------------------------- rdzv_round.c */

/* Opens the round after our frozen one, or closes the job. */
void rdzv__advance(job_t *job, int failure, const char *lost, int exit_code, const char *reason);
/* Stops the workers' store of our etcd round, if we serve one. */
void rdzv__round_store_stop(rdzv_t *rz);

#endif
