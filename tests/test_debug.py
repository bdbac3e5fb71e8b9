"""The collective recorder and its cross-rank diff, on planted bugs.

Each planted bug runs on 2-3 real gloo ranks with a short timeout; the test
checks that the launch fails within that timeout (plus start-up), and that the
diff names the right rank, the right call and the line it came from. A healthy
run must yield no finding, or the diff would cry wolf.
"""

import os
import pathlib
import time

import pytest

from helpers import RankError, RankTimeout, launch
from helpers.debug import first_disagreement, straggler
from helpers.debug.diff import arrival_lateness
from helpers.debug.recorder import CallRecord
from planted_bugs import (crashes_mid_step, data_dependent_branch, failing_inside_recorder,
                          healthy_step, mismatched_dtype, mismatched_shape, recv_without_send,
                          skips_a_collective, slow_rank, swaps_two_collectives)

# Seconds before a planted deadlock is declared: every rank must have reached
# its hang by then (a tenth of a second on a quiet machine; much more when
# the cores are shared), or its record would stop short of the planted bug.
HANG = 6.0
SLACK = 15.0  # start-up and teardown on a loaded machine (never part of a check's logic)
PLANTED = pathlib.Path(__file__).with_name("planted_bugs.py")
SRC = PLANTED.read_text().splitlines()


def line_of(marker: str) -> str:
    """``tests/planted_bugs.py:NN`` (as the diff names it) of the line with ``# <marker>``."""
    n = next(i for i, s in enumerate(SRC, 1) if s.rstrip().endswith(f"# {marker}"))
    return f"{os.path.relpath(PLANTED)}:{n}"


def failed_launch(fn, world, **kw):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, world, timeout=HANG, **kw)
    assert time.monotonic() - t0 < HANG + SLACK, "the launch did not end near its timeout"
    assert info.value.diff is not None and str(info.value).endswith(info.value.diff)
    return info.value


# -- a healthy run -------------------------------------------------------------

def test_a_healthy_run_is_recorded_and_has_no_disagreement():
    out = launch(healthy_step, 3, timeout=30)
    records = {r: calls for r, (calls, _) in enumerate(out)}
    assert all(restored for _, restored in out), "the original functions were not put back"
    assert first_disagreement(records) is None
    ops0 = [c.op for c in records[0]]
    assert ops0 == ["all_reduce", "all_gather", "barrier", "send", "isend", "irecv"]
    assert [c.op for c in records[1]][3] == "recv" and records[1][3].peer == 0
    first = records[0][0]
    assert (first.seq, first.group, first.shapes, first.dtypes) == (0, (0, 1, 2), ((4,),),
                                                                    ("float32",))
    assert records[0][1].shapes == (((2, 3),) * 3, (2, 3))   # the list and the input
    assert records[0][4].peer == 1 and records[0][5].peer == 2
    assert all(c.end is not None and c.end >= c.start for calls in records.values() for c in calls)
    from helpers.debug.recorder import describe_where
    assert describe_where(first.where).endswith(line_of("HEALTHY-ALLREDUCE"))


def test_the_recorder_restores_torch_distributed_on_an_error():
    assert launch(failing_inside_recorder, 2, timeout=30) == [True, True]


# -- planted bugs ----------------------------------------------------------------

def test_a_rank_that_skips_a_collective_is_named():
    err = failed_launch(skips_a_collective, 3, record=True)
    assert isinstance(err, RankTimeout)
    assert f"rank 2's call #1 is broadcast [4] float32 at {line_of('SKIPPER-BCAST')}" in err.diff
    assert f"ranks 0, 1 called all_reduce [4] float32 (call #1 at {line_of('SKIPPED')})" in err.diff


def test_two_ranks_calling_collectives_in_different_orders():
    err = failed_launch(swaps_two_collectives, 3)
    assert f"rank 1's call #0 is broadcast [4] float32 at {line_of('SWAPPED')}" in err.diff
    assert f"ranks 0, 2 called all_reduce [4] float32 (call #0 at {line_of('IN-ORDER')})" \
        in err.diff


