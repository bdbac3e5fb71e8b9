"""Fewer bits per number: loss scaling for fp16, FP8 with delayed scaling.

Precision is the other compute-for-memory trade of chapter 13. Halving the
bits halves the bytes of every stored activation and doubles (fp16/bf16 vs
fp32) or quadruples (FP8) the tensor-core FLOP rate, at the price of range
and resolution.

fp16 and loss scaling (Micikevicius et al. 2018, "Mixed Precision
Training", sec. 3.2). fp16's smallest subnormal is 2^-24 (about 6e-8); small
gradients fall below it and become exactly 0. Multiplying the loss by S
multiplies every gradient by S (backward is linear), lifting them into range;
the optimizer divides by S again in fp32. The paper also skips the update
when a gradient overflows; the *dynamic* schedule that picks S on line (used
by NVIDIA's mixed-precision tooling and ``torch.amp.GradScaler``) is:

    a step with an inf/nan gradient   skip the update, S *= backoff (0.5), reset counter
    ``growth_interval`` clean steps    S *= growth (2.0)

``DynamicLossScaler`` makes exactly the decisions of ``torch.amp.GradScaler``
(tests compare the two on the same finite/non-finite sequence). bf16 keeps
fp32's 8 exponent bits, so it needs no scaling; that is why it won.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", sec. 3,
Table 1): two formats of one byte,

    E4M3  4 exponent, 3 mantissa bits, max 448     weights and activations (forward)
    E5M2  5 exponent, 2 mantissa bits, max 57344   gradients (backward: range over precision)

Eight bits hold too little range for raw tensors, so each tensor gets a
scale (the paper's sec. 2 leaves how to pick it to software): x8 =
cast(x * scale), x ~ x8 / scale, with scale = fp8_max / amax so the largest
magnitude lands at the top of the format. Computing amax needs a pass over
the tensor before casting it; *delayed scaling* (NVIDIA Transformer Engine's
default ``DelayedScaling`` recipe) instead uses the amax of *previous* steps,
kept in a short history:

    scale_t = fp8_max / max(amax_history) / 2^margin     (algo "max")
    scale_t = fp8_max / amax_{t-1} / 2^margin           (algo "most_recent")

and records this step's amax into the history afterwards. A spike larger
than the history saturates (clamps to +-fp8_max) for one step.

``FP8Linear`` quantizes input and weight to E4M3 and the output gradient to
E5M2 and runs all three GEMMs (forward, grad input, grad weight) through
``torch._scaled_mm``, which multiplies FP8 operands, accumulates in fp32 and
applies the two dequantization scales. It keeps the FP8 copies of input and
weight for backward, so its saved activations are 1 byte per element.
Where ``_scaled_mm`` is not available the same quantization feeds an fp32
matmul of the dequantized operands (the emulation). ``FP8_GEMM`` counts
which path ran, so tests and notebooks can show it rather than assume it.

``_scaled_mm``'s contract differs by device. The CPU kernel takes any
shapes and strides. cuBLASLt (CUDA, compute capability 8.9+: Ada, Hopper)
wants the first operand row-major, the second column-major, both inner
dimension K and output width N multiples of 16, at most one operand in
E5M2, and per-tensor scales as fp32 one-element tensors on the device
(``torch/_meta_registrations.py`` spells these checks out). ``fp8_gemm``
meets that contract on every device: it zero-pads K and N up to multiples of
16 (zeros add nothing to a dot product, so the result is exact) and slices
the padding off the output. In a training step the token count is the inner
dimension of the weight-gradient GEMM, so any batch x sequence not divisible
by 16 needs the padding.

How production differs: Transformer Engine fuses amax, cast and transpose
into one kernel, reduces amax across tensor/data-parallel ranks so all ranks
use one scale, keeps the master weights in higher precision and, newer,
scales per block (MXFP8) instead of per tensor. The private
``torch._scaled_mm`` is what torchao's float8 training calls underneath.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.recompute import forward_state

__all__ = ["DynamicLossScaler", "E4M3", "E5M2", "FP8_MAX", "fp8_scale", "quantize",
           "block_quantize", "block_dequantize", "mx_quantize", "tile_quantize", "all_reduce_amax",
           "dequantize", "fp8_round_trip", "update_delayed_scale", "DelayedScaling",
           "FP8Linear", "swap_to_fp8", "FP8SavedTensors", "scaled_mm_available", "fp8_gemm",
           "FP8_GEMM", "train_fp16"]


# ---------------------------------------------------------------------------
# fp16: dynamic loss scaling
# ---------------------------------------------------------------------------

def _f32(x: float) -> float:
    """Round to fp32: GradScaler keeps its scale in an fp32 tensor; so do we, in effect."""
    return float(torch.tensor(x, dtype=torch.float32))


class DynamicLossScaler:
    """Loss scaling (Micikevicius et al. 2018, sec. 3.2) with GradScaler's dynamic schedule.

        loss_scaled = scaler.scale(loss); loss_scaled.backward()
        stepped = scaler.step(optimizer, params)   # unscale, skip on inf/nan
        scaler.update()                            # grow or back off the scale

    With an fp16 model and fp32 master weights (the optimizer's), pass both:
    ``scaler.step(optimizer, fp16_params, master_params)`` unscales each fp16
    gradient in fp32 into its master's ``.grad``.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale_value = _f32(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0          # consecutive steps without inf/nan ("growth tracker")
        self.found_inf: bool | None = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, params: Iterable[torch.Tensor],
                 master_params: Iterable[torch.Tensor] | None = None) -> bool:
        """Divide every gradient by the scale, in fp32; True if any is inf/nan.

        fp32 gradients are unscaled in place. An fp16/bf16 gradient cannot
        hold the unscaled value: the small gradients that scaling lifted into
        fp16's range would fall out of it again (below 2^-24 they flush to
        0). So it is unscaled in fp32 into the ``.grad`` of its fp32 master
        parameter (``master_params``, same order), the mixed-precision recipe
        (Micikevicius et al. 2018, sec. 3.1); without master parameters it is
        refused, as ``torch.amp.GradScaler`` refuses to unscale fp16 gradients.
        """
        params = list(params)
        masters = None if master_params is None else list(master_params)
        if masters is not None and len(masters) != len(params):
            raise ValueError(f"{len(params)} parameters but {len(masters)} master parameters")
        inv = _f32(1.0 / self.scale_value)   # GradScaler: an fp32 reciprocal of the scale
        found = False
        for i, p in enumerate(params):
            if p.grad is None:
                continue
            found |= not bool(torch.isfinite(p.grad).all())
            if p.grad.dtype == torch.float32 and masters is None:
                p.grad.mul_(inv)
                continue
            if masters is None:
                raise ValueError(f"parameter {i} has a {p.grad.dtype} gradient: unscaled in "
                                 f"its own dtype its small entries underflow again; pass fp32 "
                                 f"master_params to receive the unscaled gradients")
            m = masters[i]
            if m.dtype != torch.float32 or m.shape != p.shape:
                raise ValueError(f"master parameter {i} must be float32 of shape "
                                 f"{tuple(p.shape)}, got {m.dtype} {tuple(m.shape)}")
            m.grad = p.grad.float().mul_(inv)   # widen first, then divide: exact widening
        self.found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
             master_params: Iterable[torch.Tensor] | None = None) -> bool:
        """Unscale (into ``master_params`` if given, see ``unscale_``), then step
        unless a gradient overflowed. Returns whether it stepped."""
        if self.unscale_(params, master_params):
            return False
        optimizer.step()
        return True

    def update(self, found_inf: bool | None = None) -> float:
        """The scale rule. ``found_inf`` defaults to what the last unscale_ saw."""
        found = self.found_inf if found_inf is None else found_inf
        if found is None:
            raise ValueError("update() needs found_inf, or a preceding unscale_/step")
        if found:
            self.scale_value = _f32(self.scale_value * self.backoff_factor)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                grown = _f32(self.scale_value * self.growth_factor)
                if grown != float("inf"):     # never grow the scale itself to inf
                    self.scale_value = grown
                self.clean_steps = 0
        self.found_inf = None
        return self.scale_value


