"""Activation recompute drawn from what autograd kept (chapter 13).

The record is chapter 06's ``SavedTensorCounter``: every tensor handed to autograd for
backward passes through its saved-tensor hooks, with the innermost module running at the
time, its bytes, and whether it was saved by the forward or again during the backward (a
recompute re-runs part of the forward inside backward, and that re-run saves its tensors
a second time, briefly). ``saved_by_layer(counter)`` sums both per layer: what the
forward *kept* until backward, and what the recompute *re-saved* in backward.

``draw_saved(counters)`` draws one pair of bars per layer for each recompute mode
(``{"none": counter, "selective": ..., "full": ...}``): solid, the bytes the forward
kept; hatched, the bytes the recompute rebuilt during backward. Without recompute every
layer keeps everything and rebuilds nothing; selective recompute keeps the attention
core's inputs (q, k, v) and moves what the core saves (the score-sized tensors above
all) from the first bar to the second; full recompute keeps one block input per layer
and rebuilds the rest, one block at a time, which is why the peak falls while the total
work grows by one forward. (The layer of a re-saved tensor is the module running when
it was saved: selective recompute re-runs ``helpers.recompute``'s ``recomputed_core``
module, so its tensors land on their block.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["layer_of", "saved_by_layer", "draw_saved"]

_MODE_COLORS = {"none": "#7f7f7f", "selective": "#1f77b4", "full": "#d62728",
                "segments": "#9467bd"}


def layer_of(module: str) -> str:
    """'blocks.3.attn.c_attn' -> 'blocks.3'; anything outside the blocks -> 'ends'
    (embeddings, final LayerNorm, head and loss)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 1 else "ends"


def saved_by_layer(counter) -> dict[str, dict[str, int]]:
    """{layer: {"kept": bytes the forward saved for backward, "recomputed": bytes saved
    again while backward ran}} from a ``SavedTensorCounter``, in forward order ("ends"
    first). Both count each storage once (views of one tensor share it) and leave
    parameters out. "kept": the forward's records. "recomputed": the storages that came
    alive after the forward, from the counter's log (``(module, +bytes)`` each time a
    storage becomes alive, in time order; the forward's come first, one per record that
    added bytes), so only a backward's re-run adds to it."""
    out: dict[str, dict[str, int]] = {"ends": {"kept": 0, "recomputed": 0}}
    forward_new = 0
    for rec in counter.records:
        if rec.is_param or rec.in_backward:
            continue
        out.setdefault(layer_of(rec.module), {"kept": 0, "recomputed": 0})["kept"] += rec.nbytes
        forward_new += rec.nbytes > 0
    came_alive = [(owner, nbytes) for owner, nbytes in counter.log if nbytes > 0]
    for owner, nbytes in came_alive[forward_new:]:
        row = out.setdefault(layer_of(str(owner)), {"kept": 0, "recomputed": 0})
        row["recomputed"] += nbytes
    return out


def draw_saved(counters: dict[str, Any], *, title: str | None = None, unit: float = 2 ** 20,
               unit_name: str = "MiB"):
    """Bars per layer and mode (see the module docstring); returns ``(fig, data)`` with
    ``data = {mode: saved_by_layer(counter)}``."""
    import matplotlib.pyplot as plt

    data = {mode: saved_by_layer(c) for mode, c in counters.items()}
    layers = list(next(iter(data.values())))
    for rows in data.values():
        layers += [name for name in rows if name not in layers]
    modes = list(data)
    fig, ax = plt.subplots(figsize=(9.5, 0.5 + 0.32 * len(layers) * len(modes)))
    height = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        colour = _MODE_COLORS.get(mode, "#333333")
        ys = [len(layers) - 1 - li + (len(modes) - 1 - i) * height - 0.4 + height / 2
              for li in range(len(layers))]
        kept = [data[mode].get(name, {}).get("kept", 0) / unit for name in layers]
        again = [data[mode].get(name, {}).get("recomputed", 0) / unit for name in layers]
        ax.barh(ys, kept, height=height * 0.9, color=colour, label=f"{mode}: kept by the forward")
        ax.barh(ys, again, left=kept, height=height * 0.9, color="white", edgecolor=colour,
                hatch="////", label=f"{mode}: re-saved by the recompute in backward")
    ax.set_yticks(range(len(layers)), list(reversed(layers)))
    ax.set_xlabel(unit_name)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # off the bars
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, data
