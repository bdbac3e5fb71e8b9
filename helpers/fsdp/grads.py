"""FSDP's gradients: reduce-scatter each unit's, clip them sharded, in which precision.

Chapter 15, sections "Same training as DDP and as PyTorch's FSDP2" (sharded
gradients, clipping) and "Mixed precision and ignored parameters"; the
all-reduce across replicas is the gradient half of "Hybrid sharding on 4 ranks"
(the groups: ``helpers.fsdp.hybrid``). A unit's gathers and frees are
``helpers.fsdp.unit``.

**Reduce-scatter** (Zhao et al. 2023, sec. 3.2): a post-accumulate-grad hook
on each parameter counts the unit's gradients; when the last one has arrived,
the unit's full-size gradients are copied into one flat buffer, divided by the
number of data-parallel ranks and reduce-scattered in the shard group: rank r
keeps the average of chunk r, and the unit is freed. A reduce-scatter needs
that full-size buffer as input; at most one is kept in flight, and it is
retired when the next unit's starts, so those buffers do not add up over the
depth. When backward ends (a callback queued on the autograd engine) every
unit that got no gradient reduces zeros, the last reduce-scatter is waited
for, and under hybrid sharding (sec. 3.2.2) each chunk is all-reduced across the
replicate group: only 1/S of the gradient's bytes cross the slow links.

The optimizer is PyTorch's own: each unit's shard is an ``nn.Parameter``
(``FSDP.parameters()``) whose ``.grad`` is the averaged gradient chunk when
``loss.backward()`` returns, so ``torch.optim.AdamW(fsdp.parameters())``
updates exactly the elements this rank owns. Padding stays zero. Clip with
``fsdp.clip_grad_norm_(max_norm)``, not torch's: the norm of the whole
gradient needs every rank's chunks (one all-reduce of the squared norms).
``sharded_grads()`` gives this rank's piece of each parameter's gradient, by
name with its offset (the same views the parameters' own ``.grad`` are
between steps, ``helpers.fsdp.unit``); ``full_grads()`` all-gathers them into
full shapes, for inspection.

**Mixed precision** (FSDP2's ``MixedPrecisionPolicy``; Micikevicius et al.
2018, "Mixed Precision Training", sec. 3.1): with ``param_dtype=torch.bfloat16``
the shards stay fp32, the master weights the optimizer updates, and each
gather first rounds this rank's chunk to bf16: half the bytes on the wire,
and the unit's forward and backward run in bf16 (floating-point inputs of the
root and of each unit are cast to bf16, as FSDP2's ``cast_forward_inputs``;
both happen in ``helpers.fsdp.unit``). ``reduce_dtype=torch.float32``
reduce-scatters the bf16 gradients in fp32, so the sum over ranks loses
nothing more; None reduces in bf16. The reduced chunk becomes the fp32
shard's gradient.

**Ignored parameters** (``ignored_params``): left out of every unit, so they
stay full and replicated on every rank. Here, and this is the course's own
choice, they are then trained as under DDP: rank 0's values are broadcast at
construction, their gradients all-reduced and averaged when backward ends, and
``fsdp.parameters()`` yields them next to the shards. FSDP2's ``ignored_params``
only shares the first half: ``fully_shard`` neither shards them nor reduces
their gradients (its docstring, PyTorch 2.13: "They will not be sharded, nor
moved to the device during init, nor have their gradients reduced in
backward"), so keeping the replicas equal is left to the caller. Meant for a
few small tensors (norms) or anything that must not be sharded; they keep
their own dtype under a mixed-precision policy.

How production differs: FSDP2 reduce-scatters on its own CUDA stream, keeps
each parameter's gradient a DTensor sharded along dim 0, and its policy has
an ``output_dtype`` (none here); here ignored parameters are averaged
synchronously at the end of backward, unbucketed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from helpers.clip import sharded_clip_grad_norm_
from helpers.comm import all_gather, reduce_scatter
from helpers.fsdp.unit import Unit
from helpers.overlap import issue_mark, record_comm, wait_comm

__all__ = ["GradShard", "ShardedGrads"]


class GradShard(NamedTuple):
    """This rank's part of one parameter's gradient (``FSDP.sharded_grads``):
    elements ``[start, start + grad.numel())`` of the flattened gradient."""
    start: int
    grad: torch.Tensor | None


class ShardedGrads:
    """The part of ``helpers.fsdp.FSDP`` that turns each unit's full gradients
    into this rank's averaged chunk, and reads and clips those chunks. A mixin:
    the wrapper (``helpers.fsdp.wrap``) builds the state it reads (the units,
    the shard and replicate groups and sizes, ``reduce_dtype``, ``timeline``,
    the ignored parameters, the byte counter) and registers ``_post_accumulate``
    on every parameter of every unit."""

    def _expect_end_of_backward(self) -> None:
        """Queue ``_finish_backward`` once per backward (it runs when autograd is
        done, before ``loss.backward()`` returns). Called from within backward:
        by the first gradient hook, or when backward reaches a unit."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True

    def _post_accumulate(self, u: Unit):
        def hook(p):
            self._expect_end_of_backward()
            u.ready += 1
            if u.ready == len(u.params):
                self._reduce(u)
        return hook

    def _reduce(self, u: Unit) -> None:
        """Average this unit's gradients: reduce-scatter in the shard group,
        then (hybrid) all-reduce the chunk across the replicate group."""
        if self.timeline is not None and hasattr(u, "t_bwd"):
            self.timeline.add("compute", f"backward {u.name}", u.t_bwd, self.timeline.now())
        b = u.bucket
        # (padded,) on the unit's device, in reduce_dtype (default: the
        # gradients' dtype, that of the gathered weights); padding stays 0
        buf = torch.zeros(b.padded, dtype=self.reduce_dtype or u.full.dtype,
                          device=u.shard.device)
        for p, off, shape in zip(u.params, b.offsets, u.shapes):
            if p.grad is not None:
                buf[off:off + shape.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        buf.div_(self.shard_size * self.replicate_size)  # mean over every data-parallel rank
        out = torch.empty(b.chunk, dtype=buf.dtype, device=buf.device)  # (padded / S,)
        self._count("reduce_scatter", buf.numel() * buf.element_size(), self.shard_size)
        self._retire_reduce_scatter()
        if self.shard_size > 1:
            t0 = issue_mark(self.timeline)
            work = reduce_scatter(out, buf, group=self.shard_group, async_op=True)
            record_comm(self.timeline, work, f"reduce-scatter {u.name}", t0)
            self._rs_in_flight = (u.name, work, buf)
        else:
            out.copy_(buf)
        u.grad_chunk = out  # filled once the reduce-scatter has finished
        u.reduced = True
        self.free(u)

    def _retire_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter still in flight (it had a whole unit's
        backward to finish, so usually it has) and drop its full-size input.
        Keeping every unit's input to the end of backward would hold the
        whole model's gradients again; with one in flight at a time the
        extra is one unit's, whatever the depth (FSDP2 does the same)."""
        if self._rs_in_flight is not None:
            name, work, _ = self._rs_in_flight
            wait_comm(self.timeline, work, f"reduce-scatter {name}")
            self._rs_in_flight = None  # the input buffer goes with it

    def _finish_backward(self) -> None:
        for u in self.all_units:
            if not u.reduced:  # parameters that got no gradient: reduce zeros
                self._reduce(u)
        self._retire_reduce_scatter()
        for u in self.all_units:
            out = u.grad_chunk  # every reduce-scatter has finished
            if self.replicate_size > 1:
                t0 = issue_mark(self.timeline)
                work = dist.all_reduce(out, group=self.replicate_group, async_op=True)
                record_comm(self.timeline, work, f"all-reduce {u.name}", t0)
                wait_comm(self.timeline, work, f"all-reduce {u.name}")
                self._count("all_reduce", out.numel() * out.element_size(), self.replicate_size)
            out = out.to(u.shard.dtype)  # the master weights' dtype (a no-op in fp32)
            if u.shard.grad is None:
                u.shard.grad = out
            else:
                u.shard.grad.add_(out)  # gradient accumulation over backwards
            u.ready, u.reduced, u.grad_chunk = 0, False, None
            self.free(u)  # (waits first for a prefetch nobody used)
        self._average_ignored()
        self._callback_queued = False
        self._comm_last, self._comm = self._comm, {}

    def _average_ignored(self) -> None:
        """DDP for the ignored parameters: all-reduce each full gradient and
        divide by the number of data-parallel ranks (no bucketing or overlap:
        they are meant to be few and small). A parameter that got no gradient
        on this rank contributes zeros, so every rank calls every all-reduce."""
        for p in self._ignored:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.div_(self.shard_size * self.replicate_size)
            for group, n in ((self.shard_group, self.shard_size),
                             (self.replicate_group, self.replicate_size)):
                if n > 1:
                    dist.all_reduce(p.grad, group=group)
                    self._count("all_reduce", p.grad.numel() * p.grad.element_size(), n)

    # ------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that the whole model's gradient has L2 norm
        at most ``max_norm``; return the norm before clipping. The same as
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on
        one process; call it between ``backward()`` and ``optimizer.step()``.
        Collective.

        Rank r holds only chunk r of each unit's gradient, so torch's version
        over ``fsdp.parameters()`` would clip each rank by the norm of its own
        chunks: ranks would clip by different factors. Here each rank sums the
        squares of its chunks, one all-reduce over the shard group adds them
        (replicate groups hold copies of the same chunks: counted once), and
        every rank takes the same factor, ``max_norm / (norm + 1e-6)`` capped
        at 1 (torch's formula; the 1e-6 keeps a zero gradient finite).
        Padding is zero, so it adds nothing. The arithmetic is
        ``helpers.clip.sharded_clip_grad_norm_``, which ZeRO calls too.
        """
        # ignored parameters are replicated, their averaged gradient the same on
        # every rank: counted once, after the all-reduce
        return sharded_clip_grad_norm_(
            [u.shard.grad for u in self.all_units], max_norm, group=self.shard_group,
            shards=self.shard_size, replicated=[p.grad for p in self._ignored],
            device=next(self.parameters()).device)

    # ------------------------------------------------------------ inspection
    def sharded_grads(self) -> dict[str, GradShard]:
        """Each parameter's gradient as this rank holds it after backward: the
        slice ``[start, start + grad.numel())`` of the flattened parameter that
        falls in this rank's chunk, as a 1-D *view* into its unit's
        ``shard.grad`` (in the shards' dtype: fp32 master gradients under mixed
        precision). Writing into a view changes what the optimizer sees. This
        is FSDP1's ``use_orig_params=True`` view, the same piece that each
        parameter's own ``.grad`` is after backward (``helpers.fsdp.unit``);
        FSDP2 gives each parameter a DTensor gradient sharded along dim 0
        instead. A slice may be empty (the parameter lies in other ranks'
        chunks); ignored parameters give their whole (averaged, replicated)
        gradient. ``grad`` is None before the first backward and after
        ``zero_grad()``. Not collective."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {}
        for p in self._ignored:
            g = None if p.grad is None else p.grad.view(-1)
            out[names[id(p)]] = GradShard(0, g)
        for u in self.all_units:
            g = u.shard.grad
            for o in u.owned:  # (FlatPartition.owned_ranges: one per parameter)
                out[names[id(u.params[o.index])]] = GradShard(
                    o.lo, None if g is None else g[o.shard_slice])
        return out

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's averaged gradient, full shape, in the shards' dtype:
        an all-gather of each unit's ``shard.grad`` into fresh tensors (for
        inspection and tests; the training state is not touched). Collective."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        out = {names[id(p)]: p.grad.detach().clone() for p in self._ignored
               if p.grad is not None}
        for u in self.all_units:
            if u.shard.grad is None:
                continue
            full = torch.empty(u.full.numel(), dtype=u.shard.dtype, device=u.shard.device)
            if self.shard_size > 1:
                all_gather(full, u.shard.grad.detach(), group=self.shard_group)
            else:
                full.copy_(u.shard.grad)
            for p, off, shape in zip(u.params, u.bucket.offsets, u.shapes):
                out[names[id(p)]] = full[off:off + shape.numel()].view(shape).clone()
        return out
