"""torch.distributed's own collectives on flat buffers, their ring cost, and freeing storage.

The thin layer that the sharded mechanisms (ZeRO, FSDP, PowerSGD) call
instead of ``torch.distributed`` directly. Not to be confused with
``helpers.collectives``: chapter 03's hand-written ring, tree and
halving-doubling implementations and their alpha-beta cost model.

Also the small helpers every parallel module needs: ``world_size`` and
``group_rank`` (1 and 0 outside a process group, so the code runs as plain
single-process code; the one home of that rule) and ``completed_future``
(what a DDP comm hook returns when its work is done).

The sharded mechanisms (``helpers.zero``, ``helpers.fsdp``,
``helpers.compression``) move flat 1-D buffers with two collectives:

* reduce-scatter: every rank passes N * k elements; rank r receives the sum
  over ranks of elements [r k, (r+1) k).
* all-gather: every rank passes k elements; every rank receives all N pieces
  in rank order (N * k).

``ring_bytes_sent`` is what one rank sends for them under the ring algorithm
(Patarasuk & Yuan 2009): (N-1)/N of the buffer for a reduce-scatter, an
all-gather or a broadcast, twice that for an all-reduce (a reduce-scatter
followed by an all-gather). Gloo and NCCL do not report what they send; the
tensor sizes are real, the algorithm is the model.

ZeRO-3 and FSDP keep a parameter tensor alive while its weights are not
there: ``free_storage`` shrinks the tensor's storage to 0 bytes (views and
tensors saved by autograd keep pointing at it), ``alloc_storage`` grows it
back before a collective fills it. PyTorch's first FSDP did the same
(``_free_storage`` / ``_alloc_storage``); FSDP2 instead allocates a fresh
buffer per all-gather and points the parameters at it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter", "all_gather", "ring_bytes_sent", "free_storage", "alloc_storage",
           "is_allocated", "world_size", "group_rank", "completed_future"]

# torch >= 2.11 renamed the flat collectives; older releases have only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_size(group=None) -> int:
    """Ranks in ``group``; 1 outside any process group (plain single-process code)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """This rank's index in ``group``; 0 outside any process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def completed_future(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``value``: what a comm hook returns when the
    work is done synchronously (one rank, or a blocking collective), so that
    callers can ``.wait()`` on every hook alike."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def reduce_scatter(output, input, group=None, async_op=False):
    """Sum ``input`` (N * k elements) over the group; rank r gets elements [r k, (r+1) k)."""
    return _reduce_scatter(output, input, group=group, async_op=async_op)


def all_gather(output, input, group=None, async_op=False):
    """Concatenate every rank's ``input`` (k elements) in rank order into ``output`` (N k)."""
    return _all_gather(output, input, group=group, async_op=async_op)


def ring_bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for a collective on a buffer of ``nbytes`` (ring algorithm).

    ``nbytes`` is the full buffer: the input of a reduce-scatter, the output
    of an all-gather, the tensor of an all-reduce (Patarasuk & Yuan 2009).
    """
    if world_size == 1:
        return 0.0
    share = (world_size - 1) / world_size * nbytes
    if op == "all_reduce":
        return 2 * share
    if op in ("reduce_scatter", "all_gather", "broadcast"):
        return share
    raise ValueError(f"unknown collective {op!r}")


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor (and every view of it)."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give a freed ``t`` its memory back (contents undefined until filled)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def is_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0
