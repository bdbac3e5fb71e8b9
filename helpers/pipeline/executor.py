"""Run any pipeline schedule on real ranks, with point-to-point send/recv.

The model is cut by depth (``split_model``): ``p * v`` virtual stages, each a
``StageChunk`` holding a contiguous run of transformer blocks; the first also
holds the embeddings, the last the final LayerNorm and the LM head. Rank r
holds chunks ``r, p + r, 2p + r, ...`` (Megatron-LM's interleaving; v = 1 is
the plain pipeline).

``pipeline_step(chunks, schedule, x, y)`` runs one training step's forward
and backward on the calling rank, following its list of actions:

    F(j, c): input = embed(x_j) on virtual stage 0, else the activation
             (B/m, T, C) received from the rank of stage s-1; run the chunk; on
             the last stage compute loss_j / m, else send the output to stage
             s+1. Stash (input, output) until B(j, c).
    B(j, c): on the last stage backprop loss_j / m; else backprop the received
             d(output) from stage s+1; then send d(input) to stage s-1.

Communication is planned before any message moves
(``helpers.pipeline.p2p.plan_messages``; read its docstring for the why):
each action gets a time step, and the rank posts, per step, one
``dist.batch_isend_irecv`` holding the send of its own action at that step and
the receives of what its neighbours send at that step. An action waits only
for its own input. A sent tensor is released as soon as the schedule proves
the receiver has it (the wait then returns at once); the rest at the end.

Why this never deadlocks. On gloo: sends and receives are posted without
blocking, the only blocking wait is an action's own input, and before any
message moves every rank checks that the schedule simulates to completion
(``helpers.pipeline.simulate.validate_schedule``): if the simulator can finish
it, every awaited message has a send that some rank will reach. On nccl,
where sends and receives also queue behind each other on a stream, the
per-step groups keep every operation's partner in the peer's group of the
same step, so no group waits for a later one (``helpers.pipeline.p2p``'s
``stream_model`` checks it for every schedule; this was reasoned and modelled,
not run on a multi-GPU machine). Every message has a known shape (B/m, T, C)
and dtype, so no shape handshake is needed, and a tag naming (direction,
micro-batch, stage); nccl ignores tags, but both sides post a rank pair's
messages in the same order.

Gradient accumulation: each micro-batch's loss is divided by m and ``.grad``
accumulates over micro-batches, so after the step the gradients equal those of
the unsplit model on the whole batch (the mean loss). The tied embedding /
LM-head weight lives on the first and the last stage; after the step those two
ranks add their gradients (``sync_tied_grads``), as Megatron-LM does with an
all-reduce over its "embedding group" (Shoeybi et al. 2019 keep the same tie).

The step records each action's (start, end) on this rank's clock, how long it
waited for its input, and the activations it held for backward, *measured*
from the tensors autograd saves (``helpers.pipeline.stash.StashMeter``): the
peak in bytes and in micro-batches, to compare with the simulator's stash.
All of that lives in ``StepRecorder``, which the loop calls at fixed points
(input awaited, input there, send posted, action done), so the loop itself
holds no timing code.

For 1F1B alone there is a shorter way: its order is fixed, so it can be
written as three loops (warm-up, steady, cool-down) with paired sends and
receives and no plan at all, as Megatron-LM does;
``helpers.pipeline.plain_1f1b`` is that version, equal to this executor bit
for bit.

How production differs: Megatron and ``torch.distributed.pipelining`` also
batch send/recv pairs, but lay out the groups per schedule phase (Megatron) or
wait on each time step's group before the next (PyTorch); Megatron frees the
output tensor's data after sending it ("deallocate_output_tensor"); both
support variable shapes by exchanging them first. On a GPU our timeline
records when the CPU issued the work (nothing here synchronizes the device).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.clock import clock_for, elapsed, seconds
from helpers.comm import group_rank, world_size
from helpers.model import GPT, lm_loss
from helpers.pipeline.p2p import plan_messages, post
from helpers.pipeline.partition import partition
from helpers.pipeline.schedules import Action, schedule_shape
from helpers.pipeline.simulate import validate_schedule
from helpers.pipeline.stash import StashMeter
from helpers.validate import positive_int

__all__ = ["StageChunk", "split_model", "pipeline_step", "StepResult", "sync_tied_grads",
           "reference_grads", "chunk_grads"]


class StageChunk(nn.Module):
    """One virtual stage: blocks[start:end] of a GPT, plus the embeddings if it
    is the first stage and the final norm + head if it is the last.

    Input: token ids (B, T) on the first stage, activations (B, T, C) elsewhere.
    Output: logits (B, T, V) on the last stage, activations (B, T, C) elsewhere.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.layers, self.first, self.last = layers, first, last
        self.n_embd = model.config.n_embd  # width of every activation message
        if first:
            self.wte, self.wpe, self.drop = (copy.deepcopy(m) for m in
                                             (model.wte, model.wpe, model.drop))
            self.block_size = model.config.block_size
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in layers)
        if last:
            self.ln_f = copy.deepcopy(model.ln_f)
            self.lm_head = copy.deepcopy(model.lm_head)
            if first:  # the whole model in one chunk: keep the tie
                self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))      # (B, T) -> (B, T, C)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))                  # (B, T, V)
        return x

    def global_names(self) -> dict[str, str]:
        """This chunk's parameter names -> the unsplit model's names."""
        out = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                out[name] = f"blocks.{self.layers[int(i)]}.{rest}"
            elif name == "lm_head.weight":
                out[name] = "wte.weight"  # tied in the unsplit model
            else:
                out[name] = name
        return out


