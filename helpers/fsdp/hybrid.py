"""Hybrid sharding (HSDP): shard inside a group of ranks, replicate across groups.

Chapter 15, section "Hybrid sharding on 4 ranks". Zhao et al. 2023 ("PyTorch
FSDP", sec. 3.2.2): shard each unit inside a shard group (a node, fast links)
and keep one copy of those shards in every shard group. The ranks form one
grid of shape (replicate, shard): a row is a shard group, a column a
replicate group. Gradients are reduce-scattered in the row, then each chunk
is all-reduced down the column (``helpers.fsdp.grads``), so only 1/S of the
gradient's bytes cross the slow links; every all-gather of weights stays in
the row. The price is memory: the state is sharded over S ranks, not all.

Pass both groups to ``FSDP(model, shard_group=..., replicate_group=...)``.
How production differs: FSDP2 takes a 2-D ``DeviceMesh`` (``("replicate",
"shard")``) and builds the groups itself; the grid is the same.
"""

from __future__ import annotations

import torch.distributed as dist

from helpers.mesh import axis_groups

__all__ = ["hybrid_grid", "hybrid_groups"]


def hybrid_grid(world_size: int, shard_size: int) -> list[list[int]]:
    """Ranks as a (replicate, shard) grid: row i is shard group i.

    Column j (``[row[j] for row in grid]``) is replicate group j.
    ``hybrid_grid(4, 2) -> [[0, 1], [2, 3]]``.
    """
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} must divide world_size={world_size}")
    sizes = {"replicate": world_size // shard_size, "shard": shard_size}
    return axis_groups("shard", ("replicate", "shard"), sizes)


def hybrid_groups(shard_size: int):
    """(shard_group, replicate_group) of the calling rank. Collective: every
    rank must call it (every rank takes part in creating every group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = hybrid_grid(world, shard_size)
    mine_shard = mine_rep = None
    for row in grid:  # same creation order on every rank
        g = dist.new_group(row)
        if rank in row:
            mine_shard = g
    for j in range(shard_size):
        col = [row[j] for row in grid]
        g = dist.new_group(col)
        if rank in col:
            mine_rep = g
    return mine_shard, mine_rep
