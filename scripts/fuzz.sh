#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/, build dir build-fuzz, clang with
# ASan + UBSan + libFuzzer) and runs each for a bounded time.
#
#   scripts/fuzz.sh SECONDS [HARNESS...]    e.g. scripts/fuzz.sh 30
#                                                scripts/fuzz.sh 600 fuzz_store
#
# Harnesses: fuzz_wire fuzz_tcp_recv fuzz_store fuzz_handshake fuzz_etcd_reply (all when none
# is named); fuzz/<harness>.options, if present, holds flags for one of them.  Each starts from a copy of its seed corpus fuzz/corpus/<harness>
# in a temporary directory (the checked-in corpus is never written), runs
# SECONDS seconds, and the script prints its executions and exec/s.  Crash,
# leak and timeout inputs go to build-fuzz/artifacts/<harness>/ and the
# script prints the command that reproduces them; any of them fails it.
#
# Release check (docs in fuzz/README.md): every harness 10 minutes, at least
# a million executions each, no crash:
#   CHORUS_FUZZ_MIN_EXECS=1000000 scripts/fuzz.sh 600
#
# Environment:
#   CHORUS_FUZZ_PARALLEL   harnesses run at once (default: nproc)
#   CHORUS_FUZZ_JOBS       build jobs (default: nproc)
#   CHORUS_FUZZ_MIN_EXECS  fail a harness that executed fewer inputs
#   CHORUS_FUZZ_ARGS       extra libFuzzer flags for every harness
#   CHORUS_FUZZ_CC         the compiler (default clang-14, else clang)
# Exit status: 0 all clean, 1 a harness failed (or the build did), 2 the
# fuzzers cannot be built here (no clang or no libFuzzer: the line
# "fuzz: SKIPPED because ..." says why).
set -euo pipefail
cd "$(dirname "$0")/.."

all=(fuzz_wire fuzz_tcp_recv fuzz_store fuzz_handshake fuzz_etcd_reply)
if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  echo "usage: scripts/fuzz.sh SECONDS [${all[*]}]" >&2
  exit 64
fi
seconds=$1
shift
harnesses=("$@")
((${#harnesses[@]})) || harnesses=("${all[@]}")
for h in "${harnesses[@]}"; do
  [[ " ${all[*]} " == *" $h "* ]] || { echo "fuzz: unknown harness '$h' (${all[*]})" >&2; exit 64; }
done
parallel=${CHORUS_FUZZ_PARALLEL:-$(nproc)}
jobs=${CHORUS_FUZZ_JOBS:-$(nproc)}
min_execs=${CHORUS_FUZZ_MIN_EXECS:-0}

# ------------------------------------------------- can this machine fuzz?
cc=${CHORUS_FUZZ_CC:-}
if [[ -z "$cc" ]]; then
  if command -v clang-14 >/dev/null 2>&1; then cc=clang-14; else cc=clang; fi
fi
if ! command -v "$cc" >/dev/null 2>&1; then
  echo "fuzz: SKIPPED because there is no clang ('$cc' not found; scripts/deps.sh --fuzz installs it)"
  exit 2
fi
probe=$(mktemp -d "${TMPDIR:-/tmp}/chorus-fuzz-probe.XXXXXX")
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' \
  >"$probe/p.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$probe/p.c" -o "$probe/p" >"$probe/log" 2>&1; then
  echo "fuzz: SKIPPED because $cc cannot link libFuzzer with ASan/UBSan (package libclang-rt-14-dev" \
    "missing?): $(head -c 300 "$probe/log" | tr '\n' ' ')"
  rm -rf "$probe"
  exit 2
fi
rm -rf "$probe"

# ---------------------------------------------------------------- build
echo "== fuzz: build (build-fuzz, $cc, ASan + UBSan + libFuzzer)"
t0=$(date +%s)
CC="$cc" cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g" -DCHORUS_FUZZ=ON -DBUILD_TESTING=OFF >/dev/null
cmake --build build-fuzz --target fuzzers -j"$jobs" >/dev/null
echo "fuzz: built in $(($(date +%s) - t0)) s"

# ------------------------------------------------------------------ run
work=$(mktemp -d "${TMPDIR:-/tmp}/chorus-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p build-fuzz/artifacts

run_one() {
  local h=$1 dir="$work/$1"
  mkdir -p "$dir/corpus" "build-fuzz/artifacts/$h"
  cp fuzz/corpus/"$h"/* "$dir/corpus/"
  local rc=0 opts=()
  # fuzz/<harness>.options: libFuzzer flags of that harness, one a line.
  if [[ -f "fuzz/$h.options" ]]; then
    mapfile -t opts < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "fuzz/$h.options")
  fi
  # -timeout: one input running this long is a hang (a report).
  ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    "build-fuzz/fuzz/$h" -max_total_time="$seconds" -max_len=65536 -timeout=60 \
    -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$h/" ${opts[@]+"${opts[@]}"} \
    ${CHORUS_FUZZ_ARGS:-} \
    "$dir/corpus" >"$dir/log" 2>&1 || rc=$?
  echo "$rc" >"$dir/rc"
}

echo "== fuzz: ${harnesses[*]}, ${seconds} s each, $parallel at a time"
t0=$(date +%s)
pids=()
for h in "${harnesses[@]}"; do
  while (($(jobs -rp | wc -l) >= parallel)); do wait -n || true; done
  run_one "$h" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || true; done

failed=0
printf '%-16s %12s %10s %8s  %s\n' harness executions exec/s corpus result
for h in "${harnesses[@]}"; do
  dir="$work/$h"
  rc=$(cat "$dir/rc" 2>/dev/null || echo 1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log" | tail -1)
  units=$(ls "$dir/corpus" | wc -l)
  result=ok
  if [[ "$rc" != 0 ]]; then
    result="FAILED (exit $rc)"
  elif ((${execs:-0} < min_execs)); then
    result="FAILED (fewer than $min_execs executions)"
  fi
  printf '%-16s %12s %10s %8s  %s\n' "$h" "${execs:-?}" "${rate:-?}" "$units" "$result"
  if [[ "$result" != ok ]]; then
    failed=1
    # The report: from its first line (sanitizer, libFuzzer or the
    # harness's own check), else the end of the log.
    first=$(grep -n -m1 -E '^==[0-9]+==(ERROR| ERROR)|runtime error:|requirement failed|: FATAL: ' \
      "$dir/log" | cut -d: -f1 || true)
    echo "---- fuzz: $h: its report" >&2
    if [[ -n "$first" ]]; then
      tail -n +"$first" "$dir/log" | grep -v -E '^stat::|^  0x|^Shadow|^  [A-Z][a-z].*:  ' | head -n 50 >&2
    else
      grep -v '^stat::' "$dir/log" | tail -n 50 >&2
    fi
    for a in $(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$dir/log"); do
      echo "fuzz: $h: reproduce with: build-fuzz/fuzz/$h $a" >&2
    done
  fi
done
echo "fuzz: ran in $(($(date +%s) - t0)) s"
exit "$failed"
