/*
 * args.c - chorusrun's command line (torchrun's option names).
 */
#include "launcher/launcher.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chorus.h"
#include "util/env.h"
#include "util/log.h"
#include "util/util.h"

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die_usage(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("chorusrun: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\nchorusrun --help lists the options\n", stderr);
  va_end(ap);
  exit(EXIT_USAGE);
}

/* --------------------------------------------------------------- options */

void usage(FILE *f) {
  fputs(
      "usage: chorusrun [options] [--] program [args...]\n"
      "\n"
      "Starts program N times on this machine with torchrun's environment\n"
      "contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,\n"
      "MASTER_ADDR, MASTER_PORT), hosts the rendezvous store the workers use,\n"
      "prefixes each line of their output with [rankN]:, and stops every worker\n"
      "when one fails.\n"
      "\n"
      "examples:\n"
      "  chorusrun --standalone -n 4 -- ./prog            # 4 ranks on this machine\n"
      "  chorusrun --nnodes 2 -n 4 --rdzv-endpoint node0:29400 --rdzv-id run7 ./prog\n"
      "                                  # the same line on each of 2 nodes (a shared\n"
      "                                  # CHORUS_JOB_SECRET_FILE on both)\n"
      "  chorusrun --standalone -n 4 --max-restarts 3 -- ./train   # restart on failure\n"
      "\n"
      "workers:\n"
      "  -n, --nproc-per-node N  workers to start (default 1; auto: one per CPU)\n"
      "  --standalone            store on 127.0.0.1 with a free port chosen\n"
      "                          automatically (overrides --master-addr/-port)\n"
      "  --master-addr A         address of the store (default 127.0.0.1)\n"
      "  --master-port P         port of the store (default 29500; 0: any)\n"
      "\n"
      "several nodes (rendezvous):\n"
      "  --nnodes N|MIN:MAX      nodes in the job (default 1); with MIN:MAX the\n"
      "                          group starts once MIN agents joined and the last\n"
      "                          call ran out (or MAX joined), and re-forms with\n"
      "                          what is left after a failure (down to MIN)\n"
      "  --node-rank K           this node's fixed rank (static rendezvous)\n"
      "  --rdzv-backend B        c10d (default with several nodes): the agent on\n"
      "                          the endpoint's node hosts the store, the others\n"
      "                          join it; static: --node-rank K, node 0 hosts the\n"
      "                          store at --master-addr:--master-port, no\n"
      "                          membership changes; etcd: a real etcd (v3 API)\n"
      "                          keeps the rendezvous, group rank 0's agent\n"
      "                          serves each round's workers a store\n"
      "  --rdzv-endpoint H[:P]   where the rendezvous store is (default port\n"
      "                          29400); on one node the same as --master-addr H\n"
      "                          --master-port P; etcd: H:P[,H:P...], its members\n"
      "  --rdzv-id ID            the job's run id, the same on every node\n"
      "                          (default \"none\"; TORCHELASTIC_RUN_ID)\n"
      "  --rdzv-conf K=V,...     join_timeout (s, default 600), last_call_timeout\n"
      "                          (30), close_timeout (30), heartbeat (0.15: a\n"
      "                          node silent for 4 heartbeats is lost); etcd:\n"
      "                          protocol=https, cacert=F, cert=F, key=F (TLS,\n"
      "                          client certificate), user=U, password_file=F\n"
      "  --monitor-interval S    how often the agent reads the rendezvous state\n"
      "                          (default 0.1 s)\n"
      "\n"
      "failures:\n"
      "  --elastic restart|inplace  what a worker's failure does: restart\n"
      "                          (default) stops the group (and restarts it, see\n"
      "                          --max-restarts); inplace reports it (or a lost\n"
      "                          node) and lets the others go on (they call\n"
      "                          chorus_comm_shrink; chorus-train does); a node\n"
      "                          succeeds if its workers that did not fail exit 0\n"
      "  --max-restarts K        after a failure, restart the whole group up\n"
      "                          to K times (default 0)\n"
      "  --grace-period S        seconds between SIGTERM and SIGKILL when\n"
      "                          stopping workers (default 5)\n"
      "\n"
      "output:\n"
      "  --no-prefix             do not prefix output lines\n"
      "  --log-dir DIR           per-rank log files for the streams chosen by\n"
      "                          --redirects/--tee, in DIR/RUN/attempt_R/L/\n"
      "                          stdout.log and stderr.log (RUN: the run id, R:\n"
      "                          the restart, L: the local rank; directories made\n"
      "                          0700); lines are written as printed, no prefix\n"
      "  -r, --redirects V       streams that go to the log files only: 0 none\n"
      "                          (default), 1 stdout, 2 stderr, 3 both; or per\n"
      "                          local rank, e.g. 0:3,1:1 (others 0)\n"
      "  -t, --tee V             streams that go to the log files and to the\n"
      "                          terminal (same values; wins over --redirects)\n"
      "\n"
      "other:\n"
      "  --cpu-bind auto|none    auto (default; CHORUS_CPU_BIND): worker i runs\n"
      "                          on its own share of chorusrun's CPUs (CPU i mod\n"
      "                          C when there are more workers than CPUs), so\n"
      "                          the scheduler cannot stack ranks that wait on\n"
      "                          each other on one core; none: no binding\n"
      "  --print-env             list chorus's environment variables, exit\n"
      "  --env-markdown          the same list as a markdown table\n"
      "  -h, --help              this text\n"
      "Underscores may replace dashes (--nproc_per_node); --opt=value works.\n"
      "\n"
      "Several nodes need a shared secret: CHORUS_JOB_SECRET_FILE (or\n"
      "CHORUS_JOB_SECRET) with the same contents on every node.\n"
      "\n"
      "Workers also get CHORUS_JOB_ID, CHORUS_JOB_SECRET_FILE (a file only this\n"
      "user can read, holding a fresh random secret, or CHORUS_JOB_SECRET's value),\n"
      "CHORUS_STORE_EXTERNAL=1 and CHORUS_RESTART_COUNT (0, 1, ... per restart;\n"
      "the store keeps running across restarts and keys are separated by it).\n"
      "\n"
      "Exit status: 0 if every worker succeeded; else the exit code of the\n"
      "worker the failure report blames (128+N if it was killed by signal N;\n"
      "a worker blamed for the others' timeouts gives their code); 128+N when\n"
      "chorusrun itself got signal N (SIGINT, SIGTERM, SIGHUP or SIGQUIT, forwarded to\n"
      "the workers); 2 for usage errors; 127 if the program is not found;\n"
      "1 for other errors.\n",
      f);
}

