"""A sharded checkpoint as a picture: which rank wrote which piece, and who reads it back.

``helpers.checkpoint.save`` writes one file per rank and a manifest that says, for every
sharded tensor, which file holds which flat range ``[offset, offset + numel)`` (the
``Shard``s each rank saved). A job with another world size asks for other ranges: a
rank's new shard usually starts in one old file and ends in another, and the loader
copies each overlap from the file that holds it (``load_latest``; it records what it
copied in ``Loaded.reads``, and ``resumable_run`` returns it as ``"reads"``).

``draw_reshard(manifest, reads)`` lays the sharded tensors whose key starts with a
prefix (ZeRO's weights, say) end to end in the manifest's order and draws two things
over that one index line: on top, the pieces as saved, each in the colour of the rank
whose file holds it; below, one row per rank of the new job, each range it read in the
colour of the file it read it from. A new rank whose row shows two colours read across
two old ranks' files; that is resharding. DCP (``torch.distributed.checkpoint``) does
the same with its ``.metadata`` instead of the manifest (chapter 17).
"""

from __future__ import annotations

import re

from helpers.drawing import rank_color

__all__ = ["file_rank", "reshard_layout", "draw_reshard"]


def file_rank(name: str) -> int:
    """The rank that wrote ``rank<r>.pt``."""
    m = re.fullmatch(r"rank(\d+)\.pt", name)
    if m is None:
        raise ValueError(f"not a rank file: {name!r}")
    return int(m.group(1))


def reshard_layout(manifest: dict, reads: list[dict], prefix: str) -> dict:
    """The picture's data: the keys under ``prefix`` (manifest order) laid end to end,
    ``offsets`` where each starts on that line, ``saved`` [(file, lo, hi)] from the
    manifest's pieces and ``read`` [[(file, lo, hi)] for each new rank] from ``reads``,
    all on the line; ``bytes`` of each saved file."""
    keys = [k for k in manifest["shards"] if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"no sharded tensor in the manifest starts with {prefix!r}")
    offsets, at = {}, 0
    for k in keys:
        offsets[k] = at
        size = 1
        for d in manifest["shards"][k]["global_shape"]:
            size *= d
        at += size
    saved = sorted((p["file"], offsets[k] + p["offset"], offsets[k] + p["offset"] + p["numel"])
                   for k in keys for p in manifest["shards"][k]["pieces"] if p["numel"])
    read = [sorted((f, offsets[k] + lo, offsets[k] + hi)
                   for k in keys for f, lo, hi in r.get(k, []) if hi > lo) for r in reads]
    return {"prefix": prefix, "keys": keys, "offsets": offsets, "total": at,
            "saved": saved, "read": read,
            "bytes": {f: m["bytes"] for f, m in manifest["files"].items()},
            "saved_by": manifest["world_size"]}


def draw_reshard(manifest: dict, reads: list[dict], prefix: str, *, title: str | None = None):
    """Draw the saved pieces and each new rank's reads (see the module docstring);
    returns (fig, data), ``data`` = ``reshard_layout(manifest, reads, prefix)``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    data = reshard_layout(manifest, reads, prefix)
    rows = 1 + len(reads)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.55 * rows))
    y0 = rows - 1
    for f, lo, hi in data["saved"]:
        ax.broken_barh([(lo, hi - lo)], (y0 - 0.35, 0.7), color=rank_color(file_rank(f)),
                       alpha=0.9, edgecolor="white", linewidth=0.3)
    for r, spans in enumerate(data["read"]):
        y = y0 - 1 - r
        for f, lo, hi in spans:
            ax.broken_barh([(lo, hi - lo)], (y - 0.35, 0.7), color=rank_color(file_rank(f)),
                           alpha=0.9, edgecolor="white", linewidth=0.3)
    for k in data["keys"]:   # the tensors' boundaries, faint
        ax.axvline(data["offsets"][k], color="grey", lw=0.3, alpha=0.5)
    labels = [f"saved by {data['saved_by']} ranks"] + [f"new rank {r} reads" for r in
                                                       range(len(reads))]
    ax.set_yticks([y0 - i for i in range(rows)], labels, fontsize=8)
    ax.set_xlim(0, data["total"])
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_xlabel(f"elements of the {len(data['keys'])} tensors under {prefix}, end to end "
                  f"(faint lines: tensor boundaries)", fontsize=8)
    files = sorted(data["bytes"], key=file_rank)
    ax.legend(handles=[Patch(color=rank_color(file_rank(f)),
                             label=f"{f} ({data['bytes'][f] / 1024:.0f} KiB)") for f in files],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False,
              title="file (colour)", title_fontsize=7)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"{data['saved_by']} ranks saved, {len(reads)} ranks read back",
                 fontsize=9)
    fig.tight_layout()
    return fig, data
