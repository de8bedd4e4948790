#!/usr/bin/env bash
# Collectives across emulated hosts (tests/fixtures/netns.sh), 2 hosts x 2
# ranks under chorusrun --nnodes (c10d rendezvous): shared memory between
# the ranks of a host, TCP between hosts, the host map learned at the
# rendezvous.
#   matrix    the whole collective matrix (test_colls --big: every algorithm
#             of every collective forced in turn, flat and hierarchical)
#   streams   the same with 4 piece connections per rank and peer
#             (CHORUS_SOCKET_NSTREAMS): messages over 1 MiB dealt over them
#   ucx       the same with UCX between hosts (CHORUS_TRANSPORT=ucx: its tcp
#             transport over the emulated links)
#   lossy     links with 1 ms delay and 1 % loss: all_reduce (every
#             algorithm) and all_to_all stay right
#   linkdown  host 1 unplugged in the middle of a stream of 16 MiB
#             all_reduces: every rank fails within the timeout, and each
#             host's ranks name a rank of the other host
#   linkdown_ucx  the same over UCX
#   test_hosts.sh CHORUSRUN TEST_COLLS CHORUS_BENCH FIXTURES_DIR [CASE...]
# (all four by default; CTest runs one case per test).  Needs root; exits 77
# (skipped, reason printed) when the hosts, or the shaping a case needs
# (lossy: the kernel's sch_netem), cannot be made here.
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 COLLS=$2 BENCH=$3 FIXTURES=$4
shift 4
CASES=${*:-matrix streams ucx lossy linkdown linkdown_ucx}
. "$FIXTURES/hosts_test.sh"
hosts_test_begin hosts

cp "$RUN" "$TMP/chorusrun" && cp "$COLLS" "$TMP/test_colls" && cp "$BENCH" "$TMP/chorus-bench" || exit 1
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key
unset CHORUS_JOB_SECRET RANK WORLD_SIZE MASTER_ADDR MASTER_PORT CHORUS_ALGO CHORUS_TRANSPORT CHORUS_HOST_ID

port=$((20000 + RANDOM % 20000))
# launch NAME LIMIT_S CMD...: one chorusrun per host, 2 ranks each; sets PID[]
launch() {
  local name=$1 limit=$2 i
  shift 2
  port=$((port + 1))
  for i in 0 1; do
    bash "$NETNS" exec "$i" timeout -s KILL "$limit" "$TMP/chorusrun" --nnodes 2 -n 2 \
      --cpu-bind none --rdzv-backend c10d --rdzv-endpoint "${ADDR[0]}:$port" \
      --rdzv-id "$name" -- "$@" >"$TMP/$name.h$i.out" 2>&1 &
    PID[i]=$!
  done
}
collect() { local i; for i in 0 1; do wait "${PID[i]}"; RC[i]=$?; done; }
tail_of() { echo "---- $1 (last lines)"; tail -n 15 "$1" | sed 's/^/  /'; }

# matrix_with NAME NSTREAMS [TRANSPORT]: the matrix with that many piece
# connections per rank and peer between hosts (messages over 1 MiB in
# pieces on them), or over UCX.
matrix_with() {
  local name=$1 how="$2 piece connection(s) per peer"
  hosts_up 2
  export CHORUS_TIMEOUT=60 CHORUS_SOCKET_NSTREAMS=$2
  if [ -n "${3:-}" ]; then export CHORUS_TRANSPORT=$3; how="CHORUS_TRANSPORT=$3"; fi
  launch "$name" 600 "$TMP/test_colls" --big
  collect
  unset CHORUS_TRANSPORT
  if ((RC[0] == 0 && RC[1] == 0)) && grep -q "passed, 0 failed" "$TMP/$name.h0.out" "$TMP/$name.h1.out"; then
    ok "$name: every collective and algorithm on 2 hosts x 2, $how ($(grep -ho '[0-9]* passed, 0 failed' "$TMP/$name.h0.out" "$TMP/$name.h1.out" | head -n 1))"
  else
    fail "$name: exit ${RC[*]}"
    tail_of "$TMP/$name.h0.out"
    tail_of "$TMP/$name.h1.out"
  fi
  grep -h "FAIL\|wrong" "$TMP/$name".h*.out | head -n 5
  unset CHORUS_SOCKET_NSTREAMS
}
case_matrix() { matrix_with matrix 1; }
case_streams() { matrix_with streams 4; }
case_ucx() { matrix_with ucx 1 ucx; }

