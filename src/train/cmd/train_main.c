/*
 * chorus-train - trains the GPT of chorus_train.h on a byte-level text file,
 * data-parallel over every process chorusrun started (one process without
 * it).  Each step: every rank takes its next batch from chorus_sampler
 * (PyTorch's DistributedSampler, index for index), forward, backward with
 * DDP reducing gradient buckets while backward runs, gradient clipping,
 * AdamW with warm-up + cosine learning rate.  Prints per-step loss and
 * timings, validation loss every --val-every steps, and a sample of
 * generated text at the end.
 *
 *   chorusrun -n 2 build/chorus-train --steps 300
 */
#include <ctype.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chorus.h"
#include "chorus_train.h"
#include "opt.h"
#include "../ckpt.h"    /* chorus__ckpt_file: a resumed checkpoint's name */
#include "../runtime.h" /* chorus_ps_inject: --bad-push, a test knob */

/* OpenBLAS's thread count (absent in other BLAS builds: then a no-op). */
void openblas_set_num_threads(int) __attribute__((weak));

typedef struct {
  const char *data, *val_data, *tokenizer;
  int data_format, vocab;       /* vocab 0: from the tokenizer, the data, or GPT-2's */
  int workers, data_prefetch;   /* the loader's threads and batches read ahead by each */
  double data_delay_ms;         /* benchmarks: each batch takes this long to read */
  const char *log_data;         /* testing: FILE.rank<R> gets each step's sequence numbers */
  chorus_gpt_config_t model;
  int batch, steps, warmup, val_every, val_batches, accum, sample, threads, overlap, log_every;
  float lr, min_lr_frac, weight_decay, clip;
  double bucket_mb;
  chorus_ddp_hook_t hook;
  chorus_optim_kind_t optim;
  float momentum;
  uint64_t seed;
  const char *dump, *ckpt_dir, *trace, *export_path;
  int ckpt_every, keep, stop_after, kill_at, kill_rank;
  int elastic; /* --elastic inplace (-1: CHORUS_ELASTIC decides) */
  int replica_every; /* --elastic inplace, sharded: replicas brought up to date every K steps */
  int skip_rank, skip_layer;     /* --skip-layer R:L */
  int uneven_rank, uneven_steps; /* --uneven R:N */
  int dump_all;
  int loss_scale;  /* dynamic loss scaling */
  int inject_inf;  /* testing: rank 1 puts an inf into its gradient at this step */
  int trace_ping;  /* --trace-clock ping: estimate every rank's clock offset */
  long skew_ms;    /* testing: rank 1's trace clock runs this far ahead */
  int shard;       /* 0: DDP; 1-3: ZeRO stages */
  int prefetch;    /* stage 3: gathers ahead */
  chorus_dtype_t param_dtype;
  size_t mem_cap;  /* bytes per rank; 0: none */
  int async;       /* --mode async: parameter servers and workers */
  int servers, max_staleness, staleness_weight, mirror, standby;
  int slow_rank;   /* testing: --slowdown RANK:FACTOR */
  double slow_factor;
  int bad_rank, bad_kind, bad_step; /* testing: --bad-push RANK:stale|size|nan:STEP */
} opts_t;

/* What a checkpoint records besides model and optimizer.  The data
 * position: with `taken` set, pos is the samples of the epoch the whole
 * world consumed; checkpoints from before it (taken 0) hold rank 0's
 * position in its list, which times world is the same count. */
typedef struct {
  int64_t steps_done, epoch, pos;
  int32_t world, taken;
  uint64_t seed;
  /* What the position counts in (absent from checkpoints written before
   * it, which end at nseq): the dataset's sequences. */
  int64_t nseq;
} train_state_t;
#define TS_OLD_LEN offsetof(train_state_t, nseq)

static int g_rank, g_size;

static train_state_t train_state(const opts_t *o, const chorus_loader_t *ld, long steps_done) {
  return (train_state_t){.steps_done = steps_done, .epoch = chorus_loader_epoch(ld),
                         .pos = (int64_t)chorus_loader_taken(ld), .world = g_size, .taken = 1,
                         .seed = o->seed, .nseq = (int64_t)chorus_loader_sequences(ld)};
}

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  if (g_rank) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: chorusrun [chorusrun options] -- chorus-train [options]\n"
          "Trains a GPT data-parallel on the ranks chorusrun starts (or on one rank alone).\n\n"
          "examples:\n"
          "  chorusrun --standalone -n 2 -- chorus-train --data runs/data/shakespeare-bpe1024 \\\n"
          "      --steps 800 --checkpoint-dir runs/ckpt     # DDP on 2 ranks, resumable\n"
          "  chorusrun --standalone -n 4 -- chorus-train --shard 3 --prefetch 1   # ZeRO-3 / FSDP\n"
          "  chorusrun --standalone -n 5 --elastic inplace -- chorus-train --mode async \\\n"
          "      --servers 2 --mirror      # 2 parameter servers, 3 workers\n\n"
          "data:\n"
          "  --data DIR|GLOB|FILE token shards to train on (llm.c's NAME_train_*.bin in DIR,\n"
          "                       a glob, or one shard), or a text file read as bytes\n"
          "                       (default data/tinyshakespeare.txt)\n"
          "  --val-data DIR|GLOB|FILE  validation shards (default: DIR's NAME_val_*.bin, the\n"
          "                       glob with train -> val; a text file's last tenth)\n"
          "  --data-format auto|llmc|raw16|text  raw16: nanoGPT's headerless uint16 (auto)\n"
          "  --tokenizer DIR      encoder.json + vocab.bpe: the vocabulary size, and --sample\n"
          "                       decodes through it (default: the data's directory, if\n"
          "                       it has them)\n"
          "  --vocab N            model vocabulary (default: the tokenizer's; 256 for text;\n"
          "                       50257, GPT-2's, for shards without a tokenizer)\n"
          "  --workers N          loader threads reading batches ahead (1; 0: read in the\n"
          "                       step)\n"
          "  --data-prefetch K    batches each worker holds ready (2)\n\n"
          "model and optimizer:\n"
          "  --layers N --heads N --channels N --ctx N   model shape (4, 4, 128, 128)\n"
          "  --batch N            sequences per rank per step (8)\n"
          "  --steps N            optimizer steps (200)\n"
          "  --lr X               peak learning rate (3e-3); --min-lr-frac X (0.1)\n"
          "  --warmup N           warm-up steps (20)\n"
          "  --weight-decay X     weight decay (0.1); --clip X  max grad norm, 0: none (1.0)\n"
          "  --optim adamw|sgd    optimizer (adamw: betas 0.9, 0.95); --momentum X  SGD's (0.9)\n"
          "  --accum K            micro-steps per step; the first K-1 skip communication (1)\n"
          "  --param-dtype fp32|bf16  compute with weights rounded to bf16 (gathered as\n"
          "                       bf16 when sharded); the optimizer keeps fp32 masters\n"
          "  --threads N          BLAS threads per rank (default: cores / local ranks)\n"
          "  --seed N             initialisation and sampling seed (1337)\n\n"
          "data parallel (--mode sync, the default):\n"
          "  --bucket-mb X        DDP bucket cap (25); --no-overlap: reduce after backward\n"
          "  --hook none|bf16|fp16  gradient compression for the all_reduce (none)\n"
          "  --loss-scale dynamic|none  scale the loss (2^16 at first) so small gradients\n"
          "                       survive fp16 compression; a step whose gradients hold\n"
          "                       inf/NaN on any rank is skipped everywhere and the scale\n"
          "                       halves; it doubles after 200 good steps (dynamic with\n"
          "                       --hook fp16)\n"
          "  --shard 0|1|2|3      0: DDP (every rank holds everything); sharded like ZeRO:\n"
          "                       1 the optimizer state, 2 also the gradients, 3 also the\n"
          "                       parameters (FSDP's full shard) (0)\n"
          "  --prefetch K         stage 3: all-gathers in flight ahead of the unit that\n"
          "                       computes (1; 0: gather each unit when it is needed)\n"
          "  --mem-cap BYTES[K|M|G]  refuse to start when a rank's planned memory (state,\n"
          "                       gathered units, activations) would pass it\n"
          "  --elastic restart|inplace  when a rank dies: stop (chorusrun restarts the\n"
          "                       group, which resumes from a checkpoint), or shrink to\n"
          "                       the ranks alive, re-shard the data (and, with --shard,\n"
          "                       the model from the replicas) and go on from memory\n"
          "                       (default: chorusrun's --elastic)\n"
          "  --replica-every K    --elastic inplace with --shard: each rank's shard is\n"
          "                       copied to a rank on another host every K steps (1); a\n"
          "                       death goes back at most K - 1 steps further\n\n"
          "parameter servers (--mode async):\n"
          "  --mode sync|async    sync: data parallel (DDP or --shard); async: ranks\n"
          "                       0..--servers-1 hold the parameters and the optimizer\n"
          "                       (split by range), the others push gradients and pull\n"
          "                       parameters each at its own pace (sync)\n"
          "  --servers N          async: parameter servers (1)\n"
          "  --mirror             async: each server's range also on the next server\n"
          "                       process, updated with every step; a server that dies\n"
          "                       loses nothing: the one with its copy serves its range\n"
          "  --standby            async, with --mirror: one more server process, which\n"
          "                       keeps the last range's copy (--servers 1 survives)\n"
          "  --max-staleness S    async: no gradient is applied more than S updates after\n"
          "                       the parameters it was computed on were handed out; 0 is\n"
          "                       synchronous (16)\n"
          "  --staleness-weight none|inverse  async: inverse weights a gradient by\n"
          "                       1 / (1 + its staleness) (none)\n\n"
          "checkpoints and output:\n"
          "  --checkpoint-dir D   checkpoints there (resuming from the newest at start: a\n"
          "                       folder ckpt-<step> or a file ckpt-<step>.bin)\n"
          "  --checkpoint-every N every N steps and at the end (0: only at the end)\n"
          "  --keep K             checkpoints kept (3)\n"
          "  --stop-after N       stop (cleanly, after checkpointing) once N steps are done\n"
          "  --export FILE        at the end, the whole state in one file (chorus_ckpt_save's\n"
          "                       format: rank 0 gathers it unit by unit); any stage and\n"
          "                       world resumes from it as DIR/ckpt-<step>.bin\n"
          "  --val-every N        validation loss every N steps (50); --val-batches N (8)\n"
          "  --sample N           generate N tokens at the end (300)\n"
          "  --log-every N        print a step line every N steps (10)\n"
          "  --dump FILE          rank 0 writes the final parameters (raw float32)\n"
          "  --trace FILE         Chrome trace (JSON, Perfetto / chrome://tracing): a track\n"
          "                       per rank for forward, backward, waiting and the optimizer,\n"
          "                       one for each bucket's all_reduce; merged by rank 0\n"
          "  --trace-clock auto|ping  ranks on rank 0's host share its clock; others\n"
          "                       estimate their offset by round trips to rank 0 (auto);\n"
          "                       ping estimates it for every rank\n\n"
          "testing and benchmarks (not for training runs):\n"
          "  --dump-all           with --dump, every rank writes FILE.rank<R>\n"
          "  --skip-layer R:L     rank R skips block L every step (unused parameters)\n"
          "  --uneven R:N         rank R has data for only N steps, then joins: it shadows\n"
          "                       the others' gradient all_reduces with zeros (PyTorch's\n"
          "                       Join) until every rank is out of data\n"
          "  --data-delay-ms X    reading a batch takes at least X ms (slow storage)\n"
          "  --log-data FILE      rank R appends \"step: sequence numbers\" of every batch it\n"
          "                       trains on to FILE.rank<R>\n"
          "  --inject-inf N       rank 1 corrupts its gradient at step N\n"
          "  --kill-at N          a rank kills itself (SIGKILL) at the start of step N of\n"
          "                       the first generation (CHORUS_RESTART_COUNT 0)\n"
          "  --kill-rank R        the rank --kill-at kills (1)\n"
          "  --clock-skew-ms N    rank 1's trace clock runs N ms ahead\n"
          "  --slowdown R:F       rank R computes F times slower (it sleeps)\n"
          "  --bad-push R:stale|size|nan:N  worker rank R pushes, at its step N, a gradient\n"
          "                       claiming a too-old version, one float too many, or a NaN\n");
}

