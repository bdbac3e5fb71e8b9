"""Where does a training step's time go? Measure it per rank, then name the bottleneck.

A data-parallel step has four parts, timed separately on every rank:

    data       fetch the next micro-batch (a real loader: disk, decode, copy)
    compute    forward + backward on this rank's micro-batch
    comm       all-reduce of the gradients. The clock runs from the call until
               the averaged gradient is back, so it includes *waiting* for the
               slowest rank to arrive, not only moving bytes.
    optimizer  the parameter update

Five bottlenecks show up as five shapes of that breakdown:

    input-bound       data is the largest part: the GPUs wait for the loader
    compute-bound     compute is the largest part: the healthy case
    all-reduce-bound  comm is the largest part and the ranks are balanced
    straggler-bound   the time the fast ranks spend waiting for the slowest
                      (max - min compute) is larger than any real cost: the
                      data time, the fast ranks' own compute, and the transfer
                      itself (the smallest comm: the last rank to arrive does
                      not wait). The fast ranks show the wait as a long comm.
    memory-bound      memory is nearly full (>= 90 %), which forces tiny
                      micro-batches or recompute; look at memory before time

The order of the tests matters: a straggler makes comm look large on the
fast ranks, so the spread between ranks is checked before the largest part.

To show a shape, a planted effect must dominate the step on whatever machine
runs it: a 50 ms sleep is large next to a 5 ms GPU step and small next to a
200 ms step on a loaded laptop. ``plant_bottlenecks`` therefore sizes each
effect from a measured healthy step (and, for the gradient, from the measured
cost of one extra megabyte of all-reduce).

Each part is timed with ``helpers.clock``: on CPU with gloo every call is
synchronous and the host clock measures it; on a GPU kernels and nccl
collectives run after the call returns, so the part ends at a CUDA event on
the stream, which completes when the work it queued has finished.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers.data import ShardedSampler, make_dataset
from helpers.launch import rank_info
from helpers.model import build_model

__all__ = ["StepProfile", "dp_step_profile", "classify_bottleneck", "plant_bottlenecks", "PARTS"]

PARTS = ("data", "compute", "comm", "optimizer")


@dataclasses.dataclass
class StepProfile:
    """Seconds per step for each part, one entry per rank (median over steps)."""

    data: list[float]
    compute: list[float]
    comm: list[float]
    optimizer: list[float]
    mem_frac: float = 0.0  # peak memory / device memory, the largest over ranks
    label: str = ""
    grad_mb: float = 0.0   # megabytes all-reduced per step (model gradient + planted extra)

    def part(self, name: str) -> list[float]:
        return getattr(self, name)

    def mean(self, name: str) -> float:
        return statistics.fmean(self.part(name))

    def step_time(self) -> float:
        """The step takes as long as the slowest rank's four parts."""
        return max(sum(v) for v in zip(*(self.part(p) for p in PARTS)))

    @classmethod
    def from_ranks(cls, per_rank: list[dict], label: str = "") -> "StepProfile":
        """Build from ``launch(dp_step_profile, ...)``'s per-rank dicts."""
        return cls(*([r[p] for r in per_rank] for p in PARTS),
                   mem_frac=max(r.get("mem_frac", 0.0) for r in per_rank), label=label,
                   grad_mb=per_rank[0].get("grad_mb", 0.0))


