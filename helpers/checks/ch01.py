"""Checks for chapter 01: the bytes of training state, naming a bottleneck, and rooflines
(the roofline exercises' checks live in ``helpers.checks.rooflines``)."""

from __future__ import annotations

import math

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.rooflines import (check_cp_verdict, check_ep_verdict, check_pp_verdict,
                                      check_roofline_verdict)
from helpers.steptime import StepProfile

__all__ = ["check_bytes_per_param", "check_gpus_needed", "check_classify_bottleneck",
           "check_roofline_verdict", "check_cp_verdict", "check_ep_verdict", "check_pp_verdict"]

# Bytes per parameter: weights + gradients + optimizer state.
# fp32: 4 + 4 + (Adam: m and v, 4 + 4 | momentum: 4 | plain SGD: 0)
# bf16-mixed: 2 + 2 + 4 fp32 master copy + the same optimizer state in fp32.
BYTES_PER_PARAM = {
    ("fp32", "adam"): 16, ("fp32", "sgd-momentum"): 12, ("fp32", "sgd"): 8,
    ("bf16-mixed", "adam"): 16, ("bf16-mixed", "sgd-momentum"): 12, ("bf16-mixed", "sgd"): 8,
}


def _is_int(x) -> bool:
    """An int as the lab's signature states (``-> int``): 16.0 == 16 would pass a loose
    compare, then fail where the next cell uses it as a count (``range``, slicing)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_bytes_per_param(bytes_per_param) -> None:
    """``bytes_per_param(weights, optimizer)`` for weights in fp32 / bf16-mixed and
    optimizer in adam / sgd-momentum / sgd.

    Catches:
    * forgets the fp32 master copy under bf16-mixed: named;
    * Adam's state in bf16 (2 + 2 bytes), or one moment only: the adam rows;
    * a float (16.0, from ``/`` or a float table): named as a type error;
    * None (a missing return) or a KeyError for an optimizer it does not know: named.
    """
    for (weights, optimizer), want in BYTES_PER_PARAM.items():
        got = attempt(bytes_per_param, weights, optimizer,
                      what=f"bytes_per_param({weights!r}, {optimizer!r})")
        if got == want and not _is_int(got):
            raise CheckFailed(f"bytes_per_param({weights!r}, {optimizer!r}) = {got!r}: right "
                              f"value, but return an int (the signature says -> int)")
        if got != want:
            hint = (" Mixed precision keeps an fp32 master copy of the weights for the "
                    "optimizer." if weights == "bf16-mixed" else "")
            raise CheckFailed(f"bytes_per_param({weights!r}, {optimizer!r}) = {got}, "
                              f"expected {want}.{hint}")
    passed("bytes per parameter right for all six combinations "
           "(mixed precision saves no model-state bytes: it saves activations and time)")


GPU_CASES = [  # (params, bytes/param, GPU GB) -> GPUs for model state alone
    (70e9, 16, 80, 14), (7e9, 16, 80, 2), (13e9, 16, 80, 3), (405e9, 16, 80, 81),
    (1e9, 16, 24, 1), (7e9, 8, 24, 3),
    (10e9, 16, 80, 2),  # exactly 2.0 GPUs: int(x) + 1 gives 3
    (1e6, 16, 80, 1),   # a sliver of one GPU: still one GPU, not 0
]


def check_gpus_needed(gpus_needed) -> None:
    """``gpus_needed(n_params, bytes_per_param, gpu_gb)``: GPUs to hold the model state
    (decimal GB, as GPU vendors quote).

    Catches:
    * rounds down (``int``, ``//``): 7e9 x 16 bytes / 80 GB = 1.4 GPUs -> 1 (named);
    * ``int(x) + 1`` for rounding up: 10e9 x 16 / 80 GB is exactly 2, not 3;
    * GiB (2**30) where the GPU's memory is in GB: 405e9 -> 76, not 81;
    * a float (``-(-x // y)`` on floats gives 14.0): named as a type error;
    * None or an exception: named with the case.
    """
    for n, bpp, gb, want in GPU_CASES:
        got = attempt(gpus_needed, n, bpp, gb, what=f"gpus_needed({n:.3g}, {bpp}, {gb})")
        if got == want and not _is_int(got):
            raise CheckFailed(f"gpus_needed({n:.3g}, {bpp}, {gb}) = {got!r}: right value, but "
                              f"return an int (math.ceil gives one; -(-a // b) on floats "
                              f"gives a float)")
        if got != want:
            extra = " (round up: part of a GPU is still a GPU)" if got == want - 1 else ""
            extra += " (1 GB = 1e9 bytes here)" if isinstance(got, int) and got > want else ""
            raise CheckFailed(f"gpus_needed({n:.3g}, {bpp}, {gb}) = {got}, expected {want}{extra}")
    passed(f"70B with Adam: {math.ceil(70e9 * 16 / 80e9)} x 80 GB GPUs before a single activation")


def _p(data, compute, comm, mem=0.0):
    return StepProfile(list(data), list(compute), list(comm), [1.0] * len(data), mem_frac=mem)


# Milliseconds per part and rank. The answer is in the shape, not in any one number.
PROFILES = [
    (_p([40, 41], [8, 8], [3, 3]), "input-bound"),
    (_p([1, 1], [30, 31], [5, 6]), "compute-bound"),
    (_p([1, 1], [10, 10], [90, 92]), "all-reduce-bound"),
    (_p([1, 1], [8, 45], [40, 2]), "straggler-bound"),
    (_p([1, 1, 1], [10, 10, 50], [42, 41, 2]), "straggler-bound"),  # waiting looks like comm
    (_p([1, 1], [5, 12], [100, 95]), "all-reduce-bound"),  # uneven compute, but comm dominates
    (_p([1, 1], [30, 31], [5, 6], mem=0.95), "memory-bound"),
    (_p([1, 1], [30, 31], [5, 6], mem=0.89), "compute-bound"),
    (_p([1, 1], [30, 31], [5, 6], mem=0.90), "memory-bound"),  # "90 % or more": >=, not >
    # the wait (20 - 10 = 10 ms) equals the largest real cost (10 ms of compute, 10 ms of
    # transfer): "larger than every real cost" is strict, so not a straggler
    (_p([1, 1], [10, 20], [10, 12]), "compute-bound"),
    # the mean comm (25 ms) looks largest, but on the fast ranks it is waiting: the
    # slow rank's 2 ms is the real transfer
    (_p([1, 1, 1], [5, 5, 40], [36, 37, 2]), "straggler-bound"),
    # Below, the fastest and slowest rank decide where a mean would not. Every profile
    # keeps the shape of a real step: a fast rank's comm = its wait + the transfer.
    # The wait (30 ms) beats every real cost (the fast rank's 20 ms of compute), but is
    # less than the mean compute (35 ms) and twice the slowest-minus-mean (15 ms).
    (_p([1, 1], [20, 50], [32, 2]), "straggler-bound"),
    # the wait (30) beats the real transfer (20 ms, the slow rank's comm), not the mean
    # comm (35 ms), which contains half the wait
    (_p([1, 1], [10, 40], [50, 20]), "straggler-bound"),
    # the loader (35 ms) costs more than the wait (20), and than any rank's compute:
    # input-bound, not a straggler
    (_p([35, 35], [10, 30], [22, 2]), "input-bound"),
    # the fast rank's own compute (30 ms) costs more than the wait (20): compute-bound
    (_p([1, 1], [30, 50], [22, 2]), "compute-bound"),
    # the wait (20) beats each real cost, not their sum (1 + 15 + 10 = 26 ms)
    (_p([1, 1], [15, 35], [30, 10]), "straggler-bound"),
    # the slow rank is rank 0, and one of four
    (_p([1, 1, 1, 1], [45, 10, 10, 10], [2, 37, 37, 37]), "straggler-bound"),
    # four ranks, one slow: the wait (30) beats the fast ranks' compute (20) but not the
    # mean compute (27.5); slowest minus mean is 22.5
    (_p([1, 1, 1, 1], [20, 20, 20, 50], [32, 32, 32, 2]), "straggler-bound"),
    # Below, the order of the rules decides (memory, then the straggler, then the largest
    # part), and the mean over ranks where the slowest rank would say otherwise. A third
    # item names the mistake behind a wrong label ("*": any wrong label).
    # a straggler's shape (profile 3) on a rank 95 % full: memory decides first
    (_p([1, 1], [8, 45], [40, 2], mem=0.95), "memory-bound",
     {"*": "the fullest rank uses 95 % of its memory, which decides whatever the timings "
           "say: test memory first, before the straggler rule and the largest part"}),
    # the loader (40 ms) is the largest mean part (compute 16.25, comm 35.75), but the fast
    # ranks wait 45 ms, more than every real cost (40, 5, 2)
    (_p([40, 40, 40, 40], [5, 5, 5, 50], [47, 47, 47, 2]), "straggler-bound",
     {"input-bound": "the loader (40 ms) is the largest mean part, but the fast ranks wait "
                     "45 ms for the slow one, more than every real cost: test for a "
                     "straggler before naming the largest part"}),
    # no straggler (the 10 ms wait is less than the loader's 37); by the mean the loader
    # (37) beats compute (35), by the slowest rank compute (40) beats the loader
    (_p([37, 37], [30, 40], [15, 5]), "input-bound",
     {"compute-bound": "the slowest rank computes 40 ms, more than the loader's 37, but the "
                       "mean over ranks is 35 ms: compare the parts by their mean over ranks "
                       "(profile.mean), not by the slowest rank"}),
]


_LABEL = {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}


def check_classify_bottleneck(classify_bottleneck) -> None:
    """``classify_bottleneck(profile: StepProfile) -> str``.

    Catches:
    * the largest part only, no straggler rule: profiles 3 and 4 (named);
    * a compute ratio (slowest 2x the fastest) instead of the wait against the real
      costs: profile 5 (noise on small compute flagged);
    * memory tested after the timings, or ``> 0.9``: profiles 6 and 8;
    * ``>=`` where the wait must be *larger* than every cost: profile 9;
    * the mean comm (which includes waiting) as the real comm cost: profiles 4, 10, 12;
    * a mean where the fastest or slowest rank decides: the wait as slowest minus the
      mean compute, or mean minus fastest (11, 17); the mean compute as the fast rank's
      real cost (11, 15); profiles whose ranks differ enough to tell them apart;
    * a real cost left out of the comparison (the loader: 13; the fast rank's compute:
      14) or the costs summed instead of each compared (15);
    * the last rank assumed to be the slow one (``compute[-1] - compute[0]``): 16;
    * the rules in another order: the straggler (or the largest part) before memory: 18;
      the largest part before the straggler rule: 3 (compute), 4 (comm), 19 (the loader),
      each failure with the wait and the real costs it beats;
    * the largest part read on the slowest rank where the mean is meant: 20 (named);
    * a misspelled label ("memory bound"), None, or an exception: named.
    """
    labels = ("memory-bound", "straggler-bound", "input-bound", "all-reduce-bound",
              "compute-bound")
    for i, (profile, want, *named) in enumerate(PROFILES):
        got = attempt(classify_bottleneck, profile, what=f"classify_bottleneck(profile {i})")
        if got not in labels:
            raise CheckFailed(f"profile {i}: classify_bottleneck returned {got!r}; return "
                              f"exactly one of {', '.join(map(repr, labels))}")
        if got != want:
            means = {p: round(profile.mean(p), 1) for p in ("data", "compute", "comm")}
            mistakes = named[0] if named else {}
            why = mistakes.get(got, mistakes.get("*"))
            largest = max(("data", "compute", "comm"), key=profile.mean)
            if why is None and want == "straggler-bound" and got == _LABEL[largest]:
                # the part that is largest by the mean, where the wait beats every real cost
                why = (f"the fast rank waits {max(profile.compute) - min(profile.compute):g} ms "
                       f"for the slow one, more than every real cost (loader "
                       f"{profile.mean('data'):g}, fastest compute {min(profile.compute):g}, "
                       f"transfer {min(profile.comm):g} ms): a straggler, though {largest} is "
                       f"the largest mean part; the straggler rule comes before the largest "
                       f"part")
            # per rank: the mean comm of a straggled step is mostly the fast rank's wait
            raise CheckFailed(f"profile {i} (compute per rank {profile.compute} ms, comm per "
                              f"rank {profile.comm} ms, means {means}, memory "
                              f"{profile.mem_frac:.0%}): you said {got!r}, "
                              f"expected {want!r}" + (f". {why[0].upper()}{why[1:]}"
                                                      if why else ""))
    passed(f"all {len(PROFILES)} profiles named correctly")
