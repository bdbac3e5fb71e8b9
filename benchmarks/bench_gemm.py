"""GEMM throughput for the shapes of a tensor-parallel layer, on the GPU at hand.

    python benchmarks/bench_gemm.py [--shapes auto|cpu|gpu] [--hidden 4096 8192]
                                    [--tokens 2048 8192] [--tp 1 2 4 8] [--reps 10]
                                    [--out helpers/costs/measured/<gpu>_tp_gemm_shapes.csv]

For each hidden size, micro-batch token count and TP size it times the four weight
GEMMs of one Megatron layer on one TP rank (``helpers.costs.gemm.layer_gemms``: QKV
and MLP-up with N cut by t, attention-out and MLP-down with K cut by t) in bf16, and
in FP8 through ``torch._scaled_mm`` where the GPU has FP8 tensor cores, and prints
TFLOP/s, the fraction of the peak you give with ``--peak-tflops``, and the ratio the
table is for: each GEMM's bf16 rate over the same GEMM's at TP 1 (how much of the
GEMMs' speed a cut of t keeps: smaller GEMMs fill the GPU less). With ``--out``
it writes the CSV that ``helpers.costs.gemm.GemmTable`` reads (add it to ``TABLES``
there with the date), the format of the stored H100 table.

Times: the rank's clock (``helpers.clock``: CUDA events on a GPU), median of 5
repeats of ``--reps`` calls after warm-up; operands random (zeros run faster than
data). Sizes by ``--shapes``: a GPU's (hidden 4096 and 8192, 2k and 8k tokens, TP 1-8:
minutes on an H100, the default where torch sees CUDA) or a CPU's (hidden 512 and 1024,
256 tokens, TP 1-4, 2 calls a repeat: seconds on a laptop, the default elsewhere); each
of ``--hidden``, ``--tokens``, ``--tp``, ``--reps`` given overrides its default. On CPU
it measures the CPU's bf16 GEMMs (the FP8 column is left empty: nan): a smoke test of
the script, not a figure for the planner.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

from _args import add_shapes_flag, shapes  # (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed
from helpers.costs.gemm import layer_gemms
from helpers.modelspec import ModelSpec
from helpers.precision import E4M3, scaled_mm_available

# --shapes: what each flag defaults to
DEFAULTS = {"gpu": {"hidden": [4096, 8192], "tokens": [2048, 8192], "tp": [1, 2, 4, 8], "reps": 10},
            "cpu": {"hidden": [512, 1024], "tokens": [256], "tp": [1, 2, 4], "reps": 2}}

COLUMNS = ["gpu", "torch", "hidden", "tokens", "tp", "layer", "m", "k", "n",
           "bf16_tflops", "fp8_tflops"]


def median_seconds(fn, reps: int, device: torch.device, repeats: int = 5) -> float:
    for _ in range(3):                          # cuBLAS heuristics, workspace, clocks
        fn()
    clk, times = clock_for(device), []
    for _ in range(repeats):
        t0 = clk.mark()
        for _ in range(reps):
            fn()
        times.append(elapsed(t0, clk.mark()) / reps)
    return statistics.median(times)


def gemm_rates(m: int, k: int, n: int, device: torch.device, reps: int) -> tuple[float, float]:
    """(bf16, fp8) FLOP/s of (m, k) @ (k, n); fp8 is nan off CUDA (the CPU's _scaled_mm
    is a slow reference kernel, nothing to plan with) and where _scaled_mm cannot run."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)   # weights are (out, in)
    flops = 2 * m * k * n
    bf16 = flops / median_seconds(lambda: a @ b.t(), reps, device)
    fp8 = float("nan")
    if device.type == "cuda" and scaled_mm_available(device) and k % 16 == 0 and n % 16 == 0:
        a8, b8 = a.to(E4M3), b.to(E4M3)                          # b8.t(): column-major
        one = torch.tensor(1.0, device=device)
        fp8 = flops / median_seconds(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                     out_dtype=torch.bfloat16), reps, device)
    return bf16, fp8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=None)
    ap.add_argument("--heads-dim", type=int, default=128, help="head size (heads = hidden / this)")
    ap.add_argument("--reps", type=int, default=None)
    add_shapes_flag(ap)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak of this GPU, for the efficiency column (989 on H100 SXM)")
    ap.add_argument("--out", default=None, help="write the table here as CSV")
    args = ap.parse_args(argv)
    kind = shapes(args)
    for name, default in DEFAULTS[kind].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("hidden", "tokens", "tp"):
        if min(getattr(args, name)) < 1:
            raise ValueError(f"--{name} values must be >= 1, got {getattr(args, name)}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    tp1 = {}  # (hidden, tokens, layer) -> bf16 FLOP/s at TP 1
    print(f"{gpu}, torch {torch.__version__}, {kind} shapes, median of 5 x {args.reps} calls")
    print(f"{'hidden':>6} {'tokens':>6} {'tp':>3} {'layer':>9} {'m x k x n':>22} "
          f"{'bf16 TF/s':>10} {'fp8 TF/s':>9} {'bf16 / tp1':>10}"
          + (f" {'bf16 eff':>8}" if args.peak_tflops else ""))
    for h in args.hidden:
        if h % args.heads_dim:
            raise ValueError(f"--hidden {h} is not a multiple of --heads-dim {args.heads_dim}")
        model = ModelSpec(layers=1, hidden=h, heads=h // args.heads_dim, vocab=1, seq=1)
        for tokens in args.tokens:
            for tp in args.tp:
                for layer, m, k, n in layer_gemms(model, tp, tokens):   # refuses a bad tp
                    bf16, fp8 = gemm_rates(m, k, n, device, args.reps)
                    rows.append([gpu, torch.__version__, h, tokens, tp, layer, m, k, n,
                                 round(bf16 / 1e12, 1), round(fp8 / 1e12, 1)])
                    if tp == 1:
                        tp1[h, tokens, layer] = bf16
                    base = tp1.get((h, tokens, layer))
                    ratio = f"{bf16 / base:10.2f}" if base else f"{'-':>10}"
                    eff = f" {bf16 / 1e12 / args.peak_tflops:8.1%}" if args.peak_tflops else ""
                    print(f"{h:>6} {tokens:>6} {tp:>3} {layer:>9} {f'{m} x {k} x {n}':>22} "
                          f"{bf16 / 1e12:>10.3g} {fp8 / 1e12:>9.3g} {ratio}{eff}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            csv.writer(f).writerows([COLUMNS, *rows])
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
