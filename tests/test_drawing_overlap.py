"""Chapter 16's step picture draws the spans the run recorded, and the exposed time it
reports is ``exposed_comm`` of those same spans."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.overlap import LANES, draw_step_spans  # noqa: E402
from helpers.overlap import exposed_comm  # noqa: E402


def _step(prefetch):
    from helpers.fsdp import FSDP
    from helpers.model import build_model
    from helpers.overlap import Timeline

    tl = Timeline()
    model = FSDP(build_model("toy", seed=0), prefetch=prefetch, timeline=tl)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    tl.settle()
    return tl.events


def test_the_picture_is_the_recorded_spans():
    runs = {f"prefetch {p}": launch(_step, 2, p) for p in (False, True)}
    fig, data = draw_step_spans(runs)
    plt.close(fig)
    assert list(data) == list(runs)
    for label, timelines in runs.items():
        drawn = data[label]
        t0 = min(e["start"] for tl in timelines for e in tl)
        assert drawn["t0"] == t0
        for rank, tl in enumerate(timelines):
            for lane in LANES:
                want = [(e["name"], (e["start"] - t0) * 1e3, (e["end"] - t0) * 1e3)
                        for e in tl if e["lane"] == lane]
                assert drawn["ranks"][rank][lane] == want
            assert drawn["exposed"][rank] == exposed_comm(tl)
            # every lane the picture shows was recorded, and FSDP's gathers are in it
            assert any(name.startswith("all-gather") for name, *_ in drawn["ranks"][rank]["comm"])
