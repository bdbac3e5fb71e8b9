"""Megatron sequence parallelism: TP's all-reduces become all-gather + reduce-scatter.

What
----
Tensor parallelism (``helpers.tp``) leaves the LayerNorms, residual adds and
dropouts whole on every rank: each rank stores the same (B, T, h)
activations there. Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", sec. 4.2.2, Fig. 5) split those
regions along the sequence instead. The block's input is (B, T/t, h) per
rank, and the two edges of each tensor-parallel region change:

* entering (before the column-parallel linear), TP's f (identity forward,
  all-reduce backward) becomes g-bar: **all-gather** the sequence forward,
  **reduce-scatter** the gradient backward;
* leaving (after the row-parallel linear), TP's g (all-reduce forward)
  becomes g: **reduce-scatter** forward (sum the partial products and keep
  this rank's T/t positions), **all-gather** backward.

An all-reduce *is* a reduce-scatter followed by an all-gather (the ring
algorithm runs exactly those two phases), so the bytes on the wire are the
same as TP's (``ring_wire_bytes``), while the activations of the LayerNorm /
dropout regions shrink by t (Korthikanti Table 2: sbh(10 + 24/t) becomes
sbh(34)/t, without the attention-score term).

Parameters outside the split layers (LayerNorm weights, row-parallel biases)
now see only T/t positions per rank: their gradients are partial sums and
must be all-reduced over the group (``allreduce_replicated_grads``; Megatron
does it in its finalize-grads step).

How production differs
----------------------
Megatron-LM keeps activations sequence-first (T, B, h) so the gather is along
dim 0 and contiguous; it overlaps the all-gather with the QKV GEMM and the
reduce-scatter with the projection GEMM (``--tp-comm-overlap``). Here the
layout is the course model's (B, T, h) and nothing overlaps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.model import Block
from helpers.tp import (ColumnParallelLinear, RowParallelLinear, record_collective, tp_rank,
                        tp_size)

__all__ = ["all_gather_seq", "reduce_scatter_seq", "gather_from_sequence",
           "reduce_scatter_to_sequence", "SequenceParallelBlock", "sequence_parallel_block",
           "allreduce_replicated_grads", "ring_wire_bytes"]


# The two collectives of sequence parallelism, plain (no autograd): the edges below
# (_SequenceCollective) and helpers.sp.regather's linear build their backward from them.
# ``layer`` and ``direction`` label the call in helpers.tp's record_collective.

def all_gather_seq(x, group, layer, direction):
    """(B, T/t, h) per rank -> (B, T, h), rank order along the sequence."""
    record_collective("all_gather", x, layer, direction)
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_seq(x, group, layer, direction):
    """(B, T, h) partial sums on each rank -> (B, T/t, h): the sum, this rank's positions."""
    t = tp_size(group)
    if x.size(1) % t:
        raise ValueError(f"sequence length {x.size(1)} does not divide over "
                         f"tensor-parallel size {t}")
    record_collective("reduce_scatter", x, layer, direction)
    out = torch.empty_like(x.chunk(t, dim=1)[0])
    dist.reduce_scatter(out, [c.contiguous() for c in x.chunk(t, dim=1)], group=group)
    return out


class _SequenceCollective(torch.autograd.Function):
    """One edge of a tensor-parallel region under SP (Korthikanti sec. 4.2.2, Fig. 5).

    ``gather=True`` is g-bar: all-gather forward, reduce-scatter backward.
    ``gather=False`` is g: reduce-scatter forward, all-gather backward.
    Each is the other's conjugate, so one Function serves both.
    """

    @staticmethod
    def forward(ctx, x, group, layer, gather):
        ctx.group, ctx.layer, ctx.gather = group, layer, gather
        op = all_gather_seq if gather else reduce_scatter_seq
        return op(x, group, layer, "forward")

    @staticmethod
    def backward(ctx, grad):
        op = reduce_scatter_seq if ctx.gather else all_gather_seq
        return op(grad, ctx.group, ctx.layer, "backward"), None, None, None


def gather_from_sequence(x, group=None, layer="gather_seq"):
    """(B, T/t, h) -> (B, T, h): all-gather forward, reduce-scatter backward."""
    return x if tp_size(group) == 1 else _SequenceCollective.apply(x, group, layer, True)


