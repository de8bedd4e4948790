#!/usr/bin/env bash
# scripts/flaky.sh -- the flake hunter: runs tests again and again while the
# machine is busy, and names every test that failed at least once.
#
#   scripts/flaky.sh [-n N] [-d BUILD_DIR] [-j JOBS] [--no-load] [-- CTEST_ARGS...]
#
#   -n N         rounds (default 3)
#   -d DIR       the build to test (default build; configured and built by
#                scripts/test.sh or by hand)
#   -j JOBS      ctest's parallelism (default: the number of CPUs)
#   --no-load    no load beside the tests
#   CTEST_ARGS   which tests, as ctest takes them: -L faults, -R '^multi\.',
#                -LE cluster, ...  (default: every test of the build)
#
# The load, beside every round (unless --no-load):
#   - a CPU hog on every core (busy shell loops);
#   - another chorus job: chorusrun --standalone -n 2 running chorus-bench
#     over all collectives in a loop, with a job id of its own, so its
#     shared-memory names, ports and processes come and go while the tests
#     run -- a test that judges machine-wide state instead of its own fails.
# The sanitizer builds' environment (ASAN_OPTIONS, TSAN_OPTIONS, UCX's hooks)
# is set as scripts/test.sh sets it when DIR is build-asan or build-tsan.
#
# Output: each round's ctest log in $FLAKY_OUT (default build dir's
# flaky/ folder), then one line per test that failed, with how often and
# the log of its first failure.  Exit status 1 when any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=3 dir=build jobs=$(nproc) load=1
while (($#)); do
  case $1 in
    -n) rounds=$2; shift 2 ;;
    -d) dir=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    --no-load) load=0; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[[ -f $dir/CTestTestfile.cmake ]] || { echo "flaky.sh: $dir is not a configured build (run scripts/test.sh or cmake first)" >&2; exit 2; }
out=${FLAKY_OUT:-$dir/flaky}
rm -rf "$out" && mkdir -p "$out"

case $dir in
  *asan*) export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ;;
  *tsan*) export UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no
          export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ;;
esac

pids=()
stop_load() {
  local p
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
trap 'stop_load' EXIT
trap 'exit 130' INT TERM HUP

start_load() {
  local i
  for ((i = 0; i < $(nproc); i++)); do
    setsid bash -c 'while :; do :; done' &
    pids+=($!)
  done
  # The release build's tools run the other job (a sanitizer build's would
  # be slower, not different).
  local run=build/chorusrun bench=build/chorus-bench
  [[ -x $run && -x $bench ]] || { run=$dir/chorusrun bench=$dir/chorus-bench; }
  if [[ -x $run && -x $bench ]]; then
    setsid bash -c 'while :; do CHORUS_TIMEOUT=60 "$0" --standalone -n 2 -- "$1" --all -e 4M -n 5 -w 1 >/dev/null 2>&1; done' \
      "$run" "$bench" &
    pids+=($!)
  else
    echo "flaky.sh: no chorusrun/chorus-bench built: the load is the CPU hog only" >&2
  fi
}

declare -A fails=() first=() # initialised: set -u refuses ${#fails[@]} of a declared-only array
for ((r = 1; r <= rounds; r++)); do
  ((load)) && start_load
  log=$out/round$r.log
  t0=$SECONDS
  ctest --test-dir "$dir" --output-on-failure -j"$jobs" "$@" >"$log" 2>&1
  rc=$?
  ((load)) && stop_load
  # ctest's closing list: "The following tests FAILED:" then "  97 - name (Failed)".
  failed=$(awk '/^The following tests FAILED:/ {f = 1; next} f && /^[[:space:]]+[0-9]+ - / {print $3; next} f {f = 0}' "$log")
  n=0
  for t in $failed; do
    n=$((n + 1))
    fails[$t]=$(( ${fails[$t]:-0} + 1 ))
    [[ -n ${first[$t]:-} ]] || first[$t]=$log
  done
  echo "flaky.sh: round $r of $rounds: ctest exit $rc, $n failed, $((SECONDS - t0)) s ($log)"
  ((rc == 0 || n > 0)) || echo "flaky.sh: round $r: ctest failed without naming a test (see $log)"
  ((rc == 0 || n > 0)) || fails["(ctest itself)"]=$(( ${fails["(ctest itself)"]:-0} + 1 ))
done

if ((${#fails[@]} == 0)); then
  echo "flaky.sh: no test failed in $rounds rounds$( ((load)) && echo " under load")"
  exit 0
fi
echo "flaky.sh: tests that failed at least once in $rounds rounds:"
for t in "${!fails[@]}"; do
  echo "  $t: ${fails[$t]} of $rounds (first log: ${first[$t]:-see above})"
done
for t in "${!fails[@]}"; do
  [[ -n ${first[$t]:-} ]] || continue
  echo "---- $t (from ${first[$t]})"
  # The test's own output, as --output-on-failure printed it.
  awk -v t="$t" '$0 ~ ("Test +#[0-9]+: " t " ") {p = 1} p {print} p && /^ *Start / {exit}' "${first[$t]}" | tail -n 60
done
exit 1
