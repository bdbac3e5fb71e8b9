"""Which global rank sits where on a grid of parallel axes: the one rank-order rule.

A mesh is named by its axes, outermost (slowest) first, exactly as
``torch.distributed.device_mesh.init_device_mesh(dev, shape,
mesh_dim_names=dims)`` names them: the ranks are ``torch.arange(world)
.view(shape)``, so the *last* axis varies fastest and consecutive ranks differ
in it. With ``dims = ("dp", "pp", "tp")`` and every size 2, rank 5 is
(dp, pp, tp) = (1, 0, 1).

Every module that needs "which ranks form a group" or "how far apart are a
group's ranks" asks here:

* ``helpers.parallel3d`` (chapter 20's capstone): ``rank_table`` for its
  (dp, pp, tp) or (dp, tp, pp) mesh;
* ``helpers.costs.axes`` (chapters 19-20's cost model): the stride of the TP,
  CP, DP and PP groups in Megatron-LM's order, ``MEGATRON_DIMS``;
* ``helpers.fsdp.hybrid_grid`` (chapter 16's HSDP): a (replicate, shard) mesh;
* ``helpers.topology.hierarchical.grid_layout`` (chapter 07): (node, local).

Megatron-LM's ``RankGenerator`` (megatron/core/parallel_state.py) writes its
order fastest first, "tp-cp-ep-dp-pp"; ``MEGATRON_DIMS`` is the same order
outermost first, without ep (expert parallelism adds no GPUs: it splits the
dp x cp ranks that hold the same layer). Pure Python: it starts no ranks.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from helpers.validate import is_int, positive_int

__all__ = ["MEGATRON_DIMS", "megatron_stride", "mesh_size", "coords_of", "rank_at", "rank_coords",
           "axis_stride", "axis_groups"]

MEGATRON_DIMS = ("pp", "dp", "cp", "tp")  # outermost first: tp fastest, pp slowest


def _check(dims: Sequence[str], sizes: Mapping[str, int]) -> None:
    if len(set(dims)) != len(dims):
        raise ValueError(f"mesh axes must be distinct, got {tuple(dims)}")
    for d in dims:
        if d not in sizes:
            raise ValueError(f"no size given for mesh axis {d!r} (sizes: {dict(sizes)})")
        positive_int(f"size of mesh axis {d!r}", sizes[d])


def mesh_size(dims: Sequence[str], sizes: Mapping[str, int]) -> int:
    """The number of ranks: the product of the axes' sizes."""
    _check(dims, sizes)
    return math.prod(sizes[d] for d in dims)


def axis_stride(axis: str, dims: Sequence[str], sizes: Mapping[str, int]) -> int:
    """How many ranks apart two neighbours on ``axis`` are: the product of the
    sizes of the axes after it (the faster ones). The last axis has stride 1."""
    _check(dims, sizes)
    if axis not in dims:
        raise ValueError(f"{axis!r} is not an axis of the mesh {tuple(dims)}")
    return math.prod(sizes[d] for d in dims[list(dims).index(axis) + 1:])


def megatron_stride(axis: str, *, tp: int = 1, cp: int = 1, dp: int = 1, pp: int = 1) -> int:
    """``axis_stride`` on Megatron-LM's mesh (``MEGATRON_DIMS``): 1 for tp, tp for
    cp (and for the merged dp x cp group, whose fastest axis is cp), tp cp for
    dp, tp cp dp for pp."""
    return axis_stride(axis, MEGATRON_DIMS, {"tp": tp, "cp": cp, "dp": dp, "pp": pp})


def coords_of(rank: int, dims: Sequence[str], sizes: Mapping[str, int]) -> dict[str, int]:
    """``rank``'s coordinate on every axis, in ``dims`` order."""
    world = mesh_size(dims, sizes)
    if not is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not in 0..{world - 1} (mesh {dict(sizes)})")
    out, rest = {}, rank
    for d in reversed(dims):
        out[d] = rest % sizes[d]
        rest //= sizes[d]
    return {d: out[d] for d in dims}


def rank_at(coords: Mapping[str, int], dims: Sequence[str], sizes: Mapping[str, int]) -> int:
    """The global rank at ``coords`` (the inverse of ``coords_of``)."""
    _check(dims, sizes)
    rank = 0
    for d in dims:
        c = coords[d]
        if not 0 <= c < sizes[d]:
            raise ValueError(f"coordinate {d}={c} is outside 0..{sizes[d] - 1}")
        rank = rank * sizes[d] + c
    return rank


def rank_coords(dims: Sequence[str], sizes: Mapping[str, int]) -> list[dict[str, int]]:
    """Every global rank's coordinates, rank 0 first."""
    return [coords_of(r, dims, sizes) for r in range(mesh_size(dims, sizes))]


def axis_groups(axis: str, dims: Sequence[str], sizes: Mapping[str, int]) -> list[list[int]]:
    """The groups along ``axis``: the ranks that differ only in their ``axis``
    coordinate, each group in coordinate order, groups ordered by their first
    rank (the order in which every rank must create them with ``dist.new_group``)."""
    stride = axis_stride(axis, dims, sizes)
    groups: dict[int, list[int]] = {}
    for r, c in enumerate(rank_coords(dims, sizes)):
        groups.setdefault(r - c[axis] * stride, []).append(r)
    return [groups[k] for k in sorted(groups)]
