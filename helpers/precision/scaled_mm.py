"""The FP8 GEMM: ``torch._scaled_mm`` where it runs, an fp32 emulation elsewhere.

``fp8_gemm`` runs ``torch._scaled_mm``, which multiplies FP8 operands,
accumulates in fp32 and applies the two dequantization scales. Where
``_scaled_mm`` is not available the same quantization feeds an fp32 matmul of
the dequantized operands (the emulation). ``FP8_GEMM`` counts which path ran,
so tests and notebooks can show it rather than assume it.

``_scaled_mm``'s contract differs by device. The CPU kernel takes any shapes
and strides. cuBLASLt (CUDA, compute capability 8.9+: Ada, Hopper) wants the
first operand row-major, the second column-major, both inner dimension K and
output width N multiples of 16, at most one operand in E5M2, and per-tensor
scales as fp32 one-element tensors on the device
(``torch/_meta_registrations.py`` of torch 2.13, the tested build, spells
these checks out). ``fp8_gemm`` meets that contract on every device: it
zero-pads K and N up to multiples of 16 (zeros add nothing to a dot product,
so the result is exact) and slices the padding off the output. In a training
step the token count is the inner dimension of the weight-gradient GEMM, so
any batch x sequence not divisible by 16 needs the padding.
"""

from __future__ import annotations

import collections

import torch

from helpers.precision.fp8 import E4M3, FP8_MAX

__all__ = ["FP8_GEMM", "scaled_mm_available", "fp8_gemm"]

_SCALED_MM_OK: dict[str, bool] = {}

# Which path each fp8_gemm call took, counted since import (``FP8_GEMM.clear()``
# to start over): "scaled_mm" (torch._scaled_mm ran), "emulated" (fp32 matmul of
# the dequantized operands), and "padded" (of the scaled_mm calls, those whose
# K or N had to be zero-padded to a multiple of 16). An observable record, so a
# test can assert that the FP8 kernel ran instead of trusting a probe.
FP8_GEMM: collections.Counter = collections.Counter()

_ALIGN = 16   # cuBLASLt FP8 GEMMs: K and N multiples of 16 (16 bytes of FP8)


def scaled_mm_available(device: torch.device | str = "cpu") -> bool:
    """Does this build run torch._scaled_mm with FP8 inputs on ``device``? (cached probe)

    On CUDA the probe fails on GPUs without FP8 tensor cores (before compute
    capability 8.9), and ``fp8_gemm`` then emulates there. On CPU, torch's FP8 kernel
    is oneDNN's, which runs only where the CPU has AVX512-FP16 or AMX (Intel Sapphire
    Rapids and later); elsewhere the probe fails and ``fp8_gemm`` emulates."""
    key = torch.device(device).type
    if key not in _SCALED_MM_OK:
        try:
            a = torch.zeros(_ALIGN, _ALIGN, device=device).to(E4M3)
            one = torch.tensor(1.0, device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _SCALED_MM_OK[key] = True
        except (RuntimeError, AttributeError, NotImplementedError):
            _SCALED_MM_OK[key] = False
    return _SCALED_MM_OK[key]


def _emulated(a8, b8, inv_a, inv_b, out_dtype) -> torch.Tensor:
    """The same product in fp32: FP8 values are exact in fp32, and so are their products."""
    FP8_GEMM["emulated"] += 1
    return ((a8.float() * inv_a) @ (b8.float() * inv_b)).to(out_dtype)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _row_major_padded(x8: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x8 (r, c) as a contiguous (rows, cols) tensor, zeros in the new rows/columns."""
    if x8.shape == (rows, cols):
        return x8.contiguous()
    return torch.nn.functional.pad(x8, (0, cols - x8.size(1), 0, rows - x8.size(0)))


def fp8_gemm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 / scale_a) @ (b8 / scale_b) for a8 (M, K), b8 (K, N), FP8; fp32 accumulation.

    ``_scaled_mm`` takes *dequantization* factors (it multiplies), hence the
    reciprocals, as fp32 scalars on the operands' device. Operands are laid
    out and padded for cuBLAS on every device (module docstring), so the CPU
    tests exercise the same code a GPU runs: a (M, Kp) row-major, b (Kp, Np)
    column-major, Kp and Np the next multiples of 16; M needs no padding.
    """
    if a8.dim() != 2 or b8.dim() != 2 or a8.size(1) != b8.size(0):
        raise ValueError(f"fp8_gemm multiplies (M, K) by (K, N); got {tuple(a8.shape)} and "
                         f"{tuple(b8.shape)}")
    if a8.dtype not in FP8_MAX or b8.dtype not in FP8_MAX:
        raise ValueError(f"fp8_gemm takes FP8 operands (quantize them first), got {a8.dtype} "
                         f"and {b8.dtype}")
    inv_a = (1.0 / scale_a).float().reshape(()).to(a8.device)
    inv_b = (1.0 / scale_b).float().reshape(()).to(a8.device)
    if not scaled_mm_available(a8.device):
        return _emulated(a8, b8, inv_a, inv_b, out_dtype)
    (m, k), n = a8.shape, b8.size(1)
    kp, np_ = _round_up(k), _round_up(n)
    a = _row_major_padded(a8, m, kp)                       # (M, Kp) row-major
    b = _row_major_padded(b8.t(), np_, kp).t()             # (Kp, Np) column-major
    try:
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)  # (M, Np)
    except RuntimeError:
        # On CPU the FP8 kernel is oneDNN's, which needs AVX512-FP16 (or AMX): an AVX2-only
        # x86 laptop, an AMD Zen 4 or an ARM CPU refuses it ("could not create a primitive
        # descriptor"), whatever the probe saw. Emulate from now on; on a GPU an error is
        # a real one and is raised.
        if a8.device.type != "cpu":
            raise
        _SCALED_MM_OK["cpu"] = False
        return _emulated(a8, b8, inv_a, inv_b, out_dtype)
    FP8_GEMM["scaled_mm"] += 1
    if (kp, np_) != (k, n):
        FP8_GEMM["padded"] += 1
        out = out[:, :n].contiguous()                      # drop the zero columns
    return out
