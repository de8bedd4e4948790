#!/usr/bin/env bash
# The main job: builds chorus and trains the default GPT (4 layers, 4 heads,
# 128 channels, context 128, byte-level) on data/tinyshakespeare.txt with 2
# ranks through chorusrun, DDP, 1200 steps: about two minutes on a 2-core machine.
# Prints the loss and timings, validation loss every 200 steps, a sample of
# generated text, and leaves a checkpoint in runs/shakespeare (a second run
# resumes from it; delete the folder to start over).  Extra arguments go to
# chorus-train (e.g. --steps 100); NPROC sets the number of ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
exec build/chorusrun --standalone --nproc-per-node "${NPROC:-2}" -- build/chorus-train \
  --steps 1200 --val-every 200 --log-every 50 --sample 400 \
  --checkpoint-dir runs/shakespeare --checkpoint-every 400 "$@"
