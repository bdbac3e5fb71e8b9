"""Chapter 08's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch08
from helpers.tp import g, tp_rank, tp_size


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


class GAllReducesInPlace(torch.autograd.Function):
    # Plausible mistake: g all-reduces its input in place and returns it.
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnHalves(nn.Module):
    # Plausible mistake: the slice hard-coded to halves (right at t = 2 only).
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        n, r = linear.out_features // 2, tp_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n:(r + 1) * n].clone())

    def forward(self, x):
        from helpers.tp import f
        return F.linear(f(x, self.group), self.weight, self.bias)


class RowSwapped(nn.Module):
    # Plausible mistake: the row layer slices output rows, like the column layer.
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        n, r = linear.out_features // tp_size(group), tp_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return g(F.linear(x, self.weight), self.group) + self.bias


class GIgnoresGroup(torch.autograd.Function):
    # Plausible mistake: g's all-reduce without group= (right in the default group only).
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FIgnoresGroup(torch.autograd.Function):
    # Plausible mistake: f's backward all-reduce without group=.
    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None


class ColumnWholeJob(nn.Module):
    # Plausible mistake: t and r of the whole job (dist.get_world_size / get_rank), not
    # of the tensor-parallel group.
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        n, r = linear.out_features // dist.get_world_size(), dist.get_rank()
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n:(r + 1) * n].clone())

    def forward(self, x):
        from helpers.tp import f
        return F.linear(f(x, self.group), self.weight, self.bias)


class ColumnFWithoutGroup(nn.Module):
    # Plausible mistake: the right slice, but f(x) without the layer's group.
    def __init__(self, linear, group=None):
        super().__init__()
        self.group = group
        n, r = linear.out_features // tp_size(group), tp_rank(group)
        self.weight = nn.Parameter(linear.weight.detach()[r * n:(r + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach()[r * n:(r + 1) * n].clone())

    def forward(self, x):
        from helpers.tp import f
        return F.linear(f(x), self.weight, self.bias)


class ColumnFromCourse(nn.Module):
    # Plausible shortcut: the course's own layer inside the exercise.
    def __init__(self, linear, group=None):
        super().__init__()
        from helpers.tp import ColumnParallelLinear
        self.inner = ColumnParallelLinear.from_dense(linear, group)
        self.weight, self.bias = self.inner.weight, self.inner.bias

    def forward(self, x):
        return self.inner(x)


class GGathersThenSums(torch.autograd.Function):
    # Plausible mistake: g's sum as an all-gather of the partials, then a local sum (the
    # right numbers; t - 1 times the tensor on the wire and t copies in memory).
    @staticmethod
    def forward(ctx, x, group):
        from torch.distributed import all_gather, get_world_size
        parts = [torch.empty_like(x) for _ in range(get_world_size(group))]
        all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts).sum(0)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FReducesInBackwardAndForwardBroadcasts(torch.autograd.Function):
    # Plausible mistake: f "makes sure" x is the same everywhere with a broadcast in forward.
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.broadcast(y, dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class TestChapter08(ChapterChecks):
    lab = "labs/08_tensor_parallel_basics_lab.ipynb"
    sol = "solutions/08_tensor_parallel_basics_solution.ipynb"
    checks = {
        "f_g": Check(ch08.check_f_g, "CopyToTP", "ReduceFromTP", wire=True),
        "parallel_layers": Check(ch08.check_parallel_layers,
                                 "ColumnParallelLinear", "RowParallelLinear"),
    }
    # a wrong answer replaces one of the two; the other is the solution's
    wrong = [
        Wrong("f_g", {"CopyToTP": FAllReducesInForward}, "f all-reduces in forward",
              says="f's forward summed x over ranks"),
        Wrong("f_g", {"ReduceFromTP": GAllReducesInBackwardToo},
              "g all-reduces in backward too", says="g's backward all-reduced"),
        Wrong("f_g", {"ReduceFromTP": GAllReducesInPlace}, "g all-reduces its input in place",
              says="changed its input"),
        Wrong("parallel_layers", {"ColumnParallelLinear": ColumnHalves},
              "column slice hard-coded to halves", says="12 / 1"),
        Wrong("parallel_layers", {"RowParallelLinear": RowSwapped},
              "row layer slices rows", says="input columns"),
        Wrong("parallel_layers", {"RowParallelLinear": RowBiasOnEveryRank},
              "row-parallel bias added on every rank", says="bias on every rank"),
        Wrong("parallel_layers", {"ColumnParallelLinear": ColumnWithoutF},
              "column-parallel without f", says="pass x through f"),
        Wrong("f_g", {"ReduceFromTP": GIgnoresGroup}, "g's all-reduce without group=",
              says="summed over all 4 ranks.*group=group"),
        Wrong("f_g", {"CopyToTP": FIgnoresGroup}, "f's all-reduce without group=",
              says="summed the gradient over all 4 ranks.*group=group"),
        Wrong("parallel_layers", {"ColumnParallelLinear": ColumnWholeJob},
              "t and r of the whole job, not of the group", says="not from the whole job"),
        Wrong("parallel_layers", {"ColumnParallelLinear": ColumnFWithoutGroup},
              "f without the layer's group", says=r"f\(x, self.group\)"),
        Wrong("f_g", {"ReduceFromTP": GGathersThenSums}, "g as an all-gather and a local sum",
              says="g forward gave the right sum through all_gather.*one all-reduce"),
        Wrong("f_g", {"CopyToTP": FReducesInBackwardAndForwardBroadcasts},
              "f broadcasts in forward", says="f forward communicated .broadcast.*identity"),
        Wrong("parallel_layers", {"ColumnParallelLinear": ColumnFromCourse},
              "the course's own ColumnParallelLinear inside", says="course's own answer"),
    ]
