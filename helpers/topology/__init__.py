"""Topology: why the same number of GPUs behaves differently depending on its wires.

What
----
A cluster is a hierarchy: GPUs inside a node share a fast fabric (NVLink
through NVSwitch: 450 GB/s per H100 each way), nodes share a slower network
(InfiniBand NDR: 50 GB/s per NIC each way, 8 NICs per DGX H100). A collective
that ignores the hierarchy (chapter 03's flat ring over every GPU) runs at the
speed of its slowest hop and pays the network's latency at every one of its
2(p-1) steps. One that follows it (the hierarchical all-reduce: reduce-scatter
inside the node, all-reduce across nodes on 1/g of the data, all-gather inside
the node) keeps most bytes on the fast links and spreads the rest over every
NIC.

This package
------------
* ``gpus``: ``GPU`` (memory, dense 16-bit peak FLOP/s) and its presets
  ``H100_80GB``, ``A100_80GB``: the course's one table of GPU peaks.
* ``links``: ``Link`` and the validated ``Topology`` dataclass, presets with
  cited figures (H100 / A100 nodes, PCIe boxes, InfiniBand HDR / NDR, Ethernet).
* ``cost``: the models: ``collective_cost(topology, collective, nbytes, ranks,
  algorithm)`` and ``all_reduce_time(topology, nbytes, ranks, algorithm)`` for
  ring, NCCL's double binary tree and the hierarchical all-reduce (also
  reduce-scatter, all-gather, all-to-all), with bytes crossing node boundaries.
  No ranks needed: chapters 08-09 ask it where tensor parallelism should live.
* ``hierarchical``: the real thing on ranks: ``hierarchical_all_reduce(tensor,
  gpus_per_node, group=None)`` from process subgroups (``node_groups`` with
  ``dist.new_group``, or ``mesh_groups`` with a 2-D DeviceMesh), a ``Wire`` that
  counts cross-node bytes and can emulate a slow network on one machine.
* ``nvidia_smi``: ``nvidia-smi topo -m`` parsed into a ``Topology``.

Cost and how production differs
--------------------------------
The hierarchical all-reduce adds phases (2(g-1) intra steps, 2(n-1) inter
steps instead of 2(p-1) steps that all wait on the network) and needs two sets
of communicators. NCCL gets the same effect inside one "flat" call: it builds
several rings (channels) that run through each node on NVLink and leave by
different NICs, ordered node by node from the topology whatever the ranks'
numbering (NCCL 2.30.7, ``src/graph/search.cc`` and ``src/graph/connect.cc``), and double binary trees across nodes; it chooses per message
size from a cost model like ``cost``. Knobs: NCCL_ALGO (Ring, Tree, NVLS,
CollnetDirect...), NCCL_PROTO (LL, LL128, Simple), NCCL_P2P_LEVEL, NCCL_IB_HCA;
NCCL_DEBUG=INFO prints the rings and trees it built.
"""

from helpers.topology.cost import (ALGORITHMS, COLLECTIVES, Cost, all_reduce_time,
                                   collective_cost, layout, packed_ranks, spread_ranks)
from helpers.topology.gpus import A100_80GB, GPUS, GPU, H100_80GB
from helpers.topology.hierarchical import (NodeGroups, Wire, check_grid, emulated_topology,
                                           grid_layout, hierarchical_all_reduce, mesh_groups,
                                           node_groups, ring_all_gather, ring_all_reduce,
                                           ring_reduce_scatter, time_emulated,
                                           time_placement)
from helpers.topology.links import (ETH_100G, IB_HDR, IB_NDR, LINKS, NVLINK3_A100,
                                    NVLINK4_H100, PCIE4_X16, PCIE5_X16, PRESETS, Link, Topology,
                                    a100_cluster, h100_cluster, pcie_cluster, preset)
from helpers.topology.nvidia_smi import (SAMPLES, parse_topo_matrix, read_live,
                                         topology_from_nvidia_smi)

__all__ = ["GPU", "GPUS", "H100_80GB", "A100_80GB", "Link", "Topology", "LINKS", "NVLINK4_H100", "NVLINK3_A100", "PCIE4_X16", "PCIE5_X16",
           "IB_HDR", "IB_NDR", "ETH_100G", "PRESETS", "preset", "h100_cluster", "a100_cluster",
           "pcie_cluster", "Cost", "collective_cost", "all_reduce_time", "layout",
           "packed_ranks", "spread_ranks", "ALGORITHMS", "COLLECTIVES", "Wire", "NodeGroups",
           "check_grid", "grid_layout", "node_groups", "mesh_groups", "ring_reduce_scatter",
           "ring_all_gather", "ring_all_reduce", "hierarchical_all_reduce", "emulated_topology",
           "time_emulated", "time_placement", "SAMPLES", "parse_topo_matrix", "topology_from_nvidia_smi",
           "read_live"]
