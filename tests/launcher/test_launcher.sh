#!/usr/bin/env bash
# test_launcher.sh CHORUSRUN LAUNCH_WORKER - end-to-end tests of chorusrun.
#
# Each case runs chorusrun (bounded by `timeout`) on launch_worker and checks
# its exit status, stdout and stderr with grep.  After every case no process
# of this run may be left: the worker is copied into a private temporary
# directory, so `pgrep -f $TMP/` finds exactly the processes this script
# started (chorusrun, its guard, the workers and their children, which all
# carry that path on their command line).  The EXIT trap kills whatever is
# left and removes the directory, also when a case fails or the script is
# interrupted.  Prints "ok"/"FAIL" per check and exits non-zero on failure.
set -u
. "$(dirname "$0")/../lib.sh"

if [ $# -ne 2 ]; then
  echo "usage: $0 CHORUSRUN LAUNCH_WORKER" >&2
  exit 2
fi
CHORUSRUN=$1
tmp_dir launcher
WORKER="$TMP/launch_worker"
cp "$2" "$WORKER" || exit 1
OUT="$TMP/out"
ERR="$TMP/err"
BG=""

ours() { pgrep -f "$TMP/"; }

cleanup() {
  local pids
  [ -n "$BG" ] && kill -KILL "$BG" 2>/dev/null
  pids=$(ours)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
}
on_exit cleanup

fail_details() {
  echo "---- stdout (first 20 lines):"; head -n 20 "$OUT" 2>/dev/null | cut -c1-200
  echo "---- stderr (first 20 lines):"; head -n 20 "$ERR" 2>/dev/null | cut -c1-200
  # What the agent itself said, among the workers' lines: every line of
  # stderr that no rank's prefix starts.
  echo "---- stderr lines without a rank prefix (first 20):"
  grep -v '^\[rank[0-9]*\]:' "$ERR" 2>/dev/null | head -n 20 | cut -c1-300
  echo "----"
}
check() { # check DESCRIPTION command...
  local what=$1
  shift
  if "$@"; then ok "$what"; else fail "$what"; fi
}

# Runs chorusrun in the foreground; sets RC and ELAPSED_MS.
run() {
  local t0
  t0=$(now_ms)
  timeout -s KILL 60 "$CHORUSRUN" "$@" >"$OUT" 2>"$ERR"
  RC=$?
  ELAPSED_MS=$(($(now_ms) - t0))
}

# Starts chorusrun in the background (BG = its pid).
start_bg() {
  "$CHORUSRUN" "$@" >"$OUT" 2>"$ERR" &
  BG=$!
}

# Waits (at most 10 s) until stdout has N lines matching PATTERN.
wait_lines() {
  local n=$1 pat=$2 i
  for i in $(seq 100); do
    [ "$(grep -c -- "$pat" "$OUT")" -ge "$n" ] && return 0
    sleep 0.1
  done
  return 1
}

# Waits for the background chorusrun (at most 20 s); sets RC.
wait_bg() {
  local i
  for i in $(seq 200); do
    kill -0 "$BG" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$BG" 2>/dev/null; then
    kill -KILL "$BG"
    wait "$BG" 2>/dev/null
    RC=999
  else
    wait "$BG" 2>/dev/null
    RC=$?
  fi
  BG=""
}

# No process of ours may survive a case (a SIGKILLed one may take a moment).
no_leftovers() {
  local i left
  for i in $(seq 50); do
    left=$(ours)
    [ -z "$left" ] && { ok "$1: no leftover processes"; return 0; }
    sleep 0.1
  done
  fail "$1: leftover processes: $(ps -o pid=,args= -p "$(echo $left | tr ' ' ,)" | cut -c1-150)"
  kill -KILL $left 2>/dev/null
}

rc_is() { [ "$RC" -eq "$1" ]; }
has() { grep -q -- "$2" "$1"; }
hasx() { grep -qx -- "$2" "$1"; }
not_has() { ! grep -q -- "$2" "$1"; }
SLACK=${CHORUS_TEST_SLACK:-1} # the slow builds' multiplier (whole numbers)
SLACK=${SLACK%%.*}
faster_than() { [ "$ELAPSED_MS" -lt $(($1 * SLACK)) ]; }
slower_than() { [ "$ELAPSED_MS" -ge "$1" ]; }

# ------------------------------------------------------------- env contract
case_env() {
  run -n 3 --standalone "$WORKER" env
  check "env: exit 0" rc_is 0
  local r v port secret id
  for r in 0 1 2; do
    for v in "RANK=$r" "LOCAL_RANK=$r" "WORLD_SIZE=3" "LOCAL_WORLD_SIZE=3" "GROUP_RANK=0" \
      "MASTER_ADDR=127.0.0.1" "CHORUS_STORE_EXTERNAL=1" "CHORUS_RESTART_COUNT=0" \
      "TORCHELASTIC_RESTART_COUNT=0"; do
      check "env: rank $r has $v" hasx "$OUT" "\[rank$r\]:$v"
    done
    check "env: rank $r MASTER_PORT is a port" grep -Eqx "\[rank$r\]:MASTER_PORT=[1-9][0-9]*" "$OUT"
    check "env: rank $r has no secret in its environment" hasx "$OUT" "\[rank$r\]:CHORUS_JOB_SECRET=<unset>"
    check "env: rank $r secret file is private" hasx "$OUT" "\[rank$r\]:SECRET_FILE_MODE=600"
    check "env: rank $r job secret is 64 hex" grep -Eqx "\[rank$r\]:SECRET=[0-9a-f]{64}" "$OUT"
    check "env: rank $r job id is 16 hex" grep -Eqx "\[rank$r\]:CHORUS_JOB_ID=[0-9a-f]{16}" "$OUT"
  done
  port=$(grep -o 'MASTER_PORT=.*' "$OUT" | sort -u | wc -l)
  secret=$(grep -o ':SECRET=.*' "$OUT" | sort -u | wc -l)
  id=$(grep -o 'CHORUS_JOB_ID=.*' "$OUT" | sort -u | wc -l)
  check "env: one port, one secret, one job id for all ranks" [ "$port$secret$id" = 111 ]
  check "env: 60 lines, all prefixed" [ "$(grep -c '^\[rank[0-2]\]:' "$OUT")" -eq 60 ] \
    && [ "$(wc -l <"$OUT")" -eq 60 ]
  local first_secret secret_file
  first_secret=$(grep -m1 -o ':SECRET=.*' "$OUT")
  secret_file=$(grep -m1 -o 'CHORUS_JOB_SECRET_FILE=.*' "$OUT" | cut -d= -f2-)
  check "env: the secret file is gone after the run" [ -n "$secret_file" ] && [ ! -e "$secret_file" ]
  no_leftovers env

  # Inherited contract variables are replaced, not kept.
  RANK=99 WORLD_SIZE=7 CHORUS_RESTART_COUNT=5 MASTER_PORT=1 run -n 2 --standalone "$WORKER" env
  check "env: inherited RANK/WORLD_SIZE overridden" \
    eval 'hasx "$OUT" "\[rank1\]:RANK=1" && hasx "$OUT" "\[rank1\]:WORLD_SIZE=2" &&
          hasx "$OUT" "\[rank1\]:CHORUS_RESTART_COUNT=0" && ! has "$OUT" "MASTER_PORT=1$"'
  check "env: a fresh secret per run" not_has "$OUT" "$first_secret"

  # A secret given to chorusrun reaches the workers (by file), not the
  # environment; --print-env never shows it.
  CHORUS_JOB_SECRET=given-secret-123 run -n 2 --standalone "$WORKER" env
  check "env: CHORUS_JOB_SECRET passed on by file" hasx "$OUT" "\[rank1\]:SECRET=given-secret-123"
  check "env: and not in the environment" hasx "$OUT" "\[rank1\]:CHORUS_JOB_SECRET=<unset>"
  CHORUS_JOB_SECRET=given-secret-123 run --print-env
  check "print-env: the secret is hidden" eval 'has "$OUT" "CHORUS_JOB_SECRET.*<hidden>" && not_has "$OUT" given-secret-123'

  # --no-prefix, torchrun spellings, --nnodes 1 / --node-rank 0 accepted.
  run --nproc_per_node=1 --nnodes 1:1 --node_rank 0 --standalone --no-prefix -- "$WORKER" env
  check "no-prefix: exit 0" rc_is 0
  check "no-prefix: bare lines" hasx "$OUT" "RANK=0"
  check "no-prefix: nothing prefixed" not_has "$OUT" "^\[rank"

  # An explicit --master-port is used as is (try a few random ports).
  local p i
  for i in 1 2 3; do
    p=$((20000 + RANDOM % 30000))
    run -n 2 --master-addr 127.0.0.1 --master-port "$p" "$WORKER" env
    rc_is 0 && break
  done
  check "master-port: exit 0" rc_is 0
  check "master-port: MASTER_PORT=$p" hasx "$OUT" "\[rank1\]:MASTER_PORT=$p"
  no_leftovers master-port
}

# ------------------------------------------------------------------ output
case_output() {
  run -n 3 --standalone "$WORKER" lines 2000
  check "lines: exit 0" rc_is 0
  local re='^\[rank([0-2])\]:LINE-\1-[0-9]+-(abcdefghij){20}-END$'
  check "lines: 6000 stdout lines" [ "$(wc -l <"$OUT")" -eq 6000 ]
  check "lines: every stdout line whole and prefixed by its own rank" \
    [ "$(grep -Ec "$re" "$OUT")" -eq 6000 ]
  check "lines: 6000 stderr lines" [ "$(wc -l <"$ERR")" -eq 6000 ]
  check "lines: every stderr line whole and prefixed by its own rank" \
    [ "$(grep -Ec "$re" "$ERR")" -eq 6000 ]
  check "lines: each rank's lines in order" \
    awk -F- '{ split($1, a, "rank"); r = a[2] + 0; if ($3 != n[r]++) bad = 1 }
             END { exit bad || n[0] != 2000 || n[1] != 2000 || n[2] != 2000 }' "$OUT"
  no_leftovers lines

  run -n 2 --standalone "$WORKER" mixed
  check "mixed: exit 0" rc_is 0
  check "mixed: stdout line" hasx "$OUT" "\[rank1\]:hello from stdout"
  check "mixed: stderr line on stderr" hasx "$ERR" "\[rank1\]:hello from stderr"
  check "mixed: stderr line not on stdout" not_has "$OUT" "hello from stderr"
  check "mixed: unterminated last line flushed" hasx "$OUT" "\[rank0\]:tail-no-newline"
  check "mixed: 100000-byte line split in 64 KiB pieces, nothing lost" \
    awk '/^\[rank[01]\]:x+$/ { sub(/^\[rank/, ""); r = substr($0, 1, 1);
           n = length($0) - 3; if (n > 65536) bad = 1; tot[r] += n }
         END { exit bad || tot[0] != 100000 || tot[1] != 100000 }' "$OUT"
  no_leftovers mixed
}

