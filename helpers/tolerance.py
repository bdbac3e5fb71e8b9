"""How close should two floating-point answers be? Bounds from the arithmetic.

Every check in this course compares a distributed result with a
single-process reference: DDP's averaged gradients with one process on the
whole batch, a pipeline's gradients with the unsplit model, a ring all-reduce
with gloo's. In floating point they are rarely bit-equal, because the
distributed version adds the same numbers in another order (rank 0's half of
the batch, then rank 1's; gloo's tree; a kernel that blocks the reduction
differently on AVX2 than on AVX-512). A tolerance typed in after one run
("1e-6 passed here") fails on the next machine. The bounds here come from
the arithmetic instead, in two forms:

* **A sum whose terms we know.** Recursive summation of n numbers in a
  format with unit roundoff u = eps / 2 is off from the exact sum by at most
  gamma(n-1) * sum |x_i|, gamma(k) = k u / (1 - k u), in *any* order
  (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002,
  Lemma 3.1 for gamma, sec. 4.2 for the bound). Two orders of the same sum are
  each that close to the exact one, so they differ by at most twice that:
  `reorder_bound`.

* **A whole computation** (a model's forward and backward, a few optimizer
  steps), where nobody wants to carry sum |terms| through every layer. Run
  the single-process reference twice, in float32 and in float64. The float64
  run is the exact answer to ~1e-16; the float32 run's distance from it is
  the rounding noise of *this* computation on *this* machine's kernels. The
  distributed float32 run differs from the float32 reference only in the
  order of its sums, so its distance from float64 is rounding noise of the
  same size: `within_fp32_noise` allows `NOISE_FACTOR` times the measured
  noise. Measured in the same run, the bound moves with the machine: it is
  larger where the kernels round more, smaller where they round less.

Where the arithmetic is identical (same operations, same order, same
shapes), the answer is bit-equal and tests use ``torch.equal``; a tolerance
there would hide a real difference.

Cost: the float64 reference doubles the reference's time (it is the tiny
model on one process). Production test suites do the same thing in other
forms: PyTorch's ``torch.testing.assert_close`` picks default tolerances per
dtype, and its distributed tests compare against a single-process run with
tolerances chosen per test; Megatron-LM's functional tests compare loss
curves against golden values recorded per GPU type.
"""

from __future__ import annotations

import torch

__all__ = ["NOISE_FACTOR", "unit_roundoff", "gamma", "sum_bound", "reorder_bound",
           "fp32_noise", "within_fp32_noise", "assert_within_fp32_noise", "max_abs"]

# Two float32 evaluations of the same computation in different orders carry
# rounding errors of the same size (each a sum of many roundings of the same
# magnitudes); their largest entries agree within a small factor. 8 leaves
# room for that, while every mistake the checks look for (a missing or a
# doubled average, a stale or a lost gradient, a wrong chunk) moves a result
# by 1e-3 of its size or more: thousands of times this noise.
NOISE_FACTOR = 8.0


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps / 2: the largest relative error of one rounding (2^-24 for fp32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma(n) = n u / (1 - n u): the relative error of n successive roundings
    (Higham 2002, Lemma 3.1). Valid while n u < 1."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) is undefined for {dtype}: n * u = {nu:.3g} >= 1")
    return nu / (1 - nu)


def sum_bound(abs_sum, n: int, dtype: torch.dtype = torch.float32):
    """Largest error of a float sum of ``n`` terms whose absolute values add up
    to ``abs_sum``, in any order: gamma(n-1) * sum|x_i| (Higham 2002, sec. 4.2).
    ``abs_sum`` may be a tensor (one bound per entry)."""
    return gamma(max(n - 1, 0), dtype) * abs_sum


def reorder_bound(abs_sum, n: int, dtype: torch.dtype = torch.float32):
    """Largest difference between two orders of the same float sum of ``n``
    terms: each is within `sum_bound` of the exact sum."""
    return 2 * sum_bound(abs_sum, n, dtype)


def max_abs(t: torch.Tensor) -> float:
    """Largest |entry| as a Python float (0.0 for an empty tensor)."""
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def fp32_noise(ref32: torch.Tensor, ref64: torch.Tensor) -> float:
    """The rounding noise of a float32 computation, measured: the largest
    distance of its float32 result from its float64 one, plus one ulp of the
    largest entry (a float32 result cannot be closer than half an ulp, and a
    lucky reference whose noise happens to be tiny must not make the bound
    tighter than that)."""
    eps = torch.finfo(torch.float32).eps
    return max_abs(ref32.double() - ref64.double()) + eps * max_abs(ref64)


def within_fp32_noise(got: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor,
                      factor: float = NOISE_FACTOR) -> tuple[bool, float, float]:
    """Is ``got`` (a float32 result computed in another order) as close to the
    float64 reference as float32 rounding allows? Returns (ok, error, bound)
    with error = max |got - ref64| and bound = factor * fp32_noise(ref32, ref64)."""
    if got.shape != ref64.shape:
        return False, float("inf"), 0.0
    err = max_abs(got.double() - ref64.double())
    bound = factor * fp32_noise(ref32, ref64)
    return err <= bound, err, bound


def assert_within_fp32_noise(got, ref32, ref64, what: str = "", factor: float = NOISE_FACTOR):
    """`within_fp32_noise` as an assertion whose message gives both numbers.
    Accepts tensors, Python floats, or dicts of them (keys of ``ref64``)."""
    if isinstance(ref64, dict):
        for k in ref64:
            assert_within_fp32_noise(got[k], ref32[k], ref64[k], f"{what}[{k}]", factor)
        return
    got, ref32, ref64 = (torch.as_tensor(v) for v in (got, ref32, ref64))
    ok, err, bound = within_fp32_noise(got, ref32, ref64, factor)
    assert ok, (f"{what}: off from the float64 reference by {err:.3g}, more than "
                f"{factor:g} x the float32 reference's own rounding noise ({bound:.3g})")
