"""Column- and row-parallel linear layers and the vocab-parallel embedding.

A linear layer Y = X A^T (A: out x in, as in ``nn.Linear``) can be split over
t ranks two ways (Shoeybi et al. 2019, "Megatron-LM", sec. 3, eq. 2-3):

* **column-parallel**: each rank keeps out/t rows of A (output features,
  "columns" of the math's X A). Rank r computes its own slice Y_r = X A_r^T
  from the whole X: no communication in forward; X goes in through ``f``
  because dL/dX = sum_r dL/dY_r A_r needs every rank's piece (all-reduce in
  backward).
* **row-parallel**: each rank keeps in/t columns of A (input features) and
  needs only its slice X_r of the input, which is exactly what a
  column-parallel layer before it produced. Y = sum_r X_r A_r^T: the partial
  products are added by ``g`` (all-reduce in forward). The bias is added once,
  after the sum: added before, it would be counted t times.

Column then row, with an element-wise function between (GeLU acts on each
feature on its own), is a split MLP with one all-reduce forward and one
backward: the Megatron pattern.

Weight memory per rank is 1/t of the split layer (the row-parallel bias and
LayerNorms stay whole). The layers are built either from a seed, like
``nn.Linear`` (the full matrix is initialized identically on every rank and
sliced, as Megatron initializes a master weight, so the model does not depend
on t), or with ``from_dense`` from an existing layer, so tests can compare
with that exact layer.

``parts`` handles a stacked projection such as QKV: the out features are
``parts`` blocks (q, k, v), and each block is split over t, so rank r holds
its heads of q, of k and of v (Megatron calls this the partition stride).

Production differences: Megatron-LM's ``ColumnParallelLinear`` and
``RowParallelLinear`` (``megatron/core/tensor_parallel/layers.py``) add
sequence parallelism, overlap of the backward all-reduce with the weight
gradient GEMM, fused gradient accumulation, and custom CUDA kernels.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.tp.operators import f, g, gather_last, split_last, tp_rank, tp_size

__all__ = ["shard", "unshard", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "padded_vocab_size"]


def shard(w: torch.Tensor, dim: int, t: int, r: int, parts: int = 1) -> torch.Tensor:
    """Rank r's slice of ``w`` along ``dim``: ``dim`` holds ``parts`` blocks, each split in t.

    (.., parts * t * n, ..) -> (.., parts * n, ..); a copy, so the shard owns its memory.
    """
    if w.size(dim) % (parts * t):
        into = f" into {parts} parts" if parts > 1 else ""   # parts: chapter 09's QKV
        raise ValueError(f"dim {dim} of size {w.size(dim)} does not divide{into} over "
                         f"tensor-parallel size {t}")
    return w.unflatten(dim, (parts, t, -1)).select(dim + 1, r).flatten(dim, dim + 1).clone()


def unshard(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """Inverse of ``shard``: the t ranks' slices (rank order) -> the whole tensor."""
    blocks = [s.unflatten(dim, (parts, -1)) for s in shards]  # (.., parts, n, ..)
    return torch.stack(blocks, dim=dim + 1).flatten(dim, dim + 2)  # (.., parts, t, n, ..)


def padded_vocab_size(vocab_size: int, t: int, divisible_by: int = 1) -> int:
    """Megatron-LM's padding: round the vocabulary up to a multiple of divisible_by * t.

    Megatron pads (``--make-vocab-size-divisible-by``, default 128, times the TP
    size) so every rank gets an equal, GEMM-friendly slice of the vocabulary;
    the padded rows are never looked up. Here ``divisible_by=1``: the smallest
    padding that divides over t.
    """
    multiple = divisible_by * t
    return math.ceil(vocab_size / multiple) * multiple


class _Sharded(nn.Module):
    """Common part: the group, a name for the collective counter, and each
    parameter's layout {name: (dim, parts)} (None: replicated) for gathering."""

    layout: dict

    def _setup(self, group, name: str) -> tuple[int, int]:
        self.group, self.name = group, name
        return tp_size(group), tp_rank(group)


