"""The tutorial scripts of this folder (and the profiler's view of the
collectives, tutorial_profiler.py) one after another in one process
group: what each prints, in one launch instead of four (each launch costs
every rank a torch import).  argv[1]: the DDP tutorial's checkpoint
directory."""
import sys

import tutorial_ddp
import tutorial_gather
import tutorial_objects
import tutorial_p2p_collectives
import tutorial_profiler
from common import standalone


def run(ckpt_dir):
    tutorial_p2p_collectives.run()
    tutorial_gather.run()
    tutorial_objects.run()
    tutorial_ddp.run(ckpt_dir)
    tutorial_profiler.run()


if __name__ == "__main__":
    standalone(run, sys.argv[1])
