"""The alpha-beta cost of an all-reduce (ring, tree, halving-doubling) and bus bandwidth.

Follows Thakur et al. 2005, "Optimization of collective communication
operations in MPICH", sec. 4, Hockney 1994 for the model, and nccl-tests'
doc/PERFORMANCE.md for bus bandwidth. The algorithms themselves are in
``helpers.collectives.ring`` and ``helpers.collectives.halving_doubling``.

Cost (the alpha-beta model, Thakur et al. 2005, sec. 4; Hockney 1994)
---------------------------------------------------------------------
A message of n bytes costs alpha + n / beta (alpha: latency, seconds;
beta: link bandwidth, bytes/s). Ring all-reduce of N bytes on p ranks:

    T_ring = 2(p-1) alpha + 2 (p-1)/p * N / beta

A binomial tree (reduce to a root, then broadcast back) sends the whole
message at every one of its 2 ceil(log2 p) levels:

    T_tree = 2 ceil(log2 p) (alpha + N / beta)

so the tree wins for small messages (few alphas), the ring for large ones.
NCCL's trees are pipelined double binary trees that also reach ~2N/beta; the
simple tree here is the textbook one that shows the trade-off.

Halving-doubling (``helpers.collectives.halving_doubling``) sends the ring's
bytes in only 2 log2 p messages:

    T_hd = 2 log2(p) alpha + 2 (p-1)/p * N / beta          (p a power of two)

and 2 (alpha + N/beta) more to fold in the ranks beyond the largest power of two.

Algorithm vs bus bandwidth (nccl-tests, doc/PERFORMANCE.md)
-----------------------------------------------------------
``algbw = N / T`` depends on p for the same hardware. nccl-tests therefore
also report ``busbw = algbw * factor`` with factor 2(p-1)/p for all-reduce and
(p-1)/p for reduce-scatter and all-gather: the bytes that really crossed each
link per second, comparable with the link's peak whatever p is.
"""

from __future__ import annotations

import math

from helpers.validate import positive_int

__all__ = ["ring_all_reduce_time", "tree_all_reduce_time", "halving_doubling_all_reduce_time",
           "bus_bandwidth", "BUSBW_FACTORS"]


def _check_model_args(nbytes: float, world_size: int, alpha: float, beta: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    positive_int("world_size", world_size)
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 (seconds) and beta > 0 (bytes/s), got {alpha}, {beta}")


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """T = 2(p-1) alpha + 2(p-1)/p * nbytes / beta (Patarasuk & Yuan 2009; Thakur et al. 2005)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    p = world_size
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta


def tree_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) (alpha + nbytes/beta)
    (Thakur et al. 2005, sec. 4.1-4.2; unpipelined)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    return 2 * math.ceil(math.log2(world_size)) * (alpha + nbytes / beta)


def halving_doubling_all_reduce_time(nbytes: float, world_size: int, alpha: float,
                                     beta: float) -> float:
    """2 log2(q) alpha + 2(q-1)/q * nbytes/beta, q the largest power of two <= p, plus
    2 (alpha + nbytes/beta) to fold in the other p - q ranks (Thakur et al. 2005, sec. 4.5)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    q = 1 << (world_size.bit_length() - 1)
    t = 2 * int(math.log2(q)) * alpha + 2 * (q - 1) / q * nbytes / beta
    return t + (2 * (alpha + nbytes / beta) if q != world_size else 0.0)


# busbw = algbw * factor(p); nccl-tests doc/PERFORMANCE.md, one factor per collective.
BUSBW_FACTORS = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def bus_bandwidth(algbw: float, world_size: int, op: str = "all_reduce") -> float:
    """Bus bandwidth from algorithm bandwidth (bytes/s in, bytes/s out)."""
    if op not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {op!r}; choose from {sorted(BUSBW_FACTORS)}")
    positive_int("world_size", world_size)
    return algbw * BUSBW_FACTORS[op](world_size)