def reduce_scatter_to_sequence(x, group=None, layer="reduce_scatter_seq"):
    """(B, T, h) partial sums -> (B, T/t, h): reduce-scatter forward, all-gather backward."""
    return x if tp_size(group) == 1 else _SequenceCollective.apply(x, group, layer, False)


class SequenceParallelBlock(nn.Module):
    """A pre-LN block with TP inside and SP outside: (B, T/t, h) in, (B, T/t, h) out.

    The split layers are ``helpers.tp``'s (so ``gather_dense`` reassembles
    them), but their f / g are replaced by the gather / reduce-scatter above.
    """

    def __init__(self, block: Block, group=None):
        super().__init__()
        t = tp_size(group)
        attn = block.attn
        if attn.n_head % t:
            raise ValueError(f"{attn.n_head} heads do not divide over tensor-parallel size {t}")
        self.group, self.n_head, self.head_dim = group, attn.n_head // t, attn.head_dim
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        self.c_attn = ColumnParallelLinear.from_dense(attn.c_attn, group, parts=3)
        self.attn_proj = RowParallelLinear.from_dense(attn.c_proj, group)
        self.c_fc = ColumnParallelLinear.from_dense(block.mlp.c_fc, group)
        self.mlp_proj = RowParallelLinear.from_dense(block.mlp.c_proj, group)
        for name in ("c_attn", "attn_proj", "c_fc", "mlp_proj"):
            getattr(self, name).name = name

    def _attention(self, a):
        B, T, _ = a.shape                                          # a: (B, T, h) gathered
        local = self.n_head * self.head_dim
        q, k, v = F.linear(a, self.c_attn.weight, self.c_attn.bias).split(local, dim=2)
        q, k, v = (u.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        return F.linear(y.transpose(1, 2).reshape(B, T, local), self.attn_proj.weight)

    def forward(self, x):                                          # x: (B, T/t, h)
        g = self.group
        a = gather_from_sequence(self.ln_1(x), g, "c_attn")           # (B, T, h)
        x = x + reduce_scatter_to_sequence(self._attention(a), g, "attn_proj") \
            + _bias(self.attn_proj)
        m = gather_from_sequence(self.ln_2(x), g, "c_fc")             # (B, T, h)
        m = F.gelu(F.linear(m, self.c_fc.weight, self.c_fc.bias))     # (B, T, 4h/t)
        return x + reduce_scatter_to_sequence(F.linear(m, self.mlp_proj.weight), g, "mlp_proj") \
            + _bias(self.mlp_proj)


def _bias(row: RowParallelLinear):
    return 0.0 if row.bias is None else row.bias  # added once, after the reduce-scatter


def sequence_parallel_block(block: Block, group=None) -> SequenceParallelBlock:
    """The SP form of a dense ``block`` (weights copied, dropout must be 0)."""
    if any(isinstance(m, nn.Dropout) and m.p for m in block.modules()):
        raise ValueError("sequence_parallel_block needs dropout 0 (a split region needs its "
                         "own random stream per rank)")
    return SequenceParallelBlock(block, group)


def allreduce_replicated_grads(module: nn.Module, group=None) -> int:
    """Sum over the group the gradients of parameters every rank holds whole; returns
    the bytes of gradient all-reduced (0 at t = 1).

    Each rank's LayerNorm (and row-parallel bias) saw only its T/t positions,
    so its gradient is a partial sum over the sequence: 6h values a block (two
    LayerNorms' weight and bias, the two row-parallel biases), once a step.
    """
    if tp_size(group) == 1:
        return 0
    split = {id(p) for m in module.modules() for n, spec in getattr(m, "layout", {}).items()
             if spec is not None for p in [getattr(m, n)]}
    nbytes = 0
    for p in module.parameters():
        if id(p) not in split and p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            nbytes += p.grad.numel() * p.grad.element_size()
    return nbytes


def ring_wire_bytes(op: str, nbytes: int, t: int) -> float:
    """Bytes each rank sends for one collective with the ring algorithm.

    nbytes: the payload each rank hands over (the counter's convention: the
    all-reduce's buffer, the all-gather's local piece, the reduce-scatter's
    whole input). All-reduce 2 (t-1)/t N, all-gather (t-1) n, reduce-scatter
    (t-1)/t N (Thakur et al. 2005, "Optimization of Collective Communication
    Operations in MPICH", sec. 4).
    """
    per = {"all_reduce": 2 * (t - 1) / t, "all_gather": t - 1, "reduce_scatter": (t - 1) / t}
    return per[op] * nbytes
