"""helpers.frameworks: plans validated by rule, readers on real-style configs, estimates that
reproduce the figures earlier chapters check, and the frameworks' own calculators."""

import os

import pytest

from helpers.frameworks import (KNOBS, CHAPTERS, Cluster, ModelSpec, Plan, estimate,
                                from_deepspeed, from_megatron, from_torchtitan, knob_table)
from helpers.frameworks import crosscheck
from helpers.frameworks.estimate import (bytes_per_param, hardware_flops_per_step,
                                         narayanan_flops, narayanan_params,
                                         narayanan_training_days)
from helpers.frameworks.examples import EXAMPLES, MODELS, load
from helpers.memory import GB, activation_bytes_model, model_state_bytes

GPT3 = MODELS["GPT-3 175B"]
ROOT = os.path.dirname(os.path.dirname(__file__))


# -- Plan.validate: each rule named ------------------------------------------------

@pytest.mark.parametrize("plan, world, model, rule", [
    (Plan(dp=4, tp=2), 16, None, "degrees must multiply to the world size"),
    (Plan(dp=4, micro_batch=2, grad_accum=3, global_batch=20), 4, None,
     "global batch = micro-batch x accumulation x dp"),
    (Plan(dp=2, tp=1, pp=4), 8, ModelSpec(layers=30, hidden=64, heads=4, vocab=8, seq=16),
     "30 layers do not split over pp 4"),
    (Plan(dp=1, tp=2, pp=2, vpp=2, grad_accum=4), 4,
     ModelSpec(layers=10, hidden=64, heads=4, vocab=8, seq=16), "10 layers do not split"),
    (Plan(dp=1, tp=5), 5, ModelSpec(layers=2, hidden=240, heads=24, vocab=8, seq=16),
     "24 heads do not divide over tensor-parallel size 5"),
    (Plan(dp=4, ep=3), 4, None, "ep=3 does not divide"),
    (Plan(dp=4, ep=4), 4, ModelSpec(layers=2, hidden=64, heads=4, vocab=8, seq=16, experts=6),
     "6 experts do not divide over expert-parallel size 4"),
    (Plan(dp=1, cp=4), 4, ModelSpec(layers=2, hidden=64, heads=4, vocab=8, seq=20),
     "2 x cp = 8 chunks"),
    (Plan(precision="fp16"), 1, None, "fp16 needs loss scaling"),
    (Plan(dp=2, offload="optimizer"), 2, None, "needs ZeRO stage >= 1"),
    (Plan(dp=2, sequence_parallel=True), 2, None, "needs tp > 1"),
    (Plan(dp=4, dp_shard=3, zero_stage=3), 4, None, "dp_shard=3 does not divide dp=4"),
])
def test_validate_names_the_rule(plan, world, model, rule):
    with pytest.raises(ValueError, match=rule):
        plan.validate(world, model)


def test_valid_plan_passes_and_reports_its_batch():
    plan = Plan(dp=8, tp=8, pp=16, vpp=2, micro_batch=1, grad_accum=192, global_batch=1536,
                zero_stage=1, sequence_parallel=True).validate(1024, GPT3)
    assert plan.sequences_per_step == 1536 and plan.world_size == 1024 and plan.shard_ranks == 8


# -- readers -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_read_and_estimate(name):
    plan, model, cluster = load(name)
    est = estimate(plan, model, cluster)
    assert est.fits, est.table()
    assert plan.unmapped, "every example has hyperparameters that must be listed, not dropped"
    assert all(len(u) == 3 and u[2] for u in plan.unmapped)   # (knob, value, why)


def test_megatron_reader_maps_each_parallel_knob():
    plan, *_ = load("megatron-gpt3-175b")
    assert (plan.dp, plan.tp, plan.pp, plan.vpp) == (8, 8, 16, 2)   # 96 / (16 x 3) = 2 chunks
    assert plan.zero_stage == 1 and plan.sequence_parallel and plan.recompute == "selective"
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == (1, 192, 1536)
    assert plan.precision == "fp16" and plan.loss_scaling == "dynamic"
    assert plan.overlap_grad_reduce and plan.overlap_param_gather
    assert {u[0] for u in plan.unmapped} >= {"--lr", "--clip-grad", "--initial-loss-scale"}


