"""Naive data parallelism equals a single process on the global batch."""

import pytest
import torch
import torch.distributed as dist

from helpers import launch, rank_info
from helpers.data import make_dataset
from helpers.naive_dp import average_gradients, broadcast_parameters
from helpers.model import build_model
from helpers.tolerance import assert_within_fp32_noise

STEPS, MICRO = 3, 4  # 3 optimizer steps, 4 sequences per rank


def _global_batches(world_size):
    data = make_dataset(seq_len=16, num_sequences=64)
    return [data.batch(range(s * MICRO * world_size, (s + 1) * MICRO * world_size))
            for s in range(STEPS)]


def _reference(world_size, dtype=torch.float32):
    """One process, the whole global batch each step (float64: the exact answer)."""
    model = build_model("toy", seed=7).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in _global_batches(world_size):
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _naive_dp():
    r, p = rank_info().rank, rank_info().world_size
    # every rank starts from different weights (seeds 7, 8): the broadcast
    # must make them rank 0's, i.e. the reference's (seed 7)
    model = build_model("toy", seed=7 + r)
    broadcast_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    calls = []
    for x, y in _global_batches(p):
        opt.zero_grad()
        model(x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO])[1].backward()
        calls.append(average_gradients(model))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, calls


@pytest.mark.slow
def test_naive_dp_equals_single_process():
    results = launch(_naive_dp, 2, seed_per_rank=True)
    ref, ref64 = _reference(2), _reference(2, torch.float64)
    n_grads = len(list(build_model("toy").parameters()))  # tied weight counted once
    for state, calls in results:
        assert calls == [n_grads] * STEPS  # one all-reduce per gradient per step
        # fp32, the gradient sums run in another order than in the single
        # process: as far from float64 as the fp32 reference is, times a small
        # factor (helpers.tolerance), whatever the machine's kernels.
        assert_within_fp32_noise(state, ref, ref64, "naive DP")
    # and the ranks agree with each other exactly (same averaged gradients)
    for k in ref:
        assert torch.equal(results[0][0][k], results[1][0][k])


def test_world_size_one_is_plain_single_process_code():
    assert not dist.is_initialized()
    model = build_model("toy")
    x, y = _global_batches(1)[0]
    model(x, y)[1].backward()
    before = [p.grad.clone() for p in model.parameters()]
    broadcast_parameters(model)
    assert average_gradients(model) == 0
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def _both_on_four_ranks():
    """Naive DP and BucketedDDP, 3 steps each, on the same 4-rank pool."""
    from helpers.ddp import BucketedDDP

    naive_state, _ = _naive_dp()
    r, p = rank_info().rank, rank_info().world_size
    model = BucketedDDP(build_model("toy", seed=7 + r), bucket_cap_mb=0.01, first_bucket_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in _global_batches(p):
        opt.zero_grad()
        model(x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO])[1].backward()
        opt.step()
    return naive_state, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.slow
def test_naive_dp_and_bucketed_ddp_equal_single_process_on_four_ranks():
    results = launch(_both_on_four_ranks, 4, seed_per_rank=True)
    ref, ref64 = _reference(4), _reference(4, torch.float64)
    for naive, bucketed in results:
        # same bound as above: reduction order differs from one process
        assert_within_fp32_noise(naive, ref, ref64, "naive DP")
        assert_within_fp32_noise(bucketed, ref, ref64, "BucketedDDP")
