"""chorus as a torch.distributed backend.

    import chorus.torch                      # registers the backend "chorus"
    dist.init_process_group("chorus")        # under torchrun, chorusrun, or env://

Every torch group (the default one and each ``new_group``) is its own chorus
world, bootstrapped through the c10d store torch gives the backend.

Under chorusrun, MASTER_ADDR:MASTER_PORT is chorus's own authenticated store
(CHORUS_STORE_EXTERNAL=1), which torch's TCPStore cannot use; there the
``env://`` rendezvous (init_process_group's default) gets a c10d store over
that store instead (``ChorusStore``), its keys under ``torch/<restart>/``.
Elsewhere ``env://`` is torch's own.

``dist.monitored_barrier`` works on chorus groups: importing this module
replaces torch's function (which refuses every backend but Gloo) with one
that sends chorus groups to their own monitored barrier -- Gloo's
semantics and messages -- and every other group to torch's function as
before.  Without ``timeout`` a chorus group waits for its own timeout.

Timeouts: init_process_group's ``timeout`` bounds every wait of the group;
left at torch's default (30 minutes) it yields to CHORUS_TIMEOUT when that is
set.
"""

import os
import sys
from datetime import timedelta

import torch  # noqa: F401  (registers the c10d types _torch builds on)
import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401

from chorus import _torch
from chorus._torch import ChorusStore, ProcessGroupChorus, create_process_group

# (torch.distributed.rendezvous the attribute is a function: the module)
_rendezvous = sys.modules["torch.distributed.rendezvous"]

__all__ = [
    "ChorusStore",
    "ProcessGroupChorus",
    "create_process_group",
    "is_chorus_group",
    "chorus_store_from_env",
    "fix_fsdp_import",
]

BACKEND = "chorus"

if "CHORUS" not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _torch.create_process_group)


def _group(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


def is_chorus_group(group=None):
    """True when ``group`` (default: the default group) is a chorus group."""
    return isinstance(_group(group), ProcessGroupChorus)


def _under_chorusrun():
    return os.environ.get("CHORUS_STORE_EXTERNAL") == "1"


def chorus_store_from_env(timeout=timedelta(minutes=30)):
    """A c10d store over the chorus store at MASTER_ADDR:MASTER_PORT (the one
    chorusrun serves), authenticated with the job secret from the environment,
    its keys under ``torch/<restart count>/`` so that a restarted group starts
    from a clean slate."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT")
    if not port:
        raise RuntimeError("chorus: MASTER_PORT is not set; is this process started by chorusrun?")
    store = ChorusStore(host, int(port), timeout)
    restart = os.environ.get("CHORUS_RESTART_COUNT") or os.environ.get(
        "TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore("torch/%s" % restart, store)


_torch_env_handler = _rendezvous._rendezvous_handlers.get("env")
_torch_env_handler = getattr(_torch_env_handler, "_chorus_orig", _torch_env_handler)


def _env_rendezvous_handler(url, timeout=timedelta(minutes=30), **kwargs):
    if not _under_chorusrun():
        yield from _torch_env_handler(url, timeout, **kwargs)
        return
    query = _rendezvous._query_to_dict(_rendezvous.urlparse(url).query)

    def need(var, key):
        if key in query:
            return int(query[key])
        val = os.environ.get(var)
        if not val:
            raise _rendezvous._rendezvous_error(
                "env:// rendezvous: environment variable %s expected, but not set" % var)
        return int(val)

    rank = need("RANK", "rank")
    world_size = need("WORLD_SIZE", "world_size")
    yield (chorus_store_from_env(timeout), rank, world_size)
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


if _torch_env_handler is not None:
    _env_rendezvous_handler._chorus_orig = _torch_env_handler
    _rendezvous._rendezvous_handlers["env"] = _env_rendezvous_handler


# torch.distributed.monitored_barrier: torch 1.13's Python refuses every
# backend but Gloo before it reaches the group.  For a chorus group it calls
# the group's own monitored_barrier (ProcessGroupChorus.monitoredBarrier:
# Gloo's protocol, semantics and messages); for every other group, and for
# a rank outside the group, torch's function runs unchanged.
_c10d = dist.distributed_c10d
_torch_monitored_barrier = getattr(_c10d.monitored_barrier, "_chorus_orig",
                                   _c10d.monitored_barrier)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    if not _c10d._rank_not_in_group(group) and is_chorus_group(group):
        if timeout is None:  # the group's own timeout (Gloo: 30 minutes)
            return _group(group).monitored_barrier(wait_all_ranks=wait_all_ranks)
        return _group(group).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    return _torch_monitored_barrier(group, timeout, wait_all_ranks)


monitored_barrier.__doc__ = _torch_monitored_barrier.__doc__
monitored_barrier._chorus_orig = _torch_monitored_barrier
_c10d.monitored_barrier = monitored_barrier
dist.monitored_barrier = monitored_barrier


def fix_fsdp_import():
    """Makes ``torch.distributed.fsdp`` importable on Python 3.11 with torch
    1.13 (Debian 12's pair), and imports it.

    torch 1.13's sharded-tensor metadata declares a dataclass field whose
    default is an instance of another (unhashable) dataclass, which Python
    3.11 refuses ("mutable default ... use default_factory"), so importing
    FSDP fails before any backend is involved.  This imports it once with
    ``dataclasses.field`` turning such a default into the equivalent
    ``default_factory`` (a copy per instance), then restores ``field``.
    Call it before ``from torch.distributed.fsdp import ...``; it does
    nothing where the import already works."""
    import copy
    import dataclasses
    try:
        import torch.distributed.fsdp  # noqa: F401
        return
    except ValueError:
        pass
    for name in [m for m in sys.modules if m.startswith("torch.distributed._shard")
                 or m.startswith("torch.distributed.fsdp")]:
        del sys.modules[name]
    original = dataclasses.field

    def field(*args, default=dataclasses.MISSING, **kwargs):
        if default is not dataclasses.MISSING and type(default).__hash__ is None:
            proto = default
            return original(*args, default_factory=lambda: copy.deepcopy(proto), **kwargs)
        return original(*args, default=default, **kwargs)

    dataclasses.field = field
    try:
        import torch.distributed.fsdp  # noqa: F401,F811
    finally:
        dataclasses.field = original
