"""Accumulation, LR scaling rules and the gradient noise scale."""

import pytest
import torch

from helpers import launch, rank_info
from helpers.batch import (accumulate_gradients, global_batch_size, linear_scaled_lr,
                           measure_noise_scale, noise_scale, scaled_lr, sqrt_scaled_lr, warmup_lr)
from helpers.data import make_dataset
from helpers.ddp import BucketedDDP
from helpers.model import build_model
from helpers.tolerance import assert_within_fp32_noise


def _loss(model, batch):
    return model(*batch)[1]


def test_global_batch_and_lr_rules():
    assert global_batch_size(4, accum_steps=8, dp=32) == 1024
    with pytest.raises(ValueError):
        global_batch_size(0)
    # Goyal et al. 2017, sec. 2.1: lr = 0.1 * B / 256; their 8k batch -> 3.2
    assert linear_scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert sqrt_scaled_lr(1e-3, 1024, base_batch=256) == pytest.approx(2e-3)
    # warmup: linear ramp, then constant
    assert warmup_lr(0, 3.2, 100, start_lr=0.1) == pytest.approx(0.1)
    assert warmup_lr(50, 3.2, 100, start_lr=0.1) == pytest.approx(1.65)
    assert warmup_lr(100, 3.2, 100) == 3.2 and warmup_lr(10, 1.0, 0) == 1.0
    assert scaled_lr(0, 0.1, 1024, 256, "linear", warmup_steps=10) == pytest.approx(0.1)
    assert scaled_lr(10, 0.1, 1024, 256, "linear", warmup_steps=10) == pytest.approx(0.4)
    assert scaled_lr(5, 0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(5, 0.1, 1024, 256, "none") == 0.1
    with pytest.raises(ValueError):
        scaled_lr(0, 0.1, 1024, 256, "cubic")
    with pytest.raises(ValueError):
        linear_scaled_lr(0.1, 0)


def test_accumulation_equals_the_big_batch_single_process():
    data = make_dataset(seq_len=16, num_sequences=32)
    x, y = data.batch(range(8))
    big, acc = build_model("toy", seed=1), build_model("toy", seed=1)
    big64 = build_model("toy", seed=1).double()  # the exact answer, to ~1e-16
    big_loss, big64_loss = _loss(big, (x, y)), _loss(big64, (x, y))
    (big_loss + big64_loss).backward()  # two separate graphs: one backward each
    loss = accumulate_gradients(acc, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)], _loss)
    # fp32, 4 partial sums instead of one: as far from float64 as the one-batch
    # fp32 run is (times a small factor; helpers.tolerance)
    assert_within_fp32_noise(loss, big_loss.detach(), big64_loss.detach(), "loss")
    for a, b, c in zip(acc.parameters(), big.parameters(), big64.parameters()):
        assert_within_fp32_noise(a.grad, b.grad, c.grad, "accumulated grad")
    # a plausible mistake, summing micro-batch means without dividing by 4,
    # is far outside that bound
    with pytest.raises(AssertionError):
        assert_within_fp32_noise(4 * a.grad, b.grad, c.grad)


def test_noise_scale_recovers_known_statistics():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B exactly -> the two-batch formulas invert it
    G2, tr = 4.0, 200.0
    out = noise_scale(G2 + tr / 8, 8, G2 + tr / 64, 64)
    assert out["G2"] == pytest.approx(G2) and out["trace_sigma"] == pytest.approx(tr)
    assert out["b_simple"] == pytest.approx(50.0)
    # Monte Carlo: per-example gradients G + noise with known covariance
    g = torch.Generator().manual_seed(0)
    d, sigma = 50, 2.0
    G = torch.full((d,), 0.2, dtype=torch.float64)          # |G|^2 = 2
    true_b = d * sigma ** 2 / float(G @ G)                  # tr(Sigma) / |G|^2 = 100
    est_small, est_big = [], []
    for _ in range(400):
        ex = G + sigma * torch.randn(64, d, generator=g, dtype=torch.float64)
        est_small.append(float(ex[:8].mean(0).pow(2).sum()))
        est_big.append(float(ex.mean(0).pow(2).sum()))
    mc = noise_scale(sum(est_small) / 400, 8, sum(est_big) / 400, 64)
    assert mc["b_simple"] == pytest.approx(true_b, rel=0.25)  # 400 samples: ~10 % noise
    with pytest.raises(ValueError):
        noise_scale(1.0, 8, 1.0, 8)


