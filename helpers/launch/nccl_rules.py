"""NCCL's rules on CPU ranks: what a GPU node would hang on or refuse, shown under gloo.

Why
---
A laptop and CI run the course on gloo with CPU tensors. A GPU node runs the same
rank functions on nccl, and nccl is stricter in ways that change the outcome:
code that gloo runs happily can hang there, or stop with an error. Without a GPU
nobody would see it. ``launch(fn, n, nccl_rules=True)``, or ``COURSE_NCCL_RULES=1``
in the environment (for a whole test run or notebook), keeps gloo and CPU tensors
but makes ``torch.distributed`` behave as ``ProcessGroupNCCL`` does wherever that
changes what happens. ``rank_info().nccl_rules`` says whether it is on.

The rules
---------
Each follows torch's own source, read for torch 2.13.0 (the installed
``torch/distributed/distributed_c10d.py``, the headers under
``torch/include/torch/csrc/distributed/c10d/``, and ``ProcessGroupNCCL.cpp`` of
the same period); the same code paths exist in torch 2.11 (the eager-init branch
of rule 1 dates from June 2025, before 2.11).

1. **A lone send or receive creates a two-rank communicator, and both ranks must
   join it.** ``ProcessGroupNCCL::pointToPoint``: a ``send``/``recv``/``isend``/
   ``irecv`` outside ``batch_isend_irecv`` on a group initialised lazily (no
   ``device_id`` at ``init_process_group``, as ``launch`` does) uses a communicator
   keyed ``"low:high"`` for the pair, created at the pair's first such call by
   ``initNCCLComm``: the lower rank publishes the NCCL id through the store
   (``broadcastUniqueNCCLID``), the higher one waits for it, and both block in
   ``ncclCommInitRankConfig`` (blocking by default: ``TORCH_NCCL_USE_COMM_NONBLOCKING``
   is off) until both have called. So the host call blocks until the peer makes
   its own first lone call *with this rank*. A ring of lone calls (every rank
   sends right, then receives left) at p >= 3 is a cycle of ranks each waiting for
   the next: it hangs, however small the messages. Here: the first lone call of
   a pair waits in the store for the peer's, for as long as nccl would (until the
   launch's timeout, whose message names the cycle).
2. **A group's own communicator needs every rank of the group the first time.**
   Collectives and ``batch_isend_irecv`` use the group-wide communicator
   (``pointToPoint`` with ``ncclActiveGroupCounter_ > 0`` takes the device key,
   like a collective), created at its first use by all ranks of the group; the
   ``batch_isend_irecv`` docstring: if it is the first collective call in the
   group, all ranks of the group must participate. Here: a batch on a group that
   has run no collective yet waits until every rank of the group reaches one.
   (Whether a collective ran is read from the group's sequence number, which
   counts collectives torch issues from C++ too, as DDP's.)
3. **``monitored_barrier`` is gloo's alone.** ``distributed_c10d.monitored_barrier``
   raises ``ValueError("monitored_barrier is only implemented for GLOO backend.")``
   unless the group was created with ``backend="gloo"``; a GPU job's default group
   is ``"cpu:gloo,cuda:nccl"`` and is refused too. Here: refused on any group not
   made by ``new_group(..., backend="gloo")``.
4. **Data types nccl has no type for.** ``getNcclDataType`` maps int8, uint8,
   int32, int64, float16, bfloat16, float32, float64, bool (as uint8) and the
   float8 types; anything else raises ``TypeError: Input tensor data type is not
   supported for NCCL process group: <type>`` (uint16/32/64, int16, float8_e8m0fnu,
   and complex types in the calls whose Python side does not view them as real
   pairs first: reduce, gather, reduce_scatter, reduce_scatter_tensor).
5. **No bitwise reductions.** ``getNcclReduceOp``: ``ReduceOp.BAND``/``BOR``/``BXOR``
   raise ``ValueError: Cannot use ReduceOp.BAND with NCCL`` (gloo allows them on
   integers).
6. **No receive from any source.** ``ProcessGroupNCCL::recvAnysource`` raises
   ``NotImplementedError("ProcessGroupNCCL does not support recvAnysource")``;
   ``recv(t)`` without ``src`` needs it.
7. **Tags are ignored.** ``ProcessGroupNCCL::send``/``recv`` take the tag as an
   unused argument: two messages between the same pair match in the order they
   were posted, whatever their tags (gloo matches by tag). Here: every tag is 0.
What it cannot show (only a GPU does)
-------------------------------------
* **The host returns before the data is there.** An nccl collective with
  ``async_op=False`` is queued on the current CUDA stream and returns at once;
  ``work.wait()`` makes the stream wait, not the host. Values read through torch
  (``.item()``, ``.cpu()``) are still right, since they wait for the stream; what
  goes wrong is a host clock around the call (``helpers.clock`` times with CUDA
  events; ``tests/test_notebook_clock.py`` scans the notebooks for host clocks).
  gloo's CPU work cannot be made to return early.
* **Mismatched collectives.** Ranks calling different collectives, or the same
  with other sizes: gloo raises or aborts the rank (SIGABRT) at once; nccl checks
  nothing and hangs until its watchdog kills the process (10 minutes by
  default) or completes with garbage. Which one depends on sizes and algorithms,
  so it is not reproduced; the course's collective recorder
  (``launch(..., record=True)``, chapter 18) compares the ranks' calls instead,
  which works on both.
* **Stream order.** ``launch`` initialises nccl lazily (chapter 03 says why);
  with ``device_id`` (eager init) lone sends and receives would share the group's
  one stream and could hang on the GPU depending on message sizes. Not emulated:
  the course posts exchanges through ``batch_isend_irecv``, which both accept.
* **One Work for a whole batch.** With nccl, ``batch_isend_irecv`` returns a list
  holding *one* Work for the whole batch (``_coalescing_manager``); gloo returns one
  per operation, so code that unpacks ``send_req, recv_req = batch_isend_irecv(...)``
  works on gloo only. Returning one Work here would not be faithful: on nccl its
  ``wait()`` orders the CUDA stream and the host goes on, while a gloo Work blocks
  the host until the whole batch is done. Code written for nccl (the pipeline
  executor maps that one Work to every operation of the batch, and waits for a send
  it has proved delivered) would then wait on the host for a receive that nccl's
  stream alone waits for, and stall where a GPU does not. So gloo's list stands;
  ``helpers.pipeline.p2p.post`` shows how to handle both.
* **Uneven ``all_gather`` lists, PREMUL_SUM and float8 reductions**, which nccl
  accepts and gloo refuses: gloo's refusal stands.
* Collectives torch issues from C++ (DDP's reducer, functional collectives) pass
  no Python function, so rules 4 and 5 see only Python calls; torch's own code
  obeys them already.

Cost: a Python wrapper per call (microseconds), and one store round trip per
pair and per group at first use.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
import threading
import traceback
from typing import Any, Callable

from helpers.launch import hooks
from helpers.launch.errors import cell_name, library_dirs

ENV = "COURSE_NCCL_RULES"

# torch.distributed's point-to-point calls, and the collectives whose tensors and
# reduce op are checked (rules 4 and 5; every one of them also creates the group's
# communicator, rule 2).
P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "barrier", "all_reduce_coalesced")

# Rule 4: the dtypes getNcclDataType maps (torch 2.13, NCCLUtils), by name so that
# a torch without one of them still imports this module.
NCCL_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32",
               "float64", "bool", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
               "float8_e4m3fnuz")
# C++ ScalarType names, as nccl's message prints them
_SCALAR_NAMES = {"uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "int16": "Short",
                 "complex32": "ComplexHalf", "complex64": "ComplexFloat",
                 "complex128": "ComplexDouble", "float8_e8m0fnu": "Float8_e8m0fnu"}


def requested(flag: bool | None) -> bool:
    """What ``launch(..., nccl_rules=flag)`` means: the flag, or the environment's."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


