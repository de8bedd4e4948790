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