#define P "chorus-train"
/* Each numeric option's range: what a run can use (the model's sizes are
 * checked together later by chorus_gpt_create). */
static int parse(int argc, char **argv, opts_t *o) {
  static const struct option lo[] = {
      {"data", 1, 0, 'd'},     {"layers", 1, 0, 'L'},      {"heads", 1, 0, 'H'},
      {"channels", 1, 0, 'C'}, {"ctx", 1, 0, 'T'},         {"batch", 1, 0, 'B'},
      {"steps", 1, 0, 's'},    {"lr", 1, 0, 'l'},          {"min-lr-frac", 1, 0, 'm'},
      {"warmup", 1, 0, 'w'},   {"weight-decay", 1, 0, 'W'}, {"clip", 1, 0, 'c'},
      {"accum", 1, 0, 'a'},    {"bucket-mb", 1, 0, 'b'},    {"no-overlap", 0, 0, 'O'},
      {"hook", 1, 0, 'k'},     {"val-every", 1, 0, 'v'},    {"val-batches", 1, 0, 'V'},
      {"sample", 1, 0, 'S'},   {"threads", 1, 0, 'j'},      {"seed", 1, 0, 'r'},
      {"log-every", 1, 0, 'g'}, {"dump", 1, 0, 'D'},        {"help", 0, 0, 'h'},
      {"optim", 1, 0, 'o'},    {"momentum", 1, 0, 'M'},    {"checkpoint-dir", 1, 0, 'K'},
      {"checkpoint-every", 1, 0, 'E'}, {"keep", 1, 0, 'P'}, {"stop-after", 1, 0, 'X'},
      {"kill-at", 1, 0, 'Z'},    {"kill-rank", 1, 0, 'F'},   {"elastic", 1, 0, 'e'},
      {"trace", 1, 0, 'R'},       {"skip-layer", 1, 0, 'Y'},
      {"uneven", 1, 0, 'U'},     {"dump-all", 0, 0, 'A'},    {"loss-scale", 1, 0, 'Q'},
      {"inject-inf", 1, 0, 'I'}, {"trace-clock", 1, 0, 'G'}, {"clock-skew-ms", 1, 0, 'z'},
      {"shard", 1, 0, 1000},     {"prefetch", 1, 0, 1001},   {"param-dtype", 1, 0, 1002},
      {"mem-cap", 1, 0, 1003},   {"export", 1, 0, 1004},     {"mode", 1, 0, 1005},
      {"servers", 1, 0, 1006},   {"max-staleness", 1, 0, 1007},
      {"staleness-weight", 1, 0, 1008}, {"slowdown", 1, 0, 1009}, {"bad-push", 1, 0, 1010},
      {"val-data", 1, 0, 1011},  {"data-format", 1, 0, 1012}, {"tokenizer", 1, 0, 1013},
      {"vocab", 1, 0, 1014},     {"workers", 1, 0, 1015},     {"data-prefetch", 1, 0, 1016},
      {"data-delay-ms", 1, 0, 1017}, {"log-data", 1, 0, 1018}, {"replica-every", 1, 0, 1019},
      {"mirror", 0, 0, 1020},    {"standby", 0, 0, 1021},
      {0, 0, 0, 0}};
  static const chorus_ddp_hook_t hooks[] = {CHORUS_DDP_HOOK_NONE, CHORUS_DDP_HOOK_BF16,
                                            CHORUS_DDP_HOOK_FP16};
  static const chorus_optim_kind_t optims[] = {CHORUS_OPTIM_ADAMW, CHORUS_OPTIM_SGD};
  static const chorus_dtype_t pdtypes[] = {CHORUS_FLOAT32, CHORUS_BFLOAT16};
  static const int formats[] = {CHORUS_TOKENS_AUTO, CHORUS_TOKENS_LLMC, CHORUS_TOKENS_RAW16,
                                CHORUS_TOKENS_TEXT};
  const long big = INT_MAX; /* "or more" */
  int c, idx, k;
  char name[40];
#define INT(field, lo_, hi_)                                                                   \
  if (opt_int(P, name, optarg, lo_, hi_, &o->field)) return -1;                                \
  break
#define FLOAT(field, lo_, open_, hi_)                                                          \
  if (opt_float(P, name, optarg, lo_, open_, hi_, &o->field)) return -1;                       \
  break
#define CHOICE(words, assign)                                                                  \
  if (opt_choice(P, name, optarg, words, &k)) return -1;                                       \
  assign;                                                                                      \
  break
  opterr = 0;
  while ((idx = -1, c = getopt_long(argc, argv, ":h", lo, &idx)) != -1) {
    snprintf(name, sizeof name, "--%s", idx >= 0 ? lo[idx].name : "help");
    switch (c) {
      case 'd': o->data = optarg; break;
      case 'L': INT(model.layers, 1, 1024);
      case 'H': INT(model.heads, 1, 4096);
      case 'C': INT(model.channels, 1, 1 << 20);
      case 'T': INT(model.ctx, 2, 1 << 20);
      case 'B': INT(batch, 1, 1 << 20);
      case 's': INT(steps, 0, big);
      case 'l': FLOAT(lr, 0, 1, 10);
      case 'm': FLOAT(min_lr_frac, 0, 0, 1);
      case 'w': INT(warmup, 0, big);
      case 'W': FLOAT(weight_decay, 0, 0, 100);
      case 'c': FLOAT(clip, 0, 0, 1e30);
      case 'a': INT(accum, 1, 1 << 20);
      case 'b':
        if (opt_double(P, name, optarg, 0, 1, 1 << 20, &o->bucket_mb)) return -1;
        break;
      case 'O': o->overlap = 0; break;
      case 'k': CHOICE("none|bf16|fp16", o->hook = hooks[k]);
      case 'v': INT(val_every, 0, big);
      case 'V': INT(val_batches, 1, 1 << 20);
      case 'S': INT(sample, 0, 1 << 20);
      case 'j': INT(threads, 1, 4096);
      case 'r':
        if (opt_u64(P, name, optarg, &o->seed)) return -1;
        break;
      case 'g': INT(log_every, 1, big);
      case 'D': o->dump = optarg; break;
      case 'o': CHOICE("adamw|sgd", o->optim = optims[k]);
      case 'M': FLOAT(momentum, 0, 0, 1);
      case 'K': o->ckpt_dir = optarg; break;
      case 'E': INT(ckpt_every, 0, big);
      case 'P': INT(keep, 1, 1 << 20);
      case 'X': INT(stop_after, 0, big);
      case 'Z': INT(kill_at, 0, big);
      case 'F': INT(kill_rank, 0, big);
      case 'e': CHOICE("restart|inplace", o->elastic = k);
      case 'R': o->trace = optarg; break;
      case 'Y':
        if (opt_pair(P, name, optarg, "RANK:LAYER", 0, big, 0, 1023, &o->skip_rank,
                     &o->skip_layer))
          return -1;
        break;
      case 'U':
        if (opt_pair(P, name, optarg, "RANK:STEPS", 0, big, 0, big, &o->uneven_rank,
                     &o->uneven_steps))
          return -1;
        break;
      case 'A': o->dump_all = 1; break;
      case 'Q': CHOICE("none|dynamic", o->loss_scale = k);
      case 'I': INT(inject_inf, 0, big);
      case 'G': CHOICE("auto|ping", o->trace_ping = k);
      case 'z': {
        long long v;
        if (opt_long(P, name, optarg, -86400000, 86400000, &v)) return -1;
        o->skew_ms = (long)v;
        break;
      }
      case 1000: INT(shard, 0, 3);
      case 1001: INT(prefetch, 0, 64);
      case 1002: CHOICE("fp32|bf16", o->param_dtype = pdtypes[k]);
      case 1003: {
        uint64_t v;
        if (opt_bytes(P, name, optarg, &v)) return -1;
        o->mem_cap = (size_t)v;
        break;
      }
      case 1004: o->export_path = optarg; break;
      case 1005: CHOICE("sync|async", o->async = k);
      case 1006: INT(servers, 1, 4096);
      case 1007: INT(max_staleness, 0, big);
      case 1008: CHOICE("none|inverse", o->staleness_weight = k);
      case 1009: { /* RANK:FACTOR, the factor at least 1 */
        char *e1 = NULL, *e2 = NULL;
        long r = isdigit((unsigned char)*optarg) ? strtol(optarg, &e1, 10) : -1;
        double f = e1 && *e1 == ':' && isdigit((unsigned char)e1[1]) ? strtod(e1 + 1, &e2) : 0;
        if (r < 0 || r > big || !e2 || *e2 || !(f >= 1 && f <= 1e6)) {
          fprintf(stderr, P ": %s '%s': not of that form; it takes RANK:FACTOR, the factor "
                  "from 1 to 1e6 (e.g. 3:4)\n", name, optarg);
          return -1;
        }
        o->slow_rank = (int)r, o->slow_factor = f;
        break;
      }
      case 1010: {
        char kind[16];
        int n = 0;
        if (sscanf(optarg, "%d:%15[a-z]:%d%n", &o->bad_rank, kind, &o->bad_step, &n) != 3 ||
            optarg[n] || o->bad_rank < 0 || o->bad_step < 0 ||
            !(o->bad_kind = !strcmp(kind, "stale") ? 1 : !strcmp(kind, "size") ? 2
                          : !strcmp(kind, "nan") ? 3 : 0)) {
          fprintf(stderr, P ": %s '%s': not of that form; it takes RANK:stale|size|nan:STEP\n",
                  name, optarg);
          return -1;
        }
        break;
      }
      case 1011: o->val_data = optarg; break;
      case 1012: CHOICE("auto|llmc|raw16|text", o->data_format = formats[k]);
      case 1013: o->tokenizer = optarg; break;
      case 1014: INT(vocab, 2, 1 << 24);
      case 1015: INT(workers, 0, 256);
      case 1016: INT(data_prefetch, 1, 1024);
      case 1017:
        if (opt_double(P, name, optarg, 0, 0, 3600e3, &o->data_delay_ms)) return -1;
        break;
      case 1018: o->log_data = optarg; break;
      case 1019: INT(replica_every, 1, big);
      case 1020: o->mirror = 1; break;
      case 1021: o->standby = 1; break;
      case 'h': usage(stdout); exit(0);
      default: opt_getopt_error(P, c, argv); return -1;
    }
  }
#undef INT
#undef FLOAT
#undef CHOICE
  if (optind != argc) {
    fprintf(stderr, P ": '%s': not an option (chorus-train takes no file arguments; the data "
            "is --data)\n", argv[optind]);
    opt_see_help(P);
    return -1;
  }
  return 0;
}
#undef P

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
  if (!(s > 0)) return;
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* A 64-bit mixer (splitmix64) for sampling generated text. */
static uint64_t mix(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* ----------------------------------------------------------------- trace */

/* Complete events ("ph":"X") of this rank, in its CLOCK_MONOTONIC ns. */
typedef struct {
  const char *name;
  int tid; /* 0: compute, 1: communication */
  int step;
  int bucket; /* communication events: the bucket's index */
  int64_t t0, t1;
  size_t bytes;
} event_t;

typedef struct {
  event_t *ev;
  size_t n, cap;
  int64_t skew; /* testing (--clock-skew-ms): added to every time of this rank */
} trace_t;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void trace_add(trace_t *tr, const char *name, int tid, int step, int bucket, int64_t t0,
                      int64_t t1, size_t bytes) {
  if (!tr || t1 <= t0 || tr->n >= 1000000) return;
  if (tr->n == tr->cap) {
    size_t cap = tr->cap ? tr->cap * 2 : 1024;
    event_t *ev = realloc(tr->ev, cap * sizeof *ev);
    if (!ev) return;
    tr->ev = ev, tr->cap = cap;
  }
  tr->ev[tr->n++] = (event_t){name, tid, step, bucket, t0 + tr->skew, t1 + tr->skew, bytes};
}

/* The trace's clock is rank 0's CLOCK_MONOTONIC.  Ranks on rank 0's host
 * (chorus_comm_same_host) read the same clock (offset 0, exact).  Any other rank estimates its
 * offset by Cristian's method: it sends its time t1, rank 0 answers with
 * its own t, the answer arrives at t2, so rank 0's clock read t somewhere
 * in [t1, t2] of ours: offset = t - (t1 + t2) / 2, wrong by at most
 * (t2 - t1) / 2.  Of 16 round trips the shortest is kept; *unc gets that
 * bound.  Rank 0 answers the ranks one after the other. */
static chorus_result_t clock_offset(chorus_comm_t comm, const trace_t *tr, int ping,
                                    int64_t *off, int64_t *unc) {
  enum { ROUNDS = 16, TAG = 7001 };
  *off = *unc = 0;
  chorus_result_t st = CHORUS_OK;
  for (int r = 1; r < g_size && st == CHORUS_OK; r++) {
    /* Rank 0 and rank r see the same answer (one host table). */
    if (!ping && chorus_comm_same_host(comm, g_rank == 0 ? r : 0) == 1) continue;
    if (g_rank == 0) {
      for (int k = 0; k < ROUNDS && st == CHORUS_OK; k++) {
        int64_t t;
        st = chorus_recv(comm, &t, 1, CHORUS_INT64, r, TAG, NULL);
        t = now_ns() + tr->skew;
        if (st == CHORUS_OK) st = chorus_send(comm, &t, 1, CHORUS_INT64, r, TAG, NULL);
      }
    } else if (g_rank == r) {
      int64_t best = INT64_MAX;
      for (int k = 0; k < ROUNDS && st == CHORUS_OK; k++) {
        int64_t t1 = now_ns() + tr->skew, t;
        st = chorus_send(comm, &t1, 1, CHORUS_INT64, 0, TAG, NULL);
        if (st == CHORUS_OK) st = chorus_recv(comm, &t, 1, CHORUS_INT64, 0, TAG, NULL);
        int64_t t2 = now_ns() + tr->skew;
        if (st == CHORUS_OK && t2 - t1 < best) {
          best = t2 - t1;
          *off = t - t1 - best / 2;
          *unc = (best + 1) / 2;
        }
      }
    }
  }
  return st;
}

/* Every rank turns its events into JSON objects on rank 0's clock (times
 * relative to the earliest event of any rank); rank 0 gathers them and
 * writes one file. */
static int trace_write(chorus_comm_t comm, const trace_t *tr, int ping, const char *path) {
  int64_t off, unc;
  if (clock_offset(comm, tr, ping, &off, &unc) != CHORUS_OK) return -1;
  int64_t mine = INT64_MAX, base;
  for (size_t i = 0; i < tr->n; i++) mine = tr->ev[i].t0 + off < mine ? tr->ev[i].t0 + off : mine;
  if (chorus_all_reduce(comm, &mine, &base, 1, CHORUS_INT64, CHORUS_MIN, NULL) != CHORUS_OK)
    return -1;
  size_t cap = 512 + tr->n * 200, len = 0;
  char *buf = malloc(cap);
  if (!buf) return -1;
  len += (size_t)snprintf(buf + len, cap - len,
                          "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":"
                          "\"rank %d\",\"clock_offset_us\":%.3f,\"clock_uncertainty_us\":%.3f}},"
                          "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
                          "\"args\":{\"name\":\"compute\"}},{\"name\":\"thread_name\",\"ph\":\"M\","
                          "\"pid\":%d,\"tid\":1,\"args\":{\"name\":\"collectives\"}}",
                          g_rank, g_rank, (double)off / 1e3, (double)unc / 1e3, g_rank, g_rank);
  for (size_t i = 0; i < tr->n && len < cap; i++) {
    const event_t *e = &tr->ev[i];
    len += (size_t)snprintf(buf + len, cap - len,
                            ",{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                            "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%d,\"bucket\":%d,"
                            "\"bytes\":%zu}}",
                            e->name, e->tid ? "comm" : "compute", g_rank, e->tid,
                            (double)(e->t0 + off - base) / 1e3, (double)(e->t1 - e->t0) / 1e3,
                            e->step, e->bucket, e->bytes);
  }
  if (len >= cap) len = cap - 1;
  void *all = NULL;
  size_t *lens = malloc(sizeof(size_t) * (size_t)g_size);
  chorus_result_t st = chorus_gather_bytes(comm, buf, len, 0, &all, lens);
  free(buf);
  int rc = st == CHORUS_OK ? 0 : -1;
  if (st == CHORUS_OK && g_rank == 0) {
    FILE *f = fopen(path, "w");
    if (!f) {
      rc = -1;
    } else {
      fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[", f);
      const char *p = all;
      for (int r = 0; r < g_size; r++) {
        if (r) fputc(',', f);
        fwrite(p, 1, lens[r], f);
        p += lens[r];
      }
      fputs("]}\n", f);
      rc = fclose(f) == 0 ? 0 : -1;
    }
    if (rc == 0) say("trace: %s (%d ranks; open in https://ui.perfetto.dev or chrome://tracing)\n",
                     path, g_size);
  }
  free(all);
  free(lens);
  return rc;
}

/* ----------------------------------------------------------- checkpoints */

/* Every rank writes its file (its slices, or a share under DDP), rank 0
 * the index last; the call returns on every rank once the checkpoint is
 * complete, so a crash right after still finds it. */
static chorus_result_t checkpoint(const opts_t *o, chorus_trainer_t *t,
                                  const chorus_loader_t *ld, long steps_done) {
  train_state_t ts = train_state(o, ld, steps_done);
  chorus_result_t st = chorus_trainer_save(t, o->ckpt_dir, steps_done, &ts, sizeof ts, o->keep);
  if (st != CHORUS_OK)
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
  else
    say("checkpoint: %s/ckpt-%09ld (%d file(s) and an index)\n", o->ckpt_dir, steps_done,
        g_size);
  return st;
}

/* Puts the loader at (epoch, taken: samples of it the world consumed) over
 * this world (g_size, g_rank); what it had read ahead is dropped.  0, or -1
 * (reported). */
static int loader_place(chorus_loader_t *ld, long epoch, size_t taken) {
  if (chorus_loader_reshard(ld, g_size, g_rank) == CHORUS_OK &&
      chorus_loader_seek(ld, epoch, taken) == CHORUS_OK)
    return 0;
  fprintf(stderr, "chorus-train: rank %d: the data position: %s\n", g_rank,
          chorus_train_last_error());
  return -1;
}

/* Every rank loads the newest usable checkpoint, whatever stage and number
 * of ranks wrote it; the sampler goes on from the same global position.
 * The step to start from, or -1 when a collective failed (reported). */
static long resume(const opts_t *o, chorus_trainer_t *t, chorus_loader_t *ld) {
  train_state_t ts;
  size_t len = 0;
  long step = -1;
  chorus_ckpt_info_t info;
  chorus_result_t st = chorus_trainer_load(t, o->ckpt_dir, &step, &ts, sizeof ts, &len, &info);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return -1;
  }
  if (step < 0) return 0;
  if ((len != sizeof ts && len != TS_OLD_LEN) || ts.world < 1 || ts.epoch < 0 || ts.pos < 0) {
    say("checkpoint of step %ld: its training state is unreadable; the data order starts "
        "over\n", step);
    return step;
  }
  /* A position in another order (other data or seed) would skip and
   * repeat sequences without a word: that epoch starts over instead. */
  const train_state_t now = train_state(o, ld, 0);
  size_t pos = (size_t)ts.pos * (ts.taken ? 1 : (size_t)ts.world);
  if (ts.seed != now.seed || (len == sizeof ts && ts.nseq != now.nseq)) {
    say("checkpoint of step %ld: its data position is in another order (%lld sequences, seed "
        "%llu; this run: %lld, seed %llu): epoch %lld starts over\n", step,
        len == sizeof ts ? (long long)ts.nseq : -1LL, (unsigned long long)ts.seed,
        (long long)now.nseq, (unsigned long long)now.seed, (long long)ts.epoch);
    pos = 0;
  }
  if (loader_place(ld, (long)ts.epoch, pos)) {
    say("checkpoint of step %ld: the data position could not be restored; the data order "
        "starts over\n", step);
    return step;
  }
  /* The file's own name, as the runtime found it: an export may be named
   * ckpt-6.bin by hand. */
  char path[4200];
  if (info.sharded) snprintf(path, sizeof path, "%s/ckpt-%09ld", o->ckpt_dir, step);
  else chorus__ckpt_file(path, sizeof path, o->ckpt_dir, step);
  say("resumed from %s (saved by %d rank(s)%s%s, epoch %ld)\n", path,
      (int)ts.world, info.sharded ? " at stage " : "",
      info.sharded ? (const char *[]){"0", "1", "2", "3"}[info.stage & 3] : "", (long)ts.epoch);
  return (long)ts.steps_done;
}

/* ----------------------------------------------------------------- main */

static int die(chorus_comm_t comm, const char *what, chorus_result_t st) {
  /* The runtime's message when the communicator has none (the loader's,
   * the data's: they fail before any collective). */
  const char *why = comm ? chorus_comm_last_error(comm) : "";
  if (!why || !*why) why = chorus_train_last_error();
  fprintf(stderr, "chorus-train: rank %d: %s: %s: %s\n", g_rank, what, chorus_result_name(st),
          why);
  if (comm) chorus_comm_abort(comm);
  return 1;
}

/* join: chorusrun started this worker into a running job (CHORUS_JOIN=1,
 * a node admitted in place). */
static chorus_result_t init_comm(int join, chorus_comm_t *comm) {
  if (join) return chorus_comm_join(NULL, comm);
  if (getenv("RANK") && getenv("WORLD_SIZE")) return chorus_comm_init_env(comm);
  /* Alone: a world of one, its own store on a free port. */
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  cfg.rank = 0;
  cfg.world_size = 1;
  cfg.store_host = "127.0.0.1";
  cfg.store_port = 0;
  cfg.host_store = 1;
  return chorus_comm_init(&cfg, comm);
}

/* Rank `rank` of a world of `world`'s mean validation loss over
 * val_batches batches (every rank evaluates different samples); NaN
 * without validation data or memory. */
static float val_loss_as(chorus_gpt_t *m, const chorus_tokens_t *val, const opts_t *o, int world,
                         int rank, int *tok, int *tgt) {
  size_t n = chorus_tokens_samples(val, o->model.ctx);
  size_t *idx = malloc(sizeof(size_t) * (size_t)o->batch);
  if (n == 0 || !idx) {
    free(idx);
    return NAN;
  }
  double sum = 0;
  for (int v = 0; v < o->val_batches; v++) {
    for (int b = 0; b < o->batch; b++)
      idx[b] = ((size_t)(v * o->batch + b) * (size_t)world + (size_t)rank) % n;
    if (chorus_tokens_read(val, o->model.ctx, idx, o->batch, tok, tgt) != CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: validation data: %s\n", g_rank,
              chorus_train_last_error());
      free(idx);
      return NAN;
    }
    float loss = 0;
    chorus_gpt_forward(m, tok, tgt, o->batch, o->model.ctx, &loss);
    sum += loss;
  }
  free(idx);
  return (float)(sum / o->val_batches);
}