def classify_bottleneck(profile: StepProfile) -> str:
    """One of: memory-bound, straggler-bound, input-bound, all-reduce-bound, compute-bound."""
    if profile.mem_frac >= 0.9:
        return "memory-bound"
    wait = max(profile.compute) - min(profile.compute)
    if wait > max(profile.mean("data"), min(profile.compute), min(profile.comm)):
        return "straggler-bound"
    largest = max(("data", "compute", "comm"), key=profile.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[largest]


def plant_bottlenecks(healthy: StepProfile, probe: StepProfile, factor: float = 3.0,
                      max_extra_mb: float = 8192.0) -> dict[str, dict]:
    """``dp_step_profile`` knobs that make each planted effect ``factor`` times its rival.

    healthy  a measured step without planted effects
    probe    the same step with some ``extra_grad_mb``: the growth of the pure
             transfer time (the smallest comm over ranks) between the two gives
             the seconds per all-reduced megabyte on this machine and backend. The
             healthy comm alone cannot: a tiny gradient's all-reduce is mostly
             latency, so dividing it by the bytes overstates the cost per byte.
    Returns {"slow loader": ..., "slow rank": ..., "big gradient": ...}. A sleep of
    ``factor`` healthy steps outweighs every healthy part (each is at most one step);
    the gradient grows until its transfer is predicted at ``factor`` x the slowest
    rank's compute. Add the healthy run's own knobs (batch size, model size) to each.
    """
    if factor <= 1:
        raise ValueError(f"factor must be > 1 for the planted effect to dominate, got {factor}")
    d_mb = probe.grad_mb - healthy.grad_mb
    d_s = min(probe.comm) - min(healthy.comm)
    if d_mb <= 0:
        raise ValueError(f"the probe must all-reduce more than the healthy step "
                         f"({probe.grad_mb:.2f} MB vs {healthy.grad_mb:.2f} MB): give it extra_grad_mb > 0")
    if d_s <= 0:
        raise ValueError(f"the probe's {d_mb:.1f} extra MB did not lengthen the all-reduce "
                         f"({1e3 * d_s:+.2f} ms, noise): probe with a larger extra_grad_mb")
    s_per_mb = d_s / d_mb
    target = factor * max(healthy.compute)
    extra = d_mb + max(0.0, (target - min(probe.comm)) / s_per_mb)
    if extra > max_extra_mb:
        raise ValueError(f"an all-reduce-bound step needs {extra:,.0f} MB of extra gradient here, "
                         f"more than max_extra_mb={max_extra_mb:,.0f}: use a smaller batch or model")
    step = healthy.step_time()
    return {"slow loader": dict(data_delay=factor * step),
            "slow rank": dict(straggler_delay=factor * step),
            "big gradient": dict(extra_grad_mb=extra)}


def _timed(fn, *args):
    # helpers.clock: on a GPU two events on the stream, so the span covers the
    # kernels and collectives ``fn`` queued, not only their launch
    clk = clock_for()
    start = clk.mark()
    out = fn(*args)
    return out, elapsed(start, clk.mark())


def dp_step_profile(size: str = "toy", batch_size: int = 8, steps: int = 8,
                    data_delay: float = 0.0, straggler_delay: float = 0.0,
                    extra_grad_mb: float = 0.0, mem_frac: float = 0.0) -> dict:
    """Rank function: a few plain data-parallel steps, each part timed.

    The knobs plant one bottleneck each, so chapter 01 can show its shape:
    data_delay       seconds the "loader" sleeps per batch (a slow input pipeline)
    straggler_delay  seconds the *last* rank sleeps in compute (a slow GPU/host)
    extra_grad_mb    megabytes of extra gradient to all-reduce, standing in for
                     a model with many more parameters than this toy one
    mem_frac         reported memory fullness (CPU has no device memory to read)
    Returns the median seconds per part over ``steps`` (the first step is a warm-up).
    """
    info = rank_info()
    device = torch.device(info.device)
    model = build_model(size, seed=0, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_dataset(vocab_size=model.config.vocab_size, seq_len=model.config.block_size,
                        num_sequences=max(256, 2 * batch_size * info.world_size * (steps + 1)))
    sampler = ShardedSampler(len(data), batch_size, info.rank, info.world_size)
    extra = torch.zeros(int(extra_grad_mb * 2**20 // 4), device=device)
    times = {p: [] for p in PARTS}

    def load():
        if data_delay:
            time.sleep(data_delay)
        x, y = data.batch(next(sampler))
        return x.to(device), y.to(device)

    def compute(x, y):
        _, loss = model(x, y)
        loss.backward()
        if straggler_delay and info.rank == info.world_size - 1:
            time.sleep(straggler_delay)

    def communicate():
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads] + [extra])
        dist.all_reduce(flat)
        flat /= info.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=False)

    for step in range(steps + 1):
        (x, y), t_data = _timed(load)
        _, t_compute = _timed(compute, x, y)
        _, t_comm = _timed(communicate)
        _, t_opt = _timed(update)
        if step > 0:  # step 0 warms up allocators and caches
            for p, t in zip(PARTS, (t_data, t_compute, t_comm, t_opt)):
                times[p].append(t)
    result = {p: statistics.median(v) for p, v in times.items()}
    result["mem_frac"] = mem_frac
    result["grad_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 \
        + extra.numel() * extra.element_size() / 2**20
    return result
