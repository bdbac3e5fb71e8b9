"""Fewer bits per number: loss scaling for fp16, FP8 with delayed scaling.

Precision is the other compute-for-memory trade of chapter 13. Halving the
bits halves the bytes of every stored activation and doubles (fp16/bf16 vs
fp32) or quadruples (FP8) the tensor-core FLOP rate, at the price of range
and resolution.

Where to read what (each module stands on its own)
--------------------------------------------------
* ``loss_scaling.py``: fp16 with dynamic loss scaling (Micikevicius et al.
  2018, sec. 3), ``DynamicLossScaler`` == ``torch.amp.GradScaler``.
* ``fp8.py``: the two FP8 formats (Micikevicius et al. 2022), per-tensor
  current and delayed scaling (Transformer Engine's ``DelayedScaling``),
  the amax all-reduce.
* ``block_scaling.py``: one scale per block, MXFP8 (OCP MX v1.0) and
  DeepSeek-V3's tiles.
* ``scaled_mm.py``: the FP8 GEMM, ``torch._scaled_mm`` or its emulation.
* ``fp8_linear.py``: ``FP8Linear``, an nn.Linear whose three GEMMs run in FP8.
* ``saved_tensors.py``: ``FP8SavedTensors``, activations kept in FP8.

How production differs: Transformer Engine fuses amax, cast and transpose
into one kernel, reduces amax across tensor/data-parallel ranks so all ranks
use one scale, keeps the master weights in higher precision and, newer,
scales per block (MXFP8) instead of per tensor. The private
``torch._scaled_mm`` is what torchao's float8 training calls underneath.
"""

from helpers.precision.block_scaling import (FP8_EMAX, block_dequantize, block_quantize,
                                             mx_quantize, tile_quantize)
from helpers.precision.fp8 import (E4M3, E5M2, FP8_MAX, DelayedScaling, all_reduce_amax, cast_and_amax,
                                   dequantize, fp8_round_trip, fp8_scale, quantize,
                                   update_delayed_scale)
from helpers.precision.fp8_linear import FP8Linear, swap_to_fp8
from helpers.precision.loss_scaling import DynamicLossScaler, train_fp16
from helpers.precision.saved_tensors import FP8SavedTensors
from helpers.precision.scaled_mm import FP8_GEMM, fp8_gemm, scaled_mm_available

__all__ = ["DynamicLossScaler", "train_fp16",
           "E4M3", "E5M2", "FP8_MAX", "fp8_scale", "quantize", "dequantize", "fp8_round_trip",
           "update_delayed_scale", "cast_and_amax", "DelayedScaling", "all_reduce_amax",
           "FP8_EMAX", "block_quantize", "block_dequantize", "mx_quantize", "tile_quantize",
           "FP8_GEMM", "scaled_mm_available", "fp8_gemm",
           "FP8Linear", "swap_to_fp8", "FP8SavedTensors"]
