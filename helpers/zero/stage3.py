"""ZeRO stage 3: each rank keeps only its chunk of the weights too.

Here the flat partition has one bucket (a *unit*) per module that owns
parameters. A unit's full weights exist only while they are needed:

* forward: a pre-hook on the module all-gathers its unit just before it
  runs; a forward hook frees it right after;
* backward: a hook on the module's output (one multi-grad hook over every
  tensor in it, so a module returning a tuple works) gathers the unit again
  when backward reaches the module; once all the unit's gradients exist they
  are reduce-scattered (``reduce_in_backward``) and the weights freed.

Each parameter is gathered twice per step and its gradient reduce-scattered
once: 1.5x DP's volume (ZeRO sec. 7.2.2). A weight tied between two modules
(the GPT's embedding and head) lives in the first module's unit; the second
module gathers that unit as well.

The gather/free itself (the unit's flat buffer, its asynchronous all-gather,
the forward and backward hooks) is ``helpers.unit_gather``, the same code
``helpers.fsdp`` runs; what is ZeRO-3's own is which module needs which
units, and when a unit may go. "Freeing" keeps the parameter tensors
(autograd saved them, some as views) and shrinks their shared storage to 0
bytes; gathering grows it back and fills it, as PyTorch's first FSDP did.
``prefetch.py`` adds DeepSpeed's knobs for fewer, larger collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from helpers.zero.base import ZeroOptimizer
from helpers.zero.prefetch import PrefetchMixin
from helpers.zero.reduce_in_backward import ReduceScatterInBackward
from helpers.unit_gather import UnitBuffer, register_unit_hooks, start_gather

__all__ = ["ZeroStage3", "LEAF_MODULES"]

# Modules whose forward reads their children's parameters without calling the
# children (nn.MultiheadAttention passes out_proj.weight to a functional): one
# stage-3 unit for the whole subtree. DeepSpeed's set_z3_leaf_modules does the same.
LEAF_MODULES: tuple[type, ...] = (nn.MultiheadAttention,)


def _unit_modules(model: nn.Module):
    """The model's modules in pre-order, each once, without descending into a
    module of ``LEAF_MODULES``."""
    seen: set[int] = set()

    def walk(module):
        if id(module) in seen:
            return
        seen.add(id(module))
        yield module
        if not isinstance(module, LEAF_MODULES):
            for child in module.children():
                yield from walk(child)
    return walk(model)


class ZeroStage3(ReduceScatterInBackward, PrefetchMixin, ZeroOptimizer):
    """Stage 3: weights, gradients and optimizer state all sharded."""

    def _bucket_groups(self, numels, cap):
        return self._module_groups()

    def _module_groups(self) -> list[list[int]]:
        """Stage 3: one bucket per module that directly owns trainable params (a
        module of ``LEAF_MODULES`` owns its whole subtree's)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        groups, seen = [], set()
        self._module_units: list[tuple[nn.Module, list[int]]] = []
        for module in _unit_modules(self.model):
            mine = []
            units_needed = []
            for p in module.parameters(recurse=isinstance(module, LEAF_MODULES)):
                if id(p) not in index:
                    continue
                if id(p) not in seen:
                    seen.add(id(p))
                    mine.append(index[id(p)])
                else:  # a tied weight owned by an earlier module
                    units_needed.append(id(p))
            if mine:
                groups.append(mine)
            if mine or units_needed:
                self._module_units.append((module, mine and [len(groups) - 1] or [], units_needed))
        return groups

    def _setup(self) -> None:
        part, r = self.partition, self.rank
        self.param_shard = self._zeros(part.shard_numel)
        self.grad_shard = self._zeros(part.shard_numel)
        self.units: list[UnitBuffer] = []  # one per bucket: its full weights, when gathered
        for b in part.buckets:
            full = self._zeros(b.padded)
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                seg = full[off:off + p.numel()]
                seg.copy_(p.detach().reshape(-1))
                p.data = seg.view_as(p)  # from now on p is a window into `full`
            self._broadcast(full)
            self.param_shard[b.shard_start:b.shard_start + b.chunk].copy_(
                full[r * b.chunk:(r + 1) * b.chunk])
            unit = UnitBuffer(full)
            unit.free()  # the full weights exist only while a module runs
            self.units.append(unit)
        self._param_chunks = [self.param_shard[b.shard_start:b.shard_start + b.chunk]
                              for b in part.buckets]
        self._init_optimizer_state(self._param_chunks)
        owner = {}
        for bi, b in enumerate(part.buckets):
            for i in b.params:
                owner[id(self.params[i])] = bi
        for module, own, tied in self._module_units:
            units = sorted(set(own) | {owner[t] for t in tied})
            self._hooks += register_unit_hooks(
                module, before_forward=self._gather_units(units),
                after_forward=lambda units=units: self._release_units(units),
                before_backward=self._gather_units(units))
        self._install_grad_hooks()
        self._init_trace()

    def _weight_tensors(self):
        return [self.param_shard] + [u.full for u in self.units]

    # ------------------------------------------------------------ gather/free
    def _gather_units(self, units: list[int]):
        def gather(*args):  # forward pre-hook (args, kwargs) or backward (no args)
            for bi in units:
                self._gather_unit(bi)
        return gather

    def _release_units(self, units: list[int]) -> None:
        for bi in units:
            self._release(bi)

    def _gather_unit(self, bi: int) -> None:
        """A module needs unit ``bi``'s full weights: make sure they are there,
        then (with prefetch on) start gathering the units the trace says come next."""
        upcoming = self._follow_trace(bi)
        self._ensure_gathered(bi)
        if self.prefetch_bucket_numel and upcoming:
            self._prefetch(upcoming)

    def _ensure_gathered(self, bi: int) -> None:
        if not self.units[bi].gathered:
            self._start_gather([bi])
        self.units[bi].wait()  # prefetched: usually already arrived

    def _start_gather(self, units: list[int]) -> None:
        """One asynchronous all-gather of ``units`` (coalesced if several)."""
        name = f"all-gather {units[0]}" + (f"..{units[-1]}" if len(units) > 1 else "")
        start_gather([self.units[j] for j in units], [self._param_chunks[j] for j in units],
                     self.group, self.world, self.timeline, name)
        nbytes = sum(self.partition.buckets[j].padded for j in units) * self.param_shard.element_size()
        self._count("all_gather", nbytes)

    def _release(self, bi: int) -> None:
        """A module is done with unit bi: free it, unless it is needed again soon."""
        if not self._reused_soon(bi):
            self.units[bi].free()  # (waits first for a gather still writing into it)

    def _bucket_done(self, bi: int) -> None:
        self._release(bi)  # the unit's gradients are sent: its weights can go

    # ------------------------------------------------------------------ step
    def _before_update(self) -> None:
        # Weights gathered ahead of a request that never came would be stale
        # after this update: drop them. The trace is complete after step 1.
        for bi in range(len(self.partition.buckets)):
            self.units[bi].free()
        self._restart_trace()

    @torch.no_grad()
    def remove_hooks(self) -> None:
        """Unwrap: gather the full weights and give each parameter its own storage
        again (a collective: call on every rank), then remove the hooks."""
        if self._hooks:
            for bi in range(len(self.partition.buckets)):
                self._ensure_gathered(bi)
            for p in self.params:
                p.data = p.detach().clone()  # out of the unit's storage, which is freed
            for bi in range(len(self.partition.buckets)):
                self.units[bi].free()
        super().remove_hooks()
