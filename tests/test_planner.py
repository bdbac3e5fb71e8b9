"""helpers.planner: its terms equal the chapters' cost models, its rejections name the
right rule, and published layouts are feasible and rank near the top.

Published layouts:
* Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC21), Table 1: GPT models on Selene (DGX A100
  80 GB, 8 HDR InfiniBand NICs per node), sequence 2048, vocabulary 51,200.
* Dubey et al. 2024 ("The Llama 3 Herd of Models"), sec. 3.3.2 and Table 4:
  Llama 3 405B on 16,384 H100s, TP 8, PP 16, DP 128 at 8k tokens (CP 1); at
  131,072 tokens CP 16 and DP 8. (Table 3: 126 layers, model dimension 16,384,
  FFN 53,248, 128 heads, 8 key/value heads, vocabulary 128,000.)
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers.costs import collective_time, dp_cost
from helpers.memory import training_memory
from helpers.pipeline.partition import pipeline_step_time
from helpers.planner import (A100_80GB, H100_80GB, TERMS, Layout, ModelSpec, evaluate,
                             flops_per_token, ladder, plan, structures)
from helpers.topology import a100_cluster, h100_cluster, pcie_cluster
from helpers.tp.cost import tp_layer_comm_time, tp_layer_compute_time

# (params in B, heads, hidden, layers, TP, PP, GPUs, batch): Narayanan et al. 2021, Table 1
NARAYANAN = [
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]


def gpt(params_b, heads, hidden, layers):
    return ModelSpec(name=f"GPT {params_b}B", layers=layers, hidden=hidden, heads=heads,
                     vocab=51200, seq=2048, tied_embeddings=True)


def llama405(seq):
    return ModelSpec(name="Llama 3 405B", layers=126, hidden=16384, heads=128, vocab=128000,
                     seq=seq, ffn=53248, kv_heads=8,
                     gated_mlp=True)


LLAMA_7B = ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn=11008,
                     gated_mlp=True)
LLAMA_70B = ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                      ffn=28672, kv_heads=8, gated_mlp=True)


# --- the model's inputs and terms against the chapters' own formulas ----------------------

@pytest.mark.parametrize("row", NARAYANAN)
def test_parameter_count_matches_table_1(row):
    # Table 1's counts include biases, norms and learned positions (~13 l h + s h),
    # which ModelSpec leaves out: ours is smaller by less than 0.1 %.
    params_b, heads, hidden, layers = row[:4]
    n = gpt(params_b, heads, hidden, layers).total_params()
    assert n < params_b * 1e9 and n == pytest.approx(params_b * 1e9, rel=1e-3)


def test_llama3_405b_parameter_count():
    # Dubey et al. 2024 call it 405B; GQA and SwiGLU counted, untied embeddings
    assert llama405(8192).total_params() == pytest.approx(405e9, rel=0.005)


def test_flops_per_token_is_chapter_09s_count_plus_the_output_layer():
    # Narayanan eq. 3 without recompute: 72 tokens h^2 (1 + s/6h) per layer
    # (tp_layer_compute_time at 1 FLOP/s gives FLOPs) + 6 V h per token for the
    # logits. Same products in another order: equal to a few ulps (rel 1e-12).
    m = gpt(*NARAYANAN[0][:4])
    tokens = 8 * m.seq
    layers = m.layers * tp_layer_compute_time(m.hidden, tokens, m.seq, 1, flops=1.0)
    assert flops_per_token(m) * tokens == pytest.approx(layers + 6 * m.vocab * m.hidden * tokens,
                                                        rel=1e-12)


@pytest.mark.parametrize("lay", [Layout(8, 8, 4, zero=0, recompute="selective", micro_batch=2),
                                 Layout(64, 2, 2, zero=1, recompute="full", micro_batch=1),
                                 Layout(256, 1, 1, zero=3, recompute="none", micro_batch=1)])
def test_memory_terms_are_training_memory(lay):
    # the planner calls training_memory's two halves with their own caches: the same
    # arithmetic, so exact equality for a GPT-shaped model (the planner counts each
    # layer with the model's own MLP and K/V, which for GPT shapes is Table 2's count)
    m = ModelSpec(name="70B as GPT", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096)
    e = evaluate(m, lay, 1024, H100_80GB, h100_cluster(32), memory_fraction=1e9)
    want = training_memory(m.dense_params(), seq=m.seq, micro_batch=lay.micro_batch,
                           hidden=m.hidden, heads=m.heads, layers=m.layers, vocab=m.vocab,
                           zero_stage=lay.zero, dp=lay.dp, tp=lay.tp, pp=lay.pp,
                           sequence_parallel=lay.tp > 1, recompute=lay.recompute)
    assert e.feasible, e.reason
    for part in ("weights", "grads", "optimizer"):
        assert e.memory[part] == want[part], part
    # the same sum plus (own layer - GPT layer) x the layers held, which is 0 here:
    # equal to rounding of that zero difference, far below a byte
    assert e.memory["activations"] == pytest.approx(want["activations"], rel=1e-12)


def test_planner_counts_swiglu_and_grouped_kv_activations():
    """For Llama 2 70B (SwiGLU 3.5h, 8 of 64 K/V heads) the planner's activations are the GPT
    count plus, per layer held, 2 sbh/t x (6 x 3.5 - 16) for the MLP and 4 sbh/t x
    (8/64 - 1) for K and V, with TP 8 + SP and selective recompute."""
    lay = Layout(16, 8, 4, zero=1, recompute="selective", micro_batch=1)
    e = evaluate(LLAMA_70B, lay, 1024, H100_80GB, h100_cluster(64), memory_fraction=1e9)
    want = training_memory(LLAMA_70B.dense_params(), seq=4096, micro_batch=1, hidden=8192,
                           heads=64, layers=80, vocab=32000, zero_stage=1, dp=16, tp=8, pp=4,
                           sequence_parallel=True, recompute="selective")["activations"]
    sbh = 4096 * 8192
    per_layer = (6 * 28672 / 8192 - 16 + 4 * (8 / 64) - 4) * sbh / 8
    assert e.memory["activations"] == pytest.approx(want + 80 * per_layer, rel=1e-12)


def test_bubble_and_tp_terms_are_chapters_11_and_09s_models():
    m, lay = LLAMA_70B, Layout(16, 8, 4, recompute="selective", micro_batch=1)
    topo = h100_cluster(64)
    e = evaluate(m, lay, 512, H100_80GB, topo)
    n_mb = 512 // 16
    # ch. 11: (m-1) max + sum over p equal stages; rel 1e-12: the same ratio computed
    # by another order of operations
    compute = e.time["compute"]
    assert e.time["bubble"] == pytest.approx(
        pipeline_step_time([compute / n_mb] * 4, n_mb) - compute, rel=1e-12)
    # ch. 09: 4 ring all-reduces per layer on NVLink (the 8 TP ranks share a node)
    per_layer = tp_layer_comm_time(m.hidden, m.seq, 8, topo.intra)
    assert e.time["tp_comm"] == pytest.approx(per_layer * (m.layers // 4) * n_mb, rel=1e-12)


def test_dp_term_is_nccls_ring_on_the_strided_group():
    # 7B, DP 8 x TP 8 on 8 H100 nodes, ZeRO-0: the DP group of GPU 0 is {0, 8, ..., 56},
    # one GPU per node, so NCCL's ring has 2(P-1) = 14 steps, all across the network
    # (nInterSteps = 2(n-1) = 14), on one NIC per group (k m / g = 8 x 1 / 8): the
    # all-reduce of the 1/8 of the bf16 gradients this GPU holds, exposed beyond the
    # last micro-batch's backward (2/3 of its compute)
    m, lay, topo = LLAMA_7B, Layout(8, 8, 1, zero=0, recompute="selective"), h100_cluster(8)
    e = evaluate(m, lay, 64, H100_80GB, topo, memory_fraction=1e9)
    nbytes = m.dense_params() / 8 * 2
    ring = 14 * topo.inter.latency + 2 * 7 / 8 * nbytes / topo.inter.bandwidth
    t_mb = e.time["compute"] / (64 // 8)
    # the same sum in another order: float64 rounding only (rel 1e-12)
    assert e.time["dp_comm"] == pytest.approx(max(0.0, ring - 2 / 3 * t_mb), rel=1e-12)
    # packed: DP 64 x TP 1 fills every node, and ZeRO-1 all-gathers the updated bf16
    # weights: 63 ring steps, 7 of them across nodes, all 8 NICs carrying it, busbw
    # min(NVLink 450, 8 x 50) = 400 GB/s; overlapped with the next step's first
    # forward (Megatron's --overlap-param-gather: Layout.to_plan's choice), so only
    # what outlasts that forward (1/3 of the one micro-batch's compute) is exposed;
    # the reduce-scatter hides behind the backward
    lay = Layout(64, 1, 1, zero=1, recompute="selective")
    e = evaluate(m, lay, 64, H100_80GB, topo, memory_fraction=1e9)
    nbytes = m.dense_params() * 2
    gather = 56 * topo.intra.latency + 7 * topo.inter.latency + 63 / 64 * nbytes / 400e9
    assert collective_time(topo, "all_gather", nbytes, 64) == pytest.approx(gather, rel=1e-12)
    forward = e.time["compute"] / 3
    assert gather < forward and e.time["dp_comm"] == 0.0  # 33 ms behind a 133 ms forward
    # without the overlap it would all be exposed
    assert dp_cost(m, topo, dp=64, tp=1, pp=1, zero=1, micro_batch_time=e.time["compute"],
                   overlap_param_gather=False).exposed == pytest.approx(gather, rel=1e-12)


def test_structures_multiply_to_the_world_without_duplicates():
    topo = h100_cluster(8)   # 64 GPUs = 2^6
    got = structures(LLAMA_7B, topo)
    assert all(dp * tp * pp * cp == 64 for dp, tp, pp, cp, _ in got)
    assert len(set(got)) == len(got)
    # ordered factorizations of 2^6 into 4 factors: C(6 + 3, 3) = 84 (every CP size
    # divides the 4096-token sequence)
    assert len(got) == math.comb(9, 3)


# --- rejections name the rule ----------------------------------------------------------------

def reject(model, lay, batch=1024, topo=None, gpu=H100_80GB):
    e = evaluate(model, lay, batch, gpu, topo or h100_cluster(lay.world // 8 or 1))
    assert not e.feasible
    return e


def test_tp_across_nodes_is_rejected():
    e = reject(LLAMA_70B, Layout(8, 16, 1))
    assert e.rule == "tp-crosses-node" and "tp=16 > 8 GPUs per node" in e.reason
    # the same TP fits a 16-GPU node
    ok = evaluate(LLAMA_70B, Layout(8, 16, 1, zero=3, recompute="full"), 1024, H100_80GB,
                  pcie_cluster(8, gpus_per_node=16))
    assert ok.rule != "tp-crosses-node"


def test_shape_and_batch_rules():
    m = ModelSpec(name="odd", layers=29, hidden=4000, heads=20, vocab=32000, seq=2048)
    e = reject(m, Layout(8, 8, 1))
    assert e.rule == "heads" and "20 heads do not divide over tensor-parallel size 8" in e.reason
    assert reject(m, Layout(16, 1, 4)).rule == "layers"   # neither 29 nor 29 + 2 splits over 4
    # Llama 3's 126 layers on 16 stages: 126 + 2 = 128 (embedding and loss as a layer each)
    assert evaluate(llama405(8192), Layout(128, 8, 16, zero=1, recompute="full"), 2048, H100_80GB,
                    h100_cluster(2048)).feasible
    assert reject(LLAMA_7B, Layout(8, 1, 1), batch=100).rule == "batch"
    assert reject(LLAMA_7B, Layout(8, 1, 1, micro_batch=8), batch=32).rule == "micro-batch"
    assert reject(LLAMA_70B, Layout(8, 1, 1, 8, recompute="none")).rule == "cp-recompute"
    assert reject(LLAMA_70B, Layout(8, 8, 1, interleave=2)).rule == "interleave"
    e = evaluate(LLAMA_7B, Layout(4, 1, 1), 1024, H100_80GB, h100_cluster(1))
    assert e.rule == "world" and "is not the 8 GPUs" in e.reason


def test_memory_rejection_names_the_largest_term():
    # 70B, no sharding: 16 bytes/param on 8-way TP = 140 GB, optimizer 105 GB of it
    e = reject(LLAMA_70B, Layout(8, 8, 1, zero=0, recompute="full"), topo=h100_cluster(8))
    assert e.rule == "memory" and "largest term: optimizer" in e.reason
    # 7B at 32k tokens, no recompute, ZeRO-3 over 8: activations dominate
    long7 = ModelSpec(name="7B-32k", layers=32, hidden=4096, heads=32, vocab=32000, seq=32768)
    e = reject(long7, Layout(8, 1, 1, zero=3, recompute="none"), topo=h100_cluster(1))
    assert e.rule == "memory" and "largest term: activations" in e.reason


def test_moe_experts_split_over_ep():
    moe = ModelSpec(name="MoE", layers=16, hidden=2048, heads=16, vocab=32000, seq=2048, experts=8,
                    top_k=2)
    topo = h100_cluster(2)
    one = evaluate(moe, Layout(16, 1, 1, ep=1, zero=1), 256, H100_80GB, topo)
    four = evaluate(moe, Layout(16, 1, 1, ep=4, zero=1), 256, H100_80GB, topo)
    assert one.feasible and four.feasible
    # 16 bytes/param (ZeRO-1: 4 + 12/dp) of the experts: ep=4 keeps a quarter of them
    assert four.memory["weights"] < one.memory["weights"]
    assert four.time["ep_comm"] > 0 == one.time["ep_comm"]
    assert reject(moe, Layout(16, 1, 1, ep=3), topo=topo).rule == "experts"


def test_plan_arguments_and_no_feasible_layout():
    topo = h100_cluster(1)
    for kwargs, msg in ((dict(global_batch=0), "global_batch"), (dict(mfu=0), "mfu"),
                        (dict(zero_stages=(4,)), "ZeRO stage"),
                        (dict(recomputes=("some",)), "recompute"),
                        (dict(micro_batches=(0,)), "micro-batch")):
        args = dict(model=LLAMA_7B, global_batch=64, gpu=H100_80GB, topology=topo) | kwargs
        with pytest.raises(ValueError, match=msg):
            plan(**args)
    p = plan(gpt(1008.0, 160, 25600, 128), 64, H100_80GB, topo)
    assert not p.ranked
    with pytest.raises(ValueError, match="no layout of GPT 1008.0B fits 8 x"):
        p.best


def test_decide_splits_the_step_time_difference_into_terms():
    p = plan(LLAMA_70B, 512, H100_80GB, h100_cluster(8))
    a, b = p.ranked[0], p.ranked[-1]
    term, diff = p.decide(a, b)
    # the terms sum to the step time, so their differences sum to the step difference
    assert sum(b.time[t] - a.time[t] for t in TERMS) == pytest.approx(b.step_time - a.step_time)
    assert diff == max(b.time[t] - a.time[t] for t in TERMS) > 0
    assert p.explain().count("GB") >= 5 and term in TERMS


# --- published layouts ---------------------------------------------------------------------

@pytest.mark.parametrize("row", NARAYANAN, ids=lambda r: f"{r[0]}B")
def test_narayanan_table_1_layouts_rank_near_the_top(row):
    params_b, heads, hidden, layers, t, p, n, batch = row
    m = gpt(params_b, heads, hidden, layers)
    topo = a100_cluster(n // 8)
    dp = n // (t * p)
    # The options Megatron-LM had in 2021: no distributed optimizer (ZeRO-0), no CP
    # (both came later); interleaving, recompute and micro-batch free.
    paper = plan(m, batch, A100_80GB, topo, zero_stages=(0,), cp_sizes=(1,))
    e = paper.find(dp, t, p)
    assert e.feasible, e.reason
    rank = paper.rank_of(dp, t, p)
    print(f"\n{params_b}B: DP{dp} x TP{t} x PP{p} ranks {rank} of {len(paper.structures())} "
          f"structures with 2021's options; best {paper.best.layout.short()}")
    assert rank <= 3
    # Everything allowed: still feasible; where another structure wins, name the term
    full = plan(m, batch, A100_80GB, topo, cp_sizes=(1,))
    e = full.find(dp, t, p)
    assert e.feasible
    term, diff = full.decide(full.best, e)
    print(f"  all options: rank {full.rank_of(dp, t, p)} of {len(full.structures())}; best "
          f"{full.best.layout.short()}; the published layout is slower by {diff:+.2f} s of {term}")
    assert e.step_time >= full.best.step_time * (1 - 0.02)   # the band: ties to simpler


@pytest.mark.parametrize("seq, batch, dp, cp, cps", [
    (8192, 2048, 128, 1, (1,)),                    # pretraining, Table 4 rows 2
    (131072, 128, 8, 16, (1, 2, 4, 8, 16)),        # long context, Table 4 row 3
])
def test_llama3_405b_layout_ranks_near_the_top(seq, batch, dp, cp, cps):
    # 16,384 H100s = 2048 DGX-like nodes; ZeRO-1/2: Llama 3 shards optimizer state and
    # gradients but keeps the weights after forward (sec. 3.3.2)
    p = plan(llama405(seq), batch, H100_80GB, h100_cluster(2048), zero_stages=(1, 2),
             cp_sizes=cps)
    e = p.find(dp, 8, 16, cp)
    assert e.feasible, e.reason
    rank = p.rank_of(dp, 8, 16, cp)
    term, diff = p.decide(p.best, e)
    print(f"\nLlama 3 405B at {seq}: DP{dp} x TP8 x PP16 x CP{cp} ranks {rank} of "
          f"{len(p.structures())}; best {p.best.layout.short()}; published slower by "
          f"{diff:+.2f} s of {term}")
    assert rank <= 5
    # the published layout is wrong on anything else: TP 16 crosses the node
    assert p.find(dp // 2, 16, 16, cp).rule == "tp-crosses-node"


@pytest.mark.parametrize("argv, message", [(["--gpus", "12"], "multiples of 8"),
                                           (["--gpus", "a"], "comma-separated ints"),
                                           (["--reps", "0"], "--reps must be >= 1")])
def test_benchmark_refuses_bad_arguments(argv, message, load_bench):
    with pytest.raises(ValueError, match=message):
        load_bench("bench_planner").main(argv)


def test_ladder_climbs_the_courses_order():
    # 7B x 16 bytes = 108 GB: plain DP cannot hold it on 80 GB GPUs, ZeRO-1 over 8 can
    steps = ladder(LLAMA_7B, 512, H100_80GB, h100_cluster(1))
    names = [name.split(" (")[0] for name, _ in steps]
    assert names == ["DP", "+ ZeRO-1/2", "+ ZeRO-3 / FSDP", "+ TP inside a node",
                     "+ PP across nodes", "+ CP"]
    assert not steps[0][1].ranked and steps[0][1].reasons()[0][0] == "memory"
    assert steps[1][1].best.layout.zero in (1, 2) and steps[1][1].best.layout.tp == 1
    # each rung allows what the ones below it did: its fastest is never slower
    times = [min(e.step_time for e in p.ranked) for _, p in steps[1:]]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:]))
    # the 70B model needs ZeRO-3 before anything fits on 64 GPUs without TP
    steps = ladder(LLAMA_70B, 1024, H100_80GB, h100_cluster(8))
    assert [bool(p.ranked) for _, p in steps[:3]] == [False, False, True]


def test_spec_and_layout_refuse_bad_values():
    with pytest.raises(ValueError, match="heads=7"):
        ModelSpec(name="m", layers=4, hidden=64, heads=7, vocab=100, seq=16)
    with pytest.raises(ValueError, match="8 query heads do not group over 3"):
        ModelSpec(name="m", layers=4, hidden=64, heads=8, vocab=100, seq=16, kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        ModelSpec(name="m", layers=4, hidden=64, heads=8, vocab=100, seq=16, experts=4, top_k=5)
    with pytest.raises(ValueError, match="Layout.tp must be a positive int"):
        Layout(8, 0, 1)
    with pytest.raises(ValueError, match="ZeRO stage"):
        Layout(8, 1, 1, zero=True)
    with pytest.raises(ValueError, match="recompute"):
        Layout(8, 1, 1, recompute="some")
    with pytest.raises(ValueError, match="whole_grads is a ZeRO-2 choice"):
        Layout(8, 1, 1, zero=1, whole_grads=True)


def test_zero2_under_accumulation_pays_in_memory_or_in_traffic():
    # 16 micro-batches a step. ZeRO-2's shard is held only by reduce-scattering every
    # micro-batch; holding the whole gradients until one reduce-scatter is ZeRO-1.
    topo = h100_cluster(8)
    kw = dict(dp=64, tp=1, pp=1, recompute="full", micro_batch=1)
    e1, e2, e2w = (evaluate(LLAMA_7B, Layout(zero=z, whole_grads=w, **kw), 1024, H100_80GB, topo)
                   for z, w in ((1, False), (2, False), (2, True)))
    assert e2w.memory == e1.memory and e2w.time == e1.time
    assert e2.memory["grads"] == pytest.approx(e1.memory["grads"] / 64, rel=1e-12)
    dp = {z: dp_cost(LLAMA_7B, topo, dp=64, tp=1, pp=1, zero=z, micro_batches=16).time
          for z in (1, 2)}
    # 16 reduce-scatters + 1 all-gather, against 1 + 1 (a ring reduce-scatter and
    # all-gather of one size take the same time)
    assert dp[2] == pytest.approx(17 / 2 * dp[1], rel=1e-12)
    assert e2.time["dp_comm"] >= e1.time["dp_comm"]
    assert "whole grads" in e2w.layout.short() and "whole" not in e2.layout.short()
    plan19 = e2w.layout.to_plan(1024)
    assert plan19.whole_grads and Layout.from_plan(plan19) == e2w.layout
    # one micro-batch a step: nothing to accumulate, the choice changes nothing
    one = dict(kw, micro_batch=16)
    assert (evaluate(LLAMA_7B, Layout(zero=2, whole_grads=True, **one), 1024, H100_80GB,
                     topo).memory
            == evaluate(LLAMA_7B, Layout(zero=2, **one), 1024, H100_80GB, topo).memory)


def test_the_gpt_1t_winner_is_not_a_free_zero2():
    # Narayanan et al.'s 1T GPT with every option: a ZeRO-2 that pays for its sharded
    # gradients (a reduce-scatter per micro-batch) no longer wins with 8 stages
    m = gpt(1008.0, 160, 25600, 128)
    p = plan(m, 3072, A100_80GB, a100_cluster(384), cp_sizes=(1,))
    best = p.best.layout
    assert not (best.zero == 2 and 3072 // best.dp // best.micro_batch > 1), best.short()


def test_untied_input_embedding_is_not_counted_as_flops():
    # the lookup costs no matmul: an untied model's FLOPs equal the tied one's
    tied = ModelSpec(name="t", layers=4, hidden=64, heads=8, vocab=1000, seq=16,
                     tied_embeddings=True)
    untied = ModelSpec(name="u", layers=4, hidden=64, heads=8, vocab=1000, seq=16)
    assert untied.total_params() == tied.total_params() + 1000 * 64
    assert flops_per_token(untied) == flops_per_token(tied)


# ---------------------------------------------------------------------------
# One layer's activations with the model's own shapes (SwiGLU, grouped-query attention)
# ---------------------------------------------------------------------------

def test_layer_activations_with_gpt_shapes_are_table_2():
    from helpers.costs.memory import layer_activation_bytes
    from helpers.memory import activation_bytes_per_layer
    gpt = ModelSpec(name="gpt", layers=4, hidden=1024, heads=16, vocab=50304, seq=2048)
    for tp in (1, 2, 8):
        for sp in ((False, True) if tp > 1 else (False,)):
            for rc in ("none", "selective", "full"):
                ours = layer_activation_bytes(gpt, 2048, 2, tp, sp, rc)
                table = activation_bytes_per_layer(2048, 2, 1024, 16, tp=tp,
                                                   sequence_parallel=sp, recompute=rc)
                assert ours == pytest.approx(table, rel=1e-12), (tp, sp, rc)


def test_layer_activations_count_swiglu_and_grouped_kv():
    """SwiGLU keeps 6 sbf instead of GeLU's 4 sbf; 8 of 128 key/value heads keep 4 sbh / 16
    of K and V instead of 4 sbh: the differences, term by term, for Llama 3 405B's shapes."""
    from helpers.costs.memory import layer_activation_bytes
    llama = ModelSpec(name="405B", layers=126, hidden=16384, heads=128, vocab=128000,
                      seq=8192, ffn=53248, kv_heads=8, gated_mlp=True)
    as_gpt = ModelSpec(name="405B as GPT", layers=126, hidden=16384, heads=128, vocab=128000,
                       seq=8192)
    sbh = 8192 * 16384
    diff = (layer_activation_bytes(llama, 8192, 1, 8, True, "selective")
            - layer_activation_bytes(as_gpt, 8192, 1, 8, True, "selective"))
    want = (6 * 53248 / 16384 - 16 + 4 * 8 / 128 - 4) * sbh / 8
    assert diff == pytest.approx(want, rel=1e-12)
    assert layer_activation_bytes(llama, 8192, 1, 8, True, "full") == 2 * sbh / 8


