"""Chapter 07's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch07
from helpers.costs import network
from helpers.costs.network import ring_time as price  # imported before the check runs
from helpers.topology import (all_reduce_time, packed_ranks, ring_all_gather, ring_all_reduce,
                              ring_reduce_scatter, spread_ranks)


# ---- plausible mistakes in the layout

def _swapped(world, g):  # intra and inter the wrong way round
    grid = torch.arange(world).view(world // g, g)
    if world % g:
        raise ValueError("no")
    return grid.t().tolist(), grid.tolist()


def _strided_nodes(world, g):  # a "node" = every (world/g)-th rank: round-robin numbering
    if world % g:
        raise ValueError("no")
    n = world // g
    grid = torch.arange(world).view(g, n).t()  # (n, g): node i = i, i+n, i+2n, ...
    return grid.tolist(), grid.t().tolist()


def _no_error(world, g):  # silently drops the ranks that do not fill a node
    grid = torch.arange(world // g * g).view(world // g, g)
    return grid.tolist(), grid.t().tolist()


def _assert_refusal(world, g):  # refuses with an assert, not a ValueError
    assert world % g == 0, "does not fill"
    grid = torch.arange(world).view(world // g, g)
    return grid.tolist(), grid.t().tolist()


# ---- plausible mistakes in the all-reduce (run on 4 ranks)

def _flat(x, intra, inter, wire):  # a flat ring over the world, passed off as hierarchical
    ring_all_reduce(x, None, wire)


def _whole_tensor_across(x, intra, inter, wire):  # all-reduces all of x across nodes
    ring_reduce_scatter(x, intra, wire)
    ring_all_reduce(x, inter, wire)
    ring_all_gather(x, intra, wire)


def _groups_swapped(x, intra, inter, wire):  # reduce-scatter across nodes, all-reduce inside
    chunk = ring_reduce_scatter(x, inter, wire)
    ring_all_reduce(chunk, intra, wire)
    ring_all_gather(x, inter, wire)


def _leaders_only(x, intra, inter, wire):  # reduce to a leader, leaders all-reduce, broadcast
    from torch.distributed import broadcast, get_global_rank, get_rank, reduce

    leader = get_global_rank(intra, 0)
    reduce(x, leader, group=intra)
    if get_rank(intra) == 0:
        ring_all_reduce(x, inter, wire)
    broadcast(x, leader, group=intra)


def _course_one_liner(x, intra, inter, wire):  # the chapter's own function
    from helpers.topology.hierarchical import NodeGroups, hierarchical_all_reduce

    import torch.distributed as dist

    g = wire.gpus_per_node
    groups = NodeGroups(intra, inter, dist.get_rank() // g, dist.get_rank() % g, g)
    hierarchical_all_reduce(x, g, groups=groups, wire=wire)


def _no_all_gather(x, intra, inter, wire):  # forgets phase 3: only my chunk is right
    chunk = ring_reduce_scatter(x, intra, wire)
    ring_all_reduce(chunk, inter, wire)


def _two_per_node(x, intra, inter, wire):  # this rank's chunk cut for 2 GPUs per node
    import torch.distributed as dist

    from helpers.collectives import chunk_bounds

    ring_reduce_scatter(x, intra, wire)
    a, b = chunk_bounds(x.numel(), 2)[dist.get_rank(intra)]
    ring_all_reduce(x[a:b], inter, wire)
    ring_all_gather(x, intra, wire)


def _wrong_placement(topology, nbytes, k):  # both groups packed
    t = all_reduce_time(topology, nbytes, packed_ranks(topology, k))
    return {"inside": t, "across": t}


def _placement(topology, nbytes, k, *, share=None, sent=None):
    steps = 2 * (k - 1)
    sent = 2 * (k - 1) / k * nbytes if sent is None else sent
    share = topology.nics_per_node / topology.gpus_per_node if share is None else share
    return {"inside": steps * topology.intra.latency + sent / topology.intra.bandwidth,
            "across": steps * topology.inter.latency
            + sent / (topology.inter.bandwidth * share(topology) if callable(share) else
                      topology.inter.bandwidth * share)}


def _whole_nic(topology, nbytes, k):  # every group gets a whole NIC (no sharing)
    return _placement(topology, nbytes, k, share=1.0)


def _all_nics(topology, nbytes, k):  # one group gets all of the node's NICs
    return _placement(topology, nbytes, k, share=lambda t: t.nics_per_node)


def _whole_tensor_sent(topology, nbytes, k):  # N / B instead of 2(P-1)/P N / B
    return _placement(topology, nbytes, k, sent=nbytes)


def _chapter_03_ring(topology, nbytes, k):  # the flat-ring model on rank lists
    return {"inside": all_reduce_time(topology, nbytes, packed_ranks(topology, k)),
            "across": all_reduce_time(topology, nbytes, spread_ranks(topology, k))}


def _helper_call(topology, nbytes, k):  # the chapter's answer, one call per key
    return {"inside": network.ring_time(topology, "all_reduce", nbytes, k, 1),
            "across": network.ring_time(topology, "all_reduce", nbytes, k,
                                        topology.gpus_per_node)}


def _helper_imported_early(topology, nbytes, k):  # the same, through a name bound earlier
    return {"inside": price(topology, "all_reduce", nbytes, k),
            "across": price(topology, "all_reduce", nbytes, k, topology.gpus_per_node)}


def _helper_bandwidth(topology, nbytes, k):  # the steps by hand, the bandwidth from the course
    g = topology.gpus_per_node
    sent = 2 * (k - 1) / k * nbytes
    return {"inside": 2 * (k - 1) * topology.intra.latency
            + sent / network.bus_bandwidth(topology, k, 1),
            "across": 2 * (k - 1) * topology.inter.latency
            + sent / network.bus_bandwidth(topology, k, g)}


class TestChapter07(ChapterChecks):
    lab, sol = "labs/07_nccl_topology_lab.ipynb", "solutions/07_nccl_topology_solution.ipynb"
    checks = {
        "node_layout": Check(ch07.check_node_layout),
        "hierarchical": Check(ch07.check_hierarchical, slow=True, wire=True),
        "placement_times": Check(ch07.check_placement_times),
    }
    wrong = [
        Wrong("node_layout", _swapped, "intra and inter swapped", says="swapped"),
        Wrong("node_layout", _strided_nodes, "round-robin rank numbering",
              says="not consecutive ranks"),
        Wrong("node_layout", _no_error, "drops the ranks that do not fill a node",
              says="should raise ValueError"),
        Wrong("node_layout", _assert_refusal, "refuses with an assert",
              says="raised AssertionError"),
        Wrong("hierarchical", _flat, "a flat ring over the world", says="exactly a flat ring"),
        Wrong("hierarchical", _whole_tensor_across, "all of x across nodes",
              says="only the chunk"),
        Wrong("hierarchical", _groups_swapped, "reduce-scatter across nodes, all-reduce inside",
              says="only the chunk"),
        Wrong("hierarchical", _leaders_only, "one leader per node carries everything",
              says="one GPU per node carries the node's traffic"),
        Wrong("hierarchical", _course_one_liner, "the chapter's hierarchical_all_reduce",
              says="switched off in this check"),
        Wrong("hierarchical", _no_all_gather, "forgets the all-gather",
              says="does not hold the sum"),
        Wrong("hierarchical", _two_per_node, "the chunk cut for 2 GPUs per node",
              says="hierarchical on 2 nodes x 3"),
        Wrong("placement_times", _wrong_placement, "both groups packed", says="spread the group"),
        Wrong("placement_times", _whole_nic, "a whole NIC per group", says="share the node"),
        Wrong("placement_times", _all_nics, "all the node's NICs per group",
              says="share the node"),
        Wrong("placement_times", _whole_tensor_sent, "the whole tensor per rank",
              says="2\\(P-1\\)/P"),
        Wrong("placement_times", _chapter_03_ring, "chapter 03's flat-ring model",
              says="share the node"),
        Wrong("placement_times", _helper_call, "the chapter's ring_time, one line",
              says="the chapter's answer to this exercise"),
        Wrong("placement_times", _helper_imported_early, "ring_time bound to another name",
              says="the chapter's answer to this exercise"),
        Wrong("placement_times", _helper_bandwidth, "the course's bus_bandwidth",
              says="the chapter's answer to this exercise"),
    ]
