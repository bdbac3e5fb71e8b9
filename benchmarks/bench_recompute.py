"""Memory vs step time for none / selective / full recompute (ours) and torch.utils.checkpoint.

    python benchmarks/bench_recompute.py [--size tiny] [--batch 8] [--steps 10]

Memory: bytes autograd keeps at the end of the forward and the peak including what a
recompute re-saves in backward (``helpers.memory.SavedTensorCounter``, exact on any
device); on CUDA also ``torch.cuda.max_memory_allocated`` for the whole step. Time: median
of ``--steps`` forward+backward steps after one warm-up, modes interleaved so background
load affects all of them alike.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.utils.checkpoint as tuc

from _args import at_least, check_size_seq  # (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed
from helpers.memory import SavedTensorCounter, cuda_peak_bytes
from helpers.model import build_model
from helpers.recompute import apply_recompute


def torch_full(model):
    """Every block through torch.utils.checkpoint (non-reentrant), for comparison."""
    for block in model.blocks:
        block.forward = functools.partial(tuc.checkpoint, type(block).forward.__get__(block),
                                          use_reentrant=False)
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    check_size_seq(args.size, 1)
    at_least(args, "batch", 1, "sequences per step")
    at_least(args, "steps", 1, "timed steps after the warm-up")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    setups = {
        "none": lambda m: m,
        "selective (ours)": lambda m: apply_recompute(m, "selective"),
        "full (ours)": lambda m: apply_recompute(m, "full"),
        "full (torch.utils.checkpoint)": torch_full,
    }
    models = {k: f(build_model(args.size, dropout=0.1, device=device)) for k, f in setups.items()}
    T = models["none"].config.block_size
    idx = torch.randint(0, 64, (args.batch, T), device=device)

    def step(model):
        _, loss = model(idx, idx)
        loss.backward()

    mem, peak, cuda = {}, {}, {}
    for name, model in models.items():
        with SavedTensorCounter(model) as c:
            step(model)
        mem[name], peak[name] = c.total_bytes, c.peak_bytes
        cuda[name] = cuda_peak_bytes(functools.partial(step, model))
    samples = {k: [] for k in models}
    for i in range(args.steps + 1):
        for name, model in models.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = clock_for(idx).mark()
            step(model)
            if i:
                samples[name].append(elapsed(t0, clock_for(idx).mark()))
    med = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    print(f"model {args.size!r}, batch {args.batch}, seq {T}, device {device}, "
          f"median of {args.steps} steps")
    print(f"{'mode':31s} {'saved MB':>9s} {'peak MB':>8s} {'cuda peak MB':>13s} "
          f"{'step ms':>8s} {'time x':>7s} {'memory x':>9s}")
    for name in models:
        cu = f"{cuda[name] / 1e6:13.2f}" if cuda[name] is not None else f"{'n/a (CPU)':>13s}"
        print(f"{name:31s} {mem[name] / 1e6:9.2f} {peak[name] / 1e6:8.2f} {cu} "
              f"{med[name] * 1e3:8.1f} {med[name] / med['none']:7.2f} "
              f"{mem[name] / mem['none']:9.2f}")
    print("(torch.utils.checkpoint's non-reentrant recompute runs under its own saved-tensor "
          "hooks, so the counter's peak does not see the tensors it re-saves in backward)")


if __name__ == "__main__":
    main()
