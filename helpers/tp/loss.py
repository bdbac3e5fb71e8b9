"""Cross-entropy over a vocabulary split across tensor-parallel ranks.

With a vocab-parallel head each rank holds logits for V/t tokens only:
(N, V/t). Gathering the whole (N, V) logits would cost N V bytes per rank,
the largest tensor of the model for big vocabularies. Instead each rank
reduces its slice to three numbers per token and all-reduces only those
(Shoeybi et al. 2019, "Megatron-LM", sec. 3, "we fuse the output of the
parallel GEMM with the cross entropy loss"):

    m      = max over all V of the logits         (all-reduce MAX, N values)
    S      = sum over all V of exp(logit - m)     (all-reduce SUM, N values)
    z_tgt  = logit of the target token - m        (all-reduce SUM, N values;
                                                   only the owner is non-zero)
    loss   = log S - z_tgt

Subtracting the global max before exp keeps every exponent <= 0, so large
logits do not overflow (the log-sum-exp trick).

Backward needs no communication: dL/dz_j = softmax_j - [j == target], and
each rank has its own softmax slice exp(z_j - m) / S.

``ignore_index`` and the mean over non-ignored tokens follow
``F.cross_entropy``'s defaults (mean of an empty set is nan, as there).

Production difference: Megatron-LM's ``_VocabParallelCrossEntropy``
(``megatron/core/tensor_parallel/cross_entropy.py``) computes the same three
reductions, fuses the softmax into the backward in place to save memory, and
leaves the mean and masking to the caller.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.tp.operators import all_reduce, tp_rank, tp_size

__all__ = ["vocab_parallel_cross_entropy", "VocabParallelCrossEntropy"]


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (N, V/t) logit slices; three all-reduces of N values forward."""

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index, vocab_start, layer):
        t = tp_size(group)
        n_local = logits.size(-1)
        # 1. global max per token, a constant shift (no gradient flows through it)
        m = logits.max(dim=-1).values                                     # (N,)
        if t > 1:
            all_reduce(m, group, layer, "forward", op=dist.ReduceOp.MAX)
        z = logits - m.unsqueeze(-1)                                      # (N, V/t), <= 0
        # 2. the target's shifted logit, from the rank that owns it
        local = targets - vocab_start
        owned = (local >= 0) & (local < n_local) & (targets != ignore_index)
        z_tgt = z.gather(-1, local.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1)
        z_tgt = z_tgt.masked_fill(~owned, 0.0)                            # (N,)
        # 3. sum of exponentials over the whole vocabulary
        e = z.exp()
        s = e.sum(dim=-1)                                                 # (N,)
        if t > 1:
            all_reduce(z_tgt, group, layer, "forward")
            all_reduce(s, group, layer, "forward")
        valid = targets != ignore_index
        n_valid = valid.sum()
        loss = ((s.log() - z_tgt) * valid).sum() / n_valid               # nan if nothing valid
        ctx.save_for_backward(e, s, local, owned, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        e, s, local, owned, valid, n_valid = ctx.saved_tensors
        grad = e / s.unsqueeze(-1)                                        # softmax slice
        rows = owned.nonzero().squeeze(-1)
        grad[rows, local[rows]] -= 1.0                                    # - one-hot of target
        grad *= (valid.to(grad.dtype) * grad_loss / n_valid).unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group=None,
                                 ignore_index: int = -100, vocab_start: int | None = None,
                                 layer: str = "loss") -> torch.Tensor:
    """Mean cross-entropy over non-ignored tokens, each rank holding a slice of the vocab.

    logits_shard: (..., V/t), this rank's slice, covering token ids
    [vocab_start, vocab_start + V/t) (default: rank r's r-th equal slice).
    targets: (...) int64 ids over the whole vocabulary, or ``ignore_index``.
    Returns the same value on every rank, equal to
    ``F.cross_entropy(whole_logits, targets, ignore_index=ignore_index)``.
    """
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and targets "
                         f"{tuple(targets.shape)} disagree before the vocab dimension")
    if vocab_start is None:
        vocab_start = tp_rank(group) * logits_shard.size(-1)
    n = logits_shard.size(-1)
    return VocabParallelCrossEntropy.apply(logits_shard.reshape(-1, n), targets.reshape(-1),
                                           group, ignore_index, vocab_start, layer)
