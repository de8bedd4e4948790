#!/usr/bin/env bash
# The whole test suite, as CI runs it (README's second command):
#   1. a release build with warnings as errors, all CTest tests, among them
#      those (label "cluster") against real launchers and services: Open
#      MPI, MPICH, Slurm, etcd, emulated hosts, and the Python package and
#      PyTorch backend (labels "python", "torch"; the extensions are built
#      once, by this build) -- only in this pass;
#   2. an ASan+UBSan build (LeakSanitizer included), all tests again but the
#      cluster ones;
#   3. a TSan build, all tests but the launcher's and the cluster ones;
#   4. the fuzzers (fuzz/, clang + libFuzzer + ASan/UBSan, build dir
#      build-fuzz), each for CHORUS_FUZZ_SECONDS (default 30), two at a time
#      (scripts/fuzz.sh; a crash fails the script and names the reproducer).
# Set CHORUS_SKIP_SANITIZERS=1 to skip passes 2 and 3, CHORUS_SKIP_FUZZ=1 to
# skip pass 4.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${CHORUS_SKIP_FUZZ:-0}" == 1 ]]; then scripts/deps.sh --cluster --torch; else scripts/deps.sh --fuzz --cluster --torch; fi
jobs=$(nproc)

echo "== build (release, -Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHORUS_WERROR=ON >/dev/null
cmake --build build -j"$jobs" >/dev/null
echo "== tests (release)"
ctest --test-dir build --output-on-failure -j"$jobs"

if [[ "${CHORUS_SKIP_SANITIZERS:-0}" != 1 ]]; then
  echo "== build (ASan + UBSan)"
  CHORUS_TEST_TIMEOUT_MULTIPLIER=3 cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug \
    -DCHORUS_SANITIZE=address -DCHORUS_WERROR=ON >/dev/null
  cmake --build build-asan -j"$jobs" >/dev/null
  echo "== tests (ASan + UBSan)"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE cluster

  echo "== build (TSan)"
  CHORUS_TEST_TIMEOUT_MULTIPLIER=4 cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug \
    -DCHORUS_SANITIZE=thread -DCHORUS_WERROR=ON >/dev/null
  cmake --build build-tsan -j"$jobs" >/dev/null
  echo "== tests (TSan)"
  # UCX's memory hooks (libucm patches mmap and friends when the UCX tests
  # load it) and TSan's interceptors cannot both own them: UCX runs without
  # its hooks here (they only serve RDMA registration caches).
  UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_EVENTS=no \
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure -j"$jobs" -E '^launcher\.' -LE cluster
fi

if [[ "${CHORUS_SKIP_FUZZ:-0}" == 1 ]]; then
  echo "fuzz: SKIPPED because CHORUS_SKIP_FUZZ=1"
else
  # Exit status 2: no clang/libFuzzer here; fuzz.sh printed "fuzz: SKIPPED
  # because ...".  Anything else non-zero is a finding or a broken build.
  fuzz_rc=0
  CHORUS_FUZZ_PARALLEL="${CHORUS_FUZZ_PARALLEL:-2}" \
    scripts/fuzz.sh "${CHORUS_FUZZ_SECONDS:-30}" || fuzz_rc=$?
  if [[ "$fuzz_rc" != 0 && "$fuzz_rc" != 2 ]]; then
    echo "test.sh: the fuzzers failed (see above; artifacts in build-fuzz/artifacts/)" >&2
    exit 1
  fi
fi
leftover=$(ls /dev/shm 2>/dev/null | grep -i chorus || true)
if [[ -n "$leftover" ]]; then
  echo "test.sh: /dev/shm segments left behind: $leftover" >&2
  exit 1
fi
echo "test.sh: all passes green"
