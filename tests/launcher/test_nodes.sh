#!/usr/bin/env bash
# test_nodes.sh CHORUSRUN WORKER TEST_COLLS FIXTURES_DIR [CASE...]
#
# chorusrun on several emulated hosts (tests/fixtures/netns.sh: one network
# namespace per host, joined by a bridge): one agent per host, as users run
# torchrun on every node.  Cases (all by default):
#   c10d      2 hosts x 2 workers, c10d rendezvous: distinct ranks, the
#             contract on every worker, every collective across hosts
#   static    the same with --node-rank and --master-addr
#   lastcall  --nnodes 2:3: with 2 hosts the group starts after the last
#             call; with 3 it starts at once
#   worker    a worker SIGKILLed on one host: every host restarts its
#             workers (4 hosts x 2), and the time from the kill to every
#             worker running again is printed
#   agent     one host's agent SIGKILLed (--nnodes 2:3, 3 hosts): the other
#             two see the node lost and re-form without it
#   link      host 2 unplugged (the fixture's link down) while 3 hosts
#             all_reduce (--nnodes 2:3): the other hosts see it lost and
#             re-form without it; its own agent loses the store and exits
#   grow      a third host joins a running 2-host job (--nnodes 2:3): the
#             group re-forms with it
#   store     the agent hosting the c10d store SIGKILLed: every other node
#             fails with a clear message within the timeout
#   signal    SIGTERM to one host's agent: every agent stops its workers and
#             exits 143 (the job stops, as torchrun's agents do)
#   etcd      a real 3-member etcd (tests/fixtures/etcd.sh, run inside host 3)
#             keeps the rendezvous of 3 hosts: distinct ranks; one etcd
#             member SIGKILLed changes nothing; then a worker SIGKILLed
#             makes all 3 re-form through the 2 members left and finish
#   bad       a node with another secret is refused; a node with another
#             --nnodes is refused; garbage on the store's port changes
#             nothing
# Needs root (network namespaces); exits 77 (skipped, reason printed) when
# the fixture cannot make hosts.  The EXIT trap kills every agent and
# removes the hosts.
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 WORKER=$2 COLLS=$3 FIXTURES=$4
shift 4
CASES=${*:-c10d static lastcall worker agent link grow store signal etcd bad}
tmp_dir nodes
export CHORUS_NETNS_DIR=$TMP/netns CHORUS_NETNS_PREFIX=chn$$
NETNS=$FIXTURES/netns.sh
UP=0 ETCD_UP=0
ETCD=$FIXTURES/etcd.sh

cleanup() {
  pkill -KILL -f "$TMP/" 2>/dev/null
  if ((ETCD_UP)); then CHORUS_ETCD_DIR=$TMP/etcd bash "$ETCD" down >/dev/null 2>&1; fi
  if ((UP)); then bash "$NETNS" down >/dev/null 2>&1; fi
}
on_exit cleanup

# Private copies, so pkill -f $TMP/ finds exactly our processes.
cp "$RUN" "$TMP/chorusrun" && cp "$WORKER" "$TMP/worker" && cp "$COLLS" "$TMP/test_colls" || exit 1
RUN=$TMP/chorusrun WORKER=$TMP/worker COLLS=$TMP/test_colls
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key
unset CHORUS_JOB_SECRET RANK WORLD_SIZE MASTER_ADDR MASTER_PORT

fail_details() {
  for f in "$TMP"/h*.out; do
    [ -e "$f" ] || continue
    echo "---- $(basename "$f") (last 25 lines):"; tail -n 25 "$f" | cut -c1-300
  done
  echo "----"
}

out=$(bash "$NETNS" up 4 2>&1)
rc=$?
if ((rc == 77)); then echo "SKIPPED: $(tail -n 1 <<<"$out")"; exit 77; fi
if ((rc != 0)); then echo "FAIL cannot make emulated hosts: $out"; exit 1; fi
UP=1
for i in 0 1 2 3; do ADDR[i]=$(bash "$NETNS" addr "$i"); done
PORT=29400

