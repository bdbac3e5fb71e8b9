"""The collective recorder and its cross-rank diff, on planted bugs.

Each planted bug runs on 2-3 real gloo ranks with a short timeout; the test
checks that the launch fails within that timeout (plus start-up), and that the
diff names the right rank, the right call and the line it came from. A healthy
run must yield no finding, or the diff would cry wolf.
"""

import os
import pathlib
import re
import time

import pytest

from helpers import RankError, RankTimeout, launch
from helpers.debug import first_disagreement, straggler
from helpers.debug.diff import arrival_lateness
from helpers.debug.recorder import CallRecord
from planted_bugs import (a_collective_that_raises, crashes_mid_step, data_dependent_branch, ddp_steps, failing_inside_recorder,
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
    assert f"rank 2's call #1 is broadcast [4] float32 from rank 0 at {line_of('SKIPPER-BCAST')}" in err.diff
    assert f"ranks 0, 1 called all_reduce [4] float32 (call #1 at {line_of('SKIPPED')})" in err.diff


def test_two_ranks_calling_collectives_in_different_orders():
    err = failed_launch(swaps_two_collectives, 3)
    assert f"rank 1's call #0 is broadcast [4] float32 from rank 0 at {line_of('SWAPPED')}" in err.diff
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
        assert re.search(r"Tensor shapes: (4vs 5|5vs 4)", str(err))  # whichever rank saw it first


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


def test_a_call_that_raised_is_recorded_as_raised_not_returned():
    err = failed_launch(a_collective_that_raises, 2)
    assert err.rank == 0 and err.exc_type == "ValueError"
    assert (f"rank 0: #0 all_reduce [2] complex64 at {line_of('RAISES')} (raised ValueError)"
            in err.diff)
    [call] = err.records[0]
    assert (call.outcome, call.state) == ("raised ValueError", "raised ValueError")
    assert err.records[1][-1].state == "never returned"  # rank 1 still waits for it


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


# -- replica consistency ---------------------------------------------------------------

def test_healthy_replicas_are_identical():
    for before, after in launch(ddp_steps, 3, timeout=60):
        assert before.ok and after.ok, after.text


def test_a_rank_dependent_update_names_the_rank_and_first_parameter():
    out = launch(ddp_steps, 3, local_clip_on=2, timeout=60)
    for before, _ in out:
        assert not before.ok and before.rank == 2 and before.ranks == [2]
        assert before.name == "fc1.weight"  # the first parameter: every one was scaled
        assert before.n_different > 0
    assert out[0][0].text == out[1][0].text == out[2][0].text  # every rank reports the same


@pytest.mark.parametrize("what, name", [("param", "fc2.weight"),
                                        ("optimizer", "optimizer[fc2.weight].exp_avg")])
def test_a_flipped_bit_is_found_in_the_right_rank_and_tensor(what, name):
    out = launch(ddp_steps, 3, steps=1, flip_on=1, flip_what=what, timeout=60)
    for before, after in out:
        assert before.ok  # healthy until the flip
        assert not after.ok and after.rank == 1 and after.name == name
        assert after.n_different == 1  # exactly the flipped element
    assert "rank 1 diverged first at " + name in out[0][1].text


def test_the_fingerprint_sees_every_single_bit():
    import torch

    from helpers.debug.replica import fingerprint, flip_bit
    t = torch.randn(64)
    ref = fingerprint(t)
    for bit in range(32):  # each bit of one float32, flipped alone
        u = t.clone()
        flip_bit(u, index=7, bit=bit)
        assert not torch.equal(fingerprint(u), ref), bit
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    assert fingerprint(swapped)[0] == ref[0] and fingerprint(swapped)[1] != ref[1]


def test_fingerprints_meet_on_the_parameters_device_whatever_the_step_lives_on():
    """On a GPU node AdamW keeps its ``step`` on the CPU next to CUDA moments, and
    the fingerprints were stacked across the two devices (a crash). No GPU here:
    the parameters sit on the ``meta`` device (a device without values), the
    optimizer's step on the CPU, and the fingerprints must all land on meta."""
    import torch

    from helpers.debug.replica import fingerprint, local_fingerprints
    w = torch.empty(3, 4, device="meta")
    step = torch.tensor(5.0)                                    # as AdamW keeps it
    out = local_fingerprints([("w", w), ("optimizer[w].step", step)])
    assert out.device.type == "meta" and out.shape == (2, 2) and out.dtype == torch.int64
    cpu = local_fingerprints([("step", step), ("w", torch.ones(2))])
    assert cpu.device.type == "cpu" and torch.equal(cpu[0], fingerprint(step))
    assert local_fingerprints([]).shape == (0, 2)


# -- the health monitor ------------------------------------------------------------------

def _noisy_loss(steps, spike_at=None, seed=0):
    """A falling loss with 2% noise; a 3x spike at ``spike_at``."""
    import random
    rng = random.Random(seed)
    out = [4.0 * 0.99 ** s * (1 + 0.02 * rng.gauss(0, 1)) for s in range(steps)]
    if spike_at is not None:
        out[spike_at] *= 3.0
    return out


def test_the_monitor_flags_a_planted_loss_spike_and_nothing_in_normal_runs():
    from helpers.debug.monitor import HealthMonitor
    mon = HealthMonitor()
    for s, loss in enumerate(_noisy_loss(80, spike_at=50)):
        mon.log(s, loss, grad_norm=1.0 + 0.05 * (s % 3))
    assert [(a.step, a.metric) for a in mon.alerts] == [(50, "loss")]
    for seed in range(20):  # 20 normal runs of 80 steps: not one false alarm
        mon = HealthMonitor()
        for s, loss in enumerate(_noisy_loss(80, seed=seed)):
            mon.log(s, loss)
        assert mon.alerts == [], mon.alerts[0].text


def test_a_spike_would_hide_from_mean_and_std_but_not_from_the_median():
    """Two spikes close together: with mean/std the first inflates the window's
    std and the second looks normal; the robust z-score flags both."""
    from helpers.debug.monitor import robust_z
    window = [1.0 + 0.01 * (i % 3) for i in range(18)] + [3.0]   # a spike one step ago
    mean, std = sum(window) / len(window), torch_std(window)
    assert (3.0 - mean) / std < 6                               # hidden by its twin
    assert robust_z(window, 3.0) > 6


def torch_std(xs):
    import statistics
    return statistics.pstdev(xs)


def test_grad_norm_spike_tokens_mfu_and_the_writer():
    from helpers.debug.monitor import HealthMonitor

    class Writer:  # anything with add_scalar, as SummaryWriter
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    w = Writer()
    mon = HealthMonitor(n_params=1e6, peak_flops=1e12, writer=w)
    for s in range(30):
        mon.log(s, 2.0 - 0.01 * s, grad_norm=50.0 if s == 25 else 1.0 + 0.01 * (s % 4),
                tokens=1000, step_s=0.5)
    assert [(a.step, a.metric) for a in mon.alerts] == [(25, "grad_norm")]
    assert mon.history["tokens_per_s"][0] == 2000.0
    assert mon.history["mfu"][0] == pytest.approx(6 * 1e6 * 2000 / 1e12)  # 6N per token
    assert ("health/loss", 2.0, 0) in w.scalars


def test_the_gradient_norm_is_summed_on_the_gradients_device():
    """On a GPU node the gradients were added into a CPU float64 scalar (a crash:
    CUDA into CPU). The crash itself cannot be replayed without a GPU (a 0-dim
    ``meta`` tensor, unlike a CUDA one, adds into a CPU scalar without
    complaint), so this pins the rule that prevents it: the sum lives on the
    gradients' device, checked with gradients on ``meta`` (a device that holds
    shapes, not values); then the value on the CPU with mixed dtypes."""
    import torch

    from helpers.debug.monitor import global_grad_norm, sum_of_squares
    meta = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta", dtype=torch.bfloat16)]
    sq = sum_of_squares(meta)
    assert sq.device.type == "meta" and sq.dtype == torch.float64 and sq.dim() == 0
    assert sum_of_squares([]).device.type == "cpu"
    assert sum_of_squares([torch.ones(2)], device="meta").device.type == "meta"

    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.zeros(4))                      # no gradient: left out
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0], dtype=torch.bfloat16)
    assert global_grad_norm(iter([a, c, b])) == 13.0           # sqrt(9 + 16 + 144)
    assert global_grad_norm([c]) == 0.0 and global_grad_norm([]) == 0.0


