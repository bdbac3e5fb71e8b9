"""Checks for chapter 18's lab: three broken training functions, diagnosed with the
collective recorder (which rank is at fault) and fixed (every rank ends with the
weights of a single-process reference).

The broken functions live here so that the lab and its tests run the same code;
``show(n)`` prints one. Each trains a linear model ``w`` (8 float64 weights) for a few
steps of data-parallel SGD on 3 ranks: every rank computes the gradient of its own
batch, the gradients are summed with an all-reduce and divided by the number of ranks.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from helpers.checks import CheckFailed, attempt, passed

__all__ = ["BROKEN", "FAULTY_RANK", "show", "run_broken", "check_diagnosis", "check_fixed",
           "batch", "reference"]

WORLD, STEPS, LR = 3, 3, 0.1


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: x [4, 8], y [4] (float64, fixed seed)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    return x, x.sum(1) + 0.1 * torch.randn(4, generator=g, dtype=torch.float64)


def n_batches(rank: int) -> int:
    """Rank 1's shard is one batch short (a dataset that does not split evenly)."""
    return STEPS - 1 if rank == 1 else STEPS


# -- the three broken training functions -------------------------------------------------

def train_skip_nonfinite() -> torch.Tensor:
    """Skip the gradient sync when the local loss is not finite."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        x, y = batch(rank, step)
        if rank == 2 and step == 1:
            x[0, 0] = float("nan")          # a corrupt sample
        loss = (x @ w - y).pow(2).mean()
        loss.backward()
        if torch.isfinite(loss):
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= LR * w.grad / world
        dist.all_reduce(loss.detach())      # the mean loss, for the log
        w.grad = None
    return w.detach()


def train_log_on_rank0() -> torch.Tensor:
    """Rank 0 logs the mean loss across ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = (x @ w - y).pow(2).mean()
        if rank == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            print(f"step {step}: loss {mean.item() / world:.4f}")
        loss.backward()
        dist.all_reduce(w.grad)
        with torch.no_grad():
            w -= LR * w.grad / world
        w.grad = None
    return w.detach()


def train_uneven_shards() -> torch.Tensor:
    """Each rank trains on every batch of its own shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(n_batches(rank)):
        x, y = batch(rank, step)
        (x @ w - y).pow(2).mean().backward()
        dist.all_reduce(w.grad)
        with torch.no_grad():
            w -= LR * w.grad / world
        w.grad = None
    return w.detach()


BROKEN = {1: train_skip_nonfinite, 2: train_log_on_rank0, 3: train_uneven_shards}
# The rank at fault in each: the one whose sequence of collectives differs from the others'
# (tests/test_checks_ch18.py checks that the recorder's diff names exactly these).
FAULTY_RANK = {1: 2, 2: 0, 3: 1}


def show(n: int) -> None:
    """Print the source of broken function ``n``."""
    print(inspect.getsource(BROKEN[n]))


def run_broken(n: int, timeout: float = 4.0) -> str:
    """Run broken function ``n`` on 3 ranks with the recorder; the launch's error
    (the recorder's diff at its end), or '' if it did not fail."""
    from helpers.launch import RankError, launch
    try:
        launch(BROKEN[n], WORLD, record=True, timeout=timeout)
    except RankError as err:
        return _summary(err)
    return ""


def _summary(err) -> str:
    """The error without the rank's traceback, ending with the diff."""
    summary = str(err).split("\n\n--- traceback")[0]
    if err.diff and err.diff not in summary:
        summary += "\n\n" + err.diff
    return summary


# -- the checks -----------------------------------------------------------------------------

def check_diagnosis(diagnose) -> None:
    """``diagnose()`` returns {bug number: the rank at fault} for bugs 1, 2, 3."""
    got = attempt(diagnose, what="diagnose")
    if not isinstance(got, dict) or set(got) != set(BROKEN):
        raise CheckFailed(f"diagnose() must return a dict with keys 1, 2, 3 (bug -> rank), "
                          f"got {got!r}")
    for n, rank in sorted(got.items()):
        if rank != FAULTY_RANK[n]:
            raise CheckFailed(
                f"bug {n}: you named rank {rank}. Read the diff again: the rank at fault is the "
                f"one whose call differs from what the others called at the same position "
                f"(or that stopped calling while they wait), not one of those waiting.")
    passed("every bug pinned on the right rank")


def reference(skip: set[int] = frozenset(), steps: int = STEPS) -> torch.Tensor:
    """Single-process data parallelism: the weights every rank should end with.
    ``skip``: steps that every rank skips (a non-finite loss anywhere)."""
    w = torch.zeros(8, dtype=torch.float64)
    for step in range(steps):
        if step in skip:
            continue
        grads = []
        for rank in range(WORLD):
            wr = w.clone().requires_grad_(True)
            x, y = batch(rank, step)
            (x @ wr - y).pow(2).mean().backward()
            grads.append(wr.grad)
        w = w - LR * torch.stack(grads).sum(0) / WORLD
    return w


# What each fix must reproduce: bug 1 skips step 1 on every rank (rank 2's loss was NaN
# there); bug 2 changes nothing in the update; bug 3 trains as many steps as the shortest
# shard has batches (what DistributedSampler(drop_last=True) or Join would give).
_WANT = {1: dict(skip={1}), 2: {}, 3: dict(steps=STEPS - 1)}


def check_fixed(n: int, fixed) -> None:
    """Your fix of broken function ``n``: runs on 3 ranks without a hang or a mismatch,
    and every rank ends with the reference weights."""
    from helpers.launch import RankError, launch
    if not callable(fixed):
        raise CheckFailed(f"pass your fixed training function, got {type(fixed).__name__}")
    try:
        got = launch(fixed, WORLD, record=True, timeout=10)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            raise CheckFailed(f"fix {n} is not implemented yet") from None
        raise CheckFailed(f"fix {n} still fails: {_summary(err)}") from None
    want = reference(**_WANT[n])
    for rank, w in enumerate(got):
        if not isinstance(w, torch.Tensor) or w.shape != (8,):
            raise CheckFailed(f"fix {n}: rank {rank} returned {w!r}, expected the 8 weights")
        # float64 throughout; the all-reduce may add the 3 gradients in another order
        # than the reference: each step's error <= 2 eps64 * sum|g_i| (about 1e-15 here),
        # and 3 steps of lr 0.1 keep it far below 1e-12.
        if not torch.allclose(w, want, rtol=0, atol=1e-12):
            diff = (w - want).abs().max().item()
            hint = {1: "when any rank's loss is not finite, every rank must skip that step "
                       "(decide with an all-reduce of a flag)",
                    2: "the update itself was right; every rank must make the same calls",
                    3: "every rank must train the same number of steps: the shortest shard's"}[n]
            raise CheckFailed(f"fix {n}: rank {rank}'s weights differ from the reference by "
                              f"{diff:.3g}: {hint}")
    passed(f"fix {n}: no hang, no mismatch, and all 3 ranks end with the reference weights")
