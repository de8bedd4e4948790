#!/usr/bin/env bash
# test_etcd_secure.sh CHORUSRUN WORKER TEST_KV_ETCD FIXTURES_DIR [CASE...]
#
# chorusrun's etcd rendezvous against a real etcd that is locked down, and
# attacked (tests/fixtures/etcd.sh on a free random port, state in a mktemp
# dir; two agents on this machine, each one node of the job):
#   tls     etcd with TLS and client-certificate authentication: a job with
#           --rdzv-conf protocol=https,cacert,cert,key forms its world and
#           finishes, and leaves no key behind; a client certificate from
#           another CA, a wrong CA for the server and plain http are refused
#           with a message naming the cause, in seconds; the client's
#           semantics, cas race and latency over TLS (test_kv_etcd secure)
#   auth    etcd with user/password authentication: a job with user=,
#           password_file= finishes while a stranger without credentials tries to
#           forge its state (etcd refuses him); a wrong password and no credentials are
#           refused at once, clearly; the client's semantics with
#           authentication and tokens living 2 s, one idle past its token
#   replay  plain etcd, someone who can write to it: an agent is SIGKILLed
#           and two of its old (sealed) heartbeats are put back in turn; the
#           other agent must still find it lost and end the job
# Exits 77 (skipped, reason printed) when etcd cannot be installed or run.
# The EXIT trap kills our agents and workers (private copies under the
# mktemp dir, so pkill -f finds only ours) and takes etcd down.
set -u
. "$(dirname "$0")/../lib.sh"
RUN=$1 WORKER=$2 KV=$3 FIXTURES=$4
shift 4
CASES=${*:-tls auth replay}
ETCD=$FIXTURES/etcd.sh
tmp_dir etcd-sec
export CHORUS_ETCD_DIR=$TMP/etcd
unset CHORUS_ETCD_ADDR CHORUS_ETCD_PORT CHORUS_ETCD_MEMBERS RANK WORLD_SIZE MASTER_ADDR MASTER_PORT

cleanup() {
  pkill -KILL -f "$TMP/" 2>/dev/null
  bash "$ETCD" down >/dev/null 2>&1
}
on_exit cleanup

cp "$RUN" "$TMP/chorusrun" && cp "$WORKER" "$TMP/worker" || exit 1
RUN=$TMP/chorusrun WORKER=$TMP/worker
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key

fail_details() {
  for f in "$TMP"/*.out; do
    [ -e "$f" ] && { echo "---- $(basename "$f"):"; tail -n 15 "$f" | cut -c1-300; }
  done
}

# up SECURE: etcd afresh; sets EP (and the env the fixture prints)
up() {
  local out rc
  bash "$ETCD" down >/dev/null 2>&1
  out=$(CHORUS_ETCD_SECURE=$1 bash "$ETCD" up 2>"$TMP/up.err")
  rc=$?
  if ((rc == 77)); then echo "SKIPPED: $(tail -n 1 "$TMP/up.err")"; exit 77; fi
  if ((rc != 0)); then cat "$TMP/up.err"; echo "FAIL etcd ($1) did not start"; exit 1; fi
  eval "$out"
  EP=$CHORUS_ETCD_ENDPOINTS
}

# keys PREFIX [ETCDCTL ARGS]: how many keys start with PREFIX
keys() {
  local p=$1
  shift
  ETCDCTL_API=3 timeout 10 etcdctl --endpoints="$EP" "$@" get --prefix --keys-only "$p" |
    grep -c .
}

# job NAME ID CONF PROG...: two agents (one node each) in the background,
# output in $TMP/NAME.a.out and NAME.b.out; their pids in PA, PB.
job() {
  local name=$1 id=$2 conf=$3
  shift 3
  "$RUN" --nnodes 2 -n 1 --rdzv-backend etcd --rdzv-endpoint "$EP" --rdzv-id "$id" \
    --rdzv-conf "$conf" "$@" >"$TMP/$name.a.out" 2>&1 &
  PA=$!
  "$RUN" --nnodes 2 -n 1 --rdzv-backend etcd --rdzv-endpoint "$EP" --rdzv-id "$id" \
    --rdzv-conf "$conf" "$@" >"$TMP/$name.b.out" 2>&1 &
  PB=$!
}

# wait_pid PID SECONDS: its exit status, or 124 after SIGKILL past the bound
wait_pid() {
  local end=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && ((SECONDS < end)); do sleep 0.05; done
  if kill -0 "$1" 2>/dev/null; then
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
    return 124
  fi
  wait "$1"
}

# refused NAME CONF WANT: one agent alone (on REFUSED_EP if set) must fail
# within 15 s (join timeout 60) saying WANT; prints how long it took
refused() {
  local name=$1 conf=$2 want=$3 t0 rc ms
  t0=$(now_ms)
  "$RUN" --nnodes 2 -n 1 --rdzv-backend etcd --rdzv-endpoint "${REFUSED_EP:-$EP}" \
    --rdzv-id "refused$$" --rdzv-conf "join_timeout=60,$conf" "$WORKER" exit 0 0 \
    >"$TMP/$name.out" 2>&1 &
  wait_pid $! 20
  rc=$? ms=$(($(now_ms) - t0))
  if ((rc != 0 && rc != 124 && ms < 15000)) && grep -q -- "$want" "$TMP/$name.out"; then
    ok "$name: refused in $ms ms: $(grep -m1 -- "$want" "$TMP/$name.out" | cut -c1-220)"
  else
    fail "$name: rc $rc after $ms ms, wanted a message with '$want'"
  fi
}

# client NAME VAR=VALUE...: test_kv_etcd secure on this etcd with those
# variables (its TLS files or credentials)
client() {
  local name=$1
  shift
  if env "$@" timeout -k 5 90 "$KV" secure "$EP" >"$TMP/$name-client.out" 2>&1; then
    ok "$name: the etcd client ($(grep -c '^ok' "$TMP/$name-client.out") checks; $(grep -m1 'latency cas' "$TMP/$name-client.out" | sed 's/^ *//'))"
  else
    sed 's/^/    /' "$TMP/$name-client.out"
    fail "$name: the etcd client"
  fi
}

