"""Checks for chapter 07: the grid of subgroups, the hierarchical all-reduce, placement.

Contracts:

* ``node_layout(world_size, gpus_per_node)`` -> ``(intra, inter)``: ``intra`` lists
  the ranks of each node ([[0, 1], [2, 3]] for 4 ranks, 2 per node), ``inter``
  the ranks with the same local index on every node ([[0, 2], [1, 3]]). A world
  size that is not a multiple of gpus_per_node raises ValueError.
* ``hierarchical(x, intra, inter, wire)``: in place, the sum over all ranks,
  built from ``helpers.topology``'s ``ring_reduce_scatter``, ``ring_all_reduce``
  and ``ring_all_gather`` with ``wire=wire`` (so its messages are counted).
  ``intra``/``inter`` are this rank's process groups.
* ``placement_times(topology, nbytes, group_size)`` -> {"inside": s, "across": s}:
  NCCL's ring all-reduce time (``helpers.costs.network``) for a group of
  ``group_size`` GPUs packed in one node, and spread one per node.

Mistakes each check catches are listed in its docstring. The hierarchical check
runs on 4 ranks as 2 "nodes" x 2 and counts the bytes that cross nodes: a flat
ring passed off as hierarchical sends more of them, and so does an all-reduce of
the whole tensor across nodes, or phases on swapped groups; a missing all-gather
leaves only this rank's chunk summed.
"""

from __future__ import annotations

import contextlib

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed

WORLD, GPUS = 4, 2
SIZES = [12, 7, 1]  # 12 divides into every chunk (bytes exact); 7 and 1 do not


def check_node_layout(node_layout) -> None:
    """Rows and columns of the rank grid on six shapes. Mistakes it catches: intra and
    inter swapped; round-robin "nodes" (rank r on node r % nodes); a square-only or
    hard-coded layout (non-square shapes first, g = 1 and one node too); a world that
    does not fill the nodes accepted instead of refused with ValueError."""
    from helpers.topology import grid_layout

    for world, g in [(6, 3), (4, 2), (6, 2), (8, 4), (8, 1), (3, 3)]:  # non-square first
        got = attempt(node_layout, world, g, what="node_layout")
        want = grid_layout(world, g)
        try:
            got = ([list(map(int, r)) for r in got[0]], [list(map(int, r)) for r in got[1]])
        except (TypeError, IndexError, ValueError):
            raise CheckFailed(f"node_layout({world}, {g}) should return (intra, inter), two "
                              f"lists of rank lists; got {got!r}") from None
        if got == want:
            continue
        hint = ""
        if got == want[::-1]:
            hint = (" intra and inter are swapped: intra holds the ranks of one node "
                    "(consecutive ranks), inter one rank per node.")
        elif any(sorted(r) != list(range(min(r), min(r) + len(r))) for r in got[0] if r):
            hint = (" Your intra groups are not consecutive ranks: rank r lives on node "
                    "r // gpus_per_node, so a node holds ranks g*i .. g*i + g - 1.")
        raise CheckFailed(f"node_layout({world}, {g}): got {got}, expected {want}.{hint}")
    try:
        node_layout(6, 4)
    except ValueError:
        pass
    except NotImplementedError:
        raise CheckFailed("node_layout is not implemented yet") from None
    except Exception as exc:  # noqa: BLE001 - the learner's error, explained
        raise CheckFailed(f"node_layout(6, 4) raised {type(exc).__name__}: {exc}; 6 ranks do "
                          f"not fill nodes of 4 GPUs: raise ValueError naming that constraint"
                          ) from None
    else:
        raise CheckFailed("node_layout(6, 4) should raise ValueError: 6 ranks do not fill "
                          "nodes of 4 GPUs (say so before any rank starts a collective)")
    passed("node_layout: nodes are consecutive ranks, inter groups one rank per node; "
           "a world that does not fill the nodes is refused")


# the chapter's own answer: one call of it is not the exercise
COURSE_HIERARCHICAL = ["helpers.topology.hierarchical.hierarchical_all_reduce"]


def _run_hierarchical(fn, gpus_per_node=GPUS):
    import torch.distributed as dist

    from helpers.checks.course_answers import CourseAnswerUsed, refusing

    from helpers.topology import Wire, node_groups

    groups = node_groups(gpus_per_node)
    rank = dist.get_rank()
    out = []
    for n in SIZES:
        g = torch.Generator().manual_seed(100 * rank + n)
        x = torch.randint(-50, 50, (n,), generator=g).double()  # small ints: sums are exact
        ref = x.clone()
        dist.all_reduce(ref)
        wire = Wire(gpus_per_node)
        try:
            with refusing(COURSE_HIERARCHICAL, "hierarchical",
                          "build the three phases from the ring functions yourself"):
                fn(x, groups.intra, groups.inter, wire)
        except CourseAnswerUsed as exc:
            return str(exc)
        out.append((torch.equal(x, ref), wire.cross_bytes))
    dist.barrier()
    return out


