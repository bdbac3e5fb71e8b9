"""The point-to-point messages of a pipeline schedule, planned before any rank runs.

Each action of a schedule needs at most one message before it computes and
sends at most one after it:

    F(j) on virtual stage s: needs activation j from stage s-1 (unless s = 0),
                             sends activation j to stage s+1 (unless s is the last)
    B(j) on virtual stage s: needs gradient j from stage s+1 (unless s is the last),
                             sends gradient j to stage s-1 (unless s = 0)

``plan_messages(schedule)`` lists them for every rank and action, and settles
three questions that the executor (``helpers.pipeline.executor``) would
otherwise leave to luck.

1. **Which sends and receives are posted together** (for nccl). On nccl a
   send finishes only once the peer runs the matching receive, and a rank's
   sends and receives run one after the other, in the order they were posted,
   on a CUDA stream (the CPU does not wait: ``wait()`` only orders streams).
   In 1F1B's steady phase rank r sends activation k + w to rank r+1 and then
   needs gradient k from it, while rank r+1 sends gradient k to rank r and
   then needs an activation from it. Posted as separate calls, each rank's
   receive queues behind its own send, and each send waits for a receive that
   is queued behind the other rank's send: both streams stall. Operations
   posted together in one ``dist.batch_isend_irecv`` (an nccl group) progress
   together, which breaks the cycle: Megatron-LM's ``send_forward_recv_backward``
   does exactly that (megatron/core/pipeline_parallel/p2p_communication.py), as
   does ``torch.distributed.pipelining``'s ``Schedule1F1B``.

   Pairing a send with the next receive from the same peer is not enough for
   every schedule: interleaved 1F1B on two ranks still stalls (a rank sends a
   gradient for one chunk before it receives the gradient for the other, on
   both ranks at once; ``stream_model`` finds it). So we group the way
   ``torch.distributed.pipelining``'s multi-stage schedules do. Give every
   action a *time step*: its start time if each action took one unit and
   started as soon as its inputs exist (``steps``). A rank posts one group per
   step: the message its own action of that step sends, plus the receives of
   all messages its neighbours send at that step. Every operation's partner is
   then in the peer's group of the same step, groups are posted in step order
   on every rank, so the groups of step t can only wait for groups of step t
   (induction on t: no stall). In 1F1B's steady phase this *is* Megatron's
   pair: rank r's step holds "send activation k + w, receive gradient k".
   Every operation goes through ``batch_isend_irecv``, including groups of one:
   PyTorch puts batched operations on the process group's communicator and
   lone ``isend``/``irecv`` on a separate two-rank one, and a send on one
   communicator never meets a receive on the other. ``post`` is that one call,
   for the executor and for the short 1F1B loop (``helpers.pipeline.plain_1f1b``).

   gloo queues nothing (each operation progresses on its own, and a receive
   is matched by tag), so on gloo the groups only post receives a little
   earlier than needed; the executor still waits for a receive only when its
   action runs, and never waits for a send to make progress.
   ``stream_model`` plays posted calls under nccl's rules and raises
   ``ScheduleDeadlock`` if they stall; the tests run it on every schedule with
   separate calls (1F1B stalls), with pairs (interleaved stalls) and with
   steps (nothing stalls). No multi-GPU machine checked this: the model is the
   argument.

2. **When a sent tensor may be freed.** ``isend`` keeps its tensor until the
   receiver has it. Keeping every send until the end of the step holds all m
   activations and m gradients a rank sent, which undoes 1F1B's memory saving;
   waiting on a send too early can block a rank on a peer that waits for it.
   We wait on a send exactly when the schedule *proves* it has arrived: when
   this rank receives a message that the receiver sent after it took ours,
   directly or through other ranks. Vector clocks (Fidge 1988, Mattern 1989:
   each action carries, per rank, the last action of that rank known to have
   happened before it) find that point. Such a wait returns at once, so it
   cannot add a deadlock. Sends nobody can vouch for (the gradients of a
   rank's last backwards, which the previous stage never answers) are waited
   on at the end of the step: at most p per rank in 1F1B, whatever m. GPipe's
   gradients all go out after the previous stage's last message, so a GPipe
   rank keeps its m sent gradients (one activation each) to the end, while its
   stash of m micro-batches drains.

3. **Order.** nccl matches a rank pair's messages in the order they were
   posted and ignores tags; gloo matches by tag. With one group per step and
   at most one message per rank pair and direction in a step, both sides post
   a pair's messages in the same order (``plan_messages`` checks it), so the
   executor is right on both.

How production differs: Megatron-LM hard-codes the groups per schedule phase
(``send_forward_recv_backward``, ``send_backward_recv_forward`` and the
interleaved variants); ``torch.distributed.pipelining`` lowers a schedule to
per-rank action lists with time steps, batches each step's sends and receives
and waits on them before the next step. Neither plans releases with vector
clocks: they wait on a step's sends before the next sends.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from helpers.pipeline.schedules import Action, schedule_shape
from helpers.pipeline.simulate import ScheduleDeadlock, validate_schedule

__all__ = ["Message", "RankPlan", "plan_messages", "comm_calls", "stream_model", "tag", "post"]

ACTIVATION, GRADIENT = 0, 1


def tag(direction: int, microbatch: int, dst_stage: int, num_virtual: int) -> int:
    """A tag unique per (activation | gradient, micro-batch, receiving stage)."""
    return (microbatch * num_virtual + dst_stage) * 2 + direction


class Message(NamedTuple):
    direction: int    # ACTIVATION (forward) or GRADIENT (backward)
    microbatch: int
    src_stage: int    # virtual stages
    dst_stage: int
    src: int          # ranks (stage % p)
    dst: int
    tag: int

    @property
    def local(self) -> bool:  # both stages on one rank (p = 1, or interleaving wraps round)
        return self.src == self.dst

    def __repr__(self) -> str:
        what = "act" if self.direction == ACTIVATION else "grad"
        return f"{what}{self.microbatch}[{self.src_stage}->{self.dst_stage}]"


Op = tuple[str, Message]  # ("send" | "recv", message)


@dataclasses.dataclass
class RankPlan:
    """What one rank receives and sends, indexed by its action list."""
    recv: list[Message | None]      # the message action i needs before it computes
    send: list[Message | None]      # the message action i sends after it computes
    step: list[int]                 # time step of action i (unit-time, as soon as possible)
    groups: dict[int, list[Op]]     # step -> the remote operations posted together
    release: list[list[int]]        # after action i's receive: wait on the sends of these
                                    # earlier actions (proved received, so it returns at once)
    unreleased: list[int]           # sends waited on only at the end of the step


def _messages(a: Action, rank: int, p: int, S: int) -> tuple[Message | None, Message | None]:
    s = a.chunk * p + rank
    j = a.microbatch
    if a.kind == "F":
        src, dst = s - 1, s + 1
        recv = None if s == 0 else Message(ACTIVATION, j, src, s, src % p, rank,
                                           tag(ACTIVATION, j, s, S))
        send = None if s == S - 1 else Message(ACTIVATION, j, s, dst, rank, dst % p,
                                               tag(ACTIVATION, j, dst, S))
    else:
        src, dst = s + 1, s - 1
        recv = None if s == S - 1 else Message(GRADIENT, j, src, s, src % p, rank,
                                               tag(GRADIENT, j, s, S))
        send = None if s == 0 else Message(GRADIENT, j, s, dst, rank, dst % p,
                                           tag(GRADIENT, j, dst, S))
    return recv, send


def plan_messages(schedule: Sequence[Sequence]) -> list[RankPlan]:
    """One ``RankPlan`` per rank; ValueError / ScheduleDeadlock for an invalid schedule."""
    sched = validate_schedule(schedule)
    p, _, v = schedule_shape(sched)
    S = p * v                                   # virtual stages
    msgs = [[_messages(a, r, p, S) for a in row] for r, row in enumerate(sched)]
    sender = {snd: (r, i) for r, row in enumerate(msgs) for i, (_, snd) in enumerate(row) if snd}
    receiver = {rcv: (r, i) for r, row in enumerate(msgs) for i, (rcv, _) in enumerate(row) if rcv}

    # Walk the actions in an order where every message is sent before it is received
    # (validate_schedule proved one exists) and give each action
    #   step[(r, i)]: start time if every action took 1 and started as soon as it could;
    #   vc[(r, i)][q]: the last action of rank q that happens before action i of rank r
    #                  ends (-1: none), following program order and messages.
    step: dict[tuple[int, int], int] = {}
    vc: dict[tuple[int, int], list[int]] = {}
    pos = [0] * p
    while any(pos[r] < len(sched[r]) for r in range(p)):
        for r in range(p):
            while pos[r] < len(sched[r]):
                i = pos[r]
                t = step[(r, i - 1)] + 1 if i else 0
                clock = list(vc[(r, i - 1)]) if i else [-1] * p
                rcv = msgs[r][i][0]
                if rcv is not None:
                    src = sender[rcv]
                    if src not in step:
                        break                  # its input is not sent yet: next rank
                    t = max(t, step[src] + 1)
                    clock = [max(x, y) for x, y in zip(clock, vc[src])]
                clock[r] = i
                step[(r, i)], vc[(r, i)] = t, clock
                pos[r] += 1

    plans = []
    for r, row in enumerate(msgs):
        n = len(row)
        groups: dict[int, list[Op]] = {}
        for i, (_, snd) in enumerate(row):       # our sends, at the step that makes them
            if snd is not None and not snd.local:
                groups.setdefault(step[(r, i)], []).append(("send", snd))
        for i, (rcv, _) in enumerate(row):       # our receives, at the step of their sender
            if rcv is not None and not rcv.local:
                groups.setdefault(step[sender[rcv]], []).append(("recv", rcv))
        release: list[list[int]] = [[] for _ in range(n)]
        unreleased = []
        for k, (_, snd) in enumerate(row):
            if snd is None or snd.local:
                continue
            q, c = receiver[snd]  # consumed by action c of rank q, at that action's start
            # first later action of ours that receives news of q's action c (or later)
            later = next((i for i in range(k + 1, n) if vc[(r, i)][q] >= c), None)
            (unreleased.append(k) if later is None else release[later].append(k))
        plans.append(RankPlan([m[0] for m in row], [m[1] for m in row],
                              [step[(r, i)] for i in range(n)], dict(sorted(groups.items())),
                              release, unreleased))

    # nccl ignores tags: both sides of every rank pair must post its messages in one order
    for a in range(p):
        for b in range(p):
            sent = [m for _, ops in plans[a].groups.items() for k, m in ops
                    if k == "send" and m.dst == b]
            got = [m for _, ops in plans[b].groups.items() for k, m in ops
                   if k == "recv" and m.src == a]
            if sent != got:  # cannot happen with one group per step; a guard for edits
                raise AssertionError(f"rank {a} posts {sent} to rank {b}, which posts {got}")
    return plans


def post(ops: Sequence[tuple[str, torch.Tensor, int, int]], group=None) -> list:
    """Post sends and receives together, as one ``dist.batch_isend_irecv`` (one nccl
    group: they progress together, point 1 above), a group of one included; return
    one work handle per operation (nccl coalesces a group into a single handle).

    ops: ("send" | "recv", tensor, peer's global rank, tag); none: nothing posted."""
    if not ops:
        return []
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv,
                                               t, peer, group=group, tag=tag)
                                    for kind, t, peer, tag in ops])
    return works if len(works) == len(ops) else [works[0]] * len(ops)


