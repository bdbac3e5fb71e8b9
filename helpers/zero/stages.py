"""ZeRO stages 0, 1 and 2: the weights stay whole on every rank.

All three keep every weight in one flat buffer (``flat_param``; each
parameter is a view into it), so the forward pass needs no communication.
They differ in what happens to the gradients:

* stage 0 (DP): a full flat gradient buffer, all-reduced (averaged) in
  ``step()``; every rank updates everything.
* stage 1: the same full gradient buffer, but ``step()`` reduce-scatters it,
  each rank updates only its chunks (its slice of Adam's moments), then an
  all-gather shares the new weights. Reduce-scatter + all-gather move the same
  bytes as one all-reduce (ZeRO sec. 7.2.1).
* stage 2: no full gradient buffer: each bucket is reduce-scattered *during
  backward* as soon as its gradients exist (``reduce_in_backward``), and a
  rank keeps only its gradient chunk.

Stages 0-1 average inside ``step()``: between ``backward()`` and ``step()``
each ``p.grad`` is this rank's local gradient, where DDP's is already the
average.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.comm import all_gather, reduce_scatter
from helpers.zero.base import ZeroOptimizer
from helpers.zero.partition import size_buckets
from helpers.zero.reduce_in_backward import ReduceScatterInBackward

__all__ = ["ZeroStage0", "ZeroStage1", "ZeroStage2"]


class _FlatWeights(ZeroOptimizer):
    """Stages 0-2: the full weights in one flat buffer, parameters are views of it."""

    def _setup(self) -> None:
        part = self.partition
        self.flat_param = self._zeros(part.total)
        for b in part.buckets:
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                seg = self.flat_param[b.start + off:b.start + off + p.numel()]
                seg.copy_(p.detach().reshape(-1))
                p.data = seg.view_as(p)
        self._broadcast(self.flat_param)
        self._setup_grads()
        # this rank's chunks of the weights: what its optimizer updates
        self._init_optimizer_state(
            [self.flat_param[slice(*part.shard_range(b, self.shard_rank))] for b in part.buckets])

    def _setup_grads(self) -> None:
        raise NotImplementedError

    def _weight_tensors(self):
        return [self.flat_param]

    def _all_gather_weights(self) -> None:
        """Every rank's updated chunks into every rank's full buffer, bucket by bucket."""
        for b, chunk in zip(self.partition.buckets, self._param_chunks):
            full = self.flat_param[b.start:b.start + b.padded]
            if self.world > 1:
                all_gather(full, chunk.clone(), group=self.group)
            self._count("all_gather", full.numel() * full.element_size())


class _LocalGradients(_FlatWeights):
    """Stages 0-1: ``p.grad`` is a view into one flat gradient buffer, so autograd
    accumulates straight into it and ``step()`` reduces it in place."""

    def _bucket_groups(self, numels, cap):
        return [list(range(len(numels)))]  # reduced once, in step(): one bucket

    def _setup_grads(self) -> None:
        part = self.partition
        self.flat_grad = self._zeros(part.total)
        self._grad_views = [None] * len(self.params)
        for b in part.buckets:
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                view = self.flat_grad[b.start + off:b.start + off + p.numel()].view_as(p)
                self._grad_views[i] = p.grad = view
        for i, p in enumerate(self.params):
            self._hooks.append(p.register_post_accumulate_grad_hook(self._relink_grad(i)))

    def _relink_grad(self, i: int):
        """After p's gradient is accumulated, make sure it lives in the flat buffer
        (``model.zero_grad()`` or an assignment may have replaced it)."""
        def hook(p):
            self._used[i] = True
            self._link_grad(i)
        return hook

    @torch.no_grad()
    def _link_grad(self, i: int) -> None:
        p, view = self.params[i], self._grad_views[i]
        g = p.grad
        if g is None:
            view.zero_()  # no gradient since the last zero_grad(set_to_none=True)
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)  # a fresh tensor holds this backward's gradient: adopt it
        if p.grad is not view:
            p.grad = view

    def _relink_all(self) -> None:
        for i in range(len(self.params)):
            self._link_grad(i)  # every p.grad a view of flat_grad again

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer and keep each ``p.grad`` a view of it
        (``set_to_none`` is ignored: the buffer is reused)."""
        super().zero_grad()
        self.flat_grad.zero_()
        for p, view in zip(self.params, self._grad_views):
            p.grad = view  # (re-)link: the next backward accumulates into the buffer


class ZeroStage0(_LocalGradients):
    """Stage 0, plain data parallelism: all-reduce the gradient, update everything."""

    def _reduce_grads(self):
        self._relink_all()
        if self.world > 1:
            self.flat_grad.div_(self.world)  # average, not sum
            dist.all_reduce(self.flat_grad, group=self.group)
        self._count("all_reduce", self.flat_grad.numel() * self.flat_grad.element_size())
        part = self.partition
        return [self.flat_grad[slice(*part.shard_range(b, 0))] for b in part.buckets]


class ZeroStage1(_LocalGradients):
    """Stage 1: reduce-scatter the gradient, update my chunks, all-gather the weights."""

    def _reduce_grads(self):
        self._relink_all()
        chunks = []
        for b in self.partition.buckets:
            src = self.flat_grad[b.start:b.start + b.padded].div(self.world)
            out = self._empty(b.chunk)
            if self.world > 1:
                reduce_scatter(out, src, group=self.group)
            else:
                out.copy_(src)
            self._count("reduce_scatter", src.numel() * src.element_size())
            chunks.append(out)
        return chunks

    def _publish_weights(self) -> None:
        self._all_gather_weights()


class ZeroStage2(ReduceScatterInBackward, _FlatWeights):
    """Stage 2: buckets reduce-scattered during backward; only my gradient chunk
    is kept; after the update, all-gather the weights as stage 1 does."""

    def _bucket_groups(self, numels, cap):
        # reduced during backward, so bucketed by size like DDP, last layers first
        return size_buckets(numels, cap)

    def _setup_grads(self) -> None:
        self.grad_shard = self._zeros(self.partition.shard_numel)
        self._install_grad_hooks()

    def _publish_weights(self) -> None:
        self._all_gather_weights()
