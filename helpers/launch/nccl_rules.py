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
   ``barrier()`` and the object collectives (``all_gather_object``,
   ``broadcast_object_list``, ...) do not count: on a node's ``"cpu:gloo,cuda:nccl"``
   group they run on gloo (``_get_object_coll_device``, ``barrier``'s device choice)
   and create no nccl communicator. A first collective blocks the host the same way,
   ``async_op=True`` or not: ranks that start groups in a circle (each its first
   collective on one group, asynchronously, then on the next) hang there.
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
   were posted, whatever their tags (gloo matches by tag). Here: every tag of a
   batched call is 0 and of a lone call 1 (rule 9 says why).
8. **A pair's lone calls share one stream, and a send waits for its receive.**
   ``pointToPoint`` runs a lone call on the stream of the pair's communicator
   (``key = getKeySendRecv(rank_, peer)``, ``ncclStreams_[key]``): a rank's lone
   sends and receives with one peer run one after the other, in posting order, in
   both directions. ``ncclSend`` "is blocking for the GPU" (NCCL user guide): it
   finishes only when the peer's stream runs the matching ``ncclRecv`` (small messages
   may slip through NCCL's buffers, NVIDIA/nccl#1456, large ones do not, #479, #783;
   a program that works only for small messages is wrong). So two ranks that each
   ``isend`` to the other and then ``irecv`` hang: each receive waits on its stream
   behind a send that waits for it. Here: every lone call of a pair runs on a thread
   of its own for the pair (the stream), in posting order; a lone send goes out only
   once the peer's stream has reached the matching lone receive. The host does not
   wait (``isend`` returns at once, as on a GPU); ``wait()`` does.
   ``helpers.pipeline.p2p.stream_model`` plays the same rule on a schedule's calls
   without running them; ``tests/test_nccl_rules.py`` checks that both agree.
9. **Lone and batched calls never meet.** A ``batch_isend_irecv`` runs on the
   group's communicator, a lone call on the pair's: a lone send never matches a
   batched receive (``stream_model`` says so too). Here: their gloo tags differ.
10. **One Work for a whole batch.** nccl coalesces a batch into one handle
   (``_coalescing_manager(..., async_ops=True)``): ``batch_isend_irecv`` returns a
   list of *one* Work, so ``send_req, recv_req = dist.batch_isend_irecv(...)`` raises
   on a node. Here the list holds one Work too, which waits for the whole batch
   (``helpers.pipeline.p2p.post`` shows how to handle both).
