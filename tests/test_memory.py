"""helpers.memory: published cells reproduced, measured saved bytes == hand accounting."""

import pytest
import torch

from helpers.memory import (GB, SavedTensorCounter, activation_bytes_model,
                            activation_bytes_per_layer, count_saved_bytes, explain_saved_bytes,
                            model_state_bytes, training_memory)
from helpers.model import build_model


def test_70b_needs_1120_gb():
    assert model_state_bytes(70e9).total / GB == pytest.approx(1120)


@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, gb):
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12 (rounded to 0.1 GB)
    got = model_state_bytes(7.5e9, dp=64, zero_stage=stage).total / GB
    assert round(got, 1) == gb


@pytest.mark.parametrize("stage", [True, False, 1.0, "1", 4, -1])
def test_zero_stage_must_be_an_int_stage(stage):
    # True == 1 in Python: without the check, zero_stage=True silently meant stage 1
    with pytest.raises(ValueError, match="zero_stage must be the int 0, 1, 2 or 3"):
        model_state_bytes(7.5e9, dp=64, zero_stage=stage)


def test_korthikanti_table_2_forms():
    s, b, h, a, t = 2048, 1, 12288, 96, 8        # GPT-3 175B shapes (Korthikanti Table 3)
    sbh = s * b * h
    f = lambda **kw: activation_bytes_per_layer(s, b, h, a, **kw)  # noqa: E731
    assert f() == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert f(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert f(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert f(tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert f(recompute="full") == pytest.approx(2 * sbh)
    assert f(tp=t, recompute="full") == pytest.approx(2 * sbh)   # Table 2: input kept whole
    assert f(tp=1) == f()                                  # t = 1 reduces to no parallelism


def test_full_recompute_with_sequence_parallel_keeps_the_sharded_input():
    # Deliberate deviation from Korthikanti Table 2 (2sbh): with sequence parallelism the
    # layer input is already split along s, so keeping it costs 2sbh/t and no all-gather.
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    full_sp = activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True,
                                         recompute="full")
    assert full_sp == pytest.approx(2 * s * b * h / t)
    assert full_sp == activation_bytes_per_layer(s // t, b, h, a, recompute="full")  # s/t rows
    whole = activation_bytes_model(s, b, h, a, 96, tp=t, pp=8, sequence_parallel=True,
                                   recompute="full")
    assert whole == pytest.approx(96 * 2 * s * b * h / t + s * b * h * 8 / t)


def test_whole_model_first_stage():
    s, b, h, a, L, v = 2048, 1, 12288, 96, 96, 51200
    per = activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True)
    # 1F1B: first stage holds L/p layers x p micro-batches = L layers' worth
    got = activation_bytes_model(s, b, h, a, L, tp=8, pp=8, sequence_parallel=True)
    assert got == pytest.approx(per * L + s * b * h * 8 / 8)
    inter = activation_bytes_model(s, b, h, a, L, tp=8, pp=8, sequence_parallel=True,
                                   interleave=3)
    assert inter == pytest.approx(per * L * (1 + 7 / 24) + s * b * h)
    nopp = activation_bytes_model(s, b, h, a, L, vocab=v)
    per1 = activation_bytes_per_layer(s, b, h, a)
    assert nopp == pytest.approx(per1 * L + s * b * h + 4 * s * b * h * (1 + v / h))


def test_output_layer_terms_sec_4_3():
    s, b, h, a, L, v, t = 2048, 1, 12288, 96, 96, 51200, 8
    sbh = s * b * h

    def extra(sp):      # what activation_bytes_model adds beyond the layers
        layers = activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=sp) * L
        return activation_bytes_model(s, b, h, a, L, tp=t, sequence_parallel=sp,
                                      vocab=v) - layers
    # with sequence parallelism: the paper's sbhp/t + 4sbh/t (1 + v/h), p = 1
    assert extra(True) == pytest.approx(sbh / t + 4 * sbh / t * (1 + v / h))
    # without it, the embedding mask and the final LN / projection inputs are whole on
    # every rank; only the vocabulary-parallel fp32 logits (4sbv) are split over t
    assert extra(False) == pytest.approx(sbh + 4 * sbh + 4 * s * b * v / t)
    # a pipeline's first stage holds no output layer
    assert activation_bytes_model(s, b, h, a, L, tp=t, pp=2, vocab=v) == \
        activation_bytes_model(s, b, h, a, L, tp=t, pp=2)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(heads=24, tp=5), "24 heads do not divide over tensor-parallel size 5"),
    (dict(seq=-1), "seq must be a positive int"),
    (dict(recompute="some"), "unknown recompute mode"),
    (dict(hidden=100, heads=8), "not divisible by heads"),
    (dict(seq=10, tp=4, heads=8, sequence_parallel=True), "not divisible by tensor-parallel"),
])
def test_clear_errors(kwargs, msg):
    args = dict(seq=16, batch=2, hidden=96, heads=8) | kwargs
    with pytest.raises(ValueError, match=msg):
        activation_bytes_per_layer(args.pop("seq"), args.pop("batch"), args.pop("hidden"),
                                   args.pop("heads"), **args)


