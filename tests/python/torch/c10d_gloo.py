"""PyTorch's tests of the Gloo process group, with chorus in Gloo's place.

    c10d_gloo.py --src DIR [--backend gloo|chorus] [--json FILE] [-k SUBSTRING]...
    c10d_gloo.py --src DIR --compare [--json-dir DIR]

DIR holds test/distributed/test_c10d_gloo.py and test_c10d_common.py of the
PyTorch source that matches the installed torch (Debian's source package of
python3-torch: scripts/torch_tests.sh fetches it).  They are never copied
into this tree.

For --backend chorus both files are rewritten in their syntax trees before
they are compiled, mechanically, and each rewrite is counted and printed:

  c10d.ProcessGroupGloo (or dist.)  ->  a constructor that makes a chorus
                                        group from the same arguments (store,
                                        rank, size, and Gloo's options or a
                                        timeout: the timeout is kept, the
                                        devices and threads have no meaning
                                        for chorus); isinstance() with it
                                        means a chorus group
  the string "gloo" given to a call   ->  "chorus" (init_process_group,
  (positionally or as backend=)          new_group, the suites' helpers
                                          that take a backend's name)

For both backends, a @sandcastle_skip("... Windows ...") decorator is
removed (counted): PyTorch's CI skips those tests everywhere for failures
on Windows, and on Linux they run (test_sparse_allreduce_basics: several
sparse tensors per rank).  Nothing else of the tests changes.  For both
backends the harness starts a test's processes with fork (the file asks for
spawn: 2.5 CPU-seconds of imports per process, the same tests either way).

--compare runs the file once per backend (two child processes) and exits 1
when a test passes on Gloo and not on chorus (issue 42), printing each such
test and what chorus said; tests that fail on Gloo too, or that both skip,
are listed and do not count.  Exit 77 when DIR lacks the files or torch
cannot be imported (the reason is printed).
"""
import argparse
import ast
import datetime
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import types
import unittest


from suite_common import Recorder, install_expecttest


class _ChorusForGloo(ast.NodeTransformer):
    """The two rewrites of the module docstring."""

    def __init__(self):
        self.constructors = 0
        self.backends = 0

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if (node.attr == "ProcessGroupGloo" and isinstance(node.value, ast.Name)
                and node.value.id in ("c10d", "dist")):
            self.constructors += 1
            return ast.copy_location(ast.Name(id="_ChorusAsGloo", ctx=node.ctx), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        for i, a in enumerate(node.args):
            if isinstance(a, ast.Constant) and a.value == "gloo":
                node.args[i] = ast.copy_location(ast.Constant("chorus"), a)
                self.backends += 1
        for k in node.keywords:
            if k.arg == "backend" and isinstance(k.value, ast.Constant) and k.value.value == "gloo":
                k.value = ast.copy_location(ast.Constant("chorus"), k.value)
                self.backends += 1
        return node


class _UnskipWindows(ast.NodeTransformer):
    """Drops @sandcastle_skip(reason) where the reason is Windows'."""

    def __init__(self):
        self.removed = 0

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        keep = []
        for d in node.decorator_list:
            if (isinstance(d, ast.Call) and isinstance(d.func, ast.Name)
                    and d.func.id == "sandcastle_skip" and d.args
                    and isinstance(d.args[0], ast.Constant)
                    and "Windows" in str(d.args[0].value)):
                self.removed += 1
                continue
            keep.append(d)
        node.decorator_list = keep
        return node


def _chorus_as_gloo():
    """What c10d.ProcessGroupGloo becomes: a chorus group from Gloo's
    constructor arguments."""
    from chorus.torch import ProcessGroupChorus

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, ProcessGroupChorus)

    class _ChorusAsGloo(metaclass=_Meta):
        class _Options:
            def __init__(self):
                self._timeout = 1800.0
                self._devices = []
                self._threads = 2

        def __new__(cls, store, rank, size, options=None, timeout=None):
            if isinstance(options, datetime.timedelta):
                timeout, options = options, None
            if timeout is None:
                timeout = datetime.timedelta(seconds=options._timeout if options else 1800.0)
            if not isinstance(timeout, datetime.timedelta):
                timeout = datetime.timedelta(seconds=float(timeout))
            return ProcessGroupChorus(store, rank, size, timeout)

    return _ChorusAsGloo


