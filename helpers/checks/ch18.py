"""Checks for chapter 18's lab: three broken training functions, diagnosed with the
collective recorder (which rank is at fault) and fixed (every rank ends with the
weights of a single-process reference).

The broken functions live here so that the lab and its tests run the same code;
``show(n)`` prints one. Each trains a linear model ``w`` (8 float64 weights) for a few
steps of data-parallel SGD on 3 ranks: every rank computes the gradient of its own
batch, the gradients are summed with an all-reduce and divided by the number of ranks.
"""

from __future__ import annotations

import contextlib
import io
import re

import inspect

import torch
import torch.distributed as dist

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.course_answers import refusing
from helpers.launch.info import rank_device, rank_info

__all__ = ["BROKEN", "FAULTY_RANK", "show", "run_broken", "recorded_calls",
           "check_first_disagreement", "check_diagnosis", "check_fixed", "batch", "reference"]

WORLD, STEPS, LR = 3, 3, 0.1

# The data the training functions see. The lab's: rank 2's batch at step 1 holds a NaN,
# rank 1's shard is one batch short. ``check_fixed`` also runs each fix on other data
# (``_PROFILES``), so that a fix written for this one profile (skip step 1, train 2 steps)
# is caught; it sets the profile inside the ranks, before calling the fix.
_DATA = {"corrupt": {(2, 1)}, "shards": {1: STEPS - 1}}


