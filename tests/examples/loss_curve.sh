#!/usr/bin/env bash
# examples/train_elastic's loss curve on 4 ranks, nobody killed: it falls
# step by step (no step more than 0.3 above the one before) and ends below
# 4.0.  At its old peak learning rate (3e-3) one AdamW step of the first
# block's attention overshot and step 6 read 7.69 (more than a uniform
# guess over 256 bytes), which looked like a broken recovery.
#   loss_curve.sh CHORUSRUN TRAIN_ELASTIC DATA
set -u
run=$1 prog=$2 data=$3
out=$(CHORUS_TIMEOUT=60 timeout 120 "$run" --standalone -n 4 --elastic inplace -- "$prog" "$data" 2>&1)
echo "$out" | grep -E '^\[rank0\]:(step|done)'
echo "$out" | awk '
  /^\[rank0\]:step +[0-9]+: loss/ { l = $4 + 0; n++
    if (n > 1 && l > prev + 0.3) { printf "FAIL step %d: loss %.4f after %.4f\n", n - 1, l, prev; bad = 1 }
    prev = l }
  END { if (n != 16) { print "FAIL " n " steps, not 16"; bad = 1 }
        else if (prev >= 4.0) { printf "FAIL final loss %.4f, not below 4.0\n", prev; bad = 1 }
        if (!bad) print "ok   the loss falls step by step to " prev
        exit bad }'