def test_deepspeed_reader_infers_the_missing_batch_term_as_deepspeed_does():
    plan = from_deepspeed({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, 8)
    assert (plan.dp, plan.micro_batch, plan.grad_accum) == (8, 2, 4) and plan.zero_stage == 2


def test_torchtitan_reader():
    plan, *_ = load("torchtitan-llama3-8b")
    assert (plan.dp, plan.tp, plan.zero_stage, plan.micro_batch, plan.grad_accum) == \
        (32, 2, 3, 2, 8)
    assert plan.sequence_parallel and plan.params_fp32 and plan.recompute == "selective"
    hsdp = from_torchtitan("[parallelism]\ndata_parallel_replicate_degree = 2\n"
                           "data_parallel_shard_degree = 4\n", 8)
    assert (hsdp.dp, hsdp.dp_shard, hsdp.shard_ranks) == (8, 4, 4)


@pytest.mark.parametrize("call, rule", [
    (lambda: from_deepspeed({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2}, 8),
     "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp"),
    (lambda: from_deepspeed({"train_batch_size": "auto"}, 8), "'auto' is filled in"),
    (lambda: from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 2}}, 8, pp=2),
     "pipeline engine takes ZeRO stage 0 or 1 only"),
    (lambda: from_deepspeed({"train_batch_size": 8, "bf16": {"enabled": True},
                             "fp16": {"enabled": True}}, 8), "exclude each other"),
    (lambda: from_megatron("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 3",
                           64), "does not divide 64 GPUs"),
    (lambda: from_megatron("--micro-batch-size 2 --global-batch-size 10", 4),
     "not a multiple of micro-batch 2 x dp 4"),
    (lambda: from_megatron("--tensor-model-parallel-size 5 --num-layers 4 --hidden-size 240 "
                           "--num-attention-heads 24 --seq-length 64", 5),
     "24 heads do not divide over tensor-parallel size 5"),
    (lambda: from_megatron("--fp8-format hybrid", 1), "inside a --bf16"),
    (lambda: from_torchtitan("[parallelism]\ntensor_parallel_degree = 3\n", 8),
     "does not divide 8 GPUs"),
    (lambda: from_torchtitan("[training]\nlocal_batch_size = 3\nglobal_batch_size = 16\n", 4),
     "not a multiple of 3 x 4"),
])
def test_reader_errors_name_the_rule(call, rule):
    with pytest.raises(ValueError, match=rule.replace("(", r"\(").replace("+", r"\+")):
        call()


def test_every_knob_points_at_a_chapter_that_exists():
    rows = knob_table()
    assert len(rows) == len(KNOBS) and {fw for fw, *_ in rows} == {"megatron", "deepspeed",
                                                                   "torchtitan"}
    for _, _, _, notebook in rows:
        assert os.path.exists(os.path.join(ROOT, "course", notebook + ".ipynb")), notebook
    fields = set(Plan.__dataclass_fields__)
    assert {field for field, _ in KNOBS.values()} <= fields
    assert set(CHAPTERS) >= {ch for _, ch in KNOBS.values()}


def test_megatron_script_text_with_comments_and_line_continuations():
    plan = from_megatron("# a comment\n--tensor-model-parallel-size 2 \\\n  --bf16\n", 4)
    assert (plan.tp, plan.dp, plan.precision, plan.main_grads_fp32) == (2, 2, "bf16", True)


# -- estimates reproduce what earlier chapters check -------------------------------------

@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_estimate_model_states_reproduce_zero_figure_1(stage, gb):
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12, rounded to 0.1 GB
    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=1024, n_params=7.5e9)
    est = estimate(Plan(dp=64, zero_stage=stage), model, Cluster.a100(8))
    states = sum(t.value for t in est.memory[:3])
    assert states == model_state_bytes(7.5e9, dp=64, zero_stage=stage).total  # same arithmetic
    assert round(states / GB, 1) == gb


