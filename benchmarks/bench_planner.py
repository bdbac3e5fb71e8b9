"""How long the planner takes to enumerate, check, estimate and rank every layout.

    python benchmarks/bench_planner.py [--gpus 8,64,512,1024,16384] [--reps 3]

For each cluster size (DGX H100-like nodes of 8 GPUs) the 70B model of chapter 20
(Llama 2 70B's shape, 4096 tokens, global batch 1024 sequences) is planned from
cold caches ``--reps`` times; the table gives the median wall time, the CPU
time of this process (what the planner itself costs on a machine shared with
other work), candidates examined and microseconds per candidate. There is no
PyTorch built-in to compare with; the ratio that matters is to the budget:
a full enumeration for 1024 GPUs should take under a second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers import costs, planner  # noqa: E402
from helpers.topology import h100_cluster  # noqa: E402

MODEL = planner.ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                          ffn=28672, kv_heads=8, gated_mlp=True)
BUDGET_S = 1.0   # full enumeration for 1024 GPUs


def _gpus(text: str) -> list[int]:
    try:
        counts = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus must be comma-separated ints, got {text!r}") from None
    bad = [c for c in counts if c < 8 or c % 8]
    if not counts or bad:
        raise ValueError(f"--gpus must be multiples of 8 (whole 8-GPU nodes), got {bad or text!r}")
    return counts


def _cold_plan(gpus: int) -> tuple[float, float, planner.Ranking]:
    costs.clear_caches()   # placements, collectives, model state, activations
    wall, cpu = time.perf_counter(), time.process_time()
    p = planner.plan(MODEL, 1024, planner.H100_80GB, h100_cluster(gpus // 8))
    return time.perf_counter() - wall, time.process_time() - cpu, p


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8,64,512,1024,16384")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    counts = _gpus(args.gpus)
    at_least(args, "reps", 1, "a median needs one run")
    print(f"planner on {MODEL.name} (global batch 1024 x {MODEL.seq} tokens), H100 nodes; "
          f"median of {args.reps} cold runs")
    print(f"{'GPUs':>6}{'candidates':>12}{'feasible':>10}{'wall s':>9}{'CPU s':>8}"
          f"{'us/cand':>9}  best layout")
    for gpus in counts:
        runs = [_cold_plan(gpus) for _ in range(args.reps)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        p = runs[-1][2]
        n = len(p.ranked) + len(p.rejected)
        best = p.best.layout.short() if p.ranked else "none fits"
        print(f"{gpus:>6}{n:>12}{len(p.ranked):>10}{wall:>9.3f}{cpu:>8.3f}{1e6 * cpu / n:>9.1f}"
              f"  {best}")
        if gpus == 1024:
            verdict = "within" if cpu < BUDGET_S else "over"
            print(f"        1024 GPUs: {cpu:.3f} s of CPU, {verdict} the {BUDGET_S:g} s budget")


if __name__ == "__main__":
    main()
