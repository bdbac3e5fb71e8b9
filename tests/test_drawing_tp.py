"""helpers.drawing.tp: the picture of a split layer is what the ranks hold and issued."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.tp import (distinct_copy, draw_tp, held_indices, ownership,  # noqa: E402
                                tp_picture_data)
from helpers.tp import shard  # noqa: E402


def test_held_indices_finds_a_shard_in_its_dense_tensor():
    dense = torch.arange(24.0).view(6, 4)
    assert held_indices(dense, dense.clone()) == (None, list(range(6)))
    assert held_indices(dense, shard(dense, 0, 3, 1)) == (0, [2, 3])
    assert held_indices(dense, shard(dense, 1, 2, 1)) == (1, [2, 3])
    # a stacked projection (parts=3, as QKV): a piece of each part
    assert held_indices(dense, shard(dense, 0, 2, 0, parts=3)) == (0, [0, 2, 4])
    with pytest.raises(ValueError, match="nowhere"):
        held_indices(dense, torch.full((2, 4), -1.0))
    with pytest.raises(ValueError, match="more than one dim"):
        held_indices(dense, dense[:2, :2])


def test_two_ranks_cannot_hold_the_same_index():
    owners = [{"w": {"dim": 0, "size": 2, "held": [0]}}, {"w": {"dim": 0, "size": 2, "held": [0]}}]
    with pytest.raises(ValueError, match="held by ranks 0 and 1"):
        tp_picture_data(owners, [])
    owners[1]["w"]["held"] = []
    with pytest.raises(ValueError, match="held by no rank"):
        tp_picture_data(owners, [])


def _block_on_ranks(t):
    from helpers import rank_info
    from helpers.model import build_model
    from helpers.tp import count_collectives, tensor_parallel_block

    block = build_model("tiny", seed=0).blocks[0]
    probe = distinct_copy(block)
    tp = tensor_parallel_block(probe)
    x = torch.randn(2, 8, block.ln_1.normalized_shape[0], dtype=torch.float64,
                    device=rank_info().device)
    with count_collectives() as counter:
        tp(x).square().mean().backward()
    return ownership(probe, tp), [(c.op, c.layer, c.direction, c.nbytes) for c in counter.log]


@pytest.mark.slow
@pytest.mark.parametrize("t", [2, 4])
def test_the_block_picture_is_each_ranks_shards_and_the_counted_collectives(t):
    runs = launch(_block_on_ranks, t, t)
    fig, data = draw_tp([o for o, _ in runs], runs[0][1])
    assert fig.axes
    params = data["params"]
    # what each rank holds, from its values, is Megatron's split (helpers.tp.shard of the
    # indices): QKV by output rows in 3 parts, the projections by input columns
    for name, dim, parts in (("attn.c_attn.weight", 0, 3), ("attn.c_attn.bias", 0, 3),
                             ("attn.c_proj.weight", 1, 1), ("mlp.c_fc.weight", 0, 1),
                             ("mlp.c_fc.bias", 0, 1), ("mlp.c_proj.weight", 1, 1)):
        size = params[name]["size"]
        want = [None] * size
        for r in range(t):
            for i in shard(torch.arange(size), 0, t, r, parts).tolist():
                want[i] = r
        assert params[name]["dim"] == dim and params[name]["owner"] == want, name
    for name in ("ln_1.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"):
        assert params[name]["dim"] is None and set(params[name]["owner"]) == {"all"}
    # the collectives drawn are the ones counted on rank 0: g forward, f backward, 2 each
    assert data["collectives"] == runs[0][1]
    assert sorted((layer, d) for _, layer, d, _ in data["collectives"]) == [
        ("attn.c_attn", "backward"), ("attn.c_proj", "forward"),
        ("mlp.c_fc", "backward"), ("mlp.c_proj", "forward")]
