"""Chapter 18's picture of the recorder draws each rank's recorded calls and marks the
first disagreement ``helpers.debug.first_disagreement`` finds in those same records."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers import RankError, launch  # noqa: E402
from helpers.debug import first_disagreement  # noqa: E402
from helpers.drawing import FRAME_TEXT_PT  # noqa: E402
from helpers.drawing.recorder import call_lists, draw_call_lists  # noqa: E402
from planted_bugs import crashes_mid_step, skips_a_collective, swaps_two_collectives  # noqa: E402


@pytest.mark.parametrize("bug,odd", [(skips_a_collective, [2]), (swaps_two_collectives, [1]),
                                     (crashes_mid_step, [1])],
                         ids=["skips", "swaps", "crashes"])
def test_the_picture_is_the_records_and_their_diff(bug, odd):
    with pytest.raises(RankError) as info:
        launch(bug, 3, record=True, timeout=6)
    records = info.value.records
    fig, data = draw_call_lists({"bug": records, "again": records})
    # every text inside its own cell, at the readable size: nothing runs into the next
    # rank's column (an outcome such as "raised RuntimeError" wraps instead)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        cells = [p.get_window_extent(renderer) for p in ax.patches]
        for t in ax.texts:
            assert t.get_fontsize() >= FRAME_TEXT_PT, t
            box = t.get_window_extent(renderer)
            assert any(c.x0 - 1 <= box.x0 and box.x1 <= c.x1 + 1 and c.y0 - 1 <= box.y0
                       and box.y1 <= c.y1 + 1 for c in cells), (t.get_text(), box)
    plt.close(fig)
    drawn = data["bug"]
    assert drawn == call_lists(records)
    for r, calls in records.items():
        assert drawn["ranks"][r] == [c.describe() for c in calls]
        assert drawn["states"][r] == [c.state for c in calls]
    found = first_disagreement(records)
    assert drawn["finding"]["ranks"] == found.ranks == odd
    assert drawn["finding"]["marked"] == {r: (None if c is None else c.seq)
                                          for r, c in found.calls.items()}
    # the marked row is where the odd rank's list parts from the others'
    row = drawn["finding"]["row"]
    others = [r for r in records if r not in odd]
    assert len({tuple(drawn["ranks"][r][:row]) for r in records}) == 1
    odd_call = drawn["ranks"][odd[0]][row] if row < len(drawn["ranks"][odd[0]]) else None
    assert all(odd_call != drawn["ranks"][r][row] for r in others)
