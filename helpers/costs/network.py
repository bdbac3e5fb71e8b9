"""Seconds of one collective on one parallel axis's group: NCCL's ring, priced as NCCL does.

The model a reader of NCCL's source will recognise. NCCL (``src/graph/tuning.cc``,
``ncclTopoTuneModel``; read at NCCL 2.30.7, 2026) prices a ring collective on
``P`` ranks spread over ``n`` nodes as

    T = latency + N / algbw,   algbw = busbw x P / nsteps,   i.e.
    T = latency + f(P) x N / busbw

with ``N`` the full tensor (the gathered size for all-gather and reduce-scatter,
nccl-tests' S), ``nsteps`` = 2(P-1) for all-reduce and P-1 for reduce-scatter and
all-gather, and f(P) = nsteps / P: 2(P-1)/P of the tensor leaves each rank in an
all-reduce, (P-1)/P in the other two. ``busbw`` is what nccl-tests reports as
"busbw" (``src/all_reduce.cu``: algbw x 2(n-1)/n; ``doc/PERFORMANCE.md``), the
rate of the ring's slowest link.

Latency (same function): (nsteps - nInterSteps) x intraLat + nInterSteps x
interLat with nInterSteps = 2(n-1) for all-reduce, n-1 for the other two (NCCL
2.8-2.10 and 2.23 onwards; 2.12-2.22 charged 2n). The ring runs node by node: of its
2(P-1) steps only 2(n-1) wait for a network hop, the others are NVLink hops. The
per-step latencies are the links' own (``Link.latency``: chapter 07's presets
carry tuning.cc's Ring/Simple figures, 3.4 us NVLink, 5.7 us PCIe, 9.6 us
network as of NCCL 2.8; 2.30 charges 14 us for the network). NCCL adds a base
latency per call (8.4 us, Ring/Simple) that this model leaves out.

Bus bandwidth: NCCL builds one ring (channel) per NIC, each running through
the node on NVLink and entering and leaving it on its own NIC (busBw = nChannels
x per-channel bandwidth in the same function). Per channel, every hop carries
the same bytes and one hop per node is a network hop, so a node sends across
the network what one rank sends in total, spread over its NICs: with ``k``
NICs per node of ``g`` GPUs and the group's ``m`` GPUs on each node,

    busbw = min(B_intra, B_nic x k m / g)     (B_nic alone when m = 1)

``k m / g``: the group's share of its node's NICs. Every group of an axis runs
its collective at the same time (the 8 DP groups of a TP-8 layout, one per
TP rank), and each GPU has k / g NICs of its own (one on a DGX), so a group
with m GPUs on a node gets k m / g of them. A group packed into whole nodes
(m = g) gets all k: on 8 x H100 with 8 NDR NICs, min(450, 8 x 50) = 400 GB/s,
and each NIC carries 1/g of the node's network bytes. A group strided one GPU
per node (DP over TP-8 layouts) gets one NIC, 50 GB/s: each NIC carries g times
more. Where the group's GPUs are spread unevenly (8, 8, 4), the node with the
fewest of them limits: m is that node's count.

Chapter 07 prices its all-reduces with this module (NCCL's ring, the scattered
ring, the hierarchical all-reduce composed from rings) next to
``helpers.topology.cost``'s tree and its one-channel ring (the ring chapter
03 builds, which the chapter times on real ranks); chapter 09's TP and
chapter 10's context parallelism use it too, and so does every step-time
estimate of the course (``helpers.costs``). All-to-all is chapter 07's "direct" model
(every pair at once, NVLink or the node's NICs, whichever is slower),
evaluated on the axis's group. A point-to-point hop (pipeline stages) is one
message on the slowest link it crosses, the NIC shared by the GPUs of the node
that send at once.

A ring whose neighbours sit on different nodes (``scattered_ring_time``): NCCL
orders its rings node by node itself, but a ring run in a rank order that
alternates nodes (chapter 03's ring on an interleaved rank list, or any
hand-written ring) makes every hop a network hop. Each GPU then sends all of
its share through the network, not one GPU per node per channel: each NIC
carries up to m times more, and all 2(P-1) steps wait for the network.
A hierarchical all-reduce (``hierarchical_all_reduce_time``) builds its groups
from the nodes, so it gets the node-contiguous result whatever the rank order.

How production differs: NCCL picks the tree, NVLink SHARP (H100 NVSwitch) or
CollNet per message size where its model says they beat the ring; LL and LL128
protocols cut latency for small messages; the Simple protocol's busbw is ~80 %
of the line rate on NVLink (NVIDIA's figures, ``tests/test_costs.py``), which
the links here do not discount.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

from helpers.topology.cost import collective_cost
from helpers.topology.links import Topology
from helpers.validate import positive_int

__all__ = ["RING_COLLECTIVES", "COLLECTIVES", "Placement", "placement", "ring_steps",
           "inter_node_steps", "wire_factor", "sent_bytes", "nic_share", "ring_latency",
           "bus_bandwidth", "ring_time", "scattered_bus_bandwidth", "scattered_ring_time",
           "hierarchical_all_reduce_time", "all_to_all_time", "collective_time", "p2p_time",
           "clear_caches"]

RING_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
COLLECTIVES = RING_COLLECTIVES + ("all_to_all",)


@dataclass(frozen=True)
class Placement:
    """Where a group of ``size`` GPUs spaced ``stride`` apart (the group of GPU 0;
    every other group of the axis looks the same) lands: ``nodes`` it spans, the
    fewest and the most of its GPUs on one of them."""

    size: int
    stride: int
    nodes: int
    min_per_node: int
    max_per_node: int

    @property
    def even(self) -> bool:
        return self.min_per_node == self.max_per_node


def _check(topo: Topology, size: int, stride: int) -> None:
    if not isinstance(topo, Topology):
        raise TypeError(f"expected a Topology, got {type(topo).__name__}")
    for name, v in (("size", size), ("stride", stride)):
        positive_int(name, v)
    if (size - 1) * stride >= topo.world_size:
        raise ValueError(f"a group of {size} GPUs {stride} apart needs "
                         f"{(size - 1) * stride + 1} GPUs; {topo.name} has {topo.world_size}")


@functools.lru_cache(maxsize=None)
def placement(topo: Topology, size: int, stride: int = 1) -> Placement:
    """The nodes the group {0, stride, ..., (size-1) stride} spans (GPUs are numbered
    node by node, as ``Topology.node_of``)."""
    _check(topo, size, stride)
    counts = Counter(i * stride // topo.gpus_per_node for i in range(size)).values()
    return Placement(size, stride, len(counts), min(counts), max(counts))


def ring_steps(collective: str, size: int) -> int:
    """NCCL's nsteps: 2(P-1) for all-reduce, P-1 for reduce-scatter and all-gather."""
    _ring_collective(collective)
    return 2 * (size - 1) if collective == "all_reduce" else size - 1


