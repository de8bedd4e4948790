#!/usr/bin/python3
"""compare_run.py - the measuring half of bench/compare (run it through
bench/compare, which installs, builds and compiles what this needs).

Runs chorus (chorus-bench), Open MPI and MPICH (compare_mpi.c built with
each one's mpicc) and Gloo (compare_gloo.py), interleaved round-robin per
repeat, measures the memory bandwidth (compare_membw.c) before and after the
whole run and right before every library run (the bound a run is judged
against is the one measured next to it), and writes OUT/compare.md,
OUT/compare.csv, OUT/compare.png.
Only the Python standard library is used here.
"""
import argparse
import csv
import datetime
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

LIBS = ["chorus", "openmpi", "mpich", "gloo"]
PEERS = ["openmpi", "mpich", "gloo"]
AR_SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
OTHER_COLLS = ["all_gather", "reduce_scatter", "broadcast", "all_to_all"]
OTHER_SIZES = [1 << 20, 16 << 20, 64 << 20]
AR8_SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
# (warm-up calls, timed calls) per size: fewer for large sizes to stay in time
ITERS = {8: (5, 50), 64 << 10: (5, 30), 1 << 20: (3, 20), 16 << 20: (2, 8), 64 << 20: (1, 5)}
TIMEOUT = 150  # seconds per library invocation
RETRIES = 2  # re-runs of a library run disturbed by other processes
QUIET_MAX_WAIT = 20  # seconds to wait for the machine to be quiet before a run
RETRY_DEADLINE = 12 * 60  # no more waiting or re-running after this many seconds


def human(s):
    if s >= 1 << 20:
        return "%d MiB" % (s >> 20)
    if s >= 1 << 10:
        return "%d KiB" % (s >> 10)
    return "%d B" % s


def busfactor(coll, n):
    if coll == "all_reduce":
        return 2.0 * (n - 1) / n
    if coll == "broadcast":
        return 1.0
    return (n - 1) / n


def jobs_for(n, with8):
    """(coll, size) list one library runs for world size n."""
    if n == 8:
        return [("all_reduce", s) for s in AR8_SIZES] if with8 else []
    j = [("all_reduce", s) for s in AR_SIZES]
    if n == 4:
        j += [(c, s) for c in OTHER_COLLS for s in OTHER_SIZES]
    return j


def run(cmd, timeout, env=None):
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, env=env)
        return p.returncode, p.stdout, time.time() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", out, time.time() - t0


