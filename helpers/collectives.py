"""Ring all-reduce from point-to-point messages, and how to read its cost.

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

Cost (the alpha-beta model, Thakur et al. 2005, sec. 4; Hockney 1994)
---------------------------------------------------------------------
A message of n bytes costs alpha + n / beta (alpha: latency, seconds;
beta: link bandwidth, bytes/s). Ring all-reduce of N bytes on p ranks:

    T_ring = 2(p-1) alpha + 2 (p-1)/p * N / beta

A binomial tree (reduce to a root, then broadcast back) sends the whole
message at every one of its 2 ceil(log2 p) levels:

    T_tree = 2 ceil(log2 p) (alpha + N / beta)

so the tree wins for small messages (few alphas), the ring for large ones.
NCCL's trees are pipelined double binary trees that also reach ~2N/beta; the
simple tree here is the textbook one that shows the trade-off.

Halving-doubling (Rabenseifner 2004; Thakur et al. 2005, sec. 4.5) gets both:
a reduce-scatter by *recursive halving* (log2 p steps; at step k a rank
swaps half of what it still owns with the partner whose rank differs in one
bit, and adds) and an all-gather by *recursive doubling* (the same partners
in reverse order, each step doubling what a rank owns). It sends the ring's
2(p-1)/p * N bytes in only 2 log2 p messages:

    T_hd = 2 log2(p) alpha + 2 (p-1)/p * N / beta          (p a power of two)

For other p, the first 2r ranks (r = p - 2^floor(log2 p)) pair up before and
after: the even one of each pair hands its whole tensor to the odd one and
gets the sum back at the end, which adds 2 (alpha + N/beta) to the time
(Thakur et al. fold only half the vector each way; we fold it whole, simpler
and at most one extra N/beta). MPICH uses it for long messages when p is a
power of two; NCCL does not (rings and trees only).

Algorithm vs bus bandwidth (nccl-tests, doc/PERFORMANCE.md)
-----------------------------------------------------------
``algbw = N / T`` depends on p for the same hardware. nccl-tests therefore
also report ``busbw = algbw * factor`` with factor 2(p-1)/p for all-reduce and
(p-1)/p for reduce-scatter and all-gather: the bytes that really crossed each
link per second, comparable with the link's peak whatever p is.

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
import math
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["chunk_bounds", "flat_view", "check_summable", "post_pair", "SEGMENT_BYTES",
           "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "halving_doubling_all_reduce", "halving_doubling_all_reduce_time",
           "ring_all_reduce_time", "tree_all_reduce_time", "bus_bandwidth", "BUSBW_FACTORS",
           "check_sweep_args", "sweep", "fit_alpha_beta"]


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


def _ring(group) -> tuple[int, int, int, int]:
    """(rank, world_size, right neighbour, left neighbour), all ranks *within* ``group``."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, 0, 0  # no process group: one rank, the collectives do nothing
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    return rank, p, (rank + 1) % p, (rank - 1) % p


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


