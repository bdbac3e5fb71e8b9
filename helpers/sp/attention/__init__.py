"""Causal attention over a sequence split across ranks: all-gather, ring, and all-to-all.

What
----
Each of cp ranks holds a chunk of the sequence: q, k, v of shape
(batch, heads, seq / cp, head_dim), positions given by ``helpers.sp.layout``.
Every query still needs every earlier key. Three ways to get there, each
returning this rank's chunk of the output, equal to full attention:

* ``allgather_attention``: all-gather K and V (the whole sequence), keep Q
  local. Llama 3's context parallelism (Dubey et al. 2024, sec. 3.3.2): simple,
  and K/V are small under grouped-query attention. Memory: the whole K, V.
* ``ring_attention``: K/V blocks travel round the ring of ranks (isend/irecv)
  while each rank computes on the block it holds; partial results merge
  exactly with the online-softmax rule below (Liu, Zaharia & Abbeel 2023,
  "Ring Attention with Blockwise Transformers for Near-Infinite Context",
  sec. 3). Memory: two K/V blocks; communication hidden if a block's compute
  takes longer than its transfer.
* ``ulysses_attention``: an all-to-all turns sequence-split into head-split,
  each rank runs ordinary attention on the whole sequence for heads/cp heads,
  and a second all-to-all turns it back (Jacobs et al. 2023, "DeepSpeed
  Ulysses", sec. 3). Needs heads divisible by cp.

One mechanism per module, each opening with what it implements and its source:

* ``blocks``: one block's attention and log-sum-exp, the exact online-softmax
  merge of two blocks (Milakov & Gimelshein 2018), the causal mask, the work
  per rank, and the input checks all three share;
* ``allgather``: ``allgather_attention`` and ``attention_saved_bytes``;
* ``ring``: ``ring_attention`` (forward and backward on the ring),
  ``ring_forward`` with its time line, ``ring_shift``;
* ``ulysses``: ``ulysses_attention`` over ``helpers.collectives.alltoall``;
* ``torch_cp``: ``torch_context_parallel``, PyTorch's own, for comparison.

The all-gather and all-to-all variants rely on autograd, with the conjugate
collectives as backward (reduce-scatter for all-gather, the reverse
all-to-all for all-to-all); ring attention has its own ring backward.
Everything is re-exported here, and by ``helpers.sp``.
"""

from helpers.sp.attention.allgather import allgather_attention, attention_saved_bytes
from helpers.sp.attention.blocks import (block_attention, causal_mask, check_qkv, merge_partials,
                                         unmasked_scores)
from helpers.sp.attention.ring import (RingAttention, block_mask, ring_attention, ring_forward,
                                       ring_shift, wait_all)
from helpers.sp.attention.torch_cp import torch_context_parallel
from helpers.sp.attention.ulysses import check_ulysses, ulysses_attention

__all__ = ["block_attention", "merge_partials", "allgather_attention", "ring_attention",
           "ring_forward", "ring_shift", "wait_all", "block_mask", "ulysses_attention",
           "check_ulysses", "causal_mask", "unmasked_scores", "attention_saved_bytes",
           "torch_context_parallel", "RingAttention", "check_qkv"]
