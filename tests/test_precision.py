"""helpers.precision: loss scaler == GradScaler; FP8 formats, delayed scaling, FP8Linear."""

import pytest
import torch

from helpers.data import make_dataset
from helpers.model import build_model
from helpers.precision import (E4M3, E5M2, FP8_MAX, DelayedScaling, DynamicLossScaler,
                               FP8Linear, FP8SavedTensors, dequantize, fp8_scale,
                               quantize, swap_to_fp8, train_fp16, update_delayed_scale)
from helpers.recompute import apply_recompute

# finite (F) / non-finite (N) gradient per step; includes runs long enough to grow
SEQUENCE = "FFFNFFFFFFNNFFFFFFFNF"


@pytest.mark.parametrize("growth_interval, growth, backoff", [(3, 2.0, 0.5), (2, 3.0, 0.25)])
def test_loss_scaler_equals_grad_scaler(growth_interval, growth, backoff):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=growth,
                                  backoff_factor=backoff, growth_interval=growth_interval)
    ours = DynamicLossScaler(2.0 ** 10, growth, backoff, growth_interval)
    q = torch.nn.Parameter(torch.zeros(4))
    opt2 = torch.optim.SGD([q], lr=0.1)
    for step, kind in enumerate(SEQUENCE):
        g = torch.full((4,), float(step + 1)) if kind == "F" \
            else torch.tensor([1.0, float("inf"), 0.0, 0.0])
        theirs.scale(torch.ones(()))     # GradScaler insists on a scale() call per step
        p.grad, q.grad = g * theirs.get_scale(), g * ours.scale_value
        before = p.detach().clone()
        theirs.step(opt)
        theirs.update()
        stepped = ours.step(opt2, [q])
        ours.update()
        assert stepped == (kind == "F") and torch.equal(p, q), step
        assert (not torch.equal(p, before)) == stepped
        assert ours.scale_value == theirs.get_scale(), step


def test_loss_scaler_errors():
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        DynamicLossScaler(backoff_factor=2.0)
    with pytest.raises(ValueError, match="needs found_inf"):
        DynamicLossScaler().update()


def test_fp16_underflows_without_scaling_and_trains_with_it():
    ds = make_dataset(num_sequences=64, seq_len=32)
    batches = [ds.batch(range(8))] * 4         # one batch again and again: loss must fall
    tiny = 2.0 ** -20    # gradients 2^20 x smaller than the toy's: below fp16's 2^-24
    plain, _, _ = train_fp16(build_model("toy"), batches, lr=0.3)
    lost, zeros, _ = train_fp16(build_model("toy"), batches, lr=0.3, loss_multiplier=tiny)
    scaled, zeros_s, _ = train_fp16(build_model("toy"), batches, lr=0.3, loss_multiplier=tiny,
                                    scaler=DynamicLossScaler())
    assert min(zeros) == 1.0                       # every gradient entry flushed to zero
    assert max(zeros_s) < 0.1
    assert lost[-1] == lost[0]                               # nothing learned
    assert scaled[-1] < lost[-1] - 0.05
    assert scaled == pytest.approx(plain, abs=0.02)           # fp16 rounding differs slightly


@pytest.mark.parametrize("dtype, mant, min_sub", [(E4M3, 3, 2.0 ** -9), (E5M2, 2, 2.0 ** -16)])
def test_fp8_round_trip_within_format_bound(dtype, mant, min_sub):
    assert torch.finfo(dtype).max == FP8_MAX[dtype]           # 448 and 57344 (Micikevicius 2022)
    x = torch.randn(4096) * torch.logspace(-3, 3, 4096)
    scale = fp8_scale(x.abs().max(), dtype)
    back = dequantize(quantize(x, dtype, scale), scale)
    # round to nearest: half an ulp, 2^-(mant+1) relative for normals, half the
    # smallest subnormal absolute below the normal range (all in scaled units)
    bound = torch.maximum(x.abs() * 2.0 ** -(mant + 1), (min_sub / 2) / scale)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert quantize(torch.tensor([1e9]), dtype, 1.0).float().item() == FP8_MAX[dtype]  # saturate


