"""helpers.drawing.recompute: the picture is what the saved-tensor hooks recorded, per layer."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from helpers.drawing.recompute import draw_saved, layer_of, saved_by_layer  # noqa: E402
from helpers.memory import SavedTensorCounter  # noqa: E402
from helpers.model import build_model  # noqa: E402
from helpers.recompute import apply_recompute  # noqa: E402


def _counter(mode):
    model = build_model("toy", n_layer=3, dropout=0.1)
    apply_recompute(model, mode)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with SavedTensorCounter(model) as counter:
        model(idx, idx)[1].backward()
    return counter


def test_layer_names():
    assert layer_of("blocks.3.attn.c_attn") == "blocks.3"
    assert layer_of("wte") == layer_of("<top>") == layer_of("lm_head") == "ends"


def test_the_bars_are_the_counters_records_per_layer():
    counters = {mode: _counter(mode) for mode in ("none", "selective", "full")}
    fig, data = draw_saved(counters)
    assert fig.axes and set(data) == set(counters)
    for mode, counter in counters.items():
        rows = data[mode]
        assert rows == saved_by_layer(counter)
        # kept: the forward's bytes, exactly the counter's total
        assert sum(r["kept"] for r in rows.values()) == counter.total_bytes
        # re-saved in backward: every storage that came alive after the forward's, once
        alive = [n for _, n in counter.log if n > 0]
        assert sum(r["recomputed"] for r in rows.values()) == sum(alive) - counter.total_bytes
        assert sum(r["recomputed"] for r in rows.values()) <= \
            sum(rec.storage_bytes for rec in counter.records if rec.in_backward)
    blocks = [f"blocks.{i}" for i in range(3)]
    assert all(data["none"][b]["recomputed"] == 0 for b in blocks)          # nothing rebuilt
    assert all(data["full"][b]["recomputed"] > 0 for b in blocks)           # every block rebuilt
    assert all(data["full"][b]["kept"] < data["selective"][b]["kept"] < data["none"][b]["kept"]
               for b in blocks)
    # what a recompute rebuilds is at most what no recompute keeps, layer by layer
    assert all(data[m][b]["recomputed"] <= data["none"][b]["kept"]
               for m in ("selective", "full") for b in blocks)
    assert data["none"]["ends"]["recomputed"] == data["selective"]["ends"]["recomputed"] == 0
