"""Per-call time of all_reduce from Python, measured like chorus-bench's
"median" column: every rank times each call; the per-call maximum over
ranks (the slowest rank decides) is taken with one all_reduce after the
timed loop; the median over calls is printed by rank 0.

    chorusrun --standalone -n 2 -- python3 allreduce.py --api chorus
    chorusrun --standalone -n 2 -- python3 allreduce.py --api torch-chorus
    chorusrun --standalone -n 2 -- python3 allreduce.py --api torch-gloo

--api chorus: chorus.all_reduce on a NumPy float32 array (the package);
torch-chorus / torch-gloo: torch.distributed.all_reduce on a float32
tensor, backend "chorus" (import chorus.torch) or "gloo".
Output (rank 0): "api=... ranks=N bytes=S median_us=M mean_us=A" per size.
"""
import argparse
import statistics
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("--api", default="chorus", choices=["chorus", "torch-chorus", "torch-gloo"])
ap.add_argument("--sizes", default="8,16M", help="bytes, comma separated (K, M suffixes)")
ap.add_argument("--iters", type=int, default=0, help="timed calls per size (0: by size)")
ap.add_argument("--warmup", type=int, default=20)
args = ap.parse_args()


def nbytes(s):
    mult = {"K": 1024, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


if args.api == "chorus":
    import chorus
    chorus.init_process_group()
    rank, size = chorus.get_rank(), chorus.get_world_size()

    def make(n):
        return np.ones(n, np.float32)

    def call(a):
        chorus.all_reduce(a)

    def max_over_ranks(t):
        chorus.all_reduce(t, op=chorus.ReduceOp.MAX)
        return t

    def finish():
        chorus.destroy_process_group()
else:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if args.api == "torch-chorus":
        import chorus.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.api.split("-")[1])
    rank, size = dist.get_rank(), dist.get_world_size()

    def make(n):
        return torch.ones(n, dtype=torch.float32)

    def call(a):
        dist.all_reduce(a)

    def max_over_ranks(t):
        tt = torch.from_numpy(t)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        return tt.numpy()

    def finish():
        dist.destroy_process_group()

for s in args.sizes.split(","):
    b = nbytes(s)
    a = make(max(1, b // 4))
    iters = args.iters or (2000 if b <= 65536 else 50)
    for _ in range(args.warmup):
        call(a)
    times = np.zeros(iters, np.float64)
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        call(a)
        times[i] = (clock() - t0) / 1000.0
    times = max_over_ranks(times)
    if rank == 0:
        print("api=%s ranks=%d bytes=%d median_us=%.2f mean_us=%.2f" % (
            args.api, size, b, statistics.median(times), float(np.mean(times))), flush=True)
finish()
