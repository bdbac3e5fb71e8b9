"""Tensor parallelism drawn from the split modules themselves (chapters 08 and 09).

What each rank holds is read from its parameters, not from the rule that made them:
``ownership(dense, split)`` runs on a rank and looks every slice of every split
parameter up in the dense layer it came from (exact equality of the values), so it
finds, for each row or column of a dense weight, the rank that holds it, whatever
code did the slicing (the course's ``helpers.tp`` layers, a learner's, PyTorch's
DTensor). The lookup needs values that tell the rows apart, and a freshly built layer
often has none (zero biases, LayerNorm's ones): ``distinct_copy(module)`` gives a copy
whose every parameter entry is a different number, to split with the same code. Where
the communication happens is read from the collectives the layers issued
(``helpers.tp.count_collectives``): the layer, the direction, the operation and its
bytes.

``draw_tp(owners, collectives)`` draws one row per parameter, in the module's order (the
order of the forward): a bar as long as the split dimension, each cell in the colour of
the rank that holds it (``helpers.drawing.rank_color``), grey where every rank holds the
whole tensor. A column-parallel weight is cut along its output features (dim 0), a
row-parallel one along its input features (dim 1); a stacked projection such as QKV
shows each rank holding a piece of q, of k and of v. Next to the layer that issued it,
each collective: Megatron's g (all-reduce in forward) after a row-parallel layer, f
(all-reduce in backward) before a column-parallel one (Shoeybi et al. 2019, sec. 3).
Change the world size or the split and the picture changes with it.
"""

from __future__ import annotations

from typing import Any

import torch

from helpers.drawing import rank_color

__all__ = ["distinct_copy", "held_indices", "ownership", "tp_picture_data", "draw_tp"]


