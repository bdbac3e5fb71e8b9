"""The hierarchical all-reduce on real ranks, with node boundaries you can see.

Ranks are grouped into "nodes" of ``gpus_per_node`` consecutive ranks (rank
r lives on node r // g, as torchrun numbers them). Two families of process
subgroups follow from that grid (a (nodes, g) array of ranks):

* ``intra``: the g ranks of one node (a row), and
* ``inter``: the ranks with the same local index on every node (a column).

The all-reduce in three phases (see ``helpers.topology.cost``):

1. ring reduce-scatter inside the node: local rank j ends with the node's sum
   of chunk j (N/g bytes), over the fast links only;
2. ring all-reduce of that chunk across nodes, in the inter group: the only
   phase that crosses a node boundary, g of them in parallel, each on N/g;
3. ring all-gather inside the node.

Both ways of building the groups are here: ``node_groups`` calls
``dist.new_group`` once per row and per column (every rank must make every
call, in the same order, members or not), and ``mesh_groups`` asks a 2-D
``DeviceMesh`` (torch.distributed.device_mesh) for its two dimensions, which
does the same bookkeeping for you.

A ``Wire`` carries every message of these rings. It counts the bytes that
leave the sender's node (counted, not assumed) and, given a ``Link``, makes
each such message late by ``latency + bytes / bandwidth`` (the sender sleeps
before posting it), which turns one CPU machine into a cluster with a slow
network between "nodes": the flat ring and the hierarchical one can then be
timed on real ranks and compared with the cost model. What it cannot do is
show NVLink vs InfiniBand: on one machine every message goes through the same
loopback, and the model treats that intra-node part as free.

Cost: building the groups is a collective per group (a few ms each on gloo):
build them once per launch and pass ``groups=``.

The rings are chapter 03's own (``helpers.collectives``): ``ring_reduce_scatter``
and friends below only plug ``wire.exchange`` into their exchange hook, with
``segmented=False``, so that each chunk crosses as one message per step: what
the Wire prices (latency + bytes / bandwidth) and what the cost model counts.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers import collectives  # chapter 03's ring, with its exchange hook
from helpers.collectives import check_summable, flat_view, post_pair
from helpers.mesh import axis_groups
from helpers.topology.links import Link, Topology
from helpers.validate import is_int, positive_int

__all__ = ["Wire", "NodeGroups", "check_grid", "grid_layout", "node_groups", "mesh_groups",
           "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "hierarchical_all_reduce", "emulated_topology", "time_emulated", "time_placement"]


class Wire:
    """Carries ring messages; counts (and optionally delays) those that cross nodes.

    ``gpus_per_node``: global rank r is on node r // gpus_per_node.
    ``slow_link``: if given, each cross-node message is sent
    ``slow_link.time(nbytes)`` seconds late. One Wire per rank; its counters
    cover what *this* rank sent, and ``sends`` lists each of its messages as
    ``(from global rank, to global rank, bytes, crossed a node boundary)``, in
    posting order: the record chapter 07's picture of a ring is drawn from
    (``helpers.drawing.topology``).
    """

    def __init__(self, gpus_per_node: int, slow_link: Link | None = None):
        positive_int("gpus_per_node", gpus_per_node)
        self.gpus_per_node = gpus_per_node
        self.slow_link = slow_link
        self.cross_bytes = 0      # bytes this rank sent to another node
        self.cross_messages = 0
        self.local_bytes = 0      # bytes this rank sent inside its node
        self.sends: list[tuple[int, int, int, bool]] = []

    def node(self, global_rank: int) -> int:
        return global_rank // self.gpus_per_node

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, right: int, left: int,
                 group=None) -> list:
        """The ring's exchange hook (``helpers.collectives``): send ``send`` to group rank
        ``right``, receive ``recv`` from ``left``; returns the requests to wait on.

        Counts the bytes that leave for another node (sleeping first, if there is a
        slow link: the message is late by exactly what the link would cost), then
        posts the pair as chapter 03 does (``post_pair``: one batch, sends and
        receives progress together).
        """
        if send.numel():
            g = group if group is not None else dist.group.WORLD
            nbytes = send.numel() * send.element_size()
            me, to = dist.get_rank(), dist.get_global_rank(g, right)
            crossed = self.node(to) != self.node(me)
            self.sends.append((me, to, nbytes, crossed))
            if crossed:
                self.cross_bytes += nbytes
                self.cross_messages += 1
                if self.slow_link is not None:
                    time.sleep(self.slow_link.time(nbytes))  # the emulated slow link
            else:
                self.local_bytes += nbytes
        return post_pair(send, recv, right, left, group)


# Chapter 03's ring phases with every message through a Wire (default: Wire(1),
# which counts only), one message per chunk and step (segmented=False).

def ring_reduce_scatter(tensor: torch.Tensor, group=None, wire: Wire | None = None, *,
                        order=None):
    """Chapter 03's ring reduce-scatter, every message through ``wire``.

    In place; returns chunk ``rank`` (of ``chunk_bounds(numel, p)``), which
    then holds the sum over ``group``. ``order``: the ring's rank order
    (``helpers.collectives.ring_neighbours``; default: rank order).
    """
    wire = wire or Wire(1)
    return collectives.ring_reduce_scatter(tensor, group, exchange=wire.exchange, segmented=False,
                                           order=order)


def ring_all_gather(tensor: torch.Tensor, group=None, wire: Wire | None = None, *, order=None):
    """Chapter 03's ring all-gather through ``wire``: chunk ``rank`` in, every chunk out."""
    wire = wire or Wire(1)
    return collectives.ring_all_gather(tensor, group, exchange=wire.exchange, order=order)


