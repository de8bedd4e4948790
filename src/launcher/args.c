/*
 * args.c - chorusrun's command line (torchrun's option names).
 */
#include "launcher/launcher.h"

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
  fputs("\nTry 'chorusrun --help' for more information.\n", stderr);
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
      "options:\n"
      "  -n, --nproc-per-node N  workers to start (default 1; auto: one per CPU)\n"
      "  --standalone            store on 127.0.0.1 with a free port chosen\n"
      "                          automatically (overrides --master-addr/-port)\n"
      "  --master-addr A         address of the store (default 127.0.0.1)\n"
      "  --master-port P         port of the store (default 29500; 0: any)\n"
      "  --rdzv-endpoint A[:P]   same as --master-addr A --master-port P\n"
      "  --nnodes 1              accepted; multi-node is not supported yet\n"
      "  --node-rank 0           accepted; multi-node is not supported yet\n"
      "  --elastic restart|inplace  what a worker's failure does: restart\n"
      "                          (default) stops the group (and restarts it, see\n"
      "                          --max-restarts); inplace reports it and lets the\n"
      "                          others go on (they call chorus_comm_shrink);\n"
      "                          the run succeeds if every other worker exits 0\n"
      "  --max-restarts K        after a failure, restart the whole group up\n"
      "                          to K times (default 0)\n"
      "  --grace-period S        seconds between SIGTERM and SIGKILL when\n"
      "                          stopping workers (default 5)\n"
      "  --no-prefix             do not prefix output lines\n"
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
      "Workers also get CHORUS_JOB_ID, CHORUS_JOB_SECRET_FILE (a file only this\n"
      "user can read, holding a fresh random secret, or CHORUS_JOB_SECRET's value),\n"
      "CHORUS_STORE_EXTERNAL=1 and CHORUS_RESTART_COUNT (0, 1, ... per restart;\n"
      "the store keeps running across restarts and keys are separated by it).\n"
      "\n"
      "Exit status: 0 if every worker succeeded; else the first failing\n"
      "worker's exit code (128+N if it was killed by signal N); 128+N when\n"
      "chorusrun itself got signal N (SIGINT, SIGTERM, SIGHUP or SIGQUIT, forwarded to\n"
      "the workers); 2 for usage errors; 127 if the program is not found;\n"
      "1 for other errors.\n",
      f);
}

static long parse_int_opt(const char *opt, const char *v, long lo, long hi) {
  long x;
  if (chorus__parse_long(v, &x) != 0 || x < lo || x > hi)
    die_usage("invalid value '%s' for %s (expected an integer in %ld..%ld)", v, opt, lo, hi);
  return x;
}

