"""FP8 (torch._scaled_mm) vs bf16 GEMM time, and FP8Linear vs nn.Linear fwd+bwd.

    python benchmarks/bench_fp8.py [--shapes auto|cpu|gpu] [--sizes 64 128 256] [--reps N]

On CPU ``_scaled_mm`` is a reference kernel: expect FP8 to be *slower* than bf16 there,
and slow in itself (a quarter of a second for one 256^3 GEMM on a laptop core), so the
CPU shapes (the default without CUDA) stop at 256^3 and one small layer. The GPU shapes
(the default on a CUDA GPU; ``--shapes gpu`` forces them) are 256-1024^3, 8192^3 and
five layers up to a 70B-class MLP. On a GPU with FP8 tensor cores (compute capability
>= 8.9) the script then prints a verdict against the course's target: FP8 >= 1.6x faster than
bf16 on an H100 (the peak rate ratio is 2x, 1979 vs 989 dense TFLOP/s for H100 SXM in
NVIDIA's H100 datasheet; 1.6x leaves room for what a real GEMM does not get).

Two FP8 columns: ``fp8`` accumulates as FP8Linear does (use_fast_accum=False: cuBLAS
periodically promotes the tensor cores' partial sums to full fp32), ``fp8 fast`` lets
the tensor cores accumulate alone (faster, less precise; torchao uses it for the
forward GEMM). Both are timed with CUDA events after warm-up, median of several
repeats; the operands are random (never zeros: they run faster than real data), FP8
scales are fp32 one-element tensors on the device, the second operand column-major,
as cuBLASLt requires. About 30 s on an H100, most of it allocation and warm-up.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _args import add_shapes_flag, shapes  # (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed
from helpers.precision import E4M3, FP8_GEMM, FP8Linear, scaled_mm_available

TARGET = 1.6        # FP8 / bf16 speed at 8192^3 on an H100
TARGET_N = 8192
# (in, out, tokens) of the layers timed on a GPU: a small MLP, square layers, a
# 70B-class MLP-up (8192 x 28672) and a long micro-batch
LAYERS = [(1024, 4096, 8192), (4096, 4096, 8192), (8192, 8192, 8192), (8192, 28672, 8192),
          (8192, 8192, 32768)]
# What FP8 training must give on an H100 to be worth teaching: faster on a large
# layer, and no slower on a mid-sized one.
LAYER_GOALS = {(8192, 28672, 8192): 1.3, (4096, 4096, 8192): 1.0}
# --shapes: GEMM sizes n (n^3) and layers; the CPU's stay under a second per call on a laptop
SIZES = {"gpu": [256, 512, 1024, TARGET_N], "cpu": [64, 128, 256]}
LAYER_SHAPES = {"gpu": LAYERS, "cpu": [(64, 128, 256)]}


def timeit(fn, reps: int, device: str, warmup: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``reps`` calls, in seconds."""
    for _ in range(warmup):                    # cuBLAS heuristics, handles, clocks, allocator
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()                  # device work is asynchronous: wait, then read
            times.append(start.elapsed_time(end) / 1e3 / reps)
        else:
            t0 = clock_for("cpu").mark()
            for _ in range(reps):
                fn()
            times.append(elapsed(t0, clock_for("cpu").mark()) / reps)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="GEMM sizes n (n^3); default by --shapes: 64 128 256 on cpu, "
                         "256 512 1024 8192 on gpu")
    add_shapes_flag(ap)
    ap.add_argument("--reps", type=int, default=None,
                    help="calls per timed repeat (default 3 on CPU, 20 on CUDA)")
    args = ap.parse_args(argv)
    kind = shapes(args)
    sizes = args.sizes if args.sizes is not None else SIZES[kind]
    if any(n < 16 or n % 16 for n in sizes):
        raise ValueError(f"--sizes must be multiples of 16 (cuBLAS FP8 GEMMs), got {sizes}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = args.reps if args.reps is not None else (20 if device == "cuda" else 3)
    if reps < 1:
        raise ValueError(f"--reps must be >= 1, got {reps}")
    warmup = 10 if device == "cuda" else 2
    if not scaled_mm_available(device):
        print(f"torch._scaled_mm with FP8 inputs is not available on {device} (on CUDA it "
              f"needs compute capability >= 8.9); nothing to time")
        return
    sizes = sorted(set(sizes))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, {kind} shapes, "
          f"median of 5 x {reps} calls")
    print(f"{'n (n^3 GEMM)':>12s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'fp8 fast ms':>12s} "
          f"{'fp8 speedup':>12s} {'fast speedup':>13s} {'bf16 TFLOP/s':>13s} "
          f"{'fp8 TFLOP/s':>12s} {'fast TFLOP/s':>13s}")
    one = torch.tensor(1.0, device=device)     # fp32 one-element scales, on the device
    ratios = {}
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        a = torch.randn(n, n, device=device, generator=g)
        b = torch.randn(n, n, device=device, generator=g)
        abf, bbf = a.bfloat16(), b.bfloat16()
        a8, b8 = a.to(E4M3), b.to(E4M3)        # randn: |x| < 448, no saturation
        del a, b
        bt8 = b8.t()                           # (K, N) column-major view: no copy
        t_bf = timeit(lambda: abf @ bbf.t(), reps, device, warmup)
        t_f8 = timeit(lambda: torch._scaled_mm(a8, bt8, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16), reps, device, warmup)
        t_ff = timeit(lambda: torch._scaled_mm(a8, bt8, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16, use_fast_accum=True),
                      reps, device, warmup)
        flops = 2 * n ** 3
        ratios[n] = (t_bf / t_f8, t_bf / t_ff)
        print(f"{n:12d} {t_bf * 1e3:9.3f} {t_f8 * 1e3:9.3f} {t_ff * 1e3:12.3f} "
              f"{t_bf / t_f8:11.2f}x {t_bf / t_ff:12.2f}x {flops / t_bf / 1e12:13.3g} "
              f"{flops / t_f8 / 1e12:12.3g} {flops / t_ff / 1e12:13.3g}")
        del abf, bbf, a8, b8, bt8
    # whole layers: quantize + 3 GEMMs + amax bookkeeping, forward and backward
    layers = LAYER_SHAPES[kind]
    print(f"\n{'layer in x out, tokens':>24s} {'nn.Linear bf16':>15s} {'FP8Linear':>10s} "
          f"{'fused':>8s} {'FP8Linear speed':>16s} {'fused speed':>12s}   (fwd+bwd, ms)")
    layer_ratios = {}
    for k, n, tokens in layers:
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        lin = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        times = []
        for layer in (lin, FP8Linear.from_linear(lin), FP8Linear.from_linear(lin, fused=True)):
            FP8_GEMM.clear()
            times.append(timeit(lambda: layer(x).sum().backward(), reps, device, warmup))
        t_lin, t_f8l, t_fused = times
        layer_ratios[(k, n, tokens)] = (t_lin / t_f8l, t_lin / t_fused)
        print(f"{f'{k} x {n}, {tokens // 1024}k' if tokens >= 1024 else f'{k} x {n}, {tokens}':>24s} "
              f"{t_lin * 1e3:15.2f} {t_f8l * 1e3:10.2f} {t_fused * 1e3:8.2f} "
              f"{t_lin / t_f8l:15.2f}x {t_lin / t_fused:11.2f}x")
        del x, lin
    print(f"(GEMM paths of the last layer: {dict(FP8_GEMM)}; 'fused': cast and amax of each "
          f"operand in one torch.compile'd kernel)")
    if device == "cuda":
        for shape, want in LAYER_GOALS.items():
            if shape not in layer_ratios:  # (--shapes cpu on a GPU: not timed)
                continue
            best = max(layer_ratios[shape])
            print(f"FP8Linear at {shape[0]} x {shape[1]}, {shape[2] // 1024}k tokens: "
                  f"{best:.2f}x bf16 (goal >= {want}x): {'met' if best >= want else 'NOT met'}")
    if device == "cuda" and TARGET_N in ratios:
        precise, fast = ratios[TARGET_N]
        verdict = lambda r: "MET" if r >= TARGET else "NOT MET"  # noqa: E731
        print(f"\nAt {TARGET_N}^3 on {name}: FP8 >= {TARGET}x faster than bf16 "
              f"(the goal is stated for an H100)")
        print(f"  fp8 (use_fast_accum=False, as FP8Linear): {precise:.2f}x  {verdict(precise)}")
        print(f"  fp8 (use_fast_accum=True):                {fast:.2f}x  {verdict(fast)}")


if __name__ == "__main__":
    main()