# --------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------

class _Rules:
    """One rank's view: which communicators exist, which groups are gloo's own."""

    def __init__(self, store, timeout: float):
        self.store = store
        self.timeout = datetime.timedelta(seconds=timeout)
        self.pairs: set[tuple[str, int, int]] = set()     # (group, low, high) joined
        self.lone: dict[str, int] = {}                      # group -> lone p2p ops posted
        self.groups: set[str] = set()                       # groups whose communicator exists
        self.gloo_groups: set[str] = set()                  # made with backend="gloo"
        self.local = threading.local()  # .batch: in batch_isend_irecv; .p2p: in a p2p call
        self.channel = hooks.rank_channel()


_RULES: _Rules | None = None


def install(store, timeout: float) -> None:
    """Called once in a rank, after ``init_process_group``: replace the functions of
    ``torch.distributed`` the rules apply to (and ``distributed_c10d``'s isend and
    irecv, which ``P2POp`` checks its op against). ``store``: the launch's store."""
    global _RULES
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _RULES = _Rules(store, timeout)
    for name in P2P:
        _replace(dist, c10d, name, _p2p(name, getattr(c10d, name)))
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            _replace(dist, c10d, name, _collective(name, getattr(c10d, name)))
    _replace(dist, c10d, "batch_isend_irecv", _batch(c10d.batch_isend_irecv))
    _replace(dist, c10d, "monitored_barrier", _monitored_barrier(c10d.monitored_barrier))
    _replace(dist, c10d, "new_group", _new_group(c10d.new_group))