/* The ranks' mean validation loss, averaged over ranks, into *avg. */
static chorus_result_t validate(chorus_comm_t comm, chorus_gpt_t *m, const chorus_tokens_t *val,
                                const opts_t *o, int *tok, int *tgt, float *avg) {
  *avg = NAN;
  if (chorus_tokens_samples(val, o->model.ctx) == 0) return CHORUS_OK;
  /* Every rank joins the average, also with a NaN (no memory, or a model
   * that diverged). */
  float mine = val_loss_as(m, val, o, g_size, g_rank, tok, tgt);
  return chorus_all_reduce(comm, &mine, avg, 1, CHORUS_FLOAT32, CHORUS_AVG, NULL);
}

/* Rank 0 generates n tokens, sampling from the model's distribution with a
 * seeded generator, after GPT-2's start token "<|endoftext|>" (a newline
 * for byte-level text), and prints them through the tokenizer (bytes as
 * they are without one; token ids when the vocabulary has no text). */
static void sample_text(chorus_gpt_t *m, const opts_t *o, const chorus_bpe_t *bpe, int n) {
  const int T = o->model.ctx, V = o->model.vocab;
  int *ctx = calloc((size_t)T, sizeof(int));
  if (!ctx) return;
  int len = 1;
  ctx[0] = bpe && chorus_bpe_eot(bpe) >= 0 ? chorus_bpe_eot(bpe) : V <= 256 ? '\n' : 0;
  uint64_t s = o->seed ^ 0x5eedull;
  say("---- sample (%d tokens%s) ----\n", n, bpe ? ", GPT-2 BPE" : V <= 256 ? ", bytes" : ", ids");
  for (int i = 0; i < n; i++) {
    int t = len < T ? len : T;
    chorus_gpt_forward(m, ctx, NULL, 1, t, NULL);
    const float *p = chorus_gpt_probs(m) + (size_t)(t - 1) * V;
    double r = (double)(mix(&s) >> 11) / 9007199254740992.0, acc = 0;
    int next = V - 1;
    for (int v = 0; v < V; v++) {
      acc += p[v];
      if (r < acc) {
        next = v;
        break;
      }
    }
    size_t tl = 0;
    const unsigned char *tb = bpe ? chorus_bpe_token(bpe, next, &tl) : NULL;
    if (g_rank == 0) {
      if (tb) fwrite(tb, 1, tl, stdout);
      else if (V <= 256) putchar(next);
      else printf("%d ", next);
    }
    if (len < T) {
      ctx[len++] = next;
    } else {
      memmove(ctx, ctx + 1, sizeof(int) * (size_t)(T - 1));
      ctx[T - 1] = next;
    }
  }
  say("\n---- end of sample ----\n");
  free(ctx);
}

