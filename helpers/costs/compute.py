"""FLOPs of a training step and the seconds they take: compute and the pipeline bubble.

    model FLOPs      3 forward passes (forward + a backward of twice its cost) of
                     ``ModelSpec.forward_flops_per_token`` per token: 6 N_active +
                     12 l h s, the attention matmuls counted over the full s x s
                     square as the papers do (Kaplan et al. 2020, sec. 2.1;
                     Narayanan et al. 2021, sec. 5.1)
    hardware FLOPs   what the GPUs execute: full recompute re-runs each layer's
                     forward (4 passes for the layers, 3 for the output layer:
                     Narayanan et al. 2021, eq. 3); selective re-runs the attention
                     scores and their product with V, 4 s h per token per layer
                     (Korthikanti et al. 2022, sec. 5)
    compute          hardware FLOPs spread evenly over every GPU, at an achieved
                     rate (peak x matmul efficiency, or an assumed MFU)
    bubble           fill and drain of the pipeline: (p-1)/(v m + p-1) of the step
                     (chapter 12's ``bubble_formula``), so compute x (p-1)/(v m)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from helpers.pipeline.simulate import bubble_formula

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["flops_per_token", "model_flops_per_step", "hardware_flops_per_step",
           "recompute_factor", "compute_time", "bubble_time"]


def flops_per_token(model: "ModelSpec") -> float:
    """Training FLOPs per token without recompute: three forward passes, 6 N_active +
    12 l h s (for a GPT with tied embeddings, N = 12 l h^2 + V h, this is Narayanan
    et al. 2021 eq. 3 divided by B s tokens, with 3/4 of their 96). The input
    embedding is a lookup, not a matmul: an untied input matrix is not counted."""
    return 3 * model.forward_flops_per_token()


def model_flops_per_step(model: "ModelSpec", global_batch: int) -> float:
    """Forward + backward FLOPs of one step of ``global_batch`` sequences, no recompute."""
    return flops_per_token(model) * model.seq * global_batch


@functools.lru_cache(maxsize=None)
def hardware_flops_per_step(model: "ModelSpec", global_batch: int, recompute: str) -> float:
    """What the GPUs execute: full recompute re-runs each layer's forward (Narayanan
    et al. 2021, sec. 5.1: 4 passes for the layers, 3 for the output layer);
    selective re-runs only the attention scores and their product with V
    (Korthikanti et al. 2022, sec. 5: 4 s h FLOPs per token per layer)."""
    tokens = model.seq * global_batch
    extra = 0.0
    if recompute == "full":
        extra = model.forward_flops_per_token() - 2 * model.hidden * model.vocab
    elif recompute == "selective":
        extra = 4 * model.seq * model.hidden * model.layers
    return model_flops_per_step(model, global_batch) + extra * tokens


def recompute_factor(model: "ModelSpec", recompute: str) -> float:
    """Executed FLOPs / model FLOPs: 1 without recompute, below 4/3 with full (the
    output layer is not re-run)."""
    return hardware_flops_per_step(model, 1, recompute) / model_flops_per_step(model, 1)


def compute_time(model: "ModelSpec", global_batch: int, recompute: str, gpus: int,
                 flops_per_gpu: float) -> float:
    """Seconds of the step's matmuls: hardware FLOPs / (GPUs x achieved FLOP/s each)."""
    if not flops_per_gpu > 0:
        raise ValueError(f"flops_per_gpu must be > 0, got {flops_per_gpu!r}")
    return hardware_flops_per_step(model, global_batch, recompute) / (gpus * flops_per_gpu)


def bubble_time(compute: float, pp: int, micro_batches: int, interleave: int = 1) -> float:
    """Idle seconds of fill and drain: the bubble is (p-1)/(v m + p-1) of the step
    (chapter 12), the step compute / (1 - that), so the bubble is compute (p-1)/(v m)."""
    f = bubble_formula(pp, micro_batches, interleave)
    return compute * f / (1 - f)
