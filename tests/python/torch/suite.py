"""Runs the torch scripts of this folder under torchrun and chorusrun, with
backend "gloo" and "chorus", and compares what they print.

    suite.py CHORUSRUN CASE

CASE:
  tutorials     the tutorial scripts (p2p + six collectives, gather,
                objects, the DDP tutorial) in one launch on 4 processes
                (tutorials.py): chorus under torchrun and under chorusrun
                prints what Gloo under torchrun prints
  gloo_wrong    where Gloo is wrong or crashes, chorus is right or raises
                on every rank, in time, killing nobody (4 processes)
  ddp:N         DDP configurations at N ranks: chorus's weights = Gloo's
  fsdp          ZeRO-3's all-gather / reduce-scatter(AVG) training by hand
                on chorus at 2 ranks = DDP's weights (on Gloo it cannot
                run); torch's own FSDP too where this torch runs it on CPU
  nodes         2 emulated hosts x 2 processes (tests/fixtures/netns.sh,
                root): the collectives tutorial and DDP under torchrun
                (static rendezvous, --node_rank) and under chorusrun (c10d
                rendezvous) print and reach what Gloo on one host does
                (exit 77 when the hosts cannot be made)
Exit 0 when everything matched; every difference is printed.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(HERE, "..", "..", "fixtures", "netns.sh")
PY = sys.executable
CHORUSRUN = sys.argv[1]
CASE = sys.argv[2]
TIMEOUT = int(os.environ.get("SUITE_TIMEOUT", "240"))
failures = []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_lines(text, where):
    """The scripts' "rank N: ..." lines: from the per-rank files common.out
    wrote into where (whole lines, whatever the launcher did to stdout),
    else from the output."""
    lines = []
    for name in sorted(os.listdir(where)):
        if name.endswith(".finished"):
            continue
        with open(os.path.join(where, name)) as f:
            lines += f.read().splitlines()
    shutil.rmtree(where, ignore_errors=True)
    if not lines:
        lines = [m.group(0) for m in re.finditer(r"rank \d+:.*", text)]
    return sorted(lines)


def script_env(backend, extra=None):
    """The environment of a script run: its backend, this folder on the
    path, a fresh folder for its rank lines (rank_lines removes it)."""
    e = dict(os.environ)
    e["TEST_LINES_DIR"] = tempfile.mkdtemp(prefix="chorus-lines.")
    e["TEST_BACKEND"] = backend
    e["PYTHONPATH"] = HERE + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(extra or {})
    return e


EXIT_GRACE = 30  # seconds a Gloo run may take to exit once every rank is done


def wait_run(p, n, backend, where):
    """Waits for the launcher p; returns (its output, None) when it exits,
    (output, "timeout") after TIMEOUT.  A Gloo run (only Gloo: a hang of
    chorus is a failure) whose n ranks all marked themselves finished
    (common.finish) and that has still not exited EXIT_GRACE s later is
    killed: (output, "gloo-exit")."""
    start, all_done = time.monotonic(), None
    while True:
        try:
            text, _ = p.communicate(timeout=2)
            return text, None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if backend == "gloo" and all_done is None and os.path.isdir(where) and sum(
                f.endswith(".finished") for f in os.listdir(where)) >= n:
            all_done = now
        hung = ("timeout" if now - start > TIMEOUT else
                "gloo-exit" if all_done is not None and now - all_done > EXIT_GRACE else None)
        if hung:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
            return text, hung


def launch(launcher, n, backend, script, *args, env=None, expect_ok=True):
    """Runs script on n processes; returns (exit status, its rank lines)."""
    e = script_env(backend, env)
    path = os.path.join(HERE, script)
    if launcher == "torchrun":
        # Debian's torch 1.13 on Python 3.11: torchrun's default "--redirects
        # 0" is parsed to None (Std.from_str iterates an IntFlag, which no
        # longer yields 0) and the agent crashes; "1" works.
        cmd = [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
               "--master_port", str(free_port()), "--redirects", "1", "--tee", "1",
               path] + list(args)
    else:
        cmd = [CHORUSRUN, "--standalone", "-n", str(n), "--", PY, path] + list(args)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                         start_new_session=True, text=True)
    try:
        text, hung = wait_run(p, n, backend, e["TEST_LINES_DIR"])
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # nothing may outlive the run
        except ProcessLookupError:
            pass
    if hung == "timeout":
        failures.append("%s %s n=%d %s: timed out after %d s" % (launcher, backend, n, script,
                                                                 TIMEOUT))
        print(text[-3000:])
        shutil.rmtree(e["TEST_LINES_DIR"], ignore_errors=True)
        return -1, []
    if hung == "gloo-exit":
        print("     note: Gloo's %s run reached destroy_process_group on all %d ranks but did"
              " not exit within %d s (torch's shutdown hang, pytorch#75097); killed, its"
              " results used" % (script, n, EXIT_GRACE))
        p.returncode = 0
    if (p.returncode != 0 and launcher == "torchrun" and not (env or {}).get("_RETRIED")
            and "address already in use" in text.lower()):
        # free_port()'s port was taken by someone else before torchrun bound it.
        shutil.rmtree(e["TEST_LINES_DIR"], ignore_errors=True)
        return launch(launcher, n, backend, script, *args, env=dict(env or {}, _RETRIED="1"),
                      expect_ok=expect_ok)
    lines = rank_lines(text, e["TEST_LINES_DIR"])
    if expect_ok and p.returncode != 0:
        failures.append("%s %s n=%d %s %s: exit status %d" % (launcher, backend, n, script,
                                                              " ".join(args), p.returncode))
        print(text[-4000:])
    return p.returncode, lines


def launch_nodes(launcher, addrs, per_host, script, *args):
    """Runs script with backend chorus on every emulated host (addrs[i] is
    host i's address; the rendezvous is on host 0), per_host processes each;
    returns (worst exit status, the rank lines of all hosts)."""
    e = script_env("chorus")
    port, n = free_port(), len(addrs)
    path = os.path.join(HERE, script)
    procs = []
    for i in range(n):
        if launcher == "torchrun":
            cmd = [PY, "-m", "torch.distributed.run", "--nnodes", str(n), "--node_rank", str(i),
                   "--nproc_per_node", str(per_host), "--master_addr", addrs[0],
                   "--master_port", str(port), "--redirects", "1", "--tee", "1", path]
        else:
            cmd = [CHORUSRUN, "--nnodes", str(n), "-n", str(per_host), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "%s:%d" % (addrs[0], port), "--rdzv-id", "suite%d" % port,
                   "--", PY, path]
        procs.append(subprocess.Popen(["bash", NETNS, "exec", str(i)] + cmd + list(args),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=e,
                                      start_new_session=True, text=True))
    texts, worst = [], 0
    for p in procs:
        try:
            text, _ = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            text, _ = p.communicate()
            failures.append("%s on %d hosts %s: timed out after %d s" % (launcher, n, script,
                                                                      TIMEOUT))
        texts.append(text)
        worst = worst or p.returncode
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if worst != 0:
        failures.append("%s on %d hosts %s: exit status %d" % (launcher, n, script, worst))
        for i, t in enumerate(texts):
            print("---- host %d:\n%s" % (i, t[-3000:]))
    return worst, rank_lines("\n".join(texts), e["TEST_LINES_DIR"])


def same_output(what, ref, got):
    if ref != got:
        failures.append(what + ": output differs from Gloo's")
        print("--- Gloo under torchrun\n" + "\n".join(ref))
        print("--- " + what + "\n" + "\n".join(got))
    else:
        print("ok   %s (%d lines, as Gloo's)" % (what, len(got)))


def tutorials():
    # The four tutorials in one launch (tutorials.py): a launch costs each
    # rank a torch import, and the DDP tutorial on 2 ranks is ddp:2's case.
    script, n = "tutorials.py", 4
    tmp = tempfile.mkdtemp(prefix="chorus-tut.")
    _, ref = launch("torchrun", n, "gloo", script, tmp)
    if not ref:
        failures.append("%s n=%d: Gloo printed nothing" % (script, n))
    for launcher in ("torchrun", "chorusrun"):
        _, got = launch(launcher, n, "chorus", script, tmp)
        same_output("chorus under %s n=%d %s" % (launcher, n, script), ref, got)
    os.rmdir(tmp)


def gloo_wrong():
    # Two launches, not six: each case once, the one that cannot fail the
    # group under both launchers (an expected error must end a launch).
    for launcher, cases in (("torchrun", ("noncontig", "gather")),
                            ("chorusrun", ("noncontig", "allgather"))):
        rc, lines = launch(launcher, 4, "chorus", "gloo_wrong.py", ",".join(cases),
                           env={"CHORUS_TIMEOUT": "30"})
        for case in cases:
            oks = [l for l in lines if l.endswith("ok " + case)]
            if rc != 0 or len(oks) != 4:
                failures.append("gloo_wrong %s under %s: %d of 4 ranks ok (exit %d)" % (
                    case, launcher, len(oks), rc))
                print("\n".join(lines))
            else:
                print("ok   gloo_wrong %s under %s:\n      %s" % (
                    case, launcher, case != "noncontig" and "\n      ".join(
                        l for l in lines if "error as expected" in l) or
                    "(right answer on every rank)"))


def compare(a, b, what, *tol):
    r = subprocess.run([PY, os.path.join(HERE, "compare_weights.py"), a, b] + list(tol),
                       capture_output=True, text=True)
    print(r.stdout.rstrip())
    if r.returncode != 0:
        failures.append(what)
    else:
        print("ok   " + what)


def ddp(n):
    with tempfile.TemporaryDirectory(prefix="chorus-ddp.") as tmp:
        ref, got = os.path.join(tmp, "gloo.pt"), os.path.join(tmp, "chorus.pt")
        launch("torchrun", n, "gloo", "ddp_equivalence.py", ref)
        launch("torchrun", n, "chorus", "ddp_equivalence.py", got)
        if os.path.exists(ref) and os.path.exists(got):
            compare(ref, got, "DDP at %d ranks: chorus = Gloo" % n)
        else:
            failures.append("DDP at %d ranks: no weights written" % n)


def fsdp():
    """Sharded data parallel in torch on CPU: ZeRO-3's collectives by hand
    (zero_sharded.py) on chorus = DDP on Gloo; torch's own FSDP where this
    torch can run it on CPU."""
    with tempfile.TemporaryDirectory(prefix="chorus-fsdp.") as tmp:
        ref, got = os.path.join(tmp, "ddp.pt"), os.path.join(tmp, "zero.pt")
        launch("torchrun", 2, "gloo", "zero_sharded.py", ref, env={"MODE": "ddp"})
        rc, lines = launch("torchrun", 2, "chorus", "zero_sharded.py", got)
        print("\n".join(l for l in lines if "step 9" in l))
        if os.path.exists(ref) and os.path.exists(got):
            compare(ref, got, "ZeRO-3 by hand on chorus at 2 ranks = DDP on Gloo")
        else:
            failures.append("ZeRO-3 by hand: no weights written")
        # Gloo cannot run it (no _allgather_base): checked, not assumed.
        rc, _ = launch("torchrun", 2, "gloo", "zero_sharded.py", os.path.join(tmp, "x.pt"),
                       expect_ok=False)
        print("     the same on Gloo: exit status %d (%s)" % (rc, "fails, as known" if rc
                                                              else "runs: update the docs"))
        # torch's FSDP: torch 1.13 puts its compute on CUDA whatever the
        # module's device; a CPU-only torch (Debian's) cannot construct it.
        ref2, got2 = os.path.join(tmp, "ddp2.pt"), os.path.join(tmp, "fsdp.pt")
        rc, lines = launch("torchrun", 2, "chorus", "fsdp.py", got2, expect_ok=False)
        if rc != 0 and any("needs CUDA" in l for l in lines):
            print("     SKIPPED torch FSDP: %s" % next(l for l in lines if "needs CUDA" in l))
        else:
            launch("torchrun", 2, "gloo", "fsdp.py", ref2, env={"MODE": "ddp"})
            if rc == 0 and os.path.exists(ref2) and os.path.exists(got2):
                compare(ref2, got2, "torch FSDP on chorus at 2 ranks = DDP on Gloo")
            else:
                failures.append("torch FSDP on chorus failed (exit status %d)" % rc)


def nodes():
    """Two emulated hosts with two processes each: what users do with
    torchrun --nnodes and chorusrun --nnodes.  The references are Gloo's
    runs of the same scripts on one host with 4 processes."""
    scratch = tempfile.mkdtemp(prefix="chorus-nodes.")
    os.environ["CHORUS_NETNS_DIR"] = scratch + "/netns"
    # chorusrun across hosts wants the job's secret on every node.
    key = os.path.join(scratch, "key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    os.environ["CHORUS_JOB_SECRET_FILE"] = key
    os.environ["CHORUS_NETNS_PREFIX"] = "cpt%d" % os.getpid()
    up = subprocess.run(["bash", NETNS, "up", "2"], capture_output=True, text=True)
    if up.returncode == 77:
        print("SKIPPED: " + (up.stderr.strip().splitlines() or ["no reason given"])[-1])
        sys.exit(77)
    try:
        if up.returncode != 0:
            failures.append("cannot make emulated hosts: " + up.stderr.strip())
            return
        addrs = [subprocess.run(["bash", NETNS, "addr", str(i)], capture_output=True,
                                text=True, check=True).stdout.strip() for i in range(2)]
        _, ref = launch("torchrun", 4, "gloo", "tutorial_p2p_collectives.py")
        for launcher in ("torchrun", "chorusrun"):
            _, got = launch_nodes(launcher, addrs, 2, "tutorial_p2p_collectives.py")
            same_output("chorus under %s, 2 hosts x 2, tutorial_p2p_collectives.py" % launcher,
                        ref, got)
        with tempfile.TemporaryDirectory(prefix="chorus-ddp.") as tmp:
            ref = os.path.join(tmp, "gloo.pt")
            launch("torchrun", 4, "gloo", "ddp_equivalence.py", ref)
            for launcher in ("torchrun", "chorusrun"):
                got = os.path.join(tmp, launcher + ".pt")
                launch_nodes(launcher, addrs, 2, "ddp_equivalence.py", got)
                if os.path.exists(ref) and os.path.exists(got):
                    compare(ref, got, "DDP under %s on 2 hosts x 2 = Gloo on one host" % launcher)
                else:
                    failures.append("DDP under %s on 2 hosts: no weights written" % launcher)
    finally:
        subprocess.run(["bash", NETNS, "down"], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if CASE == "tutorials":
    tutorials()
elif CASE == "gloo_wrong":
    gloo_wrong()
elif CASE.startswith("ddp:"):
    ddp(int(CASE[4:]))
elif CASE == "fsdp":
    fsdp()
elif CASE == "nodes":
    nodes()
else:
    sys.exit("unknown case " + CASE)
for f in failures:
    print("FAIL " + f)
sys.exit(1 if failures else 0)
