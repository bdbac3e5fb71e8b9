"""Matmul efficiency by shape: measured GEMM throughput instead of one assumed figure.

A GEMM's achieved FLOP/s depends on its shape. Tensor parallelism cuts each
layer's weight matrices into thinner shards (attention's output projection at
TP 8 on hidden 4096 multiplies by a 512-wide slice), and a smaller micro-batch
gives fewer rows; both leave tensor cores waiting on memory. A planner that
prices every layout at one efficiency cannot see that, so it cannot rank a
layout with thin TP shards against one without them honestly.

``GemmTable`` holds throughput measured on one GPU for the four GEMMs of a
Megatron tensor-parallel layer (QKV and MLP-up column-parallel: N cut by t;
attention-out and MLP-down row-parallel: K cut by t; Shoeybi et al. 2019,
sec. 3) at several hidden sizes, token counts and TP sizes. ``rate`` prices a
shape at the measured shape nearest to it (distance: the sum of squared log
ratios of M, K and N; ``nearest`` shows which row that was), and
``matmul_efficiency`` turns a layer's four GEMMs into one achieved fraction of
peak: the FLOPs-weighted harmonic mean, i.e. total FLOPs / total seconds.

What it leaves out, and so why a planner using it still overshoots a
published MFU: the backward's two GEMMs per forward GEMM are priced at the
forward shape's rate (their shapes are the same three sizes permuted);
attention's own matmuls (scores and their product with V, run by fused
attention kernels) are not in the table and keep an assumed rate; and the
memory-bound work between GEMMs (norms, activations, softmax, optimizer) is
not priced at all.

Tables live in ``helpers/costs/measured/`` (CSV), each with the GPU, the torch
build and the date it was measured; ``benchmarks/bench_gemm.py`` measures a new
one on the GPU at hand in the same format.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helpers.modelspec import ModelSpec

__all__ = ["GemmRow", "GemmTable", "TABLES", "layer_gemms", "matmul_efficiency"]

MEASURED = Path(__file__).with_name("measured")
# name -> (file, when and how it was measured: the CSV carries GPU and torch per row)
TABLES = {
    "h100": ("h100_tp_gemm_shapes.csv",
             "2026-11-24, one H100 80GB HBM3, torch 2.11.0+cu130, CUDA events, median of 5"),
}


@dataclasses.dataclass(frozen=True)
class GemmRow:
    """One measured GEMM: (m, k) @ (k, n) at ``bf16`` and ``fp8`` FLOP/s."""

    layer: str
    m: int
    k: int
    n: int
    bf16: float
    fp8: float


# eq=False: a table is itself (hashed by identity), so caches keyed on it (the
# planner's, per TP size and micro-batch) do not hash every row on each lookup
@dataclasses.dataclass(frozen=True, eq=False)
class GemmTable:
    gpu: str
    torch: str
    measured: str
    rows: tuple[GemmRow, ...]

    @classmethod
    @functools.lru_cache(maxsize=None)
    def load(cls, name: str = "h100") -> "GemmTable":
        if name not in TABLES:
            raise ValueError(f"no measured GEMM table {name!r}; have {sorted(TABLES)}")
        file, measured = TABLES[name]
        return cls.from_csv(MEASURED / file, measured)

    @classmethod
    def from_csv(cls, path: str | Path, measured: str = "") -> "GemmTable":
        """A table in ``benchmarks/bench_gemm.py``'s format; ``measured``: when and how."""
        with open(path, newline="") as f:
            raw = list(csv.DictReader(f))
        # One shape can appear under two names (attention-out at TP 1 is MLP-up at TP 4
        # on hidden 4096): measured twice, it is priced at the mean of the two.
        shapes: dict[tuple[int, int, int], list[dict]] = {}
        for r in raw:
            shapes.setdefault((int(r["m"]), int(r["k"]), int(r["n"])), []).append(r)
        rows = tuple(GemmRow("/".join(r["layer"] for r in rs), m, k, n,
                             _mean(rs, "bf16_tflops") * 1e12, _mean(rs, "fp8_tflops") * 1e12)
                     for (m, k, n), rs in shapes.items())
        return cls(raw[0]["gpu"], raw[0]["torch"], measured, rows)

    def nearest(self, m: int, k: int, n: int) -> GemmRow:
        """The measured GEMM closest in shape: least sum of squared log ratios of m, k, n
        (a GEMM twice as tall is as far as one twice as wide)."""
        if min(m, k, n) < 1:
            raise ValueError(f"GEMM sizes must be positive, got m={m}, k={k}, n={n}")

        def distance(r: GemmRow) -> float:
            return sum(math.log(a / b) ** 2 for a, b in ((m, r.m), (k, r.k), (n, r.n)))
        return min(self.rows, key=distance)

    def rate(self, m: int, k: int, n: int, dtype: str = "bf16") -> float:
        """Achieved FLOP/s of an (m, k) @ (k, n) GEMM, from the nearest measured shape."""
        if dtype not in ("bf16", "fp8"):
            raise ValueError(f"dtype must be 'bf16' or 'fp8', got {dtype!r}")
        return getattr(self.nearest(m, k, n), dtype)


def _mean(rows: list[dict], column: str) -> float:
    return sum(float(r[column]) for r in rows) / len(rows)


def layer_gemms(model: "ModelSpec", tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of one transformer layer's four weight GEMMs on one TP rank, forward,
    for a micro-batch of ``tokens`` tokens (m: the rows every rank multiplies, the whole
    micro-batch's tokens also under sequence parallelism, which all-gathers them first)."""
    h, ffn = model.hidden, model.ffn_hidden
    head_dim = h // model.heads
    for what, size in (("hidden", h), ("heads", model.heads), ("ffn", ffn)):
        if size % tp:
            raise ValueError(f"{what} {size} does not divide over tensor-parallel size {tp}")
    # K/V heads: split over the ranks, or replicated when there are fewer than tp
    # (Megatron's GQA under TP: every rank keeps at least one K/V head)
    kv_per_rank = -(-model.n_kv_heads // tp)
    qkv = (model.heads // tp + 2 * kv_per_rank) * head_dim
    up = ffn * (2 if model.gated_mlp else 1)     # SwiGLU: gate and up projections side by side
    return [("qkv", tokens, h, qkv), ("attn_out", tokens, h // tp, h),
            ("mlp_up", tokens, h, up // tp), ("mlp_down", tokens, ffn // tp, h)]


def matmul_efficiency(model: "ModelSpec", tp: int, tokens: int, table: GemmTable,
                      peak_flops: float, dtype: str = "bf16") -> float:
    """Achieved fraction of ``peak_flops`` over a layer's four weight GEMMs: their FLOPs
    over the seconds each takes at its measured rate (a FLOPs-weighted harmonic mean)."""
    gemms = layer_gemms(model, tp, tokens)
    flops = [2 * m * k * n for _, m, k, n in gemms]
    seconds = sum(f / table.rate(m, k, n, dtype) for f, (_, m, k, n) in zip(flops, gemms))
    return sum(flops) / seconds / peak_flops
