#!/usr/bin/env bash
# bench/launcher/nodes.sh BUILD_DIR [REPS]
#
# Measures chorusrun on emulated hosts (tests/fixtures/netns.sh, needs
# root), REPS times each (default 5), and prints every sample and the median:
#   rdzv     16 hosts x 4 workers (64 ranks): from starting the 16 agents to
#            the last rank's chorus_comm_init_env() returning (world formed)
#   lost     3 hosts, one agent SIGKILLed: until another agent reports the
#            node lost
#   restart  4 hosts x 2 workers, one worker SIGKILLed: until the last of the
#            8 workers of the next round has started (the program's own
#            start-up is a few ms: launch_worker round-wait)
#   inplace  4 hosts x 2 workers of chorus-train --elastic inplace (a small
#            model), rank 5 SIGKILLs itself at the start of step 10: from
#            the kill to the survivors' next completed step (step 10 again,
#            in the world of 7)
# Example: sudo bash bench/launcher/nodes.sh build 5
set -u
BUILD=$(cd "$1" && pwd) REPS=${2:-5}
HERE=$(cd "$(dirname "$0")" && pwd)
NETNS=$HERE/../../tests/fixtures/netns.sh
TMP=$(mktemp -d "${TMPDIR:-/tmp}/chorus-bnodes.XXXXXX") || exit 1
export CHORUS_NETNS_DIR=$TMP/netns CHORUS_NETNS_PREFIX=cbn$$
cp "$BUILD/chorusrun" "$TMP/chorusrun" && cp "$BUILD/tests/launcher/launch_worker" "$TMP/worker" &&
  cp "$BUILD/chorus-train" "$TMP/chorus-train" || exit 1
RUN=$TMP/chorusrun WORKER=$TMP/worker TRAIN=$TMP/chorus-train
DATA=$HERE/../../data/tinyshakespeare.txt
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key
cleanup() { pkill -KILL -f "$TMP/" 2>/dev/null; bash "$NETNS" down >/dev/null 2>&1; rm -rf "$TMP"; }
trap cleanup EXIT
bash "$NETNS" up 16 >/dev/null || { echo "cannot make 16 emulated hosts"; exit 1; }
for i in $(seq 0 15); do ADDR[i]=$(bash "$NETNS" addr "$i"); done
PORT=29700
now_ms() { date +%s%3N; }
agent() {
  local i=$1
  shift
  (bash "$NETNS" exec "$i" bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$TMP/h$i.pid" "$RUN" \
    "$@" >"$TMP/h$i.out" 2>&1 </dev/null; exit $?) &
}
wait_for() { # FILES PATTERN COUNT SECONDS
  local end=$((SECONDS + $4))
  while ((SECONDS < end)); do
    (($(cat $1 2>/dev/null | grep -c -- "$2") >= $3)) && return 0
    sleep 0.01
  done
  return 1
}
median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : int((v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
c10d() { echo --rdzv-endpoint "${ADDR[0]}:$PORT" --rdzv-id "$1"; }
finish() { pkill -KILL -f "$TMP/" 2>/dev/null; wait 2>/dev/null; rm -f "$TMP"/h*.out; PORT=$((PORT + 1)); }

declare -a R L S P
for rep in $(seq 1 "$REPS"); do
  t0=$(now_ms)
  for i in $(seq 0 15); do agent "$i" --nnodes 16 -n 4 $(c10d r$rep) "$WORKER" reduce-loop 0; done
  if wait_for "$TMP/h*.out" 'reducing round 0 at' 64 60; then
    last=$(cat "$TMP"/h*.out | sed -n 's/.*reducing round 0 at \([0-9]*\).*/\1/p' | sort -n | tail -n 1)
    R+=($((last - t0)))
  fi
  wait_for "$TMP/h*.out" 'done round 0' 64 60
  finish

  for i in 0 1 2; do agent "$i" --nnodes 2:3 --max-restarts 1 -n 1 $(c10d l$rep) "$WORKER" round-wait 1; done
  wait_for "$TMP/h*.out" 'start round 0' 3 30
  t0=$(now_ms)
  kill -KILL "$(cat "$TMP/h2.pid")"
  wait_for "$TMP/h0.out $TMP/h1.out" 'was lost' 1 10 && L+=($(($(now_ms) - t0)))
  finish

  for i in 0 1 2 3; do agent "$i" --nnodes 4 --max-restarts 1 -n 2 $(c10d s$rep) "$WORKER" round-wait 1; done
  wait_for "$TMP/h*.out" 'start round 0' 8 30
  victim=$(sed -n 's/.*rank5 start round 0 .* pid \([0-9]*\) .*/\1/p' "$TMP"/h*.out | head -n 1)
  t0=$(now_ms)
  kill -KILL "$victim"
  if wait_for "$TMP/h*.out" 'start round 1' 8 30; then
    last=$(cat "$TMP"/h*.out | sed -n 's/.*start round 1 .* at //p' | sort -n | tail -n 1)
    S+=($((last - t0)))
  fi
  finish

  for i in 0 1 2 3; do
    agent "$i" --nnodes 4 -n 2 --elastic inplace $(c10d p$rep) "$TRAIN" --data "$DATA" \
      --layers 2 --heads 2 --channels 64 --ctx 64 --batch 4 --steps 20 --val-every 0 --sample 0 \
      --threads 1 --kill-at 10 --kill-rank 5
  done
  if wait_for "$TMP/h*.out" 'elastic: step 10 done' 1 60; then
    k=$(cat "$TMP"/h*.out | sed -n 's/.*kills itself at step 10 .*wall clock \([0-9]*\) ms.*/\1/p' | head -n 1)
    d=$(cat "$TMP"/h*.out | sed -n 's/.*elastic: step 10 done .*wall clock \([0-9]*\) ms.*/\1/p' | head -n 1)
    [[ -n $k && -n $d ]] && P+=($((d - k)))
  fi
  finish
done
echo "rdzv 16x4 (ms):      ${R[*]}  median $(printf '%s\n' "${R[@]}" | median)"
echo "lost node (ms):      ${L[*]}  median $(printf '%s\n' "${L[@]}" | median)"
echo "restart 4x2 (ms):    ${S[*]}  median $(printf '%s\n' "${S[@]}" | median)"
echo "in place 4x2 (ms):   ${P[*]}  median $(printf '%s\n' "${P[@]}" | median)"
