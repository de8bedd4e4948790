/*
 * loader.c - batches of a token dataset in DistributedSampler's order, read
 * ahead by worker threads (PyTorch's DataLoader with num_workers and
 * prefetch_factor).
 *
 * A ring of workers x prefetch slots.  The caller's thread owns the sampler:
 * each next() first tops the ring up (drawing the indices of batch i + 1,
 * i + 2, ... in order, and recording where the sampler stands after each),
 * then waits for batch i.  Workers take the oldest batch not yet read,
 * copy its sequences out of the mapped shards and mark it ready; batches
 * come out in sampler order whatever order the workers finish in.  The
 * position the loader reports (for checkpoints) is that of the batches
 * handed out, not of those read ahead, so a resume neither skips nor
 * repeats a batch that was prefetched but never used.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chorus_train.h"
#include "train/runtime.h"

enum { SLOT_FREE, SLOT_QUEUED, SLOT_BUSY, SLOT_READY, SLOT_FAILED };

typedef struct {
  int state;
  size_t *idx;
  int *tok, *tgt;
  long epoch; /* the sampler after this batch */
  size_t taken;
  chorus_result_t st;
  char err[512]; /* the library's messages are up to 512 bytes: the offset comes last */
} slot_t;

struct chorus_loader {
  const chorus_tokens_t *data;
  chorus_loader_config_t cfg;
  size_t nseq;
  int world, rank;
  chorus_sampler_t *sp;
  long epoch; /* of the batches handed out */
  size_t taken;
  /* The ring: batches head .. tail - 1 are scheduled. */
  slot_t *slots;
  int nslots;
  unsigned long head, tail;
  pthread_mutex_t mu;
  pthread_cond_t work, done;
  pthread_t *threads;
  int nthreads, stop, busy;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A deadline s seconds from now on clock.  The loader's waits use the
 * monotonic clock (its condition variable is set to it), so a step of the
 * wall clock neither fires nor holds them. */
static struct timespec deadline_on(clockid_t clock, double s) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + s;
  ts.tv_sec = (time_t)t;
  ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  return ts;
}

static struct timespec deadline_in(double s) { return deadline_on(CLOCK_MONOTONIC, s); }

