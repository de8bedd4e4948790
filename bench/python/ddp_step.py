"""torch DDP step time on a communication-heavy CPU model: a wide MLP
(default 4 layers of 1536: 9.4 M parameters, 38 MB of gradients per step)
on a small batch, so the all_reduce of the gradients dominates.

    chorusrun --standalone -n 2 -- python3 ddp_step.py --backend chorus
    (torchrun works the same; --backend gloo for the reference)

Rank 0 prints "backend=... ranks=N step_ms_median=M step_ms_mean=A params=P".
The step: forward, backward (DDP's bucketed all_reduce overlapping it),
optimizer step; timed after warm-up, each step ended by a barrier-free
wall-clock read on every rank, the slowest rank's time taken per step.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="chorus")
ap.add_argument("--width", type=int, default=1536)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--warmup", type=int, default=5)
ap.add_argument("--no-comm", action="store_true",
                help="a DDP comm hook that sends nothing: the step's floor on these ranks")
args = ap.parse_args()

torch.set_num_threads(1)
if args.backend == "chorus":
    import chorus.torch  # noqa: F401
dist.init_process_group(args.backend)
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
layers = []
for _ in range(args.layers):
    layers += [nn.Linear(args.width, args.width), nn.ReLU()]
model = nn.Sequential(*layers)
ddp = DDP(model)
if args.no_comm:
    def no_comm(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    ddp.register_comm_hook(None, no_comm)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
x = torch.randn(args.batch, args.width)
times = []
for step in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    opt.zero_grad()
    ddp(x).square().mean().backward()
    opt.step()
    if step >= args.warmup:
        times.append((time.perf_counter() - t0) * 1000)
t = torch.tensor(times, dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
if rank == 0:
    print("backend=%s%s ranks=%d step_ms_median=%.2f step_ms_mean=%.2f params=%d" % (
        args.backend, "-nocomm" if args.no_comm else "", size, statistics.median(t.tolist()), t.mean().item(),
        sum(p.numel() for p in model.parameters())), flush=True)
dist.destroy_process_group()
