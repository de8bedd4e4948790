"""torch 1.13's FullyShardedDataParallel on CPU: trains a small model and
saves its full state (rank 0) to OUT.  With DDP=1 the same model and data
train under DistributedDataParallel instead, the reference FSDP must
match.  FSDP needs _allgather_base and _reduce_scatter_base, which Gloo on
CPU does not have: on Gloo it cannot run at all.

Usage: fsdp.py OUT   (TEST_BACKEND=chorus; MODE=ddp for the reference)
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from common import BACKEND, Net, finish, out

# Debian 12: torch 1.13's FSDP does not import on Python 3.11 without it
# (whatever the backend).
import chorus.torch  # noqa: E402
chorus.torch.fix_fsdp_import()
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

MODE = os.environ.get("MODE", "fsdp")


def main():
    dist.init_process_group(BACKEND)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    model = Net()
    if MODE == "ddp":
        wrapped = DDP(model)
    else:
        try:
            wrapped = FSDP(model, device_id=None)
        except AssertionError as e:  # "Torch not compiled with CUDA enabled"
            if torch.cuda.is_available():
                raise
            out("needs CUDA: torch %s's FSDP puts its compute on a CUDA device (%s)"
                % (torch.__version__, e))
            sys.exit(3)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    per = 16 // size
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 20, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(wrapped(x[rank * per:(rank + 1) * per]),
                                      y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        out("step %d loss %.6f" % (step, lt.item() / size))
    if MODE == "ddp":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, cfg):
            state = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    if rank == 0:
        # FSDP's full state names parameters as the unwrapped module does.
        torch.save({"train": {k.replace("_fsdp_wrapped_module.", "")
                              .replace("_fpw_module.", ""): v for k, v in state.items()}},
                   sys.argv[1])
    finish()


if __name__ == "__main__":
    main()
