"""FP8 (torch._scaled_mm) vs bf16 GEMM time, and FP8Linear vs nn.Linear fwd+bwd.

    python benchmarks/bench_fp8.py [--sizes 256 512 1024] [--reps 5]

On CPU ``_scaled_mm`` is a reference kernel: expect FP8 to be *slower* than bf16 there.
On a CUDA GPU with FP8 tensor cores (H100) the same script also runs 8192^3, where the
target is FP8 >= 1.6x faster than bf16 (peak rate ratio 2x, Hopper whitepaper).
"""

from __future__ import annotations

import argparse
import time

import torch

from helpers.precision import E4M3, FP8Linear, scaled_mm_available


def timeit(fn, reps: int, device: str) -> float:
    for _ in range(2):                             # warm-up (threads, kernel choice, allocation)
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = list(args.sizes) + ([8192] if device == "cuda" and 8192 not in args.sizes else [])
    if not scaled_mm_available(device):
        print(f"torch._scaled_mm with FP8 inputs is not available on {device}; nothing to time")
        return
    print(f"device {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    print(f"{'n (n x n x n)':>14s} {'bf16 ms':>9s} {'fp8 ms':>9s} {'fp8 speedup':>12s} "
          f"{'bf16 TFLOP/s':>13s} {'fp8 TFLOP/s':>12s}")
    one = torch.tensor(1.0, device=device)
    for n in sizes:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        abf, bbf = a.bfloat16(), b.bfloat16()
        a8, b8 = a.to(E4M3), b.to(E4M3)
        t_bf = timeit(lambda: abf @ bbf.t(), args.reps, device)
        t_f8 = timeit(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16), args.reps, device)
        flops = 2 * n ** 3
        print(f"{n:14d} {t_bf * 1e3:9.2f} {t_f8 * 1e3:9.2f} {t_bf / t_f8:11.2f}x "
              f"{flops / t_bf / 1e12:13.3f} {flops / t_f8 / 1e12:12.3f}")
    # a whole layer: quantize + 3 GEMMs + amax bookkeeping, forward and backward
    n = 1024 if device == "cuda" else 256
    x = torch.randn(8 * n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    lin = torch.nn.Linear(n, 4 * n, device=device, dtype=torch.bfloat16)
    f8 = FP8Linear.from_linear(lin)

    def fwd_bwd(layer):
        return lambda: layer(x).sum().backward()

    t_lin = timeit(fwd_bwd(lin), args.reps, device)
    t_f8l = timeit(fwd_bwd(f8), args.reps, device)
    print(f"\nlayer {n} -> {4 * n}, {8 * n} tokens, forward+backward: nn.Linear bf16 "
          f"{t_lin * 1e3:.2f} ms, FP8Linear {t_f8l * 1e3:.2f} ms ({t_lin / t_f8l:.2f}x)")


if __name__ == "__main__":
    main()
