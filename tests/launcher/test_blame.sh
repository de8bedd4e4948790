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
run=$1 worker=$2
tmp=$(mktemp -d /tmp/chorus-blame.XXXXXX)
cp "$worker" "$tmp/launch_worker" && worker=$tmp/launch_worker || exit 1
agent= cr=
trap '[ -n "$cr" ] && kill -CONT "$cr" 2>/dev/null; pkill -9 -f "$tmp/" 2>/dev/null; rm -rf "$tmp"' EXIT
fails=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fails=$((fails + 1)); }
rank_pid() { # RANK: the pid of our worker of that rank
  local p
  for p in $(pgrep -f "$tmp/launch_worker"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return; }
  done
}
state() { sed 's/.*) \(.\).*/\1/' "/proc/$1/stat" 2>/dev/null; }

# 1. SIGKILL over TCP, reaped together.
CHORUS_TRANSPORT=tcp CHORUS_TIMEOUT=20 timeout 60 "$run" --standalone -n 3 -- \
  "$worker" culprit -1 none >"$tmp/kill.log" 2>&1 &
agent=$!
for _ in $(seq 200); do grep -q "rank0 at step 20" "$tmp/kill.log" && break; sleep 0.05; done
p0=$(rank_pid 0) p1=$(rank_pid 1) p2=$(rank_pid 2)
if [ -z "$p0" ] || [ -z "$p1" ] || [ -z "$p2" ]; then bad "the workers did not start"; cat "$tmp/kill.log"
else
  cr=$(pgrep -P "$agent" -x chorusrun) # timeout's child
  kill -STOP "$cr"
  kill -9 "$p1"
  for _ in $(seq 200); do [ "$(state "$p0")" = Z ] && [ "$(state "$p2")" = Z ] && break; sleep 0.05; done
  [ "$(state "$p0")" = Z ] && [ "$(state "$p2")" = Z ] || bad "the survivors did not exit by themselves"
  kill -CONT "$cr"
fi
wait "$agent"
rc=$?
agent= cr=
if grep -q "^chorusrun: rank 1 (pid $p1) failed: killed by signal 9" "$tmp/kill.log" &&
   ! grep -q "^chorusrun: rank [02] .*failed" "$tmp/kill.log" && [ "$rc" -eq 137 ]; then
  ok "a SIGKILLed rank is blamed, not a survivor reaped first (exit $rc)"
else bad "SIGKILL over TCP: exit $rc; $(grep '^chorusrun' "$tmp/kill.log" | head -n 3)"; fi

# 2. A stopped rank.
CHORUS_TIMEOUT=2 timeout 60 "$run" --standalone -n 3 -- "$worker" culprit 1 stop \
  >"$tmp/stop.log" 2>&1
rc=$?
if grep -q "^chorusrun: rank 1 (pid [0-9]*) failed: it was stopped" "$tmp/stop.log" &&
   grep -q "timed out after .* rank 1" "$tmp/stop.log" && [ "$rc" -eq 2 ]; then
  ok "a stopped rank the others timed out on is blamed (exit $rc)"
else bad "SIGSTOP: exit $rc; $(grep '^chorusrun' "$tmp/stop.log" | head -n 3)"; fi

# 3. A rank alive but stuck in its own code: every timeout names it.
CHORUS_TIMEOUT=2 timeout 60 "$run" --standalone -n 3 -- "$worker" culprit 1 busy \
  >"$tmp/busy.log" 2>&1
rc=$?
if grep -q "^chorusrun: rank 1 (pid [0-9]*) failed: the others timed out waiting for it" \
     "$tmp/busy.log" && [ "$rc" -eq 2 ]; then
  ok "a busy rank every timeout names is blamed (exit $rc)"
else bad "busy: exit $rc; $(grep '^chorusrun' "$tmp/busy.log" | head -n 3)"; fi

[ "$fails" -eq 0 ] && echo "chorusrun blames the root cause" && exit 0
echo "$fails blame check(s) FAILED"; exit 1
