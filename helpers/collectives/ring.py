"""Ring reduce-scatter, all-gather and all-reduce from point-to-point messages.

Follows Patarasuk & Yuan 2009 and Thakur et al. 2005, sec. 4.5 (cited in
full below). Its alpha-beta cost is in ``helpers.collectives.cost``, its
measurement against the backend's all-reduce in ``helpers.collectives.measure``.

What
----
An all-reduce leaves the element-wise sum of every rank's tensor on every
rank. The ring algorithm (Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations"; Thakur et al. 2005,
"Optimization of collective communication operations in MPICH", sec. 4.5)
does it in two phases over a logical ring 0 -> 1 -> ... -> p-1 -> 0:

1. **reduce-scatter**: cut the tensor into p chunks. In each of p-1 steps,
   every rank sends one chunk to its right neighbour and adds the chunk it
   receives from its left neighbour into its own copy. Afterwards rank r
   holds the complete sum of chunk r.
2. **all-gather**: p-1 more steps pass the finished chunks around the ring,
   each rank overwriting its stale copy, until everyone has every chunk.

Why it is bandwidth-optimal: each rank sends 2(p-1) chunks of N/p bytes, i.e.
2(p-1)/p * N bytes, which tends to 2N however many ranks there are. Any
all-reduce must move at least that much through each rank's link
(Patarasuk & Yuan 2009, sec. 3). The price is latency: 2(p-1) sequential
messages, each paying the per-message start-up cost alpha.

How production differs: NCCL and gloo split a big tensor into many small
pieces and pipeline them, use several rings/channels at once, pick ring or
tree per message size, and reduce on the GPU with fused kernels. Our version
pipelines only within a step (a chunk travels in 1 MB segments, each added as
it lands) and pays Python overhead per message, so it loses on small
messages; on large ones it keeps up with gloo (benchmarks/bench_collectives.py).

The exchange hook
-----------------
Every message of the ring goes through one function, the *exchange*: the
point where a rank sends a piece of a chunk to its right neighbour and
receives one from its left neighbour. The ring decides *what* moves (which
chunk, into which buffer, what is added afterwards); the exchange decides
*how* it moves. Its shape::

    exchange(send, recv, right, left, group) -> list of requests

It starts sending ``send`` to group rank ``right`` and receiving into
``recv`` from group rank ``left``, and returns the requests (anything with a
``.wait()``); the ring waits on all of them before it reads ``recv`` or
reuses ``send``. Either tensor may be empty (a chunk of a tensor smaller than
the world): nothing moves on that side. The default is ``post_pair``, one
``batch_isend_irecv`` of the pair. ``ring_reduce_scatter``,
``ring_all_gather`` and ``ring_all_reduce`` take ``exchange=`` to replace it:
chapter 07 (``helpers.topology.Wire``) passes one that counts the bytes
leaving a node and delays them to emulate a slow network, then calls
``post_pair``; a test passes one that records every message. Because the
hook is called once per message, ``segmented=False`` (one message per chunk
and step, no 1 MB segments) lets such a hook see exactly the 2(p-1) messages
of the cost model.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from helpers.comm import group_rank, world_size

__all__ = ["chunk_bounds", "flat_view", "check_summable", "post_pair", "SEGMENT_BYTES",
           "ring_neighbours", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``world_size`` contiguous chunks, sizes differ by <= 1.

    The first ``numel % world_size`` chunks get one extra element, so any size
    works (also numel < world_size: the trailing chunks are empty).
    """
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_neighbours(group, order: Sequence[int] | None = None) -> tuple[int, int, int, int]:
    """(position, world_size, right neighbour, left neighbour) on the ring, the neighbours
    as ranks *within* ``group``; (0, 1, 0, 0) outside any process group.

    ``order``: the group ranks in the order the ring visits them (``order[i]`` sits at
    position i; default: rank order, so position == rank). The position, not the rank,
    picks the chunks a rank sends and owns: with ``order=[0, 2, 1, 3]`` rank 2 sits at
    position 1, sends to rank 1, receives from rank 0 and ends owning chunk 1. Every rank
    must pass the same ``order``.
    """
    rank, p = group_rank(group), world_size(group)  # no process group: one rank, nothing to do
    if order is None:
        return rank, p, (rank + 1) % p, (rank - 1) % p
    order = [int(r) for r in order]
    if sorted(order) != list(range(p)):
        raise ValueError(f"order must list every rank of the group once (0..{p - 1}), "
                         f"got {order}")
    pos = order.index(rank)
    return pos, p, order[(pos + 1) % p], order[(pos - 1) % p]


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a 1-D view of the same memory, so that the ring's in-place writes land
    in ``tensor``; a TypeError for a non-tensor, a ValueError if it is not contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("ring collectives work in place on a contiguous tensor; "
                         "call .contiguous() first (and copy the result back)")
    return tensor.view(-1)