def test_estimate_activations_are_chapter_06s_korthikanti_formula():
    plan, model, cluster = load("megatron-gpt3-175b")
    act = {t.name: t.value for t in estimate(plan, model, cluster).memory}["activations"]
    # identical call, identical arithmetic: exact equality
    assert act == activation_bytes_model(2048, 1, 12288, 96, 96, tp=8, pp=16,
                                         sequence_parallel=True, recompute="selective",
                                         vocab=51200, interleave=2)
    # Korthikanti et al. 2022, Table 2 (TP + SP + selective): 34 sbh / t per layer, times
    # L layers x (1 + (p-1)/(p v)) on the first interleaved stage, + the embedding mask
    sbh = 2048 * 12288
    want = 34 * sbh / 8 * 96 * (1 + 15 / 32) + sbh * 16 / 8
    assert act == pytest.approx(want, rel=1e-12)   # float summation order only


def test_narayanan_equation_2_parameter_count():
    # Table 1's largest row: 128 layers, width 25600 -> "1008.0B"; our ModelSpec leaves out
    # biases and positions (eq. 2's 13/12h and s/12lh terms), at most that fraction smaller
    # the paper prints one decimal: half a unit of it
    assert narayanan_params(128, 25600, 51200, 2048) / 1e9 == pytest.approx(1008.0, abs=0.05)
    ours = ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
                     tied_embeddings=True).total_params()
    eq2 = narayanan_params(96, 12288, 51200, 2048)
    assert 0 < (eq2 - ours) / eq2 < 13 / (12 * 12288) + 2048 / (12 * 96 * 12288)


def test_narayanan_equation_3_is_our_hardware_flops_with_full_recompute():
    # eq. 3 counts 4 passes over the layers (full recompute) and 3 over the output layer,
    # attention over the whole s x s square (Megatron's unfused kernel in 2021)
    model = ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)
    ours = hardware_flops_per_step(model, 1536, "full", "unfused")
    # same terms, grouped differently: float64 rounding (~1e-16 per operation) only
    assert ours == pytest.approx(narayanan_flops(1536, 2048, 96, 12288, 51200), rel=1e-12)
    assert hardware_flops_per_step(model, 1536, "none") < ours     # no forward re-run


def test_narayanan_equation_4_training_days():
    # sec. 5.1: GPT-3 (175B, 300B tokens) on 1024 A100s at 140 TFLOP/s: ~34 days;
    # the 1T model (eq. 2: 1008B parameters, 450B tokens) on 3072 GPUs at 163 TFLOP/s: ~84 days
    assert round(narayanan_training_days(300e9, 175e9, 1024, 140e12)) == 34
    p_1t = narayanan_params(128, 25600, 51200, 2048)
    assert round(narayanan_training_days(450e9, p_1t, 3072, 163e12)) == 84


def test_step_time_terms_and_bubble():
    plan, model, cluster = load("megatron-gpt3-175b")
    est = estimate(plan, model, cluster)
    t = {x.name: x.value for x in est.time}
    # chapter 12: bubble = compute x (p-1)/(v m) with p=16, v=2, m=192
    # f / (1 - f) with f = (p-1)/(vm + p-1) is (p-1)/(vm): equal up to float64 rounding
    assert t["pipeline bubble"] == pytest.approx(t["compute"] * 15 / (2 * 192), rel=1e-12)
    assert est.step_time == sum(t.values())         # the same sum, in the same order
    # TP crosses nodes when t > 8: its time jumps (chapter 09)
    inside = estimate(plan.replace(tp=8, pp=16), model, cluster)
    assert {c.name: c.value for c in inside.comm_time}["tp"] > 0
    comm = {c.name: c.value for c in est.comm}
    assert comm["cp"] == comm["ep"] == 0 and comm["tp"] > comm["dp"] > 0


