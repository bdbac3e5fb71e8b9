"""Tensor parallelism: splitting each layer's matrices over ranks (chapters 08-09).

What
----
Data parallelism copies the model; pipeline parallelism cuts it by depth.
Tensor parallelism (TP) cuts *inside* each layer: every weight matrix of a
transformer block is split over t ranks, so each rank stores and multiplies
1/t of it, and the ranks exchange activations twice per block in forward and
twice in backward (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", sec. 3).

Modules
-------
* ``operators``: the conjugate f / g autograd Functions, all-gather / split,
  and ``count_collectives`` (every collective, its bytes, layer, direction).
* ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear``,
  ``VocabParallelEmbedding`` (each ``from_dense`` for exact comparison).
* ``loss``: ``vocab_parallel_cross_entropy`` on vocab-sliced logits.
* ``transformer``: ``tp_plan`` (divisibility, before any rank starts),
  ``tensor_parallel_gpt`` (the course GPT converted), ``tied_lm_head`` (the
  LM head sharing the vocab-parallel embedding's weight), ``gather_dense``,
  ``tp_comm_bytes`` (the per-layer byte formula).
* ``cost``: why TP stays inside a node (message per layer vs link bandwidth).

Every function takes ``group`` (``None``: the default group), so TP can run in
a sub-group of a larger mesh (data x pipeline x tensor, chapter 20).

Cost
----
Weights, gradients and optimizer state of the split layers: 1/t per rank.
Activations inside the block are split too, but the LayerNorm/residual ones
stay whole (chapter 10's sequence parallelism splits those). Communication:
4 all-reduces of B T h elements per block per step, on the critical path
(nothing to overlap them with in this simple form), so TP needs the fastest
links there are: NVLink inside a node.

How production differs
----------------------
Megatron-LM (``megatron/core/tensor_parallel``) adds sequence parallelism,
overlaps communication with GEMMs, fuses kernels; PyTorch's
``torch.distributed.tensor.parallel`` expresses the same plan with DTensor
(``ColwiseParallel`` / ``RowwiseParallel``, ``loss_parallel``), which the
tests and chapter 09 compare against.
"""

from helpers.tp.cost import LINKS, tp_efficiency, tp_layer_comm_time, tp_link
from helpers.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               padded_vocab_size, shard, unshard)
from helpers.tp.loss import vocab_parallel_cross_entropy
from helpers.tp.operators import (CollectiveCounter, count_collectives, f, g, gather_last,
                                  record_collective, split_last, tp_rank, tp_size)
from helpers.tp.transformer import (ParallelSelfAttention, TensorParallelGPT, TPPlan,
                                    gather_dense, tensor_parallel_block, tensor_parallel_gpt,
                                    tied_lm_head, tp_comm_bytes, tp_plan)

__all__ = ["f", "g", "gather_last", "split_last", "tp_size", "tp_rank", "count_collectives",
           "CollectiveCounter", "record_collective", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "padded_vocab_size", "shard", "unshard",
           "vocab_parallel_cross_entropy", "TPPlan", "tp_plan", "ParallelSelfAttention",
           "tensor_parallel_block", "TensorParallelGPT", "tensor_parallel_gpt", "tied_lm_head",
           "gather_dense", "tp_comm_bytes", "LINKS", "tp_link", "tp_layer_comm_time",
           "tp_efficiency"]
