"""What carries a bucket: the all-reduce behind ``BucketedDDP``'s ``comm_hook``.

Chapter 04, section 2 (our wrapper and torch's DDP counted through their comm
hooks); chapter 16 plugs compression in here (``helpers.compression``). The
reducer that calls the hook is ``helpers.ddp.reducer``.

``comm_hook(flat_grad, group) -> torch.futures.Future`` replaces the
all-reduce of a bucket (DDP's ``register_comm_hook``). The future must
resolve to the *averaged* flat gradient, same shape. A hook with a
``bind(ddp)`` method is handed the BucketedDDP once, at construction, on
every rank; what it may read is public: ``buckets``, ``layout`` and
``flat_buffers`` (PowerSGD reads which tensors each bucket holds, as DDP's
``GradBucket.gradients()`` tells torch's hooks).

How production differs: torch's hooks receive a ``GradBucket`` and a state
object, not the flat tensor and the group; its default hook
(``ddp_comm_hooks.default_hooks.allreduce_hook``) divides first and sums,
as ``allreduce_hook`` does here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.comm import completed_future, world_size  # (completed_future lived here first)

__all__ = ["allreduce_hook", "ring_allreduce_hook", "completed_future"]


def allreduce_hook(flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
    """Default comm hook: divide by p, then an asynchronous sum all-reduce.

    Dividing before summing (as DDP's default does) keeps fp16 sums in range.
    """
    p = world_size(group)
    if p == 1:
        return completed_future(flat_grad)
    flat_grad.div_(p)
    work = dist.all_reduce(flat_grad, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ring_allreduce_hook(flat_grad: torch.Tensor, group=None) -> torch.futures.Future:
    """Our ring from ch. 03 as the bucket all-reduce (synchronous, so no overlap)."""
    from helpers.collectives import ring_all_reduce

    p = world_size(group)
    if p > 1:
        flat_grad.div_(p)
        ring_all_reduce(flat_grad, group)
    return completed_future(flat_grad)
