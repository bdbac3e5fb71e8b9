"""Checks for chapter 01: the bytes of training state, naming a bottleneck, and rooflines."""

from __future__ import annotations

import math

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.course_answers import refusing
from helpers.costs.roofline import H100_SXM, Ceilings, dp_tokens, tp_hidden, zero_tokens
from helpers.steptime import StepProfile

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


# ---------------------------------------------------------------------------
# Rooflines: each parallelism's threshold and the verdict it gives
# ---------------------------------------------------------------------------

# A made-up GPU beside the H100, so that an answer fitted to the H100's numbers fails.
_GPU_X = Ceilings("GPU-X", 400e12, 2e12, 200e9, 25e9)
# (family, gpu, wire, degree, global tokens, hidden). Global tokens: the whole batch of
# one step (dp) or of one micro-batch (fsdp) over all ``degree`` ranks; hidden: tp's width.
# GPU-X comes first: on an H100 NVLink / NIC is 9, the ratio of two other slips.
ROOFLINE_CASES = [
    ("dp", _GPU_X, "nvlink", 3, 3 * 1000, 1024),       # odd degree: 1,000 > 889
    ("dp", _GPU_X, "network", 3, 3 * 12000, 1024),     # 12,000 > 7,111
    ("dp", H100_SXM, "nvlink", 8, 8 * 4096, 8192),     # 4,096 a rank > 1,282: compute
    ("dp", H100_SXM, "network", 8, 8 * 4096, 8192),    # 4,096 < 11,538: communication
    ("fsdp", H100_SXM, "nvlink", 8, 8 * 1600, 8192),   # above DP's 1,282, below FSDP's 1,923
    ("fsdp", _GPU_X, "network", 2, 2 * 10000, 1024),   # 10,000 > 8,000
    ("tp", H100_SXM, "nvlink", 8, 8 * 4096, 4096),     # 4,096 > 3,419
    ("tp", H100_SXM, "network", 8, 8 * 4096, 8192),    # 8,192 < 30,769: TP stays in the node
    ("tp", _GPU_X, "nvlink", 2, 2 * 4096, 400),        # 400 < 444
    ("dp", _GPU_X, "network", 1, 100, 1024),           # one rank sends nothing: threshold 0
    ("tp", _GPU_X, "network", 1, 100, 1024),
]


def roofline_answer(family: str, gpu: Ceilings, wire: str, degree: int, global_tokens: float,
                    hidden: int) -> tuple[float, str]:
    """What ``roofline_verdict`` must return: (threshold, verdict), bf16 on the wire."""
    w = {"nvlink": gpu.nvlink, "network": gpu.network}[wire]
    if family == "dp":
        thr, have = dp_tokens(gpu.flops, w, degree), global_tokens / degree
    elif family == "fsdp":
        thr, have = zero_tokens(gpu.flops, w, degree, 3), global_tokens / degree
    else:
        thr, have = tp_hidden(gpu.flops, w, degree), hidden
    return thr, "compute-bound" if have >= thr else "communication-bound"


def _threshold_slip(case, got: float, want: float) -> str:
    """The usual mistake behind a wrong threshold, named from the ratio got / want."""
    family, gpu, wire, degree = case[:4]
    if want == 0:
        return ("with one rank there is nothing to send: the threshold is 0 (the ring's "
                "2(n-1)/n or (n-1)/n is 0 at n = 1)")
    r = got / want
    other = gpu.network if wire == "nvlink" else gpu.nvlink
    mine = gpu.nvlink if wire == "nvlink" else gpu.network

    def near(x: float) -> bool:
        return math.isclose(r, x, rel_tol=1e-6)
    slips = []   # every mistake this ratio fits (on the H100 NVLink / NIC is also 9)
    if near(mine / other):
        slips.append(f"that is the threshold on the other wire: {wire!r} means the "
                     f"{'NVLink' if wire == 'nvlink' else 'network NIC'} bandwidth "
                     f"({mine / 1e9:g} GB/s here), not {other / 1e9:g} GB/s")
    if near(0.5):
        slips.append("half the expected: a ring sends one way, so W is one direction of the "
                     "link (NVLink's '900 GB/s' counts both), and an all-reduce is two passes "
                     "of the ring (reduce-scatter + all-gather), 2(n-1)/n of the tensor, "
                     "not (n-1)/n")
    if near(degree / (degree - 1)):
        slips.append("the ring's (n-1)/n is missing: each rank sends all but its own share")
    if near(9) or near(1 / 9):
        slips.append("bytes and FLOPs swapped: the compute side is 6 FLOPs per weight per "
                     "token, the communication side 2 bytes per bf16 value")
    if family == "fsdp" and near(2 / 3):
        slips.append("FSDP (ZeRO-3) sends three collectives per micro-batch: the weights "
                     "all-gathered for the forward, again for the backward, and the gradients "
                     "reduce-scattered, (n-1)/n each: 1.5 times DP's all-reduce")
    if family == "tp" and (near(degree) or near(1 / degree)):
        slips.append("each of the t GPUs does 1/t of the layer's 6 x 12 h^2 FLOPs per token, "
                     "while every all-reduce carries the whole token's h values")
    if r < 1e-3:
        slips.append("C / W is FLOPs per byte: peak FLOP/s over bytes/s, not the other way "
                     "round")
    return "; or ".join(slips)