static void sleep_s(double s) {
  if (s <= 0) return;
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Reads slot's batch (no lock held).  The delay option stands in for slow
 * storage: the read takes at least that long. */
static void read_slot(chorus_loader_t *l, slot_t *s) {
  double t0 = now_s();
  s->st = chorus_tokens_read(l->data, l->cfg.seq, s->idx, l->cfg.batch, s->tok, s->tgt);
  if (s->st != CHORUS_OK) snprintf(s->err, sizeof s->err, "%s", chorus_train_last_error());
  sleep_s(l->cfg.read_delay_s - (now_s() - t0));
}

static void *worker(void *arg) {
  chorus_loader_t *l = arg;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    slot_t *s = NULL;
    for (unsigned long i = l->head; i < l->tail && !s; i++)
      if (l->slots[i % (unsigned long)l->nslots].state == SLOT_QUEUED)
        s = &l->slots[i % (unsigned long)l->nslots];
    if (l->stop) break;
    if (!s) {
      pthread_cond_wait(&l->work, &l->mu);
      continue;
    }
    s->state = SLOT_BUSY;
    l->busy++;
    pthread_mutex_unlock(&l->mu);
    read_slot(l, s);
    pthread_mutex_lock(&l->mu);
    s->state = s->st == CHORUS_OK ? SLOT_READY : SLOT_FAILED;
    l->busy--;
    pthread_cond_broadcast(&l->done);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* Draws the next batch's indices into slot s.  Caller holds the lock (or
 * there are no workers). */
static chorus_result_t schedule(chorus_loader_t *l, slot_t *s) {
  for (int b = 0; b < l->cfg.batch; b++) {
    chorus_result_t st = chorus_sampler_next(l->sp, &s->idx[b]);
    if (st != CHORUS_OK) return chorus__train_fail(st, "the sampler: out of memory");
  }
  s->epoch = chorus_sampler_epoch(l->sp);
  s->taken = chorus_sampler_taken(l->sp);
  s->state = SLOT_QUEUED;
  return CHORUS_OK;
}

chorus_result_t chorus_loader_create(const chorus_tokens_t *data,
                                     const chorus_loader_config_t *cfg, int world, int rank,
                                     chorus_loader_t **out) {
  *out = NULL;
  if (!data || !cfg || cfg->seq < 1 || cfg->batch < 1 || cfg->workers < 0 ||
      cfg->workers > 64 || cfg->prefetch < 1 || cfg->prefetch > 64 || world < 1 || rank < 0 ||
      rank >= world)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "loader: bad arguments (seq %d, batch %d, workers %d, "
                              "prefetch %d)",
                              cfg ? cfg->seq : 0, cfg ? cfg->batch : 0, cfg ? cfg->workers : 0,
                              cfg ? cfg->prefetch : 0);
  size_t nseq = chorus_tokens_samples(data, cfg->seq);
  if (nseq < (size_t)world)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "the dataset has %zu sequences of %d tokens (%zu "
                              "tokens in all; a sequence takes %d), fewer than the %d ranks%s",
                              nseq, cfg->seq, chorus_tokens_count(data), cfg->seq + 1, world,
                              nseq ? "" : ": it is empty, or too short for one sequence");
  if (nseq > UINT32_MAX)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "the dataset has %zu sequences of %d tokens; the "
                              "sampler takes fewer than 2^32 (a longer context, or fewer shards)",
                              nseq, cfg->seq);
  chorus_loader_t *l = calloc(1, sizeof *l);
  if (!l) return chorus__train_fail(CHORUS_ERR_NO_MEMORY, "out of memory");
  l->data = data, l->cfg = *cfg, l->nseq = nseq, l->world = world, l->rank = rank;
  if (!(l->cfg.read_timeout_s > 0)) {
    const char *e = getenv("CHORUS_TIMEOUT");
    double v = e ? strtod(e, NULL) : 0;
    l->cfg.read_timeout_s = v > 0 ? v : 300;
  }
  if (l->cfg.read_timeout_s > 1e8) l->cfg.read_timeout_s = 1e8; /* about 3 years: a time_t */
  l->nslots = cfg->workers ? cfg->workers * cfg->prefetch : 1;
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->work, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&l->done, &ca);
  pthread_condattr_destroy(&ca);
  l->slots = calloc((size_t)l->nslots, sizeof *l->slots);
  chorus_result_t st = l->slots ? CHORUS_OK : CHORUS_ERR_NO_MEMORY;
  const size_t bt = (size_t)cfg->batch * (size_t)cfg->seq;
  for (int i = 0; st == CHORUS_OK && i < l->nslots; i++) {
    slot_t *s = &l->slots[i];
    s->idx = malloc(sizeof(size_t) * (size_t)cfg->batch);
    s->tok = malloc(sizeof(int) * bt);
    s->tgt = malloc(sizeof(int) * bt);
    if (!s->idx || !s->tok || !s->tgt) st = CHORUS_ERR_NO_MEMORY;
  }
  if (st == CHORUS_OK &&
      chorus_sampler_create(nseq, world, rank, cfg->shuffle, cfg->seed, cfg->drop_last,
                            &l->sp) != CHORUS_OK)
    st = CHORUS_ERR_NO_MEMORY;
  if (st == CHORUS_OK && cfg->workers) {
    l->threads = calloc((size_t)cfg->workers, sizeof(pthread_t));
    if (!l->threads) st = CHORUS_ERR_NO_MEMORY;
    for (int i = 0; st == CHORUS_OK && i < cfg->workers; i++) {
      if (pthread_create(&l->threads[i], NULL, worker, l) != 0) st = CHORUS_ERR_SYSTEM;
      else l->nthreads++;
    }
  }
  if (st != CHORUS_OK) {
    chorus_loader_destroy(l);
    return chorus__train_fail(
        st, "loader: %s", st == CHORUS_ERR_SYSTEM ? "cannot start its threads" : "out of memory");
  }
  *out = l;
  return CHORUS_OK;
}

