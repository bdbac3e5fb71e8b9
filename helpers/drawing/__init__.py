"""Pictures of the mechanisms, drawn from what the run recorded.

Most of the course's figures are measurements: timings, memory, loss curves. The
pictures of this package show the mechanism itself: which chunk each rank sends at
each step of a ring, which shard of a weight each rank holds, which token goes to
which expert. Each is drawn from a record the run produced (the sends the checks'
spy saw, a schedule's executed actions, the ownership map of a sharded state, the
router's assignments), never from coordinates typed in by hand, so a picture is true
by construction and changes when the learner changes the world size or the layout.
Two kinds of picture are not drawn here: chapter 12's schedules are Gantt charts of
measured timelines (``helpers.pipeline.gantt``), and ``layout.draw_rank_grid`` (chapters
19 and 20) draws a plan, the placement the cost model priced, not a run.

Conventions, for every picture module here (one module per mechanism):

* ``draw_<thing>(record, ...)`` draws one picture and returns ``(fig, data)``:
  ``data`` holds the plain values it drew (ints, strings, lists, dicts), so that a
  test compares them with the run's record instead of pixels;
* ``rank_color(r)``: rank r's colour, the same rank the same colour in every chapter;
* a mechanism that runs in steps is drawn frame by frame: ``step_frames(draw_frame,
  steps)`` gives a slider over the steps in JupyterLab and, as the picture stored with
  the widget (what the static site and a notebook not run yet show), all the frames
  in a strip of rows of at most three, no wider than the site's text column
  (``COLUMN_INCHES``), so that it is shown at its natural size; text inside a frame
  is at least ``FRAME_TEXT_PT``.

matplotlib is imported inside the functions: ranks import helpers but never draw.
"""

from __future__ import annotations

from typing import Any, Callable

from helpers.plots import COLUMN_INCHES, FRAME_TEXT_PT

# Rank colours: matplotlib's tab10 order, so that rank r has one colour in every
# picture of every chapter (rank 0 blue, 1 orange, 2 green, 3 red, ...).
RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
               "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def rank_color(rank: int) -> str:
    """Rank ``rank``'s colour (the palette repeats after 10 ranks)."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


# COLUMN_INCHES (the site's text column) and FRAME_TEXT_PT (the smallest text in a
# frame) live in helpers.plots, with the style they follow from.
MAX_PER_ROW = 3            # three frames of ~2.8 in: each still holds labels at FRAME_TEXT_PT


def strip_layout(steps: int, per_row: int | None = None) -> tuple[int, int]:
    """(rows, columns) of a strip of ``steps`` frames: at most ``per_row`` (default and
    most ``MAX_PER_ROW``) a row, the rows as even as they can be (4 frames: 2 x 2)."""
    if steps < 1:
        raise ValueError(f"a strip needs at least one frame, got {steps}")
    most = MAX_PER_ROW if per_row is None else per_row
    if not 1 <= most <= MAX_PER_ROW:
        raise ValueError(f"per_row={per_row}: a row of the site's column holds 1 to "
                         f"{MAX_PER_ROW} frames at a readable size")
    rows = -(-steps // most)
    return rows, -(-steps // rows)


def strip_frame_size(cols: int, frame_size: tuple[float, float]) -> tuple[float, float]:
    """One frame's size in a row of ``cols``: ``frame_size``, narrowed (keeping its
    shape) so that the row fits ``COLUMN_INCHES``."""
    w, h = frame_size
    scale = min(1.0, COLUMN_INCHES / (w * cols))
    return w * scale, h * scale


def draw_strip(draw_frame: Callable[[Any, int], None], steps: int, *,
               frame_size: tuple[float, float] = (3.0, 2.6), per_row: int | None = None,
               title: str | None = None):
    """Every frame, ``draw_frame(ax, step)`` for step 0 .. steps-1, in rows of at most
    three, no wider than the site's column (``strip_frame_size``); returns the figure."""
    import matplotlib.pyplot as plt

    rows, cols = strip_layout(steps, per_row)
    w, h = strip_frame_size(cols, frame_size)
    fig, axes = plt.subplots(rows, cols, figsize=(w * cols, h * rows), squeeze=False)
    for step, ax in enumerate(axes.flat):
        if step < steps:
            draw_frame(ax, step)
        else:
            ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def step_frames(draw_frame: Callable[[Any, int], None], steps: int, *, label: str = "step",
                frame_size: tuple[float, float] = (4.5, 3.5), per_row: int | None = None,
                title: str | None = None) -> None:
    """Show a stepped mechanism: in JupyterLab a slider over ``steps`` frames, each drawn
    by ``draw_frame(ax, step)``; stored with it, as the static picture, the strip of all
    the frames (``draw_strip``), which is what the site shows."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    from helpers.plots import EVERY_STEP, show_widget

    def one(**kw):
        fig, ax = plt.subplots(figsize=frame_size)
        draw_frame(ax, kw[label])
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        plt.show()

    def strip():
        draw_strip(draw_frame, steps, frame_size=frame_size, per_row=per_row, title=title)
        plt.show()

    slider = widgets.IntSlider(value=0, min=0, max=steps - 1, description=label,
                               style={"description_width": "initial"})
    show_widget(widgets.interactive(one, **{label: slider}), strip, picture=EVERY_STEP)


__all__ = ["RANK_COLORS", "COLUMN_INCHES", "MAX_PER_ROW", "FRAME_TEXT_PT", "rank_color",
           "strip_layout", "strip_frame_size", "draw_strip", "step_frames"]
