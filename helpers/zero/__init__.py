"""ZeRO: shard the optimizer state, then the gradients, then the weights.

Plain data parallelism (DP) keeps a full copy of the *model state* on every
rank: weights, gradients and Adam's state. With mixed precision that is 16
bytes per parameter (2 bf16 weights + 2 bf16 grads + 12 for the fp32 master
copy and the two Adam moments), and N_d ranks hold N_d identical copies.
ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", sec. 5) removes the copies one part at a time:

    stage 0 (DP)  every rank: all 16 bytes/param           16 Psi
    stage 1       optimizer state sharded (P_os)            4 Psi + 12 Psi / N_d
    stage 2       + gradients sharded     (P_os+g)          2 Psi + 14 Psi / N_d
    stage 3       + weights sharded       (P_os+g+p)        16 Psi / N_d

(sec. 5.1, Figure 1; ``helpers.memory.model_state_bytes`` is the formula and
``ZeroOptimizer.state_bytes()`` measures the tensors this module really holds.)

How each stage works here
-------------------------
All trainable parameters are laid out in **flat buffers**. The buffer is cut
into buckets (stage 0-2: by size, in reverse registration order, about the
order backward produces gradients; stage 3: one bucket per module that owns
parameters). Each bucket is padded to a multiple of N_d so it splits into N_d
equal chunks, and rank r owns chunk r of every bucket. Padding is zeros and
stays zero under AdamW; it costs at most N_d - 1 elements per bucket. Every
buffer lives on the parameters' device (CPU with gloo, the rank's GPU with
nccl), so the same code runs on both. This layout (buckets padded, chunk r of
each) is PyTorch FSDP1's flat parameter. DeepSpeed lays it out otherwise:
ZeRO-1/2 flatten each parameter group once and give rank r one contiguous
1/N_d of the whole of it (one partition boundary per rank, not per bucket),
and ZeRO-3 partitions each parameter on its own. The bytes per rank and the
communication volume are the same; what differs is which elements a rank
owns and how many pieces a collective moves.

* stage 0: gradients all-reduced (averaged), every rank runs AdamW on all of
  it. This is DP, kept for comparison.
* stages 0-1 average the gradients inside ``step()`` (or
  ``clip_grad_norm_()``), not during backward: between ``backward()`` and
  ``step()`` each ``p.grad`` holds this rank's *local* gradient, where DDP's
  would already hold the average. Read gradients after ``step()``'s
  reduction, or use stage 2-3's shards, if you need the average.
* stage 1: every rank still computes the full gradient. ``step()``
  reduce-scatters it (rank r receives the average of chunk r), updates its
  chunk of the fp32 master weights with Adam moments it alone holds, then
  all-gathers the updated chunks so every rank has the new full weights.
  Reduce-scatter + all-gather move the same bytes as one all-reduce
  (sec. 7.2.1), so stage 1 is free in communication.
* stage 2: the same, but each bucket is reduce-scattered *during backward*,
  as soon as its gradients exist (like DDP's buckets), and the full-size
  gradients are dropped right after: a rank keeps only its gradient chunk.
* stage 3: a rank keeps only its chunk of the weights too. A forward
  pre-hook on each module all-gathers that module's parameters just before it
  runs, a forward hook frees them after; a hook on the module's output
  gathers them again when backward reaches the module, and once all of the
  module's gradients have been accumulated they are reduce-scattered and the
  parameters freed. Each parameter is gathered twice per step and its
  gradient reduce-scattered once: 1.5x DP's volume (sec. 7.2.2).

"Freeing" keeps the parameter tensors (autograd saved them, some as views)
and shrinks their shared storage to 0 bytes; gathering grows it back and
fills it. That is how PyTorch's first FSDP did it.

Gradients: accumulation and who clears them
-------------------------------------------
Several ``backward()`` calls before one ``step()`` accumulate, as with any
PyTorch optimizer (chapter 05's micro-batches; scale each loss by 1/accum).
In stages 0-1 autograd adds into the flat gradient buffer. In stages 2-3
every backward reduce-scatters its own buckets and *adds* the result into
the rank's gradient shard (the full gradients are gone by then); the end of
each backward waits for those reduce-scatters (a callback queued on the
autograd engine, as DDP does). This is what DeepSpeed's stages 2-3 do: one
reduce-scatter per micro-batch, no ``no_sync``.

``step()`` consumes the gradients it applies: afterwards every stage's
gradient buffer or shard is zero. A stage-2/3 rank cannot notice
``model.zero_grad()`` (its ``.grad`` fields are already None; the shard is
not a ``.grad``), so clearing in ``step()`` is the only rule that makes
``opt.zero_grad()``, ``model.zero_grad()`` and no zero_grad at all train the
same in every stage. DeepSpeed's engine does the same (its ``step()`` zeroes
the gradients). In stages 0-1 ``model.zero_grad()`` sets each ``p.grad``
to None, which cuts it off from the flat buffer; the next backward then
writes a fresh tensor, and a post-accumulate hook copies it back into the
buffer and re-links ``p.grad`` (``step()`` checks the links once more).

Precision: ``precision="fp32"`` (default) keeps weights, gradients and
moments in fp32 with no separate master copy (8 optimizer bytes/param), so a
run can be compared with ``torch.optim.AdamW`` op for op. Equal to what? To
DDP's recipe on the same ranks, bitwise on 2 ranks. Not to one process on
the global batch: that process sums the per-example gradients in one
reduction, N ranks sum B examples each and then the N partial sums, and fp32
addition is not associative. The two agree to fp32 rounding carried through
AdamW, not bit for bit (FSDP2 behaves the same way); ``tests/test_zero.py``
derives that bound against a float64 run. ``"bf16"`` or
``"fp16"`` is the paper's setting: 16-bit working weights and gradients
(also communicated in 16 bits), fp32 master weights and moments (12
bytes/param). There is no loss scaling here; fp16 in production needs it.

``comm_bytes()`` counts, per collective, the bytes one rank *sends* in the
last step under the ring algorithm's cost (reduce-scatter or all-gather of B
bytes: (N-1)/N * B; all-reduce: 2 (N-1)/N * B; Patarasuk & Yuan 2009). Gloo
does not report what it sends; the tensor sizes are real, the algorithm is
the model.

Stage 3 with fewer, larger collectives: ``prefetch_bucket_numel``,
``max_reuse_numel`` and ``reduce_bucket_numel`` are DeepSpeed's prefetch,
reuse-distance and reduce-bucket knobs (off by default, so chapter 14 sees one
collective per module); ``prefetch.py`` explains them.

How production differs: DeepSpeed's ZeRO adds CPU/NVMe offload, contiguous
memory defragmentation, keeping small parameters unpartitioned
(``stage3_param_persistence_threshold``) and dynamic loss scaling.
``ZeroOptimizer`` applies one set of AdamW hyperparameters to every
parameter, as ``torch.optim.AdamW(model.parameters())`` does;
``ShardedOptimizer`` (stages 1-2) takes parameter groups and any elementwise
``torch.optim`` optimizer, as ``ZeroRedundancyOptimizer`` does. Frozen
parameters and buffers are replicated, never sharded (rank 0's copies are
broadcast at construction, as DDP does).

Unused parameters, as DDP: a trainable parameter that got a gradient on some
rank but not on another is averaged with zeros from the others; one that got
no gradient on any rank is skipped by AdamW (no weight decay, no momentum, its
step count not advanced), as ``torch.optim`` skips a ``.grad`` that DDP left
None. Each ``step()`` all-reduces one flag per parameter to know (DDP
all-reduces the same "used" bitmap with ``find_unused_parameters=True``).
Stage 3 needs more: a module's forward all-gathers its weights, a collective,
so every rank must run the same modules in the same order (FSDP and
DeepSpeed's ZeRO-3 require the same); a module no rank runs is fine.

Where to read what (each file stands on its own)
-----------------------------------------------
* ``partition.py``: the flat buffer cut into padded buckets, chunk r to rank r;
  ``owned_ranges`` says which elements of each parameter a rank owns.
* ``adamw.py``: the one AdamW update every stage applies to its chunks.
* ``base.py``: ``ZeroOptimizer``, what all stages share (step, clipping
  through ``helpers.clip``, unused parameters, measurements);
  ``ZeroOptimizer(model, stage)`` returns the stage's class, looked up in
  ``STAGE_CLASSES``, which this file fills.
* ``stages.py``: stages 0, 1, 2, each a short class.
* ``reduce_in_backward.py``: stages 2-3's reduce-scatter during backward.
* ``stage3.py``: stage 3's units, gathered and freed around each module.
* ``prefetch.py``: stage 3's optional prefetch and reuse (DeepSpeed's knobs).
* ``sharded.py``: ``ShardedOptimizer``, stages 1-2 around any torch optimizer.
* ``helpers.comm``: the collectives, their ring cost, freeing storage.
"""

from helpers.comm import all_gather, reduce_scatter, ring_bytes_sent
from helpers.zero.adamw import adamw_update
from helpers.zero.base import PRECISION_DTYPES, STAGE_CLASSES, ZeroOptimizer
from helpers.zero.partition import Bucket, FlatPartition, OwnedRange, size_buckets
from helpers.zero.sharded import ShardedOptimizer
from helpers.zero.stage3 import LEAF_MODULES, ZeroStage3
from helpers.zero.stages import ZeroStage0, ZeroStage1, ZeroStage2

# The stage dispatch: ZeroOptimizer(model, stage) returns an instance of this
# stage's class (base.py imports no stage, so no import runs in a circle).
STAGE_CLASSES.update({0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3})

__all__ = ["ZeroOptimizer", "ShardedOptimizer", "FlatPartition", "Bucket", "OwnedRange",
           "size_buckets", "ring_bytes_sent", "adamw_update", "reduce_scatter", "all_gather",
           "PRECISION_DTYPES",
           "ZeroStage0", "ZeroStage1", "ZeroStage2", "ZeroStage3", "LEAF_MODULES"]
