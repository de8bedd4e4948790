#!/usr/bin/env bash
# test_listen.sh CHORUSRUN LAUNCH_WORKER - what a one-host job listens on,
# and a squatted rendezvous port (issue 30, items 4 and 5).
#
#   env        two ranks started torchrun-style (RANK, WORLD_SIZE,
#              MASTER_ADDR=127.0.0.1, MASTER_PORT; no chorusrun) over TCP:
#              every listening socket of theirs is on loopback
#   c10d       chorusrun --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT:
#              the rendezvous store and the workers' ports are on loopback
#   squat-*    a process of another user (uid 65534 when we are root) holds
#              the endpoint's port and says nothing / closes every
#              connection / sends garbage: chorusrun gives up within 30 s
#              (not the 600 s join timeout), naming the port and the
#              squatter's pid and uid
#   squat-gone the squatter leaves 2 s after chorusrun started: chorusrun
#              hosts the store after all and the job succeeds
#   env-squat-* rank 1 of a torchrun-style job whose MASTER_PORT a silent or
#              closing squatter holds gives up within 30 s (not its 300 s
#              init timeout), naming the squatter
#
# Only this script's own processes are judged: the worker is copied into a
# private directory, so `pgrep -f $TMP/` finds exactly them (other jobs may
# run on the machine).  The EXIT trap kills whatever is left and removes the
# directory.  Skips (77) without ss or python3.
set -u
. "$(dirname "$0")/../lib.sh"