def test_training_memory_parts_add_up():
    parts = training_memory(70e9, seq=4096, micro_batch=1, hidden=8192, heads=64, layers=80,
                            vocab=32000, dp=8, zero_stage=3, tp=8, pp=1)
    assert parts["weights"] + parts["grads"] + parts["optimizer"] == \
        pytest.approx(model_state_bytes(70e9 / 8, dp=8, zero_stage=3).total)
    assert parts["total"] == pytest.approx(sum(parts[k] for k in
                                               ("weights", "grads", "optimizer", "activations")))
    with pytest.raises(ValueError, match="80 layers do not split over 3"):
        training_memory(70e9, seq=4096, micro_batch=1, hidden=8192, heads=64, layers=80, pp=3)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_measured_equals_explained_exactly(dropout, dtype):
    model = build_model("toy", dropout=dropout).to(dtype).train()
    b, s = 2, 8
    idx, tgt = torch.randint(0, 64, (b, s)), torch.randint(0, 64, (b, s))
    with SavedTensorCounter(model) as counter:
        model(idx, tgt)
    explained = explain_saved_bytes(model.config, b, s, dtype)
    per_module: dict[str, int] = {}
    for term in explained:
        per_module[term.module] = per_module.get(term.module, 0) + term.nbytes
    assert counter.by_module() == per_module          # module by module, to the byte
    assert counter.total_bytes == sum(t.nbytes for t in explained)


def test_per_layer_matches_paper_plus_named_extras():
    # bf16, dropout on, CPU: paper's 34sbh + 5as^2b, plus CPU's 2-byte masks
    # (2 sbh + a s^2 b extra), LayerNorm stats (2 LN x 2 x sb x 2 bytes) and the s x s mask.
    model = build_model("toy", dropout=0.1)
    cfg, b, s = model.config, 2, 8
    h, a = cfg.n_embd, cfg.n_head
    layer = sum(t.nbytes for t in explain_saved_bytes(cfg, b, s) if t.module.startswith("blocks.0"))
    paper = activation_bytes_per_layer(s, b, h, a)
    assert layer == paper + 2 * s * b * h + a * s * s * b + 2 * 2 * s * b * 2 + s * s


def test_counter_dedups_views_and_skips_parameters():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with SavedTensorCounter(lin) as c:
        y = lin(x)
        z = y[:, :2] * y[:, 2:]            # two views of y's storage, both saved
    assert c.total_bytes == x.nbytes + y.nbytes
    assert any(r.is_param for r in c.records)
    assert count_saved_bytes(lin, x).total_bytes == x.nbytes
    z.sum().backward()


def test_peak_drops_as_backward_frees():
    model = build_model("toy")
    idx = torch.randint(0, 64, (2, 8))
    with SavedTensorCounter(model) as c:
        _, loss = model(idx, idx)
        assert c.live_bytes == c.peak_bytes
        loss.backward()
    assert c.live_bytes == 0


def test_sdpa_not_explained():
    with pytest.raises(ValueError, match="attention='manual'"):
        explain_saved_bytes(build_model("toy", attention="sdpa").config, 2, 8)


def test_widget_and_plot_build():
    import matplotlib
    matplotlib.use("Agg")
    from helpers.memory import memory_widget, plot_memory_bars
    box = memory_widget("7B (Llama 2)")
    controls = box.children[0].children
    assert len(controls) == 11
    controls[5].value = 8                      # TP 8 over 32 heads: fine
    ax = plot_memory_bars({"a": training_memory(7e9, seq=1024, micro_batch=1, hidden=4096,
                                                heads=32, layers=32)})
    assert len(ax.patches) == 4                # one stacked bar, four parts
    # the planner's ZeRO-3 term is stacked too: each bar's top is the budget's total
    budgets = {"a": {"weights": 1e9, "grads": 1e9, "optimizer": 6e9, "gathered": 2e9,
                     "activations": 3e9},
               "b": {"weights": 2e9, "grads": 2e9, "optimizer": 6e9, "gathered": 0.0,
                     "activations": 4e9}}
    ax = plot_memory_bars(budgets, gpu_gb=72, gpu_label="usable")
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert [tops[i] for i in (0, 1)] == pytest.approx([13.0, 14.0], rel=1e-12)
    assert any(t.get_text() == " 72 GB usable" for t in ax.texts)
    with pytest.raises(ValueError, match="gathered layers"):
        plot_memory_bars({"a": {"weights": 1e9, "gathered layers": 1e9}})


