"""Pipeline schedules as data: for each rank, the ordered list of what it does.

A pipeline step pushes ``m`` micro-batches through ``p`` ranks. Each rank can
do two kinds of work on a micro-batch ``j``: its forward ``F(j)`` and its
backward ``B(j)``. A *schedule* says in which order each rank does them, and
nothing else. Here it is plain data::

    gpipe(2, 3)      -> [[F0, F1, F2, B0, B1, B2],      # rank 0
                         [F0, F1, F2, B0, B1, B2]]      # rank 1
    one_f_one_b(2, 3) -> [[F0, F1, B0, F2, B1, B2],
                          [F0, B0, F1, B1, F2, B2]]

so a schedule can be printed, compared, simulated (``helpers.pipeline.simulate``)
and run (``helpers.pipeline.executor``) without any process group. The
dependencies are implied: ``F(j)`` on stage s needs ``F(j)`` of stage s-1;
``B(j)`` on stage s needs ``B(j)`` of stage s+1 and its own ``F(j)`` (whose
activations it stashed).

The three classic schedules
---------------------------
* **GPipe** (Huang et al. 2019, "GPipe", sec. 2.2): all forwards, then all
  backwards. Every rank stashes the activations of all ``m`` micro-batches.
* **1F1B** (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training" (PipeDream-Flush/2BW), sec. 3.2; also Megatron-LM SC21, sec. 2.2.1):
  rank r first does ``p - r - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Same bubble as
  GPipe, but rank r never holds more than ``min(p - r, m)`` micro-batches.
* **Interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", sec. 2.2.2): each rank
  holds ``v`` non-contiguous model chunks ("virtual stages"); chunk c of rank r
  is virtual stage ``c * p + r``. Each chunk is v times shorter, so the fill and
  drain shrink by v: bubble ``(p-1) / (v*m + p-1)`` instead of
  ``(p-1) / (m + p-1)``, paid for with v times more point-to-point messages.
  Micro-batches go through the chunks in *rounds*: a round of micro-batches
  runs on chunk 0, then the same round on chunk 1, and so on. The paper's
  order (and early Megatron-LM) used rounds of exactly p and so required m
  to be a multiple of p. The production versions relax that only partly:
  Megatron-core takes rounds of ``microbatch_group_size_per_vp_stage``
  (default p, at least p) and refuses a last round shorter than p
  (``forward_backward_pipelining_with_interleaving``), so with the default m
  must still be a multiple of p; ``torch.distributed.pipelining``'s
  ``ScheduleInterleaved1F1B`` takes ``max(1, m // p)`` equal rounds and
  refuses an m they do not divide (PyTorch 2.13: m = 6 or 10 on p = 4, not 9
  or 11). We take torch's rounds and let the first ``m % rounds`` of them
  hold one micro-batch more, so every m works (the course's freedom, not the
  libraries'); every round holds at least min(p, m)
  micro-batches, which keeps the order deadlock-free. Where torch accepts m
  the order is torch's, and for m a multiple of p it is the paper's. The
  simulated bubble is the closed form below for every m >= p, whether or not
  p divides it; with m < p (one round, shorter than the pipeline) it is
  larger. Both checked on a grid in tests/test_pipeline_schedules.py.

Cost summary with t_b = 2 t_f (Narayanan et al. 2021, SC21, eq. 1 and sec. 2.2.2):
bubble time ``(p-1)(t_f + t_b)`` for GPipe and 1F1B, ``(p-1)(t_f + t_b)/v``
interleaved; peak stash m (GPipe), p - r (1F1B, rank r).

How production differs: Megatron-LM and ``torch.distributed.pipelining`` also
generate action lists (the latter calls them "pipeline_order") and add
actions for the communication itself (send/recv) so they can be overlapped
and batched. Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism") split B into input-gradient and weight-gradient actions and use
the weight-gradient work, which nobody waits for, to fill the bubble. Here a
schedule may contain a third kind of action, "W": then "B" stands for the
input-gradient half only (what the previous stage waits for) and "W(j)" for
the weight-gradient half, run later on the same rank. ``zb_h1`` is Qi et al.'s
ZB-H1 (sec. 3.1): 1F1B's order with each rank i holding back its W's by i
slots, so the drain's idle time is filled with weight gradients while the peak
of micro-batches in flight (F done, W not yet) stays at 1F1B's p. The
simulator plays it; the executor runs F/B schedules only.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from helpers.validate import positive_int

__all__ = ["Action", "F", "B", "W", "gpipe", "one_f_one_b", "zb_h1", "interleaved_1f1b",
           "microbatch_rounds",
           "normalize", "schedule_shape", "format_schedule"]


class Action(NamedTuple):
    """One unit of work on one rank: forward "F" or backward "B" of a micro-batch
    on one of the rank's model chunks (chunk 0 unless the schedule interleaves);
    in a zero-bubble schedule also "W", the weight-gradient half of a backward."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        tail = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{tail}"


def F(j: int, chunk: int = 0) -> Action:
    return Action("F", j, chunk)


def B(j: int, chunk: int = 0) -> Action:
    return Action("B", j, chunk)


