#!/usr/bin/python3
"""Writes the index lists of torch.utils.data.DistributedSampler for the
cases below, one case per line:

    n world rank seed epoch shuffle drop_last : i0 i1 i2 ...

Run with Debian's /usr/bin/python3 and python3-torch; the output is
committed as sampler_fixtures.txt so the C test runs without torch."""
import sys

import torch
from torch.utils.data import DistributedSampler


class Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


CASES = []
for n in (1, 7, 10, 64):
    for world in (1, 2, 3, 4, 8):
        if n < world:
            continue
        for seed in (0, 1337):
            for epoch in (0, 1, 5):
                for shuffle in (1, 0):
                    for drop_last in (0, 1):
                        if not shuffle and (seed or epoch):
                            continue  # the order does not depend on them
                        for rank in range(world):
                            CASES.append((n, world, rank, seed, epoch, shuffle, drop_last))
# Larger datasets: a few cases each (the main job's 7842 samples among them).
for n, world, rank, seed, epoch, drop_last in ((1000, 3, 2, 7, 4, 1), (1000, 8, 5, 0, 0, 0),
                                               (7842, 2, 0, 1337, 0, 0), (7842, 2, 1, 1337, 1, 0),
                                               (7842, 4, 3, 1337, 2, 1)):
    CASES.append((n, world, rank, seed, epoch, 1, drop_last))

out = sys.stdout
out.write("# torch %s DistributedSampler index lists (tests/train/gen_sampler_fixtures.py)\n"
          % torch.__version__)
for n, world, rank, seed, epoch, shuffle, drop_last in CASES:
    s = DistributedSampler(Sized(n), num_replicas=world, rank=rank, shuffle=bool(shuffle),
                           seed=seed, drop_last=bool(drop_last))
    s.set_epoch(epoch)
    idx = list(iter(s))
    out.write("%d %d %d %d %d %d %d : %s\n" % (n, world, rank, seed, epoch, shuffle, drop_last,
                                                " ".join(map(str, idx))))
