"""Chapters 19 and 20 price a layout with one library, term by term.

The planner (``helpers.planner``, chapter 20) ranks ``Layout``s; chapter 19's
``estimate`` costs a ``Plan``; ``Layout.to_plan`` turns one into the other.
Both read their input into the per-term cost library ``helpers.costs``, so
for the same layout:

* every shared term is computed by one call: each library function the two
  use (model state, activations, compute, bubble, and the communication of
  TP, PP, CP, EP and DP) is called by both with the same arguments, and
* every shared term has the same value, to the bit (the same function on
  the same arguments does the same float64 arithmetic).

What only one of them counts is checked to be that term and nothing else: fp32
main gradients (a ``Plan`` knob the planner does not offer). ZeRO-3's gathered
layers (chapter 15) are a term of both, so chapter 19's per-GPU memory and the
planner's are the same number for the same plan.
"""

import inspect

import pytest

from helpers import costs
from helpers.costs.gemm import GemmTable
from helpers.costs.memory import layer_activation_bytes
from helpers.frameworks import Cluster, ModelSpec, Plan, estimate
from helpers.planner import H100_80GB, Layout, evaluate
from helpers.topology import h100_cluster

LLAMA_7B = ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                     ffn=11008, gated_mlp=True)
LLAMA_70B = ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                      ffn=28672, kv_heads=8, gated_mlp=True)
GPT3 = ModelSpec(name="GPT-3 175B", layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
                 tied_embeddings=True)
GPT_1B = ModelSpec(name="GPT 1.3B", layers=24, hidden=2048, heads=16, vocab=51200, seq=2048,
                   tied_embeddings=True)
MOE = ModelSpec(name="MoE", layers=16, hidden=2048, heads=16, vocab=32000, seq=2048, experts=8,
                top_k=2)

# (model, layout, global batch, nodes of 8 H100s)
CASES = [
    (LLAMA_7B, Layout(8, 1, 1, zero=1, recompute="selective"), 64, 1),
    (LLAMA_70B, Layout(8, 8, 4, zero=1, recompute="selective", interleave=2), 512, 32),
    (GPT3, Layout(8, 8, 16, zero=1, recompute="full"), 1536, 128),
    (LLAMA_7B, Layout(16, 1, 1, zero=3, recompute="full", micro_batch=2), 64, 2),
    # stages 4 GPUs apart on 8-GPU nodes: the first hop stays in the node, the
    # second crosses it, and the pipeline runs at the slower one
    (LLAMA_7B, Layout(1, 4, 4, recompute="selective"), 64, 2),
    # context parallel across nodes (CP group 8 apart: one GPU per node)
    (LLAMA_70B, Layout(4, 8, 2, cp=2, zero=1, recompute="selective"), 256, 16),
    # experts split over 4 of the 16 DP ranks, reduced over the other 4
    (MOE, Layout(16, 1, 1, ep=4, zero=1), 256, 2),
    # plain DP over 8 whole nodes: the all-reduce on all 8 NICs of each node
    (GPT_1B, Layout(64, 1, 1, zero=0, recompute="selective", micro_batch=4), 256, 8),
    # ZeRO-2 over 8 micro-batches: a reduce-scatter each, or whole gradients held
    (LLAMA_7B, Layout(8, 1, 1, zero=2, recompute="selective"), 64, 1),
    (LLAMA_7B, Layout(8, 1, 1, zero=2, recompute="selective", whole_grads=True), 64, 1),
]
IDS = ["7B-ZeRO1-8", "70B-TP8-PP4-v2", "GPT3-TP8-PP16", "7B-ZeRO3-16", "7B-TP4-PP4-2nodes",
       "70B-CP2", "MoE-EP4", "1B-DP64-ZeRO0", "7B-ZeRO2-8", "7B-ZeRO2-whole-8"]
MEMORY = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer state",
          "gathered": "gathered layers", "activations": "activations"}
TIME = {"compute": "compute", "bubble": "pipeline bubble", "tp_comm": "tp (exposed)",
        "pp_p2p": "pp (exposed)", "cp_comm": "cp (exposed)", "ep_comm": "ep (exposed)",
        "dp_comm": "dp (exposed)"}
# the library functions both chapters call
SHARED = ("model_state", "activations", "compute_time", "bubble_time", "tp_cost", "pp_cost",
          "cp_cost", "ep_cost", "dp_cost", "gathered_layers")
ONLY_ZERO3 = ("gathered_layers",)   # called for ZeRO-3 layouts only


def _both(model, layout, global_batch, nodes, **choices):
    topo = h100_cluster(nodes)
    cand = evaluate(model, layout, global_batch, H100_80GB, topo, mfu=0.5, memory_fraction=1.0)
    assert cand.feasible, cand.reason
    est = estimate(layout.to_plan(global_batch, **choices), model,
                   Cluster.of(H100_80GB, topo, matmul_efficiency=0.5))
    return cand, est


