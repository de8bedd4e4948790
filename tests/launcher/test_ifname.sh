#!/usr/bin/env bash
# Which address a rank listens on for its peers, on 2 emulated hosts
# (tests/fixtures/netns.sh), one rank each, plain environment bootstrap
# (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 serves the store on
# every interface):
#   1. rank 0 reaches the store over loopback (MASTER_ADDR=127.0.0.1, as
#      with a host name that /etc/hosts maps to 127.0.1.1), rank 1 over the
#      network: rank 0 must not give rank 1 a loopback address -- the world
#      forms;
#   2. the control: the same with CHORUS_SOCKET_IFADDR=127.0.0.1 forced on
#      rank 0 fails on rank 1 (so case 1 can fail);
#   3. CHORUS_SOCKET_IFNAME=eth0, =eth0 and ^lo on both: the world forms;
#   4. CHORUS_SOCKET_IFNAME naming no interface (ib; =eth, exact): rank 0
#      fails with a message that lists this host's interfaces, and so does
#      the world.
#   test_ifname.sh BOOTSTRAP_CHECK FIXTURES_DIR
# Needs root; exits 77 (skipped, reason printed) when hosts cannot be made.
set -u
. "$(dirname "$0")/../lib.sh"
CHECK=$1 FIXTURES=$2
. "$FIXTURES/hosts_test.sh"
hosts_test_begin ifname

cp "$CHECK" "$TMP/bootstrap_check" || exit 1
CHECK=$TMP/bootstrap_check
hosts_up 2
A0=${ADDR[0]}
unset CHORUS_JOB_SECRET_FILE RANK WORLD_SIZE MASTER_ADDR MASTER_PORT LOCAL_WORLD_SIZE LOCAL_RANK \
  CHORUS_SOCKET_IFNAME CHORUS_SOCKET_IFADDR
export CHORUS_JOB_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export CHORUS_TIMEOUT=8 CHORUS_STORE_BIND_ALL=1 WORLD_SIZE=2

# world NAME "ENV0..." "ENV1...": rank 0 on host 0 (store over loopback),
# rank 1 on host 1; outputs in $TMP/NAME.rI, exit statuses in RC0 RC1,
# the slower rank's seconds in SECS.
world() {
  local name=$1 e0=$2 e1=$3 port=$((20000 + RANDOM % 20000)) t0=$SECONDS
  # (CHORUS_TEST_HOST: bootstrap_check's name for the host, whose host
  # name the namespaces share.)
  bash "$NETNS" exec 0 env RANK=0 CHORUS_TEST_HOST=h0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port $e0 \
    timeout -s KILL 30 "$CHECK" >"$TMP/$name.r0" 2>&1 &
  local p0=$!
  bash "$NETNS" exec 1 env RANK=1 CHORUS_TEST_HOST=h1 MASTER_ADDR="$A0" MASTER_PORT=$port $e1 \
    timeout -s KILL 30 "$CHECK" >"$TMP/$name.r1" 2>&1 &
  local p1=$!
  wait $p0; RC0=$?
  wait $p1; RC1=$?
  SECS=$((SECONDS - t0))
}
fail_details() { # MESSAGE NAME: the tails of world NAME's outputs
  for f in "$TMP"/"$2".r*; do [ -e "$f" ] && { echo "---- $(basename "$f"):"; tail -n 5 "$f"; }; done
}
formed() { # formed NAME: both ranks printed "bootstrap ok" and exited 0
  ((RC0 == 0 && RC1 == 0)) && grep -q "bootstrap ok" "$TMP/$1.r0" && grep -q "bootstrap ok" "$TMP/$1.r1"
}

# Rank 0 speaks 2 s late (CHORUS_TEST_DELAY_MS) here and in the control:
# pairs connect on their first message, whichever way it goes, and had rank
# 0 spoken first its connection would carry both directions -- rank 1 would
# never dial the address under test.
world loopback "CHORUS_TEST_DELAY_MS=2000" ""
if formed loopback; then ok "store over loopback on rank 0: the world forms across hosts"
else fail "store over loopback on rank 0: the world did not form" loopback; fi

world forced "CHORUS_SOCKET_IFADDR=127.0.0.1 CHORUS_TEST_DELAY_MS=2000" ""
if ((RC1 != 0)) && grep -q "127.0.0.1" "$TMP/forced.r1"; then
  ok "control: a loopback address forced on rank 0 fails rank 1 ($(grep -o 'cannot connect[^;]*' "$TMP/forced.r1" | head -n 1))"
else
  fail "control: rank 1 formed a world with rank 0 listening on loopback (exit $RC1)" forced
fi

for spec in eth0 =eth0 "^lo"; do
  world "ifname$spec" "CHORUS_SOCKET_IFNAME=$spec" "CHORUS_SOCKET_IFNAME=$spec"
  if formed "ifname$spec"; then ok "CHORUS_SOCKET_IFNAME=$spec: the world forms"
  else fail "CHORUS_SOCKET_IFNAME=$spec: the world did not form" "ifname$spec"; fi
done

world nosuch "CHORUS_SOCKET_IFNAME=ib" "CHORUS_SOCKET_IFNAME=ib"
if ((RC0 != 0 && RC1 != 0)) && [ "$(wc -l <"$TMP/nosuch.r0")" -ge 1 ] &&
   grep -q "CHORUS_SOCKET_IFNAME=ib matches no interface.*this host has: .*eth0" "$TMP/nosuch.r0"; then
  ok "CHORUS_SOCKET_IFNAME naming no interface: rank 0 fails naming the interfaces, rank 1 fails too (${SECS} s)"
else
  fail "CHORUS_SOCKET_IFNAME naming no interface (exit $RC0/$RC1, ${SECS} s)" nosuch
fi
world exact "CHORUS_SOCKET_IFNAME==eth" ""
if ((RC0 != 0)) && grep -q "CHORUS_SOCKET_IFNAME==eth matches no interface" "$TMP/exact.r0"; then
  ok "CHORUS_SOCKET_IFNAME==eth is exact: no interface is called eth"
else
  fail "CHORUS_SOCKET_IFNAME==eth matched an interface (exit $RC0)" exact
fi

summary "all checks passed"
