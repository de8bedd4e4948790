"""Where torch 1.13's Gloo is wrong or crashes, chorus must give the right
answer or raise on every rank, within the timeout, killing nobody.

  noncontig   all_reduce of a non-contiguous view (Gloo reduces the wrong
              memory); broadcast into a transposed tensor
  gather      gather with a gather_list entry of the wrong size on dst
  allgather   all_gather where ranks pass tensors of different sizes

argv[1]: one case or several, comma-separated, in one process group (a
case that expects an error must come last: the error fails the group).
Run with TEST_BACKEND=chorus; prints "ok <case>" per case and exits 0 when
every rank saw what it should.
"""
import sys
import time

import torch
import torch.distributed as dist

from common import BACKEND, out

CASES = sys.argv[1].split(",")


def expect_error(fn, what):
    t0 = time.time()
    try:
        fn()
    except RuntimeError as e:
        dt = time.time() - t0
        if dt > 25:
            out("FAIL %s: error after %.1f s" % (what, dt))
            return False
        out("error as expected (%s, %.1f s): %s" % (what, dt, str(e).splitlines()[0][:160]))
        return True
    out("FAIL %s: no error" % what)
    return False


def run(case, rank, size):
    ok = True
    if case == "noncontig":
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
        view = base[:, ::2]                       # strided columns
        dist.all_reduce(view)
        want = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
        want[:, ::2] = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2] * sum(
            range(1, size + 1))
        ok &= torch.equal(base, want)
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * (rank + 1)  # transposed
        dist.broadcast(t, src=size - 1)
        ok &= torch.equal(t, torch.arange(6, dtype=torch.float32).reshape(2, 3).t() * size)
        b = torch.zeros(3, 4)[:, 1]               # a column: stride 4
        b.fill_(rank)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        ok &= torch.equal(b, torch.full((3,), float(size - 1)))
    elif case == "gather":
        gl = None
        if rank == 0:
            gl = [torch.zeros(4) for _ in range(size)]
            gl[1] = torch.zeros(5)                # wrong size on dst
        ok &= expect_error(lambda: dist.gather(torch.ones(4), gather_list=gl, dst=0),
                           "gather_list of mismatched sizes")
    elif case == "allgather":
        n = 4 + rank                              # globally different sizes
        tl = [torch.zeros(n) for _ in range(size)]
        ok &= expect_error(lambda: dist.all_gather(tl, torch.ones(n)),
                           "all_gather of different sizes")
    else:
        ok = False
    out(("ok " if ok else "FAIL ") + case)
    return ok


def main():
    dist.init_process_group(BACKEND)
    rank, size = dist.get_rank(), dist.get_world_size()
    ok = True
    for case in CASES:
        ok &= run(case, rank, size)
    try:
        dist.destroy_process_group()
    except RuntimeError:
        pass
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
