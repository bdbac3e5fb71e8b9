"""Checks of lab 01's roofline exercises: each parallelism's threshold and its verdict.

Exercise 3 derives data parallelism's, FSDP's and tensor parallelism's thresholds
(``check_roofline_verdict``), exercise 4 ring attention's, expert parallelism's and a
pipeline stage's (``check_cp_verdict``, ``check_ep_verdict``, ``check_pp_verdict``). The
right numbers come from ``helpers.costs.roofline`` (one formula, one home), which is
switched off while the learner's code runs. A wrong number is named from its ratio to
the right one: each usual slip is off by a known factor (half for both directions of a
link, 9 for bytes and FLOPs swapped, e/(e-1) for a missing (e-1)/e, ...). The cases are
ordered so that most slips first fail where their factor is theirs alone; where two
slips give the same factor, the message names both.
"""

from __future__ import annotations

import math
import numbers

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.course_answers import refusing
from helpers.costs.roofline import (H100_SXM, Ceilings, cp_tokens, dp_tokens, ep_ffn, pp_ratio,
                                    tp_hidden, zero_tokens)

__all__ = ["check_roofline_verdict", "check_cp_verdict", "check_ep_verdict", "check_pp_verdict",
           "roofline_answer", "cp_answer", "ep_answer", "pp_answer"]


# ---------------------------------------------------------------------------
# Exercise 3: data parallelism, FSDP and tensor parallelism
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


# ---------------------------------------------------------------------------
# Exercise 4: ring attention (CP), experts (EP) and pipeline stages (PP)
# ---------------------------------------------------------------------------

# (gpu, wire, degree, seq, heads, kv_heads, causal); seq: the whole sequence, over
# ``degree`` GPUs. Multi-head and not causal first: there each slip has a ratio of its own.
CP_CASES = [
    (_GPU_X, "nvlink", 4, 4 * 2500, 32, 32, False),    # 2,500 a GPU > 2,000
    (H100_SXM, "nvlink", 8, 8 * 512, 64, 8, True),     # Llama 2 70B's heads at 4k: 512 < 549
    (H100_SXM, "nvlink", 8, 8 * 4096, 64, 8, True),    # 32k: 4,096 > 549
    (H100_SXM, "network", 8, 8 * 4096, 64, 8, True),   # across nodes: 4,096 < 4,945
    (_GPU_X, "network", 3, 3 * 20000, 40, 10, True),   # odd degree: 20,000 > 8,000
    (_GPU_X, "network", 2, 2 * 6000, 16, 16, False),   # 6,000 < 16,000
]
# (gpu, wire, degree: experts, one per GPU, ffn: an expert's width, gated, top_k). top_k 6
# first: not a wire's ratio (8 on GPU-X, 9 on the H100), nor m's 1.5, nor 2.
EP_CASES = [
    (_GPU_X, "nvlink", 4, 1024, True, 6),        # 1,024 > 667
    (H100_SXM, "nvlink", 8, 2048, True, 8),      # a fine-grained expert: 2,048 > 855
    (H100_SXM, "network", 8, 2048, True, 8),     # across nodes: 2,048 < 7,692
    (H100_SXM, "network", 8, 14336, True, 2),    # Mixtral 8x7B's experts: 14,336 > 7,692
    (_GPU_X, "network", 3, 4096, False, 1),      # plain MLP, top-1, odd degree: 4,096 < 7,111
    (H100_SXM, "network", 64, 8192, True, 4),    # 8,192 < 8,654
    (H100_SXM, "network", 1, 512, True, 2),      # every expert on one GPU: nothing to send
]
# (gpu, wire, hidden, layers_per_stage, micro_batch_tokens) -> compute / comm
PP_CASES = [
    (_GPU_X, "network", 512, 1, 4096),           # 0.58: communication-bound
    (_GPU_X, "network", 1024, 2, 4096),          # 2.3
    (H100_SXM, "network", 8192, 10, 4096),       # 70B as 8 stages across nodes: 75
    (H100_SXM, "nvlink", 96, 1, 2048),           # 0.79
    (H100_SXM, "network", 1024, 1, 8192),        # 0.93
    (_GPU_X, "nvlink", 128, 1, 512),             # 1.15
]