action_t parse_args(int argc, char **argv, job_t *job) {
  int standalone = 0, port_set = 0;
  action_t act = ACT_RUN;
  job->nproc = 1;
  job->master_addr = "127.0.0.1";
  job->master_port = 29500;
  job->max_restarts = 0;
  job->prefix = 1;
  /* CHORUS_CPU_BIND sets the default; --cpu-bind overrides it. */
  const char *bind_env = chorus__env()->CPU_BIND;
  job->bind = !bind_env || strcmp(bind_env, "none") != 0;
  job->grace_ns = 5000000000LL;
  int i = 1;
  for (; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--")) {
      i++;
      break;
    }
    if (a[0] != '-' || a[1] == '\0') break; /* the program */
    /* Normalize: name without leading dashes, '_' -> '-', split at '='. */
    char name[64];
    const char *val = NULL;
    if (a[1] == '-') {
      const char *eq = strchr(a + 2, '=');
      size_t n = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
      if (n >= sizeof name) die_usage("unknown option '%s'", a);
      memcpy(name, a + 2, n);
      name[n] = '\0';
      for (char *c = name; *c; c++)
        if (*c == '_') *c = '-';
      if (eq) val = eq + 1;
    } else if (a[1] == 'n') {
      snprintf(name, sizeof name, "nproc-per-node");
      if (a[2]) val = a + 2;
    } else if (a[1] == 'h' && !a[2]) {
      snprintf(name, sizeof name, "help");
    } else {
      die_usage("unknown option '%s'", a);
    }

    int flag = 1;
    if (!strcmp(name, "standalone")) standalone = 1;
    else if (!strcmp(name, "print-env")) act = ACT_PRINT_ENV;
    else if (!strcmp(name, "env-markdown")) act = ACT_ENV_MARKDOWN;
    else if (!strcmp(name, "no-prefix")) job->prefix = 0;
    else if (!strcmp(name, "help")) act = ACT_HELP;
    else flag = 0;
    if (flag) {
      if (val) die_usage("option '--%s' takes no value", name);
      continue;
    }

    static const char *const with_value[] = {
        "nproc-per-node", "master-addr", "master-port", "rdzv-endpoint", "nnodes",
        "node-rank",      "max-restarts", "grace-period", "cpu-bind", "elastic"};
    int known = 0;
    for (size_t k = 0; k < CHORUS__ARRAY_LEN(with_value); k++)
      if (!strcmp(name, with_value[k])) known = 1;
    if (!known) die_usage("unknown option '%s'", a);
    if (!val) {
      if (i + 1 >= argc) die_usage("option '%s' needs a value", a);
      val = argv[++i];
    }

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
    } else if (!strcmp(name, "master-port")) {
      job->master_port = (int)parse_int_opt("--master-port", val, 0, 65535);
      port_set = 1;
    } else if (!strcmp(name, "rdzv-endpoint")) {
      /* host[:port]; an IPv6 literal must be written [addr]:port. */
      static char host[256];
      const char *colon = strrchr(val, ':');
      if (val[0] == '[' && strchr(val, ']') && (!colon || colon < strchr(val, ']')))
        colon = NULL;
      size_t hl = colon ? (size_t)(colon - val) : strlen(val);
      if (hl == 0 || hl >= sizeof host) die_usage("invalid --rdzv-endpoint '%s'", val);
      memcpy(host, val, hl);
      host[hl] = '\0';
      if (host[0] == '[' && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
      }
      job->master_addr = host;
      if (colon) {
        job->master_port = (int)parse_int_opt("--rdzv-endpoint port", colon + 1, 0, 65535);
        port_set = 1;
      }
    } else if (!strcmp(name, "nnodes")) {
      /* torchrun takes N or MIN:MAX; only 1 (or 1:1) is supported. */
      if (strcmp(val, "1") != 0 && strcmp(val, "1:1") != 0)
        die_usage("multi-node not supported yet (--nnodes %s; only 1 is)", val);
    } else if (!strcmp(name, "node-rank")) {
      if (strcmp(val, "0") != 0)
        die_usage("multi-node not supported yet (--node-rank %s; only 0 is)", val);
    } else if (!strcmp(name, "cpu-bind")) {
      if (!strcmp(val, "auto") || !strcmp(val, "core")) job->bind = 1;
      else if (!strcmp(val, "none")) job->bind = 0;
      else die_usage("invalid value '%s' for --cpu-bind (auto or none)", val);
    } else if (!strcmp(name, "elastic")) {
      if (!strcmp(val, "inplace")) job->inplace = 1;
      else if (!strcmp(val, "restart")) job->inplace = 0;
      else die_usage("invalid value '%s' for --elastic (restart or inplace)", val);
    } else if (!strcmp(name, "max-restarts")) {
      job->max_restarts = (int)parse_int_opt("--max-restarts", val, 0, 1000000);
    } else if (!strcmp(name, "grace-period")) {
      char *end = NULL;
      errno = 0;
      double s = strtod(val, &end);
      if (errno || !end || end == val || *end || !(s >= 0 && s <= 86400))
        die_usage("invalid value '%s' for --grace-period (seconds, 0..86400)", val);
      job->grace_ns = (int64_t)(s * 1e9);
    }
  }
  if (act != ACT_RUN) return act;
  if (i >= argc) die_usage("no program given");
  job->argv = argv + i;
  if (standalone) {
    if (port_set) fprintf(stderr, "chorusrun: --standalone ignores --master-port\n");
    job->master_addr = "127.0.0.1";
    job->master_port = 0;
  }
  return ACT_RUN;
}
