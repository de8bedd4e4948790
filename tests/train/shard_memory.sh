#!/usr/bin/env bash
# Memory of sharded training at 4 ranks, on a model whose state dominates
# (8 blocks of 256 channels, 6.4 M parameters, 97.5 MiB of state unsharded):
#   - every stage's state (parameters + gradients + AdamW) is its formula
#     within 5 %: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N bytes (fp32 parameters
#     and gradients);
#   - measured, not only counted: the process's peak resident memory is a
#     fixed base plus that state plus the gathered units' peak, within 5 % of
#     what the runtime says it holds, at every stage;
#   - the gathered peak stays under the bound the runtime plans with;
#   - --mem-cap between the two: DDP is refused before training, naming
#     what it would need; stage 3 trains under the cap, to the same losses.
#   shard_memory.sh CHORUSRUN CHORUS_TRAIN DATA [SANITIZER]
set -u
run=$1 train=$2 data=$3 sanitizer=${4:-}
if [ -n "$sanitizer" ]; then
  echo "SKIPPED: a $sanitizer-sanitized build: its shadow memory makes resident sizes meaningless"
  exit 77
fi
tmp=$(mktemp -d /tmp/chorus-shardmem.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
model=(--layers 8 --heads 4 --channels 256 --ctx 16 --batch 1 --steps 3 --warmup 1
       --val-every 0 --sample 0 --log-every 1 --threads 1 --data "$data")
for s in 0 1 2 3; do
  if ! "$run" --standalone -n 4 -- "$train" "${model[@]}" --shard "$s" >"$tmp/s$s.log" 2>&1; then
    echo "FAIL stage $s: chorus-train failed"; tail -n 5 "$tmp/s$s.log"; fails=$((fails + 1))
  fi
done
# memory rank R: stage S: parameters A MiB, gradients B MiB, optimizer C MiB = state D MiB
# (formula E MiB, Fx); gathered units peak G MiB (bound H); activations I MiB; peak resident J MiB
fields() { # LOG -> "state ratio peak bound rss" of rank 0
  sed -n 's/.*memory rank 0: .*= state \([0-9.]*\) MiB (formula [0-9.]* MiB, \([0-9.]*\)x); gathered units peak \([0-9.]*\) MiB (bound \([0-9.]*\)); activations [0-9.]* MiB; peak resident \([0-9.]*\) MiB.*/\1 \2 \3 \4 \5/p' "$1"
}
read -r st0 _ pk0 _ rss0 <<<"$(fields "$tmp/s0.log")"
if [ -z "${rss0:-}" ]; then
  echo "FAIL no memory report from stage 0"; exit 1
fi
base=$(awk -v r="$rss0" -v s="$st0" -v p="$pk0" 'BEGIN { print r - s - p }')
echo "     base (everything but the training state) $base MiB"
for s in 0 1 2 3; do
  read -r st ratio pk bound rss <<<"$(fields "$tmp/s$s.log")"
  if [ -z "${rss:-}" ]; then echo "FAIL stage $s: no memory report"; fails=$((fails + 1)); continue; fi
  echo "     stage $s: state $st MiB (${ratio}x the formula), gathered peak $pk MiB (bound $bound), peak resident $rss MiB"
  if awk -v r="$ratio" 'BEGIN { exit !(r >= 0.95 && r <= 1.05) }'; then
    echo "ok   stage $s: state within 5 % of its formula"
  else echo "FAIL stage $s: state ${ratio}x its formula"; fails=$((fails + 1)); fi
  if awk -v p="$pk" -v b="$bound" 'BEGIN { exit !(p <= b) }'; then
    echo "ok   stage $s: gathered units within the planned bound"
  else echo "FAIL stage $s: gathered peak $pk over the bound $bound"; fails=$((fails + 1)); fi
  if [ "$s" -gt 0 ]; then
    if awk -v r="$rss" -v b="$base" -v s="$st" -v p="$pk" \
        'BEGIN { d = r - b - s - p; if (d < 0) d = -d; exit !(d <= 0.05 * (s + p)) }'; then
      echo "ok   stage $s: peak resident = base + state + gathered peak (within 5 %)"
    else echo "FAIL stage $s: peak resident $rss MiB, expected $base + $st + $pk"; fails=$((fails + 1)); fi
  fi
done
read -r st3 _ pk3 bd3 rss3 <<<"$(fields "$tmp/s3.log")"
if awk -v a="$rss0" -v b="$rss3" 'BEGIN { exit !(b < 0.6 * a) }'; then
  echo "ok   stage 3 peaks at under 60 % of DDP's resident memory ($rss3 vs $rss0 MiB)"
else echo "FAIL stage 3 resident $rss3 MiB vs DDP $rss0 MiB"; fails=$((fails + 1)); fi

# A cap between the two: 64 MiB per rank (DDP plans 100, stage 3 about 45).
long=(--layers 8 --heads 4 --channels 256 --ctx 16 --batch 1 --steps 10 --warmup 2
      --val-every 0 --sample 0 --log-every 1 --threads 1 --data "$data")
start=$(date +%s%N)
if "$run" --standalone -n 4 -- "$train" "${long[@]}" --mem-cap 64M >"$tmp/cap0.log" 2>&1; then
  echo "FAIL DDP over the cap was not refused"; fails=$((fails + 1))
else
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  if grep -q "stage 0 needs .* MiB per rank (parameters .*over the cap of 64.0 MiB" "$tmp/cap0.log" &&
     ! grep -q "step    0" "$tmp/cap0.log"; then
    echo "ok   DDP over --mem-cap is refused before its first step, itemised ($ms ms)"
  else echo "FAIL refusal message"; tail -n 4 "$tmp/cap0.log"; fails=$((fails + 1)); fi
fi
"$run" --standalone -n 4 -- "$train" "${long[@]}" >"$tmp/free0.log" 2>&1 ||
  { echo "FAIL uncapped DDP run"; fails=$((fails + 1)); }
if "$run" --standalone -n 4 -- "$train" "${long[@]}" --shard 3 --mem-cap 64M >"$tmp/cap3.log" 2>&1; then
  read -r _ _ _ _ rsscap <<<"$(fields "$tmp/cap3.log")"
  if awk -v r="$rsscap" -v b="$base" 'BEGIN { exit !(r - b <= 64) }'; then
    echo "ok   stage 3 trains under the 64 MiB cap (peak resident $rsscap MiB, base $base)"
  else echo "FAIL stage 3 went over the cap: $rsscap MiB - base $base"; fails=$((fails + 1)); fi
  losses() { sed -n 's/.*step *\([0-9]*\)\/10  loss \([0-9.]*\).*/\1 \2/p' "$1"; }
  if [ -n "$(losses "$tmp/cap3.log")" ] && [ "$(losses "$tmp/cap3.log")" = "$(losses "$tmp/free0.log")" ]; then
    echo "ok   and its loss falls step for step as uncapped DDP's ($(losses "$tmp/cap3.log" | head -n 1 | cut -d' ' -f2) -> $(losses "$tmp/cap3.log" | tail -n 1 | cut -d' ' -f2))"
  else echo "FAIL losses differ from DDP's"; paste <(losses "$tmp/cap3.log") <(losses "$tmp/free0.log"); fails=$((fails + 1)); fi
else
  echo "FAIL stage 3 under the cap did not train"; tail -n 4 "$tmp/cap3.log"; fails=$((fails + 1))
fi

[ "$fails" -eq 0 ] && echo "all sharding memory checks passed" && exit 0
echo "$fails sharding memory check(s) FAILED"; exit 1
