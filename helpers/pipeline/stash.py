"""Measure the activations a pipeline rank holds for its backwards ("the stash").

A forward pass leaves tensors alive for the backward: autograd saves the inputs
of matmuls, softmax outputs, LayerNorm statistics and so on, and the executor
keeps each micro-batch's input and output. The schedule decides how many
micro-batches' worth of them a rank holds at once: m for GPipe, p - i on stage
i for 1F1B (chapter 12). The simulator *counts* that from the order of the
actions; ``StashMeter`` *measures* it from the tensors that are really alive.

How: the meter is chapter 06's ``helpers.memory.SavedTensorCounter`` (one
counter for both chapters), used with owners. Inside ``meter.saving(owner)``
every tensor autograd saves passes through
``torch.autograd.graph.saved_tensors_hooks``. The pack hook records its bytes
and hands autograd a small handle instead of the tensor; autograd keeps the
handle until the backward that needs it has run (or the graph is dropped), and
when the handle dies the bytes are released. ``meter.hold(owner, t)`` does the
same for a tensor the executor keeps itself, through a weak reference: the
bytes go when the tensor object goes. So the meter follows what stays alive,
whatever the executor's bookkeeping says: a micro-batch whose graph is never
freed keeps counting.

Counting rules. A storage counts once however many saved tensors view it,
and never if it belongs to a parameter, a buffer or the caller's batch (they
live whatever the schedule: ``exclude``). A storage belongs to the owner,
(micro-batch, chunk), whose forward made it alive first. ``meter.peaks()``
returns the most bytes alive at any moment and the most micro-batches alive
at any moment, where each owner counts by the fraction of
its forward's bytes still alive: 1 from the end of its forward to the start of
its backward, falling to 0 during the backward. For one chunk per rank that is
bytes / bytes-per-micro-batch; with v chunks, each chunk's bytes are divided
by that chunk's own bytes per micro-batch, because the chunks differ (the
first holds the embedding, the last the LM head and the loss).

Not counted: a sent tensor that the executor keeps alive until its send has
completed (``StepResult.peak_pending_sends`` counts those); memory inside
autograd's C++ nodes other than saved tensors; allocator caching.

How production differs: on GPUs one reads the allocator
(``torch.cuda.memory_allocated``, ``torch.cuda.memory._snapshot``), which sees
everything at once; Megatron-LM frees each sent output's data right after
sending it ("deallocate_output_tensor"), so its stash is the saved tensors
alone.
"""

from __future__ import annotations

from helpers.memory import SavedTensorCounter

__all__ = ["StashMeter"]

# The pipeline's name for the counter: bytes held for backward, per
# (micro-batch, chunk) owner, over time (``peaks``, ``unit_bytes``).
StashMeter = SavedTensorCounter
