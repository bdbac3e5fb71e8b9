"""A training health monitor: the handful of numbers that say a run is sick.

What
----
A long run fails quietly far more often than loudly. The numbers that catch
it, logged every step by every serious training stack:

* **loss** and **validation loss**: the objective; a *spike* (one step far
  above the trend) often comes from a bad batch or an optimizer instability,
  and a run that diverges shows it first as spikes that stop recovering;
* **global gradient norm** (over every shard: ``global_grad_norm``): spikes
  here usually precede loss spikes, and clipping is set from its typical size;
* **learning rate**: a wrong schedule looks fine in code and obvious on a plot;
* **tokens/s** and **MFU** (model FLOPs utilization: achieved model FLOPs /
  peak FLOPs, with 6N FLOPs per token for a model of N parameters, forward
  and backward; Chowdhery et al. 2022, "PaLM", appendix B): throughput that
  drops means a slow rank, a slow disk or a thermal problem;
* **data-loader stall**: seconds a step waited for its batch;
* **memory**: a per-step curve that keeps rising is a leak, which ends in an
  out-of-memory error hours later (``leak_suspected``);
* **checkpoint time**: the time a save blocks training (chapter 17).

``HealthMonitor.log(step, loss=..., grad_norm=..., ...)`` keeps every value
(``.history``), checks loss and gradient norm for spikes, and returns the
alerts of that step (all of them: ``.alerts``). ``plot()`` draws the
dashboard. ``writer=`` sends every scalar to a
``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_scalar``),
where practitioners look (``tensorboard_writer(logdir)`` makes one when
TensorBoard is installed).

Spike detection: a robust z-score over a trailing window,
``z = (x - median) / (1.4826 * MAD)`` (median absolute deviation; 1.4826
makes it estimate the standard deviation of normal data; Rousseeuw & Croux
1993, "Alternatives to the median absolute deviation", JASA). Why not mean
and standard deviation: a spike inflates both, so it partly hides itself and
the next few steps; the median and the MAD ignore up to half of the window
being outliers. Why a trailing window: the loss falls steadily, so "normal"
must mean "like the last few steps", not "like the whole run". A step is a
spike when ``z > threshold`` (default 6: on noise alone that is rarer than 1
in 10^8 steps for normal data) *and* it is ``min_ratio`` above the median, so
a window that is almost flat (MAD ~ 0) does not flag tiny wiggles.

Stragglers: in synchronous training every rank's *step* time is the same
(they all wait for the slowest at the all-reduce), so a straggler shows in
the time each rank spends *before* the collective (its compute and data
time): ``stragglers(busy_times)`` names ranks whose median is ``ratio``
above the median rank's. (``helpers.debug.diff.straggler`` finds the same
rank from the recorder's arrival times.)

How production differs: Megatron-LM logs these per iteration to TensorBoard
or W&B and has a straggler detector (``--log-straggler``) that compares
per-rank GPU throughput; large labs add automatic "skip the batch / roll back
to the last checkpoint" on repeated spikes (the PaLM paper, sec. 5.1, restarted
from a checkpoint ~100 steps before a spike and skipped 200-500 batches).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["HealthMonitor", "Alert", "robust_z", "global_grad_norm", "sum_of_squares", "mfu",
           "stragglers", "leak_suspected", "cuda_memory_stats", "tensorboard_writer"]

METRICS = ("loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu", "data_stall_s",
           "memory_bytes", "checkpoint_s", "step_s")


def robust_z(window: Sequence[float], x: float) -> float:
    """How many (robust) standard deviations ``x`` lies above the window's median."""
    med = statistics.median(window)
    mad = statistics.median(abs(v - med) for v in window)
    if mad == 0:
        return 0.0 if x == med else float("inf") * (1 if x > med else -1)
    return (x - med) / (1.4826 * mad)


def sum_of_squares(tensors, device=None) -> torch.Tensor:
    """The sum of x**2 over every element of ``tensors``: a float64 scalar on
    ``device`` (default: the first tensor's; the CPU when there is none).

    Each tensor's part is computed where the tensor lives (in float64) and only
    that scalar moves, so CUDA gradients are summed on the GPU: never added into
    a CPU number (which raises), never copied whole to the host."""
    tensors = list(tensors)
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        sq += t.detach().double().pow(2).sum().to(device)
    return sq


