"""The flat partition: parameters laid out in buckets, each padded to split N ways.

Pure bookkeeping, no process group: unit-tested alone. ``numels[i]`` is the
size of parameter i, ``groups`` lists which parameters share a bucket. Each
bucket is padded to a multiple of N (at most N - 1 zeros) so it cuts into N
equal chunks; rank r owns chunk r of every bucket, and its *shard* is those
chunks back to back:

    full buffer  | bucket 0: r0 r1 r2 r3 | bucket 1: r0 r1 r2 r3 | ...
    rank 1 shard | b0.r1 | b1.r1 | ...

This is PyTorch FSDP1's flat-parameter layout. DeepSpeed's ZeRO-1/2 instead
give rank r one contiguous 1/N of a whole flattened parameter group (one cut
per rank, not per bucket), and its ZeRO-3 partitions each parameter alone.
"""

from __future__ import annotations

import dataclasses

from helpers.ddp import assign_buckets

__all__ = ["Bucket", "FlatPartition", "size_buckets"]


@dataclasses.dataclass(frozen=True)
class Bucket:
    params: tuple[int, ...]   # indices into the managed parameter list
    offsets: tuple[int, ...]  # where each parameter starts inside the bucket
    numel: int                # sum of the parameters' sizes
    padded: int               # numel rounded up to a multiple of world_size
    start: int                # where the bucket starts in the full flat buffer
    shard_start: int          # where this bucket's chunk starts in a rank's shard
    world_size: int

    @property
    def chunk(self) -> int:
        """Elements of this bucket each rank owns."""
        return self.padded // self.world_size


class FlatPartition:
    """Buckets of parameters in one flat buffer, each padded to split N ways.

    ``numels[i]`` is the size of parameter i; ``groups`` lists which
    parameters share a bucket (every index exactly once). Rank r owns chunk r
    of every bucket; its shard is those chunks back to back.
    """

    def __init__(self, numels: list[int], world_size: int, groups: list[list[int]]):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        seen = sorted(i for g in groups for i in g)
        if seen != list(range(len(numels))):
            raise ValueError("groups must list every parameter index exactly once")
        self.world_size = world_size
        self.numels = list(numels)
        self.buckets: list[Bucket] = []
        start = shard_start = 0
        for g in groups:
            offsets, n = [], 0
            for i in g:
                offsets.append(n)
                n += numels[i]
            padded = -(-n // world_size) * world_size  # ceil to a multiple of N
            b = Bucket(tuple(g), tuple(offsets), n, padded, start, shard_start, world_size)
            self.buckets.append(b)
            start += padded
            shard_start += b.chunk
        self.total = start             # full flat buffer, padding included
        self.shard_numel = shard_start  # one rank's shard
        self.padding = self.total - sum(numels)

    def shard_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """[lo, hi) of rank's chunk of ``bucket`` in the full flat buffer."""
        lo = bucket.start + rank * bucket.chunk
        return lo, lo + bucket.chunk


def size_buckets(numels: list[int], cap_numel: int) -> list[list[int]]:
    """ZeRO's buckets by size: BucketedDDP's rule, ``helpers.ddp.assign_buckets``.

    Parameter indices walked from last registered to first (gradients arrive
    roughly in that order, so bucket 0 is complete first), a bucket closed as
    soon as it holds at least ``cap_numel`` elements (a parameter larger than
    the cap gets a bucket of its own). Sizes are counted in elements, not
    bytes: one flat buffer, one dtype. No smaller first bucket: ZeroOptimizer
    has one knob, ``bucket_cap_mb``, as DeepSpeed has one ``reduce_bucket_size``
    (and torch's DDP, given a ``bucket_cap_mb``, uses it for the first bucket
    too). Padding to a multiple of N is FlatPartition's business, not the
    grouping's."""
    return assign_buckets(numels, cap_numel)