if [ $# -ne 2 ]; then
  echo "usage: $0 CHORUSRUN LAUNCH_WORKER" >&2
  exit 2
fi
CHORUSRUN=$1
command -v ss >/dev/null || { echo "skip: no ss (iproute2)"; exit 77; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=$(command -v python3) || { echo "skip: no python3"; exit 77; }
tmp_dir listen
chmod 755 "$TMP"
WORKER="$TMP/launch_worker"
cp "$2" "$WORKER" || exit 1

ours() { pgrep -f "$TMP/"; }
cleanup() {
  local pids
  pids=$(ours)
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
}
on_exit cleanup

fail_details() {
  for f in "${D:-$TMP}"/*.out "${D:-$TMP}"/*.err; do
    [ -s "$f" ] || continue
    echo "---- $f (first 15 lines, and the last 15 of more):"; head -n 15 "$f" | cut -c1-400
    if [ "$(wc -l <"$f")" -gt 15 ]; then echo "  ..."; tail -n 15 "$f" | cut -c1-400; fi
  done
}

# A secret for the chorusrun cases (c10d wants one).
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"

# A port nobody listens on now (the squatter or the job binds it next).
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 30000))
    ss -ltnH "sport = :$p" | grep -q . || { echo "$p"; return 0; }
  done
  return 1
}

# "ADDRESS PID" for every TCP listener of the given pids.
listeners_of() {
  local pids=" $* "
  ss -ltnpH | while read -r _ _ _ local _ users; do
    for p in $(grep -o 'pid=[0-9]*' <<<"$users" | cut -d= -f2); do
      case $pids in *" $p "*) echo "$local $p"; break ;; esac
    done
  done
}

is_loopback() { # ADDRESS:PORT as ss prints it
  [[ $1 =~ ^127\. || $1 =~ ^\[::1\] || $1 =~ ^\[::ffff:127\. ]]
}

# Checks that every listener of our processes is on loopback and that
# there are at least MIN of them; WHAT names the case.
check_loopback() {
  local what=$1 min=$2 pids lines n bad
  pids=$(ours | tr '\n' ' ')
  lines=$(listeners_of $pids)
  n=$(grep -c . <<<"$lines")
  bad=$(while read -r a _; do [ -n "$a" ] && ! is_loopback "$a" && echo "$a"; done <<<"$lines")
  echo "     $what: listeners of pids $pids: $(tr '\n' ' ' <<<"$lines")"
  if [ -n "$bad" ]; then fail "$what: listening beyond loopback: $(tr '\n' ' ' <<<"$bad")"
  elif [ "$n" -lt "$min" ]; then fail "$what: $n listeners found, expected at least $min"
  else ok "$what: all $n listeners on loopback"; fi
}

# Waits (at most 20 s) until FILE has N lines matching PATTERN.
wait_lines() {
  local n=$1 pat=$2 file=$3
  for _ in $(seq 200); do
    [ "$(cat $file 2>/dev/null | grep -c -- "$pat")" -ge "$n" ] && return 0
    sleep 0.1
  done
  return 1
}

case_env() {
  local port r
  port=$(free_port) || { fail "env: no free port"; return; }
  for r in 0 1; do
    env -u LOCAL_WORLD_SIZE -u LOCAL_RANK -u CHORUS_JOB_SECRET -u CHORUS_JOB_SECRET_FILE \
      CHORUS_TRANSPORT=tcp RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout -s KILL 60 "$WORKER" reduce-loop 1 >"$TMP/env$r.out" 2>"$TMP/env$r.err" &
  done
  if wait_lines 2 'first all_reduce done' "$TMP/env*.out"; then
    check_loopback "env (MASTER_ADDR=127.0.0.1)" 3 # the store, two data ports
  else
    fail "env: the ranks did not form a world"
  fi
  kill -KILL $(ours) 2>/dev/null
  wait 2>/dev/null
  rm -f "$TMP"/env*
}

case_c10d() {
  local port
  port=$(free_port) || { fail "c10d: no free port"; return; }
  CHORUS_JOB_SECRET_FILE=$TMP/key CHORUS_TRANSPORT=tcp timeout -s KILL 60 "$CHORUSRUN" \
    --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" \
    "$WORKER" reduce-loop 1 >"$TMP/c10d.out" 2>"$TMP/c10d.err" &
  if wait_lines 2 'first all_reduce done' "$TMP/c10d.out"; then
    check_loopback "c10d (--rdzv-endpoint 127.0.0.1)" 3 # the rendezvous store, two data ports
    if ss -ltnH "sport = :$port" | grep -q "127.0.0.1:$port"; then
      ok "c10d: the store listens on 127.0.0.1:$port"
    else
      fail "c10d: no store on 127.0.0.1:$port: $(ss -ltnH "sport = :$port")"
    fi
  else
    fail "c10d: the workers did not form a world"
  fi
  kill -KILL $(ours) 2>/dev/null
  wait 2>/dev/null
  rm -f "$TMP"/c10d*
}

# The squatter: listens on 127.0.0.1:PORT and, for each connection, says
# nothing (silent), closes it (close) or sends bytes that are not the
# store's (garbage).  Another user's when we are root.
cat >"$TMP/squat.py" <<'EOF'
import socket, sys
mode, port = sys.argv[1], int(sys.argv[2])
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen(64)
print("listening", flush=True)
keep = []
while True:
    c, _ = s.accept()
    if mode == "close":
        c.close()
        continue
    if mode == "garbage":
        c.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n" * 8)
    keep.append(c)
EOF
chmod 644 "$TMP/squat.py"
AS_OTHER=()
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null &&
   setpriv --reuid=65534 --regid=65534 --clear-groups "$PY" -c pass 2>/dev/null; then
  AS_OTHER=(setpriv --reuid=65534 --regid=65534 --clear-groups)
fi

# Starts the squatter (SQ: its pid, SQPORT: its port).
squat() {
  local mode=$1
  for _ in 1 2 3; do
    SQPORT=$(free_port) || return 1
    "${AS_OTHER[@]}" "$PY" "$TMP/squat.py" "$mode" "$SQPORT" >"$D/squat.log" 2>&1 &
    SQ=$!
    wait_lines 1 listening "$D/squat.log" && return 0
    kill -KILL "$SQ" 2>/dev/null
    wait "$SQ" 2>/dev/null
  done
  return 1
}

run_c10d() { # PORT: chorusrun, bounded; sets RC, ELAPSED_MS
  local t0
  t0=$(now_ms)
  CHORUS_JOB_SECRET_FILE=$TMP/key timeout -s KILL 60 "$CHORUSRUN" --nnodes 1 \
    --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$1" "$WORKER" env \
    >"$D/sq.out" 2>"$D/sq.err"
  RC=$?
  ELAPSED_MS=$(($(now_ms) - t0))
}

case_squat() {
  local mode=$1 msg
  squat "$mode" || { fail "squat-$mode: cannot start the squatter"; return; }
  run_c10d "$SQPORT"
  msg=$(grep -v ' WARN ' "$D/sq.err" | grep -m1 'chorusrun:')
  echo "     squat-$mode: rc $RC after $ELAPSED_MS ms: ${msg:0:400}"
  if [ "$RC" = 0 ] || [ "$RC" = 137 ]; then fail "squat-$mode: rc $RC (expected a failure)"
  elif [ "$ELAPSED_MS" -gt 30000 ]; then fail "squat-$mode: gave up only after $ELAPSED_MS ms"
  elif ! grep -q "127.0.0.1:$SQPORT" <<<"$msg"; then fail "squat-$mode: the message names no port"
  elif ! grep -q "pid $SQ " <<<"$msg"; then fail "squat-$mode: the message names not the squatter (pid $SQ)"
  elif [ ${#AS_OTHER[@]} -gt 0 ] && ! grep -q "uid 65534" <<<"$msg"; then
    fail "squat-$mode: the message names not the squatter's uid 65534"
  else ok "squat-$mode: chorusrun gave up in $ELAPSED_MS ms naming the port and the squatter"; fi
  kill -KILL "$SQ" 2>/dev/null
  wait "$SQ" 2>/dev/null
  rm -f "$D"/sq.*
}

# The library's own client (torchrun-style variables, no chorusrun): rank 1
# of a job whose MASTER_PORT is squatted gives up in seconds, not after its
# init timeout (300 s), naming the squatter.
case_env_squat() {
  local mode=$1 t0 msg
  squat "$mode" || { fail "env-squat-$mode: cannot start the squatter"; return; }
  t0=$(now_ms)
  env -u LOCAL_WORLD_SIZE -u LOCAL_RANK -u CHORUS_JOB_SECRET CHORUS_JOB_SECRET_FILE=$TMP/key \
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$SQPORT \
    timeout -s KILL 60 "$WORKER" reduce-loop 1 >"$D/sq.out" 2>"$D/sq.err"
  RC=$?
  ELAPSED_MS=$(($(now_ms) - t0))
  msg=$(grep -m1 'init failed' "$D/sq.err")
  echo "     env-squat-$mode: rc $RC after $ELAPSED_MS ms: ${msg:0:400}"
  if [ "$RC" = 0 ] || [ "$RC" = 137 ]; then fail "env-squat-$mode: rc $RC (expected a failure)"
  elif [ "$ELAPSED_MS" -gt 30000 ]; then fail "env-squat-$mode: gave up only after $ELAPSED_MS ms"
  elif ! grep -q "pid $SQ " <<<"$msg"; then fail "env-squat-$mode: the message names not the squatter (pid $SQ)"
  else ok "env-squat-$mode: rank 1 gave up in $ELAPSED_MS ms naming the squatter"; fi
  kill -KILL "$SQ" 2>/dev/null
  wait "$SQ" 2>/dev/null
  rm -f "$D"/sq.*
}

case_squat_gone() {
  squat garbage || { fail "squat-gone: cannot start the squatter"; return; }
  (sleep 2; kill -KILL "$SQ") &
  run_c10d "$SQPORT"
  wait 2>/dev/null
  if [ "$RC" = 0 ] && [ "$(grep -c ':WORLD_SIZE=2$' "$D/sq.out")" = 2 ]; then
    ok "squat-gone: the squatter left after 2 s; chorusrun hosted the store and ran ($ELAPSED_MS ms)"
  else
    fail "squat-gone: rc $RC after $ELAPSED_MS ms"
  fi
  rm -f "$D"/sq.*
}

run_one() {
  case $1 in
    env) case_env ;;
    c10d) case_c10d ;;
    squat-gone) case_squat_gone ;;
    env-squat-*) case_env_squat "${1#env-squat-}" ;;
    squat-*) case_squat "${1#squat-}" ;;
  esac
}

# env and c10d look at every listener of ours: alone.  The squatter cases
# mostly wait (5-15 s each, by design) on ports of their own: side by side,
# each in a subshell with its own files (D) whose exit status is its
# failure count.
cases=${CASES:-env c10d squat-silent squat-close squat-garbage squat-gone env-squat-silent env-squat-close}
pids=() names=()
for c in $cases; do
  case $c in
    env | c10d)
      D=$TMP
      run_one "$c"
      left=$(ours)
      [ -n "$left" ] && { fail "$c: processes left behind: $left"; kill -KILL $left 2>/dev/null; }
      ;;
    *)
      (D=$TMP/case-$c && mkdir -p "$D" && FAILS=0 && run_one "$c" && exit "$FAILS") \
        >"$TMP/case-$c.log" 2>&1 &
      pids+=($!) names+=("$c")
      ;;
  esac
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  cat "$TMP/case-${names[$i]}.log"
  ((rc)) && FAILS=$((FAILS + rc))
done
left=$(ours)
[ -n "$left" ] && { fail "processes left behind: $left"; kill -KILL $left 2>/dev/null; }

summary "all passed" "check(s) failed"
