"""Objects as data: the encoding behind all_gather_object, gather_object,
broadcast_object_list and scatter_object_list.

torch.distributed sends objects with pickle, and unpickling bytes that came
from the network runs whatever code they name.  chorus sends data instead:
None, bool, int, float, complex, str, bytes, bytearray, lists, tuples,
dicts, sets and frozensets of them, and NumPy arrays and scalars of numeric
or boolean dtypes.  Anything else is refused when sending, with a message
that says what to do.  Pickle is available only after an explicit, global
opt-in (``chorus.allow_unsafe_pickle()``) on the receiving side too.

The format: the magic ``b"CHO\\x01"``, then one value.  A value is a tag
byte and its payload; lengths and counts are unsigned LEB128.  Decoding
treats the bytes as hostile: every length is checked against what is left,
nesting is limited, containers cannot claim more items than bytes remain,
and array dtypes come from a fixed list.
"""

import struct

MAGIC = b"CHO\x01"
MAX_DEPTH = 100
_allow_pickle = False

# NumPy dtypes sent as data (dtype.str without the byte-order character).
_ARRAY_KINDS = {"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8",
                "c16"}


def allow_unsafe_pickle(enable=True):
    """Lets object collectives fall back to pickle for other types, and accept
    pickled objects from peers.  UNSAFE: unpickling runs code chosen by the
    sender.  Enable it only when every process of the job is trusted, on every
    rank that should accept such objects."""
    global _allow_pickle
    _allow_pickle = bool(enable)


def unsafe_pickle_allowed():
    return _allow_pickle


class DecodeError(ValueError):
    pass


def _uleb(n, out):
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return


def _np():
    try:
        import numpy
        return numpy
    except ImportError:  # pragma: no cover - numpy is a dependency in practice
        return None


def dumps(obj):
    out = bytearray(MAGIC)
    _enc(obj, out, 0)
    return bytes(out)


def _enc(o, out, depth):
    if depth > MAX_DEPTH:
        raise ValueError("chorus: object nested more than %d levels deep" % MAX_DEPTH)
    t = type(o)
    if o is None:
        out += b"N"
    elif t is bool:
        out += b"T" if o else b"F"
    elif t is int:
        n = (o.bit_length() + 8) // 8
        out += b"i"
        _uleb(n, out)
        out += o.to_bytes(n, "little", signed=True)
    elif t is float:
        out += b"f" + struct.pack("<d", o)
    elif t is complex:
        out += b"c" + struct.pack("<dd", o.real, o.imag)
    elif t is str:
        b = o.encode("utf-8", "surrogatepass")
        out += b"s"
        _uleb(len(b), out)
        out += b
    elif t is bytes or t is bytearray:
        out += b"b" if t is bytes else b"y"
        _uleb(len(o), out)
        out += o
    elif t in (list, tuple, set, frozenset):
        out += {list: b"l", tuple: b"t", set: b"e", frozenset: b"z"}[t]
        _uleb(len(o), out)
        for x in o:
            _enc(x, out, depth + 1)
    elif t is dict:
        out += b"d"
        _uleb(len(o), out)
        for k, v in o.items():
            _enc(k, out, depth + 1)
            _enc(v, out, depth + 1)
    else:
        np = _np()
        if np is not None and isinstance(o, (np.ndarray, np.generic)):
            _enc_numpy(np, o, out)
        elif _allow_pickle:
            import pickle
            b = pickle.dumps(o)
            out += b"P"
            _uleb(len(b), out)
            out += b
        else:
            raise TypeError(
                "chorus: cannot send an object of type %s.%s: object collectives send data, "
                "not pickles (None, bool, int, float, complex, str, bytes, lists, tuples, "
                "dicts and sets of them, NumPy arrays).  Convert it, or, if every process of "
                "the job is trusted, call chorus.allow_unsafe_pickle() on every rank "
                "(unpickling runs code the sender chooses)" % (t.__module__, t.__qualname__))


def _enc_numpy(np, o, out):
    scalar = isinstance(o, np.generic)
    a = np.asarray(o)
    kind = a.dtype.str[1:]
    if a.dtype.str[0] == ">" or kind not in _ARRAY_KINDS:
        raise TypeError("chorus: NumPy dtype %s is not sent as data (numeric and bool dtypes, "
                        "native byte order)" % a.dtype)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    out += b"g" if scalar else b"a"
    k = kind.encode()
    _uleb(len(k), out)
    out += k
    _uleb(a.ndim, out)
    for d in a.shape:
        _uleb(d, out)
    raw = a.tobytes()
    _uleb(len(raw), out)
    out += raw


