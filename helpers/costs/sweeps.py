"""Each parallelism's threshold on ranks: a sweep whose crossover lands where the formula says.

``helpers.costs.roofline`` derives, for every family, the value of one knob at which
its compute time equals its communication time: the tokens per rank for data
parallelism and FSDP, each rank's share of the MLP's width for tensor parallelism
(4h/t; the tokens and even h cancel), the sequence per rank for ring attention, the
stage's width for a pipeline, the expert's width for expert parallelism.
``threshold_sweep(family)`` is a rank function (``launch(threshold_sweep, 2, "tp")``)
that runs that family's own work on the ranks at several values of the knob and times
its two halves apart:

* the **compute**: the GEMMs of one step of the family, forward and backward, written
  out so that they do exactly the FLOPs the formula counts (the elementwise work
  between them, an activation or a softmax, is left out: it moves no bytes between
  ranks and is not in the count);
* the **communication**: the family's own collectives or point-to-point exchange on
  the tensors that step would send, as many as the formula counts.

The ceilings the formula needs are measured in the same run, at the sizes the
crossover works at (a GEMM on a thin matrix runs below the compute roof, a collective
of a few hundred kB below the link's, because of its per-call latency; chapter 01's
section 7 shows both):

* ``C``, the FLOP/s of the family's GEMMs alone at the knob the formula predicts,
  measured twice over (the second time at the prediction the first gave: the GEMMs'
  rate changes with their shape); the sweep is centred on the result;
* ``W``, the bandwidth of one plain transfer of the kind the family waits on, of the
  size it sends per call (an all-reduce's bus bandwidth, 2(n-1)/n of the tensor over
  its seconds; a point-to-point exchange's, the whole tensor; for FSDP one all-gather
  and one reduce-scatter, since gloo runs the two at different speeds), taken again
  between the sweep's points and used as their median.

What the crossover then tests is the formula's counting: how many FLOPs the family
does per unit of its knob and how many bytes its step sends (two all-reduces or one,
K and V or K alone, four all-to-alls or two, (n-1)/n or the whole tensor). A count off
by a factor of two moves the prediction by two; noise on a shared machine moves the
measured crossover by tens of percent, hence ``TOLERANCE``. Where every point sends the
same tensors (DP, FSDP, TP, EP) their time is one number, and the crossover uses the
median of the points' times; where the tensors grow with the knob (CP, PP), a line
through the points, latency plus bandwidth, fitted robustly (``smoothed``).

Every figure is the fastest of ``repeats`` timed calls after a warm-up (other work on
the machine only ever slows a call down); each rank returns its own and ``slowest``
keeps the slowest rank's (a collective runs at its slowest member's pace). Timings go
through ``helpers.clock``: CUDA events on a GPU, so the same sweep runs on nccl.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable

import torch
import torch.distributed as dist

from helpers.clock import clock_for
from helpers.costs.ceilings import (best_seconds, crossing as crossover, linear_stack_step,
                                    slowest_rates, smoothed)
from helpers.collectives.ring import post_pair
from helpers.comm import all_gather, group_rank, reduce_scatter
from helpers.costs import roofline
from helpers.costs.network import wire_factor
from helpers.launch import rank_info

__all__ = ["FAMILIES", "TOLERANCE", "threshold_sweep", "slowest", "smoothed", "crossover",
           "report"]

# A factor either way: the ceilings are the fastest of several runs and still move by
# tens of percent on a shared machine from one second to the next; a slip in the
# counting (one all-reduce for two, both ring directions for one) is a factor of 2.
TOLERANCE = 1.5
BYTES = 4                       # fp32 on every rank: CPU GEMMs and gloo run it natively


@dataclasses.dataclass(frozen=True)
class Family:
    """One parallelism as the sweep sees it.

    ``wire``: the kind of transfer it waits on ("all_reduce", "gather_scatter": an
    all-gather and a reduce-scatter, "all_to_all" or "p2p"); ``flops(x, n)``: the
    FLOPs one rank's step does at knob ``x`` on ``n`` ranks; ``message(x, n)``: the
    numel of one call's tensor;
    ``predict(C, W, n)``: the formula's knob at the crossover (``roofline``);
    ``step(x, n, device)``: the (compute, communicate) callables at knob ``x``."""

    name: str
    knob: str
    wire: str
    formula: str
    flops: Callable[[float, int], float]
    message: Callable[[float, int], int]
    predict: Callable[[float, float, int], float]
    step: Callable

    def message_power(self, n: int) -> int:
        """How the tensors sent grow with the knob: 0, the same at every point (DP, FSDP,
        TP, EP); 1, in proportion to it (CP, PP)."""
        return round(math.log(self.message(1000, n) / self.message(10, n), 100))


# -- the families' fixed sizes: small enough for a laptop, large enough that each
#    collective moves at least tens of kB (below that gloo's latency is the message)
DP_HIDDEN, DP_LAYERS = 256, 2          # DP and FSDP: P = 2 x 256^2 weights
TP_TOKENS, TP_HIDDEN = 1024, 64        # TP: tokens per rank and h of one MLP block
CP_HIDDEN = 128                        # CP: width of Q, K and V in one attention block
PP_TOKENS = 4096                       # PP: tokens per micro-batch through one h x h layer
EP_TOKENS, EP_HIDDEN = 1024, 64        # EP: routed tokens per rank, model width


def _dp_numel(n: int, sharded: bool) -> int:
    """The gradients' buffer: P values, padded to a multiple of n when sharded (as FSDP
    pads a parameter that does not divide evenly over its ranks)."""
    p = DP_LAYERS * DP_HIDDEN ** 2
    return -(-p // n) * n if sharded else p


def _dp_step(tokens: float, n: int, dev, sharded: bool):
    """DP: the gradients' all-reduce once a step. FSDP (``sharded``): each micro-batch
    all-gathers the weights for the forward and again for the backward, and
    reduce-scatters the gradients."""
    p = DP_LAYERS * DP_HIDDEN ** 2
    weights = [torch.randn(DP_HIDDEN, DP_HIDDEN, device=dev) / DP_HIDDEN ** 0.5
               for _ in range(DP_LAYERS)]
    flat = torch.zeros(_dp_numel(n, sharded), device=dev)
    grads = list(flat[:p].view(DP_LAYERS, DP_HIDDEN, DP_HIDDEN).unbind(0))
    x = torch.randn(max(1, round(tokens)), DP_HIDDEN, device=dev)
    shard = torch.empty(flat.numel() // n, device=dev)

    def communicate():
        if not sharded:
            dist.all_reduce(flat)
            return
        all_gather(flat, shard)        # forward's weights
        all_gather(flat, shard)        # backward's weights, gathered again
        reduce_scatter(shard, flat)    # gradients

    return (lambda: linear_stack_step(weights, grads, x)), communicate


def _tp_step(columns: float, n: int, dev):
    """TP, one MLP block as Megatron splits it: W1 by columns (h x f/t), W2 by rows
    (f/t x h); an all-reduce of the block's (T, h) output in the forward and of its
    input gradient in the backward (Shoeybi et al. 2019, sec. 3). The knob is this
    rank's share of the MLP's width, f/t (4h/t in a GPT); h is held at TP_HIDDEN."""
    h, f = TP_HIDDEN, max(1, round(columns))
    x = torch.randn(TP_TOKENS, h, device=dev)
    w1, w2 = torch.randn(h, f, device=dev) / h ** 0.5, torch.randn(f, h, device=dev) / f ** 0.5
    out, gin = torch.empty(TP_TOKENS, h, device=dev), torch.empty(TP_TOKENS, h, device=dev)

    def compute():
        y = x @ w1                     # forward: (T, h) @ (h, f/t), then (T, f/t) @ (f/t, h)
        torch.matmul(y, w2, out=out)
        g = out                        # backward: d(sum of squares / 2) / d out = out
        y.t() @ g                      # dW2
        gy = g @ w2.t()
        x.t() @ gy                     # dW1
        torch.matmul(gy, w1.t(), out=gin)

    def communicate():
        dist.all_reduce(out)           # forward: the row-parallel output
        dist.all_reduce(gin)           # backward: the column-parallel input's gradient

    return compute, communicate


def _ring(n: int) -> tuple[int, int]:
    """The next and the previous rank on a ring of ``n``."""
    rank = group_rank()
    return (rank + 1) % n, (rank - 1) % n


def _cp_step(seq: float, n: int, dev):
    """CP, one step of ring attention: this rank's queries against the K/V block it
    holds (Q K^T, then P V: 4 s^2 h FLOPs), while the block goes on to the next rank
    and the previous rank's arrives (K and V: 2 s h values each way)."""
    s = max(1, round(seq))
    q, kv = torch.randn(s, CP_HIDDEN, device=dev), torch.randn(2, s, CP_HIDDEN, device=dev)
    incoming = torch.empty_like(kv)
    right, left = _ring(n)

    def compute():
        scores = q @ kv[0].t()         # (s, h) @ (h, s)
        scores @ kv[1]                 # (s, s) @ (s, h); the softmax between is elementwise

    def communicate():
        for req in post_pair(kv, incoming, right, left, None):
            req.wait()

    return compute, communicate


