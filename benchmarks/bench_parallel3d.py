"""The 3-D capstone's step time vs one process and vs PyTorch DDP on the same ranks.

    python benchmarks/bench_parallel3d.py [--size tiny] [--dp 2 --tp 2 --pp 2] [--steps 5]

Same model (the course GPT), same global batch, same SGD step, one run:

* one process: the whole batch on one rank, once with all the machine's cores as
  intra-op threads and once with one thread (ratios "/ 1 proc" are to the faster);
* torch DDP: ``torch.nn.parallel.DistributedDataParallel`` on dp * tp * pp ranks,
  each with batch / ranks sequences (pure data parallelism, the whole model per rank);
* 3-D: ``helpers.parallel3d.run_capstone`` on the same number of ranks (1F1B,
  --micro-batches per replica), also checked against one process (column "= 1 proc").

Each row is the median step (forward + backward + gradient sync + SGD step) after
one warm-up step; a multi-rank step is timed on every rank and the slowest rank counts.
On a CPU with fewer cores than ranks the ranks share cores, so the ratios
measure the parallelism's overheads (messages, bubble, small per-rank matmuls),
not its speed-up; on a GPU node (one GPU per rank, nccl) they measure both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from _args import validate  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402
from helpers.parallel3d import (CapstoneLayout, capstone_batches, run_capstone,  # noqa: E402
                                sgd_step)


def _plain_steps(layout: CapstoneLayout, ddp: bool, threads: int | None = None) -> dict:
    """Rank function: ``layout.steps`` SGD steps of the unsplit model, either one
    process on the whole batch or torch DDP with batch / world sequences per rank.
    ``threads``: intra-op threads (None: what launch gives a rank, cores // ranks)."""
    from helpers.model import build_model

    if threads is not None:
        torch.set_num_threads(threads)
    info = rank_info()
    device = torch.device(info.device)
    model = build_model(layout.config, seed=0, device=device)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    shard = layout.batch // info.world_size
    losses, times = [], []
    for x, y in capstone_batches(layout):
        x, y = (u[info.rank * shard:(info.rank + 1) * shard].to(device) for u in (x, y))
        t0 = clock_for(device).mark()
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()  # DDP: bucketed all-reduce overlapped with backward
        sgd_step(list(model.parameters()), layout.lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(elapsed(t0, clock_for(device).mark()))
        losses.append(float(loss.detach()))
    return {"losses": losses, "times": times, "threads": torch.get_num_threads()}


def _median_after_warmup(times: list[float]) -> float:
    return statistics.median(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="steps, the first a warm-up")
    args = ap.parse_args(argv)
    validate(args)  # --size, --seq, --steps
    layout = CapstoneLayout(args.dp, args.tp, args.pp, args.size, batch=args.batch,
                            seq=args.seq, micro_batches=args.micro_batches,
                            steps=args.steps)  # ValueError names it
    world = layout.world_size
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} does not divide over the {world} DDP ranks "
                         f"(dp x tp x pp)")

    # One process twice: with every core as intra-op threads, and with one thread (the
    # tiny model's matmuls are small, and on a busy machine a multi-threaded region
    # waits for all its threads to be scheduled). Ratios are to the faster of the two.
    ones = [launch(_plain_steps, 1, layout, False, n, timeout=600)[0] for n in (None, 1)]
    ddp = launch(_plain_steps, world, layout, True, timeout=600)
    r3d = run_capstone(args.dp, args.tp, args.pp, steps=args.steps,
                       micro_batches=args.micro_batches, size=args.size, batch=args.batch,
                       seq=args.seq, timeout=600)
    t_ones = [_median_after_warmup(o["times"]) for o in ones]
    t1 = min(t_ones)
    one = ones[0]
    tddp = _median_after_warmup([max(r["times"][i] for r in ddp) for i in range(args.steps)])
    t3d = _median_after_warmup(r3d.step_times_s)
    # DDP's loss per step: the mean of the ranks' shard losses. Float32 reordering moves
    # it by ~1e-7 relative over a few steps; a gradient that is not averaged moves the
    # second step's loss by ~1e-2 relative: 1e-5 sits between the two.
    ddp_loss = [statistics.fmean(r["losses"][i] for r in ddp) for i in range(args.steps)]
    ddp_same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ddp_loss, one["losses"]))

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; each of {world} "
          f"ranks on {ddp[0]['threads']} thread(s); model {args.size}, "
          f"global batch {args.batch} x {args.seq} tokens, {args.steps - 1} timed steps; "
          f"3-D: dp x tp x pp = {args.dp} x {args.tp} x {args.pp}, mesh {r3d.mesh_dims}, "
          f"1F1B, {args.micro_batches} micro-batches")
    print(f"{'run':28s} {'ranks':>5s} {'step ms':>8s} {'/ 1 proc':>9s} {'/ DDP':>7s} "
          f"{'= 1 proc':>8s}")
    rows = [(f"one process, {o['threads']} thread(s)", 1, t, "-") for o, t in zip(ones, t_ones)]
    rows += [("torch DDP", world, tddp, ddp_same),
             ("3-D (helpers.parallel3d)", world, t3d, r3d.ok)]
    for name, n, t, same in rows:
        print(f"{name:28s} {n:5d} {1e3 * t:8.1f} {t / t1:9.2f} {t / tddp:7.2f} {str(same):>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