def comm_calls(plan: RankPlan, how: str = "steps") -> list[tuple[bool, tuple[Op, ...]]]:
    """The calls one rank posts, in order, as (batched, operations posted together).

    how: "steps" (what the executor does: one ``batch_isend_irecv`` per time step);
         "pairs" (a send batched with the next action's receive when both go to the
         same peer, everything else a lone isend / irecv);
         "separate" (every operation a lone isend / irecv, in program order)."""
    if how == "steps":
        return [(True, tuple(ops)) for ops in plan.groups.values()]
    if how not in ("pairs", "separate"):
        raise ValueError(f"how must be 'steps', 'pairs' or 'separate', got {how!r}")
    calls: list[tuple[bool, tuple[Op, ...]]] = []
    n = len(plan.recv)
    prefetched = False
    for i in range(n):
        rcv, snd = plan.recv[i], plan.send[i]
        if rcv is not None and not rcv.local and not prefetched:
            calls.append((False, (("recv", rcv),)))
        prefetched = False
        if snd is not None and not snd.local:
            nxt = plan.recv[i + 1] if i + 1 < n else None
            if how == "pairs" and nxt is not None and not nxt.local and nxt.src == snd.dst:
                calls.append((True, (("send", snd), ("recv", nxt))))
                prefetched = True
            else:
                calls.append((False, (("send", snd),)))
    return calls


