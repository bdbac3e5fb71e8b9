"""helpers.mesh is the one rank-order rule; the modules that lay ranks out agree with it."""

import itertools

import pytest
import torch

from helpers import mesh
from helpers.fsdp import hybrid_grid
from helpers.parallel3d import CapstoneLayout, rank_table
from helpers.topology.hierarchical import grid_layout


@pytest.mark.parametrize("shape", [(2, 3, 2), (1, 4), (3,), (2, 1, 2, 2)])
def test_rank_coords_are_init_device_meshs_arange_view(shape):
    dims = tuple("abcd"[:len(shape)])
    sizes = dict(zip(dims, shape))
    grid = torch.arange(mesh.mesh_size(dims, sizes)).view(shape)
    for rank, c in enumerate(mesh.rank_coords(dims, sizes)):
        assert grid[tuple(c[d] for d in dims)].item() == rank
        assert mesh.rank_at(c, dims, sizes) == rank
    for i, d in enumerate(dims):
        assert mesh.axis_stride(d, dims, sizes) == grid.stride(i)
        # the groups along d: every line of the grid along dimension i
        lines = grid.movedim(i, -1).reshape(-1, shape[i]).tolist()
        assert mesh.axis_groups(d, dims, sizes) == sorted(lines)


def test_megatron_order_is_tp_cp_dp_pp_fastest_first():
    assert mesh.MEGATRON_DIMS == ("pp", "dp", "cp", "tp")
    tp, cp, dp, pp = 2, 3, 2, 2
    assert mesh.megatron_stride("tp", tp=tp, cp=cp, dp=dp, pp=pp) == 1
    assert mesh.megatron_stride("cp", tp=tp, cp=cp, dp=dp, pp=pp) == tp
    assert mesh.megatron_stride("dp", tp=tp, cp=cp, dp=dp, pp=pp) == tp * cp
    assert mesh.megatron_stride("pp", tp=tp, cp=cp, dp=dp, pp=pp) == tp * cp * dp


@pytest.mark.parametrize("tp_innermost", [True, False])
def test_parallel3d_rank_table_agrees(tp_innermost):
    layout = CapstoneLayout(dp=2, tp=2, pp=2, tp_innermost=tp_innermost)
    sizes = {"dp": 2, "tp": 2, "pp": 2}
    expected = mesh.rank_coords(layout.mesh_dims, sizes)
    assert [{k: row[k] for k in sizes} for row in rank_table(layout)] == expected


@pytest.mark.parametrize("world, shard", [(4, 2), (8, 4), (6, 1), (6, 6)])
def test_fsdp_hybrid_grid_agrees(world, shard):
    dims, sizes = ("replicate", "shard"), {"replicate": world // shard, "shard": shard}
    grid = hybrid_grid(world, shard)
    assert grid == mesh.axis_groups("shard", dims, sizes)
    assert [list(col) for col in zip(*grid)] == mesh.axis_groups("replicate", dims, sizes)


@pytest.mark.parametrize("world, g", [(6, 3), (8, 2), (4, 4)])
def test_topology_grid_layout_agrees(world, g):
    rows, cols = grid_layout(world, g)
    dims, sizes = ("node", "local"), {"node": world // g, "local": g}
    assert rows == mesh.axis_groups("local", dims, sizes)
    assert cols == mesh.axis_groups("node", dims, sizes)


def test_costs_use_the_megatron_strides(monkeypatch):
    """costs.axes prices each group at the stride helpers.mesh gives it."""
    from helpers.costs import axes
    from helpers.topology import h100_cluster

    seen = []
    monkeypatch.setattr(axes, "collective_time",
                        lambda topo, op, nbytes, size, stride: seen.append(stride) or 0.0)
    topo = h100_cluster(4)
    for tp, cp in itertools.product((1, 2, 4), (2, 4)):
        seen.clear()
        from helpers.frameworks.plan import ModelSpec
        model = ModelSpec(layers=2, hidden=64, heads=8, vocab=128, seq=64)
        axes.cp_cost(model, topo, tp=tp, cp=cp, micro_batch=1, layers=2, micro_batches=1)
        assert set(seen) == {mesh.megatron_stride("cp", tp=tp, cp=cp)}


def test_mesh_refuses_nonsense():
    with pytest.raises(ValueError, match="size of mesh axis 'tp' must be a positive int"):
        mesh.rank_coords(("tp",), {"tp": 0})
    with pytest.raises(ValueError, match="no size given for mesh axis 'pp'"):
        mesh.axis_stride("pp", ("pp",), {})
    with pytest.raises(ValueError, match="rank 8 is not in 0..7"):
        mesh.coords_of(8, ("a", "b"), {"a": 2, "b": 4})