# (ranks, GPUs per node): 2 nodes of 2, then 2 nodes of 3, so that a chunk or a node
# size hard-coded from the first grid (``x.chunk(2)``, ``rank % 2``) fails the second
GRIDS = ((WORLD, GPUS), (6, 3))


def check_hierarchical(hierarchical) -> None:
    """4 ranks as 2 nodes x 2, then 6 as 2 nodes x 3; three sizes (one that does not
    split evenly), exact sums, bytes across nodes counted by the Wire. Mistakes it
    catches: a flat ring over the world; all of x across nodes; the phases on swapped
    groups; a missing all-gather; messages not sent through the wire (nothing counted);
    a chunk or node size hard-coded from the 2 x 2 grid (the 2 x 3 one); the right total
    sent by one leader per node (reduce to it, all-reduce among leaders, broadcast: one
    NIC carries everything); the chapter's own ``hierarchical_all_reduce`` called."""
    from helpers.topology import IB_NDR, NVLINK4_H100, Topology, Wire, collective_cost

    if not callable(hierarchical):
        raise CheckFailed(f"hierarchical should be a function, got {hierarchical!r}")
    for world, g in GRIDS:
        nodes = world // g
        grid = f"{nodes} nodes x {g}"
        results = on_ranks(_run_hierarchical, world, hierarchical, g,
                           what=f"hierarchical on {grid}",
                           timeout=120,  # generous: up to 5 subgroups on a loaded 2-core machine
                           probe=lambda: hierarchical(torch.zeros(4), None, None, Wire(1)))
        refused = [res for res in results if isinstance(res, str)]
        if refused:
            raise CheckFailed(refused[0])
        for i, n in enumerate(SIZES):
            wrong = [r for r, res in enumerate(results) if not res[i][0]]
            if wrong:
                raise CheckFailed(f"hierarchical on {grid}: a tensor of {n} elements does not "
                                  f"hold the sum over all {world} ranks on rank(s) {wrong}. "
                                  f"Every element must be summed over every rank, with only "
                                  f"the part a rank owns after the intra-node step crossing "
                                  f"nodes.")
        topo = Topology(grid, nodes, g, NVLINK4_H100, IB_NDR, nics_per_node=g)
        N = 8 * SIZES[0]  # float64 bytes
        want = collective_cost(topo, "all_reduce", N, world, "hierarchical").cross_node_bytes
        flat = collective_cost(topo, "all_reduce", N, world, "ring").cross_node_bytes
        got = sum(res[0][1] for res in results)
        if got != want:
            hint = ""
            if got == flat:
                hint = " That is exactly a flat ring over all ranks: use the subgroups."
            elif got > want:
                hint = (" More than the hierarchy needs: only the chunk that the intra-node "
                        "reduce-scatter returns should cross nodes, and only in the inter "
                        "group.")
            elif got == 0:
                hint = " Nothing crossed nodes: were the messages sent through `wire`?"
            raise CheckFailed(f"hierarchical on {grid}: {got:g} bytes crossed node boundaries "
                              f"for a {N}-byte tensor; the hierarchical all-reduce sends "
                              f"2 (nodes - 1) N = {want:g} (a flat ring: {flat:g}).{hint}")
        per_rank = [res[0][1] for res in results]
        share = want / world
        if max(per_rank) > share:
            busiest = per_rank.index(max(per_rank))
            idle = [r for r, b in enumerate(per_rank) if b == 0]
            raise CheckFailed(
                f"hierarchical on {grid}: the right total crossed nodes, but rank {busiest} "
                f"sent {max(per_rank):g} bytes across and rank(s) {idle or 'others'} "
                f"{min(per_rank):g}: one GPU per node carries the node's traffic on its one "
                f"NIC. In the hierarchy every GPU sends its own 1/{g} of the tensor across "
                f"({share:g} bytes each), so all {g} NICs of a node carry an equal share: "
                f"reduce-scatter inside the node, all-reduce your chunk in the inter group, "
                f"all-gather inside")
    passed(f"hierarchical all-reduce on 2 nodes x 2 and 2 nodes x 3: the exact sum, and "
           f"{got:g} bytes across nodes for a {N}-byte tensor on the second (a flat ring "
           f"sends {flat:g}), {got / world:g} from each GPU: every NIC carries its share")


