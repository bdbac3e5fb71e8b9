"""Our ring all-reduce vs the backend's own all_reduce: busbw over 1 KB..64 MB, fitted alpha/beta.

    python benchmarks/bench_collectives.py [--ranks 2] [--iters 10] [--max-mb 64]

Both run in the same launch, size by size, alternating, so that a busy machine
slows both alike. busbw = algbw * 2(p-1)/p (nccl-tests doc/PERFORMANCE.md).
Target (issue 3): ring/backend busbw >= 0.8 for messages >= 16 MB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers import launch  # noqa: E402
from helpers.collectives import check_sweep_args, fit_alpha_beta, sweep  # noqa: E402

WARMUP = 2  # untimed calls per size and implementation


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-mb", type=int, default=64)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args(argv)
    # Every check before any rank starts (starting ranks costs seconds).
    try:
        at_least(args, "ranks", 2, "one rank sends nothing, and the alpha/beta fit needs p >= 2")
        at_least(args, "iters", 1, "timed calls per size; the table shows their median")
        at_least(args, "max-mb", 1, "the sweep runs 1 KB, 4 KB, ... up to --max-mb")
        sizes = [2 ** k for k in range(10, 21 + (args.max_mb.bit_length() - 1) + 1, 2)
                 if 2 ** k <= args.max_mb * 2 ** 20]
        check_sweep_args(sizes, ("ring", "torch"), args.iters, WARMUP)
    except ValueError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    rows = launch(sweep, args.ranks, sizes, ("ring", "torch"), args.iters, WARMUP,
                  backend=args.backend, timeout=600)[0]
    p = args.ranks
    print(f"all-reduce on {p} ranks, {args.iters} iterations per size (median, slowest rank)")
    print(f"{'bytes':>12} {'ring ms':>9} {'backend ms':>11} {'ring busbw':>11} "
          f"{'backend busbw':>14} {'ratio':>6}")
    for n in sizes:
        a = next(r for r in rows if r["impl"] == "ring" and r["nbytes"] == n)
        b = next(r for r in rows if r["impl"] == "torch" and r["nbytes"] == n)
        print(f"{n:12,d} {a['time_s'] * 1e3:9.3f} {b['time_s'] * 1e3:11.3f} "
              f"{a['busbw'] / 1e9:8.3f} GB/s {b['busbw'] / 1e9:10.3f} GB/s "
              f"{a['busbw'] / b['busbw']:6.2f}")
    for impl in ("ring", "torch"):
        mine = [r for r in rows if r["impl"] == impl]
        alpha, beta = fit_alpha_beta([r["nbytes"] for r in mine], [r["time_s"] for r in mine], p)
        print(f"fit {impl:5s}: alpha = {alpha * 1e6:8.1f} us, beta = {beta / 1e9:6.2f} GB/s")
    big = [n for n in sizes if n >= 16 * 2 ** 20]
    if big:
        ratios = [next(r for r in rows if r["impl"] == "ring" and r["nbytes"] == n)["busbw"]
                  / next(r for r in rows if r["impl"] == "torch" and r["nbytes"] == n)["busbw"]
                  for n in big]
        print(f"ring/backend busbw at >= 16 MB: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(target >= 0.8: {'met' if min(ratios) >= 0.8 else 'NOT met'})")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