static int64_t parse_seconds(const char *opt, const char *v, double lo, double hi) {
  char *end = NULL;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || !end || end == v || *end || !(x >= lo && x <= hi))
    die_usage("%s '%s': %s; it takes seconds from %g to %g", opt, v,
              end && end != v && !*end ? "out of range" : "not a number", lo, hi);
  return (int64_t)(x * 1e9);
}

/* --rdzv-conf join_timeout=600,last_call_timeout=30,... */
static void parse_rdzv_conf(job_t *job, const char *v) {
  char buf[1024];
  if (strlen(v) >= sizeof buf) die_usage("--rdzv-conf is too long");
  snprintf(buf, sizeof buf, "%s", v);
  char *save = NULL;
  for (char *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq) die_usage("--rdzv-conf: '%s' is not KEY=VALUE", kv);
    *eq = '\0';
    const char *k = kv, *val = eq + 1;
    if (!strcmp(k, "join_timeout") || !strcmp(k, "timeout"))
      job->join_timeout_ns = parse_seconds("join_timeout", val, 0.1, 86400 * 7);
    else if (!strcmp(k, "last_call_timeout"))
      job->last_call_ns = parse_seconds("last_call_timeout", val, 0, 86400);
    else if (!strcmp(k, "close_timeout"))
      job->close_timeout_ns = parse_seconds("close_timeout", val, 0, 86400);
    else if (!strcmp(k, "heartbeat"))
      job->heartbeat_ns = parse_seconds("heartbeat", val, 0.01, 3600);
    else if (!strcmp(k, "protocol")) {
      if (strcmp(val, "http") && strcmp(val, "https"))
        die_usage("--rdzv-conf: protocol is http or https, not '%s'", val);
      job->etcd.https = !strcmp(val, "https");
    } else if (!strcmp(k, "cacert"))
      job->etcd.cacert = xstrdup(val);
    else if (!strcmp(k, "cert"))
      job->etcd.cert = xstrdup(val);
    else if (!strcmp(k, "key"))
      job->etcd.key = xstrdup(val);
    else if (!strcmp(k, "user"))
      job->etcd.user = xstrdup(val);
    else if (!strcmp(k, "password_file"))
      job->etcd.password_file = xstrdup(val);
    else if (!strcmp(k, "password"))
      die_usage("--rdzv-conf: give the etcd password in a file (password_file=PATH), not on "
                "the command line, where every local user sees it");
    else
      die_usage("--rdzv-conf: unknown key '%s' (join_timeout, last_call_timeout, "
                "close_timeout, heartbeat; etcd: protocol, cacert, cert, key, user, "
                "password_file)", k);
    if (*val == '\0') die_usage("--rdzv-conf: %s needs a value", k);
  }
}

