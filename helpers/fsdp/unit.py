"""A unit's life: gather its weights, let its parameters point at them, free them, prefetch.

Chapter 15, sections "One step of a unit's life, on two ranks" and "The knob:
reshard after forward"; chapter 16 times the prefetch. The unit itself and
the hooks that gather and free it; what happens to its gradients is
``helpers.fsdp.grads``.

A unit's life in one training step (Zhao et al. 2023, "PyTorch FSDP", sec.
3.2, Figure 3):

    forward:   all-gather its weights -> run its forward -> free them
               (``reshard_after_forward=True``; False keeps them until backward,
               trading memory for one all-gather less)
    backward:  all-gather again -> run its backward -> reduce-scatter the
               gradients (rank r gets the average of chunk r) -> free them

"Its backward starts" is seen as the first gradient arriving at any of the
unit's outputs: one multi-grad hook (``register_multi_grad_hook``, mode
"any") over every tensor of the output pytree, so a unit may return a tuple,
as ``nn.MultiheadAttention`` does, or any nesting of tensors.
These hooks and the unit's buffer (gather into it asynchronously, never
free it under a gather in flight) are ``helpers.unit_gather``, the same code
ZeRO stage 3 runs (``helpers.zero.stage3``): FSDP is ZeRO-3 with units chosen
by a policy.

Only one or two units are ever full at a time, so the peak weight memory is a
shard of everything plus the largest units, not the whole model. The root
unit is gathered when the model's forward starts and kept until its
gradients are reduced (its embedding is used first in forward and last in
backward, as FSDP2 does for the root).

FSDP never sees ``optimizer.step()``, so it cannot free the units there as
ZeRO-3 does. A unit still gathered when a new forward starts from the root
is a leftover from a forward that had no backward (an evaluation pass
between ``backward()`` and ``step()``); its weights may be older than the
shards the optimizer has just updated, so the root's pre-forward hook frees
every leftover and the forward gathers afresh. A forward under
``torch.no_grad()`` frees the root (and, with ``reshard_after_forward=False``,
every unit) as soon as it ends: no backward will need them.

**Prefetch** (sec. 3.3.2): while unit i computes, the all-gather of the unit
that runs next (i+1 in forward, i-1 in backward) is already issued
asynchronously, so its communication hides under unit i's compute. Without
prefetch each gather starts only when its unit is about to run, and the
rank waits: that wait is *exposed communication* (chapter 16 measures it
with ``helpers.overlap``).

**The model's own parameters** (FSDP1's ``use_orig_params=True``): while its
unit is gathered (its forward and backward), a parameter is its full-shape
window into the gathered buffer, in ``param_dtype``, with no ``.grad`` (the
gradient autograd accumulates there is full-size and is reduce-scattered
away). Otherwise, from the wrap on and whenever ``backward()`` has returned,
it is *this rank's piece*: ``p.data`` a 1-D view of the elements of the
flattened parameter that fall in this rank's chunk of the unit's shard (the
fp32 master weights, updated in place by the optimizer; maybe 0 elements),
and ``p.grad`` the matching view of ``shard.grad`` (fp32 under mixed
precision), so ``p.grad.shape == p.data.shape``. Hence ``p.shape`` outside
a unit's run is the piece's, not the parameter's: ``u.shapes`` keeps the
real ones. FSDP2 gives a DTensor instead, of full logical shape, whose
local part is a dim-0 shard. Writing into a ``.grad`` view changes what the
optimizer sees; dropping every ``.grad`` (``model.zero_grad()``) drops the
gradient at the unit's next gather, as FSDP1 writes back its parameters'
gradients; ``optimizer.zero_grad()`` clears the shards, and the views
follow at the next forward.

Mixed precision's forward half happens here: each gather first rounds this
rank's fp32 chunk to ``param_dtype`` (half the bytes on the wire in bf16),
and the floating-point inputs of the root and of each unit are cast to it,
as FSDP2's ``cast_forward_inputs`` (the policy: ``helpers.fsdp.grads``).

How production differs: FSDP2 gathers into a fresh buffer per all-gather on
its own CUDA stream, with events so that the gather really runs beside
compute, and copies out with fused kernels; here the buffer's storage is
resized in place (as FSDP1 did) and a gather runs when the backend runs it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from helpers.unit_gather import UnitBuffer, start_gather
from helpers.zero import FlatPartition

__all__ = ["Unit", "UnitLife", "next_unit_prefetch"]


class Unit(UnitBuffer):
    """One FSDP unit: its parameters, a flat full buffer (``UnitBuffer``, gathered
    and freed as ZeRO-3's units are) and this rank's shard.

    ``params`` (the model's parameters in it), ``shapes`` (their real shapes),
    ``shard`` (this rank's chunk, an ``nn.Parameter``: what the optimizer
    updates), ``part`` (its ``FlatPartition``, one bucket), ``rank`` (this rank's
    place in the shard group); ``full``, ``gathered``, ``pending``, ``wait()``
    from ``UnitBuffer``."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 shard_world: int, shard_rank: int):
        self.name, self.module, self.params = name, module, params
        # the parameters' own shapes: outside the unit's run p.shape is this rank's piece
        self.shapes = [p.shape for p in params]
        self.part = FlatPartition([p.numel() for p in params], shard_world,
                                  [list(range(len(params)))], shapes=self.shapes)
        b = self.part.buckets[0]
        self.bucket = b
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(f"unit {name!r}: its parameters must share one dtype and device "
                             f"(they share one flat buffer), found {sorted(map(str, kinds))}")
        dtype, device = params[0].dtype, params[0].device
        # (padded,): every rank's chunk back to back
        super().__init__(torch.zeros(b.padded, dtype=dtype, device=device))
        for p, off in zip(params, b.offsets):
            seg = self.full[off:off + p.numel()]
            seg.copy_(p.detach().reshape(-1))
            p.data = seg.view_as(p)  # p is now a window into `full`
        self.shard = nn.Parameter(torch.zeros(b.chunk, dtype=dtype, device=device))  # (padded / S,)
        self.rank = shard_rank
        # This rank's piece of each parameter (one entry per parameter, in order):
        # owned[i].lo:hi of the flattened parameter are shard[pieces[i][0]:pieces[i][1]]
        # (empty: the parameter lies wholly in other ranks' chunks).
        self.owned = self.part.owned_ranges(shard_rank, empty=True)
        self.pieces = [(o.at, o.at + o.hi - o.lo) for o in self.owned]
        self.views_of = None  # the shard.grad the parameters' .grad are views of
        self.ready = 0       # parameters whose gradient arrived in this backward
        self.reduced = False
        self.grad_chunk = None  # this rank's averaged gradient chunk, once reduced

    # What a parameter of the model is (module docstring, "The model's own
    # parameters"): a window into the gathered buffer while its unit runs, else
    # this rank's piece of the shard, with the matching piece of shard.grad as .grad.

    def full_views(self) -> None:
        """The unit is about to be gathered: each parameter becomes its full-shape
        window into ``full``, with no ``.grad`` (backward accumulates a full one)."""
        self._write_back_grads()
        for p, off, shape in zip(self.params, self.bucket.offsets, self.shapes):
            p.grad = None  # the gradient lives on in shard.grad
            p.data = self.full[off:off + shape.numel()].view(shape)
        self.views_of = None

    def shard_views(self) -> None:
        """The unit is freed: each parameter becomes this rank's piece of the shard,
        its ``.grad`` the same piece of ``shard.grad`` (None if that is None)."""
        self._write_back_grads()
        g = self.shard.grad
        for p, (a, e) in zip(self.params, self.pieces):
            p.grad = None  # first: .grad must match .data's shape and dtype when set
            p.data = self.shard.detach()[a:e]
            p.grad = None if g is None else g[a:e]
        self.views_of = g

    def _write_back_grads(self) -> None:
        """A user who set the parameters' ``.grad`` to None (``model.zero_grad()``)
        meant to drop those gradients: zero their pieces of ``shard.grad``, or drop
        it whole if every piece went. Only if ``shard.grad`` is still the tensor the
        views were made of: once the optimizer or backward replaced it, it wins."""
        g = self.shard.grad
        if g is None or g is not self.views_of:
            return
        dropped = [(a, e) for p, (a, e) in zip(self.params, self.pieces) if p.grad is None]
        if len(dropped) == len(self.params):
            self.shard.grad = None
        else:
            for a, e in dropped:
                g[a:e].zero_()


def next_unit_prefetch(fsdp, i: int, phase: str) -> None:
    """Default prefetch: after unit i is gathered, start gathering the unit that
    runs next: i + 1 in forward (i = -1 is the root, before block 0), i - 1 in
    backward (Zhao et al. 2023, sec. 3.3.2: forward and backward prefetch)."""
    j = i + 1 if phase == "forward" else i - 1
    if 0 <= j < len(fsdp.units):
        fsdp.gather_async(fsdp.units[j])


class UnitLife:
    """The part of ``helpers.fsdp.FSDP`` that gathers and frees its units: the
    forward hooks, the hook that sees a unit's backward start, ``gather_async``
    and ``free``. A mixin: the wrapper (``helpers.fsdp.wrap``) builds the state
    it reads (``units``, ``root``, ``shard_group``, ``shard_size``, ``timeline``,
    ``prefetch``, ``param_dtype``, ``reshard_after_forward``, the gathered-bytes
    counters) and registers these hooks; a unit's backward ends in
    ``helpers.fsdp.grads``, which frees it once its gradients are on their way."""

    def _gather(self, u: Unit, async_op: bool = False) -> None:
        if u.pending is not None:  # prefetched
            if not async_op:  # someone needs it now: wait for it
                u.wait()
            return
        if u.gathered:
            return
        nbytes = u.full.numel() * u.full.element_size()
        self._gathered_now += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_now)
        self._count("all_gather", nbytes, self.shard_size)
        if self.timeline is not None:  # the unit's full weights exist from now until free
            u.held_since = self.timeline.now()
        # (padded / S,) this rank's chunk, cast to param_dtype first: half the
        # bytes on the wire in bf16.
        chunk = u.shard.detach().to(u.full.dtype)
        start_gather([u], [chunk], self.shard_group, self.shard_size, self.timeline,
                     f"all-gather {u.name}")
        u.full_views()  # (its storage is allocated now; the weights land later)
        if not async_op:
            u.wait()

    def gather_async(self, u: Unit) -> None:
        """Start gathering unit ``u`` without waiting (a no-op if it is full or on its way)."""
        self._gather(u, async_op=True)

    def free(self, u: Unit) -> None:
        """Free unit ``u``'s gathered weights (a no-op if they are not there; waits
        first for a gather still writing into them): its parameters become this
        rank's pieces of the shard again. The hooks call it after each use; call
        it yourself after writing into the shards outside a step (a checkpoint
        load), or a unit still gathered would go on computing with the old
        weights. Not collective."""
        held = u.gathered
        if held:
            self._gathered_now -= u.full.numel() * u.full.element_size()
        u.free()  # (waits first for a gather still writing into it)
        u.shard_views()
        since = getattr(u, "held_since", None)
        if held and self.timeline is not None and since is not None:
            # lane "held": from the gather's launch to this free, the unit's full weights
            # take memory on this rank (chapter 15's picture of units' lives)
            self.timeline.add("held", u.name, since, self.timeline.now())
            u.held_since = None

    # ------------------------------------------------------------ hooks
    def _cast_inputs(self, args, kwargs):
        """Floating-point inputs to param_dtype, as FSDP2's cast_forward_inputs."""
        if self.param_dtype is None:
            return None

        def cast(t):
            floating = isinstance(t, torch.Tensor) and t.is_floating_point()
            return t.to(self.param_dtype) if floating else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _root_pre_forward(self, module, args, kwargs):
        # Whatever is still gathered is left over from a forward without backward
        # (see the module docstring): possibly older than the shards. Start clean.
        for u in self.all_units:
            self.free(u)
        if self.root is not None:
            self._gather(self.root)
        if self.prefetch is not None:
            self.prefetch(self, -1, "forward")
        return self._cast_inputs(args, kwargs)

    def _root_post_forward(self, module, args, out):
        if not torch.is_grad_enabled():  # no backward will follow: nothing stays gathered
            for u in self.all_units:
                self.free(u)

    def _pre_forward(self, i):
        def hook(args, kwargs):
            u = self.units[i]
            self._gather(u)
            if self.prefetch is not None:
                self.prefetch(self, i, "forward")
            if self.timeline is not None:
                u.t_fwd = self.timeline.now()
            return self._cast_inputs(args, kwargs)
        return hook

    def _post_forward(self, i):
        def hook():
            u = self.units[i]
            if self.timeline is not None:
                self.timeline.add("compute", f"forward {u.name}", u.t_fwd, self.timeline.now())
            if self.reshard_after_forward or not torch.is_grad_enabled():
                self.free(u)
        return hook

    def _pre_backward(self, i) -> None:
        self._expect_end_of_backward()  # (helpers.fsdp.grads: reduce what is left then)
        u = self.units[i]
        self._gather(u)
        if self.prefetch is not None:
            self.prefetch(self, i, "backward")
        if self.timeline is not None:
            u.t_bwd = self.timeline.now()