def split_model(model: GPT, num_stages: int, num_chunks: int = 1,
                layer_costs: Sequence[float] | None = None) -> list[list[StageChunk]]:
    """Cut ``model`` into ``num_stages * num_chunks`` virtual stages; return, for
    each rank, its chunks in chunk order. The split balances ``layer_costs``
    (default: equal cost per block). Raises ValueError before anything runs if
    the model has fewer blocks than virtual stages."""
    positive_int("num_chunks", num_chunks)
    S = num_stages * num_chunks
    n = len(model.blocks)
    if n < S:
        raise ValueError(f"the model has {n} transformer block(s), fewer than the "
                         f"{num_stages} stages x {num_chunks} chunk(s) = {S} virtual stages "
                         f"asked for; build a deeper model (n_layer >= {S}) or use fewer stages")
    costs = n if layer_costs is None else list(layer_costs)
    bounds = partition(costs, S)
    chunks = [StageChunk(model, bounds[s], first=s == 0, last=s == S - 1) for s in range(S)]
    return [[chunks[c * num_stages + r] for c in range(num_chunks)] for r in range(num_stages)]


@dataclasses.dataclass
class StepResult:
    loss: float | None            # mean loss over the batch, on the last stage's rank
    timeline: list[tuple[float, float, Action]]  # this rank's compute intervals, seconds
    peak_stash: float             # most micro-batch activations held at once, measured
                                  # (per chunk: bytes alive / bytes of one micro-batch)
    peak_stash_bytes: int         # most activation bytes held for backward at once
    stash_unit_bytes: list[int]   # bytes one micro-batch holds on each of this rank's chunks
    messages_sent: int            # point-to-point sends this rank posted
    peak_pending_sends: int       # most sent tensors kept alive at once, waiting for delivery
    recv_wait: list[float]        # per action: seconds blocked waiting for its input message
    cpu_time: list[float]         # per action: CPU seconds this thread spent in its interval
                                  # (below the interval's length: the rank waited for a core)


def _post(ops: list, group, global_rank: Callable[[int], int],
          buffers: dict, outgoing: dict) -> dict:
    """Post one time step's sends and receives as one ``batch_isend_irecv`` (one nccl
    group: they progress together; see helpers/pipeline/p2p.py). Returns the work
    handle of each operation, keyed by (kind, message)."""
    works = post([(kind, outgoing[msg], global_rank(msg.dst), msg.tag) if kind == "send"
                  else (kind, buffers[msg], global_rank(msg.src), msg.tag)
                  for kind, msg in ops], group)
    return dict(zip(ops, works))


