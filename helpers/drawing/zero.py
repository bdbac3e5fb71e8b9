"""ZeRO as a picture: which elements of the model state each rank holds, moment by moment.

ZeRO lays every trainable parameter out in one flat index space (``FlatPartition``:
buckets padded to a multiple of N, rank r owning chunk r of each bucket). Each rank
holds three states over that space: the weights, the gradients and the optimizer state
(Adam's moments, and the fp32 master copy in mixed precision). Data parallelism keeps all
three whole on every rank; stage 1 cuts the optimizer state down to the rank's own
chunks, stage 2 the gradients as well, stage 3 the weights too, which then exist whole
only while the module that needs them runs (Rajbhandari et al. 2020, sec. 5, Figure 1).

``ZeroOptimizer.holdings()`` reads, on a rank, which index ranges it holds right now,
from the storages of its own tensors (a buffer freed to 0 bytes holds nothing). A run
records it at a few moments of a step (during a module's forward, after backward, after
the optimizer step) and this module draws the records: one row per rank, a bar per state
along the flat index, filled (in the rank's colour) where the rank holds the elements.
Read a frame top to bottom: where the bars of every rank are full, that state is
replicated N times; where each rank's bar has only its own chunks, it is sharded, and
the ranks' chunks tile the index space exactly once between them.

``draw_holdings(frames, total)`` draws every frame side by side (returns ``(fig, data)``);
``show_holdings`` shows them with a slider in JupyterLab (``helpers.drawing.step_frames``),
the strip as the stored picture.
"""

from __future__ import annotations

from helpers.drawing import FRAME_TEXT_PT, draw_strip, rank_color, step_frames

__all__ = ["STATES", "draw_holdings_frame", "draw_holdings", "show_holdings", "held_fraction"]

STATES = ("weights", "grads", "optimizer")
_ALPHA = {"weights": 0.95, "grads": 0.6, "optimizer": 0.3}


def held_fraction(spans: list, total: int) -> float:
    """The share of the ``total`` elements the ``[lo, hi)`` spans cover."""
    return sum(hi - lo for lo, hi in spans) / total if total else 0.0


def draw_holdings_frame(ax, label: str, per_rank: list[dict], total: int) -> None:
    """One moment: ``per_rank[r]`` is rank r's ``holdings()`` ({state: [(lo, hi)]})."""
    from matplotlib.patches import Rectangle

    n = len(per_rank)
    for r, held in enumerate(per_rank):
        for k, state in enumerate(STATES):
            y = n - 1 - r + 0.08 + 0.28 * (2 - k)   # weights on top of each rank's band
            ax.add_patch(Rectangle((0, y), total, 0.24, facecolor="#eeeeee", edgecolor="none"))
            for lo, hi in held.get(state, []):
                ax.add_patch(Rectangle((lo, y), hi - lo, 0.24, facecolor=rank_color(r),
                                       alpha=_ALPHA[state], edgecolor="none"))
    ax.set_xlim(0, total)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)],
                  fontsize=FRAME_TEXT_PT)
    ax.set_xticks([0, total], ["0", f"{total:,}"], fontsize=FRAME_TEXT_PT)
    # the key of every frame, so that one frame alone (the slider's) reads by itself
    ax.set_xlabel("each rank, top to bottom: " + ", ".join(STATES), fontsize=FRAME_TEXT_PT)
    ax.tick_params(length=0)
    ax.set_title(label, fontsize=FRAME_TEXT_PT)
    for side in ax.spines.values():
        side.set_visible(False)


def _legend(fig) -> None:
    from matplotlib.patches import Patch
    handles = [Patch(facecolor="grey", alpha=_ALPHA[s],
                     label=f"{s} (bar {i + 1} of each rank)") for i, s in enumerate(STATES)]
    handles.append(Patch(facecolor="#eeeeee", label="not held"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=FRAME_TEXT_PT,
               frameon=False, bbox_to_anchor=(0.5, 0.0))


def draw_holdings(frames: list[tuple[str, list[dict]]], total: int, *, per_row: int = 3,
                  title: str | None = None):
    """Every frame of ``frames`` ([(label, [holdings of rank 0, 1, ...])]) side by side;
    returns (fig, data), ``data`` = {"total", "frames": [{"label", "ranks": [{state:
    spans}], "fraction": [{state: share of total held}]}]}."""
    fig = draw_strip(lambda ax, i: draw_holdings_frame(ax, frames[i][0], frames[i][1], total),
                     len(frames), frame_size=(3.3, 0.55 + 0.42 * len(frames[0][1])),
                     per_row=per_row, title=title)
    _legend(fig)
    fig.subplots_adjust(bottom=max(0.08, 0.6 / fig.get_size_inches()[1]))
    return fig, _data(frames, total)


def show_holdings(frames: list[tuple[str, list[dict]]], total: int, *, per_row: int = 3,
                  title: str | None = None) -> dict:
    """``draw_holdings`` as a slider over the frames (the strip stored as its picture);
    returns the same ``data``."""
    step_frames(lambda ax, i: draw_holdings_frame(ax, frames[i][0], frames[i][1], total),
                len(frames), label="moment", frame_size=(4.5, 0.7 + 0.45 * len(frames[0][1])),
                per_row=per_row, title=title)
    return _data(frames, total)


def _data(frames, total) -> dict:
    return {"total": total,
            "frames": [{"label": label,
                        "ranks": [{s: [tuple(x) for x in held.get(s, [])] for s in STATES}
                                  for held in ranks],
                        "fraction": [{s: held_fraction(held.get(s, []), total) for s in STATES}
                                     for held in ranks]}
                       for label, ranks in frames]}
