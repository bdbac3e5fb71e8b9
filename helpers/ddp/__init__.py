"""Bucketed data parallelism that overlaps gradient all-reduce with backward (chapter 04).

``BucketedDDP`` does what ``torch.nn.parallel.DistributedDataParallel`` does
(Li et al. 2020, "PyTorch Distributed", VLDB, sec. 3-4), in Python: rank 0's
weights are broadcast at construction, gradients are grouped into buckets, a
hook on every parameter sees its gradient become final, each complete bucket
is all-reduced asynchronously while backward goes on (in bucket order, the
same on every rank), and when backward ends the averaged buckets are copied
back into ``.grad``.

Read it in the order chapter 04 teaches it, one file per part:

1. ``buckets``: which parameters share a bucket (``assign_buckets``, the
   one bucketing rule of the course; section 1, point 2).
2. ``reducer``: ``BucketedDDP``, the hooks, the in-order launch, the end of
   backward, ``no_sync`` and unused parameters (section 1, points 1 and 3-5;
   sections 2-5).
3. ``comm_hooks``: what carries a bucket (``allreduce_hook``, and our ring
   from chapter 03); chapter 16 plugs compression in here.

Why a package: each part has a reader of its own. ZeRO's stage 2 uses the
bucket rule without the reducer (``helpers.zero.partition``), chapter 16's
compression only the comm-hook contract, and the reducer reads best with
neither in its way. The names a chapter imports come from here:
``from helpers.ddp import BucketedDDP, allreduce_hook, assign_buckets``.
"""

from helpers.ddp.buckets import MB, assign_buckets
from helpers.ddp.comm_hooks import allreduce_hook, completed_future, ring_allreduce_hook
from helpers.ddp.reducer import BucketedDDP

__all__ = ["BucketedDDP", "assign_buckets", "allreduce_hook", "ring_allreduce_hook",
           "completed_future", "MB"]
