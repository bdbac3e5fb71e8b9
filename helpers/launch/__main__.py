"""``python -m helpers.launch``: torchrun, with a bound on waiting for the other nodes.

It takes torchrun's arguments and runs torchrun (``torch.distributed.run``); two things
differ, both about a node that never comes:

* the rendezvous waits at most ``JOIN_TIMEOUT`` seconds (120) for every node to join,
  not torchrun's 600 (``--rdzv-conf join_timeout=SECONDS`` still sets it), and a
  multi-node agent says so when it starts waiting;
* when the nodes do not all come in time, or the rendezvous endpoint cannot be
  reached, it ends with a sentence that says what is missing and what to check,
  instead of a bare ``RendezvousTimeoutError`` traceback (exit status 1 either way).
  An unreachable endpoint (the first node missing, or a name it does not recognise
  as its own, so that nobody hosts the rendezvous) takes two tries of the store's
  ``read_timeout``, 60 s each by default.

And one repair, so that every node prints its root cause when a job fails. The agent
that hosts the rendezvous (on node0, say) ends as soon as its own workers failed; an
agent on another node asks the rendezvous, every ``--monitor-interval``, whether nodes
wait to join, and torch 2.13 lets the ``RendezvousConnectionError`` of that question
end the agent: it dies with that traceback instead of reporting its workers, which are
failing at that moment (plain torchrun, two nodes of two ranks on one machine, a rank
of the host's node raising: 2 runs of 3 when the other node's ranks waited in the same
all-reduce, 2 of 2 when they were still computing). Here a lost rendezvous counts as
"no node waiting", said once; the agent goes on watching its workers and reports them
as torchrun would.

Everything else, the job's own failures included, is torchrun's: a rank whose
function raised is named in its "Root Cause" (helpers.launch.torchrun). How long a
missing node takes to report, then: ``join_timeout`` after the first agent started,
plus about a second (the rendezvous polls its state once a second).
"""

from __future__ import annotations

import sys

JOIN_TIMEOUT = 120


def with_course_defaults(args):
    """torchrun's parsed arguments with the course's join timeout, unless given."""
    conf = [kv for kv in args.rdzv_conf.split(",") if kv.strip()]
    if not any(kv.split("=")[0].strip() == "join_timeout" for kv in conf):
        args.rdzv_conf = ",".join(conf + [f"join_timeout={JOIN_TIMEOUT}"])
    return args


def _join_timeout(args) -> str:
    for kv in args.rdzv_conf.split(","):
        key, _, value = kv.partition("=")
        if key.strip() == "join_timeout":
            return value.strip()
    return str(JOIN_TIMEOUT)


def tolerate_a_lost_rendezvous() -> None:
    """While workers run, a rendezvous that cannot be reached has no node waiting to join
    (torchrun's agent asks, to restart its workers for a new node); said once. Also
    counts the rendezvous this agent completed (``ROUNDS``), for the messages."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import \
        DynamicRendezvousHandler as Handler

    original = Handler.num_nodes_waiting
    if getattr(original, "course_tolerant", False):
        return
    lost: list[bool] = []

    def num_nodes_waiting(self) -> int:
        if lost:  # (asking again would print c10d's errors ten times a second)
            return 0
        try:
            return original(self)
        except RendezvousConnectionError:
            lost.append(True)
            sys.stderr.write("[course] the rendezvous is gone (its host's agent ended, as it "
                             "does when its ranks failed); this agent goes on watching its "
                             "own ranks\n")
            sys.stderr.flush()
            return 0

    num_nodes_waiting.course_tolerant = True
    Handler.num_nodes_waiting = num_nodes_waiting
    joined = Handler.next_rendezvous

    def next_rendezvous(self):
        info = joined(self)
        ROUNDS.append(True)  # (a later rendezvous error is a restart's, not the start's)
        return info

    Handler.next_rendezvous = next_rendezvous


ROUNDS: list[bool] = []  # rendezvous this agent completed


def _what_started() -> str:
    return "so no rank restarted" if ROUNDS else "so no rank started"


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.elastic.rendezvous.api import (RendezvousConnectionError,
                                                          RendezvousTimeoutError)
    from torch.distributed.run import parse_args, parse_min_max_nnodes, run

    args = with_course_defaults(parse_args(sys.argv[1:] if argv is None else argv))
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    multi_node = max_nodes > 1 and not args.standalone
    where = f"{args.rdzv_endpoint or '(no --rdzv_endpoint)'}"
    if multi_node:
        sys.stderr.write(f"[course] waiting up to {_join_timeout(args)} s for {args.nnodes} "
                         f"node(s) to join rendezvous '{args.rdzv_id}' at {where}\n")
        sys.stderr.flush()
    tolerate_a_lost_rendezvous()
    try:
        record(run)(args)
    except RendezvousTimeoutError:
        sys.stderr.write(
            f"[course] rendezvous '{args.rdzv_id}' at {where} did not gather --nnodes="
            f"{args.nnodes} nodes within join_timeout={_join_timeout(args)} s, "
            f"{_what_started()}. The node(s) missing did not run this same command (same "
            f"--rdzv_id, --nnodes and --rdzv_endpoint), or cannot reach {where} (a firewall, "
            f"or a host name that resolves to another address there). More time: "
            f"--rdzv-conf join_timeout=SECONDS.\n")
        sys.exit(1)
    except RendezvousConnectionError:
        sys.stderr.write(
            f"[course] could not reach the rendezvous at {where}, {_what_started()}. The "
            f"first node hosts it when it recognises the name as its own (as `hostname` "
            f"prints it there): is this same command running there, is the port open, and "
            f"does the name resolve here to an address this node reaches?\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