def post_pair(send: torch.Tensor, recv: torch.Tensor, right: int, left: int, group) -> list:
    """Start sending ``send`` to the right neighbour and receiving ``recv`` from the left.

    The ring's default exchange hook (see the module docstring). Returns the
    requests; wait on all of them before touching either tensor.

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
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=left))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests) -> None:
    for req in requests:
        req.wait()


# Reduce-scatter moves a chunk in segments of this many bytes, so that adding
# segment i overlaps receiving segment i+1 (gloo and NCCL pipeline the same way).
# Read at call time, so a test can set it small to get many segments.
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
                        exchange=post_pair, segmented: bool = True) -> torch.Tensor:
    """Phase 1, in place: afterwards chunk ``rank`` (``chunk_bounds``) holds the sum.

    Returns that chunk (a view into ``tensor``). The other chunks hold partial
    sums and are meant to be overwritten by ``ring_all_gather``.
    ``workspace``: optional receive buffer of at least one chunk, reused across
    calls. A fresh large buffer costs the kernel's zeroing of every new page on
    first touch (about as long as the transfer itself on a CPU); NCCL likewise
    keeps persistent buffers.
    ``exchange``: the hook every message goes through (module docstring).
    ``segmented``: move each chunk in ``SEGMENT_BYTES`` pieces, adding each as it
    lands (default); False sends it as one message.
    """
    flat = flat_view(tensor)
    check_summable(flat, "ring_reduce_scatter")
    rank, p, right, left = _ring(group)
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


def ring_all_gather(tensor: torch.Tensor, group=None, *, exchange=post_pair) -> torch.Tensor:
    """Phase 2, in place: on entry chunk ``rank`` is final; on return every chunk is.

    Step s sends chunk (rank - s) and receives chunk (rank - s - 1) straight
    into its place (no add, no extra buffer, so nothing to overlap: one
    message per step). ``exchange``: as in ``ring_reduce_scatter``.
    """
    flat = flat_view(tensor)
    rank, p, right, left = _ring(group)
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
                    exchange=post_pair, segmented: bool = True) -> torch.Tensor:
    """In-place sum over the group, as reduce-scatter then all-gather. Returns ``tensor``.

    Same result as ``dist.all_reduce(tensor)`` (up to floating-point summation
    order; exact for integers, which wrap around on overflow as gloo's do).
    Any dtype torch can add on the tensor's device, including int16, which
    gloo's own all_reduce refuses; bool and dtypes without an add kernel
    (uint16, float8 on CPU) raise TypeError before any message is sent.
    ``workspace``, ``exchange``, ``segmented``: see ``ring_reduce_scatter``.
    """
    check_summable(flat_view(tensor), "ring_all_reduce")
    ring_reduce_scatter(tensor, group, workspace, exchange=exchange, segmented=segmented)
    ring_all_gather(tensor, group, exchange=exchange)
    return tensor


# --------------------------------------------------------------------------
# Halving-doubling (Rabenseifner): the ring's bytes in 2 log2 p messages.
# --------------------------------------------------------------------------

def _swap(send: torch.Tensor, recv: torch.Tensor, peer: int, group) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it; return when both are done."""
    _wait(post_pair(send, recv, peer, peer, group))


def halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over the group by recursive halving, then recursive doubling.

    Rabenseifner 2004, "Optimization of collective reduction operations";
    Thakur et al. 2005, sec. 4.5. Same result as ``dist.all_reduce`` up to
    summation order (exact for integers); any p (see the module docstring for
    how ranks beyond the largest power of two are folded in).
    """
    flat = flat_view(tensor)
    check_summable(flat, "halving_doubling_all_reduce")
    rank, p, _, _ = _ring(group)
    if p == 1:
        return tensor
    q = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - q                  # ranks 0..2*extra-1 pair up: even ones sit out
    if rank < 2 * extra and rank % 2 == 0:
        _swap(flat, flat[:0], rank + 1, group)   # hand my whole tensor to rank + 1
        _swap(flat[:0], flat, rank + 1, group)   # and get the finished sum back
        return tensor
    if rank < 2 * extra:
        buf = torch.empty_like(flat)
        _swap(flat[:0], buf, rank - 1, group)
        flat.add_(buf)                           # (N,) += partner's (N,)
        me = rank // 2
    else:
        me = rank - extra
    real = lambda v: 2 * v + 1 if v < extra else v + extra  # virtual rank -> group rank
    bounds = chunk_bounds(flat.numel(), q)
    elems = lambda lo, hi: (bounds[lo][0], bounds[hi - 1][1])  # chunks [lo, hi) -> elements
    lo, hi = 0, q  # the chunks this rank is still responsible for
    # the largest half ever received is the first step's lower half (chunk_bounds puts
    # the extra elements in the first chunks)
    buf = torch.empty(bounds[q // 2 - 1][1], dtype=flat.dtype, device=flat.device)
    # Recursive halving: distance q/2, q/4, ..., 1. Keep the half of [lo, hi) that
    # contains chunk `me`, send the other half to the partner, add the partner's
    # copy of mine. After log2 q steps [lo, hi) = [me, me + 1).
    d = q // 2
    while d:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & d == 0 else ((mid, hi), (lo, mid))
        (a, b), (c, e) = elems(*keep), elems(*give)
        _swap(flat[c:e], buf[:b - a], real(me ^ d), group)
        flat[a:b].add_(buf[:b - a])              # (half,) += partner's (half,)
        lo, hi = keep
        d //= 2
    # Recursive doubling: distance 1, 2, ..., q/2. Swap what I own for the
    # partner's equally large neighbouring block, written straight into place.
    d = 1
    while d < q:
        width = hi - lo
        plo = lo + width if me & d == 0 else lo - width  # the partner's block
        (a, b), (c, e) = elems(lo, hi), elems(plo, plo + width)
        _swap(flat[a:b], flat[c:e], real(me ^ d), group)
        lo, hi = min(lo, plo), max(hi, plo + width)
        d *= 2
    if rank < 2 * extra:
        _swap(flat, flat[:0], rank - 1, group)   # the sum back to the rank that sat out
    return tensor


# --------------------------------------------------------------------------
# The alpha-beta cost model and bus bandwidth.
# --------------------------------------------------------------------------

def _check_model_args(nbytes: float, world_size: int, alpha: float, beta: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if alpha < 0 or beta <= 0:
        raise ValueError(f"need alpha >= 0 (seconds) and beta > 0 (bytes/s), got {alpha}, {beta}")


def ring_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """T = 2(p-1) alpha + 2(p-1)/p * nbytes / beta (Patarasuk & Yuan 2009; Thakur et al. 2005)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    p = world_size
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / beta


def tree_all_reduce_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) (alpha + nbytes/beta)
    (Thakur et al. 2005, sec. 4.1-4.2; unpipelined)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    return 2 * math.ceil(math.log2(world_size)) * (alpha + nbytes / beta)


def halving_doubling_all_reduce_time(nbytes: float, world_size: int, alpha: float,
                                     beta: float) -> float:
    """2 log2(q) alpha + 2(q-1)/q * nbytes/beta, q the largest power of two <= p, plus
    2 (alpha + nbytes/beta) to fold in the other p - q ranks (Thakur et al. 2005, sec. 4.5)."""
    _check_model_args(nbytes, world_size, alpha, beta)
    q = 1 << (world_size.bit_length() - 1)
    t = 2 * int(math.log2(q)) * alpha + 2 * (q - 1) / q * nbytes / beta
    return t + (2 * (alpha + nbytes / beta) if q != world_size else 0.0)


