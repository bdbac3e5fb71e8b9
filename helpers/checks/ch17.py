"""Checks for chapter 17's lab: save and restore the data position and the RNG streams;
the optimal checkpoint interval."""

from __future__ import annotations

import math
import random
import tempfile

import torch

from helpers.checks import CheckFailed, attempt, expect_close, on_ranks, passed

__all__ = ["check_resume_extras", "check_optimal_interval"]


def _advance(sampler, n: int) -> None:
    for _ in range(n):
        next(sampler)


def _draws() -> tuple:
    import numpy as np
    return torch.rand(4), random.random(), float(np.random.rand())


def _in_process(capture, restore) -> None:
    """The two functions on one process: each stream and the position, one at a time."""
    import numpy as np

    from helpers.data import ShardedSampler
    sampler = ShardedSampler(128, 4, rank=0, world_size=2, seed=1)
    _advance(sampler, 3)
    torch.manual_seed(11); random.seed(11); np.random.seed(11)  # noqa: E702
    state = attempt(capture, sampler, what="capture_extras")
    if not isinstance(state, dict):
        raise CheckFailed(f"capture_extras must return a dict, got {type(state).__name__}")
    want_draws, want_batch = _draws(), next(sampler)

    fresh = ShardedSampler(128, 4, rank=0, world_size=2, seed=1)  # a new process: step 0
    torch.manual_seed(99); random.seed(99); np.random.seed(99)  # noqa: E702
    attempt(restore, state, fresh, what="restore_extras")
    got_draws, got_batch = _draws(), next(fresh)
    names = ("torch (dropout masks)", "Python's random", "NumPy's")
    for name, want, got in zip(names, want_draws, got_draws):
        same = torch.equal(want, got) if isinstance(want, torch.Tensor) else want == got
        if not same:
            raise CheckFailed(f"after restore_extras, the {name} generator gave other numbers "
                              f"than at capture time: save its state and set it back")
    if not torch.equal(want_batch, got_batch):
        hint = (" The restored sampler gave the first batch of the epoch: it restarted "
                "from the beginning instead of the saved step." if torch.equal(
                    got_batch, next(iter(ShardedSampler(128, 4, 0, 2, seed=1)))) else "")
        raise CheckFailed(f"after restore_extras the sampler's next batch is "
                          f"{got_batch.tolist()}, it should be {want_batch.tolist()}.{hint}")


def _bitwise(directory: str, capture, restore) -> dict:
    """Rank function: 6 steps in one go against 3 + a resume through the learner's
    functions (dropout on, so the RNG matters)."""
    import os

    import torch as t

    from helpers.checkpoint.train import resumable_run

    def seed(s):
        import numpy as np
        t.manual_seed(s); random.seed(s); np.random.seed(s)  # noqa: E702

    seed(0)
    full = resumable_run(os.path.join(directory, "full"), 6, save_every=100)
    cut = os.path.join(directory, "cut")
    seed(0)  # the interrupted run starts like the uninterrupted one
    resumable_run(cut, 3, save_every=3, extras=(capture, restore))
    seed(1234)  # the resumed "process" starts from another seed
    resumed = resumable_run(cut, 6, save_every=100, extras=(capture, restore))
    same = all(t.equal(full["params"][k], resumed["params"][k]) for k in full["params"])
    return {"same": same, "start": resumed["start"],
            "losses": (full["losses"], resumed["losses"]),
            "samples": (full["samples"], resumed["samples"])}


def check_resume_extras(capture, restore) -> None:
    """``capture(sampler) -> dict`` and ``restore(state, sampler)``: a resumed run on 2
    ranks must end with exactly the weights of an uninterrupted one."""
    _in_process(capture, restore)
    with tempfile.TemporaryDirectory() as d:
        res = on_ranks(_bitwise, 2, d, capture, restore, what="the resume with your functions",
                       hints={"cannot be saved": "store the state as tensors, numbers, "
                              "strings, lists and dicts (e.g. a NumPy array as "
                              "torch.from_numpy(a))"})
    r = res[0]
    if r["start"] != 3:
        raise CheckFailed(f"the resumed run started at step {r['start']}, expected 3")
    full_l, res_l = r["losses"]
    full_s, res_s = r["samples"]
    for s in (4, 5, 6):
        if full_s[s] != res_s[s]:
            raise CheckFailed(f"step {s} of the resumed run used samples {res_s[s]}, the "
                              f"uninterrupted run used {full_s[s]}")
        if full_l[s] != res_l[s]:
            raise CheckFailed(f"step {s}: loss {res_l[s]!r} after the resume, {full_l[s]!r} "
                              f"without interruption: the dropout masks differ")
    if not r["same"]:
        raise CheckFailed("the final weights differ from the uninterrupted run's")
    passed("a run stopped at step 3 and resumed with your functions ends bitwise equal to "
           "one that never stopped (2 ranks, dropout 0.1)")


def check_optimal_interval(optimal_interval) -> None:
    """``optimal_interval(cost, mtbf)``: Young's sqrt(2 C M), any consistent unit."""
    cases = [(60.0, 3 * 3600.0), (1.0, 1000.0), (300.0, 11_137.0)]
    for cost, mtbf in cases:
        got = attempt(optimal_interval, cost, mtbf, what="optimal_interval")
        want = math.sqrt(2 * cost * mtbf)
        # same formula, a few float roundings apart: 1e-12 relative
        expect_close(got, want, f"optimal_interval({cost:g}, {mtbf:g})", rel=1e-12)
    passed("optimal_interval is Young's sqrt(2 x cost x MTBF): a 1-minute save every "
           f"{math.sqrt(2 * 60 * 3 * 3600) / 60:.0f} minutes when a job fails every 3 hours")
