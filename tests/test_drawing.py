"""helpers.drawing: the shared conventions of the mechanism pictures (the pictures
themselves are tested against their runs' records in the chapters' test files)."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers.drawing import RANK_COLORS, draw_strip, rank_color, strip_layout  # noqa: E402


def test_a_rank_has_one_colour_everywhere():
    assert rank_color(0) == RANK_COLORS[0] and rank_color(3) == RANK_COLORS[3]
    assert rank_color(len(RANK_COLORS)) == rank_color(0)
    assert len(set(RANK_COLORS)) == len(RANK_COLORS)


@pytest.mark.parametrize("steps, per_row, want", [(1, None, (1, 1)), (6, None, (1, 6)),
                                                  (7, None, (2, 4)), (8, 3, (3, 3))])
def test_a_strip_fits_the_column(steps, per_row, want):
    assert strip_layout(steps, per_row) == want


def test_a_strip_draws_every_frame_once_in_order():
    drawn = []
    fig = draw_strip(lambda ax, step: drawn.append(step), 7)
    assert drawn == list(range(7))
    assert sum(ax.axison for ax in fig.axes) == 7  # the eighth place of the 2 x 4 grid is off
    with pytest.raises(ValueError, match="at least one frame"):
        strip_layout(0)
