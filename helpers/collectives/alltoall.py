"""A differentiable all-to-all of rows: the one used by Ulysses and by expert parallelism.

An all-to-all sends a different piece of a tensor to every rank: rows
``[sum(in_splits[:q]), +in_splits[q])`` of ``x`` go to rank q, and the result
holds, in rank order, the rows every rank sent here (``out_splits[q]`` of them
from rank q). No arithmetic, only a permutation of rows across ranks, so its
adjoint is the inverse permutation: the backward is the *reverse* all-to-all,
the gradient rows going back where their rows came from, ``out_splits`` and
``in_splits`` swapped (GShard, Lepikhin et al. 2020, sec. 3.2; DeepSpeed-
Ulysses, Jacobs et al. 2023, sec. 3).

Two users:

* ``helpers.sp.attention.ulysses`` turns a sequence-split q, k, v into a
  head-split one and back (equal splits, ``out_splits = in_splits = None``);
* ``helpers.moe`` dispatches token rows to the rank of their expert and
  combines the results back (variable splits, known only after the routing;
  or equal ones in its padded mode).

Why ``dist.all_to_all_single`` and not the list form ``dist.all_to_all(outs,
ins)``: torch 2.11's gloo refuses the list form ("Backend gloo does not
support alltoall"), while every version's gloo and NCCL have the single form
(tests/test_portable_collectives.py checks that helpers/ never calls the
list form). A list of equal chunks becomes one tensor by stacking them along
a new leading dimension, which the single form splits evenly over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "all_to_all"]


class AllToAll(torch.autograd.Function):
    """all_to_all_single of the rows of ``x``; backward is the reverse all-to-all.

    Forward: rows [sum(in_splits[:q]), +in_splits[q]) go to rank q. Backward:
    the gradient rows come back from q, so out/in splits swap (the all-to-all
    is a permutation of rows across ranks; its adjoint is the inverse
    permutation). Splits None: equal, dim 0 divided evenly over the ranks.
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        if out_splits is None:
            out = torch.empty_like(x)
        else:
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        if in_splits is None:
            gx = torch.empty_like(grad)
        else:
            gx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None, group=None) -> torch.Tensor:
    """Differentiable all_to_all_single of rows of ``x`` (see ``AllToAll``).

    ``in_splits[q]``: rows of ``x`` sent to rank q; ``out_splits[q]``: rows
    received from rank q. Both None: every rank sends and receives
    ``x.size(0) / world`` rows to and from each rank.
    """
    if (out_splits is None) != (in_splits is None):
        raise ValueError("give both out_splits and in_splits, or neither (equal splits)")
    return AllToAll.apply(x, None if out_splits is None else list(out_splits),
                          None if in_splits is None else list(in_splits), group)
