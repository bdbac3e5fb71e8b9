"""BucketedDDP vs torch DistributedDataParallel step time, and the bucket-size trade-off.

    python benchmarks/bench_ddp.py [--size small] [--ranks 2] [--steps 12]

Same model, same data, same bucket caps, 2 ranks, one launch. Variants are
interleaved step by step (A B C ... A B C ...) so that a busy machine slows all
alike; each reports the median step (forward + backward + SGD step).
Target (issue 3): BucketedDDP / DDP <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _args import at_least, validate  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402


def _bench(size: str, steps: int, micro: int, seq: int, cap_mb: float) -> dict:
    import torch.distributed as dist

    from helpers.data import make_dataset
    from helpers.ddp import BucketedDDP
    from helpers.naive_dp import average_gradients
    from helpers.model import build_model

    r = rank_info().rank
    device = rank_info().device
    p = rank_info().world_size
    data = make_dataset(seq_len=seq, num_sequences=p * micro)  # one micro-batch per rank
    x, y = (t.to(device) for t in data.batch(range(micro * r, micro * (r + 1))))

    def make(kind):
        m = build_model(size, seed=0, device=device, block_size=max(seq, 32))
        if kind == "torch DDP":
            return torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=cap_mb)
        if kind == "BucketedDDP":
            return BucketedDDP(m, bucket_cap_mb=cap_mb)
        if kind == "one bucket (after backward)":
            return BucketedDDP(m, bucket_cap_mb=1e6, first_bucket_mb=1e6)
        if kind == "one all-reduce per parameter":
            return BucketedDDP(m, bucket_cap_mb=0, first_bucket_mb=0)
        return m  # naive: average_gradients after backward

    kinds = ["torch DDP", "BucketedDDP", "one bucket (after backward)",
             "one all-reduce per parameter", "naive DP (helpers.naive_dp)"]
    models = {k: make(k) for k in kinds}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times = {k: [] for k in kinds}
    for step in range(steps + 2):
        for k in kinds:
            m, opt = models[k], opts[k]
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = clock_for(x).mark()
            opt.zero_grad(set_to_none=True)
            loss = m(x, y)[1]
            loss.backward()
            if k.startswith("naive"):
                average_gradients(m)
            opt.step()
            # on a GPU the end mark is an event after the step's kernels and all-reduces
            dt = torch.tensor([elapsed(t0, clock_for(x).mark())], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 2:  # two warm-up steps
                times[k].append(float(dt))
    n_params = sum(p.numel() for p in models["BucketedDDP"].parameters())
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "n_params": n_params, "n_buckets": len(models["BucketedDDP"].buckets)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--cap-mb", type=float, default=25)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args(argv)
    # Every check before any rank starts (starting ranks costs seconds).
    try:
        validate(args)  # --size, --seq, --steps
        at_least(args, "ranks", 2, "data parallelism on one rank has nothing to average")
        at_least(args, "micro", 1, "sequences per rank per step")
        at_least(args, "cap-mb", 0, "bucket cap in megabytes; 0 = one bucket per parameter")
    except ValueError as e:
        ap.error(str(e))
    t0 = time.perf_counter()
    res = launch(_bench, args.ranks, args.size, args.steps, args.micro, args.seq, args.cap_mb,
                 backend=args.backend, timeout=900)[0]
    med = res["median"]
    base = med["torch DDP"]
    print(f"model {args.size!r}: {res['n_params']:,} parameters "
          f"({4 * res['n_params'] / 2 ** 20:.1f} MB of fp32 gradients), {args.ranks} ranks, "
          f"micro-batch {args.micro} x {args.seq} tokens, bucket cap {args.cap_mb} MB "
          f"-> {res['n_buckets']} buckets; median of {args.steps} steps, slowest rank")
    print(f"{'variant':32s} {'step ms':>9} {'vs torch DDP':>13}")
    for k, v in med.items():
        print(f"{k:32s} {v * 1e3:9.2f} {v / base:13.3f}")
    ratio = med["BucketedDDP"] / base
    print(f"BucketedDDP / DistributedDataParallel = {ratio:.3f} "
          f"(target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
