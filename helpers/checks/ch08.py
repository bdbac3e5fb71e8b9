"""Checks for chapter 08: Megatron's f and g, and the column/row-parallel linear layers.

The learner writes

* ``CopyToTP`` (f) and ``ReduceFromTP`` (g): ``torch.autograd.Function``s with
  ``forward(ctx, x, group)`` and ``backward(ctx, grad)``;
* ``ColumnParallelLinear(linear, group)`` and ``RowParallelLinear(linear, group)``:
  ``nn.Module``s built from a dense ``nn.Linear`` that keep this rank's slice
  in ``.weight`` / ``.bias`` and use ``helpers.tp.f`` / ``g`` in forward.

Every check runs one launch of 4 ranks, twice over: first split into two
tensor-parallel groups, rank 0 alone (t = 1) and ranks 1, 2, 3 (t = 3, whose ranks in
the group are not their ranks in the job), with different data in each group; then the
4 ranks as one group (t = 4). At t = 2 a slice hard-coded to halves looks right; in the
default group only, a collective without ``group=`` or ``dist.get_rank()`` in place of
the rank in the group gives the right numbers. In float64, against the dense
computation in the same process: both sides differ only by the order of a few
additions (~1e-16 relative); the checks allow 1e-9 relative, while every mistake they
name is off by O(1).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.checks.course_answers import CourseAnswerUsed

REL = 1e-9  # float64, only the summation order differs (see above)
WORLD = 4
LAYOUT = [[0], [1, 2, 3]]   # a lone rank (t = 1) and a group of 3 that is not ranks 0..2
CASES = ("groups", "world")  # LAYOUT's groups, then the 4 ranks as one group
# the course's own layers: the exercise is to write them (helpers/checks/course_answers.py)
COURSE_LAYERS = ["helpers.tp.layers.ColumnParallelLinear", "helpers.tp.layers.RowParallelLinear"]


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and \
        (a - b).abs().max().item() <= REL * max(b.abs().max().item(), 1.0)


def _groups(case: str):
    """(group, its index, members) of this rank for ``case``: LAYOUT's groups, or the world."""
    import torch.distributed as dist

    from helpers.checks.groups import split_world
    if case == "groups":
        return split_world(LAYOUT)
    return dist.group.WORLD, 0, list(range(dist.get_world_size()))


def _case_name(case: str, members: list, rank: int) -> str:
    where = (f"{len(members)} rank(s) in one group" if case == "world" else
             f"the group {members} of {{{', '.join(map(str, LAYOUT))}}}")
    return f"{where}, rank {rank}"


def _run_f_g(copy_to, reduce_from):
    """Both cases on this rank: LAYOUT's groups (made first, by every rank), the world."""
    import torch.distributed as dist

    out = {}
    split = _groups("groups")
    for case, (group, index, members) in zip(CASES, (split, _groups("world"))):
        out[case] = _one_f_g(copy_to, reduce_from, group, index, members)
        out[case]["members"] = members
    return out


def _one_f_g(copy_to, reduce_from, group, index, members):
    import torch.distributed as dist

    from helpers.checks.spy import communication_spy

    r = dist.get_rank(group)   # the rank inside the group
    t = len(members)
    # f: rank-dependent input and upstream gradient (f's output feeds this rank's own
    # slice, so its gradient differs per rank), so a missing or extra sum shows
    x = torch.full((3,), float(r + 1), dtype=torch.float64, requires_grad=True)
    w = torch.full((3,), float(10 * (r + 1)), dtype=torch.float64)
    with communication_spy(keep_values=False) as f_fwd:
        y = copy_to.apply(x, group)
    with communication_spy(keep_values=False) as f_bwd:
        (y * w).sum().backward()
    f_out = (y.detach().clone(), x.grad.clone())
    # g: its output is whole on every rank, and so is its upstream gradient (the same
    # on every rank, as in a real model); the input is a non-leaf so that an in-place
    # all-reduce of it shows in x2 afterwards
    leaf = x.detach().clone().requires_grad_()
    x2 = leaf * 1.0
    before = x2.detach().clone()
    w_g = torch.arange(1.0, 4.0, dtype=torch.float64)
    with communication_spy(keep_values=False) as g_fwd:
        z = reduce_from.apply(x2, group)
    in_place = not torch.equal(x2.detach(), before)
    with communication_spy(keep_values=False) as g_bwd:
        (z * w_g).sum().backward()
    g_out = (z.detach().clone(), leaf.grad.clone())
    wire = {name: (spy.ops(), spy.bytes()) for name, spy in
            (("f forward", f_fwd), ("f backward", f_bwd), ("g forward", g_fwd),
             ("g backward", g_bwd))}
    return dict(f=f_out, g=g_out, x=x.detach(), w=w, w_g=w_g, t=t, in_place=in_place,
                wire=wire, nbytes=x.numel() * x.element_size())


