"""Chapter 14's picture draws ``ZeroOptimizer.holdings()`` as the ranks recorded it, and
those records are the optimizer's real tensors: their sizes are what ``state_bytes()``
measures, and a sharded state's chunks tile the flat index space exactly once."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing import FRAME_TEXT_PT  # noqa: E402
from helpers.drawing.zero import STATES, draw_holdings, held_fraction  # noqa: E402

WORLD = 3   # odd: every bucket is padded


def _record(stage):
    from helpers.model import build_model
    from helpers.zero import ZeroOptimizer

    model = build_model("toy", seed=0)
    opt = ZeroOptimizer(model, stage)
    held, measured = {}, {}

    def in_forward(module, args, out):
        held["forward"] = opt.holdings()
        measured["forward"] = opt.state_bytes()

    model.blocks[0].mlp.c_fc.register_forward_hook(in_forward, prepend=True)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    held["backward"], measured["backward"] = opt.holdings(), opt.state_bytes()
    part = opt.partition
    mine = [part.shard_range(b, opt.shard_rank) for b in part.buckets]
    c_fc = {id(p) for p in model.blocks[0].mlp.c_fc.parameters()}
    unit = [(b.start, b.start + b.padded) for b in part.buckets
            if any(id(opt.params[i]) in c_fc for i in b.params)]
    return {"held": held, "measured": measured, "total": part.total, "mine": mine,
            "unit": unit, "shard_numel": part.shard_numel}


@pytest.fixture(scope="module")
def records():
    return {stage: launch(_record, WORLD, stage) for stage in range(4)}


def _merged(spans):   # [lo, hi) ranges, sorted, touching ones joined
    out = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _length(spans):
    return sum(hi - lo for lo, hi in spans)


@pytest.mark.parametrize("stage", range(4))
def test_the_picture_draws_what_the_ranks_recorded(records, stage):
    res = records[stage]
    total = res[0]["total"]
    frames = [(f"stage {stage}, {m}", [r["held"][m] for r in res]) for m in ("forward", "backward")]
    fig, data = draw_holdings(frames, total)
    # every frame carries its key (the slider shows one frame alone), and its text is
    # no smaller than the strips' smallest readable size
    for ax in fig.axes:
        assert ax.get_xlabel() == "each rank, top to bottom: weights, grads, optimizer"
        for text in [ax.title, ax.xaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]:
            assert text.get_fontsize() >= FRAME_TEXT_PT, text
    plt.close(fig)
    assert data["total"] == total
    for (label, ranks), drawn in zip(frames, data["frames"]):
        assert drawn["label"] == label
        assert drawn["ranks"] == [{s: [tuple(x) for x in held[s]] for s in STATES} for held in ranks]
        assert drawn["fraction"] == [{s: held_fraction(held[s], total) for s in STATES}
                                     for held in ranks]


@pytest.mark.parametrize("stage", range(4))
def test_the_records_are_the_optimizers_tensors(records, stage):
    """Which states are whole and which are this rank's chunks, per stage (ZeRO paper,
    sec. 5.1), read off real storages, and sized as state_bytes measures them (fp32)."""
    full = [(0, records[stage][0]["total"])]
    sharded = {0: set(), 1: {"optimizer"}, 2: {"optimizer", "grads"},
               3: {"optimizer", "grads", "weights"}}[stage]
    for r in records[stage]:
        after = r["held"]["backward"]
        for state in STATES:
            assert after[state] == (sorted(r["mine"]) if state in sharded else full), state
        # stage 3 holds the running Linear's whole bucket during its forward, nothing else
        if stage == 3:
            assert r["held"]["forward"]["weights"] == _merged(r["mine"] + r["unit"])
        m = r["measured"]["backward"]
        # fp32: 4 bytes a weight or gradient; Adam's two moments on the optimizer's part
        assert m.grads == 4 * _length(after["grads"])
        assert m.optimizer == 2 * 4 * _length(after["optimizer"])
        if stage < 3:
            assert m.params == 4 * _length(after["weights"])
        else:   # the shard, and no unit gathered after backward
            assert m.params == 4 * r["shard_numel"] == 4 * _length(after["weights"])
    # a sharded state: the ranks' chunks tile the index space once
    for state in sharded:
        spans = sorted(s for r in records[stage] for s in r["held"]["backward"][state])
        assert spans[0][0] == 0 and spans[-1][1] == full[0][1]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