/* --redirects / --tee V, as torchrun: 0-3 (STD_OUT | STD_ERR) for every
 * local rank, or LOCAL_RANK:V,... with the ranks not named getting 0.
 * Returns the highest local rank named (-1 for the first form). */
static int parse_std(const char *opt, const char *v, unsigned char *by_rank) {
  memset(by_rank, 0, MAX_NPROC);
  if (v[0] >= '0' && v[0] <= '3' && v[1] == '\0') {
    memset(by_rank, v[0] - '0', MAX_NPROC);
    return -1;
  }
  int top = -1;
  for (const char *p = v;;) {
    char *end = NULL;
    errno = 0;
    long r = isdigit((unsigned char)*p) ? strtol(p, &end, 10) : -1;
    if (r < 0 || errno || *end != ':' || end[1] < '0' || end[1] > '3' ||
        (end[2] != ',' && end[2] != '\0'))
      die_usage("%s '%s': not a stream choice; it takes 0 none, 1 stdout, 2 stderr, 3 both, or "
                "per local rank (e.g. 0:3,1:1)", opt, v);
    if (r >= MAX_NPROC)
      die_usage("%s: local rank %ld is out of range (0..%d)", opt, r, MAX_NPROC - 1);
    by_rank[r] = (unsigned char)(end[1] - '0');
    if (r > top) top = (int)r;
    if (end[2] == '\0') return top;
    p = end + 3;
  }
}

static long parse_int_opt(const char *opt, const char *v, long lo, long hi) {
  long x;
  if (chorus__parse_long(v, &x) != 0)
    die_usage("%s '%s': not a whole number; it takes a whole number from %ld to %ld", opt, v, lo,
              hi);
  if (x < lo || x > hi)
    die_usage("%s '%s': out of range; it takes a whole number from %ld to %ld", opt, v, lo, hi);
  return x;
}

/* --rdzv-endpoint as given, and its host: the job's addresses point here. */
static char endpoint_host[256], endpoint_raw[1024];

/* What the options say beyond job's fields, for the checks after them. */
typedef struct {
  int standalone, port_set, addr_set, endpoint_set;
  const char *std_opt; /* the last --redirects or --tee, for messages */
  int std_top[2];      /* the highest local rank each names */
  int endpoint_port;
  const char *backend;
  action_t act;
} cli_t;