def test_a_fused_causal_kernel_executes_half_the_square_and_re_runs_qk_only():
    """Attention's two s x s matmuls, per token per layer, in units of 2 s h FLOPs (one
    whole-square matmul): model FLOPs count 6 (forward 2, backward 4, the whole square).
    A fused causal kernel (FlashAttention) computes half the square and its backward
    re-runs Q K^T: 7 halves; full recompute re-runs the forward's 2 too: 9 halves.
    Stored scores mean an unfused kernel: the whole square, 6."""
    from helpers.costs.compute import attention_flops_per_token, hardware_flops_per_step
    m = llama405(131072)
    unit = 2 * m.seq * m.hidden * m.layers
    assert attention_flops_per_token(m, "none") == 6 * unit
    assert attention_flops_per_token(m, "selective") == 3.5 * unit
    assert attention_flops_per_token(m, "full") == 4.5 * unit
    assert attention_flops_per_token(m, "selective", "unfused") == 8 * unit   # Korthikanti
    # the model FLOPs' attention (3 x 4 s h l) is the unfused kernel without re-runs
    model_attention = 3 * 4 * m.seq * m.hidden * m.layers
    assert attention_flops_per_token(m, "none") == model_attention
    # at 128K the attention is over half the model FLOPs, so a fused kernel without
    # re-running the layers executes fewer FLOPs than the model FLOPs count
    assert model_attention > 0.5 * flops_per_token(m)
    per_token = hardware_flops_per_step(m, 1, "selective") / m.seq
    assert per_token == pytest.approx(flops_per_token(m) - 2.5 * unit, rel=1e-12)
    assert per_token < flops_per_token(m)
    with pytest.raises(ValueError, match="attention must be one of"):
        attention_flops_per_token(m, "full", "flash")


