"""Gradient accumulation under data parallelism: k micro-batches, one all-reduce.

Chapter 05 accumulates k micro-batches into ``.grad`` before each optimizer step. Under
DDP every backward would all-reduce its bucket(s), k times per step, although only the
sum is needed: all-reduce is linear, so averaging the sum once equals summing k
averages. ``no_sync()`` keeps the first k-1 backwards local; the last one, run outside
it, all-reduces what has piled up. The picture puts both ways side by side as the
sequence of what one rank did: a box per micro-batch (hatched: its forward and backward
ran inside ``no_sync()``, local only), a box per bucket all-reduce, a bar per optimizer
step, accumulation window after window.

The record is made by the run (``record_accumulation``): the loss function notes each
micro-batch and whether the wrapper will reduce after it (``require_backward_grad_sync``,
read at forward time, which is when DDP and ``helpers.ddp`` decide), the comm hook notes
each all-reduce it is handed, the loop notes each step. Change k, the number of windows
or the bucket size and the boxes follow.

    events = {v: launch(record_accumulation, 2, k=4, use_no_sync=v)[0] for v in (True, False)}
    fig, data = draw_accumulation(events)
"""

from __future__ import annotations

__all__ = ["record_accumulation", "accumulation_counts", "draw_accumulation"]


def record_accumulation(k: int = 4, windows: int = 2, use_no_sync: bool = True,
                        rows: int = 2, size: str = "toy", bucket_cap_mb: float = 25) -> list:
    """Rank function: ``windows`` optimizer steps of ``k`` micro-batches of ``rows``
    sequences through ``helpers.ddp.BucketedDDP``; with ``use_no_sync`` through
    ``helpers.batch.accumulate_gradients`` (no_sync for all but the last), else every
    backward synchronized. Returns the events in order: ``("micro", window, i, reduces)``,
    ``("all-reduce", window, elements)``, ``("step", window)``."""
    import torch

    from helpers.batch import accumulate_gradients
    from helpers.data import make_dataset
    from helpers.ddp import BucketedDDP, allreduce_hook
    from helpers.launch import rank_info
    from helpers.model import build_model

    r = rank_info().rank
    events: list = []
    window = 0

    def hook(flat, group):
        events.append(("all-reduce", window, flat.numel()))
        return allreduce_hook(flat, group)

    ddp = BucketedDDP(build_model(size, seed=0), bucket_cap_mb=bucket_cap_mb,
                      first_bucket_mb=bucket_cap_mb, comm_hook=hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = make_dataset(seq_len=16, num_sequences=64)
    per_rank = k * rows
    for window in range(windows):
        first = (window * rank_info().world_size + r) * per_rank
        x, y = data.batch(range(first, first + per_rank))
        micro = [(x[rows * i:rows * (i + 1)], y[rows * i:rows * (i + 1)]) for i in range(k)]
        count = iter(range(k))

        def loss_fn(model, batch, window=window):
            # read at forward time: the wrapper decides here whether this backward reduces
            events.append(("micro", window, next(count), bool(model.require_backward_grad_sync)))
            return model(*batch)[1]

        opt.zero_grad()
        if use_no_sync:
            accumulate_gradients(ddp, micro, loss_fn)
        else:
            for batch in micro:
                (loss_fn(ddp, batch) / k).backward()
        opt.step()
        events.append(("step", window))
    return events


def accumulation_counts(events: list) -> dict:
    """Per window: micro-batches, how many of them reduced, bucket all-reduces."""
    windows = sorted({e[1] for e in events})
    return {w: {"micro": sum(e[0] == "micro" and e[1] == w for e in events),
                "reducing": sum(e[0] == "micro" and e[1] == w and e[3] for e in events),
                "all-reduces": sum(e[0] == "all-reduce" and e[1] == w for e in events)}
            for w in windows}


def draw_accumulation(runs: dict, title: str | None = None):
    """One row per run (``{label: record_accumulation's events}``), the events left to
    right. Returns ``(fig, data)``: ``data[label]`` holds the events drawn and
    ``accumulation_counts`` of them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.75 * len(runs)))
    data = {}
    for row, (label, events) in enumerate(runs.items()):
        x = 0.0
        for e in events:
            if e[0] == "micro":
                ax.add_patch(plt.Rectangle((x, row), 0.9, 0.6, facecolor="#9ecae1",
                                           hatch="" if e[3] else "///", edgecolor="#3182bd"))
                ax.text(x + 0.45, row + 0.3, f"m{e[2]}", ha="center", va="center", fontsize=7)
                x += 1.0
            elif e[0] == "all-reduce":
                ax.add_patch(plt.Rectangle((x, row + 0.05), 0.55, 0.5, color="#fd8d3c"))
                x += 0.65
            elif e[0] == "step":
                ax.add_patch(plt.Rectangle((x, row - 0.1), 0.12, 0.8, color="#31a354"))
                x += 0.45
        ax.text(-0.3, row + 0.3, label, ha="right", va="center", fontsize=8)
        data[label] = {"events": [tuple(e) for e in events],
                       "counts": accumulation_counts(events)}
    ax.set_xlim(-0.2, x + 0.2 if runs else 1)
    ax.set_ylim(len(runs) - 0.1, -0.3)
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor="#9ecae1", hatch="///", edgecolor="#3182bd",
                             label="micro-batch inside no_sync (local)"),
                       Patch(facecolor="#9ecae1", edgecolor="#3182bd",
                             label="micro-batch that reduces"),
                       Patch(color="#fd8d3c", label="bucket all-reduce"),
                       Patch(color="#31a354", label="optimizer step")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, data
