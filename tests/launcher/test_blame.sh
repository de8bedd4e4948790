#!/usr/bin/env bash
# Whom chorusrun blames when a group fails: the root cause, not the first
# survivor it happens to reap.
#   1. Over TCP, rank 1 of 3 is SIGKILLed while chorusrun is paused
#      (SIGSTOP), so that the survivors -- who see the connection close and
#      exit 2 -- are zombies beside it when it reaps them all at once (as on
#      a loaded machine); waitpid hands the oldest child, rank 0, out first.
#      The report must name rank 1, killed by signal 9, and the job's exit
#      code be 137.
#   2. Rank 1 SIGSTOPs itself; the others time out (CHORUS_TIMEOUT=2) naming
#      it.  The report must name rank 1 as stopped, not the first rank that
#      timed out; the exit code is the timed-out ranks' 2.
#   3. Rank 1 stays alive but sleeps in its own code: every timeout names it,
#      and so must the report.
#   test_blame.sh CHORUSRUN LAUNCH_WORKER
set -u
. "$(dirname "$0")/../lib.sh"
run=$1 worker=$2
tmp_dir blame
cp "$worker" "$TMP/launch_worker" && worker=$TMP/launch_worker || exit 1
agent= cr=
on_exit '[ -n "$cr" ] && kill -CONT "$cr" 2>/dev/null; pkill -9 -f "$TMP/" 2>/dev/null'
rank_pid() { # RANK: the pid of our worker of that rank
  local p
  for p in $(pgrep -f "$TMP/launch_worker"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return; }
  done
}
state() { sed 's/.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null; }

# 1. SIGKILL over TCP, reaped together.
CHORUS_TRANSPORT=tcp CHORUS_TIMEOUT=20 timeout 60 "$run" --standalone -n 3 -- \
  "$worker" culprit -1 none >"$TMP/kill.log" 2>&1 &
agent=$!
for _ in $(seq 200); do grep -q "rank0 at step 20" "$TMP/kill.log" && break; sleep 0.05; done
p0=$(rank_pid 0) p1=$(rank_pid 1) p2=$(rank_pid 2)
if [ -z "$p0" ] || [ -z "$p1" ] || [ -z "$p2" ]; then fail "the workers did not start"; cat "$TMP/kill.log"
else
  cr=$(pgrep -P "$agent" -x chorusrun) # timeout's child
  kill -STOP "$cr"
  kill -9 "$p1"
  for _ in $(seq 200); do [ "$(state "$p0")" = Z ] && [ "$(state "$p2")" = Z ] && break; sleep 0.05; done
  [ "$(state "$p0")" = Z ] && [ "$(state "$p2")" = Z ] || fail "the survivors did not exit by themselves"
  kill -CONT "$cr"
fi
wait "$agent"
rc=$?
agent= cr=
if grep -q "^chorusrun: rank 1 (pid $p1) failed: killed by signal 9" "$TMP/kill.log" &&
   ! grep -q "^chorusrun: rank [02] .*failed" "$TMP/kill.log" && [ "$rc" -eq 137 ]; then
  ok "a SIGKILLed rank is blamed, not a survivor reaped first (exit $rc)"
else fail "SIGKILL over TCP: exit $rc; $(grep '^chorusrun' "$TMP/kill.log" | head -n 3)"; fi

# 2. A stopped rank.
CHORUS_TIMEOUT=2 timeout 60 "$run" --standalone -n 3 -- "$worker" culprit 1 stop \
  >"$TMP/stop.log" 2>&1
rc=$?
if grep -q "^chorusrun: rank 1 (pid [0-9]*) failed: it was stopped" "$TMP/stop.log" &&
   grep -q "timed out after .* rank 1" "$TMP/stop.log" && [ "$rc" -eq 2 ]; then
  ok "a stopped rank the others timed out on is blamed (exit $rc)"
else fail "SIGSTOP: exit $rc; $(grep '^chorusrun' "$TMP/stop.log" | head -n 3)"; fi

# 3. A rank alive but stuck in its own code: every timeout names it.
CHORUS_TIMEOUT=2 timeout 60 "$run" --standalone -n 3 -- "$worker" culprit 1 busy \
  >"$TMP/busy.log" 2>&1
rc=$?
if grep -q "^chorusrun: rank 1 (pid [0-9]*) failed: the others timed out waiting for it" \
     "$TMP/busy.log" && [ "$rc" -eq 2 ]; then
  ok "a busy rank every timeout names is blamed (exit $rc)"
else fail "busy: exit $rc; $(grep '^chorusrun' "$TMP/busy.log" | head -n 3)"; fi

summary "chorusrun blames the root cause" "blame check(s) FAILED"
