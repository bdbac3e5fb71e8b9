"""helpers.precision: loss scaler == GradScaler; FP8 formats, delayed scaling, FP8Linear."""

import pytest
import torch

from helpers.data import make_dataset
from helpers.model import build_model
import helpers.precision as prec
from helpers.precision import (E4M3, E5M2, FP8_GEMM, FP8_MAX, DelayedScaling, DynamicLossScaler,
                               FP8Linear, FP8SavedTensors, dequantize, fp8_gemm, fp8_scale,
                               quantize, scaled_mm_available, swap_to_fp8, train_fp16,
                               update_delayed_scale)
from helpers.recompute import apply_recompute
from helpers.tolerance import reorder_bound

# finite (F) / non-finite (N) gradient per step; includes runs long enough to grow
SEQUENCE = "FFFNFFFFFFNNFFFFFFFNF"

CPU_SCALED_MM = scaled_mm_available("cpu")
NO_CPU_SCALED_MM = "this torch build has no CPU torch._scaled_mm for FP8: only the emulation runs"


def _skip_if_refused_since() -> None:
    """The probe passed, but the CPU then refused a call and fp8_gemm fell back to the
    emulation (oneDNN's FP8 matmul needs AVX512-FP16 or AMX; with its ISA capped it runs
    some calls and refuses others). What these tests compare then did not run."""
    if not scaled_mm_available("cpu"):
        pytest.skip("this CPU refused torch._scaled_mm at run time: only the emulation ran")


@pytest.fixture
def cublas_contract(monkeypatch):
    """torch._scaled_mm that first checks what cuBLASLt (CUDA) would demand of its
    operands (the checks of torch/_meta_registrations.py), so a CPU test fails
    where a GPU would raise. Yields the list of (M, K, N) it was called with."""
    real, calls = torch._scaled_mm, []

    def checked(a, b, *, scale_a, scale_b, out_dtype, **kw):
        assert a.dtype in FP8_MAX and b.dtype in FP8_MAX, "operands must be FP8"
        assert not (a.dtype == b.dtype == E5M2), "cuBLAS rejects E5M2 x E5M2"
        assert a.stride(1) == 1 and a.stride(0) >= a.size(1), f"a not row-major: {a.stride()}"
        assert b.stride(0) == 1 and b.stride(1) >= b.size(0), f"b not column-major: {b.stride()}"
        assert a.size(1) % 16 == 0, f"K = {a.size(1)} is not a multiple of 16"
        assert b.size(1) % 16 == 0, f"N = {b.size(1)} is not a multiple of 16"
        for sc in (scale_a, scale_b):
            assert sc.dtype == torch.float32 and sc.numel() == 1 and sc.device == a.device
        calls.append((a.size(0), a.size(1), b.size(1)))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", checked)
    FP8_GEMM.clear()
    yield calls


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