@pytest.mark.gpu
def test_cuda_saved_bytes_match_cuda_accounting():
    # CUDA keeps 1-byte bool dropout masks and fp32 LayerNorm statistics
    model = build_model("toy", dropout=0.1, device="cuda").to(torch.bfloat16).train()
    idx = torch.randint(0, 64, (2, 8), device="cuda")
    tgt = torch.randint(0, 64, (2, 8), device="cuda")
    with SavedTensorCounter(model) as counter:
        model(idx, tgt)
    explained = explain_saved_bytes(model.config, 2, 8, torch.bfloat16, device_type="cuda")
    assert counter.total_bytes == sum(t.nbytes for t in explained)


def test_memory_over_step_peak_is_not_the_sum():
    from helpers.memory import memory_over_step
    budget = {"weights": 2.0, "grads": 3.0, "optimizer": 12.0, "activations": 40.0}
    points = memory_over_step(budget, layers=4)
    totals = [sum(v.values()) for _, v in points]
    # the parts never all live at once: peak = weights + optimizer + max(acts, grads)
    assert max(totals) == 2 + 12 + 40 < 2 + 3 + 12 + 40
    assert [name for name, _ in points][:2] == ["start", "forward 1"]
    assert points[0][1]["grads"] == 0 and points[-1][1] == points[0][1]
    assert points[4][1]["activations"] == 40 and points[8][1]["grads"] == 3  # ends of fwd, bwd
    assert points[9][0] == "optimizer step" and totals[9] == 2 + 3 + 12
    # gradients larger than the activations: the peak moves to the end of backward
    big_g = dict(budget, grads=50.0)
    assert max(sum(v.values()) for _, v in memory_over_step(big_g, 4)) == 2 + 12 + 50
    with pytest.raises(ValueError, match="layers"):
        memory_over_step(budget, 0)


def test_memory_over_step_with_a_gradient_buffer_peaks_at_the_sum():
    # DDP's buckets / Megatron's contiguous buffer: gradients live through the forward,
    # so nothing is freed between steps and the peak is the sum of the parts
    from helpers.memory import memory_over_step
    budget = {"weights": 2.0, "grads": 3.0, "optimizer": 12.0, "activations": 40.0}
    points = memory_over_step(budget, layers=4, grad_buffer=True)
    assert all(v["grads"] == 3.0 for _, v in points)
    assert max(sum(v.values()) for _, v in points) == 2 + 3 + 12 + 40


def test_ddps_default_copies_hold_the_gradients_twice():
    # gradient_as_bucket_view=False (DDP's default): the buckets live all run and the .grad
    # tensors from backward to zero_grad, so at the end of backward the gradients are held
    # twice, and the peak exceeds the sum of the four parts when they outweigh activations
    from helpers.memory import memory_over_step
    budget = {"weights": 2.0, "grads": 30.0, "optimizer": 12.0, "activations": 10.0}
    points = memory_over_step(budget, layers=4, grad_buffer="copy")
    assert all(v["buckets"] == 30.0 for _, v in points)
    assert points[0][1]["grads"] == 0 and points[-1][1] == points[0][1]
    peak = max(sum(v.values()) for _, v in points)
    assert peak == 2 + 12 + 30 + max(10, 30) > 2 + 30 + 12 + 10
    # with the activations larger, the peak is the sum: buckets + everything at forward's end
    big_a = dict(budget, activations=50.0)
    assert max(sum(v.values()) for _, v in memory_over_step(big_a, 4, grad_buffer="copy")) \
        == 2 + 30 + 12 + 50
    # True and False keep their meaning: views into a kept buffer, and nothing kept
    assert memory_over_step(budget, 4, grad_buffer=True) == memory_over_step(budget, 4,
                                                                             grad_buffer="view")
    assert memory_over_step(budget, 4) == memory_over_step(budget, 4, grad_buffer="none")
    with pytest.raises(ValueError, match="grad_buffer must be one of"):
        memory_over_step(budget, 4, grad_buffer="bucket")


def test_the_gpu_views_say_none_without_cuda():
    from helpers.memory import cuda_memory_views
    if not torch.cuda.is_available():
        assert cuda_memory_views(lambda: None) is None


def test_bf16_with_fp32_gradients_is_megatrons_18_bytes():
    # Megatron-LM docs/source/api-guide/dist_optimizer.md: "float16 param, fp32 grads"
    # 18 B/param, 6 + 12/d with the distributed optimizer (ZeRO-1)
    from helpers.memory import BYTES_PER_PARAM_BY_PRECISION, OPTIMIZER_STATE
    w, g, master = BYTES_PER_PARAM_BY_PRECISION["bf16, fp32 grads"]
    k = master + OPTIMIZER_STATE["adam"]
    assert model_state_bytes(1, param_bytes=w, grad_bytes=g, optimizer_bytes=k).total == 18
    assert model_state_bytes(1, dp=8, zero_stage=1, param_bytes=w, grad_bytes=g,
                             optimizer_bytes=k).total == pytest.approx(6 + 12 / 8)
    w, g, master = BYTES_PER_PARAM_BY_PRECISION["bf16 mixed"]  # ZeRO's accounting
    assert w + g + master + OPTIMIZER_STATE["adam"] == 16