def distinct_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameter entries are all different numbers
    (0, 1, 2, ... over every parameter in order, in float64, exact): split it with the
    code under study and ``ownership`` can tell every row and column apart."""
    import copy

    labelled = copy.deepcopy(module).double()
    start = 0
    with torch.no_grad():
        for p in labelled.parameters():
            p.copy_(torch.arange(start, start + p.numel(), dtype=torch.float64).view_as(p))
            start += p.numel()
    return labelled


def held_indices(dense: torch.Tensor, shard: torch.Tensor) -> tuple[int | None, list[int]]:
    """(split dim, the dense indices along it that ``shard`` holds, in its order).

    ``shard`` equal to ``dense``: (None, all indices of dim 0), the whole tensor. Else the
    one dim where the shapes differ, and for each slice of ``shard`` along it the index
    of the equal slice of ``dense`` (the first not yet used, so repeated values still map
    one to one). Raises ValueError when a slice has no equal in ``dense``."""
    dense, shard = dense.detach().cpu(), shard.detach().cpu()
    if dense.shape == shard.shape:
        if not torch.equal(dense, shard):
            raise ValueError("a parameter of the dense shape but other values: not a shard")
        return None, list(range(dense.shape[0] if dense.dim() else 1))
    diff = [d for d in range(dense.dim()) if dense.shape[d] != shard.shape[d]]
    if len(diff) != 1 or dense.dim() != shard.dim():
        raise ValueError(f"shapes {tuple(shard.shape)} and {tuple(dense.shape)} differ in more "
                         f"than one dim: not a slice along one dim")
    dim = diff[0]
    # every dense slice by its bytes (exact equality, one pass), indices in order
    where: dict[bytes, list[int]] = {}
    for j in range(dense.shape[dim]):
        where.setdefault(dense.select(dim, j).contiguous().numpy().tobytes(), []).append(j)
    held = []
    for i in range(shard.shape[dim]):
        free = where.get(shard.select(dim, i).contiguous().numpy().tobytes())
        if not free:
            raise ValueError(f"slice {i} along dim {dim} of the shard is nowhere in the dense "
                             f"tensor")
        held.append(free.pop(0))
    return dim, held


def ownership(dense: torch.nn.Module, split: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """On one rank: {parameter name: {"dim", "size", "held"}} for every parameter of
    ``split`` that ``dense`` has under the same name (module order). ``dim`` is None for a
    whole (replicated) parameter; ``size`` is the dense length along the split dim (dim
    0 for a whole one); ``held`` the dense indices this rank holds."""
    want = dict(dense.named_parameters())
    out = {}
    for name, p in split.named_parameters():
        if name not in want:
            continue
        dim, held = held_indices(want[name], p)
        size = want[name].shape[0 if dim is None else dim] if want[name].dim() else 1
        out[name] = {"dim": dim, "size": int(size), "held": held}
    return out


def tp_picture_data(owners: list[dict], collectives: list[tuple]) -> dict[str, Any]:
    """The values ``draw_tp`` draws, from every rank's ``ownership`` (rank order) and one
    rank's collectives ``(op, layer, direction, nbytes)``, in the order issued:
    {"params": {name: {"dim", "size", "owner"}}, "collectives": [...]} where ``owner[i]``
    is the rank holding index i of the dense split dim, or "all" for a whole parameter.
    Raises ValueError if two ranks hold the same index of a split parameter or one is
    held by nobody."""
    params: dict[str, dict] = {}
    for name, first in owners[0].items():
        dims = {o[name]["dim"] for o in owners}
        if dims == {None}:
            params[name] = {"dim": None, "size": first["size"], "owner": ["all"] * first["size"]}
            continue
        if len(dims) != 1:
            raise ValueError(f"{name}: ranks split it along different dims {sorted(dims, key=str)}")
        owner: list = [None] * first["size"]
        for rank, o in enumerate(owners):
            for i in o[name]["held"]:
                if owner[i] is not None:
                    raise ValueError(f"{name}: index {i} held by ranks {owner[i]} and {rank}")
                owner[i] = rank
        if None in owner:
            raise ValueError(f"{name}: index {owner.index(None)} held by no rank")
        params[name] = {"dim": dims.pop(), "size": first["size"], "owner": owner}
    return {"params": params, "collectives": [tuple(c) for c in collectives]}


def _layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _meaning(op: str, direction: str) -> str:
    if op == "all_reduce" and direction == "forward":
        return "g"
    if op == "all_reduce" and direction == "backward":
        return "f"
    return op


def draw_tp(owners: list[dict], collectives: list[tuple], *, title: str | None = None,
            skip_biases: bool = False):
    """One row per parameter (see the module docstring); returns ``(fig, data)`` with
    ``data = tp_picture_data(owners, collectives)``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    data = tp_picture_data(owners, collectives)
    names = [n for n in data["params"] if not (skip_biases and n.endswith(".bias"))]
    fig, ax = plt.subplots(figsize=(10, 0.38 * len(names) + 1.2))
    ranks = len(owners)
    notes: dict[str, list[str]] = {}
    for op, layer, direction, nbytes in data["collectives"]:
        notes.setdefault(layer, []).append(
            f"{_meaning(op, direction)}: {op} in {direction}, {nbytes:,} B")
    noted: set[str] = set()
    from matplotlib.colors import to_rgb

    for row, name in enumerate(names):
        y = len(names) - 1 - row
        p = data["params"][name]
        colours = [to_rgb("#d9d9d9" if owner == "all" else rank_color(owner))
                   for owner in p["owner"]]
        ax.imshow([colours], extent=(0, 1, y + 0.12, y + 0.88), aspect="auto",
                  interpolation="nearest")
        how = ("whole on every rank" if p["dim"] is None else
               "split by output (dim 0)" if p["dim"] == 0 else "split by input (dim 1)")
        ax.text(-0.02, y + 0.5, f"{name}", ha="right", va="center", fontsize=8)
        ax.text(1.02, y + 0.5, how, ha="left", va="center", fontsize=7, color="#555555")
        layer = _layer_of(name)
        if layer in notes and layer not in noted:
            noted.add(layer)
            ax.text(1.34, y + 0.5, "; ".join(notes[layer]), ha="left", va="center",
                    fontsize=7, color="#d95f02", fontweight="bold")
    for r in range(ranks):
        ax.add_patch(Rectangle((0.1 * r, len(names) + 0.25), 0.05, 0.5,
                               facecolor=rank_color(r)))
        ax.text(0.1 * r + 0.06, len(names) + 0.5, f"{r}", va="center", fontsize=7)
    ax.text(0.1 * ranks + 0.02, len(names) + 0.5, "rank holding each row / column; grey: "
            "every rank holds it whole", va="center", fontsize=7)
    ax.set_xlim(-0.02, 2.0)
    ax.set_ylim(-0.2, len(names) + 1.0)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig, data
