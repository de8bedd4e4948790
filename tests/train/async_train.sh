#!/usr/bin/env bash
# chorus-train --mode async (parameter servers, bounded staleness):
#   1. --max-staleness 0 with one server, and with two (ranges split), gives
#      DDP's weights on as many ranks (float tolerance: the server adds the
#      gradients in arrival order); unbounded staleness does not (the
#      check can fail);
#   2. one worker 4x slower (--slowdown): async trains more tokens per
#      second than DDP on the same 4 ranks, and its validation loss is
#      below 3.25 after the budget (3 workers x 40 steps x 512 tokens; 5.5
#      at the start) and within 5 % of DDP's on 3 ranks after as many;
#   3. a worker SIGKILLed mid-run is dropped; the others fill the budget
#      and the run reports its final loss; nothing hangs;
#      a worker stopped (SIGSTOP) is dropped once it is declared dead;
#   4. a gradient claiming a version staler than --max-staleness, or
#      holding NaN, is refused (the worker goes on from fresh parameters);
#      one of the wrong size is refused and its worker dropped; the server
#      serves the others;
#   5. a server SIGKILLed mid-run fails every worker fast, saying so;
#      with --mirror it loses nothing: two mirrored servers, S = 0, one of
#      them SIGKILLed at a random moment -- the survivor takes its range
#      over and the weights are bit for bit those of the run nobody killed
#      (itself bit for bit the unmirrored run's); one server and a standby,
#      asynchronous, the server SIGKILLed -- the standby serves on, the
#      budget is applied to the gradient and the gradients the workers
#      heard were applied add up to it; checkpoints go on after the
#      take-over, and a run resumes from them;
#   6. two servers checkpoint their ranges; a run resumed from the first
#      checkpoint ends at the uninterrupted run's weights (S = 0); two
#      asynchronous servers write every checkpoint and resume; DDP resumes
#      from the servers' checkpoint too; --mode async refuses flags it does
#      not support.
#   async_train.sh CHORUSRUN CHORUS_TRAIN CMP_WEIGHTS DATA SANITIZER
# Every run is bounded by timeout; the EXIT trap kills what is left.
set -u
. "$(dirname "$0")/../lib.sh"
run=$1 train=$2 cmp=$3 data=$4 sanitizer=${5:-}
tmp_dir async
on_exit 'pkill -9 -f "$TMP/" 2>/dev/null'
# A private copy, so that pkill -f "$TMP/" finds exactly our processes.
cp "$train" "$TMP/chorus-train" && train=$TMP/chorus-train || exit 1
model=(--layers 2 --heads 4 --channels 64 --ctx 64 --batch 8 --warmup 5 --sample 0
       --log-every 10 --threads 1 --data "$data")
# A sanitizer build looks for memory errors and races in the servers and
# workers, which a smaller model exercises the same way (no check below but
# part 2's, skipped there, depends on the model's size).
[ -n "$sanitizer" ] && model=(--layers 1 --heads 2 --channels 32 --ctx 32 --batch 4 --warmup 5
                              --sample 0 --log-every 10 --threads 1 --data "$data")