11. **Tensors must be contiguous.** ``ProcessGroupNCCL``'s ``check_gpu_single_tensor``
   raises ``ValueError("Tensors must be contiguous")`` for a non-contiguous input of a
   collective or a send or receive; gloo copies it. Here: the same ``ValueError``.
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
* **Eager initialisation.** ``launch`` initialises nccl lazily (chapter 03 says why).
  With ``device_id`` (eager), a lone call goes on the group's communicator and stream
  instead of the pair's, and a first lone send blocks in connection setup until the
  peer posts its receive (NCCL 2.30's ``ncclTransportP2pSetup``), at any size. Not
  emulated: the launcher never initialises eagerly.
* **A buffer on the wrong device.** On a node, a tensor made without the rank's
  device (``torch.empty(k)``) is a CPU tensor, and its send or receive goes to gloo
  while the peer's CUDA tensor goes to nccl: the two never meet. Here every tensor is
  on the CPU, so the rules cannot see it. Chapter 03's check shows it another way: the
  learner's ring runs with "meta" as the default device, apart from the data's as on a
  node, and the checks' spy refuses a message on another device than the data's
  (``communication_spy(device=...)``); ``make test-gpu`` runs the lab checks on nccl
  where a node has a GPU per rank.
* **Where a hang ends.** A wait to create a communicator (rules 1 and 2) is not an
  nccl operation, so NCCL's watchdog (``TORCH_NCCL_...``, 10 minutes) never sees it:
  on a node, and here, the launch's own timeout ends it.
* **Uneven ``all_gather`` lists, PREMUL_SUM and float8 reductions**, which nccl
  accepts and gloo refuses: gloo's refusal stands.
* Collectives torch issues from C++ (DDP's reducer, functional collectives) never
  reach a Python method of the process group, so rules 4 and 5 see only calls made
  from Python; torch's own code obeys them already.

Cost: a Python wrapper per call (microseconds), one store round trip per pair and
per group at first use, and one per lone send (rule 8).
"""

from __future__ import annotations

import collections
import datetime
import functools
import inspect
import os
import queue
import sys
import threading
import traceback
from typing import Callable

from helpers.launch import hooks, wire
from helpers.launch.errors import library_dirs

ENV = "COURSE_NCCL_RULES"

# Rule 4: the dtypes getNcclDataType maps (torch 2.13, NCCLUtils), by name so that
# a torch without one of them still imports this module. (torch's Python layer views a
# complex tensor as real pairs before handing it to the group in most calls, so the
# rule sees complex only where nccl would: reduce, gather, reduce_scatter.)
NCCL_DTYPES = ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32",
               "float64", "bool", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
               "float8_e4m3fnuz")
# C++ ScalarType names, as nccl's message prints them
_SCALAR_NAMES = {"uint16": "UInt16", "uint32": "UInt32", "uint64": "UInt64", "int16": "Short",
                 "complex32": "ComplexHalf", "complex64": "ComplexFloat",
                 "complex128": "ComplexDouble", "float8_e8m0fnu": "Float8_e8m0fnu"}
# Rule 2: the functions that a node runs on gloo ("cpu:gloo,cuda:nccl"), creating no
# nccl communicator.
ON_GLOO_ON_A_NODE = ("barrier", "monitored_barrier", "all_gather_object",
                     "broadcast_object_list", "gather_object", "scatter_object_list",
                     "send_object_list", "recv_object_list")
# Rules 7 and 9: the gloo tag of every batched and of every lone point-to-point call.
BATCH_TAG, LONE_TAG = 0, 1


def requested(flag: bool | None, backend: str = "auto") -> bool:
    """What ``launch(..., nccl_rules=flag, backend=backend)`` means: the flag, or the
    environment's. The environment's switch stands for "run as a GPU node would", and a
    node runs a launch that asks for ``backend="gloo"`` on gloo: no rules there."""
    if flag is not None:
        return bool(flag)
    if str(backend).lower() == "gloo":
        return False
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


# --------------------------------------------------------------------------
# Inside a rank
# --------------------------------------------------------------------------

class _Stream:
    """One pair's stream on this rank (rule 8): its lone calls run one after another,
    in posting order, on a thread of their own; the host does not wait for them."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            self.jobs.get()()


class _Rules:
    """One rank's view (the wire's observer): which communicators exist, which groups
    are gloo's own, each pair's stream."""

    def __init__(self, store, timeout: float):
        self.store = store
        self.timeout = datetime.timedelta(seconds=timeout)
        self.pairs: set[tuple[str, int, int]] = set()     # (group, low, high) joined
        self.uncounted: collections.Counter = collections.Counter()  # group -> ops that
                                                            # create no communicator
        self.groups: set[str] = set()                       # groups whose communicator exists
        self.gloo_groups: set[str] = set()                  # made with backend="gloo"
        self.streams: dict[tuple[str, int, int], _Stream] = {}
        self.posted: collections.Counter = collections.Counter()  # (group, peer, op) ->
                                                            # lone calls posted
        self.batch_works: list = []
        self.channel = hooks.rank_channel()

    # -- the wire's observer ------------------------------------------------
    def before(self, call: wire.Call) -> None:
        if call.op in wire.P2P:
            self._p2p(call)
        elif call.op == "monitored_barrier":
            self._monitored_barrier(call)
        else:
            self._collective(call)

    def post(self, call: wire.Call, post: Callable):
        if call.op not in wire.P2P:
            return post()
        if call.batched:
            return self._post_batched(call, post)
        return self._post_lone(call, post)

    # -- the rules ------------------------------------------------------------
    def _p2p(self, call: wire.Call) -> None:
        """Rules 1, 2 (a batch's first use of the group), 4, 6, 7."""
        if call.method == "recv_anysource":
            raise NotImplementedError("ProcessGroupNCCL does not support recvAnysource  "
                                      "[nccl_rules: name the source rank, recv(t, src=...)]")
        _check_dtypes(call.tensors)
        _check_contiguous(call)
        call.args[2] = BATCH_TAG if call.batched else LONE_TAG
        gname = call.group.group_name
        if call.batched:
            if call.first_in_batch:
                self.batch_works = []
                self._first_batch(call, gname)
            return
        self.uncounted[gname] += 1
        me, peer = call.rank, call.peer
        low, high = sorted((me, peer))
        if peer != me and (gname, low, high) not in self.pairs:
            what = f"{call.api} {'to' if call.op == 'send' else 'from'} rank {peer}"
            self._meet("pair", f"pair/{gname}/{low}:{high}", me, [peer], what)
            self.pairs.add((gname, low, high))

    def _first_batch(self, call: wire.Call, gname: str) -> None:
        """Rule 2: a batch on a group whose communicator does not exist yet waits for
        every rank of the group."""
        if gname in self.groups:
            return
        # Has a collective run on the group from C++ (DDP's broadcast)? gloo counts every
        # operation in the sequence number; the rules counted those that create nothing.
        if call.group._get_sequence_number_for_group() > self.uncounted[gname]:
            self.groups.add(gname)
            return
        members = list(call.ranks)
        me = call.rank
        self._meet("group", f"group/{gname}", me, [r for r in members if r != me],
                   f"batch_isend_irecv, the first use of the group's communicator "
                   f"(group of ranks {members})")
        self.groups.add(gname)

    def _collective(self, call: wire.Call) -> None:
        """Rules 2, 4, 5 and 11."""
        _check_dtypes(wire.flatten(call.args))
        _check_contiguous(call)
        for arg in call.args:
            if hasattr(arg, "reduceOp"):
                _check_op(arg.reduceOp)
        gname = call.group.group_name
        if call.api in ON_GLOO_ON_A_NODE:
            self.uncounted[gname] += 1
        elif gname not in self.groups:
            # the group's first nccl collective creates its communicator: the host waits
            # for every rank of the group, even for an async_op=True call
            me, members = call.rank, list(call.ranks)
            self._meet("group", f"group/{gname}", me, [r for r in members if r != me],
                       f"{call.api}, the first use of the group's communicator (group of "
                       f"ranks {members})")
            self.groups.add(gname)

    def _monitored_barrier(self, call: wire.Call) -> None:
        """Rule 3."""
        if call.group.group_name not in self.gloo_groups:
            raise ValueError("monitored_barrier is only implemented for GLOO backend.  "
                             "[nccl_rules: on a GPU node the default group is "
                             "'cpu:gloo,cuda:nccl'; make a gloo group for it: "
                             "dist.new_group(backend='gloo')]")
        self.uncounted[call.group.group_name] += 1

    def _post_batched(self, call: wire.Call, post: Callable):
        """Rule 10: one Work for the batch. torch's batch_isend_irecv keeps only the
        Works that are not None: every operation but the last returns None."""
        self.batch_works.append(post())
        if call.index < len(call.batch) - 1:
            return None
        works, self.batch_works = self.batch_works, []

        def wait():
            # gloo's Work may be waited once: the second wait() of a send blocks
            # (torch 2.13), and the batch's one Work is waited once per operation
            while works:
                works[0].wait()
                works.pop(0)
        return wire.work(wait, lambda: all(w.is_completed() for w in works))

    def _post_lone(self, call: wire.Call, post: Callable):
        """Rule 8: on the pair's stream, in posting order; a send goes out once the
        peer's stream has reached the matching receive."""
        import torch

        gname, me, peer = call.group.group_name, call.rank, call.peer
        low, high = sorted((me, peer))
        stream = self.streams.get((gname, low, high))
        if stream is None:
            stream = self.streams[(gname, low, high)] = _Stream(f"nccl-pair-{low}:{high}")
        sending = call.op == "send"
        count = (gname, peer, call.op)
        j = self.posted[count]          # this call's place among the pair's lone ones
        self.posted[count] += 1
        src, dst = (me, peer) if sending else (peer, me)
        key = f"stream/{gname}/{src}>{dst}/{j}"
        what = f"lone {call.api} {'to' if sending else 'from'} rank {peer}"
        site = _call_site()
        future = torch.futures.Future()

        def run():
            try:
                if sending:   # wait until the peer's stream runs the matching receive
                    self._meet("stream", key, me, [peer], what, site=site, mine=False)
                else:         # this stream has reached the receive: the peer may send
                    self.store.set(f"ncclrules/{key}/{me}", "1")
                    self._event("wait", "recv", key, me, (peer,), what, site)
                post().wait()
                if not sending:
                    self._event("joined", "recv", key, me)
                future.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - reported by wait()
                future.set_exception(exc)
        stream.submit(run)
        return wire.work(future.wait, future.done)

    # -- meeting other ranks ------------------------------------------------------
    def _event(self, *event) -> None:
        if self.channel is not None:
            self.channel(("nccl_rules",) + event)

    def _meet(self, kind: str, key: str, me: int, others: list[int], what: str,
              site=None, mine: bool = True) -> None:
        """Block until every rank in ``others`` has arrived at ``key`` too (NCCL's
        communicator creation; rule 8: the peer's stream at the receive). The wait is
        written to the rank's record channel first, so that a launch that times out
        here can say who waited for whom."""
        site = _call_site() if site is None else site
        self._event("wait", kind, key, me, tuple(others), what, site)
        if mine:
            self.store.set(f"ncclrules/{key}/{me}", "1")
        self.store.wait([f"ncclrules/{key}/{r}" for r in others], self.timeout)
        self._event("joined", kind, key, me)


_RULES: _Rules | None = None


def install(store, timeout: float) -> None:
    """Called once in a rank, after ``init_process_group``: the rules watch every
    call that reaches a process group from now on (``helpers.launch.wire``), and
    remember which groups are made with backend="gloo" (rule 3). ``store``: the
    launch's store."""
    global _RULES
    import torch.distributed.distributed_c10d as c10d

    _RULES = _Rules(store, timeout)
    wire.add(_RULES)
    # new_group creates its group through one of these (torch 2.13), looked up in the
    # module when it runs: wrapping them sees new_group however it was imported.
    for name in ("_new_group_with_tag", "_new_group_via_split_group"):
        if hasattr(c10d, name):
            setattr(c10d, name, _remember_gloo_groups(getattr(c10d, name)))


def _remember_gloo_groups(original: Callable) -> Callable:
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


def _check_dtypes(values) -> None:
    """Rule 4."""
    import torch

    for t in values:
        if not isinstance(t, torch.Tensor):
            continue
        name = str(t.dtype).removeprefix("torch.")
        if name not in NCCL_DTYPES:
            raise TypeError(f"Input tensor data type is not supported for NCCL process group: "
                            f"{_SCALAR_NAMES.get(name, name)}  [nccl_rules: gloo accepts "
                            f"{name} where it has a type for it; nccl has none]")


def _check_contiguous(call: wire.Call) -> None:
    """Rule 11."""
    for t in call.tensors:
        if not t.is_contiguous():
            raise ValueError(f"Tensors must be contiguous  [nccl_rules: {call.api} was handed "
                             f"a non-contiguous tensor of shape {tuple(t.shape)}, which gloo "
                             f"accepts and nccl refuses; pass t.contiguous()]")


def _check_op(op) -> None:
    """Rule 5."""
    import torch.distributed as dist

    for bad in ("BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, bad):
            raise ValueError(f"Cannot use ReduceOp.{bad} with NCCL  [nccl_rules]")


_HELPERS = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep
# Wrappers that sit between a call and torch.distributed (the wire and these rules, the
# checks' spy, the collective recorder): never the line to show.
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


# In the caller: what a launch that hung under the rules was waiting for (its own module,
# which registers the launcher's failure report when imported)
from helpers.launch.nccl_hangs import explain, waiting  # noqa: E402

__all__ = ["ENV", "install", "requested", "explain", "waiting"]
