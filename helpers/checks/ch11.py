"""Checks for chapter 11: a balanced stage split, and the send/recv stage loop."""

from __future__ import annotations

import itertools

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.tolerance import within_fp32_noise

# (layer costs, stages): equal layers, a heavy last layer (an LM head), a heavy first
# layer (embeddings), a case where "fill up to the average" greedy splits go wrong,
# and zero-cost layers.
PARTITION_CASES = [
    ([1.0] * 8, 4),
    ([1.0] * 7, 3),
    ([1, 1, 1, 1, 1, 1, 4], 3),
    ([5, 1, 1, 1, 1, 1, 1, 1], 2),
    ([3, 3, 2, 2, 2, 2, 3, 3], 3),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3),
    ([2, 0, 0, 2, 1, 1], 4),
    ([4.0], 1),
    ([1, 1, 1], 3),
]


def _best(costs, k):
    """Smallest possible most-expensive stage, by trying every set of cuts."""
    n = len(costs)
    return min(max(sum(costs[a:b]) for a, b in zip(e, e[1:]))
               for cuts in itertools.combinations(range(1, n), k - 1)
               for e in [(0, *cuts, n)])


def check_balanced_partition(balanced_partition) -> None:
    """``balanced_partition(layer_costs, num_stages) -> list[range]``: contiguous,
    non-empty stages covering every layer once, minimizing the costliest stage;
    ValueError when there are fewer layers than stages."""
    for costs, k in PARTITION_CASES:
        got = attempt(balanced_partition, list(costs), k, what="balanced_partition")
        try:
            stages = [range(r.start, r.stop) if isinstance(r, range) else range(r[0], r[-1] + 1)
                      for r in got]
        except (TypeError, IndexError, AttributeError):
            raise CheckFailed(f"balanced_partition({costs}, {k}) should return a list of "
                              f"ranges, got {got!r}") from None
        if len(stages) != k or any(len(r) == 0 for r in stages):
            raise CheckFailed(f"balanced_partition({costs}, {k}) = {got!r}: expected {k} "
                              f"non-empty stages")
        if [i for r in stages for i in r] != list(range(len(costs))):
            raise CheckFailed(f"balanced_partition({costs}, {k}) = {got!r}: stages must be "
                              f"contiguous and cover layers 0..{len(costs) - 1} in order")
        worst, best = max(sum(costs[i] for i in r) for r in stages), _best(costs, k)
        if worst > best + 1e-9:
            raise CheckFailed(f"balanced_partition({costs}, {k}) = {got!r}: its slowest stage "
                              f"costs {worst:g}, but a split with slowest stage {best:g} "
                              f"exists (a greedy 'fill up to the average' split can miss it)")
    try:
        got = balanced_partition([1.0, 1.0], 3)
    except ValueError:
        pass
    except NotImplementedError as exc:
        raise CheckFailed(f"balanced_partition is not implemented yet ({exc})") from None
    else:
        raise CheckFailed(f"balanced_partition([1, 1], 3) returned {got!r}; 2 layers cannot "
                          f"make 3 non-empty stages: raise ValueError")
    passed(f"all {len(PARTITION_CASES)} splits optimal, and 2 layers in 3 stages refused")


# ---------------------------------------------------------------------------
# The stage loop on real ranks
# ---------------------------------------------------------------------------

STAGE_LOOP_WORLD, STAGE_LOOP_LAYERS = 4, 4


def _batch():
    g = torch.Generator().manual_seed(11)
    return (torch.randint(0, 64, (4, 16), generator=g),
            torch.randint(0, 64, (4, 16), generator=g))


def _stage_loop_rank(run_stage):
    """Rank function: one step of the learner's loop on this rank's stage."""
    from helpers import rank_info
    from helpers.model import build_model
    from helpers.pipeline.executor import chunk_grads, split_model

    torch.set_num_threads(1)
    info = rank_info()
    stage = split_model(build_model("toy", n_layer=STAGE_LOOP_LAYERS), info.world_size)[info.rank][0]
    x, y = _batch()
    loss = run_stage(stage, x, y)
    return (None if loss is None else float(loss)), chunk_grads([stage])


def check_run_stage(run_stage, timeout: float = 30.0) -> None:
    """``run_stage(stage, x, y)`` on a 4-stage pipeline: loss on the last rank, and
    every rank's gradients, equal the unsplit model's. A loop that hangs fails after
    ``timeout`` seconds, naming the ranks still waiting."""
    from helpers.model import build_model
    from helpers.pipeline.executor import reference_grads

    results = on_ranks(_stage_loop_rank, STAGE_LOOP_WORLD, run_stage, timeout=timeout,
                       what="run_stage")
    x, y = _batch()
    ref_loss, ref = reference_grads(build_model("toy", n_layer=STAGE_LOOP_LAYERS), x, y)
    # float64: the exact answer, to ~1e-16. The stages run the unsplit model's
    # float32 operations, so they must be as close to it as the float32
    # reference is (helpers.tolerance), whatever the machine's kernels.
    ref64_loss, ref64 = reference_grads(
        build_model("toy", n_layer=STAGE_LOOP_LAYERS).double(), x, y)
    last_loss = results[-1][0]
    if last_loss is None or not within_fp32_noise(
            torch.tensor(last_loss), torch.tensor(ref_loss), torch.tensor(ref64_loss))[0]:
        raise CheckFailed(f"the last stage returned loss {last_loss!r}; the unsplit model's "
                          f"is {ref_loss:.6f}")
    grads: dict[str, list] = {}
    for r, (_, g) in enumerate(results):
        for name, t in g.items():
            grads.setdefault(name, []).append((r, t))
    for name, want in ref.items():
        if name not in grads:
            raise CheckFailed(f"no gradient for {name}: did that stage run its backward?")
        # the tied weight has two copies (embedding on the first rank, head on the last):
        # the unsplit model's gradient is their sum
        got = sum(t for _, t in grads[name])
        ranks = [r for r, _ in grads[name]]
        # float32, same operations per stage as the unsplit model: rounding only
        if not within_fp32_noise(got, want, ref64[name])[0]:
            err = (got - want).abs().max().item()
            raise CheckFailed(f"gradient of {name} (rank {ranks}) differs from the unsplit "
                              f"model's by up to {err:.3g}. Did the received activation "
                              f"requires_grad_(), and did you backprop the received gradient?")
    passed(f"4-stage pipeline: loss {last_loss:.4f} and all gradients equal the unsplit model")
