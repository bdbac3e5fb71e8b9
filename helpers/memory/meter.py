"""Two meters: the bytes autograd keeps for backward, and the CUDA allocator's peak.

Measured, not guessed: ``SavedTensorCounter`` installs
``torch.autograd.graph.saved_tensors_hooks`` and sees every tensor autograd
keeps for backward, attributed to the module that saved it, de-duplicated by
storage (two views of one buffer cost one buffer), parameters excluded (they
are model state: ``formulas.model_state_bytes``).

Every storage's life is logged as it becomes alive and dies, so the counter
also gives the most bytes held at once (``peak_bytes``), per owner when a
caller names owners (the pipeline's stash, chapter 12: ``helpers.pipeline.stash``).
``accounting.explain_saved_bytes`` derives the same total by hand for our GPT
(chapter 06 shows the two agree to the byte).

Source: PyTorch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``,
the "Hooks for saved tensors" note of the autograd docs) and module forward
hooks (``register_forward_hook(..., always_call=True)``), as in torch 2.x (the
course pins 2.13.0).

What the counter does not see, a GPU shows in three views, each holding the one
before (torch 2.13, ``torch/cuda/memory.py``):

* *allocated* (``torch.cuda.memory_allocated``, ``max_memory_allocated``): every
  tensor the caching allocator handed out, temporaries included, each rounded up
  to the allocator's block size (``memory_stats``' ``requested_bytes`` is the
  unrounded figure). ``cuda_peak_bytes`` reads its peak around a call;
* *reserved* (``torch.cuda.memory_reserved``): what the allocator took from the
  driver and keeps, including freed blocks it caches and the unusable remainders
  of split blocks, i.e. fragmentation. It is not in *allocated*;
* the *driver's view* (``torch.cuda.mem_get_info``, ``nvidia-smi``): adds what
  lives outside PyTorch's allocator, the CUDA context (hundreds of MB per process)
  and buffers libraries allocate themselves (NCCL's). ``memory_allocated``'s own
  note: it is "likely less than the amount shown in nvidia-smi since some unused
  memory can be held by the caching allocator and some context needs to be
  created on GPU".

``cuda_memory_views`` reads all three around a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["SavedRecord", "SavedTensorCounter", "count_saved_bytes", "cuda_peak_bytes",
           "cuda_memory_views"]


# ---------------------------------------------------------------------------
# Measured: what autograd actually keeps
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One tensor handed to autograd for backward."""

    module: str            # innermost module running when it was saved ("<top>" if none)
    shape: tuple
    dtype: torch.dtype
    nbytes: int            # bytes it adds: 0 for a parameter or a storage already counted
    storage_bytes: int     # bytes of the whole storage it keeps alive
    is_param: bool         # a parameter (or a tensor in ``exclude``): not counted
    in_backward: bool      # saved while backward ran (a recompute), not by the forward


