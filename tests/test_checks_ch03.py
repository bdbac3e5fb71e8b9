"""Chapter 03's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch03
from helpers.collectives import chunk_bounds, ring_all_gather, ring_reduce_scatter


def _batch(sends=(), recvs=()):
    """Post (tensor, peer) sends and receives as one batch, skipping empty tensors (the
    form the lab hands out: nccl needs it)."""
    ops = [dist.P2POp(dist.isend, t, q) for t, q in sends if t.numel()] + \
        [dist.P2POp(dist.irecv, t, q) for t, q in recvs if t.numel()]
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()


def _exchange(send, recv):
    r, p = dist.get_rank(), dist.get_world_size()
    _batch([(send, (r + 1) % p)], [(recv, (r - 1) % p)])


def _lone_exchange(send, recv):  # a lone isend then a lone irecv: fine on gloo only
    r, p = dist.get_rank(), dist.get_world_size()
    reqs = [dist.isend(send, (r + 1) % p)] if send.numel() else []
    if recv.numel():
        reqs.append(dist.irecv(recv, (r - 1) % p))
    for q in reqs:
        q.wait()


def _lone_reduce_scatter(x):  # the right ring, each step posted as a lone isend + irecv
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r - s - 1) % p]
        c, d = bounds[(r - s - 2) % p]
        buf = torch.empty(d - c, dtype=x.dtype, device=x.device)
        _lone_exchange(x[a:b], buf)
        x[c:d] += buf


def _buffer_on_the_default_device(x):  # the right ring, its buffer made without device=
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r - s - 1) % p]
        c, d = bounds[(r - s - 2) % p]
        buf = torch.empty(d - c, dtype=x.dtype)   # on a GPU node: the CPU, data on the GPU
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _overwrites(x):  # receives into place instead of adding: only the left neighbour's copy
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r - s - 1) % p]
        c, d = bounds[(r - s - 2) % p]
        _exchange(x[a:b], x[c:d])


def _off_by_one(x):  # sends chunk (r - s): ends up owning the sum of chunk r+1
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r - s) % p]
        c, d = bounds[(r - s - 1) % p]
        buf = torch.empty(d - c, dtype=x.dtype, device=x.device)
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _backwards(x):  # the mirrored ring: sends left, receives right; right sums at any p
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r + s + 1) % p]
        c, d = bounds[(r + s + 2) % p]
        buf = torch.empty(d - c, dtype=x.dtype, device=x.device)
        _batch([(x[a:b], (r - 1) % p)], [(buf, (r + 1) % p)])
        x[c:d] += buf


def _straight_to_owner(x):  # each chunk sent directly to its owner: right sums, same bytes
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    a, b = bounds[r]
    bufs = [torch.empty(b - a, dtype=x.dtype, device=x.device) for _ in range(p)]
    _batch([(x[c:d].clone(), q) for q, (c, d) in enumerate(bounds) if q != r],
           [(bufs[q], q) for q in range(p) if q != r])
    for q in range(p):
        if q != r:
            x[a:b] += bufs[q]


def _even_slices(x):  # chunks as n // p slices: the tail past p * (n // p) is never reduced
    r, p = dist.get_rank(), dist.get_world_size()
    k = x.numel() // p
    bounds = [(i * k, (i + 1) * k) for i in range(p)]
    for s in range(p - 1):
        a, b = bounds[(r - s - 1) % p]
        c, d = bounds[(r - s - 2) % p]
        buf = torch.empty(d - c, dtype=x.dtype, device=x.device)
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _float32_buffer(x):  # torch.empty(k) is float32: gloo would abort on the size mismatch
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[(r - s - 1) % p]
        c, d = bounds[(r - s - 2) % p]
        buf = torch.empty(d - c, device=x.device)
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _no_modulo(x):  # chunk index without % p: IndexError on the first ranks
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[r - s - 1 + p if r - s - 1 < 0 else r - s - 1]
        c, d = bounds[r - s - 2 + 2 * p]
        buf = torch.empty(d - c, dtype=x.dtype, device=x.device)
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _gather_own_every_step(x):  # forwards its own chunk each step, not the one that arrived
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    for s in range(p - 1):
        a, b = bounds[r]
        c, d = bounds[(r - s - 1) % p]
        _exchange(x[a:b], x[c:d])


def _rebinds(x):  # `x = x / p` makes a new tensor: the caller's keeps the sum
    ring_reduce_scatter(x)
    ring_all_gather(x)
    x = x / dist.get_world_size()


def _gather_one_step(x):  # only the first step: chunks from two hops away never arrive
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    a, b = bounds[r]
    c, d = bounds[(r - 1) % p]
    _exchange(x[a:b], x[c:d])


def _forgets_to_divide(x):  # the sum, not the mean
    ring_reduce_scatter(x)
    ring_all_gather(x)


def _divides_after_gather(x):  # the right mean, dividing all of x after the all-gather
    ring_reduce_scatter(x)
    ring_all_gather(x)
    x /= dist.get_world_size()


def _library_average(x):  # the right mean, from the library's collective
    dist.all_reduce(x)
    x /= dist.get_world_size()


def _whole_tensor_average(x):  # the right mean, passing whole tensors: (p-1) N per rank
    acc, cur = x.clone(), x.clone()
    for _ in range(dist.get_world_size() - 1):
        buf = torch.empty_like(cur)
        _exchange(cur, buf)
        acc += buf
        cur = buf
    x.copy_(acc / dist.get_world_size())


def _batched_average(x):  # the reference ring phases (batch_isend_irecv inside): counted too
    r, p = dist.get_rank(), dist.get_world_size()
    ring_reduce_scatter(x)
    a, b = chunk_bounds(x.numel(), p)[r]
    x[a:b] /= p
    ring_all_gather(x)


class TestChapter03(ChapterChecks):
    lab, sol = "labs/03_all_reduce_ring_lab.ipynb", "solutions/03_all_reduce_ring_solution.ipynb"
    checks = {
        "reduce_scatter": Check(ch03.check_reduce_scatter, slow=True, wire="p2p"),
        "all_gather": Check(ch03.check_all_gather, slow=True, wire="p2p"),
        "ring_average": Check(ch03.check_ring_average, slow=True, wire="p2p"),
    }
    uses = {"ring_average": ("reduce_scatter", "all_gather")}  # the notebook's two phases
    wrong = [
        Wrong("reduce_scatter", _buffer_on_the_default_device, "a buffer made without device=",
              says="a buffer made without device="),
        Wrong("reduce_scatter", _overwrites, "receives into place instead of adding",
              says="don't overwrite"),
        Wrong("reduce_scatter", _off_by_one, "sends chunk r - s, one off", says="chunk indices"),
        Wrong("reduce_scatter", _backwards, "the ring runs backwards", says="runs backwards"),
        Wrong("reduce_scatter", _straight_to_owner, "each chunk straight to its owner",
              says="not a ring"),
        Wrong("reduce_scatter", _even_slices, "n // p slices instead of chunk_bounds",
              says="chunk_bounds"),
        Wrong("reduce_scatter", _float32_buffer, "float32 receive buffer",
              says="receiving into a torch.float32 buffer"),
        Wrong("reduce_scatter", _no_modulo, "a chunk index without % p",
              says="raised IndexError"),
        Wrong("all_gather", _gather_own_every_step, "forwards its own chunk every step",
              says="same chunk"),
        Wrong("ring_average", _rebinds, "rebinds x instead of dividing in place",
              says="x the mean"),
        Wrong("all_gather", _gather_one_step, "only the first step", says="never arrived"),
        Wrong("ring_average", _forgets_to_divide, "the sum, not the mean", says="divide"),
        Wrong("ring_average", _divides_after_gather, "divides the whole tensor after the gather",
              says="not yet the mean"),
        Wrong("ring_average", _library_average, "dist.all_reduce instead of the ring",
              says="dist.all_reduce is switched off"),
        Wrong("ring_average", _whole_tensor_average, "passes whole tensors around the ring",
              says="more than one chunk"),
    ]
    wrong += [
        # right on gloo, a hang on a GPU node: under NCCL's rules the check says why
        Wrong("reduce_scatter", _lone_reduce_scatter, "lone isend + irecv under NCCL's rules",
              says=r"(?s)hung: .*two-rank communicator.*batch_isend_irecv", kwargs={"timeout": 3},
              rules=True),
    ]
    right = [
        Right("ring_average", _batched_average, "posted as one batch: bytes counted the same"),
        Right("reduce_scatter", _lone_reduce_scatter,
              "lone isend + irecv on gloo: every send is still counted", rules=False),
    ]
