"""The DDP tutorial's training loop: a toy model wrapped in
DistributedDataParallel, a DistributedSampler over a fixed dataset,
set_epoch, a checkpoint saved by rank 0 and loaded by every rank after a
barrier (map_location), then training on from it.  Prints the loss per
epoch (averaged over ranks) and a checksum of the final weights."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import BACKEND, out, standalone


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def run(ckpt_dir):
    """The training loop, in a process group that exists already; the
    checkpoint goes to ckpt_dir."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 10), torch.randn(64, 5))
    model = ToyModel()
    ddp = DDP(model)
    loss_fn = nn.MSELoss()
    opt = optim.SGD(ddp.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    path = os.path.join(ckpt_dir, "ddp_tutorial_%s_%s.pt" % (BACKEND, os.environ.get(
        "MASTER_PORT", "x")))
    for epoch in range(4):
        sampler.set_epoch(epoch)
        total = torch.zeros(1)
        for x, y in loader:
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()
        dist.all_reduce(total)
        out("epoch %d loss %.4f" % (epoch, total.item() / dist.get_world_size()))
        if epoch == 1:
            if rank == 0:
                torch.save(ddp.state_dict(), path)
            dist.barrier()
            ddp.load_state_dict(torch.load(path, map_location={"cuda:0": "cpu"}))
            dist.barrier()
            if rank == 0:
                os.remove(path)
    s = sum(p.double().sum().item() for p in model.parameters())
    out("weights checksum %.4f" % s)


if __name__ == "__main__":
    standalone(run, sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir())
