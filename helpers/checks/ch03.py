"""Checks for chapter 03: the two phases of the ring, and the averaging all-reduce.

Contract (the same as ``helpers.collectives``): a 1-D contiguous tensor is cut
into p chunks by ``chunk_bounds(numel, p)``.

* ``reduce_scatter(x)``: in place; afterwards chunk ``rank`` holds the sum over
  ranks. Return value ignored.
* ``all_gather(x)``: in place; on entry chunk ``rank`` is the one to share;
  afterwards every chunk holds its owner's values.
* ``ring_average(x)``: in place; every element becomes the mean over ranks.

The checks run on 3 ranks with sizes that do not divide by 3 (and one smaller
than 3), with different data on each rank, against gloo's own collectives.
They test the mechanism as well as the result: inside the ranks every byte
sent point-to-point (``dist.send``/``isend``, also inside
``batch_isend_irecv``) is counted and must total what a ring sends, (p-1)·N
elements over all ranks per phase, and the collectives themselves
(``dist.all_reduce`` and friends) are switched off, so a result that came
from them fails.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, on_ranks, passed

WORLD = 3
SIZES = [10, 11, 2, 64]


def _inputs(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-50, 50, (n,), generator=g).double()  # small ints: sums are exact


# The collectives a learner might reach for instead of building the ring.
REFUSED = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
           "all_gather_into_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single")


def _instrumented(fn, t) -> int:
    """Run ``fn(t)`` with point-to-point sends counted and collectives refused; bytes sent.

    ``torch.distributed.isend`` is patched in ``distributed_c10d`` as well, because
    ``P2POp`` checks its op against that module's own names and ``batch_isend_irecv``
    calls the op it holds; so each send is counted once whichever way it was posted.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    sent = [0]
    saved = {}

    def counting(real):
        def send(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return real(tensor, *args, **kwargs)
        return send

    def refuse(name):
        def collective(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is switched off in this check: build the "
                               f"collective from point-to-point messages (isend/irecv)")
        return collective

    for name in ("send", "isend"):
        saved[name] = getattr(c10d, name)
        setattr(c10d, name, counting(saved[name]))
        setattr(dist, name, getattr(c10d, name))
    for name in REFUSED:
        saved[name] = getattr(dist, name)
        setattr(dist, name, refuse(name))
    try:
        fn(t)
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
            if name in ("send", "isend"):
                setattr(c10d, name, real)
    return sent[0]


def _run(fn, phase):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.collectives import chunk_bounds

    r, p = rank_info().rank, rank_info().world_size
    out, sent = [], []
    for n in SIZES:
        x = _inputs(r, n)
        a, b = chunk_bounds(n, p)[r]
        if phase == "all_gather":
            t = torch.full((n,), float("nan"), dtype=torch.float64)
            t[a:b] = x[a:b]  # only my chunk is known; the rest is garbage
        else:
            t = x.clone()
        sent.append(_instrumented(fn, t))
        out.append(t)
    dist.barrier()
    return out, sent


def _expected(n: int, phase: str) -> torch.Tensor:
    from helpers.collectives import chunk_bounds

    xs = [_inputs(r, n) for r in range(WORLD)]
    if phase == "reduce_scatter":
        return sum(xs)
    if phase == "ring_average":
        return sum(xs) / WORLD
    want = torch.empty(n, dtype=torch.float64)
    for r, (a, b) in enumerate(chunk_bounds(n, WORLD)):
        want[a:b] = xs[r][a:b]
    return want


def _check(fn, phase: str, label: str) -> None:
    from helpers.collectives import chunk_bounds

    if not callable(fn):
        raise CheckFailed(f"{label} should be a function, got {fn!r}")
    results = on_ranks(_run, WORLD, fn, phase, what=label, timeout=30,
                       probe=lambda: fn(torch.zeros(4, dtype=torch.float64)))
    for rank, (outs, _) in enumerate(results):
        for n, got in zip(SIZES, outs):
            want = _expected(n, phase)
            a, b = chunk_bounds(n, WORLD)[rank]
            if phase == "reduce_scatter":  # only my chunk is specified
                got, want = got[a:b], want[a:b]
            if torch.equal(got, want):
                continue
            hint = ""
            if phase == "ring_average" and torch.allclose(got, want * WORLD):
                hint = f" It is {WORLD}x the mean: divide the reduced chunk by the world size."
            elif phase == "reduce_scatter":
                others = [_expected(n, phase)[c:d] for c, d in chunk_bounds(n, WORLD)]
                if any(o.numel() == got.numel() and torch.equal(got, o) for o in others):
                    hint = (" That is the sum of another chunk: check the chunk indices (the "
                            "chunk received in the last step must be chunk r).")
                elif torch.equal(got, _inputs(rank, n)[a:b]):
                    hint = (" That is this rank's input: nothing was added into chunk r. Check "
                            "the chunk indices (the chunk received in the last step must be "
                            "chunk r).")
                else:
                    hint = " Add what you receive into your copy (don't overwrite it)."
            elif torch.isnan(got).any():
                hint = " Some chunks never arrived (still NaN): p-1 steps, each forwarding a chunk."
            raise CheckFailed(f"{label}: rank {rank}, tensor of {n} elements: got "
                              f"{got.tolist()[:6]}..., expected {want.tolist()[:6]}...{hint}")
    # The mechanism: a ring phase moves every chunk p-1 hops, one hop = one send of
    # that chunk, so over all ranks it sends (p-1) N elements; the all-reduce twice that.
    phases = 2 if phase == "ring_average" else 1
    for i, n in enumerate(SIZES):
        total = sum(sent[i] for _, sent in results)
        want = phases * (WORLD - 1) * n * 8  # float64 elements
        if total != want:
            more = "more" if total > want else "fewer"
            raise CheckFailed(
                f"{label}: for a tensor of {n} elements the {WORLD} ranks sent {total} bytes "
                f"point-to-point in total, {more} than a ring's {want} "
                f"({phases} x (p-1) x N x 8 bytes). "
                + ("Send one chunk per step, not the whole tensor: each rank's link should "
                   "carry about 2(p-1)/p of the tensor, not (p-1) times it."
                   if total > want else
                   "Every chunk must travel p-1 hops, each a send of that chunk."))


def check_reduce_scatter(reduce_scatter) -> None:
    _check(reduce_scatter, "reduce_scatter", "reduce_scatter")
    passed(f"ring reduce-scatter on {WORLD} ranks: chunk r holds the sum on rank r "
           f"(sizes {SIZES})")


def check_all_gather(all_gather) -> None:
    _check(all_gather, "all_gather", "all_gather")
    passed(f"ring all-gather on {WORLD} ranks: every rank has every chunk (sizes {SIZES})")


def check_ring_average(ring_average) -> None:
    _check(ring_average, "ring_average", "ring_average")
    passed(f"reduce-scatter + divide + all-gather = the mean on every rank ({WORLD} ranks)")
