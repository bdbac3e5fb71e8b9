"""What a launch checks before any rank starts: the backend and the arguments.

A bad argument is refused here, in the caller, with a message naming the
constraint, rather than as an error from every rank.
"""

from __future__ import annotations

import os
from typing import Any, Callable


def backend_for(backend: str, world_size: int, n_gpus: int, nccl: bool = True) -> str:
    """The backend a launch of ``world_size`` ranks asking for ``backend`` gets on a
    machine with ``n_gpus`` GPUs ("auto": nccl with one GPU per rank, else gloo: nccl
    cannot put two ranks on one GPU). ``tools/launch_log.py --gpus`` replays a logged
    run with it for other GPU counts."""
    if backend == "auto":
        return "nccl" if nccl and n_gpus >= world_size else "gloo"
    return backend


def resolve_backend(backend: str, world_size: int) -> str:
    import torch
    import torch.distributed as dist

    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return backend_for(backend, world_size, n_gpus, dist.is_nccl_available())
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend='nccl' asked for, but this torch build has no nccl "
                               "(a CPU build?). Use backend='gloo' or 'auto'.")
        if n_gpus < world_size:
            raise RuntimeError(f"backend='nccl' needs one GPU per rank: {world_size} ranks asked "
                               f"for, {n_gpus} GPU(s) visible. Use fewer ranks or backend='gloo'.")
    return backend


def group_backend(backend: str) -> str:
    """What init_process_group gets. An nccl job also gets gloo for CPU
    tensors: nccl moves only CUDA tensors, and a rank function that keeps the
    tiny model (or a counter, or a list of results) on the CPU should still run
    on a GPU node rather than fail with "no backend for device cpu"."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def local_rank_limit() -> int:
    """Most ranks one machine runs: more processes than that thrash its cores."""
    return max(64, 8 * (os.cpu_count() or 1))


def check_args(fn: Callable, world_size: Any, timeout: Any, local: bool = True) -> None:
    """``local``: all ``world_size`` ranks run on this machine (a launch); under
    torchrun the limit applies to the ranks it started here (helpers.launch.torchrun)."""
    if not callable(fn):
        raise TypeError(f"launch needs a function to run on every rank, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    cores = os.cpu_count() or 1
    if local and world_size > local_rank_limit():
        raise ValueError(f"world_size={world_size} local ranks on {cores} cores would thrash; "
                         f"use at most {local_rank_limit()} (or torchrun across machines)")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
