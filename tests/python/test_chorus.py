"""The Python package (`import chorus`) on N ranks, under chorusrun.

    chorusrun --standalone -n 3 -- python3 test_chorus.py [mode]

mode "all" (default): every collective x dtype x op against NumPy's own
result, lists, async handles, subgroups and split, point-to-point, object
collectives (and that pickles from the wire are refused), the store, the
GIL released while blocked, argument errors, a mismatch raised on every
rank, and the object codec against mutated bytes.  "dead": the last rank
exits mid-run and the others must get an exception, quickly.  "timeout":
rank 0 is late and the others must get chorus.TimeoutError.  "refuse":
rank 0's gather_list is wrong; it raises ValueError, the others a
MismatchError at once.
Exit status 0 when every check passed; failures are printed with the rank.
"""

import os
import random
import sys
import threading
import time

import numpy as np

import chorus
from chorus import ReduceOp, _objects

MODE = sys.argv[1] if len(sys.argv) > 1 else "all"
failures = 0


def fail(msg):
    global failures
    failures += 1
    print("rank %s: FAIL %s" % (os.environ.get("RANK"), msg), flush=True)


def check(cond, msg):
    if not cond:
        fail(msg)


def expect(exc, fn, what):
    try:
        fn()
    except exc as e:
        return e
    except Exception as e:  # noqa: BLE001
        fail("%s: raised %s (%s), wanted %s" % (what, type(e).__name__, e, exc.__name__))
        return None
    fail("%s: no exception, wanted %s" % (what, exc.__name__))
    return None


# ------------------------------------------------------------------ dtypes

