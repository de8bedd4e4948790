#!/usr/bin/python3
"""The PyTorch reference for chorus-train: the same GPT (pre-norm blocks,
causal multi-head attention, GELU-tanh MLP, tied output projection, byte
vocabulary), the same batch per rank, AdamW with the same hyper-parameters,
trained with DistributedDataParallel over Gloo on the same text.  Prints
tokens/s per step like chorus-train's summary, so bench/compare_train can
put the two side by side.

    /usr/bin/python3 bench/train_torch.py --ranks 2 --steps 30 [--threads 1]

Runs its own processes (torch.multiprocessing), one per rank, on 127.0.0.1.
Across hosts (bench/train_hosts): on every host

    train_torch.py --ranks P --world N --rank-offset K --addr HOST0 --port PORT ...

starts ranks K..K+P-1 of N, which meet at HOST0:PORT; host 0 (K = 0) prints.
Uses Debian's python3-torch; nothing is downloaded.
"""
import argparse
import math
import os
import socket
import statistics
import sys
import time


def _threads_arg(argv):
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return "1"


# torch.set_num_threads sizes PyTorch's own thread pool, not OpenBLAS's,
# which Debian's torch calls for its matrix products and which otherwise
# starts a thread per core: "1 thread" then used both cores (measured: 12.2k
# tokens/s instead of 8.9k).  OpenBLAS reads its count when it is loaded,
# so it is set here, before torch is imported; the workers inherit it.
os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = _threads_arg(sys.argv)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.ln1 = nn.LayerNorm(C)
        self.qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.ln2 = nn.LayerNorm(C)
        self.fc = nn.Linear(C, 4 * C)
        self.fcproj = nn.Linear(4 * C, C)
        self.NH = NH

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        hs = C // self.NH
        q = q.view(B, T, self.NH, hs).transpose(1, 2)
        k = k.view(B, T, self.NH, hs).transpose(1, 2)
        v = v.view(B, T, self.NH, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        x = x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, V, ctx, L, NH, C):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(ctx, C)
        self.blocks = nn.ModuleList([Block(C, NH) for _ in range(L)])
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()  # tied output projection
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def worker(local, a, port, out):
    rank = a.rank_offset + local
    os.environ["MASTER_ADDR"] = a.addr
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    torch.manual_seed(a.seed)
    model = GPT(256, a.ctx, a.layers, a.heads, a.channels)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.frombuffer(bytearray(open(a.data, "rb").read()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(a.seed + rank)
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, data.numel() - a.ctx - 1, (a.batch,), generator=g)
        x = torch.stack([data[s:s + a.ctx] for s in starts])
        y = torch.stack([data[s + 1:s + a.ctx + 1] for s in starts])
        loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        steady = times[3:] if len(times) > 4 else times
        tps = [a.world * a.batch * a.ctx / t for t in steady]
        nparams = sum(p.numel() for p in model.parameters())
        with open(out, "w") as f:
            f.write("%.1f %.1f %d %.4f\n" % (statistics.median(tps), statistics.mean(tps),
                                             nparams, loss.item()))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--port", type=int, default=0, help="MASTER_PORT (0: one free now)")
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    p.add_argument("--world", type=int, default=0, help="ranks in all (0: --ranks)")
    p.add_argument("--rank-offset", type=int, default=0, help="rank of this host's first process")
    p.add_argument("--addr", default="127.0.0.1", help="MASTER_ADDR (host 0)")
    a = p.parse_args()
    a.world = a.world or a.ranks
    out = "/tmp/train_torch.%d.out" % os.getpid()
    if not a.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    mp.spawn(worker, args=(a, a.port, out), nprocs=a.ranks, join=True)
    if a.rank_offset:
        return  # rank 0 (another host) reports
    med, mean, nparams, loss = open(out).read().split()
    os.unlink(out)
    print("torch %s DDP(gloo): %d rank(s), %d thread(s) each, %s parameters: %s tok/s median, "
          "%s mean, last loss %s" % (torch.__version__, a.world, a.threads, nparams, med, mean,
                                      loss))


if __name__ == "__main__":
    main()
