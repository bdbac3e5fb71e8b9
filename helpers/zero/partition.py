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

``FlatPartition.owned_ranges(rank)`` is the one place that answers "which
elements of each parameter does this rank own, and where in its shard": ZeRO's
update and checkpoints, FSDP's per-parameter views, its gradients by name and
its checkpoints all read it. A chunk boundary may cut a parameter anywhere, so
a rank owns a piece of it (maybe all, maybe none):

    bucket     | p0 p0 p0 p0 p0 p1 p1 p1 pad |    (numels 5 and 3, N = 3)
    chunks     | rank 0   | rank 1   | rank 2   |
    rank 1 owns p0[3:5] at shard[0:2] and p1[0:1] at shard[2:3]
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from helpers.ddp import assign_buckets

__all__ = ["Bucket", "FlatPartition", "OwnedRange", "size_buckets"]


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


class OwnedRange(NamedTuple):
    """A piece of one parameter that a rank owns (``FlatPartition.owned_ranges``):
    elements ``[lo, hi)`` of flattened parameter ``index`` (full shape
    ``shape``) are elements ``[at, at + hi - lo)`` of the rank's shard, inside
    bucket ``bucket``'s chunk. ``lo == hi``: the rank owns none of it."""
    index: int                # the parameter: its position in ``numels``
    shape: tuple[int, ...]    # its full (global) shape
    lo: int                   # range within the flattened parameter
    hi: int
    at: int                   # where the range starts in the rank's shard
    bucket: int               # the bucket it lies in (index into ``buckets``)

    @property
    def shard_slice(self) -> slice:
        """The range within the rank's shard: ``shard[o.shard_slice]``."""
        return slice(self.at, self.at + self.hi - self.lo)


class FlatPartition:
    """Buckets of parameters in one flat buffer, each padded to split N ways.

    ``numels[i]`` is the size of parameter i; ``groups`` lists which
    parameters share a bucket (every index exactly once). Rank r owns chunk r
    of every bucket; its shard is those chunks back to back. ``shapes[i]``
    (optional, default ``(numels[i],)``) is parameter i's full shape, passed
    through to ``owned_ranges`` for the callers that save or show parameters.
    """

    def __init__(self, numels: list[int], world_size: int, groups: list[list[int]],
                 shapes: list[tuple[int, ...]] | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        seen = sorted(i for g in groups for i in g)
        if seen != list(range(len(numels))):
            raise ValueError("groups must list every parameter index exactly once")
        if shapes is None:
            shapes = [(n,) for n in numels]
        if len(shapes) != len(numels) or any(math.prod(s) != n for s, n in zip(shapes, numels)):
            raise ValueError("shapes must give one shape per parameter, of numels[i] elements")
        self.world_size = world_size
        self.numels = list(numels)
        self.shapes = list(shapes)
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

    def owned_ranges(self, rank: int, empty: bool = False,
                     buckets: list[int] | None = None) -> list[OwnedRange]:
        """Which elements of each parameter ``rank`` owns, and where they sit in
        its shard: one ``OwnedRange`` per parameter that rank's chunk cuts, in
        bucket order, then parameter order within the bucket. Padding is in no
        parameter's range. ``empty=True`` also lists the parameters the rank
        owns nothing of (``lo == hi``; ``at`` still within the bucket's chunk),
        so there is one entry per parameter. ``buckets``: only those buckets
        (indices into ``self.buckets``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        out = []
        for bi in range(len(self.buckets)) if buckets is None else buckets:
            b = self.buckets[bi]
            c_lo = rank * b.chunk  # where the rank's chunk starts, inside the bucket
            for i, off in zip(b.params, b.offsets):
                n = self.numels[i]
                lo = min(max(c_lo - off, 0), n)        # the chunk's elements, in the
                hi = max(min(c_lo + b.chunk - off, n), lo)  # flattened parameter
                at = b.shard_start + min(max(off + lo - c_lo, 0), b.chunk)
                if lo < hi or empty:
                    out.append(OwnedRange(i, self.shapes[i], lo, hi, at, bi))
        return out


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
