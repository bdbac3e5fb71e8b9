"""A flight recorder for collectives: which rank called what, from where, when.

What
----
A distributed bug rarely shows where it happens. A rank that skips one
``all_reduce`` does not fail: its *peers* wait in that all-reduce forever, and
the launch ends in a timeout that names everyone. The question is always the
same three: which rank, which collective, which state. A record of every
collective and point-to-point call on every rank answers the first two by
lookup: line the ranks' records up and the first call where they disagree is
the bug (``helpers.debug.diff`` does that).

``record_collectives()`` is a context manager used inside a rank function.
While it is active, the functions of ``torch.distributed`` listed in ``OPS``
are replaced by thin wrappers that log, per call, a :class:`CallRecord`:

* ``seq``: the call's number on this rank (0, 1, 2, ...),
* ``op``, the ``group`` (its global ranks) and the ``peer`` of a send/recv,
* ``shapes`` and ``dtypes`` of the tensor arguments,
* ``where``: the calling line of code outside libraries (a notebook cell is
  named as IPython names it: ``Cell In[5], line 12``), and if that line is
  inside the course's ``helpers``, also the learner's line that led there,
* ``start`` and ``end`` (``time.time()``; ``end`` is None while the call has
  not ended, which is what a hung call looks like), and ``outcome``: how it
  ended, ``"returned"`` or ``"raised RuntimeError"`` (a peer that went away,
  a size mismatch gloo caught). On CPU an ``async_op=True`` call "ends" when
  it returns its Work, not when the Work completes.

With gloo on CPU tensors a call that returned is done. With nccl on CUDA
tensors it is not: the call returns once the collective is queued on the GPU,
and a collective stuck waiting for a peer "returns" all the same. So on CUDA
the recorder keeps the call *scheduled* (``returned`` set, ``end`` None) until
a CUDA event recorded after it (``helpers.clock``) has completed, and only then
sets ``end``: ``end`` means completed, as in NCCL's flight recorder, and a call
that never completes reads as hung. For an ``async_op`` call the event cannot
tell (the current stream does not wait for the collective until ``wait()``):
its Work's ``is_completed()`` is polled instead. A small thread polls every
2 ms while calls are pending (``end`` is when it saw the completion); it never
blocks on the GPU.

On exit (also on an error) the original functions are put back.

Inside ``helpers.launch`` every call is also appended, as it starts and as it
ends, to a file per rank that the caller reads when the launch fails (one
``write()`` per event, in /dev/shm; it wakes no other process), so the record
survives the rank: a rank that hangs, raises or is killed has already written
what it was doing. That is why ``launch`` can end a ``RankTimeout`` or
``RankError`` with the cross-rank diff. ``launch(fn, n, record=True)`` records
the whole of ``fn``.

Cost
----
A Python wrapper, a walk up the stack to find the calling line, and one small
pickled record written per call start and end: tens of microseconds per call,
against milliseconds for a collective of a real model
(``benchmarks/bench_debug.py`` measures it on a DDP step).

How production differs
----------------------
PyTorch's NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE=N``) keeps the
last N collectives per rank in a ring buffer *inside the C++ process group*,
with the state of each (scheduled, started, completed); on a watchdog
timeout each rank dumps it to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` and
``torch/distributed/flight_recorder`` (``fr_trace``) lines the dumps up
across ranks, much as ``helpers.debug.diff`` does. It sees collectives issued
from C++ too (DDP's reducer, FSDP), which a Python wrapper like this one does
not, and it costs almost nothing since it never leaves the process until the
dump. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` instead checks, before each
collective, that all ranks agree on op and shapes (an extra gloo collective
per call), and fails at the first mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from helpers.clock import clock_for, completed
from helpers.launch.errors import cell_name, library_dirs
from helpers.launch import wire
from helpers.launch.hooks import rank_channel, register_option

__all__ = ["OPS", "CallRecord", "Recorder", "record_collectives", "recorded", "describe_where"]

# The functions of torch.distributed that are recorded. Point-to-point ops
# carry a peer; the others are collectives every rank of the group must call.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "barrier")
P2P = ("send", "recv", "isend", "irecv")
OPS = COLLECTIVES + P2P + ("batch_isend_irecv",)
# Argument that names the other side of a point-to-point call.
_PEER_ARG = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
_GROUP_PEER_ARG = {"send": "group_dst", "isend": "group_dst", "recv": "group_src",
                   "irecv": "group_src"}
# The root of a rooted collective: every rank must name the same one.
_ROOT_ARG = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}


@dataclasses.dataclass
class CallRecord:
    """One call of one rank. ``where`` is [(filename, line, function)], innermost first."""

    rank: int
    seq: int
    op: str
    group: tuple[int, ...]          # global ranks of the group
    peer: int | None                # global rank of the other side (p2p), else None
    shapes: tuple                   # one entry per tensor argument; a list -> tuple of shapes
    dtypes: tuple[str, ...]
    where: list[tuple[str, int, str]]
    start: float
    end: float | None = None        # when it completed (CPU: returned), time.time()
    async_op: bool = False
    world: int = 0                  # the default group's size (to tell a subgroup)
    root: int | None = None         # src/dst of broadcast, reduce, gather, scatter
    outcome: str | None = None      # "returned", "raised RuntimeError"; None: not ended
    returned: float | None = None   # when the host call returned, time.time()

    @property
    def state(self) -> str:
        """How the call ended, in words: returned, raised X, scheduled (returned,
        the GPU has not finished it) or never returned."""
        if self.end is not None:
            return self.outcome or "returned"
        return "never returned" if self.returned is None else "scheduled, not completed"

    @property
    def is_p2p(self) -> bool:
        return self.op in P2P

    def signature(self) -> tuple:
        """What every rank of a collective must agree on: op, group, root, shapes, dtypes."""
        return (self.op, self.group, self.root, self.shapes, self.dtypes)

    def describe(self) -> str:
        """``all_reduce [4] float32`` / ``send [2, 3] float32 to rank 1``."""
        def shape(s):
            if s and isinstance(s[0], tuple):  # a list of tensors
                inner = {shape(x) for x in s}
                return f"{len(s)}x{inner.pop()}" if len(inner) == 1 else \
                    "(" + ", ".join(shape(x) for x in s) + ")"
            return "[" + ", ".join(map(str, s)) + "]"

        text = " ".join([self.op] + [shape(s) for s in self.shapes])
        dtypes = sorted(set(self.dtypes))
        if dtypes:
            text += " " + "/".join(dtypes)
        if self.peer is not None:
            text += f" {'to' if self.op in ('send', 'isend') else 'from'} rank {self.peer}"
        if self.root is not None:
            text += f" {'from' if _ROOT_ARG[self.op] == 'src' else 'to'} rank {self.root}"
        if len(self.group) != self.world:
            text += f" in group {list(self.group)}"
        return text


# --------------------------------------------------------------------------
# Where was it called from? The first frames outside libraries.
# --------------------------------------------------------------------------

_HERE = os.path.dirname(os.path.realpath(__file__))          # helpers/debug
_HELPERS = os.path.dirname(_HERE)                             # helpers
_LAUNCH = os.path.join(_HELPERS, "launch") + os.sep                # the launcher package
_kind_cache: dict[str, str] = {}


def _kind(filename: str) -> str:
    """'skip' (a library, or the recorder/launcher), 'helpers', or 'user'."""
    kind = _kind_cache.get(filename)
    if kind is None:
        real = os.path.realpath(filename)
        if real.startswith(library_dirs()) or real.startswith(_HERE) or real.startswith(_LAUNCH) \
                or filename.startswith("<"):
            kind = "skip"
        elif real.startswith(_HELPERS + os.sep):
            kind = "helpers"
        else:
            kind = "user"
        _kind_cache[filename] = kind
    return kind


def _calling_lines(frame) -> list[tuple[str, int, str]]:
    """The innermost non-library frame, and if it is inside helpers, the
    innermost frame of the learner's own code too (a cell, a test, a script)."""
    found: list[tuple[str, int, str]] = []
    while frame is not None:
        code = frame.f_code
        kind = _kind(code.co_filename)
        if kind != "skip":
            if not found or kind == "user":
                found.append((code.co_filename, frame.f_lineno, code.co_name))
            if kind == "user":
                break
        frame = frame.f_back
    return found


