"""Halving-doubling all-reduce: the ring's bytes in 2 log2 p messages.

Follows Rabenseifner 2004, "Optimization of collective reduction operations",
and Thakur et al. 2005, "Optimization of collective communication operations
in MPICH", sec. 4.5. Its time is ``halving_doubling_all_reduce_time`` in
``helpers.collectives.cost``.

It gets both the tree's few messages and the ring's few bytes:
a reduce-scatter by *recursive halving* (log2 p steps; at step k a rank
swaps half of what it still owns with the partner whose rank differs in one
bit, and adds) and an all-gather by *recursive doubling* (the same partners
in reverse order, each step doubling what a rank owns). It sends the ring's
2(p-1)/p * N bytes in only 2 log2 p messages:

    T_hd = 2 log2(p) alpha + 2 (p-1)/p * N / beta          (p a power of two)

For other p, the first 2r ranks (r = p - 2^floor(log2 p)) pair up before and
after: the even one of each pair hands its whole tensor to the odd one and
gets the sum back at the end, which adds 2 (alpha + N/beta) to the time
(Thakur et al. fold only half the vector each way; we fold it whole, simpler
and at most one extra N/beta). MPICH uses it for long messages when p is a
power of two; NCCL does not (rings and trees only).
"""

from __future__ import annotations

import torch

from helpers.collectives.ring import chunk_bounds, check_summable, flat_view, post_pair, \
    ring_neighbours

__all__ = ["halving_doubling_all_reduce"]


def _swap(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it; return when both are done."""
    for req in post_pair(send, recv, peer, peer, group):
        req.wait()


def halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over the group by recursive halving, then recursive doubling.

    Rabenseifner 2004, "Optimization of collective reduction operations";
    Thakur et al. 2005, sec. 4.5. Same result as ``dist.all_reduce`` up to
    summation order (exact for integers); any p (see the module docstring for
    how ranks beyond the largest power of two are folded in).
    """
    flat = flat_view(tensor)
    check_summable(flat, "halving_doubling_all_reduce")
    rank, p, _, _ = ring_neighbours(group)
    if p == 1:
        return tensor
    q = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - q                  # ranks 0..2*extra-1 pair up: even ones sit out
    if rank < 2 * extra and rank % 2 == 0:
        _swap(flat, flat[:0], rank + 1, group)   # hand my whole tensor to rank + 1
        _swap(flat[:0], flat, rank + 1, group)   # and get the finished sum back
        return tensor
    if rank < 2 * extra:
        buf = torch.empty_like(flat)
        _swap(flat[:0], buf, rank - 1, group)
        flat.add_(buf)                           # (N,) += partner's (N,)
        me = rank // 2
    else:
        me = rank - extra
    real = lambda v: 2 * v + 1 if v < extra else v + extra  # virtual rank -> group rank
    bounds = chunk_bounds(flat.numel(), q)
    elems = lambda lo, hi: (bounds[lo][0], bounds[hi - 1][1])  # chunks [lo, hi) -> elements
    lo, hi = 0, q  # the chunks this rank is still responsible for
    # the largest half ever received is the first step's lower half (chunk_bounds puts
    # the extra elements in the first chunks)
    buf = torch.empty(bounds[q // 2 - 1][1], dtype=flat.dtype, device=flat.device)
    # Recursive halving: distance q/2, q/4, ..., 1. Keep the half of [lo, hi) that
    # contains chunk `me`, send the other half to the partner, add the partner's
    # copy of mine. After log2 q steps [lo, hi) = [me, me + 1).
    d = q // 2
    while d:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & d == 0 else ((mid, hi), (lo, mid))
        (a, b), (c, e) = elems(*keep), elems(*give)
        _swap(flat[c:e], buf[:b - a], real(me ^ d), group)
        flat[a:b].add_(buf[:b - a])              # (half,) += partner's (half,)
        lo, hi = keep
        d //= 2
    # Recursive doubling: distance 1, 2, ..., q/2. Swap what I own for the
    # partner's equally large neighbouring block, written straight into place.
    d = 1
    while d < q:
        width = hi - lo
        plo = lo + width if me & d == 0 else lo - width  # the partner's block
        (a, b), (c, e) = elems(lo, hi), elems(plo, plo + width)
        _swap(flat[a:b], flat[c:e], real(me ^ d), group)
        lo, hi = min(lo, plo), max(hi, plo + width)
        d *= 2
    if rank < 2 * extra:
        _swap(flat, flat[:0], rank - 1, group)   # the sum back to the rank that sat out
    return tensor