case_lossy() {
  hosts_up 2 --delay 1 --loss 1
  export CHORUS_TIMEOUT=60
  local c rcs=""
  for c in all_reduce all_to_all; do
    launch "lossy-$c" 600 "$TMP/test_colls" --only "$c"
    collect
    rcs+="$c:${RC[0]}${RC[1]} "
    if ((RC[0] != 0 || RC[1] != 0)) || ! grep -q "passed, 0 failed" "$TMP/lossy-$c.h0.out" "$TMP/lossy-$c.h1.out"; then
      fail "lossy: $c with 1 ms delay and 1 % loss: exit ${RC[*]}"
      tail_of "$TMP/lossy-$c.h0.out"
      return
    fi
  done
  ok "lossy: all_reduce and all_to_all right with 1 ms delay and 1 % loss ($rcs)"
}

# The ranks are started directly (RANK, WORLD_SIZE, MASTER_ADDR; rank 0
# serves the store), not by chorusrun: its agents would notice the lost
# node within a second and end the job themselves, and this case is about
# what the library does on its own.
case_linkdown() {
  hosts_up 2
  local r h t0 ms i tr=${1:-tcp}
  port=$((port + 1))
  for r in 0 1 2 3; do
    h=$((r / 2))
    bash "$NETNS" exec "$h" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$((r % 2)) LOCAL_WORLD_SIZE=2 \
      MASTER_ADDR="${ADDR[0]}" MASTER_PORT=$port CHORUS_TIMEOUT=5 CHORUS_PEER_TIMEOUT_MS=3000 \
      CHORUS_TRANSPORT=$([ "$tr" = ucx ] && echo ucx || echo auto) \
      timeout -s KILL 120 "$TMP/chorus-bench" -b 16M -e 16M -n 100000 -w 0 -c 0 \
      >"$TMP/linkdown.r$r.out" 2>&1 &
    PID[r]=$!
  done
  for i in $(seq 300); do grep -q "float32" "$TMP/linkdown.r0.out" && break; sleep 0.1; done
  sleep 1 # the header comes before the first timed call: let a few run
  t0=$(date +%s%N)
  bash "$NETNS" link 1 down
  for r in 0 1 2 3; do wait "${PID[r]}"; RC[r]=$?; done
  ms=$((($(date +%s%N) - t0) / 1000000))
  bash "$NETNS" link 1 up
  # Ranks 0, 1 are on host 0, ranks 2, 3 on host 1: each must fail (exit 1,
  # not killed by the time limit) naming a rank of the other host.
  local bad="" other
  for r in 0 1 2 3; do
    if ((r < 2)); then other=23; else other=01; fi
    if ((RC[r] != 1)) || ! grep -qE "rank [$other]\b" "$TMP/linkdown.r$r.out"; then
      bad+=" rank $r (exit ${RC[r]})"
    fi
  done
  if [ -z "$bad" ] && ((ms < 20000)); then
    ok "linkdown ($tr): host 1 unplugged mid-all_reduce; every rank failed within ${ms} ms (CHORUS_TIMEOUT=5, CHORUS_PEER_TIMEOUT_MS=3000) naming a rank of the other host"
    sed -n 's/^chorus-bench: \(rank 0: .\{0,300\}\).*/  \1/p' "$TMP/linkdown.r0.out" | head -n 1
  else
    fail "linkdown ($tr): after ${ms} ms:${bad:- too slow}"
    for r in 0 1 2 3; do tail_of "$TMP/linkdown.r$r.out"; done
  fi
}

for c in $CASES; do
  case $c in
    matrix | streams | ucx | lossy | linkdown) "case_$c" ;;
    linkdown_ucx) case_linkdown ucx ;;
    *) echo "unknown case $c"; exit 2 ;;
  esac
done
summary "all checks passed"