/* ------------------------------------------------------------------ a run */

/* Everything a training run changes as it goes. */
typedef struct {
  const opts_t *o;
  chorus_comm_t comm;
  chorus_trainer_t *trainer; /* DDP or sharded, optimizer, loss scaling, join */
  chorus_elastic_t *elastic; /* --elastic inplace: recovery and growth in place */
  chorus_gpt_t *m;           /* the trainer's model */
  chorus_optim_t *opt;       /* the trainer's optimizer */
  chorus_tokens_t *train, *val;
  chorus_loader_t *ld;
  chorus_bpe_t *bpe; /* NULL: no tokenizer */
  trace_t *tr;
  int *tok, *tgt;
  size_t *idx, np;
  int first_generation; /* CHORUS_RESTART_COUNT is 0 */
  /* For the summary. */
  double sum_tps, sum_fwd, sum_bwd, sum_exp, sum_opt, sum_comm, sum_step, sum_data, sum_rep;
  int skipped_steps;
  int timed;
  float first_val, last_val;
  /* The collective that failed a step. */
  const char *fail_what;
  chorus_result_t fail_st;
  int64_t failed_ns; /* when a failure was seen; 0 once a step completed after it */
  long steps_done;
} run_t;

enum { STEP_NEXT, STEP_STOP, STEP_FATAL, STEP_COMM };

/* Opens the training and validation data, the tokenizer when there is
 * one, and sets the model's vocabulary.  0, or -1 (reported). */
static int open_data(opts_t *o, run_t *r) {
  /* What the data is first (text or tokens), then its vocabulary. */
  chorus_result_t st = chorus_tokens_open(o->data, CHORUS_SPLIT_TRAIN, o->data_format, 1 << 30,
                                          &r->train);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: the data: %s\n", g_rank, chorus_train_last_error());
    return -1;
  }
  const int text = chorus_tokens_is_text(r->train);
  chorus_tokens_close(r->train);
  r->train = NULL;
  char dbuf[4096], err[512];
  const char *tokdir = o->tokenizer;
  if (!tokdir && !text) /* the shards' own: chorus-data prepare leaves it there */
    tokdir = chorus_tokens_tokenizer_dir(o->data, dbuf, sizeof dbuf);
  if (tokdir && chorus_bpe_load(tokdir, &r->bpe, err, sizeof err) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: the tokenizer: %s\n", g_rank, err);
    return -1;
  }
  int vocab = o->vocab ? o->vocab : r->bpe ? chorus_bpe_vocab(r->bpe) : text ? 256 : 50257;
  if (r->bpe && vocab < chorus_bpe_vocab(r->bpe)) {
    fprintf(stderr, "chorus-train: --vocab %d is smaller than the tokenizer's %d tokens (%s)\n",
            vocab, chorus_bpe_vocab(r->bpe), tokdir);
    return -1;
  }
  st = chorus_tokens_open(o->data, CHORUS_SPLIT_TRAIN, o->data_format, vocab, &r->train);
  if (st == CHORUS_OK)
    st = chorus_tokens_open(o->val_data ? o->val_data : o->data, CHORUS_SPLIT_VAL,
                            o->data_format, vocab, &r->val);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: the data: %s\n", g_rank, chorus_train_last_error());
    return -1;
  }
  o->model.vocab = vocab;
  return 0;
}

