"""chorus for Python: torch.distributed's API over libchorus, for NumPy
arrays and anything else with the buffer protocol.

    import numpy as np, chorus
    chorus.init_process_group()                 # env:// (chorusrun, torchrun, srun, mpirun)
    a = np.full(4, chorus.get_rank(), dtype=np.float32)
    chorus.all_reduce(a)                        # in place, like dist.all_reduce
    chorus.destroy_process_group()

Names and semantics follow torch.distributed: ranks given as ``src``/``dst``
are global ranks, ``group=None`` is the world, ``async_op=True`` returns a
Work with ``wait()`` and ``is_completed()``.  Buffers must be C-contiguous;
their element type comes from their format (int8, uint8, int32, int64,
float16, float32, float64), or from ``dtype="bfloat16"`` for 2-byte
elements.  Errors are exceptions of one class per result code
(chorus.TimeoutError, chorus.MismatchError, ...; all are chorus.Error),
carrying the library's message.  Every call that can block releases the
GIL.  For PyTorch, ``import chorus.torch`` registers the "chorus" backend
of torch.distributed instead (docs/python.md).
"""

import array as _array
import datetime as _dt
import itertools as _itertools
import os as _os
import warnings as _warnings

from . import _chorus
from . import _objects
from ._errors import *  # noqa: F401,F403 (the exception classes)
from ._errors import BY_CODE as _BY_CODE, Error
from ._objects import allow_unsafe_pickle, unsafe_pickle_allowed

_chorus._set_error_classes(_BY_CODE)
_NAMES = _chorus.names()
_DTYPES = _NAMES["dtypes"]  # "float32" -> code

__version__ = "%d.%d.%d" % (_chorus.version() // 10000, _chorus.version() // 100 % 100,
                            _chorus.version() % 100)

Store = None  # defined below
Work = _chorus.Work


class ReduceOp:
    """torch.distributed.ReduceOp's names (AVG divides by the group size;
    BAND/BOR/BXOR are for integers)."""
    SUM = _NAMES["ops"]["SUM"]
    PRODUCT = _NAMES["ops"]["PROD"]
    MIN = _NAMES["ops"]["MIN"]
    MAX = _NAMES["ops"]["MAX"]
    AVG = _NAMES["ops"]["AVG"]
    BAND = _NAMES["ops"]["BAND"]
    BOR = _NAMES["ops"]["BOR"]
    BXOR = _NAMES["ops"]["BXOR"]


class Backend:
    CHORUS = "chorus"


def _dtype(dtype):
    """dtype= argument -> code (-1: from the buffer's format)."""
    if dtype is None:
        return -1
    name = getattr(dtype, "name", None) or str(dtype)
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
            "double": "float64"}.get(name, name)
    code = _DTYPES.get(name)
    if code is None:
        raise ValueError("chorus: unknown dtype %r (one of %s)" % (dtype, ", ".join(_DTYPES)))
    return code


class ProcessGroup:
    """A group of processes (a libchorus communicator).  ``ranks`` are the
    members' global ranks in group-rank order."""

    __slots__ = ("_c", "ranks", "_index", "__weakref__")

    def __init__(self, comm, ranks):
        self._c = comm
        self.ranks = list(ranks)
        self._index = {g: i for i, g in enumerate(self.ranks)}

    def rank(self):
        return self._c.rank()

    def size(self):
        return self._c.size()

    def _local(self, global_rank, what):
        try:
            return self._index[global_rank]
        except (KeyError, TypeError):
            raise InvalidArgumentError(  # noqa: F405
                "CHORUS_ERR_INVALID_ARG: %s %r is not a rank of this group (global ranks %s)"
                % (what, global_rank, self.ranks)) from None

    def __repr__(self):
        return "<chorus.ProcessGroup ranks=%s>" % self.ranks


class GroupMember:
    """torch.distributed.GroupMember: WORLD is the default group once it
    exists; NON_GROUP_MEMBER is what new_group returns to non-members."""
    WORLD = None
    NON_GROUP_MEMBER = object()


_world = None
_groups = []


def is_available():
    return True


def is_initialized():
    return _world is not None