# agent I ARGS...: starts chorusrun in host I in the background, output in
# $TMP/hI.out, its pid in $TMP/hI.pid (agent_wait bounds it).
agent() {
  local i=$1
  shift
  rm -f "$TMP/h$i.rc"
  # The subshell (which does not exec) keeps bash from reporting "Killed"
  # when a case SIGKILLs the agent.
  (bash "$NETNS" exec "$i" bash -c 'echo $$ >"$1"; shift; exec "$@"' _ \
    "$TMP/h$i.pid" "$RUN" "$@" >"$TMP/h$i.out" 2>&1 </dev/null; exit $?) &
  AGENT[i]=$!
}
# agent_wait I: waits (at most 90 s, then SIGKILL: rc 137) for agent I,
# sets RCS[I].
agent_wait() {
  local end=$((SECONDS + 90))
  while kill -0 "${AGENT[$1]}" 2>/dev/null && ((SECONDS < end)); do sleep 0.05; done
  if kill -0 "${AGENT[$1]}" 2>/dev/null; then
    echo "agent $1 still running after 90 s: killing it"
    kill -KILL "$(cat "$TMP/h$1.pid")" 2>/dev/null
  fi
  wait "${AGENT[$1]}" 2>/dev/null
  RCS[$1]=$?
}
# wait_for FILE PATTERN COUNT SECONDS: until COUNT lines match.
wait_for() {
  local end=$((SECONDS + $4))
  while ((SECONDS < end)); do
    (($(grep -c -- "$2" "$1" 2>/dev/null) >= $3)) && return 0
    sleep 0.05
  done
  return 1
}
fresh() { PORT=$((PORT + 1)); rm -f "$TMP"/h*.out; RCS=(); }
c10d() { echo --rdzv-backend c10d --rdzv-endpoint "${ADDR[0]}:$PORT" --rdzv-id "$1"; }

# ------------------------------------------------------------------- cases

case_c10d() {
  fresh
  for i in 0 1; do agent "$i" --nnodes 2 -n 2 $(c10d c10d) "$WORKER" env; done
  for i in 0 1; do agent_wait "$i"; done
  local ranks
  ranks=$(cat "$TMP"/h0.out "$TMP"/h1.out | sed -n 's/^\[rank[0-9]*\]:RANK=//p' | sort -n | tr '\n' ' ')
  if [[ ${RCS[0]} == 0 && ${RCS[1]} == 0 && $ranks == "0 1 2 3 " ]] &&
    grep -q '^\[rank3\]:GROUP_RANK=1$' "$TMP"/h*.out &&
    grep -q '^\[rank3\]:WORLD_SIZE=4$' "$TMP"/h*.out &&
    grep -q '^\[rank3\]:LOCAL_RANK=1$' "$TMP"/h*.out &&
    grep -q '^\[rank3\]:GROUP_WORLD_SIZE=2$' "$TMP"/h*.out &&
    grep -q "^\[rank3\]:MASTER_ADDR=${ADDR[0]}$" "$TMP"/h*.out &&
    grep -q '^\[rank3\]:TORCHELASTIC_RUN_ID=c10d$' "$TMP"/h*.out; then
    ok "c10d: 2 hosts x 2 workers got ranks $ranks and the contract"
  else
    fail "c10d: ranks '$ranks', rc ${RCS[0]} ${RCS[1]}"
  fi
  fresh
  local t0=$(now_ms)
  for i in 0 1; do agent "$i" --nnodes 2 -n 2 $(c10d colls) "$COLLS"; done
  for i in 0 1; do agent_wait "$i"; done
  # Rank 0 prints the summary, and c10d numbers the nodes in the order they
  # joined: it may be on either host.
  if [[ ${RCS[0]} == 0 && ${RCS[1]} == 0 ]] && grep -q ' passed, 0 failed' "$TMP/h0.out" "$TMP/h1.out"; then
    ok "c10d: every collective passed across 2 hosts ($(($(now_ms) - t0)) ms)"
  else
    fail "c10d: test_colls across hosts, rc ${RCS[0]} ${RCS[1]}"
  fi
}

case_static() {
  fresh
  for i in 0 1 2; do
    agent "$i" --nnodes 3 --node-rank $((2 - i)) --master-addr "${ADDR[2]}" --master-port "$PORT" \
      -n 1 --rdzv-id static "$WORKER" env
  done
  for i in 0 1 2; do agent_wait "$i"; done
  if [[ ${RCS[0]}${RCS[1]}${RCS[2]} == 000 ]] && grep -q '^\[rank0\]:RANK=0$' "$TMP/h2.out" &&
    grep -q '^\[rank2\]:GROUP_RANK=2$' "$TMP/h0.out" && grep -q '^\[rank1\]:RANK=1$' "$TMP/h1.out"; then
    ok "static: --node-rank K gave host K's worker rank K (3 hosts)"
  else
    fail "static: rc ${RCS[*]}"
  fi
}

