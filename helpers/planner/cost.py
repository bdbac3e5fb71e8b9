"""The planner's cost model: memory and step time of one layout, one term per mechanism.

Every number the planner ranks by is a term of the course's per-term cost
library, ``helpers.costs``, which chapter 19's ``helpers.frameworks.estimate``
calls with the same arguments for the same layout (``Layout.to_plan``;
``tests/test_plan_consistency.py``). This module only reads a ``Layout`` into
those arguments, with the planner's assumptions: bf16 mixed-precision Adam (16
bytes per parameter), sequence parallelism whenever there is TP, gradient
reduction overlapped with the backward, ZeRO-3's weight gathers prefetched
(the choices ``Layout.to_plan`` writes into a ``Plan``).

    compute        executed FLOPs at an assumed MFU (ch. 01, 13; Narayanan et al.
                   2021 eq. 3, attention's matmuls as a fused causal kernel runs
                   them where no scores are stored): ``costs.compute_time``; with a measured GEMM
                   table, the layers' weight GEMMs at the efficiency measured
                   for this layout's shapes (``gemm_efficiency``) and only the
                   rest at the assumed MFU
    bubble         fill and drain, (p-1)/(v m) of the compute (ch. 11-12)
    tp_comm        4 all-reduces per layer per micro-batch (6 with full
                   recompute) inside the node (ch. 07-09)
    pp_p2p         an activation forward and a gradient backward per
                   micro-batch and chunk across a stage boundary (ch. 11)
    cp_comm        the all-gather of K and V (and reduce-scatter of their
                   gradients) per layer, Llama 3's CP (ch. 10)
    ep_comm        4 all-to-alls per MoE layer per micro-batch (ch. 21)
    dp_comm        gradient all-reduce / ZeRO reduce-scatter + all-gather,
                   exposed only where it outlasts the compute it overlaps
                   (ch. 04, 14-16); ZeRO-2 reduce-scatters every micro-batch
                   (``Layout.whole_grads``: once, holding whole gradients)

Each collective is NCCL's ring on its group's placement (``costs.network``):
a DP group strided across nodes gets one NIC per node, a packed one all of
them. Memory (``memory_terms``): weights, gradients and optimizer state
(``costs.model_state``: Rajbhandari et al. 2020, sec. 3.1, ZeRO-sharded over
dp x cp), ZeRO-3's gathered layers (``costs.gathered_layers``, ch. 15: the one
computing and the prefetched next), activations (``costs.activations``:
Korthikanti et al. 2022, sec. 4 and Table 2, each layer with the model's own MLP
and key/value heads, at most the step's micro-batches in flight) on the
busiest (first) pipeline stage; ``time_terms`` gives the
seconds per step, by term, as the list above.
"""

from __future__ import annotations

import functools

from helpers import costs
from helpers.costs import flops_per_token, stage_layers
from helpers.costs.gemm import GemmTable, matmul_efficiency
from helpers.frameworks.plan import GPU, ModelSpec
from helpers.planner.layouts import Layout, overlap_flags
from helpers.topology.links import Topology

__all__ = ["BF16", "flops_per_token", "stage_layers", "memory_terms", "time_terms",
           "axis_balance", "overlap", "gemm_efficiency"]

BF16 = 2  # bytes of an activation, weight or gradient on the wire


def overlap(lay: Layout) -> dict:
    """What the planner assumes overlaps (``Layout.to_plan`` writes the same into a
    ``Plan``): gradient reduction with the backward, and with any sharded
    optimizer state the weight all-gather with the forward: ZeRO-3's gathers
    prefetched, ZeRO-1/2's all-gather of the updated weights overlapped with the
    next step's forward, as Megatron-Core's distributed optimizer does with
    ``--overlap-param-gather`` (a flag that needs ``--use-distributed-optimizer``,
    i.e. ZeRO-1) and FSDP2 with its prefetch."""
    return {"overlap_grad_reduce": True, "overlap_param_gather": lay.zero >= 1}


def memory_terms(model: ModelSpec, lay: Layout, global_batch: int | None = None) -> tuple:
    """(weights, grads, optimizer, gathered, activations) bytes on the busiest GPU
    (pipeline stage 0), each cached by ``helpers.costs`` on the few degrees it
    depends on (``MEMORY_TERMS`` names them in this order).

    CP ranks hold the same weights, so ZeRO shards over dp x cp (Megatron's
    distributed optimizer does); each CP rank keeps the activations of seq / cp
    tokens. Experts are split over ep and their state is ZeRO-sharded over the
    dp x cp / ep ranks that share them. ZeRO-3 also holds the layers it has
    all-gathered (``costs.gathered_layers``, ch. 15): the one computing and, with the
    gather prefetched (``overlap``), the next; 0 at the other stages. ``global_batch``
    (sequences): the first stage holds no more micro-batches than a replica runs
    (``costs.activations``' ``micro_batches``); None counts as many as the schedule's
    warm-up could hold."""
    m = None if global_batch is None else global_batch // lay.dp // lay.micro_batch
    # ZeRO-2 holding whole gradients holds them only across micro-batches (None: assume some)
    w, g, o = costs.model_state(model, lay.tp * lay.pp, lay.dp * lay.cp, lay.zero, lay.ep,
                                costs.MIXED_ADAM, lay.whole_grads and (m is None or m > 1))
    gathered = 0.0
    if lay.zero == 3:
        units = 2 if overlap(lay)["overlap_param_gather"] else 1
        gathered = costs.gathered_layers(model, lay.tp, units, "bf16", lay.ep)
    act = costs.activations(model, model.seq // lay.cp, lay.micro_batch, lay.tp, lay.pp,
                            lay.tp > 1, lay.recompute, lay.interleave, "bf16", own_shapes=True,
                            micro_batches=m)
    return w, g, o, gathered, act


