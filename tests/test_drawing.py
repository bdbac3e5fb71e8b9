"""helpers.drawing: the shared conventions of the mechanism pictures (the pictures
themselves are tested against their runs' records in the chapters' test files)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers.drawing import (COLUMN_INCHES, RANK_COLORS, draw_strip, rank_color,  # noqa: E402
                             strip_frame_size, strip_layout)


def test_a_rank_has_one_colour_everywhere():
    assert rank_color(0) == RANK_COLORS[0] and rank_color(3) == RANK_COLORS[3]
    assert rank_color(len(RANK_COLORS)) == rank_color(0)
    assert len(set(RANK_COLORS)) == len(RANK_COLORS)


@pytest.mark.parametrize("steps, per_row, want", [(1, None, (1, 1)), (3, None, (1, 3)),
                                                  (4, None, (2, 2)), (6, None, (2, 3)),
                                                  (7, None, (3, 3)), (8, 2, (4, 2))])
def test_a_strip_has_at_most_three_frames_a_row(steps, per_row, want):
    assert strip_layout(steps, per_row) == want


def test_a_strip_draws_every_frame_once_in_order():
    drawn = []
    fig = draw_strip(lambda ax, step: drawn.append(step), 7)
    assert drawn == list(range(7))
    assert sum(ax.axison for ax in fig.axes) == 7  # the last two places of the 3 x 3 grid are off
    with pytest.raises(ValueError, match="at least one frame"):
        strip_layout(0)
    with pytest.raises(ValueError, match="1 to 3 frames"):
        strip_layout(6, per_row=6)


@pytest.mark.parametrize("steps", [1, 2, 3, 6, 14])
@pytest.mark.parametrize("frame_size", [(2.0, 2.0), (3.4, 3.0), (6.0, 4.0)])
def test_a_strip_is_no_wider_than_the_sites_column(steps, frame_size):
    # wider, the site shrinks the figure and its labels with it (six 3-in frames: 47 %)
    fig = draw_strip(lambda ax, step: None, steps, frame_size=frame_size)
    w, h = fig.get_size_inches()
    plt.close(fig)
    assert w <= COLUMN_INCHES + 1e-9
    cols = strip_layout(steps)[1]
    fw, fh = strip_frame_size(cols, frame_size)
    assert fw / fh == pytest.approx(frame_size[0] / frame_size[1])   # the frame keeps its shape
    assert fw == pytest.approx(min(frame_size[0], COLUMN_INCHES / cols))
