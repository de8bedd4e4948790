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
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chorus_train.h"
#include "train/layers.h"

static __thread char g_err[512];

const char *chorus_train_last_error(void) { return g_err; }

/* Records the reason of a failure for chorus_train_last_error (also used
 * by the other files of the runtime). */
chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
chorus_result_t chorus__train_fail(chorus_result_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_err, sizeof g_err, fmt, ap);
  va_end(ap);
  return st;
}
#define fail chorus__train_fail

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

struct chorus_gpt {
  chorus_gpt_config_t cfg;
  int max_batch;
  size_t nparams;
  float *params, *grads;
  int ntensors;
  chorus_gpt_tensor_t *tensors;
  char *names;
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
static void fill_normal(float *p, size_t n, float std, uint64_t *s) {
  for (size_t i = 0; i < n; i += 2) {
    /* Box-Muller: two normals per pair of uniforms. */
    double u1 = rng_uniform(s), u2 = rng_uniform(s);
    double r = sqrt(-2.0 * log(u1)), a = 6.283185307179586 * u2;
    p[i] = (float)(r * cos(a)) * std;
    if (i + 1 < n) p[i + 1] = (float)(r * sin(a)) * std;
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

static float *T_(chorus_gpt_t *m, float *base, int layer, int what) {
  return base + m->tensors[2 + layer * P_PER_LAYER + what].offset;
}
#define PAR(l, w) T_(m, m->params, (l), (w))
#define GRD(l, w) T_(m, m->grads, (l), (w))
#define WTE(base) ((base) + m->tensors[0].offset)
#define WPE(base) ((base) + m->tensors[1].offset)
#define LNFW(base) ((base) + m->tensors[m->ntensors - 2].offset)
#define LNFB(base) ((base) + m->tensors[m->ntensors - 1].offset)

chorus_result_t chorus_gpt_create(const chorus_gpt_config_t *cfg, int max_batch, uint64_t seed,
                                  chorus_gpt_t **out) {
  if (!out) return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_create: out is NULL");
  *out = NULL;
  if (!cfg || cfg->vocab < 2 || cfg->ctx < 1 || cfg->layers < 1 || cfg->heads < 1 ||
      cfg->channels < 1 || cfg->channels % cfg->heads || max_batch < 1)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_create: bad shape (vocab %d, ctx %d, layers "
                "%d, heads %d, channels %d, batch %d): channels must be a multiple of heads",
                cfg ? cfg->vocab : 0, cfg ? cfg->ctx : 0, cfg ? cfg->layers : 0,
                cfg ? cfg->heads : 0, cfg ? cfg->channels : 0, max_batch);
  chorus_gpt_t *m = calloc(1, sizeof *m);
  if (!m) return fail(CHORUS_ERR_NO_MEMORY, "chorus_gpt_create: out of memory");
  m->cfg = *cfg;
  m->max_batch = max_batch;
  const int V = cfg->vocab, C = cfg->channels, L = cfg->layers, Tm = cfg->ctx, NH = cfg->heads;
  m->ntensors = 2 + L * P_PER_LAYER + 2;
  m->tensors = calloc((size_t)m->ntensors, sizeof *m->tensors);
  m->names = calloc((size_t)m->ntensors, 32);
  if (!m->tensors || !m->names) goto oom;
  size_t off = 0;
  int k = 0;
#define ADD(nm, sz, ly)                                                          \
  do {                                                                         \
    char *slot = m->names + 32 * k;                                            \
    snprintf(slot, 32, "%s", nm);                                              \
    m->tensors[k] = (chorus_gpt_tensor_t){slot, off, (sz), (ly)};              \
    off += (sz);                                                               \
    k++;                                                                       \
  } while (0)
  ADD("wte", (size_t)V * C, -1);
  ADD("wpe", (size_t)Tm * C, -1);
  for (int l = 0; l < L; l++)
    for (int w = 0; w < P_PER_LAYER; w++) {
      char nm[32];
      snprintf(nm, sizeof nm, "h.%d.%s", l, k_block_names[w]);
      ADD(nm, block_size(w, C), l);
    }
  ADD("lnf.w", (size_t)C, -1);
  ADD("lnf.b", (size_t)C, -1);
#undef ADD
  m->nparams = off;
  m->params = malloc(sizeof(float) * off);
  m->grads = calloc(off, sizeof(float));
  if (!m->params || !m->grads) goto oom;

  /* Initialisation, tensor by tensor in layout order from one stream. */
  uint64_t s = seed;
  memset(m->params, 0, sizeof(float) * off);
  fill_normal(WTE(m->params), (size_t)V * C, 0.02f, &s);
  fill_normal(WPE(m->params), (size_t)Tm * C, 0.01f, &s);
  float proj_std = 0.02f / sqrtf(2.0f * (float)L);
  for (int l = 0; l < L; l++) {
    for (int i = 0; i < C; i++) PAR(l, P_LN1W)[i] = PAR(l, P_LN2W)[i] = 1.0f;
    fill_normal(PAR(l, P_QKVW), block_size(P_QKVW, C), 0.02f, &s);
    fill_normal(PAR(l, P_PROJW), block_size(P_PROJW, C), proj_std, &s);
    fill_normal(PAR(l, P_FCW), block_size(P_FCW, C), 0.02f, &s);
    fill_normal(PAR(l, P_FCPW), block_size(P_FCPW, C), proj_std, &s);
  }
  for (int i = 0; i < C; i++) LNFW(m->params)[i] = 1.0f;

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
    return fail(CHORUS_ERR_INTERNAL, "chorus_gpt_create: activation arena overflow");
  }
  *out = m;
  return CHORUS_OK;
oom:
  chorus_gpt_destroy(m);
  return fail(CHORUS_ERR_NO_MEMORY, "chorus_gpt_create: out of memory");
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
void chorus_gpt_zero_grad(chorus_gpt_t *m) { memset(m->grads, 0, sizeof(float) * m->nparams); }

chorus_result_t chorus_gpt_skip_layer(chorus_gpt_t *m, int layer, int skip) {
  if (layer < 0 || layer >= m->cfg.layers)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_skip_layer: no block %d (the model has %d)",
                layer, m->cfg.layers);
  m->skip[layer] = skip != 0;
  return CHORUS_OK;
}

/* -------------------------------------------------------------- forward */

chorus_result_t chorus_gpt_forward(chorus_gpt_t *m, const int *tokens, const int *targets, int B,
                                   int T, float *loss) {
  const int V = m->cfg.vocab, C = m->cfg.channels, L = m->cfg.layers, NH = m->cfg.heads;
  if (!tokens || B < 1 || B > m->max_batch || T < 1 || T > m->cfg.ctx)
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_forward: batch %d x %d does not fit the "
                "model (at most %d x %d) or tokens is NULL", B, T, m->max_batch, m->cfg.ctx);
  const int N = B * T;
  for (int i = 0; i < N; i++) {
    if (tokens[i] < 0 || tokens[i] >= V)
      return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_forward: token %d at %d is not in [0, %d)",
                  tokens[i], i, V);
    if (targets && targets[i] >= V)
      return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_forward: target %d at %d is not below %d",
                  targets[i], i, V);
  }
  m->B = B;
  m->T = T;
  memcpy(m->tokens, tokens, sizeof(int) * (size_t)N);
  m->have_targets = targets != NULL;
  if (targets) memcpy(m->targets, targets, sizeof(int) * (size_t)N);
  else
    for (int i = 0; i < N; i++) m->targets[i] = -1; /* probabilities only */

  chorus__encoder_fwd(m->x0, tokens, WTE(m->params), WPE(m->params), B, T, C);
  const float *x = m->x0;
  for (int l = 0; l < L; l++) {
    block_acts_t *a = &m->blk[l];
    m->skipped[l] = m->skip[l];
    if (m->skipped[l]) { /* identity: the stream passes through */
      memcpy(a->res3, x, sizeof(float) * (size_t)N * C);
      x = a->res3;
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
  }
  chorus__layernorm_fwd(m->lnf, m->lnf_mean, m->lnf_rstd, x, LNFW(m->params), LNFB(m->params), N,
                        C);
  chorus__linear_fwd(m->logits, m->lnf, WTE(m->params), NULL, NULL, N, C, V);
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
    return fail(CHORUS_ERR_INVALID_ARG, "chorus_gpt_backward: the last forward had no targets");
  const int B = m->B, T = m->T, N = B * T;
  const int V = m->cfg.vocab, C = m->cfg.channels, L = m->cfg.layers, NH = m->cfg.heads;
  const size_t NC = (size_t)N * C;
  float *dres = m->dres; /* gradient of the residual stream */
  float *dtmp = m->dtmp;

  chorus__xent_bwd(m->dlogits, m->probs, m->targets, loss_scale, N, V);
  chorus__linear_bwd(dtmp, WTE(m->grads), NULL, m->dlogits, m->lnf, WTE(m->params), N, C, V);
  memset(dres, 0, sizeof(float) * NC);
  const float *xL = L ? m->blk[L - 1].res3 : m->x0;
  chorus__layernorm_bwd(dres, LNFW(m->grads), LNFB(m->grads), dtmp, xL, LNFW(m->params),
                        m->lnf_mean, m->lnf_rstd, N, C);
  ready(fn, arg, m->ntensors - 1);
  ready(fn, arg, m->ntensors - 2);

  for (int l = L - 1; l >= 0; l--) {
    block_acts_t *a = &m->blk[l];
    const float *xin = l ? m->blk[l - 1].res3 : m->x0;
    int base = 2 + l * P_PER_LAYER;
    if (m->skipped[l]) { /* unused: its gradients are final (untouched) now */
      for (int w = P_PER_LAYER - 1; w >= 0; w--) ready(fn, arg, base + w);
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
  }
  chorus__encoder_bwd(WTE(m->grads), WPE(m->grads), dres, m->tokens, B, T, C);
  ready(fn, arg, 1);
  ready(fn, arg, 0);
  return CHORUS_OK;
}