# ----------------------------------------------------------------- failures
case_failures() {
  run -n 3 --standalone "$WORKER" exit 2 3
  check "exit: code 3 propagated" rc_is 3
  check "exit: report names rank 2" grep -Eq '^chorusrun: rank 2 \(pid [0-9]+\) failed: exit code 3$' "$ERR"
  check "exit: report shows its last line" grep -q '  | rank2 exiting with code 3' "$ERR"
  check "exit: only one rank blamed" [ "$(grep -c 'failed:' "$ERR")" -eq 1 ]
  no_leftovers exit

  run -n 2 --standalone "$WORKER" exit 7 3
  check "success: all ranks exit 0 -> 0" rc_is 0
  check "success: no report" not_has "$ERR" "failed"

  run -n 3 --standalone "$WORKER" signal 1 9
  check "signal: 128+9" rc_is 137
  check "signal: report names the signal" \
    grep -Eq '^chorusrun: rank 1 \(pid [0-9]+\) failed: killed by signal 9 \(SIGKILL\)$' "$ERR"
  check "signal: only one rank blamed" [ "$(grep -c 'failed:' "$ERR")" -eq 1 ]
  no_leftovers signal

  # Rank 1 fails at once, the others sleep forever: stopped promptly.
  run -n 4 --standalone "$WORKER" exit 1 5 sleep
  check "prompt stop: code 5" rc_is 5
  check "prompt stop: within 4 s (took ${ELAPSED_MS} ms)" faster_than 4000
  check "prompt stop: rank 1 blamed, no other" \
    eval '[ "$(grep -c "failed:" "$ERR")" -eq 1 ] && has "$ERR" "rank 1 (pid"'
  no_leftovers prompt-stop

  # Workers that ignore SIGTERM get SIGKILL after the grace period.
  run -n 3 --standalone --grace-period 1 "$WORKER" exit 0 4 sleep-ignore-term
  check "grace: code 4" rc_is 4
  check "grace: waited the grace period (${ELAPSED_MS} ms)" slower_than 900
  check "grace: then SIGKILL, within 5 s" faster_than 5000
  no_leftovers grace

  run -n 2 --standalone "$WORKER-does-not-exist"
  check "missing program: 127" rc_is 127
  check "missing program: message" has "$ERR" "not found"
}

