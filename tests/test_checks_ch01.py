"""Chapter 01's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import math

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch01
from helpers.steptime import classify_bottleneck


def _no_master(weights, optimizer):
    w = 4 if weights == "fp32" else 2
    return 2 * w + {"adam": 8, "sgd-momentum": 4, "sgd": 0}[optimizer]


def _largest_only(p):
    if p.mem_frac >= 0.9:
        return "memory-bound"
    part = max(("data", "compute", "comm"), key=p.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]


def _ratio_rule(p):  # "slowest rank computes 2x the fastest" flags noise when compute is small
    if p.mem_frac >= 0.9:
        return "memory-bound"
    if max(p.compute) > 2 * min(p.compute):
        return "straggler-bound"
    part = max(("data", "compute", "comm"), key=p.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]


def _float_table(weights, optimizer):  # right numbers, as floats
    return {"adam": 16.0, "sgd-momentum": 12.0, "sgd": 8.0}[optimizer]


def _adam_only(weights, optimizer):  # a table without plain SGD: KeyError
    return {"adam": 16, "sgd-momentum": 12}[optimizer]


def _int_plus_one(n, b, g):  # "round up" as int(x) + 1: one too many on a whole number
    return int(n * b / (g * 1e9)) + 1


def _float_ceil(n, b, g):  # -(-a // b) on floats: the right value as a float
    return -(-n * b // (g * 1e9))


def _mem_strict(p):  # "> 0.9" where the lab says "90 % or more"
    if p.mem_frac > 0.9:
        return "memory-bound"
    return classify_bottleneck(ch01._p(p.data, p.compute, p.comm, 0.0))


def _wait_at_least(p):  # ">=" where the wait must be larger than every real cost
    if p.mem_frac >= 0.9:
        return "memory-bound"
    wait = max(p.compute) - min(p.compute)
    if wait >= max(p.mean("data"), min(p.compute), min(p.comm)):
        return "straggler-bound"
    part = max(("data", "compute", "comm"), key=p.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[part]


_LABEL = {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}


def _rule(wait, costs):
    """A classifier with the solution's shape: memory first, then ``wait(p) > costs(p)``
    for a straggler, then the largest mean part."""
    def classify(p):
        if p.mem_frac >= 0.9:
            return "memory-bound"
        if wait(p) > costs(p):
            return "straggler-bound"
        return _LABEL[max(("data", "compute", "comm"), key=p.mean)]
    return classify


def _spread(p):
    return max(p.compute) - min(p.compute)


def _real_costs(p):
    return max(p.mean("data"), min(p.compute), min(p.comm))


# a mean where the fastest or slowest rank decides
_wait_from_mean = _rule(lambda p: max(p.compute) - p.mean("compute"), _real_costs)
_wait_to_mean = _rule(lambda p: p.mean("compute") - min(p.compute), _real_costs)
_mean_compute_cost = _rule(_spread, lambda p: max(p.mean("data"), p.mean("compute"),
                                                   min(p.comm)))
_mean_comm_cost = _rule(_spread, lambda p: max(p.mean("data"), min(p.compute), p.mean("comm")))
# a real cost left out, or the costs summed
_no_loader = _rule(_spread, lambda p: max(min(p.compute), min(p.comm)))
_no_fast_compute = _rule(_spread, lambda p: max(p.mean("data"), min(p.comm)))
_summed_costs = _rule(_spread, lambda p: p.mean("data") + min(p.compute) + min(p.comm))
# the slow rank assumed to be the last one
_last_rank_slow = _rule(lambda p: p.compute[-1] - p.compute[0], _real_costs)
# right: the wait read where the fast ranks spend it, in their comm
_wait_in_comm = _rule(lambda p: max(p.comm) - min(p.comm), _real_costs)


# The rules as separate tests, to apply in any order: each returns its label or None.
_TESTS = {
    "memory": lambda p: "memory-bound" if p.mem_frac >= 0.9 else None,
    "straggler": lambda p: "straggler-bound" if _spread(p) > _real_costs(p) else None,
    "input": lambda p: "input-bound" if _largest(p) == "data" else None,
    "all-reduce": lambda p: "all-reduce-bound" if _largest(p) == "comm" else None,
    "compute": lambda p: "compute-bound" if _largest(p) == "compute" else None,
}


def _largest(p):
    return max(("data", "compute", "comm"), key=p.mean)


def _in_order(*names):
    """The right rules, tested in the order ``names`` (then any left, in _TESTS' order)."""
    order = list(names) + [n for n in _TESTS if n not in names]

    def classify(p):
        return next(label for label in (_TESTS[n](p) for n in order) if label)
    return classify


# the rules in another order
_straggler_before_memory = _in_order("straggler", "memory")
_input_before_straggler = _in_order("memory", "input", "straggler")
_compute_before_straggler = _in_order("memory", "compute", "straggler")
_all_reduce_before_straggler = _in_order("memory", "all-reduce", "straggler")


def _largest_on_slowest(p):  # the largest part read on the slowest rank, not the mean
    if p.mem_frac >= 0.9:
        return "memory-bound"
    if _spread(p) > _real_costs(p):
        return "straggler-bound"
    return _LABEL[max(("data", "compute", "comm"), key=lambda part: max(getattr(p, part)))]


def _spaces(p):  # right answer, label written with a space
    return classify_bottleneck(p).replace("-", " ")


# Rooflines: roofline_verdict(family, gpu, wire, degree, global_tokens, hidden)

def _roofline(dp_passes=2, fsdp_passes=3, ring=lambda n: (n - 1) / n, bw=None, b=2, six=6,
              tp_split=True, per_rank=True, invert=False, geq=True):
    """A roofline_verdict with the solution's shape and one knob turned."""
    def verdict(family, gpu, wire, degree, global_tokens, hidden):
        w = (bw or (lambda g, wire: g.nvlink if wire == "nvlink" else g.network))(gpu, wire)
        ridge = w / gpu.flops if invert else gpu.flops / w
        if family == "dp":
            thr = ridge * dp_passes * ring(degree) * b / six
        elif family == "fsdp":
            thr = ridge * fsdp_passes * ring(degree) * b / six
        else:
            thr = ridge * 4 * 2 * ring(degree) * b * (degree if tp_split else 1) / (six * 12)
        have = hidden if family == "tp" else global_tokens / (degree if per_rank else 1)
        ok = have >= thr if geq else have > thr
        return thr, "compute-bound" if ok else "communication-bound"
    return verdict


def _by_crossing(family, gpu, wire, degree, global_tokens, hidden):
    """Right, another way: the two times at a trial value, then where they meet (compute
    grows linearly in the tokens, and as h^2 against comm's h for TP)."""
    from helpers.costs.network import wire_factor
    W = {"nvlink": gpu.nvlink, "network": gpu.network}[wire]
    if family in ("dp", "fsdp"):
        P, T = 1e9, 1000.0
        compute = 6 * P * T / gpu.flops
        if family == "dp":
            sent = wire_factor("all_reduce", degree) * 2 * P
        else:
            sent = (2 * wire_factor("all_gather", degree)
                    + wire_factor("reduce_scatter", degree)) * 2 * P
        thr = T * (sent / W) / compute
        have = global_tokens / degree
    else:
        h, T = 1000.0, 1.0
        compute = 6 * 12 * h * h / degree * T / gpu.flops
        comm = 4 * wire_factor("all_reduce", degree) * 2 * h * T / W
        thr, have = h * comm / compute, hidden
    return thr, ("communication-bound", "compute-bound")[have >= thr]


def _both_directions(family, gpu, wire, degree, global_tokens, hidden):
    return _roofline(bw=lambda g, w: 2 * (g.nvlink if w == "nvlink" else g.network))(
        family, gpu, wire, degree, global_tokens, hidden)


def _calls_the_course(family, gpu, wire, degree, global_tokens, hidden):
    from helpers.costs import roofline
    w = gpu.nvlink if wire == "nvlink" else gpu.network
    thr = roofline.dp_tokens(gpu.flops, w, degree)
    return thr, "compute-bound" if global_tokens / degree >= thr else "communication-bound"


class TestChapter01(ChapterChecks):
    lab = "labs/01_why_distributed_lab.ipynb"
    sol = "solutions/01_why_distributed_solution.ipynb"
    checks = {
        "bytes_per_param": Check(ch01.check_bytes_per_param),
        "gpus_needed": Check(ch01.check_gpus_needed),
        "classify_bottleneck": Check(ch01.check_classify_bottleneck),
        "roofline_verdict": Check(ch01.check_roofline_verdict),
    }
    wrong = [
        Wrong("bytes_per_param", _no_master, "forgets the fp32 master copy", says="master copy"),
        Wrong("gpus_needed", lambda n, b, g: int(n * b / (g * 1e9)),
              "rounds down", says="round up"),
        Wrong("gpus_needed", lambda n, b, g: math.ceil(n * b / (g * 2**30)),
              "GiB where the GPU's memory is in GB", says=None),
        Wrong("bytes_per_param", _float_table, "floats, not ints", says="return an int"),
        Wrong("bytes_per_param", _adam_only, "no entry for plain SGD", says="raised KeyError"),
        Wrong("gpus_needed", _int_plus_one, "int(x) + 1 for rounding up", says=r"10, 16, 80"),
        Wrong("gpus_needed", _float_ceil, "a float from // on floats", says="return an int"),
        Wrong("classify_bottleneck", _mem_strict, "> 0.9 for memory", says="profile 8"),
        Wrong("classify_bottleneck", _wait_at_least, ">= for the straggler rule",
              says="profile 9"),
        Wrong("classify_bottleneck", _spaces, "labels with spaces", says="exactly one of"),
        Wrong("classify_bottleneck", lambda p: None, "returns None", says="returned None"),
        Wrong("classify_bottleneck", _largest_only,
              "largest part only, no straggler rule", says="straggler"),
        Wrong("classify_bottleneck", _ratio_rule,
              "compute ratio flags noise as a straggler", says="all-reduce-bound"),
        Wrong("classify_bottleneck", _wait_from_mean, "the wait as slowest minus mean compute",
              says="profile 11 .*expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _wait_to_mean, "the wait as mean minus fastest compute",
              says="profile 11 .*expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _mean_compute_cost, "the mean compute as a real cost",
              says="profile 11 .*expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _mean_comm_cost, "the mean comm (waits in it) as the "
              "transfer", says=r"profile 12 .*comm per rank \[.*expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _no_loader, "the loader left out of the real costs",
              says="profile 13 .*expected 'input-bound'"),
        Wrong("classify_bottleneck", _no_fast_compute, "the fast rank's compute left out",
              says="profile 14 .*expected 'compute-bound'"),
        Wrong("classify_bottleneck", _summed_costs, "the real costs summed",
              says="expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _last_rank_slow, "the last rank assumed slow",
              says="profile 16 .*expected 'straggler-bound'"),
        Wrong("classify_bottleneck", _straggler_before_memory,
              "the straggler rule before the memory rule", says="memory first"),
        Wrong("classify_bottleneck", _input_before_straggler,
              "the largest part (the loader) before the straggler rule",
              says="straggler before"),
        Wrong("classify_bottleneck", _compute_before_straggler,
              "the largest part (compute) before the straggler rule", says="straggler"),
        Wrong("classify_bottleneck", _all_reduce_before_straggler,
              "the largest part (comm) before the straggler rule", says="straggler"),
        Wrong("classify_bottleneck", _largest_on_slowest,
              "the largest part on the slowest rank, not the mean", says="mean over ranks"),
        Wrong("roofline_verdict", _roofline(dp_passes=1, fsdp_passes=1.5),
              "an all-reduce as one pass of the ring", says="[Hh]alf the expected"),
        Wrong("roofline_verdict", _both_directions, "NVLink's both directions",
              says="one direction of the link"),
        Wrong("roofline_verdict", _roofline(ring=lambda n: 1), "the ring's (n-1)/n left out",
              says=r"\(n-1\)/n is missing"),
        Wrong("roofline_verdict", _roofline(b=6, six=2), "bytes and FLOPs swapped",
              says="[Bb]ytes and FLOPs swapped"),
        Wrong("roofline_verdict", _roofline(fsdp_passes=2), "FSDP priced as DP",
              says="three collectives per micro-batch"),
        Wrong("roofline_verdict", _roofline(tp_split=False), "TP's FLOPs not split over t",
              says="1/t of the layer"),
        Wrong("roofline_verdict", _roofline(bw=lambda g, w: g.nvlink), "NVLink for every wire",
              says="the other wire"),
        Wrong("roofline_verdict", _roofline(bw=lambda g, w: g.network), "the NIC for every wire",
              says="the other wire"),
        Wrong("roofline_verdict", _roofline(invert=True), "W / C for C / W",
              says="FLOPs per byte"),
        Wrong("roofline_verdict", _roofline(per_rank=False), "the global batch, not a rank's",
              says="not the global batch"),
        Wrong("roofline_verdict", lambda *a: _roofline()(*a)[1], "the verdict alone",
              says="return a pair"),
        Wrong("roofline_verdict", lambda *a: (_roofline()(*a)[0], "compute bound"),
              "a misspelled verdict", says="exactly one of"),
        Wrong("roofline_verdict", _calls_the_course, "the course's own dp_tokens",
              says="switched off"),
    ]
    right = [
        Right("roofline_verdict", _roofline(), "the closed forms"),
        Right("roofline_verdict", _by_crossing, "the two times at a trial value, scaled"),
        Right("roofline_verdict", _roofline(geq=False), "> instead of >= (no case sits on the "
              "threshold)"),
        Right("classify_bottleneck", classify_bottleneck, "the library's classifier"),
        Right("classify_bottleneck", _wait_in_comm, "the wait read from the comm spread"),
        Right("classify_bottleneck", _in_order("memory", "straggler", "compute", "all-reduce",
                                               "input"), "the largest-part tests in another order"),
    ]


def test_every_other_order_of_the_rules_fails():
    """The rules in all 120 orders: the check passes exactly the 6 that test memory first
    and the straggler second (the largest-part tests exclude one another, so their order
    is free) and fails the other 114."""
    from itertools import permutations

    from helpers.checks import CheckFailed

    for order in permutations(_TESTS):
        right = order[:2] == ("memory", "straggler")
        try:
            ch01.check_classify_bottleneck(_in_order(*order))
            passed = True
        except CheckFailed:
            passed = False
        assert passed == right, order
