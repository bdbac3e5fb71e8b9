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
