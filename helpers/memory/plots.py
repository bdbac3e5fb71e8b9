"""Pictures of a memory budget: stacked bars, the budget over one step, chapter 06's calculator.

``plot_memory_bars`` stacks ``formulas.training_memory``'s four parts per
configuration against a GPU's memory; ``plot_memory_over_step`` draws
``formulas.memory_over_step`` (the same parts, alive at different times);
``memory_widget`` is an ipywidgets calculator over ``training_memory``, shown
with a static picture through the course's ``helpers.plots.show_widget``.
matplotlib and ipywidgets are imported on first use only.
"""

from __future__ import annotations

from helpers.memory.formulas import (BYTES_PER_PARAM_BY_PRECISION, GB, MODEL_PRESETS,
                                     OPTIMIZER_STATE, memory_over_step, training_memory)
from helpers.recompute import RECOMPUTE_MODES

__all__ = ["plot_memory_bars", "plot_memory_over_step", "memory_widget"]

# ---------------------------------------------------------------------------
# Pictures and the calculator
# ---------------------------------------------------------------------------

_PARTS = ("weights", "grads", "optimizer", "activations")
# what a bar stacks, bottom up: the four parts and, where a budget has it, ZeRO-3's
# all-gathered layers (the planner's "gathered" term, chapter 15)
_BAR_PARTS = ("weights", "grads", "optimizer", "gathered", "activations")
_COLORS = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
           "gathered": "#8172b3", "activations": "#c44e52", "buckets": "#f2c6a0"}
_LABELS = {"buckets": "DDP buckets", "gathered": "gathered layers"}


def plot_memory_bars(budgets: dict[str, dict[str, float]], ax=None, gpu_gb: float | None = 80.0,
                     gpu_label: str = "GPU"):
    """Stacked bars, one per configuration, of ``training_memory``'s parts in GB, and of
    the planner's ``gathered`` term where a budget has one (every part given is drawn;
    a key other than these and ``total`` is refused, so that no term goes missing).
    ``gpu_gb``: a dashed line labelled "<gpu_gb> GB <gpu_label>" (e.g. "usable" for
    the share of the GPU a planner lets a layout use)."""
    import matplotlib.pyplot as plt

    unknown = {k for b in budgets.values() for k in b} - set(_BAR_PARTS) - {"total"}
    if unknown:
        raise ValueError(f"plot_memory_bars draws {_BAR_PARTS}; got {sorted(unknown)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(budgets), 3.6))
    labels = list(budgets)
    bottom = [0.0] * len(labels)
    for part in _BAR_PARTS:
        if part not in _PARTS and not any(budgets[k].get(part) for k in labels):
            continue
        vals = [budgets[k].get(part, 0.0) / GB for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=_LABELS.get(part, part), color=_COLORS[part])
        bottom = [b + v for b, v in zip(bottom, vals)]
    if gpu_gb:
        ax.axhline(gpu_gb, color="k", ls="--", lw=1)
        ax.text(len(labels) - 0.5, gpu_gb, f" {gpu_gb:g} GB {gpu_label}", va="bottom",
                ha="right")
    ax.set_ylabel("GB per GPU")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never on them
    ax.tick_params(axis="x", labelsize=10)  # long budget names side by side
    return ax


def plot_memory_over_step(budgets: dict[str, dict[str, float]], layers: int,
                          gpu_gb: float | None = 80.0,
                          grad_buffer: dict[str, bool | str] | None = None):
    """One panel per budget: the parts of ``memory_over_step`` stacked over the step,
    with the sum of the four parts (the bar chart's total) dotted for comparison.
    ``grad_buffer`` gives, per budget, who else holds gradient bytes (``"none"``,
    ``"view"``, ``"copy"``: see ``memory_over_step``)."""
    import matplotlib.pyplot as plt

    from helpers.plots import COLUMN_INCHES, FRAME_TEXT_PT

    # one row as wide as the site's column, one scale, one legend under the panels (a
    # legend inside a panel covered its stack)
    fig, axes = plt.subplots(1, len(budgets), figsize=(COLUMN_INCHES, 4.2), squeeze=False,
                             sharey=True, layout="constrained")
    handles = {}
    for ax, (name, budget) in zip(axes[0], budgets.items()):
        points = memory_over_step(budget, layers,
                                  grad_buffer=(grad_buffer or {}).get(name, False))
        parts = list(points[0][1])  # the four parts, and "buckets" when DDP copies
        gap = max(2, layers // 2)  # room for the optimizer step's label after backward
        xs = list(range(2 * layers + 1)) + [2 * layers + gap, 2 * layers + 2 * gap]
        ax.stackplot(xs, *[[pt[part] / GB for _, pt in points] for part in parts],
                     labels=[_LABELS.get(p, p) for p in parts],
                     colors=[_COLORS[p] for p in parts])
        ax.axhline(sum(budget[p] for p in _PARTS) / GB, color="grey", ls=":", lw=1,
                   label="sum of the four parts")
        if gpu_gb:
            ax.axhline(gpu_gb, color="k", ls="--", lw=1, label=f"{gpu_gb:g} GB GPU")
        ax.axvspan(layers, 2 * layers, color="0.9", zorder=0)  # backward
        # short labels, turned: the last two ticks are only half a forward apart
        ax.set_xticks([0, layers, 2 * layers, 2 * layers + gap],
                      ["start", "end fwd", "end bwd", "opt. step"], fontsize=FRAME_TEXT_PT,
                      rotation=40, ha="right", rotation_mode="anchor")
        ax.set_title(name, fontsize=FRAME_TEXT_PT)
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][0].set_ylabel("GB per GPU")
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3,
               fontsize=FRAME_TEXT_PT)
    return axes[0]


