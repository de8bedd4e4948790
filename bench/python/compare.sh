#!/usr/bin/env bash
# Python and PyTorch against C and Gloo, same machine, same run:
#   1. all_reduce per call (median us) at 8 B and 16 MiB: chorus-bench (C),
#      chorus.all_reduce on NumPy, torch's dist.all_reduce on chorus and on
#      Gloo;
#   2. torch DDP step time on a wide MLP, backend chorus against Gloo.
# Every measurement REPS times (default 3), interleaved; medians of the
# runs' medians.  torch runs under torchrun (the same launcher for both
# backends); chorus-bench and the NumPy package under chorusrun.
#   bench/python/compare.sh [BUILD_DIR] [RANKS...]   (default: build, 2 4)
# Writes bench/results/python.md and prints it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
shift || true
ranks=("${@:-2 4}")
# shellcheck disable=SC2206
ranks=(${ranks[*]})
reps=${REPS:-3}
py=/usr/bin/python3
export PYTHONPATH=$build/python OMP_NUM_THREADS=1
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT
port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
torchrun() { local n=$1; shift; timeout 600 $py -m torch.distributed.run --nproc_per_node "$n" \
  --master_port "$(port)" -r 1 -t 1 "$@" 2>&1; }
for rep in $(seq "$reps"); do
  for n in "${ranks[@]}"; do
    echo "== rep $rep, $n ranks" >&2
    for size in 8 16M; do
      timeout 600 "$build/chorusrun" --standalone -n "$n" -- "$build/chorus-bench" -b $size \
        -e $size -n 200 -c 0 2>&1 | awk -v n="$n" '/^\[rank0\]: +[0-9]/ {
          print "api=c ranks=" n " bytes=" $2 " median_us=" $14 }' >> "$raw"
    done
    timeout 600 "$build/chorusrun" --standalone -n "$n" -- $py "$here/allreduce.py" --api chorus \
      2>&1 | grep -o 'api=.*' >> "$raw"
    for api in torch-chorus torch-gloo; do
      torchrun "$n" "$here/allreduce.py" --api "$api" | grep -o 'api=.*' >> "$raw"
    done
    for b in chorus gloo; do
      torchrun "$n" "$here/ddp_step.py" --backend "$b" | grep -o 'backend=.*' >> "$raw"
    done
    # The floor on these ranks: DDP with a comm hook that sends nothing.
    torchrun "$n" "$here/ddp_step.py" --backend chorus --no-comm | grep -o 'backend=.*' >> "$raw"
  done
  # The same step on one rank.
  torchrun 1 "$here/ddp_step.py" --backend chorus | grep -o 'backend=.*' >> "$raw"
done
$py - "$raw" "$reps" "${ranks[*]}" > "$root/bench/results/python.md" <<'PY'
import re, statistics, sys
raw, reps, ranks = open(sys.argv[1]).read().split("\n"), sys.argv[2], sys.argv[3].split()
def kv(line):
    return dict(re.findall(r"(\w+)=([\w.\-]+)", line))
ar, ddp = {}, {}
for line in raw:
    d = kv(line)
    if "api" in d:
        ar.setdefault((d["api"], d["ranks"], int(d["bytes"])), []).append(float(d["median_us"]))
    elif "backend" in d:
        ddp.setdefault((d["backend"], d["ranks"]), []).append(float(d["step_ms_median"]))
med = lambda v: statistics.median(v) if v else float("nan")
print("# Python and PyTorch: chorus against C and Gloo\n")
print("`bench/python/compare.sh` (%s runs each, interleaved; medians of the runs' medians).\n" % reps)
print("## all_reduce, float32, per call (us)\n")
print("| ranks | bytes | C (chorus-bench) | chorus.all_reduce (NumPy) | torch on chorus | torch on Gloo | NumPy - C | torch chorus - C | Gloo / torch chorus |")
print("|---|---|---|---|---|---|---|---|---|")
for n in ranks:
    for b in (8, 16 << 20):
        c, p, tc, tg = (med(ar.get((a, n, b), [])) for a in ("c", "chorus", "torch-chorus", "torch-gloo"))
        print("| %s | %d | %.2f | %.2f | %.2f | %.2f | %+.2f | %+.2f (%.1f%%) | %.1fx |" % (
            n, b, c, p, tc, tg, p - c, tc - c, 100 * (tc - c) / c, tg / tc))
print("\n## torch DDP step, wide MLP (4 x 1536, 9.4 M parameters, batch 8), ms\n")
one = med(ddp.get(("chorus", "1"), []))
print("| ranks | chorus | Gloo | chorus / Gloo | floor (no comm) | floor / Gloo | chorus - floor |")
print("|---|---|---|---|---|---|---|")
for n in ranks:
    c, g, f = (med(ddp.get((b, n), [])) for b in ("chorus", "gloo", "chorus-nocomm"))
    print("| %s | %.1f | %.1f | %.2f | %.1f | %.2f | %+.1f |" % (n, c, g, c / g, f, f / g, c - f))
print("\nfloor (no comm): the same ranks running DDP with a comm hook that sends nothing "
      "(the gradients stay local): compute, backward, DDP's bucketing and the optimizer, "
      "with the ranks competing for the same cores and memory as in the real runs. No "
      "backend can make a step faster. One rank alone: %.1f ms." % one)
PY
cat "$root/bench/results/python.md"