def inter_node_steps(collective: str, nodes: int) -> int:
    """NCCL's nInterSteps: the ring's steps that wait for a network hop, 2(n-1) for
    all-reduce, n-1 for reduce-scatter and all-gather (0 inside one node)."""
    _ring_collective(collective)
    return 2 * (nodes - 1) if collective == "all_reduce" else nodes - 1


def wire_factor(collective: str, size: int) -> float:
    """Share of the tensor each rank sends: 2(P-1)/P for all-reduce, (P-1)/P for
    reduce-scatter, all-gather and all-to-all (nccl-tests' busbw factors)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose from {COLLECTIVES}")
    return (2 if collective == "all_reduce" else 1) * (size - 1) / size


def sent_bytes(collective: str, nbytes: float, size: int) -> float:
    """Bytes each rank of ``size`` sends for one collective on an ``nbytes`` tensor."""
    return wire_factor(collective, size) * nbytes


def nic_share(topo: Topology, per_node: int) -> float:
    """NICs a group with ``per_node`` GPUs on a node can use while every group of its
    axis runs at once: its share ``k per_node / g`` of the node's ``k`` NICs."""
    return topo.nics_per_node * per_node / topo.gpus_per_node


def _ring_collective(collective: str) -> None:
    if collective not in RING_COLLECTIVES:
        raise ValueError(f"{collective!r} is not a ring collective; choose from "
                         f"{RING_COLLECTIVES} (all-to-all: all_to_all_time)")


def ring_latency(topo: Topology, collective: str, size: int, stride: int = 1) -> float:
    """Seconds at zero bytes: (nsteps - nInterSteps) intra latencies + nInterSteps
    network latencies (NCCL's tuning.cc)."""
    _ring_collective(collective)
    if size == 1:
        return 0.0
    pl = placement(topo, size, stride)
    inter = inter_node_steps(collective, pl.nodes)
    return ((ring_steps(collective, size) - inter) * topo.intra.latency
            + inter * topo.inter.latency)


def bus_bandwidth(topo: Topology, size: int, stride: int = 1) -> float:
    """The ring's busbw (bytes/s): NVLink inside one node; across nodes the node's
    NICs that the group owns, ``nic_share`` x B_nic, or NVLink if that is slower."""
    pl = placement(topo, size, stride)
    if pl.nodes == 1:
        return topo.intra.bandwidth
    nics = topo.inter.bandwidth * nic_share(topo, pl.min_per_node)
    return nics if pl.max_per_node == 1 else min(topo.intra.bandwidth, nics)


@functools.lru_cache(maxsize=None)
def _ring(topo: Topology, collective: str, size: int, stride: int) -> tuple[float, float]:
    """(latency s, seconds per byte of the tensor) of one ring collective."""
    return (ring_latency(topo, collective, size, stride),
            wire_factor(collective, size) / bus_bandwidth(topo, size, stride))


def ring_time(topo: Topology, collective: str, nbytes: float, size: int,
              stride: int = 1) -> float:
    """Seconds of one ring all-reduce / reduce-scatter / all-gather of an ``nbytes``
    tensor over the ``size`` GPUs ``stride`` apart: latency + f(P) N / busbw."""
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if size == 1 or nbytes == 0:
        return 0.0
    latency, per_byte = _ring(topo, collective, size, stride)
    return latency + per_byte * nbytes


