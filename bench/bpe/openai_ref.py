#!/usr/bin/python3
"""Tokens of a file by OpenAI's own GPT-2 encoder (encoder.py from the
gpt-2 repository, not shipped here: give its path), for bench/bpe/compare.sh.

    openai_ref.py ENCODER_PY DIR IN OUT

DIR holds GPT-2's encoder.json and vocab.bpe.  encoder.py works on text;
bytes of IN that are not UTF-8 become one lone surrogate each
(surrogateescape) and go back to their byte the same way, which is how
chorus's tokenizer and tests/train/bpe_ref.py define tokens of any byte
string.  Only the pre-split pattern, byte map, merge loop and vocabulary of
encoder.py's Encoder are used.  Tokens are written as little-endian uint32;
the time and speed go to stdout.
"""
import importlib.util
import json
import struct
import sys
import time

enc_py, vocab_dir, src, dst = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("gpt2_encoder", enc_py)
gpt2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt2)
with open(vocab_dir + "/encoder.json", encoding="utf-8") as f:
    vocab = json.load(f)
with open(vocab_dir + "/vocab.bpe", encoding="utf-8") as f:
    merges = [tuple(line.split()) for line in f.read().split("\n")[1:-1]]
coder = gpt2.Encoder(encoder=vocab, bpe_merges=merges)

with open(src, "rb") as f:
    data = f.read()
t0 = time.time()
out = []
for piece in gpt2.re.findall(coder.pat, data.decode("utf-8", "surrogateescape")):
    chars = "".join(coder.byte_encoder[b] for b in piece.encode("utf-8", "surrogateescape"))
    out.extend(coder.encoder[t] for t in coder.bpe(chars).split(" "))
t1 = time.time()
with open(dst, "wb") as f:
    f.write(struct.pack("<%dI" % len(out), *out))
print("%s: %d tokens, %.1f MB in %.1f s: %.2f MB/s"
      % (src, len(out), len(data) / 1e6, t1 - t0, len(data) / 1e6 / (t1 - t0)))