def check_f_g(copy_to, reduce_from) -> None:
    """4 ranks, in two tensor-parallel groups ([0] and [1, 2, 3]) and then as one: rank r
    of its group holds x = r + 1; f's upstream gradient is 10 (r + 1), g's the same
    [1, 2, 3] on every rank. Mistakes it catches: f summing in forward; f's backward not
    summing (or summing twice); g not summing in forward; g all-reducing its input in
    place (the caller's tensor changes); g summing the gradient in backward (t times too
    large); a collective without ``group=`` (it sums over all 4 ranks: named); any
    exception as a CheckFailed."""
    res = on_ranks(_run_f_g, WORLD, copy_to, reduce_from, what=f"f / g on {WORLD} ranks",
                   probe=lambda: (copy_to.forward(None, torch.ones(1), None),
                                  reduce_from.forward(None, torch.ones(1), None)))
    for case in CASES:
        _check_f_g_case([out[case] for out in res], case)
    passed(f"f: identity forward with no communication, one all-reduce backward; g: one "
           f"all-reduce forward (its input untouched), identity backward with no "
           f"communication (groups of 1 and 3 ranks, and of {WORLD})")


_NO_GROUP = ("pass group=group to the collective: without it the sum runs over every rank "
             "of the job, not over the tensor-parallel group")


def _check_f_g_case(res: list, case: str) -> None:
    for rank, out in enumerate(res):
        members = out["members"]
        where = _case_name(case, members, rank)
        x_sum = sum(res[m]["x"] for m in members)
        w_sum = sum(res[m]["w"] for m in members)
        x_all = sum(o["x"] for o in res)
        w_all = sum(o["w"] for o in res)
        y, dx = out["f"]
        if torch.equal(y, x_sum) and len(members) > 1:
            raise CheckFailed(f"{where}: f's forward summed x over ranks. f is the identity in "
                              f"forward: x is already whole on every rank; the all-reduce belongs "
                              f"in its backward")
        if not torch.equal(y, out["x"]):
            raise CheckFailed(f"{where}: f's forward should return x unchanged, got "
                              f"{y.tolist()} for x = {out['x'].tolist()}")
        if torch.equal(dx, out["w"]) and len(members) > 1:
            raise CheckFailed(f"{where}: f's backward returned this rank's gradient only; "
                              f"x feeds every rank's slice, so dL/dx is the sum over ranks "
                              f"(all-reduce the gradient)")
        if not torch.equal(dx, w_sum):
            if case == "groups" and torch.equal(dx, w_all):
                raise CheckFailed(f"{where}: f's backward summed the gradient over all "
                                  f"{len(res)} ranks, {w_all.tolist()}, instead of the group's "
                                  f"{w_sum.tolist()}: {_NO_GROUP}")
            raise CheckFailed(f"{where}: f's backward should give the sum of the group's "
                              f"gradients {w_sum.tolist()}, got {dx.tolist()}")
        z, dz = out["g"]
        if out["in_place"]:
            raise CheckFailed(f"{where}: g's forward changed its input: an in-place all-reduce "
                              f"of x overwrites the caller's tensor (which autograd may have "
                              f"saved for backward). Sum a copy and return that")
        if torch.equal(z, out["x"]) and len(members) > 1:
            raise CheckFailed(f"{where}: g's forward returned this rank's partial sum; it must "
                              f"all-reduce it (y = sum over ranks of the partials)")
        if not torch.equal(z, x_sum):
            if case == "groups" and torch.equal(z, x_all):
                raise CheckFailed(f"{where}: g's forward summed over all {len(res)} ranks, "
                                  f"{x_all.tolist()}, instead of the group's {x_sum.tolist()}: "
                                  f"{_NO_GROUP}")
            raise CheckFailed(f"{where}: g's forward should give {x_sum.tolist()}, got "
                              f"{z.tolist()}")
        if torch.equal(dz, out["t"] * out["w_g"]) and len(members) > 1:
            raise CheckFailed(f"{where}: g's backward all-reduced the gradient. The gradient "
                              f"of each partial sum is the output's gradient itself: identity")
        if not torch.equal(dz, out["w_g"]):
            raise CheckFailed(f"{where}: g's backward should return the gradient unchanged, "
                              f"got {dz.tolist()} for {out['w_g'].tolist()}")
    for rank, out in enumerate(res):   # the numbers are right: was the traffic?
        _check_f_g_wire(out, _case_name(case, out["members"], rank), len(out["members"]))


