"""Checkpoint save/load throughput, ours vs torch.distributed.checkpoint (DCP), and the
training stall of blocking vs asynchronous saves.

    python benchmarks/bench_checkpoint.py [--size small] [--world 2] [--reps 3]

One FSDP2 job (``helpers.checkpoint.dcp.fsdp2_job``: PyTorch's ``fully_shard`` with
AdamW, two steps so the moments exist) on ``--world`` gloo ranks. Its state
(weights + two Adam moments, sharded) is saved and loaded ``--reps`` times by each
system, alternating, into fresh directories; times are rank 0's wall clock around the
collective call, median over the repetitions. Throughput = bytes on disk / time.
Stall = how long the training thread is blocked: a blocking ``save``; ``AsyncSaver.save``
(a copy into a reused staging buffer); ``dcp.async_save`` (its staging copy). The
background writes are waited for outside the timed region.

Two more rows save and load our checkpoint of the course's own sharded jobs on the
same model: ``helpers.fsdp.FSDP`` with AdamW (``fsdp_state``) and ZeRO-3
(``zero_state``), each against DCP on the FSDP2 job (the same weights and moments,
so about the same bytes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from _args import at_least, check_size_seq  # (benchmarks/ is on sys.path)
from helpers import launch

SAVE_STEPS = 2


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(directory: str, size: str, reps: int) -> dict:
    """Rank function: every timing of the table, on rank 0's clock."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from helpers.checkpoint import AsyncSaver, load_latest, save
    from helpers.checkpoint.dcp import (dcp_load, dcp_save, fsdp2_request, fsdp2_state,
                                        load_fsdp2_state)
    from helpers.fsdp import torch_fsdp2
    from helpers.model import build_model
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch_fsdp2(build_model(size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    T = min(64, model.config.block_size)
    x = torch.randint(0, model.config.vocab_size, (2, T))
    for _ in range(SAVE_STEPS):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    rank = dist.get_rank()

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()  # a save counts when every rank is done
        return time.perf_counter() - t0

    times = {k: [] for k in ("save ours", "save DCP", "load ours", "load DCP", "stall blocking",
                             "stall AsyncSaver", "stall DCP async_save")}
    sizes = {}
    saver = AsyncSaver()
    for i in range(reps):
        ours, theirs = f"{directory}/ours{i}", f"{directory}/dcp{i}"
        times["save ours"].append(timed(lambda: save(ours, fsdp2_state(model, opt), 1)))
        times["save DCP"].append(timed(lambda: dcp_save(theirs, model, opt)))
        sizes = {"ours": _du(ours), "DCP": _du(theirs)}

        def load_ours():
            got = load_latest(ours, like=fsdp2_request(model, opt))
            load_fsdp2_state(model, opt, got.state)

        times["load ours"].append(timed(load_ours))
        times["load DCP"].append(timed(lambda: dcp_load(theirs, model, opt)))
        # Stalls: the training thread's time only, per rank (no barrier inside).
        dist.barrier()
        t0 = time.perf_counter()
        save(f"{directory}/block{i}", fsdp2_state(model, opt), 1)
        times["stall blocking"].append(time.perf_counter() - t0)
        dist.barrier()
        state = fsdp2_state(model, opt)  # (a dict of views, built outside the stall)
        t0 = time.perf_counter()
        saver.save(f"{directory}/async{i}", state, 1)
        times["stall AsyncSaver"].append(time.perf_counter() - t0)
        saver.wait()
        msd, osd = get_state_dict(model, opt)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/dasync{i}")
        times["stall DCP async_save"].append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
        if rank == 0:
            for d in (ours, theirs, f"{directory}/block{i}", f"{directory}/async{i}",
                      f"{directory}/dasync{i}"):
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
    for kind in ("helpers.fsdp", "ZeRO-3"):
        times.update(_ours_on(kind, size, x, directory, reps, timed, sizes))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"median": med, "bytes": sizes}


def _ours_on(kind: str, size: str, x, directory: str, reps: int, timed, sizes: dict) -> dict:
    """Save and load times of our checkpoint of a helpers.fsdp or ZeRO-3 job."""
    import torch
    import torch.distributed as dist

    from helpers.checkpoint import (fsdp_request, fsdp_state, load_fsdp_state, load_latest,
                                    load_zero_state, save, zero_request, zero_state)
    from helpers.fsdp import FSDP
    from helpers.model import build_model
    from helpers.zero import ZeroOptimizer

    model = build_model(size)
    if kind == "helpers.fsdp":
        model = FSDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        key, state, request = "fsdp", fsdp_state, fsdp_request

        def restore(st):
            load_fsdp_state(model, opt, st)
    else:
        opt = ZeroOptimizer(model, 3, lr=1e-3)
        key = "zero"

        def state(model, opt):
            return zero_state(opt)

        def request(model, opt):
            return zero_request(opt)

        def restore(st):
            load_zero_state(opt, st)
    for _ in range(SAVE_STEPS):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    times = {f"save {kind}": [], f"load {kind}": []}
    for i in range(reps):
        d = f"{directory}/{kind}{i}"
        times[f"save {kind}"].append(timed(lambda: save(d, {key: state(model, opt)}, 1)))
        sizes[kind] = _du(d)
        times[f"load {kind}"].append(timed(
            lambda: restore(load_latest(d, like={key: request(model, opt)}).state[key])))
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    check_size_seq(args.size, 1)
    at_least(args, "world", 2, "a sharded checkpoint needs ranks")
    at_least(args, "reps", 1, "timed repetitions")
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as d:
        res = launch(measure, args.world, d, args.size, args.reps, timeout=600)[0]
    m, b = res["median"], res["bytes"]
    mb = 2**20
    print(f"model {args.size!r} under FSDP2 + AdamW, {args.world} gloo ranks, median of "
          f"{args.reps}; on disk: ours {b['ours'] / mb:.1f} MiB, DCP {b['DCP'] / mb:.1f} MiB")
    print(f"{'':22s} {'ours':>12s} {'DCP':>12s} {'ours / DCP':>11s}")
    for what in ("save", "load"):
        ours = b["ours"] / m[f"{what} ours"] / mb
        theirs = b["DCP"] / m[f"{what} DCP"] / mb
        print(f"{what + ' MiB/s':22s} {ours:12.1f} {theirs:12.1f} {ours / theirs:11.2f}")
    print(f"\nours on the course's sharded jobs vs DCP on FSDP2 (MiB/s, ratio to DCP)")
    for kind in ("helpers.fsdp", "ZeRO-3"):
        row = []
        for what in ("save", "load"):
            ours = b[kind] / m[f"{what} {kind}"] / mb
            row.append(f"{what} {ours:8.1f} ({ours / (b['DCP'] / m[f'{what} DCP'] / mb):.2f})")
        print(f"{kind:22s} {b[kind] / mb:6.1f} MiB   " + "   ".join(row))
    print(f"\n{'training stall':22s} {'ms':>12s} {'blocking / this':>16s}")
    for k in ("stall blocking", "stall AsyncSaver", "stall DCP async_save"):
        print(f"{k[6:]:22s} {m[k] * 1e3:12.1f} {m['stall blocking'] / m[k]:16.1f}")


if __name__ == "__main__":
    main()
