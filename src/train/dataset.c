/*
 * dataset.c - a run's data with its vocabulary: the training and
 * validation splits and the tokenizer that goes with them, decided the
 * one way chorus-train and a user's loop share.
 */
#include <stdio.h>
#include <string.h>

#include "chorus.h"
#include "chorus_train.h"
#include "train/runtime.h"

void chorus_dataset_close(chorus_dataset_t *d) {
  if (!d) return;
  chorus_tokens_close(d->train);
  chorus_tokens_close(d->val);
  chorus_bpe_free(d->bpe);
  d->train = d->val = NULL;
  d->bpe = NULL;
}

/* The tokenizer: the one named, or the shards' own (chorus-data prepare
 * leaves it beside them); none for text.  Fills d->tokenizer and d->bpe. */
static chorus_result_t open_tokenizer(const char *spec, const char *tokenizer, int text,
                                      chorus_dataset_t *d) {
  const char *dir = tokenizer;
  if (!dir && !text) dir = chorus_tokens_tokenizer_dir(spec, d->tokenizer, sizeof d->tokenizer);
  if (!dir) return CHORUS_OK;
  if (dir != d->tokenizer) snprintf(d->tokenizer, sizeof d->tokenizer, "%s", dir);
  char err[512];
  chorus_result_t st = chorus_bpe_load(d->tokenizer, &d->bpe, err, sizeof err);
  return st == CHORUS_OK ? st : chorus__train_fail(st, "the tokenizer: %s", err);
}

chorus_result_t chorus_dataset_open(const char *spec, const char *val_spec, int format,
                                    int vocab, const char *tokenizer, chorus_dataset_t *out) {
  memset(out, 0, sizeof *out);
  /* What the data is first (text or tokens), then its vocabulary. */
  chorus_tokens_t *probe = NULL;
  chorus_result_t st = chorus_tokens_open(spec, CHORUS_SPLIT_TRAIN, format, 1 << 30, &probe);
  if (st != CHORUS_OK) return st;
  const int text = chorus_tokens_is_text(probe);
  chorus_tokens_close(probe);
  if ((st = open_tokenizer(spec, tokenizer, text, out)) != CHORUS_OK) return st;
  const int own = out->bpe ? chorus_bpe_vocab(out->bpe) : 0;
  out->vocab = vocab ? vocab : own ? own : text ? 256 : 50257;
  if (out->vocab < own) {
    chorus_dataset_close(out);
    return chorus__train_fail(CHORUS_ERR_INVALID_ARG,
                              "the vocabulary (--vocab %d) is smaller than the tokenizer's %d "
                              "tokens (%s)", vocab, own, out->tokenizer);
  }
  st = chorus_tokens_open(spec, CHORUS_SPLIT_TRAIN, format, out->vocab, &out->train);
  if (st == CHORUS_OK)
    st = chorus_tokens_open(val_spec ? val_spec : spec, CHORUS_SPLIT_VAL, format, out->vocab,
                            &out->val);
  if (st != CHORUS_OK) chorus_dataset_close(out);
  return st;
}
