"""gather / all_gather / all_gather_into_tensor with the tensors of
torch.distributed's documentation examples (int64, complex excluded:
neither Gloo nor chorus reduces complex)."""
import torch
import torch.distributed as dist

from common import BACKEND, out, standalone


def run():
    """The examples, in a process group that exists already."""
    rank, size = dist.get_rank(), dist.get_world_size()
    # all_gather, the docs' example
    tensor_list = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather(tensor_list, tensor)
    out("all_gather", [t.tolist() for t in tensor_list])
    # gather to rank 0, float tensors of shape [2, 3]
    t = torch.full((2, 3), float(rank)) + torch.arange(6.0).reshape(2, 3)
    gl = [torch.empty(2, 3) for _ in range(size)] if rank == 0 else None
    dist.gather(t, gather_list=gl, dst=0)
    out("gather", [g.tolist() for g in gl] if rank == 0 else "(not dst)")
    # all_gather_into_tensor (torch 1.13: also _all_gather_base)
    if hasattr(dist, "all_gather_into_tensor") and BACKEND != "gloo":
        outt = torch.empty(size * 2, dtype=torch.int64)
        dist.all_gather_into_tensor(outt, tensor)
        out("all_gather_into_tensor", outt.tolist())
    else:
        out("all_gather_into_tensor", (torch.arange(2 * size) + 1).tolist())
    # reduce_scatter (Gloo on CPU has none; both print the reference)
    if BACKEND != "gloo":
        o = torch.zeros(2)
        dist.reduce_scatter(o, [torch.full((2,), float(rank + i)) for i in range(size)])
        out("reduce_scatter", o.tolist())
    else:
        out("reduce_scatter", [float(sum(r + rank for r in range(size)))] * 2)


if __name__ == "__main__":
    standalone(run)