train_run() { # NAME RANKS [chorusrun args --] [chorus-train args...]: must succeed
  local name=$1 n=$2
  shift 2
  local pre=()
  while (($#)) && [[ $1 != -- ]]; do pre+=("$1"); shift; done
  if (($#)); then shift; else set -- "${pre[@]}"; pre=(); fi
  if ! timeout 240 "$run" --standalone -n "$n" "${pre[@]}" -- "$train" "${model[@]}" "$@" \
      >"$TMP/$name.log" 2>&1; then
    fail "$name: the run failed"; tail -n 8 "$TMP/$name.log" | cut -c1-300
  fi
}
has() { # WHAT LOG PATTERN
  if grep -q -- "$3" "$TMP/$2.log"; then ok "$1"; else fail "$1"; tail -n 6 "$TMP/$2.log" | cut -c1-300; fi
}
same() { # WHAT A B TOL
  if "$cmp" "$TMP/$2" "$TMP/$3" "$4"; then ok "$1"; else fail "$1"; fi
}
num() { sed -n "s/$2/\1/p" "$TMP/$1.log" | tail -n 1; }
wait_log() { # LOG PATTERN [POLL_S]: up to 60 s for the pattern in LOG, a look every POLL_S (0.1)
  local poll=${3:-0.1} end=$((SECONDS + 60))
  until grep -q -- "$2" "$TMP/$1.log"; do ((SECONDS < end)) || return 1; sleep "$poll"; done
}
rank_pid() { # RANK: the pid of our chorus-train process of that rank
  local p
  for p in $(pgrep -f "$TMP/chorus-train"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$1" && { echo "$p"; return; }
  done
}

# A sanitizer build looks for memory errors and races in the servers'
# and workers' code: it runs the scenarios that take it down different
# paths (a worker dying or stopping, bad pushes -- not under TSan: they
# add no threads --, a server dying, mirrors, checkpoints and a resume)
# and skips what only compares results (part 1 with two servers and
# S = 16, DDP from a servers' checkpoint, asynchronous checkpoints) or
# proves speed or loss (part 2); every check below runs in the release
# pass.
# 1. Synchronous = DDP.
if [ -z "$sanitizer" ]; then
  train_run ddp 3 --steps 20 --dump "$TMP/ddp"
  train_run s0 4 --mode async --max-staleness 0 --steps 20 --dump "$TMP/s0"
  has "S=0: every gradient had staleness 0" s0 "staleness: 0: 100.0%; mean 0.00, max 0$"
  same "S=0, one server, 3 workers = DDP on 3 ranks" ddp s0 1e-4
  a=$(num ddp '.*validation loss [0-9.]* -> \([0-9.]*\)$') b=$(num s0 '.*validation loss \([0-9.]*\) (final.*')
  [ -n "$a" ] && [ "$a" = "$b" ] && ok "and the same validation loss ($b)" || fail "validation loss: DDP '$a', async '$b'"
fi
if [ -z "$sanitizer" ]; then
  train_run ddpc 3 --steps 20 --clip 0 --dump "$TMP/ddpc"
  train_run s0b 5 --mode async --servers 2 --max-staleness 0 --steps 20 --clip 0 --dump "$TMP/s0b"
  same "S=0, two servers (ranges), 3 workers = DDP" ddpc s0b 1e-4
  train_run s16 4 --mode async --max-staleness 16 --steps 20 --clip 0 --dump "$TMP/s16"
  if "$cmp" "$TMP/ddpc" "$TMP/s16" 1e-4 >/dev/null; then fail "unbounded staleness differs from DDP"
  else ok "unbounded staleness differs from DDP (so the check above can fail)"; fi
fi

# 2. One worker 4x slower.
if [ -n "$sanitizer" ]; then
  echo "skip part 2 (a slow worker: speed and loss) in a $sanitizer build"
else
slow=(--steps 40 --slowdown 3:4)
train_run aslow 4 --mode async "${slow[@]}"
has "the slow worker's gradients are stale, and the distribution is reported" aslow \
  "staleness: 0: .*max [1-9]"
x=$(num aslow '^.*summary: async.* = \([0-9]*\) tok\/s.*')
v=$(num aslow '.*validation loss \([0-9.]*\) (final.*')
train_run dslow 4 "${slow[@]}"
train_run d40 3 --steps 40
d=$(num dslow '^.*trained [0-9]* tokens in [0-9.]* s = \([0-9]*\) tok\/s.*')
w=$(num d40 '.*validation loss [0-9.]* -> \([0-9.]*\)$')
if [ -n "$d" ] && [ -n "$x" ] && [ "$x" -gt "$d" ]; then
  ok "async $x tok/s > DDP $d tok/s on the same 4 ranks, one worker 4x slower"
else fail "async '$x' tok/s vs DDP '$d'"; fi
ref=
[ -n "$w" ] && ref=" and within 5 % of DDP on 3 ranks ($w)"
if [ -n "$v" ] && awk -v v="$v" -v w="${w:-0}" 'BEGIN { exit !(v < 3.25 && (w == 0 || v <= 1.05 * w)) }'; then
  ok "async validation loss $v < 3.25 after 61440 tokens$ref"
else fail "async validation loss '$v' (want < 3.25$ref)"; fi
fi

# 3. A worker SIGKILLed at its step 10.
train_run kill 4 --elastic inplace -- --mode async --steps 40 --kill-at 10 --kill-rank 2
has "the dead worker is dropped" kill "dropped worker 1 (rank 2): .*exited"
has "the others fill the budget" kill "summary: async.*[0-9]* update(s) of 120 gradient(s) (0 refused, 1 worker(s) dropped)"
has "and the final loss is reported" kill "validation loss [0-9.]* (final"

# 3b. A worker that stops answering (SIGSTOP) is declared dead after
# CHORUS_PEER_TIMEOUT_MS and dropped; the others finish.  Each batch is read
# 25 ms slowly (timing only, as in 5b): a sanitizer build's small model ran
# all 60 steps before the stop landed once, and nobody was dropped.
CHORUS_PEER_TIMEOUT_MS=2000 timeout 120 "$run" --standalone -n 4 --elastic inplace -- "$train" \
  "${model[@]}" --mode async --steps 60 --data-delay-ms 25 >"$TMP/stop.log" 2>&1 &
job=$!
wait_log stop "async step"
stopped=$(rank_pid 2)
[ -n "$stopped" ] && kill -STOP "$stopped"
wait_log stop "summary: async"
[ -n "$stopped" ] && kill -9 "$stopped"
wait "$job"
has "a stopped worker is dropped" stop "dropped worker 1 (rank 2): .*\(silent\|not responding\|timed out\|gone\)"
has "and the others finish without it" stop "summary: async.*(0 refused, 1 worker(s) dropped)"

# 4. Bad pushes.
if [ "$sanitizer" != thread ]; then
  train_run stale 4 --elastic inplace -- --mode async --steps 30 --max-staleness 2 --bad-push 2:stale:8
  has "a too-old gradient is refused, saying why" stale \
    "server 0 refused the gradient of step 8: it was computed on version [0-9]*, [3-9] versions old, and --max-staleness is 2"
  has "its worker hears why and goes on" stale "rank 2: worker 1: server 0 refused the gradient of step 8.*going on"
  has "the server keeps serving" stale "summary: async.*(1 refused, 0 worker(s) dropped)"
  train_run nan 4 --elastic inplace -- --mode async --steps 30 --bad-push 2:nan:6
  has "a gradient holding NaN is refused, saying why" nan "server 0 refused the gradient of step 6: it holds inf or NaN"
  has "and the run goes on" nan "summary: async.*(1 refused, 0 worker(s) dropped)"
  train_run size 4 --elastic inplace -- --mode async --steps 30 --bad-push 2:size:5
  has "a gradient of the wrong size is refused and its worker dropped" size \
    "dropped worker 1 (rank 2): refused: a gradient of [0-9]* floats, but server 0 holds"
  has "the worker says why" size "worker 1 (rank 2): server 0 refused it: a gradient of"
  has "the server keeps serving the others" size "summary: async.*(0 refused, 1 worker(s) dropped)"
fi

# 5. The server dies: every worker fails, fast, naming it.
timeout 120 "$run" --standalone -n 4 --elastic inplace -- "$train" "${model[@]}" --mode async \
  --steps 100000 >"$TMP/skill.log" 2>&1 &
job=$!
wait_log skill "async step"
victim=$(rank_pid 0)
t0=$(date +%s%N)
[ -n "$victim" ] && kill -9 "$victim"
wait "$job"
rc=$? ms=$((($(date +%s%N) - t0) / 1000000))
if [ -n "$victim" ] && [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$ms" -lt 30000 ]; then
  ok "the server's death fails the job (exit $rc) in $ms ms"
else fail "server killed ('$victim'): exit $rc after $ms ms"; fi
has "every worker names the dead server" skill "server 0 (rank 0) is gone or failed: .*the job fails"

# 5b. Mirrored servers: a server SIGKILLed at a random moment loses nothing.
mkill() { # NAME VICTIM_RANK RANKS ARGS...: runs, kills the victim soon after step 10, waits
  # (a sanitizer build's small model does 10 steps in a tenth of a second,
  # and all 40 in less than half a second: on a loaded machine the kill
  # came after the end, and the run had nothing to take over.  Each batch
  # is read 25 ms slowly -- timing only --, so 30 steps stay to be run)
  local name=$1 v=$2 n=$3
  shift 3
  timeout 180 "$run" --standalone -n "$n" --elastic inplace -- "$train" "${model[@]}" "$@" \
    --data-delay-ms 25 >"$TMP/$name.log" 2>&1 &
  local job=$!
  wait_log "$name" "async step  *[1-9][0-9]/" 0.01
  sleep "0.0$((RANDOM % 5))" # a random moment of the next few steps
  local pid
  pid=$(rank_pid "$v")
  [ -n "$pid" ] && kill -9 "$pid" && echo "     killed server rank $v (pid $pid)"
  wait "$job" || { fail "$name: the run failed"; tail -n 8 "$TMP/$name.log" | cut -c1-300; }
  grep -h "took its range" "$TMP/$name.log" | cut -c1-170 | sed 's/^/     /'
}
mir=(--mode async --servers 2 --mirror --max-staleness 0 --steps 40)
train_run mref 5 "${mir[@]}" --dump "$TMP/mref"
if [ -z "$sanitizer" ]; then
  train_run mplain 5 --mode async --servers 2 --max-staleness 0 --steps 40 --dump "$TMP/mplain"
  same "--mirror leaves the result as it was (bit for bit)" mplain mref 0
fi
v=$((RANDOM % 2))
mkill mkill "$v" 5 "${mir[@]}" --checkpoint-dir "$TMP/ck8" --checkpoint-every 10 --keep 10 \
  --dump "$TMP/mkill"
has "the other server takes the dead one's range over from its copy" mkill \
  "server process $v died; server $((1 - v)) took its range $v over from its copy"
has "the workers send that range there" mkill "range $v goes to server $((1 - v)), which kept its copy"
has "every gradient of the budget is applied" mkill "summary: async.* 40 update(s) of 120 gradient(s) (0 refused, 0 worker(s) dropped)"
same "and the weights are bit for bit the run's nobody killed" mref mkill 0
# The survivor's first checkpoint after the take-over: step 30, or 40 when
# the kill fell into step 30's (its collective fails, and that checkpoint is
# not written: the log says so).
after=$(awk '/took its range/ {t = 1} t && /checkpoint: .*\(2 server file\(s\)/ {
               sub(/.*ckpt-/, ""); sub(/ .*/, ""); print; exit}' "$TMP/mkill.log")
if [ -n "$after" ] && [ -d "$TMP/ck8/ckpt-$after" ]; then
  ok "the survivor checkpoints both ranges, a file each (step $((10#$after)))"
else fail "the survivor wrote no checkpoint of both ranges after the take-over"; fi
if [ -z "$sanitizer" ] && [ -n "$after" ]; then
  mkdir -p "$TMP/ck9" && cp -r "$TMP/ck8/ckpt-$after" "$TMP/ck9/"
  train_run mres2 5 "${mir[@]}" --checkpoint-dir "$TMP/ck9" --dump "$TMP/mres2"
  same "a run resumed from that checkpoint ends at the same weights, bit for bit" mref mres2 0
fi

# 5c. One server and a standby, asynchronous: the standby serves on.
stb=(--mode async --servers 1 --mirror --standby --steps 40)
mkill mstand 0 5 "${stb[@]}" --checkpoint-dir "$TMP/ck6" --checkpoint-every 10 --keep 10
has "the standby takes the range over" mstand "server process 0 died; server 1 took its range 0 over"
has "the budget is applied" mstand "summary: async.* of 120 gradient(s) (0 refused, 0 worker(s) dropped)"
heard=$(sed -n 's/.*worker [0-9]* (rank [0-9]*): \([0-9]*\) step(s) applied.*/\1/p' "$TMP/mstand.log" |
        awk '{ s += $1 } END { print s + 0 }')
[ "$heard" -eq 120 ] && ok "the gradients the workers heard were applied add up to it ($heard)" ||
  fail "the workers heard of $heard applied gradients, not 120"
has "checkpoints go on after the take-over" mstand "checkpoint: .*ckpt-000000030 (1 server file(s)"
if [ -z "$sanitizer" ]; then
  mkdir -p "$TMP/ck7" && cp -r "$TMP/ck6/ckpt-000000030" "$TMP/ck7/"
  train_run mres 5 "${stb[@]}" --checkpoint-dir "$TMP/ck7"
  has "and a run with a standby resumes from them" mres "resumed from .*ckpt-000000030 (written by 1 rank(s), asynchronous): 9[0-9] of 120"
fi

# 6. Checkpoints of two servers, and a resume.
ck=(--mode async --servers 2 --max-staleness 0 --steps 20 --clip 0 --checkpoint-every 10)
train_run c1 5 "${ck[@]}" --checkpoint-dir "$TMP/ck1" --dump "$TMP/c1"
has "two servers write one checkpoint" c1 "checkpoint: .*ckpt-000000010 (2 server file(s) and an index)"
n=$(ls "$TMP/ck1/ckpt-000000010" 2>/dev/null | grep -c '^shard-0000[01]-of-00002\.bin$')
[ "$n" -eq 2 ] && [ -s "$TMP/ck1/ckpt-000000010/index.bin" ] && ok "a file per server and an index" ||
  fail "files: $(ls "$TMP/ck1/ckpt-000000010" 2>&1)"
mkdir -p "$TMP/ck2" "$TMP/ck3" && cp -r "$TMP/ck1/ckpt-000000010" "$TMP/ck2/" &&
  cp -r "$TMP/ck1/ckpt-000000010" "$TMP/ck3/"
train_run c2 5 "${ck[@]}" --checkpoint-dir "$TMP/ck2" --dump "$TMP/c2"
has "the servers resume from it" c2 "resumed from .*ckpt-000000010 (written by 2 rank(s), asynchronous): 30 of 60"
same "and end at the uninterrupted run's weights, bit for bit" c1 c2 0
if [ -z "$sanitizer" ]; then
# Asynchronous servers update apart (their optimizers' step counts
# differ): their checkpoints still load, and every threshold is written.
aas=(--mode async --servers 2 --steps 20 --checkpoint-every 5)
train_run c4 5 "${aas[@]}" --checkpoint-dir "$TMP/ck4" --keep 5
has "asynchronous servers write every checkpoint" c4 "checkpoint: .*ckpt-000000015 (2 server"
has "and the final one" c4 "checkpoint: .*ckpt-000000020 (2 server"
mkdir -p "$TMP/ck5" && cp -r "$TMP/ck4/ckpt-000000010" "$TMP/ck5/"
train_run c5 5 "${aas[@]}" --checkpoint-dir "$TMP/ck5"
has "and resume from one" c5 "resumed from .*ckpt-000000010 (written by 2 rank(s), asynchronous)"
has "to the end" c5 "checkpoint: .*ckpt-000000020 (2 server"
train_run c3 3 --steps 20 --clip 0 --checkpoint-dir "$TMP/ck3"
has "DDP resumes from the servers' checkpoint" c3 "checkpoint of step 10: its training state is unreadable; the data order starts over"
fi
if timeout 60 "$run" --standalone -n 2 -- "$train" "${model[@]}" --mode async --shard 1 \
    >"$TMP/refuse.log" 2>&1; then fail "--mode async --shard 1 is refused"
else has "--mode async --shard 1 is refused" refuse "does not take --shard"; fi

summary "all asynchronous data parallel checks passed" "asynchronous data parallel check(s) FAILED"
