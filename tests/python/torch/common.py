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
    """One line, prefixed with the rank so sorted output is comparable.
    Under suite.py (TEST_LINES_DIR set) the line also goes to a file of its
    own rank: torchrun's --tee can splice two workers' lines together."""
    line = " ".join(["rank %d:" % dist.get_rank()] + [str(a) for a in args])
    print(line, flush=True)
    sys.stdout.flush()
    where = os.environ.get("TEST_LINES_DIR")
    if where:
        with open(os.path.join(where, "rank%d.txt" % dist.get_rank()), "a") as f:
            f.write(line + "\n")


def finish():
    """The script's last step: marks this rank as done (a file suite.py
    watches), then destroys the process group.  torch's destroy can hang at
    random on Gloo (pytorch#75097); the mark lets the runner tell that hang
    in a reference run from a script that never finished."""
    where = os.environ.get("TEST_LINES_DIR")
    if where:
        open(os.path.join(where, "rank%d.finished" % dist.get_rank()), "w").close()
    dist.destroy_process_group()


def standalone(run, *args):
    """A tutorial script's main: run(*args) in a process group of its own,
    then finish().  tutorials.py runs several scripts' run() in one."""
    dist.init_process_group(BACKEND)
    run(*args)
    finish()


class Net(torch.nn.Module):
    """The small MLP fsdp.py and zero_sharded.py train."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(20, 64)
        self.l2 = torch.nn.Linear(64, 64)
        self.l3 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))
