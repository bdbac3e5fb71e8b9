"""Agreement between ranks before a checkpoint is written or used.

A save or a load is a collective: every rank must take the same decision
(write, skip this checkpoint, give up), or one rank would wait forever in a
collective the others have left. Each rank says what it found with one
``all_gather_object`` (PyTorch's object collective), and all act on the same
list. At world size 1 (no process group) these are plain code.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from helpers.comm import group_rank, world_size

__all__ = ["rank_and_world", "gather_all", "raise_if_any"]


def rank_and_world(group) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) outside any process group (``helpers.comm``)."""
    return group_rank(group), world_size(group)


def gather_all(obj: Any, group) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    rank, world = rank_and_world(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_if_any(errors: list, what: str) -> None:
    """On every rank alike: raise the first rank's error, if any rank had one."""
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {e}")
