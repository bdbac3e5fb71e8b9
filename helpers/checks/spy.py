"""What the learner's code sent and called, inside a rank: one spy for every check.

A check that counts messages or forbids a shortcut must see a send whichever way
the learner posted it: ``dist.send``, ``dist.isend``, or a ``dist.P2POp`` inside
``dist.batch_isend_irecv`` (the form chapter 03 teaches, since it cannot deadlock
under nccl), with ``dst=`` or ``group_dst=``. Replacing ``torch.distributed.isend``
alone misses the last two ways, and breaks the batch: ``P2POp`` checks its op
against ``distributed_c10d``'s own ``isend``/``irecv`` ("Invalid ``op``"), and
``batch_isend_irecv`` calls the op the ``P2POp`` holds. So the spy replaces the
point-to-point functions in both modules: a ``P2POp`` made while it is active holds
the spy's function, which records the send when the batch runs it.

``with communication_spy(...) as spy:`` inside a rank function records

* ``spy.sends``: ``(destination global rank, bytes, a CPU copy of the tensor)`` per
  send, in posting order;
* ``spy.recvs``: ``(source global rank, bytes)`` per receive;
* ``spy.collectives``: the name of every collective called;

and, while active:

* a send or receive to a rank outside the group raises at once, naming it (gloo
  would wait forever for a rank that does not exist, and the check would only
  report a hang);
* the collectives named in ``refuse`` raise with the given reason;
* ``recv_dtype``: a receive buffer of another dtype raises, naming it (gloo would
  abort the process on the size mismatch with no word of the cause).

On exit the functions are put back. It stacks with the collective recorder and
NCCL's rules (``helpers.launch.nccl_rules``): each wraps what it finds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from typing import Any, Iterator

P2P = ("send", "isend", "recv", "irecv")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "all_to_all_single", "reduce", "gather", "scatter")
_SENDS = ("send", "isend")


@dataclasses.dataclass
class Spy:
    sends: list = dataclasses.field(default_factory=list)
    recvs: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)

    @property
    def destinations(self) -> list[int]:
        return [dst for dst, _, _ in self.sends]


@contextlib.contextmanager
def communication_spy(refuse: dict[str, str] | None = None, recv_dtype=None,
                      keep_values: bool = True) -> Iterator[Spy]:
    """See the module docstring. ``refuse``: {collective name: why it is refused here}."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    spy, refuse, saved = Spy(), refuse or {}, []

    def replace(name, wrapper):
        for module in (dist, c10d):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)

    for name in P2P:
        replace(name, _p2p(name, getattr(c10d, name), spy, recv_dtype, keep_values))
    for name in COLLECTIVES:
        if hasattr(dist, name):
            replace(name, _collective(name, getattr(dist, name), spy, refuse.get(name)))
    try:
        yield spy
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _peer(bound: dict, name: str) -> tuple[int | None, Any]:
    """(the peer's global rank, the group) of a point-to-point call."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    group = bound.get("group")
    pg = group if group is not None else c10d._get_default_group()
    peer_arg, group_arg = ("dst", "group_dst") if name in _SENDS else ("src", "group_src")
    peer = bound.get(peer_arg)
    if peer is None and bound.get(group_arg) is not None:
        local = bound[group_arg]
        members = dist.get_process_group_ranks(pg)
        if not 0 <= local < len(members):
            raise ValueError(f"{name} with {group_arg}={local}, but the group has "
                             f"{len(members)} ranks (0..{len(members) - 1})")
        peer = members[local]
    if peer is not None and peer not in dist.get_process_group_ranks(pg):
        members = dist.get_process_group_ranks(pg)
        raise ValueError(
            f"rank {dist.get_rank()} {'sends to' if name in _SENDS else 'receives from'} rank "
            f"{peer}, which is not in its group (ranks {members}): a rank number computed "
            f"past the last rank, or hard-coded for another world size? (gloo would wait "
            f"for it forever)")
    return peer, group


# Inside a spied point-to-point call: torch 2.13's blocking ``dist.send``/``recv`` post
# through the module's ``isend``/``irecv``, which the spy has replaced too; the inner
# call must not be recorded a second time.
_INSIDE = threading.local()


def _p2p(name: str, original, spy: Spy, recv_dtype, keep_values: bool):
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if getattr(_INSIDE, "call", False):
            return original(*args, **kwargs)
        _INSIDE.call = True
        try:
            return _record(*args, **kwargs)
        finally:
            _INSIDE.call = False

    def _record(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        tensor = bound.get("tensor")
        peer, _ = _peer(bound, name)
        nbytes = tensor.numel() * tensor.element_size()
        if name in _SENDS:
            copy = tensor.detach().to("cpu", copy=True) if keep_values else None
            spy.sends.append((peer, nbytes, copy))
        else:
            if recv_dtype is not None and tensor.dtype != recv_dtype:
                raise RuntimeError(f"receiving into a {tensor.dtype} buffer, but the messages "
                                   f"carry {recv_dtype}: allocate receive buffers with the "
                                   f"data's dtype (torch.empty_like(chunk))")
            spy.recvs.append((peer, nbytes))
        return original(*args, **kwargs)
    return wrapper


def _collective(name: str, original, spy: Spy, refused: str | None):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        spy.collectives.append(name)
        if refused is not None:
            raise RuntimeError(f"dist.{name} is switched off in this check: {refused}")
        return original(*args, **kwargs)
    return wrapper
