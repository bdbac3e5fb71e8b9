"""Two rooflines of the machine at hand, with the measured operations placed on them.

Chapter 01's probe (``helpers.costs.ceilings.roofline_probe``) measures three roofs on
every rank (a GEMM's FLOP/s, a copy's memory bytes/s, an all-reduce's link bytes/s)
and a data-parallel sweep. The picture draws Williams et al.'s roofline twice from
that record, log-log, FLOP/s against arithmetic intensity:

* **memory**: min(C, I x B_mem), with the step's GEMMs on m tokens at their own
  intensity (FLOPs over the bytes of their operands and results) and measured rate;
* **link**: min(C, I x W), with each step of the sweep at its intensity against the
  link (the step's 6 P T FLOPs per byte its gradient all-reduce sends, 2(n-1)/n of
  them) and the rate it would reach with its all-reduce hidden behind its compute,
  6 P T / max(compute, all-reduce), both measured.

    record = slowest(launch(roofline_probe, 2))
    fig, data = draw_rooflines(record)
"""

from __future__ import annotations

__all__ = ["roofline_points", "draw_rooflines"]


def roofline_points(record: dict) -> dict:
    """The values the picture draws, from the probe's record: the roofs, and per panel
    the points as (label, intensity in FLOP/byte, FLOP/s)."""
    from helpers.costs.ceilings import step_gemm_flops, step_gemms
    from helpers.costs.network import wire_factor
    from helpers.costs.roofline import gemm_bytes

    b, h = record["grad_bytes"], record["hidden"]   # the probe's tensors are fp32
    gemms = [(f"m={m}", step_gemm_flops(m, h) / sum(gemm_bytes(*s, b) for s in step_gemms(m, h)),
              rate) for m, rate in record["thin"]]
    sent = wire_factor("all_reduce", record["world"]) * record["params"] * b
    steps = [(f"T={n}", 6 * record["params"] * n / sent,
              6 * record["params"] * n / max(compute, comm))
             for n, compute, comm in record["sweep"]]
    return {"flops": record["gemm_flops"], "memory_bw": record["memory_bw"],
            "link_bw": record["link_bw"], "gemms": gemms, "steps": steps}


def draw_rooflines(record: dict, title: str = "this machine"):
    """(fig, data): the memory and the link roofline side by side (module docstring)."""
    import matplotlib.pyplot as plt
    import numpy as np

    data = roofline_points(record)
    c = data["flops"]
    fig, axes = plt.subplots(1, 2, figsize=(8.3, 3.4))
    panels = ((axes[0], data["memory_bw"], data["gemms"], "memory", "GEMMs"),
              (axes[1], data["link_bw"], data["steps"], "all-reduce link", "DP steps"))
    for ax, bw, points, wire, what in panels:
        xs = [p[1] for p in points]
        lo, hi = min(xs + [c / bw]) / 4, max(xs + [c / bw]) * 4
        grid = np.geomspace(lo, hi, 200)
        ax.loglog(grid, np.minimum(c, grid * bw), color="black", lw=1.5)
        ax.axvline(c / bw, color="grey", ls=":", lw=1)
        ax.text(c / bw, c * 1.15, f"ridge {c / bw:,.0f}", ha="center", va="bottom")
        ax.scatter(xs, [p[2] for p in points], zorder=3, label=what)
        for label, x, y in points:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10))
        ax.set_xlabel(f"FLOPs per byte of {wire}")
        ax.set_title(f"{wire} roofline, {title}")
        ax.set_ylim(top=c * 3)
    axes[0].set_ylabel("FLOP/s")
    fig.tight_layout()
    return fig, data
