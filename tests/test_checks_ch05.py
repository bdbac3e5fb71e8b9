"""Chapter 05's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest

from helpers.checks import CheckFailed, ch05
from tools.nbtool import exercise

LAB, SOL = "labs/05_batch_size_lr_scaling_lab.ipynb", "solutions/05_batch_size_lr_scaling_solution.ipynb"


def _unscaled(ddp, micro):  # forgets the 1/k: k times the gradient
    k = len(micro)
    total = 0.0
    for i, (x, y) in enumerate(micro):
        if i < k - 1:
            with ddp.no_sync():
                loss = ddp(x, y)[1]
                loss.backward()
        else:
            loss = ddp(x, y)[1]
            loss.backward()
        total += float(loss.detach()) / k
    return total


def _always_sync(ddp, micro):  # right gradient, but k all-reduces per step
    total = 0.0
    for x, y in micro:
        loss = ddp(x, y)[1] / len(micro)
        loss.backward()
        total += float(loss.detach())
    return total


def _inverted(gs, bs, gb, bb):  # |G|^2 / tr(Sigma)
    G2 = (bb * gb - bs * gs) / (bb - bs)
    return G2 / ((gs - gb) / (1 / bs - 1 / bb))


def _naive_ratio(gs, bs, gb, bb):  # "noise over signal" from the big batch alone
    return (gs - gb) / gb


def test_noise_scale(capsys):
    ch05.check_noise_scale(exercise(SOL, "noise_scale"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch05.check_noise_scale(exercise(LAB, "noise_scale"))
    with pytest.raises(CheckFailed, match="B_simple is tr"):
        ch05.check_noise_scale(_inverted)
    with pytest.raises(CheckFailed):
        ch05.check_noise_scale(_naive_ratio)


def test_accumulate_stub_fails_without_starting_ranks():
    with pytest.raises(CheckFailed, match="not implemented"):
        ch05.check_accumulate(exercise(LAB, "accumulate"))


@pytest.mark.slow
def test_accumulate_solution_passes_and_mistakes_fail(capsys):
    ch05.check_accumulate(exercise(SOL, "accumulate"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="1/3"):
        ch05.check_accumulate(_unscaled)
    with pytest.raises(CheckFailed, match="no_sync"):
        ch05.check_accumulate(_always_sync)