# busbw = algbw * factor(p); nccl-tests doc/PERFORMANCE.md, one factor per collective.
BUSBW_FACTORS = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "all_to_all": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def bus_bandwidth(algbw: float, world_size: int, op: str = "all_reduce") -> float:
    """Bus bandwidth from algorithm bandwidth (bytes/s in, bytes/s out)."""
    if op not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {op!r}; choose from {sorted(BUSBW_FACTORS)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return algbw * BUSBW_FACTORS[op](world_size)


# --------------------------------------------------------------------------
# Measuring: run inside launch(); every rank returns the same numbers.
# --------------------------------------------------------------------------

def _all_reduce_impl(impl: str, workspace: torch.Tensor | None = None):
    if impl == "ring":
        return lambda t: ring_all_reduce(t, workspace=workspace)
    if impl == "hd":
        return lambda t: halving_doubling_all_reduce(t)
    if impl == "torch":  # the backend's own all_reduce
        return lambda t: dist.all_reduce(t)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# "hd": halving-doubling; "torch": the backend's own dist.all_reduce (gloo or nccl)
IMPLS = ("ring", "hd", "torch")


def check_sweep_args(sizes: Iterable[int], impls: Sequence[str], iters: int,
                     warmup: int) -> list[int]:
    """Validate ``sweep``'s arguments; returns ``sizes`` as a list of ints.

    Call it before starting ranks (the benchmark does) to fail at once with a
    clear message; ``sweep`` calls it too, on every rank, before any collective.
    """
    sizes = list(sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 4 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of ints >= 4 (bytes; the sweep sends "
                         f"float32 elements), got {sizes!r}")
    if isinstance(impls, str) or not impls or any(i not in IMPLS for i in impls) \
            or len(set(impls)) != len(impls):
        raise ValueError(f"impls must be a non-empty sequence of distinct names from {IMPLS}, "
                         f"got {impls!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1 (timed calls per size), got {iters!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    return sizes


def sweep(sizes: Iterable[int], impls: Sequence[str] = ("ring", "torch"), iters: int = 5,
          warmup: int = 1) -> list[dict]:
    """algbw/busbw over message sizes for each implementation; run on every rank.

    For each size the implementations take turns call by call (ring, torch,
    ring, torch, ...), so a burst of load elsewhere on the machine hits both
    alike. Each call is timed after a barrier; a sample is the slowest rank's
    time; the row reports the median sample.
    Returns rows {"impl", "nbytes", "time_s", "algbw", "busbw"} (bytes/s).
    """
    sizes = check_sweep_args(sizes, impls, iters, warmup)
    p = dist.get_world_size()
    device = "cuda" if "nccl" in dist.get_backend() else "cpu"  # "cpu:gloo,cuda:nccl" too
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
        # persistent receive buffer for the ring, allocated and touched outside the timing
        ws = torch.zeros(chunk_bounds(x.numel(), p)[0][1], dtype=x.dtype, device=device)
        fns = {impl: _all_reduce_impl(impl, ws) for impl in impls}
        samples: dict = {impl: [] for impl in impls}
        for i in range(warmup + iters):
            for impl, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn(x)
                if x.is_cuda:
                    torch.cuda.synchronize(x.device)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # done when the slowest rank is
                if i >= warmup:
                    samples[impl].append(float(dt))
                x.fill_(1.0)  # keep the values bounded (sums of ones grow by p per call)
        for impl in impls:
            t = sorted(samples[impl])[len(samples[impl]) // 2]
            algbw = nbytes / t
            rows.append({"impl": impl, "nbytes": int(nbytes), "time_s": t, "algbw": algbw,
                         "busbw": bus_bandwidth(algbw, p, "all_reduce")})
    return rows


def fit_alpha_beta(nbytes: Sequence[float], times: Sequence[float],
                   world_size: int) -> tuple[float, float]:
    """Least-squares fit of T = 2(p-1) alpha + 2(p-1)/p N / beta; returns (alpha, beta).

    The fit minimizes *relative* error (each row weighted by 1/T), because the
    sweep spans five orders of magnitude of T: an unweighted fit would ignore
    the small messages, which are the only ones that show alpha.
    """
    import numpy as np

    if len(nbytes) != len(times) or len(nbytes) < 2:
        raise ValueError("need at least two (nbytes, time) pairs of equal length")
    if world_size < 2:
        raise ValueError("a fit needs world_size >= 2 (one rank sends nothing)")
    p = world_size
    N = np.asarray(nbytes, dtype=float)
    T = np.asarray(times, dtype=float)
    if (T <= 0).any():
        raise ValueError("times must be positive")
    A = np.stack([np.full_like(N, 2 * (p - 1)), 2 * (p - 1) / p * N], axis=1) / T[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = max(float(inv_beta), 1e-30)
    return alpha, 1.0 / inv_beta