def describe_where(where: list[tuple[str, int, str]]) -> str:
    """``Cell In[5], line 12`` (named as the caller's IPython names the cell),
    ``helpers/ddp/reducer.py:301 (from Cell In[5], line 12)``; '?' if unknown."""
    def one(filename, line):
        name = cell_name(filename, line)
        if name.startswith("File "):  # a file: shorter, relative where possible
            rel = os.path.relpath(filename) if os.path.isabs(filename) else filename
            name = f"{rel if not rel.startswith('..') else filename}:{line}"
        return name

    if not where:
        return "?"
    text = one(*where[0][:2])
    if len(where) > 1:
        text += f" (from {one(*where[-1][:2])})"
    return text


# --------------------------------------------------------------------------
# The recorder and the wrappers it installs.
# --------------------------------------------------------------------------

class Recorder:
    """The calls recorded on this rank (``.calls``, a list of CallRecord)."""

    def __init__(self):
        self.calls: list[CallRecord] = []
        self._sink = _caller_sink()  # writes for launch's caller, or None
        self._groups: dict[int, tuple[int, ...]] = {}
        self._pending: list[tuple[CallRecord, Any, str]] = []  # (record, mark or Work, outcome)
        self._pending_lock = threading.Lock()
        self._poller: threading.Thread | None = None

    def _group_ranks(self, group) -> tuple[int, ...]:
        key = id(group)
        ranks = self._groups.get(key)
        if ranks is None:
            pg = group if group is not None else c10d._get_default_group()
            ranks = tuple(dist.get_process_group_ranks(pg))
            self._groups[key] = ranks
        return ranks

    def begin(self, op: str, bound: dict, frame) -> CallRecord:
        group = bound.get("group")
        tensors = [v for k, v in bound.items() if k != "group"
                   and (isinstance(v, torch.Tensor) or _tensor_list(v))]
        shapes = tuple(tuple(v.shape) if isinstance(v, torch.Tensor)
                       else tuple(tuple(t.shape) for t in v) for v in tensors)
        dtypes = tuple(str(t.dtype).removeprefix("torch.")
                       for v in tensors for t in ([v] if isinstance(v, torch.Tensor) else v))
        peer = None
        if op in _PEER_ARG:
            peer = bound.get(_PEER_ARG[op])
            group_peer = bound.get(_GROUP_PEER_ARG[op])
            if peer is None and group_peer is not None:
                peer = self._group_ranks(group)[group_peer]
        rec = CallRecord(rank=dist.get_rank(), seq=_next_seq(), op=op,
                         group=self._group_ranks(group), peer=peer, shapes=shapes,
                         dtypes=dtypes, where=_calling_lines(frame), start=time.time(),
                         async_op=bool(bound.get("async_op")) or op in ("isend", "irecv"),
                         world=dist.get_world_size(), root=bound.get(_ROOT_ARG.get(op, "")))
        self.calls.append(rec)
        if self._sink is not None:
            self._sink(("call", rec))
        return rec

    def finish(self, rec: CallRecord, outcome: str = "returned", result: Any = None,
               device: torch.device | None = None) -> None:
        """The call returned (``result``: what it returned) or raised. On CUDA
        (``device``) it completes later: see the module docstring."""
        rec.returned = time.time()
        if device is None or device.type != "cuda" or outcome != "returned":
            self._complete(rec, outcome, rec.returned)
            return
        if self._sink is not None:  # scheduled: the caller's diff can tell it from unissued
            self._sink(("returned", rec.seq, rec.returned))
        works = [w for w in (result if isinstance(result, list) else [result])
                 if hasattr(w, "is_completed")]
        done = works if rec.async_op and works else [clock_for(device).mark()]
        with self._pending_lock:
            self._pending.append((rec, done, outcome))
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, daemon=True)
                self._poller.start()

    def wait_completed(self, poll: float = 0.002) -> None:
        """Block until the GPU has finished every call it had queued. With nccl a call
        that hangs on the GPU returns to the host all the same, and the rank function
        could return with it still queued (its result garbage or never produced).
        Waiting here makes the rank what it is on the GPU: one that does not finish,
        so the launch's timeout names it and the diff shows the call "scheduled, not
        completed". Nothing is pending on CPU, where this returns at once."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    return
            time.sleep(poll)

    def _complete(self, rec: CallRecord, outcome: str, end: float) -> None:
        rec.end, rec.outcome = end, outcome
        if self._sink is not None:
            self._sink(("end", rec.seq, rec.end, outcome))

    def _poll(self, interval: float = 0.002) -> None:
        """Mark pending calls completed as their events (or Works) complete."""
        while True:
            with self._pending_lock:
                if not self._pending:
                    self._poller = None
                    return
                still = []
                for rec, done, outcome in self._pending:
                    if all(_is_done(d) for d in done):
                        self._complete(rec, outcome, time.time())
                    else:
                        still.append((rec, done, outcome))
                self._pending = still
            time.sleep(interval)


def _is_done(d) -> bool:
    """A clock mark (CUDA event) or an async Work: finished on the GPU? Never blocks."""
    return d.is_completed() if hasattr(d, "is_completed") else completed(d)


def _device_of(bound: dict) -> torch.device | None:
    """The device of the call's first tensor argument (None: no tensor)."""
    for v in bound.values():
        for t in ([v] if isinstance(v, torch.Tensor) else v if _tensor_list(v) else []):
            return t.device
    return None


