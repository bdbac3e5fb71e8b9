"""The per-term cost library: one formula for each term of a parallel layout's cost.

Chapter 19's ``helpers.frameworks.estimate`` (a framework's ``Plan``) and
chapter 20's planner (``helpers.planner``, a ``Layout``) both price a layout
term by term with these functions, so a term has one formula whichever
chapter prints it (``tests/test_plan_consistency.py`` checks that both call
them with the same arguments). Each term is the teaching chapter's model:

memory, bytes on the busiest GPU (``memory``)
    weights, gradients, optimizer state   ``model_state``: ch. 06/14's
                                          ``model_state_bytes`` on the GPU's share
    activations                           ``activations``: Korthikanti et al. 2022
    gathered layers (ZeRO-3)              ``gathered_layers``: ch. 15

time, seconds per step (``compute``, ``axes``)
    compute          ``compute_time``: hardware FLOPs / (GPUs x achieved FLOP/s);
                     attention's matmuls as the kernel executes them (a fused causal
                     kernel: about half the s x s square), model FLOPs the whole square
    bubble           ``bubble_time``: compute x (p-1)/(v m), ch. 12
    tp, pp, cp, ep   ``tp_cost`` ... ``ep_cost``: bytes sent, collective seconds,
    dp               exposed seconds of each parallel axis (``dp_cost`` with the
                     overlap of ch. 16)

collectives (``network``)
    ``ring_time``: NCCL's ring as its tuning model prices it: latency
    (2(P-1) - 2(n-1)) a_intra + 2(n-1) a_net, bandwidth 2(P-1)/P N / busbw,
    busbw = min(NVLink, the group's share of its node's NICs); strided groups
    (one GPU per node) get one NIC. ``all_to_all_time``: chapter 07's direct
    model. ``p2p_time``: one hop.

rooflines (``roofline``)
    ``ridge``, ``attainable``: Williams et al. 2009's two roofs; each parallelism's
    threshold (``dp_tokens``, ``zero_tokens``, ``tp_hidden``, ``cp_tokens``,
    ``pp_ratio``, ``ep_ffn``) derived from the byte counts above (Austin et al.
    2025, "How to Scale Your Model", parts 1 and 5)

Every function takes plain numbers (degrees, tokens, bytes), a ``ModelSpec``
and a chapter-07 ``Topology``; the slow parts (placing a group on nodes, a
model's state and activations) are cached on their arguments, so a planner can
call them for ten thousand layouts (``clear_caches`` empties them).
"""

from helpers.costs import axes, compute, memory, network, roofline
from helpers.costs.axes import (NO_COST, AxisCost, cp_cost, dp_cost, dp_ops, ep_cost, pp_cost,
                                tp_cost)
from helpers.costs.compute import (attention_flops_per_token, bubble_time, compute_time,
                                   flops_per_token, hardware_flops_per_step,
                                   model_flops_per_step, recompute_factor)
from helpers.costs.memory import (MIXED_ADAM, activations, bytes_per_param, gathered_layers,
                                  model_state, stage_layers, wire_bytes)
from helpers.costs.network import (COLLECTIVES, RING_COLLECTIVES, Placement, all_to_all_time,
                                   bus_bandwidth, collective_time, inter_node_steps,
                                   nic_share, p2p_time, placement, ring_latency, ring_steps,
                                   ring_time, sent_bytes, wire_factor)

__all__ = ["AxisCost", "NO_COST", "tp_cost", "pp_cost", "cp_cost", "ep_cost", "dp_ops",
           "dp_cost", "flops_per_token", "model_flops_per_step", "hardware_flops_per_step",
           "attention_flops_per_token", "recompute_factor", "compute_time", "bubble_time",
           "MIXED_ADAM", "bytes_per_param", "wire_bytes", "stage_layers", "model_state",
           "activations", "gathered_layers", "COLLECTIVES", "RING_COLLECTIVES", "Placement",
           "placement", "ring_steps", "inter_node_steps", "wire_factor", "sent_bytes",
           "nic_share", "ring_latency", "bus_bandwidth", "ring_time", "all_to_all_time",
           "collective_time", "p2p_time", "clear_caches", "axes", "compute", "memory",
           "network", "roofline"]


def clear_caches() -> None:
    """Forget every cached placement, collective and memory term (for cold timings)."""
    network.clear_caches()  # placements and the collectives' terms
    for cached in (memory.model_state, memory.activations, axes.dp_ops,
                   compute.hardware_flops_per_step):
        cached.cache_clear()