def test_the_tensorboard_writer_is_optional():
    from helpers.debug.monitor import tensorboard_writer
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert tensorboard_writer("/nonexistent") is None  # says why, returns None
        pytest.skip("tensorboard is not installed (an optional extra)")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        w = tensorboard_writer(d)
        w.add_scalar("health/loss", 1.0, 0)
        w.close()


def test_stragglers_and_leaks_from_their_curves():
    from helpers.debug.monitor import leak_suspected, stragglers
    busy = {0: [0.10, 0.11, 0.10], 1: [0.10, 0.10, 0.12], 2: [0.16, 0.15, 0.17], 3: [0.1] * 3}
    assert [r for r, _ in stragglers(busy)] == [2]
    assert stragglers({r: [0.1] * 3 for r in range(4)}) == []
    assert leak_suspected([5, 9, 9, 10, 11, 12, 13]) and not leak_suspected([5, 9, 9, 9, 9, 9])


def leaky_training(leak: bool, steps: int = 8):
    """A small training loop; with ``leak`` it keeps each step's validation
    output *with its graph* (no torch.no_grad()): live saved bytes grow per step."""
    import torch

    from helpers.memory import SavedTensorCounter
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept, curve = [], []
    with SavedTensorCounter(model) as counter:
        for _ in range(steps):
            x = torch.randn(32, 16)
            (model(x) - x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            val = model(torch.randn(32, 16))          # validation forward
            kept.append(val if leak else val.detach())
            curve.append(counter.live_bytes)
    return curve


def test_a_leak_shows_as_a_rising_memory_curve():
    from helpers.debug.monitor import leak_suspected
    healthy, leaky = leaky_training(False), leaky_training(True)
    assert not leak_suspected(healthy) and leak_suspected(leaky)
    # each kept output holds its forward's saved activations: the curve rises
    # by the same bytes every step (exact: same shapes every step)
    steps = {b - a for a, b in zip(leaky, leaky[1:])}
    assert len(steps) == 1 and steps.pop() > 0


@pytest.mark.gpu
def test_cuda_memory_stats_see_allocated_and_reserved():
    import torch

    from helpers.debug.monitor import cuda_memory_stats
    x = torch.empty(1 << 20, device="cuda")
    s = cuda_memory_stats()
    assert s["allocated"] >= x.numel() * 4 and s["reserved"] >= s["allocated"]


def test_a_broadcast_from_different_roots_is_a_mismatch():
    records = {r: [rec(r, 0, op="broadcast")] for r in range(2)}
    records[0][0].root, records[1][0].root = 0, 1
    f = first_disagreement(records)
    assert f.kind == "mismatch" and f.ranks == [1] and "broadcast [4] float32 from rank 1" in f.text


def test_a_gpu_call_that_returned_but_never_completed_is_named_so():
    # Under nccl a collective returns once queued; the recorder then sends
    # ("returned", seq, t) and ("end", ...) only when its CUDA event completes.
    from helpers.debug.diff import assemble
    r0 = rec(0, 0, end=None)
    records = assemble({0: [("call", r0), ("returned", 0, 12.5)]})
    assert records[0][0].returned == 12.5 and records[0][0].end is None
    assert records[0][0].state == "scheduled, not completed"
    f = first_disagreement(records)
    assert f.kind == "hung" and f.ranks == [0]
    assert "never completed (it returned: queued on the GPU)" in f.text
    # the same call without the "returned" event: the host is still inside it
    f = first_disagreement(assemble({0: [("call", rec(0, 0, end=None))]}))
    assert "never returned" in f.text and "queued" not in f.text


class _GpuWork:
    """A Work standing in for an nccl collective queued on a GPU: it reports completed
    ``after`` seconds from now (never, with None). is_completed() is what the recorder
    polls; it never blocks."""

    def __init__(self, after):
        self.done_at = None if after is None else time.monotonic() + after

    def is_completed(self):
        return self.done_at is not None and time.monotonic() >= self.done_at


def _queued_on_the_gpu(after):
    """One recorded all-reduce that 'returns' at once and completes on the 'GPU' later."""
    import sys

    import torch

    from helpers.debug import record_collectives

    with record_collectives() as rec:
        call = rec.begin("all_reduce", {"tensor": torch.ones(2), "async_op": True},
                         sys._getframe())
        rec.finish(call, "returned", [_GpuWork(after)], torch.device("cuda"))
    return "left the recorder"


def test_the_recorder_waits_for_the_gpu_so_a_hung_call_times_out_with_the_diff():
    """nccl returns a collective to the host once queued; one that hangs on the GPU would
    let the rank function return. The recorder waits for the GPU on its way out: a call
    that completes lets the rank go on, one that never does becomes a RankTimeout whose
    diff says the call was scheduled and never completed."""
    assert launch(_queued_on_the_gpu, 2, 0.3) == ["left the recorder"] * 2
    err = failed_launch(_queued_on_the_gpu, 2, after=None)
    assert isinstance(err, RankTimeout)
    assert "never completed (it returned: queued on the GPU)" in err.diff


def _mismatch_that_returns():
    """Rank 0 sends 2 floats, rank 1 receives into a buffer of 4: gloo fills what came and
    returns (it only refuses a message larger than the buffer); on nccl the counts of a
    send and its receive must match, and wrong data or a hang is what follows."""
    import torch
    import torch.distributed as dist

    from helpers import rank_info

    if rank_info().rank == 0:
        dist.send(torch.ones(2), 1)
        return None
    got = torch.zeros(4)
    dist.recv(got, 0)
    return got.tolist()


def test_a_recorded_launch_whose_ranks_disagree_fails_even_when_every_rank_returned():
    assert launch(_mismatch_that_returns, 2)[1] == [1.0, 1.0, 0.0, 0.0]  # unrecorded: unnoticed
    with pytest.raises(RankError, match="every rank returned, but their recorded calls "
                                        "disagree") as err:
        launch(_mismatch_that_returns, 2, record=True)
    assert "rank 0's call #0 is send [2] float32 to rank 1" in err.value.diff
    assert "rank 1's matching call #0 is recv [4] float32 from rank 0" in err.value.diff


def _one_more_all_reduce():
    import torch
    import torch.distributed as dist

    from helpers import rank_info

    steps = 3 if rank_info().rank == 0 else 2   # uneven shards: rank 0 has one more batch
    for _ in range(steps):
        dist.all_reduce(torch.ones(2))


def _recv_from_a_rank_that_is_done():
    import torch
    import torch.distributed as dist

    from helpers import rank_info

    if rank_info().rank == 0:
        dist.recv(torch.zeros(2), src=1)


@pytest.mark.parametrize("fn, says", [
    (_one_more_all_reduce, "rank 0 waits in call #2 is all_reduce [2] float32"),
    (_recv_from_a_rank_that_is_done, "rank 0 waits in call #0 is recv [2] float32 from rank 1"),
])
def test_a_rank_waiting_for_one_that_returned_is_named_without_waiting_for_the_timeout(fn, says):
    """Once rank 1 has returned from the rank function, a call of rank 0's that needs it
    can never complete: the launch says so at once (from the records), not after 30 s."""
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match="can never finish") as err:
        launch(fn, 2, record=True, timeout=30)
    assert time.monotonic() - t0 < 10, "the deadlock was found only by the timeout"
    assert says in str(err.value) and "rank 1" in str(err.value)
    assert err.value.ranks == [0] and err.value.diff is not None


def test_dashboard_legend_covers_no_alert():
    """The loss panel's legend (val_loss) sits where no alert marker is: a spike late in
    the run lands in the upper right, where a fixed legend once hid it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.debug.monitor import HealthMonitor

    mon = HealthMonitor()
    for step in range(40):
        loss = 4.0 - 0.01 * step + (3.0 if step == 31 else 0.0) + 0.001 * (step % 3)
        mon.log(step, loss, val_loss=loss if step % 10 == 9 else None)
    assert any(a.metric == "loss" and a.step == 31 for a in mon.alerts)
    axes = mon.plot(("loss",))
    fig = axes[0].figure
    fig.canvas.draw()
    box = axes[0].get_legend().get_window_extent()
    for a in mon.alerts:
        x, y = axes[0].transData.transform((a.step, a.value))
        assert not (box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1), a.text
    plt.close(fig)
