"""Run any pipeline schedule on real ranks, with point-to-point send/recv.

The model is cut by depth (``split_model``): ``p * v`` virtual stages, each a
``StageChunk`` holding a contiguous run of transformer blocks; the first also
holds the embeddings, the last the final LayerNorm and the LM head. Rank r
holds chunks ``r, p + r, 2p + r, ...`` (Megatron-LM's interleaving; v = 1 is
the plain pipeline).

``pipeline_step(chunks, schedule, x, y)`` runs one training step's forward
and backward on the calling rank, following its list of actions:

    F(j, c): input = embed(x_j) on virtual stage 0, else recv the activation
             (B/m, T, C) from the rank of stage s-1; run the chunk; on the last
             stage compute loss_j / m, else isend the output to stage s+1.
             Stash (input, output) until B(j, c).
    B(j, c): on the last stage backprop loss_j / m; else recv d(output) from
             stage s+1 and backprop it; then isend d(input) to stage s-1.

Why this never deadlocks: sends are ``isend`` (they never block the sender),
each receive is posted only when the action that needs it runs, and before any
message moves every rank checks that the schedule simulates to completion
(``helpers.pipeline.simulate.validate_schedule``). If the simulator can finish
it, every receive has a matching send that some rank will reach. Every
message has a known shape (B/m, T, C) and dtype, so no shape handshake is
needed, and a tag naming (direction, micro-batch, stage), so messages cannot
be matched to the wrong receive even when two ranks exchange several at once.

Gradient accumulation: each micro-batch's loss is divided by m and ``.grad``
accumulates over micro-batches, so after the step the gradients equal those of
the unsplit model on the whole batch (the mean loss). The tied embedding /
LM-head weight lives on the first and the last stage; after the step those two
ranks add their gradients (``sync_tied_grads``), as Megatron-LM does with an
all-reduce over its "embedding group" (Shoeybi et al. 2019 keep the same tie).

The step records each action's (start, end) on this rank's clock and the
largest number of stashed activations, so a notebook can draw the measured
Gantt chart next to the simulated one and compare the stash.

How production differs: Megatron and ``torch.distributed.pipelining`` post
receives ahead of time and batch send/recv pairs (``batch_isend_irecv``) to
overlap communication with compute; they also free the output tensor's data
after sending it ("deallocate_output_tensor") to save memory, and support
variable shapes by exchanging them first.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.model import GPT, lm_loss
from helpers.pipeline.partition import partition
from helpers.pipeline.schedules import Action, schedule_shape
from helpers.pipeline.simulate import validate_schedule

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
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
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
    peak_stash: int               # most (micro-batch, chunk) activations held at once
    messages_sent: int            # point-to-point sends this rank posted


def _tag(direction: int, microbatch: int, stage: int, num_virtual: int) -> int:
    # unique per (activation | gradient, micro-batch, receiving stage)
    return (microbatch * num_virtual + stage) * 2 + direction


def pipeline_step(chunks: Sequence[StageChunk], schedule: Sequence[Sequence],
                  x: torch.Tensor, y: torch.Tensor, *, group=None,
                  loss_fn: Callable = lm_loss, sync_tied: bool = True) -> StepResult:
    """Forward + backward of one step on this rank, following ``schedule``.

    chunks: this rank's StageChunks (from ``split_model(...)[rank]``).
    x, y: the whole batch (B, T) of token ids and targets; every rank gets it
        and takes its micro-batches; only the first / last stage use x / y.
    Gradients are accumulated into the chunks' ``.grad`` (zero them before).
    """
    sched = validate_schedule(schedule)  # ValueError / ScheduleDeadlock before any message
    p, m, v = schedule_shape(sched)
    if group is None and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    elif group is not None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        world, rank = 1, 0
    if world != p:
        raise ValueError(f"the schedule has {p} rank(s) but the process group has {world}")
    if len(chunks) != v:
        raise ValueError(f"rank {rank} holds {len(chunks)} chunk(s); the schedule uses {v}")
    if x.size(0) % m:
        raise ValueError(f"batch size {x.size(0)} is not divisible by {m} micro-batches")
    S = p * v
    xs, ys = x.chunk(m), y.chunk(m)
    mb, T = xs[0].shape
    act_shape = (mb, T, chunks[0].n_embd)      # every message has this shape
    dtype = next(chunks[0].parameters()).dtype
    device = next(chunks[0].parameters()).device

    def peer(stage: int) -> int:
        return stage % p

    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    local: dict[int, torch.Tensor] = {}        # messages to ourselves (p = 1, or v > 1 wraps)
    sends: list = []

    def send(t: torch.Tensor, dst_stage: int, direction: int, j: int) -> None:
        tag = _tag(direction, j, dst_stage, S)
        if peer(dst_stage) == rank:
            local[tag] = t
        else:
            sends.append((dist.isend(t.contiguous(), global_rank(peer(dst_stage)), group=group,
                                     tag=tag), t))

    def recv(src_stage: int, my_stage: int, direction: int, j: int) -> torch.Tensor:
        tag = _tag(direction, j, my_stage, S)
        if peer(src_stage) == rank:
            return local.pop(tag)
        buf = torch.empty(act_shape, dtype=dtype, device=device)
        dist.irecv(buf, global_rank(peer(src_stage)), group=group, tag=tag).wait()
        return buf

    stash: dict[tuple[int, int], tuple] = {}
    peak, losses, timeline = 0, [], []
    n_sent = 0
    for a in sched[rank]:
        s = a.chunk * p + rank               # virtual stage of this action
        chunk = chunks[a.chunk]
        j = a.microbatch
        if a.kind == "F":
            if s == 0:
                inp = xs[j]
            else:
                inp = recv(s - 1, s, 0, j).requires_grad_()   # activation (mb, T, C)
            t0 = time.perf_counter()
            out = chunk(inp)
            if s == S - 1:
                loss = loss_fn(out, ys[j])
                losses.append(loss.detach())
                out = loss / m               # mean over micro-batches = mean over the batch
            else:
                send(out.detach(), s + 1, 0, j)
                n_sent += peer(s + 1) != rank
            timeline.append((t0, time.perf_counter(), a))
            stash[(j, a.chunk)] = (inp, out)
            peak = max(peak, len(stash))
        else:
            inp, out = stash.pop((j, a.chunk))
            grad = None if s == S - 1 else recv(s + 1, s, 1, j)   # d loss / d out (mb, T, C)
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            if s > 0:
                send(inp.grad, s - 1, 1, j)
                n_sent += peer(s - 1) != rank
            timeline.append((t0, time.perf_counter(), a))
    for work, _ in sends:                    # the tensors stayed alive until here
        work.wait()
    if sync_tied:
        sync_tied_grads(chunks, p, group=group)
    loss = float(torch.stack(losses).mean()) if losses else None
    return StepResult(loss, timeline, peak, n_sent)


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
    work = dist.isend(mine.grad.clone(), other, group=group, tag=1 << 20)
    dist.recv(theirs, other, group=group, tag=1 << 20)
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
