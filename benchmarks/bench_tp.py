"""Tensor parallelism: our TP block vs PyTorch's DTensor TP on the same block and ranks,
and the bytes each layer all-reduces, counted vs the formula. Ratios from one run.

    python benchmarks/bench_tp.py [--size tiny] [--batch 8] [--seq 64] [--steps 20] [--world 2]

Both rows run forward + backward of the same transformer block (helpers.model), split
over --world ranks: ours with helpers.tp (``tensor_parallel_block``), PyTorch's with
``parallelize_module`` + ColwiseParallel / RowwiseParallel (``torch_tp_block``). One launch,
one step of each in turn, so load on the machine hits both alike; the median over steps
after a warm-up is reported.

On a CPU with gloo the times measure matmuls on a few cores, gloo latency and Python
(DTensor's dispatch); on GPUs (nccl) they measure kernels and NVLink.

Target (issue 13): our block's step time at most 1.2x DTensor TP's.
Bytes: every all-reduce our block issues, per layer and direction, must equal
``tp_comm_bytes`` exactly (Shoeybi et al. 2019, sec. 3: 2 forward + 2 backward per block).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from _args import validate  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402
from helpers.model import GPTConfig, build_model  # noqa: E402

TARGET = 1.2  # our TP block's step time over DTensor TP's, at most


def _step(block, x, dy):
    t0 = clock_for(x).mark()
    y = block(x)
    y.backward(dy)
    for p in block.parameters():
        p.grad = None
    return elapsed(t0, clock_for(x).mark())


def _run(size, batch, seq, steps):
    from helpers.tp import count_collectives, tensor_parallel_block
    from helpers.tp.transformer import torch_tp_block

    r = rank_info()
    dense = build_model(size, seed=0, device=r.device).blocks[0]
    h = dense.ln_1.normalized_shape[0]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, h, generator=gen).to(r.device)
    dy = torch.randn(batch, seq, h, generator=gen).to(r.device)
    blocks = {"helpers.tp": tensor_parallel_block(dense), "DTensor TP": torch_tp_block(dense)}
    with count_collectives() as counter:
        _step(blocks["helpers.tp"], x, dy)  # also the warm-up
    _step(blocks["DTensor TP"], x, dy)
    times = {k: [] for k in blocks}
    for _ in range(steps):
        for name, block in blocks.items():  # interleaved: the same load on both
            times[name].append(_step(block, x, dy))
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "table": counter.table(), "h": h}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    validate(args)
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    from helpers.tp import tp_comm_bytes, tp_plan
    tp_plan(GPTConfig.from_name(args.size), args.world)  # heads must divide over --world

    res = launch(_run, args.world, args.size, args.batch, args.seq, args.steps, timeout=600)
    cfg = GPTConfig.from_name(args.size)
    print(f"one {args.size} block (h = {cfg.n_embd}, {cfg.n_head} heads), batch {args.batch} x "
          f"seq {args.seq}, TP = {args.world}, median of {args.steps} forward+backward steps")
    # The slowest rank sets the step time.
    times = {k: max(r["times"][k] for r in res) for k in res[0]["times"]}
    ratio = times["helpers.tp"] / times["DTensor TP"]
    print(f"{'':<12} {'ms / step':>10} {'vs DTensor':>11}")
    for name, sec in times.items():
        print(f"{name:<12} {sec * 1e3:>10.2f} {sec / times['DTensor TP']:>10.2f}x")
    print(f"verdict: helpers.tp at {ratio:.2f}x DTensor TP "
          + ("meets" if ratio <= TARGET else "misses") + f" the {TARGET}x target")

    # Bytes per layer: counted on every rank vs the formula for block 0 (fp32 activations).
    formula = {(layer[len("blocks.0."):], d): b for (layer, d), b in
               tp_comm_bytes(cfg, args.batch, args.seq, args.world).items()
               if layer.startswith("blocks.0.")}
    print(f"\n{'layer':<14} {'direction':<9} {'count':>5} {'bytes':>10} {'formula':>10}")
    for (layer, direction, op), (n, nbytes) in res[0]["table"].items():
        want = formula.get((layer, direction), 0)
        print(f"{layer:<14} {direction:<9} {n:>5} {nbytes:>10,} {want:>10,}")
    ok = all({(la, d): b for (la, d, _), (_, b) in r["table"].items()} == formula for r in res)
    print("bytes per layer and direction equal the formula on every rank "
          "(B x T x h x 4; 2 forward + 2 backward per block):", ok)


if __name__ == "__main__":
    main()