@functools.lru_cache(maxsize=None)
def _has_add(dtype: torch.dtype, device_type: str) -> bool:
    """Whether torch can add two tensors of ``dtype`` on this kind of device.

    Asked once per (dtype, device type) with a one-element tensor: which
    dtypes have an addition kernel differs between CPU and GPU builds
    (uint16 and the float8 types have none on CPU in torch 2.x).
    """
    try:
        x = torch.zeros(1, dtype=dtype, device=device_type)
        x.add_(x)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def check_summable(tensor: torch.Tensor, what: str) -> None:
    """Refuse, on every rank alike and before any message, a dtype the ring cannot add.

    ``what`` names the caller in the message (e.g. "ring_all_reduce").
    """
    if tensor.dtype == torch.bool:
        # gloo and NCCL treat a bool "sum" as a logical or; a ring of add_ cannot
        # say which the caller meant.
        raise TypeError(f"{what} sums; a bool tensor has no sum. Cast it first: "
                        f".to(torch.uint8) for a count, or use dist.all_reduce for a logical or.")
    if not _has_add(tensor.dtype, tensor.device.type):
        raise TypeError(f"{what} adds chunks with torch's add_, which has no kernel for "
                        f"{tensor.dtype} on {tensor.device.type}. Sum in a wider dtype "
                        f"(e.g. x.float()) and cast back.")


