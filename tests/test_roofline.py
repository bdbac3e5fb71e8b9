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


# ---------------------------------------------------------------------------
# helpers.costs.ceilings: the probe's arithmetic, and the probe on two ranks
# ---------------------------------------------------------------------------

def test_crossover_interpolates_where_compute_meets_the_all_reduce():
    from helpers.costs.ceilings import crossover
    # compute = T ms, all-reduce 10 ms: they meet at T = 10 exactly (log-log linear)
    sweep = [(n, n * 1e-3, 10e-3) for n in (2.5, 5, 20, 40)]
    assert crossover(sweep) == pytest.approx(10)
    # the all-reduce is one number, the median of the sweep's: a noisy point does not move it
    noisy = [(2.5, 2.5e-3, 10e-3), (5, 5e-3, 30e-3), (20, 20e-3, 10e-3), (40, 40e-3, 10e-3)]
    assert crossover(noisy) == pytest.approx(10)
    assert crossover([(n, 1.0, 2.0) for n in (1, 2, 4)]) is None   # never crosses


def test_slowest_takes_each_figure_from_the_slowest_rank():
    from helpers.costs.ceilings import slowest
    a = {"gemm_flops": 2.0, "memory_bw": 5.0, "link_bw": 1.0, "thin": [(4, 3.0)],
         "sweep": [(8, 1.0, 4.0)], "crossover_gemm": (8, 1.5)}
    b = {"gemm_flops": 3.0, "memory_bw": 4.0, "link_bw": 2.0, "thin": [(4, 1.0)],
         "sweep": [(8, 2.0, 3.0)], "crossover_gemm": (8, 1.0)}
    s = slowest([a, b])
    assert (s["gemm_flops"], s["memory_bw"], s["link_bw"]) == (2.0, 4.0, 1.0)
    assert s["thin"] == [(4, 1.0)] and s["sweep"] == [(8, 2.0, 4.0)]
    assert s["crossover_gemm"] == (8, 1.0)


def test_probe_on_two_ranks_and_its_picture():
    """Tiny sizes: the record's shape and invariants, not its timings."""
    import matplotlib
    matplotlib.use("Agg")
    from helpers import launch
    from helpers.costs.ceilings import roofline_probe, slowest, step_gemm_flops
    from helpers.drawing.roofline import draw_rooflines

    recs = launch(roofline_probe, 2, hidden=64, layers=2, thin=(4, 16), copy_mb=1,
                  spread=2, repeats=2)
    rec = slowest(recs)
    assert rec["gemm_flops"] == min(max(r for _, r in x["thin"]) for x in recs)
    # each rank's link roof is the median of its 7 all-reduces of the gradient's size (the
    # probe before the sweep, the 5 of the sweep, the probe after): with 2 of the 7 unseen
    # here, it lies between the 2nd and the 4th fastest of the sweep's 5
    for r in recs:
        rates = sorted(4 * r["params"] / comm for _, _, comm in r["sweep"])
        assert rates[1] * (1 - 1e-12) <= r["link_bw"] <= rates[3] * (1 + 1e-12)
    assert rec["link_bw"] == min(r["link_bw"] for r in recs)
    # the sweep is centred on what the slowest rank's roofs predict, a factor 2 apart:
    # the GEMMs' rate on the crossover's tokens, itself found on the best rate
    # (the ranks agree on it by a MAX all-reduce of 1/rate: 1/(1/x) is x within two
    # roundings of a float64, a relative 2.2e-16 each)
    assert rec["predicted_from"][0] == pytest.approx(min(r["crossover_gemm"][1] for r in recs),
                                                     rel=1e-15)
    predicted = rl.dp_tokens(*rec["predicted_from"], 2, 4)
    assert [n for n, _, _ in rec["sweep"]] == [max(1, round(predicted * 2.0 ** k))
                                               for k in (-2, -1, 0, 1, 2)]
    fig, data = draw_rooflines(rec)
    assert [p[0] for p in data["gemms"]] == ["m=4", "m=16"]
    assert [p[2] for p in data["gemms"]] == [r for _, r in rec["thin"]]
    # a step's intensity against the link: 6 P T FLOPs per 2(n-1)/n x 4 P bytes sent
    for (label, intensity, rate), (n, compute, comm) in zip(data["steps"], rec["sweep"]):
        assert label == f"T={n}" and intensity == pytest.approx(6 * n / 4)
        assert rate == pytest.approx(6 * rec["params"] * n / max(compute, comm))
    assert step_gemm_flops(16, 64) == 6 * 16 * 64 * 64


def test_gpu_scale_table_has_ep_rows_for_an_moe_model():
    rows = rl.family_thresholds(MOE, rl.H100_SXM, tokens_per_gpu=4096, degree=8)
    ep = {r.wire: r for r in rows if r.family == "EP"}
    assert set(ep) == {"NVLink", "network"}
    assert ep["NVLink"].critical == pytest.approx(rl.ep_ffn(rl.H100_SXM.flops,
                                                            rl.H100_SXM.nvlink, 8))
    assert ep["network"].value == MOE.ffn_hidden == 512
    # a measured compute roof lowers every threshold in proportion
    slow = rl.family_thresholds(MOE, rl.H100_SXM, tokens_per_gpu=4096, degree=8,
                                flops=rl.H100_SXM.flops / 2)
    for a, b in zip(rows, slow):
        if a.family != "PP":
            assert b.critical == pytest.approx(a.critical / 2)
