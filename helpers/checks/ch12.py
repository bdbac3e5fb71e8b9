"""Checks for chapter 12: the bubble formula, the 1F1B schedule generator, ZB-H1."""

from __future__ import annotations

import numbers

import torch

from helpers.checks import CheckFailed, attempt, on_ranks, passed
from helpers.checks.course_answers import refusing
from helpers.tolerance import within_fp32_noise
from helpers.pipeline import (Action, ScheduleDeadlock, format_schedule, interleaved_1f1b,
                              one_f_one_b, simulate, validate_schedule)

# the chapter's own answers (helpers/checks/course_answers.py): refused while the
# learner's function runs; the checks call them themselves, outside that window
COURSE_BUBBLE = ["helpers.pipeline.simulate.bubble_formula"]
# (gpipe is not refused: it is not 1F1B, and the stash check names that mistake)
COURSE_SCHEDULES = ["helpers.pipeline.schedules.one_f_one_b",
                    "helpers.pipeline.schedules.interleaved_1f1b",
                    "helpers.pipeline.schedules.zb_h1"]


def _attempt(fn, *args, what: str, course: list[str]):
    with refusing(course, what.split("(")[0], "the exercise is to write it"):
        return attempt(fn, *args, what=what)


def check_bubble_fraction(bubble_fraction) -> None:
    """``bubble_fraction(p, m, v=1)``: idle share of a step's rank-time with t_b = 2 t_f,
    compared with what the simulator measures on the real schedules.

    Catches:
    * the papers' form, relative to the ideal time ``(p-1)/(vm)``: (2, 2, 1) (named);
    * forgets that interleaving divides the fill by v: (2, 4, 2);
    * integer division (``//``): 0 at (2, 2, 1);
    * the bubble of m < p taken as if m >= p, or p and m swapped: (4, 16, 1), (4, 2, 1);
    * a single stage not 0: (1, 3, 1);
    * returns None, a string or a bool (``float()`` would take them), or raises: named;
    * calls the course's ``bubble_formula``: refused by name.
    """
    for p, m, v in [(2, 2, 1), (4, 4, 1), (4, 16, 1), (8, 8, 1), (2, 4, 2), (4, 8, 2),
                    (4, 4, 4), (1, 3, 1), (4, 2, 1), (3, 5, 1)]:
        want = simulate(interleaved_1f1b(p, m, v), 1.0, 2.0).bubble_fraction
        got = _attempt(bubble_fraction, p, m, v, what=f"bubble_fraction({p}, {m}, {v})",
                       course=COURSE_BUBBLE)
        try:
            # a number, as the lab states: a string or a bool would pass float()
            if not isinstance(got, numbers.Real) or isinstance(got, bool):
                raise TypeError
            ok = abs(float(got) - want) < 1e-9
        except (TypeError, ValueError):
            raise CheckFailed(f"bubble_fraction({p}, {m}, {v}) should be a number, got {got!r}") \
                from None
        if not ok:
            hint = ""
            if v * m and abs(float(got) - (p - 1) / (v * m)) < 1e-9:
                hint = (" That is the bubble relative to the ideal time (the papers' form); "
                        "we want the fraction of the actual step that is idle.")
            raise CheckFailed(f"bubble_fraction({p}, {m}, {v}) = {float(got):.4f}, the "
                              f"simulator measures {want:.4f}.{hint}")
    passed("bubble fraction matches the simulated schedules, v = 1 and interleaved")


GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 8, 12)]