# The course's own prices of a ring: calling one of them is the chapter's answer, not the
# exercise's. Switched off while the learner's function runs (their code objects are
# swapped, so a name imported with ``from helpers.costs.network import ring_time`` before
# the check is caught as well as ``network.ring_time``).
_PRICES = ("ring_time", "ring_latency", "bus_bandwidth", "scattered_ring_time",
           "scattered_bus_bandwidth", "collective_time", "hierarchical_all_reduce_time")


_OFF = "a helpers.costs.network price, switched off in this check"


def _refused(*args, **kwargs):
    # runs as the swapped function's code, with *its* module's globals: builtins only
    raise RuntimeError("a helpers.costs.network price, switched off in this check")


@contextlib.contextmanager
def _prices_switched_off():
    from helpers.costs import network

    saved = []
    try:
        for name in _PRICES:
            fn = getattr(network, name)
            saved.append((fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__))
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = _refused.__code__, None, None
        yield
    finally:
        for fn, code, defaults, kwdefaults in saved:
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults


def check_placement_times(placement_times) -> None:
    """NCCL's ring price for a group packed in a node and spread one GPU per node,
    against ``helpers.costs.network.ring_time`` (stride 1 and stride g). Mistakes it
    is built to catch (each case is there for one):

    * 'across' on a whole NIC per group (forgetting that the layout's groups share
      the node's NICs): the PCIe box with one NIC for 8 GPUs differs 8x;
    * 'across' on all of the node's NICs: the A100 and H100 nodes differ;
    * N / B instead of 2(P-1)/P N / B per rank, or P steps instead of 2(P-1);
    * 'across' equal to 'inside' (the group never left the node);
    * a hard-coded group size or topology: four sizes on three machines;
    * a non-number or a missing key;
    * the chapter's one-line answer (``network.ring_time(topology, "all_reduce", nbytes,
      k, stride)``) or any other of ``helpers.costs.network``'s ring prices: switched off
      while the function runs, and named.
    """
    from helpers.costs import network
    from helpers.topology import a100_cluster, h100_cluster, pcie_cluster

    cases = [(h100_cluster(8), 1e8, 8), (h100_cluster(4), 1e6, 4), (a100_cluster(4), 1e4, 3),
             (pcie_cluster(8), 1e8, 8), (pcie_cluster(4), 1e3, 2)]
    for topo, nbytes, k in cases:
        case = f"placement_times({topo.name}, {nbytes:g}, {k})"
        try:
            with _prices_switched_off():
                got = attempt(placement_times, topo, nbytes, k, what="placement_times")
        except CheckFailed as failed:
            if _OFF not in str(failed.__cause__):
                raise
            raise CheckFailed(
                f"{case} calls one of helpers.costs.network's prices ({', '.join(_PRICES)}): "
                f"that is the chapter's answer to this exercise. Write the price from the "
                f"topology's links: 2(P-1) steps of the link's latency, and 2(P-1)/P of the "
                f"tensor at the bandwidth a rank gets.") from None
        if not isinstance(got, dict) or set(got) != {"inside", "across"}:
            raise CheckFailed(f"{case} should return a dict with keys 'inside' and "
                              f"'across', got {got!r}")
        g = topo.gpus_per_node
        want = {"inside": network.ring_time(topo, "all_reduce", nbytes, k, 1),
                "across": network.ring_time(topo, "all_reduce", nbytes, k, g)}
        for key in want:
            try:
                value = float(got[key])
            except (TypeError, ValueError):
                raise CheckFailed(f"{case}[{key!r}] should be seconds (a number), got "
                                  f"{got[key]!r}") from None
            # the same formula on the same numbers: equal up to the order of operations
            if abs(value - want[key]) <= 1e-9 * want[key]:
                continue
            hint = ""
            if key == "across" and abs(value - want["inside"]) <= 1e-9 * want[key]:
                hint = " That is the 'inside' time: spread the group one GPU per node."
            elif key == "across" and value < want[key]:
                hint = (" Too fast: the layout's groups all run at once and share the node's "
                        "NICs; a group gets nics_per_node / gpus_per_node of one NIC.")
            elif key == "inside" or value > want[key]:
                hint = (" A ring of P GPUs makes 2(P-1) steps, each paying the link's "
                        "latency, and each rank sends 2(P-1)/P of the tensor at the "
                        "link's bandwidth.")
            raise CheckFailed(f"{case}[{key!r}]: got {value:.6g} s, expected "
                              f"{want[key]:.6g} s.{hint}")
    passed("placement_times: NCCL's ring price for a group packed in a node and spread one "
           "GPU per node (the groups sharing each node's NICs)")
