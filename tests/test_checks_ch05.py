"""Chapter 05's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch05


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


class TestChapter05(ChapterChecks):
    lab = "labs/05_batch_size_lr_scaling_lab.ipynb"
    sol = "solutions/05_batch_size_lr_scaling_solution.ipynb"
    checks = {
        "noise_scale": Check(ch05.check_noise_scale),
        "accumulate": Check(ch05.check_accumulate, slow=True),
    }
    wrong = [
        Wrong("noise_scale", _inverted, "the ratio inverted", says="B_simple is tr"),
        Wrong("noise_scale", _naive_ratio, "noise over signal from the big batch alone",
              says=None),
        Wrong("accumulate", _unscaled, "forgets the 1/k", says="1/3"),
        Wrong("accumulate", _always_sync, "all-reduces every micro-batch", says="no_sync"),
    ]