# ---------------------------------------------------------------- restarts
case_restarts() {
  run -n 3 --standalone --max-restarts 1 "$WORKER" restart-fail 1 7
  check "restart: recovered, exit 0" rc_is 0
  check "restart: message printed" has "$ERR" "chorusrun: restarting the group (restart 1/1)"
  check "restart: first failure reported" has "$ERR" "rank 1 (pid"
  check "restart: generation 1 ran with CHORUS_RESTART_COUNT=1" \
    eval 'hasx "$OUT" "\[rank0\]:rank0 restart 1" && hasx "$OUT" "\[rank2\]:rank2 restart 1"'
  no_leftovers restart

  run -n 2 --standalone --max-restarts 1 "$WORKER" exit 1 4
  check "restart exhausted: code 4" rc_is 4
  check "restart exhausted: two failures reported" [ "$(grep -c 'failed: exit code 4' "$ERR")" -eq 2 ]
  check "restart exhausted: says so" has "$ERR" "no restarts left"
  no_leftovers restart-exhausted
}

# ---------------------------------------------------------------- log files
# --log-dir with --redirects/--tee (torchrun's values): per-rank files under
# DIR/<run id>/attempt_<restart>/<local rank>/, the worker's raw lines (no
# prefix); a redirected stream stays off the terminal, a teed one reaches
# both; the failure report keeps its last lines either way.
case_logs() {
  local d="$TMP/logs" rd f
  run -n 2 --standalone --log-dir "$d" --redirects 1 --tee 0:2 "$WORKER" mixed
  check "logs: exit 0" rc_is 0
  rd=$(sed -n 's/^chorusrun: logs in \(.*\) (attempt_.*$/\1/p' "$ERR")
  check "logs: run directory announced, under --log-dir ($rd)" \
    eval '[ "${rd%/*}" = "$d" ] && [ -d "$rd" ]'
  check "logs: directories made 0700" \
    eval '[ "$(stat -c %a "$rd")" = 700 ] && [ "$(stat -c %a "$rd/attempt_0/1")" = 700 ]'
  for f in "$rd/attempt_0/0/stdout.log" "$rd/attempt_0/1/stdout.log"; do
    check "logs: ${f#"$rd"/}: raw lines, the unterminated last one flushed" \
      eval 'hasx "$f" "hello from stdout" && hasx "$f" "tail-no-newline" && not_has "$f" "rank"'
    check "logs: ${f#"$rd"/}: 100000-byte line split in 64 KiB pieces, nothing lost" \
      awk '/^x+$/ { if (length($0) > 65536) bad = 1; tot += length($0) }
           END { exit bad || tot != 100000 }' "$f"
  done
  check "logs: redirected stdout not on the terminal" [ ! -s "$OUT" ]
  check "logs: rank 0's teed stderr in its stderr.log" \
    hasx "$rd/attempt_0/0/stderr.log" "hello from stderr"
  check "logs: ... and on the terminal" hasx "$ERR" "\[rank0\]:hello from stderr"
  check "logs: rank 1's stderr (not named by --tee 0:2) only on the terminal" \
    eval '[ ! -e "$rd/attempt_0/1/stderr.log" ] && hasx "$ERR" "\[rank1\]:hello from stderr"'
  no_leftovers logs

  # A restart writes the next attempt_N; the report's tail survives -r 3.
  run -n 2 --standalone --max-restarts 1 --log-dir "$d" --rdzv-id logrun -r 3 \
    "$WORKER" restart-fail 1 7
  check "logs restart: exit 0" rc_is 0
  check "logs restart: attempt_0 holds the failure" \
    hasx "$d/logrun/attempt_0/1/stderr.log" "rank1 failing on restart 0"
  check "logs restart: attempt_1 holds the next generation" \
    eval 'hasx "$d/logrun/attempt_1/0/stdout.log" "rank0 restart 1" &&
          hasx "$d/logrun/attempt_1/1/stdout.log" "rank1 restart 1"'
  check "logs restart: nothing on the terminal" \
    eval '[ ! -s "$OUT" ] && not_has "$ERR" "^\[rank"'
  check "logs restart: report names the log directory" \
    has "$ERR" "rank 1's log files: $d/logrun/attempt_0/1\$"
  check "logs restart: report still shows the last lines" \
    has "$ERR" "  | rank1 failing on restart 0"
  no_leftovers logs-restart

  run -n 2 --standalone --tee 3 "$WORKER" mixed
  check "logs: --tee without --log-dir is a usage error" \
    eval 'rc_is 2 && has "$ERR" "^chorusrun: --tee needs --log-dir" && [ ! -s "$OUT" ]'
  run -n 2 --standalone --log-dir "$d" -r 4 "$WORKER" mixed
  check "logs: --redirects 4 is a usage error" eval 'rc_is 2 && [ ! -s "$OUT" ]'
  run -n 2 --standalone --log-dir "$d" -t 0:1,2:1 "$WORKER" mixed
  check "logs: --tee naming local rank 2 of 2 is a usage error" rc_is 2
  # A log directory that cannot be made stops the run before any worker.
  run -n 2 --standalone --log-dir "$OUT/sub" -r 3 "$WORKER" mixed
  check "logs: unusable --log-dir: exit 1 naming the directory" \
    eval 'rc_is 1 && has "$ERR" "cannot create the log directory $OUT/sub"'
  no_leftovers logs-unusable
}