case_lastcall() {
  fresh
  local t0=$(now_ms) conf=--rdzv-conf=last_call_timeout=1.5
  for i in 0 1; do agent "$i" --nnodes 2:3 $conf -n 1 $(c10d lc2) "$WORKER" round-wait 0; done
  for i in 0 1; do agent_wait "$i"; done
  local ms=$(($(now_ms) - t0))
  if [[ ${RCS[0]}${RCS[1]} == 00 ]] && grep -q 'world 2 node' "$TMP/h1.out" && ((ms >= 1500)); then
    ok "lastcall: 2 of 2:3 hosts started after the last call (${ms} ms, last call 1.5 s)"
  else
    fail "lastcall: 2 hosts, rc ${RCS[0]} ${RCS[1]}, ${ms} ms"
  fi
  fresh
  t0=$(now_ms)
  for i in 0 1 2; do agent "$i" --nnodes 2:3 --rdzv-conf=last_call_timeout=30 -n 1 $(c10d lc3) "$WORKER" round-wait 0; done
  for i in 0 1 2; do agent_wait "$i"; done
  ms=$(($(now_ms) - t0))
  if [[ ${RCS[0]}${RCS[1]}${RCS[2]} == 000 ]] && grep -q 'world 3 node' "$TMP/h2.out" && ((ms < 10000)); then
    ok "lastcall: 3 of 2:3 hosts started at once (${ms} ms, last call 30 s)"
  else
    fail "lastcall: 3 hosts, rc ${RCS[*]}, ${ms} ms"
  fi
}

# The newest start line's time of every rank in round R (max), or empty.
last_start() { cat "$TMP"/h*.out | sed -n "s/^\[rank[0-9]*\]:rank[0-9]* start round $1 .* at //p" | sort -n | tail -n 1; }

case_worker() {
  fresh
  for i in 0 1 2 3; do agent "$i" --nnodes 4 --max-restarts 1 -n 2 $(c10d worker) "$WORKER" round-wait 1; done
  if ! wait_for "$TMP/h2.out" 'start round 0' 2 30; then fail "worker: round 0 did not start"; return; fi
  for i in 0 1 3; do wait_for "$TMP/h$i.out" 'start round 0' 2 30; done
  local victim t0
  victim=$(sed -n 's/^\[rank[0-9]*\]:rank5 start round 0 .* pid \([0-9]*\) .*/\1/p' "$TMP"/h*.out | head -n 1)
  t0=$(now_ms)
  kill -KILL "$victim"
  for i in 0 1 2 3; do agent_wait "$i"; done
  local t1 done_n
  t1=$(last_start 1)
  done_n=$(cat "$TMP"/h*.out | grep -c 'done round 1 world 8')
  if [[ ${RCS[*]} == "0 0 0 0" && $done_n == 8 ]] &&
    grep -q 'root cause of round 0: rank 5 .* killed by SIGKILL' "$TMP/h0.out" &&
    grep -q 'root cause of round 0: rank 5 .* killed by SIGKILL' "$TMP/h3.out"; then
    ok "worker: rank 5 SIGKILLed; every host named it and restarted; all 8 workers running again $((t1 - t0)) ms after the kill"
  else
    fail "worker: rc ${RCS[*]}, $done_n of 8 finished round 1"
  fi
}

case_agent() {
  fresh
  for i in 0 1 2; do
    agent "$i" --nnodes 2:3 --max-restarts 2 -n 1 $(c10d agent) "$WORKER" round-wait 1
  done
  for i in 0 1 2; do wait_for "$TMP/h$i.out" 'start round 0' 1 30; done
  local t0=$(now_ms)
  kill -KILL "$(cat "$TMP/h2.pid")"
  for i in 0 1; do agent_wait "$i"; done
  agent_wait 2
  local seen
  seen=$(grep -h -o 'was lost: no heartbeat for [0-9.]* s' "$TMP/h0.out" "$TMP/h1.out" | head -n 1)
  if [[ ${RCS[0]}${RCS[1]} == 00 ]] && grep -q 'done round 1 world 2' "$TMP/h0.out" &&
    grep -q 'done round 1 world 2' "$TMP/h1.out" && [[ -n $seen ]]; then
    ok "agent: host 2's agent SIGKILLed; the others re-formed as 2 nodes and finished ($seen; first restart $(($(last_start 1) - t0)) ms after the kill)"
  else
    fail "agent: rc ${RCS[0]} ${RCS[1]}"
  fi
}

