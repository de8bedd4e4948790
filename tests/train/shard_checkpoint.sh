#!/usr/bin/env bash
# Checkpoints across stages and world sizes: one written by 4 ranks at
# stage 3 resumes on 2 ranks at stage 1 and on 1 rank with DDP, and DDP's
# resumes at stage 3, each with the next step's loss of the uninterrupted
# run and ending at its weights; a full export (one file, rank 0 gathering
# unit by unit) resumes anywhere too; a checkpoint without its index, or
# with a flipped bit in a shard, is passed over for the previous one.
#   shard_checkpoint.sh CHORUSRUN CHORUS_TRAIN CMP_WEIGHTS DATA
set -u
run=$1 train=$2 cmp=$3 data=$4
tmp=$(mktemp -d /tmp/chorus-shardck.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
model=(--layers 2 --heads 2 --channels 32 --ctx 32 --steps 20 --warmup 3 --val-every 0
       --sample 0 --log-every 1 --threads 1 --data "$data")
train_run() { # LOG RANKS [args...]
  local log=$1 n=$2
  shift 2
  if ! "$run" --standalone -n "$n" -- "$train" "${model[@]}" "$@" >"$tmp/$log.log" 2>&1; then
    echo "FAIL $log: chorus-train failed"; tail -n 8 "$tmp/$log.log"; fails=$((fails + 1))
  fi
}
has() { # WHAT LOG PATTERN
  if grep -q -- "$3" "$tmp/$2.log"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}
loss_at() { sed -n "s/.*step *$2\/20  loss \([0-9.]*\).*/\1/p" "$tmp/$1.log" | head -n 1; }
same_loss() { # WHAT LOG STEP: the loss of LOG at STEP is the uninterrupted run's
  local a b
  a=$(loss_at straight "$3") b=$(loss_at "$2" "$3")
  if [ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; exit !(d <= 2e-4 && d >= -2e-4) }'; then
    echo "ok   $1: step $3 loss $b (uninterrupted $a)"
  else echo "FAIL $1: step $3 loss '$b', uninterrupted '$a'"; fails=$((fails + 1)); fi
}
close_to() { # WHAT A B TOL
  if "$cmp" "$tmp/$2" "$tmp/$3" "$4"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}

# The uninterrupted run: 4 ranks x 1 at stage 3 (the global batch is 4 throughout).
train_run straight 4 --batch 1 --shard 3 --dump "$tmp/straight"
# 10 steps at stage 3 on 4 ranks, then a copy of the checkpoint per resumer.
train_run first 4 --batch 1 --shard 3 --checkpoint-dir "$tmp/ck" --stop-after 10 \
  --export "$tmp/export.bin"
has "4 ranks at stage 3 wrote a sharded checkpoint" first "checkpoint: .*ckpt-000000010 (4 file(s) and an index)"
n=$(ls "$tmp/ck/ckpt-000000010" 2>/dev/null | grep -c '^shard-0000[0-3]-of-00004\.bin$')
[ -s "$tmp/ck/ckpt-000000010/index.bin" ] && [ "$n" -eq 4 ] &&
  echo "ok   one file per rank and an index" || { echo "FAIL files: $(ls "$tmp/ck/ckpt-000000010")"; fails=$((fails + 1)); }
for d in s1 ddp s3b s2x ddpx; do cp -r "$tmp/ck" "$tmp/ck_$d"; done

train_run s1 2 --batch 2 --shard 1 --checkpoint-dir "$tmp/ck_s1" --dump "$tmp/s1"
has "stage 3 x 4 ranks -> stage 1 x 2 ranks: resumed" s1 "resumed from .*ckpt-000000010 (saved by 4 rank(s) at stage 3"
same_loss "and its next step" s1 10
close_to "and it ends at the uninterrupted weights" straight s1 1e-4

train_run ddp 1 --batch 4 --checkpoint-dir "$tmp/ck_ddp" --dump "$tmp/ddp"
has "stage 3 x 4 ranks -> DDP on 1 rank: resumed" ddp "resumed from .*ckpt-000000010 (saved by 4 rank(s) at stage 3"
same_loss "and its next step" ddp 10
close_to "and it ends at the uninterrupted weights" straight ddp 1e-4

# DDP on 2 ranks writes one (each rank its share); stage 3 on 4 resumes it.
train_run ddpw 2 --batch 2 --checkpoint-dir "$tmp/ck_d" --stop-after 10
train_run s3 4 --batch 1 --shard 3 --checkpoint-dir "$tmp/ck_d" --dump "$tmp/s3"
has "DDP x 2 ranks -> stage 3 x 4 ranks: resumed" s3 "resumed from .*ckpt-000000010 (saved by 2 rank(s) at stage 0"
same_loss "and its next step" s3 10
close_to "and it ends at the uninterrupted weights" straight s3 1e-4

# The export: one file in chorus_ckpt_save's format, from stage 3's shards.
mkdir -p "$tmp/ck_x1" "$tmp/ck_x2"
cp "$tmp/export.bin" "$tmp/ck_x1/ckpt-10.bin" # as the docs write it: DIR/ckpt-<step>.bin
cp "$tmp/export.bin" "$tmp/ck_x2/ckpt-000000010.bin"
has "the run exported its whole state" first "exported: .*export.bin (step 10)"
train_run x1 1 --batch 4 --checkpoint-dir "$tmp/ck_x1" --dump "$tmp/x1"
has "the export, named ckpt-10.bin, resumes on 1 rank (DDP)" x1 "resumed from .*/ckpt-10.bin (saved by 4 rank(s), epoch"
same_loss "and its next step" x1 10
close_to "and it ends at the uninterrupted weights" straight x1 1e-4
train_run x2 2 --batch 2 --shard 2 --checkpoint-dir "$tmp/ck_x2" --dump "$tmp/x2"
has "the export resumes at stage 2 on 2 ranks" x2 "resumed from .*ckpt-000000010.bin"
same_loss "and its next step" x2 10

# A checkpoint missing its index (a crash before rank 0 wrote it) and one
# with a flipped bit in a shard are passed over, each for the one before.
train_run k 2 --batch 2 --shard 3 --checkpoint-dir "$tmp/ck_k" --checkpoint-every 5 --keep 5 --stop-after 15
rm -f "$tmp/ck_k/ckpt-000000015/index.bin"
printf '\x5a' | dd of="$tmp/ck_k/ckpt-000000010/shard-00001-of-00002.bin" bs=1 seek=200 conv=notrunc status=none
train_run kr 2 --batch 2 --shard 3 --checkpoint-dir "$tmp/ck_k" --stop-after 6
has "no index: passed over" kr "ckpt-000000015 is unusable: .*index.bin: No such file"
has "a flipped bit: its checksum fails, passed over" kr "ckpt-000000010 is unusable: .*shard-00001-of-00002.bin: checksum mismatch"
has "the one before is used" kr "resumed from .*ckpt-000000005 (saved by 2 rank(s) at stage 3"
# Another optimizer cannot take the state: said, and not loaded.
train_run sgd 2 --batch 2 --shard 3 --checkpoint-dir "$tmp/ck_s2x" --optim sgd --stop-after 11
has "an SGD run refuses AdamW's state, saying so" sgd "written with an optimizer of 2 state floats per parameter, this run's has 1"

[ "$fails" -eq 0 ] && echo "all sharded checkpoint checks passed" && exit 0
echo "$fails sharded checkpoint check(s) FAILED"; exit 1
