#!/usr/bin/env bash
# examples/train_elastic resumes exactly as chorus-train does: a loop of
# one's own that keeps checkpoints (CKPT_DIR) and stops after step 9
# (STOP_AT), run again, goes on from its step-8 checkpoint -- the model,
# the optimizer and the data's position -- so its losses of steps 8-15
# are the uninterrupted run's, digit for digit.  Then the same checkpoint
# on 2 ranks instead of 4: it resumes there too.
#   train_resume.sh CHORUSRUN TRAIN_ELASTIC DATA
set -u
. "$(dirname "$0")/../lib.sh"
run=$1 prog=$2 data=$3
tmp_dir resume
train() { # DIR RANKS [STOP_AT]: rank 0's lines
  CKPT_DIR=$TMP/$1 STOP_AT=${3:--1} CHORUS_TIMEOUT=60 OPENBLAS_NUM_THREADS=1 \
    timeout 120 "$run" --standalone -n "$2" -- "$prog" "$data" >"$TMP/out" 2>&1 ||
    { fail "train_elastic (CKPT_DIR=$1, $2 ranks, STOP_AT=${3:--1}) exited $?"; sed 's/^/  | /' "$TMP/out"; }
  sed -n 's/^\[rank0\]://p' "$TMP/out"
}
losses() { sed -n 's/^step *\([0-9]*\): loss \([0-9.]*\) .*/\1 \2/p'; }

train whole 4 >"$TMP/whole.log"
train cut 4 9 >"$TMP/first.log"
train cut 4 >"$TMP/second.log"
[[ $(losses <"$TMP/whole.log" | wc -l) == 16 ]] && ok "the uninterrupted run trained 16 steps" ||
  fail "the uninterrupted run: $(cat "$TMP/whole.log")"
[[ $(losses <"$TMP/first.log" | tail -1) == "9 "* ]] && ok "STOP_AT=9 stopped after step 9" ||
  fail "STOP_AT=9: $(cat "$TMP/first.log")"
grep -q "^resumed from $TMP/cut/ckpt-000000008 at step 8$" "$TMP/second.log" &&
  ok "the second run resumed from the step-8 checkpoint" ||
  fail "no resume line: $(cat "$TMP/second.log")"
want=$(losses <"$TMP/whole.log" | awk '$1 >= 8')
got=$(losses <"$TMP/second.log")
if [[ -n $got && $got == "$want" ]]; then
  ok "steps 8-15 after the resume have the uninterrupted run's losses"
else
  fail "losses after the resume differ:"; paste <(echo "$want") <(echo "$got") | sed 's/^/  | /'
fi
# The same checkpoint on 2 ranks (each rank's batch stays 8, so the steps
# are not the 4-rank run's: only that it goes on from there).
rm -rf "$TMP/cut2" && cp -r "$TMP/cut" "$TMP/cut2" && rm -rf "$TMP/cut2"/ckpt-000000016
train cut2 2 >"$TMP/two.log"
grep -q "^resumed from $TMP/cut2/ckpt-000000012 at step 12$" "$TMP/two.log" &&
  ok "a 4-rank checkpoint resumes on 2 ranks" || fail "2 ranks: $(cat "$TMP/two.log")"
[[ $(losses <"$TMP/two.log" | awk '{ printf "%s ", $1 }') == "12 13 14 15 " ]] &&
  ok "and trains steps 12-15 there" || fail "2 ranks' steps: $(losses <"$TMP/two.log" | tr '\n' ' ')"
summary
