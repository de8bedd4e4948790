#!/usr/bin/env bash
# Every option of chorus-train, chorus-data and chorusrun that takes a value,
# given nonsense: a table of (option, bad value) pairs -- garbage where a
# number goes, and numbers out of range.  Each must exit 2 at once with
# one line on stderr that names the option and the value, and nothing on
# stdout (no usage dump, no training).  The table must cover every option
# that each program's --help shows with a value (a new option without a
# row fails here), and each --help has its sections and examples.
#   options.sh CHORUS_TRAIN CHORUS_DATA CHORUSRUN
set -u
train=$1 data=$2 run=$3
tmp=$(mktemp -d /tmp/chorus-cli.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp" || exit 1
fails=0 checked=0
bad() { echo "FAIL $1"; fails=$((fails + 1)); }

# PROGRAM_NAME "OPTION VALUE" ... (a row "OPTION -" is a path or a name,
# checked by use, not here).  Extra arguments after the value: EXTRA.
refuse() { # LABEL EXTRA_BEFORE EXTRA_AFTER OPTION VALUE: runs and judges one row
  local label=$1 before=$2 after=$3 opt=$4 val=$5 out err rc
  # shellcheck disable=SC2086
  timeout 10 "${prog[@]}" $before "$opt" "$val" $after >"$tmp/out" 2>"$tmp/err"
  rc=$?
  checked=$((checked + 1))
  local lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ] || [ -s "$tmp/out" ] || [ "$lines" -lt 1 ] || [ "$lines" -gt 2 ] ||
     ! grep -qF -- "$opt '$val'" "$tmp/err" ||
     { [ "$lines" -eq 2 ] && ! tail -n 1 "$tmp/err" | grep -q -- "--help lists the options"; }; then
    bad "$label $opt $val: exit $rc, stdout $(wc -c <"$tmp/out") bytes, stderr: $(head -c 300 "$tmp/err")"
  fi
}
covered() { # HELP_FILE ROWS...: every option --help shows with a value has a row
  local help=$1 o
  shift
  for o in $(grep -oE -- '--[a-z][a-z-]+ ([A-Z]|[a-z0-9]+\||R:)' "$help" | cut -d' ' -f1 | sort -u); do
    printf '%s\n' "$@" | grep -q -- "^$o " || bad "$o takes a value in --help, and has no row here"
  done
}
table() { # LABEL BEFORE AFTER ROWS...
  local label=$1 before=$2 after=$3 row
  shift 3
  for row in "$@"; do
    set -- $row
    [ "$2" = - ] && continue
    refuse "$label" "$before" "$after" "$1" "$2"
  done
}

# ---------------------------------------------------------- chorus-train
rows=("--data -" "--val-data -" "--tokenizer -" "--checkpoint-dir -" "--export -" "--dump -"
  "--trace -" "--log-data -"
  "--data-format bogus" "--vocab abc" "--vocab 1" "--workers -1" "--workers x1"
  "--data-prefetch 0" "--layers 0" "--layers 2x" "--heads 0" "--channels -3" "--ctx 1"
  "--batch 0" "--batch 1.5" "--steps -5" "--steps abc" "--lr abc" "--lr 0" "--lr -1"
  "--lr nan" "--min-lr-frac 2" "--warmup -1" "--weight-decay -1" "--clip -1" "--clip inf"
  "--optim adam" "--momentum 1.5" "--accum 0" "--param-dtype fp8" "--threads 0"
  "--seed -1" "--seed 1e3" "--bucket-mb 0" "--hook fp8" "--loss-scale static" "--shard 4"
  "--prefetch 65" "--mem-cap 0" "--mem-cap 3X" "--elastic maybe" "--replica-every 0"
  "--mode both" "--servers 0" "--max-staleness -1" "--staleness-weight square"
  "--checkpoint-every -1" "--keep 0" "--stop-after -1" "--val-every -1" "--val-batches 0"
  "--sample -1" "--log-every 0" "--trace-clock ntp" "--skip-layer 1:x" "--skip-layer 1:2000"
  "--uneven x" "--uneven -1:2" "--data-delay-ms -1" "--inject-inf -1" "--kill-at -1"
  "--kill-rank -1" "--clock-skew-ms x" "--slowdown 3:0.5" "--slowdown 3" "--bad-push 1:foo:2")
prog=("$train")
table chorus-train "" "" "${rows[@]}"
"$train" --help >"$tmp/help" 2>&1 || bad "chorus-train --help exits $?"
covered "$tmp/help" "${rows[@]}"
for s in "examples:" "data:" "model and optimizer:" "parameter servers" "checkpoints and output:" \
         "testing and benchmarks"; do
  grep -q "^$s" "$tmp/help" || bad "chorus-train --help has no section '$s'"
done
# The testing knobs are under their own heading, after every other option.
t=$(grep -n '^testing and benchmarks' "$tmp/help" | cut -d: -f1)
for o in --kill-at --inject-inf --bad-push --clock-skew-ms --slowdown --log-data; do
  l=$(grep -n -- "^  $o " "$tmp/help" | head -n 1 | cut -d: -f1)
  [ -n "$t" ] && [ -n "$l" ] && [ "$l" -gt "$t" ] || bad "chorus-train --help: $o is not under testing"
done
timeout 10 "$train" --nonsense >"$tmp/out" 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "'--nonsense': not an option" "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 2 ] ||
  bad "an unknown option: $(cat "$tmp/err")"
timeout 10 "$train" --lr >"$tmp/out" 2>"$tmp/err"
[ $? -eq 2 ] && grep -q -- "--lr needs a value" "$tmp/err" || bad "a missing value: $(cat "$tmp/err")"

# ----------------------------------------------------------- chorus-data
rows=("-o -" "--tokenizer -" "--field -" "--vocab-size 100" "--vocab-size abc"
  "--vocab-sample 0" "--vocab-sample x" "--shard-tokens 0" "--shard-tokens 9999999999"
  "--val-fraction 1" "--val-fraction -0.1" "--val-fraction x" "--threads 0" "--threads 257"
  "--name a/b" "--vocab 1" "--vocab x")
prog=("$data")
table chorus-data "prepare in.txt" "" "${rows[@]}"
"$data" --help >"$tmp/help" 2>&1 || bad "chorus-data --help exits $?"
covered "$tmp/help" "${rows[@]}"
for s in "examples:" "prepare:" "check:"; do
  grep -q "^$s" "$tmp/help" || bad "chorus-data --help has no section '$s'"
done

# ------------------------------------------------------------- chorusrun
rows=("--master-addr -" "--log-dir -" "--rdzv-conf -" "--nproc-per-node 0" "--nproc-per-node x"
  "--nproc-per-node 4097" "--master-port 70000" "--master-port x" "--nnodes 0" "--nnodes x" "--node-rank 5000"
  "--rdzv-backend zk" "--rdzv-id a%b" "--rdzv-endpoint :" "--monitor-interval 0"
  "--elastic maybe" "--max-restarts -1" "--grace-period x" "--redirects 9" "--tee 9"
  "--cpu-bind some")
prog=("$run")
table chorusrun "" "-- true" "${rows[@]}"
"$run" --help >"$tmp/help" 2>&1 || bad "chorusrun --help exits $?"
covered "$tmp/help" "${rows[@]}"
for s in "examples:" "workers:" "several nodes" "failures:" "output:"; do
  grep -q "^$s" "$tmp/help" || bad "chorusrun --help has no section '$s'"
done

echo "$checked refusals checked"
[ "$fails" -eq 0 ] && echo "every option refuses nonsense by name" && exit 0
echo "$fails option check(s) FAILED"; exit 1
