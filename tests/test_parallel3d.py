"""The 3-D capstone (helpers.parallel3d) equals one process: losses over 3 SGD steps
and the step-1 gradients, for dp x tp x pp = 2x2x2 (8 ranks), each pair of axes
(1x2x2, 2x1x2, 2x2x1) and each axis alone; leaving out any one axis's
communication (the DP average, TP's f, the tied-weight exchange of PP) fails the
same check; bad layouts are refused before any rank starts.

The bound (helpers.tolerance): the float32 3-D run adds the same numbers as the
float32 reference in another order (TP partial sums over heads and MLP columns,
the DP mean of two half-batch means, 1/m-scaled micro-batch gradients), so its
distance from a float64 rerun of the reference must be float32 rounding noise:
at most NOISE_FACTOR x the float32 reference's own distance from float64,
measured in the same run. A missing all-reduce moves a gradient by a sizeable
fraction of itself, thousands of times that noise.
"""

import sys

import pytest

from helpers.parallel3d import CapstoneLayout, rank_table, run_capstone

# dp, tp, pp. 2x2x2 once per mesh order: the numbers must not depend on placement.
COMPOSITIONS = [
    pytest.param(2, 2, 2, {}, id="2x2x2"),
    pytest.param(2, 2, 2, {"tp_innermost": False}, id="2x2x2-mesh-dp-tp-pp"),
    pytest.param(1, 2, 2, {"schedule": "gpipe", "micro_batches": 4}, id="1x2x2-gpipe-m4"),
    pytest.param(2, 1, 2, {}, id="2x1x2"),
    pytest.param(2, 2, 1, {}, id="2x2x1"),
]


@pytest.mark.parametrize("dp, tp, pp, extra", COMPOSITIONS)
def test_3d_run_equals_one_process(dp, tp, pp, extra):
    r = run_capstone(dp, tp, pp, steps=3, seed=0, **extra)
    assert len(r.losses) == len(r.reference_losses) == 3
    assert r.max_grad_diff <= r.bound, str(r)
    assert r.loss_diff <= r.loss_bound, str(r)
    # the bound is float32 noise (a few ulps of the largest gradient, ~1e-7 here), not a
    # loose number: a bound near 1e-4 of the loss would let a lost micro-batch through
    assert r.bound < 1e-4 * max(abs(x) for x in r.losses)
    # every rank sat where init_device_mesh puts it, as rank_table predicts
    assert r.ranks == rank_table(r.layout)
    assert r.mesh_dims == (("dp", "tp", "pp") if extra.get("tp_innermost") is False
                           else ("dp", "pp", "tp"))
    assert "loss 3-D" in str(r) and r.step_time_s > 0


# Each axis alone, and the same run with that axis's communication left out.
# Two ranks each: the cheapest run in which the omission matters.
AXES = [(2, 1, 1, "dp"), (1, 2, 1, "tp"), (1, 1, 2, "tied")]


@pytest.mark.parametrize("dp, tp, pp, omit", AXES, ids=[a[3] for a in AXES])
def test_leaving_out_one_axis_communication_fails_the_check(dp, tp, pp, omit):
    good = run_capstone(dp, tp, pp, steps=2)
    assert good.ok, str(good)
    bad = run_capstone(dp, tp, pp, steps=2, omit=omit)
    # the step-1 gradients are off by far more than float32 noise: a missing exchange
    # changes what is computed (half a batch, a partial dL/dx, half the tied gradient),
    # a change of order 1e-2..1e-1 against a bound of order 1e-7; 100 x leaves no doubt
    assert bad.max_grad_diff > 100 * bad.bound, str(bad)
    # and so the step-2 loss (after one wrong update)
    assert bad.loss_diff > bad.loss_bound, str(bad)


def test_rank_table_puts_tp_innermost_by_default():
    """Pure arithmetic of the mesh: TP neighbours adjacent by default, PP
    neighbours adjacent with the (dp, tp, pp) order."""
    def groups(layout, axis):
        out = {}
        for row in rank_table(layout):
            key = tuple(row[a] for a in ("dp", "tp", "pp") if a != axis)
            out.setdefault(key, []).append(row["rank"])
        return sorted(out.values())

    inner = CapstoneLayout(2, 2, 2)
    assert groups(inner, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(inner, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(inner, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    outer = CapstoneLayout(2, 2, 2, tp_innermost=False)
    assert groups(outer, "tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(outer, "pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


BAD = [
    (dict(tp=3), "2 heads do not divide over tensor-parallel size 3"),
    (dict(pp=3, n_layer=4), "4 layers do not divide over pipeline size 3"),
    (dict(dp=2, batch=6), "global batch 6 does not divide into dp=2 replicas x 2 micro-batches"),
    (dict(dp=0), "dp must be a positive int"),
    (dict(schedule="zb"), "schedule must be one of"),
    (dict(seq=64), "seq=64 exceeds block_size=32"),
    (dict(omit="pp"), "omit must be one of"),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m for _, m in BAD])
def test_bad_layouts_are_refused_before_any_rank_starts(kwargs, message, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a rank was started before the layout was checked")

    monkeypatch.setattr(sys.modules["helpers.parallel3d"], "launch", no_launch)
    with pytest.raises(ValueError, match=message):
        run_capstone(**kwargs)


def test_torchrun_world_size_must_match_the_layout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="2 x 2 x 2 = 8 ranks, but torchrun started WORLD_SIZE=4"):
        CapstoneLayout(2, 2, 2)