static void close_data(run_t *r) {
  chorus_tokens_close(r->train);
  chorus_tokens_close(r->val);
  chorus_bpe_free(r->bpe);
  r->train = r->val = NULL;
  r->bpe = NULL;
}

static int comm_failed(run_t *r, const char *what, chorus_result_t st) {
  r->fail_what = what;
  r->fail_st = st;
  return STEP_COMM;
}

static int64_t wall_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The trace of a step's collectives (and, sharded, each unit's compute),
 * and the optimizer step from t_wait on. */
static void trace_step(run_t *r, long step, int64_t t_wait) {
  if (!r->tr) return;
  trace_add(r->tr, "optimizer step", 0, (int)step, -1, t_wait, now_ns(), 0);
  chorus_ddp_t *ddp = chorus_trainer_ddp(r->trainer);
  chorus_fsdp_t *f = chorus_trainer_fsdp(r->trainer);
  if (ddp) {
    chorus_ddp_stats_t bs;
    chorus_ddp_get_stats(ddp, &bs);
    for (int i = 0; i < bs.buckets; i++) {
      int64_t b0, b1;
      size_t bytes;
      chorus_ddp_bucket_times(ddp, i, &b0, &b1, &bytes);
      trace_add(r->tr, "all_reduce bucket", 1, (int)step, i, b0, b1, bytes);
    }
  }
  static const char *const names[] = {"forward unit", "backward unit", "all_gather unit",
                                      "reduce_scatter unit", "all_reduce unit"};
  const chorus_fsdp_event_t *e;
  for (int i = 0; f && (e = chorus_fsdp_event(f, i)); i++)
    trace_add(r->tr, names[e->kind], e->kind >= CHORUS_FSDP_GATHER, (int)step, e->unit,
              e->start_ns, e->end_ns, e->bytes);
}

/* --dump: the master weights as raw float32, by rank 0 (every rank with
 * --dump-all, to FILE.rank<R>).  Sharded runs gather them unit by unit.
 * 0, or -1 (reported). */
static int dump_weights(run_t *r, const char *file, int all) {
  float *w = malloc(r->np * sizeof(float));
  if (!w) return -1;
  int rc = 0;
  for (int root = 0; root < (all ? g_size : 1) && rc == 0; root++) {
    chorus_result_t st = chorus_trainer_full_params(r->trainer, w, root);
    if (st != CHORUS_OK) {
      die(r->comm, "gathering the weights for --dump", st);
      rc = -1;
      break;
    }
    if (g_rank != root) continue;
    char path[4096];
    if (all) snprintf(path, sizeof path, "%s.rank%d", file, g_rank);
    else snprintf(path, sizeof path, "%s", file);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(w, sizeof(float), r->np, f) != r->np || fclose(f) != 0) {
      fprintf(stderr, "chorus-train: cannot write %s: %s\n", path, strerror(errno));
      rc = -1;
    }
  }
  free(w);
  return rc;
}

/* The process's peak resident memory (VmHWM), bytes; 0 when unknown. */
static size_t peak_rss(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
  fclose(f);
  return (size_t)kb * 1024;
}

/* Every rank's memory: what the runtime holds against the formula of its
 * stage (fp32 parameters and gradients, AdamW's two moments: 16 bytes a
 * parameter unsharded), the peak of gathered units, and the process's
 * peak resident memory. */
static void report_memory(run_t *r) {
  chorus_train_memory_t m;
  chorus_trainer_memory(r->trainer, &m);
  const double P = (double)r->np, N = g_size, ob = r->o->optim == CHORUS_OPTIM_ADAMW ? 8 : 4;
  const int s = r->o->shard;
  double formula = s == 0 ? (8 + ob) * P : s == 1 ? 8 * P + ob * P / N
                 : s == 2 ? 4 * P + (4 + ob) * P / N : (8 + ob) * P / N;
  const double state = (double)(m.params + m.grads + m.optim);
  printf("memory rank %d: stage %d: parameters %.2f MiB, gradients %.2f MiB, optimizer %.2f MiB "
         "= state %.2f MiB (formula %.2f MiB, %.3fx); gathered units peak %.2f MiB (bound "
         "%.2f); activations %.2f MiB; peak resident %.1f MiB\n",
         g_rank, s, m.params / 1048576.0, m.grads / 1048576.0, m.optim / 1048576.0,
         state / 1048576.0, formula / 1048576.0, state / formula, m.work_peak / 1048576.0,
         m.work_bound / 1048576.0, m.activations / 1048576.0, peak_rss() / 1048576.0);
  if (r->elastic) {
    chorus_elastic_stats_t es;
    chorus_elastic_get_stats(r->elastic, &es);
    if (s)
      printf("memory rank %d: replica of rank %d's shard (%s) %.2f MiB = %.3fx the shard's "
             "masters and optimizer state (%.2f MiB); incoming copy %.2f MiB; own copy %.2f "
             "MiB\n", g_rank, es.buddy, es.buddy_same_host ? "on this host: no other" :
             "on another host", es.replica_bytes / 1048576.0,
             (double)es.replica_bytes / (double)(m.optim + m.optim / (ob / 4)),
             (m.optim + m.optim / (ob / 4)) / 1048576.0, es.staging_bytes / 1048576.0,
             es.snapshot_bytes / 1048576.0);
    else
      printf("memory rank %d: snapshots for --elastic inplace %.2f MiB (the last two steps)\n",
             g_rank, es.snapshot_bytes / 1048576.0);
  }
  fflush(stdout);
}

/* --log-data: the sequence numbers of a batch, to FILE.rank<R> (opened per
 * line: the rank can change with an elastic world). */
static void log_batch(const opts_t *o, long step, const size_t *idx, int B) {
  char path[4096];
  snprintf(path, sizeof path, "%s.rank%d", o->log_data, g_rank);
  FILE *f = fopen(path, "a");
  if (!f) return;
  fprintf(f, "%ld:", step);
  for (int b = 0; b < B; b++) fprintf(f, " %zu", idx[b]);
  fputc('\n', f);
  fclose(f);
}

/* One optimizer step: STEP_NEXT, STEP_STOP (out of data, --stop-after),
 * STEP_FATAL (reported) or STEP_COMM (a collective failed: r->fail_*). */
