"""Chapter 07's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch

from helpers.checks import CheckFailed, ch07
from helpers.topology import (all_reduce_time, packed_ranks, ring_all_gather, ring_all_reduce,
                              ring_reduce_scatter)
from tools.nbtool import exercise

LAB, SOL = "labs/07_nccl_topology_lab.ipynb", "solutions/07_nccl_topology_solution.ipynb"
CHECKS = [("node_layout", ch07.check_node_layout), ("hierarchical", ch07.check_hierarchical),
          ("placement_times", ch07.check_placement_times)]


def test_stubs_fail_without_starting_ranks():
    for name, check in CHECKS:
        with pytest.raises(CheckFailed, match="not implemented"):
            check(exercise(LAB, name))


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


def test_layout_mistakes_fail():
    with pytest.raises(CheckFailed, match="swapped"):
        ch07.check_node_layout(_swapped)
    with pytest.raises(CheckFailed, match="not consecutive ranks"):
        ch07.check_node_layout(_strided_nodes)
    with pytest.raises(CheckFailed, match="should raise ValueError"):
        ch07.check_node_layout(_no_error)


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


def _no_all_gather(x, intra, inter, wire):  # forgets phase 3: only my chunk is right
    chunk = ring_reduce_scatter(x, intra, wire)
    ring_all_reduce(chunk, inter, wire)


def _wrong_placement(topology, nbytes, k):  # both groups packed
    t = all_reduce_time(topology, nbytes, packed_ranks(topology, k))
    return {"inside": t, "across": t}


@pytest.mark.slow
def test_solution_passes_and_mistakes_fail(capsys):
    for name, check in CHECKS:
        check(exercise(SOL, name))
    assert capsys.readouterr().out.count("✓") == 3
    with pytest.raises(CheckFailed, match="exactly a flat ring"):
        ch07.check_hierarchical(_flat)
    with pytest.raises(CheckFailed, match="only the chunk"):
        ch07.check_hierarchical(_whole_tensor_across)
    with pytest.raises(CheckFailed, match="only the chunk"):
        ch07.check_hierarchical(_groups_swapped)
    with pytest.raises(CheckFailed, match="does not hold the sum"):
        ch07.check_hierarchical(_no_all_gather)
    with pytest.raises(CheckFailed, match="spread the group"):
        ch07.check_placement_times(_wrong_placement)
