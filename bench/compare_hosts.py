#!/usr/bin/python3
"""compare_hosts.py - the measuring half of bench/compare_hosts (run it
through bench/compare_hosts, which installs what is missing, makes the
emulated hosts and removes them again).

Measures the TCP goodput between host 0 and host 1 (iperf3, or a one-stream
Python sender and receiver when iperf3 is missing), then runs all_reduce
(float32 sum) with chorus (chorus-bench under chorusrun --nnodes, c10d
rendezvous), Open MPI over TCP (bench/compare_mpi.c; its defaults, and tuned:
yield when idle + forced ring) and Gloo (bench/compare_gloo.py, one process
group of P processes per host), interleaved round-robin per repeat, and
writes a markdown report.  Every launch has a time limit; a library that
fails or runs out of time is reported as such.  Standard library only.

Also its own TCP goodput tool, run inside the hosts' namespaces:
  compare_hosts.py tcp-sink PORT            receive one stream, print
                                            "GOODPUT <bytes> <seconds>"
  compare_hosts.py tcp-source ADDR PORT SECONDS
"""
import argparse
import datetime
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

LIBS = [  # (key, name in the report, form of its all_reduce)
    ("chorus", "chorus", "both"),
    ("chorus-ring", "chorus, flat ring", "both"),  # only with several ranks per host
    ("ompi-default", "Open MPI, defaults", "out of place"),
    ("ompi-tuned", "Open MPI, tuned", "out of place"),
    ("gloo", "Gloo", "in place"),
]
OMPI_TUNED = ["--mca", "mpi_yield_when_idle", "1", "--mca", "coll_tuned_use_dynamic_rules", "1",
              "--mca", "coll_tuned_allreduce_algorithm", "4"]  # 4 = ring (ompi_info --level 9)
GRACE = 30  # seconds the other processes of a launch get after one of them failed
RETRIES = 1  # re-runs of a library run during which other processes took > 10 % of the CPUs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_run import ForeignCPU  # noqa: E402 - bench/compare's interference meter


def iters_for(size):
    """(warm-up calls, timed calls) of one size: fewer for large sizes."""
    if size <= 64 << 10:
        return 5, 30
    if size <= 1 << 20:
        return 3, 20
    if size <= 16 << 20:
        return 2, 8
    return 1, 5


def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError("bad size %r (want e.g. 1M, 64K, 4096)" % s)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def human(s):
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if s >= 1 << shift and s % (1 << shift) == 0:
            return "%d %s" % (s >> shift, unit)
    return "%d B" % s


# ------------------------------------------------------------ TCP goodput tool