def _pp_step(hidden: float, n: int, dev):
    """PP, one micro-batch at a stage boundary: a stage of one h x h layer, forward and
    backward on T tokens (6 h^2 T FLOPs); its (T, h) activation goes to the next stage
    and a gradient of the same size comes back (2 of them; on a ring of two ranks,
    both ranks send and receive one of each at once)."""
    h = max(1, round(hidden))
    x = torch.randn(PP_TOKENS, h, device=dev)
    w, dw = torch.randn(h, h, device=dev) / h ** 0.5, torch.empty(h, h, device=dev)
    act, grad = torch.empty(2, PP_TOKENS, h, device=dev), torch.empty(2, PP_TOKENS, h, device=dev)
    right, left = _ring(n)

    def communicate():
        for req in post_pair(act[0], act[1], right, left, None, tag=1):   # activation on
            req.wait()
        for req in post_pair(grad[0], grad[1], left, right, None, tag=2):  # gradient back
            req.wait()

    return (lambda: linear_stack_step([w], [dw], x)), communicate


def _ep_rows(n: int) -> int:
    """Routed tokens per rank: EP_TOKENS, rounded down to a multiple of n so that even
    routing sends each rank the same number."""
    return EP_TOKENS // n * n


def _ep_step(ffn: float, n: int, dev):
    """EP, one MoE layer with an expert of width f on every rank (a plain MLP, h -> f
    -> h: 12 h f FLOPs per routed token). Routing is even, so each all-to-all sends
    (n-1)/n of the rank's (T, h) tokens: dispatch and combine in the forward, the same
    two in the backward."""
    f = max(1, round(ffn))
    x = torch.randn(_ep_rows(n), EP_HIDDEN, device=dev)
    w1 = torch.randn(EP_HIDDEN, f, device=dev) / EP_HIDDEN ** 0.5
    w2 = torch.randn(f, EP_HIDDEN, device=dev) / f ** 0.5
    routed = torch.empty_like(x)

    def communicate():
        for _ in range(4):             # dispatch, combine; their gradients back
            dist.all_to_all_single(routed, x)

    return (lambda: _mlp_step(x, w1, w2)), communicate


