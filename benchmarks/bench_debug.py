"""What the collective recorder costs: a healthy DDP step with and without it.

    python benchmarks/bench_debug.py [--size small] [--ranks 2] [--steps 12]

Same model and data on every variant, one launch; variants interleaved step by
step (A B C D A B C D ...) so that a busy machine slows all alike; each reports
the median step (forward + backward + SGD step) of the slowest rank.

* torch DDP: PyTorch's DistributedDataParallel (the reference).
* BucketedDDP: the course's DDP (chapter 04), whose bucket all-reduces are
  Python calls of ``torch.distributed.all_reduce``.
* BucketedDDP + recorder: the same step inside ``record_collectives()``
  (entered and left every step, so installing the wrappers is counted too);
  every bucket's all-reduce is logged with its calling line and streamed to
  the caller.
* torch DDP + recorder: DDP's reducer issues its all-reduces from C++, which a
  Python recorder cannot see (PyTorch's own flight recorder sits in C++ for
  this reason): the ratio shows the wrapper costs nothing when not called.

Then the cost of one recorded call: N all-reduces of one float, recorded vs
not, in microseconds of the calling thread's CPU time per call (waiting for
the peer is not counted, so a busy machine blurs it less than wall time). Target: recorded / plain BucketedDDP <= 1.05.
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

KINDS = ["torch DDP", "BucketedDDP", "BucketedDDP + recorder", "torch DDP + recorder"]


def _bench(size: str, steps: int, micro: int, seq: int, calls: int) -> dict:
    import contextlib

    import torch.distributed as dist

    from helpers.data import make_dataset
    from helpers.ddp import BucketedDDP
    from helpers.debug import record_collectives
    from helpers.model import build_model

    r, p, device = rank_info().rank, rank_info().world_size, rank_info().device
    data = make_dataset(seq_len=seq, num_sequences=p * micro)  # one micro-batch per rank
    x, y = (t.to(device) for t in data.batch(range(micro * r, micro * (r + 1))))

    def make(kind):
        m = build_model(size, seed=0, device=device, block_size=max(seq, 32))
        if kind.startswith("torch DDP"):
            return torch.nn.parallel.DistributedDataParallel(m)
        return BucketedDDP(m)

    models = {k: make(k) for k in KINDS}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times = {k: [] for k in KINDS}
    recorded_calls = 0
    for step in range(steps + 2):
        for k in KINDS:
            m, opt = models[k], opts[k]
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = clock_for(x).mark()
            with record_collectives() if k.endswith("recorder") else contextlib.nullcontext() as rec:
                opt.zero_grad(set_to_none=True)
                m(x, y)[1].backward()
                opt.step()
            dt = torch.tensor([elapsed(t0, clock_for(x).mark())], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= 2:  # two warm-up steps
                times[k].append(float(dt))
                if k == "BucketedDDP + recorder":
                    recorded_calls = len(rec.calls)

    def per_call(recorded: bool) -> float:
        t = torch.zeros(1)
        dist.barrier()
        t0 = time.thread_time()  # this thread's CPU: waiting for the peer does not count
        with record_collectives() if recorded else contextlib.nullcontext():
            for _ in range(calls):
                dist.all_reduce(t)
        return (time.thread_time() - t0) / calls

    per_call(False)  # warm-up
    pairs = [(per_call(False), per_call(True)) for _ in range(3)]
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "calls_per_step": recorded_calls,
            "per_call": {"plain": statistics.median(a for a, _ in pairs),
                         "recorded": statistics.median(b for _, b in pairs)}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = ap.parse_args(argv)
    # Every check before any rank starts (starting ranks costs seconds).
    validate(args)  # --size, --seq, --steps
    at_least(args, "ranks", 2, "data parallelism on one rank has nothing to record")
    at_least(args, "micro", 1, "sequences per rank per step")
    at_least(args, "calls", 1, "all-reduces timed for the cost of one call")

    t0 = time.perf_counter()
    res = launch(_bench, args.ranks, args.size, args.steps, args.micro, args.seq, args.calls,
                 backend=args.backend, timeout=900)[0]
    med = res["median"]
    print(f"model {args.size!r}, {args.ranks} ranks, micro-batch {args.micro} x {args.seq} "
          f"tokens; median of {args.steps} steps, slowest rank; "
          f"{res['calls_per_step']} recorded call(s) per BucketedDDP step")
    print(f"{'variant':26s} {'step ms':>9} {'vs torch DDP':>13} {'vs unrecorded':>14}")
    for k in KINDS:
        plain = med[k.replace(" + recorder", "")]
        print(f"{k:26s} {med[k] * 1e3:9.2f} {med[k] / med['torch DDP']:13.3f} "
              f"{med[k] / plain:14.3f}")
    pc = res["per_call"]
    print(f"one all_reduce of 1 float, CPU time of the calling thread: {pc['plain'] * 1e6:.1f} us "
          f"plain, {pc['recorded'] * 1e6:.1f} us recorded "
          f"({(pc['recorded'] - pc['plain']) * 1e6:+.1f} us)")
    ratio = med["BucketedDDP + recorder"] / med["BucketedDDP"]
    print(f"recorded / plain BucketedDDP step = {ratio:.3f} "
          f"(target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
