"""Activations stored in FP8: saved-tensor hooks that quantize what backward keeps.

``FP8SavedTensors`` gives a (pack, unpack) pair for PyTorch's saved-tensor
hooks (``torch.autograd.graph.saved_tensors_hooks``, which
``helpers.recompute.apply_recompute`` installs around each checkpoint): pack
stores a tensor in E4M3 with its current per-tensor scale (``fp8.fp8_scale``),
unpack hands backward the dequantized tensor.
"""

from __future__ import annotations

import torch

from helpers.precision.fp8 import E4M3, check_fp8, dequantize, fp8_scale, quantize

__all__ = ["FP8SavedTensors"]


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
        check_fp8(dtype)
        self.dtype = dtype
        self.stored_bytes = 0
        self.original_bytes = 0

    def pack(self, t: torch.Tensor):
        if not t.is_floating_point() or t.numel() == 0:
            return t
        scale = fp8_scale(t.detach().abs().amax().float(), self.dtype)  # on t.device: no host sync
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