def train_fp16(model: nn.Module, batches, *, lr: float = 3e-3,
               scaler: DynamicLossScaler | None = None, loss_multiplier: float = 1.0):
    """Mixed-precision training by hand: fp16 copy for forward/backward, fp32 master
    weights for the update (Micikevicius et al. 2018, sec. 3.1).

    ``loss_multiplier`` shrinks the loss, and so every fp16 gradient, to build
    an underflow case on a toy model (our toy's gradients are far larger than
    a deep network's); the fp32 update divides it back out, so in exact
    arithmetic every multiplier trains identically and any difference is
    fp16's. Returns (losses, fraction of gradient entries exactly zero per
    step, scale used per step).
    """
    master = [p.detach().clone().float() for p in model.parameters()]
    half = model.half()
    opt = torch.optim.SGD(master, lr=lr)
    losses, zero_frac, scales = [], [], []
    for x, y in batches:
        for p, m in zip(half.parameters(), master):
            p.data.copy_(m)                                 # fp32 master -> fp16 working copy
            p.grad = None
        _, loss = half(x, y)
        losses.append(loss.item())
        small = loss.float() * loss_multiplier      # fp32 scalar; its gradient enters fp16
        (scaler.scale(small) if scaler else small).backward()
        grads = [p.grad for p in half.parameters()]
        zero_frac.append(sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads))
        for m, g in zip(master, grads):
            m.grad = g.float() / loss_multiplier            # unscale in fp32, not in fp16
        scales.append(scaler.scale_value if scaler else 1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt, master)                        # skips the step on inf/nan
            scaler.update()
    for p, m in zip(half.parameters(), master):
        p.data.copy_(m)
    return losses, zero_frac, scales