def stream_model(calls: Sequence[Sequence[tuple[bool, tuple[Op, ...]]]],
                 one_stream: bool = False) -> None:
    """Play every rank's calls (``comm_calls``) the way nccl runs them; raise
    ScheduleDeadlock, naming each rank's stuck call, if they stall.

    The rules: the CPU never blocks, so each rank posts all its calls in order.
    PyTorch runs a lone isend / irecv on a two-rank communicator of the pair and
    batched calls on the process group's own communicator; each communicator has
    one stream per rank (``one_stream=True``: every call on one communicator and
    stream, as when p2p shares the group's communicator). A call starts when it
    reaches the head of its stream; a send or receive in it finishes when its
    partner is in a started call on the peer, on the same communicator. A call
    ends when all its operations have. Sends get no buffering: small messages may
    slip through without a receiver, large ones do not."""
    def comm(rank: int, batched: bool, op: Op):
        peer = op[1].dst if op[0] == "send" else op[1].src
        if one_stream or batched:
            return "group"
        return ("pair",) + tuple(sorted((rank, peer)))

    queues: dict[tuple, list[list[Op]]] = {}
    owner: dict[tuple, tuple] = {}
    for r, rank_calls in enumerate(calls):
        for batched, ops in rank_calls:
            key = (r, comm(r, batched, ops[0]))
            queues.setdefault(key, []).append(list(ops))
            for op in ops:
                owner[(r, op)] = key
    heads = dict.fromkeys(queues, 0)
    while True:
        started = {(r, op) for (r, c), q in queues.items() if heads[(r, c)] < len(q)
                   for op in q[heads[(r, c)]]}
        done = []
        for r, (kind, msg) in started:
            peer, other = (msg.dst, "recv") if kind == "send" else (msg.src, "send")
            if (peer, (other, msg)) in started and \
                    owner[(peer, (other, msg))][1] == owner[(r, (kind, msg))][1]:
                done.append((r, (kind, msg)))
        if not done:
            break
        for r, op in done:
            key = owner[(r, op)]
            queues[key][heads[key]].remove(op)
        for key, q in queues.items():
            while heads[key] < len(q) and not q[heads[key]]:
                heads[key] += 1
    stuck = [(key, q[heads[key]]) for key, q in sorted(queues.items(), key=str)
             if heads[key] < len(q)]
    if stuck:
        detail = "; ".join(f"rank {r} at " + " + ".join(f"{k} {m!r}" for k, m in ops)
                           for (r, _), ops in stuck)
        raise ScheduleDeadlock(f"the posted sends and receives stall on nccl's streams: {detail}")
