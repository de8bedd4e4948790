#!/usr/bin/env bash
# scale_hb.sh - the heartbeat table of docs/launcher.md: chorus-scale-hb
# (bench/scale_hb.c) at H = 4, 100, 1,000 and 10,000 agents against a chorus
# store in its own process, and, given an etcd endpoint, against that etcd
# at the sizes it takes on this machine.
#
#   bash bench/launcher/scale_hb.sh BUILD_DIR [ETCD_HOST:PORT]
set -euo pipefail
build=${1:?usage: scale_hb.sh BUILD_DIR [ETCD_HOST:PORT]}
etcd=${2:-}
bin=$build/bench/chorus-scale-hb
for h in 4 100 1000 10000; do
  t=$((h < 4 ? h : 4))
  "$bin" -n "$h" -t "$t" --measure 5 || echo "H=$h store: failed (exit $?)"
done
if [ -n "$etcd" ]; then
  # etcd's calls wait on its disk and raft: more threads keep more in flight.
  for h in 4 100 300 1000; do
    "$bin" -n "$h" -t 16 --measure 5 --etcd "$etcd" || echo "H=$h etcd: failed (exit $?)"
  done
fi
