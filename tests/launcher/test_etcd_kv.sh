#!/usr/bin/env bash
# test_etcd_kv.sh TEST_KV_ETCD FIXTURES_DIR
#
# The launcher's etcd client (src/launcher/kv_etcd.c) against a real etcd
# (tests/fixtures/etcd.sh on free random ports unless CHORUS_ETCD_KV_PORT
# says otherwise, state under a mktemp dir):
# (The test alone, against fake servers, is unit.test_kv_etcd.)
#   single    1 member: get/set/cas semantics, 1 MiB values, values etcd
#             refuses, two clients racing cas, round-trip latency
#   kill-m0   3 members, member 0 (the one the client talks to) SIGKILLed
#             while get/set/cas go on: no call may fail
#   kill-lead 3 members afresh, the leader SIGKILLed (an election) while
#             get/set/cas go on: no call may fail
# The same client over TLS and with authentication: test_etcd_secure.sh
# (test_kv_etcd secure, on the etcd it starts for chorusrun).
# Exits 77 (skipped, reason printed) when etcd cannot be installed or run
# here.  The EXIT trap always takes etcd down and removes the state.
set -u
. "$(dirname "$0")/../lib.sh"

# Internal: the kill command the test runs in the middle of its calls.
if [ "${1:-}" = --kill-leader ]; then
  # `endpoint status` lines: "addr, id, version, size, IS LEADER, ..."
  i=0
  for ep in ${CHORUS_ETCD_ENDPOINTS//,/ }; do
    line=$(ETCDCTL_API=3 timeout 5 etcdctl --endpoints="$ep" --dial-timeout=2s endpoint status 2>/dev/null)
    if [ "$(cut -d, -f5 <<<"$line" | tr -d ' ')" = true ]; then
      echo "killing the leader, member $i ($ep)"
      exec bash "$2/etcd.sh" kill-member "$i"
    fi
    i=$((i + 1))
  done
  echo "no leader found among $CHORUS_ETCD_ENDPOINTS" >&2
  exit 1
fi

BIN=$1 FIXTURES=$2
ETCD=$FIXTURES/etcd.sh
tmp_dir etcd-kv
export CHORUS_ETCD_DIR=$TMP/etcd CHORUS_ETCD_PORT=${CHORUS_ETCD_KV_PORT:-}
unset CHORUS_ETCD_ADDR # loopback: the test checks the local address it reports

on_exit 'bash "$ETCD" down >/dev/null 2>&1'

# up N: N members, CHORUS_ETCD_ENDPOINTS set; skips the test (77) when
# etcd cannot be had here.
up() {
  local out rc
  out=$(CHORUS_ETCD_MEMBERS=$1 bash "$ETCD" up 2>"$TMP/up.err")
  rc=$?
  if ((rc == 77)); then echo "SKIPPED: $(tail -n 1 "$TMP/up.err")"; exit 77; fi
  if ((rc != 0)); then
    cat "$TMP/up.err"
    echo "FAIL etcd with $1 member(s) did not start (etcd.sh up exited $rc)"
    exit 1
  fi
  eval "$out"
  echo "etcd: $1 member(s) at $CHORUS_ETCD_ENDPOINTS"
}

# run NAME ARGS...: the test binary, its output indented.  Each run is
# bounded here (a few seconds normally), so CTest's timeout, whose kill
# skips the EXIT trap, is never what stops a hung one.
run() {
  local name=$1
  shift
  if timeout -k 5 90 "$BIN" "$@" >"$TMP/$name.out" 2>&1; then
    sed 's/^/    /' "$TMP/$name.out"
    ok "$name"
  else
    sed 's/^/    /' "$TMP/$name.out"
    fail "$name"
  fi
}

up 1
run single single "$CHORUS_ETCD_ENDPOINTS"

bash "$ETCD" down >/dev/null 2>&1
up 3
run kill-m0 cluster "$CHORUS_ETCD_ENDPOINTS" "bash '$ETCD' kill-member 0"

bash "$ETCD" down >/dev/null 2>&1
up 3
export CHORUS_ETCD_ENDPOINTS
run kill-lead cluster "$CHORUS_ETCD_ENDPOINTS" "bash '$0' --kill-leader '$FIXTURES'"

summary "all passed" failed