def _replace(dist, c10d, name: str, wrapper: Callable) -> None:
    setattr(c10d, name, wrapper)
    setattr(dist, name, wrapper)


def _group_of(group):
    import torch.distributed.distributed_c10d as c10d

    return group if group is not None else c10d._get_default_group()


def _name(group) -> str:
    return _group_of(group).group_name


# The calls whose Python layer hands a complex tensor to the backend as real pairs
# (torch.view_as_real in torch 2.13's distributed_c10d: isend/irecv, so send/recv too,
# broadcast, all_reduce, all_reduce_coalesced, all_gather, all_gather_into_tensor,
# scatter, all_to_all, all_to_all_single): complex is fine there on nccl. reduce,
# gather, reduce_scatter and reduce_scatter_tensor pass it on as it is.
VIEWS_COMPLEX_AS_REAL = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce",
                         "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
                         "scatter", "all_to_all", "all_to_all_single")


def _check_dtypes(tensors, call: str) -> None:
    """Rule 4, for the tensors of the call ``call``."""
    import torch

    for t in tensors:
        if not isinstance(t, torch.Tensor) or (t.is_complex() and call in VIEWS_COMPLEX_AS_REAL):
            continue
        name = str(t.dtype).removeprefix("torch.")
        if name not in NCCL_DTYPES:
            raise TypeError(f"Input tensor data type is not supported for NCCL process group: "
                            f"{_SCALAR_NAMES.get(name, name)}  [nccl_rules: gloo accepts "
                            f"{name} where it has a type for it; nccl has none]")


