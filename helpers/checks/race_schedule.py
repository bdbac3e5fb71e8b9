"""A deterministic schedule for the ranks' races, for checks whose verdict would
otherwise depend on timing (chapter 17's atomic save).

What a broken save does depends on timing: a rank that returns before the commit, a
directory used before rank 0 made it, a manifest written while rank 1 is dying. Left to
the scheduler, the same code passes one run and fails the next, naming whichever race
it lost. So the check decides the order itself. Each rank publishes what it is doing in
a status file (running, blocked in a collective of some group, creating a directory,
renaming, done, raised, frozen); a rank about to create a directory or to rename, and a
rank about to be killed, first waits until every other rank has gone as far as it can
without it: returned, raised, or blocked in a collective that needs a rank that is
waiting. Whatever the learner's code does, it then does it in that one order, every run.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

__all__ = ["RaceSchedule", "PARKED", "SETTLE_S"]

SETTLE_S = 10.0   # a rank that neither returns nor blocks by then is let be (its own bug)


class RaceSchedule:
    """One rank's side of the schedule (the module docstring): its status file and the waits.

    A status is a state and the rank's count of collectives entered per group, as JSON:
    {"state": "running" | "blocked" | "mkdir" | "renaming" | "frozen" | "done" | "raised",
    "group": the ranks of the collective it is blocked in, "counts": {group: n}}. Counts
    make "blocked" exact: the i-th collective of a group pairs the i-th of every member,
    so a rank blocked in its n-th collective of a group waits for a member that has
    entered fewer than n of them, and for nobody once every member has (a status not yet
    rewritten after a collective completed reads as blocked, and is not)."""

    def __init__(self, status_dir: str, rank: int, world: int):
        self.dir, self.rank, self.world = status_dir, rank, world
        self.real_replace, self.depth = os.replace, 0
        self.counts: dict[str, int] = {}
        self.state, self.group = "running", None

    def publish(self, state: str, group: str | None = None) -> None:
        import json
        self.state, self.group = state, group
        path = os.path.join(self.dir, str(self.rank))
        with open(path + ".tmp", "w") as f:
            json.dump({"state": state, "group": group, "counts": self.counts}, f)
        self.real_replace(path + ".tmp", path)

    def states(self) -> dict[int, dict]:
        import json
        out = {}
        for r in range(self.world):
            try:
                with open(os.path.join(self.dir, str(r))) as f:
                    out[r] = json.load(f)
            except (OSError, ValueError):
                out[r] = {"state": "running", "group": None, "counts": {}}
        out[self.rank] = {"state": self.state, "group": self.group, "counts": self.counts}
        return out

    def wait_for_others(self, settled_states: tuple, waits_for: set[str]) -> None:
        """Until every other rank is in one of ``settled_states`` or blocked in a
        collective that waits for a rank in one of the states ``waits_for`` (this rank
        counts as in them)."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            states = self.states()
            holders = [r for r, st in states.items()
                       if r == self.rank or st["state"] in waits_for]

            def settled(st):
                if st["state"] in settled_states:
                    return True
                if st["state"] != "blocked":
                    return False
                n = st["counts"].get(st["group"], 0)
                members = {int(x) for x in st["group"].split(",")}
                # blocked for real: a member it needs has not entered this collective yet
                return any(h in members and states[h]["counts"].get(st["group"], 0) < n
                           for h in holders)

            if all(settled(st) for r, st in states.items() if r != self.rank):
                return
            time.sleep(0.005)

    def before(self, call) -> None:
        """The wire's observer (``helpers.launch.wire``): see ``post``."""

    def post(self, call, post):
        """A blocking collective or receive, however spelled: this rank is "blocked" in
        the group's collective (counted per group, so others can tell whether a member
        they need has entered it) until it completes. Asynchronous calls and sends do
        not block the rank, so they are posted as they are."""
        from helpers.launch import wire

        if call.async_op or call.op == "send":
            return post()
        key = ",".join(map(str, call.ranks))
        self.counts[key] = self.counts.get(key, 0) + 1
        self.publish("blocked", key)
        try:
            post().wait()
        finally:
            self.publish("running")
        return wire.work(lambda: None, lambda: True)


# where a rank that creates a directory or renames lets the others be: returned, raised,
# stopped for good (frozen), or waiting at such a point itself
PARKED = ("done", "raised", "frozen", "renaming", "mkdir")