/* The defaults, CHORUS_CPU_BIND's among them. */
static void set_defaults(job_t *job) {
  job->min_nodes = job->max_nodes = 1;
  job->node_rank_opt = -1;
  job->join_timeout_ns = 600 * 1000000000LL;
  job->last_call_ns = 30 * 1000000000LL;
  job->close_timeout_ns = 30 * 1000000000LL;
  job->heartbeat_ns = 150 * 1000000LL;
  job->monitor_ns = 100 * 1000000LL;
  job->nproc = 1;
  job->master_addr = "127.0.0.1";
  job->master_port = 29500;
  job->max_restarts = 0;
  job->prefix = 1;
  /* CHORUS_CPU_BIND sets the default; --cpu-bind overrides it. */
  const char *bind_env = chorus__env()->CPU_BIND;
  job->bind = !bind_env || strcmp(bind_env, "none") != 0;
  job->grace_ns = 5000000000LL;
}

/* Normalize: name without leading dashes, '_' -> '-', split at '='.
 * Returns the value given with the option itself (--opt=V, -nV), or NULL. */
static const char *option_name(const char *a, char *name, size_t cap) {
  const char *val = NULL;
  if (a[1] == '-') {
    const char *eq = strchr(a + 2, '=');
    size_t n = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
    if (n >= cap) die_usage("unknown option '%s'", a);
    memcpy(name, a + 2, n);
    name[n] = '\0';
    for (char *c = name; *c; c++)
      if (*c == '_') *c = '-';
    if (eq) val = eq + 1;
  } else if (a[1] == 'n') {
    snprintf(name, cap, "nproc-per-node");
    if (a[2]) val = a + 2;
  } else if (a[1] == 'r' || a[1] == 't') {
    snprintf(name, cap, "%s", a[1] == 'r' ? "redirects" : "tee");
    if (a[2]) val = a + 2;
  } else if (a[1] == 'h' && !a[2]) {
    snprintf(name, cap, "help");
  } else {
    die_usage("unknown option '%s'", a);
  }
  return val;
}

/* The options without a value: 1 when name is one of them. */
static int flag_option(cli_t *c, job_t *job, const char *name) {
  int flag = 1;
  if (!strcmp(name, "standalone")) c->standalone = 1;
  else if (!strcmp(name, "print-env")) c->act = ACT_PRINT_ENV;
  else if (!strcmp(name, "env-markdown")) c->act = ACT_ENV_MARKDOWN;
  else if (!strcmp(name, "no-prefix")) job->prefix = 0;
  else if (!strcmp(name, "help")) c->act = ACT_HELP;
  else flag = 0;
  return flag;
}

/* 1 when name is an option that takes a value. */
static int takes_value(const char *name) {
  static const char *const with_value[] = {
      "nproc-per-node", "master-addr",  "master-port",  "rdzv-endpoint", "nnodes",
      "node-rank",      "max-restarts", "grace-period", "cpu-bind",      "elastic",
      "rdzv-backend",   "rdzv-id",      "rdzv-conf",    "monitor-interval",
      "log-dir",        "redirects",    "tee"};
  int known = 0;
  for (size_t k = 0; k < CHORUS__ARRAY_LEN(with_value); k++)
    if (!strcmp(name, with_value[k])) known = 1;
  return known;
}

/* "workers:" of --help.  1 when name is one of them. */
static int workers_option(cli_t *c, job_t *job, const char *name, const char *val) {
  if (!strcmp(name, "nproc-per-node")) {
    if (!strcmp(val, "auto") || !strcmp(val, "cpu")) {
      long n = sysconf(_SC_NPROCESSORS_ONLN);
      job->nproc = n > 0 ? (int)CHORUS__MIN(n, MAX_NPROC) : 1;
    } else {
      job->nproc = (int)parse_int_opt("--nproc-per-node", val, 1, MAX_NPROC);
    }
  } else if (!strcmp(name, "master-addr")) {
    if (!*val) die_usage("--master-addr needs a non-empty address");
    job->master_addr = val;
    c->addr_set = 1;
  } else if (!strcmp(name, "master-port")) {
    job->master_port = (int)parse_int_opt("--master-port", val, 0, 65535);
    c->port_set = 1;
  } else {
    return 0;
  }
  return 1;
}

