#!/usr/bin/env bash
# run_bench.sh - runs one chorus-bench command line and checks it.
#
# usage: run_bench.sh COMMAND...
#
# Runs COMMAND (chorusrun ... -- chorus-bench ...) and fails unless it exits
# 0 and its standard output has an "Avg bus bandwidth" line.  (CTest's
# PASS_REGULAR_EXPRESSION alone would ignore the exit status.)  Standard
# output and error are printed in full, for ctest's log.
set -u
if [ $# -lt 1 ]; then
  echo "usage: run_bench.sh COMMAND..." >&2
  exit 2
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

"$@" >"$tmp/out" 2>"$tmp/err"
rc=$?
echo "--- $*: exit $rc"
echo "--- stdout:"
cat "$tmp/out"
echo "--- stderr:"
cat "$tmp/err"

if [ "$rc" -ne 0 ]; then
  echo "FAIL: exit status $rc, expected 0"
  exit 1
fi
if ! grep -q "Avg bus bandwidth" "$tmp/out"; then
  echo "FAIL: no 'Avg bus bandwidth' line in the output"
  exit 1
fi
echo "PASS"
