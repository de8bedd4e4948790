/*
 * bpe.h - internals of the tokenizer that its tests use: the pre-split of
 * bpe_scan.c.  What only the tokenizer's files share is bpe_internal.h.
 */
#ifndef CHORUS_TRAIN_BPE_H
#define CHORUS_TRAIN_BPE_H

#include <stddef.h>
#include <stdint.h>

/* The length in bytes of the piece of GPT-2's pre-split that starts at s
 * (s < end; the text is s..end).  Can't fail; at least 1. */
size_t chorus__bpe_piece_len(const uint8_t *s, const uint8_t *end);

#endif
