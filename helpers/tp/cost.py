"""Why tensor parallelism stays inside a node: its messages against link bandwidth.

Each transformer layer all-reduces its whole activation (tokens x h values)
four times per step (``transformer.tp_comm_bytes``), and nothing overlaps
them in plain TP: the layer waits. With the alpha-beta ring model of chapter
03 (``helpers.collectives.ring_all_reduce_time``) the time per layer is

    T_comm(t) = 4 * [2 (t-1) alpha + 2 (t-1)/t * tokens * h * s / beta]

while the layer's compute shrinks as 1/t. Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
sec. 5.1) count 96 B s h^2 (1 + s / 6h) FLOPs per layer for a step with full
recompute (forward twice + backward = 4 forward passes); without recompute it
is 3 passes, 3/4 of that:

    T_comp(t) = 72 tokens h^2 (1 + seq / 6h) / (t * achieved FLOP/s)

Efficiency (no overlap) = T_comp(1) / t / (T_comp(1) / t + T_comm(t)).

The link decides: a ring inside one 8-GPU H100 node runs over NVLink 4,
450 GB/s per direction per GPU (NVIDIA H100 Tensor Core GPU datasheet, SXM
"NVLink: 900 GB/s" bidirectional); once t exceeds the GPUs of a node the ring
has to cross the network, and its slowest hop is one InfiniBand NDR NIC per
GPU, 400 Gb/s = 50 GB/s (NVIDIA ConnectX-7 / DGX H100 user guide: eight
400 Gb/s NICs for eight GPUs). A 9x slower hop with messages that do not shrink
with t: TP across nodes spends most of its time waiting.

``tp_link`` is the one place that maps a TP size to a link. The links are
chapter 07's presets (``helpers.topology``): the bandwidths above, and the
per-step latency NCCL's own tuning model uses (3.4 us on NVLink, 9.6 us over
the network). At these message sizes the bandwidth term dominates, which
``tp_layer_comm_time(..., parts=True)`` lets a notebook show.
"""

from __future__ import annotations

from helpers.collectives import ring_all_reduce_time
from helpers.topology import H100_80GB, IB_NDR, NVLINK4_H100, Link

__all__ = ["Link", "LINKS", "tp_link", "tp_layer_comm_time", "tp_layer_compute_time",
           "tp_efficiency", "H100_BF16_FLOPS"]

H100_BF16_FLOPS = H100_80GB.peak_flops  # dense BF16 peak, from helpers.topology's GPU table


# The slowest hop of a TP ring inside an H100 node, and once it leaves the node.
LINKS = {"nvlink": NVLINK4_H100, "infiniband": IB_NDR}


def tp_link(t: int, gpus_per_node: int = 8) -> Link:
    """The slowest link a TP ring of t GPUs crosses: NVLink within a node, else the NIC."""
    if t < 1 or gpus_per_node < 1:
        raise ValueError(f"need t >= 1 and gpus_per_node >= 1, got {t}, {gpus_per_node}")
    return LINKS["nvlink"] if t <= gpus_per_node else LINKS["infiniband"]


def tp_layer_comm_time(h: int, tokens: int, t: int, link: Link, dtype_bytes: int = 2,
                       parts: bool = False):
    """Seconds of all-reduce per layer per step (4 of tokens * h * dtype_bytes bytes).

    ``parts=True`` returns (latency term, bandwidth term) instead of their sum.
    """
    nbytes = tokens * h * dtype_bytes
    if parts:
        lat = 4 * ring_all_reduce_time(0, t, link.latency, link.bandwidth)
        return lat, 4 * ring_all_reduce_time(nbytes, t, link.latency, link.bandwidth) - lat
    return 4 * ring_all_reduce_time(nbytes, t, link.latency, link.bandwidth)


def tp_layer_compute_time(h: int, tokens: int, seq: int, t: int,
                          flops: float = 0.5 * H100_BF16_FLOPS) -> float:
    """Seconds of forward + backward matmuls per layer on one of t ranks: 72 tokens h^2
    (1 + seq / 6h) FLOPs (Narayanan et al. 2021, sec. 5.1, without recompute: 3/4 of
    their 96); ``flops``: achieved FLOP/s (default half of peak)."""
    return 72 * tokens * h * h * (1 + seq / (6 * h)) / (t * flops)


def tp_efficiency(t: int, h: int, tokens: int, seq: int, gpus_per_node: int = 8,
                  link: Link | None = None, flops: float = 0.5 * H100_BF16_FLOPS) -> float:
    """Compute time / (compute + exposed all-reduce time) of one layer at TP size t."""
    link = link or tp_link(t, gpus_per_node)
    comp = tp_layer_compute_time(h, tokens, seq, t, flops)
    return comp / (comp + tp_layer_comm_time(h, tokens, t, link))
