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


# Exercise 4: cp_verdict, ep_verdict, pp_verdict

def _bw(gpu, wire):
    return gpu.nvlink if wire == "nvlink" else gpu.network


def _bound(value, critical, geq=True):
    above = value >= critical if geq else value > critical
    return "compute-bound" if above else "communication-bound"


def _cp(causal_x=2, always_causal=False, kv=True, bw=1, sent=1, ring=False, whole=False,
        per_gpu=True, geq=True):
    """A cp_verdict with the solution's shape and one knob turned (sent: a factor on the
    bytes a block sends)."""
    def verdict(gpu, wire, degree, seq, heads, kv_heads, causal):
        share = kv_heads / heads if kv else 1
        # a block of s_c tokens: 4 s_c^2 h FLOPs against K and V, 2 s_c h share b bytes
        thr = gpu.flops / (bw * _bw(gpu, wire)) * sent * 2 * 2 * share / 4
        thr *= causal_x if causal or always_causal else 1
        thr *= (degree - 1) / degree if ring else 1
        have = seq / degree if per_gpu else seq
        if whole:
            thr, have = thr * degree, seq
        return thr, _bound(have, thr, geq)
    return verdict


def _cp_by_times(gpu, wire, degree, seq, heads, kv_heads, causal):
    """Right, another way: a trial block's compute and transfer times, forward and
    backward, then the block where they meet (compute grows as its square, bytes as it)."""
    n, h = 1000.0, 128.0 * heads
    compute = 3 * 4 * n * n * h * (0.5 if causal else 1) / gpu.flops
    comm = 3 * 2 * n * h * kv_heads / heads * 2 / _bw(gpu, wire)
    thr = n * comm / compute
    return thr, _bound(seq / degree, thr)


def _ep(passes=4, ring=True, top_k_bytes=False, m=None, six=6, b=2, geq=True):
    """An ep_verdict with the solution's shape and one knob turned."""
    def verdict(gpu, wire, degree, ffn, gated, top_k):
        mats = m or (3 if gated else 2)
        share = (degree - 1) / degree if ring else 1
        thr = gpu.flops / _bw(gpu, wire) * passes * share * b / (six * mats)
        thr *= top_k if top_k_bytes else 1
        return thr, _bound(ffn, thr, geq)
    return verdict


def _ep_by_bytes(gpu, wire, degree, ffn, gated, top_k):
    """Right, another way: the library's bytes of each of the 4 all-to-alls of a token's
    top_k copies, summed, against their experts' FLOPs at a trial width."""
    from helpers.costs.network import sent_bytes
    h, f = 4096.0, 1000.0
    sent = sum(sent_bytes("all_to_all", top_k * h * 2, degree) for _ in range(4))
    compute = top_k * 6 * (3 if gated else 2) * h * f / gpu.flops
    thr = f * (sent / _bw(gpu, wire)) / compute
    return thr, _bound(ffn, thr)


def _pp(messages=2, six=6, a=12, bw=1, per_layer=False, tokens_once=False, invert=False,
        geq=True):
    """A pp_verdict with the solution's shape and one knob turned."""
    def verdict(gpu, wire, hidden, layers_per_stage, micro_batch_tokens):
        h, n, t = hidden, layers_per_stage, micro_batch_tokens
        compute = six * a * h * h * n * t / gpu.flops
        comm = messages * 2 * h * (1 if tokens_once else t) * (n if per_layer else 1) \
            / (bw * _bw(gpu, wire))
        ratio = comm / compute if invert else compute / comm
        return ratio, _bound(ratio, 1, geq)
    return verdict


def _pp_closed(gpu, wire, hidden, layers_per_stage, micro_batch_tokens):
    """Right, another way: the closed form 6 a h^2 L / (2 b h) x W / C, a = 12, b = 2."""
    ratio = 3 * 12 * hidden * layers_per_stage / 2 * _bw(gpu, wire) / gpu.flops
    return ratio, _bound(ratio, 1)


def _cp_course(gpu, wire, degree, seq, heads, kv_heads, causal):
    from helpers.costs import roofline
    thr = roofline.cp_tokens(gpu.flops, _bw(gpu, wire), kv_heads / heads, causal=causal)
    return thr, _bound(seq / degree, thr)


def _ep_course(gpu, wire, degree, ffn, gated, top_k):
    from helpers.costs import roofline
    thr = roofline.ep_ffn(gpu.flops, _bw(gpu, wire), degree, gated)
    return thr, _bound(ffn, thr)


def _pp_course(gpu, wire, hidden, layers_per_stage, micro_batch_tokens):
    from helpers.costs import roofline
    ratio = roofline.pp_ratio(gpu.flops, _bw(gpu, wire), hidden, layers_per_stage)
    return ratio, _bound(ratio, 1)


