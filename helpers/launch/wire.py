"""The wire: every call that reaches a process group, seen in one place.

Why here
--------
Whatever a rank function writes, ``dist.all_reduce(t)``, ``torch.distributed.isend``,
``from torch.distributed import isend`` or a ``P2POp`` inside ``batch_isend_irecv``,
torch's Python layer ends in one method of the group's ``ProcessGroup`` object:
``group.allreduce([t], opts)``, ``group.send([t], group_dst, tag)`` (torch 2.13,
``distributed_c10d.py``: every collective and point-to-point function does this).
Replacing the *functions* of ``torch.distributed`` sees only the code that looks them
up after the replacement: a name imported before keeps torch's own function, and
torch's ``P2POp`` refuses any ``isend`` but the module's current one. Replacing the
*methods* of the ``ProcessGroup`` class (a pybind class whose attributes Python may
set) sees every spelling, changes no function a learner holds, and needs no import
order. So the checks' spy (``helpers.checks.spy``) and NCCL's rules
(``helpers.launch.nccl_rules``) both watch here: one interposition point.

Alternatives, and why not: a backend written in Python that wraps gloo
(``Backend.register_backend``, as torch's ``multi_threaded_pg.py`` writes a whole
ProcessGroup in Python) would see the same calls, but ``launch`` would have to create
every group through it, and torch's own code (DDP, FSDP2, DeviceMesh) checks the
backend's name in places; swapping the code of torch's functions (what
``helpers.checks.course_answers`` does to the course's own answers) breaks on
torch's decorators, which close over the function they wrap.

What each call tells (``Call``)
-------------------------------
``op``: what moves, named as ``torch.distributed`` names it ("send", "recv",
"all_reduce", "all_gather_into_tensor", ...); ``api``: the function the code called
("isend", "batch_isend_irecv", "all_gather_object", ...: the outermost function of
``distributed_c10d`` on the stack); the group and its global ranks; ``peer``, the
other side of a send or receive as a global rank; the tensors this rank hands in and
their bytes; whether it is one operation of a ``batch_isend_irecv`` (and which).

Observers
---------
An observer has ``before(call)``: it may record the call, refuse it (raise), or change
``call.args`` (the rules zero the tag). It may also have ``post(call, post)``, to
take the posting over: ``post()`` posts the call to gloo and returns its Work, and the
observer returns a Work of its own (the rules run lone point-to-point calls on a
stream of their own, as nccl does). ``observing(obs)`` adds one for a block;
``add(obs)`` for the rank's life.

What it cannot see: collectives torch issues from C++ (DDP's reducer, functional
collectives such as DTensor's), which never pass a Python method. They are torch's
own code; the checks that need them count them another way (``helpers.tp``'s
``count_collectives`` hooks the layers).

Cost: with no observer, one Python call per operation (under a microsecond); with
one, a walk up a few stack frames to name the ``api``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from typing import Any, Callable, Iterator

# ProcessGroup method -> the operation, as torch.distributed names the function
# that posts it (torch 2.13, and 2.14.1's distributed_c10d, read for the same calls and
# batch_isend_irecv's p2p_op_list / p2p_op). Only the methods the class has are replaced.
OPS = {
    "send": "send", "recv": "recv", "recv_anysource": "recv",
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single": "all_gather_into_tensor", "_allgather_base": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all", "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "gather_single": "gather_single",   # torch 2.14's dist.gather_single
    "barrier": "barrier", "monitored_barrier": "monitored_barrier",
}
P2P = ("send", "recv")

# The operations whose first argument is the output and second the input, per method
# (the rest take the tensors to reduce, send or fill in their first argument).
_OUT_IN = {"allgather", "allgather_coalesced", "all_gather_single", "_allgather_base",
           "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
           "reduce_scatter", "reduce_scatter_single", "_reduce_scatter_base",
           "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
           "alltoall", "all_to_all_single", "alltoall_base", "gather", "gather_single",
           "scatter"}


@dataclasses.dataclass
class Call:
    """One operation reaching a process group (see the module docstring)."""
    op: str
    api: str
    method: str
    group: Any
    ranks: tuple[int, ...]
    args: list
    peer: int | None = None          # global rank (send / recv), None for any source
    group_peer: int | None = None    # the same, as the group numbers it
    batch: list | None = None        # the P2POps of the batch_isend_irecv it is part of
    index: int = 0                   # its place in that batch
    async_op: bool = False           # the caller goes on before it completes (isend, irecv,
                                     # a batch, async_op=True)

    @property
    def batched(self) -> bool:
        return self.batch is not None

    @property
    def first_in_batch(self) -> bool:
        return self.batch is not None and self.index == 0

    @property
    def tensors(self) -> list:
        """The tensors this rank hands in (a receive: the buffer it fills)."""
        import torch

        if not self.args:
            return []
        first = self.args[1] if self.method in _OUT_IN else self.args[0]
        if self.method == "scatter" and not flatten(first):  # not the root: what it gets
            first = self.args[0]
        return [t for t in flatten(first) if isinstance(t, torch.Tensor)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def rank(self) -> int:
        return self.ranks[self.group.rank()] if self.ranks else 0


def flatten(value) -> list:
    """Nested lists and tuples of a call's arguments as one list."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten(v)]
    return [value]


_OBSERVERS: list = []
_INSTALLED: dict[str, Callable] = {}   # method -> torch's own
_LOCAL = threading.local()             # .busy: inside an observer (its own calls pass)