def free_port():
    """A port the kernel says is free now: not a fixed one another job on
    the machine may hold."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, a):
        self.a = a
        self.log = open(os.path.join(a.out, "compare.log"), "w")

    def note(self, msg):
        line = "[%s] %s" % (datetime.datetime.now().strftime("%H:%M:%S"), msg)
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def logout(self, cmd, rc, out, dt):
        self.log.write("$ %s\n# rc=%s %.1fs\n%s\n" % (" ".join(map(shlex.quote, cmd)), rc, dt, out))
        self.log.flush()

    def lib(self, lib, n, jobs):
        """{(coll,size): time_us or error string}"""
        res = {}
        if lib == "chorus":
            for coll, size in jobs:
                w, it = ITERS[size]
                cmd = [self.a.chorusrun, "--standalone", "-n", str(n), "--", self.a.chorus_bench,
                       "-C", coll, "-b", str(size), "-e", str(size), "-w", str(w), "-n", str(it), "-c", "0"]
                rc, out, dt = run(cmd, TIMEOUT)
                self.logout(cmd, rc, out, dt)
                val = "failed(rc=%s)" % rc
                for line in out.splitlines():
                    line = re.sub(r"^\[rank0\]:\s*", "", line)
                    t = line.split()
                    if len(t) >= 13 and t[0].isdigit() and not line.startswith("#"):
                        med = t[7] if t[7] != "n/a" else t[12]  # out-of-place; broadcast: its only form
                        if rc == 0:
                            val = float(med)
                res[(coll, size)] = val
            return res
        specs = []
        for coll, size in jobs:
            w, it = ITERS[size]
            specs.append((coll, size, w, it))
        if lib == "gloo":
            cmd = [self.a.python, self.a.gloo, str(n), str(free_port())] + ["%s:%d:%d:%d" % s for s in specs]
            per_coll = [cmd]
        else:
            exe = self.a.mpi_exe[lib]
            if lib == "openmpi":
                launcher = [self.a.mpirun_ompi, "--allow-run-as-root", "--oversubscribe",
                            "--mca", "btl", "self,vader", "-n", str(n)]
            else:
                launcher = [self.a.mpirun_mpich, "-n", str(n)]
            per_coll = []
            for coll in dict.fromkeys(c for c, _ in jobs):
                per_coll.append(launcher + [exe, coll] + ["%d:%d:%d" % (s, w, i) for c, s, w, i in specs if c == coll])
        for cmd in per_coll:
            rc, out, dt = run(cmd, TIMEOUT * (3 if lib == "gloo" else 1))
            self.logout(cmd, rc, out, dt)
            for line in out.splitlines():
                t = line.split()
                if len(t) >= 5 and t[0] == "RESULT":
                    res[(t[1], self.nominal(int(t[3]), n))] = float(t[4])
                elif len(t) >= 5 and t[0] == "UNSUPPORTED":
                    res[(t[1], self.nominal(int(t[3]), n))] = "unsupported"
                    self.note("%s n=%d %s: unsupported (%s)" % (lib, n, t[1], t[4].replace("_", " ")))
        for j in jobs:
            if j not in res:
                res[j] = "timeout" if rc == "timeout" else "failed"
        return res

    @staticmethod
    def nominal(real, n):
        # map a rounded-down size back to the nominal size of the job
        for s in sorted(set(AR_SIZES + OTHER_SIZES)):
            if real <= s and real > s - 4 * n:
                return s
        return real


def membw(a):
    out = subprocess.run([a.membw, "128", str(a.cores)], stdout=subprocess.PIPE, text=True).stdout
    bw = {}
    for line in out.splitlines():
        t = line.split()
        if t and t[0] == "MEMBW":
            bw[(t[1], int(t[2]))] = float(t[3])
    return bw


def bound_us(coll, S, n, bw, cores):
    """Single-copy time bound, in us (see the formula in compare.md)."""
    T = min(n, cores)
    add = bw[("add", T)] * 1e9   # bytes moved / s by T threads, add kernel
    cpy = bw[("copy", T)] * 1e9  # bytes moved / s by T threads, copy kernel
    if coll == "all_reduce":
        t = n * S / add + n * S / cpy
    elif coll == "reduce_scatter":
        t = n * S / add + S / cpy
    elif coll == "broadcast":
        t = (n - 1) * S / cpy + (n - 1) * S / cpy
    else:  # all_gather, all_to_all: S = one rank's whole output
        t = n * S / cpy + n * S / cpy
    return t * 1e6


class ForeignCPU:
    """Samples /proc every 0.5 s and adds up the CPU time (user + system) of
    user-space processes that are not this run or its descendants: another
    developer's build or benchmark.  Processes that live less than one sample
    interval are missed, so this is a lower bound."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.me = os.getpid()
        self.lock = threading.Lock()
        self.total = 0.0
        self.by = {}
        self.prev = {}
        self.stop = False
        threading.Thread(target=self.loop, daemon=True).start()

    def snap(self):
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % d) as f:
                    st = f.read()
            except OSError:
                continue
            comm = st[st.index("(") + 1:st.rindex(")")]
            f = st[st.rindex(")") + 2:].split()
            # f[1] = ppid, f[11] = utime, f[12] = stime; kernel threads have ppid 2 or pid 2
            procs[int(d)] = (int(f[1]), comm, int(f[11]) + int(f[12]))
        return procs

    def loop(self):
        while not self.stop:
            cur = self.snap()
            ours = set()
            for pid in cur:
                p, seen = pid, 0
                while p in cur and p > 1 and seen < 64:
                    if p == self.me:
                        ours.add(pid)
                        break
                    p, seen = cur[p][0], seen + 1
            with self.lock:
                for pid, (ppid, comm, ticks) in cur.items():
                    if pid in ours or pid == 2 or ppid == 2 or pid not in self.prev:
                        continue
                    if self.prev[pid][1] != comm:
                        continue
                    d = (ticks - self.prev[pid][2]) / self.hz
                    if d > 0:
                        self.total += d
                        self.by[comm] = self.by.get(comm, 0.0) + d
                self.prev = cur
            time.sleep(0.5)

    def wait_quiet(self, cores):
        """Wait (at most QUIET_MAX_WAIT s) until other processes used < 10 % of the
        cores over the last second.  Returns the seconds waited."""
        t0 = time.time()
        while time.time() - t0 < QUIET_MAX_WAIT:
            a, _ = self.read()
            time.sleep(1.0)
            b, _ = self.read()
            if b - a < 0.1 * cores:
                break
        return time.time() - t0 - 1.0

    def read(self):
        with self.lock:
            return self.total, dict(self.by)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def bwruns_from_json(rows):
    out = {}
    for lib, n, i, k, t, v in rows:
        l = out.setdefault((lib, n), [])
        while len(l) <= i:
            l.append({})
        l[i][(k, t)] = v
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--with8", type=int, default=1)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--chorusrun", required=True)
    ap.add_argument("--chorus-bench", dest="chorus_bench", required=True)
    ap.add_argument("--ompi-exe", required=True)
    ap.add_argument("--mpich-exe", required=True)
    ap.add_argument("--mpirun-ompi", dest="mpirun_ompi", required=True)
    ap.add_argument("--mpirun-mpich", dest="mpirun_mpich", required=True)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--gloo", required=True)
    ap.add_argument("--membw", required=True)
    ap.add_argument("--machine", required=True, help="file with the machine description")
    ap.add_argument("--command", required=True)
    ap.add_argument("--report-only", dest="report_only", default="",
                    help="rewrite the report from a compare.json of an earlier run")
    a = ap.parse_args()
    a.mpi_exe = {"openmpi": a.ompi_exe, "mpich": a.mpich_exe}
    os.makedirs(a.out, exist_ok=True)
    if a.report_only:
        with open(a.report_only) as f:
            d = json.load(f)
        r = Runner.__new__(Runner)
        r.log = open(os.devnull, "w")
        return report(a, r, {tuple(x[:-1]): x[-1] for x in d["raw"]},
                      {(x[0], x[1]): x[2] for x in d["bw1"]}, {(x[0], x[1]): x[2] for x in d["bw2"]},
                      [tuple(x) for x in d["loads"]], d["elapsed"], d["worlds"], d.get("runs", []),
                      bwruns_from_json(d.get("bw_runs", [])))
    r = Runner(a)
    fcpu = ForeignCPU()
    t_start = time.time()
    time.sleep(1.0)
    fcpu.wait_quiet(a.cores)
    loads = [("start", loadavg())]
    r.note("load average at start: " + loads[0][1])
    bw1 = membw(a)
    r.note("memory bandwidth (start): %s" % bw1)
    worlds = [2, 4] + ([8] if a.with8 else [])
    raw = {}  # (lib, n, coll, size) -> [values per repeat]
    bwruns = {}  # (lib, n) -> [bandwidths measured right before each repeat's run]
    runs = []  # (repeat, n, lib, wall s, user CPU s of other processes)
    for rep in range(a.repeats):
        for n in worlds:
            jobs = jobs_for(n, a.with8)
            # round-robin across libraries, the order rotated every repeat
            order = LIBS[rep % len(LIBS):] + LIBS[:rep % len(LIBS)]
            for lib in order:
                for attempt in range(1, RETRIES + 2):
                    waited = fcpu.wait_quiet(a.cores) if time.time() - t_start < RETRY_DEADLINE else 0.0
                    bwr = membw(a)
                    t0 = time.time()
                    f0, b0 = fcpu.read()
                    res = r.lib(lib, n, jobs)
                    f1, b1 = fcpu.read()
                    foreign = f1 - f0
                    top = sorted(((v - b0.get(k, 0.0), k) for k, v in b1.items()), reverse=True)
                    who = ", ".join("%s %.1fs" % (k, v) for v, k in top[:3] if v >= 0.2)
                    wall = time.time() - t0
                    r.note("repeat %d n=%d %-8s %5.1fs  load %s  CPU of other processes %.1fs %s%s" % (
                        rep + 1, n, lib, wall, loadavg(), foreign, who,
                        "  (waited %.0fs for quiet)" % waited if waited >= 1 else ""))
                    if (foreign <= 0.1 * wall * a.cores or attempt == RETRIES + 1
                            or time.time() - t_start > RETRY_DEADLINE):
                        break
                    r.note("  interference above 10 % of the cores: running it again")
                runs.append((rep + 1, n, lib, wall, foreign, who, attempt))
                bwruns.setdefault((lib, n), []).append(bwr)
                for k, v in res.items():
                    raw.setdefault((lib, n) + k, []).append(v)
        loads.append(("after repeat %d" % (rep + 1), loadavg()))
    fcpu.wait_quiet(a.cores)
    bw2 = membw(a)
    r.note("memory bandwidth (end): %s" % bw2)
    return report(a, r, raw, bw1, bw2, loads, time.time() - t_start, worlds, runs, bwruns)


