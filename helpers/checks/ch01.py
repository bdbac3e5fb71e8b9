"""Checks for chapter 01: the bytes of training state, and naming a bottleneck."""

from __future__ import annotations

import math

from helpers.checks import CheckFailed, attempt, passed
from helpers.steptime import StepProfile

# Bytes per parameter: weights + gradients + optimizer state.
# fp32: 4 + 4 + (Adam: m and v, 4 + 4 | momentum: 4 | plain SGD: 0)
# bf16-mixed: 2 + 2 + 4 fp32 master copy + the same optimizer state in fp32.
BYTES_PER_PARAM = {
    ("fp32", "adam"): 16, ("fp32", "sgd-momentum"): 12, ("fp32", "sgd"): 8,
    ("bf16-mixed", "adam"): 16, ("bf16-mixed", "sgd-momentum"): 12, ("bf16-mixed", "sgd"): 8,
}


def check_bytes_per_param(bytes_per_param) -> None:
    """``bytes_per_param(weights, optimizer)`` for weights in fp32 / bf16-mixed and
    optimizer in adam / sgd-momentum / sgd."""
    for (weights, optimizer), want in BYTES_PER_PARAM.items():
        got = attempt(bytes_per_param, weights, optimizer, what="bytes_per_param")
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
]


def check_gpus_needed(gpus_needed) -> None:
    """``gpus_needed(n_params, bytes_per_param, gpu_gb)``: GPUs to hold the model state
    (decimal GB, as GPU vendors quote)."""
    for n, bpp, gb, want in GPU_CASES:
        got = attempt(gpus_needed, n, bpp, gb, what="gpus_needed")
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
]


def check_classify_bottleneck(classify_bottleneck) -> None:
    """``classify_bottleneck(profile: StepProfile) -> str``."""
    for i, (profile, want) in enumerate(PROFILES):
        got = attempt(classify_bottleneck, profile, what="classify_bottleneck")
        if got != want:
            means = {p: round(profile.mean(p), 1) for p in ("data", "compute", "comm")}
            raise CheckFailed(f"profile {i} (compute per rank {profile.compute} ms, "
                              f"means {means}, memory {profile.mem_frac:.0%}): you said {got!r}, "
                              f"expected {want!r}")
    passed(f"all {len(PROFILES)} profiles named correctly")
