"""helpers.drawing.memory: chapter 06's picture is the saved-tensor counter's log."""

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402

from helpers.drawing.memory import (draw_saved_over_step, part_of,  # noqa: E402
                                    record_saved_over_step)
from helpers.memory import SavedTensorCounter  # noqa: E402
from helpers.model import build_model  # noqa: E402


def _model_and_batch(n_layer=2):
    model = build_model("toy", dropout=0.1, n_layer=n_layer).to(torch.bfloat16).train()
    g = torch.Generator().manual_seed(0)
    T = model.config.block_size
    return model, torch.randint(0, 64, (2, T), generator=g), torch.randint(0, 64, (2, T),
                                                                          generator=g)


def test_the_bands_are_the_counters_log():
    model, x, y = _model_and_batch()
    record = record_saved_over_step(model, x, y)
    _, data = draw_saved_over_step(record)
    live = data["live"]
    assert len(live) == len(record["log"]) + 1 and live[0] == [0] * len(data["parts"])
    for k, (owner, delta) in enumerate(record["log"]):     # each step of the stack is one entry
        j = data["parts"].index(part_of(owner))
        assert [b - a for a, b in zip(live[k], live[k + 1])] == \
            [delta if i == j else 0 for i in range(len(data["parts"]))]
    # the height at the end of forward is what the counter says the forward left
    forward = sum(live[data["forward_events"]])
    with SavedTensorCounter(model) as counter:
        model(x, y)
    assert forward == record["total_bytes"] == counter.total_bytes
    assert max(map(sum, live)) == record["peak_bytes"]
    assert live[-1] == [0] * len(data["parts"])             # backward freed everything
    assert data["parts"] == ["embedding", "blocks.0", "blocks.1", "head and loss"]


def test_backward_frees_the_blocks_top_down():
    model, x, y = _model_and_batch(n_layer=3)
    _, data = draw_saved_over_step(record_saved_over_step(model, x, y))
    live, parts = data["live"], data["parts"]
    gone = {p: next(k for k in range(data["forward_events"], len(live))
                    if live[k][parts.index(p)] == 0) for p in ("blocks.0", "blocks.1", "blocks.2")}
    assert gone["blocks.2"] < gone["blocks.1"] < gone["blocks.0"]
