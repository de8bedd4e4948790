"""PyTorch's own test suite for process groups, run on chorus (or Gloo).

    dist_suite.py [--backend chorus|gloo] [--world-size N] [--shard K/N]
                  [--start fork|spawn] [--json FILE] [-k SUBSTRING]...

Debian's python3-torch ships the suite as
torch/testing/_internal/distributed/distributed_test.py
(DistributedTest._DistTestBase); PyTorch drives it with
test/distributed/test_distributed_spawn.py and the variables BACKEND,
WORLD_SIZE and TEMP_DIR.  This driver does the same for chorus, with every
place where the suite branches on the backend's name answering for chorus
as it answers for Gloo (chorus is a CPU backend that claims Gloo's
features): the comparisons BACKEND == "gloo" / != "gloo" and the
require_backend({"gloo", ...}) decorators are rewritten in the suite's
syntax tree before it is compiled, and "chorus" joins Gloo in the feature
sets (DistTestCases) and the profiling allow-lists.  For either backend,
the harness's file barrier polls every 5 ms instead of 100 ms.  Nothing
else of the suite changes; each rewrite is counted and printed.

Each test starts WORLD_SIZE processes and a process group of its own.
--start fork (the default) forks them from this process, which has already
imported torch; --start spawn starts fresh interpreters as PyTorch's CI
does (about 2.5 CPU-seconds of imports per process).

Exit status: 0 when every test passed or was skipped by the suite itself,
1 when one failed.  A test that fails on chorus for a reason that is not
chorus's goes into EXCLUDED below, with that reason.
"""
import argparse
import ast
import json
import logging
import os
import sys
import tempfile
import time
import unittest

from suite_common import Recorder, install_expecttest

SUITE = "torch.testing._internal.distributed.distributed_test"

# Tests left out on purpose: name -> why.  Empty: every test Gloo runs here,
# chorus runs.
EXCLUDED = {}


class _AsGloo(ast.NodeTransformer):
    """BACKEND == "gloo"  ->  BACKEND in ("gloo", NAME)   (and != -> not in);
    require_backend({"gloo", ...})  ->  require_backend({"gloo", NAME, ...})."""

    def __init__(self, name):
        self.name = name
        self.compares = 0
        self.decorators = 0

    @staticmethod
    def _is_backend(node):
        return isinstance(node, ast.Name) and node.id == "BACKEND"

    @staticmethod
    def _is_gloo(node):
        return isinstance(node, ast.Constant) and node.value == "gloo"

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        left, right = node.left, node.comparators[0]
        if self._is_gloo(left) and self._is_backend(right):
            left, right = right, left
        if not (self._is_backend(left) and self._is_gloo(right)):
            return node
        self.compares += 1
        op = ast.In() if isinstance(node.ops[0], ast.Eq) else ast.NotIn()
        both = ast.Tuple(elts=[ast.Constant("gloo"), ast.Constant(self.name)], ctx=ast.Load())
        return ast.copy_location(ast.Compare(left=left, ops=[op], comparators=[both]), node)

    def visit_Call(self, node):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "require_backend"
                and node.args and isinstance(node.args[0], ast.Set)
                and any(self._is_gloo(e) for e in node.args[0].elts)):
            node.args[0].elts.append(ast.Constant(self.name))
            self.decorators += 1
        return node


class _FastBarrier(ast.NodeTransformer):
    """The suite's file barrier between a test's processes (Barrier.sync,
    twice per test) looks every 5 ms instead of every 100 ms: at 0.3 s a
    test, the harness's own sleeps were a third of the suite's time, on any
    backend.  Rewrites the one time.sleep(...) call inside Barrier.sync."""

    def __init__(self):
        self.where = []
        self.sleeps = 0

    def _inside(self, node):
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()
        return node

    visit_ClassDef = visit_FunctionDef = _inside

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if (self.where[-2:] == ["Barrier", "sync"] and isinstance(f, ast.Attribute)
                and f.attr == "sleep" and isinstance(f.value, ast.Name) and f.value.id == "time"
                and len(node.args) == 1):
            node.args[0] = ast.copy_location(ast.Constant(0.005), node.args[0])
            self.sleeps += 1
        return node