def report(a, r, raw, bw1, bw2, loads, elapsed, worlds, runs, bwruns=None):
    bw = {k: max(bw1.get(k, 0), bw2.get(k, 0)) for k in set(bw1) | set(bw2)}
    bwruns = bwruns or {}
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump({"raw": [list(k) + [v] for k, v in raw.items()],
                   "bw1": [list(k) + [v] for k, v in bw1.items()],
                   "bw2": [list(k) + [v] for k, v in bw2.items()],
                   "bw_runs": [[lib, n, i, k[0], k[1], v] for (lib, n), l in bwruns.items()
                               for i, d in enumerate(l) for k, v in d.items()],
                   "loads": loads, "elapsed": elapsed, "worlds": worlds, "runs": runs}, f)

    # ---- aggregate
    def med(lib, n, coll, size):
        vals = raw.get((lib, n, coll, size), [])
        nums = [v for v in vals if isinstance(v, float)]
        if len(nums) == len(vals) and nums:
            return statistics.median(nums), nums
        errs = sorted(set(v for v in vals if not isinstance(v, float)))
        if nums:  # some repeats failed: report the median of those that ran, flagged
            return statistics.median(nums), nums
        return (errs[0] if errs else "not run"), nums

    with open(os.path.join(a.out, "compare.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["library", "ranks", "collective", "bytes", "repeat", "median_us"])
        for (lib, n, coll, size), vals in sorted(raw.items()):
            for i, v in enumerate(vals):
                w.writerow([lib, n, coll, size, i + 1, v])

    def fmt_t(t):
        if not isinstance(t, float):
            return t
        return "%.1f" % t if t < 1e4 else "{:,.0f}".format(t).replace(",", " ")

    def fmt_bw(coll, n, S, t):
        if not isinstance(t, float):
            return "–"
        return "%.2f" % (S / (t * 1e-6) / 1e9 * busfactor(coll, n))

    def fmt_ratio(tc, tp):
        if not isinstance(tc, float) or not isinstance(tp, float):
            return "–"
        x = tp / tc
        return "%.2f" % x if x >= 0.1 else "%.3f" % x

    def rep_fracs(lib, n, coll, S):
        """Per repeat: (bound / time, the bandwidths measured right before that
        run), or None where the run gave no time; None for all if the run's
        bandwidths were not recorded (a report of an older run)."""
        vals = raw.get((lib, n, coll, S), [])
        bws = bwruns.get((lib, n), [])
        if len(bws) != len(vals):
            return None
        return [(bound_us(coll, S, n, bws[i], a.cores) / v, bws[i])
                if isinstance(v, float) and v > 0 else None for i, v in enumerate(vals)]

    def frac(lib, n, coll, S):
        """Median over the repeats of bound / time, each repeat's bound from the
        bandwidth measured right before that run (else the run's max)."""
        fr = rep_fracs(lib, n, coll, S)
        if fr is None:
            t = med(lib, n, coll, S)[0]
            return bound_us(coll, S, n, bw, a.cores) / t if isinstance(t, float) else None
        fr = [x[0] for x in fr if x]
        return statistics.median(fr) if fr else None

    def row_bound(n, coll, S):
        """The bound shown in a row: the median of those measured next to its runs."""
        bs = [bound_us(coll, S, n, x, a.cores) for l in LIBS for x in bwruns.get((l, n), [])]
        return statistics.median(bs) if bs else bound_us(coll, S, n, bw, a.cores)

    def fmt_frac(f):
        if f is None:
            return "–"
        return "%.0f %%" % (100 * f) if f >= 0.1 else "%.1f %%" % (100 * f)

    # spread (max/min over repeats) for honesty
    def spread(nums):
        return max(nums) / min(nums) if len(nums) > 1 and min(nums) > 0 else 1.0

    L = []
    L.append("# chorus vs Open MPI, MPICH and Gloo on one machine\n")
    L.append("Report written by `bench/compare` on %s (UTC), in %.1f minutes of measuring. "
             "Raw per-repeat medians: [compare.csv](compare.csv); every command and its output: "
             "[compare.log](compare.log).\n" % (
                 datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), elapsed / 60))
    L.append("Command:\n\n```sh\n%s\n```\n" % a.command)
    L.append("![busbw vs size, all_reduce](compare.png)\n")
    L.append("## Method\n")
    L.append(
        "- Libraries: **chorus** (`chorus-bench` under `chorusrun --standalone`, shared-memory transport chosen automatically (every rank on this host), "
        "`algo auto`, `-c 0`), **Open MPI** and **MPICH** (`bench/compare_mpi.c` compiled with each "
        "one's own `mpicc`; Open MPI run with `--mca btl self,vader --oversubscribe`, MPICH with its "
        "defaults), **Gloo** (`bench/compare_gloo.py`: `torch.distributed` backend `gloo` over "
        "127.0.0.1, one process per rank via `torch.multiprocessing`, `torch.set_num_threads(1)`).\n"
        "- float32, `sum` for the reductions, root 0 for broadcast. Sizes are nccl-tests' (the "
        "largest buffer of the call; all_gather/reduce_scatter/all_to_all move S/n per rank and "
        "block). Out-of-place calls for chorus and MPI (chorus's broadcast has only one form); "
        "Gloo's all_reduce and broadcast are in place (torch has no other form).\n"
        "- Timing, identical in all four: per size a barrier, W untimed calls, N timed calls each "
        "timed alone with CLOCK_MONOTONIC; the time of a call is the MAX over ranks; the value "
        "of a run is the median over the N calls (chorus-bench's `median` column). (W, N) = "
        + ", ".join("%s: (%d, %d)" % (human(s), w, i) for s, (w, i) in ITERS.items()) + ".\n"
        "- %d repeats. In each repeat, for each world size, the libraries run one after the other "
        "(round-robin; the order is rotated every repeat: chorus, openmpi, mpich, gloo, then "
        "openmpi, mpich, gloo, chorus, ...). A cell below is the median over the repeats; "
        "`spread` is the largest/smallest repeat of the chorus cell.\n"
        "- busbw = S / time × factor (nccl-tests: all_reduce 2(n−1)/n, broadcast 1, the others "
        "(n−1)/n), computed from the median time (chorus-bench's own busbw column uses the mean).\n"
        "- **ratio chorus/peer** = peer time / chorus time = chorus busbw / peer busbw: above 1 "
        "chorus is faster, below 1 slower.\n" % a.repeats)
    L.append("## Memory-bandwidth bound\n")
    L.append("Measured with `bench/compare_membw.c` (built `-O2`, no `-march`), 128 MiB buffers per "
             "thread, best of 5 passes, at the start and at the end of the run, and right before "
             "every library run. Bandwidth = bytes read + bytes written per second, all threads "
             "together. At the start and the end (the larger of the two):\n")
    L.append("| kernel | bytes moved per byte of output | " + " | ".join(
        "%d thread%s (GB/s)" % (t, "s" if t > 1 else "") for t in range(1, a.cores + 1)) + " |")
    L.append("|---|---|" + "---|" * a.cores)
    for k, desc in (("copy", "2 (`memcpy`)"), ("add", "3 (`c[i] = a[i] + b[i]`, float)")):
        L.append("| %s | %s | " % (k, desc) + " | ".join(
            "%.1f (start %.1f, end %.1f)" % (bw[(k, t)], bw1.get((k, t), 0), bw2.get((k, t), 0))
            for t in range(1, a.cores + 1)) + " |")
    L.append("")
    if bwruns:
        allr = [x for l in bwruns.values() for x in l]

        def rng(k, t):
            v = [x[(k, t)] for x in allr if (k, t) in x]
            return "%.1f, %.1f, %.1f" % (min(v), statistics.median(v), max(v)) if v else "–"
        L.append("Right before each of the %d library runs (min, median, max): " % len(allr) + "; ".join(
            "%s, %d thread%s: %s GB/s" % (k, t, "s" if t > 1 else "", rng(k, t))
            for k in ("copy", "add") for t in range(1, a.cores + 1)) +
            "; a cache line's round trip between two threads: %s ns. " % rng("pingpong", 2) +
            "This machine's memory bandwidth moves by tens of per cent within minutes, so each "
            "run is judged against the bandwidth measured next to it: a `% bound` cell is the "
            "median over the repeats of that run's bound / that run's time, and the `bound` "
            "column is the median of the bounds of the row's runs.\n")
    L.append(
        "Bound = the time of a single-copy collective in which each input byte is read once and "
        "each output byte written once, with T = min(n, cores) = min(n, %d) cores streaming "
        "together. Read bytes that feed a reduction cost 1/B_add(T) each, every other byte "
        "moved costs 1/B_copy(T), where B_add(T) and B_copy(T) are the aggregate bandwidths above "
        "(bytes moved per second by T threads). With S the size column and n ranks:\n\n"
        "- all_reduce: t = n·S / B_add(T) + n·S / B_copy(T)  (read the n inputs of S bytes once, "
        "reducing as they stream; write the n outputs of S bytes once)\n"
        "- reduce_scatter: t = n·S / B_add(T) + S / B_copy(T)  (n inputs of S read; n outputs "
        "of S/n written)\n"
        "- all_gather, all_to_all: t = n·S / B_copy(T) + n·S / B_copy(T)  (n outputs of S "
        "written, each byte read once from its source)\n"
        "- broadcast: t = (n−1)·S / B_copy(T) + (n−1)·S / B_copy(T)  (the root's buffer read "
        "once per receiver, n−1 outputs written)\n\n"
        "`%% bound` = bound time / measured time (100 %% = at the bound). This ignores "
        "synchronisation and assumes perfect overlap across cores, so it is optimistic; with "
        "more ranks than cores it still counts only T = %d cores. The bandwidths are those of "
        "DRAM (128 MiB buffers): at sizes whose buffers fit in the caches (the 1 MiB rows, and "
        "below) a library can come near or above 100 %%, so read `%% bound` from 16 MiB up.\n"
        % (a.cores, a.cores))
    # all_reduce table
    L.append("## all_reduce, float32 sum\n")
    hdr = ("| ranks | size | bound (µs) | " + " | ".join("%s time (µs)" % l for l in LIBS) + " | " +
           " | ".join("%s busbw (GB/s)" % l for l in LIBS) + " | " +
           " | ".join("chorus/%s" % p for p in PEERS) + " | " +
           " | ".join("%s %% bound" % l for l in LIBS) + " | chorus spread |")
    L.append(hdr)
    L.append("|" + "---|" * (hdr.count("|") - 1))
    plotdata = {}
    for n in worlds:
        sizes = AR8_SIZES if n == 8 else AR_SIZES
        for S in sizes:
            b = row_bound(n, "all_reduce", S)
            m = {l: med(l, n, "all_reduce", S) for l in LIBS}
            row = [str(n), human(S), "%.1f" % b if b < 1e4 else "%.0f" % b]
            row += [fmt_t(m[l][0]) for l in LIBS]
            row += [fmt_bw("all_reduce", n, S, m[l][0]) for l in LIBS]
            row += [fmt_ratio(m["chorus"][0], m[p][0]) for p in PEERS]
            row += [fmt_frac(frac(l, n, "all_reduce", S)) for l in LIBS]
            row += ["%.2f" % spread(m["chorus"][1]) if m["chorus"][1] else "–"]
            L.append("| " + " | ".join(row) + " |")
            plotdata[(n, S)] = (b, m)
    L.append("")
    L.append("## all_gather, reduce_scatter, broadcast, all_to_all, 4 ranks\n")
    L.append(hdr.replace("| ranks | size |", "| collective | size |"))
    L.append("|" + "---|" * (hdr.count("|") - 1))
    if 4 in worlds:
        for coll in OTHER_COLLS:
            for S in OTHER_SIZES:
                b = row_bound(4, coll, S)
                m = {l: med(l, 4, coll, S) for l in LIBS}
                row = [coll, human(S), "%.1f" % b if b < 1e4 else "%.0f" % b]
                row += [fmt_t(m[l][0]) for l in LIBS]
                row += [fmt_bw(coll, 4, S, m[l][0]) for l in LIBS]
                row += [fmt_ratio(m["chorus"][0], m[p][0]) for p in PEERS]
                row += [fmt_frac(frac(l, 4, coll, S)) for l in LIBS]
                row += ["%.2f" % spread(m["chorus"][1]) if m["chorus"][1] else "–"]
                L.append("| " + " | ".join(row) + " |")
    L.append("")
    L.append("`unsupported`: the library refused the collective (torch's Gloo backend has no "
             "reduce_scatter: `ProcessGroupGloo does not support _reduce_scatter_base`); `timeout`: "
             "the run took longer than %d s; `failed`: it exited with an error (see compare.log). "
             "`–`: no value to compare.\n" % TIMEOUT)
    if bwruns:
        L.append("## chorus per repeat\n")
        L.append("Each cell: chorus's % bound in that repeat (its time against the bound measured "
                 "right before its run), then that measurement: the 2-thread copy bandwidth and the "
                 "cache line's round trip between two threads. A round trip several times the "
                 "shortest one means the two vCPUs did not share a cache then; the 2-thread "
                 "bandwidth is higher in that state (each has memory of its own) while everything "
                 "the ranks share crosses between the caches.\n")
        L.append("| row | " + " | ".join("repeat %d" % (i + 1) for i in range(a.repeats)) + " |")
        L.append("|---|" + "---|" * a.repeats)
        prow = [("all_reduce", n, S) for n in worlds for S in (AR8_SIZES if n == 8 else AR_SIZES)
                if S >= 16 << 20] + [(c, 4, S) for c in OTHER_COLLS for S in OTHER_SIZES
                                     if S >= 16 << 20 and 4 in worlds]
        for coll, n, S in prow:
            fr = rep_fracs("chorus", n, coll, S) or []
            cells = []
            for i in range(a.repeats):
                if i >= len(fr) or not fr[i]:
                    cells.append("–")
                    continue
                f, b = fr[i]
                cells.append("%.0f %% (%.0f GB/s, %s ns)" % (
                    100 * f, b.get(("copy", min(n, a.cores)), 0),
                    "%.0f" % b[("pingpong", 2)] if ("pingpong", 2) in b else "–"))
            L.append("| %s, %d ranks, %s | " % (coll, n, human(S)) + " | ".join(cells) + " |")
        L.append("")
    L.append("## Load during the run\n")
    L.append("`/proc/loadavg` (1, 5, 15 min): " + "; ".join("%s: %s" % x for x in loads) +
             ". The run itself keeps the load near n while it measures; a load well above the "
             "world size means something else was running and the numbers of that stretch are "
             "suspect. compare.log has the load after every library run.\n")
    L.append("Interference: CPU time (user + system) used during each library run by "
             "user-space processes that are not part of this run (sampled from /proc every "
             "0.5 s; processes shorter than that are missed), with the biggest consumers. Before "
             "every library run the script waits (up to %d s) for a quiet second; a run in which "
             "other processes took more than 10 %% of the cores is run again, up to %d times, and "
             "the last attempt is kept, whatever the library (`attempt`); after %d minutes there is "
             "no more waiting or re-running. Only the kept attempt is listed:\n" % (
                 QUIET_MAX_WAIT, RETRIES, RETRY_DEADLINE // 60))
    L.append("| repeat | ranks | library | wall (s) | other processes' CPU (s) | share of the %d cores | who | attempt |" % a.cores)
    L.append("|---|---|---|---|---|---|---|---|")
    for x in runs:
        rep, n, lib, wall, foreign = x[:5]
        who = x[5] if len(x) > 5 else ""
        att = x[6] if len(x) > 6 else 1
        share = foreign / (wall * a.cores) if wall > 0 else 0
        flag = " **(interference)**" if share > 0.1 else ""
        L.append("| %d | %d | %s | %.1f | %.1f | %.0f %%%s | %s | %d |" % (rep, n, lib, wall, foreign, 100 * share, flag, who, att))
    L.append("")
    L.append("## Machine\n")
    with open(a.machine) as f:
        L.append(f.read())
    with open(os.path.join(a.out, "compare.md"), "w") as f:
        f.write("\n".join(L) + "\n")

    # ---- plot data + gnuplot
    dat = os.path.join(a.out, "compare_plot.dat")
    with open(dat, "w") as f:
        for n in (2, 4):
            f.write("# n=%d: size busbw(bound) busbw(chorus openmpi mpich gloo)\n" % n)
            for S in AR_SIZES:
                if (n, S) not in plotdata:
                    continue
                b, m = plotdata[(n, S)]
                vals = [S / (b * 1e-6) / 1e9 * busfactor("all_reduce", n)]
                for l in LIBS:
                    t = m[l][0]
                    vals.append(S / (t * 1e-6) / 1e9 * busfactor("all_reduce", n) if isinstance(t, float) else float("nan"))
                f.write("%d %s\n" % (S, " ".join("%.6g" % v for v in vals)))
            f.write("\n\n")
    gp = os.path.join(a.out, "compare_plot.gp")
    with open(gp, "w") as f:
        f.write("""set terminal pngcairo size 1200,500 font ',10' noenhanced
set output '%s'
set datafile missing 'nan'
set multiplot layout 1,2 title 'all_reduce float32 sum, busbw vs size (median of %d repeats), %s'
set logscale xy
set grid
set key bottom right box opaque
set format y '%%g'
set xrange [4:1.6e8]
set xlabel 'size (bytes)'
set ylabel 'busbw (GB/s)'
set xtics ('8 B' 8, '64 KiB' 65536, '1 MiB' 1048576, '16 MiB' 16777216, '64 MiB' 67108864)
do for [i=0:1] {
  set title sprintf('%%d ranks', i==0 ? 2 : 4)
  plot '%s' index i using 1:3 with linespoints lw 2 title 'chorus', \\
       '' index i using 1:4 with linespoints title 'Open MPI', \\
       '' index i using 1:5 with linespoints title 'MPICH', \\
       '' index i using 1:6 with linespoints title 'Gloo', \\
       '' index i using 1:2 with lines dt 2 lc rgb 'black' title 'memory-bandwidth bound'
}
unset multiplot
""" % (os.path.join(a.out, "compare.png"), a.repeats, socket.gethostname(), dat))
    p = subprocess.run(["gnuplot", gp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0 and "pngcairo" in p.stdout:
        txt = open(gp).read().replace("pngcairo size 1200,500 font ',10'", "png size 1200,500")
        open(gp, "w").write(txt)
        p = subprocess.run(["gnuplot", gp], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        r.note("gnuplot failed: " + p.stdout)
    r.note("done in %.1f min; wrote %s" % (elapsed / 60, os.path.join(a.out, "compare.md")))


if __name__ == "__main__":
    sys.exit(main())