# ---------------------------------------------------------------------------
# FP8: formats, scales, delayed scaling
# ---------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn   # "fn": finite, no inf; max 448 (Micikevicius et al. 2022, Table 1)
E5M2 = torch.float8_e5m2     # IEEE-like, has inf; max 57344
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def _check_fp8(dtype) -> float:
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def fp8_scale(amax: float | torch.Tensor, dtype=E4M3, margin: int = 0) -> torch.Tensor:
    """scale = fp8_max / amax / 2^margin (1.0 when amax is 0 or not finite), fp32 scalar."""
    fmax = _check_fp8(dtype)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, fmax / amax / 2.0 ** margin, torch.ones_like(amax))


def quantize(x: torch.Tensor, dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """x * scale, clamped to the format's range (saturate, never inf), cast to FP8."""
    fmax = _check_fp8(dtype)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def dequantize(x8: torch.Tensor, scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x8.float() / scale).to(dtype)


def fp8_round_trip(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """Quantize with the tensor's own amax (current scaling) and back."""
    scale = fp8_scale(x.abs().max(), dtype)
    return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def update_delayed_scale(amax_history: torch.Tensor, new_amax, scale, *, fp8_max: float,
                         margin: int = 0, algo: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling step, as in Transformer Engine's ``DelayedScaling`` recipe
    (amax_history_len, amax_compute_algo "max" / "most_recent", margin). Pure function.

    amax_history: (H,) most recent first. Returns (history with ``new_amax``
    pushed in front and the oldest dropped, scale for the next step):
    fp8_max / amax / 2^margin where amax = max(history) ("max") or
    history[0] ("most_recent"). If that amax is 0 or not finite the previous
    ``scale`` is kept.
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    if amax_history.dim() != 1 or amax_history.numel() < 1:
        raise ValueError("amax_history must be a non-empty 1-D tensor")
    history = torch.roll(amax_history, 1)
    history[0] = torch.as_tensor(new_amax, dtype=history.dtype)
    amax = history.max() if algo == "max" else history[0]
    scale = torch.as_tensor(scale, dtype=torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    new_scale = torch.where(ok, fp8_max / amax.float() / 2.0 ** margin, scale)
    return history, new_scale


# --------------------------------------------------------------------------
# Finer scales: one per block instead of one per tensor.
# --------------------------------------------------------------------------
# A per-tensor scale is set by the tensor's largest value; one outlier channel
# then pushes every other value towards the bottom of the format. Block scaling
# gives each small block its own scale:
# * MXFP8 (OCP "Microscaling Formats (MX) Specification" v1.0, sec. 5-6): blocks
#   of 32 consecutive elements, a shared power-of-two scale (E8M0), chosen as
#   2^(floor(log2 amax) - emax_elem), emax_elem = 8 for E4M3; values between 448
#   and 512 after scaling saturate. Blackwell tensor cores consume it natively.
# * DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.3.2): activations in 1x128 tiles (per
#   token, per 128 channels), weights in 128x128 blocks, fp32 scales computed
#   online from each tile's amax (current scaling, no history).
# Here ``scale`` multiplies, as in ``fp8_scale``: x8 = quantize(x * scale).
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
    fmax = _check_fp8(dtype)
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


def all_reduce_amax(amax: torch.Tensor, group=None) -> torch.Tensor:
    """In place: the largest amax over the ranks of ``group`` (no-op on one rank).

    Transformer Engine reduces amaxes across the data- and tensor-parallel
    group (``reduce_amax``) so that every rank derives the same scale: under
    tensor parallelism the shards of one weight or activation then sit on one
    grid, and under data parallelism replicas quantize identically. One small
    all-reduce (MAX) per step for all amaxes together.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@dataclasses.dataclass
class DelayedScaling:
    """The scale of one tensor (e.g. a layer's input) across steps."""

    dtype: torch.dtype = E4M3
    history_len: int = 16
    margin: int = 0
    algo: str = "max"

    def __post_init__(self) -> None:
        _check_fp8(self.dtype)
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) \
                or self.history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {self.history_len!r}")
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {self.algo!r}")
        self.amax_history = torch.zeros(self.history_len)
        self.scale = torch.tensor(1.0)
        self.steps = 0

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast with the scale from earlier steps, then record this tensor's amax.

        First call: no history yet, so the tensor's own amax sets the scale
        (Transformer Engine instead starts at scale 1 and lets the first step
        saturate). With ``scale`` given, as when a recompute replays an
        earlier forward, cast with it and record nothing: the history
        advances once per pass, not once more per recompute.
        Returns (x8, the scale used)."""
        if scale is not None:
            return quantize(x.detach(), self.dtype, scale.to(x.device)), scale
        amax = x.detach().abs().max().float().cpu()
        if self.steps == 0:
            self.scale = fp8_scale(amax, self.dtype, self.margin)
        scale = self.scale
        x8 = quantize(x.detach(), self.dtype, scale.to(x.device))
        self.amax_history, self.scale = update_delayed_scale(
            self.amax_history, amax, self.scale, fp8_max=FP8_MAX[self.dtype],
            margin=self.margin, algo=self.algo)
        self.steps += 1
        return x8, scale


# ---------------------------------------------------------------------------
# FP8 GEMMs
# ---------------------------------------------------------------------------

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
    capability 8.9), and ``fp8_gemm`` then emulates there."""
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
        FP8_GEMM["emulated"] += 1
        return ((a8.float() * inv_a) @ (b8.float() * inv_b)).to(out_dtype)
    (m, k), n = a8.shape, b8.size(1)
    kp, np_ = _round_up(k), _round_up(n)
    a = _row_major_padded(a8, m, kp)                       # (M, Kp) row-major
    b = _row_major_padded(b8.t(), np_, kp).t()             # (Kp, Np) column-major
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)  # (M, Np)
    FP8_GEMM["scaled_mm"] += 1
    if (kp, np_) != (k, n):
        FP8_GEMM["padded"] += 1
        out = out[:, :n].contiguous()                      # drop the zero columns
    return out


class _FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with FP8 GEMMs in both directions: E4M3 x and W forward, E5M2
    output gradient backward (the split Micikevicius et al. 2022, sec. 3, recommend)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer: "FP8Linear"):
        out_dtype = x.dtype
        x2 = x.reshape(-1, x.size(-1))                                  # (M, K)
        x8, sx, w8, sw = layer.quantize_operands(x2, weight)             # E4M3, w8 (N, K)
        y = fp8_gemm(x8, w8.t(), sx, sw, out_dtype)                      # (M, N)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(x8, w8, sx, sw)   # FP8 copies: 1 byte per saved element
        ctx.layer, ctx.x_shape, ctx.has_bias = layer, x.shape, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype)
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x8, w8, sx, sw = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.size(-1))                     # (M, N)
        g8, sg = ctx.layer.grad_scaling.quantize(g2)                     # E5M2
        grad_x = fp8_gemm(g8, w8, sg, sw, ctx.dtypes[0])                 # (M,N)@(N,K)
        grad_w = fp8_gemm(g8.t(), x8, sg, sx, ctx.dtypes[1])            # (N,M)@(M,K)
        grad_b = g2.sum(0) if ctx.has_bias else None                    # high precision
        return grad_x.reshape(ctx.x_shape), grad_w, grad_b, None


