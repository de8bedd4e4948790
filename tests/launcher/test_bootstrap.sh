#!/usr/bin/env bash
# test_bootstrap.sh MODE BOOTSTRAP_CHECK TEST_COLLS [FIXTURES_DIR [CHORUSRUN [STRANGER]]]
#
# chorus_comm_init_env() with no flags under each way a program gets
# started.  MODE:
#   env    no launcher: stale or incomplete Slurm/Open MPI variables must be
#          refused at once with a clear message, explicit RANK/WORLD_SIZE win
#   hydra  MPICH's mpiexec.hydra (PMI-1 over PMI_FD), also with two fake
#          hosts (-launcher fork -hosts n0:2,n1:2)
#   ompi   Open MPI's mpirun (PMIx), also with two fake hosts (an rsh agent
#          that runs the command here)
#   slurm  a real Slurm (tests/fixtures/slurm.sh: slurmctld and two slurmd
#          on this machine): srun -N 2 --ntasks-per-node=2 with --mpi=pmi2
#          and --mpi=pmix, srun on one node without PMI, sbatch --wait of a
#          script like the one in the README, srun -N 2 without PMI or
#          secret, which must fail fast with a clear message, and chorusrun
#          on 2 nodes inside an srun allocation (one agent per node)
# Under each launcher a job with no secret configured is attacked while its
# world is up (attack below): every rank must name where its secret came
# from (a fresh one through the launcher's key-value service, or the
# runtime directory on one host without one), and a stranger (STRANGER,
# secret_stranger.c) with the public key or a key of its own must be
# refused by the job's store.
# Every run is bounded by `timeout`; a component that is not installed makes
# the mode exit 77 (CTest: skipped) after saying why.  The EXIT trap kills
# what this script started and stops the fixture.
set -u
. "$(dirname "$0")/../lib.sh"
MODE=$1 CHECK=$2 COLLS=$3 FIXTURES=${4:-} CHORUSRUN=${5:-} STRANGER=${6:-}
tmp_dir bootstrap
OUT=$TMP/out
SLURM_UP=0

cleanup() {
  if ((SLURM_UP)); then bash "$FIXTURES/slurm.sh" down >/dev/null 2>&1; fi
  pkill -KILL -f "$TMP/" 2>/dev/null
}
on_exit cleanup

# Private copies, so pkill -f $TMP/ finds exactly our processes.
cp "$CHECK" "$TMP/bootstrap_check" && cp "$COLLS" "$TMP/test_colls" || exit 1
CHECK=$TMP/bootstrap_check COLLS=$TMP/test_colls
if [[ -n $CHORUSRUN ]]; then cp "$CHORUSRUN" "$TMP/chorusrun" || exit 1; CHORUSRUN=$TMP/chorusrun; fi
if [[ -n $STRANGER ]]; then cp "$STRANGER" "$TMP/secret_stranger" || exit 1; STRANGER=$TMP/secret_stranger; fi

fail_details() {
  echo "---- output (first 30 lines):"; head -n 30 "$OUT" | cut -c1-300; echo "----"
}
skip() { echo "SKIPPED: $*"; exit 77; }

# run SECONDS cmd...: output to $OUT, sets RC and MS.
run() {
  local t=$1 t0
  shift
  t0=$(now_ms)
  timeout -s KILL "$t" "$@" >"$OUT" 2>&1 </dev/null
  RC=$?
  MS=$(($(now_ms) - t0))
}

# expect_world WHAT N: N "bootstrap ok" lines with ranks 0..N-1, rc 0.
expect_world() {
  local what=$1 n=$2 got ranks
  got=$(grep -c '^bootstrap ok' "$OUT")
  ranks=$(grep '^bootstrap ok' "$OUT" | awk '{print $4}' | sort -n | uniq | tr '\n' ' ')
  if [[ $RC == 0 && $got == "$n" && $ranks == "$(seq -s ' ' 0 $((n - 1))) " ]]; then
    ok "$what: $n ranks formed a world (${MS} ms)"
  else
    fail "$what: expected $n distinct ranks and rc 0, got $got lines, ranks '$ranks', rc $RC"
  fi
}

