"""Expert-parallel communication: the split-size exchange and the token all-to-all.

Follows GShard (Lepikhin et al. 2020, sec. 3.2): tokens travel to the rank of
their expert and back with two all-to-alls per MoE layer. The all-to-all
itself, with its reverse all-to-all as backward, is
``helpers.collectives.alltoall.all_to_all`` (the one Ulysses uses too),
re-exported here; ``helpers.moe.layer`` calls these in its forward.

Backward runs the same two all-to-alls in reverse (``AllToAll``): the
gradient of "send rows i..j to rank q" is "receive those rows' gradients back
from q". Router weights are replicated: their gradients are partial per rank
and must be summed/averaged over the data-parallel ranks like any DP weight.

Cost. Each all-to-all moves ``T_kept_remote * H * bytes`` from a rank, where
T_kept_remote is the number of kept (token, expert) pairs whose expert lives
elsewhere: with uniform routing a fraction (P-1)/P of k*T. Twice per layer in
forward (dispatch, combine) and twice in backward. Unlike an all-reduce, every
byte crosses to a distinct peer, so across nodes it runs at the slow link's
speed: EP groups are kept inside a node when possible.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.collectives.alltoall import all_to_all

__all__ = ["exchange_splits", "all_to_all", "alltoall_bytes"]


def exchange_splits(send_counts: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's per-expert counts for my experts: (E,) -> (P, E/P).

    ``send_counts[e]``: rows this rank sends to expert e. Row q of the result:
    rows rank q will send to each of my local experts. One all-to-all of
    P*(E/P) integers, before the token all-to-all can size its buffers.
    """
    P = dist.get_world_size(group)
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv.view(P, -1)


def alltoall_bytes(in_splits: list[int], rank: int, row_bytes: int) -> int:
    """Bytes this rank sends to *other* ranks in one all-to-all (its own part stays)."""
    return sum(n for q, n in enumerate(in_splits) if q != rank) * row_bytes
