"""Who am I? ``rank_info()`` inside a rank function.

Inside a launch's rank it is what the launcher set when it started the rank;
under ``torchrun`` it is read from the environment torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK: see torch.distributed.run's documentation); anywhere
else, rank 0 of a world of 1.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Who am I? Available inside ``fn`` through ``rank_info()``."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str  # "cpu" or "cuda:<local_rank>"
    nccl_rules: bool = False  # gloo behaving as nccl would (helpers.launch.nccl_rules)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_RANK_INFO: RankInfo | None = None  # set in a launch's rank (helpers.launch.rank)
_TORCHRUN_NCCL_RULES = False  # under torchrun: set once helpers.launch.torchrun installed them


def set_rank_info(info: RankInfo) -> None:
    """Called once in each rank, before ``fn`` runs."""
    global _RANK_INFO
    _RANK_INFO = info


def set_torchrun_nccl_rules(on: bool) -> None:
    """Under torchrun, once the rules are on in this process (they stay on)."""
    global _TORCHRUN_NCCL_RULES
    _TORCHRUN_NCCL_RULES = on


def rank_info() -> RankInfo:
    """Rank, world size, backend and device of the calling rank.

    Outside ``launch`` (and outside torchrun) this is rank 0 of a world of 1.
    """
    if _RANK_INFO is not None:
        return _RANK_INFO
    if under_torchrun():
        return torchrun_info()
    return RankInfo(0, 1, 0, "none", "cpu")


def rank_device(device=None):
    """``device`` when given, else the calling rank's device (``rank_info().device``):
    "cuda:<local_rank>" in an nccl job, "cpu" otherwise and outside a launch. The
    default of every helper that builds a rank's model or batch."""
    return rank_info().device if device is None else device


def in_rank() -> bool:
    """Inside a launch's rank (or its rank server)."""
    return os.environ.get("_COURSE_POOL_WORKER") == "1"


def under_torchrun() -> bool:
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ
            and os.environ.get("_COURSE_POOL_WORKER") != "1")


def torchrun_info() -> RankInfo:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = dist.get_backend() if dist.is_initialized() else "none"
    backend = "nccl" if "nccl" in backend else backend  # "cpu:gloo,cuda:nccl" is an nccl job
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank,
                    backend, device if torch.cuda.is_available() or device == "cpu" else "cpu",
                    _TORCHRUN_NCCL_RULES)
