"""The roofline's ceilings measured on the ranks at hand, and a data-parallel sweep to test it.

``roofline_probe`` is a rank function (``launch(roofline_probe, 2)``): every rank
measures, one after another and after a barrier, so both work at once as they
would in a step:

* the **compute roof**: the FLOP/s of the step's own three GEMMs per layer (forward,
  input gradient, weight gradient; ``step_gemms``) on m tokens, for each m in
  ``thin``: the fastest is the roof, the others are points below it on the memory
  roofline (few tokens make thin GEMMs that wait on memory); and their rate on as many
  tokens as the crossover needs (``crossover_gemm``: the rate a step meets there);
* the **memory roof**: bytes/s of a tensor copy (read once, written once), large
  enough to leave the caches;
* the **link roof**: the all-reduce's bus bandwidth, 2(n-1)/n of the tensor over
  its seconds (``network.wire_factor``), of a message as large as the sweep's
  gradient (``comm_mb`` to choose another size) before the sweep, to centre it; the
  roof is then the median of every all-reduce of that size the run timed, before, in
  and after the sweep;
* a **data-parallel sweep**: a stack of ``layers`` bias-free ``hidden`` x
  ``hidden`` linear layers, forward + backward on T tokens (6 P T FLOPs), then the
  all-reduce of its P fp32 gradients, each timed, for T from 2^-spread to 2^spread
  times the crossover the first roofs predict.

``crossover`` finds where the sweep's compute time meets its all-reduce time, and
``roofline.dp_tokens`` on the measured roofs (``crossover_gemm``'s rate, ``link_bw``)
predicts it. The copy's bandwidth is the
DRAM's: a layer of the sweep (1 MB of fp32 weights) stays in the caches, which are
faster, so the prediction uses the compute roof alone, measured on the step's own
GEMMs. On a CPU the ranks share the cores that both compute and copy the all-reduce's
bytes (gloo over loopback TCP), so each roof is the machine's, not a datasheet's; the
claim under test is only that the crossover sits where the roofs put it.

Timings go through ``helpers.clock`` (CUDA events on a GPU) and are the fastest of
``repeats`` after a warm-up; each rank returns its own, and the caller takes the slowest rank (a
collective is as fast as its slowest member).
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers.costs.network import wire_factor
from helpers.costs.roofline import dp_tokens, gemm_flops
from helpers.launch import rank_info

__all__ = ["roofline_probe", "best_seconds", "linear_stack_step", "slowest_rates", "step_gemms",
           "step_gemm_flops", "smoothed", "crossing", "crossover", "slowest"]


def best_seconds(fn, repeats: int, clk) -> float:
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


def linear_stack_step(weights: list, grads: list, x: torch.Tensor) -> None:
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


def slowest_rates(dev, *rates: float) -> list[float]:
    """Each rate as the slowest rank has it (a collective runs at its slowest member's
    pace), so that every rank sizes its sweep alike."""
    inverse = torch.tensor([1 / r for r in rates], dtype=torch.float64, device=dev)
    dist.all_reduce(inverse, op=dist.ReduceOp.MAX)
    return [1 / v for v in inverse.tolist()]


def roofline_probe(hidden: int = 512, layers: int = 2, thin: tuple = (4, 16, 64, 256),
                   copy_mb: float = 64, comm_mb: float | None = None, spread: int = 2,
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
        t = best_seconds(lambda: _step_gemms(x, w), repeats, clk)
        out["thin"].append((m, step_gemm_flops(m, hidden) / t))
    out["gemm_flops"] = max(rate for _, rate in out["thin"])   # the compute roof

    src = torch.empty(int(copy_mb * 2 ** 20) // 4, device=dev).uniform_()
    dst = torch.empty_like(src)
    dist.barrier()
    t = best_seconds(lambda: dst.copy_(src), repeats, clk)
    out["memory_bw"] = 2 * src.numel() * 4 / t    # read + write
    del src, dst

    # the link roof, measured on a message of the gradient's size unless told otherwise:
    # at a few MB gloo's per-call latency is a part of what the sweep's all-reduce pays
    grad_numel = layers * hidden * hidden
    buf = torch.ones(grad_numel if comm_mb is None else int(comm_mb * 2 ** 20) // 4,
                     device=dev)

    def link_roof() -> float:
        # all-reduces of a few MB are cheap and the noisiest: three times the repeats
        dist.barrier()
        t = best_seconds(lambda: dist.all_reduce(buf), 3 * repeats, clk)
        return wire_factor("all_reduce", info.world_size) * buf.numel() * 4 / t

    out["link_bw"] = link_roof()

    # The compute roof a step meets at the crossover is the rate its GEMMs reach on that
    # many tokens (fewer tokens, lower intensity: a point below the roof). So: the
    # crossover on the best rate, then the GEMMs measured alone on that many tokens, and
    # the sweep centred on the crossover the slowest rank's roofs then predict.
    grad_bytes = 4
    flops, link = slowest_rates(dev, out["gemm_flops"], out["link_bw"])
    m = max(1, round(dp_tokens(flops, link, info.world_size, grad_bytes)))
    x = torch.randn(m, hidden, device=dev)
    out["crossover_gemm"] = (m, step_gemm_flops(m, hidden)
                             / best_seconds(lambda: _step_gemms(x, w), repeats, clk))
    flops, link = slowest_rates(dev, out["crossover_gemm"][1], out["link_bw"])
    predicted = dp_tokens(flops, link, info.world_size, grad_bytes)
    out["predicted_from"] = (flops, link)      # the roofs that centred the sweep
    weights = [torch.randn(hidden, hidden, device=dev) / hidden ** 0.5 for _ in range(layers)]
    flat = torch.zeros(layers * hidden * hidden, device=dev)   # the gradients, one buffer
    grads = list(flat.view(layers, hidden, hidden).unbind(0))
    out["params"], out["grad_bytes"] = flat.numel(), grad_bytes
    out["sweep"] = []                          # (tokens, compute s, all-reduce s)
    for k in range(-spread, spread + 1):
        n = max(1, round(predicted * 2.0 ** k))
        x = torch.randn(n, hidden, device=dev)
        dist.barrier()
        compute = best_seconds(lambda: linear_stack_step(weights, grads, x), repeats, clk)
        dist.barrier()
        comm = best_seconds(lambda: dist.all_reduce(flat), 3 * repeats, clk)
        out["sweep"].append((n, compute, comm))
    # The same message is all-reduced at every T, so the sweep measures one number several
    # times over: the roof is the median of all those measurements (each the fastest of
    # its repeats), before, in and after the sweep, so that a burst of other work on the
    # machine during one of them does not move the prediction.
    sent = wire_factor("all_reduce", info.world_size) * flat.numel() * 4
    if comm_mb is None:
        out["link_bw"] = statistics.median([out["link_bw"], link_roof()]
                                           + [sent / comm for _, _, comm in out["sweep"]])
    return out


def slowest(results: list[dict]) -> dict:
    """One record from every rank's: the slowest rank's seconds (and so the lowest
    rates), as a collective or a step runs at its slowest member's pace."""
    first = dict(results[0])
    for key in ("gemm_flops", "memory_bw", "link_bw"):
        first[key] = min(r[key] for r in results)
    first["crossover_gemm"] = (results[0]["crossover_gemm"][0],
                               min(r["crossover_gemm"][1] for r in results))
    first["thin"] = [(m, min(r["thin"][i][1] for r in results))
                     for i, (m, _) in enumerate(results[0]["thin"])]
    first["sweep"] = [(n, max(r["sweep"][i][1] for r in results),
                       max(r["sweep"][i][2] for r in results))
                      for i, (n, _, _) in enumerate(results[0]["sweep"])]
    return first


