"""1F1B as one loop you can read: warm-up, steady state, cool-down.

``helpers.pipeline.executor.pipeline_step`` runs *any* schedule, so it plans its
messages first (time-step groups, vector clocks). 1F1B alone needs none of
that: its order is fixed, so it can be written out, as Megatron-LM does in
``forward_backward_pipelining_without_interleaving``
(megatron/core/pipeline_parallel/schedules.py, Megatron-Core main, d98e8a6 of
2026-08-22; the paired calls ``send_forward_recv_backward`` /
``send_backward_recv_forward`` are in p2p_communication.py). Same shape, our own code; it gives the executor's loss
and gradients bit for bit (tests/test_pipeline_plain_1f1b.py).

Rank r of p, m micro-batches:

* warm-up, ``w = min(p - r - 1, m)`` forwards. Why that many: in the steady
  state rank r+1 sends gradient k and at once needs its next activation,
  k + 1 + w(r+1). Rank r must have sent it already, before it waits for that
  gradient, or rank r+1 idles through rank r's backward: rank r runs one
  forward more than rank r+1 before its first backward, w(r) = w(r+1) + 1. The
  last rank turns each forward straight into a backward, w(p-1) = 0; hence
  p - r - 1. One fewer still finishes but idles more (p = 4, m = 8 on the
  simulator: step 54 instead of 33); one more holds an activation for nothing.
* steady, m - w times: one forward, then the backward of the oldest micro-batch.
* cool-down: the w backwards left.

Why the paired exchange: in the steady state rank r sends activation k + w to
rank r+1 and then needs gradient k from it, while rank r+1 sends gradient k and
then needs activation k + w. On nccl a send finishes only when the peer
receives; if both ranks post their send alone first, each waits for a receive
the other has not posted, forever. Posted as one ``dist.batch_isend_irecv``,
send and receive progress together. With w as above, every exchange of rank r
meets the same two messages in one exchange of its neighbour. Even a lone send
or receive goes through ``batch_isend_irecv`` (helpers/pipeline/p2p.py, point 1,
says why), via ``p2p.post``.

When activations are freed: a forward stashes (input, output); autograd's
saved tensors hang off the output. The backward pops the oldest (1F1B runs
backwards in forward order), ``torch.autograd.backward`` frees that graph, and
nothing of the micro-batch is left but the gradient we send, which we wait on.
So rank r holds at most w + 1 = p - r micro-batches. (Megatron also frees the
output's data right after sending it, ``deallocate_output_tensor``.)
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from helpers.comm import group_rank, world_size
from helpers.model import lm_loss
from helpers.pipeline.executor import StageChunk, sync_tied_grads
from helpers.pipeline.p2p import post
from helpers.validate import positive_int

__all__ = ["one_f_one_b_step"]


def one_f_one_b_step(stage: StageChunk, x: torch.Tensor, y: torch.Tensor, num_microbatches: int,
                     *, loss_fn: Callable = lm_loss) -> float | None:
    """Forward + backward of one step on this rank, in 1F1B order; gradients accumulate
    into ``.grad``. stage: this rank's ``split_model(model, p)[rank][0]``; x, y: the
    whole batch (B, T), on every rank. Returns the mean loss on the last rank, else None."""
    p, rank = world_size(), group_rank()
    m = num_microbatches
    _check(stage, x, m, p, rank)
    xs, ys = x.chunk(m), y.chunk(m)
    prm = next(stage.parameters())
    shape = (*xs[0].shape, stage.n_embd)          # every message: (B/m, T, C)
    prev = rank - 1 if rank > 0 else None          # neighbours; None past either end
    nxt = rank + 1 if rank < p - 1 else None
    stash, losses = collections.deque(), []        # (input, output) of micro-batches in flight

    def exchange(send=None, to=None, recv_from=None):
        """Send ``send`` to rank ``to`` and/or receive a message from ``recv_from``, posted
        together; wait for both (then the sent tensor may go) and return what came."""
        got = None if recv_from is None else torch.empty(shape, dtype=prm.dtype, device=prm.device)
        ops = ([("send", send, to, 0)] if to is not None else []) + \
              ([("recv", got, recv_from, 0)] if got is not None else [])
        for work in post(ops):
            work.wait()
        return got

    def forward(j, inp):
        """Run micro-batch j, stash what its backward needs, return what goes to rank + 1."""
        inp = xs[j] if prev is None else inp.requires_grad_()
        out = stage(inp)
        if nxt is None:                            # last stage: loss / m, so that the summed
            loss = loss_fn(out, ys[j])             # grads are those of the batch's mean loss
            losses.append(loss.detach())
            out = loss / m
        stash.append((inp, out))
        return None if nxt is None else out.detach()

    def backward(grad):
        """Backward of the oldest stashed micro-batch; return what goes to rank - 1."""
        inp, out = stash.popleft()
        torch.autograd.backward(out, grad)         # frees this micro-batch's graph
        return None if prev is None else inp.grad

    w = min(p - rank - 1, m)
    for j in range(w):                                           # warm-up
        inp = exchange(recv_from=prev)                           # recv_forward
        exchange(forward(j, inp), to=nxt)                        # send_forward
    inp = exchange(recv_from=prev) if m > w else None
    for k in range(m - w):                                       # steady: F(k + w), B(k)
        out = forward(k + w, inp)
        grad = exchange(out, to=nxt, recv_from=nxt)              # send_forward_recv_backward
        more = k < m - w - 1                                     # another forward to come?
        inp = exchange(backward(grad), to=prev,                  # send_backward_recv_forward
                       recv_from=prev if more else None)
    for _ in range(w):                                           # cool-down
        exchange(backward(exchange(recv_from=nxt)), to=prev)     # recv_backward, send_backward
    sync_tied_grads([stage], p)                    # tied embedding / LM head: add both halves
    return float(torch.stack(losses).mean()) if losses else None


def _check(stage, x: torch.Tensor, m, p: int, rank: int) -> None:
    """Refuse bad input before any message moves."""
    if not isinstance(stage, StageChunk):
        raise ValueError(f"stage must be this rank's StageChunk (split_model(model, p)[rank][0]), "
                         f"got {type(stage).__name__}")
    positive_int("num_microbatches", m)
    if x.size(0) % m:
        raise ValueError(f"batch size {x.size(0)} is not divisible by {m} micro-batches")
    if (stage.first, stage.last) != (rank == 0, rank == p - 1):
        raise ValueError(f"rank {rank} of {p} holds a stage with first={stage.first}, "
                         f"last={stage.last}: cut the model into {p} stages, one per rank "
                         f"(split_model(model, {p})[rank][0])")
