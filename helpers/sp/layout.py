"""Which sequence positions each rank holds, and moving between the full sequence and chunks.

Context parallelism (CP) cuts the *sequence* of every activation over cp
ranks. Two layouts (``positions`` gives rank r's global positions):

* ``"contiguous"``: rank r holds [r S/cp, (r+1) S/cp). Simple, but with a
  causal mask the last rank's queries see the whole sequence and the first
  rank's see only their own chunk: the work per rank grows with r.
* ``"zigzag"`` (load-balanced): the sequence is cut into 2 cp chunks and rank
  r holds chunk r and chunk 2 cp - 1 - r, one early and one late, so every
  rank has the same number of unmasked score entries. Llama 3 uses it for its
  context parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models",
  sec. 3.3.2) and so does Megatron-LM's ``--context-parallel-size``.

``shard_sequence`` is a slice (differentiable, no communication);
``gather_sequence`` is an all-gather put back in global order (for checking
and printing; it is not differentiable).

Sequence lengths that do not divide (by cp, or by 2 cp for zigzag) are
refused with a message naming the constraint; production pads instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.comm import group_rank, world_size
__all__ = ["LAYOUTS", "cp_size", "cp_rank", "check_layout", "positions", "shard_sequence",
           "gather_sequence"]

LAYOUTS = ("contiguous", "zigzag")


def cp_size(group=None) -> int:
    """Ranks in the context-parallel group (1 without a process group)."""
    return world_size(group)


def cp_rank(group=None) -> int:
    """This rank's index in the context-parallel group (0 without a process group)."""
    return group_rank(group)


def check_layout(seq: int, cp: int, layout: str) -> None:
    """Raise ValueError naming the constraint unless ``seq`` splits over cp ranks in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    chunks = cp if layout == "contiguous" else 2 * cp
    if seq % chunks:
        raise ValueError(f"sequence length {seq} does not divide into {chunks} chunks "
                         f"({layout} layout over context-parallel size {cp})")


def positions(seq: int, cp: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions (LongTensor, ascending) that ``rank`` holds of a length-``seq`` sequence."""
    check_layout(seq, cp, layout)
    if layout == "contiguous":
        c = seq // cp
        return torch.arange(rank * c, (rank + 1) * c)
    c = seq // (2 * cp)
    early, late = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(early * c, (early + 1) * c),
                      torch.arange(late * c, (late + 1) * c)])


def shard_sequence(x: torch.Tensor, group=None, layout: str = "contiguous",
                   dim: int = -2) -> torch.Tensor:
    """The full sequence (same on every rank) -> this rank's chunk along ``dim``.

    Default ``dim=-2``: attention's (batch, heads, seq, head_dim).
    """
    pos = positions(x.size(dim), cp_size(group), cp_rank(group), layout)
    return x.index_select(dim, pos.to(x.device))


def gather_sequence(x: torch.Tensor, group=None, layout: str = "contiguous",
                    dim: int = -2) -> torch.Tensor:
    """Every rank's chunk -> the full sequence in global order, on every rank (all-gather)."""
    cp = cp_size(group)
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    seq = x.size(dim) * cp
    order = torch.cat([positions(seq, cp, r, layout) for r in range(cp)])  # where each row goes
    full = torch.empty_like(torch.cat(parts, dim))
    full.index_copy_(dim % x.dim(), order.to(x.device), torch.cat(parts, dim))
    return full
