#!/usr/bin/env bash
# The whole test suite, as CI runs it (README's second command).  Every test
# runs at least once:
#   1. a release build with warnings as errors, and every CTest test, among
#      them those (label "cluster") against real launchers and services:
#      Open MPI, MPICH, Slurm, etcd, emulated hosts, and the Python package
#      and PyTorch backend (labels "python", "torch"; the extensions are
#      built once, by this build) -- only in this pass;
#   2. an ASan+UBSan build (LeakSanitizer included) and the tests labelled
#      "sanitize": the library's and the training runtime's own tests, each
#      scenario once (tests/CMakeLists.txt says which and why);
#   3. a TSan build and the same tests but the launcher's;
#   4. the fuzzers (fuzz/, clang + libFuzzer + ASan/UBSan, build dir
#      build-fuzz), each for CHORUS_FUZZ_SECONDS (default 16), two at a time
#      (scripts/fuzz.sh; a crash fails the script and names the reproducer).
# It prints how long each pass took.
#
#   scripts/test.sh           the above (CI)
#   scripts/test.sh --full    the release matrix: passes 2 and 3 run every
#                             test but the cluster ones, the fuzzers 120 s each
#
# Set CHORUS_SKIP_SANITIZERS=1 to skip passes 2 and 3, CHORUS_SKIP_FUZZ=1 to
# skip pass 4.
#
# Other jobs may run on the machine meanwhile (another clone's test.sh, a
# user's training): every test judges only what it made.  This run's
# processes that do not get a job id from chorusrun name their shared
# memory with the run's own (CHORUS_JOB_ID, exported below), and the final
# check looks for those names only.
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
for arg in "$@"; do
  case $arg in
    --full) full=1 ;;
    *) echo "test.sh: unknown option $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
t_start=$SECONDS
timings=()
mark() { timings+=("$(printf '%-26s %4d s' "$1" $((SECONDS - $2)))"); }

t0=$SECONDS
if [[ "${CHORUS_SKIP_FUZZ:-0}" == 1 ]]; then scripts/deps.sh --cluster --torch; else scripts/deps.sh --fuzz --cluster --torch; fi
mark "packages (deps.sh)" "$t0"
jobs=$(nproc)
CHORUS_JOB_ID=ct$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')
export CHORUS_JOB_ID

# PyTorch's c10d tests for Gloo, from Debian's source of the installed
# torch, into the build tree (python.torch.c10d_gloo; it skips, saying why,
# when they cannot be fetched).
scripts/torch_tests.sh build/torch-src ||
  echo "test.sh: PyTorch's c10d tests could not be fetched: python.torch.c10d_gloo will skip"

echo "== build (release, -Werror)"
t0=$SECONDS
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHORUS_WERROR=ON >/dev/null
cmake --build build -j"$jobs" >/dev/null
mark "release build" "$t0"
echo "== tests (release: every test)"
t0=$SECONDS
ctest --test-dir build --output-on-failure -j"$jobs"
mark "release tests" "$t0"

if [[ "${CHORUS_SKIP_SANITIZERS:-0}" != 1 ]]; then
  if ((full)); then select=(-LE cluster); else select=(-L sanitize); fi
  echo "== build (ASan + UBSan)"
  t0=$SECONDS
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug \
    -DCHORUS_SANITIZE=address -DCHORUS_WERROR=ON >/dev/null
  cmake --build build-asan -j"$jobs" >/dev/null
  mark "ASan + UBSan build" "$t0"
  echo "== tests (ASan + UBSan: ${select[*]})"
  t0=$SECONDS
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" "${select[@]}"
  mark "ASan + UBSan tests" "$t0"

  echo "== build (TSan)"
  t0=$SECONDS
  cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug \
    -DCHORUS_SANITIZE=thread -DCHORUS_WERROR=ON >/dev/null
  cmake --build build-tsan -j"$jobs" >/dev/null
  mark "TSan build" "$t0"
  # TSan looks for races between threads; the tests whose time goes to
  # bulk copies through one path (large point-to-point messages, the
  # 4 MiB collective matrices over single copy, small chunks, emulated
  # hosts) are ASan's, as TSan runs them 5-15 times slower; so are the
  # unit tests of code that starts no thread (wire formats, reductions,
  # patterns, crypto, host lists, the etcd client) and train.shard_equivalence, whose time
  # is the model's arithmetic over the library's threads (39 s under TSan;
  # train.async and the multi.* tests keep those threads under TSan), and
  # examples.train_elastic (the runtime's recovery starts no thread; 20 s
  # under TSan, ASan's pass runs it).  --full runs them under TSan too.
  tsan_skip='^launcher\.'
  ((full)) || tsan_skip='^(launcher\.|multi\.(p2p_(shm|tcp|streams|hosts|ucx)|colls_(big|shm_cma|shm_chunk16k|hosts_blocked))\.|unit\.test_(crypto|hostlist|kv_etcd|patterns|reduce|ucx_choice|wire)$|train\.shard_equivalence$|examples\.train_elastic$)'
  echo "== tests (TSan: ${select[*]}, not: $tsan_skip)"
  t0=$SECONDS
  # UCX's memory hooks (libucm patches mmap and friends when the UCX tests
  # load it) and TSan's interceptors cannot both own them: UCX runs without
  # its hooks here (they only serve RDMA registration caches).
  UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no \
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure -j"$jobs" -E "$tsan_skip" "${select[@]}"
  mark "TSan tests" "$t0"
fi

if [[ "${CHORUS_SKIP_FUZZ:-0}" == 1 ]]; then
  echo "fuzz: SKIPPED because CHORUS_SKIP_FUZZ=1"
else
  # Exit status 2: no clang/libFuzzer here; fuzz.sh printed "fuzz: SKIPPED
  # because ...".  Anything else non-zero is a finding or a broken build.
  t0=$SECONDS
  fuzz_rc=0
  fuzz_s=${CHORUS_FUZZ_SECONDS:-16}
  ((full)) && fuzz_s=${CHORUS_FUZZ_SECONDS:-120}
  CHORUS_FUZZ_PARALLEL="${CHORUS_FUZZ_PARALLEL:-2}" scripts/fuzz.sh "$fuzz_s" || fuzz_rc=$?
  if [[ "$fuzz_rc" != 0 && "$fuzz_rc" != 2 ]]; then
    echo "test.sh: the fuzzers failed (see above; artifacts in build-fuzz/artifacts/)" >&2
    exit 1
  fi
  mark "fuzzers (build and run)" "$t0"
fi
# Names this run's processes left in /dev/shm (chorusrun's jobs have ids of
# their own, and chorusrun removes their names; launcher.chorusrun checks it).
leftover=$(ls /dev/shm 2>/dev/null | grep "^chorus-$CHORUS_JOB_ID-" || true)
if [[ -n "$leftover" ]]; then
  echo "test.sh: /dev/shm segments left behind: $leftover" >&2
  exit 1
fi
echo "test.sh: time per pass:"
printf '  %s\n' "${timings[@]}"
printf '  %-26s %4d s\n' "all" $((SECONDS - t_start))
echo "test.sh: all passes green"
