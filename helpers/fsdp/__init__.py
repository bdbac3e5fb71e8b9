"""FSDP: fully sharded data parallelism, one unit of modules at a time (chapter 15).

FSDP is ZeRO stage 3 (``helpers.zero.stage3``) organised around *units*
(Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", sec. 3): a policy picks modules (each transformer block), each
unit's parameters are flattened, padded and sharded over the ranks, and a
unit is gathered just before it runs and freed right after. Its gradients
are reduce-scattered, so each rank keeps the average of its own chunk, which
``torch.optim.AdamW(fsdp.parameters())`` updates.

Read it in the order chapter 15 teaches it, one file per part:

1. ``wrap``: ``FSDP(model)`` picks the units (the root takes what the
   policy left and every weight two units share), shards them, registers the
   hooks, and ``unwrap()`` undoes it; ``torch_fsdp2``, the yardstick
   (sections "Units", "Why units").
2. ``unit``: a unit's life in one step: gather, the parameters' views into
   the buffer, free, prefetch (sections "One step of a unit's life",
   "The knob: reshard after forward").
3. ``grads``: the reduce-scatter of each unit's gradients, clipping over the
   shards, mixed precision, ignored parameters (sections "Same training as
   DDP and as PyTorch's FSDP2", "Mixed precision and ignored parameters").
4. ``hybrid``: the (replicate, shard) groups of hybrid sharding (section
   "Hybrid sharding on 4 ranks").

Why a package of parts and one class: a unit's life and its gradients act on
the same units at the same moments of a step (a unit's reduce-scatter ends
with its free, a backward's first gather queues the end-of-backward step), so
``FSDP`` stays one ``nn.Module`` whose methods come from two mixins,
``UnitLife`` and ``ShardedGrads``; ``FSDP.__init__`` in ``wrap`` sets every
attribute they share. Each file reads on its own beside its section. The
names a chapter imports come from here: ``from helpers.fsdp import FSDP``.

How production differs: PyTorch's FSDP2 (``fully_shard``) shards each
parameter separately as a DTensor along dim 0 (no flat buffer, so per-
parameter optimizers and state dicts are easy), uses CUDA streams and events
so gathers really run beside compute, offloads to CPU, and copies in and
out with fused kernels. FSDP1 used flat parameters like this package: one
process group per role, no offload.
"""

from helpers.fsdp.grads import GradShard
from helpers.fsdp.hybrid import hybrid_grid, hybrid_groups
from helpers.fsdp.unit import Unit, next_unit_prefetch
from helpers.fsdp.wrap import FSDP, block_policy, torch_fsdp2

__all__ = ["FSDP", "GradShard", "Unit", "hybrid_grid", "hybrid_groups", "block_policy",
           "next_unit_prefetch", "torch_fsdp2"]
