"""One step's compute and communication, as recorded: where communication hides.

``helpers.overlap.Timeline`` (and DDP's bucket log, ``ddp_timeline``) record three lanes
per rank while a step runs: compute spans (a unit's forward or backward), communication
in flight (from a collective's launch to its data's arrival) and waits (the training
thread blocked on a collective). Exposed communication is the waiting time while
something was in flight; the rest of the communication ran under compute, hidden
(``helpers.overlap.exposed_comm``).

``draw_step_spans({label: [rank 0's events, rank 1's, ...]})`` draws each recorded run as
a Gantt chart, one panel per run (``helpers.overlap.plot_timelines``: a row per rank and
lane, every wide bar labelled, F/B forward/backward, AG/RS/AR all-gather, reduce-scatter,
all-reduce), and returns with the figure the spans it drew and each rank's exposed and
hidden time, computed from the same spans. Put two runs of one step side by side (small
buckets against one, prefetch on against off): look for communication bars with compute
above them (hidden) and for wait bars (exposed).
"""

from __future__ import annotations

from helpers.overlap import exposed_comm, plot_timelines

__all__ = ["LANES", "draw_step_spans"]

LANES = ("compute", "comm", "wait")


def draw_step_spans(runs: dict[str, list[list[dict]]], *, width: float = 9.0):
    """One panel per run; returns (fig, data), ``data`` = {label: {"t0": seconds,
    "ranks": [{lane: [(name, start ms, end ms)]}], "exposed": [each rank's
    ``exposed_comm``]}}. Times are from the run's earliest event."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(width, 0.5 + 2.6 * len(runs)),
                             squeeze=False)
    data = {}
    for ax, (label, timelines) in zip(axes[:, 0], runs.items()):
        plot_timelines(timelines, ax=ax, title=label)
        t0 = min(e["start"] for tl in timelines for e in tl)
        data[label] = {
            "t0": t0,
            "ranks": [{lane: [(e["name"], (e["start"] - t0) * 1e3, (e["end"] - t0) * 1e3)
                              for e in tl if e["lane"] == lane] for lane in LANES}
                      for tl in timelines],
            "exposed": [exposed_comm(tl) for tl in timelines],
        }
    fig.tight_layout()
    return fig, data
