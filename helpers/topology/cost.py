"""Cost models of collectives on a ``Topology``: time and bytes that cross nodes.

Usable without ranks: ``all_reduce_time(topology, nbytes, ranks, "ring")``
answers "how long does this all-reduce take on these GPUs?", which is what
placement questions need (tensor parallelism inside a node or across nodes,
chapters 08-09; data parallelism across nodes, chapter 04).

Notation: ``N`` bytes (the full tensor; for reduce-scatter and all-gather the
full, gathered size, as nccl-tests' S), the participating GPUs span ``n``
nodes with ``m`` GPUs on each, ``P = n m``. Intra-node link: latency a_i,
bandwidth B_i per GPU per direction; NIC: a_n, B_n; ``k`` NICs per node.
Every phase is a sequence of steps; a step costs its slowest hop, alpha + n/beta
(Hockney 1994; Thakur, Rabenseifner & Gropp 2005, sec. 4).

* ``ring`` (Patarasuk & Yuan 2009): chapter 03's ring, one channel run step by
  step in rank order, blind to the hierarchy. With n > 1 every one of its 2(P-1)
  steps waits for the boundary hop it contains, through one NIC per GPU:
      T = 2(P-1) (a_n + N/P / min(B_i, B_n)).
  It is what the real-rank demos of chapter 07 run and time. It is *not* the ring
  NCCL runs: NCCL pipelines a node-contiguous ring per NIC and pays the network
  latency only 2(n-1) times (``helpers.costs.network.ring_time``, the course's
  model of it); this flat ring's time is NCCL's model of a ring whose neighbours
  sit on different nodes (``helpers.costs.network.scattered_ring_time``) when
  every GPU has a NIC of its own.
* ``tree``: NCCL's double binary tree (Sanders, Speck & Traeff 2009, "Two-tree
  algorithms for full bandwidth broadcast, reduction and scan"; NCCL 2.4,
  NVIDIA developer blog 2019): a chain inside each node, two complementary
  binary trees across nodes, each carrying half the data, pipelined. Latency
  grows with log2 of the node count; every rank moves ~2N:
      T = 2((m-1) a_i + ceil(log2 n) a_n) + 2N / (0.92 B)
  (B: NVLink, or the group's k m / g NICs across nodes, one tree per NIC; 0.92:
  NCCL's own correction for the tree's bandwidth, src/graph/tuning.cc)
  (the latency term is NCCL's own, src/graph/tuning.cc).
* ``hierarchical`` (the 2D / hierarchical all-reduce of e.g. Jia et al. 2018,
  "Highly scalable deep learning training system with mixed-precision",
  sec. 3.3; Horovod's hierarchical allreduce): reduce-scatter inside each node
  (each GPU ends with the node's sum of N/m bytes), m independent all-reduces
  across nodes on N/m bytes each (one per local GPU index, each on its own
  NIC when k >= m), all-gather inside the node:
      T = 2(m-1)(a_i + N/m / B_i) + 2(n-1)(a_n + N/(m n) / B_n')
  with B_n' = B_n min(k, m) / m (GPUs share the node's NICs).

Bytes that cross node boundaries (summed over every message): ring
n 2(P-1) N/P; tree and hierarchical 2(n-1) N. The totals are alike; what
differs is how many NICs carry them. The flat ring pushes all of its share
through one NIC per node, 2(P-1)/P N each; the hierarchical one spreads it
over m NICs, 2(n-1)/n N/m each: about 1/m of the flat ring's per NIC. Its
latency is 2(m-1) a_i + 2(n-1) a_n instead of 2(P-1) a_n.

How production differs: NCCL builds several rings ("channels") at once and
routes each one through the node on NVLink, entering and leaving on different
NICs, so its ring already uses every NIC, like the hierarchical scheme does
(``helpers.costs.network`` prices that ring; chapter 07 compares it with these
models). It picks ring, tree, NVLS or CollNet (and a protocol) per message size
from a model much like these, with per-size correction factors. NVLink SHARP
(NVLS, NCCL 2.17+) on H100 NVSwitch reduces inside the switch and beats every
formula here inside a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from helpers.topology.links import Topology

__all__ = ["Cost", "layout", "packed_ranks", "spread_ranks", "collective_cost",
           "all_reduce_time", "ALGORITHMS", "COLLECTIVES"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
TREE_BW_FACTOR = 0.92   # NCCL's tree all-reduce bandwidth correction (src/graph/tuning.cc)
ALGORITHMS = {"all_reduce": ("ring", "tree", "hierarchical"),
              "reduce_scatter": ("ring", "hierarchical"),
              "all_gather": ("ring", "hierarchical"),
              "all_to_all": ("direct",)}


@dataclass(frozen=True)
class Cost:
    """What a model predicts for one collective.

    ``time``: seconds. ``cross_node_bytes``: bytes sent from one node to another,
    summed over all messages. ``nic_bytes``: bytes each NIC in use sends (every
    NIC in use sends the same in these algorithms; for the tree, the mean).
    ``phases``: (name, seconds) in order.
    """

    collective: str
    algorithm: str
    nbytes: float
    nodes: int
    per_node: int
    time: float
    cross_node_bytes: float
    nic_bytes: float
    phases: tuple = ()


def layout(topology: Topology, ranks) -> tuple[int, int]:
    """(nodes spanned n, GPUs per spanned node m) for ``ranks``.

    ``ranks``: an int (that many GPUs, packed node by node from GPU 0) or a
    sequence of distinct global GPU ids. The models need the same count on
    every spanned node.
    """
    g = topology.gpus_per_node
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        if not 1 <= ranks <= topology.world_size:
            raise ValueError(f"{ranks} ranks do not fit on {topology.name} "
                             f"({topology.world_size} GPUs)")
        if ranks > g and ranks % g:
            raise ValueError(f"{ranks} ranks do not fill whole nodes of {g} GPUs: use a "
                             f"multiple of {g} (or at most {g}, inside one node)")
        return (1, ranks) if ranks <= g else (ranks // g, g)
    ranks = list(ranks)
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be a non-empty list of distinct GPU ids, got {ranks!r}")
    per_node: dict[int, int] = {}
    for r in ranks:
        node = topology.node_of(r)
        per_node[node] = per_node.get(node, 0) + 1
    counts = set(per_node.values())
    if len(counts) != 1:
        raise ValueError(f"ranks {ranks} put {sorted(per_node.items())} (node, GPUs) on their "
                         f"nodes; the models need the same number of GPUs on every node used")
    return len(per_node), counts.pop()


def packed_ranks(topology: Topology, count: int) -> list[int]:
    """``count`` GPUs filling nodes in order: 0, 1, 2, ... (inside a node first)."""
    layout(topology, count)
    return list(range(count))


def spread_ranks(topology: Topology, count: int) -> list[int]:
    """``count`` GPUs, one per node first: 0, g, 2g, ..., then 1, g+1, ... (across nodes)."""
    n, g = topology.nodes, topology.gpus_per_node
    if not isinstance(count, int) or not 1 <= count <= topology.world_size:
        raise ValueError(f"count must be 1..{topology.world_size}, got {count!r}")
    if count > n and count % n:
        raise ValueError(f"{count} GPUs do not spread evenly over {n} nodes: use a multiple "
                         f"of {n} (or at most {n})")
    return [node * g + local for local in range(g) for node in range(n)][:count]


def _steps(count: int, latency: float, nbytes: float, bandwidth: float) -> float:
    return count * (latency + nbytes / bandwidth)


def _ring(topology, coll, N, n, m):
    P = n * m
    steps = 2 * (P - 1) if coll == "all_reduce" else P - 1
    if n == 1:
        t = _steps(steps, topology.intra.latency, N / P, topology.intra.bandwidth)
        return t, 0.0, 0.0, (("ring over " + topology.intra.name, t),)
    bw = min(topology.intra.bandwidth, topology.inter.bandwidth)
    t = _steps(steps, topology.inter.latency, N / P, bw)
    cross = n * steps * N / P          # n boundary hops, each carrying one chunk per step
    return t, cross, cross / n, (("ring, every step waits for a node boundary", t),)


def _hierarchical(topology, coll, N, n, m):
    if n == 1 or m == 1:
        return _ring(topology, coll, N, n, m)
    intra, inter, k = topology.intra, topology.inter, topology.nics_per_node
    nics = min(k, m)
    bw_n = min(intra.bandwidth, inter.bandwidth * nics / m)  # m rings share `nics` NICs
    inner = _steps(m - 1, intra.latency, N / m, intra.bandwidth)  # one intra RS or AG
    if coll == "all_reduce":
        outer = _steps(2 * (n - 1), inter.latency, N / (m * n), bw_n)
        phases = (("reduce-scatter inside nodes", inner), ("all-reduce across nodes", outer),
                  ("all-gather inside nodes", inner))
        cross = 2 * (n - 1) * N
    else:
        outer = _steps(n - 1, inter.latency, N / (m * n), bw_n)
        name = "reduce-scatter" if coll == "reduce_scatter" else "all-gather"
        phases = ((f"{name} inside nodes", inner), (f"{name} across nodes", outer))
        if coll == "all_gather":
            phases = phases[::-1]
        cross = (n - 1) * N
    return sum(t for _, t in phases), cross, cross / (n * nics), phases


def _tree(topology, coll, N, n, m):
    intra, inter = topology.intra, topology.inter
    # NCCL runs a tree per channel, one channel per NIC, like its rings: the group's
    # m GPUs on a node own k m / g of the node's k NICs (helpers.costs.network.nic_share)
    nics = topology.nics_per_node * m / topology.gpus_per_node
    bw = intra.bandwidth if n == 1 else min(intra.bandwidth, inter.bandwidth * nics)
    # tuning.cc (NCCL 2.28, ncclTopoTuneModel) charges the tree all-reduce 0.92 of that
    # bus bandwidth ("busBw*.92"): its chunks take two directions through each node
    bw *= TREE_BW_FACTOR
    lat = 2 * ((m - 1) * intra.latency + math.ceil(math.log2(n)) * inter.latency)
    t = lat + 2 * N / bw
    cross = 2 * (n - 1) * N  # n-1 tree edges x 2 trees x (N/2 up + N/2 down)
    return t, cross, cross / (n * nics), (("tree latency", lat), ("tree bandwidth", 2 * N / bw))


def _all_to_all(topology, coll, N, n, m):
    intra, inter = topology.intra, topology.inter
    P = n * m
    nics = min(topology.nics_per_node, m)
    t_intra = (m - 1) * N / P / intra.bandwidth        # per GPU, to its node's other GPUs
    if n == 1:
        return intra.latency + t_intra, 0.0, 0.0, (("all-to-all inside the node",
                                                     intra.latency + t_intra),)
    per_gpu_out = (P - m) * N / P                       # to the GPUs of other nodes
    t_inter = max(m * per_gpu_out / (nics * inter.bandwidth), per_gpu_out / intra.bandwidth)
    t = inter.latency + max(t_intra, t_inter)          # all pairs exchange at once
    cross = P * per_gpu_out
    return t, cross, cross / (n * nics), (("all-to-all, slowest of NVLink and NICs", t),)


_MODELS = {"ring": _ring, "hierarchical": _hierarchical, "tree": _tree, "direct": _all_to_all}


def collective_cost(topology: Topology, collective: str, nbytes: float, ranks,
                    algorithm: str = "ring") -> Cost:
    """Predicted time and cross-node bytes of one collective on ``ranks`` of ``topology``."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose from {COLLECTIVES}")
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(f"{collective} has no {algorithm!r} model here; choose from "
                         f"{ALGORITHMS[collective]} (NCCL runs reduce-scatter and all-gather "
                         f"as rings only)")
    if not isinstance(topology, Topology):
        raise TypeError(f"expected a Topology, got {type(topology).__name__}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    n, m = layout(topology, ranks)
    if n * m == 1:
        return Cost(collective, algorithm, nbytes, 1, 1, 0.0, 0.0, 0.0)
    t, cross, nic, phases = _MODELS[algorithm](topology, collective, float(nbytes), n, m)
    return Cost(collective, algorithm, nbytes, n, m, t, cross, nic, phases)


def all_reduce_time(topology: Topology, nbytes: float, ranks, algorithm: str = "ring") -> float:
    """Seconds for an all-reduce of ``nbytes`` over ``ranks`` (an int, packed, or GPU ids).

    ``algorithm``: "ring" (flat), "tree" (NCCL's double binary tree) or
    "hierarchical" (reduce-scatter / all-reduce across nodes / all-gather).
    """
    return collective_cost(topology, "all_reduce", nbytes, ranks, algorithm).time
