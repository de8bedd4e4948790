/*
 * train_opts.c - chorus-train's options: the help, each option's strict
 * value, and the checks of options that do not go together.
 */
#include <ctype.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "opt.h"
#include "train.h"

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
/* Each numeric option's value: in its range, or -1 (reported). */
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

static const long big = INT_MAX; /* "or more" */

/* The options that have no letter (c >= 1000): sharding, asynchronous
 * training, the data.  0, or -1 (reported). */
static int parse_long_only(int c, const char *name, opts_t *o) {
  static const chorus_dtype_t pdtypes[] = {CHORUS_FLOAT32, CHORUS_BFLOAT16};
  static const int formats[] = {CHORUS_TOKENS_AUTO, CHORUS_TOKENS_LLMC, CHORUS_TOKENS_RAW16,
                                CHORUS_TOKENS_TEXT};
  int k;
  switch (c) {
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
  }
  return 0;
}

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
  int c, idx, k;
  char name[40];
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
      case 'h': usage(stdout); exit(0);
      default:
        if (c >= 1000) { /* the options without a letter */
          if (parse_long_only(c, name, o)) return -1;
          break;
        }
        opt_getopt_error(P, c, argv);
        return -1;
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

/* The options that do not go together, and what the environment says.
 * 0, or 2 (reported). */
static int check_options(opts_t *o) {
  if (o->async && (o->shard || o->hook != CHORUS_DDP_HOOK_NONE || o->loss_scale > 0 ||
                  o->uneven_rank >= 0 || o->skip_rank >= 0 || o->trace || o->export_path ||
                  o->stop_after >= 0 || o->param_dtype != CHORUS_FLOAT32 || o->mem_cap ||
                  o->elastic > 0 || o->inject_inf >= 0)) {
    fprintf(stderr, "chorus-train: --mode async trains fp32 parameters on servers; it does not "
            "take --shard, --hook, --loss-scale, --uneven, --skip-layer, --trace, --export, "
            "--stop-after, --param-dtype, --mem-cap, --inject-inf or --elastic (a dead worker "
            "is dropped and the others go on by design; run chorusrun --elastic inplace so "
            "that it lets them)\n");
    return 2;
  }
  if (!o->async && (o->servers != 1 || o->bad_rank >= 0 || o->staleness_weight || o->mirror ||
                   o->standby)) {
    fprintf(stderr, "chorus-train: --servers, --mirror, --standby, --staleness-weight and "
            "--bad-push need --mode async\n");
    return 2;
  }
  if (o->standby && !o->mirror) {
    fprintf(stderr, "chorus-train: --standby keeps a copy: it needs --mirror\n");
    return 2;
  }
  if (o->mirror && o->servers + o->standby < 2) {
    fprintf(stderr, "chorus-train: --mirror keeps each range's copy on another server process: "
            "give --servers 2 or more, or --standby\n");
    return 2;
  }
  if (o->elastic < 0 && o->async) o->elastic = 0;
  if (o->elastic < 0) { /* chorusrun --elastic tells its workers */
    const char *e = getenv("CHORUS_ELASTIC");
    o->elastic = e && !strcmp(e, "inplace");
  }
  const char *join_env = getenv("CHORUS_JOIN");
  o->join = join_env && !strcmp(join_env, "1");
  if (!o->elastic && o->join) {
    fprintf(stderr, "chorus-train: CHORUS_JOIN=1 (started into a running job) needs --elastic "
            "inplace: the running ranks take newcomers in only then\n");
    return 2;
  }
  if (o->elastic && o->uneven_rank >= 0) {
    fprintf(stderr, "chorus-train: --uneven and --elastic inplace do not go together (the "
            "rank out of data could be the one that dies)\n");
    return 2;
  }
  if (o->replica_every < 1) {
    fprintf(stderr, "chorus-train: --replica-every %d: give K >= 1\n", o->replica_every);
    return 2;
  }
  if (o->shard && o->hook == CHORUS_DDP_HOOK_FP16) {
    fprintf(stderr, "chorus-train: --shard %d reduces gradients in fp32 or bf16 (--hook bf16), "
            "not fp16\n", o->shard);
    return 2;
  }
  if (o->loss_scale < 0) o->loss_scale = o->hook == CHORUS_DDP_HOOK_FP16;
  if (o->loss_scale < 0) o->loss_scale = o->hook == CHORUS_DDP_HOOK_FP16;
  return 0;
}

int train_options(int argc, char **argv, opts_t *o) {
  *o = (opts_t){.data = "data/tinyshakespeare.txt", .workers = 1, .data_prefetch = 2,
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
  if (parse(argc, argv, o) != 0) return 2;
  return check_options(o);
}