def ring_all_reduce(tensor: torch.Tensor, group=None, wire: Wire | None = None, *, order=None):
    """The flat ring: reduce-scatter then all-gather over all of ``group``. In place.

    ``order``: the ranks in the order the ring visits them. A topology-blind ring
    (this one, or any hand-written one) hops between neighbours in that order, so
    ``order=[0, 2, 1, 3]`` on 2 nodes x 2 makes every hop cross a node boundary,
    where ``[0, 1, 2, 3]`` crosses at two of four. NCCL does not take its ring order
    from the rank order: it builds each ring from the topology, node by node (chapter
    07, section 2).
    """
    wire = wire or Wire(1)
    return collectives.ring_all_reduce(tensor, group, exchange=wire.exchange, segmented=False,
                                       order=order)


# --------------------------------------------------------------------------
# The grid of ranks and its two kinds of subgroup.
# --------------------------------------------------------------------------

def check_grid(world_size: int, gpus_per_node: int) -> int:
    """Number of nodes; a ValueError naming the constraint if the ranks don't fill them."""
    positive_int("gpus_per_node", gpus_per_node)
    if world_size % gpus_per_node:
        raise ValueError(f"{world_size} ranks do not fill nodes of {gpus_per_node} GPUs: the "
                         f"world size must be a multiple of gpus_per_node")
    return world_size // gpus_per_node


def grid_layout(world_size: int, gpus_per_node: int) -> tuple[list, list]:
    """(intra, inter): rank lists of every node (rows) and every local index (columns).

    >>> grid_layout(6, 3)
    ([[0, 1, 2], [3, 4, 5]], [[0, 3], [1, 4], [2, 5]])
    """
    dims, sizes = ("node", "local"), {"node": check_grid(world_size, gpus_per_node),
                                      "local": gpus_per_node}  # local index fastest
    return axis_groups("local", dims, sizes), axis_groups("node", dims, sizes)


@dataclass
class NodeGroups:
    """This rank's two subgroups, and where it sits in the grid."""

    intra: object        # the g ranks of my node
    inter: object        # the ranks with my local index, one per node
    node: int
    local: int
    gpus_per_node: int


def node_groups(gpus_per_node: int, group=None) -> NodeGroups | None:
    """Build the row and column subgroups of ``group`` (default: the world) with new_group.

    A collective over the default group: every rank calls it, with the same
    arguments, members of ``group`` or not (those get None). Nodes are formed
    from ``group``'s ranks in group order.
    """
    members = dist.get_process_group_ranks(group) if group is not None \
        else list(range(dist.get_world_size()))
    rows, cols = grid_layout(len(members), gpus_per_node)
    me = dist.get_rank()
    mine = {}
    for kind, lists in (("intra", rows), ("inter", cols)):
        for idx in lists:
            ranks = [members[i] for i in idx]
            pg = dist.new_group(ranks)  # every rank creates every group, same order
            if me in ranks:
                mine[kind] = pg
    if me not in members:
        return None  # a rank outside ``group`` only helped create the subgroups
    pos = members.index(me)
    return NodeGroups(mine["intra"], mine["inter"], pos // gpus_per_node,
                      pos % gpus_per_node, gpus_per_node)


