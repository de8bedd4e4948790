/*
 * gpt.c - the model: parameter layout, initialisation, forward, backward.
 *
 * Block l (pre-norm, GPT-2 style), with x the residual stream (B,T,C):
 *   a  = ln1(x);  qkv = a W_qkv^T + b_qkv;  y = attention(qkv)
 *   x += y W_proj^T + b_proj
 *   f  = ln2(x);  h = gelu(f W_fc^T + b_fc)            (B,T,4C)
 *   x += h W_fcproj^T + b_fcproj
 * then logits = lnf(x) wte^T (the output projection is the token embedding).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "train/layers.h"
#include "train/runtime.h"

/* Per-block tensors, in forward order. */
enum {
  P_LN1W, P_LN1B, P_QKVW, P_QKVB, P_PROJW, P_PROJB,
  P_LN2W, P_LN2B, P_FCW, P_FCB, P_FCPW, P_FCPB, P_PER_LAYER
};
static const char *const k_block_names[P_PER_LAYER] = {
    "ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
    "ln2.w", "ln2.b", "mlp.fc.w",   "mlp.fc.b",   "mlp.proj.w",  "mlp.proj.b"};

/* Saved activations of one block. */
typedef struct {
  float *ln1, *ln1_mean, *ln1_rstd; /* (N,C), (N), (N) */
  float *qkv;                       /* (N,3C) */
  float *att;                       /* (B,NH,T,T) */
  float *atty;                      /* (N,C) */
  float *res2;                      /* (N,C) x after attention */
  float *ln2, *ln2_mean, *ln2_rstd;
  float *fch, *fch_gelu;            /* (N,4C) */
  float *res3;                      /* (N,C) x after the MLP */
} block_acts_t;

/* How a tensor starts: N(0, std) from the stream, ones, or zeros. */
typedef struct {
  float std;      /* > 0: normal; 0: constant */
  float value;    /* the constant */
  uint64_t calls; /* normals: generator calls made before this tensor */
} tensor_init_t;

struct chorus_gpt {
  chorus_gpt_config_t cfg;
  int max_batch;
  size_t nparams;
  float *params, *grads; /* NULL with CHORUS_GPT_EXTERNAL */
  int ntensors;
  chorus_gpt_tensor_t *tensors;
  char *names;
  tensor_init_t *init;
  int *tunit;   /* tensor -> unit */
  size_t *trel; /* tensor's offset inside its unit */
  int nunits;
  chorus_gpt_unit_t *units;
  float **upar, **ugrd; /* where each unit's parameters and gradients live */
  chorus_gpt_unit_fn hook;
  void *hook_arg;
  unsigned char *skip;   /* per block: identity */
  unsigned char *skipped; /* per block, as the last forward ran */
  /* activations of the last forward */
  int B, T, have_targets;
  int *tokens, *targets;
  float *x0;                        /* (N,C) embeddings */
  block_acts_t *blk;
  float *lnf, *lnf_mean, *lnf_rstd; /* (N,C), (N), (N) */
  float *logits, *probs, *losses;   /* (N,V), (N,V), (N) */
  /* backward scratch */
  float *dres, *dtmp, *dbig, *dbig2, *dqkv, *datt, *dlogits;
  float *arena;
  size_t arena_size;
};

/* ------------------------------------------------------------------ RNG */

/* splitmix64 -> xoshiro-free, portable: the same normals everywhere. */
static uint64_t rng_next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
static double rng_uniform(uint64_t *s) { /* (0, 1] */
  return ((double)(rng_next(s) >> 11) + 1.0) / 9007199254740992.0;
}
/* Elements [lo, hi) of a tensor of normals whose stream starts at s (the
 * generator state before its first call).  Box-Muller makes two normals of
 * each pair of uniforms, and a call only adds a constant to the state, so
 * element i's pair starts 2 * (i / 2) calls in: any range costs only its
 * own length -- what a rank initialising its shard alone needs. */