@functools.lru_cache(maxsize=None)
def gemm_efficiency(model: ModelSpec, tp: int, tokens: int, table: GemmTable,
                    peak_flops: float) -> float:
    """Measured share of peak of one layer's four weight GEMMs on a TP rank that
    multiplies ``tokens`` rows (``costs.gemm.matmul_efficiency``), cached: a
    search asks for the same (tp, tokens) thousands of times.

    What it leaves out, and so why a layout's MFU stays below it: the memory-bound
    work between the GEMMs (norms, activations, softmax, rotary embeddings, the
    optimizer step), attention's own kernels (priced at the assumed MFU instead),
    and the backward GEMMs' own shapes (priced at the forward shape's rate)."""
    return matmul_efficiency(model, tp, tokens, table, peak_flops)


def _axis_costs(model: ModelSpec, lay: Layout, global_batch: int, gpu: GPU, topo: Topology,
                mfu: float, gemm_table: GemmTable | None = None) -> tuple[float, dict]:
    """(compute seconds, {axis: ``AxisCost``}) of one step: what ``time_terms`` and
    ``axis_balance`` read."""
    m = global_batch // lay.dp // lay.micro_batch          # micro-batches per replica
    layers = stage_layers(model, lay.pp)
    tokens = lay.micro_batch * (model.seq // lay.cp)       # one micro-batch on a CP rank
    sp = lay.tp > 1
    gemm_rate = None
    if gemm_table is not None:
        gemm_rate = gpu.peak_flops * gemm_efficiency(model, lay.tp, tokens, gemm_table,
                                                     gpu.peak_flops)
    compute = costs.compute_time(model, global_batch, lay.recompute, lay.world,
                                 gpu.peak_flops * mfu, gemm_rate)
    tp = costs.tp_cost(topo, tp=lay.tp, tokens=tokens, hidden=model.hidden, layers=layers,
                       micro_batches=m, recompute=lay.recompute, dtype_bytes=BF16)
    pp = costs.pp_cost(topo, tp=lay.tp, cp=lay.cp, dp=lay.dp, pp=lay.pp,
                       interleave=lay.interleave, tokens=tokens, hidden=model.hidden,
                       micro_batches=m, sequence_parallel=sp, dtype_bytes=BF16)
    cp = costs.cp_cost(model, topo, tp=lay.tp, cp=lay.cp, micro_batch=lay.micro_batch,
                       layers=layers, micro_batches=m, dtype_bytes=BF16)
    ep = costs.ep_cost(model, topo, tp=lay.tp, ep=lay.ep, tokens=tokens, layers=layers,
                       micro_batches=m, sequence_parallel=sp, dtype_bytes=BF16)
    dp = costs.dp_cost(model, topo, dp=lay.dp, tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep,
                       zero=lay.zero, micro_batches=m, micro_batch_time=compute / m,
                       shard=lay.dp * lay.cp, grad_bytes=BF16, weight_bytes=BF16,
                       **overlap(lay), whole_grads=lay.whole_grads)
    return compute, {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "dp": dp}


def time_terms(model: ModelSpec, lay: Layout, global_batch: int, gpu: GPU, topo: Topology,
               mfu: float, gemm_table: GemmTable | None = None) -> dict:
    """Seconds per step, by term (see the module docstring). ``mfu``: the assumed
    share of peak of every executed FLOP, or, with ``gemm_table``, of the FLOPs
    outside the layers' weight GEMMs (attention's score matmuls, the output layer),
    the GEMMs running at ``gemm_efficiency`` for this layout's TP size and tokens
    per micro-batch (micro-batch x seq / cp)."""
    compute, axes = _axis_costs(model, lay, global_batch, gpu, topo, mfu, gemm_table)
    m = global_batch // lay.dp // lay.micro_batch
    return {"compute": compute, "bubble": costs.bubble_time(compute, lay.pp, m, lay.interleave),
            "tp_comm": axes["tp"].exposed, "pp_p2p": axes["pp"].exposed,
            "cp_comm": axes["cp"].exposed, "ep_comm": axes["ep"].exposed,
            "dp_comm": axes["dp"].exposed}


def axis_balance(model: ModelSpec, lay: Layout, global_batch: int, gpu: GPU, topo: Topology,
                 mfu: float, gemm_table: GemmTable | None = None) -> dict:
    """{axis: communication seconds / compute seconds} per step, every axis the layout
    splits: the roofline's verdict per axis (``helpers.costs.roofline``; above 1 the
    axis's collectives outlast the compute they could hide behind), whether or not the
    step hides them. The same byte counts as ``time_terms``, all of each axis's time."""
    compute, axes = _axis_costs(model, lay, global_batch, gpu, topo, mfu, gemm_table)
    return {name: cost.time / compute for name, cost in axes.items() if cost.time > 0}