def bf16_bits(x):
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def bf16_float(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


NUMPY = {"int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int64": np.int64,
         "float16": np.float16, "float32": np.float32, "float64": np.float64}
DTYPES = list(NUMPY) + ["bfloat16"]
INT = {"int8", "uint8", "int32", "int64"}


def values(dtype, rank, n, op, salt=0):
    """Rank `rank`'s input: small values whose reductions are exact in every
    dtype (sums stay below 2^7 for int8, products below 2^7)."""
    rng = np.random.default_rng(1000 * salt + rank)
    if op == ReduceOp.PRODUCT:
        v = rng.integers(1, 3, n)
    elif op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        v = rng.integers(0, 100, n)
    else:
        v = rng.integers(0, 9, n)
        if dtype not in ("uint8",) and op in (ReduceOp.MIN, ReduceOp.MAX):
            v = v - 4
    if dtype == "bfloat16":
        return bf16_bits(v.astype(np.float32))
    return v.astype(NUMPY[dtype])


def as_float(a, dtype):
    return bf16_float(a) if dtype == "bfloat16" else a


def reference(inputs, op, dtype, size):
    stack = np.stack([as_float(x, dtype).astype(np.float64) if dtype not in INT
                      else x.astype(np.int64) for x in inputs])
    if op == ReduceOp.SUM:
        r = stack.sum(0)
    elif op == ReduceOp.PRODUCT:
        r = stack.prod(0)
    elif op == ReduceOp.MIN:
        r = stack.min(0)
    elif op == ReduceOp.MAX:
        r = stack.max(0)
    elif op == ReduceOp.AVG:
        s = stack.sum(0)
        r = (np.sign(s) * (np.abs(s) // size)) if dtype in INT else s / size
    elif op == ReduceOp.BAND:
        r = np.bitwise_and.reduce(stack.astype(np.int64), 0)
    elif op == ReduceOp.BOR:
        r = np.bitwise_or.reduce(stack.astype(np.int64), 0)
    else:
        r = np.bitwise_xor.reduce(stack.astype(np.int64), 0)
    return r


def same(got, want, dtype):
    g = as_float(got, dtype).astype(np.float64)
    tol = {"float16": 1e-2, "bfloat16": 2e-2}.get(dtype, 1e-6)
    return np.allclose(g, want, rtol=tol, atol=tol)


def ops_for(dtype):
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
    if dtype in INT:
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops


def dt_arg(dtype):
    return "bfloat16" if dtype == "bfloat16" else None


def test_reductions(rank, size):
    n = 37
    for dtype in DTYPES:
        for op in ops_for(dtype):
            inputs = [values(dtype, r, n, op) for r in range(size)]
            want = reference(inputs, op, dtype, size)
            a = inputs[rank].copy()
            chorus.all_reduce(a, op=op, dtype=dt_arg(dtype))
            check(same(a, want, dtype), "all_reduce %s op %d: %s != %s" % (dtype, op, a[:5],
                                                                          want[:5]))
            b = inputs[rank].copy()
            chorus.reduce(b, dst=size - 1, op=op, dtype=dt_arg(dtype))
            if rank == size - 1:
                check(same(b, want, dtype), "reduce %s op %d" % (dtype, op))
            # reduce_scatter: blocks of 5 per rank
            blocks = [values(dtype, r, 5 * size, op, salt=1) for r in range(size)]
            want_rs = reference(blocks, op, dtype, size)[5 * rank:5 * rank + 5]
            out = np.zeros(5, dtype=blocks[0].dtype)
            chorus.reduce_scatter_tensor(out, blocks[rank], op=op, dtype=dt_arg(dtype))
            check(same(out, want_rs, dtype), "reduce_scatter_tensor %s op %d" % (dtype, op))
            out2 = np.zeros(5, dtype=blocks[0].dtype)
            chorus.reduce_scatter(out2, [blocks[rank][5 * i:5 * i + 5] for i in range(size)],
                                  op=op, dtype=dt_arg(dtype))
            check(same(out2, want_rs, dtype), "reduce_scatter (list) %s op %d" % (dtype, op))


def test_movement(rank, size):
    for dtype in DTYPES:
        npdt = np.uint16 if dtype == "bfloat16" else NUMPY[dtype]
        d = dt_arg(dtype)
        mine = (np.arange(6) + 10 * rank).astype(npdt)
        allin = [(np.arange(6) + 10 * r).astype(npdt) for r in range(size)]
        # broadcast from every root
        for root in range(size):
            b = mine.copy()
            chorus.broadcast(b, src=root, dtype=d)
            check(np.array_equal(b, allin[root]), "broadcast %s root %d" % (dtype, root))
        # all_gather into a list and into one array
        lst = [np.zeros(6, npdt) for _ in range(size)]
        chorus.all_gather(lst, mine, dtype=d)
        check(all(np.array_equal(lst[r], allin[r]) for r in range(size)), "all_gather " + dtype)
        flat = np.zeros(6 * size, npdt)
        chorus.all_gather_into_tensor(flat, mine, dtype=d)
        check(np.array_equal(flat, np.concatenate(allin)), "all_gather_into_tensor " + dtype)
        # gather / scatter with every root
        for root in range(size):
            gl = [np.zeros(6, npdt) for _ in range(size)] if rank == root else None
            chorus.gather(mine, gl, dst=root, dtype=d)
            if rank == root:
                check(all(np.array_equal(gl[r], allin[r]) for r in range(size)),
                      "gather %s root %d" % (dtype, root))
            out = np.zeros(6, npdt)
            sl = [(np.arange(6) + 10 * r + root).astype(npdt) for r in range(size)]
            chorus.scatter(out, sl if rank == root else None, src=root, dtype=d)
            check(np.array_equal(out, sl[rank]), "scatter %s root %d" % (dtype, root))
        # all_to_all: equal, list, uneven single
        src = np.array([10 * rank + j for j in range(size)], npdt)
        dst = np.zeros(size, npdt)
        chorus.all_to_all_single(dst, src, dtype=d)
        check(np.array_equal(dst, np.array([10 * j + rank for j in range(size)], npdt)),
              "all_to_all_single " + dtype)
        ins = [np.full(r + 1, rank, npdt) for r in range(size)]   # to r: r+1 items
        outs = [np.zeros(rank + 1, npdt) for _ in range(size)]    # from each: rank+1 items
        chorus.all_to_all(outs, ins, dtype=d)
        check(all(np.array_equal(outs[j], np.full(rank + 1, j, npdt)) for j in range(size)),
              "all_to_all (uneven lists) " + dtype)
        rows_in = np.repeat(np.arange(size, dtype=npdt), 2).reshape(-1, 2) * 0 + rank
        insplit = [1] * size
        outsplit = [1] * size
        rows_out = np.zeros((size, 2), npdt)
        chorus.all_to_all_single(rows_out, rows_in, outsplit, insplit, dtype=d)
        check(np.array_equal(rows_out[:, 0], np.arange(size, dtype=npdt)),
              "all_to_all_single (splits) " + dtype)


def test_p2p_async(rank, size):
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    out = np.full(8, rank, np.int32)
    got = np.zeros(8, np.int32)
    if size > 1:
        rw = chorus.irecv(got, src=prv, tag=7)
        sw = chorus.isend(out, dst=nxt, tag=7)
        check(rw.wait() and sw.wait(), "isend/irecv wait")
        check(np.all(got == prv), "ring irecv got %s" % got[:3])
        got[:] = 0
        ops = [chorus.P2POp(chorus.irecv, got, prv, tag=3), chorus.P2POp(chorus.isend, out, nxt,
                                                                           tag=3)]
        for w in chorus.batch_isend_irecv(ops):
            w.wait()
        check(np.all(got == prv), "batch_isend_irecv")
        if rank % 2 == 0:
            if rank + 1 < size:
                chorus.send(out, dst=rank + 1)
        elif True:
            check(chorus.recv(got, src=rank - 1) == rank - 1, "recv returns src")
    # From any source: rank 0 takes one message from every other rank, in
    # whatever order they come; recv returns the sender, irecv's Work names it.
    if size > 1:
        if rank == 0:
            senders = []
            for i in range(size - 1):
                got[:] = -1
                if i % 2 == 0:
                    src = chorus.recv(got, tag=11)
                else:
                    w = chorus.irecv(got, tag=11)
                    w.wait()
                    src = w.source_rank()
                check(np.all(got == src), "recv from any source: %s from %d" % (got[:2], src))
                senders.append(src)
            check(sorted(senders) == list(range(1, size)), "senders %s" % senders)
        else:
            chorus.send(np.full(8, rank, np.int32), dst=0, tag=11)
    else:
        expect(chorus.InvalidArgumentError, lambda: chorus.recv(got), "recv from any source alone")
    # async collectives: many in flight, waited in reverse order
    arrs = [np.full(1000, rank + i, np.float64) for i in range(6)]
    works = [chorus.all_reduce(a, async_op=True) for a in arrs]
    for w in reversed(works):
        check(w.wait() is True, "async wait")
        check(w.is_completed() and w.is_success() and w.exception() is None, "async status")
    for i, a in enumerate(arrs):
        check(np.all(a == sum(r + i for r in range(size))), "async all_reduce %d" % i)
    gl = [np.zeros(3, np.int64) for _ in range(size)] if rank == 0 else None
    w = chorus.gather(np.full(3, rank, np.int64), gl, dst=0, async_op=True)
    w.wait()
    if rank == 0:
        check([int(g[0]) for g in gl] == list(range(size)), "async gather into a list")
    w = chorus.barrier(async_op=True)
    t0 = time.time()
    while not w.is_completed():
        if time.time() - t0 > 30:
            fail("async barrier never completed")
            break
        time.sleep(0.001)


def test_groups(rank, size):
    evens = list(range(0, size, 2))
    g = chorus.new_group(evens)
    if rank in evens:
        check(chorus.get_rank(g) == evens.index(rank), "group rank")
        check(chorus.get_world_size(g) == len(evens), "group size")
        a = np.array([rank], np.int64)
        chorus.all_reduce(a, group=g)
        check(int(a[0]) == sum(evens), "all_reduce on new_group")
        b = np.array([rank], np.int64)
        chorus.broadcast(b, src=evens[-1], group=g)  # src is a global rank
        check(int(b[0]) == evens[-1], "broadcast src is global")
        check(chorus.get_global_rank(g, 0) == 0 and chorus.get_process_group_ranks(g) == evens,
              "global rank translation")
        expect(ValueError, lambda: chorus.broadcast(b, src=size + 5, group=g), "src not in group")
    else:
        check(g is chorus.GroupMember.NON_GROUP_MEMBER, "non-member sentinel")
        check(chorus.get_rank(g) == -1, "non-member rank -1")
    sub = chorus.split(rank % 2, key=-rank)   # odd/even, in reverse order
    members = sorted([r for r in range(size) if r % 2 == rank % 2], reverse=True)
    check(sub.ranks == members, "split members %s != %s" % (sub.ranks, members))
    c = np.array([1.0], np.float32)
    chorus.all_reduce(c, group=sub)
    check(c[0] == len(members), "all_reduce on split")
    chorus.destroy_process_group(sub)
    if rank in evens:
        chorus.destroy_process_group(g)


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/chorus-pickle-ran-%s" % os.environ.get("CHORUS_JOB_ID"),))


def test_objects(rank, size):
    obj = {"rank": rank, "name": "r%d" % rank, "vals": [1.5, None, True, 2 ** 70 + rank],
           "arr": np.arange(rank + 2, dtype=np.float32), "t": (b"x" * rank, {1, 2}),
           "scalar": np.int64(rank)}
    lst = [None] * size
    chorus.all_gather_object(lst, obj)
    for r in range(size):
        o = lst[r]
        check(o["rank"] == r and o["name"] == "r%d" % r and o["vals"][3] == 2 ** 70 + r and
              np.array_equal(o["arr"], np.arange(r + 2, dtype=np.float32)) and
              o["t"] == (b"x" * r, {1, 2}) and o["scalar"] == r, "all_gather_object %d" % r)
    gl = [None] * size if rank == 0 else None
    chorus.gather_object(["g", rank], gl, dst=0)
    if rank == 0:
        check(gl == [["g", r] for r in range(size)], "gather_object")
    bl = [1, "two", {"three": 3}] if rank == size - 1 else [None, None, None]
    chorus.broadcast_object_list(bl, src=size - 1)
    check(bl == [1, "two", {"three": 3}], "broadcast_object_list")
    out = [None]
    chorus.scatter_object_list(out, [{"for": r} for r in range(size)] if rank == 0 else None,
                               src=0)
    check(out[0] == {"for": rank}, "scatter_object_list")
    expect(TypeError, lambda: chorus.all_gather_object([None] * size, object()),
           "an object that is not data")
    # One rank's object cannot be sent: that rank raises TypeError, the
    # others learn why (no one waits for the timeout) and the group goes on.
    if size > 1:
        bad = object() if rank == 1 else 1
        expect(TypeError if rank == 1 else chorus.InvalidArgumentError,
               lambda: chorus.all_gather_object([None] * size, bad), "one rank's bad object")
        lst2 = [None] * size
        chorus.all_gather_object(lst2, rank)
        check(lst2 == list(range(size)), "the group works after a refused object")
    # A pickle sent by one rank that opted in must not be unpickled by the
    # others; the marker file proves nothing ran.
    # Named by the job id (chorusrun's, random per run): a marker a killed
    # run left behind is never this run's.
    marker = "/tmp/chorus-pickle-ran-%s" % os.environ.get("CHORUS_JOB_ID")
    if size > 1:
        if rank == 0:
            chorus.allow_unsafe_pickle(True)
            chorus.all_gather_object([None] * size, "ok")  # the others send data
            e = None
            try:
                chorus.all_gather_object([None] * size, Evil())
            except chorus.ProtocolError as ex:  # rank 0 itself does not unpickle others' ...
                e = ex
            chorus.allow_unsafe_pickle(False)
            # rank 0 opted in, so it decodes its own pickle: the marker may
            # appear from rank 0 only; remove it and check the others below.
            chorus.barrier()
            if os.path.exists(marker):
                os.unlink(marker)
            chorus.barrier()
        else:
            chorus.all_gather_object([None] * size, "ok")
            expect(chorus.ProtocolError, lambda: chorus.all_gather_object([None] * size, "x"),
                   "a pickle from the wire")
            chorus.barrier()
            chorus.barrier()
            check(not os.path.exists(marker), "the peer's pickle ran here")


def test_codec_fuzz(rank):
    rng = random.Random(rank)
    samples = [_objects.dumps(o) for o in
               ([1, 2.5, "x", b"y", None], {"a": [np.arange(5), (1, 2)]}, {frozenset([1])},
                np.float16(3), 2 ** 200, -1, [[[[]]]], "ü" * 30)]
    for i in range(3000):
        b = bytearray(rng.choice(samples))
        for _ in range(rng.randint(1, 4)):
            k = rng.randrange(4, len(b)) if len(b) > 4 else 4
            op = rng.randrange(3)
            if op == 0 and k < len(b):
                b[k] = rng.randrange(256)
            elif op == 1:
                del b[k:k + rng.randint(1, 8)]
            else:
                b[k:k] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            _objects.loads(bytes(b))
        except _objects.DecodeError:
            pass
        except Exception as e:  # noqa: BLE001
            fail("codec: %s on mutated bytes %r" % (type(e).__name__, bytes(b)[:40]))
            return
    # Bounded: a huge claimed length is refused, not allocated.
    expect(_objects.DecodeError, lambda: _objects.loads(b"CHO\x01l\xff\xff\xff\xff\x0f"),
           "a list claiming 2^32 items")
    expect(_objects.DecodeError, lambda: _objects.loads(b"CHO\x01" + b"l\x01" * 200 + b"N"),
           "nesting")


def test_store(rank, size):
    port = np.zeros(1, np.int64)
    srv = None
    if rank == 0:
        srv = chorus.Store("127.0.0.1", 0, is_master=True, timeout=20)
        port[0] = srv.port
    chorus.broadcast(port, src=0)
    s = srv if rank == 0 else chorus.Store("127.0.0.1", int(port[0]), timeout=20)
    s.set("k%d" % rank, "v%d" % rank)
    check(s.get("k%d" % ((rank + 1) % size)) == b"v%d" % ((rank + 1) % size), "store get")
    total = s.add("counter", rank + 1)
    check(total >= rank + 1, "store add")
    chorus.barrier()
    check(s.add("counter", 0) == size * (size + 1) // 2, "store add total")
    check(s.check(["k0"]) and not s.check(["nope"]), "store check")
    e = expect(chorus.TimeoutError, lambda: s.wait(["never"], 200), "store wait times out")
    check(e is None or isinstance(e, TimeoutError), "chorus.TimeoutError is a TimeoutError")
    if rank == 0:
        check(s.compare_set("cas", b"", b"one") == b"one", "compare_set creates")
        check(s.compare_set("cas", b"zzz", b"two") == b"one", "compare_set refuses")
    chorus.barrier()
    if rank == 0:
        check(s.delete_key("cas") and s.num_keys() >= size, "delete/num_keys")
    chorus.barrier()
    if rank != 0:
        s.close()
    chorus.barrier()
    if rank == 0:
        s.close()


def test_gil(rank, size):
    if size < 2 or rank > 1:
        chorus.barrier()
        return
    if rank == 1:
        time.sleep(0.5)
        chorus.send(np.ones(4, np.float32), dst=0)
    else:
        got = np.zeros(4, np.float32)
        done = []
        t = threading.Thread(target=lambda: (chorus.recv(got, src=1), done.append(time.time())))
        t.start()
        spins = 0
        t0 = time.time()
        while not done and time.time() - t0 < 20:
            spins += 1
        t.join()
        # While the thread is blocked in recv this loop must run: with the
        # GIL held it would manage only a switch interval's worth.
        check(spins > 100000, "the main thread ran only %d loops while recv blocked" % spins)
    chorus.barrier()


def test_arguments(rank, size):
    a = np.zeros((4, 4), np.float32)
    expect(ValueError, lambda: chorus.all_reduce(a[:, ::2]), "non-contiguous")
    expect(ValueError, lambda: chorus.all_reduce(np.zeros(3, np.uint32)), "uint32")
    expect(ValueError, lambda: chorus.all_reduce(bytes(4)), "read-only output")
    expect(TypeError, lambda: chorus.all_reduce([1, 2]), "a list is not a buffer")
    expect(ValueError, lambda: chorus.all_gather([np.zeros(2)] * (size + 1), np.zeros(2)),
           "all_gather list length")
    expect(ValueError, lambda: chorus.all_gather_into_tensor(np.zeros(3), np.zeros(2)),
           "all_gather_into_tensor size")
    # Nothing was issued: the group still works.
    b = np.ones(2)
    chorus.all_reduce(b)
    check(np.all(b == size), "group usable after argument errors")


def test_mismatch(rank, size):
    if size < 2:
        return
    # Sizes that differ across ranks: every rank raises MismatchError fast.
    t0 = time.time()
    e = expect(chorus.MismatchError, lambda: chorus.all_reduce(np.zeros(3 + rank, np.float32)),
               "all_reduce of different sizes")
    check(time.time() - t0 < 10, "mismatch took %.1f s" % (time.time() - t0))
    check(e is None or "mismatch" in str(e), "mismatch message: %s" % e)
    # The world is failed now (sticky): every later call says so.
    expect(chorus.Error, lambda: chorus.barrier(), "calls after the failure")


def main():
    timeout = {"timeout": 3} if MODE == "timeout" else {"timeout": 30}
    chorus.init_process_group(**timeout)
    rank, size = chorus.get_rank(), chorus.get_world_size()
    if MODE == "dead":
        a = np.ones(4)
        chorus.all_reduce(a)
        if rank == size - 1:
            os._exit(0)  # dies without a word; chorusrun sees exit 0
        t0 = time.time()
        expect(chorus.Error, lambda: [chorus.all_reduce(a) for _ in range(100)],
               "collectives with a dead peer")
        check(time.time() - t0 < 20, "dead peer noticed after %.1f s" % (time.time() - t0))
    elif MODE == "refuse":
        # A gather_list only the destination can get wrong: it raises there
        # and touches nothing (the group stays usable, as Gloo's); the
        # destination's next collective meets the others' gather, and every
        # rank fails fast with a mismatch, not at the timeout.
        t0 = time.time()
        if rank == 0:
            gl = [np.zeros(3), np.zeros(4)] + [np.zeros(3)] * (size - 2)
            expect(ValueError, lambda: chorus.gather(np.zeros(3), gl, dst=0),
                   "a bad gather_list on dst")
            expect(chorus.MismatchError, lambda: chorus.barrier(),
                   "the destination's next collective")
        else:
            expect(chorus.MismatchError, lambda: chorus.gather(np.zeros(3), None, dst=0),
                   "the gather the destination refused")
        check(time.time() - t0 < 10, "refusal noticed after %.1f s" % (time.time() - t0))
    elif MODE == "timeout":
        if rank == 0:
            time.sleep(6)
        t0 = time.time()
        if rank != 0:
            expect(chorus.TimeoutError, lambda: chorus.barrier(), "a late rank")
            check(time.time() - t0 < 5.5, "timeout after %.1f s (timeout 3 s)" % (time.time() - t0))
        else:
            expect(chorus.Error, lambda: chorus.barrier(), "the late rank's own call")
    else:
        for name, fn in [("reductions", test_reductions), ("movement", test_movement),
                         ("p2p_async", test_p2p_async), ("groups", test_groups),
                         ("objects", test_objects), ("store", test_store), ("gil", test_gil),
                         ("arguments", test_arguments)]:
            before = failures
            fn(rank, size)
            if rank == 0:
                print("%s %s" % ("ok  " if failures == before else "FAIL", name), flush=True)
        test_codec_fuzz(rank)
        test_mismatch(rank, size)
    try:
        chorus.destroy_process_group()
    except chorus.Error:
        pass
    print("rank %d: %s (%d failures)" % (rank, "passed" if not failures else "FAILED", failures),
          flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
