"""Measuring all-reduce bandwidth over message sizes, and fitting alpha and beta.

``sweep`` times the ring (``helpers.collectives.ring``), halving-doubling and
the backend's own ``dist.all_reduce`` side by side and reports algorithm and
bus bandwidth as nccl-tests do (doc/PERFORMANCE.md); ``fit_alpha_beta`` fits
the ring's alpha-beta model (Thakur et al. 2005, sec. 4;
``helpers.collectives.cost``) to the measured times.
benchmarks/bench_collectives.py runs it from the command line.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers.collectives.cost import bus_bandwidth
from helpers.collectives.halving_doubling import halving_doubling_all_reduce
from helpers.collectives.ring import chunk_bounds, ring_all_reduce
from helpers.validate import int_at_least, is_int

__all__ = ["IMPLS", "check_sweep_args", "sweep", "fit_alpha_beta"]


# Run inside launch(); every rank returns the same numbers.

def _all_reduce_impl(impl: str, workspace: torch.Tensor | None = None):
    if impl == "ring":
        return lambda t: ring_all_reduce(t, workspace=workspace)
    if impl == "hd":
        return lambda t: halving_doubling_all_reduce(t)
    if impl == "torch":  # the backend's own all_reduce
        return lambda t: dist.all_reduce(t)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# "hd": halving-doubling; "torch": the backend's own dist.all_reduce (gloo or nccl)
IMPLS = ("ring", "hd", "torch")


def check_sweep_args(sizes: Iterable[int], impls: Sequence[str], iters: int,
                     warmup: int) -> list[int]:
    """Validate ``sweep``'s arguments; returns ``sizes`` as a list of ints.

    Call it before starting ranks (the benchmark does) to fail at once with a
    clear message; ``sweep`` calls it too, on every rank, before any collective.
    """
    sizes = list(sizes)
    if not sizes or any(not is_int(n) or n < 4 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of ints >= 4 (bytes; the sweep sends "
                         f"float32 elements), got {sizes!r}")
    if isinstance(impls, str) or not impls or any(i not in IMPLS for i in impls) \
            or len(set(impls)) != len(impls):
        raise ValueError(f"impls must be a non-empty sequence of distinct names from {IMPLS}, "
                         f"got {impls!r}")
    int_at_least("iters (timed calls per size)", iters, 1)
    int_at_least("warmup", warmup, 0)
    return sizes


def sweep(sizes: Iterable[int], impls: Sequence[str] = ("ring", "torch"), iters: int = 5,
          warmup: int = 1) -> list[dict]:
    """algbw/busbw over message sizes for each implementation; run on every rank.

    For each size the implementations take turns call by call (ring, torch,
    ring, torch, ...), so a burst of load elsewhere on the machine hits both
    alike. Each call is timed after a barrier; a sample is the slowest rank's
    time; the row reports the median sample.
    Returns rows {"impl", "nbytes", "time_s", "algbw", "busbw"} (bytes/s).
    """
    sizes = check_sweep_args(sizes, impls, iters, warmup)
    p = dist.get_world_size()
    device = "cuda" if "nccl" in dist.get_backend() else "cpu"  # "cpu:gloo,cuda:nccl" too
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
        # persistent receive buffer for the ring, allocated and touched outside the timing
        ws = torch.zeros(chunk_bounds(x.numel(), p)[0][1], dtype=x.dtype, device=device)
        fns = {impl: _all_reduce_impl(impl, ws) for impl in impls}
        clk = clock_for(x.device)  # CUDA events after the call: when the GPU finished it
        samples: dict = {impl: [] for impl in impls}
        for i in range(warmup + iters):
            for impl, fn in fns.items():
                dist.barrier()
                t0 = clk.mark()
                fn(x)
                dt = torch.tensor([elapsed(t0, clk.mark())], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # done when the slowest rank is
                if i >= warmup:
                    samples[impl].append(float(dt))
                x.fill_(1.0)  # keep the values bounded (sums of ones grow by p per call)
        for impl in impls:
            t = sorted(samples[impl])[len(samples[impl]) // 2]
            algbw = nbytes / t
            rows.append({"impl": impl, "nbytes": int(nbytes), "time_s": t, "algbw": algbw,
                         "busbw": bus_bandwidth(algbw, p, "all_reduce")})
    return rows


def fit_alpha_beta(nbytes: Sequence[float], times: Sequence[float],
                   world_size: int) -> tuple[float, float]:
    """Least-squares fit of T = 2(p-1) alpha + 2(p-1)/p N / beta; returns (alpha, beta).

    The fit minimizes *relative* error (each row weighted by 1/T), because the
    sweep spans five orders of magnitude of T: an unweighted fit would ignore
    the small messages, which are the only ones that show alpha.
    """
    import numpy as np

    if len(nbytes) != len(times) or len(nbytes) < 2:
        raise ValueError("need at least two (nbytes, time) pairs of equal length")
    if world_size < 2:
        raise ValueError("a fit needs world_size >= 2 (one rank sends nothing)")
    p = world_size
    N = np.asarray(nbytes, dtype=float)
    T = np.asarray(times, dtype=float)
    if (T <= 0).any():
        raise ValueError("times must be positive")
    A = np.stack([np.full_like(N, 2 * (p - 1)), 2 * (p - 1) / p * N], axis=1) / T[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = max(float(inv_beta), 1e-30)
    return alpha, 1.0 / inv_beta
