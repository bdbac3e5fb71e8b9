"""Rooflines: when an operation, and each way of splitting a model, turns bandwidth-bound.

The roofline (Williams, Waterman & Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009) reads any
operation as two numbers, the FLOPs it does and the bytes it moves, and the
hardware as two ceilings, peak FLOP/s ``C`` and the bandwidth ``W`` of the wire
the bytes take. Its arithmetic intensity is I = FLOPs / bytes, and

    attainable FLOP/s = min(C, I x W)          ridge point: I* = C / W

Below the ridge the operation waits on the wire (bandwidth-bound), above it on
the arithmetic (compute-bound). The wire can be the memory (a GEMM reading its
operands from HBM) or a link between GPUs (a collective). "How to Scale Your
Model" (Austin et al., Google DeepMind 2025) builds every parallelism choice on
it: part 1 ("All About Rooflines") for one chip, part 5 ("How to Parallelize a
Transformer for Training") for each parallelism, where the FLOPs are the
layer's matmuls and the bytes are what the parallelism's collectives send.
If the two overlap, a step takes max(T_math, T_comm) and the parallelism stays
compute-bound while T_math > T_comm: its intensity above C / W.

Each parallelism's threshold, derived here from the byte counts of
``helpers.costs`` (``network.wire_factor``: the share of a tensor a rank sends in
each collective; the counts of ``axes``: how many collectives per layer or step)
and the FLOPs of ``compute`` (6 per weight per token: a forward and a backward of
twice its cost), for one GPU of peak ``C`` whose axis runs at ``W`` bytes/s each way:

    DP   tokens per DP rank per step  T > C/W x 2(n-1)/n x b_grad / 6
         (the gradients' all-reduce, once a step, against 6 P T FLOPs; with TP or
         PP inside the rank both sides shrink by tp x pp, so T counts the tokens
         of one model replica)
    ZeRO stages 1-2: the same bytes (reduce-scatter + all-gather = all-reduce);
         stage 3 (FSDP): 2 all-gathers + 1 reduce-scatter per micro-batch, so per
         micro-batch T > C/W x 3(n-1)/n x b / 6
    TP   hidden width h > C/W x 4 x 2(t-1)/t x b x t / (6 a)  (4 all-reduces of a
         token's h values per layer against 6 a h^2 / t FLOPs; a = layer weights
         / h^2, 12 for a GPT): independent of the batch
    CP   sequence per GPU s/c > C/W x b x (kv heads / heads) / 2, twice that
         causal (ring attention: a block of K and V, 2 (s/c) h_kv b bytes, per
         block of 4 (s/c)^2 h FLOPs; the backward doubles both; Liu, Zaharia &
         Abbeel 2023, sec. 3, size the blocks by the same condition)
    PP   compute / comm = 3 a h L_stage / b x W / C per micro-batch (an activation
         forward and a gradient back, 2 b h bytes a token, against 6 a h^2 L_stage
         FLOPs): with h in thousands it is compute-bound by a wide margin
    EP   expert width f > C/W x 4 (e-1)/e x b / (6 m)  (4 all-to-alls of each
         routed token, 4 (e-1)/e b h bytes, against 6 m h f FLOPs; m = 3 matrices
         for a gated MLP, 2 plain): top_k cancels

How the constants relate to the book's: the book writes W_ici both directions
and an all-reduce's time as 2 x bytes / W_ici, and compares DP's all-reduce with
the backward's FLOPs only (the window it can overlap), giving B/X > C/W_ici
(part 5, "Data Parallelism"); this module prices a ring as NCCL does
(``network``: 2(n-1)/n of the tensor at the bus bandwidth, one direction) and
compares with the step's 6 FLOPs per weight per token, the roofline's
max(compute, comm). Same shape, constants within a factor of two of each other.

How production differs: real steps reach the ceilings only in part (a GEMM at
60-75 % of the H100's datasheet peak, ``helpers.costs.gemm``; NCCL's bus bandwidth
about 80 % of NVLink's line rate, ``network``), latency adds a fixed cost the
roofline leaves out, and overlap is never perfect (chapter 16): a layout just
above its threshold is already slowed by its communication.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from helpers.costs.network import wire_factor
from helpers.topology.gpus import H100_80GB
from helpers.topology.links import IB_NDR, NVLINK4_H100
from helpers.validate import positive_int

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["Ceilings", "H100_SXM", "H200_SXM", "measured_h100_gemm", "gemm_flops",
           "gemm_bytes", "gemm_intensity", "gemm_time", "collective_intensity", "ridge", "attainable",
           "bound", "dp_tokens", "zero_tokens", "tp_hidden", "cp_tokens", "pp_ratio",
           "ep_ffn", "Threshold", "family_thresholds", "format_thresholds"]


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """One GPU's roofs: dense 16-bit ``flops`` (FLOP/s), HBM ``memory`` bandwidth and
    the bandwidth of its links each way (bytes/s): ``nvlink`` inside the node, its
    ``network`` NIC across nodes."""

    name: str
    flops: float
    memory: float
    nvlink: float
    network: float
    source: str = ""

    def ridge(self, bandwidth: float) -> float:
        """FLOPs per byte at which an operation on this wire turns compute-bound."""
        return ridge(self.flops, bandwidth)


# Dense BF16 and the links: the course's GPU and link tables (NVIDIA H100 datasheet:
# 989 TFLOP/s dense, NVLink 900 GB/s both ways; ConnectX-7 NDR 400 Gb/s per GPU).
# HBM: H100 SXM 3.35 TB/s (H100 datasheet), H200 SXM 4.8 TB/s and the same
# compute and NVLink (NVIDIA H200 datasheet, "1,979 TFLOPS" BF16 is with sparsity).
H100_SXM = Ceilings("H100 SXM", H100_80GB.peak_flops, 3.35e12, NVLINK4_H100.bandwidth,
                    IB_NDR.bandwidth, "NVIDIA H100 Tensor Core GPU datasheet")
H200_SXM = Ceilings("H200 SXM", H100_80GB.peak_flops, 4.8e12, NVLINK4_H100.bandwidth,
                    IB_NDR.bandwidth, "NVIDIA H200 Tensor Core GPU datasheet")


def measured_h100_gemm() -> float:
    """Median bf16 FLOP/s of the Megatron layer GEMMs measured on one H100
    (``helpers.costs.gemm``'s table): the compute roof a real layer meets."""
    from helpers.costs.gemm import GemmTable
    return statistics.median(r.bf16 for r in GemmTable.load("h100").rows)


# ---------------------------------------------------------------------------
# One operation
# ---------------------------------------------------------------------------

def gemm_flops(m: int, k: int, n: int) -> float:
    """(m, k) @ (k, n): a multiply and an add per output element per k."""
    return 2.0 * m * k * n


def gemm_bytes(m: int, k: int, n: int, dtype_bytes: float = 2) -> float:
    """Bytes a GEMM must move at least: read both operands, write the result once."""
    return dtype_bytes * (m * k + k * n + m * n)


def gemm_intensity(m: int, k: int, n: int, dtype_bytes: float = 2) -> float:
    """FLOPs per byte of memory traffic; about m when m << k, n (part 1 of the book:
    a bf16 matmul with a small batch of m tokens has intensity ~ m)."""
    return gemm_flops(m, k, n) / gemm_bytes(m, k, n, dtype_bytes)


def gemm_time(m: int, k: int, n: int, flops: float, memory_bw: float,
              dtype_bytes: float = 2) -> float:
    """Seconds of one GEMM on the roofline: its FLOPs at the compute roof or its bytes
    at the memory roof, whichever takes longer."""
    ridge(flops, memory_bw)
    return max(gemm_flops(m, k, n) / flops, gemm_bytes(m, k, n, dtype_bytes) / memory_bw)


def collective_intensity(flops: float, collective: str, nbytes: float, size: int) -> float:
    """FLOPs that run beside a collective per byte each rank sends in it
    (``network.wire_factor``: 2(n-1)/n of the tensor for an all-reduce, (n-1)/n else)."""
    positive_int("size", size)
    sent = wire_factor(collective, size) * nbytes
    if sent == 0:
        return float("inf")
    return flops / sent


def ridge(flops: float, bandwidth: float) -> float:
    """C / W: the intensity where the two roofs meet (Williams et al. 2009)."""
    if not flops > 0 or not bandwidth > 0:
        raise ValueError(f"peak FLOP/s and bandwidth must be > 0, got {flops!r}, {bandwidth!r}")
    return flops / bandwidth


def attainable(intensity: float, flops: float, bandwidth: float) -> float:
    """The roofline: min(C, I x W) FLOP/s."""
    ridge(flops, bandwidth)
    return min(flops, intensity * bandwidth)


def bound(intensity: float, flops: float, bandwidth: float) -> str:
    """"compute-bound" above the ridge, "bandwidth-bound" below (at it: compute)."""
    return "compute-bound" if intensity >= ridge(flops, bandwidth) else "bandwidth-bound"


# ---------------------------------------------------------------------------
# Each parallelism's threshold (the module docstring derives each)
# ---------------------------------------------------------------------------

FLOPS_PER_WEIGHT_TOKEN = 6   # forward 2 + backward 4 (Kaplan et al. 2020, sec. 2.1)


def dp_tokens(flops: float, bandwidth: float, dp: int, grad_bytes: float = 2) -> float:
    """Tokens per GPU per step above which data parallelism is compute-bound: the
    gradients' all-reduce, 2(n-1)/n x b P bytes, against 6 P T FLOPs."""
    positive_int("dp", dp)
    return ridge(flops, bandwidth) * wire_factor("all_reduce", dp) * grad_bytes \
        / FLOPS_PER_WEIGHT_TOKEN


def zero_tokens(flops: float, bandwidth: float, dp: int, zero: int,
                dtype_bytes: float = 2) -> float:
    """Tokens per GPU above which ZeRO stage ``zero`` is compute-bound: per step for
    stages 0-2 (all-reduce, or reduce-scatter + all-gather: the same bytes), per
    micro-batch for stage 3 (all-gather forward, again backward, reduce-scatter)."""
    positive_int("dp", dp)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if zero == 0:
        return dp_tokens(flops, bandwidth, dp, dtype_bytes)
    collectives = ("all_gather", "all_gather", "reduce_scatter") if zero == 3 \
        else ("reduce_scatter", "all_gather")
    per_weight = sum(wire_factor(c, dp) for c in collectives) * dtype_bytes
    return ridge(flops, bandwidth) * per_weight / FLOPS_PER_WEIGHT_TOKEN


def _weights_per_h2(model: "ModelSpec") -> float:
    """a: a layer's dense weights over h^2 (12 for a GPT: 4 h^2 attention + 8 h^2 MLP)."""
    return (model.attention_params() + model.mlp_params()) / model.hidden ** 2


def tp_hidden(flops: float, bandwidth: float, tp: int, weights_per_h2: float = 12,
              dtype_bytes: float = 2, all_reduces: int = 4) -> float:
    """Hidden width h above which tensor parallelism over ``tp`` GPUs is compute-bound:
    per token per layer ``all_reduces`` all-reduces of h values (2 forward, 2 backward;
    Shoeybi et al. 2019, sec. 3) against 6 a h^2 / tp FLOPs on each GPU."""
    positive_int("tp", tp)
    per_h = all_reduces * wire_factor("all_reduce", tp) * dtype_bytes
    return ridge(flops, bandwidth) * per_h * tp / (FLOPS_PER_WEIGHT_TOKEN * weights_per_h2)


def cp_tokens(flops: float, bandwidth: float, kv_share: float = 1.0, dtype_bytes: float = 2,
              causal: bool = True) -> float:
    """Sequence per GPU (s / cp) above which ring attention hides its K/V passing: a
    block of 2 (s/c) h kv_share b bytes per 4 (s/c)^2 h FLOPs (half of them causal, with
    the zigzag layout's equal work per GPU). ``kv_share``: kv_heads / heads."""
    return ridge(flops, bandwidth) * dtype_bytes * kv_share / 2 * (2 if causal else 1)


def pp_ratio(flops: float, bandwidth: float, hidden: int, layers_per_stage: float,
             weights_per_h2: float = 12, dtype_bytes: float = 2) -> float:
    """Compute / communication time of a pipeline stage per micro-batch: 6 a h^2 L FLOPs
    a token against its activation forward and gradient back, 2 b h bytes."""
    per_token_flops = FLOPS_PER_WEIGHT_TOKEN * weights_per_h2 * hidden ** 2 * layers_per_stage
    return per_token_flops / (2 * dtype_bytes * hidden) / ridge(flops, bandwidth)


def ep_ffn(flops: float, bandwidth: float, ep: int, gated: bool = True,
           dtype_bytes: float = 2) -> float:
    """Expert MLP width above which expert parallelism is compute-bound: each routed
    token copy crosses 4 all-to-alls (dispatch and combine, forward and backward), 4
    (e-1)/e b h bytes, and meets 6 m h f FLOPs in its expert (m = 3 gated, 2 plain)."""
    positive_int("ep", ep)
    matrices = 3 if gated else 2
    return ridge(flops, bandwidth) * 4 * wire_factor("all_to_all", ep) * dtype_bytes \
        / (FLOPS_PER_WEIGHT_TOKEN * matrices)


# ---------------------------------------------------------------------------
# A table of thresholds for one model on one GPU
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Threshold:
    """One family on one wire: the quantity that decides, the layout's value of it,
    the critical value, and ``ratio`` = compute time / communication time (> 1:
    compute-bound)."""

    family: str
    wire: str
    quantity: str
    value: float
    critical: float

    @property
    def ratio(self) -> float:
        return self.value / self.critical

    @property
    def verdict(self) -> str:
        return "compute-bound" if self.ratio >= 1 else "communication-bound"


def family_thresholds(model: "ModelSpec", gpu: Ceilings, *, tokens_per_gpu: float,
                      degree: int = 8, layers_per_stage: float | None = None,
                      flops: float | None = None) -> list[Threshold]:
    """Every family's threshold for ``model`` on ``gpu``, inside a node (NVLink) and
    across nodes (one NIC per GPU, a group strided one GPU per node), at ``degree``
    GPUs and ``tokens_per_gpu`` tokens per GPU per micro-batch. ``flops``: the compute
    roof (default the datasheet's peak; ``measured_h100_gemm()`` for a measured one)."""
    c = gpu.flops if flops is None else flops
    share = model.n_kv_heads / model.heads
    a = _weights_per_h2(model)
    lps = layers_per_stage or model.layers / degree
    rows = []
    for wire, w in (("NVLink", gpu.nvlink), ("network", gpu.network)):
        rows += [
            Threshold("DP", wire, "tokens/DP rank/step", tokens_per_gpu,
                      dp_tokens(c, w, degree)),
            Threshold("ZeRO-3/FSDP", wire, "tokens/rank/micro-batch", tokens_per_gpu,
                      zero_tokens(c, w, degree, 3)),
            Threshold("TP", wire, "hidden width", model.hidden,
                      tp_hidden(c, w, degree, a)),
            Threshold("CP (ring)", wire, "sequence/GPU", model.seq / degree,
                      cp_tokens(c, w, share)),
            Threshold("PP", wire, "compute/comm", pp_ratio(c, w, model.hidden, lps, a), 1.0),
        ]
        if model.experts:
            rows.append(Threshold("EP", wire, "expert width", model.ffn_hidden,
                                  ep_ffn(c, w, degree, model.gated_mlp)))
    return rows


def format_thresholds(rows: list[Threshold]) -> str:
    """The table: family, wire, the deciding quantity, its value, the threshold, and
    compute / comm (above 1: compute-bound)."""
    def num(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    out = [f"{'family':<13}{'wire':<9}{'quantity':<25}{'layout':>9}{'threshold':>11}"
           f"{'compute/comm':>14}  verdict"]
    for r in rows:
        out.append(f"{r.family:<13}{r.wire:<9}{r.quantity:<25}{num(r.value):>9}"
                   f"{num(r.critical):>11}{r.ratio:>14.2f}  {r.verdict}")
    return "\n".join(out)