def _mlp_step(x, w1, w2) -> None:
    """A two-matrix MLP, forward and backward, as its six GEMMs."""
    y = x @ w1
    out = y @ w2
    y.t() @ out
    gy = out @ w2.t()
    x.t() @ gy
    gy @ w1.t()


def _tp_predict(C, W, n):
    # an MLP alone: a = 8 and two all-reduces; the threshold on h, as this rank's 4h/t
    return 4 * roofline.tp_hidden(C, W, n, weights_per_h2=8, dtype_bytes=BYTES,
                                  all_reduces=2) / n


def _pp_predict(C, W, n):
    # pp_ratio is linear in h: the h where it is 1
    return 1.0 / roofline.pp_ratio(C, W, 1, 1, weights_per_h2=1, dtype_bytes=BYTES)


FAMILIES = {
    "dp": Family("DP", "tokens per rank", "all_reduce",
                 "T* = C/W x 2(n-1)/n x b / 6",
                 lambda t, n: 6 * DP_LAYERS * DP_HIDDEN ** 2 * t,
                 lambda t, n: _dp_numel(n, False),
                 lambda C, W, n: roofline.dp_tokens(C, W, n, BYTES),
                 lambda x, n, dev: _dp_step(x, n, dev, sharded=False)),
    "fsdp": Family("ZeRO-3/FSDP", "tokens per rank per micro-batch", "gather_scatter",
                   "T* = C/W x 3(n-1)/n x b / 6",
                   lambda t, n: 6 * DP_LAYERS * DP_HIDDEN ** 2 * t,
                   lambda t, n: _dp_numel(n, True),
                   lambda C, W, n: roofline.zero_tokens(C, W, n, 3, BYTES),
                   lambda x, n, dev: _dp_step(x, n, dev, sharded=True)),
    "tp": Family("TP", "MLP columns per rank", "all_reduce",
                 "4h*/t, with h* = C/W x 2 x 2(t-1)/t x b x t / (6 x 8)",
                 lambda f, n: 12 * TP_HIDDEN * round(f) * TP_TOKENS,
                 lambda f, n: TP_TOKENS * TP_HIDDEN,
                 _tp_predict, _tp_step),
    "cp": Family("CP (ring attention)", "sequence per rank", "p2p",
                 "s* = C/W x b / 2",
                 lambda s, n: 4 * round(s) ** 2 * CP_HIDDEN,
                 lambda s, n: 2 * max(1, round(s)) * CP_HIDDEN,
                 lambda C, W, n: roofline.cp_tokens(C, W, 1.0, BYTES, causal=False),
                 _cp_step),
    "pp": Family("PP", "hidden width of a one-layer stage", "p2p",
                 "h* = C/W x 2b / 6",
                 lambda h, n: 6 * round(h) ** 2 * PP_TOKENS,
                 lambda h, n: PP_TOKENS * max(1, round(h)),
                 _pp_predict, _pp_step),
    "ep": Family("EP", "expert width", "all_to_all",
                 "f* = C/W x 4(e-1)/e x b / (6 x 2)",
                 lambda f, n: 6 * 2 * EP_HIDDEN * round(f) * _ep_rows(n),
                 lambda f, n: _ep_rows(n) * EP_HIDDEN,
                 lambda C, W, n: roofline.ep_ffn(C, W, n, gated=False, dtype_bytes=BYTES),
                 _ep_step),
}