def post_pair(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group,
              tag: int = 0) -> list:
    """Start sending ``send`` to the right neighbour and receiving ``recv`` from the left.

    The ring's default exchange hook (see the module docstring). Returns the
    requests; wait on all of them before touching either tensor. ``tag``
    tells apart two exchanges in flight at once under gloo (ring attention's
    K/V and its gradients); nccl ignores tags, so both sides must post them in
    the same order anyway.

    The two are posted as *one* batch (``batch_isend_irecv``), not as two
    separate ``isend``/``irecv`` calls. With gloo either way works. With NCCL
    a lone send of a large message may block until the peer posts the matching
    receive, and each separate call is its own NCCL operation: if every rank
    posts its send first, every rank waits for a receive that nobody has
    posted yet. At 2 ranks it is worse still: left == right, so a send to and
    a receive from the *same* peer sit in two calls that can each wait for the
    other. A batch is one NCCL group (ncclGroupStart/End), in which sends and
    receives progress together, so no ordering of the ring can deadlock. It
    is how NCCL users write a ring exchange. Empty tensors (chunks of a tensor
    smaller than the world) are left out on both sides of the pair alike.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=left))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for req in requests:
        req.wait()


# Reduce-scatter moves a chunk in segments of this many bytes, so that adding
# segment i overlaps receiving segment i+1 (gloo and NCCL pipeline the same way).
# Read at call time, so a test can set it small to get many segments (set it
# here, on helpers.collectives.ring: the package's copy is only a re-export).
SEGMENT_BYTES = 1 << 20


def _segments(n: int, per: int) -> list[tuple[int, int]]:
    """(start, end) pieces of ``per`` elements covering 0..n; none if n == 0."""
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def _workspace(flat: torch.Tensor, n: int, workspace: torch.Tensor | None) -> torch.Tensor:
    if workspace is None:
        return torch.empty(n, dtype=flat.dtype, device=flat.device)
    if workspace.dtype != flat.dtype or workspace.device != flat.device \
            or workspace.numel() < n or not workspace.is_contiguous():
        raise ValueError(f"workspace must be a contiguous {flat.dtype} tensor on {flat.device} "
                         f"with at least {n} elements (one chunk)")
    return workspace.view(-1)


def _send_and_add(send: torch.Tensor, mine: torch.Tensor, buf: torch.Tensor, right: int,
                  left: int, group, exchange, per: int) -> None:
    """One reduce-scatter step: ``send`` goes right; the left neighbour's partial sum of
    ``mine`` arrives in ``buf`` and is added into ``mine``.

    Both chunks travel in pieces of ``per`` elements, piece i out with piece i
    in, each pair one call of ``exchange``. Every pair is posted first, then
    each received piece is added as soon as its requests are done, while later
    pieces are still on the wire. Sender and receiver cut a chunk alike (same
    chunk_bounds, same ``per``), and messages between two ranks are matched in
    the order they were posted. The two chunks may differ by one element, so
    one can have a piece more: that exchange is one-sided, and so is its
    partner on the neighbour.
    """
    out, inc = _segments(send.numel(), per), _segments(mine.numel(), per)
    pending = []
    for i in range(max(len(out), len(inc))):
        a, b = out[i] if i < len(out) else (0, 0)
        x, y = inc[i] if i < len(inc) else (0, 0)
        pending.append((exchange(send[a:b], buf[x:y], right, left, group), x, y))
    for requests, x, y in pending:
        _wait(requests)
        mine[x:y].add_(buf[x:y])  # (piece,) += (piece,)


def ring_reduce_scatter(tensor: torch.Tensor, group=None,
                        workspace: torch.Tensor | None = None, *,
                        exchange=post_pair, segmented: bool = True,
                        order: Sequence[int] | None = None) -> torch.Tensor:
    """Phase 1, in place: afterwards chunk ``rank`` (``chunk_bounds``) holds the sum.

    Returns that chunk (a view into ``tensor``); with ``order``, the chunk of this
    rank's *position* on the ring (``ring_neighbours``). The other chunks hold partial
    sums and are meant to be overwritten by ``ring_all_gather``.
    ``workspace``: optional receive buffer of at least one chunk, reused across
    calls. A fresh large buffer costs the kernel's zeroing of every new page on
    first touch (about as long as the transfer itself on a CPU); NCCL likewise
    keeps persistent buffers.
    ``exchange``: the hook every message goes through (module docstring).
    ``segmented``: move each chunk in ``SEGMENT_BYTES`` pieces, adding each as it
    lands (default); False sends it as one message.
    ``order``: the ring's rank order (``ring_neighbours``); default: rank order.
    """
    flat = flat_view(tensor)
    check_summable(flat, "ring_reduce_scatter")
    rank, p, right, left = ring_neighbours(group, order)  # rank: the position on the ring
    if p == 1:
        return flat
    bounds = chunk_bounds(flat.numel(), p)
    biggest = bounds[0][1] - bounds[0][0]  # chunk_bounds puts the extra elements first
    buf = _workspace(flat, biggest, workspace)
    per = max(1, (SEGMENT_BYTES // flat.element_size()) if segmented else biggest)  # elements
    # Step s: send chunk (rank - s - 1), receive chunk (rank - s - 2) and add it.
    # The chunk received in the last step (s = p-2) is chunk `rank`, which by then
    # has collected the contributions of all p ranks (Patarasuk & Yuan 2009, sec. 4).
    for s in range(p - 1):
        a, b = bounds[(rank - s - 1) % p]
        c, d = bounds[(rank - s - 2) % p]
        _send_and_add(flat[a:b], flat[c:d], buf, right, left, group, exchange, per)
    a, b = bounds[rank]
    return flat[a:b]


def ring_all_gather(tensor: torch.Tensor, group=None, *, exchange=post_pair,
                    order: Sequence[int] | None = None) -> torch.Tensor:
    """Phase 2, in place: on entry chunk ``rank`` is final; on return every chunk is.

    Step s sends chunk (rank - s) and receives chunk (rank - s - 1) straight
    into its place (no add, no extra buffer, so nothing to overlap: one
    message per step). ``exchange``, ``order``: as in ``ring_reduce_scatter``
    (with ``order``, "rank" is the position on the ring).
    """
    flat = flat_view(tensor)
    rank, p, right, left = ring_neighbours(group, order)
    if p == 1:
        return tensor
    bounds = chunk_bounds(flat.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(rank - s) % p]
        c, d = bounds[(rank - s - 1) % p]
        _wait(exchange(flat[a:b], flat[c:d], right, left, group))
    return tensor


def ring_all_reduce(tensor: torch.Tensor, group=None,
                    workspace: torch.Tensor | None = None, *,
                    exchange=post_pair, segmented: bool = True,
                    order: Sequence[int] | None = None) -> torch.Tensor:
    """In-place sum over the group, as reduce-scatter then all-gather. Returns ``tensor``.

    Same result as ``dist.all_reduce(tensor)`` (up to floating-point summation
    order; exact for integers, which wrap around on overflow as gloo's do).
    Any dtype torch can add on the tensor's device, including int16, which
    gloo's own all_reduce refuses; bool and dtypes without an add kernel
    (uint16, float8 on CPU) raise TypeError before any message is sent.
    ``workspace``, ``exchange``, ``segmented``, ``order``: see ``ring_reduce_scatter``.
    ``order`` changes who neighbours whom (chapter 07: which hops cross a node
    boundary), not the result.
    """
    check_summable(flat_view(tensor), "ring_all_reduce")
    ring_reduce_scatter(tensor, group, workspace, exchange=exchange, segmented=segmented,
                        order=order)
    ring_all_gather(tensor, group, exchange=exchange, order=order)
    return tensor