case_tls() {
  up tls
  local t=$CHORUS_ETCD_TLS_DIR id="tls$$"
  local tlsconf="protocol=https,cacert=$t/ca.pem,cert=$t/client.pem,key=$t/client-key.pem"
  local ctl=(--cacert "$t/ca.pem" --cert "$t/client.pem" --key "$t/client-key.pem")
  job tls "$id" "$tlsconf" "$WORKER" store
  wait_pid "$PA" 60
  local ra=$?
  wait_pid "$PB" 60
  local rb=$?
  local left
  left=$(keys "/chorus/rdzv/$id/" "${ctl[@]}")
  if ((ra == 0 && rb == 0)) && [[ $(cat "$TMP"/tls.?.out | grep -c 'store ok') == 2 ]]; then
    ok "tls: two nodes met through etcd over TLS with client certificates; workers used the store"
  else
    fail "tls: rc $ra $rb"
  fi
  if [[ $left == 0 ]]; then ok "tls: the finished job left no key under /chorus/rdzv/$id/"
  else fail "tls: the finished job left $left keys under /chorus/rdzv/$id/"; fi
  refused tls-stranger-cert "protocol=https,cacert=$t/ca.pem,cert=$t/other.pem,key=$t/other-key.pem" \
    "certificate"
  refused tls-wrong-ca "protocol=https,cacert=$t/other-ca.pem,cert=$t/client.pem,key=$t/client-key.pem" \
    "does not check out"
  REFUSED_EP=${EP//https:\/\//} refused tls-plain-http "protocol=http" "serve https"
  client tls CHORUS_TEST_ETCD_CACERT="$t/ca.pem" CHORUS_TEST_ETCD_CERT="$t/client.pem" \
    CHORUS_TEST_ETCD_KEY="$t/client-key.pem"
}

case_auth() {
  CHORUS_ETCD_TOKEN_TTL=2 up auth
  local id="auth$$" conf="user=$CHORUS_ETCD_USER,password_file=$CHORUS_ETCD_PASSWORD_FILE"
  local t0
  t0=$(now_ms)
  job auth "$id" "$conf" sleep 3
  # A stranger without credentials forges the state while the job runs.
  sleep 1.5
  local forged
  forged=$(python3 - "$EP" "/chorus/rdzv/$id/state" <<'PY'
import base64, json, sys, urllib.error, urllib.request
ep, key = sys.argv[1:3]
b64 = lambda s: base64.b64encode(s.encode()).decode()
body = json.dumps({"key": b64(key), "value": b64("chorus-rdzv 1\nphase closed\nexit 3\n")})
try:
    urllib.request.urlopen(urllib.request.Request("http://%s/v3/kv/put" % ep, body.encode()), timeout=5)
    print("accepted")
except urllib.error.HTTPError as e:
    print("refused HTTP %d" % e.code)
except Exception as e:
    print("error %s" % e)
PY
)
  wait_pid "$PA" 60
  local ra=$?
  wait_pid "$PB" 60
  local rb=$?
  if ((ra == 0 && rb == 0)) && [[ $forged == refused* ]]; then
    ok "auth: a job of $(($(now_ms) - t0)) ms on etcd with user/password authentication; a stranger's forged state was $forged"
  else
    fail "auth: rc $ra $rb, a stranger's forged state: $forged"
  fi
  echo "not-the-password" >"$TMP/badpw"
  refused auth-wrong-password "user=$CHORUS_ETCD_USER,password_file=$TMP/badpw" "refused user"
  refused auth-no-credentials "heartbeat=0.15" "authentication enabled"
  client auth CHORUS_TEST_ETCD_USER="$CHORUS_ETCD_USER" \
    CHORUS_TEST_ETCD_PASSWORD_FILE="$CHORUS_ETCD_PASSWORD_FILE" CHORUS_TEST_ETCD_TOKEN_TTL=2
}

case_replay() {
  up ""
  local id="replay$$"
  job replay "$id" "heartbeat=0.2" "$WORKER" round-wait 5
  local end=$((SECONDS + 30))
  until [[ $(cat "$TMP"/replay.?.out 2>/dev/null | grep -c 'start round 0') == 2 ]] || ((SECONDS > end)); do
    sleep 0.1
  done
  # B's heartbeat key, two of its values a while apart, then B dies.
  python3 - "$EP" "/chorus/rdzv/$id/hb/" "$PB" "$TMP/replay.vals" <<'PY'
import base64, json, sys, time, urllib.request
ep, prefix, pid, out = sys.argv[1:5]
def post(path, body):
    req = urllib.request.Request("http://%s%s" % (ep, path), json.dumps(body).encode())
    return json.load(urllib.request.urlopen(req, timeout=5))
b64 = lambda s: base64.b64encode(s.encode() if isinstance(s, str) else s).decode()
end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
vals, key = [], None
for _ in range(60):
    r = post("/v3/kv/range", {"key": b64(prefix), "range_end": b64(end)})
    for kv in r.get("kvs", []):
        k = base64.b64decode(kv["key"]).decode()
        if k.endswith("/" + pid):
            key = kv["key"]
            v = kv.get("value", "")
            if v not in vals: vals.append(v)
    if len(vals) >= 2: break
    time.sleep(0.25)
json.dump({"key": key, "vals": vals[:2]}, open(out, "w"))
print("recorded %d heartbeat values of agent %s" % (len(vals[:2]), pid))
PY
  kill -KILL "$PB"
  wait "$PB" 2>/dev/null
  # The replayer: the two old values in turn, each for 0.3 s (the agents
  # read a heartbeat every 0.2 s and call a node lost after 0.8 s without
  # a change), for 30 s.
  python3 - "$EP" "$TMP/replay.vals" <<'PY' &
import json, sys, time, urllib.request
ep, f = sys.argv[1:3]
d = json.load(open(f))
end = time.time() + 30
i = 0
while time.time() < end and d["key"] and len(d["vals"]) == 2:
    body = json.dumps({"key": d["key"], "value": d["vals"][i % 2]}).encode()
    try:
        urllib.request.urlopen(urllib.request.Request("http://%s/v3/kv/put" % ep, body), timeout=2)
    except Exception as e:
        print("replayer:", e, file=sys.stderr)
    i += 1
    time.sleep(0.3)
PY
  local replayer=$! t0
  t0=$(now_ms)
  wait_pid "$PA" 25
  local ra=$? ms=$(($(now_ms) - t0))
  kill "$replayer" 2>/dev/null
  wait "$replayer" 2>/dev/null
  if ((ra != 0 && ra != 124)) && grep -q 'was lost' "$TMP/replay.a.out" &&
    grep -q 'replay' "$TMP/replay.a.out"; then
    ok "replay: old heartbeats put back in turn did not keep a killed node alive: lost, job ended in $ms ms"
  else
    fail "replay: rc $ra after $ms ms (124: the survivor never found the killed node lost)"
  fi
}

for c in $CASES; do "case_$c"; done
summary "all passed" failed
