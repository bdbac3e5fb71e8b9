"""Launch cost: our pooled launcher vs torch.multiprocessing.spawn, in one run.

    python benchmarks/bench_launch.py

The rank function is trivial (one all_reduce of one float), so the numbers are
pure overhead: starting interpreters, importing torch, rendezvous, shipping the
function, returning results. "first" starts the rank server (what a notebook
pays once: it imports torch); "later" forks fresh ranks from it (median of 10,
back to back, so the server's spares are often not ready: the worst case).
torch.multiprocessing.spawn starts fresh interpreters and a process group every
time, as a script would. The load average is printed: on a shared machine the
numbers scale with it.
"""

import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import launch, shutdown  # noqa: E402


def tiny():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawned(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    tiny()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    rows = []
    for world in (2, 4):
        shutdown()
        start = time.perf_counter()
        launch(tiny, world)
        first = time.perf_counter() - start
        later = []
        for _ in range(10):
            start = time.perf_counter()
            launch(tiny, world)
            later.append(time.perf_counter() - start)
        shutdown()
        start = time.perf_counter()
        mp.spawn(_spawned, args=(world, free_port()), nprocs=world, join=True)
        spawn = time.perf_counter() - start
        rows.append((world, first, statistics.median(later), spawn))

    print(f"{'ranks':>5} | {'first launch s':>14} | {'later launch s':>14} | "
          f"{'mp.spawn s':>10} | {'later/spawn':>11}")
    print("-" * 68)
    for world, first, later, spawn in rows:
        print(f"{world:>5} | {first:14.3f} | {later:14.4f} | {spawn:10.3f} | {later / spawn:11.3f}")
    print(f"\n(on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"target: later launch <= 0.3 s for 4 ranks)")


if __name__ == "__main__":
    main()