def test_zero3_gathers_every_micro_batch():
    model = MODELS["Llama 2 70B"]
    cluster = Cluster.a100(8)
    base = Plan(dp=64, zero_stage=3, micro_batch=1, grad_accum=1, recompute="full")
    one = {c.name: c.value for c in estimate(base, model, cluster).comm}["dp"]
    four = {c.name: c.value for c in estimate(base.replace(grad_accum=4), model,
                                              cluster).comm}["dp"]
    assert four == pytest.approx(4 * one, rel=1e-12)   # 4x as many identical terms summed
    z1 = {c.name: c.value for c in estimate(base.replace(zero_stage=1, grad_accum=4), model,
                                            cluster).comm}["dp"]
    assert z1 == pytest.approx(one * 2 / 3, rel=1e-12)   # RS + AG once vs 2 AG + RS per micro


def test_offload_moves_the_optimizer_to_cpu():
    model = MODELS["Llama 2 70B"]
    plan = Plan(dp=64, zero_stage=3, recompute="full")
    on = estimate(plan, model, Cluster.a100(8))
    off = estimate(plan.replace(offload="optimizer"), model, Cluster.a100(8))
    opt = {t.name: t.value for t in on.memory}["optimizer state"]
    # one term moved out of the sum: float64 rounding of a ~1e10 total only
    assert off.cpu_bytes == opt and off.memory_total == pytest.approx(on.memory_total - opt,
                                                                      rel=1e-12)


# -- the frameworks' own figures ----------------------------------------------------------

@pytest.mark.parametrize("key", sorted(crosscheck.MEGATRON_DOCS_BYTES_PER_PARAM))
@pytest.mark.parametrize("d", [1, 8, 64])
def test_megatron_distributed_optimizer_bytes_match_its_docs(key, d):
    whole, (fixed, per_d) = crosscheck.MEGATRON_DOCS_BYTES_PER_PARAM[key]
    assert crosscheck.megatron_bytes_per_param(*key, d, distributed=False) == whole
    assert crosscheck.megatron_bytes_per_param(*key, d, distributed=True) == \
        pytest.approx(fixed + per_d / d, rel=1e-15)   # a few float64 operations


@pytest.mark.parametrize("flags, row", [("--bf16", ("bf16", "fp32")),
                                        ("--fp16", ("fp16", "fp16"))])
def test_megatron_plans_get_the_docs_bytes_per_param(flags, row):
    plan = from_megatron(f"{flags} --use-distributed-optimizer", 8)
    w, g, o = bytes_per_param(plan)
    got = model_state_bytes(1, dp=8, zero_stage=plan.zero_stage, param_bytes=w, grad_bytes=g,
                            optimizer_bytes=o).total
    fixed, per_d = crosscheck.MEGATRON_DOCS_BYTES_PER_PARAM[row][1]
    assert got == pytest.approx(fixed + per_d / 8, rel=1e-15)


def test_deepspeed_plans_count_the_fp32_gradient_as_deepspeed_does():
    n, gpus = 7.5e9, 64
    plan = from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, gpus)
    w, g, o = bytes_per_param(plan)
    ours = model_state_bytes(n, dp=gpus, zero_stage=2, param_bytes=w, grad_bytes=g,
                             optimizer_bytes=o).total
    assert ours == crosscheck.deepspeed_gpu_bytes(n, gpus, 2)
    # a difference of two ~1e11 sums: float64 rounding, ~1e-5 bytes, far below rel 1e-9
    assert ours - crosscheck.paper_gpu_bytes(n, gpus, 2) == pytest.approx(4 * n / gpus, rel=1e-9)


@pytest.mark.parametrize("n, gpn, nodes", [(7_500_000_000, 8, 8), (70_000_000_000, 8, 1),
                                           (1_000_000, 1, 1)])
def test_deepspeed_own_estimators(n, gpn, nodes):
    pytest.importorskip("deepspeed", reason="DeepSpeed is the optional 'frameworks' extra "
                                            "(pip install -e '.[frameworks]'); CI skips this")
    largest = n // 40
    got = crosscheck.run_deepspeed_estimators(n, gpn, nodes, largest)
    gpus = gpn * nodes
    # DeepSpeed truncates its sharded term to an int: at most one byte below ours
    assert 0 <= crosscheck.deepspeed_gpu_bytes(n, gpus, 2) - got[2] < 1
    assert 0 <= crosscheck.deepspeed_gpu_bytes(n, gpus, 3, largest) - got[3] < 1


