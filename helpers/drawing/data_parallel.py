"""Data parallelism in one picture: who computes which rows, and what the all-reduce returns.

Chapter 02's claim has two halves. Each of p ranks computes the gradient of its own
slice of the global batch (rank r: rows r*b .. r*b + b - 1, with b = B / p), so the
ranks hold p *different* gradients; one all-reduce (a sum, then a division by p) then
hands every rank the *same* vector, the mean of the p, which is the gradient of the
whole batch. The picture has three columns: the global batch, each row coloured by
the rank that computed on it; each rank's own gradient (a few of its coordinates, as
a strip of colours); and what each rank holds after ``average_gradients``, next to
the gradient one process computes on the whole batch.

Everything comes from the run: ``record_dp_step`` is a rank function that records
the rows it used, its gradient before and after the all-reduce; the reference strip
is one process's backward on the same rows. With another world size or batch the
rows regroup and the strips change.

    record = launch(record_dp_step, 4, global_batch=8)
    fig, data = draw_dp_step(record, reference=global_batch_gradient(8))
"""

from __future__ import annotations

__all__ = ["COORDS", "SHOWN", "record_dp_step", "global_batch_gradient", "draw_dp_step"]

COORDS = 12  # gradient coordinates shown: enough to see the pattern, few enough to read
# whose coordinates: a weight every row of every slice reaches (an embedding's gradient
# is zero in the rows of tokens a slice does not contain)
SHOWN = "blocks.0.mlp.c_fc.weight"


def _first_coords(model, k: int) -> list[float]:
    params = dict(model.named_parameters())
    p = params.get(SHOWN, next(iter(params.values())))
    return p.grad.reshape(-1)[:k].tolist()


def _batch(global_batch: int, size: str):
    from helpers.data import make_dataset

    data = make_dataset(seq_len=16, num_sequences=max(64, global_batch))
    return data.batch(range(global_batch))


def record_dp_step(global_batch: int = 8, size: str = "toy", coords: int = COORDS) -> dict:
    """Rank function: one naive data-parallel backward (``helpers.naive_dp``) on this
    rank's slice of a global batch. Returns ``{"rows": global row indices used,
    "local": the first ``coords`` coordinates of ``SHOWN``'s gradient before the
    all-reduce,
    "averaged": the same coordinates after it}``."""
    from helpers.launch import rank_info
    from helpers.model import build_model
    from helpers.naive_dp import average_gradients

    r, p = rank_info().rank, rank_info().world_size
    if global_batch % p:
        raise ValueError(f"a global batch of {global_batch} does not split over {p} ranks")
    b = global_batch // p
    x, y = _batch(global_batch, size)
    model = build_model(size, seed=0)
    model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1].backward()
    local = _first_coords(model, coords)
    average_gradients(model)
    return {"rows": list(range(r * b, (r + 1) * b)), "local": local,
            "averaged": _first_coords(model, coords)}


def global_batch_gradient(global_batch: int = 8, size: str = "toy",
                          coords: int = COORDS) -> list[float]:
    """One process, the whole batch: the same coordinates of its gradient."""
    from helpers.model import build_model

    x, y = _batch(global_batch, size)
    model = build_model(size, seed=0)
    model(x, y)[1].backward()
    return _first_coords(model, coords)


def draw_dp_step(record: list[dict], reference: list[float] | None = None):
    """The picture described in the module docstring. ``record``: ``record_dp_step``'s
    result on every rank (``launch``'s list); ``reference``: ``global_batch_gradient``.
    Returns ``(fig, data)``; ``data`` holds the rows per rank, the strips drawn and the
    largest difference between a rank's averaged strip and the reference."""
    import matplotlib.pyplot as plt
    import numpy as np

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT, rank_color

    world = len(record)
    rows = {r: list(rec["rows"]) for r, rec in enumerate(record)}
    owner = {i: r for r, idx in rows.items() for i in idx}
    batch = len(owner)
    local = [list(rec["local"]) for rec in record]
    averaged = [list(rec["averaged"]) for rec in record]
    strips = local + averaged + ([list(reference)] if reference is not None else [])
    scale = max(abs(v) for s in strips for v in s) or 1.0

    fig, (ax_b, ax_l, ax_a) = plt.subplots(
        1, 3, figsize=(COLUMN_INCHES, 0.45 * max(batch, 2 * world + 2) + 2.0),
        gridspec_kw={"width_ratios": [1.3, 3, 3]}, layout="constrained")
    for i in range(batch):  # the global batch, one row per sequence
        ax_b.add_patch(plt.Rectangle((0, i), 1, 0.9, color=rank_color(owner[i]), alpha=0.8))
        ax_b.text(0.5, i + 0.45, f"row {i}: rank {owner[i]}", ha="center", va="center",
                  fontsize=FRAME_TEXT_PT)
    ax_b.set_xlim(0, 1)
    ax_b.set_ylim(batch, 0)
    ax_b.set_title("global batch", fontsize=FRAME_TEXT_PT + 1)
    ax_b.axis("off")

    def strip(ax, y, values, label, color):
        image = ax.imshow(np.array([values]) / scale, cmap="RdBu_r", vmin=-1, vmax=1,
                          aspect="auto", extent=(0, len(values), y + 0.85, y + 0.1))
        ax.text(-0.3, y + 0.48, label, ha="right", va="center", fontsize=FRAME_TEXT_PT,
                color=color)
        return image

    for r in range(world):
        image = strip(ax_l, r, local[r], f"rank {r}", rank_color(r))
        strip(ax_a, r, averaged[r], f"rank {r}", rank_color(r))
    if reference is not None:
        strip(ax_a, world + 0.4, reference, "one process,\nwhole batch", "black")
    for ax, title in ((ax_l, f"each rank's own gradient\n({SHOWN}, first {len(local[0])})"),
                      (ax_a, "after the all-reduce (sum / p)")):
        ax.set_xlim(0, len(local[0]))
        ax.set_ylim(world + 1.4, 0)
        ax.set_title(title, fontsize=FRAME_TEXT_PT + 1)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        for side in ax.spines.values():
            side.set_visible(False)
    # one scale for every strip: red positive, blue negative, white zero
    bar = fig.colorbar(image, ax=(ax_l, ax_a), orientation="horizontal", shrink=0.6,
                       aspect=40)
    bar.set_label(f"gradient element / {scale:.2g} (the largest |element| drawn)",
                  fontsize=FRAME_TEXT_PT)
    bar.ax.tick_params(labelsize=FRAME_TEXT_PT)
    worst = (max(abs(a - b) for s in averaged for a, b in zip(s, reference))
             if reference is not None else None)
    data = {"world": world, "rows": rows, "local": local, "averaged": averaged,
            "reference": list(reference) if reference is not None else None,
            "largest_difference": worst}
    return fig, data