# expect_locals WHAT: every host's local ranks are 0..k-1.
expect_locals() {
  local what=$1 bad
  if ! grep -q '^bootstrap ok' "$OUT"; then fail "$what: no rank reported"; return; fi
  bad=$(grep '^bootstrap ok' "$OUT" | awk '{split($8, a, "/"); h[$10] = h[$10] " " a[1]; n[$10] = a[2]}
        END { for (k in h) { c = split(h[k], v, " "); if (c != n[k]) print k; } }')
  if [[ -z $bad ]]; then ok "$what: local ranks dense on every host"
  else fail "$what: local ranks wrong on: $bad"; fi
}

expect_colls() {
  if [[ $RC == 0 ]] && grep -q ' passed, 0 failed' "$OUT" && ! grep -q 'FAIL' "$OUT"; then
    ok "$1: every collective passed"
  else
    fail "$1: test_colls rc $RC"
  fi
}

# expect_error WHAT PATTERN MAX_MS: rc != 0, PATTERN in the output, fast.
expect_error() {
  if [[ $RC != 0 && $RC != 137 ]] && grep -q -- "$2" "$OUT" && ((MS <= $3)); then
    ok "$1: refused in ${MS} ms ($(grep -m1 -o -- "$2.\{0,60\}" "$OUT"))"
  else
    fail "$1: expected a failure naming '$2' within $3 ms, got rc $RC after $MS ms"
  fi
}

# The "job secret from" line (CHORUS_LOG_LEVEL=INFO) of a world that got a
# fresh secret through the launcher's key-value service: rank 0 made it,
# the others got it from there.
KVS_FRESH="(a fresh one this rank made, sent to the others|rank 0's fresh one,) through the launcher's key-value service"

# attack WHAT N SOURCE cmd...: runs cmd, a job of N bootstrap_check ranks,
# with CHORUS_LOG_LEVEL=INFO and CHORUS_TEST_HOLD; while its world is up,
# a stranger tries rank 0's store (its address from rank 0's "bootstrap:"
# line) with the public key and with its own.  Then: the world formed
# (expect_world), the stranger was refused, and every rank's "job secret
# from" line matches SOURCE (an extended regular expression).
attack() {
  local what=$1 n=$2 source=$3 hold=$TMP/hold pid t0 i store verdict got
  shift 3
  if [[ -z $STRANGER ]]; then run 60 "$@"; expect_world "$what" "$n"; return; fi
  rm -f "$hold"
  t0=$(now_ms)
  CHORUS_LOG_LEVEL=INFO CHORUS_TEST_HOLD=$hold timeout -s KILL 90 "$@" >"$OUT" 2>&1 </dev/null &
  pid=$!
  # Both lines: the launcher relays stdout (holding) and stderr (rank 0's
  # store, logged) apart, and srun's came out of order once.
  for ((i = 0; i < 600; i++)); do
    grep -q '^bootstrap holding' "$OUT" && grep -q 'bootstrap: rank 0/.*, store ' "$OUT" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  store=$(grep -m1 -o 'bootstrap: rank 0/.*, store [^ ]*' "$OUT" | sed 's/.*, store //')
  if [[ -n $store ]] && grep -q '^bootstrap holding' "$OUT"; then
    verdict=$("$STRANGER" "${store%:*}" "${store##*:}" 2>&1)
  else
    verdict="stranger: no world held open (store '$store')"
  fi
  touch "$hold"
  wait "$pid"
  RC=$?
  MS=$(($(now_ms) - t0))
  expect_world "$what" "$n"
  if [[ $verdict == "stranger: refused"* ]]; then ok "$what: $verdict"
  else fail "$what: $verdict"; fi
  got=$(grep -cE "job secret from $source" "$OUT")
  if [[ $got == "$n" ]]; then ok "$what: every rank's secret is from $(grep -m1 -oE "job secret from $source" "$OUT" | sed 's/job secret from //')"
  else fail "$what: $got of $n ranks say 'job secret from $source'"; fi
}

mode_env() {
  local clean=(env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u LOCAL_RANK
    -u LOCAL_WORLD_SIZE -u GROUP_WORLD_SIZE -u PMI_FD -u PMI_RANK -u PMI_SIZE
    -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE CHORUS_TIMEOUT=20)
  run 30 "${clean[@]}" "$CHECK"
  expect_error "no launcher at all" "RANK and WORLD_SIZE are not set" 3000
  # An sbatch script's own process has SLURM_PROCID but no step: not a task.
  run 30 "${clean[@]}" SLURM_JOB_ID=7 SLURM_PROCID=1 SLURM_NTASKS=4 "$CHECK"
  expect_error "SLURM_PROCID without a step" "not believed" 3000
  # A child of a task (its SLURM_TASK_PID is someone else's).
  run 30 "${clean[@]}" SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_TASK_PID=1 SLURM_PROCID=1 \
    SLURM_STEP_NUM_TASKS=4 "$CHECK"
  expect_error "SLURM_PROCID inherited by a child" "not believed" 3000
  # A real-looking task of a 2-node step with no PMI and no node list.
  run 30 bash -c 'exec "$@"' _ "${clean[@]}" SLURM_JOB_ID=7 SLURM_STEP_ID=0 \
    SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=4 SLURM_STEP_NUM_NODES=2 SLURM_NODEID=1 SLURM_LOCALID=0 \
    SLURM_STEP_TASKS_PER_NODE='2(x2)' bash -c 'export SLURM_TASK_PID=$$; exec "$0"' "$CHECK"
  expect_error "2-node Slurm step without PMI or node list" "spans several hosts" 3000
  # Incomplete or malformed values.
  run 30 "${clean[@]}" RANK=0 "$CHECK"
  expect_error "RANK without WORLD_SIZE" "RANK is set but WORLD_SIZE is not" 3000
  run 30 "${clean[@]}" RANK=3 WORLD_SIZE=2 MASTER_PORT=1 "$CHECK"
  expect_error "RANK beyond WORLD_SIZE" "RANK=3 is not below WORLD_SIZE=2" 3000
  run 30 "${clean[@]}" OMPI_COMM_WORLD_RANK=x OMPI_COMM_WORLD_SIZE=2 "$CHECK"
  expect_error "malformed OMPI_COMM_WORLD_RANK" "OMPI_COMM_WORLD_RANK='x'" 3000
  run 30 "${clean[@]}" RANK=0 WORLD_SIZE=2 GROUP_WORLD_SIZE=2 MASTER_PORT=29999 "$CHECK"
  expect_error "2 nodes, MASTER_PORT without MASTER_ADDR" "spans several hosts" 3000
  # Explicit values win over a launcher's: a world of one despite OMPI's 4.
  run 30 "${clean[@]}" OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=4 RANK=0 WORLD_SIZE=1 \
    MASTER_PORT=0 "$CHECK"
  expect_world "RANK/WORLD_SIZE over OMPI_COMM_WORLD_*" 1
}

mode_hydra() {
  command -v mpiexec.hydra >/dev/null || skip "mpiexec.hydra not found (Debian package mpich; scripts/deps.sh --cluster installs it)"
  attack "mpiexec.hydra -n 4" 4 "$KVS_FRESH \\(PMI-1" mpiexec.hydra -n 4 "$CHECK"
  expect_locals "mpiexec.hydra -n 4"
  attack "mpiexec.hydra, 2 fake hosts x 2" 4 "$KVS_FRESH \\(PMI-1" \
    mpiexec.hydra -launcher fork -hosts n0:2,n1:2 -n 4 "$CHECK"
  expect_locals "mpiexec.hydra, 2 fake hosts x 2"
  # A secret the user set wins over a fresh one.
  attack "mpiexec.hydra -n 2, CHORUS_JOB_SECRET set" 2 "CHORUS_JOB_SECRET$" \
    env CHORUS_JOB_SECRET=0123456789abcdef0123456789abcdef mpiexec.hydra -n 2 "$CHECK"
  run 120 mpiexec.hydra -n 3 "$COLLS"
  expect_colls "mpiexec.hydra -n 3 test_colls"
  # One rank dies before the exchange: the others fail, nobody hangs.
  run 60 env CHORUS_TIMEOUT=10 mpiexec.hydra -n 3 bash -c \
    '[ "$PMI_RANK" = 1 ] && exit 3; exec "$0"' "$CHECK"
  if [[ $RC != 0 && $RC != 137 ]]; then ok "mpiexec.hydra, rank 1 exits early: job failed in $MS ms"
  else fail "mpiexec.hydra, rank 1 exits early: rc $RC"; fi
}

mode_ompi() {
  command -v mpirun.openmpi >/dev/null || skip "mpirun.openmpi not found (Debian package openmpi-bin; scripts/deps.sh --cluster installs it)"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PMIX_MCA_gds=hash
  local mpi=(mpirun.openmpi --oversubscribe --mca oob_tcp_if_include lo --mca btl self)
  run 60 "${mpi[@]}" -np 4 "$CHECK"
  if grep -q "built without PMIx\|libpmix.so.2 cannot be loaded" "$OUT"; then
    skip "$(grep -m1 -o 'the launcher offers PMIx but.*' "$OUT")"
  fi
  attack "mpirun -np 4" 4 "$KVS_FRESH \\(PMIx" "${mpi[@]}" -np 4 "$CHECK"
  expect_locals "mpirun -np 4"
  # Two "hosts": an rsh agent that runs the command here, telling it (and
  # so the ranks) the host name it was given, with a temporary directory of
  # that host's own (two orted daemons sharing one session directory race
  # on creating it: "mkdir ... File exists").
  printf '#!/bin/sh\nwhile [ $# -gt 0 ]; do case "$1" in -*) shift;; *) h=$1; shift; break;; esac; done\nexport CHORUS_TEST_HOST=$h TMPDIR=%s/tmp-$h\nmkdir -p "$TMPDIR"\nexec sh -c "$*"\n' "$TMP" >"$TMP/fake-ssh"
  chmod +x "$TMP/fake-ssh"
  attack "mpirun, 2 fake hosts x 2" 4 "$KVS_FRESH \\(PMIx" \
    "${mpi[@]}" --mca plm_rsh_agent "$TMP/fake-ssh" --host n0:2,n1:2 -np 4 "$CHECK"
  expect_locals "mpirun, 2 fake hosts x 2"
  run 120 "${mpi[@]}" -np 3 "$COLLS"
  expect_colls "mpirun -np 3 test_colls"
}

mode_slurm() {
  [[ -n $FIXTURES && -x $FIXTURES/slurm.sh ]] || skip "no Slurm fixture given"
  # munged wants every directory above its socket searchable by all.
  chmod 755 "$TMP"
  export CHORUS_SLURM_DIR=$TMP/slurm CHORUS_SLURM_NODES=2
  bash "$FIXTURES/slurm.sh" up >"$OUT" 2>&1
  case $? in
    0) SLURM_UP=1 ;;
    77) skip "$(tail -n 1 "$OUT")" ;;
    *) SLURM_UP=1; fail "Slurm fixture up"; return ;;
  esac
  eval "$(bash "$FIXTURES/slurm.sh" env)"
  local srun=(srun --immediate=30 -O)
  attack "srun -N 2 --ntasks-per-node=2 --mpi=pmi2" 4 "$KVS_FRESH \\(PMI-1" \
    "${srun[@]}" -N 2 --ntasks-per-node=2 --mpi=pmi2 "$CHECK"
  expect_locals "srun --mpi=pmi2"
  if srun --mpi=list 2>&1 | grep -q pmix; then
    attack "srun -N 2 --ntasks-per-node=2 --mpi=pmix" 4 "$KVS_FRESH \\(PMIx" \
      "${srun[@]}" -N 2 --ntasks-per-node=2 --mpi=pmix "$CHECK"
  else
    echo "skip srun --mpi=pmix: this Slurm has no pmix plugin"
  fi
  # No key-value service, every rank on one host: the secret is agreed
  # through the runtime directory.
  attack "srun -N 1 -n 3 (no PMI: one host, derived port)" 3 \
    "a fresh one (this rank made in|read from) .*/store-[0-9]+\\.key" \
    "${srun[@]}" --mpi=none -N 1 -n 3 "$CHECK"
  run 120 "${srun[@]}" -N 2 --ntasks-per-node=2 --mpi=pmi2 "$COLLS"
  expect_colls "srun -N 2 --mpi=pmi2 test_colls"
  # What users copy: an sbatch script whose srun needs no flags of ours.
  cat >"$TMP/job.sh" <<JOB
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --output=$TMP/job.out
# The batch script's own process has SLURM_PROCID=0 and SLURM_NTASKS=4: a
# program run here without srun must refuse them, not wait for 3 peers.
CHORUS_TIMEOUT=10 $CHECK >$TMP/direct.out 2>&1
srun --mpi=pmi2 $CHECK
JOB
  run 120 sbatch --wait "$TMP/job.sh"
  cp "$TMP/job.out" "$OUT" 2>/dev/null
  expect_world "sbatch --wait (2 nodes x 2, srun --mpi=pmi2 inside)" 4
  if grep -q "not believed" "$TMP/direct.out" && ! grep -q '^bootstrap ok' "$TMP/direct.out"; then
    ok "sbatch script's own process: its SLURM_PROCID is not believed"
  else
    cp "$TMP/direct.out" "$OUT"; fail "sbatch script's own process believed SLURM_PROCID"
  fi
  # Two nodes, no PMI, no secret: a clear error at once, never a world of one.
  run 90 env CHORUS_TIMEOUT=20 "${srun[@]}" -N 2 --ntasks-per-node=1 "$CHECK"
  expect_error "srun -N 2 without PMI or secret" "bootstrap FAILED" 15000
  if grep -q '^bootstrap ok' "$OUT"; then fail "srun -N 2 without PMI: some rank formed a world"; fi
  # chorusrun inside an allocation: one agent per node, the first node's
  # agent hosts the store (both fake nodes are this machine: 127.0.0.1).
  if [[ -n $CHORUSRUN ]]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$TMP/key" && chmod 600 "$TMP/key"
    # A port the kernel says is free, not one derived from the pid.
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    run 120 env CHORUS_JOB_SECRET_FILE="$TMP/key" "${srun[@]}" -N 2 --ntasks-per-node=1 \
      "$CHORUSRUN" --nnodes 2 -n 2 --no-prefix --rdzv-endpoint "127.0.0.1:$port" \
      --rdzv-id "slurm$$" "$CHECK"
    expect_world "srun -N 2 chorusrun --nnodes 2 -n 2" 4
  fi
}

case $MODE in
  env) mode_env ;;
  hydra) mode_hydra ;;
  ompi) mode_ompi ;;
  slurm) mode_slurm ;;
  *) echo "unknown mode $MODE" >&2; exit 2 ;;
esac
summary "all checks passed" "check(s) failed"
