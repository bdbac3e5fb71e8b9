"""Rank functions with planted bugs, for tests/test_debug.py.

They live apart from the tests so that a rank imports only torch to run them
(the test module imports pytest, a second or more per rank on a busy machine,
which would eat into the short timeouts of the planted hangs). Each marked
line (``# NAME``) is looked up by the tests, which check the diff names it.
"""

import os
import time

import torch
import torch.distributed as dist

from helpers.checks.ch18 import LR, STEPS, batch, n_batches
from helpers.debug import record_collectives

def healthy_step():
    t = torch.ones(4)
    before = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, dist.batch_isend_irecv)
    with record_collectives() as rec:
        dist.all_reduce(t)                                   # HEALTHY-ALLREDUCE
        parts = [torch.empty(2, 3) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, torch.zeros(2, 3))
        dist.barrier()
        if dist.get_rank() == 0:
            dist.send(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
        ops = [dist.P2POp(dist.isend, t, (dist.get_rank() + 1) % 3),
               dist.P2POp(dist.irecv, torch.empty(4), (dist.get_rank() - 1) % 3)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    after = (dist.all_reduce, dist.isend, dist.distributed_c10d.isend, dist.batch_isend_irecv)
    return rec.calls, all(a is b for a, b in zip(before, after))


def failing_inside_recorder():
    before = dist.all_reduce
    inside = None
    try:
        with record_collectives():
            inside = dist.all_reduce
            raise ValueError("x")
    except ValueError:
        pass
    return inside is not before and dist.all_reduce is before


def skips_a_collective():
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() != 2:
        dist.all_reduce(t)                                   # SKIPPED
    dist.broadcast(t, 0)                                     # SKIPPER-BCAST


def swaps_two_collectives():
    t = torch.ones(4)
    with record_collectives():                               # used inside fn, not record=True
        if dist.get_rank() == 1:
            dist.broadcast(t, 0)                             # SWAPPED
            dist.all_reduce(t)
        else:
            dist.all_reduce(t)                               # IN-ORDER
            dist.broadcast(t, 0)


def mismatched_shape():
    t = torch.ones(5 if dist.get_rank() == 1 else 4)
    dist.all_reduce(t)                                       # SHAPE


def mismatched_dtype():
    t = torch.ones(4, dtype=torch.float64 if dist.get_rank() == 2 else torch.float32)
    dist.all_reduce(t)                                       # DTYPE


def crashes_mid_step():
    t = torch.ones(4)
    dist.all_reduce(t)                                       # BEFORE-CRASH
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(t)                                       # AFTER-CRASH


def data_dependent_branch():
    """Gradient clipping done wrong: only a rank whose *local* gradient norm is
    large all-reduces the norm; rank 2's batch is the one with large values."""
    torch.manual_seed(dist.get_rank())
    w = torch.ones(8, requires_grad=True)
    x = torch.randn(16, 8) * (10.0 if dist.get_rank() == 2 else 1.0)
    (x @ w).pow(2).mean().backward()
    if w.grad.norm() > 100.0:
        norm = w.grad.norm().pow(2)
        dist.all_reduce(norm)                                # BRANCH
    dist.all_reduce(w.grad)                                  # GRAD-SYNC


def recv_without_send():
    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        dist.recv(t, 0)                                      # LONELY-RECV


def slow_rank(slow: int, steps: int):
    with record_collectives() as rec:
        for _ in range(steps):
            if dist.get_rank() == slow:
                time.sleep(0.05)  # this rank's data loader stalls, every step
            dist.all_reduce(torch.ones(4))
    return rec.calls




# -- replicas --------------------------------------------------------------------

def ddp_steps(steps: int = 2, local_clip_on: int | None = None, flip_on: int | None = None,
              flip_what: str = "param"):
    """A few steps of BucketedDDP + AdamW on a small MLP, each rank its own batch.

    local_clip_on=r: rank r clips with the norm of its *local* gradients
    (computed before the all-reduce) - a rank-dependent update.
    flip_on=r: after training, one bit of rank r's state flips (a parameter,
    or an Adam moment with flip_what="optimizer")."""
    from helpers.ddp import BucketedDDP
    from helpers.debug.replica import check_replicas, flip_bit

    rank = dist.get_rank()
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(8, 32))
    net.add_module("act", torch.nn.GELU())
    net.add_module("fc2", torch.nn.Linear(32, 8))
    model = BucketedDDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x).pow(2).mean()
        local_norm = None
        if rank == local_clip_on:  # BUG: the norm of this rank's own gradients...
            loss.backward(retain_graph=True)
            local_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
            opt.zero_grad()
        loss.backward()
        if local_norm is not None:  # ...scales the all-reduced ones on this rank only
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3 * local_norm.item())
        opt.step()
        opt.zero_grad()
    healthy_before_flip = check_replicas(model.module, opt)
    if rank == flip_on:
        p = model.module.fc2.weight
        flip_bit(p if flip_what == "param" else opt.state[p]["exp_avg"], index=5)
    return healthy_before_flip, check_replicas(model.module, opt)


# -- chapter 18's lab: plausible wrong fixes -------------------------------------------------

def sync_always() -> torch.Tensor:
    """Fix 1 done wrong: no skip at all, so a rank's NaN reaches every rank."""
    world = dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        x, y = batch(dist.get_rank(), step)      # holds the NaN where the data has one
        (x @ w - y).pow(2).mean().backward()
        dist.all_reduce(w.grad)
        with torch.no_grad():
            w -= LR * w.grad / world
        w.grad = None
    return w.detach()


def pad_with_zero_grads() -> torch.Tensor:
    """Fix 3 done wrong: every rank runs the longest shard's steps, the short one
    contributing a zero gradient: no hang, but not the reference's update."""
    world = dist.get_world_size()
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    for step in range(STEPS):
        if step < n_batches(dist.get_rank()):
            x, y = batch(dist.get_rank(), step)
            (x @ w - y).pow(2).mean().backward()
        else:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad)
        with torch.no_grad():
            w -= LR * w.grad / world
        w.grad = None
    return w.detach()


def a_collective_that_raises():
    """Rank 0's all-reduce raises (MAX is not defined on complex numbers) and
    rank 0 gives up; rank 1 goes on to the next all-reduce and waits there."""
    from helpers.debug import record_collectives
    with record_collectives():
        if dist.get_rank() == 0:
            z = torch.ones(2, dtype=torch.complex64)
            dist.all_reduce(z, op=dist.ReduceOp.MAX)                # RAISES
        dist.all_reduce(torch.ones(2))
