"""Launch cost: our pooled launcher vs torch.multiprocessing.spawn, in one run.

    python benchmarks/bench_launch.py [--repeats 3]

The rank function is trivial (one all_reduce of one float), so the numbers are
pure overhead: starting interpreters, importing torch, rendezvous, shipping the
function, returning results. "first" starts the rank server (what a notebook
pays once: it imports torch; the fastest of ``--repeats`` fresh servers, since
on a shared machine noise only ever adds); "later" forks fresh ranks from it
(median of 10, back to back, so the server's spares are often not ready: the
worst case). torch.multiprocessing.spawn starts fresh interpreters and a process
group every time, as a script would. The load average is printed: on a shared
machine the numbers scale with it.

What the first launch is made of, timed in the same run (fresh interpreters, the
fastest of ``--repeats``): importing torch, and importing torch._dynamo after it.
The server imports both before it forks any rank: every torch.optim optimizer's
constructor imports torch._dynamo, so a rank forked without it would import it
itself, once per rank (``helpers.launch.server``). "first / imports" near 1 says
the first launch costs the server's imports and little else.
"""

import argparse
import datetime
import os
import socket
import statistics
import subprocess
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


# A fresh interpreter times its own imports (its start and exit are not the server's cost).
_IMPORTS = """
import time
t0 = time.perf_counter()
import torch, torch.distributed
t1 = time.perf_counter()
import torch._dynamo
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


def import_costs(repeats: int) -> tuple[float, float]:
    """(import torch, then import torch._dynamo) in seconds, the fastest of ``repeats``."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True,
                             check=True).stdout.split()
        runs.append((float(out[0]), float(out[1])))
    return min(r[0] for r in runs), min(r[1] for r in runs)


def first_launch(world: int) -> float:
    shutdown()
    start = time.perf_counter()
    launch(tiny, world)
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3,
                    help="fresh servers (and fresh interpreters) per figure; the fastest is kept")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    rows = []
    for world in (2, 4):
        first = min(first_launch(world) for _ in range(args.repeats))
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
    t_torch, t_dynamo = import_costs(args.repeats)
    imports = t_torch + t_dynamo
    print(f"\nthe server's imports, in a fresh interpreter: torch {t_torch:.3f} s, then "
          f"torch._dynamo {t_dynamo:.3f} s; first launch / imports: "
          + ", ".join(f"{first / imports:.2f} ({world} ranks)" for world, first, _, _ in rows))
    print(f"(on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"target: later launch <= 0.3 s for 4 ranks)")


if __name__ == "__main__":
    main()