static int train_step(run_t *r, long step) {
  const opts_t *o = r->o;
  const int T = o->model.ctx, B = o->batch;
  chorus_result_t st;
  if (step == o->kill_at && g_rank == o->kill_rank && r->first_generation) {
    fprintf(stderr, "chorus-train: rank %d kills itself at step %ld (--kill-at) at wall clock "
            "%lld ms\n", g_rank, step, (long long)wall_ms());
    raise(SIGKILL);
  }
  double t0 = now_s(), tf = 0, tb = 0, td = 0;
  chorus_trainer_begin_step(r->trainer);
  float loss_sum = 0;
  /* Uneven inputs: a rank out of data joins -- it contributes zero
   * gradients to the others' reductions (averaged over all ranks, as
   * PyTorch's Join does by default) and applies the same update, so every
   * rank keeps the same weights; training ends when no rank has data. */
  int have = !(g_rank == o->uneven_rank && step >= o->uneven_steps), active = have;
  if (o->uneven_rank >= 0 &&
      (st = chorus_trainer_join(r->trainer, have, &active)) != CHORUS_OK)
    return comm_failed(r, "join", st);
  if (active == 0) {
    say("step %ld: every rank is out of data\n", step);
    return STEP_STOP;
  }
  for (int a = 0; a < o->accum; a++) {
    const int last = a == o->accum - 1;
    if (!have) {
      if ((st = chorus_trainer_micro_step(r->trainer, NULL, NULL, 0, 0, 0, last, NULL)) !=
          CHORUS_OK)
        return comm_failed(r, "a joined rank's share of the step", st);
      continue;
    }
    double waited = 0;
    if ((st = chorus_loader_next(r->ld, r->tok, r->tgt, r->idx, &waited)) != CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: the training data: %s\n", g_rank,
              chorus_train_last_error());
      die(r->comm, "reading a batch", st);
      return STEP_FATAL;
    }
    td += waited;
    if (o->log_data) log_batch(o, step, r->idx, B);
    float loss = 0;
    /* --inject-inf: a backward weighted by infinity fills rank 1's
     * gradients with inf and NaN. */
    const float w = step == o->inject_inf && g_rank == 1 ? INFINITY : 1.0f / (float)o->accum;
    st = chorus_trainer_micro_step(r->trainer, r->tok, r->tgt, B, T, w, last, &loss);
    if (st != CHORUS_OK) {
      /* A collective under the pass failed (sharded runs gather and reduce
       * inside it), or the pass itself refused its input. */
      if (chorus_comm_status(r->comm) != CHORUS_OK) return comm_failed(r, "forward/backward", st);
      die(NULL, "forward/backward", st);
      return STEP_FATAL;
    }
    int64_t ns[3];
    chorus_trainer_pass_times(r->trainer, ns);
    trace_add(r->tr, "forward", 0, (int)step, -1, ns[0], ns[1], 0);
    trace_add(r->tr, "backward", 0, (int)step, -1, ns[1], ns[2], 0);
    tf += (double)(ns[1] - ns[0]) / 1e9;
    tb += (double)(ns[2] - ns[1]) / 1e9;
    loss_sum += loss;
  }
  if (g_rank == o->slow_rank) { /* --slowdown: a slower machine */
    sleep_s((o->slow_factor - 1.0) * (tf + tb));
  }
  double w0 = now_s();
  int64_t nw0 = now_ns();
  float lr = chorus_lr_at(step, o->warmup, o->steps, o->lr, o->lr * o->min_lr_frac);
  chorus_step_info_t info;
  if ((st = chorus_trainer_finish_step(r->trainer, lr, &info)) != CHORUS_OK)
    return comm_failed(r, "the optimizer step (gradient reductions)", st);
  double w1 = now_s();
  trace_step(r, step, nw0);
  if (info.skipped) {
    r->skipped_steps++;
    say("step %ld: inf/NaN in the gradients: step skipped on every rank, loss scale now %g\n",
        step, info.loss_scale);
  }
  const double norm = info.grad_norm;
  r->steps_done = step + 1;
  double t1 = now_s();
  double dt = t1 - t0, tps = (double)g_size * B * T * o->accum / dt;
  /* Sharded runs wait for gathers inside the passes: that time is in
   * fwd/bwd and in exposed comm both. */
  const double opt_s = (w1 - w0) - info.wait_s;
  /* --elastic inplace, sharded: what the replicas' upkeep cost the step
   * (waiting for the transfers, copying at the commit). */
  double rep_s = 0;
  if (r->elastic && o->shard) {
    chorus_elastic_stats_t es;
    chorus_elastic_get_stats(r->elastic, &es);
    rep_s = es.upkeep_wait_s + es.upkeep_copy_s;
  }
  if (step >= 3) { /* after warm-up */
    r->sum_rep += rep_s;
    r->sum_tps += tps, r->sum_fwd += tf, r->sum_bwd += tb, r->sum_exp += info.exposed_s;
    r->sum_opt += opt_s, r->sum_comm += info.comm_s, r->sum_step += dt, r->sum_data += td;
    r->timed++;
  }
  /* The loss every rank saw, averaged (what PyTorch users log). */
  float mine = loss_sum / (float)o->accum, avg = mine;
  if (step % o->log_every == 0 || step == o->steps - 1) {
    if ((st = chorus_all_reduce(r->comm, &mine, &avg, 1, CHORUS_FLOAT32, CHORUS_AVG, NULL)) !=
        CHORUS_OK)
      return comm_failed(r, "loss all_reduce", st);
    char rep[48] = "";
    if (r->elastic && o->shard) snprintf(rep, sizeof rep, "  replica %.1f ms", 1e3 * rep_s);
    say("step %4ld/%d  loss %.4f  lr %.2e  norm %.3f  %.0f tok/s  data %.1f ms  fwd %.1f ms  "
        "bwd %.1f ms  exposed comm %.1f ms  optim %.1f ms%s\n",
        step, o->steps, avg, lr, norm, tps, 1e3 * td, 1e3 * tf, 1e3 * tb, 1e3 * info.exposed_s,
        1e3 * opt_s, rep);
  }
  if (o->val_every && ((step + 1) % o->val_every == 0 || step == o->steps - 1)) {
    float v;
    if ((st = validate(r->comm, r->m, r->val, o, r->tok, r->tgt, &v)) != CHORUS_OK)
      return comm_failed(r, "validation", st);
    if (isnan(r->first_val)) r->first_val = v;
    r->last_val = v;
    say("step %4ld  validation loss %.4f\n", step, v);
  }
  int stopping = o->stop_after >= 0 && step + 1 >= o->stop_after;
  if (o->ckpt_dir && ((o->ckpt_every && (step + 1) % o->ckpt_every == 0) ||
                      step == o->steps - 1 || stopping)) {
    st = checkpoint(o, r->trainer, r->ld, step + 1);
    if (st == CHORUS_ERR_SYSTEM || st == CHORUS_ERR_NO_MEMORY) {
      fprintf(stderr, "chorus-train: rank %d: stopping: the checkpoint could not be written\n",
              g_rank);
      return STEP_FATAL;
    }
    if (st != CHORUS_OK) return comm_failed(r, "checkpoint", st);
  }
  if (stopping) {
    say("stopping after %ld steps (--stop-after)\n", step + 1);
    return STEP_STOP;
  }
  return STEP_NEXT;
}

/* ------------------------------------------------------- --elastic inplace */

/* After a recovery or a growth: the runtime's communicator. */
static void world_changed(run_t *r) {
  if (!r->elastic) return;
  r->comm = chorus_elastic_comm(r->elastic);
  g_rank = chorus_comm_rank(r->comm);
  g_size = chorus_comm_size(r->comm);
}

/* The runtime's lines (elastic events, the servers' reports), as they come. */
static void log_line(void *arg, const char *line) {
  (void)arg;
  printf("%s\n", line);
  fflush(stdout);
}

/* The runtime lost a shard with its replica: the last checkpoint (or the
 * start, without one) over the survivors. */
static chorus_result_t reload_checkpoint(void *arg, long *step) {
  run_t *r = arg;
  world_changed(r);
  if (!r->o->ckpt_dir) {
    fprintf(stderr, "chorus-train: rank %d: no --checkpoint-dir to go back to\n", g_rank);
    return CHORUS_ERR_INVALID_ARG;
  }
  long s = resume(r->o, r->trainer, r->ld);
  if (s < 0) return CHORUS_ERR_REMOTE;
  if (s == 0 && loader_place(r->ld, 0, 0) != 0) return CHORUS_ERR_INVALID_ARG;
  *step = s;
  return CHORUS_OK;
}

/* ------------------------------------------------------------ --mode async */

/* The validation loss DDP's validate() reports on `world` ranks (the same
 * samples), computed here alone. */
static float validate_alone(chorus_gpt_t *m, const chorus_tokens_t *val, const opts_t *o,
                            int world, int *tok, int *tgt) {
  double sum = 0;
  for (int r = 0; r < world; r++) sum += val_loss_as(m, val, o, world, r, tok, tgt);
  return (float)(sum / world);
}

/* A server: serves until the budget is applied; server 0 then reports,
 * validates, samples and dumps the final weights. */
static int async_server(const opts_t *o, chorus_comm_t comm, chorus_ps_t *ps, const run_t *run) {
  const int W = chorus_ps_workers(ps);
  chorus_result_t st = chorus_ps_serve(ps);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  chorus_ps_stats_t s;
  chorus_ps_get_stats(ps, &s);
  const int lead = chorus_ps_leader(ps);
  if (s.takeovers)
    printf("rank %d took %d range(s) over from a dead server; it serves %d\n", g_rank,
           s.takeovers, s.ranges);
  if (lead) {
    long total = 0, mx = 0;
    double mean = 0;
    for (int i = 0; i < CHORUS_PS_HIST; i++) {
      total += s.hist[i];
      mean += (double)i * s.hist[i];
      if (s.hist[i]) mx = i;
    }
    char hist[512];
    size_t len = 0;
    hist[0] = '\0';
    for (int i = 0; i < CHORUS_PS_HIST && total; i++)
      if (s.hist[i] && len < sizeof hist)
        len += (size_t)snprintf(hist + len, sizeof hist - len, "%s%d%s: %.1f%%", len ? ", " : "",
                                i, i == CHORUS_PS_HIST - 1 ? "+" : "",
                                100.0 * s.hist[i] / total);
    const double tok = s.tokens;
    printf("summary: async, %d server(s), %d worker(s), --max-staleness %d: %.0f tokens in "
           "%.2f s = %.0f tok/s; %ld update(s) of %ld gradient(s) (%ld refused, %d worker(s) "
           "dropped)\n", o->servers, W, o->max_staleness, tok, s.seconds,
           s.seconds > 0 ? tok / s.seconds : 0.0, s.updates, s.applied, s.refused, s.dropped);
    if (o->mirror)
      printf("mirror: every update acknowledged by range 0's copy before its workers heard "
             "of it, %.2f ms on average\n", s.updates ? 1e3 * s.mirror_wait_s / s.updates : 0.0);
    printf("staleness: %s; mean %.2f, max %ld%s\n", total ? hist : "none",
           total ? mean / total : 0.0, mx, mx == CHORUS_PS_HIST - 1 ? " or more" : "");
    printf("training loss: %.4f (mean of all %ld gradients), %.4f (the last tenth)\n",
           s.loss_n ? s.loss_sum / s.loss_n : NAN, s.loss_n, s.tail_loss);
    fflush(stdout);
  }
  /* The leader (server 0, or the one serving its range now) puts the
   * whole model together for the last words. */
  const int want = o->val_every || o->sample > 0 || o->dump;
  chorus_gpt_t *m = NULL;
  if (lead && want &&
      chorus_gpt_create(&o->model, o->batch > 1 ? o->batch : 1, o->seed, &m) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank 0: %s\n", chorus_train_last_error());
    m = NULL;
  }
  int rc = 0;
  if (want) {
    /* The leader without a model passes no buffer: the call then fails on
     * every server at once. */
    st = chorus_ps_full_params(ps, m ? chorus_gpt_params(m) : NULL);
    if (st != CHORUS_OK || (lead && !m)) {
      if (st != CHORUS_OK) fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank,
                                   chorus_train_last_error());
      rc = 1;
    }
  }
  if (lead && m && rc == 0) {
    const size_t np = chorus_gpt_num_params(m);
    int *tok = malloc(sizeof(int) * (size_t)o->batch * o->model.ctx);
    int *tgt = malloc(sizeof(int) * (size_t)o->batch * o->model.ctx);
    if (o->val_every && tok && tgt)
      printf("validation loss %.4f (final weights; the samples DDP on %d ranks validates on)\n",
             validate_alone(m, run->val, o, W, tok, tgt), W);
    free(tok), free(tgt);
    if (o->sample > 0) sample_text(m, o, run->bpe, o->sample);
    if (o->dump) {
      FILE *f = fopen(o->dump, "wb");
      if (!f || fwrite(chorus_gpt_params(m), sizeof(float), np, f) != np || fclose(f) != 0) {
        fprintf(stderr, "chorus-train: cannot write %s: %s\n", o->dump, strerror(errno));
        rc = 1;
      }
    }
  }
  chorus_gpt_destroy(m);
  (void)comm;
  return rc;
}

