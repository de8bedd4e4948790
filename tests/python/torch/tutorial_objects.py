"""all_gather_object and broadcast_object_list, the documentation's
examples."""
import torch.distributed as dist

from common import out, standalone


def run():
    """The examples, in a process group that exists already."""
    rank, size = dist.get_rank(), dist.get_world_size()
    gather_objects = ["foo", 12, {1: 2}, (3, "x")]
    output = [None for _ in gather_objects][:size] + [None] * max(0, size - len(gather_objects))
    dist.all_gather_object(output, gather_objects[rank % len(gather_objects)])
    out("all_gather_object", output)
    if rank == 0:
        objects = ["foo", 12, {1: 2}]
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    out("broadcast_object_list", objects)
    gl = [None] * size if rank == 1 else None
    dist.gather_object({"rank": rank}, gl, dst=1)
    out("gather_object", gl if rank == 1 else "(not dst)")


if __name__ == "__main__":
    standalone(run)