def memory_widget(preset: str = "70B (Llama 2)"):
    """An ipywidgets calculator over ``training_memory`` with a stacked bar.

    Every control maps to one argument of the plain function; the function,
    not the widget, is what the tests check.
    """
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from helpers.plots import show_widget

    style = {"description_width": "110px"}
    c = dict(
        model=W.Dropdown(options=list(MODEL_PRESETS), value=preset, description="model",
                         style=style),
        precision=W.Dropdown(options=list(BYTES_PER_PARAM_BY_PRECISION), description="precision", style=style),
        optimizer=W.Dropdown(options=list(OPTIMIZER_STATE), description="optimizer",
                             style=style),
        zero_stage=W.IntSlider(value=0, min=0, max=3, description="ZeRO stage", style=style),
        dp=W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128], value=8, description="DP",
                      style=style),
        tp=W.Dropdown(options=[1, 2, 4, 8], value=1, description="TP", style=style),
        pp=W.Dropdown(options=[1, 2, 4, 8], value=1, description="PP", style=style),
        seq=W.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=2048, description="seq len",
                       style=style),
        micro_batch=W.IntSlider(value=1, min=1, max=16, description="micro-batch", style=style),
        sp=W.Checkbox(value=False, description="sequence parallel"),
        # selective: what a fused attention kernel without dropout keeps (no s x s scores)
        recompute=W.Dropdown(options=list(RECOMPUTE_MODES), value="selective",
                             description="recompute", style=style),
    )
    out = W.Output()

    def draw():
        m = MODEL_PRESETS[c["model"].value]
        try:
            parts = training_memory(
                m["n_params"], seq=c["seq"].value, micro_batch=c["micro_batch"].value,
                hidden=m["hidden"], heads=m["heads"], layers=m["layers"], vocab=m["vocab"],
                precision=c["precision"].value, optimizer=c["optimizer"].value,
                zero_stage=c["zero_stage"].value, dp=c["dp"].value, tp=c["tp"].value,
                pp=c["pp"].value, sequence_parallel=c["sp"].value,
                recompute=c["recompute"].value)
        except ValueError as exc:
            print("impossible configuration:", exc)
            return
        fig, ax = plt.subplots(figsize=(4.5, 4))
        plot_memory_bars({"per GPU": parts}, ax=ax)
        ax.set_title(f"{parts['total'] / GB:,.1f} GB per GPU")
        plt.show()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            draw()

    for w in c.values():
        w.observe(redraw, names="value")
    redraw()
    box = W.HBox([W.VBox(list(c.values())), out])
    show_widget(box, draw)  # with a picture of the first bar for a notebook not run yet
    return box
