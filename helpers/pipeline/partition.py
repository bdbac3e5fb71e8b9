"""Cut a stack of layers into pipeline stages.

A pipeline runs at the pace of its slowest stage: every micro-batch passes
through every stage, so in the steady state each stage gets one slot per
micro-batch of length ``max_s cost(s)``. The other stages wait for the
difference. ``partition(layer_costs, num_stages)`` therefore picks the
contiguous split (stages must be contiguous: stage s feeds stage s+1) that
minimizes the most expensive stage. The cost of imbalance is

    step time ~ (m + p - 1) * max_s cost(s)    instead of    (m + p - 1) * mean_s cost(s)

(Huang et al. 2019, "GPipe", sec. 2.2 uses a partitioning heuristic to
balance estimated per-layer cost for exactly this reason; Narayanan et al.
2019, "PipeDream", sec. 3.1 solves it by dynamic programming with
communication costs included.)

Algorithm: dynamic programming over prefixes, O(L^2 p) for L layers. best[k][i]
is the smallest possible "largest stage" when the first i layers form k
stages; best[k][i] = min over j of max(best[k-1][j], cost(j..i)). Among
splits with the same slowest stage, the last stage takes as many layers as it
can (then the one before it, and so on), so ties leave the *earlier* stages
smaller: ``partition(7, 3)`` is 2, 2, 3 layers. Two reasons to lighten the early
stages: the first stage also runs the embedding, and under 1F1B stage i
stashes the activations of p - i micro-batches (chapter 12), so an early
layer costs more memory than a late one.

``layer_costs`` can be an int (that many layers of equal cost: split by
count) or a list of measured costs (seconds, FLOPs, parameters...).

How production differs: Megatron-LM splits transformer layers evenly by count
and lets you move the embedding/head into their own "virtual" layers;
DeepSpeed offers ``partition_method="parameters"`` or by type; PipeDream's
planner also models communication and memory per stage.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["partition", "stage_costs"]


def partition(layer_costs: int | Sequence[float], num_stages: int) -> list[range]:
    """Contiguous split of the layers into ``num_stages`` non-empty stages that
    minimizes the cost of the most expensive stage; among equally good splits,
    the one whose later stages are longest (earlier stages lighter). Returns one
    ``range`` of layer indices per stage, e.g. ``[range(0, 2), range(2, 4)]``."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if isinstance(layer_costs, bool):
        raise ValueError("layer_costs must be a number of layers or a list of costs")
    costs = [1.0] * layer_costs if isinstance(layer_costs, int) else [float(c) for c in layer_costs]
    L = len(costs)
    if L < num_stages:
        raise ValueError(f"cannot split {L} layer(s) into {num_stages} stages: every stage "
                         f"needs at least one layer (use at most {L} stages or a deeper model)")
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {costs}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost of layers [0, i) in k stages; cut[k][i]: where
    # the last of those k stages starts.
    best = [[inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, L - (num_stages - k) + 1):
            # last stage = layers [j, i); j ascending and a strict "<" keep the smallest j
            # among equally good cuts: the longest last stage (ties -> earlier stages smaller)
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], L
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


def stage_costs(layer_costs: int | Sequence[float], bounds: Sequence[range]) -> list[float]:
    """Total cost of each stage of a split."""
    costs = [1.0] * layer_costs if isinstance(layer_costs, int) else [float(c) for c in layer_costs]
    return [sum(costs[i] for i in r) for r in bounds]
