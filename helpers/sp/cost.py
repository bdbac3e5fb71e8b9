"""What ring attention's messages cost on a cluster, and how much of it the attention hides.

Ring attention (``helpers.sp.attention.ring``) sends the same K/V bytes as an all-gather
of K and V, in the same cp - 1 steps, but it is not NCCL's all-gather, and the
difference is in the network. NCCL builds one ring per NIC and runs each through the
node on NVLink (``helpers.costs.network``): a node's traffic across the network is
spread over all of its NICs, 8 x 50 GB/s on a DGX H100. The ring of ring attention
is one ring, in rank order: at every step each rank passes its whole block to the
next rank, all at once, and the step lasts as long as the slowest hop. Inside a
node that is an NVLink hop. Where the ring crosses from one node to the next, one
GPU sends its whole block to one GPU of the next node: one pair, through that
GPU's own NIC (``network.p2p_time`` with one sender on the node), 50 GB/s, however
many NICs the node has. So a step of a ring that spans nodes moves its block at one
NIC's bandwidth. What saves the ring is that it need not be fast, only hidden: Liu,
Zaharia & Abbeel 2023 (sec. 3) size the blocks so that a block's attention outlasts
its transfer.

Exposed time: step i computes on the block it holds while the next one travels, so a
transfer costs only what it takes beyond that step's attention:
``(cp - 1) x max(0, hop - attention / cp)`` with the zigzag layout's equal work per
step (chapter 10, section 4).

Groups: a context-parallel group of ``cp`` GPUs ``stride`` apart (Megatron's order puts
tp consecutive GPUs first, so CP groups are strided by tp). Every CP group of the job
runs its ring at the same time, so the node's GPUs that send across the boundary at
once (one per group: ``stride`` of them, at most the node's GPUs) share its NICs, which
``p2p_time`` models.
"""

from __future__ import annotations

from helpers.costs import network
from helpers.topology.links import Topology
from helpers.validate import positive_int

__all__ = ["ring_hop_time", "ring_attention_time"]


def ring_hop_time(topo: Topology, block_bytes: float, cp: int, stride: int = 1) -> float:
    """Seconds of one ring step's transfer: each rank sends one ``block_bytes`` block to
    the next at once; the slowest hop decides. NVLink inside a node; across nodes one
    GPU pair on one NIC (shared only with the other groups' boundary GPUs)."""
    positive_int("cp", cp)
    if cp == 1:
        return 0.0
    crosses = network.placement(topo, cp, stride).nodes > 1
    return network.p2p_time(topo, block_bytes, crosses_node=crosses,
                            senders_per_node=min(stride, topo.gpus_per_node))


def ring_attention_time(topo: Topology, kv_bytes: float, cp: int, attention: float,
                        stride: int = 1) -> tuple[float, float, float]:
    """(bytes each rank sends, seconds of transfers, seconds not hidden) for one ring
    attention forward: ``kv_bytes`` the whole sequence's K and V, ``attention`` the
    seconds of one rank's attention over the whole sequence (all cp steps)."""
    positive_int("cp", cp)
    if cp == 1:
        return 0.0, 0.0, 0.0
    block = kv_bytes / cp
    hop = ring_hop_time(topo, block, cp, stride)
    steps = cp - 1
    return steps * block, steps * hop, steps * max(0.0, hop - attention / cp)