def test_torchtitan_interleaved_schedule_gets_two_stages_per_rank():
    plan = from_torchtitan("[parallelism]\npipeline_parallel_degree = 4\n"
                           "pipeline_parallel_schedule = 'Interleaved1F1B'\n"
                           "[training]\nlocal_batch_size = 8\n", 8)
    assert (plan.pp, plan.vpp, plan.dp, plan.micro_batch, plan.grad_accum) == (4, 2, 2, 1, 8)
    assert plan.zero_stage == 2        # "default" keeps weights gathered under a pipeline
    # and torch's pipelining syncs an FSDP stage's gradients on the last micro-batch only
    assert plan.whole_grads
    flat = from_torchtitan("[parallelism]\nfsdp_reshard_after_forward = 'never'\n"
                           "[training]\nlocal_batch_size = 8\n", 8)
    assert flat.zero_stage == 2 and not flat.whole_grads      # no pipeline: FSDP2 syncs each
    with pytest.raises(ValueError, match="whole_grads is a ZeRO-2 choice"):
        Plan(zero_stage=1, whole_grads=True).validate(1)


def test_experts_split_over_ep_and_pay_all_to_alls():
    moe = ModelSpec(layers=8, hidden=1024, heads=16, vocab=32000, seq=2048, experts=8, top_k=2)
    cluster = Cluster.h100(2)
    one = estimate(Plan(dp=16, micro_batch=1, grad_accum=1), moe, cluster)
    eight = estimate(Plan(dp=16, ep=8, micro_batch=1, grad_accum=1), moe, cluster)
    w1 = {t.name: t.value for t in one.memory}["weights"]
    w8 = {t.name: t.value for t in eight.memory}["weights"]
    dense = moe.total_params() - moe.expert_params()
    # 16-bit weights: dense ones whole, experts 1/8 each (exact: same products and sums)
    assert w1 == 2 * moe.total_params()
    assert w8 == pytest.approx(2 * (dense + moe.expert_params() / 8), rel=1e-12)
    comm = {t.name: t.value for t in eight.comm}
    # 4 all-to-alls per layer of s b k h 16-bit values, 7/8 of each leaves the GPU (chapter 21)
    assert comm["ep"] == pytest.approx(4 * 8 * 7 / 8 * 2048 * 2 * 1024 * 2, rel=1e-12)
    assert {t.name: t.value for t in one.comm}["ep"] == 0


def test_megatron_ignores_sequence_parallel_without_tp_and_says_so():
    plan = from_megatron("--sequence-parallel --bf16", 4)
    assert not plan.sequence_parallel
    assert ("--sequence-parallel", True, "ignored with tp = 1, as Megatron does") in plan.unmapped


def test_deepspeed_accepts_both_bf16_spellings():
    for key in ("bf16", "bfloat16"):
        plan = from_deepspeed({"train_micro_batch_size_per_gpu": 1, key: {"enabled": True}}, 2)
        assert plan.precision == "bf16" and not plan.unmapped


@pytest.mark.parametrize("size", ["toy", "tiny", "small"])
def test_modelspec_from_gpt_config_counts_the_course_gpt(size):
    """The one conversion: the course's GPT (no biases) has ModelSpec's weights
    plus its learned position embedding, which the paper formulas leave out."""
    from helpers.frameworks import ModelSpec
    from helpers.model import GPTConfig, build_model, count_parameters

    cfg = GPTConfig.from_name(size, bias=False)
    spec = ModelSpec.from_gpt_config(cfg)
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq) == (
        cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size)
    assert spec.total_params() == cfg.n_params() - cfg.block_size * cfg.n_embd
    if size == "toy":
        assert count_parameters(build_model(cfg)) == cfg.n_params()
