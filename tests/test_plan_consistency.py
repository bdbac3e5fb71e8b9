"""Chapters 19 and 20 describe the same layout with the same numbers.

The planner (``helpers.planner``, chapter 20) ranks ``Layout``s; chapter 19's
``estimate`` costs a ``Plan``. ``Layout.to_plan`` turns one into the other, and
for the layouts below each term that both compute must agree:

* memory: both call ``helpers.memory.model_state_bytes`` and
  ``activation_bytes_model`` with the same arguments on the same
  ``ModelSpec.dense_params()``, so the floats are identical: exact equality.
  Where they legitimately differ, the difference is checked to be that term:
  ZeRO-3's gathered layers (only chapter 19 counts them) and fp32 main
  gradients (a ``Plan`` knob the planner does not offer; 2 more bytes per
  parameter, so chapter 19's gradients are twice the planner's).
* compute and bubble: the same FLOP count (``hardware_flops_per_step``) and
  ``bubble_formula``, written as compute / (1 - f) - compute in one and
  compute f / (1 - f) in the other: equal up to a few roundings.
* TP communication time: four (six with full recompute) ring all-reduces per
  layer per micro-batch on the node's link in both; the planner interpolates
  chapter 07's cost linearly in the bytes, an exact model evaluated with a
  few more roundings.
* PP: both charge 2 v m hops of one activation (1/tp of it, sequence
  parallel); chapter 19 exposes only the fill and drain hops, which is a
  different claim about overlap, so its ``comm_time`` (all hops) is compared.

DP is not compared: the planner models NCCL's hierarchical rings and overlaps
the whole reduce with the last backward; chapter 19 uses a flat ring and hides
reduce-scatter and all-gather separately. Two cost models of one mechanism,
each checked against its own chapter's references.
"""

import sys

import pytest

from helpers.frameworks import Cluster, ModelSpec, Plan, estimate
from helpers.planner import H100_80GB, Layout, evaluate
from helpers.topology import h100_cluster

EPS = 2.0 ** -52
# A handful of float64 roundings (each <= EPS / 2 relative) separate the two
# sides where they do not share an expression; 1e-12 leaves four orders of
# margin and is far below any difference of formula (an all-reduce more, a
# different link, a layer more: percent-level changes).
REL = 1e-12

LLAMA_7B = ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                     ffn=11008, gated_mlp=True)
LLAMA_70B = ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                      ffn=28672, kv_heads=8, gated_mlp=True)
GPT3 = ModelSpec(name="GPT-3 175B", layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
                 tied_embeddings=True)

# (model, layout, global batch, nodes of 8 H100s)
CASES = [
    (LLAMA_7B, Layout(8, 1, 1, zero=1, recompute="selective"), 64, 1),
    (LLAMA_70B, Layout(8, 8, 4, zero=1, recompute="selective", interleave=2), 512, 32),
    (GPT3, Layout(8, 8, 16, zero=1, recompute="full"), 1536, 128),
    (LLAMA_7B, Layout(16, 1, 1, zero=3, recompute="full", micro_batch=2), 64, 2),
    # stages 4 GPUs apart on 8-GPU nodes: the first hop stays in the node, the
    # second crosses it, and the pipeline runs at the slower one
    (LLAMA_7B, Layout(1, 4, 4, recompute="selective"), 64, 2),
]
IDS = ["7B-ZeRO1-8", "70B-TP8-PP4-v2", "GPT3-TP8-PP16", "7B-ZeRO3-16", "7B-TP4-PP4-2nodes"]
MEMORY = {"weights": "weights", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations"}


def _both(model, layout, global_batch, nodes, **choices):
    topo = h100_cluster(nodes)
    cand = evaluate(model, layout, global_batch, H100_80GB, topo, mfu=0.5, memory_fraction=1.0)
    assert cand.feasible, cand.reason
    est = estimate(layout.to_plan(global_batch, **choices), model,
                   Cluster.of(H100_80GB, topo, matmul_efficiency=0.5))
    return cand, est


@pytest.mark.parametrize("model,layout,global_batch,nodes", CASES, ids=IDS)
def test_memory_terms_agree(model, layout, global_batch, nodes):
    cand, est = _both(model, layout, global_batch, nodes)
    mem = {t.name: t.value for t in est.memory}
    for mine, theirs in MEMORY.items():
        assert cand.memory[mine] == mem[theirs], mine      # same call, same floats
    extra = set(mem) - set(MEMORY.values())
    if layout.zero == 3:
        # chapter 15's gathered layers: one layer all-gathered in bf16, plus the prefetched next
        assert extra == {"gathered layers"}
        assert mem["gathered layers"] == 2 * model.layer_params() / layout.tp * 2
        assert est.memory_total - cand.memory_total == pytest.approx(
            mem["gathered layers"], rel=REL)
    else:
        assert not extra


def test_fp32_main_grads_are_the_difference():
    model, layout, gb, nodes = CASES[1]
    cand, est = _both(model, layout, gb, nodes, main_grads_fp32=True)
    mem = {t.name: t.value for t in est.memory}
    # 4 bytes per parameter instead of 2, sharded the same way (ZeRO-1 leaves them whole)
    assert mem["gradients"] == 2 * cand.memory["grads"]
    assert mem["weights"] == cand.memory["weights"]


@pytest.mark.parametrize("model,layout,global_batch,nodes", CASES, ids=IDS)
def test_step_time_terms_agree(model, layout, global_batch, nodes):
    cand, est = _both(model, layout, global_batch, nodes)
    time = {t.name: t.value for t in est.time}
    comm = {t.name: t.value for t in est.comm_time}
    assert cand.time["compute"] == pytest.approx(time["compute"], rel=REL)
    # the bubble is compared to compute: f/(1-f) of it, rounding errors of its size
    assert cand.time["bubble"] == pytest.approx(time["pipeline bubble"],
                                                abs=REL * time["compute"])
    assert cand.time["tp_comm"] == pytest.approx(time["tp (exposed)"], rel=REL)
    assert cand.time["pp_p2p"] == pytest.approx(comm["pp"], rel=REL)
    if layout.tp > 1:
        assert cand.time["tp_comm"] > 0
    if layout.pp > 1:
        assert cand.time["bubble"] > 0 and cand.time["pp_p2p"] > 0


def test_full_recompute_leaves_the_output_layer_alone():
    """Narayanan et al. 2021, eq. 3: with full recompute the layers run 4 passes but
    the output layer 3 (its V/16lh term is 6 B s h V): the extra forward covers the
    layers only, so the factor is below 4/3."""
    cost = sys.modules["helpers.planner.cost"]
    m = GPT3
    full = cost._recompute_factor(m, "full")
    layers = m.forward_flops_per_token() - 2 * m.hidden * m.vocab
    assert full == pytest.approx(1 + layers / (3 * m.forward_flops_per_token()), rel=REL)
    assert full < 4 / 3


def test_layout_round_trip():
    lay = Layout(8, 8, 4, cp=2, zero=1, recompute="selective", micro_batch=2, interleave=2)
    plan = lay.to_plan(256)
    assert isinstance(plan, Plan)
    assert (plan.dp, plan.tp, plan.pp, plan.cp, plan.vpp, plan.zero_stage) == (8, 8, 4, 2, 2, 1)
    assert plan.grad_accum == 16 and plan.global_batch_ == 256 and plan.sequence_parallel
    plan.validate(lay.world, LLAMA_70B)
    assert Layout.from_plan(plan) == lay
    with pytest.raises(ValueError, match="not a multiple of dp x micro-batch"):
        lay.to_plan(100)
