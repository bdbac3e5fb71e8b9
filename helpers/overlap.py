"""Timelines of compute and communication, and how much communication shows.

A step's communication is either *hidden* (it runs while the rank computes
something else, as DDP's bucket all-reduces do during backward) or *exposed*
(the rank has nothing to compute and waits). Only exposed communication adds
to step time, so that is the number to measure, not the bytes alone
(Li et al. 2020, "PyTorch Distributed", sec. 3.2.3, on overlapping
all-reduce with backward; Zhao et al. 2023, "PyTorch FSDP", sec. 3.3.2, on
prefetching all-gathers).

``Timeline`` records spans on three lanes with the device's clock
(``helpers.clock``: ``time.perf_counter()`` on CPU, CUDA events on a GPU):
``"compute"`` (a unit's forward or backward), ``"comm"`` (a collective in
flight) and ``"wait"`` (the training thread blocked until a collective
finishes). A communication span starts when the collective is
issued and ends when it completes: ``Timeline.comm(work, name)`` attaches a
callback to the async work's future, which runs on the communication thread
as soon as the data has arrived, so the end time is not delayed by the
moment we happen to ``wait()``. Gloo's reduce-scatter has no future; for it
a small watcher thread blocks in ``work.wait()`` (which releases the GIL)
and stamps the end the moment it returns. On a GPU the same stamps are CUDA
events recorded on the current stream after the collective (inside the
future's callback, or after ``wait()``), so they resolve to when the GPU
finished it, not to when nccl queued it (``helpers.clock``). Closing such a span at the next
place the training thread happens to look instead would stretch it by
whatever the thread computed meanwhile: a reduce-scatter issued after unit
k's backward would appear to last until unit k-1's backward ended, and
"communication in flight" would approach the whole backward.

    exposed = | union(wait spans) within union(comm spans) |
    hidden  = | union(comm spans) | - exposed

Waiting is the cost communication adds to the step: while the thread waits
nothing else runs. (Counting "comm not covered by compute spans" instead
would need compute spans covering every operator, the loss and the optimizer
included; the wait lane needs only the few places that block.) On a GPU the two lanes are CUDA
streams; on a CPU with gloo they are the Python thread and gloo's threads,
which share the cores, so "hidden" work still slows compute a little: the
metric counts time, not cores.

``export_trace`` runs a function under ``torch.profiler`` and writes a Chrome
trace JSON that opens in Perfetto (https://ui.perfetto.dev) or
chrome://tracing: every operator, every ``record_function`` label, every gloo
collective.

How production differs: PyTorch's profiler and Nsight Systems read GPU
streams directly; Megatron-LM and torchtitan log per-step exposed
communication from CUDA events. The interval arithmetic is the same.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable

from helpers.clock import clock_for, resolve


__all__ = ["Timeline", "union_length", "exposed_comm", "ddp_timeline", "plot_timelines",
           "OVERLAP_KEY", "short_label", "export_trace"]


class Timeline:
    """Spans on named lanes: ``events`` is a list of dicts
    ``{"lane", "name", "start", "end"}`` (seconds on the ``perf_counter`` scale).

    ``clock``: a ``helpers.clock`` clock (default: the rank's device's). Spans
    are kept as the clock's marks and turned into seconds when ``events`` is
    read, so that timing a GPU step never synchronizes inside it."""

    def __init__(self, clock=None) -> None:
        self.clock = clock_for() if clock is None else clock
        self._spans: list[dict] = []  # marks, resolved by ``events``
        self._lock = threading.Lock()
        self._watchers: dict[int, threading.Thread] = {}  # id(work) -> its watcher

    @property
    def events(self) -> list[dict]:
        with self._lock:
            spans = list(self._spans)
        return resolve(spans)

    def add(self, lane: str, name: str, start, end) -> None:
        """A span from mark (or seconds) ``start`` to ``end``."""
        if isinstance(start, float) and isinstance(end, float) and end < start:
            raise ValueError(f"span {name!r} ends ({end}) before it starts ({start})")
        with self._lock:
            self._spans.append({"lane": lane, "name": name, "start": start, "end": end})

    def now(self):
        """A mark of this moment on the timeline's clock."""
        return self.clock.mark()

    @contextlib.contextmanager
    def span(self, lane: str, name: str):
        t0 = self.clock.mark()
        try:
            yield
        finally:
            self.add(lane, name, t0, self.clock.mark())

    def comm(self, work, name: str, start=None) -> None:
        """Record an async collective from ``start`` (default now) to its completion."""
        t0 = self.clock.mark() if start is None else start
        try:
            fut = work.get_future()
        except RuntimeError:
            # Some gloo collectives (reduce-scatter) have no future: a watcher
            # thread waits for the work and closes the span when it returns.
            watcher = threading.Thread(target=self._watch, args=(work, name, t0), daemon=True)
            self._watchers[id(work)] = watcher
            watcher.start()
            return
        # The callback runs with streams that wait on the collective (torch.futures,
        # add_done_callback behaves as then() for GPU tensors): its mark is the end.
        fut.add_done_callback(lambda _: self.add("comm", name, t0, self.clock.mark()))

    def _watch(self, work, name: str, t0) -> None:
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the training thread's own wait reports it
            return
        self.add("comm", name, t0, self.clock.mark())

    def settle(self, work=None) -> None:
        """Let the watcher of ``work`` (default: every watcher) record its span:
        after ``work.wait()`` returned it is microseconds from done."""
        keys = list(self._watchers) if work is None else [id(work)]
        for key in keys:
            watcher = self._watchers.pop(key, None)
            if watcher is not None:
                watcher.join()

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def exposed_comm(self) -> dict[str, float]:
        return exposed_comm(self.events)


