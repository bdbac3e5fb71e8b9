"""helpers.drawing.ring: chapter 03's ring picture is the messages the ranks sent."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers import launch  # noqa: E402
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
