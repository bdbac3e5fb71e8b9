"""FP8 training of nn.Linear: three FP8 GEMMs with delayed per-tensor scaling.

``FP8Linear`` quantizes input and weight to E4M3 and the output gradient to
E5M2 and runs all three GEMMs (forward, grad input, grad weight) through
``torch._scaled_mm``, which multiplies FP8 operands, accumulates in fp32 and
applies the two dequantization scales. It keeps the FP8 copies of input and
weight for backward, so its saved activations are 1 byte per element.
The GEMMs are ``scaled_mm.fp8_gemm``, the scales ``fp8.DelayedScaling``: the
split of Micikevicius et al. 2022 (sec. 3), which Transformer Engine's
``te.Linear`` uses under its ``DelayedScaling`` recipe (``Format.HYBRID`` by default:
E4M3 forward, E5M2 backward), the default recipe on Hopper and Ada GPUs
(``get_default_fp8_recipe`` in Transformer Engine v2.18; MXFP8 block scaling on
compute capability 10.x, per-tensor current scaling on 12.0 and later).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from helpers.precision.fp8 import E4M3, E5M2, DelayedScaling
from helpers.precision.scaled_mm import fp8_gemm
from helpers.recompute import forward_state

__all__ = ["FP8Linear", "swap_to_fp8"]


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
    forward. ``history_len``, ``margin`` and ``algo`` go to every scaling;
    ``fused=True`` casts each operand and takes its amax in one compiled kernel
    (``helpers.precision.fp8.cast_and_amax``): the same bits, less memory traffic.

    Under activation recompute (``helpers.recompute``) the recomputed forward
    reuses the scales of the forward it replays and records no amax, as
    Transformer Engine's checkpoint does: the same FP8 operands, so the same
    gradients as without recompute, and each scaling history advances once
    per forward/backward pass.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 history_len: int = 16, margin: int = 0, algo: str = "max",
                 fused: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        # the scaling state lives beside the weight, so a GPU step never copies it
        self.input_scaling = DelayedScaling(E4M3, history_len, margin, algo, device, fused)
        self.weight_scaling = DelayedScaling(E4M3, history_len, margin, algo, device, fused)
        self.grad_scaling = DelayedScaling(E5M2, history_len, margin, algo, device, fused)

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