def _reference(wire: str, numel: int, n: int, dev) -> tuple[Callable, float]:
    """One plain transfer of the kind the family waits on, of ``numel`` fp32 values,
    and the bytes each rank sends in it: its link roof is those bytes over its time
    (an all-reduce's "bus bandwidth", nccl-tests' convention; a point-to-point
    exchange sends the whole tensor)."""
    buf = torch.ones(numel, device=dev)
    if wire == "p2p":
        recv, (right, left) = torch.empty_like(buf), _ring(n)
        return (lambda: [r.wait() for r in post_pair(buf, recv, right, left, None)]), \
            numel * BYTES
    if wire == "all_reduce":
        return (lambda: dist.all_reduce(buf)), wire_factor("all_reduce", n) * numel * BYTES
    if wire == "gather_scatter":      # one of each: the two may run at different speeds
        shard = torch.ones(numel // n, device=dev)
        return (lambda: (all_gather(buf, shard), reduce_scatter(shard, buf))), \
            2 * wire_factor("all_gather", n) * numel * BYTES
    out = torch.empty_like(buf)
    return (lambda: dist.all_to_all_single(out, buf)), wire_factor("all_to_all", n) * numel * BYTES


def _compute_roof(fam: Family, x: int, n: int, dev, clk, repeats: int) -> float:
    """FLOP/s of the family's GEMMs alone at knob ``x``: the rate the step meets there."""
    compute, _ = fam.step(x, n, dev)
    dist.barrier()
    return fam.flops(x, n) / best_seconds(compute, repeats, clk)


def threshold_sweep(family: str, spread: int = 2, repeats: int = 5, start: float | None = None
                    ) -> dict:
    """Rank function: the ceilings at the predicted crossover, then the family's step at
    2^-spread ... 2^spread times it (module docstring). Returns the knob values with the
    compute and communication seconds of each, and the ceilings of the prediction."""
    fam = FAMILIES[family]
    info = rank_info()
    dev = torch.device(info.device)
    clk = clock_for(dev)
    n = info.world_size
    torch.manual_seed(info.rank)

    def reference(x: int):
        """The plain transfer that measures W at knob x, and its bytes sent."""
        return _reference(fam.wire, max(n, fam.message(x, n)) // n * n, n, dev)

    def link_roof(transfer, sent) -> float:
        dist.barrier()
        return sent / best_seconds(transfer, 3 * repeats, clk)   # short and the noisiest

    x = max(1, round(start if start is not None else fam.predict(200e9, 2e9, n)))
    for _ in range(2):                 # the GEMMs' rate depends on the shape: measure there
        C, W = slowest_rates(dev, _compute_roof(fam, x, n, dev, clk, repeats),
                        link_roof(*reference(x)))
        x = max(1, round(fam.predict(C, W, n)))
    transfer, sent = reference(x)
    links = [W]
    sweep = []
    for k in range(-spread, spread + 1):
        value = max(1, round(x * 2.0 ** k), sweep[-1][0] + 1 if sweep else 1)  # distinct
        compute, communicate = fam.step(value, n, dev)
        dist.barrier()
        tc = best_seconds(compute, repeats, clk)
        dist.barrier()
        tm = best_seconds(communicate, 3 * repeats, clk)
        sweep.append((value, tc, tm))
        links.append(link_roof(transfer, sent))   # W again, between the points
    # W: the median of the reference's rates before and between the points, so that a
    # burst of other work on the machine during one of them does not move the prediction
    (W,) = slowest_rates(dev, statistics.median(links))
    return {"family": family, "world": n, "flops": C, "link_bw": W,
            "predicted": fam.predict(C, W, n), "centre": x, "sweep": sweep}


def slowest(results: list[dict]) -> dict:
    """One record from every rank's: the slowest rank's seconds at each point."""
    first = dict(results[0])
    first["sweep"] = [(v, max(r["sweep"][i][1] for r in results),
                       max(r["sweep"][i][2] for r in results))
                      for i, (v, _, _) in enumerate(results[0]["sweep"])]
    return first


def report(result: dict, units: str = "") -> str:
    """The sweep as a table, the formula on the measured ceilings, and the verdict,
    each line computed from ``result``."""
    fam = FAMILIES[result["family"]]
    lines = [f"{fam.name}: {fam.knob} swept on {result['world']} ranks "
             f"(compute and communication of one step, each the fastest of several runs)"]
    power = fam.message_power(result["world"])
    smooth = smoothed(result["sweep"], power)
    for (v, tc, tm), (_, _, line) in zip(result["sweep"], smooth):
        side = "compute" if tc >= line else "communication"
        lines.append(f"  {fam.knob} = {v:6d}: compute {1e3 * tc:7.3f} ms, "
                     f"communication {1e3 * tm:7.3f} ms -> {side}-bound")
    lines.append("  the same tensors are sent at every point: their time is the median, "
                 f"{1e3 * smooth[0][2]:.3f} ms" if power == 0 else
                 "  the tensors sent grow with the knob: their time is read off one line "
                 "through the points (a fixed latency plus a cost per unit of the knob)")
    C, W = result["flops"], result["link_bw"]
    lines.append(f"  ceilings measured at the prediction: GEMMs {C / 1e9:.1f} GFLOP/s, "
                 f"link {W / 1e9:.2f} GB/s (ridge {C / W:,.0f} FLOPs per byte)")
    lines.append(f"  formula {fam.formula} on them: {result['predicted']:,.0f}{units}")
    measured = crossover(smooth)
    if measured is None:
        lines.append("  the two times did not cross inside the sweep: the machine was too "
                     "busy for a clean measurement; run the cell again")
    else:
        ratio = measured / result["predicted"]
        inside = 1 / TOLERANCE <= ratio <= TOLERANCE
        lines.append(f"  measured crossover: {measured:,.0f}{units}, {ratio:.2f} x the "
                     f"prediction, {'within' if inside else 'outside'} the factor "
                     f"{TOLERANCE} tolerance")
    return "\n".join(lines)