static void fill_normal_range(float *dst, size_t lo, size_t hi, float std, uint64_t s) {
  for (size_t i = lo & ~(size_t)1; i < hi; i += 2) {
    uint64_t st = s + 0x9E3779B97F4A7C15ull * (uint64_t)i;
    double u1 = rng_uniform(&st), u2 = rng_uniform(&st);
    double r = sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
    if (i >= lo) dst[i - lo] = (float)(r * cos(a)) * std;
    if (i + 1 >= lo && i + 1 < hi) dst[i + 1 - lo] = (float)(r * sin(a)) * std;
  }
}

/* --------------------------------------------------------------- layout */

static size_t block_size(int what, int C) {
  switch (what) {
    case P_QKVW: return (size_t)3 * C * C;
    case P_QKVB: return (size_t)3 * C;
    case P_PROJW: return (size_t)C * C;
    case P_FCW: return (size_t)4 * C * C;
    case P_FCB: return (size_t)4 * C;
    case P_FCPW: return (size_t)4 * C * C;
    default: return (size_t)C; /* layernorm gains and biases, proj.b, mlp.proj.b */
  }
}

/* Tensor t in the parameters (or gradients) of its unit, wherever the
 * unit lives now. */
static float *tpar(const chorus_gpt_t *m, int t) { return m->upar[m->tunit[t]] + m->trel[t]; }
static float *tgrd(const chorus_gpt_t *m, int t) { return m->ugrd[m->tunit[t]] + m->trel[t]; }
#define PAR(l, w) tpar(m, 2 + (l) * P_PER_LAYER + (w))
#define GRD(l, w) tgrd(m, 2 + (l) * P_PER_LAYER + (w))
#define T_WTE 0
#define T_WPE 1
#define T_LNFW (m->ntensors - 2)
#define T_LNFB (m->ntensors - 1)

chorus_result_t chorus_gpt_create(const chorus_gpt_config_t *cfg, int max_batch, uint64_t seed,
                                  chorus_gpt_t **out) {
  return chorus_gpt_create_ex(cfg, max_batch, seed, 0, out);
}

void chorus_gpt_init_range(const chorus_gpt_t *m, uint64_t seed, size_t offset, size_t n,
                           float *dst) {
  const size_t end = offset + n;
  for (int t = 0; t < m->ntensors; t++) {
    const chorus_gpt_tensor_t *ts = &m->tensors[t];
    size_t lo = ts->offset > offset ? ts->offset : offset;
    size_t hi = ts->offset + ts->size < end ? ts->offset + ts->size : end;
    if (lo >= hi) continue;
    const tensor_init_t *in = &m->init[t];
    float *d = dst + (lo - offset);
    if (in->std > 0)
      fill_normal_range(d, lo - ts->offset, hi - ts->offset, in->std,
                        seed + 0x9E3779B97F4A7C15ull * in->calls);
    else
      for (size_t i = 0; i < hi - lo; i++) d[i] = in->value;
  }
}

