"""Where a step's activation bytes go: saved layer by layer in forward, freed top-down in backward.

Chapter 06 counts the tensors autograd keeps for backward with a saved-tensor hook
(``helpers.memory.SavedTensorCounter``). The counter also logs every storage as it
becomes alive and as it dies (``counter.log``: ``(module, +bytes)`` when a module's
forward saves a new storage, ``(module, -bytes)`` when backward has used it and
autograd lets it go). The picture stacks those bytes over the step, one band per part
of the model: the embedding, each transformer block, the head and the loss. Forward
adds the bands from the bottom up, layer after layer; backward runs from the loss
down and frees them top first, each block's bytes as soon as that block's backward
has run. The height at the dashed line is what the forward leaves for backward
(``counter.total_bytes``), the largest height the peak (``counter.peak_bytes``): the
shape ``memory_over_step`` assumes for the activations, here measured.

    record = record_saved_over_step(model, x, y)      # forward + backward under the counter
    fig, data = draw_saved_over_step(record)
"""

from __future__ import annotations

__all__ = ["part_of", "record_saved_over_step", "saved_over_step", "draw_saved_over_step"]


def part_of(module: str) -> str:
    """The band a module's saved bytes belong to: ``blocks.i``, the embedding, or the
    head and loss (the final LayerNorm, the LM head, the cross-entropy at the top)."""
    if module.startswith("blocks."):
        return ".".join(module.split(".")[:2])
    if module.split(".")[0] in ("wte", "wpe", "drop"):
        return "embedding"
    return "head and loss"


def record_saved_over_step(model, x, y) -> dict:
    """Forward and backward of ``model(x, y)`` under a ``SavedTensorCounter``; plain
    values: the counter's ``log`` (owner names as strings), the number of log entries
    the forward made, ``total_bytes`` and ``peak_bytes``."""
    from helpers.memory import SavedTensorCounter

    with SavedTensorCounter(model) as counter:
        _, loss = model(x, y)
        forward_events = len(counter.log)
        loss.backward()
    return {"log": [(str(owner), int(delta)) for owner, delta in counter.log],
            "forward_events": forward_events, "total_bytes": counter.total_bytes,
            "peak_bytes": counter.peak_bytes}


def saved_over_step(record: dict) -> dict:
    """The bands the picture stacks: ``parts`` in forward order, and ``live[k][j]``, the
    bytes of part j alive after log entry k (entry 0: before anything is saved)."""
    log = record["log"]
    parts = list(dict.fromkeys(part_of(owner) for owner, delta in log if delta > 0))
    where = {p: j for j, p in enumerate(parts)}
    live = [[0] * len(parts)]
    for owner, delta in log:
        row = list(live[-1])
        row[where[part_of(owner)]] += delta
        live.append(row)
    return {"parts": parts, "live": live, "forward_events": record["forward_events"],
            "total_bytes": record["total_bytes"], "peak_bytes": record["peak_bytes"]}


def draw_saved_over_step(record: dict, title: str | None = None):
    """The picture of the module docstring. Returns ``(fig, data)``, ``data`` being
    ``saved_over_step(record)``."""
    import matplotlib.pyplot as plt

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT

    data = saved_over_step(record)
    parts, live = data["parts"], data["live"]
    xs = list(range(len(live)))
    cmap = plt.get_cmap("viridis")
    colors = [cmap(0.15 + 0.7 * j / max(1, len(parts) - 1)) for j in range(len(parts))]
    fig, ax = plt.subplots(figsize=(COLUMN_INCHES, 4.2), layout="constrained")
    ax.stackplot(xs, *[[row[j] / 1e3 for row in live] for j in range(len(parts))],
                 labels=parts, colors=colors, step="post")
    ax.axvline(data["forward_events"], color="k", ls="--", lw=1)
    # just above the axes (the stack peaks right under it); the title is lifted clear of it
    ax.text(data["forward_events"], 1.01, "end of forward", transform=ax.get_xaxis_transform(),
            ha="center", va="bottom", fontsize=FRAME_TEXT_PT)
    ax.set_xlabel("storages saved (forward) and freed (backward), in the order it happened",
                  fontsize=FRAME_TEXT_PT)
    ax.set_ylabel("KB kept for backward")
    ax.set_xlim(0, len(live) - 1)
    fig.legend(loc="outside lower center", ncol=3, fontsize=FRAME_TEXT_PT)
    if title:
        ax.set_title(title, pad=4 + 2 * FRAME_TEXT_PT)
    return fig, data
