"""Ring attention drawn from what each rank did at each step (chapter 10).

(Chapter 03's ring all-reduce has its own picture, ``helpers.drawing.ring``.)

``helpers.sp.ring_forward(..., trace=steps)`` records, on every rank and at every step,
whose K/V block the rank held, the global positions of its queries and of the block's
keys, the causal mask it applied, whether it skipped the block (every score masked),
and to which neighbour it passed the block on. Gather those lists from the ranks and
``ring_data`` turns them into plain values; ``draw_ring_step`` draws one step as the
whole s x s score matrix (queries down, keys across, in global positions):

* the scores each rank computes at this step, in that rank's colour
  (``helpers.drawing.rank_color``), outlined by the block it holds, labelled with the
  rank the block started on;
* inside a computed block, the scores the causal mask removes, pale and crossed;
* a block the rank skips (its keys are all in the future of its queries), dashed;
* the scores earlier steps computed, faint.

After cp steps every score on or below the diagonal has been computed exactly once
(``ring_data`` checks it), and none above. With the contiguous layout the last rank's
rows fill at every step while the first rank's fill once; with the zigzag layout every
rank computes the same number of scores (chapter 10, section 4). ``show_ring`` gives a
slider over the steps in JupyterLab and the strip of all steps as the stored picture.
"""

from __future__ import annotations

from typing import Any

from helpers.drawing import FRAME_TEXT_PT, draw_strip, rank_color, step_frames

__all__ = ["ring_data", "draw_ring_step", "draw_ring", "show_ring"]

FRAME = (4.2, 4.4)   # one step's frame (inches): the slider's, and the strip's in two columns


def ring_data(traces: list[list[dict]]) -> dict[str, Any]:
    """Plain values from every rank's ``ring_forward`` trace (rank order):
    {"seq", "ranks", "steps": [[{"rank", "owner", "sent_to", "received_from", "computed",
    "visible": [(q, k), ...], "masked": [(q, k), ...]} per rank] per step]}. Raises
    ValueError if a score is computed twice, or if the steps do not cover exactly the
    causal triangle (the trace is not a whole causal ring)."""
    ranks = len(traces)
    steps = len(traces[0])
    if any(len(t) != steps for t in traces):
        raise ValueError("every rank must have traced the same number of steps")
    seq = sum(len(t[0]["q_pos"]) for t in traces)
    out_steps, seen = [], set()
    for s in range(steps):
        row = []
        for r in range(ranks):
            rec = traces[r][s]
            q_pos, k_pos, mask = rec["q_pos"], rec["k_pos"], rec["mask"]
            visible, masked = [], []
            if rec["computed"]:
                for i, q in enumerate(q_pos):
                    for j, k in enumerate(k_pos):
                        (visible if bool(mask[i][j]) else masked).append((int(q), int(k)))
            dup = seen.intersection(visible)
            if dup:
                raise ValueError(f"score {sorted(dup)[0]} computed twice")
            seen.update(visible)
            row.append({"rank": r, "owner": rec["owner"], "sent_to": rec["sent_to"],
                        "received_from": rec["received_from"], "computed": rec["computed"],
                        "q_pos": [int(q) for q in q_pos], "k_pos": [int(k) for k in k_pos],
                        "visible": visible, "masked": masked})
        out_steps.append(row)
    triangle = {(q, k) for q in range(seq) for k in range(q + 1)}
    if seen != triangle:
        raise ValueError(f"the steps computed {len(seen)} scores; causal attention over "
                         f"{seq} positions has {len(triangle)}")
    return {"seq": seq, "ranks": ranks, "steps": out_steps}


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 14, 15] -> [(0, 2), (14, 2)]: contiguous runs as (start, length)."""
    runs: list[tuple[int, int]] = []
    for v in sorted(values):
        if runs and runs[-1][0] + runs[-1][1] == v:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


def draw_ring_step(ax, data: dict[str, Any], step: int) -> None:
    """Step ``step`` of ``ring_data``'s values on ``ax`` (see the module docstring)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle

    seq = data["seq"]
    image = np.ones((seq, seq, 3))                       # white: not computed (yet)
    for earlier in data["steps"][:step]:                 # faint: earlier steps
        for blk in earlier:
            faint = 0.25 * np.array(to_rgb(rank_color(blk["rank"]))) + 0.75
            for q, k in blk["visible"]:
                image[q, k] = faint
    masked_q, masked_k, masked_c = [], [], []
    for blk in data["steps"][step]:
        colour = np.array(to_rgb(rank_color(blk["rank"])))
        for q, k in blk["visible"]:
            image[q, k] = colour
        for q, k in blk["masked"]:                       # computed, then masked: marked
            image[q, k] = 0.12 * colour + 0.88
            masked_q.append(q)
            masked_k.append(k)
            masked_c.append(colour)
    ax.imshow(image, extent=(0, seq, seq, 0), interpolation="nearest")
    if masked_q:
        # a cross a third of a cell wide: read as a cross, not a dot, at the strip's size
        cell_pt = 72 * ax.get_position().width * ax.figure.get_figwidth() / seq
        ax.scatter(np.array(masked_k) + 0.5, np.array(masked_q) + 0.5, marker="x",
                   s=(cell_pt / 3) ** 2, c=np.array(masked_c), linewidths=0.8)
    for blk in data["steps"][step]:
        colour = rank_color(blk["rank"])
        for q0, nq in _runs(blk["q_pos"]):
            for k0, nk in _runs(blk["k_pos"]):
                ax.add_patch(Rectangle((k0, q0), nk, nq, facecolor="none", edgecolor=colour,
                                       linewidth=1.2, linestyle="-" if blk["computed"] else "--"))
    ax.set_xlim(0, seq)
    ax.set_ylim(seq, 0)          # query 0 at the top, as a matrix is written
    ax.set_aspect("equal")
    ax.set_xticks([]), ax.set_yticks([])
    ax.set_xlabel("key position", fontsize=FRAME_TEXT_PT)
    ax.set_ylabel("query position", fontsize=FRAME_TEXT_PT)
    held = ", ".join(f"{b['rank']}:{b['owner']}" for b in data["steps"][step])
    ax.set_title(f"step {step}: rank:block {held}", fontsize=FRAME_TEXT_PT)


def draw_ring(traces: list[list[dict]], *, title: str | None = None):
    """Every step side by side; returns ``(fig, data)`` with ``data = ring_data(traces)``."""
    data = ring_data(traces)
    fig = draw_strip(lambda ax, s: draw_ring_step(ax, data, s), len(data["steps"]),
                     frame_size=FRAME, title=title)
    return fig, data


def show_ring(traces: list[list[dict]], *, title: str | None = None) -> dict[str, Any]:
    """A slider over the steps (``helpers.drawing.step_frames``); returns the data."""
    data = ring_data(traces)
    step_frames(lambda ax, s: draw_ring_step(ax, data, s), len(data["steps"]),
                frame_size=FRAME, title=title)
    return data
