"""Chapter 14's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch
import torch.distributed as dist

from helpers.checks import CheckFailed, ch14
from helpers.zero import adamw_update, all_gather, reduce_scatter
from tools.nbtool import exercise

LAB, SOL = "labs/14_zero_stages_lab.ipynb", "solutions/14_zero_stages_solution.ipynb"


@pytest.mark.parametrize("name, check", [
    ("shard_bounds", ch14.check_shard_bounds),
    ("zero1_step", ch14.check_zero1_step),
    ("reduce_scatter_bucket", ch14.check_reduce_scatter_bucket),
    ("attach_zero2", ch14.check_attach_zero2),
])
def test_solution_passes_and_stub_fails(name, check, capsys):
    check(exercise(SOL, name))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        check(exercise(LAB, name))


def test_no_padding_fails():
    def floor_chunks(numel, world_size, rank):
        chunk = numel // world_size
        return rank * chunk, (rank + 1) * chunk, numel

    with pytest.raises(CheckFailed, match="Pad"):
        ch14.check_shard_bounds(floor_chunks)


def _zero1(average_twice=False, gather=True):
    def zero1_step(flat_param, flat_grad, m, v, step, group=None):
        N, r = dist.get_world_size(group), dist.get_rank(group)
        chunk = flat_param.numel() // N
        lo, hi = r * chunk, (r + 1) * chunk
        out = torch.empty(chunk)
        reduce_scatter(out, flat_grad / N, group=group)
        if average_twice:
            out /= N
        adamw_update(flat_param[lo:hi], out, m, v, step, ch14.LR, *ch14.BETAS, ch14.EPS, ch14.WD)
        if gather:
            all_gather(flat_param, flat_param[lo:hi].clone(), group=group)
        return out
    return zero1_step


def test_forgetting_the_all_gather_fails():
    with pytest.raises(CheckFailed, match="all-gather"):
        ch14.check_zero1_step(_zero1(gather=False))


def test_averaging_twice_fails():
    ch14.check_zero1_step(_zero1())  # the right answer, written as in the tests' helper
    with pytest.raises(CheckFailed, match="averaged twice"):
        ch14.check_zero1_step(_zero1(average_twice=True))


def test_bucket_mistakes_fail():
    def summed(grads, group=None):
        N = dist.get_world_size(group)
        flat = torch.cat([g.reshape(-1) for g in grads])
        buf = torch.zeros(-(-flat.numel() // N) * N)
        buf[:flat.numel()] = flat
        out = torch.empty(buf.numel() // N)
        reduce_scatter(out, buf, group=group)
        return out

    with pytest.raises(CheckFailed, match="summed"):
        ch14.check_reduce_scatter_bucket(summed)

    def unpadded(grads, group=None):
        N = dist.get_world_size(group)
        flat = torch.cat([g.reshape(-1) for g in grads]) / N
        out = torch.empty(flat.numel() // N)
        reduce_scatter(out, flat[:out.numel() * N], group=group)
        return out

    with pytest.raises(CheckFailed):
        ch14.check_reduce_scatter_bucket(unpadded)


def _zero2(free=True, average=True, accumulate=True, all_reduce=False):
    """The solution's mechanism with one switch turned wrong at a time."""
    def attach_zero2(model, group=None):
        N, r = dist.get_world_size(group), dist.get_rank(group)
        name_of = {id(p): n for n, p in model.named_parameters()}
        shards = {}

        def hook(p):
            numel = p.grad.numel()
            buf = torch.zeros(-(-numel // N) * N)
            buf[:numel] = p.grad.reshape(-1) / (N if average else 1)
            if all_reduce:  # the full average on every rank, then keep a slice
                dist.all_reduce(buf, group=group)
                chunk = buf[r * (buf.numel() // N):(r + 1) * (buf.numel() // N)].clone()
            else:
                chunk = torch.empty(buf.numel() // N)
                reduce_scatter(chunk, buf, group=group)
            n = name_of[id(p)]
            shards[n] = shards[n] + chunk if (n in shards and accumulate) else chunk
            if free:
                p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return shards

    return attach_zero2


@pytest.mark.parametrize("wrong, match", [
    (dict(free=False), "still in p.grad"),
    (dict(average=False), "2x the average"),
    (dict(accumulate=False), "Add into the shard"),
    (dict(all_reduce=True), "all_reduce refused"),
])
def test_zero2_hook_mistakes_fail(wrong, match):
    with pytest.raises(CheckFailed, match=match):
        ch14.check_attach_zero2(_zero2(**wrong))
