"""Context parallelism by all-gathering K and V: Llama 3's attention over a split sequence.

Follows Llama 3 (Dubey et al. 2024, sec. 3.3.2): each of cp ranks keeps its
chunk of queries and all-gathers the keys and values of the whole sequence,
simple, and K/V are small under grouped-query attention. Memory: the whole
K, V. The backward of the all-gather is its conjugate, a reduce-scatter of
the K/V gradients. ``attention_saved_bytes`` is what one call keeps for
backward, with and without the s^2 scores (Korthikanti et al. 2022, Table 2).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.sp.attention.blocks import causal_mask, check_qkv
from helpers.sp.layout import cp_size, positions

__all__ = ["allgather_attention", "attention_saved_bytes"]


class _GatherSequence(torch.autograd.Function):
    """All-gather chunks into the global order forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, layout):
        cp = cp_size(group)
        ctx.group, ctx.order = group, torch.cat(
            [positions(x.size(-2) * cp, cp, r, layout) for r in range(cp)]).to(x.device)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        full = torch.empty_like(torch.cat(parts, -2))
        return full.index_copy_(-2 % x.dim(), ctx.order, torch.cat(parts, -2))

    @staticmethod
    def backward(ctx, grad):
        # every rank's queries used my keys: sum their gradients for my rows
        by_rank = grad.index_select(-2, ctx.order).chunk(cp_size(ctx.group), dim=-2)
        out = torch.empty_like(by_rank[0])
        dist.reduce_scatter(out, [c.contiguous() for c in by_rank], group=ctx.group)
        return out, None, None


def allgather_attention(q, k, v, group=None, causal=True, layout="contiguous",
                        materialize=False):
    """Local q against the all-gathered K, V; returns this rank's output chunk.

    ``materialize=True`` computes softmax(q k^T) v explicitly, so autograd keeps the
    (seq/cp, seq) probabilities per head, the s^2 term a fused kernel avoids
    (``attention_saved_bytes``); otherwise it calls SDPA.
    """
    cp, r, seq = check_qkv(q, k, v, group, layout)
    if cp > 1:
        k, v = (_GatherSequence.apply(x, group, layout) for x in (k, v))  # (B, H, S, d)
    mask = causal_mask(positions(seq, cp, r, layout), torch.arange(seq)) if causal else None
    mask = None if mask is None else mask.to(q.device)
    if materialize:
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))           # (B, H, S/cp, S)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))                     # saves the bool mask
        return torch.softmax(s, dim=-1) @ v                             # saves the probabilities
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_saved_bytes(seq, cp, batch, heads, head_dim, itemsize=4, materialize=False,
                          causal=True):
    """Bytes autograd keeps per rank for one attention call, s = seq split over cp ranks.

    n = s/cp local queries, per (batch, head):
    * ``materialize=True`` (``allgather_attention(materialize=True)``): q (n d), the
      gathered K and V (2 s d), the probabilities (n s), plus the causal mask
      (n s bools, shared by all heads). The n s terms are the s^2/cp growth that
      Korthikanti et al. 2022 (Table 2) write as 5as/h per sbh.
    * flash-style (``ring_attention``): q, k, v, the output (4 n d) and one
      log-sum-exp per row (n): linear in s, what FlashAttention saves (Dao et al.
      2022, sec. 3.1) and why the s^2 term vanishes with a fused kernel.
    """
    n = seq // cp
    if materialize:
        return itemsize * batch * heads * (n * head_dim + 2 * seq * head_dim + n * seq) \
            + (n * seq if causal else 0)
    return itemsize * batch * heads * (4 * n * head_dim + n)
