"""Sequence and context parallelism: splitting the sequence over ranks (chapter 10).

Tensor parallelism (chapters 08-09) splits the weights but leaves the
LayerNorm / residual activations whole on every rank, and every rank still
sees the whole sequence. As context grows, activations (linear in the
sequence s, plus s^2 attention scores without a fused kernel) dominate
memory. Two splits along the sequence fix that:

* ``layout``: which positions each rank holds ("contiguous" or the
  load-balanced "zigzag"), ``shard_sequence`` / ``gather_sequence``.
* ``attention``: context parallelism for attention, the one layer whose
  tokens interact: ``allgather_attention`` (Llama 3), ``ring_attention``
  (Liu et al. 2023, online-softmax merge; ``ring_forward`` records its time
  line), ``ulysses_attention`` (DeepSpeed-Ulysses, all-to-all);
  ``attention_saved_bytes`` (what one call keeps for backward, with and
  without the s^2 scores) and ``torch_context_parallel`` (PyTorch's own, for
  comparison; CUDA only).
* ``megatron``: Megatron sequence parallelism on top of ``helpers.tp``
  (Korthikanti et al. 2022, sec. 4.2.2): ``sequence_parallel_block``.
* ``cost``: what the ring's messages cost on a cluster (``ring_hop_time``,
  ``ring_attention_time``): one GPU pair per hop, one NIC at a node boundary,
  and how much of it the attention hides.

Every function takes ``group`` (None: the default group) and, with one
rank, reduces to ordinary attention.
"""

from helpers.sp.attention import (allgather_attention, attention_saved_bytes, block_attention,
                                  block_mask, causal_mask, check_ulysses, merge_partials,
                                  ring_attention,
                                  ring_forward, ring_shift, torch_context_parallel,
                                  ulysses_attention, unmasked_scores, wait_all)
from helpers.sp.megatron import (SequenceParallelBlock, allreduce_replicated_grads,
                                 gather_from_sequence, reduce_scatter_to_sequence,
                                 ring_wire_bytes, sequence_parallel_block)
from helpers.sp.layout import (LAYOUTS, check_layout, cp_rank, cp_size, gather_sequence,
                               positions, shard_sequence)

__all__ = ["LAYOUTS", "check_layout", "cp_rank", "cp_size", "positions", "shard_sequence",
           "gather_sequence", "causal_mask", "block_attention", "merge_partials",
           "unmasked_scores", "allgather_attention", "ring_attention", "ring_forward",
           "ring_shift", "wait_all", "block_mask", "attention_saved_bytes",
           "torch_context_parallel", "ulysses_attention", "check_ulysses",
           "gather_from_sequence", "reduce_scatter_to_sequence", "SequenceParallelBlock",
           "sequence_parallel_block", "allreduce_replicated_grads", "ring_wire_bytes"]
