"""Gather a unit's weights just before it runs, free them right after.

This is the core that ZeRO stage 3 (``helpers.zero.stage3``) and FSDP
(``helpers.fsdp``) share. Both cut the model into *units* (a module, or a
group of modules); each rank keeps only its chunk of a unit's flattened
weights, and the unit's full weights exist only while the unit computes:

    forward:   all-gather the unit -> its forward -> free
    backward:  all-gather again    -> its backward -> (reduce-scatter the
               gradients) -> free

Two pieces live here:

* ``UnitBuffer``: one unit's full flat buffer (``full``, shape (padded,),
  every rank's chunk back to back). Its parameters are views into it, so
  autograd keeps pointing at it while it is freed: ``free`` shrinks its
  storage to 0 bytes, ``start_gather`` grows it back and all-gathers the
  chunks into it, asynchronously. A buffer with a gather in flight is never
  freed before the gather has landed (the collective would write into freed
  memory), and ``wait`` is what a unit calls before computing with it.
* ``register_unit_hooks``: the module hooks that say *when*. A forward
  pre-hook gathers, a forward hook frees, and one multi-grad hook over every
  tensor of the module's output (any pytree: ``nn.MultiheadAttention``
  returns a tuple) fires when the first gradient reaches it, that is when
  backward reaches the module: gather again. The caller decides what
  "gather" and "free" mean for its units (FSDP keeps the root gathered;
  ZeRO-3 keeps a unit that its trace says is reused soon) and when the
  gradients are reduced.

``start_gather`` can fill several units with one collective (ZeRO-3's
prefetch coalesces them): the chunks are concatenated on every rank, so the
gathered buffer is rank-major, ``[rank 0: A, B | rank 1: A, B | ...]``, and
each unit's columns are copied into its own buffer once the gather lands.

Cost: each gather moves (N-1)/N of the unit's bytes per rank; with a gather
before forward and one before backward each weight crosses the wire twice per
step (ZeRO, Rajbhandari et al. 2020, sec. 7.2.2: 1.5x data parallelism's
volume with the gradient's reduce-scatter). How production differs: FSDP2
allocates a fresh buffer per all-gather and copies out with fused kernels on
a separate CUDA stream; PyTorch's first FSDP resized storage as here.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from helpers.comm import all_gather, alloc_storage, free_storage, is_allocated
from helpers.overlap import issue_mark, record_comm, wait_comm

__all__ = ["UnitBuffer", "Gather", "start_gather", "register_unit_hooks"]


class Gather:
    """One all-gather in flight into one or more ``UnitBuffer``s."""

    def __init__(self, work, name: str, timeline, buffers: list["UnitBuffer"],
                 inp: torch.Tensor, out: torch.Tensor, world: int):
        # inp is kept: the collective reads it until it completes
        self.work, self.name, self.timeline = work, name, timeline
        self.buffers, self.inp, self.out, self.world = buffers, inp, out, world

    def wait(self) -> None:
        """Block until the weights are there; copy a coalesced gather's columns
        into each unit's buffer. Idempotent."""
        if self.work is not None:
            wait_comm(self.timeline, self.work, self.name)
            self.work = None
        if len(self.buffers) > 1 and self.out is not None:
            columns, col = self.out.view(self.world, -1), 0  # (world, sum of chunks)
            for b in self.buffers:
                c = b.full.numel() // self.world  # this unit's chunk
                b.full.view(self.world, c).copy_(columns[:, col:col + c])
                col += c
        self.out = self.inp = None
        for b in self.buffers:
            if b.pending is self:
                b.pending = None


class UnitBuffer:
    """A unit's full flat buffer, (padded,), present only while gathered."""

    def __init__(self, full: torch.Tensor):
        self.full = full
        self.pending: Gather | None = None  # an all-gather writing into ``full``

    @property
    def gathered(self) -> bool:
        """Weights there or on their way."""
        return is_allocated(self.full)

    def wait(self) -> None:
        """The unit computes now: make sure its gather has landed."""
        if self.pending is not None:
            self.pending.wait()

    def free(self) -> None:
        """Drop the full weights (after waiting for a gather still writing into them)."""
        self.wait()
        free_storage(self.full)


def start_gather(buffers: list[UnitBuffer], chunks: list[torch.Tensor], group, world: int,
                 timeline=None, name: str = "all-gather") -> Gather:
    """Start one asynchronous all-gather of ``chunks`` (this rank's chunk of each
    unit, already in the buffers' dtype) into ``buffers`` (coalesced if several).
    On one rank the chunk is the whole unit: copied, no collective."""
    for b in buffers:
        alloc_storage(b.full)
    if len(buffers) == 1:  # straight into the unit's storage
        inp, out = chunks[0], buffers[0].full
    else:  # rank-major: every rank's [A, B, ...] back to back
        inp = torch.cat(chunks)
        out = torch.empty(world * inp.numel(), dtype=inp.dtype, device=inp.device)
    if world == 1:
        out.copy_(inp)
        work = None
    else:
        t0 = issue_mark(timeline)
        work = all_gather(out, inp, group=group, async_op=True)
        record_comm(timeline, work, name, t0)
    g = Gather(work, name, timeline, buffers, inp, out, world)
    for b in buffers:
        b.pending = g
    return g


def register_unit_hooks(module: nn.Module, before_forward: Callable, after_forward: Callable,
                        before_backward: Callable) -> list:
    """The hooks that gather and free a unit; returns their handles.

    ``before_forward(args, kwargs)`` runs before the module's forward and may
    return new ``(args, kwargs)`` (FSDP casts inputs there) or None;
    ``after_forward()`` right after it; ``before_backward()`` when the first
    gradient reaches any output tensor that needs one, i.e. when backward
    reaches the module (registered only when grad mode is on)."""
    def pre_hook(mod, args, kwargs):
        return before_forward(args, kwargs)

    def post_hook(mod, args, out):
        after_forward()
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            # mode "any": one call, for the first gradient to arrive (FSDP2 does the same)
            register_multi_grad_hook(outputs, lambda grad: before_backward(), mode="any")
        return None

    return [module.register_forward_pre_hook(pre_hook, with_kwargs=True),
            module.register_forward_hook(post_hook)]
