"""Gradient clipping when each rank holds only a piece of the gradient.

``torch.nn.utils.clip_grad_norm_(params, max_norm)`` scales every gradient
by ``min(1, max_norm / (norm + 1e-6))``, where ``norm`` is the L2 norm of the
whole model's gradient. Under ZeRO stages 1-3 and FSDP a rank holds only its
chunks of the averaged gradient, so torch's version, run on each rank, would
take the norm of that rank's chunks: every rank would clip by a different
factor and the replicas would drift apart. ``sharded_clip_grad_norm_`` takes
the global norm instead:

    norm^2 = sum over ranks of (the squares of this rank's chunks)   one all-reduce
           + the squares of the replicated gradients                 counted once

Padding is zero and adds nothing. Each element of a sharded gradient lives on
exactly one rank of ``group``, so the all-reduce counts it once; a gradient
every rank holds whole (FSDP's ignored parameters, averaged as DDP does) is
added after the all-reduce, or it would be counted N times. Replicas of the
same shards (hybrid sharding's replicate group) already hold the same chunks:
they all-reduce inside their own shard group only. Every rank then scales by
the same factor, torch's formula (the 1e-6 keeps a zero gradient finite).

Why a module of its own: ``helpers.zero`` (``ZeroOptimizer.clip_grad_norm_``)
and ``helpers.fsdp`` (``FSDP.clip_grad_norm_``) both call it, and a learner
who wonders why the sharded optimizers clip differently from torch looks for
"clip" here, next to ``unit_gather.py``, the other piece the two share. It is
not in ``helpers/zero/partition.py``: that file is pure bookkeeping, with no
process group. Production does the same: Megatron-LM's ``clip_grad_norm_fp32``
all-reduces the summed squares over the ranks that split the gradient, and
torch's own ``clip_grad_norm_`` on FSDP2's DTensor gradients gets a partial
norm that is all-reduced.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["sharded_clip_grad_norm_"]


@torch.no_grad()
def sharded_clip_grad_norm_(sharded: Iterable[torch.Tensor | None], max_norm: float, *,
                            group=None, shards: int = 1,
                            replicated: Iterable[torch.Tensor | None] = (),
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """Clip in place so that the global gradient has L2 norm at most ``max_norm``;
    return the norm before clipping (an fp32 scalar on ``device``). Collective
    over ``group`` when ``shards > 1``.

    ``sharded``: this rank's pieces of gradients split over the ``shards``
    ranks of ``group`` (each element on exactly one of them): their squares
    are summed here and all-reduced over ``group``. ``replicated``: gradients
    every rank holds whole and identical: added once, after the all-reduce.
    None entries (no gradient) are skipped. Squares are summed in fp32, even
    for 16-bit gradients; ``device``: where the sum lives
    (that of the gradients: nccl all-reduces CUDA tensors only)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    sharded = [g for g in sharded if g is not None]
    replicated = [g for g in replicated if g is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        squares += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    if shards > 1:
        dist.all_reduce(squares, group=group)  # every rank's chunks, each counted once
    for g in replicated:  # the same on every rank: after the all-reduce
        squares += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    norm = squares.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.dtype))
    return norm
