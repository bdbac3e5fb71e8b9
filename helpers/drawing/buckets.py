"""DDP's buckets as backward fills them: which gradient arrives when, which all-reduce starts.

Chapter 04's wrapper (``helpers.ddp.BucketedDDP``) puts a hook on every parameter. A
hook fires when that parameter's gradient is final; the wrapper counts it in the
parameter's bucket, and when a bucket's count reaches zero its all-reduce is started,
but only after every earlier bucket's, so that all ranks issue their collectives in
one order. The picture is that sequence: one box per gradient, left to right in the
order backward produced them, coloured by bucket, and an arrow where each bucket's
all-reduce was launched. A bucket whose gradients are all in but whose turn has not
come yet waits; its arrow then stands further right, next to the earlier bucket's.

The record is ``BucketedDDP.sequence``: the hooks and launches of the last backward
as they happened (no clock, so the picture is the same on any machine for the same
model and bucket sizes). ``bucket_record`` packs it with the names and buckets on the
rank, as plain values:

    def fn():
        ddp = BucketedDDP(build_model("toy"), bucket_cap_mb=0.01, first_bucket_mb=0.002)
        ddp(x, y)[1].backward()
        return bucket_record(ddp)
    fig, data = draw_bucket_launches(launch(fn, 2)[0])
"""

from __future__ import annotations

__all__ = ["bucket_record", "bucket_events", "draw_bucket_launches", "bucket_color", "short_name"]

# bucket colours: not the rank colours (a bucket is not a rank), one per bucket
_BUCKET_COLORS = ("#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69",
                  "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f")


def bucket_color(b: int) -> str:
    return _BUCKET_COLORS[b % len(_BUCKET_COLORS)]


def bucket_record(ddp) -> dict:
    """Plain values of a ``BucketedDDP`` after a backward: parameter names and bytes
    (registration order), the buckets as parameter indices, and ``ddp.sequence``."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    index = {id(p): i for i, p in enumerate(ddp.params)}
    return {"params": [names.get(id(p), f"param {i}") for i, p in enumerate(ddp.params)],
            "bytes": [p.numel() * p.element_size() for p in ddp.params],
            "buckets": [[index[id(p)] for p in bucket] for bucket in ddp.buckets],
            "sequence": [tuple(e) for e in ddp.sequence]}


def bucket_events(record: dict) -> dict:
    """What the picture draws, from ``bucket_record``'s values: ``arrivals``, one
    ``(parameter name, bucket)`` per gradient in arrival order; ``launches``, one
    ``(bucket, gradients arrived before it)`` per all-reduce in launch order; and
    ``waited``, the buckets complete before their launch (their turn had not come)."""
    bucket_of = {i: b for b, idx in enumerate(record["buckets"]) for i in idx}
    arrivals, launches, complete_at = [], [], {}
    missing = [len(idx) for idx in record["buckets"]]
    for kind, i in record["sequence"]:
        if kind in ("grad", "unused"):
            b = bucket_of[i]
            arrivals.append((record["params"][i], b))
            missing[b] -= 1
            if missing[b] == 0:
                complete_at[b] = len(arrivals)
        elif kind == "launch":
            launches.append((i, len(arrivals)))
        else:
            raise ValueError(f"unknown event {kind!r} in the sequence")
    waited = [b for b, at in launches if complete_at.get(b, at) < at]
    return {"arrivals": arrivals, "launches": launches, "waited": waited}


def short_name(name: str) -> str:
    """A parameter's name as the picture prints it: ``blocks.1.mlp.c_fc.weight`` ->
    ``1.mlp.c_fc.w`` (short enough to stand in its box at ``FRAME_TEXT_PT``)."""
    name = name.removeprefix("blocks.")
    for long, short in ((".weight", ".w"), (".bias", ".b")):
        if name.endswith(long):
            return name[: -len(long)] + short
    return name


def draw_bucket_launches(record: dict, title: str | None = None, ax=None):
    """The picture of the module docstring. Returns ``(fig, data)``, ``data`` being
    ``bucket_events(record)``. No wider than the site's column, so that the gradients'
    names are shown at ``FRAME_TEXT_PT``."""
    import matplotlib.pyplot as plt

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT

    data = bucket_events(record)
    arrivals, launches = data["arrivals"], data["launches"]
    n = len(arrivals)
    if ax is None:
        # 0.28 in a box holds a rotated 10-pt name; more boxes than the column holds at
        # that width get narrower ones (the names then overlap: a model that large
        # is better drawn with fewer, larger parameters)
        _, ax = plt.subplots(figsize=(min(COLUMN_INCHES, max(5.0, 1.0 + 0.28 * n)), 4.2))
    for k, (name, b) in enumerate(arrivals):
        ax.add_patch(plt.Rectangle((k, 0), 0.92, 1, color=bucket_color(b)))
        ax.text(k + 0.46, 0.5, short_name(name), rotation=90, ha="center", va="center",
                fontsize=FRAME_TEXT_PT)
    for order, (b, after) in enumerate(launches):
        height = 1.25 + 0.3 * (order % 3)  # stagger labels of launches at one place
        ax.annotate(f"bucket {b}", xy=(after - 0.04, 1.0), xytext=(after - 0.04, height),
                    ha="center", fontsize=FRAME_TEXT_PT, color="black",
                    arrowprops=dict(arrowstyle="-|>", color="black", lw=1),
                    bbox=dict(boxstyle="round,pad=0.2", fc=bucket_color(b), ec="none"))
    ax.set_xlim(-0.3, n + 0.5)
    ax.set_ylim(-0.15, 2.2)
    ax.set_yticks([])
    ax.set_xticks([])
    ax.grid(False)
    ax.set_xlabel("gradients in the order backward produced them (colour: bucket;\n"
                  "blocks.i. shortened to i., .w weight, .b bias); "
                  "arrow: that bucket's all-reduce starts", fontsize=FRAME_TEXT_PT)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure, data
