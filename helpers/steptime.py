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

__all__ = ["StepProfile", "dp_step_profile", "classify_bottleneck", "PARTS"]

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
                   mem_frac=max(r.get("mem_frac", 0.0) for r in per_rank), label=label)


def classify_bottleneck(profile: StepProfile) -> str:
    """One of: memory-bound, straggler-bound, input-bound, all-reduce-bound, compute-bound."""
    if profile.mem_frac >= 0.9:
        return "memory-bound"
    wait = max(profile.compute) - min(profile.compute)
    if wait > max(profile.mean("data"), min(profile.compute), min(profile.comm)):
        return "straggler-bound"
    largest = max(("data", "compute", "comm"), key=profile.mean)
    return {"data": "input-bound", "compute": "compute-bound", "comm": "all-reduce-bound"}[largest]


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
    return result