void chorus_loader_destroy(chorus_loader_t *l) {
  if (!l) return;
  pthread_mutex_lock(&l->mu);
  l->stop = 1;
  pthread_cond_broadcast(&l->work);
  pthread_mutex_unlock(&l->mu);
  /* A worker stuck in a read (see next()) is waited for once more as long;
   * after that its slot may still be written, so nothing is freed. */
  int stuck = 0;
  for (int i = 0; i < l->nthreads; i++) {
    /* pthread_timedjoin_np (the wall clock): ThreadSanitizer knows it for
     * a join, not pthread_clockjoin_np. */
    struct timespec until = deadline_on(CLOCK_REALTIME, l->cfg.read_timeout_s);
    if (stuck || pthread_timedjoin_np(l->threads[i], NULL, &until) != 0) {
      pthread_detach(l->threads[i]);
      stuck = 1;
    }
  }
  if (stuck) return;
  free(l->threads);
  for (int i = 0; l->slots && i < l->nslots; i++) {
    free(l->slots[i].idx);
    free(l->slots[i].tok);
    free(l->slots[i].tgt);
  }
  free(l->slots);
  chorus_sampler_destroy(l->sp);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->work);
  pthread_cond_destroy(&l->done);
  free(l);
}

chorus_result_t chorus_loader_next(chorus_loader_t *l, int *tokens, int *targets, size_t *idx,
                                   double *wait_s) {
  const double t0 = now_s();
  const size_t bt = (size_t)l->cfg.batch * (size_t)l->cfg.seq;
  chorus_result_t st = CHORUS_OK;
  pthread_mutex_lock(&l->mu);
  while (st == CHORUS_OK && l->tail - l->head < (unsigned long)l->nslots) {
    st = schedule(l, &l->slots[l->tail % (unsigned long)l->nslots]);
    if (st == CHORUS_OK) l->tail++;
  }
  if (st != CHORUS_OK && l->tail == l->head) {
    pthread_mutex_unlock(&l->mu);
    return st;
  }
  slot_t *s = &l->slots[l->head % (unsigned long)l->nslots];
  if (l->nthreads) {
    pthread_cond_broadcast(&l->work);
    struct timespec until = deadline_in(l->cfg.read_timeout_s);
    while (s->state != SLOT_READY && s->state != SLOT_FAILED)
      if (pthread_cond_timedwait(&l->done, &l->mu, &until) == ETIMEDOUT &&
          s->state != SLOT_READY && s->state != SLOT_FAILED) {
        st = chorus__train_fail(
            CHORUS_ERR_TIMEOUT,
            "the batch of sequences %zu, ... (tokens from %zu on) "
            "was not read within %.0f s (%s): is the storage stalled? (a slower disk: "
            "raise CHORUS_TIMEOUT)",
            s->idx[0], s->idx[0] * (size_t)l->cfg.seq, l->cfg.read_timeout_s,
            s->state == SLOT_BUSY ? "a worker is still in the read" : "no worker took it");
        pthread_mutex_unlock(&l->mu);
        return st;
      }
  } else {
    pthread_mutex_unlock(&l->mu);
    read_slot(l, s);
    pthread_mutex_lock(&l->mu);
    s->state = s->st == CHORUS_OK ? SLOT_READY : SLOT_FAILED;
  }
  if (s->state == SLOT_FAILED) {
    /* It stays failed: the same error again on the next call. */
    st = chorus__train_fail(s->st, "%s", s->err);
    pthread_mutex_unlock(&l->mu);
    return st;
  }
  memcpy(tokens, s->tok, sizeof(int) * bt);
  memcpy(targets, s->tgt, sizeof(int) * bt);
  if (idx) memcpy(idx, s->idx, sizeof(size_t) * (size_t)l->cfg.batch);
  l->epoch = s->epoch, l->taken = s->taken;
  s->state = SLOT_FREE;
  l->head++;
  /* Refill at once, so the workers read ahead while the caller computes. */
  if (schedule(l, &l->slots[l->tail % (unsigned long)l->nslots]) == CHORUS_OK) l->tail++;
  if (l->nthreads) pthread_cond_broadcast(&l->work);
  pthread_mutex_unlock(&l->mu);
  if (wait_s) *wait_s = now_s() - t0;
  return CHORUS_OK;
}

