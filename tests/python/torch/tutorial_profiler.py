"""What torch's profiler shows for each collective: one event per call,
named "<backend>:<op>" as Gloo names it (the coalesced forms under the
plain name), so a profile of a chorus job reads like one of a Gloo job.
Prints the names with the backend replaced by "<backend>"."""
import torch
import torch.distributed as dist

from common import out, standalone


def run():
    """The calls, profiled, in a process group that exists already."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    with torch.autograd.profiler.profile() as prof:
        dist.all_reduce(t)
        dist.all_reduce_coalesced([torch.ones(2), torch.ones(3)])
        dist.broadcast(t, src=0)
        dist.reduce(t, dst=0)
        dist.all_gather([torch.empty(4) for _ in range(size)], t)
        dist.all_gather_coalesced([[torch.empty(2)] for _ in range(size)], [torch.ones(2)])
        dist.all_to_all_single(torch.empty(size * 2), torch.ones(size * 2))
        dist.all_to_all_single(torch.empty(size * 2), torch.ones(size * 2),
                               [2] * size, [2] * size)
        dist.barrier()
    prefix = dist.get_backend() + ":"
    names = [e.name.replace(prefix, "<backend>:", 1) for e in prof.function_events
             if e.name.startswith(prefix)]
    out("profiled", rank, names)


if __name__ == "__main__":
    standalone(run)
