"""Chapter 16's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest

from helpers.checks import CheckFailed, ch16
from tools.nbtool import exercise

LAB, SOL = "labs/16_comm_overlap_lab.ipynb", "solutions/16_comm_overlap_solution.ipynb"


@pytest.mark.parametrize("name, check", [
    ("union_length", ch16.check_union_length),
    ("prefetch", ch16.check_prefetch),
    ("topk_ef_hook", ch16.check_topk_ef_hook),
])
def test_solution_passes_and_stub_fails(name, check, capsys):
    check(exercise(SOL, name))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        check(exercise(LAB, name))


def test_plain_sum_and_unsorted_merge_fail():
    with pytest.raises(CheckFailed, match="plain sum"):
        ch16.check_union_length(lambda spans: sum(b - a for a, b in spans))

    def no_sort(spans):
        total, end = 0.0, float("-inf")
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        return total

    with pytest.raises(CheckFailed):
        ch16.check_union_length(no_sort)


def test_prefetch_mistakes_fail():
    def same_direction(fsdp, i, phase):  # i + 1 in backward too: that unit already ran
        if i + 1 < len(fsdp.units):
            fsdp.gather_async(fsdp.units[i + 1])

    with pytest.raises(CheckFailed, match="bytes sent|backward"):
        ch16.check_prefetch(same_direction)

    def everything(fsdp, i, phase):  # gathers all units at once: memory of DDP
        for u in fsdp.units:
            fsdp.gather_async(u)

    with pytest.raises(CheckFailed):
        ch16.check_prefetch(everything)


def _topk_hook(ratio, feedback=True, average=True, dense=False, zero_sent=True):
    """The solution's mechanism with one switch turned wrong at a time."""
    import math

    import torch
    import torch.distributed as dist

    errors = {}

    def hook(flat, group=None):
        n = dist.get_world_size(group)
        acc = flat + errors.get(flat.data_ptr(), 0) if feedback else flat.clone()
        if dense:  # average densely, then sparsify: sends every element
            dist.all_reduce(acc, group=group)
        k = math.ceil(ratio * acc.numel())
        idx = acc.abs().topk(k).indices
        vals = acc[idx]
        errors[flat.data_ptr()] = acc.index_fill(0, idx, 0.0) if zero_sent else acc.clone()
        all_idx = [torch.empty_like(idx) for _ in range(n)]
        all_vals = [torch.empty_like(vals) for _ in range(n)]
        dist.all_gather(all_idx, idx, group=group)
        dist.all_gather(all_vals, vals, group=group)
        out = torch.zeros_like(flat)
        for i, v in zip(all_idx, all_vals):
            out.index_add_(0, i, v)
        fut = torch.futures.Future()
        fut.set_result(flat.copy_(out / n if average else out))
        return fut

    return hook


@pytest.mark.parametrize("wrong, match", [
    (dict(feedback=False), "without error feedback"),
    (dict(average=False), "the sum"),
    (dict(dense=True), "dense all_reduce refused"),
    (dict(zero_sent=False), "the error you keep"),
])
def test_topk_mistakes_fail(wrong, match):
    from functools import partial

    # (with every switch right, _topk_hook is the solution: test_solution_passes covers it)
    with pytest.raises(CheckFailed, match=match):
        ch16.check_topk_ef_hook(partial(_topk_hook, **wrong))
