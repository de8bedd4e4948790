#!/usr/bin/python3
"""bench/scale_torch.py - world formation of P ranks against PyTorch's TCPStore, the same
steps chorus-scale (bench/scale.c) plays against chorus's store, side by side:

  connect   each rank's own TCPStore client;
  world id  rank 0 sets it, the others get it;
  join      the rank's record set, itself counted in (add);
  formed    the last rank sets the count, the others get it;
  dial      the records of k peers read (ring neighbours, then 2, 4, 8... away).

Each step runs for all of a thread's ranks before the next, PROCS processes of THREADS
threads (TCPStore releases the GIL while it waits).  Every client leaves from 127.0.0.1
(TCPStore cannot choose its source address; it has no per-address limit either).  One
line per P: medians of the seconds to a formed world and to the last record.

    /usr/bin/python3 bench/scale_torch.py [-p PROCS] [-t THREADS] [-k PEERS] [-r REPEATS]
                                          [--timeout S] P [P ...]
"""
import argparse, multiprocessing as mp, os, resource, socket, statistics, sys, threading, time
from datetime import timedelta

STEPS = ('connect', 'world id', 'join', 'formed', 'dial')


def free_port():
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def store_main(port, ready, stop):
    import torch.distributed as dist
    raise_nofile()
    store = dist.TCPStore('127.0.0.1', port, None, True, timedelta(seconds=600), False)
    ready.set()
    stop.wait()
    del store


def peer_of(r, i, size):
    if i == 0:
        return (r + 1) % size
    if i == 1:
        return (r + size - 1) % size
    return (r + (1 << (i - 1))) % size


def block(first, count, size, port, k, timeout, ends, errs, slot):
    import torch.distributed as dist
    ranks = range(first, first + count)
    stores, tickets = {}, {}
    try:
        for s, name in enumerate(STEPS):
            if name == 'connect':
                for r in ranks:
                    stores[r] = dist.TCPStore('127.0.0.1', port, None, False,
                                              timedelta(seconds=timeout), False)
            elif name == 'world id':
                for r in ranks:
                    if r == 0:
                        stores[r].set('scale/world_id', '5ca1e5ca1e5ca1e5')
                    else:
                        stores[r].get('scale/world_id')
            elif name == 'join':
                for r in ranks:
                    stores[r].set(f'scale/addr/{r}', f'127.0.0.1 {20000 + r % 40000}|-|id host-{r // 64}')
                    tickets[r] = stores[r].add('scale/joined', 1)
            elif name == 'formed':
                for r in sorted(ranks, key=lambda r: tickets[r] != size):
                    if tickets[r] == size:
                        stores[r].set('scale/joined/all', str(size))
                    else:
                        stores[r].get('scale/joined/all')
            else:
                for r in ranks:
                    for i in range(min(k, size - 1)):
                        stores[r].get(f'scale/addr/{peer_of(r, i, size)}')
            ends[slot * len(STEPS) + s] = time.monotonic()
    except Exception as e:  # a store error ends this block: reported, never silent
        errs.append(f'rank block {first}+{count}, step {name}: {e}')


def client_main(first, count, size, port, threads, k, timeout, go, out):
    import torch.distributed  # noqa: F401 (imported before the clock starts)
    raise_nofile()
    nt = min(threads, count)
    ends, errs, ths = [0.0] * (nt * len(STEPS)), [], []
    for t in range(nt):
        a = first + count * t // nt
        b = first + count * (t + 1) // nt
        ths.append(threading.Thread(target=block, args=(a, b - a, size, port, k, timeout, ends, errs, t)))
    go.wait()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    out.put(([max(ends[t * len(STEPS) + s] for t in range(nt)) for s in range(len(STEPS))], errs))
    out.close()
    out.join_thread()  # the queue's thread sends it: before _exit
    os._exit(0)


def start_store(ctx):
    """A TCPStore server in its own process: (process, port, stop event), or None.  A port
    found free may be taken again before the store binds it: another port then."""
    for _ in range(5):
        port = free_port()
        ready, stop = ctx.Event(), ctx.Event()
        store = ctx.Process(target=store_main, args=(port, ready, stop))
        store.start()
        if ready.wait(30):
            return store, port, stop
        store.kill()
        store.join()
    return None


def run_once(size, a):
    ctx = mp.get_context('fork')
    go = ctx.Event()
    started = start_store(ctx)
    if not started:
        return None, 'the TCPStore did not start'
    store, port, stop = started
    out = ctx.Queue()
    procs = min(a.procs, size)
    cl = []
    for p in range(procs):
        first, last = size * p // procs, size * (p + 1) // procs
        cl.append(ctx.Process(target=client_main,
                              args=(first, last - first, size, port, a.threads, a.peers, a.timeout, go, out)))
        cl[-1].start()
    time.sleep(0.5)
    t0 = time.monotonic()
    go.set()
    ends, errs = [0.0] * len(STEPS), []
    for _ in cl:
        try:
            e, er = out.get(timeout=a.timeout + 30)
        except Exception:
            errs.append('a client process did not report')
            break
        ends = [max(x, y) for x, y in zip(ends, e)]
        errs += er
    for c in cl:
        c.join(5)
        if c.is_alive():
            c.kill()
    stop.set()
    store.join(10)
    if store.is_alive():
        store.kill()
    if errs:
        return None, errs[0]
    return [e - t0 for e in ends], None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('-p', '--procs', type=int, default=4)
    ap.add_argument('-t', '--threads', type=int, default=8)
    ap.add_argument('-k', '--peers', type=int, default=2)
    ap.add_argument('-r', '--repeats', type=int, default=3)
    ap.add_argument('--timeout', type=float, default=120)
    ap.add_argument('ranks', type=int, nargs='+')
    a = ap.parse_args()
    # torch stays out of this process: its children are forked from it.
    import subprocess
    ver = subprocess.run([sys.executable, '-c', 'import torch; print(torch.__version__)'],
                         capture_output=True, text=True).stdout.strip()
    print(f'# bench/scale_torch.py (torch {ver} TCPStore) -p {a.procs} -t {a.threads} '
          f'-k {a.peers}: medians of {a.repeats}')
    print(f'| P | formed (s) | +{a.peers} records (s) | failed runs |\n|---|---|---|---|')
    for size in a.ranks:
        formed, dial, failed = [], [], 0
        for r in range(a.repeats):
            steps, err = run_once(size, a)
            if err:
                failed += 1
                print(f'  P={size} run {r + 1}: {err}', file=sys.stderr)
                continue
            formed.append(steps[3])
            dial.append(steps[4])
            print(f'  P={size} run {r + 1}: ' + ' '.join(f'{n} {t:.3f}' for n, t in zip(STEPS, steps)),
                  file=sys.stderr)
        if formed:
            print(f'| {size} | {statistics.median(formed):.3f} | {statistics.median(dial):.3f} | {failed} |')
        else:
            print(f'| {size} | failed | | {failed} |')
        sys.stdout.flush()


if __name__ == '__main__':
    main()