chorus_result_t chorus_gpt_create_ex(const chorus_gpt_config_t *cfg, int max_batch,
                                     uint64_t seed, unsigned flags, chorus_gpt_t **out) {
  if (!out) return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_create: out is NULL");
  *out = NULL;
  if (!cfg || cfg->vocab < 2 || cfg->ctx < 1 || cfg->layers < 1 || cfg->heads < 1 ||
      cfg->channels < 1 || cfg->channels % cfg->heads || max_batch < 1 ||
      (flags & ~CHORUS_GPT_EXTERNAL))
    return chorus__train_fail(
        CHORUS_ERR_INVALID_ARG,
        "chorus_gpt_create: bad shape (vocab %d, ctx %d, layers "
        "%d, heads %d, channels %d, batch %d) or flags %#x: channels must be a multiple "
        "of heads",
        cfg ? cfg->vocab : 0, cfg ? cfg->ctx : 0, cfg ? cfg->layers : 0, cfg ? cfg->heads : 0,
        cfg ? cfg->channels : 0, max_batch, flags);
  chorus_gpt_t *m = calloc(1, sizeof *m);
  if (!m) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_gpt_create: out of memory");
  m->cfg = *cfg;
  m->max_batch = max_batch;
  const int V = cfg->vocab, C = cfg->channels, L = cfg->layers, Tm = cfg->ctx, NH = cfg->heads;
  m->ntensors = 2 + L * P_PER_LAYER + 2;
  m->nunits = L + 2;
  m->tensors = calloc((size_t)m->ntensors, sizeof *m->tensors);
  m->names = calloc((size_t)m->ntensors, 32);
  m->init = calloc((size_t)m->ntensors, sizeof *m->init);
  m->tunit = calloc((size_t)m->ntensors, sizeof *m->tunit);
  m->trel = calloc((size_t)m->ntensors, sizeof *m->trel);
  m->units = calloc((size_t)m->nunits, sizeof *m->units);
  m->upar = calloc((size_t)m->nunits, sizeof *m->upar);
  m->ugrd = calloc((size_t)m->nunits, sizeof *m->ugrd);
  if (!m->tensors || !m->names || !m->init || !m->tunit || !m->trel || !m->units || !m->upar ||
      !m->ugrd)
    goto oom;
  /* Layout, and how each tensor starts: the normals come from one stream
   * in layout order (each tensor takes an even number of calls). */
  size_t off = 0;
  uint64_t calls = 0;
  int k = 0;
#define ADD(nm, sz, ly, std_, val_)                                            \
  do {                                                                         \
    char *slot = m->names + 32 * k;                                            \
    snprintf(slot, 32, "%s", nm);                                              \
    m->tensors[k] = (chorus_gpt_tensor_t){slot, off, (sz), (ly)};              \
    m->init[k] = (tensor_init_t){(std_), (val_), calls};                       \
    if ((std_) > 0) calls += 2 * (((sz) + 1) / 2);                             \
    off += (sz);                                                               \
    k++;                                                                       \
  } while (0)
  const float proj_std = 0.02f / sqrtf(2.0f * (float)L);
  ADD("wte", (size_t)V * C, -1, 0.02f, 0.0f);
  ADD("wpe", (size_t)Tm * C, -1, 0.01f, 0.0f);
  for (int l = 0; l < L; l++)
    for (int w = 0; w < P_PER_LAYER; w++) {
      char nm[32];
      snprintf(nm, sizeof nm, "h.%d.%s", l, k_block_names[w]);
      float std = w == P_QKVW || w == P_FCW ? 0.02f : w == P_PROJW || w == P_FCPW ? proj_std : 0;
      ADD(nm, block_size(w, C), l, std, w == P_LN1W || w == P_LN2W ? 1.0f : 0.0f);
    }
  ADD("lnf.w", (size_t)C, -1, 0.0f, 1.0f);
  ADD("lnf.b", (size_t)C, -1, 0.0f, 0.0f);
#undef ADD
  m->nparams = off;
  /* Units: the embeddings, each block, the final layernorm. */
  for (int u = 0; u < m->nunits; u++) {
    int first = u == 0 ? 0 : u <= L ? 2 + (u - 1) * P_PER_LAYER : m->ntensors - 2;
    int count = u == 0 || u == L + 1 ? 2 : P_PER_LAYER;
    const chorus_gpt_tensor_t *last = &m->tensors[first + count - 1];
    m->units[u] = (chorus_gpt_unit_t){m->tensors[first].offset,
                                      last->offset + last->size - m->tensors[first].offset,
                                      first, count};
    for (int t = first; t < first + count; t++) {
      m->tunit[t] = u;
      m->trel[t] = m->tensors[t].offset - m->tensors[first].offset;
    }
  }
  if (!(flags & CHORUS_GPT_EXTERNAL)) {
    m->params = malloc(sizeof(float) * off);
    m->grads = calloc(off, sizeof(float));
    if (!m->params || !m->grads) goto oom;
    chorus_gpt_init_range(m, seed, 0, off, m->params);
    for (int u = 0; u < m->nunits; u++) {
      m->upar[u] = m->params + m->units[u].offset;
      m->ugrd[u] = m->grads + m->units[u].offset;
    }
  }

  /* Activations and backward scratch, one arena. */
  size_t N = (size_t)max_batch * Tm;
  size_t per_block = N * C * 2 + N * 2 + N * 3 * C + (size_t)max_batch * NH * Tm * Tm + N * C +
                     N * C + N * C + N * 2 + N * 4 * C * 2 + N * C;
  size_t total = N * C + per_block * L + N * C + N * 2 + N * V * 2 + N +
                 /* backward */ N * C * 2 + N * 4 * C * 2 + N * 3 * C +
                 chorus__attention_scratch(Tm, C, NH) + N * V;
  m->arena_size = total;
  m->arena = calloc(total, sizeof(float));
  m->blk = calloc((size_t)L, sizeof *m->blk);
  m->skip = calloc((size_t)L, 1);
  m->skipped = calloc((size_t)L, 1);
  m->tokens = calloc(N, sizeof(int));
  m->targets = calloc(N, sizeof(int));
  if (!m->arena || !m->blk || !m->tokens || !m->targets || !m->skip || !m->skipped) goto oom;
  float *p = m->arena;
#define TAKE(ptr, n) ((ptr) = p, p += (n))
  TAKE(m->x0, N * C);
  for (int l = 0; l < L; l++) {
    block_acts_t *a = &m->blk[l];
    TAKE(a->ln1, N * C);
    TAKE(a->ln1_mean, N);
    TAKE(a->ln1_rstd, N);
    TAKE(a->qkv, N * 3 * C);
    TAKE(a->att, (size_t)max_batch * NH * Tm * Tm);
    TAKE(a->atty, N * C);
    TAKE(a->res2, N * C);
    TAKE(a->ln2, N * C);
    TAKE(a->ln2_mean, N);
    TAKE(a->ln2_rstd, N);
    TAKE(a->fch, N * 4 * C);
    TAKE(a->fch_gelu, N * 4 * C);
    TAKE(a->res3, N * C);
  }
  TAKE(m->lnf, N * C);
  TAKE(m->lnf_mean, N);
  TAKE(m->lnf_rstd, N);
  TAKE(m->logits, N * V);
  TAKE(m->probs, N * V);
  TAKE(m->losses, N);
  TAKE(m->dres, N * C);
  TAKE(m->dtmp, N * C);
  TAKE(m->dbig, N * 4 * C);
  TAKE(m->dbig2, N * 4 * C);
  TAKE(m->dqkv, N * 3 * C);
  TAKE(m->datt, chorus__attention_scratch(Tm, C, NH));
  TAKE(m->dlogits, N * V);
#undef TAKE
  if ((size_t)(p - m->arena) > total) {
    chorus_gpt_destroy(m);
    return chorus__train_fail(CHORUS_ERR_INTERNAL, "chorus_gpt_create: activation arena overflow");
  }
  *out = m;
  return CHORUS_OK;
oom:
  chorus_gpt_destroy(m);
  return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_gpt_create: out of memory");
}

