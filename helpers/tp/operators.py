"""The communication of tensor parallelism: Megatron's f and g, gather/split, and a counter.

Tensor parallelism (TP) keeps every activation that enters a split region
whole on every rank and splits only the weights. Two conjugate operators mark
the edges of a split region (Shoeybi et al. 2019, "Megatron-LM", sec. 3,
Figure 3):

* ``f`` on the way in: identity in forward (every rank already has the whole
  input), all-reduce in backward (each rank's weights produced only part of
  dL/dx, and x feeds all of them).
* ``g`` on the way out: all-reduce in forward (each rank holds a partial sum
  of the output), identity in backward (the summed output's gradient is the
  gradient of every partial sum).

Derivation from the chain rule: if y = sum_r y_r (g), then dL/dy_r = dL/dy, so
g's backward copies. If x is used by every rank, y_r = h_r(x) (f), then
dL/dx = sum_r dL/dy_r * dy_r/dx, a sum over ranks: f's backward all-reduces.

When a column-parallel output must be whole (e.g. to print logits), the pair
is ``gather_last`` (all-gather along the last dim forward, keep own slice
backward) and ``split_last`` (keep own slice forward, all-gather backward).

With one rank every operator is the identity and issues nothing, so the TP
model reduces to the plain one (as Megatron's mappings do).

Counting. Every collective these operators issue is recorded, with its payload
bytes, the layer that issued it and the direction, by any active
``count_collectives()`` context (a tracing switch in the spirit of PyTorch's
``CommDebugMode``; it changes nothing that is computed).

Production differences: Megatron-LM issues the same four operators
(``megatron/core/tensor_parallel/mappings.py``), but overlaps the backward
all-reduce of ``f`` with the weight-gradient GEMM and, with sequence
parallelism (chapter 10), swaps each all-reduce for a reduce-scatter plus an
all-gather of the same total bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

import torch
import torch.distributed as dist

from helpers.comm import group_rank, world_size
__all__ = ["tp_size", "tp_rank", "f", "g", "gather_last", "split_last", "CopyToTP",
           "ReduceFromTP", "GatherFromTP", "SplitToTP", "count_collectives", "CollectiveCounter",
           "Collective", "record_collective"]


def tp_size(group=None) -> int:
    """Ranks in the tensor-parallel group (``None``: the default group; 1 without one)."""
    return world_size(group)


def tp_rank(group=None) -> int:
    """This rank's index inside the tensor-parallel group."""
    return group_rank(group)


# --------------------------------------------------------------------------
# The counter.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Collective:
    op: str          # "all_reduce", "all_reduce(max)", "all_gather"
    layer: str       # the issuing layer's name, e.g. "blocks.0.attn.c_proj"
    direction: str   # "forward" or "backward"
    nbytes: int      # payload: the tensor each rank hands to the collective


class CollectiveCounter:
    """The collectives issued while it was active, in order (``.log``)."""

    def __init__(self) -> None:
        self.log: list[Collective] = []

    def count(self, op: str | None = None, direction: str | None = None,
              layer: str | None = None) -> int:
        return sum(1 for c in self._select(op, direction, layer))

    def nbytes(self, op: str | None = None, direction: str | None = None,
               layer: str | None = None) -> int:
        return sum(c.nbytes for c in self._select(op, direction, layer))

    def _select(self, op, direction, layer):
        return [c for c in self.log if (op is None or c.op == op)
                and (direction is None or c.direction == direction)
                and (layer is None or c.layer == layer)]

    def table(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """(layer, direction, op) -> (how many, total bytes), in first-seen order."""
        rows: dict = defaultdict(lambda: [0, 0])
        for c in self.log:
            row = rows[(c.layer, c.direction, c.op)]
            row[0] += 1
            row[1] += c.nbytes
        return {k: tuple(v) for k, v in rows.items()}


_ACTIVE: list[CollectiveCounter] = []  # the open count_collectives() contexts


@contextlib.contextmanager
def count_collectives():
    """``with count_collectives() as c: ...`` records every TP collective in ``c.log``."""
    counter = CollectiveCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def record_collective(op: str, tensor: torch.Tensor, layer: str, direction: str) -> None:
    """Log one collective on ``tensor`` in every open ``count_collectives()`` (other
    mechanisms built on TP's counter, such as chapter 10's sequence parallelism, call it)."""
    for counter in _ACTIVE:
        counter.log.append(Collective(op, layer, direction, tensor.numel() * tensor.element_size()))


def all_reduce(x: torch.Tensor, group, layer: str, direction: str,
               op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``x`` over ``group``, recorded. Returns ``x``."""
    record_collective("all_reduce" if op == dist.ReduceOp.SUM else "all_reduce(max)", x, layer, direction)
    dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather_last(x: torch.Tensor, group, layer: str, direction: str) -> torch.Tensor:
    """(..., n) on each rank -> (..., t * n), rank order along the last dim."""
    record_collective("all_gather", x, layer, direction)
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice_last(x: torch.Tensor, group) -> torch.Tensor:
    """(..., t * n) -> (..., n): this rank's slice; no communication."""
    t, r = tp_size(group), tp_rank(group)
    if x.size(-1) % t:
        raise ValueError(f"last dim {x.size(-1)} does not divide over tensor-parallel size {t}")
    n = x.size(-1) // t
    return x[..., r * n:(r + 1) * n].contiguous()


# --------------------------------------------------------------------------
# The four autograd Functions (Shoeybi et al. 2019, sec. 3, Fig. 3; gather and
# split are Megatron-LM's _GatherFromModelParallelRegion / _ScatterToModelParallelRegion).
# --------------------------------------------------------------------------

class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return x.view_as(x)  # a new autograd node, same memory

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # all-reduce in place, never on autograd's buffer
        return all_reduce(grad, ctx.group, ctx.layer, "backward"), None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum of partial outputs) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        return all_reduce(x.contiguous().clone(), group, layer, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group = group
        return _all_gather_last(x, group, layer, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _own_slice_last(grad, ctx.group), None, None


class SplitToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, layer):
        ctx.group, ctx.layer = group, layer
        return _own_slice_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.group, ctx.layer, "backward"), None, None


def f(x: torch.Tensor, group=None, layer: str = "f") -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce backward (identity with one rank)."""
    return x if tp_size(group) == 1 else CopyToTP.apply(x, group, layer)


def g(x: torch.Tensor, group=None, layer: str = "g") -> torch.Tensor:
    """Megatron's g: all-reduce forward, identity backward (identity with one rank)."""
    return x if tp_size(group) == 1 else ReduceFromTP.apply(x, group, layer)


def gather_last(x: torch.Tensor, group=None, layer: str = "gather") -> torch.Tensor:
    """(..., n) per rank -> (..., t n) on every rank; backward keeps the own slice."""
    return x if tp_size(group) == 1 else GatherFromTP.apply(x, group, layer)


def split_last(x: torch.Tensor, group=None, layer: str = "split") -> torch.Tensor:
    """(..., t n) on every rank -> this rank's (..., n); backward all-gathers."""
    return x if tp_size(group) == 1 else SplitToTP.apply(x, group, layer)
