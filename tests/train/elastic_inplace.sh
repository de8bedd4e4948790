#!/usr/bin/env bash
# chorus-train --elastic inplace on emulated hosts (tests/fixtures/netns.sh),
# one worker each, chorusrun's c10d rendezvous on every host.
#   elastic_inplace.sh CHORUSRUN CHORUS_TRAIN CMP_WEIGHTS DATA FIXTURES_DIR [ddp|shards]
# ddp (the default), 3 hosts:
#   1. a worker on a random host is SIGKILLed at a random moment (after a
#      random step was logged: mid-step, mid-all_reduce or between steps);
#      the two survivors shrink, re-shard the data and finish the run;
#   2. the reference: the same job without a death stopped after the step
#      the survivors went on from (a checkpoint), resumed on 2 hosts;
#   3. the survivors' final weights must equal the reference's bit for bit
#      (with 2 ranks every all_reduce algorithm adds the same two numbers),
#      and differ from those of the uninterrupted 3-host run (so the check
#      can fail);
#   4. a random host other than the store's unplugged after a random step:
#      the other two see it go silent and finish in place;
#   5. a third host arrives while 2 train (--nnodes 2:3): it is admitted into
#      the running job, which grows to 3 ranks; the weights equal a run
#      that switched from 2 to 3 hosts at the step it joined.
# shards, 4 hosts, sharded (--shard; each rank's replica on the next host):
#   1. stage 3: a random worker SIGKILLed at a random moment; the three
#      survivors rebuild its shard from the replica, re-shard over 3 and
#      finish; weights bit-identical to a checkpoint at the agreed step
#      resumed on 3 hosts (a different world from step M on: the ddp run
#      shows such a comparison can fail);
#   2. a random stage (1 or 2): a random host other than the store's
#      unplugged; the same comparison;
#   3. a random stage (1-3): a fourth host arrives while 3 train
#      (--nnodes 3:4); the model is re-sharded over 4; the weights equal a
#      run that switched from 3 to 4 hosts at that step;
#   4. a random stage (1-3): a worker and the one keeping its replica
#      SIGKILLed together: the shard is gone from memory, so the two
#      survivors go on from the last checkpoint, and say why; the weights
#      equal that checkpoint resumed on 2 hosts.
#   5. mirrored parameter servers (--mode async --servers 2 --mirror,
#      S = 0, 2 workers): the host of a server other than the store's
#      unplugged after a random step; the other server takes its range
#      over, the workers send it there, the job applies its whole budget and
#      ends at the weights of the run nobody unplugged, bit for bit.
# Needs root (network namespaces); exits 77 (skipped, reason printed) when the
# fixture cannot make hosts.  The EXIT trap kills what it started and removes
# the hosts.
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 TRAIN=$2 CMP=$3 DATA=$4 FIXTURES=$5 MODE=${6:-ddp}
. "$FIXTURES/hosts_test.sh"
hosts_test_begin "el$MODE"

# Private copies, so pkill -f $TMP/ finds exactly our processes.
cp "$RUN" "$TMP/chorusrun" && cp "$TRAIN" "$TMP/chorus-train" || exit 1
RUN=$TMP/chorusrun TRAIN=$TMP/chorus-train
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key OPENBLAS_NUM_THREADS=1
unset CHORUS_JOB_SECRET RANK WORLD_SIZE MASTER_ADDR MASTER_PORT

STEPS=40
[[ $MODE == shards ]] && STEPS=24
MODEL=(--data "$DATA" --layers 2 --heads 4 --channels 128 --ctx 64 --batch 8 --steps "$STEPS"
       --warmup 5 --val-every 0 --sample 0 --log-every 1 --threads 1)