void chorus_gpt_destroy(chorus_gpt_t *m) {
  if (!m) return;
  free(m->params);
  free(m->grads);
  free(m->tensors);
  free(m->names);
  free(m->arena);
  free(m->blk);
  free(m->tokens);
  free(m->targets);
  free(m->skip);
  free(m->skipped);
  free(m->init);
  free(m->tunit);
  free(m->trel);
  free(m->units);
  free(m->upar);
  free(m->ugrd);
  free(m);
}

const chorus_gpt_config_t *chorus_gpt_config(const chorus_gpt_t *m) { return &m->cfg; }
size_t chorus_gpt_num_params(const chorus_gpt_t *m) { return m->nparams; }
float *chorus_gpt_params(chorus_gpt_t *m) { return m->params; }
float *chorus_gpt_grads(chorus_gpt_t *m) { return m->grads; }
int chorus_gpt_num_tensors(const chorus_gpt_t *m) { return m->ntensors; }
const chorus_gpt_tensor_t *chorus_gpt_tensor(const chorus_gpt_t *m, int i) {
  return i >= 0 && i < m->ntensors ? &m->tensors[i] : NULL;
}
const float *chorus_gpt_probs(const chorus_gpt_t *m) { return m->probs; }

chorus_result_t chorus_gpt_sample(chorus_gpt_t *m, const int *prompt, int len, int n,
                                  uint64_t seed, int *out) {
  const int T = m->cfg.ctx, V = m->cfg.vocab;
  if (!prompt || len < 1 || n < 0 || (n && !out))
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_gpt_sample: give a prompt of 1 token or more and room "
                              "for n >= 0 tokens");
  for (int i = 0; i < len; i++)
    if (prompt[i] < 0 || prompt[i] >= V)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "chorus_gpt_sample: prompt token %d is %d, outside the "
                                "vocabulary [0, %d)", i, prompt[i], V);
  int *ctx = malloc(sizeof(int) * (size_t)T);
  if (!ctx)
    return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "chorus_gpt_sample: no memory for %d tokens",
                              T);
  /* The context: the prompt's last T tokens, then a window that slides. */
  int have = len < T ? len : T;
  memcpy(ctx, prompt + (len - have), sizeof(int) * (size_t)have);
  uint64_t s = seed;
  chorus_result_t st = CHORUS_OK;
  for (int i = 0; i < n && st == CHORUS_OK; i++) {
    if ((st = chorus_gpt_forward(m, ctx, NULL, 1, have, NULL)) != CHORUS_OK) break;
    const float *p = m->probs + (size_t)(have - 1) * V;
    double r = (double)(rng_next(&s) >> 11) / 9007199254740992.0, acc = 0;
    int next = V - 1;
    for (int v = 0; v < V; v++) {
      acc += p[v];
      if (r < acc) {
        next = v;
        break;
      }
    }
    out[i] = next;
    if (have < T) {
      ctx[have++] = next;
    } else {
      memmove(ctx, ctx + 1, sizeof(int) * (size_t)(T - 1));
      ctx[T - 1] = next;
    }
  }
  free(ctx);
  return st;
}
void chorus_gpt_zero_grad(chorus_gpt_t *m) {
  if (m->grads) {
    memset(m->grads, 0, sizeof(float) * m->nparams);
    return;
  }
  for (int u = 0; u < m->nunits; u++)
    if (m->ugrd[u]) memset(m->ugrd[u], 0, sizeof(float) * m->units[u].size);
}