def _ddp_accumulate_and_noise():
    r = rank_info().rank
    data = make_dataset(seq_len=16, num_sequences=32)
    calls = []

    def counting_hook(flat, group):
        from helpers.ddp import allreduce_hook
        calls.append(flat.numel())
        return allreduce_hook(flat, group)

    model = BucketedDDP(build_model("toy", seed=1), bucket_cap_mb=0.01, comm_hook=counting_hook)
    x, y = data.batch(range(r * 4, r * 4 + 4))  # this rank's 4 of the global 8
    accumulate_gradients(model, [(x[:2], y[:2]), (x[2:], y[2:])], _loss)
    grads = [p.grad.clone() for p in model.module.parameters()]
    est = measure_noise_scale(model.module, _loss, data.batch(range(8 + r * 4, 12 + r * 4)))
    return grads, len(calls), len(model.buckets), est


@pytest.mark.slow
def test_no_sync_accumulation_on_two_ranks_and_noise_scale():
    results = launch(_ddp_accumulate_and_noise, 2)
    data = make_dataset(seq_len=16, num_sequences=32)
    ref, ref64 = build_model("toy", seed=1), build_model("toy", seed=1).double()
    (_loss(ref, data.batch(range(8))) + _loss(ref64, data.batch(range(8)))).backward()
    for grads, n_calls, n_buckets, est in results:
        assert n_calls == n_buckets  # the first micro-batch stayed local
        for a, p, p64 in zip(grads, ref.parameters(), ref64.parameters()):
            # other summation order than one process: within fp32 rounding noise
            assert_within_fp32_noise(a, p.grad, p64.grad, "no_sync grad")
        assert est["b_small"] == 4 and est["b_big"] == 8
        check = noise_scale(est["g_small_sq"], 4, est["g_big_sq"], 8)
        assert check["b_simple"] == pytest.approx(est["b_simple"])
        assert est["g_small_sq"] > est["g_big_sq"] > 0  # a smaller batch is noisier
    assert results[0][3] == results[1][3]


IGNORE = -100  # F.cross_entropy's default ignore_index: a padded or masked label


def _padded_batch():
    """8 sequences of 16 tokens; sequence i keeps its first 2 + 2i labels, so the
    micro-batches hold very different numbers of loss tokens."""
    x, y = make_dataset(seq_len=16, num_sequences=8).batch(range(8))
    y = y.clone()
    for i in range(8):
        y[i, 2 + (2 * i) % 15:] = IGNORE
    return x, y


def _loss_sum(model, batch):
    logits, _ = model(batch[0])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             batch[1].reshape(-1), reduction="sum")


def _count(batch):
    return int((batch[1] != IGNORE).sum())


def _token_weighted_on_ranks(weighted):
    from helpers.batch import accumulate_token_weighted
    r = rank_info().rank
    x, y = _padded_batch()
    ddp = BucketedDDP(build_model("toy", seed=1))
    mine = (x[4 * r:4 * r + 4], y[4 * r:4 * r + 4])  # rank r: 2 micro-batches of 2
    micro = [(mine[0][i:i + 2], mine[1][i:i + 2]) for i in (0, 2)]
    if weighted:
        accumulate_token_weighted(ddp, micro, _loss_sum, _count)
    else:  # the mean of per-micro-batch means, then DDP's mean over ranks
        accumulate_gradients(ddp, micro, _loss)
    return [p.grad.clone() for p in ddp.module.parameters()]


def test_token_weighted_accumulation_equals_the_global_token_mean():
    x, y = _padded_batch()
    ref = build_model("toy", seed=1)
    _loss(ref, (x, y)).backward()  # mean over every non-ignored token of the 8 sequences
    for weighted in (True, False):
        grads = launch(_token_weighted_on_ranks, 2, weighted)
        worst = max(float((a - p.grad).abs().max() / p.grad.abs().max())
                    for a, p in zip(grads[0], ref.parameters()))
        if weighted:
            # same sums in another order: fp32 rounding, ~1e-7 relative (1e-5 leaves 100x)
            assert worst < 1e-5
            for a, p in zip(grads[1], ref.parameters()):
                torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
        else:
            # token counts 2..16 per sequence: equal weights per micro-batch are wrong by
            # far more than rounding
            assert worst > 1e-2


def test_token_weighted_single_process_and_errors():
    from helpers.batch import accumulate_token_weighted
    x, y = _padded_batch()
    ref, acc = build_model("toy", seed=1), build_model("toy", seed=1)
    _loss(ref, (x, y)).backward()
    loss, n = accumulate_token_weighted(acc, [(x[:3], y[:3]), (x[3:], y[3:])], _loss_sum, _count)
    assert n == _count((x, y))
    assert loss == pytest.approx(float(_loss(ref, (x, y))), rel=1e-5)
    for a, p in zip(acc.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, p.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="no loss tokens"):
        accumulate_token_weighted(acc, [(x, torch.full_like(y, IGNORE))], _loss_sum, _count)