def _record(monkeypatch):
    """Wrap each shared library function; return {name: [bound arguments of each call]}."""
    calls = {name: [] for name in SHARED}
    for name in SHARED:
        fn = getattr(costs, name)
        sig = inspect.signature(getattr(fn, "__wrapped__", fn))

        def wrapper(*args, _fn=fn, _sig=sig, _name=name, **kwargs):
            bound = _sig.bind(*args, **kwargs)
            bound.apply_defaults()
            calls[_name].append(dict(bound.arguments))
            return _fn(*args, **kwargs)

        monkeypatch.setattr(costs, name, wrapper)
    return calls


@pytest.mark.parametrize("model,layout,global_batch,nodes", CASES, ids=IDS)
def test_both_call_the_library_with_the_same_arguments(model, layout, global_batch, nodes,
                                                       monkeypatch):
    calls = _record(monkeypatch)
    topo = h100_cluster(nodes)
    evaluate(model, layout, global_batch, H100_80GB, topo, mfu=0.5, memory_fraction=1.0)
    planner = {name: list(c) for name, c in calls.items()}
    for c in calls.values():
        c.clear()
    estimate(layout.to_plan(global_batch), model,
             Cluster.of(H100_80GB, topo, matmul_efficiency=0.5))
    for name in SHARED:
        if name in ONLY_ZERO3 and layout.zero != 3:
            assert not planner[name] and not calls[name], name
            continue
        assert planner[name], f"the planner does not call costs.{name}"
        assert calls[name], f"chapter 19's estimate does not call costs.{name}"
        # one call each, the same arguments (2 and 2.0 compare equal: the same value)
        assert planner[name] == calls[name], name


@pytest.mark.parametrize("model,layout,global_batch,nodes", CASES, ids=IDS)
def test_every_shared_term_has_the_same_value(model, layout, global_batch, nodes):
    cand, est = _both(model, layout, global_batch, nodes)
    mem = {t.name: t.value for t in est.memory}
    for mine, theirs in MEMORY.items():
        assert cand.memory[mine] == mem.get(theirs, 0.0), mine   # (no gathered term: 0)
    time = {t.name: t.value for t in est.time}
    for mine, theirs in TIME.items():
        assert cand.time[mine] == time[theirs], mine      # same call, same floats
    assert set(time) == set(TIME.values())                # no term only one of them has
    if layout.tp > 1:
        assert cand.time["tp_comm"] > 0
    if layout.pp > 1:
        assert cand.time["bubble"] > 0 and cand.time["pp_p2p"] > 0
    if layout.cp > 1:
        assert cand.time["cp_comm"] > 0
    if layout.ep > 1:
        assert cand.time["ep_comm"] > 0
    # the exposed time is part of the collective time that chapter 19 also lists
    comm_time = {t.name: t.value for t in est.comm_time}
    for axis in ("tp", "pp", "cp", "ep", "dp"):
        assert time[f"{axis} (exposed)"] <= comm_time[axis]


@pytest.mark.parametrize("model,layout,global_batch,nodes", CASES, ids=IDS)
def test_both_count_zero3s_gathered_layers(model, layout, global_batch, nodes):
    """Chapter 19's per-GPU memory and the planner's are one number for one plan: ZeRO-3's
    gathered layers (chapter 15: the computing layer and the prefetched next, in bf16)
    are in both, every other plan has no such term."""
    cand, est = _both(model, layout, global_batch, nodes)
    mem = {t.name: t.value for t in est.memory}
    assert set(mem) - set(MEMORY.values()) == set()
    if layout.zero == 3:
        assert mem["gathered layers"] == 2 * (model.layer_params() / layout.tp * 2)
        assert cand.memory["gathered"] == mem["gathered layers"]
    else:
        assert "gathered layers" not in mem and cand.memory["gathered"] == 0.0
    # the same terms summed in the same order: the same float
    assert est.memory_total == cand.memory_total


def test_chapter_20s_70b_winner_is_chapter_19s_number():
    """The plan chapter 20's notebook hands to chapter 19 (70B on 64 H100s, ZeRO-3):
    both print the same GB per GPU (the notebook once printed 65.24 GB vs 68.66 GB)."""
    lay = Layout(32, 1, 1, cp=2, zero=3, recompute="selective")
    cand, est = _both(LLAMA_70B, lay, 1024, 8)
    assert cand.memory["gathered"] > 0
    assert est.memory_total == cand.memory_total