# ------------------------------------------------------ --elastic inplace
case_inplace() {
  run -n 4 --standalone --elastic inplace "$WORKER" inplace 2 50
  check "inplace: exit 0" rc_is 0
  check "inplace: the killed worker reported" has "$ERR" "rank 2 (pid"
  check "inplace: the others went on" has "$ERR" "the other workers go on"
  check "inplace: three survivors finished in a world of 3 (sum 0+1+3)" \
    [ "$(grep -c 'inplace done size 3 sum 4' "$OUT")" -eq 3 ]
  check "inplace: summary" has "$ERR" "1 worker(s) failed, 3 finished"
  no_leftovers inplace

  run -n 2 --standalone --elastic bogus "$WORKER" env
  check "inplace: bad --elastic value is a usage error" rc_is 2
}

# ------------------------------------------------------- signals to chorusrun
case_signals() {
  start_bg -n 3 --standalone "$WORKER" trap
  wait_lines 3 "ready"
  kill -TERM "$BG"
  wait_bg
  check "SIGTERM: exit 143" rc_is 143
  check "SIGTERM: forwarded to every worker" \
    eval 'hasx "$OUT" "\[rank0\]:rank0 got SIGTERM" && hasx "$OUT" "\[rank1\]:rank1 got SIGTERM" &&
          hasx "$OUT" "\[rank2\]:rank2 got SIGTERM"'
  no_leftovers sigterm

  # SIGINT works although a background job starts with SIGINT ignored.
  start_bg -n 2 --standalone "$WORKER" sleep
  wait_lines 2 "ready"
  kill -INT "$BG"
  wait_bg
  check "SIGINT: exit 130" rc_is 130
  no_leftovers sigint

  # Workers ignoring the forwarded SIGTERM are SIGKILLed after the grace.
  start_bg -n 2 --standalone --grace-period 0.5 "$WORKER" sleep-ignore-term
  wait_lines 2 "ready"
  local t0=$(now_ms)
  kill -TERM "$BG"
  wait_bg
  ELAPSED_MS=$(($(now_ms) - t0))
  check "SIGTERM + ignoring workers: exit 143" rc_is 143
  check "SIGTERM + ignoring workers: done within 4 s (${ELAPSED_MS} ms)" faster_than 4000
  no_leftovers sigterm-ignored

  # The workers' children die with them (process groups).
  start_bg -n 2 --standalone "$WORKER" fork-sleep
  wait_lines 2 "ready"
  kill -TERM "$BG"
  wait_bg
  check "SIGTERM + grandchildren: exit 143" rc_is 143
  no_leftovers sigterm-grandchildren

  # chorusrun killed with SIGKILL: workers (PDEATHSIG) and their children
  # (the guard) must not survive it.
  start_bg -n 2 --standalone "$WORKER" fork-sleep
  wait_lines 2 "ready"
  kill -KILL "$BG"
  wait_bg
  check "SIGKILL: chorusrun died" rc_is 137
  no_leftovers sigkill
}