# --- measured GEMM efficiency by shape (helpers.costs.gemm) --------------------------------

def test_weight_gemm_flops_are_the_layer_part_of_narayanan():
    from helpers.costs.compute import (compute_time, hardware_flops_per_step,
                                       weight_gemm_flops_per_step)
    m, b = gpt(*NARAYANAN[0][:4]), 8
    tokens, l, h = b * m.seq, m.layers, m.hidden
    # a GPT layer's weights are 12 h^2: 2 FLOPs each per token, 3 passes (4 with full
    # recompute); the rest is attention's 4 s h per layer per pass (unfused: the whole
    # square, 3 passes, 4 with full recompute, + Korthikanti's re-run of both matmuls with
    # selective) and the output layer's 2 h V, 3 passes
    for recompute, passes in (("none", 3), ("selective", 3), ("full", 4)):
        gemm = weight_gemm_flops_per_step(m, b, recompute)
        assert gemm == passes * 24 * l * h * h * tokens
        rest = hardware_flops_per_step(m, b, recompute, "unfused") - gemm
        attention = (passes + (recompute == "selective")) * 4 * m.seq * h * l
        # ~1e18 FLOPs summed in different orders: float64 rounding only (rel 1e-12)
        assert rest == pytest.approx((attention + 3 * 2 * h * m.vocab) * tokens, rel=1e-12)
    # at one rate for both parts, the split prices the step as the unsplit call does
    one = compute_time(m, b, "full", 64, 400e12)
    assert compute_time(m, b, "full", 64, 400e12, 400e12) == pytest.approx(one, rel=1e-12)
    assert compute_time(m, b, "full", 64, 400e12, 800e12) < one


