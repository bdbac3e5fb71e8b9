"""Chapter 03's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from helpers.checks import CheckFailed, ch03
from helpers.collectives import chunk_bounds, ring_all_gather, ring_reduce_scatter
from tools.nbtool import exercise

# Ship this file's wrong answers to the ranks by value: by reference, every rank would
# import this module, and with it pytest and nbformat (seconds each on a loaded machine,
# inside the check's 30 s timeout).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAB, SOL = "labs/03_all_reduce_ring_lab.ipynb", "solutions/03_all_reduce_ring_solution.ipynb"
CHECKS = [("reduce_scatter", ch03.check_reduce_scatter), ("all_gather", ch03.check_all_gather),
          ("ring_average", ch03.check_ring_average)]


def test_stubs_fail_without_starting_ranks():
    for name, check in CHECKS:
        with pytest.raises(CheckFailed, match="not implemented"):
            check(exercise(LAB, name))


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


@pytest.mark.slow
def test_solution_passes_and_mistakes_fail(capsys):
    sol = {name: exercise(SOL, name) for name, _ in CHECKS}
    # ring_average calls the notebook's two phases, defined in other cells
    sol["ring_average"].__globals__.update(reduce_scatter=sol["reduce_scatter"],
                                          all_gather=sol["all_gather"])
    for name, check in CHECKS:
        check(sol[name])
    assert capsys.readouterr().out.count("✓") == 3
    with pytest.raises(CheckFailed, match="don't overwrite"):
        ch03.check_reduce_scatter(_overwrites)
    with pytest.raises(CheckFailed, match="chunk indices"):
        ch03.check_reduce_scatter(_off_by_one)
    with pytest.raises(CheckFailed, match="never arrived"):
        ch03.check_all_gather(_gather_one_step)
    with pytest.raises(CheckFailed, match="divide"):
        ch03.check_ring_average(_forgets_to_divide)
    with pytest.raises(CheckFailed, match="dist.all_reduce is switched off"):
        ch03.check_ring_average(_library_average)
    with pytest.raises(CheckFailed, match="more than a ring's"):
        ch03.check_ring_average(_whole_tensor_average)
    ch03.check_ring_average(_batched_average)  # posted as one batch: counted the same
