"""The PyTorch backend's job secret, attacked while the job runs.

    secret.py STRANGER CHORUSRUN

Each case starts a 2-rank job whose ranks form a chorus group, then hold it
open (rank 0 waits for a file) while STRANGER (tests/launcher/
secret_stranger.c) runs the store handshake against the group's store, whose
address rank 0 logs ("bootstrap: ... store HOST:PORT", CHORUS_LOG_LEVEL=INFO),
with the public key CHORUS_INSECURE=1 would use and with a key of its own.
Both must be refused, and every rank must log where its secret came from
("job secret from ..."):

  torchrun        torchrun, env://, no secret: rank 0's fresh one, in a file
                  of the runtime directory (every rank on one host), only
                  its name through torch's store; the stranger also reads
                  torch's store (no authentication) and must not find the
                  secret there
  filestore       two processes by hand, a FileStore, no secret: the same
  tcpstore        two processes by hand, a TCPStore of the user's own and
                  CHORUS_JOB_SECRET: the user's secret, not a fresh one
  chorusrun       chorusrun, env:// (torch's store over chorusrun's own):
                  chorusrun's secret, CHORUS_JOB_SECRET_FILE

Two more cases attack torch's store itself (issue 42): a TCPStore of the
test's own stands for the job's; ranks 1 and 2 of a 3-rank group wait in it
for a rank 0 that never comes, and a stranger -- another local user (nobody,
through setpriv) when the test runs as root, else this user with a visible
note -- connects to that store (it has no authentication) and runs a rank 0
of its own with no secret, so that it puts a fresh one of its own under
"chorus-store" beside the address of its own chorus store.  The ranks must
not join the stranger's group (before the fix they did, and all_reduce gave
them the stranger's numbers):

  hijack          the ranks have CHORUS_JOB_SECRET_FILE: they ignore the
                  stranger's secret, its store cannot prove it holds theirs,
                  and init fails within seconds, naming the store
  hijack1host     the ranks have no secret and LOCAL_WORLD_SIZE ==
                  WORLD_SIZE: on one host rank 0 never puts a secret in
                  torch's store, so they refuse the value outright

Exit 0 when every case passed, 1 otherwise; 77 (skip) without torch.
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

FRESH = (r"job secret from (a fresh one this rank made, sent to the others|rank 0's fresh one,)"
         r" through the caller's key-value service")
FILE = (r"job secret from (a fresh one this rank made, in|rank 0's fresh one, from) \S+/kv-[0-9a-f]{32}"
        r"\.key \(only its name went through the caller's key-value service\)")
# Where torch 1.13 under torchrun keeps the default group's keys.
TORCHRUN_KEY = "/worker/attempt_0/default_pg/0/chorus-store"
N = 2


def worker(mode):
    """One rank: form the group, check it, hold it open for the attack."""
    import torch
    import torch.distributed as dist
    import chorus.torch  # noqa: F401  -- registers backend "chorus"
    rank = int(os.environ["RANK"])
    if mode == "filestore":
        store = dist.FileStore(os.environ["TEST_FILESTORE"], N)
        dist.init_process_group("chorus", store=store, rank=rank, world_size=N)
    elif mode == "tcpstore":
        store = dist.TCPStore("127.0.0.1", int(os.environ["TEST_PORT"]), N, rank == 0)
        dist.init_process_group("chorus", store=store, rank=rank, world_size=N)
    else:
        dist.init_process_group("chorus")
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    if t.tolist() != [3.0] * 4:
        print("worker FAILED: rank %d: all_reduce gave %s" % (rank, t.tolist()), flush=True)
        return 1
    if rank == 0:
        print("worker holding", flush=True)
        hold = os.environ["CHORUS_TEST_HOLD"]
        for _ in range(600):
            if os.path.exists(hold):
                break
            time.sleep(0.1)
    dist.barrier()
    print("worker ok rank %d" % rank, flush=True)
    dist.destroy_process_group()
    return 0


def hijack_worker(role):
    """A rank of the attacked group ("victim") or the stranger's rank 0."""
    import datetime
    import torch
    import torch.distributed as dist
    import chorus.torch  # noqa: F401
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["TEST_PORT"]), n, False,
                          timeout=datetime.timedelta(seconds=60))
    try:
        dist.init_process_group("chorus", store=store, rank=rank, world_size=n,
                                timeout=datetime.timedelta(seconds=40))
    except Exception as e:  # noqa: BLE001 -- the refusal is the point
        print("%s %d refused: %s" % (role, rank, " ".join(str(e).split())), flush=True)
        return 3
    t = torch.ones(1) * (1000 if role == "stranger" else rank + 1)
    dist.all_reduce(t)
    print("%s %d JOINED: all_reduce gave %s" % (role, rank, t.item()), flush=True)
    return 0