def _outcome(exc: BaseException | None) -> str:
    return "returned" if exc is None else f"raised {type(exc).__name__}"


def _tensor_list(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(t, torch.Tensor) for t in v)


def _caller_sink() -> Callable[[tuple], None] | None:
    """Inside a launch's rank: a function that records an event for the caller."""
    return rank_channel()


_SEQ = iter(range(sys.maxsize))
_next_seq = functools.partial(next, _SEQ)
_ACTIVE: list[Recorder] = []          # the recorder in use (nested contexts share it)
_LOCAL = threading.local()            # .busy: inside a recorded call (its inner calls are not)


def _wrap(op: str, original: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not _ACTIVE or getattr(_LOCAL, "busy", False):
            return original(*args, **kwargs)
        bound = sig.bind_partial(*args, **kwargs).arguments
        rec = _ACTIVE[-1].begin(op, bound, sys._getframe(1))
        _LOCAL.busy, failure, result = True, None, None
        try:
            result = original(*args, **kwargs)
            return result
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _LOCAL.busy = False
            _ACTIVE[-1].finish(rec, _outcome(failure), result, _device_of(bound))
    return wrapper


def _wrap_batch(original: Callable) -> Callable:
    """batch_isend_irecv: one record per isend/irecv in the batch."""
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        if not _ACTIVE or getattr(_LOCAL, "busy", False):
            return original(p2p_op_list)
        frame = sys._getframe(1)
        recs = [_ACTIVE[-1].begin(getattr(p.op, "__name__", "p2p"),
                                  {"tensor": p.tensor, "group": p.group,
                                   _PEER_ARG.get(getattr(p.op, "__name__", ""), "peer"): p.peer},
                                  frame) for p in p2p_op_list]
        _LOCAL.busy, failure, result = True, None, None
        try:
            result = original(p2p_op_list)
            return result
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _LOCAL.busy = False
            device = p2p_op_list[0].tensor.device if p2p_op_list else None
            for rec in recs:
                _ACTIVE[-1].finish(rec, _outcome(failure), result, device)
    return wrapper


_WRAPPERS: dict[str, tuple[Callable, Callable]] = {}  # op -> (original, wrapper), built once


def _install() -> list[tuple[Any, str, Any]]:
    """Replace the ops in torch.distributed; what to put back. isend and irecv
    are replaced in distributed_c10d as well, since P2POp accepts only the
    functions found there (and batch_isend_irecv calls them). The wrappers are
    built once per process (reading a signature costs ~0.1 ms per op), so
    entering the recorder every step costs only the assignments."""
    saved = []
    for op in OPS:
        current = getattr(dist, op)
        original, wrapper = _WRAPPERS.get(op, (None, None))
        if original is not current:  # first use (or torch.distributed was patched by others)
            wrapper = _wrap_batch(current) if op == "batch_isend_irecv" else _wrap(op, current)
            _WRAPPERS[op] = (current, wrapper)
        targets = [dist] + ([c10d] if op in ("isend", "irecv") else [])
        for module in targets:
            saved.append((module, op, getattr(module, op)))
            setattr(module, op, wrapper)
    return saved


@contextlib.contextmanager
def record_collectives() -> Iterator[Recorder]:
    """Record every call of ``OPS`` made while active (see the module docstring).

    ``with record_collectives() as rec: ...`` then ``rec.calls``. Nested uses
    share the outer recorder. The original functions are restored on exit,
    also when the body raises. On a normal exit it first waits until the GPU has
    completed every recorded call (``Recorder.wait_completed``).
    """
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    recorder = Recorder()
    saved = _install()
    _ACTIVE.append(recorder)
    try:
        yield recorder
        recorder.wait_completed()  # (a normal exit only: an error is reported as it is)
    finally:
        _ACTIVE.clear()
        for module, op, original in reversed(saved):
            setattr(module, op, original)


def _run_recorded(fn: Callable, *args, **kwargs):
    with record_collectives():
        return fn(*args, **kwargs)


def recorded(fn: Callable) -> Callable:
    """``fn`` run inside ``record_collectives()`` (what ``launch(record=True)`` ships)."""
    return functools.partial(_run_recorded, fn)


register_option("record", recorded)  # launch(fn, n, record=True)
# its wrappers stand between torch's batch_isend_irecv and isend: the wire (which NCCL's
# rules and the checks' spy watch) must still see a batched isend as batched
wire.see_through(__file__)