def load_suite(backend):
    """Imports the suite with chorus answering as Gloo (see the docstring)."""
    install_expecttest()
    import torch  # noqa: F401
    import chorus.torch  # registers "chorus"
    # DDP (any backend) imports torch.distributed._shard, which Python 3.11
    # refuses with torch 1.13 unless this runs first.
    chorus.torch.fix_fsdp_import()
    from torch.testing._internal import common_distributed
    if backend != "gloo":
        for feature in common_distributed.DistTestCases.backend_feature.values():
            if "gloo" in feature:
                feature.add(backend)
        for ops in common_distributed.DistTestCases.skip_collective.values():
            if "gloo" in ops:
                ops.add(backend)
    import importlib.util
    spec = importlib.util.find_spec(SUITE)
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), spec.origin)
    rewrite = _AsGloo(backend)
    if backend != "gloo":
        tree = rewrite.visit(tree)
    barrier = _FastBarrier()
    tree = ast.fix_missing_locations(barrier.visit(tree))
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE] = module
    exec(compile(tree, spec.origin, "exec"), module.__dict__)
    if backend != "gloo":
        for allow in ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                      "SEND_RECV_PROFILING_SUPPORTED_BACKENDS"):
            getattr(module, allow).append(backend)
    return module, rewrite, barrier


def _environment(argv):
    """BACKEND, WORLD_SIZE and TEMP_DIR must be set before the suite is
    imported, here and in every spawned child (which re-imports this file)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=os.environ.get("BACKEND", "chorus"))
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", "2")))
    p.add_argument("--shard", default="1/1", help="K/N: every N-th test from the K-th")
    p.add_argument("--start", choices=("fork", "spawn"), default="fork")
    p.add_argument("--json", help="write {test: [status, seconds, detail]} here")
    p.add_argument("-k", action="append", default=[], help="only tests whose name contains this")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    args = p.parse_args(argv)
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    return args


def _die_with_parent():
    """A test's processes end when this driver does (killed by CTest's
    timeout, say): PR_SET_PDEATHSIG, set in each forked child."""
    import ctypes
    import signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    ARGS = _environment(sys.argv[1:])
    _temp = tempfile.TemporaryDirectory(prefix="chorus-dist-suite-")
    os.environ["TEMP_DIR"] = _temp.name
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # The harness kills a test's processes after this long (its default:
    # 300 s; a test here takes seconds).
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    os.register_at_fork(after_in_child=_die_with_parent)

# The harness logs every process start and store barrier at INFO.
logging.disable(logging.INFO)

# Spawned children import this file as __mp_main__ with the parent's
# environment: they rebuild the same classes.
_suite, _rewrite, _barrier = load_suite(os.environ["BACKEND"])


class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    START = "fork"

    def setUp(self):
        super().setUp()
        import torch.multiprocessing
        self._start_processes(torch.multiprocessing.get_context(self.START).Process)


def main(args):
    TestDistBackendWithSpawn.START = args.start
    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    k, n = (int(x) for x in args.shard.split("/"))
    if not 1 <= k <= n:
        sys.exit("dist_suite: --shard K/N needs 1 <= K <= N")
    names = names[k - 1::n]
    if args.list:
        print("\n".join(names))
        return 0
    for name, why in EXCLUDED.items():
        if hasattr(TestDistBackendWithSpawn, name):
            setattr(TestDistBackendWithSpawn, name, unittest.skip("excluded: " + why)(
                getattr(TestDistBackendWithSpawn, name)))
    print("dist_suite: %s, world size %s, %d tests (shard %s), %s; rewritten for %s: "
          "%d comparisons with \"gloo\", %d require_backend sets; %d barrier sleep(s) made 5 ms" % (
              args.backend, os.environ["WORLD_SIZE"], len(names), args.shard, args.start,
              args.backend, _rewrite.compares, _rewrite.decorators, _barrier.sleeps),
          flush=True)
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    t0 = time.monotonic()
    runner = unittest.TextTestRunner(resultclass=Recorder, verbosity=0, stream=open(os.devnull, "w"))
    result = runner.run(suite)
    counts = {}
    for status, _, _ in result.record.values():
        counts[status] = counts.get(status, 0) + 1
    for name, (status, _, detail) in sorted(result.record.items()):
        if status == "FAIL":
            print("\n==== FAIL %s\n%s" % (name, detail))
    print("dist_suite: %s ws %s: %s in %.0f s" % (
        args.backend, os.environ["WORLD_SIZE"],
        ", ".join("%d %s" % (c, s.lower()) for s, c in sorted(counts.items())),
        time.monotonic() - t0), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.record, f, indent=1, sort_keys=True)
    return 1 if counts.get("FAIL") else 0


if __name__ == "__main__":
    rc = main(ARGS)
    _temp.cleanup()
    sys.exit(rc)
