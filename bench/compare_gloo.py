#!/usr/bin/python3
"""compare_gloo.py - Gloo (torch.distributed, CPU) benchmark for bench/compare.

Same method as chorus-bench's "median" column and bench/compare_mpi.c: for
each size a barrier, W untimed calls, N timed calls each timed alone with
time.perf_counter() (CLOCK_MONOTONIC); per-call times combined with a MAX
over ranks (an all_reduce of a float64 tensor); the median is printed.
Sizes follow nccl-tests' convention (S = the largest buffer of the call).

usage: compare_gloo.py NRANKS PORT COLL:SIZE:WARMUP:ITERS [...]
       compare_gloo.py --local P --rank-offset K --world-size W PORT SPEC...
The first form starts NRANKS processes on this host (store on 127.0.0.1).
The second starts P processes, ranks K..K+P-1 of a world of W, that meet
the others at MASTER_ADDR:PORT (MASTER_ADDR from the environment, 127.0.0.1
when unset); bench/compare_hosts runs it once per host, with
GLOO_SOCKET_IFNAME naming the interface Gloo must use.
output (rank 0): "RESULT <coll> <n> <size> <median_us> <cpu_s_per_gb>" (the
CPU time of the timed calls, every thread of the process, per GB of the
size and rank), or
"UNSUPPORTED <coll> <n> <size> <reason>" when Gloo lacks the collective.

Gloo's all_reduce and broadcast are in place (torch has no out-of-place
form); all_gather uses all_gather_into_tensor when the backend has it,
else the list form; reduce_scatter uses reduce_scatter_tensor; all_to_all
uses all_to_all_single.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_one(rank, n, coll, size, warm, iters):
    total = size // 4
    per = total // n
    f = torch.float32
    if coll == "all_reduce":
        buf = torch.ones(total, dtype=f)
        call = lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        real = total * 4
    elif coll == "broadcast":
        buf = torch.ones(total, dtype=f)
        call = lambda: dist.broadcast(buf, src=0)
        real = total * 4
    elif coll == "all_gather":
        inp = torch.ones(per, dtype=f)
        out = torch.empty(per * n, dtype=f)
        outs = list(out.chunk(n)) if per else [torch.empty(0) for _ in range(n)]
        def call():
            try:
                dist.all_gather_into_tensor(out, inp)
            except (RuntimeError, AttributeError, NotImplementedError):
                dist.all_gather(outs, inp)
        real = per * n * 4
    elif coll == "reduce_scatter":
        inp = torch.ones(per * n, dtype=f)
        out = torch.empty(per, dtype=f)
        call = lambda: dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        real = per * n * 4
    elif coll == "all_to_all":
        inp = torch.ones(per * n, dtype=f)
        out = torch.empty(per * n, dtype=f)
        call = lambda: dist.all_to_all_single(out, inp)
        real = per * n * 4
    else:
        raise SystemExit("unknown collective " + coll)
    # probe once: Gloo may not implement the collective
    err = None
    try:
        call()
    except Exception as e:  # noqa: BLE001 - report any backend refusal
        err = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
    flag = torch.tensor([1.0 if err else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        if rank == 0:
            print("UNSUPPORTED %s %d %d %s" % (coll, n, real, (err or "another rank failed").replace(" ", "_")), flush=True)
        return
    dist.barrier()
    for _ in range(warm):
        call()
    times = []
    cpu = 0.0
    for _ in range(iters):
        c0, t0 = time.process_time(), time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
        cpu += time.process_time() - c0
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(c, op=dist.ReduceOp.SUM)
    if rank == 0:
        gb = iters * real / 1e9 * n
        print("RESULT %s %d %d %.3f %.4f" % (coll, n, real, statistics.median(t.tolist()),
                                             c.item() / gb if gb else 0.0), flush=True)


def worker(local, n, port, specs, addr="127.0.0.1", offset=0):
    rank = offset + local
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for coll, size, warm, iters in specs:
        run_one(rank, n, coll, size, warm, iters)
    dist.barrier()
    dist.destroy_process_group()


def main():
    args = sys.argv[1:]
    addr, offset = "127.0.0.1", 0
    if args and args[0] == "--local":
        # one host's share of a world that spans hosts
        if len(args) < 7 or args[2] != "--rank-offset" or args[4] != "--world-size":
            raise SystemExit("usage: compare_gloo.py --local P --rank-offset K --world-size W PORT SPEC...")
        nproc, offset, n = int(args[1]), int(args[3]), int(args[5])
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        args = args[6:]
    else:
        n = nproc = int(args[0])
        args = args[1:]
    port = int(args[0])
    specs = []
    for a in args[1:]:
        coll, size, warm, iters = a.split(":")
        specs.append((coll, int(size), int(warm), int(iters)))
    mp.spawn(worker, args=(n, port, specs, addr, offset), nprocs=nproc, join=True)


if __name__ == "__main__":
    main()
