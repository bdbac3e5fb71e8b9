"""Chapter 03's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import sys

import cloudpickle
import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch03
from helpers.collectives import chunk_bounds, ring_all_gather, ring_reduce_scatter

# Ship this file's wrong answers to the ranks by value: by reference, every rank would
# import this module, and with it pytest and nbformat (seconds each on a loaded machine,
# inside the check's 30 s timeout).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _exchange(send, recv):
    r, p = dist.get_rank(), dist.get_world_size()
    reqs = [dist.isend(send, (r + 1) % p)] if send.numel() else []
    if recv.numel():
        reqs.append(dist.irecv(recv, (r - 1) % p))
    for q in reqs:
        q.wait()


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
        buf = torch.empty(d - c, dtype=x.dtype)
        _exchange(x[a:b], buf)
        x[c:d] += buf


def _gather_one_step(x):  # only the first step: chunks from two hops away never arrive
    r, p = dist.get_rank(), dist.get_world_size()
    bounds = chunk_bounds(x.numel(), p)
    a, b = bounds[r]
    c, d = bounds[(r - 1) % p]
    _exchange(x[a:b], x[c:d])


def _forgets_to_divide(x):  # the sum, not the mean
    ring_reduce_scatter(x)
    ring_all_gather(x)


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


def _batched_average(x):  # the reference ring (batch_isend_irecv inside): bytes counted too
    from helpers.collectives import ring_all_reduce
    ring_all_reduce(x)
    x /= dist.get_world_size()


class TestChapter03(ChapterChecks):
    lab, sol = "labs/03_all_reduce_ring_lab.ipynb", "solutions/03_all_reduce_ring_solution.ipynb"
    checks = {
        "reduce_scatter": Check(ch03.check_reduce_scatter, slow=True),
        "all_gather": Check(ch03.check_all_gather, slow=True),
        "ring_average": Check(ch03.check_ring_average, slow=True),
    }
    uses = {"ring_average": ("reduce_scatter", "all_gather")}  # the notebook's two phases
    wrong = [
        Wrong("reduce_scatter", _overwrites, "receives into place instead of adding",
              says="don't overwrite"),
        Wrong("reduce_scatter", _off_by_one, "sends chunk r - s, one off", says="chunk indices"),
        Wrong("all_gather", _gather_one_step, "only the first step", says="never arrived"),
        Wrong("ring_average", _forgets_to_divide, "the sum, not the mean", says="divide"),
        Wrong("ring_average", _library_average, "dist.all_reduce instead of the ring",
              says="dist.all_reduce is switched off"),
        Wrong("ring_average", _whole_tensor_average, "passes whole tensors around the ring",
              says="more than a ring's"),
    ]
    right = [
        Right("ring_average", _batched_average, "posted as one batch: bytes counted the same"),
    ]