def test_measured_table_prices_thin_tp_shards_lower():
    from helpers.costs.gemm import GemmTable
    topo, table = h100_cluster(1), GemmTable.load("h100")
    tp1, tp8 = Layout(8, 1, 1, zero=3, recompute="selective"), Layout(1, 8, 1, recompute="selective")
    plain = [evaluate(LLAMA_7B, lay, 64, H100_80GB, topo, memory_fraction=1.0) for lay in (tp1, tp8)]
    meas = [evaluate(LLAMA_7B, lay, 64, H100_80GB, topo, memory_fraction=1.0, gemm_table=table)
            for lay in (tp1, tp8)]
    # hidden 4096: TP 8's attention-out multiplies by a 512-wide shard, measured slower
    assert plain[0].gemm_efficiency is None
    print(f"\nLlama-7B-like, 4096 tokens per micro-batch: GEMMs at {meas[0].gemm_efficiency:.1%} "
          f"of peak at TP 1, {meas[1].gemm_efficiency:.1%} at TP 8")
    assert meas[1].gemm_efficiency < meas[0].gemm_efficiency
    # the assumed MFU prices both layouts' compute the same (same FLOPs, same GPUs);
    # the table makes TP 8's slower
    assert plain[0].time["compute"] == plain[1].time["compute"]
    assert meas[1].time["compute"] > meas[0].time["compute"]
    # a smaller micro-batch (fewer rows) is measured less efficient too: 2048 vs 8192 tokens
    short = evaluate(dataclasses.replace(LLAMA_7B, seq=2048), tp8, 64, H100_80GB, topo,
                     memory_fraction=1.0, gemm_table=table)
    long = evaluate(dataclasses.replace(LLAMA_7B, seq=8192), tp8, 64, H100_80GB, topo,
                    memory_fraction=1.0, gemm_table=table)
    assert short.gemm_efficiency < long.gemm_efficiency


