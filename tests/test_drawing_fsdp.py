"""Chapter 15's picture of FSDP units draws the lives FSDP recorded (lane "held"), and
those lives are FSDP's own accounting: whole while computing, twice per step unless kept
after forward, and their largest overlap is the peak of gathered bytes FSDP measures."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.fsdp import draw_unit_lives, unit_lives  # noqa: E402


def _one_step(reshard, prefetch):
    from helpers.fsdp import FSDP
    from helpers.model import build_model
    from helpers.overlap import Timeline

    tl = Timeline()
    model = FSDP(build_model("toy", seed=0, n_layer=3), reshard_after_forward=reshard,
                 prefetch=prefetch, timeline=tl)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, x)[1].backward()
    sizes = {u.name: u.full.numel() * u.full.element_size() for u in model.all_units}
    return {"events": tl.events, "peak": model.peak_gathered_bytes, "sizes": sizes}


@pytest.mark.parametrize("reshard,prefetch", [(True, True), (True, False), (False, False)])
def test_the_picture_is_the_recorded_lives(reshard, prefetch):
    res = launch(_one_step, 2, reshard, prefetch)
    fig, data = draw_unit_lives([r["events"] for r in res])
    plt.close(fig)
    assert data["units"] == ["root", "blocks.0", "blocks.1", "blocks.2"]
    for r, drawn in zip(res, data["ranks"]):
        assert drawn == unit_lives(r["events"], data["t0"])
        held, computing = drawn["held"], drawn["computing"]
        # a unit computes only while whole
        for unit, spans in computing.items():
            for a, b in spans:
                assert any(lo <= a and b <= hi for lo, hi in held[unit]), (unit, a, b)
        # gathered for forward and again for backward, unless kept after forward
        for unit in ("blocks.0", "blocks.1", "blocks.2"):
            assert len(held[unit]) == (2 if reshard else 1), unit
        assert len(held["root"]) == 1
        # the largest overlap of lives, in bytes, is FSDP's own peak of gathered bytes
        points = sorted([(a, r["sizes"][u]) for u, s in held.items() for a, _ in s]
                        + [(b, -r["sizes"][u]) for u, s in held.items() for _, b in s],
                        key=lambda p: (p[0], p[1]))
        now = peak = 0
        for _, d in points:
            now += d
            peak = max(peak, now)
        assert peak == r["peak"]
    # prefetch: a block's life starts before the previous block's forward ends
    if prefetch:
        lives = data["ranks"][0]
        assert lives["held"]["blocks.1"][0][0] < lives["computing"]["blocks.0"][0][1]
