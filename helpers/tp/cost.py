"""Why tensor parallelism stays inside a node: its messages against the network model.

Each transformer layer all-reduces its whole activation (tokens x h values)
four times per step (``transformer.tp_comm_bytes``): two in forward, two in
backward. Plain TP waits for them; Megatron-LM's ``--tp-comm-overlap`` and
PyTorch's asynchronous TP hide part of them behind the GEMMs by cutting both
into chunks. The time of one all-reduce is NCCL's ring as
``helpers.costs.network`` prices it (the model chapters 07, 19 and 20 use):

    T_comm(t) = 4 x ring_time(all_reduce, tokens h s bytes, t GPUs)

inside one node a ring on NVLink 4 (450 GB/s per direction per H100, NVIDIA
H100 datasheet, "900 GB/s" bidirectional); once t exceeds the GPUs of a node,
a node-by-node ring with one channel per NIC (8 x 400 Gb/s NDR on a DGX H100:
busbw min(450, 8 x 50) = 400 GB/s) that pays the network's latency on 2(n-1)
of its steps. A group strided one GPU per node (``stride`` = GPUs per node)
gets one NIC's worth, 50 GB/s: every hop crosses the network.

The layer's compute shrinks as 1/t. Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
sec. 5.1) count 96 B s h^2 (1 + s / 6h) FLOPs per layer for a step with full
recompute (forward twice + backward = 4 forward passes); without recompute it
is 3 passes, 3/4 of that:

    T_comp(t) = 72 tokens h^2 (1 + seq / 6h) / (t * achieved FLOP/s)

Efficiency (no overlap) = T_comp(t) / (T_comp(t) + T_comm(t)).

With NCCL's channels the bandwidth term does not collapse at the node
boundary; what keeps TP inside the NVLink domain (Narayanan et al. 2021,
sec. 3.3) is the rest: the latency of every step on the critical path of
every layer, the node's NICs shared with data and pipeline traffic, and GEMMs
that thin out as t grows.

``tp_layer_comm_time`` is the same ring on one explicit link (inside a node
the two agree: test_costs); ``tp_link`` names the link a TP ring's slowest
hop uses.
"""

from __future__ import annotations

import math

from helpers.collectives import ring_all_reduce_time
from helpers.costs import network
from helpers.topology import H100_80GB, IB_NDR, NVLINK4_H100, Link, Topology, h100_cluster

__all__ = ["Link", "LINKS", "tp_link", "tp_topology", "tp_layer_comm_time", "tp_comm_time",
           "tp_layer_compute_time", "tp_efficiency", "H100_BF16_FLOPS"]

H100_BF16_FLOPS = H100_80GB.peak_flops  # dense BF16 peak, from helpers.topology's GPU table


# The slowest hop of a TP ring inside an H100 node, and once it leaves the node.
LINKS = {"nvlink": NVLINK4_H100, "infiniband": IB_NDR}


def tp_link(t: int, gpus_per_node: int = 8) -> Link:
    """The slowest link a TP ring of t GPUs crosses: NVLink within a node, else the NIC."""
    if t < 1 or gpus_per_node < 1:
        raise ValueError(f"need t >= 1 and gpus_per_node >= 1, got {t}, {gpus_per_node}")
    return LINKS["nvlink"] if t <= gpus_per_node else LINKS["infiniband"]


def tp_topology(t: int, stride: int = 1) -> Topology:
    """The H100 / NDR cluster a TP group of t GPUs ``stride`` apart needs (whole nodes)."""
    if t < 1 or stride < 1:
        raise ValueError(f"need t >= 1 and stride >= 1, got {t}, {stride}")
    g = h100_cluster(1).gpus_per_node
    return h100_cluster(max(1, math.ceil(((t - 1) * stride + 1) / g)))


def tp_layer_comm_time(h: int, tokens: int, t: int, link: Link, dtype_bytes: int = 2,
                       parts: bool = False):
    """Seconds of all-reduce per layer per step (4 of tokens * h * dtype_bytes bytes),
    chapter 03's ring on one ``link`` (every step on that link).

    ``parts=True`` returns (latency term, bandwidth term) instead of their sum.
    """
    nbytes = tokens * h * dtype_bytes
    if parts:
        lat = 4 * ring_all_reduce_time(0, t, link.latency, link.bandwidth)
        return lat, 4 * ring_all_reduce_time(nbytes, t, link.latency, link.bandwidth) - lat
    return 4 * ring_all_reduce_time(nbytes, t, link.latency, link.bandwidth)


def tp_comm_time(h: int, tokens: int, t: int, topo: Topology | None = None, stride: int = 1,
                 dtype_bytes: int = 2, parts: bool = False):
    """Seconds of TP all-reduce per layer per step in NCCL's model: 4 ring all-reduces
    of tokens * h * dtype_bytes bytes over t GPUs ``stride`` apart on ``topo``
    (default: the H100 / NDR nodes they need). ``parts=True``: (latency, bandwidth)."""
    if t == 1:
        return (0.0, 0.0) if parts else 0.0
    topo = topo or tp_topology(t, stride)
    total = 4 * network.ring_time(topo, "all_reduce", tokens * h * dtype_bytes, t, stride)
    if parts:
        lat = 4 * network.ring_latency(topo, "all_reduce", t, stride)
        return lat, total - lat
    return total


def tp_layer_compute_time(h: int, tokens: int, seq: int, t: int,
                          flops: float = 0.5 * H100_BF16_FLOPS) -> float:
    """Seconds of forward + backward matmuls per layer on one of t ranks: 72 tokens h^2
    (1 + seq / 6h) FLOPs (Narayanan et al. 2021, sec. 5.1, without recompute: 3/4 of
    their 96); ``flops``: achieved FLOP/s (default half of peak)."""
    return 72 * tokens * h * h * (1 + seq / (6 * h)) / (t * flops)


def tp_efficiency(t: int, h: int, tokens: int, seq: int, stride: int = 1,
                  topo: Topology | None = None,
                  flops: float = 0.5 * H100_BF16_FLOPS) -> float:
    """Compute time / (compute + all-reduce time) of one layer at TP size t, nothing
    overlapped, the group's GPUs ``stride`` apart (1: node by node)."""
    comp = tp_layer_compute_time(h, tokens, seq, t, flops)
    return comp / (comp + tp_comm_time(h, tokens, t, topo, stride))
