"""Rooflines (helpers.costs.roofline): every family's closed-form threshold is the
crossover of the cost library's own byte counts (helpers.costs.axes, helpers.sp.cost)
against the FLOPs of the layers it overlaps.

How each test works: a one-node topology whose links all run at W bytes/s with no
latency (the roofline leaves latency out), so an axis's collective seconds are its
bytes / W exactly as ``helpers.costs`` counts them; compute is the FLOPs / C. Compute
grows linearly in the deciding quantity while the comm stays fixed (DP, FSDP) or
grows one power slower (TP, EP), so quantity x comm / compute is the crossover. The
closed form must give it to float rounding (rel 1e-9: a few dozen flops of error
on numbers near 1)."""

import math

import pytest

from helpers import costs
from helpers.costs import roofline as rl
from helpers.frameworks import ModelSpec
from helpers.sp.cost import ring_attention_time
from helpers.topology import Topology
from helpers.topology.links import Link

C, W = 400e12, 100e9           # a made-up GPU: ridge C / W = 4000 FLOPs per byte
REL = 1e-9

GPT = ModelSpec(layers=4, hidden=1024, heads=16, vocab=1000, seq=2048, name="gpt")
LLAMA = ModelSpec(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=2816, gated_mlp=True,
                  vocab=1000, seq=2048, name="llama-ish")
MOE = ModelSpec(layers=4, hidden=1024, heads=16, ffn=512, gated_mlp=True, experts=8,
                top_k=2, vocab=1000, seq=2048, name="moe")


def flat(n: int) -> Topology:
    """n GPUs on one node, every link W each way, no latency."""
    wire = Link("flat", W, 0.0)
    return Topology("flat", 1, n, wire, wire, 1)


def test_ridge_attainable_and_bound():
    assert rl.ridge(C, W) == 4000
    assert rl.attainable(1000, C, W) == 1000 * W < C      # on the slope
    assert rl.attainable(8000, C, W) == C                  # on the roof
    assert rl.bound(3999, C, W) == "bandwidth-bound"
    assert rl.bound(4000, C, W) == "compute-bound"
    with pytest.raises(ValueError, match="must be > 0"):
        rl.ridge(C, 0)


def test_gemm_intensity_is_about_the_batch_when_it_is_small():
    # part 1 of the book: 2 B D F / (2 (B D + D F + B F)) -> B for B << D, F
    for m in (16, 64, 256):
        i = rl.gemm_intensity(m, 8192, 8192)
        assert i == pytest.approx(m * 8192 / (2 * m + 8192)) and 0.9 * m < i < m
    assert rl.gemm_intensity(8192, 8192, 8192) == pytest.approx(8192 / 3)
    assert rl.gemm_bytes(2, 3, 4, 4) == 4 * (6 + 12 + 8)


def test_collective_intensity_uses_the_ring_wire_factor():
    # an all-reduce sends 2(n-1)/n of the tensor, an all-gather (n-1)/n
    assert rl.collective_intensity(1e9, "all_reduce", 1e6, 4) == pytest.approx(1e9 / 1.5e6)
    assert rl.collective_intensity(1e9, "all_gather", 1e6, 4) == pytest.approx(1e9 / 0.75e6)
    assert rl.collective_intensity(1.0, "all_reduce", 1e6, 1) == math.inf


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_dp_threshold_is_the_crossover_of_dp_cost(dp):
    P, T = GPT.dense_params(), 1000.0
    comm = costs.dp_cost(GPT, flat(dp), dp=dp, tp=1, pp=1).time
    compute = 6 * P * T / C
    assert rl.dp_tokens(C, W, dp) == pytest.approx(T * comm / compute, rel=REL)
    # ZeRO-1/2 with whole gradients: reduce-scatter + all-gather, the same bytes
    for zero in (1, 2):
        comm = costs.dp_cost(GPT, flat(dp), dp=dp, tp=1, pp=1, zero=zero, whole_grads=True).time
        assert rl.zero_tokens(C, W, dp, zero) == pytest.approx(T * comm / compute, rel=REL)


