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
echo "== configure and build (build/; the first build takes a few minutes)"
log=$(mktemp)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
rm -f "$log"
# A line per target built, with cmake's percentage; the log's end on failure.
set +e
cmake --build build -j"$(nproc)" 2>&1 | tee build/build.log | grep --line-buffered -E '^\[ *[0-9]+%\] Built target'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || { tail -n 40 build/build.log; echo "train.sh: the build failed (build/build.log)" >&2; exit 1; }
data=runs/data/shakespeare-bpe1024
if [ ! -e "$data/encoder.json" ]; then
  # Into a temporary folder, renamed when complete: an interrupted prepare
  # is never taken for a finished one.
  rm -rf "$data.tmp"
  mkdir -p "$(dirname "$data")"
  echo "== tokenizer and shards (once): $data"
  build/chorus-data prepare data/tinyshakespeare.txt -o "$data.tmp" --vocab-size 1024
  mv "$data.tmp" "$data"
fi
echo "== training: ${NPROC:-2} ranks through chorusrun (checkpoints in runs/shakespeare-bpe)"
exec build/chorusrun --standalone --nproc-per-node "${NPROC:-2}" -- build/chorus-train \
  --data "$data" --steps 800 --val-every 200 --log-every 50 --sample 200 \
  --checkpoint-dir runs/shakespeare-bpe --checkpoint-every 400 "$@"