int chorus_gpt_num_units(const chorus_gpt_t *m) { return m->nunits; }
size_t chorus_gpt_activation_bytes(const chorus_gpt_t *m) {
  return m->arena_size * sizeof(float);
}
const chorus_gpt_unit_t *chorus_gpt_unit(const chorus_gpt_t *m, int u) {
  return u >= 0 && u < m->nunits ? &m->units[u] : NULL;
}

chorus_result_t chorus_gpt_bind_unit(chorus_gpt_t *m, int u, float *params, float *grads) {
  if (u < 0 || u >= m->nunits)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_gpt_bind_unit: no unit %d (the model has %d)", u, m->nunits);
  m->upar[u] = params ? params : m->params ? m->params + m->units[u].offset : NULL;
  m->ugrd[u] = grads ? grads : m->grads ? m->grads + m->units[u].offset : NULL;
  return CHORUS_OK;
}

void chorus_gpt_set_unit_hook(chorus_gpt_t *m, chorus_gpt_unit_fn fn, void *arg) {
  m->hook = fn;
  m->hook_arg = arg;
}

/* Tells the hook about unit u, then checks that what the unit's compute
 * needs is there: its parameters (and gradients in backward) and, for the
 * last unit, the embeddings' too (the head is tied to wte). */
static chorus_result_t unit_event(chorus_gpt_t *m, chorus_gpt_event_t ev, int u, int train) {
  if (m->hook) {
    chorus_result_t st = m->hook(m->hook_arg, ev, u, train);
    if (st != CHORUS_OK) return st;
  }
  if (ev != CHORUS_GPT_FORWARD_BEGIN && ev != CHORUS_GPT_BACKWARD_BEGIN) return CHORUS_OK;
  const int bwd = ev == CHORUS_GPT_BACKWARD_BEGIN;
  for (int k = 0; k < (u == m->nunits - 1 ? 2 : 1); k++) {
    int v = k ? 0 : u;
    if (!m->upar[v] || (bwd && !m->ugrd[v]))
      return chorus__train_fail(
          CHORUS_ERR_INVALID_ARG,
          "chorus_gpt: unit %d has no %s bound for its %s (a "
          "model made with CHORUS_GPT_EXTERNAL needs chorus_gpt_bind_unit, usually "
          "from a unit hook)",
          v, m->upar[v] ? "gradients" : "parameters", bwd ? "backward" : "forward");
  }
  return CHORUS_OK;
}
#define EVENT(ev, u)                                                             do {                                                                             chorus_result_t est_ = unit_event(m, (ev), (u), train);                        if (est_ != CHORUS_OK) return est_;                                          } while (0)

