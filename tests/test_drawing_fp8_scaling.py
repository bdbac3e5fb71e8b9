"""helpers.drawing.fp8_scaling: the picture is the scale and history a DelayedScaling kept."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.drawing.fp8_scaling import draw_amax_history, scaling_data  # noqa: E402
from helpers.precision import E4M3, FP8_MAX, DelayedScaling  # noqa: E402


def test_each_step_names_the_earlier_step_whose_amax_set_its_scale():
    amaxes = [1.0, 2.0, 1.0, 8.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]
    scaling = DelayedScaling(E4M3, history_len=3)
    record = []
    for t, a in enumerate(amaxes):
        x = torch.full((4,), a)
        used = scaling.scale.item()
        scaling.quantize(x)
        record.append({"scale": used if t else scaling.scale.item(), "amax": a,
                       "history": scaling.amax_history.tolist()})
    fig, data = draw_amax_history(record)
    assert fig.axes and data == scaling_data(record)
    for t, d in enumerate(data):
        assert d["amax"] == amaxes[t]
        assert d["assumed"] == FP8_MAX[E4M3] / record[t]["scale"]
        if t == 0:
            assert d["from_step"] is None
            continue
        window = range(max(0, t - 3), t)                       # the 3 steps before t
        want = max(window, key=lambda j: (amaxes[j], j))       # largest; the newest on ties
        assert d["from_step"] == want
        assert d["assumed"] == pytest.approx(amaxes[want], rel=1e-6)   # fp32 scale
        assert d["saturated"] == (amaxes[t] > d["assumed"])
    # the spike at step 3 sets the scale of the next 3 steps, then leaves the window
    assert [d["from_step"] for d in data[4:8]] == [3, 3, 3, 6]
    assert data[3]["saturated"] and data[8]["saturated"]
    # the legend names both bar colours: a red (saturated) bar must be readable
    bars = {tuple(b.get_facecolor()) for b in fig.axes[0].patches}
    handles = fig.axes[0].get_legend_handles_labels()[0]
    legend_colors = {tuple(h.patches[0].get_facecolor()) for h in handles
                     if hasattr(h, "patches")}
    assert bars <= legend_colors, (bars, legend_colors)