def W(j: int, chunk: int = 0) -> Action:
    return Action("W", j, chunk)


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        positive_int(name, value)


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards, on every rank (Huang et al. 2019, sec. 2.2)."""
    _check_counts(num_stages, num_microbatches)
    m = num_microbatches
    return [[F(j) for j in range(m)] + [B(j) for j in range(m)] for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """PipeDream-Flush's one-forward-one-backward (Narayanan et al. 2021, sec. 3.2).

    Rank r: warm-up of ``w = min(p - r - 1, m)`` forwards; steady phase of
    ``m - w`` (forward, backward) pairs; cool-down of the ``w`` backwards left.
    The last rank has no warm-up: it turns each forward straight into a backward.
    """
    _check_counts(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [F(j) for j in range(warmup)]                 # fill
        for k in range(m - warmup):                             # steady: F(k+w), B(k)
            actions += [F(k + warmup), B(k)]
        actions += [B(j) for j in range(m - warmup, m)]         # drain
        schedule.append(actions)
    return schedule


def zb_h1(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3.1, fig. 3).

    1F1B's F/B order, with each backward split into B (input gradient, sent
    upstream at once) and W (weight gradient). Rank i issues W(k - i) after
    B(k): its W's lag i slots behind, and the lagging W's run in the drain,
    where 1F1B would idle waiting for gradients from downstream. Micro-batches
    in flight on rank i (F done, W not yet) peak at (p - i - 1) + 1 + i = p,
    1F1B's peak on rank 0. With T_F = T_B = T_W the bubble per rank falls
    from (p-1)(T_F + T_B + T_W) to (p-1)(T_F + T_B - T_W), a third.
    """
    _check_counts(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [F(j) for j in range(warmup)]
        issued = 0  # W's issued so far, in micro-batch order
        for k in range(m):
            if k + warmup < m:
                actions.append(F(k + warmup))
            actions.append(B(k))
            if k - r >= 0:                  # lag of r slots on rank r
                actions.append(W(k - r))
                issued += 1
        actions += [W(j) for j in range(issued, m)]  # the lagging W's fill the drain
        schedule.append(actions)
    return schedule


def interleaved_1f1b(num_stages: int, num_microbatches: int,
                     num_chunks: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, SC21, sec. 2.2.2).

    Work is counted in *virtual micro-batches*: every rank does ``v * m``
    forwards, taken in rounds per chunk (`microbatch_rounds`; p micro-batches
    each when p divides m): micro-batches 0..p-1 on chunk 0, then the same p
    on chunk 1, ..., then micro-batches p..2p-1 on chunk 0, and so on.
    Backwards go through the chunks in reverse. Rank r warms up with
    ``(p - r - 1) * 2 + (v - 1) * g`` forwards, g the first round's size (so
    the last virtual stage can start backwards as early as possible), then
    alternates, then drains. Any m >= 1 works (see the module docstring).
    """
    _check_counts(num_stages, num_microbatches)
    positive_int("num_chunks", num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v == 1:
        return one_f_one_b(p, m)
    rounds = microbatch_rounds(p, m)
    # the forward order, shared by every rank: (micro-batch, chunk) per step
    table = [(j, c) for rnd in rounds for c in range(v) for j in rnd]
    total = v * m  # virtual micro-batches per rank

    def forward_action(k: int) -> Action:
        return F(table[k][0], chunk=table[k][1])

    def backward_action(k: int) -> Action:
        return B(table[k][0], chunk=v - 1 - table[k][1])  # chunks in reverse

    schedule = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * len(rounds[0]), total)
        actions = [forward_action(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward_action(k + warmup), backward_action(k)]
        actions += [backward_action(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def microbatch_rounds(num_stages: int, num_microbatches: int) -> list[range]:
    """How interleaved 1F1B groups micro-batches: ``max(1, m // p)`` rounds of
    consecutive micro-batches, the first ``m % rounds`` one longer than the rest.

    As torch.distributed.pipelining's ScheduleInterleaved1F1B (which requires
    the rounds to be equal); p rounds of p when p divides m, as in the paper.
    ``microbatch_rounds(4, 10) -> [range(0, 5), range(5, 10)]``;
    ``microbatch_rounds(4, 9) -> [range(0, 5), range(5, 9)]``.
    """
    _check_counts(num_stages, num_microbatches)
    n = max(1, num_microbatches // num_stages)
    base, extra = divmod(num_microbatches, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def normalize(schedule: Sequence[Sequence]) -> list[list[Action]]:
    """Accept tuples like ("F", 3) or ("B", 3, 1); return lists of ``Action``."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
        raise ValueError("a schedule is a non-empty list with one list of actions per rank")
    out = []
    for r, actions in enumerate(schedule):
        if isinstance(actions, (str, bytes)) or not isinstance(actions, Sequence):
            raise ValueError(f"rank {r}: expected a list of actions, got {type(actions).__name__}")
        row = []
        for a in actions:
            try:
                act = Action(*a)
            except TypeError:
                raise ValueError(f"rank {r}: {a!r} is not an action (kind, microbatch[, chunk])") \
                    from None
            if act.kind not in ("F", "B", "W"):
                raise ValueError(f"rank {r}: action kind must be 'F', 'B' or 'W', "
                                 f"got {act.kind!r}")
            if not isinstance(act.microbatch, int) or not isinstance(act.chunk, int) \
                    or act.microbatch < 0 or act.chunk < 0:
                raise ValueError(f"rank {r}: micro-batch and chunk must be ints >= 0 in {act!r}")
            row.append(act)
        out.append(row)
    return out


def schedule_shape(schedule: Sequence[Sequence]) -> tuple[int, int, int]:
    """(p ranks, m micro-batches, v chunks) of a schedule, read off its actions."""
    sched = normalize(schedule)
    acts = [a for row in sched for a in row]
    if not acts:
        raise ValueError("the schedule has no actions")
    return len(sched), max(a.microbatch for a in acts) + 1, max(a.chunk for a in acts) + 1


def format_schedule(schedule: Sequence[Sequence], width: int = 5) -> str:
    """One line per rank, e.g. ``rank 0 | F0   F1   B0   F2 ...``."""
    sched = normalize(schedule)
    return "\n".join(f"rank {r} | " + "".join(f"{a!r:<{width}}" for a in row).rstrip()
                     for r, row in enumerate(sched))
