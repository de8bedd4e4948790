#!/usr/bin/env bash
# The tuning table: chorus-bench --tune writes one for this group (4 ranks
# over TCP: "flat"), a hand-written one steers the automatic choice (the
# algo column and the DEBUG log name its rule, the results check out), a
# bad one fails the world's creation naming its line.
#   test_tuning.sh CHORUSRUN CHORUS_BENCH
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 BENCH=$2
tmp_dir tuning
export CHORUS_TRANSPORT=tcp CHORUS_TIMEOUT=60
unset CHORUS_TUNING_FILE CHORUS_ALGO CHORUS_ALL_REDUCE_ALGO

# 1. A tuning run writes rules for every tuned collective.
"$RUN" --standalone -n 4 -- "$BENCH" --tune "$TMP/t.tune" -b 1K -e 256K -f 16 -n 3 -w 1 \
  >"$TMP/tune.out" 2>&1
rc=$?
n=$(grep -cE '^(all_reduce|reduce_scatter|all_gather|broadcast|reduce) +flat +4 +[0-9]+-[0-9]* +[a-z_]+$' "$TMP/t.tune" 2>/dev/null)
if ((rc == 0)) && ((n >= 5)) && grep -q "wrote $TMP/t.tune" "$TMP/tune.out"; then
  ok "--tune wrote $n rules for 4 ranks (flat)"
else
  fail "--tune: exit $rc, $n rules"; tail -n 20 "$TMP/tune.out"; cat "$TMP/t.tune" 2>/dev/null
fi
# ... which the library loads and follows.
CHORUS_TUNING_FILE=$TMP/t.tune "$RUN" --standalone -n 4 -- "$BENCH" -b 1K -e 256K -f 16 -n 2 -w 0 \
  >"$TMP/use.out" 2>&1
want=$(awk '$1 == "all_reduce" { print $5 }' "$TMP/t.tune" | head -n 1)
got=$(grep -E '^\[rank0\]: +1024 ' "$TMP/use.out" | awk '{ print $7 }')
if [ $? = 0 ] && [ -n "$want" ] && [ "$got" = "$want" ] && grep -q "Wrong elements *: 0 OK" "$TMP/use.out"; then
  ok "CHORUS_TUNING_FILE followed: all_reduce of 1 KiB ran $got, as the tuning run chose"
else
  fail "the tuned table: 1 KiB ran '$got', the file says '$want'"; tail -n 20 "$TMP/use.out"
fi

# 2. A hand-written rule beats the built-in ones; the DEBUG log names it.
printf '# force\nall_reduce flat 4 1K- rabenseifner   # a comment\n' >"$TMP/h.tune"
CHORUS_TUNING_FILE=$TMP/h.tune CHORUS_LOG_LEVEL=DEBUG CHORUS_LOG_SUBSYS=ALGO \
  "$RUN" --standalone -n 4 -- "$BENCH" -b 512 -e 1M -f 4 -n 2 -w 0 >"$TMP/h.out" 2>&1
algos=$(grep -E '^\[rank0\]: +[0-9]+ ' "$TMP/h.out" | awk '{ print $2 ":" $7 }' | tr '\n' ' ')
if [[ $algos == "512:recursive_doubling 2048:rabenseifner 8192:rabenseifner 32768:rabenseifner 131072:rabenseifner 524288:rabenseifner "* ]] &&
  grep -q "Wrong elements *: 0 OK" "$TMP/h.out" &&
  grep -q "algo: all_reduce of 2048 bytes on 4 ranks (flat): rabenseifner, by $TMP/h.tune line 2" "$TMP/h.out" &&
  grep -q "algo: all_reduce of 512 bytes on 4 ranks (flat): recursive_doubling, by the built-in table" "$TMP/h.out"; then
  ok "hand-written rule: rabenseifner from 1 KiB, the built-in table below it; DEBUG names each rule"
else
  fail "hand-written rule: $algos"; grep -m3 "algo:" "$TMP/h.out"
fi

# 3. A bad file fails init on every rank, naming the line.
printf 'all_reduce flat 4 0-10 ring\nall_reduce flat 4 any no_such_algo\n' >"$TMP/bad.tune"
CHORUS_TUNING_FILE=$TMP/bad.tune "$RUN" --standalone -n 2 -- "$BENCH" -b 1K -e 1K >"$TMP/bad.out" 2>&1
rc=$?
if ((rc != 0)) && grep -q "bad.tune line 2: all_reduce has no algorithm 'no_such_algo'" "$TMP/bad.out"; then
  ok "bad file: init fails naming line 2"
else
  fail "bad file: exit $rc"; tail -n 5 "$TMP/bad.out"
fi
summary "all checks passed"