@pytest.mark.parametrize("dp", [2, 5, 8])
def test_fsdp_threshold_is_per_micro_batch_and_half_again_dps(dp):
    P, T, m = GPT.dense_params(), 1000.0, 4
    comm = costs.dp_cost(GPT, flat(dp), dp=dp, tp=1, pp=1, zero=3, micro_batches=m).time / m
    assert rl.zero_tokens(C, W, dp, 3) == pytest.approx(T * comm / (6 * P * T / C), rel=REL)
    assert rl.zero_tokens(C, W, dp, 3) == pytest.approx(1.5 * rl.dp_tokens(C, W, dp), rel=REL)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=lambda m: m.name)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_threshold_is_the_crossover_of_tp_cost(model, tp):
    T, h = 512, model.hidden
    comm = costs.tp_cost(flat(tp), tp=tp, tokens=T, hidden=h, layers=1, micro_batches=1,
                         recompute="selective").time
    compute = 6 * (model.attention_params() + model.mlp_params()) / tp * T / C
    a = (model.attention_params() + model.mlp_params()) / h ** 2
    # compute grows as h^2, comm as h: the crossover is h x comm / compute
    assert rl.tp_hidden(C, W, tp, a) == pytest.approx(h * comm / compute, rel=REL)


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_ep_threshold_is_the_crossover_of_ep_cost(ep):
    T = 512
    comm = costs.ep_cost(MOE, flat(ep), tp=1, ep=ep, tokens=T, layers=1, micro_batches=1,
                         sequence_parallel=False).time
    compute = 6 * MOE.top_k * MOE.mlp_params() * T / C
    # compute grows with the expert's width f, the all-to-alls do not
    f = MOE.ffn_hidden
    assert rl.ep_ffn(C, W, ep, gated=True) == pytest.approx(f * comm / compute, rel=REL)


@pytest.mark.parametrize("pp", [2, 4])
def test_pp_ratio_is_pp_costs(pp):
    T, layers = 512, GPT.layers // pp
    comm = costs.pp_cost(flat(pp), tp=1, cp=1, dp=1, pp=pp, interleave=1, tokens=T,
                         hidden=GPT.hidden, micro_batches=1, sequence_parallel=False).time
    compute = 6 * (GPT.attention_params() + GPT.mlp_params()) * layers * T / C
    assert rl.pp_ratio(C, W, GPT.hidden, layers) == pytest.approx(compute / comm, rel=REL)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=lambda m: m.name)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_threshold_is_where_chapter_10s_ring_hides_its_hops(model, cp):
    """helpers.sp.cost: a step's hop is hidden when one block's attention outlasts it.
    At the threshold x (1 +- 1e-6) the exposed time switches from zero to positive."""
    share = model.n_kv_heads / model.heads
    local = rl.cp_tokens(C, W, share)                          # s / cp at the crossover
    for scale, hidden in ((1 + 1e-6, True), (1 - 1e-6, False)):
        s = local * scale * cp
        kv = 2 * s * model.hidden * share * 2                  # K and V of the sequence, bf16
        attention = 0.5 * 4 * (s / cp) * s * model.hidden / C  # causal: half the square
        exposed = ring_attention_time(flat(cp), kv, cp, attention)[2]
        assert (exposed == 0) == hidden, (scale, exposed)


def test_measured_h100_gemm_is_below_the_datasheet():
    measured = rl.measured_h100_gemm()
    assert 400e12 < measured < rl.H100_SXM.flops  # most shapes 600-720 TFLOP/s (the CSV)


def test_gpu_scale_table_for_a_70b_model():
    from helpers.frameworks.examples import MODELS
    rows = rl.family_thresholds(MODELS["Llama 2 70B"], rl.H100_SXM, tokens_per_gpu=4096)
    by = {(r.family, r.wire): r for r in rows}
    # H100 ridges: 989e12 / 450e9 = 2198 on NVLink, 19,780 on one 50 GB/s NIC
    assert by["DP", "NVLink"].critical == pytest.approx(2197.8 * 2 * 7 / 8 * 2 / 6, rel=1e-4)
    assert by["DP", "NVLink"].verdict == "compute-bound"
    assert by["DP", "network"].verdict == "communication-bound"
    assert by["PP", "network"].ratio > 10                       # compute-bound by far
    assert all(r.family != "EP" for r in rows)                 # a dense model has no EP row
    table = rl.format_thresholds(rows)
    assert table.count("\n") == len(rows) and "ZeRO-3/FSDP" in table


def test_refusals():
    with pytest.raises(ValueError, match="zero must be"):
        rl.zero_tokens(C, W, 4, 4)
    with pytest.raises(ValueError, match="dp"):
        rl.dp_tokens(C, W, 0)