def _load(path, name, backend, rewrite, unskip):
    """Compiles path as module name (rewritten for chorus) into sys.modules."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    tree = unskip.visit(tree)
    if backend == "chorus":
        tree = ast.fix_missing_locations(rewrite.visit(tree))
    module = types.ModuleType(name)
    module.__file__ = path
    if backend == "chorus":
        module._ChorusAsGloo = _chorus_as_gloo()
    sys.modules[name] = module
    exec(compile(tree, path, "exec"), module.__dict__)
    return module


def load_tests(src, backend):
    install_expecttest()
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import chorus.torch
    chorus.torch.fix_fsdp_import()
    from torch.testing._internal import common_distributed
    import torch.multiprocessing

    def start_forked(self):
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    common_distributed.MultiProcessTestCase._spawn_processes = start_forked
    d = os.path.join(src, "test", "distributed")
    sys.path.insert(0, d)
    rewrite, unskip = _ChorusForGloo(), _UnskipWindows()
    _load(os.path.join(d, "test_c10d_common.py"), "test_c10d_common", backend, rewrite, unskip)
    mod = _load(os.path.join(d, "test_c10d_gloo.py"), "test_c10d_gloo_under_test", backend,
                rewrite, unskip)
    return mod, rewrite, unskip


def run(args):
    mod, rewrite, unskip = load_tests(args.src, args.backend)
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    count = 0
    for name in sorted(dir(mod)):
        cls = getattr(mod, name)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)
                and cls.__module__ == mod.__name__):
            continue
        for t in sorted(loader.getTestCaseNames(cls)):
            if args.k and not any(k in "%s.%s" % (name, t) for k in args.k):
                continue
            suite.addTest(cls(t))
            count += 1
    print("c10d_gloo: %s, %d tests of test_c10d_gloo.py; %d Windows-only skip(s) removed; "
          "rewritten for %s: %d ProcessGroupGloo constructors, %d backend names" % (
              args.backend, count, unskip.removed, args.backend, rewrite.constructors,
              rewrite.backends), flush=True)
    t0 = time.monotonic()
    Recorder.QUALIFIED = True
    runner = unittest.TextTestRunner(resultclass=Recorder, verbosity=0,
                                     stream=open(os.devnull, "w"))
    result = runner.run(suite)
    counts = {}
    for status, _, _ in result.record.values():
        counts[status] = counts.get(status, 0) + 1
    print("c10d_gloo: %s: %s in %.0f s" % (
        args.backend, ", ".join("%d %s" % (c, s.lower()) for s, c in sorted(counts.items())),
        time.monotonic() - t0), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.record, f, indent=1, sort_keys=True)
    return 1 if counts.get("FAIL") else 0


def compare(args):
    out = args.json_dir or tempfile.mkdtemp(prefix="chorus-c10d-gloo-")
    os.makedirs(out, exist_ok=True)
    rec = {}
    for backend in ("gloo", "chorus"):
        path = os.path.join(out, backend + ".json")
        cmd = [sys.executable, os.path.abspath(__file__), "--src", args.src, "--backend", backend,
               "--json", path] + sum((["-k", k] for k in args.k), [])
        subprocess.run(cmd, timeout=3000)
        if not os.path.exists(path):
            print("c10d_gloo: the %s run wrote no results" % backend)
            return 1
        with open(path) as f:
            rec[backend] = json.load(f)
    gloo, ours = rec["gloo"], rec["chorus"]
    behind, gloo_fails = [], []
    for name, (status, _, _) in sorted(gloo.items()):
        mine = ours.get(name, ["MISSING", 0, ""])
        if status == "PASS" and mine[0] != "PASS":
            behind.append((name, mine))
        if status == "FAIL":
            gloo_fails.append(name)
    tally = {b: sum(1 for v in rec[b].values() if v[0] == "PASS") for b in rec}
    skips = {b: sum(1 for v in rec[b].values() if v[0] == "SKIP") for b in rec}
    for name, (status, _, detail) in behind:
        print("\n==== passes on Gloo, %s on chorus: %s\n%s" % (status, name, detail[-3000:]))
    if gloo_fails:
        print("fail on Gloo too (not counted): %s" % ", ".join(gloo_fails))
    print("c10d_gloo --compare: Gloo passes %d, chorus %d; skipped %d and %d; %d test(s) pass "
          "on Gloo and not on chorus" % (tally["gloo"], tally["chorus"], skips["gloo"],
                                         skips["chorus"], len(behind)))
    return 1 if behind else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True)
    p.add_argument("--backend", choices=("gloo", "chorus"), default="chorus")
    p.add_argument("--json")
    p.add_argument("--json-dir")
    p.add_argument("--compare", action="store_true")
    p.add_argument("-k", action="append", default=[])
    args = p.parse_args()
    f = os.path.join(args.src, "test", "distributed", "test_c10d_gloo.py")
    if not os.path.exists(f):
        print("SKIPPED: %s is missing (scripts/torch_tests.sh fetches Debian's source of the "
              "installed torch)" % f)
        return 77
    try:
        import torch.distributed  # noqa: F401
        import chorus.torch  # noqa: F401
    except ImportError as e:
        print("SKIPPED: torch or the chorus backend cannot be imported: %s" % e)
        return 77
    logging.disable(logging.INFO)
    # The harness kills a test's processes after this long (its default:
    # 300 s; a test here takes a second).  Forked, Gloo's run now and then
    # hangs in a DDP comm-hook test's exit (a C++ thread joined under the
    # GIL): such a test fails on Gloo, which does not count, after this.
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "30")
    return compare(args) if args.compare else run(args)


if __name__ == "__main__":
    sys.exit(main())
