"""BucketedDDP: the reducer that overlaps the buckets' all-reduces with backward.

Chapter 04, section 1 (the mechanism, points 1 and 3-5, and the drawing of
the hooks at work), sections 2-4 (the same gradients as torch's DDP, the
overlap, step time against bucket size) and section 5 (``no_sync``, unused
parameters, buffers). Which parameters share a bucket is
``helpers.ddp.buckets``; what carries a bucket, ``helpers.ddp.comm_hooks``.

What
----
``BucketedDDP`` does what ``torch.nn.parallel.DistributedDataParallel`` does
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, sec. 3-4), in Python, small enough to read:

1. **Same start.** At construction rank 0's parameters and buffers are
   broadcast, so replicas begin identical whatever each rank's seed was.
2. **Buckets.** Trainable parameters are grouped into buckets of about
   ``bucket_cap_mb``, the last-registered first, with a small first bucket
   (``assign_buckets``, ``helpers.ddp.buckets``).
3. **Hooks.** A post-accumulate-grad hook on every parameter fires when that
   parameter's ``.grad`` is final for this backward. When a bucket's last
   gradient arrives, its gradients are copied into one flat buffer and the
   bucket's all-reduce is *launched asynchronously*; autograd keeps computing
   the earlier layers' gradients meanwhile. That is the overlap.
4. **In order.** Buckets are launched strictly in bucket order (bucket 2
   waits for bucket 1 even if it was ready first). Why: the order in which
   gradients become ready is *not* the same on every rank (a forward that
   branches on the data, a parameter unused on some ranks), but collectives
   are paired by the order they are issued in: if rank 0 issues bucket A's
   all-reduce while rank 1 issues bucket B's, gloo hands B's bytes to A's
   buffer and aborts the process ("Received data size doesn't match expected
   size", SIGABRT), or NCCL hangs. The bucket index is the same on every rank,
   so the launch order is too, whatever the timing of the hooks. torch's DDP
   does the same: its C++ Reducer launches ``buckets_[next_bucket_]`` while
   it is complete (``Reducer::mark_bucket_ready``), and torch 2.13's
   ``distributed.py`` says of it "Schedule comm in the same order as Reducer
   schedules them, i.e. the order of the buckets". ``launch_bucket`` checks
   it, so a reducer that launches out of order (a subclass, an exercise)
   stops with an error on the rank that did it, before its collective
   reaches gloo. Hooks can also fire on *two threads at once*: autograd
   runs each device's part of backward on its own thread (CPU on the thread
   that called ``backward()``, each GPU on one of its own), so a model spread
   over devices reports gradients concurrently. The counting and launching
   are therefore done under a lock, as the Reducer's ``autograd_hook`` does
   under its ``mutex_``; otherwise two threads could both see bucket 0
   complete and not yet launched, and launch it twice.
5. **End of backward.** A callback queued on the autograd engine runs when
   backward finishes, before ``loss.backward()`` returns: it launches
   whatever is left, waits for every bucket, and copies the averaged flat
   buffers back into ``.grad``. The optimizer then sees averaged gradients,
   exactly as with DistributedDataParallel.

``no_sync()`` turns the hooks off for forwards run inside it: gradients
just accumulate locally (for gradient accumulation, ch. 05); the backward of
the first forward outside it reduces the accumulated sum. Frozen parameters
are never bucketed. A parameter that gets no gradient in a step is handled
like DDP's ``find_unused_parameters=True`` when that flag is set: after
forward, the autograd graph is searched and parameters not in it are marked
ready at once (so their bucket does not wait for a gradient that will never
come), and a small all-reduce of "used" flags at the end tells every rank
which parameters nobody used: those keep ``.grad = None``, as in DDP. Without
the flag such a bucket is launched at the end of backward, and the
parameter's gradient is the average where zero stands for "no gradient" (DDP
would raise an error instead).

A backward that raises part-way (or is interrupted) never reaches step 5.
The next forward notices, waits for the buckets that backward had already
launched, and starts clean, so the following backward averages again.

Cost
----
The same bytes as naive DP (one all-reduce of every gradient, ch. 02), plus
one copy of the gradients into the flat buffers and back, plus an
``alpha`` per bucket instead of per parameter. What it saves is *idle time*:
only the last bucket's all-reduce is exposed after backward. Bucket size is
the knob: small buckets overlap more but pay more latency terms; one giant
bucket pays one alpha but cannot start until backward ends.

How production differs: DDP's reducer is C++; with
``gradient_as_bucket_view=True`` (off by default) it makes ``.grad`` a view
into the bucket, which saves the copy back and one gradient's worth of
memory (by default it copies, as we do); it supports sparse
gradients, static graphs and mixed devices, and (with NCCL) runs the
all-reduce on a separate CUDA stream. Two differences change what a reader
of a trace or a profile sees:

* **Bucket layout over time.** DDP rebuilds its buckets once, after the first
  iteration, in the order the gradients arrived; ``BucketedDDP`` keeps the
  reverse registration order from the start (``helpers.ddp.buckets`` says
  more).
* **Buffers every forward.** DDP broadcasts rank 0's buffers (BatchNorm's
  running statistics, for instance) at the start of *every* forward by
  default (``broadcast_buffers=True``, renamed ``forward_sync_buffers`` in
  torch 2.13), so ranks keep identical buffers even when each updates them
  from its own shard. ``BucketedDDP`` broadcasts buffers once, at
  construction; a module whose forward changes its buffers drifts apart
  across ranks here (the course's GPT has none).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.clock import clock_for, resolve
from helpers.comm import world_size
from helpers.ddp.buckets import MB, assign_buckets
from helpers.ddp.comm_hooks import allreduce_hook
from helpers.naive_dp import broadcast_parameters, unique_parameters

__all__ = ["BucketedDDP"]


class BucketedDDP(nn.Module):
    """Wrap ``module`` for data parallel training; see the module docstring.

    ``ddp = BucketedDDP(model)``; ``loss = ddp(x, y)...; loss.backward()`` ->
    every ``.grad`` is the average over the group's ranks. ``ddp.timeline`` is
    the list of {"bucket", "event", "t"} of the last synchronized backward,
    events "ready" / "launched" / "finished", t in seconds from ``self.clock``
    (``helpers.clock``: ``time.perf_counter()`` on CPU; on a GPU CUDA events, so
    "finished", stamped in the future's callback, is when the all-reduce ended
    on the GPU, not when nccl queued it). ``ddp.sequence`` is the same backward
    without a clock: each hook and each launch, in the order they happened
    (chapter 04 draws it, ``helpers.drawing.buckets``).

    The buckets, for comm hooks and readers (fixed at construction, the same
    on every rank; bucket b is launched b-th):

    * ``buckets[b]``: its parameters, in the order they are packed;
    * ``layout[b]``: ``(param, start, end)`` per parameter, where its
      gradient sits in the bucket's flat buffer;
    * ``flat_buffers[b]``: that flat buffer (1-D, the parameters' dtype and
      device). The same tensor every step: it is what ``comm_hook`` receives
      for bucket b, so a hook may key per-bucket state on it (PowerSGD's
      error feedback and warm start do). Between backwards it holds the last
      averaged gradients; do not write to it.
    """

    # Held while a hook counts and launches, and while finish_backward runs: hooks
    # may come from several autograd threads (module docstring, point 4). One lock
    # for the whole process, shared by every instance: collectives are issued one
    # at a time whichever wrapper issues them (and a deepcopy still works).
    _lock = threading.RLock()

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 process_group=None, comm_hook: Callable | None = None,
                 find_unused_parameters: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"BucketedDDP wraps an nn.Module, got {type(module).__name__}")
        for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0 (megabytes), got {v!r}")
        if comm_hook is not None and not callable(comm_hook):
            raise TypeError("comm_hook must be callable(flat_grad, group) -> Future")
        self.module = module
        self.process_group = process_group
        self.world_size = world_size(process_group)
        self.comm_hook = comm_hook or allreduce_hook
        self.find_unused_parameters = bool(find_unused_parameters)
        self.require_backward_grad_sync = True
        self._timeline: list[dict] = []  # t as clock marks; ``timeline`` resolves them
        self._sequence: list[tuple[str, int]] = []  # ("grad", param) / ("launch", bucket)

        if self.world_size > 1:
            broadcast_parameters(module, src=0, group=process_group)

        self.params = unique_parameters(module)  # trainable, tied once, registration order
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets: list[list[nn.Parameter]] = [
            [self.params[i] for i in idx] for idx in assign_buckets(
                [p.numel() * p.element_size() for p in self.params],
                bucket_cap_mb * MB, first_bucket_mb * MB, [p.dtype for p in self.params])]
        self.bucket_of_param: dict[int, int] = {}  # id(param) -> bucket index
        self.layout: list[list[tuple[nn.Parameter, int, int]]] = []  # (param, start, end)
        self.flat_buffers: list[torch.Tensor] = []
        for b, bucket in enumerate(self.buckets):
            offset, layout = 0, []
            for p in bucket:
                self.bucket_of_param[id(p)] = b
                layout.append((p, offset, offset + p.numel()))
                offset += p.numel()
            self.layout.append(layout)
            self.flat_buffers.append(
                torch.zeros(offset, dtype=bucket[0].dtype, device=bucket[0].device))
        self.clock = clock_for(self.flat_buffers[0].device if self.flat_buffers else "cpu")
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        if hasattr(self.comm_hook, "bind"):  # a hook that needs the buckets' layout
            self.comm_hook.bind(self)
        self._unused: list[nn.Parameter] = []
        self._expect_hooks = False
        self._in_backward = False
        self._reset_state()

    # -- forward ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._in_backward:
            # The previous backward never reached _finalize: it raised (or was
            # interrupted) part-way. Autograd drops the queued callback with the
            # failed graph, so without this reset every later backward would see
            # _in_backward == True, skip _begin_backward and never finalize:
            # gradients silently left un-averaged, forever.
            self._abandon_backward()
        out = self.module(*args, **kwargs)
        # As in DDP, the decision to reduce is taken here, at forward time: a
        # backward through a forward run inside no_sync() (or through the bare
        # module, bypassing this wrapper) leaves gradients local.
        self._expect_hooks = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._expect_hooks and self.find_unused_parameters:
            self._unused = self._params_not_in_graph(out)
        return out

    def _params_not_in_graph(self, out) -> list[nn.Parameter]:
        """Parameters that no path of the autograd graph from ``out`` reaches."""
        roots, stack = [], [out]
        while stack:  # tensors inside nested tuples/lists/dicts
            o = stack.pop()
            if isinstance(o, torch.Tensor):
                if o.grad_fn is not None:
                    roots.append(o.grad_fn)
            elif isinstance(o, (list, tuple)):
                stack.extend(o)
            elif isinstance(o, dict):
                stack.extend(o.values())
        seen, found = set(), set()
        while roots:
            node = roots.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
            if var is not None:
                found.add(id(var))
            roots.extend(nxt for nxt, _ in node.next_functions)
        return [p for p in self.params if id(p) not in found]

    # -- backward: hooks, launch, finalize -------------------------------
    def _reset_state(self) -> None:
        self.pending = [len(b) for b in self.buckets]  # gradients still missing per bucket
        self.next_bucket = 0                             # first bucket not launched yet
        self.futures: list = [None] * len(self.buckets)
        self._n_launched = 0  # launch_bucket's own count, to check the order
        self._locally_used = [True] * len(self.params)
        self._arrived: set[int] = set()   # ids of parameters whose hook fired (or unused)
        self._finishing = False           # inside finish_backward: leftovers may go

    def _abandon_backward(self) -> None:
        """Forget a backward that failed before finishing (called from forward).

        Buckets it had already launched are still being all-reduced into
        ``self.flat_buffers``; wait for them so that the next backward does not copy
        gradients into a buffer the old collective is writing, and so that the
        next collectives pair with the same calls on the other ranks. This
        assumes every rank failed at the same point (the same exception in the
        same backward); if only some ranks failed, the ranks have issued
        different collectives and the job must restart, as with DDP.
        """
        for fut in self.futures:
            if fut is not None:
                with contextlib.suppress(Exception):  # that iteration's result is discarded
                    fut.wait()
        self._reset_state()
        self._in_backward = False

    @property
    def timeline(self) -> list[dict]:
        """{"bucket", "event", "t"} of the last synchronized backward, t in seconds."""
        return resolve(self._timeline)

    @property
    def sequence(self) -> list[tuple[str, int]]:
        """What happened in the last synchronized backward, in order: ``("grad", i)``
        when parameter ``self.params[i]``'s hook fired, ``("unused", i)`` when it was
        marked ready without a gradient (``find_unused_parameters``), ``("launch", b)``
        when bucket b's all-reduce started. No clock in it, so it is the same on any
        machine for the same model: chapter 04 draws it (``helpers.drawing.buckets``)."""
        return list(self._sequence)

    def record(self, bucket: int, event: str) -> None:
        self._timeline.append({"bucket": bucket, "event": event, "t": self.clock.mark()})

    def _hook(self, param: nn.Parameter) -> None:
        # Called by autograd with the *parameter* (not the gradient): read param.grad.
        # Possibly on several threads at once (docstring, point 4): one at a time.
        with self._lock:
            if not self._expect_hooks:
                return  # forward ran inside no_sync() (or not through us): accumulate locally
            if not self._in_backward:
                self._begin_backward()
            self._sequence.append(("grad", self._index[id(param)]))
            self._arrived.add(id(param))
            self.on_grad_ready(param)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._reset_state()
        self._timeline = []
        self._sequence = []
        # Runs when the whole backward pass is done, before backward() returns.
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        unused, self._unused = self._unused, []
        for p in unused:  # found after forward: no gradient will come, mark ready now
            self._sequence.append(("unused", self._index[id(p)]))
            self._arrived.add(id(p))
            self.on_grad_ready(p)

    def on_grad_ready(self, param: nn.Parameter) -> None:
        """``param.grad`` is final: count it; launch every bucket that can go."""
        b = self.bucket_of_param[id(param)]
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self.record(b, "ready")
            self.launch_ready_buckets()

    def launch_ready_buckets(self) -> None:
        """Launch complete buckets in bucket order, stopping at the first incomplete one."""
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self.launch_bucket(self.next_bucket)
            self.next_bucket += 1

    def launch_bucket(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into its flat buffer and start its all-reduce
        (through ``comm_hook``); ``self.futures[b]`` resolves to the averaged buffer.

        Buckets must go in the order 0, 1, 2, ... on every rank (docstring,
        point 4): anything else is refused here, before a collective is issued."""
        if b != self._n_launched:
            raise RuntimeError(
                f"bucket {b} launched after {self._n_launched} bucket(s) of this backward: "
                f"buckets must be launched in the order 0, 1, 2, ..., each once, on every "
                f"rank (launch_ready_buckets: the next bucket only, while it is complete). "
                f"Launched in the order gradients arrive, ranks issue their all-reduces in "
                f"different orders and gloo pairs different buckets (size mismatch, SIGABRT).")
        missing = [self._index[id(p)] for p, _, _ in self.layout[b] if id(p) not in self._arrived]
        if missing and not self._finishing:
            raise RuntimeError(
                f"bucket {b} launched while the gradient(s) of parameter(s) {missing} "
                f"(self.params[i]) had not arrived: its all-reduce would send what .grad held "
                f"before (nothing, or the last step's). Launch a bucket only once every "
                f"gradient in it is ready (pending[b] == 0), and count each gradient into "
                f"its own bucket (bucket_of_param[id(param)]).")
        self._n_launched += 1
        flat = self.flat_buffers[b]
        for p, start, end in self.layout[b]:
            if p.grad is None:  # no gradient on this rank this step: contributes zero
                self._locally_used[self._index[id(p)]] = False
                flat[start:end].zero_()
            else:
                flat[start:end].copy_(p.grad.reshape(-1))
        self.record(b, "launched")
        self._sequence.append(("launch", b))
        fut = self.comm_hook(flat, self.process_group)

        def finished(f, b=b):
            # Runs on the communication thread when it completes; on a GPU with
            # streams that wait on the all-reduce, so the mark is its end there.
            self.record(b, "finished")
            return f.value()

        self.futures[b] = fut.then(finished)

    def _finalize(self) -> None:
        with self._lock:
            try:
                self._finishing = True   # backward is over: what never arrived never will
                self.finish_backward()
            finally:
                self._in_backward = False
                self._expect_hooks = False  # the next reduction needs a new forward

    def finish_backward(self) -> None:
        """End of backward (queued on the autograd engine): launch what is left,
        wait for every bucket, write the averaged gradients into ``.grad``."""
        for b in range(self.next_bucket, len(self.buckets)):
            if self.pending[b] > 0:  # a parameter without gradient held this bucket back
                self.record(b, "ready")
            self.pending[b] = 0
        self.launch_ready_buckets()
        used_work = None
        if self.find_unused_parameters and self.world_size > 1:
            used = torch.tensor(self._locally_used, dtype=torch.int32,
                                device=self.flat_buffers[0].device if self.flat_buffers else "cpu")
            used_work = (used, dist.all_reduce(used, group=self.process_group,
                                               async_op=True))
        results = [f.wait() for f in self.futures]
        if used_work is not None:
            used_work[1].wait()
            globally_used = used_work[0].tolist()
        else:
            globally_used = self._locally_used if self.find_unused_parameters else None
        with torch.no_grad():
            for b, layout in enumerate(self.layout):
                avg = results[b]
                for p, start, end in layout:
                    g = avg[start:end].view_as(p)
                    if p.grad is not None:
                        p.grad.copy_(g)
                    elif globally_used is None or globally_used[self._index[id(p)]]:
                        p.grad = g.clone()
                    # else: nobody used it -> keep None, as DDP does

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards run inside accumulate gradients locally; the first backward of a
        forward run outside reduces the accumulated sum (DDP's semantics)."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
