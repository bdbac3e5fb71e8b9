"""Gradient compression hooks on BucketedDDP: bytes sent and step time against the
plain fp32 all-reduce, PowerSGD across ranks. Ratios from one run.

    python benchmarks/bench_compression.py [--size tiny] [--world 2] [--steps 8]

Bytes are counted by the hooks (ring-model bytes one rank sends, the same
model as ``helpers.zero.ring_bytes_sent``), per step (PowerSGD's last step is
compressed; its first ``WARMUP`` steps are plain all-reduces and are not
timed). Step time is the median of forward + backward (with the hook) +
AdamW. "torch PowerSGD 4" is torch's DDP with ``powerSGD_hook``: its step
time against "PowerSGD 4" (ours, synchronous) and "PowerSGD 4 async" (ours,
worker thread). It is called through ``helpers.compression.torch_powersgd_hook``,
which on a machine with CUDA runs it to completion before returning (torch's
hook would otherwise call ``torch.cuda.synchronize`` on our CPU tensors and
fail): there it is synchronous too. On a CPU
with gloo, sending fewer bytes rarely pays for the compression's compute;
on slow inter-node links it does.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from _args import validate  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402


def run(kind, size, seq, steps):
    from helpers.compression import PowerSGDHook, TopKHook, cast_hook
    from helpers.ddp import BucketedDDP
    from helpers.model import build_model

    r = rank_info()
    if kind.startswith("torch"):  # PyTorch's DDP with its own hook, same warm-up
        return _run_torch(kind, size, seq, steps)
    hooks = {"fp32": None, "bf16": cast_hook(torch.bfloat16), "top-k 1%": TopKHook(0.01)}
    hook = hooks[kind] if kind in hooks else PowerSGDHook(
        int(kind.split()[1]), start_iter=WARMUP, asynchronous=kind.endswith("async"))
    ddp = BucketedDDP(build_model(size, seed=0), comm_hook=hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(r.rank))
    times = []
    for _ in range(steps):
        if hook is not None:
            hook.reset()
        t0 = clock_for(x).mark()
        ddp(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(elapsed(t0, clock_for(x).mark()))
    n = sum(p.numel() for p in ddp.parameters())
    dense = 2 * (r.world_size - 1) / r.world_size * 4 * n
    sent = hook.bytes_sent if hook is not None else dense
    skip = WARMUP if kind.startswith("PowerSGD") else 1  # time compressed steps only
    return {"step": sorted(times[skip:])[len(times[skip:]) // 2], "sent": sent, "dense": dense}


WARMUP = 2  # plain all-reduce steps before PowerSGD starts (torch needs > 1)


def _run_torch(kind, size, seq, steps):
    """torch's DDP with ``powerSGD_hook`` (rank from the name); time only, its bytes are
    the same as ours by construction (tests/test_compression.py compares the two)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.compression import torch_powersgd_hook
    from helpers.model import build_model

    r = rank_info()
    ddp = DDP(build_model(size, seed=0))
    state = psgd.PowerSGDState(None, matrix_approximation_rank=int(kind.split()[-1]),
                               start_powerSGD_iter=WARMUP)
    ddp.register_comm_hook(state, torch_powersgd_hook)  # torch's, CPU-safe with CUDA present
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, seq), generator=torch.Generator().manual_seed(r.rank))
    times = []
    for _ in range(steps):
        t0 = clock_for(x).mark()
        ddp(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(elapsed(t0, clock_for(x).mark()))
    return {"step": sorted(times[WARMUP:])[len(times[WARMUP:]) // 2], "sent": float("nan"),
            "dense": 1.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    validate(args)
    kinds = ["fp32", "bf16", "top-k 1%", "PowerSGD 1", "PowerSGD 4", "PowerSGD 4 async",
             "torch PowerSGD 4", "PowerSGD 16", "PowerSGD 64"]
    res = {k: launch(run, args.world, k, args.size, args.seq, args.steps, timeout=300)[0]
           for k in kinds}
    base = res["fp32"]["step"]
    print(f"BucketedDDP comm hooks, {args.world} ranks, {args.size}, seq {args.seq}")
    print(f"{'hook':17s} {'sent kB/step':>13} {'x fp32':>7} {'step ms':>8} {'x fp32':>7}")
    for k in kinds:
        v = res[k]
        sent = ("-", "-") if v["sent"] != v["sent"] else (f"{v['sent'] / 1e3:.1f}",
                                                          f"{v['sent'] / v['dense']:.3f}")
        print(f"{k:17s} {sent[0]:>13} {sent[1]:>7} {v['step'] * 1e3:8.1f} {v['step'] / base:7.2f}")


if __name__ == "__main__":
    main()