def scattered_bus_bandwidth(topo: Topology) -> float:
    """busbw of a ring in which every hop crosses nodes: each GPU's whole share goes
    through the network, over its own k / g of the node's NICs (B_nic on a DGX,
    one NIC per GPU), or NVLink if that is slower."""
    return min(topo.intra.bandwidth, topo.inter.bandwidth * nic_share(topo, 1))


def scattered_ring_time(topo: Topology, collective: str, nbytes: float, size: int) -> float:
    """Seconds of a ring over the first ``size`` GPUs run in an order whose neighbours
    sit on different nodes: nsteps network latencies, busbw ``scattered_bus_bandwidth``.
    Inside one node there is no network hop: the node-contiguous ring's time."""
    _ring_collective(collective)
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    pl = placement(topo, size, 1)
    if pl.nodes == 1 or nbytes == 0:
        return ring_time(topo, collective, nbytes, size)
    return (ring_steps(collective, size) * topo.inter.latency
            + wire_factor(collective, size) * nbytes / scattered_bus_bandwidth(topo))


def hierarchical_all_reduce_time(topo: Topology, nbytes: float, size: int) -> float:
    """Seconds of the two-level all-reduce on ``size`` GPUs filling whole nodes (or
    inside one): a ring reduce-scatter inside each node, g rings across nodes on 1/g
    of the tensor each (one GPU per node: ``ring_time`` with stride g), a ring
    all-gather inside. The phases run one after another. The groups come from the
    nodes, not the rank order, so no order can make it cross the network more."""
    pl = placement(topo, size, 1)
    if not pl.even:
        raise ValueError(f"{size} GPUs do not fill whole nodes of {topo.gpus_per_node}")
    m, n = pl.max_per_node, pl.nodes
    inside = (ring_time(topo, "reduce_scatter", nbytes, m)
              + ring_time(topo, "all_gather", nbytes, m))
    across = ring_time(topo, "all_reduce", nbytes / m, n, topo.gpus_per_node) if n > 1 else 0.0
    return inside + across


@functools.lru_cache(maxsize=None)
def _all_to_all(topo: Topology, size: int, stride: int) -> tuple[float, float]:
    """(latency, seconds per byte) of chapter 07's direct all-to-all on the group.
    The model needs the same GPU count on every node; an uneven group (20 GPUs on
    8-GPU nodes: 8, 8, 4) is priced on the even spread of ``size`` GPUs over the
    fewest nodes it fits (its time depends on the GPUs per node, not their ids)."""
    pl = placement(topo, size, stride)
    if pl.even:
        ranks = [i * stride for i in range(size)]
    else:
        m = next(m for m in range(min(size, topo.gpus_per_node), 0, -1)
                 if size % m == 0 and size // m <= topo.nodes)
        ranks = [node * topo.gpus_per_node + i for node in range(size // m) for i in range(m)]
    # the model is alpha + N x (a rate): two sizes give both
    t0 = collective_cost(topo, "all_to_all", 0.0, ranks, "direct").time
    t1 = collective_cost(topo, "all_to_all", 1e9, ranks, "direct").time
    return t0, (t1 - t0) / 1e9


def all_to_all_time(topo: Topology, nbytes: float, size: int, stride: int = 1) -> float:
    """Seconds of one all-to-all in which each rank holds ``nbytes`` (a 1/size share
    for every rank), chapter 07's direct model on the group."""
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if size == 1 or nbytes == 0:
        return 0.0
    latency, per_byte = _all_to_all(topo, size, stride)
    return latency + per_byte * nbytes


def collective_time(topo: Topology, collective: str, nbytes: float, size: int,
                    stride: int = 1) -> float:
    """Seconds of one collective of a parallel axis: the ring for all-reduce,
    reduce-scatter and all-gather, the direct model for all-to-all."""
    if collective == "all_to_all":
        return all_to_all_time(topo, nbytes, size, stride)
    _ring_collective(collective)
    return ring_time(topo, collective, nbytes, size, stride)


def p2p_time(topo: Topology, nbytes: float, *, crosses_node: bool,
             senders_per_node: int | None = None) -> float:
    """Seconds of one point-to-point message: NVLink inside a node; across nodes a
    NIC, shared by the ``senders_per_node`` GPUs of the node that send at once
    (default all of them): B_nic min(1, k / senders)."""
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not crosses_node:
        return topo.intra.time(nbytes)
    senders = min(topo.gpus_per_node, senders_per_node or topo.gpus_per_node)
    share = min(1.0, topo.nics_per_node / senders)
    return topo.inter.latency + nbytes / (topo.inter.bandwidth * share)


def clear_caches() -> None:
    """Forget the cached placements and collective terms (``helpers.costs.clear_caches``
    calls it, with the other modules' caches, for cold timings)."""
    for cached in (placement, _ring, _all_to_all):
        cached.cache_clear()
