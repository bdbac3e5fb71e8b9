"""The layout picture draws the placement the cost model priced: its data is the planner's
record (``Candidate.layout`` and ``.memory``, a ``Plan``'s degrees), rank by rank."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers.drawing.layout import draw_rank_grid, layout_cells  # noqa: E402
from helpers.frameworks.examples import load  # noqa: E402
from helpers.mesh import MEGATRON_DIMS, axis_groups, coords_of, megatron_stride  # noqa: E402
from helpers.planner import H100_80GB, Layout, ModelSpec, evaluate  # noqa: E402
from helpers.topology import h100_cluster  # noqa: E402

LLAMA_70B = ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                      ffn=28672, kv_heads=8, gated_mlp=True)


@pytest.mark.parametrize("layout", [Layout(8, 2, 2, cp=2, zero=3), Layout(32, 1, 1, cp=2, zero=3),
                                    Layout(4, 8, 2, zero=1), Layout(2, 4, 8, zero=1)],
                         ids=["DP8-CP2-TP2-PP2", "DP32-CP2", "DP4-TP8-PP2", "DP2-TP4-PP8"])
def test_the_picture_is_the_planners_candidate(layout):
    cand = evaluate(LLAMA_70B, layout, 1024, H100_80GB, h100_cluster(8), check_memory=False)
    fig, data = draw_rank_grid(cand.layout, 8, memory=cand.memory, gpu_memory=80e9)
    plt.close(fig)
    sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp}
    assert data["sizes"] == sizes and data["memory"] == cand.memory
    assert len(data["cells"]) == layout.world == 64
    for c in data["cells"]:
        assert {k: c[k] for k in sizes} == coords_of(c["rank"], MEGATRON_DIMS, sizes)
        assert (c["node"], c["gpu"]) == divmod(c["rank"], 8)
    for axis, groups in data["groups"].items():
        assert groups == axis_groups(axis, MEGATRON_DIMS, sizes)
        # the stride the cost model places this axis's rings with
        stride = megatron_stride(axis, **sizes)
        assert all(b - a == stride for g in groups for a, b in zip(g, g[1:]))
    # TP inside a node (tp <= 8), and each stage a block of whole nodes here
    for g in data["groups"].get("tp", []):
        assert len({r // 8 for r in g}) == 1
    stages = {}
    for c in data["cells"]:
        stages.setdefault(c["pp"], set()).add(c["node"])
    assert all(not (a & b) for s, a in stages.items() for t, b in stages.items() if s < t)


def test_a_large_plan_is_drawn_by_its_first_nodes():
    plan, model, cluster = load("megatron-gpt3-175b")     # DP 8 x TP 8 x PP 16 on 1024 GPUs
    fig, data = draw_rank_grid(plan, 8, max_nodes=16)
    plt.close(fig)
    assert data["nodes"] == (16, 128) and len(data["cells"]) == 128
    assert data["cells"] == layout_cells(plan, 8, 16)
    # the first 16 nodes are stage 0 (nodes 0-7: dp 0..7) and stage 1 (nodes 8-15)
    assert {c["pp"] for c in data["cells"]} == {0, 1}
    assert [c["dp"] for c in data["cells"] if c["gpu"] == 0] == list(range(8)) * 2
    # only groups wholly drawn are listed: TP groups yes, PP groups (16 nodes apart) no
    assert len(data["groups"]["tp"]) == 16
    assert not data["groups"].get("pp")


def test_the_picture_changes_with_the_layout():
    a = layout_cells(Layout(8, 8, 1), 8)
    b = layout_cells(Layout(8, 1, 8), 8)
    assert [c["dp"] for c in a[:8]] == [0] * 8          # TP 8: a node is one replica
    assert [c["dp"] for c in b[:8]] == list(range(8))   # DP 8 innermost: a node is 8 replicas
