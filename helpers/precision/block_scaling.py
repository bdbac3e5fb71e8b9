"""Finer scales: one per block instead of one per tensor (MXFP8, DeepSeek-V3 tiles).

A per-tensor scale is set by the tensor's largest value; one outlier channel
then pushes every other value towards the bottom of the format. Block scaling
gives each small block its own scale:

* MXFP8 (OCP "Microscaling Formats (MX) Specification" v1.0, sec. 5-6): blocks
  of 32 consecutive elements, a shared power-of-two scale (E8M0), chosen as
  2^(floor(log2 amax) - emax_elem), emax_elem = 8 for E4M3; values between 448
  and 512 after scaling saturate. Blackwell tensor cores consume it natively.
* DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.3.2): activations in 1x128 tiles (per
  token, per 128 channels), weights in 128x128 blocks, fp32 scales computed
  online from each tile's amax (current scaling, no history).

Here ``scale`` multiplies, as in ``fp8_scale``: x8 = quantize(x * scale).
"""

from __future__ import annotations

import torch

from helpers.precision.fp8 import E4M3, E5M2, check_fp8

__all__ = ["FP8_EMAX", "block_quantize", "block_dequantize", "mx_quantize", "tile_quantize"]

FP8_EMAX = {E4M3: 8, E5M2: 15}  # exponent of the largest normal: 448 = 1.75 * 2^8


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(R, C) -> (R/br, C/bc, br, bc) view of the blocks; refuses shapes that do not divide."""
    if x.dim() != 2:
        raise ValueError(f"block scaling takes a 2-D tensor (rows, cols), got shape {tuple(x.shape)}")
    (R, C), (br, bc) = x.shape, block
    if br < 1 or bc < 1 or R % br or C % bc:
        raise ValueError(f"a tensor of shape {(R, C)} does not divide into {br}x{bc} blocks; "
                         f"pad it to multiples of {(br, bc)} first")
    return x.reshape(R // br, br, C // bc, bc).transpose(1, 2)


def block_quantize(x: torch.Tensor, dtype=E4M3, block: tuple[int, int] = (1, 32),
                   power_of_two: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor with one scale per ``block``; returns (x8, scales).

    x8 has x's shape; scales has shape (R/br, C/bc), fp32. ``power_of_two=True``
    gives MX scales (``mx_quantize``); False gives fp8_max/amax per block as
    DeepSeek-V3 does (``tile_quantize``). A block of zeros gets scale 1.
    Each block is quantized exactly as ``quantize(block, dtype, its scale)``.
    """
    fmax = check_fp8(dtype)
    b = _blocks(x.float(), block)                       # (R/br, C/bc, br, bc)
    amax = b.abs().amax(dim=(-2, -1))                   # (R/br, C/bc)
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, torch.ones_like(amax))
    if power_of_two:  # 2^-(floor(log2 amax) - emax): the MX shared exponent, negated
        scales = torch.exp2(FP8_EMAX[dtype] - torch.floor(torch.log2(safe)))
    else:
        scales = fmax / safe
    scales = torch.where(ok, scales, torch.ones_like(scales))
    q = (b * scales[..., None, None]).clamp(-fmax, fmax).to(dtype)
    R, C = x.shape
    return q.transpose(1, 2).reshape(R, C), scales


def block_dequantize(x8: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (1, 32),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``block_quantize``: each block divided by its scale."""
    b = _blocks(x8.float(), block)
    R, C = x8.shape
    return (b / scales[..., None, None]).transpose(1, 2).reshape(R, C).to(dtype)


def mx_quantize(x: torch.Tensor, dtype=E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8: 1x32 blocks along the last dimension, power-of-two (E8M0) scales."""
    return block_quantize(x, dtype, (1, 32), power_of_two=True)


def tile_quantize(x: torch.Tensor, dtype=E4M3, weight: bool = False):
    """DeepSeek-V3's tiles: 1x128 for activations, 128x128 for weights, fp32 scales."""
    return block_quantize(x, dtype, (128, 128) if weight else (1, 128), power_of_two=False)
