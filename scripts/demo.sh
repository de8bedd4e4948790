#!/usr/bin/env bash
# The main job: builds chorus and runs the 4-rank demonstration through
# chorusrun (every collective, checked).  Until the training runtime exists
# this is what `README.md`'s first command runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" >/dev/null
exec build/chorusrun --standalone --nproc-per-node "${NPROC:-4}" -- build/examples/demo