def mesh_groups(gpus_per_node: int) -> NodeGroups:
    """The same two subgroups from a 2-D DeviceMesh of shape (nodes, gpus_per_node)."""
    from torch.distributed.device_mesh import init_device_mesh

    nodes = check_grid(dist.get_world_size(), gpus_per_node)
    # "nccl" *in* the backend: the course's groups are "cpu:gloo,cuda:nccl", which
    # is not equal to "nccl" but runs on GPUs all the same
    device = "cuda" if "nccl" in dist.get_backend() else "cpu"
    mesh = init_device_mesh(device, (nodes, gpus_per_node), mesh_dim_names=("node", "local"))
    me = dist.get_rank()
    # dimension "local" varies inside a node (a row); "node" varies across nodes (a column)
    return NodeGroups(mesh.get_group("local"), mesh.get_group("node"), me // gpus_per_node,
                      me % gpus_per_node, gpus_per_node)


def hierarchical_all_reduce(tensor: torch.Tensor, gpus_per_node: int, group=None, *,
                            groups: NodeGroups | None = None, wire: Wire | None = None):
    """Sum ``tensor`` over ``group`` in place: reduce-scatter inside nodes, all-reduce
    across, all-gather inside. Returns ``tensor``.

    Equal to ``dist.all_reduce`` up to the order of floating-point additions.
    ``groups``: from ``node_groups``/``mesh_groups``, built once and reused.
    If None they are built here, which is a collective over the *default*
    group: with a ``group`` smaller than the world, build them beforehand
    on every rank (``node_groups(g, group)``) and pass them.
    ``wire``: counts and optionally delays messages (default: counts only).
    """
    flat = flat_view(tensor)
    check_summable(flat, "hierarchical_all_reduce")
    if not (dist.is_available() and dist.is_initialized()):
        check_grid(1, gpus_per_node)
        return tensor  # one rank, no process group: the sum is the tensor itself
    check_grid(dist.get_world_size(group), gpus_per_node)  # every rank raises alike, first
    if groups is None:
        groups = node_groups(gpus_per_node, group)
    elif groups.gpus_per_node != gpus_per_node:
        raise ValueError(f"groups were built for {groups.gpus_per_node} GPUs per node, "
                         f"not {gpus_per_node}")
    wire = wire or Wire(gpus_per_node)
    chunk = ring_reduce_scatter(flat, groups.intra, wire)   # (N/g,): my node's sum of chunk j
    ring_all_reduce(chunk, groups.inter, wire)              # the only cross-node phase
    ring_all_gather(flat, groups.intra, wire)
    return tensor


# --------------------------------------------------------------------------
# Timing on an emulated cluster (run inside launch; every rank gets the same rows).
# --------------------------------------------------------------------------

LOOPBACK = Link("this machine's loopback (free in the model)", 1e15, 0.0,
                "not modelled: the emulation delays only cross-node messages")


def emulated_topology(nodes: int, gpus_per_node: int, slow_link: Link) -> Topology:
    """The cluster the emulation builds: free links inside, ``slow_link`` per rank between."""
    return Topology(f"emulated {nodes}x{gpus_per_node}", nodes, gpus_per_node, LOOPBACK,
                    slow_link, nics_per_node=gpus_per_node)


