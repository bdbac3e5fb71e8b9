"""Checks for chapter 03: the two phases of the ring, and the averaging all-reduce.

Contract (the same as ``helpers.collectives``): a 1-D contiguous tensor is cut
into p chunks by ``chunk_bounds(numel, p)``.

* ``reduce_scatter(x)``: in place; afterwards chunk ``rank`` holds the sum over
  ranks. Return value ignored.
* ``all_gather(x)``: in place; on entry chunk ``rank`` is the one to share;
  afterwards every chunk holds its owner's values.
* ``ring_average(x)``: in place; every element becomes the mean over ranks.

The checks run on 3 and then 4 ranks (at 2 ranks the left and the right
neighbour are the same rank, so a ring run backwards, or a chunk index off by
one in the other direction, would pass), with sizes that do not divide by 3
or 4 (and ones smaller than p, so some chunks are empty), with different data
on each rank, against the sum computed here. They test the mechanism as well
as the result: inside the ranks every point-to-point send (``dist.send``/
``isend``, also inside ``batch_isend_irecv``) is recorded with its
destination and size, and must go to the right neighbour (r + 1) % p, carry
one chunk, and total what a ring sends, (p-1)·N elements over all ranks per
phase; receive buffers must have the tensor's dtype and device (the learner's code runs
with "meta" as the default device, so a buffer made without device= is caught on a CPU
as it would fail on a GPU node); and the collectives
themselves (``dist.all_reduce`` and friends) are switched off, so a result that
came from them fails. The sends are seen through the checks' spy
(``helpers.checks.spy``), which sees a send posted alone or in a
``batch_isend_irecv``.
"""

from __future__ import annotations

import torch

from helpers.checks import CheckFailed, on_ranks, passed

WORLDS = (3, 4)
# 10, 11, 13: not multiples of 3 or 4 (uneven chunks, hard-coded ``n // p`` slices
# lose the tail); 2: fewer elements than ranks (empty chunks); 64: a plain case
SIZES = [10, 11, 13, 2, 64]


def _inputs(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-50, 50, (n,), generator=g).double()  # small ints: sums are exact


# The collectives a learner might reach for instead of building the ring.
REFUSED = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
           "all_gather_into_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single")


def _instrumented(fn, t) -> list:
    """Run ``fn(t)`` under the checks' spy (``helpers.checks.spy``): every point-to-point
    send recorded with its destination, size and values, however it was posted (alone or
    inside ``batch_isend_irecv``); the collectives refused; a receive into a buffer of
    another dtype than ``t`` refused with its cause (gloo would abort the process on the
    size mismatch, with no word of it). Returns the sends as (destination, bytes, values)."""
    from helpers.checks.spy import communication_spy

    why = "build the collective from point-to-point messages (isend/irecv)"
    with communication_spy(refuse={name: why for name in REFUSED}, recv_dtype=t.dtype,
                           device=t.device) as spy:
        # A GPU node's default device (the CPU) is not the data's (the rank's GPU): a
        # tensor made without device= lands elsewhere than the data, and on nccl its
        # message never meets the peer's. Here the default device is "meta" while the
        # data stays where it is, so that slip fails on a CPU too, named.
        with torch.device("meta"):
            fn(t)
    return spy.sends


def _run(fn, phase):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.collectives import chunk_bounds

    r, p = rank_info().rank, rank_info().world_size
    out, sent = [], []
    for n in SIZES:
        x = _inputs(r, n).to(rank_info().device)
        a, b = chunk_bounds(n, p)[r]
        if phase == "all_gather":
            t = torch.full((n,), float("nan"), dtype=torch.float64, device=x.device)
            t[a:b] = x[a:b]  # only my chunk is known; the rest is garbage
        else:
            t = x.clone()
        sent.append(_instrumented(fn, t))
        out.append(t)
    dist.barrier()
    return out, sent


def _expected(n: int, phase: str, world: int) -> torch.Tensor:
    from helpers.collectives import chunk_bounds

    xs = [_inputs(r, n) for r in range(world)]
    if phase == "reduce_scatter":
        return sum(xs)
    if phase == "ring_average":
        return sum(xs) / world
    want = torch.empty(n, dtype=torch.float64)
    for r, (a, b) in enumerate(chunk_bounds(n, world)):
        want[a:b] = xs[r][a:b]
    return want


# gloo aborts the process (SIGABRT, its reason only on stderr) when a message is larger
# than the buffer posted to receive it; dtypes are checked before that, sizes cannot be
_ABORT = ("a rank aborted inside gloo. The usual cause: a receive buffer of another size "
          "than the message sent to it. In each step the chunk a rank sends and the chunk "
          "its right neighbour receives must be the same chunk (same bounds, same dtype).")


