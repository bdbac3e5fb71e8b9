"""FLOPs of a training step and the seconds they take: compute and the pipeline bubble.

    model FLOPs      3 forward passes (forward + a backward of twice its cost) of
                     ``ModelSpec.forward_flops_per_token`` per token: 6 N_active +
                     12 l h s, the attention matmuls counted over the whole s x s
                     square as the papers count model FLOPs (Kaplan et al. 2020,
                     sec. 2.1; Narayanan et al. 2021, sec. 5.1, eq. 3; PaLM's MFU,
                     Chowdhery et al. 2022, appendix B: 6N + 12 L H Q T). It is the
                     numerator of every MFU the course prints.
    hardware FLOPs   what the GPUs execute. The weight matmuls: 3 passes, 4 for
                     the layers with full recompute (its re-run forward; Narayanan
                     et al. 2021, eq. 3). Attention's score (Q K^T) and
                     score-times-V matmuls (``attention_flops_per_token``) depend
                     on the kernel. A layer that stores its s x s scores
                     (recompute "none") materialised them: the whole square, 2 s h
                     FLOPs per token for each of the forward's 2 matmuls and the
                     backward's 4. A layer that stores none ("selective", "full")
                     runs a fused causal kernel (FlashAttention-2, Dao 2023, sec.
                     3.1: blocks above the diagonal skipped), which computes about
                     half of the square and whose backward re-runs Q K^T only (Dao et
                     al. 2022, Algorithm 4), not also the product with V as
                     Korthikanti et al. 2022 (sec. 5) count for their selective
                     recompute; full recompute adds the re-run forward's 2 matmuls.
                     ``attention="unfused"`` counts the whole square in every pass
                     and Korthikanti's re-run of both (Narayanan et al.'s eq. 3
                     for full recompute, Megatron-LM in 2021).
    compute          hardware FLOPs spread evenly over every GPU, at an achieved
                     rate (peak x matmul efficiency, or an assumed MFU); or, given
                     a measured rate for the layers' weight GEMMs (``helpers.costs.gemm``),
                     those FLOPs at it and the rest (attention's score and
                     score-times-V matmuls, the output layer) at the assumed rate
    bubble           fill and drain of the pipeline: (p-1)/(v m + p-1) of the step
                     (chapter 12's ``bubble_formula``), so compute x (p-1)/(v m)

Because model FLOPs count the whole square and a causal kernel executes about half
of it, a long-sequence run executes fewer FLOPs than its model FLOPs: its MFU can
exceed the rate its kernels run at (Llama 3 405B at 131,072 tokens: the attention
matmuls are over half of the model FLOPs).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from helpers.pipeline.simulate import bubble_formula

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["flops_per_token", "model_flops_per_step", "hardware_flops_per_step",
           "attention_flops_per_token", "ATTENTION_KERNELS", "weight_gemm_flops_per_step",
           "recompute_factor", "compute_time", "bubble_time"]

ATTENTION_KERNELS = ("fused", "unfused")
# matmuls over the s x s square per layer, in units of one whole-square matmul (2 s h FLOPs
# per token): forward (Q K^T, P V), backward (dV, dP, dQ, dK), the re-runs, and the share
# of the square computed. Fused causal: 1/2 of it; its backward re-runs Q K^T (Dao et al.
# 2022, Alg. 4). Unfused: the whole square; selective re-runs both (Korthikanti et al. 2022).
_ATTENTION = {  # (kernel, recompute): (matmuls, share of the square)
    ("unfused", "none"): (6, 1.0), ("unfused", "selective"): (8, 1.0),
    ("unfused", "full"): (8, 1.0),
    ("fused", "none"): (6, 0.5), ("fused", "selective"): (7, 0.5), ("fused", "full"): (9, 0.5),
}


def flops_per_token(model: "ModelSpec") -> float:
    """Training FLOPs per token without recompute: three forward passes, 6 N_active +
    12 l h s (for a GPT with tied embeddings, N = 12 l h^2 + V h, this is Narayanan
    et al. 2021 eq. 3 divided by B s tokens, with 3/4 of their 96). The input
    embedding is a lookup, not a matmul: an untied input matrix is not counted."""
    return 3 * model.forward_flops_per_token()


def model_flops_per_step(model: "ModelSpec", global_batch: int) -> float:
    """Forward + backward FLOPs of one step of ``global_batch`` sequences, no recompute."""
    return flops_per_token(model) * model.seq * global_batch


def attention_kernel(recompute: str, attention: str | None = None) -> str:
    """The attention kernel a recompute mode implies: "unfused" where the layer stores
    its s x s scores (recompute "none"), else "fused"; ``attention`` overrides it."""
    if attention is None:
        return "unfused" if recompute == "none" else "fused"
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    return attention


def attention_flops_per_token(model: "ModelSpec", recompute: str,
                              attention: str | None = None) -> float:
    """Executed FLOPs of attention's score and score-times-V matmuls per token, every
    layer, every pass (forward, backward, re-runs), as the module docstring counts them.
    The model FLOPs' share is 3 x 4 s h per layer (the whole square, no re-run)."""
    matmuls, share = _ATTENTION[attention_kernel(recompute, attention), recompute]
    return matmuls * share * 2 * model.seq * model.hidden * model.layers


@functools.lru_cache(maxsize=None)
def hardware_flops_per_step(model: "ModelSpec", global_batch: int, recompute: str,
                            attention: str | None = None) -> float:
    """What the GPUs execute: the weight matmuls 3 passes, the layers' 4 with full
    recompute (Narayanan et al. 2021, sec. 5.1: the output layer is not re-run), and
    attention's own matmuls as ``attention_flops_per_token`` counts them (a fused
    causal kernel unless the scores are stored, or ``attention`` says otherwise)."""
    tokens = model.seq * global_batch
    square = 4 * model.seq * model.hidden * model.layers        # the forward's 2 matmuls
    weights = flops_per_token(model) - 3 * square
    if recompute == "full":
        weights += model.forward_flops_per_token() - 2 * model.hidden * model.vocab - square
    return (weights + attention_flops_per_token(model, recompute, attention)) * tokens


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


def recompute_factor(model: "ModelSpec", recompute: str, attention: str | None = None) -> float:
    """Executed FLOPs / model FLOPs. Counted as Narayanan et al. count their executed
    FLOPs (``attention="unfused"``): 1 without recompute, below 4/3 with full (the
    output layer is not re-run). With a fused causal kernel (the default where the
    scores are not stored) it is lower, below 1 at long sequences."""
    return (hardware_flops_per_step(model, 1, recompute, attention)
            / model_flops_per_step(model, 1))


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
