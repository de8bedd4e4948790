#!/usr/bin/python3
"""A reference for chorus's tokenizer (src/train/bpe.c): GPT-2's byte-level
BPE as GPT-2's encoder.py defines it, written out plainly in Python with
the `regex` module (Debian's python3-regex; run with /usr/bin/python3).

    bpe_ref.py encode DIR IN OUT    tokens of file IN with the vocabulary in
                                    DIR (encoder.json, vocab.bpe) to OUT
    bpe_ref.py pieces IN OUT        byte lengths of IN's pre-split pieces
    bpe_ref.py train VOCAB OUTDIR FILE...
                                    learns a vocabulary the slow, obvious
                                    way (every pair recounted each step):
                                    small inputs only
    bpe_ref.py bench DIR IN RUNS    encodes IN RUNS times (a new cache each
                                    time), prints MB/s per run and median

Tokens and piece lengths are written as little-endian uint32.  Input bytes
that are not UTF-8 are decoded with errors='surrogateescape' (each such byte
becomes one lone surrogate) and encoded back the same way, so every byte
string has tokens.

The semantics, for a piece's characters in GPT-2's byte alphabet: while
some adjacent pair is in the merge list, take the pair with the lowest
rank and merge each of its occurrences, scanning left to right, without
overlap.  Training: the most frequent adjacent pair over all pieces
(weighted by their counts) becomes the next merge; ties go to the smaller
(left id, right id); a pair whose concatenation is already a token, or
longer than MAX_TOKEN bytes, is never chosen.
"""
import json
import struct
import sys
import time

import regex

PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
EOT = "<|endoftext|>"
MAX_TOKEN = 1024


def alphabet():
    """byte -> character, and the bytes in GPT-2's id order."""
    printable = [b for b in range(256)
                 if ord("!") <= b <= ord("~") or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = [b for b in range(256) if b not in printable]
    char = {}
    for b in printable:
        char[b] = chr(b)
    for n, b in enumerate(others):
        char[b] = chr(256 + n)
    return char, printable + others


BYTE_CHAR, BYTE_ORDER = alphabet()


def pieces(data):
    text = data.decode("utf-8", "surrogateescape")
    return [p.encode("utf-8", "surrogateescape") for p in PATTERN.findall(text)]


class Vocab:
    def __init__(self, d):
        with open(d + "/encoder.json", encoding="utf-8") as f:
            self.ids = json.load(f)
        with open(d + "/vocab.bpe", encoding="utf-8") as f:
            lines = f.read().split("\n")
        # First line "#version", last one empty (the file ends with "\n").
        merges = [tuple(line.split(" ")) for line in lines[1:] if line]
        self.rank = {pair: r for r, pair in enumerate(merges)}
        self.cache = {}

    def bpe(self, piece):
        """The tokens (strings) of one piece (bytes)."""
        word = [BYTE_CHAR[b] for b in piece]
        while len(word) > 1:
            ranked = [(self.rank[p], p) for p in zip(word, word[1:]) if p in self.rank]
            if not ranked:
                break
            _, (first, second) = min(ranked)
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, data):
        out = []
        for piece in pieces(data):
            toks = self.cache.get(piece)
            if toks is None:
                toks = [self.ids[s] for s in self.bpe(piece)]
                self.cache[piece] = toks
            out.extend(toks)
        return out


def write_u32(path, values):
    with open(path, "wb") as f:
        f.write(struct.pack("<%dI" % len(values), *values))


def train(vocab, outdir, files):
    counts = {}
    for path in files:
        with open(path, "rb") as f:
            for p in pieces(f.read()):
                counts[p] = counts.get(p, 0) + 1
    tok_bytes = [bytes([b]) for b in BYTE_ORDER]
    byte_id = {b: i for i, b in enumerate(BYTE_ORDER)}
    known = set(tok_bytes)
    words = [([byte_id[b] for b in p], c) for p, c in counts.items() if len(p) >= 2]
    merges, banned = [], set()
    while len(merges) < vocab - 257:
        pair_count = {}
        for w, c in words:
            for p in zip(w, w[1:]):
                pair_count[p] = pair_count.get(p, 0) + c
        best = None
        for p, c in sorted(pair_count.items(), key=lambda kv: (-kv[1], kv[0])):
            if c <= 0 or p in banned:
                continue
            cat = tok_bytes[p[0]] + tok_bytes[p[1]]
            if cat in known or len(cat) > MAX_TOKEN:
                banned.add(p)
                continue
            best = p
            break
        if best is None:
            sys.exit("bpe_ref.py train: only %d merges" % len(merges))
        new = len(tok_bytes)
        tok_bytes.append(tok_bytes[best[0]] + tok_bytes[best[1]])
        known.add(tok_bytes[-1])
        merges.append(best)
        for k, (w, c) in enumerate(words):
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[k] = (out, c)

    def spell(b):
        return "".join(BYTE_CHAR[x] for x in b)
    enc = {spell(b): i for i, b in enumerate(tok_bytes)}
    enc[EOT] = len(tok_bytes)
    import os
    os.makedirs(outdir, exist_ok=True)
    with open(outdir + "/encoder.json", "w", encoding="ascii") as f:
        json.dump(enc, f)  # ensure_ascii, ", " and ": " as GPT-2's file
    with open(outdir + "/vocab.bpe", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(spell(tok_bytes[a]) + " " + spell(tok_bytes[b]) + "\n")


def main(argv):
    if len(argv) == 5 and argv[1] == "encode":
        with open(argv[3], "rb") as f:
            data = f.read()
        write_u32(argv[4], Vocab(argv[2]).encode(data))
    elif len(argv) == 4 and argv[1] == "pieces":
        with open(argv[2], "rb") as f:
            write_u32(argv[3], [len(p) for p in pieces(f.read())])
    elif len(argv) >= 5 and argv[1] == "train":
        train(int(argv[2]), argv[3], argv[4:])
    elif len(argv) == 5 and argv[1] == "bench":
        with open(argv[3], "rb") as f:
            data = f.read()
        rates = []
        for r in range(int(argv[4])):
            v = Vocab(argv[2])
            t0 = time.perf_counter()
            n = len(v.encode(data))
            dt = time.perf_counter() - t0
            rates.append(len(data) / 1e6 / dt)
            print("run %d: %.1f MB in %.3f s: %.2f MB/s (%d tokens)" %
                  (r, len(data) / 1e6, dt, rates[-1], n))
        rates.sort()
        print("median %.2f MB/s" % rates[len(rates) // 2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
