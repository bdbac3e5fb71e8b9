"""Chapter 08's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.checks import CheckFailed, ch08
from helpers.tp import g, tp_rank, tp_size
from tools.nbtool import exercise

LAB, SOL = "labs/08_tensor_parallel_basics_lab.ipynb", "solutions/08_tensor_parallel_basics_solution.ipynb"


def test_solution_passes_and_stubs_fail(capsys):
    f_op, g_op, col, row = (exercise(SOL, n) for n in
                            ("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear"))
    ch08.check_f_g(f_op, g_op)
    ch08.check_parallel_layers(col, row)
    assert capsys.readouterr().out.count("✓") == 2
    lab = {n: exercise(LAB, n) for n in
           ("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear")}
    with pytest.raises(CheckFailed, match="not implemented"):
        ch08.check_f_g(lab["CopyToTP"], g_op)
    with pytest.raises(CheckFailed, match="not implemented"):
        ch08.check_f_g(f_op, lab["ReduceFromTP"])
    with pytest.raises(CheckFailed, match="not implemented"):
        ch08.check_parallel_layers(lab["ColumnParallelLinear"], row)
    with pytest.raises(CheckFailed, match="not implemented"):
        ch08.check_parallel_layers(col, lab["RowParallelLinear"])


class FAllReducesInForward(torch.autograd.Function):
    # Plausible mistake: f and g swapped (all-reduce in f's forward).
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GAllReducesInBackwardToo(torch.autograd.Function):
    # Plausible mistake: g all-reduces in both directions.
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def test_f_that_all_reduces_in_forward_fails():
    g_op = exercise(SOL, "ReduceFromTP")
    with pytest.raises(CheckFailed, match="f's forward summed x over ranks"):
        ch08.check_f_g(FAllReducesInForward, g_op)


def test_g_that_all_reduces_in_backward_fails():
    f_op = exercise(SOL, "CopyToTP")
    with pytest.raises(CheckFailed, match="g's backward all-reduced"):
        ch08.check_f_g(f_op, GAllReducesInBackwardToo)


class RowBiasOnEveryRank(nn.Module):
    # Plausible mistake: the bias added before the all-reduce, so t times.
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        n = linear.in_features // tp_size(group)
        r = tp_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[:, r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return g(F.linear(x, self.weight, self.bias), self.group)


def test_row_parallel_bias_on_every_rank_fails():
    col = exercise(SOL, "ColumnParallelLinear")
    with pytest.raises(CheckFailed, match="bias on every rank"):
        ch08.check_parallel_layers(col, RowBiasOnEveryRank)


class ColumnWithoutF(nn.Module):
    # Plausible mistake: no f, so the input gradient is only this rank's part.
    def __init__(self, linear, group=None):
        super().__init__()
        n = linear.out_features // tp_size(group)
        r = tp_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n:(r + 1) * n].clone())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def test_column_parallel_without_f_fails():
    row = exercise(SOL, "RowParallelLinear")
    with pytest.raises(CheckFailed, match="pass x through f"):
        ch08.check_parallel_layers(ColumnWithoutF, row)
