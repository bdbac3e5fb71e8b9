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

"Freeing" keeps the parameter tensors (autograd saved them, some as views)
and shrinks their shared storage to 0 bytes (``helpers.comm.free_storage``);
gathering grows it back and fills it, as PyTorch's first FSDP did.
``prefetch.py`` adds DeepSpeed's knobs for fewer, larger collectives.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from helpers.comm import all_gather, alloc_storage, free_storage, is_allocated
from helpers.zero.base import ZeroOptimizer
from helpers.zero.prefetch import PrefetchMixin
from helpers.zero.reduce_in_backward import ReduceScatterInBackward

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
        self.unit_full: list[torch.Tensor] = []
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
            free_storage(full)  # the full weights exist only while a module runs
            self.unit_full.append(full)
        self._param_chunks = [self.param_shard[b.shard_start:b.shard_start + b.chunk]
                              for b in part.buckets]
        self._init_optimizer_state(self._param_chunks)
        owner = {}
        for bi, b in enumerate(part.buckets):
            for i in b.params:
                owner[id(self.params[i])] = bi
        for module, own, tied in self._module_units:
            units = sorted(set(own) | {owner[t] for t in tied})
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward(units)))
            self._hooks.append(module.register_forward_hook(self._post_forward(units)))
        self._install_grad_hooks()
        self._inflight: dict[int, tuple] = {}  # unit -> its (work, units, output) all-gather
        self._init_trace()

    def _weight_tensors(self):
        return [self.param_shard] + self.unit_full

    # ------------------------------------------------------------ gather/free
    def gather_unit(self, bi: int) -> None:
        """A module needs unit ``bi``'s full weights: make sure they are there,
        then (with prefetch on) start gathering the units the trace says come next."""
        upcoming = self._follow_trace(bi)
        self._ensure_gathered(bi)
        if self.prefetch_bucket_numel and upcoming:
            self._prefetch(upcoming)

    def _ensure_gathered(self, bi: int) -> None:
        if bi in self._inflight:
            self._complete(self._inflight[bi])  # prefetched: usually already arrived
        elif not is_allocated(self.unit_full[bi]):
            self._complete(self._start_gather([bi]))

    def _start_gather(self, units: list[int]) -> tuple:
        """One asynchronous all-gather of ``units`` (coalesced if several)."""
        buckets = self.partition.buckets
        for j in units:
            alloc_storage(self.unit_full[j])
        name = f"all-gather {units[0]}" + (f"..{units[-1]}" if len(units) > 1 else "")
        if len(units) == 1:  # straight into the unit's storage
            inp, out = self._param_chunks[units[0]], self.unit_full[units[0]]
        else:  # rank-major layout: [rank 0: A, B, ... | rank 1: A, B, ... | ...]
            inp = torch.cat([self._param_chunks[j] for j in units])
            out = self._empty(self.world * inp.numel())
        work = self._issue(all_gather, out, inp, name)
        self._count("all_gather", sum(buckets[j].padded for j in units) * out.element_size())
        pending = (work, units, out, name)
        for j in units:
            self._inflight[j] = pending
        return pending

    def _complete(self, pending: tuple) -> None:
        """Wait for a gather and move coalesced results into each unit's storage."""
        work, units, out, name = pending
        if work is not None:
            self._wait(work, name)
        if len(units) > 1:
            columns, col = out.view(self.world, -1), 0
            for j in units:
                c = self.partition.buckets[j].chunk
                self.unit_full[j].view(self.world, c).copy_(columns[:, col:col + c])
                col += c
        for j in units:
            self._inflight.pop(j, None)

    def _release(self, bi: int) -> None:
        """A module is done with unit bi: free it, unless it is needed again soon."""
        if not self._reused_soon(bi):
            self.free_unit(bi)

    def free_unit(self, bi: int) -> None:
        if bi in self._inflight:  # never free storage a collective is writing into
            self._complete(self._inflight[bi])
        free_storage(self.unit_full[bi])

    def _pre_forward(self, units):
        def hook(module, args):
            for bi in units:
                self.gather_unit(bi)
        return hook

    def _post_forward(self, units):
        def hook(module, args, out):
            for bi in units:
                self._release(bi)
            # The output may be any pytree (nn.MultiheadAttention returns a tuple):
            # one hook over all its tensors that need a gradient, fired by the first
            # gradient that reaches any of them (FSDP2 does the same).
            outputs = [t for t in tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and outputs:
                register_multi_grad_hook(outputs, pre_backward, mode="any")
            return None

        def pre_backward(grad):
            # Fires when backward reaches this module's output: gather again.
            for bi in units:
                self.gather_unit(bi)
        return hook

    def _bucket_done(self, bi: int) -> None:
        self._release(bi)  # the unit's gradients are sent: its weights can go

    # ------------------------------------------------------------------ step
    def _before_update(self) -> None:
        # Weights gathered ahead of a request that never came would be stale
        # after this update: drop them. The trace is complete after step 1.
        for bi in range(len(self.partition.buckets)):
            self.free_unit(bi)
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
                free_storage(self.unit_full[bi])
        super().remove_hooks()
