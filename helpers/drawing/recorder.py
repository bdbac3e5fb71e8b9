"""The collective recorder as a picture: each rank's calls side by side, the first
disagreement marked.

Every rank of a group must issue the same collectives in the same order; the i-th call
of one rank pairs with the i-th of the others. ``helpers.debug.record_collectives``
records each rank's calls (op, shapes, dtypes, where, how each ended), and
``helpers.debug.first_disagreement`` finds the first place the lists part (a call that
differs from the others', or a call a rank never made). ``launch(..., record=True)``
hands both back on a failure (``err.records``).

``draw_call_lists(records)`` draws one column per rank, one row per call number, each
cell the call as the recorder describes it (``all_reduce [8] float32``) and how it ended;
the first disagreement is marked: the odd rank's call (or the empty cell where a rank
made no call) in red, the calls the other ranks made there in amber. Read it across a
row: the row where the colours appear is "which collective", the red column is "which
rank"; what that rank did differently is its state (chapter 18's method).
"""

from __future__ import annotations

from helpers.drawing import FRAME_TEXT_PT, step_frames

__all__ = ["call_lists", "draw_call_lists", "draw_call_lists_frame", "show_call_lists"]

_RED, _AMBER, _GREY = "#d62728", "#ffbf46", "#eeeeee"


def call_lists(records: dict) -> dict:
    """The picture's data from a recorder's ``{rank: [CallRecord]}``: ``ranks`` {rank:
    [description]}, ``states`` {rank: [how each call ended]}, ``finding`` (None, or
    {"kind", "ranks": the odd ones out, "marked": {rank: call number or None}})."""
    from helpers.debug import first_disagreement

    ranks = {r: [c.describe() for c in calls] for r, calls in sorted(records.items())}
    states = {r: [c.state for c in calls] for r, calls in sorted(records.items())}
    found = first_disagreement(records)
    finding = None
    if found is not None:
        seqs = [c.seq for c in found.calls.values() if c is not None]
        # a call a rank never made: the row after its last one (where the others are)
        row = min(seqs) if seqs else min(len(records[r]) for r in found.ranks)
        finding = {"kind": found.kind, "ranks": list(found.ranks), "text": found.text,
                   "marked": {r: (None if c is None else c.seq) for r, c in found.calls.items()},
                   "row": row}
    return {"ranks": ranks, "states": states, "finding": finding}


def _lines(text: str, width_pt: float) -> list[str]:
    """``text`` as the fewest lines, split at spaces, each at most ``width_pt`` wide at
    ``FRAME_TEXT_PT`` (a word wider than that stays whole on its line)."""
    from matplotlib.textpath import TextPath

    def fits(s):
        return TextPath((0, 0), s, size=FRAME_TEXT_PT).get_extents().width <= width_pt

    lines: list[str] = []
    for word in text.split(" "):
        if lines and fits(f"{lines[-1]} {word}"):
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def draw_call_lists_frame(ax, data: dict, title: str = "") -> None:
    """One recorded run (``call_lists``' data) on ``ax``: each call's text wrapped to its
    cell at ``FRAME_TEXT_PT``, so that nothing runs over into the next rank's column."""
    from matplotlib.patches import Rectangle

    ranks = list(data["ranks"])
    rows = max((len(v) for v in data["ranks"].values()), default=0)
    finding = data["finding"] or {"ranks": [], "marked": {}, "row": None}
    odd, row = set(finding["ranks"]), finding["row"]
    rows = max(rows, (row or 0) + 1)
    ax.set_xlim(-0.05, len(ranks))
    ax.set_ylim(-0.1, rows)
    # a cell's width in points, less a margin: the axes' width over the x range
    box = ax.get_window_extent()
    cell_pt = 0.85 * box.width * 72 / ax.figure.dpi / (len(ranks) + 0.05)
    for j, r in enumerate(ranks):
        calls, states = data["ranks"][r], data["states"][r]
        for i in range(rows):
            y = rows - 1 - i
            if i < len(calls):
                color = _GREY
                if i == row:
                    color = _RED if r in odd else _AMBER
                ax.add_patch(Rectangle((j, y), 0.95, 0.9, facecolor=color, edgecolor="white"))
                op, _, rest = calls[i].partition(" ")
                text = "\n".join(_lines(f"#{i} {op}", cell_pt) + _lines(rest, cell_pt))
                ax.text(j + 0.47, y + 0.6, text, ha="center", va="center",
                        fontsize=FRAME_TEXT_PT, linespacing=1.1)
                ax.text(j + 0.47, y + 0.05, "\n".join(_lines(states[i], cell_pt)), ha="center",
                        va="bottom", fontsize=FRAME_TEXT_PT, style="italic", linespacing=1.1)
            elif i == row and r in odd:   # the call this rank never made
                ax.add_patch(Rectangle((j, y), 0.95, 0.9, facecolor="none", edgecolor=_RED,
                                       linestyle="--", lw=1.2))
                ax.text(j + 0.47, y + 0.45, "\n".join(_lines("never called", cell_pt)),
                        ha="center", va="center", fontsize=FRAME_TEXT_PT, color=_RED)
    ax.set_xticks([j + 0.47 for j in range(len(ranks))], [f"rank {r}" for r in ranks],
                  fontsize=FRAME_TEXT_PT)
    ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=FRAME_TEXT_PT)


# two runs a row: a cell then holds "#12 all_reduce" and "[1024] float32" on a line each at
# FRAME_TEXT_PT (at three a row its column is narrower than "all_reduce")
_PER_ROW = 2
_FRAME = (4.5, 0.8)     # inches: width, and height besides the rows
_ROW_INCHES = 1.5       # a call's cell: up to six lines of text


def draw_call_lists(runs: dict[str, dict], *, per_row: int | None = _PER_ROW):
    """Every recorded run of ``runs`` ({title: ``{rank: [CallRecord]}``}) side by side;
    returns (fig, data), ``data`` = {title: ``call_lists(records)``}."""
    from helpers.drawing import draw_strip

    data = {title: call_lists(records) for title, records in runs.items()}
    titles = list(data)
    fig = draw_strip(lambda ax, i: draw_call_lists_frame(ax, data[titles[i]], titles[i]),
                     len(titles), frame_size=(_FRAME[0], _FRAME[1] + _ROW_INCHES * _rows(data)),
                     per_row=per_row)
    return fig, data


def show_call_lists(runs: dict[str, dict], *, per_row: int | None = _PER_ROW) -> dict:
    """``draw_call_lists`` as a slider over the runs (the strip as its stored picture);
    returns the same data."""
    data = {title: call_lists(records) for title, records in runs.items()}
    titles = list(data)
    step_frames(lambda ax, i: draw_call_lists_frame(ax, data[titles[i]], titles[i]),
                len(titles), label="bug",
                frame_size=(_FRAME[0], _FRAME[1] + _ROW_INCHES * _rows(data)),
                per_row=per_row)
    return data


def _rows(data: dict) -> int:
    return max([len(v) for d in data.values() for v in d["ranks"].values()] + [1])
