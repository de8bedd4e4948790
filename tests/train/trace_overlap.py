#!/usr/bin/env python3
"""Reads a merged chorus-train trace of a sharded run (--shard 3) and counts,
per rank and step, the blocks k whose forward compute overlaps the all-gather
of block k+1, and whose backward compute overlaps the all-gather of block k-1
-- the prefetch at work.  Prints "forward A/B backward C/D" (overlapping /
pairs seen).  Blocks are units 1..L (gathered once per pass, unlike unit 0).

  trace_overlap.py TRACE LAYERS
"""
import json
import sys

trace, layers = sys.argv[1], int(sys.argv[2])
events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]


def span(e):
    return e["ts"], e["ts"] + e["dur"]


def overlaps(a, b):
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


counts = {"forward": [0, 0], "backward": [0, 0]}
keys = {(e["pid"], e["args"]["step"]) for e in events}
for pid, step in keys:
    mine = [e for e in events if e["pid"] == pid and e["args"]["step"] == step]
    comp = {(e["name"], e["args"]["bucket"]): e for e in mine if e["name"].endswith(" unit")
            and e["cat"] == "compute"}
    gathers = {}
    for e in sorted((e for e in mine if e["name"] == "all_gather unit"), key=lambda e: e["ts"]):
        gathers.setdefault(e["args"]["bucket"], []).append(e)
    for k in range(1, layers + 1):
        g = gathers.get(k, [])
        if len(g) < 2:
            continue  # not a step with both passes
        fwd, bwd = comp.get(("forward unit", k - 1)), comp.get(("backward unit", k + 1))
        # The forward's gather of block k is its first; the backward's its last.
        if fwd and k >= 2:
            counts["forward"][1] += 1
            counts["forward"][0] += overlaps(g[0], fwd)
        if bwd and k + 1 <= layers:
            counts["backward"][1] += 1
            counts["backward"][0] += overlaps(g[-1], bwd)
print("forward %d/%d backward %d/%d" % (counts["forward"][0], counts["forward"][1],
                                         counts["backward"][0], counts["backward"][1]))
