"""DeepSpeed-Ulysses: all-to-all from sequence-split to head-split attention and back.

Follows Jacobs et al. 2023, "DeepSpeed Ulysses", sec. 3: an all-to-all turns
the sequence-split q, k, v into head-split ones, each rank runs ordinary
attention on the whole sequence for heads/cp heads, and a second all-to-all
turns the output back. Needs heads divisible by cp. The all-to-all is
``helpers.collectives.alltoall.all_to_all`` (the one expert parallelism uses
too), whose backward is the reverse all-to-all; the reordering around it is
plain tensor indexing, so autograd gives each direction the other as its
backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.collectives.alltoall import all_to_all
from helpers.sp.attention.blocks import check_qkv
from helpers.sp.layout import cp_size, positions

__all__ = ["check_ulysses", "ulysses_attention"]


def check_ulysses(heads: int, cp: int) -> None:
    """Pure: raise ValueError unless ``heads`` split over cp ranks (call before launching)."""
    if heads % cp:
        raise ValueError(f"{heads} heads do not divide over context-parallel size {cp}")


def _exchange(send, group):
    """All-to-all of equal-shaped chunks: send[j] goes to rank j, recv[j] came from rank j.

    That is the contract of the list form ``dist.all_to_all(recv, send)``, which
    torch 2.11's gloo refuses; ``all_to_all`` is the single form (module
    ``helpers.collectives.alltoall``). So the chunks are stacked along a new
    leading dimension, which it splits evenly over the ranks: row j goes to
    rank j, and row j of the result came from rank j.
    """
    stacked = torch.stack(send)                           # (cp, *chunk); copies, so contiguous
    return all_to_all(stacked, group=group).unbind(0)


def _seq_to_head(x, group, layout):
    """(B, H, S/cp, d) sequence-split -> (B, H/cp, S, d) head-split, global order."""
    cp = cp_size(group)
    recv = _exchange(x.chunk(cp, dim=1), group)           # head group j goes to rank j
    by_rank = torch.cat(recv, dim=-2)                     # rank 0's positions, rank 1's, ...
    order = torch.cat([positions(by_rank.size(-2), cp, r, layout)
                       for r in range(cp)]).to(x.device)
    return torch.empty_like(by_rank).index_copy_(2, order, by_rank)


def _head_to_seq(x, group, layout):
    """(B, H/cp, S, d) head-split, global order -> (B, H, S/cp, d) this rank's chunk."""
    cp = cp_size(group)
    order = torch.cat([positions(x.size(-2), cp, r, layout) for r in range(cp)]).to(x.device)
    send = x.index_select(2, order).chunk(cp, dim=-2)     # rank r's positions go to rank r
    recv = _exchange(send, group)
    return torch.cat(recv, dim=1)                         # heads of rank 0, rank 1, ...



def ulysses_attention(q, k, v, group=None, causal=True, layout="contiguous"):
    """All-to-all to head-split, full-sequence attention on H/cp heads, all-to-all back."""
    cp, _, _ = check_qkv(q, k, v, group, layout)
    check_ulysses(q.size(1), cp)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    q, k, v = (_seq_to_head(x, group, layout) for x in (q, k, v))  # (B, H/cp, S, d)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _head_to_seq(y, group, layout)
