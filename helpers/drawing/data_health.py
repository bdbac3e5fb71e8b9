"""The example ledger in one picture: how often each example of an epoch was used.

One row per planted case, one column per example id, coloured by the number of
uses the all-gathered ledgers counted (``helpers.data_health.audit``): white for
a gap (never used), the palette's light shade for once, darker for two uses and
more. A clean epoch is one even row; padding repeats are a few dark cells, a
replayed step a dark band, N ranks on one batch a few very dark cells in a white
row. Drawn from the audits the ranks returned, so another world size or another
mistake changes the picture.

    fig, data = draw_ledgers(audits, labels)
"""

from __future__ import annotations

__all__ = ["draw_ledgers"]


def draw_ledgers(audits: list, labels: list[str], title: str | None = None):
    """``audits``: ``LedgerAudit``s (one per row), ``labels``: a name per row.
    Returns (fig, {"counts": [[uses per id] per row], "labels": labels,
    "duplicates": [...], "gaps": [...]})."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    if len(audits) != len(labels):
        raise ValueError(f"{len(audits)} audits but {len(labels)} labels")
    width = max(a.num_samples for a in audits)
    grid = np.full((len(audits), width), np.nan)
    for i, a in enumerate(audits):
        grid[i, :a.num_samples] = a.counts
    top = int(np.nanmax(grid)) if np.isfinite(grid).any() else 1
    # 0 uses white (a gap), 1 use light, then darker for each extra use
    colors = ["#ffffff", "#c6dbef"] + list(plt.cm.Reds(np.linspace(0.45, 0.95, max(top - 1, 1))))
    cmap = ListedColormap(colors[:top + 1])
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N)
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(audits) + 1.4))
    im = ax.imshow(grid, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set_yticks(range(len(audits)), [f"{lab}  ({a.duplicates} dup, {a.gaps} gaps)"
                                      for lab, a in zip(labels, audits)])
    ax.set_xlabel("example id")
    ax.grid(False)  # the cells are the data; grid lines would cut them
    bar = fig.colorbar(im, ax=ax, ticks=range(top + 1), fraction=0.04, pad=0.02)
    bar.set_label("uses")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig, {"counts": [list(a.counts) for a in audits], "labels": list(labels),
                 "duplicates": [a.duplicates for a in audits], "gaps": [a.gaps for a in audits]}