def _bandwidth(gpu: Ceilings, wire: str) -> float:
    return {"nvlink": gpu.nvlink, "network": gpu.network}[wire]


def _verdict(value: float, critical: float) -> str:
    return "compute-bound" if value >= critical else "communication-bound"


def cp_answer(gpu, wire, degree, seq, heads, kv_heads, causal) -> tuple[float, str]:
    """What ``cp_verdict`` must return: (threshold on the sequence per GPU, verdict)."""
    thr = cp_tokens(gpu.flops, _bandwidth(gpu, wire), kv_heads / heads, causal=causal)
    return thr, _verdict(seq / degree, thr)


def ep_answer(gpu, wire, degree, ffn, gated, top_k) -> tuple[float, str]:
    """What ``ep_verdict`` must return: (threshold on the expert width, verdict)."""
    thr = ep_ffn(gpu.flops, _bandwidth(gpu, wire), degree, gated)
    return thr, _verdict(ffn, thr)


def pp_answer(gpu, wire, hidden, layers_per_stage, micro_batch_tokens) -> tuple[float, str]:
    """What ``pp_verdict`` must return: (compute / comm of a stage per micro-batch, verdict)."""
    ratio = pp_ratio(gpu.flops, _bandwidth(gpu, wire), hidden, layers_per_stage)
    return ratio, _verdict(ratio, 1.0)


def _link_slips(gpu: Ceilings, wire: str, power: int) -> list:
    """The wire's slips as (factor got / want, mistake), for an answer that goes as
    W ** power (-1: a threshold, C / W; +1: the pipeline's compute / comm, W / C)."""
    mine = _bandwidth(gpu, wire)
    other = _bandwidth(gpu, "network" if wire == "nvlink" else "nvlink")
    return [((other / mine) ** power, f"that is the answer on the other wire: {wire!r} is the "
             f"{'NVLink' if wire == 'nvlink' else 'network NIC'} bandwidth ({mine / 1e9:g} GB/s "
             f"here), not {other / 1e9:g} GB/s"),
            (2.0 ** power, "W is one direction of the link (NVLink's '900 GB/s' counts both)"),
            (lambda r: r ** power > 1e5, "C / W is FLOPs per byte: peak FLOP/s over bytes/s, "
                                         "not the other way round")]


def _cp_slips(gpu, wire, degree, seq, heads, kv_heads, causal) -> list:
    backward = ("the backward doubles both the FLOPs and the bytes (K and V again, and their "
                "gradients): count it on both sides or on neither")
    slips = [(0.5, "a causal mask skips half of each block's FLOPs (the zigzag layout gives "
                   "every GPU an equal share) and none of its bytes: fewer FLOPs per byte, so "
                   "the threshold doubles"),
             (0.25, "a causal mask halves the FLOPs, which doubles the threshold, not halves "
                    "it")] if causal else [
             (2, "this layout is not causal: every block's FLOPs count (the x2 is for a causal "
                 "mask only)")]
    if kv_heads != heads:
        slips += [(heads / kv_heads, f"only the kv heads travel: with grouped-query attention "
                   f"K and V hold h x kv_heads / heads = h x {kv_heads}/{heads} values a token, "
                   f"while the queries of all heads make the FLOPs"),
                  ((heads / kv_heads) ** 2, "the kv share upside down: K and V carry kv_heads "
                                            "/ heads of h values a token")]
    slips += [((degree - 1) / degree, "ring attention has no (c-1)/c: its condition is per "
               "step, one block's attention hiding the next block's transfer ((n-1)/n is a "
               "collective's share over all its steps)"),
              (2, "a ring passes each K/V block one way: a GPU sends one block per step and "
                  "receives one"),
              (0.5, "K and V both travel: 2 (s/c) h_kv b bytes a block"),
              (3, backward), (1 / 3, backward),
              (degree, "the threshold is on the sequence one GPU holds, s / c, not on the "
                       "whole sequence")]
    return slips + _link_slips(gpu, wire, -1)


