"""Checks for chapter 11: a balanced stage split, and the send/recv stage loop."""

from __future__ import annotations

import itertools

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import CourseAnswerUsed, refusing

# the chapter's own answers (helpers/checks/course_answers.py)
COURSE_PARTITION = ["helpers.pipeline.partition.partition"]
COURSE_STAGE = ["helpers.pipeline.executor.pipeline_step",
                "helpers.pipeline.plain_1f1b.one_f_one_b_step"]
from helpers.tolerance import within_fp32_noise

# (layer costs, stages): equal layers, a heavy last layer (an LM head), a heavy first
# layer (embeddings), a case where "fill up to the average" greedy splits go wrong,
# zero-cost layers, and two where the most even split (smallest spread between the
# costliest and the cheapest stage) is not the one with the cheapest costliest stage:
# [4, 1, 9 | 4, 6 | 4, 3] has spread 7 but a slowest stage of 14; the optimum is 13.
PARTITION_CASES = [
    ([4, 1, 9, 4, 6, 4, 3], 3),
    ([2, 7, 4, 1, 4, 8, 6], 3),
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
    ValueError when there are fewer layers than stages.

    Catches:
    * greedy "fill up to the average": ``[3, 3, 2, 2, 2, 2, 3, 3], 3`` and others
      (a split with a cheaper slowest stage is shown);
    * minimizes the spread between stages instead of the slowest stage:
      ``[4, 1, 9, 4, 6, 4, 3], 3`` (spread-optimal split has slowest stage 14, not 13);
    * equal layer counts: ``[1, 1, 1, 1, 1, 1, 4], 3``;
    * empty stages (zero-cost layers, or as many stages as layers): ``[2, 0, 0, 2, 1, 1], 4``
      and ``[1, 1, 1], 3``;
    * non-contiguous or repeated layers, wrong number of stages: named;
    * returns None, or not ranges/lists of indices: named;
    * no error, or another exception than ValueError, for fewer layers than stages;
    * raises on a valid case: named, with the case;
    * calls the course's ``helpers.pipeline.partition``: refused by name.
    """
    for costs, k in PARTITION_CASES:
        with refusing(COURSE_PARTITION, "balanced_partition", "the split is the exercise"):
            got = attempt(balanced_partition, list(costs), k,
                          what=f"balanced_partition({costs}, {k})")
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
        with refusing(COURSE_PARTITION, "balanced_partition", "the split is the exercise"):
            got = balanced_partition([1.0, 1.0], 3)
    except CourseAnswerUsed:
        raise
    except ValueError:
        pass
    except NotImplementedError as exc:
        raise CheckFailed(f"balanced_partition is not implemented yet ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the learner's error, named
        raise CheckFailed(f"balanced_partition([1, 1], 3) raised {type(exc).__name__}: {exc}; "
                          f"2 layers cannot make 3 non-empty stages: check that first and "
                          f"raise ValueError saying so") from None
    else:
        raise CheckFailed(f"balanced_partition([1, 1], 3) returned {got!r}; 2 layers cannot "
                          f"make 3 non-empty stages: raise ValueError")
    passed(f"all {len(PARTITION_CASES)} splits optimal, and 2 layers in 3 stages refused")


# ---------------------------------------------------------------------------
# The stage loop on real ranks
# ---------------------------------------------------------------------------

# (ranks, layers): an odd pipeline too, so "rank == 3 is the last stage" or a loop
# written for one depth fails; 5 layers on 3 ranks makes one stage deeper than others
STAGE_LOOP_RUNS = ((3, 5), (4, 4))


def _batch():
    g = torch.Generator().manual_seed(11)
    return (torch.randint(0, 64, (4, 16), generator=g),
            torch.randint(0, 64, (4, 16), generator=g))


def _stage_loop_rank(run_stage, n_layer):
    """Rank function: one step of the learner's loop on this rank's stage."""
    from helpers import rank_info
    from helpers.checks.spy import communication_spy
    from helpers.model import build_model
    from helpers.pipeline.executor import chunk_grads, split_model

    torch.set_num_threads(1)
    info = rank_info()
    stage = split_model(build_model("toy", n_layer=n_layer), info.world_size)[info.rank][0]
    # the model lands on the rank's device (build_model's default): the batch goes there too
    x, y = (t.to(info.device) for t in _batch())
    # the checks' spy: a send to a rank that does not exist (a last stage hard-coded for
    # another world size) is named at once; gloo would wait for it until the timeout.
    # It also records every send and collective, so that only the pipeline's own
    # messages pass: one activation forward, one gradient back.
    try:
        with communication_spy(keep_values=False) as spy, \
                refusing(COURSE_STAGE, "run_stage", "the stage loop is the exercise"):
            loss = run_stage(stage, x, y)
    except CourseAnswerUsed as exc:
        return {"refused": str(exc)}
    # the lab states a float on the last stage, None elsewhere: keep the type's name
    kind = type(loss).__name__
    value = float(loss) if isinstance(loss, (float, int, torch.Tensor)) and \
        getattr(loss, "numel", lambda: 1)() == 1 else None
    sent = [(dst, nbytes) for dst, nbytes, _ in spy.sends]
    return (kind, value), chunk_grads([stage]), sent, list(spy.collectives), \
        x.numel() * stage.n_embd * 4


_HINTS = {"NoneType": "a tensor was None: the received activation needs requires_grad_() "
                      "before the forward, or its .grad stays None and there is nothing to "
                      "send back",
          "SIGABRT": "a rank aborted inside gloo: a receive buffer of another size or dtype "
                     "than the message sent to it (activation and gradient buffers are "
                     "(B, T, stage.n_embd), float32)"}


def check_run_stage(run_stage, timeout: float = 30.0) -> None:
    """``run_stage(stage, x, y)`` on 3- and 4-stage pipelines: loss on the last rank, and
    every rank's gradients, equal the unsplit model's. A loop that hangs fails after
    ``timeout`` seconds, naming the ranks still waiting.

    Catches:
    * backprops ones (or nothing) instead of the received gradient: gradients differ;
    * forgets requires_grad_() on the received activation: the rank's error, with a hint;
    * a receive buffer of the wrong shape/dtype: gloo's abort, with a hint;
    * receives the gradient before sending the activation: a deadlock, named by ranks;
    * last stage hard-coded to rank 3 or 1, or sends past the last rank: the 3-stage run
      (a send to a rank that does not exist is named at once);
    * returns the loss tensor (not a float), or a loss on other ranks: named;
    * messages the pipeline does not need, which the numbers cannot show: a collective
      (broadcasting the activation or the loss, an all-reduce of gradients), a send to
      a rank that is not a neighbour, a second copy of a message: every rank sends one
      (B, T, C) float32 activation forward (not the last) and one gradient back (not the
      first), nothing else (named, with what was sent);
    * calls the course's executor (``pipeline_step``, ``one_f_one_b_step``): refused;
    * any other exception: the rank's error, as CheckFailed.
    """
    for world, n_layer in STAGE_LOOP_RUNS:
        results = on_ranks(_stage_loop_rank, world, run_stage, n_layer, timeout=timeout,
                           what=f"run_stage on {world} ranks", hints=_HINTS)
        if isinstance(results[0], dict):
            raise CheckFailed(results[0]["refused"])
        _check_messages(results, world)
        last_loss = _compare_stage_loop([r[:2] for r in results], world, n_layer)
    passed(f"3- and 4-stage pipelines: loss {last_loss:.4f} and all gradients equal the "
           f"unsplit model")


def _check_messages(results: list, world: int) -> None:
    """Every rank sent exactly its pipeline messages and called no collective."""
    for r, (_, _, sent, collectives, nbytes) in enumerate(results):
        tied = (" If it is the tied embedding's gradient: leave each copy's part in its "
                ".grad (the first and the last stage each keep the part from their own use; "
                "the check adds them, as sync_tied_grads does after a training step)."
                if r in (0, world - 1) else "")
        if collectives:
            raise CheckFailed(f"{world} stages: rank {r} called {sorted(set(collectives))}; a "
                              f"pipeline stage talks to its neighbours only, by point-to-point "
                              f"messages (one activation forward, one gradient back). The "
                              f"numbers may be right, but that moves data every rank does not "
                              f"need.{tied}")
        want = ([(r + 1, nbytes)] if r < world - 1 else []) + \
               ([(r - 1, nbytes)] if r > 0 else [])
        if sorted(sent) != sorted(want):
            shown = ", ".join(f"{n:,} B to rank {d}" for d, n in sent) or "nothing"
            expect = ", ".join(f"{n:,} B to rank {d}" for d, n in want)
            raise CheckFailed(f"{world} stages: rank {r} sent {shown}; a stage sends exactly "
                              f"{expect}: its output activation to the next stage and the "
                              f"gradient of its input to the previous one, (B, T, C) float32 "
                              f"each, and nothing else.{tied}")


def _compare_stage_loop(results: list, world: int, n_layer: int) -> float:
    from helpers.model import build_model
    from helpers.pipeline.executor import reference_grads

    x, y = _batch()
    ref_loss, ref = reference_grads(build_model("toy", n_layer=n_layer), x, y)
    # float64: the exact answer, to ~1e-16. The stages run the unsplit model's
    # float32 operations, so they must be as close to it as the float32
    # reference is (helpers.tolerance), whatever the machine's kernels.
    ref64_loss, ref64 = reference_grads(build_model("toy", n_layer=n_layer).double(), x, y)
    for r, ((kind, _), _) in enumerate(results[:-1]):
        if kind != "NoneType":
            raise CheckFailed(f"{world} stages: rank {r} returned a {kind}; only the last "
                              f"stage returns the loss, the others return None")
    kind, last_loss = results[-1][0]
    if kind != "float":
        raise CheckFailed(f"{world} stages: the last stage returned a {kind}, expected the loss "
                          f"as a float (loss.item())")
    if not within_fp32_noise(torch.tensor(last_loss), torch.tensor(ref_loss),
                             torch.tensor(ref64_loss))[0]:
        raise CheckFailed(f"{world} stages: the last stage returned loss {last_loss!r}; the "
                          f"unsplit model's is {ref_loss:.6f}")
    grads: dict[str, list] = {}
    for r, (_, g) in enumerate(results):
        for name, t in g.items():
            grads.setdefault(name, []).append((r, t))
    for name, want in ref.items():
        if name not in grads:
            raise CheckFailed(f"{world} stages: no gradient for {name}: did that stage run its "
                              f"backward?")
        # the tied weight has two copies (embedding on the first rank, head on the last):
        # the unsplit model's gradient is their sum
        got = sum(t for _, t in grads[name])
        ranks = [r for r, _ in grads[name]]
        # float32, same operations per stage as the unsplit model: rounding only
        if not within_fp32_noise(got, want, ref64[name])[0]:
            err = (got - want).abs().max().item()
            raise CheckFailed(f"{world} stages: gradient of {name} (rank {ranks}) differs from "
                              f"the unsplit model's by up to {err:.3g}. Did the received "
                              f"activation requires_grad_(), and did you backprop the received "
                              f"gradient?")
    return last_loss