class ColumnParallelLinear(_Sharded):
    """y = f(x) A_r^T + b_r: this rank's out_features / t outputs (Megatron-LM, sec. 3).

    x: (..., in_features) whole on every rank -> (..., out_features / t), or
    (..., out_features) with ``gather_output=True`` (an all-gather).

    ``weight``: this rank's (out_features / t, in_features) slice, used as it is
    instead of a new one: a parameter shared with another layer (the tied LM
    head's is the vocab-parallel embedding's, ``helpers.tp.transformer.tied_lm_head``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False, parts: int = 1, *, dense: nn.Linear | None = None,
                 weight: nn.Parameter | None = None, device=None, dtype=None):
        super().__init__()
        t, r = self._setup(group, "ColumnParallelLinear")
        if out_features % (parts * t):
            raise ValueError(f"{out_features} output features" + (f" ({parts} parts)" if parts > 1
                             else "") + f" do not divide over tensor-parallel size {t}")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.parts = gather_output, parts
        self.layout = {"weight": (0, parts), "bias": (0, parts)}
        if weight is not None:  # shared, not copied: one tensor, two uses
            if dense is not None or bias:
                raise ValueError("a shared weight comes alone: no dense layer, no bias")
            if tuple(weight.shape) != (out_features // t, in_features):
                raise ValueError(f"shared weight of shape {tuple(weight.shape)}, expected "
                                 f"{(out_features // t, in_features)} (out/t, in)")
            self.weight, self.bias = weight, None
            return
        if dense is None:  # initialize the whole layer (same on every rank), keep a slice
            dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight = nn.Parameter(shard(dense.weight.detach(), 0, t, r, parts))  # (out/t, in)
        self.bias = (nn.Parameter(shard(dense.bias.detach(), 0, t, r, parts))   # (out/t,)
                     if dense.bias is not None else None)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output: bool = False,
                   parts: int = 1) -> "ColumnParallelLinear":
        """This rank's slice of an existing ``nn.Linear`` (copied, same dtype/device)."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                   gather_output, parts, dense=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(f(x, self.group, self.name), self.weight, self.bias)  # (..., out/t)
        return gather_last(y, self.group, self.name) if self.gather_output else y


class RowParallelLinear(_Sharded):
    """y = g(x_r A_r^T) + b: partial products summed by all-reduce, bias once (sec. 3).

    x: (..., in_features / t), this rank's slice (``input_is_parallel=True``), or
    (..., in_features) whole, of which the layer keeps its slice -> (..., out_features).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 input_is_parallel: bool = True, *, dense: nn.Linear | None = None,
                 device=None, dtype=None):
        super().__init__()
        t, r = self._setup(group, "RowParallelLinear")
        if in_features % t:
            raise ValueError(f"{in_features} input features do not divide over "
                             f"tensor-parallel size {t}")
        if dense is None:
            dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(shard(dense.weight.detach(), 1, t, r))  # (out, in/t)
        self.bias = nn.Parameter(dense.bias.detach().clone()) if dense.bias is not None else None
        self.layout = {"weight": (1, 1), "bias": None}  # bias replicated

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None,
                   input_is_parallel: bool = True) -> "RowParallelLinear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                   input_is_parallel, dense=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last(x, self.group, self.name)   # (..., in/t)
        y = g(F.linear(x, self.weight), self.group, self.name)  # (..., out), summed
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(_Sharded):
    """Rows [r V/t, (r+1) V/t) of the embedding table on rank r (Megatron-LM, sec. 3).

    Each rank looks up the tokens it owns, writes zeros for the others, and
    ``g`` sums over ranks: exactly one rank contributed each token's row.
    idx (...,) -> (..., embedding_dim). The table may be padded past
    ``num_embeddings`` (``padded_vocab_size``); padded rows are zero and never used.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None,
                 padded_num_embeddings: int | None = None, *, dense: nn.Embedding | None = None,
                 device=None, dtype=None):
        super().__init__()
        t, r = self._setup(group, "VocabParallelEmbedding")
        padded = padded_num_embeddings or num_embeddings
        if padded < num_embeddings:
            raise ValueError(f"padded_num_embeddings={padded} < num_embeddings={num_embeddings}")
        if padded % t:
            raise ValueError(f"a vocabulary of {padded} does not divide over tensor-parallel "
                             f"size {t}; pad it with padded_vocab_size({num_embeddings}, {t})")
        if dense is None:
            dense = nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        full = dense.weight.detach()
        full = torch.cat([full, full.new_zeros(padded - num_embeddings, embedding_dim)])
        self.num_embeddings, self.padded_num_embeddings = num_embeddings, padded
        self.embedding_dim = embedding_dim
        self.per_rank = padded // t
        self.vocab_start = r * self.per_rank  # this rank owns [vocab_start, vocab_start + per_rank)
        self.weight = nn.Parameter(shard(full, 0, t, r))  # (V_pad / t, h)
        self.layout = {"weight": (0, 1)}

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group=None,
                   padded_num_embeddings: int | None = None) -> "VocabParallelEmbedding":
        return cls(emb.num_embeddings, emb.embedding_dim, group, padded_num_embeddings, dense=emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        foreign = (local < 0) | (local >= self.per_rank)             # tokens another rank owns
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)  # (..., h)
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        return g(out, self.group, self.name)
