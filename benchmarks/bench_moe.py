"""Expert parallelism: the EP layer's step time against the single-process layer on
the same tokens, and our differentiable all-to-all against PyTorch's. Ratios from one run.

    python benchmarks/bench_moe.py [--world 2] [--tokens 256] [--hidden 64] [--experts 8]
                                   [--top-k 2] [--steps 8]

* "EP layer": ``MoELayer`` with its experts split over ``--world`` ranks, each rank
  with ``--tokens`` tokens, forward + backward; against one process running the
  same layer (all experts) on all ``world * tokens`` tokens. On a CPU the ranks
  share cores, so the ratio shows the all-to-all and bookkeeping overhead, not a
  speed-up; on GPUs with one rank per GPU the EP layer divides expert work by P.
* "all-to-all": ``helpers.moe.all_to_all`` (our autograd.Function) against
  ``torch.distributed.nn.functional.all_to_all_single`` (PyTorch's), forward +
  backward of the dispatch rows, with the bytes each rank sent and the effective
  bandwidth (bytes / time), to set beside a link's nominal bandwidth.
Medians over ``--steps`` after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers import launch, rank_info  # noqa: E402


def _median(xs):
    xs = sorted(xs[1:])  # the first step warms up
    return xs[len(xs) // 2]


def _layer_steps(layer, x, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        y, _ = layer(x)
        y.square().mean().backward()
        times.append(time.perf_counter() - t0)
    return _median(times)


def run_ep(tokens, hidden, experts, top_k, steps):
    import warnings

    import torch.distributed as dist
    import torch.distributed.nn.functional as dnf
    warnings.filterwarnings("ignore", category=FutureWarning)  # dnf is deprecated, still autograd

    from helpers.moe import MoELayer, all_to_all

    r = rank_info()
    torch.manual_seed(0)
    layer = MoELayer(hidden, 4 * hidden, experts, top_k=top_k, ep_group=dist.group.WORLD)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(r.rank))
    out = {"ep": _layer_steps(layer, x.requires_grad_(), steps)}
    st = layer.last_stats
    send, recv = st.send_splits, st.recv_splits
    rows = torch.randn(sum(send), hidden, requires_grad=True)
    for name, fn in (("ours", lambda: all_to_all(rows, recv, send)),
                     ("torch", lambda: dnf.all_to_all_single(
                         torch.empty(sum(recv), hidden), rows, recv, send))):
        times = []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            fn().sum().backward()
            times.append(time.perf_counter() - t0)
        out[name] = _median(times)
    out["bytes"] = st.dispatch_bytes
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    at_least(args, "world", 2, "expert parallelism needs ranks to send to")
    at_least(args, "tokens", 1, "each rank routes its own tokens")
    at_least(args, "hidden", 1, "the width of a token row")
    at_least(args, "steps", 2, "the first step is a warm-up")
    from helpers.moe import MoEConfig, MoELayer
    MoEConfig(args.hidden, 4 * args.hidden, args.experts, args.top_k, None, args.world)

    # the single process gets the threads of one rank (launch gives each cores // world),
    # so the ratio compares the same compute resources per process
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    torch.manual_seed(0)
    single = MoELayer(args.hidden, 4 * args.hidden, args.experts, top_k=args.top_k)
    x = torch.randn(args.world * args.tokens, args.hidden, requires_grad=True)
    t_single = _layer_steps(single, x, args.steps)
    res = launch(run_ep, args.world, args.tokens, args.hidden, args.experts, args.top_k,
                 args.steps, timeout=300)
    t_ep = max(r["ep"] for r in res)  # the slowest rank sets the step
    print(f"MoE layer, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"{args.tokens} tokens per rank, {args.world} ranks (fwd + bwd, median ms)")
    print(f"{'what':34s} {'ms':>8} {'ratio':>7}")
    print(f"{'single process, all tokens':34s} {t_single * 1e3:8.2f} {1.0:7.2f}")
    print(f"{'EP layer, slowest rank':34s} {t_ep * 1e3:8.2f} {t_ep / t_single:7.2f}")
    ours, theirs = max(r["ours"] for r in res), max(r["torch"] for r in res)
    sent = max(r["bytes"] for r in res)
    print(f"{'all-to-all, torch.distributed.nn':34s} {theirs * 1e3:8.2f} {1.0:7.2f}")
    print(f"{'all-to-all, helpers.moe':34s} {ours * 1e3:8.2f} {ours / theirs:7.2f}")
    print(f"dispatch bytes sent by the busiest rank: {sent:,}; effective bandwidth of ours "
          f"(fwd + bwd moves them twice): {2 * sent / ours / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