/* --rdzv-endpoint V into endpoint_raw, endpoint_host and c's port. */
static void parse_endpoint(cli_t *c, const char *val) {
  /* etcd takes a list (host:port,host:port); the others host[:port]. */
  size_t vl = strlen(val);
  if (vl >= sizeof endpoint_raw) die_usage("--rdzv-endpoint is too long");
  memcpy(endpoint_raw, val, vl + 1);
  c->endpoint_set = 1;
  if (strchr(val, ',')) return;
  /* host[:port]; an IPv6 literal must be written [addr]:port. */
  const char *colon = strrchr(val, ':');
  if (val[0] == '[' && strchr(val, ']') && (!colon || colon < strchr(val, ']')))
    colon = NULL;
  size_t hl = colon ? (size_t)(colon - val) : strlen(val);
  if (hl == 0 || hl >= sizeof endpoint_host) die_usage("--rdzv-endpoint '%s': not an address; it takes HOST[:PORT]", val);
  memcpy(endpoint_host, val, hl);
  endpoint_host[hl] = '\0';
  if (endpoint_host[0] == '[' && endpoint_host[hl - 1] == ']') {
    memmove(endpoint_host, endpoint_host + 1, hl - 2);
    endpoint_host[hl - 2] = '\0';
  }
  c->endpoint_set = 1;
  c->endpoint_port = colon ? (int)parse_int_opt("--rdzv-endpoint port", colon + 1, 0, 65535) : -1;
}

/* "several nodes (rendezvous):" of --help.  1 when name is one of them. */
static int rdzv_option(cli_t *c, job_t *job, const char *name, const char *val) {
  if (!strcmp(name, "rdzv-endpoint")) {
    parse_endpoint(c, val);
  } else if (!strcmp(name, "nnodes")) {
    /* N or MIN:MAX, as torchrun. */
    const char *colon = strchr(val, ':');
    if (colon) {
      char lo[32];
      size_t n = (size_t)(colon - val);
      if (n == 0 || n >= sizeof lo) die_usage("--nnodes '%s': not of that form; it takes N or MIN:MAX", val);
      memcpy(lo, val, n);
      lo[n] = '\0';
      job->min_nodes = (int)parse_int_opt("--nnodes MIN", lo, 1, 1024);
      job->max_nodes = (int)parse_int_opt("--nnodes MAX", colon + 1, 1, 1024);
      if (job->max_nodes < job->min_nodes)
        die_usage("--nnodes %s: MAX is smaller than MIN", val);
    } else {
      job->min_nodes = job->max_nodes = (int)parse_int_opt("--nnodes", val, 1, 1024);
    }
  } else if (!strcmp(name, "node-rank")) {
    job->node_rank_opt = (int)parse_int_opt("--node-rank", val, 0, 1023);
  } else if (!strcmp(name, "rdzv-backend")) {
    if (strcmp(val, "c10d") && strcmp(val, "static") && strcmp(val, "etcd") &&
        strcmp(val, "etcd-v2"))
      die_usage("--rdzv-backend '%s': not a choice; it takes one of c10d|static|etcd", val);
    c->backend = val;
  } else if (!strcmp(name, "rdzv-id")) {
    if (!rdzv_run_id_ok(val))
      die_usage("--rdzv-id '%s': not an id; it takes 1-127 letters, digits, '.', '_', ':', '/', '-'", val);
    snprintf(job->run_id, sizeof job->run_id, "%s", val);
  } else if (!strcmp(name, "rdzv-conf")) {
    parse_rdzv_conf(job, val);
  } else if (!strcmp(name, "monitor-interval")) {
    job->monitor_ns = parse_seconds("--monitor-interval", val, 0.01, 60);
  } else {
    return 0;
  }
  return 1;
}