def global_grad_norm(params, group=None, sharded: bool = False) -> float:
    """The L2 norm of all gradients. ``sharded=True`` (ZeRO-2/3, FSDP: each rank
    holds a different part): the squared local norms are summed over ``group``
    first; with replicated gradients (DDP) the local norm already is global.

    Summed on the gradients' device (``sum_of_squares``): CUDA on a GPU node,
    where the all-reduce needs a CUDA tensor too. A rank that holds no gradient
    sums on its first parameter's device, so every rank all-reduces on the same
    kind of device."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    fallback = params[0].device if params else torch.device("cpu")
    sq = sum_of_squares(grads, grads[0].device if grads else fallback)
    if sharded and dist.is_initialized():
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


def mfu(tokens_per_s: float, n_params: float, peak_flops: float) -> float:
    """Model FLOPs utilization: 6 N FLOPs per token (forward 2N, backward 4N;
    attention's FLOPs left out, as PaLM's appendix B does for short sequences)."""
    return 6.0 * n_params * tokens_per_s / peak_flops


def stragglers(busy_s: dict[int, Sequence[float]], ratio: float = 1.2) -> list[tuple[int, float]]:
    """Ranks whose median busy time (compute + data, before the collective) is
    at least ``ratio`` times the median over ranks: [(rank, times the median)]."""
    med = {r: statistics.median(v) for r, v in busy_s.items() if len(v)}
    if len(med) < 2:
        return []
    typical = statistics.median(med.values())
    out = [(r, m / typical) for r, m in med.items() if typical > 0 and m >= ratio * typical]
    return sorted(out, key=lambda rt: -rt[1])


def leak_suspected(memory: Sequence[float], warmup: int = 2) -> bool:
    """A leak: after ``warmup`` steps (allocator and optimizer state settle),
    every step holds more than the one before. A healthy run goes flat."""
    tail = list(memory)[warmup:]
    return len(tail) >= 3 and all(b > a for a, b in zip(tail, tail[1:]))


def cuda_memory_stats(device=None) -> dict[str, float] | None:
    """The CUDA caching allocator's view, or None without a GPU.

    allocated: bytes in live tensors; reserved: bytes the allocator holds from
    the driver (allocated + cached free blocks); fragmentation: the share of
    reserved that is not allocated. An OOM with large ``reserved - allocated``
    is fragmentation (try ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``);
    with ``allocated`` near the GPU's size it is true over-subscription."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.memory_stats(device)
    alloc, reserved = s.get("allocated_bytes.all.current", 0), s.get("reserved_bytes.all.current", 0)
    return {"allocated": alloc, "reserved": reserved,
            "peak_allocated": s.get("allocated_bytes.all.peak", 0),
            "fragmentation": (reserved - alloc) / reserved if reserved else 0.0,
            "num_alloc_retries": s.get("num_alloc_retries", 0), "num_ooms": s.get("num_ooms", 0)}