def _ep_slips(gpu, wire, degree, ffn, gated, top_k) -> list:
    slips = [(0.5, "4 all-to-alls, not 2: dispatch and combine in the forward, and both again "
                   "in the backward, on their gradients"),
             (3, "the backward's 4 m h f FLOPs count too, beside the forward's 2 m h f: 6 m h "
                 "f per routed copy, against all 4 all-to-alls"),
             (9, "bytes and FLOPs swapped: 6 FLOPs per weight per token, 2 bytes per bf16 "
                 "value"),
             (1.5, "a gated MLP (SwiGLU) has 3 matrices of h x f: gate, up and down") if gated
             else (2 / 3, "a plain MLP has 2 matrices of h x f: up and down")]
    if degree > 1:
        slips.append((degree / (degree - 1), "(e-1)/e is missing: a routed copy whose expert "
                      "lives on its own GPU stays there (1 in e of them)"))
    if top_k > 1:
        cancels = ("leave top_k out: each token sends top_k copies and meets top_k experts, "
                   "so both sides grow by it (it cancels)")
        slips += [(top_k, cancels), (1 / top_k, cancels)]
    return slips + _link_slips(gpu, wire, -1)


def _pp_slips(gpu, wire, hidden, layers_per_stage, micro_batch_tokens) -> list:
    want = pp_answer(gpu, wire, hidden, layers_per_stage, micro_batch_tokens)[0]
    tokens = ("the micro-batch's tokens cancel: the compute and the messages both grow with "
              "them (count them on both sides or on neither)")
    slips = [(2, "a stage sends two messages per token and micro-batch, b h bytes each, both "
                 "out of its own GPU: the activation forward to the next stage and, in the "
                 "backward, the gradient of its input back to the previous one; you counted "
                 "one"),
             (0.5, "count what the GPU sends (an activation forward, an input gradient back); "
                   "what it receives comes the other way on its links"),
             (1 / 3, "the backward's 4 FLOPs per weight per token count too, beside the "
                     "forward's 2"),
             (1 / 12, "a GPT layer has 12 h^2 weights (4 h^2 attention, 8 h^2 MLP)"),
             (1 / 9, "bytes and FLOPs swapped: 6 FLOPs per weight per token, 2 bytes per bf16 "
                     "value"),
             (1 / want ** 2, "return compute / comm (above 1: compute-bound), not comm / "
                             "compute"),
             (micro_batch_tokens, tokens), (1 / micro_batch_tokens, tokens)]
    if layers_per_stage > 1:
        slips.append((1 / layers_per_stage, "a stage sends once per micro-batch, at its "
                      "boundary, and computes all its layers in between: not once per layer"))
    return slips + _link_slips(gpu, wire, 1)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _check_layouts(fn, name: str, cases, answer, quantity: str, slips, why) -> None:
    """Run ``fn`` on every case against ``answer``. A wrong number is named from its ratio
    to the right one (``slips(*case)``: pairs of a factor, or a test of the ratio, and the
    mistake), a wrong verdict by ``why(case, right number)``. The course's formulas are
    switched off while ``fn`` runs. Tolerance 1e-6: the same products in another order
    differ in the last bits (1e-16); the smallest slip, (e-1)/e at e = 64, is 1.6 %."""
    refuse = {f"helpers.costs.roofline.{f}": "" for f in ("cp_tokens", "ep_ffn", "pp_ratio",
                                                           "family_thresholds")}
    for case in cases:
        call = f"{name}({', '.join(a.name if isinstance(a, Ceilings) else repr(a) for a in case)})"
        with refusing(refuse, name):
            got = attempt(fn, *case, what=call)
        want_x, want = answer(*case)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"{call} returned {got!r}; return a pair ({quantity}, verdict)")
        x, verdict = got
        if not _is_number(x) or not math.isclose(x, want_x, rel_tol=1e-6, abs_tol=1e-9):
            hits = []
            if want_x == 0:
                hits = ["with one GPU there is nothing to send: the threshold is 0 ((e-1)/e "
                        "is 0 at e = 1)"]
            elif _is_number(x) and x > 0:
                r = x / want_x
                hits = [m for t, m in slips(*case)
                        if (t(r) if callable(t) else math.isclose(r, t, rel_tol=1e-6))]
            slip = "; or ".join(dict.fromkeys(hits))
            shown = f"{x:,.6g}" if _is_number(x) else repr(x)
            raise CheckFailed(f"{call}: {quantity} {shown}, expected {want_x:,.6g}"
                              + (f". {slip[0].upper()}{slip[1:]}" if slip else ""))
        if verdict not in ("compute-bound", "communication-bound"):
            raise CheckFailed(f"{call}: verdict {verdict!r}; return exactly one of "
                              f"'compute-bound', 'communication-bound'")
        if verdict != want:
            raise CheckFailed(f"{call}: you said {verdict!r}, expected {want!r}: "
                              f"{why(case, want_x)}")