case_link() {
  fresh
  for i in 0 1 2; do
    agent "$i" --nnodes 2:3 --max-restarts 1 -n 1 $(c10d link) "$WORKER" reduce-loop 1
  done
  for i in 0 1 2; do wait_for "$TMP/h$i.out" 'reducing round 0' 1 30; done
  sleep 0.3
  local t0=$(now_ms)
  bash "$NETNS" link 2 down
  for i in 0 1 2; do agent_wait "$i"; done
  local ms=$(($(now_ms) - t0))
  bash "$NETNS" link 2 up
  local seen
  seen=$(grep -h -o 'was lost: no heartbeat for [0-9.]* s' "$TMP/h0.out" "$TMP/h1.out" | head -n 1)
  if [[ ${RCS[0]}${RCS[1]} == 00 && ${RCS[2]} == 1 ]] && [[ -n $seen ]] &&
    grep -q 'done round 1 world 2' "$TMP/h0.out" && grep -q 'lost the rendezvous store' "$TMP/h2.out" &&
    grep -q "root cause of round 0: node [0-9] (${ADDR[2]}/[0-9]*) was lost" "$TMP/h0.out" &&
    grep -q "root cause of round 0: node [0-9] (${ADDR[2]}/[0-9]*) was lost" "$TMP/h1.out"; then
    ok "link: host 2 unplugged mid-all_reduce; the others re-formed as 2 and finished ($seen; all agents done ${ms} ms after the unplug); host 2's agent lost the store and exited"
  else
    fail "link: rc ${RCS[*]}"
  fi
}

case_grow() {
  fresh
  for i in 0 1; do
    agent "$i" --nnodes 2:3 --rdzv-conf=last_call_timeout=0.5 -n 1 $(c10d grow) "$WORKER" round-wait 1
  done
  for i in 0 1; do wait_for "$TMP/h$i.out" 'start round 0 world 2' 1 30; done
  local t0=$(now_ms)
  agent 2 --nnodes 2:3 --rdzv-conf=last_call_timeout=0.5 -n 1 $(c10d grow) "$WORKER" round-wait 1
  for i in 0 1 2; do agent_wait "$i"; done
  if [[ ${RCS[0]}${RCS[1]}${RCS[2]} == 000 ]] && grep -q 'done round 1 world 3' "$TMP/h2.out" &&
    grep -q 'done round 1 world 3' "$TMP/h0.out"; then
    ok "grow: a third host joined a running 2-host job; it re-formed as 3 ($(($(last_start 1) - t0)) ms)"
  else
    fail "grow: rc ${RCS[*]}"
  fi
}

case_store() {
  fresh
  for i in 0 1 2; do agent "$i" --nnodes 3 --max-restarts 3 -n 1 $(c10d store) "$WORKER" round-wait 9; done
  for i in 0 1 2; do wait_for "$TMP/h$i.out" 'start round 0' 1 30; done
  local t0=$(now_ms) ms
  kill -KILL "$(cat "$TMP/h0.pid")"
  for i in 1 2; do agent_wait "$i"; done
  ms=$(($(now_ms) - t0))
  if [[ ${RCS[1]} == 1 && ${RCS[2]} == 1 ]] && grep -q 'lost the rendezvous store' "$TMP/h1.out" &&
    grep -q 'lost the rendezvous store' "$TMP/h2.out" && ((ms < 10000)); then
    ok "store: the store's host SIGKILLed; both other nodes failed naming it in ${ms} ms"
  else
    fail "store: rc ${RCS[1]} ${RCS[2]} after ${ms} ms"
  fi
  agent_wait 0
  [ -n "${DEBUG_NODES:-}" ] && cat "$TMP/h1.out"
}

case_signal() {
  fresh
  for i in 0 1 2; do agent "$i" --nnodes 3 --max-restarts 3 -n 1 $(c10d sig) "$WORKER" round-wait 9; done
  for i in 0 1 2; do wait_for "$TMP/h$i.out" 'start round 0' 1 30; done
  local t0=$(now_ms) ms
  kill -TERM "$(cat "$TMP/h1.pid")"
  for i in 0 1 2; do agent_wait "$i"; done
  ms=$(($(now_ms) - t0))
  if [[ ${RCS[*]} == "143 143 143" ]] && grep -q 'the job ends: node .* got SIGTERM' "$TMP/h0.out" &&
    grep -q 'the job ends: node .* got SIGTERM' "$TMP/h2.out"; then
    ok "signal: SIGTERM to one agent stopped all 3 nodes (exit 143) in ${ms} ms"
  else
    fail "signal: rc ${RCS[*]} after ${ms} ms"
  fi
}

