"""helpers.drawing.accumulation: chapter 05's picture is the recorded micro-batches and
all-reduces."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.accumulation import (accumulation_counts, draw_accumulation,  # noqa: E402
                                          record_accumulation)


@pytest.mark.slow
@pytest.mark.parametrize("k, windows", [(4, 2), (3, 1)])
def test_one_all_reduce_per_window_with_no_sync_and_k_without(k, windows):
    runs = {"no_sync": launch(record_accumulation, 2, k, windows, True)[0],
            "every": launch(record_accumulation, 2, k, windows, False)[0]}
    _, data = draw_accumulation(runs)
    for label, events in runs.items():
        assert data[label]["events"] == [tuple(e) for e in events]
        assert data[label]["counts"] == accumulation_counts(events)
    for w in range(windows):
        # the toy GPT's gradient fits one bucket: one all-reduce per reducing backward
        assert data["no_sync"]["counts"][w] == {"micro": k, "reducing": 1, "all-reduces": 1}
        assert data["every"]["counts"][w] == {"micro": k, "reducing": k, "all-reduces": k}
    # with no_sync the one reducing micro-batch is the last of its window, and its
    # all-reduce comes after it, before the step
    events = runs["no_sync"]
    for w in range(windows):
        mine = [e for e in events if e[1] == w]
        assert [e[3] for e in mine if e[0] == "micro"] == [False] * (k - 1) + [True]
        assert [e[0] for e in mine][-2:] == ["all-reduce", "step"]


@pytest.mark.slow
def test_smaller_buckets_mean_more_all_reduces_in_the_same_window():
    events = launch(record_accumulation, 2, 2, 1, True, 2, "toy", 0.02)[0]
    counts = accumulation_counts(events)[0]
    assert counts["reducing"] == 1 and counts["all-reduces"] > 1