class FP8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 with delayed per-tensor scaling.

    The parameters stay in their dtype (the "master" copy); each step
    quantizes them. In eval mode or with grad disabled it runs the same FP8
    forward. ``history_len``, ``margin`` and ``algo`` go to every scaling.

    Under activation recompute (``helpers.recompute``) the recomputed forward
    reuses the scales of the forward it replays and records no amax, as
    Transformer Engine's checkpoint does: the same FP8 operands, so the same
    gradients as without recompute, and each scaling history advances once
    per forward/backward pass.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 history_len: int = 16, margin: int = 0, algo: str = "max",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.input_scaling = DelayedScaling(E4M3, history_len, margin, algo)
        self.weight_scaling = DelayedScaling(E4M3, history_len, margin, algo)
        self.grad_scaling = DelayedScaling(E5M2, history_len, margin, algo)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "FP8Linear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        new.weight, new.bias = linear.weight, linear.bias     # share, don't copy
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self)

    def quantize_operands(self, x2: torch.Tensor, weight: torch.Tensor):
        """(x8, sx, w8, sw): input and weight in E4M3 with their scales.

        In a checkpointed segment's first forward, remember the scales used
        (one entry per call: a layer may run more than once in a segment); in
        its recompute, take them back in the same order instead of the
        current ones, and record nothing."""
        state = forward_state()
        replayed = state[1][id(self)].pop(0) if state and state[0] == "replay" else (None, None)
        x8, sx = self.input_scaling.quantize(x2, replayed[0])
        w8, sw = self.weight_scaling.quantize(weight, replayed[1])
        if state and state[0] == "record":
            state[1].setdefault(id(self), []).append((sx, sw))
        return x8, sx, w8, sw