case_etcd() {
  fresh
  # etcd listens on host 3's address, inside host 3's namespace.
  export CHORUS_ETCD_DIR=$TMP/etcd CHORUS_ETCD_MEMBERS=3 CHORUS_ETCD_PORT=24990
  export CHORUS_ETCD_ADDR=${ADDR[3]}
  local out rc
  out=$(bash "$NETNS" exec 3 bash "$ETCD" up 2>&1)
  rc=$?
  if ((rc == 77)); then echo "skip etcd: $(tail -n 1 <<<"$out")"; return; fi
  ETCD_UP=1
  if ((rc != 0)); then fail "etcd: fixture up: $(tail -n 1 <<<"$out")"; return; fi
  local ep="${ADDR[3]}:24990,${ADDR[3]}:24991,${ADDR[3]}:24992"
  for i in 0 1 2; do
    agent "$i" --nnodes 3 --max-restarts 1 -n 1 --rdzv-backend etcd --rdzv-endpoint "$ep" \
      --rdzv-id "etcd$$" "$WORKER" round-wait 1
  done
  for i in 0 1 2; do wait_for "$TMP/h$i.out" 'start round 0' 1 30; done
  local ranks
  ranks=$(cat "$TMP"/h*.out | sed -n 's/^\[rank\([0-9]*\)\]:rank[0-9]* start round 0 .*/\1/p' | sort -n | tr '\n' ' ')
  [[ $ranks == "0 1 2 " ]] && ok "etcd: 3 hosts met through a 3-member etcd (ranks $ranks)" ||
    fail "etcd: round 0 ranks '$ranks'"
  bash "$ETCD" kill-member 0 >/dev/null 2>&1
  sleep 3
  if grep -q 're-forms\|lost' "$TMP"/h*.out; then fail "etcd: killing one etcd member disturbed the job"
  else ok "etcd: one etcd member SIGKILLed, 3 s later nothing noticed"; fi
  local victim t0
  victim=$(sed -n 's/^\[rank[0-9]*\]:rank1 start round 0 .* pid \([0-9]*\) .*/\1/p' "$TMP"/h*.out | head -n 1)
  t0=$(now_ms)
  kill -KILL "$victim"
  for i in 0 1 2; do agent_wait "$i"; done
  if [[ ${RCS[*]} == "0 0 0" ]] && [[ $(cat "$TMP"/h*.out | grep -c 'done round 1 world 3') == 3 ]]; then
    ok "etcd: a worker SIGKILLed; all 3 hosts re-formed through the 2 etcd members left ($(($(last_start 1) - t0)) ms to all running)"
  else
    fail "etcd: rc ${RCS[*]}"
  fi
  bash "$ETCD" down >/dev/null 2>&1
  ETCD_UP=0
  unset CHORUS_ETCD_DIR CHORUS_ETCD_MEMBERS CHORUS_ETCD_PORT CHORUS_ETCD_ADDR
}

case_bad() {
  fresh
  agent 0 --nnodes 2 -n 1 $(c10d bad) "$WORKER" round-wait 0
  sleep 0.3
  # Garbage on the store's port, then a stranger with another secret.
  bash "$NETNS" exec 1 bash -c "exec 3<>/dev/tcp/${ADDR[0]}/$PORT; head -c 5000 /dev/urandom >&3; exec 3>&-" 2>/dev/null
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key2" && chmod 600 "$TMP/key2"
  CHORUS_JOB_SECRET_FILE=$TMP/key2 agent 2 --nnodes 2 -n 1 $(c10d bad) "$WORKER" round-wait 0
  agent_wait 2
  if [[ ${RCS[2]} == 1 ]] && grep -q 'refused this node' "$TMP/h2.out"; then
    ok "bad: a node with another secret is refused ($(grep -o 'refused this node.\{0,40\}' "$TMP/h2.out" | head -n 1))"
  else
    fail "bad: stranger rc ${RCS[2]}"
  fi
  agent 3 --nnodes 2:4 -n 1 $(c10d bad) "$WORKER" round-wait 0
  agent_wait 3
  if [[ ${RCS[3]} == 2 ]] && grep -q 'give every node the same' "$TMP/h3.out"; then
    ok "bad: a node with another --nnodes is refused"
  else
    fail "bad: conflicting --nnodes rc ${RCS[3]}"
  fi
  agent 1 --nnodes 2 -n 1 $(c10d bad) "$WORKER" round-wait 0
  for i in 0 1; do agent_wait "$i"; done
  if [[ ${RCS[0]}${RCS[1]} == 00 ]] && grep -q 'done round 0 world 2' "$TMP/h1.out"; then
    ok "bad: after all that the real second node joined and the job finished"
  else
    fail "bad: rc ${RCS[0]} ${RCS[1]}"
  fi
}

for c in $CASES; do "case_$c"; done
summary "all checks passed" "check(s) failed"
