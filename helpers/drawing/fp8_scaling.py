"""Delayed FP8 scaling drawn from the scale and amax history a layer kept (chapter 13).

Delayed scaling (``helpers.precision.DelayedScaling``) casts step t's tensor with a scale
set from the amaxes of *earlier* steps: scale_t = fp8_max / max(history after step t - 1)
(Transformer Engine's ``DelayedScaling`` with ``amax_compute_algo="max"``). The record is
what the layer held at each step: the scale it cast with, this step's amax, and its
history afterwards (newest first). ``scaling_data(record)`` turns it into plain values,
and for every step finds *which earlier step's* amax set its scale: the position of the
maximum in the history the scale came from.

``draw_amax_history(record)`` draws each step's amax (a bar; red when it outgrew its
scale, so that its largest values saturated at +-fp8_max), the amax the scale assumed
(fp8_max / scale, a dot), and a line from the step whose amax set that scale to the step
that used it: a spike sets the scale of the next ``history_len`` steps, then drops out
of the window.
"""

from __future__ import annotations

from typing import Any

__all__ = ["scaling_data", "draw_amax_history"]


def scaling_data(record: list[dict], fp8_max: float = 448.0) -> list[dict[str, Any]]:
    """Per step {"step", "amax", "scale", "assumed" (fp8_max / scale), "from_step" (the
    earlier step whose amax set the scale; None at step 0, whose scale came from its own
    amax), "saturated" (amax > assumed)} from a record of {"amax", "scale", "history"}
    per step (``history``: the layer's amax history after the step, newest first)."""
    out = []
    for t, rec in enumerate(record):
        amax, scale = float(rec["amax"]), float(rec["scale"])
        frm = None
        if t:
            before = [float(a) for a in record[t - 1]["history"]]
            window = before[:min(len(before), t)]          # only steps that happened
            i = max(range(len(window)), key=lambda j: (window[j], -j))
            frm = t - 1 - i
        assumed = fp8_max / scale
        out.append({"step": t, "amax": amax, "scale": scale, "assumed": assumed,
                    "from_step": frm, "saturated": amax > assumed})
    return out


def draw_amax_history(record: list[dict], *, fp8_max: float = 448.0, title: str | None = None):
    """See the module docstring; returns ``(fig, scaling_data(record, fp8_max))``."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    data = scaling_data(record, fp8_max)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    steps = [d["step"] for d in data]
    # two bar calls, so that the legend names both colours
    for saturated, color, label in ((False, "#bbbbbb", "amax of the step"),
                                    (True, "#d62728", "amax above its scale's (clamped)")):
        chosen = [d for d in data if d["saturated"] == saturated]
        ax.bar([d["step"] for d in chosen], [d["amax"] for d in chosen], color=color,
               label=label)
    ax.plot(steps, [d["assumed"] for d in data], "o", color="#1f77b4", ms=4,
            label="amax its scale assumed (fp8_max / scale)")
    for d in data:
        if d["from_step"] is not None:
            src = data[d["from_step"]]
            ax.plot([src["step"], d["step"]], [src["amax"], d["assumed"]], color="#1f77b4",
                    lw=0.6, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("amax")
    values = [d["amax"] for d in data] + [d["assumed"] for d in data]
    ax.set_ylim(0.9 * min(values), 1.05 * max(values))   # the differences, not the zero
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole
    # under the axes, across: beside them it took half the figure's width
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, data