# What each half of f and g may put on the wire: one all-reduce of the tensor (of a group
# of more than one rank), or nothing (Megatron's _CopyToModelParallelRegion and
# _ReduceFromModelParallelRegion, megatron/core/tensor_parallel/mappings.py).
_F_G_WIRE = {"f forward": False, "f backward": True, "g forward": True, "g backward": False}


def _check_f_g_wire(out: dict, where: str, members: int) -> None:
    for half, reduces in _F_G_WIRE.items():
        ops, nbytes = out["wire"][half]
        if not reduces:
            if ops:
                raise CheckFailed(f"{where}: {half} communicated ({', '.join(ops)}): it is "
                                  f"the identity, with no communication at all")
            continue
        if not ops and members == 1:
            continue  # a group of one rank: nothing to sum (an all-reduce is fine too)
        if ops != ["all_reduce"]:
            raise CheckFailed(
                f"{where}: {half} gave the right sum through "
                f"{', '.join(ops) or 'no collective'} ({nbytes:,} bytes handed in by this "
                f"rank): the sum over the group is one all-reduce of the "
                f"{out['nbytes']:,}-byte tensor. A gather then a local sum moves t - 1 times "
                f"the tensor to every rank and holds t copies of it")
        if nbytes != out["nbytes"]:
            raise CheckFailed(f"{where}: {half} all-reduced {nbytes:,} bytes for a "
                              f"{out['nbytes']:,}-byte tensor: all-reduce the tensor itself, "
                              f"once")


def _run_layers(column_cls, row_cls):
    """Both cases on this rank (LAYOUT's groups, then the world), the course's own layers
    refused while the learner's run."""
    from helpers.checks.course_answers import refusing

    out = {}
    split = _groups("groups")
    try:
        with refusing(COURSE_LAYERS, "your layer"):
            for case, (group, index, members) in zip(CASES, (split, _groups("world"))):
                out[case] = _one_layers(column_cls, row_cls, group, index, members)
                out[case]["members"] = members
    except CourseAnswerUsed as exc:
        return {"refused": str(exc)}
    return out