def _validated(got, p: int, m: int, name: str, deadlock_hint: str = "") -> list:
    """The schedule validated, or a CheckFailed naming the case (never a raw error:
    a None or a flat list makes the validator raise TypeError or AttributeError)."""
    if got is None:
        raise CheckFailed(f"{name}({p}, {m}) returned None: return the schedule (one list "
                          f"of actions per rank)")
    try:
        return validate_schedule(got, num_microbatches=m, num_chunks=1)
    except ScheduleDeadlock as exc:
        raise CheckFailed(f"{name}({p}, {m}) can never finish: {exc}.{deadlock_hint}") from None
    except ValueError as exc:
        raise CheckFailed(f"{name}({p}, {m}) is not a valid schedule: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed return, named
        raise CheckFailed(f"{name}({p}, {m}) should return one list of actions per rank "
                          f"(F(j), B(j){', W(j)' if name == 'zb_h1' else ''}), got {got!r:.120} "
                          f"({type(exc).__name__}: {exc})") from None


def _learner_schedule(one_f_one_b_fn, p, m):
    got = _attempt(one_f_one_b_fn, p, m, what=f"one_f_one_b({p}, {m})",
                   course=COURSE_SCHEDULES)
    sched = _validated(got, p, m, "one_f_one_b",
                       " Check the warm-up count of each rank (which rank needs the most "
                       "forwards in flight?)")
    if len(sched) != p:
        raise CheckFailed(f"one_f_one_b({p}, {m}) has {len(sched)} rank(s), expected {p}")
    return sched


def check_one_f_one_b(one_f_one_b_fn) -> None:
    """``one_f_one_b(p, m)``: per-rank lists of F(j)/B(j), valid, deadlock-free, with
    1F1B's stash min(p - i, m) on rank i and 1F1B's order.

    Catches (GRID: p = 1, 2, 3, 4, 6 with m below, at and above p):
    * GPipe order: the stash is m on every rank (named);
    * warm-up of r forwards (reversed): a deadlock (named);
    * warm-up hard-coded for 2 ranks, or one short: another stash or order at p = 1, 3, ...
    * warm-up not capped at m (m < p): an invalid schedule, named;
    * forwards only, missing or repeated micro-batches: not a valid schedule (named);
    * returns None or a flat list, or raises: named with the case;
    * returns the course's ``one_f_one_b`` (or another of its schedules): refused by name.
    """
    for p, m in GRID:
        sched = _learner_schedule(one_f_one_b_fn, p, m)
        sim = simulate(sched, 1.0, 2.0)
        want_stash = [min(p - i, m) for i in range(p)]
        if sim.peak_stash != want_stash:
            raise CheckFailed(
                f"one_f_one_b({p}, {m}) holds up to {sim.peak_stash} micro-batches per rank; "
                f"1F1B holds min(p - i, m) = {want_stash}. Your schedule:\n"
                f"{format_schedule(sched)}")
        ref = one_f_one_b(p, m)
        if sched != ref:
            r = next(i for i in range(p) if sched[i] != ref[i])
            raise CheckFailed(f"one_f_one_b({p}, {m}): rank {r} runs {sched[r]}, expected "
                              f"{ref[r]} (warm-up, then F(k + warm-up) B(k) pairs, then the "
                              f"remaining B's)")
        expected_bubble = (p - 1) / (m + p - 1)
        if abs(sim.bubble_fraction - expected_bubble) > 1e-9:  # cannot happen if equal to ref
            raise CheckFailed(f"bubble {sim.bubble_fraction:.4f} != {expected_bubble:.4f}")
    passed(f"1F1B right for {len(GRID)} (p, m) pairs: stash min(p - i, m), "
           f"bubble (p-1)/(m+p-1)")


# (ranks, micro-batches): an odd pipeline with m > p, and m < p (warm-up capped at m)
RANKS_RUNS, RANKS_LAYERS = ((3, 4), (4, 2)), 4


def _batch():
    g = torch.Generator().manual_seed(12)
    return (torch.randint(0, 64, (8, 16), generator=g),
            torch.randint(0, 64, (8, 16), generator=g))


def _executor_rank(schedule):
    from helpers import rank_info
    from helpers.model import build_model
    from helpers.pipeline.executor import chunk_grads, pipeline_step, split_model

    torch.set_num_threads(1)
    info = rank_info()
    # the chunks on this rank's device: the executor allocates its buffers there
    chunks = [c.to(info.device) for c in
              split_model(build_model("toy", n_layer=RANKS_LAYERS), info.world_size)[info.rank]]
    x, y = (t.to(info.device) for t in _batch())
    res = pipeline_step(chunks, schedule, x, y)
    return res.loss, chunk_grads(chunks), res.peak_stash


def check_one_f_one_b_on_ranks(one_f_one_b_fn) -> None:
    """Run the learner's 1F1B on 3 and 4 real ranks (m = 4 and 2) with the course
    executor: loss and gradients must equal the unsplit model's, and the stash measured
    from the activations autograd really keeps must be 1F1B's.

    Catches:
    * GPipe order: correct numbers, but the measured stash is m per rank (named);
    * a deadlocking or invalid schedule: refused before any rank starts (named);
    * a warm-up not capped at m: the 4-rank run has m = 2 < p;
    * raises or returns None: named with the case.
    """
    for p, m in RANKS_RUNS:
        sched = _learner_schedule(one_f_one_b_fn, p, m)  # refuses a deadlock before ranks run
        results = on_ranks(_executor_rank, p, sched,
                           what=f"the pipeline with your schedule on {p} ranks")
        shown, loss = _compare_pipeline(results, p, m)
    passed(f"3 and 4 real ranks (m = 4, 2): loss {loss:.4f} and gradients equal the unsplit "
           f"model; measured stash {shown} = 1F1B's")


def _compare_pipeline(results: list, p: int, m: int) -> tuple[str, float]:
    from helpers.model import build_model
    from helpers.pipeline.executor import reference_grads

    x, y = _batch()
    ref_loss, ref = reference_grads(build_model("toy", n_layer=RANKS_LAYERS), x, y)
    # float64: the exact answer, to ~1e-16; the pipeline's float32 sums run in
    # another order, so it must be as close to it as the float32 reference is
    ref64_loss, ref64 = reference_grads(build_model("toy", n_layer=RANKS_LAYERS).double(), x, y)
    loss = results[-1][0]
    if loss is None or not within_fp32_noise(
            torch.tensor(loss), torch.tensor(ref_loss), torch.tensor(ref64_loss))[0]:
        raise CheckFailed(f"{p} ranks, m = {m}: loss {loss!r} on the last rank, unsplit model "
                          f"{ref_loss:.6f}")
    grads: dict = {}
    for _, g, _ in results:
        # the executor already sums the tied weight's two copies (first and last rank):
        # either copy is the unsplit model's gradient
        grads.update(g)
    for name, want in ref.items():
        # accumulation over micro-batches reorders float32 sums: rounding only
        if name not in grads or not within_fp32_noise(grads[name], want, ref64[name])[0]:
            raise CheckFailed(f"{p} ranks, m = {m}: gradient of {name} differs from the "
                              f"unsplit model's")
    # measured from the bytes autograd keeps, in micro-batches (float: a micro-batch
    # being freed counts by the share of its bytes still alive)
    measured = [round(r[2], 6) for r in results]
    shown = "[" + ", ".join(f"{x:g}" for x in measured) + "]"
    want = [min(p - i, m) for i in range(p)]
    if measured != want:
        raise CheckFailed(f"{p} ranks, m = {m}: measured peak stash {shown} micro-batches per "
                          f"rank; 1F1B keeps {want}. The pipeline is correct but holds more "
                          f"activations than 1F1B needs (GPipe order?)")
    return shown, float(loss)


ZB_GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 6, 8, 12)]