def swap_to_fp8(model: nn.Module, skip: Iterable[str] = ("lm_head",), **kwargs) -> nn.Module:
    """Replace every nn.Linear (except names in ``skip``) by an FP8Linear, in place.

    The output layer is skipped by default: its weight is tied to the
    embedding, and the logits are the most precision-sensitive GEMM (common
    practice, e.g. in torchao's float8 recipes). Only nn.Linear layers change:
    matmuls of two activations (attention's q k^T and att @ v) have no weight
    and stay in the model's dtype, as Transformer Engine does by default
    (its FP8 attention, the recipe's ``fp8_dpa``, is opt-in).
    In our GPT that leaves four FP8 linears per block (attn.c_attn,
    attn.c_proj, mlp.c_fc, mlp.c_proj), three FP8 GEMMs each per step.
    """
    skip = set(skip)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and full not in skip and child_name not in skip:
                setattr(module, child_name, FP8Linear.from_linear(child, **kwargs))
    return model


class FP8SavedTensors:
    """Saved-tensor hooks that keep activations in FP8 (E4M3, current per-tensor scale).

        store = FP8SavedTensors()
        apply_recompute(model, "full", saved_tensor_hooks=store.hooks)

    Only floating tensors are converted; ``stored_bytes`` / ``original_bytes``
    count what was kept. With full recompute the only saved tensors are the
    block inputs, so the checkpoints cost 1 byte per element instead of 2-4,
    at the price of rounding the input of every recomputed block.
    """

    def __init__(self, dtype=E4M3):
        _check_fp8(dtype)
        self.dtype = dtype
        self.stored_bytes = 0
        self.original_bytes = 0

    def pack(self, t: torch.Tensor):
        if not t.is_floating_point() or t.numel() == 0:
            return t
        scale = fp8_scale(t.detach().abs().max().float().cpu(), self.dtype).to(t.device)
        x8 = quantize(t.detach(), self.dtype, scale)
        self.stored_bytes += x8.numel() * x8.element_size()
        self.original_bytes += t.numel() * t.element_size()
        return (x8, scale, t.dtype)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, tuple):
            x8, scale, dtype = packed
            return dequantize(x8, scale, dtype)
        return packed

    @property
    def hooks(self):
        return (self.pack, self.unpack)