chorus_result_t chorus_gpt_skip_layer(chorus_gpt_t *m, int layer, int skip) {
  if (layer < 0 || layer >= m->cfg.layers)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_gpt_skip_layer: no block %d (the model has %d)", layer,
                              m->cfg.layers);
  m->skip[layer] = skip != 0;
  return CHORUS_OK;
}

/* -------------------------------------------------------------- forward */

chorus_result_t chorus_gpt_forward(chorus_gpt_t *m, const int *tokens, const int *targets, int B,
                                   int T, float *loss) {
  const int V = m->cfg.vocab, C = m->cfg.channels, L = m->cfg.layers, NH = m->cfg.heads;
  if (!tokens || B < 1 || B > m->max_batch || T < 1 || T > m->cfg.ctx)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_gpt_forward: batch %d x %d does not fit the "
                              "model (at most %d x %d) or tokens is NULL",
                              B, T, m->max_batch, m->cfg.ctx);
  const int N = B * T;
  for (int i = 0; i < N; i++) {
    if (tokens[i] < 0 || tokens[i] >= V)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "chorus_gpt_forward: token %d at %d is not in [0, %d)", tokens[i],
                                i, V);
    if (targets && targets[i] >= V)
      return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                                "chorus_gpt_forward: target %d at %d is not below %d", targets[i],
                                i, V);
  }
  m->B = B;
  m->T = T;
  memcpy(m->tokens, tokens, sizeof(int) * (size_t)N);
  m->have_targets = targets != NULL;
  if (targets) memcpy(m->targets, targets, sizeof(int) * (size_t)N);
  else
    for (int i = 0; i < N; i++) m->targets[i] = -1; /* probabilities only */

  const int train = targets != NULL, last = m->nunits - 1;
  EVENT(CHORUS_GPT_FORWARD_BEGIN, 0);
  chorus__encoder_fwd(m->x0, tokens, tpar(m, T_WTE), tpar(m, T_WPE), B, T, C);
  EVENT(CHORUS_GPT_FORWARD_END, 0);
  const float *x = m->x0;
  for (int l = 0; l < L; l++) {
    block_acts_t *a = &m->blk[l];
    m->skipped[l] = m->skip[l];
    /* A skipped block's unit is announced too: every rank must take part
     * in the same collectives, whatever it computes. */
    EVENT(CHORUS_GPT_FORWARD_BEGIN, 1 + l);
    if (m->skipped[l]) { /* identity: the stream passes through */
      memcpy(a->res3, x, sizeof(float) * (size_t)N * C);
      x = a->res3;
      EVENT(CHORUS_GPT_FORWARD_END, 1 + l);
      continue;
    }
    chorus__layernorm_fwd(a->ln1, a->ln1_mean, a->ln1_rstd, x, PAR(l, P_LN1W), PAR(l, P_LN1B), N,
                          C);
    chorus__linear_fwd(a->qkv, a->ln1, PAR(l, P_QKVW), PAR(l, P_QKVB), NULL, N, C, 3 * C);
    chorus__attention_fwd(a->atty, a->att, a->qkv, m->datt, B, T, C, NH);
    chorus__linear_fwd(a->res2, a->atty, PAR(l, P_PROJW), PAR(l, P_PROJB), x, N, C, C);
    chorus__layernorm_fwd(a->ln2, a->ln2_mean, a->ln2_rstd, a->res2, PAR(l, P_LN2W),
                          PAR(l, P_LN2B), N, C);
    chorus__linear_fwd(a->fch, a->ln2, PAR(l, P_FCW), PAR(l, P_FCB), NULL, N, C, 4 * C);
    chorus__gelu_fwd(a->fch_gelu, a->fch, (size_t)N * 4 * C);
    chorus__linear_fwd(a->res3, a->fch_gelu, PAR(l, P_FCPW), PAR(l, P_FCPB), a->res2, N, 4 * C,
                       C);
    x = a->res3;
    EVENT(CHORUS_GPT_FORWARD_END, 1 + l);
  }
  EVENT(CHORUS_GPT_FORWARD_BEGIN, last);
  chorus__layernorm_fwd(m->lnf, m->lnf_mean, m->lnf_rstd, x, tpar(m, T_LNFW), tpar(m, T_LNFB), N,
                        C);
  chorus__linear_fwd(m->logits, m->lnf, tpar(m, T_WTE), NULL, NULL, N, C, V);
  EVENT(CHORUS_GPT_FORWARD_END, last);
  float l = chorus__xent_fwd(m->probs, m->losses, m->logits, m->targets, N, V);
  if (loss) *loss = l;
  return CHORUS_OK;
}