fail_details() {
  for f in "$TMP"/*.out; do
    [ -e "$f" ] || continue
    echo "---- $(basename "$f") (last 15 lines):"; tail -n 15 "$f" | cut -c1-300
  done
}

# job NAME NHOSTS PORT [chorusrun args --] chorus-train args: one agent per
# host in the background (--nnodes NHOSTS, or $NNODES); outputs in
# $TMP/NAME.hI.out, pids in PIDS[].
job() {
  local name=$1 n=$2 port=$3
  shift 3
  local pre=()
  while (($#)) && [[ $1 != -- ]]; do pre+=("$1"); shift; done
  (($#)) && shift
  PIDS=()
  for ((i = 0; i < n; i++)); do
    (bash "$NETNS" exec "$i" bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$TMP/$name.h$i.pid" \
      "$RUN" --nnodes "${NNODES:-$n}" -n 1 --rdzv-backend c10d --rdzv-endpoint "${ADDR[0]}:$port" \
      --rdzv-id "$name" "${pre[@]}" "$TRAIN" "${MODEL[@]}" "$@" \
      >"$TMP/$name.h$i.out" 2>&1 </dev/null; exit $?) &
    PIDS[i]=$!
  done
}
# job_wait: waits (at most 120 s, then SIGKILL) for the agents of the last
# job; RCS[] gets their exit codes.
job_wait() {
  local end=$((SECONDS + 120)) i
  RCS=()
  for i in "${!PIDS[@]}"; do
    while kill -0 "${PIDS[i]}" 2>/dev/null && ((SECONDS < end)); do sleep 0.05; done
    kill -0 "${PIDS[i]}" 2>/dev/null && { echo "agent $i still running after 120 s"; kill -KILL "${PIDS[i]}"; }
    wait "${PIDS[i]}" 2>/dev/null
    RCS[i]=$?
  done
}

# wait_logged NAME STEP: until a host of job NAME logged STEP (60 s at most).
wait_logged() {
  local end=$((SECONDS + 60))
  until grep -qE "step +$2/$STEPS" "$TMP"/$1.h*.out 2>/dev/null || ((SECONDS >= end)); do
    sleep 0.01
  done
}
# kill_worker NAME HOST: SIGKILLs the worker of job NAME on HOST.
kill_worker() {
  local agent worker
  agent=$(cat "$TMP/$1.h$2.pid" 2>/dev/null)
  worker=$(pgrep -P "$agent" -f "^$TMP/chorus-train " 2>/dev/null | head -n 1)
  if [[ -z $worker ]]; then
    fail "could not find host $2's worker of job $1"
    return 1
  fi
  echo "killing pid $worker ($(tr "\0" " " </proc/$worker/cmdline 2>/dev/null | cut -c1-80)) of agent $agent"
  kill -KILL "$worker"
}
# rank_worker NAME RANK: the pid of job NAME's worker of that rank ("" if
# none); RANK_HOST is set to its host.
rank_worker() {
  local i agent w
  RANK_HOST=
  for i in "${!PIDS[@]}"; do
    agent=$(cat "$TMP/$1.h$i.pid" 2>/dev/null)
    for w in $(pgrep -P "$agent" -f "^$TMP/chorus-train " 2>/dev/null); do
      tr '\0' '\n' <"/proc/$w/environ" 2>/dev/null | grep -qx "RANK=$2" && RANK_HOST=$i &&
        echo "$w" && return
    done
  done
}
# reference WHAT NAME PORT N1 N2 M STAGE: the run NAME must equal, bit for
# bit, a reference that checkpointed after step M on N1 hosts and resumed
# on N2 (ports PORT and PORT + 1).
reference() {
  local what=$1 name=$2 port=$3 n1=$4 n2=$5 m=$6 s=$7
  job "${name}r1" "$n1" "$port" -- --shard "$s" --checkpoint-dir "$TMP/${name}ck" --stop-after "$m"
  job_wait
  job "${name}r2" "$n2" $((port + 1)) -- --shard "$s" --checkpoint-dir "$TMP/${name}ck" \
    --dump "$TMP/${name}ref.bin"
  job_wait
  if "$CMP" "$TMP/$name.bin" "$TMP/${name}ref.bin" 0; then
    ok "$what: bit-identical to the reference"
  else
    fail "$what: the weights differ from the reference's"
  fi
}

run_ddp() {
hosts_up 3
# 1. The elastic run: a random host loses its worker after a random step.
VICTIM=$((RANDOM % 3)) AFTER=$((3 + RANDOM % 25))
job el 3 29500 --elastic inplace -- --dump "$TMP/inplace.bin"
wait_logged el "$AFTER"
kill_worker el "$VICTIM"
job_wait
M=$(sed -n 's/.*elastic: 2 of 3 rank(s) go on from step \([0-9]*\) .*/\1/p' "$TMP"/el.h*.out | head -n 1)
echo "host $VICTIM's worker SIGKILLed after step $AFTER was logged; the survivors went on from step ${M:-?}"
grep -h "recovery took\|after the failure was seen" "$TMP"/el.h*.out | sed 's/^/  /'
survivors_ok=1
for i in 0 1 2; do
  ((i == VICTIM)) && continue
  ((RCS[i] == 0)) || survivors_ok=0
done
if ((survivors_ok)) && ((RCS[VICTIM] == 137)) && [[ -n $M ]] && [[ -s $TMP/inplace.bin ]] &&
  grep -q "was killed by SIGKILL\|killed by signal 9" "$TMP/el.h$VICTIM.out"; then
  ok "the survivors finished $STEPS steps in place (agents: ${RCS[*]})"
else
  fail "elastic run: agents ${RCS[*]}, resumed at '${M}'"
fi

if [[ -n $M ]]; then
  # 2. The reference: 3 hosts stopped after step M, then 2 hosts from there.
  job ref1 3 29501 -- --checkpoint-dir "$TMP/ck" --stop-after "$M"
  job_wait
  [[ ${RCS[*]} == "0 0 0" ]] || fail "reference, first part: agents ${RCS[*]}"
  job ref2 2 29502 -- --checkpoint-dir "$TMP/ck" --dump "$TMP/reference.bin"
  job_wait
  [[ ${RCS[*]} == "0 0" ]] || fail "reference, second part: agents ${RCS[*]}"
  if ((M < STEPS)) && ! grep -q "resumed from .*ckpt-$(printf %09d "$M") " "$TMP"/ref2.h*.out; then
    fail "the reference did not resume from step $M"
  fi
  # The uninterrupted run on 3 hosts.
  job straight 3 29503 -- --dump "$TMP/straight.bin"
  job_wait
  [[ ${RCS[*]} == "0 0 0" ]] || fail "uninterrupted run: agents ${RCS[*]}"
  # 3. The comparison.
  if "$CMP" "$TMP/inplace.bin" "$TMP/reference.bin" 0; then
    ok "the survivors' weights equal the reference's bit for bit"
  else
    fail "the survivors' weights differ from the reference's"
  fi
  if ((M < STEPS)) && "$CMP" "$TMP/inplace.bin" "$TMP/straight.bin" 0 >/dev/null 2>&1; then
    fail "the survivors' weights equal the uninterrupted run's: the check cannot tell"
  else
    ok "... and differ from the uninterrupted 3-host run's"
  fi
fi
# 4. A host unplugged (the fixture's link down) after a random step: no
# connection closes, the survivors see it go silent (CHORUS_PEER_TIMEOUT_MS,
# 1.5 s here) and go on without it; its own agent loses the store and stops.
VICTIM=$((RANDOM % 2 + 1)) AFTER=$((3 + RANDOM % 25))
CHORUS_PEER_TIMEOUT_MS=1500 job link 3 29504 --elastic inplace -- --dump "$TMP/link.bin"
wait_logged link "$AFTER"
bash "$NETNS" link "$VICTIM" down >/dev/null
job_wait
bash "$NETNS" link "$VICTIM" up >/dev/null
grep -h "went silent\|recovery took\|after the failure was seen" "$TMP"/link.h*.out | grep -v WARN |
  cut -c1-200 | sed 's/^/  /'
survivors_ok=1
for i in 0 1 2; do
  ((i == VICTIM)) && continue
  ((RCS[i] == 0)) || survivors_ok=0
done
if ((survivors_ok)) && ((RCS[VICTIM] != 0)) && [[ -s $TMP/link.bin ]] &&
  grep -q "elastic: 2 of 3 rank(s) go on" "$TMP"/link.h*.out &&
  grep -q "went silent" "$TMP"/link.h*.out; then
  ok "host $VICTIM unplugged after step $AFTER: the other two finished in place (agents: ${RCS[*]})"
else
  fail "host $VICTIM unplugged after step $AFTER: agents ${RCS[*]}"
fi

# 5. Growing: 2 hosts train (--nnodes 2:3), a third host's agent arrives
# after a random step; it is admitted into the running round, its worker
# joins the running job (chorus_comm_join) and the two take it in
# (chorus_comm_grow) and hand it the state.  The weights must equal those
# of a run that switched from 2 to 3 hosts at that step (a checkpoint).
# The running hosts read each batch 40 ms slowly (--data-delay-ms: timing
# only), so that the job still runs when the third agent, started after step
# AFTER <= 22, is up: at full speed the 40 steps take 0.7 s, and on a loaded
# machine the job had ended before the agent reached the store.
AFTER=$((3 + RANDOM % 20))
NNODES=2:3 job grow 2 29505 --rdzv-conf last_call_timeout=0.2 --elastic inplace -- \
  --dump "$TMP/grow.bin" --data-delay-ms 40
GROW2=("${PIDS[@]}")
wait_logged grow "$AFTER"
(bash "$NETNS" exec 2 "$RUN" --nnodes 2:3 -n 1 --rdzv-backend c10d \
  --rdzv-endpoint "${ADDR[0]}:29505" --rdzv-id grow --elastic inplace "$TRAIN" "${MODEL[@]}" \
  >"$TMP/grow.h2.out" 2>&1 </dev/null; exit $?) &
PIDS=("${GROW2[@]}" $!)
job_wait
G=$(sed -n 's/.*elastic: 1 new rank(s) joined at step \([0-9]*\):.*/\1/p' "$TMP"/grow.h*.out | head -n 1)
echo "host 2 arrived after step $AFTER was logged; it joined at step ${G:-?}"
grep -h "joined\|admitted" "$TMP"/grow.h*.out | cut -c1-200 | sed 's/^/  /'
if [[ ${RCS[*]} == "0 0 0" && -n $G && -s $TMP/grow.bin ]]; then
  ok "the job grew from 2 to 3 hosts in place and finished"
  job gref1 2 29506 -- --checkpoint-dir "$TMP/gck" --stop-after "$G"
  job_wait
  job gref2 3 29507 -- --checkpoint-dir "$TMP/gck" --dump "$TMP/grow-ref.bin"
  job_wait
  if "$CMP" "$TMP/grow.bin" "$TMP/grow-ref.bin" 0; then
    ok "the grown job's weights equal the reference's (2 hosts to step $G, then 3) bit for bit"
  else
    fail "the grown job's weights differ from the reference's"
  fi
else
  fail "growing: agents ${RCS[*]}, joined at '$G'"
fi

}

