"""The roofline's ceilings measured on the ranks at hand, and a data-parallel sweep to test it.

``roofline_probe`` is a rank function (``launch(roofline_probe, 2)``): every rank
measures, one after another and after a barrier, so both work at once as they
would in a step:

* the **compute roof**: the FLOP/s of the step's own three GEMMs per layer (forward,
  input gradient, weight gradient; ``step_gemms``) on m tokens, for each m in
  ``thin``: the fastest is the roof, the others are points below it on the memory
  roofline (few tokens make thin GEMMs that wait on memory);
* the **memory roof**: bytes/s of a tensor copy (read once, written once), large
  enough to leave the caches;
* the **link roof**: the all-reduce's bus bandwidth, 2(n-1)/n of the tensor over
  its seconds (``network.wire_factor``), of a ``comm_mb`` message;
* a **data-parallel sweep**: a stack of ``layers`` bias-free ``hidden`` x
  ``hidden`` linear layers, forward + backward on T tokens (6 P T FLOPs), then the
  all-reduce of its P fp32 gradients, each timed for every T in ``tokens``.

``crossover`` finds where the sweep's compute time meets its all-reduce time, and
``roofline.dp_tokens`` on the measured roofs predicts it. On a CPU the ranks share
the cores that both compute and copy the all-reduce's bytes (gloo over loopback
TCP), so each roof is the machine's, not a datasheet's; the claim under test is
only that the crossover sits where the roofs put it.

Timings go through ``helpers.clock`` (CUDA events on a GPU) and are the fastest of
``repeats`` after a warm-up; each rank returns its own, and the caller takes the slowest rank (a
collective is as fast as its slowest member).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers.costs.network import wire_factor
from helpers.costs.roofline import dp_tokens, gemm_flops, gemm_time
from helpers.launch import rank_info

__all__ = ["roofline_probe", "step_gemms", "step_gemm_flops", "crossover", "slowest",
           "predicted_compute", "predicted_crossover"]


def _best_seconds(fn, repeats: int, clk) -> float:
    """The fastest of ``repeats`` timed calls after a warm-up. Other work on the machine
    only ever slows a call down, so the fastest is the closest to what the hardware
    does (Python's ``timeit`` docs make the same case for the minimum)."""
    fn()                                       # warm-up: allocations, first-call costs
    times = []
    for _ in range(repeats):
        t0 = clk.mark()
        fn()
        times.append(elapsed(t0, clk.mark()))
    return min(times)


def _data_parallel_step(weights: list, grads: list, x: torch.Tensor) -> None:
    """Forward and backward of a stack of bias-free linear layers, written as its GEMMs
    so that it does exactly 6 P T FLOPs: per layer a_next = a W (forward), then
    g = g_next W^T and dW = a^T g_next (backward); each dW lands in ``grads``."""
    acts = [x]
    for w in weights:                          # (T, h) @ (h, h)
        acts.append(acts[-1] @ w)
    g = acts[-1]                               # d(sum of squares / 2) / d out = out
    for w, a, dw in zip(reversed(weights), reversed(acts[:-1]), reversed(grads)):
        torch.matmul(a.t(), g, out=dw)         # (h, T) @ (T, h)
        g = g @ w.t()


def step_gemms(tokens: float, hidden: int) -> list[tuple[float, float, float]]:
    """(m, k, n) of one layer's three GEMMs in the sweep's step: the forward
    (T, h) @ (h, h), the input gradient (T, h) @ (h, h)^T, the weight gradient
    (h, T) @ (T, h)."""
    return [(tokens, hidden, hidden), (tokens, hidden, hidden), (hidden, tokens, hidden)]


def step_gemm_flops(tokens: float, hidden: int) -> float:
    """FLOPs of one layer's three GEMMs: 6 h^2 T, the 6 P T of a step per layer."""
    return sum(gemm_flops(*shape) for shape in step_gemms(tokens, hidden))


def _step_gemms(x: torch.Tensor, w: torch.Tensor) -> None:
    """One layer's three GEMMs as the step runs them (transposes included): the compute
    roof is measured on the kernels the step calls, as ``helpers.costs.gemm`` measures
    the H100's on a layer's own shapes."""
    y = x @ w
    y @ w.t()
    x.t() @ y


def _slowest_roofs(gemm_flops: float, link_bw: float, dev) -> tuple[float, float]:
    """Every rank's lowest compute and link roof (a collective runs at its slowest
    member's pace), so that all ranks size the sweep alike."""
    t = torch.tensor([1 / gemm_flops, 1 / link_bw], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 1 / t[0].item(), 1 / t[1].item()


def roofline_probe(hidden: int = 1024, layers: int = 2, thin: tuple = (4, 16, 64, 256),
                   copy_mb: float = 64, comm_mb: float = 16, spread: int = 2,
                   repeats: int = 5) -> dict:
    """Rank function: the measured roofs, then the data-parallel sweep (module docstring)
    at 2^-spread ... 2^spread times the tokens the roofs predict for the crossover.
    Seconds are the fastest of ``repeats``; FLOP/s and bytes/s are computed from them."""
    info = rank_info()
    dev = torch.device(info.device)
    clk = clock_for(dev)
    torch.manual_seed(0)
    out = {"hidden": hidden, "layers": layers, "world": info.world_size}

    dist.barrier()
    w = torch.randn(hidden, hidden, device=dev)
    out["thin"] = []                           # (m, FLOP/s) of the step's GEMMs on m tokens
    for m in thin:
        x = torch.randn(m, hidden, device=dev)
        t = _best_seconds(lambda: _step_gemms(x, w), repeats, clk)
        out["thin"].append((m, step_gemm_flops(m, hidden) / t))
    out["gemm_flops"] = max(rate for _, rate in out["thin"])   # the compute roof

    src = torch.empty(int(copy_mb * 2 ** 20) // 4, device=dev).uniform_()
    dst = torch.empty_like(src)
    dist.barrier()
    t = _best_seconds(lambda: dst.copy_(src), repeats, clk)
    out["memory_bw"] = 2 * src.numel() * 4 / t    # read + write
    del src, dst

    buf = torch.ones(int(comm_mb * 2 ** 20) // 4, device=dev)
    dist.barrier()
    t = _best_seconds(lambda: dist.all_reduce(buf), repeats, clk)
    out["link_bw"] = wire_factor("all_reduce", info.world_size) * buf.numel() * 4 / t

    # the sweep, centred on the crossover the slowest rank's roofs predict
    flops, link = _slowest_roofs(out["gemm_flops"], out["link_bw"], dev)
    grad_bytes = 4
    predicted = dp_tokens(flops, link, info.world_size, grad_bytes)
    out["predicted_from"] = (flops, link)
    weights = [torch.randn(hidden, hidden, device=dev) / hidden ** 0.5 for _ in range(layers)]
    flat = torch.zeros(layers * hidden * hidden, device=dev)   # the gradients, one buffer
    grads = list(flat.view(layers, hidden, hidden).unbind(0))
    out["params"], out["grad_bytes"] = flat.numel(), grad_bytes
    out["sweep"] = []                          # (tokens, compute s, all-reduce s)
    for k in range(-spread, spread + 1):
        n = max(1, round(predicted * 2.0 ** k))
        x = torch.randn(n, hidden, device=dev)
        dist.barrier()
        compute = _best_seconds(lambda: _data_parallel_step(weights, grads, x), repeats, clk)
        dist.barrier()
        comm = _best_seconds(lambda: dist.all_reduce(flat), repeats, clk)
        out["sweep"].append((n, compute, comm))
    return out


def slowest(results: list[dict]) -> dict:
    """One record from every rank's: the slowest rank's seconds (and so the lowest
    rates), as a collective or a step runs at its slowest member's pace."""
    first = dict(results[0])
    for key in ("gemm_flops", "memory_bw", "link_bw"):
        first[key] = min(r[key] for r in results)
    first["thin"] = [(m, min(r["thin"][i][1] for r in results))
                     for i, (m, _) in enumerate(results[0]["thin"])]
    first["sweep"] = [(n, max(r["sweep"][i][1] for r in results),
                       max(r["sweep"][i][2] for r in results))
                      for i, (n, _, _) in enumerate(results[0]["sweep"])]
    return first


def predicted_compute(tokens: float, rec: dict) -> float:
    """Seconds of the sweep's step on the measured roofs: each of its GEMMs per layer
    (forward (T, h) @ (h, h), input gradient the same shape, weight gradient
    (h, T) @ (T, h)) at the compute or the memory roof, whichever is slower."""
    c, b = rec["gemm_flops"], rec["memory_bw"]
    return rec["layers"] * sum(gemm_time(m, k, n, c, b, rec["grad_bytes"])
                               for m, k, n in step_gemms(tokens, rec["hidden"]))


def predicted_crossover(rec: dict) -> float:
    """Tokens where ``predicted_compute`` meets the all-reduce's bytes at the link roof
    (bisection on log tokens: the compute time only grows with the tokens)."""
    comm = wire_factor("all_reduce", rec["world"]) * rec["params"] * rec["grad_bytes"] \
        / rec["link_bw"]
    lo, hi = 1e-3, 1e9
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if predicted_compute(mid, rec) < comm else (lo, mid)
    return math.sqrt(lo * hi)


def crossover(sweep: list[tuple[float, float, float]]) -> float | None:
    """Tokens where compute time meets all-reduce time: the first pair of neighbouring
    points where compute - comm changes sign, interpolated on log-log axes (compute
    grows as a power of the tokens there); None if it never changes sign."""
    for (n0, c0, a0), (n1, c1, a1) in zip(sweep, sweep[1:]):
        if c0 < a0 and c1 >= a1:
            # log(c/a) is close to linear in log(n) between two neighbours
            r0, r1 = math.log(c0 / a0), math.log(c1 / a1)
            f = r0 / (r0 - r1)
            return math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0)))
    return None
