"""Cut a stack of layers into pipeline stages.

A pipeline runs at the pace of its slowest stage: every micro-batch passes
through every stage, so in the steady state each stage gets one slot per
micro-batch of length ``max_s cost(s)``. The other stages wait for the
difference. ``partition(layer_costs, num_stages)`` therefore picks the
contiguous split (stages must be contiguous: stage s feeds stage s+1) that
minimizes the most expensive stage. With stage times t_s (forward + backward
of one micro-batch, no communication) a GPipe or 1F1B step takes

    GPipe step time = (m - 1) * max_s t_s + sum_s t_s     (``pipeline_step_time``)

each micro-batch crosses every stage once (the fill and drain, sum t_s) and
the other m - 1 micro-batches leave at the pace of the slowest stage. It is
the makespan of a flow shop whose jobs are all alike; with balanced stages it
is the familiar (m + p - 1) t (Narayanan et al. 2021, SC21, sec. 2.2), and
(m + p - 1) * max_s t_s is only an upper bound. The course's simulator
reproduces it exactly for GPipe when every stage's backward is the same
multiple of its forward; 1F1B, which starts backwards early, takes the same
time when the slowest stage is the last one (an LM head) and can be shorter
otherwise (tests/test_pipeline_schedules.py checks both on random stage times). (Huang et al. 2019, "GPipe",
sec. 2.2 uses a partitioning heuristic to balance estimated per-layer cost for
exactly this reason; Narayanan et al. 2019, "PipeDream", sec. 3.1 solves it by
dynamic programming with communication costs included.)

Memory is the second thing to balance. Under 1F1B stage s (0-based) stashes
the activations of p - s micro-batches (chapter 12): stage 0 holds p
micro-batches of L/p layers, as much as the whole model's activations for one
micro-batch, whatever p is (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.2.3, eq. 5). Pass
``layer_memory`` (activation bytes of one micro-batch per layer) and
``memory_limit``: only splits with (p - s) * memory(stage s) <= memory_limit
on every stage are allowed, and among those the slowest stage is minimized.

Comparisons of sums carry a stated tolerance, ``RTOL`` = 1e-9 relative. The
same layers summed in another order (here through prefix sums, by the caller
one stage at a time) differ in the last bits: each float addition rounds by
at most 2^-53 of its result (Higham 2002, sec. 3.1), so n of them by ~n x
1.1e-16. Without a tolerance a split whose stash fills the limit exactly is
refused for a rounding error, and a worse split is returned (12 equal layers,
a limit of 8 layers' stash: [2, 2, 3, 5] instead of [2, 2, 4, 4]). 1e-9 is far
above that rounding and far below any real difference between two splits.

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

from helpers.validate import positive_int

__all__ = ["partition", "stage_costs", "pipeline_step_time", "stash_memory", "RTOL"]

# relative tolerance of every comparison of sums (module docstring): a stash within
# RTOL of the limit fits, two stage costs within RTOL of each other tie
RTOL = 1e-9


def partition(layer_costs: int | Sequence[float], num_stages: int, *,
              layer_memory: Sequence[float] | None = None,
              memory_limit: float | None = None) -> list[range]:
    """Contiguous split of the layers into ``num_stages`` non-empty stages that
    minimizes the cost of the most expensive stage; among equally good splits,
    the one whose later stages are longest (earlier stages lighter). Returns one
    ``range`` of layer indices per stage, e.g. ``[range(0, 2), range(2, 4)]``.

    With ``layer_memory`` and ``memory_limit``, stage s may hold only layers
    whose 1F1B stash, (num_stages - s) * sum(layer_memory), fits the limit."""
    positive_int("num_stages", num_stages)
    if isinstance(layer_costs, bool):
        raise ValueError("layer_costs must be a number of layers or a list of costs")
    costs = [1.0] * layer_costs if isinstance(layer_costs, int) else [float(c) for c in layer_costs]
    L = len(costs)
    if L < num_stages:
        raise ValueError(f"cannot split {L} layer(s) into {num_stages} stages: every stage "
                         f"needs at least one layer (use at most {L} stages or a deeper model)")
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be >= 0, got {costs}")
    if (layer_memory is None) != (memory_limit is None):
        raise ValueError("give layer_memory and memory_limit together (or neither)")
    mem = [0.0] * L if layer_memory is None else [float(x) for x in layer_memory]
    if len(mem) != L:
        raise ValueError(f"layer_memory has {len(mem)} entries for {L} layers")
    # a stash up to RTOL above the limit fits: rounding, not memory (module docstring)
    limit = float("inf") if memory_limit is None else float(memory_limit) * (1 + RTOL)
    mem_prefix = [0.0]
    for x in mem:
        mem_prefix.append(mem_prefix[-1] + x)
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
            # last stage = layers [j, i); j ascending and a strict "<" (by more than RTOL)
            # keep the smallest j among equally good cuts: the longest last stage (ties ->
            # earlier stages smaller)
            for j in range(k - 1, i):
                # stage k - 1 (0-based) stashes num_stages - k + 1 micro-batches under 1F1B
                if (num_stages - k + 1) * (mem_prefix[i] - mem_prefix[j]) > limit:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] * (1 - RTOL):
                    best[k][i], cut[k][i] = value, j
    if best[num_stages][L] == inf:
        raise ValueError(f"no split into {num_stages} stages keeps every stage's 1F1B stash "
                         f"within memory_limit={memory_limit:g} (stage 0 alone needs "
                         f"{num_stages} x its layers' memory): raise the limit, recompute "
                         f"activations, or use more stages")
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


def pipeline_step_time(stage_times: Sequence[float], num_microbatches: int) -> float:
    """Step time of GPipe (an upper bound for 1F1B) with per-stage times ``stage_times`` (forward +
    backward of one micro-batch, no communication): (m - 1) max t + sum t. The fill
    and drain pass every stage once; the other m - 1 micro-batches go at the
    slowest stage's pace (see the module docstring)."""
    positive_int("num_microbatches", num_microbatches)
    t = [float(x) for x in stage_times]
    return (num_microbatches - 1) * max(t) + sum(t)


def stash_memory(layer_memory: Sequence[float], bounds: Sequence[range]) -> list[float]:
    """Peak activation memory of each stage under 1F1B: stage s stashes
    p - s micro-batches of its layers (Korthikanti et al. 2022, sec. 4.2.3)."""
    p = len(bounds)
    return [(p - s) * sum(layer_memory[i] for i in r) for s, r in enumerate(bounds)]