class StepRecorder:
    """What ``pipeline_step`` measures, kept out of its loop, which calls, per action:
    ``waiting()`` before it blocks for the action's input, ``computing()`` once the
    input is there, ``sent(n)`` after posting a send (n: sends now in flight) and
    ``done(action)`` at its end; ``saving(owner)`` and ``hold(owner, tensor)`` around a
    forward feed the stash meter (``helpers.pipeline.stash``), when there is one."""

    def __init__(self, exclude: list, measure_stash: bool, clock=None):
        self.meter = StashMeter(exclude=exclude) if measure_stash else None
        # helpers.clock marks, resolved in result(): on a GPU, CUDA events, so that
        # "input there" is when the receive finished, not when nccl queued it
        self.clock = clock_for() if clock is None else clock
        self.timeline, self.waits, self.cpu_time = [], [], []
        self.messages_sent = self.peak_pending = 0

    def waiting(self) -> None:
        self._t_wait = self.clock.mark()

    def computing(self) -> None:
        # thread_time: CPU seconds of this host thread (cpu_share), a host quantity
        self._t0, self._c0 = self.clock.mark(), time.thread_time()
        self.waits.append((self._t_wait, self._t0))

    def sent(self, in_flight: int) -> None:
        self.messages_sent += 1
        self.peak_pending = max(self.peak_pending, in_flight)

    def done(self, action: Action) -> None:
        self.timeline.append((self._t0, self.clock.mark(), action))
        self.cpu_time.append(time.thread_time() - self._c0)

    def saving(self, owner):
        return self.meter.saving(owner) if self.meter else contextlib.nullcontext()

    def hold(self, owner, tensor: torch.Tensor) -> None:
        if self.meter:
            self.meter.hold(owner, tensor)

    def result(self, loss: float | None, num_chunks: int) -> StepResult:
        peak_bytes, peak_mb = self.meter.peaks() if self.meter else (0, float("nan"))
        units = self.meter.unit_bytes() if self.meter else {}
        timeline = [(seconds(t0), seconds(t1), a) for t0, t1, a in self.timeline]
        recv_wait = [elapsed(t_wait, t0) for t_wait, t0 in self.waits]
        return StepResult(loss, timeline, peak_mb, peak_bytes,
                          [units.get(c, 0) for c in range(num_chunks)], self.messages_sent,
                          self.peak_pending, recv_wait, self.cpu_time)


def pipeline_step(chunks: Sequence[StageChunk], schedule: Sequence[Sequence],
                  x: torch.Tensor, y: torch.Tensor, *, group=None,
                  loss_fn: Callable = lm_loss, sync_tied: bool = True,
                  measure_stash: bool = True) -> StepResult:
    """Forward + backward of one step on this rank, following ``schedule``.

    chunks: this rank's StageChunks (from ``split_model(...)[rank]``).
    x, y: the whole batch (B, T) of token ids and targets; every rank gets it
        and takes its micro-batches; only the first / last stage use x / y.
    group: the process group of this pipeline (default: the whole world); the
        calling rank must belong to it.
    measure_stash: measure the activations held for backward (StashMeter). It
        costs a Python call per saved tensor and many small objects (whose
        garbage collection grows with the stash): turn it off for timing runs,
        and the stash fields come back as NaN / 0.
    Gradients are accumulated into the chunks' ``.grad`` (zero them before).
    """
    sched = validate_schedule(schedule)  # ValueError / ScheduleDeadlock before any message
    if any(a.kind == "W" for row in sched for a in row):
        raise ValueError("this executor runs F/B schedules; a zero-bubble schedule (W actions) "
                         "runs on the simulator only (simulate)")
    p, m, v = schedule_shape(sched)
    if group is not None:
        if not dist.is_initialized():
            raise ValueError("group= was given but torch.distributed is not initialized")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:  # get_rank returns -1 (or another negative) outside the group
            raise ValueError(f"rank {dist.get_rank()} is not a member of the process group "
                             f"passed as group=; call pipeline_step only on that group's "
                             f"ranks")
    else:
        world, rank = world_size(), group_rank()
    if world != p:
        raise ValueError(f"the schedule has {p} rank(s) but the process group has {world}")
    if len(chunks) != v:
        raise ValueError(f"rank {rank} holds {len(chunks)} chunk(s); the schedule uses {v}")
    if x.size(0) % m:
        raise ValueError(f"batch size {x.size(0)} is not divisible by {m} micro-batches")
    plan = plan_messages(sched)[rank]  # messages, time-step groups, send releases
    S = p * v
    xs, ys = x.chunk(m), y.chunk(m)
    mb, T = xs[0].shape
    act_shape = (mb, T, chunks[0].n_embd)      # every message has this shape
    dtype = next(chunks[0].parameters()).dtype
    device = next(chunks[0].parameters()).device

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    local: dict = {}        # messages to ourselves (p = 1, or interleaving wraps round)
    outgoing: dict = {}     # message -> tensor to send, until its group is posted
    buffers: dict = {}      # message -> receive buffer, from posting until its action
    works: dict = {}        # (kind, message) -> work handle
    pending: dict[int, tuple] = {}   # action index -> (work, tensor) of a send in flight
    groups = iter(plan.groups.items())
    next_group = next(groups, None)

    def post_until(step: int) -> None:
        """Post, in step order, every group of a time step <= ``step``."""
        nonlocal next_group
        while next_group is not None and next_group[0] <= step:
            for kind, msg in next_group[1]:
                if kind == "recv":
                    buffers[msg] = torch.empty(act_shape, dtype=dtype, device=device)
            works.update(_post(next_group[1], group, global_rank, buffers, outgoing))
            for kind, msg in next_group[1]:
                if kind == "send":
                    outgoing.pop(msg)  # the work handle keeps it (and so do we, in pending)
            next_group = next(groups, None)

    params = [q for c in chunks for q in (*c.parameters(), *c.buffers())]
    rec = StepRecorder([*params, x, y], measure_stash, clock_for(x.device))
    stash: dict[tuple[int, int], tuple] = {}
    losses = []
    for i, a in enumerate(sched[rank]):
        s = a.chunk * p + rank               # virtual stage of this action
        chunk = chunks[a.chunk]
        j = a.microbatch
        post_until(plan.step[i] - 1)         # receive-only groups of earlier steps
        msg_in = plan.recv[i]
        rec.waiting()
        if msg_in is None:
            got = None
        elif msg_in.local:
            got = local.pop(msg_in)
        else:
            works.pop(("recv", msg_in)).wait()
            got = buffers.pop(msg_in)
        rec.computing()
        awaited = {id(w) for (kind, _), w in works.items() if kind == "recv"}
        for k in plan.release[i]:            # proved delivered: returns at once, frees memory
            work, _ = pending.pop(k)
            if id(work) not in awaited:      # nccl: one Work for a whole batch, which may
                work.wait()                  # hold a receive of a later action; that
                                             # action's wait completes it (and frees the send)
        if a.kind == "F":
            inp = xs[j] if s == 0 else got.requires_grad_()   # tokens, or activation (mb, T, C)
            with rec.saving((j, a.chunk)):
                out = chunk(inp)
                if s == S - 1:
                    loss = loss_fn(out, ys[j])
                    losses.append(loss.detach())
                    out = loss / m           # mean over micro-batches = mean over the batch
                    del loss                 # it would keep this micro-batch's graph (and its
                                             # received input) alive until the next forward
            rec.hold((j, a.chunk), inp)
            rec.hold((j, a.chunk), out)
            stash[(j, a.chunk)] = (inp, out)
            t_out = None if s == S - 1 else out.detach()
        else:
            inp, out = stash.pop((j, a.chunk))
            torch.autograd.backward(out, got)   # got: d loss / d out (mb, T, C), or None
            t_out = inp.grad if s > 0 else None
            del inp, out                     # nothing of this micro-batch stays alive here
        msg_out = plan.send[i]
        if msg_out is not None:
            if msg_out.local:
                local[msg_out] = t_out
            else:
                outgoing[msg_out] = t_out.contiguous()
        post_until(plan.step[i])             # this step's group: our send, neighbours' sends
        if msg_out is not None and not msg_out.local:
            pending[i] = (works.pop(("send", msg_out)), t_out)
            rec.sent(len(pending))
        rec.done(a)
        del got, t_out
    post_until(float("inf"))                 # nothing left in practice; a guard
    for work, _ in pending.values():         # sends nobody could vouch for
        work.wait()
    pending.clear()
    if sync_tied:
        sync_tied_grads(chunks, p, group=group)
    return rec.result(float(torch.stack(losses).mean()) if losses else None, v)