def smoothed(sweep: list[tuple[float, float, float]], power: int
             ) -> list[tuple[float, float, float]]:
    """The sweep with its communication times read off one robust line, since its
    points send tensors of size (knob)^power: for power 0 the median time; for power 1
    a fixed cost (the per-call latency) plus a cost per unit of the knob, the line
    through the points with the median of their pairwise slopes (Theil-Sen). A burst of
    other work on the machine during one point's transfer then moves nothing."""
    if power == 0:
        comm = statistics.median(tm for _, _, tm in sweep)
        return [(v, tc, comm) for v, tc, _ in sweep]
    slope = statistics.median((b[2] - a[2]) / (b[0] - a[0])
                              for i, a in enumerate(sweep) for b in sweep[i + 1:])
    fixed = statistics.median(tm - slope * v for v, _, tm in sweep)
    floor = min(tm for _, _, tm in sweep) / 2         # a line is never below half the fastest
    return [(v, tc, max(floor, fixed + slope * v)) for v, tc, _ in sweep]


def crossing(sweep: list[tuple[float, float, float]]) -> float | None:
    """The knob where compute / communication crosses 1, interpolated on log-log axes
    between the two neighbouring points (both grow as powers of the knob); None if the
    ratio never crosses inside the sweep."""
    pts = [(math.log(v), math.log(tc / tm)) for v, tc, tm in sweep]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if r0 < 0 <= r1:
            return math.exp(x0 + (0 - r0) / (r1 - r0) * (x1 - x0))
    return None


def crossover(sweep: list[tuple[float, float, float]]) -> float | None:
    """Tokens where the data-parallel sweep's compute time meets its all-reduce's time.
    The all-reduce is the same message at every T, so its time is one number, the median
    of the sweep's (``smoothed`` with power 0); None if they never cross."""
    return crossing(smoothed(sweep, 0))
