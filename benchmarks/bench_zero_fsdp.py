"""ZeRO stages and FSDP: measured bytes per rank, step time against PyTorch's FSDP2,
and exposed communication with prefetch on and off. Ratios from one run.

    python benchmarks/bench_zero_fsdp.py [--size tiny] [--steps 10]

Bytes are measured from the tensors each rank holds (``ZeroOptimizer.state_bytes``)
in the ZeRO paper's mixed precision (bf16 weights/grads, fp32 master + Adam).
Step time is the median over steps after a warm-up, forward + backward + optimizer.
On a CPU with gloo the times measure Python hooks and gloo latency more than
bandwidth; run on GPUs (nccl) for bandwidth-bound numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from _args import validate  # noqa: E402  (benchmarks/ is on sys.path)
from helpers import launch, rank_info  # noqa: E402
from helpers.memory import model_state_bytes  # noqa: E402
from helpers.model import build_model  # noqa: E402


def state_bytes(size):
    from helpers.zero import ZeroOptimizer
    r = rank_info()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(r.rank))
    out = {}
    for stage in range(4):
        model = build_model(size, seed=0).to(torch.bfloat16)
        opt = ZeroOptimizer(model, stage, precision="bf16")
        model(x, x)[1].backward()
        opt.step()
        out[stage] = (opt.state_bytes().total, sum(p.numel() for p in opt.params),
                      opt.comm_bytes()["total"])
    return out


def step_time(kind, size, seq, steps):
    r = rank_info()
    model = build_model(size, seed=0)
    tl = None
    if kind.startswith("zero3"):
        from helpers.zero import ZeroOptimizer
        # "zero3": one collective per module; "zero3-ds": DeepSpeed's default
        # stage3_prefetch_bucket_size, stage3_max_reuse_distance, reduce_bucket_size
        # "zero3-block": windows of one transformer block, nothing kept for reuse
        # (full weights held: about two blocks at a time, like FSDP with prefetch)
        block = sum(p.numel() for p in model.blocks[0].parameters())
        knobs = {"zero3-ds": dict(prefetch_bucket_numel=5 * 10**7, max_reuse_numel=10**9,
                                  reduce_bucket_numel=5 * 10**8),
                 "zero3-block": dict(prefetch_bucket_numel=block, reduce_bucket_numel=block),
                 }.get(kind, {})
        wrapped, opt = model, ZeroOptimizer(model, 3, lr=1e-3, **knobs)
    elif kind.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        for blk in model.blocks:
            fully_shard(blk)
        wrapped = fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif kind.startswith("fsdp"):
        from helpers.fsdp import FSDP
        from helpers.overlap import Timeline
        tl = Timeline()
        wrapped = FSDP(model, prefetch=kind != "fsdp-noprefetch", timeline=tl)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    else:
        from helpers.ddp import BucketedDDP
        wrapped = BucketedDDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(r.rank))
    times, exposed = [], []
    for _ in range(steps):
        if tl is not None:
            tl.clear()
        t0 = time.perf_counter()
        wrapped(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if tl is not None:
            exposed.append(tl.exposed_comm()["exposed"])
    med = lambda v: sorted(v[1:])[len(v[1:]) // 2] if v else float("nan")  # noqa: E731
    return {"step": med(times), "exposed": med(exposed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    validate(args)

    print(f"Per-rank model-state bytes, measured ({args.size}, bf16 mixed precision)")
    print(f"{'N':>3} {'stage':>6} {'measured kB':>12} {'formula kB':>11} {'ratio':>6} "
          f"{'sent kB':>8} {'x DP':>5}")
    for world in (2, 4):
        res = launch(state_bytes, world, args.size, timeout=300)[0]
        dp_comm = res[0][2]
        for stage, (total, n, comm) in res.items():
            want = model_state_bytes(n, dp=world, zero_stage=stage).total
            print(f"{world:>3} {('DP' if stage == 0 else stage):>6} {total / 1e3:12.1f} "
                  f"{want / 1e3:11.1f} {total / want:6.3f} {comm / 1e3:8.1f} "
                  f"{comm / dp_comm:5.2f}")

    print(f"\nStep time, 2 ranks, {args.size}, seq {args.seq}, median of {args.steps - 1} steps")
    kinds = ["ddp", "fsdp2", "zero3", "zero3-block", "zero3-ds", "fsdp", "fsdp-noprefetch"]
    res = {k: launch(step_time, 2, k, args.size, args.seq, args.steps, timeout=300)[0]
           for k in kinds}
    base = res["fsdp2"]["step"]
    for k in kinds:
        extra = ""
        if k.startswith("fsdp") and k != "fsdp2":
            extra = f"   exposed comm {res[k]['exposed'] * 1e3:6.1f} ms"
        print(f"{k:16s} {res[k]['step'] * 1e3:8.1f} ms   {res[k]['step'] / base:5.2f} x FSDP2{extra}")
    print("zero3: one gather/free per module; zero3-block: + prefetch and reduce buckets of one"
          " block;\nzero3-ds: DeepSpeed's default prefetch (5e7), reuse distance (1e9) and reduce"
          " bucket (5e8 elements),\n  which hold the whole toy model gathered through the step")


if __name__ == "__main__":
    main()