def test_measured_ranking_is_deterministic_and_the_default_unchanged():
    topo = h100_cluster(2)
    kw = dict(micro_batches=(1, 2), interleaves=(1, 2))
    a = plan(LLAMA_7B, 256, H100_80GB, topo, gemm_table="h100", **kw)
    b = plan(LLAMA_7B, 256, H100_80GB, topo, gemm_table="h100", **kw)
    assert [(e.layout, e.step_time) for e in a.ranked] == [(e.layout, e.step_time) for e in b.ranked]
    plain = plan(LLAMA_7B, 256, H100_80GB, topo, **kw)
    # no table: every layout priced at the assumed MFU, as before the option existed
    assert plain.gemm_table is None and all(e.gemm_efficiency is None for e in plain.ranked)
    assert {e.layout for e in a.ranked} == {e.layout for e in plain.ranked}  # same rules
    assert "measured on NVIDIA H100" in a.explain() and "assumed at 50%" in plain.explain()


def test_measured_table_refuses_what_it_cannot_price():
    topo = h100_cluster(1)
    with pytest.raises(ValueError, match="no measured GEMM table 'b200'; have"):
        plan(LLAMA_7B, 64, H100_80GB, topo, gemm_table="b200")
    with pytest.raises(ValueError, match="measured on NVIDIA H100 80GB HBM3, not A100"):
        plan(LLAMA_7B, 64, A100_80GB, a100_cluster(1), gemm_table="h100")
    moe = ModelSpec(name="MoE", layers=4, hidden=1024, heads=8, vocab=1000, seq=1024,
                    experts=8, top_k=2)
    with pytest.raises(ValueError, match="prices dense layers; MoE has 8 experts"):
        plan(moe, 64, H100_80GB, topo, gemm_table="h100")
    with pytest.raises(TypeError, match="GemmTable or a table's name"):
        plan(LLAMA_7B, 64, H100_80GB, topo, gemm_table=0.7)