@pytest.mark.parametrize("detail", [False, True])
def test_a_shape_mismatch_is_named_with_and_without_detail_mode(detail, monkeypatch):
    """Plain gloo notices a size mismatch only as a failed read (a rank aborts or
    sees 'connection reset'); DETAIL mode checks every collective's fingerprint
    first and says 'Detected mismatch between collectives'. Our diff is the same."""
    if detail:
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    else:
        monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    err = failed_launch(mismatched_shape, 2, record=True)
    assert f"rank 1's call #0 is all_reduce [5] float32 at {line_of('SHAPE')}" in err.diff
    assert "rank 0 called all_reduce [4] float32" in err.diff
    if detail:
        assert "Detected mismatch between collectives" in str(err)
        assert "Tensor shapes: 4vs 5" in str(err)


def test_a_dtype_mismatch_is_named():
    err = failed_launch(mismatched_dtype, 3, record=True)
    assert f"rank 2's call #0 is all_reduce [4] float64 at {line_of('DTYPE')}" in err.diff
    assert "ranks 0, 1 called all_reduce [4] float32" in err.diff


def test_a_rank_that_crashes_mid_step_is_named_with_its_last_call():
    err = failed_launch(crashes_mid_step, 3, record=True)
    assert err.rank == 1 and err.exc_type == "died"
    assert f"ranks 0, 2 are in all_reduce [4] float32 (call #1 at {line_of('AFTER-CRASH')})" \
        in err.diff
    assert (f"rank 1 never called it: its last one was call #0, all_reduce [4] float32 at "
            f"{line_of('BEFORE-CRASH')}, then it exited with code 3") in err.diff


def test_a_data_dependent_branch_is_named():
    err = failed_launch(data_dependent_branch, 3, record=True)
    assert f"rank 2's call #0 is all_reduce [] float32 at {line_of('BRANCH')}" in err.diff
    assert f"ranks 0, 1 called all_reduce [8] float32 (call #0 at {line_of('GRAD-SYNC')})" \
        in err.diff


def test_a_recv_that_no_rank_sends_to_is_named():
    err = failed_launch(recv_without_send, 2, record=True)
    assert f"rank 1 waits in call #1 is recv [4] float32 from rank 0 at {line_of('LONELY-RECV')}" \
        in err.diff
    assert "rank 0 sent it only 0 message(s)" in err.diff


def test_a_straggler_is_named_from_arrival_times():
    out = launch(slow_rank, 3, 1, 6, timeout=30)
    records = dict(enumerate(out))
    assert first_disagreement(records) is None
    rank, late = straggler(records)
    # Rank 1 sleeps 50 ms before each all-reduce while the others wait inside
    # it, so it arrives ~50 ms after them; 25 ms leaves room for scheduling noise.
    assert rank == 1 and late > 0.025
    lateness = arrival_lateness(records)
    assert len(lateness[0]) == 6


# -- the diff on hand-made records (no ranks) ---------------------------------------

def rec(rank, seq, op="all_reduce", shape=(4,), dtype="float32", end=1.0, group=(0, 1), peer=None):
    return CallRecord(rank, seq, op, group, peer, (shape,), (dtype,), [("f.py", 10 + seq, "f")],
                      start=float(seq), end=end, world=2)


def test_a_tie_is_judged_against_the_lowest_rank_and_subgroups_are_named():
    records = {0: [rec(0, 0)], 1: [rec(1, 0, shape=(5,))]}
    f = first_disagreement(records)
    assert f.kind == "mismatch" and f.ranks == [1]
    records = {0: [rec(0, 0, group=(0,))], 1: [rec(1, 0, group=(1,))]}
    assert first_disagreement(records) is None  # two one-rank groups: nothing to agree on
    sub = rec(0, 0, group=(0,))
    assert "in group [0]" in sub.describe()


def test_a_rank_without_any_record_is_named_as_missing():
    records = {0: [rec(0, 0, end=None)]}
    f = first_disagreement(records, {0: "was still running at the timeout",
                                     1: "was still running at the timeout"})
    assert f.kind == "missing" and f.ranks == [1]
    assert "rank 1 never called it: it made no collective call in this group, then it was " \
           "still running at the timeout" in f.text


def test_a_call_that_never_returned_is_reported_when_all_agree():
    records = {0: [rec(0, 0, end=None)], 1: [rec(1, 0, end=None)]}
    f = first_disagreement(records)
    assert f.kind == "hung" and "never returned" in f.text
