"""Chapter 02's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch.distributed as dist

from helpers import rank_info
from helpers.checks import CheckFailed, ch02
from tools.nbtool import exercise

LAB, SOL = "labs/02_sync_sgd_data_parallel_lab.ipynb", "solutions/02_sync_sgd_data_parallel_solution.ipynb"


def test_stubs_fail_without_starting_ranks():
    for name, check in [("average_gradients", ch02.check_average_gradients),
                        ("dp_step", ch02.check_dp_step)]:
        with pytest.raises(CheckFailed, match="not implemented"):
            check(exercise(LAB, name))


def _sum_only(model):  # forgets to divide
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _halves(model):  # divides by a hard-coded 2
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(2)


def _local_only(model):  # never communicates
    pass


def _whole_batch_step(model, opt, x, y):  # every rank repeats the whole batch
    opt.zero_grad()
    loss = model(x, y)[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    return float(loss.detach())


def _no_zero_grad_step(model, opt, x, y):  # gradients pile up across steps
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    loss = model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    return float(loss.detach())


def ch02_average(model):
    from helpers.dp import average_gradients
    average_gradients(model)


@pytest.mark.slow
def test_solution_passes_and_mistakes_fail(capsys):
    ch02.check_average_gradients(exercise(SOL, "average_gradients"))
    dp_step = exercise(SOL, "dp_step")
    # the step calls the notebook's average_gradients, defined in another cell
    dp_step.__globals__["average_gradients"] = exercise(SOL, "average_gradients")
    ch02.check_dp_step(dp_step)
    assert capsys.readouterr().out.count("✓") == 2
    with pytest.raises(CheckFailed, match="divide by the world size"):
        ch02.check_average_gradients(_sum_only)
    with pytest.raises(CheckFailed, match="not by a fixed number"):
        ch02.check_average_gradients(_halves)
    with pytest.raises(CheckFailed, match="own gradient"):
        ch02.check_average_gradients(_local_only)
    with pytest.raises(CheckFailed, match="own slice"):
        ch02.check_dp_step(_whole_batch_step)
    with pytest.raises(CheckFailed, match="Zero the gradients"):
        ch02.check_dp_step(_no_zero_grad_step)
