"""Play a schedule on paper: when each action runs, the bubble, the stash.

``simulate(schedule, t_forward, t_backward, t_comm=0)`` gives every action a
start and end time. Each rank runs its own list in order; an action starts as
soon as its rank is free *and* its inputs exist:

* ``F(j)`` on virtual stage s waits for ``F(j)`` on stage s-1 (its input
  activation), plus ``t_comm`` if that stage lives on another rank;
* ``B(j)`` on stage s waits for ``B(j)`` on stage s+1 (the gradient of its
  output), plus ``t_comm``, and for its own ``F(j)``;
* ``W(j)`` (zero-bubble schedules only: the weight-gradient half of a
  backward) waits for its own ``B(j)`` on the same rank; nobody waits for it.
  In a schedule with W actions, ``t_backward`` is split: W takes
  ``t_weight`` (default half of it), B the rest, so the work per
  micro-batch is the same as without the split.

Virtual stage of chunk c on rank r: ``s = c * p + r`` (Megatron-LM's
interleaving). Times are per micro-batch for a rank's *whole* share of the
model: a rank with v chunks spends ``t_forward / v`` on each chunk's forward.
That is the convention under which interleaving saves time: the same layers,
cut finer. ``t_forward`` may be one number or one per rank (an imbalanced
split, chapter 11).

What comes back (``Simulation``): per-rank busy intervals, the makespan, the
bubble fraction ``idle / (p * makespan)``, and the peak number of stashed
activations per rank (a micro-batch's activations on a chunk are stashed from
its F until its B, or until its W when the schedule splits the backward: the
weight gradient needs the layer inputs). With t_b = 2 t_f and balanced stages this reproduces the
closed forms (Narayanan et al. 2021, SC21, sec. 2.2): bubble
``(p-1)/(m+p-1)`` for GPipe and 1F1B and ``(p-1)/(v*m+p-1)`` interleaved.

A schedule that cannot finish (two ranks each waiting for the other) raises
``ScheduleDeadlock``, naming the stuck actions. Since sends never block in
our executor (``isend``) and each receive waits only for an action the
simulator found runnable, a schedule that simulates also runs: this check is
what makes the executor deadlock-free on gloo. On nccl, where sends and
receives also queue on a stream, the executor additionally posts them in
per-step groups (``helpers.pipeline.p2p``).

How production differs: real runs add launch overheads, contention between
communication and compute, and imbalanced layers (the embedding and the head);
Megatron and torch.distributed.pipelining do not simulate, they just run.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from helpers.pipeline.schedules import Action, normalize, schedule_shape

__all__ = ["simulate", "Simulation", "ScheduleDeadlock", "validate_schedule",
           "bubble_formula", "peak_stash", "gantt"]


class ScheduleDeadlock(ValueError):
    """Every unfinished rank waits for an action another rank will never run."""


@dataclasses.dataclass
class Simulation:
    intervals: list[list[tuple[float, float, Action]]]  # per rank: (start, end, action)
    total_time: float                                    # makespan of the step
    bubble_fraction: float                               # idle / (p * total_time)
    peak_stash: list[int]                                # per rank, in chunk-activations

    @property
    def num_stages(self) -> int:
        return len(self.intervals)

    def busy(self, rank: int) -> float:
        return sum(e - s for s, e, _ in self.intervals[rank])


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """(p-1) / (v*m + p-1): idle fraction of a step with t_b = 2 t_f, balanced
    stages and free communication (Huang et al. 2019 sec. 2.2 for v = 1;
    Narayanan et al. 2021 SC21 sec. 2.2.2 for v chunks). Note the papers quote
    the bubble relative to the ideal time, (p-1)/(v*m); we quote it as the
    fraction of the actual step, which is what a timeline shows."""
    return (p - 1) / (v * m + p - 1)


def validate_schedule(schedule: Sequence[Sequence], num_microbatches: int | None = None,
                      num_chunks: int | None = None) -> list[list[Action]]:
    """Every (micro-batch, chunk) gets exactly one F and one B on every rank (and
    one W if the schedule has any), B after F and W after B on the same rank;
    then the dependencies must be satisfiable (no deadlock). Returns the
    normalized schedule; raises ValueError (or ScheduleDeadlock) saying why not."""
    sched = normalize(schedule)
    p, m_seen, v_seen = schedule_shape(sched)
    m = m_seen if num_microbatches is None else num_microbatches
    v = v_seen if num_chunks is None else num_chunks
    kinds = ("F", "B", "W") if any(a.kind == "W" for row in sched for a in row) else ("F", "B")
    want = sorted(Action(k, j, c) for k in kinds for j in range(m) for c in range(v))
    for r, row in enumerate(sched):
        got = sorted(row)
        if got != want:
            missing = sorted(set(want) - set(got))
            extra = sorted(set(got) - set(want))
            dup = sorted({a for a in row if row.count(a) > 1})
            parts = [f"missing {missing[:6]}" if missing else "",
                     f"unexpected {extra[:6]}" if extra else "",
                     f"repeated {dup[:6]}" if dup else ""]
            raise ValueError(f"rank {r} must run each of {kinds} once for each of {m} "
                             f"micro-batch(es) x {v} chunk(s): "
                             + "; ".join(x for x in parts if x))
        seen = set()
        for a in row:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(before, a.microbatch, a.chunk) not in seen:
                what = "forward" if before == "F" else "input-gradient backward"
                raise ValueError(f"rank {r}: {a!r} comes before its {what} "
                                 f"{Action(before, a.microbatch, a.chunk)!r}")
            seen.add(a)
    _play(sched, [1.0] * p, [2.0] * p, [1.0] * p, 0.0)  # raises ScheduleDeadlock
    return sched


def _deps(a: Action, rank: int, p: int, v: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish before ``a`` on ``rank`` may start."""
    s = a.chunk * p + rank          # virtual stage
    S = p * v
    if a.kind == "F":
        if s == 0:
            return []
        prev = s - 1
        return [(prev % p, Action("F", a.microbatch, prev // p))]
    if a.kind == "W":
        return [(rank, Action("B", a.microbatch, a.chunk))]
    deps = [(rank, Action("F", a.microbatch, a.chunk))]
    if s < S - 1:
        nxt = s + 1
        deps.append((nxt % p, Action("B", a.microbatch, nxt // p)))
    return deps


def _play(sched: list[list[Action]], tf: list[float], tb: list[float], tw: list[float],
          t_comm: float) -> tuple[list[list[tuple[float, float, Action]]], list[int]]:
    """tb: the whole backward; tw: its W part, used only if the schedule has W actions."""
    p, _, v = schedule_shape(sched)
    split = any(a.kind == "W" for row in sched for a in row)
    # per rank and kind, the time of one micro-batch through the rank's whole share
    cost = [{"F": tf[r], "B": tb[r] - (tw[r] if split else 0.0), "W": tw[r]} for r in range(p)]
    done: dict[tuple[int, Action], float] = {}   # (rank, action) -> end time
    free = [0.0] * p                              # when each rank is next idle
    pos = [0] * p                                 # next action index per rank
    intervals: list[list] = [[] for _ in range(p)]
    while any(pos[r] < len(sched[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(sched[r]):
                a = sched[r][pos[r]]
                deps = _deps(a, r, p, v)
                if not all(d in done for d in deps):
                    break
                start = max([free[r]] + [done[(dr, da)] + (t_comm if dr != r else 0.0)
                                         for dr, da in deps])
                dur = cost[r][a.kind] / v  # a chunk is 1/v of the rank
                done[(r, a)] = free[r] = start + dur
                intervals[r].append((start, start + dur, a))
                pos[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: sched[r][pos[r]] for r in range(p) if pos[r] < len(sched[r])}
            detail = "; ".join(
                f"rank {r} at {a!r} waits for "
                + ", ".join(f"{da!r} on rank {dr}" for dr, da in _deps(a, r, p, v)
                            if (dr, da) not in done)
                for r, a in waiting.items())
            raise ScheduleDeadlock(f"the schedule deadlocks: {detail}")
    return intervals, peak_stash(sched)


def peak_stash(schedule: Sequence[Sequence]) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activations held at once: +1 at
    each F, -1 at each B (at each W instead, if the schedule splits the backward)."""
    sched = normalize(schedule)
    freed_by = "W" if any(a.kind == "W" for row in sched for a in row) else "B"
    peaks = []
    for row in sched:
        held = peak = 0
        for a in row:
            held += 1 if a.kind == "F" else -1 if a.kind == freed_by else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _per_rank(value, p: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * p
    else:
        values = [float(x) for x in value]
        if len(values) != p:
            raise ValueError(f"{name} has {len(values)} entries for {p} ranks")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return values


def simulate(schedule: Sequence[Sequence], t_forward=1.0, t_backward=2.0,
             t_comm: float = 0.0, t_weight=None) -> Simulation:
    """Timeline of ``schedule`` given per-micro-batch forward/backward times.

    t_forward, t_backward: time for one micro-batch through one rank's whole
        share of the layers (a number, or a list with one entry per rank).
    t_comm: latency added to every message between two different ranks.
    t_weight: the W part of t_backward in a schedule with W actions (default
        t_backward / 2: Qi et al. 2023 take T_B = T_W, sec. 2).
    """
    sched = validate_schedule(schedule)
    p = len(sched)
    tf = _per_rank(t_forward, p, "t_forward")
    tb = _per_rank(t_backward, p, "t_backward")
    tw = [x / 2 for x in tb] if t_weight is None else _per_rank(t_weight, p, "t_weight")
    if any(w > b for w, b in zip(tw, tb)):
        raise ValueError(f"t_weight ({t_weight}) is part of t_backward ({t_backward}): "
                         f"it cannot be larger")
    if t_comm < 0:
        raise ValueError(f"t_comm must be >= 0, got {t_comm}")
    intervals, stash = _play(sched, tf, tb, tw, float(t_comm))
    total = max(e for row in intervals for _, e, _ in row)
    busy = sum(e - s for row in intervals for s, e, _ in row)
    bubble = 1.0 - busy / (p * total) if total > 0 else 0.0
    return Simulation(intervals, total, bubble, stash)


_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
_LABEL_SIZE = 7  # points


def _label_points(label: str) -> float:
    """Width in points of ``label`` drawn inside a bar in the current font, with a point
    of margin each side."""
    from matplotlib.textpath import TextPath

    return TextPath((0, 0), label, size=_LABEL_SIZE).get_extents().width + 2


def gantt(intervals, ax=None, title: str = "", num_chunks: int | None = None):
    """Draw per-rank intervals [(start, end, action), ...] as a Gantt chart.

    Works for ``Simulation.intervals`` and for the executor's measured timeline.
    Forward blue, backward orange (weight gradient green); a later chunk is drawn
    lighter and labelled with its chunk (``F3.1``)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(intervals)))
    v = num_chunks or 1 + max((a.chunk for row in intervals for _, _, a in row), default=0)
    for r, row in enumerate(intervals):
        for s, e, a in row:
            alpha = 1.0 - 0.45 * a.chunk / max(v - 1, 1) if v > 1 else 1.0
            ax.barh(r, e - s, left=s, height=0.8, color=_COLORS[a.kind], alpha=alpha,
                    edgecolor="white", linewidth=0.5)
    # label a bar only where its name fits inside it: interleaved rows have many short
    # actions, and labels printed over each other read as none
    ax.autoscale_view()
    x0, x1 = ax.get_xlim()
    points_per_unit = ax.get_window_extent().width * 72 / ax.figure.dpi / (x1 - x0)
    for r, row in enumerate(intervals):
        for s, e, a in row:
            if (e - s) * points_per_unit >= _label_points(repr(a)):
                ax.text((s + e) / 2, r, repr(a), ha="center", va="center",
                        fontsize=_LABEL_SIZE, color="white")
    ax.set_yticks(range(len(intervals)), [f"rank {r}" for r in range(len(intervals))])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    if title:
        ax.set_title(title)
    return ax