def _cp_why(case, thr: float) -> str:
    seq, degree = case[3], case[2]
    if (seq >= thr) != (seq / degree >= thr):
        return (f"compare the sequence one GPU holds, {seq:,} / {degree} = {seq / degree:,.0f} "
                f"tokens, not the whole sequence, with the threshold")
    return f"the sequence per GPU is {seq / degree:,.0f} against a threshold of {_num(thr)}"


def check_cp_verdict(cp_verdict) -> None:
    """``cp_verdict(gpu, wire, degree, seq, heads, kv_heads, causal) -> (threshold on the
    sequence per GPU, verdict)`` for ring attention, bf16 on the wire.

    Catches, each named: the causal factor left out, or dividing where it multiplies, or
    applied to a layout that is not causal; the kv-heads share left out or upside down;
    both directions of the link; each block sent both ways round the ring, or K without V;
    a collective's (c-1)/c; the backward counted on one side only; the threshold on the
    whole sequence, or the verdict on it; the other wire; W / C; the course's cp_tokens.
    """
    _check_layouts(cp_verdict, "cp_verdict", CP_CASES, cp_answer, "threshold", _cp_slips,
                   _cp_why)
    passed(f"thresholds and verdicts right in all {len(CP_CASES)} layouts (causal and not, "
           f"grouped-query and multi-head, degrees 2, 3, 4, 8, NVLink and network)")


def check_ep_verdict(ep_verdict) -> None:
    """``ep_verdict(gpu, wire, degree, ffn, gated, top_k) -> (threshold on the expert width,
    verdict)``, one expert per GPU, bf16 on the wire.

    Catches, each named: (e-1)/e left out (degree 1: a threshold of 0); 2 all-to-alls for
    4; top_k counted on one side; the gated MLP's 3 matrices or the plain one's 2; the
    forward's FLOPs only; bytes and FLOPs swapped; both link directions; the other wire;
    W / C; the course's ep_ffn.
    """
    _check_layouts(ep_verdict, "ep_verdict", EP_CASES, ep_answer, "threshold", _ep_slips,
                   lambda case, thr: f"the expert width is {case[3]:,} against a threshold "
                                     f"of {_num(thr)}")
    passed(f"thresholds and verdicts right in all {len(EP_CASES)} layouts (gated and plain, "
           f"top-1 to top-8, degrees 1 to 64, NVLink and network)")


def check_pp_verdict(pp_verdict) -> None:
    """``pp_verdict(gpu, wire, hidden, layers_per_stage, micro_batch_tokens) -> (compute /
    comm per micro-batch, verdict)``, bf16 on the wire.

    Catches, each named: the activation and the input gradient counted as one message (or
    the received ones as well); both link directions; the forward's FLOPs only; a layer's
    12 h^2 left out; bytes and FLOPs swapped; comm / compute; the tokens on one side; a
    message per layer; the other wire; W / C; the course's pp_ratio.
    """
    _check_layouts(pp_verdict, "pp_verdict", PP_CASES, pp_answer, "compute / comm", _pp_slips,
                   lambda case, ratio: f"compute / comm is {_num(ratio)}: at 1 or above the "
                                       f"stage's compute hides its messages")
    passed(f"compute / comm and verdicts right in all {len(PP_CASES)} layouts (from "
           f"{min(pp_answer(*c)[0] for c in PP_CASES):.2f} to "
           f"{max(pp_answer(*c)[0] for c in PP_CASES):.0f})")
