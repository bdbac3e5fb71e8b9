"""Failure arithmetic: how often a big job breaks, and how often to checkpoint.

If each of N GPUs (with its host, links and software) fails independently at
a constant rate 1/m (m = the MTBF of one GPU), the job, which stops when any
of them fails, fails at rate N/m: its MTBF is m / N. Twice the GPUs, half the
time between interruptions.

Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4,
Table 5): 16,384 H100s, 466 job interruptions in a 54-day snapshot, 419 of
them unexpected (hardware above all: GPUs, HBM3). That is one unexpected
interruption every 3.1 hours, and (with the formula above) a per-GPU MTBF of
about 50,000 hours, almost six years: a very reliable GPU, multiplied by
16,384.

Checkpointing every tau seconds with a save that stalls training for C
seconds, on a job with MTBF M and restart cost R, loses a fraction of about

    C / tau            (time spent saving)
  + (tau / 2 + R) / M  (per failure: half an interval of redone work, plus the restart)

The sum is smallest at tau* = sqrt(2 C M) (Young 1974, "A first order
approximation to the optimum checkpoint interval", CACM 17(9)); Daly 2006
("A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3), eq. 37) refines it for C not small against M. Goodput is
1 minus that fraction. ``simulate_goodput`` replays random failures to check
the first-order formula against a measurement of the model it approximates.
"""

from __future__ import annotations

import math
import random

__all__ = ["LLAMA3", "job_mtbf", "per_gpu_mtbf", "young_interval", "daly_interval",
           "lost_fraction", "goodput", "simulate_goodput"]

# Dubey et al. 2024, sec. 3.3.4 and Table 5.
LLAMA3 = {"gpus": 16_384, "days": 54, "interruptions": 466, "unexpected": 419}


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")


def job_mtbf(gpu_mtbf: float, n_gpus: int) -> float:
    """MTBF of a job that stops when any of ``n_gpus`` independent GPUs fails."""
    _positive(gpu_mtbf=gpu_mtbf, n_gpus=n_gpus)
    return gpu_mtbf / n_gpus


def per_gpu_mtbf(hours: float, failures: int, n_gpus: int) -> float:
    """The per-GPU MTBF that ``failures`` in ``hours`` on ``n_gpus`` GPUs imply."""
    _positive(hours=hours, failures=failures, n_gpus=n_gpus)
    return hours / failures * n_gpus


def young_interval(cost: float, mtbf: float) -> float:
    """tau* = sqrt(2 C M) (Young 1974): the interval that minimizes ``lost_fraction``."""
    _positive(cost=cost, mtbf=mtbf)
    return math.sqrt(2 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly 2006, eq. 37: higher-order optimum; equals M once C >= 2M."""
    _positive(cost=cost, mtbf=mtbf)
    if cost >= 2 * mtbf:
        return mtbf
    x = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost


def lost_fraction(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """First-order share of wall time not spent on new training (see module docstring)."""
    _positive(interval=interval, cost=cost, mtbf=mtbf)
    return cost / interval + (interval / 2 + restart) / mtbf


def goodput(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    return max(0.0, 1.0 - lost_fraction(interval, cost, mtbf, restart))


def simulate_goodput(interval: float, cost: float, mtbf: float, restart: float = 0.0,
                     work: float | None = None, seed: int = 0) -> float:
    """Replay a job of ``work`` seconds of training under exponential failures
    (mean ``mtbf``): train ``interval``, save ``cost``, repeat; a failure loses
    everything since the last completed save and costs ``restart``. Returns
    work / wall time."""
    _positive(interval=interval, cost=cost, mtbf=mtbf)
    work = work if work is not None else 2000 * mtbf
    rng = random.Random(seed)
    done = wall = 0.0
    next_fail = rng.expovariate(1 / mtbf)
    while done < work:
        segment = min(interval, work - done) + cost  # train, then save
        if wall + segment <= next_fail:
            wall += segment
            done += segment - cost
        else:  # the failure hits during this segment: its work is lost
            wall = next_fail + restart
            next_fail = wall + rng.expovariate(1 / mtbf)
    return done / wall