def tcp_sink(port):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("LISTENING", flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total, t0 = 0, None
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        total += k
    dt = time.perf_counter() - t0 if t0 else 0.0
    print("GOODPUT %d %.6f" % (total, dt), flush=True)


def tcp_source(addr, port, seconds):
    end = time.time() + 20
    while True:
        try:
            s = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.time() > end:
                raise
            time.sleep(0.1)
    data = memoryview(bytes(1 << 20))
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        s.sendall(data)
    s.close()


# ------------------------------------------------------------ running things

class Runner:
    def __init__(self, a):
        self.a = a
        self.log = open(a.log, "w")
        self.port = 29610
        self.live = []  # Popen objects of the launch in progress
        self.failures = []  # (repeat, library, what, status, last lines of output)
        self.addr = [self.netns_out("addr", str(i)).strip() for i in range(a.hosts)]
        self.names = []
        for line in self.netns_out("env").splitlines():
            m = re.match(r"export CHORUS_NETNS_NAMES=(.*)", line)
            if m:
                self.names = shlex.split(m.group(1))[0].split()

    def netns_out(self, *args):
        return subprocess.run(["bash", self.a.netns] + list(args), check=True, text=True,
                              stdout=subprocess.PIPE).stdout

    def in_host(self, i, cmd):
        return ["bash", self.a.netns, "exec", str(i)] + cmd

    def next_port(self):
        self.port += 1
        return self.port

    def note(self, msg):
        line = "[%s] %s" % (datetime.datetime.now().strftime("%H:%M:%S"), msg)
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def launch(self, cmds, timeout, env=None):
        """Starts every command (each in its own session), waits for all of
        them (at most `timeout` s; once one fails, GRACE s more for the
        others) and ends whatever is left.  Returns (status, [outputs]) where
        status is 0, 'timeout' or 'failed (rc=N)' (the first failure)."""
        t0 = time.time()
        files, self.live = [], []
        for cmd in cmds:
            f = open(os.path.join(self.a.tmp, "out.%d" % len(files)), "w+")
            files.append(f)
            self.log.write("$ %s\n" % " ".join(map(shlex.quote, cmd)))
            self.live.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True))
        deadline, status = t0 + timeout, 0
        while True:
            rcs = [p.poll() for p in self.live]
            bad = [rc for rc in rcs if rc not in (None, 0)]
            if bad and status == 0:
                status = "failed (rc=%d)" % bad[0]
                deadline = min(deadline, time.time() + GRACE)
            if all(rc is not None for rc in rcs):
                break
            if time.time() > deadline:
                if status == 0:
                    status = "timeout (%d s)" % timeout
                break
            time.sleep(0.05)
        self.stop_live()
        self.sweep()
        outs = []
        for f in files:
            f.seek(0)
            outs.append(f.read())
            f.close()
        self.log.write("# status %s, %.1f s\n" % (status, time.time() - t0))
        for k, o in enumerate(outs):
            self.log.write("# --- output of command %d\n%s\n" % (k, o))
        self.log.flush()
        return status, outs, time.time() - t0

    def failed(self, rep, key, what, status, outs):
        """Keeps the last lines of each host's output of a failed launch."""
        tail = []
        for k, o in enumerate(outs):
            lines = [ln.rstrip()[:240] for ln in o.splitlines() if ln.strip()]
            if lines:
                tail.append("(command %d) " % k + " | ".join(lines[-4:]))
        self.failures.append((rep, key, what, status, tail))

    def stop_live(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = [p for p in self.live if p.poll() is None]
            for p in left:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.time() + 5
            while any(p.poll() is None for p in left) and time.time() < end:
                time.sleep(0.05)
        self.live = []

    def sweep(self):
        """Ends what a launch left behind in our namespaces (an orted, a
        worker whose agent died): they are private to this run, so every
        process in them is one this run started."""
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    self.log.write("# killed pid %s left in %s\n" % (pid, ns))
                except (ProcessLookupError, ValueError):
                    pass

    # ---- goodput
    def goodput(self, src, dst):
        """MB/s (10^6 bytes) of one TCP stream from host src to host dst, or
        an error string."""
        port = self.next_port()
        if self.a.iperf3:
            server = subprocess.Popen(self.in_host(dst, [self.a.iperf3, "-s", "-1", "-p", str(port)]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
            self.live = [server]
            cmd = [self.a.iperf3, "-c", self.addr[dst], "-p", str(port), "-t", "3", "-O", "1", "-J"]
            res = "failed"
            for _ in range(50):  # until the server listens
                p = subprocess.run(self.in_host(src, cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=60)
                try:
                    j = json.loads(p.stdout)
                except ValueError:
                    j = {"error": p.stdout.strip()[-200:]}
                if "error" not in j:
                    res = j["end"]["sum_received"]["bits_per_second"] / 8e6
                    break
                res = "failed: " + str(j["error"])
                if "refused" not in res:
                    break
                time.sleep(0.1)
            self.log.write("$ %s\n%s\n" % (" ".join(cmd), p.stdout[-3000:]))
            self.stop_live()
            return res
        here = os.path.abspath(__file__)
        status, outs, _ = self.launch([self.in_host(dst, [self.a.python, here, "tcp-sink", str(port)]),
                                       self.in_host(src, [self.a.python, here, "tcp-source", self.addr[dst],
                                                          str(port), "3"])], 60)
        m = re.search(r"GOODPUT (\d+) ([\d.]+)", outs[0])
        if status != 0 or not m or float(m.group(2)) <= 0:
            return "failed"
        return int(m.group(1)) / float(m.group(2)) / 1e6

    # ---- the libraries
    def mpirun_cmd(self):
        a = self.a
        hosts = ",".join("%s:%d" % (ad, a.per_host) for ad in self.addr)
        return [a.mpirun, "--oversubscribe", "--bind-to", "none", "--host", hosts, "-np", str(a.hosts * a.per_host),
                "--mca", "plm_rsh_agent", a.rsh_agent, "--mca", "btl", "tcp,self,vader",
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]

    @staticmethod
    def mpi_env():
        return dict(os.environ, PMIX_MCA_gds="hash", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")

    def ompi_placement(self):
        """Where mpirun puts its ranks: 'rank R: host H' for each, from the
        network namespace each rank runs in (a check of the rsh agent)."""
        if not self.a.ompi_exe:
            return "not checked (Open MPI not installed)"
        probe = ["/bin/sh", "-c", 'echo PLACE "$OMPI_COMM_WORLD_RANK" "$(ip netns identify $$)" '
                 '"${OMPI_MCA_btl_vader_backing_directory:-/dev/shm}" "${OMPI_MCA_orte_tmpdir_base:-/tmp}"']
        status, outs, _ = self.launch([self.in_host(0, self.mpirun_cmd() + probe)], 60, env=self.mpi_env())
        got = sorted((int(r), ns, d, t) for r, ns, d, t in
                     re.findall(r"^PLACE (\d+) (\S+) (\S+) (\S+)", outs[0], re.M))
        host = {ns: i for i, ns in enumerate(self.names)}
        txt = ", ".join("rank %d: host %s" % (rk, host.get(ns, "?" + ns)) for rk, ns, _, _ in got)
        own = [(d, t) for _, ns, d, t in got if host.get(ns, 0) > 0]
        if own and all(d != "/dev/shm" and t != "/tmp" for d, t in own):
            txt += " (the ranks of hosts 1 and up had their own vader and session directories)"
        elif own:
            txt += " (some ranks of hosts 1 and up shared /dev/shm or /tmp with host 0)"
        if status != 0 or len(got) != self.a.hosts * self.a.per_host:
            return "check failed (%s): %s" % (status or "missing ranks", txt or outs[0].strip()[-300:])
        return txt

    def run_lib(self, key, sizes, rep):
        a, N, P = self.a, self.a.hosts, self.a.per_host
        T = a.timeout
        res = {}  # size -> {"ip": us, "oop": us} or error string
        if key in ("chorus", "chorus-ring"):
            # chorus-ring: the flat ring forced, against the automatic
            # choice (hierarchical when hosts have several ranks).
            env = dict(os.environ, CHORUS_ALL_REDUCE_ALGO="ring") if key == "chorus-ring" else None
            for S in sizes:
                w, it = iters_for(S)
                port = self.next_port()
                cmds = [self.in_host(i, [a.chorusrun, "--nnodes", str(N), "-n", str(P), "--cpu-bind", "none",
                                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "%s:%d" % (self.addr[0], port),
                                         "--rdzv-id", "hosts-r%d-%d" % (rep, S), "--",
                                         a.chorus_bench, "-C", "all_reduce", "-b", str(S), "-e", str(S),
                                         "-w", str(w), "-n", str(it), "-c", "0", "--cpu"])
                        for i in range(N)]
                status, outs, dt = self.launch(cmds, T, env=env)
                got = None
                for line in "\n".join(outs).splitlines():
                    m = re.match(r"^\[rank0\]:\s*(\d.*)$", line)
                    t = m.group(1).split() if m else []
                    if len(t) >= 16 and int(t[0]) == S:
                        got = {"oop": float(t[7]), "ip": float(t[12])}
                    m = re.match(r"^\[rank0\]:# cpu (\d+) bytes: out-of-place ([\d.]+) s/GB, "
                                 r"in-place ([\d.]+) s/GB", line)
                    if m and got and int(m.group(1)) == S:
                        got.update({"oop_cpu": float(m.group(2)), "ip_cpu": float(m.group(3))})
                res[S] = got if status == 0 and got else (status or "no result")
                if not isinstance(res[S], dict):
                    self.failed(rep, key, human(S), res[S], outs)
                self.note("  %s %s: %s (%.1f s)" % (key, human(S), fmt_res(res[S]), dt))
            return res
        specs_mpi = ["%d:%d:%d" % ((S,) + iters_for(S)) for S in sizes]
        specs_gloo = ["all_reduce:%d:%d:%d" % ((S,) + iters_for(S)) for S in sizes]
        if key.startswith("ompi"):
            if not a.ompi_exe:
                self.note("  %s: not installed" % key)
                return {S: "not installed" for S in sizes}
            cmd = self.mpirun_cmd() + (OMPI_TUNED if key == "ompi-tuned" else [])
            cmd += [a.ompi_exe, "all_reduce"] + specs_mpi
            status, outs, dt = self.launch([self.in_host(0, cmd)], T, env=self.mpi_env())
        else:
            if not a.gloo_ok:
                self.note("  gloo: not installed")
                return {S: "not installed" for S in sizes}
            port = self.next_port()
            env = dict(os.environ, MASTER_ADDR=self.addr[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                       OMP_NUM_THREADS="1")
            cmds = [self.in_host(i, [a.python, a.gloo, "--local", str(P), "--rank-offset", str(i * P),
                                     "--world-size", str(N * P), str(port)] + specs_gloo) for i in range(N)]
            status, outs, dt = self.launch(cmds, T, env=env)
        got = {}
        for line in "\n".join(outs).splitlines():
            t = line.split()
            if len(t) >= 5 and t[0] == "RESULT" and t[1] == "all_reduce":
                got[int(t[3])] = (float(t[4]), float(t[5]) if len(t) >= 6 else None)
        for S in sizes:
            if S in got and status == 0:
                form = "oop" if key.startswith("ompi") else "ip"
                res[S] = {form: got[S][0]}
                if got[S][1] is not None:
                    res[S][form + "_cpu"] = got[S][1]
            else:
                res[S] = status or "no result"
        if status != 0 or len(got) < len(sizes):
            self.failed(rep, key, "all sizes", status or "no result", outs)
        self.note("  %s: %s (%.1f s)" % (key, ", ".join("%s %s" % (human(S), fmt_res(res[S])) for S in sizes), dt))
        return res


def fmt_res(r):
    if isinstance(r, dict):
        return " / ".join("%s %.3f s/GB" % (k, v) if k.endswith("_cpu") else "%s %.0f us" % (k, v)
                          for k, v in sorted(r.items()))
    return str(r)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ------------------------------------------------------------ main

def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "tcp-sink":
        return tcp_sink(int(sys.argv[2]))
    if len(sys.argv) >= 2 and sys.argv[1] == "tcp-source":
        return tcp_source(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    ap = argparse.ArgumentParser()
    ap.add_argument("--netns", required=True)
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--per-host", type=int, required=True)
    ap.add_argument("--bw", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--chorusrun", required=True)
    ap.add_argument("--chorus-bench", required=True)
    ap.add_argument("--ompi-exe", default="")
    ap.add_argument("--mpirun", default="")
    ap.add_argument("--rsh-agent", default="")
    ap.add_argument("--gloo", required=True)
    ap.add_argument("--gloo-ok", type=int, default=1)
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--iperf3", default="")
    ap.add_argument("--tmp", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True)
    a = ap.parse_args()
    sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    r = Runner(a)

    def on_signal(sig, _frame):
        r.stop_live()
        sys.exit(128 + sig)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    t_start = time.time()
    r.note("%d hosts x %d rank(s), links %s, hosts %s" % (a.hosts, a.per_host, a.bw or "unshaped",
                                                          " ".join(r.addr)))
    good = []  # (when, direction, MB/s or error)

    def measure_goodput(when):
        if a.hosts < 2:
            return
        for src, dst in ((0, 1), (1, 0)):
            g = r.goodput(src, dst)
            good.append((when, "host %d -> host %d" % (src, dst), g))
            r.note("goodput %s, host %d -> host %d: %s" % (when, src, dst,
                                                           "%.1f MB/s" % g if isinstance(g, float) else g))
    measure_goodput("before")
    r.placement = r.ompi_placement()
    r.note("Open MPI placement: " + r.placement)
    raw = {}  # (lib, size, form) -> [us per repeat]; errors under (lib, size, "err")
    skip = {}  # lib -> reason it is not run again (it ran out of time)
    runs = []
    cores = os.cpu_count()
    fcpu = ForeignCPU()
    for rep in range(a.repeats):
        order = LIBS[rep % len(LIBS):] + LIBS[:rep % len(LIBS)]
        for key, _name, _form in order:
            if key == "chorus-ring" and a.per_host == 1:
                continue
            if key in skip:
                r.note("repeat %d %s: not run again (%s in an earlier repeat)" % (rep + 1, key, skip[key]))
                for S in sizes:
                    raw.setdefault((key, S, "err"), []).append("not run (earlier %s)" % skip[key])
                continue
            for attempt in range(1, RETRIES + 2):
                waited = fcpu.wait_quiet(cores)
                f0, by0 = fcpu.read()
                la0, t0 = loadavg(), time.time()
                r.note("repeat %d %s%s" % (rep + 1, key, " (again)" if attempt > 1 else ""))
                res = r.run_lib(key, sizes, rep + 1)
                wall = time.time() - t0
                f1, by = fcpu.read()
                foreign = f1 - f0
                who = sorted(((v - by0.get(k, 0.0), k) for k, v in by.items() if v - by0.get(k, 0.0) >= 0.05),
                             reverse=True)[:3]
                who = ", ".join("%s %.1f s" % (k, v) for v, k in who)
                if foreign > 0.1 * wall * cores and attempt <= RETRIES:
                    r.note("  other processes took %.1f CPU-s of %.1f s (%s): running it again" % (
                        foreign, wall, who))
                    continue
                break
            runs.append((rep + 1, key, wall, la0, loadavg(), foreign, attempt, max(waited, 0.0), who))
            for S, v in res.items():
                if isinstance(v, dict):
                    for form, us in v.items():
                        raw.setdefault((key, S, form), []).append(us)
                else:
                    raw.setdefault((key, S, "err"), []).append(v)
                    if v.startswith("timeout"):
                        skip[key] = v
    measure_goodput("after")
    elapsed = time.time() - t_start
    with open(os.path.join(os.path.dirname(a.log), os.path.basename(a.log)[:-4] + ".json"), "w") as f:
        json.dump({"raw": [list(k) + [v] for k, v in raw.items()], "goodput": good, "runs": runs}, f)
    report(a, r, sizes, raw, good, runs, elapsed)
    r.note("done in %.1f min; wrote %s" % (elapsed / 60, a.out))
    return 0


def report(a, r, sizes, raw, good, runs, elapsed):
    n = a.hosts * a.per_host
    factor = 2.0 * (n - 1) / n
    gvals = [g for _, _, g in good if isinstance(g, float)]
    gref = statistics.median(gvals) if gvals else None

    def med(key, S, form):
        nums = raw.get((key, S, form), [])
        errs = raw.get((key, S, "err"), [])
        if nums:
            return statistics.median(nums), nums, errs
        return None, [], errs

    def busbw(S, us):
        return S / (us * 1e-6) / 1e6 * factor  # MB/s

    L = []
    L.append("# all_reduce across %d emulated hosts x %d rank%s, links %s\n" % (
        a.hosts, a.per_host, "s" if a.per_host > 1 else "",
        "shaped to " + a.bw if a.bw else "unshaped"))
    L.append("Written by `bench/compare_hosts` on %s UTC after %.1f minutes; %d repeat%s, "
             "interleaved round-robin." % (datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
                                           elapsed / 60, a.repeats, "s" if a.repeats > 1 else ""))
    L.append("\n```sh\n%s\n```\n" % a.command)
    L.append("## TCP goodput between host 0 and host 1\n")
    tool = "iperf3 (one stream, 3 s after 1 s omitted)" if a.iperf3 else \
        "one TCP stream of the Python sender/receiver in compare_hosts.py, 3 s"
    if good:
        L.append("%s, before and after the runs, MB/s (10^6 bytes/s):\n" % tool)
        L.append("| when | direction | goodput (MB/s) |")
        L.append("|---|---|---|")
        for when, d, g in good:
            L.append("| %s | %s | %s |" % (when, d, "%.1f" % g if isinstance(g, float) else g))
        L.append("")
        L.append("Reference goodput (median of these): **%s**.\n" % (
            "%.1f MB/s" % gref if gref else "none measured"))
    else:
        L.append("One host: no link to measure.\n")
    L.append("## Results\n")
    L.append(
        "float32 sum, %d ranks (%d hosts x %d, block placement: ranks %s). Per size, each library's "
        "**median per-call time** (the median over the timed calls of the slowest rank's time, as "
        "chorus-bench's `median` column), then the median of that over the repeats. busbw as "
        "nccl-tests counts it: algbw × 2(n−1)/n with algbw = size / time, in MB/s (10^6 bytes/s), "
        "here × %.3f. `chorus ip / this` and `chorus oop / this` = this row's time / chorus's time in "
        "place and out of place (above 1: chorus is faster). **CPU s/GB**: the CPU time every thread of "
        "a rank's process used (user and system, CLOCK_PROCESS_CPUTIME_ID) during the timed calls, per GB "
        "of the size, averaged over the ranks, median over the repeats; `this / chorus ip|oop` = this "
        "row's CPU over chorus's (below 1: this library spends less). Kernel work done in softirq context "
        "on behalf of a socket is charged to whichever process the CPU was running, as the kernel counts "
        "it. Per repeat values in ms in the last column.\n"
        % (n, a.hosts, a.per_host, ", ".join("%d–%d on host %d" % (h * a.per_host, h * a.per_host + a.per_host - 1, h)
                                              if a.per_host > 1 else "%d on host %d" % (h, h)
                                              for h in range(a.hosts)), factor))
    rows = [("chorus", "chorus", "ip", "in place"), ("chorus", "chorus", "oop", "out of place"),
            ("chorus-ring", "chorus, flat ring", "ip", "in place"),
            ("chorus-ring", "chorus, flat ring", "oop", "out of place"),
            ("ompi-default", "Open MPI, defaults", "oop", "out of place"),
            ("ompi-tuned", "Open MPI, tuned", "oop", "out of place"),
            ("gloo", "Gloo", "ip", "in place")]
    for S in sizes:
        w, it = iters_for(S)
        L.append("### %s (%d warm-up + %d timed calls)\n" % (human(S), w, it))
        L.append("| library | form | median per call (ms) | busbw (MB/s) | % of goodput | chorus ip / this | "
                 "chorus oop / this | CPU s/GB | this / chorus ip | this / chorus oop | repeats (ms) |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        cip = med("chorus", S, "ip")[0]
        coop = med("chorus", S, "oop")[0]
        cpu_ip = med("chorus", S, "ip_cpu")[0]
        cpu_oop = med("chorus", S, "oop_cpu")[0]
        for key, name, form, fname in rows:
            if key == "chorus-ring" and a.per_host == 1:
                continue  # the automatic choice is the flat ring already
            t, nums, errs = med(key, S, form)
            if t is None:
                why = errs[0] if errs else "not run"
                L.append("| %s | %s | **%s** | – | – | – | – | – | – | – | %s |" % (name, fname, why,
                                                                     "; ".join(errs) if len(set(errs)) > 1 else ""))
                continue
            bb = busbw(S, t)
            reps = ", ".join("%.2f" % (v / 1e3) for v in nums)
            if errs:
                reps += "; also " + "; ".join(errs)
            cpu = med(key, S, form + "_cpu")[0]
            L.append("| %s | %s | %.2f | %.1f | %s | %s | %s | %s | %s | %s | %s |" % (
                name, fname, t / 1e3, bb, "%.0f %%" % (100 * bb / gref) if gref else "–",
                "%.2f" % (t / cip) if cip and key != "chorus" else "–",
                "%.2f" % (t / coop) if coop and key != "chorus" else "–",
                "%.3f" % cpu if cpu is not None else "–",
                "%.2f" % (cpu / cpu_ip) if cpu is not None and cpu_ip and key != "chorus" else "–",
                "%.2f" % (cpu / cpu_oop) if cpu is not None and cpu_oop and key != "chorus" else "–",
                reps))
        L.append("")
    L.append("## Method\n")
    L.append(
        "- Hosts: `tests/fixtures/netns.sh up %d%s`: one network namespace per host, eth0 on a "
        "Linux bridge%s. The hosts share this machine's %d CPU cores and its memory, so unshaped links "
        "are bound by CPU, not by a wire.\n"
        "- **chorus**: `chorusrun --nnodes %d -n %d --cpu-bind none --rdzv-backend c10d` on every host "
        "(rendezvous on host 0), `chorus-bench -C all_reduce -b S -e S -w W -n N -c 0`, one launch per "
        "size; its defaults otherwise (the library's choice of algorithm: the hierarchical all_reduce "
        "when every host has several ranks, else the ring). *chorus, flat ring* (only with several ranks "
        "per host): the same with `CHORUS_ALL_REDUCE_ALGO=ring`. chorus-bench times out of place, then in "
        "place, in the same launch.\n"
        "- **Open MPI** (%s): `bench/compare_mpi.c` built with `mpicc.openmpi`, `mpirun` in host 0's "
        "namespace with `--host <addr>:%d,...`, a `plm_rsh_agent` script that runs `orted` in the host's "
        "namespace, `--mca btl tcp,self,vader --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 "
        "--oversubscribe --bind-to none`, `PMIX_MCA_gds=hash`. *defaults*: nothing more; *tuned*: `%s` "
        "(ring). compare_mpi.c calls MPI_Allreduce out of place. Where the ranks ran (each rank's network "
        "namespace, checked with a probe launch): %s.\n"
        "- **Gloo** (torch %s): `bench/compare_gloo.py --local %d --rank-offset K --world-size %d` on every "
        "host, `MASTER_ADDR` = host 0, `GLOO_SOCKET_IFNAME=eth0`, `torch.set_num_threads(1)`; torch's "
        "all_reduce is in place.\n"
        "- No library binds ranks to CPUs (`--cpu-bind none`, `--bind-to none`): the emulated hosts share "
        "the cores, and binding per host would stack the ranks of different hosts on the same core.\n"
        "- Same timing in all: a barrier, W untimed calls, N timed calls each timed alone, time of a call "
        "= MAX over ranks, median over the N calls. Each repeat runs every library once, in an order "
        "rotated every repeat. Each launch has a %d s limit; once one process of a launch fails the others "
        "get %d s more; a library that ran out of time is not run again in later repeats.\n" % (
            a.hosts, " --bw " + a.bw if a.bw else "",
            ", every host link shaped to %s in both directions (tc tbf, 256 kB bursts, so short transfers "
            "can pass a little above the rate: a busbw slightly over 100 %% of the goodput at 1 MiB is "
            "that)" % a.bw if a.bw else ", no shaping",
            os.cpu_count(), a.hosts, a.per_host, "version under Machine", a.per_host,
            " ".join(OMPI_TUNED), r.placement, "version under Machine", a.per_host, n, a.timeout, GRACE))
    if r.failures:
        L.append("## Failures\n")
        L.append("The last lines each host printed:\n")
        for rep, key, what, status, tail in r.failures:
            L.append("- repeat %d, %s, %s: **%s**" % (rep, key, what, status))
            for t in tail:
                L.append("  - `%s`" % t.replace("`", "'"))
        L.append("")
    L.append("## Runs\n")
    L.append("Before every library run the script waits (at most 20 s) for a second in which other "
             "processes used less than 10 %% of the CPUs; a run during which other processes (not "
             "started by this script; sampled from /proc every 0.5 s) took more than 10 %% of the %d "
             "CPUs is run again, %d time(s) at most, and the last attempt is kept (bench/compare's "
             "interference meter).\n" % (os.cpu_count(), RETRIES))
    L.append("| repeat | library | wall (s) | other processes' CPU (s) | share | who | attempt | waited (s) | "
             "load before | load after |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for rep, key, wall, l0, l1, foreign, att, waited, who in runs:
        share = foreign / (wall * os.cpu_count()) if wall > 0 else 0
        L.append("| %d | %s | %.1f | %.1f | %.0f %%%s | %s | %d | %.0f | %s | %s |" % (
            rep, key, wall, foreign, 100 * share, " **(interference)**" if share > 0.1 else "", who, att,
            waited, l0, l1))
    L.append("")
    L.append("Every command and its output: `%s` (not committed).\n" % os.path.basename(a.log))
    L.append("## Machine\n")
    with open(a.machine) as f:
        L.append(f.read())
    with open(a.out, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    sys.exit(main())
