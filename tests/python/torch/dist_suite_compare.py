"""PyTorch's distributed test suite on chorus and on Gloo, side by side.

    dist_suite_compare.py [--world-sizes 2,3,4] [--start fork|spawn] [--out FILE.md]

Runs dist_suite.py for each world size, Gloo then chorus (the same tests,
the same machine, one after the other), and prints a table: tests passed,
failed and skipped per backend, and every test whose outcome differs.
Exit status 1 when a test passes on Gloo and not on chorus.  For release
checks and closing notes; CI runs dist_suite.py itself at world size 2.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(backend, ws, start, where):
    out = os.path.join(where, "%s.%d.json" % (backend, ws))
    log = os.path.join(where, "%s.%d.log" % (backend, ws))
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, os.path.join(HERE, "dist_suite.py"),
                              "--backend", backend, "--world-size", str(ws),
                              "--start", start, "--json", out],
                             stdout=f, stderr=subprocess.STDOUT)
    secs = time.monotonic() - t0
    if not os.path.exists(out):
        sys.exit("dist_suite_compare: %s at world size %d ended (%d) without results: see %s"
                 % (backend, ws, rc, log))
    with open(out) as f:
        return json.load(f), secs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2,3,4")
    p.add_argument("--start", choices=("fork", "spawn"), default="fork")
    p.add_argument("--out", help="also write the table here (Markdown)")
    p.add_argument("--keep", help="keep the logs and JSON results in this directory")
    args = p.parse_args()
    where = args.keep or tempfile.mkdtemp(prefix="chorus-suite-compare-")
    os.makedirs(where, exist_ok=True)
    lines = ["| world size | Gloo passed | chorus passed | Gloo failed | chorus failed "
             "| skipped (Gloo / chorus) | Gloo s | chorus s |",
             "|---|---|---|---|---|---|---|---|"]
    diffs, worse = [], 0
    for ws in (int(w) for w in args.world_sizes.split(",")):
        res = {}
        for backend in ("gloo", "chorus"):
            res[backend] = run(backend, ws, args.start, where)
            print("world size %d, %s: done in %.0f s" % (ws, backend, res[backend][1]), flush=True)

        def count(b, status):
            return sum(1 for v in res[b][0].values() if v[0] == status)
        lines.append("| %d | %d | %d | %d | %d | %d / %d | %.0f | %.0f |" % (
            ws, count("gloo", "PASS"), count("chorus", "PASS"), count("gloo", "FAIL"),
            count("chorus", "FAIL"), count("gloo", "SKIP"), count("chorus", "SKIP"),
            res["gloo"][1], res["chorus"][1]))
        for name in sorted(set(res["gloo"][0]) | set(res["chorus"][0])):
            g = res["gloo"][0].get(name, ["-"])[0]
            c = res["chorus"][0].get(name, ["-"])[0]
            if g != c:
                diffs.append("| %d | %s | %s | %s |" % (ws, name, g, c))
                worse += g == "PASS"
    text = "\n".join(lines)
    if diffs:
        text += "\n\nTests whose outcome differs:\n\n| world size | test | Gloo | chorus |\n" \
                "|---|---|---|---|\n" + "\n".join(diffs)
    else:
        text += "\n\nEvery test has the same outcome on both."
    text += "\n\n(`tests/python/torch/dist_suite_compare.py --world-sizes %s --start %s`; " \
            "logs in %s)\n" % (args.world_sizes, args.start, where)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