def test_a_step_with_fewer_micro_batches_than_the_warm_up_holds_them_all():
    """Korthikanti et al. sec. 4.2.3 count p micro-batches in flight on the first stage
    (p v + p - 1 chunks interleaved); a step of m micro-batches holds at most m of them
    (m v chunks), and the cap binds nowhere else."""
    llama = ModelSpec(name="405B", layers=126, hidden=16384, heads=128, vocab=128000, seq=8192,
                      ffn=53248, kv_heads=8, gated_mlp=True)
    args = (llama, 8192, 1, 8, 16, True, "selective")
    per_layer = layer_activation_bytes(llama, 8192, 1, 8, True, "selective")
    sbh = 8192 * 16384 / 8                                   # the embedding's dropout mask, SP
    for v in (1, 2, 4, 8):
        paper = costs.activations(*args, v, own_shapes=True)
        chunks = 16 * v + (16 - 1 if v > 1 else 0)          # p v + p - 1 (p for 1F1B)
        for m in (4, 16, 17, 64):
            capped = costs.activations(*args, v, own_shapes=True, micro_batches=m)
            held = min(chunks, m * v)                        # chunks of 8 / v layers each
            # the count drops by the chunks the step does not have, and by the embedding
            # masks of the micro-batches it does not have (float64 sums: rel 1e-12)
            want = paper - per_layer * 8 / v * (chunks - held) - sbh * (16 - min(16, m))
            assert capped == pytest.approx(want, rel=1e-12), (v, m)
            if m * v >= chunks and m >= 16:
                assert capped == paper


def test_fp32_main_grads_are_the_difference():
    model, layout, gb, nodes = CASES[1]
    cand, est = _both(model, layout, gb, nodes, main_grads_fp32=True)
    mem = {t.name: t.value for t in est.memory}
    # 4 bytes per parameter instead of 2, sharded the same way (ZeRO-1 leaves them whole)
    assert mem["gradients"] == 2 * cand.memory["grads"]
    assert mem["weights"] == cand.memory["weights"]
    # and they are reduced in fp32: chapter 19's reduce-scatter moves twice the bytes
    comm = {t.name: t.value for t in est.comm}
    bf16 = {t.name: t.value for t in _both(model, layout, gb, nodes)[1].comm}
    rs_ag = bf16["dp"] / 2                 # reduce-scatter and all-gather, equal bytes in bf16
    assert comm["dp"] == pytest.approx(3 * rs_ag, rel=1e-12)


def test_full_recompute_leaves_the_output_layer_alone():
    """Narayanan et al. 2021, eq. 3: with full recompute the layers run 4 passes but
    the output layer 3 (its V/16lh term is 6 B s h V): the extra forward covers the
    layers only, so the factor is below 4/3. (Their count: attention unfused, the
    whole s x s square in every pass.)"""
    m = GPT3
    full = costs.recompute_factor(m, "full", "unfused")
    layers = m.forward_flops_per_token() - 2 * m.hidden * m.vocab
    # the same ratio by another order of operations: float64 rounding only (rel 1e-12)
    assert full == pytest.approx(1 + layers / (3 * m.forward_flops_per_token()), rel=1e-12)
    assert full < 4 / 3


def test_layout_round_trip():
    lay = Layout(8, 8, 4, cp=2, zero=1, recompute="selective", micro_batch=2, interleave=2)
    plan = lay.to_plan(256)
    assert isinstance(plan, Plan)
    assert (plan.dp, plan.tp, plan.pp, plan.cp, plan.vpp, plan.zero_stage) == (8, 8, 4, 2, 2, 1)
    assert plan.grad_accum == 16 and plan.sequences_per_step == 256 and plan.sequence_parallel
    plan.validate(lay.world, LLAMA_70B)
    assert Layout.from_plan(plan) == lay
    with pytest.raises(ValueError, match="not a multiple of dp x micro-batch"):
        lay.to_plan(100)


@pytest.mark.parametrize("model,layout,global_batch,nodes",
                         [c for c in CASES if not c[0].experts],
                         ids=[i for i, c in zip(IDS, CASES) if not c[0].experts])
def test_measured_gemm_table_prices_the_same_compute_in_both(model, layout, global_batch, nodes):
    """With the measured H100 table, both price the layers' GEMMs at the rate measured
    for the layout's TP size and micro-batch tokens: one call, the same floats."""
    table = GemmTable.load("h100")
    topo = h100_cluster(nodes)
    cand = evaluate(model, layout, global_batch, H100_80GB, topo, mfu=0.5, memory_fraction=1.0,
                    gemm_table=table)
    est = estimate(layout.to_plan(global_batch), model,
                   Cluster.of(H100_80GB, topo, matmul_efficiency=0.5), gemm_table=table)
    time = {t.name: t.value for t in est.time}
    for mine, theirs in TIME.items():
        assert cand.time[mine] == time[theirs], mine
    # and the table changed the compute: no measured GEMM of these shapes runs at exactly 50 %
    plain, _ = _both(model, layout, global_batch, nodes)
    assert cand.time["compute"] != plain.time["compute"]