/* Drops what was read ahead (waiting for reads under way) and puts the
 * sampler at (epoch, taken) over world/rank.  Caller holds the lock. */
static chorus_result_t reposition(chorus_loader_t *l, long epoch, size_t taken, int world,
                                  int rank) {
  /* Batches not yet started are dropped first, so a worker finishing its
   * read does not go on to the next one: only the reads under way are
   * waited for, not the whole ring. */
  for (int i = 0; i < l->nslots; i++)
    if (l->slots[i].state == SLOT_QUEUED) l->slots[i].state = SLOT_FREE;
  struct timespec until = deadline_in(l->cfg.read_timeout_s);
  while (l->busy)
    if (pthread_cond_timedwait(&l->done, &l->mu, &until) == ETIMEDOUT && l->busy)
      return chorus__train_fail(CHORUS_ERR_TIMEOUT,
                                "a read under way did not end within %.0f s (is the "
                                "storage stalled?): the loader cannot move",
                                l->cfg.read_timeout_s);
  for (int i = 0; i < l->nslots; i++) l->slots[i].state = SLOT_FREE;
  l->head = l->tail = 0;
  chorus_result_t st = CHORUS_OK;
  if (world != l->world || rank != l->rank) {
    chorus_sampler_t *sp;
    st = chorus_sampler_create(l->nseq, world, rank, l->cfg.shuffle, l->cfg.seed,
                               l->cfg.drop_last, &sp);
    if (st != CHORUS_OK)
      return chorus__train_fail(
          st, "the sampler over %d ranks: %s", world,
          st == CHORUS_ERR_NO_MEMORY ? "out of memory" : "fewer sequences than ranks");
    chorus_sampler_destroy(l->sp);
    l->sp = sp, l->world = world, l->rank = rank;
  }
  if ((st = chorus_sampler_seek(l->sp, epoch, taken)) != CHORUS_OK)
    return chorus__train_fail(st, "the sampler: out of memory");
  l->epoch = epoch;
  l->taken = chorus_sampler_taken(l->sp);
  return CHORUS_OK;
}

chorus_result_t chorus_loader_seek(chorus_loader_t *l, long epoch, size_t taken) {
  if (epoch < 0) return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "loader: epoch %ld", epoch);
  pthread_mutex_lock(&l->mu);
  chorus_result_t st = reposition(l, epoch, taken, l->world, l->rank);
  pthread_mutex_unlock(&l->mu);
  return st;
}

chorus_result_t chorus_loader_reshard(chorus_loader_t *l, int world, int rank) {
  if (world < 1 || rank < 0 || rank >= world)
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG, "loader: rank %d of %d", rank, world);
  pthread_mutex_lock(&l->mu);
  chorus_result_t st = reposition(l, l->epoch, l->taken, world, rank);
  pthread_mutex_unlock(&l->mu);
  return st;
}

long chorus_loader_epoch(const chorus_loader_t *l) { return l->epoch; }
size_t chorus_loader_taken(const chorus_loader_t *l) { return l->taken; }
size_t chorus_loader_len(const chorus_loader_t *l) { return chorus_sampler_len(l->sp); }
size_t chorus_loader_sequences(const chorus_loader_t *l) { return l->nseq; }

uint64_t chorus__loader_seed(const chorus_loader_t *l) { return l->cfg.seed; }