def _check_op(op) -> None:
    """Rule 5."""
    import torch.distributed as dist

    for bad in ("BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, bad):
            raise ValueError(f"Cannot use ReduceOp.{bad} with NCCL  [nccl_rules]")


def _tensors_in(values) -> list:
    import torch

    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
            out += [t for inner in v if isinstance(inner, (list, tuple))
                    for t in inner if isinstance(t, torch.Tensor)]
    return out


_HELPERS = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
# Wrappers that sit between a call and torch.distributed (the checks' spy, the
# collective recorder, these rules): never the line to show.
_WRAPPERS = tuple(os.path.join(_HELPERS, *parts) for parts in
                  (("launch", ""), ("checks", "spy.py"), ("debug", "recorder.py")))


def _call_site() -> tuple[tuple[str, int], ...]:
    """Where the call came from: the innermost frame outside torch and the wrappers,
    and if that is inside ``helpers``, also the innermost one outside it (the learner's)."""
    lib = library_dirs()
    found: list[tuple[str, int]] = []
    for f in reversed(traceback.extract_stack(sys._getframe(2))):
        real = os.path.realpath(f.filename)
        if real.startswith(lib) or real.startswith(_WRAPPERS):
            continue
        if not found or not real.startswith(_HELPERS):
            found.append((f.filename, f.lineno or 0))
        if not real.startswith(_HELPERS):
            break
    return tuple(found[:1] + found[-1:]) if len(found) > 1 else tuple(found)


def _where(site: tuple[tuple[str, int], ...]) -> str:
    """' at Cell In[3], line 4' or ' at helpers/x.py:12 (from Cell In[3], line 4)', in the
    caller (where IPython can name a notebook cell)."""
    if not site:
        return ""
    text = f" at {cell_name(*site[0])}"
    return text + (f" (from {cell_name(*site[1])})" if len(site) > 1 else "")


def _meet(kind: str, key: str, me: int, others: list[int], what: str) -> None:
    """Block until every rank in ``others`` has arrived at ``key`` too (NCCL's
    communicator creation). The wait is written to the rank's record channel first,
    so that a launch that times out here can say who waited for whom."""
    rules = _RULES
    site = _call_site()
    if rules.channel is not None:
        rules.channel(("nccl_rules", "wait", kind, key, me, tuple(others), what, site))
    rules.store.set(f"ncclrules/{key}/{me}", "1")
    rules.store.wait([f"ncclrules/{key}/{r}" for r in others], rules.timeout)
    if rules.channel is not None:
        rules.channel(("nccl_rules", "joined", kind, key, me))


def _p2p(name: str, original: Callable) -> Callable:
    """Rules 1, 4, 6, 7 for send / recv / isend / irecv."""
    sig = inspect.signature(original)
    peer_arg, group_peer_arg = ("dst", "group_dst") if name in ("send", "isend") else \
        ("src", "group_src")

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        # torch 2.13's blocking send/recv post through the module's isend/irecv, which are
        # wrapped too: the inner call is the same operation, checked once
        if getattr(_RULES.local, "p2p", False):
            return original(*args, **kwargs)
        _RULES.local.p2p = True
        try:
            return _checked(*args, **kwargs)
        finally:
            _RULES.local.p2p = False

    def _checked(*args, **kwargs):
        import torch.distributed as dist

        rules = _RULES
        bound = sig.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        peer = bound.arguments.get(peer_arg)
        if peer is None and bound.arguments.get(group_peer_arg) is not None:
            peer = dist.get_global_rank(_group_of(group), bound.arguments[group_peer_arg])
        if peer is None and name in ("recv", "irecv"):
            raise NotImplementedError("ProcessGroupNCCL does not support recvAnysource  "
                                      "[nccl_rules: name the source rank, recv(t, src=...)]")
        _check_dtypes([bound.arguments.get("tensor")], name)
        if "tag" in bound.arguments:
            bound.arguments["tag"] = 0  # rule 7
        if not getattr(rules.local, "batch", False):
            me, gname = dist.get_rank(), _name(group)
            rules.lone[gname] = rules.lone.get(gname, 0) + 1
            low, high = sorted((me, peer))
            if peer != me and (gname, low, high) not in rules.pairs:
                _meet("pair", f"pair/{gname}/{low}:{high}", me, [peer],
                      f"{name} {'to' if peer_arg == 'dst' else 'from'} rank {peer}")
                rules.pairs.add((gname, low, high))
        return original(*bound.args, **bound.kwargs)
    return wrapper


def _collective(name: str, original: Callable) -> Callable:
    """Rules 4 and 5; the group's communicator exists from now on (rule 2)."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        _check_dtypes(_tensors_in(v for k, v in bound.items() if k != "group"), name)
        if "op" in bound:
            _check_op(bound["op"])
        _RULES.groups.add(_name(bound.get("group")))
        return original(*args, **kwargs)
    return wrapper


def _batch(original: Callable) -> Callable:
    """Rule 2, and the batch's sends and receives exempt from rule 1."""
    @functools.wraps(original)
    def wrapper(p2p_op_list):
        import torch.distributed as dist

        rules = _RULES
        if not p2p_op_list:
            return original(p2p_op_list)
        group = _group_of(p2p_op_list[0].group)
        gname = group.group_name
        if gname not in rules.groups:
            # Has any collective run on the group (from C++ too, as DDP's)? gloo counts
            # every operation in the sequence number, lone sends and receives included.
            if group._get_sequence_number_for_group() > rules.lone.get(gname, 0):
                rules.groups.add(gname)
            else:
                members = dist.get_process_group_ranks(group)
                me = dist.get_rank()
                _meet("group", f"group/{gname}", me, [r for r in members if r != me],
                      f"batch_isend_irecv, the first use of the group's communicator "
                      f"(group of ranks {members})")
                rules.groups.add(gname)
        for op in p2p_op_list:
            _check_dtypes([op.tensor], "isend")
        rules.local.batch = True
        try:
            return original(p2p_op_list)
        finally:
            rules.local.batch = False
    return wrapper


def _monitored_barrier(original: Callable) -> Callable:
    """Rule 3."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        group = sig.bind(*args, **kwargs).arguments.get("group")
        if _name(group) not in _RULES.gloo_groups:
            raise ValueError("monitored_barrier is only implemented for GLOO backend.  "
                             "[nccl_rules: on a GPU node the default group is "
                             "'cpu:gloo,cuda:nccl'; make a gloo group for it: "
                             "dist.new_group(backend='gloo')]")
        return original(*args, **kwargs)
    return wrapper


def _new_group(original: Callable) -> Callable:
    """Remembers the groups created with backend="gloo" (rule 3 allows them)."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = sig.bind(*args, **kwargs).arguments.get("backend")
        if backend is not None and str(backend).lower() == "gloo" and \
                hasattr(group, "group_name"):
            _RULES.gloo_groups.add(group.group_name)
        return group
    return wrapper


# --------------------------------------------------------------------------
# In the caller: what a launch that hung under the rules was waiting for
# --------------------------------------------------------------------------

def waiting(events: dict[int, list[tuple]]) -> dict[int, tuple]:
    """rank -> its unfinished communicator wait ("wait" event without "joined")."""
    out = {}
    for rank, evs in events.items():
        open_waits = {}
        for ev in evs:
            if ev[0] != "nccl_rules":
                continue
            if ev[1] == "wait":
                open_waits[ev[3]] = ev
            elif ev[1] == "joined":
                open_waits.pop(ev[3], None)
        if open_waits:
            out[rank] = list(open_waits.values())[-1]
    return out


def explain(events: dict[int, list[tuple]]) -> str | None:
    """Why the ranks hung, when they hung creating nccl communicators."""
    stuck = waiting(events)
    if not stuck:
        return None
    lines = ["Under NCCL's rules (nccl_rules=True), ranks were blocked creating NCCL "
             "communicators, as they would on a GPU node:"]
    pairs = False
    for rank, ev in sorted(stuck.items()):
        _, _, kind, _, me, others, what, site = ev
        where = _where(site)
        if kind == "pair":
            pairs = True
            lines.append(f"  rank {me}: its first lone {what}{where} waits for rank "
                         f"{others[0]} to join their two-rank communicator")
        else:
            lines.append(f"  rank {me}: {what}{where} waits for ranks {list(others)}")
    if pairs:
        lines.append("A lone send/recv/isend/irecv creates a communicator for its pair of "
                     "ranks at the pair's first such call, and blocks until both ranks call "
                     "(torch's ProcessGroupNCCL::pointToPoint); ranks waiting for each other "
                     "in a circle never get there. Post each step's sends and receives "
                     "together with dist.batch_isend_irecv([P2POp(...), ...]).")
    else:
        lines.append("The first batch_isend_irecv on a group creates the group's "
                     "communicator and needs every rank of the group (torch's "
                     "batch_isend_irecv docstring); run a collective on the group first, "
                     "or include every rank in that first batch.")
    return "\n".join(lines)


def report_failure(err, events: dict[int, list[tuple]], status: dict[int, str]) -> None:
    """The launch's failure report (helpers.launch.hooks): say which communicator each
    stuck rank was waiting to create."""
    text = explain(events)
    if text:
        err.nccl_rules = text
        err.args = (f"{err.args[0]}\n\n{text}",) + err.args[1:]


hooks.register_failure_report(report_failure)


__all__ = ["ENV", "install", "requested", "explain", "waiting"]
