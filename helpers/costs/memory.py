"""Bytes on the busiest GPU of a parallel layout: model state, activations, gathered layers.

    bytes per parameter   bf16 mixed-precision Adam: 2 + 2 + 12 (16-bit weights and
                          gradients, fp32 master + m + v; Rajbhandari et al. 2020,
                          sec. 3.1, K = 12); fp32 gradients 4; fp32 training 4 + 4 + 8
    model state           ``helpers.memory.model_state_bytes`` (ch. 06, 14) on the
                          parameters a GPU owns: the dense ones / (tp pp), experts
                          also / ep, ZeRO-sharded over the ranks that hold the same
                          weights (dp x cp; for experts dp x cp / ep); ZeRO-2 that
                          accumulates whole gradients over a step's micro-batches
                          holds them whole (``whole_grads``)
    activations           ``helpers.memory.activation_bytes_model`` (Korthikanti et
                          al. 2022, Table 2 and sec. 4.2.3; ch. 06, 10, 13) on the
                          first pipeline stage, seq / cp tokens, doubled in fp32;
                          given the step's micro-batches per replica, the stage
                          holds no more of them than the step has (sec. 4.2.3
                          counts p in flight, which assumes at least p)
    gathered layers       ZeRO-3 (ch. 15): one layer all-gathered in the compute
                          dtype, plus the next one when the gather is prefetched
    layer_activation_bytes  one layer of the model's own shapes: Korthikanti's
                          accounting with the MLP's width and gating (SwiGLU keeps
                          gate, up and their product: 6 sbf; a GeLU MLP 4 sbf) and
                          grouped-query K and V (kv_heads / heads of 4 sbh). For a
                          GPT (4h GeLU, no grouping) it is Table 2's count; the
                          planner and chapter 19's estimate count every layer this
                          way (``activations(..., own_shapes=True)``)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from helpers.memory import (activation_bytes_model, activation_bytes_per_layer,
                            model_state_bytes)
from helpers.validate import positive_int

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["MIXED_ADAM", "bytes_per_param", "wire_bytes", "stage_layers", "model_state",
           "activations", "gathered_layers", "layer_activation_bytes"]

MIXED_ADAM = (2.0, 2.0, 12.0)   # weights, gradients, optimizer state: bytes per parameter


def bytes_per_param(precision: str = "bf16", *, main_grads_fp32: bool = False,
                    optimizer_grads_fp32: bool = False,
                    params_fp32: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter before sharding.

    Mixed precision with Adam (Rajbhandari et al. 2020, sec. 3.1, K = 12): 16-bit
    weights and gradients, fp32 master weights + m + v; gradients kept in fp32
    (Megatron's main_grad) cost 4. FP8 training keeps bf16 weights and runs FP8
    GEMMs on transient casts (chapter 13), so its state is bf16's. fp32: 4 + 4 + 8
    (no master copy). ``optimizer_grads_fp32``: the optimizer keeps an fp32 copy
    of its gradient shard, 4 more bytes in the sharded part (DeepSpeed's ZeRO
    partitions, Megatron's fp16 optimizer). ``params_fp32`` (FSDP2): 4-byte
    weights that are the master copy, so the optimizer holds only m and v.
    """
    if precision == "fp32":
        return 4.0, 4.0, 8.0
    grads = 4.0 if main_grads_fp32 else 2.0
    if params_fp32:
        return 4.0, grads, 8.0
    return 2.0, grads, 12.0 + (4.0 if optimizer_grads_fp32 else 0.0)


def wire_bytes(precision: str = "bf16") -> int:
    """Bytes of one value the matmuls read: activations sent by TP, PP, CP and EP and
    weights all-gathered for compute (FSDP2 gathers its fp32 weights cast to bf16)."""
    return 4 if precision == "fp32" else 2