def sync_tied_grads(chunks: Sequence[StageChunk], num_stages: int, group=None) -> None:
    """Add the gradients of the tied weight's two copies: the token embedding on
    virtual stage 0 (rank 0) and the LM head on the last (rank p-1)."""
    first = [c for c in chunks if c.first]
    last = [c for c in chunks if c.last]
    if first and last:
        if first[0] is last[0]:
            return  # one chunk, one tensor: autograd already added both uses
        a, b = first[0].wte.weight, last[0].lm_head.weight
        total = a.grad + b.grad
        a.grad.copy_(total)
        b.grad.copy_(total)
        return
    if not (first or last):
        return
    other = num_stages - 1 if first else 0
    other = dist.get_global_rank(group, other) if group is not None else other
    mine = first[0].wte.weight if first else last[0].lm_head.weight
    theirs = torch.empty_like(mine.grad)
    # both ranks send, then receive: posted as separate calls, nccl could stall both
    # sends (see helpers/pipeline/p2p.py); one group lets them pass each other
    ops = [dist.P2POp(dist.isend, mine.grad.clone(), other, group=group, tag=1 << 20),
           dist.P2POp(dist.irecv, theirs, other, group=group, tag=1 << 20)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    mine.grad.add_(theirs)


def chunk_grads(chunks: Sequence[StageChunk]) -> dict[str, torch.Tensor]:
    """Gradients of this rank's chunks under the unsplit model's names."""
    out = {}
    for c in chunks:
        names = c.global_names()
        for name, prm in c.named_parameters(remove_duplicate=False):
            if prm.grad is not None:
                out[names[name]] = prm.grad.detach().clone()
    return out


def reference_grads(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    """Loss and gradients of the unsplit model on the whole batch."""
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}
