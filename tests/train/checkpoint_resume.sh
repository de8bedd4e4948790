#!/usr/bin/env bash
# Checkpoints: a run stopped and resumed ends with exactly the weights of an
# uninterrupted one; a checkpoint of 4 ranks resumes on 2; chorusrun
# --max-restarts brings a job whose rank was SIGKILLed back to the same
# weights; a torn newest checkpoint falls back to the previous one.
#   checkpoint_resume.sh CHORUSRUN CHORUS_TRAIN CMP_WEIGHTS DATA
set -u
run=$1 train=$2 cmp=$3 data=$4
tmp=$(mktemp -d /tmp/chorus-ckpt.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
model=(--layers 2 --heads 2 --channels 32 --ctx 32 --steps 20 --warmup 3 --val-every 0
       --sample 0 --log-every 100 --threads 1 --data "$data")
train_run() { # LOG RANKS [chorusrun args --] [chorus-train args...]
  local log=$1 n=$2
  shift 2
  local pre=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do pre+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  if ! "$run" --standalone -n "$n" "${pre[@]}" -- "$train" "${model[@]}" "$@" \
      >"$tmp/$log.log" 2>&1; then
    echo "FAIL $log: chorus-train failed"; tail -n 8 "$tmp/$log.log"; fails=$((fails + 1))
  fi
}
check() { # WHAT A B TOL
  if "$cmp" "$tmp/$2" "$tmp/$3" "$4"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}
has() { # WHAT LOG PATTERN
  if grep -q -- "$3" "$tmp/$2.log"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}

train_run straight 2 -- --batch 2 --dump "$tmp/straight"
# Stop after 10 steps (checkpoint), then resume to 20.
train_run first 2 -- --batch 2 --checkpoint-dir "$tmp/ck1" --stop-after 10
train_run second 2 -- --batch 2 --checkpoint-dir "$tmp/ck1" --dump "$tmp/resumed"
has "the second run resumed at step 10" second "resumed from .*ckpt-000000010 "
check "stop + resume is bit-exact" straight resumed 0
# Run again with every step done: nothing to train, and it says so.
train_run third 2 -- --batch 2 --checkpoint-dir "$tmp/ck1"
has "a run with every step done says so, and how to train more" third \
  "nothing to train: the checkpoint in .* has 20 of --steps 20 step(s) done; raise --steps"
# 4 ranks x 1 for 10 steps, then 2 ranks x 2: the same global batches.
train_run four 4 -- --batch 1 --checkpoint-dir "$tmp/ck2" --stop-after 10
train_run two 2 -- --batch 2 --checkpoint-dir "$tmp/ck2" --dump "$tmp/from4"
has "a 4-rank checkpoint resumes on 2 ranks" two "saved by 4 rank(s)"
check "and ends where 2 ranks all along end (float tolerance)" straight from4 1e-4
# Elastic: rank 1 is SIGKILLed at step 12; checkpoints every 5 steps.
train_run elastic 2 --max-restarts 1 -- --batch 2 --checkpoint-dir "$tmp/ck3" \
  --checkpoint-every 5 --kill-at 12 --dump "$tmp/elastic"
has "the worker was killed" elastic "rank 1 kills itself at step 12"
has "chorusrun restarted the group" elastic "restarting the group"
has "the restart resumed from step 10" elastic "resumed from .*ckpt-000000010 "
check "the restarted job ends with the uninterrupted weights" straight elastic 0
# Keep: only the newest 2 remain of 4 written.
train_run keep 1 -- --batch 4 --checkpoint-dir "$tmp/ck4" --checkpoint-every 5 --keep 2
n=$(ls "$tmp/ck4" | grep -c '^ckpt-[0-9]*$')
if [ "$n" -eq 2 ] && [ -e "$tmp/ck4/ckpt-000000020/index.bin" ]; then echo "ok   --keep 2 keeps the newest 2"
else echo "FAIL --keep 2 left $n files"; fails=$((fails + 1)); fi
# A torn newest checkpoint: the older one is used.
truncate -s 1000 "$tmp/ck4/ckpt-000000020/shard-00000-of-00001.bin"
train_run torn 1 -- --batch 4 --checkpoint-dir "$tmp/ck4" --steps 20
has "a torn newest checkpoint falls back to the previous" torn "resumed from .*ckpt-000000015 "
has "and says why the newest was unusable" torn "ckpt-000000020 is unusable: .*shard-00000-of-00001.bin: 1000 bytes, the index says"
[ "$fails" -eq 0 ] && echo "all checkpoint checks passed" && exit 0
echo "$fails checkpoint check(s) FAILED"; exit 1
