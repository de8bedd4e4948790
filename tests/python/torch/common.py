"""What every script here shares: the backend switch users make (the only
line that differs from their Gloo script), and printing per rank in a form
the runner can compare across backends and launchers."""
import os
import sys

import torch
import torch.distributed as dist

BACKEND = os.environ.get("TEST_BACKEND", "gloo")
if BACKEND == "chorus":
    import chorus.torch  # noqa: F401  -- registers backend "chorus"

torch.set_num_threads(1)


def out(*args):
    """One line, prefixed with the rank so sorted output is comparable."""
    print("rank %d:" % dist.get_rank(), *args, flush=True)
    sys.stdout.flush()


class Net(torch.nn.Module):
    """The small MLP fsdp.py and zero_sharded.py train."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(20, 64)
        self.l2 = torch.nn.Linear(64, 64)
        self.l3 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