# ---------------------------------------------------------- usage, env table
case_usage() {
  run --print-env
  check "print-env: exit 0" rc_is 0
  check "print-env: lists CHORUS_TIMEOUT" has "$OUT" "^CHORUS_TIMEOUT"
  check "print-env: lists the contract (MASTER_PORT)" has "$OUT" "^MASTER_PORT"
  run --env-markdown
  check "env-markdown: table row" has "$OUT" '| `CHORUS_TIMEOUT` |'
  run --help
  check "help: exit 0 and usage" eval 'rc_is 0 && has "$OUT" "^usage: chorusrun"'

  local args
  for args in "" "-n" "-n 0 $WORKER env" "-n abc $WORKER env" "--bogus $WORKER env" \
    "--nnodes 2 $WORKER env" "--node-rank 1 $WORKER env" "--grace-period x $WORKER env" \
    "--master-port 70000 $WORKER env" "--standalone"; do
    # shellcheck disable=SC2086
    run $args
    check "usage error [$args]: exit 2 with a message" \
      eval 'rc_is 2 && has "$ERR" "^chorusrun: " && [ ! -s "$OUT" ]'
  done
  run --nnodes 2 "$WORKER" env
  check "nnodes 2 without an endpoint: says what is missing" has "$ERR" "needs --rdzv-endpoint"
  run --nnodes 2 --rdzv-endpoint 127.0.0.1:1 "$WORKER" env
  check "nnodes 2 without a secret: says so" eval 'rc_is 1 && has "$ERR" "needs a secret that every node shares"'
  run --nnodes 2 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id 'a b' "$WORKER" env
  check "bad --rdzv-id: usage error" eval 'rc_is 2 && has "$ERR" "--rdzv-id .a b.: not an id"'
  no_leftovers usage
}

