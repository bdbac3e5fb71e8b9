"""Megatron's sequence-parallel linear: keep the sequence shard, all-gather it again in backward.

What
----
Under sequence parallelism (``helpers.sp.megatron``) the column-parallel
layers of a block (QKV and the MLP's first layer) read the *gathered*
LayerNorm output, (B, T, h) on every rank. A plain ``F.linear`` on it saves
that gathered tensor for the weight gradient, so each rank keeps 2 sbh values
per layer that are not divided by t: in Korthikanti et al.'s units (2022,
sec. 4.2.2, bytes at 16 bits) sbh (4 + 30/t) instead of their 34 sbh / t, in
which every activation of the block is divided by t.

Megatron-LM saves only this rank's shard, (B, T/t, h), and all-gathers it a
second time in backward, just before the weight-gradient GEMM
(``LinearWithGradAccumulationAndAsyncCommunication`` in
megatron/core/tensor_parallel/layers.py: with sequence parallelism it saves
the local input and re-runs the all-gather in backward, overlapped with the
input-gradient GEMM). The trade: 2 more all-gathers per layer per step, one
per column-parallel layer, (t-1)/t of the gathered input each, for 2 sbh (t-1)/t
fewer saved values.

``gather_linear(x_local, weight, bias, group)`` is that layer:
forward  all-gather x -> y = x W^T + b, saving x_local only;
backward all-gather x again; dx = reduce-scatter(dy W); dW = dy^T x; db = sum dy.
``RegatherBlock`` is ``SequenceParallelBlock`` with its two column-parallel
layers replaced by it. Nothing overlaps here (CPU ranks, one stream).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.sp.megatron import (SequenceParallelBlock, all_gather_seq, reduce_scatter_seq,
                                 reduce_scatter_to_sequence, sequence_parallel_block)
from helpers.tp import tp_size

__all__ = ["gather_linear", "RegatherBlock", "regather_block"]


class _GatherLinear(torch.autograd.Function):
    """y = all_gather(x) W^T + b, saving the shard x and re-gathering it in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, layer):
        ctx.group, ctx.layer, ctx.has_bias = group, layer, bias is not None
        ctx.save_for_backward(x, weight)                       # the shard, not the gather
        whole = all_gather_seq(x, group, layer, "forward")    # (B, T, h)
        return F.linear(whole, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                   # grad: (B, T, out/t)
        x, weight = ctx.saved_tensors
        whole = all_gather_seq(x, ctx.group, ctx.layer, "backward")    # the re-gather
        grad_whole = grad @ weight                              # (B, T, h), a partial sum
        grad_x = reduce_scatter_seq(grad_whole, ctx.group, ctx.layer, "backward")
        g2, w2 = grad.reshape(-1, grad.size(-1)), whole.reshape(-1, whole.size(-1))
        grad_w = g2.t() @ w2                                    # (out/t, h)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def gather_linear(x, weight, bias=None, group=None, layer="gather_linear"):
    """(B, T/t, h) shard -> (B, T, out/t): all-gather then linear, saving only the shard."""
    if tp_size(group) == 1:
        return F.linear(x, weight, bias)
    return _GatherLinear.apply(x, weight, bias, group, layer)


class RegatherBlock(SequenceParallelBlock):
    """``SequenceParallelBlock`` whose QKV and MLP-up layers save the sequence shard and
    all-gather it again in backward (Megatron-LM's choice)."""

    def _attend(self, qkv):
        B, T, _ = qkv.shape                                     # qkv: (B, T, 3h/t)
        local = self.n_head * self.head_dim
        q, k, v = (u.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for u in qkv.split(local, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # this rank's heads
        return F.linear(y.transpose(1, 2).reshape(B, T, local), self.attn_proj.weight)

    def forward(self, x):                                       # x: (B, T/t, h)
        g = self.group
        qkv = gather_linear(self.ln_1(x), self.c_attn.weight, self.c_attn.bias, g, "c_attn")
        x = x + reduce_scatter_to_sequence(self._attend(qkv), g, "attn_proj") \
            + _bias(self.attn_proj)
        m = F.gelu(gather_linear(self.ln_2(x), self.c_fc.weight, self.c_fc.bias, g, "c_fc"))
        return x + reduce_scatter_to_sequence(F.linear(m, self.mlp_proj.weight), g, "mlp_proj") \
            + _bias(self.mlp_proj)


def _bias(row):
    return 0.0 if row.bias is None else row.bias   # added once, after the reduce-scatter


def regather_block(block, group=None) -> RegatherBlock:
    """The SP form of a dense ``block`` that re-gathers in backward (dropout must be 0)."""
    sequence_parallel_block(block, group)           # the same refusals, before any copy
    return RegatherBlock(block, group)