def tensorboard_writer(logdir: str):
    """A ``SummaryWriter`` for ``logdir``, or None (with the reason printed) when
    TensorBoard is not installed: it is an optional extra, not a dependency."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        print(f"TensorBoard is not installed ({exc}); `pip install tensorboard` to write "
              f"the scalars there too")
        return None
    return SummaryWriter(logdir)


@dataclasses.dataclass
class Alert:
    step: int
    metric: str
    value: float
    z: float
    text: str


class HealthMonitor:
    """Log per-step health scalars, flag spikes, plot a dashboard.

    ``mon = HealthMonitor(n_params=..., peak_flops=...)``; every step
    ``mon.log(step, loss=..., grad_norm=..., lr=..., tokens=..., step_s=...,
    data_stall_s=..., memory_bytes=..., checkpoint_s=..., val_loss=...)``
    (all but ``loss`` optional) -> the alerts raised by that step.
    tokens/s and MFU are derived from ``tokens`` and ``step_s``.
    """

    def __init__(self, n_params: float | None = None, peak_flops: float | None = None,
                 window: int = 20, threshold: float = 6.0, min_ratio: float = 1.1,
                 writer: Any = None):
        if window < 5:
            raise ValueError(f"window must be >= 5 steps for a median to mean anything, got {window}")
        self.n_params, self.peak_flops = n_params, peak_flops
        self.window, self.threshold, self.min_ratio = window, threshold, min_ratio
        self.writer = writer
        self.steps: list[int] = []
        self.history: dict[str, list[float | None]] = {m: [] for m in METRICS}
        self.alerts: list[Alert] = []

    def log(self, step: int, loss: float, *, grad_norm: float | None = None,
            lr: float | None = None, tokens: int | None = None, step_s: float | None = None,
            data_stall_s: float | None = None, memory_bytes: float | None = None,
            checkpoint_s: float | None = None, val_loss: float | None = None) -> list[Alert]:
        tps = tokens / step_s if tokens and step_s else None
        util = mfu(tps, self.n_params, self.peak_flops) if tps and self.n_params and \
            self.peak_flops else None
        row = dict(loss=float(loss), val_loss=val_loss, grad_norm=grad_norm, lr=lr,
                   tokens_per_s=tps, mfu=util, data_stall_s=data_stall_s,
                   memory_bytes=memory_bytes, checkpoint_s=checkpoint_s, step_s=step_s)
        new = [a for a in (self._spike(step, "loss", row["loss"]),
                           self._spike(step, "grad_norm", grad_norm)) if a is not None]
        self.steps.append(step)
        for m in METRICS:
            self.history[m].append(None if row[m] is None else float(row[m]))
            if self.writer is not None and row[m] is not None:
                self.writer.add_scalar(f"health/{m}", float(row[m]), step)
        self.alerts += new
        return new

    def _spike(self, step: int, metric: str, x: float | None) -> Alert | None:
        past = [v for v in self.history[metric][-self.window:] if v is not None]
        if x is None or len(past) < self.window // 2:  # too little history to judge
            return None
        med = statistics.median(past)
        z = robust_z(past, x)
        if z > self.threshold and x > self.min_ratio * med:
            return Alert(step, metric, x, z, f"step {step}: {metric} {x:.4g} is {z:.1f} robust "
                                             f"std above the median {med:.4g} of the last "
                                             f"{len(past)} steps")
        return None

    def summary(self) -> str:
        last = {m: next((v for v in reversed(h) if v is not None), None)
                for m, h in self.history.items()}
        shown = ", ".join(f"{m} {v:.4g}" for m, v in last.items() if v is not None)
        return f"{len(self.steps)} steps; last: {shown}; {len(self.alerts)} alert(s)" + \
            "".join(f"\n  {a.text}" for a in self.alerts)

    def plot(self, metrics: Sequence[str] = ("loss", "grad_norm", "lr", "tokens_per_s",
                                             "data_stall_s", "memory_bytes"), axes=None):
        """One panel per metric that has values; alerts marked in red."""
        import matplotlib.pyplot as plt

        shown = [m for m in metrics if any(v is not None for v in self.history[m])]
        if axes is None:
            cols = min(3, len(shown))
            rows = -(-len(shown) // cols)
            _, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
            axes = axes.ravel()
        for ax, m in zip(axes, shown):
            pts = [(s, v) for s, v in zip(self.steps, self.history[m]) if v is not None]
            ax.plot(*zip(*pts), lw=1.5)
            if m == "loss" and any(v is not None for v in self.history["val_loss"]):
                val = [(s, v) for s, v in zip(self.steps, self.history["val_loss"]) if v is not None]
                ax.plot(*zip(*val), "o-", ms=4, label="val_loss")
            for a in self.alerts:
                if a.metric == m:
                    ax.plot(a.step, a.value, "o", color="red", ms=8)
            if ax.get_legend_handles_labels()[1]:
                # placed after the alert markers, where it covers the fewest of them and
                # of the curves (a spike sits in any fixed corner sooner or later)
                ax.legend(loc="best")
            ax.set_title(m)
            ax.set_xlabel("step")
        for ax in list(axes)[len(shown):]:
            ax.set_visible(False)
        plt.tight_layout()
        return axes
