"""Checks for chapter 10: the online-softmax merge and the key/value ring.

``check_merge(merge)``: the learner's ``merge(o1, lse1, o2, lse2) -> (o, lse)``
combines attention over two disjoint key blocks (Milakov & Gimelshein 2018,
sec. 3). Checked on one process in float64 against softmax over all keys,
including rows whose first block is fully masked (lse = -inf). Float64 on
both sides, only rounding differs (~1e-16 relative); we allow 1e-9, while an
average of the two blocks is off by O(1).

``check_ring(ring_forward)``: the learner's causal ring attention forward
(contiguous layout, K/V passed round the ring with isend/irecv) on 2 ranks in
float64 against ``F.scaled_dot_product_attention(..., is_causal=True)`` on
the whole sequence. A ring that skips the causal mask lets the first rank's
queries see the future: off by O(1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.checks import CheckFailed, attempt, on_ranks, passed

REL = 1e-9  # float64, only rounding differs (module docstring)


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and \
        bool(((a - b).abs().nan_to_num(float("inf")) <= REL * max(b.abs().max().item(), 1.0))
             .all())


def check_merge(merge) -> None:
    """Two key blocks of one float64 attention, merged, vs softmax over all keys."""
    from helpers.sp import block_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    k[..., 5:, :] *= 4.0                          # one block with much more softmax mass
    want = F.scaled_dot_product_attention(q, k, v)
    want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / 2.0, -1)
    o1, l1 = block_attention(q, k[..., :3, :], v[..., :3, :])
    o2, l2 = block_attention(q, k[..., 3:, :], v[..., 3:, :])
    out = attempt(merge, o1, l1, o2, l2, what="merge")
    if not (isinstance(out, tuple) and len(out) == 2):
        raise CheckFailed("merge must return a pair (o, lse)")
    o, lse = out
    if _close(o, (o1 + o2) / 2):
        raise CheckFailed("merge averages the two outputs; weight each by its share of the "
                          "softmax mass: exp(lse_i - lse) with lse = logaddexp(lse1, lse2)")
    if not _close(lse, want_lse):
        raise CheckFailed("the merged lse is not log(exp(lse1) + exp(lse2)) (torch.logaddexp)")
    if not _close(o, want):
        raise CheckFailed("the merged output differs from attention over all keys: "
                          "o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2")
    # Causal attention: a query's first block can be entirely in its future (lse = -inf).
    empty = torch.zeros(6, 3, dtype=torch.bool)
    oe, le = block_attention(q, k[..., :3, :], v[..., :3, :], empty)
    o, lse = attempt(merge, oe, le, o2, l2, what="merge with an empty block")
    if not (_close(o, o2) and _close(lse, l2)):
        raise CheckFailed("merging an empty block (lse = -inf, o = 0) must leave the other "
                          "block unchanged; is there a NaN from -inf - (-inf)?")
    passed("merge equals attention over all keys (float64), also with an empty block")


def _run_ring(ring_forward):
    from helpers import rank_info
    from helpers.sp import shard_sequence
    t = rank_info().world_size
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4 * t, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = ring_forward(*(shard_sequence(x) for x in (q, k, v)))
    return got, shard_sequence(want)


def check_ring(ring_forward) -> None:
    """2 ranks, contiguous layout, float64, vs full causal SDPA."""
    probe = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    res = on_ranks(_run_ring, 2, ring_forward, what="ring_forward",
                   probe=lambda: ring_forward(probe, probe, probe))
    for rank, (got, want) in enumerate(res):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise CheckFailed(f"rank {rank}: ring_forward must return this rank's output chunk "
                              f"of shape {tuple(want.shape)}")
        if not _close(got, want):
            raise CheckFailed(f"rank {rank}: the output differs from full causal attention. "
                              f"Mask each block with causal_mask(my positions, the block "
                              f"owner's positions), and merge with the log-sum-exp rule")
    passed("the ring's output equals full causal attention on 2 ranks (float64)")