class TestChapter01(ChapterChecks):
    lab = "labs/01_why_distributed_lab.ipynb"
    sol = "solutions/01_why_distributed_solution.ipynb"
    checks = {
        "bytes_per_param": Check(ch01.check_bytes_per_param),
        "gpus_needed": Check(ch01.check_gpus_needed),
        "classify_bottleneck": Check(ch01.check_classify_bottleneck),
        "roofline_verdict": Check(ch01.check_roofline_verdict),
        "cp_verdict": Check(ch01.check_cp_verdict),
        "ep_verdict": Check(ch01.check_ep_verdict),
        "pp_verdict": Check(ch01.check_pp_verdict),
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
        Wrong("cp_verdict", _cp(causal_x=1), "the causal factor left out", says="skips half"),
        Wrong("cp_verdict", _cp(causal_x=0.5), "causal halving the threshold",
              says="not halves it"),
        Wrong("cp_verdict", _cp(always_causal=True), "x2 on a layout that is not causal",
              says="not causal"),
        Wrong("cp_verdict", _cp(kv=False), "the kv-heads share left out",
              says="[Oo]nly the kv heads travel"),
        Wrong("cp_verdict", _cp(bw=2), "both directions of the link",
              says="one direction of the link"),
        Wrong("cp_verdict", _cp(sent=2), "each block sent both ways round the ring",
              says="passes each K/V block one way"),
        Wrong("cp_verdict", _cp(sent=0.5), "K without V", says="K and V both travel"),
        Wrong("cp_verdict", _cp(ring=True), "a collective's (c-1)/c", says=r"no \(c-1\)/c"),
        Wrong("cp_verdict", _cp(sent=3), "the forward's FLOPs against all the bytes",
              says="backward doubles both"),
        Wrong("cp_verdict", _cp(whole=True), "the threshold on the whole sequence",
              says="one GPU holds, s / c"),
        Wrong("cp_verdict", _cp(per_gpu=False), "the verdict on the whole sequence",
              says="not the whole sequence"),
        Wrong("cp_verdict", lambda *a: _cp()(*a)[1], "the verdict alone", says="return a pair"),
        Wrong("cp_verdict", _cp_course, "the course's own cp_tokens", says="switched off"),
        Wrong("ep_verdict", _ep(ring=False), "(e-1)/e left out", says=r"\(e-1\)/e is missing"),
        Wrong("ep_verdict", _ep(passes=2), "2 all-to-alls, not 4", says="dispatch and combine"),
        Wrong("ep_verdict", _ep(top_k_bytes=True), "top_k counted on the bytes",
              says="Leave top_k out"),
        Wrong("ep_verdict", _ep(m=2), "a gated MLP as 2 matrices", says="3 matrices"),
        Wrong("ep_verdict", _ep(m=3), "a plain MLP as 3 matrices", says="2 matrices"),
        Wrong("ep_verdict", _ep(six=2), "the forward's FLOPs only", says="backward's 4 m h f"),
        Wrong("ep_verdict", _ep(b=6, six=2), "bytes and FLOPs swapped",
              says="[Bb]ytes and FLOPs swapped"),
        Wrong("ep_verdict", _ep_course, "the course's own ep_ffn", says="switched off"),
        Wrong("ep_verdict", lambda *a: (_ep()(*a)[0], "compute-bound"), "always compute-bound",
              says="expected .communication-bound.: the expert width"),
        Wrong("pp_verdict", _pp(messages=1), "both directions counted as one message",
              says="you counted one"),
        Wrong("pp_verdict", _pp(messages=4), "the received messages counted too",
              says="what the GPU sends"),
        Wrong("pp_verdict", _pp(bw=2), "both directions of the link",
              says="one direction of the link"),
        Wrong("pp_verdict", _pp(six=2), "the forward's FLOPs only", says="backward's 4 FLOPs"),
        Wrong("pp_verdict", _pp(a=1), "h^2 FLOPs, not 12 h^2", says=r"12 h\^2 weights"),
        Wrong("pp_verdict", _pp(per_layer=True), "a message per layer",
              says="once per micro-batch"),
        Wrong("pp_verdict", _pp(tokens_once=True), "the tokens on the compute side only",
              says="tokens cancel"),
        Wrong("pp_verdict", _pp(invert=True), "comm / compute", says="not comm / compute"),
        Wrong("pp_verdict", _pp_course, "the course's own pp_ratio", says="switched off"),
        Wrong("pp_verdict", lambda *a: (_pp()(*a)[0], "compute-bound"), "always compute-bound",
              says="expected .communication-bound.: compute / comm is"),
    ]
    right = [
        Right("roofline_verdict", _roofline(), "the closed forms"),
        Right("roofline_verdict", _by_crossing, "the two times at a trial value, scaled"),
        Right("roofline_verdict", _roofline(geq=False), "> instead of >= (no case sits on the "
              "threshold)"),
        Right("cp_verdict", _cp(), "the closed form"),
        Right("cp_verdict", _cp_by_times, "a trial block's two times, scaled"),
        Right("cp_verdict", _cp(geq=False), "> instead of >= (no case sits on the threshold)"),
        Right("ep_verdict", _ep(), "the closed form"),
        Right("ep_verdict", _ep_by_bytes, "the library's bytes of the 4 all-to-alls, summed"),
        Right("ep_verdict", _ep(geq=False), "> instead of >= (degree 1: threshold 0, width > 0)"),
        Right("pp_verdict", _pp_closed, "the closed form"),
        Right("pp_verdict", _pp(), "the two times of a micro-batch"),
        Right("pp_verdict", _pp(geq=False), "> instead of >= (no case sits at 1)"),
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


def test_each_familys_layouts_sit_on_both_sides_of_its_threshold():
    """An answer to exercise 4 that always says one verdict must fail: each family's
    layouts hold both verdicts. None sits on its threshold, so ``>`` for ``>=`` passes
    (the ``Right`` rows with ``geq=False`` rely on that)."""
    from helpers.checks import rooflines

    # (layouts, reference, (the layout's value, the threshold) from a case and its number)
    families = [(rooflines.CP_CASES, rooflines.cp_answer, lambda c, x: (c[3] / c[2], x)),
                (rooflines.EP_CASES, rooflines.ep_answer, lambda c, x: (c[3], x)),
                (rooflines.PP_CASES, rooflines.pp_answer, lambda c, x: (x, 1.0))]  # PP: vs 1
    for cases, answer, sides in families:
        assert {answer(*c)[1] for c in cases} == {"compute-bound", "communication-bound"}
        for case in cases:
            have, critical = sides(case, answer(*case)[0])
            assert have != critical, case