_DEFAULT_DEVICE = ("a tensor was made without device= (torch.empty(k), torch.zeros(k)): it "
                   "lands on the default device, which the check sets apart from the data's "
                   "device, as a GPU node does (default CPU, data on the GPU). Make tensors "
                   "like the data: torch.empty_like(chunk), or device=x.device.")


def _check(fn, phase: str, label: str, timeout: float) -> None:
    if not callable(fn):
        raise CheckFailed(f"{label} should be a function, got {fn!r}")
    for world in WORLDS:
        results = on_ranks(_run, world, fn, phase, what=f"{label} on {world} ranks",
                           timeout=timeout,
                           probe=lambda: fn(torch.zeros(4, dtype=torch.float64)),
                           hints={"SIGABRT": _ABORT, "meta": _DEFAULT_DEVICE})
        for rank, (outs, _) in enumerate(results):
            for n, got in zip(SIZES, outs):
                _compare(got, n, rank, world, phase, label)
        _check_sends([sent for _, sent in results], world, phase, label)
        if phase == "ring_average":
            _check_divided_before_gather([sent for _, sent in results], world, label)


def _compare(got, n: int, rank: int, world: int, phase: str, label: str) -> None:
    from helpers.collectives import chunk_bounds

    where = f"{label}: {world} ranks, rank {rank}, tensor of {n} elements"
    want = _expected(n, phase, world)
    a, b = chunk_bounds(n, world)[rank]
    if phase == "reduce_scatter":  # only my chunk is specified
        got, want = got[a:b], want[a:b]
    if torch.equal(got, want):
        return
    hint = ""
    if phase == "ring_average" and torch.allclose(got, want * world):
        hint = f" It is {world}x the mean: divide the reduced chunk by the world size."
    elif phase == "reduce_scatter":
        others = [_expected(n, phase, world)[c:d] for c, d in chunk_bounds(n, world)]
        if any(o.numel() == got.numel() and torch.equal(got, o) for o in others):
            hint = (" That is the sum of another chunk: check the chunk indices (the "
                    "chunk received in the last step must be chunk r).")
        elif torch.equal(got, _inputs(rank, n)[a:b]):
            hint = (" That is this rank's input: nothing was added into chunk r. Check "
                    "the chunk indices (the chunk received in the last step must be "
                    "chunk r).")
        else:
            hint = (" Add what you receive into your copy (don't overwrite it), and use "
                    "chunk_bounds(numel, p) for every chunk (the last ones are shorter).")
    elif torch.isnan(got).any():
        hint = (" Some chunks never arrived (still NaN): p-1 steps, each forwarding a chunk, "
                "bounds from chunk_bounds(numel, p).")
    raise CheckFailed(f"{where}: got {got.tolist()[:6]}..., expected "
                      f"{want.tolist()[:6]}...{hint}")


def _check_sends(sends: list, world: int, phase: str, label: str) -> None:
    """The mechanism: a ring phase moves every chunk p-1 hops, one hop = one send of
    that chunk to the right neighbour, so over all ranks it sends (p-1) N elements;
    the all-reduce twice that."""
    from helpers.collectives import chunk_bounds

    phases = 2 if phase == "ring_average" else 1
    for i, n in enumerate(SIZES):
        largest = max(b - a for a, b in chunk_bounds(n, world)) * 8  # float64 bytes
        for rank, per_size in enumerate(sends):
            right, left = (rank + 1) % world, (rank - 1) % world
            dests = sorted({dst for dst, _, _ in per_size[i]})
            if dests not in ([], [right]):
                how = ("only to its left neighbour: the ring runs backwards"
                       if dests == [left] else
                       "more than one rank: that is not a ring. Each chunk must hop "
                       "around the ring, not go straight to its owner")
                raise CheckFailed(
                    f"{label}: {world} ranks, tensor of {n} elements: rank {rank} sent to "
                    f"rank(s) {dests}, {how}. Send to the right neighbour (r + 1) % p "
                    f"= {right}, receive from the left (r - 1) % p = {left}.")
            for _, nbytes, _ in per_size[i]:
                if nbytes > largest:
                    raise CheckFailed(
                        f"{label}: {world} ranks, tensor of {n} elements: rank {rank} sent "
                        f"{nbytes} bytes in one message, more than one chunk "
                        f"({largest} bytes). Send one chunk per step, not the whole tensor.")
        total = sum(nbytes for per_size in sends for _, nbytes, _ in per_size[i])
        want = phases * (world - 1) * n * 8  # float64 elements
        if total != want:
            more = "more" if total > want else "fewer"
            raise CheckFailed(
                f"{label}: for a tensor of {n} elements the {world} ranks sent {total} bytes "
                f"point-to-point in total, {more} than a ring's {want} "
                f"({phases} x (p-1) x N x 8 bytes). "
                + ("Send one chunk per step, not the whole tensor: each rank's link should "
                   "carry about 2(p-1)/p of the tensor, not (p-1) times it."
                   if total > want else
                   "Every chunk must travel p-1 hops, each a send of that chunk."))


