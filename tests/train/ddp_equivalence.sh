#!/usr/bin/env bash
# DDP equivalence: the same global batch split over 1, 2 and 4 ranks must
# give the same weights (float tolerance) after a few steps -- plain, with
# no_sync gradient accumulation, and with the compressed hooks (looser).
#   ddp_equivalence.sh CHORUSRUN CHORUS_TRAIN CMP_WEIGHTS DATA
set -u
run=$1 train=$2 cmp=$3 data=$4
tmp=$(mktemp -d /tmp/chorus-ddp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
# SGD without clipping: the update is linear in the averaged gradient, so a
# wrong average (a sum, a missing rank) shows; AdamW + clipping would hide a
# constant factor.  The AdamW default gets its own pair of runs.
model=(--layers 2 --heads 2 --channels 32 --ctx 32 --steps 8 --warmup 2 --val-every 0
       --sample 0 --log-every 100 --threads 1 --data "$data" --optim sgd --lr 0.05 --clip 0)
train_run() { # NAME RANKS [args...]
  local name=$1 n=$2
  shift 2
  if ! "$run" --standalone -n "$n" -- "$train" "${model[@]}" --dump "$tmp/$name" "$@" \
      >"$tmp/$name.log" 2>&1; then
    echo "FAIL $name: chorus-train failed"; tail -n 5 "$tmp/$name.log"; fails=$((fails + 1))
  fi
}
same() { # WHAT A B TOL
  if "$cmp" "$tmp/$2" "$tmp/$3" "$4"; then echo "ok   $1"; else echo "FAIL $1"; fails=$((fails + 1)); fi
}
train_run r1 1 --batch 4
train_run r2 2 --batch 2
train_run r4 4 --batch 1
train_run r2_accum 2 --batch 1 --accum 2
train_run r1_accum 1 --batch 2 --accum 2
train_run r2_nooverlap 2 --batch 2 --no-overlap
train_run r2_bf16 2 --batch 2 --hook bf16
train_run r2_fp16 2 --batch 2 --hook fp16 --loss-scale none
train_run r1_adamw 1 --batch 4 --optim adamw --lr 3e-3 --clip 1
train_run r2_adamw 2 --batch 2 --optim adamw --lr 3e-3 --clip 1
same "1 rank x 4 == 2 ranks x 2" r1 r2 2e-5
same "1 rank x 4 == 4 ranks x 1" r1 r4 2e-5
same "no_sync accumulation: 2 ranks x 1 x 2 micro-steps == 1 rank x 4" r1 r2_accum 2e-5
same "accumulation on 1 rank: 2 x 2 micro-steps == 4 at once" r1 r1_accum 2e-5
same "reducing after backward == during backward" r2 r2_nooverlap 1e-6
same "bf16-compressed gradients stay close" r1 r2_bf16 2e-2
same "fp16-compressed gradients stay close" r1 r2_fp16 5e-3
same "AdamW with clipping: 1 rank x 4 == 2 ranks x 2" r1_adamw r2_adamw 2e-4
# The runs really differ from an untrained model: a different seed is far.
train_run other 1 --batch 4 --seed 7
if "$cmp" "$tmp/r1" "$tmp/other" 2e-4 >/dev/null; then
  echo "FAIL another seed gives the same weights"; fails=$((fails + 1))
else
  echo "ok   another seed gives different weights"
fi
# Unused parameters: rank 1 skips block 0 every step (its tensors are
# announced ready at once); the job completes and the ranks stay identical.
train_run skip 2 --batch 2 --skip-layer 1:0 --dump "$tmp/skip" --dump-all
same "rank 1 skipping a block: the job completes, both ranks hold the same weights" \
  skip.rank0 skip.rank1 0
# Uneven inputs: rank 1 runs out after 3 of 8 steps, then rank 0 after 8;
# the other way round too.  No hang, and the ranks agree on the weights.
train_run uneven 2 --batch 2 --uneven 1:3 --dump "$tmp/uneven" --dump-all
same "uneven inputs (rank 1 has 3 steps of data): ranks agree" uneven.rank0 uneven.rank1 0
train_run uneven0 2 --batch 2 --uneven 0:5 --dump "$tmp/uneven0" --dump-all
same "uneven inputs (rank 0 has 5 steps of data): ranks agree" uneven0.rank0 uneven0.rank1 0
if "$cmp" "$tmp/uneven.rank0" "$tmp/r2" 2e-5 >/dev/null; then
  echo "FAIL uneven inputs changed nothing"; fails=$((fails + 1))
else
  echo "ok   uneven inputs train on less data than the even run"
fi

# Dynamic loss scaling: a power-of-two scale changes no bit with float32
# gradients; an inf on rank 1 at step 3 skips that step on both ranks.
train_run scaled 2 --batch 2 --loss-scale dynamic
same "loss scaling by 2^16 (float32 gradients) changes nothing" r2 scaled 0
train_run inf 2 --batch 2 --loss-scale dynamic --inject-inf 3 --dump "$tmp/inf" --dump-all
if grep -q "step 3: inf/NaN in the gradients: step skipped on every rank, loss scale now 32768" \
    "$tmp/inf.log"; then echo "ok   an inf on one rank skips the step everywhere and halves the scale"
else echo "FAIL no skipped step reported"; fails=$((fails + 1)); fi
same "after a skipped step the ranks still agree" inf.rank0 inf.rank1 0
# fp16 with its default dynamic scaling: 2^16 overflows fp16 at the first
# step, which is skipped on both ranks; training goes on with 2^15.
train_run fp16s 2 --batch 2 --hook fp16 --dump "$tmp/fp16s" --dump-all
if grep -q "step 0: inf/NaN in the gradients" "$tmp/fp16s.log"; then
  echo "ok   fp16 + dynamic scaling: the overflowing first step is skipped"
else echo "FAIL fp16 + dynamic scaling did not skip its overflowing first step"; fails=$((fails + 1)); fi
same "fp16 + dynamic scaling: ranks agree" fp16s.rank0 fp16s.rank1 0

# A Chrome trace merged by rank 0: both ranks' compute and bucket tracks.
train_run traced 2 --batch 2 --trace "$tmp/trace.json"
t="$tmp/trace.json"
if [ -s "$t" ] && head -c 40 "$t" | grep -q '^{"displayTimeUnit":"ms","traceEvents":\[' &&
   tail -c 4 "$t" | grep -q ']}' && grep -q '"name":"rank 1"' "$t" &&
   [ "$(grep -o '"name":"backward","cat":"compute","ph":"X","pid":1' "$t" | wc -l)" -eq 8 ] &&
   [ "$(grep -o '"name":"all_reduce bucket"' "$t" | wc -l)" -ge 16 ]; then
  echo "ok   --trace writes one Chrome trace with every rank's events"
else
  echo "FAIL --trace output"; head -c 300 "$t"; fails=$((fails + 1))
fi
# The merged trace is on one clock: rank 1's estimated offset is -SKEW_US
# within the uncertainty it reports, and each bucket's all_reduce overlaps
# in time on both ranks (neither can finish before the other started).
trace_aligned() { # FILE SKEW_US
  local t=$1 skew=$2
  { grep -o '"name":"rank 1","clock_offset_us":[-0-9.]*,"clock_uncertainty_us":[0-9.]*' "$t"
    grep -o '"name":"all_reduce bucket"[^}]*}' "$t"; } |
  awk -v skew="$skew" -F'[:,]' '
    /clock_offset_us/ { off = $4; unc = $6; seen = 1; next }
    { for (i = 1; i < NF; i++) { k = $i; gsub(/[{}"]/, "", k); v[k] = $(i + 1) }
      key = v["step"] "/" v["bucket"]; s = v["ts"]; e = v["ts"] + v["dur"]
      if (v["pid"] == 0) { s0[key] = s; e0[key] = e } else { s1[key] = s; e1[key] = e } }
    END {
      if (!seen) { print "no clock offset for rank 1"; exit 1 }
      d = off + skew; if (d < 0) d = -d
      if (d > unc) { printf "offset %.3f us, expected %.3f +- %.3f\n", off, -skew, unc; exit 1 }
      n = 0
      for (k in s0) {
        if (!(k in s1)) continue
        n++
        if (s0[k] > e1[k] + unc || s1[k] > e0[k] + unc) { printf "bucket %s: rank 0 [%.1f, %.1f], rank 1 [%.1f, %.1f] us do not overlap\n", k, s0[k], e0[k], s1[k], e1[k]; exit 1 }
      }
      if (n < 8) { print "only " n " buckets on both ranks"; exit 1 }
    }'
}
if why=$(trace_aligned "$t" 0); then echo "ok   the trace's ranks share one clock"
else echo "FAIL trace clocks: $why"; fails=$((fails + 1)); fi
# Rank 1's clock 5 s ahead: the round-trip estimate must find and remove it
# (what a rank on another host needs).
train_run skewed 2 --batch 2 --trace "$tmp/skewed.json" --trace-clock ping --clock-skew-ms 5000
if why=$(trace_aligned "$tmp/skewed.json" 5000000); then
  echo "ok   a rank 5 s off has its estimated offset removed from the trace"
else echo "FAIL estimated clock offset: $why"; fails=$((fails + 1)); fi

[ "$fails" -eq 0 ] && echo "all DDP equivalence checks passed" && exit 0
echo "$fails DDP equivalence check(s) FAILED"; exit 1