def test_delayed_scaling_update_definition():
    h = torch.tensor([3.0, 8.0, 1.0, 0.0])
    hist, scale = update_delayed_scale(h, 2.0, torch.tensor(1.0), fp8_max=448.0, margin=1)
    assert torch.equal(hist, torch.tensor([2.0, 3.0, 8.0, 1.0]))
    assert scale.item() == pytest.approx(448.0 / 8.0 / 2)
    _, recent = update_delayed_scale(h, 2.0, 1.0, fp8_max=448.0, algo="most_recent")
    assert recent.item() == pytest.approx(448.0 / 2.0)
    _, kept = update_delayed_scale(torch.zeros(3), 0.0, torch.tensor(5.0), fp8_max=448.0)
    assert kept.item() == 5.0
    # the spike leaves the max only after history_len steps
    ds = DelayedScaling(E4M3, history_len=3)
    scales = [ds.quantize(torch.tensor([a]))[1].item() for a in (1.0, 4.0, 1.0, 1.0, 1.0, 1.0)]
    assert scales == pytest.approx([448, 448, 112, 112, 112, 448])


def test_fp8_linear_close_to_fp32_and_uses_fp8_gemm():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    f8 = FP8Linear.from_linear(lin)
    x = torch.randn(4, 16, 64, requires_grad=True)
    gy = torch.randn(4, 16, 48)
    y = lin(x)
    gx, gw, gb = torch.autograd.grad(y, (x, lin.weight, lin.bias), gy)
    y8 = f8(x)
    gx8, gw8, gb8 = torch.autograd.grad(y8, (x, f8.weight, f8.bias), gy)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # stated tolerances: E4M3 keeps 3 mantissa bits (<= 6% per element, errors
    # average out over K terms), E5M2 2 bits for the gradient
    assert rel(y8, y) < 0.06 and rel(gx8, gx) < 0.1 and rel(gw8, gw) < 0.1
    assert torch.equal(gb8, gb)
    assert f8.grad_scaling.steps == 1 and f8.input_scaling.amax_history[0] == x.abs().max()


def test_toy_gpt_trains_with_fp8_close_to_bf16():
    ds = make_dataset(num_sequences=256, seq_len=32)
    g = torch.Generator().manual_seed(0)
    losses = {}
    for name in ("bf16", "fp8"):
        model = build_model("toy").to(torch.bfloat16)
        if name == "fp8":
            swap_to_fp8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g.manual_seed(0)
        out = []
        for _ in range(15):
            x, y = ds.batch(torch.randint(0, 256, (16,), generator=g))
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    assert sum(losses["fp8"][-3:]) / 3 < losses["fp8"][0] - 0.3          # it learns
    assert abs(losses["fp8"][-1] - losses["bf16"][-1]) < 0.1


def test_fp8_saved_activations_for_recompute():
    model = build_model("toy")
    store = FP8SavedTensors()
    apply_recompute(model, "full", saved_tensor_hooks=store.hooks)
    idx = torch.randint(0, 64, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert store.stored_bytes * 4 == store.original_bytes == 2 * 2 * 16 * 32 * 4
    grad = model.blocks[0].ln_1.weight.grad.clone()
    ref = build_model("toy")
    _, l2 = ref(idx, idx)
    l2.backward()
    ref_grad = ref.blocks[0].ln_1.weight.grad
    assert ((grad - ref_grad).norm() / ref_grad.norm()) < 0.1


def test_fp8_errors():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize(torch.ones(2), torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match="history_len must be a positive int"):
        DelayedScaling(history_len=0)


def test_emulated_gemm_matches_scaled_mm():
    import helpers.precision as prec
    from helpers.precision import fp8_gemm
    a8 = (torch.randn(32, 64) * 4).to(E4M3)
    b8 = (torch.randn(64, 48) * 2).to(E5M2)
    sa, sb = torch.tensor(4.0), torch.tensor(2.0)
    real = fp8_gemm(a8, b8, sa, sb, torch.float32)
    saved = dict(prec._SCALED_MM_OK)
    prec._SCALED_MM_OK["cpu"] = False
    try:
        emulated = fp8_gemm(a8, b8, sa, sb, torch.float32)
    finally:
        prec._SCALED_MM_OK.clear()
        prec._SCALED_MM_OK.update(saved)
    # products of FP8 values are exact in fp32; only the summation order may differ
    torch.testing.assert_close(real, emulated, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_linear_on_cuda():
    from helpers.precision import scaled_mm_available
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, device="cuda", dtype=torch.bfloat16)   # dims % 16 == 0
    f8 = FP8Linear.from_linear(lin)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, y8 = lin(x), f8(x)
    gx8, = torch.autograd.grad(y8.float().square().sum(), x)
    gx, = torch.autograd.grad(y.float().square().sum(), x)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(y8, y) < 0.06 and rel(gx8, gx) < 0.12
    print("scaled_mm on cuda:", scaled_mm_available("cuda"))
