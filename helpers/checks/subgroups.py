"""Process groups for the checks: run a learner's code in a group that is not the world.

A learner's ``dist.all_reduce(x)`` without ``group=`` sums over every rank of the job;
in a check that always passes the default group it gives the same numbers as the right
``dist.all_reduce(x, group=group)``, and so does ``dist.get_rank()`` in place of the
rank inside the group. On a real mesh (tensor parallelism inside data parallelism,
chapter 20) both are wrong. A check that runs the exercise in groups whose members are
not ranks 0..t-1, with different data in each group, sees the difference: a
collective that ignores ``group=`` mixes in another group's data, a global rank used as
a group rank picks the wrong slice.

``split_world(layout)``: every rank creates every group of ``layout`` (torch needs every
rank of the job to call ``new_group`` for every group, in the same order), and gets back
its own group, its index in the layout and the group's members.
"""

from __future__ import annotations

__all__ = ["split_world", "describe"]


def split_world(layout: list[list[int]]):
    """(this rank's group, the group's index in ``layout``, its members) on the calling
    rank. ``layout``: disjoint lists of global ranks covering the world."""
    import torch.distributed as dist

    me = dist.get_rank()
    mine = None
    for index, members in enumerate(layout):
        group = dist.new_group(ranks=list(members))
        if me in members:
            mine = (group, index, list(members))
    if mine is None:
        raise ValueError(f"rank {me} is in no group of {layout}")
    return mine


def describe(layout: list[list[int]]) -> str:
    """'groups [0] and [1, 2, 3]' for messages."""
    parts = [str(list(m)) for m in layout]
    return "groups " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1
                        else parts[0])
