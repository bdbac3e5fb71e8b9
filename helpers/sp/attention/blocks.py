"""Attention on one block of keys, and the exact merge of two blocks (online softmax).

Follows Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax", sec. 3, the same rule as FlashAttention (Dao et al. 2022, sec.
3.1). What every context-parallel attention here shares: the causal mask
between two sets of positions, one block's output and log-sum-exp, their
merge, the work each rank does, and the input checks made before any message.

The merge (online softmax)
--------------------------
Attention of a query over keys split into blocks A and B: with per-block
outputs o_A = softmax(s_A) v_A and log-sum-exps l_A = log sum exp(s_A),

    l = log(e^{l_A} + e^{l_B}),    o = e^{l_A - l} o_A + e^{l_B - l} o_B

exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax", sec. 3; the same rule as FlashAttention, Dao et al. 2022, sec. 3.1).
Averaging o_A and o_B instead is wrong whenever the blocks carry different
softmax mass.
"""

from __future__ import annotations

import math

import torch

from helpers.sp.layout import check_layout, cp_rank, cp_size, positions

__all__ = ["causal_mask", "block_attention", "merge_partials", "unmasked_scores", "check_qkv"]


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(len q, len k) bool, True where key position <= query position (may attend)."""
    return k_pos[None, :] <= q_pos[:, None]


def block_attention(q, k, v, mask=None, scale=None):
    """softmax(q k^T scale, masked) v and the log-sum-exp of each row.

    q: (B, H, n, d), k, v: (B, H, m, d), mask: (n, m) bool or None.
    Returns o (B, H, n, d) and lse (B, H, n); a row with no allowed key has
    o = 0 and lse = -inf (it carries no softmax mass into a merge).
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale                        # (B, H, n, m)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                             # (B, H, n)
    p = torch.exp(s - _finite(lse)[..., None])                   # exp(-inf) = 0 on empty rows
    return p @ v, lse


def merge_partials(o1, lse1, o2, lse2):
    """The online-softmax merge of two partial attentions over disjoint key blocks.

    l = logaddexp(l1, l2); o = e^{l1-l} o1 + e^{l2-l} o2 (Milakov & Gimelshein 2018).
    """
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - _finite(lse)).nan_to_num(0.0)   # both -inf: the row stays empty
    w2 = torch.exp(lse2 - _finite(lse)).nan_to_num(0.0)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def unmasked_scores(seq: int, cp: int, layout: str) -> list[int]:
    """Score entries each rank computes under the causal mask (the work per rank)."""
    return [int(causal_mask(positions(seq, cp, r, layout), torch.arange(seq)).sum())
            for r in range(cp)]


def check_qkv(q, k, v, group, layout):
    """Same checks on every rank before any communication: all fail alike, none hangs.

    Returns (cp, this rank in the group, the whole sequence's length)."""
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"q, k, v must share one shape (batch, heads, seq/cp, head_dim), "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    cp = cp_size(group)
    check_layout(q.size(-2) * cp, cp, layout)
    return cp, cp_rank(group), q.size(-2) * cp
