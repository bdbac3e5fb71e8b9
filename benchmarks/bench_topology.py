"""Hierarchical vs flat all-reduce on an emulated slow network, and the price of the extra stages.

    python benchmarks/bench_topology.py [--world 4] [--gpus-per-node 2] [--mbps 0.25]
                                        [--latency-ms 1] [--reps 3] [--sizes 8192,32768]

Part 1: every cross-node message of our rings is delayed by latency + bytes / bandwidth
(helpers.topology.Wire); the flat ring and the hierarchical all-reduce take turns call
by call; each is compared with the cost model of that emulated cluster (measured /
predicted; the model is a lower bound, the excess is this machine's own cost).
Part 2: no emulated delay: our hierarchical all-reduce and our flat ring against
dist.all_reduce (gloo, or nccl on GPUs), as time ratios: what the extra stages and
Python-level rings cost when the network is not slow.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _args import at_least  # noqa: E402  (benchmarks/ is on sys.path)
from helpers import launch  # noqa: E402
from helpers.topology import (Link, check_grid, collective_cost, emulated_topology,  # noqa: E402
                              time_emulated)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be comma-separated ints (float32 elements), "
                         f"got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be >= 1 element each, got {text!r}")
    return sizes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--mbps", type=float, default=0.25, help="emulated network, MB/s")
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="8192,32768", help="float32 elements, comma-separated")
    ap.add_argument("--plain-sizes", default="65536,1048576,4194304",
                    help="sizes of part 2 (no delay)")
    args = ap.parse_args(argv)
    # Every check before any rank starts (starting ranks costs seconds).
    at_least(args, "world", 2, "one rank has nobody to talk to")
    at_least(args, "gpus-per-node", 2, "one GPU per node has no intra-node phase to compare")
    check_grid(args.world, args.gpus_per_node)
    if args.world == args.gpus_per_node:
        raise ValueError(f"--world {args.world} with --gpus-per-node {args.gpus_per_node} is "
                         f"one node: nothing crosses a network")
    if not args.mbps > 0:
        raise ValueError(f"--mbps must be > 0 (emulated bandwidth), got {args.mbps}")
    at_least(args, "latency-ms", 0, "emulated per-message latency")
    at_least(args, "reps", 1, "timed calls per size; the table shows their median")
    sizes, plain = _sizes(args.sizes), _sizes(args.plain_sizes)

    t0 = time.perf_counter()
    p, g = args.world, args.gpus_per_node
    slow = Link(f"emulated {args.mbps:g} MB/s", args.mbps * 1e6, args.latency_ms * 1e-3)
    topo = emulated_topology(p // g, g, slow)
    print(f"Part 1: {p // g} nodes x {g} ranks, cross-node messages delayed by "
          f"{args.latency_ms:g} ms + bytes / {args.mbps:g} MB/s; median of {args.reps}")
    print(f"{'bytes':>10} {'algorithm':>13} {'measured ms':>12} {'model ms':>9} "
          f"{'meas/model':>10} {'bytes across':>13}")
    for n in sizes:
        rows = launch(time_emulated, p, n, g, slow, args.reps, timeout=600)[0]
        for r in rows:
            model = collective_cost(topo, "all_reduce", r["nbytes"], p, r["algorithm"])
            print(f"{r['nbytes']:10,d} {r['algorithm']:>13} {r['time_s'] * 1e3:12.1f} "
                  f"{model.time * 1e3:9.1f} {r['time_s'] / model.time:10.2f} "
                  f"{r['cross_node_bytes']:13,.0f}")
        by = {r["algorithm"]: r["time_s"] for r in rows}
        model = {a: collective_cost(topo, "all_reduce", 4 * n, p, a).time for a in by}
        print(f"{'':10} flat / hierarchical: measured {by['ring'] / by['hierarchical']:.2f}, "
              f"model {model['ring'] / model['hierarchical']:.2f}")

    print(f"\nPart 2: no emulated delay; time / dist.all_reduce's (median of {args.reps})")
    print(f"{'bytes':>10} {'dist ms':>9} {'ring/dist':>10} {'hier/dist':>10}")
    for n in plain:
        rows = launch(time_emulated, p, n, g, None, args.reps, include_torch=True,
                      timeout=600)[0]
        by = {r["algorithm"]: r["time_s"] for r in rows}
        print(f"{4 * n:10,d} {by['torch'] * 1e3:9.2f} {by['ring'] / by['torch']:10.2f} "
              f"{by['hierarchical'] / by['torch']:10.2f}")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