def time_emulated(numel: int, gpus_per_node: int, slow_link: Link | None, reps: int = 3,
                  algorithms=("ring", "hierarchical"), include_torch: bool = False) -> list[dict]:
    """Time the flat ring and the hierarchical all-reduce over an emulated slow link.

    Run on every rank. The algorithms take turns call by call (so load hits
    both alike); a sample is the slowest rank's time after a barrier; each row
    reports the median sample, the bytes crossing nodes (summed over ranks)
    and the most any one rank sent across (its "NIC"). ``include_torch`` adds
    dist.all_reduce (no emulated delay: gloo's own messages bypass the Wire).
    Every result is checked against the exact sum (float32 ones: exact).
    On a CPU each row also has ``cores_busy``: the CPU seconds all ranks' processes
    used during a call over (the machine's cores x the call's time), median over the
    calls. Near 1, the ranks competed for cores, so their cost above the model is
    partly waiting for one; well below 1, a core was free. (None on a GPU, where CPU
    seconds count only launches.)
    """
    positive_int("numel", numel)
    positive_int("reps", reps)
    groups = node_groups(gpus_per_node)
    p = dist.get_world_size()
    x = torch.empty(numel, dtype=torch.float32)
    clk = clock_for(x.device)
    names = list(algorithms) + (["torch"] if include_torch else [])
    samples = {a: [] for a in names}
    busy = {a: [] for a in names}
    on_cpu = x.device.type == "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    counts = {}
    for _ in range(reps):
        for alg in names:
            x.fill_(1.0)
            wire = Wire(gpus_per_node, slow_link)
            dist.barrier()
            t0, c0 = clk.mark(), time.process_time()
            if alg == "ring":
                ring_all_reduce(x, None, wire)
            elif alg == "hierarchical":
                hierarchical_all_reduce(x, gpus_per_node, groups=groups, wire=wire)
            elif alg == "torch":
                dist.all_reduce(x)
            else:
                raise ValueError(f"unknown algorithm {alg!r}")
            dt = torch.tensor([elapsed(t0, clk.mark())], dtype=torch.float64)
            cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            if not torch.equal(x, torch.full_like(x, float(p))):
                raise RuntimeError(f"{alg} all-reduce gave a wrong sum on rank {dist.get_rank()}")
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu)                        # every rank's CPU seconds, summed
            busy[alg].append(cpu.item() / (cores * dt.item()))
            sent = torch.tensor([float(wire.cross_bytes)], dtype=torch.float64)
            most = sent.clone()
            dist.all_reduce(sent)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            samples[alg].append(dt.item())
            # gloo's own messages bypass the Wire: nothing to count for "torch"
            counts[alg] = (None, None) if alg == "torch" else (sent.item(), most.item())
    return [{"algorithm": a, "nbytes": 4 * numel, "time_s": statistics.median(samples[a]),
             "samples": samples[a], "cross_node_bytes": counts[a][0],
             "nic_bytes": counts[a][1],
             "cores_busy": statistics.median(busy[a]) if on_cpu else None} for a in names]


def time_placement(numel: int, gpus_per_node: int, group_size: int, slow_link: Link | None,
                   reps: int = 3) -> dict:
    """Time an all-reduce inside groups of ``group_size`` ranks placed two ways.

    "inside": consecutive ranks (a tensor-parallel group inside a node);
    "across": ranks strided by ``gpus_per_node`` (one per node). Every group
    runs its own flat ring through a ``Wire``. Run on every rank; returns
    {"inside": (median s, cross-node bytes summed over ranks), "across": ...}.
    """
    p = dist.get_world_size()
    check_grid(p, gpus_per_node)
    nodes = p // gpus_per_node
    if not is_int(group_size) or group_size < 1 or gpus_per_node % group_size \
            or nodes % group_size:
        raise ValueError(f"group_size {group_size} must divide both gpus_per_node "
                         f"({gpus_per_node}) and the node count ({nodes})")
    grid = torch.arange(p).view(nodes, gpus_per_node)
    layouts = {"inside": grid.reshape(-1, group_size).tolist(),
               # columns of the grid, cut into groups of group_size consecutive nodes
               "across": grid.t().reshape(-1, group_size).tolist()}
    mine = {}
    for name, groups in layouts.items():
        for ranks in groups:
            pg = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine[name] = pg
    x = torch.empty(numel)
    clk = clock_for(x.device)
    out = {}
    samples = {name: [] for name in layouts}
    sent = {}
    for _ in range(reps):
        for name in layouts:
            x.fill_(1.0)
            wire = Wire(gpus_per_node, slow_link)
            dist.barrier()
            t0 = clk.mark()
            ring_all_reduce(x, mine[name], wire)
            dt = torch.tensor([elapsed(t0, clk.mark())], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            samples[name].append(dt.item())
            b = torch.tensor([float(wire.cross_bytes)], dtype=torch.float64)
            dist.all_reduce(b)
            sent[name] = b.item()
    for name in layouts:
        out[name] = (statistics.median(samples[name]), sent[name])
    return out