def add(observer) -> None:
    """Watch every call for the rest of this process's life."""
    install()
    _OBSERVERS.append(observer)


@contextlib.contextmanager
def observing(observer) -> Iterator[Any]:
    """Watch every call made while the block runs. It sees each call before the
    observers added for the rank's life (a check's spy names a wrong peer before NCCL's
    rules would wait for it)."""
    install()
    _OBSERVERS.insert(0, observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


def install() -> None:
    """Replace the ProcessGroup methods once per process (idempotent)."""
    if _INSTALLED:
        return
    from torch._C._distributed_c10d import ProcessGroup

    for method, op in OPS.items():
        if method in ProcessGroup.__dict__:
            _INSTALLED[method] = ProcessGroup.__dict__[method]
            setattr(ProcessGroup, method, _wrap(method, op, _INSTALLED[method]))


def _wrap(method: str, op: str, torch_own: Callable) -> Callable:
    def watched(self, *args, **kwargs):
        if not _OBSERVERS or getattr(_LOCAL, "busy", False):
            return torch_own(self, *args, **kwargs)
        call = _describe(self, method, op, list(args), sys._getframe(1))
        observers = list(_OBSERVERS)
        _LOCAL.busy = True
        try:
            for obs in observers:
                obs.before(call)
        finally:
            _LOCAL.busy = False

        def post():
            return torch_own(self, *call.args, **kwargs)
        for obs in reversed(observers):
            if hasattr(obs, "post"):
                post = _bind(obs.post, call, post)
        return post()
    watched.__name__ = watched.__qualname__ = method
    watched.__doc__ = f"ProcessGroup.{method}, seen by helpers.launch.wire"
    return watched


def _bind(post_of, call, inner):
    return lambda: post_of(call, inner)


def _ranks_of(group) -> tuple[int, ...]:
    import torch.distributed as dist

    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:  # a group torch's registry does not know: number it as itself
        return tuple(range(group.size()))


def _describe(group, method: str, op: str, args: list, frame) -> Call:
    api, batch, index, async_op = _caller(frame)
    ranks = _ranks_of(group)
    call = Call(op=op, api=api or op, method=method, group=group, ranks=ranks, args=args,
                batch=batch, index=index,
                async_op=bool(async_op) or api in ("isend", "irecv", "batch_isend_irecv"))
    if method in ("send", "recv"):
        local = args[1]
        call.group_peer = local
        call.peer = ranks[local] if 0 <= local < len(ranks) else local
    return call


_KIND: dict[str, str | None] = {}   # a code object's file name -> "c10d", "logger" or None


_SEE_THROUGH: set[str] = set()      # files of wrappers around torch.distributed's functions


def see_through(path: str) -> None:
    """Frames of this file sit between torch's functions without being their caller
    (the collective recorder wraps them): name the call past them."""
    _SEE_THROUGH.add(os.path.realpath(path))
    _KIND.clear()


def _torch_dir(torch) -> str:
    return os.path.dirname(os.path.realpath(torch.__file__)) + os.sep


def _kind(filename: str) -> str | None:
    kind = _KIND.get(filename, "?")
    if kind == "?":
        import torch.distributed.c10d_logger as logger
        import torch.distributed.distributed_c10d as c10d

        import torch

        real = os.path.realpath(filename)
        kind = {os.path.realpath(c10d.__file__): "c10d",
                os.path.realpath(logger.__file__): "logger"}.get(real)
        if kind is None and (real in _SEE_THROUGH or real.startswith(_torch_dir(torch))):
            # a wrapper of ours, or torch's own (a __torch_function__ mode such as
            # `with torch.device(...)` re-enters isend through torch/overrides.py)
            kind = "wrapper"
        _KIND[filename] = kind
    return kind


def _caller(frame) -> tuple[str | None, list | None, int, bool]:
    """(the outermost distributed_c10d function on the stack above ``frame``, the
    P2POp list if one of them is batch_isend_irecv, this op's place in it, whether the
    outermost call asked for async_op). Torch's own frames are consecutive: the walk
    stops at the first frame outside torch (and the wrappers that see_through names)."""
    api, batch, index, async_op = None, None, 0, False
    f = frame
    while f is not None:
        kind = _kind(f.f_code.co_filename)
        if kind is None:
            break
        if kind == "c10d":
            api = f.f_code.co_name
            if "async_op" in f.f_code.co_varnames:
                async_op = f.f_locals.get("async_op", False)
            if api == "batch_isend_irecv":
                local = f.f_locals
                batch = list(local.get("p2p_op_list") or [])
                current = local.get("p2p_op")
                index = next((i for i, p in enumerate(batch) if p is current), 0)
        f = f.f_back
    return api, batch, index, async_op


_WORK: list = []   # the ObservedWork class, made once (torch is imported lazily)


def work(wait: Callable[[], None], done: Callable[[], bool]):
    """A torch Work whose wait() runs ``wait`` (and raises what it raises), for an
    observer's ``post`` that hands back a Work of its own."""
    if not _WORK:
        from torch._C._distributed_c10d import Work

        class ObservedWork(Work):
            def __init__(self, wait, done):
                super().__init__()
                self._wait, self._done = wait, done

            def wait(self, timeout=None):  # noqa: ARG002 - Work's signature
                self._wait()
                return True

            def is_completed(self):
                return self._done()

            def is_success(self):
                return self._done()
        _WORK.append(ObservedWork)
    return _WORK[0](wait, done)


__all__ = ["Call", "OPS", "add", "observing", "install", "see_through", "work",
           "flatten"]
