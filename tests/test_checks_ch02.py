"""Chapter 02's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Wrong
from helpers import rank_info
from helpers.checks import ch02


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
    from helpers.naive_dp import average_gradients
    average_gradients(model)


class TestChapter02(ChapterChecks):
    lab = "labs/02_sync_sgd_data_parallel_lab.ipynb"
    sol = "solutions/02_sync_sgd_data_parallel_solution.ipynb"
    checks = {
        "average_gradients": Check(ch02.check_average_gradients, slow=True),
        "dp_step": Check(ch02.check_dp_step, slow=True),
    }
    uses = {"dp_step": ("average_gradients",)}  # the step calls the notebook's average_gradients
    wrong = [
        Wrong("average_gradients", _sum_only, "forgets to divide", says="divide by the world size"),
        Wrong("average_gradients", _halves, "divides by a hard-coded 2",
              says="not by a fixed number"),
        Wrong("average_gradients", _local_only, "never communicates", says="own gradient"),
        Wrong("dp_step", _whole_batch_step, "every rank repeats the whole batch", says="own slice"),
        Wrong("dp_step", _no_zero_grad_step, "gradients pile up across steps",
              says="Zero the gradients"),
    ]