/* "failures:" of --help.  1 when name is one of them. */
static int failure_option(job_t *job, const char *name, const char *val) {
  if (!strcmp(name, "elastic")) {
    if (!strcmp(val, "inplace")) job->inplace = 1;
    else if (!strcmp(val, "restart")) job->inplace = 0;
    else die_usage("--elastic '%s': not a choice; it takes one of restart|inplace", val);
  } else if (!strcmp(name, "max-restarts")) {
    job->max_restarts = (int)parse_int_opt("--max-restarts", val, 0, 1000000);
  } else if (!strcmp(name, "grace-period")) {
    char *end = NULL;
    errno = 0;
    double s = strtod(val, &end);
    if (errno || !end || end == val || *end || !(s >= 0 && s <= 86400))
      die_usage("--grace-period '%s': not a number in range; it takes seconds from 0 to 86400", val);
    job->grace_ns = (int64_t)(s * 1e9);
  } else {
    return 0;
  }
  return 1;
}

/* "output:" of --help.  1 when name is one of them. */
static int output_option(cli_t *c, job_t *job, const char *name, const char *val) {
  if (!strcmp(name, "log-dir")) {
    if (!*val) die_usage("--log-dir needs a non-empty directory");
    job->log_dir = val;
  } else if (!strcmp(name, "redirects") || !strcmp(name, "tee")) {
    int redirects = !strcmp(name, "redirects");
    c->std_opt = redirects ? "--redirects" : "--tee";
    c->std_top[!redirects] = parse_std(c->std_opt, val, redirects ? job->redirects : job->tee);
  } else {
    return 0;
  }
  return 1;
}

/* "other:" of --help (those with a value).  1 when name is one of them. */
static int other_option(job_t *job, const char *name, const char *val) {
  if (!strcmp(name, "cpu-bind")) {
    if (!strcmp(val, "auto") || !strcmp(val, "core")) job->bind = 1;
    else if (!strcmp(val, "none")) job->bind = 0;
    else die_usage("--cpu-bind '%s': not a choice; it takes one of auto|none", val);
  } else {
    return 0;
  }
  return 1;
}

/* After the options: --redirects and --tee against --log-dir and the
 * workers they name. */
static void check_output(const cli_t *c, job_t *job) {
  if (c->std_opt && !job->log_dir)
    die_usage("%s needs --log-dir DIR (where the per-rank log files go)", c->std_opt);
  for (int k = 0; k < 2; k++)
    if (c->std_top[k] >= job->nproc)
      die_usage("%s names local rank %d, but there are %d workers per node (--nproc-per-node)",
                k == 0 ? "--redirects" : "--tee", c->std_top[k], job->nproc);
  if (job->log_dir) {
    int logged = 0;
    for (int r = 0; r < job->nproc; r++) logged |= job->redirects[r] | job->tee[r];
    if (!logged)
      fprintf(stderr, "chorusrun: --log-dir without --redirects or --tee writes no log files; "
              "add --tee 3 to copy every worker's output there\n");
  }
}

/* One node and no rendezvous asked for: the store is ours alone. */
static void one_node(cli_t *c, job_t *job) {
  if (c->endpoint_set) {
    job->master_addr = endpoint_host;
    if (c->endpoint_port >= 0) job->master_port = c->endpoint_port, c->port_set = 1;
  }
  if (c->standalone) {
    if (c->port_set) fprintf(stderr, "chorusrun: --standalone ignores --master-port\n");
    job->master_addr = "127.0.0.1";
    job->master_port = 0;
  }
  job->backend = BACKEND_NONE;
}

/* Several nodes on etcd: its addresses, and --rdzv-conf's TLS and
 * authentication in pairs. */
static void etcd_backend(const cli_t *c, job_t *job) {
  /* etcd-v2 is torchrun's name for its etcd backend; ours speaks v3. */
  job->backend = BACKEND_ETCD;
  if (!c->endpoint_set)
    die_usage("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (etcd's "
              "client URLs)");
  if (job->node_rank_opt >= 0)
    die_usage("--node-rank is for --rdzv-backend static (etcd assigns node ranks)");
  job->rdzv_host = endpoint_raw;
  job->rdzv_port = 2379; /* unused: each address carries its port */
  if (!job->etcd.cert != !job->etcd.key)
    die_usage("--rdzv-conf: a client certificate needs both cert= and key=");
  if (!job->etcd.user != !job->etcd.password_file)
    die_usage("--rdzv-conf: etcd authentication needs both user= and password_file=");
}

