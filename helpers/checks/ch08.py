"""Checks for chapter 08: Megatron's f and g, and the column/row-parallel linear layers.

The learner writes

* ``CopyToTP`` (f) and ``ReduceFromTP`` (g): ``torch.autograd.Function``s with
  ``forward(ctx, x, group)`` and ``backward(ctx, grad)``;
* ``ColumnParallelLinear(linear, group)`` and ``RowParallelLinear(linear, group)``:
  ``nn.Module``s built from a dense ``nn.Linear`` that keep this rank's slice
  in ``.weight`` / ``.bias`` and use ``helpers.tp.f`` / ``g`` in forward.

Every check runs on 3 and on 4 ranks (at 2, a slice hard-coded to halves or a
ring run backwards looks right) in float64, against the dense computation in the
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
WORLDS = (3, 4)


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and \
        (a - b).abs().max().item() <= REL * max(b.abs().max().item(), 1.0)


def _run_f_g(copy_to, reduce_from):
    import torch.distributed as dist

    from helpers import rank_info
    r = rank_info()
    t = r.world_size
    group = dist.group.WORLD
    # f: rank-dependent input and upstream gradient (f's output feeds this rank's own
    # slice, so its gradient differs per rank), so a missing or extra sum shows
    x = torch.full((3,), float(r.rank + 1), dtype=torch.float64, requires_grad=True)
    w = torch.full((3,), float(10 * (r.rank + 1)), dtype=torch.float64)
    y = copy_to.apply(x, group)
    (y * w).sum().backward()
    f_out = (y.detach().clone(), x.grad.clone())
    # g: its output is whole on every rank, and so is its upstream gradient (the same
    # on every rank, as in a real model); the input is a non-leaf so that an in-place
    # all-reduce of it shows in x2 afterwards
    leaf = x.detach().clone().requires_grad_()
    x2 = leaf * 1.0
    before = x2.detach().clone()
    w_g = torch.arange(1.0, 4.0, dtype=torch.float64)
    z = reduce_from.apply(x2, group)
    in_place = not torch.equal(x2.detach(), before)
    (z * w_g).sum().backward()
    g_out = (z.detach().clone(), leaf.grad.clone())
    return dict(f=f_out, g=g_out, x=x.detach(), w=w, w_g=w_g, t=t, in_place=in_place)


def check_f_g(copy_to, reduce_from) -> None:
    """On 3 and 4 ranks: rank r holds x = r + 1; f's upstream gradient is 10 (r + 1),
    g's the same [1, 2, 3] on every rank. Mistakes it catches: f summing in forward;
    f's backward not summing (or summing twice); g not summing in forward; g
    all-reducing its input in place (the caller's tensor changes); g summing the
    gradient in backward (t times too large); any exception as a CheckFailed."""
    for world in WORLDS:
        _check_f_g_on(copy_to, reduce_from, world)
    passed(f"f: identity forward, all-reduce backward; g: all-reduce forward (its input "
           f"untouched), identity backward ({' and '.join(map(str, WORLDS))} ranks)")


def _check_f_g_on(copy_to, reduce_from, world: int) -> None:
    res = on_ranks(_run_f_g, world, copy_to, reduce_from, what=f"f / g on {world} ranks",
                   probe=lambda: (copy_to.forward(None, torch.ones(1), None),
                                  reduce_from.forward(None, torch.ones(1), None)))
    x_sum = sum(out["x"] for out in res)
    w_sum = sum(out["w"] for out in res)
    for rank, out in enumerate(res):
        case = f"{world} ranks, rank {rank}"
        y, dx = out["f"]
        if torch.equal(y, x_sum):
            raise CheckFailed(f"{case}: f's forward summed x over ranks. f is the identity in "
                              f"forward: x is already whole on every rank; the all-reduce belongs "
                              f"in its backward")
        if not torch.equal(y, out["x"]):
            raise CheckFailed(f"{case}: f's forward should return x unchanged, got "
                              f"{y.tolist()} for x = {out['x'].tolist()}")
        if torch.equal(dx, out["w"]):
            raise CheckFailed(f"{case}: f's backward returned this rank's gradient only; "
                              f"x feeds every rank's slice, so dL/dx is the sum over ranks "
                              f"(all-reduce the gradient)")
        if not torch.equal(dx, w_sum):
            raise CheckFailed(f"{case}: f's backward should give the sum of every rank's "
                              f"gradient {w_sum.tolist()}, got {dx.tolist()}")
        z, dz = out["g"]
        if out["in_place"]:
            raise CheckFailed(f"{case}: g's forward changed its input: an in-place all-reduce "
                              f"of x overwrites the caller's tensor (which autograd may have "
                              f"saved for backward). Sum a copy and return that")
        if torch.equal(z, out["x"]):
            raise CheckFailed(f"{case}: g's forward returned this rank's partial sum; it must "
                              f"all-reduce it (y = sum over ranks of the partials)")
        if not torch.equal(z, x_sum):
            raise CheckFailed(f"{case}: g's forward should give {x_sum.tolist()}, got "
                              f"{z.tolist()}")
        if torch.equal(dz, world * out["w_g"]):
            raise CheckFailed(f"{case}: g's backward all-reduced the gradient. The gradient "
                              f"of each partial sum is the output's gradient itself: identity")
        if not torch.equal(dz, out["w_g"]):
            raise CheckFailed(f"{case}: g's backward should return the gradient unchanged, "
                              f"got {dz.tolist()} for {out['w_g'].tolist()}")


def _run_layers(column_cls, row_cls):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.tp import gather_last
    r = rank_info()
    group = dist.group.WORLD
    torch.manual_seed(0)  # same dense layers and data on every rank
    up, down = nn.Linear(6, 12).double(), nn.Linear(12, 6).double()   # 12 = 3 x 4
    with torch.no_grad():  # non-zero biases, so a bias added t times shows
        up.bias.normal_()
        down.bias.normal_()
    x = torch.randn(5, 6, dtype=torch.float64)
    dy = torch.randn(5, 6, dtype=torch.float64)
    col, row = column_cls(up, group), row_cls(down, group)
    out = {"col_weight": tuple(col.weight.shape), "row_weight": tuple(row.weight.shape)}
    part = 12 // r.world_size
    if (out["col_weight"], out["row_weight"]) != ((part, 6), (6, part)):
        return out  # wrong slices: the shapes say why; running them would only crash
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
    """On 3 and 4 ranks: Linear(6, 12) column-parallel, GeLU, Linear(12, 6)
    row-parallel, float64. Mistakes it catches: a slice hard-coded to halves or to
    t = 2 (shapes and values at t = 3 and 4); rows and columns swapped; the bias
    sliced in the row layer or added on every rank before the sum; x not passed
    through f (wrong input gradient); any weight gradient off; exceptions."""
    for world in WORLDS:
        _check_layers_on(column_cls, row_cls, world)
    passed(f"column- then row-parallel MLP on {' and '.join(map(str, WORLDS))} ranks equals "
           f"the dense MLP: output, input gradient and every weight gradient (float64)")


def _check_layers_on(column_cls, row_cls, world: int) -> None:
    res = on_ranks(_run_layers, world, column_cls, row_cls,
                   what=f"the parallel layers on {world} ranks",
                   probe=lambda: (column_cls(nn.Linear(2, 2), None),
                                  row_cls(nn.Linear(2, 2), None)))
    part = 12 // world
    for rank, out in enumerate(res):
        case = f"{world} ranks, rank {rank}"
        if out["col_weight"] != (part, 6):
            raise CheckFailed(f"{case}: ColumnParallelLinear(Linear(6, 12)).weight has shape "
                              f"{out['col_weight']}; on {world} ranks it keeps 12 / {world} "
                              f"output rows: {(part, 6)}")
        if out["row_weight"] != (6, part):
            raise CheckFailed(f"{case}: RowParallelLinear(Linear(12, 6)).weight has shape "
                              f"{out['row_weight']}; it keeps 12 / {world} input columns: "
                              f"{(6, part)}")
        want = out["want"]
        if not _close(out["col_out"], want["col_out"]):
            raise CheckFailed(f"{case}: the column-parallel outputs, gathered in rank order, "
                              f"differ from the dense layer's: rank r keeps rows "
                              f"[r * out/t, (r+1) * out/t) of weight and bias")
        y, dx = out["mlp"]
        if _close(y, want["y"] + (world - 1) * want["bias"]):
            raise CheckFailed(f"{case}: the MLP output is off by exactly {world - 1} extra "
                              f"biases: the row-parallel layer added its bias on every rank "
                              f"before the all-reduce. Add it once, after g")
        if not _close(y, want["y"]):
            raise CheckFailed(f"{case}: the split MLP's output differs from the dense MLP's "
                              f"(max error {(y - want['y']).abs().max().item():.3g})")
        if not _close(dx, want["dx"]):
            raise CheckFailed(f"{case}: the input gradient differs from the dense one: does "
                              f"the column-parallel layer pass x through f (all-reduce in "
                              f"backward)?")
        for name, g in out["grads"].items():
            if not _close(g, want["grads"][name]):
                raise CheckFailed(f"{case}: the gradient of {name} (gathered over ranks) "
                                  f"differs from the dense layer's")
