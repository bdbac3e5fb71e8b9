"""Which gradients travel together: DDP's bucket assignment.

Chapter 04, section 1, point 2 ("Buckets") and the bucket list printed under
it; section 4 varies the cap. The reducer that fills and launches the
buckets is ``helpers.ddp.reducer``.

One all-reduce per parameter pays the latency alpha (chapter 03) hundreds of
times per step; one all-reduce of everything cannot start until backward is
over. A bucket is the compromise: trainable parameters are grouped into
buckets of about ``bucket_cap_mb`` (default 25 MB), in *reverse registration
order*, and the first bucket is kept small (``first_bucket_mb``, default
1 MB) so that the first all-reduce starts as early as possible (Li et al.
2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB, sec. 3.2.3 and 4.2; DDP's ``bucket_cap_mb`` / first-bucket
cap). ``assign_buckets`` is the one bucketing rule of the course: ZeRO's
stage 2 uses it as well (``helpers.zero.partition.size_buckets``).

How production differs, the bucket layout over time: DDP builds its *first*
buckets before any backward has run, from the parameters in *registration*
order (with ``find_unused_parameters=True`` the first-registered parameters
fill the small first bucket and the list of buckets is then reversed; with
the default ``find_unused_parameters=False``, recent versions start from a
single bucket holding everything). During the first backward the reducer
records the order in which gradients really became ready, and once, after
that first iteration, rebuilds the buckets in that order with the small
bucket first (``Reducer::rebuild_buckets``; never with
``find_unused_parameters=True``). ``BucketedDDP`` uses a fixed *reverse
registration* order from the start: that is the rebuilt layout for a model
whose gradients arrive last-layer-first, not DDP's first iteration, and it
never looks at the real arrival order. The averaged gradients are the same
either way; which all-reduce carries which gradient, and so the overlap,
differs.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["assign_buckets", "MB"]

MB = 1024 * 1024  # DDP's bucket_cap_mb counts binary megabytes


def assign_buckets(sizes_bytes: Sequence[int], bucket_cap_bytes: float,
                   first_bucket_bytes: float | None = None,
                   dtypes: Sequence | None = None) -> list[list[int]]:
    """Group parameters (given in registration order) into buckets: the one
    bucketing rule of the course, used by ``BucketedDDP`` and by ZeRO's stage 2
    (``helpers.zero.partition.size_buckets``, which counts elements instead of
    bytes: any unit works if sizes and caps share it).

    Walk the parameters from last registered to first; add each to the open
    bucket of its dtype; close that bucket as soon as it holds at least its
    cap (so a bucket exceeds the cap by at most one parameter, and a
    parameter larger than the cap gets a bucket of its own). The first bucket
    of each dtype has cap ``first_bucket_bytes`` (default: ``bucket_cap_bytes``),
    later ones ``bucket_cap_bytes``. Buckets of one flat buffer need one
    dtype, hence one open bucket per dtype.

    Why reverse: gradients arrive roughly in reverse. Backward visits the
    layers in the reverse of forward, and a model usually registers its
    modules in the order forward uses them, so the last-registered parameters
    get their gradients first. Bucket 0 then is complete first and its
    all-reduce overlaps the rest of backward; in registration order the first
    bucket would wait for the very last gradient. It is a guess from the
    registration order; torch's DDP replaces it after the first iteration by
    the order it saw (module docstring, "How production differs").

    Why a smaller first bucket: it is complete, and its all-reduce starts,
    sooner. In torch 2.13 the value is ``dist._DEFAULT_FIRST_BUCKET_BYTES``
    = 1 MiB (``kDefaultFirstBucketBytes = 1024 * 1024`` in c10d's
    reducer.hpp), the later caps ``bucket_cap_mb`` = 25 MiB
    (``_DEFAULT_BUCKET_CAP_MB`` in torch/nn/parallel/distributed.py). torch
    applies the 1 MiB only while ``bucket_cap_mb`` is left at its default:
    ``_BucketCapacityConfig.create`` sets ``first_bucket_bytes_cap =
    dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else
    bucket_bytes_cap``. BucketedDDP keeps ``first_bucket_mb=1`` whatever
    ``bucket_cap_mb`` is; pass ``first_bucket_mb=bucket_cap_mb`` for torch's
    layout with an explicit cap.

    Returns lists of parameter indices, buckets in the order they are
    expected to become ready. Same rule as DDP's
    ``_compute_bucket_assignment_by_size`` fed the parameters in reverse
    (tests/test_ddp.py compares the two on random cases).
    """
    n = len(sizes_bytes)
    if first_bucket_bytes is None:
        first_bucket_bytes = bucket_cap_bytes
    if bucket_cap_bytes < 0 or first_bucket_bytes < 0:
        raise ValueError(f"bucket caps must be >= 0 bytes, got {bucket_cap_bytes}, "
                         f"{first_bucket_bytes}")
    if dtypes is not None and len(dtypes) != n:
        raise ValueError(f"{len(dtypes)} dtypes for {n} parameters")
    order = list(range(n - 1, -1, -1))
    position = {i: k for k, i in enumerate(order)}
    buckets: list[list[int]] = []
    open_: dict = {}      # dtype -> [indices, bytes]
    closed: dict = {}     # dtype -> buckets closed so far
    for i in order:
        key = dtypes[i] if dtypes is not None else None
        b = open_.setdefault(key, [[], 0])
        b[0].append(i)
        b[1] += sizes_bytes[i]
        cap = first_bucket_bytes if closed.get(key, 0) == 0 else bucket_cap_bytes
        if b[1] >= cap:
            buckets.append(b[0])
            closed[key] = closed.get(key, 0) + 1
            del open_[key]
    buckets.extend(b[0] for b in open_.values() if b[0])
    # Ready order = the position of a bucket's first parameter in backward order.
    return sorted(buckets, key=lambda b: position[b[0]])