def stage_layers(model: "ModelSpec", pp: int) -> int:
    """Transformer layers on the busiest stage. When pp divides layers + 2 but not
    layers (Llama 3 405B: 126 layers on 16 stages), the embedding and the loss
    each take one layer's place on the first and the last stage (Dubey et al.
    2024, sec. 3.3.2), and the other stages hold ceil(layers / pp)."""
    return -(-model.layers // pp)


@functools.lru_cache(maxsize=None)
def model_state(model: "ModelSpec", model_parallel: int, shard: int, zero: int, ep: int = 1,
                per_param: tuple = MIXED_ADAM,
                whole_grads: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU: the dense parameters split
    over ``model_parallel`` = tp x pp GPUs, ZeRO stage ``zero`` sharding them over
    ``shard`` ranks (dp x cp: CP ranks hold the same weights, and Megatron's
    distributed optimizer shards over both); the experts also split over ``ep``
    and sharded over the shard / ep ranks that hold the same expert.

    ``whole_grads``: ZeRO-2 whose step accumulates its micro-batches' gradients whole
    and reduce-scatters them once (``helpers.costs.axes``): until then every GPU holds
    the whole gradient, so its state is ZeRO-1's. The caller passes it only when the
    step has more than one micro-batch (with one, the backward's reduce-scatters free
    the gradient as they go)."""
    w_b, g_b, o_b = per_param
    if zero == 2 and whole_grads:
        zero = 1
    dense = model.dense_params()
    s = model_state_bytes(dense / model_parallel, dp=shard, zero_stage=zero,
                          param_bytes=w_b, grad_bytes=g_b, optimizer_bytes=o_b)
    w, g, o = s.params, s.grads, s.optimizer
    experts = model.total_params() - dense
    if experts:
        e = model_state_bytes(experts / (model_parallel * ep), dp=max(1, shard // ep),
                              zero_stage=zero, param_bytes=w_b, grad_bytes=g_b,
                              optimizer_bytes=o_b)
        w, g, o = w + e.params, g + e.grads, o + e.optimizer
    return w, g, o


@functools.lru_cache(maxsize=None)
def activations(model: "ModelSpec", seq: int, micro_batch: int, tp: int, pp: int,
                sequence_parallel: bool, recompute: str, interleave: int = 1,
                precision: str = "bf16", own_shapes: bool = False,
                micro_batches: int | None = None) -> float:
    """Korthikanti et al. 2022's count (``activation_bytes_model``) for the first
    stage of ``stage_layers`` x pp layers, ``seq`` tokens a rank (seq / cp), in
    16 bits (twice that in fp32). The formula is a GPT layer (4h GeLU MLP, a key
    and value per head). ``own_shapes``: each layer counted with the model's own
    MLP width and gating and its key/value heads instead
    (``layer_activation_bytes``: a SwiGLU MLP keeps 6 sbf, grouped-query K and V
    kv_heads / heads of 4 sbh); the planner and chapter 19's estimate pass True.
    The embedding and output-layer terms are the same either way.

    ``micro_batches``: the micro-batches one replica runs per step (m). Sec. 4.2.3's
    first stage holds p micro-batches of its layers (1F1B's warm-up), p (1 + (p-1) /
    (p v)) with v interleaved chunks: Megatron-Core's first stage runs 2 (p - 1) +
    (v - 1) p warm-up forwards, then one more before its first backward, p v + p - 1
    chunks (Megatron-Core main, d98e8a6 of 2026-08-22, ``pipeline_parallel/schedules.py``,
    ``get_pp_rank_microbatches``), and caps the warm-up at the step's m v chunks. So
    with m < p + (p - 1) / v the stage holds all m: every forward of the step runs
    before its first backward (m = 16 micro-batches on 16 stages, v = 8: 128 chunks,
    not 143). None: the paper's count, m taken to be large."""
    layers = stage_layers(model, pp) * pp
    act = activation_bytes_model(seq, micro_batch, model.hidden, model.heads, layers,
                                 tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                 recompute=recompute, vocab=model.vocab, interleave=interleave)
    in_flight = 1 + (pp - 1) / (pp * interleave) if interleave > 1 else 1.0  # sec. 4.2.3
    held = in_flight                 # micro-batches of the stage's layers, in units of p
    gpt = activation_bytes_per_layer(seq, micro_batch, model.hidden, model.heads, tp=tp,
                                     sequence_parallel=sequence_parallel, recompute=recompute)
    if micro_batches is not None:
        positive_int("micro_batches", micro_batches)
        held = min(in_flight, micro_batches / pp)
        # what the paper's count holds beyond the step's micro-batches: the layers' part
        # and the embedding's dropout mask (sbh per micro-batch, /t with SP)
        sbh = seq * micro_batch * model.hidden / (tp if sequence_parallel else 1)
        act -= gpt * layers * (in_flight - held) + sbh * (pp - min(pp, micro_batches))
    if own_shapes:
        own = layer_activation_bytes(model, seq, micro_batch, tp, sequence_parallel, recompute)
        act += (own - gpt) * layers * held
    return act * (2 if precision == "fp32" else 1)


def gathered_layers(model: "ModelSpec", tp: int, units: int, precision: str = "bf16",
                    ep: int = 1) -> float:
    """ZeRO-3's all-gathered weights (chapter 15): ``units`` layers (1, or 2 when the
    next one is prefetched) of 1/tp of a layer each, in the compute dtype. An MoE layer's
    gather holds only the experts of the rank's expert-parallel group, E / ``ep`` of them
    (``layer_params`` counts all E)."""
    experts = model.mlp_params() * model.experts  # 0 for a dense model
    layer = model.layer_params() - experts + experts / ep
    return units * (layer / tp * wire_bytes(precision))


def layer_activation_bytes(model: "ModelSpec", seq: int, micro_batch: int, tp: int,
                           sequence_parallel: bool, recompute: str) -> float:
    """Bytes one layer of ``model`` keeps for backward, in 16 bits, with its own MLP and
    attention shapes (Korthikanti et al. 2022, sec. 4.1-4.2 and 5, term by term).

    Outside the tensor-parallel regions, 10 sbh: two norm inputs (4), two residual
    dropout masks (2, kept as in the paper), the QKV and first-MLP matmul inputs (4);
    split by t only with sequence parallelism. Inside, split by t: Q (2 sbh), K and V
    (4 sbh x kv_heads / heads), the output projection's input (2 sbh), the MLP's
    inner tensors (GeLU: its input and output, 4 sbf; SwiGLU: gate, up and their
    product, 6 sbf) and the attention scores, softmax and dropout, 5 a s^2 b (none
    with selective recompute, which re-runs them). Full recompute keeps the layer
    input, 2 sbh (/t with SP). GPT shapes (f = 4h, no grouping) give Table 2."""
    s, b, h, a = seq, micro_batch, model.hidden, model.heads
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    g = model.n_kv_heads / a
    mlp = (6 if model.gated_mlp else 4) * s * b * model.ffn_hidden
    inner = (2 + 4 * g + 2) * sbh + mlp + (0 if recompute == "selective" else 5 * a * s * s * b)
    return 10 * sbh / (tp if sequence_parallel else 1) + inner / tp