/* Several nodes: the backend and where its rendezvous is, checked against
 * the options given. */
static void several_nodes(cli_t *c, job_t *job) {
  if (c->standalone) die_usage("--standalone is for one node; drop it or --nnodes");
  if (!c->backend) c->backend = job->node_rank_opt >= 0 ? "static" : "c10d";
  if (strcmp(c->backend, "etcd") && strchr(endpoint_raw, ','))
    die_usage("--rdzv-endpoint lists several addresses only for --rdzv-backend etcd");
  if (!job->run_id[0]) snprintf(job->run_id, sizeof job->run_id, "none");
  if (!strcmp(c->backend, "etcd") || !strcmp(c->backend, "etcd-v2")) {
    etcd_backend(c, job);
    return;
  }
  if (job->etcd.https || job->etcd.cacert || job->etcd.cert || job->etcd.key || job->etcd.user ||
      job->etcd.password_file)
    die_usage("--rdzv-conf: protocol, cacert, cert, key, user and password_file are for "
              "--rdzv-backend etcd");
  if (!strcmp(c->backend, "static")) {
    job->backend = BACKEND_STATIC;
    if (job->min_nodes != job->max_nodes)
      die_usage("the static rendezvous takes a fixed --nnodes N, not %d:%d", job->min_nodes,
                job->max_nodes);
    if (job->node_rank_opt < 0 || job->node_rank_opt >= job->max_nodes)
      die_usage("the static rendezvous needs --node-rank in 0..%d", job->max_nodes - 1);
    job->rdzv_host = c->endpoint_set ? endpoint_host : job->master_addr;
    job->rdzv_port = c->endpoint_set && c->endpoint_port >= 0 ? c->endpoint_port : job->master_port;
    if (!c->endpoint_set && !c->addr_set)
      die_usage("the static rendezvous needs --master-addr (node 0's address) on every node");
  } else {
    job->backend = BACKEND_C10D;
    if (job->node_rank_opt >= 0)
      die_usage("--node-rank is for --rdzv-backend static (c10d assigns node ranks)");
    if (!c->endpoint_set && !c->addr_set)
      die_usage("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (a node of the job; its "
                "agent hosts the store)");
    job->rdzv_host = c->endpoint_set ? endpoint_host : job->master_addr;
    job->rdzv_port = c->endpoint_set ? (c->endpoint_port >= 0 ? c->endpoint_port : 29400)
                                     : (c->port_set ? job->master_port : 29400);
  }
  if (job->rdzv_port <= 0) die_usage("the rendezvous needs a fixed port (not 0)");
}

action_t parse_args(int argc, char **argv, job_t *job) {
  cli_t c = {.std_top = {-1, -1}, .endpoint_port = -1, .act = ACT_RUN};
  set_defaults(job);
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--")) {
      i++;
      break;
    }
    if (a[0] != '-' || a[1] == '\0') break; /* the program */
    char name[64];
    const char *val = option_name(a, name, sizeof name);
    if (flag_option(&c, job, name)) {
      if (val) die_usage("option '--%s' takes no value", name);
      continue;
    }
    if (!takes_value(name)) die_usage("unknown option '%s'", a);
    if (!val) {
      if (i + 1 >= argc) die_usage("option '%s' needs a value", a);
      val = argv[++i];
    }
    if (!workers_option(&c, job, name, val) && !rdzv_option(&c, job, name, val) &&
        !failure_option(job, name, val) && !output_option(&c, job, name, val))
      other_option(job, name, val);
  }
  if (c.act != ACT_RUN) return c.act;
  if (i >= argc) die_usage("no program given");
  check_output(&c, job);
  job->argv = argv + i;
  int nodes = job->max_nodes > 1 || c.backend || job->node_rank_opt > 0;
  if (!nodes)
    one_node(&c, job);
  else
    several_nodes(&c, job);
  return ACT_RUN;
}
