"""Under ``torchrun``: run in the job's own process group, gather every result.

With RANK and WORLD_SIZE in the environment, ``launch`` starts nothing: it
runs ``fn`` in the current process's group (creating it if needed) and
returns every rank's result, gathered with ``all_gather_object``, so the
same chapter code runs multi-node unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from typing import Any

from helpers.launch.arguments import group_backend, resolve_backend
from helpers.launch.rank import seed_everything, to_cpu


def _destroy_group_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()  # no rank tears down while a peer still talks to it
        dist.destroy_process_group()


def launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout, seed, seed_per_rank):
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(..., world_size={world_size}) under torchrun with "
                         f"WORLD_SIZE={env_world}: pass the job's world size")
    if not dist.is_initialized():
        # Every process must pick the same backend, so decide on what they all
        # see alike (GPUs per node vs processes per node), never on this
        # process's own LOCAL_RANK: with 1 GPU and 2 processes that would give
        # rank 0 nccl and rank 1 gloo, and the job fails at the first collective.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(group_backend(backend),
                                timeout=datetime.timedelta(seconds=timeout))
        # We made the group, so we take it down: a group still alive when the
        # interpreter exits can abort the process ("terminate called without an
        # active exception" from a gloo thread), failing a job that succeeded.
        atexit.register(_destroy_group_at_exit)
    rank = dist.get_rank()
    seed_everything(seed + rank if seed_per_rank else seed)
    result = to_cpu(fn(*args, **kwargs))
    results: list[Any] = [None] * env_world
    dist.all_gather_object(results, result)
    return results