def test_loss_scaler_unscales_fp16_gradients_in_fp32():
    # A true gradient of 2^-26 is below fp16's smallest subnormal (2^-24); scaled
    # by 2^16 it is 2^-10, at home in fp16. Unscaled in fp16 it flushes to 0
    # again; unscaled in fp32 (into the fp32 master's .grad) it survives, exactly.
    scaler = DynamicLossScaler(init_scale=2.0 ** 16)
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    master = torch.nn.Parameter(half.detach().float())
    half.grad = torch.tensor([2.0 ** -10, 1.0, 0.0], dtype=torch.float16)
    assert (half.grad * 2.0 ** -16)[0] == 0                        # the fp16 way loses it
    stepped = scaler.step(torch.optim.SGD([master], lr=1.0), [half], [master])
    assert stepped and master.grad.dtype == torch.float32
    assert torch.equal(master.grad, torch.tensor([2.0 ** -26, 2.0 ** -16, 0.0]))
    assert torch.equal(master.detach(), -master.grad)              # the update used it
    # without a master parameter an fp16 gradient is refused, as GradScaler does
    with pytest.raises(ValueError, match="float16 gradient.*master_params"):
        scaler.unscale_([half])
    with pytest.raises(ValueError, match="must be float32"):
        scaler.unscale_([half], [torch.zeros(3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="1 parameters but 2 master"):
        scaler.unscale_([half], [master, master])


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


def _fp8_vs_fp32(in_f, out_f, tokens_shape, device="cpu", dtype=torch.float32):
    """FP8Linear and nn.Linear sharing weights: outputs and all three gradients."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(in_f, out_f, device=device, dtype=dtype)
    f8 = FP8Linear.from_linear(lin)
    x = torch.randn(*tokens_shape, in_f, device=device, dtype=dtype, requires_grad=True)
    gy = torch.randn(*tokens_shape, out_f, device=device, dtype=dtype)
    y = lin(x)
    ref = torch.autograd.grad(y, (x, lin.weight, lin.bias), gy)
    y8 = f8(x)
    got = torch.autograd.grad(y8, (x, f8.weight, f8.bias), gy)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return f8, x, rel(y8, y), [rel(a, b) for a, b in zip(got, ref)], got[2], ref[2]


def test_fp8_linear_close_to_fp32_and_uses_fp8_gemm(cublas_contract):
    f8, x, err_y, (err_x, err_w, _), gb8, gb = _fp8_vs_fp32(64, 48, (4, 16))
    # stated tolerances: E4M3 keeps 3 mantissa bits (<= 6% per element, errors
    # average out over K terms), E5M2 2 bits for the gradient
    assert err_y < 0.06 and err_x < 0.1 and err_w < 0.1
    assert torch.equal(gb8, gb)
    assert f8.grad_scaling.steps == 1 and f8.input_scaling.amax_history[0] == x.abs().max()
    # the three GEMMs ran, and ran where we say: forward (64 tokens, K=64, N=48),
    # grad input (K=48, N=64), grad weight (K = 64 tokens, N=64)
    if scaled_mm_available("cpu"):  # (after the run: the CPU may have refused the kernel)
        assert FP8_GEMM == {"scaled_mm": 3}
        assert cublas_contract == [(64, 64, 48), (64, 48, 64), (48, 64, 64)]
    else:
        assert FP8_GEMM == {"emulated": 3} and len(cublas_contract) <= 1


@pytest.mark.skipif(not CPU_SCALED_MM, reason=NO_CPU_SCALED_MM)
def test_fp8_linear_odd_shapes_padded_for_cublas(cublas_contract):
    # 3 x 11 = 33 tokens and 40 output features: every GEMM has a K or N that
    # is not a multiple of 16 (forward N=40, grad input K=40, grad weight K=33)
    f8, _, err_y, (err_x, err_w, _), gb8, gb = _fp8_vs_fp32(24, 40, (3, 11))
    _skip_if_refused_since()
    assert err_y < 0.06 and err_x < 0.1 and err_w < 0.1      # tolerances as above
    assert torch.equal(gb8, gb)
    assert FP8_GEMM == {"scaled_mm": 3, "padded": 3}
    assert cublas_contract == [(33, 32, 48), (33, 48, 32), (40, 48, 32)]


@pytest.mark.skipif(not CPU_SCALED_MM, reason=NO_CPU_SCALED_MM)
@pytest.mark.parametrize("m, k, n", [(33, 50, 7), (1, 16, 16), (5, 3, 20)])
def test_padded_scaled_mm_equals_emulation(cublas_contract, m, k, n):
    g = torch.Generator().manual_seed(m * k * n)
    a8 = (torch.randn(m, k, generator=g) * 4).to(E4M3)
    b8 = (torch.randn(k, n, generator=g) * 2).to(E5M2)
    sa, sb = torch.tensor(4.0), torch.tensor(2.0)
    real = fp8_gemm(a8, b8, sa, sb, torch.float32)
    _skip_if_refused_since()
    assert FP8_GEMM["scaled_mm"] == 1 and real.shape == (m, n)
    assert FP8_GEMM["padded"] == (k % 16 != 0 or n % 16 != 0)
    ref = (a8.float() / 4) @ (b8.float() / 2)              # fp32 reference, no FP8 kernel
    # products of FP8 values are exact in fp32 (and the scales are powers of
    # two); only the order of the k-term sums may differ: Higham's bound
    mag = (a8.float().abs() / 4) @ (b8.float().abs() / 2)  # sum |products|
    assert ((real - ref).abs() <= reorder_bound(mag, k)).all()


def test_fp8_gemm_errors():
    a8 = torch.zeros(4, 8).to(E4M3)
    with pytest.raises(ValueError, match=r"multiplies \(M, K\) by \(K, N\)"):
        fp8_gemm(a8, torch.zeros(4, 8).to(E4M3), 1.0, 1.0, torch.float32)
    with pytest.raises(ValueError, match="takes FP8 operands"):
        fp8_gemm(a8, torch.zeros(8, 4), 1.0, 1.0, torch.float32)


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
    # 0.1: the loss falls by ~0.5 in these 15 steps and a bf16 loss near 3.7 is
    # resolved only to 1/64, so 0.1 is ~6 bf16 steps and a fifth of what was
    # learned: loose enough for FP8 rounding, far too tight for a run that
    # diverged or stopped learning (measured gap: 0.0; bf16 vs fp32: 0.02)
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
    # 0.1: recompute starts from block inputs rounded to E4M3, each off by at most
    # half an ulp, 2^-4 = 6.25% (~2-3% in norm); ln_1's weight gradient multiplies
    # the normalized input by the backward signal, so its error is of that order
    # (measured 2-3% over seeds); 10% leaves room for that, not for a wrong input
    assert ((grad - ref_grad).norm() / ref_grad.norm()) < 0.1
    assert store.stored_bytes > 0 and not torch.equal(grad, ref_grad)   # FP8 really used


def test_fp8_errors():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize(torch.ones(2), torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match="history_len must be a positive int"):
        DelayedScaling(history_len=0)


@pytest.mark.skipif(not CPU_SCALED_MM, reason=NO_CPU_SCALED_MM + "; nothing to compare with")
def test_emulated_gemm_matches_scaled_mm(monkeypatch):
    a8 = (torch.randn(32, 64) * 4).to(E4M3)
    b8 = (torch.randn(64, 48) * 2).to(E5M2)
    sa, sb = torch.tensor(4.0), torch.tensor(2.0)
    FP8_GEMM.clear()
    real = fp8_gemm(a8, b8, sa, sb, torch.float32)
    _skip_if_refused_since()
    monkeypatch.setitem(prec.scaled_mm._SCALED_MM_OK, "cpu", False)     # force the emulation
    emulated = fp8_gemm(a8, b8, sa, sb, torch.float32)
    assert FP8_GEMM == {"scaled_mm": 1, "emulated": 1}        # one of each really ran
    # products of FP8 values are exact in fp32; only the order of the 64-term
    # sums may differ: Higham's bound on two orders of a sum
    mag = (a8.float().abs() / 4) @ (b8.float().abs() / 2)  # sum |products|
    assert ((real - emulated).abs() <= reorder_bound(mag, 64)).all()


@pytest.mark.gpu
def test_fp8_linear_on_cuda():
    # FP8 tensor cores (and cuBLASLt FP8 GEMMs) start at compute capability 8.9
    # (Ada, Hopper); an H100 is 9.0. There the cuBLAS path must run, not the emulation.
    fp8_gpu = torch.version.cuda is not None and torch.cuda.get_device_capability() >= (8, 9)
    assert scaled_mm_available("cuda") == fp8_gpu
    FP8_GEMM.clear()
    # 33 tokens and 40 outputs: cuBLAS would reject every one of the three GEMMs
    # unpadded (K or N not a multiple of 16), so this also proves the padding
    f8, _, err_y, (err_x, err_w, _), _, _ = _fp8_vs_fp32(64, 40, (3, 11), device="cuda",
                                                       dtype=torch.bfloat16)
    # E4M3/E5M2 tolerances as on CPU, plus bf16 rounding of the reference (2^-9)
    assert err_y < 0.06 and err_x < 0.12 and err_w < 0.12
    assert FP8_GEMM == ({"scaled_mm": 3, "padded": 3} if fp8_gpu else {"emulated": 3})


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(33, 50, 7), (64, 64, 48)])
def test_cuda_fp8_gemm_equals_fp32_reference(m, k, n):
    g = torch.Generator().manual_seed(m * k * n)
    a8 = (torch.randn(m, k, generator=g) * 4).to(E4M3).cuda()
    b8 = (torch.randn(k, n, generator=g) * 2).to(E5M2).cuda()
    FP8_GEMM.clear()
    got = fp8_gemm(a8, b8, torch.tensor(4.0), torch.tensor(2.0), torch.float32)
    ref = (a8.cpu().float() / 4) @ (b8.cpu().float() / 2)
    assert FP8_GEMM["scaled_mm" if scaled_mm_available("cuda") else "emulated"] == 1
    # Products of FP8 values are exact in fp32, but Hopper's FP8 tensor cores add
    # them with about 14 mantissa bits, not fp32's 23 (DeepSeek-AI 2024,
    # DeepSeek-V3 technical report, sec. 3.3.2; cuBLAS promotes partial sums to
    # fp32 only now and then). Measured on an H100: up to 2e-4 of the sum of
    # |products|. Bound: 2^-10 of that sum; a wrong scale or layout is off by
    # the order of the sum itself.
    mag = (a8.cpu().float().abs() / 4) @ (b8.cpu().float().abs() / 2)
    err = (got.cpu() - ref).abs()
    assert (err <= 2**-10 * mag + 1e-6).all(), (err / (mag + 1e-12)).max()


def _fp8_training_grads(recompute: str, steps: int = 4, jump_at: int = 2):
    """FP8 toy GPT, ``steps`` forward/backward passes on one batch; before pass
    ``jump_at`` every FP8 weight is multiplied by 8, so its amax jumps and the
    delayed scale of the next passes moves. Returns each pass's gradients and
    the FP8 layers' scaling objects."""
    model = swap_to_fp8(build_model("toy", seed=0))
    apply_recompute(model, recompute)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    grads = []
    for step in range(steps):
        if step == jump_at:
            with torch.no_grad():
                for m in fp8:
                    m.weight.mul_(8)
        model.zero_grad(set_to_none=True)
        model(idx, idx)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads, [s for m in fp8 for s in (m.input_scaling, m.weight_scaling, m.grad_scaling)]


@pytest.mark.parametrize("recompute", ["full", "segments"])
def test_fp8_under_recompute_replays_the_forward_scales(recompute):
    # A recomputed forward must quantize with the scales of the forward it
    # replays and record nothing: the same FP8 operands, so the same gradients
    # bit for bit as without recompute (the control without FP8 is bit-equal
    # too: test_recompute.py), and the history advanced once per pass.
    plain, plain_scalings = _fp8_training_grads("none")
    again, scalings = _fp8_training_grads(recompute)
    for step, (a, b) in enumerate(zip(again, plain)):
        for name in b:
            assert torch.equal(a[name], b[name]), (step, name)
    assert [s.steps for s in scalings] == [4] * len(scalings)
    for s, t in zip(scalings, plain_scalings):
        assert torch.equal(s.amax_history, t.amax_history) and torch.equal(s.scale, t.scale)
    # the weight jump really moved the scales (else the test could not fail)
    w = plain_scalings[1].amax_history
    assert w[0] > 4 * w[-1] > 0 or w[1] > 4 * w[2] > 0


def test_fp8_recompute_replays_again_with_a_retained_graph():
    model = swap_to_fp8(build_model("toy", seed=0))
    apply_recompute(model, "full")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(idx, idx)[1]
    loss.backward(retain_graph=True)
    first = model.blocks[0].mlp.c_fc.weight.grad.clone()
    loss.backward()                      # a second recompute, the same scales again
    assert torch.equal(model.blocks[0].mlp.c_fc.weight.grad, 2 * first)
    assert model.blocks[0].mlp.c_fc.input_scaling.steps == 1


# ---------------------------------------------------------------- block scaling

def test_block_quantize_is_per_block_quantize():
    """Each block is quantized exactly as the per-tensor quantizer with that block's own
    scale (the same arithmetic, so equality is exact)."""
    from helpers.precision import (E4M3, block_dequantize, block_quantize, fp8_scale,
                                   mx_quantize, quantize, tile_quantize)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g)
    x[:, 7] *= 300.0  # an outlier channel
    for block, p2 in (((1, 32), True), ((1, 128), False), ((2, 64), False)):
        x8, s = block_quantize(x, E4M3, block, power_of_two=p2)
        assert s.shape == (4 // block[0], 256 // block[1])
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                want = quantize(blk, E4M3, s[i, j])
                got = x8[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                assert torch.equal(got.float(), want.float())
                if not p2:
                    assert s[i, j] == fp8_scale(blk.abs().max(), E4M3)
        back = block_dequantize(x8, s, block)
        # E4M3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself
        # (half a step); values that land in the subnormals by at most half the
        # smallest subnormal step 2^-9 / 2, divided by their block's scale.
        # MX's power-of-two scale can put a block's largest values between 448 and 512:
        # they saturate to exactly 448 / scale (the spec's rule), an error of |x| - 448/scale
        full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        bound = torch.maximum(torch.maximum(x.abs() * 2 ** -4, 2 ** -10 / full),
                              x.abs() - 448 / full)
        assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    _, s = mx_quantize(x)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # MX scales: powers of two
    _, s = tile_quantize(torch.randn(256, 256, generator=g), weight=True)
    assert s.shape == (2, 2)


def test_block_scaling_beats_one_scale_on_outliers():
    from helpers.precision import E4M3, block_dequantize, block_quantize, fp8_round_trip

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    x[:, 3] *= 1e5  # one channel 1e5x the others: per tensor, the rest fall to subnormals
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[:, :32] = False  # the outlier's own 1x32 blocks share its scale either way
    err_tensor = ((fp8_round_trip(x) - x)[rest].norm() / x[rest].norm()).item()
    x8, s = block_quantize(x, E4M3, (1, 32), power_of_two=True)
    err_block = ((block_dequantize(x8, s, (1, 32)) - x)[rest].norm() / x[rest].norm()).item()
    assert err_block < err_tensor / 4  # ~3% (E4M3 rounding, MX saturation) against ~30%
    with pytest.raises(ValueError, match="does not divide into 1x32 blocks"):
        block_quantize(torch.zeros(2, 33))
    assert torch.equal(block_quantize(torch.zeros(1, 32))[1], torch.ones(1, 1))


def _amax_on_ranks():
    from helpers import rank_info
    from helpers.precision import E4M3, all_reduce_amax, fp8_scale

    r = rank_info().rank
    x = torch.randn(100, generator=torch.Generator().manual_seed(r)) * (r + 1)
    local = x.abs().max()
    amax = all_reduce_amax(local.clone())
    return local.item(), amax.item(), fp8_scale(amax, E4M3).item()


@pytest.mark.slow
def test_amax_all_reduce_gives_every_rank_one_scale():
    from helpers import launch

    out = launch(_amax_on_ranks, 3)
    locals_ = [o[0] for o in out]
    assert len(set(locals_)) == 3                       # the ranks saw different data
    assert all(o[1] == max(locals_) for o in out)       # MAX is exact
    assert len({o[2] for o in out}) == 1                # one scale everywhere


# ---------------------------------------------------------------- no host synchronisation

def _fp8_layers_on(device, recompute="none"):
    """An FP8Linear alone (odd K: the padded path too) and a toy GPT swapped to FP8,
    optionally under recompute with FP8 saved activations, with their inputs on ``device``;
    returns a function running one forward + backward of both."""
    lin = FP8Linear(40, 24, device=device)
    x = torch.randn(20, 40, device=device, requires_grad=True)
    model = swap_to_fp8(build_model("toy", device=device))
    store = FP8SavedTensors()
    apply_recompute(model, recompute, saved_tensor_hooks=store.hooks if recompute != "none" else None)
    idx = torch.zeros(2, 16, dtype=torch.long, device=device)

    def step():
        lin(x).sum().backward()
        model(idx, idx)[1].backward()
    return lin, step


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fp8_step_reads_nothing_on_the_host(recompute):
    # Meta tensors carry shapes and dtypes but no values, so every operation that
    # would read a value on the host (.item(), .cpu(), bool(t), a Python if on a
    # tensor) raises here -- the same operations that make the CPU wait for the GPU
    # in a CUDA step. Scales and amax histories must live and update on the device.
    # (The test fails on the earlier DelayedScaling, which read amax with .cpu().)
    lin, step = _fp8_layers_on("meta", recompute)
    for _ in range(3):
        step()
    for scaling in (lin.input_scaling, lin.weight_scaling, lin.grad_scaling):
        assert scaling.amax_history.device.type == "meta" and scaling.scale.device.type == "meta"
        assert scaling.steps == 3


@pytest.mark.gpu
def test_fp8_step_does_not_synchronize_cuda():
    # The CUDA version of the test above: torch raises on any synchronizing call
    # while sync debug mode is "error". The first step
    # probes _scaled_mm once (a cached host check), so it runs before.
    _, step = _fp8_layers_on("cuda", "full")
    step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fused_cast_and_amax_gives_the_same_bits_and_steps(monkeypatch):
    # The compiled path must change speed only: multiply, clamp, cast and max are each
    # exactly rounded, so the same FP8 bytes, amax, histories and gradients, bit for bit.
    # One small layer, 2 steps (the compile costs ~15-40 s on a CPU). Both runs take the
    # same GEMM (the emulation): a CPU that runs oneDNN's FP8 kernel for some calls and
    # refuses others would otherwise put the two runs on different GEMMs.
    import helpers.precision as prec

    monkeypatch.setitem(prec.scaled_mm._SCALED_MM_OK, "cpu", False)
    torch.manual_seed(0)
    base = torch.nn.Linear(48, 32)
    x = torch.randn(24, 48) * 20
    runs = []
    for fused in (False, True):
        layer = FP8Linear.from_linear(base, fused=fused)
        for _ in range(2):
            base.weight.grad = None
            layer(x).square().sum().backward()
        runs.append((base.weight.grad.clone(), layer.grad_scaling.amax_history.clone(),
                     layer.input_scaling.scale.clone()))
    for eager, fused in zip(*runs):
        assert torch.equal(eager, fused)
    assert runs[0][1][0] > 0          # the gradient's amax was recorded (not an empty run)


def test_the_quantizer_saturates_whatever_the_cast_does():
    """What helpers.precision.fp8 and chapter 13's check say about the cast: torch 2.13's
    conversion to E4M3 maps every value above 448, inf included, to 448 (an earlier
    version of it returned NaN from 480 up), so saturating is ``quantize``'s own job."""
    from helpers.precision import E4M3, quantize

    x = torch.tensor([449.0, 464.0, 470.0, 486.0, 1e6, float("inf")])
    cast = x.to(E4M3).float()
    if torch.__version__.startswith("2.13"):
        assert (cast == 448).all()                     # the tested torch saturates by itself
    else:                                              # another torch: saturate or NaN
        assert ((cast == 448) | cast.isnan()).all()
    assert (quantize(-x, E4M3, 1.0).float() == -448).all()   # clamped before the cast
    assert (quantize(x / 2, E4M3, 2.0).float() == 448).all()


def test_a_cpu_that_refuses_the_fp8_kernel_gets_the_emulation(monkeypatch):
    """oneDNN's FP8 matmul needs AVX512-FP16 or AMX: an AVX2-only laptop, an AMD Zen 4 or
    an ARM CPU refuses it. Whatever a probe said, a refusal falls back to the emulation
    (and stays there), with the emulation's result."""
    import helpers.precision as prec

    def refuses(*a, **kw):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive")

    monkeypatch.setitem(prec.scaled_mm._SCALED_MM_OK, "cpu", True)   # the probe said yes
    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    FP8_GEMM.clear()
    a8, b8 = (torch.randn(8, 32) * 4).to(E4M3), (torch.randn(32, 16) * 2).to(E4M3)
    one = torch.tensor(1.0)
    got = prec.fp8_gemm(a8, b8, one, one, torch.float32)
    assert torch.equal(got, a8.float() @ b8.float())
    assert FP8_GEMM == {"emulated": 1} and prec.scaled_mm._SCALED_MM_OK["cpu"] is False


def test_a_compiled_fp8_cast_that_differs_from_eager_is_not_used_on_cpu(monkeypatch):
    """torch 2.13's Inductor, writing AVX2 code (a laptop without AVX-512), casts to E4M3
    wrongly. cast_and_amax(fused=True) compares the compiled result with eager's on the
    first call of each shape on a CPU: a wrong compiled function is caught, warned about,
    and never used for that shape."""
    import helpers.precision.fp8 as fp8

    wrong = lambda x, scale, dtype: (torch.zeros_like(x).to(dtype), x.abs().amax() * 0)  # noqa: E731
    monkeypatch.setitem(fp8._COMPILED, "fn", wrong)
    monkeypatch.setattr(fp8, "_CPU_CHECKED", {})
    x, scale = torch.randn(5, 7) * 30, torch.tensor(2.0)
    want = fp8._cast_and_amax(x, scale, E4M3)
    with pytest.warns(UserWarning, match="gave other bits than eager on this CPU"):
        first = fp8.cast_and_amax(x, scale, E4M3, fused=True)
    second = fp8.cast_and_amax(x, scale, E4M3, fused=True)
    for got in (first, second):
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1])
    assert fp8._CPU_CHECKED == {((5, 7), torch.float32, E4M3): False}