/* A worker's test knobs around chorus_ps_train's loop. */
typedef struct {
  const opts_t *o;
  int first_generation;
  double slow; /* --slowdown's factor on this rank */
} knobs_t;

static void worker_step(void *arg, chorus_ps_t *ps, long step) {
  const knobs_t *k = arg;
  if (step == k->o->kill_at && g_rank == k->o->kill_rank && k->first_generation) {
    fprintf(stderr, "chorus-train: rank %d kills itself at step %ld (--kill-at) at wall clock "
            "%lld ms\n", g_rank, step, (long long)wall_ms());
    raise(SIGKILL);
  }
  if (step == k->o->bad_step && g_rank == k->o->bad_rank) chorus_ps_inject(ps, k->o->bad_kind);
}

static void worker_computed(void *arg, double compute_s) {
  const knobs_t *k = arg;
  sleep_s((k->slow - 1.0) * compute_s); /* --slowdown: a slower machine */
}

static void worker_log(void *arg, const char *line) {
  (void)arg;
  fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, line);
}

/* A worker: the runtime's loop, then its line. */
static int async_worker(const opts_t *o, chorus_ps_t *ps, const run_t *run) {
  const char *rcount = getenv("CHORUS_RESTART_COUNT");
  knobs_t k = {o, !rcount || !strcmp(rcount, "0"), g_rank == o->slow_rank ? o->slow_factor : 1.0};
  chorus_ps_train_config_t wc = {o->model.ctx, o->batch, o->accum, o->workers, o->data_prefetch,
                                 o->seed, o->data_delay_ms / 1e3, worker_step, worker_computed,
                                 worker_log, &k};
  chorus_ps_train_stats_t s;
  if (chorus_ps_train(ps, &o->model, run->train, &wc, &s) != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  const long n = s.steps + s.refused;
  printf("worker %d (rank %d): %ld step(s) applied, %.0f tok/s, compute %.1f ms/step%s, push and "
         "pull %.1f ms/step, staleness mean %.2f max %ld, %ld refused, mean loss %.4f\n",
         chorus_ps_worker(ps), g_rank, s.steps, s.seconds > 0 ? s.tokens / s.seconds : 0.0,
         n ? 1e3 * s.compute_s / (double)n : 0.0, k.slow > 1 ? " (slowed down)" : "",
         n ? 1e3 * s.wait_s / (double)n : 0.0, s.staleness_mean, s.staleness_max, s.refused,
         s.mean_loss);
  fflush(stdout);
  return 0;
}

/* --mode async: servers and workers instead of one data-parallel group. */
static int run_async(const opts_t *o, chorus_comm_t comm, const run_t *run) {
  chorus_ps_config_t pc = {.servers = o->servers,
                           .mirror = o->mirror,
                           .standby = o->standby,
                           .max_staleness = o->max_staleness,
                           .staleness_weight = o->staleness_weight,
                           .optim = CHORUS_OPTIM_ADAMW_DEFAULT,
                           .clip = o->clip,
                           .lr = o->lr,
                           .min_lr = o->lr * o->min_lr_frac,
                           .warmup = o->warmup,
                           .steps = o->steps,
                           .ckpt_dir = o->ckpt_dir,
                           .ckpt_every = o->ckpt_every,
                           .keep = o->keep,
                           .log_every = o->log_every,
                           .log = log_line};
  pc.optim.kind = o->optim;
  pc.optim.momentum = o->momentum;
  pc.optim.weight_decay = o->weight_decay;
  if (o->servers + o->standby >= g_size) {
    fprintf(stderr, "chorus-train: --mode async needs more ranks than server processes (%d): "
            "at least one worker\n", o->servers + o->standby);
    return 2;
  }
  chorus_ps_t *ps = NULL;
  chorus_result_t st = chorus_ps_create(comm, &o->model, o->seed, &pc, &ps);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    return 1;
  }
  const int W = chorus_ps_workers(ps);
  say("chorus-train: asynchronous data parallel: %d server(s)%s, %d worker(s), --max-staleness "
      "%d%s; model %d layers, %d heads, %d channels, context %d; batch %d x %d per worker, "
      "%d micro-step(s); a budget of %d steps x %d workers = %ld gradients%s\n",
      o->servers, !o->mirror ? "" : o->standby ? " mirrored (the last range on a standby)"
      : " mirrored (each range's copy on the next server)", W, o->max_staleness,
      o->staleness_weight ? ", stale gradients weighted "
      "1 / (1 + staleness)" : "", o->model.layers, o->model.heads, o->model.channels,
      o->model.ctx, o->batch, o->model.ctx, o->accum, o->steps, W, (long)o->steps * W,
      o->slow_rank >= 0 ? "; --slowdown" : "");
  int rc = chorus_ps_worker(ps) < 0 ? async_server(o, comm, ps, run) : async_worker(o, ps, run);
  chorus_ps_destroy(ps);
  return rc;
}