def hijack_case(name):
    """Ranks 1 and 2 wait in torch's store; a stranger plays rank 0."""
    import datetime
    import torch.distributed as dist
    tmp = tempfile.mkdtemp(prefix="chorus-hijack.")
    os.chmod(tmp, 0o755)
    env = dict(os.environ)
    for var in ("CHORUS_JOB_SECRET", "CHORUS_JOB_SECRET_FILE", "CHORUS_INSECURE", "RANK",
                "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    # TCP between the ranks: over shared memory the joined group would
    # still fail later (the stranger's segments are not this user's), which
    # hides whether the ranks joined at all.
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE="3", CHORUS_INIT_TIMEOUT="40",
               CHORUS_TRANSPORT="tcp")
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 4, True, timeout=datetime.timedelta(seconds=90),
                           wait_for_workers=False)
    env["TEST_PORT"] = str(port)
    victim_env = dict(env)
    if name == "hijack":
        key = os.path.join(tmp, "job.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        victim_env["CHORUS_JOB_SECRET_FILE"] = key
        want = r"refused: .*the store at (\S+|rank 0's address) refused this rank, or could not prove"
    else:
        victim_env.update(LOCAL_WORLD_SIZE="3")
        want = r"refused: .*carries a job secret, but every rank says it is on this host"
    script = os.path.abspath(__file__)
    logs = [open(os.path.join(tmp, "out%d" % i), "w+") for i in range(3)]  # one per process
    procs = [subprocess.Popen([sys.executable, script, "--hijack", "victim"], stdout=logs[r - 1],
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env=dict(victim_env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in (1, 2)]
    time.sleep(1.0)  # the victims wait for rank 0's key
    stranger = [sys.executable, script, "--hijack", "stranger"]
    who = "this user"
    if os.geteuid() == 0 and shutil.which("setpriv"):
        stranger = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + stranger
        who = "user nobody (uid 65534)"
        env["HOME"] = tmp
    procs.append(subprocess.Popen(stranger, stdout=logs[2], stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=tmp, env=dict(env, RANK="0")))
    problems = []
    for p in procs:
        if p is procs[-1]:  # the stranger waits for victims that refused it
            time.sleep(0.5)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            problems.append("pid %d timed out" % p.pid)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = ""
    for log in logs:
        log.flush()
        with open(log.name) as f:
            out += f.read()
        log.close()
    del master
    shutil.rmtree(tmp, ignore_errors=True)
    if "JOINED" in out:
        problems.append("a victim joined the stranger's group")
    refusals = [ln for ln in out.splitlines() if ln.startswith("victim") and re.search(want, ln)]
    if len(refusals) != 2:
        problems.append("%d of 2 victims refused with %r" % (len(refusals), want))
    if problems:
        print("FAIL %s (stranger: %s): %s" % (name, who, "; ".join(problems)))
        print("---- output (last 40 lines):\n" + "\n".join(out.splitlines()[-40:]) + "\n----")
        return False
    print("ok   %s: the stranger (%s) took torch's store; both ranks refused its group: %s" % (
        name, who, refusals[0].split("refused: ", 1)[1][:160]))
    return True


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_torch_store(port):
    """What a stranger reads in torch's store (it has no authentication)."""
    import datetime
    import torch.distributed as dist
    try:
        s = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=5))
        return s.get(TORCHRUN_KEY).decode(errors="replace")
    except Exception as e:  # noqa: BLE001 -- any failure is reported
        return "unreadable: %s" % e


def run_case(name, stranger, chorusrun, source):
    tmp = tempfile.mkdtemp(prefix="chorus-secret.")
    env = dict(os.environ)
    for var in ("CHORUS_JOB_SECRET", "CHORUS_JOB_SECRET_FILE", "CHORUS_INSECURE", "RANK",
                "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    env.update(CHORUS_LOG_LEVEL="INFO", CHORUS_TEST_HOLD=os.path.join(tmp, "hold"),
               OMP_NUM_THREADS="1")
    script = os.path.abspath(__file__)
    log = open(os.path.join(tmp, "out"), "w+")
    procs = []
    master_port = free_port()
    if name in ("torchrun", "chorusrun"):
        worker_cmd = [script, "--worker", "env"]
        if name == "torchrun":
            # --redirects 1: torch 1.13's default (0) crashes its agent on
            # Python 3.11 (suite.py); stderr, where the log goes, is not
            # redirected.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(N),
                   "--master_port", str(master_port), "--redirects", "1", "--tee", "1"]
        else:
            cmd = [chorusrun, "--standalone", "-n", str(N), "--", sys.executable]
        procs.append(subprocess.Popen(cmd + worker_cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env=env, start_new_session=True))
    else:
        env["TEST_FILESTORE"] = os.path.join(tmp, "filestore")
        env["TEST_PORT"] = str(free_port())
        if name == "tcpstore":
            env["CHORUS_JOB_SECRET"] = os.urandom(16).hex()
        for r in range(N):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(N))
            procs.append(subprocess.Popen([sys.executable, script, "--worker", name], stdout=log, stderr=subprocess.STDOUT, env=e,
                                          start_new_session=True))

    def text():
        log.flush()
        with open(log.name) as f:
            return f.read()

    problems = []
    deadline = time.monotonic() + 120
    while "worker holding" not in text() and time.monotonic() < deadline and any(
            p.poll() is None for p in procs):
        time.sleep(0.1)
    out = text()
    m = re.search(r"bootstrap: rank 0/%d .*, store (\S+):(\d+)" % N, out)
    if "worker holding" not in out or not m:
        problems.append("no group held open (store address %s)" % ((m.groups() if m else None),))
        verdict = ""
    else:
        v = subprocess.run([stranger, m.group(1), m.group(2)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=30)
        verdict = v.stdout.strip()
        if not verdict.startswith("stranger: refused"):
            problems.append(verdict)
        if name == "torchrun":
            found = read_torch_store(master_port)
            if found is None or not re.fullmatch(r"v1,\d+,[^,]+,(@[0-9a-f]{32}|-)", found):
                problems.append("torch's store, which anyone who reaches port %d can read, holds "
                                "%r under %s" % (master_port, found, TORCHRUN_KEY))
            else:
                verdict += "; torch's store holds only %s" % found.split(",")[-1]
    open(env["CHORUS_TEST_HOLD"], "w").close()
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append("timed out")
        try:
            os.killpg(p.pid, signal.SIGKILL)  # nothing may outlive the case
        except ProcessLookupError:
            pass
        if p.returncode not in (0, None):
            problems.append("exit status %s" % p.returncode)
    out = text()
    oks = len(re.findall(r"worker ok rank \d", out))
    srcs = re.findall(source, out, re.M)
    if oks != N:
        problems.append("%d of %d ranks finished" % (oks, N))
    if len(srcs) != N:
        problems.append("%d of %d ranks say '%s'" % (len(srcs), N, source))
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if problems:
        print("FAIL %s: %s" % (name, "; ".join(problems)))
        print("---- output (last 40 lines):\n" + "\n".join(out.splitlines()[-40:]) + "\n----")
        return False
    print("ok   %s: %s; every rank's secret is from %s" % (
        name, verdict, re.search(source, out, re.M).group(0)[len("job secret from "):]))
    return True


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2])
    if len(sys.argv) > 2 and sys.argv[1] == "--hijack":
        return hijack_worker(sys.argv[2])
    try:
        import torch.distributed  # noqa: F401
        import chorus.torch  # noqa: F401
    except ImportError as e:
        print("SKIPPED: torch or the chorus backend cannot be imported: %s" % e)
        return 77
    stranger, chorusrun = sys.argv[1], sys.argv[2]
    cases = [("torchrun", FILE), ("filestore", FRESH),
             ("tcpstore", r"job secret from CHORUS_JOB_SECRET$"),
             ("chorusrun", r"job secret from CHORUS_JOB_SECRET_FILE")]
    only = sys.argv[3:]
    ok = True
    for name, source in cases:
        if not only or name in only:
            ok = run_case(name, stranger, chorusrun, source) and ok
    if os.geteuid() != 0:
        print("note: not root, so the hijack cases' stranger runs as this user, not as another")
    for name in ("hijack", "hijack1host"):
        if not only or name in only:
            ok = hijack_case(name) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
