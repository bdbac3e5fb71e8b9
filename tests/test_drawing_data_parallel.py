"""helpers.drawing.data_parallel: chapter 02's picture is the ranks' recorded rows and grads."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers import RankError, launch  # noqa: E402
from helpers.drawing.data_parallel import (draw_dp_step, global_batch_gradient,  # noqa: E402
                                           record_dp_step)


@pytest.mark.slow
@pytest.mark.parametrize("world, batch", [(2, 8), (3, 6)])
def test_the_picture_is_the_run(world, batch):
    record = launch(record_dp_step, world, batch)
    reference = global_batch_gradient(batch)
    fig, data = draw_dp_step(record, reference)
    # the colours have a scale (a colour bar, labelled with the value the ends stand for),
    # and the figure is no wider than the site's column
    from helpers.drawing import COLUMN_INCHES
    bars = [ax for ax in fig.axes if "largest |element|" in ax.get_xlabel()]
    assert len(bars) == 1 and fig.get_size_inches()[0] <= COLUMN_INCHES + 1e-9
    assert data["world"] == world
    assert data["rows"] == {r: rec["rows"] for r, rec in enumerate(record)}
    assert sorted(i for rows in data["rows"].values() for i in rows) == list(range(batch))
    assert data["local"] == [rec["local"] for rec in record]
    assert data["averaged"] == [rec["averaged"] for rec in record]
    # the all-reduce hands every rank the same vector, the mean of the local ones, which
    # is one process's gradient on the whole batch (float32 summation order aside)
    assert all(a == data["averaged"][0] for a in data["averaged"])
    mean = [sum(col) / world for col in zip(*data["local"])]
    assert data["averaged"][0] == pytest.approx(mean, rel=1e-5, abs=1e-9)
    assert data["reference"] == pytest.approx(mean, rel=1e-5, abs=1e-9)
    assert data["largest_difference"] < 1e-6
    # different rows, different local gradients
    assert data["local"][0] != data["local"][1]


@pytest.mark.slow
def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(RankError, match="does not split"):
        launch(record_dp_step, 3, 8)
