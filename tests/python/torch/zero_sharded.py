"""ZeRO-3 / FSDP's data flow by hand, in torch on CPU: every rank keeps a
1/N shard of the flat parameters; each step all-gathers them
(all_gather_into_tensor, torch 1.13's _all_gather_base), runs forward and
backward on its share of the batch, reduce-scatters the gradients with
ReduceOp.AVG (reduce_scatter_tensor, _reduce_scatter_base) and updates its
shard only.  Gloo on CPU has neither collective nor AVG, so there this
cannot run; torch 1.13's own FullyShardedDataParallel needs CUDA.  Rank 0
saves the final full parameters to OUT; with MODE=ddp the same model and
data train under DistributedDataParallel instead (the reference).

Usage: zero_sharded.py OUT
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import BACKEND, Net, finish, out

MODE = os.environ.get("MODE", "zero")


def gather_params(params, shard, size):
    """All-gathers the flat parameters (all_gather_into_tensor) into the
    model's parameters."""
    full = torch.empty(shard.numel() * size)
    dist.all_gather_into_tensor(full, shard)
    off = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[off:off + p.numel()].view_as(p))
            off += p.numel()


def main():
    dist.init_process_group(BACKEND)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = Net()
    params = list(model.parameters())
    per = 16 // size
    if MODE == "ddp":
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    else:
        numel = sum(p.numel() for p in params)
        shard_len = (numel + size - 1) // size
        flat = torch.zeros(shard_len * size)
        flat[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
        shard = flat[rank * shard_len:(rank + 1) * shard_len].clone()  # all this rank keeps
        del flat
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 20, generator=g), torch.randn(16, 3, generator=g)
        xb, yb = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if MODE == "ddp":
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(xb), yb)
            loss.backward()
            opt.step()
        else:
            gather_params(params, shard, size)
            for p in params:
                p.grad = None
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            grads = torch.zeros(shard_len * size)
            grads[:numel] = torch.cat([p.grad.reshape(-1) for p in params])
            gshard = torch.empty(shard_len)
            dist.reduce_scatter_tensor(gshard, grads, op=dist.ReduceOp.AVG)
            shard -= 0.05 * gshard
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        out("step %d loss %.5f" % (step, lt.item() / size))
    if MODE != "ddp":
        gather_params(params, shard, size)
    if rank == 0:
        torch.save({"train": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   sys.argv[1])
    finish()


if __name__ == "__main__":
    main()