def _check_divided_before_gather(sends: list, world: int, label: str) -> None:
    """The all-gather half (each rank's last p-1 messages) must carry mean chunks: a rank
    divides its own reduced chunk, 1/p of the tensor, before passing it on. Dividing the
    whole tensor after the all-gather gives the same mean for p times the work."""
    from helpers.collectives import chunk_bounds

    for i, n in enumerate(SIZES):
        mean = _expected(n, "ring_average", world)
        bounds = chunk_bounds(n, world)
        for rank, per_size in enumerate(sends):
            for _, _, values in per_size[i][world - 1:]:
                if not any(b - a == values.numel() and torch.allclose(values.double(), mean[a:b])
                           for a, b in bounds):
                    raise CheckFailed(
                        f"{label}: {world} ranks, tensor of {n} elements: in the all-gather "
                        f"phase rank {rank} passed on a chunk that is not yet the mean (a sum?). "
                        f"Divide your own reduced chunk by p before the all-gather: each rank "
                        f"then divides 1/p of the tensor, not all of it after.")


_ON = " and ".join(map(str, WORLDS))


def check_reduce_scatter(reduce_scatter, timeout: float = 30.0) -> None:
    """Chunk r of rank r holds the sum over ranks, built from ring sends.

    Catches:
    * overwrites instead of adding what arrives: a partial sum (named);
    * chunk index off by one (sends chunk r - s, or r - s - 1 in the last step): rank r
      ends on another chunk's sum (named);
    * ring run backwards (sends left, receives right): at p = 3, 4 the left and right
      neighbours differ, so the send's destination is named;
    * each chunk sent straight to its owner (not a ring): destinations not r + 1;
    * whole tensor sent each step: more bytes than one chunk per message;
    * chunks as ``n // p`` slices: sizes 10, 11, 13 lose their tail (a wrong sum);
    * receive buffer of another dtype (``torch.empty(k)`` is float32): named before gloo
      would abort the rank;
    * a library collective: switched off, its message says so;
    * a lone isend then irecv per step, under NCCL's rules (the course's tests; a GPU
      node): the ring hangs at its first step, and the message says why (every rank
      waits to create a two-rank communicator with its right neighbour);
    * any other exception: the rank's error, as CheckFailed.

    A loop that hangs is stopped after ``timeout`` seconds.
    """
    _check(reduce_scatter, "reduce_scatter", "reduce_scatter", timeout)
    passed(f"ring reduce-scatter on {_ON} ranks: chunk r holds the sum on rank r, every "
           f"message one chunk to the right neighbour (sizes {SIZES})")


def check_all_gather(all_gather, timeout: float = 30.0) -> None:
    """Every chunk reaches every rank, forwarded around the ring.

    Catches:
    * only some of the p-1 steps (a loop ``range(1)``, or p-1 hard-coded for 2 ranks):
      chunks still NaN at 3 and 4 ranks (named);
    * forwards its own chunk every step instead of the one that arrived last: the
      sizes of a send and its receive differ (gloo aborts; the hint names that) or
      chunks stay missing (NaN);
    * sends to the owner's destinations directly, or backwards: destinations named;
    * any exception: the rank's error, as CheckFailed.
    """
    _check(all_gather, "all_gather", "all_gather", timeout)
    passed(f"ring all-gather on {_ON} ranks: every rank has every chunk, every message "
           f"one chunk to the right neighbour (sizes {SIZES})")


def check_ring_average(ring_average, timeout: float = 30.0) -> None:
    """The mean on every rank, from the two ring phases.

    Catches:
    * forgets to divide: p times the mean (named);
    * dist.all_reduce (or any collective) instead of the ring: switched off (named);
    * passes whole tensors around the ring: more bytes than a ring's (named);
    * rebinds x (``x = x / p``) so the caller's tensor keeps the sum: p times the mean;
    * divides the whole tensor after the all-gather (the right mean for p times the
      division work): the all-gather's messages carry sums, not means (named);
    * any exception: the rank's error, as CheckFailed.
    """
    _check(ring_average, "ring_average", "ring_average", timeout)
    passed(f"reduce-scatter + divide + all-gather = the mean on every rank ({_ON} ranks)")