def check_roofline_verdict(roofline_verdict) -> None:
    """``roofline_verdict(family, gpu, wire, degree, global_tokens, hidden) -> (threshold,
    verdict)`` for family "dp", "fsdp" or "tp", bf16 on the wire.

    Catches, each named:
    * both directions of the link, or an all-reduce as one pass of the ring: half;
    * the ring's (n-1)/n left out: the odd degree (3) and degree 1;
    * bytes and FLOPs swapped (2 / 6 for 6 / 2): 9 times off;
    * FSDP priced as DP (two collectives, or the all-reduce): 2/3;
    * TP's FLOPs not divided over the t GPUs, or divided twice;
    * the other wire's bandwidth (NVLink where the network is asked, or back);
    * W / C for C / W;
    * the verdict on the global batch instead of the tokens a rank holds (DP, FSDP);
    * a verdict on the other side of the threshold, or a misspelled one; the course's
      own ``helpers.costs.roofline`` functions: refused.
    """
    refuse = {f"helpers.costs.roofline.{f}": "" for f in ("dp_tokens", "zero_tokens",
                                                           "tp_hidden", "family_thresholds")}
    labels = ("compute-bound", "communication-bound")
    for case in ROOFLINE_CASES:
        family, gpu, wire, degree, tokens, hidden = case
        call = (f"roofline_verdict({family!r}, {gpu.name}, {wire!r}, degree={degree}, "
                f"global_tokens={tokens}, hidden={hidden})")
        with refusing(refuse, "roofline_verdict"):
            got = attempt(roofline_verdict, *case, what=call)
        want_thr, want = roofline_answer(*case)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"{call} returned {got!r}; return a pair (threshold, verdict)")
        thr, verdict = got
        if not isinstance(thr, (int, float)) or not math.isclose(thr, want_thr, rel_tol=1e-6,
                                                                 abs_tol=1e-9):
            slip = _threshold_slip(case, thr, want_thr) if isinstance(thr, (int, float)) else ""
            raise CheckFailed(f"{call}: threshold {thr!r}, expected {want_thr:,.1f}"
                              + (f". {slip[0].upper()}{slip[1:]}" if slip else ""))
        if verdict not in labels:
            raise CheckFailed(f"{call}: verdict {verdict!r}; return exactly one of "
                              f"{', '.join(map(repr, labels))}")
        if verdict != want:
            have = hidden if family == "tp" else tokens / degree
            why = (f"compare the tokens one rank holds, {tokens:,} / {degree} = {have:,.0f}, "
                   f"not the global batch, with the threshold"
                   if family != "tp" and (tokens >= want_thr) != (have >= want_thr) else
                   f"the layout's {'hidden width' if family == 'tp' else 'tokens per rank'} "
                   f"is {have:,.0f} against a threshold of {want_thr:,.0f}")
            raise CheckFailed(f"{call}: you said {verdict!r}, expected {want!r}: {why}")
    passed(f"thresholds and verdicts right in all {len(ROOFLINE_CASES)} layouts (DP, FSDP, "
           f"TP; NVLink and network; degrees 1, 2, 3, 8)")
