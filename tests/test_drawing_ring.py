"""helpers.drawing.ring: chapter 03's ring picture is the messages the ranks sent."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT  # noqa: E402
from helpers.drawing.ring import decode, draw_ring, encode, record_ring, ring_steps  # noqa: E402


def test_a_sum_of_encoded_chunks_decodes_to_its_chunk_and_ranks():
    p = 5
    for chunk in range(p):
        for ranks in ([0], [1, 3], [0, 1, 2, 3, 4]):
            value = sum(int(encode(r, p, 1)[chunk]) for r in ranks)
            assert decode(value, p) == (chunk, tuple(ranks))
    with pytest.raises(ValueError, match="no sum"):
        decode(0, p)


@pytest.mark.slow
@pytest.mark.parametrize("world, order", [(3, None), (4, None), (4, [0, 2, 1, 3])])
def test_the_picture_holds_the_recorded_messages_and_what_they_leave(world, order):
    sends = launch(record_ring, world, 2, order)
    fig, steps = draw_ring(sends)
    pos = list(range(world)) if order is None else order
    assert len(steps) == 2 * (world - 1) and len(fig.axes) == len(steps)
    for s, step in enumerate(steps):
        # the frame's arrows are the recorded messages of that step, rank by rank
        assert step["messages"] == [(src, *sends[src][s]) for src in range(world)]
        assert step["phase"] == ("reduce-scatter" if s < world - 1 else "all-gather")
        for src, dst, chunk, ranks in step["messages"]:
            i = pos.index(src)
            assert dst == pos[(i + 1) % world]                     # to the right neighbour
            want = (i - s - 1) % world if s < world - 1 else (i - (s - world + 1)) % world
            assert chunk == want                                   # chapter 03's chunk index
    # after the reduce-scatter, position i's rank holds all of chunk i; at the end, all
    done = steps[world - 2]["holds"]
    for i, r in enumerate(pos):
        assert done[r][i] == list(range(world))
    assert all(h == list(range(world)) for row in steps[-1]["holds"] for h in row)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4, 5])
def test_the_strip_reads_in_the_sites_column(world):
    # shown at its natural size (no wider than the column), every label at least
    # FRAME_TEXT_PT, and the wrap-around arrow inside its frame (it used to be clipped)
    fig, steps = draw_ring(launch(record_ring, world), frame_size=(3.4, 3.0))
    assert fig.get_size_inches()[0] <= COLUMN_INCHES + 1e-9
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        texts = ax.texts + ax.get_xticklabels() + ax.get_yticklabels() + [ax.title]
        assert min(t.get_fontsize() for t in texts if t.get_text()) >= FRAME_TEXT_PT
        box = ax.get_window_extent(renderer)
        for arrow in ax.patches[-world:]:                  # the step's messages, drawn last
            ext = arrow.get_window_extent(renderer)
            assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1
    plt.close(fig)
