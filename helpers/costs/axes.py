"""What each parallel axis sends per step, how long it takes, and how much of it shows.

Every function returns an ``AxisCost``: bytes each GPU sends per step, seconds
of the axis's collectives per step, and the seconds of those that the compute
does not hide (the step-time term). Groups follow Megatron-LM's rank order
(tp fastest, then cp, then dp, then pp: ``RankGenerator`` in
megatron/core/parallel_state.py; ``helpers.mesh.megatron_stride`` computes
every stride below): a TP group is tp consecutive GPUs, the DP x CP group is
strided by tp, a pipeline boundary lies tp cp dp GPUs away.
Each collective is timed by ``network`` (NCCL's ring on the group's
placement), so a strided group that spreads one GPU per node pays for it.

    tp   2 all-reduces forward + 2 backward per layer per micro-batch of one
         (tokens, h) activation (Shoeybi et al. 2019, sec. 3; chapter 09's
         ``tp_comm_bytes``), 6 with full recompute (the re-run forward repeats
         its 2); with sequence parallelism they are reduce-scatter + all-gather
         pairs, the same bytes and ring steps. Exposed: all (they sit between
         matmuls).
    pp   one activation forward and one gradient backward per micro-batch per
         model chunk (chapter 11), 1/tp of it with sequence parallelism
         (Narayanan et al. 2021, sec. 4.1), on the slowest link of the pipeline.
         Exposed: all (Megatron's 1F1B waits for each receive before the compute
         that needs it; overlapping them is an option of the interleaved
         schedule, not modelled).
    cp   K and V of the whole sequence (this TP rank's key/value heads)
         all-gathered in forward, again in backward, and their gradients
         reduce-scattered, per layer per micro-batch (Llama 3's CP, Dubey et
         al. 2024, sec. 3.3.2). Exposed: all (Llama 3: "exposed in the critical
         path"). Ring attention (chapter 10) sends the same bytes in the same
         cp - 1 steps, but as one GPU pair per hop, at one NIC's bandwidth where
         the ring crosses nodes, hidden behind the attention blocks when they are
         long enough: ``helpers.sp.cost`` prices it; this term does not.
    ep   dispatch and combine all-to-alls forward, their transposes backward:
         4 per MoE layer per micro-batch of top_k copies of each token (chapter
         21), 1/tp of the tokens with sequence parallelism. Exposed: all.
    dp   ZeRO-0: one gradient all-reduce per step. ZeRO-1: reduce-scatter the
         gradients, all-gather the updated weights, once per step (chapter 14).
         ZeRO-2 shards the gradients, which a step of m micro-batches
         accumulates, so it pays one way or the other: it reduce-scatters every
         micro-batch's gradients and accumulates only its shard (m
         reduce-scatters a step; Rajbhandari et al. 2020, sec. 5.2, and
         DeepSpeed's engine: "ZeRO stage >= 2 communicates during non gradient
         accumulation boundaries as well"), or it holds the whole gradients
         until the step's one reduce-scatter (``whole_grads``: torch 2.13's
         pipelining runs an FSDP stage's micro-batches but the last with
         ``set_requires_gradient_sync(False)``), and then its memory and
         traffic are ZeRO-1's. ZeRO-3: all-gather each layer's weights before
         its forward and again before its backward, reduce-scatter its
         gradients, every micro-batch (chapter 15). Hybrid sharding adds an
         all-reduce of the gradient shard across replicas. Experts are reduced
         over the dp x cp / ep ranks that share them. Exposed: a reduction
         beyond the backward it overlaps (2/3 of a micro-batch's compute): the
         once-a-step ones and the last micro-batch's reduce-scatter behind the
         last backward, each earlier micro-batch's reduce-scatter behind its
         own; the weight all-gather of ZeRO-1/2 beyond the next step's first
         forward (1/3) when overlapped; ZeRO-3 beyond the whole step's compute
         when prefetched and overlapped (chapter 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from helpers.costs.network import collective_time, p2p_time, sent_bytes
from helpers.mesh import megatron_stride
from helpers.topology.links import Topology

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["AxisCost", "NO_COST", "tp_cost", "pp_cost", "cp_cost", "ep_cost", "dp_ops",
           "dp_cost", "reduces_every_micro_batch"]


@dataclass(frozen=True)
class AxisCost:
    """One axis per step: ``sent`` bytes each GPU sends, ``time`` seconds of its
    collectives, ``exposed`` seconds of them the compute does not hide."""

    sent: float
    time: float
    exposed: float


NO_COST = AxisCost(0.0, 0.0, 0.0)


def tp_cost(topo: Topology, *, tp: int, tokens: int, hidden: int, layers: int,
            micro_batches: int, recompute: str, dtype_bytes: int = 2) -> AxisCost:
    """Tensor parallelism over ``tp`` consecutive GPUs: 4 (6 with full recompute)
    all-reduces per layer per micro-batch of ``tokens`` x ``hidden`` values."""
    if tp == 1:
        return NO_COST
    count = (6 if recompute == "full" else 4) * layers * micro_batches
    nbytes = tokens * hidden * dtype_bytes
    t = count * collective_time(topo, "all_reduce", nbytes, tp, megatron_stride("tp", tp=tp))
    return AxisCost(count * sent_bytes("all_reduce", nbytes, tp), t, t)


def pp_cost(topo: Topology, *, tp: int, cp: int, dp: int, pp: int, interleave: int,
            tokens: int, hidden: int, micro_batches: int, sequence_parallel: bool,
            dtype_bytes: int = 2) -> AxisCost:
    """Pipeline hops: 2 per micro-batch per model chunk of one activation, between
    stages tp cp dp GPUs apart; across nodes unless GPU 0's whole pipeline shares
    its node (the pipeline runs at its slowest hop), the NIC shared by the stage's
    GPUs on the node."""
    if pp == 1:
        return NO_COST
    nbytes = tokens * hidden * dtype_bytes / (tp if sequence_parallel else 1)
    stride = megatron_stride("pp", tp=tp, cp=cp, dp=dp, pp=pp)  # tp cp dp
    hop = p2p_time(topo, nbytes, crosses_node=stride * pp > topo.gpus_per_node,
                   senders_per_node=stride)
    count = 2 * micro_batches * interleave
    return AxisCost(count * nbytes, count * hop, count * hop)


def cp_cost(model: "ModelSpec", topo: Topology, *, tp: int, cp: int, micro_batch: int,
            layers: int, micro_batches: int, dtype_bytes: int = 2) -> AxisCost:
    """Context parallelism over ``cp`` GPUs tp apart: per layer per micro-batch, 2
    all-gathers and 1 reduce-scatter of the sequence's K and V (this TP rank's
    key/value heads: kv_heads / tp, one where TP replicates them)."""
    if cp == 1:
        return NO_COST
    kv_heads = max(1, model.n_kv_heads // tp)
    nbytes = 2 * micro_batch * model.seq * (model.hidden // model.heads) * kv_heads * dtype_bytes
    stride = megatron_stride("cp", tp=tp, cp=cp)  # tp
    per_layer = (2 * collective_time(topo, "all_gather", nbytes, cp, stride)
                 + collective_time(topo, "reduce_scatter", nbytes, cp, stride))
    count = layers * micro_batches
    sent = 3 * sent_bytes("all_gather", nbytes, cp)
    return AxisCost(count * sent, count * per_layer, count * per_layer)


def ep_cost(model: "ModelSpec", topo: Topology, *, tp: int, ep: int, tokens: int,
            layers: int, micro_batches: int, sequence_parallel: bool,
            dtype_bytes: int = 2) -> AxisCost:
    """Expert parallelism over ``ep`` GPUs tp apart (ep consecutive members of the
    dp x cp group): 4 all-to-alls per MoE layer per micro-batch of the routed tokens,
    top_k copies of each."""
    if ep == 1 or not model.experts:
        return NO_COST
    nbytes = (tokens * model.top_k * model.hidden * dtype_bytes
              / (tp if sequence_parallel else 1))
    count = 4 * layers * micro_batches
    stride = megatron_stride("cp", tp=tp)  # the dp x cp group's fastest axis: tp apart
    t = count * collective_time(topo, "all_to_all", nbytes, ep, stride)
    return AxisCost(count * sent_bytes("all_to_all", nbytes, ep), t, t)


def reduces_every_micro_batch(zero: int, whole_grads: bool = False) -> bool:
    """Whether ZeRO stage ``zero`` reduce-scatters the gradients after every
    micro-batch's backward: stage 3 always (the course's FSDP frees what it
    gathered), stage 2 unless it holds whole gradients until the step's end
    (``whole_grads``); stages 0 and 1 keep whole gradients and reduce once."""
    return zero == 3 or (zero == 2 and not whole_grads)


@functools.lru_cache(maxsize=None)
def dp_ops(model: "ModelSpec", *, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
           zero: int = 0, micro_batches: int = 1, shard: int | None = None,
           grad_bytes: float = 2, weight_bytes: float = 2, whole_grads: bool = False) -> tuple:
    """The data-parallel collectives of one step, each as (kind, collective, bytes,
    group size, stride, count): kind "reduce" (gradients) or "gather" (weights).

    ``shard``: the ranks ZeRO shards over (default dp x cp; hybrid sharding:
    dp_shard x cp, the replicas then all-reduce their gradient shard).
    ``grad_bytes``: bytes per gradient value reduced (4 with fp32 main grads);
    ``weight_bytes``: per weight value gathered (the compute dtype).
    ``whole_grads`` (ZeRO-2): the gradients are accumulated whole and
    reduce-scattered once per step instead of once per micro-batch
    (``reduces_every_micro_batch``). Cached."""
    group = dp * cp
    shard = group if shard is None else shard
    dense = model.dense_params()
    inner = megatron_stride("cp", tp=tp, cp=cp)  # the dp x cp group's ranks are tp apart
    sets = [(dense / (tp * pp), shard, inner, group // shard, inner * shard)]
    experts = model.total_params() - dense
    if experts:
        e_shard = max(1, shard // ep)
        sets.append((experts / (tp * pp * ep), e_shard, inner * ep, group // ep // e_shard,
                     inner * ep * e_shard))
    ops = []
    reductions = micro_batches if reduces_every_micro_batch(zero, whole_grads) else 1
    gathers = 2 * micro_batches if zero == 3 else 1   # ZeRO-1/2: the updated weights, once
    for params, size, stride, replicas, r_stride in sets:
        grads, weights = params * grad_bytes, params * weight_bytes
        if zero == 0:
            ops.append(("reduce", "all_reduce", grads, size * replicas, stride, 1))
            continue
        ops.append(("reduce", "reduce_scatter", grads, size, stride, reductions))
        ops.append(("gather", "all_gather", weights, size, stride, gathers))
        if replicas > 1:
            ops.append(("reduce", "all_reduce", grads / size, replicas, r_stride, 1))
    return tuple(ops)


def dp_cost(model: "ModelSpec", topo: Topology, *, dp: int, tp: int, pp: int, cp: int = 1,
            ep: int = 1, zero: int = 0, micro_batches: int = 1, micro_batch_time: float = 0.0,
            shard: int | None = None, grad_bytes: float = 2, weight_bytes: float = 2,
            overlap_grad_reduce: bool = True, overlap_param_gather: bool = False,
            whole_grads: bool = False) -> AxisCost:
    """Data parallelism (``dp_ops``), exposed as the module docstring says;
    ``micro_batch_time``: one micro-batch's forward + backward compute (t_b = 2 t_f).
    ``whole_grads``: ZeRO-2 accumulates whole gradients and reduce-scatters once."""
    per_micro = zero != 3 and reduces_every_micro_batch(zero, whole_grads)
    once_t = micro_t = gather_t = sent = 0.0     # micro_t: one micro-batch's reduce-scatters
    for kind, coll, nbytes, size, stride, count in dp_ops(
            model, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, micro_batches=micro_batches,
            shard=shard, grad_bytes=grad_bytes, weight_bytes=weight_bytes,
            whole_grads=whole_grads):
        one = collective_time(topo, coll, nbytes, size, stride)
        sent += count * sent_bytes(coll, nbytes, size)
        if kind == "gather":
            gather_t += count * one
        elif per_micro and coll == "reduce_scatter":
            micro_t += one                        # count = micro_batches: one per backward
        else:
            once_t += count * one
    reduce_t = once_t + micro_t * (micro_batches if per_micro else 0)
    total = reduce_t + gather_t
    if zero == 3:
        # prefetched gathers and overlapped reduce-scatters hide behind the whole step
        hideable = ((gather_t if overlap_param_gather else 0.0)
                    + (reduce_t if overlap_grad_reduce else 0.0))
        exposed = total - hideable + max(0.0, hideable - micro_batch_time * micro_batches)
    else:
        backward, forward = micro_batch_time * 2 / 3, micro_batch_time / 3
        hide = backward if overlap_grad_reduce else 0.0
        # each earlier micro-batch's reduce-scatter behind its own backward; the last one
        # and the once-a-step reductions behind the last backward
        exposed_reduce = max(0.0, micro_t + once_t - hide)
        if per_micro:
            exposed_reduce += (micro_batches - 1) * max(0.0, micro_t - hide)
        exposed = exposed_reduce + max(0.0, gather_t - (forward if overlap_param_gather else 0.0))
    return AxisCost(sent, total, exposed)
