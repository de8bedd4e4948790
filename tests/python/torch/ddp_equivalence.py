"""torch DDP on CPU models, several configurations in one run; rank 0
saves every configuration's final weights to OUT (a torch.save'd dict).
compare.py then checks chorus's against Gloo's at the same world size.

  bn        Linear + BatchNorm1d (buffers broadcast every forward), SGD
  unused    a branch the forward skips, find_unused_parameters=True, Adam
  nosync    gradient accumulation: 2 micro-batches under no_sync, then 1
  bf16hook  the bf16 compression communication hook

Usage: ddp_equivalence.py OUT
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from common import BACKEND, finish, out

GLOBAL_BATCH = 8
STEPS = 12


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.l2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.unused = nn.Linear(32, 32)
        self.b = nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def batches(rank, size, step, micro=1):
    """This rank's share of the global batch of `step` (same data whatever
    the world size: the global batch is split in rank order)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH * micro, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH * micro, 4, generator=g)
    per = GLOBAL_BATCH // size
    xs, ys = [], []
    for m in range(micro):
        lo = m * GLOBAL_BATCH + rank * per
        xs.append(x[lo:lo + per])
        ys.append(y[lo:lo + per])
    return xs, ys


def run(config, rank, size):
    torch.manual_seed(1)
    model = {"bn": BNNet, "unused": Branchy}.get(config, MLP)()
    ddp = DDP(model, find_unused_parameters=(config == "unused"))
    if config == "bf16hook":
        # torch 1.13 refuses its own hook by name without CUDA and NCCL
        # (DistributedDataParallel._check_comm_hook); the same hook under
        # another name runs on CPU.  Gloo has no bfloat16 ("Invalid scalar
        # type"): its reference rounds to bfloat16 as the hook does, sums
        # in float32 and rounds the sum once -- what chorus computes.
        def bf16_compress(state, bucket):
            if BACKEND != "gloo":
                return default_hooks.bf16_compress_hook(state, bucket)
            t = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size()).float()
            fut = dist.all_reduce(t, async_op=True).get_future()

            def back(f):
                return bucket.buffer().copy_(f.value()[0].to(torch.bfloat16))
            return fut.then(back)
        ddp.register_comm_hook(None, bf16_compress)
    opt = (torch.optim.Adam if config == "unused" else torch.optim.SGD)(ddp.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    for step in range(STEPS):
        opt.zero_grad()
        if config == "nosync":
            xs, ys = batches(rank, size, step, micro=3)
            with ddp.no_sync():
                for x, y in zip(xs[:2], ys[:2]):
                    loss_fn(ddp(x), y).backward()
            loss_fn(ddp(xs[2]), ys[2]).backward()
        else:
            xs, ys = batches(rank, size, step)
            loss_fn(ddp(xs[0]), ys[0]).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out("%s done, checksum %.6f" % (config, sum(v.double().sum().item() for v in state.values())))
    return state


def main():
    dist.init_process_group(BACKEND)
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for config in ("bn", "unused", "nosync", "bf16hook"):
        results[config] = run(config, rank, size)
    if rank == 0:
        torch.save(results, sys.argv[1])
    finish()


if __name__ == "__main__":
    main()
