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
                     rate (peak x matmul efficiency, or an assumed MFU); or, given
                     a measured rate for the layers' weight GEMMs (``helpers.costs.gemm``),
                     those FLOPs at it and the rest (attention's score and
                     score-times-V matmuls, the output layer) at the assumed rate
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
           "weight_gemm_flops_per_step", "recompute_factor", "compute_time", "bubble_time"]


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


@functools.lru_cache(maxsize=None)
def weight_gemm_flops_per_step(model: "ModelSpec", global_batch: int, recompute: str) -> float:
    """The part of ``hardware_flops_per_step`` in the layers' weight GEMMs (QKV,
    attention-out, MLP up and down: 2 FLOPs per weight a token meets, the top_k
    experts of an MoE layer): three passes, four with full recompute (its re-run
    forward). Selective recompute re-runs only attention's own matmuls, which are
    not weight GEMMs. The rest of the executed FLOPs is attention's score and
    score-times-V matmuls and the output layer."""
    active_mlp = model.mlp_params() * (model.top_k if model.experts else 1)
    per_token = 2 * (model.attention_params() + active_mlp) * model.layers
    passes = 4 if recompute == "full" else 3
    return passes * per_token * model.seq * global_batch


def recompute_factor(model: "ModelSpec", recompute: str) -> float:
    """Executed FLOPs / model FLOPs: 1 without recompute, below 4/3 with full (the
    output layer is not re-run)."""
    return hardware_flops_per_step(model, 1, recompute) / model_flops_per_step(model, 1)


def compute_time(model: "ModelSpec", global_batch: int, recompute: str, gpus: int,
                 flops_per_gpu: float, gemm_flops_per_gpu: float | None = None) -> float:
    """Seconds of the step's matmuls: hardware FLOPs / (GPUs x achieved FLOP/s each).

    ``gemm_flops_per_gpu``: None prices every FLOP at ``flops_per_gpu``. Given (a
    measured rate for this layout's GEMM shapes, ``helpers.costs.gemm``), the
    layers' weight GEMMs (``weight_gemm_flops_per_step``) run at it and only the
    rest at ``flops_per_gpu``, which is then an assumed rate for attention's own
    matmuls and the output layer."""
    for name, v in (("flops_per_gpu", flops_per_gpu), ("gemm_flops_per_gpu", gemm_flops_per_gpu)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    executed = hardware_flops_per_step(model, global_batch, recompute)
    if gemm_flops_per_gpu is None:
        return executed / (gpus * flops_per_gpu)
    gemm = weight_gemm_flops_per_step(model, global_batch, recompute)
    return (gemm / gemm_flops_per_gpu + (executed - gemm) / flops_per_gpu) / gpus


def bubble_time(compute: float, pp: int, micro_batches: int, interleave: int = 1) -> float:
    """Idle seconds of fill and drain: the bubble is (p-1)/(v m + p-1) of the step
    (chapter 12), the step compute / (1 - that), so the bubble is compute (p-1)/(v m)."""
    f = bubble_formula(pp, micro_batches, interleave)
    return compute * f / (1 - f)