def _seconds(timeout):
    if timeout is None:
        return 0
    if isinstance(timeout, _dt.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1,
                       store=None, group_name="", pg_options=None):
    """Creates the world group, like torch.distributed.init_process_group.

    init_method: None or "env://" (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    or what srun / mpirun set), or "tcp://HOST:PORT" with rank and
    world_size.  store: a chorus.Store to rendezvous through (with rank and
    world_size).  timeout: seconds or a timedelta bounding every wait
    (default CHORUS_TIMEOUT, 300 s).  backend: None or "chorus".
    """
    global _world
    if _world is not None:
        raise RuntimeError("chorus: trying to initialize the default process group twice")
    if backend not in (None, "chorus", "CHORUS"):
        raise ValueError("chorus: backend %r: this package is the chorus backend (for torch, "
                         "import chorus.torch and use torch.distributed)" % (backend,))
    ms = int(_seconds(timeout) * 1000)
    explicit = rank is not None and rank >= 0 and world_size is not None and world_size > 0
    if store is not None:
        if not explicit:
            raise ValueError("chorus: store= needs rank and world_size")
        comm = _chorus.init(rank, world_size, store.host, store.port, ms, store.secret,
                            host_store=0)
    elif init_method and init_method.startswith("tcp://"):
        if not explicit:
            raise ValueError("chorus: tcp:// needs rank and world_size")
        hostport = init_method[len("tcp://"):].rstrip("/")
        host, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError("chorus: init_method %r is not tcp://HOST:PORT" % init_method)
        comm = _chorus.init(rank, world_size, host.strip("[]"), int(port), ms)
    elif init_method in (None, "env://"):
        env = _os.environ
        torchrun_style = all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        if explicit or (ms > 0 and torchrun_style):
            # The values given (or torchrun's variables) with this timeout.
            port = env.get("MASTER_PORT", "")
            if not port.isdigit():
                raise ValueError("chorus: env:// with explicit rank needs MASTER_PORT")
            comm = _chorus.init(rank if explicit else int(env["RANK"]),
                                world_size if explicit else int(env["WORLD_SIZE"]),
                                env.get("MASTER_ADDR") or "127.0.0.1", int(port), ms,
                                local_rank=int(env.get("LOCAL_RANK", -1)),
                                local_world_size=int(env.get("LOCAL_WORLD_SIZE", -1)))
        else:
            # srun, mpirun, mpiexec: the library reads their variables (and
            # CHORUS_TIMEOUT, which a timeout given here sets if the library
            # has not read its environment yet in this process).
            if ms > 0:
                env["CHORUS_TIMEOUT"] = str(max(1, (ms + 999) // 1000))
            comm = _chorus.init_env()
    else:
        raise ValueError("chorus: init_method %r: use env:// or tcp://HOST:PORT" % init_method)
    _world = ProcessGroup(comm, range(comm.size()))
    GroupMember.WORLD = _world


def _group(group):
    """The ProcessGroup to use, or None (with torch's warning) when this
    process is not a member."""
    if group is None or group is GroupMember.WORLD:
        if _world is None:
            raise RuntimeError("chorus: the default process group is not initialized; call "
                               "chorus.init_process_group() first")
        return _world
    if group is GroupMember.NON_GROUP_MEMBER:
        _warnings.warn("chorus: this rank is not a member of the group; the call does nothing",
                       stacklevel=3)
        return None
    if isinstance(group, ProcessGroup):
        if group._c.destroyed():
            raise RuntimeError("chorus: the group was destroyed")
        return group
    raise TypeError("chorus: group must be a ProcessGroup, None or GroupMember.WORLD")


def get_rank(group=None):
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return _group(group)._c.rank()


def get_world_size(group=None):
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return _group(group)._c.size()


def get_backend(group=None):
    _group(group)
    return "chorus"


def get_global_rank(group, group_rank):
    g = _group(group)
    if not 0 <= group_rank < len(g.ranks):
        raise ValueError("chorus: group rank %d out of range" % group_rank)
    return g.ranks[group_rank]


def get_group_rank(group, global_rank):
    return _group(group)._local(global_rank, "global rank")


def get_process_group_ranks(group):
    return list(_group(group).ranks)


def new_group(ranks=None, timeout=None, backend=None, pg_options=None):
    """A subgroup of the world (every rank of the world calls it with the same
    ranks).  Non-members get GroupMember.NON_GROUP_MEMBER."""
    w = _group(None)
    ranks = sorted(set(range(w.size()) if ranks is None else ranks))
    comm = w._c.new_group(ranks)
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    g = ProcessGroup(comm, ranks)
    _groups.append(g)
    return g


def split(color, key=None, group=None):
    """MPI_Comm_split: ranks of `group` with the same color form a subgroup,
    ordered by key (default: their rank).  Collective over `group`; a
    negative color returns GroupMember.NON_GROUP_MEMBER."""
    g = _group(group)
    key = g.rank() if key is None else key
    # The members' global ranks: everyone's (color, key) is known only to the
    # library, so ask the new group who is in it.
    comm = g._c.split(color, key)
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    me = _int64s([g.ranks[g.rank()]])
    allr = _int64s([0] * comm.size())
    comm.all_gather(me, allr, -1, False)
    sub = ProcessGroup(comm, [int(x) for x in allr])
    _groups.append(sub)
    return sub


def _int64s(values):
    """An int64 buffer of values (for counts and lengths; no NumPy needed)."""
    return _array.array("q", values)


def destroy_process_group(group=None):
    """Destroys group, or with None every group and the world."""
    global _world
    if group is None or group is GroupMember.WORLD:
        for g in reversed(_groups):
            g._c.destroy()
        _groups.clear()
        if _world is not None:
            _world._c.destroy()
        _world = None
        GroupMember.WORLD = None
        return
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    group._c.destroy()
    if group in _groups:
        _groups.remove(group)


def abort(group=None):
    """Makes every pending and future call on group fail (AbortedError),
    here and, as they notice, on its peers; destroy it afterwards."""
    _group(group)._c.abort()


# ----------------------------------------------------------------- collectives


class _After:
    """A Work whose result needs one more step on this side once the
    operation completes (copying a gathered buffer into a list, ...)."""

    __slots__ = ("_w", "_after", "_done")

    def __init__(self, work, after):
        self._w = work
        self._after = after
        self._done = False

    def _finish(self):
        if not self._done:
            self._done = True
            self._after()

    def wait(self, timeout=None):
        ms = -1 if timeout is None else int(_seconds(timeout) * 1000)
        self._w.wait(ms)
        self._finish()
        return True

    def is_completed(self):
        if self._w.is_completed():
            if self._w.is_success():
                self._finish()
            return True
        return False

    def is_success(self):
        return self.is_completed() and self._w.is_success()

    def exception(self):
        return self._w.exception()

    def duration(self):
        return self._w.duration()


def _then(work, async_op, after):
    """The outcome of an issued call whose data needs one more step here once
    it is in place (`after`): an _After Work (async), or None once done.
    (The extension itself returns None for a blocking call.)"""
    if async_op:
        return _After(work, after)
    after()
    return None


def _mv(x):
    """A flat byte view of a C-contiguous buffer."""
    m = memoryview(x)
    if not m.c_contiguous:
        raise ValueError("chorus: a tensor is not C-contiguous")
    return m.cast("B") if m.format != "B" or m.ndim != 1 else m


def _nbytes(x):
    return memoryview(x).nbytes


def _pack(buffers):
    """One bytearray holding the buffers one after the other."""
    out = bytearray(sum(_nbytes(b) for b in buffers))
    off = 0
    for b in buffers:
        m = _mv(b)
        out[off:off + len(m)] = m
        off += len(m)
    return out


def _unpack(flat, buffers):
    """Copies consecutive pieces of flat into the buffers."""
    src = memoryview(flat).cast("B")
    off = 0
    for b in buffers:
        m = _mv(b)
        if m.readonly:
            raise ValueError("chorus: an output is read-only")
        m[:] = src[off:off + len(m)]
        off += len(m)


def _check_root_list(g, lst, tensor, name, is_root):
    """gather's and scatter's list: only on the root, one entry per rank,
    each the tensor's size.  Only this rank can see a mistake in it; the
    error is only raised, and the group stays usable, as Gloo's does.
    Returns the tensor's size in bytes."""
    n = _nbytes(tensor)
    if not is_root:
        if lst:
            raise ValueError("chorus: %s must be given only on the root rank" % name)
        return n
    if lst is None or len(lst) != g.size():
        raise ValueError("chorus: %s needs %d tensors on the root rank" % (name, g.size()))
    for i, t in enumerate(lst):
        if _nbytes(t) != n:
            raise ValueError("chorus: %s[%d] has %d bytes, the tensor %d" % (name, i, _nbytes(t), n))
    return n


# The largest object a peer may make this rank allocate (bytes): received
# lengths are untrusted.
OBJECT_BYTES_MAX = 1 << 30


def _offsets(counts):
    """Where each block starts when the blocks lie end to end."""
    return [0] + list(_itertools.accumulate(counts))[:-1] if counts else []


def _code(x, dtype):
    return _chorus.dtype_of(x) if dtype < 0 else dtype


def broadcast(tensor, src, group=None, async_op=False, dtype=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.broadcast(tensor, g._local(src, "src"), _dtype(dtype), async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, dtype=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.all_reduce(tensor, tensor, op, _dtype(dtype), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, dtype=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.reduce(tensor, tensor, op, g._local(dst, "dst"), _dtype(dtype), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, dtype=None):
    """The inputs of every rank, in rank order, into one output of
    group-size times the input's elements."""
    g = _group(group)
    if g is None:
        return None
    return g._c.all_gather(input_tensor, output_tensor, _dtype(dtype), async_op)


_all_gather_base = all_gather_into_tensor


def all_gather(tensor_list, tensor, group=None, async_op=False, dtype=None):
    """tensor_list[r] receives rank r's tensor (every entry the tensor's size)."""
    g = _group(group)
    if g is None:
        return None
    return g._c.all_gather_list(tensor, tensor_list, _dtype(dtype), async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, dtype=None):
    """On dst, gather_list[r] receives rank r's tensor."""
    g = _group(group)
    if g is None:
        return None
    root = g._local(dst, "dst")
    dt = _dtype(dtype)
    if g.rank() != root:
        _check_root_list(g, gather_list, tensor, "gather_list", False)
        return g._c.gather(tensor, None, root, dt, async_op)
    n = _check_root_list(g, gather_list, tensor, "gather_list", True)
    flat = bytearray(n * g.size())
    w = g._c.gather(tensor, flat, root, _code(tensor, dt), async_op)
    return _then(w, async_op, lambda: _unpack(flat, gather_list))


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, dtype=None):
    """Rank r receives scatter_list[r] of src into tensor."""
    g = _group(group)
    if g is None:
        return None
    root = g._local(src, "src")
    dt = _dtype(dtype)
    if g.rank() != root:
        _check_root_list(g, scatter_list, tensor, "scatter_list", False)
        return g._c.scatter(None, tensor, root, dt, async_op)
    _check_root_list(g, scatter_list, tensor, "scatter_list", True)
    flat = _pack(scatter_list)
    return g._c.scatter(flat, tensor, root, _code(tensor, dt), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False,
                          dtype=None):
    """Block r (of group-size equal blocks) of op over every rank's input
    lands in rank r's output."""
    g = _group(group)
    if g is None:
        return None
    return g._c.reduce_scatter(input, output, op, _dtype(dtype), async_op)


_reduce_scatter_base = reduce_scatter_tensor


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, dtype=None):
    """output receives op over every rank's input_list[rank]."""
    g = _group(group)
    if g is None:
        return None
    if len(input_list) != g.size():
        raise ValueError("chorus: reduce_scatter needs %d inputs, got %d"
                         % (g.size(), len(input_list)))
    dt = _code(output, _dtype(dtype))
    flat = _pack(input_list)
    return g._c.reduce_scatter(flat, output, op, dt, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False, dtype=None):
    """torch's all_to_all_single: split sizes count rows (the first
    dimension); without them the rows are split evenly."""
    g = _group(group)
    if g is None:
        return None
    dt = _dtype(dtype)
    if output_split_sizes is None and input_split_sizes is None:
        return g._c.all_to_all(input, output, dt, async_op)
    n = g.size()

    def layout(x, splits, what):
        m = memoryview(x)
        rows = m.shape[0] if m.ndim else 1
        per_row = (m.nbytes // m.itemsize) // rows if rows else 0
        if splits is None:
            if rows % n:
                raise ValueError("chorus: %s has %d rows, not divisible by %d" % (what, rows, n))
            splits = [rows // n] * n
        if len(splits) != n or sum(splits) != rows:
            raise ValueError("chorus: %s split sizes %s do not cover its %d rows in %d parts"
                             % (what, list(splits), rows, n))
        counts = [s * per_row for s in splits]
        return counts, _offsets(counts)

    sc, sd = layout(input, input_split_sizes, "input")
    rc, rd = layout(output, output_split_sizes, "output")
    return g._c.all_to_allv(input, sc, sd, output, rc, rd, dt, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, dtype=None):
    """output_tensor_list[r] receives input_tensor_list[me] of rank r."""
    g = _group(group)
    if g is None:
        return None
    n = g.size()
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ValueError("chorus: all_to_all needs %d inputs and %d outputs" % (n, n))
    dt = _code(input_tensor_list[0], _dtype(dtype)) if n else -1
    esz = memoryview(input_tensor_list[0]).itemsize if n else 1
    sc = [_nbytes(t) // esz for t in input_tensor_list]
    rc = [_nbytes(t) // esz for t in output_tensor_list]
    sd, rd = _offsets(sc), _offsets(rc)
    src = _pack(input_tensor_list)
    out = bytearray(sum(rc) * esz)
    # all_to_allv whatever the sizes: whether they are equal is only known
    # per rank, and every rank must issue the same collective.
    w = g._c.all_to_allv(src, sc, sd, out, rc, rd, dt, async_op)
    return _then(w, async_op, lambda: _unpack(out, output_tensor_list))


def barrier(group=None, async_op=False, device_ids=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.barrier(async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """A barrier that fails with chorus.TimeoutError when some rank does not
    arrive within timeout (default: the group's timeout)."""
    g = _group(group)
    if g is None:
        return None
    w = g._c.barrier(True)
    ms = -1 if timeout is None else int(_seconds(timeout) * 1000)
    try:
        w.wait(ms)
    except TimeoutError:  # chorus's: some rank is stuck; the group cannot go on
        g._c.abort()
        raise


def send(tensor, dst, group=None, tag=0, dtype=None):
    g = _group(group)
    if g is None:
        return None
    g._c.send(tensor, g._local(dst, "dst"), tag, _dtype(dtype), False)


_ANY_SOURCE = -1  # chorus.h's CHORUS_ANY_SOURCE


def _recv_src(g, src):
    return _ANY_SOURCE if src is None else g._local(src, "src")


def recv(tensor, src=None, group=None, tag=0, dtype=None):
    """Receives into tensor from src (a global rank), or without src from
    any rank (the first message with this tag); returns the sender's
    global rank."""
    g = _group(group)
    if g is None:
        return -1
    if src is not None:
        g._c.recv(tensor, _recv_src(g, src), tag, _dtype(dtype), False)
        return src
    w = g._c.recv(tensor, _ANY_SOURCE, tag, _dtype(dtype), True)
    w.wait()
    return g.ranks[w.source_rank()]


def isend(tensor, dst, group=None, tag=0, dtype=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.send(tensor, g._local(dst, "dst"), tag, _dtype(dtype), True)


def irecv(tensor, src=None, group=None, tag=0, dtype=None):
    g = _group(group)
    if g is None:
        return None
    return g._c.recv(tensor, _recv_src(g, src), tag, _dtype(dtype), True)


class P2POp:
    """torch.distributed.P2POp: an isend or irecv for batch_isend_irecv."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        if op not in (isend, irecv):
            raise ValueError("chorus: P2POp's op must be chorus.isend or chorus.irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    """Posts every operation; returns their Works."""
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]


# ------------------------------------------------------------ object collectives
#
# Objects travel as data (chorus/_objects.py), never as pickles unless
# allow_unsafe_pickle() was called: bytes from the network must not run code.


_FAILED = b"CHO\x00"  # what a rank that could not encode its object sends


def _encode_or_marker(obj):
    """(bytes to send, exception to raise after the collective or None)."""
    try:
        return _objects.dumps(obj), None
    except (TypeError, ValueError) as e:
        return _FAILED + str(e).encode("utf-8", "replace")[:2000], e


def _failure(why):
    """An argument error in an object collective, as what the rank sends in
    place of its object and the exception it raises afterwards."""
    return _FAILED + why.encode("utf-8", "replace"), ValueError("chorus: " + why)


def _check_lengths(lengths, sender):
    """Object lengths a peer announced: untrusted, so bounded before anything
    is allocated for them."""
    if not all(0 <= n <= OBJECT_BYTES_MAX for n in lengths):
        raise ProtocolError(  # noqa: F405
            "CHORUS_ERR_PROTOCOL: rank %d announced an object length that is negative or over "
            "chorus.OBJECT_BYTES_MAX (%d bytes)" % (sender, OBJECT_BYTES_MAX))


def _decode(raw, sender):
    if bytes(raw[:4]) == _FAILED:
        raise InvalidArgumentError(  # noqa: F405
            "CHORUS_ERR_INVALID_ARG: rank %d could not send its object: %s"
            % (sender, bytes(raw[4:]).decode("utf-8", "replace")))
    try:
        return _objects.loads(raw)
    except _objects.DecodeError as e:
        raise ProtocolError(  # noqa: F405
            "CHORUS_ERR_PROTOCOL: the object rank %d sent cannot be decoded: %s" % (sender, e)
        ) from None


def all_gather_object(object_list, obj, group=None):
    """object_list[r] receives rank r's obj."""
    g = _group(group)
    if g is None:
        return None
    data, err = _encode_or_marker(obj)
    if len(object_list) != g.size() and err is None:
        data, err = _failure("object_list must have %d entries, not %d"
                             % (g.size(), len(object_list)))
    parts = g._c.all_gather_bytes(data)  # every rank takes part, even one that failed
    if err is not None:
        raise err
    for r, raw in enumerate(parts):
        object_list[r] = _decode(raw, g.ranks[r])


def gather_object(obj, object_gather_list=None, dst=0, group=None):
    """On dst, object_gather_list[r] receives rank r's obj."""
    g = _group(group)
    if g is None:
        return None
    root = g._local(dst, "dst")
    data, err = _encode_or_marker(obj)
    bad_list = g.rank() == root and (object_gather_list is None or
                                     len(object_gather_list) != g.size())
    parts = g._c.gather_bytes(data, root)  # every rank takes part, even one that failed
    if err is not None:
        raise err
    if bad_list:
        raise ValueError("chorus: object_gather_list must have %d entries on dst" % g.size())
    if parts is not None and g.rank() == root:
        for r, raw in enumerate(parts):
            object_gather_list[r] = _decode(raw, g.ranks[r])


def broadcast_object_list(object_list, src=0, group=None, device=None):
    """Every rank's object_list (same length everywhere) receives src's."""
    g = _group(group)
    if g is None:
        return None
    root = g._local(src, "src")
    length = _int64s([0])
    err = None
    if g.rank() == root:
        data, err = _encode_or_marker(list(object_list))
        length[0] = len(data)
    g._c.broadcast(length, root, -1, False)
    if g.rank() != root:
        _check_lengths(length, src)
        data = bytearray(length[0])
    g._c.broadcast(data, root, -1, False)
    if err is not None:
        raise err
    if g.rank() != root:
        got = _decode(data, src)
        if not isinstance(got, list) or len(got) != len(object_list):
            raise ValueError("chorus: broadcast_object_list: src sent %s entries, this rank's "
                             "list has %d" % (len(got) if isinstance(got, list) else "no",
                                             len(object_list)))
        object_list[:] = got


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=0,
                        group=None):
    """scatter_object_output_list[0] receives src's
    scatter_object_input_list[rank]."""
    g = _group(group)
    if g is None:
        return None
    root = g._local(src, "src")
    if not scatter_object_output_list:
        raise ValueError("chorus: scatter_object_output_list needs at least one entry")
    n = g.size()
    counts = _int64s([0] * n)
    err = None
    if g.rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != n:
            blob, err = _failure("scatter_object_input_list must have %d entries on src" % n)
            blobs = [blob] * n
        else:
            enc = [_encode_or_marker(o) for o in scatter_object_input_list]
            blobs = [b for b, _ in enc]
            err = next((e for _, e in enc if e is not None), None)
        for i, b in enumerate(blobs):
            counts[i] = len(b)
    g._c.broadcast(counts, root, -1, False)
    _check_lengths(counts, src)
    # One all_to_allv in which only src sends: counts[r] bytes to rank r.
    zeros = [0] * n
    mine = bytearray(counts[g.rank()])
    recv_counts = [counts[g.rank()] if r == root else 0 for r in range(n)]
    if g.rank() == root:
        g._c.all_to_allv(b"".join(blobs), list(counts), _offsets(counts), mine, recv_counts,
                         zeros, -1, False)
    else:
        g._c.all_to_allv(b"", zeros, zeros, mine, recv_counts, zeros, -1, False)
    if err is not None:
        raise err
    scatter_object_output_list[0] = _decode(mine, src)


# ----------------------------------------------------------------------- store


class Store(_chorus.Store):
    """chorus's key-value store, with torch's TCPStore methods: set, get
    (waits for the key), add, compare_set, check, delete_key, wait,
    num_keys.  Store(host, port, is_master=True) also serves it (port 0:
    any free port; see .port).  Connections are authenticated with the job
    secret (secret=, CHORUS_JOB_SECRET or CHORUS_JOB_SECRET_FILE)."""

    def __init__(self, host_name, port, world_size=None, is_master=False, timeout=None,
                 secret=None):
        ms = int(_seconds(timeout) * 1000) or 300000
        super().__init__(host_name, port, bool(is_master), secret, ms)
        self.host = host_name or "127.0.0.1"
        served = super().port()
        self.port = served if served is not None else port
        self.secret = secret
