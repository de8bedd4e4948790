#!/usr/bin/env bash
# The main job: builds chorus, turns data/tinyshakespeare.txt into GPT-2
# style BPE tokens (chorus-data learns a vocabulary of 1024 on it and writes
# llm.c token shards to runs/data/shakespeare-bpe1024, once: later runs find
# them there), then trains the default GPT (4 layers, 4 heads, 128 channels,
# context 128) on the shards with 2 ranks through chorusrun, DDP, prefetching
# batches in a loader thread: about two minutes on a 2-core machine.
# Prints the loss and timings, validation loss every 200 steps, a sample of
# generated text decoded through the tokenizer, and leaves a checkpoint in
# runs/shakespeare-bpe (a second run resumes from it; delete the folder to
# start over).  Extra arguments go to chorus-train (e.g. --steps 100); NPROC
# sets the number of ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
data=runs/data/shakespeare-bpe1024
if [ ! -e "$data/encoder.json" ]; then
  # Into a temporary folder, renamed when complete: an interrupted prepare
  # is never taken for a finished one.
  rm -rf "$data.tmp"
  mkdir -p "$(dirname "$data")"
  build/chorus-data prepare data/tinyshakespeare.txt -o "$data.tmp" --vocab-size 1024
  mv "$data.tmp" "$data"
fi
exec build/chorusrun --standalone --nproc-per-node "${NPROC:-2}" -- build/chorus-train \
  --data "$data" --steps 800 --val-every 200 --log-every 50 --sample 200 \
  --checkpoint-dir runs/shakespeare-bpe --checkpoint-every 400 "$@"
