#!/usr/bin/env bash
# bench/launcher/startup.sh BUILD_DIR [REPS] [HxP ...]
#
# World formation on emulated hosts (tests/fixtures/netns.sh, needs root):
# for each layout H hosts x P ranks (default 1x2 2x4 8x4 16x4), REPS times
# (default 3), one chorusrun agent per host (c10d rendezvous on host 0)
# starting P workers that form the world with chorus_comm_init_env and
# all_reduce 4 KiB; prints the time from starting the agents to the last
# rank's init returning and to the last rank's first all_reduce returning
# (which makes the TCP connections its algorithm needs), and the sockets
# each worker has open at both points (store connection, data listener,
# shared-memory doorbells, TCP connections), median and maximum over the
# ranks.  Medians over the REPS.
# Example: sudo bash bench/launcher/startup.sh build 3 1x2 2x4 8x4 16x4 64x4
set -u
BUILD=$(cd "$1" && pwd) REPS=${2:-3}
shift $(($# >= 2 ? 2 : $#))
LAYOUTS=${*:-1x2 2x4 8x4 16x4}
HERE=$(cd "$(dirname "$0")" && pwd)
NETNS=$HERE/../../tests/fixtures/netns.sh
TMP=$(mktemp -d "${TMPDIR:-/tmp}/chorus-bstart.XXXXXX") || exit 1
export CHORUS_NETNS_DIR=$TMP/netns CHORUS_NETNS_PREFIX=cbs$$
cp "$BUILD/chorusrun" "$TMP/chorusrun" && cp "$BUILD/tests/launcher/launch_worker" "$TMP/worker" || exit 1
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
export CHORUS_JOB_SECRET_FILE=$TMP/key
cleanup() { pkill -KILL -f "$TMP/" 2>/dev/null; bash "$NETNS" down >/dev/null 2>&1; rm -rf "$TMP"; }
trap cleanup EXIT
now_ms() { date +%s%3N; }
median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : int((v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
PORT=29900
printf '%-8s %6s  %-24s %-24s %-14s %s\n' layout ranks "formed (ms, each rep)" \
  "1st all_reduce (ms)" "sockets formed" "sockets after 1st all_reduce (median / max)"
for lay in $LAYOUTS; do
  [[ $lay =~ ^([0-9]+)x([0-9]+)$ ]] || { echo "bad layout $lay (want HxP)"; exit 2; }
  H=${BASH_REMATCH[1]} P=${BASH_REMATCH[2]} N=$((H * P))
  bash "$NETNS" up "$H" >/dev/null || { echo "cannot make $H emulated hosts"; exit 1; }
  addr0=$(bash "$NETNS" addr 0)
  T=() T1=() SOCK=() SOCK1=()
  for rep in $(seq 1 "$REPS"); do
    PORT=$((PORT + 1))
    t0=$(now_ms)
    for ((i = 0; i < H; i++)); do
      bash "$NETNS" exec "$i" "$TMP/chorusrun" --nnodes "$H" -n "$P" --rdzv-endpoint "$addr0:$PORT" \
        --rdzv-id "s$lay-$rep" "$TMP/worker" reduce-loop 0 >"$TMP/h$i.out" 2>&1 </dev/null &
      disown
    done
    end=$((SECONDS + 120))
    while ((SECONDS < end)); do
      (($(cat "$TMP"/h*.out 2>/dev/null | grep -c 'first all_reduce done at') >= N)) && break
      sleep 0.02
    done
    last=$(cat "$TMP"/h*.out | sed -n 's/.*reducing round 0 at \([0-9]*\).*/\1/p' | sort -n | tail -n 1)
    [ -n "$last" ] && T+=($((last - t0)))
    last=$(cat "$TMP"/h*.out | sed -n 's/.*first all_reduce done at \([0-9]*\).*/\1/p' | sort -n | tail -n 1)
    [ -n "$last" ] && T1+=($((last - t0)))
    SOCK+=($(cat "$TMP"/h*.out | sed -n 's/.*reducing round 0 at [0-9]* sockets \([0-9]*\).*/\1/p'))
    SOCK1+=($(cat "$TMP"/h*.out | sed -n 's/.*first all_reduce done at [0-9]* sockets \([0-9]*\).*/\1/p'))
    pkill -KILL -f "$TMP/" 2>/dev/null
    wait 2>/dev/null
    rm -f "$TMP"/h*.out
  done
  printf '%-8s %6d  %-24s %-24s %-14s %s / %s\n' "$lay" "$N" \
    "${T[*]} (med $(printf '%s\n' "${T[@]}" | median))" \
    "${T1[*]} (med $(printf '%s\n' "${T1[@]}" | median))" \
    "$(printf '%s\n' "${SOCK[@]}" | median) / $(printf '%s\n' "${SOCK[@]}" | sort -n | tail -n 1)" \
    "$(printf '%s\n' "${SOCK1[@]}" | median)" "$(printf '%s\n' "${SOCK1[@]}" | sort -n | tail -n 1)"
done