def issue_mark(timeline: "Timeline | None"):
    """A mark to take just before issuing a collective (None without a timeline)."""
    return None if timeline is None else timeline.now()


def record_comm(timeline: "Timeline | None", work, name: str, start) -> None:
    """Note an async collective issued at mark ``start`` on ``timeline`` (if any)."""
    if timeline is not None:
        timeline.comm(work, name, start)


def wait_comm(timeline: "Timeline | None", work, name: str) -> None:
    """Block on ``work``; with a timeline the blocked time is a "wait" span
    (exposed communication). On a GPU the span's end is the mark after
    ``wait()``: when the stream could go on, i.e. when the collective finished."""
    if timeline is None:
        work.wait()
        return
    t0 = timeline.now()
    work.wait()
    timeline.add("wait", name, t0, timeline.now())
    timeline.settle(work)


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping [start, end) spans."""
    return sum(b - a for a, b in _merge(spans))


def exposed_comm(events: list[dict]) -> dict[str, float]:
    """Seconds of communication in flight (union), exposed (the thread waited
    while some of it was in flight) and hidden (the rest: it ran while the
    thread computed)."""
    comm = _merge((e["start"], e["end"]) for e in events if e["lane"] == "comm")
    waits = _merge((e["start"], e["end"]) for e in events if e["lane"] == "wait")
    total = sum(b - a for a, b in comm)
    exposed = sum(max(0.0, min(b, d) - max(a, c)) for a, b in waits for c, d in comm)
    return {"total": total, "exposed": exposed, "hidden": max(0.0, total - exposed)}


def ddp_timeline(ddp_events: list[dict], backward_start: float, backward_end: float) -> list[dict]:
    """``BucketedDDP.timeline`` (bucket, event, t) -> Timeline events: one comm
    span per bucket (launched -> finished); backward as compute from
    ``backward_start`` until the last bucket is launched (after that the
    thread only waits); the wait from there until the last bucket finished,
    or until ``backward_end`` (when ``loss.backward()`` returned) if later."""
    launched = {e["bucket"]: e["t"] for e in ddp_events if e["event"] == "launched"}
    last_launch = max(launched.values(), default=backward_end)
    out = [{"lane": "compute", "name": "backward", "start": backward_start, "end": last_launch}]
    for e in ddp_events:
        if e["event"] == "finished" and e["bucket"] in launched:
            out.append({"lane": "comm", "name": f"all-reduce bucket {e['bucket']}",
                        "start": launched[e["bucket"]], "end": e["t"]})
    last_finish = max((e["end"] for e in out if e["lane"] == "comm"), default=last_launch)
    end = max(last_finish, backward_end)
    if end > last_launch:
        out.append({"lane": "wait", "name": "wait for buckets", "start": last_launch, "end": end})
    return out


# a wait keeps its word: "W" is chapter 12's weight-gradient action, and the wait lane is
# named on the axis anyway
_SHORT = {"forward": "F", "backward": "B", "all-gather": "AG", "reduce-scatter": "RS",
          "all-reduce": "AR", "wait": "wait"}


def short_label(name: str) -> str:
    """"all-gather blocks.1" -> "AG1", "backward blocks.2" -> "B2", "all-reduce
    bucket 3" -> "AR3": a label that fits on a bar (the key is printed under
    the chart)."""
    words = name.replace(".", " ").split()
    if not words:
        return ""
    head = _SHORT.get(words[0], words[0][:2])
    if words[-1].isdigit():
        return head + words[-1]
    return head + (" root" if len(words) > 1 and words[-1] == "root" else "")


# what the bars' short labels mean in chapter 16's timelines (``short_label``)
OVERLAP_KEY = ("F/B forward/backward of a unit, AG all-gather, RS reduce-scatter,\n"
               "AR all-reduce (number: unit or bucket); wait: the training thread blocked")


def plot_timelines(timelines: list[list[dict]], ax=None, title: str = "",
                   key: str = OVERLAP_KEY):
    """Gantt chart: three rows (compute, comm, wait) per rank, time in ms
    from the earliest event; every bar wide enough carries its short label
    (``short_label``: F/B = forward/backward of a unit, AG/RS/AR = all-gather,
    reduce-scatter, all-reduce, then the unit or bucket number). ``key``: what the
    labels mean, under the axis (another chapter's spans name other things)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.9 * len(timelines)))
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    t0 = min(e["start"] for tl in timelines for e in tl)
    t1 = max(e["end"] for tl in timelines for e in tl)
    # a bar carries its label only where the text fits inside it: the axes' width over the
    # span it will show (the data and matplotlib's margin on each side)
    font = FontProperties(size="x-small")
    shown_ms = max((t1 - t0) * 1e3, 1e-9) * (1 + 2 * plt.rcParams["axes.xmargin"])
    points_per_ms = ax.get_window_extent().width * 72 / ax.figure.dpi / shown_ms

    def fits(text: str, width_ms: float) -> bool:
        return TextPath((0, 0), text, prop=font).get_extents().width + 2 <= \
            width_ms * points_per_ms
    colors = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:red"}
    lanes = ("compute", "comm", "wait")
    yticks, labels = [], []
    for r, tl in enumerate(timelines):
        for j, lane in enumerate(lanes):
            y = -(len(lanes) * r + j)
            events = [e for e in tl if e["lane"] == lane]
            spans = [((e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3) for e in events]
            ax.broken_barh(spans, (y - 0.4, 0.8), color=colors[lane], alpha=0.8,
                           edgecolor="white", linewidth=0.5)
            labelled_to = float("-inf")  # bars in flight together overlap: label the first
            for e, (x, w) in sorted(zip(events, spans), key=lambda ev: ev[1][0]):
                if x >= labelled_to and fits(short_label(e["name"]), w):
                    ax.text(x + w / 2, y, short_label(e["name"]), ha="center", va="center",
                            fontproperties=font, color="white", clip_on=True)
                    labelled_to = x + w
            yticks.append(y)
            labels.append(f"rank {r} {lane}")
    ax.set_yticks(yticks, labels)
    ax.set_xlabel(f"ms   {key}" if key else "ms")
    if title:
        ax.set_title(title)
    return ax


def export_trace(fn: Callable[[], object], path: str) -> str:
    """Run ``fn()`` under torch.profiler and write a Chrome/Perfetto trace: CPU activity,
    and on a machine with a GPU the CUDA kernels too (nccl's collectives appear as
    kernels on their own stream there, which is where overlap is seen)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with _without_profiler_chatter():
        with profile(activities=activities) as prof:
            fn()
    prof.export_chrome_trace(str(path))
    return str(path)


@contextlib.contextmanager
def _without_profiler_chatter():
    """The profiler's C++ side writes "USDT: ... profiler_start/stop" lines straight to
    file descriptor 2. Catch fd 2 meanwhile and pass on every other line."""
    import os
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)