# -------------------------------------------------------------------- store
case_store() {
  run -n 3 --standalone "$WORKER" store
  check "store: exit 0" rc_is 0
  check "store: every rank saw every key" [ "$(grep -c 'store ok: 3 of 3 keys' "$OUT")" -eq 3 ]
  # Restarted generations use the same store (keys separated by restart).
  run -n 2 --standalone --max-restarts 1 "$WORKER" store
  check "store again: exit 0" rc_is 0
  no_leftovers store
}

# ------------------------------------------------------------ shared memory
# A worker that dies between creating its group's segment and unlinking it
# leaves a name in /dev/shm; chorusrun removes the names of its job.
case_shm() {
  run -n 1 --standalone "$WORKER" leak-shm
  check "shm: worker left a segment name" has "$OUT" "made /dev/shm/chorus-"
  local f
  f=$(sed -n 's/^\[rank[0-9]*\]:made //p' "$OUT" | head -n 1)
  gone() { [ -n "$1" ] && [ ! -e "$1" ]; }
  check "shm: chorusrun removed it" gone "$f"
  no_leftovers shm
}

# ----------------------------------------------------------- CPU binding
# --cpu-bind auto (default): workers get disjoint CPU sets when there are
# at most as many workers as CPUs, one CPU each beyond that; none: every
# worker keeps chorusrun's whole set; anything else is a usage error.
case_cpu_bind() {
  local ncpu a b
  ncpu=$(nproc)
  run -n 2 --standalone "$WORKER" cpus
  check "cpu-bind: exit 0" rc_is 0
  a=$(sed -n 's/^\[rank0\]:CPUS=//p' "$OUT")
  b=$(sed -n 's/^\[rank1\]:CPUS=//p' "$OUT")
  if [ "$ncpu" -ge 2 ]; then
    check "cpu-bind: 2 workers on disjoint CPUs ($a | $b)" \
      eval '[ -n "$a" ] && [ -n "$b" ] && [ -z "$(comm -12 <(tr , "\n" <<<"$a" | sort) <(tr , "\n" <<<"$b" | sort))" ]'
    run -n $((ncpu + 1)) --standalone "$WORKER" cpus
    check "cpu-bind: more workers than CPUs: one CPU each" \
      eval '[ "$(grep -c "^\[rank[0-9]*\]:CPUS=[0-9]*$" "$OUT")" -eq $((ncpu + 1)) ]'
  else
    ok "cpu-bind: one CPU only, nothing to bind (skipped: nproc is $ncpu)"
  fi
  run -n 2 --standalone --cpu-bind none "$WORKER" cpus
  a=$(sed -n 's/^\[rank0\]:CPUS=//p' "$OUT")
  b=$(sed -n 's/^\[rank1\]:CPUS=//p' "$OUT")
  check "cpu-bind none: both workers keep every CPU" eval '[ -n "$a" ] && [ "$a" = "$b" ]'
  CHORUS_CPU_BIND=none run -n 2 --standalone "$WORKER" cpus
  b=$(sed -n 's/^\[rank1\]:CPUS=//p' "$OUT")
  check "CHORUS_CPU_BIND=none: the same" eval '[ "$a" = "$b" ]'
  run -n 1 --standalone --cpu-bind sideways "$WORKER" cpus
  check "cpu-bind: a bad value is a usage error" rc_is 2
  no_leftovers "cpu-bind"
}

case_usage
case_cpu_bind
case_shm
case_env
case_output
case_failures
case_restarts
case_logs
case_inplace
case_signals
case_store

summary "all launcher checks passed"
