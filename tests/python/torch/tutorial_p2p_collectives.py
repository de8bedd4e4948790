"""The "Writing Distributed Applications with PyTorch" tutorial: blocking
and non-blocking point-to-point, then the six collectives, on 4
processes.  Unchanged but for the backend."""
import torch
import torch.distributed as dist

from common import out, standalone


def p2p_blocking(rank):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)
    out("blocking p2p: data", tensor[0].item())


def p2p_nonblocking(rank):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        req = dist.isend(tensor=tensor, dst=1)
    elif rank == 1:
        req = dist.irecv(tensor=tensor, src=0)
    if req is not None:
        req.wait()
    out("non-blocking p2p: data", tensor[0].item())


def all_reduce(rank):
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    out("all_reduce on group [0,1]: data", tensor[0].item())


def collectives(rank, size):
    t = torch.arange(4, dtype=torch.float32) + rank * 10
    dist.broadcast(t, src=2)
    out("broadcast", t.tolist())
    t = torch.arange(4, dtype=torch.float32) + rank
    dist.reduce(t, dst=3, op=dist.ReduceOp.SUM)
    out("reduce", t.tolist() if rank == 3 else "(not dst)")
    t = torch.tensor([rank + 1.0, 2.0 * rank])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out("all_reduce max", t.tolist())
    t = torch.tensor([rank + 1.0, 2.0])
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    out("all_reduce product", t.tolist())
    recv = torch.zeros(2)
    scatter_list = [torch.tensor([i * 1.0, i + 0.5]) for i in range(size)] if rank == 0 else None
    dist.scatter(recv, scatter_list=scatter_list, src=0)
    out("scatter", recv.tolist())
    gather_list = [torch.zeros(3) for _ in range(size)] if rank == 1 else None
    dist.gather(torch.full((3,), float(rank)), gather_list=gather_list, dst=1)
    out("gather", [g.tolist() for g in gather_list] if rank == 1 else "(not dst)")
    tl = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(tl, torch.tensor([rank, rank * rank]))
    out("all_gather", [x.tolist() for x in tl])
    dist.barrier()
    out("barrier passed")


def run():
    """The tutorial's steps, in a process group that exists already."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out("backend-independent world", size)
    p2p_blocking(rank)
    p2p_nonblocking(rank)
    all_reduce(rank)
    collectives(rank, size)


if __name__ == "__main__":
    standalone(run)
