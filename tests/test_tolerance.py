"""helpers.tolerance: the bounds hold where the arithmetic says, and can fail."""

import pytest
import torch

from helpers.tolerance import (fp32_noise, gamma, reorder_bound, sum_bound, unit_roundoff,
                               within_fp32_noise)


def test_unit_roundoff_and_gamma():
    assert unit_roundoff(torch.float32) == 2.0 ** -24
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8
    assert gamma(1) == pytest.approx(2.0 ** -24, rel=1e-6)
    with pytest.raises(ValueError, match="n \\* u"):
        gamma(2 ** 24)


def test_sum_bound_holds_in_any_order():
    # 1000 terms of mixed sign and magnitude, summed in float32 forwards, backwards,
    # sorted and pairwise (torch.sum): each within gamma(n-1) sum|x| of the exact
    # (float64) sum, so any two within reorder_bound of each other
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 3, 1000)
    exact = x.double().sum()
    abs_sum = float(x.double().abs().sum())
    sums = []
    for order in (x, x.flip(0), x[x.abs().argsort()]):
        acc = torch.zeros((), dtype=torch.float32)
        for v in order:
            acc = acc + v  # one float32 rounding per addition
        sums.append(acc)
    sums.append(x.sum())
    for s in sums:
        assert abs(float(s) - float(exact)) <= sum_bound(abs_sum, 1000)
    for a in sums:
        for b in sums:
            assert abs(float(a) - float(b)) <= reorder_bound(abs_sum, 1000)


def test_within_fp32_noise_accepts_reordering_and_rejects_a_real_error():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 32, generator=g)
    ref32, ref64 = a @ b, a.double() @ b.double()
    # the same product with the inner sum split in two halves: another order
    other = a[:, :128] @ b[:128] + a[:, 128:] @ b[128:]
    ok, err, bound = within_fp32_noise(other, ref32, ref64)
    assert ok and err <= bound
    assert fp32_noise(ref32, ref64) > 0
    # a relative error of 1e-4, far above float32's rounding, is caught
    assert not within_fp32_noise(other * (1 + 1e-4), ref32, ref64)[0]
    assert not within_fp32_noise(other[:, :-1], ref32, ref64)[0]  # wrong shape
