# tests/lib.sh - what the shell tests share: their "ok" and "FAIL" lines,
# the count of failures, the summary that sets the exit status, and a
# private temporary folder that the EXIT trap cleans up.  A test sources it
# first thing: . "$(dirname "$0")/../lib.sh"  (tests/fixtures/hosts_test.sh
# sources it too; a second source changes nothing).
#   ok MSG...          prints "ok   MSG"
#   fail MSG...        prints "FAIL MSG", then, when the test defines
#                      fail_details, calls it with the same arguments (the
#                      logs worth seeing), and counts the failure in FAILS;
#                      the test goes on (follow it with `exit 1` where it
#                      cannot)
#   summary [PASSED [FAILED]]
#                      the test's last line: with no failure, prints PASSED
#                      (when given) and exits 0; else prints "$FAILS FAILED"
#                      (FAILED: "check(s) FAILED" unless given) and exits 1
#   tmp_dir NAME       TMP, a new folder ${TMPDIR:-/tmp}/chorus-NAME.XXXXXX,
#                      and the traps: at exit the commands given to on_exit
#                      run in that order, then TMP is removed (kept, and
#                      named on stderr, when KEEP_TMP is set); INT, TERM and
#                      HUP print "interrupted" and exit 1, through the same
#   on_exit COMMAND    one more command for the exit: a function of the test
#                      or a line of shell, run (eval) then; its failure does
#                      not stop the others
#   now_ms             milliseconds since the epoch
# Also sourced by scripts under `set -euo pipefail` (bench/algos_hosts, via
# hosts_test.sh): nothing here may fail there.
# shellcheck shell=bash
[[ -n ${CHORUS_TEST_LIB:-} ]] && return 0
CHORUS_TEST_LIB=1

FAILS=0
ok() { echo "ok   $*"; }
fail() {
  echo "FAIL $*"
  if declare -F fail_details >/dev/null; then fail_details "$@"; fi
  FAILS=$((FAILS + 1))
}

summary() {
  if ((FAILS == 0)); then
    if [[ -n ${1:-} ]]; then echo "$1"; fi
    exit 0
  fi
  echo "$FAILS ${2:-check(s) FAILED}"
  exit 1
}

ON_EXIT=()
on_exit() { ON_EXIT+=("$1"); }

tmp_dir() {
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/chorus-$1.XXXXXX") || exit 1
  TMP_OWNER=$BASHPID
  trap tmp_dir_exit EXIT
  trap 'echo "interrupted"; exit 1' INT TERM HUP
}

# Only the test's own shell cleans up: a subshell that inherited the EXIT
# trap (one CI run lost $TMP halfway through test_launcher.sh's signal
# cases) must not.
tmp_dir_exit() {
  local cmd
  [[ $BASHPID == "$TMP_OWNER" ]] || return 0
  for cmd in "${ON_EXIT[@]}"; do eval "$cmd" || true; done
  if [[ -n ${KEEP_TMP:-} ]]; then
    echo "KEEP_TMP: kept $TMP" >&2
  else
    rm -rf "$TMP" || true
  fi
}

now_ms() { date +%s%3N; }
