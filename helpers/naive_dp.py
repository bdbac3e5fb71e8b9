"""Naive data parallelism: every rank a full replica, gradients averaged after backward.

What
----
Synchronous SGD over p ranks (Dean et al. 2012 call the asynchronous variant
Downpour; the synchronous one is the baseline of Goyal et al. 2017, sec. 3).
The global batch of B examples is cut into p shards of B/p. Rank r computes
the gradient g_r of the mean loss over its shard. Because the mean over the
global batch is the mean of the shard means (equal shard sizes),

    grad L_B = (1/p) sum_r g_r

so after one all-reduce (sum) and a division by p, every rank holds the
gradient a single process would have computed on the whole batch, and the
same optimizer step keeps the replicas identical. It is the same update
mathematically, not bitwise: floating-point sums in a different order round
differently (about 1e-7 relative in fp32).

Cost
----
* Memory: every rank holds the full model state (weights, gradients,
  optimizer); nothing is saved by adding ranks (ZeRO, ch. 14, attacks this).
* Communication: an all-reduce of every gradient each step, 2(p-1)/p * bytes
  of the gradients through each link (ch. 03).
* Idle time: the all-reduce starts after the *whole* backward has finished
  (nothing overlaps; ch. 04 fixes that), and it is a barrier: the step of
  every rank takes as long as the slowest rank's backward (stragglers).

How production differs: DDP (``torch.nn.parallel.DistributedDataParallel``)
packs gradients into buckets and starts each bucket's all-reduce while backward
is still running (see ``helpers.ddp``). Here each gradient is its own
all-reduce, after backward, which is what a first implementation does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.comm import world_size

__all__ = ["broadcast_parameters", "average_gradients", "unique_parameters"]


def unique_parameters(module: nn.Module, trainable_only: bool = True) -> list[nn.Parameter]:
    """Parameters in registration order, a tied weight once, frozen ones dropped."""
    # module.parameters() already yields a shared tensor once (tied embeddings).
    return [p for p in module.parameters() if p.requires_grad or not trainable_only]


def broadcast_parameters(module: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (in place).

    Replicas must start identical, or averaging gradients does not keep them
    identical. ``src`` is a rank of ``group``.
    """
    if world_size(group) == 1:
        return
    src_global = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for t in list(unique_parameters(module, trainable_only=False)) + list(module.buffers()):
            dist.broadcast(t.data, src_global, group=group)


def average_gradients(module: nn.Module, group=None) -> int:
    """All-reduce every parameter's ``.grad`` and divide by the world size, in place.

    A parameter whose ``.grad`` is None on this rank is skipped; that must be
    so on every rank (same model, same code path), or the ranks would call
    different numbers of collectives and hang. Returns the number of
    all-reduces issued (one per gradient: the cost ch. 04 reduces). With one
    rank (or no process group) it does nothing, like single-process code.
    """
    p = world_size(group)
    calls = 0
    for param in unique_parameters(module):
        if param.grad is None:
            continue
        if p > 1:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            calls += 1
        param.grad.div_(p)  # sum of p shard means -> mean over the global batch
    return calls
