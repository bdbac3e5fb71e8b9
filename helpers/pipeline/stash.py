"""Measure the activations a pipeline rank holds for its backwards ("the stash").

A forward pass leaves tensors alive for the backward: autograd saves the inputs
of matmuls, softmax outputs, LayerNorm statistics and so on, and the executor
keeps each micro-batch's input and output. The schedule decides how many
micro-batches' worth of them a rank holds at once: m for GPipe, p - i on stage
i for 1F1B (chapter 12). The simulator *counts* that from the order of the
actions; ``StashMeter`` *measures* it from the tensors that are really alive.

How: inside ``meter.saving(owner)`` every tensor autograd saves passes through
``torch.autograd.graph.saved_tensors_hooks``. The pack hook records its bytes
and hands autograd a small handle instead of the tensor; autograd keeps the
handle until the backward that needs it has run (or the graph is dropped), and
when the handle dies the bytes are released. ``meter.hold(owner, t)`` does the
same for a tensor the executor keeps itself, through a weak reference: the
bytes go when the tensor object goes. So the meter follows what stays alive,
whatever the executor's bookkeeping says: a micro-batch whose graph is never
freed keeps counting.

Counting rules. A memory region (address, bytes) counts once however many
saved tensors view it, and never if it belongs to a parameter, a buffer or the
caller's batch (they live whatever the schedule). A region belongs to the
owner, (micro-batch, chunk), whose forward saved it first. ``peak_bytes`` is
the most bytes alive at any moment. ``peak_microbatches`` is the most
micro-batches alive at any moment, where each owner counts by the fraction of
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

import contextlib
import weakref
from typing import Hashable, Iterable

import torch

__all__ = ["StashMeter"]


class _Saved:
    """What autograd holds instead of a saved tensor; releases its bytes when dropped."""
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "StashMeter", key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class StashMeter:
    """Bytes of activations held for backward, per owner, over time."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        # storages that live regardless of the schedule: parameters, buffers, the batch
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        # (address, bytes) -> [owner, bytes, holders]
        self._regions: dict[tuple[int, int], list] = {}
        self._log: list[tuple[Hashable, int]] = []       # (owner, +bytes | -bytes), in time order

    def _add(self, owner: Hashable, t: torch.Tensor):
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.untyped_storage().data_ptr() in self._skip:
            return None
        key = (t.data_ptr(), nbytes)
        entry = self._regions.get(key)
        if entry is None:
            self._regions[key] = [owner, nbytes, 1]
            self._log.append((owner, nbytes))
        else:
            entry[2] += 1
        return key

    def _release(self, key) -> None:
        if key is None:
            return
        entry = self._regions[key]
        entry[2] -= 1
        if entry[2] == 0:
            del self._regions[key]
            self._log.append((entry[0], -entry[1]))

    @contextlib.contextmanager
    def saving(self, owner: Hashable):
        """Count what autograd saves inside this block as ``owner``'s."""
        def pack(t: torch.Tensor):
            # keep a detached alias (same memory): the tensor itself may be the output of
            # the op that saves it, and holding it would tie our handle, the tensor and
            # its graph into a cycle that Python's collector cannot see through autograd
            return _Saved(t.detach(), self, self._add(owner, t))

        def unpack(handle: _Saved) -> torch.Tensor:
            return handle.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def hold(self, owner: Hashable, t: torch.Tensor) -> None:
        """Count ``t`` as ``owner``'s until the tensor object is freed."""
        key = self._add(owner, t)
        if key is not None:
            weakref.finalize(t, self._release, key)

    @property
    def live_bytes(self) -> int:
        return sum(e[1] for e in self._regions.values())

    def unit_bytes(self, group=lambda owner: owner[1]) -> dict:
        """Bytes one owner's forward holds, per group of owners (default: per chunk,
        for owners (micro-batch, chunk)); the largest owner of each group."""
        full: dict = {}
        for owner, delta in self._log:
            if delta > 0:
                full[owner] = full.get(owner, 0) + delta
        units: dict = {}
        for owner, b in full.items():
            units[group(owner)] = max(units.get(group(owner), 0), b)
        return units

    def peaks(self, group=lambda owner: owner[1]) -> tuple[int, float]:
        """(most bytes alive at once, most micro-batches alive at once)."""
        units = self.unit_bytes(group)
        live = dict.fromkeys(units, 0)      # bytes alive per group
        total = peak_bytes = 0
        peak_mb = 0.0
        for owner, delta in self._log:
            live[group(owner)] += delta
            total += delta
            peak_bytes = max(peak_bytes, total)
            peak_mb = max(peak_mb, sum(live[g] / units[g] for g in units))
        return peak_bytes, peak_mb
