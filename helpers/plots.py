"""How the course's figures and controls look in a notebook.

Two things every chapter shares, kept in one place so that a chapter never
passes a font size or styles a widget by hand:

* ``STYLE``: matplotlib settings sized for a screen, not a paper. Titles 14 pt,
  labels and legends 12 pt (matplotlib's defaults are 12 / 10, and the
  notebooks used to shrink them to 7-9 pt to fit five panels in a row); a
  legend gets a solid background so that, when it must sit on the bars, the
  bars do not show through it. ``use()`` applies it. ``import helpers`` calls
  ``use()`` inside a notebook kernel; the ranks, which never plot, skip it and
  so do not pay matplotlib's import.
* ``interact(fn, **controls)``: ``ipywidgets.interact`` plus a static picture
  of ``fn``'s output at the default settings, in the same output. JupyterLab
  shows a widget only in a notebook it trusts, that is one whose cells this
  learner has run; a freshly opened notebook shows the richest *safe* format
  of each output instead, which for a plain widget is the text
  ``interactive(children=(FloatSlider(...``. With the picture (a PNG for a
  plot, the printed text otherwise) the learner sees what the control
  produces before running it, and the live control replaces it once the cell
  runs. Labels are given their full width ("params_billion", not
  "params_b..."). ``show_widget`` does the same for a hand-built widget.

Production notebooks (and Voila dashboards) save the widget state instead
(nbclient does: ``store_widget_state``); JupyterLab only uses it when its
"save widget state" setting is on, which it is not by default.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
from typing import Any, Callable

STYLE = {
    "figure.dpi": 100,            # inline figures at 1 inch = 100 px
    "font.size": 12,
    "axes.titlesize": 14,
    "axes.labelsize": 12,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "legend.fontsize": 11,
    "legend.title_fontsize": 12,
    "legend.framealpha": 1.0,     # opaque: a legend over bars stays readable
    "figure.titlesize": 15,
    "axes.spines.top": False,     # less ink around the data
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,       # grid behind bars, not over them
    "grid.alpha": 0.3,
}


# The site's text column is 832 px wide and figures are drawn at 100 px an inch (above),
# so a figure at most this wide is shown at its natural size: its labels keep the size
# they were drawn at. A wider one is shrunk to fit, and its labels with it (six 3-inch
# frames in a row came out at 47 %, 7-pt labels at ~4.5 px).
COLUMN_INCHES = 8.3
FRAME_TEXT_PT = 10         # the smallest text in a figure's frame: ~14 px; body text is 17 px


def use() -> None:
    """Apply ``STYLE`` to matplotlib's defaults (figures made afterwards use it)."""
    import matplotlib

    matplotlib.rcParams.update(STYLE)


def outside_legend(fig, ax, ncol: int | None = None) -> None:
    """One legend for the whole figure, below the axes, so it never covers a bar.

    ``ax`` supplies the handles (the first axes usually has every label)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol or len(labels),
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # leave the bottom tenth for the legend


def _snapshot(fn: Callable, kwargs: dict[str, Any]) -> dict[str, str]:
    """Run ``fn(**kwargs)`` once, capturing what it prints and the figures it draws,
    and return it as one safe mime type: image/png for a figure, else text/html."""
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    plt.figure()  # a fresh current figure, so a bare plt.plot() in fn cannot draw on an old one
    out = io.StringIO()
    show = plt.show
    plt.show = lambda *a, **k: None  # keep the figures open so we can save them
    try:
        with contextlib.redirect_stdout(out):
            fn(**kwargs)
    finally:
        plt.show = show
    new = [n for n in plt.get_fignums() if n not in before]
    drawn = [n for n in new if plt.figure(n).get_axes()]
    png = io.BytesIO()
    if drawn:
        plt.figure(drawn[-1]).savefig(png, format="png", bbox_inches="tight")
    for n in new:
        plt.close(n)
    if drawn:
        return {"image/png": base64.b64encode(png.getvalue()).decode("ascii")}
    settings = ", ".join(f"{k} = {v!r}" for k, v in kwargs.items())
    return {"text/html": f"<pre>{html.escape(out.getvalue())}</pre>"
                         f"<p><i>At {html.escape(settings)}. Run the cell to get the controls.</i></p>"}


def interact(fn: Callable, **controls: Any) -> None:
    """``ipywidgets.interact(fn, **controls)``, full-width labels, and a static
    picture of the default output for a notebook that has not been run yet.

    Displays the widget and returns nothing (so a cell ending in ``interact(...)``
    does not show it a second time)."""
    import ipywidgets as widgets

    w = widgets.interactive(fn, **controls)  # runs fn once with the defaults (its live output)
    for control in w.kwargs_widgets:
        control.style.description_width = "initial"  # the whole name, not "params_b..."
    show_widget(w, fn, **{c._kwarg: c.value for c in w.kwargs_widgets})


# What a widget's stored picture shows, kept in its output's metadata (the site's caption
# under it says which): the output at the controls' first settings, or every step of a
# slider side by side (``helpers.drawing.step_frames``' strip).
PICTURE_KEY = "course_picture"
FIRST_SETTINGS, EVERY_STEP = "first settings", "every step"


def show_widget(widget, fn: Callable, *, picture: str = FIRST_SETTINGS, **kwargs: Any) -> None:
    """Display ``widget`` with a static picture of ``fn(**kwargs)``'s output in the same
    output, for a notebook not run yet: by default what the widget shows at its initial
    settings; ``picture=EVERY_STEP`` says the picture is every step of a slider."""
    from IPython.display import display

    if picture not in (FIRST_SETTINGS, EVERY_STEP):
        raise ValueError(f"picture must be {FIRST_SETTINGS!r} or {EVERY_STEP!r}, got {picture!r}")
    bundle = widget._repr_mimebundle_()  # {widget-view+json, text/plain}
    bundle.update(_snapshot(fn, kwargs))
    display(bundle, raw=True, metadata={PICTURE_KEY: picture})