run_shards() {
hosts_up 4
local S M V W G C
# 1. Stage 3, a random worker SIGKILLed after a random step.
V=$((RANDOM % 4)) AFTER=$((3 + RANDOM % 18))
job sk 4 29510 --elastic inplace -- --shard 3 --dump "$TMP/sk.bin"
wait_logged sk "$AFTER"
kill_worker sk "$V"
job_wait
M=$(sed -n 's/.*elastic: 3 of 4 rank(s) go on from step \([0-9]*\) .*/\1/p' "$TMP"/sk.h*.out | head -n 1)
echo "stage 3: host $V's worker SIGKILLed after step $AFTER was logged; the survivors went on from step ${M:-?}"
grep -h "recovery took\|after the failure was seen" "$TMP"/sk.h*.out | sed 's/^/  /'
if [[ -n $M && -s $TMP/sk.bin ]] && ((RCS[V] == 137)); then
  ok "stage 3: the survivors rebuilt the lost shard and finished on 3 (agents: ${RCS[*]})"
  reference "stage 3, a worker killed" sk 29511 4 3 "$M" 3
else
  fail "stage 3, a worker killed: agents ${RCS[*]}, resumed at '${M}'"
fi

# 2. Stage 1 or 2, a host other than the store's unplugged.
S=$((1 + RANDOM % 2)) V=$((1 + RANDOM % 3)) AFTER=$((3 + RANDOM % 18))
CHORUS_PEER_TIMEOUT_MS=1500 job su 4 29514 --elastic inplace -- --shard "$S" --dump "$TMP/su.bin"
wait_logged su "$AFTER"
bash "$NETNS" link "$V" down >/dev/null
job_wait
bash "$NETNS" link "$V" up >/dev/null
M=$(sed -n 's/.*elastic: 3 of 4 rank(s) go on from step \([0-9]*\) .*/\1/p' "$TMP"/su.h*.out | head -n 1)
echo "stage $S: host $V unplugged after step $AFTER was logged; the others went on from step ${M:-?}"
grep -h "went silent\|recovery took\|after the failure was seen" "$TMP"/su.h*.out | grep -v WARN |
  cut -c1-200 | sed 's/^/  /'
if [[ -n $M && -s $TMP/su.bin ]] && grep -q "went silent" "$TMP"/su.h*.out; then
  ok "stage $S: host $V unplugged: the other three finished in place"
  reference "stage $S, a host unplugged" su 29515 4 3 "$M" "$S"
else
  fail "stage $S, host $V unplugged: agents ${RCS[*]}, resumed at '${M}'"
fi

# 3. A random stage, a fourth host arriving while 3 train.
S=$((1 + RANDOM % 3)) AFTER=$((3 + RANDOM % 14))
NNODES=3:4 job sg 3 29517 --rdzv-conf last_call_timeout=0.2 --elastic inplace -- --shard "$S" \
  --dump "$TMP/sg.bin" --data-delay-ms 40 # as for growing above
local G3=("${PIDS[@]}")
wait_logged sg "$AFTER"
(bash "$NETNS" exec 3 "$RUN" --nnodes 3:4 -n 1 --rdzv-backend c10d \
  --rdzv-endpoint "${ADDR[0]}:29517" --rdzv-id sg --elastic inplace "$TRAIN" "${MODEL[@]}" \
  --shard "$S" --dump "$TMP/sg.bin" >"$TMP/sg.h3.out" 2>&1 </dev/null; exit $?) &
PIDS=("${G3[@]}" $!)
job_wait
G=$(sed -n 's/.*elastic: 1 new rank(s) joined at step \([0-9]*\):.*/\1/p' "$TMP"/sg.h*.out | head -n 1)
echo "stage $S: host 3 arrived after step $AFTER was logged; it joined at step ${G:-?}"
if [[ ${RCS[*]} == "0 0 0 0" && -n $G && -s $TMP/sg.bin ]]; then
  ok "stage $S: the job grew from 3 to 4 hosts in place, re-sharded, and finished"
  reference "stage $S, grown from 3 to 4" sg 29518 3 4 "$G" "$S"
else
  fail "stage $S, growing: agents ${RCS[*]}, joined at '$G'"
fi

# 4. A random stage, a rank and the one keeping its replica (the next
# rank: one per host) killed together: from the last checkpoint (every 5
# steps).
S=$((1 + RANDOM % 3)) V=$((RANDOM % 4)) AFTER=$((6 + RANDOM % 12))
W=$(((V + 1) % 4))
job sd 4 29520 --elastic inplace -- --shard "$S" --checkpoint-dir "$TMP/sdrun" \
  --checkpoint-every 5 --dump "$TMP/sd.bin"
wait_logged sd "$AFTER"
local pv pw
pv=$(rank_worker sd "$V") pw=$(rank_worker sd "$W")
if [[ -n $pv && -n $pw ]]; then kill -KILL "$pv" "$pw"; else fail "ranks $V and $W of job sd not found"; fi
job_wait
C=$(sed -n 's/.*resumed from .*ckpt-0*\([0-9][0-9]*\) .*/\1/p' "$TMP"/sd.h*.out | head -n 1)
echo "stage $S: ranks $V and $W (which kept $V's replica) killed after step $AFTER; the survivors went back to the checkpoint of step ${C:-?}"
grep -h "no longer in memory" "$TMP"/sd.h*.out | head -n 1 | cut -c1-250 | sed 's/^/  /'
if [[ -n $C && -s $TMP/sd.bin ]] && grep -q "no longer in memory" "$TMP"/sd.h*.out &&
  grep -q "elastic: 2 of 4 rank(s) go on" "$TMP"/sd.h*.out; then
  ok "stage $S: shard and replica lost: the two survivors went on from the checkpoint"
  reference "stage $S, a shard and its replica lost" sd 29521 4 2 "$C" "$S"
else
  fail "stage $S, a shard and its replica lost: agents ${RCS[*]}, checkpoint '${C}'"
fi

# 5. Mirrored parameter servers: a server's host unplugged.
local PS=(--mode async --servers 2 --mirror --max-staleness 0)
AFTER=$((3 + RANDOM % 15))
CHORUS_PEER_TIMEOUT_MS=1500 job pu 4 29523 --elastic inplace -- "${PS[@]}" --dump "$TMP/pu.bin"
wait_logged pu "$AFTER"
local R=0 H=
rank_worker pu 0 >/dev/null
((RANK_HOST == 0)) && R=1 && rank_worker pu 1 >/dev/null
H=$RANK_HOST
if [[ -z $H ]]; then
  fail "mirrored servers: could not find server $R's host"
else
  bash "$NETNS" link "$H" down >/dev/null
  job_wait
  bash "$NETNS" link "$H" up >/dev/null
  echo "mirrored servers: server $R's host $H unplugged after step $AFTER was logged"
  grep -h "took its range\|every range answered" "$TMP"/pu.h*.out | cut -c1-200 | sed 's/^/  /'
  local ok_ps=1
  for i in 0 1 2 3; do ((i == H)) || ((RCS[i] == 0)) || ok_ps=0; done
  if ((ok_ps)) && [[ -s $TMP/pu.bin ]] &&
    grep -q "server process $R died; server $((1 - R)) took its range $R over" "$TMP"/pu.h*.out &&
    grep -q "summary: async.* $STEPS update(s) of $((2 * STEPS)) gradient(s) (0 refused" \
      "$TMP"/pu.h*.out; then
    ok "mirrored servers: the other server took the range over, the budget was applied"
    job pr 4 29524 -- "${PS[@]}" --dump "$TMP/pr.bin"
    job_wait
    if "$CMP" "$TMP/pu.bin" "$TMP/pr.bin" 0; then
      ok "mirrored servers, a host unplugged: bit-identical to the run nobody unplugged"
    else
      fail "mirrored servers, a host unplugged: the weights differ from the unplugged-free run's"
    fi
  else
    fail "mirrored servers, server $R's host $H unplugged: agents ${RCS[*]}"
  fi
fi
}

case $MODE in
  ddp) run_ddp ;;
  shards) run_shards ;;
  *) echo "unknown mode $MODE (ddp or shards)"; exit 2 ;;
esac
summary "all elastic checks passed" "elastic check(s) FAILED"