def _one_layers(column_cls, row_cls, group, index, members):
    import torch.distributed as dist

    from helpers.tp import gather_last
    t = len(members)
    torch.manual_seed(0)  # same dense layers on every rank of every group
    up, down = nn.Linear(6, 12).double(), nn.Linear(12, 6).double()   # 12 = 3 x 4
    with torch.no_grad():  # non-zero biases, so a bias added t times shows
        up.bias.normal_()
        down.bias.normal_()
    # data of this group: another group's, mixed in by a collective without group=, shows
    gen = torch.Generator().manual_seed(100 + index)
    x = torch.randn(5, 6, dtype=torch.float64, generator=gen)
    dy = torch.randn(5, 6, dtype=torch.float64, generator=gen)
    col, row = column_cls(up, group), row_cls(down, group)
    out = {"col_weight": tuple(col.weight.shape), "row_weight": tuple(row.weight.shape)}
    part = 12 // t
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
        parts = [torch.empty_like(p.grad) for _ in range(t)]
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
    """4 ranks, in two tensor-parallel groups ([0] and [1, 2, 3]: t = 1 and 3) with
    different data in each, then as one group (t = 4): Linear(6, 12) column-parallel,
    GeLU, Linear(12, 6) row-parallel, float64. Mistakes it catches: a slice hard-coded to
    halves or to one t (shapes and values at t = 1, 3 and 4); rows and columns swapped;
    the bias sliced in the row layer or added on every rank before the sum; x not passed
    through f (wrong input gradient); the group ignored (slices for the whole job, or f
    and g summing over all 4 ranks: named); any weight gradient off; the course's own
    ``helpers.tp`` layers in place of yours (refused by name); exceptions."""
    res = on_ranks(_run_layers, WORLD, column_cls, row_cls,
                   what=f"the parallel layers on {WORLD} ranks",
                   probe=lambda: (column_cls(nn.Linear(2, 2), None),
                                  row_cls(nn.Linear(2, 2), None)))
    if "refused" in res[0]:
        raise CheckFailed(res[0]["refused"])
    for case in CASES:
        _check_layers_case([out[case] for out in res], case)
    passed(f"column- then row-parallel MLP in groups of 1 and 3 ranks and of {WORLD} equals "
           f"the dense MLP: output, input gradient and every weight gradient (float64)")


def _check_layers_case(res: list, case: str) -> None:
    for rank, out in enumerate(res):
        members = out["members"]
        world = len(members)
        case_name = _case_name(case, members, rank)
        part = 12 // world
        hint = ("" if case == "world" else
                f" (this group has {world} rank(s): take t and r from the group, "
                f"tp_size(group) and tp_rank(group), not from the whole job)")
        if out["col_weight"] != (part, 6):
            raise CheckFailed(f"{case_name}: ColumnParallelLinear(Linear(6, 12)).weight has "
                              f"shape {out['col_weight']}; on {world} rank(s) it keeps 12 / "
                              f"{world} output rows: {(part, 6)}{hint}")
        if out["row_weight"] != (6, part):
            raise CheckFailed(f"{case_name}: RowParallelLinear(Linear(12, 6)).weight has shape "
                              f"{out['row_weight']}; it keeps 12 / {world} input columns: "
                              f"{(6, part)}{hint}")
        want = out["want"]
        group_hint = ("" if case == "world" else
                      " Inside a group, f and g need the layer's group (f(x, self.group)): "
                      "without it they sum over every rank of the job, other groups' data "
                      "included.")
        if not _close(out["col_out"], want["col_out"]):
            raise CheckFailed(f"{case_name}: the column-parallel outputs, gathered in rank "
                              f"order, differ from the dense layer's: rank r keeps rows "
                              f"[r * out/t, (r+1) * out/t) of weight and bias{hint}")
        y, dx = out["mlp"]
        if world > 1 and _close(y, want["y"] + (world - 1) * want["bias"]):
            raise CheckFailed(f"{case_name}: the MLP output is off by exactly {world - 1} extra "
                              f"biases: the row-parallel layer added its bias on every rank "
                              f"before the all-reduce. Add it once, after g")
        if not _close(y, want["y"]):
            raise CheckFailed(f"{case_name}: the split MLP's output differs from the dense "
                              f"MLP's (max error {(y - want['y']).abs().max().item():.3g})."
                              f"{group_hint}")
        if not _close(dx, want["dx"]):
            raise CheckFailed(f"{case_name}: the input gradient differs from the dense one: "
                              f"does the column-parallel layer pass x through f (all-reduce "
                              f"in backward)?{group_hint}")
        for name, g in out["grads"].items():
            if not _close(g, want["grads"][name]):
                raise CheckFailed(f"{case_name}: the gradient of {name} (gathered over the "
                                  f"group) differs from the dense layer's")
