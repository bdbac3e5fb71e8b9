"""Why a launch hung under NCCL's rules: the caller's side of ``helpers.launch.nccl_rules``.

A rank under the rules writes each wait it starts (to create a communicator, or on a
pair's stream for the matching receive) to its record channel before it blocks, and
"joined" when it gets through. When a launch fails, the launcher reads every rank's
events and this module says who waited for whom, and why nccl would wait there too:
the text is appended to the error (``err.nccl_rules``).
"""

from __future__ import annotations

from helpers.launch import hooks
from helpers.launch.errors import RankTimeout, cell_name


def where(site: tuple[tuple[str, int], ...]) -> str:
    """' at Cell In[3], line 4' or ' at helpers/x.py:12 (from Cell In[3], line 4)', in the
    caller (where IPython can name a notebook cell)."""
    if not site:
        return ""
    text = f" at {cell_name(*site[0])}"
    return text + (f" (from {cell_name(*site[1])})" if len(site) > 1 else "")


def waiting(events: dict[int, list[tuple]]) -> dict[int, list[tuple]]:
    """rank -> its unfinished waits ("wait" events without "joined"), in order."""
    out = {}
    for rank, evs in events.items():
        open_waits = {}
        for ev in evs:
            if ev[0] != "nccl_rules":
                continue
            if ev[1] == "wait":
                open_waits[ev[3]] = ev
            elif ev[1] == "joined":
                open_waits.pop(ev[3], None)
        if open_waits:
            out[rank] = list(open_waits.values())
    return out


_WHY = {
    "pair": "A lone send/recv/isend/irecv creates a communicator for its pair of ranks at "
            "the pair's first such call, and blocks until both ranks call (torch's "
            "ProcessGroupNCCL::pointToPoint); ranks waiting for each other in a circle "
            "never get there. Post each step's sends and receives together with "
            "dist.batch_isend_irecv([P2POp(...), ...]).",
    "stream": "A pair's lone sends and receives run one after another on one stream, in "
              "the order they were posted, and a send finishes only when the peer's "
              "stream runs the matching receive (NCCL's ncclSend blocks its stream; torch's "
              "ProcessGroupNCCL::pointToPoint puts both directions of a pair on one "
              "stream): two ranks that each send before they receive wait for each other, "
              "whatever the message size once NCCL's buffers are full. A batched call on "
              "the peer never matches a lone one (it runs on the group's communicator). "
              "Post each step's sends and receives together with "
              "dist.batch_isend_irecv([P2POp(...), ...]).",
    "group": "The first collective or batch_isend_irecv on a group creates the group's "
             "communicator and blocks the host until every rank of the group gets there, "
             "also with async_op=True (torch's batch_isend_irecv docstring; lazy "
             "initialisation; a barrier or an object collective runs on gloo on a GPU node "
             "and creates nothing); run a collective on the group first, on every rank of "
             "it, or include every rank in that first batch.",
}


def explain(events: dict[int, list[tuple]], timed_out: bool = True) -> str | None:
    """Why the ranks hung, when they hung creating nccl communicators or on a pair's
    stream (only when the launch timed out: a wait on a stream is ordinary while a
    message is on its way)."""
    stuck = waiting(events)
    lines, kinds = [], []
    for rank, evs in sorted(stuck.items()):
        for ev in evs:
            _, _, kind, _, me, others, what, site = ev
            if kind in ("stream", "recv") and not timed_out:
                continue
            at = where(site)
            if kind == "pair":
                line = (f"  rank {me}: its first lone {what}{at} waits for rank "
                        f"{others[0]} to join their two-rank communicator")
            elif kind == "stream":
                line = (f"  rank {me}: its {what}{at} waits for rank {others[0]}'s stream "
                        f"to reach the matching lone receive")
            elif kind == "recv":
                line = (f"  rank {me}: its {what}{at} waits for rank {others[0]}'s "
                        f"matching lone send")
            else:
                line = f"  rank {me}: {what}{at} waits for ranks {list(others)}"
            lines.append(line)
            kinds.append("stream" if kind == "recv" else kind)
    if not lines:
        return None
    head = ("Under NCCL's rules (nccl_rules=True), ranks were blocked creating NCCL "
            "communicators, as they would on a GPU node:" if "stream" not in kinds else
            "Under NCCL's rules (nccl_rules=True), ranks were blocked as they would be on "
            "a GPU node:")
    return "\n".join([head] + lines + [_WHY[k] for k in ("pair", "stream", "group")
                                       if k in kinds])


def report_failure(err, events: dict[int, list[tuple]], status: dict[int, str]) -> None:
    """The launch's failure report (helpers.launch.hooks): say which communicator or
    stream each stuck rank was waiting for."""
    text = explain(events, timed_out=isinstance(err, RankTimeout))
    if text:
        err.nccl_rules = text
        err.args = (f"{err.args[0]}\n\n{text}",) + err.args[1:]


hooks.register_failure_report(report_failure)


__all__ = ["waiting", "explain", "report_failure", "where"]
