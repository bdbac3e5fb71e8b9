"""FSDP's units as a picture: when each unit's full weights exist on each rank.

An FSDP unit is sharded at rest: each rank keeps 1/N of its flat buffer. It is whole
only from the moment its all-gather is launched until it is freed again: around its
forward, and again around its backward, when the gradients are reduce-scattered and the
unit freed (Zhao et al. 2023, "PyTorch FSDP", sec. 3.2). So the memory a rank needs for
weights is its shards plus the units whole *at the same time*, and the picture to look at
is the units' lives on a common clock.

``helpers.fsdp.FSDP(..., timeline=tl)`` records them on the ``Timeline``'s lane "held"
(one span per unit per life: gather launched to free), next to its "compute" lane
(``forward <unit>``, ``backward <unit>``) and "comm" lane. ``draw_unit_lives`` draws, for
each rank, one row per unit: a pale bar while the unit is held, a dark one while it
computes, and under the rows how many units are whole at each moment. With prefetch on,
a unit's life starts one unit early (its gather runs under the previous unit's compute),
so two blocks overlap; with ``reshard_after_forward=False`` a unit lives from its forward
to its backward. Read the bottom line's maximum against the step: that is the "only one or
two units whole at a time" of the FSDP paper, measured.
"""

from __future__ import annotations

from helpers.drawing import rank_color

__all__ = ["unit_lives", "draw_unit_lives"]


def unit_lives(events: list[dict], t0: float) -> dict:
    """One rank's record as the picture uses it: {"held": {unit: [(start, end) ms]},
    "computing": {unit: [(start, end) ms]}, "peak": most units held at once,
    "peak_at": when (ms)}. Times from ``t0`` (seconds), in ms."""
    held: dict[str, list] = {}
    computing: dict[str, list] = {}
    for e in events:
        span = ((e["start"] - t0) * 1e3, (e["end"] - t0) * 1e3)
        if e["lane"] == "held":
            held.setdefault(e["name"], []).append(span)
        elif e["lane"] == "compute":
            unit = e["name"].split(" ", 1)[1]
            computing.setdefault(unit, []).append(span)
    points = sorted([(a, 1) for spans in held.values() for a, _ in spans]
                    + [(b, -1) for spans in held.values() for _, b in spans],
                    key=lambda p: (p[0], p[1]))   # a free before a gather at the same time
    now = peak = 0
    peak_at = 0.0
    for t, d in points:
        now += d
        if now > peak:
            peak, peak_at = now, t
    return {"held": {u: sorted(v) for u, v in held.items()},
            "computing": {u: sorted(v) for u, v in computing.items()},
            "peak": peak, "peak_at": peak_at}


def draw_unit_lives(timelines: list[list[dict]], *, title: str | None = None):
    """Each rank's units (see the module docstring); ``timelines[r]`` is rank r's
    ``Timeline.events``. Returns (fig, data), ``data`` = {"t0", "units", "ranks":
    [``unit_lives`` of each rank]}."""
    import matplotlib.pyplot as plt

    t0 = min(e["start"] for tl in timelines for e in tl)
    ranks = [unit_lives(tl, t0) for tl in timelines]
    units = sorted({u for r in ranks for u in r["held"]},
                   key=lambda u: (u != "root", u))     # root first, then blocks in order
    n = len(units)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(9, 0.6 + (0.42 * n + 0.7) * len(ranks)),
                             sharex=True, squeeze=False)
    end = max(b for r in ranks for spans in r["held"].values() for _, b in spans)
    for ax, (rank, lives) in zip(axes[:, 0], enumerate(ranks)):
        for row, unit in enumerate(units):
            y = n - row
            ax.broken_barh([(a, b - a) for a, b in lives["held"].get(unit, [])], (y - 0.35, 0.7),
                           color=rank_color(rank), alpha=0.3)
            ax.broken_barh([(a, b - a) for a, b in lives["computing"].get(unit, [])],
                           (y - 0.18, 0.36), color=rank_color(rank), alpha=0.95)
        # how many units are whole at each moment, on a row of its own under them
        points = sorted([(a, 1) for s in lives["held"].values() for a, _ in s]
                        + [(b, -1) for s in lives["held"].values() for _, b in s],
                        key=lambda p: (p[0], p[1]))
        xs, ys, now = [0.0], [0], 0
        for t, d in points:
            xs += [t, t]
            ys += [now, now + d]
            now += d
        scale = 0.8 / max(1, lives["peak"])
        ax.plot(xs + [end], [-0.4 + v * scale for v in ys + [0]], color="black", lw=1)
        ax.text(end, -0.4 + lives["peak"] * scale, f" at most {lives['peak']} whole at once",
                fontsize=7, va="bottom", ha="right")
        ax.set_yticks([n - i for i in range(n)] + [-0.1], units + ["units whole"], fontsize=7)
        ax.set_ylim(-0.6, n + 0.6)
        ax.set_ylabel(f"rank {rank}", fontsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("ms from the first event  (pale: the unit's full weights exist, "
                           "from its gather's launch to its free; dark: it computes)", fontsize=8)
    fig.suptitle(title or "FSDP units on each rank: when their full weights exist", fontsize=9)
    fig.tight_layout()
    return fig, {"t0": t0, "units": units, "ranks": ranks}
