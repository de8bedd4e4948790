#!/usr/bin/env bash
# chorus-bench --links on 3 emulated hosts (tests/fixtures/netns.sh), one
# rank each, chorusrun's c10d rendezvous, with host 2's outgoing link
# shaped to 40 Mbit/s: the matrices are printed, the links named slow for
# their bandwidth are exactly the two leaving the rank on host 2, and every pair's link is TCP over eth0
# between the hosts' addresses.
#   test_links.sh CHORUSRUN CHORUS_BENCH FIXTURES_DIR
# Needs root; exits 77 (skipped, reason printed) when hosts cannot be made.
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 BENCH=$2 FIXTURES=$3
. "$FIXTURES/hosts_test.sh"
hosts_test_begin links

cp "$RUN" "$TMP/chorusrun" && cp "$BENCH" "$TMP/chorus-bench" || exit 1
hosts_up 3
if ! err=$(bash "$NETNS" exec 2 tc qdisc add dev eth0 root tbf rate 40mbit burst 32kb latency 100ms 2>&1); then
  echo "SKIPPED: cannot shape host 2's link: $err"; exit 77
fi
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key CHORUS_TIMEOUT=60
unset CHORUS_JOB_SECRET RANK WORLD_SIZE MASTER_ADDR MASTER_PORT

port=$((20000 + RANDOM % 20000))
for i in 0 1 2; do
  bash "$NETNS" exec "$i" timeout -s KILL 100 "$TMP/chorusrun" --nnodes 3 -n 1 --rdzv-backend c10d \
    --rdzv-endpoint "${ADDR[0]}:$port" --rdzv-id links -- "$TMP/chorus-bench" --links -e 1M \
    >"$TMP/h$i.out" 2>&1 &
  PID[i]=$!
done
for i in 0 1 2; do wait "${PID[i]}"; RC[i]=$?; done
# Rank 0 prints the report; chorusrun numbers the nodes in arrival order,
# so it is on whichever host came first.
OUT=$TMP/h0.out
for i in 0 1 2; do grep -q "^\[rank0\]:" "$TMP/h$i.out" && { OUT=$TMP/h$i.out; break; }; done
if ((RC[0] == 0 && RC[1] == 0 && RC[2] == 0)); then ok "every host exits 0"
else fail "exit statuses ${RC[*]}"; fi
grep -q "bandwidth (MB/s), row = from" "$OUT" && grep -q "one-way latency (us)" "$OUT" &&
  ok "both matrices printed" || fail "matrices missing"
# The rank on host 2 (chorusrun numbers the nodes in arrival order): the
# one whose links leave from host 2's address.
r2=$(grep -oE "^\[rank0\]:#   [0-2] [^ ]+ -> [0-2] [^ ]+: tcp ${ADDR[2]//./\\.}:" "$OUT" | head -n 1 |
     sed -E 's/^\[rank0\]:#   ([0-2]).*/\1/')
want=$(for o in 0 1 2; do [ "$o" != "$r2" ] && printf '%s -> %s,' "$r2" "$o"; done)
# The links named for their bandwidth (under half the median): exactly the
# shaped ones.  A link named for its latency alone (over twice the median)
# is what a busy machine does to a 40 us ping-pong, not the shaping.
med=$(sed -nE 's/^\[rank0\]:# medians: latency [0-9.]+ us, bandwidth ([0-9.]+) MB\/s.*/\1/p' "$OUT")
slow=$(grep -oE "^\[rank0\]:#   [0-9] -> [0-9]: [0-9]+ MB/s" "$OUT" |
       awk -v m="${med:-0}" '{split($0, a, "#   "); split(a[2], b, ": "); bw = b[2] + 0; if (bw < m / 2) print b[1]}' |
       sort | tr '\n' ',')
if [ -n "$r2" ] && [ -n "$med" ] && [ "$slow" = "$want" ]; then
  ok "slow links named for bandwidth: $slow (rank $r2 is on the shaped host)"
else fail "links named for bandwidth '$slow', expected '$want' (rank '$r2' on the shaped host, median '$med' MB/s)"; fi
nlinks=$(grep -cE "^\[rank0\]:#   [0-2] [^ ]+ -> [0-2] [^ ]+: tcp 10\.[0-9.]+:[0-9]+ -> 10\.[0-9.]+:[0-9]+ \(eth0\)" "$OUT")
if ((nlinks == 6)); then ok "all 6 directed links: tcp over eth0 between the hosts' addresses"
else fail "$nlinks of 6 link lines name tcp over eth0"; fi
if ((FAILS)); then
  echo "---- rank 0's output:"; sed 's/^/  /' "$OUT" | tail -n 40
else
  sed -n '/one-way latency/,/no slow\|slow links/p' "$OUT" | head -n 14
fi
summary "all checks passed"
