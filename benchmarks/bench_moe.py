"""Expert parallelism: the EP layer's step time against the single-process layer on
the same tokens, our differentiable all-to-all against PyTorch's, and the measured
all-to-all time against chapter 07's model. Ratios from one run.

    python benchmarks/bench_moe.py [--world 2] [--tokens 256] [--hidden 64] [--experts 8]
                                   [--top-k 2] [--steps 8] [--capacity-factor 1.25]

* "EP layer": ``MoELayer`` with its experts split over ``--world`` ranks, each rank
  with ``--tokens`` tokens, forward + backward; against one process running the
  same layer (all experts) on all ``world * tokens`` tokens. On a CPU the ranks
  share cores, so the ratio shows the all-to-all and bookkeeping overhead, not a
  speed-up; on GPUs with one rank per GPU the EP layer divides expert work by P.
* "all-to-all": ``helpers.moe.all_to_all`` (our autograd.Function) against
  ``torch.distributed.nn.functional.all_to_all_single`` (PyTorch's), forward +
  backward of the dispatch rows, with the bytes each rank sent and the effective
  bandwidth (bytes / time), to set beside a link's nominal bandwidth.
* "EP layer, padded": the same layer in the padded capacity mode (fixed (E, C, H)
  buffers, ``--capacity-factor``), which sends every empty slot too.
* "model": ``helpers.topology.collective_cost(topology, "all_to_all", N, P,
  algorithm="direct")`` (chapter 07) on a one-node topology whose link is *measured*
  here first: a ping-pong between ranks 0 and 1 gives the latency (8-byte message)
  and the bandwidth (a message of one rank's all-to-all piece, at least 4 MiB). N is the
  bytes of one rank's send buffer: for the padded buffers exactly what the model
  assumes (the same to every peer); for the dropless rows, the model assumes they
  spread evenly. The ratio measured / model shows what the model leaves out: on a
  CPU the "all pairs at once" of the direct model shares the same memory system.
Medians over ``--steps`` after one warm-up step.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers.clock import clock_for, elapsed  # noqa: E402
from helpers import launch, rank_info  # noqa: E402


def _median(xs):
    xs = sorted(xs[1:])  # the first step warms up
    return xs[len(xs) // 2]


def _layer_steps(layer, x, steps):
    times = []
    for _ in range(steps):
        t0 = clock_for(x).mark()
        y, _ = layer(x)
        y.square().mean().backward()
        times.append(elapsed(t0, clock_for(x).mark()))
    return _median(times)


def _ping_pong(nbytes, reps, trips=10):
    """Ranks 0 and 1: median one-way seconds for a message of ``nbytes`` (others wait).

    Rank 0 times ``trips`` round trips in a row (so the barrier's uneven exit is paid
    once, not per message) and halves the mean."""
    import torch.distributed as dist
    r = rank_info().rank
    buf = torch.zeros(max(1, nbytes // 4))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = clock_for(buf).mark()
        for _ in range(trips):
            if r == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif r == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
        times.append(elapsed(t0, clock_for(buf).mark()) / (2 * trips))
    return _median(times)


def _timed_all_to_all(n_rows, hidden, splits_out, splits_in, steps):
    """Median seconds of one forward ``dist.all_to_all_single`` of these splits."""
    import torch.distributed as dist
    send = torch.randn(n_rows, hidden)
    recv = torch.empty(sum(splits_out), hidden)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = clock_for(send).mark()
        dist.all_to_all_single(recv, send, splits_out, splits_in)
        times.append(elapsed(t0, clock_for(send).mark()))
    return _median(times)


def run_ep(tokens, hidden, experts, top_k, steps, capacity_factor):
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
            t0 = clock_for(rows).mark()
            fn().sum().backward()
            times.append(elapsed(t0, clock_for(rows).mark()))
        out[name] = _median(times)
    out["bytes"] = st.dispatch_bytes
    torch.manual_seed(0)
    padded = MoELayer(hidden, 4 * hidden, experts, top_k=top_k, capacity_factor=capacity_factor,
                      ep_group=dist.group.WORLD, padded=True)
    out["padded"] = _layer_steps(padded, x, steps)
    pst = padded.last_stats
    out["padded_bytes"], out["padding_bytes"] = pst.dispatch_bytes, pst.padding_bytes
    # the dispatch all-to-all alone, forward, for the model comparison
    out["a2a_dropless"] = _timed_all_to_all(sum(send), hidden, recv, send, steps)
    out["a2a_padded"] = _timed_all_to_all(sum(pst.send_splits), hidden, pst.recv_splits,
                                          pst.send_splits, steps)
    out["send_rows"], out["padded_rows"] = sum(send), sum(pst.send_splits)
    # calibration message: one peer's padded piece, at least 4 MiB so that the
    # transfer, not the per-message overhead, sets its time
    piece = max(pst.send_splits[0] * hidden * 4, 4 * 2**20)
    out["latency"], out["t_piece"], out["piece"] = (_ping_pong(8, steps),
                                                   _ping_pong(piece, steps), piece)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    args = ap.parse_args(argv)
    at_least(args, "world", 2, "expert parallelism needs ranks to send to")
    at_least(args, "tokens", 1, "each rank routes its own tokens")
    at_least(args, "hidden", 1, "the width of a token row")
    at_least(args, "steps", 2, "the first step is a warm-up")
    from helpers.moe import MoEConfig, MoELayer
    MoEConfig(args.hidden, 4 * args.hidden, args.experts, args.top_k, None, args.world)
    MoEConfig(args.hidden, 4 * args.hidden, args.experts, args.top_k, args.capacity_factor,
              args.world, padded=True)

    # the single process gets the threads of one rank (launch gives each cores // world),
    # so the ratio compares the same compute resources per process
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    torch.manual_seed(0)
    single = MoELayer(args.hidden, 4 * args.hidden, args.experts, top_k=args.top_k)
    x = torch.randn(args.world * args.tokens, args.hidden, requires_grad=True)
    t_single = _layer_steps(single, x, args.steps)
    res = launch(run_ep, args.world, args.tokens, args.hidden, args.experts, args.top_k,
                 args.steps, args.capacity_factor, timeout=300)
    t_ep = max(r["ep"] for r in res)  # the slowest rank sets the step
    print(f"MoE layer, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
          f"{args.tokens} tokens per rank, {args.world} ranks (fwd + bwd, median ms)")
    print(f"{'what':34s} {'ms':>8} {'ratio':>7}")
    print(f"{'single process, all tokens':34s} {t_single * 1e3:8.2f} {1.0:7.2f}")
    print(f"{'EP layer, slowest rank':34s} {t_ep * 1e3:8.2f} {t_ep / t_single:7.2f}")
    t_pad = max(r["padded"] for r in res)
    print(f"{f'EP layer, padded (cf {args.capacity_factor})':34s} {t_pad * 1e3:8.2f} "
          f"{t_pad / t_single:7.2f}")
    ours, theirs = max(r["ours"] for r in res), max(r["torch"] for r in res)
    sent = max(r["bytes"] for r in res)
    print(f"{'all-to-all, torch.distributed.nn':34s} {theirs * 1e3:8.2f} {1.0:7.2f}")
    print(f"{'all-to-all, helpers.moe':34s} {ours * 1e3:8.2f} {ours / theirs:7.2f}")
    print(f"dispatch bytes sent by the busiest rank: {sent:,}; effective bandwidth of ours "
          f"(fwd + bwd moves them twice): {2 * sent / ours / 1e9:.2f} GB/s")
    _model_table(res, args)


def _model_table(res, args):
    """Measured dispatch all-to-all (forward) against chapter 07's direct model."""
    from helpers.topology import Link, Topology, collective_cost
    r0 = res[0]
    lat = r0["latency"]
    bw = r0["piece"] / max(r0["t_piece"] - lat, 1e-9)
    link = Link("this machine, measured (ping-pong ranks 0-1)", bw, lat)
    topo = Topology("this machine", 1, args.world, link, link, nics_per_node=1)
    print(f"\nlink measured: latency {lat * 1e6:.1f} us, bandwidth {bw / 1e9:.2f} GB/s "
          f"({r0['piece']:,} B messages)")
    print(f"{'dispatch all-to-all (forward)':34s} {'ms':>8} {'model ms':>9} {'ratio':>7} "
          f"{'MiB sent/rank':>14}")
    for name, key, rows in (("dropless (variable splits)", "a2a_dropless", "send_rows"),
                            ("padded (E, C, H) buffers", "a2a_padded", "padded_rows")):
        t = max(r[key] for r in res)
        n = max(r[rows] for r in res) * args.hidden * 4           # one rank's send buffer
        model = collective_cost(topo, "all_to_all", n, args.world, algorithm="direct").time
        print(f"{name:34s} {t * 1e3:8.3f} {model * 1e3:9.3f} {t / model:7.2f} "
              f"{n * (args.world - 1) / args.world / 2**20:14.2f}")
    pad = max(r["padding_bytes"] for r in res)
    total = max(r["padded_bytes"] for r in res)
    print(f"padded mode: {pad:,} of {total:,} bytes sent by the busiest rank are empty slots "
          f"({pad / total:.0%})")


if __name__ == "__main__":
    main()