# Dubey et al. 2024, Table 4: (GPUs, seq, DP, CP, published MFU) for Llama 3 405B, TP 8, PP 16
LLAMA3_TABLE_4 = [(8192, 8192, 64, 1, 0.43), (16384, 8192, 128, 1, 0.41),
                  (16384, 131072, 8, 16, 0.38)]


@pytest.mark.parametrize("gpus, seq, dp, cp, published", LLAMA3_TABLE_4)
def test_llama3_mfu_with_the_measured_table(gpus, seq, dp, cp, published):
    """What the planner predicts for Llama 3 405B's published layouts, priced with the
    H100 GEMM table, against Table 4's MFU.

    * The ceiling, model FLOPs over the compute term alone (GEMMs at their measured
      rate, attention and the output layer at the assumed 50 %, nothing else), is above
      the published MFU: a step also runs memory-bound kernels (norms, SwiGLU, rotary,
      softmax, the optimizer) that no GEMM table prices, and waits on the bubble and
      on communication.
    * At 8K tokens the planner fits these layouts only with full recompute (Korthikanti's
      activations on the first of 16 stages), which re-runs every layer's forward: its
      estimate lies at or below the published MFU, and at an assumed 50 % on every FLOP
      executed even the ceiling is below it, which is why the measured rates (about 70 %
      for these shapes) are the ones to plan with.
    * At 128K the attention matmuls are over half of the model FLOPs and a fused causal
      kernel executes about half of them, so even with full recompute the step executes
      about its model FLOPs: the ceiling at an assumed 50 % is above the published 38 %,
      and the estimate too (what the planner leaves out decides that row)."""
    m = llama405(seq)
    kw = dict(zero_stages=(1, 2), cp_sizes=(cp,), tp_sizes=(8,), pp_sizes=(16,))
    batch = 16 * 2**20 // seq                          # 16M tokens per step (Table 4)
    out = {}
    for name, table in (("assumed 50%", None), ("measured", "h100")):
        e = plan(m, batch, H100_80GB, h100_cluster(gpus // 8), gemm_table=table, **kw).find(
            dp, 8, 16, cp)
        assert e.feasible, e.reason
        out[name] = (e.mfu, e.mfu * e.step_time / e.time["compute"], e)
    mfu, ceiling, e = out["measured"]
    print(f"\nLlama 3 405B, {gpus} GPUs, seq {seq}, {e.layout.short()}: published MFU "
          f"{published:.0%}; with the table: estimate {mfu:.1%}, compute-only ceiling "
          f"{ceiling:.1%} (GEMMs at {e.gemm_efficiency:.0%}); assumed 50%: estimate "
          f"{out['assumed 50%'][0]:.1%}, ceiling {out['assumed 50%'][1]:.1%}")
    assert e.layout.recompute == "full"
    assert published < ceiling
    assert out["assumed 50%"][0] < mfu
    if seq == 8192:
        assert mfu <= published
        assert out["assumed 50%"][1] < published
    else:
        assert published < out["assumed 50%"][1] and published < mfu


# --- the roofline's verdict per axis (chapter 01) -------------------------------------------

def _only(model, global_batch, topo, dp, tp, zero, recompute):
    """A plan of the one structure DP dp x TP tp, and its best candidate."""
    p = plan(model, global_batch, H100_80GB, topo, zero_stages=(zero,), recomputes=(recompute,),
             micro_batches=(1,), interleaves=(1,), tp_sizes=(tp,), pp_sizes=(1,),
             cp_sizes=(1,))
    return p, p.find(dp, tp, 1)


def test_pure_dp_balance_is_the_rooflines_dp_threshold():
    """Pure DP on one node: the planner's dp ratio is roofline.dp_tokens over the tokens a
    rank holds, scaled by the model's 6 P FLOPs per token over the FLOPs it executes, plus
    NCCL's ring latency (14 NVLink steps) over the compute: exactly, to float rounding."""
    from helpers.costs import hardware_flops_per_step, ring_latency, roofline
    model, topo, gb, mfu = gpt(1.3, 32, 2048, 24), h100_cluster(1), 32, 0.5
    p, e = _only(model, gb, topo, 8, 1, 0, "selective")
    tokens_per_rank = gb * model.seq / 8
    compute = hardware_flops_per_step(model, gb, "selective") / (8 * H100_80GB.peak_flops * mfu)
    per_token = hardware_flops_per_step(model, 1, "selective") / model.seq
    want = (roofline.dp_tokens(H100_80GB.peak_flops * mfu, topo.intra.bandwidth, 8)
            / tokens_per_rank * 6 * model.dense_params() / per_token
            + ring_latency(topo, "all_reduce", 8) / compute)
    assert p.balance(e) == {"dp": pytest.approx(want, rel=1e-9)}
    assert p.bound_axis(e) == ("dp", pytest.approx(want, rel=1e-9))


def test_explain_names_the_bound_axis():
    """70B, TP 8 in each node, DP 8 across nodes on one NIC per GPU: one sequence per DP
    rank leaves the DP all-reduce the bound axis (4,096 tokens, under the NIC's threshold);
    128 sequences per rank put it far under TP's four all-reduces per layer."""
    topo = h100_cluster(8)
    small, one = _only(LLAMA_70B, 8, topo, 8, 8, 1, "full")
    assert small.bound_axis(one)[0] == "dp" and small.bound_axis(one)[1] > 1
    assert "the bound axis is dp, communication-bound" in small.explain(one)
    big, e = _only(LLAMA_70B, 1024, topo, 8, 8, 1, "full")
    ratios = big.balance(e)
    assert list(ratios) == ["tp", "dp"] and ratios["tp"] < 1
    # TP's ratio does not depend on the batch: 6 all-reduces per layer (full recompute)
    # against that layer's compute, the same at 8 and 1024 sequences
    assert ratios["tp"] == pytest.approx(small.balance(one)["tp"], rel=1e-12)
    assert f"the bound axis is tp, compute-bound by {1 / ratios['tp']:.1f}x" in big.explain(e)
