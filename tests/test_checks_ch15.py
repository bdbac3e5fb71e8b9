"""Chapter 15's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch

from helpers.checks import CheckFailed, ch15
from helpers.zero import all_gather
from tools.nbtool import exercise

LAB, SOL = "labs/15_fsdp_lab.ipynb", "solutions/15_fsdp_solution.ipynb"


def test_solution_passes_and_stubs_fail(capsys):
    gather, free, attach = (exercise(SOL, n) for n in ("gather", "free", "attach"))
    ch15.check_gather_free(gather, free)
    ch15.check_attach(gather, free, attach)
    assert capsys.readouterr().out.count("✓") == 2
    lab_gather, lab_free, lab_attach = (exercise(LAB, n) for n in ("gather", "free", "attach"))
    with pytest.raises(CheckFailed, match="not implemented"):
        ch15.check_gather_free(lab_gather, lab_free)
    with pytest.raises(CheckFailed, match="not implemented"):
        ch15.check_attach(gather, free, lab_attach)


def _gather_new_tensor(unit):
    # Plausible mistake: a fresh tensor instead of the same storage; the
    # module's parameters still point at the old, empty storage.
    unit.full = torch.empty(unit.full.numel())
    all_gather(unit.full, unit.shard, group=unit.group)


def _free(unit):
    unit.full.untyped_storage().resize_(0)


def test_gather_into_a_new_tensor_fails():
    with pytest.raises(CheckFailed, match="in place"):
        ch15.check_gather_free(_gather_new_tensor, _free)


def test_free_that_keeps_bytes_fails():
    gather = exercise(SOL, "gather")
    with pytest.raises(CheckFailed, match="resize_"):
        ch15.check_gather_free(gather, lambda unit: None)


def test_forgetting_the_backward_gather_fails():
    gather, free = exercise(SOL, "gather"), exercise(SOL, "free")

    def attach_forward_only(module, unit, gather, free):
        module.register_forward_pre_hook(lambda m, a: gather(unit))
        module.register_forward_hook(lambda m, a, o: free(unit))

    with pytest.raises(CheckFailed, match="again before its backward"):
        ch15.check_attach(gather, free, attach_forward_only)


def test_never_freeing_fails():
    gather, free = exercise(SOL, "gather"), exercise(SOL, "free")

    def attach_no_free(module, unit, gather, free):
        module.register_forward_pre_hook(lambda m, a: gather(unit))

    with pytest.raises(CheckFailed, match="still gathered"):
        ch15.check_attach(gather, free, attach_no_free)


def test_post_backward_solution_passes_and_stub_fails(capsys):
    ch15.check_post_backward(exercise(SOL, "post_backward"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch15.check_post_backward(exercise(LAB, "post_backward"))


def _post_backward(average=True, drop=True, free_unit=True, all_reduce=False):
    """The solution's mechanism with one switch turned wrong at a time."""
    import torch.distributed as dist

    from helpers.zero import reduce_scatter

    def post_backward(unit, free):
        N, r = dist.get_world_size(unit.group), dist.get_rank(unit.group)
        flat = torch.zeros(unit.full.numel())
        off = 0
        for p in unit.params:
            flat[off:off + p.numel()] = p.grad.reshape(-1) / (N if average else 1)
            off += p.numel()
            if drop:
                p.grad = None
        if all_reduce:
            dist.all_reduce(flat, group=unit.group)
            chunk = flat.chunk(N)[r].clone()
        else:
            chunk = torch.empty_like(unit.shard)
            reduce_scatter(chunk, flat, group=unit.group)
        if free_unit:
            free(unit)
        return chunk

    return post_backward


@pytest.mark.parametrize("wrong, match", [
    (dict(average=False), "average"),
    (dict(drop=False), "still in p.grad"),
    (dict(free_unit=False), "still gathered"),
    (dict(all_reduce=True), "all_reduce refused"),
])
def test_post_backward_mistakes_fail(wrong, match):
    with pytest.raises(CheckFailed, match=match):
        ch15.check_post_backward(_post_backward(**wrong))
