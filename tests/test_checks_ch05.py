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


def _thirds(ddp, micro):  # 1/3 hard-coded from a first run with 3 micro-batches
    total = 0.0
    for i, (x, y) in enumerate(micro):
        if i < len(micro) - 1:
            with ddp.no_sync():
                loss = ddp(x, y)[1] / 3
                loss.backward()
        else:
            loss = ddp(x, y)[1] / 3
            loss.backward()
        total += float(loss.detach())
    return total


def _never_syncs(ddp, micro):  # no_sync around every backward: nothing is communicated
    total = 0.0
    for x, y in micro:
        with ddp.no_sync():
            loss = ddp(x, y)[1] / len(micro)
            loss.backward()
        total += float(loss.detach())
    return total


def _forward_outside(ddp, micro):  # the backwards inside no_sync, their forwards outside
    k, total = len(micro), 0.0
    for i, (x, y) in enumerate(micro):
        loss = ddp(x, y)[1] / k
        if i < k - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
        total += float(loss.detach())
    return total


def _reduce_by_hand(ddp, micro):  # everything local, then one all-reduce per tensor by hand
    import torch.distributed as dist

    k, total = len(micro), 0.0
    with ddp.no_sync():
        for x, y in micro:
            loss = ddp(x, y)[1] / k
            loss.backward()
            total += float(loss.detach())
    for p in ddp.module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return total


def _last_loss(ddp, micro):  # right gradient, returns the last micro-batch's loss
    k = len(micro)
    for i, (x, y) in enumerate(micro):
        if i < k - 1:
            with ddp.no_sync():
                (ddp(x, y)[1] / k).backward()
        else:
            loss = ddp(x, y)[1]
            (loss / k).backward()
    return float(loss.detach())


def _no_return(ddp, micro):  # right gradient, forgets to return the loss
    _last_loss(ddp, micro)


def _integer_division(gs, bs, gb, bb):  # 1 // b is 0 for b > 1
    return ((gs - gb) / (1 // bs - 1 // bb)) / ((bb * gb - bs * gs) / (bb - bs))


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
        Wrong("noise_scale", _integer_division, "integer division 1 // b",
              says="raised ZeroDivisionError"),
        Wrong("noise_scale", lambda gs, bs, gb, bb: f"{(gs - gb) / (1 / bs - 1 / bb):.3f}",
              "returns a formatted string", says="should return a number"),
        Wrong("accumulate", _thirds, "1/3 hard-coded", says="not by a fixed number"),
        Wrong("accumulate", _never_syncs, "no_sync around every backward",
              says="counted 0 bucket all-reduces: all 3 forward.s. ran inside no_sync"),
        Wrong("accumulate", _forward_outside, "backwards in no_sync, forwards outside",
              says="the forward arms the hooks"),
        Wrong("accumulate", _reduce_by_hand, "local accumulation, then all-reduced by hand",
              says="never went through the wrapper's buckets"),
        Wrong("accumulate", _last_loss, "returns the last micro-batch's loss",
              says="mean of this rank's"),
        Wrong("accumulate", _no_return, "returns None", says="got None"),
        Wrong("accumulate", _unscaled, "forgets the 1/k", says="1/k"),
        Wrong("accumulate", _always_sync, "all-reduces every micro-batch", says="no_sync"),
    ]
