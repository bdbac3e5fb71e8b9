"""Pipeline schedules on real ranks: measured bubble vs the formula, and our executor's
step time vs torch.distributed.pipelining on the same split.

    python benchmarks/bench_pipeline.py [--size tiny] [--stages 2] [--steps 3]

Table 1: for GPipe, 1F1B and interleaved 1F1B (v = 2), m = p .. 8p micro-batches,
the bubble measured from the ranks' timelines (median over the timed steps) next to
(p-1)/(v*m+p-1) (Huang et al. 2019; Narayanan et al. 2021). Table 2: median step
time of our executor and of PyTorch's ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B with the same stage modules, and their ratio.

Use p <= CPU cores: with more ranks than cores, ranks queue for a core and the
timelines measure the scheduler, not the pipeline. The machine's load average is
printed first for the same reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import pathlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from helpers import launch  # noqa: E402
from helpers.pipeline import bubble_formula  # noqa: E402
from helpers.pipeline.measure import median_bubble, time_schedule  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # "tiny" with 16 x 64-token micro-batches: enough compute per action that one
    # gloo message (~0.15 ms on loopback) is small beside it
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    p = args.stages
    common = dict(size=args.size, n_layer=args.n_layer, microbatch_size=args.microbatch_size,
                  seq_len=args.seq_len, steps=args.steps)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; p = {p} ranks, "
          f"model {args.size} n_layer={args.n_layer}, micro-batch {args.microbatch_size} x "
          f"{args.seq_len} tokens")

    print("\nbubble fraction: measured on real ranks vs (p-1)/(v*m+p-1)")
    print(f"{'schedule':14s} {'m':>3s} {'measured':>9s} {'formula':>8s} {'diff':>6s} "
          f"{'step ms':>8s}")
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        for m in (p, 2 * p, 4 * p, 8 * p):
            res = launch(time_schedule, p, kind, m, v, timeout=300, **common)
            bubble, _ = median_bubble(res)
            want = bubble_formula(p, m, v)
            print(f"{kind + (f' v={v}' if v > 1 else ''):14s} {m:3d} {bubble:9.3f} {want:8.3f} "
                  f"{bubble - want:+6.3f} {1e3 * res[0]['step_time']:8.1f}", flush=True)

    m = 4 * p
    print(f"\nstep time, m = {m}: our executor vs torch.distributed.pipelining (same split)")
    print(f"{'schedule':14s} {'ours ms':>8s} {'torch ms':>9s} {'ours/torch':>10s} {'same loss':>9s}")
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        ours = launch(time_schedule, p, kind, m, v, engine="ours", timeout=300, **common)
        theirs = launch(time_schedule, p, kind, m, v, engine="torch", timeout=300, **common)
        a, b = ours[0]["step_time"], theirs[0]["step_time"]
        same = abs(ours[-1]["loss"] - theirs[-1]["loss"]) <= 1e-5 * abs(ours[-1]["loss"])
        print(f"{kind + (f' v={v}' if v > 1 else ''):14s} {1e3 * a:8.1f} {1e3 * b:9.1f} "
              f"{a / b:10.2f} {str(same):>9s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