class _Held:
    """What the pack hook returns: owning it is owning the saved tensor, so its
    death (autograd frees saved tensors as soon as their node has run) tells
    us when the bytes are released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
        return id(t), t.numel() * t.element_size()


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class SavedTensorCounter:
    """Count the bytes autograd saves for backward, per module or per owner.

        with SavedTensorCounter(model) as c:
            loss = model(x, y)[1]
        c.total_bytes, c.by_module()
        loss.backward()        # inside or outside the block
        c.peak_bytes           # most bytes held at once (forward + recompute in backward)

    Counted once per storage (views share memory), parameters excluded (model
    state, not activations), and any tensor in ``exclude`` too (a batch that
    lives whatever happens). ``total_bytes`` is what the forward leaves for
    backward; ``peak_bytes`` also sees tensors a recompute saves during
    backward, released as backward consumes them. Keep the backward call inside
    the ``with`` block to let the counter see the recompute.

    Owners (the pipeline's stash, chapter 12): ``with c.saving(owner):``
    counts what autograd saves inside the block as ``owner``'s (for example
    ``(micro-batch, chunk)``), and ``c.hold(owner, t)`` counts a tensor the
    caller keeps itself until that tensor object dies. A storage belongs to
    the owner that first made it alive. Every time a storage becomes alive or
    dies, ``log`` gets ``(owner, +bytes or -bytes)``; ``unit_bytes`` and
    ``peaks`` read it (see ``helpers.pipeline.stash``).
    """

    def __init__(self, model: nn.Module | None = None, exclude=()):
        self.model = model
        self.records: list[SavedRecord] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.log: list[tuple] = []               # (owner, +bytes | -bytes), in time order
        self._live: dict[int, list] = {}          # storage ptr -> [holders alive, bytes, owner]
        self._seen_forward: set[int] = set()
        self._stack = ["<top>"]
        self._owner = None                        # set inside saving(owner)
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._skip: set[int] = {_storage(t)[0] for t in exclude}

    # -- context manager --------------------------------------------------
    def __enter__(self) -> "SavedTensorCounter":
        if self.model is not None:
            self._skip |= {_storage(p)[0] for p in self.model.parameters()}
            for name, mod in self.model.named_modules():
                if not name:
                    continue
                self._handles.append(mod.register_forward_pre_hook(
                    lambda m, args, name=name: self._stack.append(name)))
                self._handles.append(mod.register_forward_hook(
                    lambda m, args, out: self._pop(), always_call=True))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pop(self) -> None:
        self._stack.pop()   # returns None, so the module's output is left alone

    @contextlib.contextmanager
    def saving(self, owner):
        """Count what autograd saves inside this block as ``owner``'s."""
        outer, self._owner = self._owner, owner
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._owner = outer

    def hold(self, owner, t: torch.Tensor) -> None:
        """Count ``t`` as ``owner``'s until the tensor object is freed."""
        ptr, size = _storage(t)
        if ptr in self._skip or size == 0:
            return
        self._acquire(ptr, size, owner)
        weakref.finalize(t, self._release, ptr)

    # -- hooks ------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        ptr, size = _storage(t)
        skipped = ptr in self._skip or size == 0
        backward = _in_backward()
        new = not skipped and not backward and ptr not in self._seen_forward
        if new:
            self._seen_forward.add(ptr)
        self.records.append(SavedRecord(self._stack[-1], tuple(t.shape), t.dtype,
                                        size if new else 0, size, skipped, backward))
        if skipped:
            return t
        # hold a detached alias (same memory): the tensor itself may be the output
        # of the op that saves it, and holding it would tie our handle, the tensor
        # and its graph into a cycle the collector cannot see through autograd
        held = _Held(t.detach())
        self._acquire(ptr, size, self._stack[-1] if self._owner is None else self._owner)
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _acquire(self, ptr: int, size: int, owner) -> None:
        entry = self._live.setdefault(ptr, [0, size, owner])
        if entry[0] == 0:
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.log.append((entry[2], size))
        entry[0] += 1

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            self.log.append((entry[2], -entry[1]))
            del self._live[ptr]

    # -- results ----------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes the forward pass left for backward (unique storages, no parameters)."""
        return sum(r.nbytes for r in self.records)

    def by_module(self, depth: int | None = None) -> dict[str, int]:
        """{module name: bytes}, in forward order; ``depth`` truncates dotted names
        (depth=2: ``blocks.0.attn.c_attn`` -> ``blocks.0``)."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.nbytes:
                key = ".".join(r.module.split(".")[:depth]) if depth else r.module
                out[key] = out.get(key, 0) + r.nbytes
        return out

    def unit_bytes(self, group: Callable = lambda owner: owner[1]) -> dict:
        """Bytes one owner's forward made alive, per group of owners (default:
        per chunk, for owners (micro-batch, chunk)); the largest owner of each."""
        full: dict = {}
        for owner, delta in self.log:
            if delta > 0:
                full[owner] = full.get(owner, 0) + delta
        units: dict = {}
        for owner, b in full.items():
            units[group(owner)] = max(units.get(group(owner), 0), b)
        return units

    def peaks(self, group: Callable = lambda owner: owner[1]) -> tuple[int, float]:
        """(most bytes alive at once, most owners' worth alive at once), where an
        owner counts by the share of its group's unit (``unit_bytes``) still alive."""
        units = self.unit_bytes(group)
        live = dict.fromkeys(units, 0)      # bytes alive per group
        total = peak_bytes = 0
        peak_units = 0.0
        for owner, delta in self.log:
            live[group(owner)] += delta
            total += delta
            peak_bytes = max(peak_bytes, total)
            peak_units = max(peak_units, sum(live[g] / units[g] for g in units))
        return peak_bytes, peak_units


def count_saved_bytes(model: nn.Module, *args, **kwargs) -> SavedTensorCounter:
    """Run ``model(*args, **kwargs)`` (forward only) under a counter and return it."""
    with SavedTensorCounter(model) as counter:
        model(*args, **kwargs)
    return counter


# ---------------------------------------------------------------------------
# The allocator's view
# ---------------------------------------------------------------------------

def cuda_peak_bytes(fn: Callable[[], object], device=None) -> int | None:
    """``torch.cuda.max_memory_allocated`` around ``fn()``; None without CUDA.

    The allocated view: activations *plus* weights, gradients, temporaries and
    rounding to the allocator's block sizes, minus the bytes held before ``fn``.
    Not in it: the allocator's cached free blocks (fragmentation) and the CUDA
    context (``cuda_memory_views``, the module docstring).
    """
    views = cuda_memory_views(fn, device)
    return None if views is None else views["allocated_peak"]


def cuda_memory_views(fn: Callable[[], object], device=None) -> dict[str, int] | None:
    """The three views of the module docstring around ``fn()``, in bytes; None without
    CUDA: ``allocated_peak`` (the most bytes tensors held during ``fn``, above what they
    held before), ``reserved_peak`` (the most the caching allocator held from the
    driver), ``reserved_unused`` (reserved minus allocated after ``fn``: cached blocks,
    fragmentation), ``driver_used`` (total minus free per ``cudaMemGetInfo``: the context,
    other libraries' buffers and every process on the GPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_peak": torch.cuda.max_memory_allocated(device) - before,
            "reserved_peak": torch.cuda.max_memory_reserved(device),
            "reserved_unused": torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device),
            "driver_used": total - free}