def check_zb_h1(zb_h1_fn) -> None:
    """``zb_h1(p, m)``: per-rank lists of F(j), B(j) (input gradient) and W(j) (weight
    gradient). Verified by the simulator with T_F = T_B = T_W (Qi et al. 2023, sec. 3.1):
    a valid, deadlock-free schedule, at most p micro-batches in flight on any rank
    (1F1B's peak, held from F to W), and a bubble no larger than ZB-H1's.

    Catches:
    * every W right after its B (1F1B cut in two): 1F1B's bubble (named);
    * every W postponed to the end: more than p micro-batches held (named);
    * W before its B: an invalid schedule (named);
    * plain 1F1B, no W at all: named;
    * W's held back by a count written for one p: the bubble or the memory at another p
      of ZB_GRID (p = 1, 2, 3, 4, 6);
    * returns None or a malformed list, or raises: named with the case;
    * calls the course's ``zb_h1``: refused by name (its ``one_f_one_b`` is allowed: ZB-H1
      starts from 1F1B's order).
    """
    from helpers.pipeline import zb_h1 as reference

    for p, m in ZB_GRID:
        got = _attempt(zb_h1_fn, p, m, what=f"zb_h1({p}, {m})",
                       course=["helpers.pipeline.schedules.zb_h1"])
        sched = _validated(got, p, m, "zb_h1")
        if len(sched) != p:
            raise CheckFailed(f"zb_h1({p}, {m}) has {len(sched)} rank(s), expected {p}")
        if p > 1 and not any(a.kind == "W" for row in sched for a in row):
            raise CheckFailed(f"zb_h1({p}, {m}) has no W actions: split each backward into "
                              f"B (input gradient) and W (weight gradient)")
        # T_F = T_B = T_W = 1: t_backward = 2 split into B = 1 and W = 1
        sim = simulate(sched, 1.0, 2.0, t_weight=1.0)
        want = simulate(reference(p, m), 1.0, 2.0, t_weight=1.0)
        limit = min(p, m)
        if max(sim.peak_stash) > limit:
            raise CheckFailed(
                f"zb_h1({p}, {m}) holds up to {sim.peak_stash} micro-batches per rank (from F "
                f"to W); ZB-H1 keeps 1F1B's memory, at most {limit} on any rank. Postponing "
                f"W's costs memory: hold back only as many as the rank's 1F1B headroom "
                f"allows. Your schedule:\n{format_schedule(sched)}")
        if sim.bubble_fraction > want.bubble_fraction + 1e-9:  # exact arithmetic on small ints
            one_f_one_b_like = all(
                row[i + 1] == Action("W", a.microbatch, a.chunk)
                for row in sched for i, a in enumerate(row) if a.kind == "B")
            hint = (" Every W runs right after its B: that is 1F1B with the backward cut in "
                    "two, which keeps most of 1F1B's bubble (only the input gradient leaves "
                    "a W earlier). A rank with memory to spare under 1F1B can hold "
                    "some W's back, so that they fill the idle slots of the drain."
                    if one_f_one_b_like else "")
            raise CheckFailed(
                f"zb_h1({p}, {m}): the simulator measures a bubble of "
                f"{sim.bubble_fraction:.4f} (step {sim.total_time:g} units), ZB-H1 reaches "
                f"{want.bubble_fraction:.4f} (step {want.total_time:g}).{hint}\n"
                f"{format_schedule(sched)}")
    passed(f"zero-bubble schedule right for {len(ZB_GRID)} (p, m) pairs: memory within "
           f"1F1B's p, bubble (p-1)/(3m+p-1) for m >= p (T_F = T_B = T_W)")
