"""Ring attention (helpers.sp) on --world ranks vs PyTorch's SDPA on the whole sequence in
one process: time per forward+backward step and bytes saved for backward, ratios from one run.

    python benchmarks/bench_sp.py [--seq 2048] [--heads 8] [--head-dim 64] [--steps 5]
                                  [--world 2] [--layout zigzag]

Rows:
* ``SDPA, 1 process``: ``F.scaled_dot_product_attention(is_causal=True)`` on the whole
  sequence, run on rank 0 while the others wait (a barrier), so the two rows share the
  machine alike.
* ``ring, cp ranks``: ``ring_attention`` on each rank's chunk; the slowest rank's time.

Saved bytes: what autograd keeps for backward (``saved_tensors_hooks``), per rank. On CPU
PyTorch's SDPA may take its math path, which saves the s x s probabilities; the ring saves
q, k, v, the output and one log-sum-exp per row: O(s/cp) per rank.

Hidden communication: the ring forward is also timed as its two parts alone (the cp
block computations with no messages; the cp - 1 K/V transfers with no compute); the share
of the transfers hidden is (compute + transfers - ring) / transfers, clipped to [0, 1].

On a CPU with gloo, cp ranks share the same cores, so the time ratio measures the overhead
of the ring (Python, explicit score blocks, messages), not a speed-up; on cp GPUs each
rank has its own device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402


def _saved_bytes(fn):
    """Bytes autograd saves while ``fn()`` runs its forward (counted once per storage)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _run(seq, heads, head_dim, steps, layout):
    from helpers.sp import ring_attention, shard_sequence
    r = rank_info()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, heads, seq, head_dim, generator=gen) for _ in range(4)]
    local = [shard_sequence(x, layout=layout) for x in full]

    def sdpa():
        q, k, v = (x.clone().requires_grad_() for x in full[:3])
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), full[3]

    def ring():
        q, k, v = (x.clone().requires_grad_() for x in local[:3])
        return ring_attention(q, k, v, layout=layout), local[3]

    times, saved = {"sdpa": [], "ring": []}, {}
    for step in range(steps + 1):                   # step 0: warm-up
        for name, fn in (("sdpa", sdpa), ("ring", ring)):
            dist.barrier()
            t0 = clock_for(full[0]).mark()
            if name == "ring" or r.rank == 0:
                (y, dy), saved[name] = _saved_bytes(fn)
                y.backward(dy)
            dist.barrier()                          # every rank done: the slowest sets the time
            if step:
                times[name].append(elapsed(t0, clock_for(full[0]).mark()))
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "saved": saved,
            "parts": _ring_parts(local[:3], steps, layout)}


def _ring_parts(qkv, steps, layout):
    """Median seconds of: ring forward, its block computations alone, its transfers alone."""
    from helpers.sp import cp_size, ring_attention, ring_forward, ring_shift, wait_all
    q, k, v = qkv
    kv = torch.stack([k, v])

    def compute():  # the same cp masked blocks, on the local K/V, no messages
        ring_forward(q, k, v, layout=layout, communicate=False)

    def transfer():
        x = kv
        for _ in range(cp_size() - 1):
            x, reqs = ring_shift(x)
            wait_all(reqs)

    parts = {"ring": lambda: ring_attention(q, k, v, layout=layout), "compute": compute,
             "transfer": transfer}
    out = {k: [] for k in parts}
    with torch.no_grad():
        for step in range(steps + 1):
            for name, fn in parts.items():
                dist.barrier()
                t0 = clock_for(q).mark()
                fn()
                dist.barrier()
                if step:
                    out[name].append(elapsed(t0, clock_for(q).mark()))
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layout", default="zigzag")
    args = parser.parse_args(argv)
    at_least(args, "world", 2, "a ring needs two ranks")
    at_least(args, "steps", 1, "one timed step after the warm-up")
    at_least(args, "heads", 1, "attention needs a head")
    at_least(args, "head-dim", 1, "attention needs a head")
    from helpers.sp import check_layout
    check_layout(args.seq, args.world, args.layout)  # names the constraint before ranks start

    res = launch(_run, args.world, args.seq, args.heads, args.head_dim, args.steps,
                 args.layout, timeout=600)
    t, s = res[0]["times"], res[0]["saved"]
    print(f"causal attention, seq {args.seq}, {args.heads} heads x {args.head_dim}, fp32, "
          f"cp = {args.world} ({args.layout}), median of {args.steps} forward+backward steps")
    print(f"{'':<18} {'ms / step':>10} {'vs SDPA':>8} {'saved MiB/rank':>15} {'vs SDPA':>8}")
    for name, label in (("sdpa", "SDPA, 1 process"), ("ring", f"ring, {args.world} ranks")):
        saved = max(r["saved"][name] for r in res) if name == "ring" else s["sdpa"]
        print(f"{label:<18} {t[name] * 1e3:>10.1f} {t[name] / t['sdpa']:>7.2f}x "
              f"{saved / 2**20:>15.2f} {saved / s['sdpa']:>7.2f}x")
    p = res[0]["parts"]
    hidden = min(1.0, max(0.0, (p["compute"] + p["transfer"] - p["ring"]) / p["transfer"]))
    print(f"\nring forward (no grad) {p['ring'] * 1e3:.1f} ms; its block computations alone "
          f"{p['compute'] * 1e3:.1f} ms; its K/V transfers alone {p['transfer'] * 1e3:.1f} ms:"
          f" {hidden:.0%} of the transfer time hidden under compute")


if __name__ == "__main__":
    main()
