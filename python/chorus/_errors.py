"""Exceptions: one class per libchorus result code.

Every class derives from :class:`chorus.Error` (a ``RuntimeError``, which is
what torch.distributed raises, so code that catches that keeps working) and
from the builtin that fits its meaning where one does (``TimeoutError``,
``ValueError``, ...).  The message is the library's, unchanged, prefixed
with the code's name.
"""

import builtins


class Error(RuntimeError):
    """A libchorus call failed.  ``code`` is the result code."""
    code = -8
    name = "CHORUS_ERR_INTERNAL"


def _make(name, code, result_name, *extra, doc):
    return type(name, (Error,) + extra, {"code": code, "name": result_name, "__doc__": doc,
                                          "__module__": "chorus"})


InvalidArgumentError = _make("InvalidArgumentError", -1, "CHORUS_ERR_INVALID_ARG", ValueError,
                             doc="An argument was wrong (sizes, ranks, dtypes).")
NoMemoryError = _make("NoMemoryError", -2, "CHORUS_ERR_NO_MEMORY", MemoryError,
                      doc="Out of memory (or /dev/shm full).")
SystemCallError = _make("SystemCallError", -3, "CHORUS_ERR_SYSTEM", OSError,
                        doc="A system call failed; errno is in the message.")
TimeoutError = _make("TimeoutError", -4, "CHORUS_ERR_TIMEOUT", builtins.TimeoutError,
                     doc="A peer or the store did not answer in time (CHORUS_TIMEOUT).")
RemoteError = _make("RemoteError", -5, "CHORUS_ERR_REMOTE",
                    doc="A peer died, closed its connection or reported an error.")
MismatchError = _make("MismatchError", -6, "CHORUS_ERR_MISMATCH",
                      doc="Ranks called different collectives or passed different arguments.")
NotSupportedError = _make("NotSupportedError", -7, "CHORUS_ERR_NOT_SUPPORTED",
                          NotImplementedError, doc="Not supported for these arguments.")
InternalError = _make("InternalError", -8, "CHORUS_ERR_INTERNAL",
                      doc="A bug in chorus: please report it with CHORUS_LOG_LEVEL=DEBUG.")
AbortedError = _make("AbortedError", -9, "CHORUS_ERR_ABORTED",
                     doc="The process group was aborted.")
ProtocolError = _make("ProtocolError", -10, "CHORUS_ERR_PROTOCOL",
                      doc="Malformed or unauthenticated bytes were received.")
StoreError = _make("StoreError", -11, "CHORUS_ERR_STORE",
                   doc="The key-value store failed (the message names its address).")

BY_CODE = {0: Error}
for _cls in (InvalidArgumentError, NoMemoryError, SystemCallError, TimeoutError, RemoteError,
             MismatchError, NotSupportedError, InternalError, AbortedError, ProtocolError,
             StoreError):
    BY_CODE[_cls.code] = _cls

__all__ = ["Error"] + [c.__name__ for c in BY_CODE.values() if c is not Error]
