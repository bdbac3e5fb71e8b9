"""Process groups in the checks: run a learner's code in groups that are not the world,
and catch a collective that leaves out the group it was given.

A learner's ``dist.all_reduce(x)`` without ``group=`` sums over every rank of the job;
in a check that always passes the default group it gives the same numbers as the right
``dist.all_reduce(x, group=group)``, and so does ``dist.get_rank()`` in place of the
rank inside the group. On a real mesh (tensor parallelism inside data parallelism,
chapter 20) both are wrong. ``split_world(layout)`` makes every group of a layout (torch
needs every rank of the job to call ``new_group`` for every group, in the same order) and
returns the calling rank's own; a check that runs the exercise in groups whose members
are not ranks 0..t-1, with different data in each group, sees the difference.

A lab function that takes ``group=`` (ZeRO's shard group, an FSDP unit's group, an EP
group) must pass it to every collective. Run on the default group with every rank, code
that forgets it gives the right numbers; with two groups of two ranks it mixes the
groups, and gloo fails with a size check or hangs, naming nothing. ``GroupWatch(group,
refuse)`` watches the flat collectives, however they are spelled, for the duration: a
call whose ``group`` is not the one given raises at once, saying so, on every rank alike;
the collectives named in ``refuse`` raise with their reason.
"""

from __future__ import annotations

__all__ = ["GroupWatch", "split_world", "describe"]


class GroupWatch:
    """Inside ``with``: the collectives named in ``refuse`` raise with a reason, and,
    when a group was given, a flat collective called without ``group=group`` raises
    before it runs (it would run over the whole world and fail on a size check, or
    hang, with no word of the cause), on every rank alike. It watches the process
    group's methods (``helpers.launch.wire``), so torch's names, names imported before,
    and ``helpers.comm``'s own are all seen."""

    FLAT = ("reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor")

    def __init__(self, group, refuse: dict):
        self.group, self.refuse = group, refuse
        self._watch = None

    def before(self, call) -> None:
        """The wire's observer."""
        why = self.refuse.get(call.op, self.refuse.get(call.api))
        if why is not None:
            raise RuntimeError(f"dist.{call.api} refused: {why}")
        if self.group is not None and call.op in self.FLAT and \
                call.group.group_name != self.group.group_name:
            raise RuntimeError(f"{call.api} called without group=group: it would run over "
                               f"every rank, not this rank's group. Pass group=group to "
                               f"every collective, and use dist.get_rank(group) and "
                               f"dist.get_world_size(group)")

    def __enter__(self):
        from helpers.launch import wire

        self._watch = wire.observing(self)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc):
        self._watch.__exit__(*exc)


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