def _own(rank: int, what: str) -> None:
    """Inside a job a rank reads only its own data (no rank knows another's shard)."""
    if dist.is_available() and dist.is_initialized() and rank != dist.get_rank():
        raise RuntimeError(f"rank {dist.get_rank()} asked for rank {rank}'s {what}: a rank sees "
                           f"only its own data; what it must know of the others', it learns "
                           f"with a collective")


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: x [4, 8], y [4] (float64, fixed seed), drawn on
    the CPU (the same values everywhere) and moved to the calling rank's device. Some
    batches hold a corrupt sample, a NaN (in the lab's data, rank 2's at step 1)."""
    _own(rank, "batch")
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    y = x.sum(1) + 0.1 * torch.randn(4, generator=g, dtype=torch.float64)
    if (rank, step) in _DATA["corrupt"]:
        x[0, 0] = float("nan")
    return x.to(rank_device()), y.to(rank_device())


def n_batches(rank: int) -> int:
    """How many batches rank ``rank``'s shard holds: STEPS, or fewer for a shard of a dataset
    that does not split evenly (in the lab's data rank 1's is one batch short)."""
    _own(rank, "shard size")
    return _DATA["shards"].get(rank, STEPS)


def _clean_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` without the ownership rule or the corruption: for the reference."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    y = x.sum(1) + 0.1 * torch.randn(4, generator=g, dtype=torch.float64)
    return x, y


# -- the three broken training functions -------------------------------------------------

def train_skip_nonfinite() -> torch.Tensor:
    """Skip the gradient sync when the local loss is not finite."""
    rank, world = dist.get_rank(), dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, device=rank_info().device, requires_grad=True)
    for step in range(STEPS):
        x, y = batch(rank, step)            # rank 2's batch at step 1 holds a NaN
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
    w = torch.zeros(8, dtype=torch.float64, device=rank_info().device, requires_grad=True)
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
    w = torch.zeros(8, dtype=torch.float64, device=rank_info().device, requires_grad=True)
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


def recorded_calls(n: int, timeout: float = 4.0) -> dict[int, list[str]]:
    """Run broken function ``n`` on 3 ranks with the recorder; each rank's collectives,
    in order, as strings like ``"all_reduce [8] float64"`` (what the lab's diff reads)."""
    from helpers.launch import RankError, launch
    try:
        launch(BROKEN[n], WORLD, record=True, timeout=timeout)
    except RankError as err:
        return {rank: [c.describe() for c in calls if not c.is_p2p]
                for rank, calls in sorted(err.records.items())}
    raise RuntimeError(f"broken function {n} did not fail")


# -- the checks -----------------------------------------------------------------------------

# (per-rank calls, expected answer, the mistake the case is there for). Dict keys are
# deliberately not always in rank order: the answer must not depend on it.
_AR8, _AR0, _BC8 = "all_reduce [8] float64", "all_reduce [] float64", "broadcast [8] float64"
_DIFF_CASES = [
    ({0: [_AR8, _AR0], 1: [_AR8, _AR0], 2: [_AR8, _AR0]}, None,
     "every rank made the same calls: the answer is None"),
    ({0: [_AR8, _AR0], 1: [_AR8, _AR0], 2: [_AR0, _AR8]}, (0, [2]),
     "the odd one out is the rank whose call differs from the majority's"),
    ({0: [_AR0, _AR8], 1: [_AR8, _AR0], 2: [_AR8, _AR0]}, (0, [0]),
     "rank 0 is not the reference: here rank 0 is the odd one out (compare with the "
     "majority, not with rank 0)"),
    ({0: [_AR8, _AR8, _AR8], 1: [_AR8, _AR8], 2: [_AR8, _AR8, _AR8]}, (2, [1]),
     "a rank whose list ends while the others still have a call (it stopped, returned "
     "early or died) is at fault there; zip() stops at the shortest list and hides it"),
    ({3: [_AR8, _AR8, _AR8, _AR8], 0: [_AR8, _AR8, _AR8, _AR8], 2: [_AR8, _AR8, _AR8],
      1: [_AR8, _AR8]}, (2, [1]),
     "two ranks stop early at different places: only rank 1 is missing at index 2 "
     "(rank 2 still made that call)"),
    ({0: [_AR8, _AR8, _AR8, _BC8, _AR8], 1: [_AR8, _AR8, _AR8, _AR8, _AR8],
      2: [_AR8, _AR8, _AR8, _AR8, _AR8], 3: [_AR8, _AR8, _AR8, _AR8, _AR8],
      4: [_AR8, _AR8, _AR8, _AR8, _AR8]}, (3, [0]),
     "5 ranks, the first disagreement after three equal calls (indexes count from 0)"),
    ({3: [_AR8, _AR0], 1: [_AR0, _AR0], 2: [_AR8, _AR0], 0: [_AR0, _AR0]}, (0, [2, 3]),
     "a 2-2 tie: the reference is the call of the lowest rank (rank 0), so ranks 2 and 3 "
     "are the odd ones, listed in sorted order"),
    ({1: [_AR8], 0: [_AR8, _AR8], 2: [_AR8]}, (1, [1, 2]),
     "the majority has stopped: rank 0 is the only one still calling, and ranks 1 and 2 "
     "never made call #1 (the rule for missing calls, not a majority vote)"),
]


def _describe(calls: dict) -> str:
    return "{" + ", ".join(f"{r}: {v}" for r, v in calls.items()) + "}"


def check_first_disagreement(first_disagreement) -> None:
    """``first_disagreement(calls) -> (index, ranks) | None``: the recorder's cross-rank
    diff, from each rank's list of calls.

    The cases, each there for one mistake learners make:

    * identical lists -> None (not ``(len, [])``);
    * comparing every rank with rank 0 instead of with the majority (rank 0 is odd);
    * ``zip`` over the lists, which stops at the shortest one and misses a rank that
      stopped calling;
    * naming every rank shorter than the longest, instead of those missing at the first
      index where one is missing;
    * an index that counts from 1, or is the length of the common prefix plus one;
    * a tie broken by whichever rank comes first in the dict (the keys are not in rank
      order) instead of by the lowest rank; ranks returned unsorted;
    * a majority vote over missing calls (when most ranks have stopped, the ones that
      stopped are still the ones missing);
    * loose types: the index must be an int, the ranks a list of ints;
    * ``helpers.debug.first_disagreement`` itself called: switched off while it runs.
    """
    for calls, want, why in _DIFF_CASES:
        given = {r: list(v) for r, v in calls.items()}  # the learner may not change ours
        with refusing(exercise="first_disagreement", paths={"helpers.debug.diff.first_disagreement": "it is "
                                           "the course's answer to this exercise: write the "
                                           "diff yourself"}):
            got = attempt(first_disagreement, given,
                          what=f"first_disagreement({_describe(calls)})")
        if want is None:
            if got is not None:
                raise CheckFailed(f"first_disagreement({_describe(calls)}) returned {got!r}; "
                                  f"expected None: {why}")
            continue
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise CheckFailed(f"first_disagreement({_describe(calls)}) returned {got!r}; "
                              f"expected the pair {want!r}: {why}")
        index, ranks = got
        if type(index) is not int or not isinstance(ranks, list) or \
                any(type(r) is not int for r in ranks):
            raise CheckFailed(f"first_disagreement({_describe(calls)}) returned {got!r}: the "
                              f"index must be an int and the ranks a list of ints")
        if (index, ranks) != want:
            raise CheckFailed(f"first_disagreement({_describe(calls)}) returned {got!r}, "
                              f"expected {want!r}: {why}")
    passed(f"first_disagreement finds the first differing call and the rank(s) at fault in "
           f"{len(_DIFF_CASES)} cases (3 to 5 ranks: mismatches, ties, ranks that stopped)")


def check_diagnosis(diagnose) -> None:
    """``diagnose()`` returns {bug number: the rank at fault} for bugs 1, 2, 3.

    Catches: naming a waiting rank instead of the one whose call differs or that
    stopped (each bug has one), a dict without all three bugs, and a rank given as a
    list (``[2]``: what the diff returns, not the rank in it)."""
    got = attempt(diagnose, what="diagnose")
    if not isinstance(got, dict) or set(got) != set(BROKEN):
        raise CheckFailed(f"diagnose() must return a dict with keys 1, 2, 3 (bug -> rank), "
                          f"got {got!r}")
    for n, rank in sorted(got.items()):
        if type(rank) is not int:
            raise CheckFailed(f"bug {n}: the answer should be one rank (an int), got {rank!r}")
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
            x, y = _clean_batch(rank, step)
            (x @ wr - y).pow(2).mean().backward()
            grads.append(wr.grad)
        w = w - LR * torch.stack(grads).sum(0) / WORLD
    return w


# The data each fix is run on: the lab's, then one where its answer differs. Bug 1: a NaN
# on other ranks at other steps (a fix that skips "step 1" fails). Bug 3: shards of 5, 3 and
# 4 batches, where the shortest (3) is neither the lab's 2 nor the mean rounded down (4),
# nor what a sum over ranks divided by 3 gives (4).
_PROFILES = {
    1: [{"corrupt": {(2, 1)}, "shards": {}}, {"corrupt": {(0, 0), (1, 2)}, "shards": {}}],
    2: [{"corrupt": set(), "shards": {}}],
    3: [{"corrupt": set(), "shards": {1: STEPS - 1}}, {"corrupt": set(),
                                                     "shards": {0: 5, 1: 3, 2: 4}}],
}


def _want(n: int, profile: dict) -> dict:
    """What fix ``n`` must reproduce on ``profile``: bug 1 skips, on every rank, each step
    where some rank's loss is NaN; bug 2 changes nothing in the update; bug 3 trains as
    many steps as the shortest shard has batches (what DistributedSampler(drop_last=True)
    or Join would give)."""
    if n == 1:
        return dict(skip={step for _, step in profile["corrupt"]})
    if n == 3:
        return dict(steps=min(profile["shards"].get(r, STEPS) for r in range(WORLD)))
    return {}


def _run_with(profile: dict, fixed):
    """Rank function: the fix, on ``profile``'s data."""
    _DATA.update(profile)
    return fixed()


def check_fixed(n: int, fixed) -> None:
    """Your fix of broken function ``n``: runs on 3 ranks without a hang or a mismatch,
    and every rank ends with the reference weights.

    Each fix runs on the lab's data and, for bugs 1 and 3, on data where a fix written for
    that one case goes wrong (``_PROFILES``). A rank can read only its own batches and
    shard size (``batch`` and ``n_batches`` refuse another rank's): what it must know of
    the others' it learns with a collective.

    Catches: the broken function itself (the launch fails, with the recorder's diff),
    a fix that still mismatches or hangs (10 s), a fix 1 that syncs every step (the NaN
    reaches every rank), lets only the NaN's rank skip, or skips a step number written
    in (step 1); a fix 3 that pads the short shard with zero gradients, stops at a step
    count written in, or at the mean of the shard sizes (rounded down, or a sum over ranks
    divided by their number) instead of the minimum; a fix that reads other ranks'
    data instead of communicating; a rank returning something other than its 8 weights."""
    from helpers.launch import RankError, launch
    if not callable(fixed):
        raise CheckFailed(f"pass your fixed training function, got {type(fixed).__name__}")
    for i, profile in enumerate(_PROFILES[n]):
        data = ("the lab's data" if i == 0 else
                f"other data ({_describe_profile(n, profile)})")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                got = launch(_run_with, WORLD, profile, fixed, record=True, timeout=10)
        except RankError as err:
            print(printed.getvalue(), end="")
            if err.exc_type == "NotImplementedError":
                raise CheckFailed(f"fix {n} is not implemented yet") from None
            raise CheckFailed(f"fix {n} still fails on {data}: {_summary(err)}") from None
        print(printed.getvalue(), end="")
        want = reference(**_want(n, profile))
        if n == 2:
            _check_logged_losses(printed.getvalue())
        for rank, w in enumerate(got):
            if not isinstance(w, torch.Tensor) or w.shape != (8,):
                raise CheckFailed(f"fix {n}: rank {rank} returned {w!r}, expected the 8 weights")
            # float64 throughout; the all-reduce may add the 3 gradients in another order
            # than the reference: each step's error <= 2 eps64 * sum|g_i| (about 1e-15 here),
            # and 5 steps of lr 0.1 keep it far below 1e-12.
            if not torch.allclose(w, want, rtol=0, atol=1e-12):
                diff = (w - want).abs().max().item()
                hint = {1: "when any rank's loss is not finite, every rank must skip that "
                           "step (decide with an all-reduce of a flag), whichever rank and "
                           "step it is",
                        2: "the update itself was right; every rank must make the same calls",
                        3: "every rank must train the same number of steps: the shortest "
                           "shard's (the minimum over ranks, not a mean)"}[n]
                raise CheckFailed(f"fix {n} on {data}: rank {rank}'s weights differ from the "
                                  f"reference by {diff:.3g}: {hint}")
    passed(f"fix {n}: no hang, no mismatch, and all 3 ranks end with the reference weights"
           + (f" (on the lab's data and on {len(_PROFILES[n]) - 1} other)"
              if len(_PROFILES[n]) > 1 else "")
           + ("; rank 0 logs each step's mean loss across the ranks" if n == 2 else ""))


def reference_losses() -> list[tuple[float, float, float]]:
    """Per step, before its update: (the mean of the ranks' losses, rank 0's own, their
    sum), from single-process data parallelism."""
    w, out = torch.zeros(8, dtype=torch.float64), []
    for step in range(STEPS):
        losses, grads = [], []
        for rank in range(WORLD):
            wr = w.clone().requires_grad_(True)
            x, y = _clean_batch(rank, step)
            loss = (x @ wr - y).pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            grads.append(wr.grad)
        out.append((sum(losses) / WORLD, losses[0], sum(losses)))
        w = w - LR * torch.stack(grads).sum(0) / WORLD
    return out


def _check_logged_losses(printed: str) -> None:
    """Fix 2 must still log, on rank 0, each step's loss averaged over the ranks: the
    last number of each of rank 0's lines that mention the loss, against the reference
    (printed to 4 decimals: a difference under 1e-4 relative is the rounding)."""
    lines = [line for line in printed.splitlines()
             if line.startswith("[rank 0]") and "loss" in line.lower()]
    numbers = [re.findall(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?", line)
               for line in lines]
    logged = [float(found[-1]) for found in numbers if found]
    if len(logged) != STEPS:
        raise CheckFailed(f"fix 2: rank 0 should still log the loss once per step ({STEPS} "
                          f"lines such as 'step 0: loss 10.5063'); found {len(logged)}")
    for step, (got, (mean, own, total)) in enumerate(zip(logged, reference_losses())):
        def near(x):
            return abs(got - x) <= 1e-4 * max(1.0, abs(x))
        if near(mean):
            continue
        why = (" That is rank 0's own loss: all-reduce it on every rank, then divide by the "
               "world size." if near(own) else
               " That is the sum over the ranks: divide by the world size." if near(total)
               else " Log the mean over the ranks: all-reduce the loss on every rank, "
                    "divide by the world size, print on rank 0.")
        raise CheckFailed(f"fix 2: at step {step} rank 0 logged {got:.6g}, but the mean loss "
                          f"across the {WORLD} ranks is {mean:.6g}.{why}")


def _describe_profile(n: int, profile: dict) -> str:
    if n == 1:
        return "NaNs in " + ", ".join(f"rank {r}'s batch at step {s}"
                                      for r, s in sorted(profile["corrupt"]))
    return "shards of " + ", ".join(str(profile["shards"].get(r, STEPS)) for r in range(WORLD)) \
        + " batches"