/* ------------------------------------------------------------- backward */

static void ready(chorus_gpt_grad_ready_fn fn, void *arg, int tensor) {
  if (fn) fn(arg, tensor);
}

chorus_result_t chorus_gpt_backward(chorus_gpt_t *m, float loss_scale,
                                    chorus_gpt_grad_ready_fn fn, void *arg) {
  if (!m->have_targets)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "chorus_gpt_backward: the last forward had no targets");
  const int B = m->B, T = m->T, N = B * T;
  const int V = m->cfg.vocab, C = m->cfg.channels, L = m->cfg.layers, NH = m->cfg.heads;
  const size_t NC = (size_t)N * C;
  float *dres = m->dres; /* gradient of the residual stream */
  float *dtmp = m->dtmp;

  const int train = 1, last = m->nunits - 1;
  EVENT(CHORUS_GPT_BACKWARD_BEGIN, last);
  chorus__xent_bwd(m->dlogits, m->probs, m->targets, loss_scale, N, V);
  chorus__linear_bwd(dtmp, tgrd(m, T_WTE), NULL, m->dlogits, m->lnf, tpar(m, T_WTE), N, C, V);
  memset(dres, 0, sizeof(float) * NC);
  const float *xL = L ? m->blk[L - 1].res3 : m->x0;
  chorus__layernorm_bwd(dres, tgrd(m, T_LNFW), tgrd(m, T_LNFB), dtmp, xL, tpar(m, T_LNFW),
                        m->lnf_mean, m->lnf_rstd, N, C);
  ready(fn, arg, m->ntensors - 1);
  ready(fn, arg, m->ntensors - 2);
  EVENT(CHORUS_GPT_BACKWARD_END, last);

  for (int l = L - 1; l >= 0; l--) {
    block_acts_t *a = &m->blk[l];
    const float *xin = l ? m->blk[l - 1].res3 : m->x0;
    int base = 2 + l * P_PER_LAYER;
    EVENT(CHORUS_GPT_BACKWARD_BEGIN, 1 + l);
    if (m->skipped[l]) { /* unused: its gradients are final (untouched) now */
      for (int w = P_PER_LAYER - 1; w >= 0; w--) ready(fn, arg, base + w);
      EVENT(CHORUS_GPT_BACKWARD_END, 1 + l);
      continue;
    }
    /* MLP: res3 = res2 + proj(gelu(fc(ln2(res2)))); dres flows to res2
     * unchanged, plus through the branch. */
    float *dgelu = m->dbig;
    chorus__linear_bwd(dgelu, GRD(l, P_FCPW), GRD(l, P_FCPB), dres, a->fch_gelu, PAR(l, P_FCPW),
                       N, 4 * C, C);
    ready(fn, arg, base + P_FCPB);
    ready(fn, arg, base + P_FCPW);
    float *dfch = m->dbig2;
    chorus__gelu_bwd(dfch, a->fch, dgelu, NC * 4);
    chorus__linear_bwd(dtmp, GRD(l, P_FCW), GRD(l, P_FCB), dfch, a->ln2, PAR(l, P_FCW), N, C,
                       4 * C);
    ready(fn, arg, base + P_FCB);
    ready(fn, arg, base + P_FCW);
    chorus__layernorm_bwd(dres, GRD(l, P_LN2W), GRD(l, P_LN2B), dtmp, a->res2, PAR(l, P_LN2W),
                          a->ln2_mean, a->ln2_rstd, N, C);
    ready(fn, arg, base + P_LN2B);
    ready(fn, arg, base + P_LN2W);
    /* Attention: res2 = x + proj(attn(qkv(ln1(x)))). */
    chorus__linear_bwd(dtmp, GRD(l, P_PROJW), GRD(l, P_PROJB), dres, a->atty, PAR(l, P_PROJW), N,
                       C, C);
    ready(fn, arg, base + P_PROJB);
    ready(fn, arg, base + P_PROJW);
    chorus__attention_bwd(m->dqkv, dtmp, a->qkv, a->att, m->datt, B, T, C, NH);
    chorus__linear_bwd(dtmp, GRD(l, P_QKVW), GRD(l, P_QKVB), m->dqkv, a->ln1, PAR(l, P_QKVW), N,
                       C, 3 * C);
    ready(fn, arg, base + P_QKVB);
    ready(fn, arg, base + P_QKVW);
    chorus__layernorm_bwd(dres, GRD(l, P_LN1W), GRD(l, P_LN1B), dtmp, xin, PAR(l, P_LN1W),
                          a->ln1_mean, a->ln1_rstd, N, C);
    ready(fn, arg, base + P_LN1B);
    ready(fn, arg, base + P_LN1W);
    EVENT(CHORUS_GPT_BACKWARD_END, 1 + l);
  }
  EVENT(CHORUS_GPT_BACKWARD_BEGIN, 0);
  chorus__encoder_bwd(tgrd(m, T_WTE), tgrd(m, T_WPE), dres, m->tokens, B, T, C);
  ready(fn, arg, 1);
  ready(fn, arg, 0);
  EVENT(CHORUS_GPT_BACKWARD_END, 0);
  return CHORUS_OK;
}