def loads(data):
    mv = memoryview(data).cast("B")
    if bytes(mv[:4]) != MAGIC:
        raise DecodeError("not chorus object bytes (bad magic)")
    r = _Reader(mv, 4)
    v = r.value(0)
    if r.pos != len(mv):
        raise DecodeError("%d bytes left over after the object" % (len(mv) - r.pos))
    return v


class _Reader:
    __slots__ = ("mv", "pos")

    def __init__(self, mv, pos):
        self.mv = mv
        self.pos = pos

    def left(self):
        return len(self.mv) - self.pos

    def byte(self):
        if self.pos >= len(self.mv):
            raise DecodeError("truncated")
        b = self.mv[self.pos]
        self.pos += 1
        return b

    def uleb(self):
        n = shift = 0
        while True:
            b = self.byte()
            n |= (b & 0x7F) << shift
            if not b & 0x80:
                return n
            shift += 7
            if shift > 63:
                raise DecodeError("length field too long")

    def take(self, n):
        if n > self.left():
            raise DecodeError("a field claims %d bytes, %d are left" % (n, self.left()))
        b = self.mv[self.pos:self.pos + n]
        self.pos += n
        return b

    def count(self):
        n = self.uleb()
        if n > self.left():  # every item takes at least one byte
            raise DecodeError("a container claims %d items, %d bytes are left" % (n, self.left()))
        return n

    def value(self, depth):
        if depth > MAX_DEPTH:
            raise DecodeError("nested more than %d levels deep" % MAX_DEPTH)
        tag = chr(self.byte())
        if tag == "N":
            return None
        if tag == "T":
            return True
        if tag == "F":
            return False
        if tag == "i":
            n = self.uleb()
            if n > 1 << 20:
                raise DecodeError("integer of %d bytes" % n)
            return int.from_bytes(self.take(n), "little", signed=True)
        if tag == "f":
            return struct.unpack("<d", self.take(8))[0]
        if tag == "c":
            re_, im = struct.unpack("<dd", self.take(16))
            return complex(re_, im)
        if tag == "s":
            try:
                return str(self.take(self.uleb()), "utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise DecodeError("a string is not UTF-8: %s" % e) from None
        if tag == "b":
            return bytes(self.take(self.uleb()))
        if tag == "y":
            return bytearray(self.take(self.uleb()))
        if tag in "ltez":
            items = [self.value(depth + 1) for _ in range(self.count())]
            if tag == "l":
                return items
            if tag == "t":
                return tuple(items)
            try:
                return set(items) if tag == "e" else frozenset(items)
            except TypeError as e:
                raise DecodeError("a set holds an unhashable item: %s" % e) from None
        if tag == "d":
            d = {}
            for _ in range(self.count()):
                k = self.value(depth + 1)
                try:
                    d[k] = self.value(depth + 1)
                except TypeError as e:
                    raise DecodeError("a dict key is unhashable: %s" % e) from None
            return d
        if tag in "ag":
            return self.array(tag == "g")
        if tag == "P":
            raw = self.take(self.uleb())
            if not _allow_pickle:
                raise DecodeError(
                    "the peer sent a pickled object, and chorus does not unpickle bytes from "
                    "the network unless chorus.allow_unsafe_pickle() was called on this rank")
            import pickle
            return pickle.loads(bytes(raw))
        raise DecodeError("unknown tag %r" % tag)

    def array(self, scalar):
        np = _np()
        if np is None:
            raise DecodeError("a NumPy array arrived but NumPy is not installed")
        kind = bytes(self.take(self.uleb())).decode("ascii", "replace")
        if kind not in _ARRAY_KINDS:
            raise DecodeError("array dtype %r is not accepted" % kind)
        ndim = self.uleb()
        if ndim > 32:  # NumPy's own limit
            raise DecodeError("array of %d dimensions" % ndim)
        shape = tuple(self.uleb() for _ in range(ndim))
        dt = np.dtype("<" + kind if kind not in ("b1", "i1", "u1") else "|" + kind)
        n = 1
        for d in shape:
            n *= d
        raw = self.take(self.uleb())
        if len(raw) != n * dt.itemsize:
            raise DecodeError("array of shape %s and dtype %s needs %d bytes, %d were sent"
                              % (shape, dt, n * dt.itemsize, len(raw)))
        try:
            a = np.frombuffer(bytes(raw), dtype=dt).reshape(shape)
        except ValueError as e:
            raise DecodeError("array of shape %s: %s" % (shape, e)) from None
        if scalar:
            if shape != ():
                raise DecodeError("a NumPy scalar with shape %s" % (shape,))
            return a[()]
        return a.copy()
