"""A pipeline step drawn from what the ranks ran and sent (chapter 11).

Two records of one step: the executor's timeline (``pipeline_step(...).timeline``, each
rank's executed actions with their start and end) and the messages each rank posted,
copied by the checks' spy (``helpers.checks.spy.communication_spy``: destination and
bytes, in posting order). ``pipeline_messages`` pairs them: a stage sends forward only
what a forward produced and backward only what a backward produced, and the stages see
the micro-batches in the same order, so the k-th message rank r sends to r + 1 is the
activation of its k-th forward, F(j), and feeds F(j) on rank r + 1; the k-th it sends
to r - 1 is the input gradient of its k-th backward, B(j), and feeds B(j) there.
A message sent once every action has its own is sent after the step's computation:
the tied weight's gradient, which the first and last stages exchange and add
(``helpers.pipeline.executor.sync_tied_grads``). Both ranks post that exchange
together once each has finished its actions, so it completes no earlier than the later
of the two: it is drawn there, a vertical arrow at the later rank's last end, its label
beside its sender, never as an arrow that arrives before it was sent.

``draw_pipeline_messages`` draws the executed actions as a Gantt chart (forward blue,
backward orange, as ``helpers.pipeline.gantt``) and every message as an arrow from the
end of the action that produced it to the start of the action that needed it, labelled
with its bytes. With one micro-batch (the naive pipeline) the picture is a staircase
down and back up: exactly one rank busy at any moment, each waiting for an arrow.
"""

from __future__ import annotations

from typing import Any

from helpers.drawing import rank_color

__all__ = ["pipeline_messages", "draw_pipeline_messages"]


def pipeline_messages(timelines: list[list[tuple]], sends: list[list[tuple]]
                      ) -> dict[str, Any]:
    """Plain values from every rank's timeline ``[(start, end, action)]`` and its sends
    ``[(dst, nbytes)]`` (rank order): {"actions": [[(start, end, "F0")]], "messages":
    [(src, dst, nbytes, "F0", "F0")]}, each message with the action that produced it
    and the one it fed, or "after" / "after" for one sent after the step's actions (the
    tied weight's gradient)."""
    p = len(timelines)
    actions = [[(float(s), float(e), repr(a)) for s, e, a in row] for row in timelines]
    messages = []
    for src, row in enumerate(sends):
        fwd = [a for _, _, a in timelines[src] if a.kind == "F"]
        bwd = [a for _, _, a in timelines[src] if a.kind == "B"]
        n_fwd = n_bwd = 0
        for dst, nbytes, *_ in row:
            if dst == src + 1 and n_fwd < len(fwd):
                name, n_fwd = repr(fwd[n_fwd]), n_fwd + 1
            elif dst == src - 1 and n_bwd < len(bwd):
                name, n_bwd = repr(bwd[n_bwd]), n_bwd + 1
            elif 0 <= dst < p:
                name = "after"
            else:
                raise ValueError(f"rank {src} sent to rank {dst}, outside a pipeline of {p}")
            messages.append((src, int(dst), int(nbytes), name, name))
    return {"actions": actions, "messages": messages}


def draw_pipeline_messages(timelines: list[list[tuple]], sends: list[list[tuple]], *,
                           title: str | None = None, unit: float = 1e3, unit_name: str = "ms"):
    """The Gantt chart of the executed actions and an arrow per message (see the module
    docstring); returns ``(fig, data)``: ``pipeline_messages(timelines, sends)`` and
    ``data["arrows"]``, each message's (sent, arrived) in the picture's time unit."""
    import matplotlib.pyplot as plt

    from helpers.pipeline.simulate import gantt

    data = pipeline_messages(timelines, sends)
    t0 = min(s for row in timelines for s, _, _ in row)
    shifted = [[((s - t0) * unit, (e - t0) * unit, a) for s, e, a in row] for row in timelines]
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.55 * len(timelines)))
    gantt(shifted, ax=ax, title=title or "")
    where = {(r, name): (s, e) for r, row in enumerate(data["actions"])
             for s, e, name in row}
    arrows = []
    for src, dst, nbytes, made_by, feeds in data["messages"]:
        if made_by == "after":   # exchanged once both ranks are done: the later one's end
            end = start = max(data["actions"][src][-1][1], data["actions"][dst][-1][1])
            label_y = src + (0.3 if dst > src else -0.3)     # beside the sender: no overlap
        else:
            _, end = where[(src, made_by)]
            start, _ = where[(dst, feeds)]
            label_y = (src + dst) / 2
        x0, x1 = (end - t0) * unit, (start - t0) * unit
        arrows.append((x0, x1))
        ax.annotate("", xy=(x1, dst), xytext=(x0, src),
                    arrowprops=dict(arrowstyle="-|>", color=rank_color(src), lw=1.2,
                                    shrinkA=0, shrinkB=6))
        ax.text((x0 + x1) / 2, label_y, f" {nbytes:,} B", fontsize=6,
                color=rank_color(src), va="center")
    data["arrows"] = arrows
    ax.set_xlabel(unit_name)
    fig.tight_layout()
    return fig, data