int main(int argc, char **argv) {
  opts_t o = {.data = "data/tinyshakespeare.txt", .workers = 1, .data_prefetch = 2,
              .model = CHORUS_GPT_CONFIG_DEFAULT,
              .batch = 8, .steps = 200, .warmup = 20, .val_every = 50, .val_batches = 8,
              .accum = 1, .sample = 300, .threads = 0, .overlap = 1, .log_every = 10,
              .lr = 3e-3f, .min_lr_frac = 0.1f, .weight_decay = 0.1f, .clip = 1.0f,
              .bucket_mb = 25.0, .hook = CHORUS_DDP_HOOK_NONE, .optim = CHORUS_OPTIM_ADAMW,
              .momentum = 0.9f, .seed = 1337, .keep = 3, .stop_after = -1, .kill_at = -1,
              .kill_rank = 1, .skip_rank = -1, .uneven_rank = -1, .loss_scale = -1,
              .inject_inf = -1, .elastic = -1, .prefetch = 1, .param_dtype = CHORUS_FLOAT32,
              .servers = 1, .max_staleness = 16, .slow_rank = -1, .slow_factor = 1.0,
              .bad_rank = -1, .bad_step = -1, .replica_every = 1};
  if (parse(argc, argv, &o) != 0) return 2;
  if (o.async && (o.shard || o.hook != CHORUS_DDP_HOOK_NONE || o.loss_scale > 0 ||
                  o.uneven_rank >= 0 || o.skip_rank >= 0 || o.trace || o.export_path ||
                  o.stop_after >= 0 || o.param_dtype != CHORUS_FLOAT32 || o.mem_cap ||
                  o.elastic > 0 || o.inject_inf >= 0)) {
    fprintf(stderr, "chorus-train: --mode async trains fp32 parameters on servers; it does not "
            "take --shard, --hook, --loss-scale, --uneven, --skip-layer, --trace, --export, "
            "--stop-after, --param-dtype, --mem-cap, --inject-inf or --elastic (a dead worker "
            "is dropped and the others go on by design; run chorusrun --elastic inplace so "
            "that it lets them)\n");
    return 2;
  }
  if (!o.async && (o.servers != 1 || o.bad_rank >= 0 || o.staleness_weight || o.mirror ||
                   o.standby)) {
    fprintf(stderr, "chorus-train: --servers, --mirror, --standby, --staleness-weight and "
            "--bad-push need --mode async\n");
    return 2;
  }
  if (o.standby && !o.mirror) {
    fprintf(stderr, "chorus-train: --standby keeps a copy: it needs --mirror\n");
    return 2;
  }
  if (o.mirror && o.servers + o.standby < 2) {
    fprintf(stderr, "chorus-train: --mirror keeps each range's copy on another server process: "
            "give --servers 2 or more, or --standby\n");
    return 2;
  }
  if (o.elastic < 0 && o.async) o.elastic = 0;
  if (o.elastic < 0) { /* chorusrun --elastic tells its workers */
    const char *e = getenv("CHORUS_ELASTIC");
    o.elastic = e && !strcmp(e, "inplace");
  }
  const char *join_env = getenv("CHORUS_JOIN");
  const int join = join_env && !strcmp(join_env, "1");
  if (!o.elastic && join) {
    fprintf(stderr, "chorus-train: CHORUS_JOIN=1 (started into a running job) needs --elastic "
            "inplace: the running ranks take newcomers in only then\n");
    return 2;
  }
  if (o.elastic && o.uneven_rank >= 0) {
    fprintf(stderr, "chorus-train: --uneven and --elastic inplace do not go together (the "
            "rank out of data could be the one that dies)\n");
    return 2;
  }
  if (o.replica_every < 1) {
    fprintf(stderr, "chorus-train: --replica-every %d: give K >= 1\n", o.replica_every);
    return 2;
  }
  if (o.shard && o.hook == CHORUS_DDP_HOOK_FP16) {
    fprintf(stderr, "chorus-train: --shard %d reduces gradients in fp32 or bf16 (--hook bf16), "
            "not fp16\n", o.shard);
    return 2;
  }
  if (o.loss_scale < 0) o.loss_scale = o.hook == CHORUS_DDP_HOOK_FP16;
  run_t r = {.o = &o, .first_val = NAN, .last_val = NAN};
  chorus_result_t st = init_comm(join, &r.comm);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: cannot join the group: %s\n", chorus_last_init_error());
    return 1;
  }
  g_rank = chorus_comm_rank(r.comm);
  g_size = chorus_comm_size(r.comm);
  /* BLAS threads: share the cores among the ranks of this host. */
  int local = chorus_comm_local_size(r.comm) > 0 ? chorus_comm_local_size(r.comm) : g_size;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = o.threads > 0 ? o.threads : (int)(cores / local > 0 ? cores / local : 1);
  if (openblas_set_num_threads) openblas_set_num_threads(threads);

  if (open_data(&o, &r) != 0) {
    chorus_comm_abort(r.comm);
    chorus_comm_destroy(r.comm);
    return 1;
  }
  if (o.async) {
    int rc = run_async(&o, r.comm, &r);
    close_data(&r);
    chorus_comm_destroy(r.comm);
    return rc;
  }
  chorus_trainer_config_t tc = {.shard = o.shard,
                                .ddp = CHORUS_DDP_CONFIG_DEFAULT,
                                .fsdp = CHORUS_FSDP_CONFIG_DEFAULT,
                                .optim = CHORUS_OPTIM_ADAMW_DEFAULT,
                                .clip = o.clip,
                                .loss_scale = o.loss_scale,
                                .param_dtype = o.param_dtype,
                                .mem_cap = o.mem_cap};
  tc.ddp.bucket_mb = o.bucket_mb;
  tc.ddp.overlap = o.overlap;
  tc.ddp.hook = o.hook;
  tc.fsdp.prefetch = o.prefetch;
  tc.fsdp.overlap = o.overlap;
  tc.fsdp.reduce_dtype = o.hook == CHORUS_DDP_HOOK_BF16 ? CHORUS_BFLOAT16 : CHORUS_FLOAT32;
  tc.optim.kind = o.optim;
  tc.optim.momentum = o.momentum;
  tc.optim.weight_decay = o.weight_decay;
  /* A newcomer makes it on the grown world with the members (who move
   * theirs to it), then takes their state (chorus_elastic_join). */
  st = chorus_trainer_create(r.comm, &o.model, o.batch, o.seed, &tc, &r.trainer);
  if (st != CHORUS_OK) {
    fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
    if (st != CHORUS_ERR_NO_MEMORY || !o.mem_cap) chorus_comm_abort(r.comm);
    chorus_comm_destroy(r.comm);
    return 1;
  }
  r.m = chorus_trainer_model(r.trainer);
  r.opt = chorus_trainer_optim(r.trainer);
  r.np = chorus_gpt_num_params(r.m);
  if (o.skip_rank == g_rank && (st = chorus_gpt_skip_layer(r.m, o.skip_layer, 1)) != CHORUS_OK)
    return die(NULL, "--skip-layer", st);

  const int T = o.model.ctx, B = o.batch;
  chorus_loader_config_t lc = {T, B, o.workers, o.data_prefetch, 1, 0, o.seed,
                               o.data_delay_ms / 1e3, 0};
  if ((st = chorus_loader_create(r.train, &lc, g_size, g_rank, &r.ld)) != CHORUS_OK)
    return die(r.comm, o.data, st);
  const size_t nsamples = chorus_loader_sequences(r.ld);
  r.tok = malloc(sizeof(int) * (size_t)B * T);
  r.tgt = malloc(sizeof(int) * (size_t)B * T);
  r.idx = malloc(sizeof(size_t) * (size_t)B);
  if (o.elastic) {
    chorus_elastic_config_t ec = CHORUS_ELASTIC_CONFIG_DEFAULT;
    ec.replica_every = o.replica_every;
    ec.reload = reload_checkpoint;
    ec.reload_arg = &r;
    ec.log = log_line;
    if ((st = chorus_elastic_create(r.trainer, r.ld, &ec, &r.elastic)) != CHORUS_OK)
      return die(r.comm, "--elastic inplace", st);
  }
  if (!r.tok || !r.tgt || !r.idx) return die(r.comm, "buffers", CHORUS_ERR_NO_MEMORY);
  char mode[128];
  if (o.shard == 0) {
    chorus_ddp_stats_t ds = {0};
    if (chorus_trainer_ddp(r.trainer)) chorus_ddp_get_stats(chorus_trainer_ddp(r.trainer), &ds);
    snprintf(mode, sizeof mode, "DDP, %d bucket(s)", ds.buckets);
  } else {
    snprintf(mode, sizeof mode, "sharded, stage %d (%s), %d units%s", o.shard,
             o.shard == 1 ? "optimizer state" : o.shard == 2 ? "+ gradients" : "+ parameters",
             chorus_gpt_num_units(r.m), o.shard == 3 && o.prefetch ? ", prefetch" : "");
    if (o.shard == 3 && o.prefetch) snprintf(mode + strlen(mode), sizeof mode - strlen(mode), " %d",
                                             o.prefetch);
  }
  say("chorus-train: %d rank(s), %d BLAS thread(s) each; model %d layers, %d heads, %d "
      "channels, context %d, vocabulary %d: %zu parameters; %s; batch %d x %d per rank, %d "
      "step(s) of %d micro-step(s); %zu training samples%s%s\n",
      g_size, threads, o.model.layers, o.model.heads, o.model.channels, T, o.model.vocab, r.np,
      mode, B, T, o.steps, o.accum, nsamples, o.elastic ? "; --elastic inplace" : "",
      o.param_dtype == CHORUS_BFLOAT16 ? "; bf16 parameters on fp32 masters" : "");
  say("data: %s: %zu tokens in %d file(s); validation %zu tokens; loader: %d worker(s) x %d "
      "batch(es) ahead%s\n", o.data, chorus_tokens_count(r.train),
      chorus_tokens_files(r.train), chorus_tokens_count(r.val), o.workers,
      o.workers ? o.data_prefetch : 0, o.data_delay_ms > 0 ? "; --data-delay-ms" : "");

  long start = 0;
  if (join) {
    /* A newcomer: the members hand over their state. */
    if ((st = chorus_elastic_join(r.elastic, &start)) != CHORUS_OK)
      return die(r.comm, "joining the running job", st);
    fprintf(stderr, "chorus-train: joined the running job as rank %d of %d at step %ld\n", g_rank,
            g_size, start);
  } else if (o.ckpt_dir) {
    if ((start = resume(&o, r.trainer, r.ld)) < 0) return die(r.comm, "resuming", CHORUS_ERR_REMOTE);
    if (start >= o.steps)
      say("nothing to train: the checkpoint in %s has %ld of --steps %d step(s) done; raise "
          "--steps to train further, or delete %s to start over\n", o.ckpt_dir, start, o.steps,
          o.ckpt_dir);
  }
  trace_t trace_buf = {0};
  r.tr = o.trace ? &trace_buf : NULL;
  if (g_rank == 1) trace_buf.skew = (int64_t)o.skew_ms * 1000000;
  r.steps_done = start;
  const char *rc = getenv("CHORUS_RESTART_COUNT");
  r.first_generation = !rc || !strcmp(rc, "0");
  const double loop_t0 = now_s();
  for (long step = start; step < o.steps;) {
    int how = STEP_NEXT;
    if (r.elastic && (st = chorus_elastic_begin_step(r.elastic, &step)) != CHORUS_OK)
      how = comm_failed(&r, "the start of the step (replicas, new ranks)", st);
    world_changed(&r);
    if (how == STEP_NEXT) how = train_step(&r, step);
    if (how == STEP_STOP) break;
    if (how == STEP_FATAL) return 1;
    if (how == STEP_COMM) {
      if (!r.elastic) return die(r.comm, r.fail_what, r.fail_st);
      if (!r.failed_ns) r.failed_ns = now_ns();
      fprintf(stderr, "chorus-train: rank %d: step %ld failed in %s (%s: %s); going on with "
              "the ranks still alive\n", g_rank, step, r.fail_what, chorus_result_name(r.fail_st),
              chorus_comm_last_error(r.comm));
      if (chorus_elastic_recover(r.elastic, &step) != CHORUS_OK) {
        fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
        return 1;
      }
      world_changed(&r);
      continue;
    }
    if (r.failed_ns) {
      say("elastic: step %ld done %.0f ms after the failure was seen (wall clock %lld ms)\n",
          step, (now_ns() - r.failed_ns) / 1e6, (long long)wall_ms());
      r.failed_ns = 0;
    }
    step++;
  }
  if (r.steps_done > start) {
    const double secs = now_s() - loop_t0;
    const double toks = (double)(r.steps_done - start) * g_size * B * T * o.accum;
    say("trained %.0f tokens in %.2f s = %.0f tok/s (the whole loop, first steps included)\n",
        toks, secs, secs > 0 ? toks / secs : 0.0);
  }
  if (r.timed) {
    double step_s = r.sum_step / r.timed;
    say("summary: %.0f tok/s (mean after 3 steps), step %.1f ms: data %.1f, fwd %.1f, bwd %.1f, "
        "exposed comm %.1f (%.0f %%), optim %.1f; %s %.1f ms per step, %.0f %% hidden behind "
        "%s\n",
        r.sum_tps / r.timed, 1e3 * step_s, 1e3 * r.sum_data / r.timed,
        1e3 * r.sum_fwd / r.timed, 1e3 * r.sum_bwd / r.timed,
        1e3 * r.sum_exp / r.timed, 100.0 * r.sum_exp / r.timed / step_s,
        1e3 * r.sum_opt / r.timed, o.shard ? "collectives" : "all_reduce",
        1e3 * r.sum_comm / r.timed,
        r.sum_comm > 0 && r.sum_exp < r.sum_comm ? 100.0 * (1.0 - r.sum_exp / r.sum_comm) : 0.0,
        o.shard ? "compute" : "backward");
    if (r.elastic && o.shard)
      say("replicas: %.2f ms per step waiting for and committing the copies (every %d "
          "step(s))\n", 1e3 * r.sum_rep / r.timed, o.replica_every);
    if (!isnan(r.first_val)) say("validation loss %.4f -> %.4f\n", r.first_val, r.last_val);
  }
  if (r.tr && trace_write(r.comm, r.tr, o.trace_ping, o.trace) != 0)
    fprintf(stderr, "chorus-train: rank %d: cannot write the trace %s\n", g_rank, o.trace);
  free(trace_buf.ev);
  if (o.sample > 0) sample_text(r.m, &o, r.bpe, o.sample);
  if (o.dump && dump_weights(&r, o.dump, o.dump_all) != 0) return 1;
  if (o.export_path) {
    train_state_t ts = train_state(&o, r.ld, r.steps_done);
    if ((st = chorus_trainer_export(r.trainer, o.export_path, r.steps_done, &ts, sizeof ts)) !=
        CHORUS_OK) {
      fprintf(stderr, "chorus-train: rank %d: %s\n", g_rank, chorus_train_last_error());
      return 1;
    }
    say("exported: %s (step %ld)\n", o.export_path, r.steps_done);
  }
  report_memory(&r);
  chorus_elastic_destroy(r.elastic);
  free(r.tok), free(r.tgt), free(r.idx);
  chorus_loader_destroy(r.ld);
  chorus_trainer_destroy(r.trainer);
  close_data(&r);
  chorus_comm_destroy(r.comm);
  return 0;
}
