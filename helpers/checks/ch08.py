"""Checks for chapter 08: Megatron's f and g, and the column/row-parallel linear layers.

The learner writes

* ``CopyToTP`` (f) and ``ReduceFromTP`` (g): ``torch.autograd.Function``s with
  ``forward(ctx, x, group)`` and ``backward(ctx, grad)``;
* ``ColumnParallelLinear(linear, group)`` and ``RowParallelLinear(linear, group)``:
  ``nn.Module``s built from a dense ``nn.Linear`` that keep this rank's slice
  in ``.weight`` / ``.bias`` and use ``helpers.tp.f`` / ``g`` in forward.

Every check runs on 2 ranks in float64, against the dense computation in the
same process. Float64 on both sides differs only by the order of a few
additions (~1e-16 relative); the checks allow 1e-9 relative, while every
mistake they name is off by O(1).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.checks import CheckFailed, on_ranks, passed

REL = 1e-9  # float64, only the summation order differs (see above)


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and \
        (a - b).abs().max().item() <= REL * max(b.abs().max().item(), 1.0)


def _run_f_g(copy_to, reduce_from):
    import torch.distributed as dist

    from helpers import rank_info
    r = rank_info()
    t = r.world_size
    group = dist.group.WORLD
    # Rank-dependent input and upstream gradient, so a missing or extra sum shows.
    x = torch.full((3,), float(r.rank + 1), dtype=torch.float64, requires_grad=True)
    w = torch.full((3,), float(10 * (r.rank + 1)), dtype=torch.float64)
    y = copy_to.apply(x, group)
    (y * w).sum().backward()
    f_out = (y.detach().clone(), x.grad.clone())
    x2 = x.detach().clone().requires_grad_()
    z = reduce_from.apply(x2, group)
    (z * w).sum().backward()
    g_out = (z.detach().clone(), x2.grad.clone())
    return dict(f=f_out, g=g_out, x=x.detach(), w=w, t=t)


def check_f_g(copy_to, reduce_from) -> None:
    """2 ranks, rank r holds x = r + 1 and upstream gradient w = 10 (r + 1)."""
    res = on_ranks(_run_f_g, 2, copy_to, reduce_from, what="f / g",
                   probe=lambda: (copy_to.forward(None, torch.ones(1), None),
                                  reduce_from.forward(None, torch.ones(1), None)))
    x_sum = sum(out["x"] for out in res)
    w_sum = sum(out["w"] for out in res)
    for rank, out in enumerate(res):
        y, dx = out["f"]
        if torch.equal(y, x_sum):
            raise CheckFailed(f"rank {rank}: f's forward summed x over ranks. f is the identity in "
                              f"forward: x is already whole on every rank; the all-reduce belongs "
                              f"in its backward")
        if not torch.equal(y, out["x"]):
            raise CheckFailed(f"rank {rank}: f's forward should return x unchanged, got "
                              f"{y.tolist()} for x = {out['x'].tolist()}")
        if torch.equal(dx, out["w"]):
            raise CheckFailed(f"rank {rank}: f's backward returned this rank's gradient only; "
                              f"x feeds every rank's slice, so dL/dx is the sum over ranks "
                              f"(all-reduce the gradient)")
        if not torch.equal(dx, w_sum):
            raise CheckFailed(f"rank {rank}: f's backward should give the sum of every rank's "
                              f"gradient {w_sum.tolist()}, got {dx.tolist()}")
        z, dz = out["g"]
        if torch.equal(z, out["x"]):
            raise CheckFailed(f"rank {rank}: g's forward returned this rank's partial sum; it must "
                              f"all-reduce it (y = sum over ranks of the partials)")
        if not torch.equal(z, x_sum):
            raise CheckFailed(f"rank {rank}: g's forward should give {x_sum.tolist()}, got "
                              f"{z.tolist()}")
        if torch.equal(dz, w_sum):
            raise CheckFailed(f"rank {rank}: g's backward all-reduced the gradient. The gradient "
                              f"of each partial sum is the output's gradient itself: identity")
        if not torch.equal(dz, out["w"]):
            raise CheckFailed(f"rank {rank}: g's backward should return the gradient unchanged, "
                              f"got {dz.tolist()} for {out['w'].tolist()}")
    passed("f: identity forward, all-reduce backward; g: all-reduce forward, identity backward "
           "(2 ranks)")


def _run_layers(column_cls, row_cls):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.tp import gather_last
    r = rank_info()
    group = dist.group.WORLD
    torch.manual_seed(0)  # same dense layers and data on every rank
    up, down = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    with torch.no_grad():  # non-zero biases, so a bias added t times shows
        up.bias.normal_()
        down.bias.normal_()
    x = torch.randn(5, 8, dtype=torch.float64)
    dy = torch.randn(5, 8, dtype=torch.float64)
    col, row = column_cls(up, group), row_cls(down, group)
    out = {"col_weight": tuple(col.weight.shape), "row_weight": tuple(row.weight.shape)}
    # Column alone: this rank's slice of the outputs, gathered here for the comparison
    xc = x.clone().requires_grad_()
    hc = col(xc)
    out["col_out"] = gather_last(hc.detach(), group)
    # The split MLP: column -> GeLU -> row
    xm = x.clone().requires_grad_()
    y = row(F.gelu(col(xm)))
    y.backward(dy)
    out["mlp"] = (y.detach(), xm.grad)
    grads = {}
    for name, mod, dim in (("col.weight", col, 0), ("col.bias", col, 0), ("row.weight", row, 1)):
        p = getattr(mod, name.split(".")[1])
        parts = [torch.empty_like(p.grad) for _ in range(r.world_size)]
        dist.all_gather(parts, p.grad.contiguous(), group=group)
        grads[name] = torch.cat(parts, dim=dim)
    grads["row.bias"] = row.bias.grad
    out["grads"] = grads
    # Dense reference, same process
    xd = x.clone().requires_grad_()
    up.zero_grad()
    down.zero_grad()
    yd = down(F.gelu(up(xd)))
    yd.backward(dy)
    out["want"] = dict(col_out=up(x).detach(), y=yd.detach(), dx=xd.grad,
                       grads={"col.weight": up.weight.grad, "col.bias": up.bias.grad,
                              "row.weight": down.weight.grad, "row.bias": down.bias.grad},
                       bias=down.bias.detach())
    return out


def check_parallel_layers(column_cls, row_cls) -> None:
    """2 ranks: Linear(8, 16) column-parallel, GeLU, Linear(16, 8) row-parallel, float64."""
    res = on_ranks(_run_layers, 2, column_cls, row_cls, what="the parallel layers",
                   probe=lambda: (column_cls(nn.Linear(2, 2), None),
                                  row_cls(nn.Linear(2, 2), None)))
    for rank, out in enumerate(res):
        want = out["want"]
        if out["col_weight"] != (8, 8):
            raise CheckFailed(f"rank {rank}: ColumnParallelLinear(Linear(8, 16)).weight has shape "
                              f"{out['col_weight']}; on 2 ranks it keeps 16 / 2 output rows: "
                              f"(8, 8)")
        if out["row_weight"] != (8, 8):
            raise CheckFailed(f"rank {rank}: RowParallelLinear(Linear(16, 8)).weight has shape "
                              f"{out['row_weight']}; it keeps 16 / 2 input columns: (8, 8)")
        if not _close(out["col_out"], want["col_out"]):
            raise CheckFailed(f"rank {rank}: the column-parallel outputs, gathered in rank order, "
                              f"differ from the dense layer's: rank r keeps rows "
                              f"[r * out/t, (r+1) * out/t) of weight and bias")
        y, dx = out["mlp"]
        if _close(y, want["y"] + want["bias"]):
            raise CheckFailed(f"rank {rank}: the MLP output is off by exactly one extra bias: the "
                              f"row-parallel layer added its bias on every rank before the "
                              f"all-reduce. Add it once, after g")
        if not _close(y, want["y"]):
            raise CheckFailed(f"rank {rank}: the split MLP's output differs from the dense MLP's "
                              f"(max error {(y - want['y']).abs().max().item():.3g})")
        if not _close(dx, want["dx"]):
            raise CheckFailed(f"rank {rank}: the input gradient differs from the dense one: does "
                              f"the column-parallel layer pass x through f (all-reduce in "
                              f"backward)?")
        for name, g in out["grads"].items():
            if not _close(g, want["grads"][name]):
                raise CheckFailed(f"rank {rank}: the gradient of {name} (gathered over ranks) "
                                  f"differs from the dense layer's")
    passed("column- then row-parallel MLP on 2 ranks equals the dense MLP: output, input "
           "gradient and every weight gradient (float64)")
